"""VGG-19 (Simonyan & Zisserman 2015, configuration E, no batch norm) as 19 pipeline layers.

VGG-19 is one of DAPPLE's benchmark models (DAPPLE Table 1: 137M parameters, profiled at
batch 32). DAPPLE's analysis (arXiv version, sec. VI-C) hinges on its shape: activations shrink
from the first convolution to the classifier while ~70% of the weights sit in the fully
connected layers, so a cut between the convolutions and the classifier sends little
(its Table 4 plans a 15:1 replication with a 13:6 split of the layers). Layers::

    0 .. 15    ConvLayer   3x3 conv + ReLU; the conv that ends a block also max-pools (2x2)
    16         FCLayer     flatten + Linear + ReLU + dropout
    17         FCLayer     Linear + ReLU + dropout
    18         Linear      classifier logits

Each pipeline layer is one of VGG-19's 19 weight layers, with the pooling folded into the
last conv of each of the 5 blocks. With 1000 classes at 224x224 the model has 143,667,240
parameters (the 137M of DAPPLE Table 1 is that figure in MiB-style millions, 137.0 x 2^20).
No batch norm: batch statistics would differ per micro-batch slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.models.common import ClassifierSteps, SequentialLightningModule, check_dropout, check_positive

# VGG configuration E: channels per conv; "M" ends a block with 2x2 max-pooling.
VGG19_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


class ConvLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))
        return F.max_pool2d(x, 2) if self.pool else x


class FCLayer(nn.Module):
    def __init__(self, in_features: int, out_features: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(F.relu(self.linear(x.flatten(1))))


class VGG19(ClassifierSteps, SequentialLightningModule):
    """VGG-19 image classifier; the default is the ImageNet model of DAPPLE Table 1.

    Batches are ``(images (B, 3, S, S), labels (B,))``; loss is the mean cross-entropy
    over samples; metric top-1 accuracy. ``width_multiplier`` scales every conv's
    channels. Optimiser: SGD with momentum (as DAPPLE trains VGG-19), or Adam
    (``optimizer="adam"``), which trains the tiny variant far more reliably without batch
    norm: ``VGG19(num_classes=4, width_multiplier=1/16, image_size=32, fc_hidden=64,
    dropout=0, optimizer="adam", lr=1e-3, weight_decay=0)``.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        width_multiplier: float = 1.0,
        image_size: int = 224,
        fc_hidden: int = 4096,
        dropout: float = 0.5,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        optimizer: str = "sgd",
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_positive(num_classes=num_classes, width_multiplier=width_multiplier, image_size=image_size, fc_hidden=fc_hidden, lr=lr)
        check_dropout(dropout)
        require(optimizer in ("sgd", "adam"), "optimizer", f"must be 'sgd' or 'adam', got {optimizer!r}", "pick one of them")
        require(image_size % 32 == 0, "image_size", f"{image_size} is not a multiple of 32", "VGG halves the image 5 times; use e.g. 32 or 224")
        layers: list[nn.Module] = []
        channels = in_channels
        for index, item in enumerate(VGG19_CONFIG):
            if item == "M":
                continue
            width = max(1, round(int(item) * width_multiplier))
            layers.append(ConvLayer(channels, width, pool=VGG19_CONFIG[index + 1] == "M"))
            channels = width
        side = image_size // 32
        layers += [
            FCLayer(channels * side * side, fc_hidden, dropout),
            FCLayer(fc_hidden, fc_hidden, dropout),
            nn.Linear(fc_hidden, num_classes),
        ]
        self.layers = nn.Sequential(*layers)
        # He initialisation (fan-in) keeps the activation scale through the 18 ReLU layers
        # without batch norm at any width; the classifier starts small.
        for module in self.layers.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.layers[-1].weight, std=0.01)
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.example_input_array = torch.zeros(2, in_channels, image_size, image_size)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    @override
    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum, weight_decay=self.hparams.weight_decay
        )
