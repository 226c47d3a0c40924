"""Consolidated checkpoints reach rank 0 on the CPU, one stage leader at a time
(strategy/part_stream.py, strategy/checkpoint.py).

Four gloo ranks run three plans in one process group (a straight 2-stage pipeline, 2x2 and
four stages; float64, Adam, clipping): three steps, a save, then a fresh stage resumed from
the file for three more. On every plan:

* what a sender hands to its send is on the CPU, also where the optimizer state claims a
  GPU (a tensor subclass that reports ``cuda:3``), and rank 0 ends with plain CPU tensors;
* rank 0's host memory during the save (every allocation, counted by the profiler) stays
  within the consolidated state plus the largest single part, and holds no staging copy;
* the file loads strictly into the plain module (the single-process parameters after three
  steps, Adam state included) and without CUDA, and the resumed run ends at the
  single-process parameters after six steps (1e-10).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from dist_harness import run_ranks
from lightning_dapple.strategy.part_stream import PartLane

STEPS = 3
LR = 1e-2
CLIP = 0.5
PLANS = {
    "straight-2": {"stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]},
    "2x2": {"stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}]},
    "4-stage": {
        "stages": [
            {"layers": [0, 1], "devices": [0]},
            {"layers": [1, 2], "devices": [1]},
            {"layers": [2, 3], "devices": [2]},
            {"layers": [3, 5], "devices": [3]},
        ]
    },
}
CPU_ONLY_LOAD = """
import sys, torch
from torch.utils import _pytree as pytree
assert not torch.cuda.is_available()
checkpoint = torch.load(sys.argv[1], map_location=None, weights_only=True)
print(",".join(sorted({leaf.device.type for leaf in pytree.tree_leaves(checkpoint) if isinstance(leaf, torch.Tensor)})))
"""


class OnAnotherDevice(torch.Tensor):
    """A CPU tensor that reports ``cuda:3``, as a GPU rank's optimizer state does; pickled,
    it comes back claiming ``cuda:3``. Only ``.cpu()`` gives a plain tensor back."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "OnAnotherDevice":
        return torch.Tensor._make_subclass(cls, data)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func == torch.Tensor.device.__get__:
            return torch.device("cuda", 3)
        if func is torch.Tensor.cpu:
            return args[0].as_subclass(torch.Tensor).to("cpu", copy=True)
        return super().__torch_function__(func, types, args, kwargs or {})


@dataclass(frozen=True)
class RecordingLane(PartLane):
    """The real lane, noting what each send is handed and the bytes of each receive."""

    sent: list = field(default_factory=list)
    received: list = field(default_factory=list)

    def send(self, tensor: torch.Tensor, destination: int, what: str) -> None:
        self.sent.append((type(tensor) is torch.Tensor, tensor.device.type))
        super().send(tensor, destination, what)

    def receive(self, tensor: torch.Tensor, source: int, what: str) -> None:
        self.received.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        super().receive(tensor, source, what)


