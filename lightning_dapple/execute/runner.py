"""Interpreter of a schedule's action list on one rank: the multi-process executor.

The runner walks the action list built by ``lightning_dapple.schedule`` (the same list the
simulator times) and hands each action to the collaborator that does it:

* F, B, W and recomputation to the rank's ``Stage`` (``execute/stage.py``: the layers and
  each micro-batch's autograd state, DAPPLE 3.2 and 5.2.3, ooo-backprop sec. 3, gpipe.txt
  2.3);
* send/receive to the ``Transport`` (``execute/transfer/transport.py``): split-concat transfers to
  adjacent stages (DAPPLE 5.2.2), named by ``keys.TransferKey``. Sends are asynchronous; a
  receive, once its data is in, also waits for the earlier sends ``schedule.settle`` names
  (those the peer has already posted receives for; on a rank holding several stages, those
  its merged order knows to be received), the rest at the end of the step. Where
  it pays (``transport.receives_ahead_pay``), the receives of the next receive action are
  posted before each compute action, so their data arrives meanwhile (DAPPLE 5.2: transfers
  overlapped with compute);
* gradient AllReduce among the stage's replicas to the ``GradientSync``
  (``execute/grad_sync.py``): bucketed and started as soon as each bucket's gradients are
  final, overlapping the rest of the backward; the ALLREDUCE actions of the list mark where
  the simulator expects the last of them, and the step waits for all at its end; tied
  parameters this stage shares with others stay out of the buckets and are summed over
  every stage holding them after that (``execute/tied.py``);
* stashed bytes to the ``StashLedger`` and their sizes to ``StashSizes``
  (``execute/stash_ledger.py``: ``schedule.actions.stash_walk``'s rule with measured sizes).
* where the step ends, the stage's buffers to ``StageBuffers`` (``execute/batchnorm.py``):
  deferred BatchNorm statistics applied, replicas' buffers made the first replica's.

A rank holding several stages (chunks of interleaved and V schedules) runs one such runner
per stage, sharing the rank's transport and result channel, in its device group's merged
order (``execute/chunked.py``); a boundary between two of them is a hand-off in process.

Everything that depends on the plan only is decided once, in set-up: each action becomes an
``_Op`` (its handler, micro-batch, transfer key, the sends a receive settles, the layers of
a W, whether W work follows, which parameters are final after it), and the receives posted
ahead and the gradient-readiness reports become ops of their own. A step then only runs the
ops in order; what differs between steps (the batch's rows and their routes to the peers) is
looked up once per step.

The module is long because ``StageRunner`` is one interpreter: its set-up compiles every
action kind into ops and its handlers share the step's state (routes, stash sizes, ledger,
transport); the collaborators above hold everything that stands on its own.
"""
from __future__ import annotations

import time
from typing import Any, Callable, ContextManager, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.action_errors import name_action
from lightning_dapple.execute.batchnorm import StageBuffers
from lightning_dapple.execute.chunked import ChunkedRunner, RankShared, chunk_settle_points
from lightning_dapple.execute.failure import FailureChannel, PeerFailedError
from lightning_dapple.execute.grad_sync import GradientSync
from lightning_dapple.execute.groups import PlanGroups, build_groups
from lightning_dapple.execute.transfer.keys import TransferKey, transfer_key
from lightning_dapple.execute.transfer.links import check_stream_orders, plan_links, plan_streams
from lightning_dapple.execute.replay import detached, restore_rng, save_rng, step_key
from lightning_dapple.execute.results import ResultChannel
from lightning_dapple.execute.slicing import batch_size_of, slice_rows, take_rows
from lightning_dapple.execute.spans import span_clock
from lightning_dapple.execute.stage import EvalCallbacks, Stage, StageCallbacks
from lightning_dapple.execute.stats import StageStats
from lightning_dapple.execute.stash_ledger import KnownSizes, StageSlots, StashLedger, StashSizes, StepSizes
from lightning_dapple.execute.tied import TiedSync, build_tied_sync, tied_groups
from lightning_dapple.execute.transfer.transport import Peer, Transport, receives_ahead_pay
from lightning_dapple.plan.buckets import BUCKET_BYTES, bucket_layers
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.stash import StashMeter
from lightning_dapple.profile.ties import TiedParameter
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.settle import settle_points
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

__all__ = ["StageRunner", "StageStats", "StageCallbacks", "EvalCallbacks"]


