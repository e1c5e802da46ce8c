"""Every configuration error ends in one line ``error: <config key>: <message naming the value>`` with exit code 1.

A table of hostile command lines and YAML snippets, each run in process through ``fedlightning.cli.main`` on a tiny
quickstart (10 clients, 2 per round, 1 local step): parser errors (types, unknown / misspelled / abbreviated keys,
renamed parameters, classes that do not exist, invalid YAML) and impossible settings refused before round 0
(``max_steps``, ``val_check_interval``, seeds, non-finite learning rates). The last stderr line is compared with the
expected key and must contain the bad value; jsonargparse's usage and union dump must not be printed.
``FEDLIGHTNING_TRACEBACK=1`` still raises the original error. The trainer checks also hold for Python users
(``FederatedLoop`` in a plain ``Trainer``), and the table of renamed parameters matches the classes' signatures.
"""

import argparse
import functools
import inspect
import math
import os
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BatchSizeFinder,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelCheckpoint,
    SpikeDetection,
    StochasticWeightAveraging,
    Timer,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from fedlightning import FederatedLoop
from fedlightning._validation import SettingError
from fedlightning.cli import _RENAMED, FederatedCLI, _import, main
from fedlightning.datamodules import DigitsDataModule
from fedlightning.models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
TINY = [
    "--config",
    QUICK,
    "--trainer.max_steps",
    "1",
    "--trainer.logger",
    "false",
    "--trainer.enable_checkpointing",
    "false",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.limit_val_batches",
    "0",
    "--test_after_fit",
    "false",
    "--data.init_args.num_clients",
    "10",
    "--model.clients_per_round",
    "2",
    "--model.local_steps",
    "1",
]

