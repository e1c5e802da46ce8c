"""Every access fedlightning makes to private state of Lightning and torchmetrics, in one place.

Federated training runs inside Lightning's fit loop but does some of its work itself (client training, logging the
round's metrics, a progress bar over rounds), and for that it reads or sets a few attributes that Lightning and
torchmetrics do not publish. Each such access is one function here, named for what it does, and
``tests/test_lightning_compat.py`` checks each against the installed versions (the attribute exists, has the
meaning relied on), so an upgrade that changes one fails that test by name instead of silently changing behaviour.
No other module of fedlightning touches these attributes.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = [
    "BATCH_TRANSFER_HOOKS",
    "align_logged_step",
    "allow_logging_from",
    "attached_trainer",
    "batches_in_epoch",
    "batches_that_stepped",
    "checkpoint_every_n_epochs",
    "current_hook",
    "defer_sigterm",
    "detached_trainer",
    "early_stopping_at_epoch_end",
    "log_hyperparameters_like",
    "evaluation_batch",
    "logged_at_last_round",
    "metric_reductions",
    "metric_state",
    "note_sigterm",
    "parse_configure_optimizers",
    "preserved_metric_states",
    "progress_bar_options",
    "publish_step_metrics",
    "reopen_ended_epoch",
    "reopen_finished_fit",
    "settle_unprocessed_batch",
    "saved_step",
    "skip_validation_of_timed_stop",
    "should_write_step_logs",
    "spawns_processes",
    "strategy_optimizers",
    "timer_interval",
    "transfer_hook_owners",
    "unsynced_metrics",
    "validation_follows",
]


def defer_sigterm(trainer: pl.Trainer, on_signal: Callable[[], None]) -> bool:
    """Replace the SIGTERM handler Lightning registered for this fit by one that makes no collective: it forwards
    the signal once to the processes the strategy's launcher started (as Lightning's does), calls ``on_signal``, then
    the handler that was there before Lightning's (as Lightning's does). True if installed (in the main thread only,
    where Python runs signal handlers); Lightning's teardown puts the earlier handler back at the end of the fit.

    Decision (ours): with several processes Lightning's handler broadcasts a tensor from inside the signal handler,
    at whatever point the process is, once per signal received (a process may receive two: the job's and the one
    its launcher forwards), so the processes' sequences of collectives part and the run hangs until the collective
    timeout instead of stopping. The loop instead agrees on the stop with the round's own exchange and sets
    :func:`note_sigterm` on every process at the same round."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = getattr(trainer._signal_connector, "_original_handlers", {}).get(signal.SIGTERM)
    forwarded = []

    def handler(signum: int, frame: Any) -> None:
        if not forwarded:
            forwarded.append(signum)
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        on_signal()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)
    return True


def log_hyperparameters_like(loop: pl.LightningModule, module: pl.LightningModule) -> None:
    """Whether Lightning logs ``loop.hparams_initial`` with the loggers at the start of a fit: as it would for
    ``module`` (the flag ``save_hyperparameters(logger=...)`` sets; off for a module that never called it)."""
    loop._log_hyperparams = bool(getattr(module, "_log_hyperparams", False))


def note_sigterm(trainer: pl.Trainer) -> None:
    """Mark the fit as having received SIGTERM: Lightning then stops at the end of the round in progress with a
    ``SIGTERMException`` (the flag its own handler sets)."""
    trainer._signal_connector.received_sigterm = True


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


_PROGRESS_KEYS = ("ready", "started", "processed", "completed")


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The fit loop's saved state in a checkpoint (``loops.fit_loop``), None where the file has none."""
    loops = checkpoint.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    return fit if isinstance(fit, dict) else None


def _progress_counts(counts: Any) -> bool:
    """Whether ``counts`` is a saved progress tracker with the four integer counts of :data:`_PROGRESS_KEYS`."""
    return isinstance(counts, dict) and all(isinstance(counts.get(k), int) for k in _PROGRESS_KEYS)


