"""``client_execution="auto"``: vectorised only where it is faster for this model, round shape and device.

The decision is tested deterministically: the clock that times the throw-away rounds is replaced by a virtual one
that advances only when the measurement trains (chosen times per client-step in each mode). Checked: the rule
itself, that auto's run is bit-identical to a run in the chosen mode (the measurement leaves no trace: no logged
values, no client state, no random draws), that it measures once per run and logs one plain-words line with its
choice and the measured speed ratio, that the measurement costs about one round where rounds are short (K of 1
or 2), that recurrent models are measured like any other, and that models with dropout train sequentially
unmeasured.
"""

import logging
from contextlib import contextmanager

import pytest
import torch

import fedlightning.vectorized.auto as auto
from fedlightning.vectorized import AUTO_MARGIN, auto_choice
from registry import CLIENT_OPTIMIZERS
from test_vectorized import fit
from test_vectorized_user_losses import UserMLP


@pytest.mark.parametrize(
    "seq,vec,want",
    [
        (100.0, 50.0, "vectorized"),
        (100.0, 100.0 / AUTO_MARGIN - 1e-6, "vectorized"),
        (100.0, 100.0 / AUTO_MARGIN + 1e-6, "sequential"),  # faster, but not by the margin
        (100.0, 100.0, "sequential"),
        (100.0, 250.0, "sequential"),
    ],
)
def test_auto_choice_rule(seq, vec, want):
    assert auto_choice(seq, vec) == want
    assert auto_choice(seq, vec, margin=1.0) == ("vectorized" if vec < seq else "sequential")


def virtual_clock(monkeypatch, seq, vec, spikes=None):
    """Replace auto's clock by one that advances only while auto's measurement trains: ``seq`` per local step of a
    client trained sequentially, ``vec`` per client per lockstep step of a vectorised throw-away round (the
    warm-up's two clients included), so vectorised is ``seq / vec`` times as fast. Returns the counters: the
    ``"sequential"`` and ``"vectorized"`` client-steps the measurement ran and ``"now"``, the clock (after the
    run: what the measurement cost). Binary fractions keep the arithmetic exact. The budget's floor in seconds,
    ``AUTO_MIN_BUDGET_SECONDS``, is set to 0: the clock's units are client-steps, not seconds. ``spikes``: extra
    time (another process taking the CPU) added to the i-th sequential client the measurement trains
    (``("sequential", i)``, 0 = the warm-up) or to its i-th vectorised lockstep step (``("vectorized", i)``, 0 =
    the warm-up's step)."""
    from fedlightning import FederatedLoop

    seen = {"now": 0.0, "sequential": 0, "vectorized": 0}
    spikes, calls = spikes or {}, {"sequential": 0, "vectorized": 0}
    train_client, run = FederatedLoop.train_client, auto._run

    def spike(mode):
        seen["now"] += spikes.get((mode, calls[mode]), 0.0)
        calls[mode] += 1

    def measuring(loop):
        return loop.client_execution == "auto" and loop.client_execution_choice is None

    def spy_client(self, plan, client_id, global_flat):
        if measuring(self):
            seen["sequential"] += plan.steps_for(client_id)
            seen["now"] += seq * plan.steps_for(client_id)
            spike("sequential")
        return train_client(self, plan, client_id, global_flat)

    def spy_run(loop, state, plan, client_ids, global_flat, throwaway=False, stop=None):
        if not measuring(loop):
            return run(loop, state, plan, client_ids, global_flat, throwaway=throwaway, stop=stop)

        def step():
            seen["vectorized"] += len(client_ids)
            seen["now"] += vec * len(client_ids)
            spike("vectorized")

        def timed_stop():  # asked after each lockstep step but the last
            step()
            return stop()

        out = run(
            loop, state, plan, client_ids, global_flat, throwaway=throwaway, stop=None if stop is None else timed_stop
        )
        if out is not None:
            for _ in range(plan.local_steps if stop is None else 1):  # the steps no stop question followed
                step()
        return out

    monkeypatch.setattr(FederatedLoop, "train_client", spy_client)
    monkeypatch.setattr(auto, "_run", spy_run)
    monkeypatch.setattr(auto, "_clock", lambda: seen["now"])
    monkeypatch.setattr(auto, "AUTO_MIN_BUDGET_SECONDS", 0.0)
    return seen


