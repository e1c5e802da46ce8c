"""The user's LightningModule inside federated training: what it sees, which of its hooks run, its optimizer.

The FederatedLoop is the module the Trainer runs; the user's module is its submodule ``loop.model`` (the global
model) and a private working copy trains the clients. This module holds the pieces that make both behave as the
user's code expects from Lightning (docs/your_model.md lists it for users):

* :func:`make_client_copy` turns the working copy into an instance of a thin subclass of the user's class that is
  attached to the Trainer, reports the round as ``global_step`` / ``current_epoch``, and refuses the manual
  optimisation API (``optimizers()``, ``lr_schedulers()``, ``manual_backward()``) with an error naming it: the loop
  runs the client optimizer itself.
* :class:`ClientHooks` lists the per-local-step hooks the user's class overrides (only those are called).
* :class:`ModuleOptimizer` builds the client optimizer from the module's own ``configure_optimizers()``.
* :class:`MetricStates` saves and restores torchmetrics states around a line search's trial evaluations.
* :func:`materialize_lazy_modules` initializes lazy modules (``LazyLinear``, ...) before round 0.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from fedlightning._lightning_compat import (
    BATCH_TRANSFER_HOOKS,
    metric_state,
    parse_configure_optimizers,
    transfer_hook_owners,
)
from fedlightning._logging_route import discard, routed_logging

__all__ = [
    "ClientHooks",
    "FederatedContractError",
    "MetricStates",
    "ModuleOptimizer",
    "STEP_HOOKS",
    "check_optimization_hooks",
    "copy_gradient_hooks",
    "make_client_copy",
    "materialize_lazy_modules",
]


class FederatedContractError(RuntimeError):
    """The user's module uses a part of Lightning's API that federated client training cannot provide."""


_MANUAL_OPTIMIZATION = (
    "{cls}.{name}() is not available during federated client training: the FederatedLoop runs the client "
    "optimizer itself (one optimizer step per local step; define the optimizer in configure_optimizers() or set "
    "model.client_optimizer). Use automatic optimization in training_step (return the loss)."
)


def _refuse(name: str):
    def method(self, *args: Any, **kwargs: Any):
        raise FederatedContractError(_MANUAL_OPTIMIZATION.format(cls=type(self).__qualname__, name=name))

    method.__name__ = name
    return method


def _round_property(doc: str):
    return property(lambda self: self._fl_round, doc=doc)


_CLIENT_CLASSES: dict[type, type] = {}


def _client_class(cls: type) -> type:
    """A subclass of the user's class with the client-training view of the Trainer (cached per class)."""
    sub = _CLIENT_CLASSES.get(cls)
    if sub is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_fl_round": 0,  # the communication round, set by the FederatedLoop before each round
            "global_step": _round_property("The communication round (the number of server steps taken so far)."),
            "current_epoch": _round_property(
                "The communication round: one round is one epoch of client-side training (on_train_epoch_start / "
                "on_train_epoch_end run once per round)."
            ),
            "optimizers": _refuse("optimizers"),
            "lr_schedulers": _refuse("lr_schedulers"),
            "manual_backward": _refuse("manual_backward"),
            "toggle_optimizer": _refuse("toggle_optimizer"),
            "untoggle_optimizer": _refuse("untoggle_optimizer"),
        }
        sub = type(cls.__name__, (cls,), namespace)
        _CLIENT_CLASSES[cls] = sub
    return sub


def make_client_copy(work: pl.LightningModule, trainer: pl.Trainer | None) -> pl.LightningModule:
    """Give the client working copy (a deep copy of the global model) the view of the Trainer that client training
    provides: attached to ``trainer`` (``self.trainer``, ``self.logger``, ``self.device``, ``self.hparams`` work as
    in Lightning), ``global_step`` and ``current_epoch`` equal to the round (set by the loop as ``_fl_round``), and
    the manual-optimisation API refused by name. ``type(work).__name__`` and ``isinstance`` checks are unchanged."""
    work.__class__ = _client_class(type(work))
    work._fl_round = 0
    if trainer is not None:
        work.trainer = trainer  # LightningModule's setter also attaches nested LightningModules
    return work