def settle_unprocessed_batch(checkpoint: dict[str, Any]) -> bool:
    """Count a batch (a round) that a checkpoint records as started but not processed as never started: its fit
    loop's batch progress back to the last completed batch, in the totals as in the current epoch's counts. True
    when it changed something.

    Such a file is written when an exception (Ctrl-C) stops the run at the start of a round
    (:meth:`~fedlightning.checkpoint.RoundCheckpoint.on_exception` saves the last completed round then). Lightning's
    restore puts the current counts back to the completed batches (``_Progress.reset_on_restart``) but not the
    totals, and with ``check_val_every_n_epoch=None`` the validation schedule counts from the total of batches made
    ready: every validation after the resume came one round early, and the last round's was lost. A file written
    inside a batch after it was processed (``on_train_batch_end``) is Lightning's own case and is left as it is."""
    fit = _fit_loop_state(checkpoint)
    progress = fit.get("epoch_loop.batch_progress") if fit is not None else None
    if not isinstance(progress, dict):
        return False
    changed = False
    for part in ("total", "current"):
        counts = progress.get(part)
        if not _progress_counts(counts):
            continue
        done = counts["completed"]
        if counts["processed"] == done and (counts["ready"] > done or counts["started"] > done):
            counts["ready"] = counts["started"] = done
            changed = True
    return changed


def reopen_ended_epoch(checkpoint: dict[str, Any]) -> bool:
    """Make the file of a fit whose epoch has ended, at its ``max_steps`` (the last round of its epoch done) or by a
    stop request (``EarlyStopping``, ``max_time``, a callback setting ``trainer.should_stop``), read as written inside
    that epoch, after its last round: its fit loop's epoch progress back to the epoch in progress, its last batch
    not the epoch's last. True when it changed something. For a fit resumed to train on.

    A fit with ``max_steps`` has one epoch of ``max_steps`` rounds (the data module's round loader), so the file of a
    finished fit records that epoch as complete (written after the fit, e.g. ``RoundCheckpoint``'s last save), or
    its last batch as the epoch's last (written at the end of the last round, before Lightning ended the epoch);
    resumed to train on, Lightning began a new epoch, and every later round was logged with ``epoch`` 1 or 2 (an
    uninterrupted run logs 0) and checkpoint names read ``epoch=1-...``. A stop request ends the epoch before its
    last batch: the file records the epoch complete with a last batch that is not the epoch's last. Reopened, the
    resumed fit continues epoch 0 as a fit resumed from a file written inside it does, its epoch now ``max_steps``
    rounds long from its first round (``train_dataloader``)."""
    fit = _fit_loop_state(checkpoint)
    if fit is None:
        return False
    batches, epochs = fit.get("epoch_loop.batch_progress"), fit.get("epoch_progress")
    if (
        not isinstance(batches, dict)
        or not isinstance(epochs, dict)
        or not isinstance(batches.get("is_last_batch"), bool)
    ):
        return False
    stopped = not batches["is_last_batch"]  # only a finished epoch below qualifies: one a stop request ended
    parts = [batches.get("current"), epochs.get("current"), epochs.get("total")]
    if not all(_progress_counts(p) for p in parts):
        return False
    last = parts[0]
    if not last["ready"] == last["started"] == last["processed"] or last["completed"] not in (
        last["processed"],
        last["processed"] - 1,  # saved in the round's on_train_batch_end, before Lightning counts it completed
    ):
        return False  # its last batch not done
    in_progress = all(p["ready"] == p["started"] == p["processed"] + 1 == p["completed"] + 1 >= 1 for p in parts[1:])
    if in_progress:  # written at the end of the epoch's last round, before the epoch ended: that round is its last
        if stopped:
            return False  # a file written inside its epoch: Lightning resumes inside it already
        batches["is_last_batch"] = False
        return True
    if len(set(last.values())) != 1 or any(len({p[k] for k in _PROGRESS_KEYS}) != 1 for p in parts[1:]):
        return False  # not a finished epoch, all of whose counts agree
    if parts[1]["completed"] < 1:
        return False
    batches["is_last_batch"] = False
    for counts in parts[1:]:
        counts["processed"] -= 1
        counts["completed"] -= 1
    if isinstance(checkpoint.get("epoch"), int) and checkpoint["epoch"] > 0:
        checkpoint["epoch"] -= 1
    return True


def reopen_finished_fit(trainer: pl.Trainer) -> bool:
    """For ``trainer.fit`` again on a Trainer whose fit ended (at its ``max_steps``, now raised, or by a stop request):
    its fit loop's finished epoch reopened, as :func:`reopen_ended_epoch` reopens such a fit's file, so that the
    continued fit goes on in epoch 0 (``epoch`` logged 0, checkpoint names ``epoch=0-...``) as an uninterrupted fit
    does, not in a new epoch. True when it changed something."""
    state = {"loops": {"fit_loop": trainer.fit_loop.state_dict()}}
    if not reopen_ended_epoch(state):
        return False
    trainer.fit_loop.load_state_dict(state["loops"]["fit_loop"])
    return True


