"""Server strategies: each rule on hand-computed examples, reductions to FedAvg, the loop applying the rule round
after round (checked against an independent float64 recomputation from the recorded client updates of a float64 run,
to numerics.RTOL64), averaged-iterate evaluation, checkpoint round trips, bad arguments, and every config of this
module running via the CLI."""

import copy
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import (
    FedAdagrad,
    FedAdam,
    FedAMS,
    FedAvg,
    FedAvgM,
    FedExP,
    FedExProx,
    FedLiLS,
    FedLiLU,
    FedYogi,
    KDecay,
    ProximalTerm,
    RuntimeModel,
    Scaffold,
)
from fedlightning.callbacks.base import RoundStatistics, accumulate_core
from fedlightning.datamodules import Dirichlet
from fedlightning.models import LogisticRegression
from fedlightning.state import ClientStateStore, ClientUpdate, RoundPlan, assign_flat_, flat_params
from numerics import RTOL64, Digits64, assert_close64, rtol32, to_float64
from registry import STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ============================================================================ helpers
class FakeLoop:
    """The parts of a FederatedLoop that server rules read: global parameters, client state, the data module."""

    def __init__(self, w, num_clients=10):
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
        self.client_state = ClientStateStore()
        self.num_clients = num_clients
        self.seed = 0

    def global_parameters(self):
        return [self.w]

    @property
    def datamodule(self):
        ids = np.arange(self.num_clients)  # every client holds data
        return SimpleNamespace(num_clients=self.num_clients, clients_with_data=lambda: ids)


def upd(cid, delta, n=1, **kw):
    return ClientUpdate(client_id=cid, delta=torch.tensor(delta, dtype=torch.float64), num_samples=n, **kw)


def server_round(strategy, loop, opt, updates, round=0):
    """What FederatedLoop._server_step does with a strategy: accumulate, server_update, .grad <- Δ, lr, step."""
    stats = RoundStatistics()
    for u in updates:
        accumulate_core(strategy, stats, u)
        strategy.accumulate(stats, u)
    delta, lr, metrics = strategy.server_update(loop, stats, RoundPlan(round, [u.client_id for u in updates], 1))
    loop.w.grad = delta.view_as(loop.w).to(loop.w.dtype).clone()
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    opt.step()
    loop.w.grad = None
    loop.client_state.pop_dirty()  # the round's end, as the loop's exchange of the round's state
    return metrics


def setup_rule(strategy, w0):
    loop = FakeLoop(w0)
    opt = strategy.configure_server_optimizer([loop.w])
    return loop, opt


def assert_vec(t, expected, tol=1e-12):
    torch.testing.assert_close(t.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


class Recorder(Callback):
    """Records w_t, every healthy client update and w_{t+1} of each round (put it last in the callback list)."""

    def __init__(self):
        self.before, self.after, self.updates, self.metrics, self.plans = [], [], [], [], []

    def on_round_start(self, trainer, loop, plan):
        self.before.append(flat_params(loop.global_parameters()).double().clone())
        self.updates.append([])

    def on_client_end(self, trainer, loop, plan, update):
        if not update.failed:
            u = copy.copy(update)
            u.delta = update.delta.detach().double().clone()
            u.step_sizes = list(update.step_sizes)
            self.updates[-1].append(u)

    def on_round_end(self, trainer, loop, result):
        self.after.append(flat_params(loop.global_parameters()).double().clone())
        self.metrics.append(dict(result.metrics))
        self.plans.append(copy.copy(result.plan))


def make_dm(num_clients=12, batch_size=16):
    return Digits64(num_clients=num_clients, batch_size=batch_size, partition=Dirichlet(0.5), seed=2)


def make_loop(local_steps=3, clients_per_round=4, lr=0.2, seed=3, model_seed=1, **kw):
    """A FederatedLoop of a float64 logistic regression (its float32 initial values) with SGD clients."""
    torch.manual_seed(model_seed)
    model = to_float64(LogisticRegression(input_dim=64, num_classes=10))
    return FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        local_steps=local_steps,
        clients_per_round=clients_per_round,
        seed=seed,
        **kw,
    )


