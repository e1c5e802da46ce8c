"""benchmarks/armijo_vectorized.py counts what the batched line search does, per local step, from the step's
telemetry (the rule's host-side counts, ``StepRecord.totals``) and its trial calls.

The printed counts must obey what the search guarantees (``fedlightning.vectorized.rules._BatchedArmijo``): every
searching client makes at least one trial per step, so a step of 20 clients makes at least 20 sequential trials;
the batched calls evaluate at least the sequential trials (rows ≥ trials) and a step makes no more calls than its
longest search has trials. The by-step breakdown averages back to the overall figures.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "armijo_vectorized.py")
CLIENTS = 20  # vectorized_speedup.CLIENTS_PER_ROUND
STEPS = 20  # vectorized_speedup.LOCAL_STEPS


def _value(out: str, label: str) -> float:
    match = re.search(re.escape(label) + r"\s+(-?[\d.]+)", out)
    assert match, f"{label!r} not in the output:\n{out}"
    return float(match.group(1))


def _row(out: str, label: str) -> list[float]:
    match = re.search(r"^\s+" + re.escape(label) + r"\s+([-\d. ]+)$", out, re.MULTILINE)
    assert match, f"{label!r} not in the output:\n{out}"
    return [float(v) for v in match.group(1).split()]


def test_printed_counts_hold_the_batched_search_guarantees():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--rounds", "3", "--algorithm", "FedExpSLS", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(rf"^{3 * STEPS} local steps of {CLIENTS} clients", out, re.MULTILINE), out
    trials = _value(out, "sequential trials (sum over clients)")
    longest = _value(out, "trials of the longest search")
    calls = _value(out, "vectorized trial calls")
    rows = _value(out, "vectorized trial rows")
    assert trials >= CLIENTS  # FedExpSLS's clients all search: at least one trial each, per step
    assert 1 <= longest <= trials
    assert 1 <= calls <= longest
    assert rows >= trials
    by_step = {label: _row(out, label) for label in ("calls", "rows", "sequential trials")}
    for label, overall in (("calls", calls), ("rows", rows), ("sequential trials", trials)):
        values = by_step[label]
        assert len(values) == STEPS
        # calls printed to 0.1 (overall 0.01), rows and trials to 1 (overall 0.1): equal to that rounding
        tolerance = 0.06 if label == "calls" else 0.55
        assert abs(sum(values) / STEPS - overall) <= tolerance, (label, values, overall)
    assert all(s >= CLIENTS for s in by_step["sequential trials"])


def test_repeated_gradient_evaluations_leave_the_run_unchanged():
    """``--repeat-gradient`` times one step's gradient evaluation 600 times over inside the run; the run's counts (the
    searches, which depend on every weight and loss) must be those of a run without it, and both forms are timed."""

    def run(*extra):
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--rounds", "3", "--algorithm", "FedExpSLS", "--threads", "1", *extra],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    plain, repeated = run(), run("--repeat-gradient")
    counts = ("sequential trials (sum over clients)", "trials of the longest search", "vectorized trial rows")
    assert [_value(repeated, c) for c in counts] == [_value(plain, c) for c in counts]
    for label in ("calls", "rows", "sequential trials"):
        assert _row(repeated, label) == _row(plain, label)
    line = r"^    (line search|FedAvg) .*?, (in a row|8 MiB written before each)\s+([\d.]+)$"
    forms = re.findall(line, repeated, re.MULTILINE)
    assert sorted((form, how) for form, how, _ in forms) == sorted(
        (form, how) for form in ("line search", "FedAvg") for how in ("in a row", "8 MiB written before each")
    )
    assert all(float(ms) > 0 for _, _, ms in forms)
