"""No silent surprises in the CLI and its checkpoints.

* LightningCLI's ``--optimizer`` / ``--lr_scheduler`` (they would replace the strategy's server step) are refused;
* every bad ``--ckpt_path`` (missing, empty, truncated, random bytes, a foreign Lightning checkpoint, an unknown
  format, another architecture; a file, ``last`` or ``best``) ends in one last line naming the file and the problem;
* each run checkpoints into its own version directory, ``--ckpt_path last`` is the newest complete checkpoint (by
  round, then time) of the config's runs, and resuming with other settings is refused unless
  ``--resume_mismatch=allow``;
* ``WandbLogger`` from Python runs offline when nothing is configured;
* configuration errors end in one line ``error: <key>: <message>`` (exit code 1), full traceback on request.
"""

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fedlightning.cli as cli_module
from fedlightning import FederatedLoop
from fedlightning.checkpoint import CONFIG_KEY, CheckpointError, check_checkpoint, config_differences
from fedlightning.cli import main
from fedlightning.models import MLP

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
]


def _tiny(save_dir, *extra):
    return [
        *TINY,
        "--trainer.logger.init_args.save_dir",
        str(save_dir),
        "--trainer.default_root_dir",
        str(save_dir),
        *extra,
    ]


def _last_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1], err