def copy_gradient_hooks(source: nn.Module, copy: nn.Module) -> None:
    """Register the gradient hooks of ``source``'s parameters (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``) on the same parameters of ``copy``, a deep copy of it: ``copy.deepcopy``
    of a parameter does not copy its hooks, and the clients, which train a deep copy of the module, trained as if
    they were not there. The hooks are the module's own functions (a closure over the module reads the global
    model's attributes, as a hook of plain Lightning reads the trained module's). A parameter of ``copy`` that has
    hooks already keeps them (a torch that copies them)."""
    for p, q in zip(source.parameters(), copy.parameters()):
        if not getattr(q, "_backward_hooks", None):
            for hook in (getattr(p, "_backward_hooks", None) or {}).values():
                q.register_hook(hook)
        if not getattr(q, "_post_accumulate_grad_hooks", None):
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                q.register_post_accumulate_grad_hook(hook)


#: Per-local-step hooks, in the order client training calls them (see :class:`ClientHooks`).
STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)
#: Hooks that need the loss before ``backward``: closure-based optimizers run ``backward`` themselves.
_BACKWARD_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


#: Lightning hooks of the optimization step that client training does not call (it runs the step itself), with
#: what does the same job here.
_OPTIMIZATION_HOOKS = {
    "optimizer_step": "change the client optimizer's param groups in on_before_optimizer_step (a warm-up) or "
    "return an lr scheduler from configure_optimizers() (stepped once per round)",
    "optimizer_zero_grad": "client training clears the gradients before every local step; use on_before_zero_grad",
    "configure_gradient_clipping": "set FederatedLoop(client_grad_clip=...) or clip in on_before_optimizer_step",
    "backward": "client training calls loss.backward() itself; use on_before_backward / on_after_backward",
}


def check_optimization_hooks(model: nn.Module) -> None:
    """Refuse a module that overrides a hook of Lightning's optimization step (:data:`_OPTIMIZATION_HOOKS`):
    client training runs ``zero_grad``, ``backward``, clipping and ``step`` itself (:class:`ClientHooks` lists the
    hooks it calls), so such an override would be silently skipped and train otherwise than in plain Lightning."""
    if not isinstance(model, pl.LightningModule):
        return
    for hook, instead in _OPTIMIZATION_HOOKS.items():
        if is_overridden(hook, model, pl.LightningModule):
            raise ValueError(
                f"{type(model).__qualname__} overrides {hook}(), which federated client training does not call (the "
                f"FederatedLoop runs each local step's optimization itself); {instead}"
            )


