"""Sensitivity studies: is a disagreement with a paper the setting, a hyper-parameter or the method?

Each study is a sweep file in ``benchmarks/studies/`` (one method, one grid) run by the offline sweep runner
(``python -m fedlightning.sweep FILE --out benchmarks/results/studies/<name>``): every run keeps a validation split
(the data modules' default ``val_fraction = 0.1``), so a setting is *selected* on ``val/acc`` and its test accuracy
is only reported. A :class:`Question` groups the studies of the methods one claim compares and says which ordering
the paper reports; :func:`studies_section` writes the tables and, computed from them, whether that ordering appears
with the selected settings and at any setting of the grids.

Decisions (ours): one seed per grid point (seed 0; the seed spread of the 3-seed tables above is the noise scale to
read them against); the final ``val/acc`` and ``test/acc`` are the global model's after the last round;
``train_eval/loss`` is the global model's loss on the clients' training data after the last round, the training
loss compared in seed 002's Table 2.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from . import ROOT

STUDIES_DIR = os.path.join(ROOT, "benchmarks", "studies")
VAL, TEST, GLOBAL_LOSS = "val/acc", "test/acc", "train_eval/loss"


@dataclass(frozen=True)
class Question:
    """A claim of ``paper`` comparing ``methods`` (label -> study file stem), checked on ``metric``.

    ``claimed`` lists labels in the paper's order, best first (each at least as good as the next)."""

    paper: str
    claim: str
    methods: tuple[tuple[str, str], ...]
    claimed: tuple[str, ...]
    metric: str = VAL  # VAL (higher is better) or GLOBAL_LOSS (lower is better)


QUESTIONS: tuple[Question, ...] = (
    Question(
        "001",
        "FedDecSPS ≥ FedSPS under heterogeneity, and both beat FedAMS (Table 1, α ≤ 0.1)",
        (("FedDecSPS", "s001_feddecsps"), ("FedSPS", "s001_fedsps"), ("FedAMS", "s001_fedams")),
        ("FedDecSPS", "FedSPS", "FedAMS"),
    ),
    Question(
        "002",
        "FedExP reaches a lower training loss than FedAdam (Table 2: FedExP best among the baselines)",
        (("FedExP", "s002_fedexp"), ("FedAdam", "s002_fedadam")),
        ("FedExP", "FedAdam"),
        metric=GLOBAL_LOSS,
    ),
)


def study_files() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(STUDIES_DIR) if f.endswith(".yaml")) if os.path.isdir(STUDIES_DIR) else []


def run_studies(results_dir: str, names: Sequence[str] | None = None) -> dict[str, int]:
    """Run (or resume) every study's sweep; returns each study's exit code."""
    codes = {}
    for name in names or study_files():
        cmd = [
            sys.executable,
            "-m",
            "fedlightning.sweep",
            os.path.join(STUDIES_DIR, f"{name}.yaml"),
            "--out",
            os.path.join(results_dir, "studies", name),
        ]
        codes[name] = subprocess.call(cmd, cwd=ROOT)
    return codes


def read_study(results_dir: str, name: str) -> list[dict[str, object]]:
    """The finished runs of a study: ``{"params": {short name: value}, metric: float, ...}`` per run."""
    path = os.path.join(results_dir, "studies", name, "results.csv")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("status") != "finished":
                continue
            fixed = {"rank", "run", "status", "exit_code", "seconds"}
            params = {k.rsplit(".", 1)[-1]: r[k] for k in r if "." in k and "/" not in k and k not in fixed}
            row: dict[str, object] = {"params": params, "seconds": _float(r.get("seconds"))}
            for m in (VAL, TEST, GLOBAL_LOSS, "train/loss"):
                row[m] = _float(r.get(m))
            rows.append(row)
    return rows


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _setting(row) -> str:
    return ", ".join(f"{k} = {v}" for k, v in row["params"].items())


def _selected(rows):
    ok = [r for r in rows if math.isfinite(r[VAL])]
    return max(ok, key=lambda r: r[VAL]) if ok else None


def _best(rows, metric):
    ok = [r for r in rows if math.isfinite(r[metric])]
    if not ok:
        return None
    return max(ok, key=lambda r: r[metric]) if metric != GLOBAL_LOSS else min(ok, key=lambda r: r[metric])


