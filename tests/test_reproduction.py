"""benchmarks/reproduction: the K-decay runs built from their configs, claim verdicts on analytic cases, a study
added as data and reported from a cache of hand-made results, and the errors for bad experiment definitions."""

import json
import os
import sys

import numpy as np
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from reproduction import claims, experiments, report, runner  # noqa: E402
from reproduction.experiments import Algorithm, Claim, Experiment, Setup  # noqa: E402


def _option(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) <= 1, (name, args)
    return values[0] if values else None


def _config_callbacks(config):
    with open(os.path.join(ROOT, config)) as f:
        return (yaml.safe_load(f).get("trainer") or {}).get("callbacks") or []


@pytest.mark.parametrize("scale", [0.5, 0.05])
def test_kdecay_runs_carry_their_configs_callbacks_scaled_to_the_rounds(scale):
    """Mills et al. (2023) protocol: each schedule's KDecay window is 5% of the rounds (at least 2), the step
    schedule switches at half of them, the η-decay schedules decay the client lr, Kη-fixed gets dSGD's RuntimeModel,
    budget runs may take 20x the rounds and dSGD keeps its own K = 1."""
    specs = [s for s in runner.all_specs(1, scale) if s.run_id.startswith("004/")]
    assert {s.algorithm.key for s in specs} == {
        "fixed",
        "dsgd",
        "kr-rounds",
        "kr-error",
        "kr-step",
        "eta-rounds",
        "eta-error",
        "eta-step",
    }
    rounds = max(1, int(round(200 * scale)))
    runtime = next(cb for cb in _config_callbacks("configs/dsgd.yaml") if cb["class_path"].endswith("RuntimeModel"))
    for s in specs:
        assert s.missing is None and s.rounds == rounds
        expected = _config_callbacks(s.algorithm.config)
        for cb in expected:
            if cb["class_path"] == "fedlightning.callbacks.KDecay":
                cb["init_args"]["window"] = max(2, rounds // 20)
                if cb["init_args"]["schedule"] == "step":
                    cb["init_args"]["step_round"] = max(2, rounds // 2)
                if s.algorithm.key.startswith("eta-"):
                    cb["init_args"]["decay"] = "client_lr"
        if s.algorithm.key == "fixed":
            expected.append(runtime)
        assert json.loads(_option(s.args, "trainer.callbacks")) == expected
        budget = s.algorithm.key != "fixed"
        assert int(_option(s.args, "trainer.max_steps")) == (20 * rounds if budget else rounds)
        assert s.max_rounds == (20 * rounds if budget else None)
        assert _option(s.args, "model.local_steps") == (None if s.algorithm.key == "dsgd" else "20")


def _agg(**stats):
    return {k: {"m": {"mean": m, "std": sd, "n": 3, "diverged": 0}} for k, (m, sd) in stats.items()}


def test_claim_verdicts_follow_the_tie_rule():
    labels = {"a": "A", "b": "B", "c": "C"}
    # |1.3 - 1.0| = 0.3 > 0.1 + 0.1: a beats b; |1.15 - 1.0| = 0.15 < 0.2: a tie
    assert claims.beats("a", "b", "m", True)(_agg(a=(1.3, 0.1), b=(1.0, 0.1)), labels)[0] == "agrees"
    assert claims.beats("a", "b", "m", False)(_agg(a=(1.3, 0.1), b=(1.0, 0.1)), labels)[0] == "disagrees"
    tie = _agg(a=(1.15, 0.1), b=(1.0, 0.1))
    assert claims.beats("a", "b", "m", True)(tie, labels) == ("tie", "A 1.15 ± 0.1 vs B 1 ± 0.1")
    assert claims.at_least(claims.beats("a", "b", "m", True))(tie, labels)[0] == "agrees_tie"
    assert claims.beats("a", "x", "m", True)(tie, labels)[0] == "n/a"
    # best: a against the best other (c), not against b
    three = _agg(a=(2.0, 0.1), b=(1.0, 0.1), c=(1.95, 0.1))
    assert claims.best("a", "m", True)(three, labels) == ("tie", "best other: A 2 ± 0.1 vs C 1.95 ± 0.1")
    assert claims.best("a", "m", True, among=["a", "b"])(three, labels)[0] == "agrees"
    # all_of: disagrees > tie > agrees_tie > agrees
    agree, dis = claims.beats("a", "b", "m", True), claims.beats("b", "a", "m", True)
    assert claims.all_of(agree, claims.beats("a", "c", "m", True))(three, labels)[0] == "tie"
    assert claims.all_of(agree, dis)(three, labels)[0] == "disagrees"
    assert claims.at_most(["a", "b"], "m", 2.0, "u")(three, labels) == ("agrees", "A 2.00, B 1.00 u")
    assert claims.at_most(["a", "b"], "m", 1.5, "u")(three, labels)[0] == "disagrees"
    assert claims.lowest("b", ["a", "b", "c"], "m")(three, labels)[0] == "agrees"


def test_a_set_claim_with_algorithms_not_run_is_checked_only_where_it_fails():
    """``--only`` ran a and b of the experiment's a, b, c: "a is the best" holds among the two run, but c could
    beat it, so the claim is not checked (c named); "b is the best" fails against a whatever c does. A diverged
    c counts as run: it cannot be the best."""
    labels = {"a": "A", "b": "B", "c": "C"}
    two = _agg(a=(2.0, 0.1), b=(1.0, 0.1))
    assert claims.best("a", "m", True)(two, labels) == ("n/a", "best other: A 2 ± 0.1 vs B 1 ± 0.1; not run: C")
    assert claims.best("b", "m", True)(two, labels)[0] == "disagrees"
    assert claims.best("a", "m", True, among=["a", "b"])(two, labels)[0] == "agrees"
    assert claims.lowest("b", ["a", "b", "c"], "m")(two, labels) == ("n/a", "A 2.00, B 1.00; not run: C")
    assert claims.lowest("a", ["a", "b", "c"], "m")(two, labels)[0] == "disagrees"
    diverged = {**two, "c": {"m": {"mean": float("nan"), "std": float("nan"), "n": 3, "diverged": 1}}}
    assert claims.best("a", "m", True)(diverged, labels)[0] == "agrees"
    assert claims.lowest("b", ["a", "b", "c"], "m")(diverged, labels)[0] == "agrees"


def test_no_worse_for_less_needs_a_relative_cost_below_one():
    labels = {"ref": "R", "a": "A", "b": "B"}
    agg = {
        "ref": {"acc": {"mean": 0.8, "std": 0.01, "n": 3}},
        "a": {"acc": {"mean": 0.81, "std": 0.01, "n": 3}, "cost": {"mean": 0.5, "std": 0.0, "n": 3}},
        "b": {"acc": {"mean": 0.9, "std": 0.01, "n": 3}, "cost": {"mean": 1.2, "std": 0.0, "n": 3}},
    }
    check = claims.no_worse_for_less(["a"], "ref", "acc", "cost", "relative cost", group="schedule")
    assert check(agg, labels) == ("agrees_tie", "A 81.0 ± 1.0 vs R 80.0 ± 1.0, relative cost 0.50")
    # b is far more accurate but costs more than the reference
    assert claims.no_worse_for_less(["a", "b"], "ref", "acc", "cost", "c", group="g")(agg, labels)[0] == "disagrees"
    assert claims.no_worse_for_less(["x"], "ref", "acc", "cost", "c", group="schedule")(agg, labels) == (
        "n/a",
        "no schedule run",
    )


def _study():
    setup = Setup(
        "tiny-synthetic",
        "Synthetic(1,1), 10 rounds",
        "a study's stand-in",
        experiments.LOGREG_60,
        experiments._synthetic(1.0, 1.0),
        rounds=20,
        eval_every=5,
        sgd_lr=0.01,
    )
    algos = experiments.vary(
        Algorithm("fedprox", "FedProx", "configs/fedprox.yaml"), "trainer.callbacks.init_args.mu", [0.01, 1.0]
    )
    hi, lo = "fedprox-mu1.0", "fedprox-mu0.01"
    return Experiment(
        "003",
        "FedProx's μ",
        [setup],
        algos,
        {"clients_per_round": 5, "local_steps": 3, "batch_size": 10},
        "μ varied",
        [
            Claim("a larger μ is more accurate", claims.beats(hi, lo, "test_acc", True)),
            Claim("a larger μ has a lower loss", claims.beats(hi, lo, "train_loss", False)),
        ],
        key="003-mu",
    )


def test_a_study_is_data_and_is_reported_from_its_cached_runs(tmp_path):
    study = _study()
    specs = runner.all_specs(3, 0.5, experiments=[study])
    assert [s.run_id for s in specs] == [
        f"003-mu/tiny-synthetic/fedprox-mu{m}/seed{k}" for m in (0.01, 1.0) for k in range(3)
    ]
    assert len({s.key for s in specs}) == 6 and all(s.rounds == 10 and s.missing is None for s in specs)
    for s in specs:
        mu = s.algorithm.key.rsplit("mu", 1)[1]
        assert s.args[-1] == f"--trainer.callbacks.init_args.mu={mu}"
        assert _option(s.args, "model.client_optimizer.init_args.lr") == "0.01"  # the setup's SGD lr
    # hand-made results: losses per round, and the accuracy of the last evaluation
    rng = np.random.default_rng(0)
    finals = {}
    for s in specs:
        losses = rng.uniform(0.5, 1.0, size=10)
        acc = (0.9 if s.algorithm.key.endswith("1.0") else 0.6) + rng.uniform(0, 0.01)
        finals.setdefault(s.algorithm.key, []).append((losses[-1], acc))  # 5% of 10 rounds: the last one
        runner.save_result(
            str(tmp_path / "cache"),
            s,
            {
                "key": s.key,
                "status": "ok",
                "seed": s.seed,
                "rounds_done": 10,
                "seconds": 1.0,
                "history": [{"round": r + 1, "train/loss": float(v)} for r, v in enumerate(losses)],
                "evals": [{"round": 10, "test_eval/acc": acc, "train_eval/loss": 0.1}],
            },
        )
    path = report.write_report(
        specs,
        str(tmp_path / "cache"),
        str(tmp_path / "docs"),
        "python x",
        {},
        3,
        0.5,
        toy=False,
        toy_rounds=0,
        experiments=[study],
    )
    text = open(path, encoding="utf-8").read()
    assert "## Seed 003: FedProx's μ" in text and "(10 rounds; stands in for a study's stand-in)" in text
    for key, rows in finals.items():
        loss, acc = np.array(rows).T
        label = f"FedProx mu = {key.rsplit('mu', 1)[1]}"
        assert f"| {label} | {loss.mean():.3g} ± {loss.std(ddof=1):.2g} |" in text
        assert f"| {label} | {100 * acc.mean():.2f} ± {100 * acc.std(ddof=1):.2f} |" in text
    assert "  * a larger μ is more accurate: agrees (" in text
    loss_lo, loss_hi = (np.array(finals[k])[:, 0] for k in ("fedprox-mu0.01", "fedprox-mu1.0"))
    spread = loss_lo.std(ddof=1) + loss_hi.std(ddof=1)
    expected = (
        "tie (within seed spread)"
        if abs(loss_hi.mean() - loss_lo.mean()) < spread
        else "agrees"
        if loss_hi.mean() < loss_lo.mean()
        else "**disagrees**"
    )
    assert f"  * a larger μ has a lower loss: {expected} (" in text
    assert os.path.isfile(tmp_path / "docs" / "figures" / "003-mu_tiny-synthetic.png")
    assert "![003-mu_tiny-synthetic.png](figures/003-mu_tiny-synthetic.png)" in text


def _exp(**kw):
    setup = experiments.DIGITS_LOGREG
    args = dict(
        paper="000",
        title="t",
        setups=[setup],
        algorithms=[experiments.FEDAVG],
        protocol={"clients_per_round": 2, "local_steps": 1, "batch_size": 8},
        protocol_note="n",
    )
    args.update(kw)
    return Experiment(**args)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(algorithms=[experiments.FEDAVG, experiments.FEDAVG]), r"duplicate algorithm keys \['fedavg'\]"),
        (dict(protocol={"clients_per_round": 2, "local_steps": 1}), r"protocol lacks \['batch_size'\]"),
        (dict(claims=[Claim("c", claims.beats("a", "b", "m", True), setups=["digits-mlp"])]), r"\['digits-mlp'\]"),
        (dict(table="wide"), "table must be one of .* got 'wide'"),
        (dict(loss_metric="loss"), "loss_metric must be .* got 'loss'"),
        (dict(algorithms=[Algorithm("d", "D", "configs/dsgd.yaml", kind="budget")]), "exactly one reference"),
        (dict(curves=()), "at least one curve"),
    ],
)
def test_bad_experiments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        _exp(**kw)