def fit(callbacks, rounds=3, dm=None, loop=None, **trainer_kw):
    dm = dm or make_dm()
    loop = loop or make_loop()
    trainer = make_trainer(rounds, callbacks=callbacks, **trainer_kw)
    trainer.fit(loop, datamodule=dm)
    return loop, trainer


def weights(loop):
    return flat_params(loop.global_parameters())


# ============================================================================ FedExP
def test_fedexp_hand_example_extrapolates():
    # Δ_1=[1,0], Δ_2=[0,1], Δ_3=[-1,0]: Δ=[0,1/3], Σ‖Δ_i‖²=3, ‖Δ‖²=1/9; ε=1/18 -> η = 3/(2·3·(1/9+1/18)) = 3
    s = FedExP(eps=1 / 18)
    loop, opt = setup_rule(s, [1.0, 1.0])
    m = server_round(s, loop, opt, [upd(0, [1, 0]), upd(1, [0, 1]), upd(2, [-1, 0])])
    assert m["server/eta_g"] == pytest.approx(3.0, rel=1e-12)
    assert m["server/eta_g_raw"] == pytest.approx(3.0, rel=1e-12)
    assert_vec(loop.w, [1.0, 0.0])


def test_fedexp_reference_code_eps_times_clients():
    # M·ε = 3/18 = 1/6: η = 3 / (6 (1/9 + 1/6)) = 9/5
    s = FedExP(eps=1 / 18, scale_eps_by_clients=True)
    loop, opt = setup_rule(s, [0.0, 0.0])
    m = server_round(s, loop, opt, [upd(0, [1, 0]), upd(1, [0, 1]), upd(2, [-1, 0])])
    assert m["server/eta_g"] == pytest.approx(1.8, rel=1e-12)
    assert m["server/eps"] == pytest.approx(1 / 6, rel=1e-12)
    assert_vec(loop.w, [0.0, -1.8 / 3])


def test_fedexp_identical_clients_clip_to_one():
    # identical Δ_i = d: raw = ‖d‖²/(2(‖d‖²+ε)) < 1/2, so the max{1, ·} branch gives η_g = 1 (FedAvg's step)
    s = FedExP(eps=1e-3)
    loop, opt = setup_rule(s, [2.0, -1.0])
    m = server_round(s, loop, opt, [upd(i, [0.5, -1.0]) for i in range(3)])
    assert m["server/eta_g"] == 1.0
    assert m["server/eta_g_raw"] == pytest.approx(1.25 / (2 * (1.25 + 1e-3)), rel=1e-12)
    assert_vec(loop.w, [1.5, 0.0])


def test_fedexp_sample_weighting_and_zero_eps():
    # n = [1, 2, 1]: Δ = (1·[1,0] + 2·[0,1] + 1·[-1,0])/4 = [0, 1/2]; mean‖Δ_i‖² = (1+2+1)/4 = 1;
    # ε=0 -> η = 1/(2·1/4) = 2
    s = FedExP(eps=0.0, weighting="samples")
    loop, opt = setup_rule(s, [0.0, 0.0])
    m = server_round(s, loop, opt, [upd(0, [1, 0], n=1), upd(1, [0, 1], n=2), upd(2, [-1, 0], n=1)])
    assert m["server/eta_g"] == pytest.approx(2.0, rel=1e-12)
    assert_vec(loop.w, [0.0, -1.0])
    # all-zero deltas with ε = 0: no 0/0, η_g = 1, the weights stay put
    m = server_round(s, loop, opt, [upd(0, [0, 0]), upd(1, [0, 0])])
    assert m["server/eta_g"] == 1.0 and torch.isfinite(loop.w).all()
    assert_vec(loop.w, [0.0, -1.0])


def test_fedexp_forced_to_one_equals_fedavg_exactly():
    """ε → ∞ forces η_g = 1 every round: FedExP is then FedAvg with uniform weights, bit for bit."""
    a, _ = fit([FedExP(eps=1e30)], rounds=3)
    b, _ = fit([FedAvg(weighting="uniform")], rounds=3)
    assert torch.equal(weights(a), weights(b))
    c, _ = fit([FedExP(eps=1e-3)], rounds=3)
    assert not torch.equal(weights(a), weights(c))  # the extrapolation does change the run


