"""FederatedLoop: the LightningModule that trains any user LightningModule federatedly.

One ``training_step`` is one communication round (``trainer.max_steps`` = number of rounds), a template of five
phases (the parts they use: :mod:`fedlightning._round`)::

    _plan_round      plan = RoundPlan from the data module's seeded sampler; on_round_start (KDecay sets K here)
    _train_clients   for client in this process's share of plan.client_ids:
                         update = K local steps from w_t on the client's loader   # sequential or vectorised
                         on_client_end(trainer, loop, plan, update)
                         RoundTally.admit: aggregation checks, core sums + strategy.accumulate (or left out)
    _close_clients   all_reduce(stats) across processes; the failure policy's stops
    _step_server     Δ, η = strategy.server_update(loop, stats, plan); .grad <- Δ; server_optimizer.step()
                     (FedOpt view; Lightning counts the round; a non-finite result is undone and stops the run)
    _end_round       on_round_end(trainer, loop, result); client metrics; logging; client schedulers
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import operator
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor
from torch.nn.parameter import is_lazy

from fedlightning._hooks import _FORWARDED_HOOKS, _forward_to_model, _LogRouter
from fedlightning._lightning_compat import (
    BATCH_TRANSFER_HOOKS,
    align_logged_step,
    attached_trainer,
    checkpoint_every_n_epochs,
    defer_sigterm,
    detached_trainer,
    early_stopping_at_epoch_end,
    evaluation_batch,
    log_hyperparameters_like,
    logged_at_last_round,
    note_sigterm,
    reopen_ended_epoch,
    reopen_finished_fit,
    saved_step,
    settle_unprocessed_batch,
    skip_validation_of_timed_stop,
    spawns_processes,
    strategy_optimizers,
    timer_interval,
    transfer_hook_owners,
    unsynced_metrics,
    validation_follows,
)
from fedlightning._logging_route import route_logging, routed_logging
from fedlightning._reference import reference_mode
from fedlightning._round import (
    FailurePolicy,
    RoundTally,
    align_metric_list_states,
    client_log_means,
    log_round,
    reduce_statistics,
    server_step,
    share_round_state,
)
from fedlightning._validation import (
    SettingError,
    check_fit_callbacks,
    check_fit_settings,
    check_half_precision_eps,
    check_learning_rates,
    check_loss_scaling,
    check_refused_callbacks,
    check_step_settings,
    integer,
    one_of,
    positive,
)
from fedlightning.callbacks.base import (
    FEDERATED_HOOKS,
    FederatedCallback,
    RoundStatistics,
    ServerStrategy,
    call_federated_hook,
    check_hook_names,
)
from fedlightning.callbacks.fedavg import FedAvg
from fedlightning.callbacks.feddane import client_full_batches, client_full_gradient, client_full_rows
from fedlightning.callbacks.progress import round_bar_for
from fedlightning.checkpoint import (
    SIGTERM_EXIT_STATUS,
    AtomicCheckpointIO,
    CheckpointError,
    check_resumable,
    load_global_model,
    load_non_persistent_buffers,
    non_persistent_buffers,
)
from fedlightning.client import LocalTrainer
from fedlightning.datamodules.base import FederatedDataModule, WholeSplitSampler
from fedlightning.distributed import named_collective
from fedlightning.execution import CLIENT_EXECUTION_MODES, make_executor
from fedlightning.optim import scale_client_step
from fedlightning.state import (
    ClientStateStore,
    ClientUpdate,
    RoundPlan,
    RoundResult,
    derive_seed,
    flat_params,
)
from fedlightning.user_module import (
    ClientHooks,
    MetricStates,
    ModuleOptimizer,
    check_optimization_hooks,
    copy_gradient_hooks,
    make_client_copy,
    materialize_lazy_modules,
)
from fedlightning.vectorized import VectorizationUnsupportedError, VectorizedClientTrainer

__all__ = ["FederatedLoop", "check_launcher"]

# The FederatedLoop's optimizer step *is* the round: a checkpoint after it holds the new global model, as intended.
warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]


@dataclass
class _Runtime:
    """What a :class:`FederatedLoop` keeps per process besides its checkpointed state: built on first use, never
    a registered submodule or buffer (so it is neither moved with the loop by ``.to()``, nor saved in its
    ``state_dict``, nor walked by ``named_modules``), and not checkpointed.
    """

    #: the client working copy (a deep copy of the global model) and its LocalTrainer
    worker: LocalTrainer | None = None
    #: the client optimizer factory built from the module's configure_optimizers() (client_optimizer None)
    module_optimizer: Any | None = None
    #: its checkpointed state, when a checkpoint was loaded before the factory existed
    pending_module_optimizer_state: dict[str, Any] | None = None
    #: ``(params, optimizer, param-group snapshot, factory)`` of the torch.optim optimizer reset between
    #: sequential clients (:meth:`FederatedLoop._make_client_optimizer`)
    reusable_client_opt: tuple[Any, torch.optim.Optimizer, list[dict[str, Any]], Any] | None = None
    #: the same for the vectorised clients of a group, one per position in the group (all live during the round)
    reusable_group_opts: dict[int, tuple[Any, torch.optim.Optimizer, list[dict[str, Any]], Any]] = field(
        default_factory=dict
    )
    #: the buffer :meth:`fedlightning._round.RoundTally.admit_all` keeps across rounds
    admit_scratch: dict[str, Tensor] = field(default_factory=dict)
    #: ``(callbacks' ids, hooks)``: the federated hooks some callback defines itself this round
    #: (:meth:`FederatedLoop._federated_hook`)
    hooks_in_use: tuple[tuple[int, ...], frozenset[str]] | None = None
    #: ``(round, params, buffers)`` of the global model (:meth:`FederatedLoop._round_tensors`)
    round_tensors: tuple[int, list[Tensor], list[Tensor]] | None = None
    #: a round has ended and the validation Lightning may run after it has not (FederatedLoop._validation_pending)
    before_validation: bool = False
    #: this process received SIGTERM during the fit (several processes: :meth:`FederatedLoop._defer_sigterm`)
    sigterm_received: bool = False
    #: the round at whose end every process stops on SIGTERM, once they have agreed on it
    sigterm_round: int | None = None
    #: ``(round, lr)``: the first parameter group's learning rate of the last client optimizer built
    #: (:meth:`FederatedLoop.prepare_client`), logged as ``client/lr``; lr None when that group has no ``lr``
    client_lr: tuple[int, float | None] | None = None
    #: the vectorised engine of :meth:`FederatedLoop.client_full_gradients` while the executor has none
    full_gradient_engine: Any | None = None
    #: why :meth:`FederatedLoop.client_full_gradients` computes client by client for this run (None: it need not)
    full_gradient_fallback: str | None = None
    #: ``(round, client ids)``: the clients whose full gradient raised in that round under ``on_client_error="skip"``
    #: (:meth:`FederatedLoop.full_gradient_errors`)
    full_gradient_raised: tuple[int, frozenset[int]] = (-1, frozenset())
    #: the global model's torchmetrics metrics computing without a sync, during a whole-split evaluation with
    #: several processes (:meth:`FederatedLoop._begin_evaluation`)
    evaluation: contextlib.ExitStack | None = None
    #: ``(client, torchmetrics states before it trained)`` of the last sequential client
    #: (:meth:`FederatedLoop.train_client`), put back when the round leaves that client out
    metrics_before: tuple[int, list] | None = None
    #: the global model's trainable parameters at the fit's first round (:meth:`FederatedLoop._check_trainable`)
    trainable: list[torch.nn.Parameter] | None = None
    #: a round of the current fit has trained (:meth:`FederatedLoop._begin_fit`)
    fitted: bool = False
    #: the round that has started and not reached its end (an error stopped the fit inside it), else None
    open_round: int | None = None
    #: client-state entries a fit at round 0 cleared from a used loop (said in on_fit_start), else None
    new_run_entries: int | None = None
    #: the server optimizer the loop's ``configure_optimizers`` built last, and the one a fit that continues the
    #: Trainer's run takes the state of (:meth:`FederatedLoop._begin_fit`)
    server_optimizer: torch.optim.Optimizer | None = None
    continued_server_optimizer: torch.optim.Optimizer | None = None
    #: the step context of a test after fit (:meth:`FederatedLoop._test_at_last_round`)
    test_step_context: Any | None = None


#: The user's step hook that ``Trainer.<stage>`` needs on the global model, as Lightning requires it of a plain
#: module (``predict_step`` has a default there, the module's forward; fit's validation is Lightning's own choice).
_EVALUATION_STEPS = {"validate": "validation_step", "test": "test_step"}
#: each federated callback's ``state_dict`` when a fit at round 0 first met it, put back at its next such fit
#: (:meth:`FederatedLoop._begin_fit`)
_INITIAL_CALLBACK_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PassRoundPlan:
    """A batch-transfer hook (the data module's, or the user's module's forwarded by the loop) that hands the round's
    :class:`RoundPlan` (the loop's training "batch") back untouched and every other batch to ``hook``
    (:meth:`FederatedLoop._guard_data_transfer_hooks`, :meth:`FederatedLoop._forward_batch_transfer_hooks`). A
    class, not a closure, so the data module still pickles; ``__wrapped__`` (the hook's own function, for Lightning's
    ``is_overridden``, which unwraps one level) keeps the hook overridden."""

    def __init__(self, hook: Callable[..., Any]):
        self.hook = hook
        self.__wrapped__ = getattr(hook, "__wrapped__", hook)

    def __call__(self, batch: Any, *args: Any) -> Any:
        return batch if isinstance(batch, RoundPlan) else self.hook(batch, *args)


#: The federated hooks called once per client, on the process that trains it (their second argument names the client:
#: its id, or its ``ClientUpdate``).
_PER_CLIENT_HOOKS = ("configure_client_optimizer", "client_objective", "on_client_end")


def _install_safe_checkpoint_io(trainer: pl.Trainer) -> None:
    """:class:`~fedlightning.checkpoint.AtomicCheckpointIO` in place of Lightning's default checkpoint IO (see
    :class:`FederatedLoop`, "Checkpoint files"). ``setup`` runs before Lightning reads ``ckpt_path`` (``fit``,
    ``validate``, ``test``, ``predict``), so that read is the safe one too."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is not None and type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


class FederatedLoop(pl.LightningModule):
    """Federated training of ``model``.

    Args:
        model: any LightningModule whose ``training_step(batch, batch_idx)`` returns the loss (tensor, or dict with
            key ``"loss"``); ``batch_idx`` is the local step index ``k``. Its ``validation_step`` / ``test_step`` are
            used unchanged on the global model.
        client_optimizer: factory ``params -> Optimizer`` for the clients (LightningCLI: ``class_path`` +
            ``init_args``). Omitted (None): the module's own ``configure_optimizers()`` defines the client optimizer
            (every return form Lightning accepts; a returned LR scheduler is stepped once per round and
            checkpointed: :class:`~fedlightning.user_module.ModuleOptimizer`); an explicit ``client_optimizer``
            wins over it. A module without ``configure_optimizers`` needs ``client_optimizer`` (clear error at
            setup). Every client starts each round with a fresh optimizer (``torch.optim`` classes are built once
            and reset between sequential clients, which gives the same state), so momentum buffers never leak across
            clients;
            optimizers that define ``get_client_state`` / ``set_client_state`` (SgdArmijo's step size, DecSPS's
            counters) carry their per-client state across that client's rounds when ``persist_client_state``.
        local_steps: local steps ``K`` per client per round (default 20, seed 000's); not together with
            ``local_epochs``.
        local_epochs: local epochs ``E`` per client per round instead of a fixed ``K`` (a float > 0, fractions
            allowed): client ``i`` takes ``⌈E · B_i⌉`` steps, ``B_i`` the mini-batches of one epoch of its loader
            (``⌈n_i/b⌉``; ``⌊n_i/b⌋`` with ``drop_last``), so a whole ``E`` is seed 002's ``K = E·⌈n_i/B⌉``: every
            sample seen ``E`` times (rounding: :func:`fedlightning.datamodules.base.epoch_steps`). Each round's
            ``plan.client_steps`` holds the sampled clients' counts and ``plan.local_steps`` the largest; a callback
            changes ``plan.client_steps``, not ``plan.local_steps`` (a change of the latter is refused by name).
            Per-epoch rules follow the client's own epoch (SgdArmijo ``reset="grow"``, smoothed SPS:
            ``set_client_data``). Vectorised clients run the largest count in lockstep, each masked after its own
            last step (:meth:`fedlightning.vectorized.VectorizedClientTrainer.run`). ``KDecay`` schedules steps,
            so only its ``decay="client_lr"`` form combines with ``local_epochs`` (the other is refused at fit
            start). Default None: ``local_steps``.
        clients_per_round: clients sampled per round ``|S|`` (seed 000: 20).
        seed: seed (an integer ``>= 0``) of client sampling, client data order and in-model randomness (dropout);
            every stream is derived from ``(seed, purpose, round, client_id)``. Model initialisation is seeded by the
            CLI's ``seed_everything``.
        client_grad_clip: optional max-norm clipping of client gradients (FedExP's reference code uses 10).
        persist_client_state: keep client optimizer state across rounds (see ``client_optimizer``).
        on_client_failure: what happens to a client whose *result* is unusable: its loss or update is NaN/inf, a
            strategy marks it failed, or it fails the aggregation checks below. ``"skip"`` (default): it is left
            out of the round with a warning naming the round, the client and the cause, and counted in
            ``round/failed_clients``; if no client is healthy the global model is unchanged. ``"raise"``: the run
            stops with a ``FloatingPointError`` naming the client and round.
        on_client_error: what happens when a client's training *raises* (a target out of range, a shape mismatch,
            a BatchNorm batch of one sample). ``"raise"`` (default, ours: an exception is a bug in the module or the
            data, not a faulty client): the run stops at the first client that raised, with a ``RuntimeError``
            naming the round, the client and the exception (chained). ``"skip"``: the client is left out of its
            round as under ``on_client_failure="skip"``; a round in which *every* client raised still stops the run
            with the first exception chained.
        max_failed_rounds: consecutive rounds without a healthy client tolerated before the run stops with a
            ``FloatingPointError`` (default 3, ours: one unlucky round is skipped, a diverged run is not continued
            silently); the same error ends a run in which no round had a healthy client, when training ends
            (``on_train_end``, after the checkpoint callbacks), so such a run never exits 0. ``None`` never stops.
        max_update_norm: optional bound on a client's update norm ``‖Δ_i‖`` (float64): a client above it is left
            out of the round (``on_client_failure``). Default None (ours): only the overflow rule applies.

            **Aggregation checks** (ours). Every healthy client passes them before anything of it enters the
            round's sums; each decision depends only on that client's update, its weight ``w_i`` and the number of
            clients sampled this round ``|S|``, so it is the same in any order, mode (sequential, vectorized) and
            on every DDP process (before the all-reduce). A client is left out when ``|w_i|·‖Δ_i‖ ≥
            finfo.max / (2|S|)`` in the update's dtype (then no sum of ``|S|`` weighted updates, in any order and
            with each addition's rounding, can overflow: ``‖Δ_i‖`` bounds every entry, and the factor 2 covers the
            roundings), when ``|w_i|·‖Δ_i‖²`` could overflow the float64 sums of squared norms by the same rule, when
            its weight is non-finite, when its float buffers (BatchNorm statistics) are non-finite or could overflow
            their float32 sum, or when one of the strategy's extra statistics for it (``strategy.accumulate``) is
            non-finite or could overflow (:meth:`~fedlightning.callbacks.RoundStatistics.unsafe_entry`). The warning
            gives the update norm. ``‖Δ_i‖²`` is the float64 reduction the round's sums use anyway; the check adds
            one host read per client. Callbacks' ``on_client_end`` runs before these checks, and a client's
            optimizer state (``persist_client_state``) is stored before them: a client left out here keeps the
            state its local steps reached (the client's own, as on a device). SCAFFOLD's ``c_i``, whose change the
            server's ``c`` must receive, is stored only for admitted clients.

            **Server step check** (ours). After the server optimizer stepped, the global parameters and the floating
            tensors of the server optimizer's state are checked (one max-norm): if one is non-finite, both are put
            back as they were before the round and the run stops with a ``FloatingPointError`` naming the round,
            the strategy and the statistic at fault (non-finite ``Δ``, ``η_g``, or the step ``η_g·Δ`` overflowing);
            the round is not counted. Every client passed the checks above, so this is a problem of the strategy
            or its hyper-parameters, not of a client.
        client_execution: ``"sequential"`` (default) trains the round's clients one after the other;
            ``"vectorized"`` trains them in lockstep as one batched computation (torch.func, see
            :mod:`fedlightning.vectorized`; models without SyncBatchNorm, ``torch.optim`` SGD, Adam and AdamW
            and the optimizers of :mod:`fedlightning.optim`), raising a clear error otherwise; ``"auto"`` measures the
            first round both ways and keeps the faster (:func:`fedlightning.vectorized.run_vectorized_round`), falling
            back to sequential with a one-time warning where the model cannot be vectorised.
        max_parallel_clients: with vectorised execution, the most clients trained in lockstep at once: an int
            ``>= 1``, ``"auto"`` (a group size from the measured per-client footprint and the device's free memory)
            or None (default: the whole cohort at once). The cohort is trained in groups of at most that many
            clients (:class:`fedlightning.execution.VectorizedExecutor`); results equal sequential training's.
        init_weights: a checkpoint whose weights the global model starts from, e.g. a model trained centrally
            first: a Lightning checkpoint of the wrapped module (``trainer.save_checkpoint``), a fedlightning
            checkpoint (its global model), or a ``torch.save``d ``state_dict``. Read by the safe reader (no code runs,
            :func:`~fedlightning.checkpoint.read_checkpoint`) before round 0, after lazy modules have their shapes;
            its keys and shapes must be the module's and its weights finite
            (:func:`~fedlightning.checkpoint.check_fits_model`), else a
            :class:`~fedlightning.checkpoint.CheckpointError` names the difference. A run resumed from a checkpoint
            (``ckpt_path``) ends up with the resumed weights (Lightning restores them over these) and does not need
            the file. Default None: the module's own initial weights.

    Checkpoint files: a Trainer with Lightning's default checkpoint IO (no ``plugins``, or a plain
    ``TorchCheckpointIO``) gets :class:`~fedlightning.checkpoint.AtomicCheckpointIO` at ``setup``, as the CLI
    installs it: files written atomically (a kill mid-write keeps the previous file) and read by the safe reader,
    which admits the numpy and path values a module or callback state may hold (Lightning's default read refuses
    them, so such a run could not be resumed from Python). Another checkpoint IO is left as it is.
    """

    def __init__(
        self,
        model: pl.LightningModule,
        client_optimizer: OptimizerFactory | None = None,
        local_steps: int | None = None,
        clients_per_round: int = 20,
        seed: int = 0,
        client_grad_clip: float | None = None,
        persist_client_state: bool = True,
        on_client_failure: str = "skip",
        client_execution: str = "sequential",
        max_failed_rounds: int | None = 3,
        on_client_error: str = "raise",
        max_update_norm: float | None = None,
        local_epochs: float | None = None,
        max_parallel_clients: int | str | None = None,
        init_weights: str | os.PathLike | None = None,
    ):
        super().__init__()
        if not isinstance(model, pl.LightningModule):
            compiled = isinstance(getattr(model, "_orig_mod", None), pl.LightningModule)  # torch.compile(module)
            raise TypeError(
                f"model must be a LightningModule, got {type(model).__name__}"
                + (
                    f" (torch.compile of {type(model._orig_mod).__name__}): the clients train working copies of the "
                    "module through its training_step, which a compiled wrapper does not carry over; pass the module "
                    "itself and compile its layers instead (self.net = torch.compile(self.net), e.g. in "
                    "configure_model)"
                    if compiled
                    else ""
                )
            )
        local_steps = integer("local_steps", local_steps, allow_none=True)
        local_epochs = positive("local_epochs", local_epochs, allow_none=True)
        if local_steps is not None and local_epochs is not None:
            raise ValueError(
                f"local_steps={local_steps} and local_epochs={local_epochs} are both set; set one of them and the "
                "other to null (model.local_steps: a fixed number of steps per client; model.local_epochs: passes "
                "over each client's data)"
            )
        if local_steps is None and local_epochs is None:
            local_steps = self.DEFAULT_LOCAL_STEPS
        clients_per_round = integer("clients_per_round", clients_per_round)
        client_grad_clip = positive("client_grad_clip", client_grad_clip, allow_none=True)
        seed = integer("seed", seed, minimum=0)
        one_of("on_client_failure", on_client_failure, ("skip", "raise"))
        one_of("on_client_error", on_client_error, ("raise", "skip"))
        max_update_norm = positive("max_update_norm", max_update_norm, allow_none=True)
        max_failed_rounds = integer("max_failed_rounds", max_failed_rounds, allow_none=True)
        one_of("client_execution", client_execution, CLIENT_EXECUTION_MODES)
        if max_parallel_clients != "auto":
            max_parallel_clients = integer("max_parallel_clients", max_parallel_clients, allow_none=True)
        reference_mode()  # a bad FEDLIGHTNING_REFERENCE value fails here, before any training
        self.automatic_optimization = False
        self.model = model
        self.client_optimizer = client_optimizer  # None: the module's configure_optimizers() (resolved at setup)
        self._policy = FailurePolicy(on_client_failure, on_client_error, max_failed_rounds)
        self._runtime = _Runtime()
        self.local_steps: int | None = local_steps  # None with local_epochs
        self.local_epochs: float | None = local_epochs
        self.clients_per_round = clients_per_round
        self.seed = int(seed)
        self.client_grad_clip = client_grad_clip
        self.persist_client_state = persist_client_state
        self.max_update_norm = max_update_norm
        self.client_execution = client_execution  # its executor (fedlightning.execution) is chosen here, once
        self.max_parallel_clients = max_parallel_clients  # read by the vectorized executor
        if init_weights is not None and not isinstance(init_weights, (str, os.PathLike)):
            raise TypeError(f"init_weights must be a file path or None, got {type(init_weights).__name__}")
        self.init_weights = None if init_weights is None else os.fspath(init_weights)
        self._model_configured = False  # the user's configure_model ran in this stage's setup (_configure_model_now)
        self._server_settings_from_config = False  # apply_server_settings_on_resume
        self._init_weights_missing = False  # set at setup (_load_init_weights), checked at on_fit_start
        self.client_state = ClientStateStore()
        self.strategy: ServerStrategy | None = None
        self._eval_router = _LogRouter(self, "forward")
        self._eval_router.module = model
        route_logging(self.model, self._eval_router.log, self._eval_router.log_dict)
        self._forward_batch_transfer_hooks()
        if is_overridden("configure_model", model):
            self.__dict__["configure_model"] = self._forward_configure_model
        self.failed_clients_total = 0

    # ================================================================== setup
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        step = _EVALUATION_STEPS.get(stage)
        if step is not None and not is_overridden(step, self.model, pl.LightningModule):
            # the loop defines every step hook, so Lightning's own check (the module's) never fires: it is made here
            raise MisconfigurationException(
                f"No `{step}()` method defined on {type(self.model).__name__} to run "
                f"`Trainer.{getattr(stage, 'value', stage)}`."
            )
        self._guard_data_transfer_hooks()
        _install_safe_checkpoint_io(trainer)
        self.model.setup(stage)
        self._configure_model_now(trainer)
        strategies = [cb for cb in trainer.callbacks if isinstance(cb, ServerStrategy)]
        if len(strategies) > 1:
            raise SettingError(
                "trainer.callbacks",
                "only one server strategy callback may be configured, got "
                + ", ".join(type(s).__name__ for s in strategies),
            )
        if not strategies:
            strategies = [FedAvg()]
            trainer.callbacks.append(strategies[0])
        self.strategy = strategies[0]
        for cb in trainer.callbacks:
            check_hook_names(cb)
        if stage == "fit":
            if not self.model.automatic_optimization:
                raise ValueError(
                    f"{type(self.model).__qualname__} sets automatic_optimization = False (manual optimization); "
                    "federated client training runs the client optimizer itself: return the loss from training_step "
                    "and define the optimizer in configure_optimizers() or model.client_optimizer"
                )
            check_optimization_hooks(self.model)  # optimizer_step & co.: not called by client training
            check_fit_settings(trainer, self)  # max_steps, val_check_interval, seed: refused before round 0
            check_fit_callbacks(  # callbacks that would do nothing, or something else, in a federated fit
                trainer,
                early_stopping_at_epoch_end=early_stopping_at_epoch_end,
                timer_interval=timer_interval,
                checkpoint_every_n_epochs=checkpoint_every_n_epochs,
            )
            check_launcher(trainer)  # ddp_spawn & co.: refused
            self._begin_fit(trainer)
            self._log_every_round(trainer)
            dm = self._datamodule()
            dm.configure_rounds(self.clients_per_round, self.local_steps, self.seed, local_epochs=self.local_epochs)
            _check_test_fraction(trainer, dm)
            self._materialize_lazy_modules(dm)
            if self.init_weights is not None:
                self._load_init_weights()
            check_loss_scaling(trainer)  # 16-mixed on CUDA: a GradScaler that client training cannot apply
            self._check_client_optimizer(trainer)
            precision = str(trainer.precision)
            if precision.startswith("16"):
                rank_zero_warn(
                    f"precision={precision!r} has no loss scaling inside client training (float16 gradients that "
                    "underflow are lost); use 'bf16-mixed', 'bf16-true' or 32",
                )

    def _begin_fit(self, trainer: pl.Trainer) -> None:
        """What a fit of a loop that has fitted before starts from. Decisions (ours):

        * **A fit at round 0** (a new Trainer, or ``trainer.fit`` without ``ckpt_path`` on a Trainer that has not
          trained) is a new federated run from the module's current weights, as plain Lightning's new fit is: the
          loop's client state (SCAFFOLD's control variates, the client optimizers' carried step sizes), its failure
          counters and its client-optimizer factory (the module's schedulers) start afresh, and every
          :class:`~fedlightning.callbacks.FederatedCallback` of the Trainer gets back the state it had before its
          first fit (its ``state_dict``: SCAFFOLD's server control variate, FedExP's and the K schedules' histories,
          ...). Otherwise state from the previous fit would meet a server state that restarts (a new ``Scaffold()``
          whose ``c`` is 0 next to the previous fit's ``c_i``) or parameters that changed (a layer unfrozen between
          stages). A fit that resumes (``ckpt_path``) gets the checkpoint's state after this, as before.
        * **A fit that continues** (``trainer.fit`` again on the same Trainer after ``max_steps`` was raised: its
          round counter carries on) keeps that state, and the server optimizer, which Lightning builds again for every
          fit, gets the previous one's state (FedAdam's moments, FedAvgM's momentum): the run equals an uninterrupted
          one. Its trainable parameters must be those of the previous fit (the server optimizer's state and the
          clients' state are per parameter), else it is refused, naming the way to start a stage."""
        fed_callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        if trainer.global_step > 0:
            before = self._runtime.trainable
            now = self._global_params()
            if before is not None and (len(before) != len(now) or any(a is not b for a, b in zip(before, now))):
                raise ValueError(
                    f"trainer.fit continues this Trainer's run at round {trainer.global_step}, but the trainable "
                    "parameters differ from its previous fit's (the server optimizer's and the clients' state are "
                    "per parameter); to train a new stage (a layer unfrozen), fit with a new Trainer: a fit at round "
                    "0 starts a new federated run from the module's current weights"
                )
            if self._runtime.open_round is not None:
                raise ValueError(
                    f"trainer.fit continues this Trainer's run, but its previous fit stopped inside round "
                    f"{self._runtime.open_round} (an error), whose clients' state is partly written; resume from the "
                    "checkpoint of the last completed round (ckpt_path) or fit with a new Trainer"
                )
            self._runtime.continued_server_optimizer = self._runtime.server_optimizer
            reopen_finished_fit(trainer)  # the run's epoch goes on, as an uninterrupted fit's does (a ckpt_path's
            return  # restore, after setup, replaces it)
        self._runtime.continued_server_optimizer = None
        self._runtime.open_round = None
        used = len(self.client_state) > 0 or self.failed_clients_total > 0 or self._runtime.fitted
        # said in on_fit_start, unless a checkpoint is restored then (Lightning sets ckpt_path after setup)
        self._runtime.new_run_entries = len(self.client_state) if used else None
        self.client_state.load_state_dict({})
        self.failed_clients_total = 0
        self.rounds_without_healthy_client = 0
        for name in ("module_optimizer", "pending_module_optimizer_state", "client_lr"):
            setattr(self._runtime, name, None)
        for cb in fed_callbacks:
            initial = _INITIAL_CALLBACK_STATES.get(cb)
            if initial is None:
                _INITIAL_CALLBACK_STATES[cb] = copy.deepcopy(cb.state_dict())
            else:
                cb.load_state_dict(copy.deepcopy(initial))
        self._runtime.fitted = False

    def _configure_model_now(self, trainer: pl.Trainer) -> None:
        """The user's ``configure_model`` (parameters created there), called here, right after ``setup``, under the
        contexts Lightning calls it in, instead of after the loop's ``setup``: the lazy-module pass, ``init_weights``
        and the client optimizer's check below need the parameters. Lightning's own call of the stage then does
        not call it again (:meth:`_forward_configure_model`): one call per stage, as in plain Lightning."""
        self._model_configured = False
        if not is_overridden("configure_model", self.model):
            return
        with (
            trainer.strategy.tensor_init_context(),
            trainer.strategy.model_sharded_context(),
            trainer.precision_plugin.module_init_context(),
        ):
            self.model.configure_model()
        self._model_configured = True

    def _forward_configure_model(self) -> None:
        """The loop's ``configure_model`` when the user's module overrides it (installed on the instance, so that a
        loop around a module without one overrides none either, as Lightning's callbacks check: ``WeightAveraging``
        warns about sharded layers otherwise): the user's, unless :meth:`setup` called it for this stage already."""
        if self._model_configured:
            self._model_configured = False
            return
        self.model.configure_model()

    def _materialize_lazy_modules(self, dm: FederatedDataModule) -> None:
        """Give lazy modules their parameters before round 0 from the first client's first batch
        (:func:`~fedlightning.user_module.materialize_lazy_modules`; nothing runs for a model without them)."""
        if not any(is_lazy(p) for p in self.model.parameters()) and not any(is_lazy(b) for b in self.model.buffers()):
            return
        client = int(dm.clients_with_data()[0])
        with torch.random.fork_rng(devices=[]):  # a DataLoader iterator draws its base seed from the global RNG
            batch = next(iter(dm.client_dataloader(client, 0)))
        device = next((p.device for p in self.model.parameters() if not is_lazy(p)), torch.device("cpu"))
        batch = evaluation_batch(self.model, batch, device)
        materialize_lazy_modules(self.model, batch, derive_seed(self.seed, "lazy modules"))

    def _load_init_weights(self) -> None:
        """The global model's weights from ``init_weights`` (see the class docstring), at setup: Lightning restores a
        resumed run's checkpoint after setup, over them. Which of the two a run is, is known only at ``on_fit_start``:
        a missing file is an error there, and only for a run that does not resume."""
        path = self.init_weights
        self._init_weights_missing = not os.path.isfile(path)
        if self._init_weights_missing:
            return
        try:
            load_global_model(path, self.model)  # its non-persistent buffers too, as a resume puts them back
        except CheckpointError as err:
            if err.unsafe_type is None:
                raise
            raise CheckpointError(
                path,
                f"refuses to load: it needs the type {err.unsafe_type}, which is not an allow-listed data type and "
                "could run code; save the module's weights alone (torch.save(module.state_dict(), file)) and pass "
                "that file as model.init_weights",
                unsafe_type=err.unsafe_type,
            ) from err

    #: local steps per client and round when neither ``local_steps`` nor ``local_epochs`` is given (seed 000's K = 20)
    DEFAULT_LOCAL_STEPS = 20

    #: Lightning's ``Trainer(log_every_n_steps=...)`` default, which counts rounds here (a round is one step).
    _LIGHTNING_LOG_EVERY_N_STEPS = 50

    @staticmethod
    def _log_every_round(trainer: pl.Trainer) -> None:
        """Make the Trainer write the round metrics to its loggers every round unless the user chose a cadence.

        Lightning's default ``log_every_n_steps=50`` counts optimizer steps, and one step is one round here, so a
        60-round run would log one training point. The Trainer does not record whether the value was passed, so
        its default value 50 is read as "not set" and replaced by 1 (ours: a round is the unit a user plots); any
        other value, ``0`` (never) included, is kept; an explicit 50 cannot be told from the default and also logs
        every round. The Trainer keeps the value 1 after the fit."""
        if trainer.log_every_n_steps == FederatedLoop._LIGHTNING_LOG_EVERY_N_STEPS:
            trainer.log_every_n_steps = 1

    def _check_client_optimizer(self, trainer: pl.Trainer) -> None:
        """Build the client optimizer once before round 0, so that an impossible hyper-parameter (SgdArmijo
        ``c=1.5``, a negative SGD ``lr``, an Adam ``eps`` that is 0 in float16 under ``16-true``) is a configuration
        error now instead of a failure of every client, which the ``on_client_failure="skip"`` policy would otherwise
        absorb round after round. Constructing an optimizer does not touch the parameters."""
        factory = self._client_factory()
        try:
            opt = factory(self._global_params())
        except (ValueError, TypeError) as err:
            raise type(err)(f"client_optimizer cannot be built: {err}") from err
        if self.client_optimizer is not None:
            key, owner = "model.client_optimizer.init_args", f"client_optimizer {type(opt).__name__}"
            check_learning_rates(opt, f"{key}.lr", owner)
            check_half_precision_eps(opt, _training_dtypes(trainer, opt), f"{key}.eps", owner)
        else:
            owner = f"{type(self.model).__qualname__}.configure_optimizers()"
            check_learning_rates(opt, "model.model", owner)
            check_half_precision_eps(opt, _training_dtypes(trainer, opt), "model.model", owner)
        ClientHooks(self.model).check_optimizer(opt, type(self.model).__qualname__)
        if self.client_grad_clip is not None and getattr(opt, "requires_closure", False):
            raise SettingError(
                "model.client_grad_clip",
                f"client_grad_clip={self.client_grad_clip} clips the gradient before a client optimizer's step, but "
                f"{type(opt).__name__} computes its gradients and step size inside its own step (a line search or "
                "Polyak step), where no clipping applies; remove client_grad_clip or use a torch.optim optimizer",
            )

    def _client_factory(self) -> OptimizerFactory:
        """The client optimizer factory: ``client_optimizer``, or else the module's ``configure_optimizers()``."""
        if self.client_optimizer is not None:
            return self.client_optimizer
        runtime = self._runtime
        mo = runtime.module_optimizer
        if mo is None:
            if not is_overridden("configure_optimizers", self.model, pl.LightningModule):
                raise ValueError(
                    f"no client optimizer: model.client_optimizer is not set and {type(self.model).__qualname__} does "
                    "not define configure_optimizers(); set one of them (e.g. model.client_optimizer: "
                    "{class_path: torch.optim.SGD, init_args: {lr: 0.1}})"
                )
            mo = ModuleOptimizer(self.model)
            if runtime.pending_module_optimizer_state is not None:
                mo.load_state_dict(runtime.pending_module_optimizer_state)
                runtime.pending_module_optimizer_state = None
            runtime.module_optimizer = mo
            if runtime.worker is not None:
                mo.register(runtime.worker.model)
        return mo

    # ------------------------------------------------------------------ public accessors for callbacks
    @property
    def datamodule(self):
        """The run's :class:`~fedlightning.datamodules.FederatedDataModule` (``trainer.datamodule``)."""
        return self._datamodule()

    @property
    def client_execution_choice(self) -> str | None:
        """How this run trains its clients, ``"sequential"`` or ``"vectorized"``: ``client_execution`` itself, or
        for ``"auto"`` the mode chosen at the first round (None before it); ``"sequential"`` in reference mode
        (:mod:`fedlightning._reference`)."""
        if reference_mode():
            return "sequential"
        return self._executor.choice

    @property
    def client_execution_reason(self) -> str | None:
        """Why ``client_execution="auto"`` chose its mode, in the words of its log line (None otherwise, and before
        its first round)."""
        return self._executor.reason

    @property
    def vectorized_engine(self):
        """The :class:`~fedlightning.vectorized.VectorizedClientTrainer` of the client working copy (None until a
        vectorised round built it)."""
        return self._executor.engine

    # the failure settings and counter live in the round's FailurePolicy (fedlightning._round)
    on_client_failure = property(
        lambda self: self._policy.on_client_failure,
        lambda self, v: setattr(self._policy, "on_client_failure", v),
        doc="What happens to a client whose result is unusable (see the class docstring).",
    )
    on_client_error = property(
        lambda self: self._policy.on_client_error,
        lambda self, v: setattr(self._policy, "on_client_error", v),
        doc="What happens when a client's training raises (see the class docstring).",
    )
    max_failed_rounds = property(
        lambda self: self._policy.max_failed_rounds,
        lambda self, v: setattr(self._policy, "max_failed_rounds", v),
        doc="Consecutive rounds without a healthy client tolerated (class docstring).",
    )
    rounds_without_healthy_client = property(
        lambda self: self._policy.rounds_without_healthy_client,
        lambda self, v: setattr(self._policy, "rounds_without_healthy_client", int(v)),
        doc="Consecutive rounds, up to now, in which no client was healthy (checkpointed).",
    )

    @property
    def client_execution(self) -> str:
        """``"sequential"``, ``"vectorized"`` or ``"auto"`` (see the class docstring); setting it chooses the
        executor of the round's clients (:func:`fedlightning.execution.make_executor`)."""
        return self._client_execution

    @client_execution.setter
    def client_execution(self, value: str) -> None:
        one_of("client_execution", value, CLIENT_EXECUTION_MODES)
        self._client_execution = value
        self._executor = make_executor(value)

    @property
    def client_worker(self) -> LocalTrainer:
        """The :class:`~fedlightning.client.LocalTrainer` of the client working copy (a deep copy of the global
        model, built on first use on the loop's device), which sequential client training runs on; its ``model``
        is the copy, its ``params`` the copy's trainable parameters."""
        return self._worker_trainer()

    @property
    def client_optimizer_factory(self) -> OptimizerFactory:
        """``params -> Optimizer`` building the client optimizer: ``client_optimizer``, or the module's
        ``configure_optimizers()`` when that is None (available from ``setup``)."""
        return self._client_factory()

    def process_share(self, client_ids: list[int]) -> list[int]:
        """The clients of ``client_ids`` this process trains (all of them on one process; round-robin by position
        over the DDP processes)."""
        return self._my_clients(client_ids)

    def global_parameters(self) -> list[torch.nn.Parameter]:
        """The global model's trainable parameters, in ``model.parameters()`` order (the order of every flat
        vector the loop and the strategies use: ``Δ``, ``update.delta``, ``flat_params``)."""
        return self._global_params()

    def parameter_slices(self) -> dict[str, slice]:
        """Where each trainable parameter of the global model lies in the flat vectors a round passes around (a
        client's ``update.delta``, ``mean_delta``, the pseudo-gradient ``server_update`` returns, rows of
        :meth:`client_full_gradients`): ``{name: slice}`` in ``model.named_parameters()`` order, frozen parameters
        (``requires_grad=False``) left out, a shared parameter once under its first name. E.g. a strategy that keeps
        some layers out of the server step zeroes ``pseudo_gradient[s]`` for their slices. The order is the module's
        registration order, not the order of the names: a module's own ``nn.Parameter`` attributes come before
        those of its submodules."""
        slices, start = {}, 0
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                slices[name] = slice(start, start + p.numel())
                start += p.numel()
        return slices

    def global_frozen_parameters(self) -> list[torch.nn.Parameter]:
        """The global model's parameters that do not train (``requires_grad=False``), in ``model.parameters()``
        order: every client starts from their values (``LocalTrainer.run``'s ``global_frozen``)."""
        return [p for p in self.model.parameters() if not p.requires_grad]

    def client_full_gradients(
        self, client_ids: Iterable[int], round: int, batch_size: int | None = None, tag: str = "feddane-gradient"
    ) -> Tensor:
        """``[len(client_ids), D]``: row ``i`` the flat gradient of client ``client_ids[i]``'s mean training loss over
        all its samples at the global weights (:func:`~fedlightning.callbacks.feddane.client_full_gradient`'s, chunked
        by ``batch_size``; FedDANE's ``∇F_k(w_t)``).

        When this run trains its clients vectorised (:attr:`client_execution_choice`), all of them are one batched
        computation (:meth:`~fedlightning.vectorized.VectorizedClientTrainer.full_gradients`: each chunk a row of one
        vmapped ``training_step``; model randomness from one generator seeded with ``(seed, tag + "-vectorized",
        round, *client_ids)``); else, or when the model or the batches cannot be vectorised (said once, for the run),
        or when the batched computation runs out of accelerator memory (for that call), client by client with
        ``client_full_gradient`` (randomness seeded with ``(seed, tag, round, client_id)``). The global model, the
        global generator and the round's logged values are left as they were. Memory: the result
        (``[len(client_ids), D]``) and, vectorised, the activations of ``len(client_ids)`` chunks at once, or of a
        group's with ``max_parallel_clients`` (the clients are then taken in consecutive groups of the size local
        training uses, each one batched computation seeded with its own clients)."""
        ids = [int(c) for c in client_ids]
        params = self._global_params()
        self._worker_trainer().model._fl_round = round  # training_step's global_step / current_epoch: the round
        if not ids:
            return torch.zeros(0, sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        engine = self._full_gradient_engine()
        limit = self._client_group_limit() if engine is not None else None
        if limit is not None and len(ids) > limit:
            groups = [ids[i : i + limit] for i in range(0, len(ids), limit)]
            return torch.cat([self.client_full_gradients(group, round, batch_size, tag) for group in groups])
        if engine is not None:
            seed = derive_seed(self.seed, f"{tag}-vectorized", round, *ids)
            buffers = list(self.model.buffers())
            try:
                stacked = client_full_rows(self, ids, batch_size)  # in-memory data: one gather per tensor
                if stacked is not None:
                    rows, sizes, row_clients, totals = stacked
                    return engine.full_gradients_of_rows(rows, sizes, row_clients, totals, params, buffers, seed)
                with torch.random.fork_rng(devices=[]):  # loading draws from the generator (client_full_batches)
                    batches = [list(client_full_batches(self, k, batch_size, direct=True)[1]) for k in ids]
                return engine.full_gradients(batches, params, buffers, seed)
            except VectorizationUnsupportedError as err:
                self._runtime.full_gradient_fallback = str(err)
                rank_zero_warn(f"client full gradients are computed client by client: {err}")
            except torch.cuda.OutOfMemoryError as err:  # this call's clients at once did not fit: one by one
                engine.release()
                torch.cuda.empty_cache()
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                rank_zero_warn(
                    f"the full gradients of {len(ids)} clients at once ran out of accelerator memory ({first}); "
                    "computing them client by client this round"
                )
            except Exception as err:  # noqa: BLE001 - which client raised is found client by client below
                warnings.warn(
                    f"round {round}: the batched full gradients of {len(ids)} clients raised {type(err).__name__}: "
                    f"{err}; computing them client by client this round",
                    UserWarning,
                    stacklevel=2,
                )
        return self._full_gradients_one_by_one(ids, round, batch_size, tag, params)

    def _full_gradients_one_by_one(self, ids: list[int], round: int, batch_size, tag: str, params) -> Tensor:
        """:meth:`client_full_gradients` client by client, under the loop's ``on_client_error``.

        Decision (ours): a client whose ``training_step`` raises in its full gradient at the global weights is
        treated as a client that raises in its local training: ``"raise"`` (default) stops the run with a
        ``RuntimeError`` naming the round, the client and the exception (chained); ``"skip"`` warns and gives the
        client a NaN row, which the strategies' means leave out (FedDANE's ``g_t``, Mime's server momentum:
        :func:`~fedlightning.callbacks.feddane.leave_out_nonfinite_gradients`, which does not count it again as a
        NaN gradient; :meth:`full_gradient_errors`). Under FedDANE the client's own correction is then NaN, so its
        local update is too and the round leaves it out (``on_client_failure``)."""
        rows = []
        for k in ids:
            try:
                rows.append(client_full_gradient(self, k, round, batch_size, tag=tag))
            except Exception as err:
                what = (
                    f"round {round}: client {k} raised {type(err).__name__}: {err}, in its full gradient at the "
                    f"global weights ({tag})"
                )
                if self.on_client_error != "skip":
                    raise RuntimeError(
                        f"{what}. An exception in client training is a bug in the model, the data or a callback's "
                        "hook, not a faulty client, so the run stops (on_client_error='skip' would leave such clients "
                        "out of the round's means)"
                    ) from err
                warnings.warn(f"{what}; it is left out (on_client_error='skip')", UserWarning, stacklevel=3)
                self._runtime.full_gradient_raised = (round, self.full_gradient_errors(round) | {k})
                D = sum(p.numel() for p in params)
                rows.append(torch.full((D,), float("nan"), dtype=params[0].dtype, device=params[0].device))
        return torch.stack(rows)

    def full_gradient_errors(self, round: int) -> frozenset[int]:
        """The clients whose full gradient raised in ``round`` and were left out under ``on_client_error="skip"``
        (their rows of :meth:`client_full_gradients` are NaN)."""
        seen_round, raised = self._runtime.full_gradient_raised
        return raised if seen_round == round else frozenset()

    def _client_group_limit(self) -> int | None:
        """The most clients one vectorised computation takes now (the vectorised executor's rule, ``VectorizedRun``);
        None for all of them."""
        run = getattr(self._executor, "run", None)
        return run.group_limit(self.max_parallel_clients) if run is not None else None

    def _full_gradient_engine(self) -> VectorizedClientTrainer | None:
        """The vectorised engine :meth:`client_full_gradients` uses: the executor's, or one of its own for the
        working copy until the executor has built one; None when clients train sequentially (or the model cannot
        be vectorised, or an earlier call fell back)."""
        if self.client_execution_choice != "vectorized" or self._runtime.full_gradient_fallback is not None:
            return None
        worker = self._worker_trainer()
        engine = self.vectorized_engine
        if engine is not None and engine.model is worker.model:
            return engine
        cached = self._runtime.full_gradient_engine
        if cached is not None and cached.model is worker.model:
            return cached
        convert = getattr(worker, "convert_input", None)
        to_device = worker.to_device if convert is None else (lambda b: worker.to_device(convert(b)))
        try:
            cached = VectorizedClientTrainer(worker.model, to_device=to_device)
        except VectorizationUnsupportedError as err:
            self._runtime.full_gradient_fallback = str(err)
            rank_zero_warn(f"client full gradients are computed client by client: {err}")
            return None
        self._runtime.full_gradient_engine = cached
        return cached

    def _datamodule(self):
        dm = getattr(self.trainer, "datamodule", None)
        if not isinstance(dm, FederatedDataModule):
            raise TypeError(
                "FederatedLoop needs a FederatedDataModule (trainer.fit(loop, datamodule=...)), got "
                f"{type(dm).__name__}"
            )
        return dm

    def _guard_data_transfer_hooks(self) -> None:
        """The data module's batch-transfer hooks, which Lightning calls on the round's RoundPlan too (it prefers a
        data module's hook to the module's), pass the RoundPlan through untouched; client, validation and test
        batches go through them. Installed on the data module instance, once, for the hooks it overrides."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None:
            return
        for name, owner in transfer_hook_owners(self.model, dm).items():
            hook = getattr(dm, name)
            if owner is dm and not isinstance(hook, _PassRoundPlan):
                dm.__dict__[name] = _PassRoundPlan(hook)

    def _forward_batch_transfer_hooks(self) -> None:
        """Evaluation batches go through the user's batch-transfer hooks, the round's RoundPlan does not (client
        batches go through them in client training). Installed only for the hooks the user's class overrides:
        Lightning warns about every overridden transfer hook of a module trained with a data module."""
        for name in BATCH_TRANSFER_HOOKS:
            if is_overridden(name, self.model, pl.LightningModule):
                self.__dict__[name] = _PassRoundPlan(getattr(self.model, name))

    def configure_optimizers(self):
        if self.strategy is None:
            raise RuntimeError("the server strategy is resolved in setup(); fit the loop with a Trainer")
        optimizer = self.strategy.configure_server_optimizer(self._global_params())
        previous = self._runtime.continued_server_optimizer
        if previous is not None and self.trainer.state.fn == TrainerFn.FITTING:
            # a fit that continues this Trainer's run (_begin_fit): the previous fit's server optimizer state
            self._runtime.continued_server_optimizer = None
            if type(previous) is type(optimizer) and len(previous.param_groups) == len(optimizer.param_groups):
                optimizer.load_state_dict(previous.state_dict())
        self._runtime.server_optimizer = optimizer
        return optimizer

    def _global_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _worker_trainer(self) -> LocalTrainer:
        w = self._runtime.worker
        if w is None or w.params[0].device != self.device:
            # do not deep-copy the Trainer (nor the loop through the log router)
            with detached_trainer(self.model) as trainer_ref, routed_logging(self.model, None, None):
                try:
                    work = copy.deepcopy(self.model)
                except Exception as err:  # the clients train a deep copy of the model: say so, with torch's reason
                    raise RuntimeError(
                        f"the clients train a working copy of {type(self.model).__name__} made with copy.deepcopy, "
                        f"which fails: {type(err).__name__}: {err}"
                        + (
                            " (torch.nn.utils.weight_norm cannot be deep-copied: use "
                            "torch.nn.utils.parametrizations.weight_norm, its replacement)"
                            if "weight_norm" in str(err)
                            else ""
                        )
                    ) from err
            copy_gradient_hooks(self.model, work)
            work.to(self.device)
            make_client_copy(work, trainer_ref)
            router = _LogRouter(self, "capture")
            router.module = work
            route_logging(work, router.log, router.log_dict)
            to_device = (lambda b: b) if self.device.type == "cpu" else (lambda b: move_data_to_device(b, self.device))
            hooks = ClientHooks(work, getattr(trainer_ref, "datamodule", None))
            w = LocalTrainer(
                work,
                to_device=to_device,
                grad_clip=self.client_grad_clip,
                hooks=hooks if hooks.any else None,
                metrics=MetricStates(work),
                convert_input=self._input_conversion(trainer_ref),
            )
            w.router = router  # type: ignore[attr-defined]
            w.client_hooks = hooks  # type: ignore[attr-defined]  # incl. the per-round epoch hooks
            if self._runtime.module_optimizer is not None:
                self._runtime.module_optimizer.register(work)
            self._runtime.worker = w
        dm = getattr(self.trainer, "datamodule", None)
        if w.client_hooks.datamodule is not dm:  # another fit's data module: its batch-transfer hooks
            hooks = ClientHooks(w.model, dm)
            w.hooks, w.client_hooks = (hooks if hooks.any else None), hooks  # type: ignore[attr-defined]
        return w

    @staticmethod
    def _input_conversion(trainer: pl.Trainer | None) -> Callable[[Any], Any] | None:
        """The Trainer's ``precision_plugin.convert_input`` when it changes batches (``"64-true"``, ``"16-true"``,
        ``"bf16-true"``: floating tensors to the run's dtype, as Lightning's training loop converts every batch),
        else None (32-bit and mixed precision, whose autocast is the Trainer's ``train_step_context`` around the
        round, so client forwards run under it already)."""
        plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
        if plugin is None or type(plugin).convert_input is Precision.convert_input:
            return None
        return plugin.convert_input

    # ================================================================== one round
    def _my_clients(self, client_ids: list[int]) -> list[int]:
        """Deterministic share of the round's clients for this process (round-robin by position)."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return client_ids[rank::world] if world > 1 else list(client_ids)

    def _make_client_optimizer(
        self, params, client_id: int, lr_scale: float, reuse: bool = False, slot: int | None = None
    ) -> torch.optim.Optimizer:
        """The client optimizer of ``client_id`` for this round: as fresh as a new ``client_optimizer(params)``.

        With ``reuse``, an optimizer of a class from ``torch.optim`` itself is built once and reset for every later
        client instead (its per-parameter state cleared, its hyper-parameters restored to their values after
        construction): the same object state as a fresh one, without the ~50 µs construction per client. Sequential
        clients (one at a time on the same working copy, ``slot`` None) share one such optimizer; the vectorised
        clients of a group, whose optimizers all live during the group's round, have one each, by their position
        ``slot`` in the group. Other optimizers (``fedlightning.optim``, user classes) are always built by the
        factory, and so is every optimizer in reference mode.
        """
        factory = self._client_factory()
        reuse = reuse and not reference_mode()
        runtime = self._runtime
        cached = None
        if reuse:
            cached = runtime.reusable_client_opt if slot is None else runtime.reusable_group_opts.get(slot)
        if cached is not None and cached[0] is params and cached[3] is factory:
            opt, defaults = cached[1], cached[2]
            opt.state.clear()
            for group, snapshot in zip(opt.param_groups, defaults):
                group.update({k: (v.clone() if isinstance(v, Tensor) else v) for k, v in snapshot.items()})
        else:
            opt = factory(params)
            if reuse and type(opt).__module__.startswith("torch.optim.") and not hasattr(opt, "set_client_state"):
                defaults = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
                if slot is None:
                    runtime.reusable_client_opt = (params, opt, defaults, factory)
                else:
                    runtime.reusable_group_opts[slot] = (params, opt, defaults, factory)
        if lr_scale != 1.0:
            scale_client_step(opt, lr_scale)
        if self.persist_client_state and hasattr(opt, "set_client_state"):
            state = self.client_state.get("optimizer", client_id)
            if state is not None:
                opt.set_client_state(state)
        return opt

    def _forget_reusable_optimizers(self) -> None:
        """Build the reusable client optimizers afresh (their snapshots hold a client learning rate that changed)."""
        self._runtime.reusable_client_opt = None
        self._runtime.reusable_group_opts.clear()

    def _federated_hook(self, name: str, *args: Any) -> list[Any]:
        """:func:`~fedlightning.callbacks.base.call_federated_hook` for ``name``, skipped (``[]``) when no callback
        defines the hook other than as :class:`~fedlightning.callbacks.base.FederatedCallback`'s no-op: a round calls
        the per-client hooks once per client, and dispatching no-ops (each call profiled, the hook name set on the
        module) costs tens of µs per client. Which hooks are in use is decided once per round (:meth:`_plan_round`
        forgets it) and list of callbacks (a callback's own method, inherited from a class of its own or set on the
        instance, counts as defined)."""
        if not self._federated_hook_users(name):
            return []
        if name not in _PER_CLIENT_HOOKS:
            return call_federated_hook(self.trainer, self, name, *args)
        # a per-client hook runs on the process that trains the client: pl_module.log there logs one value of that
        # client, reduced over the round's clients as training_step's values are (client/<name>, every process)
        client = args[1].client_id if name == "on_client_end" else args[1]
        router = self._worker_trainer().router
        owner, router.owner = router.owner, client
        try:
            with routed_logging(self, router.log, router.log_dict):
                return call_federated_hook(self.trainer, self, name, *args)
        finally:
            router.owner = owner

    def _federated_hook_users(self, name: str) -> bool:
        """Whether a callback defines the federated hook ``name`` itself (see :meth:`_federated_hook`)."""
        callbacks = self.trainer.callbacks
        key = tuple(map(id, callbacks))
        cached = self._runtime.hooks_in_use
        if cached is None or cached[0] != key:
            cached = (key, frozenset(n for n in FEDERATED_HOOKS if any(_defines_hook(cb, n) for cb in callbacks)))
            self._runtime.hooks_in_use = cached
        return name in cached[1]

    def prepare_client(self, plan: RoundPlan, client_id: int, params, reuse: bool = False, slot: int | None = None):
        """``(optimizer, terms)`` of ``client_id`` for ``plan``, as sequential and vectorised training use them: the
        client optimizer over ``params`` (:meth:`_make_client_optimizer`: scaled, client state set; ``reuse`` and
        ``slot`` as there) told the client's epoch length ``b/n_i`` (``set_client_data``: SgdArmijo
        ``reset="grow"``, smoothed SPS), and the ``client_objective`` terms of the callbacks."""
        opt = self._make_client_optimizer(params, client_id, plan.client_lr_scale, reuse=reuse, slot=slot)
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        self._runtime.client_lr = (plan.round, float(lr) if isinstance(lr, (int, float, Tensor)) else None)
        if hasattr(opt, "set_client_data"):
            dm = self._datamodule()
            opt.set_client_data(num_samples=dm.client_num_samples(client_id), batch_size=dm.batch_size)
        writers = self._user_hook_owners("configure_client_optimizer")
        before = [p.detach().clone() for p in params] if writers else None
        for owner, configured in self._hook_results("configure_client_optimizer", plan, client_id, opt):
            if configured is not None:
                _check_configured_optimizer(owner, configured, params)
                opt = configured
        if before is not None:
            _check_parameters_unwritten(writers, client_id, before, params)
        terms = []
        for owner, extra in self._hook_results("client_objective", plan, client_id):
            terms.extend(_objective_terms(owner, extra))
        return opt, terms

    def _user_hook_owners(self, name: str) -> list[str]:
        """The class names of the callbacks other than fedlightning's own that define the federated hook ``name``
        (fedlightning's are known not to write the client's parameters: :func:`_check_parameters_unwritten`)."""
        if not self._federated_hook_users(name):
            return []
        return [
            type(cb).__name__
            for cb in self.trainer.callbacks
            if _defines_hook(cb, name) and not type(cb).__module__.startswith("fedlightning.")
        ]

    def _hook_results(self, name: str, *args: Any) -> list[tuple[str, Any]]:
        """:meth:`_federated_hook`'s results, each with the name of the callback class that returned it."""
        results = self._federated_hook(name, *args)
        if not results:
            return []
        owners = [type(cb).__name__ for cb in self.trainer.callbacks if callable(getattr(cb, name, None))]
        return list(zip(owners, results))

    def finish_client(self, update: ClientUpdate, optimizer: torch.optim.Optimizer, persist: bool = True) -> None:
        """After a client trained: its optimizer's ``client_report()`` (last-step scalars a strategy may use,
        FedSPS-Global) joins ``update.payload``, and its ``get_client_state()`` is stored for the client's next
        round (with ``persist`` and ``persist_client_state``, unless the update failed)."""
        if hasattr(optimizer, "client_report"):
            update.payload.update(optimizer.client_report())
        if persist and self.persist_client_state and hasattr(optimizer, "get_client_state") and not update.failed:
            self.client_state.set("optimizer", update.client_id, optimizer.get_client_state())

    def train_client(self, plan: RoundPlan, client_id: int, global_flat: Tensor) -> ClientUpdate:
        """Run one client's local training for ``plan`` and return its update (no aggregation)."""
        dm = self._datamodule()
        worker = self._worker_trainer()
        if not worker.model.training:  # the working copy is private to the loop: train() once, not per client
            worker.model.train()
        opt, terms = self.prepare_client(plan, client_id, worker.params, reuse=True)
        gparams, gbuffers = self._round_tensors(plan.round)
        # what the client logs is its own (left out with it when the round leaves it out, _leave_out_logs)
        self._runtime.metrics_before = (client_id, worker.metrics.save()) if worker.metrics else None
        with self.client_optimizer_view(opt), worker.router.owned_by(client_id):
            update = worker.run(
                client_id=client_id,
                round=plan.round,
                seed=self.seed,
                global_params=gparams,
                global_buffers=gbuffers,
                global_flat=global_flat,
                loader=dm.client_dataloader(client_id, plan.round, seed=self.seed),
                optimizer=opt,
                local_steps=plan.steps_for(client_id),
                num_samples=dm.client_num_samples(client_id),
                terms=terms,
                with_buffers=True,
                global_frozen=self.global_frozen_parameters() if worker.frozen else (),
            )
        self.finish_client(update, opt)
        return update

    @contextmanager
    def client_optimizer_view(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """While one client trains sequentially (also in a callback's local training on the client working copy,
        e.g. ``ClientEvaluation``'s adaptation), ``trainer.optimizers`` is ``[optimizer]`` (the client's own) and
        ``trainer.lr_scheduler_configs`` the client schedulers of the module's ``configure_optimizers()`` (their
        ``scheduler.optimizer`` is the round's template, whose learning rate the client's is built from; ``[]`` with
        ``client_optimizer``); both are the server's again afterwards, also when the client raises, so callbacks
        (``LearningRateMonitor``: ``lr-<ServerOptimizer>``) and checkpoints see the server optimizer. Decisions
        (ours): the swap is two attribute assignments per client on the strategy (``_optimizers`` directly, not the
        ``optimizers`` setter, which wraps each optimizer in a new ``LightningOptimizer``: the server's wrapper,
        which the loop's own ``self.optimizers()`` returns, stays); vectorised clients leave both unchanged (the
        server's), as their ``training_step`` runs once for all the round's clients."""
        trainer = attached_trainer(self)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if strategy is None:
            yield
            return
        mo = self._runtime.module_optimizer
        schedulers = list(mo.schedulers) if (mo is not None and self.client_optimizer is None) else []
        with strategy_optimizers(strategy, [optimizer], schedulers):
            yield

    def _round_tensors(self, round: int):
        """The global model's trainable parameters and buffers, listed once per round (walking
        a LightningModule's module tree costs ~0.1 ms, which adds up over a round's clients); listed at every call
        in reference mode."""
        cached = self._runtime.round_tensors
        if cached is None or cached[0] != round or reference_mode():
            gbuffers = list(self.model.buffers())
            cached = (round, self._global_params(), gbuffers)
            self._runtime.round_tensors = cached
        return cached[1], cached[2]

    def _start_round(self, plan: RoundPlan) -> None:
        """The plan's clients checked (:meth:`_check_plan_clients`), the callbacks' ``on_round_start``, then the
        clients checked again and the plan's step counts: ``plan.local_steps`` an integer
        >= 1; with per-client counts (``local_epochs``) each of them, and ``plan.local_steps`` their largest (a
        callback that changed ``plan.local_steps`` alone is refused, naming it: the clients' own counts decide)."""
        before, per_client = plan.local_steps, plan.client_steps is not None
        self._check_plan_clients(plan)  # the callbacks see the clients as ints (DPFedAvg's check of repeats)
        self._federated_hook("on_round_start", plan)
        if plan.client_steps is not None and plan.local_steps != before:
            owners = ", ".join(
                type(cb).__name__
                for cb in self.trainer.callbacks
                if callable(getattr(cb, "on_round_start", None))
                and type(cb).on_round_start is not FederatedCallback.on_round_start
            )
            source = (
                f"model.local_epochs={self.local_epochs}"
                if self.local_epochs is not None
                else "the data module's round_plan"
                if per_client
                else "plan.client_steps, which on_round_start set"
            )
            raise ValueError(
                f"round {plan.round}: on_round_start ({owners}) set plan.local_steps={plan.local_steps!r}, but with "
                f"{source}, each client's steps are plan.client_steps and plan.local_steps is their largest, so that "
                "change would be lost; change plan.client_steps instead"
                + (", or set model.local_steps instead of model.local_epochs" if self.local_epochs is not None else "")
            )
        self._check_plan_clients(plan)
        label = f"round {plan.round}: local_steps"
        if plan.client_steps is not None:
            plan.client_steps = {
                int(c): integer("local_steps", n, label=f"{label} of client {c}") for c, n in plan.client_steps.items()
            }
            missing = [c for c in plan.client_ids if c not in plan.client_steps]
            if missing:
                raise ValueError(f"{label}: plan.client_steps has no entry for client(s) {missing}")
            plan.local_steps = max(plan.client_steps[c] for c in plan.client_ids)
        plan.local_steps = integer("local_steps", plan.local_steps, label=label)

    def _check_plan_clients(self, plan: RoundPlan) -> None:
        """The plan's clients as Python ints (numpy integers and 0-d integer tensors are taken by value; floats and
        bools refused): a client's data order and seeds are derived from its id, so an id of another type would
        give another run. Every id must name a client of the data module that holds training data, and a round
        needs at least one client (a sampler that leaves a round empty is refused here, rather than the round
        counted as one whose clients all failed)."""
        dm = self._datamodule()
        ids = []
        for c in plan.client_ids:
            if isinstance(c, (bool, float)) or (
                isinstance(c, Tensor) and (c.is_floating_point() or c.dtype == torch.bool)
            ):
                raise ValueError(f"round {plan.round}: plan.client_ids holds {c!r}; client ids are integers")
            try:
                ids.append(operator.index(c))
            except TypeError:
                raise ValueError(
                    f"round {plan.round}: plan.client_ids holds {c!r} ({type(c).__name__}); client ids are integers"
                ) from None
        if not ids:
            raise ValueError(
                f"round {plan.round}: the round's plan has no client (the data module's sample_clients or an "
                "on_round_start left plan.client_ids empty); every round trains at least one client"
            )
        bad = [c for c in ids if not 0 <= c < dm.num_clients]
        if bad:
            raise ValueError(
                f"round {plan.round}: plan.client_ids holds client(s) {bad[:5]} outside the data module's "
                f"{dm.num_clients} clients (0 to {dm.num_clients - 1})"
            )
        empty = [c for c in ids if dm.client_num_samples(c) == 0]
        if empty:
            raise ValueError(
                f"round {plan.round}: plan.client_ids holds client(s) {empty[:5]} without training data; sample "
                "from the data module's clients_with_data()"
            )
        plan.client_ids = ids

    def training_step(self, plan: RoundPlan, batch_idx: int) -> None:
        """One communication round, as the template of its phases (:mod:`fedlightning._round` lists them)."""
        align_logged_step(self.trainer)  # round r's metrics at step r, also after a restore
        plan = self._plan_round(plan)
        tally = self._train_clients(plan)
        stats = self._close_clients(plan, tally)
        result = self._step_server(plan, stats, tally)
        self._end_round(result)
        self._runtime.open_round = None  # set at the round's start (_check_trainable)
        self._runtime.before_validation = True
        return None

    # ------------------------------------------------------------------ the round's phases
    def _plan_round(self, plan: Any) -> RoundPlan:
        """The round's plan (the data module's, for round ``global_step``), after the callbacks' ``on_round_start``
        with its step counts checked (:meth:`_start_round`)."""
        if not isinstance(plan, RoundPlan) or plan.round != self.global_step:
            # e.g. resumed mid-epoch with a restarted loader: the round is defined by the global step
            dm = self._datamodule()
            plan = dm.round_plan(self.global_step)
            if not isinstance(plan, RoundPlan) or plan.round != self.global_step:
                got = f"round {plan.round}'s plan" if isinstance(plan, RoundPlan) else f"a {type(plan).__name__}"
                raise ValueError(
                    f"round {self.global_step}: {type(dm).__name__}.round_plan({self.global_step}) returned {got}; it "
                    f"must return the RoundPlan of round {self.global_step} (its data order and seeds come from it)"
                )
        self._runtime.hooks_in_use = None  # decided again for this round's callbacks
        self._start_round(plan)
        return plan

    def _train_clients(self, plan: RoundPlan) -> RoundTally:
        """This process's share of the round's clients, trained from the global weights (sequentially or
        vectorised), each handed to ``on_client_end`` and then admitted into the round's sums or left out
        (:class:`~fedlightning._round.RoundTally`); stops early when the failure policy stops the run.

        Without an ``on_client_end`` hook (none of the callbacks defines one) nothing happens to an update between
        its training and its admission, and the clients trained together (a vectorised group) are admitted together
        (:meth:`~fedlightning._round.RoundTally.admit_all`: the same checks and sums, in the same order)."""
        global_flat = self._begin_client_training(plan)
        tally = RoundTally(
            self.strategy,
            len(plan.client_ids),
            global_flat.device,
            self._policy,
            self.max_update_norm,
            scratch=self._runtime.admit_scratch,
        )
        executor = self._executor  # chosen once per run (fedlightning.execution)
        hooked = self._federated_hook_users("on_client_end")
        for group in executor.update_groups(self, plan, self._my_clients(plan.client_ids), global_flat):
            pending: list[ClientUpdate] = []  # trained, not yet admitted (no on_client_end hook)
            go_on = True
            for cid, outcome in group:
                update = tally.raised(cid, outcome) if isinstance(outcome, Exception) else outcome
                if update is None:
                    go_on = False  # the policy stops the run; every process reaches the reduction first
                    break
                if not hooked:
                    pending.append(update)
                    continue
                self._federated_hook("on_client_end", plan, update)
                if not tally.admit(plan, update):
                    go_on = False
                    break
            if pending and not tally.admit_all(plan, pending):  # the clients before a stop are admitted first
                go_on = False
            self._leave_out_logs(group, tally)
            if not go_on:
                break
        if tally.failed:  # clients left out of the round: left out of client/<name> too
            self._worker_trainer().router.keep_clients({h.client_id for h in tally.healthy})
        return tally

    def _leave_out_logs(self, group: list[tuple[int, Any]], tally: RoundTally) -> None:
        """The torchmetrics updates of a sequential client that the round left out (failed, screened out or raised)
        undone, as its values logged with ``self.log`` are dropped at the end of the client training
        (``keep_clients``): ``client/<name>`` covers the clients whose updates the round aggregates, as
        ``train/loss`` does. Vectorised groups do not replay a failed client's metric calls (the engine's
        ``_replay``); a client that only the aggregation checks leave out (``max_update_norm``, an update that could
        overflow the round's sums) keeps its metric updates there."""
        before = self._runtime.metrics_before
        self._runtime.metrics_before = None
        if before is None:
            return
        healthy = {h.client_id for h in tally.healthy}
        if any(cid == before[0] and cid not in healthy for cid, _ in group):
            MetricStates.restore(before[1])

    def _begin_client_training(self, plan: RoundPlan) -> Tensor:
        """The round's global weights as one flat vector; the client working copy set to the round (its
        ``global_step``) and its ``on_train_epoch_start`` called."""
        self._runtime.round_tensors = None  # the parameter list is re-read every round
        gparams = self._round_tensors(plan.round)[0]
        self._check_trainable(plan, gparams)
        with torch.no_grad():
            global_flat = flat_params(gparams)
        worker = self._worker_trainer()
        worker.model._fl_round = plan.round  # the client copy's global_step / current_epoch
        if worker.client_hooks.epoch_start:
            worker.model.on_train_epoch_start()
        self._check_worker_trainable(plan, worker)
        return global_flat

    def _check_trainable(self, plan: RoundPlan, gparams: list[Tensor]) -> None:
        """Refuse a change of ``requires_grad`` during fit in the global model (a callback unfreezing a layer),
        naming the parameters.

        Decision (ours): the trainable parameters are fixed at the fit's first round (after ``on_fit_start`` and
        ``on_train_start``, where a module may still freeze a layer): every client's update and the vectorized
        engine's layout cover exactly them, and so must the server optimizer (and its state: FedAdam's moments),
        built before those hooks, so a layer unfrozen later would be trained by no one (its clients' work dropped)
        or break the round's sums. To unfreeze in stages, run one fit per stage with a new Trainer, each starting from
        the previous one's weights (the same loop may fit again: its working copy is rebuilt, and a fit at round 0 is
        a new federated run, :meth:`_begin_fit`)."""
        fixed = self._runtime.trainable
        self._runtime.fitted = True
        self._runtime.open_round = plan.round  # until the round's end (training_step)
        if fixed is None:  # the fit's first round
            self._fix_trainable(plan, gparams)
        elif len(gparams) != len(fixed) or any(a is not b for a, b in zip(gparams, fixed)):
            self._refuse_trainable_change(plan, "the global model", self.model, fixed)

    def _check_worker_trainable(self, plan: RoundPlan, worker: LocalTrainer) -> None:
        """:meth:`_check_trainable` for the clients' working copy (the module's own ``on_train_epoch_start``): its
        trainable and frozen parameters are those its :class:`~fedlightning.client.LocalTrainer` was built with."""
        if any(not p.requires_grad for p in worker.params) or any(p.requires_grad for p in worker.frozen):
            self._refuse_trainable_change(plan, "the clients' working copy", worker.model, worker.params)

    @staticmethod
    def _refuse_trainable_change(plan: RoundPlan, where: str, model: torch.nn.Module, trainable: list[Tensor]) -> None:
        """The error naming the parameters of ``model`` whose ``requires_grad`` differs from ``trainable``."""
        was = {id(p) for p in trainable}
        changed = [
            f"{name} ({'now trainable' if p.requires_grad else 'now frozen'})"
            for name, p in model.named_parameters()
            if p.requires_grad != (id(p) in was)
        ]
        raise ValueError(
            f"round {plan.round}: requires_grad changed during fit in {where}: {', '.join(changed[:5])}"
            f"{' ...' if len(changed) > 5 else ''}. The trainable parameters are fixed when fit starts (the server "
            "optimizer and every client's update cover exactly them): set requires_grad before trainer.fit, and to "
            "unfreeze in stages run one fit per stage with a new Trainer, each from the previous one's weights"
        )

    def _fix_trainable(self, plan: RoundPlan, gparams: list[Tensor]) -> None:
        """At the fit's first round: the trainable parameters from now on (:meth:`_check_trainable`). Refuses one the
        server optimizer does not hold (made trainable after ``configure_optimizers``: the server step would never
        move it); drops a working copy (and the executor's engine) that an earlier fit of this loop built with
        other trainable parameters."""
        held = {id(p) for opt in self.trainer.optimizers for g in opt.param_groups for p in g["params"]}
        if held:
            outside = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in held]
            if outside:
                raise ValueError(
                    f"round {plan.round}: {', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''} became "
                    "trainable after the server optimizer was built (configure_optimizers, before on_fit_start and "
                    "on_train_start), so the server step would never move them: set requires_grad=True before "
                    "trainer.fit (in __init__, setup or configure_model)"
                )
        worker = self._runtime.worker
        if worker is not None:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            if [n for n, p in worker.model.named_parameters() if p.requires_grad] != names:
                self._runtime.worker = None
                self._runtime.reusable_client_opt = None
                self._runtime.reusable_group_opts = {}
                self._executor = make_executor(self._client_execution)
        self._runtime.trainable = list(gparams)

    def _close_clients(self, plan: RoundPlan, tally: RoundTally) -> RoundStatistics:
        """The round's statistics summed over all processes; then the failure policy's stops (identical on every
        process, from the reduced counts)."""
        stats = tally.close()
        reduce_statistics(stats, self.trainer, self.global_step)  # global_step is the round being trained
        self._policy.stop_run(plan, stats, tally.stop, self.trainer)
        self._policy.check_round(plan, stats, tally.first_error, type(self.model).__qualname__, tally.first_failure)
        return stats

    def _step_server(self, plan: RoundPlan, stats: RoundStatistics, tally: RoundTally) -> RoundResult:
        """The server step on the reduced statistics (:func:`~fedlightning._round.server_step`), and the round's
        :class:`~fedlightning.state.RoundResult` (its metrics, and every process's healthy clients' losses)."""
        summaries, sigterm, client_lr = share_round_state(
            plan,
            tally.healthy,
            self.trainer,
            self.client_state,
            self._worker_trainer().router,
            self._runtime.sigterm_received,
            self._runtime.client_lr,
        )
        if sigterm:  # a process received SIGTERM: all of them stop at the end of this round
            self._runtime.sigterm_round = plan.round
            note_sigterm(self.trainer)
        metrics, pseudo_gradient = server_step(
            self, self.strategy, self.optimizers(), self._global_params(), stats, plan, client_lr
        )
        n_failed = int(stats["failed"].item())
        self.failed_clients_total += n_failed
        return RoundResult(
            plan=plan,
            num_clients=int(stats["clients"].item()) if "clients" in stats else 0,
            num_failed=n_failed,
            metrics=metrics,
            first_losses=[u[2] for u in summaries],
            mean_losses=[u[3] for u in summaries],
            pseudo_gradient=pseudo_gradient,
            client_ids=[int(u[1]) for u in summaries],
        )

    def _end_round(self, result: RoundResult) -> None:
        """``on_round_end``; the values the client training logged (torchmetrics computed and reset, means) join the
        round's metrics; the client copy's ``on_train_epoch_end``; the metrics logged; the client schedulers of the
        module's ``configure_optimizers()`` stepped once."""
        trainer = self.trainer
        self._federated_hook("on_round_end", result)
        worker = self._worker_trainer()
        router = worker.router
        if worker.client_hooks.epoch_end:  # before the metrics are computed, as in Lightning (it may log one)
            worker.model.on_train_epoch_end()
        logged: dict[str, float] = {}
        if router.metrics:  # torchmetrics syncs their states over the processes
            align_metric_list_states(router, trainer, result.plan.round)
            with named_collective("sync of the torchmetrics metrics logged in training_step", result.plan.round):
                logged.update(router.compute_metrics())
        router.reset_metrics()
        logged.update(client_log_means(router, trainer, result.plan.round))
        taken = sorted(set(logged) & set(result.metrics))
        if taken:
            raise ValueError(
                f"self.log({taken[0].removeprefix('client/')!r}) during client training (the module's training_step "
                f"or a callback's per-client hook) is logged as {taken[0]!r}, which fedlightning logs itself "
                "(docs/configs.md); give the value another name"
            )
        result.metrics.update(logged)
        log_round(trainer, result.metrics, *router.shown_and_hidden())
        mo = self._runtime.module_optimizer
        if mo is not None and mo.schedulers:  # only built when client_optimizer is None
            # the round's own metrics: a validation metric waits for the validation after the round
            # (ModuleOptimizer.step_schedulers; _LoopCallback steps it)
            if mo.step_schedulers(result.plan.round, dict(result.metrics)):
                self._forget_reusable_optimizers()  # their snapshots hold the previous round's lr

    def _after_validation(self, trainer: pl.Trainer) -> None:
        """After a validation of the global model during a fit: the client schedulers waiting for its metrics."""
        mo = self._runtime.module_optimizer
        if mo is not None and mo.waiting and mo.step_after_validation(dict(trainer.callback_metrics)):
            self._forget_reusable_optimizers()

    # ================================================================== evaluation on the global model
    # Lightning passes ``dataloader_idx`` only with several loaders of the stage (and then requires the step to take
    # it); the loop's steps accept it either way and hand it on exactly when Lightning would.
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None):
        return self._evaluation_step("validation_step", batch, batch_idx, dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None):
        return self._evaluation_step("test_step", batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None):
        return self._evaluation_step("predict_step", batch, batch_idx, dataloader_idx)

    def _evaluation_step(self, hook: str, batch: Any, batch_idx: int, dataloader_idx: int | None):
        """The global model's ``hook`` on one batch, with ``dataloader_idx`` as plain Lightning passes it (only when
        the stage has several loaders; a step without that argument then stops the run, as in Lightning)."""
        step = getattr(self.model, hook)
        if dataloader_idx is None:
            return step(batch, batch_idx)
        if not is_param_in_hook_signature(step, "dataloader_idx"):
            raise RuntimeError(
                f"several dataloaders reach {type(self.model).__name__}.{hook}(), but it has no `dataloader_idx` "
                "argument; add `dataloader_idx=0` to its signature"
            )
        return step(batch, batch_idx, dataloader_idx=dataloader_idx)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    # ============================================================= the user's hooks (README: "What your module sees")
    # Fit-level and evaluation hooks are forwarded to the global model (_FORWARDED_HOOKS, installed below the
    # class). Training hooks are mapped by client training instead (fedlightning.user_module.ClientHooks;
    # on_train_epoch_start/_end once per round on the client working copy), so the loop's own train batch/epoch
    # hooks are not forwarded.
    def configure_callbacks(self):
        """The user module's callbacks (at a fit, after :func:`~fedlightning._validation.check_step_settings`); and,
        when the Trainer has Lightning's default progress bar ("Epoch 0": tqdm,
        or rich when the ``rich`` package is installed), the round-counting bar of the same kind and options in its
        place (the CLI adds that bar itself; this gives it to Python users too)."""
        trainer = attached_trainer(self)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_step_settings(trainer)  # before Lightning's own check, which would advise automatic optimization
            check_refused_callbacks(trainer)  # before their setup (BackboneFinetuning's fails on the loop)
        callbacks = self.model.configure_callbacks() or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        bar = round_bar_for(trainer.progress_bar_callback) if trainer is not None else None
        if bar is not None:  # replaced: Lightning drops a trainer callback that a configure_callbacks one subclasses
            callbacks.append(bar)
        if trainer is None or not any(isinstance(cb, _LoopCallback) for cb in trainer.callbacks):
            callbacks.append(_LoopCallback())  # once per Trainer (fit, then test, call this again)
        return callbacks

    #: Log the user's module's ``save_hyperparameters()`` with the loggers at the start of a fit, as Lightning does
    #: for a module it trains directly (:attr:`hparams_initial`). ``train.py`` turns it off: its runs log the whole
    #: resolved config, which holds the module's arguments under ``model.model.init_args`` and whose top-level keys
    #: (``optimizer``, ``seed_everything``, ...) a module's hyper-parameter of the same name would overwrite.
    log_module_hparams: bool = True

    #: Warn when a fit resumes from a checkpoint written with other settings (:meth:`_compare_resumed_settings`).
    #: ``train.py`` turns it off: it compares the whole stored config itself and refuses unless told otherwise.
    compare_resumed_settings: bool = True

    @property
    def hparams_initial(self) -> Any:
        """The user's module's ``save_hyperparameters()`` as it called it: what Lightning logs with the loggers at
        the start of a fit (merged with the data module's, as for a module trained directly); the loop saves none
        of its own. Checkpoints keep storing the loop's own (empty) ``hparams``, so a resume never depends on how
        the user's hyper-parameters unpickle (``load_global_model`` reads the user's module's file either way)."""
        return self.model.hparams_initial

    def on_fit_start(self) -> None:
        """A missing ``init_weights`` file stops a run that does not resume (see :meth:`_load_init_weights`); then
        the user's module's ``on_fit_start``; then the user's module's hyper-parameters are logged if it saved them
        for the logger (:attr:`hparams_initial`)."""
        trainer = attached_trainer(self)
        resumed = trainer is not None and trainer.ckpt_path is not None
        if self._init_weights_missing and not resumed:
            raise CheckpointError(self.init_weights, "file not found (model.init_weights)")
        self._runtime.trainable = None  # fixed again at this fit's first round (_check_trainable)
        entries, self._runtime.new_run_entries = self._runtime.new_run_entries, None
        if entries is not None and not resumed:  # _begin_fit reset a used loop's state
            rank_zero_info(
                "trainer.fit starts a new federated run at round 0 from the module's current weights: the loop's "
                f"client state from its previous fit ({entries} entries) and the federated callbacks' state start "
                "afresh (to continue a run, resume from its checkpoint with ckpt_path)"
            )
        self.model.on_fit_start()
        if self.log_module_hparams:  # Lightning logs hparams_initial after on_fit_start
            log_hyperparameters_like(self, self.model)

    def apply_server_settings_on_resume(self) -> None:
        """Resume with this run's server strategy settings (the CLI calls it for ``--resume_mismatch=allow`` when
        the strategy's settings differ from the checkpoint's): Lightning restores the checkpoint's server optimizer,
        whose hyper-parameters (``lr``, ``betas``, ``eps``, ...) would override the strategy's; after that restore
        (:meth:`on_train_start`) they are set from the strategy's ``configure_server_optimizer``, while the
        optimizer's state (momentum, moments) is kept."""
        self._server_settings_from_config = True

    def on_train_start(self) -> None:
        """After Lightning's restore of a checkpoint: the server optimizer's hyper-parameters from this run's strategy
        when :meth:`apply_server_settings_on_resume` asked for it; then the user's module's ``on_train_start``."""
        if self._server_settings_from_config:
            self._server_settings_from_config = False
            (optimizer,) = self.trainer.optimizers
            fresh = self.strategy.configure_server_optimizer(self._global_params())
            if type(fresh) is not type(optimizer) or len(fresh.param_groups) != len(optimizer.param_groups):
                raise CheckpointError(
                    str(self.trainer.ckpt_path),
                    f"its server optimizer ({type(optimizer).__name__}, {len(optimizer.param_groups)} group(s)) is "
                    f"not the one {type(self.strategy).__name__} builds ({type(fresh).__name__}, "
                    f"{len(fresh.param_groups)} group(s)): a run cannot resume with another server optimizer",
                )
            for group, configured in zip(optimizer.param_groups, fresh.param_groups):
                group.update({k: v for k, v in configured.items() if k != "params"})
        self._keep_an_early_stop()
        self._defer_sigterm()
        self.model.on_train_start()

    def _defer_sigterm(self) -> None:
        """With several processes: SIGTERM only marks this process (no collective in the signal handler,
        :func:`~fedlightning._lightning_compat.defer_sigterm`); the round's exchange of client summaries carries the
        mark (:func:`~fedlightning._round.share_round_state`), and every process stops at the end of the first round
        whose exchange carries one, its checkpoint callbacks' files written (:attr:`stopping_on_sigterm`)."""
        runtime = self._runtime
        runtime.sigterm_received, runtime.sigterm_round = False, None
        trainer = self.trainer
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            defer_sigterm(trainer, self._mark_sigterm)

    def _mark_sigterm(self) -> None:
        self._runtime.sigterm_received = True

    @property
    def stopping_on_sigterm(self) -> bool:
        """Whether every process stops at the end of this round because one of them received SIGTERM (several
        processes; a one-process run stops on its own SIGTERM as Lightning does)."""
        return self._runtime.sigterm_round is not None

    def _keep_an_early_stop(self) -> None:
        """A run resumed from the checkpoint of a run that an ``EarlyStopping`` stopped trains no further round while
        that callback is still configured: the checkpoint restores its state (``stopping_reason``) and the run it
        resumes had ended there, so resuming a finished run (a restart loop that runs ``--ckpt_path last`` again)
        changes nothing, as resuming after ``max_steps`` changes nothing. Lightning alone would go on training
        until the callback's next check (its ``patience`` and counters come from the checkpoint too). To train on
        from such a checkpoint, resume without that ``EarlyStopping`` (``docs/reliability.md``). Lightning versions
        before 2.5 do not record a stopping reason; there the resumed run trains on, as Lightning's does."""
        trainer = self.trainer
        if trainer.ckpt_path is None:
            return
        for callback in trainer.early_stopping_callbacks:
            reason = getattr(callback, "stopping_reason", None)
            if reason is None or reason.name == "NOT_STOPPED":
                continue
            trainer.should_stop = True
            message = getattr(callback, "stopping_reason_message", None) or reason.name
            rank_zero_info(
                f"{type(callback).__name__}(monitor={callback.monitor!r}) stopped the run this checkpoint comes from "
                f"at round {trainer.global_step} ({message}); no further round is trained. Resume without that "
                "callback to train on from it"
            )
            return

    def on_train_end(self) -> None:
        """The user's module's ``on_train_end``, then the end-of-run check of the failure policy (a run in which no
        round had a healthy client fails: ``max_failed_rounds``). Lightning calls the callbacks' ``on_train_end``
        (checkpoints) before this hook."""
        self.model.on_train_end()
        self._warn_unsaved_final_round()
        self._policy.check_run(int(self.global_step))

    def _warn_unsaved_final_round(self) -> None:
        """A warning when checkpoint callbacks ran and none holds the round training ended at (Lightning's
        ``ModelCheckpoint`` saves at its own interval, or after validations: a run of 7 rounds validated every 2
        ends with round 6 in its files); :class:`~fedlightning.checkpoint.RoundCheckpoint` with ``save_last``,
        train.py's default, saves the final round. Decision (ours): warn rather than write a file the user's callback
        did not ask for."""
        trainer = self.trainer
        callbacks = trainer.checkpoint_callbacks
        step = int(trainer.global_step)
        if step == 0 or not callbacks:
            return
        newest = max((s for s in map(saved_step, callbacks) if s is not None), default=None)
        if newest is not None and newest >= step:
            return
        held = (
            f"the newest checkpoint file holds round {newest}"
            if newest is not None
            else "no checkpoint file was written"
        )
        rank_zero_warn(
            f"training ended at round {step} and {held}: the final model is only in memory. Add "
            "fedlightning.checkpoint.RoundCheckpoint(save_last=True) (it also saves the round training ends at; "
            "train.py's default) or call trainer.save_checkpoint(path)"
        )

    # ============================================================= evaluation of the global model
    def on_validation_start(self) -> None:
        self._begin_evaluation("val_dataloaders")
        self.model.on_validation_start()

    def on_validation_end(self) -> None:
        self._runtime.before_validation = False
        try:
            self.model.on_validation_end()
        finally:
            self._end_evaluation()

    def on_test_start(self) -> None:
        self._begin_evaluation("test_dataloaders")
        self._test_at_last_round()
        self.model.on_test_start()

    def on_test_end(self) -> None:
        try:
            self.model.on_test_end()
        finally:
            self._end_evaluation()
            self._end_test_at_last_round()

    def _test_at_last_round(self) -> None:
        """A test of the Trainer's fitted model (``trainer.test`` after ``trainer.fit``, as ``train.py`` runs it)
        logs at the step of the fit's last round, next to that round's metrics and validation
        (:func:`~fedlightning._lightning_compat.logged_at_last_round`), until :meth:`on_test_end`. Decision (ours):
        the same step whether the test runs from Python or from the CLI; Lightning's own step there is one past the
        last round."""
        self._end_test_at_last_round()
        trainer = attached_trainer(self)
        if trainer is not None and trainer.global_step > 0:
            context = logged_at_last_round(trainer)
            context.__enter__()
            self._runtime.test_step_context = context

    def _end_test_at_last_round(self) -> None:
        context, self._runtime.test_step_context = self._runtime.test_step_context, None
        if context is not None:
            context.__exit__(None, None, None)

    def _begin_evaluation(self, loaders: str) -> None:
        """With several processes that each evaluate the whole split (the data modules' evaluation loaders,
        :class:`~fedlightning.datamodules.base.WholeSplitSampler`), the global model's torchmetrics metrics compute
        from this process's states until :meth:`_end_evaluation` (``_lightning_compat.unsynced_metrics``): a sync
        over the processes would count every sample once per process (a ``SumMetric``, a confusion matrix; ratios
        such as accuracy would not change). Evaluation loaders that Lightning splits over the processes (a user's own
        ``val_dataloader``, given a ``DistributedSampler``) keep torchmetrics' sync."""
        self._end_evaluation()
        trainer = attached_trainer(self)
        if trainer is None or trainer.world_size <= 1 or not _whole_split(getattr(trainer, loaders, None)):
            return
        stack = contextlib.ExitStack()
        stack.enter_context(unsynced_metrics(self.model))
        self._runtime.evaluation = stack

    def _end_evaluation(self) -> None:
        stack, self._runtime.evaluation = self._runtime.evaluation, None
        if stack is not None:
            stack.close()

    # ================================================================== checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        mo = self._runtime.module_optimizer
        checkpoint["fedlightning"] = {
            "format": 1,
            "client_state": self.client_state.state_dict(),
            "failed_clients_total": self.failed_clients_total,
            "rounds_without_healthy_client": self.rounds_without_healthy_client,
            "module_optimizer": mo.state_dict() if mo is not None else None,
            "client_groups": self._client_groups_state(),
            "validation_pending": self._validation_pending(),
            "settings": self._resume_settings(),
            "non_persistent_buffers": non_persistent_buffers(self.model),
        }
        self.model.on_save_checkpoint(checkpoint)

    def _resume_settings(self) -> dict[str, Any]:
        """What decides this run's training beyond the weights and state a checkpoint holds, as plain values
        (safe to load): the loop's round settings, the client optimizer's class and defaults, every federated
        callback's class and the plain arguments it keeps under their own names, and the data module's batch size
        and client split (a hash of every client's sample indices). Read by :meth:`_compare_resumed_settings`."""
        out: dict[str, Any] = {
            name: getattr(self, name, None)
            for name in (
                "local_steps",
                "local_epochs",
                "clients_per_round",
                "seed",
                "client_grad_clip",
                "persist_client_state",
                "max_update_norm",
                "on_client_failure",
            )
        }
        out = {k: v if _plain_setting(v) else repr(v) for k, v in out.items()}
        try:
            opt = self._client_factory()(self._global_params())
            defaults = {k: v for k, v in sorted(opt.defaults.items()) if _plain_setting(v)}
            out["client_optimizer"] = f"{type(opt).__qualname__}({_arguments(defaults)})"
        except Exception:  # noqa: BLE001 - a factory that cannot be built here is left out of the comparison
            pass
        trainer = attached_trainer(self)
        if trainer is not None:
            out["callbacks"] = [_describe_callback(cb) for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
            dm = trainer.datamodule
            if isinstance(dm, FederatedDataModule) and dm.client_indices:
                digest = hashlib.sha1()
                for ix in dm.client_indices:
                    digest.update(np.asarray(ix, dtype=np.int64).tobytes() + b"|")
                out["data"] = (
                    f"{type(dm).__qualname__}(batch_size={dm.batch_size}, clients={len(dm.client_indices)}, "
                    f"split {digest.hexdigest()[:12]})"
                )
        return out

    def _compare_resumed_settings(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """A fit resuming from a checkpoint whose :meth:`_resume_settings` differ from this run's warns, listing each
        difference. Decision (ours): a warning, not a refusal, as plain Lightning resumes with changed settings (a
        second stage with another learning rate); but such a run is not the checkpoint's run continued, which a
        silent resume would let one believe (a changed ``clients_per_round``, seed, strategy or client split).
        ``train.py`` compares its whole stored config instead and refuses (``--resume_mismatch``)."""
        saved = checkpoint.get("fedlightning", {}).get("settings")
        if not self.compare_resumed_settings or not isinstance(saved, dict):
            return
        now = self._resume_settings()
        diffs = [
            f"{key}: checkpoint {saved[key]!r} -> now {now[key]!r}"
            for key in sorted(saved.keys() & now.keys())
            if saved[key] != now[key]
        ]
        if diffs:
            rank_zero_warn(
                f"the checkpoint {trainer.ckpt_path} was written by a run with other settings, and this fit trains "
                "on with its own, so it does not continue that run as it was:\n  " + "\n  ".join(diffs)
            )

    def _validation_pending(self) -> int | None:
        """The round a checkpoint written now holds before the validation that Lightning runs after it (a
        ``ModelCheckpoint`` saving at the round's end, before that validation), else None. A run resumed from such a
        file does not run that validation (:meth:`_tell_validation_pending`)."""
        trainer = attached_trainer(self)
        if trainer is None or not self._runtime.before_validation or trainer.validating:
            return None
        return int(trainer.global_step) if validation_follows(trainer) else None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The loop's own state; and first the precision plugin's conversion of the modules (``64-true``: float64),
        which Lightning otherwise makes after loading the weights: a float64 checkpoint loaded into the float32
        parameters a module is built with would be rounded to float32 (a resumed run then leaves the uninterrupted
        one by that rounding; converting twice is a no-op)."""
        fed = checkpoint.get("fedlightning")
        if fed is None:
            raise ValueError("this checkpoint was not written by a FederatedLoop (no 'fedlightning' section)")
        if fed.get("format") != 1:
            raise ValueError(f"unsupported fedlightning checkpoint format {fed.get('format')!r}")
        trainer = attached_trainer(self)
        if trainer is not None:
            trainer.precision_plugin.convert_module(self)
            _say_nothing_to_train(trainer, checkpoint)
            if trainer.state.fn == TrainerFn.FITTING:  # the file resumes training: it must hold the training state
                check_resumable(str(trainer.ckpt_path), checkpoint)
                self._check_server_optimizer_kind(trainer, checkpoint)
                self._compare_resumed_settings(trainer, checkpoint)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            _tell_validation_pending(checkpoint)
            _confine_checkpoint_paths(checkpoint)
        settle_unprocessed_batch(checkpoint)  # a file of a run stopped at a round's start: that round not begun
        if trainer is not None and _trains_on(trainer, checkpoint):
            reopen_ended_epoch(checkpoint)  # a finished fit extended: its epoch goes on
        self.client_state.load_state_dict(fed["client_state"])
        self.failed_clients_total = int(fed.get("failed_clients_total", 0))
        self.rounds_without_healthy_client = int(fed.get("rounds_without_healthy_client", 0))
        saved = fed.get("module_optimizer")
        if saved is not None:
            saved = {**saved, "validation_pending": _pending_validation(checkpoint)}
            mo = self._runtime.module_optimizer
            if mo is not None:
                mo.load_state_dict(saved)
                self._forget_reusable_optimizers()
            else:  # restored before setup resolved it (e.g. validate/test): applied when it is built
                self._runtime.pending_module_optimizer_state = saved
        self._load_client_groups_state(fed.get("client_groups"))
        load_non_persistent_buffers(self.model, fed.get("non_persistent_buffers"))
        self.model.on_load_checkpoint(checkpoint)

    def _check_server_optimizer_kind(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Raise :class:`~fedlightning.checkpoint.CheckpointError` when the checkpoint's server optimizer is of another
        kind than the one this run's strategy builds: its parameter groups have other settings (Adam's ``betas`` /
        ``eps`` against SGD's ``momentum`` / ``dampening``), or other groups. torch's ``load_state_dict`` would load
        it anyway, leaving one optimizer with both kinds' settings and Adam's moments in SGD's state. Decision
        (ours): the flags that torch versions add (``foreach``, ``fused``, ``capturable``, ``differentiable``,
        ``maximize``, ``decoupled_weight_decay``) do not count; a setting whose value is a string names the update
        rule and counts with its value (FedAdam's ``rule="adam"`` against FedAMS's ``"ams"``: the same optimizer class
        and settings, but FedAMS needs a state FedAdam never kept, and FedYogi's or FedAdagrad's second moments mean
        something else than Adam's); in the command line, ``--resume_mismatch=allow`` does
        not lift this refusal (it resumes with this run's settings of the same optimizer)."""
        saved = checkpoint.get("optimizer_states")
        if not saved or self.strategy is None:
            return
        groups = saved[0].get("param_groups") if isinstance(saved[0], dict) else None
        if not isinstance(groups, list) or not groups:
            return
        fresh = self.strategy.configure_server_optimizer(self._global_params())
        flags = {"params", "foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"}
        theirs = {k for g in groups if isinstance(g, dict) for k in g} - flags
        ours = {k for g in fresh.param_groups for k in g} - flags

        def described(keys: set[str], gs: list) -> str:  # its settings, the update rules they name, its groups
            rules = sorted(
                {f"{k}={v!r}" for g in gs if isinstance(g, dict) for k, v in g.items() if isinstance(v, str)}
            )
            return f"settings {sorted(keys)}{''.join(', ' + r for r in rules)}, {len(gs)} group(s)"

        theirs_kind, ours_kind = described(theirs, groups), described(ours, fresh.param_groups)
        if theirs_kind == ours_kind:
            return
        raise CheckpointError(
            str(trainer.ckpt_path),
            f"its server optimizer ({theirs_kind}) is not the kind {type(self.strategy).__name__} builds "
            f"({type(fresh).__name__}: {ours_kind}): a run cannot resume with another server optimizer",
        )

    def _client_groups_state(self) -> dict[str, Any] | None:
        """How vectorised execution runs, as far as a measurement decided it: the group size in force (measured for
        ``max_parallel_clients="auto"``, or halved after running out of memory) with the setting it came from, and
        ``client_execution="auto"``'s choice with its reason and the device type it was measured on, and the padded
        steps' path once it left loss interception (``padded_path``); None when the settings alone give it."""
        run = getattr(self._executor, "run", None)
        if run is None:
            return None
        out: dict[str, Any] = {}
        if run.group_size is not None:
            out.update(max_parallel_clients=self.max_parallel_clients, group_size=int(run.group_size))
        padded = run.engine.padded_path_state if run.engine is not None else run.padded_path
        if padded is not None:
            out["padded_path"] = dict(padded)
        if run.mode == "auto" and run.choice is not None:
            out["auto"] = {
                "choice": run.choice,
                "reason": run.reason,
                "fallback": bool(run.fallback),
                "device": self.device.type,
            }
        return out or None

    def _load_client_groups_state(self, saved: dict[str, Any] | None) -> None:
        """A resumed run trains in the groups the interrupted one had reached (the group seeds the dropout masks of
        its clients, so the resumed run equals the uninterrupted one), unless ``max_parallel_clients`` was changed
        since: then the new setting applies. ``client_execution="auto"`` keeps the choice measured before the
        resume on the same device type (decision, ours: a new measurement could choose the other mode, whose
        rounding differs in the last bits, and the resumed run would no longer equal the uninterrupted one); on
        another device type it measures again. Padded steps keep the per-sample path the interrupted run had moved
        to (a check or a call of loss interception failed in a round before the checkpoint; the two paths round
        differently in the last bits)."""
        run = getattr(self._executor, "run", None)
        if run is None or not saved:
            return
        padded = saved.get("padded_path")
        run.padded_path = dict(padded) if isinstance(padded, dict) else None
        if run.engine is not None:
            run.engine.pin_padded_path(run.padded_path)
        size = saved.get("group_size")
        same_setting = saved.get("max_parallel_clients") == self.max_parallel_clients
        if same_setting and isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            run.group_size = size
        auto = saved.get("auto")
        if (
            run.mode == "auto"
            and isinstance(auto, dict)
            and auto.get("choice") in ("vectorized", "sequential")
            and auto.get("device") == self.device.type
        ):
            run.choice, run.reason = auto["choice"], auto.get("reason")
            run.fallback = bool(auto.get("fallback")) or run.choice == "sequential"
            rank_zero_info(
                f"client_execution='auto': training clients {run.choice} as measured before the resume ({run.reason})"
            )


def check_launcher(trainer: pl.Trainer) -> None:
    """Refuse a strategy that runs the fit in processes it launches from ``fit`` and hands back only the weights
    (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``; :func:`~fedlightning._lightning_compat.spawns_processes`): the
    process that called ``fit`` would keep the loop's round counter, client state and strategy state as they were
    before round 0. Called by :meth:`FederatedLoop.setup` and, before the processes start, by ``train.py``."""
    if spawns_processes(trainer):
        raise SettingError(
            "trainer.strategy",
            f"{type(trainer.strategy).__name__} launched by fit in new processes (ddp_spawn, ddp_fork, "
            "ddp_notebook) hands back only the weights: the round counter, the client state (SCAFFOLD's control "
            "variates, ...) and the strategy's state would stay at their start in the process that called fit, so "
            "a checkpoint or a test after fit would be wrong; use strategy=ddp (Lightning starts one process per "
            "device from the script)",
        )


#: The parameter dtype of Lightning's ``*-true`` half precisions (its precision plugin converts the module to it).
_TRUE_HALF_DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


def _training_dtypes(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    """The dtypes the client optimizer's parameters train in: their own, and the one the precision plugin converts
    the module to (``16-true``: float16), which it may not have done yet at ``setup``."""
    dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
    converted = _TRUE_HALF_DTYPES.get(str(getattr(trainer, "precision", "")))
    return dtypes | {converted} if converted is not None else dtypes


def _check_test_fraction(trainer: pl.Trainer, dm: FederatedDataModule) -> None:
    """At a fit's setup, refuse a fraction ``trainer.limit_test_batches`` of the data module's test batches that
    keeps none of them (Lightning's error, raised only when the test after the fit starts: after every round has
    trained). Data modules without a test set pass (``train.py`` then skips the test)."""
    fraction = getattr(trainer, "limit_test_batches", None)
    if not isinstance(fraction, float) or not 0.0 < fraction < 1.0:
        return
    try:
        batches = len(dm.test_dataloader())
    except Exception:  # noqa: BLE001 - no test set (or no length): nothing to check here
        return
    if int(batches * fraction) < 1:
        raise SettingError(
            "trainer.limit_test_batches",
            f"limit_test_batches={fraction!r} of the {batches} test batch(es) keeps none of them "
            f"(int({batches} * {fraction!r}) = 0); use 1.0, an integer number of batches, or 0 for no test",
        )


def _resumed_rounds(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> tuple[int, int] | None:
    """``(rounds in the checkpoint, trainer.max_steps)`` when a fit resumes from ``checkpoint`` under a positive
    ``max_steps``; None otherwise (not a fit, no round count, no bound)."""
    rounds, max_steps = checkpoint.get("global_step"), trainer.max_steps
    if trainer.state.fn != TrainerFn.FITTING or not isinstance(rounds, int) or max_steps is None or max_steps <= 0:
        return None
    return rounds, max_steps


def _trains_on(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether a fit resumes from ``checkpoint`` with rounds left to train under ``trainer.max_steps``."""
    resumed = _resumed_rounds(trainer, checkpoint)
    return resumed is not None and resumed[1] > resumed[0]


def _confine_checkpoint_paths(checkpoint: dict[str, Any]) -> None:
    """Drop the file paths a ``ModelCheckpoint``'s saved state names outside its own ``dirpath`` (``best_k_models``,
    ``best_model_path``, ``kth_best_model_path``, ``last_model_path``), before Lightning restores the callbacks: a
    resumed run removes the files of those paths that fall out of its top k, and a crafted checkpoint could name any
    file (``<dirpath>/../x``, which Lightning's own check, on unresolved paths, takes for one inside). Decision
    (ours): paths are compared resolved (``..`` and links); a dropped top-k entry is simply no longer ranked."""
    states = checkpoint.get("callbacks")
    for state in states.values() if isinstance(states, dict) else ():
        if not isinstance(state, dict) or not isinstance(state.get("dirpath"), str) or "best_k_models" not in state:
            continue
        if "://" in state["dirpath"]:
            continue  # a remote folder (fsspec): no local file to protect
        root = os.path.realpath(state["dirpath"])
        best_k = state.get("best_k_models")
        if isinstance(best_k, dict):
            state["best_k_models"] = {p: v for p, v in best_k.items() if _inside(root, p)}
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if state.get(key) and not _inside(root, state[key]):
                state[key] = ""


def _inside(root: str, path: Any) -> bool:
    """``path`` is a file path under the resolved folder ``root`` once resolved itself."""
    return isinstance(path, str) and os.path.commonpath([root, os.path.realpath(path)]) == root


def _pending_validation(checkpoint: dict[str, Any]) -> int | None:
    """The rounds done when the file was written before the validation Lightning runs after them (the loop's record
    ``validation_pending``, or a callback's in files written before the loop kept one); None if it was not."""
    pending = checkpoint["fedlightning"].get("validation_pending")
    if pending is not None:
        return int(pending)
    states = checkpoint.get("callbacks")
    states = states if isinstance(states, dict) else {}
    for v in states.values():
        if isinstance(v, dict) and v.get("validation_pending") is not None:
            return int(v["validation_pending"])
    return None


def _tell_validation_pending(checkpoint: dict[str, Any]) -> None:
    """Warn when the file holds a round before the validation Lightning ran after it: written at the round's end
    (by a ``ModelCheckpoint``, or by :class:`~fedlightning.checkpoint.RoundCheckpoint` in a run that stopped during
    that validation). The resumed run goes on with the next round and never runs it. The round is the loop's
    record (``validation_pending``), or a callback's (files written before the loop kept one)."""
    pending = _pending_validation(checkpoint)
    if pending is None:
        return
    states = checkpoint.get("callbacks")
    states = states if isinstance(states, dict) else {}
    hint = (
        ""
        if any(str(k).startswith("RoundCheckpoint") for k in states)
        else " (fedlightning.checkpoint.RoundCheckpoint writes its files again after the validation)"
    )
    rank_zero_warn(
        f"the checkpoint holds round {pending} as it was before that round's validation, written at the round's end"
        f"{hint}; the resumed run goes on with round {pending + 1} and does not run that validation: its metrics are "
        "not logged, and callbacks acting on them (EarlyStopping, a monitored checkpoint, a scheduler stepped on a "
        "validation metric) do not see them"
    )


def _say_nothing_to_train(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """A warning when a fit resumes from a checkpoint at or past ``trainer.max_steps`` rounds: no round trains (the
    run would otherwise end with Lightning's "max_steps reached" only, and ``train.py`` test the checkpoint's
    model); a fit that should go on needs a larger ``max_steps``."""
    resumed = _resumed_rounds(trainer, checkpoint)
    if resumed is not None and resumed[1] <= resumed[0]:
        rounds, max_steps = resumed
        rank_zero_warn(
            f"the checkpoint is at round {rounds}, at or past trainer.max_steps={max_steps}: no round trains in "
            f"this fit; set max_steps above {rounds} to train on"
        )


def _whole_split(loaders: Any) -> bool:
    """Whether every evaluation DataLoader in ``loaders`` (one, a list, a dict, or None) reads its whole split in
    every process (its sampler a :class:`~fedlightning.datamodules.base.WholeSplitSampler`)."""
    if loaders is None:
        return False
    items = list(loaders.values()) if isinstance(loaders, dict) else loaders
    items = list(items) if isinstance(items, (list, tuple)) else [items]
    return bool(items) and all(isinstance(getattr(dl, "sampler", None), WholeSplitSampler) for dl in items)


def _defines_hook(callback: Any, name: str) -> bool:
    """Whether ``callback`` has a federated hook ``name`` other than :class:`FederatedCallback`'s no-op."""
    method = getattr(callback, name, None)
    if not callable(method):
        return False
    return getattr(method, "__func__", method) is not getattr(FederatedCallback, name)


def _plain_setting(value: Any) -> bool:
    """Whether ``value`` is a plain setting (compared and stored as it is): a number, string, bool, None, or a
    tuple / list of them."""
    if isinstance(value, (tuple, list)):
        return all(_plain_setting(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _arguments(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def _describe_callback(callback: FederatedCallback) -> str:
    """``Class(arg=value, ...)``: the plain arguments of the callback's ``__init__`` it keeps as attributes of the
    same name (``FedAvg(server_lr=1.0, ...)``); arguments kept under other names are not seen."""
    try:
        names = [n for n in inspect.signature(type(callback).__init__).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []
    kept = {n: getattr(callback, n) for n in names if hasattr(callback, n)}
    return f"{type(callback).__qualname__}({_arguments({k: v for k, v in kept.items() if _plain_setting(v)})})"


class _LoopCallback(pl.Callback):
    """The loop's own callback, one per Trainer (:meth:`FederatedLoop.configure_callbacks`).

    It runs :meth:`FederatedLoop._after_validation` at the end of each validation of a fit: as a callback, before
    every ``ModelCheckpoint`` (Lightning orders those last), so a checkpoint written after the validation holds the
    scheduler steps it caused.

    A fit that ``max_time`` stops (Lightning's ``Timer``) ends after the round in progress without the validation
    Lightning runs on every stop request, unless one was due after that round anyway
    (:func:`~fedlightning._lightning_compat.skip_validation_of_timed_stop`). Decision (ours): where the clock stops
    a run is the machine's speed, not the config's, and a validation there would reach what acts on validations
    (``EarlyStopping``'s patience and best score, ``ReduceLROnPlateau``, a monitored ``ModelCheckpoint``), so the
    run resumed from its last round would not train as the uninterrupted run does. The run's last metrics are
    those of its last scheduled validation.

    It also gives a fit that SIGTERM stopped a nonzero exit status: Lightning ends such a fit with a
    ``SIGTERMException``, a ``SystemExit`` without a code, so a Python script that does not catch it exits with
    status 0, and a restart loop or a job scheduler takes the preempted run for a finished one. The exception keeps
    its type and gets the code :data:`~fedlightning.checkpoint.SIGTERM_EXIT_STATUS` (143, as a shell reports a
    process that SIGTERM ended; ``train.py`` exits with the same status), with a warning naming the rounds done."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if skip_validation_of_timed_stop(trainer):
            pl_module._runtime.before_validation = False  # a file written from now on holds no pending validation

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            pl_module._after_validation(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and exception.code is None:
            exception.code = SIGTERM_EXIT_STATUS
            rank_zero_warn(
                f"the run received SIGTERM and stopped after round {trainer.global_step}: trainer.fit ends with "
                f"SIGTERMException (exit status {SIGTERM_EXIT_STATUS}); resume from the last saved round with "
                "trainer.fit(..., ckpt_path=...)"
            )


for _name in _FORWARDED_HOOKS:
    if _name not in FederatedLoop.__dict__:  # on_fit_start, on_train_start, on_train_end forward themselves
        setattr(FederatedLoop, _name, _forward_to_model(_name))


def _check_configured_optimizer(owner: str, optimizer: Any, params: Sequence[Tensor]) -> None:
    """What a ``configure_client_optimizer`` hook returned in place of the client optimizer: an optimizer (its
    ``param_groups``, ``step``, ``zero_grad``) over the client model's parameters only (the docs: a wrapper over the
    same parameters). An optimizer over other tensors would leave the client's model untrained while its round
    counts as healthy: a ``TypeError`` naming the hook."""
    where = f"{owner}.configure_client_optimizer"
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")):
        raise TypeError(
            f"{where} returned {type(optimizer).__name__}, not an optimizer (with param_groups, step and zero_grad); "
            "return the client optimizer it receives, a wrapper over the same parameters, or None"
        )
    own = {id(p) for p in params}
    foreign = sum(1 for g in groups for p in g.get("params", []) if id(p) not in own)
    if foreign:
        raise TypeError(
            f"{where} returned a {type(optimizer).__name__} over {foreign} tensor(s) that are not the client model's "
            "parameters, so the client's model would not train; build it over the parameters of the optimizer the "
            "hook receives (optimizer.param_groups), or return None"
        )


def _check_parameters_unwritten(
    owners: list[str], client_id: int, before: list[Tensor], params: Sequence[Tensor]
) -> None:
    """A ``configure_client_optimizer`` hook must leave the client's parameters (the optimizer's) as they were.

    Decision (ours): every client starts its local training from the global weights ``w_t``, which are written into
    the client's working copy after this hook, in sequential and vectorised training alike; a value the hook writes
    there (personal weights, say) would be overwritten without a trace, so a write is refused, naming the hook.
    Compared bit for bit (a NaN left by the previous client counts as unchanged), for callbacks other than
    fedlightning's own: one copy of the client's parameters per client while such a callback defines the hook."""
    changed = [
        i
        for i, (old, p) in enumerate(zip(before, params))
        if not torch.equal(old.reshape(-1).view(torch.uint8), p.detach().reshape(-1).view(torch.uint8))
    ]
    if changed:
        raise ValueError(
            f"{' / '.join(owners)}.configure_client_optimizer changed client {client_id}'s parameters ({len(changed)} "
            "of the optimizer's parameter tensors): a client starts its training from the global model's weights, "
            "written after this hook, so the change would be lost; set server-held state into the optimizer (its "
            "state or param_groups) or the client_objective, not into the parameters"
        )


def _objective_terms(owner: str, extra: Any) -> list:
    """The terms a ``client_objective`` hook returned: None (no term) or a list (or tuple) of callables ``term(params)
    -> scalar tensor``; anything else is a ``TypeError`` naming the hook."""
    if extra is None:
        return []
    if not isinstance(extra, (list, tuple)):
        raise TypeError(
            f"{owner}.client_objective returned {type(extra).__name__}; it must return a list of terms (callables "
            "term(params) -> scalar tensor), or None: e.g. return [my_term], not my_term"
        )
    bad = next((t for t in extra if not callable(t)), None)
    if bad is not None:
        raise TypeError(
            f"{owner}.client_objective returned a list holding {type(bad).__name__}; every term must be a callable "
            "term(params) -> scalar tensor"
        )
    return list(extra)
