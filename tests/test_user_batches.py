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
    with pytest.raises(Exception, match=r"^round \d+: .*leaf batch\['inputs'\]\['seq'\] has shape"):
        _fit(True, "vectorized")  # the round is named: batches may stop stacking in a later round


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


# ---------------------------------------------------------------------------------------------------------------------
# the data module's batch-transfer hooks (Lightning sends a data module's batches through its own hooks)

M = 40


class Pixels(Dataset):
    """uint8 "images" of 4 pixels and a class label; ``scaled``: the same images as float64 / 255."""

    def __init__(self, scaled=False):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 256, (M, 4), generator=g, dtype=torch.uint8)
        self.scaled = scaled

    def __len__(self):
        return M

    def __getitem__(self, i):
        x = self.x[i].double() / 255 if self.scaled else self.x[i]
        return x, i % 2


CALLS = []


def _scale(batch, where):
    x, y = batch
    CALLS.append((where, x.dtype))
    return (x.double() / 255, y)


class PixelNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 4, dtype=torch.float64))

    def _loss(self, batch):
        x, y = batch
        assert x.dtype == torch.float64  # the hooks ran before the step
        return torch.nn.functional.binary_cross_entropy_with_logits(x @ self.w, y.double())

    def training_step(self, batch, batch_idx):
        CALLS.append(("train", None))
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        CALLS.append(("val", None))
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        CALLS.append(("test", None))
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ScalingDataModule(pl.LightningDataModule):
    """A plain Lightning data module that scales its uint8 images on the device, in on_after_batch_transfer, and
    reads its Trainer there as a data module trained directly does."""

    def __init__(self):
        super().__init__()
        self.data = Pixels()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=8)

    def test_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=8)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        CALLS.append(("before", batch[0].dtype))
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx):
        assert isinstance(self.trainer, pl.Trainer)
        return _scale(batch, "after")


def _pixel_run(dm, mode="sequential", model_cls=PixelNet):
    CALLS.clear()
    torch.manual_seed(0)
    model = model_cls()
    loop = FederatedLoop(model, local_steps=3, clients_per_round=3, seed=0, client_execution=mode)
    trainer = make_trainer(2, limit_val_batches=1.0, val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(loop, datamodule=dm)
    trainer.test(loop, datamodule=dm, verbose=False)
    return model.w.detach().clone(), list(CALLS)


def _wrapped(kind):
    from fedlightning.datamodules import WrappedDataModule

    options = dict(partition=IID(), num_clients=4, seed=0)
    if kind == "from_datamodule":
        return FederatedDataModule.from_datamodule(ScalingDataModule(), **options)
    return WrappedDataModule(ScalingDataModule(), **options)


def _reference_weights():
    """The same clients and batches with the images scaled in the data set: no hook anywhere."""
    dm = FederatedDataModule.from_datasets(
        Pixels(scaled=True), Pixels(scaled=True), num_clients=4, batch_size=4, partition=IID(), seed=0, val=Pixels(True)
    )
    return _pixel_run(dm)[0]


@pytest.mark.parametrize("kind", ["from_datamodule", "WrappedDataModule"])
def test_a_wrapped_data_modules_transfer_hooks_run_for_every_client_validation_and_test_batch(kind):
    """Lightning sends a data module's batches through its on_before_batch_transfer / on_after_batch_transfer;
    wrapped for federated training, every local step (2 rounds x 3 clients x 3 steps), validation batch (the sanity
    check's and round 2's) and test batch goes through them once, and training equals the same data scaled in the
    data set."""
    w, calls = _pixel_run(_wrapped(kind))
    steps = [c[0] for c in calls if c[0] in ("train", "val", "test")]
    assert (steps.count("train"), steps.count("val"), steps.count("test")) == (18, 2, 1)
    assert [c[0] for c in calls].count("before") == [c[0] for c in calls].count("after") == len(steps)
    assert all(dtype == torch.uint8 for where, dtype in calls if where in ("before", "after"))
    assert torch.equal(w, _reference_weights())


def test_a_federated_data_module_subclass_may_override_the_transfer_hooks():
    """A FederatedDataModule subclass's own on_after_batch_transfer gets client, validation and test batches, never
    the round's plan (Lightning calls it on the loop's training "batch" too)."""

    from fedlightning.datamodules import DatasetDataModule

    class Scaling(DatasetDataModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return _scale(batch, "after")

    dm = Scaling(Pixels(), Pixels(), num_clients=4, batch_size=4, partition=IID(), seed=0, val=Pixels())
    w, calls = _pixel_run(dm)
    steps = [c[0] for c in calls if c[0] in ("train", "val", "test")]
    assert steps.count("train") == 18 and steps.count("val") >= 1 and steps.count("test") >= 1
    assert [c[0] for c in calls].count("after") == len(steps)
    assert torch.equal(w, _reference_weights())


def test_the_data_modules_transfer_hook_wins_over_the_modules_and_vectorized_refuses_it_by_name():
    """Lightning's rule: a hook both override is the data module's. Vectorized clients cannot call per-client hooks
    and say whose they are; auto trains sequentially."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    class ModuleScales(PixelNet):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            raise AssertionError("the data module's hook wins")

    w, _ = _pixel_run(_wrapped("WrappedDataModule"), model_cls=ModuleScales)
    assert torch.equal(w, _reference_weights())
    with pytest.raises(
        VectorizationUnsupportedError, match=r"data module DatasetDataModule overrides the batch-transfer"
    ):
        _pixel_run(_wrapped("from_datamodule"), mode="vectorized")
    assert torch.equal(_pixel_run(_wrapped("from_datamodule"), mode="auto")[0], w)