# (id, extra command line arguments, the key the last line names, texts the line must contain)
COMMAND_LINES = [
    (
        "type float",
        ["--data.init_args.partition.init_args.alpha", "high"],
        "data.init_args.partition.init_args.alpha",
        ["expected a float, got 'high'"],
    ),
    ("type int", ["--model.local_steps", "abc"], "model.local_steps", ["expected an int or null, got 'abc'"]),
    (
        "type int of a class",
        ["--data.init_args.batch_size", "1.5"],
        "data.init_args.batch_size",
        ["expected an int, got 1.5"],
    ),
    (
        "type list item",
        ["--model.model.init_args.hidden", "[8, x]"],
        "model.model.init_args.hidden",
        ["expected an int, got 'x'"],
    ),
    (
        "type bool",
        ["--trainer.enable_checkpointing", "maybe"],
        "trainer.enable_checkpointing",
        ["expected a bool", "got 'maybe'"],
    ),
    ("type literal", ["--trainer.precision", "65"], "trainer.precision", ["'bf16-mixed'", "got 65"]),
    (
        "type client lr",
        ["--model.client_optimizer.lr", "fast"],
        "model.client_optimizer.init_args.lr",
        ["expected a float, got 'fast'"],
    ),
    ("type trainer", ["--trainer.max_steps", "three"], "trainer.max_steps", ["expected an int, got 'three'"]),
    (
        "unknown class",
        ["--model.model.class_path", "fedlightning.models.MPL"],
        "model.model.class_path",
        ["fedlightning.models.MPL does not exist", "did you mean fedlightning.models.MLP?"],
    ),
    (
        "unknown data class",
        ["--data.class_path", "fedlightning.datamodules.NoSuchData"],
        "data.class_path",
        ["fedlightning.datamodules.NoSuchData does not exist"],
    ),
    (
        "unknown module",
        ["--model.model.class_path", "nomodule.Net"],
        "model.model.class_path",
        ["cannot import 'nomodule.Net'", "No module named 'nomodule'"],
    ),
    (
        "unknown optimizer",
        ["--model.client_optimizer", "torch.optim.Sgd"],
        "model.client_optimizer.class_path",
        ["torch.optim.Sgd does not exist", "did you mean torch.optim.SGD?"],
    ),
    ("not a class", ["--model.model", "null"], "model.model", ["subclass of LightningModule", "got null"]),
    (
        "renamed SPS c",
        ["--model.client_optimizer", "fedlightning.optim.SPS", "--model.client_optimizer.c", "0.3"],
        "model.client_optimizer.init_args.c",
        ["SPS's c is now polyak_c"],
    ),
    (
        "renamed SPS lr",
        ["--model.client_optimizer", "fedlightning.optim.SPS", "--model.client_optimizer.lr", "0.1"],
        "model.client_optimizer.init_args.lr",
        ["SPS takes no lr", "fixed_step_size"],
    ),
    (
        "renamed FedAdam eps",
        ["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks.eps", "0.1"],
        "trainer.callbacks.init_args.eps",
        ["FedAdam's eps is now tau"],
    ),
    (
        "misspelled class argument",
        ["--model.model.init_args.hiden", "[8]"],
        "model.model.init_args.hiden",
        ["MLP has no argument 'hiden' (did you mean hidden?)"],
    ),
    (
        "misspelled key",
        ["--model.lcoal_steps", "5"],
        "model.lcoal_steps",
        ["unknown option 'lcoal_steps' (did you mean local_steps?)"],
    ),
    (
        "misspelled trainer key",
        ["--trainer.max_stepz=3"],
        "trainer.max_stepz",
        ["unknown option 'max_stepz' (did you mean max_steps?)"],
    ),
    (
        "abbreviated key",
        ["--model.local_step", "5"],
        "model.local_step",
        ["'local_step' (did you mean local_steps? abbreviated options are not accepted)"],
    ),
    (
        "missing required argument",
        ["--trainer.callbacks+=fedlightning.callbacks.RuntimeModel"],
        "trainer.callbacks[0].init_args.seconds_per_batch",
        ["RuntimeModel needs seconds_per_batch"],
    ),
    ("choice", ["--resume_mismatch", "maybe"], "resume_mismatch", ["invalid choice: 'maybe'"]),
    ("missing config file", ["--config", "no_such_config.yaml"], "config", ["no_such_config.yaml"]),
    ("constructor check", ["--model.client_execution", "vector"], "model.client_execution", ["got 'vector'"]),
    ("Lightning's own check", ["--trainer.max_steps", "-5"], "trainer.max_steps", ["-5"]),
    ("seed_everything", ["--seed_everything", "-1"], "seed_everything", ["got -1"]),
    (
        "optimizer constructor check",
        ["--model.client_optimizer", "fedlightning.optim.SgdArmijo", "--model.client_optimizer.c", "1.5"],
        "model.client_optimizer.init_args.c",
        ["c must be in (0, 1), got 1.5"],
    ),
    (
        "data setup check",
        ["--model.clients_per_round", "500"],
        "model.clients_per_round",
        ["clients_per_round=500 exceeds"],
    ),
    # impossible settings refused before round 0 (the FederatedLoop's setup)
    ("no rounds", ["--trainer.max_steps", "0"], "trainer.max_steps", ["number of federated rounds", "got 0"]),
    (
        "a fraction of the test batches that keeps none",
        ["--trainer.limit_test_batches", "0.5"],
        "trainer.limit_test_batches",
        ["limit_test_batches=0.5 of the 1 test batch(es) keeps none"],
    ),
    (
        "a fraction of an epoch without epochs",
        ["--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "0.5"],
        "trainer.val_check_interval",
        ["`val_check_interval` should be an integer", "check_val_every_n_epoch=None"],
    ),
    (
        "two server strategies",
        ["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks+=fedlightning.callbacks.FedAvg"],
        "trainer.callbacks",
        ["only one server strategy callback", "FedAdam, FedAvg"],
    ),
    (
        "a client optimizer Mime cannot use",
        [
            "--config",
            os.path.join(ROOT, "configs", "fedsps", "digits_mime_cpu.yaml"),
            "--model.client_optimizer",
            "torch.optim.Adam",
            "--trainer.max_steps",
            "1",
            "--trainer.limit_val_batches",
            "0",
        ],
        "model.client_optimizer",
        ["Mime needs model.client_optimizer to be plain torch.optim.SGD", "it is Adam"],
    ),
    (
        "a client optimizer FedSPS-Global cannot use",
        [
            "--config",
            os.path.join(ROOT, "configs", "fedsps_global.yaml"),
            "--model.client_optimizer",
            "torch.optim.SGD",
            "--trainer.max_steps",
            "1",
            "--trainer.limit_val_batches",
            "0",
        ],
        "model.client_optimizer",
        ["FedSPSGlobal needs client_optimizer fedlightning.optim.SPS", "got SGD"],
    ),
    (
        "a strategy that spawns its processes",
        ["--trainer.strategy", "ddp_spawn"],
        "trainer.strategy",
        ["ddp_spawn", "hands back only the weights"],
    ),
    (
        "validation every 2 epochs of a one-epoch run",
        ["--trainer.limit_val_batches", "1", "--trainer.check_val_every_n_epoch", "2"],
        "trainer.check_val_every_n_epoch",
        ["check_val_every_n_epoch=2 would never validate"],
    ),
    ("unbounded rounds", ["--trainer.max_steps", "-1"], "trainer.max_steps", ["got -1", "without max_epochs"]),
    (
        "validation every 0 rounds",
        ["--trainer.val_check_interval", "0", "--trainer.limit_val_batches", "1"],
        "trainer.val_check_interval",
        ["must be > 0", "got 0"],
    ),
    ("validation every 0.0 epochs", ["--trainer.val_check_interval", "0.0"], "trainer.val_check_interval", ["got 0.0"]),
    (
        "validation every 0 epochs",
        ["--trainer.check_val_every_n_epoch", "0"],
        "trainer.check_val_every_n_epoch",
        ["got 0"],
    ),
    ("negative seed", ["--model.seed", "-1"], "model.seed", ["got -1"]),
    # Lightning's own optimizer steps, which the loop does not take: the setting that does the job named
    (
        "gradient clipping of Lightning's steps",
        ["--trainer.gradient_clip_val", "0.5"],
        "trainer.gradient_clip_val",
        ["gradient_clip_val=0.5", "model.client_grad_clip", "client_grad_clip: 0.5"],
    ),
    (
        "gradient accumulation of Lightning's steps",
        ["--trainer.accumulate_grad_batches", "4"],
        "trainer.accumulate_grad_batches",
        ["accumulate_grad_batches=4", "one batch of its loader", "data.batch_size"],
    ),
    (
        "nan lr",
        ["--model.client_optimizer.lr=.nan"],
        "model.client_optimizer.init_args.lr",
        ["client_optimizer SGD lr must be a finite number, got nan"],
    ),
    ("inf lr", ["--model.client_optimizer.lr=.inf"], "model.client_optimizer.init_args.lr", ["got inf"]),
    ("negative data seed", ["--data.init_args.seed", "-1"], "data.init_args.seed", ["integer >= 0, got -1"]),
    (
        "data seed past 32 bits",
        ["--data.init_args.seed", "4294967296"],
        "data.init_args.seed",
        ["in [0, 2**32), got 4294967296"],
    ),
    (
        "Dirichlet max_retries negative",
        ["--data.init_args.partition.init_args.max_retries", "-3"],
        "data.init_args.partition.init_args.max_retries",
        ["integer >= 0, got -3"],
    ),
    (
        "negative lr (torch's words: learning rate)",
        ["--model.client_optimizer.lr=-0.1"],
        "model.client_optimizer.init_args.lr",
        ["Invalid learning rate: -0.1"],
    ),
    (
        "Adam's negative eps (torch's words: epsilon value)",
        ["--model.client_optimizer", "torch.optim.Adam", "--model.client_optimizer.eps=-1"],
        "model.client_optimizer.init_args.eps",
        ["Invalid epsilon value: -1"],
    ),
    (
        "inf Adam lr",
        ["--model.client_optimizer", "torch.optim.Adam", "--model.client_optimizer.lr=.inf"],
        "model.client_optimizer.init_args.lr",
        ["client_optimizer Adam lr", "got inf"],
    ),
    ("max_epochs 0", ["--trainer.max_epochs", "0"], "trainer.max_epochs", ["max_epochs=0 trains no round"]),
    (
        "grad clip with a line search",
        [
            "--model.client_optimizer",
            "fedlightning.optim.SgdArmijo",
            "--model.client_grad_clip",
            "1e-4",
        ],
        "model.client_grad_clip",
        ["client_grad_clip=0.0001 clips the gradient", "SgdArmijo computes its gradients"],
    ),
    (
        "backbone finetuning callback",
        ["--trainer.callbacks+=lightning.pytorch.callbacks.BackboneFinetuning"],
        "trainer.callbacks",
        ["BackboneFinetuning unfreezes layers at epochs", "remove the callback"],
    ),
    (
        "SWA callback",
        [
            "--trainer.callbacks+=lightning.pytorch.callbacks.StochasticWeightAveraging",
            "--trainer.callbacks.swa_lrs=0.5",
        ],
        "trainer.callbacks",
        ["StochasticWeightAveraging averages", "remove the callback"],
    ),
]

# (id, YAML given after the quickstart config, the key, texts the line must contain)
YAML_SNIPPETS = [
    ("yaml misspelled key", "model:\n  lcoal_steps: 5\n", "model.lcoal_steps", ["did you mean local_steps?"]),
    (
        "yaml misspelled section",
        "trainr:\n  max_steps: 3\n",
        "trainr.max_steps",
        ["unknown option 'trainr.max_steps' (did you mean trainer.max_steps?)"],
    ),
    ("yaml type", "model:\n  local_steps: five\n", "model.local_steps", ["expected an int or null, got 'five'"]),
    (
        "yaml renamed SPS c",
        "model:\n  client_optimizer:\n    class_path: fedlightning.optim.SPS\n    init_args:\n      c: 0.2\n",
        "model.client_optimizer.init_args.c",
        ["SPS's c is now polyak_c"],
    ),
    (
        "yaml renamed FedAMS eps",
        "trainer:\n  callbacks:\n    - class_path: fedlightning.callbacks.FedAMS\n      init_args:\n        eps: 0.1\n",
        "trainer.callbacks[0].init_args.eps",
        ["FedAMS's eps is now ams_eps"],
    ),
    (
        "yaml misspelled class argument",
        "data:\n  init_args:\n    partition:\n      class_path: fedlightning.datamodules.Dirichlet\n"
        "      init_args:\n        alpah: 0.5\n",
        "data.init_args.partition.init_args.alpah",
        ["Dirichlet has no argument 'alpah' (did you mean alpha?)"],
    ),
    ("yaml syntax", "model: [unclosed\n", "config", ["not valid YAML", "(line 2, column 1)"]),
]

# the brief's exact lines
EXACT = {
    "type float": "error: data.init_args.partition.init_args.alpha: expected a float, got 'high'",
    "renamed SPS c": "error: model.client_optimizer.init_args.c: SPS's c is now polyak_c",
    "misspelled key": "error: model.lcoal_steps: unknown option 'lcoal_steps' (did you mean local_steps?)",
}


@pytest.fixture
def fit_only(monkeypatch):
    """Build only the ``fit`` subcommand's parser (LightningCLI builds one per subcommand, most of a parsing
    error's cost); the ``fit`` path itself is unchanged."""
    fit = {"fit": FederatedCLI.subcommands()["fit"]}
    monkeypatch.setattr(FederatedCLI, "subcommands", staticmethod(lambda: fit))


def _run(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    return info.value.code, err, err.rstrip("\n").split("\n")[-1]


def _check(code, err, last, key, needles):
    assert code == 1, err[-3000:]
    assert last.startswith(f"error: {key}: "), err[-3000:]
    for needle in needles:
        assert needle in last, last
    for dump in ("usage:", "Does not validate against", "Subtypes:", "Traceback"):
        assert dump not in err, err[-3000:]


@pytest.mark.parametrize("case", COMMAND_LINES, ids=[c[0] for c in COMMAND_LINES])
def test_command_line_error_is_one_line(case, tmp_path, capsys, fit_only):
    name, extra, key, needles = case
    code, err, last = _run(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path), *extra], capsys)
    _check(code, err, last, key, needles)
    if name in EXACT:
        assert last == EXACT[name]
    # nothing but the run's config (written by LightningCLI's config callback at setup, before the loop's checks)
    assert set(os.listdir(tmp_path)) <= {"config.yaml"}, os.listdir(tmp_path)


