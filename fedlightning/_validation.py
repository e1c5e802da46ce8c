"""Argument checks shared by the package: one message style that names the field and the value.

Every check returns the value converted (``float``, ``int``, ``bool`` or the matching choice) or raises

* ``ValueError``: ``"<name> must be <rule>, got <value>"`` (a number outside its range, a value not among the
  choices);
* :class:`WrongTypeError` for a value of the wrong kind (a string where a number belongs): both a ``TypeError`` and
  a ``ValueError``, so a caller catching either sees it.

Numbers are Python or NumPy reals, finite unless the rule says otherwise; ``bool`` is not a number here
(``True`` is no step size). Integers also accept integral floats (``2.0``); ``2.5`` is refused. ``allow_none``
lets ``None`` through (returned as is) and adds "or None" to the rule; ``show_name`` writes the value as
``name=value``; ``label`` replaces the field name at the start of the message (``"Dirichlet alpha"``); ``hint``
follows the rule in parentheses.

Run-level checks raise :class:`SettingError` (a ``ValueError`` carrying the setting's ``train.py`` config key):
:func:`check_fit_settings` (trainer limits, validation interval, seed) and :func:`check_learning_rates` (a client
optimizer's learning rates), both called by ``FederatedLoop.setup`` before round 0, and
:func:`check_val_check_interval`, which the CLI also calls right after parsing.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

__all__ = [
    "SettingError",
    "SettingTypeError",
    "WrongTypeError",
    "check_fit_callbacks",
    "check_fit_settings",
    "check_refused_callbacks",
    "check_half_precision_eps",
    "check_learning_rates",
    "check_loss_scaling",
    "check_step_settings",
    "check_val_check_interval",
    "flag",
    "in_range",
    "integer",
    "non_negative",
    "number",
    "one_of",
    "positive",
]


class WrongTypeError(TypeError, ValueError):
    """A value of the wrong kind for its field (both a ``TypeError`` and a ``ValueError``)."""


class SettingError(ValueError):
    """An impossible setting of a run. ``config_key`` is the setting's key in a ``train.py`` config
    (``trainer.max_steps``, ``model.seed``), which the CLI's one-line error starts with; the message itself names the
    setting as a Python user writes it, and the value."""

    def __init__(self, config_key: str, message: str) -> None:
        super().__init__(message)
        self.config_key = config_key


class SettingTypeError(TypeError):
    """A setting of the wrong kind (a client optimizer another class than the callback needs); ``config_key`` as in
    :class:`SettingError`."""

    def __init__(self, config_key: str, message: str) -> None:
        super().__init__(message)
        self.config_key = config_key


def _fail(
    name: str,
    rule: str,
    value: Any,
    *,
    label: str | None,
    show_name: bool,
    allow_none: bool,
    error: type = ValueError,
    hint: str = "",
) -> None:
    shown = f"{name}={value!r}" if show_name else repr(value)
    rule = rule + (" or None" if allow_none else "") + (f" ({hint})" if hint else "")
    raise error(f"{label or name} must be {rule}, got {shown}")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _bound(low: float | None, high: float | None, low_closed: bool, high_closed: bool) -> str:
    if low is not None and high is not None:
        return f"in {'[' if low_closed else '('}{low:g}, {high:g}{']' if high_closed else ')'}"
    if low is not None:
        return f"{'>=' if low_closed else '>'} {low:g}"
    if high is not None:
        return f"{'<=' if high_closed else '<'} {high:g}"
    return ""


def in_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_closed: bool = True,
    high_closed: bool = False,
    finite: bool = True,
    allow_none: bool = False,
    label: str | None = None,
    show_name: bool = False,
    hint: str = "",
) -> float | None:
    """``float(value)`` for a real number in the interval (``low`` / ``high`` None: unbounded on that side;
    ``low_closed`` / ``high_closed``: whether the end belongs to it); NaN never does, ±inf only with
    ``finite=False``."""
    if value is None and allow_none:
        return None
    bound = _bound(low, high, low_closed, high_closed)
    if low is not None and high is not None:
        rule = bound
    else:
        rule = " ".join(filter(None, ("a finite number" if finite else "a number", bound)))
    options = dict(label=label, show_name=show_name, allow_none=allow_none, hint=hint)
    if not _is_real(value):
        _fail(name, rule, value, error=WrongTypeError, **options)
    v = float(value)
    ok = not math.isnan(v) and (math.isfinite(v) or not finite)
    if ok and low is not None:
        ok = v >= low if low_closed else v > low
    if ok and high is not None:
        ok = v <= high if high_closed else v < high
    if not ok:
        _fail(name, rule, value, **options)
    return v


def number(name: str, value: Any, **options: Any) -> float | None:
    """A finite real number."""
    return in_range(name, value, **options)


def positive(name: str, value: Any, **options: Any) -> float | None:
    """A finite real number > 0."""
    return in_range(name, value, 0.0, low_closed=False, **options)


def non_negative(name: str, value: Any, **options: Any) -> float | None:
    """A finite real number >= 0."""
    return in_range(name, value, 0.0, **options)


def integer(
    name: str,
    value: Any,
    minimum: int | None = 1,
    *,
    allow_none: bool = False,
    label: str | None = None,
    show_name: bool = False,
    hint: str = "",
) -> int | None:
    """``int(value)`` for an integer (or integral float) >= ``minimum`` (None: no lower bound)."""
    if value is None and allow_none:
        return None
    rule = "an integer" + ("" if minimum is None else f" >= {minimum}")
    options = dict(label=label, show_name=show_name, allow_none=allow_none, hint=hint)
    if not _is_real(value):
        _fail(name, rule, value, error=WrongTypeError, **options)
    if isinstance(value, (numbers.Integral, np.integer)):
        v = int(value)
    else:
        f = float(value)
        if not (math.isfinite(f) and f.is_integer()):
            _fail(name, rule, value, **options)
        v = int(f)
    if minimum is not None and v < minimum:
        _fail(name, rule, value, **options)
    return v


def one_of(name: str, value: Any, choices: Sequence[Any], *, label: str | None = None, show_name: bool = False) -> Any:
    """``value`` when it equals one of ``choices`` and has its type (``1`` is not ``True``)."""
    for choice in choices:
        if isinstance(value, type(choice)) and value == choice:
            return value
    listed = [repr(c) for c in choices]
    rule = listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} or {listed[-1]}"
    _fail(name, rule, value, label=label, show_name=show_name, allow_none=False)


def flag(name: str, value: Any) -> bool:
    """``value`` when it is a ``bool``."""
    if not isinstance(value, (bool, np.bool_)):
        _fail(name, "a bool", value, label=None, show_name=False, allow_none=False, error=WrongTypeError)
    return bool(value)


#: ``max_epochs`` that Lightning sets when a fit gives neither ``max_epochs`` nor a time limit and ``max_steps=-1``
#: (``lightning.pytorch.loops.utilities._parse_loop_limits``).
LIGHTNING_DEFAULT_MAX_EPOCHS = 1000


def check_fit_settings(trainer: Any, loop: Any) -> None:
    """Refuse, before round 0, trainer and loop settings with which a federated fit cannot run as asked; each
    :class:`SettingError` names the setting and the value. Called by ``FederatedLoop.setup("fit")``, so Python users
    get the same checks as ``train.py``. Decisions (ours):

    * ``trainer.max_steps`` is the number of rounds (one ``training_step`` is one round). ``0`` trains nothing and
      would still report success, so it is refused. ``-1`` (no step limit) is accepted with an explicit
      ``max_epochs`` (``max_epochs × rounds_per_epoch`` rounds, or ``-1``: until stopped) or a ``max_time``; with
      neither, Lightning picks ``max_epochs=1000``, i.e. 1000 × ``rounds_per_epoch`` rounds nobody chose, which is
      refused (an explicit ``max_epochs=1000`` cannot be told apart from that default and is refused too).
      Values below ``-1`` are Lightning's own error.
      An explicit ``max_epochs`` with ``max_steps=-1`` is logged with the rounds it means (an epoch of the loop is
      ``rounds_per_epoch`` rounds, 1000 by default, while the user's module sees one round as one epoch).
    * ``trainer.val_check_interval``: a number of rounds (int) or a fraction of an epoch of rounds (float) must be
      > 0 and finite (``0`` is a ``ZeroDivisionError`` in Lightning's loop); ``check_val_every_n_epoch`` must be
      None or >= 1 (likewise). Time-based intervals (``"00:01:00"``) are Lightning's.
    * ``model.seed`` must be an integer >= 0: every random stream is derived from it, and a negative seed is
      almost always a sentinel ("random") that the loop does not implement.
    """
    from lightning.pytorch.callbacks import Timer

    max_steps = getattr(trainer, "max_steps", None)
    max_epochs = getattr(trainer, "max_epochs", None)
    if isinstance(max_steps, int) and not isinstance(max_steps, bool):
        if max_steps == 0:
            raise SettingError(
                "trainer.max_steps",
                "max_steps is the number of federated rounds and must be >= 1 (or -1 with max_epochs), got 0",
            )
        timed = any(isinstance(cb, Timer) for cb in getattr(trainer, "callbacks", []))
        if max_steps == -1 and max_epochs == LIGHTNING_DEFAULT_MAX_EPOCHS and not timed:
            raise SettingError(
                "trainer.max_steps",
                "max_steps is the number of federated rounds; got -1 (no limit) without max_epochs or max_time, "
                f"so Lightning would run {LIGHTNING_DEFAULT_MAX_EPOCHS} epochs of rounds_per_epoch rounds: set "
                "max_steps to the number of rounds",
            )
        if max_steps == -1 and isinstance(max_epochs, int) and max_epochs > 0:
            per = getattr(getattr(trainer, "datamodule", None), "rounds_per_epoch", None)
            limit = getattr(trainer, "limit_train_batches", None)
            rounds = f"{max_epochs} x rounds_per_epoch={per} = {max_epochs * per}" if isinstance(per, int) else ""
            if rounds and isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit != 1.0:
                # Lightning's rule: an int caps an epoch's batches (rounds), a float takes that fraction of them
                capped = min(per, limit) if isinstance(limit, int) else max(1, int(per * limit))
                rounds = f"{max_epochs} x {capped} (limit_train_batches={limit!r}) = {max_epochs * capped}"
            rank_zero_info(
                f"trainer.max_epochs={max_epochs}: an epoch of the FederatedLoop is rounds_per_epoch rounds, so the "
                f"run trains up to {rounds or 'max_epochs x rounds_per_epoch'} rounds (set trainer.max_steps to "
                "count rounds)"
            )
    if isinstance(max_epochs, int) and not isinstance(max_epochs, bool) and max_epochs == 0:
        raise SettingError(
            "trainer.max_epochs",
            "max_epochs=0 trains no round; remove trainer.max_epochs and set trainer.max_steps to the number of rounds",
        )
    limit = getattr(trainer, "limit_train_batches", None)
    if limit is not None and not isinstance(limit, bool) and limit == 0:
        raise SettingError(
            "trainer.limit_train_batches",
            "limit_train_batches=0 trains no round (a training batch is a round); set trainer.max_steps to the "
            "number of rounds and remove trainer.limit_train_batches",
        )
    _check_min_epochs(trainer, max_steps)
    check_val_check_interval(getattr(trainer, "val_check_interval", None))
    every = getattr(trainer, "check_val_every_n_epoch", None)
    if every is not None:
        try:
            integer("check_val_every_n_epoch", every, allow_none=True)
        except ValueError as err:
            raise SettingError("trainer.check_val_every_n_epoch", str(err)) from None
    _check_validation_runs(trainer, max_steps, every)
    seed = getattr(loop, "seed", None)
    try:
        integer("seed", seed, 0)
    except ValueError as err:
        raise SettingError("model.seed", str(err)) from None


def _check_min_epochs(trainer: Any, max_steps: Any) -> None:
    """``trainer.min_steps`` is the minimum number of rounds before a callback's stop (``EarlyStopping``) takes
    effect. Lightning adds ``min_epochs=1`` to a given ``min_steps``; with ``max_steps`` set the run is one epoch of
    rounds, so that would hold every stop until the run's end: with ``min_steps`` given, a ``min_epochs`` of 1 is
    dropped here (an explicit ``min_epochs: 1`` next to ``min_steps`` cannot be told apart from it and is dropped
    too). An explicit ``min_epochs`` >= 1 with ``max_steps`` set is refused for the same reason (decision ours)."""
    loop = getattr(trainer, "fit_loop", None)
    min_epochs, min_steps = getattr(loop, "min_epochs", None), getattr(loop, "min_steps", None)
    if not (isinstance(min_epochs, int) and min_epochs >= 1):
        return
    if min_steps and min_epochs == 1:
        loop.min_epochs = 0
        return
    if isinstance(max_steps, int) and max_steps >= 1:
        raise SettingError(
            "trainer.min_epochs",
            f"with max_steps={max_steps} the run is one epoch of {max_steps} rounds, so min_epochs={min_epochs} "
            "would hold any early stop until the run's end; the minimum number of rounds before a stop is "
            "trainer.min_steps",
        )


def check_fit_callbacks(
    trainer: Any,
    *,
    early_stopping_at_epoch_end: Callable[[Any], bool],
    timer_interval: Callable[[Any], str],
    checkpoint_every_n_epochs: Callable[[Any], int],
) -> None:
    """Refuse, before round 0, Lightning callbacks that would do nothing, or something else than they say, in a
    federated fit (one training batch is one round; with ``trainer.max_steps`` set the run is one epoch of rounds).
    The three functions read the callbacks' resolved settings (``fedlightning._lightning_compat``). Decisions (ours):

    * ``EarlyStopping`` that checks at the end of a training epoch (``check_on_train_epoch_end: true``, or
      Lightning's default when validation runs once per epoch) would check once, after the last round, with
      ``max_steps`` set; one that checks after each validation never checks with ``limit_val_batches: 0``.
    * ``ModelCheckpoint(every_n_epochs >= 2)`` with ``max_steps`` set never saves (the run is epoch 0).
    * ``Timer(interval="epoch")`` with ``max_steps`` set checks the time after the last round only.
    * a callback monitoring a ``val/`` metric with ``limit_val_batches: 0`` (no validation) never sees it
      (``ModelCheckpoint`` would save nothing, ``EarlyStopping`` would fail after the last round).
    * ``StochasticWeightAveraging`` averages Lightning's own optimizer steps per epoch and, from a given epoch,
      puts its average into the model when the fit ends, here the weights of before the first round;
      ``BatchSizeFinder`` grows ``data.batch_size`` until a batch fails, which client batches (at most a client's
      data) never do, so clients would take full-batch steps; ``LearningRateFinder`` tunes Lightning's own
      optimizer; ``GradientAccumulationScheduler`` accumulates Lightning's optimizer steps (as
      ``accumulate_grad_batches``); ``BaseFinetuning`` (``BackboneFinetuning``) unfreezes layers at epochs, which
      under ``max_steps`` never come (the run is epoch 0), and adds them to the server optimizer with a smaller
      learning rate, which scales the server step of their average update, not the clients' training;
      ``SpikeDetection`` reads the loss of Lightning's training step, which a round does not return (the round's
      mean client loss is ``train/loss``). Each is refused with what does the job here.
    """
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer

    max_steps = getattr(trainer, "max_steps", None)
    one_epoch = isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps >= 1
    validates = getattr(trainer, "limit_val_batches", 1) != 0
    check_refused_callbacks(trainer)
    for cb in getattr(trainer, "callbacks", None) or []:
        name = type(cb).__name__
        monitor = getattr(cb, "monitor", None)
        if not validates and isinstance(monitor, str) and monitor.startswith("val/"):
            raise SettingError(
                "trainer.limit_val_batches",
                f"limit_val_batches=0 runs no validation, but {name}(monitor={monitor!r}) monitors a validation "
                "metric; validate (e.g. limit_val_batches: 1.0 with val_check_interval: N rounds) or monitor "
                "another metric",
            )
        if isinstance(cb, EarlyStopping):
            if early_stopping_at_epoch_end(cb):
                if one_epoch:
                    raise SettingError(
                        "trainer.callbacks",
                        f"{name}(monitor={monitor!r}) checks at the end of a training epoch, and with max_steps="
                        f"{max_steps} the run is one epoch: it would check once, after the last round; validate "
                        "every N rounds (val_check_interval: N) and set the callback's check_on_train_epoch_end: "
                        "false to check after each validation",
                    )
            elif not validates:
                raise SettingError(
                    "trainer.limit_val_batches",
                    f"{name}(monitor={monitor!r}) checks after each validation, and limit_val_batches=0 runs none: "
                    "it would never check; validate every N rounds (val_check_interval: N)",
                )
        if one_epoch and isinstance(cb, ModelCheckpoint) and checkpoint_every_n_epochs(cb) >= 2:
            raise SettingError(
                "trainer.callbacks",
                f"{name}(every_n_epochs={checkpoint_every_n_epochs(cb)}) with max_steps={max_steps}: the run is one "
                "epoch, so it would never save; save every N rounds with every_n_train_steps: N",
            )
        if one_epoch and isinstance(cb, Timer) and timer_interval(cb) == "epoch":
            raise SettingError(
                "trainer.callbacks",
                f"{name}(interval='epoch') with max_steps={max_steps}: the run is one epoch, so it would check the "
                "time after the last round only; use interval: step (a step is a round)",
            )


def check_refused_callbacks(trainer: Any) -> None:
    """Refuse the Lightning callbacks that would do something else in a federated fit (:func:`check_fit_callbacks`
    lists them and why), naming what does the job here. Also called when a fit starts, before the callbacks' own
    ``setup`` (``FederatedLoop.configure_callbacks``), where ``BackboneFinetuning`` would fail first on the loop."""
    from lightning.pytorch import callbacks
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        BatchSizeFinder,
        GradientAccumulationScheduler,
        LearningRateFinder,
        StochasticWeightAveraging,
    )

    refused = {
        StochasticWeightAveraging: "averages the weights of Lightning's own optimizer steps per epoch, which a "
        "federated fit does not take, and would put the weights of before the first round into the model when the "
        "fit ends; average on the server with a strategy (e.g. FedExP's iterate average) instead",
        BatchSizeFinder: "grows data.batch_size until a batch fails, which a client's batch (at most its data) never "
        "does, so clients would take full-batch steps; set data.init_args.batch_size",
        LearningRateFinder: "tunes Lightning's own optimizer, which a federated fit does not step; sweep the client "
        "learning rate with a W&B sweep (docs/sweeps.md)",
        GradientAccumulationScheduler: "accumulates Lightning's own optimizer steps, which federated training does "
        "not take: a client's local step is one batch of its loader; use a larger data.batch_size",
        BaseFinetuning: "unfreezes layers at epochs (with max_steps the run is one epoch of rounds, so a later one "
        "never comes; with max_epochs a layer thawed during the fit is refused) and adds them to the server optimizer "
        "with a smaller learning rate, which scales the server step of their averaged update instead of the clients' "
        "training; freeze layers in the module "
        "(requires_grad=False, fixed at the first round) and give them their own client learning rate in "
        "configure_optimizers() (a parameter group)",
    }
    spike = getattr(callbacks, "SpikeDetection", None)
    if spike is not None:
        refused[spike] = (
            "reads the loss of Lightning's training step, which a federated round does not return (the round's mean "
            "client loss is logged as train/loss); watch train/loss, or let the loop leave out non-finite clients "
            "(FederatedLoop's max_failed_rounds)"
        )
    for cb in getattr(trainer, "callbacks", None) or []:
        for kind, why in refused.items():
            if isinstance(cb, kind):
                raise SettingError("trainer.callbacks", f"{type(cb).__name__} {why}, and remove the callback")


def _check_validation_runs(trainer: Any, max_steps: Any, every: Any) -> None:
    """Refuse validation settings under which a fit of ``max_steps`` rounds would never validate, or validate
    something else (part of :func:`check_fit_settings`). Decisions (ours):

    * ``trainer.overfit_batches``: Lightning trains and validates on its first training batches, which here are
      rounds (a round plan reaches ``validation_step`` instead of a batch); a few clients are
      ``data.init_args.num_clients`` and ``model.clients_per_round``.
    * With ``max_steps`` set the run is one epoch of ``max_steps`` rounds (``FederatedDataModule.train_dataloader``):
      ``check_val_every_n_epoch`` >= 2 would never validate, whatever the run's length, and the run would end as if
      it had (a sweep on ``val/*`` finding no metric); an integer ``val_check_interval`` above ``max_steps`` with
      epoch-based validation (``check_val_every_n_epoch`` set) is Lightning's error, given here in one line. With
      ``check_val_every_n_epoch: null`` such an interval counts rounds over the whole run, so a run shortened below
      it (a quick trial of a config) is allowed, with a warning that it will not validate. Checked when validation
      is on (``limit_val_batches`` not 0)."""
    overfit = getattr(trainer, "overfit_batches", 0)
    if overfit:
        raise SettingError(
            "trainer.overfit_batches",
            f"overfit_batches={overfit!r} trains and validates on Lightning's first training batches, which here are "
            "rounds, not data; to train on a few clients set data.init_args.num_clients and model.clients_per_round, "
            "and remove trainer.overfit_batches",
        )
    if getattr(trainer, "limit_val_batches", 1) == 0 or not (isinstance(max_steps, int) and max_steps >= 1):
        return
    if isinstance(every, int) and not isinstance(every, bool) and every >= 2:
        raise SettingError(
            "trainer.check_val_every_n_epoch",
            f"with max_steps={max_steps} the run is one epoch of {max_steps} rounds, so check_val_every_n_epoch="
            f"{every} would never validate; validate every N rounds with val_check_interval: N and "
            "check_val_every_n_epoch: null",
        )
    interval = getattr(trainer, "val_check_interval", None)
    if not (isinstance(interval, int) and not isinstance(interval, bool) and interval > max_steps):
        return
    said = (
        f"val_check_interval={interval} rounds is more than the run's max_steps={max_steps} rounds, so no validation "
        "would run"
    )
    if every is not None:
        raise SettingError(
            "trainer.val_check_interval",
            f"{said}; set val_check_interval to at most max_steps (or limit_val_batches: 0 for no validation)",
        )
    warnings.warn(f"trainer.val_check_interval: {said} in this fit", UserWarning, stacklevel=2)


def check_step_settings(trainer: Any) -> None:
    """Refuse the Trainer's settings of Lightning's own optimizer steps, which federated training does not take (the
    loop runs each client's optimizer itself), each with the setting that does the job here; Lightning would stop
    with advice to switch to automatic optimization, which the user's module already uses. Called when a fit
    starts, before Lightning checks them (``FederatedLoop.configure_callbacks``). Decisions (ours):

    * ``trainer.gradient_clip_val``: clipping of client gradients is ``model.client_grad_clip`` (by norm, per local
      step; the server's step is not clipped). Not mapped silently: Lightning's ``"value"`` algorithm is another
      clipping than the norm clipping the loop does.
    * ``trainer.accumulate_grad_batches``: a local step is one batch of the client's loader; a larger step is a
      larger ``data.batch_size``."""
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip is not None and clip != 0:
        algorithm = str(getattr(getattr(trainer, "gradient_clip_algorithm", None), "value", None) or "norm")
        raise SettingError(
            "trainer.gradient_clip_val",
            f"Trainer(gradient_clip_val={clip!r}, gradient_clip_algorithm={algorithm!r}) clips Lightning's own "
            "optimizer steps, which federated training does not take; clip each client's local steps with "
            f"model.client_grad_clip (the gradient's norm, e.g. client_grad_clip: {clip!r}) and remove "
            "trainer.gradient_clip_val",
        )
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise SettingError(
            "trainer.accumulate_grad_batches",
            f"Trainer(accumulate_grad_batches={accumulate!r}) accumulates Lightning's own optimizer steps, which "
            "federated training does not take: a client's local step is one batch of its loader; use a larger "
            "data.batch_size and remove trainer.accumulate_grad_batches",
        )


def check_val_check_interval(interval: Any) -> None:
    """Refuse a numeric ``trainer.val_check_interval`` that is not > 0 and finite (rounds as an int, a fraction of an
    epoch of rounds as a float); None and time-based values (``"00:01:00"``, a timedelta, a dict) pass."""
    if _is_real(interval):
        v = float(interval)
        if not (math.isfinite(v) and v > 0):
            raise SettingError(
                "trainer.val_check_interval",
                "val_check_interval must be > 0 (validate every N rounds, or a fraction of an "
                f"epoch of rounds), got {interval!r}",
            )


def check_loss_scaling(trainer: Any) -> None:
    """Refuse a precision plugin with a loss scaler (``precision="16-mixed"`` on CUDA: Lightning's
    ``MixedPrecision`` with a ``torch.amp.GradScaler``), before round 0. Client training computes its gradients
    itself (``loss.backward()`` of each local step, the line searches' own backward passes, the vectorized engine's
    batched gradients) and never scales a loss, so the scaler would not do what the setting says, and the server
    step, a Lightning optimizer step, would fail in the scaler's ``unscale_`` after every client of round 0 has
    trained. Decision ours: refuse and name the setting (a dynamic loss scale per client is not implemented);
    ``bf16-mixed`` needs no loss scaling. On the CPU Lightning runs ``16-mixed`` as ``bf16-mixed`` (no scaler)."""
    plugin = getattr(trainer, "precision_plugin", None)
    if getattr(plugin, "scaler", None) is None:
        return
    precision = str(getattr(trainer, "precision", ""))
    raise SettingError(
        "trainer.precision",
        f"precision={precision!r} trains with a loss scaler (torch.amp.GradScaler), which federated client "
        "training does not apply (each client computes its own gradients without scaling its loss); use "
        "'bf16-mixed' (GPUs with bfloat16), '32-true', or '16-true' (float16 weights, no loss scaling)",
    )


def check_half_precision_eps(optimizer: Any, dtypes: Any, config_key: str, owner: str) -> None:
    """Refuse a client optimizer whose ``eps`` (Adam, AdamW, Adagrad, RMSprop, ...; any parameter group's
    positive float ``eps``) is 0 in a parameter dtype it will train (``precision="16-true"``: float16, whose smallest
    positive value is 6e-8). torch's default ``eps=1e-8`` rounds to 0 there, so the step divides by a square root of
    squared gradients that underflows to 0: every client's update is non-finite and every client fails, which a run
    would only report after round 0 as "no healthy client". ``dtypes`` are the dtypes the parameters train in."""
    halves = [d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point and torch.finfo(d).bits < 32]
    if not halves:
        return
    for i, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        eps = group.get("eps") if isinstance(group, dict) else None
        if not isinstance(eps, float) or not eps > 0:
            continue
        for dtype in halves:
            if float(torch.tensor(eps, dtype=dtype)) == 0.0:
                where = f" (parameter group {i})" if len(optimizer.param_groups) > 1 else ""
                tiny = torch.finfo(dtype).smallest_normal
                raise SettingError(
                    config_key,
                    f"{owner} eps={eps!r}{where} is 0 in {str(dtype).removeprefix('torch.')}, the dtype the "
                    "client parameters train in, so every step would divide by zero; set eps to at least "
                    f"{tiny:.3g} ({str(dtype).removeprefix('torch.')}'s smallest normal number), e.g. 1e-4",
                )


def check_learning_rates(optimizer: Any, config_key: str, owner: str) -> None:
    """Refuse a client optimizer whose learning rate (``lr`` of any parameter group) is NaN or infinite:
    ``torch.optim.SGD`` accepts both, and every client's loss would then be non-finite, so every client would be
    skipped and the global model never change. ``owner`` names the optimizer in the message (e.g.
    ``"client_optimizer SGD"``); ``config_key`` is its ``lr`` key in a ``train.py`` config."""
    for i, group in enumerate(getattr(optimizer, "param_groups", None) or []):
        lr = group.get("lr") if isinstance(group, dict) else None
        if lr is None or isinstance(lr, bool):
            continue
        try:
            value = float(lr)
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):
            where = f" (parameter group {i})" if len(optimizer.param_groups) > 1 else ""
            raise SettingError(config_key, f"{owner} lr must be a finite number, got {value!r}{where}")
