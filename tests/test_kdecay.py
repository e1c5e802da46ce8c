"""K-decay schedules and the runtime model (seed 004): Table III values with exact ceilings, the error and step
schedules on hand-fed loss sequences, the η-decay counterparts, the schedules acting in the loop, the simulated
wall-clock against the paper's constants (Tables I, II, IV), and bad arguments."""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, KDecay, RoundTimer, RuntimeModel
from fedlightning.callbacks.kdecay import (
    ceil_cube_root,
    error_local_steps,
    error_lr_scale,
    rounds_local_steps,
    rounds_lr_scale,
    simulated_round_seconds,
    step_local_steps,
)
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP, LogisticRegression
from test_strategies import Recorder

# seed 004 Table III, K_r-rounds = ⌈K_0 r^(−1/3)⌉ at r = 1, 2, 10, 100, 1000 (K_0 of Table I: 60, 80, 50)
TABLE_III_ROUNDS = {
    50: [50, 40, 24, 11, 5],
    60: [60, 48, 28, 13, 6],
    80: [80, 64, 38, 18, 8],
}
R_VALUES = [1, 2, 10, 100, 1000]


# ============================================================================ K_r-rounds
@pytest.mark.parametrize("k0", sorted(TABLE_III_ROUNDS))
def test_table_iii_rounds_schedule_values(k0):
    assert [rounds_local_steps(k0, r) for r in R_VALUES] == TABLE_III_ROUNDS[k0]
    # the float fuzz the exact ceiling avoids: K_0·1000^(−1/3) lands just above the integer K_0/10
    assert math.ceil(k0 * 1000 ** (-1 / 3)) == k0 // 10 + 1


def test_rounds_schedule_is_the_smallest_integer_above_the_real_value():
    for k0 in (1, 2, 7, 20, 27, 64, 100):
        prev = k0
        for r in range(1, 1500):
            k = rounds_local_steps(k0, r)
            assert k**3 * r >= k0**3 and (k - 1) ** 3 * r < k0**3  # k = ⌈k0 / r^(1/3)⌉, exactly
            assert 1 <= k <= prev  # non-increasing, never 0
            prev = k
    assert rounds_local_steps(60, 10**12) == 1
    assert ceil_cube_root(10**300 * 8, 10**300) == 2  # beyond float precision of the ratio
    assert ceil_cube_root(10**402) == 10**134 and ceil_cube_root(10**402 + 1) == 10**134 + 1  # beyond float range


def test_eta_decay_scales():
    assert [rounds_lr_scale(r) for r in (1, 4, 100)] == [1.0, 0.5, 0.1]
    assert error_lr_scale(0.25, 1.0) == 0.5


# ============================================================================ K_r-error / K_r-step functions
def test_error_schedule_values():
    assert error_local_steps(60, 0.125, 1.0) == 30  # ∛(1/8)·60
    assert error_local_steps(60, 0.001, 1.0) == 6  # 0.001 is not exactly 1/1000 in binary: no 7
    assert error_local_steps(60, 0.125 * (1 + 1e-9), 1.0) == 31  # a real excess is not swallowed
    assert error_local_steps(60, 8.0, 1.0) == 120  # F_r > F_0: no clamp (the paper states none)
    assert error_local_steps(60, 0.0, 1.0) == 1  # never 0 steps
    assert error_local_steps(80, 2.0, 3.0) == math.ceil(80 * (2 / 3) ** (1 / 3))


def test_step_schedule_values():
    assert step_local_steps(60, 10) == 6 and step_local_steps(80, 10) == 8 and step_local_steps(50, 10) == 5
    assert step_local_steps(55, 10) == 6 and step_local_steps(5, 10) == 1


