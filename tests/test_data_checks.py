"""Data checked once, at setup: non-finite inputs, labels that are not class ids, string and float labels, LEAF
duplicate users, ``num_samples`` mismatches and test-only users, and the content-keyed Arrow cache. Every bad data set
is built here in its exact form (tensors, Hugging Face data sets, LEAF JSON and parquet files) and every message is
compared in full."""

import json
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
from fedlightning.datamodules import (
    IID,
    ArrayDataset,
    DatasetDataModule,
    Dirichlet,
    FederatedDataModule,
    LeafDataModule,
    checks,
)
from fedlightning.datamodules.generic import SampleView
from fedlightning.models import MLP

N, DIM, CLASSES = 40, 3, 4
G = torch.Generator().manual_seed(0)
X = torch.randn(N, DIM, generator=G)
Y = torch.randint(0, CLASSES, (N,), generator=G)
XT = torch.randn(10, DIM, generator=G)
YT = torch.randint(0, CLASSES, (10,), generator=G)
KW = dict(num_clients=4, batch_size=5, partition=IID(), seed=0)


def _raises(message, make, error=ValueError):
    """``make()`` (construction and setup) raises ``error`` with exactly ``message``."""
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        make()


def _setup(dm):
    dm.setup()
    return dm


def _reference():
    """The same split on clean data: which client / split holds each row (computed without the checks' code)."""
    return _setup(DatasetDataModule(TensorDataset(X, Y), TensorDataset(XT, YT), **KW))


def _client_of(ref, row):
    return next(c for c, ix in enumerate(ref.client_indices) if row in ix.tolist())


def _where(ref, row):
    """``(split, owner)`` of a training-set row as the messages write them."""
    if row in ref.val_indices.tolist():
        return "validation", ""
    return "training", f" (client {_client_of(ref, row)})"


# ---------------------------------------------------------------------------------------------- scan
def test_nonfinite_rows_match_numpy_in_every_chunking(monkeypatch):
    x = torch.randn(257, 5, 3, generator=G)
    x[3, 1, 2] = float("nan")
    x[100, 0, 0] = float("inf")
    x[101, 4, 1] = -float("inf")
    x[256, 2, 2] = float("nan")
    x[50] = 3e38  # finite values whose sum overflows: not a non-finite input
    expected = np.flatnonzero(~np.isfinite(x.numpy().astype(np.float64)).reshape(257, -1).all(axis=1))
    assert expected.tolist() == [3, 100, 101, 256]
    for chunk in (checks.CHUNK_BYTES, 60, 600, 1):  # bytes: one chunk, one row (60 B), 10 rows, one row
        monkeypatch.setattr(checks, "CHUNK_BYTES", chunk)
        assert checks.nonfinite_rows(x).tolist() == expected.tolist()
        assert checks.nonfinite_rows(x.numpy()).tolist() == expected.tolist()
        assert checks.nonfinite_rows(x.double()).tolist() == expected.tolist()
    assert checks.nonfinite_rows(torch.arange(10)).tolist() == []  # integers are always finite: not read
    assert checks.first_nonfinite_value(x[101]) == -float("inf")


# ---------------------------------------------------------------------------------------------- non-finite inputs
def test_nonfinite_input_names_split_client_and_sample():
    ref = _reference()
    row = int(ref.client_indices[2][1])
    bad = X.clone()
    bad[row, 1] = float("nan")
    bad[int(ref.client_indices[3][0]), 0] = float("inf")
    first = min(row, int(ref.client_indices[3][0]))
    _raises(
        f"DatasetDataModule: non-finite input in the training split: sample {first} of the training set (client "
        f"{_client_of(ref, first)}) holds {'nan' if first == row else 'inf'} (the first of 2 such samples); fix or "
        f"drop it: a NaN or infinite input makes the loss, and through the average the global model, non-finite",
        lambda: _setup(DatasetDataModule(TensorDataset(bad, Y), **KW)),
    )

    val = int(ref.val_indices[0])
    bad = X.clone()
    bad[val, 2] = -float("inf")
    _raises(
        f"DatasetDataModule: non-finite input in the validation split: sample {val} of the training set holds -inf; "
        f"fix or drop it: a NaN or infinite input makes the loss, and through the average the global model, "
        f"non-finite",
        lambda: _setup(DatasetDataModule(TensorDataset(bad, Y), **KW)),
    )

    bad_test = XT.clone()
    bad_test[7, 0] = float("nan")
    _raises(
        "DatasetDataModule: non-finite input in the test split: sample 7 of the test set holds nan; fix or drop it: "
        "a NaN or infinite input makes the loss, and through the average the global model, non-finite",
        lambda: _setup(DatasetDataModule(TensorDataset(X, Y), TensorDataset(bad_test, YT), **KW)),
    )


