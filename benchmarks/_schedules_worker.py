"""Worker side of ``bench_schedules.py``: every variant on the same spawned gloo ranks.

Each rank builds, for one micro-batch count M, trainers of the same MLP from the same seed
(so their first-step losses must agree), then runs them round-robin so that machine noise
hits all variants alike. Two modes:

* 2 ranks, one stage each (``run``'s default, ``cfg["chunks"] == 1``):

  * ``dapple`` / ``gpipe``: lightning_dapple's ``StageRunner`` with that schedule (receives
    posted where ``transport.receives_ahead_pay`` says, as users get it);
  * ``dapple-ahead``: the dapple schedule with every receive posted one transfer ahead (the
    ablation behind that rule);
  * ``torch-1F1B`` / ``torch-GPipe``: ``torch.distributed.pipelining`` ``PipelineStage`` with
    ``Schedule1F1B`` / ``ScheduleGPipe``;
  * ``ddp``: ``DistributedDataParallel`` of the whole model, each rank half the batch.

* P ranks, 2 stages (chunks) each (``cfg["chunks"] == 2``), 2P stages of equal layers:

  * ``interleaved`` / ``zbv``: lightning_dapple's executor running the chunked plan (stage k
    on rank k mod P, Megatron's interleaved placement; or on rank k for k < P and 2P-1-k
    after, ZB-V's V), ``StageRunner.for_plan`` as the strategy builds it;
  * ``torch-Interleaved1F1B`` / ``torch-ZBVZeroBubble``: two ``PipelineStage``s per rank with
    the same placement under ``ScheduleInterleaved1F1B`` / ``ScheduleZBVZeroBubble``;
  * ``dapple`` / ``torch-1F1B``: one stage per rank, the 1F1B reference;
  * with ``cfg["settle_ablation"]``: ``interleaved-nosettle`` / ``zbv-nosettle``, every send
    waited at the end of the step instead of at its settle point;
  * with ``cfg["policy_ablation"]``: ``interleaved-PB``, ours under the K_i policy P_B, whose
    forwards before the first backward are Megatron's count (torch's schedule runs it too);
  * with ``cfg["due_ablation"]``: ``interleaved-due`` / ``zbv-due``, every receive posted
    when its action is due, never ahead (the rule for one stage per rank without a core to
    spare; the chunked schedules post ahead whenever every rank has a core).

  After the first step every variant's parameters are compared with one SGD step of the
  whole model in one process (``parameter_diff``).

Peak stashed bytes are measured the same way for every variant by ``LiveStash`` (see its
docstring) in one extra, untimed step; for the lightning_dapple variants
``runner.stats.peak_stash_bytes`` of that step is reported as well.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict

LR = 1e-3
SEED = 1234
VARIANTS = ("dapple", "dapple-ahead", "gpipe", "torch-1F1B", "torch-GPipe", "ddp")
CHUNKED_VARIANTS = ("interleaved", "zbv", "torch-Interleaved1F1B", "torch-ZBVZeroBubble", "dapple", "torch-1F1B")


def stage_ranks(placement: str, ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """The rank of each of ``ranks * chunks`` stages: ``straight`` (one stage per rank),
    ``interleaved`` (stage k on rank k mod P: Megatron's placement, Narayanan et al. 2021
    section 2.2) or ``v`` (ranks 0..P-1 then back P-1..0: ZB-V's, Qi et al. 2024 section 6)."""
    stages = range(ranks * chunks)
    if placement == "straight":
        assert chunks == 1, "a straight pipeline has one stage per rank"
        return tuple(stages)
    if placement == "interleaved":
        return tuple(k % ranks for k in stages)
    assert placement == "v" and chunks == 2, "the V placement has exactly 2 stages per rank"
    return tuple(k if k < ranks else 2 * ranks - 1 - k for k in stages)


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Equal cuts of ``layers`` blocks into ``stages`` consecutive ranges."""
    per = layers // stages
    return [(k * per, (k + 1) * per) for k in range(stages)]


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
    held: dict[int, nn.Module]  # global block index -> this rank's copy of it

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
        placement: Sequence[int] = (0, 1),
        policy: str = "PA",
        policy_in_name: bool = False,
    ) -> None:
        # post_ahead None: the executor decides (what a user gets); True / False: ablation rows
        # with every receive posted ahead / when due;
        # settle_sends False: every send waited only at the end of the step (ablation);
        # ooo: out-of-order backprop, what DappleStrategy runs by default (ooo=True);
        # placement: the rank of each stage (equal cuts of the blocks), several stages per
        # rank for the chunked schedules; policy: the K_i policy (PB: Megatron's warm-up
        # count, which torch's Interleaved1F1B runs too), named only in the policy ablation
        self.name = (
            schedule + {None: "", True: "-ahead", False: "-due"}[post_ahead] + ("" if settle_sends else "-nosettle") + ("-ooo" if ooo else "")
            + (f"-{policy}" if policy_in_name else "")
        )
        cuts = stage_layers(cfg["layers"], len(placement))
        plan = plan_from_dict(
            {
                "global_batch_size": cfg["batch"],
                "micro_batches": micro_batches,
                "schedule": schedule,
                "policy": policy,
                "ooo": ooo,
                "stages": [{"layers": list(cut), "devices": [r]} for cut, r in zip(cuts, placement)],
            }
        )
        blocks = make_blocks(cfg["width"], cfg["layers"])
        # the rank's blocks, its stages' ranges in pipeline order (what for_plan expects)
        indices = [i for stage in plan.stages_of_rank(rank) for i in range(*cuts[stage])]
        self.held = {i: blocks[i] for i in indices}
        self.runner = StageRunner.for_plan(
            plan,
            rank,
            [blocks[i] for i in indices],
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
        # The executor meters its layers' saves (with hooks that would shadow ours) only in
        # the first step of a batch layout; this step comes after the warm-up, so ours see
        # every saved tensor. The buffers of sends not yet waited: ``_send_probe``.
        from _send_probe import PendingSendBytes

        with PendingSendBytes(self.runner.transport) as sends:
            stash = super().measure_stash(batch)
        return {
            **stash,
            "runner_peak_stash_bytes": self.runner.stats.peak_stash_bytes,
            "runner_peak_in_flight": self.runner.stats.peak_in_flight,
            "runner_peak_send_bytes": sends.peak,
        }


class TorchPipeVariant(Variant):
    """``torch.distributed.pipelining``: one ``PipelineStage`` per stage this rank holds,
    under the schedule class ``Schedule<kind>`` (single-stage kinds ``1F1B``, ``GPipe``;
    multi-stage ``Interleaved1F1B``, ``ZBVZeroBubble``, whose own stage-to-rank rules match
    ``placement``)."""

    def __init__(self, kind: str, rank: int, cfg: dict, micro_batches: int, placement: Sequence[int] = (0, 1)) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        self.name = f"torch-{kind}"
        self.rank = rank
        self.last_rank = placement[-1]
        cuts = stage_layers(cfg["layers"], len(placement))
        blocks = make_blocks(cfg["width"], cfg["layers"])
        mine = [stage for stage, r in enumerate(placement) if r == rank]
        self.holds_first, self.holds_last = 0 in mine, len(placement) - 1 in mine
        self.held = {i: blocks[i] for stage in mine for i in range(*cuts[stage])}
        example = torch.empty(cfg["batch"] // micro_batches, cfg["width"])
        stages = [
            pipelining.PipelineStage(
                nn.Sequential(*blocks[slice(*cuts[stage])]), stage, len(placement), torch.device("cpu"), input_args=(example,)
            )
            for stage in mine
        ]
        self.stages = stages
        self.stage = stages[0]  # the rank's only stage under the single-stage schedules
        cls = getattr(pipelining, f"Schedule{kind}")
        # loss_fn is a mean over the micro-batch; scale_grads (default) divides the
        # accumulated gradients by M, so they are those of the mean over the global batch.
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, n_microbatches=micro_batches, loss_fn=F.mse_loss)
        self.params = [p for block in self.held.values() for p in block.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=LR)

    def forward_backward(self, batch: Any) -> Any:
        self.optimizer.zero_grad(set_to_none=True)
        x, y = batch
        args = (x,) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=y if self.holds_last else None, losses=losses, return_outputs=False)
        return losses

    def global_loss(self, handle: Any) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if self.holds_last:  # equal micro-batches: the mean of their means is the batch mean
            value += sum(float(loss.detach()) for loss in handle) / len(handle)
        dist.broadcast(value, src=self.last_rank)
        return float(value)


class DDPVariant(Variant):
    def __init__(self, rank: int, world: int, cfg: dict) -> None:
        self.name = "ddp"
        self.rank, self.world = rank, world
        model = nn.Sequential(*make_blocks(cfg["width"], cfg["layers"]))
        self.held = dict(enumerate(model))
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


def reference_step(cfg: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[nn.Sequential, float, float]:
    """The whole model after one SGD step on ``batch`` in one process, the step's largest
    parameter change and the largest parameter (the scales the variants' differences are
    read against: a gradient summed in another order moves the rounding of ``p - lr * g``
    by an ulp of ``p``)."""
    model = nn.Sequential(*make_blocks(cfg["width"], cfg["layers"]))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    F.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()
    change = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    return model, change, max(float(p.detach().abs().max()) for p in model.parameters())


def parameter_diff(variant: Variant, reference: nn.Sequential) -> float:
    """Largest |parameter - reference| over every block, whichever rank holds it (collective)."""
    diff = 0.0
    for index, block in variant.held.items():
        for ours, theirs in zip(block.parameters(), reference[index].parameters()):
            diff = max(diff, float((ours.detach() - theirs.detach()).abs().max()))
    worst = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def make_variants(rank: int, world: int, cfg: dict, m: int, failure: FailureChannel) -> list[Variant]:
    """The variants of ``cfg``'s mode, in ``VARIANTS`` / ``CHUNKED_VARIANTS`` order."""
    if cfg.get("chunks", 1) == 1:
        return [
            DappleVariant("dapple", rank, cfg, m, failure),
            DappleVariant("dapple", rank, cfg, m, failure, post_ahead=True),
            DappleVariant("gpipe", rank, cfg, m, failure),
            TorchPipeVariant("1F1B", rank, cfg, m),
            TorchPipeVariant("GPipe", rank, cfg, m),
            DDPVariant(rank, world, cfg),
        ]
    interleaved, v = stage_ranks("interleaved", world, cfg["chunks"]), stage_ranks("v", world, cfg["chunks"])
    straight = stage_ranks("straight", world)
    # each chunked schedule's K_i policy: the one plan="auto" runs (bench_schedules.planner_policies)
    chosen = {kind: item["policy"] for kind, item in cfg.get("policies", {}).get(str(m), {}).items()}
    policy = {"interleaved": chosen.get("interleaved", "PA"), "zbv": chosen.get("zbv", "PA")}
    # the settle ablation: the chunked schedules with every send waited at the end of the step
    ablation = (("interleaved", interleaved), ("zbv", v)) if cfg.get("settle_ablation") else ()
    # the receives-when-due ablation: no receive posted ahead, whatever the cores
    due = (("interleaved", interleaved), ("zbv", v)) if cfg.get("due_ablation") else ()
    # the policy ablation: interleaved under the policy not chosen
    other = "PB" if policy["interleaved"] == "PA" else "PA"
    return [
        DappleVariant("interleaved", rank, cfg, m, failure, placement=interleaved, policy=policy["interleaved"]),
        DappleVariant("zbv", rank, cfg, m, failure, placement=v, policy=policy["zbv"]),
        TorchPipeVariant("Interleaved1F1B", rank, cfg, m, placement=interleaved),
        TorchPipeVariant("ZBVZeroBubble", rank, cfg, m, placement=v),
        DappleVariant("dapple", rank, cfg, m, failure, placement=straight),
        TorchPipeVariant("1F1B", rank, cfg, m, placement=straight),
        *(DappleVariant(kind, rank, cfg, m, failure, settle_sends=False, placement=where, policy=policy[kind]) for kind, where in ablation),
        *(
            [DappleVariant("interleaved", rank, cfg, m, failure, placement=interleaved, policy=other, policy_in_name=True)]
            if cfg.get("policy_ablation")
            else []
        ),
        *(DappleVariant(kind, rank, cfg, m, failure, post_ahead=False, placement=where, policy=policy[kind]) for kind, where in due),
    ]


def run(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    results: dict[str, Any] = {}
    chunked = cfg.get("chunks", 1) > 1
    for m in cfg["micro_batches"]:
        variants = make_variants(rank, world, cfg, m, failure)
        per: dict[str, dict[str, Any]] = {v.name: {"times_s": [], "cpu_s": [], "blocks": sorted(v.held)} for v in variants}
        batches = [make_batch(step, cfg["batch"], cfg["width"]) for step in range(4)]
        # step 0 (identical weights and batch everywhere): the correctness check
        for v in variants:
            seconds, _, loss = _timed(v, batches)
            per[v.name]["first_loss"] = loss
            per[v.name]["first_step_s"] = seconds
        if chunked:  # the gradients of step 0, read in the parameters it updated
            reference, change, largest = reference_step(cfg, batches[0])
            for v in variants:
                per[v.name]["param_diff_after_one_step"] = parameter_diff(v, reference)
                per[v.name]["largest_param_change"] = change
                per[v.name]["largest_param"] = largest
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
