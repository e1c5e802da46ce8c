"""Client-optimizer and schedule semantics: switching optimizer / strategy classes in a configuration never carries a
parameter into another meaning; the client step-size scale reaches every client optimizer (or is refused); FedLi-LS
uses the last accepted step; per-epoch growth factors grow by δ over one local epoch."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FedLiLS, FedSPSGlobal, KDecay
from fedlightning.callbacks.base import RoundStatistics, accumulate_core
from fedlightning.cli import main as cli_main
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.optim import SPS, DecSPS, SgdArmijo, check_client_step_scalable, scale_client_step
from fedlightning.state import ClientUpdate, RoundPlan
from registry import CLIENT_OPTIMIZERS, params
from test_vectorized import assert_same_run, fit, mlp

DT = torch.float64
QUIET = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]


# ------------------------------------------------------------------------------------------ configuration switches
def cli_client_optimizer(args):
    cli = cli_main(args + QUIET, run=False)
    return cli, cli.model.client_optimizer([torch.nn.Parameter(torch.zeros(1, dtype=DT))])


def offset_quadratic(w, a=2.0, b0=0.3):
    """f(w) = a/2 w² + b0: the Polyak ratio (f - 0)/(c g²) changes with w (a pure quadratic's would not)."""
    return lambda: 0.5 * a * (w * w).sum() + b0


def polyak_step(w, a=2.0, b0=0.3, c=0.5, cap=1.0):
    f, g2 = 0.5 * a * w * w + b0, (a * w) ** 2
    return min(f / (c * g2), cap)


def test_cli_switch_from_sgd_to_sps_gives_adaptive_sps(tmp_path):
    """quickstart's SGD has lr: 0.1; SPS has no lr, so the switch (on the command line or through a second config
    file) gives adaptive SPS whose first step is the Polyak step, not the fixed 0.1."""
    second = tmp_path / "sps.yaml"
    second.write_text("model:\n  client_optimizer:\n    class_path: fedlightning.optim.SPS\n")
    for switch in (["--model.client_optimizer=fedlightning.optim.SPS"], ["--config", str(second)]):
        _, opt = cli_client_optimizer(["--config", "configs/quickstart.yaml", *switch])
        assert isinstance(opt, SPS) and opt.hyper.get("fixed_step_size") is None
        w = opt.param_groups[0]["params"][0]
        with torch.no_grad():
            w.fill_(0.4)
        opt.zero_grad()
        opt.step(offset_quadratic(w))
        expected = polyak_step(0.4)  # (0.16 + 0.3) / (0.5 * 0.64) = 1.4375 -> capped at gamma_max = 1
        assert opt.last_step["step_size"] == pytest.approx(expected) and expected != 0.1
        assert w.item() == pytest.approx(0.4 - expected * 0.8)


def test_cli_switch_from_armijo_to_sps_keeps_the_polyak_constant():
    """configs/fedsls.yaml sets SgdArmijo's c: 0.1 (Armijo constant); SPS's constant is polyak_c, default 0.5."""
    _, opt = cli_client_optimizer(
        ["--config", "configs/fedsls.yaml", "--model.client_optimizer=fedlightning.optim.SPS"]
    )
    assert isinstance(opt, SPS) and opt.hyper["polyak_c"] == 0.5 and "c" not in opt.hyper


def test_cli_switch_between_strategies_does_not_carry_epsilons(tmp_path):
    """FedAdam's τ (tau) and FedExP's / FedLi-LU's ε have different names, so none is carried into another."""
    adam = tmp_path / "adam.yaml"
    adam.write_text(
        "trainer:\n  callbacks:\n  - class_path: fedlightning.callbacks.FedAdam\n    init_args:\n      tau: 0.5\n"
    )
    expected = {
        "fedlightning.callbacks.FedExP": 1e-3,
        "fedlightning.callbacks.FedLiLU": 1e-5,
        "fedlightning.callbacks.FedAMS": 1e-3,
    }
    for class_path, default_eps in expected.items():
        other = tmp_path / "other.yaml"
        other.write_text(f"trainer:\n  callbacks:\n  - class_path: {class_path}\n")
        cli = cli_main(
            ["--config", "configs/quickstart.yaml", "--config", str(adam), "--config", str(other)] + QUIET, run=False
        )
        strategy = cli.trainer.callbacks[0]
        assert type(strategy).__name__ == class_path.rsplit(".", 1)[1]
        assert strategy.eps == default_eps


def test_old_parameter_names_are_refused():
    w = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(TypeError, match="'lr'"):
        SPS([w], lr=0.1)
    with pytest.raises(TypeError, match="'c'"):
        SPS([w], c=0.5)
    from fedlightning.callbacks import FedAdam, FedAMS, FedLiLU

    for make, name in (
        (lambda: FedAdam(eps=0.1), "'eps'"),
        (lambda: FedAMS(eps=0.1), "'eps'"),
        (lambda: FedLiLU(eps=0.1), "'eps'"),
    ):
        with pytest.raises(TypeError, match=name):
            make()


# ------------------------------------------------------------------------------------------ client step-size scale
def test_scale_client_step_multiplies_torch_lr_and_refuses_optimizers_without_a_step_size():
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.3)
    scale_client_step(sgd, 0.5)
    assert sgd.param_groups[0]["lr"] == 0.15

    class NoStepSize(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"momentum": 0.9})

    with pytest.raises(ValueError, match="client optimizer NoStepSize has no step size"):
        scale_client_step(NoStepSize([w]), 0.5)
    with pytest.raises(ValueError, match="NoStepSize"):
        check_client_step_scalable(NoStepSize([w]))
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="client_lr_scale must be a finite number >= 0"):
            scale_client_step(sgd, bad)