@pytest.mark.numerics
def test_fedexp_loop_applies_the_rule_every_round():
    rec = Recorder()
    fit([FedExP(eps=1e-3), rec], rounds=3)
    for r in range(3):
        deltas = [u.delta for u in rec.updates[r]]
        mean = torch.stack(deltas).mean(0)
        raw = sum(float(d.pow(2).sum()) for d in deltas) / (2 * len(deltas) * (float(mean.pow(2).sum()) + 1e-3))
        eta = max(1.0, raw)
        assert rec.metrics[r]["server/eta_g"] == pytest.approx(eta, rel=RTOL64)
        assert rec.metrics[r]["server/eta_g_raw"] == pytest.approx(raw, rel=RTOL64)
        assert_close64(rec.after[r], rec.before[r] - eta * mean)
    assert max(m["server/eta_g"] for m in rec.metrics) > 1.0  # this run exercises the extrapolation branch


class ValLossRecorder(Callback):
    def __init__(self):
        self.losses, self.steps = [], []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val/loss"]))
            self.steps.append(trainer.global_step)


def _test_loss(loop, dm, flat):
    """Loss of the weights ``flat`` on the validation split (what Lightning's validation loop evaluates)."""
    model = copy.deepcopy(loop.model)
    assign_flat_([p for p in model.parameters() if p.requires_grad], flat)
    val = torch.as_tensor(dm.val_indices)
    x, y = dm.train_dataset.x[val], dm.train_dataset.y[val]
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def test_fedexp_evaluates_mean_of_last_two_iterates_and_trains_on(tmp_path):
    rec, vals = Recorder(), ValLossRecorder()
    dm = make_dm()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, save_top_k=0)
    loop, trainer = fit(
        [FedExP(eps=1e-3, evaluate_iterate_average=True), rec, vals, ckpt],
        rounds=3,
        dm=dm,
        limit_val_batches=None,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
    )
    assert vals.steps == [1, 2, 3]
    # after round 0 the reference code evaluates w_1 itself; later (w_t + w_{t+1}) / 2. The logged loss is float32
    # (Lightning's batch-size weighted mean of the validation batches' losses: a few float32 roundings)
    logged = rtol32(4)
    assert vals.losses[0] == pytest.approx(_test_loss(loop, dm, rec.after[0]), rel=logged)
    for r in (1, 2):
        avg = (rec.before[r] + rec.after[r]) / 2
        assert vals.losses[r] == pytest.approx(_test_loss(loop, dm, avg), rel=logged)
        assert vals.losses[r] != pytest.approx(_test_loss(loop, dm, rec.after[r]), abs=1e-5)
    # training continued from w_{t+1}: identical to a run without the averaged evaluation
    plain, _ = fit(
        [FedExP(eps=1e-3)],
        rounds=3,
        dm=make_dm(),
        limit_val_batches=None,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )
    assert torch.equal(weights(loop), weights(plain))
    # the checkpoint written at the last validation holds w_{t+1}, not the average
    state = torch.load(os.path.join(str(tmp_path), "last.ckpt"), weights_only=False)["state_dict"]
    saved = torch.cat([state[k].reshape(-1) for k in state if k.startswith("model.")])
    assert torch.equal(saved, weights(loop))


# ============================================================================ FedExProx / ProximalTerm
def test_fedexprox_grads_and_constant_rules():
    # GraDS α = mean‖Δ_i‖²/‖Δ‖² = 1/(1/9) = 9 (no 1/2, no max)
    s = FedExProx(mu=1.0, rule="grads")
    loop, opt = setup_rule(s, [0.0, 0.0])
    m = server_round(s, loop, opt, [upd(0, [1, 0]), upd(1, [0, 1]), upd(2, [-1, 0])])
    assert m["server/eta_g"] == pytest.approx(9.0, rel=1e-12)
    assert_vec(loop.w, [0.0, -3.0])
    s = FedExProx(mu=1.0, rule="constant", server_lr=2.5)
    loop, opt = setup_rule(s, [0.0, 0.0])
    m = server_round(s, loop, opt, [upd(0, [1, 0]), upd(1, [0, 1]), upd(2, [-1, 0])])
    assert m["server/eta_g"] == 2.5
    assert_vec(loop.w, [0.0, -2.5 / 3])


