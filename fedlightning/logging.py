"""Experiment logging helpers: the resolved config with every logger, W&B offline runs, W&B sweep files.

* :class:`LogConfigCallback`: the full resolved configuration handed to every logger (and ``config.yaml``).
* :func:`wandb_mode`: W&B runs offline unless the user configured it (:func:`default_wandb_offline` sets it, on
  importing ``fedlightning`` and in the CLI); :func:`read_offline_run` /
  :func:`find_offline_runs` read an offline run back without network or account.
* Sweeps: :func:`validate_sweep` / :func:`load_sweep` check a W&B sweep file, :func:`sweep_grid` lists a grid's
  parameter sets and :func:`agent_command` builds the exact command line the W&B agent runs;
  :mod:`fedlightning.sweep` runs the same files locally (``python -m fedlightning.sweep SWEEP.yaml --dry-run`` prints
  the commands of the runs it would start, one per line).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from lightning.pytorch.cli import SaveConfigCallback

from fedlightning._validation import non_negative

__all__ = [
    "LogConfigCallback",
    "resolved_config",
    "wandb_mode",
    "default_wandb_offline",
    "OfflineRun",
    "read_offline_run",
    "find_offline_runs",
    "load_sweep",
    "validate_sweep",
    "sweep_grid",
    "agent_command",
    "SWEEP_METHODS",
]

WANDB_CONFIG_FILENAME = "cli_config.yaml"


# ====================================================================== config logging
def resolved_config(parser, config) -> dict[str, Any]:
    """The full resolved configuration as plain nested Python data (what ``parser.dump`` writes as YAML)."""
    return yaml.safe_load(parser.dump(config, skip_none=False)) or {}


class LogConfigCallback(SaveConfigCallback):
    """``SaveConfigCallback`` that also logs the resolved config with every logger of the trainer.

    **Config logging.** :class:`LogConfigCallback` is LightningCLI's ``SaveConfigCallback`` (which writes
    ``config.yaml`` into the log directory) that also hands the full resolved configuration — every default filled
    in, after all ``--config`` files and command-line overrides — to ``log_hyperparams`` of every configured logger:
    W&B stores it as the run config (nested keys such as ``model.local_steps``), CSVLogger and TensorBoardLogger write
    it to their ``hparams.yaml``. For W&B the YAML text is also written into the run's files directory as
    ``cli_config.yaml`` (uploaded with the run; the name avoids W&B's own ``config.yaml``), so
    ``python train.py fit --config cli_config.yaml`` re-creates a run from its W&B page. The FederatedCLI installs it
    with ``save_config_callback=LogConfigCallback``.

    Same arguments as Lightning's ``SaveConfigCallback`` (the CLI passes them). Runs on global rank 0 only, once
    per process (Lightning's ``already_saved`` flag).
    """

    #: The run's own folder for ``config.yaml`` when the Trainer has no logger (the CLI sets it to the run's
    #: checkpoint version folder); None: Lightning's ``trainer.log_dir``.
    run_folder: str | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning's ``setup``, except where Lightning's ``trainer.log_dir`` is shared by every run (each would
        replace the last one's ``config.yaml``): with a ``WandbLogger`` first, ``trainer.log_dir`` is the logger's
        ``save_dir``, and the file goes into the run's own folder, ``<save_dir>/<project>/<run id>/``, where
        Lightning's ``ModelCheckpoint`` puts the run's ``checkpoints/``; without a logger it is ``default_root_dir``,
        and the file goes into :attr:`run_folder` where one is set."""
        if self.already_saved:
            return super().setup(trainer, pl_module, stage)
        if trainer.logger is None and self.run_folder is not None:  # the same branch on every process
            run_dir = self.run_folder if trainer.is_global_zero else None
        elif _first_logger_is_wandb(trainer):
            run_dir = _wandb_run_folder(trainer) if trainer.is_global_zero else None
        else:
            return super().setup(trainer, pl_module, stage)
        if self.save_to_log_dir and run_dir is not None:
            path = os.path.join(run_dir, self.config_filename)
            if not self.overwrite and os.path.isfile(path):
                raise RuntimeError(f"{type(self).__name__} expected {path} to NOT exist (overwrite is off)")
            os.makedirs(run_dir, exist_ok=True)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = resolved_config(self.parser, self.config)
        for logger in trainer.loggers:
            logger.log_hyperparams(config)
        self._save_to_wandb(trainer)

    def _save_to_wandb(self, trainer) -> None:
        try:
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:  # pragma: no cover - lightning always ships the class; wandb itself may be missing
            return
        text = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                run_dir = getattr(logger.experiment, "dir", None)
                if run_dir:
                    with open(os.path.join(run_dir, WANDB_CONFIG_FILENAME), "w") as f:
                        f.write(text)


def _first_logger_is_wandb(trainer) -> bool:
    from lightning.pytorch.loggers import WandbLogger

    return bool(trainer.loggers) and isinstance(trainer.loggers[0], WandbLogger)


def _wandb_run_folder(trainer) -> str | None:
    """``<save_dir>/<project>/<run id>`` of the trainer's first logger, a ``WandbLogger`` (called on global rank 0,
    where the run exists); None without a save directory."""
    logger = trainer.loggers[0]
    logger.experiment  # noqa: B018 - creates the run, which gives the version (its id)
    if logger.save_dir is None or logger.version is None:
        return None
    return os.path.join(logger.save_dir, str(logger.name), str(logger.version))


# ====================================================================== W&B mode policy
def wandb_mode(environ: Mapping[str, str] | None = None, netrc_path: str | None = None) -> dict[str, str]:
    """The W&B mode a run of the CLI gets, and why: ``{"mode": ..., "reason": ...}``.

    ``WANDB_MODE`` wins when set (``online``, ``offline``, ``disabled``, ...). Otherwise a configured account
    (``WANDB_API_KEY`` or an ``api.wandb.ai`` entry in ``~/.netrc``) means ``online``; with neither, the CLI sets
    ``WANDB_MODE=offline``.

    **W&B policy** (the CLI, :func:`fedlightning.cli.main`): W&B runs offline unless the user configured it
    (``WANDB_MODE``, ``WANDB_API_KEY`` or a ``wandb login`` entry in ``~/.netrc``), so a run never waits for the
    network; an offline run is uploaded later with ``wandb sync <run dir>``. :func:`wandb_mode` reports which mode a run
    will use and why. :func:`read_offline_run` reads an offline run's ``.wandb`` file back (history rows, config,
    summary) without network or account — for tests and for post-processing (its docstring says why it is our own
    reader).
    """
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE")
    if mode:
        return {"mode": mode, "reason": "WANDB_MODE is set"}
    if env.get("WANDB_API_KEY"):
        return {"mode": "online", "reason": "WANDB_API_KEY is set"}
    path = netrc_path or os.path.expanduser("~/.netrc")
    try:
        with open(path) as f:
            if "api.wandb.ai" in f.read():
                return {"mode": "online", "reason": f"wandb login found in {path}"}
    except OSError:
        pass
    return {"mode": "offline", "reason": "no W&B account configured (runs are kept locally; upload with wandb sync)"}


def default_wandb_offline(environ: dict[str, str] | None = None, netrc_path: str | None = None) -> bool:
    """Set ``WANDB_MODE=offline`` in ``environ`` (default ``os.environ``) when nothing is configured
    (:func:`wandb_mode` says "offline"); True if it set it. Importing ``fedlightning`` and
    :func:`fedlightning.cli.main` call it (the package docstring gives the policy)."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE") or wandb_mode(env, netrc_path=netrc_path)["mode"] != "offline":
        return False
    env["WANDB_MODE"] = "offline"
    return True


# ====================================================================== offline run reader
@dataclass
class OfflineRun:
    """What an offline W&B run file holds: ``history`` (one dict per ``log`` call, in order), the merged
    ``config`` and the last ``summary``. Values are decoded from W&B's JSON encoding."""

    path: str
    finished: bool = False  #: the file holds the run's exit record (``wandb.finish`` completed writing)
    exit_code: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> list[Any]:
        """The values of ``key`` in history order (rows without it are skipped)."""
        return [row[key] for row in self.history if key in row]


_WANDB_MAGIC = b":W&B"
_BLOCK = 32768  # LevelDB log format: records never straddle a 32 KiB block boundary without being split
_HEADER = 7  # record header: crc32 (4), length (2, little endian), type (1)


def _item_key(item) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def _decode(value_json: str) -> Any:
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def _set_nested(target: dict[str, Any], keys: Sequence[str], value: Any) -> None:
    for k in keys[:-1]:
        target = target.setdefault(k, {})
    target[keys[-1]] = value


def read_offline_run(path: str, wait_seconds: float = 0.0) -> OfflineRun:
    """Read an offline W&B run: a ``run-<id>.wandb`` file or the ``offline-run-*`` directory holding it.

    The file is W&B's transaction log: a 7-byte header (``:W&B``, magic ``0xBEE1``, version) followed by
    LevelDB-log records (32 KiB blocks; record types FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record``
    protobuf messages. Checksums are not verified; a truncated final record (a killed run) is ignored.

    Why our own reader: wandb offers no stable Python reader for this file. Its record *messages* are wandb's own
    (``wandb.proto.wandb_internal_pb2.Record``, used here to decode them); only the block framing above is ours.
    Older wandb releases had a framing reader, ``wandb.sdk.internal.datastore.DataStore``, but it was internal (it
    asserts it runs inside W&B's internal process) and it is gone from current releases (wandb 0.31 has no
    ``wandb.sdk.internal.datastore``), where the file is read only by the Go ``wandb-core`` service behind
    ``wandb sync`` and ``wandb leet``, with no Python API; the public ``wandb.Api`` reads uploaded runs only.
    Offline runs of current releases also write no ``files/wandb-summary.json`` to read instead.

    ``wandb.finish()`` can return before W&B's writer process has flushed the file: with ``wait_seconds > 0`` the
    file is re-read until it holds the run's exit record (``OfflineRun.finished``) or the time is up.
    """
    wait_seconds = non_negative("wait_seconds", wait_seconds)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            run = _read_offline_run(path)
        except (FileNotFoundError, ValueError):
            if time.monotonic() >= deadline:
                raise
            run = None
        if run is not None and (run.finished or time.monotonic() >= deadline):
            return run
        time.sleep(0.05)


def _read_offline_run(path: str) -> OfflineRun:
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".wandb"))
        if not files:
            raise FileNotFoundError(f"no .wandb file in {path}")
        path = os.path.join(path, files[0])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"W&B run file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER or data[:4] != _WANDB_MAGIC:
        raise ValueError(f"{path} is not a W&B run file (bad header {data[:7]!r})")
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    records: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 or pos + length > len(data):
            break
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    run = OfflineRun(path=path)
    try:
        _decode_records(run, records, pb)
    except (DecodeError, TypeError, IndexError, KeyError) as e:  # a damaged record, or keys that do not nest
        raise ValueError(f"{path}: a damaged W&B record ({type(e).__name__}: {e})") from None
    return run


