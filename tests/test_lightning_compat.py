"""Each private attribute of Lightning and torchmetrics that fedlightning relies on (all of them are read or set in
``fedlightning/_lightning_compat.py`` and nowhere else) still exists and means what the project assumes, on the
installed versions: an upgrade that changes one fails here, by name."""

import os
import pathlib
import re

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from fedlightning import _lightning_compat as compat

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen_optimizers = []
        self.logged_steps = []

    def training_step(self, batch, batch_idx):
        self.seen_optimizers.append(list(self.trainer.optimizers))
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]

    def train_dataloader(self):
        x = torch.randn(8, 2)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)


def _trainer(tmp_path, **kw):
    return pl.Trainer(
        max_steps=3,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_attached_and_detached_trainer(tmp_path):
    model, trainer = _Tiny(), _trainer(tmp_path)
    assert compat.attached_trainer(model) is None
    trainer.fit(model)
    assert compat.attached_trainer(model) is trainer
    with compat.detached_trainer(model) as t:
        assert t is trainer and compat.attached_trainer(model) is None
        with pytest.raises(RuntimeError):
            model.trainer  # noqa: B018 - the property raises without a trainer
    assert model.trainer is trainer


def test_strategy_optimizers_are_what_trainer_optimizers_shows(tmp_path):
    model, trainer = _Tiny(), _trainer(tmp_path)
    trainer.fit(model)
    server = trainer.optimizers[0]
    wrapper = model.optimizers()
    client = torch.optim.Adam(model.parameters())
    with compat.strategy_optimizers(trainer.strategy, [client], []):
        assert trainer.optimizers == [client] and trainer.lr_scheduler_configs == []
    assert trainer.optimizers == [server] and len(trainer.lr_scheduler_configs) == 1
    assert model.optimizers() is wrapper  # the LightningOptimizer wrapper is kept
    with pytest.raises(KeyError):
        with compat.strategy_optimizers(trainer.strategy, [client], []):
            raise KeyError("restored on an exception too")
    assert trainer.optimizers == [server]


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
@pytest.mark.parametrize("leave", [False, True])
def test_progress_bar_options_rebuild_the_same_bar(kind, leave):
    if kind == "tqdm":
        bar = TQDMProgressBar(refresh_rate=3, process_position=1, leave=leave)
    else:
        pytest.importorskip("rich")
        from lightning.pytorch.callbacks import RichProgressBar
        from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

        bar = RichProgressBar(
            refresh_rate=3, leave=leave, theme=RichProgressBarTheme(description="red"), console_kwargs={"width": 80}
        )
    again = type(bar)(**compat.progress_bar_options(bar))
    assert compat.progress_bar_options(again) == compat.progress_bar_options(bar)
    assert again.refresh_rate == 3 and again._leave is leave
    if kind == "rich":
        assert again.theme.description == "red" and again._console_kwargs == {"width": 80}


@pytest.mark.parametrize("every,written", [(1, [0, 1, 2]), (2, [1]), (0, [])])
def test_batches_that_stepped_and_the_step_log_rule(tmp_path, every, written):
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Lightning's logger connector updates the count after this hook: the step being logged
            seen.append((compat.batches_that_stepped(trainer), compat.should_write_step_logs(trainer)))

    trainer = _trainer(tmp_path, callbacks=[Probe()], log_every_n_steps=every)
    trainer.fit(_Tiny())
    assert [s for s, _ in seen] == [0, 1, 2]
    # written at every log_every_n_steps-th step, never with 0
    assert [s for s, w in seen if w] == written


@pytest.mark.parametrize("interval,limit,rounds", [(2, 1.0, [2, 4, 6]), (3, 1.0, [3]), (2, 0, [])])
def test_validation_follows_is_whether_a_validation_runs_after_the_batch(tmp_path, interval, limit, rounds):
    """Asked at each batch end (6 batches of an epoch of 4, then 2), it answers what the fit loop then does."""
    asked, validated = [], []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            asked.append(compat.validation_follows(trainer))

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                validated.append(trainer.global_step)

    class WithVal(_Tiny):
        def validation_step(self, batch, batch_idx):
            return None

        val_dataloader = _Tiny.train_dataloader

    trainer = pl.Trainer(
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=interval,
        limit_val_batches=limit,
        num_sanity_val_steps=0,
        callbacks=[Probe()],
    )
    trainer.fit(WithVal())
    assert [i + 1 for i, a in enumerate(asked) if a] == validated
    assert validated == rounds


def test_resolved_callback_settings(tmp_path):
    """EarlyStopping's check_on_train_epoch_end as its setup resolves it (epoch end with one validation per epoch),
    a Timer's interval and ModelCheckpoint's every_n_epochs as their constructors resolve them."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer

    def resolved(es, **kw):
        trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, callbacks=[es], **kw)
        es.setup(trainer, _Tiny(), "fit")
        return compat.early_stopping_at_epoch_end(es)

    assert resolved(EarlyStopping(monitor="m")) is True
    assert resolved(EarlyStopping(monitor="m"), val_check_interval=2) is False
    assert resolved(EarlyStopping(monitor="m", check_on_train_epoch_end=False)) is False
    assert compat.timer_interval(Timer(interval="epoch")) == "epoch"
    assert compat.timer_interval(Timer()) == "step"
    assert compat.checkpoint_every_n_epochs(ModelCheckpoint()) == 1
    assert compat.checkpoint_every_n_epochs(ModelCheckpoint(every_n_epochs=3)) == 3
    assert compat.checkpoint_every_n_epochs(ModelCheckpoint(every_n_train_steps=2)) == 0


def test_batches_in_epoch_is_the_restored_position_inside_the_epoch(tmp_path):
    """0 when a fit starts; after a resume from a checkpoint written after batch 2 of an epoch (of 4 batches), 2 when
    the training loader is built, which is what the data module sizes the resumed epoch from."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = []

    class Records(_Tiny):
        def train_dataloader(self):
            seen.append(compat.batches_in_epoch(self.trainer))
            return super().train_dataloader()

    def trainer(**kw):
        return pl.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)

    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer(callbacks=[ck]).fit(Records())
    trainer(enable_checkpointing=False).fit(Records(), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert seen == [0, 2]


def test_align_logged_step_sets_the_step_lightning_logs_training_metrics_at(tmp_path):
    """After ``align_logged_step``, the step Lightning's logger connector writes the batch's metrics at (the CSV's
    ``step`` column) is ``global_step``, whatever the count held before."""

    class Shifted(_Tiny):
        def training_step(self, batch, batch_idx):
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = 7  # a wrong count, as after a restore
            compat.align_logged_step(self.trainer)
            loss = super().training_step(batch, batch_idx)
            self.log("m", float(self.global_step))
            return loss

    trainer = _trainer(tmp_path, log_every_n_steps=1)
    trainer.fit(Shifted())
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        header, *rows = [line.strip().split(",") for line in f]
    steps = [int(r[header.index("step")]) for r in rows if r[header.index("m")]]
    assert steps == [0, 1, 2]


def test_publish_step_metrics_is_what_self_log_makes_of_a_training_step_value(tmp_path):
    """``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` after a fit: a value published
    in ``training_step`` is where ``self.log(..., prog_bar=...)`` puts one, with the same value."""

    class Logs(_Tiny):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("by_lightning", 0.25 + self.global_step, prog_bar=True)
            self.log("by_lightning_quiet", 0.5 + self.global_step)
            value = {"ours": torch.tensor(0.25 + self.global_step), "ours_quiet": torch.tensor(0.5 + self.global_step)}
            compat.publish_step_metrics(self.trainer, value, progress_bar=("ours",))
            return loss

    trainer = _trainer(tmp_path, log_every_n_steps=1)
    trainer.fit(Logs())
    for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        metrics = getattr(trainer, name)
        assert ("by_lightning_quiet" in metrics) == ("ours_quiet" in metrics), name
        for a, b, last in (("by_lightning", "ours", 2.25), ("by_lightning_quiet", "ours_quiet", 2.5)):  # step 2
            if a in metrics:
                assert type(metrics[a]) is type(metrics[b]), (name, a)
                assert float(metrics[a]) == float(metrics[b]) == last, (name, a)
    assert "ours" in trainer.progress_bar_metrics and "ours_quiet" not in trainer.progress_bar_metrics


def test_current_hook_is_the_name_lightning_sets_for_the_running_hook(tmp_path):
    names = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            names.append(pl_module._current_fx_name)

    model = _Tiny()
    _trainer(tmp_path, callbacks=[Probe()]).fit(model)
    assert names == ["on_train_batch_end"] * 3  # Lightning's dispatcher sets it for every callback hook
    before = model._current_fx_name
    with compat.current_hook(model, "on_round_end"):
        assert model._current_fx_name == "on_round_end"
    assert model._current_fx_name == before


def test_parse_configure_optimizers_follows_lightnings_rules():
    model = _Tiny()
    optimizers, configs = compat.parse_configure_optimizers(model.configure_optimizers())
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.SGD)
    assert len(configs) == 1 and configs[0].scheduler.optimizer is optimizers[0] and configs[0].interval == "epoch"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, configs = compat.parse_configure_optimizers(
        {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "step"}}
    )
    assert configs[0].interval == "step"
    with pytest.raises(MisconfigurationException):  # Lightning's own error for a malformed return value
        compat.parse_configure_optimizers("not an optimizer")


