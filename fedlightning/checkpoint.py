"""Atomic checkpoint writing and clear errors for unreadable checkpoints.

Lightning's default checkpoint IO writes the file in place: a process killed during ``save_checkpoint`` leaves a
truncated file that replaces the previous good one. :class:`AtomicCheckpointIO` writes to a temporary file in the
same directory, flushes it to disk, then ``os.replace``s it over the target (atomic on POSIX), so a checkpoint
path always holds either the old or the new complete checkpoint. The FederatedCLI installs it by default.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
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
