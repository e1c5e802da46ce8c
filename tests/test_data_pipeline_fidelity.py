"""The data pipeline of ``DatasetDataModule`` / ``from_datamodule`` serves what the user's own DataLoader would:
Hugging Face transforms and column selections are kept, a separate validation set gets the training and test sets'
label settling and data checks, the served label dtype does not depend on the in-memory decision, a
``num_workers=0`` override drops the loader's worker-only options, an unbatched training loader is refused, and
building and setting up a data module leaves the process's random states as they were. Expected batches are torch's
``default_collate`` of ``dataset[i]`` for the same rows, computed here without the framework's code."""

import random
import re
import warnings

import datasets
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from fedlightning.datamodules import IID, Dirichlet, FederatedDataModule, WrappedDataModule

N = 24


def _equal(a, b):
    """Same nested structure, leaf by leaf equal values of the same type (tensors: same dtype and shape)."""
    (la, sa), (lb, sb) = tree_flatten(a), tree_flatten(b)
    assert sa == sb, (sa, sb)
    for x, y in zip(la, lb):
        assert type(x) is type(y), (x, y)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), (x, y)
        else:
            assert x == y, (x, y)


def _client_batches_match(dm, dataset, rounds=(0, 1)):
    """Every client batch of ``dm`` is ``default_collate`` of the user's ``dataset[i]`` for the batch's rows (the
    rows are the framework's seeded choice; the samples and their collation are computed here). The in-memory path
    serves ``(x, y)`` as a tuple where ``default_collate`` gives a list (documented)."""
    dm.sampling_seed = 3
    for r in rounds:
        for c in range(dm.num_clients):
            batches = list(dm.client_dataloader(c, r))
            rows = list(dm.client_batch_sampler(c, r))
            assert len(batches) == len(rows) > 0
            for batch, idx in zip(batches, rows):
                expected = default_collate([dataset[int(i)] for i in idx])
                _equal(batch, tuple(expected) if dm.in_memory else expected)


# ---------------------------------------------------------------- Hugging Face formats and transforms
def _hf(n=N):
    return datasets.Dataset.from_dict(
        {
            "x": [[float(i), 1.0] for i in range(n)],
            "text": [f"s{i}" for i in range(n)],
            "label": [i % 3 for i in range(n)],
        }
    )


def _scale(batch):
    """A user's transform: scales the input, flips the label to 2 - label, drops the text column."""
    return {"x": [torch.tensor(v) * 100 for v in batch["x"]], "label": [2 - v for v in batch["label"]]}


def test_hugging_face_transform_is_kept():
    for name, data in (("with_transform", _hf().with_transform(_scale)), ("set_transform", _hf())):
        if name == "set_transform":
            data.set_transform(_scale)
        test = _hf(9).with_transform(_scale)
        dm = FederatedDataModule.from_datasets(data, test, num_clients=3, batch_size=4, val_fraction=0, seed=0)
        dm.setup("fit")
        _client_batches_match(dm, data)
        (served,) = list(dm.test_dataloader())
        _equal(served, default_collate([test[j] for j in range(9)]))
        assert float(served["x"][1, 0]) == 100.0 and sorted(served) == ["label", "x"]  # the transform ran


def test_hugging_face_transform_labels_drive_the_partition():
    """A label partition reads the labels through the transform (which maps label to 2 - label), not the column."""
    data = _hf(60).with_transform(_scale)
    part = Dirichlet(alpha=0.3)
    dm = FederatedDataModule.from_datasets(data, num_clients=4, batch_size=4, partition=part, val_fraction=0, seed=1)
    dm.setup("fit")
    served = np.array([int(data[i]["label"]) for i in range(60)])
    expected = part(served, 4, seed=1)
    raw = part(np.array(_hf(60)["label"]), 4, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(expected, raw))  # the column would split otherwise
    for got, want in zip(dm.client_indices, expected):
        assert np.array_equal(np.sort(got), np.sort(want))