def test_a_failed_setup_is_not_skipped_by_the_next_one():
    bad = X.clone()
    bad[0, 0] = float("nan")
    dm = DatasetDataModule(TensorDataset(bad, Y), **KW)
    for _ in range(2):  # setup() returns early once a data set is loaded: not after a failed check
        with pytest.raises(ValueError, match="non-finite input"):
            dm.setup()


def test_per_sample_data_sets_are_not_scanned():
    bad = X.clone()
    bad[5, 0] = float("nan")
    dm = _setup(DatasetDataModule(TensorDataset(bad, Y), in_memory=False, **KW))  # documented: lazily read, not scanned
    assert isinstance(dm.train_dataset, SampleView)
    assert torch.isnan(dm.train_dataset[5][0][0])


# ---------------------------------------------------------------------------------------------- labels
def test_negative_and_out_of_range_labels_name_sample_and_value():
    ref = _reference()
    neg = Y.clone()
    row = int(ref.client_indices[1][0])
    neg[row] = -1
    _raises(
        f"DatasetDataModule: bad label in the training split: sample {row} of the training set (client 1) has label "
        f"-1, which is negative: class labels are 0, 1, ..., num_classes - 1; pass check_labels=False if the labels "
        f"are targets of your own loss, not class ids",
        lambda: _setup(DatasetDataModule(TensorDataset(X, neg), **KW)),
    )
    # num_classes=3: every label 3 is outside; the first such row names the message
    rows = np.flatnonzero(Y.numpy() == 3)
    first = int(rows[0])
    split, owner = _where(ref, first)
    _raises(
        f"DatasetDataModule: bad label in the {split} split: sample {first} of the training set{owner} has label 3 "
        f"(the first of {len(rows)} such samples), outside the classes 0 to 2 of num_classes=3; pass "
        f"check_labels=False if the labels are targets of your own loss, not class ids",
        lambda: _setup(DatasetDataModule(TensorDataset(X, Y), num_classes=3, **KW)),
    )
    test_labels = YT.clone()
    test_labels[4] = 9
    _raises(
        "DatasetDataModule: bad label in the test split: sample 4 of the test set has label 9, outside the classes 0 "
        "to 3 of num_classes=4; pass check_labels=False if the labels are targets of your own loss, not class ids",
        lambda: _setup(DatasetDataModule(TensorDataset(X, Y), TensorDataset(XT, test_labels), num_classes=4, **KW)),
    )
    # check_labels=False serves the labels exactly as given
    dm = _setup(DatasetDataModule(TensorDataset(X, neg), check_labels=False, **KW))
    assert torch.equal(dm.train_dataset.y, neg)