def test_error_schedule_window_warmup_and_reference_loss():
    kd = KDecay(schedule="error", window=3, reference_loss="first_window")
    # per-round (sum, count) of client first-batch losses: means 3, 2, 1
    for r, (s, c) in enumerate([(6.0, 2), (4.0, 2), (2.0, 2)], start=1):
        assert kd.value(r, 60) == (60, 1.0)  # warm-up: K_0 for the first s rounds
        kd.observe(r, s, c)
    assert kd.reference == pytest.approx(2.0)  # F_0 = mean over rounds 1..s
    assert kd.value(4, 60) == (60, 1.0)  # F_4 = F_0: continuous at the end of the warm-up
    kd.observe(4, 1.0, 2)  # window = rounds 2..4: (4 + 2 + 1)/6
    assert kd.loss_estimate() == pytest.approx(7 / 6)
    assert kd.value(5, 60) == (math.ceil(60 * (7 / 12) ** (1 / 3)), 1.0)
    kd.observe(5, 0.0, 0)  # a round without healthy clients adds nothing to the mean
    assert kd.loss_estimate() == pytest.approx((2 + 1) / 4)
    lr = KDecay(schedule="error", decay="client_lr", window=3, reference_loss="first_round")
    for r, (s, c) in enumerate([(6.0, 2), (4.0, 2), (2.0, 2), (1.0, 2)], start=1):
        lr.observe(r, s, c)
    assert lr.reference == pytest.approx(3.0)  # round 1's mean
    k, scale = lr.value(5, 60)
    assert k == 60 and scale == pytest.approx(math.sqrt((7 / 6) / 3.0))


def test_step_schedule_plateau_rule_on_the_loss_window():
    kd = KDecay(schedule="step", window=2, patience=3, plateau_tolerance=0.01)
    losses = [10, 8, 6, 6, 6, 6, 6]  # window means 9, 7, 6, 6, 6, 6 from round 2 on
    for r, loss in enumerate(losses, start=1):
        assert kd.value(r, 60) == (60, 1.0)
        kd.observe(r, 2.0 * loss, 2)
    # rounds 5, 6, 7 did not improve on 6 by > 1%: the plateau fires after round 7, the decay applies from 8 on
    assert kd.decayed(8) and not kd.decayed(7)
    assert kd.value(8, 60) == (6, 1.0) and kd.value(50, 60) == (6, 1.0)
    # the state round-trips (a fresh instance continues identically)
    again = KDecay(schedule="step", window=2, patience=3, plateau_tolerance=0.01)
    again.load_state_dict(kd.state_dict())
    assert again.value(8, 60) == (6, 1.0) and again.state_dict() == kd.state_dict()
    improving = KDecay(schedule="step", window=2, patience=3)
    for r in range(1, 30):
        improving.observe(r, 2.0 * 0.9**r, 2)
    assert improving.value(30, 60) == (60, 1.0)  # steady 10% improvements: no plateau


def test_step_schedule_fixed_round_and_monitored_metric():
    kd = KDecay(schedule="step", step_round=5, decay="client_lr")
    assert kd.value(4, 60) == (60, 1.0) and kd.value(5, 60) == (60, 0.1)
    mon = KDecay(schedule="step", monitor="val/loss", patience=2)
    fake = lambda v, step, sanity=False: SimpleNamespace(  # noqa: E731
        callback_metrics={"val/loss": torch.tensor(v)}, sanity_checking=sanity, global_step=step
    )
    mon.on_validation_end(fake(0.1, 0, sanity=True), None)  # sanity check: ignored
    mon.on_validation_end(fake(1.0, 5), None)
    mon.on_validation_end(fake(0.5, 10), None)
    mon.on_validation_end(fake(0.5, 15), None)
    assert not mon.decayed(100)
    mon.on_validation_end(fake(0.499, 20), None)  # within 1%: second observation without improvement
    assert mon.decayed(21) and not mon.decayed(20)  # 20 rounds done -> decay from (1-based) round 21
    assert mon.value(21, 40) == (4, 1.0)


# ============================================================================ in the loop
def _run(callbacks, rounds, local_steps=6, lr=0.2):
    torch.manual_seed(0)
    loop = FederatedLoop(
        LogisticRegression(input_dim=64, num_classes=10),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        local_steps=local_steps,
        clients_per_round=3,
        seed=1,
    )
    trainer = make_trainer(rounds, callbacks=callbacks)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0))
    return loop, trainer


def test_rounds_schedules_act_on_the_clients():
    rec = Recorder()
    _run([KDecay(schedule="rounds"), rec], rounds=5)
    expected = [6, 5, 5, 4, 4]  # ⌈6 r^(−1/3)⌉
    assert [p.local_steps for p in rec.plans] == expected
    for r, k in enumerate(expected):
        assert all(u.num_steps == k and u.step_sizes == [0.2] * k for u in rec.updates[r])
        assert rec.metrics[r]["schedule/local_steps"] == k
    rec = Recorder()
    _run([KDecay(schedule="rounds", decay="client_lr"), rec], rounds=4)
    for r in range(4):
        lr = 0.2 / math.sqrt(r + 1)
        assert rec.plans[r].local_steps == 6
        for u in rec.updates[r]:
            assert u.num_steps == 6 and u.step_sizes == pytest.approx([lr] * 6, rel=1e-12)


