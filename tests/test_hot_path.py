"""What a training step does besides its compute: what it moves to the device, what it reads
back on the host, how it clips and how it times (the CPU side of tests/test_cuda_hot_path.py).

* the batch: a middle stage moves nothing to its device, the first and last stages only
  their slices' rows of the fields their step reads;
* host reads (``item``, ``float``, ``tolist``, ``cpu``, ...), counted per step after the
  first: a fixed few that the step needs, none per micro-batch; logged values are summed
  on the device with the host's arithmetic and read once;
* clipping: the global norm over all stages equals single-process ``clip_grad_norm_``,
  without a gradient-sized copy;
* the measured timeline: host times on a CPU; the CUDA path's placement of event times on
  the host clock;
* the fp16 inf/nan flag of a rank whose parameters got no gradient lives on its device.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_dapple  # noqa: F401  (registers the strategies)
from dist_harness import run_ranks
from lightning_dapple.execute.spans import DeviceSpan, on_host_clock
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy import precision as precision_module
from lightning_dapple.strategy.module_adapter import LogRecorder
from lightning_dapple.strategy.precision import agree_found_inf
from lightning_toys import FloatMLPModule, MLPModule, mlp_loader, quiet_trainer, single_device_run

TORCH_DIR = os.path.dirname(torch.__file__)
#: tensor methods that read a value on the host (on a GPU: wait for the device)
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


def _plan(micro_batches: int, cuts: tuple[int, ...] = ()) -> dict:
    edges = [0, *cuts, 5]
    stages = [{"layers": [a, b], "devices": [i]} for i, (a, b) in enumerate(zip(edges, edges[1:]))]
    return {"global_batch_size": 12, "micro_batches": micro_batches, "stages": stages}


# -- the batch: each stage moves only what it reads -------------------------------------
class SliceMoves(Callback):
    """Per rank, every slice leaf moved to the device during training: (global step,
    shape), written to ``<directory>/moves_rank<r>.json`` at the end of fit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.moves: list[tuple[int, list[int]]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning_dapple.strategy import slice_transfer

        original = slice_transfer.to_device

        def recording(leaf: torch.Tensor, device: torch.device) -> torch.Tensor:
            if trainer.training:
                self.moves.append((trainer.global_step, list(leaf.shape)))
            return original(leaf, device)

        slice_transfer.to_device = recording

    def on_train_end(self, trainer, pl_module) -> None:
        with open(f"{self.directory}/moves_rank{trainer.global_rank}.json", "w") as stream:
            json.dump(self.moves, stream)


@pytest.mark.timeout(300)
def test_each_stage_moves_only_its_rows_of_the_fields_it_reads(tmp_path: Path) -> None:
    """Three stages, M = 2, batches (x: 12 x 6, y: 12 x 3). The first stage reads x, the
    last y, the middle stage neither: after the first slice (all of whose fields move while
    the strategy finds out which the step reads) rank 0 moves its two 6-row slices of x per
    step, rank 2 its two of y, rank 1 nothing ever. The parameters equal one device's."""
    model = MLPModule().double()
    strategy = DappleStrategy(plan=_plan(2, cuts=(1, 4)), start_method="spawn", timeout_s=60)
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cpu", devices=3, precision="64-true", max_steps=3, root=tmp_path,
        gradient_clip_val=0.5, callbacks=[SliceMoves(str(tmp_path))],
    )
    trainer.fit(model, mlp_loader(3))
    moves = {rank: json.loads((tmp_path / f"moves_rank{rank}.json").read_text()) for rank in range(3)}
    x, y = [6, 6], [6, 3]
    assert moves[1] == []
    assert moves[0] == [[0, x], [0, y], [0, x]] + [[step, x] for step in (1, 2) for _ in range(2)]
    assert moves[2] == [[0, x], [0, y], [0, y]] + [[step, y] for step in (1, 2) for _ in range(2)]
    reference, _ = single_device_run(3, clip=0.5)
    state = model.state_dict()
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10


