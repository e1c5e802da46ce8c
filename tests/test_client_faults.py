"""One client cannot blow up the global model, and exceptions are bugs (FederatedLoop's aggregation checks, server
step check and failure policies ``on_client_failure`` / ``on_client_error``).

Global models are compared with an aggregate computed by hand in float64 from the recorded client updates, with a
tolerance derived from float32 rounding of the loop's sums (``_tolerance``).
"""

import functools
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAdam, FedAvg, FedAvgM, FederatedCallback, FedExP
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP, LogisticRegression

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32
BIG = 3e38  # a float32 weight near finfo(float32).max = 3.4e38


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double()


class Record(FederatedCallback):
    """Every round's global model before the round, and every client's update as the loop sees it after
    ``on_client_end`` (optionally overwritten first: ``inject = {position in the round's sample: value}``)."""

    def __init__(self, inject=None):
        self.inject = inject or {}
        self.start, self.updates, self.results = [], [], []

    def on_round_start(self, trainer, loop, plan):
        self.start.append(_flat(loop.model))

    def on_client_end(self, trainer, loop, plan, update):
        if update.failed:
            return
        position = plan.client_ids.index(update.client_id)
        if position in self.inject:
            update.delta.fill_(self.inject[position])
        self.updates.append((plan.round, update.client_id, update.delta.double().clone(), update.num_samples))

    def on_round_end(self, trainer, loop, result):
        self.results.append(result)


class BlowUpSGD(torch.optim.SGD):
    """SGD whose last local step sets every weight of the chosen client to 3e38: its losses stay finite and its
    update ``w_t - 3e38`` is finite, but the float32 sum of weighted updates is not."""

    victim_now = False

    def __init__(self, params, lr=0.1, local_steps=2):
        super().__init__(params, lr=lr)
        self.calls, self.local_steps = 0, local_steps

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        self.calls += 1
        if BlowUpSGD.victim_now and self.calls == self.local_steps:
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(BIG)
        return out


class ChooseVictim(FederatedCallback):
    """Makes the second client sampled in each round the BlowUpSGD victim (sequential clients)."""

    def client_objective(self, trainer, loop, plan, client_id):
        BlowUpSGD.victim_now = client_id == plan.client_ids[1]
        return []


def _data():
    return DigitsDataModule(num_clients=6, batch_size=16, partition=Dirichlet(1.0), seed=0)