def test_nan_and_fractional_labels():
    nan = Y.float()
    nan[11] = float("nan")
    ref = _reference()
    split, owner = _where(ref, 11)
    _raises(
        f"DatasetDataModule: bad label in the {split} split: sample 11 of the training set{owner} has label nan, "
        f"which is not finite",
        lambda: _setup(DatasetDataModule(TensorDataset(X, nan), **KW)),
    )
    half = Y.float() + 0.5
    split, owner = _where(ref, 0)
    _raises(
        f"DatasetDataModule: bad label in the {split} split: sample 0 of the training set{owner} has label "
        f"{float(Y[0]) + 0.5!r} (the first of {N} such samples), not a whole number, but num_classes=5 makes the "
        f"labels class ids; pass check_labels=False if the labels are targets of your own loss, not class ids",
        lambda: _setup(DatasetDataModule(TensorDataset(X, half), num_classes=5, **KW)),
    )
    # without num_classes, fractional labels are a regression target: served unchanged
    dm = _setup(DatasetDataModule(TensorDataset(X, half), **KW))
    assert torch.equal(dm.train_dataset.y, half)
    # class labels in train (a label-based partition makes them class ids), a fractional label in test
    test = YT.float()
    test[2] = 1.25
    dirichlet = {**KW, "partition": Dirichlet(alpha=1.0)}
    with pytest.warns(UserWarning, match="the train labels are whole-number floats"):
        _raises(
            "DatasetDataModule: bad label in the test split: sample 2 of the test set has label 1.25, not a whole "
            "number, but the training labels are class ids; pass check_labels=False if the labels are targets of your "
            "own loss, not class ids",
            lambda: _setup(DatasetDataModule(TensorDataset(X, Y.float()), TensorDataset(XT, test), **dirichlet)),
        )
    # IID without num_classes: nothing says the labels are class ids, so both sets are served as they are
    dm = _setup(DatasetDataModule(TensorDataset(X, Y.float()), TensorDataset(XT, test), **KW))
    assert torch.equal(dm.train_dataset.y, Y.float()) and torch.equal(dm.test_dataset.y, test)


class Floats(Dataset):
    """A per-sample data set with Python float labels."""

    def __init__(self, x, y):
        self.x, self.y = x, [float(v) for v in y]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_whole_float_labels_are_served_as_int64_with_a_warning():
    def message(why):
        return (
            f"DatasetDataModule: the train labels are whole-number floats and {why} makes them class ids (train[0][1] "
            f"is {float(Y[0])}); they are served as int64 class ids. Pass check_labels=False to serve them unchanged "
            "(e.g. float targets of BCEWithLogitsLoss)"
        )

    dirichlet = Dirichlet(alpha=1.0)
    for dm, why in (
        # in memory, num_classes given
        (
            DatasetDataModule(TensorDataset(X, Y.float()), TensorDataset(XT, YT.double()), num_classes=4, **KW),
            "num_classes=4",
        ),
        # per sample: the Dirichlet partition reads every training label once, and the checks reuse that pass
        (
            DatasetDataModule(Floats(X, Y), Floats(XT, YT), in_memory=False, **{**KW, "partition": dirichlet}),
            "the label-based partition=Dirichlet(alpha=1.0, min_samples=1, max_retries=10)",
        ),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup()
        assert [str(w.message) for w in caught if "whole-number" in str(w.message)] == [message(why)]
        for c in range(dm.num_clients):
            for x, y in dm.client_dataloader(c):
                assert y.dtype == torch.int64
                assert torch.equal(y, Y[(x[:, None, :] == X[None]).all(-1).int().argmax(1)])
        xt, yt = next(iter(dm.test_dataloader()))
        assert yt.dtype == torch.int64 and torch.equal(yt, YT)
    dm = _setup(DatasetDataModule(TensorDataset(X, Y.float()), check_labels=False, **KW))
    assert dm.train_dataset.y.dtype == torch.float32


def _fit(dm):
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=DIM, hidden=[8], num_classes=CLASSES), local_steps=3, clients_per_round=2, seed=0
    )
    make_trainer(2).fit(loop, datamodule=dm)
    return loop.model.state_dict()


def test_float_labels_train_as_their_class_ids():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        floats = _fit(DatasetDataModule(Floats(X, Y), in_memory=False, **{**KW, "partition": Dirichlet(alpha=1.0)}))
    ints = _fit(DatasetDataModule(TensorDataset(X, Y), in_memory=False, **{**KW, "partition": Dirichlet(alpha=1.0)}))
    start = MLP(input_dim=DIM, hidden=[8], num_classes=CLASSES).state_dict()
    assert any(not torch.equal(start[k], ints[k]) for k in start)  # training moved the weights
    for k, v in ints.items():
        assert torch.equal(floats[k], v), k


