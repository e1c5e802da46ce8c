"""The data contract: a client's ``training_step`` receives what the user's DataLoader would build from the client's
samples, in every client_execution mode, with the user's DataLoader options; ``from_datamodule`` federates a plain
LightningDataModule; ``drop_last``; a resumed run with a dict data set and a ``collate_fn`` equals the uninterrupted
one."""

import functools
import os
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.checkpoint import AtomicCheckpointIO
from fedlightning.datamodules import IID, ArrayDataset, FederatedDataModule, Partitioner
from fedlightning.datamodules.base import ClientBatchSampler
from fedlightning.state import derive_seed
from fedlightning.vectorized.batches import _padded_positions, _round_index, _sampler_batches
from numerics import assert_close64

DIM, CLASSES = 3, 2
G = torch.Generator().manual_seed(0)
X = torch.randn(300, DIM, dtype=torch.float64, generator=G)
Y = (X[:, 0] + 0.3 * torch.randn(300, dtype=torch.float64, generator=G) > 0).long()
W = 1.0 + torch.arange(300, dtype=torch.float64) % 3  # a per-sample input scale (the 3-tuples' middle element)
SEEN = []  # batch sizes of the real (not vmapped) training_step calls of the latest _fit (clients train on copies)


class Dicts(Dataset):
    """Dict samples ``{"features", "label", "idx"}`` of rows ``offset … offset + n − 1``."""

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        r = self.offset + i
        return {"features": X[r], "label": int(Y[r]), "idx": r}


def dict_collate(samples):
    """A user's collate: other keys than the samples', so that torch's default collate would give another batch."""
    return {
        "x": torch.stack([s["features"] for s in samples]),
        "y": torch.tensor([s["label"] for s in samples]),
        "ids": torch.tensor([s["idx"] for s in samples]),
    }


class Tuples(Dataset):
    """Plain tuple samples: ``(x, y)`` or ``(x, w, y)`` (``arity``), not a TensorDataset (served per sample)."""

    def __init__(self, n, arity):
        self.n, self.arity = n, arity

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (X[i], Y[i]) if self.arity == 2 else (X[i], W[i], Y[i])


