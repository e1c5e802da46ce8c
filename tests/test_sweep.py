"""The local sweep runner (``python -m fedlightning.sweep``): a grid of real tiny training runs (table sorted by the
metric, resume, the best command reproduces the best run), failing runs, interrupted runs, seeded random and bayes
draws within the W&B ranges, the W&B → Optuna mapping and clear errors for unsupported specs and malformed files.

Most tests run a tiny stand-in program written by the test (it parses the ``--key=value`` arguments, logs a
``metrics.csv`` where the CSV logger would, and records each invocation), so every run is a real subprocess that
costs a Python start only; one test runs ``train.py`` itself."""

import csv
import fcntl
import glob
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

import fedlightning.cli as cli_module
from fedlightning.logging import agent_command, load_sweep, sweep_grid
from fedlightning.sweep import LOCAL_LOGGER, LocalSweep, main, make_sampler, run_slug, search_space

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_SWEEPS = sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml")))

# The stand-in program: val/loss = (x - 0.3)^2 (+1 per unit of y), every numeric argument echoed as val/arg_<name>;
# --mode=fail exits 3, --mode=nan logs a nan loss, --mode=missing logs no val/loss; while the file named by
# FAKE_TERM_ONCE exists, a call deletes it, sends SIGTERM to the sweep process and sleeps.
FAKE = r"""
import math, os, signal, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
save, name = args["trainer.logger.init_args.save_dir"], args["trainer.logger.init_args.name"]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt"), "a") as f:
    f.write(name + "\n")
if os.environ.get("FAKE_TERM_ONCE") and os.path.exists(os.environ["FAKE_TERM_ONCE"]):
    os.remove(os.environ["FAKE_TERM_ONCE"])  # once: terminate the sweep process, then wait to be killed
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(120)
mode = args.get("mode", "ok")
if mode == "fail":
    sys.exit(3)
loss = (float(args.get("x", 0)) - 0.3) ** 2 + float(args.get("y", 0))
echo = {}
for k, v in args.items():
    try:
        echo["val/arg_" + k] = float(v)
    except ValueError:
        pass
d = os.path.join(save, name)
os.makedirs(d, exist_ok=True)
cols = ["step", "train/loss"] + ([] if mode == "missing" else ["val/loss"]) + sorted(echo)
with open(os.path.join(d, "metrics.csv"), "w") as f:
    f.write(",".join(cols) + "\n")
    f.write("0,5.0" + "," * (len(cols) - 2) + "\n")  # an early row: only train/loss
    last = {"step": 1, "train/loss": 1.0, "val/loss": float("nan") if mode == "nan" else loss, **echo}
    f.write(",".join(repr(last[c]) for c in cols) + "\n")
"""


def _fake_sweep(tmp_path, parameters, method="grid", goal="minimize", **extra):
    program = tmp_path / "objective.py"
    program.write_text(FAKE)
    sweep = {
        "name": "fake",
        "program": str(program),
        "method": method,
        "metric": {"name": "val/loss", "goal": goal},
        "parameters": parameters,
        "command": ["${env}", "${interpreter}", "${program}", "${args}"],
    }
    sweep.update(extra)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return str(path)


def _calls(tmp_path):
    path = tmp_path / "calls.txt"
    return path.read_text().split() if path.exists() else []


def _table(out):
    with open(os.path.join(out, "results.csv"), newline="") as f:
        return list(csv.DictReader(f))


def _last_value(metrics_csv, column):
    """Independent of the runner's reader: the column's last non-empty cell."""
    with open(metrics_csv, newline="") as f:
        cells = [row[column] for row in csv.DictReader(f) if row.get(column)]
    return float(cells[-1])


# ---------------------------------------------------------------------------------------------- real runs
TINY = """
seed_everything: 0
trainer:
  max_steps: 2
  val_check_interval: 2
  check_val_every_n_epoch: null
  log_every_n_steps: 1
  accelerator: cpu
  devices: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  model:
    class_path: fedlightning.models.MLP
    init_args: {input_dim: 64, num_classes: 10, hidden: [16]}
  client_optimizer:
    class_path: torch.optim.SGD
    init_args: {lr: 0.1}
  local_steps: 2
  clients_per_round: 3
  seed: 0
data:
  class_path: fedlightning.datamodules.DigitsDataModule
  init_args:
    num_clients: 6
    batch_size: 20
    seed: 0
"""


