r"""SGD with a stochastic Armijo backtracking line search (SGD-Armijo): :class:`SgdArmijo`.

Vaswani et al. 2019, "Painless Stochastic Gradient" (Algorithm 1); the client solver of FedSLS / FedExpSLS
("Painless Federated Learning", seed 000, Algorithms 2–5) and FedLi-LS. Every step draws one mini-batch and takes

.. math::
    w_k = w_{k-1} - \eta_k g, \qquad
    \eta_k = \max\{\eta_0 \beta^m :\ f(w_{k-1} - \eta g; b_k) \le f(w_{k-1}; b_k) - c\,\eta\,\|g\|^2\}

on the same mini-batch on both sides, with :math:`\eta_0` from the ``reset`` policy. The reset policies and every
decision the papers leave open (growth per epoch, zero gradient, exhausted search, trial RNG, persistence across
rounds, client step-size scale) are in :class:`SgdArmijo`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import flag, in_range, integer, non_negative, one_of, positive
from fedlightning.optim import rules
from fedlightning.optim._common import ClosureOptimizer, RngSnapshot, epoch_exponent

__all__ = ["SgdArmijo"]

RESETS = ("max", "last", "grow")


class SgdArmijo(ClosureOptimizer):
    r"""SGD with stochastic Armijo line search (Vaswani et al. 2019; seed 000 Alg. 2–3).

    Vaswani et al. 2019, "Painless Stochastic Gradient" (Algorithm 1); the client solver of FedSLS / FedExpSLS
    (seed 000, Algorithms 2–5) and FedLi-LS (seed 002). Every step draws one mini-batch :math:`b_k` and returns

    .. math::
        w_k = w_{k-1} - \eta_k g, \qquad g = \nabla f(w_{k-1}; b_k), \qquad
        \eta_k = \max\{\eta = \eta_0 \beta^m,\ m = 0, 1, \dots :\
            f(w_{k-1} - \eta g; b_k) \le f(w_{k-1}; b_k) - c\,\eta\,\|g\|^2\}

    (the largest point of the grid :math:`\eta_0\beta^m` that satisfies the Armijo condition, on the SAME mini-batch on
    both sides; :math:`\|g\|` over all parameters jointly). The start :math:`\eta_0` comes from the reset policy
    (seed 000, Algorithm 3), with :math:`\eta_{k-1}` the step accepted at the previous step:

    =========  ============  =====================================================================================
    ``reset``  seed 000      :math:`\eta_0`
    =========  ============  =====================================================================================
    ``"max"``  opt 1         :math:`\eta_{l,\max}` (``eta_max``) at every step — the setting of the theory (Lemma 6)
    ``"last"`` opt 0         :math:`\eta_{k-1}` (continue damping from the last accepted step)
    ``"grow"`` opt 2         :math:`\min\{\eta_{k-1}\,\delta^{1/\lceil n/b\rceil},\ \eta_{l,\max}\}`
    =========  ============  =====================================================================================

    and :math:`\eta_0 = \eta_{l,\max}` at the first step (Algorithm 3, ``k = 1``), or ``init_step_size`` where given.

    Decisions the papers leave open ("Painless Federated Learning", Alg. 2 and 3; the reference Sls code of Vaswani
    et al.), all ours unless a source is named:

    * **Cap of ``"grow"``**: the grown step is capped at ``eta_max`` (Vaswani et al.'s paper and seed 000's theory
      assume :math:`\eta \in (0, \eta_{l,\max}]`; the current reference Sls code has no cap).
    * **First step below the cap** (``init_step_size``): seed 002's reference code starts every client's search at
      ``init_step_size = 1`` and lets ``"grow"`` raise the step from there, with ``eta_max = 10`` enforced only in
      its Goldstein branch (digest of seed 002, §2.2 defaults); with ``eta_max`` as both start and cap, as in seed
      000 and Vaswani et al., a step could never grow past its first value. ``init_step_size`` is the first trial step
      of a client's first search (of each round, or of the run with ``carry_step_size``) under ``"last"`` /
      ``"grow"``, and ``eta_max`` stays the cap, as seed 002's theory assumes (:math:`\eta \in (0, \eta_{\max}]`,
      its Lemma 2). It must not exceed ``eta_max``; with ``"max"`` every search starts at ``eta_max``, so it is
      refused there.
    * **Growth of ``"grow"``: at most** :math:`\delta` **per local epoch.** Seed 000 and Vaswani et al. write
      :math:`\delta^{b/n}` per step so that one epoch (:math:`n/b` steps) grows the step by :math:`\delta`; the
      reference Sls code passes ``n_batches_per_epoch = n/b`` for the same intent. We use the steps one epoch of the
      client's loader really takes, :math:`\lceil n/b\rceil` (last partial batch kept): the per-step factor is
      :math:`\delta^{1/\lceil n/b\rceil}`, which equals :math:`\delta^{b/n}` whenever :math:`b` divides :math:`n` and is
      :math:`\delta` per step when :math:`n \le b` (there every step is a whole epoch; :math:`\delta^{b/n}` would be
      ×14.4 per step for 13 samples, batch 50, :math:`\delta = 2`). The epoch length comes from
      ``n_batches_per_epoch`` (``>= 1``) or ``batch_size`` + ``num_samples`` given to the constructor; otherwise, inside
      a :class:`~fedlightning.FederatedLoop`, the loop calls :meth:`set_client_data` with the client's own :math:`n_i`
      and the data module's ``batch_size`` (seed 000: :math:`n` = the client's number of samples). Outside the loop,
      ``reset="grow"`` without these raises a ValueError at the first step.
    * **Zero gradient** (``‖g‖ < grad_tol``, default 1e-8 as the reference Sls): no trial, no parameter change,
      recorded step size ``0.0``; :math:`\eta_{k-1}` is left as it was (the current Sls code does the same to the
      parameters but stores the reset step).
    * **Exhausted backtracking**: the grid is :math:`\eta_0\beta^m` for ``m = 0..max_backtracks``
      (``max_backtracks + 1`` trial points; default 100 as the reference Sls). If none satisfies the condition the
      parameters are left unchanged (recorded step size ``0.0``, ``max_backtracks + 1`` backtracks) — not the
      reference's :math:`w - 10^{-6} g`, which is not an Armijo step. For ``"last"``/``"grow"``, :math:`\eta_{k-1}`
      becomes the next grid point :math:`\eta_0\beta^{\text{max\_backtracks}+1}`, so the next search continues below the
      rejected grid.
    * **Trial evaluations** call the closure under ``torch.no_grad()`` after restoring the CPU RNG state (and the CUDA
      RNG state of the parameters' device) saved before the gradient evaluation, so dropout draws the same masks as in
      the gradient evaluation (the reference reseeds from wall-clock time; we never reseed). After the step the RNG is
      left in the state the gradient evaluation left it in, so the number of trials does not change later randomness.
      Inside the FederatedLoop the closure also restores every model buffer after a no-grad call, so trial forwards do
      not update BatchNorm running statistics.
    * **Non-finite loss or gradient**: parameters unchanged, step size ``nan``, :math:`\eta_{k-1}` unchanged, the loss
      is returned (the FederatedLoop skips a client whose loss is non-finite). A non-finite *trial* loss simply fails
      the Armijo test (the comparison is False) and the search backtracks.
    * **Persistence across rounds** (``carry_step_size``, default False): seed 000's Algorithm 3 restarts every round at
      :math:`\eta_{l,\max}` (``k = 1``), so by default each round's first search starts at ``eta_max``. With
      ``carry_step_size=True`` the first step of a round continues from the step this client accepted last (its
      ``get_client_state()["step_size"]``, stored by the FederatedLoop per client and checkpointed) with the ``"last"``
      / ``"grow"`` rule. The client state is ``{"step_size": η_{k-1}, "accepted_step_size": ...}``: the search state
      (after an exhausted search the next grid point, not an accepted step) and the last step the line search really
      accepted (kept across rounds, never reset by zero-gradient or exhausted steps). :meth:`client_report` sends the
      latter as ``armijo_accepted_step_size`` (FedLi-LS's ``η_i``).
    * **Client step-size scale** (:meth:`scale_step`, the loop's ``client_lr_scale``: ``KDecay(decay="client_lr")``):
      the line search runs unchanged (grid, Armijo test, :math:`\eta_{k-1}` and the accepted step all in the rule's own
      units) and the update applies :math:`s\,\eta_k`. Reasoning (seed 004): its η-decay schedules multiply the step
      every local update takes by :math:`s_r` relative to the undecayed run. Scaling only ``eta_max`` would not do
      that: a search that backtracks below :math:`s\,\eta_{l,\max}` is unaffected, and ``reset="last"`` never looks at
      ``eta_max`` again after the first step. Scaling the state instead would compound :math:`s` from step to step
      through ``"last"`` / ``"grow"``. With :math:`s > 1` (seed 004's error schedule when the loss rises above
      :math:`F_0`) the applied step exceeds the accepted Armijo step, as an SGD learning rate times :math:`s` would.
      ``last_step["step_size"]`` is the applied step :math:`s\,\eta_k`.

    Cost per step: 1 forward + 1 backward for the gradient, one forward per trial point, one parameter copy, and one
    host synchronisation per trial (the accept/reject decision) plus one for ``(loss, ‖g‖²)``.

    Args:
        params: parameters or param groups (all groups must share the hyperparameters: one step size for all).
        eta_max: :math:`\eta_{l,\max}`, the upper bound and first trial step. Default 1.0 (the reference Sls
            ``init_step_size``; seed 000 does not report its value).
        init_step_size: the first trial step of a client's first search, at most ``eta_max``, for ``reset="last"`` /
            ``"grow"`` (above). Default None: ``eta_max`` (seed 000 Alg. 3, Vaswani et al.). Seed 002's configs:
            1.0 with ``eta_max`` 10.0 (its reference code).
        c: Armijo constant in (0, 1). Default 0.1 (Vaswani et al. 2019).
        beta: backtracking factor :math:`\beta \in (0, 1)`. Default 0.9 (Vaswani et al. 2019).
        reset: ``"max"`` (seed 000 opt 1, default: the policy its theory analyses), ``"last"`` (opt 0) or
            ``"grow"`` (opt 2).
        delta: growth factor :math:`\delta > 1` of ``"grow"`` per local epoch (per step
            :math:`\delta^{1/\lceil n/b\rceil}`, above). Default 2.0 (Vaswani et al.; reference Sls
            ``gamma``).
        n_batches_per_epoch: steps per epoch (``>= 1``) for ``"grow"`` (alternatively ``batch_size`` and
            ``num_samples``: :math:`\lceil n/b\rceil`).
        batch_size, num_samples: :math:`b` and :math:`n` for ``"grow"``.
        max_backtracks: largest exponent ``m`` of the grid (``max_backtracks + 1`` trials at most). Default 100
            (reference Sls).
        grad_tol: below this gradient norm no step is taken. Default 1e-8 (reference Sls).
        carry_step_size: start a round from the client's last accepted step (see above). Default
            False (seed 000 Alg. 3 restarts at ``eta_max``). With ``reset="max"`` it would change nothing and is
            refused, as ``init_step_size`` is.
    """

    growth_setting = ("delta", 'reset="grow"')

    def __init__(
        self,
        params,
        eta_max: float = 1.0,
        c: float = 0.1,
        beta: float = 0.9,
        reset: str = "max",
        delta: float = 2.0,
        n_batches_per_epoch: float | None = None,
        batch_size: int | None = None,
        num_samples: int | None = None,
        max_backtracks: int = 100,
        grad_tol: float = 1e-8,
        carry_step_size: bool = False,
        init_step_size: float | None = None,
    ):
        eta_max = positive("eta_max", eta_max)
        c = in_range("c", c, 0.0, 1.0, low_closed=False)
        beta = in_range("beta", beta, 0.0, 1.0, low_closed=False)
        reset = one_of("reset", reset, RESETS)
        # a growth factor ("Painless Federated Learning", Alg. 3)
        delta = in_range("delta", delta, 1.0, low_closed=False)
        max_backtracks = integer("max_backtracks", max_backtracks, 0)
        grad_tol = non_negative("grad_tol", grad_tol)
        carry_step_size = flag("carry_step_size", carry_step_size)
        if init_step_size is not None:
            init_step_size = positive("init_step_size", init_step_size)
            if init_step_size > eta_max:
                raise ValueError(
                    f"SgdArmijo: init_step_size={init_step_size!r} exceeds eta_max={eta_max!r}; the first trial step "
                    "must lie in (0, eta_max]"
                )
            if reset == "max":
                raise ValueError(
                    f"SgdArmijo: init_step_size={init_step_size!r} has no effect with reset='max' (every search starts "
                    "at eta_max); use reset='last' or 'grow', or leave init_step_size unset"
                )
        if carry_step_size and reset == "max":
            raise ValueError(
                "SgdArmijo: carry_step_size=True has no effect with reset='max' (every search starts at eta_max, "
                "whatever step the client accepted before); use reset='last' or 'grow', or carry_step_size=False"
            )
        exponent = epoch_exponent(n_batches_per_epoch, batch_size, num_samples)
        defaults = dict(
            eta_max=eta_max,
            c=c,
            beta=beta,
            reset=reset,
            delta=delta,
            max_backtracks=max_backtracks,
            grad_tol=grad_tol,
            init_step_size=init_step_size,
        )
        super().__init__(params, defaults)
        self._explicit_exponent = exponent
        self.carry_step_size = carry_step_size
        self._prev_step: float | None = None  # η_{k-1}: step accepted at the previous step (None before the first)
        self._carried_step: float | None = None  # last accepted step of the client's previous round
        self._accepted_step: float | None = None  # the last step the line search accepted (across rounds)
        self._start: list | None = None  # reusable copy of w_{k-1}

    # ------------------------------------------------------------------ reset policy (seed 000 Alg. 3)
    def initial_step_size(self) -> float:
        """:math:`\\eta_0` of the next search (:func:`fedlightning.optim.rules.armijo_initial_step`)."""
        h = self.hyper
        prev = self._prev_step
        if prev is None and self.carry_step_size:
            prev = self._carried_step
        growth = self.per_step_growth() if (h["reset"] == "grow" and prev is not None) else 1.0
        prev = math.nan if prev is None else prev
        return rules.armijo_initial_step(h["reset"], h["eta_max"], prev, growth, h.get("init_step_size"))

    # ------------------------------------------------------------------ step
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        """One SGD-Armijo step on the closure's mini-batch; returns the loss at the original point."""
        h = self.hyper
        if h["reset"] == "grow":
            self._epoch_exponent('reset="grow"')  # fail before any work when b/n is unknown
        first_params = self.param_groups[0]["params"]
        device = first_params[0].device if first_params else None
        rng_before = RngSnapshot(device)
        loss = self._loss_and_grad(closure)
        params, grads = self._params_with_grad()
        if not params:
            self._record(0.0)
            return loss
        loss_value, grad_sq_value = self._loss_and_squared_norm(loss, grads)
        if not rules.finite_step(loss_value, grad_sq_value):
            self._record(float("nan"))
            return loss
        if rules.flat_gradient(grad_sq_value, h["grad_tol"]):
            self._record(0.0)
            return loss

        eta0 = self.initial_step_size()
        rng_after = RngSnapshot(device)
        c, powers = h["c"], rules.armijo_powers(h["beta"], h["max_backtracks"])
        forwards, backtracks, accepted = 1, 0, None
        with torch.no_grad():
            start = self._start_buffers(params)  # w_{k-1} (a copy; trial points are w_{k-1} - η g)
            try:
                for m in range(h["max_backtracks"] + 1):
                    eta = eta0 * powers[m]
                    if m > 0:
                        torch._foreach_copy_(params, start)
                    torch._foreach_add_(params, grads, alpha=-eta)
                    rng_before.restore()
                    trial = closure()
                    forwards += 1
                    if rules.armijo_accepts(float(trial), loss_value, grad_sq_value, c, eta):
                        accepted = eta
                        break
                    backtracks += 1
            except BaseException:  # a failing trial evaluation leaves the model at w_{k-1}
                torch._foreach_copy_(params, start)
                rng_after.restore()
                raise
            if accepted is None:
                torch._foreach_copy_(params, start)
            elif self.step_scale != 1.0:  # the update applies s·η_k (SgdArmijo docstring)
                torch._foreach_copy_(params, start)
                torch._foreach_add_(params, grads, alpha=-(self.step_scale * accepted))
        rng_after.restore()
        found = accepted is not None
        self._prev_step, self._accepted_step = rules.armijo_after_search(
            eta0, accepted, found, not found, self._prev_step, self._accepted_step, powers[-1]
        )
        self._record(self.step_scale * accepted if found else 0.0, backtracks, forwards, 1)
        return loss

    def _start_buffers(self, params):
        """A copy of the current parameters in buffers allocated once per optimizer (reused across steps)."""
        buffers = self._start
        if (
            buffers is None
            or len(buffers) != len(params)
            or any(b.shape != p.shape or b.dtype != p.dtype or b.device != p.device for b, p in zip(buffers, params))
        ):
            buffers = self._start = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(buffers, params)
        return buffers

    # ------------------------------------------------------------------ per-client state
    def get_client_state(self) -> dict[str, Any]:
        """``{"step_size": η_{k-1}, "accepted_step_size": last accepted step}`` (SgdArmijo docstring; None where this
        client has none yet)."""
        prev = self._prev_step if self._prev_step is not None else self._carried_step
        return {"step_size": prev, "accepted_step_size": self._accepted_step}

    def set_client_state(self, state: dict[str, Any]) -> None:
        super().set_client_state(state)
        self._carried_step = self._state_step(state, "step_size")
        self._accepted_step = self._state_step(state, "accepted_step_size")

    def client_report(self) -> dict[str, float]:
        """``{"armijo_accepted_step_size": η}``: the last step the line search accepted, in this round or an earlier
        one of this client (NaN if none); a zero-gradient or exhausted step does not replace it. Before any
        client-step scale (FedLi-LS's ``η_i``, :class:`~fedlightning.callbacks.FedLiLS`)."""
        value = self._accepted_step
        return {"armijo_accepted_step_size": float("nan") if value is None else float(value)}