def _fmt(metric, v) -> str:
    return "—" if not math.isfinite(v) else (f"{100 * v:.2f}" if metric in (VAL, TEST) else f"{v:.4g}")


def _order_holds(values: dict[str, float], claimed: Sequence[str], metric: str) -> bool:
    better = (lambda a, b: a >= b) if metric != GLOBAL_LOSS else (lambda a, b: a <= b)
    return all(better(values[a], values[b]) for a, b in zip(claimed, claimed[1:]))


def studies_section(results_dir: str) -> tuple[list[str], float, dict[str, str]]:
    """The markdown lines of the studies, their total compute (s) and a one-line finding per paper."""
    out = [
        "## Sensitivity studies",
        "",
        "Each grid is one method's sweep on the validation split (`python -m fedlightning.sweep "
        "benchmarks/studies/<name>.yaml`, run by `python benchmarks/reproduce.py --studies`); the selected setting "
        "has the best `val/acc` and only its test accuracy is reported. One seed per grid point: read differences "
        "against the seed spread of the tables above. Accuracies in %; global train loss = the final global model "
        "on the clients' training data.",
        "",
    ]
    seconds, findings = 0.0, {}
    for q in QUESTIONS:
        out += [f"### Seed {q.paper}: {q.claim}", ""]
        data = {label: read_study(results_dir, name) for label, name in q.methods}
        seconds += sum(r["seconds"] for rows in data.values() for r in rows if math.isfinite(r["seconds"]))
        if not all(data.values()):
            missing = [name for label, name in q.methods if not data[label]]
            out += [f"Not run yet: {', '.join(missing)}.", ""]
            findings[q.paper] = "sensitivity study not run yet"
            continue
        for label, name in q.methods:
            rows = sorted(data[label], key=lambda r: -r[VAL] if math.isfinite(r[VAL]) else math.inf)
            keys = list(rows[0]["params"])
            out += [
                f"**{label}** (`benchmarks/studies/{name}.yaml`)",
                "",
                "| " + " | ".join(keys) + " | val acc | test acc | global train loss |",
                "|" + "---|" * (len(keys) + 3),
            ]
            sel = _selected(rows)
            for r in rows:
                mark = " **(selected)**" if r is sel else ""
                out.append(
                    "| "
                    + " | ".join(str(r["params"][k]) for k in keys)
                    + f" | {_fmt(VAL, r[VAL])}{mark} | {_fmt(TEST, r[TEST])}"
                    + f" | {_fmt(GLOBAL_LOSS, r[GLOBAL_LOSS])} |"
                )
            out.append("")
        selected = {label: _selected(rows) for label, rows in data.items()}
        best = {label: _best(rows, q.metric) for label, rows in data.items()}
        name = "validation accuracy" if q.metric == VAL else "global train loss"
        sel_vals = {label: r[q.metric] for label, r in selected.items()}
        best_vals = {label: r[q.metric] for label, r in best.items()}
        rel = " ≥ " if q.metric != GLOBAL_LOSS else " ≤ "
        claimed = rel.join(q.claimed)
        observed_sel = ", ".join(
            f"{label} {_fmt(q.metric, v)} ({_setting(selected[label])})" for label, v in sel_vals.items()
        )
        observed_best = ", ".join(
            f"{label} {_fmt(q.metric, v)} ({_setting(best[label])})" for label, v in best_vals.items()
        )
        holds_sel = _order_holds(sel_vals, q.claimed, q.metric)
        holds_any = _order_holds(best_vals, q.claimed, q.metric)
        tests = ", ".join(f"{label} {_fmt(TEST, r[TEST])}" for label, r in selected.items())
        verdict = (
            ("holds" if holds_sel else "does not hold")
            + " with the settings selected on validation, and "
            + ("appears" if holds_any else "does not appear")
            + " with each method at its best grid setting"
        )
        out += [
            f"**Finding.** The paper's ordering {claimed} ({name}) {verdict}. Selected on validation: "
            f"{observed_sel}; their test accuracy: {tests}. Best {name} over each grid: {observed_best}.",
            "",
        ]
        findings[q.paper] = f"the ordering {claimed} ({name}) {verdict}"
    return out, seconds, findings
