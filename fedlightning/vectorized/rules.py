r"""Batched client optimizers: one local step of every client at once, on the clients' weights ``W`` ([C, D]) in place.

:func:`make_batched_rule` maps the round's client optimizers to their batched rule: ``torch.optim.SGD`` without
momentum (:class:`_BatchedSGD`), and :class:`~fedlightning.optim.SgdArmijo`, :class:`~fedlightning.optim.SPS` and
:class:`~fedlightning.optim.DecSPS` (:class:`_BatchedArmijo`, :class:`_BatchedSPS`, :class:`_BatchedDecSPS`: step
sizes, Armijo tests and Polyak ratios as ``[C]`` tensors, no Python loop over clients inside a step). Each rule reads
the clients' optimizer instances (built by the loop, client state set) and writes the final per-client state back,
so ``get_client_state()`` / ``client_report()`` answer exactly as after sequential training.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .support import VectorizationUnsupportedError
from .torch_internals import _foreach_add_

if TYPE_CHECKING:
    from .step import _StepEvaluator


class _StepRecord:
    """Per-step telemetry of every client, kept as tensors until the end of the round (one host sync)."""

    def __init__(self, num_clients: int, device: torch.device):
        self.losses: List[Tensor] = []
        self.step_sizes: List[Tensor] = []
        self.backtracks = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.forwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.backwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.uniform_evaluations = 0  # one forward and one backward of every client (SGD steps), added at the end


class _BatchedRule:
    """Base of the batched client optimizers: one local step of every client at once, on ``W`` ([C, D]) in place.

    ``alive`` ([C] bool) marks the clients that still train: ``LocalTrainer.run`` stops a client whose loss is
    non-finite under a closure optimizer (``stops_on_nonfinite``); stopped clients are still computed (their rows
    ride along in the batched ops) but neither their weights, state nor telemetry change any more.
    """

    stops_on_nonfinite = False
    uses_trials = False  # evaluates trial points (line search): the evaluator keeps the RNG state to replay

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        raise NotImplementedError

    def finalize(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Write the batched per-client state back into each client's optimizer instance (whose own
        ``get_client_state`` / ``client_report`` then give exactly what a sequential run stores)."""


class _BatchedSGD(_BatchedRule):
    """``torch.optim.SGD`` without momentum: ``d = clip(g) + λ w``; ``w ← w − lr · d`` (the same ops as torch).

    A parameter the loss does not depend on gets a zero gradient here, while torch's SGD skips a parameter whose
    ``.grad`` is None: the two agree except that such a parameter still decays when ``weight_decay > 0``.
    """

    def __init__(self, lr: float, weight_decay: float, grad_clip: Optional[float], num_clients: int, device):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.grad_clip = grad_clip
        self.lr_vector = torch.full((num_clients,), self.lr, dtype=torch.float64, device=device)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        if self.grad_clip is None and self.weight_decay == 0.0:
            # plain SGD: w <- w - lr g on every parameter's rows of W, the gradients as the backward pass made them
            loss, grads = ev.gradient(W, alive, flat=False)
            _foreach_add_(ev.engine.weights.views(W), grads, alpha=-self.lr)
            record.losses.append(loss)
            record.step_sizes.append(self.lr_vector)
            record.uniform_evaluations += 1
            return
        loss, g = ev.gradient(W, alive)
        if self.grad_clip is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (‖g‖ + 1e-6), clamped to 1, always multiplied
            norm = torch.linalg.vector_norm(g, dim=1)
            coef = (float(self.grad_clip) / (norm + 1e-6)).clamp(max=1.0)
            g = g * coef[:, None]
        if self.weight_decay != 0.0:
            g = g.add(W, alpha=self.weight_decay)
        W.add_(g, alpha=-self.lr)
        record.losses.append(loss)
        record.step_sizes.append(self.lr_vector)
        record.uniform_evaluations += 1