def test_float_labels_of_unscanned_per_sample_data_follow_num_classes():
    labels = [float(v) for v in Y]
    labels[6] = 2.5
    dm = DatasetDataModule(Floats(X, torch.tensor(labels)), in_memory=False, num_classes=4, **KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup()  # IID, per sample: the labels are not read at setup
    assert [str(w.message) for w in caught if "num_classes" in str(w.message)] == [
        f"DatasetDataModule: the train labels are floats and num_classes=4 makes them class ids (train[0][1] is "
        f"{float(Y[0])!r}); they are served as int64 class ids (a label that is not a whole number raises a "
        f"ValueError when it is read). Pass check_labels=False to serve them unchanged (e.g. float targets of "
        f"BCEWithLogitsLoss)"
    ]
    assert dm.train_dataset[0][1] == int(Y[0]) and isinstance(dm.train_dataset[0][1], int)
    _raises(
        "train[6]: label 2.5 is not a whole number, but the training labels are class ids", lambda: dm.train_dataset[6]
    )


class Strings(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return X[i], ["cat", "dog"][i % 2]


def test_string_labels_are_refused_with_the_fix():
    _raises(
        "train labels are strings (train[0][1] is 'cat'), but a model needs integer class ids: return integer class "
        "ids from __getitem__ (e.g. classes.index(label)), or build a Hugging Face data set and cast the column with "
        "class_encode_column; or pass check_labels=False to serve the strings as they are",
        lambda: DatasetDataModule(Strings(), **KW),
    )
    names = ["cat", "dog", "emu"]
    strings = [names[int(v) % 3] for v in Y]
    hf = datasets.Dataset.from_dict({"features": X.tolist(), "label": strings})
    _raises(
        f"train labels are strings (train[0]['label'] is {strings[0]!r}), but a model needs integer class ids: cast "
        "the column with train = train.class_encode_column('label') (a Hugging Face ClassLabel maps each string to a "
        "class id); or pass check_labels=False to serve the strings as they are",
        lambda: DatasetDataModule(hf, **KW),
    )
    # served as they are on request (no crash on their size: strings stay per sample)
    dm = _setup(DatasetDataModule(Strings(), check_labels=False, **KW))
    assert dm.in_memory is False and dm.train_dataset[3][1] == "dog"
    # the fix: a ClassLabel column serves the class ids of its names, and gives num_classes
    datasets.disable_progress_bars()
    encoded = hf.class_encode_column("label")
    dm = _setup(DatasetDataModule(encoded, **KW))
    assert dm.num_classes == 3
    ids = torch.tensor([sorted(set(strings)).index(s) for s in strings])  # class_encode_column sorts the names
    assert torch.equal(torch.stack([dm.train_dataset[i]["label"] for i in range(len(ids))]), ids)


def test_class_label_gives_num_classes_and_must_match_the_test_set():
    datasets.disable_progress_bars()
    feats = datasets.Features(
        {
            "features": datasets.Sequence(datasets.Value("float32")),
            "label": datasets.ClassLabel(names=["a", "b", "c", "d"]),
        }
    )
    train = datasets.Dataset.from_dict({"features": X.tolist(), "label": Y.tolist()}, features=feats)
    test_labels = YT.clone()
    test_labels[3] = 4
    test = datasets.Dataset.from_dict({"features": XT.tolist(), "label": test_labels.tolist()})  # plain int column
    _raises(
        "DatasetDataModule: bad label in the test split: sample 3 of the test set has label 4, outside the classes 0 "
        "to 3 of the ClassLabel feature 'label' of train; pass check_labels=False if the labels are targets of your "
        "own loss, not class ids",
        lambda: _setup(DatasetDataModule(train, test, **KW)),
    )
    other = datasets.Features(
        {
            "features": datasets.Sequence(datasets.Value("float32")),
            "label": datasets.ClassLabel(names=["a", "c", "b", "d"]),
        }
    )
    test = datasets.Dataset.from_dict({"features": XT.tolist(), "label": YT.tolist()}, features=other)
    _raises(
        "the ClassLabel names of train and test differ (class 1 is 'b' in train but 'c' in test), so one class id "
        "would mean two classes; align them: test = test.align_labels_with_mapping({name: i for i, name in "
        "enumerate(train.features['label'].names)}, 'label')",
        lambda: DatasetDataModule(train, test, **KW),
    )


class Natural(FederatedDataModule):
    """A natural split with named users (the bundled modules' path) and a known number of classes."""

    num_classes = 4

    def __init__(self, y, **kw):
        super().__init__(**kw)
        self.y = y
        self.client_names = ["ann", "bob"]

    def load(self):
        return ArrayDataset(X, self.y), ArrayDataset(XT, YT), self.y.numpy()

    def natural_clients(self):
        return [np.arange(0, 25), np.arange(25, N)]


def test_bundled_path_names_the_user():
    y = Y.clone()
    y[30] = 4
    _raises(
        "Natural: bad label in the training split: sample 30 of the training set (client 1, user 'bob') has label 4, "
        "outside the classes 0 to 3 of num_classes=4",
        lambda: _setup(Natural(y, val_fraction=0)),
    )


# ---------------------------------------------------------------------------------------------- LEAF
def _write_json(path, users, user_data, num_samples=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "users": users,
                "num_samples": num_samples or [len(user_data[u]["y"]) for u in users],
                "user_data": user_data,
            },
            f,
        )


def _femnist(n, label=3, fill=0.5):
    return {"x": [[fill] * 784 for _ in range(n)], "y": [label] * n}


def _leaf(root, tmp_path, **kw):
    return LeafDataModule(name="femnist", data_dir=str(root), cache_dir=str(tmp_path / "hf_cache"), **kw)


def test_leaf_duplicate_users_and_num_samples(tmp_path):
    one = tmp_path / "twice_in_file"
    _write_json(str(one / "train" / "a.json"), ["u1", "u2", "u1"], {"u1": _femnist(2), "u2": _femnist(3)})
    path = str(one / "train" / "a.json")
    _raises(
        f"{path}: user 'u1' is listed twice in 'users'; a LEAF user must appear once per split (its samples would be "
        f"trained on twice and could leak into the validation split)",
        lambda: _setup(_leaf(one, tmp_path)),
    )
    two = tmp_path / "two_files"
    _write_json(str(two / "train" / "a.json"), ["u1", "u2"], {"u1": _femnist(2), "u2": _femnist(3)})
    _write_json(str(two / "train" / "b.json"), ["u3", "u2"], {"u3": _femnist(2), "u2": _femnist(3)})
    _raises(
        f"user 'u2' is listed in two train files, {two / 'train' / 'a.json'} and {two / 'train' / 'b.json'}; a LEAF "
        f"user must appear once per split (its samples would be trained on twice and could leak into the "
        f"validation split)",
        lambda: _setup(_leaf(two, tmp_path)),
    )
    count = tmp_path / "count"
    _write_json(
        str(count / "train" / "a.json"), ["u1", "u2"], {"u1": _femnist(2), "u2": _femnist(3)}, num_samples=[2, 4]
    )
    _raises(
        f"{count / 'train' / 'a.json'}: user 'u2' declares num_samples=4 but has 3 samples",
        lambda: _setup(_leaf(count, tmp_path)),
    )


def test_leaf_test_users_without_training_data_are_left_out_with_a_warning(tmp_path):
    root = tmp_path / "orphans"
    _write_json(str(root / "train" / "a.json"), ["u1", "u2"], {"u1": _femnist(4, 1), "u2": _femnist(3, 2)})
    _write_json(
        str(root / "test" / "a.json"),
        ["u1", "t1", "u2", "t2", "t3", "t4"],
        {
            "u1": _femnist(2, 5),
            "t1": _femnist(1),
            "u2": _femnist(1, 6),
            "t2": _femnist(2),
            "t3": _femnist(1),
            "t4": _femnist(3),
        },
    )
    dm = _leaf(root, tmp_path, val_fraction=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup()
    assert [str(w.message) for w in caught if "test user" in str(w.message)] == [
        f"LeafDataModule: 4 test user(s) in {root} have no training sample and are left out with their 7 test "
        f"samples (LEAF trains and tests the same users): 't1', 't2', 't3', ...; pass train_fraction= to pool and "
        f"re-split every user's samples instead"
    ]
    assert dm.client_names == ["u1", "u2"]
    assert dm.test_dataset.y.tolist() == [5, 5, 6]  # the global test set: the kept users' test samples
    assert [ix.tolist() for ix in dm.client_test_indices] == [[0, 1], [2]]


def test_leaf_nonfinite_input_names_user_and_file(tmp_path):
    root = tmp_path / "nan"
    u2 = _femnist(3)
    u2["x"][1][100] = float("nan")  # json.dump writes NaN, which json.load reads back
    _write_json(str(root / "train" / "a.json"), ["u1", "u2"], {"u1": _femnist(5), "u2": u2})
    _write_json(str(root / "test" / "a.json"), ["u1", "u2"], {"u1": _femnist(1), "u2": _femnist(1)})
    _raises(
        f"LeafDataModule: non-finite input in the training split: sample 6 of the training set (client 1, user 'u2', "
        f"in {root / 'train' / 'a.json'}) holds nan; fix or drop it: a NaN or infinite input makes the loss, and "
        f"through the average the global model, non-finite",
        lambda: _setup(_leaf(root, tmp_path, val_fraction=0)),
    )


def _rewrite_keeping_size_and_mtime(path, old, new):
    stat = os.stat(path)
    data = open(path, "rb").read()
    assert data.count(old) >= 1 and len(old) == len(new)
    with open(path, "wb") as f:
        f.write(data.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


def test_arrow_cache_is_keyed_by_content(tmp_path):
    root = tmp_path / "cache"
    _write_json(str(root / "train" / "a.json"), ["u1", "u2"], {"u1": _femnist(2, 3), "u2": _femnist(3, 3)})
    _write_json(str(root / "test" / "a.json"), ["u1", "u2"], {"u1": _femnist(1, 3), "u2": _femnist(1, 3)})
    assert _setup(_leaf(root, tmp_path, val_fraction=0)).train_dataset.y.tolist() == [3] * 5
    _rewrite_keeping_size_and_mtime(str(root / "train" / "a.json"), b'"y": [3, 3, 3]', b'"y": [7, 8, 9]')
    assert _setup(_leaf(root, tmp_path, val_fraction=0)).train_dataset.y.tolist() == [3, 3, 7, 8, 9]


def test_parquet_cache_is_keyed_by_content(tmp_path):
    import pandas as pd

    from fedlightning.datamodules.shakespeare import ALL_LETTERS

    text = "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name; Or if thou wilt not, be"
    xs = [text[i : i + 80] for i in range(8)]
    root = tmp_path / "flwr"
    root.mkdir()
    path = root / "train-0.parquet"
    pd.DataFrame({"character_id": ["JULIET"] * 6, "x": xs[:6], "y": list("abcdef")}).to_parquet(path)
    pd.DataFrame({"character_id": ["JULIET"] * 2, "x": xs[6:], "y": list("gh")}).to_parquet(root / "test-0.parquet")

    def targets():
        dm = LeafDataModule(
            name="shakespeare", data_dir=str(root), cache_dir=str(tmp_path / "hf_cache"), val_fraction=0
        )
        dm.setup()
        return [ALL_LETTERS[i] for i in dm.train_dataset.y.tolist()]

    assert targets() == list("abcdef")
    stat = os.stat(path)
    pd.DataFrame({"character_id": ["JULIET"] * 6, "x": xs[:6], "y": list("uvwxyz")}).to_parquet(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # datasets alone keys local files by mtime only
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert targets() == list("uvwxyz")
