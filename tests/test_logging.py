"""Telemetry callbacks (RoundTimer, GlobalEvaluation), config logging with CSV/TensorBoard loggers through the
CLI, the W&B mode policy, and bad input."""

import copy
import csv
import functools
import glob
import os

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.loggers import Logger

import fedlightning.cli as cli_module
from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks.telemetry import GlobalEvaluation, RoundTimer
from fedlightning.datamodules import IID, DigitsDataModule, Dirichlet
from fedlightning.logging import LogConfigCallback, wandb_mode
from fedlightning.models import MLP
from numerics import RTOL64, Digits64, rtol32, to_float64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


class RecordingLogger(Logger):
    """A logger that keeps every ``log_metrics`` call (step, metrics) and every ``log_hyperparams`` call."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self.hparams = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        self.hparams.append(params)

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def series(self, key):
        return [m[key] for _, m in self.rows if key in m]


def _small_run(callbacks, rounds=3, clients=4, local_steps=2, logger=None, model=None, val_fraction=0.1):
    """A float64 run (model and data): GlobalEvaluation's batched sums are compared with one direct computation,
    which sums in another order, to numerics.RTOL64."""
    torch.manual_seed(0)
    model = to_float64(model or MLP(input_dim=64, hidden=[8], num_classes=10))
    dm = Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, val_fraction=val_fraction)
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=local_steps,
        clients_per_round=clients,
        seed=2,
    )
    logger = logger or RecordingLogger()
    trainer = make_trainer(rounds, callbacks=callbacks, logger=logger, log_every_n_steps=1)
    trainer.fit(loop, datamodule=dm)
    return loop, dm, logger


class SavesHyperparameters(pl.LightningModule):
    """A user's module that saves its arguments (for the logger or not) or none."""

    def __init__(self, lr: float = 0.1, width: int = 8, save: str = "logger"):
        super().__init__()
        if save != "none":
            self.save_hyperparameters(logger=save == "logger")
        self.net = torch.nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("save", ["logger", "not for the logger", "none"])
def test_the_users_module_hyperparameters_are_logged_as_lightning_logs_them(tmp_path, save):
    """What the loggers receive from a federated fit equals what they receive from Lightning training the module
    directly; the checkpoint keeps the loop's own (empty) hyper-parameters."""
    logged = {}
    for kind in ("plain", "federated"):
        module = SavesHyperparameters(lr=0.05, width=7, save=save)
        logger = RecordingLogger()
        trainer = make_trainer(1, logger=logger)
        dm = DigitsDataModule(num_clients=4, batch_size=16, partition=IID(), seed=1)
        if kind == "plain":
            dm.setup("fit")
            trainer.fit(module, train_dataloaders=dm.client_dataloader(0, 0))
        else:
            loop = FederatedLoop(module, local_steps=1, clients_per_round=2, seed=0)
            trainer.fit(loop, datamodule=dm)
            trainer.save_checkpoint(tmp_path / "run.ckpt")
            assert "hyper_parameters" not in torch.load(tmp_path / "run.ckpt", weights_only=False)
        logged[kind] = [dict(p) for p in logger.hparams if p]
    assert logged["federated"] == logged["plain"]
    assert logged["plain"] == ([{"lr": 0.05, "width": 7, "save": "logger"}] if save == "logger" else [])