def _fit(strategy, rounds=1, cpr=4, callbacks=(), **loop_kwargs):
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[8])
    loop_kwargs.setdefault("client_optimizer", lambda p: torch.optim.SGD(p, lr=0.1))
    loop = FederatedLoop(model, local_steps=2, clients_per_round=cpr, seed=0, **loop_kwargs)
    rec = Record()
    trainer = make_trainer(rounds, callbacks=[strategy, rec, *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(loop, datamodule=_data())
    skipped = [str(w.message) for w in caught if " skipped (" in str(w.message)]
    return loop, rec, skipped


def _aggregate(g0, updates, strategy):
    """The new global model from ``updates`` ``[(delta, num_samples)]`` in float64, and the float32 tolerance of the
    loop's computation of it: each sum of k terms is off by at most k·u·Σ|terms| (u: float32 unit roundoff), FedExP's
    η_g by its relative error times η_g, and the last subtraction by u·|result|; the factor 4 covers the divisions and
    the products of these bounds."""
    k = len(updates)
    deltas = torch.stack([d for d, _ in updates])
    if isinstance(strategy, FedExP):  # uniform weights (FedExP's default)
        weights = torch.ones(k, dtype=torch.float64)
    else:
        weights = torch.tensor([float(n) for _, n in updates], dtype=torch.float64)
    mean = (weights[:, None] * deltas).sum(0) / weights.sum()
    abs_mean = (weights[:, None] * deltas.abs()).sum(0) / weights.sum()
    eta = 1.0
    if isinstance(strategy, FedExP):
        mean_sq = float(deltas.pow(2).sum()) / k
        eta = max(1.0, mean_sq / (2 * (float(mean.pow(2).sum()) + strategy.eps)))
    expected = g0 - eta * mean
    tol = 4 * (k + 2) * U32 * eta * (abs_mean + mean.abs()) + 2 * U32 * (g0.abs() + expected.abs())
    return expected, tol


def _assert_close_to(got, expected, tol):
    err = (got - expected).abs()
    assert bool((err <= tol).all()), (
        f"max error {float(err.max()):.3g}, tolerance at that entry {float(tol[err.argmax()]):.3g}"
    )


# ============================================================================ item 3: no client blows up the model
@pytest.mark.parametrize("strategy", [FedAvg, FedExP], ids=["fedavg", "fedexp"])
def test_a_client_whose_weights_end_at_3e38_is_skipped_and_named(strategy):
    """The victim's update passes the client's finiteness check but would overflow the float32 sum: FedAvg's
    samples-weighted sum would be inf, FedExP's uniform mean 3e38/4. It is left out and named with its update norm;
    the global model is the aggregate of the other three clients."""
    strategy = strategy()
    loop, rec, skipped = _fit(
        strategy, callbacks=[ChooseVictim()], client_optimizer=lambda p: BlowUpSGD(p, lr=0.1, local_steps=2)
    )
    BlowUpSGD.victim_now = False
    plan = rec.results[0].plan
    victim = plan.client_ids[1]
    by_client = {cid: (d, n) for _, cid, d, n in rec.updates}
    victim_delta = by_client[victim][0]
    assert bool(torch.isfinite(victim_delta).all()) and float(victim_delta.abs().max()) > 1e38
    norm = float(victim_delta.norm())
    assert len(skipped) == 1
    assert skipped[0].startswith(
        f"round 0: client {victim} skipped (update norm {norm:.4g}: its weighted update "
        f"(weight {1 if isinstance(strategy, FedExP) else by_client[victim][1]}) could "
        f"overflow the float32 sum of the round's 4 clients"
    )
    result = rec.results[0]
    assert (result.num_clients, result.num_failed, result.metrics["round/failed_clients"]) == (3, 1, 1.0)
    others = [by_client[c] for c in plan.client_ids if c != victim]
    expected, tol = _aggregate(rec.start[0], others, strategy)
    got = _flat(loop.model)
    assert bool(torch.isfinite(got).all())
    _assert_close_to(got, expected, tol)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_the_rule_is_the_same_in_both_client_modes(mode):
    """An update of -3e38 (injected after training) in sequential and vectorised runs: the same client is skipped
    with the same warning, and the global model is FedAvg over the others."""
    rec = Record(inject={2: -BIG})
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[8])
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=2,
        clients_per_round=4,
        seed=0,
        client_execution=mode,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(1, callbacks=[FedAvg(), rec]).fit(loop, datamodule=_data())
    plan = rec.results[0].plan
    victim, victim_delta, weight = next((c, d, n) for _, c, d, n in rec.updates if c == plan.client_ids[2])
    skipped = [str(w.message) for w in caught if " skipped (" in str(w.message)]
    assert skipped == [
        f"round 0: client {victim} skipped (update norm {float(victim_delta.norm()):.4g}: its weighted "
        f"update (weight {weight}) could overflow the float32 sum of the round's 4 clients (limit "
        f"|w|·‖Δ‖ < {3.4028234663852886e38 / 8:.4g}))"
    ]
    others = [(d, n) for _, c, d, n in rec.updates if c != victim]
    assert len(others) == 3 and rec.results[0].num_failed == 1
    expected, tol = _aggregate(rec.start[0], others, FedAvg())
    _assert_close_to(_flat(model), expected, tol)


class BatchNormMLP(MLP):
    def __init__(self):
        super().__init__(input_dim=64, hidden=[8])
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 10)
        )


class BufferFault(Record):
    """Record that also replaces the float buffers of the client sampled second by ``value`` and records every
    client's buffers."""

    def __init__(self, value):
        super().__init__()
        self.value, self.buffers = value, {}

    def on_client_end(self, trainer, loop, plan, update):
        if plan.client_ids.index(update.client_id) == 1:
            update.buffers.fill_(self.value)
        self.buffers[update.client_id] = update.buffers.double().clone()
        super().on_client_end(trainer, loop, plan, update)


