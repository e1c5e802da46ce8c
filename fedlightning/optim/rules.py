r"""The step-size rules of the client optimizers, each written once, for one client and for a batch of clients.

Every function takes either Python numbers (one client: what :class:`~fedlightning.optim.SgdArmijo`,
:class:`~fedlightning.optim.SPS` and :class:`~fedlightning.optim.DecSPS` compute per step, where per-step overhead
matters for small models) or ``[C]`` float64 tensors and bool masks (one entry per client: their batched forms in
:mod:`fedlightning.vectorized.rules`), and returns the same kind. The elementwise helpers (:func:`_where`,
:func:`_minimum`, ...) dispatch on the type, so both forms run the same IEEE float64 operations in the same order and
give bit-identical values. "No value" (no previous step yet) is NaN in both forms. Every decision is float64: the
losses and squared gradient norms enter as float64 (Python floats, or tensors cast with ``.double()``), and factors
that are powers (the Armijo grid :math:`\beta^m`, per-step growth :math:`\delta^{1/\lceil n/b\rceil}`) are Python
float powers, computed once per client, never tensor powers; DecSPS's :math:`\sqrt{t}` is ``math.sqrt``
(:class:`CountRoots` for tensors). The client step-size scale multiplies the applied step only, never the rule's
state (:meth:`~fedlightning.optim._common.ClosureOptimizer.scale_step`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CountRoots",
    "armijo_accepts",
    "armijo_after_search",
    "armijo_initial_step",
    "armijo_powers",
    "decsps_bound",
    "decsps_step",
    "finite_step",
    "flat_gradient",
    "per_step_growth",
    "polyak_after_step",
    "sgd_direction",
    "sps_after_step",
    "sps_cap",
    "sps_step",
]

Value = Any  # a Python float / int / bool (one client) or a [C] tensor (a batch of clients)


# ---------------------------------------------------------------------------------------- float-or-tensor helpers
# Each tests for a Python number first: isinstance(x, (float, int)) costs ~30 ns where isinstance(x, Tensor) costs
# ~150 ns (torch's metaclass), and the one-client form runs once per local step.
_NUMBER = (float, int)  # bool is an int


def _where(cond: Value, a: Value, b: Value) -> Value:
    """``a`` where ``cond``, else ``b``; tuples elementwise (a number ``cond`` selects a whole tuple)."""
    if isinstance(cond, _NUMBER):
        return a if cond else b
    if isinstance(a, tuple):
        return tuple(_where(cond, x, y) for x, y in zip(a, b))
    if isinstance(a, _NUMBER) and isinstance(b, _NUMBER):  # two numbers: a float64 result
        a = torch.full(cond.shape, a, dtype=torch.float64, device=cond.device)
    return torch.where(cond, a, b)


def _minimum(a: Value, b: Value) -> Value:
    """``torch.minimum``'s semantics (NaN if either is NaN) for numbers too."""
    if isinstance(a, _NUMBER):
        if isinstance(b, _NUMBER):
            return a if a <= b else (b if b < a else math.nan)
        return torch.minimum(torch.full_like(b, a), b)
    return torch.minimum(a, torch.full_like(a, b) if isinstance(b, _NUMBER) else b)


def _divide(a: Value, b: Value) -> Value:
    """``a / b`` with IEEE semantics for numbers too (``±inf`` or NaN for a zero ``b``, where Python raises)."""
    if not (isinstance(a, _NUMBER) and isinstance(b, _NUMBER)) or b != 0.0:
        return a / b
    if a != a or a == 0.0:
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _isfinite(x: Value) -> Value:
    return math.isfinite(x) if isinstance(x, _NUMBER) else torch.isfinite(x)


def _not(x: Value) -> Value:
    return (not x) if isinstance(x, _NUMBER) else ~x


def _full_like(like: Value, value: float) -> Value:
    return value if isinstance(like, _NUMBER) else torch.full_like(like, value)


# ---------------------------------------------------------------------------------------- shared by the rules
def per_step_growth(factor: float, exponent: float) -> float:
    """:math:`\\delta^{1/\\lceil n/b\\rceil}`: a growth factor ``δ`` per local epoch as a per-step factor, with
    ``exponent = 1/steps-per-epoch`` (:func:`fedlightning.optim._common.epoch_exponent`); a Python float power."""
    return factor**exponent


