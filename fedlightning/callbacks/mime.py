r"""Mime and MimeLite with SGD with momentum as the base optimizer (Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich &
Suresh, "Breaking the centralized barrier for cross-device federated learning", NeurIPS 2021, Algorithm 1):
:class:`Mime`, :class:`MimeLite`.

Each round: the server sends the model :math:`x` and its optimizer state :math:`s` (the momentum :math:`m`); the
round's clients compute full-batch gradients at :math:`x`, :math:`c = \frac{1}{|S|}\sum_{i\in S}\nabla f_i(x)`;
every client runs local steps :math:`y \leftarrow y - \eta\,U(d, s)` with :math:`s` frozen,
:math:`U(d, m) = (1-\beta)d + \beta m`, and :math:`d = g_i(y;\zeta) - g_i(x;\zeta) + c` (Mime) or
:math:`d = g_i(y;\zeta)` (MimeLite); the server averages, :math:`x \leftarrow \frac{1}{|S|}\sum_i y_i`, and updates the
state with the full-batch gradient, :math:`m \leftarrow (1-\beta)c + \beta m`. The decisions are in :class:`Mime`'s
docstring; the client steps are :class:`fedlightning.optim.MimeSGD` / :class:`~fedlightning.optim.MimeLiteSGD`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from fedlightning._logging_route import discard, routed_logging
from fedlightning._validation import SettingTypeError, in_range, integer
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy
from fedlightning.callbacks.feddane import leave_out_nonfinite_gradients
from fedlightning.callbacks.proximal import global_anchors
from fedlightning.distributed import finite_weighted_mean_over_processes
from fedlightning.optim.mime import MimeLiteSGD, MimeSGD
from fedlightning.state import RoundPlan, flat_params

__all__ = ["Mime", "MimeLite", "plain_sgd_problem", "optimizer_positions", "position_views", "flat_from_positions"]


def plain_sgd_problem(optimizer: Any) -> str | None:
    """Why ``optimizer`` is not a plain ``torch.optim.SGD`` (no momentum, weight decay, Nesterov, ``maximize``), or
    None when it is one."""
    if type(optimizer) is not torch.optim.SGD:
        return f"it is {type(optimizer).__name__}"
    for i, group in enumerate(optimizer.param_groups):
        for key in ("momentum", "weight_decay"):
            if group.get(key, 0) != 0:
                return f"param group {i} sets {key}={group[key]}"
        for key in ("nesterov", "maximize"):
            if group.get(key):
                return f"param group {i} sets {key}=True"
    return None


def optimizer_positions(loop, optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """``(offset, numel)`` in the flat global-parameter vector of each parameter of ``optimizer`` (param-group order):
    the client optimizer is built over the FederatedLoop's working copy, whose trainable parameters are in the global
    model's order."""
    offsets, offset = {}, 0
    for p in loop.client_worker.params:
        offsets[id(p)] = (offset, p.numel())
        offset += p.numel()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in offsets:
                raise ValueError(
                    f"the client optimizer {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is "
                    "not a trainable parameter of the model"
                )
            out.append(offsets[id(p)])
    return out


def position_views(vector: Tensor, positions: list[tuple[int, int]], like: list[Tensor]) -> list[Tensor]:
    """Views of ``vector`` at ``positions`` shaped like ``like`` (one tensor per optimizer parameter)."""
    return [vector[o : o + n].view_as(t) for (o, n), t in zip(positions, like)]


def flat_from_positions(tensors: list[Tensor], positions: list[tuple[int, int]], size: int, like: Tensor) -> Tensor:
    """The flat global-order vector holding ``tensors`` at ``positions`` (zeros elsewhere)."""
    out = torch.zeros(size, dtype=like.dtype, device=like.device)
    for (o, n), t in zip(positions, tensors):
        out[o : o + n] = t.reshape(-1).to(dtype=like.dtype, device=like.device)
    return out


