"""Fault injection: NaN losses and raising clients follow the documented failure policy."""

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import Dirichlet, DigitsDataModule, FederatedDataModule, ArrayDataset
from fedlightning.models import MLP


class Faulty(MLP):
    """Returns NaN (or raises) while training the chosen clients in the chosen rounds."""

    def __init__(self, bad_clients=(), bad_rounds=None, mode="nan"):
        super().__init__(input_dim=64, hidden=[8])
        self.bad_clients, self.bad_rounds, self.mode = set(bad_clients), bad_rounds, mode
        self.current = None  # (round, client) set by the test callback

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        r, c = self.current
        if c in self.bad_clients and (self.bad_rounds is None or r in self.bad_rounds):
            if self.mode == "raise":
                raise RuntimeError("injected failure")
            if self.mode == "inf_update":
                return loss * float("inf")
            return loss * float("nan")
        return loss


class Tracker(Callback):
    """Tells the worker model which (round, client) is training (tests only)."""

    def __init__(self):
        self.seen = []

    def client_objective(self, loop, plan, client_id):
        loop._worker_trainer().model.current = (plan.round, client_id)
        self.seen.append((plan.round, client_id))
        return []


class Spy(FedAvg):
    def __init__(self):
        super().__init__()
        self.results = []

    def on_round_end(self, trainer, loop, result):
        self.results.append(result)


def _fit(model, rounds=3, policy="skip", clients=6, cpr=3):
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=cpr, seed=0, on_client_failure=policy)
    spy, tracker = Spy(), Tracker()
    dm = DigitsDataModule(num_clients=clients, batch_size=16, partition=Dirichlet(1.0), seed=0)
    trainer = make_trainer(rounds, callbacks=[spy, tracker])
    return loop, spy, tracker, trainer, dm


@pytest.mark.parametrize("mode", ["nan", "raise", "inf_update"])
def test_skip_policy_aggregates_only_healthy_clients(mode):
    model = Faulty(bad_clients={0, 1, 2}, mode=mode)
    loop, spy, tracker, trainer, dm = _fit(model)
    with pytest.warns(UserWarning, match="skipped"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 3
    w = torch.nn.utils.parameters_to_vector(loop.model.parameters())
    assert torch.isfinite(w).all()
    for res in spy.results:
        bad = sum(1 for c in res.plan.client_ids if c in {0, 1, 2})
        assert res.num_failed == bad and res.num_clients == 3 - bad
        assert res.metrics["round/failed_clients"] == bad
    assert loop.failed_clients_total == sum(r.num_failed for r in spy.results) > 0


def test_skipping_equals_training_without_the_bad_clients():
    """With one NaN client, the new global model is FedAvg over the remaining clients only."""
    torch.manual_seed(0)
    base = Faulty(bad_clients=set())
    bad_model = copy.deepcopy(base)
    bad_model.bad_clients = {3}
    loop_bad, spy, tracker, trainer, dm = _fit(bad_model, rounds=1, clients=6, cpr=6)
    with pytest.warns(UserWarning):
        trainer.fit(loop_bad, datamodule=dm)
    # reference: the same round, computed client by client with the loop's own client trainer, leaving client 3 out
    fresh = copy.deepcopy(base)
    loop2, _, _, tr2, dm2 = _fit(fresh, rounds=0, clients=6, cpr=6)
    tr2.fit(loop2, datamodule=dm2)  # zero rounds: only sets the loop up
    assert tr2.global_step == 0
    plan = dm2.round_plan(0)
    g = torch.nn.utils.parameters_to_vector(fresh.parameters()).detach().clone()
    total, acc = 0.0, torch.zeros_like(g)
    for cid in plan.client_ids:
        if cid == 3:
            continue
        loop2._worker_trainer().model.current = (0, cid)
        u = loop2.train_client(plan, cid, g)
        acc += u.num_samples * u.delta
        total += u.num_samples
    expected = g - acc / total
    got = torch.nn.utils.parameters_to_vector(loop_bad.model.parameters()).detach()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_no_healthy_client_leaves_model_unchanged():
    model = Faulty(bad_clients=set(range(6)))
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    loop, spy, tracker, trainer, dm = _fit(model, rounds=2)
    with pytest.warns(UserWarning, match="no healthy client"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 2  # rounds still advance (the sampler moves on)
    assert torch.equal(torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach(), before)


def test_raise_policy_names_client_and_round():
    model = Faulty(bad_clients=set(range(6)), bad_rounds={1})
    loop, spy, tracker, trainer, dm = _fit(model, policy="raise")
    with pytest.raises((RuntimeError, FloatingPointError), match=r"client \d+ failed in round 1"):
        trainer.fit(loop, datamodule=dm)


class Small(FederatedDataModule):
    """Clients with 1-3 samples (fewer than the batch size), one class each."""

    def load(self):
        x = torch.rand(8, 64)
        y = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4])
        return ArrayDataset(x, y), ArrayDataset(x, y), y.numpy()

    def natural_clients(self):
        import numpy as np

        return [np.array([0, 1]), np.array([2]), np.array([3, 4, 5]), np.array([6]), np.array([7])]


def test_tiny_single_class_clients_train_with_partial_batches():
    loop = FederatedLoop(MLP(input_dim=64, hidden=[4], num_classes=5), local_steps=4, clients_per_round=5)
    trainer = make_trainer(2)
    trainer.fit(loop, datamodule=Small(num_clients=5, batch_size=50))
    assert trainer.global_step == 2
    assert torch.isfinite(torch.nn.utils.parameters_to_vector(loop.model.parameters())).all()
