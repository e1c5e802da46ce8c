"""A sweep run's name (:func:`run_slug`), its recorded outcome (:class:`RunResult`) and its final metrics
(:func:`read_final_metrics`)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedlightning.sweep.space import Param

__all__ = ["RunFailed", "RunResult", "read_final_metrics", "run_slug", "DryRun", "cell_text", "short_names"]


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Shortest dotted suffix of each key that no other key ends with."""
    parts = {k: k.split(".") for k in keys}
    out = {}
    for k, p in parts.items():
        for n in range(1, len(p) + 1):
            suffix = ".".join(p[-n:])
            if not any(o != k and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        out[k] = suffix
    return out


def _fmt(value: Any, drawn: bool) -> str:
    if isinstance(value, float) and drawn:
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "x".join(_fmt(v, False) for v in value)  # [64, 64] -> 64x64
    return str(value)


def run_slug(number: int, params: Mapping[str, Any], space: Mapping[str, Param]) -> str:
    """A run's name: ``<number:03d>-<short key>=<value>_...`` over the swept (non-constant) parameters.

    The three-digit run number keeps names unique even when two runs draw the same values; each swept parameter
    is named by the shortest dotted suffix of its name that is unique in the sweep (``lr=0.1``); floats drawn from
    a range get 4 significant digits, lists are joined by ``x`` (``hidden=64x64``); characters outside
    ``[A-Za-z0-9._=+-]`` become ``-``; at most 150 characters. The slug is the CSV logger's run name and the log
    file's name.
    """
    swept = [k for k in params if k in space and space[k].kind != "constant"]
    short = short_names(list(space))
    body = "_".join(f"{short[k]}={_fmt(params[k], space[k].kind == 'float')}" for k in swept)
    slug = re.sub(r"[^A-Za-z0-9._=+-]", "-", f"{number:03d}-{body}" if body else f"{number:03d}")
    return slug[:150]


# ====================================================================== results
@dataclass
class RunResult:
    """One run of the sweep as recorded: ``status`` is ``finished``, ``failed``, ``no metric`` or ``running``."""

    number: int
    slug: str
    params: dict[str, Any]
    status: str
    exit_code: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None

    def value(self, metric: str) -> float | None:
        v = self.metrics.get(metric)
        return v if v is not None and math.isfinite(v) else None


def read_final_metrics(path: str) -> dict[str, float]:
    """The last non-empty value of every column of a CSVLogger ``metrics.csv`` (``step``/``epoch`` excluded);
    an empty dict when the file does not exist. The same rule as a W&B run's summary (the last logged value by
    default)."""
    if not os.path.isfile(path):
        return {}
    out: dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text in (None, ""):
                    continue
                try:
                    out[key] = float(text)
                except ValueError:
                    continue
    return out


class RunFailed(Exception):
    """A run exited with a non-zero code or did not log the sweep's metric (the trial is recorded as failed)."""


class DryRun(Exception):
    pass


def cell_text(value: Any) -> str:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)
