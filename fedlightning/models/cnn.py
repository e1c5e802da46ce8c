"""Convolutional reference models of the papers: LeNet-5 (seed 001), the FEMNIST CNN (LEAF / Reddi et al.) and the
CIFAR-100 CNN of seed 004.

All take image batches ``(N, C, H, W)`` (a flat ``(N, C·H·W)`` batch is reshaped to the declared image shape, so the
LEAF JSON / Flower FEMNIST rows of 784 values work unchanged) and return class logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedlightning._validation import one_of
from fedlightning.models.base import Classifier

__all__ = ["LeNet5", "FemnistCNN", "Cifar100CNN"]


class _ImageClassifier(Classifier):
    """A Classifier whose forward first brings flat inputs to ``image_shape`` (C, H, W)."""

    def __init__(self, image_shape: Sequence[int], num_classes: int, lr: float):
        super().__init__(num_classes=num_classes, lr=lr)
        shape = tuple(int(s) for s in image_shape)
        if len(shape) != 3 or any(s < 1 for s in shape):
            raise ValueError(f"image_shape must be (channels, height, width) with positive sizes, got {image_shape}")
        self.image_shape: tuple[int, int, int] = shape  # type: ignore[assignment]

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.reshape(x.shape[0], *self.image_shape)
        elif x.dim() == 3:  # (N, H, W) greyscale
            x = x.unsqueeze(1)
        return self.net(x.float())


def _flat_size(features: nn.Module, image_shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *image_shape)).numel())


class LeNet5(_ImageClassifier):
    r"""LeNet-5 (LeCun et al. 1998) for 28×28 greyscale digits, the non-convex MNIST model of seed 001 (FedSPS).

    conv 5×5 (6, padding 2) → ReLU → max-pool 2 → conv 5×5 (16) → ReLU → max-pool 2 → FC 120 → ReLU → FC 84 → ReLU →
    FC ``num_classes``. Seed 001 names the architecture only ("LeNet"); the padding-2 first convolution (so a 28×28
    MNIST image gives the original 32×32 geometry), ReLU and max-pooling instead of the 1998 sigmoid/sub-sampling
    layers are ours (the usual modern form). 61,706 parameters for 10 classes.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28, lr: float = 0.1):
        super().__init__((in_channels, image_size, image_size), num_classes, lr)
        features = nn.Sequential(
            nn.Conv2d(int(in_channels), 6, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        flat = _flat_size(features, self.image_shape)
        self.net = nn.Sequential(
            features,
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, self.num_classes),
        )


class FemnistCNN(_ImageClassifier):
    r"""The FEMNIST character CNN, in the two forms the papers use.

    * ``variant="reddi"`` (default): Reddi et al. 2021 ("Adaptive Federated Optimization", EMNIST CNN), the FedML
      ``CNN_DropOut`` that seed 002 (FedLi) runs: conv 3×3 (32) → ReLU → conv 3×3 (64) → ReLU → max-pool 2 →
      dropout 0.25 → FC 128 → ReLU → dropout 0.5 → FC 62. 1,206,590 parameters.
    * ``variant="leaf"``: the LEAF reference CNN (Caldas et al. 2018): conv 5×5 (32, same) → ReLU → max-pool 2 →
      conv 5×5 (64, same) → ReLU → max-pool 2 → FC 2048 → ReLU → FC 62. 6,603,710 parameters.

    Inputs: 28×28 greyscale images (LEAF stores them as 784 values in [0, 1]; flat rows are reshaped). ``lr``
    (standalone training only) defaults to 0.1, as :class:`~fedlightning.models.Classifier` (ours).
    """

    def __init__(self, num_classes: int = 62, variant: str = "reddi", lr: float = 0.1):
        super().__init__((1, 28, 28), num_classes, lr)
        one_of("variant", variant, ("reddi", "leaf"))
        self.variant = variant
        if variant == "reddi":
            features = nn.Sequential(
                nn.Conv2d(1, 32, kernel_size=3),
                nn.ReLU(),
                nn.Conv2d(32, 64, kernel_size=3),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Dropout(0.25),
                nn.Flatten(),
            )
            hidden, dropout = 128, 0.5
        else:
            features = nn.Sequential(
                nn.Conv2d(1, 32, kernel_size=5, padding=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, kernel_size=5, padding=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
            )
            hidden, dropout = 2048, 0.0
        flat = _flat_size(features, self.image_shape)
        head = [nn.Linear(flat, hidden), nn.ReLU()]
        if dropout > 0:
            head.append(nn.Dropout(dropout))
        head.append(nn.Linear(hidden, self.num_classes))
        self.net = nn.Sequential(features, *head)


class Cifar100CNN(_ImageClassifier):
    r"""The CIFAR-100 CNN of seed 004 (Mills et al., Table I): two blocks of [3×3 conv → ReLU → 2×2 max-pool], FC 512 →
    ReLU, FC 100.

    ``lr`` (standalone training only) defaults to seed 004's η₀ = 0.01. The paper gives neither channel counts nor
    padding, only the model size (40.0 Mb ≈ 1.25 M float32 parameters).
    Decision (from the model size of Mills et al., Table I): 32 and 64 channels with *unpadded* convolutions on
    32×32 inputs, so the flattened features are 6·6·64 = 2,304 and the model has exactly 1,250,852 parameters
    (40.03 Mb).
    The paper's 28×28 random crop does not fit the stated size with any padding, so the data modules feed 32×32 images
    (pad-4 random crop + flip augmentation).
    """

    def __init__(self, num_classes: int = 100, image_size: int = 32, lr: float = 0.01):
        super().__init__((3, image_size, image_size), num_classes, lr)
        features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        flat = _flat_size(features, self.image_shape)
        self.net = nn.Sequential(features, nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, self.num_classes))
