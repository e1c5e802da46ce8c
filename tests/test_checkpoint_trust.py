"""Checkpoints and data files cannot run code; a run keeps the last round it completed; ``--ckpt_path last`` resumes
the newest complete checkpoint by round and removes the temporary files of interrupted writes; checkpoint files get
the umask's permissions.

The "evil" files below hold an object whose unpickling calls ``os.system("touch <marker>")``: a marker file that
exists afterwards means pickled code ran.
"""

import csv
import hashlib
import os
import pickle
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path, PurePosixPath

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fedlightning.cli as cli_module
from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FederatedCallback
from fedlightning.checkpoint import (
    STALE_TEMP_SECONDS,
    AtomicCheckpointIO,
    CheckpointError,
    RoundCheckpoint,
    check_checkpoint,
    read_checkpoint,
    remove_interrupted_writes,
    safe_types,
)
from fedlightning.cli import main
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.optim import SgdArmijo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
TINY = [
    "--config",
    QUICK,
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_model_summary",
    "false",
    "--data.init_args.num_clients",
    "10",
    "--model.clients_per_round",
    "2",
    "--model.local_steps",
    "2",
    "--test_after_fit",
    "false",
]
REFUSED = (
    "refuses to load: it needs the type os.system, which is not an allow-listed data type and could run code; "
    "pass --weights_only false (Python: weights_only=False) to load a checkpoint you trust"
)


def _tiny(save_dir, *extra):
    return [
        *TINY,
        "--trainer.logger.init_args.save_dir",
        str(save_dir),
        "--trainer.default_root_dir",
        str(save_dir),
        *extra,
    ]


def _exit_with_error(capsys, args):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


def _weights(module):
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()


class Evil:
    """Unpickling it runs ``os.system``, which creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fedlightning checkpoint of the tiny quickstart run (1 round) and its contents."""
    d = tmp_path_factory.mktemp("trained")
    cli = main(["fit", *_tiny(d, "--trainer.max_steps", "1")])
    path = os.path.join(cli.trainer.log_dir, "checkpoints", "last.ckpt")
    return path, read_checkpoint(path)


def _write_evil(trained, path, marker):
    """The trained checkpoint (a valid FederatedLoop checkpoint) with an Evil object in its fedlightning section."""
    ckpt = dict(trained[1])
    ckpt["fedlightning"] = {**ckpt["fedlightning"], "note": Evil(marker)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(ckpt, path)
    return path


# ====================================================================== 1. no code from checkpoints
@pytest.mark.parametrize(
    "subcommand,extra",
    [("fit", []), ("fit", ["--weights_only", "true"]), ("validate", []), ("test", []), ("predict", [])],
    ids=["fit", "fit-weights_only-true", "validate", "test", "predict"],
)
def test_evil_checkpoint_is_refused_by_every_subcommand(trained, tmp_path, capsys, subcommand, extra):
    marker = tmp_path / "MARKER"
    evil = _write_evil(trained, str(tmp_path / "evil.ckpt"), marker)
    args = [subcommand, *_tiny(tmp_path / "run"), "--ckpt_path", evil, *extra]
    if subcommand == "fit":
        args += ["--trainer.max_steps", "2"]
    line = _exit_with_error(capsys, args)
    assert line == f"error: checkpoint {evil}: {REFUSED}"
    assert not marker.exists()


def test_planted_last_checkpoint_is_refused(trained, tmp_path, capsys):
    """An evil file planted among the run's checkpoints stops ``--ckpt_path last`` (it is not skipped), even next to
    a good checkpoint of a later round."""
    marker = tmp_path / "MARKER"
    good = tmp_path / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    good.parent.mkdir(parents=True)
    good.write_bytes(open(trained[0], "rb").read())
    planted = _write_evil(trained, str(tmp_path / "quickstart" / "version_1" / "checkpoints" / "last.ckpt"), marker)
    line = _exit_with_error(capsys, ["fit", *_tiny(tmp_path, "--trainer.max_steps", "2"), "--ckpt_path", "last"])
    assert line == f"error: checkpoint {planted}: {REFUSED}"
    assert not marker.exists()


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_the_trainers_own_read_is_safe(trained, tmp_path, fn):
    """Without the CLI's checks, the Trainer's read through AtomicCheckpointIO refuses the file too."""
    marker = tmp_path / "MARKER"
    evil = _write_evil(trained, str(tmp_path / "evil.ckpt"), marker)
    loop = FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[128]), local_steps=1, clients_per_round=2)
    trainer = make_trainer(2, plugins=[AtomicCheckpointIO()])
    kwargs = (
        {"dataloaders": DataLoader(TensorDataset(torch.zeros(2, 64)))}
        if fn == "predict"
        else {"datamodule": DigitsDataModule(num_clients=10, batch_size=16, seed=0)}
    )
    with pytest.raises(CheckpointError) as info:
        getattr(trainer, fn)(loop, ckpt_path=evil, **kwargs)
    assert str(info.value) == f"checkpoint {evil}: {REFUSED}" and info.value.unsafe_type == "os.system"
    assert not marker.exists()


def test_weights_only_false_is_the_warned_opt_in(trained, tmp_path):
    """The same file loads with ``--weights_only false``: its code runs (the marker appears) after a warning."""
    marker = tmp_path / "MARKER"
    evil = _write_evil(trained, str(tmp_path / "evil.ckpt"), marker)
    with pytest.warns(
        UserWarning,
        match=rf"checkpoint {evil}: loading with weights_only=False \(--weights_only "
        r"false\): any code pickled in the file runs now",
    ):
        cli = main(
            [
                "fit",
                *_tiny(tmp_path / "run", "--trainer.max_steps", "2"),
                "--ckpt_path",
                evil,
                "--weights_only",
                "false",
            ]
        )
    assert marker.exists()
    assert cli.trainer.global_step == 2