@pytest.mark.parametrize("make", [lambda: ProximalTerm(0.5), lambda: FedExProx(mu=0.5)])
def test_proximal_term_value_and_gradient(make):
    cb = make()
    loop = FakeLoop([1.0, -2.0])
    (term,) = cb.client_objective(None, loop, RoundPlan(0, [0], 1), 0)
    p = torch.tensor([2.0, 0.0], dtype=torch.float64, requires_grad=True)
    value = term([p])
    assert float(value.detach()) == pytest.approx(0.25 * (1.0 + 4.0))  # μ/2 ‖p − w_t‖²
    value.backward()
    assert_vec(p.grad, [0.5 * 1.0, 0.5 * 2.0])  # μ (p − w_t)
    assert ProximalTerm(0.0).client_objective(None, loop, RoundPlan(0, [0], 1), 0) == []


def test_fedexprox_loop_matches_independent_recomputation():
    rec = Recorder()
    fit([FedExProx(mu=0.3, rule="grads"), rec], rounds=3)
    for r in range(3):
        deltas = [u.delta for u in rec.updates[r]]
        mean = torch.stack(deltas).mean(0)
        alpha = sum(float(d.pow(2).sum()) for d in deltas) / len(deltas) / float(mean.pow(2).sum())
        assert alpha >= 1.0
        assert_close64(rec.after[r], rec.before[r] - alpha * mean)


def test_fedexprox_rejects_a_second_proximal_term():
    with pytest.raises(ValueError, match="ProximalTerm"):
        fit([FedExProx(mu=0.3), ProximalTerm(0.3)], rounds=1)


# ============================================================================ adaptive servers
def test_fedadam_two_rounds_by_hand():
    lr, tau, b1, b2 = 0.1, 0.5, 0.9, 0.99
    s = FedAdam(server_lr=lr, betas=(b1, b2), tau=tau)
    loop, opt = setup_rule(s, [1.0, 1.0])
    server_round(s, loop, opt, [upd(0, [1.0, -2.0])])
    m1 = [0.1, -0.2]
    v1 = [0.99 * 0.25 + 0.01 * 1.0, 0.99 * 0.25 + 0.01 * 4.0]  # v_{-1} = τ²
    w1 = [1.0 - lr * m1[i] / (math.sqrt(v1[i]) + tau) for i in range(2)]
    assert_vec(loop.w, w1)
    server_round(s, loop, opt, [upd(0, [0.5, 0.5])])
    m2 = [0.9 * m1[i] + 0.1 * 0.5 for i in range(2)]
    v2 = [0.99 * v1[i] + 0.01 * 0.25 for i in range(2)]
    assert_vec(loop.w, [w1[i] - lr * m2[i] / (math.sqrt(v2[i]) + tau) for i in range(2)])


def test_fedyogi_sign_rule_by_hand():
    lr, tau = 0.1, 0.5
    s = FedYogi(server_lr=lr, betas=(0.9, 0.99), tau=tau)
    loop, opt = setup_rule(s, [0.0, 0.0])
    server_round(s, loop, opt, [upd(0, [1.0, -2.0])])
    # v_{-1} - Δ² = [0.25-1, 0.25-4] < 0 -> sign = -1 -> v grows by (1-β2) Δ²
    v1 = [0.25 + 0.01 * 1.0, 0.25 + 0.01 * 4.0]
    m1 = [0.1, -0.2]
    w1 = [-lr * m1[i] / (math.sqrt(v1[i]) + tau) for i in range(2)]
    assert_vec(loop.w, w1)
    server_round(s, loop, opt, [upd(0, [0.1, 0.1])])
    # now v - Δ² = v - 0.01 > 0 -> sign = +1 -> v shrinks by (1-β2) Δ²
    v2 = [v1[i] - 0.01 * 0.01 for i in range(2)]
    m2 = [0.9 * m1[i] + 0.1 * 0.1 for i in range(2)]
    assert_vec(loop.w, [w1[i] - lr * m2[i] / (math.sqrt(v2[i]) + tau) for i in range(2)])


def test_fedadagrad_by_hand():
    s = FedAdagrad(server_lr=0.1, betas=(0.9, 0.99), tau=0.5)
    loop, opt = setup_rule(s, [0.0, 0.0])
    server_round(s, loop, opt, [upd(0, [1.0, -2.0])])
    v1 = [0.25 + 1.0, 0.25 + 4.0]  # β2 plays no role
    assert_vec(loop.w, [-0.1 * 0.1 / (math.sqrt(v1[0]) + 0.5), 0.1 * 0.2 / (math.sqrt(v1[1]) + 0.5)])


