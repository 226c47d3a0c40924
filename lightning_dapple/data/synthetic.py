"""Generated (seeded, download-free) data sets for the benchmark models, or small real files.

Stand-ins for the data sets of DAPPLE's benchmarks (DAPPLE 6.1: WMT16 En-De, SQuAD 2.0,
ImageNet) that a tiny model can actually learn:

* ``MaskedLMDataModule``: sequences sampled from a seeded random Markov chain over a small
  vocabulary (each word has a few likely successors, so a masked word is predictable from
  its neighbours), a fixed length and a fixed number of ``[MASK]`` positions per sequence;
  or the lines of a text file (``path``).
* ``TranslationDataModule``: the target is the source reversed with every word mapped by a
  fixed seeded permutation; or the tab-separated pairs of a text file (``path``).
* ``ShapesDataModule``: noisy images of stripes (horizontal, vertical, two diagonals),
  discs and squares in random colours; or an image folder with one subfolder per class.

``batch_size`` is the GLOBAL batch of one optimizer step (DAPPLE splits it into micro-batches
and slices itself). Every rank must draw the same batch sequence, so the training loader
shuffles with a ``torch.Generator`` seeded with ``seed`` (re-seeded each time the loader is
built), uses no worker processes and drops the last incomplete batch. Validation and
predict loaders keep the data's order.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.models.common import BOS_ID, EOS_ID, FIRST_WORD_ID, IGNORE_INDEX, MASK_ID, PAD_ID, UNK_ID

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]")
SHAPE_CLASSES = ("horizontal_stripes", "vertical_stripes", "diagonal_stripes", "antidiagonal_stripes", "disc", "square")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


# --------------------------------------------------------------------------- generators


def markov_chain(vocab_size: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """Transition matrix over word ids: each word has ``branching`` successors with random weights.

    Rows and columns below ``FIRST_WORD_ID`` (special tokens) are zero.
    """
    words = vocab_size - FIRST_WORD_ID
    transitions = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for word in range(FIRST_WORD_ID, vocab_size):
        successors = torch.randperm(words, generator=generator)[:branching] + FIRST_WORD_ID
        weights = torch.rand(len(successors), generator=generator, dtype=torch.float64) + 0.2
        transitions[word, successors] = weights / weights.sum()
    return transitions


def markov_sequences(count: int, length: int, transitions: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``count`` sequences of ``length`` words drawn from the chain (uniform first word)."""
    vocab_size = transitions.shape[0]
    out = torch.empty(count, length, dtype=torch.long)
    out[:, 0] = torch.randint(FIRST_WORD_ID, vocab_size, (count,), generator=generator)
    # Sample among each word's few successors only: inverse CDF over the top-k weights.
    branching = int((transitions > 0).sum(dim=1).max())
    weights, successors = transitions.topk(branching, dim=1)
    cumulative = weights.cumsum(dim=1)
    draws = torch.rand(length, count, 1, generator=generator, dtype=torch.float64)
    for position in range(1, length):
        previous = out[:, position - 1]
        choice = (draws[position] >= cumulative[previous]).sum(dim=1).clamp_max(branching - 1)
        out[:, position] = successors[previous, choice]
    return out


