"""``FederatedDataModule.from_datasets`` / ``DatasetDataModule``: own torch and Hugging Face data sets get the
bundled modules' clients (the partitioner on the same labels), serve exactly their rows, train to the same weights
as the in-memory ArrayDataset path, build from YAML, and fail early with exact messages."""

import os
import re
import warnings

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.cli import main
from fedlightning.datamodules import IID, ArrayDataset, DatasetDataModule, Dirichlet, FederatedDataModule, Shards
from fedlightning.datamodules.base import ClientBatchSampler
from fedlightning.datamodules.generic import TARGET_SPOT_CHECKS, SampleView
from fedlightning.models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, DIM, CLASSES = 120, 6, 4


def _data(n=N, seed=0):
    """Features whose column 0 is the row number (rows are identifiable in a batch) and 4 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, y


X, Y = _data()
XT, YT = _data(40, seed=1)


class Rows(Dataset):
    """A custom tuple data set: ``(x_i, int label)``, no ``targets`` attribute; counts its reads."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], int(self.y[i])


class Dicts(Dataset):
    """A dict data set: numpy image, int label and an extra key (the input is found by name)."""

    def __init__(self, x, y):
        self.x, self.y = x.numpy(), y.numpy()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": int(self.y[i]), "idx": i}


def _hf(x, y):
    features = datasets.Features(
        {
            "features": datasets.Sequence(datasets.Value("float32")),
            "label": datasets.ClassLabel(num_classes=CLASSES),
        }
    )
    return datasets.Dataset.from_dict({"features": x.tolist(), "label": y.tolist()}, features=features)


KINDS = {
    "tensor": lambda x, y: TensorDataset(x, y),
    "tuple": Rows,
    "dict": Dicts,
    "hf": _hf,
}


def make_sample_keys(kind):
    return {"dict": ("image", "label", "idx"), "hf": ("features", "label")}[kind]


class Bundled(FederatedDataModule):
    """The bundled modules' path: an ArrayDataset and its labels from load()."""

    def load(self):
        return ArrayDataset(X, Y), ArrayDataset(XT, YT), Y.numpy()


def _kw(**kw):
    out = dict(num_clients=6, batch_size=8, partition=Dirichlet(alpha=0.5), seed=3)
    out.update(kw)
    return out


#: kinds whose samples are (x, y) pairs; the others are dicts, served as dicts
PAIRS = ("tensor", "tuple")


def _xy(batch):
    """``(x, y)`` of a pair batch, or of a dict batch (its input and label keys)."""
    if isinstance(batch, dict):
        return torch.as_tensor(batch["image" if "image" in batch else "features"]), batch["label"]
    x, y = batch
    return x, y


def _pairs_collate(samples):
    """A user's collate that turns dict samples into an ``(x, y)`` batch (for the bundled MLP)."""
    return tuple(torch.stack([torch.as_tensor(v) for v in column]) for column in zip(*(_xy(s) for s in samples)))


def _own(kind, **kw):
    make = KINDS[kind]
    return FederatedDataModule.from_datasets(make(X, Y), make(XT, YT), **_kw(**kw))


# ---------------------------------------------------------------------------------------------- clients
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("partition", [Dirichlet(alpha=0.5), Shards(classes_per_client=2), IID()])
def test_clients_are_the_partitioner_on_the_same_labels(kind, partition):
    dm = _own(kind, partition=partition, val_fraction=0)
    dm.setup()
    expected = partition(Y.numpy(), 6, seed=3)  # the partitioner itself, on the labels
    assert len(dm.client_indices) == 6
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))
    if kind == "dict" and isinstance(partition, IID):
        return  # per-sample dicts under IID: no label pass, so the validation draw is uniform (documented)
    # with the default validation split: the same clients and validation rows as the bundled ArrayDataset path
    dm, ref = _own(kind, partition=partition), Bundled(**_kw(partition=partition))
    dm.setup(), ref.setup()
    assert np.array_equal(dm.val_indices, ref.val_indices) and len(dm.val_indices) == 12  # ceil(0.1 * 120)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, ref.client_indices))