@pytest.mark.parametrize(
    "value,reason",
    [
        (math.nan, "non-finite float buffers (e.g. BatchNorm running statistics)"),
        (
            BIG,
            "float buffers norm {bnorm:.4g}: its weighted buffers could overflow "
            "the float32 sum of the round's 4 clients",
        ),
    ],
    ids=["nan", "3e38"],
)
def test_a_client_with_non_finite_or_overflowing_buffers_is_skipped(value, reason):
    """BatchNorm running statistics are averaged like the updates: a client whose buffers are NaN or 3e38 is left
    out, and the global buffers are the weighted mean of the other clients' (float64 reference)."""
    torch.manual_seed(0)
    model = BatchNormMLP()
    if value == BIG:  # float32 reports need float buffers only: an integer one (num_batches_tracked) makes them float64
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.num_batches_tracked = None  # BatchNorm without its counter (momentum set: it does not read it)
    rec = BufferFault(value)
    loop = FederatedLoop(
        model, client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, clients_per_round=4, seed=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(1, callbacks=[FedAvg(), rec]).fit(loop, datamodule=_data())
    plan = rec.results[0].plan
    victim = plan.client_ids[1]
    norm, bnorm = float(by_id(rec, victim)[0].norm()), float(rec.buffers[victim].norm())
    skipped = [str(w.message) for w in caught if " skipped (" in str(w.message)]
    assert skipped == [
        f"round 0: client {victim} skipped (update norm {norm:.4g}, {reason.format(bnorm=bnorm)})"
        if value == BIG
        else f"round 0: client {victim} skipped (update norm {norm:.4g}: {reason})"
    ]
    others = [c for c in plan.client_ids if c != victim]
    weights = torch.tensor([float(by_id(rec, c)[1]) for c in others], dtype=torch.float64)
    stacked = torch.stack([rec.buffers[c] for c in others])
    expected = (weights[:, None] * stacked).sum(0) / weights.sum()
    tol = 4 * (len(others) + 2) * U32 * (weights[:, None] * stacked.abs()).sum(0) / weights.sum()
    # every buffer is averaged: the float statistics as they are, num_batches_tracked rounded (write_averaged_buffer)
    is_float = torch.cat([torch.full((b.numel(),), b.is_floating_point()) for b in model.buffers()])
    expected = torch.where(is_float, expected, expected.round())
    tol = torch.where(is_float, tol, torch.zeros_like(tol))
    _assert_close_to(torch.cat([b.reshape(-1).double() for b in model.buffers()]), expected, tol)


def by_id(rec, client_id):
    return next((d, n) for _, c, d, n in rec.updates if c == client_id)


def test_max_update_norm_skips_a_client_with_a_big_norm():
    """max_update_norm between the largest and the second-largest update norm of a round leaves exactly the
    largest-norm client out, with its norm in the warning."""
    _, free, skipped = _fit(FedAvg())
    assert skipped == []
    norms = sorted((float(d.norm()), cid) for _, cid, d, _ in free.updates)
    bound = (norms[-1][0] + norms[-2][0]) / 2
    loop, rec, skipped = _fit(FedAvg(), max_update_norm=bound)
    assert skipped == [
        f"round 0: client {norms[-1][1]} skipped (update norm {norms[-1][0]:.4g} > max_update_norm={bound:g})"
    ]
    others = [(d, n) for _, c, d, n in rec.updates if c != norms[-1][1]]
    expected, tol = _aggregate(rec.start[0], others, FedAvg())
    _assert_close_to(_flat(loop.model), expected, tol)


def test_rounds_left_without_a_client_by_max_update_norm_stop_naming_it():
    """Every update (finite) above a tiny max_update_norm for max_failed_rounds rounds: the stop said every loss or
    update was NaN/inf and suggested client_grad_clip; it names a client's actual reason now."""
    with pytest.raises(FloatingPointError) as info:
        _fit(FedAvg(), rounds=3, max_update_norm=1e-9, max_failed_rounds=2)
    message = str(info.value)
    assert message.startswith(
        "round 1: 2 consecutive rounds without a healthy client (max_failed_rounds=2): every client was left out of "
        "its round; e.g. client "
    )
    named = re.search(r"e.g. client \d+ in round (\d+): update norm [0-9.e+-]+ > max_update_norm=1e-09\. ", message)
    assert named and named.group(1) == "1"  # the latest round's first client left out
    assert "for 'max_update_norm': raise it" in message and "NaN/inf or it failed" not in message


class ExtraStatistic(FedAvg):
    """FedAvg that adds a statistic per client; the second sampled client's is ``bad`` (others: 1.0)."""

    def __init__(self, bad):
        super().__init__()
        self.bad, self.plan = bad, None

    def on_round_start(self, trainer, loop, plan):
        self.plan = plan

    def accumulate(self, stats, update):
        bad = update.client_id == self.plan.client_ids[1]
        if isinstance(self.bad, torch.Tensor):
            stats.add("extra_vector", self.bad if bad else torch.ones_like(self.bad))
        else:
            stats.add("extra", self.bad if bad else 1.0, update.delta.device)


@pytest.mark.parametrize(
    "bad,shown",
    [(math.inf, "extra = inf"), (math.nan, "extra = nan"), (torch.full((3,), 1e38), "extra_vector (norm 1.732e+38)")],
    ids=["inf", "nan", "vector-overflow"],
)
def test_a_non_finite_or_overflowing_strategy_statistic_skips_the_client(bad, shown):
    strategy = ExtraStatistic(bad)
    loop, rec, skipped = _fit(strategy)
    victim = rec.results[0].plan.client_ids[1]
    assert skipped == [f"round 0: client {victim} skipped (ExtraStatistic statistic {shown})"]
    assert rec.results[0].num_failed == 1
    others = [(d, n) for _, c, d, n in rec.updates if c != victim]
    expected, tol = _aggregate(rec.start[0], others, FedAvg())
    _assert_close_to(_flat(loop.model), expected, tol)


class ExplodesInRound1(FedAvgM):
    """FedAvgM (server momentum 0.9) whose round 1 steps with server learning rate ``lr`` on a pseudo-gradient of
    10s: the momentum buffer's entries are then above 9 (its round-0 entries are below 1 in magnitude), and
    ``1e38 · 9`` overflows float32; ``1e39`` is beyond float32 itself, and torch's SGD raises half-way."""

    def __init__(self, lr):
        super().__init__()
        self.lr = lr

    def server_update(self, loop, stats, plan):
        delta, lr, metrics = super().server_update(loop, stats, plan)
        if plan.round == 1:
            return torch.full_like(delta, 10.0), self.lr, metrics
        return delta, lr, metrics


class AdamOverflowsInRound1(FedAdam):
    """FedAdam whose round 1 steps on a pseudo-gradient of 1e25s: Adam's second moment (1 − β₂)·Δ² = 1e47 is past
    float32, while lr·Δ itself is finite."""

    def server_update(self, loop, stats, plan):
        delta, lr, metrics = super().server_update(loop, stats, plan)
        return (torch.full_like(delta, 1e25) if plan.round == 1 else delta), lr, metrics


def test_an_overflowing_server_optimizer_state_is_named_as_such():
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]), client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2,
        clients_per_round=4, seed=0,
    )  # fmt: skip
    after = []

    class Record(FederatedCallback):
        def on_round_end(self, trainer, loop, result):
            after.append(_flat(loop.model))

    trainer = make_trainer(3, callbacks=[AdamOverflowsInRound1(), Record()])
    with pytest.raises(FloatingPointError) as info:
        trainer.fit(loop, datamodule=_data())
    assert str(info.value).startswith(
        "round 1: the server step of AdamOverflowsInRound1 would make the global model non-finite (server optimizer "
        "state 'exp_avg_sq' of net.1.weight): the server optimizer's state overflows on this Δ: server/lr = "
    )
    assert len(after) == 1 and torch.equal(_flat(loop.model), after[0])  # round 0's model kept


