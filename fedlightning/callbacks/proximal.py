r"""FedProx's proximal term as a client-objective callback (Li et al., "Federated Optimization in Heterogeneous
Networks", MLSys 2020): :class:`ProximalTerm` adds

.. math::
    h_i(w) = f_i(w) + \frac{\mu}{2}\,\lVert w - w_t \rVert^2

to every client's objective (as an :class:`~fedlightning.objectives.AnchoredTerm`, the batched term kind). Also the
helpers other strategies use for their client terms: :func:`global_anchors`, :func:`split_like`, and the per-client
forms of the term's parts, :func:`proximal_penalty` and :func:`linear_correction` (SCAFFOLD's and FedDANE's
``⟨c, w − w_t⟩``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fedlightning._validation import non_negative
from fedlightning.callbacks.base import FederatedCallback
from fedlightning.objectives import AnchoredTerm, real_products, squared_magnitudes

__all__ = ["ProximalTerm", "proximal_penalty", "linear_correction", "split_like", "global_anchors"]


def proximal_penalty(params: Sequence[Tensor], anchors: Sequence[Tensor], mu: float) -> Tensor:
    r""":math:`\frac{\mu}{2}\sum_j \lVert p_j - a_j\rVert^2` over matching lists of tensors (anchors detached)."""
    total = sum(squared_magnitudes(p - a).sum() for p, a in zip(params, anchors))  # |p − a|² for complex ones
    return 0.5 * mu * total


def linear_correction(params: Sequence[Tensor], anchors: Sequence[Tensor], directions: Sequence[Tensor]) -> Tensor:
    r""":math:`\sum_j \langle c_j, p_j - a_j\rangle` (gradient ``c``; zero at ``p = a``).

    The module also holds the linear correction term shared by SCAFFOLD and FedDANE,
    :math:`\langle c, w - w_t\rangle` (gradient ``c``): written relative to ``w_t`` it has the gradient the papers
    ask for and is zero at the global weights, so the client's first-batch loss (seed 004's statistic) is unchanged.
    """
    return sum(real_products(c, p - a).sum() for p, a, c in zip(params, anchors, directions))  # Re(c̄·d) if complex


def split_like(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of consecutive slices of a flat ``vector`` shaped like the tensors of ``like``."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(vector[offset : offset + n].view_as(t))
        offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} elements but the tensors hold {offset}")
    return out


def global_anchors(loop) -> list[Tensor]:
    """The round's global weights ``w_t`` (detached views of the FederatedLoop's trainable parameters).

    The global parameters are not modified while clients train (the server step comes after every client of the
    round), so views are enough: no copy.
    """
    return [p.detach() for p in loop.global_parameters()]


class ProximalTerm(FederatedCallback):
    r"""Adds FedProx's ``μ/2·‖w − w_t‖²`` to every client's objective.

    Every participating client minimises its loss plus a proximal penalty towards the round's global weights:

    .. math::
        h_i(w) = f_i(w) + \frac{\mu}{2}\,\lVert w - w_t \rVert^2 ,
        \qquad \nabla h_i(w) = \nabla f_i(w) + \mu\,(w - w_t)

    (the local step of FedProx's reference code, ``w <- w - η [∇f(w; batch) + μ (w − w_t)]``). The term is a
    *client-objective* part: it composes with any server strategy (FedAvg → FedProx; FedExP → the FedExP reference
    code's "fedprox(exp)"; :class:`~fedlightning.callbacks.FedExProx` and :class:`~fedlightning.callbacks.FedDANE`
    add the same term themselves through :func:`proximal_penalty`). The norm runs over all trainable parameters
    jointly; ``μ = 0`` adds nothing (FedAvg). The term is an :class:`~fedlightning.objectives.AnchoredTerm`
    (anchors ``w_t``, no linear part): vectorised training evaluates it for all clients at once and adds its
    gradient in closed form.

    Args:
        mu: proximal coefficient ``μ ≥ 0``. No default: FedProx tunes it per data set (Li et al. 2020 use
            ``μ ∈ {0.001, 0.01, 0.1, 1}``; the FedExP reference code uses 0.1 on CIFAR-10).
    """

    def __init__(self, mu: float):
        self.mu = non_negative("mu", mu)

    def client_objective(self, trainer, pl_module, plan, client_id: int) -> list[AnchoredTerm]:
        if self.mu == 0.0:
            return []
        return [AnchoredTerm(global_anchors(pl_module), mu=self.mu)]

    @property
    def state_key(self) -> str:
        return f"ProximalTerm[mu={self.mu}]"

    def __repr__(self) -> str:
        return f"ProximalTerm(mu={self.mu})"