class Net(pl.LightningModule):
    """A float64 linear classifier reading dict batches (``x``/``y``), pairs or ``(x, w, y)`` 3-tuples; records the
    sizes of the real batches in ``SEEN``."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(DIM, CLASSES).double()
        self.kind = kind

    def training_step(self, batch, batch_idx):
        if self.kind == "dict":
            assert set(batch) == {"x", "y", "ids"}
            x, y = batch["x"], batch["y"]
        elif self.kind == "triple":
            assert len(batch) == 3
            x, w, y = batch
            x = x * w[:, None]
        else:
            assert len(batch) == 2
            x, y = batch
        if not torch._C._functorch.is_batchedtensor(x):
            SEEN.append(len(y))
        return F.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _weights(loop):
    return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().clone()


def _fit(dm, kind, mode="sequential", rounds=2, local_steps=4):
    loop = FederatedLoop(Net(kind), local_steps=local_steps, clients_per_round=3, seed=0, client_execution=mode)
    SEEN.clear()
    make_trainer(rounds).fit(loop, datamodule=dm)
    loop.seen = list(SEEN)
    return loop


class Sizes(Partitioner):
    """Consecutive clients of the given sizes (no labels needed)."""

    needs_labels = False

    def __init__(self, sizes):
        self.sizes = list(sizes)

    def split(self, labels, num_clients, rng):
        ends = np.cumsum(self.sizes)
        return [np.arange(e - s, e) for e, s in zip(ends, self.sizes)]


# ------------------------------------------------------------------------------------------- from_datamodule
class UserDataModule(pl.LightningDataModule):
    """A plain LightningDataModule, written without fedlightning: dict samples, a custom collate, val and test."""

    def setup(self, stage):
        self.train, self.val, self.test = Dicts(40), Dicts(10, offset=100), Dicts(12, offset=200)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=5, shuffle=True, collate_fn=dict_collate, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4, collate_fn=dict_collate)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=4, collate_fn=dict_collate)


def _equal_batches(got, expected):
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_from_datamodule_serves_the_users_collate_and_its_val_and_test_data():
    user = UserDataModule()
    dm = FederatedDataModule.from_datamodule(user, partition=IID(), num_clients=4, seed=0)
    dm.setup()
    assert (dm.batch_size, dm.drop_last, dm.collate_fn) == (5, True, dict_collate)
    # nothing is held out of the training set: the module's own val_dataloader validates
    assert sorted(np.concatenate(dm.client_indices).tolist()) == list(range(40))
    for c in range(4):
        gen = torch.Generator().manual_seed(derive_seed(7, "data", 2, c))
        expected = [b.tolist() for b in ClientBatchSampler(dm.client_indices[c], 5, gen, drop_last=True)]
        got = list(dm.client_dataloader(c, round=2, seed=7))
        assert len(got) == len(expected) > 0
        for batch, rows in zip(got, expected):
            _equal_batches(batch, dict_collate([user.train[i] for i in rows]))
    for loader, data in ((dm.val_dataloader(), user.val), (dm.test_dataloader(), user.test)):
        batches = list(loader)
        assert torch.cat([b["ids"] for b in batches]).tolist() == [data.offset + i for i in range(len(data))]
        start = 0
        for b in batches:
            _equal_batches(b, dict_collate([data[i] for i in range(start, start + len(b["ids"]))]))
            start += len(b["ids"])
    loop = _fit(dm, "dict")
    assert loop.seen and set(loop.seen) == {5}  # every client batch whole (drop_last, 10 per client)


def test_from_datamodule_names_a_sampler_or_collate_it_does_not_use():
    """A weighted sampler, a custom batch sampler, or an evaluation loader that collates otherwise than the
    training loader are not what the federated loaders use: a warning names each; the plain module warns nothing."""
    import warnings

    from torch.utils.data import BatchSampler, SequentialSampler, WeightedRandomSampler

    class Weighted(UserDataModule):
        def train_dataloader(self):
            sampler = WeightedRandomSampler(torch.ones(len(self.train)), len(self.train))
            return DataLoader(self.train, batch_size=5, sampler=sampler, collate_fn=dict_collate)

    class Buckets(BatchSampler):
        pass

    class Bucketed(UserDataModule):
        def train_dataloader(self):
            batches = Buckets(SequentialSampler(self.train), batch_size=5, drop_last=False)
            return DataLoader(self.train, batch_sampler=batches, collate_fn=dict_collate)

    class OtherCollate(UserDataModule):
        def val_dataloader(self):
            return DataLoader(self.val, batch_size=4, collate_fn=lambda samples: dict_collate(samples))

    for module, needle in (
        (Weighted, "sampler WeightedRandomSampler"),
        (Bucketed, "batch_sampler Buckets"),
        (OtherCollate, "val_dataloader() has another collate_fn"),
    ):
        with pytest.warns(UserWarning, match=re.escape(needle)):
            FederatedDataModule.from_datamodule(module(), partition=IID(), num_clients=4, seed=0)

    class OwnMethods(UserDataModule):  # each loader makes its own bound method or partial: the same collate
        def collate(self, samples, scale=1):
            return dict_collate(samples)

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=5, collate_fn=functools.partial(self.collate, scale=1))

        def val_dataloader(self):
            return DataLoader(self.val, batch_size=4, collate_fn=functools.partial(self.collate, scale=1))

        def test_dataloader(self):
            return DataLoader(self.test, batch_size=4, collate_fn=functools.partial(self.collate, scale=1))

    class BoundMethods(OwnMethods):
        def train_dataloader(self):
            return DataLoader(self.train, batch_size=5, collate_fn=self.collate)

        def val_dataloader(self):
            return DataLoader(self.val, batch_size=4, collate_fn=self.collate)

        def test_dataloader(self):
            return DataLoader(self.test, batch_size=4, collate_fn=self.collate)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in (UserDataModule, OwnMethods, BoundMethods):
            FederatedDataModule.from_datamodule(module(), partition=IID(), num_clients=4, seed=0)


def test_wrapped_datamodule_is_from_datamodule_with_init_args():
    """WrappedDataModule (the YAML form) builds what from_datamodule builds: the same clients, loader options and
    validation / test sets, and the same run; its None arguments keep the loader's values, the others win."""
    from fedlightning.datamodules import WrappedDataModule

    wrapped = WrappedDataModule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    plain = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    for dm in (wrapped, plain):
        dm.setup()
    assert isinstance(wrapped.datamodule, UserDataModule)
    assert (wrapped.batch_size, wrapped.drop_last, wrapped.collate_fn) == (5, True, dict_collate)
    assert all(np.array_equal(a, b) for a, b in zip(wrapped.client_indices, plain.client_indices))
    assert len(wrapped.val_dataloader().dataset) == 10 and len(wrapped.test_dataloader().dataset) == 12
    assert torch.equal(_weights(_fit(wrapped, "dict")), _weights(_fit(plain, "dict")))
    other = WrappedDataModule(UserDataModule(), partition=IID(), num_clients=4, seed=0, batch_size=3, drop_last=False)
    assert (other.batch_size, other.drop_last) == (3, False)


