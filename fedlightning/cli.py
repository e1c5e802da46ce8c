"""LightningCLI for federated runs (``train.py``).

``python train.py fit --config configs/quickstart.yaml [--model.local_steps 10 ...]``

* ``model`` is always a :class:`~fedlightning.FederatedLoop`; the user's LightningModule goes in
  ``model.model`` (``class_path`` + ``init_args``).
* ``data`` is any :class:`~fedlightning.datamodules.FederatedDataModule` subclass.
* Weights & Biases runs offline unless the user configured it (``WANDB_MODE`` or an API key / ``wandb login``),
  so no run ever blocks on the network.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from lightning.pytorch.cli import LightningCLI

from fedlightning.datamodules.base import FederatedDataModule
from fedlightning.loop import FederatedLoop

__all__ = ["FederatedCLI", "main"]


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    try:
        with open(netrc) as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


class FederatedCLI(LightningCLI):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(FederatedLoop, FederatedDataModule, *args, **kwargs)


def main(args: Optional[List[str]] = None, run: bool = True) -> FederatedCLI:
    if not _wandb_configured():
        os.environ["WANDB_MODE"] = "offline"
    return FederatedCLI(args=args, run=run)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
