"""A progress bar that counts communication rounds.

One ``training_step`` of the :class:`~fedlightning.FederatedLoop` is one round and the run is bounded by
``trainer.max_steps``, so Lightning's default description ("Epoch 0/-2" with ``max_epochs=-1``) and its ``v_num``
item say nothing useful. :class:`RoundProgressBar` shows "Round" and the loggers' progress-bar metrics only: the rich
variant when the optional ``rich`` package is installed, the tqdm one otherwise. The CLI adds it when the config
enables the progress bar and lists no progress bar of its own.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar

from fedlightning._lightning_compat import progress_bar_options

try:  # rich is optional (Lightning's extras); tqdm is always there
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
except ImportError:  # pragma: no cover
    RichProgressBar, _RICH_AVAILABLE = None, False

__all__ = ["ROUND_DESCRIPTION", "RoundProgressBar", "RoundTQDMProgressBar", "round_bar_for"]

ROUND_DESCRIPTION = "Round"


def _round_metrics(items):
    items.pop("v_num", None)
    return items


class RoundTQDMProgressBar(TQDMProgressBar):
    """tqdm progress bar over rounds (``max_steps``), without the logger version number."""

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(ROUND_DESCRIPTION)

    def get_metrics(self, trainer, pl_module):
        return _round_metrics(super().get_metrics(trainer, pl_module))


if _RICH_AVAILABLE:

    class RoundRichProgressBar(RichProgressBar):
        """Rich progress bar over rounds (``max_steps``), without the logger version number."""

        def _get_train_description(self, current_epoch: int) -> str:
            text = ROUND_DESCRIPTION
            if len(self.validation_description) > len(text):
                text = f"{text:{len(self.validation_description)}}"
            return text

        def get_metrics(self, trainer, pl_module):
            return _round_metrics(super().get_metrics(trainer, pl_module))

    RoundProgressBar = RoundRichProgressBar
else:
    RoundProgressBar = RoundTQDMProgressBar


def round_bar_for(bar: Any) -> Any | None:
    """The round-counting bar that replaces ``bar`` when ``bar`` is Lightning's own default (exactly
    ``TQDMProgressBar`` or ``RichProgressBar``), built with the same options; None for any other bar (a bar the user
    chose is kept) or no bar."""
    if type(bar) is TQDMProgressBar:
        return RoundTQDMProgressBar(**progress_bar_options(bar))
    if _RICH_AVAILABLE and type(bar) is RichProgressBar:
        return RoundRichProgressBar(**progress_bar_options(bar))
    return None