@pytest.mark.parametrize("case", YAML_SNIPPETS, ids=[c[0] for c in YAML_SNIPPETS])
def test_yaml_error_is_one_line(case, tmp_path, capsys, fit_only):
    _, text, key, needles = case
    path = tmp_path / "override.yaml"
    path.write_text(text)
    code, err, last = _run(
        ["fit", *TINY, "--trainer.default_root_dir", str(tmp_path / "root"), "--config", str(path)], capsys
    )
    if key == "config":
        needles = [str(path)] + needles  # the file is named
    _check(code, err, last, key, needles)


@pytest.mark.parametrize(
    "args,line",
    [
        (["--config", QUICK], "error: subcommand: not given (one of fit, validate, test, predict)"),
        (
            ["fitt", *TINY],
            "error: subcommand: invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict')",
        ),
        (["fit", "--trainer.max_steps", "1"], "error: model.model: required, not given (nor data)"),
    ],
)
def test_subcommand_and_required_errors(args, line, capsys):
    code, err, last = _run(args, capsys)
    assert code == 1 and last == line, err[-2000:]


def test_traceback_variable_raises_jsonargparse_full_error(tmp_path, monkeypatch):
    """FEDLIGHTNING_TRACEBACK=1: the parsing error is raised as it is, with jsonargparse's full message."""
    monkeypatch.setenv("FEDLIGHTNING_TRACEBACK", "1")
    with pytest.raises(argparse.ArgumentError) as info:
        main(
            [
                "fit",
                *TINY,
                "--trainer.default_root_dir",
                str(tmp_path),
                "--data.init_args.partition.init_args.alpha",
                "high",
            ]
        )
    assert "Does not validate against any of the Union subtypes" in str(info.value)
    assert info.value.fedlightning_error_line == (
        "data.init_args.partition.init_args.alpha: expected a float, got 'high'"
    )