@pytest.mark.parametrize("given", ["labels=", "label_key"])
@pytest.mark.parametrize("partition", [Dirichlet(alpha=0.5), IID()])
def test_per_client_test_rows_by_label_for_dict_samples_equal_the_in_memory_path(given, partition):
    """ClientEvaluation's default (client_eval_indices with assignment="labels") on per-sample dict data sets, whose
    labels are given with labels= or only found through label_key (an IID split reads none): the training and test
    labels are read from the samples once, and every client gets the test rows the in-memory path deals it."""
    kw = dict(labels=Y.tolist()) if given == "labels=" else {}
    dm = _own("dict", partition=partition, label_key="label", val_fraction=0, in_memory=False, **kw)
    ref = Bundled(**_kw(partition=partition, val_fraction=0))
    dm.setup(), ref.setup()
    got, expected = dm.client_eval_indices("test", "labels"), ref.client_eval_indices("test", "labels")
    assert sum(len(r) for r in got) == len(YT)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("in_memory", ["auto", False])
def test_batches_are_the_clients_rows(kind, in_memory):
    dm = _own(kind, in_memory=in_memory)
    dm.setup()
    fast = in_memory == "auto" and kind in PAIRS
    assert dm.in_memory is fast
    assert isinstance(dm.train_dataset, ArrayDataset if fast else SampleView)
    for c in range(dm.num_clients):
        rows = []
        for batch in dm.client_dataloader(c, round=1, seed=5):
            if kind not in PAIRS:  # the samples' own structure: a dict batch
                assert isinstance(batch, dict) and set(batch) == set(make_sample_keys(kind))
            x, y = _xy(batch)
            ids = x[:, 0].long()
            assert x.dtype == torch.float32 and y.dtype == torch.int64 and len(y) <= 8
            assert torch.equal(x, X[ids]) and torch.equal(y, Y[ids])
            rows += ids.tolist()
        assert sorted(rows) == dm.client_indices[c].tolist()  # one epoch: every row of the client once
    # the order is the seeded sampler's: ClientBatchSampler with the same generator draws the same batches
    from fedlightning.state import derive_seed

    gen = torch.Generator().manual_seed(derive_seed(5, "data", 1, 2))
    expected = [b.tolist() for b in ClientBatchSampler(dm.client_indices[2], 8, gen)]
    assert [_xy(b)[0][:, 0].long().tolist() for b in dm.client_dataloader(2, round=1, seed=5)] == expected
    xv, yv = _xy(next(iter(dm.val_dataloader())))
    assert torch.equal(xv, X[dm.val_indices]) and torch.equal(yv, Y[dm.val_indices])
    xt, yt = _xy(next(iter(dm.test_dataloader())))
    assert torch.equal(xt, XT) and torch.equal(yt, YT)


def test_hugging_face_float64_columns_are_float32_by_its_torch_format_said_once_and_kept_by_a_transform(caplog):
    """A Hugging Face data set without a format is read with its torch format, which serves floats as float32: the
    float64 column is named in one info line. A transform of the user's own is read as it is: float64 kept."""
    import logging

    x = [1.0 + 1e-12 * i for i in range(N)]  # distinct in float64, one value in float32
    ds = datasets.Dataset.from_dict(
        {"x": x, "nested": [{"v": [v]} for v in x], "z": [float(i) for i in range(N)], "label": Y.tolist()},
        features=datasets.Features(
            {
                "x": datasets.Value("float64"),
                "nested": {"v": datasets.Sequence(datasets.Value("float64"))},
                "z": datasets.Value("float32"),
                "label": datasets.Value("int64"),
            }
        ),
    )
    iid = dict(num_clients=1, batch_size=N, partition=IID(), seed=0, val_fraction=0)
    with caplog.at_level(logging.INFO):
        dm = FederatedDataModule.from_datasets(ds, **iid)
        dm.setup("fit")
    said = [r.getMessage() for r in caplog.records if "float64 column" in r.getMessage()]
    assert len(said) == 1 and "'x', 'nested'" in said[0] and "'z'" not in said[0] and "with_transform" in said[0]
    batch = next(iter(dm.client_dataloader(0, round=0, seed=0)))
    assert batch["x"].dtype == torch.float32 and len(set(batch["x"].tolist())) == 1

    def float64_tensors(b):
        return {"x": torch.tensor(b["x"], dtype=torch.float64), "label": torch.tensor(b["label"])}

    caplog.clear()
    with caplog.at_level(logging.INFO):
        dm = FederatedDataModule.from_datasets(ds.with_transform(float64_tensors), **iid)
        dm.setup("fit")
    assert not [r for r in caplog.records if "float64 column" in r.getMessage()]
    batch = next(iter(dm.client_dataloader(0, round=0, seed=0)))
    assert batch["x"].dtype == torch.float64 and sorted(batch["x"].tolist()) == x