def test_refused_types_are_named_whatever_the_pickle(trained, tmp_path):
    """Torch names the global of a protocol-2 file; a protocol-4 pickle (STACK_GLOBAL, which torch's reader does not
    name) is read statically; an object array's element type is refused by its dtype."""
    marker = tmp_path / "MARKER"
    p4 = tmp_path / "p4.ckpt"
    with open(p4, "wb") as f:
        pickle.dump({"state_dict": {}, "x": Evil(marker)}, f, protocol=4)
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(p4)
    assert info.value.summary_line() == f"checkpoint {p4}: {REFUSED}"
    objects = tmp_path / "objects.ckpt"
    torch.save({**trained[1], "extra": np.array([1, "a"], dtype=object)}, objects)
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(objects)
    assert info.value.unsafe_type == "numpy.dtypes.ObjectDType"
    assert not marker.exists()


class _ObjectDtype:
    """Pickles as ``numpy.dtype("O8")``: the admitted dtype constructor, not the refused ObjectDType class."""

    def __reduce__(self):
        return (np.dtype, ("O8", False, True))


class _ObjectArray:
    def __reduce__(self):
        core = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
        return (core._reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), _ObjectDtype(), False, ["hello", ("t", 1)]))


@pytest.mark.parametrize("where", ["top", "nested"])
def test_an_object_array_built_through_the_dtype_constructor_is_refused(trained, tmp_path, where):
    path = tmp_path / "objects.ckpt"
    extra = _ObjectArray() if where == "top" else {"metrics": [1.0, {"hist": _ObjectArray()}]}
    torch.save({**trained[1], "extra": extra}, path)
    with pytest.raises(CheckpointError, match="refuses to load: it holds a numpy array of object dtype") as info:
        check_checkpoint(path)
    assert info.value.unsafe_type == "numpy object array"


def test_allow_listed_data_types_load_and_nothing_else_is_allowed_afterwards(trained, tmp_path):
    """Paths and numpy scalars / arrays load under weights_only (torch alone refuses them); the allow-list is scoped
    to fedlightning's reads."""
    extra = {
        "path": Path("/data/run"),
        "pure": PurePosixPath("a/b"),
        "f64": np.float64(0.1),
        "i64": np.int64(-3),
        "flag": np.bool_(True),
        "name": np.str_("x"),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
    }
    path = tmp_path / "typed.ckpt"
    torch.save({**trained[1], "extra": extra}, path)
    before = torch.serialization.get_safe_globals()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    loaded = check_checkpoint(path)["extra"]
    # fedlightning's allow-list is not left in torch's process-wide one (torch itself may register its own types
    # meanwhile, when a lazily imported torch module loads: only ours are checked)
    added = [g for g in torch.serialization.get_safe_globals() if g not in before]
    ours = [t if not isinstance(t, tuple) else t[0] for t in safe_types()]
    assert not [g for g in added if (g if not isinstance(g, tuple) else g[0]) in ours], added
    for key, value in extra.items():
        assert type(loaded[key]) is type(value), key
    assert loaded["path"] == extra["path"] and loaded["pure"] == extra["pure"] and loaded["name"] == "x"
    assert loaded["f64"] == np.float64(0.1) and loaded["i64"] == -3 and loaded["flag"]
    np.testing.assert_array_equal(loaded["array"], extra["array"])
    assert loaded["array"].dtype == np.float32


# ====================================================================== 2. real checkpoints resume under weights_only
class HParamNet(pl.LightningModule):
    """A user's module: hyper-parameters, torchmetrics metrics, SGD with a ReduceLROnPlateau scheduler, and extra
    plain data (a path, numpy values) in its own checkpoint hook."""

    def __init__(self, lr: float = 0.2, hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.loaded_extra = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train/loss"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["user_extra"] = {"dir": Path("/data"), "best": np.float64(0.5), "counts": np.arange(3)}

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extra = checkpoint["user_extra"]


def test_user_module_checkpoint_resumes_bit_exactly_under_weights_only(tmp_path):
    """save_hyperparameters + torchmetrics + an LR scheduler + a checkpoint hook with paths and numpy values:
    2 rounds, then resumed to 4 with ``--weights_only true``, equal the uninterrupted 4 rounds bit for bit."""
    user = ["--model.model", f"{__name__}.HParamNet", "--model.client_optimizer", "null"]
    full = main(["fit", *_tiny(tmp_path / "full", "--trainer.max_steps", "4"), *user])
    main(["fit", *_tiny(tmp_path / "cut", "--trainer.max_steps", "2"), *user])
    resumed = main(
        [
            "fit",
            *_tiny(tmp_path / "cut", "--trainer.max_steps", "4"),
            *user,
            "--ckpt_path",
            "last",
            "--weights_only",
            "true",
        ]
    )
    assert resumed.trainer.global_step == 4
    assert torch.equal(_weights(resumed.model), _weights(full.model))
    extra = resumed.model.model.loaded_extra
    assert extra["dir"] == Path("/data") and type(extra["best"]) is np.float64
    np.testing.assert_array_equal(extra["counts"], np.arange(3))


class _NumpyState(FederatedCallback):
    """A researcher's callback keeping numpy scalars (a float32 loss, a count) in its state and in the loop's
    per-client state."""

    def __init__(self):
        self.best, self.rounds = np.float32(np.inf), np.int64(0)

    def on_client_end(self, trainer, pl_module, plan, update):
        self.best = min(self.best, np.float32(update.first_loss))
        pl_module.client_state.set("numpy_probe", update.client_id, {"first_loss": np.float64(update.first_loss)})

    def on_round_end(self, trainer, pl_module, result):
        self.rounds += 1

    def state_dict(self):
        return {"best": self.best, "rounds": self.rounds}

    def load_state_dict(self, state_dict):
        self.best, self.rounds = state_dict["best"], state_dict["rounds"]


def _python_fit(folder, max_steps, ckpt_path=None, **trainer_args):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    loop = FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[16]), local_steps=2, clients_per_round=3, seed=0)
    probe = _NumpyState()
    every_round = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(max_steps, [probe, every_round], enable_checkpointing=True, **trainer_args)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0), ckpt_path=ckpt_path)
    return trainer, loop, probe


