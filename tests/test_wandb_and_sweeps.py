"""W&B logging through the CLI (offline, read back from the run file) and the W&B sweep files (schema, the exact
command line the agent builds, a short run of it, clear errors for unknown keys). No network: WANDB_MODE=offline."""

import copy
import functools
import glob
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

import fedlightning.cli as cli_module
from fedlightning import FederatedLoop
from fedlightning.logging import (
    LogConfigCallback,
    agent_command,
    find_offline_runs,
    load_sweep,
    read_offline_run,
    sweep_grid,
    validate_sweep,
)
from numerics import assert_rounding_close, rtol32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS = sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml")))
SWEEP_IDS = [os.path.basename(p) for p in SWEEPS]


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(
        cli_module, "FederatedCLI", functools.partial(cli_module.FederatedCLI, save_config_callback=LogConfigCallback)
    )
    yield
    import wandb

    wandb.finish()


def _finish_wandb():
    import wandb

    wandb.finish()  # flush the offline run file before reading it


def _record_updates(monkeypatch):
    seen = {}
    original = FederatedLoop.train_client

    def recording(self, plan, client_id, global_flat):
        update = original(self, plan, client_id, global_flat)
        seen.setdefault(plan.round, []).append(update)
        return update

    monkeypatch.setattr(FederatedLoop, "train_client", recording)
    return seen


