"""Fault injection: NaN losses and raising clients follow the documented failure policy."""

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
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

    def client_objective(self, trainer, loop, plan, client_id):
        loop.client_worker.model.current = (plan.round, client_id)
        self.seen.append((plan.round, client_id))
        return []


class Spy(FedAvg):
    def __init__(self):
        super().__init__()
        self.results = []

    def on_round_end(self, trainer, loop, result):
        self.results.append(result)


def _fit(model, rounds=3, policy="skip", clients=6, cpr=3, **loop_kwargs):
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=cpr, seed=0, on_client_failure=policy, **loop_kwargs)
    spy, tracker = Spy(), Tracker()
    dm = DigitsDataModule(num_clients=clients, batch_size=16, partition=Dirichlet(1.0), seed=0)
    trainer = make_trainer(rounds, callbacks=[spy, tracker])
    return loop, spy, tracker, trainer, dm


@pytest.mark.parametrize("mode", ["nan", "raise", "inf_update"])
def test_skip_policy_aggregates_only_healthy_clients(mode):
    model = Faulty(bad_clients={0, 1, 2}, mode=mode)
    loop, spy, tracker, trainer, dm = _fit(model, on_client_error="skip")  # raising clients are skipped on request
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


class StopAtStart(Callback):
    """Ends fit before round 0: the loop and its client trainer are set up, nothing is trained."""

    def on_train_start(self, trainer, pl_module):
        trainer.should_stop = True


def test_skipping_equals_training_without_the_bad_clients():
    """With one NaN client, the new global model is FedAvg over the remaining clients only: compared with the same
    round computed client by client (the loop's own client trainer, client 3 left out) and aggregated in float64,
    within the float32 rounding bound of the loop's sum of k weighted updates (k·u·Σ n_i|Δ_i|/Σ n_i, u the unit
    roundoff; factor 4 for the division and the subtraction) and of the last subtraction (u·|w|)."""
    torch.manual_seed(0)
    base = Faulty(bad_clients=set())
    bad_model = copy.deepcopy(base)
    bad_model.bad_clients = {3}
    loop_bad, spy, tracker, trainer, dm = _fit(bad_model, rounds=1, clients=6, cpr=6)
    with pytest.warns(UserWarning):
        trainer.fit(loop_bad, datamodule=dm)
    fresh = copy.deepcopy(base)
    loop2, _, _, tr2, dm2 = _fit(fresh, rounds=1, clients=6, cpr=6)
    tr2.callbacks.append(StopAtStart())
    tr2.fit(loop2, datamodule=dm2)  # only sets the loop up
    assert tr2.global_step == 0
    plan = dm2.round_plan(0)
    g = torch.nn.utils.parameters_to_vector(fresh.parameters()).detach().clone()
    g64 = g.double()
    total, acc, acc_abs, k = 0.0, torch.zeros_like(g64), torch.zeros_like(g64), 0
    for cid in plan.client_ids:
        if cid == 3:
            continue
        loop2.client_worker.model.current = (0, cid)
        u = loop2.train_client(plan, cid, g)
        acc += u.num_samples * u.delta.double()
        acc_abs += u.num_samples * u.delta.double().abs()
        total += u.num_samples
        k += 1
    expected = g64 - acc / total
    u32 = torch.finfo(torch.float32).eps / 2
    tol = 4 * (k + 2) * u32 * acc_abs / total + 2 * u32 * (g64.abs() + expected.abs())
    got = torch.nn.utils.parameters_to_vector(loop_bad.model.parameters()).detach().double()
    assert bool(((got - expected).abs() <= tol).all())
    assert [r.num_failed for r in spy.results] == [1]


def test_no_healthy_client_leaves_model_unchanged_and_a_run_without_a_healthy_round_fails():
    """Two rounds (fewer than max_failed_rounds=3) in which every client diverged: each leaves the global model
    unchanged, and the run ends with a FloatingPointError once training ends; max_failed_rounds=None tolerates it."""
    model = Faulty(bad_clients=set(range(6)))
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    loop, spy, tracker, trainer, dm = _fit(model, rounds=2)
    with pytest.warns(UserWarning, match="no healthy client"):
        refused = r"^no round of this run had a healthy client \(2 rounds: every client was left out of its round; "
        with pytest.raises(FloatingPointError, match=refused + r"e.g. client \d+ in round 1: non-finite"):
            trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 2  # rounds still advance (the sampler moves on)
    assert [r.num_clients for r in spy.results] == [0, 0]
    assert torch.equal(torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach(), before)
    tolerant = Faulty(bad_clients=set(range(6)))
    loop, spy, tracker, trainer, dm = _fit(tolerant, rounds=2, max_failed_rounds=None)
    with pytest.warns(UserWarning, match="no healthy client"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 2


def test_one_healthy_round_is_enough_at_the_end():
    """Round 0 has healthy clients, round 1 none: the run ends normally (the end-of-run check asks for one round)."""
    model = Faulty(bad_clients=set(range(6)), bad_rounds={1})
    loop, spy, tracker, trainer, dm = _fit(model, rounds=2)
    with pytest.warns(UserWarning, match="no healthy client"):
        trainer.fit(loop, datamodule=dm)
    assert [r.num_clients for r in spy.results] == [3, 0] and loop.rounds_without_healthy_client == 1


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
