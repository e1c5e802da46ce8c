"""Server strategies as Lightning callbacks with federated hooks.

A strategy decides how client updates become the next global model; following the FedOpt view (Reddi et al.
2021), the server step is an optimizer step on the pseudo-gradient ``Δ``. :class:`ServerStrategy` (weights,
``accumulate``, ``server_update``, ``configure_server_optimizer``; a round's three steps in its docstring),
:func:`accumulate_core` (the sums the loop adds for every strategy), :class:`FederatedCallback` (the federated hooks
with their signatures), :func:`call_federated_hook` (the one dispatcher of the federated hooks) and
:func:`check_hook_names` (near misses of hook names refused at setup). :class:`~fedlightning.state.RoundStatistics`
(summable statistics: one ``all_reduce`` across processes) is re-exported here; it is defined in
:mod:`fedlightning.state` so that :mod:`fedlightning.distributed`, which reduces it, sits below the strategies.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import warnings
from typing import Any, NamedTuple

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from fedlightning._lightning_compat import allow_logging_from, current_hook
from fedlightning._validation import SettingError, one_of, positive
from fedlightning.state import ClientUpdate, RoundPlan, RoundStatistics, squared_norm64, sum_dtype

__all__ = [
    "FEDERATED_HOOKS",
    "FederatedCallback",
    "RoundStatistics",
    "ServerStep",
    "ServerStrategy",
    "accumulate_core",
    "call_federated_hook",
    "check_hook_names",
    "copy_of_state",
]


def copy_of_state(callback: Callback) -> dict[str, Any] | None:
    """A deep copy of ``callback.state_dict()`` to put back later with ``load_state_dict`` (a rollback), or None
    where there is nothing to put back: the class keeps Lightning's empty ``state_dict``, returns an empty one, or
    returns one that cannot be deep-copied (a tensor with autograd history)."""
    if type(callback).state_dict is Callback.state_dict:
        return None
    state = callback.state_dict()
    try:
        return copy.deepcopy(state) if state else None
    except (RuntimeError, TypeError):
        return None


class _RestoreError(SettingError):
    """A callback's state in a checkpoint that its ``load_state_dict`` cannot restore (:func:`_named_restore`): a
    problem of the checkpoint the run resumes from (``ckpt_path``), not of the callback's arguments."""

    def __init__(self, message: str) -> None:
        super().__init__("ckpt_path", message)


def _named_restore(load_state_dict: Any) -> Any:
    """``load_state_dict`` whose failures on the given state name the callback: a ``KeyError``, ``TypeError``,
    ``ValueError``, ``IndexError`` or ``AttributeError`` becomes one :class:`ValueError` (ours; a subclass calling
    ``super().load_state_dict`` is named once)."""

    @functools.wraps(load_state_dict)
    def restore(self: Any, state_dict: Any) -> Any:
        try:
            return load_state_dict(self, state_dict)
        except _RestoreError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            raise _RestoreError(
                f"{type(self).__name__}: the checkpoint's state for this callback cannot be restored "
                f"({type(err).__name__}: {err}); resume from a checkpoint written by a run with this callback"
            ) from err

    restore._named_restore = True  # type: ignore[attr-defined]
    return restore


