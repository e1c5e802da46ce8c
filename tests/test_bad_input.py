"""Impossible configurations fail early with an error that names the bad value."""

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP, Classifier


def test_more_clients_per_round_than_clients():
    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=30, local_steps=2)
    dm = DigitsDataModule(num_clients=10)
    with pytest.raises(ValueError, match="clients_per_round=30"):
        make_trainer(1).fit(loop, datamodule=dm)


@pytest.mark.parametrize("k", [0, -3, 1.5, True])
def test_bad_local_steps(k):
    with pytest.raises(ValueError, match="local_steps"):
        FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=k)


@pytest.mark.parametrize("c", [0, -1])
def test_bad_clients_per_round(c):
    with pytest.raises(ValueError, match="clients_per_round"):
        FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=c)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_clients": 0}, "num_clients"),
        ({"batch_size": 0}, "batch_size"),
        ({"test_fraction": 1.5}, "test_fraction"),
    ],
)
def test_bad_datamodule_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kw)


def test_bad_alpha_in_datamodule():
    with pytest.raises(ValueError, match="alpha=-0.5"):
        DigitsDataModule(partition=Dirichlet(alpha=-0.5))


def test_bad_strategy_args():
    with pytest.raises(ValueError, match="server_lr"):
        FedAvg(server_lr=0)
    with pytest.raises(ValueError, match="weighting"):
        FedAvg(weighting="by_size")


class NoLoss(Classifier):
    def __init__(self):
        super().__init__(num_classes=10)
        self.net = torch.nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        self(batch[0]).sum()  # forgets to return the loss


def test_training_step_without_loss_is_a_clear_error():
    loop = FederatedLoop(NoLoss(), clients_per_round=2, local_steps=1, on_client_failure="raise")
    with pytest.raises(RuntimeError, match="NoLoss.training_step returned None for every local step of every client"):
        make_trainer(1).fit(loop, datamodule=DigitsDataModule(num_clients=5))


def test_two_strategies_is_a_clear_error():
    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=2, local_steps=1)
    with pytest.raises(ValueError, match="only one server strategy"):
        make_trainer(1, callbacks=[FedAvg(), FedAvg(server_lr=0.5)]).fit(
            loop, datamodule=DigitsDataModule(num_clients=5)
        )


def test_default_strategy_is_fedavg():
    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=2, local_steps=1)
    trainer = make_trainer(1)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=5))
    assert type(loop.strategy) is FedAvg and loop.strategy in trainer.callbacks


def test_not_a_federated_datamodule():
    import lightning.pytorch as pl

    class Plain(pl.LightningDataModule):
        def train_dataloader(self):
            return [0]

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=2, local_steps=1)
    with pytest.raises(TypeError, match="needs a FederatedDataModule"):
        make_trainer(1).fit(loop, datamodule=Plain())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"gradient_clip_val": 1.0}, r"gradient_clip_val=1.0.*model\.client_grad_clip"),
        ({"gradient_clip_val": 0.3, "gradient_clip_algorithm": "value"}, r"gradient_clip_algorithm='value'"),
        ({"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2.*data\.batch_size"),
    ],
)
def test_lightning_step_settings_name_the_federated_setting_before_round_0(kw, match):
    """Lightning's own step settings would stop the fit with advice to switch to automatic optimization; the loop
    names the setting that does the job instead, before any round, and only for a fit (validation ignores them)."""
    from fedlightning._validation import SettingError

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), clients_per_round=2, local_steps=1)
    dm = DigitsDataModule(num_clients=10)
    trainer = make_trainer(2, **kw)
    with pytest.raises(SettingError, match=match):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 0
    metrics = make_trainer(2, limit_val_batches=2, **kw).validate(loop, datamodule=dm, verbose=False)
    assert metrics and all(v == v for v in metrics[0].values())