def _fit(dm):
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=DIM, hidden=[8], num_classes=CLASSES), local_steps=3, clients_per_round=2, seed=0
    )
    make_trainer(2).fit(loop, datamodule=dm)
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


@pytest.fixture(scope="module")
def reference_weights():
    return _fit(Bundled(**_kw()))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("in_memory", ["auto", False])
def test_two_round_fit_equals_the_in_memory_array_path(kind, in_memory, reference_weights):
    extra = {} if kind in PAIRS else {"collate_fn": _pairs_collate}
    weights = _fit(_own(kind, in_memory=in_memory, **extra))
    start = MLP(input_dim=DIM, hidden=[8], num_classes=CLASSES).state_dict()
    assert any(not torch.equal(start[k], reference_weights[k]) for k in start)  # training moved the weights
    for k, v in reference_weights.items():
        assert torch.equal(weights[k], v), k


def test_namedtuple_samples_give_namedtuple_batches_in_every_stage():
    """A plain DataLoader gives a namedtuple sample's type to its batches (``batch.x``); so do the clients' and the
    evaluation loaders, with in_memory="auto" as with False (the in-memory path's plain tuples once lost it)."""
    import collections

    from torch.utils.data import DataLoader

    Sample = collections.namedtuple("Sample", "x y")

    class Named(Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return Sample(self.x[i], int(self.y[i]))

    assert type(next(iter(DataLoader(Named(X, Y), batch_size=4)))) is Sample
    for in_memory in ("auto", False):
        dm = FederatedDataModule.from_datasets(
            Named(X, Y), Named(XT, YT), partition=IID(), num_clients=4, batch_size=8, seed=0, in_memory=in_memory
        )
        dm.setup()
        assert dm.in_memory is False
        batches = [next(iter(dm.client_dataloader(0, round=0, seed=1))), next(iter(dm.val_dataloader()))]
        batches.append(next(iter(dm.test_dataloader())))
        assert all(type(b) is Sample for b in batches), (in_memory, [type(b) for b in batches])
        for batch in batches[:2]:  # rows of the training set
            ids = batch.x[:, 0].long()
            assert torch.equal(batch.x, X[ids]) and torch.equal(batch.y, Y[ids])
        assert torch.equal(batches[2].x, XT) and torch.equal(batches[2].y, YT)


# ---------------------------------------------------------------------------------------------- labels
def test_labels_come_from_targets_with_a_spot_check_of_the_samples():
    ds = Rows(X, Y)
    ds.targets = Y.tolist()
    dm = DatasetDataModule(ds, in_memory=False, **_kw(val_fraction=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # targets agree with the samples: no warning
        dm.setup()
    assert ds.reads == 1 + TARGET_SPOT_CHECKS  # sample 0 (the structure check) and the spot check, not N reads
    expected = Dirichlet(alpha=0.5)(Y.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))


class Transformed(Rows):
    """torchvision's convention: ``targets`` holds the raw classes, ``__getitem__`` serves ``target_transform`` of
    them (a binary task made of the 4 classes)."""

    def __init__(self, x, y):
        super().__init__(x, y)
        self.targets = y.tolist()

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], int(self.y[i] >= 2)


@pytest.mark.parametrize("in_memory", [True, False])
def test_targets_that_differ_from_the_served_labels_give_way_to_them_with_a_warning(in_memory):
    """A partition by ``targets`` would skew the raw classes, not the binary labels the model trains on."""
    ds = Transformed(X, Y)
    served = (Y >= 2).long()
    dm = DatasetDataModule(ds, in_memory=in_memory, **_kw(val_fraction=0))
    first = int(np.flatnonzero((Y != served).numpy())[0])
    with pytest.warns(UserWarning, match=rf"targets attribute differs .* \(sample {first}: targets {int(Y[first])}, "):
        dm.setup()
    expected = Dirichlet(alpha=0.5)(served.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))