def test_error_schedule_in_the_loop_uses_the_previous_rounds_first_losses():
    rec = Recorder()
    _run([KDecay(schedule="error", window=2), rec], rounds=6, local_steps=20)
    first = [[u.first_loss for u in rec.updates[r]] for r in range(6)]
    mean = lambda rounds: sum(sum(first[i]) for i in rounds) / sum(len(first[i]) for i in rounds)  # noqa: E731
    f0 = mean([0, 1])
    for r in range(6):
        k = 20 if r < 2 else math.ceil(20 * (mean([r - 2, r - 1]) / f0) ** (1 / 3) - 1e-9)
        assert rec.plans[r].local_steps == k, r
        assert all(u.num_steps == k for u in rec.updates[r])
    assert any(p.local_steps < 20 for p in rec.plans)  # the loss fell, so K decayed


def test_runtime_model_in_the_loop():
    rec = Recorder()
    loop, _ = _run([KDecay(schedule="rounds"), RuntimeModel(seconds_per_batch=0.017), rec], rounds=4)
    megabits = (64 * 10 + 10) * 32 / 1e6
    wall, steps, client_steps = 0.0, 0, 0
    for r in range(4):
        k = rec.plans[r].local_steps
        wall += megabits / 20 + k * 0.017 + megabits / 5
        steps += k
        client_steps += k * len(rec.updates[r])
        m = rec.metrics[r]
        assert m["runtime/model_megabits"] == pytest.approx(megabits)
        assert m["runtime/wall_clock_seconds"] == pytest.approx(wall, rel=1e-12)
        assert m["runtime/wall_clock_minutes"] == pytest.approx(wall / 60, rel=1e-12)
        assert m["runtime/sgd_steps"] == steps and m["runtime/client_sgd_steps"] == client_steps


def test_runtime_model_with_local_epochs_counts_each_clients_own_steps():
    """With local_epochs every client runs its own ⌈E·⌈n_i/b⌉⌉ steps: runtime/client_sgd_steps adds each client's
    count (it added clients × the largest), runtime/sgd_steps the round's mean (round/local_steps), and W_r waits
    for the slowest client (the largest count)."""
    rec = Recorder()
    torch.manual_seed(0)
    loop = FederatedLoop(
        LogisticRegression(input_dim=64, num_classes=10),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.2),
        local_epochs=1,
        clients_per_round=4,
        seed=1,
    )
    timer = RoundTimer()
    timer.clock = iter([0.0, 1.0] * 3).__next__  # one second per round: client steps per second = the steps
    trainer = make_trainer(3, callbacks=[RuntimeModel(seconds_per_batch=0.017), timer, rec])
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0))
    megabits = (64 * 10 + 10) * 32 / 1e6
    wall, steps, client_steps = 0.0, 0.0, 0
    for r in range(3):
        counts = [u.num_steps for u in rec.updates[r]]
        assert len(set(counts)) > 1  # the clients' counts differ
        wall += megabits / 20 + max(counts) * 0.017 + megabits / 5
        steps += sum(counts) / len(counts)
        client_steps += sum(counts)
        m = rec.metrics[r]
        assert m["runtime/wall_clock_seconds"] == pytest.approx(wall, rel=1e-12)
        assert m["runtime/sgd_steps"] == pytest.approx(steps, rel=1e-12)
        assert m["runtime/client_sgd_steps"] == client_steps
        assert m["round/local_steps"] == pytest.approx(sum(counts) / len(counts), rel=1e-12)
    assert float(trainer.callback_metrics["time/client_steps_per_second"]) == sum(counts)  # RoundTimer's count