def test_fedams_max_stabilisation_by_hand():
    lr, eps = 1.0, 0.5
    s = FedAMS(server_lr=lr, betas=(0.9, 0.99), ams_eps=eps)
    loop, opt = setup_rule(s, [0.0, 0.0])
    server_round(s, loop, opt, [upd(0, [1.0, -2.0])])
    m1, v1 = [0.1, -0.2], [0.01, 0.04]
    vhat1 = [max(0.0, v1[i], eps) for i in range(2)]  # = [0.5, 0.5]: ε bounds the denominator
    w1 = [-lr * m1[i] / math.sqrt(vhat1[i]) for i in range(2)]
    assert_vec(loop.w, w1)
    server_round(s, loop, opt, [upd(0, [10.0, 0.0])])
    m2 = [0.9 * m1[0] + 1.0, 0.9 * m1[1]]
    v2 = [0.99 * v1[0] + 0.01 * 100.0, 0.99 * v1[1]]
    vhat2 = [max(vhat1[i], v2[i], eps) for i in range(2)]  # [1.0099, 0.5]
    w2 = [w1[i] - lr * m2[i] / math.sqrt(vhat2[i]) for i in range(2)]
    assert_vec(loop.w, w2)
    server_round(s, loop, opt, [upd(0, [0.0, 0.0])])
    m3 = [0.9 * m2[i] for i in range(2)]
    v3 = [0.99 * v2[i] for i in range(2)]
    vhat3 = [max(vhat2[i], v3[i], eps) for i in range(2)]
    assert vhat3[0] == vhat2[0] > v3[0]  # the running max keeps the old, larger value
    assert_vec(loop.w, [w2[i] - lr * m3[i] / math.sqrt(vhat3[i]) for i in range(2)])


def test_fedavgm_by_hand():
    s = FedAvgM(server_lr=0.5, momentum=0.9, weighting="uniform")
    loop, opt = setup_rule(s, [1.0, 1.0])
    server_round(s, loop, opt, [upd(0, [1.0, 0.0]), upd(1, [1.0, 2.0])])  # Δ1 = [1, 1]
    assert_vec(loop.w, [0.5, 0.5])
    server_round(s, loop, opt, [upd(0, [0.0, 2.0])])  # u2 = 0.9·[1,1] + [0,2]
    assert_vec(loop.w, [0.5 - 0.5 * 0.9, 0.5 - 0.5 * 2.9])


@pytest.mark.numerics
def test_fedadam_loop_matches_independent_recomputation():
    rec = Recorder()
    fit([FedAdam(server_lr=0.05, betas=(0.8, 0.9), tau=1e-2), rec], rounds=3)
    m = torch.zeros_like(rec.before[0])
    v = torch.full_like(rec.before[0], 1e-4)
    for r in range(3):
        mean = torch.stack([u.delta for u in rec.updates[r]]).mean(0)  # uniform (Reddi et al.)
        m = 0.8 * m + 0.2 * mean
        v = 0.9 * v + 0.1 * mean**2
        assert_close64(rec.after[r], rec.before[r] - 0.05 * m / (v.sqrt() + 1e-2))
    assert rec.metrics[-1]["server/first_moment_norm"] == pytest.approx(float(m.norm()), rel=RTOL64)
    assert rec.metrics[-1]["server/second_moment_max"] == pytest.approx(float(v.max()), rel=RTOL64)


# ============================================================================ FedLi
def test_fedlils_uses_max_of_last_step_sizes():
    s = FedLiLS()
    loop, opt = setup_rule(s, [1.0, 1.0])
    ups = [upd(0, [4.0, 0.0], n=1, step_sizes=[0.1, 0.5]), upd(1, [0.0, 4.0], n=3, step_sizes=[2.0, 0.3])]
    m = server_round(s, loop, opt, ups)
    assert m["server/eta_g"] == 0.5  # max of the LAST steps (0.5, 0.3), not of all steps (2.0)
    assert_vec(loop.w, [1.0 - 0.5 * 1.0, 1.0 - 0.5 * 3.0])  # Δ = (1·[4,0] + 3·[0,4])/4 = [1, 3]
    s = FedLiLS(convex=True)
    loop, opt = setup_rule(s, [1.0, 1.0])
    assert server_round(s, loop, opt, ups)["server/eta_g"] == 1.0
    assert_vec(loop.w, [0.0, -2.0])
    s = FedLiLS()
    loop, opt = setup_rule(s, [1.0, 1.0])
    with pytest.raises(RuntimeError, match="step size"):
        server_round(s, loop, opt, [upd(0, [1.0, 0.0], step_sizes=[float("nan")])])