def test_full_option_names_still_parse(tmp_path):
    """allow_abbrev=False refuses abbreviations only: the full names of the same options parse and run."""
    cli = main(
        [
            "fit",
            *TINY,
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.local_steps",
            "2",
            "--trainer.max_steps",
            "1",
        ]
    )
    assert cli.model.local_steps == 2 and cli.trainer.global_step == 1


@pytest.mark.parametrize("form", [["--model.max_update_norm=None"], ["--model.max_update_norm", "None"]])
def test_none_on_the_command_line_is_null(tmp_path, form):
    """``None`` (what W&B's agent writes for a sweep's null value) is YAML's null for a nullable option: the config
    file's value is replaced by None, where jsonargparse alone refused the string 'None'."""
    base = main([*TINY, "--model.max_update_norm=10", "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert base.model.max_update_norm == 10.0
    cli = main([*TINY, "--model.max_update_norm=10", *form, "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert cli.model.max_update_norm is None


def test_renamed_table_matches_the_signatures():
    """Each renamed argument is no longer accepted by its class, and the name the message gives is."""
    for (class_path, old), message in _RENAMED.items():
        cls = _import(class_path)
        assert cls is not None, class_path
        params = inspect.signature(cls).parameters
        assert old not in params, (class_path, old)
        new = re.search(r"is now (\w+)|is (\w+)\)$", message)
        assert new is not None, message
        assert (new.group(1) or new.group(2)) in params, (class_path, message)


# ---------------------------------------------------------------------------------------------- Python users
def _tiny_fit(trainer_kwargs, **loop_kwargs):
    import lightning.pytorch as pl

    trained = []

    class Net(MLP):
        def training_step(self, batch, batch_idx):
            trained.append(batch_idx)
            return super().training_step(batch, batch_idx)

    loop = FederatedLoop(Net(input_dim=64, hidden=[8]), local_steps=1, clients_per_round=2, seed=0, **loop_kwargs)
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    options.update(trainer_kwargs)
    trainer = pl.Trainer(**options)
    with pytest.raises(SettingError) as info:
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    assert trained == [] and trainer.global_step == 0  # refused before any client trained
    return info.value


class _Thaw(BaseFinetuning):
    """Freezes nothing and thaws nothing: refused by kind (a thaw at epoch 0 would go to the server optimizer)."""

    def freeze_before_training(self, pl_module):
        pass

    def finetune_function(self, pl_module, current_epoch, optimizer):
        pass


@pytest.mark.parametrize(
    "trainer_kwargs,key,text",
    [
        (dict(max_steps=0), "trainer.max_steps", "got 0"),
        (dict(max_steps=-1), "trainer.max_steps", "got -1"),
        (dict(max_steps=2, val_check_interval=0, limit_val_batches=1), "trainer.val_check_interval", "got 0"),
        (dict(max_steps=2, check_val_every_n_epoch=0), "trainer.check_val_every_n_epoch", "got 0"),
        (dict(max_steps=2, overfit_batches=1), "trainer.overfit_batches", "overfit_batches=1"),
        (
            dict(max_steps=3, check_val_every_n_epoch=2, val_check_interval=1, limit_val_batches=1),
            "trainer.check_val_every_n_epoch",
            "check_val_every_n_epoch=2 would never validate",
        ),
        (
            dict(max_steps=3, check_val_every_n_epoch=1, val_check_interval=5, limit_val_batches=1),
            "trainer.val_check_interval",
            "val_check_interval=5 rounds is more than the run's max_steps=3",
        ),
        (dict(max_steps=3, max_epochs=0), "trainer.max_epochs", "max_epochs=0 trains no round"),
        (dict(max_steps=3, limit_train_batches=0), "trainer.limit_train_batches", "limit_train_batches=0"),
        (dict(max_steps=3, min_epochs=2), "trainer.min_epochs", "min_epochs=2 would hold any early stop"),
        (
            dict(max_steps=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.5, swa_epoch_start=1)]),
            "trainer.callbacks",
            "StochasticWeightAveraging averages",
        ),
        (dict(max_steps=3, callbacks=[BatchSizeFinder()]), "trainer.callbacks", "BatchSizeFinder grows"),
        (dict(max_steps=3, callbacks=[_Thaw()]), "trainer.callbacks", "_Thaw unfreezes layers at epochs"),
        (  # its own setup would fail first on the loop, which has no backbone attribute
            dict(max_steps=3, callbacks=[BackboneFinetuning()]),
            "trainer.callbacks",
            "BackboneFinetuning unfreezes layers at epochs",
        ),
        (dict(max_steps=3, callbacks=[SpikeDetection()]), "trainer.callbacks", "SpikeDetection reads the loss"),
        (dict(max_steps=3, callbacks=[LearningRateFinder()]), "trainer.callbacks", "LearningRateFinder tunes"),
        (
            dict(max_steps=3, callbacks=[GradientAccumulationScheduler({0: 4})]),
            "trainer.callbacks",
            "GradientAccumulationScheduler accumulates",
        ),
        (
            dict(max_steps=3, enable_checkpointing=True, callbacks=[ModelCheckpoint(every_n_epochs=2)]),
            "trainer.callbacks",
            "ModelCheckpoint(every_n_epochs=2) with max_steps=3: the run is one epoch, so it would never save",
        ),
        (
            dict(max_steps=3, callbacks=[Timer(duration="00:00:00:01", interval="epoch")]),
            "trainer.callbacks",
            "Timer(interval='epoch') with max_steps=3",
        ),
        (
            dict(max_steps=3, enable_checkpointing=True, callbacks=[ModelCheckpoint(monitor="val/acc", mode="max")]),
            "trainer.limit_val_batches",
            "limit_val_batches=0 runs no validation, but ModelCheckpoint(monitor='val/acc')",
        ),
        (
            dict(max_steps=3, val_check_interval=2, callbacks=[EarlyStopping(monitor="client/train_loss")]),
            "trainer.limit_val_batches",
            "EarlyStopping(monitor='client/train_loss') checks after each validation, and limit_val_batches=0",
        ),
        (
            dict(
                max_steps=3,
                limit_val_batches=1,
                val_check_interval=1,
                callbacks=[EarlyStopping(monitor="val/loss", check_on_train_epoch_end=True)],
            ),
            "trainer.callbacks",
            "checks at the end of a training epoch, and with max_steps=3 the run is one epoch",
        ),
        (  # Lightning's default when validation runs once per epoch, i.e. here after the last round
            dict(max_steps=3, limit_val_batches=1, callbacks=[EarlyStopping(monitor="val/loss")]),
            "trainer.callbacks",
            "it would check once, after the last round",
        ),
    ],
)
def test_python_trainer_settings_are_refused_before_round_0(trainer_kwargs, key, text):
    err = _tiny_fit(trainer_kwargs, client_optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert err.config_key == key and text in str(err)


def test_min_steps_counts_rounds_before_an_early_stop():
    """EarlyStopping(mode="max", patience=0) on the falling val/loss asks to stop at the check after round 2; with
    min_steps=3 the run stops at round 3 (Lightning's implied min_epochs=1 would hold it to max_steps=8)."""
    from lightning.pytorch import Trainer

    def rounds(**kw):
        es = EarlyStopping(monitor="val/loss", mode="max", patience=0, check_finite=False)
        loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=2, seed=0)
        trainer = Trainer(
            accelerator="cpu",
            max_steps=8,
            val_check_interval=1,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[es],
            **kw,
        )
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
        return trainer.global_step

    assert rounds() == 2
    assert rounds(min_steps=3) == 3


def test_python_strategy_that_spawns_its_processes_is_refused_in_them_before_round_0():
    """ddp_spawn runs setup in the process it starts: the refusal reaches the caller through Lightning's launcher
    (train.py refuses it before any process starts, tested with the command lines)."""
    from lightning.pytorch import Trainer

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=1, clients_per_round=2, seed=0)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="ddp_spawn", max_steps=2, logger=False)
    with pytest.raises(Exception, match=r"trainer\.strategy|hands back only the weights"):
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    assert trainer.global_step == 0


