"""Natural clients of a user's own data set (``DatasetDataModule(client_key=...)`` / ``client_ids=``): every
distinct id is a client, checked against a grouping by hand; per-client validation and test rows; the batches a
client's ``training_step`` receives; training and per-client evaluation on them; and the bad inputs."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import ClientEvaluation
from fedlightning.datamodules import DatasetDataModule, Dirichlet, FederatedDataModule, WrappedDataModule
from fedlightning.state import derive_seed

WRITERS = ["carol", "alice", "bob", "dave"]  # unsorted on purpose: clients are ordered by id


class Writers(Dataset):
    """Dict samples ``{"x", "y", "writer"}``: sample ``i``'s writer is a fixed, uneven function of ``i``."""

    def __init__(self, n: int, offset: int = 0, kind: str = "dict"):
        self.n, self.offset, self.kind = n, offset, kind

    def __len__(self):
        return self.n

    def writer(self, i: int) -> str:
        j = i + self.offset
        return WRITERS[(j * j + j // 3) % len(WRITERS)]

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i + self.offset)
        x = torch.randn(6, generator=g, dtype=torch.float64)
        y = (i + self.offset) % 3
        if self.kind == "tuple":
            return x, y, WRITERS.index(self.writer(i))
        return {"x": x, "y": y, "writer": self.writer(i)}


def _by_hand(ds: Writers) -> dict[str, list[int]]:
    """Independent grouping: writer -> its sample rows, in data-set order."""
    out: dict[str, list[int]] = {}
    for i in range(len(ds)):
        out.setdefault(ds.writer(i), []).append(i)
    return out


def test_each_distinct_id_is_a_client_with_its_own_rows_validation_and_test_samples():
    train, test = Writers(80), Writers(30, offset=1000)
    dm = DatasetDataModule(train, test, client_key="writer", batch_size=4, val_fraction=0.25, seed=3)
    dm.setup("fit")
    groups, test_groups = _by_hand(train), _by_hand(test)
    assert dm.client_names == sorted(groups) and dm.num_clients == len(groups)
    for c, name in enumerate(dm.client_names):
        own = np.sort(np.concatenate([dm.client_indices[c], dm.client_val_indices[c]]))
        assert own.tolist() == groups[name]  # every sample of the writer, and only its samples
        assert len(dm.client_val_indices[c]) == math.floor(0.25 * len(groups[name]))
        assert dm.client_test_indices[c].tolist() == test_groups.get(name, [])
        assert dm.client_num_samples(c) == len(groups[name]) - len(dm.client_val_indices[c])
    assert np.array_equal(dm.val_indices, np.sort(np.concatenate(dm.client_val_indices)))
    assert dm.client_eval_indices("test")[0].tolist() == test_groups[dm.client_names[0]]
    # a client's batches hold its own samples, as the data set returns them (dict batches of the default collate)
    for c, name in enumerate(dm.client_names):
        seen = []
        for batch in dm.client_dataloader(c, 0):
            assert set(batch) == {"x", "y", "writer"} and set(batch["writer"]) == {name}
            seen += batch["x"][:, 0].tolist()
        expected = sorted(float(train[i]["x"][0]) for i in dm.client_indices[c].tolist())
        assert sorted(seen) == expected


def test_client_ids_given_and_a_tuple_position_give_the_same_clients():
    train = Writers(60, kind="tuple")
    ids = [WRITERS.index(train.writer(i)) for i in range(len(train))]
    by_key = DatasetDataModule(train, client_key=2, batch_size=5, val_fraction=0.1)
    by_ids = DatasetDataModule(train, client_ids=torch.tensor(ids), batch_size=5, val_fraction=0.1)
    for dm in (by_key, by_ids):
        dm.setup("fit")
    assert by_key.client_names == by_ids.client_names == [str(i) for i in sorted(set(ids))]
    for a, b in zip(by_key.client_indices, by_ids.client_indices):
        assert np.array_equal(a, b)
    assert by_key.client_test_indices is None  # no test set


def test_a_hugging_face_column_with_and_without_a_transform():
    datasets = pytest.importorskip("datasets")
    train = Writers(40)
    rows = [train[i] for i in range(len(train))]
    hf = datasets.Dataset.from_dict(
        {"x": [r["x"].tolist() for r in rows], "y": [r["y"] for r in rows], "user": [r["writer"] for r in rows]}
    )
    plain = DatasetDataModule(hf, client_key="user", batch_size=4, val_fraction=0)
    transformed = DatasetDataModule(
        hf.with_transform(lambda b: {**b, "x": [[2 * v for v in x] for x in b["x"]]}),
        client_key="user",
        batch_size=4,
        val_fraction=0,
    )
    for dm in (plain, transformed):
        dm.setup("fit")
    groups = _by_hand(train)
    assert plain.client_names == transformed.client_names == sorted(groups)
    for c, name in enumerate(plain.client_names):
        assert plain.client_indices[c].tolist() == transformed.client_indices[c].tolist() == groups[name]


class _Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 3).double()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.lin(batch["x"]), batch["y"])

    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.cross_entropy(self.lin(batch["x"]), batch["y"]), batch_size=len(batch["y"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


@pytest.mark.numerics
def test_training_samples_the_natural_clients_and_evaluates_each_on_its_own_test_samples():
    train, test = Writers(80), Writers(40, offset=1000)
    dm = DatasetDataModule(train, test, client_key="writer", batch_size=4, val_fraction=0)
    evaluation = ClientEvaluation(batch_size=64)
    loop = FederatedLoop(_Net(), local_steps=2, clients_per_round=2, seed=5)
    make_trainer(3, callbacks=[evaluation]).fit(loop, datamodule=dm)
    sampled = {int(c) for r in range(3) for c in dm.sample_clients(r)}
    assert sampled <= set(range(len(WRITERS)))
    results = evaluation.last_results
    assert results.names == dm.client_names
    test_groups = _by_hand(test)
    for j, name in enumerate(results.names):
        rows = test_groups[name]
        x = torch.stack([test[i]["x"] for i in rows])
        y = torch.tensor([test[i]["y"] for i in rows])
        with torch.no_grad():
            expected = float(F.cross_entropy(loop.model.lin(x), y))
        assert results.values["test/loss"][j] == pytest.approx(expected, rel=1e-12)


def test_natural_clients_from_a_lightning_data_module():
    class UserDM(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Writers(40), batch_size=8, shuffle=True)

    dm = FederatedDataModule.from_datamodule(UserDM(), client_key="writer", val_fraction=0)
    wrapped = WrappedDataModule(UserDM(), client_key="writer", val_fraction=0)  # what a config builds
    for d in (dm, wrapped):
        d.setup("fit")
        assert d.client_names == sorted(_by_hand(Writers(40))) and d.batch_size == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(client_key="writer", partition=Dirichlet(0.3)), r"client_key='writer' makes each distinct id a client"),
        (
            dict(client_key="author"),
            r"client_key='author' is not a key of train sample 0 \(keys \['x', 'y', 'writer'\]\)",
        ),
        (dict(client_key=1.5), r"client_key must be a dict key"),
        (dict(client_ids=[0, 1], test_client_ids=[0] * 10), r"client_ids holds 2 ids for the 30 train samples"),
        (dict(test_client_ids=[0] * 10), r"test_client_ids gives the test samples' clients"),
        (dict(client_ids=[0] * 30), r"client_ids gives the training samples' clients, but the test set's samples"),
        (
            dict(client_ids=[0.0] * 29 + [1.5], test_client_ids=[0] * 10),
            r"client_ids: train sample 29's client id is 1.5, not an integer",
        ),
        (dict(client_ids=[0] * 29 + [float("nan")], test_client_ids=[0] * 10), r"train sample 29's client id is nan"),
        (dict(client_ids=[[0, 1]] * 30, test_client_ids=[0] * 10), r"train sample 0's client id is .*not a scalar"),
        (
            dict(client_ids=[0] * 29 + ["a"], test_client_ids=[0] * 10),
            r"client_ids mixes numbers and strings \(train sample 0.s id is 0, train sample 29.s .a.\)",
        ),
        (
            dict(client_ids=[1] * 29 + [True], test_client_ids=[0] * 10),
            r"client_ids mixes bools and numbers \(train sample 0.s id is 1, train sample 29.s True\)",
        ),
        (dict(client_key="writer", test_client_ids=[0] * 3), r"test_client_ids holds 3 ids for the 10 test samples"),
    ],
)
def test_bad_natural_client_options_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetDataModule(Writers(30), Writers(10, offset=500), batch_size=4, **kwargs)


