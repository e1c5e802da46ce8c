"""FedExProx: proximal clients with server extrapolation (Li, Acharya & Richtárik, "The Power of Extrapolation in
Federated Learning", NeurIPS 2024): :class:`FedExProx`.

Each client inexactly solves ``min_w f_i(w) + (μ/2)‖w − w_t‖²``; with ``Δ = Σ p_i Δ_i / Σ p_i`` the server steps
``w_{t+1} = w_t − α_t Δ`` with a constant ``α_t`` or the gradient-diversity rule (GraDS,
:func:`grads_extrapolation`) ``α_t = mean‖Δ_i‖² / (‖Δ‖² + ε)``. The rules, what is not implemented (StoPS) and
the decisions are in :class:`FedExProx`'s docstring.
"""

from __future__ import annotations

from fedlightning._validation import non_negative, one_of
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.callbacks.proximal import ProximalTerm, global_anchors
from fedlightning.objectives import AnchoredTerm
from fedlightning.state import RoundPlan, squared_norm64

__all__ = ["FedExProx", "grads_extrapolation"]

_RULES = ("constant", "grads")


def grads_extrapolation(mean_client_sq_norm: float, delta_sq_norm: float, eps: float = 0.0) -> float:
    """GraDS: ``α = mean‖Δ_i‖² / (‖Δ‖² + ε)``; 1 when the denominator is zero."""
    denom = delta_sq_norm + eps
    if denom == 0.0:
        return 1.0
    return mean_client_sq_norm / denom


class FedExProx(ServerStrategy):
    r"""FedExProx: proximal clients, extrapolated server step.

    Each sampled client approximates the proximal point ``p_i = prox_{γ f_i}(w_t)``, i.e. solves
    ``min_w f_i(w) + (μ/2)‖w − w_t‖²`` with ``μ = 1/γ`` by its local steps (an *inexact* prox: ``K`` steps of the
    client optimizer, as in the FedProx local solver). With ``Δ_i = w_t − p_i`` and ``Δ = Σ p_i Δ_i / Σ p_i`` the
    server extrapolates

    .. math::
        w_{t+1} = w_t - \alpha_t \Delta ,\qquad
        \alpha_t = \begin{cases}
            \alpha
                & \text{rule "constant" (} \alpha = \texttt{server\_lr}
                  \text{; the paper's } 1/(\gamma L_\gamma)\text{)}\\
            \dfrac{\sum_i p_i\lVert\Delta_i\rVert^2 / \sum_i p_i}{\lVert\Delta\rVert^2 + \epsilon}
                & \text{rule "grads" (gradient diversity, GraDS)}
        \end{cases}

    Implemented: the constant and the GraDS rules. Not implemented: StoPS (it needs each client's Moreau-envelope
    value ``f_i(p_i) + ‖w_t − p_i‖²/(2γ)`` and its infimum, which clients do not report).

    Decisions:

    * ``mu > 0`` adds the proximal term to every client's objective (an
      :class:`~fedlightning.objectives.AnchoredTerm`, as :class:`~fedlightning.callbacks.ProximalTerm`'s; do not
      configure both). ``mu = 0`` leaves the client objective
      alone (then GraDS is FedExP's rule without its ``1/2`` and ``max{1, ·}``).
    * GraDS is ``≥ 1`` automatically (Jensen: ``mean‖Δ_i‖² ≥ ‖mean Δ_i‖²``), so no ``max{1, ·}`` is applied; with
      ``eps = 0`` (default, the paper's rule has no ``ε``) and ``Δ = 0`` the step is empty and ``α_t = 1`` is used.
    * Weighting ``"uniform"`` (default, the paper's mean over the sampled clients) or ``"samples"``.
    * The FedExP reference code's "fedprox(exp)" (FedExP's rule with proximal clients) is
      ``FedExP`` + ``ProximalTerm`` — not this class.

    Logged: ``server/eta_g`` (``α_t``) and ``server/eta_g_raw`` (identical here: no clipping).

    Args:
        mu: proximal coefficient ``μ = 1/γ ≥ 0`` of the clients. No default: the paper sets ``γ`` per problem.
        rule: ``"grads"`` (default; adaptive, needs no smoothness constant) or ``"constant"``.
        server_lr: the constant ``α`` of rule ``"constant"`` (default 1.0: plain FedProx averaging; the third-party
            FedLineSearch code's ``--fedexprox-alpha`` default). Unused by ``"grads"``.
        eps: ``ε ≥ 0`` added to GraDS' denominator (default 0, the paper).
        weighting: ``"uniform"`` (default, the paper) or ``"samples"``.
    """

    def __init__(
        self, mu: float, rule: str = "grads", server_lr: float = 1.0, eps: float = 0.0, weighting: str = "uniform"
    ):
        super().__init__(server_lr=server_lr, weighting=weighting)
        self.mu = non_negative("mu", mu)
        self.rule = one_of("rule", rule, _RULES)
        self.eps = non_negative("eps", eps)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.mu > 0 and any(isinstance(cb, ProximalTerm) and cb.mu > 0 for cb in trainer.callbacks):
            raise ValueError(
                "FedExProx(mu > 0) already adds the proximal term; remove the ProximalTerm callback or set mu=0"
            )

    def client_objective(self, trainer, pl_module, plan: RoundPlan, client_id: int):
        if self.mu == 0.0:
            return []
        return [AnchoredTerm(global_anchors(pl_module), mu=self.mu)]

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        if self.rule == "constant":
            alpha = self.server_lr
        else:
            mean_sq = float(stats["weighted_sq_norm_sum"].item()) / float(stats["weight"].item())
            alpha = grads_extrapolation(mean_sq, float(squared_norm64(delta).item()), self.eps)
        metrics: dict[str, float] = {"server/eta_g": alpha, "server/eta_g_raw": alpha}
        return delta, alpha, metrics

    def __repr__(self) -> str:
        return (
            f"FedExProx(mu={self.mu}, rule={self.rule!r}, server_lr={self.server_lr}, eps={self.eps}, "
            f"weighting={self.weighting!r})"
        )