def test_bad_algorithms_setups_and_experiment_lists_are_named():
    with pytest.raises(ValueError, match="kind must be one of .* got 'fixed'"):
        Algorithm("a", "A", "configs/quickstart.yaml", kind="fixed")
    with pytest.raises(ValueError, match=r"without '--', got \['--model.seed=1'\]"):
        Algorithm("a", "A", "configs/quickstart.yaml", args=["--model.seed=1"])
    with pytest.raises(ValueError, match="setup 's': rounds must be an int >= 1, got 0"):
        Setup("s", "t", "a", {}, experiments._shakespeare, rounds=0, eval_every=1)
    with pytest.raises(ValueError, match=r"duplicate experiment keys \['000'\]"):
        runner.all_specs(1, 1.0, experiments=[_exp(), _exp(title="other")])
    bad = Algorithm("a", "A", "configs/quickstart.yaml", callback_args={"KDecay": {"window": 3}})
    with pytest.raises(ValueError, match="callback_args names 'KDecay', which configs/quickstart.yaml does not"):
        runner.all_specs(1, 1.0, experiments=[_exp(algorithms=[bad])])


def test_a_missing_callback_entry_marks_the_run_missing():
    algo = Algorithm("a", "A", "configs/quickstart.yaml", extra_callbacks=[("configs/dsgd.yaml", "NoSuchCallback")])
    (spec,) = runner.all_specs(1, 1.0, experiments=[_exp(algorithms=[algo])])
    assert spec.missing == "configs/dsgd.yaml (its NoSuchCallback entry)"
    assert spec.rounds == 200 and spec.max_rounds is None


