"""A hybrid pipeline/data-parallel plan as plain data: what the planner writes, the runtime reads.

A plan is DAPPLE's output (section 4): stages of consecutive layers (half-open ranges),
each replicated on its own list of global ranks, the number of micro-batches M, the
schedule and the per-stage warm-up count K_i (section 5.3). ``predicted`` holds the
planner's latency model (formulas 1-2) and memory model so a user can see why.

A replicated stage may shard its optimizer state over its replicas (``zero``: ZeRO-1,
and with 2 its gradients too; ``strategy/zero.py`` runs it, ``costs.py`` prices it). The
runtime reads it per stage, so a plan can shard one stage and not another.

The JSON form is documented in docs/formats.md; a hand-written file needs only
``global_batch_size``, ``micro_batches`` and each stage's ``layers`` and ``devices``.

This module is long because a plan's fields, their JSON form and the checks of each field
belong together: a field added in one place and not the others is a plan that saves what it
cannot load.

The module is long because a plan's validation and its JSON forms live beside the dataclasses
they check: each bad field gets its own message naming the fix, and a hand-written file is
read through the same checks as a planned one.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from lightning_dapple.atomic_files import atomic_write_text
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.schedule_table import (
    chunked_schedule_names,
    schedule_names,
    schedule_spec,
)
from lightning_dapple.plan.warmup import chunked_warmup_counts, warmup_counts

SCHEDULES = schedule_names()
# schedules that run several stages (chunks) on each device group
CHUNKED_SCHEDULES = chunked_schedule_names()
POLICIES = ("PA", "PB")
RECOMPUTE_MODES = ("never", "always", "except_last")
# ZeRO levels of a replicated stage: 0 every replica keeps the whole optimizer state, 1 each
# keeps its share's state (ZeRO-1), 2 its share's gradients too (ZeRO-2)
ZERO_LEVELS = (0, 1, 2)


def chunk_placement(schedule: str, num_groups: int, chunks: int) -> tuple[int, ...]:
    """The device group of each stage: k mod P (interleaved), the V (zbv: 2 chunks)."""
    spec = schedule_spec(schedule)
    require(spec.chunked, "schedule", f"is {schedule!r}", f"use one of {list(CHUNKED_SCHEDULES)} for chunks")
    require(num_groups >= 1, "device groups", f"are {num_groups}", "give at least one device group")
    if spec.fixed_chunks is not None:
        require(chunks == spec.fixed_chunks, "chunks", f"is {chunks} for {schedule!r}", f"{schedule!r} places exactly {spec.fixed_chunks} chunks per device group")
    if spec.chunk_placement == "vee":
        return (*range(num_groups), *reversed(range(num_groups)))
    require(chunks >= 2, "chunks", f"is {chunks} for {schedule!r}", "use 2 or more chunks per device group")
    return tuple(stage % num_groups for stage in range(num_groups * chunks))


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: layers ``[start, end)`` replicated on ``devices`` (global ranks)."""

    layers: tuple[int, int]
    devices: tuple[int, ...]
    warmup: int | None = None
    recompute: str = "never"
    zero: int = 0

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "devices": list(self.devices)}
        if self.warmup is not None:
            out["warmup"] = self.warmup
        if self.recompute != "never":
            out["recompute"] = self.recompute
        if self.zero:
            out["zero"] = self.zero
        return out


@dataclass(frozen=True)
class Prediction:
    """The planner's estimate (DAPPLE formulas 1-2) and its memory model, per stage."""

    latency_ms: float
    warmup_ms: float
    steady_ms: float
    ending_ms: float
    pivot_stage: int
    memory_bytes: tuple[float, ...]
    simulated_latency_ms: float | None = None
    bubble_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_bytes"] = list(self.memory_bytes)
        return {key: value for key, value in out.items() if value is not None}


