"""Worker side of ``bench_schedules.py``: every variant on the same two spawned gloo ranks.

Each rank builds, for one micro-batch count M, five trainers of the same MLP from the same
seed (so their first-step losses must agree), then runs them round-robin so that machine
noise hits all variants alike:

* ``dapple`` / ``gpipe``: lightning_dapple's ``StageRunner`` with that schedule (receives
  posted where ``transport.receives_ahead_pay`` says, as users get it);
* ``dapple-ahead``: the dapple schedule with every receive posted one transfer ahead (the
  ablation behind that rule);
* ``torch-1F1B`` / ``torch-GPipe``: ``torch.distributed.pipelining`` ``PipelineStage`` with
  ``Schedule1F1B`` / ``ScheduleGPipe``;
* ``ddp``: ``DistributedDataParallel`` of the whole model, each rank half the batch.

Peak stashed bytes are measured the same way for every variant by ``LiveStash`` (see its
docstring) in one extra, untimed step; for the lightning_dapple variants
``runner.stats.peak_stash_bytes`` of that step is reported as well.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_dapple.execute.runner as runner_module
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict

LR = 1e-3
SEED = 1234
VARIANTS = ("dapple", "dapple-ahead", "gpipe", "torch-1F1B", "torch-GPipe", "ddp")


# -- model and data ------------------------------------------------------------------
def make_blocks(width: int, layers: int) -> list[nn.Module]:
    """``layers`` blocks of Linear(width, width) + ReLU, float32, identical on every call."""
    torch.manual_seed(SEED)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]


def make_batch(step: int, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)


# -- stashed-bytes measurement ---------------------------------------------------------
class _Saved:
    """What autograd keeps instead of a saved tensor; its death is the tensor's release."""

    __slots__ = ("owner", "tensor", "keys")

    def __init__(self, owner: "LiveStash", tensor: torch.Tensor, keys: tuple[tuple[Any, int], ...]) -> None:
        self.owner, self.tensor, self.keys = owner, tensor, keys
        owner._acquire(keys)

    def __del__(self) -> None:
        self.owner._release(self.keys)