def test_grid_of_real_runs_resumes_sorts_by_metric_and_the_best_command_reproduces_the_best_run(
    tmp_path, monkeypatch, capsys
):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    lr_key = "model.client_optimizer.init_args.lr"
    sweep = {
        "name": "tiny",
        "program": "train.py",
        "method": "grid",
        "metric": {"name": "val/acc", "goal": "maximize"},
        "parameters": {lr_key: {"values": [0.02, 1.0]}},
        "command": ["${env}", "${interpreter}", "${program}", "fit", "--config", str(config), "${args}"],
    }
    path = tmp_path / "tiny_sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = str(tmp_path / "out")
    monkeypatch.chdir(ROOT)  # the sweep's program path is relative to the repository root

    assert main([str(path), "--out", out, "--runs", "1"]) == 0
    first = _table(out)
    assert len(first) == 1 and first[0]["status"] == "finished"
    first_csv = os.path.join(out, "runs", first[0]["run"], "metrics.csv")
    stamp = os.stat(first_csv).st_mtime_ns

    capsys.readouterr()
    assert main([str(path), "--out", out]) == 0  # the same command again: completes the grid
    printed = capsys.readouterr().out
    rows = _table(out)
    assert len(rows) == 2 and {float(r[lr_key]) for r in rows} == {0.02, 1.0}
    assert os.stat(first_csv).st_mtime_ns == stamp  # the finished run was not re-run
    assert sorted(os.listdir(os.path.join(out, "logs"))) == sorted(r["run"] + ".log" for r in rows)

    # one row per run, sorted by val/acc (maximize), each value the last val/acc its metrics.csv holds
    accs = [_last_value(os.path.join(out, "runs", r["run"], "metrics.csv"), "val/acc") for r in rows]
    assert [float(r["val/acc"]) for r in rows] == accs
    assert accs[0] > accs[1], accs  # the two learning rates must give different accuracies for this test
    assert all(r["status"] == "finished" and r["exit_code"] == "0" for r in rows)
    assert [r["rank"] for r in rows] == ["1", "2"]

    # the best command: the sweep's command with the best run's parameters; run in-process it gives its val/acc
    best_line = [line for line in printed.splitlines() if line.startswith("python ")][-1]
    cmd = shlex.split(best_line)
    assert cmd == ["python"] + agent_command(sweep, {lr_key: float(rows[0][lr_key])})[2:]
    cli = cli_module.main(cmd[2:] + [f"--trainer.default_root_dir={tmp_path}"])
    assert cli.model.client_optimizer.keywords["lr"] == float(rows[0][lr_key])
    assert float(cli.trainer.callback_metrics["val/acc"]) == pytest.approx(accs[0], abs=1e-6)
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert best_line in md and md.count(f"| {rows[0]['run']} |") == 1


# ---------------------------------------------------------------------------------------------- stand-in runs
def test_failed_runs_are_recorded_with_exit_code_and_the_sweep_continues(tmp_path, capsys):
    path = _fake_sweep(tmp_path, {"mode": {"values": ["fail", "ok", "nan", "missing"]}, "x": {"values": [0.6, 0.2]}})
    out = str(tmp_path / "out")
    assert main([path, "--out", out]) == 0  # some runs finished: the sweep has a best run
    logs = os.path.join(os.path.abspath(out), "logs")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"warning: 6 of 8 runs failed (2 exited non-zero, 4 logged no finite val/loss); logs: {logs}{os.sep}"
    )
    assert len(_calls(tmp_path)) == 8  # every run was started, after the failures too
    rows = _table(out)
    assert len(rows) == 8
    ok = [r for r in rows if r["mode"] == "ok"]
    # the two successful runs first, by val/loss ascending ((0.2-0.3)^2 < (0.6-0.3)^2), then the rest in run order
    assert rows[:2] == ok and [float(r["x"]) for r in ok] == [0.2, 0.6]
    assert [float(r["val/loss"]) for r in ok] == pytest.approx([0.01, 0.09])
    rest = rows[2:]
    assert [int(r["run"][:3]) for r in rest] == sorted(int(r["run"][:3]) for r in rest)
    status = {(r["mode"], r["exit_code"], r["status"]) for r in rest}
    assert status == {("fail", "3", "failed"), ("nan", "0", "no metric"), ("missing", "0", "no metric")}
    assert all(r["val/loss"] == "" for r in rest if r["mode"] in ("fail", "missing"))
    assert all(math.isnan(float(r["val/loss"])) for r in rest if r["mode"] == "nan")


