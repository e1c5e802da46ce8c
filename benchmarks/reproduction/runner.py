"""Runs of the experiments: one :class:`RunSpec` per experiment × setup × algorithm × seed, each run in-process,
each finished run cached as JSON.

:func:`build_spec` turns the data of ``experiments.py`` into the CLI arguments of ``fedlightning.cli.main``: the
algorithm's YAML config, then the setup's model and data module and the protocol as overrides. :func:`run_one` is
``main(args, run=False)`` followed by ``trainer.fit`` with a recorder callback: every round's metrics, and the
global model on the training and test data every ``eval_every`` rounds
(:class:`~fedlightning.callbacks.telemetry.GlobalEvaluation`); Lightning's validation loop is off.
:func:`execute` runs what the cache (``<results>/<experiment>/<setup>/<algorithm>/seed<k>.json``) lacks; a cached
run is reused when its key (a hash of the repository-relative arguments, the config file and the round and
evaluation counts) matches, in any checkout.

Decisions (ours): seed ``k`` sets ``seed_everything`` (model initialisation), the loop's seed (client sampling,
data order) and the data module's seed (partition / synthetic data), so seeds vary all three. A run whose config
file or one of whose classes is missing is not run and reported as "not run (missing X)"; a failing run is
reported and the others go on.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import logging
import os
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from . import BENCH, ROOT
from .experiments import EXPERIMENTS, Algorithm, Experiment, Setup, check_experiments

SCHEMA_VERSION = 1
DEFAULT_RESULTS = os.path.join(BENCH, "results")
RECORDED = (
    "train/loss",
    "train/first_loss",
    "server/lr",
    "server/eta_g",
    "client/backtracks_per_step",
    "client/step_size_mean",
    "round/local_steps",
    "round/clients",
    "round/failed_clients",
    "runtime/wall_clock_seconds",
    "runtime/sgd_steps",
    "runtime/client_sgd_steps",
    "schedule/client_lr_scale",
)


class MissingPart(Exception):
    """A file or class a run needs is absent; the message names it."""


@dataclass
class RunSpec:
    experiment: Experiment
    setup: Setup
    algorithm: Algorithm
    seed: int
    rounds: int
    eval_every: int
    args: list[str]
    missing: str | None  # what is missing (the run is not run), None when runnable
    run_id: str
    key: str  # the cache key
    max_rounds: int | None = None  # budget runs: the cap on rounds


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


def _class_paths(node) -> list[str]:
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


def _class_name(entry: dict[str, Any]) -> str:
    return str(entry.get("class_path", "")).rpartition(".")[2]


def config_callback(config: str, name: str) -> dict[str, Any]:
    """A copy of the entry of class ``name`` in the ``trainer.callbacks`` of ``config`` (relative to the root)."""
    path = os.path.join(ROOT, config)
    if os.path.isfile(path):
        entries = ((yaml.safe_load(_read(path)) or {}).get("trainer") or {}).get("callbacks") or []
        for cb in entries:
            if _class_name(cb) == name:
                return copy.deepcopy(cb)
    raise MissingPart(f"{config} (its {name} entry)")


def run_callbacks(exp: Experiment, algo: Algorithm, config: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    """The run's ``trainer.callbacks``: the config's, rewritten by ``exp.callbacks``, with ``algo.callback_args``
    merged into the named callbacks and ``algo.extra_callbacks`` appended."""
    callbacks = copy.deepcopy((config.get("trainer") or {}).get("callbacks") or [])
    if exp.callbacks is not None:
        callbacks = exp.callbacks(callbacks, algo, rounds)
    for name, values in algo.callback_args.items():
        targets = [cb for cb in callbacks if _class_name(cb) == name]
        if not targets:
            raise ValueError(
                f"algorithm {algo.key!r}: callback_args names {name!r}, which {algo.config} does not "
                f"configure (callbacks: {[_class_name(cb) for cb in callbacks]})"
            )
        for cb in targets:
            cb.setdefault("init_args", {}).update(values)
    for source, name in algo.extra_callbacks:
        callbacks = callbacks + [config_callback(source, name)]
    return callbacks


def build_spec(exp: Experiment, setup: Setup, algo: Algorithm, seed: int, scale: float) -> RunSpec:
    """The run of ``algo`` on ``setup`` with ``seed`` for ``round(setup.rounds * scale)`` rounds (at least 1)."""
    rounds = max(1, int(round(setup.rounds * scale)))
    eval_every = max(1, min(setup.eval_every, rounds))
    protocol = dict(exp.protocol, **setup.protocol)
    run_id = f"{exp.key}/{setup.key}/{algo.key}/seed{seed}"
    config_path = os.path.join(ROOT, algo.config)
    missing = None
    config: dict[str, Any] = {}
    if not os.path.isfile(config_path):
        missing = algo.config
    else:
        config = yaml.safe_load(_read(config_path)) or {}
        for cp in _class_paths(config) + _class_paths(setup.model) + _class_paths(setup.data(seed, 1)):
            if not _importable(cp):
                missing = cp
                break
    args = [
        "--config",
        config_path,
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
    if algo.local_steps:
        args.append(f"--model.local_steps={protocol['local_steps']}")
    optimizer = ((config.get("model") or {}).get("client_optimizer") or {}).get("class_path")
    if setup.sgd_lr is not None and optimizer == "torch.optim.SGD":
        args.append(f"--model.client_optimizer.init_args.lr={setup.sgd_lr}")
    max_rounds = None
    if not missing:
        if exp.callbacks is not None or algo.callback_args or algo.extra_callbacks:
            try:
                args.append(f"--trainer.callbacks={json.dumps(run_callbacks(exp, algo, config, rounds))}")
            except MissingPart as err:
                missing = str(err)
        if algo.kind == "budget":
            max_rounds = exp.budget_cap * rounds
            args[args.index(f"--trainer.max_steps={rounds}")] = f"--trainer.max_steps={max_rounds}"
    args += [f"--{a}" for a in algo.args]
    key_src = json.dumps(
        {
            "v": SCHEMA_VERSION,
            "args": portable_args(args),
            "config": _read(config_path) if not missing else None,
            "eval_every": eval_every,
            "eval_samples": setup.eval_samples,
            "rounds": rounds,
        },
        sort_keys=True,
    )
    key = hashlib.sha1(key_src.encode()).hexdigest()[:16]
    return RunSpec(exp, setup, algo, seed, rounds, eval_every, args, missing, run_id, key, max_rounds)


def all_specs(
    seeds: int,
    scale: float,
    setup_scales: dict[str, float] | None = None,
    experiments: Sequence[Experiment] | None = None,
) -> list[RunSpec]:
    """Every run of ``experiments`` (default: all); ``setup_scales`` maps fnmatch patterns over
    ``<experiment>/<setup>`` to a round scale that replaces ``scale`` for the matching setups (the first matching
    pattern wins)."""
    experiments = EXPERIMENTS if experiments is None else experiments
    check_experiments(experiments)
    specs = []
    for exp in experiments:
        for setup in exp.setups:
            own = scale
            for pattern, value in (setup_scales or {}).items():
                if fnmatch.fnmatch(f"{exp.key}/{setup.key}", pattern):
                    own = value
                    break
            for algo in exp.algorithms:
                for seed in range(seeds):
                    specs.append(build_spec(exp, setup, algo, seed, own))
    return specs


def selected(run_id: str, patterns: Sequence[str] | None) -> bool:
    """``run_id`` matches one of ``patterns`` (fnmatch; a prefix selects everything below it); no patterns: all."""
    if not patterns:
        return True
    return any(fnmatch.fnmatch(run_id, p) or fnmatch.fnmatch(run_id, p.rstrip("/") + "/*") for p in patterns)


# ====================================================================== one run
def _recorder(spec: RunSpec, budget: float | None):
    from lightning.pytorch.callbacks import Callback

    from fedlightning.callbacks.telemetry import GlobalEvaluation

    simulated = budget is not None or spec.experiment.runtime

    class Recorder(Callback):
        """Every round's metrics, and the global model on train/test data every ``eval_every`` rounds; stops a
        budget run at the budget's simulated seconds."""

        def __init__(self):
            self.rounds: list[dict[str, float]] = []
            self.evals: list[dict[str, float]] = []
            self.started = time.time()
            n = spec.setup.eval_samples
            self.train_eval = GlobalEvaluation("train", spec.eval_every, max_samples=n, seed=spec.seed)
            self.test_eval = GlobalEvaluation("test", spec.eval_every, max_samples=n, seed=spec.seed)

        def evaluate(self, loop, round_number: int, wall: float | None) -> None:
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
                self.evaluate(loop, int(trainer.global_step), 0.0 if simulated else None)

        def on_round_end(self, trainer, loop, result) -> None:
            m = result.metrics
            row = {"round": result.plan.round + 1, "host_seconds": time.time() - self.started}
            row.update({k: float(m[k]) for k in RECORDED if k in m})
            self.rounds.append(row)
            if budget is not None and m.get("runtime/wall_clock_seconds", 0.0) >= budget * (1 - 1e-12):
                trainer.should_stop = True
            if self.train_eval.due(result.plan.round) or trainer.should_stop:
                self.evaluate(loop, result.plan.round + 1, m.get("runtime/wall_clock_seconds"))

    return Recorder()