class ServerState(FederatedCallback):
    def __init__(self):
        super().__init__()
        self.after = []

    def on_round_end(self, trainer, loop, result):
        opt = loop.optimizers().optimizer
        self.after.append(
            (
                _flat(loop.model),
                [s["momentum_buffer"].clone() for s in opt.state.values()],
                [g["lr"] for g in opt.param_groups],
                trainer.global_step,
            )
        )


@pytest.mark.parametrize("lr", [1e38, 1e39])
def test_a_non_finite_server_step_keeps_model_and_optimizer_state_and_stops(lr):
    """Round 1's step would make the global model inf (lr 1e38), or torch's SGD raises half-way through it (lr
    1e39, after updating the momentum): either way the model, the server momentum and the server lr stay those after
    round 0 and round 1 is not counted; the FloatingPointError names the round, the strategy and the statistic."""
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[8])
    loop = FederatedLoop(
        model, client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, clients_per_round=4, seed=0
    )
    state = ServerState()
    trainer = make_trainer(3, callbacks=[ExplodesInRound1(lr), state])
    with pytest.raises((FloatingPointError, RuntimeError)) as info:
        trainer.fit(loop, datamodule=_data())
    message = str(info.value)
    if lr == 1e38:
        assert info.type is FloatingPointError
        assert message == (
            "round 1: the server step of ExplodesInRound1 would make the global model non-finite (parameter "
            f"net.1.weight): the step server/lr·Δ overflows: server/lr = 1e+38, server/delta_norm = "
            f"{10 * 610**0.5:.4g}. The global model and the server optimizer state are left as they were before "
            "this round and the run stops; every client update passed the aggregation checks, so the strategy or its "
            "hyper-parameters are at fault, not a client"
        )
    else:
        assert "overflow" in message  # torch's own error, raised by the server optimizer
    assert len(state.after) == 1 and trainer.global_step == 1  # round 1 was not counted
    weights, momentum, lrs, _ = state.after[0]
    assert max(float(m.abs().max()) for m in momentum) < 1  # so round 1's buffer entries exceed 9
    assert torch.equal(_flat(model), weights)
    opt = loop.optimizers().optimizer
    assert [g["lr"] for g in opt.param_groups] == lrs == [1.0]
    now = [s["momentum_buffer"] for s in opt.state.values()]
    assert len(now) == len(momentum) and all(torch.equal(a, b) for a, b in zip(now, momentum))