def test_scaled_armijo_applies_scale_times_the_accepted_step_and_keeps_its_state_unscaled():
    """f = 1/2·a·w², a = 3, η_max = 1, β = 0.5, c = 0.1: the Armijo test f(w - ηg) <= f - cη g² holds first at
    η = 0.5 (1 fails: (1 - 3)² > 1 - 0.6). Scale 0.4: w moves by 0.4·0.5·g, the state keeps 0.5."""
    s = 0.4
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last")
    scale_client_step(opt, s)
    opt.zero_grad()
    opt.step(lambda: 1.5 * (w * w).sum())
    assert w.item() == pytest.approx(1.0 - s * 0.5 * 3.0)
    assert opt.last_step["step_size"] == pytest.approx(s * 0.5) and opt.last_step["backtracks"] == 1
    assert opt.get_client_state() == {"step_size": 0.5, "accepted_step_size": 0.5}
    opt.zero_grad()
    opt.step(lambda: 1.5 * (w * w).sum())  # "last": starts at the unscaled 0.5, accepted at once
    assert opt.last_step["backtracks"] == 0 and opt.last_step["step_size"] == pytest.approx(s * 0.5)


@pytest.mark.parametrize("smooth", [False, True])
def test_scaled_sps_applies_scale_times_the_polyak_step(smooth):
    s, w0, steps = 0.3, 0.9, 4
    w = torch.nn.Parameter(torch.tensor([w0], dtype=DT))
    opt = SPS([w], polyak_c=0.5, gamma_max=0.8, smooth=smooth, smooth_factor=2.0, n_batches_per_epoch=2)
    scale_client_step(opt, s)
    x, prev = w0, None
    for _ in range(steps):
        cap = 0.8 if (not smooth or prev is None) else 2.0**0.5 * prev  # the cap grows from the unscaled step
        gamma = polyak_step(x, cap=cap, c=0.5)
        x, prev = x - s * gamma * 2.0 * x, gamma
        opt.zero_grad()
        opt.step(offset_quadratic(w))
        assert opt.last_step["step_size"] == pytest.approx(s * gamma)
        assert opt.last_step["sps_step_size"] == pytest.approx(gamma)
        assert w.item() == pytest.approx(x)
    assert opt.get_client_state() == ({"prev_step": pytest.approx(prev)} if smooth else {})


def test_scaled_decsps_applies_scale_times_its_step_with_unscaled_state():
    s, c0, gamma_b = 0.5, 0.5, 1.0
    w = torch.nn.Parameter(torch.tensor([0.7], dtype=DT))
    opt = DecSPS([w], c0=c0, gamma_max=gamma_b)
    scale_client_step(opt, s)
    x, prev = 0.7, gamma_b
    for t in range(4):
        f, g2 = x * x + 0.3, (2.0 * x) ** 2
        c_prev, c_t = (c0 * math.sqrt(t) if t >= 1 else c0), c0 * math.sqrt(t + 1)
        gamma = min(f / g2, c_prev * prev) / c_t
        x, prev = x - s * gamma * 2.0 * x, gamma
        opt.zero_grad()
        opt.step(offset_quadratic(w))
        assert opt.last_step["step_size"] == pytest.approx(s * gamma)
        assert w.item() == pytest.approx(x)
    assert opt.get_client_state() == {"t": 4, "gamma_prev": pytest.approx(prev)}


def test_scaled_fixed_step_sps_applies_scale_times_the_fixed_step():
    w = torch.nn.Parameter(torch.tensor([0.5], dtype=DT))
    opt = SPS([w], fixed_step_size=0.2)
    scale_client_step(opt, 0.25)
    opt.zero_grad()
    opt.step(offset_quadratic(w))
    assert w.item() == pytest.approx(0.5 - 0.05 * 1.0) and opt.last_step["step_size"] == pytest.approx(0.05)


