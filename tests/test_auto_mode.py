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
    """_auto_decide's readings: 0 before the timed sequential round, ``seq_ms`` after it (the start of the timed
    vectorised round), and ``seq_ms + vec_ms`` at every later reading (after each vectorised step and at its end):
    the vectorised round takes ``vec_ms``, all of it in its first step."""
    calls = []

    def clock():
        calls.append(1)
        return {1: 0.0, 2: seq_ms / 1e3}.get(len(calls), (seq_ms + vec_ms) / 1e3)

    monkeypatch.setattr(auto, "_clock", clock)
    return calls


def readings(vectorized_steps: int) -> int:
    """Clock readings of one measurement whose timed vectorised round ran ``vectorized_steps`` local steps: two
    around the sequential round, one after each vectorised step but the last of the timed round, one at its end."""
    from test_vectorized import K

    return 2 + min(vectorized_steps, min(K, auto.AUTO_MEASURE_STEPS) - 1) + 1




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
    from test_vectorized import K

    calls = fake_clock(monkeypatch, seq_ms, vec_ms)
    with caplog.at_level(logging.INFO):
        auto = fit(UserMLP(), CLIENT_OPTIMIZERS[opt], "auto")
    # measured once, at the first round; a vectorised round that has lost after its first step stops there
    assert len(calls) == readings(K if chosen == "vectorized" else 1)
    assert auto[1].client_execution_choice == chosen
    lines = [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()]
    assert len(lines) == 1
    assert f"training clients {chosen}" in lines[0]
    if chosen == "vectorized":
        assert f"{seq_ms:.1f} ms sequential, {vec_ms:.1f} ms vectorized" in lines[0]
    else:
        assert f"{seq_ms:.1f} ms sequential, 1 took {vec_ms:.1f} ms vectorized, measurement stopped" in lines[0]
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

    def spy_run(loop, plan, client_ids, global_flat, throwaway=False, stop=None):
        seen["vectorized"].append((len(client_ids), plan.local_steps, throwaway))
        return run(loop, plan, client_ids, global_flat, throwaway=throwaway, stop=stop)

    monkeypatch.setattr(FederatedLoop, "train_client", spy_client)
    monkeypatch.setattr(auto, "_run", spy_run)
    got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2)
    clients = len(got[2]) // 2  # updates of the two real rounds
    assert seen["sequential"] == [1] + [2] * clients  # nothing sequential after choosing vectorized
    assert seen["vectorized"] == [(2, 1, True), (clients, 2, True), (clients, K, False), (clients, K, False)]
    assert all(u.num_steps == K for u in got[2])


@pytest.mark.parametrize("per_step_ms,steps_run,chosen", [(30.0, 2, "sequential"), (6.0, 5, "vectorized")])
def test_vectorized_measurement_stops_once_it_cannot_win(monkeypatch, caplog, per_step_ms, steps_run, chosen):
    """The timed vectorised round is asked after each step whether its time so far already rules it out (more than
    sequential's time / AUTO_MARGIN): 40 ms sequential for 5 steps, vectorised at 30 ms per step has lost after 2
    steps (60 ms > 36.4 ms) and stops there; at 6 ms per step it runs all 5 (30 ms) and is chosen. A stopped
    measurement leaves no trace: the run equals a sequential run."""
    from fedlightning import FederatedLoop
    from test_vectorized import K

    monkeypatch.setattr(auto, "AUTO_MEASURE_STEPS", 5)
    assert K == 5  # the timed rounds run K steps, which real rounds run too
    clock = {"now": 0.0}
    monkeypatch.setattr(auto, "_clock", lambda: clock["now"])
    train_client, run = FederatedLoop.train_client, auto._run
    asked = []

    def spy_client(self, plan, client_id, global_flat):
        if plan.local_steps == 5 and clock["now"] < 0.040:
            clock["now"] = 0.040  # the timed sequential round (its first client onwards): 40 ms
        return train_client(self, plan, client_id, global_flat)

    def spy_run(loop, plan, client_ids, global_flat, throwaway=False, stop=None):
        if stop is None:
            return run(loop, plan, client_ids, global_flat, throwaway=throwaway)

        def timed_stop():  # asked after each step but the last: that step took per_step_ms
            asked.append(1)
            clock["now"] += per_step_ms / 1e3
            return stop()

        out = run(loop, plan, client_ids, global_flat, throwaway=throwaway, stop=timed_stop)
        if out is not None:
            clock["now"] += per_step_ms / 1e3  # the last step
        return out

    monkeypatch.setattr(FederatedLoop, "train_client", spy_client)
    monkeypatch.setattr(auto, "_run", spy_run)
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto")
    assert got[1].client_execution_choice == chosen
    assert len(asked) == min(steps_run, 4)
    line = [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()][0]
    if chosen == "sequential":
        assert "40.0 ms sequential, 2 took 60.0 ms vectorized, measurement stopped" in line
    else:
        assert "40.0 ms sequential, 30.0 ms vectorized (1.33x" in line
    monkeypatch.undo()
    assert_identical(got, fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], chosen))


def oom_on_call(monkeypatch, which):
    """The vectorised engine raises CUDA's out-of-memory error at its ``which``-th round (1-based) and runs
    normally otherwise; returns the list of calls."""
    from fedlightning.vectorized import VectorizedClientTrainer

    calls = []
    run = VectorizedClientTrainer.run

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == which:
            self.scratch("probe", (4, 4), torch.float32, torch.device("cpu"))  # a buffer the fallback frees
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.64 GiB.\nmore details")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(VectorizedClientTrainer, "run", failing)
    return calls


@pytest.mark.parametrize("when", ["measurement", "later round"])
def test_auto_trains_sequentially_when_vectorized_runs_out_of_memory(monkeypatch, when):
    """Vectorised clients hold C clients' activations at once: where that does not fit, "auto" falls back to
    sequential training (one warning naming the reason, the engine's buffers freed), and its run equals sequential
    mode's from the round that ran out on (bit for bit when that is the measurement)."""
    if when == "measurement":
        oom_on_call(monkeypatch, 1)  # auto's warm-up throw-away round
        fake_clock(monkeypatch, 40.0, 10.0)
    else:
        fake_clock(monkeypatch, 40.0, 10.0)  # vectorized is chosen ...
        calls = oom_on_call(monkeypatch, 4)  # ... warm-up, timed and real round 0 run; round 1 runs out
    with pytest.warns(UserWarning, match=r"client_execution='auto': training clients sequentially \(vectorized "
                                         r"clients ran out of accelerator memory: CUDA out of memory\. Tried to "
                                         r"allocate 26\.64 GiB\.\)"):
        run = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto")
    loop = run[1]
    assert loop.client_execution_choice == "sequential" and loop._runtime.vectorized_fallback
    assert loop._runtime.vectorized_engine._scratch == {}
    sequential = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    if when == "measurement":
        assert_identical(run, sequential)
    else:
        assert len(calls) == 4  # no vectorised round after the fallback
        from test_vectorized import assert_same_run

        assert_same_run(sequential, run)


def test_vectorized_out_of_memory_names_the_setting(monkeypatch):
    oom_on_call(monkeypatch, 1)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"client_execution='vectorized': the round's \d+ clients in "
                                                          r"lockstep did not fit in accelerator memory \(CUDA out of "
                                                          r"memory\. Tried to allocate 26\.64 GiB\.\); use "
                                                          r"client_execution='sequential' or 'auto', or fewer "
                                                          r"clients_per_round"):
        fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
