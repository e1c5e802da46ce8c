r"""torchmetrics metrics used in ``training_step`` under vmap: their calls are recorded, then replayed per client.

While the model runs under vmap, :class:`_MetricCalls` stands in for ``update``, ``forward`` (``metric(...)``),
``compute`` and ``reset`` of every torchmetrics ``Metric`` and ``MetricCollection`` of the model and records each
call; its tensor arguments leave vmap as ``[C, ...]`` outputs, as logged values do. After the round :func:`_replay`
makes the same calls outside vmap on each client's own tensors (its real samples on padded steps), client after
client and each client's steps in order: sequential training's calls in its order, so the metrics end the round in
its state and values read from them in ``training_step`` (``self.log("acc", metric.compute())``, the batch value
``metric(preds, y)`` returns) are its values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning._lightning_compat import metric_reductions

from .support import VectorizationUnsupportedError
from .torch_internals import _is_batched

__all__ = [
    "_MetricCalls",
    "_MetricStep",
    "_Pending",
    "_constants_mismatch",
    "_metric_modules",
    "_metric_types",
    "_replay",
]

#: The metric methods recorded under vmap.
_METHODS = ("update", "forward", "compute", "reset")

#: In :attr:`_MetricCalls.constants`: an argument that is one value per sample or per client (a per-sample tensor,
#: the loss loss interception computes, a value a metric returned, a container), which :func:`_constants_mismatch`
#: does not compare.
_PER_ROW = object()


def _metric_types() -> tuple[type, ...]:
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return ()
    return (Metric, MetricCollection)


def _metric_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's torchmetrics ``Metric`` and ``MetricCollection`` modules, with their names."""
    types = _metric_types()
    return [(n, m) for n, m in model.named_modules() if types and isinstance(m, types)]


