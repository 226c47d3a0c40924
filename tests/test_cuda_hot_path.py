"""The hot path on a GPU: host synchronisations in a step, the event-timed timeline, and the
fp16 inf/nan flag of a rank without gradients (the CPU side: tests/test_hot_path.py).

Skipped where torch sees no CUDA device (CI); run on a GPU machine with
``pytest tests/test_cuda_hot_path.py``.

Synchronisations are caught with ``torch.cuda.set_sync_debug_mode("warn")`` around the
second training step: each synchronising CUDA call warns, attributed to the Python line
that made it. Those that a step needs are named here; every other one made by the package
fails the test:

* the global loss to the host at the end of the step (``runner.py``), which Lightning
  and the non-finite-loss check read (and the other ranks receive);
* on the staged wire (ranks sharing a GPU over gloo): the wire's own copies between the
  device and its pinned host buffers (``transport.py``, ``staging.py``, ``wires.py``,
  ``results.py``, ``failure.py``) and gloo's collectives, which reduce host tensors (the
  gradient norm in ``clipping.py``, gradient buckets in ``grad_sync.py``).

Torch's and Lightning's own are not the package's (fp16: ``GradScaler.step`` reads its
inf/nan flag once per step).
"""
from __future__ import annotations

import json
import linecache
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from dist_harness import run_ranks
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import FloatMLPModule, ScaleRecorder, mlp_loader, quiet_trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: package files whose synchronisations the staged wire needs (see the module docstring)
STAGED_WIRE = {"transport.py", "staging.py", "wires.py", "results.py", "failure.py", "clipping.py", "grad_sync.py"}