def test_a_python_trainer_writes_atomically_and_resumes_numpy_state(tmp_path):
    """A Trainer built in Python without plugins: its checkpoints went through Lightning's default IO, written in
    place, and the read of ``ckpt_path`` refused the numpy scalars the callback keeps (torch's weights_only
    ``UnpicklingError``), so the run could not resume. The loop installs AtomicCheckpointIO: the run resumes and
    equals the uninterrupted one, numpy types included; another checkpoint IO the user gave is kept."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    full, full_loop, full_probe = _python_fit(tmp_path / "full", 4)
    assert type(full.strategy.checkpoint_io) is AtomicCheckpointIO
    _python_fit(tmp_path / "cut", 2)
    resumed, loop, probe = _python_fit(tmp_path / "cut", 4, ckpt_path=str(tmp_path / "cut" / "epoch=0-step=2.ckpt"))
    assert resumed.global_step == 4 and probe.rounds == full_probe.rounds == 4
    assert type(probe.best) is np.float32 and probe.best == full_probe.best
    assert torch.equal(_weights(loop), _weights(full_loop))
    clients = loop.client_state.clients("numpy_probe")
    assert clients == full_loop.client_state.clients("numpy_probe") and clients
    for c in clients:
        value = loop.client_state.get("numpy_probe", c)["first_loss"]
        assert type(value) is np.float64 and value == full_loop.client_state.get("numpy_probe", c)["first_loss"]

    class OwnIO(TorchCheckpointIO):
        pass

    own, _, _ = _python_fit(tmp_path / "own", 1, plugins=[OwnIO()])
    assert type(own.strategy.checkpoint_io) is OwnIO


_PREEMPTED_SCRIPT = """
import os, signal, sys
import lightning.pytorch as pl, torch
from fedlightning import FederatedLoop
from fedlightning.checkpoint import RoundCheckpoint
from fedlightning.datamodules import DigitsDataModule
from fedlightning.models import MLP

class Preempt(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)

torch.manual_seed(0)
loop = FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[16]), local_steps=1, clients_per_round=2, seed=0)
trainer = pl.Trainer(max_steps=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, callbacks=[Preempt(), RoundCheckpoint(dirpath=sys.argv[1], save_last=True)])
trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
print("script went on after fit")
"""


def test_a_python_script_stopped_by_sigterm_exits_143_with_its_round_saved(tmp_path):
    """Lightning ends a fit that SIGTERM stopped with a SystemExit without a code: a plain Python script exited
    with status 0, as a finished run does, so a restart loop or a scheduler took the preempted run for done. The
    loop gives the exception the CLI's status 143 and warns; the round in progress is saved as last.ckpt."""
    from fedlightning.checkpoint import SIGTERM_EXIT_STATUS

    proc = subprocess.run(
        [sys.executable, "-c", _PREEMPTED_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert proc.returncode == SIGTERM_EXIT_STATUS, proc.stderr[-2000:]
    assert "script went on" not in proc.stdout
    assert "the run received SIGTERM and stopped after round 2" in proc.stderr
    assert read_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 2


# ====================================================================== 3. nothing lost: the final round
def _last_holds_the_model(path, module):
    ckpt = read_checkpoint(path)
    state = module.state_dict()
    assert set(ckpt["state_dict"]) == set(state)
    assert all(torch.equal(ckpt["state_dict"][k], state[k]) for k in state)
    return ckpt["global_step"]


def test_a_finished_run_checkpoints_its_final_round(tmp_path):
    cli = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "13")])
    folder = os.path.join(cli.trainer.log_dir, "checkpoints")
    assert _last_holds_the_model(os.path.join(folder, "last.ckpt"), cli.model) == 13
    assert {f: read_checkpoint(os.path.join(folder, f))["global_step"] for f in os.listdir(folder)} == {
        "last.ckpt": 13,
        "epoch=0-step=10.ckpt": 10,
    }


def test_early_stopping_keeps_the_round_it_stopped_at(tmp_path):
    """EarlyStopping stops at the validation of round 12 (threshold reached); the default checkpoint saved round 10,
    and the final round 12 too."""
    cli = main(
        [
            "fit",
            *_tiny(
                tmp_path,
                "--trainer.max_steps",
                "40",
                "--trainer.limit_val_batches",
                "1.0",
                "--trainer.val_check_interval",
                "12",
            ),
            "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
            "--trainer.callbacks.monitor=val/loss",
            "--trainer.callbacks.stopping_threshold=1e9",
        ]
    )
    assert cli.trainer.global_step == 12
    assert _last_holds_the_model(os.path.join(cli.trainer.log_dir, "checkpoints", "last.ckpt"), cli.model) == 12


def _early_stopped(save_dir, *extra, stop=True):
    args = [
        "fit",
        *_tiny(save_dir, "--trainer.max_steps", "16", "--trainer.limit_val_batches", "1.0"),
        "--trainer.val_check_interval",
        "4",
        *extra,
    ]
    if stop:
        args += [
            "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
            "--trainer.callbacks.monitor=val/loss",
            "--trainer.callbacks.stopping_threshold=1e9",
        ]
    return main(args)


def test_resuming_an_early_stopped_run_trains_no_further_round(tmp_path, caplog):
    """A restart loop that resumes a run EarlyStopping ended (``--ckpt_path last`` again) leaves it as it was, as
    resuming after ``max_steps`` does; resumed without the EarlyStopping it trains on to ``max_steps``."""
    first = _early_stopped(tmp_path)
    assert first.trainer.global_step == 4
    last = os.path.join(first.trainer.log_dir, "checkpoints", "last.ckpt")
    with caplog.at_level("INFO"):
        again = _early_stopped(tmp_path, "--ckpt_path", last)
    assert again.trainer.global_step == 4
    assert torch.equal(_weights(again.model), _weights(first.model))
    assert "EarlyStopping(monitor='val/loss') stopped the run this checkpoint comes from at round 4" in caplog.text
    on = _early_stopped(tmp_path, "--ckpt_path", last, stop=False)
    assert on.trainer.global_step == 16