def _exit_with_error(capsys, args):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 1
    return _last_error_line(capsys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One fedlightning checkpoint of the tiny quickstart run (1 round)."""
    d = tmp_path_factory.mktemp("trained")
    cli = main(["fit", *_tiny(d, "--trainer.max_steps", "1")])
    path = os.path.join(cli.trainer.log_dir, "checkpoints", "last.ckpt")
    assert os.path.isfile(path)
    return path


# ====================================================================== 1. no LightningCLI server optimizer
REFUSED = [
    (["--optimizer=torch.optim.Adam", "--optimizer.lr=0.01"], "optimizer", "torch.optim.Adam"),
    (
        ["--lr_scheduler=torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size=1"],
        "lr_scheduler",
        "torch.optim.lr_scheduler.StepLR",
    ),
]


@pytest.mark.parametrize("override,key,cls", REFUSED, ids=["optimizer", "lr_scheduler"])
def test_lightning_optimizer_options_are_refused(tmp_path, capsys, override, key, cls):
    line, _ = _exit_with_error(capsys, ["fit", *_tiny(tmp_path, "--trainer.max_steps", "1"), *override])
    assert line.startswith(f"error: {key}: LightningCLI's --{key} is refused by fedlightning (got {cls})")
    assert "model.client_optimizer" in line and "trainer.callbacks" in line and "FedAdam" in line
    assert not os.path.exists(os.path.join(tmp_path, "quickstart"))  # refused before anything ran


def test_optimizer_in_a_config_file_is_refused_too(tmp_path, capsys):
    extra = tmp_path / "server_adam.yaml"
    extra.write_text("optimizer:\n  class_path: torch.optim.Adam\n  init_args:\n    lr: 0.01\n")
    line, _ = _exit_with_error(capsys, ["fit", *_tiny(tmp_path, "--trainer.max_steps", "1"), "--config", str(extra)])
    assert line.startswith("error: optimizer: LightningCLI's --optimizer is refused")


def test_without_those_options_the_server_step_is_the_strategy(tmp_path):
    """The loop keeps its own configure_optimizers (the strategy's server optimizer): plain FedAvg is SGD(lr=1)."""
    cli = main(_tiny(tmp_path, "--trainer.logger", "false", "--trainer.max_steps", "1"), run=False)
    assert cli.model.configure_optimizers.__func__ is FederatedLoop.configure_optimizers
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    opt = cli.trainer.optimizers[0]
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 1.0


# ====================================================================== 2. every bad checkpoint: one clear line
def _truncated(trained, tmp_path):
    data = open(trained, "rb").read()
    p = tmp_path / "truncated.ckpt"
    p.write_bytes(data[: len(data) // 2])
    return p


def _random(trained, tmp_path):
    p = tmp_path / "random.ckpt"
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    p.write_bytes(bytes(noise.tolist()))
    return p


def _empty(trained, tmp_path):
    p = tmp_path / "empty.ckpt"
    p.write_bytes(b"")
    return p


def _foreign(trained, tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    t = pl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    t.fit(BoringModel())
    p = tmp_path / "boring.ckpt"
    t.save_checkpoint(str(p))
    return p


def _future_format(trained, tmp_path):
    ck = torch.load(trained, weights_only=False)
    ck["fedlightning"]["format"] = 99
    p = tmp_path / "future.ckpt"
    torch.save(ck, p)
    return p


def _not_lightning(trained, tmp_path):
    p = tmp_path / "weights.ckpt"
    torch.save({"weight": torch.zeros(3)}, p)
    return p


def damage_entry(path, out):
    """Copy ``path`` (a zip checkpoint) to ``out`` with 64 bytes in the middle of its largest entry flipped: a copy
    damaged on disk; ``torch.load`` reads it without complaint."""
    import struct
    import zipfile

    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    for i in range(start, start + 64):
        data[i] ^= 0xFF
    out.write_bytes(bytes(data))
    torch.load(out, weights_only=False)  # torch itself does not notice
    return out


def _damaged(trained, tmp_path):
    return damage_entry(trained, tmp_path / "damaged.ckpt")


BAD_FILES = [
    ("missing", lambda trained, tmp_path: tmp_path / "nope.ckpt", "file not found"),
    ("directory", lambda trained, tmp_path: tmp_path, "is a directory, not a checkpoint file"),
    ("empty", _empty, "the file is empty (0 bytes): corrupt, truncated or not a checkpoint"),
    ("truncated", _truncated, "corrupt, truncated or not a checkpoint ("),  # the reader's error depends on the cut
    ("random", _random, "corrupt, truncated or not a checkpoint (UnpicklingError: "),
    ("damaged", _damaged, "corrupt: the bytes of its entry 'archive/data/"),
    (
        "not_lightning",
        _not_lightning,
        "not a Lightning checkpoint (no 'state_dict'); pass a .ckpt file a fedlightning run wrote",
    ),
    (
        "foreign",
        _foreign,
        "a Lightning checkpoint of another LightningModule, not of a FederatedLoop (no "
        "'fedlightning' section): it cannot resume a federated run",
    ),
    ("future_format", _future_format, "unsupported fedlightning checkpoint format 99 (this version reads format 1)"),
]


@pytest.mark.parametrize("name,make,problem", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_checkpoint_file_is_one_clear_line(trained, tmp_path, capsys, name, make, problem):
    path = make(trained, tmp_path)
    run_dir = tmp_path / "run"
    line, lines = _exit_with_error(
        capsys, ["fit", *_tiny(run_dir, "--trainer.max_steps", "2"), "--ckpt_path", str(path)]
    )
    assert line.startswith(f"error: checkpoint {path}: {problem}"), line
    assert "Traceback" not in "\n".join(lines)
    assert not run_dir.exists()  # checked right after parsing: nothing was built or written


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_bad_checkpoint_in_every_subcommand(trained, tmp_path, capsys, subcommand):
    path = _random(trained, tmp_path)
    line, _ = _exit_with_error(capsys, [subcommand, *_tiny(tmp_path / "run"), "--ckpt_path", str(path)])
    assert line.startswith(f"error: checkpoint {path}: corrupt, truncated or not a checkpoint (UnpicklingError")


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_checkpoint_of_another_architecture(trained, tmp_path, capsys, subcommand):
    """The trained MLP has hidden [128]; the new config asks for [32]: the shapes are listed."""
    args = [subcommand, *_tiny(tmp_path, "--model.model.init_args.hidden", "[32]"), "--ckpt_path", trained]
    if subcommand == "fit":
        args += ["--trainer.max_steps", "2"]
    line, _ = _exit_with_error(capsys, args)
    assert line == (
        f"error: checkpoint {trained}: its weights do not fit the configured model (another "
        "architecture?): different shapes (checkpoint vs model): model.net.1.weight (128, 64) vs "
        "(32, 64), model.net.1.bias (128,) vs (32,), model.net.3.weight (10, 128) vs (10, 32)"
    )


def test_checkpoint_with_other_layers_lists_missing_and_unexpected_keys(trained, tmp_path, capsys):
    line, _ = _exit_with_error(
        capsys, ["validate", *_tiny(tmp_path, "--model.model.init_args.hidden", "[128, 16]"), "--ckpt_path", trained]
    )
    assert line == (
        f"error: checkpoint {trained}: its weights do not fit the configured model (another "
        "architecture?): different shapes (checkpoint vs model): model.net.3.weight (10, 128) vs "
        "(16, 128), model.net.3.bias (10,) vs (16,); missing in the checkpoint: model.net.5.weight, "
        "model.net.5.bias"
    )


def test_check_checkpoint_accepts_a_good_file_and_its_model(trained):
    from fedlightning.models import MLP

    ck = check_checkpoint(trained, model=FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[128])))
    assert ck["global_step"] == 1 and ck["fedlightning"]["format"] == 1
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(trained, model=FederatedLoop(MLP(input_dim=64, num_classes=10, hidden=[128, 4])))
    assert info.value.path == os.fspath(trained) and "missing in the checkpoint: model.net.5.weight" in str(info.value)


def test_last_skips_a_corrupt_newer_file_naming_it(trained, tmp_path, monkeypatch):
    """A truncated checkpoint (newer by time and by version) is passed over with a warning naming it; the complete
    one of the other run is resumed."""
    good = tmp_path / "quickstart" / "version_0" / "checkpoints"
    bad = tmp_path / "quickstart" / "version_1" / "checkpoints"
    good.mkdir(parents=True)
    bad.mkdir(parents=True)
    (good / "last.ckpt").write_bytes(open(trained, "rb").read())
    (bad / "last.ckpt").write_bytes(open(trained, "rb").read()[:100])
    os.utime(bad / "last.ckpt", (os.path.getmtime(good / "last.ckpt") + 10,) * 2)
    infos = []
    monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
    with pytest.warns(UserWarning) as caught:
        cli = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "2"), "--ckpt_path", "last"])
    skipped = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert skipped == [
        f"--ckpt_path last: skipped checkpoint {bad / 'last.ckpt'}: corrupt, truncated or not a "
        "checkpoint (RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
        "central directory)"
    ]
    assert infos[-1].startswith(f"--ckpt_path last: resuming from {good / 'last.ckpt'} (round 1, ")
    assert cli.trainer.global_step == 2


def test_best_without_a_monitored_checkpoint_is_an_error(trained, tmp_path, capsys):
    run = tmp_path / "quickstart" / "version_0" / "checkpoints"
    run.mkdir(parents=True)
    (run / "last.ckpt").write_bytes(open(trained, "rb").read())
    line, _ = _exit_with_error(capsys, ["validate", *_tiny(tmp_path), "--ckpt_path", "best"])
    assert line == (
        f"error: checkpoint {run / 'last.ckpt'}: --ckpt_path best: this newest checkpoint of the "
        "config's runs records no best model (the CLI's default checkpoint monitors no metric; add a "
        "ModelCheckpoint with a monitor to trainer.callbacks, or pass a file)"
    )


@pytest.mark.parametrize(
    "callback", ["lightning.pytorch.callbacks.ModelCheckpoint", "fedlightning.checkpoint.RoundCheckpoint"]
)
def test_best_with_a_monitored_checkpoint_evaluates_that_file(tmp_path, monkeypatch, callback):
    """A ModelCheckpoint(monitor='val/acc') records its best file in last.ckpt; validate --ckpt_path best uses it.
    So does a RoundCheckpoint (whose state key --ckpt_path best did not recognise)."""
    args = _tiny(
        tmp_path,
        "--trainer.limit_val_batches",
        "1.0",
        "--trainer.val_check_interval",
        "1",
        f"--trainer.callbacks+={callback}",
        "--trainer.callbacks.monitor=val/acc",
        "--trainer.callbacks.mode=max",
        "--trainer.callbacks.save_last=true",
    )
    fit = main(["fit", *args, "--trainer.max_steps", "2"])
    best = fit.trainer.checkpoint_callback.best_model_path
    assert best and os.path.isfile(best)
    infos = []
    monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
    val = main(["validate", *args, "--ckpt_path", "best"])
    assert val.config_init["validate"]["ckpt_path"] == best
    assert infos == [
        f"--ckpt_path best: using {best} (best val/acc, recorded in {os.path.join(os.path.dirname(best), 'last.ckpt')})"
    ]


# ====================================================================== 3. version directories, last, mismatches
def test_runs_get_own_version_dirs_last_is_the_newest_and_a_mismatch_is_refused(tmp_path, monkeypatch, capsys):
    first = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "1", "--model.client_optimizer.init_args.lr", "0.05")])
    second = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "1")])
    paths = [os.path.join(tmp_path, "quickstart", f"version_{v}", "checkpoints", "last.ckpt") for v in (0, 1)]
    assert [os.path.join(c.trainer.log_dir, "checkpoints", "last.ckpt") for c in (first, second)] == paths
    assert all(os.path.isfile(p) for p in paths)
    assert not os.path.exists(os.path.join(tmp_path, "quickstart", "checkpoints"))
    saved = [torch.load(p, weights_only=False)[CONFIG_KEY] for p in paths]
    assert [s["model"]["client_optimizer"]["init_args"]["lr"] for s in saved] == [0.05, 0.1]
    # the newest checkpoint is version_0's (touched last): 'last' picks it, and the lr differs from this run's
    os.utime(paths[0], (os.path.getmtime(paths[1]) + 10,) * 2)
    infos = []
    monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
    capsys.readouterr()
    line, lines = _exit_with_error(capsys, ["fit", *_tiny(tmp_path, "--trainer.max_steps", "2"), "--ckpt_path", "last"])
    assert infos == [
        f"--ckpt_path last: resuming from {paths[0]} (round 1, the newest complete of 2 checkpoint "
        f"file(s) in {os.path.join(tmp_path, 'quickstart', '*', 'checkpoints')})"
    ]
    assert line == (
        f"error: checkpoint {paths[0]}: written by a run with other settings (1 listed above); pass "
        "--resume_mismatch=allow to resume with this run's settings, or drop --ckpt_path to start a "
        "new run"
    )
    assert lines[-3].strip() == "model.client_optimizer.init_args.lr: checkpoint 0.05 -> now 0.1"
    # with the override it resumes from that checkpoint (round 1 -> 2) into a new version directory
    with pytest.warns(UserWarning, match=r"model.client_optimizer.init_args.lr: checkpoint 0.05 -> now 0.1"):
        resumed = main(
            ["fit", *_tiny(tmp_path, "--trainer.max_steps", "2"), "--ckpt_path", "last", "--resume_mismatch", "allow"]
        )
    assert resumed.trainer.global_step == 2
    assert resumed.trainer.log_dir == os.path.join(tmp_path, "quickstart", "version_2")


