"""The single-algorithm configs of configs/*.yaml that no other test runs (FedSLS, FedSPS, FedDecSPS;
FedAdagrad, FedSPS-Global, FedSPS-Normalized) run on the quickstart data through the CLI, and what
each run did is checked against an independent recomputation from the recorded client updates: the server rule
(global weights before/after every round), the client step-size rule (Armijo grid, SPS caps, DecSPS recursion
and its per-client state across rounds), and the per-round metrics the loop logs (η_g and its raw value, client
step-size mean/min/max, line-search steps per gradient step, forward/backward counts, K_r). The runs are float64
(the config's model and data converted), so the recomputation agrees to rounding (numerics.RTOL64)."""

import math
import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from conftest import make_trainer
from fedlightning.callbacks import FedAvg, FedLiLU
from fedlightning.cli import main
from fedlightning.state import flat_params
from numerics import RTOL64, assert_close64, float64_data, to_float64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENTS, PER_ROUND, STEPS, ROUNDS, BATCH = 5, 4, 3, 2, 20


class Recorder(Callback):
    """Global weights before/after each round, every client update, and the round's metrics."""

    def __init__(self):
        super().__init__()
        self.before, self.after, self.updates, self.metrics = [], [], [], []

    def on_round_start(self, trainer, loop, plan):
        self.before.append(flat_params(loop.global_parameters()).double())
        self.updates.append([])

    def on_client_end(self, trainer, loop, plan, update):
        self.updates[-1].append(update)

    def on_round_end(self, trainer, loop, result):
        self.after.append(flat_params(loop.global_parameters()).double())
        self.metrics.append(dict(result.metrics))


def run(name, tmp_path, *extra):
    """Build the run of configs/<name>.yaml with the CLI (small round shape), add a Recorder, fit."""
    args = [
        "--config",
        os.path.join(ROOT, "configs", f"{name}.yaml"),
        "--trainer.max_steps",
        str(ROUNDS),
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.clients_per_round",
        str(PER_ROUND),
        "--model.local_steps",
        str(STEPS),
        "--data.init_args.num_clients",
        str(CLIENTS),  # 4 of 5 clients per round: most take part in both rounds
        "--data.init_args.batch_size",
        str(BATCH),
        *extra,
    ]
    cli = main(args, run=False)
    to_float64(cli.model)
    float64_data(cli.datamodule)
    rec = Recorder()
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == ROUNDS and len(rec.updates) == ROUNDS
    assert all(len(u) == PER_ROUND and not any(x.failed for x in u) for u in rec.updates)
    assert all(x.delta.dtype == torch.float64 for u in rec.updates for x in u)
    return cli, rec


def uniform_mean(updates):
    return torch.stack([u.delta.double() for u in updates]).mean(0)


def assert_fedavg_uniform(rec, server_lr=1.0):
    for r in range(ROUNDS):
        expected = rec.before[r] - server_lr * uniform_mean(rec.updates[r])
        assert_close64(rec.after[r], expected)


def assert_logged_client_telemetry(rec):
    """The loop's per-round client metrics equal the statistics recomputed from the clients' own reports."""
    for r in range(ROUNDS):
        m, ups = rec.metrics[r], rec.updates[r]
        sizes = [s for u in ups for s in u.step_sizes if math.isfinite(s)]
        assert m["client/step_size_mean"] == pytest.approx(sum(sizes) / len(sizes), rel=1e-9)
        assert m["client/step_size_min"] == pytest.approx(min(sizes), rel=1e-9)
        assert m["client/step_size_max"] == pytest.approx(max(sizes), rel=1e-9)
        assert m["client/backtracks_per_step"] == pytest.approx(sum(u.backtracks / u.num_steps for u in ups) / len(ups))
        assert m["client/forwards"] == sum(u.forwards for u in ups)
        assert m["client/backwards"] == sum(u.backwards for u in ups) == PER_ROUND * STEPS
        assert m["round/local_steps"] == STEPS  # K_r
        assert m["server/delta_norm"] == pytest.approx(
            float((rec.before[r] - rec.after[r]).norm()) / m["server/eta_g"], rel=RTOL64
        )


