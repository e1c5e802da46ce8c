r"""FedExP: server step-size extrapolation (Jhunjhunwala, Wang & Joshi, "FedExP: Speeding Up Federated Averaging
via Extrapolation", ICLR 2023), as written in "Painless Federated Learning" (seed 000), Alg. 5 (FedExpSLS).

.. math::
    \eta_{g,t} = \max\Bigl\{1,\; \frac{\sum_{i\in S_t}\lVert\Delta^i_t\rVert^2}
                                     {2\,|S_t|\,(\lVert\Delta_t\rVert^2 + \epsilon)}\Bigr\},
    \qquad w_{t+1} = w_t - \eta_{g,t}\,\Delta_t

:class:`FedExP` (its docstring: weighting, ε, averaged-iterate evaluation, logged values) and
:func:`fedexp_server_lr` (the formula). FedExpSLS is this strategy with :class:`~fedlightning.optim.SgdArmijo`
clients (``configs/fedexpsls.yaml``).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from fedlightning._validation import non_negative
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.state import RoundPlan, assign_flat_, flat_params, squared_norm64

__all__ = ["FedExP", "fedexp_server_lr"]


def fedexp_server_lr(mean_client_sq_norm: float, delta_sq_norm: float, eps: float) -> tuple[float, float]:
    r"""``(η_g, raw)`` with ``raw = mean‖Δ_i‖² / (2(‖Δ‖² + ε))`` and ``η_g = max{1, raw}``.

    ``mean_client_sq_norm`` is ``Σ p_i‖Δ_i‖²/Σ p_i`` (``Σ‖Δ_i‖²/|S|`` for uniform weights). A zero denominator
    (``ε = 0`` and ``Δ = 0``) gives ``raw = inf`` (or 1 when every client delta is zero too) and ``η_g = 1``.
    """
    denom = 2.0 * (delta_sq_norm + eps)
    if denom == 0.0:
        raw = math.inf if mean_client_sq_norm > 0 else 1.0
        return 1.0, raw
    raw = mean_client_sq_norm / denom
    return max(1.0, raw), raw


class FedExP(ServerStrategy):
    """FedExP server extrapolation (the formula: module docstring).

    With ``Δ^i_t = w_t − w^i_{t,K}`` and ``Δ_t`` their mean. FedExpSLS is this strategy with
    :class:`~fedlightning.optim.SgdArmijo` clients (``configs/fedexpsls.yaml``).

    Decisions (the papers leave them open: "Painless Federated Learning", Alg. 5, and the FedExP paper; the FedExP
    reference code settles some):

    * **Weighting** (``weighting="uniform"``, default): the paper's uniform mean. With ``weighting="samples"`` both
      ``Δ_t`` and the mean squared norm use ``p_i = n_i`` (the reference code's ``p_i = n_i/N``):
      ``η_g = max{1, (Σ p_i‖Δ_i‖²/Σ p_i) / (2(‖Δ_t‖² + ε))}``; with equal weights this is the formula above.
    * **ε** (``eps``, default ``1e-3``: the reference code's CIFAR value; it uses 0.1 on EMNIST). The paper adds
      ``ε``; the reference code adds ``M·ε`` (``M`` = participating clients): ``scale_eps_by_clients=True``.
      ``eps = 0`` is allowed; when then ``‖Δ_t‖ = 0`` the step is empty anyway and ``η_g = 1`` is used.
    * **Averaged-iterate evaluation** (``evaluate_iterate_average=True``, off by default — the paper does not do
      it): validation and test see ``(w_t + w_{t+1})/2`` (the last two global iterates) while training continues
      from ``w_{t+1}``; after the first round the reference code evaluates ``w_1`` itself, and so does this class.
      The weights are swapped in at ``on_validation_start`` / ``on_test_start`` and restored at the matching
      ``*_end`` hook (before Lightning's ModelCheckpoint, which always runs last, saves anything). Only trainable
      parameters are averaged; buffers (BatchNorm statistics) stay those of ``w_{t+1}``.
    * The reference code also decays the client lr and ``ε`` by 0.998 per round; that is a schedule, not part of
      this rule (not implemented here).

    Logged per round: ``server/eta_g`` (η_g after the ``max{1, ·}``), ``server/eta_g_raw`` (before it) and
    ``server/eps`` (the ε actually added); the loop adds ``server/delta_norm`` and
    ``server/mean_client_delta_sq_norm``.

    Args:
        eps: ``ε ≥ 0`` in the denominator (default 1e-3, FedExP reference code, CIFAR experiments).
        scale_eps_by_clients: add ``M·ε`` instead of ``ε`` (reference code). Default False (paper).
        evaluate_iterate_average: evaluate ``(w_t + w_{t+1})/2`` (reference code). Default False (paper).
        weighting: ``"uniform"`` (default, the paper's mean) or ``"samples"`` (reference code).
    """

    def __init__(
        self,
        eps: float = 1e-3,
        scale_eps_by_clients: bool = False,
        evaluate_iterate_average: bool = False,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr=1.0, weighting=weighting)
        self.eps = non_negative("eps", eps)
        self.scale_eps_by_clients = bool(scale_eps_by_clients)
        self.evaluate_iterate_average = bool(evaluate_iterate_average)
        self._previous_iterate: Tensor | None = None  # w_t of the last round (for the averaged evaluation)
        self._swapped_out: Tensor | None = None  # w_{t+1} while the average is swapped in

    # ------------------------------------------------------------------ server step
    def extrapolation(self, stats: RoundStatistics, delta: Tensor) -> tuple[float, float, float]:
        """``(η_g, raw η_g, ε used)`` for the round's statistics and mean delta."""
        mean_sq = float(stats["weighted_sq_norm_sum"].item()) / float(stats["weight"].item())
        delta_sq = float(squared_norm64(delta).item())
        eps = self.eps * float(stats["clients"].item()) if self.scale_eps_by_clients else self.eps
        eta, raw = fedexp_server_lr(mean_sq, delta_sq, eps)
        return eta, raw, eps

    def server_update(
        self, loop, stats: RoundStatistics, plan: RoundPlan
    ) -> tuple[Tensor, float | None, dict[str, float]]:
        delta = self.mean_delta(stats)
        eta, raw, eps = self.extrapolation(stats, delta)
        if self.evaluate_iterate_average:
            # w_t, before the loop applies the step; after round 0 the reference code evaluates w_1 alone
            self._previous_iterate = flat_params(loop.global_parameters()).clone() if plan.round >= 1 else None
        return delta, eta, {"server/eta_g": eta, "server/eta_g_raw": raw, "server/eps": eps}

    # ------------------------------------------------------------------ averaged-iterate evaluation
    def _swap_in_average(self, pl_module) -> None:
        if not self.evaluate_iterate_average or self._previous_iterate is None or self._swapped_out is not None:
            return
        params = pl_module.global_parameters()
        current = flat_params(params)
        previous = self._previous_iterate.to(device=current.device, dtype=current.dtype)
        self._swapped_out = current.clone()
        assign_flat_(params, (previous + current) / 2)

    def _restore(self, pl_module) -> None:
        if self._swapped_out is None:
            return
        assign_flat_(pl_module.global_parameters(), self._swapped_out)
        self._swapped_out = None

    def on_validation_start(self, trainer, pl_module) -> None:
        self._swap_in_average(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._restore(pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._swap_in_average(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._restore(pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore(pl_module)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        prev = self._previous_iterate
        return {"previous_iterate": None if prev is None else prev.detach().cpu().clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._previous_iterate = state_dict.get("previous_iterate")

    def __repr__(self) -> str:
        return (
            f"FedExP(eps={self.eps}, scale_eps_by_clients={self.scale_eps_by_clients}, "
            f"evaluate_iterate_average={self.evaluate_iterate_average}, weighting={self.weighting!r})"
        )
