"""DAPPLE's planner (section 4): partition, replication and placement that minimise formula 2.

The search is the dynamic programme of DAPPLE 4.3 (formulas 4-5). A sub-problem
``T_PL(j, m, g)`` has planned the first ``j`` layers as complete stages on the device set
``g`` (``m = |g|``); the unplanned layers form one last stage replicated on the other
``G - m`` devices, so every sub-problem is itself a complete plan with a latency (formula
2). A step splits that last stage at ``j'`` and gives the new stage ``m'`` devices chosen by
one of the placement policies of 4.2 (``placement.py``: Fresh First, Append First, Scatter
First, plus three variants of ours on clusters of up to 16 devices); the layers after ``j'``
stay one stage on the rest. DP (one stage on all G devices) and the straight pipeline (one device per
stage) are both points of this space.

How this differs from a literal reading, and why:

* **Pivot, incrementally (4.3).** Algorithm 1 walks from the last stage towards the first.
  For a prefix we precompute where that walk would go once it enters the prefix: with
  ``h_s = (M-1)(F_s+B_s) - sum_{s<t<=e}(F_t+B_t)`` the walk moves into the prefix at the
  largest ``s`` with ``h_s > X`` (``X`` being the current pivot's steady time plus the work
  after the prefix up to and including the pivot, as ``costs.pivot_stage`` charges it), and
  from there on it only sees prefix stages, so its end point is precomputed too.
  Appending a stage therefore costs O(log S), not a re-walk, and the latency computed is
  formula 2 itself (up to float rounding of the transfer times; every returned plan is
  re-priced with ``costs.dapple_latency``).
* **Several candidates per sub-problem.** Formula 2 has no optimal substructure: the prefix
  that is best with one remainder is not always best once the remainder is split further
  (the pivot may move). The paper keeps one plan per sub-problem; we keep a small Pareto set
  (``keep_per_state`` candidates) over the quantities through which a prefix influences any
  completion: its forward sum (warm-up), its backward-plus-AllReduce tail (ending phase),
  its strongest pivot claim ``max h_s``, its largest F+B, how many further stages its
  memory allows, and the paper's own T_PL; the kept ones are the best by ``_rank``.
  tests/test_planner_optimality.py shows a case where one candidate is not enough.
* **Symmetry of the placement state (4.2).** Costs depend on which devices share a machine,
  not on machine or device numbers: permuting machines, or devices within a machine,
  consistently across a whole plan leaves every ``allreduce_ms`` (one ring bandwidth
  decision) and, with each stage's ranks kept in machine order, every split-concat
  ``p2p_ms`` unchanged up to the order in which machines are visited. The placement
  policies only look at per-machine free counts, and the cost of the next transfer only at
  how the last stage sits on the machines. So a sub-problem is keyed by
  ``(j, sorted((free_k, last_k) for every machine k))`` -- free devices and devices of the
  last planned stage per machine, machines unordered -- and one concrete placement per
  candidate is kept and priced exactly. (Where two keyed-equal states differ in machine
  order the split-concat pairing can differ; every plan returned is priced on its concrete
  ranks with ``stage_costs``, so this only affects which candidates are explored.)
* **Branch and bound** (``lower_bound``). For any plan, formula 2 with ``costs.pivot_stage``
  satisfies ``L >= (M-1) max_s (F_s+B_s)`` over all stages, communication stages included,
  and ``L >= sum_{s in prefix} (F_s+B_s) + M * (work after the prefix) / (devices left)``
  for every prefix of stages. (Proof sketch: the warm-up, steady phase and the ending term of
  stage 0 give ``L >= FB_{0..Q} + (M-1) FB_Q``; every move of Algorithm 1 to a stage s
  needs ``(M-1) FB_s > (M-1) FB_Q + FB_{s+1..Q}``, and every stage it passes over satisfies
  the reverse, which telescopes into ``FB_{a..Q} + (M-1) FB_Q >= M FB_s`` for each stage s
  from a on, whether the pivot ends up inside the prefix or after it; a suffix on f devices
  has a stage with ``F+B >= its work / f``.) A prefix whose bound reaches the ``rerank``-th
  best complete plan found so far is dropped, and the new stage's end ``j'`` is bracketed
  with the bound's monotone parts.
* **Effort by size** (``search_effort``). Small instances get the full Pareto sets; large
  ones a beam per layer plus a local polish (``polish``) of the best results.
* **Micro-batches.** M is searched over the divisors of the global batch whose micro-batch
  is at least ``min_slice`` samples (see ``evaluate.py`` for why there is a floor); a stage
  may have at most ``micro_batch_size // min_slice`` replicas.
Files: ``request.py`` (the planning request), ``search_tables.py`` (range sums),
``partial.py`` (partial plans and the sets kept of them), ``search.py`` (one DP run for a
fixed M), ``polish.py`` (local edits), ``baselines.py`` (DP, straight, balanced cuts),
``choice.py`` (the one-line reason); the latency model itself is ``costs.py``.

* **Re-ranking.** The best ``rerank`` plans under the formula, the same plans with evenly
  balanced layer cuts (``balanced_variant``), and DP and the straight pipeline when valid
  and within memory, are simulated (``simulate_plan``); the fastest simulated plan is
  returned. The formula ignores bubbles inside the pivot stage (4.1) and lets a stage
  before the pivot be heavier than the pivot; the simulator does not. For the same reason
  DP is simulated first and the search keeps only plans whose formula latency is below
  DP's simulated step (``_run_searches``): when DP wins, most of the search is pruned.
"""
from __future__ import annotations