def test_a_validation_interval_beyond_a_shortened_run_counting_rounds_warns_and_trains():
    """check_val_every_n_epoch null: val_check_interval counts rounds over the run; a run shorter than it (a quick
    trial of a config) trains, with a warning naming the setting that no validation will run."""
    from lightning.pytorch import Trainer

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=1, clients_per_round=2, seed=0)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=5,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match=r"trainer.val_check_interval: val_check_interval=5 rounds .* no validation"):
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    assert trainer.global_step == 2 and not any(k.startswith("val/") for k in trainer.callback_metrics)


@pytest.mark.parametrize("lr", [math.nan, math.inf])  # SGD refuses -inf itself (a negative lr)
def test_python_non_finite_client_lr_is_refused(lr):
    err = _tiny_fit(dict(max_steps=2), client_optimizer=functools.partial(torch.optim.SGD, lr=lr))
    assert err.config_key == "model.client_optimizer.init_args.lr"
    assert str(err) == f"client_optimizer SGD lr must be a finite number, got {lr!r}"


def test_python_non_finite_lr_of_configure_optimizers_is_refused():
    import lightning.pytorch as pl

    class Net(MLP):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=float("inf"))

    loop = FederatedLoop(Net(input_dim=64, hidden=[8]), local_steps=1, clients_per_round=2)
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with pytest.raises(SettingError, match=r"Net.configure_optimizers\(\) lr must be a finite number, got inf") as e:
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    assert e.value.config_key == "model.model" and trainer.global_step == 0