class StepSizes(pl.Callback):
    def __init__(self):
        self.by_round = {}
        self.metrics = {}

    def on_client_end(self, trainer, loop, plan, update):
        self.by_round.setdefault(plan.round, []).extend(update.step_sizes)

    def on_round_end(self, trainer, loop, result):
        self.metrics[result.plan.round] = dict(result.metrics)


def digits():
    return DigitsDataModule(num_clients=20, batch_size=16, partition=Dirichlet(0.3), seed=0)


@pytest.mark.parametrize(
    "optimizer,step",
    [
        # tiny caps: Armijo accepts eta_max at once, the Polyak ratios exceed gamma_b, so every unscaled step is
        # the cap and the scaled one is 0.1 times it
        (lambda p: SgdArmijo(p, eta_max=1e-3), 1e-3),
        (lambda p: SPS(p, gamma_max=1e-3), 1e-3),
        (lambda p: DecSPS(p, gamma_max=1e-3), None),
    ],
    ids=["armijo", "sps", "decsps"],
)
def test_kdecay_client_lr_reaches_adaptive_clients(optimizer, step):
    """KDecay(step schedule from round 2, factor 10): round 1 runs the rule as is, round 2 applies a tenth of it."""
    rec = StepSizes()
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]),
        client_optimizer=optimizer,
        local_steps=3,
        clients_per_round=3,
        seed=0,
        persist_client_state=False,
    )
    kdecay = KDecay(schedule="step", decay="client_lr", step_round=2, step_factor=10.0)
    make_trainer(2, callbacks=[FedAvg(), kdecay, rec]).fit(loop, datamodule=digits())
    assert rec.metrics[0]["schedule/client_lr_scale"] == 1.0 and rec.metrics[1]["schedule/client_lr_scale"] == 0.1
    first, second = rec.by_round[0], rec.by_round[1]
    if step is None:  # DecSPS without state: γ_t = γ_b/√(t+1) when the ratio exceeds the bound
        step_t = [1e-3 / math.sqrt(t + 1) for t in range(3)] * 3
        assert first == pytest.approx(step_t) and second == pytest.approx([0.1 * x for x in step_t])
    else:
        assert first == pytest.approx([step] * 9) and second == pytest.approx([0.1 * step] * 9)


def test_kdecay_client_lr_refuses_an_optimizer_without_step_size_at_fit_start():
    class NoStepSize(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"momentum": 0.9})

        def step(self, closure=None):  # pragma: no cover - never reached
            raise AssertionError("a client trained although the schedule cannot act on it")

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), client_optimizer=NoStepSize, local_steps=2, clients_per_round=2)
    with pytest.raises(ValueError, match="client optimizer NoStepSize has no step size"):
        make_trainer(2, callbacks=[FedAvg(), KDecay(schedule="rounds", decay="client_lr")]).fit(
            loop, datamodule=digits()
        )


def test_fedsps_global_refuses_adaptive_sps_clients():
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]), client_optimizer=lambda p: SPS(p), local_steps=2, clients_per_round=2
    )
    with pytest.raises(TypeError, match=r"without fixed_step_size \(adaptive SPS\)"):
        make_trainer(1, callbacks=[FedSPSGlobal(initial_step_size=0.1)]).fit(loop, datamodule=digits())


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "armijo-grow-carry", "sps-smooth", "decsps"))
def test_vectorized_equals_sequential_with_a_scaled_adaptive_optimizer(optimizer):
    """KDecay's η-rounds schedule (scales 1, 1/√2, 1/√3) on adaptive clients: same weights, steps, state."""
    schedule = [KDecay(schedule="rounds", decay="client_lr")]
    seq = fit(mlp(), optimizer, "sequential", callbacks=schedule)
    vec = fit(mlp(), optimizer, "vectorized", callbacks=schedule)
    assert_same_run(seq, vec)
    unscaled = fit(mlp(), optimizer, "sequential")
    # the schedule changed the run (the scale was applied, not only logged)
    assert (seq[0] - unscaled[0]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ FedLi-LS's η_i
def test_armijo_reports_the_last_accepted_step_after_zero_gradient_and_exhausted_steps():
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="max", max_backtracks=2)
    assert math.isnan(opt.client_report()["armijo_accepted_step_size"])
    opt.zero_grad()
    opt.step(lambda: 1.5 * (w * w).sum())  # accepts 0.5 (see the scaled Armijo test)
    with torch.no_grad():
        w.zero_()
    opt.zero_grad()
    opt.step(lambda: 1.5 * (w * w).sum())  # zero gradient: step size 0
    with torch.no_grad():
        w.fill_(1.0)
    opt.zero_grad()
    opt.step(lambda: 500.0 * (w * w).sum())  # grid 1, 0.5, 0.25 all fail (η* = 1.8e-3): exhausted, step size 0
    assert opt.last_step["step_size"] == 0.0 and opt.last_step["backtracks"] == 3
    assert opt.client_report() == {"armijo_accepted_step_size": 0.5}
    nxt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5)  # the next round's optimizer of this client
    nxt.set_client_state(opt.get_client_state())
    assert nxt.client_report() == {"armijo_accepted_step_size": 0.5}