def test_metric_state_round_trips_and_reductions_are_the_state_reductions():
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    saved = compat.metric_state(metric)
    before = float(metric.compute())
    metric.update(torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]))
    assert float(metric.compute()) != before
    for k, v in saved.items():
        setattr(metric, k, v)
    assert float(metric.compute()) == pytest.approx(before)
    assert set(compat.metric_reductions(metric)) == {k for k in saved if not k.startswith("_")}


def test_unsynced_metrics_compute_from_this_process_alone_inside_the_block_and_sync_again_after():
    """torchmetrics' sync, made observable: a metric that believes it runs on two processes whose states are this
    one's (the gather returns two copies). Inside the block compute() and forward() use this process's state alone;
    outside (before, after, and after an exception inside) the state is summed over the two copies again."""

    def two_copies(tensor, group=None):
        return [tensor, tensor.clone()]

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n = torchmetrics.SumMetric(distributed_available_fn=lambda: True, dist_sync_fn=two_copies)

    holder = Holder()
    holder.n.update(torch.tensor(3.0))
    assert float(holder.n.compute()) == 6.0  # synced: each sample counted once per process
    holder.n._computed = None
    with compat.unsynced_metrics(holder):
        assert float(holder.n.compute()) == 3.0
        holder.n._computed = None
        holder.n(torch.tensor(2.0))  # forward resets torchmetrics' pending-sync flag from sync_on_compute
        assert float(holder.n.compute()) == 5.0
    holder.n._computed = None
    assert holder.n.sync_on_compute is True and float(holder.n.compute()) == 10.0
    holder.n._computed = None
    with pytest.raises(KeyError), compat.unsynced_metrics(holder):
        raise KeyError("inside")
    assert float(holder.n.compute()) == 10.0