def test_a_sweep_whose_every_run_failed_exits_non_zero_naming_the_logs(tmp_path, capsys):
    """Every run failed (a crash or no finite metric): exit code 1, each run and its log above, and a last line
    counting them; resuming the finished sweep reports the same."""
    path = _fake_sweep(tmp_path, {"mode": {"values": ["fail", "nan", "fail"]}})
    out = str(tmp_path / "out")
    logs = os.path.join(os.path.abspath(out), "logs")
    last = f"error: all 3 runs failed (2 exited non-zero, 1 logged no finite val/loss); logs: {logs}{os.sep}"
    assert main([path, "--out", out]) == 1
    err = capsys.readouterr().err.rstrip().splitlines()
    assert err[-1] == last
    rows = {r["run"]: r for r in _table(out)}
    assert len(rows) == 3
    for slug, row in rows.items():
        code = f" (exit code {row['exit_code']})" if row["status"] == "failed" else ""
        assert f"  {slug}: {row['status']}{code}, log {os.path.join(logs, slug + '.log')}" in err
        assert os.path.isfile(os.path.join(logs, slug + ".log"))
    assert main([path, "--out", out]) == 1  # nothing left to run: the recorded runs still all failed
    assert capsys.readouterr().err.strip().splitlines()[-1] == last
    assert main([path, "--out", str(tmp_path / "dry"), "--dry-run"]) == 0  # nothing ran, nothing failed


def test_resume_skips_finished_runs(tmp_path):
    path = _fake_sweep(tmp_path, {"x": {"values": [0.1, 0.2, 0.3, 0.4]}})
    out = str(tmp_path / "out")
    assert main([path, "--out", out, "--runs", "2"]) == 0
    done = _calls(tmp_path)
    assert len(done) == 2 and len(_table(out)) == 2
    assert main([path, "--out", out, "--runs", "2"]) == 0  # the same command: nothing left to run
    assert _calls(tmp_path) == done
    assert main([path, "--out", out]) == 0  # the whole grid: only the two missing cells run
    calls = _calls(tmp_path)
    assert calls[:2] == done and len(calls) == 4
    assert sorted(float(r["x"]) for r in _table(out)) == [0.1, 0.2, 0.3, 0.4]
    assert main([path, "--out", out]) == 0
    assert len(_calls(tmp_path)) == 4