def test_a_cached_result_that_is_not_a_result_counts_as_not_cached(tmp_path):
    """A result file that is valid JSON but not an object (a list, a number) is a run to redo, as a truncated file
    is, not an AttributeError in the report; a finished result of the same key is read back."""
    (spec,) = runner.all_specs(1, 0.5, experiments=[_study()])[:1]
    cache = str(tmp_path / "cache")
    runner.save_result(cache, spec, {"key": spec.key, "status": "ok", "history": []})
    assert runner.load_cached(cache, spec)["key"] == spec.key
    for text in ("[1, 2]", "3", "not json"):
        with open(runner.result_path(cache, spec), "w") as f:
            f.write(text)
        assert runner.load_cached(cache, spec) is None


def test_the_summary_of_a_partial_invocation_says_what_was_checked():
    """A claim whose runs were not all made is "n/a" on every setup: the paper's summary line says no claim was
    checked (it read "— ." before), and a claim that held reads "on every setup checked", not on every setup."""
    exp = experiments.EXPERIMENTS[0]
    claim = exp.claims[0].text
    lines = report._summary([exp], {exp.paper: {claim: ["n/a"]}}, {})
    assert lines[2].endswith("— No claim checked yet (a claim is checked once the runs it compares have all run).")
    lines = report._summary([exp], {exp.paper: {claim: ["agrees"]}}, {})
    assert f"— Holds on every setup checked: {report._short(claim)}." in lines[2]