def test_defer_sigterm_replaces_lightnings_handler_for_the_fit_and_note_sigterm_stops_at_the_batch_end(tmp_path):
    """The handler installed during a fit calls back and chains to the handler from before the fit, without
    setting Lightning's flag (Lightning's own handler sets it); ``note_sigterm`` sets it, and Lightning stops at the
    end of that batch with a SIGTERMException; after the fit the earlier handler is back."""
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("before"))
    try:
        earlier = signal.getsignal(signal.SIGTERM)

        class Deferring(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                assert compat.defer_sigterm(trainer, lambda: calls.append("deferred"))

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                    assert calls == ["deferred", "before"] and not trainer.received_sigterm
                    compat.note_sigterm(trainer)
                    assert trainer.received_sigterm

        trainer = _trainer(tmp_path, callbacks=[Deferring()])
        with pytest.raises(SIGTERMException):
            trainer.fit(_Tiny())
        assert trainer.global_step == 1  # the batch in progress finished
        assert signal.getsignal(signal.SIGTERM) is earlier
    finally:
        signal.signal(signal.SIGTERM, before)


def test_no_other_module_touches_the_private_attributes():
    pattern = re.compile(
        r"\._(trainer|optimizers|leave|batches_that_stepped|logger_connector|current_fx_name|"
        r"defaults|update_count|computed|reductions|signal_connector|original_handlers|log_hyperparams)\b|\b_configure_optimizers\b|"
        r"\b_configure_schedulers_automatic_opt"
    )
    offenders = []
    for path in (ROOT / "fedlightning").rglob("*.py"):
        if path.name == "_lightning_compat.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and "self._trainer" not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