def test_a_client_key_that_is_not_a_scalar_is_refused_at_setup_naming_the_sample():
    class Vectors(Writers):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return {**sample, "writer": torch.zeros(2) if i == 7 else sample["writer"]}

    dm = DatasetDataModule(Vectors(20), client_key="writer", batch_size=4)
    with pytest.raises(ValueError, match=r"client_key='writer' of train: train sample 7's client id is .*not a scalar"):
        dm.setup("fit")


def test_a_client_key_missing_from_a_later_sample_is_refused_at_setup_naming_the_sample():
    class Missing(Writers):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            if i == 5:
                return {"x": sample["x"], "y": sample["y"]} if self.kind == "dict" else sample[:2]
            return sample

    for key, kind in (("writer", "dict"), (2, "tuple")):
        dm = DatasetDataModule(Missing(20, kind=kind), client_key=key, batch_size=4)
        with pytest.raises(
            ValueError, match=rf"client_key={key!r}: train sample 5 has no {key!r} .*(KeyError|IndexError)"
        ):
            dm.setup("fit")


def test_a_validation_fraction_near_one_leaves_every_user_a_training_sample():
    """floor(val_fraction * n) < n for val_fraction < 1: the float tolerance of the rounding must not take a user's
    last sample."""
    dm = DatasetDataModule(Writers(40), client_key="writer", val_fraction=0.9999999999, seed=1)
    dm.setup("fit")
    groups = _by_hand(Writers(40))
    for c, name in enumerate(dm.client_names):
        n = len(groups[name])
        assert len(dm.client_val_indices[c]) == math.floor(0.9999999999 * n) == n - 1
        assert dm.client_num_samples(c) == 1