def auto_lines(caplog):
    return [r.getMessage() for r in caplog.records if "client_execution='auto'" in r.getMessage()]


def assert_identical(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert [(u.client_id, u.first_loss, u.mean_loss, u.step_sizes, u.backtracks) for u in a[2]] == [
        (u.client_id, u.first_loss, u.mean_loss, u.step_sizes, u.backtracks) for u in b[2]
    ]
    assert a[1].client_state.state_dict() == b[1].client_state.state_dict()
    ma, mb = a[3].callback_metrics, b[3].callback_metrics
    logged = sorted(k for k in ma if k.startswith("client/"))
    assert logged and logged == sorted(k for k in mb if k.startswith("client/"))
    assert [float(ma[k]) for k in logged] == [float(mb[k]) for k in logged]


# The round: 6 clients, K = 5 (test_vectorized's CPR and K), so a sequential round of 30 client-steps and at least
# 5 timed vectorised steps. Times in units of the clock (far above AUTO_MEASURE_SECONDS, so the minimums of 3
# clients and 5 steps are what is timed when the budget allows), worked by hand from _auto_decide's docstring:
#  * seq 4, vec 1: warm-ups 2 x 1 + 4 = 6; sequential clients end at 26, 46, 66 (each time the next client's 20
#    and a vectorised step of 6 clients at sequential speed, 24, still fit in the budget 120); the vectorised
#    round's steps take 6 each, all five fit (66 + 30 <= 120): 6 + 4 x 6 = 30 against 120, 4.00x.
#  * seq 1, vec 4: warm-ups 2 x 4 + 1 = 9; clients end at 14, 19, 24 (19 + 5 + 6 <= 30); one vectorised step takes
#    24, a second would exceed the budget 30: estimated 24 x 5 = 120 against 30, 0.25x.
WORDS = {
    "vectorized": "training clients vectorized (4.00x faster than one at a time; timed: 5 local steps of all 6 "
    "clients vectorized, 3 of the 6 clients one at a time)",
    "sequential": "training clients one at a time (sequential): vectorized measured 0.25x as fast (timed: 1 local "
    "step of all 6 clients vectorized, 3 of the 6 clients one at a time)",
}


@pytest.mark.parametrize("opt", ["sgd", "armijo"])
@pytest.mark.parametrize("seq,vec,chosen", [(4.0, 1.0, "vectorized"), (1.0, 4.0, "sequential")])
def test_auto_equals_the_chosen_mode_and_says_why(monkeypatch, caplog, opt, seq, vec, chosen):
    seen = virtual_clock(monkeypatch, seq, vec)
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS[opt], "auto")
    assert got[1].client_execution_choice == chosen
    lines = auto_lines(caplog)
    assert lines == [f"client_execution='auto': {WORDS[chosen]}"]  # measured once, at the first round
    reason = got[1].client_execution_reason
    assert reason and reason in lines[0]
    assert seen["sequential"] == 1 + 3 * 5
    assert seen["vectorized"] == 2 + 6 * (5 if chosen == "vectorized" else 1)
    if chosen == "sequential":  # no vectorised round follows: the engine's buffers are not kept
        assert got[1].vectorized_engine._scratch == {}
    reference = fit(UserMLP(), CLIENT_OPTIMIZERS[opt], chosen)
    assert_identical(got, reference)


@pytest.mark.parametrize(
    "where",
    [("sequential", 0), ("sequential", 1), ("sequential", 3), ("vectorized", 0), ("vectorized", 2), ("vectorized", 5)],
)
def test_an_interrupted_client_or_step_does_not_move_the_estimate(monkeypatch, caplog, where):
    """Another process stretching one sample by 100 (most of a sequential round of 120): the medians pass over one
    timed sequential client of three or one vectorised step after the first, and the warm-ups are not timed. With
    the budget out of the way, the first case of WORDS then measures its 4.00x, on the same samples."""
    seen = virtual_clock(monkeypatch, 4.0, 1.0, spikes={where: 100.0})
    monkeypatch.setattr(auto, "AUTO_MIN_BUDGET_SECONDS", 1e6)
    with caplog.at_level(logging.INFO):
        fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)
    assert auto_lines(caplog) == [f"client_execution='auto': {WORDS['vectorized']}"]
    assert seen["vectorized"] == 2 + 6 * 5 and seen["sequential"] == 1 + 3 * 5


