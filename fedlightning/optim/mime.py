r"""Client steps of Mime and MimeLite, SGD with momentum as the base optimizer: :class:`MimeLiteSGD`, :class:`MimeSGD`.

Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich & Suresh, "Breaking the centralized barrier for cross-device federated
learning" (NeurIPS 2021; arXiv title "Mime: Mimicking Centralized Stochastic Algorithms in Federated Learning"),
Algorithm 1 with the base optimizer ``B = (U, V)`` = SGD with momentum :math:`\beta`. Every local step applies the
base optimizer's update with the server's momentum :math:`m` **frozen** (never updated on the client):

.. math::
    y \leftarrow y - \eta\,\big((1-\beta)\,d + \beta\,m\big), \qquad
    d = \begin{cases} g_i(y;\zeta) - g_i(x;\zeta) + c & \text{Mime (SVRG correction)}\\
                      g_i(y;\zeta) & \text{MimeLite}\end{cases}

with :math:`x` the round's server point, :math:`\zeta` the step's mini-batch (the same on both gradients) and :math:`c`
the mean full-batch gradient of the round's clients at :math:`x`. The server side (the frozen state, its update
:math:`m \leftarrow (1-\beta)c + \beta m`) is :class:`fedlightning.callbacks.Mime` /
:class:`~fedlightning.callbacks.MimeLite`, which builds these optimizers for every client from the user's plain SGD
(its learning rates) through ``configure_client_optimizer``. Both have batched forms for
``client_execution="vectorized"`` in :mod:`fedlightning.vectorized.rules`, which read
:meth:`MimeLiteSGD.server_momentum`, :meth:`MimeSGD.server_point` and :meth:`MimeSGD.full_gradient`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import flag, in_range
from fedlightning.optim._common import RngSnapshot

__all__ = ["MimeLiteSGD", "MimeSGD"]


def _aligned(name: str, tensors: Sequence[Tensor] | None, params: list[Tensor]) -> list[Tensor] | None:
    """``tensors`` checked to have one entry shaped like each of ``params`` (None stays None)."""
    if tensors is None:
        return None
    tensors = list(tensors)
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors for {len(params)} parameters")
    for i, (t, p) in enumerate(zip(tensors, params)):
        if not isinstance(t, Tensor) or t.shape != p.shape:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}[{i}] has shape {shape}, the parameter {tuple(p.shape)}")
    return tensors


class MimeLiteSGD(torch.optim.Optimizer):
    r"""MimeLite's client step, SGD with the server momentum frozen: :math:`y \leftarrow y - \eta((1-\beta)g+\beta m)`.

    :math:`g = \nabla f_i(y;\zeta)` is the parameter's ``.grad`` (a plain ``step()``, as ``torch.optim.SGD``; the
    FederatedLoop's ``client_grad_clip`` applies to it). Each param group keeps its own ``lr`` :math:`\eta` (taken
    from the user's SGD groups); :math:`\beta` is shared. With :math:`\beta = 0` the step is plain SGD.

    Args:
        params: parameters or param groups (each group may set ``lr``).
        lr: client learning rate :math:`\eta > 0` of groups that do not set one.
        momentum: the base optimizer's :math:`\beta \in [0, 1)`.
        server_momentum: the frozen momentum :math:`m`, one tensor per parameter in param-group order (None: zeros,
            the state before the first server update).
    """

    requires_closure = False

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, server_momentum: Sequence[Tensor] | None = None):
        lr = in_range("lr", lr, 0.0, low_closed=False)
        momentum = in_range("momentum", momentum, 0.0, 1.0)
        super().__init__(params, dict(lr=lr))
        for group in self.param_groups:
            in_range("lr", group["lr"], 0.0, low_closed=False, label="param group lr")
        self.momentum = momentum
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._server_momentum = _aligned("server_momentum", server_momentum, self._params)

    def server_momentum(self) -> list[Tensor]:
        """The frozen server momentum :math:`m`, one tensor per parameter in param-group order (zeros when none was
        given). A batched form (:mod:`fedlightning.vectorized`) reads it."""
        return list(self._frozen())

    def _frozen(self) -> list[Tensor]:
        if self._server_momentum is None:
            self._server_momentum = [torch.zeros_like(p) for p in self._params]
        return self._server_momentum

    def _direction(self, index: int, grad: Tensor) -> Tensor:
        """The base optimizer's update :math:`U(d, m) = (1-\\beta) d + \\beta m` for parameter ``index``."""
        beta = self.momentum
        m = self._frozen()[index]
        return grad.mul(1.0 - beta).add_(m, alpha=beta) if beta != 0.0 else grad

    @torch.no_grad()
    def _apply(self, directions: dict[int, Tensor]) -> None:
        index = 0
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                d = directions.get(index)
                if d is not None:
                    p.add_(d, alpha=-lr)
                index += 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        directions = {}
        for i, p in enumerate(self._params):
            if p.grad is not None:
                directions[i] = self._direction(i, p.grad)
        self._apply(directions)
        return loss