class Mime(ServerStrategy):
    r"""Mime with SGD with momentum as the base optimizer (Karimireddy et al. 2021, Algorithm 1).

    **Round** ``t`` (server point :math:`x`, momentum :math:`m`, clients :math:`S` = the round's sample)::

        c = Σ_{i∈S} w_i ∇f_i(x) / Σ_{i∈S} w_i                  full-batch gradients at x (on_round_start)
        client i ∈ S, y ← x, K local steps on mini-batches ζ:
            d = g_i(y; ζ) − g_i(x; ζ) + c                        (Mime; MimeLite: d = g_i(y; ζ))
            y ← y − η ((1 − β) d + β m)                           m frozen (optim.MimeSGD / MimeLiteSGD)
        x ← x − η_g Σ_i w_i (x − y_i) / Σ_i w_i                   (η_g = server_lr = 1: the paper's averaging)
        m ← (1 − β) c + β m                                       the base optimizer's state update V(c, m)

    **Decisions** (what the paper leaves open, ours unless a source is named):

    * Base optimizer: SGD with momentum in the paper's form :math:`(1-\beta)g + \beta m` (its main experiments'
      base optimizer); Adam as a base is not offered. :math:`m` starts at 0 (the state before any update), so the
      first round's steps are :math:`\eta(1-\beta)d`.
    * Client learning rate: the user's client optimizer must be plain ``torch.optim.SGD`` (no momentum, weight decay,
      Nesterov, ``maximize``; refused at fit start otherwise, naming ``model.client_optimizer``): its groups' ``lr``
      (after the round's ``client_lr_scale``) are :math:`\eta`, and ``configure_client_optimizer`` replaces it for
      each client by :class:`~fedlightning.optim.MimeSGD` / :class:`~fedlightning.optim.MimeLiteSGD` over the same
      parameters with the frozen state. A user momentum would be a second, unfrozen momentum on top of Mime's.
    * :math:`c` and :math:`\nabla f_i(x)`: the gradient of the client's mean training loss over all its samples
      (``FederatedLoop.client_full_gradients``: client by client, as Mime's clients train sequentially, chunked by
      ``gradient_batch_size``, model randomness seeded by ``(seed, "mime-gradient", round, client)``; only the model's
      loss, no other objective terms), over the round's sampled clients, computed once in ``on_round_start``
      (mathematically what each client uploads; a client that fails later still counts in :math:`c`). MimeLite needs
      :math:`c` only for the server's state update. Under DDP each process computes its share and the sum is
      all-reduced (as :class:`~fedlightning.callbacks.FedDANE`).
    * Weighting of :math:`c` and of the average: ``"uniform"`` (default, the paper's :math:`1/|S|`) or
      ``"samples"``.
    * The SVRG correction evaluates ``training_step`` a second time per step, at :math:`x` on the same mini-batch,
      with the same dropout masks; BatchNorm statistics, torchmetrics states and logged values of that evaluation
      are discarded (:class:`~fedlightning.optim.MimeSGD`). ``client_grad_clip`` does not apply to Mime's steps
      (it applies to MimeLite's, as to SGD's).
    * State: :math:`m` is this strategy's checkpointed state (``state_dict``); :math:`c` is recomputed every round.
    * A client whose full gradient at :math:`x` holds a NaN or an infinity is left out of :math:`c` (its weight too)
      with a warning, or stops the run under ``on_client_failure="raise"``
      (:func:`~fedlightning.callbacks.feddane.leave_out_nonfinite_gradients`): one faulty client would otherwise make
      every client's steps (Mime) or the momentum (MimeLite) NaN for good. Its own update still counts when it is
      finite (its local steps do not use its full gradient). A round in which no client's full gradient is finite
      leaves :math:`m` unchanged (and Mime's clients, whose steps use :math:`c`, fail).

    **Cost and communication per round** (model-sized vectors, per sampled client): Mime — one full pass over the
    client's data for :math:`\nabla f_i(x)`, then 2 forwards and 2 backwards per local step; down :math:`x`,
    :math:`m` and (after the gradient phase) :math:`c`, up :math:`\nabla f_i(x)` and :math:`y_i`: two communication
    rounds (``round/communication_rounds`` counts 2 per round, as FedDANE). MimeLite — the same full pass, 1 forward
    and 1 backward per step; down :math:`x, m`, up :math:`y_i, \nabla f_i(x)`: one communication round.

    **Execution**: both client optimizers (:class:`~fedlightning.optim.MimeSGD`,
    :class:`~fedlightning.optim.MimeLiteSGD`) have batched forms, so ``client_execution="vectorized"`` trains the
    round's clients in lockstep, to the weights of sequential training (float rounding apart; dropout masks differ, as
    for every vectorized run): Mime's gradient at the server point is a second batched evaluation per step, on the same
    batch, with the same random state, and without its side effects (``tests/test_mime.py``).

    Logged: ``mime/momentum_norm`` (‖m‖ after the update), ``mime/full_gradient_norm`` (‖c‖),
    ``mime/gradient_clients`` (the clients whose full gradient entered :math:`c`), ``round/communication_rounds``.

    Args:
        momentum: :math:`\beta \in [0, 1)` of the base optimizer. Default 0.9 (ours: the usual heavy-ball value;
            seed 001 tunes MIME without reporting it).
        server_lr: :math:`\eta_g` on the averaged update. Default 1.0 (the paper's plain average).
        weighting: ``"uniform"`` (default) or ``"samples"``.
        gradient_batch_size: chunk size of the full-batch gradients (None: each client's data at once).
    """

    correction = True

    def __init__(
        self,
        momentum: float = 0.9,
        server_lr: float = 1.0,
        weighting: str = "uniform",
        gradient_batch_size: int | None = None,
    ):
        super().__init__(server_lr=server_lr, weighting=weighting)
        self.momentum = in_range("momentum", momentum, 0.0, 1.0)
        self.gradient_batch_size = integer("gradient_batch_size", gradient_batch_size, allow_none=True)
        self.server_momentum: Tensor | None = None  # m, flat, in the global parameters' order
        self._full_gradient: Tensor | None = None  # c of the current round
        self._round: int | None = None
        self._gradient_clients = 0  # the clients whose full gradient entered c this round

    # ------------------------------------------------------------------ checks
    def _check_client_optimizer(self, optimizer: Any) -> None:
        problem = plain_sgd_problem(optimizer)
        if problem is not None:
            raise SettingTypeError(
                "model.client_optimizer",
                f"{type(self).__name__} needs model.client_optimizer to be plain torch.optim.SGD (its lr is the client "
                f"learning rate; {type(self).__name__} applies the server's momentum itself), but {problem}; set "
                "model.client_optimizer: {class_path: torch.optim.SGD, init_args: {lr: ...}}",
            )

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check_client_optimizer(pl_module.client_optimizer_factory(list(pl_module.global_parameters())))

    # ------------------------------------------------------------------ state
    def _momentum(self, like: Tensor) -> Tensor:
        m = self.server_momentum
        if m is None:
            m = torch.zeros_like(like)
        elif m.device != like.device or m.dtype != like.dtype:
            m = m.to(device=like.device, dtype=like.dtype)
        self.server_momentum = m
        return m

    # ------------------------------------------------------------------ round
    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        self._round = plan.round
        like = flat_params(pl_module.global_parameters())
        dm = pl_module.datamodule
        ids = list(plan.client_ids)
        weights = {k: (float(dm.client_num_samples(k)) if self.weighting == "samples" else 1.0) for k in ids}
        share = pl_module.process_share(ids)
        grads = pl_module.client_full_gradients(share, plan.round, self.gradient_batch_size, tag="mime-gradient")
        result = finite_weighted_mean_over_processes(
            ((k, weights[k], grad) for k, grad in zip(share, grads)),
            like,
            "Mime's full gradient",
            plan.round,
            raised=pl_module.full_gradient_errors(plan.round),
        )
        leave_out_nonfinite_gradients(pl_module, plan, result, f"{type(self).__name__}'s full gradient c")
        self._full_gradient = result.mean
        self._gradient_clients = result.used_total
        self._momentum(like)

    @contextmanager
    def _discard_side_effects(self, worker) -> Iterator[None]:
        """Around the evaluation at the server point: the working copy's buffers and torchmetrics states are put
        back afterwards and its ``self.log`` calls are dropped."""
        buffers = list(worker.buffers)
        saved = [b.detach().clone() for b in buffers]
        metrics = getattr(worker, "metrics", None)
        saved_metrics = metrics.save() if metrics else None
        try:
            with routed_logging(worker.model, discard, discard):
                yield
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)
            if saved_metrics is not None:
                metrics.restore(saved_metrics)

    def configure_client_optimizer(self, trainer, pl_module, plan: RoundPlan, client_id: int, optimizer):
        self._check_client_optimizer(optimizer)
        if self._full_gradient is None or self._round != plan.round:
            raise RuntimeError(f"{type(self).__name__}: on_round_start did not run for round {plan.round}")
        positions = optimizer_positions(pl_module, optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = [{"params": g["params"], "lr": g["lr"]} for g in optimizer.param_groups]
        momentum = position_views(self._momentum(self._full_gradient), positions, params)
        if not self.correction:
            return MimeLiteSGD(groups, momentum=self.momentum, server_momentum=momentum)
        anchor = position_views(flat_params(global_anchors(pl_module)), positions, params)
        worker = pl_module.client_worker
        return MimeSGD(
            groups,
            momentum=self.momentum,
            server_momentum=momentum,
            anchor=anchor,
            full_gradient=position_views(self._full_gradient, positions, params),
            evaluation_guard=lambda: self._discard_side_effects(worker),
        )

    def server_update(self, loop, stats: RoundStatistics, plan: RoundPlan):
        delta = self.mean_delta(stats)
        metrics: dict[str, float] = {}
        c = self._full_gradient
        metrics["mime/gradient_clients"] = float(self._gradient_clients)
        if c is not None and self._gradient_clients:  # no finite full gradient: m is left as it is
            m = self._momentum(c)
            m.mul_(self.momentum).add_(c, alpha=1.0 - self.momentum)  # V(c, m) = (1 − β) c + β m
            metrics["mime/momentum_norm"] = float(m.double().norm().item())
            metrics["mime/full_gradient_norm"] = float(c.double().norm().item())
        per_round = 2 if self.correction else 1
        metrics["round/communication_rounds"] = float(per_round * (plan.round + 1))
        return delta, None, metrics

    def on_round_end(self, trainer, pl_module, result) -> None:
        self._full_gradient = None  # free the model-sized vector between rounds

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        m = self.server_momentum
        return {"server_momentum": None if m is None else m.detach().cpu().clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.server_momentum = state_dict.get("server_momentum")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(momentum={self.momentum}, server_lr={self.server_lr}, "
            f"weighting={self.weighting!r}, gradient_batch_size={self.gradient_batch_size})"
        )


class MimeLite(Mime):
    r"""MimeLite (Karimireddy et al. 2021, Algorithm 1 without the correction): local steps
    :math:`y \leftarrow y - \eta((1-\beta)g_i(y;\zeta) + \beta m)` with the server's momentum :math:`m` frozen, the
    server averages and updates :math:`m \leftarrow (1-\beta)c + \beta m` with the clients' mean full-batch gradient
    :math:`c` at the server point. Everything else (arguments, decisions, cost) as :class:`Mime`; with
    :math:`\beta = 0` it is FedAvg with uniform weights (the full-batch gradients are then computed but unused)."""

    correction = False