class _Op(NamedTuple):
    """One step of the compiled action list: ``run(op)`` does it. Built once per plan."""

    run: Callable[["_Op"], None]
    mb: int = -1
    key: TransferKey | None = None  # a transfer: the one this op sends, receives or posts
    settle: frozenset[TransferKey] = frozenset()  # a receive: earlier sends to wait for
    span: tuple[int, int] | None = None  # W: the layers it covers (None: all that are left)
    replay: bool = False  # B: replay the forward first (recomputed micro-batch)
    final: bool = False  # B: the stage's last (autograd reports finished gradients)
    pending_w: bool = False  # B/W: W work of this micro-batch follows
    params: Sequence[nn.Parameter] = ()  # ready: parameters whose gradient is now final
    position: int = -1  # the action it does (posts ahead for, follows) in the stage's list: errors name it


class _Route(NamedTuple):
    """Where one micro-batch's slice lives: this rank's rows and the adjacent stages' ranks."""

    rows: tuple[int, int]
    upstream: list[Peer]
    downstream: list[Peer]


class StageRunner:
    """Runs this rank's part of a plan, one action list per step."""

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        rank: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        failure: FailureChannel,
        groups: PlanGroups,
        loss_reduction: str = "mean",
        post_ahead: bool | None = None,
        settle_sends: bool = True,
        forward_context: Callable[[], ContextManager[Any]] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        wire: str = "auto",
        tied: TiedSync | None = None,
        chunk: RankShared | None = None,
    ) -> None:
        self.plan = plan
        self.schedule = schedule
        self.rank = rank
        # a rank holding several stages runs one runner per stage, sharing ``chunk``'s
        # transport, results and hand-offs (``execute/chunked.py``)
        self.chunk = chunk
        self.stage = plan.stage_of_rank(rank) if chunk is None else chunk.stage
        self.stage_plan = plan.stages[self.stage]
        self.replica = self.stage_plan.devices.index(rank)
        self.layers = list(layers)
        self.device = device
        self.failure = failure
        if chunk is None:
            # a collective under NCCL (a communicator per link and direction): every rank builds its runner
            self.transport = Transport(failure, device, wire=wire, links=plan_links(plan))
            self.results = ResultChannel(plan, rank, device, failure)
        else:
            self.transport, self.results = chunk.transport, chunk.results
        # post each receive one transfer ahead (None: where that pays, see receives_ahead_pay)
        self.post_ahead = self.transport.posts_ahead and (receives_ahead_pay(device) if post_ahead is None else post_ahead)
        self.groups = groups
        self.replica_groups = groups.replicas
        self.loss_reduction = loss_reduction
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.num_stages - 1
        # boundaries to a stage on the same ranks (a V schedule's turn): hand-offs in process
        self._local_up = chunk is not None and not self.is_first and plan.stages[self.stage - 1].devices == self.stage_plan.devices
        self._local_down = chunk is not None and not self.is_last and plan.stages[self.stage + 1].devices == self.stage_plan.devices
        self.stats = StageStats()
        # each once: layers of one stage may share a parameter (tied weights)
        self._all_parameters = list({id(p): p for layer in self.layers for p in layer.parameters()}.values())
        self.parameters = self._trainable()
        self.tied = tied
        self.steps_done = 0  # training steps run so far (part of every dropout seed; a resume sets it)
        # the seed every rank's step seeds derive from (None: this process's initial seed);
        # the strategy gives rank 0's, so a step's draws before self(...) agree across stages
        self.job_seed: int | None = None
        self.evals_done = 0  # eval batches run so far (part of their step seeds)
        self.ledger: StashLedger | StageSlots = StashLedger() if chunk is None else StageSlots(chunk.ledger, self.stage)
        self.sizes = StashSizes(self.parameters)
        self._routes: dict[tuple[int, int], list[_Route]] = {}  # per (batch rows, micro-batches)
        self._actions: list[Action] = list(schedule.actions[self.stage]) if self.stage < schedule.num_stages else []
        self.pipeline_stage = self._build_stage(schedule, loss_reduction, forward_context)
        self.split = self.pipeline_stage.split
        self.store = self.pipeline_stage.store
        self.forward_context = self.pipeline_stage.forward_context
        self.recomputed = schedule.recomputed(self.stage) if self.stage < schedule.num_stages else frozenset()
        self._bucket_bytes = bucket_bytes
        self.sync = self._build_sync(bucket_bytes)
        self.buffers = StageBuffers(
            self.layers, self.replica_groups.get(self.stage), self.stage_plan.devices[0], self.replica, self.stage_plan.replicas, failure, self.stage
        )
        self._program = self._compile(settle_sends)
        # eval transfers (forward_step): activation of micro-batch mb from upstream and downstream
        self._eval_in = [transfer_key(Kind.RECV_ACT, self.stage, mb) for mb in range(plan.micro_batches)]
        self._eval_out = [transfer_key(Kind.SEND_ACT, self.stage, mb) for mb in range(plan.micro_batches)]
        # the step in progress: its routes and stash sizes (set by train_step)
        self._step_routes: list[_Route] = []
        self._step_sizes: StepSizes = KnownSizes({}, {})

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        rank: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        failure: FailureChannel,
        *,
        ties: Sequence[TiedParameter],
        groups: PlanGroups | None = None,
        tie_groups: dict[tuple[int, ...], Any] | None = None,
        schedule: Schedule | None = None,
        **options: Any,
    ) -> "StageRunner | ChunkedRunner":
        """This rank's runner of ``plan``: the one way every caller builds one.

        ``layers`` are the rank's layers: its stage's range, or, where the rank holds several
        stages (chunks), their ranges in pipeline order; such a rank gets a ``ChunkedRunner``
        with the same public face (``execute/chunked.py``).

        Process groups are collectives of the whole default group, so every rank calls this
        for every plan, in the same order: the replica and plan groups (``build_groups``)
        first, then one group per set of ranks sharing tied parameters (``ties``, the
        model's; ``tied_groups``). ``ties`` has no default: a rank sees only its own layers
        and cannot tell that one of them shares a parameter with another stage, so a
        forgotten tie would train silently wrong; callers say ``tied_parameters(layers)``
        of the whole layer list, or ``()`` for a model known to have none. A caller running several plans of one device layout
        passes the groups it made once (``groups``, ``tie_groups``). The schedule is the one
        the simulator times for the plan (``schedule_for_plan``) unless ``schedule`` is given.
        ``failure`` stays the caller's: it outlives the runner (its watchdog is closed by
        whoever opened it). ``options`` are ``StageRunner``'s own keywords (``post_ahead``,
        ``wire``, ``loss_reduction``, ...).
        """
        groups = groups if groups is not None else build_groups(plan)
        tied = None
        if ties:
            tie_groups = tie_groups if tie_groups is not None else tied_groups(plan, ties)
            tied = build_tied_sync(plan, ties, rank, layers, tie_groups, failure)
        schedule = schedule if schedule is not None else schedule_for_plan(plan)
        if len(plan.stages_of_rank(rank)) > 1:
            return cls._for_chunks(plan, schedule, rank, layers, device, failure, groups, tied, options)
        return cls(plan, schedule, rank, layers, device, failure, groups, tied=tied, **options)

    @classmethod
    def _for_chunks(
        cls,
        plan: Plan,
        schedule: Schedule,
        rank: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        failure: FailureChannel,
        groups: PlanGroups,
        tied: TiedSync | None,
        options: dict[str, Any],
    ) -> "ChunkedRunner":
        """A rank holding several stages: one runner per stage over its share of ``layers``
        (the rank's layers, its stages' ranges in pipeline order), driven in the group's merged
        order by a ``ChunkedRunner`` (``execute/chunked.py``), over one transport that keeps
        each boundary and direction apart (``links``: a tag under gloo, a communicator per
        stream under NCCL). The ``ChunkedRunner`` posts receives
        ahead in the merged order (``post_ahead`` as for one stage); each send is waited at
        the first receive of the merged order by which its receiver is known to have it
        (``schedule.settle.group_settle_points``; ``settle_sends=False``: all at the end of
        the step, the benchmarks' ablation)."""
        check_stream_orders(plan, schedule)
        wire = options.pop("wire", "auto")
        post_ahead = options.pop("post_ahead", None)
        settle = chunk_settle_points(schedule, plan.placement[plan.stages_of_rank(rank)[0]]) if options.pop("settle_sends", True) else {}
        # one transport and result channel per rank (collective under NCCL: every rank, once)
        shared = RankShared(
            Transport(failure, device, wire=wire, links=plan_streams(plan), tagged=True),
            ResultChannel(plan, rank, device, failure),
            StashLedger(),
            settle=settle,
        )
        units, offset = [], 0
        for stage in plan.stages_of_rank(rank):
            count = plan.stages[stage].end - plan.stages[stage].start
            own = layers[offset : offset + count]
            offset += count
            units.append(cls(plan, schedule, rank, own, device, failure, groups, tied=tied, chunk=shared.of_stage(stage), post_ahead=False, settle_sends=False, **options))
        posts = shared.transport.posts_ahead and (receives_ahead_pay(device, merged_order=True) if post_ahead is None else post_ahead)
        return ChunkedRunner(plan, schedule, rank, units, shared, tied, post_ahead=posts)

    # -- set-up: everything decided once per plan ----------------------------------
    def _build_stage(
        self, schedule: Schedule, loss_reduction: str, forward_context: Callable[[], ContextManager[Any]] | None
    ) -> Stage:
        """The rank's Stage: split backward (out-of-order backprop: the stage lists I actions)
        or not, and how many W actions each micro-batch gets."""
        split = self.stage < schedule.num_stages and schedule.splits(self.stage)
        self._w_count: dict[int, int] = {}
        for action in self._actions:
            if action.kind is Kind.W and action.microbatch is not None:
                self._w_count[action.microbatch] = self._w_count.get(action.microbatch, 0) + 1
        return Stage(
            self.layers, self.device, self.stage, self.replica, self.plan.num_stages,
            split=split, w_count=self._w_count, loss_reduction=loss_reduction, forward_context=forward_context,
            rows_as_last=self.plan.stages[0].replicas == self.plan.stages[-1].replicas,
        )

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self._all_parameters if p.requires_grad]

    def refresh_trainable(self) -> bool:
        """Follow parameters frozen or unfrozen since set-up (Lightning's ``BackboneFinetuning``
        unfreezes a backbone at an epoch): ``parameters``, the gradient buckets and the
        stash sizes are rebuilt from what requires grad now. Replicas of a stage run the
        same hooks, so they rebuild alike. Returns whether anything changed."""
        current = self._trainable()
        if len(current) == len(self.parameters) and all(a is b for a, b in zip(current, self.parameters)):
            return False
        self.parameters = current
        self.sizes = StashSizes(current)
        self.pipeline_stage.keep_trainable_deferred()
        if self.sync is not None:
            self.sync.close()
        self.sync = self._build_sync(self._bucket_bytes)
        return True

    def _build_sync(self, bucket_bytes: int) -> GradientSync | None:
        """The stage's gradient buckets; parameters that autograd reports (not deferred to W)."""
        self._hooked: list[nn.Parameter] = []
        group = self.replica_groups.get(self.stage)
        if group is None or not self.parameters:
            return None
        owned: list[list[nn.Parameter]] = []
        seen: set[int] = {id(p) for p in self.tied.params} if self.tied is not None else set()  # summed by TiedSync
        for layer in self.layers:
            owned.append([p for p in layer.parameters() if p.requires_grad and id(p) not in seen])
            seen.update(id(p) for p in owned[-1])
        sizes = [sum(p.numel() * p.element_size() for p in params) for params in owned]
        buckets = [[p for layer in range(lo, hi) for p in owned[layer]] for lo, hi in bucket_layers(sizes, 0, len(owned), bucket_bytes)]
        deferred = {id(p) for params in self.pipeline_stage.deferred for p in params}
        self._hooked = [p for p in self.parameters if id(p) not in deferred]
        return GradientSync(buckets, self._hooked, group, self.failure, self.stage)

    def _weight_spans(self) -> tuple[dict[int, tuple[int, int] | None], set[int]]:
        """Per W position: the layers it covers (widened to weight groups; None for all that
        is left, as the last W of its micro-batch does); and the positions of last Ws."""
        left = dict(self._w_count)
        spans: dict[int, tuple[int, int] | None] = {}
        last: set[int] = set()
        for position, action in enumerate(self._actions):
            if action.kind is Kind.W and action.microbatch is not None:
                left[action.microbatch] -= 1
                if left[action.microbatch] == 0:
                    last.add(position)
                narrow = action.layers is not None and position not in last
                spans[position] = self.pipeline_stage.weight_span(action.layers) if narrow else None
        return spans, last

    def _final_positions(self, spans: dict[int, tuple[int, int] | None]) -> dict[int, list[nn.Parameter]]:
        """Per action position: the deferred parameters whose last W work it does."""
        last: dict[int, int] = {}  # layer -> position of its last deferred work
        done: dict[int, set[int]] = {}  # micro-batch -> layers whose W ran
        every = set(range(len(self.layers)))
        for position, action in enumerate(self._actions):
            mb = action.microbatch
            if action.kind is Kind.B and mb is not None:
                for layer in every:  # a full backward: the weight work runs with it
                    last[layer] = position
            elif action.kind is Kind.W and mb is not None:
                span = spans[position]
                layers = set(range(*span)) if span is not None else every - done.get(mb, set())
                done.setdefault(mb, set()).update(layers)
                for layer in layers:
                    last[layer] = position
        final: dict[int, list[nn.Parameter]] = {}
        for layer, position in last.items():
            final.setdefault(position, []).extend(self.pipeline_stage.deferred[layer])
        return final

    def _compile(self, settle_sends: bool) -> list[_Op]:
        """The action list as ops: per action its handler and everything the plan decides."""
        actions = self._actions
        # per receive position: the earlier sends it waits for too (schedule/settle.py; a chunk
        # gets its share of its group's merged-order points); settle_sends=False leaves every
        # send to the end of the step (the benchmarks' ablation)
        settle_at: Mapping[int, frozenset[TransferKey]] = {}
        if self.chunk is not None:
            settle_at = self.chunk.settle.get(self.stage, {})
        elif settle_sends and actions:
            points = settle_points(self.schedule.actions)[self.stage]
            settle_at = {at: frozenset(transfer_key(kind, self.stage, mb) for kind, mb in keys) for at, keys in points.items()}
        spans, last_w = self._weight_spans()
        final_after = self._final_positions(spans) if self.sync is not None else {}
        last_b = max((i for i, a in enumerate(actions) if a.kind.is_backward), default=-1)
        receives = [i for i, a in enumerate(actions) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        program: list[_Op] = []
        upcoming = 0  # index into receives of the first receive after the current position
        for position, action in enumerate(actions):
            while upcoming < len(receives) and receives[upcoming] <= position:
                upcoming += 1
            if self.post_ahead and action.kind.is_compute and upcoming < len(receives):
                ahead = actions[receives[upcoming]]
                run = self._post_activation if ahead.kind is Kind.RECV_ACT else self._post_gradient
                key = transfer_key(ahead.kind, self.stage, ahead.microbatch)
                program.append(_Op(run, ahead.microbatch, key, position=receives[upcoming]))
            op = self._op(action, settle_at.get(position, frozenset()), spans.get(position), position == last_b, position in last_w)
            if op is not None:
                program.append(op._replace(position=position))
            if position in final_after:
                program.append(_Op(self._ready, params=final_after[position], position=position))
        return program

    def _op(self, action: Action, settle: frozenset[TransferKey], span: tuple[int, int] | None, last_b: bool, last_w: bool) -> _Op | None:
        """One action's op (None for ALLREDUCE: its buckets start when their gradients are final)."""
        kind, mb = action.kind, action.microbatch
        if kind is Kind.F:
            return _Op(self._forward_keeping_input if mb in self.recomputed else self._forward, mb)
        if kind.is_backward:
            return _Op(
                self._backward, mb, replay=mb in self.recomputed, final=self.sync is not None and last_b, pending_w=kind is Kind.I
            )
        if kind is Kind.W:
            return _Op(self._weight, mb, span=span, pending_w=not last_w)
        if kind in (Kind.RECV_ACT, Kind.SEND_ACT, Kind.RECV_GRAD, Kind.SEND_GRAD) and self._is_local(kind):
            handler = {
                Kind.RECV_ACT: self._take_activation,
                Kind.SEND_ACT: self._hand_activation,
                Kind.RECV_GRAD: self._take_gradient,
                Kind.SEND_GRAD: self._hand_gradient,
            }[kind]
            return _Op(handler, mb, transfer_key(kind, self.stage, mb))
        if kind in (Kind.RECV_ACT, Kind.SEND_ACT, Kind.RECV_GRAD, Kind.SEND_GRAD):
            handler = {
                Kind.RECV_ACT: self._recv_activation,
                Kind.SEND_ACT: self._send_activation,
                Kind.RECV_GRAD: self._recv_gradient,
                Kind.SEND_GRAD: self._send_gradient,
            }[kind]
            return _Op(handler, mb, transfer_key(kind, self.stage, mb), settle=settle)
        if kind is Kind.ALLREDUCE:
            return None
        raise NotImplementedError(f"action {action} is not supported by this executor")

    def _is_local(self, kind: Kind) -> bool:
        """Whether a transfer action crosses a boundary to a stage on this rank's own devices."""
        return self._local_down if kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else self._local_up

    # -- helpers ---------------------------------------------------------------
    def _rows(self, stage: int, replica: int, batch_rows: int, microbatch: int, micro_batches: int) -> tuple[int, int]:
        return slice_rows(batch_rows, micro_batches, microbatch, self.plan.stages[stage].replicas, replica)

    def _routes_for(self, batch_rows: int, micro_batches: int | None = None) -> list[_Route]:
        """Per micro-batch (the plan's M unless ``micro_batches``): this rank's rows and the
        ranks of the adjacent stages with theirs (memoised: the same few answers serve every step)."""
        count = micro_batches if micro_batches is not None else self.plan.micro_batches
        routes = self._routes.get((batch_rows, count))
        if routes is None:
            routes = self._routes[(batch_rows, count)] = [
                _Route(
                    self._rows(self.stage, self.replica, batch_rows, mb, count),
                    self._peers(self.stage - 1, batch_rows, mb, count) if not self.is_first else [],
                    self._peers(self.stage + 1, batch_rows, mb, count) if not self.is_last else [],
                )
                for mb in range(count)
            ]
        return routes

    def _peers(self, stage: int, batch_rows: int, microbatch: int, micro_batches: int) -> list[Peer]:
        """The ranks of ``stage`` and the rows of ``microbatch`` each holds."""
        devices = self.plan.stages[stage].devices
        return [Peer(rank, self._rows(stage, index, batch_rows, microbatch, micro_batches)) for index, rank in enumerate(devices)]

    def run_layers(self, x: Any, meter: StashMeter | None = None) -> Any:
        """Apply the stage's layers; with ``meter``, count what each layer stashes."""
        return self.pipeline_stage.run_layers(x, meter)

    def check_batch(self, batch_rows: int) -> None:
        widest = max(stage.replicas for stage in self.plan.stages)
        if batch_rows < self.plan.micro_batches * widest:
            raise DappleConfigError(
                "batch",
                f"has {batch_rows} samples, too few for {self.plan.micro_batches} micro-batches sliced over up to {widest} replicas",
                "use a larger batch, fewer micro-batches, or DataLoader(drop_last=True) to avoid a short last batch",
            )

    def eval_micro_batches(self, batch_rows: int) -> int:
        """The micro-batches of a forward-only pass over ``batch_rows`` rows: the plan's M, or
        fewer for a short batch (the last of a validation set), so that every replica of the
        widest stage still gets rows of each. Nothing is stashed for a backward, so M only
        shapes the pipeline; every rank sees the same batch and picks the same count."""
        widest = max(stage.replicas for stage in self.plan.stages)
        if batch_rows < widest:
            raise DappleConfigError(
                "batch",
                f"of a validation, test or predict loop has {batch_rows} samples, fewer than the {widest} replicas of the widest stage, each of which needs one",
                f"give that loop's DataLoader a batch size whose last batch keeps at least {widest} samples",
            )
        return min(self.plan.micro_batches, batch_rows // widest)

    # -- training ----------------------------------------------------------------
    def train_step(
        self,
        batch: Any,
        callbacks: StageCallbacks,
        extras: Callable[[], Any] | None = None,
    ) -> tuple[torch.Tensor, list[Any]]:
        """Run one optimizer step's forward/backward work; gradients are left in ``.grad``.

        Returns the loss of the whole global batch (the same on every rank, on the host:
        the step's one device-to-host read on the last stage) with the list of what
        ``extras()`` returned on each last-stage replica (on every rank). ``batch`` may stay
        where the DataLoader put it: the stage hands slices (views) of it to ``callbacks``.
        """
        started = time.perf_counter()
        batch_rows = batch_size_of(batch)
        self.check_batch(batch_rows)
        self.stats = stats = StageStats(spans=span_clock(self.device))
        assert isinstance(self.ledger, StashLedger)  # a runner of its own (not one stage of a ChunkedRunner)
        self.ledger.start()
        stats.stash_bytes = self.ledger.stash_bytes
        self.results.post()
        rng = save_rng(self.device)  # every F reseeds; the caller's RNG stream is put back when the step ends
        # the seed base is read before any reseed changes what initial_seed() answers
        seed = step_key(self.job_seed, self.steps_done)
        self.begin_step(batch, batch_rows, callbacks, seed, stats)
        try:
            self._run_program()
            self.transport.flush()
            self.finish_sync()
            if self.tied is not None:
                self.tied.finish()
            self.buffers.end_step()  # deferred BatchNorm statistics applied; replicas' buffers made the first one's
        finally:
            restore_rng(rng)
            losses = self.pipeline_stage.end_step()
            stats.peak_stash_bytes = self.ledger.peak_stash_bytes
            stats.peak_in_flight = self.ledger.peak_in_flight
            self.steps_done += 1
        self.finish_sizes()
        loss_sum = torch.stack(losses).to(torch.float64).sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        loss, shared = self.results.share(loss_sum, extras() if (extras is not None and self.is_last) else None)
        assert loss is not None
        stats.step_s = time.perf_counter() - started
        return loss, shared

    def begin_step(self, batch: Any, batch_rows: int, callbacks: StageCallbacks, seed: tuple, stats: StageStats) -> None:
        """This stage's part of starting a step: gradients cleared, the step's sizes and
        routes, gradient buckets reset, the Stage given the batch (``seed``: the step's)."""
        for param in self.parameters:
            param.grad = None
        self.stats = stats
        self._step_sizes = self.sizes.for_step((batch_rows, bool(self.layers) and self.layers[0].training))
        routes = self._step_routes = self._routes_for(batch_rows)
        if self.sync is not None:
            self.sync.start_step()
        self.pipeline_stage.begin_step(batch, batch_rows, [route.rows for route in routes], callbacks, 1.0, seed)

    @property
    def actions(self) -> list[Action]:
        """The stage's action list, as compiled."""
        return self._actions

    def ops_by_position(self) -> dict[int, list["_Op"]]:
        """The compiled ops, by the position in ``actions`` of the action each does."""
        out: dict[int, list[_Op]] = {}
        for op in self._program:
            out.setdefault(op.position, []).append(op)
        return out

    def post_ahead_op(self, position: int) -> "_Op | None":
        """An op posting the receive at ``position`` before its action, for a driver that
        posts ahead in a merged order (None: not a receive, or a hand-off with nothing to post)."""
        action = self._actions[position]
        if action.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD) or self._is_local(action.kind) or action.microbatch is None:
            return None
        run = self._post_activation if action.kind is Kind.RECV_ACT else self._post_gradient
        return _Op(run, action.microbatch, transfer_key(action.kind, self.stage, action.microbatch), position=position)

    def finish_sizes(self) -> None:
        """The step ran to its end: keep the stash sizes it measured."""
        self._step_sizes.finish()

    def finish_sync(self) -> None:
        """Launch the stage's remaining gradient buckets and wait for all of them."""
        if self.sync is not None:
            self.sync.finish()

    def name_failure(self, exc: BaseException, op: "_Op") -> None:
        """Rename ``exc`` after the action ``op`` does (``execute/action_errors.py``)."""
        if op.position >= 0:
            name_action(exc, self._actions[op.position], self._actions, op.position)

    def _run_program(self) -> None:
        """Run the step's ops; an error is renamed after the action it happened in
        (``execute/action_errors.py``), except a peer's failure, which names its own."""
        op: _Op | None = None
        try:
            for op in self._program:
                op.run(op)
        except PeerFailedError:
            raise
        except Exception as exc:
            if op is not None:
                self.name_failure(exc, op)
            raise

    # -- op handlers: compute ---------------------------------------------------------
    def _forward(self, op: _Op) -> None:
        begun = self.stats.spans.begin()
        self.ledger.forwarded(op.mb, self._step_sizes.forward(self.pipeline_stage.forward, op.mb))
        self.stats.spans.end(begun, "F", op.mb, self.stage)

    def _forward_keeping_input(self, op: _Op) -> None:
        begun = self.stats.spans.begin()
        kept = self.pipeline_stage.forward_keeping_input(op.mb)
        self.ledger.forwarded(op.mb, self._step_sizes.kept(op.mb, kept))
        self.stats.spans.end(begun, "F", op.mb, self.stage)

    def _backward(self, op: _Op) -> None:
        begun = self.stats.spans.begin()
        mb, stage = op.mb, self.pipeline_stage
        if op.replay:
            replayed = self._step_sizes.replay(stage.recompute, mb)
            self.stats.recomputed += 1
            self.ledger.hold(mb, replayed)
        if op.final:
            sync = self.sync
            assert sync is not None
            sync.live = True  # the last backward: autograd reports finished gradients
            kept = stage.backward_input(mb)
            sync.live = False
            sync.ready_all(self._hooked)  # also those that got no gradient in this B
        else:
            kept = stage.backward_input(mb)
        if op.pending_w:
            self.ledger.keep_only(mb, kept)  # the graph is freed: what its W work keeps is left
        else:
            self.ledger.drop(mb)
        self.stats.spans.end(begun, "B", mb, self.stage)

    def _weight(self, op: _Op) -> None:
        begun = self.stats.spans.begin()
        self.pipeline_stage.backward_weight(op.mb, op.span)
        self.stats.spans.end(begun, "W", op.mb, self.stage)
        if op.pending_w:
            self.ledger.keep_only(op.mb, self.store.held_bytes(op.mb))  # the other layers' pairs
        else:
            self.ledger.drop(op.mb)

    def _ready(self, op: _Op) -> None:
        """Deferred parameters whose gradient of the step is final: their buckets may start."""
        assert self.sync is not None
        self.sync.ready_all(op.params)

    # -- op handlers: transfers ---------------------------------------------------------
    def _recv_activation(self, op: _Op) -> None:
        route = self._step_routes[op.mb]
        self.pipeline_stage.receive(op.mb, self.transport.recv_activation(route.rows, route.upstream, op.key))
        self.transport.settle(op.settle)

    def _send_activation(self, op: _Op) -> None:
        route = self._step_routes[op.mb]
        self.transport.send_activation(self.pipeline_stage.outputs(op.mb), route.rows, route.downstream, op.key)

    def _recv_gradient(self, op: _Op) -> None:
        route = self._step_routes[op.mb]
        like = self.pipeline_stage.gradient_like(op.mb)
        assert like is not None, f"stage {self.stage}: gradient {op.mb} received before its forward"
        grads = self.transport.recv_gradient(like, route.rows, route.downstream, op.key)
        self.pipeline_stage.receive_gradient(op.mb, like, grads)
        self.transport.settle(op.settle)

    def _send_gradient(self, op: _Op) -> None:
        route = self._step_routes[op.mb]
        self.transport.send_gradient(self.pipeline_stage.input_gradients(op.mb), route.rows, route.upstream, op.key)

    # -- op handlers: hand-offs to a stage on the same ranks (``_is_local``) --------------
    def _hand_activation(self, op: _Op) -> None:
        """The stage output, cut from this stage's graph (the next stage's backward stops at
        its input, as after a wire), for the stage on the same ranks."""
        assert self.chunk is not None
        self.chunk.handoffs.put(op.key, detached(self.pipeline_stage.outputs(op.mb)))

    def _take_activation(self, op: _Op) -> None:
        assert self.chunk is not None
        self.pipeline_stage.receive(op.mb, self.chunk.handoffs.take(op.key))

    def _hand_gradient(self, op: _Op) -> None:
        assert self.chunk is not None
        self.chunk.handoffs.put(op.key, self.pipeline_stage.input_gradients(op.mb))

    def _take_gradient(self, op: _Op) -> None:
        assert self.chunk is not None
        like = self.pipeline_stage.gradient_like(op.mb)
        assert like is not None, f"stage {self.stage}: gradient {op.mb} handed back before its forward"
        self.pipeline_stage.receive_gradient(op.mb, like, self.chunk.handoffs.take(op.key))

    def _post_activation(self, op: _Op) -> None:
        """Post the receives of the next receive action before this compute runs, so its
        data arrives meanwhile (one transfer ahead, in action order: see transport)."""
        if self.transport.is_posted(op.key):
            return
        route = self._step_routes[op.mb]
        self.transport.post_activation(route.rows, route.upstream, op.key)

    def _post_gradient(self, op: _Op) -> None:
        """As ``_post_activation``, for a gradient (once its forward has run: sizes known)."""
        if self.transport.is_posted(op.key):
            return
        like = self.pipeline_stage.gradient_like(op.mb)
        if like is not None:
            route = self._step_routes[op.mb]
            self.transport.post_gradient(like, route.rows, route.downstream, op.key)

    def finish(self) -> None:
        """Wait for every send still pending (the last results hand-off), so that no send
        outlives the runner or the process group it was issued on."""
        self.transport.flush()
        self.results.flush()

    def share_extras(self, obj: Any) -> list[Any]:
        """Objects of every last-stage replica (in replica order), on every rank of the plan."""
        return self.results.share(None, obj)[1]

    # -- forward only (validation, test, predict) -------------------------------
    def forward_step(self, batch: Any, callbacks: EvalCallbacks) -> list[Any]:
        """GPipe-style forward of every micro-batch; returns the last stage's per-slice
        results ordered by (micro-batch, replica), on every rank."""
        batch_rows = batch_size_of(batch)
        count = self.eval_micro_batches(batch_rows)
        self.results.post()
        rng = save_rng(self.device)  # the step seeds draw; the caller's RNG stream is put back
        self.evals_done += 1
        try:
            results = self.eval_pass(batch, batch_rows, callbacks, count, step_key(self.job_seed, self.steps_done, self.evals_done))
        finally:
            restore_rng(rng)
        self.transport.flush()
        return self.gather_eval(results if self.is_last else None, count)

    def eval_pass(self, batch: Any, batch_rows: int, callbacks: EvalCallbacks, micro_batches: int, key: tuple) -> list[Any]:
        """This stage's forward of each of ``micro_batches`` (the user's step under the seed
        of ``key`` and each slice's rows); the last stage's per-slice results."""
        routes = self._routes_for(batch_rows, micro_batches)
        stage = self.pipeline_stage
        results: list[Any] = []
        with torch.no_grad(), stage.forward_context():
            for mb, route in enumerate(routes):
                batch_slice = take_rows(batch, *route.rows)
                if self.is_first:
                    received = None if self.is_last else stage.eval_input(batch_slice, route.rows, callbacks, key)
                elif self._local_up:
                    assert self.chunk is not None
                    received = self.chunk.handoffs.take(self._eval_in[mb])
                else:
                    received = self.transport.recv_activation(route.rows, route.upstream, self._eval_in[mb])
                if self.is_last:
                    weight = (route.rows[1] - route.rows[0]) / batch_rows
                    results.append(stage.evaluate(batch_slice, received, callbacks, weight, route.rows, key))
                elif self._local_down:
                    assert self.chunk is not None
                    self.chunk.handoffs.put(self._eval_out[mb], stage.run_layers(received))
                else:
                    self.transport.send_activation(stage.run_layers(received), route.rows, route.downstream, self._eval_out[mb])
        return results

    def gather_eval(self, results: list[Any] | None, micro_batches: int) -> list[Any]:
        """The last stage's per-slice results (``results`` there, None elsewhere), ordered by
        (micro-batch, replica), on every rank."""
        gathered = self.share_extras(results)
        replicas = self.plan.stages[-1].replicas
        return [gathered[replica][mb] for mb in range(micro_batches) for replica in range(replicas)]