@pytest.mark.parametrize(
    "seq,stall,words",
    [
        (
            1.0,
            100.0,
            "training clients one at a time (sequential): vectorized measured 1.00x as fast (timed: 1 local step of "
            "all 6 clients vectorized, 1 of the 6 clients one at a time (twice)); it is used only when at least 1.1x "
            "faster",
        ),
        (
            4.0,
            0.0,
            "training clients vectorized (4.00x faster than one at a time; timed: 1 local step of all 6 clients "
            "vectorized, 1 of the 6 clients one at a time (twice))",
        ),
    ],
)
def test_a_choice_resting_on_one_timed_client_times_it_again(monkeypatch, caplog, seq, stall, words):
    """A stall of 1000 in the vectorised warm-up uses up the budget, so one client is timed sequentially, and a
    second stall of 100 stretches that client's 5 steps to 105: the estimate rested on that one sample and read
    vectorized 21.00x faster where both modes run at the same speed (seq 1, vec 1: a lockstep step of the 6 clients
    costs 6 client-steps). The client is timed again after the vectorised step and keeps its smaller time: 1.00x,
    sequential. Where vectorized is faster (seq 4), the second timing confirms it."""
    seen = virtual_clock(monkeypatch, seq, 1.0, spikes={("vectorized", 0): 1000.0, ("sequential", 1): stall})
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)
    assert auto_lines(caplog) == [f"client_execution='auto': {words}"]
    assert seen["sequential"] == 1 + 5 + 5 and seen["vectorized"] == 2 + 6
    chosen = got[1].client_execution_choice
    assert chosen == ("sequential" if seq == 1.0 else "vectorized")
    assert_identical(got, fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], chosen, rounds=1))


def test_models_with_dropout_train_sequentially_without_measuring(monkeypatch, caplog):
    seen = virtual_clock(monkeypatch, 4.0, 1.0)  # a measurement would choose vectorized
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(dropout=0.2), CLIENT_OPTIMIZERS["sgd"], "auto")
    assert seen == {"now": 0.0, "sequential": 0, "vectorized": 0}
    assert auto_lines(caplog) == [
        "client_execution='auto': training clients one at a time (sequential): the model has dropout, and vectorized "
        "training would draw different dropout masks, so results would depend on this machine's speed; set "
        "client_execution='vectorized' to use it anyway"
    ]
    assert_identical(got, fit(UserMLP(dropout=0.2), CLIENT_OPTIMIZERS["sgd"], "sequential"))