def spawns_processes(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's strategy runs the fit in processes it starts from this one and hands back only the
    results (Lightning's multiprocessing launcher: ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), not in this
    process (``ddp``'s launcher starts the other processes as copies of the script; a single device runs here)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


#: Lightning's batch-transfer hooks, in the order a batch goes through them.
BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def transfer_hook_owners(model: Any, datamodule: Any = None) -> dict[str, Any]:
    """Whose batch-transfer hook a batch goes through, by hook name (:data:`BATCH_TRANSFER_HOOKS`): the data
    module's where it overrides the hook (in its class, or on the instance: the hooks a wrapped module forwards),
    else the module's. Lightning's rule (``_DataHookSelector``, which warns when both override one)."""
    return {
        name: datamodule
        if datamodule is not None and is_overridden(name, datamodule, pl.LightningDataModule)
        else model
        for name in BATCH_TRANSFER_HOOKS
    }


def evaluation_batch(model: pl.LightningModule, batch: Any, device: torch.device) -> Any:
    """``batch`` as Lightning's evaluation loop hands it to the module's step: the attached Trainer's precision
    plugin's input conversion, then ``on_before_batch_transfer``, ``transfer_batch_to_device`` (to ``device``) and
    ``on_after_batch_transfer``, each the Trainer's data module's where it overrides it, else the module's
    (:func:`transfer_hook_owners`)."""
    trainer = attached_trainer(model)
    plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
    if plugin is not None:
        batch = plugin.convert_input(batch)
    owner = transfer_hook_owners(model, getattr(trainer, "datamodule", None) if trainer is not None else None)
    batch = owner["on_before_batch_transfer"].on_before_batch_transfer(batch, 0)
    batch = owner["transfer_batch_to_device"].transfer_batch_to_device(batch, device, 0)
    return owner["on_after_batch_transfer"].on_after_batch_transfer(batch, 0)


@contextmanager
def detached_trainer(module: pl.LightningModule) -> Iterator[pl.Trainer | None]:
    """``module`` without its Trainer inside the block (e.g. to deep-copy it without copying the Trainer), attached
    again afterwards; yields the Trainer."""
    trainer = module._trainer
    module.trainer = None
    try:
        yield trainer
    finally:
        module.trainer = trainer


@contextmanager
def strategy_optimizers(strategy: Any, optimizers: list[Any], schedulers: list[Any]) -> Iterator[None]:
    """``trainer.optimizers`` is ``optimizers`` and ``trainer.lr_scheduler_configs`` is ``schedulers`` inside the
    block, both as before afterwards (also on an exception). Sets the strategy's ``_optimizers`` directly: the public
    ``optimizers`` setter wraps each optimizer in a new ``LightningOptimizer``, which would replace the wrapper
    ``LightningModule.optimizers()`` returns."""
    saved = strategy._optimizers, strategy.lr_scheduler_configs
    strategy._optimizers, strategy.lr_scheduler_configs = optimizers, schedulers
    try:
        yield
    finally:
        strategy._optimizers, strategy.lr_scheduler_configs = saved


def progress_bar_options(bar: Any) -> dict[str, Any]:
    """The constructor arguments that rebuild ``bar`` (Lightning's ``TQDMProgressBar`` or ``RichProgressBar``) with
    the options it was built with."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    if isinstance(bar, TQDMProgressBar):
        return dict(refresh_rate=bar.refresh_rate, process_position=bar.process_position, leave=bar._leave)
    return dict(refresh_rate=bar.refresh_rate, leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs)


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning's logger connector passes to ``logger.log_metrics`` for training metrics (the fit loop's
    count of batches that stepped an optimizer; the round number here)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def early_stopping_at_epoch_end(callback: Any) -> bool:
    """Whether an ``EarlyStopping`` checks its monitor at the end of a training epoch (else after each validation):
    its ``check_on_train_epoch_end``, which its ``setup`` resolves when not given (epoch end when validation runs
    once per epoch: ``val_check_interval=1.0`` and ``check_val_every_n_epoch=1``)."""
    return bool(callback._check_on_train_epoch_end)


def timer_interval(callback: Any) -> str:
    """A ``Timer``'s ``interval``: ``"step"`` (checks after every training step) or ``"epoch"``."""
    interval = callback._interval
    return str(getattr(interval, "value", interval))


def checkpoint_every_n_epochs(callback: Any) -> int:
    """A ``ModelCheckpoint``'s ``every_n_epochs`` as it resolved it (0 when ``every_n_train_steps`` or
    ``train_time_interval`` is set and ``every_n_epochs`` is not)."""
    return int(callback._every_n_epochs)


def saved_step(callback: Any) -> int | None:
    """The global step (round) a ``ModelCheckpoint`` last wrote a file at (``_last_global_step_saved``; None if it
    wrote none in this fit)."""
    step = getattr(callback, "_last_global_step_saved", None)
    return int(step) if isinstance(step, int) and step > 0 else None


def validation_follows(trainer: pl.Trainer) -> bool:
    """Asked from an ``on_train_batch_end`` hook: whether Lightning's fit loop runs a validation right after the
    batch (round) now ending (its own rule, which it applies after that hook: ``val_check_interval``,
    ``check_val_every_n_epoch``, the epoch's last batch, a stop requested, ``limit_val_batches=0``; and not when
    :func:`skip_validation_of_timed_stop` skipped it)."""
    loop = trainer.fit_loop
    if loop.epoch_loop._skip_next_val:
        return False
    return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))


def skip_validation_of_timed_stop(trainer: pl.Trainer) -> bool:
    """Asked from an ``on_train_batch_end`` hook that runs after Lightning's ``Timer``, on every process: when the
    ``Timer`` (``max_time``, on the clock of global rank 0, as the ``Timer`` decides) has just asked the fit to stop,
    and no validation is due after this batch but for that request (Lightning validates whenever a stop is
    requested), have the fit loop skip that validation (its ``_skip_next_val``, its own flag for a validation it must
    not run). True when it did."""
    from lightning.pytorch.callbacks import Timer

    if not trainer.should_stop:  # the same on every process (the Timer broadcasts its decision, as EarlyStopping)
        return False
    timer = next((cb for cb in trainer.callbacks if isinstance(cb, Timer)), None)
    if timer is None:
        return False
    remaining = timer.time_remaining()
    # rank 0's clock, as the Timer's own decision: every process then skips the same validation (a collective)
    if not trainer.strategy.broadcast(remaining is not None and remaining <= 0):
        return False
    trainer.should_stop = False
    try:
        due = validation_follows(trainer)
    finally:
        trainer.should_stop = True
    if not due:
        trainer.fit_loop.epoch_loop._skip_next_val = True
    return not due


def batches_in_epoch(trainer: pl.Trainer) -> int:
    """The batches (rounds) of the current epoch Lightning counts as done: 0 at a fresh start, the position inside
    the epoch after a resume from a checkpoint written mid-epoch (its restored batch progress)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def align_logged_step(trainer: pl.Trainer) -> None:
    """Set the step training metrics are logged at (:func:`batches_that_stepped`) to ``trainer.global_step``, which
    it equals in a federated fit (one batch and one optimizer step per round). A restore adds one to Lightning's
    count when it takes the checkpoint for one written inside a batch (``_TrainingEpochLoop.reset``), which a file
    written at the end of training after a validation, or after an exception, is not: every later round's metrics
    would go to the step of the round after it."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = int(trainer.global_step)


@contextmanager
def logged_at_last_round(trainer: pl.Trainer) -> Iterator[None]:
    """Inside the block (a ``trainer.test`` of the final model after ``fit``), metrics logged without a step go to
    the step of the fit's last round, ``global_step − 1``, where that round's metrics and the validation after it
    are (Lightning's count of stepped batches, its default step, is one past it once the fit has ended)."""
    loop = trainer.fit_loop.epoch_loop
    kept = loop._batches_that_stepped
    loop._batches_that_stepped = max(int(trainer.global_step) - 1, 0)
    try:
        yield
    finally:
        loop._batches_that_stepped = kept


def should_write_step_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's metrics to the loggers (its ``should_update_logs`` rule: every
    ``log_every_n_steps`` steps or when the trainer is stopping, never with ``log_every_n_steps=0``)."""
    return bool(trainer._logger_connector.should_update_logs)


def publish_step_metrics(
    trainer: pl.Trainer,
    metrics: dict[str, torch.Tensor],
    progress_bar: tuple[str, ...],
    unlogged: tuple[str, ...] = (),
) -> None:
    """Make ``metrics`` (scalar tensors) what ``self.log(name, value, prog_bar=name in progress_bar)`` in a
    ``training_step`` makes them, without Lightning's result collection: ``trainer.callback_metrics`` and
    ``trainer.logged_metrics`` hold them, and the names in ``progress_bar`` show on the progress bar
    (``trainer.progress_bar_metrics``, as Python floats) until they are logged again. Writing them to the loggers is
    the caller's (Lightning's own ``log_metrics`` writes and saves each logger, with ``epoch`` added). The names in
    ``unlogged`` stay out of ``trainer.logged_metrics``, as ``self.log(..., logger=False)`` keeps them."""
    connector = trainer._logger_connector
    connector._callback_metrics.update(metrics)
    connector._logged_metrics.update({k: v for k, v in metrics.items() if k not in unlogged})
    connector._progress_bar_metrics.update({k: float(metrics[k]) for k in progress_bar if k in metrics})


@contextmanager
def current_hook(module: pl.LightningModule, name: str) -> Iterator[None]:
    """``module``'s current hook name is ``name`` inside the block (what ``self.log`` checks to decide where a value
    may be logged from), as Lightning's own hook dispatcher sets it; restored afterwards."""
    previous = getattr(module, "_current_fx_name", None)
    module._current_fx_name = name
    try:
        yield
    finally:
        module._current_fx_name = previous


