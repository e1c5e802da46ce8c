"""``RoundTally.admit_all``: a group of client updates admitted together gives the round's statistics, failures,
warnings and stops of admitting them one by one (``RoundTally.admit``), bit for bit; and a vectorised run without an
``on_client_end`` hook (whose groups are admitted together) equals the same run with one (admitted one by one) bit
for bit, and sequential training to rounding.

The reference for the statistics is the per-client path, whose sums are those of ``accumulate_core`` (tested against
hand-written sums in tests/test_strategies.py); here the two paths must agree exactly, on any CPU: both compute
every entry with the same float operations in the same order.
"""

import math
import warnings

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning._round import FailurePolicy, RoundTally
from fedlightning.callbacks import FedAvg, FederatedCallback
from fedlightning.callbacks.base import ServerStrategy
from fedlightning.state import ClientUpdate, RoundPlan
from numerics import assert_close64
from test_vectorized import digits, mlp

D = 300


class WithExtras(ServerStrategy):
    """A strategy with an extra statistic (a tensor) per client, and uniform or sample weights."""

    def accumulate(self, stats, update):
        stats.add("extra", update.delta * 3.0)


NO_LOSS = float("nan")  # one object: tuples holding it compare equal
#: clients whose telemetry is unusual: a non-finite step size among finite ones, none finite, no step at all
STEP_SIZES = {1: [0.5, float("inf"), 0.02], 3: [float("nan")], 9: []}


def make_updates(dtype, specials=()):
    """Ten updates of ``D`` entries, rows of one ``[10, D]`` tensor as the vectorised engine hands them over; the
    clients in ``specials`` (index -> kind) are made unusual."""
    g = torch.Generator().manual_seed(0)
    rows = (
        torch.randn(10, D, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 10, dtype=torch.float64)[:, None]
    )
    rows = rows.to(dtype)
    updates = []
    for i in range(10):
        u = ClientUpdate(
            client_id=100 + i,
            delta=rows[i],
            num_samples=7 + 3 * i,
            num_steps=2,
            first_loss=1.0 / (i + 1),
            mean_loss=0.5 / (i + 1),
            step_sizes=STEP_SIZES.get(i, [0.1 * (i + 1), 0.1 / (3 + i)]),
            forwards=4,
            backwards=2,
        )
        kind = dict(specials).get(i)
        if kind == "inf":  # an update whose norm overflows (the engine marks non-finite ones failed itself)
            rows[i, 5] = float("inf")
        elif kind == "failed":
            u.failed, u.failure = True, "non-finite training loss"
        elif kind == "buffers":
            u.buffers = torch.linspace(0, 1, 4, dtype=dtype)
        elif kind == "no loss":  # every local step skipped: healthy, adds no loss
            u.mean_loss = u.first_loss = NO_LOSS
        elif kind == "other dtype":
            u.delta = rows[i].to(torch.float64 if dtype == torch.float32 else torch.float32)
        updates.append(u)
    return updates


def tally(strategy, on_client_failure="skip", max_update_norm=None):
    return RoundTally(
        strategy, 10, torch.device("cpu"), FailurePolicy(on_client_failure, "skip", None), max_update_norm
    )