# ============================================================================ the paper's runtime numbers
def test_round_times_from_the_paper_constants():
    # Table I sizes, Table II β, D = 20 and U = 5 Mbps: Sent140 0.080 s comm + 60·5.2e-3 s; FEMNIST 1.6775 + 80·0.017
    assert simulated_round_seconds(0.32, 60, 5.2e-3) == pytest.approx(0.392, rel=1e-12)
    assert simulated_round_seconds(6.71, 80, 0.017) == pytest.approx(3.0375, rel=1e-12)
    fake = lambda model: SimpleNamespace(global_parameters=lambda: [p for p in model.parameters()])  # noqa: E731
    # Table I model sizes from the architectures (float32): linear 5000->2 is 0.32 Mb, FC-200-200 on FEMNIST 6.71 Mb
    linear = fake(LogisticRegression(input_dim=5000, num_classes=2))
    fc200 = fake(MLP(input_dim=784, hidden=[200, 200], num_classes=62))
    assert RuntimeModel.megabits_of(linear) == pytest.approx(0.32, abs=5e-4)
    assert RuntimeModel.megabits_of(fc200) == pytest.approx(6.71, abs=5e-3)


@pytest.mark.parametrize("k0,megabits,beta,paper", [(60, 0.32, 5.2e-3, 0.21), (80, 6.71, 0.017, 0.11)])
def test_table_iv_rounds_schedule_relative_steps(k0, megabits, beta, paper):
    """Table IV (K_r-rounds, Sent140 and FEMNIST): total SGD steps relative to Kη-fixed when every schedule gets
    the simulated wall-clock of Kη-fixed's 10k rounds (the protocol Table IV implies; its CIFAR100 entry, 0.090, is not
    reproducible from the stated constants under any protocol, so it is not tested)."""
    budget = 10_000 * simulated_round_seconds(megabits, k0, beta)
    wall, steps, r = 0.0, 0, 0
    while True:
        k = rounds_local_steps(k0, r + 1)
        w = simulated_round_seconds(megabits, k, beta)
        if wall + w > budget:
            break
        r, wall, steps = r + 1, wall + w, steps + k
    assert round(steps / (k0 * 10_000), 2) == paper


# ============================================================================ bad arguments
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: KDecay(schedule="linear"), "schedule"),
        (lambda: KDecay(decay="both"), "decay"),
        (lambda: KDecay(k0=0), "k0"),
        (lambda: KDecay(k0=2.5), "k0"),
        (lambda: KDecay(window=0), "window"),
        (lambda: KDecay(patience=0), "patience"),
        (lambda: KDecay(reference_loss="best"), "reference_loss"),
        (lambda: KDecay(schedule="step", step_round=0), "round"),
        (lambda: KDecay(schedule="step", step_factor=1.0), "step_factor"),
        (lambda: KDecay(schedule="step", plateau_tolerance=1.0), "plateau_tolerance"),
        (lambda: RuntimeModel(seconds_per_batch=-0.1), "seconds_per_batch"),
        (lambda: RuntimeModel(seconds_per_batch=0.1, download_mbps=0.0), "download_mbps"),
        (lambda: RuntimeModel(seconds_per_batch=0.1, upload_mbps=float("nan")), "upload_mbps"),
        (lambda: RuntimeModel(seconds_per_batch=0.1, model_megabits=0.0), "model_megabits"),
        (lambda: rounds_local_steps(60, 0), "round"),
        (lambda: rounds_local_steps(0, 1), "k0"),
        (lambda: error_local_steps(60, 1.0, 0.0), "reference"),
        (lambda: error_local_steps(60, float("nan"), 1.0), "loss"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_fedavg_default_with_kdecay_needs_no_strategy():
    """KDecay composes with the default strategy (FedAvg is added by the loop when none is configured)."""
    loop, trainer = _run([KDecay(schedule="rounds", k0=4)], rounds=2)
    assert isinstance(loop.strategy, FedAvg)
    assert float(trainer.callback_metrics["round/local_steps"]) == rounds_local_steps(4, 2) == 4


@pytest.mark.parametrize("schedule", [None, "rounds"])
def test_runtime_budget_ends_the_run_at_equal_simulated_runtime(schedule):
    """Seed 004 compares schedules at the simulated runtime of Kη-fixed's rounds: with budget_rounds = 4 of
    K_0 = 6 local steps, a fixed-K run stops after exactly 4 rounds, and a K_r-rounds run (shorter rounds) after the
    first round whose cumulative W_r reaches 4·W(6), recomputed here from the rounds' K_r; max_steps (40) is only an
    upper bound."""
    rec = Recorder()
    callbacks = [RuntimeModel(seconds_per_batch=0.017, budget_rounds=4, budget_local_steps=6), rec]
    if schedule:
        callbacks.insert(0, KDecay(schedule=schedule))
    _, trainer = _run(callbacks, rounds=40)
    megabits = (64 * 10 + 10) * 32 / 1e6
    budget = 4 * (megabits / 20 + 6 * 0.017 + megabits / 5)
    wall, expected_rounds = 0.0, None
    for r in range(40):
        k = 6 if schedule is None else rounds_local_steps(6, r + 1)
        wall += megabits / 20 + k * 0.017 + megabits / 5
        if wall >= budget * (1 - 1e-9):
            expected_rounds = r + 1
            break
    assert expected_rounds == (4 if schedule is None else 5)  # ⌈6 r^(−1/3)⌉ = 6, 5, 5, 4, 4
    assert trainer.global_step == expected_rounds == len(rec.plans)
    assert rec.metrics[-1]["runtime/budget_seconds"] == pytest.approx(budget, rel=1e-12)
    assert rec.metrics[-1]["runtime/wall_clock_seconds"] >= budget * (1 - 1e-9)


def test_runtime_budget_beyond_max_steps_warns_naming_both():
    with pytest.warns(UserWarning, match=r"before its budget .*budget_rounds=10.*max_steps=3"):
        _, trainer = _run([RuntimeModel(seconds_per_batch=0.017, budget_rounds=10)], rounds=3)
    assert trainer.global_step == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(budget_rounds=0), "budget_rounds"),
        (dict(budget_rounds=2.5), "budget_rounds"),
        (dict(budget_local_steps=5), r"budget_local_steps=5 needs budget_rounds"),
    ],
)
def test_bad_runtime_budget_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RuntimeModel(seconds_per_batch=0.017, **kwargs)


