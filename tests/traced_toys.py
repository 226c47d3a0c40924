"""Models as people write them, for the traced layer list and handle tests: no layer
sequence, glue in ``forward``; and a layer sequence with handles beside it."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, WIDTH, CONTEXT = 13, 8, 6
LR = 1e-2


class CausalBlock(nn.Module):
    """A pre-norm transformer block whose forward branches on its input's values: it must
    stay one leaf (fx cannot trace the branch)."""

    def __init__(self, width: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        # no projection biases: the key bias has no gradient at all, and Adam turns its
        # rounding noise into steps of the learning rate
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + attended
        if torch.isfinite(x).all():  # data-dependent control flow
            x = x + self.mlp(self.ln2(x))
        return x


class NanoGPT(LightningModule):
    """minGPT/nanoGPT-shaped: token embedding plus a position parameter in forward, a loop
    over an nn.ModuleList of blocks, a final LayerNorm and a head; no layer sequence."""

    def __init__(self, blocks: int = 3, seed: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Parameter(0.1 * torch.randn(1, CONTEXT, WIDTH))
        self.blocks = nn.ModuleList([CausalBlock() for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, t = idx.size()
        assert t <= CONTEXT, f"sequence of {t} tokens is longer than the context {CONTEXT}"
        x = self.tok_emb(idx) + self.pos_emb[:, :t, :]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


class MaskedBlock(nn.Module):
    def __init__(self, width: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return x + attended


class SkipMasked(LightningModule):
    """A causal mask built once in forward and passed to every block (the same for every
    sample: recomputed per layer, never sent), the embedding added back before the head
    (alive across every cut: it travels in a tuple with the blocks' state), and an output
    gain computed from a parameter at the top of forward but used at the end."""

    def __init__(self, seed: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MaskedBlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.out_gain = nn.Parameter(torch.full((VOCAB,), 2.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        gain = self.out_gain.tanh()  # the same for every sample: computed where it is used
        first = self.emb(idx)
        h = first
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h + first) * gain

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


class TiedHead(SkipMasked):
    """The head shares the embedding's weight (tied weights): one parameter, two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight


class ScaledGPT(NanoGPT):
    """NanoGPT whose forward also reads a non-persistent buffer (in no checkpoint)."""

    def __init__(self, seed: int = 1234) -> None:
        super().__init__(seed=seed)
        self.register_buffer("emb_scale", torch.tensor(0.5), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) * self.emb_scale + self.pos_emb[:, : idx.shape[1], :]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.norm(self.conv1(x)))))


class SmallResNet(LightningModule):
    """ResNet-shaped: a stem, residual stages in an nn.Sequential, pooling and
    ``torch.flatten`` in forward, a classifier."""

    def __init__(self, seed: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stages = nn.Sequential(Residual(4), Residual(4), Residual(4))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = self.stages(x)
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


class ModeDependent(SmallResNet):
    """Reads ``self.training`` in forward (dropout written as a function)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(F.relu(self.stem(x)), 0.1, training=self.training)
        return self.fc(torch.flatten(self.pool(self.stages(x)), 1))


class Untraceable(LightningModule):
    """Its forward branches on a value computed from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if x.mean() > 0:  # the line the error must name
            x = -x
        return self.second(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Handles(LightningModule):
    """A layer sequence with a second path to its last layer (``self.head``), to a
    sub-module of a middle layer (``self.middle_linear``) and to a parameter
    (``self.head_bias``), as models keep them for convenience."""

    def __init__(self, seed: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(6, 10), nn.Tanh()),
            nn.Sequential(nn.Linear(10, 10), nn.Tanh()),
            nn.Sequential(nn.Linear(10, 8), nn.Tanh()),
            nn.Linear(8, 3),
        )
        self.head = self.layers[-1]
        self.middle_linear = self.layers[1][0]
        self.head_bias = self.layers[-1].bias  # a parameter registered a second time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


def token_loader(steps: int = 3, rows: int = 8, length: int = CONTEXT) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (steps * rows, length), generator=g)
    targets = torch.randint(0, VOCAB, (steps * rows, length), generator=g)
    return DataLoader(TensorDataset(idx, targets), batch_size=rows, shuffle=False)


def image_loader(steps: int = 3, rows: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(8)
    images = torch.randn(steps * rows, 3, 6, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (steps * rows,), generator=g)
    return DataLoader(TensorDataset(images, labels), batch_size=rows, shuffle=False)


def vector_loader(steps: int = 3, rows: int = 8, dtype: torch.dtype = torch.float64) -> DataLoader:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(steps * rows, 6, generator=g, dtype=dtype)
    y = torch.randn(steps * rows, 3, generator=g, dtype=dtype)
    return DataLoader(TensorDataset(x, y), batch_size=rows, shuffle=False)


def plain_run(module: LightningModule, loader: DataLoader, steps: int = 3) -> dict[str, torch.Tensor]:
    """One process, float64, the module's own optimizer and step: the reference."""
    model = copy.deepcopy(module).double()
    optimizer = model.configure_optimizers()
    for batch_idx, batch in zip(range(steps), loader):
        batch = [t.double() if t.is_floating_point() else t for t in batch]
        optimizer.zero_grad()
        with warnings.catch_warnings():  # self.log without a Trainer
            warnings.simplefilter("ignore")
            loss = model.training_step(batch, batch_idx)
        loss.backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def relative_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over tensors of |a - b| / |b| (Frobenius norms)."""
    assert set(state) == set(reference), set(state) ^ set(reference)
    return max(float((state[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-300)) for k in reference)


def nanogpt_with_example() -> NanoGPT:
    """For the command lines: the module with its ``example_input_array`` (one micro-batch)."""
    model = NanoGPT()
    model.example_input_array = torch.zeros(4, CONTEXT, dtype=torch.long)
    return model


def untraceable_with_example() -> Untraceable:
    model = Untraceable()
    model.example_input_array = torch.zeros(4, 6)
    return model
