"""Per-client evaluation: how the global model does on every client's own test data (mean, spread, worst clients).

:class:`ClientEvaluation` runs the user's own ``test_step`` (``validation_step`` with ``split="val"``) on each
client's evaluation data (:meth:`~fedlightning.datamodules.FederatedDataModule.client_eval_indices`), every
``every_n_rounds`` rounds and after fit, and logs for every value the module logs the statistics over the clients,
``clients/<name>_{mean,std,min,p10,p50,p90,max}`` (``test/acc`` -> ``clients/test_acc_p10``); with a
``WandbLogger`` also a histogram per value and a per-client table. With ``local_steps=k`` each client first adapts
the global model with ``k`` local steps (personalization studies). Formulas and decisions are in the class's
docstring; :func:`client_statistics` and :func:`wandb_payload` are the pieces it logs with.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from fedlightning._lightning_compat import (
    attached_trainer,
    evaluation_batch,
    metric_state,
    transfer_hook_owners,
    unsynced_metrics,
)
from fedlightning._logging_route import discard, routed_logging
from fedlightning._reference import reference_mode
from fedlightning._validation import flag, integer, one_of
from fedlightning.callbacks.base import FederatedCallback
from fedlightning.datamodules.base import ArrayDataset
from fedlightning.models.base import Classifier
from fedlightning.state import derive_seed, flat_params

__all__ = ["ClientEvaluation", "ClientResults", "STATISTICS", "client_statistics", "metric_key", "wandb_payload"]

#: The statistics over clients logged for every metric, in this order (:func:`client_statistics`).
STATISTICS = ("mean", "std", "min", "p10", "p50", "p90", "max")


def metric_key(name: str) -> str:
    """The logged name of a metric's statistics: ``"/"`` replaced by ``"_"`` (``"test/acc"`` -> ``"test_acc"``)."""
    return name.replace("/", "_")