from typing import Any, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.baselines import (
    balanced_variant,
    data_parallel_candidates,
    smallest_memory,
    straight_candidates,
)
from lightning_dapple.plan.choice import describe_choice, pair_for, summary
from lightning_dapple.plan.communicators import communicators_per_rank
from lightning_dapple.plan.evaluate import Scored, finish_plan, raise_no_memory
from lightning_dapple.plan.partial import RawStages, TopPlans
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.plan.policy_choice import (
    PolicyChoice,
    rescored,
    simulate_policies,
)
from lightning_dapple.plan.polish import polish
from lightning_dapple.plan.request import PlanRequest, StepPricer
from lightning_dapple.plan.search import SearchSettings, SharedMemo, StageSearch
from lightning_dapple.plan.search_tables import RangeTables, p2p_ms_fast
from lightning_dapple.plan.zero_choice import (
    per_level,
    refine_zero,
    whole_twin,
    zero_note,
)
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = [
    "plan_dapple",
    "dapple_search",
    "search_effort",
    "lower_bound",
    "polish",
    "balanced_variant",
    "data_parallel_candidates",
    "straight_candidates",
    "describe_choice",
    "p2p_ms_fast",
    "PlanRequest",
]

_INF = float("inf")
SMALL_INSTANCE = 256  # layers x devices up to which the search keeps everything it can


def _to_stages(raw: RawStages, zero: int = 0) -> tuple[StagePlan, ...]:
    """A search result's stages, the replicated ones at ZeRO level ``zero``."""
    return tuple(StagePlan(layers=(a, b), devices=tuple(sorted(devices)), zero=zero if len(devices) > 1 else 0) for a, b, devices in raw)


def search_effort(num_layers: int, num_devices: int, keep_per_state: int | None = None, beam: int | None | str = "auto") -> tuple[int, int | None]:
    """(candidates kept per sub-problem, sub-problems expanded per layer) for an instance.

    Small instances (layers x devices <= 256, which covers every exhaustive check) keep four
    non-dominated candidates per sub-problem and no beam: the search then matches brute force
    (tests/test_planner_optimality.py). Larger ones keep two and expand, per number of
    planned layers j, only 16 sub-problems (8 beyond 4096 layers x devices), half with the
    lowest bound and half with the lowest T_PL, admitting 4x as many; the best results are
    then polished by local edits (``polish``). This keeps BERT-48 on 16 devices near half a
    second and 128 layers on 64 devices near two (docs/planning.md, "Planning speed"), at a cost of a
    few percent of formula latency on the hardest Table 4 cases (benchmarks/bench_planner.py
    measures it).
    """
    small = num_layers * num_devices <= SMALL_INSTANCE
    if keep_per_state is None:
        keep_per_state = 4 if small else 2
    if beam == "auto":
        beam = None if small else (16 if num_layers * num_devices <= 4 * 1024 else 8)
    if beam is not None and (not isinstance(beam, int) or beam < 1):
        raise DappleConfigError("beam", f"must be a positive integer, None or 'auto', got {beam!r}", "leave it at 'auto'")
    if not isinstance(keep_per_state, int) or keep_per_state < 1:
        raise DappleConfigError("keep_per_state", f"must be a positive integer, got {keep_per_state!r}", "leave it out")
    return keep_per_state, beam  # type: ignore[return-value]