# ============================================================================ item 4: exceptions are bugs
class RaisesFor(MLP):
    """Raises IndexError in training_step for the client ``loop.current`` names, if it is in ``bad``."""

    def __init__(self, bad_positions):
        super().__init__(input_dim=64, hidden=[8])
        self.bad_positions, self.current, self.trained = set(bad_positions), None, []

    def training_step(self, batch, batch_idx):
        plan, cid = self.current
        if batch_idx == 0:
            self.trained.append(cid)
        if plan.client_ids.index(cid) in self.bad_positions:
            raise IndexError(f"Target 12 is out of bounds (client {cid})")
        return super().training_step(batch, batch_idx)


class Current(FederatedCallback):
    def client_objective(self, trainer, loop, plan, client_id):
        loop.client_worker.model.current = (plan, client_id)
        return []


def test_an_exception_stops_the_run_at_its_first_occurrence():
    """The second sampled client raises: the run stops with a RuntimeError naming round, client and exception
    (chained), and the clients after it in the round never train."""
    torch.manual_seed(0)
    loop = FederatedLoop(
        RaisesFor({1}),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=2,
        clients_per_round=4,
        seed=0,
    )
    rec = Record()
    with pytest.raises(RuntimeError) as info:
        make_trainer(2, callbacks=[FedAvg(), rec, Current()]).fit(loop, datamodule=_data())
    worker = loop.client_worker.model
    plan = worker.current[0]
    victim = plan.client_ids[1]
    assert str(info.value) == (
        f"round 0: client {victim} raised IndexError: Target 12 is out of bounds (client {victim}). An exception in "
        "client training is a bug in the model, the data or a callback's hook, not a faulty client, so the run stops "
        "(on_client_error='skip' would leave such clients out of their round)"
    )
    assert isinstance(info.value.__cause__, IndexError)
    assert worker.trained == plan.client_ids[:2] and rec.results == []