def test_interrupted_runs_are_retried_with_the_same_parameters(tmp_path, monkeypatch):
    path = _fake_sweep(tmp_path, {"x": {"values": [0.1, 0.2, 0.3]}, "y": {"value": 1}})
    # SIGTERM (as Ctrl-C) during the first run: the sweep kills the run and stops; the next invocation re-runs
    # that grid cell first
    out = str(tmp_path / "terminated")
    marker = tmp_path / "term_once"
    marker.write_text("")
    monkeypatch.setenv("FAKE_TERM_ONCE", str(marker))
    handler = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        main([path, "--out", out])
    assert time.monotonic() - start < 60  # the runner killed the sleeping run instead of waiting for it
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    interrupted = _calls(tmp_path)
    assert len(interrupted) == 1 and not marker.exists()
    assert main([path, "--out", out]) == 0
    calls = _calls(tmp_path)
    assert len(calls) == 4 and calls[1] == interrupted[0]  # the retry runs under the interrupted run's name
    rows = _table(out)
    assert sorted(float(r["x"]) for r in rows) == [0.1, 0.2, 0.3] and all(r["status"] == "finished" for r in rows)
    assert sorted(r["run"][:3] for r in rows) == ["000", "001", "002"]
    # its files replace the interrupted attempt's: one log and one run folder per run
    assert sorted(os.listdir(os.path.join(out, "logs"))) == sorted(r["run"] + ".log" for r in rows)

    # a killed sweep leaves its trial RUNNING in the journal: the same
    sweep = LocalSweep(load_sweep(path), str(tmp_path / "killed"))
    os.makedirs(sweep.out)
    study = sweep._open_study(sweep._storage())
    study.sampler = make_sampler("grid", sweep.space, sweep.seed)
    stale = sweep._suggest(study.ask())
    sweep.run(log=lambda s: None)
    rows = sweep.results()
    assert len(rows) == 3 and sorted(r.params["x"] for r in rows) == [0.1, 0.2, 0.3]
    assert min(rows, key=lambda r: r.number).params == stale  # retried before any new cell
    assert all(
        r.params["y"] == 1 and r.value("val/loss") == pytest.approx((r.params["x"] - 0.3) ** 2 + 1) for r in rows
    )


RANGES = {
    "x": {"distribution": "uniform", "min": 0.1, "max": 0.9},
    "lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-1},
    "n": {"distribution": "int_uniform", "min": 2, "max": 5},
    "q": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.25},
    "c": {"values": ["a", "b", "c"]},
    "k": {"value": 3},
}


def _params(out):
    return [
        (r["run"], r["x"], r["lr"], r["n"], r["q"], r["c"], r["k"]) for r in sorted(_table(out), key=lambda r: r["run"])
    ]


@pytest.mark.parametrize("method", ["random", "bayes"])
def test_random_and_bayes_draw_within_the_ranges_and_are_seeded(method, tmp_path):
    path = _fake_sweep(tmp_path, RANGES, method=method)
    runs = 8
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    assert main([path, "--out", a, "--runs", str(runs)]) == 0
    assert main([path, "--out", b, "--runs", "3"]) == 0  # in two steps: the same draws
    assert main([path, "--out", b, "--runs", str(runs)]) == 0
    assert main([path, "--out", c, "--runs", "3", "--seed", "1"]) == 0
    assert _params(a) == _params(b)
    assert [p[1:] for p in _params(c)] != [p[1:] for p in _params(a)[:3]]
    rows = _table(a)
    assert len(rows) == runs and all(r["status"] == "finished" for r in rows)
    for r in rows:
        x, lr, n, q = float(r["x"]), float(r["lr"]), int(r["n"]), float(r["q"])
        assert 0.1 <= x <= 0.9 and 1e-4 <= lr <= 1e-1 and 2 <= n <= 5
        assert q in (0.0, 0.25, 0.5, 0.75, 1.0) and r["c"] in ("a", "b", "c") and r["k"] == "3"
        # the program received exactly the table's values
        assert [float(r[f"val/arg_{k}"]) for k in ("x", "lr", "n", "q", "k")] == [x, lr, n, q, 3.0]
    assert len({r["x"] for r in rows}) == runs  # continuous draws do not repeat
    assert len({r["n"] for r in rows}) > 1 and len({r["c"] for r in rows}) > 1


@pytest.mark.parametrize("method", ["random", "bayes", "grid"])
def test_an_interrupted_and_resumed_sweep_draws_what_an_uninterrupted_one_draws(method, tmp_path, monkeypatch):
    """SIGTERM during the first run, then the same command again: the retry, then the later runs, with the values
    (and run names) of one uninterrupted invocation. The samplers are seeded by the run number, which the
    interrupted attempt and its retry do not advance."""
    space = {"x": {"values": [0.1, 0.2, 0.3, 0.4]}, "y": {"value": 1}} if method == "grid" else RANGES
    path = _fake_sweep(tmp_path, space, method=method)
    runs = 3
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    assert main([path, "--out", whole, "--runs", str(runs)]) == 0
    marker = tmp_path / "term_once"
    marker.write_text("")
    monkeypatch.setenv("FAKE_TERM_ONCE", str(marker))
    with pytest.raises(KeyboardInterrupt):
        main([path, "--out", resumed, "--runs", str(runs)])
    assert main([path, "--out", resumed, "--runs", str(runs)]) == 0
    assert [r["run"] for r in sorted(_table(resumed), key=lambda r: r["run"])] == [
        r["run"] for r in sorted(_table(whole), key=lambda r: r["run"])
    ]
    if method != "grid":
        assert _params(resumed) == _params(whole)