class _Pending:
    """What ``compute()`` / ``metric(...)`` returns under vmap: the value of recorded call ``index``, known after the
    replay. It may be logged or passed to another metric; any other use raises."""

    __slots__ = ("owner", "generation", "index", "name")

    def __init__(self, owner: _MetricCalls, generation: int, index: int, name: str):
        self.owner, self.generation, self.index, self.name = owner, generation, index, name

    def _refuse(self, what: str = "used"):
        raise VectorizationUnsupportedError(
            f"the value that the torchmetrics metric '{self.name}' returns in training_step is {what}; under "
            "client_execution='vectorized' it is computed after the clients' batched step, so it can only be logged "
            "(self.log) or passed to another metric. Use client_execution='sequential' (or 'auto')"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse(f"used (.{attr})")

    def __bool__(self):
        self._refuse("used in a condition")

    def __float__(self):
        self._refuse("converted to a number")

    __int__ = __index__ = __float__

    def _operator(self, *args):
        self._refuse("used in arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _operator
    __neg__ = __pow__ = __rpow__ = __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = _operator


class _Call:
    __slots__ = ("metric", "method", "args", "kwargs")

    def __init__(self, metric: int, method: str, args: tuple, kwargs: dict):
        self.metric, self.method, self.args, self.kwargs = metric, method, args, kwargs


class _MetricStep:
    """The metric calls of one batched ``training_step`` evaluation, after vmap.

    ``tensors[j]`` is ``[R, ...]`` with ``kinds[j]`` saying how client ``c``'s argument is read from it: ``"row"``
    (``t[c]``), ``"cut"`` (``t[c, :n_c]``: its real samples) or ``"cells"`` (``t[c, :n_c]`` with the one-sample
    dimension merged: real cells of one-sample calls)."""

    def __init__(
        self,
        calls: list[_Call],
        tensors: list[Tensor],
        kinds: list[str],
        logged: list[tuple[str, int]],
        metric_logs: dict[str, int],
    ):
        self.calls, self.tensors, self.kinds = calls, tensors, kinds
        self.logged, self.metric_logs = logged, metric_logs
        # the calls whose return value is read (logged, or an argument of a later call)
        self.read = {i for _, i in logged} | {
            v for call in calls for k, v in (*call.args, *call.kwargs.values()) if k == "result"
        }
        self.counts: list[int] | None = None  # real samples per row on padded steps
        self.alive: Tensor | None = None  # [C] bool: the clients that took this step (None: all)

    def client_tensors(self, c: int) -> list[Tensor]:
        n = self.counts[c] if self.counts is not None else None
        out = []
        for t, kind in zip(self.tensors, self.kinds):
            if kind == "row":
                out.append(t[c])
            elif kind == "cut":
                out.append(t[c, :n])
            else:
                out.append(t[c, :n].flatten(0, 1))
        return out


class _MetricCalls:
    """Stands in for the metric methods of the model's torchmetrics modules while it runs under vmap (see the
    module docstring). :meth:`begin` starts one batched call, :meth:`outputs` are the tensors the vmapped function
    returns besides its own, :meth:`finish` turns them into the call's :class:`_MetricStep`.

    Decisions (ours):

    * Only gradient evaluations count; a line search's trial evaluations are not recorded (sequential training undoes
      their metric updates, :class:`fedlightning.user_module.MetricStates`).
    * A recorded tensor argument is one per client (whole batches), the client's real samples of a per-sample tensor
      (first dimension the padded batch; on one-sample calls the cells of its real samples), a loss the engine
      intercepted (its value is the mean over real samples), or a tensor the same for every client. Python constants are
      kept as they are. Anything else (a padded-batch statistic such as a mean accuracy, a container argument) is
      refused with the metric named: it cannot be split into the clients' real samples.
    * The value ``compute()`` or ``metric(...)`` returns inside ``training_step`` is only known after the replay: it may
      be logged (``self.log``) or passed to another metric's ``update``; any other use is refused.
    * ``metric(...)`` whose batch value nothing reads is replayed as ``metric.update(...)`` when that leaves the state
      ``forward`` leaves (every state reduced by sum, concatenation, min or max, or ``full_state_update``; not with
      ``dist_sync_on_step``): torchmetrics' ``forward`` also resets, computes the batch value and merges states, which
      ``update`` does not. The metric's ``_forward_cache`` (its last batch value) is then not set.
    * Memory: the recorded arguments of a round (``K`` steps × ``C`` clients × one update's arguments) are kept until
      its end.
    """

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]):
        self.modules = list(modules)
        self.generation = 0
        self.begin(False)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def install(self) -> list:
        """Replace the methods on every metric module (instance attributes); returns what :meth:`uninstall` needs."""
        saved = []
        for i, (_name, m) in enumerate(self.modules):
            for method in _METHODS:
                saved.append((m, method, m.__dict__.get(method)))
                m.__dict__[method] = _Recorder(self, i, method)
        return saved

    @staticmethod
    def uninstall(saved: list) -> None:
        for m, method, original in saved:
            if original is None:
                m.__dict__.pop(method, None)
            else:
                m.__dict__[method] = original

    # ------------------------------------------------------------------ one batched call
    def begin(
        self, record: bool, rows: str = "whole", n: int = 0, interception: Any = None, constants: bool = False
    ) -> None:
        """Start a call. ``record``: keep its metric calls (gradient evaluations); ``rows``: ``"whole"`` (a row is a
        client's whole batch), ``"padded"`` (a client's batch padded to ``n``) or ``"cell"`` (a batch of one
        sample); ``interception``: the active :class:`~fedlightning.vectorized.losses.LossInterception`, if any;
        ``constants``: keep, for a call outside vmap on one batch of ``n`` samples, every metric call's arguments
        that are not one value per sample (:attr:`constants`, compared by :func:`_constants_mismatch`)."""
        self.generation += 1
        self.record, self.rows, self.n, self.interception = record, rows, n, interception
        #: with ``constants``: (metric, method, ((position or keyword, value or _PER_ROW), ...)) per metric call
        self.constants: list[tuple[int, str, tuple]] | None = [] if constants else None
        self.calls: list[_Call] = []
        self.tensors: list[Tensor] = []
        self.kinds: list[str] = []
        self.logged: list[tuple[str, int]] = []
        self.metric_logs: dict[str, int] = {}

    def outputs(self) -> list[Tensor]:
        return list(self.tensors) if self.record else []

    def finish(self, outs: Sequence[Tensor]) -> _MetricStep | None:
        if not self.record:
            return None
        return _MetricStep(
            self.calls, [t.detach() for t in outs], list(self.kinds), list(self.logged), dict(self.metric_logs)
        )

    # ------------------------------------------------------------------ what the model does
    def call(self, index: int, method: str, *args: Any, **kwargs: Any) -> _Pending | None:
        name = self.modules[index][0]
        if self.record:
            spec_args = tuple(self._argument(a, name) for a in args)
            spec_kwargs = {k: self._argument(v, name) for k, v in kwargs.items()}
            self.calls.append(_Call(index, method, spec_args, spec_kwargs))
        if self.constants is not None:
            values = (*enumerate(args), *kwargs.items())
            self.constants.append((index, method, tuple((key, self._constant(v)) for key, v in values)))
        if method in ("forward", "compute"):
            return _Pending(self, self.generation, len(self.calls) - 1, name)
        return None

    def log_value(self, name: str, value: _Pending) -> None:
        """``self.log(name, value)`` of a value a metric returned."""
        if not self.record:
            return
        self._check(value)
        self.logged = [(n, i) for n, i in self.logged if n != name] + [(name, value.index)]

    def log_metric(self, name: str, metric: nn.Module) -> None:
        """``self.log(name, metric)``: the loop computes it at the end of the round."""
        if self.record:
            index = next((i for i, (_, m) in enumerate(self.modules) if m is metric), None)
            if index is not None:
                self.metric_logs.setdefault(name, index)

    def _check(self, value: _Pending) -> None:
        if value.owner is not self or value.generation != self.generation:
            value._refuse("kept from an earlier training_step call")

    def _argument(self, value: Any, name: str) -> tuple[str, Any]:
        if isinstance(value, _Pending):
            self._check(value)
            return ("result", value.index)
        if isinstance(value, Tensor):
            if not _is_batched(value):
                self._refuse_sized(value, name)
                return ("value", value.detach())  # the same for every client
            kind = self._kind(value, name)
            self.tensors.append(value.detach())
            self.kinds.append(kind)
            return ("tensor", len(self.tensors) - 1)
        if value is None or isinstance(value, (bool, int, float, str)):
            return ("value", value)
        raise VectorizationUnsupportedError(
            f"the torchmetrics metric '{name}' is updated in training_step with an argument of type "
            f"{type(value).__name__}, which client_execution='vectorized' cannot record per client (tensors and "
            "Python numbers can be); use client_execution='sequential' (or 'auto')"
        )

    def _refuse_sized(self, value: Tensor, name: str) -> None:
        """Refuse a tensor that is the same for every client but as long as the call's batch of padded or single
        samples (first dimension ``n``, or 1 for one-sample calls): made from the batch's size
        (``torch.ones(len(y))``), it would be replayed whole for every client, where sequential training's has the
        client's own length; a constant of that length by chance is refused too (ours: the two cannot be told apart
        under vmap)."""
        size = self.n if self.rows == "padded" else 1 if self.rows == "cell" else None
        if size is None or value.dim() == 0 or value.shape[0] != size:
            return
        where = f"the padded batch's ({size})" if self.rows == "padded" else "the single sample's (1)"
        raise VectorizationUnsupportedError(
            f"the torchmetrics metric '{name}' is updated in training_step with a tensor of shape "
            f"{tuple(value.shape)} that is the same for every client but whose first dimension is {where} on a "
            "padded step (clients' batches of unequal size): made from the batch's size (torch.ones(len(y)))? "
            "client_execution='vectorized' cannot cut it to a client's real samples; compute it from the batch "
            "(torch.ones_like(y)), or use client_execution='sequential' (or 'auto')"
        )

    def _constant(self, value: Any) -> Any:
        """``value`` (detached), or :data:`_PER_ROW` if it is one value per sample of a batch of :attr:`n` samples or
        one per client (see :data:`_PER_ROW`)."""
        if isinstance(value, Tensor):
            if value.dim() >= 1 and value.shape[0] == self.n:
                return _PER_ROW
            if self.interception is not None and self.interception.cells_of(value) is not None:
                return _PER_ROW
            return value.detach()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return _PER_ROW

    def _kind(self, value: Tensor, name: str) -> str:
        if self.rows == "whole":
            return "row"
        if self.rows == "padded":
            if self.interception is not None and self.interception.cells_of(value) is not None:
                return "row"  # an intercepted loss: already the mean over the client's real samples
            if value.dim() >= 1 and value.shape[0] == self.n:
                return "cut"
            where = "padded to the step's largest batch"
        else:
            if value.dim() >= 1 and value.shape[0] == 1:
                return "cells"
            where = "split into one training_step call per sample"
        raise VectorizationUnsupportedError(
            f"the torchmetrics metric '{name}' is updated in training_step with a tensor of shape "
            f"{tuple(value.shape)} computed from a client's batch {where} (clients' batches of unequal size): "
            "client_execution='vectorized' can replay updates with per-sample tensors (first dimension the batch), "
            "the loss training_step returns, or values the same for every client; use client_execution='sequential' "
            "(or 'auto')"
        )