def test_skipping_clients_that_raise_is_an_explicit_opt_in():
    """on_client_error='skip': the raising client is left out with a warning, the others are aggregated."""
    torch.manual_seed(0)
    model = RaisesFor({1})
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=2,
        clients_per_round=4,
        seed=0,
        on_client_error="skip",
    )
    rec = Record()
    with pytest.warns(UserWarning, match=r"round 0: client \d+ skipped \(IndexError\('Target 12 is out of bounds"):
        make_trainer(1, callbacks=[FedAvg(), rec, Current()]).fit(loop, datamodule=_data())
    assert (rec.results[0].num_clients, rec.results[0].num_failed) == (3, 1)
    expected, tol = _aggregate(rec.start[0], [(d, n) for _, _, d, n in rec.updates], FedAvg())
    _assert_close_to(_flat(model), expected, tol)


def test_on_client_failure_raise_still_covers_non_finite_results_only():
    """on_client_failure='raise' with on_client_error='skip': a raising client is skipped, a client whose update
    would overflow stops the run with a FloatingPointError naming it."""
    torch.manual_seed(0)
    rec = Record(inject={2: -BIG})
    loop = FederatedLoop(
        RaisesFor({1}),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=2,
        clients_per_round=4,
        seed=0,
        on_client_failure="raise",
        on_client_error="skip",
    )
    with pytest.warns(UserWarning, match="IndexError"), pytest.raises(FloatingPointError) as info:
        make_trainer(1, callbacks=[FedAvg(), rec, Current()]).fit(loop, datamodule=_data())
    victim = loop.client_worker.model.current[0].client_ids[2]
    assert str(info.value).startswith(f"client {victim} failed in round 0: update norm ")
    assert "could overflow the float32 sum of the round's 4 clients" in str(info.value)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("seed", -1, "seed must be an integer >= 0, got -1"),
        ("on_client_error", "ignore", "on_client_error must be 'raise' or 'skip', got 'ignore'"),
        ("max_update_norm", 0, "max_update_norm must be a finite number > 0 or None, got 0"),
        ("max_update_norm", math.inf, "max_update_norm must be a finite number > 0 or None, got inf"),
    ],
)
def test_bad_policy_arguments_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        FederatedLoop(MLP(input_dim=64, hidden=[8]), **{key: value})


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("seed", "-1", "seed must be an integer >= 0, got -1"),
        ("on_client_error", "ignore", "on_client_error must be 'raise' or 'skip', got 'ignore'"),
        ("max_update_norm", "-3", "max_update_norm must be a finite number > 0 or None, got -3.0"),
    ],
)
def test_bad_policy_arguments_are_one_line_config_errors(tmp_path, capsys, key, value, message):
    from fedlightning.cli import main

    with pytest.raises(SystemExit) as info:
        main(
            [
                "fit",
                "--config",
                os.path.join(ROOT, "configs", "quickstart.yaml"),
                "--trainer.logger",
                "false",
                "--trainer.default_root_dir",
                str(tmp_path),
                f"--model.{key}",
                value,
            ]
        )
    assert info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: model.{key}: {message}"


