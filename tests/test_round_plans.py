"""A researcher's own client sampling and round plans (a data module's ``sample_clients`` / ``round_plan``, a
callback's ``on_round_start``): the clients of a plan are taken by value whatever integer type they come as, and a
plan the loop cannot train as written (no client, a client out of range or without data, another round's plan, a
client twice in a run whose clients keep state, one step count for per-client counts) is refused naming the round
and the cause."""

import numpy as np
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FederatedCallback, KDecay, Scaffold
from fedlightning.datamodules import ArrayDataset, FederatedDataModule
from fedlightning.models import LogisticRegression

SIZES = [3, 5, 7, 9, 0, 13, 15, 17]  # client 4 holds no data


class Clients(FederatedDataModule):
    """Eight natural clients of float64 samples (client 4 empty) whose sampler returns ``ids(round)``."""

    def __init__(self, ids=None, plan=None):
        super().__init__(num_clients=len(SIZES), batch_size=4, val_fraction=0.0, seed=0)
        self.ids, self.plan = ids, plan

    def load(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(sum(SIZES), 5, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (sum(SIZES),), generator=g)
        return ArrayDataset(x, y), ArrayDataset(x[:20], y[:20]), y.numpy()

    def natural_clients(self):
        bounds = np.cumsum([0, *SIZES])
        return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def sample_clients(self, round):
        return super().sample_clients(round) if self.ids is None else self.ids(round)

    def round_plan(self, round):
        return super().round_plan(round) if self.plan is None else self.plan(self, round)


def _fit(dm, callbacks=(), rounds=2, mode="sequential", strategy=None, **loop_args):
    torch.manual_seed(1)
    model = LogisticRegression(input_dim=5, num_classes=3).to(torch.float64)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=7, client_execution=mode, **loop_args)
    make_trainer(rounds, callbacks=[strategy or FedAvg(), *callbacks]).fit(loop, datamodule=dm)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_client_ids_of_any_integer_type_train_as_the_same_ints(mode):
    """A client's data order comes from its id: a 0-d tensor id seeded another order than the int (sequential)."""
    ints = _fit(Clients(lambda r: [1, 3, 5]), mode="sequential")
    for ids in (
        lambda r: np.array([1, 3, 5]),
        lambda r: torch.tensor([1, 3, 5]),
        lambda r: list(torch.tensor([1, 3, 5])),
    ):
        assert torch.equal(_fit(Clients(ids), mode=mode), ints)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([1.0, 3.0], r"round 0: plan.client_ids holds 1.0; client ids are integers"),
        ([True, 3], r"round 0: plan.client_ids holds True; client ids are integers"),
        (["1", 3], r"round 0: plan.client_ids holds '1' \(str\); client ids are integers"),
        ([1, 8], r"round 0: plan.client_ids holds client\(s\) \[8\] outside the data module's 8 clients"),
        ([-1, 3], r"client\(s\) \[-1\] outside"),
        ([1, 4], r"round 0: plan.client_ids holds client\(s\) \[4\] without training data"),
        ([], r"round 0: the round's plan has no client"),
    ],
)
@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_plan_the_loop_cannot_train_is_refused_naming_the_cause(ids, match, mode):
    with pytest.raises(ValueError, match=match):
        _fit(Clients(lambda r: list(ids)), rounds=1, mode=mode)


def test_a_round_plan_for_another_round_or_of_another_type_is_refused():
    def stale(dm, round):  # always round 0's plan: every round would repeat round 0's data order and seeds
        return FederatedDataModule.round_plan(dm, 0)

    with pytest.raises(ValueError, match=r"round 1: Clients.round_plan\(1\) returned round 0's plan"):
        _fit(Clients(plan=stale))
    with pytest.raises(ValueError, match=r"round 0: Clients.round_plan\(0\) returned a dict"):
        _fit(Clients(plan=lambda dm, r: {"round": r}))


def test_a_client_twice_in_a_round_is_refused_where_clients_keep_state_and_trained_twice_where_not():
    """Sampling with replacement: SCAFFOLD's second copy would start from the control variate the first copy wrote
    (sequential) or from the round's (vectorized); stateless FedAvg trains both copies."""
    twice = Clients(lambda r: [2, 2, 5])
    with pytest.raises(ValueError, match=r"client 2's 'scaffold' state is written twice in one round"):
        _fit(twice, strategy=Scaffold())
    counted = []

    class Count(FederatedCallback):
        def on_client_end(self, trainer, loop, plan, update):
            counted.append(update.client_id)

    _fit(Clients(lambda r: [2, 2, 5]), callbacks=[Count()], rounds=1)
    assert counted == [2, 2, 5]


def test_kdecay_of_the_step_count_refuses_per_client_step_counts_of_a_round_plan():
    def heterogeneous(dm, round):  # FedNova-style: each client its own number of local steps
        plan = FederatedDataModule.round_plan(dm, round)
        plan.client_steps = {c: 1 + c % 3 for c in plan.client_ids}
        return plan

    with pytest.raises(ValueError, match=r"KDecay\(decay='local_steps'\) schedules one number of local steps"):
        _fit(Clients(plan=heterogeneous), callbacks=[KDecay(schedule="rounds")])


def test_a_step_count_a_callback_sets_with_per_client_counts_is_refused_naming_the_source():
    class Both(FederatedCallback):
        def on_round_start(self, trainer, loop, plan):
            plan.local_steps = 5
            plan.client_steps = {c: 1 for c in plan.client_ids}

    with pytest.raises(ValueError, match=r"with plan.client_steps, which on_round_start set, each client's steps"):
        _fit(Clients(), callbacks=[Both()], rounds=1)