def finite_step(loss: Value, grad_sq: Value) -> Value:
    """Whether a step can be taken: the loss and :math:`\\|g\\|^2` are finite (else the optimizers' non-finite
    policy: parameters and state unchanged, step size NaN)."""
    return _isfinite(loss) & _isfinite(grad_sq)


def flat_gradient(grad_sq: Value, grad_tol: float) -> Value:
    """:math:`\\|g\\| <` ``grad_tol`` (or exactly 0): no step, recorded step size 0, state not advanced (the
    reference Sls / SPS threshold 1e-8)."""
    return (grad_sq < grad_tol**2) | (grad_sq == 0.0)


def sgd_direction(g: Tensor, w: Tensor, weight_decay: float) -> Tensor:
    """SGD's direction :math:`d = g + \\lambda w` (``torch.optim.SGD`` without momentum: ``g.add(w, alpha=λ)``,
    the same op torch applies; ``g`` itself when :math:`\\lambda = 0`)."""
    return g.add(w, alpha=weight_decay) if weight_decay != 0.0 else g


# ---------------------------------------------------------------------------------------- SGD-Armijo
@functools.lru_cache(maxsize=64)
def armijo_powers(beta: float, max_backtracks: int) -> tuple[float, ...]:
    """:math:`\\beta^m` for ``m = 0 .. max_backtracks + 1`` (Python float powers): the grid :math:`\\eta_0\\beta^m`
    of a search (``m <= max_backtracks``) and the next grid point after an exhausted one."""
    return tuple(beta**m for m in range(max_backtracks + 2))


def armijo_initial_step(
    reset: str, eta_max: float, prev: Value, growth: float | Value = 1.0, init: float | None = None
) -> Value:
    """:math:`\\eta_0` of the next search from :math:`\\eta_{k-1}` (``prev``; NaN: none yet, then ``init``, whose
    default None means ``eta_max``): ``"max"``: ``eta_max``; ``"last"``: :math:`\\eta_{k-1}`; ``"grow"``:
    :math:`\\min\\{\\eta_{k-1}\\,\\text{growth}, \\eta_{\\max}\\}` with ``growth``
    :math:`= \\delta^{1/\\lceil n/b\\rceil}` (:func:`per_step_growth`)."""
    if reset == "max":
        return _full_like(prev, eta_max)
    start = prev if reset == "last" else _minimum(prev * growth, eta_max)
    return _where(prev != prev, eta_max if init is None else init, start)


def armijo_accepts(trial_loss: Value, loss: Value, grad_sq: Value, c: float, eta: Value) -> Value:
    """The Armijo test :math:`f(w - \\eta g) \\le f(w) - c\\,\\eta\\,\\|g\\|^2` in float64 (a NaN trial loss fails)."""
    return trial_loss <= loss - (c * eta) * grad_sq


def armijo_after_search(
    eta0: Value,
    accepted_eta: Value,
    accepted: Value,
    exhausted: Value,
    prev: Value,
    accepted_step: Value,
    next_power: float,
) -> tuple[Value, Value]:
    """``(η_{k-1}, last accepted step)`` after a step: the accepted step; after an exhausted search the next grid
    point :math:`\\eta_0\\beta^{\\text{max\\_backtracks}+1}` (``next_power``) and the last accepted step kept;
    both unchanged otherwise (no search: zero gradient or non-finite values)."""
    prev = _where(accepted, accepted_eta, _where(exhausted, eta0 * next_power, prev))
    return prev, _where(accepted, accepted_eta, accepted_step)


# ---------------------------------------------------------------------------------------- Polyak steps
def sps_cap(gamma_max: float, prev: Value, growth: float | Value | None = None) -> Value:
    """The cap :math:`\\gamma_{b,t}`: ``gamma_max`` (``growth`` None: constant cap), or smoothed:
    :math:`\\delta^{1/\\lceil n/b\\rceil}\\gamma_{t-1}` (``gamma_max`` while :math:`\\gamma_{t-1}` is NaN)."""
    if growth is None:
        return _full_like(prev, gamma_max)
    return _where(prev != prev, gamma_max, growth * prev)


def _polyak_degenerate(gap: Value, grad_sq: Value, grad_tol: float) -> Value:
    return flat_gradient(grad_sq, grad_tol) | (gap <= 0.0)