@dataclass(frozen=True)
class Plan:
    global_batch_size: int
    micro_batches: int
    stages: tuple[StagePlan, ...]
    schedule: str = "dapple"
    policy: str = "PA"
    predicted: Prediction | None = None
    # Out-of-order backprop (ooo-backprop sec. 3, 5.2): split backward into B (input
    # gradients, sent upstream at once) and W (weight gradients, deferred); first_k is
    # Algorithm 2's k for the ending phase (None: the conventional order; with gradient
    # buckets launched in plan.buckets order no other k finishes a bucket sooner).
    planner: str = "manual"
    reason: str = ""
    ooo: bool = False
    first_k: int | None = None
    # Per stage, the most micro-batches it may hold with W deferred (F done, W not done):
    # -1 does not split its backward, 0 runs each W right after its B, a positive cap
    # defers up to that many (at least K_i); None: the default caps of
    # ``schedule.ooo.default_caps``. Read only when ``ooo`` is on. It changes the action
    # lists, so it is part of what a plan is (compared, saved), unlike ``extra``.
    ooo_in_flight: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches

    @property
    def world_size(self) -> int:
        return sum(len(devices) for devices in self.device_groups)

    @property
    def device_groups(self) -> tuple[tuple[int, ...], ...]:
        """The distinct device lists of the stages, in order of first use.

        With one stage per device group (DAPPLE's plans) group g is stage g. Interleaved and
        V-shaped plans place several stages (chunks, Megatron's virtual stages) on one group:
        stage k of an interleaved plan on P groups is on group k mod P, and ZB-V's stages
        0..P-1 then P-1..0 go down and back up the same P groups.
        """
        groups: list[tuple[int, ...]] = []
        for stage in self.stages:
            if stage.devices not in groups:
                groups.append(stage.devices)
        return tuple(groups)

    @property
    def placement(self) -> tuple[int, ...]:
        """The device group of each stage (index into ``device_groups``)."""
        groups = self.device_groups
        return tuple(groups.index(stage.devices) for stage in self.stages)

    @property
    def chunks(self) -> int:
        """Stages per device group (``validate`` makes every group hold the same number)."""
        return self.num_stages // len(self.device_groups)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in pipeline order (one unless the plan has chunks)."""
        held = tuple(index for index, stage in enumerate(self.stages) if rank in stage.devices)
        require(bool(held), "plan.stages[].devices", f"no stage runs on rank {rank}", "list every rank in a stage")
        return held

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def warmups(self) -> tuple[int, ...]:
        require(
            all(stage.warmup is not None for stage in self.stages),
            "plan.stages[].warmup",
            "is not filled in",
            "call plan.with_warmups() before scheduling",
        )
        return tuple(int(stage.warmup) for stage in self.stages)  # type: ignore[arg-type]

    def stage_of_rank(self, rank: int) -> int:
        """The one stage ``rank`` runs; plans with several stages per rank use ``stages_of_rank``."""
        held = self.stages_of_rank(rank)
        if len(held) > 1:
            raise DappleConfigError(
                "plan.stages[].devices",
                f"rank {rank} runs stages {list(held)} (a {self.schedule!r} plan with {self.chunks} chunks per device group)",
                "ask for stages_of_rank(rank) where several stages per rank are supported",
            )
        return held[0]

    def kind(self) -> str:
        """'DP', 'straight' or 'hybrid': the words of DAPPLE Table 4."""
        if self.num_stages == 1:
            return "DP" if self.stages[0].replicas > 1 else "single"
        if self.chunks > 1:
            shape = ":".join(str(len(group)) for group in self.device_groups)
            return f"{shape} x{self.chunks} chunks"
        if all(stage.replicas == 1 for stage in self.stages):
            return "straight"
        return ":".join(str(stage.replicas) for stage in self.stages)

    def with_warmups(self, policy: str | None = None) -> "Plan":
        """Fill missing K_i by policy P_A or P_B (DAPPLE 5.3); keep the ones given.

        With several stages per device group K is the group's, in chunk micro-batches, and
        every stage of the group carries it (``plan.warmup.chunked_warmup_counts``)."""
        policy = policy or self.policy
        if self.schedule in CHUNKED_SCHEDULES:
            per_group = chunked_warmup_counts(len(self.device_groups), self.chunks, self.micro_batches, policy, self.schedule)
            counts = [per_group[group] for group in self.placement]
        else:
            counts = warmup_counts(self.num_stages, self.micro_batches, policy, schedule=self.schedule)
        stages = tuple(
            stage if stage.warmup is not None else replace(stage, warmup=count)
            for stage, count in zip(self.stages, counts)
        )
        return replace(self, stages=stages, policy=policy)

    def validate(self, num_layers: int | None = None, world_size: int | None = None) -> "Plan":
        """Check the plan is executable; every message names the field and the fix."""
        require(self.num_stages > 0, "plan.stages", "is empty", "give at least one stage")
        require(self.schedule in SCHEDULES, "plan.schedule", f"is {self.schedule!r}", f"use one of {list(SCHEDULES)}")
        require(self.policy in POLICIES, "plan.policy", f"is {self.policy!r}", f"use one of {list(POLICIES)}")
        require(
            isinstance(self.global_batch_size, int) and self.global_batch_size > 0,
            "plan.global_batch_size",
            f"must be a positive integer, got {self.global_batch_size!r}",
            "set it to the number of samples of one optimizer step",
        )
        require(
            isinstance(self.micro_batches, int) and self.micro_batches > 0,
            "plan.micro_batches",
            f"must be a positive integer, got {self.micro_batches!r}",
            "set M >= 1",
        )
        require(
            self.global_batch_size % self.micro_batches == 0,
            "plan.micro_batches",
            f"global batch {self.global_batch_size} cannot be split into {self.micro_batches} equal micro-batches",
            "choose micro_batches that divides the global batch size",
        )
        seen: set[int] = set()
        for index, stage in enumerate(self.stages):
            self._check_stage(index, seen)
            seen.update(stage.devices)
        self._check_chunks()
        _check_in_flight(self.ooo_in_flight, self.num_stages)
        warmups = [stage.warmup for stage in self.stages]
        if schedule_spec(self.schedule, "plan.schedule").early_backward and all(k is not None for k in warmups):
            capped = [min(int(k), self.micro_batches) for k in warmups]  # type: ignore[arg-type]
            for index in range(len(capped) - 1):
                require(
                    capped[index] >= capped[index + 1],
                    f"plan.stages[{index + 1}].warmup",
                    f"K={capped[index + 1]} exceeds the previous stage's K={capped[index]}; the early-backward schedule would deadlock",
                    "make warm-up counts non-increasing along the pipeline (or leave them out to use policy PA/PB)",
                )
        if num_layers is not None:
            require(
                self.num_layers == num_layers,
                "plan.stages[-1].layers",
                f"ends at layer {self.num_layers} but the model has {num_layers} layers",
                f"make the last stage end at {num_layers}",
            )
        if world_size is not None:
            require(
                seen == set(range(world_size)),
                "plan.stages[].devices",
                f"cover ranks {sorted(seen)} but the run has world size {world_size}",
                f"assign exactly the ranks 0..{world_size - 1} to stages",
            )
        return self

    def _check_stage(self, index: int, seen: set[int]) -> None:
        """Stage ``index``: consecutive non-empty layers, ranks of its own group, sliceable micro-batch."""
        stage = self.stages[index]
        where = f"plan.stages[{index}]"
        expected_start = self.stages[index - 1].end if index else 0
        require(
            stage.start == expected_start and stage.end > stage.start,
            f"{where}.layers",
            f"is [{stage.start}, {stage.end}) but must start at {expected_start} and be non-empty",
            "make stage layer ranges consecutive, half-open and covering the model",
        )
        require(stage.replicas > 0, f"{where}.devices", "is empty", "give each stage at least one rank")
        require(len(set(stage.devices)) == stage.replicas, f"{where}.devices", f"lists a rank twice: {list(stage.devices)}", "list each rank once")
        same_group = any(earlier.devices == stage.devices for earlier in self.stages[:index])
        duplicate = set() if same_group else seen.intersection(stage.devices)
        require(
            not duplicate,
            f"{where}.devices",
            f"reuses ranks {sorted(duplicate)} of another stage with other devices",
            "give each rank to one device group: stages on the same ranks list exactly the same devices",
        )
        require(
            self.micro_batch_size >= stage.replicas,
            f"{where}.devices",
            f"micro-batch of {self.micro_batch_size} samples cannot be sliced over {stage.replicas} replicas",
            "use fewer micro-batches or fewer replicas for this stage",
        )
        require(stage.recompute in RECOMPUTE_MODES, f"{where}.recompute", f"is {stage.recompute!r}", f"use one of {list(RECOMPUTE_MODES)}")
        _check_zero(stage, where, [earlier for earlier in self.stages[:index] if earlier.devices == stage.devices])
        if stage.warmup is not None:
            require(stage.warmup >= 1, f"{where}.warmup", f"is {stage.warmup}", "use K_i >= 1 or leave it out")

    def _check_chunks(self) -> None:
        """Several stages per device group: equal chunk counts, and only where the schedule runs them."""
        groups = self.device_groups
        counts = [self.placement.count(group) for group in range(len(groups))]
        if len(groups) == self.num_stages:
            require(
                self.schedule not in CHUNKED_SCHEDULES,
                "plan.schedule",
                f"is {self.schedule!r}, which runs several stages per device group, but every stage has its own devices",
                "place 2 or more stages on each device group, or use 'dapple' or 'gpipe'",
            )
            return
        require(
            len(set(counts)) == 1,
            "plan.stages[].devices",
            f"give the device groups {[list(g) for g in groups]} {counts} stages each",
            "place the same number of stages (chunks) on every device group",
        )
        require(
            self.schedule in CHUNKED_SCHEDULES,
            "plan.schedule",
            f"is {self.schedule!r}, which runs one stage per device group, but groups hold {counts[0]} stages each",
            f"use one of {list(CHUNKED_SCHEDULES)} for several stages per group, or give every stage its own devices",
        )
        self._check_chunked_schedule()

    def _check_chunked_schedule(self) -> None:
        """What interleaved and V schedules need beyond several stages per group."""
        groups = len(self.device_groups)
        require(
            not self.ooo,
            "plan.ooo",
            f"is on, but the {self.schedule!r} schedule places its own backward work"
            + (" (it always splits B into I and W)" if schedule_spec(self.schedule).splits_backward else " and does not defer weight gradients"),
            "leave ooo off for chunked plans ('zbv' is the schedule with deferred weight gradients)",
        )
        for group in range(groups):
            ks = {self.stages[k].warmup for k in range(self.num_stages) if self.placement[k] == group}
            require(
                len(ks) == 1,
                "plan.stages[].warmup",
                f"differs between the stages of device group {group}: {sorted(k for k in ks if k is not None)}",
                "give every stage of a group the group's K (in chunk micro-batches) or leave them all out",
            )
        if schedule_spec(self.schedule).chunk_placement == "vee":
            small = [k for k, stage in enumerate(self.stages) if stage.warmup is not None and stage.warmup < 2]
            require(not small, f"plan.stages[{small[0] if small else 0}].warmup", "is below 2", "let each ZB-V group hold K >= 2 chunk micro-batches, one in each chunk")
            expected = chunk_placement(self.schedule, groups, 2)
            require(
                self.chunks == 2 and self.placement == expected,
                "plan.stages[].devices",
                f"place the stages on groups {list(self.placement)}, but 'zbv' runs 2 chunks per group in a V: {list(expected[:2 * groups])}",
                "put stage k on group k for k < P and on group 2P-1-k after (the V shape)",
            )
        else:
            expected = chunk_placement(self.schedule, groups, self.chunks)
            require(
                self.placement == expected,
                "plan.stages[].devices",
                f"place the stages on groups {list(self.placement)}, but 'interleaved' runs stage k on group k mod P: {list(expected)}",
                "put stage k on device group k mod P (Megatron's interleaved placement)",
            )
            require_round_multiple(groups, self.micro_batches)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "global_batch_size": self.global_batch_size,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "policy": self.policy,
            "planner": self.planner,
            "ooo": self.ooo,
            "stages": [stage.to_dict() for stage in self.stages],
        }
        if self.first_k is not None:
            out["first_k"] = self.first_k
        if self.ooo_in_flight is not None:
            out["ooo_in_flight"] = list(self.ooo_in_flight)
        if self.predicted is not None:
            out["predicted"] = self.predicted.to_dict()
        if self.reason:
            out["reason"] = self.reason
        if self.extra:
            out["extra"] = self.extra
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        """Write the plan JSON atomically (temp file + rename)."""
        return atomic_write_text(Path(path), self.to_json() + "\n")