def mask_tokens(tokens: torch.Tensor, num_masks: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace ``num_masks`` random non-padding positions per row by ``[MASK]``.

    Returns ``(input_ids, labels)``; ``labels`` holds the original id at masked positions and
    -100 elsewhere. Every row must have more than ``num_masks`` non-padding tokens.
    """
    real = tokens != PAD_ID
    require(bool((real.sum(1) > num_masks).all()), "num_masks", f"{num_masks} leaves a sequence with nothing unmasked", "lower num_masks")
    # Random scores, padding last: the num_masks highest-scoring positions are masked.
    scores = torch.rand(tokens.shape, generator=generator).masked_fill(~real, -1.0)
    positions = scores.topk(num_masks, dim=1).indices
    chosen = torch.zeros_like(real).scatter_(1, positions, True)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return tokens.masked_fill(chosen, MASK_ID), labels


def reversal_pairs(count: int, src_len: int, vocab_size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(src, tgt_in, tgt_out): tgt = mapping[src reversed]; tgt_in = BOS + tgt, tgt_out = tgt + EOS."""
    words = vocab_size - FIRST_WORD_ID
    mapping = torch.arange(vocab_size)
    mapping[FIRST_WORD_ID:] = torch.randperm(words, generator=generator) + FIRST_WORD_ID
    src = torch.randint(FIRST_WORD_ID, vocab_size, (count, src_len), generator=generator)
    target = mapping[src.flip(1)]
    tgt_in = torch.cat([torch.full((count, 1), BOS_ID), target], dim=1)
    tgt_out = torch.cat([target, torch.full((count, 1), EOS_ID)], dim=1)
    return src, tgt_in, tgt_out


def shape_images(count: int, image_size: int, num_classes: int, noise: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (count, 3, S, S) in about [-1, 1] and labels (count,) of ``SHAPE_CLASSES[:num_classes]``.

    Stripes have a random frequency (3-6 periods), phase and +-10 degree jitter of their
    orientation; discs and squares have a random centre and an equal-area size range.
    Foreground and background colours differ by 0.4-0.6 per channel; Gaussian noise on top.
    """
    g = generator
    labels = torch.randint(0, num_classes, (count,), generator=g)
    axis = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    y, x = axis.view(1, -1, 1), axis.view(1, 1, -1)
    angle = torch.tensor([0.0, 90.0, 45.0, 135.0, 0.0, 0.0])[labels] + (torch.rand(count, generator=g) - 0.5) * 20.0
    theta = torch.deg2rad(angle).view(-1, 1, 1)
    frequency = (3.0 + 3.0 * torch.rand(count, generator=g)).view(-1, 1, 1)
    phase = (2 * math.pi * torch.rand(count, generator=g)).view(-1, 1, 1)
    # angle 0 varies along y: horizontal stripes.
    stripes = torch.sin(2 * math.pi * frequency * (y * torch.cos(theta) + x * torch.sin(theta)) + phase) > 0
    centre_y = (0.3 + 0.4 * torch.rand(count, generator=g)).view(-1, 1, 1)
    centre_x = (0.3 + 0.4 * torch.rand(count, generator=g)).view(-1, 1, 1)
    radius = (0.15 + 0.15 * torch.rand(count, generator=g)).view(-1, 1, 1)
    disc = (y - centre_y) ** 2 + (x - centre_x) ** 2 < radius**2
    square = torch.maximum((y - centre_y).abs(), (x - centre_x).abs()) < radius * math.sqrt(math.pi) / 2
    kind = labels.view(-1, 1, 1)
    mask = torch.where(kind < 4, stripes, torch.where(kind == 4, disc, square)).unsqueeze(1).float()
    foreground = torch.rand(count, 3, 1, 1, generator=g)
    background = (foreground + 0.4 + 0.2 * torch.rand(count, 3, 1, 1, generator=g)) % 1.0
    images = background + mask * (foreground - background)
    images = images + noise * torch.randn(images.shape, generator=g)
    return images * 2.0 - 1.0, labels


# --------------------------------------------------------------------------- real files


def read_lines(path: str | Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file (not stripped: tabs at the ends are kept)."""
    file = Path(path)
    require(file.is_file(), "path", f"{str(path)!r} is not a file", "point path at a UTF-8 text file")
    return [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_vocab(sentences: Sequence[Sequence[str]], vocab_size: int) -> dict[str, int]:
    """Special tokens, then the most frequent words (ties by first appearance) up to ``vocab_size``."""
    require(vocab_size > FIRST_WORD_ID, "vocab_size", f"must exceed {FIRST_WORD_ID} special tokens", "raise vocab_size")
    counts = Counter(word for sentence in sentences for word in sentence)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word, _ in counts.most_common(vocab_size - FIRST_WORD_ID):
        vocab[word] = len(vocab)
    return vocab


def encode(words: Sequence[str], vocab: dict[str, int], length: int, prefix: Sequence[int] = (), suffix: Sequence[int] = ()) -> list[int]:
    """Ids of ``prefix + words + suffix``, the words cut so that it fits ``length``, then padded."""
    room = max(length - len(prefix) - len(suffix), 0)
    ids = list(prefix) + [vocab.get(word, UNK_ID) for word in words[:room]] + list(suffix)
    return ids + [PAD_ID] * (length - len(ids))


def split_indices(count: int, val_fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    require(count >= 2, "path", f"holds {count} usable examples", "provide at least 2 (one for validation)")
    order = torch.randperm(count, generator=generator)
    val = min(max(1, round(count * val_fraction)), count - 1)
    return order[val:], order[:val]


def load_image_folder(path: str | Path, image_size: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Images of ``path/<class>/*.png|jpg`` resized to ``image_size`` squares, scaled to [-1, 1]."""
    root = Path(path)
    require(root.is_dir(), "path", f"{str(path)!r} is not a folder", "point path at a folder with one subfolder of images per class")
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    require(bool(classes), "path", f"{str(path)!r} has no class subfolders", "put each class's images in its own subfolder")
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted((root / name).iterdir()):
            if file.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            with Image.open(file) as image:
                pixels = image.convert("RGB").resize((image_size, image_size))
                data = torch.tensor(bytearray(pixels.tobytes()), dtype=torch.uint8)
            images.append(data.view(image_size, image_size, 3).permute(2, 0, 1).float() / 127.5 - 1.0)
            labels.append(label)
    require(len(images) >= 2, "path", f"{str(path)!r} holds {len(images)} images", "provide at least 2 .png/.jpg images")
    return torch.stack(images), torch.tensor(labels), classes


# --------------------------------------------------------------------------- data modules


class _GeneratedDataModule(L.LightningDataModule):
    """Shared loader logic: seeded shuffling of the global batch sequence, no workers."""

    def __init__(self, batch_size: int, num_samples: int, val_samples: int, seed: int, path: str | None, val_fraction: float) -> None:
        super().__init__()
        require(batch_size > 0, "batch_size", f"must be positive, got {batch_size}", "pass the global batch size of one optimizer step")
        require(num_samples >= batch_size or path is not None, "num_samples", f"{num_samples} < batch_size {batch_size}", "raise num_samples")
        require(val_samples > 0, "val_samples", f"must be positive, got {val_samples}", "pass e.g. 256")
        require(0.0 < val_fraction < 1.0, "val_fraction", f"must be in (0, 1), got {val_fraction}", "pass e.g. 0.1")
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.seed = seed
        self.path = path
        self.val_fraction = val_fraction
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _build(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._build()

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup()
        require(len(self.train_set) >= self.batch_size, "batch_size", f"{self.batch_size} exceeds the {len(self.train_set)} training samples", "lower batch_size or add data")
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=0, generator=self.generator(1))

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class MaskedLMDataModule(_GeneratedDataModule):
    """Masked-LM batches ``(input_ids (B, T), labels (B, T))`` for ``BertMLM``.

    Generated: Markov-chain sequences of ``seq_len`` words over ``vocab_size`` ids
    (5 special ids first), each word with ``branching`` possible successors. With ``path``:
    one sequence per non-empty line (whitespace-split words, vocabulary of the file's most
    frequent words, cut/padded to ``seq_len``; lines with at most ``num_masks`` words are
    skipped). Either way ``num_masks`` positions per sequence are replaced by ``[MASK]``
    (always the mask token, no 80/10/10), fixed once per sample by ``seed``.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_samples: int = 4096,
        val_samples: int = 256,
        seed: int = 0,
        vocab_size: int = 64,
        seq_len: int = 16,
        num_masks: int = 2,
        branching: int = 3,
        path: str | None = None,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(batch_size, num_samples, val_samples, seed, path, val_fraction)
        self.save_hyperparameters()
        require(0 < num_masks < seq_len, "num_masks", f"must be in [1, seq_len), got {num_masks}", "mask a few positions per sequence")
        require(vocab_size > FIRST_WORD_ID + 1, "vocab_size", f"must exceed {FIRST_WORD_ID + 1}", "raise vocab_size")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_masks = num_masks
        self.branching = max(1, min(branching, vocab_size - FIRST_WORD_ID))
        self.vocab: dict[str, int] | None = None

    def _build(self) -> tuple[Dataset, Dataset]:
        g = self.generator()
        if self.path is None:
            transitions = markov_chain(self.vocab_size, self.branching, g)
            tokens = markov_sequences(self.num_samples + self.val_samples, self.seq_len, transitions, g)
            train, val = tokens[: self.num_samples], tokens[self.num_samples :]
        else:
            sentences = [line.split() for line in read_lines(self.path)]
            sentences = [words for words in sentences if min(len(words), self.seq_len) > self.num_masks]
            train_index, val_index = split_indices(len(sentences), self.val_fraction, g)
            self.vocab = build_vocab([sentences[i] for i in train_index.tolist()], self.vocab_size)
            tokens = torch.tensor([encode(words, self.vocab, self.seq_len) for words in sentences])
            train, val = tokens[train_index], tokens[val_index]
        return TensorDataset(*mask_tokens(train, self.num_masks, g)), TensorDataset(*mask_tokens(val, self.num_masks, g))


class TranslationDataModule(_GeneratedDataModule):
    """Translation batches ``(src (B, S), tgt_in (B, T), tgt_out (B, T))`` for ``GNMT``.

    Generated: uniform random source words, target = source reversed with each word mapped
    by a fixed permutation (``seed``); ``T = S + 1`` (BOS / EOS). With ``path``: one
    ``source<TAB>target`` pair per line, whitespace-split, a shared vocabulary of the most
    frequent words, sources cut/padded to ``src_len``, targets to ``tgt_len`` (padding id 0
    is ignored by the loss); pairs with an empty side are skipped.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_samples: int = 4096,
        val_samples: int = 256,
        seed: int = 0,
        vocab_size: int = 32,
        src_len: int = 8,
        tgt_len: int | None = None,
        path: str | None = None,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(batch_size, num_samples, val_samples, seed, path, val_fraction)
        self.save_hyperparameters()
        require(vocab_size > FIRST_WORD_ID + 1, "vocab_size", f"must exceed {FIRST_WORD_ID + 1}", "raise vocab_size")
        require(src_len > 0, "src_len", f"must be positive, got {src_len}", "pass e.g. 8")
        self.vocab_size = vocab_size
        self.src_len = src_len
        self.tgt_len = src_len + 1 if tgt_len is None else tgt_len
        require(self.tgt_len >= 2, "tgt_len", f"must be >= 2, got {self.tgt_len}", "leave room for BOS/EOS")
        require(path is not None or self.tgt_len == src_len + 1, "tgt_len", "generated pairs have tgt_len = src_len + 1", "leave tgt_len unset")
        self.vocab: dict[str, int] | None = None

    def _build(self) -> tuple[Dataset, Dataset]:
        g = self.generator()
        if self.path is None:
            tensors = reversal_pairs(self.num_samples + self.val_samples, self.src_len, self.vocab_size, g)
            return TensorDataset(*(t[: self.num_samples] for t in tensors)), TensorDataset(*(t[self.num_samples :] for t in tensors))
        pairs = []
        for number, line in enumerate(read_lines(self.path), start=1):
            parts = line.split("\t")
            require(len(parts) == 2, "path", f"line {number} has {len(parts) - 1} tabs", "write one 'source<TAB>target' pair per line")
            source, target = parts[0].split(), parts[1].split()
            if source and target:  # an empty side would leave nothing to attend to or predict
                pairs.append((source, target))
        train_index, val_index = split_indices(len(pairs), self.val_fraction, g)
        self.vocab = build_vocab([side for i in train_index.tolist() for side in pairs[i]], self.vocab_size)
        src = torch.tensor([encode(s, self.vocab, self.src_len) for s, _ in pairs])
        # The target is cut to tgt_len - 1 words so that both BOS + words and words + EOS fit.
        tgt_in = torch.tensor([encode(t[: self.tgt_len - 1], self.vocab, self.tgt_len, prefix=(BOS_ID,)) for _, t in pairs])
        tgt_out = torch.tensor([encode(t[: self.tgt_len - 1], self.vocab, self.tgt_len, suffix=(EOS_ID,)) for _, t in pairs])
        return TensorDataset(src[train_index], tgt_in[train_index], tgt_out[train_index]), TensorDataset(
            src[val_index], tgt_in[val_index], tgt_out[val_index]
        )


class ShapesDataModule(_GeneratedDataModule):
    """Image batches ``(images (B, 3, S, S), labels (B,))`` for ``VGG19``.

    Generated: ``num_classes`` (up to 6) of ``SHAPE_CLASSES`` with Gaussian noise ``noise``.
    With ``path``: a folder with one subfolder of .png/.jpg images per class (sorted names
    give the labels), resized to ``image_size``; ``num_classes`` is set from the folder.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_samples: int = 2048,
        val_samples: int = 256,
        seed: int = 0,
        num_classes: int = 4,
        image_size: int = 32,
        noise: float = 0.1,
        path: str | None = None,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__(batch_size, num_samples, val_samples, seed, path, val_fraction)
        self.save_hyperparameters()
        require(1 < num_classes <= len(SHAPE_CLASSES) or path is not None, "num_classes", f"must be in [2, {len(SHAPE_CLASSES)}], got {num_classes}", "pick fewer classes")
        require(image_size >= 8, "image_size", f"must be >= 8, got {image_size}", "pass e.g. 32")
        self.num_classes = num_classes
        self.image_size = image_size
        self.noise = noise
        self.class_names: list[str] = list(SHAPE_CLASSES[:num_classes])

    def _build(self) -> tuple[Dataset, Dataset]:
        g = self.generator()
        if self.path is None:
            images, labels = shape_images(self.num_samples + self.val_samples, self.image_size, self.num_classes, self.noise, g)
            train, val = slice(0, self.num_samples), slice(self.num_samples, None)
            return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])
        images, labels, self.class_names = load_image_folder(self.path, self.image_size)
        self.num_classes = len(self.class_names)
        train_index, val_index = split_indices(len(labels), self.val_fraction, g)
        return TensorDataset(images[train_index], labels[train_index]), TensorDataset(images[val_index], labels[val_index])