def _loss_and_grad_sq(loss: Tensor, g: Tensor, ev: _StepEvaluator) -> Tuple[Tensor, Tensor, Tensor]:
    """float64 loss and ‖g‖² per client, and the mask of clients whose step is finite (the optimizers' policy:
    a non-finite loss or gradient leaves the weights and the state unchanged, step size nan).

    ‖g‖² is computed as the optimizers of :mod:`fedlightning.optim` compute it (per-tensor norms in the parameters'
    dtype, squared and summed in float64), so the Armijo / Polyak decisions see the same numbers up to rounding.
    """
    parts = g if isinstance(g, (list, tuple)) else ev.engine.weights.views(g)
    norms = [torch.linalg.vector_norm(v, dim=tuple(range(1, v.dim()))) if v.dim() > 1 else v.abs() for v in parts]
    grad_sq = torch.stack(norms).double().square().sum(dim=0)
    loss64 = loss.double()
    finite = torch.isfinite(loss64) & torch.isfinite(grad_sq)
    return loss64, grad_sq, finite


def _move(W: Tensor, g: Any, step: Tensor, where: Tensor, views: Optional[Callable] = None) -> None:
    """``w ← w − step · g`` for the clients in ``where`` (same rounding as ``torch._foreach_add_(alpha=-step)``);
    the other rows are left bit-for-bit unchanged (their gradient may be non-finite). ``g`` is ``[C, D]``, or the
    per-parameter gradients, applied to the parameters' views of ``W`` (``views(W)``)."""
    neg = (-step).to(W.dtype)
    if isinstance(g, Tensor):
        moved = torch.addcmul(W, g, neg[:, None])
        torch.where(where[:, None], moved, W, out=W)
        return
    for w, gi in zip(views(W), g):
        shape = (-1,) + (1,) * (w.dim() - 1)
        moved = torch.addcmul(w, gi, neg.view(shape))
        w.copy_(torch.where(where.view(shape), moved, w))