class Net(nn.Module):
    """The toy MLP as the strategy sees a LightningModule: its layers under two names (as
    ``self.model.layers``, too) and a buffer outside them, which rank 0 saves."""

    def __init__(self) -> None:
        super().__init__()
        import toy_models

        torch.manual_seed(1234)
        self.layers = toy_models.mlp_layers().double()
        self.model = nn.Module()
        self.model.layers = self.layers
        self.register_buffer("outside", torch.arange(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _mlp_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


def _named_adam_state(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): name for name, p in net.named_parameters()}
    return {names[id(p)]: dict(state) for p, state in optimizer.state.items()}


def reference(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Plain single-process training: the state dict and the Adam state by parameter name."""
    import toy_models

    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    for step in range(steps):
        batch = toy_models.mlp_batch(step)
        optimizer.zero_grad()
        _mlp_loss(net(batch[0]), batch).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
    return {k: v.clone() for k, v in net.state_dict().items()}, _named_adam_state(net, optimizer)


class _Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Callable[[Any], Any]) -> torch.Tensor:
        return _mlp_loss(forward(batch[0]), batch)


class PipelineRun:
    """One rank's stage of ``Net`` under ``plan``, set up as the strategy does it: the layout
    taken from the whole module, the other stages' layers freed, this stage's moved."""

    def __init__(self, plan: Any, rank: int, device: str, wire: str, failure: Any, groups: Any) -> None:
        from lightning_dapple.execute.runner import StageRunner
        from lightning_dapple.strategy.checkpoint import CheckpointLayout
        from lightning_dapple.strategy.module_adapter import FreedLayer, key_owners

        self.net = Net()
        self.plan, self.rank, self.device, self.failure, self.groups = plan, rank, torch.device(device), failure, groups
        self.stage = plan.stages[plan.stage_of_rank(rank)]
        self.layout = CheckpointLayout(
            key_owner=key_owners(self.net, self.net.layers),
            parameter_names=[name for name, _ in self.net.named_parameters()],
            stage_leaders=tuple(each.devices[0] for each in plan.stages),
            global_rank=rank,
        )
        for index in range(len(self.net.layers)):
            if not self.stage.start <= index < self.stage.end:
                self.net.layers[index] = FreedLayer(index, -1)
        local = [self.net.layers[i].to(self.device) for i in range(self.stage.start, self.stage.end)]
        self.runner = StageRunner.for_plan(plan, rank, local, self.device, failure, groups=groups, wire=wire, ties=())
        self.optimizer = torch.optim.Adam(self.runner.parameters, lr=LR)

    def train(self, steps: range) -> None:
        import toy_models

        from lightning_dapple.execute.clipping import clip_grad_norm_global

        for step in steps:
            batch = tuple(t.to(self.device) for t in toy_models.mlp_batch(step))
            self.runner.train_step(batch, _Callbacks())
            clip_grad_norm_global(self.runner.parameters, CLIP, self.stage.replicas, self.failure, group=self.groups.plan)
            self.optimizer.step()

    def save(self, lane: PartLane) -> tuple[dict[str, Any], dict[str, Any]]:
        from lightning_dapple.strategy.checkpoint import consolidated_optimizer_state, consolidated_state_dict

        return consolidated_state_dict(self.net, self.layout, lane), consolidated_optimizer_state(self.net, self.layout, self.optimizer, lane)

    def resume_from(self, path: Path) -> None:
        from lightning_dapple.strategy.checkpoint import load_local_optimizer_states, load_local_state_dict

        checkpoint = torch.load(path, map_location=None, weights_only=True)
        load_local_state_dict(self.net, checkpoint["state_dict"])
        load_local_optimizer_states(self.net, self.layout, [self.optimizer], checkpoint["optimizer_states"])

    def finish(self) -> None:
        self.runner.finish()


def held_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the most host memory it held at once: every CPU allocation and free in
    this process while it ran (the profiler's memory events), summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return result, peak


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct memory (a layer's entries appear under two names)."""
    return list({(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape): t for t in tensors}.values())


def part_bytes(run: PipelineRun, state: dict[str, Any], optim: dict[str, Any]) -> dict[int, int]:
    """Tensor bytes of each stage leader's part (its stage's state-dict entries plus its
    stage's optimizer state), counted from the consolidated result on rank 0."""
    owner = run.layout.key_owner
    out: dict[int, int] = {}
    for stage in run.plan.stages:
        ours = lambda key: owner.get(key) is not None and stage.start <= owner[key] < stage.end  # noqa: E731
        tensors = _unique([value for key, value in state.items() if ours(key)])
        tensors += _tensors([value for name, value in optim["state"].items() if ours(name)])
        out[stage.devices[0]] = _bytes(tensors)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((float((a[k].cpu().double() - b[k].cpu().double()).abs().max()) for k in a), default=0.0)


def _rank0_facts(run: PipelineRun, state: dict, optim: dict, peak: int, lane: RecordingLane, path: Path) -> dict[str, Any]:
    """What rank 0 checks of the measured save: memory, the file, plain-module loading."""
    from lightning_dapple.strategy.checkpoint import AtomicCheckpointIO

    AtomicCheckpointIO().save_checkpoint({"state_dict": state, "optimizer_states": [optim], "global_step": STEPS}, path)
    ref_state, ref_adam = reference(STEPS)
    plain = Net()
    plain.load_state_dict(torch.load(path, map_location=None, weights_only=True)["state_dict"])  # strict
    parts = part_bytes(run, state, optim)
    # each part arrives as its length (one int64), its header (uint8), then its tensors
    after_length = [kind == torch.int64 for kind, _ in lane.received[:-1]]
    headers = [n for follows, (_, n) in zip(after_length, lane.received[1:]) if follows]
    return {
        "peak": peak,
        "consolidated": _bytes(_unique(_tensors([state, optim]))),
        "largest_part": max(parts[s] for s in run.layout.senders),
        "from_senders": sum(parts[s] for s in run.layout.senders),
        "tensor_bytes_received": sum(n for _, n in lane.received) - sum(headers) - 8 * len(headers),
        "largest_header": max(headers, default=0),
        "plain_diff": _max_diff(plain.state_dict(), ref_state),
        "adam_diff": max(_max_diff(optim["state"][name], ref_adam[name]) for name in ref_adam),
        "adam_names": sorted(optim["state"]) == sorted(ref_adam),
        "aliases_shared": all(
            state[f"model.{k}"].untyped_storage().data_ptr() == state[k].untyped_storage().data_ptr() for k in ref_state if k.startswith("layers.")
        ),
        "all_cpu": all(type(t) is torch.Tensor and t.device.type == "cpu" for t in _tensors([state, optim])),
    }


def _claimed_device_save(run: PipelineRun, failure: Any, first: dict[str, Any] | None) -> dict[str, Any]:
    """Save again with every optimizer state tensor claiming ``cuda:3``."""
    for state in run.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = OnAnotherDevice(value)
    lane = RecordingLane(None, failure.wait)
    _, optim = run.save(lane)
    out: dict[str, Any] = {"sent_plain_cpu": all(plain and device == "cpu" for plain, device in lane.sent), "sent": len(lane.sent)}
    if first is not None:
        out["arrived_plain_cpu"] = all(type(t) is torch.Tensor and t.device.type == "cpu" for t in _tensors(optim))
        out["same_values"] = all(torch.equal(a, b) for a, b in zip(_tensors(optim), _tensors(first)))
    return out


def gather_worker(rank: int, world: int, directory: str, device: str = "cpu", wire: str = "auto", names: tuple[str, ...] = tuple(PLANS)) -> dict[str, Any]:
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.plan.plan import plan_from_dict

    failure = FailureChannel(rank, timeout_s=120)
    out: dict[str, Any] = {}
    for name in names:
        plan = plan_from_dict({"global_batch_size": 12, "micro_batches": 3, "schedule": "dapple", **PLANS[name]})
        groups = build_groups(plan)
        if rank >= plan.world_size:
            out[name] = None
            continue
        path = Path(directory) / f"{name}.ckpt"
        run = PipelineRun(plan, rank, device, wire, failure, groups)
        run.train(range(STEPS))
        lane = RecordingLane(None, failure.wait)
        facts: dict[str, Any] = {"optimizer_devices": sorted({t.device.type for s in run.optimizer.state.values() for t in _tensors(s)})}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        (state, optim), peak = held_peak(lambda: run.save(lane)) if rank == 0 else (run.save(lane), 0)
        if device.startswith("cuda"):
            facts["gpu_growth"] = torch.cuda.max_memory_allocated() - before
        if rank == 0:
            facts.update(_rank0_facts(run, state, optim, peak, lane, path))
        facts["sent_plain_cpu"] = all(plain and dev == "cpu" for plain, dev in lane.sent)
        facts["claimed"] = _claimed_device_save(run, failure, optim if rank == 0 else None)
        run.finish()
        dist.barrier(group=groups.plan)  # the file is written before any rank reads it
        resumed = PipelineRun(plan, rank, device, wire, failure, groups)
        resumed.resume_from(path)
        resumed.train(range(STEPS, 2 * STEPS))
        resumed.finish()
        never_stopped = PipelineRun(plan, rank, device, wire, failure, groups)
        never_stopped.train(range(2 * STEPS))
        never_stopped.finish()
        local = {k: v for k, v in resumed.net.state_dict().items() if k.startswith("layers.")}
        facts["resume_diff"] = _max_diff(local, reference(2 * STEPS)[0])
        facts["never_stopped_diff"] = _max_diff(local, never_stopped.net.state_dict())
        facts["resumed_keys"] = len(local)
        out[name] = facts
    return out


def load_without_cuda(path: Path) -> str:
    """The devices of the tensors ``torch.load(map_location=None)`` gives in a process that
    sees no GPU (as on a machine with only a CPU)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CPU_ONLY_LOAD, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.timeout(600)
def test_parts_reach_rank_zero_on_the_cpu_one_at_a_time_and_resume(tmp_path: Path) -> None:
    results = run_ranks(gather_worker, 4, str(tmp_path), timeout_s=500)
    assert "__errors__" not in results, results.get("__errors__")
    for name, plan in PLANS.items():
        ranks = sorted({d for stage in plan["stages"] for d in stage["devices"]})
        leaders = {stage["devices"][0] for stage in plan["stages"]}
        zero = results[0][name]
        # (a) moved to the CPU on the sender; rank 0 gets plain CPU tensors only
        for rank in ranks:
            facts = results[rank][name]
            assert facts["sent_plain_cpu"] and facts["claimed"]["sent_plain_cpu"], (name, rank)
            assert (facts["claimed"]["sent"] > 0) == (rank in leaders and rank != 0), (name, rank, facts["claimed"])
        assert zero["all_cpu"] and zero["claimed"]["arrived_plain_cpu"] and zero["claimed"]["same_values"], (name, zero)
        # (b) rank 0 holds the consolidated state plus at most one part, and no staging copy:
        # beyond the tensors it keeps, one header at a time
        assert zero["peak"] <= zero["consolidated"] + zero["largest_part"], (name, zero)
        assert zero["tensor_bytes_received"] == zero["from_senders"] > 0, (name, zero)
        assert zero["peak"] <= zero["from_senders"] + zero["largest_header"] + 64, (name, zero)
        # (c) the file loads into the plain module, without CUDA, and resumes to never stopping
        assert zero["plain_diff"] < 1e-10 and zero["adam_diff"] < 1e-10 and zero["adam_names"], (name, zero)
        assert zero["aliases_shared"], name
        assert load_without_cuda(tmp_path / f"{name}.ckpt") == "cpu"
        for rank in ranks:
            facts = results[rank][name]
            assert facts["resumed_keys"] > 0 and facts["resume_diff"] < 1e-10 and facts["never_stopped_diff"] < 1e-10, (name, rank, facts)


def _forced_gloo_group_worker(rank: int, world: int) -> dict[str, Any]:
    """The lane a non-gloo default group gets (NCCL), forced here over gloo: a new gloo
    group of all ranks that carries the parts."""
    from datetime import timedelta

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.strategy import part_stream

    failure = FailureChannel(rank, timeout_s=60)
    part_stream._carries_cpu = lambda backend: False
    lane = part_stream.open_part_lane(failure.wait, timedelta(seconds=60))
    part = {"w": torch.full((rank + 2, 3), float(rank)), "flag": rank % 2 == 0, "empty": torch.zeros(0)}
    if rank == 0:
        got = [part_stream.receive_part(source, lane) for source in range(1, world)]
        checks = [
            torch.equal(p["w"], torch.full((s + 2, 3), float(s))) and p["flag"] == (s % 2 == 0) and p["empty"].shape == (0,)
            for s, p in zip(range(1, world), got)
        ]
        return {"own_group": lane.group is not None, "parts_right": all(checks)}
    part_stream.send_part(part, lane)
    return {"own_group": lane.group is not None}


@pytest.mark.timeout(120)
def test_a_default_group_that_cannot_carry_cpu_tensors_gets_a_gloo_lane() -> None:
    results = run_ranks(_forced_gloo_group_worker, 3, timeout_s=100)
    assert "__errors__" not in results, results.get("__errors__")
    assert all(results[rank]["own_group"] for rank in range(3))
    assert results[0]["parts_right"]


def test_the_file_the_strategy_writes_holds_cpu_tensors_only(tmp_path: Path) -> None:
    """What Lightning adds to a checkpoint (a callback's best score on the GPU) is moved to
    the CPU too: the file loads with ``weights_only`` and no GPU."""
    from lightning_dapple.strategy import DappleStrategy

    checkpoint = {
        "state_dict": {"layers.0.weight": torch.ones(2, 2)},
        "callbacks": {"ModelCheckpoint{}": {"best_model_score": OnAnotherDevice(torch.tensor(0.25)), "dirpath": "x"}},
        "global_step": 3,
    }
    DappleStrategy(plan={"global_batch_size": 2, "micro_batches": 1, "stages": [{"layers": [0, 1], "devices": [0]}]}).save_checkpoint(
        checkpoint, tmp_path / "a.ckpt"
    )
    loaded = torch.load(tmp_path / "a.ckpt", map_location=None, weights_only=True)
    score = loaded["callbacks"]["ModelCheckpoint{}"]["best_model_score"]
    assert type(score) is torch.Tensor and score.device.type == "cpu" and float(score) == 0.25
    assert load_without_cuda(tmp_path / "a.ckpt") == "cpu"
