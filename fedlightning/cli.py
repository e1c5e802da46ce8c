"""LightningCLI for federated runs (``train.py``).

``python train.py fit --config configs/quickstart.yaml [--model.local_steps 10 ...]``

* ``model`` is always a :class:`~fedlightning.FederatedLoop`; the user's LightningModule goes in
  ``model.model`` (``class_path`` + ``init_args``).
* ``data`` is any :class:`~fedlightning.datamodules.FederatedDataModule` subclass.
* Weights & Biases runs offline unless the user configured it (``WANDB_MODE`` or an API key / ``wandb login``),
  so no run ever blocks on the network (the default is set when ``fedlightning`` is imported, see its docstring).

:class:`FederatedCLI`'s docstring lists its decisions (no LightningCLI optimizer options, checkpoint checks, one
version directory per run, ``--ckpt_path last`` / ``best``, refusing to resume with other settings); :func:`main`'s
the one-line configuration errors (``error: <config key>: <message>``, parsing errors included; abbreviated options
are refused).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import importlib
import os
import re
import sys
import warnings
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from fedlightning._validation import SettingError, check_val_check_interval
from fedlightning.callbacks.progress import RoundProgressBar
from fedlightning.checkpoint import (
    CONFIG_KEY,
    SIGTERM_EXIT_STATUS,
    TEMP_PREFIX,
    AtomicCheckpointIO,
    CheckpointError,
    RoundCheckpoint,
    StoreConfigCallback,
    check_checkpoint,
    check_fits_model,
    checkpoint_round,
    config_differences,
    remove_interrupted_writes,
    verify_checksums,
)
from fedlightning.datamodules.base import FederatedDataModule
from fedlightning.distributed import release_process_group
from fedlightning.logging import LogConfigCallback, default_wandb_offline, resolved_config
from fedlightning.loop import FederatedLoop, check_launcher

__all__ = ["FederatedCLI", "main", "SIGTERM_EXIT_STATUS", "TRACEBACK_ENV"]

TRACEBACK_ENV = "FEDLIGHTNING_TRACEBACK"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_KEYWORDS = ("last", "best")
_MAX_SEED = 2**32 - 1  # lightning.fabric.utilities.seed.max_seed_value (numpy's seed range)

SERVER_OPTIMIZER_HELP = (
    "Not supported by fedlightning: LightningCLI's {key} would replace the server step of the federated strategy. "
    "Set the client optimizer with model.client_optimizer and the server step with a strategy in trainer.callbacks."
)


class _RoundsRun(Callback):
    """Counts the rounds this process trained (tells a configuration error from a failure in a running round)."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1