class SyncWatch:
    """Synchronising CUDA calls while active: (package-relative file, source line) of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._catching: Any = None

    def __enter__(self) -> "SyncWatch":
        torch.cuda.synchronize()  # what earlier steps queued is not this step's
        self._catching = warnings.catch_warnings(record=True)
        self._records = self._catching.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catching.__exit__(*exc)
        for record in self._records:
            if "synchroniz" in str(record.message):
                self.calls.append((_relative(record.filename), linecache.getline(record.filename, record.lineno).strip()))

    def package(self) -> list[tuple[str, str]]:
        return [call for call in self.calls if call[0].startswith("lightning_dapple/")]


def _relative(filename: str) -> str:
    return "lightning_dapple/" + filename.split("lightning_dapple/", 1)[1] if "lightning_dapple/" in filename else filename


def _is_loss_hand_off(call: tuple[str, str]) -> bool:
    return call[0] == "lightning_dapple/execute/runner.py" and "loss" in call[1] and ".cpu()" in call[1]


class WatchSecondStep(Callback):
    def __init__(self) -> None:
        self.watch = SyncWatch()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.watch.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.watch.__exit__(None, None, None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_one_gpu_step_synchronises_only_for_the_loss(tmp_path: Path, precision: str) -> None:
    """One stage, M = 2, a pinned DataLoader, a value logged per micro-batch, clipping by
    norm: the package synchronises once in step 2, for the loss."""
    loader = mlp_loader(3, dtype=torch.float32)
    pinned = DataLoader(loader.dataset, batch_size=12, shuffle=False, pin_memory=True)
    plan = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0]}]}
    flags = {"plugins": [MixedPrecision("16-mixed", "cuda")]} if precision == "16-mixed" else {"precision": precision}
    second = WatchSecondStep()
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=60), accelerator="gpu", devices=1, max_steps=3, root=tmp_path,
        gradient_clip_val=0.5, callbacks=[second], **flags,
    )
    trainer.fit(FloatMLPModule(sgd=True), pinned)
    ours = second.watch.package()
    assert len(ours) == 1 and _is_loss_hand_off(ours[0]), (ours, second.watch.calls)


def _staged_worker(rank: int, world: int) -> dict[str, Any]:
    """Two stages on ranks sharing cuda:0 over gloo (the staged wire), float64, three steps
    of Adam with clipping; the synchronisations of step 2 and the parameters' difference
    from single-process training."""
    import equivalence_worker as ew

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    failure = FailureChannel(rank, timeout_s=60)
    plan = plan_from_dict({"global_batch_size": 12, "micro_batches": 3, "schedule": "dapple", "stages": [
        {"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]})
    stage = plan.stages[plan.stage_of_rank(rank)]
    model = ew.make_model("mlp")
    local = [model[i].to(device) for i in range(stage.start, stage.end)]
    runner = StageRunner.for_plan(plan, rank, local, device, failure, ties=())
    opt = torch.optim.Adam(runner.parameters, lr=ew.LR)
    watch = SyncWatch()
    for step in range(ew.STEPS):
        batch = ew.make_batch("mlp", step)  # on the host, as the strategy leaves it
        callbacks = _OnDevice(ew.Callbacks("mlp"), device)
        if step == 1:
            watch.__enter__()
        runner.train_step(batch, callbacks)
        ew.clip_grad_norm_global(runner.parameters, ew.CLIP, stage.replicas, failure, group=None, device=device)
        opt.step()
        if step == 1:
            torch.cuda.synchronize()  # whatever the step left queued is waited for outside the watch
            watch.__exit__(None, None, None)
    runner.finish()
    failure.close()
    reference = ew.reference_run("mlp")[0]
    diff = max(
        float((value.cpu() - reference[stage.start + offset][key]).abs().max())
        for offset, layer in enumerate(local)
        for key, value in layer.state_dict().items()
    )
    return {"wire": runner.transport.wire.name, "package": watch.package(), "diff": diff}


class _OnDevice:
    """The test callbacks with each slice moved to the device (as the strategy's do)."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner = inner
        self.device = device

    def make_input(self, batch: Any) -> Any:
        return self.inner.make_input(tuple(t.to(self.device, non_blocking=True) for t in batch))

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return self.inner.compute_loss(tuple(t.to(self.device, non_blocking=True) for t in batch), forward)


@pytest.mark.timeout(300)
def test_ranks_sharing_a_gpu_synchronise_only_in_the_staged_wire() -> None:
    results = run_ranks(_staged_worker, 2, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(2):
        got = results[rank]
        assert got["wire"] == "staged" and got["diff"] < 1e-10, got
        others = [call for call in got["package"] if call[0].rsplit("/", 1)[-1] not in STAGED_WIRE and not _is_loss_hand_off(call)]
        assert others == [], (rank, others)
        assert sum(_is_loss_hand_off(call) for call in got["package"]) <= 1, got["package"]


# -- the measured timeline ----------------------------------------------------------------
class Sleep(torch.nn.Module):
    """Keeps the GPU busy for ``cycles`` clock cycles in its forward (its backward is free)."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x


def _sleep_ms(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def test_timeline_on_a_gpu_shows_a_long_kernels_real_duration() -> None:
    """A forward that queues a ~50 ms kernel returns to the host at once; its F span must
    show the kernel's duration (CUDA events), on the host's perf_counter clock."""
    import torch.distributed as dist

    import equivalence_worker as ew
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    device = torch.device("cuda", 0)
    cycles = 10_000_000
    while _sleep_ms(cycles) < 50:  # clock rates differ between GPUs
        cycles *= 2
    sleep_ms = _sleep_ms(cycles)
    dist.init_process_group("gloo", rank=0, world_size=1)
    failure = FailureChannel(0, timeout_s=60)
    plan = plan_from_dict({"global_batch_size": 12, "micro_batches": 2, "schedule": "dapple", "stages": [{"layers": [0, 6], "devices": [0]}]})
    layers = [Sleep(cycles)] + [layer.to(device) for layer in ew.make_model("mlp")]
    runner = StageRunner.for_plan(plan, 0, layers, device, failure, ties=())
    before = time.perf_counter()
    runner.train_step(tuple(t.to(device) for t in ew.make_batch("mlp", 0)), ew.Callbacks("mlp"))
    timeline = runner.stats.timeline
    read = time.perf_counter()
    runner.finish()
    failure.close()
    forwards = [(start, end) for start, end, kind, *_ in timeline if kind == "F"]
    assert len(forwards) == 2
    for start, end in forwards:
        assert (end - start) * 1e3 > 0.8 * sleep_ms, (end - start, sleep_ms)
        assert before <= start <= end <= read
    assert all(a[1] <= b[0] + 1e-6 for a, b in zip(timeline, timeline[1:]))  # one stream: in order


# -- the fp16 inf/nan flag of a rank without gradients --------------------------------------
def test_inf_flag_without_gradients_lives_on_the_gpu() -> None:
    """A frozen rank's scaler records no device; the agreed flag is made on the GPU anyway,
    and the step is then taken and the scale updated there."""
    from lightning_dapple.strategy.precision import agree_found_inf

    device = torch.device("cuda", 0)
    param = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    scaler.unscale_(optimizer)
    agreed = agree_found_inf(scaler, optimizer, device)
    assert agreed.device == device and float(agreed) == 0.0
    assert [flag.device for flag in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()] == [device]
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 4.0


class FrozenTail(FloatMLPModule):
    """Layers 2-4 frozen: on a 2-stage plan cut at 2, rank 1's parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers[2:]:
            layer.requires_grad_(False)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_frozen_stage_under_fp16_on_two_gpus(tmp_path: Path) -> None:
    """NCCL reduces only GPU tensors: the frozen rank's inf/nan flag (and its zero gradient
    norm) must be on its GPU, or the all-reduce fails. Both ranks step and scale alike."""
    plan = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=60), accelerator="gpu", devices=2, max_steps=3,
        root=tmp_path, plugins=[MixedPrecision("16-mixed", "cuda")], gradient_clip_val=0.5, callbacks=[ScaleRecorder(str(tmp_path))],
    )
    trainer.fit(FrozenTail(), mlp_loader(3, dtype=torch.float32))
    rows = [json.loads((tmp_path / f"scale_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [row["scale"] for row in rows[0]] == [row["scale"] for row in rows[1]]
    assert [row["adam_steps"] for row in rows[0]] == [1.0, 2.0, 3.0]
