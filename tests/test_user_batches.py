"""User batch structures: training_step receives the user's collated batch (dicts, padded sequences) in every
client_execution mode; vectorized equals sequential where batches stack and refuses ragged ones by name."""

import re

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import Dataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.datamodules import IID, FederatedDataModule

N = 24


class Seqs(Dataset):
    """Dict samples: a float64 sequence of length 2 + i % 3 (``ragged``) or 4, and a class label."""

    def __init__(self, ragged):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 4, dtype=torch.float64, generator=g)
        self.ragged = ragged

    def __len__(self):
        return N

    def __getitem__(self, i):
        n = 2 + i % 3 if self.ragged else 4
        return {"seq": self.x[i, :n], "label": i % 2}


def pad_collate(samples):
    seqs = torch.nn.utils.rnn.pad_sequence([s["seq"] for s in samples], batch_first=True)
    return {
        "inputs": {"seq": seqs, "length": torch.tensor([len(s["seq"]) for s in samples])},
        "label": torch.tensor([s["label"] for s in samples]),
    }


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 4, dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, dict) and set(batch) == {"inputs", "label"}
        assert set(batch["inputs"]) == {"seq", "length"} and batch["inputs"]["seq"].dim() == 2
        seq = batch["inputs"]["seq"]
        score = seq @ self.w[: seq.shape[1]]
        return torch.nn.functional.binary_cross_entropy_with_logits(score, batch["label"].double())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(ragged, mode):
    dm = FederatedDataModule.from_datasets(
        Seqs(ragged), num_clients=4, batch_size=4, partition=IID(), val_fraction=0, collate_fn=pad_collate
    )
    net = Net()
    make_trainer(2).fit(
        FederatedLoop(net, local_steps=3, clients_per_round=3, seed=0, client_execution=mode), datamodule=dm
    )
    return net.w.detach().clone()


def test_fixed_length_dict_batches_train_the_same_in_every_mode():
    seq = _fit(False, "sequential")
    assert not torch.equal(seq, torch.linspace(-0.5, 0.5, 4, dtype=torch.float64))
    for mode in ("vectorized", "auto"):
        torch.testing.assert_close(_fit(False, mode), seq, rtol=1e-10, atol=0)


def test_ragged_padded_batches_are_refused_by_name_and_auto_falls_back():
    seq = _fit(True, "sequential")
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "training clients sequentially (client_execution='vectorized' "
            "cannot stack the clients' batches of local step"
        ),
    ):
        torch.testing.assert_close(_fit(True, "auto"), seq, rtol=0, atol=0)
    with pytest.raises(Exception, match=r"leaf batch\['inputs'\]\['seq'\] has shape"):
        _fit(True, "vectorized")


class Tagged(Dataset):
    """Dict samples with a string id (the default collate makes a list of strings of it)."""

    def __init__(self):
        self.x = torch.randn(N, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"seq": self.x[i], "label": i % 2, "id": f"sample-{i}"}


def _tagged_collate(samples):  # "weight" only in batches whose first sample is even: structures differ by client
    out = {
        "inputs": {"seq": torch.stack([s["seq"] for s in samples])},
        "label": torch.tensor([s["label"] for s in samples]),
    }
    if int(samples[0]["id"].split("-")[1]) % 2 == 0:
        out["weight"] = torch.ones(len(samples), dtype=torch.float64)
    return out


class TaggedNet(Net):
    def training_step(self, batch, batch_idx):
        seq = batch["inputs"]["seq"] if "inputs" in batch else batch["seq"]
        return torch.nn.functional.binary_cross_entropy_with_logits(seq @ self.w, batch["label"].double())


def _fit_tagged(mode, collate_fn=None):
    dm = FederatedDataModule.from_datasets(
        Tagged(), num_clients=4, batch_size=4, partition=IID(), val_fraction=0, collate_fn=collate_fn
    )
    net = TaggedNet()
    make_trainer(2).fit(
        FederatedLoop(net, local_steps=3, clients_per_round=3, seed=0, client_execution=mode), datamodule=dm
    )
    return net.w.detach().clone()


def test_a_string_leaf_is_refused_by_name_and_auto_falls_back():
    """A string field collates to a list of strings: vectorized names that leaf (not a 'structure' mismatch, which
    the lists' lengths would give), auto trains sequentially and equals sequential training."""
    seq = _fit_tagged("sequential")
    with pytest.raises(Exception, match=r"leaf batch\['id'\]\[0\] of local step 0 is a str\. Leave it out"):
        _fit_tagged("vectorized")
    with pytest.warns(UserWarning, match=r"training clients sequentially .*leaf batch\['id'\]\[0\]"):
        torch.testing.assert_close(_fit_tagged("auto"), seq, rtol=0, atol=0)


def test_batches_of_different_structures_are_refused_naming_the_leaf():
    with pytest.raises(Exception, match=r"structures differ \(leaf batch\['weight'\] is in one client's batch"):
        _fit_tagged("vectorized", _tagged_collate)
    seq = _fit_tagged("sequential", _tagged_collate)
    with pytest.warns(UserWarning, match=r"training clients sequentially .*structures differ"):
        torch.testing.assert_close(_fit_tagged("auto", _tagged_collate), seq, rtol=0, atol=0)