def test_hugging_face_columns_are_kept():
    selected = _hf().with_format("torch", columns=["x", "label"])
    dm = FederatedDataModule.from_datasets(selected, num_clients=3, batch_size=4, val_fraction=0, seed=0)
    dm.setup("fit")
    assert sorted(dm.train_dataset[0]) == ["label", "x"]
    _client_batches_match(dm, selected)
    # numpy format: the samples are numpy arrays, collated as the user's DataLoader collates them
    as_numpy = _hf().with_format("numpy", columns=["x", "label"])
    dm = FederatedDataModule.from_datasets(as_numpy, num_clients=3, batch_size=4, val_fraction=0, seed=0)
    dm.setup("fit")
    _client_batches_match(dm, as_numpy)
    # no format type: read as torch tensors, keeping the selected columns
    untyped = _hf()
    untyped.set_format(columns=["x", "label"])
    dm = FederatedDataModule.from_datasets(untyped, num_clients=3, batch_size=4, val_fraction=0, seed=0)
    dm.setup("fit")
    _client_batches_match(dm, _hf().with_format("torch", columns=["x", "label"]))
    # no format at all: every column, numbers as tensors
    dm = FederatedDataModule.from_datasets(_hf(), num_clients=3, batch_size=4, val_fraction=0, seed=0)
    dm.setup("fit")
    _client_batches_match(dm, _hf().with_format("torch"))


# ---------------------------------------------------------------- a separate validation set
def _float_labels(n, seed, bad=None):
    """``(x, y)`` with class ids 0..2 stored as float64 (read from a CSV); ``bad``: a NaN input or label 7 at row 2."""
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = (torch.arange(n) % 3).double()
    if bad == "nan":
        x[2, 1] = float("nan")
    if bad == "label":
        y[2] = 7.0
    return TensorDataset(x, y)


class PerSample(Dataset):
    """A per-sample view of a TensorDataset (Python float labels)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, float(y)


def test_validation_labels_are_settled_like_train_and_test():
    val = _float_labels(12, 2)
    for in_memory, wrap in (("auto", lambda d: d), (False, PerSample)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = FederatedDataModule.from_datasets(
                wrap(_float_labels(30, 0)),
                wrap(_float_labels(9, 1)),
                val=wrap(val),
                num_clients=3,
                batch_size=4,
                num_classes=3,
                in_memory=in_memory,
                eval_batch_size=5,
            )
            dm.setup("fit")
        assert dm.in_memory is (in_memory == "auto")
        served = list(dm.val_dataloader())
        expected = list(DataLoader(val, batch_size=5))  # the user's loader: float64 labels
        assert len(served) == len(expected) == 3
        for (x, y), (ex, ey) in zip(served, expected):
            assert torch.equal(x, ex) and y.dtype == torch.int64 and torch.equal(y, ey.long())


def _msg(split_text):
    return "^" + re.escape(f"DatasetDataModule: {split_text}")


def test_validation_set_is_checked():
    kw = dict(num_clients=3, batch_size=4, num_classes=3)
    with pytest.raises(ValueError, match=_msg("non-finite input in the validation split: sample 2 of the validation ")):
        FederatedDataModule.from_datasets(_float_labels(30, 0), val=_float_labels(12, 2, "nan"), **kw).setup("fit")
    with pytest.raises(
        ValueError,
        match=_msg(
            "bad label in the validation split: sample 2 of the validation set has label 7, outside the classes 0 to "
            "2 of num_classes=3; pass check_labels=False"
        ),
    ):
        FederatedDataModule.from_datasets(_float_labels(30, 0), val=_float_labels(12, 2, "label"), **kw).setup("fit")
    # a fractional validation label when a label partition makes the labels class ids
    val = _float_labels(12, 2)
    val.tensors[1][4] = 1.5
    with pytest.raises(
        ValueError,
        match=_msg(
            "bad label in the validation split: sample 4 of the validation set has label 1.5, not a whole number, but "
            "the training labels are class ids"
        ),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            FederatedDataModule.from_datasets(
                _float_labels(30, 0), val=val, num_clients=3, batch_size=4, partition=Dirichlet(alpha=1.0)
            ).setup("fit")


class WithVal(pl.LightningDataModule):
    def __init__(self, val, num_workers=0, **options):
        super().__init__()
        self.val, self.num_workers, self.options = val, num_workers, options

    def train_dataloader(self):
        return DataLoader(_float_labels(30, 0), batch_size=4, num_workers=self.num_workers, **self.options)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4)


def test_datamodule_validation_set_is_checked_and_settled():
    with pytest.raises(ValueError, match=_msg("non-finite input in the validation split: sample 2 of the validation ")):
        FederatedDataModule.from_datamodule(WithVal(_float_labels(12, 2, "nan")), num_clients=3).setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm = WrappedDataModule(WithVal(_float_labels(12, 2)), num_clients=3, num_classes=3)
        dm.setup("fit")
    y = torch.cat([b[1] for b in dm.val_dataloader()])
    assert y.dtype == torch.int64 and torch.equal(y, (torch.arange(12) % 3))


# ---------------------------------------------------------------- num_workers=0 override
def test_num_workers_override_drops_worker_only_options():
    options = dict(num_workers=2, persistent_workers=True, prefetch_factor=3)
    kept = FederatedDataModule.from_datamodule(WithVal(_float_labels(12, 2), **options), num_clients=3)
    assert (kept.num_workers, kept.persistent_workers, kept.prefetch_factor) == (2, True, 3)
    for dm in (
        FederatedDataModule.from_datamodule(WithVal(_float_labels(12, 2), **options), num_clients=3, num_workers=0),
        WrappedDataModule(WithVal(_float_labels(12, 2), **options), num_clients=3, num_workers=0),
    ):
        assert (dm.num_workers, dm.persistent_workers, dm.prefetch_factor) == (0, False, None)
        dm.setup("fit")
        _client_batches_match(dm, _float_labels(30, 0), rounds=(0,))
    # an explicit prefetch_factor with num_workers=0 is still the user's error
    with pytest.raises(ValueError, match="^prefetch_factor=3 needs worker processes, but num_workers=0"):
        FederatedDataModule.from_datamodule(
            WithVal(_float_labels(12, 2), **options), num_clients=3, num_workers=0, prefetch_factor=3
        )


# ---------------------------------------------------------------- served label dtype on both paths
class Counts(Dataset):
    """Whole-number float targets (counts): a regression target unless the arguments make them class ids."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((2,), float(i)), float(i % 4)