def test_fedlilu_dfw_step_by_hand():
    lr, lam, mu = 0.5, 0.1, 0.5
    s = FedLiLU(lr=lr, momentum=mu, weight_decay=lam, dfw_eps=0.0)
    loop, opt = setup_rule(s, [1.0, 2.0])
    # round 1: Δ = ([2,0] + [0,0])/2 = [1,0]; F̂ = (1.0 + 0.2)/2 = 0.6; r = λw = [0.1, 0.2]
    m = server_round(s, loop, opt, [upd(0, [2.0, 0.0], mean_loss=1.0), upd(1, [0.0, 0.0], mean_loss=0.2)])
    raw = (0.6 - lr * 0.1) / (lr * 1.0)  # (F̂ − η⟨r,Δ⟩)/(η‖Δ‖²) = 1.1 -> clipped to 1
    assert m["server/dfw_gamma_raw"] == pytest.approx(raw) and m["server/dfw_gamma"] == 1.0
    z1 = [-lr * 1.0 * (1.0 + 0.1), -lr * 1.0 * (0.0 + 0.2)]
    w1 = [1.0 - lr * (0.1 + 1.0) + mu * z1[0], 2.0 - lr * (0.2 + 0.0) + mu * z1[1]]
    assert_vec(loop.w, w1)
    # round 2: Δ = [1,0], F̂ = 0.1, r = λ w1: γ inside (0, 1); the momentum z1 carries over
    m = server_round(s, loop, opt, [upd(0, [1.0, 0.0], mean_loss=0.1), upd(1, [1.0, 0.0], mean_loss=0.1)])
    r = [lam * w1[0], lam * w1[1]]
    gamma = (0.1 - lr * r[0]) / lr
    assert 0 < gamma < 1 and m["server/dfw_gamma"] == pytest.approx(gamma)
    assert m["server/eta_g"] == pytest.approx(lr * gamma)
    z2 = [mu * z1[0] - lr * gamma * (1.0 + r[0]), mu * z1[1] - lr * gamma * (0.0 + r[1])]
    w2 = [w1[0] - lr * (r[0] + gamma * 1.0) + mu * z2[0], w1[1] - lr * r[1] + mu * z2[1]]
    assert_vec(loop.w, w2)
    # a loss below the regulariser's correction gives γ = 0: only weight decay (and momentum) act
    s = FedLiLU(lr=lr, momentum=0.0, weight_decay=lam, dfw_eps=0.0)
    loop, opt = setup_rule(s, [1.0, 2.0])
    m = server_round(s, loop, opt, [upd(0, [1.0, 0.0], mean_loss=0.0)])
    assert m["server/dfw_gamma"] == 0.0 and m["server/dfw_gamma_raw"] < 0
    assert_vec(loop.w, [1.0 - lr * 0.1, 2.0 - lr * 0.2])


def test_fedlilu_first_loss_option():
    s = FedLiLU(lr=1.0, momentum=0.0, weight_decay=0.0, dfw_eps=0.0, client_loss="first")
    loop, opt = setup_rule(s, [0.0, 0.0])
    m = server_round(s, loop, opt, [upd(0, [2.0, 0.0], mean_loss=9.0, first_loss=1.0)])
    assert m["server/pseudo_objective"] == 1.0 and m["server/dfw_gamma"] == pytest.approx(0.25)


