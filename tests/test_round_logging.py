"""``self.log`` in a user's ``training_step`` during client training: each name's values of a round (every local
step of every client) become one ``client/<name>`` per round, reduced with the call's ``reduce_fx``, shown on the
progress bar with ``prog_bar=True`` and kept out of the loggers with ``logger=False``, in sequential and vectorized
execution alike; values that are not one number, names that fedlightning logs itself and one name logged with two
sets of options are refused (``fedlightning/_logging_route.py``). Each value is checked against the values the
module recorded by hand."""

import csv
import os

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import CSVLogger

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.datamodules import DigitsDataModule, Dirichlet

SEEN: list[tuple[int, float, int]] = []  # (round, loss, batch size) of every local step of every client
HITS: list[tuple[int, int, int]] = []  # (round, right predictions, batch size) of every local step


class Logs(pl.LightningModule):
    def __init__(self, extra=None, record=False):
        super().__init__()
        self.net = torch.nn.Linear(64, 10, dtype=torch.float64)
        self.extra, self.record = extra, record

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x.double()), y)
        if self.record:  # sequential only (a float() of a vmapped value is refused)
            SEEN.append((self.global_step, float(loss), len(y)))
        self.log("mean", loss)
        self.log("max", loss, reduce_fx="max")
        self.log("min", loss, reduce_fx=torch.min)
        self.log("samples", float(len(y)), reduce_fx="sum")
        self.log("shown", loss, prog_bar=True)
        self.log("hidden", loss, logger=False)
        self.log("np", np.float32(2.5))
        if self.extra is not None:
            self.extra(self, loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, mode="sequential", extra=None, rounds=3):
    SEEN.clear()
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    torch.manual_seed(0)
    module = Logs(extra, record=mode == "sequential")
    loop = FederatedLoop(module, local_steps=3, clients_per_round=3, seed=0, client_execution=mode)
    trainer = make_trainer(rounds, logger=CSVLogger(str(tmp_path), name="logs"))
    trainer.fit(loop, datamodule=dm)
    with open(os.path.join(trainer.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("client/mean")]
    return trainer, rows


def test_each_name_is_reduced_over_the_round_as_its_reduce_fx_asks(tmp_path):
    trainer, rows = _fit(tmp_path)
    assert len(rows) == 3
    for r, row in enumerate(rows):
        losses = [loss for rr, loss, _ in SEEN if rr == r]
        sizes = [n for rr, _, n in SEEN if rr == r]
        assert len(losses) == 3 * 3
        assert float(row["client/mean"]) == pytest.approx(np.mean(losses), rel=1e-12)
        assert float(row["client/max"]) == pytest.approx(max(losses), rel=1e-12)
        assert float(row["client/min"]) == pytest.approx(min(losses), rel=1e-12)
        assert float(row["client/samples"]) == sum(sizes)  # the round's batch sizes summed, not averaged
        assert float(row["client/np"]) == 2.5
        assert "client/hidden" not in row  # logger=False: not written
    last = [loss for rr, loss, _ in SEEN if rr == 2]
    assert float(trainer.callback_metrics["client/hidden"]) == pytest.approx(np.mean(last), rel=1e-12)
    assert "client/hidden" not in trainer.logged_metrics
    assert trainer.progress_bar_metrics["client/shown"] == pytest.approx(np.mean(last), rel=1e-12)
    assert "client/mean" not in trainer.progress_bar_metrics


def test_vectorized_clients_log_what_sequential_clients_log(tmp_path):
    """float64 module: the same round values to float64 rounding of the reductions' order."""
    seq_trainer, seq = _fit(tmp_path / "seq")
    vec_trainer, vec = _fit(tmp_path / "vec", "vectorized")
    keys = ["client/mean", "client/max", "client/min", "client/samples", "client/np"]
    for a, b in zip(seq, vec):
        for k in keys:
            assert float(b[k]) == pytest.approx(float(a[k]), rel=1e-12), k
        assert "client/hidden" not in b
    assert "client/hidden" not in vec_trainer.logged_metrics
    assert float(vec_trainer.progress_bar_metrics["client/shown"]) == pytest.approx(
        float(seq_trainer.progress_bar_metrics["client/shown"]), rel=1e-12
    )


def _log_vector(module, loss):
    module.log("vec", torch.stack([loss, loss]))


def _log_string(module, loss):
    module.log("text", "high")


def _log_lr(module, loss):
    module.log("lr", 0.5)


def _log_twice(module, loss):
    module.log("twice", loss)
    module.log("twice", loss, reduce_fx="sum")


def _log_custom(module, loss):
    module.log("median", loss, reduce_fx=torch.median)


@pytest.mark.parametrize(
    "extra,match",
    [
        (_log_vector, r"self.log\('vec', value\) in training_step: the value must be one number, got a tensor of "),
        (_log_string, r"self.log\('text', value\) in training_step: the value must be a number, .* got str"),
        (
            _log_lr,
            r"self.log\('lr'\) during client training \(the module's training_step or a callback's per-client "
            r"hook\) is logged as 'client/lr', which fedlightning logs",
        ),
        (_log_twice, r"self.log\('twice', ...\) in training_step is called with different options"),
        (_log_custom, r"reduce_fx=<built-in method median .* reduced over the round's local steps"),
    ],
    ids=["vector", "string", "framework-name", "two-options", "custom-reduce"],
)
@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_what_a_round_value_cannot_be_is_refused_by_name(tmp_path, extra, match, mode):
    """Each of these is dropped or overwritten without a word by a log call that ignored it; Lightning refuses
    the first two itself."""
    with pytest.raises(Exception, match=match):
        _fit(tmp_path, mode, extra, rounds=1)


class EpochEndMetric(pl.LightningModule):
    """A torchmetrics metric updated in training_step and logged in on_train_epoch_end (a plain-Lightning idiom)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 10)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.acc.update(logits, y)
        HITS.append((self.global_step, int((logits.argmax(1) == y).sum()), len(y)))
        return F.cross_entropy(logits, y)

    def on_train_epoch_end(self):
        self.log("acc_epoch", self.acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_metric_logged_in_on_train_epoch_end_is_the_rounds_from_round_0():
    HITS.clear()
    module = EpochEndMetric()
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    loop = FederatedLoop(module, local_steps=2, clients_per_round=2, seed=0)

    logged = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append(float(trainer.callback_metrics["client/acc_epoch"]))

    make_trainer(3, callbacks=[Record()]).fit(loop, datamodule=dm)
    hits, expected = list(HITS), []
    for r in range(3):
        right = sum(h for rr, h, _ in hits if rr == r)
        total = sum(n for rr, _, n in hits if rr == r)
        expected.append(right / total)
    assert logged == pytest.approx(expected, rel=1e-6)


def test_the_options_of_repeated_log_calls_are_bound_as_the_first_call_binds_them():
    """``round_log_options`` keeps the options of calls with plain values (every local step repeats them): each
    call still gets its own options, an invalid call is refused every time, and options with other values (a torch
    reduction, a tensor) are bound each time."""
    from fedlightning._logging_route import RoundLogOptions, round_log_options

    for _ in range(2):
        assert round_log_options("a", (), {"prog_bar": True}) == RoundLogOptions("mean", True, True)
        assert round_log_options("a", (), {"prog_bar": False}) == RoundLogOptions("mean", False, True)
        assert round_log_options("a", (True, False), {}) == RoundLogOptions("mean", True, False)  # prog_bar, logger
        assert round_log_options("a", (), {"reduce_fx": "max", "logger": 0}) == RoundLogOptions("max", False, False)
        assert round_log_options("a", (), {"reduce_fx": torch.sum}) == RoundLogOptions("sum", False, True)
        assert round_log_options("a", (), {"batch_size": torch.tensor(3)}) == RoundLogOptions()
        with pytest.raises(ValueError, match=r"reduce_fx='median'"):
            round_log_options("a", (), {"reduce_fx": "median"})
        with pytest.raises(TypeError, match=r"self.log\('a', ...\) in training_step: .*unexpected keyword"):
            round_log_options("a", (), {"colour": "red"})