def run_one(spec: RunSpec, budget: float | None = None) -> dict[str, Any]:
    """One run in this process; ``budget``: stop at this many simulated seconds. Returns the cache entry."""
    from fedlightning.cli import main

    started = time.time()
    cli = main(list(spec.args), run=False)
    rec = _recorder(spec, budget)
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
        "paper": spec.experiment.paper,
        "setup": spec.setup.key,
        "algorithm": spec.algorithm.key,
        "seed": spec.seed,
        "rounds_requested": spec.rounds,
        "rounds_done": done,
        "budget_seconds": budget,
        "args": portable_args(spec.args),
        "history": rec.rounds,
        "evals": rec.evals,
        "seconds": time.time() - started,
        "status": "ok",
    }


# ====================================================================== the cache
def portable_args(args: Sequence[str]) -> list[str]:
    """``args`` with the repository's own absolute path removed (config files become ``configs/...``), so the cache
    keys and the stored arguments are the same in every checkout and name no path of one machine."""
    prefix = ROOT.rstrip(os.sep) + os.sep
    return [a.replace(prefix, "") for a in args]


def result_path(results_dir: str, spec: RunSpec) -> str:
    return os.path.join(results_dir, spec.experiment.key, spec.setup.key, spec.algorithm.key, f"seed{spec.seed}.json")