class FederatedCLI(LightningCLI):
    """LightningCLI with federated defaults.

    Decisions this module makes (all ours unless a source is named):

    * **No LightningCLI optimizer options.** LightningCLI's ``--optimizer`` / ``--lr_scheduler`` would replace the
      FederatedLoop's ``configure_optimizers`` — the *server* step of the strategy — and silently turn FedAvg into,
      e.g., an Adam server step. The options are kept in the parser only to refuse them (command line, config file or
      environment alike) with an error pointing to ``model.client_optimizer`` and the strategy callbacks in
      ``trainer.callbacks`` (``auto_configure_optimizers=False``).
    * **Checkpoints are checked before Lightning reads them** (:func:`fedlightning.checkpoint.check_checkpoint`): a file
      given to ``--ckpt_path`` right after parsing (missing, empty, truncated, not a checkpoint, a type that could run
      code, a checkpoint of another LightningModule); after the model is built, also that its weights fit the model.
      LightningCLI's own reading of hyper-parameters from the checkpoint is skipped: a FederatedLoop saves none (the
      config defines the run). Every read, the Trainer's included, is ``weights_only`` (safe types only) unless the
      command says ``--weights_only false`` (:func:`fedlightning.checkpoint.read_checkpoint`).
    * **One version directory per run.** The checkpoints of the CLI's default
      :class:`~fedlightning.checkpoint.RoundCheckpoint` go into the logger's version directory
      ``<save_dir>/<name>/<version>/checkpoints`` (Lightning's default for a ``ModelCheckpoint`` without
      ``dirpath``), or ``<default_root_dir>/checkpoints/version_<N>`` without a logger (the next free ``N``, made
      when the fit's Trainer is built, so that runs whose times overlap never share it; the run's ``config.yaml``
      goes there too).
    * **``--ckpt_path last``** is the newest *complete* checkpoint of this config's runs by the round it holds
      (``global_step`` read from the file, ``weights_only``; ties broken by modification time, then name): every
      ``*.ckpt`` (``last.ckpt``, ``last-v1.ckpt``, ``epoch=...-step=....ckpt``, ...) in
      ``<save_dir>/<name>/*/checkpoints/`` (and ``<save_dir>/<name>/checkpoints/``, the pre-version layout), without a
      logger ``<default_root_dir>/checkpoints/`` and its ``version_*`` folders, plus the ``dirpath`` of every
      configured ``ModelCheckpoint``. A file that cannot be read (truncated, not a fedlightning checkpoint) is
      skipped with a warning naming it; a file that needs a type that could run code stops the run (a planted
      file is refused, not skipped). Temporary files of interrupted writes in those folders are deleted first
      (:func:`~fedlightning.checkpoint.remove_interrupted_writes`, one log line). The file and round resumed are
      named in one log line. With none, the run starts from round 0 with a warning (Lightning's behaviour for
      ``last``, kept so a restart script can always pass ``--ckpt_path last``). ``--ckpt_path best`` is the
      ``best_model_path`` recorded in that newest checkpoint by a ``ModelCheckpoint`` with a ``monitor``; without one it
      is an error. ``hpc``, registry names and remote URLs go to Lightning as given.
    * **Resuming with other settings is refused.** Every checkpoint stores the run's resolved config
      (:class:`~fedlightning.checkpoint.StoreConfigCallback`); ``fit --ckpt_path X`` compares it with the new run's
      (:func:`~fedlightning.checkpoint.config_differences`: model, data, seeds, strategy / schedule callbacks; not
      ``trainer.max_steps``) and, when they differ, lists the differences and stops unless ``--resume_mismatch=allow``
      (then they are listed as a warning). ``validate`` / ``test`` / ``predict`` do not compare settings (evaluating a
      checkpoint on other data is their purpose), only that the weights fit the model.

    * checkpoints are written atomically (:class:`~fedlightning.checkpoint.AtomicCheckpointIO`) unless the config
      sets ``trainer.plugins``;
    * when checkpointing is enabled and the config has no ``ModelCheckpoint``, a
      :class:`~fedlightning.checkpoint.RoundCheckpoint` is added that saves ``last.ckpt`` every
      ``checkpoint_every_n_rounds`` rounds (default 10, ours) and the final round into the run's version directory,
      so an interrupted run resumes with ``python train.py fit --config X --ckpt_path last``;
    * every checkpoint holds the resolved config (``fedlightning_config``), and resuming with other settings is
      refused unless ``--resume_mismatch=allow``;
    * ``--optimizer`` / ``--lr_scheduler`` are refused (the server optimizer belongs to the strategy).
    """

    checkpoint_every_n_rounds = 10

    #: After ``fit``, evaluate the final global model on the test set with ``trainer.test`` (the model's
    #: ``test_step`` logs and prints ``test/*``). Default True (ours: ``fit`` otherwise reports only the validation
    #: split). Switch off per run with ``python train.py fit ... --test_after_fit false``, or for a subclass by
    #: setting this attribute to False (the option's default).
    test_after_fit = True

    def after_fit(self) -> None:
        """``trainer.test`` on the final global model (the weights in memory, not a checkpoint) and the same data
        module, when ``test_after_fit`` is on. LightningCLI calls it only after ``fit`` returned normally (Ctrl-C or
        an error ends the process first). Skipped, with a warning, when the data module has no test set or the user's
        module no ``test_step``.
        ``trainer.test`` starts from empty ``trainer.callback_metrics``; the fit's last values (``train/*``,
        ``val/*``, ...) are put back next to ``test/*`` so that code reading them after ``fit`` keeps working."""
        if not self._get(self.config, "test_after_fit", self.test_after_fit):
            return
        dm = self.datamodule
        if isinstance(dm, FederatedDataModule) and dm.train_dataset is not None and dm.test_dataset is None:
            rank_zero_warn(f"{type(dm).__name__} has no test set: test_after_fit skipped")
            return
        user_module = getattr(self.model, "model", None)
        if isinstance(user_module, LightningModule) and not is_overridden("test_step", user_module, LightningModule):
            rank_zero_warn(f"{type(user_module).__name__} defines no test_step: test_after_fit skipped")
            return
        fit_metrics = dict(self.trainer.callback_metrics)
        self.trainer.test(self.model, datamodule=dm)  # logged at the last round's step (FederatedLoop.on_test_start)
        metrics = self.trainer.callback_metrics
        for key, value in fit_metrics.items():
            metrics.setdefault(key, value)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        if "save_config_callback" not in kwargs:
            kwargs["save_config_callback"] = LogConfigCallback
        self._rounds_run = _RoundsRun()
        self._checked: tuple[str, dict[str, Any]] | None = None
        try:
            super().__init__(FederatedLoop, FederatedDataModule, *args, **kwargs)
        except argparse.ArgumentError as err:
            try:
                line = _parser_error_line(err, self, kwargs.get("args"))
            except Exception:  # noqa: BLE001 - a message this reduction does not know stays one line
                line = "config: " + " ".join(str(err).split())
            err.fedlightning_error_line = line  # type: ignore[attr-defined]
            raise
        except (ValueError, TypeError, MisconfigurationException, FileNotFoundError) as err:
            if self._rounds_run.count == 0:
                line = _config_error_line(err, self._config_dict())
                if line is not None:
                    err.fedlightning_error_line = line  # type: ignore[attr-defined]
            raise

    def init_parser(self, **kwargs: Any):
        """LightningCLI's parser with two settings of ours (each overridable through ``parser_kwargs``):
        ``exit_on_error=False`` — a parsing error is raised as ``argparse.ArgumentError`` instead of printing
        jsonargparse's usage and union dump and exiting, so :func:`main` reduces it to one line
        (:func:`_parser_error_line`); ``allow_abbrev=False`` — ``--model.local_step 5`` is an unknown option, not
        silently ``--model.local_steps 5`` (argparse's prefix matching, which jsonargparse 4 still applies)."""
        kwargs.setdefault("exit_on_error", False)
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    # ------------------------------------------------------------------ parser
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_subclass_arguments(
            Optimizer,
            "optimizer",
            instantiate=False,
            fail_untyped=False,
            skip={"params"},
            required=False,
            help=SERVER_OPTIMIZER_HELP.format(key="--optimizer"),
        )
        parser.add_subclass_arguments(
            LRSchedulerTypeTuple,
            "lr_scheduler",
            instantiate=False,
            fail_untyped=False,
            skip={"optimizer"},
            required=False,
            help=SERVER_OPTIMIZER_HELP.format(key="--lr_scheduler"),
        )
        parser.add_argument(
            "--resume_mismatch",
            choices=["refuse", "allow"],
            default="refuse",
            help="fit --ckpt_path: when the checkpoint's run used other model / data / seed / strategy settings, "
            "'refuse' (default) lists the differences and stops; 'allow' lists them and resumes.",
        )
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=self.test_after_fit,
            help="fit only: after training, evaluate the final global model on the test set (test/* metrics)",
        )

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        sub = self.config.get("subcommand")
        config = self.config[sub] if sub else self.config
        for key in ("optimizer", "lr_scheduler"):
            value = config.get(key)
            if value is not None:
                raise ValueError(
                    f"{key}: LightningCLI's --{key} is refused by fedlightning (got {_class_name(value)}): the "
                    "FederatedLoop's optimizer is the SERVER step of the strategy, so it would silently replace it. "
                    "Set the client optimizer with model.client_optimizer (e.g. --model.client_optimizer="
                    "torch.optim.Adam --model.client_optimizer.lr=0.01) and the server step with a strategy in "
                    "trainer.callbacks (e.g. --trainer.callbacks+=fedlightning.callbacks.FedAdam "
                    "--trainer.callbacks.server_lr=0.01)."
                )
        trainer = config.get("trainer")
        if trainer is not None and hasattr(trainer, "get"):  # before Lightning's own, less precise error
            check_val_check_interval(trainer.get("val_check_interval"))
        seed = config.get("seed_everything")
        if seed is not None and not isinstance(seed, bool) and not 0 <= seed <= _MAX_SEED:
            raise SettingError(
                "seed_everything",
                f"seed_everything must be an integer in [0, {_MAX_SEED}] (numpy's "
                f"seed range) or true/false, got {seed!r}",
            )

    def _parse_ckpt_path(self) -> None:
        """Check an explicit ``--ckpt_path`` file before anything else reads it (replaces LightningCLI's reading of
        hyper-parameters from the checkpoint: a FederatedLoop saves none)."""
        sub = self.config.get("subcommand")
        if not sub:
            return
        path = self.config[sub].get("ckpt_path")
        if _is_local_file(path):
            checked = check_checkpoint(path, weights_only=self._weights_only(sub), resume=sub == "fit")
            self._checked = (os.fspath(path), checked)

    def _weights_only(self, sub: str) -> bool | None:
        """The subcommand's ``--weights_only`` (Lightning's argument of fit / validate / test / predict; None if the
        subcommand has none)."""
        return self.config[sub].get("weights_only")

    # ------------------------------------------------------------------ trainer
    def _instantiate_trainer(self, config, callbacks):
        from lightning.pytorch.callbacks import ModelCheckpoint

        if not config.get("plugins"):
            config["plugins"] = [AtomicCheckpointIO()]
        listed = list(config.get("callbacks") or []) + list(callbacks)
        from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(cb, ProgressBar) for cb in listed
        ):
            config["callbacks"] = list(config.get("callbacks") or []) + [RoundProgressBar()]
        added = None
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(cb, ModelCheckpoint) for cb in listed
        ):
            added = RoundCheckpoint(save_last=True, every_n_train_steps=self.checkpoint_every_n_rounds)
            config["callbacks"] = list(config.get("callbacks") or []) + [added]
        config["callbacks"] = list(config.get("callbacks") or []) + [
            StoreConfigCallback(self._config_dict()),
            self._rounds_run,
        ]
        trainer = super()._instantiate_trainer(config, callbacks)
        if added is not None and trainer.logger is None:
            claim = self.subcommand in (None, "fit") and trainer.is_global_zero  # launched DDP ranks: rank 0's
            added.dirpath = _next_version_dir(os.path.join(trainer.default_root_dir, "checkpoints"), create=claim)
            for cb in trainer.callbacks:  # config.yaml next to the run's checkpoints, not shared by every run
                if isinstance(cb, LogConfigCallback):
                    cb.run_folder = added.dirpath
        # with a logger: dirpath None = Lightning's default, the logger's version directory
        return trainer

    def _config_dict(self) -> dict[str, Any]:
        """The resolved config of this run's subcommand as plain data ({} before parsing finished)."""
        config = getattr(self, "config", None)
        if config is None:
            return {}
        sub = config.get("subcommand")
        try:
            return resolved_config(self._parser(sub), config[sub] if sub else config)
        except Exception:  # noqa: BLE001 - only used to name a key or to compare settings
            return config.clone().as_dict() if hasattr(config, "clone") else {}

    # ------------------------------------------------------------------ checkpoint resolution
    def before_fit(self) -> None:
        check_launcher(self.trainer)  # before ddp_spawn starts its processes
        self.model.compare_resumed_settings = False  # the stored config is compared instead (--resume_mismatch)
        self.model.log_module_hparams = False  # LogConfigCallback logs the whole config, the module's init_args in it
        self._prepare_checkpoint("fit")

    def before_validate(self) -> None:
        self._prepare_checkpoint("validate")

    def before_test(self) -> None:
        self._prepare_checkpoint("test")

    def before_predict(self) -> None:
        self._prepare_checkpoint("predict")

    def _prepare_checkpoint(self, sub: str) -> None:
        sub_config = self.config_init[sub]
        given = sub_config.get("ckpt_path")
        weights_only = self._weights_only(sub)
        path = given
        if given in _KEYWORDS:
            path = self._resolve_keyword(given, weights_only, resume=sub == "fit")
            sub_config["ckpt_path"] = path
        if given is None and sub != "fit" and getattr(self.model, "init_weights", None) is None:
            rank_zero_warn(
                f"{sub} without --ckpt_path evaluates the model as the config builds it, untrained; pass "
                "--ckpt_path last (this config's newest run), best, or a file to evaluate a trained model"
            )
        if not _is_local_file(path):
            return
        path = os.fspath(path)
        if self._checked is not None and self._checked[0] == path:
            ckpt = self._checked[1]
            check_fits_model(path, ckpt, self.model)
        else:
            ckpt = check_checkpoint(path, model=self.model, weights_only=weights_only, resume=sub == "fit")
        self._checked = None  # the trainer loads it again; do not keep a second copy in memory
        if sub != "fit":
            return
        saved = ckpt.get(CONFIG_KEY)
        if not isinstance(saved, dict):
            rank_zero_warn(
                f"checkpoint {path} stores no run configuration: its settings cannot be compared with this run's"
            )
            return
        diffs = config_differences(saved, self._config_dict())
        if not diffs:
            return
        if self.config[sub].get("resume_mismatch", "refuse") == "allow":
            rank_zero_warn(
                f"resuming from {path}, written with other settings (--resume_mismatch=allow):\n  " + "\n  ".join(diffs)
            )
            if any(d.startswith("trainer.callbacks") for d in diffs):  # the server strategy's settings, among others
                self.model.apply_server_settings_on_resume()
            return
        raise CheckpointError(
            path,
            f"written by a run with other settings ({len(diffs)} listed above); pass --resume_mismatch=allow to "
            "resume with this run's settings, or drop --ckpt_path to start a new run",
            details=diffs,
        )

    def _run_directories(self) -> tuple[list[str], str]:
        """The folders ``--ckpt_path last`` / ``best`` search (existing ones) and the base folder of this config's
        runs."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self.trainer
        if trainer.loggers:
            logger = trainer.loggers[0]
            save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            base = os.path.join(save_dir, str(logger.name))
            patterns = [
                os.path.join(glob.escape(base), "*", "checkpoints"),
                os.path.join(glob.escape(base), "checkpoints"),
            ]
        else:
            base = os.path.join(trainer.default_root_dir, "checkpoints")
            patterns = [os.path.join(glob.escape(base), "*"), glob.escape(base)]
        found = [d for p in patterns for d in sorted(glob.glob(p)) if os.path.isdir(d)]
        for cb in trainer.callbacks:
            if (
                isinstance(cb, ModelCheckpoint)
                and cb.dirpath is not None
                and not _is_version_dir_of(cb.dirpath, base)
                and os.path.isdir(cb.dirpath)
            ):
                found.append(os.fspath(cb.dirpath))
        return list(dict.fromkeys(os.path.abspath(d) for d in found)), base

    def _last_candidates(self) -> list[str]:
        """Every ``*.ckpt`` file in the searched folders (temporary ``.tmp-*`` files excluded)."""
        directories, _ = self._run_directories()
        files = {
            os.path.join(d, f)
            for d in directories
            for f in os.listdir(d)
            if f.endswith(".ckpt") and not f.startswith(TEMP_PREFIX) and os.path.isfile(os.path.join(d, f))
        }
        return sorted(files)

    def _resolve_keyword(self, keyword: str, weights_only: bool | None = None, resume: bool = False) -> str | None:
        """``last`` / ``best`` -> a file (see the class docstring): the newest complete checkpoint by round (``resume``:
        one that can resume training, weights-only files skipped)."""
        directories, base = self._run_directories()
        where = self._runs_description()
        inside = os.path.join(os.path.abspath(base), "")
        others = [d for d in directories if not os.path.join(d, "").startswith(inside)]  # a callback's own dirpath
        if others:
            where = f"{where} and {', '.join(others)}"
        removed = remove_interrupted_writes(directories)
        if removed:
            rank_zero_info(
                f"--ckpt_path {keyword}: removed {len(removed)} temporary file(s) of interrupted checkpoint "
                f"writes: {', '.join(removed)}"
            )
        candidates = self._last_candidates()
        readable: list[tuple[tuple[int, float, str], dict[str, Any]]] = []
        weights_only_files: list[str] = []
        for path in candidates:
            try:
                ckpt = check_checkpoint(path, weights_only=weights_only, mmap=True, resume=resume)
                readable.append(((checkpoint_round(ckpt), os.path.getmtime(path), path), ckpt))
            except CheckpointError as err:
                if err.unsafe_type is not None:
                    raise  # a file that could run code is refused, never passed over silently
                if err.weights_only:  # a ModelCheckpoint(save_weights_only=True) beside the full ones: one line
                    weights_only_files.append(path)
                    continue
                rank_zero_warn(f"--ckpt_path {keyword}: skipped {err.summary_line()}")
            except (ValueError, OSError) as err:
                rank_zero_warn(f"--ckpt_path {keyword}: skipped checkpoint {path}: {err}")
        if weights_only_files:
            rank_zero_info(
                f"--ckpt_path {keyword}: passed over {len(weights_only_files)} weights-only checkpoint(s), which "
                f"cannot resume training (e.g. {weights_only_files[-1]})"
            )
        newest: tuple[tuple[int, float, str], dict[str, Any]] | None = None
        for key, ckpt in sorted(readable, key=lambda entry: entry[0], reverse=True):
            try:  # the memory-mapped read above does not read the tensors' bytes: their checksums, newest first
                verify_checksums(key[2])
            except CheckpointError as err:
                rank_zero_warn(f"--ckpt_path {keyword}: skipped {err.summary_line()}")
                continue
            newest = (key, ckpt)
            break
        if keyword == "last":
            if newest is None and resume:
                rank_zero_warn(f"--ckpt_path last: no complete checkpoint found in {where}; starting from round 0")
                return None
            if newest is None:  # validate / test / predict would evaluate the untrained model
                raise CheckpointError(
                    f"last ({where})",
                    "no complete checkpoint of this config's runs found, nothing to evaluate; pass a file",
                )
            (round_, _, path), ckpt = newest
            rank_zero_info(
                f"--ckpt_path last: {'resuming from' if resume else 'evaluating'} {path} (round {round_}, the newest "
                f"complete of {len(candidates)} checkpoint file(s) in {where})"
            )
            self._checked = (path, ckpt)
            return path
        if newest is None:
            raise CheckpointError(f"best ({where})", "no complete checkpoint of this config's runs found; pass a file")
        (_, _, path), ckpt = newest
        kinds = _checkpoint_callback_names()
        for key, state in (ckpt.get("callbacks") or {}).items():
            if (
                str(key).split("{", 1)[0] in kinds
                and isinstance(state, dict)
                and state.get("monitor")
                and state.get("best_model_path")
            ):
                best = state["best_model_path"]
                rank_zero_info(f"--ckpt_path best: using {best} (best {state['monitor']}, recorded in {path})")
                return best
        raise CheckpointError(
            path,
            "--ckpt_path best: this newest checkpoint of the config's runs records no "
            "best model (the CLI's default checkpoint monitors no metric; add a "
            "ModelCheckpoint with a monitor to trainer.callbacks, or pass a file)",
        )

    def _runs_description(self) -> str:
        trainer = self.trainer
        if trainer.loggers:
            logger = trainer.loggers[0]
            save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            return os.path.join(save_dir, str(logger.name), "*", "checkpoints")
        return os.path.join(trainer.default_root_dir, "checkpoints")


# ====================================================================== helpers
def _checkpoint_callback_names() -> set[str]:
    """The class names of ``ModelCheckpoint`` and its subclasses (:class:`~fedlightning.checkpoint.RoundCheckpoint`
    and any a config imported): the prefixes of their state keys in a checkpoint (Lightning's ``state_key``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    names, todo = set(), [ModelCheckpoint]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _class_name(value: Any) -> str:
    if isinstance(value, dict) or hasattr(value, "get"):
        try:
            return str(value.get("class_path") or value)
        except Exception:  # noqa: BLE001
            pass
    return str(value)


def _is_local_file(path: Any) -> bool:
    if path is None or isinstance(path, bool):
        return False
    path = os.fspath(path)
    return path not in _KEYWORDS and path != "hpc" and "://" not in path and not path.startswith("registry:")


def _is_version_dir_of(dirpath, base: str) -> bool:
    return os.path.dirname(os.path.abspath(os.fspath(dirpath))) == os.path.abspath(base)


def _next_version_dir(base: str, create: bool = False) -> str:
    """``<base>/version_<N>`` with the next free ``N``. With ``create`` the folder is made here, when the Trainer is
    built: a run that starts before this one's first save (which would make it otherwise) then takes the next
    number instead of writing its checkpoints into the same folder; ``os.mkdir`` fails for all but one of runs that
    race for a number."""
    versions = []
    if os.path.isdir(base):
        for name in os.listdir(base):
            m = re.fullmatch(r"version_(\d+)", name)
            if m and os.path.isdir(os.path.join(base, name)):
                versions.append(int(m.group(1)))
    n = max(versions) + 1 if versions else 0
    while create:
        try:
            os.makedirs(base, exist_ok=True)
            os.mkdir(os.path.join(base, f"version_{n}"))
            break
        except FileExistsError:
            n += 1
    return os.path.join(base, f"version_{n}")


def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in out and len(out) < 50:
        out.append(e)
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return out


def _frames(err: BaseException) -> list[Any]:
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _raised_in_package(err: BaseException) -> bool:
    frames = _frames(err)
    return bool(frames) and os.path.abspath(frames[-1].f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        return None


def _class_nodes(config: Any, path: str = "") -> list[tuple[str, Any, dict[str, Any]]]:
    """(config key, class, its arguments) for every ``class_path`` node of ``config``, plus ``model``
    (the FederatedLoop) and ``trainer``."""
    nodes: list[tuple[str, Any, dict[str, Any]]] = []
    if not path and isinstance(config, dict):
        from lightning.pytorch import Trainer

        if isinstance(config.get("model"), dict):
            nodes.append(("model", FederatedLoop, config["model"]))
        if isinstance(config.get("trainer"), dict):
            nodes.append(("trainer", Trainer, config["trainer"]))
    if isinstance(config, dict):
        if isinstance(config.get("class_path"), str):
            cls = _import(config["class_path"])
            if cls is not None:
                nodes.append((f"{path}.init_args" if path else "init_args", cls, config.get("init_args") or {}))
        for key, value in config.items():
            nodes += _class_nodes(value, f"{path}.{key}" if path else str(key))
    elif isinstance(config, list):
        for i, value in enumerate(config):
            nodes += _class_nodes(value, f"{path}[{i}]")
    return nodes


#: Words for an argument in the messages of ``torch.optim``'s constructors, and the argument.
_ARGUMENT_PHRASES = (("learning rate", "lr"), ("epsilon value", "eps"), ("beta parameter", "betas"))


def _config_key(err: BaseException, config: dict[str, Any]) -> str | None:
    """The config key of the argument the error is about, from the innermost frame of a method of an object the
    config names (its constructor, or a later method such as a data module's ``setup`` or the loop's): that class's
    key plus the one argument of it the message names, or, of several, the one the message starts with (Lightning's
    "`val_check_interval` should be ... when `check_val_every_n_epoch=None`"). Frames that name no single argument are
    passed over, except a constructor's, which gives the class's key."""
    nodes = _class_nodes(config)
    message = str(err)
    for frame in reversed(_frames(err)):
        if "self" not in frame.f_locals:
            continue
        owner = type(frame.f_locals["self"])
        for key, cls, args in nodes:
            if cls is owner:
                found = {a: re.search(rf"(?<![\w.]){re.escape(str(a))}(?!\w)", message) for a in args}
                named = sorted((a for a, m in found.items() if m), key=lambda a: found[a].start())
                if not named:  # torch.optim's messages name some arguments in words ("Invalid learning rate: -0.1")
                    named = [a for phrase, a in _ARGUMENT_PHRASES if a in args and phrase in message]
                if isinstance(err, FileNotFoundError) and "data_dir" in args:
                    named = ["data_dir"]  # a data module's missing file: the folder it reads
                if len(named) == 1 or (named and message.lstrip("`'\"").startswith(str(named[0]))):
                    return f"{key}.{named[0]}"
                if frame.f_code.co_name == "__init__":
                    return key.rsplit(".init_args", 1)[0]
                break
    return None


def _config_error_line(err: BaseException, config: dict[str, Any]) -> str | None:
    """``<config key>: <message>`` for the first ValueError / TypeError / FileNotFoundError (a data module's missing
    files; or Lightning's ``MisconfigurationException``) in the exception chain raised by fedlightning's code or by a
    class the config names; None for any other error. The message is that error's; the key is found on it or, when
    it is a wrapper (``client_optimizer cannot be built: ...``), on the errors it chains (:func:`_config_key`)."""
    chain = [
        e for e in _chain(err) if isinstance(e, (ValueError, TypeError, MisconfigurationException, FileNotFoundError))
    ]
    for i, e in enumerate(chain):
        if isinstance(e, CheckpointError):
            return e.summary_line()
        message = " ".join(str(e).split())
        if isinstance(getattr(e, "config_key", None), str):  # fedlightning._validation.SettingError
            return f"{e.config_key}: {message}"
        key = _config_key(e, config) if config else None
        if not (_raised_in_package(e) or key is not None):
            continue
        for inner in chain[i + 1 :]:  # a chained error may name the argument more precisely
            found = getattr(inner, "config_key", None) or (_config_key(inner, config) if config else None)
            if found is not None and (key is None or found.startswith(key + ".")):
                key = found
        if key is not None and not message.startswith(key):
            return f"{key}: {message}"
        return message
    return None


# ====================================================================== parser errors in one line
#: Parameters renamed in this project's history (a name that meant different things in different classes was
#: split): (class path, old name) -> the message. jsonargparse only says "Option 'c' is not accepted".
_RENAMED: dict[tuple[str, str], str] = {
    ("fedlightning.optim.SPS", "c"): "SPS's c is now polyak_c",
    ("fedlightning.optim.SPS", "lr"): "SPS takes no lr: its step is the Polyak step (a fixed step for FedSPS-Global "
    "clients is fixed_step_size)",
    ("fedlightning.callbacks.FedAdagrad", "eps"): "FedAdagrad's eps is now tau",
    ("fedlightning.callbacks.FedAdam", "eps"): "FedAdam's eps is now tau",
    ("fedlightning.callbacks.FedYogi", "eps"): "FedYogi's eps is now tau",
    ("fedlightning.callbacks.FedAMS", "eps"): "FedAMS's eps is now ams_eps",
    ("fedlightning.callbacks.FedLiLU", "eps"): "FedLiLU's eps is now dfw_eps",
}

#: Union alternatives that never explain a failure: the "path to a config file" reading of any value, the generic
#: subclass hint and ``None``.
_UNINFORMATIVE = (
    "Expected a path but",
    "Not a valid subclass of",
    "Expected a <class 'NoneType'>",
    "Expected a dot import path string",
)
#: jsonargparse's list of the forms a subclass argument may take (a hint, not a reason).
_HINTS = ("Subclass types expect", "a class path (str)", "a dict with", "a dict without")


class _Node:
    """One line of a jsonargparse error message and the lines indented under it."""

    __slots__ = ("text", "children")

    def __init__(self, text: str) -> None:
        self.text = text
        self.children: list[_Node] = []

    def all_text(self) -> str:
        return "\n".join([self.text] + [c.all_text() for c in self.children])


def _message_tree(message: str) -> list[_Node]:
    """jsonargparse's nested message as a tree by indentation (a ``- `` bullet's text without the dash)."""
    roots: list[_Node] = []
    stack: list[tuple[int, _Node]] = []
    for raw in message.splitlines():
        text = raw.strip()
        if not text:
            continue
        indent = len(raw) - len(raw.lstrip())
        node = _Node(text[2:] if text.startswith("- ") else text)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        (stack[-1][1].children if stack else roots).append(node)
        stack.append((indent, node))
    return roots


def _type_phrase(spec: str) -> str:
    """``<class 'float'>`` -> ``a float``; ``typing.Literal['a', 'b']`` -> ``one of 'a', 'b'``."""
    spec = spec.strip()
    lit = re.fullmatch(r"typing\.Literal\[(.*)\]", spec)
    if lit:
        return f"one of {lit.group(1)}"
    cls = re.fullmatch(r"<class '([\w.]+)'>", spec)
    name = cls.group(1) if cls else spec
    short = {
        "NoneType": "null",
        "bool": "a bool (true/false)",
        "int": "an int",
        "float": "a float",
        "str": "a string",
        "list": "a list",
        "dict": "a mapping",
        "collections.abc.Sequence": "a list",
    }
    if name in short:
        return short[name]
    return f"a {name.rsplit('.', 1)[-1]}"


def _join_or(items: list[str]) -> str:
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _value_text(raw: str) -> str:
    """A value from jsonargparse's message as the user wrote it (YAML-typed: ``'high'``, ``1.5``)."""
    raw = raw.split(". Got value: ", 1)[0].strip()
    if raw == "None":
        return "null"
    try:
        import yaml

        value = yaml.safe_load(raw)
    except Exception:  # noqa: BLE001 - shown as text
        value = raw
    return repr(value) if isinstance(value, (str, int, float, bool)) or value is None else raw


def _closest(word: str, choices: list[str]) -> str | None:
    """The valid name ``word`` most likely stands for: one it abbreviates, else difflib's closest (cutoff 0.6)."""
    choices = sorted(set(c for c in choices if c))
    prefixed = [c for c in choices if c.startswith(word) and c != word]
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(word, choices, n=1)
    if close:
        return close[0]
    lower: dict[str, str] = {}
    for c in choices:  # case apart (Sgd -> SGD)
        lower.setdefault(c.lower(), c)
    close = difflib.get_close_matches(word.lower(), list(lower), n=1)
    return lower[close[0]] if close else None


def _parameters(class_path: str | None) -> tuple[str, list[str]]:
    """(class name, accepted init argument names) of a class the config names."""
    cls = _import(class_path) if class_path else None
    if cls is None:
        return (class_path or "").rsplit(".", 1)[-1], []
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls.__name__, []
    return cls.__name__, [
        n for n, p in params.items() if n not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


class _ParserError:
    """The config key and one-line message of a jsonargparse parsing error (see :func:`_parser_error_line`)."""

    def __init__(self, known_keys: list[str]) -> None:
        self.known_keys = known_keys
        self.path: list[str] = []
        self.class_path: str | None = None
        self.in_class = False
        self.given: str | None = None
        self.message: str | None = None

    # ---------------------------------------------------------------- the key
    def add_key(self, key: str) -> None:
        if self.in_class:
            self.path.append("init_args")
            self.in_class = False
        self.path.append(key)

    def enter_class(self, class_path: str | None) -> None:
        self.class_path = class_path
        self.in_class = True
        given = self.given or ""
        if class_path and self.path and given.startswith("["):  # a list of classes: name the item
            listed = re.findall(r"""class_path['"]?[:=]\s*['"]([^'"]+)['"]""", given)
            if listed.count(class_path) == 1:
                self.path[-1] += f"[{listed.index(class_path)}]"

    def key(self) -> str:
        return ".".join(self.path) or "config"

    # ---------------------------------------------------------------- leaves
    def expected(self, types: list[str], value: str | None) -> None:
        literals = [
            v.strip()
            for t in types
            for m in [re.fullmatch(r"typing\.Literal\[(.*)\]", t.strip())]
            if m
            for v in m.group(1).split(",")
        ]
        phrases = [_type_phrase(t) for t in types if "NoneType" not in t and "Literal[" not in t]
        if literals:
            phrases.insert(0, f"one of {', '.join(dict.fromkeys(literals))}")
        if any("NoneType" in t for t in types) or not phrases:
            phrases.append("null")
        got = "" if value is None else f", got {_value_text(value)}"
        self.message = f"expected {_join_or(phrases)}{got}"

    def unknown_option(self, name: str) -> None:
        if self.in_class:
            self.add_key(name)
            owner = self.class_path
            for (path, old), text in _RENAMED.items():
                if old == name and owner and _import(path) is not None and _import(path) is _import(owner):
                    self.message = text
                    return
            cls_name, accepted = _parameters(owner)
            close = _closest(name, accepted)
            self.message = f"{cls_name} has no argument {name!r}" + (
                f" (did you mean {close}?)" if close else f"; it accepts {', '.join(accepted)}" if accepted else ""
            )
            return
        self.path.extend(name.split("."))
        self.message = _unknown_key_message(".".join(self.path), self.known_keys)

    def missing_class(self, module: str, name: str) -> None:
        self.path.append("class_path")
        self.in_class = False
        try:
            found = importlib.import_module(module)
            names = [n for n in dir(found) if not n.startswith("_") and isinstance(getattr(found, n, None), type)]
        except Exception:  # noqa: BLE001
            names = []
        close = _closest(name, names)
        self.message = f"{module}.{name} does not exist (module {module} has no {name!r}" + (
            f"; did you mean {module}.{close}?)" if close else ")"
        )

    def other(self, text: str) -> None:
        self.message = " ".join(text.split())

    # ---------------------------------------------------------------- walking the message
    def walk_list(self, nodes: list[_Node]) -> bool:
        for n in nodes:
            if n.text.startswith("Given value: "):
                self.given = n.text[len("Given value: ") :]
        errors = next((n for n in nodes if n.text == "Errors:"), None)
        if errors is not None and any(n.text.startswith("Does not validate against any") for n in nodes):
            scored = [(self._score(b), i, b) for i, b in enumerate(errors.children)]
            best = max(scored, key=lambda s: (s[0], -s[1]))
            if best[0] > 0:
                return self.walk(best[2].text, best[2].children)
            types = [
                m.group(1)
                for b in errors.children
                for m in [re.fullmatch(r"Expected a (.+?)(?:\. Got value: .*)?", b.text)]
                if m and not b.text.startswith(_UNINFORMATIVE[-1])
            ]
            self.expected(types, self.given)
            return True
        ranked = sorted(enumerate(nodes), key=lambda t: (-self._score(t[1]), t[0]))
        for _, n in ranked:
            if n.text.startswith(
                ("Given value", "Subtypes:", "Errors:", "Expected a path but", "Expected a dot import path string")
                + _HINTS
            ):
                continue
            if self.walk(n.text, n.children):
                return True
        return False

    @staticmethod
    def _score(node: _Node) -> int:
        text = node.all_text()
        if node.text.startswith("Not a valid subclass of") and ". Got value: " in node.text:
            return 1  # names the value that is not a class
        if node.text.startswith(_UNINFORMATIVE + _HINTS):
            return 0
        if re.search(r"class_path '(lightning\.|lightning\.pytorch\.)?Callback'", text):
            return 1  # the base class's reading of a subclass argument
        if re.search(
            r'Parser key "|Problem with given class_path|callable class:|is not accepted|'
            r"has no attribute|No module named|are required",
            text,
        ):
            return 3
        if node.text.startswith("Expected a "):
            return 0
        return 2

    def walk(self, text: str, children: list[_Node]) -> bool:
        m = re.match(r'Parser key "([^"]+)":\s*(.*)$', text)
        if m:
            self.add_key(m.group(1))
            return self.walk(m.group(2), children) if m.group(2) else self.walk_list(children)
        m = re.match(r"Problem with given class_path '([^']+)':\s*(.*)$", text)
        if m:
            self.enter_class(m.group(1))
            return self.walk(m.group(2), children) if m.group(2) else self.walk_list(children)
        m = re.match(r".*? expects a function or a callable class:\s*(.*)$", text)
        if m:
            found = re.search(r"class_path='([^']+)'", "\n".join([text] + [c.all_text() for c in children]))
            self.enter_class(found.group(1) if found else None)
            return self.walk(m.group(1), children) if m.group(1) else self.walk_list(children)
        m = re.match(r"Option '([^']+)' is not accepted", text)
        if m:
            self.unknown_option(m.group(1))
            return True
        m = re.match(r"(Group|Subcommand) '([^']+)' does not accept option '([^']+)'", text)
        if m:
            if m.group(1) == "Group":
                self.path.append(m.group(2))
            self.unknown_option(m.group(3))
            return True
        m = re.match(r"Expected a (.+?)\. Got value: (.*)$", text)
        if m:
            self.expected([m.group(1)], m.group(2))
            return True
        m = re.match(r"Not a valid subclass of (\S+?)(?:\. Got value: (.*))?$", text)
        if m:
            got = f", got {_value_text(m.group(2))}" if m.group(2) is not None else ""
            self.message = f"expected a subclass of {m.group(1)} (a class_path with its init_args){got}"
            return True
        m = re.match(r"module '([^']+)' has no attribute '([^']+)'", text)
        if m:
            self.missing_class(m.group(1), m.group(2))
            return True
        m = re.match(r"No module named '([^']+)'", text)
        if m:
            self.path.append("class_path")
            self.in_class = False
            self.message = f"cannot import {_value_text(self.class_path or self.given or m.group(1))}: {text}"
            return True
        m = re.match(r"the following arguments are required: (.+)$", text)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            self.add_key(names[0])
            owner = (self.class_path or "").rsplit(".", 1)[-1]
            self.message = (
                f"{owner} needs {', '.join(names)} (not given)"
                if owner
                else f"required, not given ({', '.join(names)})"
            )
            return True
        if children:
            if self.walk_list(children):
                return True
        if text:
            self.other(text)
            return True
        return False


def _unknown_key_message(key: str, known_keys: list[str]) -> str:
    """``unknown option ...; did you mean ...?`` for a key no parser knows (the closest sibling key, else the
    closest key)."""
    prefix, _, last = key.rpartition(".")
    siblings = [k[len(prefix) + 1 :].split(".")[0] for k in known_keys if prefix and k.startswith(prefix + ".")]
    close = _closest(last, siblings) if siblings else None
    if not siblings:  # the prefix itself is unknown (trainr.max_steps): name the whole key
        last = key
    if close is None:
        close = _closest(key, known_keys)
    if close is not None and close.startswith(last) and close != last:
        # a prefix of a valid key: a typo in a file reads the same as an abbreviation on the command line
        return f"unknown option {last!r} (did you mean {close}? abbreviated options are not accepted)"
    return f"unknown option {last!r}" + (f" (did you mean {close}?)" if close else "")


def _known_keys(cli: Any) -> list[str]:
    """Every option key of the CLI's parsers (``model.local_steps``, ``trainer.max_steps``, ``data``, ...)."""
    parsers = [getattr(cli, "parser", None)] + list(getattr(cli, "_subcommand_parsers", {}).values())
    keys = {a.dest for p in parsers if p is not None for a in p._actions}
    return sorted(k for k in keys if k and k not in ("help", argparse.SUPPRESS))


def _yaml_problem(args: list[str] | None) -> str | None:
    """``<file>: <YAML problem> (line L, column C)`` for the first ``--config`` file that is not valid YAML."""
    import yaml

    argv = list(sys.argv[1:] if args is None else args)
    files = []
    for i, a in enumerate(argv):
        if a in ("-c", "--config") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif a.startswith("--config="):
            files.append(a.split("=", 1)[1])
    for path in files:
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            return f"{path}: not valid YAML: {err.problem or err.context}{where}"
        except (OSError, yaml.YAMLError):
            continue
    return None


def _parser_error_line(err: argparse.ArgumentError, cli: Any, args: list[str] | None = None) -> str:
    """``<config key>: <message naming the value>``: a jsonargparse parsing error in one line (ours).

    jsonargparse nests its message by config level and lists every alternative of each ``Union``; the line keeps
    the innermost key (``data.init_args.partition.init_args.alpha``, class levels spelled ``init_args`` as in a
    YAML file, a list item as ``[i]`` when known) and the reason: the expected type and the given value, a class
    that does not exist (with the closest name in its module), an argument a class does not take (a renamed one
    says its new name, :data:`_RENAMED`; otherwise the closest accepted name), an unknown or abbreviated option
    (the closest valid key), a file that is not valid YAML (file, line, column).
    """
    message = str(err)
    known = _known_keys(cli)
    first = message.strip().splitlines()[0] if message.strip() else ""
    m = re.match(r"unrecognized arguments: (.*)$", first)
    if m:
        tokens = m.group(1).split()
        opts = [t for t in tokens if t.startswith("-")]
        if not opts:
            return f"command line: unexpected argument(s) {' '.join(tokens)!r}"
        key = opts[0].lstrip("-").split("=", 1)[0]
        return f"{key}: {_unknown_key_message(key, known)}"
    m = re.match(r"argument (-*[\w.\[\]-]+)(?:/[^:]*)?: (.*)$", first)
    if m:
        return f"{m.group(1).lstrip('-')}: {' '.join(m.group(2).split())}"
    m = re.match(r'expected "([^"]+)" to be one of \{([^}]*)\}', first)
    if m:
        return f"{m.group(1)}: not given (one of {', '.join(m.group(2).split(','))})"
    m = re.match(r"the following arguments are required: (.+)$", first)
    if m:
        names = [re.sub(r"^(fit|validate|test|predict)\.", "", n.strip()) for n in m.group(1).split(",")]
        return f"{names[0]}: required, not given" + (f" (nor {', '.join(names[1:])})" if names[1:] else "")
    if first.startswith("Problems parsing config"):
        problem = _yaml_problem(args)
        return f"config: {problem}" if problem else "config: " + " ".join(message.split())
    m = re.match(r"""Key "([^"]+)" is required""", first)
    if m:
        return f"{m.group(1)}: required, not given"
    m = re.match(r"Option '([^']+)' is not accepted", first)
    if m:
        return f"{m.group(1)}: {_unknown_key_message(m.group(1), known)}"
    state = _ParserError(known)
    if not state.walk_list(_message_tree(message)) or state.message is None:
        return "config: " + " ".join(first.split())
    return f"{state.key()}: {state.message}"


def _none_as_null(args: list[str]) -> list[str]:
    """The command line with a value written ``None`` (``--key=None``, ``--key None``) as YAML's ``null``: what
    Python prints for a null, and what W&B's agent writes for a sweep parameter's ``null`` value (``str(value)``).
    jsonargparse reads it as the string ``'None'``, which a nullable number or class refuses."""
    out = list(args)
    for i, token in enumerate(out):
        if token.startswith("--") and token.endswith("=None"):
            out[i] = token[: -len("None")] + "null"
        elif token == "None" and i > 0 and out[i - 1].startswith("--") and "=" not in out[i - 1]:
            out[i] = "null"
    return out


def main(args: list[str] | None = None, run: bool = True) -> FederatedCLI:
    """Run the CLI (``train.py``). A configuration error (see below) prints its details and a last
    line ``error: <config key>: <message>`` to stderr and raises ``SystemExit(1)`` (its ``__cause__`` is the original
    exception), unless the environment variable ``FEDLIGHTNING_TRACEBACK`` is set to a non-empty value other than
    ``0``: then the original exception is raised (a parsing error as jsonargparse's ``argparse.ArgumentError`` with
    its full message; the one line is its ``fedlightning_error_line``).

    **Configuration errors** (ours; docs/reliability.md lists examples), all before the first round of the process:

    * a parsing error (the parser does not exit, :meth:`FederatedCLI.init_parser`), reduced by
      :func:`_parser_error_line` to the innermost key and the reason (expected type and given value, a missing class
      with the closest name, a renamed argument with its new name, an unknown or abbreviated key with the closest
      valid one, a YAML error with its line);
    * a ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` / Lightning ``MisconfigurationException`` raised by
      fedlightning's code (a data module's missing files: its ``data_dir``) or by a class the config names (found
      through jsonargparse's wrapping via ``__cause__`` / ``__context__``); the key
      is a :class:`~fedlightning._validation.SettingError`'s ``config_key`` (the trainer and learning-rate checks
      of ``FederatedLoop.setup``), else the class of the innermost frame of an object the config names plus the one
      argument of it the message names (:func:`_config_key`).

    A run stopped by SIGTERM (preemption; Lightning stops at the next round boundary) exits with status
    :data:`SIGTERM_EXIT_STATUS` (143, the shell's status of a process ended by SIGTERM) and a last line saying so,
    not with Lightning's status 0.

    An error after the first round of the process trained keeps its traceback (it is rarely a configuration error,
    and re-running to see it is expensive); so do errors of any other type or origin.
    """
    default_wandb_offline()
    from_argv = args is None
    if from_argv:
        args = sys.argv[1:]
    if isinstance(args, (list, tuple)):
        args = _none_as_null([str(a) for a in args])
    try:
        with warnings.catch_warnings():
            if from_argv:  # the command line itself, rewritten (null): not the mix Lightning warns about
                warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
            cli = FederatedCLI(args=args, run=run)
        if from_argv:  # the command line's process ends here: its process group with it (release_process_group)
            release_process_group()
        return cli
    except SIGTERMException as err:
        # Lightning stops at the next round boundary and raises a SystemExit without a code, i.e. exit status 0: a
        # restart loop (`until python train.py ...; do ...`) would take a preempted run for a finished one
        sys.stderr.write(
            "stopped: the run received SIGTERM and stopped at a round boundary; RoundCheckpoint saved its last "
            "completed round as last.ckpt: resume with --ckpt_path last\n"
        )
        sys.stderr.flush()
        raise SystemExit(SIGTERM_EXIT_STATUS) from err
    except (ValueError, TypeError, MisconfigurationException, FileNotFoundError, argparse.ArgumentError) as err:
        line = getattr(err, "fedlightning_error_line", None)
        if line is None or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        details = getattr(err, "details", None) or []
        for d in details:
            sys.stderr.write(f"  {d}\n")
        full = "jsonargparse's full message" if isinstance(err, argparse.ArgumentError) else "the full traceback"
        sys.stderr.write(f"(set {TRACEBACK_ENV}=1 for {full})\nerror: {line}\n")
        sys.stderr.flush()
        raise SystemExit(1) from err


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