def _decode_records(run: OfflineRun, records: list[bytes], pb: Any) -> None:
    """The run's history, config, summary and exit status from its ``Record`` messages (:func:`read_offline_run`)."""
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_item_key(i): _decode(i.value_json) for i in rec.history.item})
        elif kind == "config":
            for item in rec.config.update:
                keys = [item.key] if item.key else list(item.nested_key)
                _set_nested(run.config, keys, _decode(item.value_json))
            for item in rec.config.remove:
                run.config.pop(_item_key(item), None)
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[_item_key(item)] = _decode(item.value_json)
        elif kind == "exit":
            run.finished, run.exit_code = True, int(rec.exit.exit_code)
        elif kind == "run" and rec.run.HasField("config"):
            for item in rec.run.config.update:
                keys = [item.key] if item.key else list(item.nested_key)
                _set_nested(run.config, keys, _decode(item.value_json))


def find_offline_runs(wandb_dir: str) -> list[str]:
    """The ``offline-run-*`` directories under ``wandb_dir`` (or ``wandb_dir/wandb``), oldest first."""
    base = os.path.join(wandb_dir, "wandb") if os.path.isdir(os.path.join(wandb_dir, "wandb")) else wandb_dir
    if not os.path.isdir(base):
        return []
    return sorted(os.path.join(base, d) for d in os.listdir(base) if d.startswith("offline-run-"))