class ClientHooks:
    """The per-local-step hooks that ``model``'s class overrides; client training calls only these. The batch-transfer
    hooks that the client's ``datamodule`` overrides win over the module's, as in Lightning.

    Mapping (one local step of one client = one Lightning training batch), in call order::

        batch = on_before_batch_transfer(batch, 0) -> transfer_batch_to_device(batch, device, 0)
                -> on_after_batch_transfer(batch, 0)      # only if one of the three is overridden
        on_train_batch_start(batch, k)        # returning -1 ends this client's local steps for the round
        loss = training_step(batch, k)
        on_before_zero_grad(optimizer); gradients cleared
        on_before_backward(loss); loss.backward(); on_after_backward()
        on_before_optimizer_step(optimizer)   # before client gradient clipping, as in Lightning
        optimizer.step()
        on_train_batch_end(outputs, batch, k) # outputs: what training_step returned (its loss detached)

    ``k`` is the local step index (the ``batch_idx`` training_step receives). This is Lightning's order for automatic
    optimization (its closure zeroes the gradients after ``training_step``). With a closure-based client optimizer
    (``requires_closure``: SgdArmijo, SPS, DecSPS) the optimizer runs ``training_step`` and ``backward`` itself,
    possibly several times per step, and ``on_before_zero_grad`` runs once before its step; overriding
    ``on_before_backward`` / ``on_after_backward`` / ``on_before_optimizer_step`` is then refused at setup
    (:meth:`check_optimizer`) rather than called at a different point than Lightning documents.
    """

    def __init__(self, model: nn.Module, datamodule: Any = None):
        self.overridden = tuple(h for h in STEP_HOOKS if is_overridden(h, model, pl.LightningModule))
        # the batch-transfer hooks of the data module that win over the module's (Lightning's rule); the data module
        # held by a weak reference: a deep copy of the model (a user's callback keeping one) copies no data module
        owners = transfer_hook_owners(model, datamodule)
        self.data_overridden = tuple(n for n in BATCH_TRANSFER_HOOKS if owners[n] is datamodule)
        self._datamodule = None if datamodule is None else weakref.ref(datamodule)
        o = set(self.overridden)
        self.batch_start = "on_train_batch_start" in o
        self.transfer = bool(o & set(BATCH_TRANSFER_HOOKS)) or bool(self.data_overridden)
        self.zero_grad = "on_before_zero_grad" in o
        self.before_backward = "on_before_backward" in o
        self.after_backward = "on_after_backward" in o
        self.before_step = "on_before_optimizer_step" in o
        self.batch_end = "on_train_batch_end" in o
        self.any = bool(self.overridden or self.data_overridden)
        # once per round on the client copy (called by the loop; not per-step hooks, so not part of ``any``)
        self.epoch_start = is_overridden("on_train_epoch_start", model, pl.LightningModule)
        self.epoch_end = is_overridden("on_train_epoch_end", model, pl.LightningModule)

    def check_optimizer(self, optimizer: torch.optim.Optimizer, model_name: str) -> None:
        if not getattr(optimizer, "requires_closure", False):
            return
        bad = [h for h in _BACKWARD_HOOKS if h in self.overridden]
        if bad:
            raise ValueError(
                f"{model_name} overrides {', '.join(bad)}, which client training cannot call with the closure-based "
                f"client optimizer {type(optimizer).__name__} (it runs backward itself, several times per line "
                "search); remove the hook or use a torch.optim client optimizer"
            )

    def describe(self, model_name: str) -> str:
        """The overridden per-step hooks, by owner (for messages)."""
        parts = [f"{model_name} overrides the per-step hook(s) {', '.join(self.overridden)}"] if self.overridden else []
        if self.data_overridden:
            parts.append(
                f"the data module {type(self.datamodule).__name__} overrides the batch-transfer hook(s) "
                f"{', '.join(self.data_overridden)}"
            )
        return " and ".join(parts)

    @property
    def datamodule(self) -> Any:
        """The data module whose batch-transfer hooks these are (None: the module's only)."""
        return None if self._datamodule is None else self._datamodule()

    def transfer_batch(self, model: pl.LightningModule, batch: Any) -> Any:
        dm = self.datamodule if self.data_overridden else None
        owner = {n: dm for n in self.data_overridden} if dm is not None else {}
        batch = owner.get("on_before_batch_transfer", model).on_before_batch_transfer(batch, 0)
        batch = owner.get("transfer_batch_to_device", model).transfer_batch_to_device(batch, model.device, 0)
        return owner.get("on_after_batch_transfer", model).on_after_batch_transfer(batch, 0)


