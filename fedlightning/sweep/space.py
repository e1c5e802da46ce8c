"""W&B sweep parameter specs as Optuna distributions (:func:`search_space`, :class:`Param`) and the Optuna sampler
of a W&B ``method`` (:func:`make_sampler`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedlightning.logging import validate_sweep

__all__ = ["Param", "grid_cells", "search_space", "make_sampler"]

_SPEC_KEYS = {
    "value",
    "values",
    "distribution",
    "min",
    "max",
    "q",
    "mu",
    "sigma",
    "a",
    "b",
    "probabilities",
    "parameters",
}
_RANGE_DISTRIBUTIONS = {
    "uniform",
    "int_uniform",
    "q_uniform",
    "log_uniform",
    "log_uniform_values",
    "q_log_uniform_values",
}
_UNSUPPORTED = {
    "normal": "unbounded; Optuna samples bounded ranges only",
    "q_normal": "unbounded; Optuna samples bounded ranges only",
    "log_normal": "unbounded; Optuna samples bounded ranges only",
    "q_log_normal": "unbounded; Optuna samples bounded ranges only",
    "beta": "Optuna has no beta distribution",
    "q_beta": "Optuna has no beta distribution",
    "inv_log_uniform": "Optuna has no inverse-log distribution",
    "inv_log_uniform_values": "Optuna has no inverse-log distribution",
    "q_log_uniform": "Optuna cannot combine a log scale with a step q",
    "categorical_w_probabilities": "Optuna has no weighted categorical",
}
_PRIMITIVE = (str, int, float, bool, type(None))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ====================================================================== parameter specs → Optuna
@dataclass
class Param:
    """One swept parameter: its W&B name, kind and Optuna distribution.

    ``kind`` is ``constant`` (``value``; ``distribution`` is None), ``categorical``, ``int`` or ``float``.
    Categorical choices that are not numbers, strings, booleans or null (lists, mappings) are handed to Optuna as
    their index (Optuna stores only primitive choices) and mapped back by :meth:`decode`.
    """

    name: str
    kind: str
    distribution: Any = None
    value: Any = None  # constant
    choices: list[Any] | None = None  # categorical, the values as written in the file
    by_index: bool = False

    def suggest(self, trial) -> Any:
        """Draw this parameter in an Optuna trial; returns the value the run gets."""
        from optuna.distributions import FloatDistribution, IntDistribution

        d = self.distribution
        if self.kind == "constant":
            return self.value
        if isinstance(d, FloatDistribution):
            return trial.suggest_float(self.name, d.low, d.high, step=d.step, log=d.log)
        if isinstance(d, IntDistribution):
            return trial.suggest_int(self.name, d.low, d.high, step=d.step, log=d.log)
        return self.decode(trial.suggest_categorical(self.name, d.choices))

    def decode(self, optuna_value: Any) -> Any:
        return self.choices[optuna_value] if self.by_index else optuna_value

    def grid(self) -> list[Any]:
        """The Optuna values of a grid over this parameter (categorical only)."""
        return list(range(len(self.choices))) if self.by_index else list(self.choices)


def _spec_error(name: str, key: str, message: str) -> ValueError:
    return ValueError(f"{name}: parameter {key!r}: {message}")


def _param(key: str, spec: Mapping[str, Any], name: str) -> Param:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise _spec_error(name, key, f"unknown key(s) {sorted(unknown)}; a W&B parameter takes {sorted(_SPEC_KEYS)}")
    if "parameters" in spec:
        raise _spec_error(
            name,
            key,
            "nested 'parameters' are not supported by the local runner; "
            "write each nested key as its own dotted parameter",
        )
    dist = spec.get("distribution")
    if dist is not None and not isinstance(dist, str):
        raise _spec_error(name, key, f"distribution must be a name, got {dist!r}")
    if dist in _UNSUPPORTED:
        raise _spec_error(
            name,
            key,
            f"distribution {dist!r} is not supported by the local runner "
            f"({_UNSUPPORTED[dist]}); use values, uniform, int_uniform, q_uniform, "
            "log_uniform_values or log_uniform",
        )
    if "probabilities" in spec:
        raise _spec_error(
            name,
            key,
            "'probabilities' is not supported by the local runner "
            "(Optuna has no weighted categorical); drop it for equal weights",
        )
    if dist is None:
        if "values" in spec:
            dist = "categorical"
        elif "value" in spec:
            dist = "constant"
        elif "min" in spec and "max" in spec:
            if "q" in spec:
                raise _spec_error(name, key, "'q' needs an explicit q_* distribution (e.g. distribution: q_uniform)")
            dist = "int_uniform" if _is_int(spec["min"]) and _is_int(spec["max"]) else "uniform"
        else:
            raise _spec_error(name, key, "needs 'value', 'values' or 'min' and 'max'")
    if dist == "constant":
        if "value" not in spec:
            raise _spec_error(name, key, "distribution constant needs 'value'")
        _only(spec, {"value", "distribution"}, key, name, dist)
        return Param(key, "constant", value=spec["value"])
    if dist == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise _spec_error(name, key, f"values must be a non-empty list, got {values!r}")
        _only(spec, {"values", "distribution"}, key, name, dist)
        by_index = not all(isinstance(v, _PRIMITIVE) for v in values)
        choices = list(range(len(values))) if by_index else list(values)
        return Param(key, "categorical", CategoricalDistribution(choices), choices=list(values), by_index=by_index)
    if dist not in _RANGE_DISTRIBUTIONS:
        raise _spec_error(name, key, f"unknown distribution {dist!r}")
    lo, hi = spec.get("min"), spec.get("max")
    if not (_is_number(lo) and _is_number(hi)):
        raise _spec_error(name, key, f"distribution {dist} needs numeric 'min' and 'max', got min={lo!r} max={hi!r}")
    if not lo < hi:
        raise _spec_error(name, key, f"min must be < max, got min={lo!r} max={hi!r}")
    if dist.startswith("q_"):
        q = spec.get("q", 1)
        if not (_is_number(q) and q > 0):
            raise _spec_error(name, key, f"q must be a number > 0, got {q!r}")
        _only(spec, {"min", "max", "q", "distribution"}, key, name, dist)
    else:
        _only(spec, {"min", "max", "distribution"}, key, name, dist)
    if dist == "int_uniform":
        if not (_is_int(lo) and _is_int(hi)):
            raise _spec_error(name, key, f"int_uniform needs integer min and max, got min={lo!r} max={hi!r}")
        return Param(key, "int", IntDistribution(lo, hi))
    if dist == "uniform":
        return Param(key, "float", FloatDistribution(float(lo), float(hi)))
    if dist == "q_uniform":
        if _is_int(lo) and _is_int(hi) and _is_int(q):
            return Param(key, "int", IntDistribution(lo, hi, step=q))
        return Param(key, "float", FloatDistribution(float(lo), float(hi), step=float(q)))
    if dist == "log_uniform_values":
        if lo <= 0:
            raise _spec_error(name, key, f"log_uniform_values needs min > 0, got {lo!r}")
        return Param(key, "float", FloatDistribution(float(lo), float(hi), log=True))
    if dist == "log_uniform":
        return Param(key, "float", FloatDistribution(math.exp(lo), math.exp(hi), log=True))
    # q_log_uniform_values
    if not (q == 1 and _is_int(lo) and _is_int(hi) and lo > 0):
        raise _spec_error(
            name,
            key,
            "q_log_uniform_values is supported only with q: 1 and integer min > 0 "
            "(Optuna cannot combine a log scale with another step)",
        )
    return Param(key, "int", IntDistribution(lo, hi, log=True))


def _only(spec: Mapping[str, Any], allowed: set, key: str, name: str, dist: str) -> None:
    extra = set(spec) - allowed
    if extra:
        raise _spec_error(name, key, f"key(s) {sorted(extra)} do not apply to distribution {dist}")


def search_space(sweep: Mapping[str, Any], name: str = "sweep") -> dict[str, Param]:
    """The sweep's parameters as :class:`Param` objects, in file order.

    The W&B specs map to Optuna distributions: ``value`` → a constant (never handed to Optuna), ``values`` /
    ``distribution: categorical`` → a categorical choice, ``int_uniform`` → ``IntDistribution``, ``uniform`` →
    ``FloatDistribution``, ``q_uniform`` → a stepped ``FloatDistribution`` (``IntDistribution`` when ``min``,
    ``max`` and ``q`` are integers), ``log_uniform_values`` → a log ``FloatDistribution`` over ``[min, max]``,
    ``log_uniform`` → the same over ``[e^min, e^max]`` (W&B's ``min`` and ``max`` are exponents there),
    ``q_log_uniform_values`` with ``q: 1`` and integer bounds → a log ``IntDistribution``. Without
    ``distribution`` the type is inferred as W&B does: integer ``min``/``max`` → ``int_uniform``, else ``uniform``.
    A stepped distribution's grid starts at ``min`` (Optuna); W&B rounds to multiples of ``q`` — the same values
    when ``min`` is a multiple of ``q``.

    ``ValueError`` naming the parameter for everything else: the unbounded normal families, ``beta``,
    ``inv_log_uniform*``, ``probabilities`` (Optuna has no weighted categorical), ``q`` on a log scale other than
    ``q: 1`` on integers (Optuna cannot combine a log scale with a step), nested ``parameters``; and swept
    ``trainer.logger*`` keys (the local runner replaces the logger).
    """
    validate_sweep(sweep, name=name)
    space = {}
    for key, spec in sweep["parameters"].items():
        if key == "trainer.logger" or key.startswith("trainer.logger."):
            raise _spec_error(
                name,
                key,
                "the local runner sets the logger itself (CSVLogger into the output "
                "directory); sweep logger settings in the command instead",
            )
        space[key] = _param(key, spec, name)
    return space


def grid_cells(space: Mapping[str, Param], seed: int) -> list[dict[str, Any]]:
    """The cells of a grid sweep (Optuna values by parameter name), in the order its runs take them: run ``n``
    trains cell ``n``. The order is Optuna's ``GridSampler(grid, seed)``'s (the parameters by name, the product of
    their grids, shuffled by ``numpy.random.RandomState(seed)``), given to each run by number, so that the retry of
    an interrupted run, which takes a trial of its own, moves no later run to another cell."""
    import itertools

    import numpy as np

    grid = {k: p.grid() for k, p in sorted(space.items()) if p.kind != "constant"}
    cells = list(itertools.product(*grid.values()))
    np.random.RandomState(seed).shuffle(cells)
    return [dict(zip(grid, cell)) for cell in cells]


def _queued_grid(grid: dict, seed: int):
    """:class:`QueuedGrid` (below) over ``grid``; Optuna is imported when a sweep first needs it."""
    import optuna

    class QueuedGrid(optuna.samplers.GridSampler):
        """Optuna's ``GridSampler`` for the runner, which queues every cell itself (:func:`grid_cells`) and counts its
        runs: the sampler's own end-of-grid check after a trial, which reads a grid id that queued trials do not
        have once a single cell is left unvisited (a one-cell grid: a KeyError after its run), is left out."""

        def after_trial(self, study, trial, state, values) -> None:
            return None

    return QueuedGrid(grid, seed=seed)


def make_sampler(method: str, space: Mapping[str, Param], seed: int, number: int = 0):
    """The Optuna sampler of a W&B method for the run numbered ``number``.

    W&B sweep files carry no seed; ``seed`` (``--seed``, default 0, ours) makes the draws reproducible. ``bayes``
    uses Optuna's ``TPESampler`` defaults (e.g. its 10 random start-up trials); W&B's bayes is a Gaussian process,
    so the two draw differently.

    grid → ``GridSampler`` over the categorical parameters (its shuffle seeded by ``seed`` alone, so the order is
    the same in every invocation; without its end-of-grid check: the runner queues the cells and counts the runs);
    random → ``RandomSampler``; bayes → ``TPESampler``, both seeded from ``(seed, number)`` (numpy
    ``SeedSequence``) so a run's draw does not depend on how many runs earlier invocations of the sweep made: the
    draws are a function of the seed, the run number and the earlier results only, and a sweep resumed in steps
    draws exactly what one uninterrupted invocation draws.
    """
    import numpy as np
    import optuna

    if method == "grid":
        grid = {k: p.grid() for k, p in space.items() if p.kind != "constant"}
        return _queued_grid(grid, seed)
    run_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    if method == "random":
        return optuna.samplers.RandomSampler(seed=run_seed)
    if method == "bayes":
        return optuna.samplers.TPESampler(seed=run_seed)
    raise ValueError(f"method must be one of grid, random, bayes, got {method!r}")