def test_a_run_without_a_healthy_round_exits_non_zero_through_train_py(tmp_path):
    """quickstart with a client learning rate of 1e37 for two rounds (fewer than max_failed_rounds): every client's
    loss becomes non-finite, and train.py exits 1 with the end-of-run FloatingPointError as its last line."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "quickstart.yaml"),
            "--trainer.max_steps",
            "2",
            "--model.client_optimizer.init_args.lr",
            "1e37",
            "--model.clients_per_round",
            "5",
            "--model.local_steps",
            "5",
            "--test_after_fit",
            "false",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"FloatingPointError: no round of this run had a healthy client \(2 rounds: every client was left out of its "
        r"round; e.g. client \d+ in round 1: non-finite training loss\), so the global model was never updated. For "
        r"NaN/inf losses or updates: lower the client learning rate or clip client gradients .*",
        last,
    ), last


# ============================================================================ DDP: the rules hold per process
DDP_SCRIPT = os.path.join(ROOT, "tests", "scripts", "ddp_client_faults.py")


def test_two_processes_skip_the_overflowing_client_and_stop_on_an_exception(tmp_path):
    """Two DDP processes (gloo), the client sampled second trained by rank 1. Round 0: its update is -3e38; it is
    skipped, and the one- and two-process global models both equal FedAvg over the other three clients (float64
    reference from the one-process run's updates), and rank 1 (not rank 0) warns naming it. Round 1: it raises; both
    processes stop (no collective is left waiting) and rank 0's error names the client rank 1 trained."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_client_faults", DDP_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one_loop, one = script.fit(1, rounds=1)
    ((client_ids, healthy, failed),) = one.results
    assert (healthy, failed) == (3, 1)
    others = [(d, n) for _, position, d, n in one.updates if position != script.VICTIM_POSITION]
    expected, tol = _aggregate(one.start[0], others, FedAvg())
    _assert_close_to(_flat(one_loop.model), expected, tol)

    out = tmp_path / "two.pt"
    proc = subprocess.run(
        [sys.executable, DDP_SCRIPT, "--devices", "2", "--rounds", "2", "--out", str(out)],
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    two = torch.load(out)
    assert two["results"] == [(client_ids, 3, 1)]  # round 0 only
    _assert_close_to(two["weights"].double(), expected, tol)
    warned = [(tmp_path / f"two.pt.rank{r}").read_text().splitlines() for r in (0, 1)]
    victim_delta = next(d for _, position, d, _ in one.updates if position == script.VICTIM_POSITION)
    assert warned[0] == [] and len(warned[1]) == 1
    assert warned[1][0].startswith(
        f"round 0: client {client_ids[1]} skipped (update norm {float(victim_delta.norm()):.4g}: its weighted update"
    )
    dm = DigitsDataModule(num_clients=12, batch_size=20, partition=Dirichlet(0.5), seed=0)
    dm.setup("fit")
    dm.configure_rounds(4, 3, seed=1)
    victim = dm.round_plan(1).client_ids[script.VICTIM_POSITION]
    line = (
        f"RuntimeError: round 1: client {victim} raised IndexError: Target 12 is out of bounds. An exception in "
        "client training is a bug in the model, the data or a callback's hook, not a faulty client, so the run stops "
        "(on_client_error='skip' would leave such clients out of their round)"
    )
    assert f"[rank0]: {line}" in proc.stderr and f"[rank1]: {line}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["vectorized", "auto"])
def test_a_data_error_under_vectorized_clients_points_to_the_client(mode):
    """A target out of range (label checks off) raises inside the batched call, which cannot tell whose batch it
    was: ``"vectorized"`` stops saying so and how to find the client; ``"auto"`` trains sequentially, where the
    failure policy (``on_client_error="skip"``) leaves that client out by name."""
    from torch.utils.data import TensorDataset

    from fedlightning.datamodules import IID, FederatedDataModule
    from fedlightning.vectorized import VectorizationUnsupportedError

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 64, generator=g), torch.randint(0, 10, (120,), generator=g)
    y[7] = 10  # MLP(num_classes=10): out of range
    dm = FederatedDataModule.from_datasets(
        TensorDataset(x, y), None, partition=IID(), num_clients=4, batch_size=30, seed=0, val_fraction=0.0,
        check_labels=False,
    )  # fmt: skip
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]), client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2,
        clients_per_round=4, seed=0, client_execution=mode, on_client_error="skip",
    )  # fmt: skip
    trainer = make_trainer(1)
    if mode == "vectorized":
        # torch raises IndexError from its nll kernel, or RuntimeError from the gather of the decomposition that vmap
        # takes once some earlier call in the process registered it (torch's state, not the engine's)
        raised = r"(IndexError|RuntimeError): .*out of bounds.*names the client whose batch raises"
        with pytest.raises(VectorizationUnsupportedError, match=raised):
            trainer.fit(loop, datamodule=dm)
        return
    with pytest.warns(UserWarning, match=r"round 0: client \d+ skipped \(IndexError") as caught:
        trainer.fit(loop, datamodule=dm)
    (line,) = [str(w.message) for w in caught if "skipped (IndexError" in str(w.message)]
    owner = next(c for c, ix in enumerate(dm.client_indices) if 7 in set(ix.tolist()))
    assert line.startswith(f"round 0: client {owner} skipped") and trainer.global_step == 1