@pytest.mark.numerics
def test_fedli_loop_matches_independent_recomputation():
    rec = Recorder()
    fit([FedLiLU(lr=1.0, momentum=0.5, weight_decay=1e-2, dfw_eps=1e-5), rec], rounds=3)
    z = torch.zeros_like(rec.before[0])
    for r in range(3):
        n = torch.tensor([float(u.num_samples) for u in rec.updates[r]], dtype=torch.float64)
        mean = (torch.stack([u.delta for u in rec.updates[r]]) * n[:, None]).sum(0) / n.sum()
        f_hat = float(sum(u.num_samples * u.mean_loss for u in rec.updates[r]) / n.sum())
        w = rec.before[r]
        reg = 1e-2 * w
        gamma = min(1.0, max(0.0, (f_hat - float(reg @ mean)) / (float(mean @ mean) + 1e-5)))
        z = 0.5 * z - gamma * (mean + reg)
        assert_close64(rec.after[r], w - (reg + gamma * mean) + 0.5 * z)
        assert rec.metrics[r]["server/dfw_gamma"] == pytest.approx(gamma, rel=RTOL64, abs=RTOL64)
    rec = Recorder()
    fit([FedLiLS(), rec], rounds=2, loop=make_loop(lr=0.3))
    for r in range(2):  # SGD clients report their lr as the step size: η_g = 0.3
        n = torch.tensor([float(u.num_samples) for u in rec.updates[r]], dtype=torch.float64)
        mean = (torch.stack([u.delta for u in rec.updates[r]]) * n[:, None]).sum(0) / n.sum()
        assert_close64(rec.after[r], rec.before[r] - 0.3 * mean)


# ============================================================================ checkpoint round trips
def _state_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


