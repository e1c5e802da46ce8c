r"""FedAvg (McMahan et al. 2017), with a server learning rate (FedOpt form, Reddi et al. 2021).

.. math::
    \Delta_t = \frac{\sum_{i\in S_t} p_i (w_t - w^i_{t,K})}{\sum_{i\in S_t} p_i}, \qquad
    w_{t+1} = w_t - \eta_g \Delta_t

with ``p_i = n_i`` (``weighting="samples"``, McMahan et al.) or ``p_i = 1`` (``weighting="uniform"``, the papers of
seeds 000/001/004). ``server_lr = η_g = 1`` is plain model averaging; FedSLS (seed 000, Alg. 4) is FedAvg with a
constant ``η_g ≤ 1`` and SgdArmijo clients.
"""

from __future__ import annotations

from fedlightning.callbacks.base import ServerStrategy

__all__ = ["FedAvg"]


class FedAvg(ServerStrategy):
    """Weighted model averaging with server learning rate ``server_lr`` (default 1.0: plain FedAvg)."""