class DeltaFault(FederatedCallback):
    """In ``on_client_end``, the client sampled second gets ``value`` in its update's first entry (None: it is
    marked failed instead)."""

    def __init__(self, value):
        self.value = value

    def on_client_end(self, trainer, loop, plan, update):
        if plan.client_ids.index(update.client_id) == 1:
            if self.value is None:
                update.failed, update.failure = True, "left out by the test"
            else:
                update.delta[0] = self.value


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_an_update_made_non_finite_in_on_client_end_is_skipped_as_one_from_training(value, execution):
    """on_client_end runs before the aggregation checks (docs/architecture.md): a NaN it writes into an update once
    passed them (every comparison with NaN is false) and stopped the run blaming the strategy; now the client is
    left out, naming the reason, and the round equals one that leaves the client out by marking it failed."""
    runs = {}
    for fault in (value, None):
        torch.manual_seed(0)
        loop = FederatedLoop(
            MLP(input_dim=64, hidden=[16]), client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2,
            clients_per_round=4, seed=0, client_execution=execution,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(2, callbacks=[FedAvg(), DeltaFault(fault)]).fit(loop, datamodule=_data())
        runs[fault is None] = torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach()
        if fault is not None:
            skipped = [str(w.message) for w in caught if " skipped (" in str(w.message)]
            assert len(skipped) == 2 and all(s.endswith("skipped (non-finite model update)") for s in skipped)
    torch.testing.assert_close(runs[False], runs[True], rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_precision_clients_of_thousands_of_samples_are_averaged_not_left_out(precision):
    """A half-precision run with sample-count weights: the round sums w_i Δ_i in float32, so clients of 4,000
    samples are all admitted (the float16 sum's overflow limit |w|·‖Δ‖ < 65504 / 2|S| left every one of them out,
    and then stopped the run as if every update were non-finite), and the global step is the float64 weighted mean
    of the clients' half-precision updates rounded once."""
    from fedlightning.datamodules import ArrayDataset, FederatedDataModule

    class Big(FederatedDataModule):
        """Four clients of 4,000 samples, 16 features, 2 classes."""

        def __init__(self):
            super().__init__(num_clients=4, batch_size=500, val_fraction=0.0)

        def load(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(16000, 16, generator=g)
            y = (x[:, 0] + 0.5 * torch.randn(16000, generator=g) > 0).long()
            data = ArrayDataset(x, y)
            return data, data, y.numpy()

        def natural_clients(self):
            return np.split(np.arange(16000), 4)

    torch.manual_seed(0)
    model = LogisticRegression(input_dim=16, num_classes=2)
    rec = Record()
    sgd = functools.partial(torch.optim.SGD, lr=5.0)
    loop = FederatedLoop(model, client_optimizer=sgd, local_steps=2, clients_per_round=4, seed=0)
    make_trainer(2, callbacks=[FedAvg(weighting="samples"), rec], precision=precision).fit(loop, datamodule=Big())
    assert [r.num_clients for r in rec.results] == [4, 4]  # nobody left out
    for r in (0, 1):
        updates = [(d, n) for rr, _, d, n in rec.updates if rr == r]
        if precision == "16-true" and r == 0:  # each client beyond the float16 sum's limit
            assert min(float(d.norm()) for d, _ in updates) * 4000 > 65504 / 8
        mean = sum(d * n for d, n in updates) / sum(n for _, n in updates)  # float64
        after = rec.start[r + 1] if r + 1 < len(rec.start) else _flat(model)
        # the mean rounded into the parameters' dtype, then the step w - Δ̄ rounded: within eps (|w| + |Δ̄|)
        eps = float(torch.finfo(next(model.parameters()).dtype).eps)
        assert ((after - (rec.start[r] - mean)).abs() <= eps * (rec.start[r].abs() + mean.abs())).all()