class _BatchedArmijo(_BatchedRule):
    """:class:`fedlightning.optim.SgdArmijo` for every client at once, with masked backtracking.

    Decisions (ours): every client starts from its own ``η_0`` (reset policy, its own last accepted step and ``b/n_i``)
    and walks the grid ``η_0 β^m``, ``m = 0, 1, …``; it stops at its first accepted ``m`` while the others go on. The
    outcome (accepted step, backtracks, forward count, state) is the sequential search's, grid point by grid point; only
    the batching differs:

    * deterministic models: a trial round evaluates every client still searching at a window of its next grid
      points, all (client, point) pairs in one batched call. A client's first window reaches one point past the
      ``m`` it accepted at its previous step of the round (the accepted ``m`` changes little from step to step), and
      each further window doubles, so searches end in one or two rounds with few points past the accepted one.
      Those extra points are computed but not counted: telemetry counts the search's own evaluations;
    * models with random layers (dropout): every client at one grid point per round, in order, so the replayed
      generator gives every trial the dropout masks of its gradient evaluation.

    One host synchronisation per trial round. Zero-gradient, exhausted-search and non-finite policies, telemetry
    and per-client state are SgdArmijo's (see :mod:`fedlightning.optim.armijo`).
    """

    stops_on_nonfinite = True
    uses_trials = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.eta_max, self.c, self.beta = hp["eta_max"], hp["c"], hp["beta"]
        self.reset, self.delta = hp["reset"], hp["delta"]
        self.max_backtracks, self.grad_tol = hp["max_backtracks"], hp["grad_tol"]
        f64 = dict(dtype=torch.float64, device=device)
        if self.reset == "grow":  # δ^{b/n_i} per client, computed as SgdArmijo does (Python float power)
            self.growth = torch.tensor([self.delta ** o._epoch_exponent('reset="grow"') for o in optimizers], **f64)
        # β^m for m = 0 .. max_backtracks + 1, as SgdArmijo computes them (Python float powers)
        self.powers = torch.tensor([self.beta**m for m in range(self.max_backtracks + 2)], **f64)
        # η_{k-1}: the step a client accepted last this round; before its first step, the carried step when
        # carry_step_size (SgdArmijo.initial_step_size), else none (NaN) and the search starts at eta_max
        starts = [o._carried_step if (o.carry_step_size and o._carried_step is not None) else None for o in optimizers]
        self.prev = torch.tensor([float("nan") if s is None else s for s in starts], **f64)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        accepted = [o._accepted_step for o in optimizers]  # last accepted step (client state, across rounds)
        self.accepted_step = torch.tensor([float("nan") if a is None else a for a in accepted], **f64)
        self.accepted_any = torch.zeros(num_clients, dtype=torch.bool, device=device)
        self.last_m = torch.zeros(num_clients, dtype=torch.long, device=device)  # window prediction

    def initial_step_size(self) -> Tensor:
        eta_max = torch.full_like(self.prev, self.eta_max)
        if self.reset == "max":
            return eta_max
        prev = self.prev
        start = prev if self.reset == "last" else torch.minimum(prev * self.growth, eta_max)
        return torch.where(torch.isnan(prev), eta_max, start)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        flat = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0)
        searching = alive & finite & ~flat
        eta0 = self.initial_step_size()
        grid = self.max_backtracks + 1  # grid points m = 0 .. max_backtracks
        if ev.engine.deterministic:
            first_m, trials = self._search_windows(W, g, ev, loss64, grad_sq, eta0, searching, grid)
        else:
            first_m, trials = self._search_in_order(W, g, ev, loss64, grad_sq, eta0, searching, grid)
        ev.finish()
        accepted = first_m < grid
        accepted_eta = torch.where(accepted, eta0 * self.powers[first_m.clamp(max=grid)], torch.zeros_like(eta0))
        exhausted = searching & ~accepted
        _move(W, g, accepted_eta * self.scale, accepted)  # SgdArmijo applies s·η_k
        # η_{k-1}: accepted step; after an exhausted search the next grid point η_0 β^{max_backtracks+1}
        next_grid = eta0 * self.powers[grid]
        self.prev = torch.where(accepted, accepted_eta, torch.where(exhausted, next_grid, self.prev))
        self.accepted_step = torch.where(accepted, accepted_eta, self.accepted_step)
        self.accepted_any |= accepted | exhausted
        self.last_m = torch.where(accepted, first_m, self.last_m)
        nan = torch.full_like(eta0, float("nan"))
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, accepted_eta * self.scale, nan))
        live = alive.long()
        record.backtracks += torch.where(accepted, trials - 1, trials) * live
        record.forwards += (1 + trials) * live
        record.backwards += live

    def _accepts(self, trial_loss: Tensor, loss64: Tensor, grad_sq: Tensor, eta: Tensor) -> Tensor:
        """The Armijo test f(w − ηg) ≤ f(w) − c·η·‖g‖², with SgdArmijo's float64 operations and order."""
        return trial_loss.double() <= loss64 - (self.c * eta) * grad_sq

    def _search_windows(self, W, g, ev, loss64, grad_sq, eta0, searching, grid):
        """Deterministic models: (client, grid point) pairs of all searching clients in one call per round."""
        C = W.shape[0]
        device = W.device
        never = torch.full((C,), grid, dtype=torch.long, device=device)
        first_m = never.clone()  # first accepted grid point (grid = none)
        trials = torch.zeros(C, dtype=torch.long, device=device)
        next_m = torch.zeros(C, dtype=torch.long, device=device)
        width = self.last_m + 2  # first window: up to one point past the client's previous accepted m
        while True:
            width = torch.minimum(width, grid - next_m) * searching.long()
            widths = width.tolist()  # the one host synchronisation of this trial round
            total = sum(widths)
            if total == 0:
                break
            pair_client = torch.repeat_interleave(torch.arange(C, device=device), width, output_size=total)
            offset = torch.cumsum(width, 0) - width
            pair_m = next_m[pair_client] + torch.arange(total, device=device) - offset[pair_client]
            eta = eta0[pair_client] * self.powers[pair_m]
            points = self._points(ev, W, g, pair_client, eta, widths)
            trial_loss = ev.trial(points, pair_client)
            ok = self._accepts(trial_loss, loss64[pair_client], grad_sq[pair_client], eta)
            hit = never.scatter_reduce(0, pair_client, torch.where(ok, pair_m, grid), reduce="amin")
            found = hit < grid
            first_m = torch.where(found, hit, first_m)
            trials += torch.where(found, hit - next_m + 1, width)
            next_m = next_m + width
            searching = searching & ~found & (next_m < grid)
            width = width * 2
        return first_m, trials

    @staticmethod
    def _points(ev: _StepEvaluator, W: Tensor, g: Tensor, pair_client: Tensor, eta: Tensor,
                widths: Optional[List[int]] = None) -> Tensor:
        """Trial points ``w_c − η g_c`` of the (client, grid point) pairs, written into the engine's scratch
        buffers (same rounding as ``torch.addcmul``, hence as SgdArmijo's ``_foreach_add_(alpha=-η)``).

        On CPU, with ``widths`` (pairs per client, ``pair_client`` sorted by client as ``repeat_interleave`` makes
        it), each client's block of pairs is one ``addcmul`` of its row of ``W`` and ``g`` broadcast over the block:
        the points are written once instead of gathering ``W``'s and ``g``'s rows first (3 passes over ``[P, D]``),
        at the price of one kernel call per client: faster for large ``D``, slower for the smallest models
        (docs/benchmarks.md §3). On accelerators three large kernels beat one small kernel per client."""
        shape = (len(pair_client), W.shape[1])
        neg = (-eta).to(W.dtype).unsqueeze(1)
        if widths is not None and W.device.type == "cpu":
            points = ev.engine.scratch("points", shape, W.dtype, W.device)
            start = 0
            for c, w in enumerate(widths):
                if w:
                    end = start + w
                    torch.addcmul(W[c].expand(w, -1), g[c].expand(w, -1), neg[start:end], out=points[start:end])
                    start = end
            return points
        points = torch.index_select(W, 0, pair_client, out=ev.engine.scratch("points", shape, W.dtype, W.device))
        g_rows = torch.index_select(g, 0, pair_client, out=ev.engine.scratch("g_rows", shape, W.dtype, W.device))
        return points.addcmul_(g_rows, neg)

    def _search_in_order(self, W, g, ev, loss64, grad_sq, eta0, searching, grid):
        """Models with random layers: every client at one grid point per round, all clients in order."""
        C = W.shape[0]
        first_m = torch.full((C,), grid, dtype=torch.long, device=W.device)
        trials = torch.zeros(C, dtype=torch.long, device=W.device)
        for m in range(grid):
            if not bool(searching.any()):  # the one host synchronisation of this trial round
                break
            eta = eta0 * self.powers[m]
            points = torch.addcmul(W, g, (-eta).to(W.dtype).unsqueeze(1))
            ok = searching & self._accepts(ev.trial(points), loss64, grad_sq, eta)
            first_m = torch.where(ok, torch.full_like(first_m, m), first_m)
            trials += searching.long()
            searching = searching & ~ok
        return first_m, trials

    def finalize(self, optimizers) -> None:
        prev = self.prev.tolist()
        took = self.accepted_any.tolist()
        accepted = self.accepted_step.tolist()
        for o, p, t, a in zip(optimizers, prev, took, accepted):
            if t:  # a search ended this round (accepted or exhausted): SgdArmijo's _prev_step
                o._prev_step = p
            o._accepted_step = None if math.isnan(a) else a


