"""``FederatedLoop(init_weights=...)``: federated training that starts from weights trained before (a model
trained centrally with plain Lightning, a ``torch.save``d state dict, a federated run's checkpoint). Reference: the
weights in the file itself; the global model must hold exactly them when round 0 starts."""

import enum
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.checkpoint import AtomicCheckpointIO, CheckpointError
from fedlightning.datamodules import IID, FederatedDataModule

g = torch.Generator().manual_seed(0)
X = torch.randn(120, 6, generator=g)
Y = (X[:, 0] > 0).long()


class Net(pl.LightningModule):
    def __init__(self, hidden=8):
        super().__init__()
        self.body = torch.nn.Linear(6, hidden)
        self.norm = torch.nn.BatchNorm1d(hidden)
        self.head = torch.nn.Linear(hidden, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.relu(self.norm(self.body(x)))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


class StartWeights(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def _pretrained(tmp_path):
    """A Net trained centrally for 5 steps with plain Lightning, and its checkpoint."""
    torch.manual_seed(1)
    net = Net()
    trainer = pl.Trainer(
        max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(net, DataLoader(TensorDataset(X, Y), batch_size=16))
    path = str(tmp_path / "central.ckpt")
    trainer.save_checkpoint(path)
    return net, path


def _fit(init_weights, rounds=1, ckpt_path=None, callbacks=(), **kw):
    torch.manual_seed(2)  # other initial weights than the pretrained net's
    net, start = Net(), StartWeights()
    dm = FederatedDataModule.from_datasets(TensorDataset(X, Y), partition=IID(), num_clients=6, batch_size=8, seed=0)
    loop = FederatedLoop(net, local_steps=2, clients_per_round=3, seed=0, init_weights=init_weights)
    trainer = make_trainer(rounds, callbacks=[start, *callbacks], plugins=[AtomicCheckpointIO()], **kw)
    trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return net, start.state


def test_a_plain_lightning_checkpoint_and_a_state_dict_start_the_global_model(tmp_path):
    central, path = _pretrained(tmp_path)
    expected = central.state_dict()
    for source in (path, _saved_state_dict(central, tmp_path)):
        _, start = _fit(source)
        assert set(start) == set(expected)
        assert all(torch.equal(start[k], expected[k]) for k in expected)  # weights and BatchNorm statistics
    _, default = _fit(None)
    assert not torch.equal(default["body.weight"], expected["body.weight"])


def _saved_state_dict(net, tmp_path):
    path = str(tmp_path / "weights.pt")
    torch.save(net.state_dict(), path)
    return path


def test_a_federated_checkpoint_starts_the_global_model_from_its_global_model(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trained, _ = _fit(None, rounds=2, callbacks=[ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    _, start = _fit(str(tmp_path / "step=2.ckpt"))
    assert all(torch.equal(start[k], v) for k, v in trained.state_dict().items())


def test_load_global_model_gives_your_module_the_trained_global_model(tmp_path):
    """A federated run's checkpoint into a fresh instance of the user's module: its state equals the trained global
    model's (weights and BatchNorm statistics) and it predicts as that model does; a module of another shape is
    named, as for init_weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fedlightning.checkpoint import global_model_state, load_global_model

    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trained, _ = _fit(None, rounds=2, callbacks=[ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    path = str(tmp_path / "step=2.ckpt")
    torch.manual_seed(5)
    fresh = Net()
    assert not torch.equal(fresh.body.weight, trained.body.weight)
    loaded = load_global_model(path, fresh)
    assert loaded is fresh
    expected = trained.state_dict()
    assert set(global_model_state(path)) == set(expected)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    fresh.eval()
    trained.eval()
    with torch.no_grad():
        assert torch.equal(
            fresh.head(torch.relu(fresh.norm(fresh.body(X)))), trained.head(torch.relu(trained.norm(trained.body(X))))
        )
    with pytest.raises(
        CheckpointError, match=r"different shapes \(checkpoint vs model\): body.weight \(8, 6\) vs \(16, 6\)"
    ):
        load_global_model(path, Net(hidden=16))


def test_a_checkpoint_of_another_architecture_or_a_missing_file_is_named(tmp_path):
    torch.manual_seed(0)
    wide = Net(hidden=16)
    path = str(tmp_path / "wide.pt")
    torch.save(wide.state_dict(), path)
    with pytest.raises(
        CheckpointError, match=r"different shapes \(checkpoint vs model\): body.weight \(16, 6\) vs \(8, 6\)"
    ):
        _fit(path)
    with pytest.raises(CheckpointError, match=r"file not found \(model.init_weights\)"):
        _fit(str(tmp_path / "nowhere.ckpt"))
    torch.save({"lr": 0.1}, str(tmp_path / "not_weights.pt"))
    with pytest.raises(CheckpointError, match=r"holds no state dict of tensors"):
        _fit(str(tmp_path / "not_weights.pt"))


def test_a_resumed_run_takes_the_resumed_weights_without_reading_init_weights(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    central, path = _pretrained(tmp_path)
    full, _ = _fit(path, rounds=3)
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(path, rounds=1, callbacks=[ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    os.remove(path)  # the resumed run does not need it
    resumed, _ = _fit(path, rounds=3, ckpt_path=str(tmp_path / "ck" / "step=1.ckpt"))
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in full.state_dict().items())


class Settings:
    """A custom object in a checkpoint (hyper-parameters of a central run): the safe reader admits no such type."""

    def __init__(self, lr):
        self.lr = lr


def test_a_checkpoint_that_needs_code_is_refused_with_the_state_dict_way_out(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "with_object.ckpt")
    torch.save({"state_dict": Net().state_dict(), "hyper_parameters": {"settings": Settings(0.1)}}, path)
    with pytest.raises(
        CheckpointError, match=r"needs the type .*Settings.*torch\.save\(module\.state_dict\(\), file\)"
    ):
        _fit(path)


class Mode(enum.Enum):
    WIDE = "wide"


class EnumNet(Net):
    def __init__(self, mode: Mode = Mode.WIDE):
        super().__init__()
        self.save_hyperparameters()


def test_load_global_model_reads_a_trusted_file_that_needs_other_types_when_told_to(tmp_path):
    """A central Lightning checkpoint whose save_hyperparameters() holds an Enum: refused by default naming the type
    and the argument that opts in, read with weights_only=False (the argument the message names exists); a missing
    file is named as such."""
    from fedlightning.checkpoint import global_model_state, load_global_model

    torch.manual_seed(0)
    central = EnumNet()
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(central, DataLoader(TensorDataset(X, Y), batch_size=30))
    path = str(tmp_path / "central.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"needs the type .*Mode.*weights_only=False"):
        load_global_model(path, EnumNet())
    with pytest.warns(UserWarning, match="central.ckpt"):
        loaded = load_global_model(path, EnumNet(), weights_only=False)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in central.state_dict().items())
    with pytest.raises(CheckpointError, match=r"checkpoint .*absent.ckpt: file not found"):
        global_model_state(str(tmp_path / "absent.ckpt"))