# ====================================================================== the module's own optimizer
class ModuleOptimizer:
    """Client optimizer factory from the user module's ``configure_optimizers()`` (``client_optimizer`` omitted).

    Every return form Lightning accepts is parsed by Lightning's own parser: an optimizer, a list or tuple with one
    optimizer, ``([optimizer], [scheduler])``, a dict with ``optimizer`` and optional ``lr_scheduler`` (a scheduler
    or a scheduler dict with ``monitor``, ``frequency``, ``strict``), a list of such dicts. Decisions:

    * Several optimizers are refused (one client optimizer per local step; ours).
    * A *template* is built once on the global model; its learning-rate scheduler(s) are stepped once per round by
      :meth:`step_schedulers` (a round is the scheduler's step and epoch alike; ``frequency`` counts rounds;
      ``ReduceLROnPlateau`` reads its ``monitor`` from the round's metrics, or from the validation after the round,
      see :meth:`step_schedulers`). The round's client optimizers
      use the template's current param-group hyper-parameters, so round ``r`` trains with the learning rate after
      ``r`` scheduler steps. The template's groups and the schedulers are checkpointed (:meth:`state_dict`). A
      module that overrides ``lr_scheduler_step`` (schedulers outside ``torch.optim``) has it called for each step,
      with the monitored value or None, as Lightning calls it.
    * Each client's optimizer is rebuilt by calling ``configure_optimizers()`` on the client working copy (so every
      constructor argument, parameter group and custom optimizer class is exactly the user's), then given the
      template's hyper-parameters; a scheduler built there is discarded. The loop may reuse and reset a
      ``torch.optim`` optimizer between sequential clients exactly as with ``client_optimizer``.
    """

    def __init__(self, model: pl.LightningModule):
        self.model_name = type(model).__qualname__
        # Lightning's hook for schedulers outside torch.optim (timm's take an epoch): called as Lightning calls it
        self._lr_scheduler_step = (
            model.lr_scheduler_step if is_overridden("lr_scheduler_step", model, pl.LightningModule) else None
        )
        optimizer, self.schedulers = self._parse(model)
        self.template = optimizer
        self._warn_step_interval()
        self._modules: list[tuple[Tensor, pl.LightningModule]] = [(self._first_param(model), model)]
        # (scheduler index, round) of ReduceLROnPlateau steps waiting for the validation after their round
        self.waiting: list[tuple[int, int]] = []
        # (round, the template's hyper-parameters that round trained with), kept when the schedulers step after it
        self.trained: tuple[int, list[dict[str, Any]]] | None = None

    # ------------------------------------------------------------------ parsing
    def _parse(self, model: pl.LightningModule):
        conf = model.configure_optimizers()
        if conf is None:
            raise ValueError(
                f"{self.model_name}.configure_optimizers() returned None and model.client_optimizer is not set: "
                "there is no client optimizer; return one from configure_optimizers() or set model.client_optimizer"
            )
        try:
            optimizers, configs = parse_configure_optimizers(conf)
        except Exception as err:  # Lightning's MisconfigurationException: name the method
            raise ValueError(f"{self.model_name}.configure_optimizers(): {err}") from err
        if len(optimizers) != 1:
            raise ValueError(
                f"{self.model_name}.configure_optimizers() returned {len(optimizers)} optimizers; federated client "
                "training uses exactly one client optimizer (return one, or set model.client_optimizer)"
            )
        for cfg in configs:
            if cfg.scheduler.optimizer is not optimizers[0]:
                raise ValueError(
                    f"{self.model_name}.configure_optimizers(): a scheduler is not attached to its optimizer"
                )
        return optimizers[0], configs

    def _warn_step_interval(self) -> None:
        """A scheduler configured with ``interval: "step"`` steps once per round, as one with ``"epoch"`` does: the
        global model takes one step per round (``global_step`` counts rounds), and the clients' local steps do not
        step the module's schedulers. In plain Lightning ``"step"`` means every training batch (a warm-up over
        batches, OneCycle), so a module written for it would now schedule over rounds: a warning says so once, at
        the fit's start (ours)."""
        stepwise = [type(cfg.scheduler).__name__ for cfg in self.schedulers if cfg.interval == "step"]
        if stepwise:
            rank_zero_warn(
                f"{self.model_name}.configure_optimizers(): {', '.join(stepwise)} has interval 'step', which steps "
                "it once per round, as 'epoch' does: a round is one step of the global model (trainer.global_step "
                "counts rounds), and the clients' local steps do not step the module's schedulers; a schedule over "
                "local steps (warm-up, OneCycle) would need its length and frequency in rounds"
            )

    @staticmethod
    def _first_param(model: nn.Module) -> Tensor | None:
        return next((p for p in model.parameters() if p.requires_grad), None)

    def register(self, model: pl.LightningModule) -> None:
        """Make ``model`` (a copy of the global model: the client working copy) buildable by :meth:`__call__`, in
        place of the copy registered before (the loop has one working copy; a new fit whose trainable parameters
        differ builds a new one)."""
        self._modules = [self._modules[0], (self._first_param(model), model)]

    # ------------------------------------------------------------------ the factory
    def __call__(self, params: Sequence[Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        first = params[0] if params else None
        model = next((m for p, m in self._modules if p is first), None)
        if model is None and first is not None and first is self._first_param(self._modules[0][1]):
            model = self._modules[0][1]  # the global model, whose first trainable parameter changed between fits
        if model is None:
            raise ValueError(
                f"the client optimizer comes from {self.model_name}.configure_optimizers() and can only be built for "
                "the global model or its client working copy"
            )
        opt = self.template if model is self._modules[0][1] else self._parse(model)[0]
        if opt is not self.template:
            if len(opt.param_groups) != len(self.template.param_groups):
                raise ValueError(
                    f"{self.model_name}.configure_optimizers() returned {len(opt.param_groups)} parameter groups on "
                    f"the client copy but {len(self.template.param_groups)} on the global model"
                )
            for group, tmpl in zip(opt.param_groups, self.template.param_groups):
                for k, v in tmpl.items():
                    if k != "params":
                        group[k] = v.clone() if isinstance(v, Tensor) else v
        return opt

    # ------------------------------------------------------------------ schedule
    def step_schedulers(self, round: int, metrics: dict[str, Any]) -> bool:
        """Step the schedulers after round ``round`` (0-based) with the round's own ``metrics``; True if any learning
        rate may have changed.

        Decision (ours, Lightning's order): a ``ReduceLROnPlateau`` whose ``monitor`` the round's metrics do not hold
        (a metric of the global model's validation, e.g. ``val_loss``) waits for the validation that follows the
        round and is stepped with that validation's value (:meth:`step_after_validation`), as plain Lightning steps
        such a scheduler after the epoch's validation. Where no validation ran after the round (validation every
        n rounds), the next round's end finds it still waiting: ``strict`` (the default) stops the run naming the
        monitor, ``strict: False`` skips the step, as Lightning skips a monitor it does not find."""
        self._expire_waiting(metrics)
        if self.schedulers:  # without schedulers the template's hyper-parameters are every round's
            self.trained = (int(round), self._hyperparameters())
        stepped = False
        for index, cfg in enumerate(self.schedulers):
            if (round + 1) % max(int(cfg.frequency), 1):
                continue
            if cfg.reduce_on_plateau:
                value = metrics.get(cfg.monitor)
                if value is None:
                    self.waiting.append((index, round))
                    continue
                self._step(cfg, float(value))
            else:
                self._step(cfg, None)
            stepped = True
        return stepped

    def _step(self, cfg: Any, metric: float | None) -> None:
        """One step of ``cfg``'s scheduler: the module's ``lr_scheduler_step(scheduler, metric)`` where it overrides
        it, else Lightning's default (``step()``, or ``step(metric)`` for a monitored one)."""
        with warnings.catch_warnings():
            # the template optimizer never steps (each client's own optimizer does), so torch's "scheduler stepped
            # before optimizer.step()" warning would be spurious for every module with a scheduler
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            if self._lr_scheduler_step is not None:
                self._lr_scheduler_step(cfg.scheduler, metric)
            elif metric is None:
                cfg.scheduler.step()
            else:
                cfg.scheduler.step(metric)

    def step_after_validation(self, metrics: dict[str, Any]) -> bool:
        """Step the ``ReduceLROnPlateau`` schedulers waiting for this validation (:meth:`step_schedulers`) with its
        ``metrics`` (``trainer.callback_metrics``); True if any stepped. A monitor missing here too is an error under
        ``strict`` (naming the metrics there are), else skipped."""
        stepped = False
        for index, round in self.waiting:
            cfg = self.schedulers[index]
            value = metrics.get(cfg.monitor)
            if value is None:
                if cfg.strict:
                    self.waiting = []
                    raise ValueError(
                        f"{self.model_name}.configure_optimizers(): ReduceLROnPlateau monitors {cfg.monitor!r}, "
                        f"which is neither among round {round}'s metrics nor among the metrics after its validation "
                        f"{sorted(metrics)}; set 'strict': False to skip rounds without it"
                    )
                continue
            self._step(cfg, float(value))
            stepped = True
        self.waiting = []
        return stepped

    def _expire_waiting(self, metrics: dict[str, Any]) -> None:
        """Steps still waiting at the next round's end (whose ``metrics`` are the round metrics there are): no
        validation ran after their round."""
        waiting, self.waiting = self.waiting, []
        for index, round in waiting:
            cfg = self.schedulers[index]
            if cfg.strict:
                own = sorted(k for k in metrics if k.startswith("train/"))
                hint = f"one of the round's metrics such as {own[-1]!r}" if own else "a metric of the round"
                raise ValueError(
                    f"{self.model_name}.configure_optimizers(): ReduceLROnPlateau monitors {cfg.monitor!r}, which is "
                    f"not among round {round}'s metrics, and no validation ran after round {round} to give it: "
                    f"validate after every round the scheduler steps at (trainer.val_check_interval), monitor {hint} "
                    "(or client/<name> for a value your training_step logs as <name>), or set 'strict': False to "
                    "skip rounds without it"
                )

    def _hyperparameters(self) -> list[dict[str, Any]]:
        """A copy of the template's param-group hyper-parameters (every key but ``params``)."""
        return [
            {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in self.template.param_groups
        ]

    def hyperparameters_of_round(self, round: int) -> list[dict[str, Any]]:
        """The param-group hyper-parameters (every key but ``params``; a copy) that round ``round``'s client
        optimizers trained with: those kept when the schedulers stepped after that round, else the template's
        current ones (its schedulers have not stepped since). A client-side evaluation of the model after round
        ``r`` that trains (``ClientEvaluation(local_steps=k)``) uses them, so that it trains alike whether it runs at
        the round's end or after fit, when the schedulers have stepped once more."""
        if self.trained is not None and self.trained[0] == int(round):
            return copy.deepcopy(self.trained[1])
        return self._hyperparameters()

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.template.param_groups]
        return {
            "param_groups": groups,
            "schedulers": [c.scheduler.state_dict() for c in self.schedulers],
            "waiting": [list(w) for w in self.waiting],
            "trained": None if self.trained is None else [self.trained[0], self.trained[1]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = state.get("param_groups", [])
        if len(groups) != len(self.template.param_groups) or len(state.get("schedulers", [])) != len(self.schedulers):
            raise ValueError(
                f"the checkpoint's client optimizer ({len(groups)} parameter groups, "
                f"{len(state.get('schedulers', []))} schedulers) does not match "
                f"{self.model_name}.configure_optimizers() ({len(self.template.param_groups)} groups, "
                f"{len(self.schedulers)} schedulers)"
            )
        for g, saved in zip(self.template.param_groups, groups):
            g.update(saved)
        for cfg, saved in zip(self.schedulers, state["schedulers"]):
            cfg.scheduler.load_state_dict(saved)
        trained = state.get("trained")
        self.trained = (int(trained[0]), list(trained[1])) if trained else None
        # a checkpoint written between a round's end and the end of its validation (``validation_pending``: the
        # rounds done then, put in by the loop): Lightning does not run that validation again on resume, so the step
        # that waited for it is skipped, with a warning. A step waiting after a round no validation follows keeps
        # waiting, and the next round's end expires it as in the uninterrupted run
        pending = state.get("validation_pending")
        waiting = [(int(i), int(r)) for i, r in state.get("waiting", [])]
        self.waiting = [(i, r) for i, r in waiting if pending is None or r + 1 != int(pending)]
        for index, round in waiting:
            if pending is None or round + 1 != int(pending):
                continue
            rank_zero_warn(
                f"{self.model_name}.configure_optimizers(): the checkpoint was written before the validation after "
                f"round {round} ended, and a resumed run does not run it again: ReduceLROnPlateau (monitor "
                f"{self.schedulers[index].monitor!r}) is not stepped for round {round}"
            )


# ====================================================================== torchmetrics around trial evaluations
class MetricStates:
    """Snapshot and restore of every torchmetrics ``Metric`` in a model.

    A line search evaluates ``training_step`` at trial points (without gradients); a metric updated there would count
    each of those batches again. The client's trial closure saves the metric states before such a call and restores
    them after, as it does for buffers, so a metric sees each local step's batch once, at the gradient evaluation.
    """

    def __init__(self, model: nn.Module):
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            self.metrics: list[Any] = []
            return
        self.metrics = [m for m in model.modules() if isinstance(m, Metric)]

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def save(self) -> list[tuple[Any, dict[str, Any]]]:
        return [(m, metric_state(m)) for m in self.metrics]

    @staticmethod
    def restore(saved: list[tuple[Any, dict[str, Any]]]) -> None:
        for m, state in saved:
            for k, v in state.items():
                setattr(m, k, v)


# ====================================================================== lazy modules
class _LazyModulesReady(Exception):
    """Raised by the last lazy module's forward pre-hook: its parameters are initialized, the dry run may stop."""


def _lazy_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch.nn.modules.lazy import LazyModuleMixin

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]


def materialize_lazy_modules(model: pl.LightningModule, batch: Any, seed: int) -> list[str]:
    """Initialize ``model``'s lazy modules (``LazyLinear``, ``LazyConv2d``, ``LazyBatchNorm``, ...) from one batch;
    returns their names (empty: the model has none, nothing is run).

    Plain Lightning initializes them in the first ``training_step``, after the optimizer was built on the
    uninitialized parameters. Federated training copies, stacks and averages the global weights before any client
    step, so they must have their shapes first. Decision (ours): before round 0, ``training_step`` runs once on
    ``batch`` (the first client's first batch, as its local step would receive it) in eval mode, without gradients,
    with ``self.log`` discarded, torchmetrics states restored afterwards, and the random state forked and seeded by
    ``seed`` (the lazy modules' initial values come from it, so a run is reproducible from its seed and resuming
    overwrites them from the checkpoint); the run stops as soon as the last lazy module has its parameters, so
    nothing after it in ``training_step`` runs (eval mode: no BatchNorm statistic is updated before it either).
    A lazy module that ``training_step`` does not reach stays uninitialized: a ValueError names it and asks for a
    dummy forward in ``__init__`` or ``configure_model`` (what DDP needs too)."""
    lazy = _lazy_modules(model)
    if not lazy:
        return []
    names = [n for n, _ in lazy]
    waiting = {id(m) for _, m in lazy}

    def initialized(module: nn.Module, args: Any) -> None:  # registered after the module's own initialization hook
        waiting.discard(id(module))
        if not waiting:
            raise _LazyModulesReady

    handles = [m.register_forward_pre_hook(initialized) for _, m in lazy]
    metrics = MetricStates(model)
    saved = metrics.save()
    modes = [(m, m.training) for m in model.modules()]  # put back module by module: a frozen layer stays so
    devices = [p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"][:1]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), routed_logging(model, discard, discard):
            torch.default_generator.manual_seed(seed)  # the forked generators only (torch.manual_seed: every GPU's)
            for d in devices:
                torch.cuda.default_generators[d].manual_seed(seed)
            model.training_step(batch, 0)
    except _LazyModulesReady:
        pass
    except Exception as err:
        raise RuntimeError(
            f"{type(model).__qualname__} has lazy modules ({', '.join(names)}); initializing them by one "
            f"training_step on the first client's first batch raised {type(err).__name__}: {err}. Initialize them "
            "with a dummy forward in __init__ or configure_model"
        ) from err
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training
        metrics.restore(saved)
    left = [n for n, _ in _lazy_modules(model)]
    if left:
        raise ValueError(
            f"{type(model).__qualname__}'s lazy modules {', '.join(left)} are still uninitialized after one "
            "training_step: training_step does not use them. Federated training needs every parameter's shape "
            "before round 0; initialize them with a dummy forward in __init__ or configure_model"
        )
    return names