class _BatchedSPS(_BatchedRule):
    """:class:`fedlightning.optim.SPS` (SPS_max, constant or smoothed cap; ``fixed_step_size`` FedSPS-Global mode) for
    every client at once: ``γ_i = min{(f_i − ℓ*)/(c‖g_i‖²), γ_{b,i}}``, degenerate steps and state as SPS."""

    stops_on_nonfinite = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.c, self.gamma_max, self.f_star = hp["polyak_c"], hp["gamma_max"], hp["f_star"]
        self.smooth, self.grad_tol = hp["smooth"], hp["grad_tol"]
        self.fixed_lr = hp.get("fixed_step_size")
        f64 = dict(dtype=torch.float64, device=device)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        if self.smooth:  # δ^{b/n_i} per client, as SPS.cap computes it
            self.growth = torch.tensor(
                [hp["smooth_factor"] ** o._epoch_exponent("smooth=True") for o in optimizers], **f64)
        self.prev = torch.tensor([float("nan") if o._prev_step is None else o._prev_step for o in optimizers], **f64)
        nan = torch.full((num_clients,), float("nan"), **f64)
        self.report = (nan.clone(), nan.clone(), nan.clone())  # last step's (sps step, f, ‖g‖²): SPS.client_report
        self.reported = torch.zeros(num_clients, dtype=torch.bool, device=device)

    def cap(self) -> Tensor:
        gamma_max = torch.full_like(self.prev, self.gamma_max)
        if not self.smooth:
            return gamma_max
        return torch.where(torch.isnan(self.prev), gamma_max, self.growth * self.prev)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        gap = loss64 - self.f_star
        cap = self.cap()
        degenerate = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0) | (gap <= 0.0)
        ratio = torch.minimum(gap / (self.c * grad_sq), cap)
        sps_step = torch.where(degenerate, torch.where(gap <= 0.0, torch.zeros_like(cap), cap), ratio)
        report = alive & finite
        self.report = tuple(torch.where(report, new, old) for new, old in zip((sps_step, loss64, grad_sq), self.report))
        self.reported |= report
        zeros, nan = torch.zeros_like(cap), torch.full_like(cap, float("nan"))
        if self.fixed_lr is not None:  # FedSPS-Global client: the constant step, SPS only measured
            step = torch.full_like(cap, self.fixed_lr) * self.scale
            moves = alive & finite
        else:
            step = torch.where(degenerate, zeros, sps_step * self.scale)
            moves = alive & finite & ~degenerate
            self.prev = torch.where(moves, sps_step, self.prev)
        _move(W, g, step, moves, ev.engine.weights.views)
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, step, nan))
        record.forwards += alive.long()
        record.backwards += alive.long()

    def finalize(self, optimizers) -> None:
        prev = self.prev.tolist()
        reports = torch.stack(self.report).tolist()
        reported = self.reported.tolist()
        for i, o in enumerate(optimizers):
            o._prev_step = None if math.isnan(prev[i]) else prev[i]
            if reported[i]:
                o._report = {"sps_last_step_size": reports[0][i], "sps_last_loss": reports[1][i],
                             "sps_last_grad_sq": reports[2][i]}


