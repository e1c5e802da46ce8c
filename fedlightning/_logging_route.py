"""Where a LightningModule's ``self.log`` / ``self.log_dict`` calls go while fedlightning runs it.

The user's module runs outside Lightning's training loop (client training, the working copy's deep copy, probes
and evaluations of callbacks), where Lightning's own ``log`` would refuse the call or record it at the wrong
step. Routing replaces the two methods of one instance by instance attributes; :func:`routed_logging` restores on
exit exactly what the instance held before (its earlier routing, or none, so that the class's methods show
through again)::

    with routed_logging(model, discard, discard):   # the model's self.log calls are dropped inside
        model.training_step(batch, 0)
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

__all__ = [
    "RoundLogOptions",
    "discard",
    "note_round_log_options",
    "round_log_options",
    "round_log_value",
    "route_logging",
    "routed_logging",
]

#: How the values a name gets over a round (every local step of every client) become its ``client/<name>``
REDUCTIONS = ("mean", "sum", "max", "min")
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}
_LOG_SIGNATURE = inspect.signature(LightningModule.log)


@dataclass(frozen=True)
class RoundLogOptions:
    """What ``self.log(name, value, ...)`` in ``training_step`` asks for a round-level value ``client/<name>``:
    ``reduce`` over the round's values, shown on the progress bar (``prog_bar``), written to the loggers
    (``logger``)."""

    reduce: str = "mean"
    prog_bar: bool = False
    logger: bool = True


def round_log_options(name: str, args: tuple, kwargs: dict) -> RoundLogOptions:
    """The options of a ``self.log(name, value, *args, **kwargs)`` call made during client training, bound as
    ``LightningModule.log`` binds them.

    Decisions (ours): a value logged in ``training_step`` is one value per local step of every client of the round,
    and its ``client/<name>`` is one value per round, logged at the round's step: ``reduce_fx`` ("mean", the
    default, "sum", "max", "min", or ``torch.mean`` / ``torch.sum`` / ``torch.max`` / ``torch.min``) reduces all of
    the round's values, over the clients of every process (a custom callable is refused: it cannot be combined
    across processes); ``prog_bar`` and ``logger`` are Lightning's. ``on_step`` / ``on_epoch`` are accepted and mean
    nothing more here (the round is the step, and an epoch of the loop is ``rounds_per_epoch`` rounds);
    ``sync_dist`` is always on in effect (the reduction covers all processes); ``batch_size``, ``enable_graph``,
    ``rank_zero_only`` and the rest are accepted and have no effect."""
    values = (*args, *kwargs.values())
    simple = type(name) is str and all(type(v) in _PLAIN for v in values)
    if simple:  # the common call: options of plain values, bound once per distinct call (see _bound_options)
        return _bound_options(name, args, tuple(kwargs.items()))
    return _bind_options(name, args, kwargs)


#: Types of ``self.log`` option values whose bound options :func:`_bound_options` keeps (hashable by value)
_PLAIN = frozenset({bool, int, float, str, type(None)})


@functools.lru_cache(maxsize=4096)
def _bound_options(name: str, args: tuple, kwargs: tuple[tuple[str, Any], ...]) -> RoundLogOptions:
    """:func:`_bind_options` of a call whose options are plain values, kept per distinct call: ``training_step``
    logs the same names with the same options at every local step of every client, and binding the signature
    costs about ten times a lookup here. Values equal as keys give equal options (``prog_bar=1`` and ``True``). An
    invalid call raises and is not kept."""
    return _bind_options(name, args, dict(kwargs))


def _bind_options(name: str, args: tuple, kwargs: dict) -> RoundLogOptions:
    try:
        bound = _LOG_SIGNATURE.bind(None, name, None, *args, **kwargs)
    except TypeError as err:
        raise TypeError(f"self.log({name!r}, ...) in training_step: {err}") from None
    options = bound.arguments
    reduce_fx = options.get("reduce_fx", "mean")
    reduce = _TORCH_REDUCTIONS.get(reduce_fx) if callable(reduce_fx) else reduce_fx
    if reduce not in REDUCTIONS:
        raise ValueError(
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}) in training_step: a value logged during client "
            f"training is reduced over the round's local steps and clients with one of {', '.join(REDUCTIONS)}"
        )
    logger = options.get("logger")
    return RoundLogOptions(reduce, bool(options.get("prog_bar", False)), True if logger is None else bool(logger))


def note_round_log_options(known: dict[str, RoundLogOptions], name: str, options: RoundLogOptions) -> None:
    """Record in ``known`` how ``name`` is logged; the same name logged with other options is refused (its round
    value would be ambiguous)."""
    first = known.setdefault(name, options)
    if first != options:
        raise ValueError(
            f"self.log({name!r}, ...) in training_step is called with different options ({first} and {options}); "
            "log one name with one reduce_fx, prog_bar and logger"
        )


def round_log_value(name: str, value: Any) -> Tensor:
    """A value logged during client training as a 0-d tensor (a one-element tensor keeps its dtype and device; a
    Python or numpy number, or a one-element numpy array, becomes a tensor of torch's default dtype); anything else
    is refused, as Lightning refuses it."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, value) in training_step: the value must be one number, got a tensor of shape "
                f"{tuple(value.shape)} (log a reduction of it, e.g. its mean)"
            )
        return value.detach().reshape(())
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, (numbers.Number, np.generic)) and not isinstance(value, complex):
        return torch.tensor(float(value))
    raise ValueError(
        f"self.log({name!r}, value) in training_step: the value must be a number, a one-element tensor or a "
        f"torchmetrics Metric, got {type(value).__name__}"
    )


_NAMES = ("log", "log_dict")


def discard(*args: Any, **kwargs: Any) -> None:
    """A ``log`` / ``log_dict`` that drops every value."""


def route_logging(model: nn.Module, log: Callable[..., None] | None, log_dict: Callable[..., None] | None) -> None:
    """Make ``model.log`` ``log`` and ``model.log_dict`` ``log_dict`` until changed again; None removes the instance's
    routing of that method (the class's own method is used)."""
    for name, target in zip(_NAMES, (log, log_dict)):
        if target is None:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = target


@contextmanager
def routed_logging(
    model: nn.Module, log: Callable[..., None] | None, log_dict: Callable[..., None] | None
) -> Iterator[nn.Module]:
    """:func:`route_logging` for the ``with`` block; on exit the instance's previous routing (or its absence) is
    restored, also when the block raises."""
    saved = {name: model.__dict__[name] for name in _NAMES if name in model.__dict__}
    route_logging(model, log, log_dict)
    try:
        yield model
    finally:
        route_logging(model, saved.get("log"), saved.get("log_dict"))
