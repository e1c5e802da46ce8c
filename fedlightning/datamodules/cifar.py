"""CIFAR-10 / CIFAR-100 (Krizhevsky 2009) as federated data sets: Dirichlet label skew by default, Reddi et al.'s
Pachinko split of CIFAR-100 as an option, per-sample augmentation.

* :func:`read_cifar`: the "python version" archives under ``data_dir`` (``download=True`` fetches them; otherwise
  a FileNotFoundError says where to put them), unpickled by a reader that admits only arrays and plain data, the
  official files checked against their official MD5 checksums.
* :class:`CifarImages`: per-sample random crop (padding 4) + horizontal flip, per-channel normalisation.
* :class:`PachinkoPartition`: Reddi et al. 2021's two-level Dirichlet split of CIFAR-100 (the TFF ``cifar100``
  federated split).
* :class:`Cifar10DataModule`, :class:`Cifar100DataModule`: the data modules.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from fedlightning._validation import positive
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, FederatedDataModule
from fedlightning.datamodules.partition import Dirichlet, Partitioner

__all__ = ["Cifar10DataModule", "Cifar100DataModule", "CifarImages", "PachinkoPartition", "read_cifar", "OFFICIAL_MD5"]

_CIFAR = {
    10: {
        "folder": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "label": "labels",
        "mean": (0.4914, 0.4822, 0.4465),
        "std": (0.2470, 0.2435, 0.2616),
        "url": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    },
    100: {
        "folder": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "label": "fine_labels",
        "mean": (0.5071, 0.4865, 0.4409),
        "std": (0.2673, 0.2564, 0.2762),
        "url": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    },
}


#: MD5 checksum and number of images of every official file of the "python version" archives (the checksums of
#: torchvision.datasets.CIFAR10 / CIFAR100 ``train_list`` / ``test_list``; the sizes of Krizhevsky 2009's data sets).
OFFICIAL_MD5 = {
    "cifar-10-batches-py": {
        "data_batch_1": ("c99cafc152244af753f735de768cd75f", 10000),
        "data_batch_2": ("d4bba439e000b95fd0a9bffe97cbabec", 10000),
        "data_batch_3": ("54ebc095f3ab1f0389bbae665268c751", 10000),
        "data_batch_4": ("634d18415352ddfa80567beed471001a", 10000),
        "data_batch_5": ("482c414d41f54cd18b22e5b47cb7c3cb", 10000),
        "test_batch": ("40351d587109b95175f43aff81a1287e", 10000),
    },
    "cifar-100-python": {
        "train": ("16019d7e3df5f24257cddd939b257f8d", 50000),
        "test": ("f0ef6b0ae62326f3e7ffdfab6717acfc", 10000),
    },
}

#: Globals a CIFAR data pickle may name: numpy's array and scalar reconstruction (numpy 1 and numpy 2 module names;
#: ``_frombuffer`` for protocol-5 pickles), ``ndarray`` and ``dtype``, and Python's plain data types.
_ALLOWED_GLOBALS = {
    **{(m, "_reconstruct"): None for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): None for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "_frombuffer"): None for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): None,
    ("numpy", "dtype"): None,
    ("collections", "OrderedDict"): None,
    **{
        ("builtins", n): None
        for n in (
            "set",
            "frozenset",
            "bytearray",
            "bytes",
            "complex",
            "int",
            "float",
            "bool",
            "str",
            "list",
            "dict",
            "tuple",
        )
    },
}


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes in protocol 2 (``encode(text, 'latin1')``), for that codec only."""
    if codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"refuses to decode bytes with the codec {encoding!r} (only latin1)")
    return codecs.encode(text, "latin1")