def load_cached(results_dir: str, spec: RunSpec) -> dict[str, Any] | None:
    """The cached result of ``spec`` if it finished with the same key, else None."""
    path = result_path(results_dir, spec)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):  # valid JSON, not a result: not cached, as a truncated file
        return None
    return data if data.get("key") == spec.key and data.get("status") == "ok" else None


def save_result(results_dir: str, spec: RunSpec, data: dict[str, Any]) -> None:
    path = result_path(results_dir, spec)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _budget_for(results_dir: str, spec: RunSpec, specs: list[RunSpec]) -> float | None:
    """The simulated seconds the reference run of the same experiment, setup and seed used."""
    for s in specs:
        if (
            s.experiment.key == spec.experiment.key
            and s.setup.key == spec.setup.key
            and s.seed == spec.seed
            and s.algorithm.kind == "reference"
        ):
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


def execute(specs: list[RunSpec], results_dir: str, log=print) -> dict[str, int]:
    """Run every spec that is not cached (references before the budget runs that need their runtime)."""
    from tqdm import tqdm

    specs = sorted(
        specs, key=lambda s: (s.experiment.key, s.setup.key, 0 if s.algorithm.kind != "budget" else 1, s.seed)
    )
    pending = [s for s in specs if not s.missing and load_cached(results_dir, s) is None]
    counts = {
        "cached": sum(1 for s in specs if not s.missing) - len(pending),
        "ran": 0,
        "failed": 0,
        "missing": sum(1 for s in specs if s.missing),
    }
    bar = tqdm(pending, unit="run", dynamic_ncols=True)
    for spec in bar:
        bar.set_description(spec.run_id)
        budget = None
        if spec.algorithm.kind == "budget":
            budget = _budget_for(results_dir, spec, specs)
            if budget is None:
                ref = spec.experiment.labels.get(spec.experiment.reference, "reference")
                log(f"\n{spec.run_id}: not run (needs the {ref} run of the same seed for its runtime budget)")
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
