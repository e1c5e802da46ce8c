"""Run a W&B sweep file locally: ``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--dry-run]``.

The same file works unchanged with ``wandb sweep SWEEP.yaml`` / ``wandb agent <id>`` when W&B is configured; this
module needs neither an account nor the network. What it does, and the decisions behind it:

**Drawing parameters: Optuna.** ``method: grid`` uses ``GridSampler``, ``random`` uses ``RandomSampler`` and
``bayes`` uses ``TPESampler`` (Optuna's defaults, e.g. its 10 random start-up trials; W&B's bayes is a Gaussian
process, so the two draw differently). The W&B parameter specs map to Optuna distributions (:func:`search_space`):
``value`` → a constant (never handed to Optuna), ``values`` / ``distribution: categorical`` → a categorical choice,
``int_uniform`` → ``IntDistribution``, ``uniform`` → ``FloatDistribution``, ``q_uniform`` → a stepped
``FloatDistribution`` (``IntDistribution`` when ``min``, ``max`` and ``q`` are integers), ``log_uniform_values`` →
a log ``FloatDistribution`` over ``[min, max]``, ``log_uniform`` → the same over ``[e^min, e^max]`` (W&B's ``min``
and ``max`` are exponents there), ``q_log_uniform_values`` with ``q: 1`` and integer bounds → a log
``IntDistribution``. Without ``distribution`` the type is inferred as W&B does: integer ``min``/``max`` →
``int_uniform``, else ``uniform``. Everything else is refused with an error naming the parameter: the unbounded
normal families, ``beta``, ``inv_log_uniform*``, ``probabilities`` (Optuna has no weighted categorical), ``q`` on a
log scale other than ``q: 1`` on integers (Optuna cannot combine a log scale with a step), nested ``parameters``.
A stepped distribution's grid starts at ``min`` (Optuna); W&B rounds to multiples of ``q`` — the same values when
``min`` is a multiple of ``q``.

**Seeds.** W&B sweep files carry no seed; ``--seed`` (default 0, ours) makes the draws reproducible. Each new run
gets a fresh sampler seeded from ``(seed, run number)``, so the draws are a function of the seed, the run number
and the earlier results only: a sweep resumed in steps draws exactly what one uninterrupted invocation draws. A
grid's order is Optuna's seeded shuffle.

**Resume.** The study lives in Optuna's journal file ``OUT/optuna.journal``. Re-running the same command loads it,
skips finished runs (successful or failed) and continues up to the target: ``--runs N`` is the sweep's *total*
number of runs (as W&B's ``run_cap``), default the grid size for grid sweeps (capped by ``run_cap``) and
``run_cap`` for random/bayes, which need one of the two. A run that was interrupted (Ctrl-C, killed) is retried
with the same parameters and does not count (Ctrl-C and SIGTERM kill the running subprocess first). The journal remembers the sweep's method, metric, parameters and
command and the seed; resuming with a different file or seed is refused (use another ``--out``). One sweep process
per output directory at a time (a lock file, ``OUT/.sweep.lock``).

**Running a run.** Every run is a subprocess of the sweep's own command line, built by
:func:`fedlightning.logging.agent_command` exactly as the W&B agent builds it (``${interpreter}`` is this Python,
``sys.executable``), started from the current directory (run from the directory the sweep's paths are relative
to, the repository root, as for ``wandb agent``). Locally the runner appends

* ``--trainer.logger=lightning.pytorch.loggers.CSVLogger`` with ``save_dir=OUT/runs``, ``name=<slug>`` and
  ``version=''``: the run logs to ``OUT/runs/<slug>/metrics.csv`` (with its ``config.yaml``; checkpoints, if the
  command enables them, go to ``OUT/runs/<slug>/checkpoints``). Ours: a CSV file is read back with the standard
  library, and a run does not start a W&B service process (seconds per run); W&B's own logging of the same
  parameters is one command away (the best run's command keeps the sweep's logger). ``WANDB_MODE=offline`` is
  set in the run's environment too, in case the program itself calls W&B.

So the program must be a LightningCLI (``train.py``) and the sweep may not sweep ``trainer.logger*`` (refused).
The run's output (stdout and stderr) goes to ``OUT/logs/<slug>.log``.

**Run names.** ``<number>-<key>=<value>_...``: the three-digit run number (unique even when two runs draw the same
values) then each swept parameter by the shortest dotted suffix of its name that is unique in the sweep
(``lr=0.1``), floats drawn from a range with 4 significant digits, lists joined by ``x`` (``hidden=64x64``);
characters outside ``[A-Za-z0-9._=+-]`` become ``-``; at most 150 characters. The slug is the CSV logger's run
name and the log file's name.

**Results.** A run's final metrics are the last value of every column of its ``metrics.csv`` (W&B's summary
holds the last logged value by default, the same rule). The table — ``OUT/results.csv`` (every metric, full
parameter names) and ``OUT/results.md`` (the parameters by their short names, the sweep's metric and the metrics
sharing its prefix, e.g. ``val/*``; ours) — has one row per run, sorted by the sweep's ``metric`` (``goal``
maximize: largest first), runs without a finite value (failed, diverged, metric never logged) last in run order.
A failing run is recorded as ``failed`` with its exit code and does not stop the sweep; a run that exits 0 without
logging the metric is ``no metric``. The best run is printed as a ready ``python train.py fit ...`` command (the
sweep's command with the best parameters, without the local logger).
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from fedlightning._validation import integer
from fedlightning.logging import agent_command, load_sweep, validate_sweep

__all__ = [
    "Param",
    "search_space",
    "make_sampler",
    "run_slug",
    "RunResult",
    "LocalSweep",
    "main",
    "DEFAULT_SEED",
]

DEFAULT_SEED = 0  # ours: W&B sweep files have no seed
JOURNAL = "optuna.journal"
LOCK = ".sweep.lock"
RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
LOCAL_LOGGER = "lightning.pytorch.loggers.CSVLogger"

_SPEC_KEYS = {"value", "values", "distribution", "min", "max", "q", "mu", "sigma", "a", "b", "probabilities",
              "parameters"}
_RANGE_DISTRIBUTIONS = {"uniform", "int_uniform", "q_uniform", "log_uniform", "log_uniform_values",
                        "q_log_uniform_values"}
_UNSUPPORTED = {
    "normal": "unbounded; Optuna samples bounded ranges only",
    "q_normal": "unbounded; Optuna samples bounded ranges only",
    "log_normal": "unbounded; Optuna samples bounded ranges only",
    "q_log_normal": "unbounded; Optuna samples bounded ranges only",
    "beta": "Optuna has no beta distribution",
    "q_beta": "Optuna has no beta distribution",
    "inv_log_uniform": "Optuna has no inverse-log distribution",
    "inv_log_uniform_values": "Optuna has no inverse-log distribution",
    "q_log_uniform": "Optuna cannot combine a log scale with a step q",
    "categorical_w_probabilities": "Optuna has no weighted categorical",
}
_PRIMITIVE = (str, int, float, bool, type(None))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ====================================================================== parameter specs → Optuna
@dataclass
class Param:
    """One swept parameter: its W&B name, kind and Optuna distribution.

    ``kind`` is ``constant`` (``value``; ``distribution`` is None), ``categorical``, ``int`` or ``float``.
    Categorical choices that are not numbers, strings, booleans or null (lists, mappings) are handed to Optuna as
    their index (Optuna stores only primitive choices) and mapped back by :meth:`decode`.
    """

    name: str
    kind: str
    distribution: Any = None
    value: Any = None  # constant
    choices: Optional[List[Any]] = None  # categorical, the values as written in the file
    by_index: bool = False

    def suggest(self, trial) -> Any:
        """Draw this parameter in an Optuna trial; returns the value the run gets."""
        from optuna.distributions import FloatDistribution, IntDistribution

        d = self.distribution
        if self.kind == "constant":
            return self.value
        if isinstance(d, FloatDistribution):
            return trial.suggest_float(self.name, d.low, d.high, step=d.step, log=d.log)
        if isinstance(d, IntDistribution):
            return trial.suggest_int(self.name, d.low, d.high, step=d.step, log=d.log)
        return self.decode(trial.suggest_categorical(self.name, d.choices))

    def decode(self, optuna_value: Any) -> Any:
        return self.choices[optuna_value] if self.by_index else optuna_value

    def grid(self) -> List[Any]:
        """The Optuna values of a grid over this parameter (categorical only)."""
        return list(range(len(self.choices))) if self.by_index else list(self.choices)


def _spec_error(name: str, key: str, message: str) -> ValueError:
    return ValueError(f"{name}: parameter {key!r}: {message}")


def _param(key: str, spec: Mapping[str, Any], name: str) -> Param:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise _spec_error(name, key, f"unknown key(s) {sorted(unknown)}; a W&B parameter takes "
                                     f"{sorted(_SPEC_KEYS)}")
    if "parameters" in spec:
        raise _spec_error(name, key, "nested 'parameters' are not supported by the local runner; "
                                     "write each nested key as its own dotted parameter")
    dist = spec.get("distribution")
    if dist is not None and not isinstance(dist, str):
        raise _spec_error(name, key, f"distribution must be a name, got {dist!r}")
    if dist in _UNSUPPORTED:
        raise _spec_error(name, key, f"distribution {dist!r} is not supported by the local runner "
                                     f"({_UNSUPPORTED[dist]}); use values, uniform, int_uniform, q_uniform, "
                                     "log_uniform_values or log_uniform")
    if "probabilities" in spec:
        raise _spec_error(name, key, "'probabilities' is not supported by the local runner "
                                     "(Optuna has no weighted categorical); drop it for equal weights")
    if dist is None:
        if "values" in spec:
            dist = "categorical"
        elif "value" in spec:
            dist = "constant"
        elif "min" in spec and "max" in spec:
            if "q" in spec:
                raise _spec_error(name, key, "'q' needs an explicit q_* distribution (e.g. distribution: q_uniform)")
            dist = "int_uniform" if _is_int(spec["min"]) and _is_int(spec["max"]) else "uniform"
        else:
            raise _spec_error(name, key, "needs 'value', 'values' or 'min' and 'max'")
    if dist == "constant":
        if "value" not in spec:
            raise _spec_error(name, key, "distribution constant needs 'value'")
        _only(spec, {"value", "distribution"}, key, name, dist)
        return Param(key, "constant", value=spec["value"])
    if dist == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise _spec_error(name, key, f"values must be a non-empty list, got {values!r}")
        _only(spec, {"values", "distribution"}, key, name, dist)
        by_index = not all(isinstance(v, _PRIMITIVE) for v in values)
        choices = list(range(len(values))) if by_index else list(values)
        return Param(key, "categorical", CategoricalDistribution(choices), choices=list(values), by_index=by_index)
    if dist not in _RANGE_DISTRIBUTIONS:
        raise _spec_error(name, key, f"unknown distribution {dist!r}")
    lo, hi = spec.get("min"), spec.get("max")
    if not (_is_number(lo) and _is_number(hi)):
        raise _spec_error(name, key, f"distribution {dist} needs numeric 'min' and 'max', got min={lo!r} max={hi!r}")
    if not lo < hi:
        raise _spec_error(name, key, f"min must be < max, got min={lo!r} max={hi!r}")
    if dist.startswith("q_"):
        q = spec.get("q", 1)
        if not (_is_number(q) and q > 0):
            raise _spec_error(name, key, f"q must be a number > 0, got {q!r}")
        _only(spec, {"min", "max", "q", "distribution"}, key, name, dist)
    else:
        _only(spec, {"min", "max", "distribution"}, key, name, dist)
    if dist == "int_uniform":
        if not (_is_int(lo) and _is_int(hi)):
            raise _spec_error(name, key, f"int_uniform needs integer min and max, got min={lo!r} max={hi!r}")
        return Param(key, "int", IntDistribution(lo, hi))
    if dist == "uniform":
        return Param(key, "float", FloatDistribution(float(lo), float(hi)))
    if dist == "q_uniform":
        if _is_int(lo) and _is_int(hi) and _is_int(q):
            return Param(key, "int", IntDistribution(lo, hi, step=q))
        return Param(key, "float", FloatDistribution(float(lo), float(hi), step=float(q)))
    if dist == "log_uniform_values":
        if lo <= 0:
            raise _spec_error(name, key, f"log_uniform_values needs min > 0, got {lo!r}")
        return Param(key, "float", FloatDistribution(float(lo), float(hi), log=True))
    if dist == "log_uniform":
        return Param(key, "float", FloatDistribution(math.exp(lo), math.exp(hi), log=True))
    # q_log_uniform_values
    if not (q == 1 and _is_int(lo) and _is_int(hi) and lo > 0):
        raise _spec_error(name, key, "q_log_uniform_values is supported only with q: 1 and integer min > 0 "
                                     "(Optuna cannot combine a log scale with another step)")
    return Param(key, "int", IntDistribution(lo, hi, log=True))


def _only(spec: Mapping[str, Any], allowed: set, key: str, name: str, dist: str) -> None:
    extra = set(spec) - allowed
    if extra:
        raise _spec_error(name, key, f"key(s) {sorted(extra)} do not apply to distribution {dist}")


def search_space(sweep: Mapping[str, Any], name: str = "sweep") -> Dict[str, Param]:
    """The sweep's parameters as :class:`Param` objects, in file order; ``ValueError`` naming the parameter for a
    spec the local runner cannot run (see the module docstring). Also refuses swept ``trainer.logger*`` keys:
    the local runner replaces the logger."""
    validate_sweep(sweep, name=name)
    space = {}
    for key, spec in sweep["parameters"].items():
        if key == "trainer.logger" or key.startswith("trainer.logger."):
            raise _spec_error(name, key, "the local runner sets the logger itself (CSVLogger into the output "
                                         "directory); sweep logger settings in the command instead")
        space[key] = _param(key, spec, name)
    return space


def make_sampler(method: str, space: Mapping[str, Param], seed: int, number: int = 0):
    """The Optuna sampler of a W&B method for the run numbered ``number``.

    grid → ``GridSampler`` over the categorical parameters (its shuffle seeded by ``seed`` alone, so the order is
    the same in every invocation); random → ``RandomSampler``; bayes → ``TPESampler``, both seeded from
    ``(seed, number)`` (numpy ``SeedSequence``) so a run's draw does not depend on how many runs earlier
    invocations of the sweep made.
    """
    import numpy as np
    import optuna

    if method == "grid":
        grid = {k: p.grid() for k, p in space.items() if p.kind != "constant"}
        return optuna.samplers.GridSampler(grid, seed=seed)
    run_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    if method == "random":
        return optuna.samplers.RandomSampler(seed=run_seed)
    if method == "bayes":
        return optuna.samplers.TPESampler(seed=run_seed)
    raise ValueError(f"method must be one of grid, random, bayes, got {method!r}")


def _short_names(keys: Sequence[str]) -> Dict[str, str]:
    """Shortest dotted suffix of each key that no other key ends with."""
    parts = {k: k.split(".") for k in keys}
    out = {}
    for k, p in parts.items():
        for n in range(1, len(p) + 1):
            suffix = ".".join(p[-n:])
            if not any(o != k and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        out[k] = suffix
    return out


def _fmt(value: Any, drawn: bool) -> str:
    if isinstance(value, float) and drawn:
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "x".join(_fmt(v, False) for v in value)  # [64, 64] -> 64x64
    return str(value)


def run_slug(number: int, params: Mapping[str, Any], space: Mapping[str, Param]) -> str:
    """A run's name: ``<number:03d>-<short key>=<value>_...`` over the swept (non-constant) parameters."""
    swept = [k for k in params if k in space and space[k].kind != "constant"]
    short = _short_names(list(space))
    body = "_".join(f"{short[k]}={_fmt(params[k], space[k].kind == 'float')}" for k in swept)
    slug = re.sub(r"[^A-Za-z0-9._=+-]", "-", f"{number:03d}-{body}" if body else f"{number:03d}")
    return slug[:150]