# ---------------------------------------------------------------------------------------------- W&B logging
def test_quickstart_wandb_offline_logs_per_round_metrics_and_config(tmp_path, monkeypatch):
    seen = _record_updates(monkeypatch)
    rounds, k, clients = 5, 3, 4
    cli = cli_module.main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "quickstart_wandb.yaml"),
            f"--trainer.max_steps={rounds}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--model.local_steps={k}",
            f"--model.clients_per_round={clients}",
        ]
    )
    _finish_wandb()
    runs = find_offline_runs(str(tmp_path))
    assert len(runs) == 1, runs
    run = read_offline_run(runs[0], wait_seconds=60)
    assert run.finished and run.exit_code == 0

    # one train/loss per round, equal to the mean of the losses the clients reported (recorded independently);
    # logged values are float32 (numerics.rtol32: the clients' float32 losses averaged, then one rounding)
    train = run.series("train/loss")
    expected = [sum(u.mean_loss for u in seen[r]) / len(seen[r]) for r in range(rounds)]
    assert train == pytest.approx(expected, rel=rtol32(clients + 1))
    steps = [u.step_sizes for r in range(rounds) for u in seen[r]]
    assert run.series("client/step_size_mean")[0] == pytest.approx(
        sum(sum(s) for s in steps[:clients]) / sum(len(s) for s in steps[:clients]), rel=rtol32(1)
    )
    assert run.series("server/lr") == [1] * rounds  # FedAvg
    assert run.series("round/local_steps") == [k] * rounds
    assert run.series("round/clients") == [clients] * rounds
    assert run.series("client/backtracks_per_step") == [0] * rounds  # SGD: no line search

    # RuntimeModel (simulated clock, cumulative SGD steps) and RoundTimer (real throughput)
    megabits = sum(p.numel() for p in cli.model.model.parameters()) * 32 / 1e6
    per_round = megabits / 20.0 + k * 0.017 + megabits / 5.0  # seed 004 Eq. 4 with the config's beta, D, U
    assert run.series("runtime/wall_clock_seconds") == pytest.approx([per_round * (r + 1) for r in range(rounds)])
    assert run.series("runtime/sgd_steps") == [k * (r + 1) for r in range(rounds)]
    secs = run.series("time/round_seconds")
    assert len(secs) == rounds and all(s > 0 for s in secs)
    # the logged round times are float32 roundings of the times the totals are summed from
    assert run.series("time/train_seconds")[-1] == pytest.approx(sum(secs), rel=rtol32(rounds + 1))
    assert run.series("time/rounds_per_second")[-1] == pytest.approx(rounds / sum(secs), rel=rtol32(rounds + 1))

    # global model on the validation split (val/*) and on the clients' training samples (train_eval/*), every 5
    # rounds, and on the test set after fit (test/*)
    dm, net = cli.datamodule, cli.model.model.net
    val, rows = torch.as_tensor(dm.val_indices), torch.as_tensor(dm.training_rows())
    with torch.no_grad():
        val_acc = float((net(dm.train_dataset.x[val]).argmax(-1) == dm.train_dataset.y[val]).float().mean())
        train_loss = F.cross_entropy(net(dm.train_dataset.x[rows]), dm.train_dataset.y[rows])
        exact_loss = F.cross_entropy(
            copy.deepcopy(net).double()(dm.train_dataset.x[rows].double()), dm.train_dataset.y[rows]
        )
        test_acc = float((net(dm.test_dataset.x).argmax(-1) == dm.test_dataset.y).float().mean())
    assert run.series("val/acc") == pytest.approx([val_acc], rel=rtol32(1))  # one rounding of the same ratio
    assert run.series("test/acc") == pytest.approx([test_acc], rel=rtol32(1))
    # GlobalEvaluation's float32 loss (batched) and this one (one batch) round differently: both near the float64 loss
    (logged_loss,) = run.series("train_eval/loss")
    assert_rounding_close(torch.tensor(logged_loss, dtype=torch.float32), train_loss, exact_loss)

    # the full resolved config is the run's config, and its YAML is among the run's files
    cfg = run.config
    assert cfg["model"]["local_steps"] == k and cfg["model"]["clients_per_round"] == clients
    assert cfg["trainer"]["max_steps"] == rounds
    assert cfg["model"]["client_optimizer"]["init_args"]["lr"] == 0.1
    assert cfg["data"]["init_args"]["partition"]["init_args"]["alpha"] == 0.3
    assert cfg["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    with open(os.path.join(runs[0], "files", "cli_config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["model"] == cfg["model"] and saved["data"] == cfg["data"]
    # config.yaml in the run's own folder, next to its checkpoints, not in the save_dir every run shares
    logger = cli.trainer.loggers[0]
    run_folder = os.path.join(str(tmp_path), str(logger.name), str(logger.version))
    assert not os.path.exists(os.path.join(str(tmp_path), "config.yaml"))
    with open(os.path.join(run_folder, "config.yaml")) as f:
        assert yaml.safe_load(f)["model"]["local_steps"] == k
    assert os.path.isdir(os.path.join(run_folder, "checkpoints"))


def test_read_offline_run_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_offline_run(str(tmp_path / "missing.wandb"))
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"not a wandb file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        read_offline_run(str(bad))
    empty_dir = tmp_path / "offline-run-1"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="no .wandb file"):
        read_offline_run(str(empty_dir))
    for wait in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="wait_seconds"):
            read_offline_run(str(empty_dir), wait_seconds=wait)