def lower_bound(micro_batches: int, max_fb: float, sum_fb: float, work_left: float, devices_left: int) -> float:
    """Formula 2 is at least this for any plan that starts with a given prefix of stages:
    ``max_fb`` / ``sum_fb`` are the max and sum of F+B over the prefix's stages and
    transfers, ``work_left`` the F+B of the remaining layers at the full micro-batch on one
    device (see the module docstring for the proof)."""
    per_device = work_left / devices_left if devices_left else 0.0
    return max((micro_batches - 1) * max_fb, sum_fb + micro_batches * per_device)



def dapple_search(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    min_slice: int | None = None,
    keep: int = 4,
    keep_per_state: int | None = None,
    straight_only: bool = False,
    extended_placement: bool = True,
    beam: int | None | str = "auto",
    zero: int | str = 0,
) -> list[Scored]:
    """The ``keep`` best plans under formula 2 that fit in memory, best first (per ZeRO
    level the request allows: ``keep`` for each).

    ``cluster`` must already be the device set to plan for (see ``subcluster``). Every plan
    returned is re-priced with ``score_stages`` (the official cost model). The search effort
    (``keep_per_state``, ``beam``) defaults by instance size, see ``search_effort``.
    """
    request = PlanRequest.build(
        profile, cluster, global_batch_size, micro_batches, schedule, policy, None, min_slice, keep, keep_per_state, beam, zero=zero
    )
    return search(request, keep, straight_only, extended_placement)


def search(request: PlanRequest, keep: int = 4, straight_only: bool = False, extended_placement: bool = True, cap: float = _INF) -> list[Scored]:
    """``dapple_search`` for a built request: one search per ZeRO level of the request (a
    straight pipeline has no replicas to shard, so ``straight_only`` needs one), the
    results together, best first."""
    levels = request.zero_levels[:1] if straight_only else request.zero_levels
    found: dict[tuple[int, tuple[StagePlan, ...]], Scored] = {}
    for zero in levels:
        for item in _search_level(request, zero, keep, straight_only, extended_placement, cap):
            found.setdefault((item.micro_batches, item.stages), item)
    return sorted(found.values(), key=lambda item: (item.latency_ms, len(item.stages), item.micro_batches))


def _search_level(request: PlanRequest, zero: int, keep: int, straight_only: bool, extended_placement: bool, cap: float) -> list[Scored]:
    """The search with every replicated stage at ZeRO level ``zero``, polished where a
    beam cut it short."""
    profile, cluster = request.profile, request.cluster
    keep_per_state, beam = search_effort(profile.num_layers, cluster.num_devices, request.keep_per_state, request.beam)
    tables = request.tables
    settings = SearchSettings(request.policy, request.schedule, keep_per_state, straight_only, extended_placement, beam, zero)
    top = TopPlans(keep)
    _run_searches(request, tables, settings, top, cap)
    scored = []
    for _, _, m, raw in top.items:
        item = request.score(_to_stages(raw, zero), m)
        if item.fits(cluster):
            scored.append(item)
    if beam is not None and scored and not straight_only:
        # the beam may have cut the way to a better plan: polish the best ones locally
        polished = [
            polish(profile, cluster, item, request.global_batch_size, request.policy, request.schedule, request.floor, tables=tables, rescore=request.score)
            for item in scored[:2]
        ]
        known = {(item.micro_batches, item.stages) for item in scored}
        scored.extend(item for item in polished if (item.micro_batches, item.stages) not in known and item.fits(cluster))
    scored.sort(key=lambda item: (item.latency_ms, len(item.stages), item.micro_batches))
    return scored