def _monitored(save_dir, every_n_train_steps):
    return main(
        [
            "fit",
            *_tiny(
                save_dir,
                "--trainer.max_steps",
                "8",
                "--trainer.limit_val_batches",
                "1.0",
                "--trainer.val_check_interval",
            ),
            "2",
            "--trainer.callbacks+=fedlightning.checkpoint.RoundCheckpoint",
            "--trainer.callbacks.monitor=val/loss",
            "--trainer.callbacks.save_top_k=2",
            f"--trainer.callbacks.every_n_train_steps={every_n_train_steps}",
        ]
    )


def _validation_losses(cli):
    """{round: val/loss} from metrics.csv (a round's validation is logged at step round − 1)."""
    with open(os.path.join(cli.trainer.log_dir, "metrics.csv")) as f:
        return {int(r["step"]) + 1: float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}


def _ranked(cli):
    (ck,) = [c for c in cli.trainer.checkpoint_callbacks if c.monitor]
    return ck, {read_checkpoint(path)["global_step"]: float(score) for path, score in ck.best_k_models.items()}


def test_a_monitored_round_checkpoint_ranks_each_round_by_its_own_validation(tmp_path):
    """Saved every 2 rounds, validated every 2 rounds: each kept file's score is the validation of the round it
    holds (Lightning's ModelCheckpoint would rank round 8 by round 6's validation), and the best is the round of the
    lowest logged val/loss."""
    cli = _monitored(tmp_path, 2)
    losses = _validation_losses(cli)
    assert sorted(losses) == [2, 4, 6, 8]
    ck, ranked = _ranked(cli)
    kept = sorted(losses, key=losses.get)[:2]
    assert ranked == {r: losses[r] for r in kept}
    assert read_checkpoint(ck.best_model_path)["global_step"] == kept[0]
    assert float(ck.best_model_score) == losses[kept[0]]


def test_a_saved_round_without_its_own_validation_is_not_ranked(tmp_path):
    """Saved every 3 rounds, validated every 2: rounds 3 (no validation after it) is not ranked by round 2's value,
    with a warning; round 6 is ranked by its own validation."""
    with pytest.warns(UserWarning, match=r"round 3 gets no top-k file: no validation follows it"):
        cli = _monitored(tmp_path, 3)
    losses = _validation_losses(cli)
    assert _ranked(cli)[1] == {6: losses[6]}


class CopyAtValidationStart(pl.Callback):
    """Copies ``last.ckpt`` when round ``round``'s validation starts: the file a run killed during it leaves."""

    def __init__(self, folder, round):
        self.folder, self.round = folder, round

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step == self.round and not trainer.sanity_checking:
            src = os.path.join(self.folder, "last.ckpt")
            with open(src, "rb") as f, open(os.path.join(self.folder, "killed.ckpt"), "wb") as g:
                g.write(f.read())


class FailsValidationAt(MLP):
    def __init__(self, round: int):
        super().__init__(input_dim=64, num_classes=10, hidden=[8])
        self.round = round

    def validation_step(self, batch, batch_idx):
        if self.global_step == self.round and not self.trainer.sanity_checking:
            raise RuntimeError("validation failed")
        return super().validation_step(batch, batch_idx)


def _validated_fit(tmp_path, module, max_steps, callbacks=(), ckpt_path=None):
    folder = str(tmp_path / "ck")
    ck = RoundCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        max_steps,
        callbacks=[ck, *callbacks],
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        limit_val_batches=1,
        val_check_interval=4,
        num_sanity_val_steps=0,
    )
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    loop = FederatedLoop(module, local_steps=2, clients_per_round=2, seed=0)
    trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, folder


def _small_mlp():
    return MLP(input_dim=64, num_classes=10, hidden=[8])


def _pending(path):
    (state,) = [v for k, v in read_checkpoint(path)["callbacks"].items() if k.startswith("RoundCheckpoint")]
    return state["validation_pending"]


def test_a_file_written_before_its_rounds_validation_completed_says_so_on_resume(tmp_path):
    """The round-end file of a validated round (what a kill during the validation leaves) records the pending
    validation, the file rewritten after it and a round without validation do not; resuming the first warns that
    the validation is not run again."""
    trainer, folder = _validated_fit(tmp_path, _small_mlp(), 6, [CopyAtValidationStart(str(tmp_path / "ck"), 4)])
    assert _pending(os.path.join(folder, "killed.ckpt")) == 4
    assert _pending(os.path.join(folder, "epoch=0-step=4.ckpt")) is None  # written again after the validation
    assert _pending(os.path.join(folder, "last.ckpt")) is None  # round 6: no validation
    with pytest.warns(UserWarning, match=r"round 4 as it was before that round's validation"):
        resumed, _ = _validated_fit(tmp_path / "r", _small_mlp(), 6, ckpt_path=os.path.join(folder, "killed.ckpt"))
    assert resumed.global_step == 6