def test_resume_with_the_same_settings_and_more_rounds_needs_no_flag(tmp_path):
    main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "1")])
    resumed = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "3"), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 3


def test_last_with_no_checkpoint_starts_from_round_0_with_a_warning(tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"--ckpt_path last: no complete checkpoint found in .*; starting from "
        r"round 0",
    ):
        cli = main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "1"), "--ckpt_path", "last"])
    assert cli.trainer.global_step == 1


@pytest.mark.parametrize("sub", ["validate", "test", "predict"])
def test_last_with_no_checkpoint_stops_an_evaluation(tmp_path, capsys, sub):
    """Evaluating ``last`` of a config that has no run yet (a typo in the run's name, another working directory)
    would evaluate the untrained model and exit 0: one line instead, as for ``best``."""
    line, _ = _exit_with_error(capsys, [sub, *_tiny(tmp_path), "--ckpt_path", "last"])
    assert line.startswith("error: checkpoint last (") and line.endswith(
        "no complete checkpoint of this config's runs found, nothing to evaluate; pass a file"
    )


def test_without_a_logger_each_run_gets_a_version_directory(tmp_path):
    args = [
        "fit",
        *TINY,
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "1",
    ]
    main(args)
    main(args)
    found = sorted(
        os.path.relpath(os.path.join(d, f), tmp_path)
        for d, _, files in os.walk(tmp_path)
        for f in files
        if f.endswith(".ckpt")
    )
    assert found == [os.path.join("checkpoints", f"version_{v}", "last.ckpt") for v in (0, 1)]
    resumed = main(args[:-1] + ["2", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 2


def test_without_a_logger_runs_that_overlap_get_their_own_version_directory_and_config(tmp_path):
    """The second run is built while the first has saved nothing yet (the folder used to be made at the first save,
    so both took version_0 and wrote their checkpoints and config.yaml into one folder): each has its own folder,
    with its own checkpoint and config.yaml, and none is left in default_root_dir."""
    import yaml

    args = [*TINY, "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)]
    first = main([*args, "--trainer.max_steps", "1"], run=False)
    second = main([*args, "--trainer.max_steps", "1", "--model.client_optimizer.init_args.lr", "0.05"], run=False)
    for cli in (second, first):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    folders = {cli: tmp_path / "checkpoints" / f"version_{v}" for v, cli in enumerate((first, second))}
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["version_0", "version_1"]
    for cli, folder in folders.items():
        assert sorted(os.listdir(folder)) == ["config.yaml", "last.ckpt"]
        saved = yaml.safe_load((folder / "config.yaml").read_text())
        assert saved["model"]["client_optimizer"]["init_args"]["lr"] == (0.05 if cli is second else 0.1)
    assert not (tmp_path / "config.yaml").exists()


def test_config_differences_compares_what_decides_the_trajectory():
    base = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 10,
            "devices": 1,
            "callbacks": [
                {"class_path": "fedlightning.callbacks.FedAvg", "init_args": {"server_lr": 1.0}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"monitor": None}},
            ],
        },
        "model": {"local_steps": 5, "client_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}},
        "data": {"class_path": "D", "init_args": {"seed": 0}},
    }
    import copy

    other = copy.deepcopy(base)
    other["trainer"]["max_steps"] = 99  # extending a run
    other["trainer"]["devices"] = 2
    other["trainer"]["callbacks"][1]["init_args"]["monitor"] = "val/acc"  # Lightning's own callbacks
    assert config_differences(base, other) == []
    other["seed_everything"] = 1
    other["model"]["client_optimizer"]["init_args"]["lr"] = 0.2
    other["data"]["init_args"]["seed"] = 3
    other["trainer"]["callbacks"][0] = {"class_path": "fedlightning.callbacks.FedAdam", "init_args": {}}
    assert config_differences(base, other) == [
        "data.init_args.seed: checkpoint 0 -> now 3",
        "model.client_optimizer.init_args.lr: checkpoint 0.1 -> now 0.2",
        "seed_everything: checkpoint 0 -> now 1",
        "trainer.callbacks[0].class_path: checkpoint 'fedlightning.callbacks.FedAvg' -> now "
        "'fedlightning.callbacks.FedAdam'",
        "trainer.callbacks[0].init_args.server_lr: checkpoint 1.0 -> now (not set)",
    ]


# ====================================================================== 4. W&B offline from Python
def test_import_sets_offline_only_when_nothing_is_configured(tmp_path):
    from fedlightning.logging import default_wandb_offline

    no_netrc = str(tmp_path / "netrc")
    env = {}
    assert default_wandb_offline(env, netrc_path=no_netrc) is True and env == {"WANDB_MODE": "offline"}
    for configured in ({"WANDB_MODE": "online"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": "k"}):
        env = dict(configured)
        assert default_wandb_offline(env, netrc_path=no_netrc) is False and env == configured
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    env = {}
    assert default_wandb_offline(env, netrc_path=no_netrc) is False and env == {}


def test_wandb_logger_from_python_runs_offline_without_configuration(tmp_path):
    """A fresh Python process with no W&B configuration (no WANDB_* variables, a HOME without .netrc) trains with a
    WandbLogger: the run is written offline (no API key prompt, no network)."""
    script = textwrap.dedent(f"""
        import os
        import fedlightning
        assert os.environ["WANDB_MODE"] == "offline", os.environ.get("WANDB_MODE")
        import lightning.pytorch as pl
        import wandb
        from lightning.pytorch.loggers import WandbLogger
        from fedlightning import FederatedLoop
        from fedlightning.datamodules import DigitsDataModule
        from fedlightning.models import MLP
        loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=2, seed=0)
        logger = WandbLogger(project="p", save_dir={str(tmp_path)!r})
        trainer = pl.Trainer(max_steps=2, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             accelerator="cpu")
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
        wandb.finish()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_SILENT="true", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from fedlightning.logging import find_offline_runs, read_offline_run

    runs = find_offline_runs(str(tmp_path))
    assert len(runs) == 1
    losses = read_offline_run(runs[0], wait_seconds=60).series("train/loss")
    assert len(losses) == 2


# ====================================================================== 5. one clear last line for config errors
def _run_train_py(*args, env=None):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_negative_alpha_is_one_last_line_from_train_py():
    from fedlightning.datamodules import Dirichlet

    with pytest.raises(ValueError) as original:
        Dirichlet(alpha=-1.0)  # the CLI parses the value as a float
    proc = _run_train_py("fit", "--config", "configs/quickstart.yaml", "--data.init_args.partition.init_args.alpha=-1")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: data.init_args.partition.init_args.alpha: {original.value}"
    assert lines[-2] == "(set FEDLIGHTNING_TRACEBACK=1 for the full traceback)"
    assert "Traceback" not in proc.stderr and len(lines) <= 5, proc.stderr
    # train.py hands its own command line to LightningCLI: not the mix of both that Lightning warns about
    assert "args parameter is intended" not in proc.stderr, proc.stderr


def test_negative_server_lr_is_one_last_line_and_the_traceback_is_on_request(tmp_path, capsys, monkeypatch):
    """The FedAvg error is wrapped in jsonargparse's union error; the last line is the original (in-process: the
    same main() as train.py's)."""
    from fedlightning.callbacks import FedAvg

    with pytest.raises(ValueError) as original:
        FedAvg(server_lr=-1.0)
    args = [
        "fit",
        *_tiny(tmp_path, "--trainer.max_steps", "1"),
        "--trainer.callbacks+=fedlightning.callbacks.FedAvg",
        "--trainer.callbacks.server_lr=-1",
    ]
    line, lines = _exit_with_error(capsys, args)
    assert line == f"error: trainer.callbacks[0].init_args.server_lr: {original.value}"
    assert "Does not validate against any of the Union subtypes" not in "\n".join(lines)
    monkeypatch.setenv("FEDLIGHTNING_TRACEBACK", "1")
    with pytest.raises(ValueError) as full:
        main(args)
    assert "Does not validate against any of the Union subtypes" in str(full.value)  # jsonargparse's wrapper ...
    assert str(original.value) in [str(e) for e in cli_module._chain(full.value)]  # ... around the original


def test_loop_argument_error_names_the_model_key(tmp_path, capsys):
    with pytest.raises(ValueError) as original:
        FederatedLoop(MLP(input_dim=64, hidden=[4]), local_steps=0)
    line, _ = _exit_with_error(
        capsys, ["fit", *_tiny(tmp_path, "--trainer.max_steps", "1", "--model.local_steps", "0")]
    )
    assert line == f"error: model.local_steps: {original.value}"


def test_traceback_env_reraises_the_original_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLIGHTNING_TRACEBACK", "1")
    with pytest.raises(ValueError) as info:
        main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "1", "--model.local_steps", "0")])
    assert "local_steps must be an integer >= 1 or None, got 0" in str(info.value)


def test_errors_not_from_fedlightning_or_the_config_keep_their_traceback():
    try:
        raise ValueError("a bug elsewhere")
    except ValueError as err:
        assert cli_module._config_error_line(err, {"model": {"local_steps": 1}}) is None


def test_an_error_after_a_round_trained_keeps_its_traceback(tmp_path, monkeypatch):
    """A ValueError from fedlightning's code in round 2 is not reported as a configuration error."""
    original = FederatedLoop.training_step

    def failing(self, *args, **kwargs):
        if self.trainer.global_step >= 1:
            check_checkpoint(tmp_path / "does-not-exist.ckpt")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FederatedLoop, "training_step", failing)
    with pytest.raises(CheckpointError, match="file not found"):
        main(
            [
                "fit",
                *_tiny(
                    tmp_path,
                    "--trainer.max_steps",
                    "3",
                    "--trainer.logger",
                    "false",
                    "--trainer.enable_checkpointing",
                    "false",
                ),
            ]
        )


