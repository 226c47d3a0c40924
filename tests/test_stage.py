"""The executor's pieces without processes: ``Stage`` gives exactly the gradients of plain
autograd (split into B and W, recomputed, as a middle stage), transfer keys agree on both
ends of a transfer, and the stash ledger and sizes account as the runner relies on."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from lightning_dapple.execute.transfer.keys import Direction, TransferKey, transfer_key
from lightning_dapple.execute.stage import Stage
from lightning_dapple.execute.stash_ledger import KnownSizes, MeasuringSizes, StashLedger, StashSizes
from lightning_dapple.schedule.actions import Kind

ROWS = 6
MICRO = 2  # micro-batch mb holds rows [3 mb, 3 mb + 3)


class _Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        return nn.functional.mse_loss(forward(batch[0]), batch[1])


def _layers(dropout: float = 0.0) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Dropout(dropout)),
        nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 5)),  # LayerNorm: gradients in B, Linear: deferred to W
        nn.Linear(5, 3),
    ]
    return [layer.double() for layer in layers]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 4, dtype=torch.float64, generator=generator), torch.randn(ROWS, 3, dtype=torch.float64, generator=generator)


def _reference() -> list[torch.Tensor]:
    layers = _layers()
    x, y = _batch()
    out = x
    for layer in layers:
        out = layer(out)
    nn.functional.mse_loss(out, y).backward()
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def _grads(layers: list[nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


def _rows() -> list[tuple[int, int]]:
    return [(mb * ROWS // MICRO, (mb + 1) * ROWS // MICRO) for mb in range(MICRO)]


def _stage(layers: list[nn.Module], split: bool, w_count: dict[int, int] | None = None, index: int = 0, stages: int = 1) -> Stage:
    stage = Stage(layers, torch.device("cpu"), index, 0, stages, split=split, w_count=w_count)
    stage.begin_step(_batch(), ROWS, _rows(), _Callbacks(), 1.0, (1234, 0))
    return stage


def test_forward_and_backward_give_the_gradients_of_plain_autograd() -> None:
    layers = _layers()
    stage = _stage(layers, split=False)
    for mb in range(MICRO):
        stage.forward(mb)
    for mb in range(MICRO):
        stage.backward_input(mb)
    losses = stage.end_step()
    x, y = _batch()
    with torch.no_grad():
        whole = float(nn.functional.mse_loss(nn.Sequential(*_layers())(x), y))
    assert float(torch.stack(losses).sum()) == pytest.approx(whole, abs=1e-14)  # slices weighted by their rows
    for got, want in zip(_grads(layers), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_split_backward_leaves_the_linear_weights_to_w_and_then_matches() -> None:
    layers = _layers()
    stage = _stage(layers, split=True, w_count={0: 2, 1: 1})
    assert [len(params) for params in stage.deferred] == [2, 2, 2]  # each Linear's weight and bias
    for mb in range(MICRO):
        stage.forward(mb)
        assert stage.backward_input(mb) == 3 * (4 + 5 + 5 + 5 + 5 + 3) * 8  # each Linear's input and output gradient, kept for W
    linear_weights = [layers[0][0].weight, layers[1][1].weight, layers[2].weight]
    assert all(w.grad is None for w in linear_weights)  # B computed no deferred gradient
    assert layers[1][0].weight.grad is not None  # LayerNorm's gradient came with B
    stage.backward_weight(0, stage.weight_span((2, 3)))  # micro-batch 0's first W: the last layer only
    assert layers[2].weight.grad is not None and layers[0][0].weight.grad is None
    stage.backward_weight(0)  # its last W: all that is left
    stage.backward_weight(1)
    stage.end_step()
    for got, want in zip(_grads(layers), _reference()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def _split_step(stage: Stage) -> None:
    """Every micro-batch's F and B, then every W, as ooo-backprop's tail runs them."""
    for mb in range(MICRO):
        stage.forward(mb)
        stage.backward_input(mb)
    for mb in range(MICRO):
        stage.backward_weight(mb)
    stage.end_step()


def _whole_step(stage: Stage) -> None:
    for mb in range(MICRO):
        stage.forward(mb)
        stage.backward_input(mb)
    stage.end_step()


def test_a_parametrized_weight_keeps_its_backward_whole_and_trains_its_own_parameters() -> None:
    """weight_norm's Linear computes ``weight`` from g and v in its forward: W could only
    write a gradient to that computed tensor, so its backward is not split."""
    from torch.nn.utils.parametrizations import weight_norm

    def build() -> list[nn.Module]:
        layers = _layers()
        layers[1][1] = weight_norm(layers[1][1])
        return layers

    layers = build()
    stage = _stage(layers, split=True, w_count={0: 1, 1: 1})
    _split_step(stage)
    reference = build()
    x, y = _batch()
    nn.functional.mse_loss(nn.Sequential(*reference)(x), y).backward()
    original = dict(layers[1][1].named_parameters())
    assert {"parametrizations.weight.original0", "parametrizations.weight.original1"} <= set(original)
    for got, want in zip(layers, reference):
        for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
            assert a.grad is not None, name
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)


def test_a_weight_frozen_after_set_up_gets_no_gradient_from_w_and_its_neighbours_keep_theirs() -> None:
    """A fine-tuning callback may freeze a layer after the stage routed its Linear through
    the weight-gradient store: W then gives that weight nothing, as autograd would."""
    layers = _layers()
    stage = _stage(layers, split=True, w_count={0: 1, 1: 1})
    frozen = layers[1][1].weight
    frozen.requires_grad_(False)
    stage.keep_trainable_deferred()
    _split_step(stage)
    reference = _layers()
    reference[1][1].weight.requires_grad_(False)
    x, y = _batch()
    nn.functional.mse_loss(nn.Sequential(*reference)(x), y).backward()
    assert frozen.grad is None
    for got, want in zip(layers, reference):
        for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)


class _HeadGradientPenalty(_Callbacks):
    """A step that differentiates its loss itself: the squared gradient of the head's
    weight (``torch.autograd.grad(..., create_graph=True)``) added to the loss."""

    def __init__(self, head: nn.Linear) -> None:
        self.head = head

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        loss = nn.functional.mse_loss(forward(batch[0]), batch[1])
        (grad,) = torch.autograd.grad(loss, self.head.weight, create_graph=True)
        return loss + grad.pow(2).sum()


def test_a_step_differentiating_through_a_routed_linear_gets_its_whole_backward_there() -> None:
    """Only the executor's B files weight work for W; the step's own autograd.grad through a
    Linear routed to the store gets that Linear's whole, differentiable backward, so the
    penalty trains as without the split."""
    grads = []
    for split in (False, True):
        layers = _layers()
        stage = Stage(layers, torch.device("cpu"), 0, 0, 1, split=split, w_count={0: 1, 1: 1} if split else None)
        stage.begin_step(_batch(), ROWS, _rows(), _HeadGradientPenalty(layers[2]), 1.0, (1234, 0))
        _split_step(stage) if split else _whole_step(stage)
        grads.append(_grads(layers))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


class _InputGradientPenalty(_Callbacks):
    """A physics-informed step: the gradient of the output with respect to the input x."""

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        x = batch[0].clone().requires_grad_(True)
        out = forward(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return nn.functional.mse_loss(out, batch[1]) + grad.pow(2).mean()


def test_a_last_stage_step_differentiating_by_its_input_is_told_why_it_cannot() -> None:
    """On the last of two stages the output comes from the received activation, so autograd
    finds no path to the step's x; the error says so and how to train such a model."""
    from lightning_dapple.errors import DappleConfigError

    stage = Stage(_layers()[2:], torch.device("cpu"), 1, 0, 2, split=False)
    stage.begin_step(_batch(), ROWS, _rows(), _InputGradientPenalty(), 1.0, (1234, 0))
    stage.receive(0, torch.randn(3, 5, dtype=torch.float64, requires_grad=True))
    with pytest.raises(DappleConfigError, match=r"differentiates the model's output with respect to its input.*Fix: train such a model on a single-stage plan"):
        stage.forward(0)