def _fit_validating(checkpoint, max_steps, val_every, module=None, local_steps=2, ckpt_path=None):
    """A fit of ``max_steps`` rounds of ``module`` (default :func:`_small_mlp`) that validates every ``val_every``
    rounds and checkpoints with ``checkpoint``."""
    trainer = make_trainer(
        max_steps,
        callbacks=[checkpoint],
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        limit_val_batches=1,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    loop = FederatedLoop(module or _small_mlp(), local_steps=local_steps, clients_per_round=2, seed=0)
    trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return dm


@pytest.mark.parametrize("every", [None, 1])
def test_files_a_monitored_checkpoint_writes_after_a_validation_are_not_pending(tmp_path, every):
    """With a monitor, Lightning ranks and writes its files when the validation ends (per validation, or, with
    every_n_train_steps, the round's save delayed to then): they hold the validation's results, and resuming or
    evaluating them warns of nothing."""
    folder = str(tmp_path / "ck")
    ck = RoundCheckpoint(
        dirpath=folder, monitor="val/acc", mode="max", save_top_k=-1, save_last=True, every_n_train_steps=every
    )
    dm = _fit_validating(ck, 3, 1)
    files = sorted(os.listdir(folder))
    assert len(files) == 4  # rounds 1, 2, 3 and last
    assert [_pending(os.path.join(folder, f)) for f in files] == [None] * 4
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*before that round's validation.*")
        resumed = make_trainer(4, plugins=[AtomicCheckpointIO()], limit_val_batches=1, num_sanity_val_steps=0)
        loop = FederatedLoop(_small_mlp(), local_steps=2, clients_per_round=2, seed=0)
        resumed.fit(loop, datamodule=dm, ckpt_path=os.path.join(folder, "last.ckpt"))
    assert resumed.global_step == 4


def test_a_lightning_checkpoint_written_before_its_rounds_validation_warns_on_resume(tmp_path):
    """Lightning's own ModelCheckpoint writes at the round's end, before the validation after it: the loop records
    the round in the file, and resuming it warns that the validation is not run (an EarlyStopping that this
    validation would have triggered cannot stop the resumed run); a round without validation resumes silently, and a
    RoundCheckpoint file that says so itself warns once."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = str(tmp_path / "ck")
    ck = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    dm = _fit_validating(ck, 3, 2)
    pending = {
        f: read_checkpoint(os.path.join(folder, f))["fedlightning"]["validation_pending"] for f in os.listdir(folder)
    }
    assert pending == {"step=1.ckpt": None, "step=2.ckpt": 2, "step=3.ckpt": None}

    def resume(path):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = make_trainer(4, plugins=[AtomicCheckpointIO()], limit_val_batches=0)
            resumed.fit(
                FederatedLoop(_small_mlp(), local_steps=2, clients_per_round=2, seed=0), datamodule=dm, ckpt_path=path
            )
        return [str(w.message) for w in caught if "before that round's validation" in str(w.message)]

    (told,) = resume(os.path.join(folder, "step=2.ckpt"))
    assert "round 2" in told and "goes on with round 3" in told and "EarlyStopping" in told
    assert resume(os.path.join(folder, "step=3.ckpt")) == []
    _, folder = _validated_fit(
        tmp_path / "rc", _small_mlp(), 6, [CopyAtValidationStart(str(tmp_path / "rc" / "ck"), 4)]
    )
    assert len(resume(os.path.join(folder, "killed.ckpt"))) == 1


class ScoredMLP(MLP):
    """Logs ``score`` (lower is better) at each validation, a fixed value per round: best round 4, then round 2."""

    SCORES = {1: 0.5, 2: 0.2, 3: 0.6, 4: 0.1, 5: 0.7}

    def __init__(self):
        super().__init__(input_dim=64, num_classes=10, hidden=[8])

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.log("score", self.SCORES[self.global_step])


def _scored_fit(folder, max_steps, top_k, ckpt_path=None):
    ck = RoundCheckpoint(
        dirpath=folder, monitor="score", mode="min", save_top_k=top_k, save_last=True, filename="{step}"
    )
    _fit_validating(ck, max_steps, 1, module=ScoredMLP(), local_steps=1, ckpt_path=ckpt_path)
    return ck


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_run_resumed_into_another_directory_keeps_its_best_rounds(tmp_path, top_k):
    """Rounds 1-3 in one directory, 4-5 resumed into another (as train.py resumes, in a new version directory): the
    best model is round 4 and the top k the rounds of the uninterrupted run; the earlier run's round-2 file stays in
    its directory when it falls out of the top k (Lightning would drop the ranking and name round 4 best only by
    chance of the later rounds)."""
    straight = _scored_fit(str(tmp_path / "straight"), 5, top_k)
    first = _scored_fit(str(tmp_path / "a"), 3, top_k)
    assert os.path.basename(first.best_model_path) == "step=2.ckpt"
    resumed = _scored_fit(str(tmp_path / "b"), 5, top_k, ckpt_path=str(tmp_path / "a" / "last.ckpt"))
    assert resumed.best_model_path == str(tmp_path / "b" / "step=4.ckpt")
    assert float(resumed.best_model_score) == float(straight.best_model_score) == pytest.approx(0.1)
    ranked = lambda ck: sorted((round(float(v), 6), os.path.basename(p)) for p, v in ck.best_k_models.items())  # noqa: E731
    assert ranked(resumed) == ranked(straight)
    assert os.path.isfile(tmp_path / "a" / "step=2.ckpt") and os.path.isfile(tmp_path / "a" / "last.ckpt")
    assert sorted(os.listdir(tmp_path / "b")) == ["last.ckpt", "step=4.ckpt"]


def test_an_exception_in_validation_leaves_a_file_that_says_its_validation_is_pending(tmp_path):
    with pytest.raises(RuntimeError, match="validation failed"):
        _validated_fit(tmp_path, FailsValidationAt(4), 8)
    last = str(tmp_path / "ck" / "last.ckpt")
    assert read_checkpoint(last)["global_step"] == 4 and _pending(last) == 4


class NanAfter(MLP):
    """An MLP whose loss is NaN from round ``bad_from`` on (every client of those rounds fails)."""

    def __init__(self, bad_from: int):
        super().__init__(input_dim=64, num_classes=10, hidden=[8])
        self.bad_from = bad_from

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= self.bad_from else loss


def _fit_until_error(tmp_path, callbacks=()):
    ck = RoundCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True, every_n_train_steps=10)
    trainer = make_trainer(30, callbacks=[ck, *callbacks], enable_checkpointing=True, plugins=[AtomicCheckpointIO()])
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    return trainer, dm, str(tmp_path / "ck" / "last.ckpt")


def test_max_failed_rounds_keeps_the_last_completed_round(tmp_path):
    loop = FederatedLoop(NanAfter(bad_from=12), local_steps=2, clients_per_round=2, seed=0, max_failed_rounds=2)
    trainer, dm, last = _fit_until_error(tmp_path)
    with pytest.raises(FloatingPointError, match="max_failed_rounds=2"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step > 10  # past the periodic checkpoint of round 10
    assert _last_holds_the_model(last, loop) == trainer.global_step


class RaiseInRound(FederatedCallback):
    """Raises in ``on_client_end`` of the second client of round ``round``."""

    def __init__(self, round: int):
        self.round, self.seen = round, 0

    def on_client_end(self, trainer, loop, plan, update):
        if plan.round == self.round:
            self.seen += 1
            if self.seen == 2:
                raise RuntimeError("stop in the middle of the round")


@pytest.mark.parametrize("client_state", [False, True], ids=["sgd", "armijo-with-client-state"])
def test_an_error_mid_round_saves_only_a_round_boundary(tmp_path, client_state):
    """SGD clients keep no state: the round in progress changed nothing, so round 12 (its start) is saved. SgdArmijo
    clients carrying their step: the first client already wrote its state, so nothing is saved (round 10 stays)."""
    opt = (lambda p: SgdArmijo(p, eta_max=4.0, reset="last", carry_step_size=True)) if client_state else None
    loop = FederatedLoop(
        MLP(input_dim=64, num_classes=10, hidden=[8]), client_optimizer=opt, local_steps=2, clients_per_round=3, seed=0
    )
    trainer, dm, last = _fit_until_error(tmp_path, [RaiseInRound(12)])
    with pytest.raises(RuntimeError, match="stop in the middle of the round"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 12
    if client_state:
        assert len(loop.client_state) > 0 and read_checkpoint(last)["global_step"] == 10
    else:
        assert _last_holds_the_model(last, loop) == 12


# ====================================================================== 4. --ckpt_path last: by round, temp files
@pytest.mark.parametrize(
    "change, problem",
    [
        ({"client_state": "garbage"}, "client_state is str, not a mapping"),
        ({"client_state": {"scaffold": [1, 2]}}, "client_state['scaffold'] is list, not a mapping of client ids"),
        ({"client_state": {"scaffold": {"a": {}}}}, "client_state holds the client id 'a', not an integer"),
        ({"failed_clients_total": "3"}, "failed_clients_total is '3', not an integer"),
        ({"client_groups": [4]}, "client_groups is list, not a mapping"),
    ],
    ids=["client-state", "namespace", "client-id", "counter", "client-groups"],
)
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_a_malformed_fedlightning_section_is_one_line(trained, tmp_path, capsys, change, problem, subcommand):
    """A hand-edited or damaged fedlightning section ended fit and validate in a traceback inside the restore
    (AttributeError: 'str' object has no attribute 'items'); it is now the checkpoint's one error line."""
    ckpt = dict(trained[1])
    ckpt["fedlightning"] = {**ckpt["fedlightning"], **change}
    path = tmp_path / "bad.ckpt"
    torch.save(ckpt, path)
    line = _exit_with_error(capsys, [subcommand, *_tiny(tmp_path), "--ckpt_path", str(path)])
    assert line == f"error: checkpoint {path}: its fedlightning section is malformed: {problem}"


def _with_round(trained, path, round_, mtime):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({**trained[1], "global_step": round_}, path)
    os.utime(path, (mtime, mtime))
    return path


def _host():
    """The host as AtomicCheckpointIO writes it into temporary file names (characters other than letters, digits and
    dots as ``_``, at most 64)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_last_is_the_newest_complete_round_of_any_file_name(trained, tmp_path, monkeypatch):
    """By round, not by name or time: a newer ``last.ckpt`` of an earlier round loses to step files of round 3; of the
    two round-3 files the newer one wins; a truncated file is skipped with a warning; a leftover temporary file of
    a dead writer is removed, one of a running writer is kept."""
    runs = tmp_path / "quickstart"
    now = time.time()
    _with_round(trained, str(runs / "version_0" / "checkpoints" / "last.ckpt"), 2, now)
    _with_round(trained, str(runs / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt"), 3, now - 30)
    newest = _with_round(trained, str(runs / "version_1" / "checkpoints" / "last-v1.ckpt"), 3, now - 20)
    truncated = runs / "version_1" / "checkpoints" / "last.ckpt"
    truncated.write_bytes(open(trained[0], "rb").read()[:200])
    host = _host()
    leftover = runs / "version_1" / "checkpoints" / f".tmp-{host}-{_dead_pid()}-abc.ckpt"
    leftover.write_bytes(b"half a checkpoint")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        writing = runs / "version_0" / "checkpoints" / f".tmp-{host}-{sleeper.pid}-def.ckpt"
        writing.write_bytes(b"being written")
        infos = []
        monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
        with pytest.warns(UserWarning, match="skipped") as caught:
            cli = main(["validate", *_tiny(tmp_path), "--ckpt_path", "last"])
    finally:
        sleeper.kill()
        sleeper.wait()
    where = os.path.join(tmp_path, "quickstart", "*", "checkpoints")
    assert infos[:2] == [
        f"--ckpt_path last: removed 1 temporary file(s) of interrupted checkpoint writes: {leftover}",
        f"--ckpt_path last: evaluating {newest} (round 3, the newest complete of 4 checkpoint file(s) in {where})",
    ]
    assert cli.config_init["validate"]["ckpt_path"] == newest
    assert [str(w.message) for w in caught if "skipped" in str(w.message)] == [
        f"--ckpt_path last: skipped checkpoint {truncated}: corrupt, truncated or not a checkpoint (RuntimeError: "
        "PytorchStreamReader failed reading zip archive: failed finding central directory)"
    ]
    assert not leftover.exists() and writing.exists()


def test_last_passes_over_a_damaged_newest_file(trained, tmp_path):
    """A newest ``last.ckpt`` damaged on disk (its bytes no longer match their zip checksums, which ``torch.load``
    does not compare) is skipped with a warning naming the entry; the run resumes from the newest intact file."""
    from test_cli_safety import damage_entry

    runs = tmp_path / "quickstart"
    intact = _with_round(trained, str(runs / "version_0" / "checkpoints" / "last.ckpt"), 3, time.time() - 30)
    source = _with_round(trained, str(tmp_path / "round4.ckpt"), 4, time.time())
    os.makedirs(runs / "version_1" / "checkpoints")
    damaged = damage_entry(source, runs / "version_1" / "checkpoints" / "last.ckpt")
    with pytest.warns(UserWarning, match="skipped") as caught:
        cli = main(["validate", *_tiny(tmp_path), "--ckpt_path", "last"])
    assert cli.config_init["validate"]["ckpt_path"] == intact
    (message,) = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert message.startswith(f"--ckpt_path last: skipped checkpoint {damaged}: corrupt: the bytes of its entry ")


def test_remove_interrupted_writes_rule(tmp_path):
    host = _host()
    old = time.time() - STALE_TEMP_SECONDS - 60
    files = {
        f".tmp-{host}-{_dead_pid()}-a.ckpt": True,  # this host, writer gone
        f".tmp-{host}-{os.getpid()}-b.ckpt": True,  # this process is not writing now
        f".tmp-{host}-{os.getppid()}-c.ckpt": False,  # this host, writer alive
        ".tmp-otherhost-1-d.ckpt": False,  # another host, recently modified
        ".tmp-otherhost-1-e.ckpt": True,  # another host, unmodified for over an hour
        ".tmp-q8x_2kd.ckpt": True,  # no writer recorded, old
        "last.ckpt": False,
    }
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    for name in (".tmp-otherhost-1-e.ckpt", ".tmp-q8x_2kd.ckpt"):
        os.utime(tmp_path / name, (old, old))
    removed = remove_interrupted_writes([str(tmp_path), str(tmp_path / "missing")])
    assert sorted(removed) == sorted(str(tmp_path / n) for n, gone in files.items() if gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, gone in files.items() if not gone)


KILLED_RUN = textwrap.dedent("""
    import io, os, signal, sys
    import torch
    torch.set_num_threads(int(os.environ.get("FEDLIGHTNING_TEST_THREADS", "1")))  # the test process's, as compared
    from fedlightning.cli import FederatedCLI, main
    FederatedCLI.checkpoint_every_n_rounds = 1
    kill_at, calls, real_save = int(sys.argv[1]), [0], torch.save

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:  # half of the bytes reach the temporary file, then kill -9
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    main(sys.argv[2:])
""")


def test_kill_9_mid_write_resumes_the_newest_complete_round_bit_exactly(tmp_path, monkeypatch):
    """Checkpoints every round write ``epoch=0-step=r.ckpt`` then ``last.ckpt``; kill -9 during the 6th write (round
    3's ``last.ckpt``) leaves last.ckpt at round 2, the step file at round 3 and half a temporary file. ``last``
    resumes round 3, removes the temporary file, and 4 rounds equal the uninterrupted run bit for bit."""
    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, "6", "fit", *_tiny(cut, "--trainer.max_steps", "4")],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    folder = cut / "quickstart" / "version_0" / "checkpoints"
    temps = [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
    assert len(temps) == 1
    assert {p.name: read_checkpoint(str(p))["global_step"] for p in folder.iterdir() if not p.name.startswith(".")} == {
        "last.ckpt": 2,
        "epoch=0-step=3.ckpt": 3,
    }
    infos = []
    monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
    resumed = main(["fit", *_tiny(cut, "--trainer.max_steps", "4"), "--ckpt_path", "last"])
    assert infos[0] == f"--ckpt_path last: removed 1 temporary file(s) of interrupted checkpoint writes: {temps[0]}"
    assert infos[1].startswith(f"--ckpt_path last: resuming from {folder / 'epoch=0-step=3.ckpt'} (round 3, ")
    assert not temps[0].exists()
    full = main(["fit", *_tiny(tmp_path / "full", "--trainer.max_steps", "4")])
    assert resumed.trainer.global_step == 4
    assert torch.equal(_weights(resumed.model), _weights(full.model))


# ====================================================================== 5. file permissions
@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_checkpoint_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"a": torch.ones(2)}, tmp_path / "x.ckpt")
        with open(tmp_path / "reference", "w"):  # how the system creates a file under this umask
            pass
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "x.ckpt").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "reference").st_mode) == 0o666 & ~umask


# ====================================================================== 6. CIFAR data files
def _cifar_file(folder, name, entry):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)
    return path


def test_cifar_pickle_naming_a_callable_is_refused(tmp_path):
    from fedlightning.datamodules.cifar import read_cifar

    marker = tmp_path / "MARKER"
    folder = tmp_path / "cifar-10-batches-py"
    path = _cifar_file(str(folder), "test_batch", {"data": Evil(marker), "labels": [0]})
    with pytest.raises(ValueError) as info:
        read_cifar(str(tmp_path), 10, "test")
    assert str(info.value) == (
        f"{path}: refuses to unpickle the global posix.system: a CIFAR data file holds only "
        "arrays, lists, dicts, strings and numbers, and unpickling another global could run "
        "code"
    )
    assert not marker.exists()


def test_cifar_official_checksums_are_torchvision_s():
    import torchvision

    from fedlightning.datamodules.cifar import OFFICIAL_MD5

    for cls, folder in (
        (torchvision.datasets.CIFAR10, "cifar-10-batches-py"),
        (torchvision.datasets.CIFAR100, "cifar-100-python"),
    ):
        assert {n: md5 for n, (md5, _) in OFFICIAL_MD5[folder].items()} == dict(cls.train_list + cls.test_list)


def test_cifar_official_size_file_must_match_its_checksum(tmp_path, monkeypatch):
    """A 10000-image test_batch claims to be the official file: its checksum is compared (refused naming both); the
    same content is read when it is the expected checksum; a smaller file is not compared."""
    import fedlightning.datamodules.cifar as cifar

    folder = str(tmp_path / "cifar-10-batches-py")
    labels = (np.arange(10000) % 10).tolist()
    path = _cifar_file(folder, "test_batch", {"data": np.zeros((10000, 3072), np.uint8), "labels": labels})
    actual = hashlib.md5(open(path, "rb").read()).hexdigest()
    with pytest.raises(ValueError) as info:
        cifar.read_cifar(str(tmp_path), 10, "test")
    assert str(info.value) == (
        f"{path}: MD5 checksum {actual} differs from the official "
        "40351d587109b95175f43aff81a1287e of cifar-10-batches-py/test_batch (a file of the "
        "official size under the official name must be the official file): download the "
        "archive again"
    )
    official = {**cifar.OFFICIAL_MD5["cifar-10-batches-py"], "test_batch": (actual, 10000)}
    monkeypatch.setitem(cifar.OFFICIAL_MD5, "cifar-10-batches-py", official)
    x, y, _ = cifar.read_cifar(str(tmp_path), 10, "test")
    assert x.shape == (10000, 3, 32, 32) and y.tolist() == labels
    monkeypatch.undo()
    _cifar_file(folder, "test_batch", {"data": np.zeros((100, 3072), np.uint8), "labels": labels[:100]})
    assert cifar.read_cifar(str(tmp_path), 10, "test")[0].shape == (100, 3, 32, 32)


def test_a_checkpoint_cannot_make_a_resumed_run_remove_files_outside_the_checkpoint_folder(tmp_path):
    """A checkpoint whose top-k state names files outside its folder (``<dirpath>/../x``, which Lightning takes for
    a path inside) does not make the resumed run remove them when they fall out of its top k or when it writes its
    own ``last``: the paths are dropped at the restore."""
    folder = tmp_path / "ck"
    _scored_fit(str(folder), 3, 1)
    state = read_checkpoint(str(folder / "last.ckpt"))
    victims = [tmp_path / "victim_topk.txt", tmp_path / "victim_last.txt"]
    for v in victims:
        v.write_text("precious")
    outside = [str(folder / ".." / v.name) for v in victims]
    (key,) = [k for k in state["callbacks"] if k.startswith("RoundCheckpoint")]
    state["callbacks"][key].update(
        best_k_models={outside[0]: torch.tensor(1e9)},
        kth_best_model_path=outside[0],
        kth_value=torch.tensor(1e9),
        best_model_score=torch.tensor(1e9),
        best_model_path=outside[0],
        last_model_path=outside[1],
    )
    torch.save(state, str(tmp_path / "crafted.ckpt"))
    resumed = _scored_fit(str(folder), 5, 1, ckpt_path=str(tmp_path / "crafted.ckpt"))
    assert all(v.read_text() == "precious" for v in victims)
    assert resumed.best_model_path == str(folder / "step=4.ckpt")  # ranked among the resumed run's own files


@pytest.mark.parametrize(
    "callback, warned",
    [
        ("every2", "the newest checkpoint file holds round 2"),
        ("every1", None),
        ("round", "the newest checkpoint file holds round 2"),  # RoundCheckpoint saves the final round as last only
        ("round_last", None),
    ],
)
def test_a_python_run_whose_files_miss_the_final_round_says_so(tmp_path, callback, warned):
    """Lightning's ModelCheckpoint every 2 rounds of a 3-round run keeps round 2 only, and nothing said that round 3
    exists only in memory; a checkpoint of every round, or RoundCheckpoint with save_last, is silent."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fedlightning.checkpoint import RoundCheckpoint

    cls = RoundCheckpoint if callback.startswith("round") else ModelCheckpoint
    every = 1 if callback == "every1" else 2
    ck = cls(dirpath=str(tmp_path), every_n_train_steps=every, save_top_k=-1, save_last=callback == "round_last")
    loop = FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[16]), local_steps=1, clients_per_round=2, seed=0)
    trainer = make_trainer(3, [ck], enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    said = [str(w.message) for w in caught if "final model is only in memory" in str(w.message)]
    if warned is None:
        assert said == []
    else:
        assert said == [
            f"training ended at round 3 and {warned}: the final model is only in memory. Add "
            "fedlightning.checkpoint.RoundCheckpoint(save_last=True) (it also saves the round training ends at; "
            "train.py's default) or call trainer.save_checkpoint(path)"
        ]
    if callback == "round_last":
        assert _last_holds_the_model(str(tmp_path / "last.ckpt"), loop) == 3


# ====================================================================== a Python resume with other settings
def _settings_fit(folder, max_steps, ckpt_path=None, cpr=3, lr=0.1, server_lr=1.0, split_seed=0):
    from fedlightning.callbacks import FedAvg

    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, num_classes=10, hidden=[16]),
        lambda p: torch.optim.SGD(p, lr=lr),
        local_steps=2,
        clients_per_round=cpr,
        seed=0,
    )
    trainer = make_trainer(
        max_steps,
        [FedAvg(server_lr=server_lr), RoundCheckpoint(dirpath=str(folder), save_last=True)],
        enable_checkpointing=True,
    )
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=split_seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return [str(w.message) for w in caught if "written by a run with other settings" in str(w.message)]


@pytest.mark.parametrize(
    "change, listed",
    [
        ({}, None),
        ({"cpr": 4}, "clients_per_round: checkpoint 3 -> now 4"),
        ({"lr": 0.05}, "client_optimizer: checkpoint 'SGD("),
        ({"server_lr": 0.5}, "callbacks: checkpoint [\"FedAvg(server_lr=1.0, weighting='samples')\"] -> now"),
        ({"split_seed": 1}, "data: checkpoint 'DigitsDataModule(batch_size=16, clients=10, split "),
    ],
)
def test_a_python_resume_with_other_settings_lists_them(tmp_path, change, listed):
    """train.py compares the stored config and refuses a resume with other settings; a Python run had no check at
    all, so a resume with another cohort size, client optimizer, strategy argument or client split trained on
    silently as if it continued the run. It now warns, listing each difference; the same settings warn nothing."""
    assert _settings_fit(tmp_path, 2) == []
    said = _settings_fit(tmp_path, 3, ckpt_path=str(tmp_path / "last.ckpt"), **change)
    if listed is None:
        assert said == []
    else:
        assert len(said) == 1 and listed in said[0] and len(said[0].splitlines()) == 2, said
