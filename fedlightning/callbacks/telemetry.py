"""Telemetry callbacks: real training throughput, and the global model's loss/accuracy on a schedule.

* :class:`RoundTimer` — host wall-clock per round and throughput (``time/*``: round seconds, rounds per second,
  client steps per second); the simulated wall-clock is :class:`~fedlightning.callbacks.RuntimeModel`'s.
* :class:`GlobalEvaluation` — the global model's loss (and accuracy) on the training data (``train_eval/*``, the
  training loss of FedDANE's reference code) or the test data (``test_eval/*``) every ``every_n_rounds`` rounds.

Formulas and decisions are in the two classes' docstrings.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from fedlightning._lightning_compat import batches_that_stepped, evaluation_batch, preserved_metric_states
from fedlightning._logging_route import discard, routed_logging
from fedlightning._validation import integer, one_of
from fedlightning.callbacks.base import FederatedCallback
from fedlightning.client import extract_loss
from fedlightning.models.base import Classifier

__all__ = ["RoundTimer", "GlobalEvaluation"]


class RoundTimer(FederatedCallback):
    """Host wall-clock per round and training throughput.

    With ``window`` the moving window::

        round_seconds_r = t_end(r) − t_start(r)                    # the whole training_step of round r
        rounds_per_second = n / Σ_{last n rounds} round_seconds     # n = min(window, rounds so far)
        client_steps_per_second_r = |S_r| · K_r / round_seconds_r   # healthy clients × local steps

    The *simulated* wall-clock of seed 004 and the cumulative SGD steps ``Σ_r K_r`` are logged by
    :class:`~fedlightning.callbacks.RuntimeModel` (``runtime/*``); this callback does not repeat them.

    Args:
        window: number of recent rounds averaged in ``time/rounds_per_second`` (default 10, ours).

    Logged per round: ``time/round_seconds``, ``time/train_seconds`` (cumulative), ``time/rounds_per_second``
    (moving average over ``window`` rounds), ``time/client_steps_per_second`` (this round).

    Decisions (ours):

    * ``RoundTimer`` measures from Lightning's ``on_train_batch_start`` to ``on_train_batch_end`` of the round, i.e.
      client training, the server step, every ``on_round_end`` callback and the loop's own logging; validation and
      checkpointing, which Lightning runs after ``on_train_batch_end``, are excluded. ``time/train_seconds`` (the sum of
      the round times) and the round count are checkpointed, so a resumed run continues the totals; the moving window
      of ``rounds_per_second`` restarts with the process. Default window: 10 rounds.
    * The client-step count uses ``round/clients`` (healthy clients, reduced over all processes) times the round's
      ``K_r``, or with per-client counts (``local_epochs``) the sum of each healthy client's own, as
      :class:`RuntimeModel` counts ``runtime/client_sgd_steps``.
    """

    #: the clock (seconds); replace on an instance to test with a deterministic clock
    clock = staticmethod(time.perf_counter)

    def __init__(self, window: int = 10):
        self.window = integer("window", window)
        self.train_seconds = 0.0
        self.rounds = 0
        self._recent: deque[float] = deque(maxlen=self.window)
        self._start: float | None = None
        self._client_steps = 0.0

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = self.clock()
        self._client_steps = 0.0

    def on_round_end(self, trainer, pl_module, result) -> None:
        self._client_steps = result.healthy_local_steps()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._start is None:
            return
        seconds = max(self.clock() - self._start, 0.0)
        self._start = None
        self.train_seconds += seconds
        self.rounds += 1
        self._recent.append(seconds)
        total = sum(self._recent)
        metrics = {
            "time/round_seconds": seconds,
            "time/train_seconds": self.train_seconds,
            "time/rounds_per_second": len(self._recent) / total if total > 0 else math.inf,
            "time/client_steps_per_second": self._client_steps / seconds if seconds > 0 else math.inf,
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"train_seconds": self.train_seconds, "rounds": self.rounds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_seconds = float(state_dict["train_seconds"])
        self.rounds = int(state_dict["rounds"])

    def __repr__(self) -> str:
        return f"RoundTimer(window={self.window})"


class GlobalEvaluation(FederatedCallback):
    """The global model's loss (and accuracy) on the training or test data, every ``every_n_rounds`` rounds.

    On the *training* data (``split="train"``) or the test data (``split="test"``)::

        <split>_eval/loss = Σ_j ℓ(w_{t+1}; x_j, y_j) / N        # over the N examples of the split (or a fixed subset)
        <split>_eval/acc  = #{j : argmax f(w_{t+1}; x_j) = y_j} / N

    The papers use two definitions of "training loss": seed 000/001/002 report the mean of the losses the
    participating clients report (the FederatedLoop's ``train/loss``), seed 003's reference code evaluates
    ``Σ_k n_k F_k(w) / Σ_k n_k`` on all devices every round, which is ``train_eval/loss`` here (over the union of the
    clients' index arrays: the training set without its validation split), computed here on a schedule.
    Lightning's validation loop evaluates the validation split (``val/*``), and the CLI's test after fit the
    test set (``test/*``); ``split="test"`` with ``max_samples`` is the cheap way to follow a large test set during
    training (e.g. Shakespeare's ~785k windows) on a fixed random subset.

    Args:
        split: ``"train"`` (default: the union of the clients' data, ``dm.training_rows()``, which excludes the
            validation split), ``"val"`` (the validation split, ``dm.val_indices``, or the data module's separate
            validation set, ``val=``) or ``"test"`` (``dm.evaluation_rows(split)``).
        every_n_rounds: evaluation period in rounds (default 10, ours).
        max_samples: evaluate a fixed random subset of this many examples of the split (None: all).
        seed: seed of that subset.
        batch_size: evaluation batch size (None: the data module's ``eval_batch_size``).

    Logged: ``<split>_eval/loss`` and, for :class:`~fedlightning.models.Classifier` models, ``<split>_eval/acc``.

    Decisions (ours):

    * ``GlobalEvaluation`` evaluates after the server step of round ``r`` (0-based) when
      ``(r + 1) % every_n_rounds == 0`` and logs at the same step as that round's ``train/loss``. The values go to the
      loggers directly (and into ``trainer.callback_metrics``), not through ``LightningModule.log``, because Lightning
      re-logs the last value of a step metric at every later step, which would repeat stale values between
      evaluations.
      For a :class:`~fedlightning.models.Classifier` the loss is the exact per-target mean (``ignore_index`` targets
      excluded, sequence outputs flattened) and accuracy is logged too; for any other LightningModule the loss is the
      batch-size-weighted mean of its ``training_step`` loss (its ``self.log`` calls are discarded) and no accuracy is
      logged. The model is put in ``eval()`` mode (no dropout, BatchNorm running statistics used) and restored.
      The samples are read as the validation and test loaders read them
      (:meth:`~fedlightning.datamodules.FederatedDataModule.evaluation_dataloader`): the user's ``collate_fn``, and
      the training set's un-augmented view (no random crop or flip); a batch's size is Lightning's
      (``extract_batch_size``: the first tensor's length, for dict batches too). Each batch goes through the
      precision plugin's input conversion and the module's batch-transfer hooks, as in Lightning's evaluation loop.
      ``max_samples`` evaluates a fixed random subset drawn once with ``seed``; default: all training examples.
      With several processes every process evaluates the same data (identical values, no communication).
    """

    def __init__(
        self,
        split: str = "train",
        every_n_rounds: int = 10,
        max_samples: int | None = None,
        seed: int = 0,
        batch_size: int | None = None,
    ):
        self.split = one_of("split", split, ("train", "val", "test"))
        self.every_n_rounds = integer("every_n_rounds", every_n_rounds)
        self.max_samples = integer("max_samples", max_samples, allow_none=True)
        self.seed = integer("seed", seed, 0)
        self.batch_size = integer("batch_size", batch_size, allow_none=True)
        self._indices: np.ndarray | None = None
        self._size = -1

    def due(self, round_index: int) -> bool:
        """True when the evaluation runs after 0-based round ``round_index``."""
        return (int(round_index) + 1) % self.every_n_rounds == 0

    def on_round_end(self, trainer, pl_module, result) -> None:
        if not self.due(result.plan.round):
            return
        metrics = self.evaluate(pl_module.model, pl_module.datamodule, pl_module.device)
        if not metrics:
            return
        # Straight to the loggers, not through ``self.log``: Lightning re-sends the last value of an on-step metric
        # at every later step, which would turn a sparse schedule into a stale value every round.
        step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        for key, value in metrics.items():  # visible to ModelCheckpoint(monitor=...) / EarlyStopping
            trainer.callback_metrics[key] = torch.tensor(value)

    # ------------------------------------------------------------------ evaluation
    def _subset(self, n: int) -> np.ndarray:
        """The evaluated indices of a data set of size ``n``: all, or a sorted seeded sample of ``max_samples``."""
        if self._indices is None or self._size != n:
            if self.max_samples is None or self.max_samples >= n:
                self._indices = np.arange(n)
            else:
                rng = np.random.default_rng(self.seed)
                self._indices = np.sort(rng.choice(n, size=self.max_samples, replace=False))
            self._size = n
        return self._indices

    def on_fit_start(self, trainer, pl_module) -> None:
        """A split the data module does not have stops the fit here, before round 0, not after its rounds."""
        self._rows(pl_module.datamodule)

    def _rows(self, dm) -> np.ndarray:
        """The split's rows of ``dm`` (its evaluation rows), or the error naming what is missing."""
        if dm.train_dataset is None:
            dm.setup("fit")
        dataset, rows = dm.evaluation_rows(self.split)
        if dataset is None:
            raise ValueError(
                f"GlobalEvaluation(split={self.split!r}): {type(dm).__name__} has no {self.split} data set"
            )
        if self.split == "val" and not len(rows):
            raise ValueError(
                f"GlobalEvaluation(split='val'): {type(dm).__name__} has no validation split "
                f"(val_fraction={dm.val_fraction}); set data val_fraction > 0"
            )
        return rows

    def _batches(self, dm):
        rows = self._rows(dm)
        indices = rows[self._subset(len(rows))]
        yield from dm.evaluation_dataloader(self.split, indices, self.batch_size)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dm, device: torch.device) -> dict[str, float]:
        """``{"<split>_eval/loss": ..., ["<split>_eval/acc": ...]}`` of ``model`` on ``dm``'s data of the split."""
        was_training = model.training
        model.eval()
        classifier = isinstance(model, Classifier)
        loss_sum, correct, count = 0.0, 0.0, 0.0
        # the model's own self.log calls of training_step are discarded, and its torchmetrics updates undone
        silenced = contextlib.nullcontext() if classifier else routed_logging(model, discard, discard)
        kept = contextlib.nullcontext() if classifier else preserved_metric_states(model)
        try:
            with silenced, kept:
                for i, batch in enumerate(self._batches(dm)):
                    batch = evaluation_batch(model, batch, device)
                    if classifier:
                        logits, y = model._logits_targets(batch)
                        if model.ignore_index is not None:
                            valid = y != model.ignore_index
                        else:
                            valid = torch.ones_like(y, dtype=torch.bool)
                        n = float(valid.sum().item())
                        if n == 0:
                            continue
                        loss = model.loss(logits, y)
                        loss_sum += float(loss.double().item()) * n
                        correct += float((logits.argmax(-1)[valid] == y[valid]).sum().item())
                        count += n
                    else:
                        output = model.training_step(batch, i)
                        if output is None:  # the module skips this batch (Lightning's skipped step): not counted
                            continue
                        loss = extract_loss(output, type(model).__name__)
                        n = float(extract_batch_size(batch))
                        loss_sum += float(loss.double().item()) * n
                        count += n
        finally:
            model.train(was_training)
        if count == 0:
            return {}
        out = {f"{self.split}_eval/loss": loss_sum / count}
        if classifier:
            out[f"{self.split}_eval/acc"] = correct / count
        return out

    def __repr__(self) -> str:
        return (
            f"GlobalEvaluation(split={self.split!r}, every_n_rounds={self.every_n_rounds}, "
            f"max_samples={self.max_samples})"
        )