def test_a_slice_moves_only_the_leaves_its_step_reads() -> None:
    """The meta device stands for the GPU. The step reads y's data and asks x's shape: from
    the second call only y moves; a batch of another structure is learned afresh."""
    from lightning_dapple.strategy.slice_transfer import SliceTransfer

    transfer = SliceTransfer(torch.device("meta"))
    got: list[dict] = []

    def step(batch: dict) -> torch.Tensor:
        got.append(batch)
        return batch["y"].sum() * batch["x"].shape[0]

    def batch(**extra: Any) -> dict:
        return {"x": torch.ones(4, 3), "y": torch.ones(4), "mask": torch.ones(4, dtype=torch.bool), "name": "b", **extra}

    def placed(index: int) -> dict:
        return {key: value.device.type for key, value in got[index].items() if isinstance(value, torch.Tensor)}

    for _ in range(2):
        transfer.run(batch(), step)
    transfer.run(batch(ids=torch.zeros(4)), step)
    transfer.run(batch(ids=torch.zeros(4)), step)
    assert placed(0) == {"x": "meta", "y": "meta", "mask": "meta"}  # learning: everything moves
    assert placed(1) == {"x": "cpu", "y": "meta", "mask": "cpu"}
    assert placed(2) == {"x": "meta", "y": "meta", "mask": "meta", "ids": "meta"}  # a new structure
    assert placed(3) == {"x": "cpu", "y": "meta", "mask": "cpu", "ids": "cpu"}
    assert got[1]["name"] == "b"


class OwnTransfer(MLPModule):
    """A module whose own ``on_after_batch_transfer`` defines the batch on the device."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x, y * 1.0


def test_a_module_with_its_own_transfer_hooks_moves_whole_batches(tmp_path: Path) -> None:
    """The hook runs on the whole batch (as in Lightning) and the step still matches."""
    seen: list[int] = []

    class Seen(OwnTransfer):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            seen.append(batch[0].shape[0])
            return super().on_after_batch_transfer(batch, dataloader_idx)

    model = Seen().double()
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan=_plan(2), timeout_s=30), accelerator="cpu", devices=1, precision="64-true",
        max_steps=3, root=tmp_path, gradient_clip_val=0.5,
    )
    trainer.fit(model, mlp_loader(3))
    assert seen[-3:] == [12, 12, 12]  # whole batches, one per step
    reference, _ = single_device_run(3, clip=0.5)
    assert max(float((model.state_dict()[k] - reference[k]).abs().max()) for k in reference) < 1e-12


# -- host reads ------------------------------------------------------------------------
def _caller(depth: int) -> tuple[str, str]:
    """The first frame outside torch above ``depth``: (path from the package root, function)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return ("?", "?")
    name = frame.f_code.co_filename
    for root in ("lightning_dapple/", "lightning/"):
        if root in name:
            return root + name.split(root, 1)[1], frame.f_code.co_name
    return os.path.basename(name), frame.f_code.co_name


