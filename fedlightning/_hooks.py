"""How the user's module talks to :class:`~fedlightning.loop.FederatedLoop`: its ``self.log`` calls
(:class:`_LogRouter`: forwarded to the loop on the global model, captured per round during client training) and
the fit-level / evaluation hooks the loop forwards to the global model (``_FORWARDED_HOOKS``).

The loop is seen here as the ``LightningModule`` it is (its ``log`` and its ``model``), without importing
:mod:`fedlightning.loop`, which imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from fedlightning._lightning_compat import attached_trainer, metric_reductions
from fedlightning._logging_route import (
    RoundLogOptions,
    note_round_log_options,
    round_log_options,
    round_log_value,
)

__all__ = ["_FORWARDED_HOOKS", "_LogRouter", "_forward_to_model"]


#: The owner of a value logged outside a client's training (:attr:`_LogRouter.owner`)
NO_CLIENT = -1


class _LogRouter:
    """Replaces ``log`` / ``log_dict`` of a wrapped model instance.

    In ``"forward"`` mode (validation/test on the global model) calls go to the FederatedLoop's own ``self.log``,
    so they reach the loggers and the progress bar exactly as if the user's module were trained directly. In
    ``"capture"`` mode (client training) scalar values are collected and the loop logs their per-round mean under
    ``client/<name>``. A torchmetrics ``Metric`` logged there is a round-level metric: the working copy's metric
    object accumulates every participating client's local steps (each step's batch once: a line search's trial
    evaluations are undone, see :class:`~fedlightning.user_module.MetricStates`), and :meth:`compute_metrics` gives
    its value at the end of the round, after which the loop resets it. Across processes ``Metric.compute`` syncs
    the states (torchmetrics' own distributed reduction).
    """

    def __init__(self, loop: LightningModule, mode: str):
        self.loop_ref = loop
        self.mode = mode
        self.captured: dict[str, list[Tensor]] = {}  # name -> values in logging order: scalars, or 1-d runs of them
        #: name -> the client of each captured entry (an int; a 1-d int64 tensor for a run of values), NO_CLIENT for
        #: values logged outside a client's training (the working copy's epoch hooks)
        self.owners: dict[str, list[int | Tensor]] = {}
        self.owner = NO_CLIENT  # the client whose training runs (set by the loop and the vectorised engine)
        self.metrics: dict[str, Any] = {}  # name -> torchmetrics Metric logged in training_step
        self.options: dict[str, RoundLogOptions] = {}  # name -> its round_log_options (kept over the run)
        self.metric_paths: dict[str, str] = {}  # name -> the metric's module path in the working copy
        #: the module it is installed on: the working copy (capture mode), the global model (forward mode)
        self.module: torch.nn.Module | None = None

    def _not_the_loops(self, model: LightningModule | None) -> bool:
        """Whether ``model`` (the module this forward-mode router is installed on) runs outside the loop: attached
        to another Trainer (a plain ``Trainer.validate(model)`` after or beside federated training) or to none
        while the loop has one; its calls then go to its own class's methods, as without the loop."""
        if model is None:
            return False
        loop_trainer = attached_trainer(self.loop_ref)
        return loop_trainer is None or attached_trainer(model) is not loop_trainer

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.mode == "forward":
            model = self.module
            if self._not_the_loops(model):
                type(model).log(model, name, value, *args, **kwargs)
            else:
                self.loop_ref.log(name, value, *args, **kwargs)
            return
        self.note_options(name, round_log_options(name, args, kwargs))
        if _is_metric(value):
            if name not in self.metrics:
                self.metrics[name] = value
                if self.module is not None:
                    self.metric_paths[name] = next((p for p, m in self.module.named_modules() if m is value), "")
            return
        self.captured.setdefault(name, []).append(round_log_value(name, value))
        self.owners.setdefault(name, []).append(self.owner)

    def note_options(self, name: str, options: RoundLogOptions) -> None:
        """Record how ``name`` is logged (:func:`~fedlightning._logging_route.note_round_log_options`)."""
        note_round_log_options(self.options, name, options)

    def shown_and_hidden(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The ``client/<name>`` keys logged with ``prog_bar=True``, and those logged with ``logger=False``."""
        shown = tuple(f"client/{k}" for k, o in self.options.items() if o.prog_bar)
        hidden = tuple(f"client/{k}" for k, o in self.options.items() if not o.logger)
        return shown, hidden

    @contextmanager
    def owned_by(self, client: int) -> Iterator[None]:
        """Values logged inside the block are ``client``'s."""
        before, self.owner = self.owner, int(client)
        try:
            yield
        finally:
            self.owner = before

    def save_capture(self) -> tuple[dict[str, list], dict[str, list]]:
        """A copy of the captured values and their clients, for :meth:`restore_capture`."""
        return ({k: list(v) for k, v in self.captured.items()}, {k: list(v) for k, v in self.owners.items()})

    def restore_capture(self, saved: tuple[dict[str, list], dict[str, list]]) -> None:
        self.captured, self.owners = saved

    def capture_run(self, name: str, values: Tensor, clients: Tensor) -> None:
        """A 1-d run of values of ``name`` and the client of each (the vectorised engine's round, at once)."""
        self.captured.setdefault(name, []).append(values.reshape(-1))
        self.owners.setdefault(name, []).append(clients.reshape(-1))

    def keep_clients(self, clients: set[int]) -> None:
        """Drop the captured values of every client not in ``clients`` (the round's healthy clients): a client left
        out of the round (non-finite loss or update, screened out, raised) is left out of ``client/<name>`` too, as it
        is of ``train/loss``. Values logged outside a client's training stay."""
        keep = torch.tensor(sorted(clients | {NO_CLIENT}), dtype=torch.long)
        for name, values in list(self.captured.items()):
            owners = self.owners.get(name, [])
            if all(isinstance(o, int) and (o in clients or o == NO_CLIENT) for o in owners):
                continue
            flat = _concat(values)
            who = torch.cat(
                [
                    o.reshape(-1) if isinstance(o, Tensor) else torch.full((v.numel(),), o)
                    for o, v in zip(owners, values)
                ]
            )
            mask = torch.isin(who.to(torch.long), keep).to(flat.device)
            self.captured[name] = [flat[mask]] if bool(mask.any()) else []
            self.owners[name] = [who[mask.cpu()]] if bool(mask.any()) else []

    def log_dict(self, dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if self.mode == "forward" and self._not_the_loops(self.module):
            type(self.module).log_dict(self.module, dictionary, *args, **kwargs)
            return
        for k, v in dictionary.items():
            self.log(k, v, *args, **kwargs)

    def pop_means(self) -> dict[str, float]:
        """``client/<name>``: each name's values of the round reduced with its ``reduce_fx`` (the mean unless the
        call asked for ``"sum"``, ``"max"`` or ``"min"``), in float64 as :meth:`pop_sums`."""
        out = {}
        for k, (reduce, value, count) in self.pop_sums().items():
            out[f"client/{k}"] = value / count if reduce == "mean" else value
        return out

    def pop_sums(self) -> dict[str, tuple[str, float, int]]:
        """``name -> (reduce, value, count)`` of this process's captured values: the float64 sum for ``"mean"`` and
        ``"sum"``, the maximum or minimum for ``"max"`` / ``"min"``, and the number of values; for a reduction over
        processes (:func:`~fedlightning._round.client_log_means`)."""
        out = {}
        for k, v in self.captured.items():
            if v:
                values = _concat(v).double()
                reduce = self.options.get(k, RoundLogOptions()).reduce
                value = values.amax() if reduce == "max" else values.amin() if reduce == "min" else values.sum()
                out[k] = (reduce, float(value), int(values.numel()))
        self.captured, self.owners = {}, {}
        return out

    def compute_metrics(self) -> dict[str, float]:
        """``client/<name>`` for every torchmetrics metric logged in ``training_step`` (in name order, so that every
        process calls ``compute`` — a collective under DDP — in the same order)."""
        out = {}
        for name in sorted(self.metrics):
            value = self.metrics[name].compute()
            if isinstance(value, Tensor) and value.numel() != 1:
                raise ValueError(
                    f"the torchmetrics metric logged as {name!r} in training_step computes a tensor of shape "
                    f"{tuple(value.shape)}; self.log needs a scalar metric"
                )
            out[f"client/{name}"] = float(value)
        return out

    def list_state_layouts(self) -> dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]] | None:
        """``(metric name, state) -> (dtype, shape after the first dimension)`` of the tensors in each list state
        (``dist_reduce_fx="cat"``, e.g. AUROC's scores and targets) of the metrics logged in training_step that holds
        any; None when none of these metrics has a list state (the same on every process: they hold the same
        metrics)."""
        out: dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]] = {}
        found = False
        for name in sorted(self.metrics):
            metric = self.metrics[name]
            for attr in metric_reductions(metric):
                value = getattr(metric, attr)
                if not isinstance(value, list):
                    continue
                found = True
                first = next((t for t in value if isinstance(t, Tensor)), None)
                if first is not None:
                    out[(name, attr)] = (first.dtype, tuple(first.shape[1:]) if first.dim() else ())
        return out if found else None

    def fill_empty_list_states(self, layouts: list[dict[tuple[str, str], tuple[torch.dtype, tuple[int, ...]]]]):
        """Put, into each list state that is empty on this process, an empty tensor of the dtype and trailing shape
        another process's state holds (``layouts``: every process's :meth:`list_state_layouts`).

        Decision (ours): torchmetrics' sync sends, for an empty list state (a process whose clients made no update of
        the metric this round: fewer clients than processes, a client left out), an empty tensor of the metric's
        float dtype, where the other processes send their tensors (int64 targets, ``[N, C]`` scores): the
        all-gather then fails on the mismatch. The empty tensor of the other processes' dtype and shape adds no
        value; the metric is reset at the end of the round."""
        for key in sorted({k for layout in layouts for k in layout}):
            name, attr = key
            metric = self.metrics.get(name)
            if metric is None or getattr(metric, attr):
                continue
            dtype, trailing = next(layout[key] for layout in layouts if key in layout)
            getattr(metric, attr).append(torch.empty((0, *trailing), dtype=dtype, device=metric.device))

    def adopt_metrics(self, paths: dict[str, str]) -> None:
        """Metrics another process logged (a process whose clients have not logged them yet must still compute)."""
        for name, path in paths.items():
            if name not in self.metrics and path and self.module is not None:
                self.metrics[name] = self.module.get_submodule(path)
                self.metric_paths[name] = path

    def reset_metrics(self) -> None:
        for metric in self.metrics.values():
            metric.reset()


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(value, Metric)


#: Hooks of the user's module that run on the global model whenever Lightning calls them on the loop (fit-level and
#: evaluation hooks); training hooks are mapped by client training instead (fedlightning.user_module.ClientHooks).
_FORWARDED_HOOKS = (  # configure_model: FederatedLoop forwards it itself, only for a module that overrides it
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    *(
        f"on_{stage}_{when}"
        for stage in ("validation", "test", "predict")
        for when in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")
    ),
)


def _forward_to_model(name: str):
    def hook(self: LightningModule, *args: Any, **kwargs: Any) -> Any:  # self: the FederatedLoop
        return getattr(self.model, name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"The user's module's ``{name}``, on the global model."
    return hook


def _concat(values: list[Tensor]) -> Tensor:
    """The captured values of one name as one 1-d tensor, in order (0-d values from sequential clients, 1-d runs of
    values from the vectorised engine, which hands over a round's values at once)."""
    if all(v.dim() == 0 for v in values):
        return torch.stack(values)
    return torch.cat([v.reshape(-1) for v in values])