class FederatedCallback(Callback):
    """A Lightning callback with the FederatedLoop's hooks, declared here with their signatures (all no-ops).

    Derive schedules, client-objective terms and telemetry from it (server strategies derive from
    :class:`ServerStrategy`, which derives from it) and override the hooks you need; the Lightning hooks of
    :class:`~lightning.pytorch.callbacks.Callback` work as usual.

    The federated hooks are declared, with their signatures, on :class:`FederatedCallback` (the base of every server
    strategy and schedule); the FederatedLoop calls them on every callback in ``trainer.callbacks`` that defines them,
    and refuses at setup a callback method whose name is a near miss of a hook name (a misspelled hook never runs).

    A subclass's ``load_state_dict`` that fails on the state a checkpoint holds for it (a missing key, a value of
    another type: a file edited, or written by another version) raises a ``ValueError`` naming the callback and the
    cause (:func:`_named_restore`), not the bare ``KeyError`` of an indexed state.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("load_state_dict")
        if own is not None and not getattr(own, "_named_restore", False):
            cls.load_state_dict = _named_restore(own)

    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        """Before the round's clients train; may change ``plan`` (e.g. ``plan.local_steps``, ``plan.client_lr_scale``,
        with ``local_epochs`` ``plan.client_steps``)."""

    def configure_client_optimizer(
        self, trainer, pl_module, plan: RoundPlan, client_id: int, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer | None:
        """After client ``client_id``'s optimizer was built for ``plan`` (lr scaled, its own client state set), before
        it trains: a strategy may set server-held state into ``optimizer`` (return None) or return an optimizer that
        replaces it for this client (a wrapper over the same parameters). Default: None (unchanged). Like Flower's
        ``configure_fit``: what the server sends each client besides the weights. The client's parameters (the
        optimizer's) must be left as they are: the client starts from the global weights, written after this hook,
        and a hook that changes them stops the run, naming it."""
        return None

    def client_objective(self, trainer, pl_module, plan: RoundPlan, client_id: int) -> list[Any]:
        """Extra loss terms ``f(params) -> Tensor`` added to client ``client_id``'s ``training_step`` loss this round
        (``params``: the client's trainable parameters in ``model.parameters()`` order). Default: none.

        A term of the form ``μ/2‖w − a‖² + ⟨c, w − a⟩`` returned as a :class:`~fedlightning.objectives.AnchoredTerm`
        is evaluated for all vectorised clients at once (stacked, its gradient in closed form); any other callable
        is called client by client inside every vectorised step (said once in the log)."""
        return []

    def on_client_end(self, trainer, pl_module, plan: RoundPlan, update: ClientUpdate) -> None:
        """After a client trained (healthy or failed, see ``update.failed``); may add entries to ``update.payload``
        or mark the update failed. The loop's aggregation checks (update norm, overflow; ``FederatedLoop``'s
        ``max_update_norm``) come after this hook and may still leave a client it saw healthy out of the round."""

    def on_round_end(self, trainer, pl_module, result) -> None:
        """After the server step, with the round's :class:`~fedlightning.state.RoundResult` (metrics, clients)."""


#: The federated hooks, by name (the methods of :class:`FederatedCallback` above).
FEDERATED_HOOKS = ("on_round_start", "configure_client_optimizer", "client_objective", "on_client_end", "on_round_end")

#: Hooks whose previous signature lacked ``trainer``: ``client_objective(loop, plan, client_id)`` and
#: ``on_client_end(loop, plan, update)`` (still called, with a FutureWarning, until the next release).
_LEGACY_SIGNATURES = {"client_objective": "(loop, plan, client_id)", "on_client_end": "(loop, plan, update)"}
_legacy_cache: dict[tuple[type, str], bool] = {}

# ``pl_module.log`` inside a federated hook: in the round hooks (on every process) it logs as in the loop's own
# ``training_step``; in the per-client hooks (``configure_client_optimizer``, ``client_objective``, ``on_client_end``:
# on the process that trains the client) it logs one value per client, reduced over the round's clients of every
# process as the module's ``training_step`` values are (``client/<name>``, its ``reduce_fx``; FederatedLoop)
allow_logging_from(FEDERATED_HOOKS)


def _uses_legacy_signature(callback: Any, name: str, method: Any, num_args: int) -> bool:
    """Whether the bound ``method`` (``callback.<name>``) takes the hook's old ``num_args`` positional arguments
    (``loop`` and the hook's own, no ``trainer``); decided and warned once per class."""
    key = (type(callback), name)
    legacy = _legacy_cache.get(key)
    if legacy is None:
        legacy = False
        if name in _LEGACY_SIGNATURES:
            try:
                params = list(inspect.signature(method).parameters.values())
            except (TypeError, ValueError):  # no signature (a C callable): the current one
                params = []
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
            legacy = not variadic and len(positional) == num_args  # (loop, *args): no trainer
        if legacy:
            warnings.warn(
                f"{type(callback).__name__}.{name}{_LEGACY_SIGNATURES[name]} uses the old signature of this federated "
                f"hook; define {name}(self, trainer, pl_module, ...) instead (every federated hook takes the trainer "
                "and the FederatedLoop first, as Lightning's hooks do). The old signature stops working in the next "
                "release.",
                FutureWarning,
                stacklevel=4,
            )
        _legacy_cache[key] = legacy
    return legacy


