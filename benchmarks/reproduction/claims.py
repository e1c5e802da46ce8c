"""Verdicts of a paper's claims on the aggregated results of one setup.

Each factory returns a check ``check(agg, labels) -> (verdict, detail)``: ``agg[algorithm][metric]`` holds
``{"mean", "std", "n", "diverged"}`` over seeds, ``labels`` maps algorithm keys to the names printed in ``detail``.
Verdicts: ``"agrees"``, ``"agrees_tie"`` (an "at least as good" claim that holds only within the seed spread),
``"tie"``, ``"disagrees"``, ``"n/a"`` (an algorithm was not run).

Decision (ours): "A beats B" is a *tie* when the means differ by less than the sum of the two standard deviations
(sample std over seeds); a mean over seeds of which one diverged is undefined and the claim is not checked.

A claim over a set of algorithms ("A is the best", "A is the lowest of ...") that a partial invocation (``--only``)
ran for only some of them is checked only where it already fails: A worse than one that ran stays worse whatever the
others do, but "best of the ones run" is not the paper's claim, so it is "not checked", with the ones not run named.
An algorithm that ran and diverged counts as run (it cannot be the best).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Verdict = tuple[str, str]
Check = Callable[[dict[str, dict[str, Any]], dict[str, str]], Verdict]

# the metrics of one run (benchmarks/reproduction/report.py: final_metrics), averaged over seeds
LOSS, GLOSS, ACC = "train_loss", "train_eval_loss", "test_acc"


def stat(agg, algo: str, metric: str) -> dict[str, float] | None:
    """``agg[algo][metric]`` when it has a finite mean, else None."""
    a = agg.get(algo, {}).get(metric)
    if a is None or a["n"] == 0 or not math.isfinite(a["mean"]):
        return None
    return a


def _fmt(a, percent=False):
    if a is None:
        return "n/a"
    k = 100.0 if percent else 1.0
    return f"{a['mean'] * k:.3g} ± {a['std'] * k:.2g}" if not percent else f"{a['mean'] * k:.1f} ± {a['std'] * k:.1f}"


def compare(agg, labels, a: str, b: str, metric: str, higher_better: bool) -> Verdict:
    """``a`` vs ``b`` on ``metric``: agrees (a better), disagrees (a worse) or tie (|Δmean| < std_a + std_b)."""
    sa, sb = stat(agg, a, metric), stat(agg, b, metric)
    if sa is None or sb is None:
        return "n/a", f"{a} or {b} not run"
    diff = sa["mean"] - sb["mean"]
    pct = metric.endswith("acc")
    detail = f"{labels.get(a, a)} {_fmt(sa, pct)} vs {labels.get(b, b)} {_fmt(sb, pct)}"
    if abs(diff) < sa["std"] + sb["std"]:
        return "tie", detail
    better = diff > 0 if higher_better else diff < 0
    return ("agrees" if better else "disagrees"), detail


def beats(a: str, b: str, metric: str, higher_better: bool) -> Check:
    """ "``a`` is better than ``b`` on ``metric``"."""
    return lambda agg, labels: compare(agg, labels, a, b, metric, higher_better)


def at_least(check: Check) -> Check:
    """ "A is at least as good as B": a tie is consistent with it, reported as ``agrees_tie``, never as ``agrees``."""

    def wrapped(agg, labels):
        verdict, detail = check(agg, labels)
        return ("agrees_tie" if verdict == "tie" else verdict), detail

    return wrapped


def _not_run(agg, labels, algos: Sequence[str], metric: str) -> list[str]:
    """The names of ``algos`` with no run of ``metric`` (a diverged run counts as run)."""
    return [labels.get(k, k) for k in algos if not (agg.get(k, {}).get(metric) or {}).get("n")]


def _partial(verdict: str, detail: str, missing: list[str]) -> Verdict:
    """A set claim's verdict where some of its algorithms were not run: only a failure stands (module docstring)."""
    if not missing or verdict == "disagrees":
        return verdict, detail
    return "n/a", f"{detail}; not run: {', '.join(missing)}"