class _Recorder:
    """One metric method replaced by :meth:`_MetricCalls.call` (a plain callable: no bound-method wrapper)."""

    __slots__ = ("calls", "index", "method")

    def __init__(self, calls: _MetricCalls, index: int, method: str):
        self.calls, self.index, self.method = calls, index, method

    def __call__(self, *args: Any, **kwargs: Any):
        return self.calls.call(self.index, self.method, *args, **kwargs)


def _replay(
    modules: Sequence[tuple[str, nn.Module]],
    steps: Sequence[_MetricStep],
    num_clients: int,
    router: Any = None,
    client_ids: Sequence[int] | None = None,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Make the recorded metric calls of a round outside vmap, client after client, each client's steps in order
    (sequential training's order); values logged from them and metrics logged as objects go to ``router`` (tagged
    with the client, ``client_ids[c]``). The clients at the positions in ``skip`` (left out of the round: a
    non-finite loss or update, or they raised) are not replayed, as sequential training undoes their metric
    updates."""
    if not steps:
        return
    alive = [step.alive.tolist() if step.alive is not None else None for step in steps]
    as_update = [_forward_as_update(m) for _, m in modules]
    owner = getattr(router, "owner", None)
    with torch.enable_grad():  # the router keeps values logged with gradients enabled (not a trial evaluation)
        for c in range(num_clients):
            if c in skip:
                continue
            if router is not None and client_ids is not None:
                router.owner = int(client_ids[c])
            for step, took in zip(steps, alive):
                if took is not None and not took[c]:
                    continue
                tensors = step.client_tensors(c) if step.tensors else []
                results: list[Any] = []
                for i, call in enumerate(step.calls):
                    args = [_resolve(s, tensors, results) for s in call.args]
                    kwargs = {k: _resolve(s, tensors, results) for k, s in call.kwargs.items()}
                    metric = modules[call.metric][1]
                    if call.method == "forward" and (i in step.read or not as_update[call.metric]):
                        results.append(metric(*args, **kwargs))
                    elif call.method == "forward":
                        results.append(metric.update(*args, **kwargs))
                    else:
                        results.append(getattr(metric, call.method)(*args, **kwargs))
                if router is not None:
                    for name, i in step.logged:
                        router.log(name, results[i])
        if router is not None:
            router.owner = owner
            for step in steps:
                for name, i in step.metric_logs.items():
                    router.log(name, modules[i][1])


def _forward_as_update(metric: nn.Module) -> bool:
    """Whether ``metric.update(...)`` leaves the state ``metric(...)`` (``forward``) leaves: torchmetrics' forward
    either updates once and restores that state (``full_state_update``), or merges the batch's state into the global
    one with each state's reduction, which for sums, concatenations, minima and maxima is the update itself."""
    try:
        from torchmetrics import Metric
        from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    if not isinstance(metric, Metric) or metric.dist_sync_on_step:
        return False
    if metric.full_state_update or metric.full_state_update is None:
        return True
    mergeable = (dim_zero_sum, dim_zero_cat, dim_zero_min, dim_zero_max)
    return all(fn in mergeable for fn in metric_reductions(metric).values())


def _resolve(spec: tuple[str, Any], tensors: list[Tensor], results: list[Any]) -> Any:
    kind, value = spec
    if kind == "tensor":
        return tensors[value]
    if kind == "result":
        return results[value]
    return value


def _constants_mismatch(
    names: Sequence[str],
    mine: Sequence[tuple[int, str, tuple]],
    theirs: Sequence[tuple[int, str, tuple]],
    rtol: float,
    atol: float,
) -> tuple[str, str, Any, Any] | None:
    """None if two calls of ``training_step`` (their :attr:`_MetricCalls.constants`) made the same metric calls with
    the same values in the arguments that are not one per sample (numbers and tensors to ``rtol`` / ``atol``), else
    ``(metric, argument, mine, theirs)`` for the first that differs (``argument`` ``""`` and the numbers of calls:
    not the same calls). ``names``: the metrics' names, by index.

    Decision (ours): vectorized training replays such an argument once per step for every client with the value the
    batched call saw, which for a value computed from the batch (its size, a statistic of it) is the padded batch's;
    a mismatch between the padded batch and the real samples is refused where it is found, rather than logged as
    another value than sequential training's."""
    if len(mine) != len(theirs) or any(a[:2] != b[:2] or len(a[2]) != len(b[2]) for a, b in zip(mine, theirs)):
        return names[mine[0][0]] if mine else names[theirs[0][0]], "", len(mine), len(theirs)
    for (index, method, args), (_, _, other) in zip(mine, theirs):
        other_args = dict(other)
        for key, value in args:
            if key not in other_args:
                return names[index], "", len(mine), len(theirs)
            if not _same_constant(value, other_args[key], rtol, atol):
                where = f"argument {key}" if isinstance(key, int) else f"{key}="
                return names[index], f"{method}: {where}", value, other_args[key]
    return None


def _same_constant(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if a is _PER_ROW or b is _PER_ROW:
        return True
    numbers = (Tensor, int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        x, y = torch.as_tensor(a), torch.as_tensor(b)
        if x.shape != y.shape:
            return False
        if x.dtype == torch.bool or y.dtype == torch.bool:
            return torch.equal(x.cpu(), y.cpu())
        x, y = x.detach().cpu().double(), y.detach().cpu().double()
        return bool(torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True))
    return type(a) is type(b) and a == b