@pytest.mark.parametrize("case", ["garbage record", "nested key over a value", "config item without a key"])
def test_a_damaged_record_of_a_w_and_b_run_file_is_named(tmp_path, case):
    """A run file with W&B's header and framing whose records are damaged: one ValueError naming the file (a
    protobuf DecodeError, a TypeError or an IndexError naming none before)."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    def config(*items):
        record = pb.Record()
        for key, nested, value in items:
            item = record.config.update.add()
            if key:
                item.key = key
            item.nested_key.extend(nested)
            item.value_json = value
        return record.SerializeToString()

    records = {
        "garbage record": [b"\xff" * 7],
        "nested key over a value": [config(("lr", [], "0.1"), ("", ["lr", "value"], "0.2"))],
        "config item without a key": [config(("", [], "1"))],
    }[case]
    frames = b"".join(struct.pack("<IHB", zlib.crc32(r), len(r), 1) + r for r in records)
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b":W&B" + struct.pack("<HB", 0xBEE1, 0) + frames)
    with pytest.raises(ValueError, match=r"run-x.wandb: a damaged W&B record"):
        read_offline_run(str(path))


# ---------------------------------------------------------------------------------------------- sweep files
def _config_of(sweep):
    cmd = sweep["command"]
    return cmd[cmd.index("--config") + 1]


@pytest.mark.parametrize("path", SWEEPS, ids=SWEEP_IDS)
def test_sweep_file_schema(path):
    sweep = load_sweep(path)
    assert sweep["method"] == "grid" and sweep["program"] == "train.py"
    assert sweep["metric"]["name"] in ("val/acc", "train_eval/loss")
    cmd = sweep["command"]
    assert cmd[:4] == ["${env}", "${interpreter}", "${program}", "fit"] and cmd[-1] == "${args}"
    for key, spec in sweep["parameters"].items():
        assert key.split(".")[0] in ("model", "data", "trainer"), key
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec["values"]), (key, spec)
    grid = sweep_grid(sweep)
    assert len(grid) == math.prod(len(s["values"]) for s in sweep["parameters"].values())


def test_sweeps_cover_the_papers_grids():
    keys = {os.path.basename(p): set(load_sweep(p)["parameters"]) for p in SWEEPS}
    assert {"model.client_optimizer.init_args.c", "model.client_optimizer.init_args.eta_max"} <= keys[
        "fedexpsls_c_eta_max.yaml"
    ]
    assert keys["fedexp_eps.yaml"] == {"trainer.callbacks.init_args.eps"}
    assert keys["fedavg_client_lr.yaml"] == {"model.client_optimizer.init_args.lr"}
    assert keys["fedprox_mu.yaml"] == keys["feddane_mu.yaml"] == {"trainer.callbacks.init_args.mu"}
    assert "model.local_steps" in keys["kdecay_k0.yaml"]
    assert load_sweep(os.path.join(ROOT, "configs", "sweeps", "feddane_mu.yaml"))["parameters"][
        "trainer.callbacks.init_args.mu"
    ]["values"] == [0.0, 0.001, 0.01, 0.1, 1.0]  # seed 003 §2.6


def _wandb_agent_reference(sweep, params):
    """The command line built with the W&B agent's own code (wandb_agent.Agent._command_run's macro loop)."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    sweep_vars = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    sweep_vars["interpreter"] = ["python"]
    sweep_vars["program"] = [sweep["program"]]
    sweep_vars["env"] = ["/usr/bin/env"]
    out = []
    for c in sweep_utils.create_sweep_command(list(sweep["command"])):
        c = str(c)
        if c.startswith("${") and c.endswith("}"):
            out += sweep_vars.get(c[2:-1]) or []
        else:
            out.append(c)
    return out


@pytest.mark.parametrize("path", SWEEPS, ids=SWEEP_IDS)
def test_agent_command_equals_the_wandb_agent(path):
    sweep = load_sweep(path)
    for params in (sweep_grid(sweep)[0], sweep_grid(sweep)[-1]):
        assert agent_command(sweep, params) == _wandb_agent_reference(sweep, params)


def test_agent_command_macros():
    sweep = {
        "method": "grid",
        "metric": {"name": "m", "goal": "minimize"},
        "program": "p.py",
        "parameters": {"a": {"values": [1]}, "flag": {"values": [False, True]}},
        "command": [
            "${env}",
            "${interpreter}",
            "${program}",
            "${args_no_boolean_flags}",
            "x${envvar:FEDL_TEST_VAR}",
            "${args}",
        ],
    }
    os.environ["FEDL_TEST_VAR"] = "42"
    try:
        assert agent_command(sweep, {"a": 1, "flag": False}, interpreter="py") == [
            "/usr/bin/env",
            "py",
            "p.py",
            "--a=1",
            "x42",
            "--a=1",
            "--flag=False",
        ]
        assert agent_command(sweep, {"a": 1, "flag": True})[3:5] == ["--a=1", "--flag"]
    finally:
        del os.environ["FEDL_TEST_VAR"]
    assert agent_command({k: v for k, v in sweep.items() if k != "command"}, {"a": 2}) == [
        "/usr/bin/env",
        "python",
        "p.py",
        "--a=2",
    ]  # the agent's default command
    with pytest.raises(ValueError, match="args_typo"):
        agent_command(dict(sweep, command=["${program}", "${args_typo}"]), {"a": 1})