def sps_step(gap: Value, grad_sq: Value, c: float, cap: Value, grad_tol: float) -> tuple[Value, Value]:
    """``(γ, degenerate)``: SPS_max :math:`\\gamma = \\min\\{(f - \\ell^*)/(c\\|g\\|^2), \\gamma_{b,t}\\}` with
    ``gap`` :math:`= f - \\ell^*`. Degenerate (flat gradient or ``gap <= 0``): ``γ`` is the rule's limit, 0 for
    ``gap <= 0`` (ratio 0) and the cap for a zero gradient (ratio :math:`+\\infty`); the step is not taken."""
    degenerate = _polyak_degenerate(gap, grad_sq, grad_tol)
    ratio = _minimum(_divide(gap, c * grad_sq), cap)
    return _where(degenerate, _where(gap <= 0.0, 0.0, cap), ratio), degenerate


def sps_after_step(
    gamma: Value, degenerate: Value, scale: Value, prev: Value, fixed_step_size: float | None = None
) -> tuple[Value, Value, Value]:
    """``(applied step, moved, next γ_{t-1})`` of SPS (:func:`polyak_after_step`); with ``fixed_step_size``
    (FedSPS-Global clients) the step ``fixed_step_size · s`` is applied on every step, degenerate ones included,
    and the state is not advanced (SPS is only measured)."""
    if fixed_step_size is not None:
        return fixed_step_size * scale, True, prev
    return polyak_after_step(gamma, degenerate, scale, prev, gamma)


class CountRoots:
    """:math:`\\sqrt{k}` of integer-valued step counts ``k`` ([C] tensor), equal to ``math.sqrt(k)``: looked up in
    a table of ``math.sqrt`` values that grows as needed (:meth:`cover`). ``torch.sqrt`` on float64 is not correctly
    rounded on every CPU (MKL's vectorised sqrt differs from ``math.sqrt`` in the last bit for some integers), so a
    batch of clients would otherwise get other :math:`c_t` than each client alone."""

    def __init__(self, device: torch.device):
        self.table = torch.zeros(0, dtype=torch.float64, device=device)

    def cover(self, largest: int) -> None:
        """Make counts up to ``largest`` available (the table at least doubles when it grows)."""
        if largest >= len(self.table):
            size = max(largest + 1, 2 * len(self.table))
            self.table = torch.tensor(
                [math.sqrt(k) for k in range(size)], dtype=torch.float64, device=self.table.device
            )

    def __call__(self, counts: Tensor) -> Tensor:
        return self.table[counts.long()]


def decsps_bound(c0: float, t: Value, gamma_prev: Value, sqrt=math.sqrt) -> tuple[Value, Value]:
    """``(c_{t-1} γ_{t-1}, c_t)`` of DecSPS: :math:`c_t = c_0\\sqrt{t+1}`, :math:`c_{-1} = c_0`, with ``sqrt``
    the correctly rounded square root of step counts (``math.sqrt``; for tensors a :class:`CountRoots`)."""
    c_prev = _where(t >= 1, c0 * sqrt(t), c0)
    return c_prev * gamma_prev, c0 * sqrt(t + 1)


def decsps_step(
    gap: Value, grad_sq: Value, t: Value, gamma_prev: Value, c0: float, grad_tol: float, sqrt=math.sqrt
) -> tuple[Value, Value]:
    """``(γ_t, degenerate)``: DecSPS :math:`\\gamma_t = \\min\\{(f - \\ell^*)/\\|g\\|^2,
    c_{t-1}\\gamma_{t-1}\\}/c_t` (:func:`decsps_bound`); degenerate as :func:`sps_step` (no step)."""
    degenerate = _polyak_degenerate(gap, grad_sq, grad_tol)
    bound, c_t = decsps_bound(c0, t, gamma_prev, sqrt)
    return _minimum(_divide(gap, grad_sq), bound) / c_t, degenerate


def polyak_after_step(
    gamma: Value, degenerate: Value, scale: Value, old: Value, new: Value
) -> tuple[Value, Value, Value]:
    """``(applied step, moved, state)`` of a Polyak step: the applied step :math:`s\\gamma` (0 on a degenerate
    step), whether it moved, and the rule's state: ``new`` (its value after a real step) where the step moved, else
    ``old`` (a degenerate step does not advance it). ``old`` / ``new``: one value, or a tuple of values."""
    moved = _not(degenerate)
    return _where(degenerate, 0.0, gamma * scale), moved, _where(moved, new, old)
