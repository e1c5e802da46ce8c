"""The local sweep runner: :class:`LocalSweep` (an Optuna study in ``OUT/optuna.journal``, one subprocess per run,
the results tables) and :func:`main`, the command line."""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedlightning._validation import integer
from fedlightning.logging import agent_command, load_sweep
from fedlightning.sweep.results import (
    DryRun,
    RunFailed,
    RunResult,
    cell_text,
    read_final_metrics,
    run_slug,
    short_names,
)
from fedlightning.sweep.space import grid_cells, make_sampler, search_space

__all__ = ["LocalSweep", "main", "DEFAULT_SEED", "JOURNAL", "LOCK", "RESULTS_CSV", "RESULTS_MD", "LOCAL_LOGGER"]

DEFAULT_SEED = 0  # ours: W&B sweep files have no seed
JOURNAL = "optuna.journal"
LOCK = ".sweep.lock"
RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
LOCAL_LOGGER = "lightning.pytorch.loggers.CSVLogger"


# ====================================================================== the sweep
class LocalSweep:
    """A W&B sweep file run locally into ``out``.

    **Resume.** The study lives in Optuna's journal file ``OUT/optuna.journal``. Re-running the same command loads
    it, skips finished runs (successful or failed) and continues up to the target (:meth:`target`). A run that was
    interrupted (Ctrl-C, killed) is retried with the same parameters and does not count (Ctrl-C and SIGTERM kill
    the running subprocess first). The journal remembers the sweep's method, metric, parameters and command and the
    seed; resuming with a different file or seed is refused (use another ``--out``). One sweep process per output
    directory at a time (a lock file, ``OUT/.sweep.lock``).

    **Running a run.** Every run is a subprocess of the sweep's own command line (:meth:`command`), started from the
    current directory (run from the directory the sweep's paths are relative to, the repository root, as for
    ``wandb agent``); its stdout and stderr go to ``OUT/logs/<slug>.log``.

    **Results.** One row per run (:meth:`results`), sorted by the sweep's ``metric`` (:meth:`sort`). A failing run
    is recorded as ``failed`` with its exit code and does not stop the sweep; a run that exits 0 without logging
    the metric is ``no metric``. The best run is printed as a ready ``python train.py fit ...`` command
    (:meth:`best_command`: the sweep's command with the best parameters, without the local logger).

    Args:
        sweep: the parsed sweep (:func:`fedlightning.logging.load_sweep`).
        out: output directory (created).
        seed: sampler seed; None → the seed stored in ``out`` when resuming, else :data:`DEFAULT_SEED`.
        interpreter: what ``${interpreter}`` becomes for the runs (default this Python).
        name: used in error messages and as the study name when the sweep has no ``name``.
    """

    def __init__(
        self,
        sweep: Mapping[str, Any],
        out: str,
        seed: int | None = None,
        interpreter: str | None = None,
        name: str = "sweep",
    ):
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
        self.seed = DEFAULT_SEED if seed is None else integer("--seed", seed, minimum=0)
        if self.seed >= 2**32:  # numpy's and Optuna's samplers take 32-bit seeds
            raise ValueError(f"--seed must be an integer in [0, 2**32), got {self.seed}")
        run_cap = self.sweep.get("run_cap")
        self.run_cap = None if run_cap is None else integer("run_cap", run_cap, label=f"{name}: run_cap")
        self.grid_size = None
        if self.method == "grid":
            self.grid_size = math.prod(len(p.choices) for p in self.space.values() if p.kind == "categorical")

    # ------------------------------------------------------------------ storage
    @property
    def journal(self) -> str:
        return os.path.join(self.out, JOURNAL)

    def _fingerprint(self) -> dict[str, Any]:
        return {k: self.sweep.get(k) for k in ("method", "metric", "parameters", "program", "command")}

    def _open_study(self, storage):
        """Create or load the study in ``storage``; refuse a different sweep or seed."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # the runner prints its own progress
        direction = "maximize" if self.goal == "maximize" else "minimize"
        study = optuna.create_study(
            study_name=self.study_name, storage=storage, direction=direction, load_if_exists=True
        )
        attrs = study.user_attrs
        fingerprint = json.loads(json.dumps(self._fingerprint()))
        if "sweep" not in attrs:
            study.set_user_attr("sweep", fingerprint)
            study.set_user_attr("seed", self.seed)
            return study
        if attrs["sweep"] != fingerprint:
            changed = sorted(k for k in fingerprint if fingerprint[k] != attrs["sweep"].get(k))
            raise ValueError(
                f"{self.out} holds a run of sweep {self.study_name!r} with different {changed}; "
                "use another --out for a changed sweep file"
            )
        if self._seed_arg is not None and self._seed_arg != attrs["seed"]:
            raise ValueError(
                f"{self.out} holds a sweep drawn with --seed {attrs['seed']}, "
                f"got --seed {self._seed_arg}; resume with the same seed or use another --out"
            )
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
                    study.add_trial(
                        create_trial(
                            state=TrialState.WAITING,
                            params=t.params,
                            distributions=t.distributions,
                            system_attrs={**t.system_attrs, "retry_of": t.number},
                            # the retry runs under the interrupted run's number: the same name, files replaced
                            user_attrs={"run_number": _run_number(t, trials)},
                        )
                    )
        finally:
            study.sampler = sampler

    # ------------------------------------------------------------------ running
    def target(self, runs: int | None) -> int:
        """Total number of runs the sweep should have: ``runs`` (``--runs N``) is the sweep's *total* (as W&B's
        ``run_cap``); default the grid size for grid sweeps (capped by ``run_cap``) and ``run_cap`` for
        random/bayes, which need one of the two."""
        if runs is not None:
            runs = integer("--runs", runs)
        if self.method == "grid":
            cap = min(self.grid_size, self.run_cap or self.grid_size)
            return cap if runs is None else min(runs, self.grid_size)
        if runs is None and self.run_cap is None:
            raise ValueError(
                f"{self.file_name}: a {self.method} sweep has no end; give --runs N (total runs) "
                "or run_cap in the sweep file"
            )
        return runs if runs is not None else self.run_cap

    def command(self, params: Mapping[str, Any], slug: str | None = None, interpreter: str | None = None) -> list[str]:
        """The run's command: the sweep's own command line, built by :func:`fedlightning.logging.agent_command`
        exactly as the W&B agent builds it (``${interpreter}`` is this Python, ``sys.executable``), plus, when
        ``slug`` is given, the local logger: ``--trainer.logger=lightning.pytorch.loggers.CSVLogger`` with
        ``save_dir=OUT/runs``, ``name=<slug>`` and ``version=''``, so the run logs to ``OUT/runs/<slug>/metrics.csv``
        (with its ``config.yaml``; checkpoints, if the command enables them, go to ``OUT/runs/<slug>/checkpoints``).

        Ours: a CSV file is read back with the standard library, and a run does not start a W&B service process;
        W&B's own logging of the same parameters is one command away (the best run's command keeps the sweep's
        logger). ``WANDB_MODE=offline`` is set in the run's environment too, in case the program itself calls W&B.
        So the program must be a LightningCLI (``train.py``) and the sweep may not sweep ``trainer.logger*``.
        """
        cmd = agent_command(self.sweep, params, interpreter=interpreter or self.interpreter)
        if slug is not None:
            cmd += [
                f"--trainer.logger={LOCAL_LOGGER}",
                f"--trainer.logger.init_args.save_dir={os.path.join(self.out, 'runs')}",
                f"--trainer.logger.init_args.name={slug}",
                "--trainer.logger.init_args.version=",
            ]
        return cmd

    def check_command(self) -> None:
        """Raise a ValueError with the program's own last line when the sweep's command line cannot be parsed, before
        any run starts: a swept or fixed argument that does not exist (``model.client_optimizer.init_args.lrr``), a
        value of the wrong type. Decision (ours): the check runs the sweep's command with ``--print_config``
        appended (the LightningCLI parses every argument, instantiates nothing and exits), for each parameter its
        first choice or the low end of its range (not necessarily a run's draw); only for a program that is a
        fedlightning CLI (its source imports ``fedlightning.cli``, as ``train.py`` does), whose errors end in one
        line ``error: <key>: ...``. Without it every run would start and fail alike, and the reason would be only in
        each run's log."""
        program = self.sweep.get("program")
        try:
            with open(str(program)) as f:
                if "fedlightning.cli" not in f.read():
                    return
        except (OSError, UnicodeDecodeError, TypeError):
            return
        params = {}
        for name, p in self.space.items():
            if p.kind == "constant":
                params[name] = p.value
            elif p.kind == "categorical":
                params[name] = p.choices[0]
            else:
                params[name] = p.distribution.low
        cmd = [*self.command(params), "--print_config"]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline"), timeout=600
        )
        if proc.returncode != 0:
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit code {proc.returncode}"
            raise ValueError(
                f"the sweep's command line fails before any run: {last.removeprefix('error: ')} (checked with the "
                f"first value of each parameter and --print_config: {shlex.join(cmd)})"
            )

    def best_command(self, params: Mapping[str, Any]) -> str:
        """``python <program> ...``: the sweep's command for ``params`` without the ``${env}`` prefix."""
        sentinel = "\0env"
        cmd = agent_command(self.sweep, params, interpreter="python", env=sentinel)
        return shlex.join(c for c in cmd if c != sentinel)

    def _suggest(self, trial) -> dict[str, Any]:
        return {k: p.suggest(trial) for k, p in self.space.items()}

    def _execute(self, trial, log: Callable[[str], None], total: int) -> float:
        params = self._suggest(trial)
        slug = run_slug(_run_number(trial), params, self.space)
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
            log(
                f"    finished but {self.metric} is {'missing' if value is None else value} "
                f"(logged: {seen}) after {seconds:.1f} s"
            )
            raise RunFailed(f"{self.metric} is {value}")
        trial.set_user_attr("status", "finished")
        log(f"    {self.metric} = {value:.6g} ({seconds:.1f} s)")
        return value

    def run(
        self, runs: int | None = None, dry_run: bool = False, log: Callable[[str], None] = print
    ) -> list[RunResult]:
        """Run the sweep up to ``runs`` total runs (see :meth:`target`); write the tables; return the sorted results.

        ``dry_run``: print the commands of the runs that would start next and change nothing on disk (the draws
        run against an in-memory copy of the journal; for bayes only draws before any new result are exact).
        """
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        total = self.target(runs)
        if runs is not None and total < runs:  # a grid has no more cells than it has
            log(f"{self.file_name}: --runs {runs} is more than the grid's {self.grid_size} cells; {total} run")
        if dry_run:
            return self._dry_run(total, log)
        self.check_command()  # before the output directory records the sweep: a fixed file runs in the same --out
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, LOCK), "w") as lock, _sigterm_interrupts():
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ValueError(
                    f"another sweep process is running in {self.out} (lock {LOCK} held); "
                    "wait for it or use another --out"
                ) from None
            study = self._open_study(self._storage())
            self._retry_interrupted(study)
            self._done = self._count(study)
            if self._done >= total:
                log(f"{self.study_name}: {self._done} run(s) recorded, target {total}: nothing to run")
            while self._done < total:
                self._prepare_next(study)
                study.optimize(lambda t: self._execute(t, log, total), n_trials=1, catch=(RunFailed,))
                self._done = self._count(study)
            results = self.results(study)
            self.write_tables(results)
        best = self.best(results)
        log(f"results: {os.path.join(self.out, RESULTS_MD)} and {RESULTS_CSV}")
        if best is not None:
            log(
                f"best run {best.slug}: {self.metric} = {best.value(self.metric):.6g}\n{self.best_command(best.params)}"
            )
        else:
            log(f"no run logged a finite {self.metric}")
        return results

    def _dry_run(self, total: int, log: Callable[[str], None]) -> list[RunResult]:
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
        planned: list[RunResult] = []

        def show(trial):
            params = self._suggest(trial)
            slug = run_slug(_run_number(trial), params, self.space)
            trial.set_user_attr("status", "planned")
            planned.append(RunResult(_run_number(trial), slug, params, "planned"))
            log(shlex.join(self.command(params, slug)))
            raise DryRun

        while done < total:
            self._prepare_next(study)
            study.optimize(show, n_trials=1, catch=(DryRun,))
            done += 1
        return planned

    def _prepare_next(self, study) -> None:
        """The sampler of the next run, seeded by its number (:func:`_next_run_number`); for a grid, the run's cell
        (:func:`~fedlightning.sweep.space.grid_cells`) queued unless a retry is waiting to run first."""
        from optuna.trial import TrialState

        number = _next_run_number(study)
        study.sampler = make_sampler(self.method, self.space, self.seed, number)
        if self.method != "grid" or any(t.state == TrialState.WAITING for t in study.get_trials(deepcopy=False)):
            return
        cells = grid_cells(self.space, self.seed)
        if number < len(cells):
            study.enqueue_trial(cells[number])

    @staticmethod
    def _count(study) -> int:
        from optuna.trial import TrialState

        return sum(
            1
            for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get("status") != "interrupted"
        )

    # ------------------------------------------------------------------ results
    def results(self, study=None) -> list[RunResult]:
        """Every recorded run (interrupted attempts left out), sorted by the metric (:meth:`sort`); a run's final
        metrics are :func:`~fedlightning.sweep.results.read_final_metrics` of its ``metrics.csv``."""
        if study is None:
            if not os.path.isfile(self.journal):
                return []
            study = self._open_study(self._storage())
        rows = []
        trials = study.get_trials(deepcopy=False)
        for t in trials:
            status = t.user_attrs.get("status", "running")
            if status == "interrupted" or "slug" not in t.user_attrs:
                continue
            params = {
                k: (p.value if p.kind == "constant" else p.decode(t.params[k]))
                for k, p in self.space.items()
                if p.kind == "constant" or k in t.params
            }
            slug = t.user_attrs["slug"]
            metrics = read_final_metrics(os.path.join(self.out, "runs", slug, "metrics.csv"))
            rows.append(
                RunResult(
                    _run_number(t, trials),
                    slug,
                    params,
                    status,
                    t.user_attrs.get("exit_code"),
                    metrics,
                    t.user_attrs.get("seconds"),
                )
            )
        return self.sort(rows)

    def sort(self, rows: Sequence[RunResult]) -> list[RunResult]:
        """By the sweep's metric (``goal`` maximize: largest first); runs without a finite value (failed,
        diverged, metric never logged) last, in run order."""
        sign = -1.0 if self.goal == "maximize" else 1.0
        good = [r for r in rows if r.status == "finished" and r.value(self.metric) is not None]
        rest = [r for r in rows if r not in good]
        return sorted(good, key=lambda r: (sign * r.value(self.metric), r.number)) + sorted(
            rest, key=lambda r: r.number
        )

    def best(self, results: Sequence[RunResult]) -> RunResult | None:
        for r in results:
            if r.status == "finished" and r.value(self.metric) is not None:
                return r
        return None

    def write_tables(self, results: Sequence[RunResult]) -> None:
        """``results.csv`` (full parameter names, every final metric) and ``results.md`` (ours: the parameters by
        their short names, the sweep's metric and the metrics sharing its prefix, e.g. ``val/*``)."""
        keys = list(self.space)
        metric_names = sorted({m for r in results for m in r.metrics} - {self.metric})
        metric_cols = [self.metric] + metric_names
        with open(os.path.join(self.out, RESULTS_CSV), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rank", "run", "status", "exit_code", "seconds"] + keys + metric_cols)
            for i, r in enumerate(results, 1):
                w.writerow(
                    [
                        i,
                        r.slug,
                        r.status,
                        "" if r.exit_code is None else r.exit_code,
                        "" if r.seconds is None else r.seconds,
                    ]
                    + [cell_text(r.params.get(k)) for k in keys]
                    + ["" if m not in r.metrics else repr(r.metrics[m]) for m in metric_cols]
                )
        prefix = self.metric.split("/", 1)[0] + "/" if "/" in self.metric else None
        md_metrics = [self.metric] + [m for m in metric_names if prefix and m.startswith(prefix)]
        short = short_names(keys)
        swept = [k for k in keys if self.space[k].kind != "constant"]
        lines = [f"# Sweep {self.study_name}: {self.metric} ({self.goal})", ""]
        best = self.best(results)
        if best is not None:
            lines += ["Best run, to reproduce:", "", "```", self.best_command(best.params), "```", ""]
        header = ["rank", "run", "status", "exit code"] + [short[k] for k in swept] + md_metrics
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for i, r in enumerate(results, 1):
            cells = [str(i), r.slug, r.status, "" if r.exit_code is None else str(r.exit_code)]
            cells += [cell_text(r.params.get(k)) for k in swept]
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


def _next_run_number(study) -> int:
    """The run number of the next new trial of ``study`` (:func:`_run_number`): its trials less the retries of
    interrupted runs, which run under the numbers of the runs they retry. The samplers of random and bayes sweeps
    are seeded with it (:func:`~fedlightning.sweep.space.make_sampler`), so a sweep interrupted and resumed draws
    what an uninterrupted one draws."""
    trials = study.get_trials(deepcopy=False)
    return len(trials) - sum(1 for t in trials if "retry_of" in t.system_attrs)


def _run_number(trial, trials=None) -> int:
    """The run's number in its name: for the retry of an interrupted run, that run's; for another trial, its trial
    number less the retries before it (runs are numbered 0, 1, 2, ... as in a sweep never interrupted). ``trials``:
    the study's trials (default: a live trial's study's); a live trial records the number (user attr
    ``run_number``)."""
    number = trial.user_attrs.get("run_number")
    if number is None:
        trials = trial.study.get_trials(deepcopy=False) if trials is None else trials
        number = trial.number - sum(1 for t in trials if t.number < trial.number and "retry_of" in t.system_attrs)
        from optuna.trial import Trial

        if isinstance(trial, Trial):  # a live trial (not a FrozenTrial read back)
            trial.set_user_attr("run_number", number)
    return int(number)


# ====================================================================== command line
def main(argv: list[str] | None = None) -> int:
    """``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--seed S] [--dry-run]``.

    Exit codes (ours): ``0`` when at least one of the sweep's recorded runs finished with a finite metric (the sweep
    has a best run), also when others failed — the last line is then a warning ``warning: K of N runs failed ...;
    logs: OUT/logs/`` (a failing run is an outcome of the search, e.g. a diverging learning rate, and the table
    records it); ``1`` when every recorded run failed (non-zero exit code, or no finite metric): the lines above name
    each run and its log file, the last line ``error: all N runs failed ...; logs: OUT/logs/``; ``2`` with
    ``error: ...`` for a bad sweep file or argument. The counts are over every run the output directory records,
    so a resumed sweep with nothing left to run reports the same. ``--dry-run`` exits 0.
    """
    p = argparse.ArgumentParser(
        prog="python -m fedlightning.sweep", description="Run a W&B sweep file locally (Optuna; resumable)."
    )
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
        runner = LocalSweep(sweep, out, seed=ns.seed, name=name)
        results = runner.run(runs=ns.runs, dry_run=ns.dry_run)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.dry_run:
        return 0
    return _report_failures(runner, results)


def _report_failures(runner: LocalSweep, results: Sequence[RunResult]) -> int:
    """Print the failed runs and a last line counting them (see :func:`main`); the exit code."""
    bad = [r for r in results if r.status != "finished"]
    if not bad:
        return 0
    logs = os.path.join(runner.out, "logs")
    failed = sum(1 for r in bad if r.status == "failed")
    causes = ", ".join(
        part
        for part in (
            f"{failed} exited non-zero" if failed else "",
            f"{len(bad) - failed} logged no finite {runner.metric}" if len(bad) > failed else "",
        )
        if part
    )
    every = len(bad) == len(results)
    if every:
        for r in bad:
            code = f" (exit code {r.exit_code})" if r.status == "failed" and r.exit_code is not None else ""
            print(f"  {r.slug}: {r.status}{code}, log {os.path.join(logs, r.slug + '.log')}", file=sys.stderr)
        print(f"error: all {len(results)} runs failed ({causes}); logs: {logs}{os.sep}", file=sys.stderr)
        return 1
    print(f"warning: {len(bad)} of {len(results)} runs failed ({causes}); logs: {logs}{os.sep}", file=sys.stderr)
    return 0