def allow_logging_from(names: tuple[str, ...], like: str = "training_step") -> None:
    """Let ``self.log`` be called from the hooks ``names`` (e.g. the federated hooks, which run inside the round's
    ``training_step``) with the options and defaults Lightning gives hook ``like``: Lightning's logging validator
    refuses a hook name it does not know, and its dispatcher-style ``current_hook`` sets such names."""
    from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator

    for name in names:
        _FxValidator.functions.setdefault(name, _FxValidator.functions[like])


def parse_configure_optimizers(conf: Any) -> tuple[list[Any], list[Any]]:
    """``(optimizers, scheduler configs)`` from what a ``configure_optimizers()`` returned, parsed by Lightning's own
    rules (every return form it accepts; a malformed one raises its ``MisconfigurationException``)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    optimizers, schedulers, monitor = _configure_optimizers(conf)
    return optimizers, _configure_schedulers_automatic_opt(schedulers, monitor)


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s accumulated state, by attribute name: its registered states (``add_state``), its
    update count and its cached ``compute()`` result; ``setattr`` of each entry restores it (tensors are cloned)."""
    state = {k: _clone(getattr(metric, k)) for k in metric._defaults}
    state["_update_count"] = metric._update_count
    state["_computed"] = metric._computed
    return state


@contextmanager
def unsynced_metrics(module: Any) -> Iterator[None]:
    """Inside the block, every torchmetrics ``Metric`` of ``module`` computes from this process's states alone: its
    ``sync_on_compute`` and torchmetrics' pending-sync flag (``_to_sync``, which ``forward`` resets from
    ``sync_on_compute``) are off; both as before afterwards, also on an exception. For an evaluation that every
    process runs over the same samples, where a sync would count each sample once per process."""
    metrics = [m for m in module.modules() if _metric_types() and isinstance(m, _metric_types())]
    saved = [(m, m.sync_on_compute, m._to_sync) for m in metrics]
    for m in metrics:
        m.sync_on_compute = m._to_sync = False
    try:
        yield
    finally:
        for m, on_compute, to_sync in saved:
            m.sync_on_compute, m._to_sync = on_compute, to_sync


@contextmanager
def preserved_metric_states(module: Any) -> Iterator[None]:
    """Every torchmetrics ``Metric`` of ``module`` has the state after the block it had before (:func:`metric_state`),
    also on an exception: for calls of a module's ``training_step`` that are not training (an evaluation), whose
    metric updates would otherwise accumulate in the module's metrics."""
    types = _metric_types()
    saved = [(m, metric_state(m)) for m in module.modules() if types and isinstance(m, types)]
    try:
        yield
    finally:
        for metric, state in saved:
            for key, value in state.items():
                setattr(metric, key, value)


def _metric_types() -> tuple[type, ...]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return ()
    return (Metric,)


def metric_reductions(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s reduction function of each registered state (``add_state(dist_reduce_fx=...)``)."""
    return dict(metric._reductions)


def _clone(v: Any) -> Any:
    from torch import Tensor

    if isinstance(v, Tensor):
        return v.clone()
    if isinstance(v, list):
        return [t.clone() if isinstance(t, Tensor) else t for t in v]
    return v