def _resolve(cli, key):
    """The value a swept key reached in the instantiated objects (not only in the parsed config)."""
    if key.startswith("model.client_optimizer.init_args."):
        return cli.model.client_optimizer.keywords[key.rsplit(".", 1)[1]]
    if key.startswith("trainer.callbacks.init_args."):
        cfg = cli.config[cli.subcommand] if cli.subcommand else cli.config
        last = cfg["trainer.callbacks"][-1].class_path.rsplit(".", 1)[1]
        matching = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == last]
        return getattr(matching[-1], key.rsplit(".", 1)[1])
    if key.startswith("model."):
        return getattr(cli.model, key.split(".", 1)[1])
    return (cli.config[cli.subcommand] if cli.subcommand else cli.config)[key]


def _missing_config(sweep):
    cfg = _config_of(sweep)
    return None if os.path.isfile(os.path.join(ROOT, cfg)) else cfg


def _test_overrides(tmp_path, params):
    """Smaller, faster, into tmp_path; never overriding a swept key."""
    extra = {
        "trainer.max_steps": 2,
        "trainer.val_check_interval": 2,
        "trainer.enable_progress_bar": "false",
        "trainer.enable_model_summary": "false",
        "trainer.default_root_dir": str(tmp_path),
        "trainer.logger.init_args.save_dir": str(tmp_path),
        "model.clients_per_round": 3,
        "model.local_steps": 2,
    }
    return [f"--{k}={v}" for k, v in extra.items() if k not in params]


@pytest.mark.parametrize("path", SWEEPS, ids=SWEEP_IDS)
def test_sweep_command_runs_through_the_cli(path, tmp_path, monkeypatch):
    sweep = load_sweep(path)
    missing = _missing_config(sweep)
    assert not missing, f"the sweep {path} runs a config that does not exist: {missing}"
    monkeypatch.chdir(ROOT)  # the agent runs the program from the repository root
    grid = sweep_grid(sweep)
    # the last grid point: parsed and instantiated, values reach the objects
    last = agent_command(sweep, grid[-1])
    cli = cli_module.main(last[4:] + _test_overrides(tmp_path, grid[-1]), run=False)  # run=False: no subcommand
    for key, value in grid[-1].items():
        assert _resolve(cli, key) == value, key
    # the first grid point: the exact agent command (after ${program}) runs 2 rounds and reports to W&B
    first = agent_command(sweep, grid[0])
    assert first[:3] == ["/usr/bin/env", "python", "train.py"]
    cli = cli_module.main(first[3:] + _test_overrides(tmp_path, grid[0]))
    assert cli.trainer.global_step == 2
    for key, value in grid[0].items():
        assert _resolve(cli, key) == value, key
    _finish_wandb()
    runs = find_offline_runs(str(tmp_path))
    assert len(runs) == 1
    run = read_offline_run(runs[0], wait_seconds=60)
    losses = run.series("train/loss")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert len(run.series("val/acc")) == 1
    for key, value in grid[0].items():  # the swept value is in the run's logged config
        node = run.config
        for part in key.split("."):
            node = node[-1] if isinstance(node, list) else node
            node = node[part]
        assert node == value, key