def test_round_metrics_are_one_row_per_round_on_disk_at_once_and_on_the_progress_bar(tmp_path):
    """Every round's metrics (train/loss with the server's and the clients') are one logger row at the round's step,
    with Lightning's ``epoch``, saved to metrics.csv before the round's ``on_train_batch_end``; train/loss is on the
    progress bar and in ``trainer.logged_metrics`` / ``callback_metrics`` (float64 tensors) with the value the row
    holds."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger

    on_disk = []

    class ReadsTheFile(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
                on_disk.append(sorted(int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")))

    logger = CSVLogger(str(tmp_path), name="rows")
    loop, _, _ = _small_run([ReadsTheFile()], rounds=3, logger=logger)
    assert on_disk == [[0], [0, 1], [0, 1, 2]]  # round r's row is saved within round r
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(r["server/lr"] and r["client/forwards"] and r["epoch"] == "0" for r in rows)
    trainer = loop.trainer
    last = float(rows[-1]["train/loss"])
    assert trainer.progress_bar_metrics["train/loss"] == last
    for metrics in (trainer.logged_metrics, trainer.callback_metrics):
        assert metrics["train/loss"].dtype == torch.float64 and float(metrics["train/loss"]) == last
        assert float(metrics["server/lr"]) == float(rows[-1]["server/lr"])


# ---------------------------------------------------------------------------------------------- RoundTimer
def test_round_timer_values_with_a_deterministic_clock():
    durations = [1.0, 2.0, 4.0]
    ticks = []
    for r, d in enumerate(durations):
        ticks += [100.0 * r, 100.0 * r + d]  # start, end of round r
    timer = RoundTimer(window=2)
    timer.clock = iter(ticks).__next__  # RoundTimer reads the clock exactly twice per round
    clients, k = 4, 2
    _, _, logger = _small_run([timer], rounds=3, clients=clients, local_steps=k)
    assert logger.series("time/round_seconds") == pytest.approx(durations)
    assert logger.series("time/train_seconds") == pytest.approx([1.0, 3.0, 7.0])
    # moving average over the last 2 rounds: n / sum(seconds)
    assert logger.series("time/rounds_per_second") == pytest.approx([1 / 1.0, 2 / 3.0, 2 / 6.0])
    assert logger.series("time/client_steps_per_second") == pytest.approx([clients * k / d for d in durations])
    assert timer.state_dict() == {"train_seconds": pytest.approx(7.0), "rounds": 3}


def test_round_timer_state_round_trip_continues_totals():
    a = RoundTimer()
    a.train_seconds, a.rounds = 12.5, 7
    b = RoundTimer()
    b.load_state_dict(a.state_dict())
    assert (b.train_seconds, b.rounds) == (12.5, 7)


def test_round_timer_measures_real_time_when_not_faked():
    _, _, logger = _small_run([RoundTimer()], rounds=2)
    secs = logger.series("time/round_seconds")
    assert len(secs) == 2 and all(0 < s < 60 for s in secs)


# ---------------------------------------------------------------------------------------------- GlobalEvaluation
@pytest.mark.numerics
def test_global_train_evaluation_matches_a_direct_computation():
    evaluation = GlobalEvaluation(every_n_rounds=2)
    loop, dm, logger = _small_run([evaluation], rounds=4)
    losses, accs = logger.series("train_eval/loss"), logger.series("train_eval/acc")
    assert len(losses) == 2 and len(accs) == 2  # after rounds 2 and 4 (1-based)
    # independent: cross-entropy and accuracy of the final global model over the clients' samples (the training
    # set without its validation rows)
    rows = torch.as_tensor(np.sort(np.concatenate(dm.client_indices)))
    assert len(rows) == len(dm.train_dataset) - len(dm.val_indices) > 0
    x, y = dm.train_dataset.x[rows], dm.train_dataset.y[rows]
    with torch.no_grad():
        logits = loop.model.net(x)
    assert losses[-1] == pytest.approx(float(F.cross_entropy(logits, y)), rel=RTOL64)
    assert accs[-1] == pytest.approx(float((logits.argmax(-1) == y).double().mean()), rel=RTOL64)
    assert losses[0] != losses[-1]  # two different global models were evaluated
    assert loop.model.training  # train mode restored


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_global_evaluation_leaves_training_unchanged_bit_for_bit(mode, monkeypatch):
    """A run with GlobalEvaluation every round trains the weights of the same run without it, bit for bit, also for
    a model with dropout (random draws during training) in both modes."""

    def weights(callbacks):
        torch.manual_seed(0)
        model = MLP(input_dim=64, hidden=[8], num_classes=10, dropout=0.3)
        loop, _, _ = _small_run(callbacks, rounds=3, model=model)
        return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach()

    import fedlightning.loop as loop_module

    init = loop_module.FederatedLoop.__init__
    monkeypatch.setattr(
        loop_module.FederatedLoop, "__init__", lambda self, *a, **k: init(self, *a, client_execution=mode, **k)
    )
    assert torch.equal(weights([GlobalEvaluation(every_n_rounds=1)]), weights([]))


def test_global_train_evaluation_subset_is_fixed_and_seeded():
    ev = GlobalEvaluation(every_n_rounds=1, max_samples=50, seed=3)
    loop, dm, logger = _small_run([ev], rounds=1)
    idx = ev._indices  # positions in the clients' samples (the training rows without validation)
    assert len(idx) == 50 and len(set(idx.tolist())) == 50
    rows = torch.as_tensor(np.sort(np.concatenate(dm.client_indices))[idx])
    x, y = dm.train_dataset.x[rows], dm.train_dataset.y[rows]
    with torch.no_grad():
        expected = float(F.cross_entropy(loop.model.net(x), y))
    assert logger.series("train_eval/loss")[-1] == pytest.approx(expected, rel=RTOL64)
    other = GlobalEvaluation(max_samples=50, seed=4)
    assert not (other._subset(len(dm.training_rows())) == idx).all()


def test_global_train_evaluation_generic_module_uses_training_step_loss():
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):  # not a Classifier: loss from training_step, no accuracy
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("inner", loss)  # must be discarded during the evaluation
            return loss

    ev = GlobalEvaluation(every_n_rounds=1, batch_size=100)
    loop, dm, logger = _small_run([ev], rounds=1, model=Plain())
    rows = torch.as_tensor(dm.training_rows())  # the clients' samples, no validation row
    with torch.no_grad():
        expected = float(F.cross_entropy(loop.model.net(dm.train_dataset.x[rows]), dm.train_dataset.y[rows]))
    assert logger.series("train_eval/loss") == pytest.approx([expected], rel=RTOL64)
    assert logger.series("train_eval/acc") == []


def test_global_train_evaluation_leaves_the_modules_torchmetrics_as_they_were():
    """GlobalEvaluation calls training_step on the global model of a module that is not a Classifier; the metric that
    training_step updates kept every evaluated sample (1,564 on the digits) in the global model's state. Its state
    after the evaluation is the one before."""
    import torchmetrics

    class WithMetric(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10)
            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.acc(logits, y)
            return F.cross_entropy(logits, y)

    ev = GlobalEvaluation(every_n_rounds=1, batch_size=100)
    loop, _, logger = _small_run([ev], rounds=2, model=WithMetric())
    assert len(logger.series("train_eval/loss")) == 2
    assert int(loop.model.acc.tp.sum() + loop.model.acc.fn.sum()) == 0 and loop.model.acc._update_count == 0


def test_global_evaluation_on_the_test_split():
    ev = GlobalEvaluation(split="test", every_n_rounds=1)
    loop, dm, logger = _small_run([ev], rounds=2)
    x, y = dm.test_dataset.x, dm.test_dataset.y
    with torch.no_grad():
        logits = loop.model.net(x)
    assert logger.series("test_eval/loss")[-1] == pytest.approx(float(F.cross_entropy(logits, y)), rel=RTOL64)
    assert logger.series("test_eval/acc")[-1] == pytest.approx(
        float((logits.argmax(-1) == y).double().mean()), rel=RTOL64
    )
    assert logger.series("train_eval/loss") == []


def test_global_evaluation_on_the_validation_split():
    ev = GlobalEvaluation(split="val", every_n_rounds=1, max_samples=40, seed=1)
    loop, dm, logger = _small_run([ev], rounds=2)
    assert len(dm.val_indices) > 40
    rows = torch.as_tensor(np.asarray(dm.val_indices)[ev._indices])  # a fixed subset of the validation rows
    assert len(rows) == 40 and not set(rows.tolist()) & set(dm.training_rows().tolist())
    x, y = dm.train_dataset.x[rows], dm.train_dataset.y[rows]
    with torch.no_grad():
        logits = loop.model.net(x)
    assert logger.series("val_eval/loss")[-1] == pytest.approx(float(F.cross_entropy(logits, y)), rel=RTOL64)
    assert logger.series("val_eval/acc")[-1] == pytest.approx(
        float((logits.argmax(-1) == y).double().mean()), rel=RTOL64
    )


def test_global_evaluation_on_a_missing_validation_split_names_val_fraction():
    """Refused when the fit starts, before round 0 trains (not after its first evaluation's rounds)."""
    ev = GlobalEvaluation(split="val", every_n_rounds=5)
    trained = []
    ev.on_round_end = lambda trainer, pl_module, result: trained.append(result.plan.round)
    with pytest.raises(ValueError, match="val_fraction=0"):
        _small_run([ev], rounds=6, val_fraction=0.0)
    assert trained == []


def test_global_evaluation_leaves_out_the_batches_training_step_skips():
    """A ``training_step`` that returns None for a batch (Lightning's skipped step, e.g. no labelled sample): the
    evaluation leaves that batch out of its sample-weighted mean, as the module's own training does."""
    import lightning.pytorch as pl

    class Skips(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10, dtype=torch.float64)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if bool((y == 0).any()):  # batches holding a 0 are skipped
                return None
            return F.cross_entropy(self.net(x), y)

    ev = GlobalEvaluation(every_n_rounds=1, batch_size=10)
    loop, dm, logger = _small_run([ev], rounds=1, model=Skips())
    rows = torch.as_tensor(dm.training_rows())
    x, y = dm.train_dataset.x[rows], dm.train_dataset.y[rows]
    kept = [(xb, yb) for xb, yb in zip(x.split(10), y.split(10)) if not bool((yb == 0).any())]
    assert 0 < len(kept) < len(x.split(10))
    with torch.no_grad():
        expected = sum(float(F.cross_entropy(loop.model.net(xb), yb)) * len(yb) for xb, yb in kept)
    assert logger.series("train_eval/loss") == pytest.approx([expected / sum(len(yb) for _, yb in kept)], rel=RTOL64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"split": "validation"}, "split"),
        ({"every_n_rounds": 0}, "every_n_rounds"),
        ({"every_n_rounds": 2.5}, "every_n_rounds"),
        ({"max_samples": 0}, "max_samples"),
        ({"batch_size": -1}, "batch_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_global_train_evaluation_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GlobalEvaluation(**kwargs)


@pytest.mark.parametrize("window", [0, -3, 1.5, True, float("nan")])
def test_round_timer_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        RoundTimer(window=window)


# ---------------------------------------------------------------------------------------------- CLI + CSV / TensorBoard
@pytest.fixture
def config_logging_cli(monkeypatch):
    """main() with LogConfigCallback as save_config_callback (what cli.py installs; harmless when it already does)."""
    monkeypatch.setattr(
        cli_module, "FederatedCLI", functools.partial(cli_module.FederatedCLI, save_config_callback=LogConfigCallback)
    )
    return cli_module.main


def _record_client_losses(monkeypatch):
    """Patch FederatedLoop.train_client to keep every client's update: an independent view of the round."""
    seen = {}
    original = FederatedLoop.train_client

    def recording(self, plan, client_id, global_flat):
        update = original(self, plan, client_id, global_flat)
        seen.setdefault(plan.round, []).append(update)
        return update

    monkeypatch.setattr(FederatedLoop, "train_client", recording)
    return seen


def _tiny_overrides(tmp_path, rounds=2):
    return [
        f"--trainer.max_steps={rounds}",
        f"--trainer.val_check_interval={rounds}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--model.local_steps=3",
        "--model.clients_per_round=4",
        "--trainer.callbacks+=fedlightning.callbacks.telemetry.RoundTimer",
    ]


def test_csv_logger_gets_per_round_metrics_and_resolved_config(tmp_path, monkeypatch, config_logging_cli):
    seen = _record_client_losses(monkeypatch)
    cli = config_logging_cli(
        ["fit", "--config", QUICKSTART, f"--trainer.logger.init_args.save_dir={tmp_path}"] + _tiny_overrides(tmp_path)
    )
    files = glob.glob(os.path.join(str(tmp_path), "**", "metrics.csv"), recursive=True)
    assert len(files) == 1
    with open(files[0]) as f:
        rows = list(csv.DictReader(f))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    expected = [sum(u.mean_loss for u in seen[r]) / len(seen[r]) for r in sorted(seen)]
    # the clients' float32 losses averaged (numerics.rtol32)
    assert train == pytest.approx(expected, rel=rtol32(4 + 1)) and len(train) == 2
    steps = [float(r["round/local_steps"]) for r in rows if r.get("round/local_steps")]
    assert steps == [3.0, 3.0]
    assert len([r for r in rows if r.get("time/rounds_per_second")]) == 2
    acc = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
    dm = cli.datamodule
    val = torch.as_tensor(dm.val_indices)  # validation: the held-out training rows, not the test set
    with torch.no_grad():
        logits = cli.model.model.net(dm.train_dataset.x[val])
        direct = float((logits.argmax(-1) == dm.train_dataset.y[val]).float().mean())
    assert acc == pytest.approx([direct], rel=rtol32(1))  # one float32 rounding of the same ratio of counts
    # the resolved config (overrides applied, defaults filled in) is in the logger's hparams.yaml
    hp_files = glob.glob(os.path.join(str(tmp_path), "**", "hparams.yaml"), recursive=True)
    assert len(hp_files) == 1
    with open(hp_files[0]) as f:
        hp = yaml.safe_load(f)
    assert hp["model"]["local_steps"] == 3 and hp["model"]["clients_per_round"] == 4
    assert hp["model"]["client_optimizer"]["init_args"]["lr"] == 0.1
    assert hp["model"]["client_optimizer"]["init_args"]["momentum"] == 0.0  # a default, filled in
    assert hp["data"]["class_path"] == "fedlightning.datamodules.DigitsDataModule"
    assert hp["trainer"]["max_steps"] == 2
    assert set(hp) <= set(cli.config["fit"].as_dict())  # the config alone: no module hyper-parameter beside it


def test_tensorboard_logger_gets_metrics_and_config(tmp_path, monkeypatch, config_logging_cli):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = _record_client_losses(monkeypatch)
    config_logging_cli(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
        + _tiny_overrides(tmp_path)
    )
    events = glob.glob(os.path.join(str(tmp_path), "**", "events.out.tfevents.*"), recursive=True)
    assert events
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    train = [e.value for e in acc.Scalars("train/loss")]
    expected = [sum(u.mean_loss for u in seen[r]) / len(seen[r]) for r in sorted(seen)]
    assert train == pytest.approx(expected, rel=rtol32(4 + 1))  # as above
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1]
    with open(glob.glob(os.path.join(str(tmp_path), "**", "hparams.yaml"), recursive=True)[0]) as f:
        hp = yaml.safe_load(f)
    assert hp["model"]["local_steps"] == 3