# ====================================================================== results
@dataclass
class RunResult:
    """One run of the sweep as recorded: ``status`` is ``finished``, ``failed``, ``no metric`` or ``running``."""

    number: int
    slug: str
    params: Dict[str, Any]
    status: str
    exit_code: Optional[int] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    seconds: Optional[float] = None

    def value(self, metric: str) -> Optional[float]:
        v = self.metrics.get(metric)
        return v if v is not None and math.isfinite(v) else None


def read_final_metrics(path: str) -> Dict[str, float]:
    """The last non-empty value of every column of a CSVLogger ``metrics.csv`` (``step``/``epoch`` excluded);
    an empty dict when the file does not exist."""
    if not os.path.isfile(path):
        return {}
    out: Dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text in (None, ""):
                    continue
                try:
                    out[key] = float(text)
                except ValueError:
                    continue
    return out


class RunFailed(Exception):
    """A run exited with a non-zero code or did not log the sweep's metric (the trial is recorded as failed)."""


class _DryRun(Exception):
    pass


# ====================================================================== the sweep
class LocalSweep:
    """A W&B sweep file run locally into ``out`` (see the module docstring).

    Args:
        sweep: the parsed sweep (:func:`fedlightning.logging.load_sweep`).
        out: output directory (created).
        seed: sampler seed; None → the seed stored in ``out`` when resuming, else :data:`DEFAULT_SEED`.
        interpreter: what ``${interpreter}`` becomes for the runs (default this Python).
        name: used in error messages and as the study name when the sweep has no ``name``.
    """

    def __init__(self, sweep: Mapping[str, Any], out: str, seed: Optional[int] = None,
                 interpreter: Optional[str] = None, name: str = "sweep"):
        self.sweep = dict(sweep)
        self.file_name = name
        self.space = search_space(self.sweep, name=name)
        self.method = self.sweep["method"]
        self.metric = self.sweep["metric"]["name"]
        self.goal = self.sweep["metric"]["goal"]
        self.out = os.path.abspath(out)
        self.interpreter = interpreter or sys.executable
        self.study_name = str(self.sweep.get("name") or os.path.splitext(name)[0])
        self._seed_arg = seed
        self.seed = DEFAULT_SEED if seed is None else seed
        run_cap = self.sweep.get("run_cap")
        self.run_cap = None if run_cap is None else integer("run_cap", run_cap, label=f"{name}: run_cap")
        self.grid_size = None
        if self.method == "grid":
            self.grid_size = math.prod(len(p.choices) for p in self.space.values() if p.kind == "categorical")

    # ------------------------------------------------------------------ storage
    @property
    def journal(self) -> str:
        return os.path.join(self.out, JOURNAL)

    def _fingerprint(self) -> Dict[str, Any]:
        return {k: self.sweep.get(k) for k in ("method", "metric", "parameters", "program", "command")}

    def _open_study(self, storage):
        """Create or load the study in ``storage``; refuse a different sweep or seed."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # the runner prints its own progress
        direction = "maximize" if self.goal == "maximize" else "minimize"
        study = optuna.create_study(study_name=self.study_name, storage=storage, direction=direction,
                                    load_if_exists=True)
        attrs = study.user_attrs
        fingerprint = json.loads(json.dumps(self._fingerprint()))
        if "sweep" not in attrs:
            study.set_user_attr("sweep", fingerprint)
            study.set_user_attr("seed", self.seed)
            return study
        if attrs["sweep"] != fingerprint:
            changed = sorted(k for k in fingerprint if fingerprint[k] != attrs["sweep"].get(k))
            raise ValueError(f"{self.out} holds a run of sweep {self.study_name!r} with different {changed}; "
                             "use another --out for a changed sweep file")
        if self._seed_arg is not None and self._seed_arg != attrs["seed"]:
            raise ValueError(f"{self.out} holds a sweep drawn with --seed {attrs['seed']}, "
                             f"got --seed {self._seed_arg}; resume with the same seed or use another --out")
        self.seed = attrs["seed"]
        return study

    def _storage(self):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(self.journal))

    def _retry_interrupted(self, study) -> None:
        """Re-queue runs an earlier invocation left unfinished (killed: still RUNNING; Ctrl-C: FAIL marked
        ``interrupted``) with the same parameters (and grid cell). The copy records the number it retries
        (system attr ``retry_of``), so each interrupted run is re-queued once."""
        import optuna
        from optuna.trial import TrialState, create_trial

        trials = study.get_trials(deepcopy=False)
        retried = {t.system_attrs.get("retry_of") for t in trials}
        sampler, study.sampler = study.sampler, optuna.samplers.RandomSampler()
        try:
            for t in trials:
                stale = t.state == TrialState.RUNNING
                if not (stale or t.user_attrs.get("status") == "interrupted") or t.number in retried:
                    continue
                if stale:
                    study._storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
                    study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                if t.distributions:
                    study.add_trial(create_trial(state=TrialState.WAITING, params=t.params,
                                                 distributions=t.distributions,
                                                 system_attrs={**t.system_attrs, "retry_of": t.number}))
        finally:
            study.sampler = sampler

    # ------------------------------------------------------------------ running
    def target(self, runs: Optional[int]) -> int:
        """Total number of runs the sweep should have (see the module docstring)."""
        if runs is not None:
            runs = integer("--runs", runs)
        if self.method == "grid":
            cap = min(self.grid_size, self.run_cap or self.grid_size)
            return cap if runs is None else min(runs, self.grid_size)
        if runs is None and self.run_cap is None:
            raise ValueError(f"{self.file_name}: a {self.method} sweep has no end; give --runs N (total runs) "
                             "or run_cap in the sweep file")
        return runs if runs is not None else self.run_cap

    def command(self, params: Mapping[str, Any], slug: Optional[str] = None,
                interpreter: Optional[str] = None) -> List[str]:
        """The run's command: the sweep's own command line (the W&B agent's), plus the local CSV logger when
        ``slug`` is given."""
        cmd = agent_command(self.sweep, params, interpreter=interpreter or self.interpreter)
        if slug is not None:
            cmd += [f"--trainer.logger={LOCAL_LOGGER}",
                    f"--trainer.logger.init_args.save_dir={os.path.join(self.out, 'runs')}",
                    f"--trainer.logger.init_args.name={slug}",
                    "--trainer.logger.init_args.version="]
        return cmd

    def best_command(self, params: Mapping[str, Any]) -> str:
        """``python <program> ...``: the sweep's command for ``params`` without the ``${env}`` prefix."""
        sentinel = "\0env"
        cmd = agent_command(self.sweep, params, interpreter="python", env=sentinel)
        return shlex.join(c for c in cmd if c != sentinel)

    def _suggest(self, trial) -> Dict[str, Any]:
        return {k: p.suggest(trial) for k, p in self.space.items()}

    def _execute(self, trial, log: Callable[[str], None], total: int) -> float:
        params = self._suggest(trial)
        slug = run_slug(trial.number, params, self.space)
        trial.set_user_attr("slug", slug)
        cmd = self.command(params, slug)
        logs = os.path.join(self.out, "logs")
        os.makedirs(logs, exist_ok=True)
        run_dir = os.path.join(self.out, "runs", slug)
        if os.path.isdir(run_dir):  # an interrupted attempt's files; the new attempt starts clean
            import shutil

            shutil.rmtree(run_dir)
        env = dict(os.environ, WANDB_MODE="offline")
        log(f"[{self._done + 1}/{total}] {slug}")
        start = time.monotonic()
        with open(os.path.join(logs, slug + ".log"), "w") as out:
            out.write(shlex.join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                code = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                trial.set_user_attr("status", "interrupted")
                raise
        seconds = time.monotonic() - start
        trial.set_user_attr("exit_code", code)
        trial.set_user_attr("seconds", round(seconds, 3))
        metrics = read_final_metrics(os.path.join(run_dir, "metrics.csv"))
        value = metrics.get(self.metric)
        if code != 0:
            trial.set_user_attr("status", "failed")
            log(f"    failed with exit code {code} after {seconds:.1f} s (log: {os.path.join(logs, slug + '.log')})")
            raise RunFailed(f"exit code {code}")
        if value is None or not math.isfinite(value):
            trial.set_user_attr("status", "no metric")
            seen = ", ".join(sorted(metrics)) or "none"
            log(f"    finished but {self.metric} is {'missing' if value is None else value} "
                f"(logged: {seen}) after {seconds:.1f} s")
            raise RunFailed(f"{self.metric} is {value}")
        trial.set_user_attr("status", "finished")
        log(f"    {self.metric} = {value:.6g} ({seconds:.1f} s)")
        return value

    def run(self, runs: Optional[int] = None, dry_run: bool = False,
            log: Callable[[str], None] = print) -> List[RunResult]:
        """Run the sweep up to ``runs`` total runs (see :meth:`target`); write the tables; return the sorted results.

        ``dry_run``: print the commands of the runs that would start next and change nothing on disk (the draws
        run against an in-memory copy of the journal; for bayes only draws before any new result are exact).
        """
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        total = self.target(runs)
        if dry_run:
            return self._dry_run(total, log)
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, LOCK), "w") as lock, _sigterm_interrupts():
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ValueError(f"another sweep process is running in {self.out} (lock {LOCK} held); "
                                 "wait for it or use another --out") from None
            study = self._open_study(self._storage())
            self._retry_interrupted(study)
            self._done = self._count(study)
            if self._done >= total:
                log(f"{self.study_name}: {self._done} run(s) recorded, target {total}: nothing to run")
            while self._done < total:
                study.sampler = make_sampler(self.method, self.space, self.seed, len(study.get_trials(deepcopy=False)))
                study.optimize(lambda t: self._execute(t, log, total), n_trials=1, catch=(RunFailed,))
                self._done = self._count(study)
            results = self.results(study)
            self.write_tables(results)
        best = self.best(results)
        log(f"results: {os.path.join(self.out, RESULTS_MD)} and {RESULTS_CSV}")
        if best is not None:
            log(f"best run {best.slug}: {self.metric} = {best.value(self.metric):.6g}\n"
                f"{self.best_command(best.params)}")
        else:
            log(f"no run logged a finite {self.metric}")
        return results

    def _dry_run(self, total: int, log: Callable[[str], None]) -> List[RunResult]:
        import optuna

        memory = optuna.storages.InMemoryStorage()
        if os.path.isfile(self.journal):
            study = self._open_study(self._storage())  # checks fingerprint and seed
            optuna.copy_study(from_study_name=self.study_name, from_storage=self._storage(), to_storage=memory)
            study = optuna.load_study(study_name=self.study_name, storage=memory)
        else:
            study = self._open_study(memory)
        self._retry_interrupted(study)
        done = self._count(study)
        planned: List[RunResult] = []

        def show(trial):
            params = self._suggest(trial)
            slug = run_slug(trial.number, params, self.space)
            trial.set_user_attr("status", "planned")
            planned.append(RunResult(trial.number, slug, params, "planned"))
            log(shlex.join(self.command(params, slug)))
            raise _DryRun

        while done < total:
            study.sampler = make_sampler(self.method, self.space, self.seed, len(study.get_trials(deepcopy=False)))
            study.optimize(show, n_trials=1, catch=(_DryRun,))
            done += 1
        return planned

    @staticmethod
    def _count(study) -> int:
        from optuna.trial import TrialState

        return sum(1 for t in study.get_trials(deepcopy=False)
                   if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get("status") != "interrupted")

    # ------------------------------------------------------------------ results
    def results(self, study=None) -> List[RunResult]:
        """Every recorded run (interrupted attempts left out), sorted by the metric (see the module docstring)."""
        if study is None:
            if not os.path.isfile(self.journal):
                return []
            study = self._open_study(self._storage())
        rows = []
        for t in study.get_trials(deepcopy=False):
            status = t.user_attrs.get("status", "running")
            if status == "interrupted" or "slug" not in t.user_attrs:
                continue
            params = {k: (p.value if p.kind == "constant" else p.decode(t.params[k]))
                      for k, p in self.space.items() if p.kind == "constant" or k in t.params}
            slug = t.user_attrs["slug"]
            metrics = read_final_metrics(os.path.join(self.out, "runs", slug, "metrics.csv"))
            rows.append(RunResult(t.number, slug, params, status, t.user_attrs.get("exit_code"), metrics,
                                  t.user_attrs.get("seconds")))
        return self.sort(rows)

    def sort(self, rows: Sequence[RunResult]) -> List[RunResult]:
        sign = -1.0 if self.goal == "maximize" else 1.0
        good = [r for r in rows if r.status == "finished" and r.value(self.metric) is not None]
        rest = [r for r in rows if r not in good]
        return (sorted(good, key=lambda r: (sign * r.value(self.metric), r.number))
                + sorted(rest, key=lambda r: r.number))

    def best(self, results: Sequence[RunResult]) -> Optional[RunResult]:
        for r in results:
            if r.status == "finished" and r.value(self.metric) is not None:
                return r
        return None

    def write_tables(self, results: Sequence[RunResult]) -> None:
        """``results.csv`` (full parameter names, every final metric) and ``results.md`` (short names, the
        sweep's metric and the metrics sharing its prefix)."""
        keys = list(self.space)
        metric_names = sorted({m for r in results for m in r.metrics} - {self.metric})
        metric_cols = [self.metric] + metric_names
        with open(os.path.join(self.out, RESULTS_CSV), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rank", "run", "status", "exit_code", "seconds"] + keys + metric_cols)
            for i, r in enumerate(results, 1):
                w.writerow([i, r.slug, r.status, "" if r.exit_code is None else r.exit_code,
                            "" if r.seconds is None else r.seconds]
                           + [_cell(r.params.get(k)) for k in keys]
                           + ["" if m not in r.metrics else repr(r.metrics[m]) for m in metric_cols])
        prefix = self.metric.split("/", 1)[0] + "/" if "/" in self.metric else None
        md_metrics = [self.metric] + [m for m in metric_names if prefix and m.startswith(prefix)]
        short = _short_names(keys)
        swept = [k for k in keys if self.space[k].kind != "constant"]
        lines = [f"# Sweep {self.study_name}: {self.metric} ({self.goal})", ""]
        best = self.best(results)
        if best is not None:
            lines += ["Best run, to reproduce:", "", "```", self.best_command(best.params), "```", ""]
        header = ["rank", "run", "status", "exit code"] + [short[k] for k in swept] + md_metrics
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for i, r in enumerate(results, 1):
            cells = [str(i), r.slug, r.status, "" if r.exit_code is None else str(r.exit_code)]
            cells += [_cell(r.params.get(k)) for k in swept]
            cells += [f"{r.metrics[m]:.4g}" if m in r.metrics else "" for m in md_metrics]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        with open(os.path.join(self.out, RESULTS_MD), "w") as f:
            f.write("\n".join(lines) + "\n")


class _sigterm_interrupts:
    """While a sweep runs (main thread only), SIGTERM raises KeyboardInterrupt like Ctrl-C does, so a terminated
    sweep kills its running subprocess and marks the run interrupted instead of leaving it running orphaned."""

    def __enter__(self):
        import signal
        import threading

        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


# ====================================================================== command line
def main(argv: Optional[List[str]] = None) -> int:
    """``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--seed S] [--dry-run]``; exit code 0,
    or 2 with ``error: ...`` on stderr for a bad file or argument."""
    p = argparse.ArgumentParser(prog="python -m fedlightning.sweep",
                                description="Run a W&B sweep file locally (Optuna; resumable).")
    p.add_argument("sweep", help="a W&B sweep YAML file")
    p.add_argument("--out", help="output directory (default runs/sweeps/<sweep name>)")
    p.add_argument("--runs", type=int, help="total number of runs (default: the grid size or the file's run_cap)")
    p.add_argument("--seed", type=int, help=f"sampler seed (default {DEFAULT_SEED}, or the one stored in --out)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the next runs; run nothing")
    ns = p.parse_args(argv)
    try:
        sweep = load_sweep(ns.sweep)
        name = os.path.basename(ns.sweep)
        out = ns.out or os.path.join("runs", "sweeps", str(sweep.get("name") or os.path.splitext(name)[0]))
        LocalSweep(sweep, out, seed=ns.seed, name=name).run(runs=ns.runs, dry_run=ns.dry_run)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
