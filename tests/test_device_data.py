"""In-memory client data for vectorised rounds: gathered by index where the model is, without per-client loaders.

A vectorised round over an ``ArrayDataset`` builds no client DataLoader: it reads each client's index batches from
``client_batch_sampler`` and gathers the rows of all clients from the data set's copy on the model's device
(``ArrayDataset.on_device``; on a CPU the tensors themselves). The reference is each client's own loader
(``client_dataloader``, re-iterated for new epochs as sequential training does): every client's batch of every step
must be bit for bit the loader's, in the same order, both when the round's rows are gathered at once and step by
step.
"""

import numpy as np
import pytest
import torch

from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.datamodules.base import reiterate
from fedlightning.vectorized.batches import _DeviceTransfer, _RoundBatches

ROUND, SEED, K = 3, 7, 9


def digits(**kwargs):
    dm = DigitsDataModule(num_clients=30, batch_size=16, partition=Dirichlet(0.3), seed=0, **kwargs)
    dm.setup("fit")
    return dm


def loader_batches(dm, client_id):
    return list(reiterate(dm.client_dataloader(client_id, ROUND, seed=SEED), K))


@pytest.mark.parametrize("round_gather", [True, False], ids=["round-gather", "per-step"])
def test_batches_equal_the_loaders_without_building_one(monkeypatch, round_gather):
    dm = digits()
    clients = [0, 5, 11, 17, 29]
    expected = {c: loader_batches(dm, c) for c in clients}
    assert len({len(b[0]) for c in clients for b in expected[c]}) > 1  # unequal batch sizes: padded steps

    def no_loader(*args, **kwargs):
        raise AssertionError("a client loader was built")

    monkeypatch.setattr(FederatedDataModule, "client_dataloader", no_loader)
    if not round_gather:
        monkeypatch.setattr(_RoundBatches, "ROUND_GATHER_BYTES", 0)
    moved = []

    def to_device(batch):
        moved.append([t.device for t in batch])
        return batch

    batches = _RoundBatches(dm, clients, ROUND, SEED, K, _DeviceTransfer(to_device, torch.device("cpu")))
    assert batches.fast and batches.x is dm.train_dataset.x  # on the CPU: the data set's own tensors, not a copy
    for k in range(K):
        (x, y), _, sizes = batches.step(k)
        for i, c in enumerate(clients):
            ex, ey = expected[c][k]
            assert sizes[i] == len(ey)
            assert torch.equal(x[i, : sizes[i]], ex) and torch.equal(y[i, : sizes[i]], ey), (k, c)
            pad = np.arange(x.shape[1]) % sizes[i]  # padding repeats the client's own rows
            assert torch.equal(x[i], ex[pad]) and torch.equal(y[i], ey[pad])
    assert len(moved) == (1 if round_gather else K)


def test_other_data_keep_their_loaders():
    """A collate_fn (or reference mode, or an overridden client_dataloader) keeps the per-client loader path."""
    dm = digits()
    assert dm.in_memory_train_data() is dm.train_dataset
    dm.collate_fn = lambda rows: rows
    assert dm.in_memory_train_data() is None

    class OwnLoaders(DigitsDataModule):
        def client_dataloader(self, client_id, round=0, seed=None):
            return super().client_dataloader(client_id, round, seed)

    own = OwnLoaders(num_clients=30, batch_size=16, partition=Dirichlet(0.3), seed=0)
    own.setup("fit")
    assert own.in_memory_train_data() is None


def test_sampler_is_the_loaders():
    dm = digits()
    for c in (0, 3):
        ours = [i.tolist() for i in dm.client_batch_sampler(c, ROUND, SEED)]
        theirs = [i.tolist() for i in dm.client_dataloader(c, ROUND, seed=SEED).batch_sampler]
        assert ours == theirs


def test_on_device_copies_once():
    x, y = torch.arange(12.0).view(6, 2), torch.arange(6)
    ds = ArrayDataset(x, y)
    assert ds.on_device("cpu")[0] is x  # already there: no copy
    copy = ds.on_device("meta")  # another device (meta: shapes only, available on any machine)
    assert copy[0].device.type == "meta" and copy[0].shape == x.shape and copy[1].dtype == y.dtype
    assert ds.on_device(torch.device("meta"))[0] is copy[0]  # made once
