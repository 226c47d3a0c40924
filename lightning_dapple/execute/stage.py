"""One rank's pipeline stage: its layers and the autograd work of each micro-batch.

The runner (``execute/runner.py``) walks a schedule's action list and calls the stage for
the compute actions; the stage keeps what each micro-batch needs between them:

* F (``forward``): run the stage's layers on one micro-batch slice (the first stage takes it
  from the batch via ``make_input``; the last computes the loss via ``compute_loss``),
  stashing what backward needs (DAPPLE 3.2: at most K_i micro-batches in flight). Each F
  runs under an RNG seed of its own (step, stage, replica, micro-batch), so dropout masks do
  not depend on the order in which a schedule runs its forwards, and a recomputation
  replays them exactly. The user's step around it (the first stage runs it up to
  ``self(...)``, the last all of it) runs under a seed of the step and the slice's rows,
  the same on both, so what it draws before ``self(...)`` is drawn alike. Losses are weighted by (slice rows / global batch rows) for
  mean-reduced losses, so the accumulated gradients are exactly those of one device on the
  whole global batch;
* B (``backward_input``): backpropagate that micro-batch, accumulating parameter gradients
  (DAPPLE 5.2.3: "each device produces and accumulates gradients for all micro-batches").
  When the schedule splits backward (out-of-order backprop, ooo-backprop sec. 3), the
  stage's GEMM-shaped modules leave their weight gradients to W
  (``execute/weight_grad.py``): B is still one ordinary backward that frees the graph, and
  the input gradient can go upstream at once (gradient fast-forwarding, DAPPLE 5.2);
* W (``backward_weight``): the deferred weight gradients of one micro-batch from the
  (input, output gradient) pairs B filed. A W limited to some layers runs only those,
  widened to whole weight groups (the ending phase of reverse first-k, ooo-backprop
  Algorithm 2);
* recomputation (gpipe.txt 2.3, per stage ``never``/``always``/``except_last``): the F of a
  recomputed micro-batch (``forward_keeping_input``) keeps only the stage input; right
  before its B the stage forward is replayed (``recompute``) under the same seed, on
  scratch copies of the buffers, and B/W then use that replay (see ``execute/replay.py``
  for why this is not ``torch.utils.checkpoint``).

Which micro-batches are recomputed, whether backward is split and how many W actions each
micro-batch gets are facts of the plan: the runner decides them once and calls the matching
method, so none of these methods switches on a mode. Stash sizes are the caller's concern
(``execute/stash_ledger.py``): a stashing forward takes an optional ``StashMeter``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.replay import buffer_slots, detached, discard_saved, reseed, same_rng, save_rng, scratch_buffers, tensor_leaves, weight_groups
from lightning_dapple.execute.slicing import flatten, take_rows
from lightning_dapple.execute.weight_grad import WeightGradStore, deferrable_modules, install_deferred_weights
from lightning_dapple.profile.inplace import writes_input_in_place
from lightning_dapple.profile.stash import StashMeter

__all__ = ["Stage", "StageCallbacks", "EvalCallbacks"]


class StageCallbacks(Protocol):
    """How the user's code enters the pipeline (provided by the Lightning glue)."""

    def make_input(self, batch: Any) -> Any:
        """First stage: the input of layer 0 for this batch slice."""

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        """Last stage: the loss of this slice; ``forward`` answers ``self(x)`` with the stage output."""


class EvalCallbacks(Protocol):
    def make_input(self, batch: Any) -> Any:
        """First stage: the input of layer 0 for this batch slice."""

    def compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        """Last stage: the (picklable) result of the eval step on this slice."""


@dataclass(slots=True)
class _MicroBatch:
    """What one micro-batch keeps on this stage between its actions."""

    rows: tuple[int, int]
    inputs: Any = None
    # the stage output after F; (outputs that require grad, their gradients) after RECV_GRAD
    outputs: Any = None
    loss: torch.Tensor | None = None
    # last stage, recomputed: the detached stage outputs the loss was computed from
    y: list[torch.Tensor] | None = None
    # recomputed: (replayed outputs, their gradients), from ``recompute`` until B
    replayed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    w_todo: int = 0  # W actions still to come
    sent: bool = False  # the input gradient went upstream (or there is no upstream)