class HostReads:
    """Counts calls of the ``HOST_READS`` tensor methods while active, by (immediate caller's
    file, the first caller outside torch, its function, method)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str, str, str]] = Counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "HostReads":
        for method in HOST_READS:
            original = self._saved[method] = getattr(torch.Tensor, method)
            setattr(torch.Tensor, method, self._counting(method, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved = {}

    def _counting(self, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        calls = self.calls

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            immediate = os.path.basename(sys._getframe(1).f_code.co_filename)
            calls[(immediate, *_caller(2), method)] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def ours(self) -> Counter[tuple[str, str, str, str]]:
        return Counter({key: n for key, n in self.calls.items() if key[1].startswith("lightning_dapple/")})


class StepReads(Callback):
    """Host reads per training step after the first (the warm-up)."""

    def __init__(self) -> None:
        self.steps: list[HostReads] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx > 0:
            self.steps.append(HostReads().__enter__())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx > 0:
            self.steps[-1].__exit__()


#: the host reads a one-stage fp16 step needs, whatever M: the global loss to the host for
#: the hand-off to Lightning (the last stage's one device read), the non-finite-loss check
#: on that host copy, and GradScaler.step's read of the agreed inf/nan flag
NEEDED = Counter(
    {
        ("runner.py", "lightning_dapple/execute/runner.py", "train_step", "cpu"): 1,
        ("batch_guard.py", "lightning_dapple/strategy/batch_guard.py", "check_training_loss", "__float__"): 1,
        ("grad_scaler.py", "lightning_dapple/strategy/precision.py", "optimizer_step", "item"): 1,
    }
)


@pytest.mark.timeout(300)
def test_a_step_reads_the_host_only_where_the_schedule_needs_it(tmp_path: Path) -> None:
    """One stage, fp16 with its GradScaler, clipping by norm, a value logged per micro-batch
    (SGD: Adam reads its step counters, host tensors, on the host). Per step after the
    first: exactly the reads of ``NEEDED`` from the package and the same total at M = 2 and
    M = 4 (nothing per micro-batch), with the logged loss the same number as before."""
    totals = {}
    for micro_batches in (2, 4):
        reads = StepReads()
        trainer = quiet_trainer(
            strategy=DappleStrategy(plan=_plan(micro_batches), timeout_s=30), accelerator="cpu", devices=1, max_steps=3,
            root=tmp_path / str(micro_batches), plugins=[MixedPrecision("16-mixed", "cpu")], gradient_clip_val=0.5,
            callbacks=[reads],
        )
        trainer.fit(FloatMLPModule(sgd=True), mlp_loader(3, dtype=torch.float32))
        assert len(reads.steps) == 2
        for step in reads.steps:
            assert step.ours() == NEEDED, step.ours()
        totals[micro_batches] = [sum(step.calls.values()) for step in reads.steps]
    assert totals[2] == totals[4], totals


def _old_summary(values: list[tuple[torch.Tensor | float, float]]) -> tuple[float, float]:
    """The per-micro-batch host arithmetic the recorder replaced: float() of each value."""
    total, weight = 0.0, 0.0
    for value, w in values:
        number = float(value.detach().to(torch.float64).mean()) if isinstance(value, torch.Tensor) else float(value)
        total, weight = total + number * w, weight + w
    return total, weight


def test_logged_values_are_summed_on_the_device_and_read_once() -> None:
    """Micro-batches weighted by 1/3 rows each, values in float32, bfloat16 and plain
    floats: the sums read once per step equal the per-micro-batch host arithmetic bit for
    bit, and recording makes no host read at all."""
    gen = torch.Generator().manual_seed(3)
    logged = {
        "loss": [(torch.rand(5, generator=gen), 1 / 3) for _ in range(3)],
        "acc": [(torch.rand(2, generator=gen).to(torch.bfloat16), 1 / 3) for _ in range(3)],
        "lr": [(0.1, 1 / 3), (0.2, 1 / 3), (0.3, 1 / 3)],
    }
    recorder = LogRecorder()
    module = torch.nn.Module()
    module.log = module.log_dict = lambda *a, **k: None  # recording replaces both
    with HostReads() as recording:
        for mb in range(3):
            with recorder.recording(module, 1 / 3):
                for name, values in logged.items():
                    module.log(name, values[mb][0], prog_bar=True)
    assert sum(recording.calls.values()) == 0
    with HostReads() as reading:
        summary = recorder.summary(on_host=True)
    assert [key[3] for key in reading.calls.elements()] == ["tolist"]
    for name, values in logged.items():
        total, weight, kwargs = summary[name]
        assert (total, weight) == _old_summary(values) and kwargs == {"prog_bar": True}
    on_device = recorder.summary()
    assert isinstance(on_device["loss"][0], torch.Tensor) and float(on_device["loss"][0]) == summary["loss"][0]


# -- clipping ----------------------------------------------------------------------------
def _clip_worker(rank: int, world: int) -> dict[str, Any]:
    """Stage 0 (layers 0-2) on ranks 0 and 1 (equal gradients after their AllReduce), stage
    1 (layers 3-4) on rank 2; float64 gradients of one seeded model on every rank. Each rank
    clips its stage's gradients by the global norm; also with stage 1 frozen (no grads)."""
    from lightning_dapple.execute.clipping import clip_grad_norm_global
    from lightning_dapple.execute.failure import FailureChannel
    import toy_models

    failure = FailureChannel(rank, timeout_s=30)
    stages, replicas = ([0, 1, 2], [3, 4]), (2, 1)
    mine = 0 if rank < 2 else 1
    out: dict[str, Any] = {}
    for case in ("all", "frozen"):
        torch.manual_seed(7)
        model = toy_models.mlp_layers().double()
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 3
        local = [p for index in stages[mine] for p in model[index].parameters()]
        if case == "frozen" and mine == 1:
            for param in local:
                param.grad = None
        grads = {p.grad.data_ptr() for p in local if p.grad is not None}
        converted: list[int] = []  # the storage of every tensor clipping converts (.to)
        original = torch.Tensor.to
        torch.Tensor.to = lambda t, *a, **k: converted.append(t.data_ptr()) or original(t, *a, **k)  # type: ignore[method-assign]
        try:
            norm = clip_grad_norm_global(local, 0.5, replicas[mine], failure, device=torch.device("cpu"))
        finally:
            torch.Tensor.to = original  # type: ignore[method-assign]
        out[case] = {
            "norm": norm.item(),
            "grads": [p.grad.tolist() if p.grad is not None else None for p in local],
            "conversions": len(converted),
            "gradients_converted": len(grads.intersection(converted)),
        }
    failure.close()
    return out