def admitted(strategy, updates, together, **kwargs):
    t = tally(strategy, **kwargs)
    plan = RoundPlan(round=4, client_ids=[u.client_id for u in updates], local_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if together:
            went_on = t.admit_all(plan, updates)
        else:
            went_on = all(t.admit(plan, u) for u in updates)  # all() stops at the first False, as the loop does
    return t, went_on, [str(w.message) for w in caught], [(u.failed, u.failure) for u in updates]


def assert_same_admission(strategy, dtype, specials=(), **kwargs):
    one, two = (admitted(strategy, make_updates(dtype, specials), together, **kwargs) for together in (False, True))
    (t1, on1, warn1, fate1), (t2, on2, warn2, fate2) = one, two
    assert (on1, warn1, fate1, t1.stop, t1.failed, t1.healthy) == (on2, warn2, fate2, t2.stop, t2.failed, t2.healthy)
    v1, v2 = t1.close().values, t2.close().values
    assert sorted(v1) == sorted(v2)
    for key in v1:
        assert v1[key].dtype == v2[key].dtype and torch.equal(v1[key], v2[key]), key
    return t2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strategy", [FedAvg(), FedAvg(weighting="uniform"), WithExtras(server_lr=0.5)])
def test_a_group_is_admitted_as_its_clients_one_by_one(dtype, strategy):
    t = assert_same_admission(strategy, dtype)
    assert len(t.healthy) == 10
    t = assert_same_admission(strategy, dtype, {5: "no loss"})
    assert float(t.stats["loss_clients"]) == 9 and float(t.stats["step_size_count"]) == 16
    assert float(t.stats["step_size_max"]) == 0.1 * 9 and -float(t.stats["neg_step_size_min"]) == 0.1 / 11
    # the sums themselves, by hand in float64 (independent of both paths): Σ w_i, Σ ‖Δ_i‖² and Σ w_i Δ_i
    updates = make_updates(dtype)
    w = [float(u.num_samples) if strategy.weighting == "samples" else 1.0 for u in updates]
    stats = t.stats
    assert float(stats["weight"]) == sum(w)
    sq = [float(u.delta.double().pow(2).sum()) for u in updates]
    assert math.isclose(float(stats["sq_norm_sum"]), sum(sq), rel_tol=1e-12)
    reference = sum(wi * u.delta.double() for wi, u in zip(w, updates))
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    assert torch.allclose(stats["delta"].double(), reference, rtol=rtol, atol=rtol * float(reference.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_failures_in_a_group_are_left_out_as_one_by_one(dtype):
    specials = {2: "inf", 4: "failed", 6: "buffers", 8: "other dtype"}
    t = assert_same_admission(FedAvg(), dtype, specials)
    assert t.failed == 2 and len(t.healthy) == 8
    # clients over max_update_norm (the three largest updates, norms ~130 to ~1700) are left out the same way
    t = assert_same_admission(WithExtras(), dtype, specials, max_update_norm=50.0)
    assert t.failed == 5


def test_a_failure_that_stops_the_run_stops_the_group_where_one_by_one_stops():
    t = assert_same_admission(FedAvg(), torch.float32, {3: "inf", 7: "inf"}, on_client_failure="raise")
    assert t.stop[0] == 103 and len(t.healthy) == 3


class Skip(FederatedCallback):
    """A no-op ``on_client_end``: the loop then admits every client on its own."""

    def on_client_end(self, trainer, pl_module, plan, update):
        pass


def run(mode, callbacks=(), monkeypatch=None):
    torch.manual_seed(0)
    model = mlp()
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=1,
        clients_per_round=8,
        seed=5,
        client_execution=mode,
    )
    trainer = make_trainer(3, callbacks=[FedAvg(), *callbacks])
    trainer.fit(loop, datamodule=digits())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return weights, metrics


def test_a_vectorized_round_admits_its_group_together_with_the_same_result(monkeypatch):
    groups = []
    admit_all = RoundTally.admit_all

    def spy(self, plan, updates):
        groups.append(len(updates))
        return admit_all(self, plan, updates)

    monkeypatch.setattr(RoundTally, "admit_all", spy)
    together = run("vectorized")
    assert groups == [8, 8, 8]
    groups.clear()
    one_by_one = run("vectorized", [Skip()])
    assert groups == []  # with an on_client_end hook every client is admitted right after it
    assert torch.equal(together[0], one_by_one[0])
    assert together[1] == one_by_one[1]
    sequential = run("sequential")
    assert_close64(together[0], sequential[0])
    assert together[1].keys() == sequential[1].keys()
