"""FedSPS-Normalized and FedSPS-Global (seed 001, App. D): hand-computed aggregations, and whole runs through the
FederatedLoop against hand-written plain-PyTorch reference loops."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks.base import RoundStatistics, accumulate_core
from fedlightning.callbacks.sps_variants import FedSPSGlobal, FedSPSNormalized
from fedlightning.datamodules import IID
from fedlightning.models import MLP
from fedlightning.optim import SPS
from fedlightning.state import ClientUpdate, RoundPlan
from numerics import RTOL64, Digits64, assert_close64, to_float64


def update(cid, delta, steps, payload=None):
    return ClientUpdate(
        client_id=cid,
        delta=torch.tensor(delta, dtype=torch.float64),
        num_samples=10,
        num_steps=len(steps),
        step_sizes=list(steps),
        payload=dict(payload or {}),
    )


PLAN = RoundPlan(round=0, client_ids=[0, 1], local_steps=2)


# ------------------------------------------------------------------------------------------- hand-computed
@pytest.mark.parametrize(
    "reading,expected",
    [
        # ν1 = 0.5 + 0.5 = 1, ν2 = 1 + 2 = 3; Δ1 = (1, 0), Δ2 = (0, 3)
        ("weighted_models", [0.75, 0.75]),  # (1·Δ1 + Δ2/3) / (1 + 1/3) = (1, 1)/(4/3)
        ("fednova", [1.0, 1.0]),  # mean ν = 2 times mean(Δ_j/ν_j) = ((1, 0) + (0, 1))/2
    ],
)
def test_normalized_aggregation_hand_computed(reading, expected):
    strategy = FedSPSNormalized(reading=reading)
    stats = RoundStatistics()
    for u in (update(0, [1.0, 0.0], [0.5, 0.5]), update(1, [0.0, 3.0], [1.0, 2.0])):
        strategy.on_client_end(None, None, PLAN, u)
        assert not u.failed
        accumulate_core(strategy, stats, u)
        strategy.accumulate(stats, u)
    delta, lr, metrics = strategy.server_update(None, stats, PLAN)
    assert lr is None
    torch.testing.assert_close(delta, torch.tensor(expected, dtype=torch.float64))
    assert metrics["server/mean_normalization"] == pytest.approx(2.0)


def test_normalized_rejects_a_client_that_did_not_move():
    u = update(0, [0.0, 0.0], [0.0, 0.0, float("nan")])
    FedSPSNormalized().on_client_end(None, None, PLAN, u)
    assert u.failed and "positive sum" in u.failure


def test_global_aggregations_hand_computed():
    """Client values with c = 0.5, γ_b = 1: 2/(0.5·8) = 0.5 and min(1/(0.5·1), 1) = 1.
    (a) mean = 0.75; (b) mean gap 1.5 / (0.5 · mean ‖g‖² 4.5) = 2/3."""
    for aggregation, expected in (("mean_of_steps", 0.75), ("ratio_of_means", 2 / 3)):
        strategy = FedSPSGlobal(c=0.5, gamma_max=1.0, aggregation=aggregation, initial_step_size=0.3)
        plan = RoundPlan(round=0, client_ids=[0, 1], local_steps=2, client_lr_scale=2.0)
        strategy.on_round_start(None, None, plan)
        assert plan.client_lr_scale == pytest.approx(0.6)  # composes with other schedules' scale
        stats = RoundStatistics()
        for u in (
            update(0, [1.0, 0.0], [0.3], {"sps_last_loss": 2.0, "sps_last_grad_sq": 8.0}),
            update(1, [0.0, 3.0], [0.3], {"sps_last_loss": 1.0, "sps_last_grad_sq": 1.0}),
        ):
            strategy.on_client_end(None, None, plan, u)
            accumulate_core(strategy, stats, u)
            strategy.accumulate(stats, u)
        delta, lr, metrics = strategy.server_update(None, stats, plan)
        torch.testing.assert_close(delta, torch.tensor([0.5, 1.5], dtype=torch.float64))  # uniform mean
        assert metrics["server/sps_global_step_size"] == 0.3
        assert strategy.step_size == pytest.approx(expected)
        restored = FedSPSGlobal()
        restored.load_state_dict(strategy.state_dict())
        assert restored.step_size == strategy.step_size


def test_global_sps_value_degenerate_cases():
    s = FedSPSGlobal(c=0.5, gamma_max=2.0, f_star=1.0)
    assert s.sps_value(3.0, 8.0) == pytest.approx(0.5)  # (3 - 1)/(0.5·8)
    assert s.sps_value(0.5, 8.0) == 0.0  # loss below f*
    assert s.sps_value(3.0, 0.0) == 2.0  # zero gradient: the cap
    assert s.sps_value(1.0, 0.0) == 0.0  # 0/0


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FedSPSNormalized(reading="harmonic"), "reading"),
        (lambda: FedSPSGlobal(c=0.0), "c must"),
        (lambda: FedSPSGlobal(gamma_max=-1.0), "gamma_max"),
        (lambda: FedSPSGlobal(f_star=float("nan")), "f_star"),
        (lambda: FedSPSGlobal(aggregation="gradient_norm"), "aggregation"),
        (lambda: FedSPSGlobal(initial_step_size=0.0), "initial_step_size"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------------------- whole runs
ROUNDS, CPR, K, SEED, C, GAMMA_B = 3, 3, 4, 5, 2.0, 5.0


def data():
    """Float64 inputs: whole runs are compared with the reference loops in float64 (numerics.RTOL64)."""
    return Digits64(num_clients=6, batch_size=16, partition=IID(), seed=0)


def loss_and_grad(net, names, w, batch):
    w = [p.detach().clone().requires_grad_(True) for p in w]
    out = torch.func.functional_call(net, dict(zip(names, w)), (batch[0],))
    loss = F.cross_entropy(out, batch[1])
    grads = torch.autograd.grad(loss, w)
    return loss.item(), grads, math.fsum(float(g.double().pow(2).sum()) for g in grads)


def client_batches(dm, cid, r):
    loader = dm.client_dataloader(cid, r, seed=SEED)
    it = iter(loader)
    for _ in range(K):
        try:
            yield next(it)
        except StopIteration:
            it = iter(loader)
            yield next(it)


def reference_run(model, variant, reading=None):
    """Plain PyTorch: FedSPS-Global (Alg. 3) or FedSPS-Normalized (Alg. 2) with explicit formulas."""
    dm = data()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    net = copy.deepcopy(model.net)
    names = [n for n, _ in net.named_parameters()]
    glob = [p.detach().clone() for p in net.parameters()]
    gamma, used = None, []
    for r in range(ROUNDS):
        clients = dm.sample_clients(r)
        if variant == "global" and gamma is None:  # client 0's SPS step at iteration 0
            loss, _, gsq = loss_and_grad(net, names, glob, next(iter(dm.client_dataloader(clients[0], r, seed=SEED))))
            gamma = min(loss / (C * gsq), GAMMA_B)
        used.append(gamma)
        deltas, nus, values = [], [], []
        for cid in clients:
            w, nu = [g.clone() for g in glob], 0.0
            for k, batch in enumerate(client_batches(dm, cid, r)):
                loss, grads, gsq = loss_and_grad(net, names, w, batch)
                step = gamma if variant == "global" else min(loss / (C * gsq), GAMMA_B)
                if k == K - 1:
                    values.append(min(loss / (C * gsq), GAMMA_B))
                nu += step
                w = [wi - step * gi for wi, gi in zip(w, grads)]
            deltas.append([g - wi for g, wi in zip(glob, w)])
            nus.append(nu)
        if variant == "global":
            mean = [sum(d[i] for d in deltas) / len(deltas) for i in range(len(glob))]
            gamma = sum(values) / len(values)
        elif reading == "weighted_models":
            total = sum(1 / nu for nu in nus)
            mean = [sum(d[i] / nu for d, nu in zip(deltas, nus)) / total for i in range(len(glob))]
        else:
            scale = sum(nus) / len(nus)
            mean = [scale * sum(d[i] / nu for d, nu in zip(deltas, nus)) / len(nus) for i in range(len(glob))]
        glob = [g - m for g, m in zip(glob, mean)]
    return glob, used


def run_loop(model, strategy, client_optimizer):
    loop = FederatedLoop(model, client_optimizer=client_optimizer, local_steps=K, clients_per_round=CPR, seed=SEED)
    steps = []

    class Recorder(Callback):
        def on_client_end(self, trainer, loop, plan, u):
            steps.append((plan.round, list(u.step_sizes)))

    trainer = make_trainer(ROUNDS, callbacks=[strategy, Recorder()])
    trainer.fit(loop, datamodule=data())
    return loop, trainer, steps


@pytest.mark.numerics
def test_fedsps_global_matches_reference_loop(tmp_path):
    torch.manual_seed(0)
    model = to_float64(MLP(input_dim=64, hidden=[16]))
    init = copy.deepcopy(model)
    strategy = FedSPSGlobal(c=C, gamma_max=GAMMA_B)
    loop, trainer, steps = run_loop(
        model, strategy, lambda p: SPS(p, polyak_c=C, gamma_max=GAMMA_B, fixed_step_size=1.0)
    )
    ref, used = reference_run(init, "global")
    assert used[1] != used[0] and used[2] != used[1]  # the shared step really changes between rounds
    for r, sizes in steps:  # every client step of round r used the round's shared step
        assert sizes == [pytest.approx(used[r], rel=RTOL64)] * K
    for got, want in zip(loop.model.net.parameters(), ref):
        assert_close64(got.detach(), want)
    path = tmp_path / "global.ckpt"
    trainer.save_checkpoint(str(path))
    saved = torch.load(str(path), weights_only=False)["callbacks"][strategy.state_key]
    assert saved["step_size"] == strategy.step_size


@pytest.mark.numerics
@pytest.mark.parametrize("reading", ["weighted_models", "fednova"])
def test_fedsps_normalized_matches_reference_loop(reading):
    torch.manual_seed(1)
    model = to_float64(MLP(input_dim=64, hidden=[16]))
    init = copy.deepcopy(model)
    loop, _, _ = run_loop(model, FedSPSNormalized(reading=reading), lambda p: SPS(p, polyak_c=C, gamma_max=GAMMA_B))
    ref, _ = reference_run(init, "normalized", reading)
    moved = sum(
        float((g.detach() - p.detach()).abs().sum()) for g, p in zip(loop.model.net.parameters(), init.net.parameters())
    )
    assert moved > 1e-2
    for got, want in zip(loop.model.net.parameters(), ref):
        assert_close64(got.detach(), want)


def test_fedsps_global_needs_fixed_step_sps_clients():
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        local_steps=2,
        clients_per_round=2,
    )
    with pytest.raises(TypeError, match="SPS with fixed_step_size=1.0"):
        make_trainer(1, callbacks=[FedSPSGlobal(initial_step_size=0.1)]).fit(loop, datamodule=data())