class _BatchedDecSPS(_BatchedRule):
    """:class:`fedlightning.optim.DecSPS` for every client at once:
    ``γ_t = min{(f − ℓ*)/‖g‖², c_{t−1} γ_{t−1}} / c_t``, ``c_t = c_0 √(t+1)``, with each client's own ``(t, γ_{t−1})``."""

    stops_on_nonfinite = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.c0, self.f_star, self.grad_tol = hp["c0"], hp["f_star"], hp["grad_tol"]
        f64 = dict(dtype=torch.float64, device=device)
        self.t = torch.tensor([float(o.t) for o in optimizers], **f64)
        self.gamma_prev = torch.tensor([float(o.gamma_prev) for o in optimizers], **f64)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        gap = loss64 - self.f_star
        degenerate = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0) | (gap <= 0.0)
        t = self.t
        c_prev = torch.where(t >= 1, self.c0 * torch.sqrt(t), torch.full_like(t, self.c0))
        c_t = self.c0 * torch.sqrt(t + 1)
        gamma = torch.minimum(gap / grad_sq, c_prev * self.gamma_prev) / c_t
        moves = alive & finite & ~degenerate
        step = torch.where(moves, gamma * self.scale, torch.zeros_like(gamma))
        _move(W, g, step, moves, ev.engine.weights.views)
        self.t = torch.where(moves, t + 1, t)
        self.gamma_prev = torch.where(moves, gamma, self.gamma_prev)
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, step, torch.full_like(step, float("nan"))))
        record.forwards += alive.long()
        record.backwards += alive.long()

    def finalize(self, optimizers) -> None:
        ts, gammas = self.t.tolist(), self.gamma_prev.tolist()
        for o, t, gp in zip(optimizers, ts, gammas):
            o.t, o.gamma_prev = int(t), gp