class _DataUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` admits only :data:`_ALLOWED_GLOBALS` (and ``_codecs.encode`` for latin1): a
    pickle that names anything else (a function that could run code) is refused before anything is called."""

    def __init__(self, file, path: str):
        super().__init__(file, encoding="latin1")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # the builtins module as Python 2 pickles (the official files) name it
            module = "builtins"
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise _RefusedGlobal(
            f"{self.path}: refuses to unpickle the global {module}.{name}: a CIFAR data file holds only arrays, lists, "
            "dicts, strings and numbers, and unpickling another global could run code"
        )


class _RefusedGlobal(pickle.UnpicklingError):
    pass


def _md5(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_official(path: str) -> None:
    """The official-checksum rule (ours): a file with an official name (``<folder>/<name>`` of :data:`OFFICIAL_MD5`)
    that is at least as large as the official file's pixels (images × 3072 bytes) claims to be the official file and
    must have its MD5 checksum; a smaller file cannot hold the official data set and is read as a file of the user's
    own (a subset, a test fixture). A full-size file that differs (modified labels, a corrupted download) is refused
    naming both checksums: to train on a modified CIFAR, hand it over with ``FederatedDataModule.from_datasets``."""
    folder, name = os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path)
    official = OFFICIAL_MD5.get(folder, {}).get(name)
    if official is None:
        return
    expected, images = official
    if os.path.getsize(path) < images * 3072:
        return
    actual = _md5(path)
    if actual != expected:
        raise ValueError(
            f"{path}: MD5 checksum {actual} differs from the official {expected} of {folder}/{name} (a file of the "
            "official size under the official name must be the official file): download the archive again"
        )


def _load_pickle(path: str) -> Any:
    """The CIFAR data pickle at ``path``, read by :class:`_DataUnpickler`."""
    with open(path, "rb") as f:
        return _DataUnpickler(f, path).load()


def _get(d: dict, key: str):
    if key in d:
        return d[key]
    if key.encode() in d:
        return d[key.encode()]
    raise KeyError(key)


def read_cifar(data_dir: str, num_classes: int, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(images uint8 (N, 3, 32, 32), labels int64, coarse labels or None)`` of one split from the python pickles.

    Files: the "python version" archives, extracted under ``data_dir``: ``cifar-10-batches-py/{data_batch_1..5,
    test_batch}`` and ``cifar-100-python/{train, test}`` (pickled dicts with ``data`` (N×3072 uint8, channel-major
    32×32 images) and ``labels`` / ``fine_labels`` + ``coarse_labels``). They are read directly (torchvision's own
    loader insists on the official archive checksums, so smaller files of the same format could not be used);
    ``download=True`` fetches the archives with torchvision's ``CIFAR10``/``CIFAR100(download=True)`` first.

    **No code from data files** (ours). The pickles are read by an unpickler that admits only numpy's array and
    scalar reconstruction, ``ndarray``, ``dtype`` and Python's plain data types (lists, dicts, tuples, sets,
    strings, bytes, numbers): a file naming any other global is refused with ``<file>: refuses to unpickle the global
    <module.name>: ...`` before anything is called. **Official files** are checked against the official MD5 checksums
    (:data:`OFFICIAL_MD5`) when they claim to be official: an official name and at least the official file's pixel
    bytes (images × 3072); a mismatch is refused naming both checksums.

    Without the files and without ``download=True`` a FileNotFoundError says where to put them — nothing is
    downloaded unless asked; when ``download=True`` fails (no network), the FileNotFoundError names the download
    error, the archive's URL and the folder to extract it into.
    """
    spec = _CIFAR[num_classes]
    folder = os.path.join(data_dir, spec["folder"])
    paths = [os.path.join(folder, name) for name in spec[split]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-{num_classes} files not found: {missing}. Extract the python version ({spec['url']}) so that "
            f"{folder}/ holds {', '.join(spec['train'] + spec['test'])}, or pass download=True"
        )
    xs, ys, coarse = [], [], []
    for p in paths:
        _check_official(p)
        try:
            entry = _load_pickle(p)
            raw = {
                key: _get(entry, key) for key in ("data", spec["label"], *(("coarse_labels",) * (num_classes == 100)))
            }
        except _RefusedGlobal as e:
            raise ValueError(str(e)) from None
        except (
            pickle.UnpicklingError,
            EOFError,
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            IndexError,
            LookupError,
        ) as e:
            raise ValueError(f"{p} is not a CIFAR python pickle (dict with data and labels): {e!r}") from None
        data = _pixels(raw["data"], p)
        labels = _class_indices(raw[spec["label"]], p, spec["label"])
        if num_classes == 100:
            coarse.append(_class_indices(raw["coarse_labels"], p, "coarse_labels"))
        if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
            raise ValueError(f"{p}: expected data of shape (N, 3072) and N labels, got {data.shape} / {len(labels)}")
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if len(bad):
            raise ValueError(f"{p}: label {int(labels[bad[0]])} is outside the class range [0, {num_classes})")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys), (np.concatenate(coarse) if coarse else None)


def _pixels(raw: object, path: str) -> np.ndarray:
    """``raw`` (a batch's ``data``) as uint8 pixels, refused with a ValueError naming ``path`` unless it holds
    integers 0..255: a float, string or object array (pixels scaled to [0, 1], a text dump) or integers outside the
    byte range would be truncated or wrapped by a uint8 cast."""
    arr = np.asarray(raw)
    if arr.dtype == np.uint8:
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        shown = "".join(f" (e.g. {v!r})" for v in arr.reshape(-1)[:1].tolist())
        raise ValueError(f"{path}: data holds {arr.dtype} values{shown}; CIFAR pixels are integers 0..255 (uint8)")
    bad = np.flatnonzero((arr.reshape(-1) < 0) | (arr.reshape(-1) > 255))
    if len(bad):
        raise ValueError(f"{path}: data holds the pixel value {int(arr.reshape(-1)[bad[0]])}, outside 0..255 (uint8)")
    return arr.astype(np.uint8)


def _class_indices(raw: object, path: str, field: str) -> np.ndarray:
    """``raw`` (a batch's ``labels`` / ``fine_labels`` / ``coarse_labels``) as int64 class indices, refused with a
    ValueError naming ``path`` and ``field`` unless it is a flat list of integers: fractional, string, boolean,
    nested or out-of-int64 values would be truncated, parsed or fail later without a name."""
    try:
        arr = np.asarray(raw)
    except (ValueError, OverflowError) as e:  # ragged nesting, integers beyond any numpy type
        raise ValueError(f"{path}: {field} is not a list of integer class indices ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"{path}: {field} must be a flat list of integer class indices, got shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.uint64:
        return arr.astype(np.int64)
    limit = np.iinfo(np.int64)
    values = arr.tolist()
    first = next(
        (v for v in values if isinstance(v, bool) or not isinstance(v, int) or not limit.min <= v <= limit.max),
        values[0] if values else None,
    )
    raise ValueError(
        f"{path}: {field} holds the value {first!r} ({arr.dtype} array); class labels are integers (int64)"
    )


class CifarImages(Dataset):
    """uint8 CHW images + labels; items are normalised float32 images (augmented when ``augment``).

    Augmentation (training images only, per sample): random 32×32 crop of the image zero-padded by 4 pixels, then a
    horizontal flip with probability 1/2 (the standard CIFAR recipe; seed 000 follows FedExP's code, which applies this
    crop + flip, and seed 004 asks for crop + flip). Unlike the FedExP reference code, which transforms a whole batch
    tensor at once (one crop for the batch), every sample gets its own crop and flip. Padding happens before
    normalisation (as torchvision's ``RandomCrop`` on the raw image), so padded pixels are black. Normalisation:
    per-channel mean/std of the training images (CIFAR-10: (0.4914, 0.4822, 0.4465) / (0.2470, 0.2435, 0.2616);
    CIFAR-100: (0.5071, 0.4865, 0.4409) / (0.2673, 0.2564, 0.2762)). Randomness: torch's global generator, which a
    client's loader (:class:`~fedlightning.datamodules.base.ClientDataLoader`) seeds per (seed, round, client) around
    every batch (loader workers: PyTorch's per-worker seeding from the same seed), so the crops of a round depend only
    on those, and a resumed run draws the crops the uninterrupted run would have.

    ``__getitem__`` transforms one sample; ``__getitems__`` (used by ``DataLoader`` for a whole batch of indices) does
    the same per-sample random crops and flips vectorised over the batch.
    """

    def __init__(self, images: Tensor, labels: Tensor, mean: Sequence[float], std: Sequence[float], augment: bool):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 (N, C, H, W) tensor, got {images.dtype} {tuple(images.shape)}")
        self.images, self.labels = images, labels
        self.augment = bool(augment)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.padding = 4

    def __len__(self) -> int:
        return len(self.labels)

    def _transform(self, imgs: Tensor) -> Tensor:
        """``imgs``: uint8 (B, C, H, W) -> float32 normalised, each sample cropped/flipped independently."""
        if self.augment:
            B, C, H, W = imgs.shape
            p = self.padding
            padded = torch.nn.functional.pad(imgs, (p, p, p, p))  # zeros = black, before normalisation
            top = torch.randint(0, 2 * p + 1, (B,))
            left = torch.randint(0, 2 * p + 1, (B,))
            flip = torch.rand(B) < 0.5
            rows = top[:, None] + torch.arange(H)[None, :]  # (B, H)
            cols = left[:, None] + torch.arange(W)[None, :]  # (B, W)
            cols = torch.where(flip[:, None], cols.flip(1), cols)
            b = torch.arange(B)[:, None, None]
            imgs = padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
        return (imgs.float() / 255.0 - self.mean) / self.std

    def __getitem__(self, idx: int):
        return self._transform(self.images[idx : idx + 1])[0], self.labels[idx]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self._transform(self.images[idx])
        return list(zip(x.unbind(0), self.labels[idx].unbind(0)))


class PachinkoPartition(Partitioner):
    """Reddi et al.'s two-level (coarse → fine) Dirichlet split of CIFAR-100.

    CIFAR-100 Pachinko split (:class:`PachinkoPartition`, Reddi et al. 2021, "Adaptive Federated Optimization", App. C;
    the TFF ``cifar100`` federated split, seed 004 uses its 500 clients of 100 images): every client draws a
    distribution over the 20 coarse labels from ``Dir(α)`` (α = 0.1) and, for each coarse label, a distribution over its
    5 fine labels from ``Dir(β)`` (β = 10). Each of its samples then draws a coarse label, a fine label within it, and
    the next unused image of that fine label. When a fine label runs out of images it is removed for all later draws
    (the client's distributions are renormalised over the labels that remain), and likewise a coarse label whose fine
    labels are all used up. Clients receive ``len(train) // num_clients`` images (the first ``len % num_clients`` one
    more), so the split covers the training set (500 clients → 100 images each).

    Args:
        alpha: concentration of the per-client distribution over coarse labels (Reddi et al.: 0.1).
        beta: concentration of the per-client distributions over the fine labels of each coarse label (10).
        coarse_of_fine: coarse label of every fine label; :class:`Cifar100DataModule` fills it from the data.
    """

    def __init__(self, alpha: float = 0.1, beta: float = 10.0, coarse_of_fine: Sequence[int] | None = None):
        self.alpha = positive("alpha", alpha, label="Pachinko alpha")
        self.beta = positive("beta", beta, label="Pachinko beta")
        self.coarse_of_fine = None if coarse_of_fine is None else np.asarray(coarse_of_fine, dtype=np.int64)

    def split(self, labels, num_clients, rng):
        if self.coarse_of_fine is None:
            raise ValueError("PachinkoPartition needs coarse_of_fine (the coarse label of every fine label)")
        c_of_f = self.coarse_of_fine
        if labels.max() >= len(c_of_f):
            raise ValueError(f"fine label {int(labels.max())} has no coarse label (coarse_of_fine has {len(c_of_f)})")
        coarse_ids = np.unique(c_of_f)
        fine_of = {int(c): np.flatnonzero(c_of_f == c) for c in coarse_ids}
        pools = {int(f): list(rng.permutation(np.flatnonzero(labels == f))) for f in range(len(c_of_f))}
        left = np.array([len(pools[f]) for f in range(len(c_of_f))], dtype=np.int64)
        n, N = len(labels), num_clients
        sizes = np.full(N, n // N, dtype=np.int64)
        sizes[: n % N] += 1
        parts: list[np.ndarray] = []
        for c in range(N):
            p_coarse = rng.dirichlet(np.full(len(coarse_ids), self.alpha))
            p_fine = {int(k): rng.dirichlet(np.full(len(fine_of[int(k)]), self.beta)) for k in coarse_ids}
            mine = np.empty(sizes[c], dtype=np.int64)
            for s in range(sizes[c]):
                avail_coarse = np.array([left[fine_of[int(k)]].sum() > 0 for k in coarse_ids])
                w = p_coarse * avail_coarse
                w = w / w.sum() if w.sum() > 0 else avail_coarse / avail_coarse.sum()
                k = int(coarse_ids[rng.choice(len(coarse_ids), p=w)])
                fines = fine_of[k]
                avail = left[fines] > 0
                wf = p_fine[k] * avail
                wf = wf / wf.sum() if wf.sum() > 0 else avail / avail.sum()
                f = int(fines[rng.choice(len(fines), p=wf)])
                mine[s] = pools[f].pop()
                left[f] -= 1
            parts.append(mine)
        return parts


class Cifar10DataModule(FederatedDataModule):
    """CIFAR-10 split over ``num_clients`` clients (default ``Dirichlet(alpha=0.3)`` over 100 clients, seed 000).

    Args:
        data_dir: folder holding ``cifar-10-batches-py/`` (see :func:`read_cifar`); default ``data/cifar`` (ours).
        download: fetch the archive with torchvision when the files are missing (needs network). Default False.
        augment: per-sample random crop (padding 4) + horizontal flip of training images. Default True.
        num_clients, batch_size, partition, seed, eval_batch_size, num_workers, rounds_per_epoch: as
            :class:`FederatedDataModule` (seed 000: 100 clients, batch 50, Dirichlet α = 0.3; seed 001: α ∈ {1, 0.1,
            0.01}; seed 002: 100 clients, batch 32, α = 0.1).
        val_fraction: stratified validation split held out of the 50,000 training images before the partition
            (default 0.1, ours; :class:`FederatedDataModule`). Validation reads those images without augmentation
            (:meth:`evaluation_view`). The partitioner splits the remaining images, so Pachinko's 500 clients get 90
            images each with the default and seed 004's 100 with ``val_fraction=0``.
    """

    num_classes = 10

    def __init__(
        self,
        data_dir: str = "data/cifar",
        download: bool = False,
        augment: bool = True,
        num_clients: int = 100,
        batch_size: int = 50,
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
            partition=partition if partition is not None else Dirichlet(alpha=0.3),
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.data_dir = data_dir
        self.download = bool(download)
        self.augment = bool(augment)
        self.coarse_labels: np.ndarray | None = None

    def prepare_data(self) -> None:
        if not self.download:
            return
        spec = _CIFAR[self.num_classes]
        if all(os.path.isfile(os.path.join(self.data_dir, spec["folder"], n)) for n in spec["train"] + spec["test"]):
            return
        import torchvision

        cls = torchvision.datasets.CIFAR10 if self.num_classes == 10 else torchvision.datasets.CIFAR100
        try:
            cls(self.data_dir, train=True, download=True)
            cls(self.data_dir, train=False, download=True)
        except Exception as err:  # offline, proxy, checksum mismatch, disk full, ...: say where the files go
            folder = os.path.join(self.data_dir, spec["folder"])
            raise FileNotFoundError(
                f"CIFAR-{self.num_classes}: download=True failed ({type(err).__name__}: {err}). Without network, "
                f"download {spec['url']} elsewhere and extract it under {self.data_dir!r} so that {folder}/ holds "
                f"{', '.join(spec['train'] + spec['test'])}"
            ) from err

    def load(self):
        if not os.path.isdir(self.data_dir) and not self.download:
            raise FileNotFoundError(
                f"CIFAR data_dir {self.data_dir!r} does not exist: extract {_CIFAR[self.num_classes]['url']} there or "
                f"pass download=True"
            )
        self.prepare_data()
        spec = _CIFAR[self.num_classes]
        xtr, ytr, ctr = read_cifar(self.data_dir, self.num_classes, "train")
        xte, yte, _ = read_cifar(self.data_dir, self.num_classes, "test")
        self.coarse_labels = ctr
        if isinstance(self.partition, PachinkoPartition) and self.partition.coarse_of_fine is None:
            if ctr is None:
                raise ValueError("PachinkoPartition needs coarse labels (CIFAR-100)")
            mapping = np.full(self.num_classes, -1, dtype=np.int64)
            mapping[ytr] = ctr
            self.partition.coarse_of_fine = mapping
        train = CifarImages(torch.from_numpy(xtr), torch.from_numpy(ytr), spec["mean"], spec["std"], self.augment)
        test = CifarImages(torch.from_numpy(xte), torch.from_numpy(yte), spec["mean"], spec["std"], False)
        return train, test, ytr

    def evaluation_view(self) -> CifarImages:
        """The training images without augmentation (same uint8 storage, no copy): what validation and the
        train-evaluation loader read."""
        train = self.train_dataset
        if not train.augment:
            return train
        view = getattr(self, "_eval_view", None)
        if view is None or view.images is not train.images:
            spec = _CIFAR[self.num_classes]
            view = CifarImages(train.images, train.labels, spec["mean"], spec["std"], augment=False)
            self._eval_view = view
        return view


class Cifar100DataModule(Cifar10DataModule):
    """CIFAR-100 (fine labels). Default ``Dirichlet(alpha=0.3)`` over 100 clients (seed 000); pass
    ``partition=PachinkoPartition()`` with ``num_clients=500`` for Reddi et al.'s split (seed 004)."""

    num_classes = 100