def best(a: str, metric: str, higher_better: bool, among: Sequence[str] | None = None) -> Check:
    """ "``a`` is the best of the algorithms" (the experiment's, i.e. ``labels``, or ``among`` if given): ``a``
    against the best other one that ran; "not checked" unless it fails where some were not run."""

    def check(agg, labels):
        sa = stat(agg, a, metric)
        if sa is None:
            return "n/a", f"{a} not run"
        candidates = [k for k in dict.fromkeys(among or labels or agg) if k != a]
        others = [k for k in candidates if stat(agg, k, metric) is not None]
        if not others:
            return "n/a", "nothing to compare with"
        sign = -1.0 if higher_better else 1.0
        best_other = sorted(others, key=lambda k: sign * stat(agg, k, metric)["mean"])[0]
        verdict, detail = compare(agg, labels, a, best_other, metric, higher_better)
        return _partial(verdict, f"best other: {detail}", _not_run(agg, labels, candidates, metric))

    return check


def all_of(*checks: Check) -> Check:
    """Every check holds: disagrees if any disagrees, else tie, else agrees_tie, else agrees; n/a if all n/a."""

    def check(agg, labels):
        results = [c(agg, labels) for c in checks]
        verdicts = [v for v, _ in results if v != "n/a"]
        detail = "; ".join(d for _, d in results)
        if not verdicts:
            return "n/a", detail
        for verdict in ("disagrees", "tie", "agrees_tie"):
            if verdict in verdicts:
                return verdict, detail
        return "agrees", detail

    return check


def at_most(algos: Sequence[str], metric: str, limit: float, unit: str) -> Check:
    """Every algorithm of ``algos`` that ran has a mean ``metric`` ≤ ``limit`` (``unit`` names it in the detail)."""

    def check(agg, labels):
        vals = [(a, stat(agg, a, metric)) for a in algos]
        vals = [(a, s) for a, s in vals if s is not None]
        if not vals:
            return "n/a", "not run"
        worst = max(s["mean"] for _, s in vals)
        detail = ", ".join(f"{labels.get(a, a)} {s['mean']:.2f}" for a, s in vals) + f" {unit}"
        return ("agrees" if worst <= limit else "disagrees"), detail

    return check


def no_worse_for_less(
    algos: Sequence[str], reference: str, metric: str, cost: str, cost_label: str, group: str
) -> Check:
    """Each of ``algos`` is at least as good as ``reference`` on ``metric`` (higher is better) with a relative
    ``cost`` below 1; a relative cost ≥ 1 disagrees whatever the metric. ``group`` names ``algos`` when none ran."""

    def check(agg, labels):
        if stat(agg, reference, metric) is None:
            return "n/a", f"{labels.get(reference, reference)} not run"
        out, verdicts = [], []
        for k in algos:
            s, spent = stat(agg, k, metric), stat(agg, k, cost)
            if s is None or spent is None:
                continue
            v, d = compare(agg, labels, k, reference, metric, True)
            if spent["mean"] >= 1.0:
                v = "disagrees"
            elif v in ("agrees", "tie"):
                v = "agrees" if v == "agrees" else "agrees_tie"
            verdicts.append(v)
            out.append(f"{d}, {cost_label} {spent['mean']:.2f}")
        if not verdicts:
            return "n/a", f"no {group} run"
        combined = "disagrees" if "disagrees" in verdicts else "agrees_tie" if "agrees_tie" in verdicts else "agrees"
        return combined, "; ".join(out)

    return check


def lowest(a: str, among: Sequence[str], metric: str) -> Check:
    """``a`` has the lowest mean ``metric`` of ``among`` (equal means: tie; needs ``a`` and one other; "not checked"
    unless it fails where some of ``among`` were not run)."""

    def check(agg, labels):
        vals = {k: stat(agg, k, metric) for k in among}
        vals = {k: v for k, v in vals.items() if v is not None}
        if a not in vals or len(vals) < 2:
            return "n/a", "not run"
        detail = ", ".join(f"{labels[k]} {v['mean']:.2f}" for k, v in vals.items())
        mine, others = vals[a]["mean"], min(v["mean"] for k, v in vals.items() if k != a)
        verdict = "agrees" if mine < others else "tie" if mine == others else "disagrees"
        return _partial(verdict, detail, _not_run(agg, labels, among, metric))

    return check
