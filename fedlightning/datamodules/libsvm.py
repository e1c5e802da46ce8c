"""LIBSVM binary classification data sets of seed 001's convex experiments (w8a, a9a, mushrooms, ijcnn1, phishing).

Files: the LIBSVM-site files in ``data_dir`` (``w8a`` + ``w8a.t``, ``a9a`` + ``a9a.t``, ``mushrooms``, ``ijcnn1``
(+ ``ijcnn1.t``), ``phishing``; each may be ``.bz2`` / ``.gz`` compressed), read with scikit-learn's
``load_svmlight_file`` with the data set's feature count fixed (so train and test agree). Nothing is downloaded.

Labels map to {0, 1} by each data set's label pair (w8a, a9a, ijcnn1: −1/+1; mushrooms: 1/2; phishing: 0/1); any
other value is an error naming the file. Features are used as published (dense float32; the LIBSVM versions are
already scaled). Data sets without a test file (mushrooms, phishing; ijcnn1 when ``ijcnn1.t`` is absent) hold out a
seeded, stratified ``test_fraction`` of the samples (ours; seed 001 reports training loss and does not say).

Seed 001 setup: logistic regression (``LogisticRegression(input_dim=..., num_classes=2)``, which is binary logistic
regression with two logits), i.i.d. split over 100 clients, 10 sampled per round, batch 20, 5 local steps.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from fedlightning._validation import in_range
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule
from fedlightning.datamodules.partition import IID, Partitioner

__all__ = ["LibsvmDataModule", "LIBSVM_DATASETS"]

#: name -> (number of features, label pair mapped to (0, 1), train file, test file or None)
LIBSVM_DATASETS: dict[str, tuple[int, tuple[int, int], str, str | None]] = {
    "w8a": (300, (-1, 1), "w8a", "w8a.t"),
    "a9a": (123, (-1, 1), "a9a", "a9a.t"),
    "mushrooms": (112, (1, 2), "mushrooms", None),
    "ijcnn1": (22, (-1, 1), "ijcnn1", "ijcnn1.t"),
    "phishing": (68, (0, 1), "phishing", None),
}


def _zero_index_line(path: str) -> int | None:
    """The number (from 1) of the first line of the LIBSVM file ``path`` (plain, ``.bz2`` or ``.gz``) holding a
    feature index 0, or None."""
    import bz2
    import gzip

    opener = bz2.open if path.endswith(".bz2") else gzip.open if path.endswith(".gz") else open
    pattern = re.compile(r"(^|\s)0+:")
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            if pattern.search(line.split("#", 1)[0]):
                return number
    return None


def _locate(data_dir: str, name: str) -> str | None:
    for suffix in ("", ".bz2", ".gz"):
        p = os.path.join(data_dir, name + suffix)
        if os.path.isfile(p):
            return p
    return None


class LibsvmDataModule(FederatedDataModule):
    """A LIBSVM binary data set over ``num_clients`` clients (default i.i.d. over 100, seed 001).

    Args:
        name: one of ``w8a``, ``a9a``, ``mushrooms``, ``ijcnn1``, ``phishing``.
        data_dir: folder with the LIBSVM files.
        test_fraction: held-out fraction when the data set has no test file (ours: 0.2).
        num_clients, batch_size, partition, seed, ...: as :class:`FederatedDataModule`; defaults 100 clients, batch
            20, IID (seed 001); ``eval_batch_size`` 4096 (ours: the inputs are small).
        val_fraction: stratified validation split held out of the training samples (after any ``test_fraction``
            hold-out) before the clients are formed (default 0.1, ours; :class:`FederatedDataModule`).
    """

    def __init__(
        self,
        name: str = "w8a",
        data_dir: str = "data/libsvm",
        test_fraction: float = 0.2,
        num_clients: int = 100,
        batch_size: int = 20,
        partition: Partitioner | None = None,
        seed: int = 0,
        eval_batch_size: int = 4096,
        num_workers: int = 0,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            partition=partition if partition is not None else IID(),
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        if name not in LIBSVM_DATASETS:
            raise ValueError(f"unknown LIBSVM data set {name!r}; choose one of {sorted(LIBSVM_DATASETS)}")
        self.name = name
        self.data_dir = data_dir
        self.test_fraction = in_range("test_fraction", test_fraction, 0.0, 1.0, low_closed=False)
        self.num_features, self.label_pair, self.train_file, self.test_file = LIBSVM_DATASETS[name]
        self.num_classes = 2  # the label pair, mapped to 0 and 1

    def _read(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        from sklearn.datasets import load_svmlight_file

        try:
            # LIBSVM counts features from 1; scikit-learn's default (zero_based="auto") would read a file with one
            # stray "0:" index as 0-based, every feature of every sample one column off, without an error
            x, y = load_svmlight_file(path, n_features=self.num_features, zero_based=False)
        except ValueError as e:
            where = _zero_index_line(path) if "Invalid index 0" in str(e) else None
            if where is not None:
                raise ValueError(
                    f"{path}: line {where} has the feature index 0, but LIBSVM files count features from 1 "
                    f"(1..{self.num_features} for {self.name})"
                ) from None
            raise ValueError(
                f"{path} is not a valid svmlight file for {self.name} ({self.num_features} features): {e}"
            ) from None
        except (EOFError, OSError) as e:  # a truncated or damaged .gz / .bz2 (gzip.BadGzipFile is an OSError)
            raise ValueError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
        neg, pos = self.label_pair
        bad = np.flatnonzero((y != neg) & (y != pos))
        if len(bad):
            raise ValueError(
                f"{path}: label {y[bad[0]]:g} is outside {self.name}'s label pair ({neg}, {pos}) (row {int(bad[0])})"
            )
        return np.asarray(x.todense(), dtype=np.float32), (y == pos).astype(np.int64)

    def load(self):
        if not os.path.isdir(self.data_dir):
            raise FileNotFoundError(
                f"LIBSVM data_dir {self.data_dir!r} does not exist; download {self.train_file} from "
                f"https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary.html into it"
            )
        train_path = _locate(self.data_dir, self.train_file)
        if train_path is None:
            raise FileNotFoundError(
                f"{self.name}: file {self.train_file}[.bz2|.gz] not found in {self.data_dir!r} (LIBSVM binary data "
                f"sets: https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary.html)"
            )
        xtr, ytr = self._read(train_path)
        test_path = _locate(self.data_dir, self.test_file) if self.test_file else None
        if test_path is not None:
            xte, yte = self._read(test_path)
        else:
            from sklearn.model_selection import train_test_split

            xtr, xte, ytr, yte = train_test_split(
                xtr, ytr, test_size=self.test_fraction, random_state=self.seed, stratify=ytr
            )
        train = ArrayDataset(torch.from_numpy(xtr), torch.from_numpy(ytr))
        test = ArrayDataset(torch.from_numpy(xte), torch.from_numpy(yte))
        return train, test, ytr