def test_float_label_dtype_does_not_depend_on_the_path():
    paths = (dict(in_memory="auto"), dict(in_memory="auto", max_in_memory_bytes=100), dict(in_memory=False))
    declared = ((dict(), torch.float64), (dict(num_classes=4), torch.int64), (dict(partition=Dirichlet()), torch.int64))
    for extra, dtype in declared:
        for path, in_memory in zip(paths, (True, False, False)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dm = FederatedDataModule.from_datasets(
                    Counts(), num_clients=2, batch_size=4, seed=0, val_fraction=0, **path, **extra
                )
                dm.setup("fit")
            assert dm.in_memory is in_memory
            assert any("served as int64" in str(w.message) for w in caught) is (dtype == torch.int64)
            dm.sampling_seed = 0
            for c in range(2):
                for (x, y), idx in zip(dm.client_dataloader(c), dm.client_batch_sampler(c)):
                    ex, ey = default_collate([Counts()[int(i)] for i in idx])  # the user's float64 labels
                    assert torch.equal(x, ex) and y.dtype == dtype and torch.equal(y, ey.to(dtype)), (extra, path)


# ---------------------------------------------------------------- an unbatched training loader
class Unbatched(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(PerSample(_float_labels(20, 0)), batch_size=None, shuffle=True)


def test_unbatched_training_loader_is_refused():
    message = (
        "Unbatched.train_dataloader() has batch_size=None (automatic batching off: it yields its data set's samples "
        "one at a time, each passed through collate_fn default_convert), but federated clients take batches of "
        "samples; return DataLoader(dataset, batch_size=<samples per batch>, collate_fn=<a function of a list of "
        "samples>) from train_dataloader(), or use FederatedDataModule.from_datasets(dataset, batch_size=..., "
        "collate_fn=...)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        FederatedDataModule.from_datamodule(Unbatched(), num_clients=2)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        WrappedDataModule(Unbatched(), num_clients=2, batch_size=4)  # a batch_size override does not batch it


# ---------------------------------------------------------------- the process's random states
class Augmented(Dataset):
    """Draws from torch, numpy and ``random`` in ``__getitem__`` (a random augmentation)."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        noise = 0.1 * torch.randn(2) + float(np.random.rand()) + random.random()
        return torch.full((2,), float(i)) + noise, i % 2


def _draws():
    return torch.rand(2).tolist(), np.random.rand(2).tolist(), [random.random(), random.random()]


def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def test_construction_and_setup_keep_the_random_states():
    _seed()
    untouched = _draws()
    cases = (
        dict(partition=IID()),
        dict(partition=Dirichlet(alpha=0.5)),  # the label pass reads every sample
        dict(partition=IID(), in_memory=True),  # the in-memory copy reads every sample
        dict(partition=IID(), in_memory=False, val_fraction=0),
    )
    for kw in cases:
        _seed()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = FederatedDataModule.from_datasets(Augmented(), Augmented(8), num_clients=2, batch_size=4, seed=0, **kw)
            assert _draws() == untouched, kw  # construction read sample 0 of each set
            _seed()
            dm.setup("fit")
        assert _draws() == untouched, kw
    # a separate validation set, read in memory
    _seed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FederatedDataModule.from_datasets(
            Augmented(), val=Augmented(8), num_clients=2, batch_size=4, in_memory=True
        ).setup("fit")
    assert _draws() == untouched
