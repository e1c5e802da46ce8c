"""FedLi-LS and FedLi-LU ("Towards Hyper-parameter-free Federated Learning", arXiv 2408.17145; seed 002).

**FedLi-LS** (:class:`FedLiLS`): SgdArmijo clients; the server steps ``w_{t+1} = w_t − η_g Δ_t`` with ``η_g`` the
largest step size the round's clients' line searches accepted (1 for convex problems).

**FedLi-LU** (:class:`FedLiLU`): SGD clients; one Deep-Frank-Wolfe server step (Berrada et al. 2018,
:class:`DFWServerOptimizer`) ``w_{t+1} = w_t − η (λ w_t + γ_t Δ_t)`` with the clipped optimal step ``γ_t``
(:func:`dfw_gamma`) computed from the clients' mean loss.

The formulas, defaults and the decisions the paper leaves open are in the two classes' docstrings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from fedlightning._validation import in_range, non_negative, one_of, positive
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.state import ClientUpdate, RoundPlan, flat_params

__all__ = ["FedLiLS", "FedLiLU", "DFWServerOptimizer", "dfw_gamma"]


def dfw_gamma(
    pseudo_objective: float, delta: Tensor, weights: Tensor, lr: float, weight_decay: float, eps: float
) -> tuple[float, float]:
    """``(γ_t, raw)``: DFW's optimal step ``raw = (F̂ − η⟨λw, Δ⟩)/(η‖Δ‖² + ε)`` and its clip to ``[0, 1]``."""
    d = delta.double()
    r = weights.double() * weight_decay
    num = pseudo_objective - lr * float(torch.dot(r, d).item())
    den = lr * float(d.pow(2).sum().item()) + eps
    raw = num / den if den > 0 else (math.inf if num > 0 else 0.0)
    return min(1.0, max(0.0, raw)), raw