def call_federated_hook(trainer: Any, pl_module: Any, name: str, *args: Any) -> list[Any]:
    """Call the federated hook ``name`` of every callback in ``trainer.callbacks`` that defines it, in their order,
    as ``hook(trainer, pl_module, *args)``; return their results in that order.

    As Lightning's own dispatcher (``trainer/call.py``), each call runs with ``pl_module``'s current hook name set to
    ``name`` (so ``pl_module.log`` inside it logs with ``training_step``'s options, the step being the round) and is
    profiled under the Trainer's profiler as ``[Callback]<state_key>.<name>``. A hook with its previous signature
    (no ``trainer``; ``_LEGACY_SIGNATURES``) is called the old way with a one-time ``FutureWarning`` naming the new
    one."""
    results = []
    profiler = trainer.profiler
    for callback in trainer.callbacks:
        method = getattr(callback, name, None)
        if not callable(method):
            continue
        legacy = _uses_legacy_signature(callback, name, method, len(args) + 1)
        with profiler.profile(f"[Callback]{callback.state_key}.{name}"), current_hook(pl_module, name):
            results.append(method(pl_module, *args) if legacy else method(trainer, pl_module, *args))
    return results


def check_hook_names(callback: Any) -> None:
    """Refuse a callback method whose name is a near miss of a federated hook (``on_round_ends``, ``on_client_end_``,
    ``client_objectives``): it would never be called. Lightning's own hook names and public methods of the base
    classes are not checked."""
    known = set(FEDERATED_HOOKS) | {n for n in dir(Callback) if not n.startswith("_")}
    base_names = {n for cls in type(callback).__mro__ if cls.__module__.startswith("lightning.") for n in vars(cls)}
    for cls in type(callback).__mro__:
        if cls in (FederatedCallback, ServerStrategy, Callback, object):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or name in known or name in base_names or not callable(value):
                continue
            close = difflib.get_close_matches(name, FEDERATED_HOOKS, n=1, cutoff=0.85)
            if close:
                raise ValueError(
                    f"{type(callback).__name__}.{name} looks like the federated hook {close[0]!r} misspelled; it would "
                    f"never be called. Rename it to {close[0]} (hooks: {', '.join(FEDERATED_HOOKS)})"
                )


class _ServerStepFields(NamedTuple):
    pseudo_gradient: Tensor
    lr: float | None
    metrics: dict[str, float]


class ServerStep(_ServerStepFields):
    """What :meth:`ServerStrategy.server_update` returns: the flat pseudo-gradient ``Δ`` the server optimizer steps
    on, this round's server learning rate (None: the optimizer's own; an ``lr`` given for one round leaves the
    optimizer's own learning rate for the next) and extra metrics to log (a new empty dict by default). A tuple, so
    strategies may also return ``(pseudo_gradient, lr, metrics)``."""

    __slots__ = ()

    def __new__(cls, pseudo_gradient: Tensor, lr: float | None = None, metrics: dict[str, float] | None = None):
        return super().__new__(cls, pseudo_gradient, lr, {} if metrics is None else metrics)


def accumulate_core(
    strategy: ServerStrategy,
    stats: RoundStatistics,
    update: ClientUpdate,
    weight: float | None = None,
    sq_norm: Tensor | None = None,
) -> None:
    """The round sums every strategy relies on, added by the loop for each healthy client: ``delta`` (Σ w_i Δ_i with
    ``w_i = strategy.client_weight(update)``), ``weight`` (Σ w_i), ``clients``, ``sq_norm_sum`` (Σ‖Δ_i‖²),
    ``weighted_sq_norm_sum`` and, for models with buffers, ``buffers`` (Σ w_i b_i). ``weight`` and ``sq_norm``
    (``‖Δ_i‖²``, :func:`~fedlightning.state.squared_norm64` of ``update.delta``) are computed here unless the caller
    already has them.

    The loop itself accumulates the core round sums (:func:`accumulate_core`: the weighted sum of the clients' deltas,
    the total weight, the number of clients, ``Σ‖Δ_i‖²``, the weighted buffers); a strategy's
    :meth:`ServerStrategy.accumulate` adds only its extras, so a strategy that overrides it without calling ``super()``
    still trains.
    """
    w = strategy.client_weight(update) if weight is None else weight
    delta = update.delta
    stats.add("delta", delta.to(sum_dtype(delta.dtype)) * w)  # float32 for half-precision updates
    stats.add("weight", w, delta.device)
    stats.add("clients", 1.0, delta.device)
    if sq_norm is None:
        sq_norm = squared_norm64(delta)
    stats.add("sq_norm_sum", sq_norm)
    stats.add("weighted_sq_norm_sum", sq_norm * w)
    if update.buffers is not None:
        stats.add("buffers", update.buffers * w)