def test_sweep_command_line_works_as_a_subprocess(tmp_path):
    """The literal agent command line (/usr/bin/env python train.py fit ...) as the agent spawns it, from the
    repository root; ``--print_config`` makes train.py print the resolved config instead of training (the runs
    themselves are tested in-process above, which is much cheaper than a new Python process per run)."""
    sweep = load_sweep(os.path.join(ROOT, "configs", "sweeps", "fedexpsls_c_eta_max.yaml"))
    params = sweep_grid(sweep)[-1]  # c = 0.5, eta_max = 10.0
    cmd = agent_command(sweep, params, interpreter=sys.executable) + ["--print_config"]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    opt = printed["model"]["client_optimizer"]
    assert opt["class_path"] == "fedlightning.optim.SgdArmijo"
    assert opt["init_args"]["c"] == 0.5 and opt["init_args"]["eta_max"] == 10.0
    assert printed["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.WandbLogger"
    assert printed["trainer"]["enable_checkpointing"] is False


@pytest.mark.parametrize(
    "key,value",
    [("model.client_optimizer.init_args.cc", 0.1), ("model.local_stepz", 3), ("trainer.callbacks.init_args.epz", 0.1)],
)
def test_sweep_with_unknown_key_gives_a_clear_error(key, value, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    sweep = load_sweep(os.path.join(ROOT, "configs", "sweeps", "fedexp_eps.yaml"))
    sweep["parameters"] = {key: {"values": [value]}}
    cmd = agent_command(sweep, sweep_grid(sweep)[0])
    with pytest.raises(SystemExit) as exc:
        cli_module.main(cmd[3:] + _test_overrides(tmp_path, {}))
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert key.rsplit(".", 1)[1] in err, err[-2000:]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s: s.update(method="exhaustive"), "method"),
        (lambda s: s.pop("metric"), "metric"),
        (lambda s: s["metric"].update(goal="up"), "goal"),
        (lambda s: s.update(parameters={}), "parameters"),
        (lambda s: s["parameters"].update({"x": {"values": []}}), "'x'"),
        (lambda s: s["parameters"].update({"x": {"min": 0, "max": 1}}), "'x'"),  # no distributions in a grid
        (lambda s: s.pop("program"), "program"),
        (lambda s: s["command"].remove("${args}"), "args"),
    ],
)
def test_validate_sweep_bad_input(mutate, match):
    sweep = yaml.safe_load(open(os.path.join(ROOT, "configs", "sweeps", "fedexp_eps.yaml")))
    validate_sweep(sweep)
    mutate(sweep)
    with pytest.raises(ValueError, match=match):
        validate_sweep(sweep)


def test_sweep_grid_order_and_dry_run_listing(tmp_path, capsys):
    from fedlightning.sweep.runner import main

    path = os.path.join(ROOT, "configs", "sweeps", "fedexpsls_c_eta_max.yaml")
    sweep = load_sweep(path)
    grid = sweep_grid(sweep)
    assert grid[0] == {"model.client_optimizer.init_args.c": 0.01, "model.client_optimizer.init_args.eta_max": 0.1}
    assert grid[1]["model.client_optimizer.init_args.eta_max"] == 1.0  # the last parameter varies fastest
    assert main([path, "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    lines = sorted(capsys.readouterr().out.strip().splitlines())  # one per grid cell (in the sampler's order)
    assert len(lines) == len(grid) == 15 and all(" train.py fit --config configs/fedexpsls.yaml " in x for x in lines)
    assert (
        sum(
            "--model.client_optimizer.init_args.c=0.5 --model.client_optimizer.init_args.eta_max=10.0" in x
            for x in lines
        )
        == 1
    )
    random_sweep = dict(sweep, method="random", parameters={"a": {"min": 0.0, "max": 1.0}})
    with pytest.raises(ValueError, match="no finite grid"):
        sweep_grid(random_sweep)
    bad = os.path.join(ROOT, "configs", "sweeps", "no_such_file.yaml")  # one line, no traceback
    assert main([bad, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no_such_file.yaml" in err[0]