def _same_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor]) -> Dict[str, Any]:
    """The hyper-parameters shared by every param group of every client optimizer (else unsupported)."""
    ids = {id(p) for p in params}
    first = None
    for opt in optimizers:
        covered = set()
        for group in opt.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            covered.update(id(p) for p in group["params"])
            if first is None:
                first = hp
            elif hp != first:
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' needs the same {type(opt).__name__} settings for every "
                    f"parameter group and client; got {first} and {hp}"
                )
        if covered != ids:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' needs the client optimizer to cover all trainable parameters"
            )
    return first or {}


#: Batched counterparts of the optimizers of fedlightning.optim, by class name.
_ADAPTIVE_RULES: Dict[str, Callable[..., _BatchedRule]] = {
    "SgdArmijo": _BatchedArmijo,
    "SPS": _BatchedSPS,
    "DecSPS": _BatchedDecSPS,
}


def make_batched_rule(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor],
                      grad_clip: Optional[float], device: torch.device) -> _BatchedRule:
    """The batched counterpart of the round's client optimizers (one instance per client, built by the loop).

    Supported: ``torch.optim.SGD`` without momentum, Nesterov or ``maximize`` (``weight_decay`` and the loop's
    gradient clipping ``grad_clip`` are), and :class:`~fedlightning.optim.SgdArmijo`, :class:`~fedlightning.optim.SPS`
    and :class:`~fedlightning.optim.DecSPS`. Raises :class:`VectorizationUnsupportedError` for optimizers without a
    batched rule (Adam, SGD with momentum, ...) and for settings that differ between clients or parameter groups.
    """
    kinds = {type(o) for o in optimizers}
    if len(kinds) != 1:
        raise VectorizationUnsupportedError(
            f"the clients use different optimizer classes {sorted(k.__name__ for k in kinds)}")
    kind = kinds.pop()
    num_clients = len(optimizers)
    hp = _same_hyperparameters(optimizers, params)
    if kind is torch.optim.SGD:
        bad = {k: hp.get(k) for k in ("momentum", "nesterov", "maximize") if hp.get(k)}
        if bad:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' supports torch.optim.SGD without momentum, nesterov or maximize; got "
                + ", ".join(f"{k}={v}" for k, v in bad.items())
            )
        return _BatchedSGD(hp["lr"], hp.get("weight_decay", 0.0), grad_clip, num_clients, device)
    batched = _ADAPTIVE_RULES.get(kind.__name__) if kind.__module__.startswith("fedlightning.optim") else None
    if batched is not None:
        return batched(optimizers, params, num_clients, device)
    raise VectorizationUnsupportedError(
        f"client_execution='vectorized' does not support the client optimizer {kind.__name__}; supported: "
        "torch.optim.SGD without momentum, fedlightning.optim.SgdArmijo, SPS and DecSPS"
    )
