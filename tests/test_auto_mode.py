"""``client_execution="auto"``: vectorised only where it is faster for this model, round shape and device.

The decision is tested deterministically: the clock that times the throw-away rounds is replaced by one that
returns chosen durations. Checked: the rule itself, that auto's run is bit-identical to a run in the chosen mode
(the measurement leaves no trace: no logged values, no client state, no random draws), that it measures once per
run and logs one line naming both timings, and that models with random layers train sequentially unmeasured.
"""

import logging

import pytest
import torch

import fedlightning.vectorized.auto as auto
from fedlightning.vectorized import AUTO_MARGIN, auto_choice
from registry import CLIENT_OPTIMIZERS
from test_vectorized import fit
from test_vectorized_user_losses import UserMLP


@pytest.mark.parametrize("seq,vec,want", [
    (100.0, 50.0, "vectorized"),
    (100.0, 100.0 / AUTO_MARGIN - 1e-6, "vectorized"),
    (100.0, 100.0 / AUTO_MARGIN + 1e-6, "sequential"),  # faster, but not by the margin
    (100.0, 100.0, "sequential"),
    (100.0, 250.0, "sequential"),
])
def test_auto_choice_rule(seq, vec, want):
    assert auto_choice(seq, vec) == want
    assert auto_choice(seq, vec, margin=1.0) == ("vectorized" if vec < seq else "sequential")


def fake_clock(monkeypatch, seq_ms, vec_ms):
    """The three readings _auto_decide takes: before the timed sequential round, between, after the vectorised."""
    readings = iter([0.0, seq_ms / 1e3, (seq_ms + vec_ms) / 1e3])
    calls = []

    def clock():
        calls.append(1)
        return next(readings)

    monkeypatch.setattr(auto, "_clock", clock)
    return calls




def assert_identical(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert [(u.client_id, u.first_loss, u.mean_loss, u.step_sizes, u.backtracks) for u in a[2]] == \
        [(u.client_id, u.first_loss, u.mean_loss, u.step_sizes, u.backtracks) for u in b[2]]
    assert a[1].client_state.state_dict() == b[1].client_state.state_dict()
    ma, mb = a[3].callback_metrics, b[3].callback_metrics
    logged = sorted(k for k in ma if k.startswith("client/"))
    assert logged and logged == sorted(k for k in mb if k.startswith("client/"))
    assert [float(ma[k]) for k in logged] == [float(mb[k]) for k in logged]


@pytest.mark.parametrize("opt", ["sgd", "armijo"])
@pytest.mark.parametrize("seq_ms,vec_ms,chosen", [(40.0, 10.0, "vectorized"), (10.0, 40.0, "sequential")])
def test_auto_equals_the_chosen_mode_and_logs_both_timings(monkeypatch, caplog, opt, seq_ms, vec_ms, chosen):
    calls = fake_clock(monkeypatch, seq_ms, vec_ms)
    with caplog.at_level(logging.INFO):
        auto = fit(UserMLP(), CLIENT_OPTIMIZERS[opt], "auto")
    assert len(calls) == 3  # measured once, at the first round
    assert auto[1].client_execution_choice == chosen
    lines = [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()]
    assert len(lines) == 1
    assert f"training clients {chosen}" in lines[0]
    assert f"{seq_ms:.1f} ms sequential, {vec_ms:.1f} ms vectorized" in lines[0]
    reference = fit(UserMLP(), CLIENT_OPTIMIZERS[opt], chosen)
    assert_identical(auto, reference)


def test_models_with_random_layers_train_sequentially_without_measuring(monkeypatch, caplog):
    calls = fake_clock(monkeypatch, 40.0, 10.0)
    with caplog.at_level(logging.INFO):
        auto = fit(UserMLP(dropout=0.2), CLIENT_OPTIMIZERS["sgd"], "auto")
    assert calls == []
    lines = [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()]
    assert len(lines) == 1 and "training clients sequential" in lines[0] and "random layers" in lines[0]
    assert_identical(auto, fit(UserMLP(dropout=0.2), CLIENT_OPTIMIZERS["sgd"], "sequential"))


def test_recurrent_models_train_sequentially_on_cpu_without_measuring(monkeypatch, caplog):
    """The fused LSTM/GRU kernels have no batching rule; on a CPU the step-by-step gate equations are slower than
    sequential training (docs/benchmarks.md §3), so auto does not spend a measurement on them."""
    from fedlightning.models import CharLSTM
    from test_vectorized import CharWindows

    calls = fake_clock(monkeypatch, 40.0, 10.0)  # a measurement would choose vectorized
    torch.manual_seed(6)
    model = CharLSTM(vocab_size=10, embedding_dim=4, hidden_size=8, num_layers=1)
    with caplog.at_level(logging.INFO):
        got = fit(model, CLIENT_OPTIMIZERS["sgd"], "auto", dm_fn=CharWindows, rounds=2)
    assert calls == []
    assert got[1].client_execution_choice == "sequential"
    lines = [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()]
    assert len(lines) == 1 and "recurrent layers (LSTM)" in lines[0]
    assert_identical(got, fit(model, CLIENT_OPTIMIZERS["sgd"], "sequential", dm_fn=CharWindows, rounds=2))


def test_measurement_times_a_few_local_steps_after_a_one_step_warm_up(monkeypatch):
    """Warm-up: 1 step of one client sequentially and of two clients vectorized; timed: every client,
    min(K, AUTO_MEASURE_STEPS) steps, each way."""
    from fedlightning import FederatedLoop
    from test_vectorized import K

    fake_clock(monkeypatch, 40.0, 10.0)
    monkeypatch.setattr(auto, "AUTO_MEASURE_STEPS", 2)
    assert K > 2
    seen = {"sequential": [], "vectorized": []}
    train_client, run = FederatedLoop.train_client, auto._run

    def spy_client(self, plan, client_id, global_flat):
        seen["sequential"].append(plan.local_steps)
        return train_client(self, plan, client_id, global_flat)

    def spy_run(loop, plan, client_ids, global_flat, throwaway=False):
        seen["vectorized"].append((len(client_ids), plan.local_steps, throwaway))
        return run(loop, plan, client_ids, global_flat, throwaway=throwaway)

    monkeypatch.setattr(FederatedLoop, "train_client", spy_client)
    monkeypatch.setattr(auto, "_run", spy_run)
    got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2)
    clients = len(got[2]) // 2  # updates of the two real rounds
    assert seen["sequential"] == [1] + [2] * clients  # nothing sequential after choosing vectorized
    assert seen["vectorized"] == [(2, 1, True), (clients, 2, True), (clients, K, False), (clients, K, False)]
    assert all(u.num_steps == K for u in got[2])