def lils_round(updates):
    strategy = FedLiLS()
    stats = RoundStatistics()
    for u in updates:
        accumulate_core(strategy, stats, u)
        strategy.accumulate(stats, u)
    return strategy.server_update(
        None, stats, RoundPlan(round=0, client_ids=[u.client_id for u in updates], local_steps=3)
    )


def update(cid, steps, payload=None):
    return ClientUpdate(
        client_id=cid,
        delta=torch.ones(3, dtype=DT) * (cid + 1),
        num_samples=10,
        step_sizes=steps,
        payload=payload or {},
    )


def test_fedlils_uses_the_last_accepted_step_not_a_trailing_zero():
    """Every client's last local step recorded 0 (zero gradient / exhausted search): η_g is still the max of the
    accepted steps they report, not 0."""
    ups = [
        update(0, [0.3, 0.2, 0.0], {"armijo_accepted_step_size": 0.2}),
        update(1, [0.5, 0.0, 0.0], {"armijo_accepted_step_size": 0.5}),
    ]
    delta, eta, metrics = lils_round(ups)
    assert eta == 0.5 and metrics["server/eta_g"] == 0.5
    torch.testing.assert_close(delta, torch.full((3,), 1.5, dtype=DT))  # samples weighting: (1 + 2)/2
    # without a report (e.g. SGD clients): the last positive finite step size of the round
    _, eta, _ = lils_round([update(0, [0.3, 0.2, 0.0]), update(1, [0.1, float("nan"), 0.0])])
    assert eta == 0.2
    with pytest.raises(RuntimeError, match="no client has accepted a step yet"):
        lils_round([update(0, [0.0, 0.0], {"armijo_accepted_step_size": float("nan")})])


def test_fedlils_round_with_armijo_clients_uses_the_reported_accepted_steps():
    """In a real round (sequential clients) η_g equals the max of the clients' armijo_accepted_step_size."""
    seen = []

    class Seen(pl.Callback):
        def on_client_end(self, trainer, loop, plan, update):
            seen.append(update.payload["armijo_accepted_step_size"])

        def on_round_end(self, trainer, loop, result):
            seen.append(("eta_g", result.metrics["server/eta_g"]))

    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]),
        client_optimizer=lambda p: SgdArmijo(p, eta_max=4.0),
        local_steps=3,
        clients_per_round=3,
        seed=0,
    )
    make_trainer(1, callbacks=[FedLiLS(), Seen()]).fit(loop, datamodule=digits())
    steps, (_, eta_g) = seen[:3], seen[3]
    assert all(s > 0 for s in steps) and eta_g == pytest.approx(max(steps))


# ------------------------------------------------------------------------------------------ per-epoch growth
@pytest.mark.parametrize("n,b,per_step", [(13, 50, 2.0), (130, 50, 2.0 ** (1 / 3)), (100, 50, 2.0**0.5)])
def test_growth_is_delta_per_local_epoch(n, b, per_step):
    """An epoch of the client's loader takes ⌈n/b⌉ steps; growth δ = 2 per epoch is δ^{1/⌈n/b⌉} per step (13
    samples, batch 50: ×2 per step, not 2^{50/13} = ×14.4)."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    arm = SgdArmijo([w], eta_max=100.0, c=0.1, beta=0.5, reset="grow", delta=2.0)
    arm.set_client_data(num_samples=n, batch_size=b)
    arm.zero_grad()
    arm.step(lambda: 1.5 * (w * w).sum())
    accepted = arm.last_step["step_size"]
    assert arm.initial_step_size() == pytest.approx(accepted * per_step)
    assert SgdArmijo([w], reset="grow", batch_size=b, num_samples=n)._epoch_exponent("x") == pytest.approx(
        math.log(per_step, 2.0)
    )
    v = torch.nn.Parameter(torch.tensor([0.9], dtype=DT))
    sps = SPS([v], smooth=True, smooth_factor=2.0)
    sps.set_client_data(num_samples=n, batch_size=b)
    sps.zero_grad()
    sps.step(offset_quadratic(v))
    assert sps.cap() == pytest.approx(per_step * sps.last_step["step_size"])


def test_epoch_length_below_one_step_is_refused():
    w = torch.nn.Parameter(torch.zeros(1))
    for make in (
        lambda: SgdArmijo([w], reset="grow", n_batches_per_epoch=0.26),
        lambda: SPS([w], smooth=True, n_batches_per_epoch=0.26),
    ):
        with pytest.raises(ValueError, match="n_batches_per_epoch must be >= 1"):
            make()