def client_history(rec):
    """client id -> its step sizes over all its rounds, in order, and the step sizes of its last round."""
    history, last = {}, {}
    for ups in rec.updates:
        for u in ups:
            history.setdefault(u.client_id, []).extend(u.step_sizes)
            last[u.client_id] = list(u.step_sizes)
    return history, last


# ----------------------------------------------------------------------------------------- seed 000 / 001 clients
def test_fedsls_config_armijo_grid_and_fedavg_server(tmp_path):
    cli, rec = run("fedsls", tmp_path)
    opt = cli.model.client_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(opt).__name__ == "SgdArmijo"
    h = opt.hyper
    assert (h["eta_max"], h["c"], h["beta"], h["reset"]) == (1.0, 0.1, 0.9, "max")
    assert_fedavg_uniform(rec, server_lr=1.0)  # FedSLS = SgdArmijo clients + FedAvg(server_lr, uniform)
    for ups in rec.updates:
        for u in ups:
            for s in u.step_sizes:  # reset="max": every accepted step is eta_max * beta^m for an integer m >= 0
                m = math.log(s / h["eta_max"]) / math.log(h["beta"])
                assert m > -1e-9 and abs(m - round(m)) < 1e-6
            # trials per step = rejected + the accepted one; one gradient forward per step
            assert u.forwards == u.num_steps + u.backtracks + sum(1 for s in u.step_sizes if s > 0)
    assert_logged_client_telemetry(rec)
    assert sum(u.backtracks for ups in rec.updates for u in ups) > 0  # the line search did backtrack
    assert all(m["server/eta_g"] == m["server/eta_g_raw"] == 1.0 for m in rec.metrics)


def test_fedsps_config_smoothed_cap_and_persistent_state(tmp_path):
    cli, rec = run("fedsps", tmp_path)
    assert_fedavg_uniform(rec)
    dm = cli.datamodule
    history, last = client_history(rec)
    for cid, steps in history.items():
        growth = 2.0 ** (BATCH / dm.client_num_samples(cid))  # smoothed cap 2^(b/n_i) * previous step
        assert 0 < steps[0] <= 1.0  # first cap gamma_{b,0} = gamma_max = 1
        for prev, nxt in zip(steps, steps[1:]):  # also across the client's rounds: its gamma_{t-1} persists
            assert 0 < nxt <= growth * prev * (1 + 1e-12)
        assert cli.model.client_state.get("optimizer", cid) == {"prev_step": pytest.approx(last[cid][-1], rel=1e-12)}
    assert any(len(s) > STEPS for s in history.values())  # some client took part in both rounds
    assert_logged_client_telemetry(rec)


def test_feddecsps_config_recursion_and_persistent_state(tmp_path):
    cli, rec = run("feddecsps", tmp_path)
    assert_fedavg_uniform(rec)
    gamma_b = 1.0  # DecSPS's default gamma_max
    history, last = client_history(rec)
    for cid, steps in history.items():
        assert all(s > 0 for s in steps)
        for t, s in enumerate(steps):  # gamma_t <= gamma_b / sqrt(t+1), t counted over all the client's rounds
            assert s <= gamma_b / math.sqrt(t + 1) * (1 + 1e-12)
            if t:  # gamma_t = min{ratio, c_{t-1} gamma_{t-1}} / c_t  <=  gamma_{t-1} sqrt(t/(t+1))
                assert s <= steps[t - 1] * math.sqrt(t / (t + 1)) * (1 + 1e-12)
        state = cli.model.client_state.get("optimizer", cid)
        assert state["t"] == len(steps) and state["gamma_prev"] == pytest.approx(last[cid][-1], rel=1e-12)
    assert any(len(s) > STEPS for s in history.values())
    assert_logged_client_telemetry(rec)
    assert all(m["server/eta_g"] == 1.0 for m in rec.metrics)