def test_own_datamodule_config_federates_a_plain_lightning_datamodule(tmp_path):
    """configs/examples/own_datamodule.yaml: the example's plain LightningDataModule (dict samples, its own collate)
    is split over 100 clients by label (label_key), validated and tested on its own val / test sets."""
    from fedlightning.cli import main
    from user_code.digits_datamodule import DigitsLightningDataModule, to_pairs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cli = main(
        [
            "fit",
            "--config",
            os.path.join(root, "configs", "examples", "own_datamodule.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "1",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        run=True,
    )
    dm = cli.datamodule
    assert isinstance(dm.datamodule, DigitsLightningDataModule) and dm.collate_fn is to_pairs
    assert dm.num_clients == 100 and sum(len(c) for c in dm.client_indices) == 1797 - 180 - 360
    assert len(dm.val_dataloader().dataset) == 180 and len(dm.test_dataloader().dataset) == 360
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and {"val/acc", "test/acc"} <= set(metrics)


# ------------------------------------------------------------------------------------------- full-batch gradients
def test_client_full_dataloader_reads_every_sample_in_order_with_the_users_collate():
    """A client's full-batch loader: its samples in index order, in chunks (the last one shorter; drop_last does
    not apply), each collated by the user's collate_fn; bad arguments name themselves."""
    user = UserDataModule()
    dm = FederatedDataModule.from_datamodule(user, partition=IID(), num_clients=4, seed=0)
    dm.setup()
    rows = [int(i) for i in dm.client_indices[1]]
    assert len(rows) == 10
    for size, expected in ((None, [rows]), (4, [rows[:4], rows[4:8], rows[8:]])):
        got = list(dm.client_full_dataloader(1, size))
        assert len(got) == len(expected)
        for batch, chunk in zip(got, expected):
            _equal_batches(batch, dict_collate([user.train[i] for i in chunk]))
    with pytest.raises(ValueError, match="batch_size=0"):
        dm.client_full_dataloader(1, 0)
    with pytest.raises(IndexError, match="client_id 4"):
        dm.client_full_dataloader(4)
    with pytest.raises(ValueError, match="batch_size=0"):
        dm.evaluation_dataloader("train", batch_size=0)
    with pytest.raises(ValueError, match="split='validation'"):
        dm.evaluation_dataloader("validation")


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["FedDANE", "Mime", "MimeLite"])
def test_full_batch_gradients_read_the_users_collate_in_every_mode(strategy):
    """FedDANE's gradient phase and Mime's full gradient compute each client's gradient over all its samples: the
    model gets batches of the user's collate_fn there too (Net refuses other keys), and vectorized and auto equal
    sequential."""
    from fedlightning.callbacks import FedDANE, Mime, MimeLite

    make = {"FedDANE": lambda: FedDANE(mu=0.1), "Mime": lambda: Mime(momentum=0.5), "MimeLite": MimeLite}[strategy]
    out = {}
    for mode in ("sequential", "vectorized", "auto"):
        dm = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
        loop = FederatedLoop(Net("dict"), local_steps=3, clients_per_round=3, seed=0, client_execution=mode)
        make_trainer(3, callbacks=[make()]).fit(loop, datamodule=dm)
        out[mode] = _weights(loop)
    assert_close64(out["vectorized"], out["sequential"])
    assert_close64(out["auto"], out["sequential"])
    assert not torch.equal(out["sequential"], _weights(FederatedLoop(Net("dict"))))  # it trained


def test_global_evaluation_reads_the_users_collate_and_weights_batches_by_their_size():
    """GlobalEvaluation of a user's module (not a Classifier) on dict batches of the user's collate_fn: the loss is
    the sample-weighted mean of training_step's batch means over the clients' training rows (batches of 3 over 40
    rows: the last one holds 1), as a float64 hand computation gives it."""
    from fedlightning.callbacks import GlobalEvaluation

    dm = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    dm.setup()
    net = Net("dict")
    got = GlobalEvaluation(split="train", batch_size=3).evaluate(net, dm, torch.device("cpu"))
    rows = torch.as_tensor(dm.training_rows())
    assert len(rows) == 40
    with torch.no_grad():
        expected = F.cross_entropy(net.lin(X[rows]), Y[rows]).item()
    assert got.keys() == {"train_eval/loss"}
    assert abs(got["train_eval/loss"] - expected) <= 1e-12
    # split="val": the module's own validation set (rows 100-109), which from_datamodule keeps as val=
    val = GlobalEvaluation(split="val", batch_size=4).evaluate(net, dm, torch.device("cpu"))
    with torch.no_grad():
        expected = F.cross_entropy(net.lin(X[100:110]), Y[100:110]).item()
    assert abs(val["val_eval/loss"] - expected) <= 1e-12


# ------------------------------------------------------------------------------------------------ drop_last
def _sized(drop_last, sizes=(3, 6, 10), **kw):
    n = sum(sizes)
    return FederatedDataModule.from_datasets(
        TensorDataset(X[:n], Y[:n]),
        partition=Sizes(sizes),
        num_clients=len(sizes),
        batch_size=4,
        val_fraction=0,
        seed=0,
        drop_last=drop_last,
        **kw,
    )


@pytest.mark.parametrize("in_memory", ["auto", False])
def test_drop_last_drops_each_epochs_partial_batch_and_keeps_clients_smaller_than_a_batch(in_memory):
    dm = _sized(True, in_memory=in_memory)
    dm.setup()
    for c, (n, start) in enumerate(((3, 0), (6, 3), (10, 9))):
        gen = torch.Generator().manual_seed(derive_seed(5, "data", 1, c))
        perm = (start + torch.randperm(n, generator=gen)).tolist()  # the client's shuffled epoch
        kept = perm if n < 4 else perm[: n - n % 4]  # a client smaller than a batch keeps its samples
        loader = dm.client_dataloader(c, round=1, seed=5)
        rows = [b[0] for b in loader]
        assert len(loader) == len(rows) == max(1, n // 4)
        got = [int(torch.nonzero((X[: sum((3, 6, 10))] == x).all(1))[0]) for b in rows for x in b]
        assert got == kept
    # without drop_last the partial batches are served
    dm = _sized(False, in_memory=in_memory)
    dm.setup()
    assert [len(b[0]) for b in dm.client_dataloader(1, round=1, seed=5)] == [4, 2]


def test_drop_last_round_index_equals_iterating_the_samplers():
    dm = _sized(True)
    dm.setup()
    assert dm.in_memory
    for steps in (1, 3, 7):
        samplers = [dm.client_dataloader(c, 0, seed=0).batch_sampler for c in (2, 0, 1)]
        index, sizes, widths = _round_index(samplers, steps)
        samplers = [dm.client_dataloader(c, 0, seed=0).batch_sampler for c in (2, 0, 1)]
        per_client = [_sampler_batches(s, steps) for s in samplers]
        assert {len(b) for batches in per_client for b in batches} == {3, 4}  # no partial batch of 2
        offset = 0
        for k in range(steps):
            chunks = [batches[k] for batches in per_client]
            assert sizes[k].tolist() == [len(c) for c in chunks] and widths[k] == 4
            matrix = np.concatenate(chunks)[_padded_positions([len(c) for c in chunks])]
            np.testing.assert_array_equal(index[offset : offset + matrix.size].reshape(matrix.shape), matrix)
            offset += matrix.size
        assert offset == index.size


@pytest.mark.numerics
@pytest.mark.parametrize("in_memory", ["auto", False])
def test_drop_last_vectorized_and_auto_equal_sequential(in_memory):
    seq = _fit(_sized(True, in_memory=in_memory), "pair", local_steps=5)
    assert set(seq.seen) == {3, 4}  # client 0's 3 samples, else whole batches: no partial batch of 2
    kept = _fit(_sized(False, in_memory=in_memory), "pair", local_steps=5)
    assert 2 in kept.seen
    assert not torch.equal(_weights(kept), _weights(seq))
    for mode in ("vectorized", "auto"):
        assert_close64(_weights(_fit(_sized(True, in_memory=in_memory), "pair", mode, local_steps=5)), _weights(seq))


# ------------------------------------------------------------------------------------------- tuples, 3-tuples
@pytest.fixture(scope="module")
def scaled_reference():
    """The bundled in-memory path on pair samples whose inputs are pre-scaled by ``w`` (the reference)."""
    dm = FederatedDataModule.from_datasets(
        ArrayDataset(X[:60] * W[:60, None], Y[:60]),
        partition=IID(),
        num_clients=4,
        batch_size=4,
        val_fraction=0,
        seed=0,
    )
    return _weights(_fit(dm, "pair"))


@pytest.mark.numerics
@pytest.mark.parametrize("arity", [2, 3])
def test_tuples_and_triples_in_every_mode(arity, scaled_reference):
    def dm():
        return FederatedDataModule.from_datasets(
            Tuples(60, arity), partition=IID(), num_clients=4, batch_size=4, val_fraction=0, seed=0, in_memory=False
        )

    kind = "pair" if arity == 2 else "triple"
    seq = _fit(dm(), kind)
    if arity == 3:  # x * w in training_step: the same computation as the pre-scaled in-memory pairs
        assert torch.equal(_weights(seq), scaled_reference)
    else:
        assert not torch.equal(_weights(seq), scaled_reference)
    for mode in ("vectorized", "auto"):
        assert_close64(_weights(_fit(dm(), kind, mode)), _weights(seq))


# ---------------------------------------------------------------------------------------------------- resume
def _dict_run(callbacks=(), **kw):
    dm = FederatedDataModule.from_datasets(
        Dicts(48), partition=IID(), num_clients=6, batch_size=4, val_fraction=0, seed=0, collate_fn=dict_collate
    )
    loop = FederatedLoop(Net("dict"), local_steps=3, clients_per_round=3, seed=1)
    trainer = make_trainer(3, callbacks=list(callbacks), plugins=[AtomicCheckpointIO()], **kw)
    return loop, dm, trainer


def test_resumed_dict_collate_run_equals_the_uninterrupted_run(tmp_path):
    loop, dm, trainer = _dict_run()
    trainer.fit(loop, datamodule=dm)
    full = _weights(loop)
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    loop, dm, trainer = _dict_run([ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(loop, datamodule=dm)
    path = str(tmp_path / "ck" / "step=1.ckpt")
    assert os.path.exists(path)
    loop, dm, trainer = _dict_run()
    trainer.fit(loop, datamodule=dm, ckpt_path=path, weights_only=True)
    assert trainer.global_step == 3
    resumed = _weights(loop)
    assert torch.equal(resumed, full)
    # training moved the weights
    assert not torch.equal(resumed, torch.nn.utils.parameters_to_vector(Net("dict").parameters()))