def _run_searches(request: PlanRequest, tables: RangeTables, settings: SearchSettings, top: TopPlans, cap: float = _INF) -> None:
    """One DP per M, the most promising M first.

    The M candidates are ordered by a cheap probe (every plan of at most two stages), so
    that the full searches start with a tight bound and the later M are pruned hard; an M
    whose bound (M x all work of one micro-batch / G, ``lower_bound`` with an empty prefix)
    reaches the top list is skipped.

    ``cap`` is DP's simulated step (DP is re-ranked anyway; ``plan_request`` simulates it
    first). Formula 2 leaves out the bubbles inside the pivot stage (4.1), so a plan whose
    formula latency reaches ``cap`` would simulate no faster and cannot win the
    re-ranking: the full searches keep only plans below it. The probe's plans are kept
    either way (while ``keep`` better ones are not found), so that the plan's reason can
    name a pipeline, though not always the fastest one an uncapped search would have
    found. (This holds for the searched plans themselves. Where a transfer paces the
    pipeline the formula can run high, as it charges the link's two directions one after
    the other, and a balanced twin of a plan the cap dropped could also simulate below
    ``cap``; such plans are then missed. tests/test_planner_dp_cap.py finds no chosen plan
    that changes on 150 random instances.)
    """
    gbs, g = request.global_batch_size, request.cluster.num_devices
    total_work = float(tables.work[0, tables.n])
    shared = SharedMemo()
    searches = {m: StageSearch(tables, request.cluster, gbs, m, request.floor, settings, shared) for m in request.micro_batches}
    probe_best: dict[int, float] = {}
    for m, run in searches.items():
        probe = TopPlans(2)  # the one-stage plan and the best two-stage one, or the two best two-stage ones
        run.run(probe, shallow=True)
        probe_best[m] = probe.items[0][0] if probe.items else _INF
        for latency, _, mm, raw in probe.items:
            top.add(latency, mm, raw)
    top.set_cap(cap)
    for m in sorted(request.micro_batches, key=lambda m: (probe_best[m], m)):
        if m * total_work * ((gbs // m) / tables.pbs) / g >= top.threshold:
            continue
        searches[m].run(top)


def plan_dapple(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "auto",
    num_devices: int | None = None,
    min_slice: int | None = None,
    rerank: int = 4,
    keep_per_state: int | None = None,
    beam: int | None | str = "auto",
    simulate: StepPricer | None = None,
    zero: int | str = 0,
    communicator_bytes: float = 0.0,
    recompute: str = "never",
    pipeline_only: bool = False,
) -> Plan:
    """Plan ``profile`` on all devices of ``cluster`` with DAPPLE's planner (section 4).

    Returns the plan JSON the runtime executes: stages, M, K_i (5.3), ``predicted`` (formula
    phases, pivot, per-device memory, simulated latency and bubble) and a one-line ``reason``.
    ``simulate`` prices a plan's exact schedule (``simulate.plan_and_schedule.simulate_plan``, which
    ``simulate.plan_and_schedule.make_plan`` passes): the shortlist is re-ranked by it; without it the
    formula alone decides. ``policy`` "auto" runs each plan with the K_i policy it simulates
    faster with (``policy_choice``; P_A without a simulator). ``zero`` is the ZeRO level of
    every replicated stage (0: none), or "auto": the planner searches with and without it
    and sets each stage's own (``zero_choice``), saying in the reason where it made the plan
    fit or faster. ``communicator_bytes`` is the device memory of each NCCL communicator a
    plan makes (``plan.communicators``; 0: not priced, as on CPU processes); the plan records
    it and each rank's count in ``extra["communicators"]``. ``recompute`` is a mode every
    stage runs with (gpipe.txt 2.3): the candidates are scored and simulated with it, so the
    reason's figures are those of the plan as it runs. ``pipeline_only`` keeps the fastest
    plan of more than one device group (DP, however fast, is only a comparison), for a
    schedule that chunks a pipeline (interleaved, ZB-V). Raises ``DappleConfigError`` when
    no plan is valid or none fits in device memory.
    """
    request = PlanRequest.build(
        profile, cluster, global_batch_size, micro_batches, schedule, policy, num_devices, min_slice, rerank, keep_per_state, beam, simulate, zero,
        communicator_bytes, recompute, pipeline_only,
    )
    return plan_request(request)


def plan_request(request: PlanRequest) -> Plan:
    """``plan_dapple`` for a built request: search, add DP, straight and balanced twins,
    re-rank by simulation, explain."""
    dp_all = data_parallel_candidates(request)
    dp = [item for item in dp_all if item.fits(request.cluster)][:1]
    straight = straight_candidates(request)
    dp_choice = _simulate_dp(request, dp)
    cap, known = _INF, {}
    if dp_choice is not None:
        known = {(dp[0].micro_batches, dp[0].stages): dp_choice}
        # a pipeline slower than DP is still wanted when the schedule needs one
        cap = _INF if request.pipeline_only else dp_choice.simulation.latency_ms
    pool = _candidate_pool(request, dp, straight, cap)
    choices = _simulate(request, pool, known)
    simulations = {index: choice.simulation for index, choice in choices.items()}
    chosen_index = _choose(pool, simulations, _pipelines(request, pool) if request.pipeline_only else None)
    choice = choices.get(chosen_index)
    policy = choice.policy if choice is not None else request.policy
    chosen = rescored(request, pool[chosen_index], choice)
    dp_pair = pair_for(pool, simulations, dp)
    straight_pair = pair_for(pool, simulations, straight)
    reason = describe_choice(chosen, simulations.get(chosen_index), request.cluster, dp_pair, straight_pair, dp_all, _runner_up(pool, simulations))
    if choice is not None and choice.note():
        reason += "; " + choice.note()
    extra = {
        "alternatives": {name: summary(pair) for name, pair in (("dp", dp_pair), ("straight", straight_pair)) if pair is not None},
        "ranked": _ranked(pool, simulations),
        "min_slice": _setting_floor(request),
    }
    if choice is not None and request.auto_policy:
        extra["policy_choice"] = choice.summary()
    if request.zero_auto:
        note, record = zero_note(request, chosen, simulations.get(chosen_index), pool, simulations)
        reason += ("; " + note) if note else ""
        extra["zero_choice"] = record
    if request.communicator_bytes > 0:
        counts = communicators_per_rank(Plan(request.global_batch_size, chosen.micro_batches, chosen.stages), request.profile.tied, request.cluster.num_devices)
        extra["communicators"] = {"reserve_bytes": request.communicator_bytes, "per_rank": {str(rank): count for rank, count in counts.items()}}
    return finish_plan(
        chosen, request.profile, request.cluster, request.global_batch_size, policy, request.schedule, "dapple", reason,
        simulations.get(chosen_index), extra,
    )


#: how many of the simulated pool's best plans a plan records (``extra["ranked"]``)
RANKED_KEPT = 4


def _ranked(pool: list[Scored], simulations: dict[int, Any]) -> list[dict[str, Any]]:
    """The pool's best plans by simulated step (M, stages, step): what the planner would run
    next, which ``DappleStrategy(tune_steps=...)`` measures beside its choice."""
    if not _have_sim(simulations):
        return []
    order = sorted(simulations, key=lambda index: (simulations[index].latency_ms, len(pool[index].stages)))[:RANKED_KEPT]
    return [
        {"micro_batches": pool[i].micro_batches, "stages": [stage.to_dict() for stage in pool[i].stages], "simulated_ms": round(float(simulations[i].latency_ms), 4)}
        for i in order
    ]


def _setting_floor(request: PlanRequest) -> int:
    return request.min_slice if request.min_slice is not None else request.profile.micro_batch_size


def _simulate_dp(request: PlanRequest, dp: list[Scored]) -> PolicyChoice | None:
    """DP's simulated step, before the search, which keeps only plans whose formula latency
    is below it (``_run_searches``); None without re-ranking or a DP plan that fits."""
    if request.rerank <= 0 or request.simulate is None or not dp:
        return None
    return simulate_policies(request, dp[0])  # one stage: one policy, whatever it has to beat


def _candidate_pool(request: PlanRequest, dp: list[Scored], straight: list[Scored], cap: float = _INF) -> list[Scored]:
    """The search's best, the straight pipeline, their balanced twins and DP, without
    duplicates; ``DappleConfigError`` when there is none."""
    rerank = request.rerank
    if request.pipeline_only:  # one-group plans at every M may fill the search's top list: keep past them
        best = search(request, keep=max(rerank, 1) * (len(request.micro_batches) + 1), cap=cap)
        best = [item for item in best if _device_groups(item) > 1]
    else:
        best = search(request, keep=max(rerank, 1), cap=cap)
    shortlist = [*per_level(best, request.zero_levels, max(rerank, 1)), *straight]
    if rerank > 0:
        balanced = [balanced_variant(request, item) for item in shortlist]
        shortlist += [item for item in balanced if item is not None]
    if request.zero_auto:  # each stage at its own level, and every sharded plan's twin without sharding
        shortlist += [item for item in (refine_zero(request, entry) for entry in [*shortlist, *dp]) if item is not None]
        shortlist += [item for item in (whole_twin(request, entry) for entry in [*shortlist, *dp]) if item is not None]
    pool: list[Scored] = []
    seen: set[tuple[int, tuple[StagePlan, ...]]] = set()
    for item in [*shortlist, *dp]:
        key = (item.micro_batches, item.stages)
        if key not in seen:
            seen.add(key)
            pool.append(item)
    if not pool:
        _raise_nothing_valid(request)
    return pool


def _device_groups(item: Scored) -> int:
    return len({stage.devices for stage in item.stages})


def _pipelines(request: PlanRequest, pool: list[Scored]) -> list[int]:
    """The pooled plans of more than one device group; ``DappleConfigError`` when there is none."""
    found = [index for index, item in enumerate(pool) if _device_groups(item) > 1]
    require(
        bool(found),
        "schedule",
        f"chunks a pipeline, but no plan of {request.profile.num_layers} layers on {request.cluster.num_devices} device(s) with this batch has two device groups",
        "use more devices or a larger global batch, or leave the schedule to 'auto'",
    )
    return found


def _raise_nothing_valid(request: PlanRequest) -> None:
    profile, cluster = request.profile, request.cluster
    need, what = smallest_memory(request)
    if need == _INF:
        raise DappleConfigError(
            "global_batch_size",
            f"no valid plan puts {profile.num_layers} layers on {cluster.num_devices} devices with micro-batch slices of at least {_setting_floor(request)} samples",
            "use a larger global batch, fewer devices (num_devices), or a smaller slice floor (min_slice)",
        )
    raise_no_memory(profile, cluster, need, what, zero_tried=max(request.zero_levels) > 0)


def _simulate(request: PlanRequest, pool: list[Scored], known: dict[tuple[int, tuple[StagePlan, ...]], PolicyChoice]) -> dict[int, PolicyChoice]:
    """Simulated step of every pooled plan under the policy it runs fastest with (none when
    re-ranking is off); ``known`` ones (by M and stages) are not simulated again."""
    if request.rerank <= 0 or request.simulate is None:
        return {}
    out: dict[int, PolicyChoice] = {}
    fastest = float("inf")
    for index, item in enumerate(pool):
        found = known.get((item.micro_batches, item.stages))
        out[index] = found if found is not None else simulate_policies(request, item, beat=fastest)
        fastest = min(fastest, out[index].simulation.latency_ms)
    return out


def _have_sim(simulations: dict[int, Any]) -> bool:
    return bool(simulations) and all(sim is not None for sim in simulations.values())


def _choose(pool: list[Scored], simulations: dict[int, Any], among: Sequence[int] | None = None) -> int:
    """The fastest simulated plan (formula latency, then fewer stages, break ties), or the
    formula's best without simulations."""
    indices = list(range(len(pool))) if among is None else list(among)
    if _have_sim(simulations):
        return min(indices, key=lambda i: (simulations[i].latency_ms, pool[i].latency_ms, len(pool[i].stages)))
    return min(indices, key=lambda i: (pool[i].latency_ms, len(pool[i].stages)))


def _runner_up(pool: list[Scored], simulations: dict[int, Any]) -> tuple[Scored, Any] | None:
    """The fastest pipeline of the pool (what DP is compared with)."""
    pipelines = [i for i in range(len(pool)) if len(pool[i].stages) > 1]
    if not pipelines:
        return None
    index = _choose(pool, simulations, pipelines) if _have_sim(simulations) else min(pipelines, key=lambda i: pool[i].latency_ms)
    return pool[index], simulations.get(index)
