"""Run a W&B sweep file locally: ``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--dry-run]``.

The same file works unchanged with ``wandb sweep`` / ``wandb agent`` when W&B is configured; the local runner needs
neither an account nor the network. Parameters are drawn with Optuna (grid / random / bayes → ``GridSampler`` /
``RandomSampler`` / ``TPESampler``), every run is a subprocess of the sweep's own command logging to CSV, the study
is resumable from ``OUT/optuna.journal``, and ``OUT/results.md`` / ``results.csv`` rank the runs by the sweep's
metric. User guide: docs/sweeps.md.

Modules: ``space`` (W&B parameter specs → Optuna distributions, :func:`search_space`; samplers,
:func:`make_sampler`), ``results`` (run names, :func:`run_slug`; :class:`RunResult`; final metrics), ``runner``
(:class:`LocalSweep`: resume, runs, tables; :func:`main`).
"""

from fedlightning.sweep.results import RunFailed, RunResult, read_final_metrics, run_slug
from fedlightning.sweep.runner import (
    DEFAULT_SEED,
    JOURNAL,
    LOCAL_LOGGER,
    LOCK,
    RESULTS_CSV,
    RESULTS_MD,
    LocalSweep,
    main,
)
from fedlightning.sweep.space import Param, make_sampler, search_space

__all__ = [
    "Param",
    "search_space",
    "make_sampler",
    "run_slug",
    "RunResult",
    "LocalSweep",
    "main",
    "DEFAULT_SEED",
    "RunFailed",
    "read_final_metrics",
    "LOCAL_LOGGER",
    "JOURNAL",
    "LOCK",
    "RESULTS_CSV",
    "RESULTS_MD",
]
