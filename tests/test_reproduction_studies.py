"""The sensitivity-study section of the reproduction report, on hand-written sweep result tables."""

import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from reproduction import studies  # noqa: E402


def _write(results, name, rows):
    os.makedirs(os.path.join(results, "studies", name), exist_ok=True)
    keys = [
        "rank",
        "run",
        "status",
        "exit_code",
        "seconds",
        *rows[0]["params"],
        "val/acc",
        "test/acc",
        "train_eval/loss",
    ]
    with open(os.path.join(results, "studies", name, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for i, r in enumerate(rows):
            w.writerow(
                {
                    "rank": i + 1,
                    "run": f"{i:03d}",
                    "status": r.get("status", "finished"),
                    "exit_code": 0,
                    "seconds": 10.0,
                    **r["params"],
                    "val/acc": r["val"],
                    "test/acc": r["test"],
                    "train_eval/loss": r["loss"],
                }
            )


def _p(key, v):
    return {f"model.client_optimizer.init_args.{key}": v}


@pytest.fixture
def results(tmp_path):
    r = str(tmp_path)
    # seed 001: DecSPS best val 0.90 < SPS best 0.93 -> the claimed DecSPS >= SPS >= AMS does not hold
    _write(
        r,
        "s001_feddecsps",
        [
            {"params": _p("c0", 0.5), "val": 0.88, "test": 0.87, "loss": 0.4},
            {"params": _p("c0", 1.0), "val": 0.90, "test": 0.91, "loss": 0.3},
            {"params": _p("c0", 2.0), "val": 0.99, "test": 0.99, "loss": 0.1, "status": "failed"},
        ],
    )
    _write(r, "s001_fedsps", [{"params": _p("polyak_c", 0.5), "val": 0.93, "test": 0.92, "loss": 0.2}])
    _write(r, "s001_fedams", [{"params": _p("lr", 0.1), "val": 0.85, "test": 0.86, "loss": 0.3}])
    # seed 002 (train loss, lower is better): selected FedExP (best val) has loss 0.30 > FedAdam's 0.20, but FedExP's
    # best grid loss 0.10 < 0.20 -> does not hold when selected on validation, appears at the best grid setting
    eps, tau = "trainer.callbacks.init_args.eps", "trainer.callbacks.init_args.tau"
    _write(
        r,
        "s002_fedexp",
        [
            {"params": {eps: 0.001}, "val": 0.95, "test": 0.94, "loss": 0.30},
            {"params": {eps: 0.1}, "val": 0.90, "test": 0.89, "loss": 0.10},
        ],
    )
    _write(r, "s002_fedadam", [{"params": {tau: 0.01}, "val": 0.93, "test": 0.92, "loss": 0.20}])
    return r


def test_read_study_keeps_finished_runs_with_short_parameter_names(results):
    rows = studies.read_study(results, "s001_feddecsps")
    assert [r["params"] for r in rows] == [{"c0": "0.5"}, {"c0": "1.0"}]  # the failed run is dropped
    assert rows[1]["val/acc"] == pytest.approx(0.90) and rows[1]["test/acc"] == pytest.approx(0.91)


def test_findings_follow_the_tables(results):
    lines, seconds, findings = studies.studies_section(results)
    assert seconds == pytest.approx(10.0 * 7)  # every finished run's seconds
    assert findings["001"].startswith("the ordering FedDecSPS ≥ FedSPS ≥ FedAMS (validation accuracy) does not hold")
    assert "does not appear with each method at its best grid setting" in findings["001"]
    assert (
        "does not hold with the settings selected on validation, and appears with each method at its best"
        in findings["002"]
    )
    text = "\n".join(lines)
    assert "| 1.0 | 90.00 **(selected)** | 91.00 | 0.3 |" in text  # DecSPS: c0 = 1.0 is selected on validation
    assert "| 0.5 | 88.00 | 87.00 | 0.4 |" in text
    assert "their test accuracy: FedExP 94.00, FedAdam 92.00" in text
    assert "Best global train loss over each grid: FedExP 0.1 (eps = 0.1), FedAdam 0.2 (tau = 0.01)" in text


def test_a_study_that_has_not_run_is_reported_as_such(tmp_path):
    lines, seconds, findings = studies.studies_section(str(tmp_path))
    assert seconds == 0 and findings["001"] == "sensitivity study not run yet"
    assert "Not run yet: s001_feddecsps, s001_fedsps, s001_fedams." in lines


def test_every_question_names_existing_study_files():
    files = set(studies.study_files())
    for q in studies.QUESTIONS:
        assert {name for _, name in q.methods} <= files
        assert set(q.claimed) == {label for label, _ in q.methods}


def test_summary_keeps_a_claims_words_and_drops_its_source():
    from reproduction.report import _short

    assert (
        _short("FedSPS (untuned) is at least as good as the tuned FedAvg (Figs. 3-4)")
        == "FedSPS (untuned) is at least as good as the tuned FedAvg"
    )
    assert _short("FedExP reaches the lowest training loss (Table 2)") == "FedExP reaches the lowest training loss"
    assert _short("no source here") == "no source here"
