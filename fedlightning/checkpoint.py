"""Atomic checkpoint writing, and one clear error for every checkpoint that cannot resume a run.

* :class:`AtomicCheckpointIO`: write to a temporary file, then ``os.replace`` it over the target, so a checkpoint
  path always holds either the old or the new complete checkpoint (the FederatedCLI installs it by default).
* :func:`check_checkpoint`: one :class:`CheckpointError` (``checkpoint <path>: ...``) naming why a file cannot be
  used (missing, empty, corrupt, not a FederatedLoop checkpoint, weights that do not fit the model).
* :class:`StoreConfigCallback` / :func:`config_differences`: the run's resolved CLI configuration stored in every
  checkpoint (``CONFIG_KEY``) and the training-relevant settings in which two configurations differ.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "CheckpointError", "check_checkpoint", "StoreConfigCallback",
           "config_differences", "CONFIG_KEY", "FEDLIGHTNING_FORMAT"]

CONFIG_KEY = "fedlightning_config"
FEDLIGHTNING_FORMAT = 1  #: the ``format`` number FederatedLoop writes into the checkpoint's ``fedlightning`` section
_LIST_AT_MOST = 5


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message starts with ``checkpoint <path>:``."""

    def __init__(self, path, problem: str, details: Optional[List[str]] = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.details = list(details or [])
        super().__init__(self.summary_line() + ("".join(f"\n  {d}" for d in self.details)))

    def summary_line(self) -> str:
        """``checkpoint <path>: <problem>`` without the details (the CLI prints those on the lines above)."""
        return f"checkpoint {self.path}: {self.problem}"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes.

    **Atomic writes.** Lightning's default checkpoint IO writes the file in place: a process killed during
    ``save_checkpoint`` leaves a truncated file that replaces the previous good one. :class:`AtomicCheckpointIO` writes
    to a temporary file in the same directory, flushes it to disk, then ``os.replace``s it over the target (atomic on
    POSIX), so a checkpoint path always holds either the old or the new complete checkpoint. The FederatedCLI installs
    it by default.
    """

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        path = os.fspath(path)
        if "://" in path:  # remote file systems: fall back to Lightning's writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ckpt", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load_checkpoint(self, path, map_location: Optional[Callable] = lambda storage, loc: storage, weights_only=None) -> Dict[str, Any]:
        path = os.fspath(path)
        if "://" not in path and not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=False)
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"checkpoint {path} is corrupt, truncated or not a checkpoint: {err}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    if not text:
        return type(err).__name__
    first = text[0].split(". ")[0]  # the first sentence: torch's reader errors go on with generic advice
    return f"{type(err).__name__}: {first}"


def _listed(items: List[str]) -> str:
    more = len(items) - _LIST_AT_MOST
    return ", ".join(items[:_LIST_AT_MOST]) + (f" (and {more} more)" if more > 0 else "")


def check_checkpoint(path, model: Optional[torch.nn.Module] = None) -> Dict[str, Any]:
    """Load ``path`` on the CPU and return the checkpoint, or raise :class:`CheckpointError` naming the problem
    (listed below). With ``model`` (the :class:`~fedlightning.FederatedLoop` the run will load it into),
    the checkpoint's ``state_dict`` must have exactly the model's keys and shapes.

    **Checking a checkpoint before Lightning reads it.** :func:`check_checkpoint` opens a file and raises one
    :class:`CheckpointError` (a ``ValueError``) whose message starts with ``checkpoint <path>:`` and names the problem:

    * the file does not exist, is a directory, or is empty;
    * ``torch.load`` cannot read it (truncated, random bytes, another format): "corrupt, truncated or not a checkpoint";
    * it is not a Lightning checkpoint (no ``state_dict`` mapping);
    * it is a Lightning checkpoint of another LightningModule (no ``fedlightning`` section, which
      :meth:`~fedlightning.FederatedLoop.on_save_checkpoint` writes) or of an unknown ``fedlightning`` format;
    * with ``model=``: its ``state_dict`` does not fit the model (missing / unexpected keys, different shapes: another
      architecture), listing up to 5 of each (ours).

    The file is loaded with ``weights_only=False``, exactly as :class:`AtomicCheckpointIO` (and so the Trainer) loads it
    afterwards: only hand the CLI checkpoints you trust. Remote paths (``scheme://``) are not checked here (ours: opening
    them costs a download); Lightning reads them as usual.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(path, "file not found")
    if os.path.isdir(path):
        raise CheckpointError(path, "is a directory, not a checkpoint file")
    if os.path.getsize(path) == 0:
        raise CheckpointError(path, "the file is empty (0 bytes): corrupt, truncated or not a checkpoint")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any reader failure means the same thing to the user
        raise CheckpointError(path, f"corrupt, truncated or not a checkpoint ({_first_line(err)})") from err
    if not isinstance(ckpt, Mapping) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(path, "not a Lightning checkpoint (no 'state_dict'); pass a .ckpt file a fedlightning "
                                    "run wrote")
    fed = ckpt.get("fedlightning")
    if not isinstance(fed, Mapping):
        raise CheckpointError(path, "a Lightning checkpoint of another LightningModule, not of a FederatedLoop (no "
                                    "'fedlightning' section): it cannot resume a federated run")
    if fed.get("format") != FEDLIGHTNING_FORMAT:
        raise CheckpointError(path, f"unsupported fedlightning checkpoint format {fed.get('format')!r} (this version "
                                    f"reads format {FEDLIGHTNING_FORMAT})")
    if model is not None:
        _check_state_dict(path, ckpt["state_dict"], model.state_dict())
    return ckpt


def _check_state_dict(path: str, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and hasattr(saved[k], "shape") and hasattr(expected[k], "shape")
        and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if shapes:
        parts.append(f"different shapes (checkpoint vs model): {_listed(shapes)}")
    if missing:
        parts.append(f"missing in the checkpoint: {_listed(missing)}")
    if unexpected:
        parts.append(f"not in the model: {_listed(unexpected)}")
    raise CheckpointError(path, "its weights do not fit the configured model (another architecture?): "
                                + "; ".join(parts))


# ====================================================================== the configuration stored in checkpoints
class StoreConfigCallback(Callback):
    """Adds ``config`` (the resolved CLI configuration, plain data) to every checkpoint as ``checkpoint[CONFIG_KEY]``.

    A top-level key rather than callback state (``state_dict``): resuming must not overwrite the new run's config.
    """

    def __init__(self, config: Dict[str, Any]):
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config


def _flatten(value: Any, prefix: str, out: Dict[str, Any]) -> None:
    if isinstance(value, Mapping):  # an empty mapping adds no key: ``init_args: {}`` equals no init_args
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def _compared(config: Mapping[str, Any]) -> Dict[str, Any]:
    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
    if isinstance(callbacks, Mapping):
        callbacks = [callbacks]
    callbacks = [cb for cb in (callbacks or [])
                 if not (isinstance(cb, Mapping) and str(cb.get("class_path", "")).startswith("lightning."))]
    out: Dict[str, Any] = {}
    for key in ("model", "data", "seed_everything"):
        _flatten(config.get(key), key, out)
    _flatten(callbacks, "trainer.callbacks", out)
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """``"key: checkpoint <a> -> now <b>"`` for every compared setting that differs.

    **Stored configuration.** :class:`StoreConfigCallback` adds the run's resolved CLI configuration to every checkpoint
    under the top-level key ``fedlightning_config`` (the key :data:`CONFIG_KEY`); :func:`config_differences` lists the
    settings that decide the training trajectory (``model``, ``data``, ``seed_everything`` and the non-Lightning
    ``trainer.callbacks``: strategies, schedules, telemetry) in which two such configurations differ. Every other
    ``trainer`` setting (``max_steps`` included: extending a run is normal; devices, logger, validation interval) is
    not compared (ours).
    """
    a, b = _compared(saved), _compared(current)
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            fa = "(not set)" if va is missing else repr(va)
            fb = "(not set)" if vb is missing else repr(vb)
            lines.append(f"{key}: checkpoint {fa} -> now {fb}")
    return lines
