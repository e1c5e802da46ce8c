"""MNIST (LeCun et al. 1998) from its IDX files, split into clients of exactly 2 classes as in "Locally Adaptive
Federated Learning" (seed 001, FedSPS).

:func:`read_idx` reads an IDX file (the formats and the download: its docstring); :class:`MnistDataModule` is the
data module (inputs, normalisation and the default shard split: its docstring).
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib

import numpy as np
import torch

from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule
from fedlightning.datamodules.partition import ClassShards, Partitioner

__all__ = ["MnistDataModule", "read_idx"]

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def read_idx(path: str) -> np.ndarray:
    """The uint8 array of an IDX file (optionally ``.gz``); a ValueError naming the file when it is not IDX/uint8.

    Files (in ``data_dir`` or ``data_dir/MNIST/raw``, torchvision's layout; each may be gzip-compressed with a ``.gz``
    suffix): ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
    ``t10k-labels-idx1-ubyte``. IDX format: big-endian int32 magic ``0x00000803`` (uint8, 3 dimensions) for images and
    ``0x00000801`` for labels, then the dimension sizes, then the uint8 values. ``download=True`` fetches them with
    torchvision's ``MNIST(download=True)``; otherwise missing files give a FileNotFoundError saying where to put them
    (also when ``download=True`` fails for lack of network: the error names the download error and the folder).
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (EOFError, OSError, zlib.error) as e:  # a truncated or damaged .gz (gzip.BadGzipFile is an OSError)
        raise ValueError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    if len(raw) < 4:
        raise ValueError(f"{path} is not an IDX file (too short)")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08 or ndim < 1:
        raise ValueError(f"{path} is not a uint8 IDX file (magic {raw[:4].hex()})")
    header = 4 + 4 * ndim
    dims = struct.unpack(">" + "I" * ndim, raw[4:header])
    expected = math.prod(dims)  # Python integers: no int64 wrap-around of a forged header
    if len(raw) - header != expected:
        raise ValueError(f"{path}: header says {dims} = {expected} values but the file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find(data_dir: str, name: str) -> str:
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw")):
        for suffix in ("", ".gz"):
            p = os.path.join(folder, name + suffix)
            if os.path.isfile(p):
                return p
    raise FileNotFoundError(
        f"MNIST file {name}[.gz] not found in {data_dir!r} or {os.path.join(data_dir, 'MNIST', 'raw')!r}; put the "
        f"four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        f"t10k-labels-idx1-ubyte) there or pass download=True"
    )


class MnistDataModule(FederatedDataModule):
    """MNIST over ``num_clients`` clients (default 100 of exactly 2 classes each).

    Inputs: ``(1, 28, 28)`` float32, ``(x/255 − 0.1307) / 0.3081`` (the usual MNIST normalisation, ours; seed 001 does
    not say). LogisticRegression / MLP flatten them; LeNet5 uses them as images.

    Default split (seed 001, non-IID MNIST: "exactly 2 classes, non-overlapping and balanced"): 100 clients,
    :class:`~fedlightning.datamodules.ClassShards` with 2 classes per client: every class cut into shards within the
    class, each client 2 shards of distinct classes (590 to 614 of the 60,000 images). McMahan et al.'s
    :class:`~fedlightning.datamodules.Shards` (equal shards of the label-sorted images) give every client 600
    images, but a shard can straddle a class boundary, so a few clients see 3 classes or 1. ``partition=IID()``
    gives seed 001's i.i.d. MNIST.

    Args:
        data_dir: folder with the IDX files.
        download: fetch them with torchvision when missing (needs network). Default False.
        num_clients, batch_size, partition, seed, ...: as :class:`FederatedDataModule` (seed 001: 100 clients,
            batch 20, 10 clients per round).
        val_fraction: stratified validation split held out of the 60,000 training images before the shards are
            cut (default 0.1, ours; :class:`FederatedDataModule`). ``0`` gives seed 001's split of all 60,000.
    """

    def __init__(
        self,
        data_dir: str = "data/mnist",
        download: bool = False,
        num_clients: int = 100,
        batch_size: int = 20,
        partition: Partitioner | None = None,
        seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__(
            num_clients=num_clients,
            batch_size=batch_size,
            partition=partition if partition is not None else ClassShards(classes_per_client=2),
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.data_dir = data_dir
        self.download = bool(download)
        self.num_classes = 10

    def prepare_data(self) -> None:
        if not self.download:
            return
        try:
            for names in _FILES.values():
                for n in names:
                    _find(self.data_dir, n)
            return
        except FileNotFoundError:
            import torchvision

            try:
                torchvision.datasets.MNIST(self.data_dir, train=True, download=True)
                torchvision.datasets.MNIST(self.data_dir, train=False, download=True)
            except Exception as err:  # offline, proxy, checksum mismatch, ...: say where the files go
                names = ", ".join(n for pair in _FILES.values() for n in pair)
                raise FileNotFoundError(
                    f"MNIST: download=True failed ({type(err).__name__}: {err}). Without network, put the four IDX "
                    f"files ({names}; optionally .gz) into {self.data_dir!r} or "
                    f"{os.path.join(self.data_dir, 'MNIST', 'raw')!r}"
                ) from err

    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        img_path, lab_path = (_find(self.data_dir, n) for n in _FILES[split])
        images, labels = read_idx(img_path), read_idx(lab_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(f"{img_path} / {lab_path}: expected (N, H, W) images and (N,) labels")
        if len(images) != len(labels):
            raise ValueError(f"{img_path} has {len(images)} images but {lab_path} has {len(labels)} labels")
        bad = np.flatnonzero(labels > 9)
        if len(bad):
            raise ValueError(f"{lab_path}: label {int(labels[bad[0]])} is outside the class range [0, 10)")
        return images, labels.astype(np.int64)

    def load(self):
        if not os.path.isdir(self.data_dir) and not self.download:
            raise FileNotFoundError(f"MNIST data_dir {self.data_dir!r} does not exist (or pass download=True)")
        self.prepare_data()
        xtr, ytr = self._split("train")
        xte, yte = self._split("test")

        def tensor(x: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
            return (t - MNIST_MEAN) / MNIST_STD

        train = ArrayDataset(tensor(xtr), torch.from_numpy(ytr))
        test = ArrayDataset(tensor(xte), torch.from_numpy(yte))
        return train, test, ytr
