"""What a pending W holds under autocast, and that W still gives autograd's gradients.

ooo-backprop sec. 3: B of a split backward files, per deferrable module, what the
weight gradient needs (``execute/weight_grad.py``): the module's input as the GEMM or
convolution saw it (cast to the autocast dtype) and its output gradient. The weight's
values never enter its own gradient, so the cast copy of the weight that autocast made in
the forward must be freed with the graph in B, for convolutions as for linear layers;
otherwise every pending micro-batch keeps one copy of every convolution weight.

Measured on one process without a process group (a ``Stage`` runs alone): every storage
an operator creates during a micro-batch's F and B is tracked by a weak reference; after
both micro-batches' B (their W pending) the storages still alive must be exactly the
filed (input, output gradient) pairs, byte for byte, and no weight-shaped tensor. The
same runs on a GPU where there is one (cuDNN's convolution backward); W's gradients are
compared with one backward's there within the rounding of the dtype (another algorithm
may be picked for the stand-in), on the CPU bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_dapple.execute.stage import Stage
from lightning_dapple.execute.weight_grad import deferrable_modules

ROWS = 12
ROWS_PER_MICRO_BATCH = ((0, 6), (6, 12))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


class ConvBlock(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


class Head(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def conv_layers(dims: int) -> nn.Sequential:
    """Two convolutions (with and without bias, stride 1 and 2) and a linear head."""
    torch.manual_seed(11)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    side = {1: 16, 2: 6, 3: 4}[dims]
    out_side = (side + 1) // 2
    return nn.Sequential(
        ConvBlock(conv(4, 8, 3, padding=1)),
        ConvBlock(conv(8, 8, 3, stride=2, padding=1, bias=False, groups=2)),
        Head(8 * out_side**dims),
    )


def conv_batch(dims: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    side = {1: 16, 2: 6, 3: 4}[dims]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(ROWS, 4, *([side] * dims), generator=g), torch.randn(ROWS, 3, generator=g)
    return x.to(device, dtype), y.to(device, dtype)


class _Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return F.mse_loss(forward(batch[0]).float(), batch[1].float())


class _Created(TorchDispatchMode):
    """Weak references to the storage of every tensor an operator returns, with its bytes
    and the shape of the first tensor seen on it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, tuple[int, ...]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes(), tuple(leaf.shape)))
        return out

    def alive(self, exclude: set[int]) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Storages still alive (not in ``exclude``): their bytes and shapes."""
        return {key: (nbytes, shape) for key, (ref, nbytes, shape) in self.storages.items() if not ref.expired() and key not in exclude}


def _stage(layers: nn.Sequential, split: bool, autocast: torch.dtype | None, device: str) -> Stage:
    context: Callable[[], Any] | None = None
    if autocast is not None:
        context = lambda: torch.autocast(device, dtype=autocast)  # noqa: E731
    return Stage(list(layers), torch.device(device), 0, 0, 1, split=split, w_count={0: 1, 1: 1}, forward_context=context)


def _filed_bytes(layers: nn.Sequential, batch: Any, autocast: torch.dtype | None, device: str) -> int:
    """What W needs for one micro-batch: per deferrable module, its input and its output
    gradient (the output's shape) in the dtype the operation ran in."""
    sizes: list[int] = []

    def record(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        itemsize = torch.empty((), dtype=autocast or output.dtype).element_size()
        sizes.append((inputs[0].numel() + output.numel()) * itemsize)

    modules = [m for layer in layers for m in deferrable_modules(layer)]
    hooks = [m.register_forward_hook(record) for m in modules]
    try:
        with torch.no_grad(), torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            layers(batch[0][: ROWS_PER_MICRO_BATCH[0][1]])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(sizes) == 3
    return sum(sizes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_pending_w_holds_its_input_and_output_gradient_only(dims: int, device: str) -> None:
    layers = conv_layers(dims).to(device)
    batch = conv_batch(dims, torch.float32, device)
    filed = _filed_bytes(layers, batch, torch.bfloat16, device)
    stage = _stage(layers, split=True, autocast=torch.bfloat16, device=device)
    stage.begin_step(batch, ROWS, ROWS_PER_MICRO_BATCH, _Callbacks(), 1.0, (0, 0))
    created = [_Created(), _Created()]
    for mb in (0, 1):
        with created[mb]:
            stage.forward(mb)
    for mb in (0, 1):
        with created[mb]:
            stage.backward_input(mb)
    # not the step's: the batch (whose slices the operators return) and the recorded losses
    losses = {tensor.untyped_storage()._cdata for tensor in (*batch, *stage._losses)}
    weights = {tuple(p.shape) for p in layers.parameters() if p.dim() > 1}
    for mb in (0, 1):
        alive = created[mb].alive(losses)
        assert sum(nbytes for nbytes, _ in alive.values()) == filed, (mb, sorted(alive.values()), filed)
        assert not any(shape in weights for _, shape in alive.values()), (mb, sorted(alive.values()))
    assert all(p.grad is None for p in layers.parameters()), "weight gradients wait for W"
    for mb in (0, 1):
        stage.backward_weight(mb)
    stage.end_step()
    assert all(created[mb].alive(losses) == {} for mb in (0, 1)), "W freed what it held"
    assert all(p.grad is not None for p in layers.parameters())


def _step_grads(dims: int, split: bool, dtype: torch.dtype, autocast: torch.dtype | None, device: str) -> list[torch.Tensor]:
    layers = conv_layers(dims).to(device, dtype)
    stage = _stage(layers, split=split, autocast=autocast, device=device)
    stage.begin_step(conv_batch(dims, dtype, device), ROWS, ROWS_PER_MICRO_BATCH, _Callbacks(), 1.0, (0, 0))
    for mb in (0, 1):
        stage.forward(mb)
    for mb in (0, 1):
        stage.backward_input(mb)
    if split:
        assert all(p.grad is None for p in layers.parameters())
        for mb in (0, 1):
            stage.backward_weight(mb)
    stage.end_step()
    return [p.grad.clone() for p in layers.parameters()]


# on a GPU: the largest difference allowed, relative to the largest gradient (TF32 off)
GPU_TOLERANCE = {"bf16-autocast": 2e-2, "float32": 1e-5, "float64": 1e-12}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(
    "dtype,autocast", [(torch.float32, torch.bfloat16), (torch.float32, None), (torch.float64, None)], ids=list(GPU_TOLERANCE)
)
def test_w_gives_the_gradients_of_one_backward(dims: int, dtype: torch.dtype, autocast: torch.dtype | None, device: str) -> None:
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        whole = _step_grads(dims, split=False, dtype=dtype, autocast=autocast, device=device)
        split = _step_grads(dims, split=True, dtype=dtype, autocast=autocast, device=device)
    assert len(whole) == len(split) == 5
    name = "bf16-autocast" if autocast is not None else str(dtype).removeprefix("torch.")
    for a, b in zip(whole, split):
        assert a.dtype == b.dtype == dtype
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            assert float((a - b).abs().max()) <= GPU_TOLERANCE[name] * float(a.abs().max()), name
