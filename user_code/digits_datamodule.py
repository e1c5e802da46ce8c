"""A ``LightningDataModule`` as a user writes it for plain Lightning, with no federated code: scikit-learn's bundled
digits (no download) as dict samples, a ``collate_fn`` that builds ``(x, y)`` batches, and its own train /
validation / test split. ``configs/examples/own_datamodule.yaml`` federates it unchanged with
:class:`fedlightning.datamodules.WrappedDataModule`:

    python train.py fit --config configs/examples/own_datamodule.yaml
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class DigitsDicts(Dataset):
    """Rows ``rows`` of the digits as ``{"pixels": float32 [64] in [0, 1], "digit": int}`` samples."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, rows: np.ndarray):
        self.images, self.labels, self.rows = images, labels, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        r = int(self.rows[i])
        return {"pixels": torch.from_numpy(self.images[r]), "digit": int(self.labels[r])}


def to_pairs(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a classifier's ``training_step`` reads: ``(x [n, 64], y [n])``."""
    x = torch.stack([s["pixels"] for s in samples])
    y = torch.tensor([s["digit"] for s in samples], dtype=torch.long)
    return x, y


class DigitsLightningDataModule(pl.LightningDataModule):
    """The 1,797 digits shuffled with ``seed``: ``test_size`` samples test, ``val_size`` validate, the rest train."""

    def __init__(self, batch_size: int = 50, val_size: int = 180, test_size: int = 360, seed: int = 0):
        super().__init__()
        self.batch_size, self.val_size, self.test_size, self.seed = batch_size, val_size, test_size, seed

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.data / 16.0).astype(np.float32)
        order = np.random.default_rng(self.seed).permutation(len(images))
        test, val, train = np.split(order, [self.test_size, self.test_size + self.val_size])
        self.train = DigitsDicts(images, digits.target, train)
        self.val = DigitsDicts(images, digits.target, val)
        self.test = DigitsDicts(images, digits.target, test)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=to_pairs)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=256, collate_fn=to_pairs)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=256, collate_fn=to_pairs)