# ====================================================================== 5. a preempted run does not exit 0
def test_sigterm_stops_at_a_round_boundary_with_a_nonzero_status_and_keeps_the_round(tmp_path, capsys, monkeypatch):
    """SIGTERM (a real signal to this process) during round 2: Lightning finishes the round and stops at the
    boundary; the CLI exits with status 143 (not Lightning's 0) and a last line saying how to resume, and last.ckpt
    holds the three completed rounds."""
    import glob
    import signal

    from fedlightning.checkpoint import read_checkpoint
    from fedlightning.cli import SIGTERM_EXIT_STATUS

    end_round = FederatedLoop._end_round

    def preempted(self, result):
        if result.plan.round == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return end_round(self, result)

    monkeypatch.setattr(FederatedLoop, "_end_round", preempted)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as info:
            main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "6")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == SIGTERM_EXIT_STATUS
    line, _ = _last_error_line(capsys)
    assert line.startswith("stopped: the run received SIGTERM") and "--ckpt_path last" in line
    (last,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    assert read_checkpoint(last)["global_step"] == 3


def test_resume_mismatch_allow_trains_on_with_this_runs_server_settings(tmp_path):
    """--resume_mismatch=allow promises this run's settings: a changed server_lr is the server optimizer's lr after
    the restore (Lightning's restore alone would bring back the checkpoint's), and the rounds use it."""
    fedavg = ["--trainer.callbacks+=fedlightning.callbacks.FedAvg"]
    main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "2", *fedavg)])
    with pytest.warns(UserWarning, match=r"server_lr: checkpoint 1.0 -> now 0.5"):
        resumed = main(
            [
                "fit",
                *_tiny(tmp_path, "--trainer.max_steps", "3", *fedavg, "--trainer.callbacks.server_lr=0.5"),
                "--ckpt_path",
                "last",
                "--resume_mismatch",
                "allow",
            ]
        )
    assert resumed.trainer.global_step == 3
    assert resumed.trainer.optimizers[0].param_groups[0]["lr"] == 0.5
    assert float(resumed.trainer.callback_metrics["server/lr"]) == 0.5