def test_docs_results_rest_on_runs_of_the_current_configs():
    """docs/results.md says which command wrote it; every run that command reports must be in the committed cache
    under the key of the current configs and arguments, else the page shows results of a configuration that no
    longer exists (or leaves out runs the experiments now hold). A config edit that changes a run's key needs those
    runs again: ``python benchmarks/reproduce.py <the command's options> --only <the runs named>``."""
    import shlex

    import reproduce

    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        head = f.read(2000)
    command = head.split("Command: `", 1)[1].split("`", 1)[0]
    argv = shlex.split(command)[2:]
    assert "--only" not in argv and "--results" not in argv, command
    ns = {"--rounds": "1", "--seeds": "3"}
    scales = {}
    it = iter(argv)
    for arg in it:
        if arg == "--setup-rounds":
            pattern, scale = next(it).split("=")
            scales[pattern] = float(scale)
        elif arg in ns:
            ns[arg] = next(it)
    specs = reproduce.all_specs(int(ns["--seeds"]), float(ns["--rounds"]), scales)
    results = os.path.join(BENCH, "results")
    stale = [s.run_id for s in specs if not s.missing and runner.load_cached(results, s) is None]
    assert not stale, f"{len(stale)} runs of docs/results.md are not cached under their current key: {stale[:10]}"
    assert len(specs) >= 200


def test_the_summary_does_not_word_a_tie_as_the_claim():
    """A claim tied within the seed spread is not confirmed, and the summary says so (it listed the claim's text
    under "within the seed spread", which read as the claim holding)."""
    exp = experiments.EXPERIMENTS[0]
    claim = exp.claims[0].text
    line = report._summary([exp], {exp.paper: {claim: ["tie"]}}, {})[2]
    assert f"— Tied within the seed spread, so not confirmed: {report._short(claim)}." in line