class MimeSGD(MimeLiteSGD):
    r"""Mime's client step: :math:`y \leftarrow y - \eta((1-\beta)d + \beta m)` with the SVRG-corrected
    :math:`d = g_i(y;\zeta) - g_i(x;\zeta) + c`.

    Closure convention of :mod:`fedlightning.optim` (``requires_closure``: the closure only returns the mini-batch
    loss, the optimizer runs ``backward``). One step evaluates the closure twice on the same mini-batch:

    1. at the server point :math:`x` (``anchor``): the parameters are set to :math:`x`, the loss and its gradient
       :math:`g_i(x;\zeta)` are computed (``torch.autograd.grad``, ``.grad`` untouched) inside ``evaluation_guard()``,
       and the parameters are put back to :math:`y`; the CPU (and the parameters' CUDA) RNG state is restored to its
       value before this evaluation, so dropout draws the same masks at :math:`x` and at :math:`y` and the randomness
       after the step is what a plain step leaves;
    2. at :math:`y`: the closure's loss, ``backward`` (``.grad`` = :math:`g_i(y;\zeta)`), then the update.

    The evaluation at :math:`x` comes first so that the model's own side effects of the step (the loss it logs, the
    metrics it updates, the output ``on_train_batch_end`` receives) are those at :math:`y`; ``evaluation_guard``
    (given by :class:`fedlightning.callbacks.Mime`) undoes what the evaluation at :math:`x` would otherwise leave:
    float buffers (BatchNorm statistics), torchmetrics states and ``self.log`` values. Gradient clipping
    (``client_grad_clip``) is not applied, as for the other closure-based optimizers: it would change the corrected
    direction. ``last_step`` reports the step size (group 0's ``lr``), 2 forwards and 2 backwards per step.

    Args:
        params: parameters or param groups (each group may set ``lr``).
        lr: client learning rate :math:`\eta > 0` of groups that do not set one.
        momentum: :math:`\beta \in [0, 1)`.
        server_momentum: the frozen :math:`m` (None: zeros).
        anchor: the server point :math:`x`, one tensor per parameter (required).
        full_gradient: :math:`c`, one tensor per parameter (required).
        correction: False drops the correction (:math:`d = g_i(y;\zeta)`, MimeLite's direction with Mime's two
            evaluations; for tests). Default True.
        evaluation_guard: a context-manager factory around the evaluation at :math:`x` (None: none).
    """

    requires_closure = True

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        server_momentum: Sequence[Tensor] | None = None,
        anchor: Sequence[Tensor] | None = None,
        full_gradient: Sequence[Tensor] | None = None,
        correction: bool = True,
        evaluation_guard: Callable[[], Any] | None = None,
    ):
        super().__init__(params, lr=lr, momentum=momentum, server_momentum=server_momentum)
        if anchor is None or full_gradient is None:
            raise ValueError("MimeSGD needs the server point (anchor) and the full-batch gradient (full_gradient)")
        self._anchor = _aligned("anchor", anchor, self._params)
        self._full_gradient = _aligned("full_gradient", full_gradient, self._params)
        self.correction = flag("correction", correction)
        self._guard = evaluation_guard if evaluation_guard is not None else contextlib.nullcontext
        self.last_step: dict[str, Any] = {}

    def server_point(self) -> list[Tensor]:
        """The round's server point :math:`x` (``anchor``), one tensor per parameter in param-group order. A batched
        form (:mod:`fedlightning.vectorized`) reads it."""
        return list(self._anchor)

    def full_gradient(self) -> list[Tensor]:
        """The full-batch gradient :math:`c` at the server point, one tensor per parameter in param-group order."""
        return list(self._full_gradient)

    @staticmethod
    def _checked(loss: Any) -> Tensor:
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"the closure must return the loss as a scalar tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise RuntimeError(
                "the closure's loss does not require grad: compute it from the parameters with gradients"
            )
        return loss.reshape(())

    def _gradient_at_anchor(self, closure: Callable[[], Tensor]) -> list[Tensor | None]:
        """:math:`g_i(x;\\zeta)`: the closure's gradient at the server point, parameters and RNG restored after."""
        params = self._params
        device = params[0].device if params else None
        rng = RngSnapshot(device)
        with torch.no_grad():
            current = [p.detach().clone() for p in params]
            torch._foreach_copy_(params, self._anchor)
        try:
            with self._guard(), torch.enable_grad():
                loss = self._checked(closure())
                wanted = [p for p in params if p.requires_grad]
                grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
                return [next(grads) if p.requires_grad else None for p in params]
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, current)
            rng.restore()

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:  # type: ignore[override]
        """One Mime step on the closure's mini-batch; returns the loss at :math:`y`."""
        if closure is None or not callable(closure):
            raise TypeError(
                "MimeSGD.step needs a closure that evaluates the loss on the step's mini-batch (it is called at the "
                "server point and at the client's point; the optimizer calls backward itself)"
            )
        at_anchor = self._gradient_at_anchor(closure) if self.correction else None
        with torch.enable_grad():
            loss = self._checked(closure())
            loss.backward()
        with torch.no_grad():
            directions = {}
            for i, p in enumerate(self._params):
                if p.grad is None:
                    continue
                d = p.grad.clone()
                if at_anchor is not None:
                    gx = at_anchor[i]
                    if gx is not None:
                        d.sub_(gx)
                    d.add_(self._full_gradient[i])
                directions[i] = self._direction(i, d)
            self._apply(directions)
        evaluations = 2 if self.correction else 1
        self.last_step = {
            "step_size": float(self.param_groups[0]["lr"]),
            "backtracks": 0,
            "forwards": evaluations,
            "backwards": evaluations,
        }
        return loss.detach()