def test_labels_argument_overrides_the_samples():
    other = (Y + 1) % CLASSES
    dm = DatasetDataModule(TensorDataset(X, Y), labels=other, **_kw(val_fraction=0))
    dm.setup()
    expected = Dirichlet(alpha=0.5)(other.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))


def test_per_sample_labels_are_read_in_one_pass_for_a_label_partition():
    ds = Rows(X, Y)
    dm = DatasetDataModule(ds, in_memory=False, **_kw(val_fraction=0))
    dm.setup()
    assert ds.reads == 1 + N
    expected = Dirichlet(alpha=0.5)(Y.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))


def test_iid_without_labels_is_a_seeded_uniform_validation_draw():
    reg = torch.randn(N, 2)  # regression targets: no class labels
    dm = DatasetDataModule(TensorDataset(X, reg), **_kw(partition=IID()))
    dm.setup()
    assert dm.has_labels is False

    class OneClass(FederatedDataModule):
        def load(self):
            return ArrayDataset(X, reg), None, np.zeros(N, dtype=np.int64)

    ref = OneClass(**_kw(partition=IID()))
    ref.setup()
    assert np.array_equal(dm.val_indices, ref.val_indices) and len(dm.val_indices) == 12
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, ref.client_indices))


def test_integer_valued_float_labels_are_classes():
    dm = DatasetDataModule(TensorDataset(X, Y.float()), **_kw(val_fraction=0))
    dm.setup()
    expected = Dirichlet(alpha=0.5)(Y.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))


# ---------------------------------------------------------------------------------------------- in-memory rule
def test_auto_keeps_transformed_large_and_ragged_data_per_sample():
    with_transform = Rows(X, Y)
    with_transform.transform = lambda v: v
    dm = DatasetDataModule(with_transform, **_kw())
    dm.setup()
    assert dm.in_memory is False
    dm = DatasetDataModule(with_transform, in_memory=True, **_kw())
    dm.setup()
    assert dm.in_memory is True and torch.equal(dm.train_dataset.x, X)
    # the transform of a data set wrapped by random_split / Subset / ConcatDataset counts as well
    part, _ = torch.utils.data.random_split(with_transform, [100, 20], generator=torch.Generator().manual_seed(0))
    both = torch.utils.data.ConcatDataset([Rows(X[:10], Y[:10]), torch.utils.data.Subset(with_transform, range(50))])
    for wrapped in (part, both):
        assert not hasattr(wrapped, "transform")
        dm = DatasetDataModule(wrapped, num_clients=4, partition=IID(), seed=0)
        dm.setup()
        assert dm.in_memory is False

    # 120 samples x (6 float32 + one int) = 120 x 32 bytes: the limit decides
    dm = DatasetDataModule(Rows(X, Y), max_in_memory_bytes=120 * 32, **_kw())
    dm.setup()
    assert dm.in_memory is True
    dm = DatasetDataModule(Rows(X, Y), max_in_memory_bytes=120 * 32 - 1, **_kw())
    dm.setup()
    assert dm.in_memory is False

    dm = DatasetDataModule(Ragged(), num_clients=2, partition=IID())
    dm.setup()
    assert dm.in_memory is False


class Flipped(Dataset):
    """Rows(X, Y) whose ``__getitem__`` flips the features with probability ``p`` (no transform attribute announces
    it); ``p`` = 0: deterministic."""

    def __init__(self, p):
        self.p = p

    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return (-X[i] if self.p and torch.rand(()) < self.p else X[i]), Y[i]


class OwnFlipped(Flipped):
    """:class:`Flipped` drawing from a generator of its own, which moves none of the process's random states."""

    def __init__(self, p):
        super().__init__(p)
        self.rng = np.random.default_rng(0)

    def __getitem__(self, i):
        return (-X[i] if self.rng.random() < self.p else X[i]), Y[i]


