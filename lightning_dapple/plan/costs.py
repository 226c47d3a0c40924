"""The cost model shared by planners and the simulator: per-stage times, bytes and memory.

DAPPLE 4.1 prices a plan from per-stage forward/backward times F_s, B_s, the AllReduce
time AR(P_s, g_s) of replicated stages, and inter-stage communication treated as stages
of their own. This module turns (profile, cluster, stages, micro-batch size) into those
numbers once, so the planner's formula (``dapple_latency``) and the discrete-event
simulator charge a plan exactly the same costs.

A stage replicated r ways runs a slice of micro_batch_size / r samples on each device
(split-concat, 5.2.2); times and activation bytes scale linearly with the slice, except a
cut's whole part (``LayerProfile.output_whole_bytes``: values the same for every sample),
which every slice holds once (``LayerProfile.cut_bytes``). A transfer is priced as one
micro-batch's cut split over the pairs; the whole part travels once to each receiver, so
with several receivers that prices it low by the extra copies.

Tied parameters (``ModelProfile.tied``) whose layers a plan puts on several stages live on
each of those stages: each holds their bytes (weights, gradients, optimizer state), its
own gradient buckets leave them out, and one more AllReduce over every device of those
stages sums their gradients (``StageCost.tied``, ``execute/tied.py``), as Megatron's
embedding group does for GPT's tied embedding.

A replicated stage with ``StagePlan.zero`` shards its optimizer over its d replicas
(``strategy/zero.py``): each device keeps the optimizer state of about 1/d of the stage's
parameters (whole parameters, largest first, so the shares differ by at most one
parameter), steps only those, and then every owner broadcasts what it stepped to the other
replicas (``zero_exchange_ms``). Under ``zero=2`` each gradient bucket is reduced onto the
owners of its parameters (``zero_reduce_ms``) instead of summed onto every replica, and each
device keeps only its share's gradients from then to the step. ``stage_costs`` charges those
times in the same fields the simulator and formula 2 already run (``optimizer_ms``,
``buckets``, ``allreduce_ms``), and ``weight_state_bytes`` the shares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.buckets import bucket_layers
from lightning_dapple.plan.plan import Prediction, StagePlan
from lightning_dapple.profile.action_overhead import NO_OVERHEAD, ActionOverhead
from lightning_dapple.profile.model_profile import (
    LayerProfile,
    ModelProfile,
    stash_span_bytes,
)


@dataclass(frozen=True)
class StageCost:
    """What one micro-batch costs on each device of a stage, and what the stage holds.

    ``send_ms`` is the time to move this stage's output boundary (one micro-batch) to the
    next stage; the gradient travels back over the same links in the same time. The
    recompute time is the extra forward a backward pays under recomputation.

    The fields after ``slice_size`` serve recomputation and out-of-order backprop (all
    zero/empty by default, so hand-made costs price neither):

    * ``recompute_ms``: the stage forward again before the backward of a recomputed
      micro-batch (gpipe.txt 2.3); ``forward_ms`` when the stage recomputes, else 0;
    * ``input_bytes``: what a recomputed micro-batch keeps instead of its stash (the stage
      input of one slice); ``wgrad_bytes``: the layer-output gradients one micro-batch
      keeps between its B and its deferred W (ooo-backprop sec. 3: "the weight gradient
      computation of a layer requires the layer's input and output gradient");
    * ``layer_weight_ms`` / ``layer_allreduce_ms``: per layer of the stage, the W time of
      one slice and the AllReduce time of its gradients (bucketed ending phase,
      ooo-backprop Algorithm 2);
    * ``buckets``: the gradient buckets of ``plan.buckets.bucket_layers`` in launch order,
      each as (backward time still to run after the bucket is ready, its AllReduce time).
      A bucket's AllReduce starts when the last micro-batch's backward has passed its
      layers, so only ``exposed_allreduce_ms`` outlasts the backward (DDP-style overlap,
      DAPPLE 6.3 "DP Overlap"). Hand-made costs without buckets charge ``allreduce_ms``
      after the backward, as one bucket;
    * ``tied``: the AllReduces of tied parameters this stage holds a copy of, as
      (index into ``ModelProfile.tied``, its time on the ring of every device of the
      stages holding it). Each runs after the stage's buckets, once every holding stage
      has got there (the executor issues it after its buckets); ``param_bytes`` includes
      the copy and ``allreduce_ms`` / ``buckets`` leave the tied bytes out;
    * ``optimizer_ms``: one optimizer step over the stage's parameters on each of its
      devices (the sum of its layers' ``LayerProfile.optimizer_ms``), after its gradient sync;
      a tied copy a stage holds for a later layer is not counted again. Under ZeRO
      (``zero`` > 0) a device steps its 1/``replicas`` share, and the parameter exchange
      after the step (``exchange_ms``) is included, so every reader of ``optimizer_ms``
      (the simulator's "OPT" span, formula 2's tail) charges both;
    * ``replicas`` / ``zero``: the stage's replica count and ZeRO level (module docstring),
      which ``weight_state_bytes`` reads; ``exchange_ms``: the ZeRO parameter exchange
      (``zero_exchange_ms``), already part of ``optimizer_ms``;
    * ``layer_accumulate_ms``: per layer, one add of its weight gradients into the ones
      already there (``LayerProfile.accumulate_ms``; ``accumulate_ms`` sums them), which the
      backward (or the deferred W) of every micro-batch after a step's first pays: the
      simulator charges it there, DAPPLE's formula spreads it as (M-1)/M per backward
      (``pipeline_phases``);
    * ``overhead``: the executor's own time per action (``ModelProfile.action_overhead_ms``),
      the same for every stage and slice. The times above are the layers' compute, plus
      on the stage holding the first layer (the last) the user's step around them
      (``ModelProfile.step_glue_ms``: the input's making in F; the loss and its logging in F,
      its backward in B and I), a fixed time per slice; the simulator adds ``overhead`` to
      every action it runs and DAPPLE's formula to every phase (``pipeline_phases``), so
      each charges it once.
    """

    forward_ms: float
    backward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    param_bytes: float
    stash_bytes: float
    output_bytes: float
    send_ms: float
    allreduce_ms: float
    slice_size: float
    recompute_ms: float = 0.0
    input_bytes: float = 0.0
    wgrad_bytes: float = 0.0
    layer_weight_ms: tuple[float, ...] = ()
    layer_allreduce_ms: tuple[float, ...] = ()
    buckets: tuple[tuple[float, float], ...] = ()
    tied: tuple[tuple[int, float], ...] = ()
    overhead: ActionOverhead = NO_OVERHEAD
    optimizer_ms: float = 0.0
    replicas: int = 1
    zero: int = 0
    exchange_ms: float = 0.0
    layer_accumulate_ms: tuple[float, ...] = ()

    @property
    def accumulate_ms(self) -> float:
        """One accumulation of the stage's weight gradients into those already there
        (``LayerProfile.accumulate_ms``): what every backward after a step's first pays."""
        return float(sum(self.layer_accumulate_ms))

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def allreduce_buckets(self) -> tuple[tuple[float, float], ...]:
        """``buckets``, or the whole AllReduce as one bucket ready at the backward's end."""
        if self.buckets:
            return self.buckets
        return ((0.0, self.allreduce_ms),) if self.allreduce_ms > 0 else ()

    @property
    def tied_allreduce_ms(self) -> float:
        """The time of the stage's tied-parameter AllReduces, one after another."""
        return sum(duration for _, duration in self.tied)

    @property
    def exposed_allreduce_ms(self) -> float:
        """The AllReduce time after the last backward ends (``exposed_tail``), the tied
        parameters' AllReduces after it."""
        return exposed_tail(self.allreduce_buckets) + self.tied_allreduce_ms

    @property
    def tail_ms(self) -> float:
        """What the stage still runs after its last backward: the exposed gradient sync and
        the optimizer step (the ending phase's per-stage term of DAPPLE formula 2)."""
        return self.exposed_allreduce_ms + self.optimizer_ms


def exposed_tail(buckets: Sequence[tuple[float, float]]) -> float:
    """How long gradient sync runs past the end of the backward.

    ``buckets`` are (backward still to run when the bucket is ready, AllReduce time) in
    launch order; they share one link, so each starts when it is ready and the previous
    one is done (torch DDP's reducer; DAPPLE 6.3's "DP Overlap").
    """
    finish = float("-inf")
    for remaining, duration in buckets:
        finish = max(finish, -remaining) + duration
    return max(finish, 0.0)


def stages_holding(layers: Iterable[int], stages: Sequence[StagePlan]) -> tuple[int, ...]:
    """The stages holding any of ``layers`` (of a tie: each keeps a copy of it), ascending."""
    wanted = set(layers)
    return tuple(s for s, stage in enumerate(stages) if any(stage.start <= layer < stage.end for layer in wanted))


def split_ties(profile: ModelProfile, stages: Sequence[StagePlan]) -> list[tuple[int, tuple[int, ...]]]:
    """The profile's tied parameters that ``stages`` split: (index into ``profile.tied``,
    the stages holding one of its layers), for those held by more than one stage."""
    out = []
    for index, tie in enumerate(profile.tied):
        holders = stages_holding(tie.layers, stages)
        if len(holders) > 1:
            out.append((index, holders))
    return out


def synced_layer_bytes(profile: ModelProfile, stages: Sequence[StagePlan]) -> list[list[float]]:
    """Per stage, per layer: the parameter bytes the stage's own gradient buckets sum.

    That is ``param_bytes``, less the bytes of a tie the plan splits in the layer that
    counts them (its first): those gradients are summed by the tie's own AllReduce. The
    executor buckets the same way (``execute/runner.py`` leaves tied parameters out)."""
    sizes = [[layer.param_bytes for layer in profile.layers[stage.start : stage.end]] for stage in stages]
    for index, holders in split_ties(profile, stages):
        tie = profile.tied[index]
        for s in holders:
            if stages[s].start <= tie.layers[0] < stages[s].end:
                position = tie.layers[0] - stages[s].start
                sizes[s][position] = max(sizes[s][position] - tie.param_bytes, 0.0)
    return sizes


def held_tied_bytes(profile: ModelProfile, stages: Sequence[StagePlan]) -> list[float]:
    """Per stage, the bytes of split ties it holds a copy of without counting them in its
    layers' ``param_bytes``: the tie's first layer is on another stage, and no stage on the
    same devices counts it already (chunks of one device group, a V schedule's first and
    last stage, hold one copy: the same ``nn.Parameter`` in one process)."""
    extra = [0.0] * len(stages)
    for index, holders in split_ties(profile, stages):
        tie = profile.tied[index]
        counted = {stages[s].devices for s in holders if stages[s].start <= tie.layers[0] < stages[s].end}
        for s in holders:
            if stages[s].devices not in counted:
                extra[s] += tie.param_bytes
                counted.add(stages[s].devices)
    return extra


def tied_allreduces(profile: ModelProfile, cluster: Cluster, stages: Sequence[StagePlan]) -> list[tuple[tuple[int, float], ...]]:
    """Per stage, ``StageCost.tied``: each split tie it holds, with the AllReduce time of
    the tie's bytes over every device of the stages holding it (each device once: stages
    on the same devices share one copy there)."""
    out: list[list[tuple[int, float]]] = [[] for _ in stages]
    for index, holders in split_ties(profile, stages):
        devices = tuple(sorted({d for s in holders for d in stages[s].devices}))
        duration = cluster.allreduce_ms(profile.tied[index].param_bytes, devices)
        for s in holders:
            out[s].append((index, duration))
    return [tuple(entries) for entries in out]


def stage_buckets(
    profile: ModelProfile, cluster: Cluster, stage: StagePlan, per_device: float, sizes: Sequence[float] | None = None
) -> tuple[tuple[float, float], ...]:
    """The buckets of ``StageCost.buckets`` for ``stage`` with slices of ``per_device`` x the
    profile batch (nothing to sync for an unreplicated stage); ``sizes`` are the bytes each
    layer syncs (default: its ``param_bytes``)."""
    if stage.replicas <= 1:
        return ()
    layers = profile.layers[stage.start : stage.end]
    sizes = [layer.param_bytes for layer in layers] if sizes is None else list(sizes)
    before = [0.0]  # backward of the stage's layers before each position
    for layer in layers:
        before.append(before[-1] + layer.backward_ms)
    out = []
    for lo, hi in bucket_layers(sizes, 0, len(layers)):
        out.append((before[lo] * per_device, gradient_sync_ms(cluster, sum(sizes[lo:hi]), stage)))
    return tuple(out)


def ring_ms(cluster: Cluster, volume_bytes: float, ranks: Sequence[int]) -> float:
    """A ring collective over ``ranks`` that moves ``volume_bytes`` over each link: the link
    model of ``Cluster.allreduce_ms`` (the ring's slowest link and one call's fixed cost),
    whose AllReduce of n bytes is ``ring_ms`` of 2 (r-1)/r x n."""
    if len(ranks) <= 1 or volume_bytes <= 0:
        return 0.0
    return volume_bytes / cluster.bytes_per_ms(cluster.ring_bandwidth_gbps(ranks)) + cluster.ring_latency_ms(len(ranks))


def zero_reduce_ms(cluster: Cluster, num_bytes: float, ranks: Sequence[int]) -> float:
    """A gradient bucket of ``num_bytes`` summed onto the owners of its parameters
    (``zero=2``) instead of onto every replica: the runtime reduces each owner's part to it
    (``execute/grad_sync.py``), each part crossing every link of the ring once, so the
    bucket's bytes over the ring's bandwidth plus one call per replica: about half an
    AllReduce's volume (2 (r-1)/r of the bytes) on large rings, the same on two replicas."""
    replicas = len(ranks)
    if replicas <= 1 or num_bytes <= 0:
        return 0.0
    return replicas * ring_ms(cluster, num_bytes / replicas, ranks)


def zero_exchange_ms(cluster: Cluster, param_bytes: float, ranks: Sequence[int]) -> float:
    """The parameters every replica sends the others after a ZeRO step (``strategy/zero.py``):
    one broadcast per replica of the share it stepped (about 1/r of ``param_bytes``), each
    crossing every link of the ring once, so the stage's parameter bytes over the ring's
    bandwidth plus r calls' fixed cost. (One all-gather would move (r-1)/r of the bytes in one
    call; the runtime broadcasts, and this prices what it runs.)"""
    replicas = len(ranks)
    if replicas <= 1 or param_bytes <= 0:
        return 0.0
    return replicas * ring_ms(cluster, param_bytes / replicas, ranks)


def _zero_of(stage: StagePlan) -> int:
    """The stage's ZeRO level where it has replicas to shard over, else 0."""
    return stage.zero if stage.replicas > 1 else 0


def gradient_sync_ms(cluster: Cluster, num_bytes: float, stage: StagePlan) -> float:
    """The replicas' sync of ``num_bytes`` of a stage's gradients: an AllReduce (DAPPLE
    4.1's AR(P_s, g_s)), or under ``zero=2`` the reduce onto their owners."""
    if _zero_of(stage) >= 2:
        return zero_reduce_ms(cluster, num_bytes, stage.devices)
    return cluster.allreduce_ms(num_bytes, stage.devices)


def slice_size(micro_batch_size: int, replicas: int) -> int:
    """Largest slice a replica runs: micro-batches are cut into near-equal row ranges."""
    return math.ceil(micro_batch_size / replicas)


def stage_costs(
    profile: ModelProfile,
    cluster: Cluster,
    stages: Sequence[StagePlan],
    micro_batch_size: int,
) -> list[StageCost]:
    """Per-stage costs of ``stages`` for micro-batches of ``micro_batch_size`` samples."""
    costs = []
    synced = synced_layer_bytes(profile, stages)
    extra_bytes = held_tied_bytes(profile, stages)
    tied = tied_allreduces(profile, cluster, stages)
    uses_tied = {layer for tie in profile.tied for layer in tie.layers}
    for index, stage in enumerate(stages):
        layers = profile.span(stage.start, stage.end)
        per_device = profile.scale(slice_size(micro_batch_size, stage.replicas))
        whole = profile.scale(micro_batch_size)
        output_bytes = layers[-1].cut_bytes(whole)
        send_ms = 0.0
        if index + 1 < len(stages):
            send_ms = cluster.p2p_ms(output_bytes, stage.devices, stages[index + 1].devices)
        param_bytes = sum(layer.param_bytes for layer in layers) + extra_bytes[index]
        sync_bytes = sum(synced[index])
        if stage.start > 0:
            input_bytes = profile.layers[stage.start - 1].cut_bytes(per_device)
        else:
            input_bytes = profile.input_slice_bytes(per_device)
        layer_ar = tuple(gradient_sync_ms(cluster, size, stage) if stage.replicas > 1 and size > 0 else 0.0 for size in synced[index])
        forward_ms = sum(layer.forward_ms for layer in layers) * per_device
        first, last = stage.start == 0, stage.end == profile.num_layers  # where the user's step runs
        glue_backward = profile.step_glue_ms.backward_ms(last)
        zero = _zero_of(stage)
        exchange = zero_exchange_ms(cluster, param_bytes, stage.devices) if zero else 0.0
        step_share = 1.0 / stage.replicas if zero else 1.0
        costs.append(
            StageCost(
                forward_ms=forward_ms + profile.step_glue_ms.forward_ms(first, last),
                backward_ms=sum(layer.backward_ms for layer in layers) * per_device + glue_backward,
                backward_input_ms=sum(layer.input_grad_ms for layer in layers) * per_device + glue_backward,
                backward_weight_ms=sum(layer.weight_grad_ms for layer in layers) * per_device,
                param_bytes=param_bytes,
                stash_bytes=stash_span_bytes(layers, per_device),
                output_bytes=output_bytes,
                send_ms=send_ms,
                allreduce_ms=gradient_sync_ms(cluster, sync_bytes, stage),
                slice_size=slice_size(micro_batch_size, stage.replicas) / 1.0,
                # the replay is the layers' forward again (not the user's step), with a forward's own overhead
                recompute_ms=forward_ms + profile.action_overhead_ms.forward if stage.recompute != "never" else 0.0,
                input_bytes=input_bytes,
                wgrad_bytes=_wgrad_bytes(
                    layers, [layer.param_bytes > 0 or stage.start + position in uses_tied for position, layer in enumerate(layers)], per_device
                ),
                layer_weight_ms=tuple(layer.weight_grad_ms * per_device for layer in layers),
                layer_allreduce_ms=layer_ar,
                buckets=stage_buckets(profile, cluster, stage, per_device, synced[index]),
                tied=tied[index],
                overhead=profile.action_overhead_ms,
                optimizer_ms=sum(layer.optimizer_ms for layer in layers) * step_share + exchange,
                replicas=stage.replicas,
                zero=zero,
                exchange_ms=exchange,
                layer_accumulate_ms=tuple(layer.accumulate_ms for layer in layers),
            )
        )
    return costs


def _wgrad_bytes(layers: Sequence[LayerProfile], weighted: Sequence[bool], per_device: float) -> float:
    """What one slice keeps between its B and its deferred W: per layer with weight work
    (``weighted``), its output gradient or its stash, whichever is larger, taken apart for
    the per-sample parts (scaled) and the whole parts (once). A whole value the layer before
    also saves (``stash_shared_whole_bytes``: a rotary table each layer saves and passes on)
    is one tensor, kept once while both layers wait for their W, as ``span_stash_whole``
    counts it in the stash."""
    per_sample = sum(max(layer.output_bytes, layer.stash_bytes) for layer, kept in zip(layers, weighted) if kept) * per_device
    whole = 0.0
    for index, (layer, kept) in enumerate(zip(layers, weighted)):
        if kept:
            shared = layer.stash_shared_whole_bytes if index and weighted[index - 1] else 0.0
            whole += max(layer.output_whole_bytes, layer.stash_whole_bytes - shared)
    return per_sample + whole


def weight_state_factor(replicas: int, zero: int, optimizer_state_factor: float) -> float:
    """Bytes one device holds per byte of a stage's parameters at its peak: the weights, the
    gradients and ``optimizer_state_factor`` of optimizer state (2.0 for fp32 Adam: 16 bytes
    per fp32 parameter, DAPPLE Table 7). ZeRO keeps 1/``replicas`` of the state on each
    replica (``zero`` >= 1; the shares are whole parameters, so 1/d is the balanced share,
    at most one parameter off). The gradients stay whole at the peak even under ``zero=2``:
    every micro-batch's backward adds into the stage's whole gradient, and the other shares
    are dropped only when the last one's buckets are reduced, while the stash of the
    micro-batches in flight (5.3) lies in the steps before that; ZeRO-2's share of the
    gradients is what a device holds from then until the step."""
    if zero <= 0 or replicas <= 1:
        return 2.0 + optimizer_state_factor
    return 2.0 + optimizer_state_factor / replicas


def weight_state_bytes(cost: StageCost, cluster: Cluster) -> float:
    """Weights, gradients and optimizer state on one device of the stage (``weight_state_factor``)."""
    return cost.param_bytes * weight_state_factor(cost.replicas, cost.zero, cluster.optimizer_state_factor)


def stage_memory_bytes(cost: StageCost, in_flight: int, cluster: Cluster) -> float:
    """Peak bytes on one device of a stage: weights, gradients and optimizer state
    (``weight_state_bytes``: ZeRO's shares where the stage shards), plus the activations of
    ``in_flight`` micro-batch slices (K_i under DAPPLE 5.3, M under GPipe)."""
    return weight_state_bytes(cost, cluster) + in_flight * cost.stash_bytes


def stage_memory_from_stash(cost: StageCost, peak_stash_bytes: float, cluster: Cluster) -> float:
    """``stage_memory_bytes`` with the activation term given as bytes: the peak of a
    schedule's stash walk (``schedule.actions.stash_walk``), which accounts for recomputed
    micro-batches (input only) and deferred W work (stash plus output gradients)."""
    return weight_state_bytes(cost, cluster) + peak_stash_bytes


def step_lower_bound(costs: Sequence[StageCost], micro_batches: int) -> float:
    """No schedule of these stages (any K_i, GPipe or early backward) ends a step sooner.

    Stage s cannot start before the first micro-batch's forward has crossed the stages and
    links before it; it then runs M forwards and M backwards, and after its last input
    gradient (B, which with out-of-order backprop may precede some of its weight-gradient
    work W) that gradient still has to cross back through the stages before it:
    ``F_<s + M (F_s + B_s)`` and ``F_<s + M (F_s + Bin_s) + Bin_<s``, where ``X_<s`` sums
    X_t plus the link's transfer over the stages t before s.
    """
    best = 0.0
    forward_path = 0.0
    backward_path = 0.0
    for cost in costs:
        best = max(
            best,
            forward_path + micro_batches * (cost.forward_ms + cost.backward_ms),
            forward_path + micro_batches * (cost.forward_ms + cost.backward_input_ms) + backward_path,
        )
        forward_path += cost.forward_ms + cost.send_ms
        backward_path += cost.backward_input_ms + cost.send_ms
    return best


def pipeline_phases(costs: Sequence[StageCost], micro_batches: int = 1) -> list[tuple[float, float, float]]:
    """(F, B, AR) of every stage of DAPPLE's formula, communication stages included.

    AR is the AllReduce tail the backward does not hide (``exposed_allreduce_ms``) and the
    optimizer step after it (``tail_ms``): DAPPLE's formula 2 charges AR(P_s, g_s) after the
    stage's last backward, while the runtime (and the simulator) start each gradient bucket
    as soon as its layers' last backward is done.

    4.1: "we consider inter-stage communication as an independent stage alongside the
    computation stages"; its AR is 0 and its F and B are the transfer times.
    The backward of a stage that recomputes includes its ``recompute_ms`` (charged for
    every micro-batch: an upper bound for ``except_last``). Each computation phase also pays
    the executor's own time per micro-batch (``ActionOverhead.per_microbatch``: the F or B
    and the receive and send around it), as the simulator charges it action by action, and
    the accumulation of its weight gradients (``StageCost.accumulate_ms``) on M - 1 of the
    ``micro_batches`` backwards, spread over all M.
    """
    phases: list[tuple[float, float, float]] = []
    accumulating = (micro_batches - 1) / micro_batches if micro_batches > 1 else 0.0
    for index, cost in enumerate(costs):
        forward_extra, backward_extra = cost.overhead.per_microbatch(receives=index > 0, sends=index + 1 < len(costs))
        backward = cost.backward_ms + cost.recompute_ms + backward_extra + accumulating * cost.accumulate_ms
        phases.append((cost.forward_ms + forward_extra, backward, cost.tail_ms))
        if index + 1 < len(costs) and cost.send_ms > 0:
            phases.append((cost.send_ms, cost.send_ms, 0.0))
    return phases


def walk_pivot(phases: Sequence[tuple[float, float, float]], pivot: int, m1: int) -> int:
    """Algorithm 1 of DAPPLE 4.3 continued from ``pivot`` towards stage 0, for M - 1 = ``m1``.

    The paper's line 5-6 adds F+B of the stages strictly between s and Q. Comparing
    like with like needs Q's own F+B too: moving the pivot from Q to s removes Q's
    warm-up forward and ending backward from the estimate, so the test must charge
    them. Without it the pivot can move to a stage whose estimate is *smaller*, and the
    formula undercuts the simulator (e.g. 12:11 uniform layers, M=2: 72 vs 102 ms).
    With it, each move picks the larger of two lower bounds on the latency."""
    for s in range(pivot - 1, -1, -1):
        own = m1 * (phases[s][0] + phases[s][1])
        current = m1 * (phases[pivot][0] + phases[pivot][1])
        current += sum(phases[k][0] + phases[k][1] for k in range(s + 1, pivot + 1))
        if own > current:
            pivot = s
    return pivot


def pivot_stage(phases: Sequence[tuple[float, float, float]], micro_batches: int) -> int:
    """Algorithm 1 of DAPPLE 4.3: walk from the last stage back (``walk_pivot``)."""
    return walk_pivot(phases, len(phases) - 1, micro_batches - 1)


def ending_phase(phases: Sequence[tuple[float, float, float]], q: int, floor: float = 0.0) -> float:
    """T_e of formula 2 for pivot ``q``: over all stages s, the AllReduce tail of s plus the
    backward work between the pivot and s (see ``dapple_latency``), at least ``floor``."""
    ending = floor
    for s, (_, _, allreduce) in enumerate(phases):
        if s <= q:
            tail = sum(phases[a][1] for a in range(s, q + 1))
        else:
            tail = -sum(phases[a][1] for a in range(q + 1, s + 1))
        ending = max(ending, allreduce + tail)
    return ending


def pivot_parts(phases: Sequence[tuple[float, float, float]], q: int, m1: int) -> tuple[float, float, float]:
    """For pivot ``q``: (warm-up + steady phase, ending phase without a floor, backward
    work after the pivot) -- the pieces the search combines incrementally."""
    warm = sum(phases[s][0] for s in range(q + 1))
    steady = m1 * (phases[q][0] + phases[q][1])
    after = sum(phases[a][1] for a in range(q + 1, len(phases)))
    return warm + steady, ending_phase(phases, q, float("-inf")), after


def dapple_latency(
    costs: Sequence[StageCost],
    micro_batches: int,
    memory_bytes: Sequence[float] = (),
) -> Prediction:
    """Pipeline latency L = T_w + T_s + T_e of DAPPLE formulas 1-2.

    The ending phase takes, over all stages s, the AllReduce of s plus the backward work
    between the pivot and s: for s <= Q the last micro-batch's backward still has to run
    B_Q ... B_s; a stage s > Q finished its last backward B_{Q+1} + ... + B_s before Q's
    last backward starts. (The paper prints the second sum from a = Q; counting B_Q there
    would let a later stage's AllReduce start before Q's last backward is even scheduled
    and disagrees with the simulator, so the sum starts at Q + 1.)
    The pivot index reported is that of the computation stage (communication stages are
    never chosen as a pivot unless the transfer dominates; then the sender is reported).
    """
    phases = pipeline_phases(costs, micro_batches)
    q = pivot_stage(phases, micro_batches)
    warmup = sum(phases[s][0] for s in range(q + 1))
    steady = (micro_batches - 1) * (phases[q][0] + phases[q][1])
    ending = ending_phase(phases, q)
    return Prediction(
        latency_ms=warmup + steady + ending,
        warmup_ms=warmup,
        steady_ms=steady,
        ending_ms=ending,
        pivot_stage=_computation_index(costs, q),
        memory_bytes=tuple(memory_bytes),
    )


def _computation_index(costs: Sequence[StageCost], phase_index: int) -> int:
    """Map an index into ``pipeline_phases`` back to the computation stage it belongs to."""
    index = 0
    for stage, cost in enumerate(costs):
        if index == phase_index:
            return stage
        index += 1
        if stage + 1 < len(costs) and cost.send_ms > 0:
            if index == phase_index:
                return stage
            index += 1
    return len(costs) - 1
