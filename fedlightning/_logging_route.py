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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["discard", "route_logging", "routed_logging"]

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