def test_grid_cells_are_in_optunas_grid_sampler_order(tmp_path):
    """Run n of a grid sweep takes cell n of Optuna's GridSampler order (its seeded shuffle), as the sweep did when
    the sampler chose the cells itself."""
    import optuna

    from fedlightning.sweep.space import grid_cells

    spec = {"b": {"values": [1, 2, 3]}, "a": {"values": ["x", "y"]}, "k": {"value": 3}}
    space = LocalSweep(load_sweep(_fake_sweep(tmp_path, spec)), str(tmp_path / "out")).space
    for seed in (0, 7):
        grid = {k: p.grid() for k, p in space.items() if p.kind != "constant"}
        sampler = optuna.samplers.GridSampler(grid, seed=seed)
        expected = [dict(zip(sorted(grid), cell)) for cell in sampler._all_grids]
        assert grid_cells(space, seed) == expected and len(expected) == 6


def test_bayes_is_tpe_after_its_random_start(tmp_path):
    """TPE's first 10 draws are its random start-up (the same seeds as the random method); later draws use the
    results, so they differ from random's."""
    random_out, bayes_out = str(tmp_path / "random"), str(tmp_path / "bayes")
    path = _fake_sweep(tmp_path, {"x": RANGES["x"]}, method="random")
    assert main([path, "--out", random_out, "--runs", "12"]) == 0
    path = _fake_sweep(tmp_path, {"x": RANGES["x"]}, method="bayes")
    assert main([path, "--out", bayes_out, "--runs", "12"]) == 0
    xr = [r[1] for r in _params_x(random_out)]
    xb = [r[1] for r in _params_x(bayes_out)]
    assert xb[:10] == xr[:10] and xb[10:] != xr[10:]
    assert type(make_sampler("bayes", {}, 0)).__name__ == "TPESampler"


def _params_x(out):
    return [(r["run"], r["x"]) for r in sorted(_table(out), key=lambda r: r["run"])]


def test_dry_run_prints_the_next_commands_and_changes_nothing(tmp_path, capsys):
    path = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 1.0}}, method="random", run_cap=3)
    out = tmp_path / "out"
    assert main([path, "--out", str(out), "--dry-run"]) == 0
    planned = capsys.readouterr().out.strip().splitlines()
    assert not out.exists() and _calls(tmp_path) == []
    assert len(planned) == 3  # run_cap
    assert main([path, "--out", str(out)]) == 0
    calls = _calls(tmp_path)
    logs = [open(out / "logs" / f"{name}.log").readline().strip() for name in calls]
    assert logs == planned  # the dry run showed exactly the commands that then ran
    parsed = shlex.split(planned[0])
    assert parsed[:3] == ["/usr/bin/env", sys.executable, str(tmp_path / "objective.py")]
    assert parsed[-4:] == [
        f"--trainer.logger={LOCAL_LOGGER}",
        f"--trainer.logger.init_args.save_dir={out / 'runs'}",
        f"--trainer.logger.init_args.name={calls[0]}",
        "--trainer.logger.init_args.version=",
    ]


