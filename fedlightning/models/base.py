"""Shared base of the reference models: a LightningModule with a loss, torchmetrics accuracy and the usual steps.

Batches are ``(inputs, targets)``. ``training_step`` returns the mean mini-batch loss (what the FederatedLoop and
the client optimizers need); ``validation_step`` / ``test_step`` log ``val/loss``, ``val/acc`` (``test/...``)
aggregated over the whole evaluation set by Lightning and torchmetrics.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn

from fedlightning._validation import integer

__all__ = ["Classifier"]


def _autocast_enabled(device_type: str) -> bool:
    """Whether autocast is active for ``device_type`` (``torch.is_autocast_enabled(device_type)``, torch >= 2.4)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


class Classifier(pl.LightningModule):
    """A classification LightningModule around ``self.net`` (set by subclasses).

    Args:
        num_classes: number of classes (for the accuracy metric).
        lr: learning rate used only when the module is trained on its own (``configure_optimizers``); in federated
            training the client optimizer of the FederatedLoop is used instead.
        ignore_index: target value excluded from loss and accuracy (e.g. padding in next-character prediction).
    """

    def __init__(self, num_classes: int, lr: float = 0.1, ignore_index: int | None = None):
        super().__init__()
        self.num_classes = integer("num_classes", num_classes, 2)
        self.lr = lr
        self.ignore_index = ignore_index
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=self.num_classes, **kw)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=self.num_classes, **kw)
        self.net: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _logits_targets(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch[0], batch[1]
        logits = self(x)
        if logits.dim() > 2:  # sequence outputs (N, T, C) -> (N*T, C)
            logits = logits.reshape(-1, logits.shape[-1])
            y = y.reshape(-1)
        return logits, y

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        if self.ignore_index is None:
            return F.cross_entropy(logits, y)
        return F.cross_entropy(logits, y, ignore_index=self.ignore_index)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits, y = self._logits_targets(batch)
        loss = self.loss(logits, y)
        self.log("train/batch_loss", loss)
        return loss

    def training_step_per_sample(self, batch: Any, batch_idx: int) -> Tensor:
        """Per-sample losses ``[n]``: entry ``j`` is what :meth:`training_step` returns on sample ``j`` alone.

        The optional per-sample protocol of :mod:`fedlightning.vectorized`: on steps where the round's clients have
        batches of different sizes, the vectorised engine needs every client's mean loss over its real samples; with
        this method it gets them from one batched call instead of one ``training_step`` per sample (an inner
        ``vmap``). For sequence outputs the loss of a sample is the mean over its tokens (tokens equal to
        ``ignore_index`` excluded), as ``training_step`` computes it on that sample alone. Logs ``train/batch_loss``
        per sample (the engine reports each client's mean over its real samples).
        """
        x, y = batch[0], batch[1]
        logits = self(x)
        n = logits.shape[0]
        if logits.dim() <= 2:  # one label per sample
            losses = self._token_losses(logits, y)
            if self.ignore_index is not None:  # an ignored label: 0/0 = nan, as training_step on that sample alone
                losses = losses / (y != self.ignore_index)
        else:  # (N, T, C): per-token losses, averaged per sample
            tokens = self._token_losses(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).reshape(n, -1)
            if self.ignore_index is None:
                losses = tokens.mean(1)
            else:
                losses = tokens.sum(1) / (y.reshape(n, -1) != self.ignore_index).sum(1)
        self.log("train/batch_loss", losses)
        return losses

    def _token_losses(self, logits: Tensor, y: Tensor) -> Tensor:
        """``F.cross_entropy(logits, y, reduction="none")`` (ignored targets give 0), written as ``−log_softmax``
        gathered at the targets: the same numbers bit for bit, and every op has a ``vmap`` batching rule
        (``nll_loss`` has none and runs as a Python decomposition under ``vmap``, about 0.2 ms per call). Under
        autocast (``precision="bf16-mixed"`` / ``"16-mixed"``) ``cross_entropy`` runs in float32 while
        ``log_softmax`` on the CPU stays in the low dtype, so half-precision logits are upcast first, as
        ``cross_entropy``'s cast policy does."""
        if logits.dtype in (torch.float16, torch.bfloat16) and _autocast_enabled(logits.device.type):
            logits = logits.float()
        if self.ignore_index is None:
            return -F.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        valid = y != self.ignore_index
        picked = -F.log_softmax(logits, -1).gather(-1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1)
        return torch.where(valid, picked, picked.new_zeros(()))

    def _eval(self, batch: Any, stage: str, metric: torchmetrics.Metric) -> Tensor:
        logits, y = self._logits_targets(batch)
        loss = self.loss(logits, y)
        metric(logits, y)
        n = y.numel()
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=n)
        self.log(f"{stage}/acc", metric, prog_bar=True, batch_size=n)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval(batch, "test", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