class FunctionalDropout(UserMLP):
    """Dropout written as a function call in training_step, no ``nn.Dropout`` layer for the model's check to see."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.nn.functional.dropout(self.net[:2](x), 0.3, training=self.training)
        return torch.nn.functional.cross_entropy(self.net[3](h), y)


def test_random_draws_outside_dropout_layers_are_found_and_train_sequentially(monkeypatch, caplog):
    """The first batched call moves torch's generator: the model is random after all, so "auto" trains it
    sequentially whatever the timing says (vectorized would draw other masks, and the result would depend on this
    machine's speed), and its weights are sequential training's."""
    virtual_clock(monkeypatch, 4.0, 1.0)  # a measurement that would choose vectorized
    with caplog.at_level(logging.INFO):
        got = fit(FunctionalDropout(), CLIENT_OPTIMIZERS["sgd"], "auto")
    assert auto_lines(caplog) == [
        "client_execution='auto': training clients one at a time (sequential): training_step draws random numbers "
        "(torch's generator moved in its first batched call), and vectorized training would draw different ones, so "
        "results would depend on this machine's speed; set client_execution='vectorized' to use it anyway"
    ]
    assert_identical(got, fit(FunctionalDropout(), CLIENT_OPTIMIZERS["sgd"], "sequential"))
    vec = fit(FunctionalDropout(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    assert not vec[1].vectorized_engine.deterministic  # found in vectorized mode too (line searches replay draws)
    assert fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "vectorized")[1].vectorized_engine.deterministic


@pytest.mark.parametrize("seq,vec,chosen", [(4.0, 1.0, "vectorized"), (1.0, 4.0, "sequential")])
def test_recurrent_models_are_measured_on_cpu(monkeypatch, caplog, seq, vec, chosen):
    """A GRU text classifier trains faster vectorised on a CPU, an LSTM slower (docs/benchmarks.md §3): recurrent
    layers are measured like any model, and the measurement decides."""
    from fedlightning.models import CharGRU
    from test_vectorized import CharWindows

    seen = virtual_clock(monkeypatch, seq, vec)
    torch.manual_seed(6)
    model = CharGRU(vocab_size=10, embedding_dim=4, hidden_size=8, num_layers=1)
    with caplog.at_level(logging.INFO):
        got = fit(model, CLIENT_OPTIMIZERS["sgd"], "auto", dm_fn=CharWindows, rounds=2)
    assert seen["sequential"] > 0 and seen["vectorized"] > 0
    assert got[1].client_execution_choice == chosen
    assert auto_lines(caplog) == [f"client_execution='auto': {WORDS[chosen]}"]
    assert_identical(got, fit(model, CLIENT_OPTIMIZERS["sgd"], chosen, dm_fn=CharWindows, rounds=2))


def test_measurement_times_typical_clients_after_a_one_step_warm_up(monkeypatch):
    """Warm-up: one step of the round's first client sequentially and of its first two clients vectorized; timed:
    three clients sequentially (AUTO_SEQUENTIAL_CLIENTS; the clock's units are far above AUTO_MEASURE_SECONDS),
    the clients ranked by batch size (min(samples, batch size)) at 1/2, 1/4 and 3/4 of the 6, with all their K
    steps, and every client vectorized, in a round of K steps that stops after AUTO_MEASURE_STEPS."""
    from fedlightning import FederatedLoop
    from test_vectorized import BATCH, K

    virtual = virtual_clock(monkeypatch, 4.0, 1.0)
    monkeypatch.setattr(auto, "AUTO_MEASURE_STEPS", 2)
    assert K > 2
    seen = {"sequential": [], "vectorized": []}
    train_client, run = FederatedLoop.train_client, auto._run

    def spy_client(self, plan, client_id, global_flat):
        seen["sequential"].append((client_id, plan.local_steps))
        return train_client(self, plan, client_id, global_flat)

    def spy_run(loop, state, plan, client_ids, global_flat, throwaway=False, stop=None):
        seen["vectorized"].append((list(client_ids), plan.local_steps, throwaway))
        return run(loop, state, plan, client_ids, global_flat, throwaway=throwaway, stop=stop)

    monkeypatch.setattr(FederatedLoop, "train_client", spy_client)
    monkeypatch.setattr(auto, "_run", spy_run)
    got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2)
    clients = [u.client_id for u in got[2]]
    first, second = clients[: len(clients) // 2], clients[len(clients) // 2 :]  # the two real rounds' clients
    assert len(first) == 6
    assert [steps for _, steps in seen["sequential"]] == [1, K, K, K]  # nothing sequential after choosing vectorized
    assert seen["sequential"][0][0] == first[0]
    dm = got[3].datamodule
    size = {c: min(dm.client_num_samples(c), BATCH) for c in first}
    ranked = sorted(size.values())
    assert [size[c] for c, _ in seen["sequential"][1:]] == [ranked[3], ranked[1], ranked[4]]
    assert seen["vectorized"] == [(first[:2], 1, True), (first, K, True), (first, K, False), (second, K, False)]
    assert virtual["vectorized"] == 2 + 6 * 2  # the timed round stopped after 2 steps
    assert all(u.num_steps == K for u in got[2])


@pytest.mark.parametrize(
    "vec,chosen,words",
    [
        (
            1.0,
            "sequential",
            "training clients one at a time (sequential): vectorized measured 1.00x as fast (timed: 3 "
            "local steps of all 6 clients vectorized, 3 of the 6 clients one at a time); its measurement "
            "stopped after 3 steps, as it could no longer be 1.1x faster",
        ),
        (
            0.5,
            "vectorized",
            "training clients vectorized (2.00x faster than one at a time; timed: 5 local steps of all 6 "
            "clients vectorized, 3 of the 6 clients one at a time)",
        ),
    ],
)
def test_vectorized_measurement_stops_once_it_cannot_win(monkeypatch, caplog, vec, chosen, words):
    """The timed vectorised round is asked after each step whether its time so far, with all its remaining steps
    at its fastest step's time after the first (from the third step on), already rules it out. K = 20, 6 clients,
    sequential 1 per client-step: a round of 120; three clients take 60 after warm-ups of 2 vec + 1. At 1 per
    client-step (6 per lockstep step) three steps mean a round of at least 18 + 17 x 6 = 120, not 1.1x faster
    than 120: it stops there, although the budget (120 - 63) would allow more steps. At 0.5 it runs its 5 steps
    (3 each; then it has timed enough) and is chosen: 3 + 19 x 3 = 60, 2.00x. A stopped measurement leaves no
    trace: the run equals a sequential run."""
    import test_vectorized

    monkeypatch.setattr(test_vectorized, "K", 20)
    seen = virtual_clock(monkeypatch, 1.0, vec)
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)
    assert got[1].client_execution_choice == chosen
    assert auto_lines(caplog) == [f"client_execution='auto': {words}"]
    assert seen["vectorized"] == 2 + 6 * (3 if chosen == "sequential" else 5)
    monkeypatch.undo()
    monkeypatch.setattr(test_vectorized, "K", 20)
    assert_identical(got, fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], chosen, rounds=1))


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("vec", [1.0, 0.25])
def test_measurement_costs_about_one_round_when_rounds_are_short(monkeypatch, caplog, steps, vec):
    """K = 1 or 2, 6 clients: a round of 6 or 12 sequential client-steps (time 1 each). The whole measurement
    (warm-ups included) costs at most that round, or, where even that is too little, its floor: the warm-ups (two
    vectorised client-steps, one sequential), one client's K steps sequentially and one vectorised step of the 6
    clients; and where fewer than 3 timed clients chose vectorized, their steps once more (the re-timing that keeps
    one interrupted client from deciding). Timing every client both ways (min(K, 5) steps each) would cost more
    than a round in every case."""
    import test_vectorized

    monkeypatch.setattr(test_vectorized, "K", steps)
    seen = virtual_clock(monkeypatch, 1.0, vec)
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)
    C = 6
    round_ = C * steps
    chosen = "vectorized" if vec == 0.25 else "sequential"  # 4x faster; as fast (not by the 1.1 margin)
    line = auto_lines(caplog)[0]
    floor = (2 * vec + 1) + steps + C * vec
    every_client_both_ways = (2 * vec + 1) + round_ + round_ * vec
    assert every_client_both_ways > round_
    again = (seen["sequential"] - 1) / 2 if "(twice)" in line else 0  # the timed clients' steps, once more
    assert again < 3 * steps
    assert 0 < seen["now"] <= max(round_, floor) + again
    assert seen["now"] == seen["sequential"] + seen["vectorized"] * vec
    assert got[1].client_execution_choice == chosen
    assert (
        "4.00x faster than one at a time" if chosen == "vectorized" else "vectorized measured 1.00x as fast"
    ) in line
    if chosen == "sequential":
        assert line.endswith("; it is used only when at least 1.1x faster")


@pytest.mark.parametrize("seconds,clients", [(0.05, 3), (1000.0, 6)])
def test_a_cheap_round_is_measured_in_full_within_the_minimum_budget(monkeypatch, seconds, clients):
    """Where one round costs less than AUTO_MIN_BUDGET_SECONDS, the budget does not cut the measurement short:
    the K = 2, 6-client round that the one-round budget measures at its floor (previous test: one client, one
    vectorised step) is measured on both steps vectorised and, sequentially, on AUTO_SEQUENTIAL_CLIENTS clients
    once they have taken AUTO_MEASURE_SECONDS (here at once: 2 units per client), else on more, up to all 6,
    each once."""
    import test_vectorized

    monkeypatch.setattr(test_vectorized, "K", 2)
    seen = virtual_clock(monkeypatch, 1.0, 1.0)
    monkeypatch.setattr(auto, "AUTO_MIN_BUDGET_SECONDS", 1000.0)  # the round costs 12
    monkeypatch.setattr(auto, "AUTO_MEASURE_SECONDS", seconds)
    timed = []
    train_client = auto._throwaway_sequential

    @contextmanager
    def spy(loop):
        with train_client(loop):
            from fedlightning import FederatedLoop

            inner = FederatedLoop.train_client
            monkeypatch.setattr(
                FederatedLoop,
                "train_client",
                lambda self, plan, cid, flat: (timed.append(cid), inner(self, plan, cid, flat))[1],
            )
            yield
            monkeypatch.setattr(FederatedLoop, "train_client", inner)

    monkeypatch.setattr(auto, "_throwaway_sequential", spy)
    got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)
    assert (seen["sequential"], seen["vectorized"]) == (1 + clients * 2, 2 + 6 * 2)
    first = sorted(u.client_id for u in got[2])
    assert len(timed) == 1 + clients and len(set(timed[1:])) == clients and set(timed) <= set(first)
    assert got[1].client_execution_choice == "sequential"  # as fast, not by the margin


def test_ragged_step_counts_are_estimated_from_each_clients_steps(monkeypatch, caplog):
    """With local_epochs, each client runs its own number of steps K_c: sequential training costs the sum of them,
    a vectorised round K = max K_c lockstep steps of all C clients (finished clients are masked, not skipped), so
    at equal cost per client-step vectorised is sum(K_c) / (C K) as fast."""
    import re

    import test_vectorized

    monkeypatch.setattr(test_vectorized, "K", None)
    vec = 0.125
    virtual_clock(monkeypatch, 1.0, vec)
    with caplog.at_level(logging.INFO):
        got = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1, local_epochs=1.0)
    steps = [u.num_steps for u in got[2]]
    assert len(steps) == 6 and len(set(steps)) > 1
    want = sum(steps) / (len(steps) * max(steps) * vec)
    line = auto_lines(caplog)[0]
    ratio = float(re.search(r"([0-9.]+)x (faster|as fast)", line).group(1))
    assert ratio == pytest.approx(want, abs=0.005)
    assert got[1].client_execution_choice == auto_choice(sum(steps), max(steps) * len(steps) * vec)


def oom_on_call(monkeypatch, which):
    """The vectorised engine raises CUDA's out-of-memory error from its ``which``-th call (1-based) on, for groups of
    any size, and runs normally before; returns the list of calls."""
    from fedlightning.vectorized import VectorizedClientTrainer

    calls = []
    run = VectorizedClientTrainer.run

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) >= which:
            self.scratch("probe", (4, 4), torch.float32, torch.device("cpu"))  # a buffer the fallback frees
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.64 GiB.\nmore details")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(VectorizedClientTrainer, "run", failing)
    return calls


@pytest.mark.parametrize("when", ["measurement", "later round"])
def test_auto_trains_sequentially_when_vectorized_runs_out_of_memory(monkeypatch, when):
    """Vectorised clients hold C clients' activations at once: a group that does not fit is halved, and where not
    even one client fits, "auto" falls back to sequential training (one warning naming the reason, the engine's
    buffers freed), and its run equals sequential mode's from the round that ran out on (bit for bit when that is
    the measurement). tests/test_client_groups.py has the halving that succeeds."""
    if when == "measurement":
        oom_on_call(monkeypatch, 1)  # auto's warm-up throw-away round
        virtual_clock(monkeypatch, 4.0, 1.0)
    else:
        virtual_clock(monkeypatch, 4.0, 1.0)  # vectorized is chosen ...
        calls = oom_on_call(monkeypatch, 4)  # ... warm-up, timed and real round 0 run; round 1 runs out
    with pytest.warns(
        UserWarning,
        match=r"client_execution='auto': training clients sequentially \(vectorized "
        r"clients ran out of accelerator memory even one at a time: CUDA out of memory\. Tried to "
        r"allocate 26\.64 GiB\.\)",
    ):
        run = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "auto")
    loop = run[1]
    assert loop.client_execution_choice == "sequential"
    assert loop.vectorized_engine._scratch == {}
    sequential = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    if when == "measurement":
        assert_identical(run, sequential)
    else:
        assert len(calls) == 3 + 3  # round 1: groups of 6, 3 and 1 ran out; no vectorised call after the fallback
        from test_vectorized import assert_same_run

        assert_same_run(sequential, run)


class ItemFromRound1(UserMLP):
    """Logs loss.item() from round 1 on: vmap cannot batch .item(), which round 0 did not call."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= 1:
            self.log("loss_item", loss.item())
        return loss


def test_a_vmap_failure_first_met_in_a_later_round_falls_back_to_sequential(monkeypatch):
    """A batched call that vmap refuses in round 1 (not in round 0, where vectorized was chosen): "vectorized" stops
    with an error naming the step and round; "auto" trains that round and the rest sequentially (one warning), and
    its run equals sequential training's (float64)."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(
        VectorizationUnsupportedError,
        match=r"failed at local step 0 of round 1 under torch.func.vmap: vmap: .*\.item\(\)",
    ):
        fit(ItemFromRound1(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    virtual_clock(monkeypatch, 4.0, 1.0)  # vectorized is chosen
    with pytest.warns(
        UserWarning,
        match=r"client_execution='auto': training clients sequentially \(client_execution='vectorized' failed at "
        r"local step 0 of round 1",
    ):
        run = fit(ItemFromRound1(), CLIENT_OPTIMIZERS["sgd"], "auto")
    assert run[1].client_execution_choice == "sequential"
    from test_vectorized import assert_same_run

    assert_same_run(fit(ItemFromRound1(), CLIENT_OPTIMIZERS["sgd"], "sequential"), run)


def test_vectorized_out_of_memory_names_the_setting(monkeypatch):
    oom_on_call(monkeypatch, 1)
    with pytest.raises(
        torch.cuda.OutOfMemoryError,
        match=r"client_execution='vectorized': one client alone did not fit in accelerator memory in lockstep "
        r"\(max_parallel_clients=None, halved down to 1; CUDA out of memory\. Tried to allocate 26\.64 GiB\.\); use "
        r"client_execution='sequential' or 'auto'",
    ):
        fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "vectorized")


def test_a_resumed_run_keeps_the_choice_measured_before_the_resume(monkeypatch, tmp_path, caplog):
    """The choice is checkpointed: resumed where a new measurement would choose sequential (the virtual clock now
    makes vectorized slower), the run trains vectorized as before and equals the uninterrupted run bit for bit."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from conftest import make_trainer
    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from fedlightning.checkpoint import AtomicCheckpointIO
    from test_vectorized import digits

    def setup():
        torch.manual_seed(1)
        return FederatedLoop(
            UserMLP(), client_optimizer=CLIENT_OPTIMIZERS["sgd"], local_steps=3, clients_per_round=6, seed=3,
            client_execution="auto",
        )  # fmt: skip

    def weights(loop):
        return torch.cat([p.detach().reshape(-1) for p in loop.model.parameters()])

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        virtual_clock(mp, 4.0, 1.0)  # vectorized is chosen
        full = setup()
        make_trainer(4, callbacks=[FedAvg()]).fit(full, datamodule=digits(float64=False))
        assert full.client_execution_choice == "vectorized"
        cut = setup()
        ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = make_trainer(2, callbacks=[FedAvg(), ck], enable_checkpointing=True, plugins=[AtomicCheckpointIO()])
        trainer.fit(cut, datamodule=digits(float64=False))
    seen = virtual_clock(monkeypatch, 1.0, 4.0)  # a new measurement would choose sequential
    resumed = setup()
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(4, callbacks=[FedAvg()], plugins=[AtomicCheckpointIO()]).fit(
            resumed, datamodule=digits(float64=False), ckpt_path=str(tmp_path / "step=2.ckpt"), weights_only=True
        )
    assert seen["sequential"] == seen["vectorized"] == 0  # no measurement after the resume
    assert resumed.client_execution_choice == "vectorized"
    assert any("as measured before the resume" in line for line in auto_lines(caplog))
    assert torch.equal(weights(resumed), weights(full))