ROUND_TRIP = {
    **{
        name: (lambda case=STRATEGIES[name]: [case()])
        for name in ("fedadam", "fedyogi", "fedadagrad", "fedams", "fedavgm", "fedlilu", "scaffold", "fedexp-average")
    },
    "kdecay_runtime": lambda: [
        KDecay(schedule="error", window=2, reference_loss="first_round"),
        RuntimeModel(seconds_per_batch=0.01),
    ],
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_state_round_trips_through_a_lightning_checkpoint(tmp_path, name):
    """2 rounds, save, resume to 4 == 4 rounds uninterrupted (weights bit for bit, strategy state equal)."""
    path = str(tmp_path / "mid.ckpt")
    cbs = ROUND_TRIP[name]()
    loop, trainer = fit(cbs, rounds=2)
    trainer.save_checkpoint(path)
    saved_states = [copy.deepcopy(cb.state_dict()) for cb in cbs]
    saved_opt = copy.deepcopy(trainer.optimizers[0].state_dict())
    # restore only (max_steps already reached): the fresh callbacks and optimizer now hold the saved state
    cbs2 = ROUND_TRIP[name]()
    loop2, trainer2 = make_loop(model_seed=99), make_trainer(2, callbacks=cbs2)
    trainer2.fit(loop2, datamodule=make_dm(), ckpt_path=path)
    assert torch.equal(weights(loop2), weights(loop))
    for a, b in zip(saved_states, cbs2):
        assert _state_equal(a, b.state_dict())
    assert _state_equal(saved_opt["state"], trainer2.optimizers[0].state_dict()["state"])
    nontrivial = [s for s in saved_states if any(v is not None for v in s.values())] or [saved_opt["state"]]
    assert nontrivial and any(_has_content(s) for s in nontrivial)
    # resume to 4 rounds == uninterrupted 4 rounds
    cbs3 = ROUND_TRIP[name]()
    loop3, trainer3 = make_loop(model_seed=99), make_trainer(4, callbacks=cbs3)
    trainer3.fit(loop3, datamodule=make_dm(), ckpt_path=path)
    cbs4 = ROUND_TRIP[name]()
    loop4, _ = fit(cbs4, rounds=4)
    assert torch.equal(weights(loop3), weights(loop4))
    for a, b in zip(cbs3, cbs4):
        assert _state_equal(a.state_dict(), b.state_dict())


def _has_content(state):
    if isinstance(state, torch.Tensor):
        return bool(state.abs().sum() > 0)
    if isinstance(state, dict):
        return any(_has_content(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return len(state) > 0
    return isinstance(state, (int, float)) and state != 0


# ============================================================================ bad arguments
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FedExP(eps=-1e-3), "eps"),
        (lambda: FedExP(eps=float("nan")), "eps"),
        (lambda: FedExP(weighting="median"), "weighting"),
        (lambda: FedExProx(mu=-0.1), "mu"),
        (lambda: FedExProx(mu=0.1, rule="stops"), "rule"),
        (lambda: FedExProx(mu=0.1, eps=-1.0), "eps"),
        (lambda: ProximalTerm(mu=-1.0), "mu"),
        (lambda: ProximalTerm(mu=float("inf")), "mu"),
        (lambda: FedAdam(betas=(0.9, 1.0)), "betas"),
        (lambda: FedAdam(betas=(-0.1, 0.99)), "betas"),
        (lambda: FedYogi(betas=(0.9,)), "betas"),
        (lambda: FedAMS(betas=(1.5, 0.9)), "betas"),
        (lambda: FedAdam(tau=0.0), "tau"),
        (lambda: FedAdagrad(tau=-1e-3), "tau"),
        (lambda: FedAdam(server_lr=0.0), "server_lr"),
        (lambda: FedAvgM(momentum=1.0), "momentum"),
        (lambda: FedLiLU(lr=0.0), "lr"),
        (lambda: FedLiLU(momentum=1.0), "momentum"),
        (lambda: FedLiLU(dfw_eps=-1e-5), "eps"),
        (lambda: FedLiLU(weight_decay=-1.0), "weight_decay"),
        (lambda: FedLiLU(client_loss="last"), "client_loss"),
        (lambda: Scaffold(server_lr=-1.0), "server_lr"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ============================================================================ configs through the CLI
CONFIGS = {
    # name: (strategy class name or None, metric key that proves the rule ran)
    "fedexp": ("FedExP", "server/eta_g_raw"),
    "fedexpsls": ("FedExP", "server/eta_g_raw"),
    "fedexprox": ("FedExProx", "server/eta_g"),
    "fedprox": ("FedAvg", "server/lr"),
    "fedadam": ("FedAdam", "server/second_moment_mean"),
    "fedyogi": ("FedYogi", "server/second_moment_mean"),
    "fedams": ("FedAMS", "server/second_moment_max"),
    "fedavgm": ("FedAvgM", "server/first_moment_norm"),
    "fedlils": ("FedLiLS", "server/max_client_last_step"),
    "fedlilu": ("FedLiLU", "server/dfw_gamma"),
    "scaffold": ("Scaffold", "server/control_norm"),
    "feddane": ("FedDANE", "feddane/gradient_norm"),
    "kdecay_rounds": ("FedAvg", "runtime/wall_clock_seconds"),
    "kdecay_error": ("FedAvg", "runtime/wall_clock_seconds"),
    "kdecay_step": ("FedAvg", "runtime/wall_clock_seconds"),
    "dsgd": ("FedAvg", "runtime/wall_clock_seconds"),
}


def _has_sgd_armijo():
    import fedlightning.optim as optim

    return hasattr(optim, "SgdArmijo")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_runs_two_rounds_through_the_cli(tmp_path, name):
    from fedlightning.cli import main

    if name in ("fedexpsls", "fedlils") and not _has_sgd_armijo():
        pytest.skip("fedlightning.optim.SgdArmijo is not available yet")
    args = [
        "fit",
        "--config",
        os.path.join(ROOT, "configs", f"{name}.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.clients_per_round",
        "4",
    ]
    if name != "dsgd":
        args += ["--model.local_steps", "8"]
    cli = main(args)
    trainer = cli.trainer
    assert trainer.global_step == 2
    strategy, key = CONFIGS[name]
    assert type(cli.model.strategy).__name__ == strategy
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert key in metrics and math.isfinite(metrics[key])
    assert torch.isfinite(weights(cli.model)).all()
    local_steps = {"kdecay_rounds": 7, "dsgd": 1}.get(name, 8)  # round 2: ⌈8·2^(-1/3)⌉ = ⌈6.35⌉ = 7
    assert metrics["round/local_steps"] == local_steps
    if name == "feddane":
        assert metrics["round/communication_rounds"] == 4.0
    if name == "fedprox":
        assert any(isinstance(cb, ProximalTerm) and cb.mu > 0 for cb in trainer.callbacks)
    if name in ("fedexpsls", "fedlils"):
        opt = cli.model.client_optimizer([torch.nn.Parameter(torch.zeros(2))])
        assert type(opt).__name__ == "SgdArmijo"