def test_auto_reads_samples_twice_and_keeps_a_random_getitem_per_sample():
    """A random augmentation written into ``__getitem__`` would be frozen into one draw by the copy. One that draws
    from the process's generators is found by the draw, whatever its probability: a flip of probability 0.05 left
    8 samples unchanged in about 2 of 3 setups, and the data set was copied with one draw frozen. One that draws
    from a generator of its own is found by reading each of 8 samples twice (a flip of probability 1/2 goes unseen
    with probability 1/256 per setup; its draws are seeded here)."""
    for seed in range(20):
        torch.manual_seed(seed)
        dm = DatasetDataModule(Flipped(0.05), **_kw())
        dm.setup()
        assert dm.in_memory is False, seed
    dm = DatasetDataModule(OwnFlipped(0.5), **_kw())
    dm.setup()
    assert dm.in_memory is False
    dm = DatasetDataModule(Flipped(0.0), **_kw())
    dm.setup()
    assert dm.in_memory is True and torch.equal(dm.train_dataset.x, X)
    dm = DatasetDataModule(Flipped(0.5), in_memory=True, **_kw())  # forced: copied, as the user asked
    dm.setup()
    assert dm.in_memory is True


class Ragged(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.zeros(1 + i % 2), i % 2


# ---------------------------------------------------------------------------------------------- errors
class Bare(Dataset):
    def __init__(self, sample):
        self.sample = sample

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.sample


def _raises(msg, *args, **kw):
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        dm = DatasetDataModule(*args, **kw)
        dm.setup()


def test_empty_data_sets_are_errors():
    empty = TensorDataset(torch.zeros(0, 2), torch.zeros(0))
    _raises("train is empty (len 0); pass a data set with at least one sample", empty)
    _raises("test is empty (len 0); pass a data set with at least one sample", TensorDataset(X, Y), empty)


def test_more_clients_than_samples_is_an_error():
    _raises(
        "num_clients=121 exceeds the 120 training samples: every client needs at least one sample; lower num_clients",
        TensorDataset(X, Y),
        num_clients=121,
    )
    _raises(
        "num_clients=110 exceeds the 108 training samples left for the clients (120 in train, 12 held out for "
        "validation by val_fraction=0.1); lower num_clients or val_fraction",
        TensorDataset(X, Y),
        num_clients=110,
    )


def test_unreadable_labels_for_a_label_partition_name_what_was_tried():
    part = "Dirichlet(alpha=0.5, min_samples=1, max_retries=10)"
    _raises(
        f"partition={part} splits by class label, but no class label could be read for the 120 training samples; "
        "tried: labels= (not given); a train.targets attribute (none); the second tensor of the TensorDataset "
        "(float values that are not whole numbers (a regression target?)); position 1 of the (x, y) samples, "
        "in-memory copy (float values that are not whole numbers (a regression target?)). Pass labels=[one "
        "integer class per training sample], or use partition=IID()",
        TensorDataset(X, torch.randn(N)),
        **_kw(),
    )
    _raises(
        f"partition={part} splits by class label, but no class label could be read for the 120 training samples; "
        "tried: labels= (not given); a train.targets attribute (none); position 1 of the (x, y) samples, every "
        "sample read (sample 0's label is a Tensor of shape (3,) and dtype torch.float32, not a scalar). Pass "
        "labels=[one integer class per training sample], or use partition=IID()",
        VectorLabels(),
        in_memory=False,
        **_kw(),
    )
    nan = Y.double().clone()
    nan[7] = float("nan")
    _raises(
        f"partition={part} splits by class label, but no class label could be read for the 120 training samples; "
        "tried: labels= (not given); a train.targets attribute (none); the second tensor of the TensorDataset "
        "(a label that is not finite (sample 7: nan)); position 1 of the (x, y) samples, in-memory copy (a label "
        "that is not finite (sample 7: nan)). Pass labels=[one integer class per training sample], or use "
        "partition=IID()",
        TensorDataset(X, nan),
        **_kw(),
    )
    _raises(
        "labels must hold one class label per training sample (120), got shape (119,); pass labels=[label of "
        "train[0], label of train[1], ...]",
        TensorDataset(X, Y),
        labels=list(range(119)),
    )


class VectorLabels(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return X[i], torch.ones(3)


def test_unusable_sample_structures_are_errors():
    part = "Dirichlet(alpha=0.5, min_samples=1, max_retries=10)"
    _raises(
        f"partition={part} splits by class label, but no class label could be read for the 10 training samples; "
        "tried: labels= (not given); a train.targets attribute (none); a label in the samples (none found; pass "
        "label_key=). Pass labels=[one integer class per training sample], or use partition=IID()",
        Bare((1, 2, 3)),
        num_clients=2,
        partition=Dirichlet(alpha=0.5),
    )
    _raises(
        "label_key=3 is not a position of train sample 0 (a tuple of 3 elements); pass an integer position from 0 to 2",
        Bare((1, 2, 3)),
        num_clients=2,
        label_key=3,
    )
    _raises(
        "label_key='a' names a key or position, but train sample 0 is a Tensor of shape (3,) and dtype "
        "torch.float32; pass labels=[one class per training sample] instead",
        Bare(torch.zeros(3)),
        num_clients=2,
        label_key="a",
    )
    _raises(
        "label_key='cls' is not a key of train sample 0 (keys ['a', 'label'])",
        Bare({"a": 1, "label": 0}),
        num_clients=2,
        label_key="cls",
    )
    _raises(
        "in_memory=True needs every train sample to have sample 0's shapes and types (('tensor', (1,), "
        "torch.float32), ('int',)), but sample 1 has (('tensor', (2,), torch.float32), ('int',)); use "
        "in_memory=False, or make the samples one shape",
        Ragged(),
        num_clients=2,
        partition=IID(),
        in_memory=True,
    )
    _raises(
        "in_memory=True holds (x, y) pair samples batched by the default collate, but collate_fn is given (it builds "
        "the batches); use in_memory=False or 'auto'",
        TensorDataset(X, Y),
        in_memory=True,
        collate_fn=_pairs_collate,
    )
    _raises(
        "prefetch_factor=2 needs worker processes, but num_workers=0; set num_workers > 0 or remove prefetch_factor",
        TensorDataset(X, Y),
        prefetch_factor=2,
    )
    _raises(
        "val_fraction=0.2 holds out validation samples of train, but val= gives a validation set; pass one of "
        "them (val_fraction=0 with val=)",
        TensorDataset(X, Y),
        val=TensorDataset(XT, YT),
        val_fraction=0.2,
    )
    _raises("in_memory must be True, False or 'auto', got in_memory='yes'", TensorDataset(X, Y), in_memory="yes")
    hf_stream = _hf(X[:4], Y[:4]).to_iterable_dataset()
    _raises(
        "train is a Hugging Face IterableDataset (streaming); DatasetDataModule needs a map-style data set with len() "
        "and [i]: load it without streaming=True, or materialise it with datasets.Dataset.from_generator",
        hf_stream,
        num_clients=2,
    )
    import datasets

    splits = datasets.DatasetDict({"train": _hf(X, Y), "test": _hf(XT, YT)})  # what load_from_disk returns
    _raises(
        "train is a Hugging Face DatasetDict of the splits ['train', 'test'] (what load_dataset and load_from_disk "
        "return for a folder of splits); pass one split, e.g. train=dataset['train']",
        splits,
        num_clients=10,  # was "num_clients=10 exceeds the 2 training samples"
    )


def test_label_key_finds_labels_and_leaves_the_samples_untouched():
    class Triples(Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return X[i], torch.tensor(i), int(Y[i])

    dm = DatasetDataModule(Triples(), label_key=2, **_kw(val_fraction=0))
    dm.setup()
    expected = Dirichlet(alpha=0.5)(Y.numpy(), 6, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))
    x, i, y = next(iter(dm.client_dataloader(0)))  # the 3-tuple, default-collated
    assert torch.equal(x, X[i]) and torch.equal(y, Y[i])


# ---------------------------------------------------------------------------------------------- no test set
def _own_data_cli(*extra, run=False):
    return main(
        [
            *(["fit"] if run else []),
            "--config",
            os.path.join(ROOT, "configs", "examples", "own_data.yaml"),
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--data.init_args.train.init_args.size",
            "200",
            *extra,
        ],
        run=run,
    )


def test_no_test_set_raises_on_test_dataloader_and_fit_skips_the_test(tmp_path):
    dm = DatasetDataModule(TensorDataset(X, Y), **_kw())
    with pytest.raises(
        RuntimeError,
        match="^"
        + re.escape(
            "DatasetDataModule has no test set (test=None); pass test=<a data set> to "
            "FederatedDataModule.from_datasets / DatasetDataModule"
        )
        + "$",
    ):
        dm.test_dataloader()
    with pytest.warns(UserWarning, match="DatasetDataModule has no test set: test_after_fit skipped"):
        cli = _own_data_cli(
            "--data.init_args.test",
            "null",
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            run=True,
        )
    assert cli.trainer.global_step == 1 and "train/loss" in cli.trainer.callback_metrics
    assert not [k for k in cli.trainer.callback_metrics if k.startswith("test/")]


# ---------------------------------------------------------------------------------------------- YAML
def test_yaml_builds_the_same_data_module_as_python(tmp_path):
    import torchvision

    dm = _own_data_cli().datamodule
    assert isinstance(dm, DatasetDataModule)
    dm.setup()

    def fake(size, offset=0):
        return torchvision.datasets.FakeData(
            size=size,
            image_size=(1, 16, 16),
            num_classes=10,
            transform=torchvision.transforms.ToTensor(),
            random_offset=offset,
        )

    train = fake(200)
    xs = torch.stack([train[i][0] for i in range(200)])
    ys = torch.tensor([train[i][1] for i in range(200)])
    assert dm.in_memory and torch.equal(dm.train_dataset.x, xs) and torch.equal(dm.train_dataset.y, ys)
    py = FederatedDataModule.from_datasets(
        train, fake(500, 1000000), num_clients=20, batch_size=32, partition=Dirichlet(alpha=0.5), seed=0, in_memory=True
    )
    py.setup()
    assert np.array_equal(dm.val_indices, py.val_indices)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, py.client_indices))
    assert torch.equal(dm.test_dataset.x, py.test_dataset.x)
    expected = Dirichlet(alpha=0.5)(ys.numpy()[dm.training_rows()], 20, seed=0)  # the partition of the client rows
    assert all(np.array_equal(a, dm.training_rows()[b]) for a, b in zip(dm.client_indices, expected))


