"""A module with lazy layers (``LazyLinear``, ...), written for plain Lightning, trains federatedly unchanged: the
loop gives them their parameters before round 0 by one dry ``training_step`` on the first client's first batch
(``fedlightning.user_module.materialize_lazy_modules``), and nothing else of the run changes.

Reference: the same module built eagerly, started from the lazy run's initial weights; both runs must end equal in
float64, BatchNorm statistics, logged metrics and a resumed run included."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.checkpoint import AtomicCheckpointIO
from fedlightning.datamodules import IID, FederatedDataModule

g = torch.Generator().manual_seed(0)
X = torch.randn(120, 6, dtype=torch.float64, generator=g)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()


def _dm():
    return FederatedDataModule.from_datasets(
        TensorDataset(X, Y), partition=IID(), num_clients=6, batch_size=5, val_fraction=0, seed=0
    )


class Net(pl.LightningModule):
    """BatchNorm in front of the lazy layers (eval mode must leave its statistics alone), a metric and a log call
    (the dry run must leave no trace in them)."""

    def __init__(self, lazy=True, unused_lazy=False, fail=False):
        super().__init__()
        self.bn = nn.BatchNorm1d(6, dtype=torch.float64)
        self.body = nn.LazyLinear(8, dtype=torch.float64) if lazy else nn.Linear(6, 8, dtype=torch.float64)
        self.head = nn.LazyLinear(3, dtype=torch.float64) if lazy else nn.Linear(8, 3, dtype=torch.float64)
        self.spare = nn.LazyLinear(2, dtype=torch.float64) if unused_lazy else None
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.fail = fail

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fail:
            raise KeyError("no such field")
        self.log("rows", float(len(y)))
        logits = self.head(torch.tanh(self.body(self.bn(x))))
        self.acc(logits, y)
        self.log("acc", self.acc)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class InitialWeights(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


class Metrics(pl.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("client/")})


def _fit(net, mode="sequential", rounds=3, seed=0, callbacks=(), ckpt_path=None, **kw):
    loop = FederatedLoop(net, local_steps=3, clients_per_round=3, seed=seed, client_execution=mode)
    trainer = make_trainer(rounds, callbacks=list(callbacks), plugins=[AtomicCheckpointIO()], **kw)
    trainer.fit(loop, datamodule=_dm(), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _eager_from(state):
    net = Net(lazy=False)
    net.load_state_dict(state)
    return net


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_lazy_module_trains_as_the_eager_module_from_the_same_start(mode):
    start, metrics = InitialWeights(), Metrics()
    lazy = _fit(Net(), mode, callbacks=[start, metrics])
    assert type(start.state["body.weight"]) is torch.Tensor and start.state["body.weight"].shape == (8, 6)
    assert torch.equal(start.state["bn.running_mean"], torch.zeros(6, dtype=torch.float64))  # the dry run: eval mode
    eager_metrics = Metrics()
    eager = _fit(_eager_from(start.state), mode, callbacks=[eager_metrics])
    assert set(lazy) == set(eager)
    for k in lazy:
        torch.testing.assert_close(lazy[k], eager[k], rtol=1e-12, atol=0, msg=k)
    assert not torch.equal(lazy["body.weight"], start.state["body.weight"])  # it trained
    assert metrics.rows == eager_metrics.rows and metrics.rows[0]["client/rows"] > 0


def test_the_lazy_initial_weights_come_from_the_seed():
    def start(seed):
        cb = InitialWeights()
        _fit(Net(), rounds=1, seed=seed, callbacks=[cb])
        return cb.state["head.weight"]

    assert torch.equal(start(0), start(0))
    assert not torch.equal(start(0), start(1))


def test_a_resumed_lazy_run_equals_the_uninterrupted_run(tmp_path):
    full = _fit(Net(), rounds=4)
    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(Net(), rounds=2, callbacks=[ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    resumed = _fit(Net(), rounds=4, ckpt_path=str(tmp_path / "step=2.ckpt"))
    for k in full:
        assert torch.equal(resumed[k], full[k]), k


def test_a_lazy_module_training_step_does_not_reach_is_named():
    with pytest.raises(ValueError, match=r"lazy modules spare are still uninitialized after one training_step"):
        _fit(Net(unused_lazy=True), rounds=1)


def test_a_training_step_that_raises_in_the_dry_run_is_named_with_its_cause():
    with pytest.raises(RuntimeError, match=r"has lazy modules \(body, head\).*raised KeyError") as err:
        _fit(Net(fail=True), rounds=1)
    assert isinstance(err.value.__cause__, KeyError)
