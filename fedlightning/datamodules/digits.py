"""Handwritten digits bundled with scikit-learn (1,797 8x8 images, 10 classes): real data that needs no download."""

from __future__ import annotations

import numpy as np
import torch

from fedlightning._validation import in_range
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule
from fedlightning.datamodules.partition import Dirichlet, Partitioner

__all__ = ["DigitsDataModule"]


class DigitsDataModule(FederatedDataModule):
    """scikit-learn's ``load_digits`` as a federated data set (the project's embedded default).

    Inputs are the 64 pixel values scaled from [0, 16] to [0, 1] (float32, flattened); targets are int64 labels.
    A stratified ``test_fraction`` of the images (seeded by ``seed``) is held out as the global test set; the
    rest is the training set: a stratified ``val_fraction`` (default 0.1) of it is the validation split and the
    remainder is split over ``num_clients`` clients by ``partition`` (default ``Dirichlet(alpha=0.3)``, the label
    skew of seed 000's CIFAR experiments). See :class:`FederatedDataModule` for the validation rules.
    """

    def __init__(
        self,
        num_clients: int = 100,
        batch_size: int = 50,
        partition: Partitioner | None = None,
        seed: int = 0,
        test_fraction: float = 0.2,
        eval_batch_size: int = 1024,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            partition=partition if partition is not None else Dirichlet(alpha=0.3),
            seed=seed,
            eval_batch_size=eval_batch_size,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.test_fraction = in_range("test_fraction", test_fraction, 0.0, 1.0, low_closed=False)
        self.num_classes = 10  # the ten digits

    def load(self):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        data = load_digits()
        x = data.data.astype(np.float32) / 16.0
        y = data.target.astype(np.int64)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=self.test_fraction, random_state=self.seed, stratify=y)
        train = ArrayDataset(torch.from_numpy(xtr), torch.from_numpy(ytr))
        test = ArrayDataset(torch.from_numpy(xte), torch.from_numpy(yte))
        return train, test, ytr