def _single_process_clip(case: str) -> tuple[float, list[list | None]]:
    import toy_models

    torch.manual_seed(7)
    model = toy_models.mlp_layers().double()
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 3
    if case == "frozen":
        for index in (3, 4):
            for param in model[index].parameters():
                param.grad = None
    with_grads = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(with_grads, 0.5))
    return norm, [p.grad.tolist() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.timeout(180)
def test_global_norm_clipping_equals_single_process_clip_grad_norm() -> None:
    """float64: the norm and every clipped gradient equal ``clip_grad_norm_`` over the whole
    model (to rounding), with a frozen stage too; and no gradient is converted (copied to
    another dtype or device): a few conversions in all, none per parameter."""
    results = run_ranks(_clip_worker, 3, timeout_s=150)
    assert "__errors__" not in results, results.get("__errors__")
    sizes = [len(list(layer.parameters())) for layer in __import__("toy_models").mlp_layers()]
    first = sum(sizes[:3])
    for case in ("all", "frozen"):
        norm, grads = _single_process_clip(case)
        for rank in range(3):
            got = results[rank][case]
            assert got["norm"] == pytest.approx(norm, rel=1e-13), (case, rank)
            expected = grads[:first] if rank < 2 else grads[first:]
            for mine, theirs in zip(got["grads"], expected):
                assert (mine is None) == (theirs is None)
                if mine is not None:
                    assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), rtol=1e-13, atol=0), (case, rank)
            # one dtype group: its norms, the reduced square (to the collective's device and
            # back) and the coefficient; never a gradient
            assert got["gradients_converted"] == 0 and got["conversions"] <= 4, (case, rank, got)


# -- the measured timeline -----------------------------------------------------------------
def test_host_timeline_spans_every_compute_action(tmp_path: Path) -> None:
    """CPU: (start, end) in perf_counter seconds around each F and B, in action order,
    inside the step, for every micro-batch."""
    import time

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict
    import equivalence_worker as ew

    dist.init_process_group("gloo", rank=0, world_size=1)
    failure = FailureChannel(0, timeout_s=30)
    plan = plan_from_dict({**_plan(3), "schedule": "dapple"})
    runner = StageRunner.for_plan(plan, 0, list(ew.make_model("mlp")), torch.device("cpu"), failure, ties=())
    before = time.perf_counter()
    runner.train_step(ew.make_batch("mlp", 0), ew.Callbacks("mlp"))
    after = time.perf_counter()
    runner.finish()
    failure.close()
    timeline = runner.stats.timeline
    assert sorted((kind, mb) for _, _, kind, mb, _ in timeline) == [("B", 0), ("B", 1), ("B", 2), ("F", 0), ("F", 1), ("F", 2)]
    assert {stage for *_, stage in timeline} == {0}
    ends = [before] + [end for _, end, *_ in timeline]
    for (start, end, *_), previous_end in zip(timeline, ends):
        assert previous_end <= start <= end <= after


def test_device_spans_are_placed_where_the_device_caught_up_with_the_host() -> None:
    """The CUDA path's clock placement: events can complete no earlier than queued. Here
    the device idled before the second F (queued at host time 10.5, it ran 0.5 s after
    the first event): the first event ran at host time 10.0, although it was queued at
    9.7 (the device was still busy then)."""
    spans = [
        DeviceSpan(0.0, 0.3, 9.7, 9.71, "F", 0, 2),  # queued ahead of the device
        DeviceSpan(0.5, 0.6, 10.5, 10.51, "F", 1, 2),  # the device waited for the host here
        DeviceSpan(0.6, 0.9, 10.52, 10.53, "B", 1, 2),
    ]
    placed = on_host_clock(spans)
    assert placed == [(10.0, 10.3, "F", 0, 2), (10.5, 10.6, "F", 1, 2), (10.6, 10.9, "B", 1, 2)]
    assert all(start >= span.queued_start and end >= span.queued_end for (start, end, *_), span in zip(placed, spans))


# -- the fp16 inf/nan flag of a rank without gradients ------------------------------------------
def test_inf_flag_of_a_rank_without_gradients_is_made_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose parameters got no gradient: the GradScaler records no device, and the
    flag must still be built on the rank's device (NCCL reduces only device tensors). The
    meta device stands for cuda:N; the all-reduce (as NCCL: on the compute device) sees it."""
    param = torch.nn.Parameter(torch.ones(3))  # no .grad: a frozen stage
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    assert not scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # the fallback case
    handed: list[torch.device] = []

    class Done:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(precision_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(precision_module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(precision_module, "collective_device", lambda group, compute: compute)
    monkeypatch.setattr(precision_module.dist, "all_reduce", lambda tensor, **kwargs: handed.append(tensor.device) or Done())
    rank_device = torch.device("meta")
    agreed = agree_found_inf(scaler, optimizer, rank_device)
    assert handed == [rank_device]
    assert agreed.device == rank_device
    assert [value.device for value in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()] == [rank_device]