class DFWServerOptimizer(torch.optim.Optimizer):
    """DFW's update with a given ``γ`` (param-group key ``"gamma"``, set by :class:`FedLiLU` every round).

    ``p.grad`` holds ``Δ_t``. ``w ← w − η(λw + γΔ)``; with momentum ``z ← μz − ηγ(Δ + λw)``, ``w ← w + μz``
    (``λw`` taken at the pre-step weights, as in DFW's code).
    """

    def __init__(self, params: Iterable, lr: float, momentum: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, gamma=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd, gamma = group["lr"], group["momentum"], group["weight_decay"], group["gamma"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                delta = p.grad
                r = p * wd
                p.sub_(lr * (r + gamma * delta))
                if mu:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    z = state["momentum_buffer"]
                    z.mul_(mu).sub_(lr * gamma * (delta + r))
                    p.add_(z, alpha=mu)
        return loss


class FedLiLS(ServerStrategy):
    r"""FedLi-LS server: ``η_g`` = max of the clients' last accepted step sizes (or 1 with ``convex=True``).

    **FedLi-LS** (federated line search; clients run :class:`~fedlightning.optim.SgdArmijo`). Each client reports the
    last step size its line search accepted ``η_i``; the server takes one gradient step on the pseudo-gradient

    .. math::
        \Delta_t = \frac{\sum_{i\in S_t} p_i (w_t - w_i)}{\sum_i p_i},\qquad
        \eta_g = \max_{i\in S_t} \eta_i \ \text{(non-convex)} \quad\text{or}\quad \eta_g = 1 \ \text{(convex)},\qquad
        w_{t+1} = w_t - \eta_g \Delta_t .

    Decisions (what "Towards Hyper-parameter-free Federated Learning", Alg. 1 and 2, leaves open):

    * Weighting ``p_i = n_i`` (``weighting="samples"``, the reference code) for both strategies.
    * FedLi-LS's ``η_i`` is the client's last *accepted* line-search step: SgdArmijo's ``armijo_accepted_step_size``
      (``client_report``, held in its per-client state across rounds). A zero-gradient step or an exhausted search
      records step size 0 and does not replace it, so a round in which clients end on such steps keeps a positive
      ``η_g`` (taking the last entry of the round's step sizes would give ``η_g = 0`` and lose the round when every
      client ends that way). It is the step before any client step-size scale (``client_lr_scale``, e.g.
      ``KDecay(decay="client_lr")``): that schedule acts on the clients' moves, which ``Δ_t`` already contains; scaling
      ``η_g`` too would apply it twice. Clients whose optimizer sends no such report (e.g. ``torch.optim.SGD``) use the
      last positive finite step size they took this round (refused when its parameter groups take different learning
      rates: which one is the client's step is not defined). Clients with neither (no step accepted yet) are left out
      of the maximum; if no client has one the round raises. No cap on ``η_g`` (the paper states none);
      ``server/eta_g`` is logged.

    Args:
        convex: use ``η_g = 1`` (the paper's rule for convex / strongly convex problems). Default False: the
            max-of-client-steps heuristic of the paper's deep-learning experiments.
        weighting: default ``"samples"`` (reference code).
    """

    def __init__(self, convex: bool = False, weighting: str = "samples"):
        super().__init__(server_lr=1.0, weighting=weighting)
        self.convex = bool(convex)

    @staticmethod
    def client_step_size(update: ClientUpdate) -> float:
        """``η_i``: the client's last accepted line-search step (FedLiLS docstring); NaN when it has none."""
        reported = update.payload.get("armijo_accepted_step_size")
        if reported is not None:
            reported = float(reported)
            return reported if math.isfinite(reported) and reported > 0 else float("nan")
        if update.param_step_size_sums is not None:
            raise ValueError(
                "FedLiLS takes the server step size from each client's last local step size, but the client "
                "optimizer's parameter groups took different learning rates (sums per parameter "
                f"{sorted(set(update.param_step_size_sums))}): give its parameter groups one learning rate"
            )
        moved = [s for s in update.step_sizes if math.isfinite(s) and s > 0]
        return moved[-1] if moved else float("nan")

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        super().accumulate(stats, update)
        last = self.client_step_size(update)
        if math.isfinite(last):
            stats.maximum("last_step_size_max", last, update.delta.device)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        if "last_step_size_max" not in stats:
            raise RuntimeError(
                f"round {plan.round}: FedLiLS needs each client's last accepted step size, but no client has accepted "
                "a step yet (all steps had zero gradient or exhausted line searches)"
            )
        max_step = float(stats["last_step_size_max"].item())
        eta = 1.0 if self.convex else max_step
        return delta, eta, {"server/eta_g": eta, "server/max_client_last_step": max_step}

    def __repr__(self) -> str:
        return f"FedLiLS(convex={self.convex}, weighting={self.weighting!r})"


class FedLiLU(ServerStrategy):
    r"""FedLi-LU server: one Deep-Frank-Wolfe step on the pseudo-gradient with the clients' mean loss.

    **FedLi-LU** (federated linearised updates; SGD clients, Deep-Frank-Wolfe server step of Berrada et al. 2018).
    Clients report a loss value ``f_i``; with ``F̂_t = Σ p_i f_i / Σ p_i`` and ``r_t = λ w_t`` (gradient of
    ``λ/2‖w‖²``):

    .. math::
        \gamma_t = \mathrm{clip}_{[0,1]}\Bigl(\frac{\hat F_t - \eta\langle r_t, \Delta_t\rangle}
                                                  {\eta\lVert\Delta_t\rVert^2 + \epsilon}\Bigr),\qquad
        w_{t+1} = w_t - \eta (r_t + \gamma_t \Delta_t),

    and with momentum ``μ > 0`` (DFW's form; ``z`` starts at 0 and persists across rounds)
    ``z ← μ z − η γ_t (Δ_t + r_t)``, ``w_{t+1} ← w_{t+1} + μ z``. Inner products and norms run over all trainable
    parameters jointly (one scalar ``γ_t`` per round).

    Decisions (what "Towards Hyper-parameter-free Federated Learning", Alg. 1 and 2, leaves open):

    * Weighting ``p_i = n_i`` (``weighting="samples"``, the reference code), as for FedLi-LS.
    * FedLi-LU's ``f_i``: the mean mini-batch loss over the client's local steps (``client_loss="mean"``, the
      quantity the paper plots as "train loss" and the code intends) or the first-batch loss at ``w_t``
      (``client_loss="first"``, the quantity of the paper's one-step derivation). It is the client's *objective*
      value: with extra client-objective terms (e.g. a proximal term) configured they are included.
    * FedLi-LU defaults ``lr=η=0.01``, ``momentum=0.9``, ``weight_decay=λ=1e-5``, ``dfw_eps=ε=1e-5``: the reference
      code's server DFW values (the paper's values are missing from the text). ``ε`` is called ``dfw_eps``, not
      ``eps``: the ``eps`` of FedExP / FedExProx regularises another quantity, and a configuration switching between
      the strategies would otherwise carry one into the other.

    The DFW momentum buffer ``z`` lives in the server optimizer (:class:`DFWServerOptimizer`) and is checkpointed by
    Lightning with it. Logged: ``server/eta_g`` (LS: η_g; LU: the effective ``η·γ_t``) and ``server/eta_g_raw``
    (LS: the same, nothing is clipped; LU: ``η`` times the unclipped ``γ_t``), ``server/dfw_gamma`` and
    ``server/dfw_gamma_raw`` (before clipping), ``server/pseudo_objective`` (``F̂_t``).

    Args:
        lr: DFW's proximal coefficient ``η`` (default 0.01, reference code).
        momentum: DFW momentum ``μ ∈ [0, 1)`` (default 0.9, reference code).
        weight_decay: ``λ ≥ 0`` of the regulariser ``λ/2‖w‖²`` (default 1e-5, reference code).
        dfw_eps: ``ε ≥ 0`` in the denominator of ``γ_t`` (default 1e-5, reference code).
        client_loss: ``"mean"`` (default) or ``"first"``: which client loss forms ``F̂_t`` (see above).
        weighting: default ``"samples"`` (reference code).
    """

    def __init__(
        self,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 1e-5,
        dfw_eps: float = 1e-5,
        client_loss: str = "mean",
        weighting: str = "samples",
    ):
        lr = positive("lr", lr)
        super().__init__(server_lr=lr, weighting=weighting)
        self.momentum = in_range("momentum", momentum, 0.0, 1.0)
        self.weight_decay = non_negative("weight_decay", weight_decay)
        self.eps = non_negative("dfw_eps", dfw_eps)
        self.client_loss = one_of("client_loss", client_loss, ("mean", "first"))
        self._optimizer: DFWServerOptimizer | None = None

    def configure_server_optimizer(self, params):
        self._optimizer = DFWServerOptimizer(
            params, lr=self.server_lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        return self._optimizer

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        super().accumulate(stats, update)
        loss = update.mean_loss if self.client_loss == "mean" else update.first_loss
        stats.add("weighted_client_loss", self.client_weight(update) * float(loss), update.delta.device)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        f_hat = float(stats["weighted_client_loss"].item()) / float(stats["weight"].item())
        weights = flat_params(loop.global_parameters())
        gamma, raw = dfw_gamma(f_hat, delta, weights, self.server_lr, self.weight_decay, self.eps)
        if self._optimizer is None:
            raise RuntimeError("FedLiLU's server optimizer was not configured (fit the loop with a Trainer)")
        for group in self._optimizer.param_groups:
            group["gamma"] = gamma
        metrics: dict[str, float] = {
            "server/dfw_gamma": gamma,
            "server/dfw_gamma_raw": raw,
            "server/pseudo_objective": f_hat,
            "server/eta_g": self.server_lr * gamma,
            "server/eta_g_raw": self.server_lr * raw,
        }
        return delta, None, metrics

    def __repr__(self) -> str:
        return (
            f"FedLiLU(lr={self.server_lr}, momentum={self.momentum}, weight_decay={self.weight_decay}, "
            f"dfw_eps={self.eps}, client_loss={self.client_loss!r}, weighting={self.weighting!r})"
        )