@pytest.mark.parametrize("path", REPO_SWEEPS, ids=[os.path.basename(p) for p in REPO_SWEEPS])
def test_repository_sweep_files_run_locally_as_their_grid(path, tmp_path, capsys):
    """Each configs/sweeps file, unchanged, plans one local run per grid cell with the W&B agent's command line."""
    sweep = load_sweep(path)
    assert main([path, "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    planned = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    grid = sweep_grid(sweep)
    assert len(planned) == len(grid)
    commands = sorted(cmd[:-4] for cmd in planned)
    assert commands == sorted(agent_command(sweep, p, interpreter=sys.executable) for p in grid)


def test_more_runs_than_grid_cells_says_how_many_run(tmp_path, capsys):
    path = REPO_SWEEPS[0]
    cells = len(sweep_grid(load_sweep(path)))
    assert main([path, "--out", str(tmp_path / "out"), "--runs", str(cells + 3), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    name = os.path.basename(path)
    assert lines[0] == f"{name}: --runs {cells + 3} is more than the grid's {cells} cells; {cells} run"
    assert len(lines) == 1 + cells


# ---------------------------------------------------------------------------------------------- mapping, names
def test_wandb_specs_map_to_optuna_distributions():
    space = search_space(
        {
            "method": "random",
            "metric": {"name": "m", "goal": "minimize"},
            "program": "p.py",
            "parameters": {
                "u": {"distribution": "uniform", "min": 0.5, "max": 2},
                "u_inferred": {"min": 0.5, "max": 2.0},
                "i": {"distribution": "int_uniform", "min": 1, "max": 9},
                "i_inferred": {"min": 1, "max": 9},
                "qf": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.1},
                "qi": {"distribution": "q_uniform", "min": 0, "max": 100, "q": 10},
                "lv": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-1},
                "le": {"distribution": "log_uniform", "min": -2, "max": 1},
                "ql": {"distribution": "q_log_uniform_values", "min": 1, "max": 256, "q": 1},
                "cat": {"distribution": "categorical", "values": [1, "two", None]},
                "layers": {"values": [[64], [64, 64]]},
                "const": {"value": 7},
            },
        }
    )
    assert space["u"].distribution == FloatDistribution(0.5, 2.0)
    assert space["u_inferred"].distribution == FloatDistribution(0.5, 2.0)
    assert space["i"].distribution == IntDistribution(1, 9) == space["i_inferred"].distribution
    assert space["qf"].distribution == FloatDistribution(0.0, 1.0, step=0.1)
    assert space["qi"].distribution == IntDistribution(0, 100, step=10)
    assert space["lv"].distribution == FloatDistribution(1e-5, 1e-1, log=True)
    assert space["le"].distribution == FloatDistribution(math.exp(-2), math.exp(1), log=True)
    assert space["ql"].distribution == IntDistribution(1, 256, log=True)
    assert space["cat"].distribution == CategoricalDistribution([1, "two", None])
    assert space["layers"].distribution == CategoricalDistribution([0, 1])  # by index: Optuna stores primitives
    assert [space["layers"].decode(i) for i in (0, 1)] == [[64], [64, 64]]
    assert space["const"].kind == "constant" and space["const"].value == 7 and space["const"].distribution is None
    assert list(space) == ["u", "u_inferred", "i", "i_inferred", "qf", "qi", "lv", "le", "ql", "cat", "layers", "const"]


def test_run_names():
    space = search_space(
        {
            "method": "grid",
            "metric": {"name": "m", "goal": "minimize"},
            "program": "p.py",
            "parameters": {
                "model.a.lr": {"values": [0.1]},
                "trainer.b.lr": {"values": [1]},
                "model.hidden": {"values": [[64, 32]]},
                "model.name": {"values": ["a b/c"]},
                "seed": {"value": 5},
            },
        }
    )
    params = {"model.a.lr": 0.1, "trainer.b.lr": 1, "model.hidden": [64, 32], "model.name": "a b/c", "seed": 5}
    assert run_slug(7, params, space) == "007-a.lr=0.1_b.lr=1_hidden=64x32_name=a-b-c"
    drawn = search_space(
        {
            "method": "random",
            "metric": {"name": "m", "goal": "minimize"},
            "program": "p.py",
            "parameters": {"x": {"min": 0.0, "max": 1.0}},
        }
    )
    assert run_slug(12, {"x": 0.123456789}, drawn) == "012-x=0.1235"


# ---------------------------------------------------------------------------------------------- errors
BASE = {
    "method": "random",
    "metric": {"name": "val/acc", "goal": "maximize"},
    "program": "train.py",
    "command": ["${env}", "${interpreter}", "${program}", "${args}"],
}


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"distribution": "normal", "mu": 0, "sigma": 1}, "'normal' is not supported.*unbounded"),
        ({"distribution": "q_log_normal", "mu": 0, "sigma": 1, "q": 1}, "'q_log_normal' is not supported"),
        ({"distribution": "beta", "a": 1, "b": 2}, "'beta' is not supported"),
        ({"distribution": "inv_log_uniform_values", "min": 1, "max": 2}, "'inv_log_uniform_values' is not supported"),
        ({"distribution": "q_log_uniform", "min": 0, "max": 2, "q": 1}, "'q_log_uniform' is not supported"),
        ({"values": [1, 2], "probabilities": [0.5, 0.5]}, "'probabilities' is not supported"),
        ({"parameters": {"a": {"value": 1}}}, "nested 'parameters'"),
        ({"valeus": [1, 2], "value": 1}, r"unknown key\(s\) \['valeus'\]"),
        ({"distribution": "unifrom", "min": 0, "max": 1}, "unknown distribution 'unifrom'"),
        ({"min": 0.0, "max": 1.0, "q": 0.1}, "'q' needs an explicit q_\\* distribution"),
        ({"distribution": "uniform", "min": 1.0, "max": 1.0}, "min must be < max"),
        ({"distribution": "uniform", "min": "0", "max": 1.0}, "needs numeric 'min' and 'max'"),
        ({"distribution": "int_uniform", "min": 0.5, "max": 3}, "int_uniform needs integer min and max"),
        ({"distribution": "log_uniform_values", "min": 0.0, "max": 1.0}, "needs min > 0"),
        ({"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0}, "q must be a number > 0"),
        ({"distribution": "q_log_uniform_values", "min": 1, "max": 100, "q": 2}, "only with q: 1"),
        (
            {"distribution": "uniform", "min": 0.0, "max": 1.0, "mu": 0},
            r"\['mu'\] do not apply to distribution uniform",
        ),
        ({"distribution": "constant"}, "constant needs 'value'"),
        ({"distribution": "categorical", "values": []}, "non-empty list"),
    ],
)
def test_unsupported_or_bad_spec_names_the_parameter(spec, match):
    with pytest.raises(ValueError, match=rf"sweep: parameter 'p': .*{match}"):
        search_space(dict(BASE, parameters={"ok": {"value": 1}, "p": spec}))