def test_recomputation_replays_dropout_exactly() -> None:
    """A recomputed micro-batch's B (replayed forward, same seed) gives what a stashed one gives."""
    kept_layers, replayed_layers = _layers(dropout=0.5), _layers(dropout=0.5)
    kept = _stage(kept_layers, split=True)
    replayed = _stage(replayed_layers, split=True)
    for mb in range(MICRO):
        kept.forward(mb)
        x = replayed.forward_keeping_input(mb)
        assert torch.equal(x, _batch()[0][_rows()[mb][0] : _rows()[mb][1]])
    torch.manual_seed(99)  # the replay reseeds: the RNG state in between does not matter
    for mb in range(MICRO):
        kept.backward_input(mb)
        replayed.recompute(mb)
        replayed.backward_input(mb)
    assert torch.equal(torch.stack(kept.end_step()), torch.stack(replayed.end_step()))  # the same dropout masks
    for got, want in zip(_grads(replayed_layers), _grads(kept_layers)):
        assert torch.equal(got, want)
    assert any(float(g.abs().sum()) > 0 for g in _grads(kept_layers))


def test_a_middle_stage_passes_the_input_gradient_upstream() -> None:
    layers = _layers()[1:2]
    stage = _stage(layers, split=True, w_count={0: 1}, index=1, stages=3)
    inputs = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    stage.receive(0, inputs.detach().requires_grad_(True))
    stage.forward(0)
    like = stage.gradient_like(0)
    assert like is not None and len(like) == 1
    out_grad = torch.randn(3, 5, dtype=torch.float64)
    stage.receive_gradient(0, like, [out_grad])
    stage.backward_input(0)
    (grad_in,) = stage.input_gradients(0)
    stage.backward_weight(0)
    stage.end_step()
    reference = _layers()[1]
    reference(inputs).backward(out_grad)
    torch.testing.assert_close(grad_in, inputs.grad, rtol=0, atol=1e-14)
    for got, want in zip(_grads(layers), [p.grad for p in reference.parameters()]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_a_middle_stage_starting_with_an_in_place_activation_gets_a_copy_of_its_input() -> None:
    """nn.ReLU(inplace=True) first on a stage (a cut inside a torchvision-style stack) would
    write the received leaf in place, which autograd refuses: it gets a copy, and the
    gradients are plain autograd's. The received view of a transport buffer is such a leaf."""
    from lightning_dapple.profile.inplace import writes_input_in_place

    torch.manual_seed(4)
    layers = [nn.ReLU(inplace=True), nn.Linear(5, 5).double()]
    assert writes_input_in_place(layers[0]) and writes_input_in_place(nn.Sequential(nn.Sequential(nn.ReLU(inplace=True)), nn.Linear(5, 5)))
    assert not writes_input_in_place(nn.Sequential(nn.Linear(5, 5), nn.ReLU(inplace=True))) and not writes_input_in_place(nn.ReLU())
    stage = _stage(layers, split=False, index=1, stages=3)
    inputs = torch.randn(3, 5, dtype=torch.float64)
    received = torch.zeros(6, 5, dtype=torch.float64)[:3]  # a view, as unpacked from a buffer
    received.copy_(inputs)
    stage.receive(0, received.requires_grad_(True) if received.is_leaf else received.detach().requires_grad_(True))
    stage.forward(0)
    like = stage.gradient_like(0)
    out_grad = torch.randn(3, 5, dtype=torch.float64)
    stage.receive_gradient(0, like, [out_grad])
    stage.backward_input(0)
    (grad_in,) = stage.input_gradients(0)
    stage.end_step()
    reference_input = inputs.clone().requires_grad_(True)
    nn.Sequential(nn.ReLU(), layers[1])(reference_input).backward(out_grad)
    torch.testing.assert_close(grad_in, reference_input.grad, rtol=0, atol=1e-14)


def test_weight_span_covers_layers_that_share_a_parameter() -> None:
    shared = nn.Linear(3, 3)
    layers = [nn.Linear(3, 3), shared, nn.Tanh(), shared, nn.Linear(3, 3)]
    stage = Stage(layers, torch.device("cpu"), 0, 0, 1, split=True)
    assert stage.weight_span((4, 5)) == (4, 5)
    assert stage.weight_span((3, 4)) == (1, 4)  # the shared Linear's W covers both its uses
    assert stage.weight_span((0, 1)) == (0, 1)


def test_transfer_keys_agree_on_both_ends() -> None:
    # stage 1 sends activation 3 to stage 2; stage 2 sends its gradient back
    assert transfer_key(Kind.SEND_ACT, 1, 3) == transfer_key(Kind.RECV_ACT, 2, 3) == TransferKey(Direction.ACTIVATION, 3, 1)
    assert transfer_key(Kind.SEND_GRAD, 2, 3) == transfer_key(Kind.RECV_GRAD, 1, 3) == TransferKey(Direction.GRADIENT, 3, 1)
    # a stage's incoming and outgoing activations of one micro-batch are different transfers
    assert transfer_key(Kind.RECV_ACT, 1, 3) != transfer_key(Kind.SEND_ACT, 1, 3)
    assert transfer_key(Kind.SEND_ACT, 1, 3) != transfer_key(Kind.SEND_GRAD, 2, 3)
    assert str(transfer_key(Kind.RECV_GRAD, 0, 5)) == "gradient 5"
    with pytest.raises(ValueError):
        transfer_key(Kind.F, 0, 0)


def test_stash_ledger_tracks_peak_and_in_flight() -> None:
    ledger = StashLedger()
    ledger.start()
    ledger.forwarded(0, 100)
    ledger.forwarded(1, 50)
    ledger.hold(0, 30)  # e.g. the output gradients a pending W keeps
    assert ledger.peak_stash_bytes == 180 and ledger.peak_in_flight == 2
    ledger.drop(0)
    ledger.forwarded(2, 20)
    assert ledger.peak_stash_bytes == 180 and ledger.held == {1: 50, 2: 20}
    assert ledger.stash_bytes == {0: 100, 1: 50, 2: 20}
    first = ledger.stash_bytes
    ledger.start()
    assert ledger.peak_stash_bytes == 0 and first == {0: 100, 1: 50, 2: 20}  # a finished step keeps its dict


def test_stash_sizes_are_measured_once_per_layout() -> None:
    layer = nn.Linear(4, 4).double()
    sizes = StashSizes(list(layer.parameters()))
    meters: list[Any] = []

    def run(microbatch: int, meter: Any) -> None:
        meters.append(meter)
        if meter is None:
            layer(torch.randn(8, 4, dtype=torch.float64))
            return
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            layer(torch.randn(8, 4, dtype=torch.float64))

    step = sizes.for_step((8, True))
    assert isinstance(step, MeasuringSizes)
    measured = step.forward(run, 0)
    assert measured == 8 * 4 * 8 and meters[-1] is not None  # the input, not the weight
    assert step.kept(1, torch.zeros(8, 2)) == 8 * 2 * 4
    assert isinstance(sizes.for_step((8, True)), MeasuringSizes)  # not finished: not kept
    step.finish()
    again = sizes.for_step((8, True))
    assert isinstance(again, KnownSizes)
    assert again.forward(run, 0) == measured and meters[-1] is None  # no hooks after the first step
    assert again.kept(1, None) == 8 * 2 * 4 and again.replay(run, 0) == 0
    assert isinstance(sizes.for_step((4, True)), MeasuringSizes)  # another batch size measures again