def test_explicit_epochs_of_rounds_are_accepted(tmp_path, caplog):
    """max_steps=-1 with an explicit max_epochs is a bounded run (max_epochs × rounds_per_epoch rounds), and a log
    line says how many rounds that is (the user's module sees one round as one epoch)."""
    caplog.set_level("INFO")
    cli = main(
        [
            "fit",
            *TINY,
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.max_steps",
            "-1",
            "--trainer.max_epochs",
            "2",
            "--data.init_args.rounds_per_epoch",
            "1",
        ]
    )
    assert cli.trainer.global_step == 2
    assert "trainer.max_epochs=2: an epoch of the FederatedLoop is rounds_per_epoch rounds" in caplog.text
    assert "up to 2 x rounds_per_epoch=1 = 2 rounds" in caplog.text


@pytest.mark.parametrize(
    "config,needle",
    [
        ("configs/fedsps/mnist_fedavg.yaml", "MNIST"),
        ("configs/fedli/femnist_fedavg.yaml", "train"),
        ("configs/fedli/cifar10_fedavg.yaml", "CIFAR"),
    ],
)
def test_a_missing_data_folder_is_one_line_naming_data_dir(config, needle, tmp_path, capsys, fit_only):
    """A paper config whose data is not there (no download): one line naming data.init_args.data_dir and the
    folder, before any round, instead of the data module's FileNotFoundError traceback."""
    missing = str(tmp_path / "no_data_here")
    args = ["fit", "--config", os.path.join(ROOT, config), "--trainer.logger", "false"]
    args += ["--trainer.default_root_dir", str(tmp_path), "--data.init_args.data_dir", missing]
    code, err, last = _run(args, capsys)
    _check(code, err, last, "data.init_args.data_dir", [needle])
    assert "no_data_here" in last


