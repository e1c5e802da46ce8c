"""Server strategies as Lightning callbacks with federated hooks.

A strategy decides how client updates become the next global model. Following the FedOpt view (Reddi et al.
2021), the server step is an optimizer step on the pseudo-gradient: the strategy

1. gives every client update a weight and adds what it needs into a :class:`RoundStatistics` (summable
   statistics, so that sharding clients over processes is one ``all_reduce``) — :meth:`ServerStrategy.accumulate`;
2. turns the reduced statistics into a flat pseudo-gradient ``Δ`` and, optionally, this round's server learning
   rate — :meth:`ServerStrategy.server_update`;
3. the FederatedLoop writes ``Δ`` into the global parameters' ``.grad`` and steps the optimizer returned by
   :meth:`ServerStrategy.configure_server_optimizer` (FedAvg: SGD(lr=server_lr); FedAdam: Adam; FedExP: SGD
   whose lr is the extrapolated ``η_g`` of the round). Lightning checkpoints that optimizer's state and counts
   rounds as global steps.

Federated hooks every callback may implement (the FederatedLoop calls them on all ``trainer.callbacks``):

* ``on_round_start(trainer, loop, plan)`` — before clients train (schedules change ``plan.local_steps``);
* ``client_objective(loop, plan, client_id)`` -> list of extra loss terms ``f(params) -> Tensor`` for that client;
* ``on_client_end(loop, plan, update)`` — after a client trained (add ``update.payload``);
* ``on_round_end(trainer, loop, result)`` — after the server step (logging, schedule statistics).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from fedlightning.state import ClientUpdate, RoundPlan

__all__ = ["RoundStatistics", "ServerStrategy"]


class RoundStatistics:
    """Named tensors accumulated over a round's clients; each is reduced across processes by sum or max.

    Scalars given as Python numbers are summed (or maxed) as Python floats, i.e. in float64 like the float64
    tensors they become when first read (``stats[key]``, ``values``), so a client's ten telemetry scalars cost no
    tensor operations. Tensor values are accumulated in place into the statistic's own copy.
    """

    def __init__(self) -> None:
        self._values: Dict[str, Tensor] = {}
        self._scalars: Dict[str, Tuple[float, object]] = {}  # key -> (python float, device)
        self.ops: Dict[str, str] = {}

    def _scalar(self, key: str, value: float, device, op: str) -> None:
        value = float(value)
        if key in self._values:  # already a tensor (e.g. read, then added to)
            self._tensor(key, torch.tensor(value, dtype=torch.float64, device=device), op)
        elif key in self._scalars:
            old = self._scalars[key][0]
            self._scalars[key] = (old + value if op == "sum" else max(old, value), self._scalars[key][1])
        else:
            self._scalars[key], self.ops[key] = (value, device), op

    def _tensor(self, key: str, value: Tensor, op: str) -> None:
        if key in self._scalars:
            self._materialize(key)
        if key not in self._values:
            self._values[key], self.ops[key] = value.clone(), op
            return
        cur = self._values[key]
        if op == "sum":
            if cur.dtype == value.dtype and cur.shape == value.shape and cur.device == value.device:
                cur.add_(value)
            else:
                self._values[key] = cur + value
        else:
            self._values[key] = torch.maximum(cur, value)

    def _materialize(self, key: str) -> None:
        value, device = self._scalars.pop(key)
        self._values[key] = torch.tensor(value, dtype=torch.float64, device=device)

    def add(self, key: str, value: Tensor | float, device=None) -> None:
        if isinstance(value, Tensor):
            self._tensor(key, value, "sum")
        else:
            self._scalar(key, value, device, "sum")

    def maximum(self, key: str, value: Tensor | float, device=None) -> None:
        if isinstance(value, Tensor):
            self._tensor(key, value, "max")
        else:
            self._scalar(key, value, device, "max")

    @property
    def values(self) -> Dict[str, Tensor]:
        """Every statistic as a tensor (scalars become float64 tensors on the device they were added with)."""
        for key in list(self._scalars):
            self._materialize(key)
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        if key in self._scalars:
            self._materialize(key)
        return self._values[key]

    def __contains__(self, key: str) -> bool:
        return key in self._values or key in self._scalars

    def get(self, key: str, default=None):
        return self[key] if key in self else default


class ServerStrategy(Callback):
    """Base class of server strategies. Subclasses override the parts they change.

    Args:
        server_lr: global learning rate ``η_g`` of the server optimizer.
        weighting: ``"samples"`` weights client ``i`` by its number of training samples ``n_i`` (McMahan et al.
            2017); ``"uniform"`` gives every participating client the same weight (seeds 000, 001 and 004 average
            uniformly).
    """

    #: True for strategies that need every client's update kept until the server step (none of the built-ins).
    needs_all_updates = False

    def __init__(self, server_lr: float = 1.0, weighting: str = "samples"):
        if not (server_lr > 0):
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}")
        self.server_lr = float(server_lr)
        self.weighting = weighting

    # -------------------------------------------------------------- server optimizer
    def configure_server_optimizer(self, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.server_lr)

    # -------------------------------------------------------------- aggregation
    def client_weight(self, update: ClientUpdate) -> float:
        return float(update.num_samples) if self.weighting == "samples" else 1.0

    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        """Add one healthy client's contribution. Default: weighted sum of deltas (and float buffers),
        total weight, number of clients, and Σ‖Δ_i‖² (logged, and used by extrapolation rules)."""
        w = self.client_weight(update)
        delta = update.delta
        stats.add("delta", delta * w)
        stats.add("weight", w, delta.device)
        stats.add("clients", 1.0, delta.device)
        sq_norm = delta.double().pow(2).sum()
        stats.add("sq_norm_sum", sq_norm)
        stats.add("weighted_sq_norm_sum", sq_norm * w)
        if update.buffers is not None:
            stats.add("buffers", update.buffers * w)

    def mean_delta(self, stats: RoundStatistics) -> Tensor:
        return stats["delta"] / stats["weight"].to(stats["delta"].dtype)

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan) -> Tuple[Tensor, Optional[float], Dict[str, float]]:
        """Return ``(pseudo_gradient, lr_or_None, metrics)``; ``lr=None`` keeps the optimizer's own lr."""
        return self.mean_delta(stats), None, {}

    # -------------------------------------------------------------- state
    @property
    def state_key(self) -> str:
        return f"ServerStrategy[{type(self).__name__}]"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(server_lr={self.server_lr}, weighting={self.weighting!r})"