def test_last_passes_over_weights_only_checkpoints_and_an_explicit_one_is_one_line(tmp_path, monkeypatch, capsys):
    """A ModelCheckpoint(save_weights_only=True) beside the full checkpoints writes newer files without optimizer
    state or loop progress: --ckpt_path last picked the newest of them and Lightning failed with a KeyError at every
    restart. It now passes over them (one line) and resumes the newest full checkpoint; an explicit weights-only file
    is one error line for fit, and validate reads it."""
    weights = tmp_path / "weights"
    args = _tiny(
        tmp_path,
        "--trainer.callbacks+=fedlightning.checkpoint.RoundCheckpoint",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={weights}",
        "--trainer.callbacks.save_weights_only=true",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.filename=w-{step}",
    )
    main(["fit", *args, "--trainer.max_steps", "3"])
    assert sorted(os.listdir(weights)) == ["w-step=1.ckpt", "w-step=2.ckpt", "w-step=3.ckpt"]
    infos = []
    monkeypatch.setattr(cli_module, "rank_zero_info", infos.append)
    resumed = main(["fit", *args, "--trainer.max_steps", "4", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 4
    assert infos[0] == (
        f"--ckpt_path last: passed over 3 weights-only checkpoint(s), which cannot resume training (e.g. "
        f"{weights / 'w-step=3.ckpt'})"
    )
    assert infos[1].startswith("--ckpt_path last: resuming from ") and "last.ckpt (round 3, " in infos[1]
    assert infos[1].endswith(f" and {weights})")  # where it looked: the logger's runs and the callback's folder
    line, _ = _exit_with_error(
        capsys, ["fit", *args, "--trainer.max_steps", "5", "--ckpt_path", str(weights / "w-step=1.ckpt")]
    )
    assert line == (
        f"error: checkpoint {weights / 'w-step=1.ckpt'}: a weights-only checkpoint (save_weights_only: no optimizer "
        "state nor loop progress): it cannot resume training; resume a full checkpoint, or evaluate this one with "
        "validate / test"
    )
    val = main(["validate", *args, "--trainer.limit_val_batches", "1.0", "--ckpt_path", str(weights / "w-step=1.ckpt")])
    assert "val/acc" in val.trainer.callback_metrics
    from conftest import make_trainer
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import DigitsDataModule

    loop = FederatedLoop(MLP(input_dim=64, hidden=[128], num_classes=10), local_steps=2, clients_per_round=2, seed=0)
    with pytest.raises(CheckpointError, match="a weights-only checkpoint .* it cannot resume training"):
        make_trainer(3, callbacks=[FedAvg()]).fit(
            loop, datamodule=DigitsDataModule(num_clients=10, seed=0), ckpt_path=str(weights / "w-step=1.ckpt")
        )


def test_changing_only_where_and_how_often_round_checkpoints_are_written_resumes(tmp_path):
    """RoundCheckpoint's settings do not change the training, so they are not compared (it was refused as a
    settings mismatch, as Lightning's own ModelCheckpoint is not)."""
    every = ["--trainer.callbacks+=fedlightning.checkpoint.RoundCheckpoint", "--trainer.callbacks.save_last=true"]
    main(["fit", *_tiny(tmp_path, "--trainer.max_steps", "2", *every, "--trainer.callbacks.every_n_train_steps=2")])
    resumed = main(
        [
            "fit",
            *_tiny(tmp_path, "--trainer.max_steps", "3", *every, "--trainer.callbacks.every_n_train_steps=3"),
            "--ckpt_path",
            "last",
        ]
    )
    assert resumed.trainer.global_step == 3


def test_another_kind_of_server_optimizer_is_refused_even_when_settings_may_differ(tmp_path, capsys):
    """A FedAdam checkpoint resumed into a FedAvg run with --resume_mismatch=allow trained on with one optimizer
    holding SGD's and Adam's settings (torch's load_state_dict takes any groups of the same sizes); it is refused
    naming both kinds, also from Python."""
    adam = ["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks.server_lr=0.01"]
    main(["fit", *_tiny(tmp_path / "adam", "--trainer.max_steps", "2", *adam)])
    (ckpt,) = glob.glob(str(tmp_path / "adam" / "**" / "last.ckpt"), recursive=True)
    fedavg = ["--trainer.callbacks+=fedlightning.callbacks.FedAvg"]
    line, _ = _exit_with_error(
        capsys,
        [
            "fit",
            *_tiny(tmp_path / "avg", "--trainer.max_steps", "3", *fedavg),
            "--ckpt_path",
            ckpt,
            "--resume_mismatch",
            "allow",
        ],
    )
    assert line.startswith(
        f"error: checkpoint {ckpt}: its server optimizer (settings ['betas', 'eps', 'lr', 'rule'], rule='adam', 1"
    )
    assert line.endswith(
        "is not the kind FedAvg builds (SGD: settings ['dampening', 'lr', 'momentum', 'nesterov', 'weight_decay'], 1 "
        "group(s)): a run cannot resume with another server optimizer"
    )
    from conftest import make_trainer
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import DigitsDataModule

    loop = FederatedLoop(MLP(input_dim=64, hidden=[128], num_classes=10), local_steps=2, clients_per_round=2, seed=0)
    trainer = make_trainer(3, callbacks=[FedAvg()])
    with pytest.raises(CheckpointError, match="is not the kind FedAvg builds"):
        trainer.fit(loop, datamodule=DigitsDataModule(num_clients=100, seed=0), ckpt_path=ckpt)


@pytest.mark.parametrize("other", ["FedAMS", "FedYogi", "FedAdagrad"])
def test_another_adaptive_server_rule_is_refused_even_when_settings_may_differ(tmp_path, capsys, other):
    """FedAdam, FedAMS, FedYogi and FedAdagrad build one optimizer class with the same settings but another rule: a
    FedAdam checkpoint resumed as FedAMS with --resume_mismatch=allow died in its first round with a KeyError (no
    max_exp_avg_sq in Adam's state), and as FedYogi trained on with Adam's moments under Yogi's rule."""
    adam = ["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks.server_lr=0.01"]
    main(["fit", *_tiny(tmp_path / "adam", "--trainer.max_steps", "2", *adam)])
    (ckpt,) = glob.glob(str(tmp_path / "adam" / "**" / "last.ckpt"), recursive=True)
    resumed = [f"--trainer.callbacks+=fedlightning.callbacks.{other}", "--trainer.callbacks.server_lr=0.01"]
    args = [*_tiny(tmp_path / "other", "--trainer.max_steps", "3", *resumed), "--ckpt_path", ckpt]
    line, _ = _exit_with_error(capsys, ["fit", *args, "--resume_mismatch", "allow"])
    rule = {"FedAMS": "ams", "FedYogi": "yogi", "FedAdagrad": "adagrad"}[other]
    assert f"rule='adam', 1 group(s)) is not the kind {other} builds" in line
    assert f"rule='{rule}', 1 group(s)): a run cannot resume with another server optimizer" in line