# ---------------------------------------------------------------------------------------------- W&B mode policy
def test_wandb_mode_policy(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_mode({}, netrc_path=str(netrc))["mode"] == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}, netrc_path=str(netrc))["mode"] == "disabled"
    assert wandb_mode({"WANDB_API_KEY": "x"}, netrc_path=str(netrc))["mode"] == "online"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert wandb_mode({}, netrc_path=str(netrc))["mode"] == "online"
    netrc.write_text("machine example.org login a password b\n")
    assert wandb_mode({}, netrc_path=str(netrc))["mode"] == "offline"


def test_cli_sets_offline_when_nothing_is_configured(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    cli_module.main(
        ["--config", QUICKSTART, "--trainer.logger=false", "--trainer.enable_checkpointing=false"], run=False
    )
    assert os.environ["WANDB_MODE"] == "offline"
    assert wandb_mode()["mode"] == "offline"


def test_cli_installs_log_config_callback():
    """cli.py passes save_config_callback=LogConfigCallback (the one-line wiring this module needs)."""
    cli = cli_module.main(
        ["--config", QUICKSTART, "--trainer.logger=false", "--trainer.enable_checkpointing=false"], run=False
    )
    if not any(isinstance(cb, LogConfigCallback) for cb in cli.trainer.callbacks):
        pytest.skip(
            "fedlightning/cli.py does not install LogConfigCallback yet "
            "(FederatedCLI.__init__: kwargs.setdefault('save_config_callback', LogConfigCallback))"
        )
    assert sum(isinstance(cb, LogConfigCallback) for cb in cli.trainer.callbacks) == 1


class _Chunks(IID):
    """Client i gets samples [40 i, 40 i + 40) (a fixed split, for a test that poisons one client's samples)."""

    def split(self, labels, num_clients, rng):
        return [np.arange(40 * c, 40 * c + 40) for c in range(num_clients)]


class _Poisoned(pl.LightningModule):
    """A user's module logging its loss and a torchmetrics accuracy; a sample whose third element is 1 makes the
    loss of its batch NaN (the client holding such samples fails with a non-finite training loss)."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        x, y, poison = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        loss = loss + torch.where(poison.any(), float("nan"), 0.0)  # a constant: no NaN in the others' gradients
        self.acc(logits, y)
        self.log("acc", self.acc)
        self.log("myloss", loss)
        return loss


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_client_left_out_of_the_round_is_left_out_of_its_logged_values(mode):
    """A client with a non-finite loss is skipped; its self.log values made client/<name> NaN for the round and its
    torchmetrics updates counted. Now client/myloss and client/acc cover the healthy clients, as train/loss does:
    with a learning rate of 0 the model stays at its initial weights, so both equal the initial model's loss and
    accuracy over the healthy clients' batches (the data module's own loaders, recomputed here)."""
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import FederatedDataModule

    digits = load_digits()
    x = torch.tensor(digits.data[:240] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:240], dtype=torch.long)
    poison = torch.zeros(240, dtype=torch.bool)
    poison[80:120] = True  # client 2
    dm = FederatedDataModule.from_datasets(
        TensorDataset(x, y, poison), None, partition=_Chunks(), num_clients=6, batch_size=10, val_fraction=0.0, seed=0
    )
    model = _Poisoned()
    init = copy.deepcopy(model.net)
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
        local_steps=3,
        clients_per_round=6,
        seed=1,
        client_execution=mode,
    )
    trainer = make_trainer(1, callbacks=[FedAvg()], precision="64-true")
    with pytest.warns(UserWarning, match=r"client 2 skipped \(non-finite training loss\)"):
        trainer.fit(loop, datamodule=dm)
    if mode == "vectorized":
        assert loop.vectorized_engine is not None
    losses, correct, total = [], 0, 0
    for c in dm.sample_clients(0):
        if c == 2:
            continue
        batches = iter(dm.client_dataloader(c, 0, seed=1))
        for _ in range(3):
            bx, by, _ = next(batches)
            with torch.no_grad():
                logits = init.double()(bx.double())
            losses.append(float(F.cross_entropy(logits, by)))
            correct += int((logits.argmax(1) == by).sum())
            total += len(by)
    logged = trainer.callback_metrics
    assert float(logged["round/failed_clients"]) == 1.0
    expected = float(np.mean(losses))  # float64; the engine reports logged values in float32 (one rounding each)
    assert abs(float(logged["client/myloss"]) - expected) <= rtol32(1) * abs(expected)
    assert float(logged["client/acc"]) == pytest.approx(correct / total, abs=1e-7)