def test_too_many_clients_per_round_names_the_natural_split():
    dm = DatasetDataModule(Writers(40), client_key="writer", val_fraction=0)
    dm.setup("fit")
    with pytest.raises(
        ValueError, match=r"clients_per_round=5 exceeds .* \(4 of 4\); lower clients_per_round \(the clients are"
    ):
        dm.configure_rounds(5, 2, 0)


def test_test_samples_of_an_unknown_client_are_counted_in_a_warning():
    train = Writers(30)
    ids = [train.writer(i) for i in range(30)]
    dm = DatasetDataModule(
        train, Writers(6, offset=7), client_ids=ids, test_client_ids=["alice", "erin", "erin", "bob", "x", "bob"]
    )
    with pytest.warns(
        UserWarning, match=r"3 test sample\(s\) have a client id that no training sample has \(e\.g\. 'erin'\)"
    ):
        dm.setup("fit")
    names = dm.client_names
    assert dm.client_test_indices[names.index("alice")].tolist() == [0]
    assert dm.client_test_indices[names.index("bob")].tolist() == [3, 5]
    assert sum(len(t) for t in dm.client_test_indices) == 3


def test_the_seeded_validation_split_of_natural_clients_is_reproducible():
    a, b = (DatasetDataModule(Writers(60), client_key="writer", val_fraction=0.3, seed=11) for _ in range(2))
    c = DatasetDataModule(Writers(60), client_key="writer", val_fraction=0.3, seed=12)
    for dm in (a, b, c):
        dm.setup("fit")
    assert all(np.array_equal(x, y) for x, y in zip(a.client_val_indices, b.client_val_indices))
    assert any(not np.array_equal(x, y) for x, y in zip(a.client_val_indices, c.client_val_indices))
    assert derive_seed(11, "val") != derive_seed(12, "val")