class _Ledger:
    """Reference-counted live bytes of keys, with the running peak."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}
        self.bytes = 0
        self.peak = 0

    def acquire(self, key: Any, nbytes: int) -> None:
        count = self.counts.get(key, 0)
        self.counts[key] = count + 1
        if count == 0:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)

    def release(self, key: Any, nbytes: int) -> None:
        count = self.counts[key] - 1
        if count:
            self.counts[key] = count
        else:
            del self.counts[key]
            self.bytes -= nbytes


class LiveStash:
    """Peak bytes held by autograd for backward over a step, parameters excluded.

    Installed with ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` around the
    whole step. ``pack`` wraps each saved tensor in a ``_Saved`` whose lifetime is the
    saved tensor's: autograd drops it when the graph node that saved it runs in backward
    (or when the graph is freed). Two ledgers reference-count what is alive:

    * ``storages``: distinct storages (keyed by data pointer), each with its full size; a
      micro-batch slice of the input batch counts as the whole batch buffer;
    * ``views``: distinct tensor views (storage, offset, shape, strides), each with its own
      bytes; a slice counts as its rows (the rule of ``lightning_dapple.profile.stash``).

    Each ledger adds a key's bytes when its first saved tensor is packed, removes them when
    the last is released, and keeps the peak of the live sum. Unlike the executor's own
    ``runner.stats`` it is global over the step (not per micro-batch or layer) and it
    includes what the loss function saves.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages = _Ledger()
        self.views = _Ledger()

    def _acquire(self, keys: tuple[tuple[Any, int], ...]) -> None:
        (skey, sbytes), (vkey, vbytes) = keys
        self.storages.acquire(skey, sbytes)
        self.views.acquire(vkey, vbytes)

    def _release(self, keys: tuple[tuple[Any, int], ...]) -> None:
        (skey, sbytes), (vkey, vbytes) = keys
        self.storages.release(skey, sbytes)
        self.views.release(vkey, vbytes)

    def pack(self, tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return tensor
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return tensor
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.exclude:
            return tensor
        view = (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        return _Saved(self, tensor, ((ptr, nbytes), (view, tensor.numel() * tensor.element_size())))

    @staticmethod
    def unpack(obj: Any) -> Any:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def report(self) -> dict[str, int]:
        return {
            "peak_stash_bytes": self.storages.peak,
            "peak_stash_view_bytes": self.views.peak,
            "leftover_bytes": self.storages.bytes,
        }


def _param_keys(params: list[torch.Tensor]) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in params}


# -- variants ---------------------------------------------------------------------------
class Variant:
    name: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        """Forward and backward of the global batch; returns what ``global_loss`` needs."""
        raise NotImplementedError

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        handle = self.forward_backward(batch)
        self.optimizer.step()
        return handle

    def global_loss(self, handle: Any) -> float:
        """The loss of the whole global batch, on every rank (collective)."""
        raise NotImplementedError

    def measure_stash(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
        tracker = LiveStash(_param_keys(self.params))
        with tracker.hooks():
            self.step(batch)
        return tracker.report()


class _Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        return F.mse_loss(forward(batch[0]), batch[1])


class DappleVariant(Variant):
    def __init__(
        self,
        schedule: str,
        rank: int,
        cfg: dict,
        micro_batches: int,
        failure: FailureChannel,
        post_ahead: bool | None = None,
        settle_sends: bool = True,
        ooo: bool = False,
    ) -> None:
        # post_ahead None: the executor decides (what a user gets); True: the ablation row;
        # settle_sends False: every send waited only at the end of the step (ablation);
        # ooo: out-of-order backprop, what DappleStrategy runs by default (ooo=True)
        self.name = (
            schedule + ("" if post_ahead is None else "-ahead") + ("" if settle_sends else "-nosettle") + ("-ooo" if ooo else "")
        )
        half = cfg["layers"] // 2
        plan = plan_from_dict(
            {
                "global_batch_size": cfg["batch"],
                "micro_batches": micro_batches,
                "schedule": schedule,
                "ooo": ooo,
                "stages": [{"layers": [0, half], "devices": [0]}, {"layers": [half, cfg["layers"]], "devices": [1]}],
            }
        )
        blocks = make_blocks(cfg["width"], cfg["layers"])
        local = blocks[:half] if rank == 0 else blocks[half:]
        self.runner = StageRunner.for_plan(
            plan,
            rank,
            local,
            torch.device("cpu"),
            failure,
            post_ahead=post_ahead,
            settle_sends=settle_sends,
            ties=(),
        )
        self.params = self.runner.parameters
        self.optimizer = torch.optim.SGD(self.params, lr=LR)
        self.callbacks = _Callbacks()

    def forward_backward(self, batch: Any) -> Any:
        loss, _ = self.runner.train_step(batch, self.callbacks)
        return loss

    def global_loss(self, handle: Any) -> float:
        return float(handle)  # already the same on every rank

    def measure_stash(self, batch: Any) -> dict[str, int]:
        tracker = LiveStash(_param_keys(self.params))
        # The executor measures its own stash with saved-tensor hooks around its layers,
        # which shadow outer hooks there; chain ours behind its meter class so both see
        # every saved tensor (outside its hooks, e.g. in the loss, ours apply directly).
        name = next((n for n in ("StashMeter", "_StashCounter") if hasattr(runner_module, n)), None)
        base = getattr(runner_module, name) if name else None
        if base is not None:

            class Chained(base):  # type: ignore[misc, valid-type]
                def pack(self, tensor: torch.Tensor) -> Any:
                    return tracker.pack(super().pack(tensor))

                def unpack(self, obj: Any) -> Any:  # type: ignore[override]
                    return tracker.unpack(obj)

            setattr(runner_module, name, Chained)
        try:
            with tracker.hooks():
                self.step(batch)
        finally:
            if base is not None:
                setattr(runner_module, name, base)
        return {
            **tracker.report(),
            "runner_peak_stash_bytes": self.runner.stats.peak_stash_bytes,
            "runner_peak_in_flight": self.runner.stats.peak_in_flight,
        }


class TorchPipeVariant(Variant):
    def __init__(self, kind: str, rank: int, cfg: dict, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.name = f"torch-{kind}"
        self.rank = rank
        half = cfg["layers"] // 2
        blocks = make_blocks(cfg["width"], cfg["layers"])
        submodule = nn.Sequential(*(blocks[:half] if rank == 0 else blocks[half:]))
        example = torch.empty(cfg["batch"] // micro_batches, cfg["width"])
        self.stage = PipelineStage(submodule, rank, 2, torch.device("cpu"), input_args=(example,))
        cls = Schedule1F1B if kind == "1F1B" else ScheduleGPipe
        # loss_fn is a mean over the micro-batch; scale_grads (default) divides the
        # accumulated gradients by M, so they are those of the mean over the global batch.
        self.schedule = cls(self.stage, n_microbatches=micro_batches, loss_fn=F.mse_loss)
        self.params = [p for p in submodule.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=LR)

    def forward_backward(self, batch: Any) -> Any:
        self.optimizer.zero_grad(set_to_none=True)
        x, y = batch
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(target=y, losses=losses, return_outputs=False)
        return losses

    def global_loss(self, handle: Any) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if self.rank == 1:  # equal micro-batches: the mean of their means is the batch mean
            value += sum(float(loss.detach()) for loss in handle) / len(handle)
        dist.broadcast(value, src=1)
        return float(value)


class DDPVariant(Variant):
    def __init__(self, rank: int, world: int, cfg: dict) -> None:
        self.name = "ddp"
        self.rank, self.world = rank, world
        model = nn.Sequential(*make_blocks(cfg["width"], cfg["layers"]))
        self.model = nn.parallel.DistributedDataParallel(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=LR)

    def forward_backward(self, batch: Any) -> Any:
        self.optimizer.zero_grad(set_to_none=True)
        x, y = batch
        rows = x.shape[0] // self.world
        lo, hi = self.rank * rows, (self.rank + 1) * rows
        loss = F.mse_loss(self.model(x[lo:hi]), y[lo:hi])
        loss.backward()
        return loss.detach()

    def global_loss(self, handle: Any) -> float:
        value = handle.to(torch.float64)
        dist.all_reduce(value)
        return float(value) / self.world


# -- the benchmark ------------------------------------------------------------------------
def _timed(variant: Variant, batches: list[Any], first: int = 0, count: int = 1) -> tuple[float, float, float]:
    """(wall s per step of the slowest rank, CPU s per step of all ranks' processes
    together, global loss of the last step) over ``count`` consecutive steps.

    A step is what a Lightning training step needs from every variant: forward, backward
    and optimizer step of the global batch, and its loss known on every rank (the progress
    bar and loggers live on rank 0, a first-stage rank). lightning_dapple's step ends that
    way by itself; the others get it from ``global_loss`` (a broadcast or an all-reduce),
    inside the timed window too. Consecutive steps run back to back as in training (the
    ranks meet only at a barrier before the block), so each block is timed warm.
    """
    dist.barrier()
    cpu = time.process_time()
    start = time.perf_counter()
    loss = 0.0
    for index in range(first, first + count):
        loss = variant.global_loss(variant.step(batches[index % len(batches)]))
    elapsed = (time.perf_counter() - start) / count
    cpu = (time.process_time() - cpu) / count
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its last rank is done
    busy = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(busy)
    return float(slowest), float(busy), loss


def run(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    results: dict[str, Any] = {}
    for m in cfg["micro_batches"]:
        variants: list[Variant] = [
            DappleVariant("dapple", rank, cfg, m, failure),
            DappleVariant("dapple", rank, cfg, m, failure, post_ahead=True),
            DappleVariant("gpipe", rank, cfg, m, failure),
            TorchPipeVariant("1F1B", rank, cfg, m),
            TorchPipeVariant("GPipe", rank, cfg, m),
            DDPVariant(rank, world, cfg),
        ]
        per: dict[str, dict[str, Any]] = {v.name: {"times_s": [], "cpu_s": []} for v in variants}
        batches = [make_batch(step, cfg["batch"], cfg["width"]) for step in range(4)]
        # step 0 (identical weights and batch everywhere): the correctness check
        for v in variants:
            seconds, _, loss = _timed(v, batches)
            per[v.name]["first_loss"] = loss
            per[v.name]["first_step_s"] = seconds
        # warm-up, then one untimed step with the stash hooks
        # step 1 checks the gradients of step 0 (same SGD update everywhere); then warm-up
        for step in range(cfg["warmup"]):
            for v in variants:
                loss = v.global_loss(v.step(batches[(step + 1) % len(batches)]))
                if step == 0:
                    per[v.name]["second_loss"] = loss
        for v in variants:
            dist.barrier()
            per[v.name].update(v.measure_stash(batches[1]))
        # timed blocks of ``block`` consecutive steps, round-robin with a rotating order
        for step in range(cfg["steps"]):
            shift = step % len(variants)
            for v in variants[shift:] + variants[:shift]:
                seconds, cpu, _ = _timed(v, batches, step, cfg["block"])
                per[v.name]["times_s"].append(seconds)
                per[v.name]["cpu_s"].append(cpu)
        for name, item in per.items():
            item["median_s"] = statistics.median(item["times_s"])
            item["median_cpu_s"] = statistics.median(item["cpu_s"])
        results[str(m)] = per
        for v in variants:
            if isinstance(v, DappleVariant):
                v.runner.finish()
        del variants
        dist.barrier()
    return results