# ====================================================================== sweeps
SWEEP_METHODS = ("grid", "random", "bayes")
_GOALS = ("minimize", "maximize")
_ENVVAR = re.compile(r"\$\{envvar:([A-Z0-9_]*)\}")  # the agent's pattern
_DISTRIBUTION_KEYS = {"distribution", "min", "max", "mu", "sigma", "q", "a", "b", "probabilities", "parameters"}


def validate_sweep(sweep: Mapping[str, Any], name: str = "sweep") -> None:
    """Raise ``ValueError`` naming the problem when ``sweep`` lacks what the W&B sweep schema requires.

    Checked: ``method`` in grid/random/bayes; ``metric`` with ``name`` and ``goal`` minimize/maximize (required by
    bayes, and used by every sweep here); a non-empty ``parameters`` mapping whose entries each give ``value``,
    a non-empty list ``values`` or a distribution (``min``/``max``/``distribution``, or nested ``parameters``),
    grid sweeps only the first two; ``program``; and, when present, a ``command`` list containing ``${args}`` (else the
    parameters never reach the program).
    """
    if not isinstance(sweep, Mapping):
        raise ValueError(f"{name}: a sweep must be a mapping, got {type(sweep).__name__}")
    method = sweep.get("method")
    if method not in SWEEP_METHODS:
        raise ValueError(f"{name}: method must be one of {SWEEP_METHODS}, got {method!r}")
    metric = sweep.get("metric")
    if not isinstance(metric, Mapping) or not isinstance(metric.get("name"), str) or not metric.get("name"):
        raise ValueError(f"{name}: metric must be a mapping with a metric 'name', got {metric!r}")
    if metric.get("goal") not in _GOALS:
        raise ValueError(f"{name}: metric.goal must be one of {_GOALS}, got {metric.get('goal')!r}")
    params = sweep.get("parameters")
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"{name}: parameters must be a non-empty mapping, got {params!r}")
    for key, spec in params.items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"{name}: parameter {key!r} must be a mapping (value / values / distribution)")
        if "values" in spec:
            if not isinstance(spec["values"], list) or not spec["values"]:
                raise ValueError(f"{name}: parameter {key!r}: values must be a non-empty list, got {spec['values']!r}")
        elif "value" not in spec:
            if method == "grid" or not (_DISTRIBUTION_KEYS & set(spec)):
                raise ValueError(
                    f"{name}: parameter {key!r} needs 'values' or 'value'"
                    + ("" if method == "grid" else " or a distribution (min/max)")
                )
    if not isinstance(sweep.get("program"), str) or not sweep["program"]:
        raise ValueError(f"{name}: program (the script the agent runs) is missing")
    command = sweep.get("command")
    if command is not None:
        if not isinstance(command, list) or not all(isinstance(c, (str, int, float)) for c in command):
            raise ValueError(f"{name}: command must be a list of strings, got {command!r}")
        if "${args}" not in command:
            raise ValueError(f"{name}: command must contain ${{args}} so the sweep parameters reach the program")


