r"""Stochastic Polyak step sizes: SPS_max (FedSPS, :class:`SPS`) and decreasing SPS (FedDecSPS, :class:`DecSPS`).

.. math::
    \text{SPS: } \gamma_t = \min\Big\{\frac{f(w_t; b_t) - \ell^*}{c\,\|g_t\|^2},\ \gamma_{b,t}\Big\}, \qquad
    \text{DecSPS: } \gamma_t = \frac{1}{c_t}\min\Big\{\frac{f(w_t; b_t) - \ell^*}{\|g_t\|^2},\ c_{t-1}\gamma_{t-1}\Big\}

and :math:`w_{t+1} = w_t - \gamma_t g_t`. Loizou et al. 2021 (SPS), Orvieto et al. 2022 (DecSPS); the client
optimizers of "Locally Adaptive Federated Learning" (Mukherjee, Loizou, Stich; seed 001). The smoothed cap, the
decisions the papers leave open (degenerate steps, per-client state, ``fixed_step_size``, client step-size scale)
are in :class:`SPS`'s docstring; DecSPS's recursion in :class:`DecSPS`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import flag, in_range, integer, non_negative, number, positive
from fedlightning.optim import rules
from fedlightning.optim._common import ClosureOptimizer, epoch_exponent

__all__ = ["SPS", "DecSPS"]


class SPS(ClosureOptimizer):
    r"""Stochastic Polyak step (SPS_max), optionally with the smoothed cap.

    **SPS** — Loizou et al. 2021 (SPS_max); the client optimizer of FedSPS (Mukherjee, Loizou, Stich, "Locally Adaptive
    Federated Learning", seed 001, Algorithm 1 / Eq. 2):

    .. math::
        \gamma_t = \min\Big\{\frac{f(w_t; b_t) - \ell^*}{c\,\|g_t\|^2},\ \gamma_{b,t}\Big\}, \qquad
        w_{t+1} = w_t - \gamma_t g_t

    with a constant cap :math:`\gamma_{b,t} = \gamma_b` (``smooth=False``, seed 001's convex experiments) or the
    smoothed cap of seed 001 §6 / Loizou et al. 2021 (``smooth=True``, seed 001's non-convex experiments):

    .. math::
        \gamma_{b,0} = \gamma_b, \qquad \gamma_{b,t} = \delta^{\,1/\lceil n/b\rceil}\,\gamma_{t-1}\quad (t \ge 1)

    **Reading of the smoothed cap (a documented choice):** seed 001 ("Locally Adaptive Federated Learning", Sec. 6)
    writes :math:`\gamma_{b,t} = 2^{|B|/m_i}\gamma_{b,t-1}`, i.e. the multiplier applied to the previous *cap*, which
    would grow exponentially and never look at the step sizes; we implement the reading of the SPS paper it cites and of
    the reference SPS code (``smooth_iter``): the multiplier applies to the previous *step size* :math:`\gamma_{t-1}`.
    ``smooth_factor`` is :math:`\delta = 2` (seed 001; reference ``gamma = 2``), applied as
    :math:`\delta^{1/\lceil n/b\rceil}` per step with :math:`\lceil n/b\rceil` the steps of one local epoch of the
    client's loader (``n_batches_per_epoch`` >= 1, or ``batch_size`` + ``num_samples``, or set per client by the
    FederatedLoop), so the cap can at most double per local epoch. Seed 001 and the reference code write
    :math:`\delta^{b/n}` (the reference passes ``n/b``) with the same intent, growth :math:`\delta` per epoch; the two
    agree whenever :math:`b` divides :math:`n`. With fewer samples than the batch size (every step a whole epoch)
    :math:`\delta^{b/n}` would multiply the cap by :math:`\delta^{b/n} > \delta` per step (×2.9 for 13 samples, batch
    20), which is why we count whole steps (ours; :func:`fedlightning.optim._common.epoch_exponent`). The first cap is
    :math:`\gamma_{b,0} = \gamma_b` (seed 001: :math:`\gamma_{b,0} = 1`; the reference code also multiplies the first
    one). In smooth mode ``gamma_max`` is only this initial value, as in the reference code (no constant cap).

    Decisions (ours unless a source is named; "Locally Adaptive Federated Learning", Sec. 5 and 6, leaves them open):

    * ``f_star`` is :math:`\ell^*`, a lower bound of the mini-batch loss; 0 for non-negative losses (seed 001, all
      experiments). No epsilon in the denominator (the paper has none; the reference code's ``eps`` only guards
      :math:`\|g\| = 0`, which we handle explicitly).
    * **Degenerate steps** — :math:`\|g\| <` ``grad_tol`` (1e-8, reference SPS) or :math:`f - \ell^* \le 0`: no
      parameter change, recorded step size ``0.0``, and the state (smoothing's :math:`\gamma_{t-1}`, DecSPS's
      :math:`(t, \gamma_{t-1})`) is NOT advanced. This avoids the reference SPS bug where one zero-gradient step stores
      :math:`\gamma = 0` and the smoothed cap :math:`\delta^{b/n}\cdot 0` freezes every later step at 0 (the same would
      happen to DecSPS's :math:`c_{t-1}\gamma_{t-1}`).
    * **Non-finite loss or gradient**: parameters and state unchanged, step size ``nan``, the loss is returned (the
      FederatedLoop skips a client whose loss is non-finite).
    * **Persistent per-client state** (``get_client_state`` / ``set_client_state``, stored by the FederatedLoop per
      client, checkpointed, nothing for clients that never trained): DecSPS keeps :math:`(t, \gamma_{t-1})`, smoothed
      SPS keeps :math:`\gamma_{t-1}`, across that client's rounds. Seed 001's :math:`t` is the global iteration
      index; here :math:`t` counts the (non-degenerate) steps this client has taken, which is the same thing under full
      participation and the natural per-client reading under client sampling. Plain SPS is stateless.
    * ``fixed_step_size`` (SPS only, default None): when set, SPS applies that *fixed* step (plain SGD) and only
      measures the SPS step it would have taken (``last_step["sps_step_size"]``, ``client_report()``): the clients of
      FedSPS-Global (seed 001 App. D.2), whose server strategy sets the round's shared step through the loop's
      ``client_lr_scale``. It is deliberately not called ``lr``: a configuration that switches the client optimizer
      from ``torch.optim.SGD`` to SPS would otherwise carry SGD's ``lr`` into it and silently turn adaptive SPS into
      plain SGD. For the same reason SPS's constant is ``polyak_c``, not the ``c`` of
      :class:`~fedlightning.optim.SgdArmijo` (Armijo's sufficient-decrease constant, another meaning).
    * **Client step-size scale** (:meth:`scale_step`, the loop's ``client_lr_scale``): SPS applies :math:`s\,\gamma_t`
      (in fixed-step mode :math:`s` times the fixed step, FedSPS-Global's mechanism); DecSPS applies
      :math:`s\,\gamma_t`. The rules and their state (smoothed SPS's :math:`\gamma_{t-1}`, DecSPS's
      :math:`(t, \gamma_{t-1})`) stay in the rule's own units, so the scale does not compound through the smoothed cap
      or :math:`c_{t-1}\gamma_{t-1}`. Reasoning (seed 004): its η-decay multiplies every local step by :math:`s_r`.
      For SPS, :math:`s\min\{\text{ratio}, \gamma_{b,t}\}` scales both the Polyak ratio and the cap
      :math:`\gamma_b`; scaling only :math:`\gamma_b` would change nothing on steps where the Polyak ratio is below the
      cap (typical once the loss is small). For DecSPS, :math:`\gamma_b` only bounds the first step, so scaling it
      would do nothing after a client's first step. ``last_step["step_size"]`` is the applied step;
      ``client_report()`` and ``last_step["sps_step_size"]`` are the unscaled SPS measurement.

    Cost: one forward + one backward, one fused norm, one host synchronisation (``.tolist()`` of loss and
    :math:`\|g\|^2`) and one fused in-place update per step.

    Args:
        params: parameters or param groups (all groups share the hyperparameters: one step size for all).
        polyak_c: scaling constant :math:`c > 0` of the Polyak step. Default 0.5 (seed 001, all experiments).
        gamma_max: the cap :math:`\gamma_b` (with ``smooth=True``: the initial cap :math:`\gamma_{b,0}`). Default 1.0
            (seed 001).
        f_star: lower bound :math:`\ell^*` of the loss. Default 0.0 (seed 001).
        smooth: use the smoothed cap (seed 001's non-convex experiments). Default False.
        smooth_factor: :math:`\delta \ge 1`, growth of the smoothed cap per local epoch (per step
            :math:`\delta^{1/\lceil n/b\rceil}`). Default 2.0 (seed 001 §6).
        n_batches_per_epoch, batch_size, num_samples: the epoch length for ``smooth=True`` (see above); inside the
            FederatedLoop it is set per client when not given.
        grad_tol: below this gradient norm no step is taken. Default 1e-8 (reference SPS).
        fixed_step_size: fixed step for FedSPS-Global clients (see above). Default None (adaptive
            SPS).
    """

    growth_setting = ("smooth_factor", "smooth=True")

    def __init__(
        self,
        params,
        polyak_c: float = 0.5,
        gamma_max: float = 1.0,
        f_star: float = 0.0,
        smooth: bool = False,
        smooth_factor: float = 2.0,
        n_batches_per_epoch: float | None = None,
        batch_size: int | None = None,
        num_samples: int | None = None,
        grad_tol: float = 1e-8,
        fixed_step_size: float | None = None,
    ):
        c = positive("polyak_c", polyak_c)
        gamma_max = positive("gamma_max", gamma_max)
        f_star = number("f_star", f_star)
        smooth = flag("smooth", smooth)
        smooth_factor = in_range("smooth_factor", smooth_factor, 1.0)
        grad_tol = non_negative("grad_tol", grad_tol)
        exponent = epoch_exponent(n_batches_per_epoch, batch_size, num_samples)
        defaults: dict[str, Any] = dict(
            polyak_c=c,
            gamma_max=gamma_max,
            f_star=f_star,
            smooth=smooth,
            smooth_factor=smooth_factor,
            grad_tol=grad_tol,
        )
        if fixed_step_size is not None:
            defaults["fixed_step_size"] = positive("fixed_step_size", fixed_step_size)
        super().__init__(params, defaults)
        self._explicit_exponent = exponent
        self._prev_step: float | None = None  # γ_{t-1} of the smoothed cap (None: no step taken yet)
        self._report: dict[str, float] = {}

    def cap(self) -> float:
        """The cap :math:`\\gamma_{b,t}` of the next step (:func:`fedlightning.optim.rules.sps_cap`)."""
        h, prev = self.hyper, self._prev_step
        growth = self.per_step_growth() if (h["smooth"] and prev is not None) else None
        return rules.sps_cap(h["gamma_max"], math.nan if prev is None else prev, growth)

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        """One SPS step on the closure's mini-batch; returns the loss."""
        h = self.hyper
        if h["smooth"]:
            self._epoch_exponent("smooth=True")  # fail before any work when b/n is unknown
        loss, params, grads, gap, grad_sq = self._polyak_inputs(closure)
        if params is None:
            return loss
        sps_step, degenerate = rules.sps_step(gap, grad_sq, h["polyak_c"], self.cap(), h["grad_tol"])
        self._report = {"sps_last_step_size": sps_step, "sps_last_loss": gap + h["f_star"], "sps_last_grad_sq": grad_sq}
        applied, moved, self._prev_step = rules.sps_after_step(
            sps_step, degenerate, self.step_scale, self._prev_step, h.get("fixed_step_size")
        )
        if moved:
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-applied)
        self._record(applied, sps_step_size=sps_step)
        return loss

    def client_report(self) -> dict[str, float]:
        """Scalars of the last step a server strategy may use (FedSPS-Global): the SPS step
        :math:`\\min\\{(f-\\ell^*)/(c\\|g\\|^2), \\gamma_b\\}`, the loss :math:`f` and :math:`\\|g\\|^2`, all
        measured at the point where the last step was taken."""
        return dict(self._report)

    def set_client_report(self, report: dict[str, float]) -> None:
        """Set what :meth:`client_report` returns (the batched form of SPS writes what each client's last step
        measured)."""
        self._report = {key: float(report[key]) for key in ("sps_last_step_size", "sps_last_loss", "sps_last_grad_sq")}

    def get_client_state(self) -> dict[str, Any]:
        """Smoothed SPS: ``{"prev_step": γ_{t-1}}``; plain SPS is stateless (``{}``)."""
        if self.hyper["smooth"] and self.hyper.get("fixed_step_size") is None:
            return {"prev_step": self._prev_step}
        return {}

    def set_client_state(self, state: dict[str, Any]) -> None:
        super().set_client_state(state)
        self._prev_step = self._state_step(state, "prev_step")


class DecSPS(ClosureOptimizer):
    r"""Decreasing stochastic Polyak step (DecSPS, Orvieto et al. 2022; FedDecSPS, seed 001 §5).

    **DecSPS** — Orvieto et al. 2022; the client optimizer of FedDecSPS (seed 001 §5):

    .. math::
        \gamma_t = \frac{1}{c_t}\min\Big\{\frac{f(w_t; b_t) - \ell^*}{\|g_t\|^2},\ c_{t-1}\gamma_{t-1}\Big\},
        \qquad c_t = c_0\sqrt{t+1},\quad c_{-1} = c_0,\quad \gamma_{-1} = \gamma_b

    (no separate :math:`c`; :math:`c_t` replaces it). Consequences used by the tests: :math:`\gamma_0 =
    \min\{\text{ratio}_0/c_0, \gamma_b\}`, :math:`\gamma_t \le \gamma_{t-1}\sqrt{t/(t+1)}`, :math:`\gamma_t \le
    \gamma_b/\sqrt{t+1}`.

    Degenerate steps, non-finite values, per-client state and the client step-size scale follow the decisions in
    :class:`SPS`'s docstring. Decision (ours; seed 001 leaves open whether FedDecSPS also smooths its cap): no
    smoothing. DecSPS's own bound :math:`c_{t-1}\gamma_{t-1}/c_t` already caps each step by the previous one, and
    Orvieto et al.'s DecSPS has none.

    Args:
        params: parameters or param groups (all groups share the hyperparameters).
        c0: :math:`c_0 > 0` of :math:`c_t = c_0\sqrt{t+1}`. Default 0.5 (seed 001).
        gamma_max: :math:`\gamma_b = \gamma_{-1}`. Default 1.0 (seed 001).
        f_star: lower bound :math:`\ell^*` of the loss. Default 0.0 (seed 001).
        grad_tol: below this gradient norm no step is taken. Default 1e-8 (reference SPS).
    """

    def __init__(self, params, c0: float = 0.5, gamma_max: float = 1.0, f_star: float = 0.0, grad_tol: float = 1e-8):
        c0 = positive("c0", c0)
        gamma_max = positive("gamma_max", gamma_max)
        f_star = number("f_star", f_star)
        grad_tol = non_negative("grad_tol", grad_tol)
        super().__init__(params, dict(c0=c0, gamma_max=gamma_max, f_star=f_star, grad_tol=grad_tol))
        self.t = 0  # steps taken by this client (the index of the next step)
        self.gamma_prev = gamma_max  # γ_{t-1} (γ_{-1} = γ_b)

    def next_bound(self) -> float:
        """:math:`c_{t-1}\\gamma_{t-1}/c_t`, the largest step the next iteration may take."""
        bound, c_t = rules.decsps_bound(self.hyper["c0"], self.t, self.gamma_prev)
        return bound / c_t

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        """One DecSPS step on the closure's mini-batch; returns the loss."""
        h = self.hyper
        loss, params, grads, gap, grad_sq = self._polyak_inputs(closure)
        if params is None:
            return loss
        t = self.t
        gamma, degenerate = rules.decsps_step(gap, grad_sq, t, self.gamma_prev, h["c0"], h["grad_tol"])
        # the client scale multiplies the applied step only (SPS docstring)
        applied, moved, (self.t, self.gamma_prev) = rules.polyak_after_step(
            gamma, degenerate, self.step_scale, (t, self.gamma_prev), (t + 1, gamma)
        )
        if moved:
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-applied)
        self._record(applied)
        return loss

    def get_client_state(self) -> dict[str, Any]:
        """``{"t": steps taken, "gamma_prev": γ_{t-1}}``."""
        return {"t": self.t, "gamma_prev": self.gamma_prev}

    def set_client_state(self, state: dict[str, Any]) -> None:
        super().set_client_state(state)
        t = integer("t", int(state.get("t", 0)), 0, label="client state t")
        gamma_prev = self._state_step(state, "gamma_prev", self.hyper["gamma_max"])
        if gamma_prev is None:  # DecSPS always has a previous step (γ_max before the first)
            raise ValueError("client state gamma_prev must be a finite number > 0, got None")
        self.t, self.gamma_prev = t, gamma_prev