def client_statistics(values: Any) -> dict[str, float]:
    """``{statistic: value}`` over the per-client ``values`` (one number per client, float64), for
    :data:`STATISTICS`: ``numpy.mean``, the population ``numpy.std`` (``ddof=0``), ``numpy.min``,
    ``numpy.percentile`` at 10, 50 and 90 (NumPy's default linear interpolation) and ``numpy.max``; every client counts
    once, whatever its number of samples. NaN values (a client whose value is undefined) are left out; with none left,
    every statistic is NaN."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[~np.isnan(v)]
    if not len(v):
        return {s: math.nan for s in STATISTICS}
    p10, p50, p90 = np.percentile(v, [10, 50, 90])
    return {
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "p10": float(p10),
        "p50": float(p50),
        "p90": float(p90),
        "max": float(v.max()),
    }


@dataclass
class ClientResults:
    """One evaluation: the evaluated clients (ids, ascending), their numbers of evaluation samples, and for every
    logged name the per-client values (float64, NaN where a client did not log it), in client order. ``names``: the
    users of natural splits (``client_names``), else None."""

    client_ids: np.ndarray
    num_samples: np.ndarray
    values: dict[str, np.ndarray] = field(default_factory=dict)
    names: list[str] | None = None

    def summary(self, prefix: str = "clients") -> dict[str, float]:
        """``{"<prefix>/<metric_key(name)>_<statistic>": value}`` for every name and statistic, and
        ``"<prefix>/num_clients"``."""
        out: dict[str, float] = {}
        for name in sorted(self.values):
            for stat, value in client_statistics(self.values[name]).items():
                out[f"{prefix}/{metric_key(name)}_{stat}"] = value
        out[f"{prefix}/num_clients"] = float(len(self.client_ids))
        return out


def wandb_payload(results: ClientResults, prefix: str = "clients", table: bool = True) -> dict[str, Any]:
    """What :class:`ClientEvaluation` logs to a W&B run besides the scalars: ``<prefix>/<key>_hist`` (a
    ``wandb.Histogram`` of the clients' finite values) per metric, and ``<prefix>/table`` (a ``wandb.Table`` with one
    row per client: ``client``, ``user`` for natural splits, ``samples``, then the metrics by name)."""
    import wandb

    out: dict[str, Any] = {}
    for name in sorted(results.values):
        v = np.asarray(results.values[name], dtype=np.float64)
        v = v[np.isfinite(v)]
        if len(v):
            out[f"{prefix}/{metric_key(name)}_hist"] = wandb.Histogram(v.tolist())
    if table:
        names = sorted(results.values)
        columns = ["client"] + (["user"] if results.names is not None else []) + ["samples"] + names
        rows = []
        for j, cid in enumerate(results.client_ids.tolist()):
            user = [results.names[j]] if results.names is not None else []
            metrics = [float(results.values[n][j]) for n in names]
            rows.append([int(cid)] + user + [int(results.num_samples[j])] + metrics)
        out[f"{prefix}/table"] = wandb.Table(columns=columns, data=rows)
    return out


class _Recorder:
    """``log`` / ``log_dict`` of a module while one client's batches run through its ``test_step``: each value is
    reduced over the client's batches as Lightning reduces an epoch-level value (class docstring, "Metrics")."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.reduce: dict[str, str] = {}
        self.metrics: dict[str, Any] = {}
        self.batch: Any = None
        self.epoch_end = False  # in the epoch-end hook: a value is logged once, with weight 1

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        if _is_metric(value):
            self.metrics[name] = value
            return
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; a scalar is "
                    "needed (as Lightning requires)"
                )
            v = float(value.detach().double().item())
        elif isinstance(value, (int, float, bool, np.number)):
            v = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; log a number, a scalar tensor or "
                "a torchmetrics Metric"
            )
        fx = _reduction(name, reduce_fx)
        if self.reduce.setdefault(name, fx) != fx:
            raise ValueError(f"{name!r} is logged with reduce_fx {self.reduce[name]!r} and {fx!r} in one evaluation")
        if fx == "mean":
            n = (
                1.0
                if self.epoch_end
                else float(batch_size if batch_size is not None else extract_batch_size(self.batch))
            )
            self.sums[name] = self.sums.get(name, 0.0) + v * n
            self.weights[name] = self.weights.get(name, 0.0) + n
        elif fx == "sum":
            self.sums[name] = self.sums.get(name, 0.0) + v
        else:
            pick = max if fx == "max" else min
            self.sums[name] = pick(self.sums[name], v) if name in self.sums else v

    def log_dict(
        self,
        dictionary: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        for name, value in dictionary.items():
            self.log(name, value, reduce_fx=reduce_fx, batch_size=batch_size)

    def values(self) -> dict[str, float]:
        out = {}
        for name, total in self.sums.items():
            if self.reduce[name] == "mean":
                out[name] = total / self.weights[name] if self.weights[name] else math.nan
            else:
                out[name] = total
        for name, metric in self.metrics.items():
            value = metric.compute()
            if isinstance(value, Tensor) and value.numel() != 1:
                raise ValueError(
                    f"the torchmetrics metric logged as {name!r} computes a tensor of shape "
                    f"{tuple(value.shape)}; self.log needs a scalar metric"
                )
            out[name] = float(value)
        return out


def _reduction(name: str, reduce_fx: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for Lightning's ``reduce_fx`` (a name or the torch function)."""
    known = {
        "mean": "mean",
        "avg": "mean",
        "sum": "sum",
        "max": "max",
        "min": "min",
        torch.mean: "mean",
        torch.sum: "sum",
        torch.max: "max",
        torch.min: "min",
    }
    try:
        return known[reduce_fx]
    except (KeyError, TypeError):
        raise ValueError(
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): ClientEvaluation reduces 'mean', 'sum', "
            "'max' and 'min' over a client's batches"
        ) from None


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(value, Metric)


def _metrics_of(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if _is_metric(m)]


def _precision_plugin(model: Any) -> Any:
    """The precision plugin of the Trainer ``model`` is attached to (None without one)."""
    trainer = attached_trainer(model)
    return getattr(trainer, "precision_plugin", None) if trainer is not None else None


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in ``eval()`` mode without gradients, its torchmetrics metrics computing from this process's states
    alone (every process evaluates the same clients); its mode and its torchmetrics states are as before on exit."""
    was_training = model.training
    saved = [(m, metric_state(m)) for m in _metrics_of(model)]
    model.eval()
    try:
        with torch.no_grad(), unsynced_metrics(model):
            yield
    finally:
        model.train(was_training)
        for m, state in saved:
            for k, v in state.items():
                setattr(m, k, v)


class ClientEvaluation(FederatedCallback):
    r"""The global model evaluated on every client's own test data: statistics over clients, histogram, table.

    For each evaluated client :math:`i` and every value the user's ``test_step`` logs (``validation_step`` with
    ``split="val"``), :math:`v_i` is that value reduced over the client's evaluation batches as Lightning reduces an
    epoch-level value; then for every name::

        <prefix>/<name>_mean = mean_i v_i              <prefix>/<name>_p10, _p50, _p90 = numpy.percentile(v, 10/50/90)
        <prefix>/<name>_std  = sqrt(mean_i (v_i − mean)²)   <prefix>/<name>_min, _max
        <prefix>/num_clients = number of clients evaluated

    (``<name>``: the logged key with ``"/"`` replaced by ``"_"``, so ``test/acc`` gives ``clients/test_acc_p10``;
    :func:`client_statistics`). Every client counts once; a client whose value is NaN (not logged for it, or NaN: a
    diverged adaptation) is left out of that value's statistics, with a warning naming the value and the count. A
    module without the evaluated step (``test_step``; ``validation_step`` with ``split="val"``) is refused at fit
    start, and so are two evaluations with one ``prefix`` (each would overwrite the other's values).
    With a ``WandbLogger`` also ``<prefix>/<name>_hist`` (a
    ``wandb.Histogram`` over the clients) and ``<prefix>/table`` (one row per client: id, user, samples, values;
    :func:`wandb_payload`).

    Args:
        every_n_rounds: evaluate after every ``n``-th round (after the server step of round ``r`` when
            ``(r + 1) % n == 0``); None (default, ours: per-client evaluation is the report of a finished model and
            costs a pass over every client's data) evaluates after fit only.
        after_fit: evaluate the final global model when training ends (default True), unless the last round's
            scheduled evaluation already evaluated that model.
        clients: None (default): every client with evaluation data; an integer ``m``: a sample of ``m`` of them,
            drawn once without replacement with ``derive_seed(seed, "client-eval-sample")`` and evaluated every time
            (all of them when ``m`` is at least their number).
        split: ``"test"`` (default; the user's ``test_step``) or ``"val"`` (``validation_step``, on the validation
            split's rows; for choosing hyper-parameters on per-client statistics without test data).
        local_steps: 0 (default): the global model itself. ``k > 0``: local adaptation, each client's model is the
            global model after ``k`` local steps on the client's training data (below).
        assignment: how partitioned data is dealt to clients, ``"labels"`` (default) or ``"size"``
            (:meth:`~fedlightning.datamodules.FederatedDataModule.client_eval_indices`).
        seed: seed of the client sample and of the adaptation's data order and in-model randomness (default: the
            FederatedLoop's ``seed``). The deal of partitioned data uses the data module's ``seed``.
        batch_size: evaluation batch size (default: the data module's ``eval_batch_size``).
        prefix: the logged names' prefix (default ``"clients"``; ``"clients_adapted"`` with ``local_steps > 0``, so
            that both evaluations can run in one fit).
        vectorize: allow the one-pass evaluation of the bundled classifiers (below; default True). False evaluates
            client by client through ``test_step`` always.
        wandb_table: log the per-client ``wandb.Table`` with a ``WandbLogger`` (default True; histograms always).

    Decisions:

    * **Whose data** (:meth:`~fedlightning.datamodules.FederatedDataModule.client_eval_indices`). Natural splits
      (LEAF users, Synthetic devices, Shakespeare roles): each user's own test samples (``split="val"``: the user's
      validation rows). Partitioned data (ours): the data module's test set (validation split) dealt to the clients
      label by label in proportion to each client's training samples of that class (largest-remainder rounding,
      seeded shuffle by ``derive_seed(dm.seed, "client-eval", split)``), so each client's test labels follow its
      training label distribution and every test sample belongs to exactly one client; data without known class
      labels is refused there, with ``assignment="size"`` (shares proportional to training sizes) as the way out.
      Clients with no evaluation rows (and, with ``local_steps > 0``, no training samples) are not evaluated.
    * **Metrics**. The global model runs in ``eval()`` mode without gradients (its mode, and its torchmetrics
      states, are restored afterwards), batches of ``batch_size`` rows of one client at a time, through the Trainer's
      precision conversion and the module's batch-transfer hooks, in the precision plugin's test/val step context,
      as Lightning's evaluation loop does; ``test_step``'s return value is not used, and of the ``on_test_*`` hooks
      (``on_validation_*``) only ``on_test_epoch_end`` (``on_validation_epoch_end``) is called, after each client's
      batches: what it logs (a torchmetrics metric's ``compute()``, a mean of outputs the steps collected) is that
      client's value. What it logs is reduced per client as Lightning reduces an epoch-level value: ``reduce_fx="mean"``
      (default) is the mean over the client's batches weighted by ``batch_size`` (or the size Lightning extracts
      from the batch), ``"sum"``, ``"max"``, ``"min"`` likewise; sums are float64. A torchmetrics ``Metric`` is
      reset before each client and its ``compute()`` taken after the client's batches. Logging options
      (``on_step``, ``prog_bar``, ``sync_dist``) do not change the per-client value.
    * **Vectorized** (ours). One pass of the global model over the union of the evaluated clients' rows gives every
      client's values at once when they are per-sample means whose per-client reduction is known: exactly for the
      bundled :class:`~fedlightning.models.Classifier` models whose ``test_step`` / ``validation_step`` (and the
      ``_eval``, ``_logits_targets``, ``loss`` they use) are Classifier's own, without ``ignore_index``, with the
      default micro-averaged top-1 accuracy metric and no batch-transfer hooks. Their ``<split>/loss`` is then the
      client's mean cross-entropy per target and ``<split>/acc`` its fraction of correct argmax predictions, summed in
      float64 per client (the client-by-client path gets the same quantities from Lightning-style batch means, and
      the accuracy as torchmetrics' float32 ratio). For any other module the evaluation runs client by client: the
      values a ``test_step`` logs are batch-level reductions whose split over clients cannot be known in general.
      Reference mode (:mod:`fedlightning._reference`) and ``vectorize=False`` always run client by client.
    * **Local adaptation** (``local_steps=k``; the personalization evaluation of Wang et al. 2019, "Federated
      Evaluation of On-device Personalization": fine-tune the global model on the client's training data, then
      evaluate). Each client's model is the FederatedLoop's client working copy (``pl_module.client_worker``) after
      ``k`` steps of the loop's own client training (:meth:`~fedlightning.client.LocalTrainer.run`) from the current
      global weights, with the client optimizer (``pl_module.client_optimizer_factory``; with the module's
      ``configure_optimizers()`` and a scheduler, the learning rate round ``r``, the evaluated one, trained with, at
      the round's end and after fit alike, when the scheduler has stepped once more; told the client's epoch
      length as in training and, with ``persist_client_state``, started from a copy of the client's stored optimizer
      state), on ``dm.client_dataloader(i, round, seed=derive_seed(seed, "client-eval"))`` (a data order of its own),
      in-model randomness seeded by the same seed; then evaluated as above. Decisions (ours): the objective is the
      module's own ``training_step`` loss only: the callbacks' ``client_objective`` terms (FedProx, SCAFFOLD,
      FedDANE) belong to the training algorithm's round (FedDANE's needs that round's gradient phase), so
      ``pl_module.prepare_client`` is not called; the round's ``client_lr_scale`` is not applied; nothing is stored
      (``finish_client`` is not called). The global model, the client state store and the working copy's captured
      logs and metric states are unchanged (the copy is re-set from the global weights at every client training).
    * **Side effects** (ours). The whole evaluation runs in a forked torch RNG (CPU and the model's CUDA device), so
      a fit gives the same global model with and without this callback. Values go straight to the loggers at the
      step of the evaluated round's ``train/loss`` (step r for round r, the final evaluation included) and into
      ``trainer.callback_metrics``, as
      :class:`~fedlightning.callbacks.GlobalEvaluation` does (not through ``LightningModule.log``, which would
      repeat stale values at every later step). With several processes every process evaluates the same clients
      (identical values, no communication): a torchmetrics metric computes from its own process's states, as on
      one process (its synchronisation over processes, which would count every sample once per process, is off
      during the evaluation). W&B objects are logged from global rank 0.
    """

    def __init__(
        self,
        every_n_rounds: int | None = None,
        after_fit: bool = True,
        clients: int | None = None,
        split: str = "test",
        local_steps: int = 0,
        assignment: str = "labels",
        seed: int | None = None,
        batch_size: int | None = None,
        prefix: str | None = None,
        vectorize: bool = True,
        wandb_table: bool = True,
    ):
        self.every_n_rounds = integer("every_n_rounds", every_n_rounds, allow_none=True)
        self.after_fit = flag("after_fit", after_fit)
        self.clients = integer("clients", clients, allow_none=True)
        self.split = one_of("split", split, ("test", "val"))
        self.local_steps = integer("local_steps", local_steps, 0)
        self.assignment = one_of("assignment", assignment, ("labels", "size"))
        self.seed = integer("seed", seed, 0, allow_none=True)
        self.batch_size = integer("batch_size", batch_size, allow_none=True)
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        self.prefix = prefix if prefix is not None else ("clients" if self.local_steps == 0 else "clients_adapted")
        self.vectorize = flag("vectorize", vectorize)
        self.wandb_table = flag("wandb_table", wandb_table)
        #: the last evaluation's :class:`ClientResults` (None before the first)
        self.last_results: ClientResults | None = None
        self._rows: tuple[Any, list[np.ndarray]] | None = None  # (data module, client_eval_indices)
        self._evaluated_round: int | None = None

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer, pl_module) -> None:
        """Which clients are evaluated, and on which rows, before the first round: a data module this evaluation
        cannot deal (``assignment="labels"`` without class labels, no client with data of the split) stops the run
        here, not after its rounds have trained."""
        if self.every_n_rounds is None and not self.after_fit:
            return
        self.selected_clients(pl_module.datamodule, pl_module.seed)
        hook = "test_step" if self.split == "test" else "validation_step"
        model = pl_module.model
        if not is_overridden(hook, model, pl.LightningModule):
            raise ValueError(
                f"ClientEvaluation(split={self.split!r}) evaluates with the module's {hook}(), which "
                f"{type(model).__qualname__} does not define: define {hook} and log the values to compare across "
                "clients" + (" (or evaluate split='val' with its validation_step)" if self.split == "test" else "")
            )
        for other in trainer.callbacks:
            if other is not self and isinstance(other, ClientEvaluation) and other.prefix == self.prefix:
                raise ValueError(
                    f"two ClientEvaluation callbacks log under prefix={self.prefix!r} ({self!r} and {other!r}), so "
                    f"each would overwrite the other's {self.prefix}/* values (num_clients at least); give one of "
                    "them another prefix"
                )

    def due(self, round_index: int) -> bool:
        """True when the scheduled evaluation runs after 0-based round ``round_index``."""
        return self.every_n_rounds is not None and (int(round_index) + 1) % self.every_n_rounds == 0

    def on_round_end(self, trainer, pl_module, result) -> None:
        if self.due(result.plan.round):
            self._run(trainer, pl_module, int(result.plan.round))

    def on_train_end(self, trainer, pl_module) -> None:
        last_round = int(trainer.global_step) - 1
        if self.after_fit and last_round >= 0 and self._evaluated_round != last_round:
            self._run(trainer, pl_module, last_round)

    def _run(self, trainer, pl_module, round_index: int) -> None:
        results = self.evaluate(pl_module, round_index)
        self.last_results = results
        self._evaluated_round = round_index
        self._warn_missing(pl_module, results)
        metrics = results.summary(self.prefix)
        step = round_index  # the evaluated round's train/loss step (after fit, Lightning counts one more)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        for key, value in metrics.items():  # visible to ModelCheckpoint(monitor=...) / EarlyStopping
            trainer.callback_metrics[key] = torch.tensor(value)
        if trainer.is_global_zero:
            self._log_wandb(trainer, results, step)

    def _warn_missing(self, pl_module, results: ClientResults) -> None:
        """Say which values the statistics leave out: a name that is NaN for some clients (not logged for them, or a
        NaN, e.g. a diverged local adaptation) has statistics over the other clients; no name at all means the
        module's step logged nothing, and only ``num_clients`` is logged."""
        total = len(results.client_ids)
        if total and not results.values:
            hook = "test_step" if self.split == "test" else "validation_step"
            rank_zero_warn(
                f"ClientEvaluation: {type(pl_module.model).__qualname__}.{hook}() logged no value on any of the "
                f"{total} clients, so only {self.prefix}/num_clients is logged; log the values to compare with "
                "self.log"
            )
        for name in sorted(results.values):
            missing = int(np.isnan(np.asarray(results.values[name], dtype=np.float64)).sum())
            if missing:
                rank_zero_warn(
                    f"ClientEvaluation: {name!r} is NaN for {missing} of {total} clients (not logged for them, or NaN: "
                    f"a diverged local adaptation, for instance); {self.prefix}/{metric_key(name)}_* are statistics "
                    f"over the other {total - missing}"
                )

    def _log_wandb(self, trainer, results: ClientResults, step: int) -> None:
        from lightning.pytorch.loggers import WandbLogger

        loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if loggers and len(results.client_ids):
            payload = wandb_payload(results, self.prefix, table=self.wandb_table)
            for logger in loggers:
                logger.experiment.log({**payload, "trainer/global_step": step})

    # ------------------------------------------------------------------ which clients
    def client_rows(self, dm) -> list[np.ndarray]:
        """Every client's evaluation rows (``dm.client_eval_indices(split, assignment)``), computed once per data
        module."""
        if self._rows is None or self._rows[0] is not dm:
            self._rows = (dm, dm.client_eval_indices(self.split, self.assignment))
        return self._rows[1]

    def selected_clients(self, dm, loop_seed: int = 0) -> np.ndarray:
        """The evaluated client ids (ascending): those with evaluation rows (and training samples when adapting),
        or the seeded sample of ``clients`` of them (class docstring)."""
        rows = self.client_rows(dm)
        eligible = [c for c, r in enumerate(rows) if len(r) and (self.local_steps == 0 or dm.client_num_samples(c))]
        if not eligible:
            if self.split == "test":
                hint = "the data module's test set is empty or no client holds training samples"
            elif getattr(dm, "val_dataset", None) is not None:
                hint = (
                    "its validation set is a separate data set (val=, or a LightningDataModule's val_dataloader), "
                    "which is not dealt to the clients; evaluate split='test', or hold out data val_fraction of the "
                    "training set instead of val="
                )
            else:
                hint = "set data val_fraction > 0"
            raise ValueError(
                f"ClientEvaluation(split={self.split!r}): no client of {type(dm).__name__} has "
                f"{self.split} data to evaluate; {hint}"
            )
        eligible_arr = np.asarray(eligible, dtype=np.int64)
        if self.clients is None or self.clients >= len(eligible_arr):
            return eligible_arr
        seed = self.seed if self.seed is not None else int(loop_seed)
        rng = np.random.default_rng(derive_seed(seed, "client-eval-sample"))
        return np.sort(rng.choice(eligible_arr, size=self.clients, replace=False))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, pl_module, round_index: int = 0) -> ClientResults:
        """Evaluate ``pl_module``'s global model (a FederatedLoop) on the selected clients' data; with
        ``local_steps > 0`` each client's adapted model (``round_index`` seeds its data order). Logs nothing."""
        dm = pl_module.datamodule
        rows = self.client_rows(dm)
        ids = self.selected_clients(dm, pl_module.seed)
        dataset = dm.test_dataset if self.split == "test" else dm.evaluation_view()
        model = pl_module.model
        devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
        values: dict[str, list[float]] = {}
        with torch.random.fork_rng(devices=devices):
            if self.local_steps == 0:
                per_client = self._evaluate_clients(model, dm, dataset, rows, ids, pl_module.device)
            else:
                per_client = [self._adapted(pl_module, dm, dataset, rows, int(c), round_index) for c in ids.tolist()]
        for j, got in enumerate(per_client):
            for name, value in got.items():
                values.setdefault(name, [math.nan] * len(ids))[j] = value
        names = getattr(dm, "client_names", None)
        return ClientResults(
            client_ids=ids,
            num_samples=np.asarray([len(rows[c]) for c in ids.tolist()], dtype=np.int64),
            values={k: np.asarray(v, dtype=np.float64) for k, v in values.items()},
            names=[str(names[c]) for c in ids.tolist()] if names else None,
        )

    def _evaluate_clients(self, model, dm, dataset, rows, ids: np.ndarray, device) -> list[dict[str, float]]:
        """Each client's values for ``model`` (one pass when :meth:`vectorizable`, else client by client)."""
        with _evaluating(model):
            if self.vectorizable(model):
                return self._classifier_pass(model, dm, dataset, [rows[c] for c in ids.tolist()], device)
            return [self._one_client(model, dm, dataset, rows[c], device) for c in ids.tolist()]

    def vectorizable(self, model) -> bool:
        """Whether ``model`` is evaluated in one pass over all clients (class docstring, "Vectorized")."""
        if not self.vectorize or reference_mode() or not isinstance(model, Classifier):
            return False
        if model.ignore_index is not None:
            return False
        cls = type(model)
        if any(
            getattr(cls, n) is not getattr(Classifier, n)
            for n in ("test_step", "validation_step", "_eval", "_logits_targets", "loss")
        ):
            return False
        trainer = attached_trainer(model)
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        if any(is_overridden(n, owner) for n, owner in transfer_hook_owners(model, dm).items()):
            return False  # the batches go through the module's or the data module's transfer hooks
        metric = model.test_acc if self.split == "test" else model.val_acc
        try:
            from torchmetrics.classification import MulticlassAccuracy
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return False
        return (
            type(metric) is MulticlassAccuracy
            and metric.average == "micro"
            and metric.top_k == 1
            and metric.multidim_average == "global"
            and metric.ignore_index is None
        )

    def _batches(self, dm, dataset, rows: np.ndarray) -> Iterator[Any]:
        """``rows`` of ``dataset`` in order, ``batch_size`` at a time: one tensor indexing per batch for an in-memory
        data set (as the data module's evaluation loaders), else a DataLoader in this process with the data module's
        ``collate_fn`` (no worker processes started per client)."""
        bs = self.batch_size or dm.eval_batch_size
        if isinstance(dataset, ArrayDataset) and dm.collate_fn is None and not reference_mode():
            for chunk in torch.split(torch.as_tensor(rows, dtype=torch.long), bs):
                yield dataset[chunk]
        else:
            yield from DataLoader(
                Subset(dataset, np.asarray(rows).tolist()), batch_size=bs, shuffle=False, collate_fn=dm.collate_fn
            )

    def _step_context(self, model):
        plugin = _precision_plugin(model)
        if plugin is None:
            return contextlib.nullcontext()
        return plugin.test_step_context() if self.split == "test" else plugin.val_step_context()

    def _one_client(self, model, dm, dataset, rows: np.ndarray, device) -> dict[str, float]:
        """One client's values: its batches through ``test_step`` / ``validation_step`` (class docstring)."""
        for m in _metrics_of(model):
            m.reset()
        recorder = _Recorder()
        step = model.test_step if self.split == "test" else model.validation_step
        epoch_end = "on_test_epoch_end" if self.split == "test" else "on_validation_epoch_end"
        with routed_logging(model, recorder.log, recorder.log_dict):
            for i, batch in enumerate(self._batches(dm, dataset, rows)):
                batch = evaluation_batch(model, batch, device)
                recorder.batch = batch
                with self._step_context(model):
                    step(batch, i)
            if is_overridden(epoch_end, model):  # what it logs (a metric's compute()) is the client's value too
                recorder.epoch_end = True
                getattr(model, epoch_end)()
            return recorder.values()

    def _classifier_pass(self, model, dm, dataset, rows: list[np.ndarray], device) -> list[dict[str, float]]:
        """Every client's ``<split>/loss`` and ``<split>/acc`` from one pass over the union of ``rows`` (float64
        per-client sums of per-target cross-entropies and correct argmax predictions)."""
        lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
        union = np.concatenate(rows) if len(rows) else np.empty(0, dtype=np.int64)
        owner = torch.as_tensor(np.repeat(np.arange(len(rows)), lengths), device=device)
        loss = torch.zeros(len(rows), dtype=torch.float64, device=device)
        correct = torch.zeros_like(loss)
        count = torch.zeros_like(loss)
        start = 0
        for batch in self._batches(dm, dataset, union):
            batch = evaluation_batch(model, batch, device)
            with self._step_context(model):
                logits, y = model._logits_targets(batch)
                losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
            n = len(batch[1])
            per_sample = y.numel() // max(n, 1)  # targets per sample (sequence outputs: time steps)
            who = owner[start : start + n].repeat_interleave(per_sample)
            start += n
            loss.index_add_(0, who, losses.double())
            correct.index_add_(0, who, (logits.argmax(-1) == y).double())
            count.index_add_(0, who, torch.ones_like(losses, dtype=torch.float64))
        stage = self.split
        return [
            {f"{stage}/loss": lv / c if c else math.nan, f"{stage}/acc": cv / c if c else math.nan}
            for lv, cv, c in zip(loss.tolist(), correct.tolist(), count.tolist())
        ]

    def _adapted(self, pl_module, dm, dataset, rows, client_id: int, round_index: int) -> dict[str, float]:
        """Client ``client_id``'s values for the global model after ``local_steps`` local steps (class docstring,
        "Local adaptation") on the loop's client working copy."""
        worker = pl_module.client_worker
        work = worker.model
        seed = derive_seed(self.seed if self.seed is not None else int(pl_module.seed), "client-eval")
        factory = pl_module.client_optimizer_factory
        opt = factory(worker.params)
        of_round = getattr(factory, "hyperparameters_of_round", None)  # the module's configure_optimizers()
        if of_round is not None:  # the learning rate the evaluated round trained with, not the scheduler's next one
            for group, saved in zip(opt.param_groups, of_round(round_index)):
                group.update(saved)
        if hasattr(opt, "set_client_data"):
            opt.set_client_data(num_samples=dm.client_num_samples(client_id), batch_size=dm.batch_size)
        if pl_module.persist_client_state and hasattr(opt, "set_client_state"):
            state = pl_module.client_state.get("optimizer", client_id)
            if state is not None:
                opt.set_client_state(copy.deepcopy(state))
        gparams = pl_module.global_parameters()
        gbuffers = list(pl_module.model.buffers())
        with torch.no_grad():
            global_flat = flat_params(gparams)
        was_training = work.training
        saved = [(m, metric_state(m)) for m in _metrics_of(work)]
        try:
            work.train()
            # not the round's client/* values; self.trainer.optimizers is the adapting client's, as in training
            with routed_logging(work, discard, discard), pl_module.client_optimizer_view(opt):
                worker.run(
                    client_id=client_id,
                    round=round_index,
                    seed=seed,
                    global_params=gparams,
                    global_buffers=gbuffers,
                    global_flat=global_flat,
                    loader=dm.client_dataloader(client_id, round_index, seed=seed),
                    optimizer=opt,
                    local_steps=self.local_steps,
                    num_samples=dm.client_num_samples(client_id),
                    global_frozen=pl_module.global_frozen_parameters() if worker.frozen else (),
                )
            return self._evaluate_clients(work, dm, dataset, rows, np.asarray([client_id]), pl_module.device)[0]
        finally:
            work.train(was_training)
            for m, st in saved:
                for k, v in st.items():
                    setattr(m, k, v)

    def __repr__(self) -> str:
        return (
            f"ClientEvaluation(every_n_rounds={self.every_n_rounds}, after_fit={self.after_fit}, "
            f"clients={self.clients}, split={self.split!r}, local_steps={self.local_steps}, "
            f"prefix={self.prefix!r})"
        )