def load_sweep(path: str) -> dict[str, Any]:
    """Parse and validate a W&B sweep YAML file (see :func:`validate_sweep`).

    ``FileNotFoundError`` for a missing file; ``ValueError`` naming the file for invalid YAML or a bad sweep.
    """
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sweep file not found: {path}")
    with open(path) as f:
        try:
            sweep = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{name} is not valid YAML: {e}") from None
    validate_sweep(sweep, name=name)
    return sweep


def sweep_grid(sweep: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every parameter set of a sweep's grid (``itertools.product`` order: the last parameter varies fastest; the
    W&B controller may visit the same set in another order).

    Parameters with ``value`` are constants; a sweep with a distribution parameter has no grid (ValueError).
    """
    validate_sweep(sweep)
    names, choices = [], []
    for key, spec in sweep["parameters"].items():
        if "values" in spec:
            options = list(spec["values"])
        elif "value" in spec:
            options = [spec["value"]]
        else:
            raise ValueError(f"parameter {key!r} is a distribution: the sweep has no finite grid")
        names.append(key)
        choices.append(options)
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def agent_command(
    sweep: Mapping[str, Any],
    params: Mapping[str, Any],
    interpreter: str = "python",
    env: str = "/usr/bin/env",
) -> list[str]:
    """The command line the W&B agent runs for one parameter set (``wandb_agent.Agent._command_run``).

    Macros: ``${env}`` → ``env``, ``${interpreter}`` → ``interpreter``, ``${program}`` → ``sweep["program"]``,
    ``${args}`` → ``--name=value`` per parameter (``str(value)``, as the agent formats them),
    ``${args_no_hyphens}`` → ``name=value``, ``${args_no_boolean_flags}`` → like ``${args}`` with ``False`` flags
    omitted and ``True`` ones as bare ``--name``, ``${args_no_equals}``, ``${args_json}`` and the Hydra forms;
    ``${envvar:NAME}`` → the environment variable (``NAME`` itself when unset, as the agent does). Without a
    ``command`` the agent's default ``${env} ${interpreter} ${program} ${args}`` is used.

    **Sweeps.** ``configs/sweeps/*.yaml`` are W&B sweep files (``wandb sweep configs/sweeps/X.yaml`` then
    ``wandb agent <id>``); :mod:`fedlightning.sweep` runs the same files locally (``python -m fedlightning.sweep
    configs/sweeps/X.yaml``: Optuna, resumable, one results table). :func:`load_sweep` checks a file's essentials,
    :func:`sweep_grid` lists the parameter sets of a grid sweep and :func:`agent_command` builds the exact command line
    the W&B agent runs for one parameter set (the agent's macro expansion: ``${env}`` → ``/usr/bin/env``,
    ``${interpreter}`` → ``python``, ``${program}`` → the sweep's ``program``, ``${args}`` → ``--name=value`` per
    parameter). ``python -m fedlightning.sweep SWEEP.yaml --dry-run`` prints the commands of a grid's runs, one per
    line, without running them.
    """
    command = sweep.get("command") or ["${env}", "${interpreter}", "${program}", "${args}"]
    args, no_hyphens, no_bool, no_equals = [], [], [], []
    for key, value in params.items():
        flag = f"{key}={value}"
        args.append("--" + flag)
        no_hyphens.append(flag)
        no_equals += [f"--{key}", str(value)]
        if isinstance(value, bool):
            if value:
                no_bool.append("--" + key)
        else:
            no_bool.append("--" + flag)
    macros = {
        "env": [env],
        "interpreter": [interpreter],
        "program": [str(sweep["program"])],
        "args": args,
        "args_no_hyphens": no_hyphens,
        "args_no_boolean_flags": no_bool,
        "args_no_equals": no_equals,
        "args_json": [json.dumps(dict(params))],
        "args_append_hydra": ["+" + f for f in no_hyphens],
        "args_override_hydra": ["++" + f for f in no_hyphens],
    }
    out: list[str] = []
    for chunk in command:
        chunk = _ENVVAR.sub(lambda m: os.environ.get(m.group(1), m.group(1)), str(chunk))
        if chunk.startswith("${") and chunk.endswith("}"):
            if chunk[2:-1] not in macros:
                raise ValueError(f"unsupported sweep command macro {chunk}")
            out.extend(macros[chunk[2:-1]])
        else:
            out.append(chunk)
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(
        "error: fedlightning.logging has no command line; "
        "python -m fedlightning.sweep SWEEP.yaml --dry-run prints a sweep's commands"
    )