# ------------------------------------------------------------------------------ FedAdagrad and the FedSPS variants
def test_fedadagrad_config_matches_reddi_recursion(tmp_path):
    cli, rec = run("fedadagrad", tmp_path)
    assert type(cli.model.strategy).__name__ == "FedAdagrad"
    lr, b1, tau = 0.1, 0.9, 1e-2  # the config's values
    m = torch.zeros_like(rec.before[0])
    v = torch.full_like(rec.before[0], tau**2)  # Reddi et al. Alg. 2: v_{-1} >= tau^2
    for r in range(ROUNDS):
        delta = uniform_mean(rec.updates[r])
        m = b1 * m + (1 - b1) * delta
        v = v + delta**2
        assert_close64(rec.after[r], rec.before[r] - lr * m / (v.sqrt() + tau))
        assert rec.metrics[r]["server/eta_g"] == rec.metrics[r]["server/eta_g_raw"] == pytest.approx(lr)
        assert rec.metrics[r]["server/first_moment_norm"] == pytest.approx(float(m.norm()), rel=RTOL64)


def test_fedsps_global_config_shared_step_from_the_clients_last_steps(tmp_path):
    cli, rec = run("fedsps_global", tmp_path)
    c, gamma_b = 0.5, 1.0
    used = []
    for r in range(ROUNDS):
        steps = {s for u in rec.updates[r] for s in u.step_sizes}
        assert len(steps) == 1  # one step size for every client and every local step of the round
        used.append(steps.pop())
        assert 0 < used[-1] <= gamma_b
        assert_fedavg_uniform_round(rec, r)
    # Eq. 41: the next round's step is the mean over clients of min{F_j / (c ||g_j||^2), gamma_b}
    nxt = sum(min(u.payload["sps_last_loss"] / (c * u.payload["sps_last_grad_sq"]), gamma_b) for u in rec.updates[0])
    assert used[1] == pytest.approx(nxt / PER_ROUND, rel=1e-9)
    assert rec.metrics[0]["server/sps_global_next_step_size"] == pytest.approx(used[1], rel=1e-12)


def assert_fedavg_uniform_round(rec, r):
    assert_close64(rec.after[r], rec.before[r] - uniform_mean(rec.updates[r]))


def test_fedsps_normalized_config_weights_models_by_inverse_step_sums(tmp_path):
    cli, rec = run("fedsps_normalized", tmp_path)
    for r in range(ROUNDS):
        ups = rec.updates[r]
        nu = torch.tensor([math.fsum(u.step_sizes) for u in ups], dtype=torch.float64)
        deltas = torch.stack([u.delta.double() for u in ups])
        expected = (deltas / nu[:, None]).sum(0) / (1.0 / nu).sum()  # seed 001 Alg. 2: sum x_j/nu_j / sum 1/nu_j
        assert_close64(rec.after[r], rec.before[r] - expected)


# ----------------------------------------------------------------------------------------- eta_g for every strategy
def test_every_strategy_logs_eta_g_and_its_raw_value():
    """Strategies without an extrapolation rule report their server learning rate as η_g (nothing clipped);
    FedLi-LU reports η·γ_t and η times the unclipped γ_t."""
    from fedlightning import FederatedLoop
    from fedlightning.datamodules import IID, DigitsDataModule
    from fedlightning.models import LogisticRegression

    for strategy, check in (
        (FedAvg(server_lr=0.7), lambda m: m["server/eta_g"] == m["server/eta_g_raw"] == pytest.approx(0.7)),
        (
            FedLiLU(lr=0.5, momentum=0.0, weight_decay=0.0, dfw_eps=0.0),
            lambda m: (
                m["server/eta_g"] == pytest.approx(0.5 * m["server/dfw_gamma"])
                and m["server/eta_g_raw"] == pytest.approx(0.5 * m["server/dfw_gamma_raw"])
            ),
        ),
    ):
        rec = Recorder()
        torch.manual_seed(0)
        loop = FederatedLoop(LogisticRegression(input_dim=64, num_classes=10), local_steps=2, clients_per_round=2)
        dm = DigitsDataModule(num_clients=4, batch_size=32, partition=IID(), seed=0)
        make_trainer(1, callbacks=[strategy, rec]).fit(loop, datamodule=dm)
        assert check(rec.metrics[0])
    # LU's raw step exceeds 1 here (the loss is large next to η‖Δ‖²), so the clip is visible in η_g vs its raw value
    assert rec.metrics[0]["server/dfw_gamma_raw"] > 1.0 and rec.metrics[0]["server/eta_g"] == pytest.approx(0.5)
