"""Adaptive server optimizers on the pseudo-gradient: FedAdagrad, FedAdam, FedYogi (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021, Alg. 2), FedAMS (Wang, Lin & Chen, "Communication-Efficient Adaptive
Federated Learning", ICML 2022) and FedAvgM (server momentum; Hsu, Qi & Brown 2019, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification").

With ``Δ_t = w_t − mean_i w^i_{t,K}``: ``m_t = β1 m_{t−1} + (1 − β1) Δ_t``, a second moment ``v_t`` per rule, and
``w_{t+1} = w_t − η · m_t / (√v_t + τ)`` (FedAvgM: ``u_t = β u_{t−1} + Δ_t``, ``w_{t+1} = w_t − η u_t``). The rules,
initial state and bias correction: :class:`AdaptiveServerOptimizer`; parameter names, weighting and logged
statistics: :class:`_AdaptiveStrategy`. The optimizer state lives in the server optimizer, so Lightning
checkpoints it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fedlightning._validation import in_range, one_of, positive
from fedlightning.callbacks.base import ServerStrategy
from fedlightning.state import real_parts

__all__ = [
    "AdaptiveServerOptimizer",
    "FedAdagrad",
    "FedAdam",
    "FedYogi",
    "FedAMS",
    "FedAvgM",
    "_check_betas",
    "_moment_statistics",
]  # the last two: shared with callbacks.dp

_RULES = ("adagrad", "adam", "yogi", "ams")


def _check_betas(betas: Sequence[float], rule: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of numbers, got {betas!r}") from None
    return in_range("betas[0]", b1, 0.0, 1.0), in_range("betas[1]", b2, 0.0, 1.0)


class AdaptiveServerOptimizer(torch.optim.Optimizer):
    """The server update rules of FedAdagrad / FedAdam / FedYogi / FedAMS as one torch optimizer.

    With the pseudo-gradient ``Δ_t = w_t − mean_i w^i_{t,K}`` (this package's sign; Reddi et al. write ``−Δ_t``)::

        m_t = β1 m_{t−1} + (1 − β1) Δ_t                                   (all four adaptive rules)
        FedAdagrad: v_t = v_{t−1} + Δ_t²
        FedAdam:    v_t = β2 v_{t−1} + (1 − β2) Δ_t²
        FedYogi:    v_t = v_{t−1} − (1 − β2) Δ_t² · sign(v_{t−1} − Δ_t²)
        w_{t+1} = w_t − η · m_t / (√v_t + τ)                              (τ: "degree of adaptivity", ``tau``)

        FedAMS:     v_t = β2 v_{t−1} + (1 − β2) Δ_t²,  v̂_t = max(v̂_{t−1}, v_t, ε),  w_{t+1} = w_t − η · m_t / √v̂_t
                    (ε: ``ams_eps``)

        FedAvgM:    u_t = β u_{t−1} + Δ_t,  w_{t+1} = w_t − η u_t            (torch SGD with momentum, dampening 0)

    All products, squares, roots and maxima are element-wise. Decisions:

    * Initial state (Reddi et al. Alg. 2: ``m_{−1} = 0``, ``v_{−1} ≥ τ²``): ``v_{−1} = τ²`` for Adagrad/Adam/Yogi;
      FedAMS starts from ``v_0 = v̂_0 = 0`` (the ``max`` with ``ε`` bounds the denominator from the first round).
    * No bias correction (Reddi et al. and the FedAMS paper have none; the FedCAMS code adds Adam's corrections and a
      separate 1e-8 — not reproduced).
    * A complex parameter is two real ones (its real and imaginary parts, as ``torch.optim.Adam`` treats it): the
      moments are kept per part, so ``v`` accumulates squares of real numbers (ours; a complex ``Δ²`` made ``v``
      complex, the Adam and Adagrad steps wrong and Yogi's ``sign`` / AMS's ``max`` fail).

    ``p.grad`` holds the pseudo-gradient ``Δ_t``. State per parameter: ``exp_avg`` (m), ``exp_avg_sq`` (v) and,
    for ``rule="ams"``, ``max_exp_avg_sq`` (v̂).

    Args:
        params: the global model's trainable parameters.
        lr: server learning rate ``η``.
        rule: ``"adagrad"``, ``"adam"``, ``"yogi"`` or ``"ams"``.
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: ``τ > 0`` (adagrad/adam/yogi) or the max-stabilisation ``ε > 0`` (ams).
    """

    def __init__(self, params: Iterable, lr: float, rule: str, betas: Sequence[float] = (0.9, 0.99), eps: float = 1e-3):
        one_of("rule", rule, _RULES)
        lr = positive("lr", lr)
        b1, b2 = _check_betas(betas, rule)
        eps = positive("eps", eps)
        super().__init__(params, dict(lr=lr, betas=(b1, b2), eps=eps, rule=rule))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, rule = group["lr"], group["betas"], group["eps"], group["rule"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                # a complex parameter as its real and imaginary parts (as torch.optim.Adam treats it): v of |Δ|²
                # per part, real and non-negative
                p, d = real_parts(param), real_parts(param.grad)
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    if rule == "ams":
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        state["max_exp_avg_sq"] = torch.zeros_like(p)
                    else:
                        state["exp_avg_sq"] = torch.full_like(p, eps * eps)  # v_{-1} = τ²
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(d, alpha=1.0 - b1)
                d2 = d * d
                if rule == "adagrad":
                    v.add_(d2)
                elif rule == "adam":
                    v.mul_(b2).add_(d2, alpha=1.0 - b2)
                elif rule == "yogi":
                    v.sub_((1.0 - b2) * d2 * torch.sign(v - d2))
                else:  # ams
                    v.mul_(b2).add_(d2, alpha=1.0 - b2)
                vhat = state["max_exp_avg_sq"] if rule == "ams" else None
                if vhat is not None:
                    torch.maximum(vhat, v, out=vhat)
                    vhat.clamp_(min=eps)
                    denom = vhat.sqrt()
                else:
                    denom = v.sqrt().add_(eps)
                p.addcdiv_(m, denom, value=-lr)
        return loss


class _AdaptiveStrategy(ServerStrategy):
    """Shared parts of the adaptive strategies: the server optimizer and its logged statistics.

    * Names: τ is ``tau`` and FedAMS's ε is ``ams_eps``, not a shared ``eps``: the two act differently (τ is added to
      √v, ε floors v̂), and FedExP / FedExProx / FedLi-LU have other ε's; a configuration that switches the strategy
      class would otherwise carry one into the other with a changed meaning (ours).
    * Weighting: uniform mean over the participating clients (Reddi et al. and Wang et al. average uniformly);
      FedAvgM weights by samples (Hsu et al. use FedAvg's ``n_k`` weights).

    The optimizer state (``m``, ``v``, ``v̂``, momentum buffer) lives in the server optimizer that the
    FederatedLoop returns from ``configure_optimizers``, so Lightning checkpoints and restores it. Logged per round:
    ``server/first_moment_norm`` (‖m‖ or ‖u‖), ``server/second_moment_mean`` and ``server/second_moment_max`` (of
    ``v``, or ``v̂`` for FedAMS).
    """

    rule: str = ""

    def __init__(self, server_lr: float, betas: Sequence[float], eps: float, weighting: str):
        super().__init__(server_lr=positive("server_lr", server_lr), weighting=weighting)
        self.betas = _check_betas(betas, self.rule)
        self.eps = positive("ams_eps" if self.rule == "ams" else "tau", eps)
        self._optimizer: torch.optim.Optimizer | None = None

    def configure_server_optimizer(self, params):
        self._optimizer = AdaptiveServerOptimizer(
            params, lr=self.server_lr, rule=self.rule, betas=self.betas, eps=self.eps
        )
        return self._optimizer

    def on_round_end(self, trainer, pl_module, result) -> None:
        second = "max_exp_avg_sq" if self.rule == "ams" else "exp_avg_sq"
        result.metrics.update(_moment_statistics(self._optimizer, second, "exp_avg"))

    def __repr__(self) -> str:
        name = "ams_eps" if self.rule == "ams" else "tau"
        return (
            f"{type(self).__name__}(server_lr={self.server_lr}, betas={self.betas}, {name}={self.eps}, "
            f"weighting={self.weighting!r})"
        )


def _moment_statistics(opt: torch.optim.Optimizer | None, second: str | None, first: str) -> dict[str, float]:
    if opt is None:
        return {}
    firsts, seconds = [], []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            if first in st:
                firsts.append(st[first].reshape(-1))
            if second is not None and second in st:
                seconds.append(st[second].reshape(-1))
    out: dict[str, float] = {}
    if firsts:
        out["server/first_moment_norm"] = float(torch.cat(firsts).double().norm().item())
    if seconds:
        s = torch.cat(seconds).double()
        out["server/second_moment_mean"] = float(s.mean().item())
        out["server/second_moment_max"] = float(s.max().item())
    return out


class FedAdagrad(_AdaptiveStrategy):
    """FedAdagrad (Reddi et al. 2021). Defaults: ``server_lr=0.1``, ``tau=τ=1e-2`` (FedExP reference code's
    FedAdagrad), ``betas=(0.9, 0.99)`` (Reddi et al. 2021; β2 is unused by Adagrad), uniform weighting."""

    rule = "adagrad"

    def __init__(
        self,
        server_lr: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-2,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr, betas, tau, weighting)


class FedAdam(_AdaptiveStrategy):
    """FedAdam (Reddi et al. 2021). Defaults: ``server_lr=0.1``, ``tau=τ=1e-2`` (FedExP reference code's FedAdam),
    ``betas=(0.9, 0.99)`` (Reddi et al. 2021), uniform weighting."""

    rule = "adam"

    def __init__(
        self,
        server_lr: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-2,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr, betas, tau, weighting)


class FedYogi(_AdaptiveStrategy):
    """FedYogi (Reddi et al. 2021). Defaults as :class:`FedAdam` (ours: the FedExP code has no FedYogi;
    ``betas=(0.9, 0.99)`` from Reddi et al. 2021)."""

    rule = "yogi"

    def __init__(
        self,
        server_lr: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-2,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr, betas, tau, weighting)


class FedAMS(_AdaptiveStrategy):
    """FedAMS, AMSGrad with max stabilisation (Wang et al. 2022). Defaults: ``server_lr=1.0``,
    ``betas=(0.9, 0.99)``, ``ams_eps=ε=1e-3`` (seed 001, Table 3, MNIST; its grid is ε ∈ {1e-8, …, 1})."""

    rule = "ams"

    def __init__(
        self,
        server_lr: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.99),
        ams_eps: float = 1e-3,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr, betas, ams_eps, weighting)


class FedAvgM(ServerStrategy):
    """FedAvg with server momentum (Hsu et al. 2019): ``u_t = β u_{t−1} + Δ_t``, ``w_{t+1} = w_t − η u_t``.

    Args:
        server_lr: ``η`` (default 1.0, Hsu et al.).
        momentum: ``β ∈ [0, 1)`` (default 0.9: ours, the usual heavy-ball value, inside Hsu et al.'s sweep).
        nesterov: Nesterov momentum (torch's form). Default False (Hsu et al.).
        weighting: default ``"samples"`` (Hsu et al. weight by client samples).
    """

    def __init__(
        self, server_lr: float = 1.0, momentum: float = 0.9, nesterov: bool = False, weighting: str = "samples"
    ):
        super().__init__(server_lr=positive("server_lr", server_lr), weighting=weighting)
        momentum = in_range("momentum", momentum, 0.0, 1.0)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self._optimizer: torch.optim.Optimizer | None = None

    def configure_server_optimizer(self, params):
        self._optimizer = torch.optim.SGD(params, lr=self.server_lr, momentum=self.momentum, nesterov=self.nesterov)
        return self._optimizer

    def on_round_end(self, trainer, pl_module, result) -> None:
        result.metrics.update(_moment_statistics(self._optimizer, None, "momentum_buffer"))

    def __repr__(self) -> str:
        return (
            f"FedAvgM(server_lr={self.server_lr}, momentum={self.momentum}, nesterov={self.nesterov}, "
            f"weighting={self.weighting!r})"
        )
