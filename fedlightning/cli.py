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
    """LightningCLI with federated defaults.

    * checkpoints are written atomically (:class:`~fedlightning.checkpoint.AtomicCheckpointIO`) unless the config
      sets ``trainer.plugins``;
    * when checkpointing is enabled and the config has no ``ModelCheckpoint``, one is added that saves
      ``last.ckpt`` every ``checkpoint_every_n_rounds`` rounds (default 10, ours) into a version-independent
      directory ``<logger save_dir>/<logger name>/checkpoints`` (or ``<default_root_dir>/checkpoints``), so an
      interrupted run resumes with ``python train.py fit --config X --ckpt_path last``.
    """

    checkpoint_every_n_rounds = 10

    #: After ``fit``, evaluate the final global model on the test set with ``trainer.test`` (the model's
    #: ``test_step`` logs and prints ``test/*``). Default True (ours: ``fit`` otherwise reports only the validation
    #: split). Switch off per run with ``python train.py fit ... --test_after_fit false``, or for a subclass by
    #: setting this attribute to False (the option's default).
    test_after_fit = True

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=self.test_after_fit,
            help="fit only: after training, evaluate the final global model on the test set (test/* metrics)",
        )

    def after_fit(self) -> None:
        """``trainer.test`` on the final global model (the weights in memory, not a checkpoint) and the same data
        module, when ``test_after_fit`` is on. LightningCLI calls it only after ``fit`` returned normally (Ctrl-C or
        an error ends the process first). Skipped, with a warning, when the data module has no test set.
        ``trainer.test`` starts from empty ``trainer.callback_metrics``; the fit's last values (``train/*``,
        ``val/*``, ...) are put back next to ``test/*`` so that code reading them after ``fit`` keeps working."""
        if not self._get(self.config, "test_after_fit", self.test_after_fit):
            return
        dm = self.datamodule
        if isinstance(dm, FederatedDataModule) and dm.train_dataset is not None and dm.test_dataset is None:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"{type(dm).__name__} has no test set: test_after_fit skipped")
            return
        fit_metrics = dict(self.trainer.callback_metrics)
        self.trainer.test(self.model, datamodule=dm)
        metrics = self.trainer.callback_metrics
        for key, value in fit_metrics.items():
            metrics.setdefault(key, value)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        if "save_config_callback" not in kwargs:
            from fedlightning.logging import LogConfigCallback

            kwargs["save_config_callback"] = LogConfigCallback
        super().__init__(FederatedLoop, FederatedDataModule, *args, **kwargs)

    def _instantiate_trainer(self, config, callbacks):
        from lightning.pytorch.callbacks import ModelCheckpoint

        from fedlightning.checkpoint import AtomicCheckpointIO

        if not config.get("plugins"):
            config["plugins"] = [AtomicCheckpointIO()]
        listed = list(config.get("callbacks") or []) + list(callbacks)
        from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(cb, ProgressBar) for cb in listed
        ):
            from fedlightning.callbacks.progress import RoundProgressBar

            config["callbacks"] = list(config.get("callbacks") or []) + [RoundProgressBar()]
        added = None
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(cb, ModelCheckpoint) for cb in listed
        ):
            added = ModelCheckpoint(save_last=True, every_n_train_steps=self.checkpoint_every_n_rounds)
            config["callbacks"] = list(config.get("callbacks") or []) + [added]
        trainer = super()._instantiate_trainer(config, callbacks)
        if added is not None:
            import os

            logger = trainer.logger
            if logger is not None and getattr(logger, "save_dir", None):
                base = os.path.join(logger.save_dir, str(getattr(logger, "name", "") or ""))
            else:
                base = trainer.default_root_dir
            added.dirpath = os.path.join(base, "checkpoints")
        return trainer


def main(args: Optional[List[str]] = None, run: bool = True) -> FederatedCLI:
    if not _wandb_configured():
        os.environ["WANDB_MODE"] = "offline"
    return FederatedCLI(args=args, run=run)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
