"""Reference mode: every fast path off, to compare a run against the plain implementation when hunting a bug.

On with the environment variable ``FEDLIGHTNING_REFERENCE=1`` (``true`` / ``yes`` / ``on``; ``0``, ``false``,
``no``, ``off`` or unset: off) or :func:`set_reference_mode` (which wins over the variable until reset with
``None``). Each fast path asks :func:`reference_mode` when it is about to be taken (per client or per loader, not
per step); a run gives the same weights either way, up to float rounding. The fast paths and their references are
listed in :func:`reference_mode`'s docstring.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "reference_mode", "set_reference_mode"]

#: the environment variable that turns reference mode on
ENV = "FEDLIGHTNING_REFERENCE"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_override: bool | None = None


def set_reference_mode(enabled: bool | None) -> None:
    """Turn reference mode on (True) or off (False) in this process, whatever ``FEDLIGHTNING_REFERENCE`` says;
    None: the environment variable decides again."""
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_reference_mode takes True, False or None, got {enabled!r}")
    _override = enabled


def reference_mode() -> bool:
    """True when every fast path is to be skipped.

    The fast paths and their references:

    * ``client_execution="vectorized"`` / ``"auto"``: the clients train sequentially (``loop.client_execution_choice``
      is ``"sequential"``);
    * the reused ``torch.optim`` client optimizer (reset between sequential clients): a new one per client;
    * the global model's parameter and buffer lists cached per round: listed at every use;
    * one-``_foreach_add_`` plain-SGD steps and ``p.grad = None`` gradient clearing: ``optimizer.step()`` and
      ``optimizer.zero_grad(set_to_none=True)``; a client's loss without objective terms goes through the closure too;
    * in-memory batches (:class:`~fedlightning.datamodules.base.ArrayBatchLoader`, whole-batch indexing in evaluation
      and FedDANE's gradient phase, ``in_memory="auto"`` of :class:`~fedlightning.datamodules.DatasetDataModule`):
      ``DataLoader`` over per-sample ``__getitem__`` and ``default_collate``.

    The optimizers of :mod:`fedlightning.optim` keep their ``torch._foreach_*`` kernels: those are their arithmetic,
    not a second path.
    """
    if _override is not None:
        return _override
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"{ENV} must be one of {', '.join(_ON + _OFF[1:])} (or unset), got {ENV}={os.environ[ENV]!r}")
