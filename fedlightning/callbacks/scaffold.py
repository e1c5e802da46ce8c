"""SCAFFOLD with option-II control variates (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Alg. 1): :class:`Scaffold`.

Client ``i`` runs its local steps on ``f_i(y) + ⟨c − c_i, y − w_t⟩`` and updates its control variate
``c_i^+ = c_i − c + Δ_i / Σ_k η_{i,k}``; the server averages the deltas and moves ``c`` by
``(1/N) Σ (c_i^+ − c_i)``. The formulas and the decisions are in :class:`Scaffold`'s docstring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.callbacks.proximal import global_anchors, split_like
from fedlightning.objectives import AnchoredTerm
from fedlightning.state import ClientUpdate, RoundPlan, sum_dtype

__all__ = ["Scaffold"]

NAMESPACE = "scaffold"


#: The payload key of a client's new control variate ``c_i⁺``, stored when the client is admitted
_NEW_CONTROL = "scaffold_new_control"


class Scaffold(ServerStrategy):
    r"""SCAFFOLD, option II.

    Server control variate ``c``, client control variates ``c_i`` (both start at 0). Client ``i`` in ``S_t`` runs its
    local steps on the corrected gradient ``g_i(y) − c_i + c``, i.e. on the objective

    .. math::
        f_i(y) + \langle c - c_i,\; y - w_t\rangle ,

    then updates (option II, with ``Δ_i = w_t − y_i`` and the local step sizes ``η_{i,k}``)

    .. math::
        c_i^+ = c_i - c + \frac{\Delta_i}{\sum_k \eta_{i,k}}
        \qquad(\text{the paper's } c_i - c + \tfrac{1}{K\eta_l}(x - y_i) \text{ for a constant } \eta_l).

    Server: ``w_{t+1} = w_t − η_g · mean_{i∈S_t} Δ_i`` and ``c ← c + (1/N) Σ_{i∈S_t} (c_i^+ − c_i)`` with ``N`` the
    total number of clients: here the clients that hold training data (``clients_with_data()`` of the data module,
    the clients sampling draws from; ours). A client without data is never sampled and keeps ``c_i = 0``, so
    counting it would shrink ``c = (1/N) Σ_i c_i`` by the share of such clients; DPFedAvg's population and FedDANE's
    gradient clients count the same clients. With every client holding data (the papers' splits) both are the same.

    Decisions:

    * The correction is written as ``⟨c − c_i, y − w_t⟩``: the gradient the paper prescribes, and zero at ``w_t`` so
      the reported first-batch loss is the plain loss. It is an :class:`~fedlightning.objectives.AnchoredTerm`
      (``μ = 0``, direction ``c − c_i``): vectorised training stacks it over the clients and adds its gradient
      in closed form.
    * ``Σ_k η_{i,k}`` is the sum of the step sizes the client actually took (``ClientUpdate.step_sizes``, which
      includes any per-round lr scale): it equals ``K η_l`` for constant-lr SGD and extends option II to adaptive
      client optimizers (ours). A client optimizer whose parameter groups take different learning rates (a
      ``configure_optimizers`` with a lower rate for a pretrained body) gives each parameter its own sum, its group's
      rates over the steps (``ClientUpdate.param_step_size_sums``), and each parameter's update is divided by its
      own: option II per parameter. A parameter whose sum is 0 (a group at learning rate 0) did not move, and
      nothing estimates its gradient: its ``c_i`` stays as it was (ours).
    * Weighting: uniform mean of the client deltas (``weighting="uniform"``, the paper); ``"samples"`` is offered.
    * Only healthy clients update ``c_i``; a failed client keeps its old control variate and contributes nothing.
      ``c_i⁺`` is computed in ``on_client_end`` and stored when the round admits the client (``accumulate``, after
      the aggregation checks: a client that ``max_update_norm`` or an overflowing update leaves out keeps its
      ``c_i``, so ``c = (1/N) Σ_i c_i`` holds).
    * Storage: ``c_i`` lives in ``loop.client_state`` (namespace ``"scaffold"``, checkpointed by the loop), one
      model-sized vector per client that has participated; ``c`` is this strategy's checkpointed state.
    * Option I (``c_i^+`` = gradient at ``w_t`` on fresh data) is not implemented.

    Logged: ``server/control_norm`` (‖c‖) and ``server/control_delta_norm`` (‖(1/N)Σ(c_i^+ − c_i)‖).

    Args:
        server_lr: global step size ``η_g`` (default 1.0, Karimireddy et al.'s experiments).
        weighting: ``"uniform"`` (default, the paper) or ``"samples"``.
    """

    def __init__(self, server_lr: float = 1.0, weighting: str = "uniform"):
        super().__init__(server_lr=server_lr, weighting=weighting)
        self.server_control: Tensor | None = None
        self._client_state: Any = None  # the loop's ClientStateStore (set in on_client_end, written in accumulate)

    # ------------------------------------------------------------------ helpers
    def _server_control(self, like: Tensor) -> Tensor:
        if self.server_control is None:
            self.server_control = torch.zeros_like(like)
        elif self.server_control.device != like.device or self.server_control.dtype != like.dtype:
            self.server_control = self.server_control.to(device=like.device, dtype=like.dtype)
        return self.server_control

    @staticmethod
    def client_control(loop, client_id: int, like: Tensor) -> Tensor:
        """``c_i`` of a client (zeros before its first participation)."""
        stored = loop.client_state.get(NAMESPACE, client_id)
        if stored is None:
            return torch.zeros_like(like)
        return stored["control"].to(device=like.device, dtype=like.dtype)

    # ------------------------------------------------------------------ client side
    def client_objective(self, trainer, pl_module, plan: RoundPlan, client_id: int):
        anchors = global_anchors(pl_module)
        like = torch.cat([a.reshape(-1) for a in anchors])
        correction = self._server_control(like) - self.client_control(pl_module, client_id, like)
        return [AnchoredTerm(anchors, mu=0.0, directions=split_like(correction, anchors))]

    def on_client_end(self, trainer, pl_module, plan: RoundPlan, update: ClientUpdate) -> None:
        if update.failed or update.delta is None:
            return
        steps = [s for s in update.step_sizes if math.isfinite(s)]
        total = float(sum(steps))
        sums = update.param_step_size_sums
        if sums is not None:  # per-group learning rates: some parameter must have moved
            total = max((s for s in sums if math.isfinite(s)), default=0.0)
        if not steps or total <= 0:
            update.failed = True
            update.failure = f"SCAFFOLD needs positive local step sizes, got {update.step_sizes!r}"
            return
        delta = update.delta
        old = self.client_control(pl_module, update.client_id, delta)
        server = self._server_control(delta)
        if sums is None:
            new = old - server + delta / total
        else:  # per-group learning rates: each parameter over its own sum; c_i kept where it is 0
            numels = [a.numel() for a in global_anchors(pl_module)]
            per = torch.tensor(sums, dtype=delta.dtype, device=delta.device).repeat_interleave(
                torch.tensor(numels, device=delta.device)
            )
            new = torch.where(per > 0, old - server + delta / per, old)
        update.payload["scaffold_control_delta"] = new - old
        # c_i⁺ is stored when the round admits the client (accumulate): the aggregation checks run after this hook
        update.payload[_NEW_CONTROL] = new.detach()
        self._client_state = pl_module.client_state

    # ------------------------------------------------------------------ server side
    def accumulate(self, stats: RoundStatistics, update: ClientUpdate) -> None:
        super().accumulate(stats, update)
        control_delta = update.payload["scaffold_control_delta"]
        stats.add("scaffold_control_delta", control_delta.to(sum_dtype(control_delta.dtype)))  # float32 for halves
        new = update.payload.pop(_NEW_CONTROL, None)
        if new is not None and bool(torch.isfinite(new).all()):  # a non-finite one fails the client (unsafe_entry)
            self._client_state.set(NAMESPACE, update.client_id, {"control": new})

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        num_clients = len(loop.datamodule.clients_with_data())  # N: the clients that can be sampled
        control_step = stats["scaffold_control_delta"] / num_clients
        c = self._server_control(control_step)
        c.add_(control_step)
        metrics = {
            "server/control_norm": float(c.double().norm().item()),
            "server/control_delta_norm": float(control_step.double().norm().item()),
        }
        return delta, None, metrics

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        c = self.server_control
        return {"server_control": None if c is None else c.detach().cpu().clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.server_control = state_dict.get("server_control")