class Augmented(Dataset):
    """Rows(X, Y) read through a random flip announced as a transform (``augment=False``: the same samples read
    without it, the evaluation view)."""

    def __init__(self, augment=True):
        self.transform = "flip" if augment else None
        self.augment = augment

    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return (-X[i] if self.augment and torch.rand(()) < 0.5 else X[i]), Y[i]


def _val_rows(dm):
    return torch.cat([b[0] for b in dm.val_dataloader()])


def test_train_eval_gives_the_validation_hold_out_its_samples_without_augmentation():
    """The hold-out of an augmented training set is validated on the augmented samples (warned), or, with
    ``train_eval=``, on the same rows read without augmentation: the same values at every evaluation."""
    with pytest.warns(UserWarning, match=r"validation sees augmented samples.*pass train_eval="):
        dm = DatasetDataModule(Augmented(), **_kw())
        dm.setup()
    torch.manual_seed(0)
    first, second = _val_rows(dm), _val_rows(dm)
    assert not torch.equal(first, second)  # augmented: another draw at each evaluation
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning with train_eval=
        dm = DatasetDataModule(Augmented(), train_eval=Augmented(augment=False), **_kw())
        dm.setup()
    rows = torch.as_tensor(dm.val_indices)
    assert torch.equal(_val_rows(dm), X[rows]) and torch.equal(_val_rows(dm), X[rows])
    assert isinstance(dm.evaluation_view(), Dataset) and dm.evaluation_view() is not dm.train_dataset
    train_rows = torch.as_tensor(dm.training_rows())
    assert torch.equal(torch.cat([b[0] for b in dm.train_eval_dataloader()]), X[train_rows])


def test_train_eval_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"train_eval has 119 samples but train has 120"):
        DatasetDataModule(Augmented(), train_eval=torch.utils.data.Subset(Augmented(False), range(119)), **_kw())


def test_the_reread_probe_compares_images_strings_and_nan():
    """The probe behind in_memory="auto" and the augmented-validation warning compares what data sets return: an
    image equal to an image of the same pixels, strings, object arrays, NaN equal to NaN; another image differs."""
    from PIL import Image

    from fedlightning.datamodules.generic import _same_values

    red, other = Image.new("RGB", (4, 4), (200, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 200))
    assert _same_values(red, Image.new("RGB", (4, 4), (200, 0, 0))) and not _same_values(red, other)
    assert _same_values("cat", "cat") and not _same_values("cat", "dog")
    words = np.array(["a", "b"], dtype=object)
    assert _same_values(words, words.copy())
    assert _same_values(np.array([1.0, np.nan]), np.array([1.0, np.nan]))
    assert not _same_values(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