def test_swept_logger_keys_are_refused():
    with pytest.raises(ValueError, match="parameter 'trainer.logger.init_args.name'.*sets the logger itself"):
        search_space(dict(BASE, parameters={"trainer.logger.init_args.name": {"values": ["a"]}}))


def _error(argv, capsys):
    assert main(argv) == 2
    return capsys.readouterr().err


def test_malformed_files_and_bad_arguments_give_clear_errors(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("method: grid\nparameters: [unclosed\n")
    assert "error: bad.yaml is not valid YAML" in _error([str(bad_yaml)], capsys)
    listed = tmp_path / "list.yaml"
    listed.write_text("- method: grid\n")
    assert "error: list.yaml: a sweep must be a mapping, got list" in _error([str(listed)], capsys)
    assert "error: sweep file not found" in _error([str(tmp_path / "missing.yaml")], capsys)
    no_metric = tmp_path / "no_metric.yaml"
    no_metric.write_text(yaml.safe_dump(dict(BASE, metric=None, parameters={"x": {"values": [1]}})))
    assert "no_metric.yaml: metric must be a mapping" in _error([str(no_metric)], capsys)
    unsupported = tmp_path / "normal.yaml"
    unsupported.write_text(yaml.safe_dump(dict(BASE, parameters={"lr": {"distribution": "normal"}})))
    assert "error: normal.yaml: parameter 'lr': distribution 'normal' is not supported" in _error(
        [str(unsupported), "--runs", "2"], capsys
    )

    path = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 1.0}}, method="random")
    out = str(tmp_path / "out")
    assert "random sweep has no end; give --runs N" in _error([path, "--out", out], capsys)
    assert "--runs must be an integer >= 1, got 0" in _error([path, "--out", out, "--runs", "0"], capsys)
    assert "--seed must be an integer >= 0, got -3" in _error(
        [path, "--out", out, "--runs", "1", "--seed", "-3"], capsys
    )
    big = ["--runs", "1", "--seed", str(2**32)]
    assert "--seed must be an integer in [0, 2**32), got 4294967296" in _error([path, "--out", out, *big], capsys)
    capped = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 1.0}}, method="random", run_cap=0)
    assert "run_cap must be an integer >= 1, got 0" in _error([capped, "--out", out], capsys)

    path = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 1.0}}, method="random")
    assert main([path, "--out", out, "--runs", "1"]) == 0
    assert "holds a sweep drawn with --seed 0, got --seed 5" in _error(
        [path, "--out", out, "--runs", "2", "--seed", "5"], capsys
    )
    changed = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 2.0}}, method="random")
    assert "with different ['parameters']; use another --out" in _error([changed, "--out", out, "--runs", "2"], capsys)
    path = _fake_sweep(tmp_path, {"x": {"min": 0.0, "max": 1.0}}, method="random")
    with open(os.path.join(out, ".sweep.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert "another sweep process is running in" in _error([path, "--out", out, "--runs", "2"], capsys)
    assert len(_calls(tmp_path)) == 1  # none of the refused invocations ran anything


def test_a_terminated_sweep_ends_with_one_line_and_status_143(tmp_path):
    """``python -m fedlightning.sweep`` receiving SIGTERM mid-run: the run is stopped, the process ends with exit
    status 143 and a last line saying how to go on, without a traceback; the same command then finishes the sweep."""
    path = _fake_sweep(tmp_path, {"x": {"values": [0.1, 0.2]}})
    out = str(tmp_path / "out")
    marker = tmp_path / "term_once"
    marker.write_text("")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "FAKE_TERM_ONCE": str(marker), "PYTHONPATH": root}
    command = [sys.executable, "-m", "fedlightning.sweep", path, "--out", out]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.rstrip().splitlines()[-1].startswith("stopped: the sweep received SIGTERM; the run in progress")
    assert "Traceback" not in proc.stderr
    assert subprocess.run(command, env=env, capture_output=True, text=True, timeout=120).returncode == 0
    assert sorted(float(r["x"]) for r in _table(out)) == [0.1, 0.2]


def test_a_grid_of_one_cell_runs_and_writes_its_table(tmp_path):
    """A grid with a single value per parameter (one cell): Optuna's GridSampler looked up a grid id that the
    runner's queued cells do not have once one cell was left unvisited, and raised a KeyError after the run."""
    path = _fake_sweep(tmp_path, {"x": {"values": [0.3]}, "y": {"value": 1}})
    out = str(tmp_path / "out")
    assert main([path, "--out", out]) == 0
    assert len(_calls(tmp_path)) == 1
    assert [float(r["x"]) for r in _table(out)] == [0.3]
    assert os.path.exists(os.path.join(out, "results.md"))


def test_an_argument_the_program_does_not_take_stops_the_sweep_before_any_run(tmp_path, capsys):
    """A swept key that train.py's parser refuses (a typo of lr) ends the sweep before its first run with the
    parser's own line (the key and the closest name), and leaves nothing in --out, so the corrected file runs there."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    train = os.path.join(ROOT, "train.py")
    sweep = {
        "name": "typo",
        "program": train,
        "method": "grid",
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": {"model.client_optimizer.init_args.lrr": {"values": [0.1, 0.2]}},
        "command": ["${env}", "${interpreter}", "${program}", "fit", "--config", str(config), "${args}"],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    out = str(tmp_path / "out")
    assert main([str(path), "--out", out]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: the sweep's command line fails before any run: model.client_optimizer.init_args.lrr")
    assert "did you mean lr" in last
    assert not os.path.exists(out)