PLAN_KEYS = ("global_batch_size", "micro_batches", "stages", "schedule", "policy", "predicted", "planner", "reason", "ooo", "first_k", "ooo_in_flight", "extra")
STAGE_KEYS = ("layers", "devices", "warmup", "recompute", "zero")


def check_keys(data: dict[str, Any], valid: Sequence[str], where: str) -> None:
    """A key that is not one of ``valid`` is an error naming the nearest valid key: a
    misspelled ``micro_batch`` would otherwise be dropped silently and the plan run with
    the default."""
    for key in data:
        if key in valid:
            continue
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
        raise DappleConfigError(f"{where}.{key}", "is not a known key", f"{hint} (see docs/formats.md)")


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    require(isinstance(data, dict), source, "is not a JSON object", "see docs/formats.md for the plan format")
    check_keys(data, PLAN_KEYS, source)
    for name in ("global_batch_size", "micro_batches", "stages"):
        require(name in data, f"{source}.{name}", "is missing", "a plan needs global_batch_size, micro_batches and stages")
    require(isinstance(data["stages"], list) and data["stages"], f"{source}.stages", "is not a non-empty list", "list the stages")
    stages = [_stage_from_dict(entry, f"{source}.stages[{index}]") for index, entry in enumerate(data["stages"])]
    predicted = None
    if isinstance(data.get("predicted"), dict):
        p = data["predicted"]
        try:
            predicted = Prediction(
                latency_ms=float(p["latency_ms"]),
                warmup_ms=float(p.get("warmup_ms", 0.0)),
                steady_ms=float(p.get("steady_ms", 0.0)),
                ending_ms=float(p.get("ending_ms", 0.0)),
                pivot_stage=int(p.get("pivot_stage", len(stages) - 1)),
                memory_bytes=tuple(float(v) for v in p.get("memory_bytes", [])),
                simulated_latency_ms=p.get("simulated_latency_ms"),
                bubble_fraction=p.get("bubble_fraction"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DappleConfigError(f"{source}.predicted", f"is malformed ({exc})", "delete the 'predicted' block; it is recomputed") from None
    plan = Plan(
        global_batch_size=data["global_batch_size"],
        micro_batches=data["micro_batches"],
        stages=tuple(stages),
        schedule=str(data.get("schedule", "dapple")),
        policy=str(data.get("policy", "PA")),
        predicted=predicted,
        planner=str(data.get("planner", "manual")),
        reason=str(data.get("reason", "")),
        ooo=bool(data.get("ooo", False)),
        first_k=data.get("first_k"),
        ooo_in_flight=_in_flight_from(data, source),
        extra={key: value for key, value in dict(data.get("extra", {})).items() if key != "ooo_in_flight"},
    )
    return plan.validate()


def _stage_from_dict(entry: Any, where: str) -> StagePlan:
    """One stage of a plan's JSON, each field checked (``where`` names it in errors)."""
    require(isinstance(entry, dict), where, "is not an object", "write each stage as {\"layers\": [start, end], \"devices\": [...]}")
    check_keys(entry, STAGE_KEYS, where)
    for name in ("layers", "devices"):
        require(
            name in entry,
            f"{where}.{name}",
            "is missing",
            "every stage needs layers [start, end) and devices (or every stage devices alone: the planner then chooses the cut)",
        )
    layers = entry["layers"]
    require(
        isinstance(layers, list) and len(layers) == 2 and all(isinstance(v, int) for v in layers),
        f"{where}.layers",
        f"is {layers!r}",
        "write a half-open range [start, end] of two integers",
    )
    devices = entry["devices"]
    require(
        isinstance(devices, list) and all(isinstance(v, int) and v >= 0 for v in devices),
        f"{where}.devices",
        f"is {devices!r}",
        "write a list of global ranks",
    )
    warmup = entry.get("warmup")
    require(warmup is None or isinstance(warmup, int), f"{where}.warmup", f"is {warmup!r}", "write an integer or leave it out")
    zero = entry.get("zero", 0)
    require(
        isinstance(zero, int) and not isinstance(zero, bool),
        f"{where}.zero",
        f"is {zero!r}",
        f"write one of {list(ZERO_LEVELS)} or leave it out (0: no sharding)",
    )
    return StagePlan(
        layers=(layers[0], layers[1]),
        devices=tuple(devices),
        warmup=warmup,
        recompute=str(entry.get("recompute", "never")),
        zero=zero,
    )


def _in_flight_from(data: dict[str, Any], source: str) -> tuple[int, ...] | None:
    """The plan's ``ooo_in_flight``: its own key, or ``extra.ooo_in_flight`` where files
    written before it was a plan field keep it."""
    extra = data.get("extra") if isinstance(data.get("extra"), dict) else {}
    caps = data.get("ooo_in_flight", extra.get("ooo_in_flight"))
    if caps is None:
        return None
    require(
        isinstance(caps, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in caps),
        f"{source}.ooo_in_flight",
        f"is {caps!r}",
        "write one integer per stage (-1: no split, 0: W right after B, n: defer up to n) or leave it out",
    )
    return tuple(caps)


def require_round_multiple(num_groups: int, micro_batches: int) -> None:
    """Refuse an M that interleaved 1F1B cannot run in rounds of one micro-batch per group
    (``schedule.interleaved``: a shorter round leaves a chunk's group waiting)."""
    up = -(-micro_batches // num_groups) * num_groups
    require(
        micro_batches % num_groups == 0,
        "plan.micro_batches",
        f"is {micro_batches}, but interleaved 1F1B sends micro-batches through the chunks in rounds of the {num_groups} device groups",
        f"use a multiple of {num_groups} (e.g. {up}), or the 'dapple' or 'zbv' schedule",
    )


def _check_zero(stage: StagePlan, where: str, same_group: Sequence[StagePlan]) -> None:
    """A stage's ZeRO level: one of ``ZERO_LEVELS``, above 0 only where there are replicas
    to shard over, and the same on every stage of one device group (the runtime shards a
    rank's whole optimizer over its group's replicas, ``strategy/zero.py``)."""
    require(stage.zero in ZERO_LEVELS, f"{where}.zero", f"is {stage.zero!r}", f"use one of {list(ZERO_LEVELS)} (0: every replica keeps the whole state)")
    require(
        stage.zero == 0 or stage.replicas > 1,
        f"{where}.zero",
        f"is {stage.zero} on a stage with one device, which has no replicas to shard its optimizer state over",
        "leave zero at 0 on unreplicated stages",
    )
    require(
        all(other.zero == stage.zero for other in same_group),
        f"{where}.zero",
        f"is {stage.zero}, but another stage on the same devices {list(stage.devices)} has {same_group[0].zero if same_group else 0}",
        "give every stage of one device group the same zero (its ranks shard one optimizer)",
    )


def _check_in_flight(caps: tuple[int, ...] | None, num_stages: int) -> None:
    if caps is None:
        return
    require(
        len(caps) == num_stages,
        "plan.ooo_in_flight",
        f"has {len(caps)} entries for {num_stages} stages",
        "give one cap per stage or leave it out for the default caps",
    )
    for index, cap in enumerate(caps):
        require(
            cap >= -1,
            f"plan.ooo_in_flight[{index}]",
            f"is {cap}",
            "use -1 (no B/W split), 0 (W right after B) or a positive number of micro-batches",
        )


def _read_json(path: Path) -> Any:
    require(path.is_file(), "plan", f"file {str(path)!r} does not exist", "pass the path of a plan JSON written by dapple-plan")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DappleConfigError(f"plan {path.name}", f"is not valid JSON ({exc.msg} at line {exc.lineno})", "fix the JSON syntax") from None


def read_plan_data(path: str | Path) -> Any:
    """A plan file's JSON data, unvalidated (``plan_or_shape_from_dict`` checks it)."""
    return _read_json(Path(path))


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return plan_from_dict(_read_json(path), source=f"plan {path.name}")


@dataclass(frozen=True)
class PlanShape:
    """A plan given by its shape: each stage's devices and no layers. The planner chooses
    the layer cut for this shape (and M, where ``micro_batches`` is None); this is how a
    user asks for, say, a 2-stage pipeline without knowing how many layers the model has.
    ``policy`` None lets the planner choose the K_i policy (DAPPLE 5.3)."""

    global_batch_size: int
    devices: tuple[tuple[int, ...], ...]
    micro_batches: int | None = None
    schedule: str = "dapple"
    policy: str | None = None
    recompute: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len({rank for devices in self.devices for rank in devices})

    def validate(self, world_size: int | None = None) -> "PlanShape":
        """The checks of ``Plan.validate`` that do not need layers."""
        stages = tuple(StagePlan(layers=(index, index + 1), devices=devices) for index, devices in enumerate(self.devices))
        probe = Plan(self.global_batch_size, self.micro_batches or 1, stages, self.schedule, self.policy or "PA")
        probe.validate(world_size=world_size)
        for index, mode in enumerate(self.recompute):
            require(mode in RECOMPUTE_MODES, f"plan.stages[{index}].recompute", f"is {mode!r}", f"use one of {list(RECOMPUTE_MODES)}")
        return self


def _shape_from_dict(data: dict[str, Any], source: str) -> PlanShape:
    check_keys(data, PLAN_KEYS, source)
    require("global_batch_size" in data, f"{source}.global_batch_size", "is missing", "give the number of samples of one optimizer step")
    devices = []
    for index, entry in enumerate(data["stages"]):
        check_keys(entry, STAGE_KEYS, f"{source}.stages[{index}]")
        value = entry.get("devices")
        require(
            isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value),
            f"{source}.stages[{index}].devices",
            f"is {value!r}",
            "write a list of global ranks",
        )
        devices.append(tuple(value))
    recompute = tuple(str(entry.get("recompute", "never")) for entry in data["stages"])
    shape = PlanShape(
        global_batch_size=data["global_batch_size"],
        devices=tuple(devices),
        micro_batches=data.get("micro_batches"),
        schedule=str(data.get("schedule", "dapple")),
        policy=data.get("policy"),
        recompute=recompute if any(mode != "never" for mode in recompute) else (),
    )
    return shape.validate()


def plan_or_shape_from_dict(data: Any, source: str = "plan") -> Plan | PlanShape:
    """A plan, or, where no stage gives ``layers``, the shape the planner cuts."""
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list) or not stages or not all(isinstance(entry, dict) for entry in stages):
        return plan_from_dict(data, source)
    without = [index for index, entry in enumerate(stages) if "layers" not in entry]
    if not without:
        return plan_from_dict(data, source)
    require(
        len(without) == len(stages),
        f"{source}.stages[{without[0]}].layers",
        "is missing while other stages give theirs",
        "give layers [start, end) in every stage, or in none (then the planner chooses the cut)",
    )
    return _shape_from_dict(data, source)


def load_plan_or_shape(path: str | Path) -> Plan | PlanShape:
    path = Path(path)
    return plan_or_shape_from_dict(_read_json(path), source=f"plan {path.name}")


def straight_plan(num_layers: int, bounds: Sequence[int], global_batch_size: int, micro_batches: int, **kwargs: Any) -> Plan:
    """A plan with one device per stage, cutting before each index in ``bounds``."""
    edges = [0, *bounds, num_layers]
    stages = tuple(StagePlan(layers=(edges[i], edges[i + 1]), devices=(i,)) for i in range(len(edges) - 1))
    return Plan(global_batch_size=global_batch_size, micro_batches=micro_batches, stages=stages, **kwargs)