class ServerStrategy(FederatedCallback):
    """Base class of server strategies. Subclasses override the parts they change.

    A strategy decides how client updates become the next global model. Following the FedOpt view (Reddi et al.
    2021), the server step is an optimizer step on the pseudo-gradient: the strategy

    1. gives every client update a weight and adds what it needs into a :class:`RoundStatistics` (summable
       statistics, so that sharding clients over processes is one ``all_reduce``) — :meth:`ServerStrategy.accumulate`;
    2. turns the reduced statistics into a flat pseudo-gradient ``Δ`` and, optionally, this round's server learning
       rate — :meth:`ServerStrategy.server_update`;
    3. the FederatedLoop writes ``Δ`` into the global parameters' ``.grad`` and steps the optimizer returned by
       :meth:`ServerStrategy.configure_server_optimizer` (FedAvg: SGD(lr=server_lr); FedAdam: Adam; FedExP: SGD
       whose lr is the extrapolated ``η_g`` of the round). Lightning checkpoints that optimizer's state and counts
       rounds as global steps.

    Args:
        server_lr: global learning rate ``η_g`` of the server optimizer.
        weighting: ``"samples"`` weights client ``i`` by its number of training samples ``n_i`` (McMahan et al.
            2017); ``"uniform"`` gives every participating client the same weight (seeds 000, 001 and 004 average
            uniformly).
    """

    #: the defaults of ``__init__`` at class level: a subclass whose ``__init__`` does not call ``super().__init__()``
    #: gets them (FedAvg's), as it gets the base class's methods
    server_lr: float = 1.0
    weighting: str = "samples"

    def __init__(self, server_lr: float = 1.0, weighting: str = "samples"):
        self.server_lr = positive("server_lr", server_lr)
        self.weighting = one_of("weighting", weighting, ("samples", "uniform"))

    # -------------------------------------------------------------- server optimizer
    def configure_server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The server optimizer over the global model's trainable parameters (``params``, fixed for the fit); the
        loop writes each round's pseudo-gradient into their ``.grad`` and steps it, and Lightning checkpoints its
        state. Default: ``SGD(lr=server_lr)``, i.e. ``w ← w − η_g Δ``."""
        return torch.optim.SGD(params, lr=self.server_lr)

    # -------------------------------------------------------------- aggregation
    def client_weight(self, update: ClientUpdate) -> float:
        """The weight ``w_i ≥ 0`` of a healthy client's update in the round's core sums (``Σ w_i Δ_i``, ``Σ w_i``,
        the buffers' average). Default: ``n_i`` (``weighting="samples"``) or 1 (``"uniform"``). A non-finite weight
        leaves the client out with a warning; a negative one, or every client at weight 0, stops the round, naming
        this method."""
        return float(update.num_samples) if self.weighting == "samples" else 1.0

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        """Add this strategy's extra statistics for one healthy client (default: none). ``stats`` is a fresh
        :class:`RoundStatistics` for this client: the loop checks its entries (a non-finite one, or one that could
        overflow the round's sum, leaves the client out of the round, :meth:`RoundStatistics.unsafe_entry`) and then
        adds them to the round's statistics, next to the core sums (:func:`accumulate_core`, weighted with
        :meth:`client_weight`). Calling ``super().accumulate`` is harmless and not required."""

    def mean_delta(self, stats: RoundStatistics) -> Tensor:
        """``Σ w_i Δ_i / Σ w_i`` over the round's healthy clients of every process: the flat weighted mean update in
        the dtype the round sums the updates in (:func:`~fedlightning.state.sum_dtype`: the global parameters', or
        float32 for half-precision ones), laid out as the pseudo-gradient ``server_update`` returns (one entry per
        entry of the trainable parameters, in ``model.parameters()`` order)."""
        return stats["delta"] / stats["weight"].to(stats["delta"].dtype)

    def server_update(
        self, loop, stats: RoundStatistics, plan: RoundPlan
    ) -> tuple[Tensor, float | None, dict[str, float]]:
        """Return the round's :class:`ServerStep` ``(pseudo_gradient, lr_or_None, metrics)``; ``lr=None`` keeps the
        optimizer's own lr. Default: the weighted mean delta (FedAvg)."""
        return ServerStep(self.mean_delta(stats), None, {})

    # -------------------------------------------------------------- state
    @property
    def state_key(self) -> str:
        return f"ServerStrategy[{type(self).__name__}]"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(server_lr={self.server_lr}, weighting={self.weighting!r})"