def _without(args, option):
    """``args`` without ``option`` and its value."""
    i = args.index(option)
    return args[:i] + args[i + 2 :]


class _NoTestStep(MLP):
    """A user's module without test_step (MLP's own is taken away)."""

    test_step = pl.LightningModule.test_step


def test_a_module_without_test_step(tmp_path, capsys):
    """Trainer.test of a loop whose module has no test_step stops as plain Lightning stops (the loop defines every
    step hook, so Lightning's own check never saw the module); the CLI's test after fit is skipped with a warning
    instead of running a test that logs nothing."""
    loop = FederatedLoop(_NoTestStep(input_dim=64, num_classes=10), local_steps=1, clients_per_round=2, seed=0)
    loop.client_optimizer = lambda p: torch.optim.SGD(p, lr=0.1)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    dm = DigitsDataModule(num_clients=10, batch_size=16, seed=0)
    with pytest.raises(
        MisconfigurationException, match=r"No `test_step\(\)` method defined on _NoTestStep to run `Trainer\.test`\."
    ):
        trainer.test(loop, datamodule=dm)
    with pytest.warns(UserWarning, match="_NoTestStep defines no test_step: test_after_fit skipped"):
        cli = main(
            [
                "fit",
                *_without(TINY, "--test_after_fit"),
                "--trainer.default_root_dir",
                str(tmp_path),
                "--model.model",
                "test_config_errors._NoTestStep",
                "--model.model.init_args.input_dim",
                "64",
                "--model.model.init_args.num_classes",
                "10",
            ]
        )
    assert cli.trainer.global_step == 1 and not any(k.startswith("test/") for k in cli.trainer.callback_metrics)


@pytest.mark.parametrize("limit, rounds", [(1.0, 3 * 4), (2, 3 * 2), (0.5, 3 * 2)])
def test_the_rounds_a_max_epochs_run_trains_are_announced_with_limit_train_batches(caplog, limit, rounds):
    """max_epochs counts epochs of rounds_per_epoch rounds, each capped by limit_train_batches as Lightning caps an
    epoch's batches: the info line names the number of rounds the run trains."""
    import logging

    import lightning.pytorch as pl

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=1, clients_per_round=2, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        limit_train_batches=limit,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0, rounds_per_epoch=4))
    (line,) = [r.getMessage() for r in caplog.records if "so the run trains up to" in r.getMessage()]
    assert line.split("= ")[-1].startswith(f"{rounds} rounds") and trainer.global_step == rounds