def test_a_run_resumed_at_its_runtime_budget_trains_no_further_round(tmp_path):
    budget = RuntimeModel(seconds_per_batch=0.017, budget_rounds=3, budget_local_steps=6)
    loop, trainer = _run([budget], rounds=40)
    assert trainer.global_step == 3
    path = str(tmp_path / "end.ckpt")
    trainer.save_checkpoint(path)
    weights = [p.detach().clone() for p in loop.parameters()]
    again = make_trainer(40, callbacks=[RuntimeModel(seconds_per_batch=0.017, budget_rounds=3, budget_local_steps=6)])
    again.fit(
        loop,
        datamodule=DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0),
        ckpt_path=path,
    )
    assert again.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(loop.parameters(), weights))


# seed 004 Table IV, K_r-rounds: total SGD steps relative to Kη-fixed (CIFAR100's 0.090 is the digest's unexplained
# entry: equal runtime gives 0.144 from the paper's constants, §7.3)
TABLE_IV_ROUNDS = {"sent140": 0.21, "femnist": 0.11, "shakespeare": 0.74, "cifar100": 0.14}


@pytest.mark.parametrize("task", sorted(TABLE_IV_ROUNDS))
def test_paper_configs_budget_reproduces_table_iv(task):
    """configs/kdecay/<task>_krounds.yaml: its model's size, its RuntimeModel (β, D, U and the budget of 10k rounds
    of K_0) and K_r = ⌈K_0 r^(−1/3)⌉ give, round by round until the budget ends the run, Table IV's relative SGD
    steps; the run stays below the config's max_steps."""
    import importlib
    import os

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "kdecay", f"{task}_krounds.yaml")) as f:
        cfg = yaml.safe_load(f)
    spec = cfg["model"]["model"]
    module, _, name = spec["class_path"].rpartition(".")
    model = getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))
    runtime_spec = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("RuntimeModel"))
    runtime = RuntimeModel(**runtime_spec["init_args"])
    k0 = cfg["model"]["local_steps"]
    assert runtime.budget_rounds == 10000 and runtime.budget_local_steps == k0
    loop = SimpleNamespace(global_parameters=lambda: list(model.parameters()), local_steps=k0)
    megabits = RuntimeModel.megabits_of(loop)
    budget = runtime.budget_seconds(loop)
    wall, steps, r = 0.0, 0, 0
    while wall < budget * (1 - 1e-9):
        r += 1
        k = rounds_local_steps(k0, r)
        wall += simulated_round_seconds(
            megabits, k, runtime.seconds_per_batch, runtime.download_mbps, runtime.upload_mbps
        )
        steps += k
    assert r < cfg["trainer"]["max_steps"]
    assert round(steps / (10000 * k0), 2) == TABLE_IV_ROUNDS[task]