class Stage:
    """The layers of one stage on one rank, and the forward/backward work of its micro-batches.

    ``index``/``replica`` name the rank's place in the plan (part of every dropout seed);
    ``split`` defers the weight gradients of the GEMM-shaped modules to W, of which
    micro-batch mb gets ``w_count[mb]`` (none: its weight work runs right after its B).
    Which micro-batches are recomputed the caller says by calling ``forward_keeping_input``
    and ``recompute`` for them.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        device: torch.device,
        index: int,
        replica: int,
        num_stages: int,
        split: bool = False,
        w_count: Mapping[int, int] | None = None,
        loss_reduction: str = "mean",
        forward_context: Callable[[], ContextManager[Any]] | None = None,
        rows_as_last: bool = True,
    ) -> None:
        self.layers = list(layers)
        self._copy_input = bool(self.layers) and writes_input_in_place(self.layers[0])
        # whether the first and last stage hold the same rows of every micro-batch (equal
        # replica counts): then the user's step draws the same random numbers on both
        self.rows_as_last = rows_as_last
        self._rng_checked = False
        self.device = device
        self.index = index
        self.replica = replica
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        # the layers of the stages before this last one draw random numbers when they train
        # (set by the strategy, which sees every layer: execute/random_layers.py)
        self.upstream_draws = False
        self.split = split
        self.loss_reduction = loss_reduction
        self.forward_context = forward_context or contextlib.nullcontext
        self.store = WeightGradStore()
        self._w_count = dict(w_count or {}) if split else {}
        self._groups = weight_groups(self.layers)
        self._buffer_slots = buffer_slots(self.layers)  # where the buffers a replay must not write live
        # per layer: the parameters whose gradients W computes (empty unless split)
        self.deferred: list[list[nn.Parameter]] = [[] for _ in self.layers]
        self._routed: list[list[nn.Parameter]] = [[] for _ in self.layers]  # through the store, trained or not
        if split:
            install_deferred_weights(self.layers, self.store)
            self._routed = [_unique(p for m in deferrable_modules(layer) for p in m.parameters(recurse=False)) for layer in self.layers]
            self.keep_trainable_deferred()
        self._state: dict[int, _MicroBatch] = {}
        self._begin(None, 0, (), None, 1.0, ())

    def keep_trainable_deferred(self) -> None:
        """``deferred``: the routed parameters that require grad now (a frozen one gets no W)."""
        self.deferred = [[p for p in params if p.requires_grad] for params in self._routed]

    def _begin(self, batch: Any, batch_rows: int, rows: Sequence[tuple[int, int]], callbacks: Any, loss_scale: float, seed: tuple) -> None:
        """The context every action of a step shares (emptied between steps)."""
        self._batch = batch
        self._batch_rows = batch_rows
        self._rows = rows
        self._callbacks = callbacks
        self._loss_scale = loss_scale
        self._step_key = seed
        self._seed_key = (*seed, self.index, self.replica)
        self._losses: list[torch.Tensor] = []

    # -- the step ---------------------------------------------------------------------
    def begin_step(
        self,
        batch: Any,
        batch_rows: int,
        rows: Sequence[tuple[int, int]],
        callbacks: StageCallbacks,
        loss_scale: float,
        seed: tuple,
    ) -> None:
        """Start a training step on ``batch`` (``batch_rows`` rows; micro-batch mb's slice on
        this rank is ``rows[mb]``); every forward's seed hashes ``seed`` with the stage,
        replica and micro-batch."""
        self._state.clear()
        self._begin(batch, batch_rows, rows, callbacks, loss_scale, seed)

    def end_step(self) -> list[torch.Tensor]:
        """End the step (also one that failed): drop every micro-batch's state and pending
        weight work; returns the (detached, weighted) losses of the last stage's slices."""
        losses = self._losses
        self._state.clear()
        self.store.clear()
        self._begin(None, 0, (), None, 1.0, ())
        return losses

    def weight_span(self, layers: tuple[int, int]) -> tuple[int, int]:
        """``layers`` (stage-local, half-open) widened to whole weight groups: a W covers
        every use of a parameter that layers share."""
        lo, hi = layers
        meets = [g for g in self._groups if g[0] < hi and g[1] > lo]
        return min([lo] + [g[0] for g in meets]), max([hi] + [g[1] for g in meets])

    def run_layers(self, x: Any, meter: StashMeter | None = None) -> Any:
        """Apply the stage's layers; with ``meter``, count what they stash together (the
        layers only: the loss's own saves are not in any profile; a tensor two layers save
        counts once, as ``model_profile.stash_span_bytes`` prices it). A first layer that
        writes its input in place gets a copy of a received input (``profile/inplace.py``)."""
        if self._copy_input:
            x = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, x)
        if meter is None:
            for layer in self.layers:
                x = layer(x)
            return x
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            for layer in self.layers:
                x = layer(x)
        return x

    def _seed(self, microbatch: int) -> int:
        """The RNG seed of one micro-batch's stage forward on this rank in this step."""
        return hash((*self._seed_key, microbatch)) & 0x7FFF_FFFF_FFFF_FFFF

    def _step_seed(self, rows: tuple[int, int], key: tuple | None = None) -> int:
        """The RNG seed of the user's step on one slice (rows of the batch) in the step
        ``key`` names (this training step's by default): the same on the first stage, whose
        step makes the input, and the last, whose step computes the loss from it, so noise or
        masks the step draws before ``self(...)`` are the same draws on both (ints only:
        Python hashes them alike in every process)."""
        return hash((*(self._step_key if key is None else key), -1, *rows)) & 0x7FFF_FFFF_FFFF_FFFF

    # -- boundaries ----------------------------------------------------------------------
    def receive(self, microbatch: int, inputs: Any) -> None:
        """The stage input of ``microbatch`` arrived from upstream."""
        self._state[microbatch] = _MicroBatch(rows=self._rows[microbatch], inputs=inputs)

    def outputs(self, microbatch: int) -> Any:
        """The stage output of ``microbatch`` (what goes downstream)."""
        return self._state[microbatch].outputs

    def gradient_like(self, microbatch: int) -> list[torch.Tensor] | None:
        """The outputs of ``microbatch`` that require grad (what a gradient from downstream
        is for); None before its forward ran."""
        item = self._state.get(microbatch)
        if item is None or item.outputs is None:
            return None
        return [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]

    def receive_gradient(self, microbatch: int, like: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """The gradients of the outputs ``like`` arrived from downstream."""
        self._state[microbatch].outputs = (like, grads)

    def input_gradients(self, microbatch: int) -> list[torch.Tensor]:
        """The gradients of the inputs of ``microbatch`` that require grad (zeros where B gave
        none), handed upstream: the stage keeps no reference to its inputs after this, nor
        do the inputs to their gradients (an input a pending W still reads would otherwise
        keep its gradient alive until that W)."""
        item = self._state[microbatch]
        leaves = [leaf for leaf in flatten(item.inputs)[0] if leaf.requires_grad]
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        item.inputs = None
        item.sent = True
        self._release(microbatch, item)
        return grads

    def _item(self, microbatch: int) -> _MicroBatch:
        item = self._state.get(microbatch)
        if item is None:
            item = self._state[microbatch] = _MicroBatch(rows=self._rows[microbatch])
        return item

    def _release(self, microbatch: int, item: _MicroBatch) -> None:
        if item.sent and item.w_todo <= 0 and item.outputs is None:
            self._state.pop(microbatch, None)

    # -- forward -----------------------------------------------------------------------
    def forward(self, microbatch: int, meter: StashMeter | None = None) -> None:
        """F of ``microbatch``, stashing for its B (counted by ``meter`` if given)."""
        item = self._state.get(microbatch)
        if item is None:
            item = self._state[microbatch] = _MicroBatch(rows=self._rows[microbatch])
        self.store.recording = microbatch if self.split else None
        try:
            with self.forward_context():
                self._forward(microbatch, item, take_rows(self._batch, *item.rows), False, meter)
        finally:
            self.store.recording = None

    def forward_keeping_input(self, microbatch: int) -> Any:
        """F of a recomputed ``microbatch``: the graph is recorded (so each output knows whether
        it requires grad) but only the stage input is kept; returns that input."""
        item = self._item(microbatch)
        with self.forward_context():
            self._forward(microbatch, item, take_rows(self._batch, *item.rows), True, None)
        return item.inputs

    def _keep_input(self, item: _MicroBatch, x: Any) -> Any:
        """The stage output of ``x`` with the graph recorded but nothing saved; keeps ``x``."""
        item.inputs = x
        with discard_saved():
            return detached(self.run_layers(x))

    def _forward(self, microbatch: int, item: _MicroBatch, batch_slice: Any, keep_input: bool, meter: StashMeter | None) -> None:
        """The stage forward of one micro-batch. The user's step (first stage: up to
        ``self(...)``; last: all of it) runs under the step seed of its rows, the layers under
        the stage's own seed (which ``recompute`` replays)."""
        callbacks = self._callbacks
        if not self.is_last:
            x = self._make_input(callbacks, batch_slice, item.rows) if self.is_first else item.inputs
            reseed(self._seed(microbatch), self.device)
            item.outputs = self._keep_input(item, x) if keep_input else self.run_layers(x, meter)
            return
        received = item.inputs
        calls = 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            x = (args[0] if len(args) == 1 else args) if self.is_first else received
            calls += 1
            if calls == 1:  # later calls draw on from here (two dropout samples differ)
                reseed(self._seed(microbatch), self.device)
            if not keep_input:
                return self.run_layers(x, meter)
            y = self._keep_input(item, x)
            item.y = [leaf for leaf in tensor_leaves(y) if leaf.requires_grad]
            return y

        reseed(self._step_seed(item.rows), self.device)
        # the whole model in one process, stash kept: another call runs the layers on its own input
        guarded = guard_calls(forward, keep_input, self.upstream_draws)
        try:
            loss = callbacks.compute_loss(batch_slice, forward if self.is_first and not keep_input else guarded)
        except RuntimeError as exc:
            if self.is_first or "appears to not have been used in the graph" not in str(exc):
                raise
            raise DappleConfigError(
                "training_step",
                "differentiates the model's output with respect to its input (torch.autograd.grad(out, x): a "
                "physics-informed loss, an input-gradient penalty), but on a pipeline the last stage computes the output "
                "from the activation the previous stage sent, not from the step's x",
                "train such a model on a single-stage plan (data parallelism), where the whole model runs in each process",
            ) from exc
        weight = (item.rows[1] - item.rows[0]) / self._batch_rows if self.loss_reduction == "mean" else 1.0
        loss = loss * weight
        self._losses.append(loss.detach())
        item.loss = loss * self._loss_scale if self._loss_scale != 1.0 else loss

    def _make_input(self, callbacks: StageCallbacks | EvalCallbacks, batch_slice: Any, rows: tuple[int, int], key: tuple | None = None) -> Any:
        """The first stage's part of the user's step, under the step seed of ``rows``. Where
        the last stage holds other rows (another replica count) its draws cannot be these:
        a step that draws random numbers before ``self(...)`` is refused there, once."""
        reseed(self._step_seed(rows, key), self.device)
        if self.rows_as_last or self._rng_checked:
            return callbacks.make_input(batch_slice)
        self._rng_checked = True
        before = save_rng(self.device)
        x = callbacks.make_input(batch_slice)
        require(
            same_rng(before, save_rng(self.device)),
            "training_step",
            "draws random numbers before self(...) (noise, masks), and the first and last stage have different replica "
            "counts, so they hold different rows of each micro-batch: the loss could not see the draws the input was made with",
            "give the first and the last stage the same number of replicas, or draw the randomness inside a layer",
        )
        return x

    def recompute(self, microbatch: int, meter: StashMeter | None = None) -> None:
        """Replay the stage forward of a recomputed ``microbatch`` with autograd (same seed,
        buffers untouched: its first forward updated them), right before its B; B then
        starts from the replayed outputs."""
        item = self._state[microbatch]
        if self.is_last:
            assert item.loss is not None and item.y is not None
            grads = list(torch.autograd.grad(item.loss, item.y, allow_unused=True)) if item.y else []
            grads = [g if g is not None else torch.zeros_like(y) for g, y in zip(grads, item.y)]
            like: list[torch.Tensor] = item.y
        else:
            like, grads = item.outputs
        self.store.recording = microbatch if self.split else None
        try:
            reseed(self._seed(microbatch), self.device)  # the step restores the caller's RNG state
            with scratch_buffers(self._buffer_slots), self.forward_context():
                outputs = self.run_layers(item.inputs, meter)
        finally:
            self.store.recording = None
        replayed = [leaf for leaf in tensor_leaves(outputs) if leaf.requires_grad]
        if len(replayed) != len(like):
            raise RuntimeError(
                f"stage {self.index}: the recomputed forward of micro-batch {microbatch} has {len(replayed)} outputs that "
                f"require grad, the original had {len(like)}; recomputation needs a forward that depends only on its input and the RNG"
            )
        item.replayed = (replayed, list(grads))

    # -- backward ----------------------------------------------------------------------
    def _roots(self, item: _MicroBatch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What B starts from: the replay (recomputed), the loss (last stage) or the stage
        outputs with the gradients received for them."""
        if item.replayed is not None:
            return item.replayed
        if self.is_last:
            assert item.loss is not None
            return [item.loss], None
        outputs, grads = item.outputs
        return list(outputs), list(grads)

    def backward_input(self, microbatch: int) -> int:
        """B of ``microbatch``: one backward that frees its graph. Split, the deferrable
        weight gradients are filed for W (run at once when no W is scheduled for it);
        returns the bytes its W keeps, inputs and output gradients (0 when none is pending)."""
        item = self._state[microbatch]
        roots, root_grads = self._roots(item)
        item.loss = None
        item.y = None
        item.replayed = None
        if roots:
            self.store.splitting = microbatch  # this backward, and only it, files weight work for W
            try:
                torch.autograd.backward(roots, root_grads)
            finally:
                self.store.splitting = None
        del roots, root_grads
        item.outputs = None
        item.w_todo = self._w_count.get(microbatch, 0)
        held = 0
        if item.w_todo > 0:
            held = self.store.held_bytes(microbatch)
        else:
            self.store.run(microbatch)  # split but no W scheduled for it: the weight work runs now
        if self.is_first:
            item.sent = True
        self._release(microbatch, item)
        return held

    def backward_weight(self, microbatch: int, layers: tuple[int, int] | None = None) -> None:
        """W of ``microbatch``: its deferred weight gradients, those of ``layers`` (a
        ``weight_span``) only when given."""
        item = self._state[microbatch]
        item.w_todo -= 1
        self.store.run(microbatch, layers)
        if item.w_todo <= 0:
            self._release(microbatch, item)

    # -- forward only (validation, test, predict) ----------------------------------------
    def eval_input(self, batch_slice: Any, rows: tuple[int, int], callbacks: EvalCallbacks, key: tuple) -> Any:
        """The first stage's input of one slice for an eval step: the user's step up to
        ``self(...)`` under the step seed of ``key`` (one per eval batch) and ``rows``, which
        ``evaluate`` on the last stage uses too, so a validation step drawing noise or
        timesteps before ``self(...)`` (a diffusion model's loss) sees one draw on both."""
        return self._make_input(callbacks, batch_slice, rows, key)

    def evaluate(self, batch_slice: Any, received: Any, callbacks: EvalCallbacks, weight: float, rows: tuple[int, int], key: tuple) -> Any:
        """The last stage's eval result on one slice (``received``: the stage input from
        upstream; on a single-stage plan the callbacks make it), under the step seed
        ``eval_input`` used for these rows."""
        reseed(self._step_seed(rows, key), self.device)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.is_first:
                return self.run_layers(args[0] if len(args) == 1 else args)
            return self.run_layers(received)

        return callbacks.compute_output(batch_slice, forward if self.is_first else guard_calls(forward, False), weight)


def guard_calls(forward: Callable[..., Any], recomputed: bool, upstream_draws: bool = False) -> Callable[..., Any]:
    """``forward`` for a step whose layer input arrived from upstream for its first
    ``self(...)`` call. A later call with that same input runs the layers again (a loss and
    then a metric from ``self(x)``); one with another input (a second view of the batch, a
    consistency or contrastive term) would silently get the first input's output, and is
    refused, as is any second call on a ``recomputed`` stage, which keeps one call's
    input and outputs per micro-batch, and, in training, any second call where the stages
    before this one draw dropout (``upstream_draws``): it would share their draws, where
    one device draws anew (R-Drop's two samples)."""
    first: list[Any] = []

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.append(args)
            return forward(*args, **kwargs)
        require(
            not recomputed,
            "training_step",
            "calls self(...) more than once on a stage that recomputes its forward, which keeps one call's input and outputs per micro-batch",
            "call self(...) once per step, or give that stage recompute='never'",
        )
        require(
            not upstream_draws,
            "training_step",
            "calls self(...) again on the same input, expecting new dropout draws (R-Drop, a consistency term between two "
            "samples), but the stages before the last run once per micro-batch, so both calls would share their dropout",
            "put both samples in one batch (self(torch.cat([x, x])) and split the output), or train on a single-stage plan",
        )
        require(
            _same_input(first[0], args),
            "training_step / validation_step",
            "calls self(...) again with another input (a second view of the batch, a consistency or contrastive term, "
            "a decoding loop feeding outputs back); a pipeline runs the layers once per micro-batch, on the input of the "
            "step's first self(...) call",
            "put the views in one batch (torch.cat), call self(...) once and split the output; decode after fit, on the "
            "whole model rank 0 gets back; or train on a single-stage plan (data parallelism) without recomputation",
        )
        return forward(*args, **kwargs)

    return guarded


def _same_input(a: Any, b: Any) -> bool:
    """Whether two ``self(...)`` argument tuples hold the same tensors (or equal ones)."""
    left, left_spec = pytree.tree_flatten(a)
    right, right_spec = pytree.tree_flatten(b)
    if left_spec != right_spec or len(left) != len(right):
        return False
    return all(
        x is y or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y))
        or (not isinstance(x, torch.Tensor) and x == y)
        for x, y in zip(left, right)
    )


def _unique(params: Any) -> list[nn.Parameter]:
    out, seen = [], set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out
