r"""Batched client optimizers: one local step of every client at once, on the clients' weights ``W`` ([C, D]) in place.

:class:`BatchedRule` is the public extension point: a client optimizer class opts in to vectorised execution with a
``batched_rule`` attribute naming its batched form, which :func:`make_batched_rule` reads. ``torch.optim.SGD`` maps to
:class:`_BatchedSGD`, ``torch.optim.Adam`` / ``AdamW`` to :class:`_BatchedAdam`, and :data:`BUILT_IN_FORMS` maps
:class:`~fedlightning.optim.SgdArmijo`, :class:`~fedlightning.optim.SPS` and :class:`~fedlightning.optim.DecSPS` to
:class:`_BatchedArmijo`, :class:`_BatchedSPS`, :class:`_BatchedDecSPS` (the map lives here, not as ``batched_rule``
attributes of those classes, because :mod:`fedlightning.optim` sits below the engine and never imports it), which
evaluate the step-size rules of :mod:`fedlightning.optim.rules` on ``[C]`` tensors (SPS, DecSPS) or, for the line
search's many small per-client decisions, on Python floats client by client (SgdArmijo; see :class:`_BatchedArmijo`);
and the client steps of the local adaptive methods, Mime and MimeLite, :class:`~fedlightning.optim.AMSGradClient`,
:class:`~fedlightning.optim.AdaAlterClient`, :class:`~fedlightning.optim.MimeSGD` and
:class:`~fedlightning.optim.MimeLiteSGD`, to :class:`_BatchedAMSGradClient`, :class:`_BatchedAdaAlterClient`,
:class:`_BatchedMimeSGD` and :class:`_BatchedMimeLiteSGD`, whose server statistics become ``[C, D]`` rows. Each rule
reads the clients' optimizer instances (built by the loop, client state set) and writes the final per-client state back
through their public methods, so ``get_client_state()`` / ``client_report()`` answer exactly as after sequential
training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedlightning.optim import (
    SPS,
    AdaAlterClient,
    AMSGradClient,
    DecSPS,
    MimeLiteSGD,
    MimeSGD,
    SgdArmijo,
    rules,
    step_hooks,
)

from .support import VectorizationUnsupportedError
from .torch_internals import _foreach_add_, _rng_state, _set_rng_state
from .trials import _TrialLine, _write_points

if TYPE_CHECKING:
    from .step import _StepEvaluator

__all__ = ["BatchedRule", "StepRecord", "make_batched_rule", "BUILT_IN_FORMS", "TRIAL_POINT_BYTES"]

#: Bytes of trial points (``[P, D]``, and as many gathered gradient rows on accelerators) one trial call of the
#: batched Armijo search may hold before its (client, grid point) pairs are split over several calls of at least
#: ``C`` rows each (ours: 512 MiB; a trial call of ``C`` rows then holds no more than the step's gradient
#: evaluation, whose activations and ``[C, D]`` gradients are larger, so a search fits where the round's gradient
#: evaluation fits: a ResNet-18's ~300 pairs of 20 clients asked 26.6 GiB at once on an 80 GB GPU without it).
TRIAL_POINT_BYTES = 1 << 29


def _nan_for_none(values) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def _none_for_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


class StepRecord:
    """Per-step telemetry of every client, kept as tensors until the end of the round (one host sync): the losses
    ``[C]`` and applied step sizes ``[C]`` of each step (:meth:`add`), and per-client counts of rejected trial
    points (``backtracks``), forward and backward passes."""

    def __init__(self, num_clients: int, device: torch.device):
        self.losses: list[Tensor] = []
        self.step_sizes: list[Tensor] = []
        self.backtracks = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.forwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.backwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.uniform_evaluations = 0  # one forward and one backward of every client (SGD steps), added at the end
        self._host_counts: list[list[int]] | None = None  # add_host's (backtracks, forwards, backwards) per client

    def add(
        self,
        loss: Tensor,
        step_sizes: Tensor,
        alive: Tensor,
        forwards: Tensor | None = None,
        backtracks: Tensor | None = None,
    ) -> None:
        """One step: the clients' losses and applied step sizes (NaN where the step was not finite), and for the
        clients in ``alive`` one backward pass, ``forwards`` forward passes (default 1) and ``backtracks``."""
        self.losses.append(loss)
        self.step_sizes.append(step_sizes)
        live = alive.long()
        self.forwards += live if forwards is None else forwards * live
        self.backwards += live
        if backtracks is not None:
            self.backtracks += backtracks * live

    def add_host(
        self, loss: Tensor, step_sizes: list[float], live: list[bool], forwards: list[int], backtracks: list[int]
    ) -> None:
        """:meth:`add` for a rule that holds its step's telemetry on the host already (``live``: the ``alive`` mask as
        a list): the step sizes and counts stay host lists until the end of the round (:meth:`step_size_rows`,
        :meth:`totals`) instead of becoming a few small tensors and kernels at every step."""
        self.losses.append(loss)
        self.step_sizes.append(step_sizes)
        counts = self._host_counts
        if counts is None:
            counts = self._host_counts = [[0] * len(live) for _ in range(3)]
        backs, fwds, bwds = counts
        for i, on in enumerate(live):
            if on:
                backs[i] += backtracks[i]
                fwds[i] += forwards[i]
                bwds[i] += 1

    def step_size_rows(self) -> list[list[float]]:
        """The applied step sizes of every step, as floats, per client (``[C][K]``)."""
        if self.step_sizes and all(isinstance(s, list) for s in self.step_sizes):
            return [list(column) for column in zip(*self.step_sizes)]
        device = self.backtracks.device
        steps = [
            torch.tensor(s, dtype=torch.float64, device=device) if isinstance(s, list) else s for s in self.step_sizes
        ]
        return torch.stack(steps).double().cpu().t().tolist()

    def totals(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per-client ``(backtracks, forwards, backwards)`` over the round's steps so far."""
        if self._host_counts is None:
            return self.backtracks, self.forwards, self.backwards
        host = torch.tensor(self._host_counts, dtype=torch.long, device=self.backtracks.device)
        return self.backtracks + host[0], self.forwards + host[1], self.backwards + host[2]


class BatchedRule:
    """A client optimizer's batched form: one local step of every client of a round at once, on ``W`` in place.

    **Opting in.** A client optimizer class (a ``torch.optim.Optimizer``) names its batched form in a class
    attribute ``batched_rule``: a subclass of this class, or a classmethod returning one (to import it lazily). It
    must be defined on the class that defines ``step`` or on a subclass of it, so that a subclass overriding
    ``step`` is not run with its parent's batched form. Optimizers without one get a
    :class:`VectorizationUnsupportedError` naming them (``client_execution="auto"`` then trains sequentially).

    **Construction**, once per round: ``Rule(optimizers, params, device, grad_clip)``. ``optimizers``: the round's
    client optimizers, in client order, built as for sequential training (``set_client_data``,
    ``set_client_state`` and ``scale_step`` applied; the same hyper-parameters for every client and param group,
    checked); ``params``: the model's trainable parameters; ``grad_clip``: the loop's ``client_grad_clip``, which
    sequential training applies to optimizers without ``requires_closure``: such a rule sets
    ``applies_grad_clip = True`` and clips with :meth:`clip`, else a ``grad_clip`` is refused. Read per-client
    state through the optimizers' public methods (``get_client_state()`` and the like).

    **step(W, ev, record, alive)**, once per local step. ``W`` ([C, D]): row ``c`` holds client ``c``'s weights,
    the columns in the engine's storage order; update it in place. ``alive`` ([C] bool): the clients still
    training (with ``stops_on_nonfinite``, a client stops after its first non-finite loss, as sequential training
    stops a closure optimizer; with ragged per-client step counts, a client whose own steps are done); leave the
    other rows and their per-client state unchanged (:meth:`move`; the engine restores a finished client's row
    itself, but not state that ``finalize`` writes back). ``ev`` evaluates this step's batches:

    * ``ev.gradient(W, alive, flat=True)`` -> ``(loss [C], g)``: one forward and backward of every client; ``g``
      is ``[C, D]`` in ``W``'s column order, or (``flat=False``) the per-parameter ``[C, *shape]`` gradients;
    * ``ev.views(W)``: the per-parameter ``[C, *shape]`` views of ``W``; ``ev.deterministic``: no random layers;
    * with ``uses_trials = True``: ``ev.trial(points, clients=None)``, losses at trial points ``[P, D]`` of the
      clients ``clients`` ([P] indices; None: every client in order) under ``no_grad``, with the gradient
      evaluation's random state; call ``ev.finish()`` after the last trial of the step.

    ``record`` (:class:`StepRecord`) takes the step's telemetry: ``record.add(loss, step_sizes, alive)``, or
    ``record.add_host(...)`` with the step sizes and counts as host lists.

    **finalize(optimizers)**, after the round: write the per-client state back through the optimizers' public
    methods (``set_client_state()`` and the like), so that ``get_client_state()`` and ``client_report()`` answer
    as after sequential training.

    **zero_gradient_moves(used)**: a parameter that the loss does not reach at a step gets a zero gradient in
    ``g``, where the sequential optimizer skips it (``.grad`` None). Return False when a zero gradient leaves the
    parameter and the rule's state exactly as that skip does (``used``: it had a gradient earlier in the round); the
    default True makes such a step refuse vectorized training by name (:meth:`check_missing_gradients`).
    """

    stops_on_nonfinite = False  # a client stops at its first non-finite loss (closure optimizers)
    uses_trials = False  # evaluates trial points (line search): the evaluator keeps the RNG state to replay
    applies_grad_clip = False  # clips the gradient with the loop's client_grad_clip (clip())

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Tensor],
        device: torch.device,
        grad_clip: float | None = None,
    ):
        self.grad_clip = grad_clip

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        raise NotImplementedError

    def finalize(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Write the batched per-client state back into each client's optimizer instance."""

    def zero_gradient_moves(self, used: bool) -> bool:
        """Whether this rule's step with a zero gradient can change a parameter or its state (weight decay,
        momentum, moments), where the sequential optimizer skips a parameter whose ``.grad`` is None; ``used``:
        the parameter had a gradient at an earlier step of the round (state built from it). Default True: a rule
        that does not say is not assumed to skip."""
        return True

    def check_missing_gradients(self, missing: Sequence[int], names: Sequence[str]) -> None:
        """Called by the gradient evaluation with the parameters (indices and the model's trainable parameter
        names) that the loss does not reach at this step. Decision (ours): the batched step gives them a zero
        gradient; where that would move them or their state while the sequential optimizer skips them
        (:meth:`zero_gradient_moves`), a :class:`VectorizationUnsupportedError` names them (``"auto"`` trains
        sequentially), so that the modes never train differently."""
        used = getattr(self, "_had_gradient", None)
        if used is None:
            used = self._had_gradient = set()
        if not missing:
            if len(used) < len(names):
                used.update(range(len(names)))
            return
        moving = [k for k in missing if self.zero_gradient_moves(k in used)]
        used.update(k for k in range(len(names)) if k not in set(missing))
        if moving:
            shown = ", ".join(names[k] for k in moving[:5]) + (
                f" and {len(moving) - 5} more" if len(moving) > 5 else ""
            )
            rule = type(self).__name__.removeprefix("_Batched")
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized': training_step's loss does not depend on {shown}, which the "
                f"sequential optimizer then leaves alone (no gradient), while the batched {rule} step would move "
                "them or their state with a zero gradient (weight decay, momentum or moments). Freeze them "
                "(requires_grad_(False)), or use client_execution='sequential' (or 'auto')"
            )

    def clip(self, g: Tensor) -> Tensor:
        """``g`` ([C, D]) clipped per client as ``torch.nn.utils.clip_grad_norm_(max_norm=grad_clip)`` does:
        ``coef = max_norm / (‖g‖ + 1e-6)``, clamped to 1, always multiplied; ``g`` itself without ``grad_clip``."""
        if self.grad_clip is None:
            return g
        norm = torch.linalg.vector_norm(g, dim=1)
        coef = (float(self.grad_clip) / (norm + 1e-6)).clamp(max=1.0)
        return g * coef[:, None]

    @staticmethod
    def grad_sq(g: Any, ev: _StepEvaluator) -> Tensor:
        """‖g‖² per client in float64, computed as the optimizers of :mod:`fedlightning.optim` compute it
        (per-tensor norms in the parameters' dtype, squared and summed in float64), so their decisions see the same
        numbers up to rounding. A flat ``g`` is normed per parameter block as stored (a norm does not depend on the
        order of the entries, only its rounding may; the engine's storage order already differs from the parameters'
        own)."""
        parts = g if isinstance(g, (list, tuple)) else torch.split(g, ev.engine.weights.numels, dim=1)
        norms = [torch.linalg.vector_norm(v, dim=tuple(range(1, v.dim()))) if v.dim() > 1 else v.abs() for v in parts]
        return torch.stack(norms).double().square().sum(dim=0)

    @classmethod
    def loss_and_grad_sq(cls, loss: Tensor, g: Any, ev: _StepEvaluator) -> tuple[Tensor, Tensor, Tensor]:
        """float64 loss and ‖g‖² (:meth:`grad_sq`) per client, and the mask of clients whose step is finite
        (:func:`fedlightning.optim.rules.finite_step`)."""
        grad_sq = cls.grad_sq(g, ev)
        loss64 = loss.double()
        return loss64, grad_sq, rules.finite_step(loss64, grad_sq)

    @staticmethod
    def move(W: Tensor, g: Any, step: Tensor, where: Tensor | None, views: Callable | None = None) -> None:
        """``w ← w − step · g`` for the clients in ``where`` (same rounding as ``torch._foreach_add_(alpha=-step)``);
        the other rows are left bit-for-bit unchanged (their gradient may be non-finite). ``where=None``: every row
        moves (a rule that knows it on the host, without a mask or a synchronisation). ``g`` is ``[C, D]``, or
        the per-parameter gradients, applied to the parameters' views of ``W`` (``views(W)``, e.g. ``ev.views``)."""
        neg = (-step).to(W.dtype)
        if isinstance(g, Tensor):
            if where is None or (W.device.type == "cpu" and bool(where.all())):  # in place, no [C, D] temporary
                W.addcmul_(g, neg[:, None])
                return
            moved = torch.addcmul(W, g, neg[:, None])
            torch.where(where[:, None], moved, W, out=W)
            return
        for w, gi in zip(views(W), g):
            shape = (-1,) + (1,) * (w.dim() - 1)
            if where is None:
                w.addcmul_(gi, neg.view(shape))
                continue
            moved = torch.addcmul(w, gi, neg.view(shape))
            w.copy_(torch.where(where.view(shape), moved, w))


class _BatchedSGD(BatchedRule):
    """``torch.optim.SGD``: ``d = ±clip(g) + λ w``; with momentum ``μ``, ``b ← d`` at a client's first step of the
    round, ``b ← μ b + (1 − τ) d`` after it, and ``d ← d + μ b`` (Nesterov) or ``d ← b``; ``w ← w − lr · d``. The
    same ops as torch's SGD, on the ``[C, D]`` rows of all clients at once (one momentum buffer row per client).

    The loop gives every client a fresh optimizer each round (``FederatedLoop``'s ``client_optimizer``), so the
    momentum buffers start empty at every round, as sequentially. A parameter the loss does not depend on gets a
    zero gradient here, while torch's SGD skips a parameter whose ``.grad`` is None: the same step, unless it decays
    (``weight_decay > 0``) or, after a step that had its gradient, moves with its momentum, which
    :meth:`~BatchedRule.check_missing_gradients` refuses.
    """

    applies_grad_clip = True

    def zero_gradient_moves(self, used: bool) -> bool:
        return self.weight_decay != 0.0 or (used and self.momentum != 0.0)

    def __init__(
        self,
        lr: float,
        weight_decay: float,
        grad_clip: float | None,
        num_clients: int,
        device,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
    ):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.grad_clip = grad_clip
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.nesterov, self.maximize = bool(nesterov), bool(maximize)
        self.buffer: Tensor | None = None
        self.lr_vector = torch.full((num_clients,), self.lr, dtype=torch.float64, device=device)

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        if self.momentum == 0.0 and not self.maximize and self.grad_clip is None and self.weight_decay == 0.0:
            # plain SGD: w <- w - lr g on every parameter's rows of W, the gradients as the backward pass made them
            loss, grads = ev.gradient(W, alive, flat=False)
            _foreach_add_(ev.views(W), grads, alpha=-self.lr)
        else:
            loss, g = ev.gradient(W, alive)
            g = self.clip(g)
            d = rules.sgd_direction(-g if self.maximize else g, W, self.weight_decay)
            if self.momentum != 0.0:
                if self.buffer is None:
                    self.buffer = d.detach().clone()
                else:
                    self.buffer.mul_(self.momentum).add_(d, alpha=1 - self.dampening)
                d = d.add(self.buffer, alpha=self.momentum) if self.nesterov else self.buffer
            W.add_(d, alpha=-self.lr)
        record.losses.append(loss)
        record.step_sizes.append(self.lr_vector)
        record.uniform_evaluations += 1


class _BatchedAdam(BatchedRule):
    """``torch.optim.Adam`` / ``AdamW`` (their non-fused arithmetic), every client at once: per client and step
    ``t``, ``g ← ±clip(g)`` (+ ``λ w`` for Adam's coupled weight decay; AdamW first scales ``w`` by ``1 − lr λ``),
    ``m ← lerp(m, g, 1 − β₁)``, ``v ← β₂ v + (1 − β₂) g²`` (AMSGrad: ``v̂ = max(v̂, v)``), and
    ``w ← w − lr / (1 − β₁^t) · m / (√v / √(1 − β₂^t) + ε)``, with the moment rows ``[C, D]`` zero at the start of the
    round (a fresh optimizer per client and round, as sequentially).

    Decisions (ours): a parameter the loss does not depend on gets a zero gradient here (torch skips a parameter
    whose ``.grad`` is None): the same step while its moments are zero (no gradient yet this round) and without
    weight decay; otherwise its moments would decay and move it, which :meth:`~BatchedRule.check_missing_gradients`
    refuses. ``foreach``, ``fused``, ``capturable`` and ``differentiable`` select torch's implementation, not the
    arithmetic, and are not reproduced (a fused kernel can round differently).
    """

    applies_grad_clip = True

    def zero_gradient_moves(self, used: bool) -> bool:
        return self.weight_decay != 0.0 or used

    def __init__(self, hp: dict[str, Any], decoupled: bool, grad_clip: float | None, num_clients: int, device):
        self.lr, self.eps, self.weight_decay = float(hp["lr"]), float(hp["eps"]), float(hp.get("weight_decay", 0.0))
        self.beta1, self.beta2 = (float(b) for b in hp["betas"])
        self.amsgrad, self.maximize = bool(hp.get("amsgrad", False)), bool(hp.get("maximize", False))
        self.decoupled = decoupled
        self.grad_clip = grad_clip
        self.t = 0
        self.m: Tensor | None = None
        self.v: Tensor | None = None
        self.v_max: Tensor | None = None
        self.lr_vector = torch.full((num_clients,), self.lr, dtype=torch.float64, device=device)

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive)
        g = self.clip(g)
        if self.maximize:
            g = -g
        if self.m is None:
            self.m, self.v = torch.zeros_like(W), torch.zeros_like(W)
            self.v_max = torch.zeros_like(W) if self.amsgrad else None
        self.t += 1
        if self.weight_decay != 0.0:
            if self.decoupled:
                W.mul_(1 - self.lr * self.weight_decay)
            else:
                g = g.add(W, alpha=self.weight_decay)
        self.m.lerp_(g, 1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        bias1, bias2 = 1 - self.beta1**self.t, 1 - self.beta2**self.t
        second = self.v
        if self.amsgrad:
            torch.maximum(self.v_max, self.v, out=self.v_max)
            second = self.v_max
        denom = (second.sqrt() / bias2**0.5).add_(self.eps)
        W.addcdiv_(self.m, denom, value=-(self.lr / bias1))
        record.losses.append(loss)
        record.step_sizes.append(self.lr_vector)
        record.uniform_evaluations += 1


def _param_orders(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor]) -> list[list[int]]:
    """For each optimizer, the index in ``params`` (the engine's parameter order) of each parameter of its param
    groups, in param-group order (the order of the per-parameter lists its public methods take and give)."""
    index = {id(p): k for k, p in enumerate(params)}
    orders = []
    for o in optimizers:
        order = [index.get(id(p)) for g in o.param_groups for p in g["params"]]
        if None in order or sorted(order) != list(range(len(params))):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' needs {type(o).__name__} to hold each trainable parameter once"
            )
        orders.append(order)
    return orders


def _memory(t: Tensor) -> tuple:
    """Where ``t``'s values lie: equal for views of the same memory with the same layout (hence the same values)."""
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride())


class _PerClientTensors:
    """Per-client, per-parameter tensors (one list per client, in its optimizer's param-group order) as ``[C, D]``
    rows in the engine's storage order, and back: the state of client optimizers whose statistics the server reads
    (``client_report``) or sets (``set_server_state``)."""

    def __init__(self, orders: list[list[int]]):
        self.orders = orders

    def rows(
        self,
        per_client: Sequence[Sequence[Tensor]],
        W: Tensor,
        views: Callable[[Tensor], list[Tensor]],
        frozen: bool = False,
    ) -> Tensor:
        """``[C, D]`` (``W``'s dtype, device and layout) holding client ``c``'s tensors in row ``c``. ``frozen``
        (state no step writes): one ``[1, D]`` row when every client's tensors are the same memory (server state the
        strategy hands every client as views of one tensor: a frozen statistic, Mime's momentum), which the
        elementwise steps broadcast."""
        by_param: list[list[Tensor]] = [[] for _ in self.orders[0]]
        for tensors, order in zip(per_client, self.orders):
            for t, k in zip(tensors, order):
                by_param[k].append(t)
        shared = frozen and all(len({_memory(t) for t in parts}) == 1 for parts in by_param)
        out = torch.empty_like(W[:1] if shared else W)
        for view, parts in zip(views(out), by_param):
            view.copy_(torch.stack([t.to(device=W.device, dtype=W.dtype) for t in (parts[:1] if shared else parts)]))
        return out

    def clients(self, rows: Tensor, views: Callable[[Tensor], list[Tensor]]) -> list[list[Tensor]]:
        """Every client's row of ``rows`` as its optimizer's per-parameter list (views)."""
        per_param = views(rows)
        return [[per_param[k][c] for k in order] for c, order in enumerate(self.orders)]


class _BatchedServerStateRule(BatchedRule):
    """Shared parts of the batched forms of client optimizers that carry server statistics (:class:`AMSGradClient`,
    :class:`AdaAlterClient`, :class:`MimeLiteSGD`, :class:`MimeSGD`): the shared hyper-parameters, the clients' start
    state as ``[C, D]`` rows (built at the round's first step, once the engine's storage order is fixed; one shared
    row for state every client holds in the same memory, :meth:`_PerClientTensors.rows`), per-client step counts, and
    an update that leaves the rows of clients not in ``alive`` unchanged.

    Decision (ours, as :class:`_BatchedAdam`): a parameter the loss does not depend on gets a zero gradient here,
    where the sequential optimizer skips a parameter whose ``.grad`` is None. AdaAlter's step and increment do not
    change with a zero gradient; AMSGrad's moments (the server's, not zero) and MimeLite's frozen momentum would move
    it, which :meth:`~BatchedRule.check_missing_gradients` refuses."""

    applies_grad_clip = True

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        # the same for every group of every client: make_batched_rule checked it (_same_hyperparameters)
        self.hp = {k: v for k, v in optimizers[0].param_groups[0].items() if k != "params"}
        self.lr = float(self.hp["lr"])
        self.stack = _PerClientTensors(_param_orders(optimizers, params))
        self.optimizers = list(optimizers)
        self.steps = [0] * len(optimizers)  # steps each client took this round
        self.lr_vector = torch.full((len(optimizers),), self.lr, dtype=torch.float64, device=device)
        self.started = False

    def start(self, W: Tensor, ev: _StepEvaluator) -> None:
        """Build the ``[C, D]`` state from the optimizers (at the round's first step)."""

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        if not self.started:
            self.start(W, ev)
            self.started = True
        loss, d = self.direction(W, ev, alive)
        live = alive.tolist()
        for c, on in enumerate(live):
            self.steps[c] += on
        self.update(W, d, None if all(live) else alive[:, None], live)
        self.record(record, loss, alive)

    def direction(self, W: Tensor, ev: _StepEvaluator, alive: Tensor) -> tuple[Tensor, Tensor]:
        """The clients' losses ``[C]`` and the ``[C, D]`` direction the step applies: the clipped gradient."""
        loss, g = ev.gradient(W, alive)
        return loss, self.clip(g)

    def record(self, record: StepRecord, loss: Tensor, alive: Tensor) -> None:
        """The step's telemetry: one forward and one backward pass of every client, the step size ``lr``."""
        record.losses.append(loss)
        record.step_sizes.append(self.lr_vector)
        record.uniform_evaluations += 1

    def update(self, W: Tensor, g: Tensor, where: Tensor | None, live: list[bool]) -> None:
        """The step on the rows of ``W`` and the state; ``where`` ([C, 1] bool): the rows that move (None: all)."""
        raise NotImplementedError

    @staticmethod
    def _assign(target: Tensor, new: Tensor, where: Tensor | None) -> None:
        """``target ← new`` on the rows of ``where`` (None: all, then ``new`` is already ``target``)."""
        if where is not None:
            torch.where(where, new, target, out=target)


class _BatchedAMSGradClient(_BatchedServerStateRule):
    """:class:`fedlightning.optim.AMSGradClient` for every client at once: per client
    ``m ← β₁ m + (1 − β₁) g``, ``v ← β₂ v + (1 − β₂) g²``, ``w ← w − η m / √max(v̂, ε)``, the same ops on ``[C, D]``
    rows; ``m`` and ``v`` start from each client's optimizer (the server's averages) and go back to it after the
    round (``client_report``), ``v̂`` is frozen, so its denominator is computed once per round."""

    def start(self, W, ev):
        (b1, b2), self.eps = self.hp["betas"], float(self.hp["eps"])
        self.b1, self.b2 = float(b1), float(b2)
        stats = [o.client_statistics() for o in self.optimizers]
        self.m = self.stack.rows([st["exp_avg"] for st in stats], W, ev.views)
        self.v = self.stack.rows([st["exp_avg_sq"] for st in stats], W, ev.views)
        v_hat = self.stack.rows([st["max_exp_avg_sq"] for st in stats], W, ev.views, frozen=True)
        self.denom = v_hat.clamp_(min=self.eps).sqrt_()
        self.views = ev.views
        self.start_steps = [o.local_steps for o in self.optimizers]

    def update(self, W, g, where, live):
        b1, b2 = self.b1, self.b2
        m = self.m.mul(b1) if where is not None else self.m.mul_(b1)
        m.add_(g, alpha=1.0 - b1)
        v = self.v.mul(b2) if where is not None else self.v.mul_(b2)
        v.addcmul_(g, g, value=1.0 - b2)
        self._assign(self.m, m, where)
        self._assign(self.v, v, where)
        if where is None:
            W.addcdiv_(self.m, self.denom, value=-self.lr)
        else:
            self._assign(W, torch.addcdiv(W, self.m, self.denom, value=-self.lr), where)

    def finalize(self, optimizers) -> None:
        if not self.started:
            return
        moments = zip(self.stack.clients(self.m, self.views), self.stack.clients(self.v, self.views))
        for c, (o, (m, v)) in enumerate(zip(optimizers, moments)):
            o.load_client_statistics({"exp_avg": m, "exp_avg_sq": v}, self.start_steps[c] + self.steps[c])


class _BatchedAdaAlterClient(_BatchedServerStateRule):
    """:class:`fedlightning.optim.AdaAlterClient` for every client at once: ``w ← w − η g / √(B² + k ε²)`` and
    ``A² ← A² + g²``, the same ops on ``[C, D]`` rows, with the placeholder ``k ε²`` the same Python scalar as the
    optimizer's; ``B²`` is frozen, the increment ``Σ g²`` goes back to each client's optimizer after the round
    (``client_report``). The clients step in lockstep, so every client still training is at the same ``k`` (its
    steps since the server state was set, 1 at the round's first step); clients whose optimizers start the round at
    different step counts are refused (the loop's ``LocalAdaAlter`` sets every client's state, and so its count, at
    the round's start)."""

    def start(self, W, ev):
        self.eps = float(self.hp["eps"])
        counts = {o.local_steps for o in self.optimizers}
        if len(counts) != 1:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' needs every AdaAlterClient at the same step count at the round's start; "
                f"got {sorted(counts)}"
            )
        self.k0 = counts.pop()
        stats = [o.client_statistics() for o in self.optimizers]
        self.accumulator = self.stack.rows([st["accumulator"] for st in stats], W, ev.views, frozen=True)
        self.increment = self.stack.rows([st["increment"] for st in stats], W, ev.views)
        self.views = ev.views
        self.calls = 0

    def zero_gradient_moves(self, used: bool) -> bool:
        return False  # w − η·0/√(B² + kε²) = w, A² + 0² = A²

    def update(self, W, g, where, live):
        self.calls += 1
        k = float(self.k0 + self.calls)  # AdaAlterClient's k at this step (lockstep: the same for every client)
        eps = self.eps
        denom = self.accumulator.add(k * eps * eps).sqrt_()
        if where is None:
            W.addcdiv_(g, denom, value=-self.lr)
            self.increment.addcmul_(g, g)
            return
        self._assign(W, torch.addcdiv(W, g, denom, value=-self.lr), where)
        self._assign(self.increment, torch.addcmul(self.increment, g, g), where)

    def finalize(self, optimizers) -> None:
        if not self.started:
            return
        for c, (o, increment) in enumerate(zip(optimizers, self.stack.clients(self.increment, self.views))):
            o.load_client_statistics({"increment": increment}, self.k0 + self.steps[c])


class _BatchedMimeLiteSGD(_BatchedServerStateRule):
    """:class:`fedlightning.optim.MimeLiteSGD` for every client at once: ``w ← w − η ((1 − β) g + β m)`` with each
    client's frozen server momentum ``m`` (``server_momentum()``) as rows (one, broadcast, when the strategy gives
    every client the same tensor, as :class:`~fedlightning.callbacks.MimeLite` does), the same ops as the optimizer's
    on every row. No per-client state changes (MimeLite reports nothing)."""

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        betas = {o.momentum for o in optimizers}
        if len(betas) != 1:
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' needs the same MimeLiteSGD momentum for every client; got {betas}"
            )
        self.beta = float(betas.pop())

    def zero_gradient_moves(self, used: bool) -> bool:
        return self.beta != 0.0  # β·m moves it (Mime: g(y) − g(x) and c are zero for such a parameter too)

    def start(self, W, ev):
        self.momentum = None
        if self.beta != 0.0:
            self.momentum = self.stack.rows([o.server_momentum() for o in self.optimizers], W, ev.views, frozen=True)

    def update(self, W, g, where, live):
        d = g if self.momentum is None else g.mul(1.0 - self.beta).add_(self.momentum, alpha=self.beta)
        if where is None:
            W.add_(d, alpha=-self.lr)
        else:
            self._assign(W, W.add(d, alpha=-self.lr), where)


class _BatchedMimeSGD(_BatchedMimeLiteSGD):
    """:class:`fedlightning.optim.MimeSGD` for every client at once: ``w ← w − η ((1 − β) d + β m)`` with the
    SVRG-corrected ``d = g(y) − g(x) + c``, both gradients on the step's batch, the server point ``x`` and full-batch
    gradient ``c`` of each client's optimizer (``server_point()``, ``full_gradient()``) as rows (``x`` one per client,
    the weights of the evaluation at ``x``).

    The gradient at ``x`` is one more batched evaluation per step, taken first, as the optimizer takes it: it leaves
    no trace (the model's running statistics, metric calls and logged values of that evaluation are not kept, which
    is what :class:`~fedlightning.callbacks.Mime`'s ``evaluation_guard`` does sequentially) and the random state is
    put back after it, so the evaluation at ``y`` draws the same dropout masks. As a closure optimizer: no
    ``client_grad_clip`` (the corrected direction is not clipped), a client stops after its first non-finite loss,
    and each step counts 2 forward and 2 backward passes (``last_step``)."""

    applies_grad_clip = False
    stops_on_nonfinite = True

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, None)
        corrections = {bool(o.correction) for o in optimizers}
        if len(corrections) != 1:
            raise VectorizationUnsupportedError("client_execution='vectorized' needs the same MimeSGD correction")
        self.correction = corrections.pop()

    def start(self, W, ev):
        super().start(W, ev)
        self.anchor = self.full = None
        if self.correction:
            anchor = self.stack.rows([o.server_point() for o in self.optimizers], W, ev.views, frozen=True)
            self.anchor = anchor.expand_as(W).contiguous()  # the gradient evaluation's weights: one row per client
            self.full = self.stack.rows([o.full_gradient() for o in self.optimizers], W, ev.views, frozen=True)

    def direction(self, W, ev, alive):
        g_anchor = self._gradient_at_anchor(ev, alive) if self.correction else None
        loss, g = ev.gradient(W, alive)  # not clipped (a closure optimizer)
        return loss, g if g_anchor is None else g.sub(g_anchor).add_(self.full)

    def record(self, record, loss, alive):
        evaluations = 2 if self.correction else 1
        step = torch.where(torch.isfinite(loss), self.lr_vector, torch.full_like(self.lr_vector, float("nan")))
        record.add(loss, step, alive, forwards=torch.full_like(record.forwards, evaluations))
        if evaluations == 2:
            record.backwards += alive.long()

    def _gradient_at_anchor(self, ev: _StepEvaluator, alive: Tensor) -> Tensor:
        """Every client's gradient at the server point on this step's batch, without effects, random state kept."""
        rng = _rng_state(ev.rng_devices)
        kept = ev.keep_effects, ev.log_sink, ev.metric_sink
        ev.keep_effects, ev.log_sink, ev.metric_sink = False, None, None
        try:
            return ev.gradient(self.anchor, alive)[1]
        finally:
            ev.keep_effects, ev.log_sink, ev.metric_sink = kept
            _set_rng_state(rng, ev.rng_devices)


#: Points of a client's second window in the batched Armijo search (:class:`_BatchedArmijo`); later windows double.
_SECOND_WINDOW = 8


class _BatchedArmijo(BatchedRule):
    """:class:`fedlightning.optim.SgdArmijo` for every client at once, with masked backtracking.

    Decisions (ours): every client starts from its own ``η_0`` (reset policy, its own last accepted step and ``b/n_i``)
    and walks the grid ``η_0 β^m``, ``m = 0, 1, …``; it stops at its first accepted ``m`` while the others go on. The
    outcome (accepted step, backtracks, forward count, state) is the sequential search's, grid point by grid point; only
    the batching differs:

    * deterministic models: a trial round evaluates every client still searching at a window of its next grid
      points, all (client, point) pairs in one batched call (several calls of at least ``C`` pairs where the trial
      points would pass :data:`TRIAL_POINT_BYTES`). A client's first window of a step ends at the larger ``m`` it
      accepted at its previous two steps of the round (the accepted ``m`` drifts by a few points from step to step;
      one point at the round's first step); a client whose previous search exhausted the grid gets the whole grid at
      once (such a search mostly fails again: e.g. a client whose float32 loss is 0 with a gradient above
      ``grad_tol``, below which no trial loss can fall); the window after a client's first has 8 points, every later
      one twice the one before. The lengths trade the fixed cost of a batched call against rows evaluated past the
      accepted point: replaying recorded searches (``benchmarks/armijo_vectorized.py --windows``) puts this policy at
      the lowest cost of those tried on the digits and synthetic workloads (docs/benchmarks.md, "Batched line
      search"). Those extra points are computed but not counted: telemetry counts the search's own evaluations.
      Every call evaluates at least one point of every client still searching, so a step makes no more trial calls
      (unsplit) than its longest search has trials;
    * models with random layers (dropout): every client at one grid point per round, in order, so the replayed
      generator gives every trial the dropout masks of its gradient evaluation.

    One host synchronisation per step for the step's losses and squared gradient norms, and one per trial round.
    Decision (ours, measured): the per-client scalars of the search (``η_0``, the grid's step sizes, the Armijo
    tests, the accepted step, the state after the search) are Python floats, evaluated client by client with
    :mod:`fedlightning.optim.rules`' one-client form, the same IEEE float64 operations as
    :class:`~fedlightning.optim.SgdArmijo`, so the weights are bit for bit those of the tensor form this replaced
    (about 60 small tensor ops a step, each a few µs on a CPU and a kernel launch on a GPU; on the digits MLP with 20
    clients the step's bookkeeping took 0.2–0.45 ms less of a 7–10 ms step). Only the trial points, the trial calls
    and the update are tensor ops. Zero-gradient, exhausted-search and non-finite policies, telemetry and per-client
    state are SgdArmijo's (see :mod:`fedlightning.optim.armijo`).
    """

    stops_on_nonfinite = True
    uses_trials = True

    def zero_gradient_moves(self, used: bool) -> bool:
        return False  # w − η·0 = w, and a zero block adds nothing to ‖g‖²

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        hp = dict(optimizers[0].hyper)
        self.eta_max, self.c, self.reset = hp["eta_max"], hp["c"], hp["reset"]
        self.init_step = hp.get("init_step_size")
        self.max_backtracks, self.grad_tol = hp["max_backtracks"], hp["grad_tol"]
        self.device = device
        C = len(optimizers)
        # δ^{1/⌈n_i/b⌉} per client (SgdArmijo.per_step_growth)
        self.growth = [o.per_step_growth() for o in optimizers] if self.reset == "grow" else [1.0] * C
        self.powers_list = rules.armijo_powers(hp["beta"], self.max_backtracks)
        # the client state at the start of the round; η_{k-1} before a client's first step is its carried step when
        # carry_step_size (SgdArmijo.initial_step_size), else none (NaN) and the search starts at eta_max
        states = [o.get_client_state() for o in optimizers]
        self.start_state = _nan_for_none(st["step_size"] for st in states)
        self.prev = [s if o.carry_step_size else math.nan for s, o in zip(self.start_state, optimizers)]
        self.scale = [float(o.step_scale) for o in optimizers]  # client step scale (scale_step)
        self.accepted_step = _nan_for_none(st["accepted_step_size"] for st in states)
        self.accepted_any = [False] * C
        # window prediction (deterministic models): the grid points each client accepted at its last two steps of
        # the round (most recent last), and whether its last search exhausted the grid
        self.recent_m: list[tuple[int, ...]] = [()] * C
        self.exhausted_last = [False] * C
        self._clients: dict[tuple[int, ...], Tensor] = {}  # a trial call's [P] client indices, by pairs per client

    def initial_step_size(self) -> list[float]:
        return [
            rules.armijo_initial_step(self.reset, self.eta_max, p, gr, self.init_step)
            for p, gr in zip(self.prev, self.growth)
        ]

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive)
        # the step's host synchronisation
        losses, norms, live = loss.tolist(), self.grad_sq(g, ev).tolist(), alive.tolist()  # exact as floats
        finite = [rules.finite_step(f, n) for f, n in zip(losses, norms)]
        searching = [a and ok and not rules.flat_gradient(n, self.grad_tol) for a, ok, n in zip(live, finite, norms)]
        eta0 = self.initial_step_size()
        grid = self.max_backtracks + 1  # grid points m = 0 .. max_backtracks
        search = self._search_windows if ev.deterministic else self._search_in_order
        first_m, trials = search(W, g, ev, losses, norms, eta0, searching, grid)
        ev.finish()
        powers, scale = self.powers_list, self.scale
        C = len(first_m)
        accepted = [m < grid for m in first_m]
        accepted_eta = [eta0[i] * powers[first_m[i]] if accepted[i] else 0.0 for i in range(C)]
        applied = [accepted_eta[i] * scale[i] for i in range(C)]  # SgdArmijo applies s·η_k
        where = None if all(accepted) else self._mask(accepted)  # every client moves: move()'s in-place path
        self.move(W, g, torch.tensor(applied, dtype=torch.float64, device=self.device), where)
        for i in range(C):
            exhausted = searching[i] and not accepted[i]
            self.prev[i], self.accepted_step[i] = rules.armijo_after_search(
                eta0[i], accepted_eta[i], accepted[i], exhausted, self.prev[i], self.accepted_step[i], powers[grid]
            )
            self.accepted_any[i] = self.accepted_any[i] or accepted[i] or exhausted
        record.add_host(
            loss,
            [a if f else math.nan for a, f in zip(applied, finite)],
            live,
            forwards=[1 + t for t in trials],
            backtracks=[t - 1 if a else t for t, a in zip(trials, accepted)],
        )

    def _mask(self, values: list[bool]) -> Tensor:
        return torch.tensor(values, dtype=torch.bool, device=self.device)

    def _accepts(self, trial_losses: list[float], pairs: list[tuple[int, float]], losses, norms) -> list[bool]:
        """The Armijo test of each (client, step size) pair, from its trial loss (a float32 value is exact as a
        Python float, as ``.double()`` gives it)."""
        c = self.c
        return [rules.armijo_accepts(t, losses[i], norms[i], c, eta) for t, (i, eta) in zip(trial_losses, pairs)]

    def _search_windows(self, W, g, ev, losses, norms, eta0, searching, grid):
        """Deterministic models: (client, grid point) pairs of all searching clients in one call per round.

        Returns the first accepted grid point of every client (``grid``: none) and its number of trials, as lists."""
        C = W.shape[0]
        powers = self.powers_list
        todo = list(searching)
        first_m, trials, next_m = [grid] * C, [0] * C, [0] * C
        width = [self._first_window(c, grid) for c in range(C)]
        extended = [False] * C  # the client's first window is behind it
        while True:
            widths = [min(width[c], grid - next_m[c]) if todo[c] else 0 for c in range(C)]
            if sum(widths) == 0:
                break
            pairs = [(c, eta0[c] * powers[next_m[c] + j]) for c in range(C) for j in range(widths[c])]
            trial_losses = self._trial_losses(ev, W, g, pairs, widths)
            ok = self._accepts(trial_losses, pairs, losses, norms)
            start = 0
            for c, w in enumerate(widths):
                if not w:
                    continue
                block = ok[start : start + w]
                start += w
                if True in block:
                    hit = block.index(True)
                    first_m[c], todo[c] = next_m[c] + hit, False
                    trials[c] += hit + 1
                    self.recent_m[c] = (*self.recent_m[c][-1:], first_m[c])
                    self.exhausted_last[c] = False
                    continue
                trials[c] += w
                next_m[c] += w
                if next_m[c] >= grid:  # exhausted: the next search gets the whole grid at once
                    todo[c] = False
                    self.exhausted_last[c], self.recent_m[c] = True, ()
                width[c] = 2 * w if extended[c] else _SECOND_WINDOW
                extended[c] = True
        return first_m, trials

    def _first_window(self, c: int, grid: int) -> int:
        """Points of client ``c``'s first window at this step (see the class docstring)."""
        if self.exhausted_last[c]:
            return grid
        recent = self.recent_m[c]
        return min(grid, max(recent) + 1) if recent else 1

    def _trial_losses(
        self, ev: _StepEvaluator, W: Tensor, g: Tensor, pairs: list[tuple[int, float]], widths: list[int]
    ) -> list[float]:
        """The losses at the trial points of the (client, step size) pairs, in one trial call, or in calls of at
        most ``max(C, TRIAL_POINT_BYTES / (D · itemsize))`` pairs each (:data:`TRIAL_POINT_BYTES`); each pair's loss
        is the same either way (a row's loss does not depend on the other rows of its call)."""
        C, D = W.shape
        limit = max(C, TRIAL_POINT_BYTES // max(D * W.element_size(), 1))
        skipped, columns = ev.trial_columns()  # the parameters whose points no trial layer reads, if any
        out: list[float] = []
        for start in range(0, len(pairs), limit):
            part = pairs[start : start + limit]
            counts = [0] * len(widths)
            for c, _ in part:
                counts[c] += 1
            clients = self._clients.get(tuple(counts))  # a window's pattern of pairs per client recurs
            if clients is None:
                clients = torch.tensor([c for c, _ in part], dtype=torch.long, device=W.device)
                self._clients[tuple(counts)] = clients
            neg = torch.tensor([-eta for _, eta in part], dtype=W.dtype, device=W.device)  # −η rounded to W's dtype
            line = _TrialLine(W, g, neg, counts, skipped)
            points = self._points(ev, W, g, clients, neg, counts, columns)
            out += ev.trial(points, clients, line=line).tolist()  # the trial round's host synchronisation
        return out

    @staticmethod
    def _points(
        ev: _StepEvaluator,
        W: Tensor,
        g: Tensor,
        pair_client: Tensor,
        neg: Tensor,
        widths: list[int] | None = None,
        columns: list[tuple[int, int]] | None = None,
    ) -> Tensor:
        """Trial points ``w_c − η g_c`` of the (client, grid point) pairs (``neg``: ``−η`` per pair, ``W``'s dtype),
        written into the engine's scratch buffers, their column ranges ``columns`` only (None: all;
        :func:`~fedlightning.vectorized.trials._write_points`)."""
        points = ev.engine.scratch("points", (len(pair_client), W.shape[1]), W.dtype, W.device)
        return _write_points(points, W, g, pair_client, neg, widths, ev.engine.scratch, columns)

    def _search_in_order(self, W, g, ev, losses, norms, eta0, searching, grid):
        """Models with random layers: every client at one grid point per round, all clients in order."""
        C = W.shape[0]
        first_m, trials = [grid] * C, [0] * C
        todo = list(searching)
        for m in range(grid):
            if not any(todo):
                break
            pairs = [(c, eta0[c] * self.powers_list[m]) for c in range(C)]
            neg = torch.tensor([-eta for _, eta in pairs], dtype=W.dtype, device=W.device)
            points = torch.addcmul(W, g, neg.unsqueeze(1))
            line = _TrialLine(W, g, neg, [1] * C)
            ok = self._accepts(ev.trial(points, line=line).tolist(), pairs, losses, norms)
            for c in range(C):
                if todo[c]:
                    trials[c] += 1
                    if ok[c]:
                        first_m[c], todo[c] = m, False
        return first_m, trials

    def finalize(self, optimizers) -> None:
        # η_{k-1}: the search state where a search ended this round (accepted or exhausted), else the round's start
        prev = [p if a else s for p, a, s in zip(self.prev, self.accepted_any, self.start_state)]
        for o, p, a in zip(optimizers, prev, self.accepted_step):
            o.set_client_state({"step_size": _none_for_nan(p), "accepted_step_size": _none_for_nan(a)})


class _BatchedSPS(BatchedRule):
    """:class:`fedlightning.optim.SPS` (SPS_max, constant or smoothed cap; ``fixed_step_size`` FedSPS-Global mode) for
    every client at once: ``γ_i = min{(f_i − ℓ*)/(c‖g_i‖²), γ_{b,i}}``, degenerate steps and state as SPS."""

    stops_on_nonfinite = True

    def zero_gradient_moves(self, used: bool) -> bool:
        return False  # w − η·0 = w, and a zero block adds nothing to ‖g‖²

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        hp = dict(optimizers[0].hyper)
        self.c, self.gamma_max, self.f_star = hp["polyak_c"], hp["gamma_max"], hp["f_star"]
        self.grad_tol, self.fixed_lr = hp["grad_tol"], hp.get("fixed_step_size")
        f64 = dict(dtype=torch.float64, device=device)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        self.growth = None  # constant cap
        if hp["smooth"]:  # δ^{1/⌈n_i/b⌉} per client (SPS.per_step_growth)
            self.growth = torch.tensor([o.per_step_growth() for o in optimizers], **f64)
        self.prev = torch.tensor(_nan_for_none(o.get_client_state().get("prev_step") for o in optimizers), **f64)
        nan = torch.full((len(optimizers),), float("nan"), **f64)
        self.report = (nan.clone(), nan.clone(), nan.clone())  # last step's (sps step, f, ‖g‖²): SPS.client_report
        self.reported = torch.zeros(len(optimizers), dtype=torch.bool, device=device)

    def cap(self) -> Tensor:
        return rules.sps_cap(self.gamma_max, self.prev, self.growth)

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = self.loss_and_grad_sq(loss, g, ev)
        sps_step, degenerate = rules.sps_step(loss64 - self.f_star, grad_sq, self.c, self.cap(), self.grad_tol)
        report = alive & finite
        self.report = tuple(torch.where(report, new, old) for new, old in zip((sps_step, loss64, grad_sq), self.report))
        self.reported |= report
        step, moved, prev = rules.sps_after_step(sps_step, degenerate, self.scale, self.prev, self.fixed_lr)
        moves = report & moved
        self.prev = torch.where(moves, prev, self.prev)
        self.move(W, g, step, moves, ev.views)
        record.add(loss, torch.where(finite, step, torch.full_like(step, float("nan"))), alive)

    def finalize(self, optimizers) -> None:
        prev = self.prev.tolist()
        reports = torch.stack(self.report).tolist()
        reported = self.reported.tolist()
        for i, o in enumerate(optimizers):
            o.set_client_state({"prev_step": _none_for_nan(prev[i])})
            if reported[i]:
                o.set_client_report(
                    {
                        "sps_last_step_size": reports[0][i],
                        "sps_last_loss": reports[1][i],
                        "sps_last_grad_sq": reports[2][i],
                    }
                )


class _BatchedDecSPS(BatchedRule):
    """:class:`fedlightning.optim.DecSPS` for every client at once:
    ``γ_t = min{(f − ℓ*)/‖g‖², c_{t−1} γ_{t−1}} / c_t``, ``c_t = c_0 √(t+1)``, with each client's own ``(t,
    γ_{t−1})``."""

    stops_on_nonfinite = True

    def zero_gradient_moves(self, used: bool) -> bool:
        return False  # w − η·0 = w, and a zero block adds nothing to ‖g‖²

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        hp = dict(optimizers[0].hyper)
        self.c0, self.f_star, self.grad_tol = hp["c0"], hp["f_star"], hp["grad_tol"]
        f64 = dict(dtype=torch.float64, device=device)
        states = [o.get_client_state() for o in optimizers]
        self.t = torch.tensor([float(st["t"]) for st in states], **f64)
        self.gamma_prev = torch.tensor([float(st["gamma_prev"]) for st in states], **f64)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        self.sqrt = rules.CountRoots(device)  # √t as DecSPS's math.sqrt computes it
        self.t_bound = max((st["t"] for st in states), default=0)  # no client's t exceeds it (no host sync)

    def step(self, W: Tensor, ev: _StepEvaluator, record: StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = self.loss_and_grad_sq(loss, g, ev)
        self.sqrt.cover(self.t_bound + 1)
        gamma, degenerate = rules.decsps_step(
            loss64 - self.f_star, grad_sq, self.t, self.gamma_prev, self.c0, self.grad_tol, self.sqrt
        )
        self.t_bound += 1
        step, moved, (t, gamma_prev) = rules.polyak_after_step(
            gamma, degenerate, self.scale, (self.t, self.gamma_prev), (self.t + 1, gamma)
        )
        moves = alive & finite & moved
        step = torch.where(moves, step, torch.zeros_like(step))
        self.move(W, g, step, moves, ev.views)
        self.t = torch.where(moves, t, self.t)
        self.gamma_prev = torch.where(moves, gamma_prev, self.gamma_prev)
        record.add(loss, torch.where(finite, step, torch.full_like(step, float("nan"))), alive)

    def finalize(self, optimizers) -> None:
        ts, gammas = self.t.tolist(), self.gamma_prev.tolist()
        for o, t, gp in zip(optimizers, ts, gammas):
            o.set_client_state({"t": int(t), "gamma_prev": gp})


def _holds_tensor(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value)


def _same_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor]) -> dict[str, Any]:
    """The hyper-parameters shared by every param group of every client optimizer (else unsupported).

    Parameters with ``requires_grad=False`` (a frozen layer passed along with ``self.parameters()``) get no gradient,
    so torch's optimizers never step them: they may be in the groups, and a group holding only such parameters does
    not count."""
    ids = {id(p) for p in params}
    first = None
    for opt in optimizers:
        covered = set()
        for group in opt.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            trained = [p for p in group["params"] if id(p) in ids or p.requires_grad]
            covered.update(id(p) for p in trained)
            if not trained:
                continue
            if first is None:
                first = hp
            elif hp != first:
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' needs the same {type(opt).__name__} settings for every "
                    f"parameter group and client; got {first} and {hp}"
                )
        if covered != ids:
            missing, extra = len(ids - covered), len(covered - ids)
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' needs the client optimizer to cover exactly the model's trainable "
                f"parameters; {missing} of them are not in {type(opt).__name__}'s groups"
                if missing
                else f"client_execution='vectorized' needs the client optimizer to cover exactly the model's trainable "
                f"parameters; {type(opt).__name__} also holds {extra} trainable tensor(s) that are not the model's"
            )
    return first or {}


#: The batched forms of fedlightning's own client optimizers (a ``batched_rule`` attribute of theirs would have to
#: import this module from :mod:`fedlightning.optim`, which sits below the engine). A class found here counts as
#: defining ``batched_rule``: its subclasses inherit the form unless they override ``step`` or name their own.
BUILT_IN_FORMS: dict[type, type] = {
    SgdArmijo: _BatchedArmijo,
    SPS: _BatchedSPS,
    DecSPS: _BatchedDecSPS,
    AMSGradClient: _BatchedAMSGradClient,
    AdaAlterClient: _BatchedAdaAlterClient,
    MimeLiteSGD: _BatchedMimeLiteSGD,
    MimeSGD: _BatchedMimeSGD,
}


def _batched_form(kind: type) -> type | None:
    """The :class:`BatchedRule` subclass ``kind`` names in ``batched_rule`` (a class, or a classmethod returning
    one) or inherits from a class of :data:`BUILT_IN_FORMS`, whichever comes first in its MRO; or None: none, or one
    from above the class that defines ``step`` (a subclass that overrides ``step`` does not run its parent's batched
    form)."""
    owner = next((k for k in kind.__mro__ if "batched_rule" in vars(k) or k in BUILT_IN_FORMS), None)
    if owner is None or not issubclass(owner, next(k for k in kind.__mro__ if "step" in vars(k))):
        return None
    if "batched_rule" not in vars(owner):
        return BUILT_IN_FORMS[owner]
    form = kind.batched_rule
    if not isinstance(form, type):
        form = form()
    if not (isinstance(form, type) and issubclass(form, BatchedRule)):
        raise TypeError(
            f"{kind.__name__}.batched_rule must be a subclass of fedlightning.vectorized.BatchedRule "
            f"(or a classmethod returning one), got {form!r}"
        )
    return form


def _check_plain_steps(kind: type, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise :class:`VectorizationUnsupportedError` for client optimizers whose sequential step does more than their
    batched rule computes: a step hook (the rule never calls ``optimizer.step()``, so the hook would not run), or,
    for ``torch.optim`` SGD / Adam / AdamW, per-parameter state present before the round (a ``momentum_buffer`` or
    ``exp_avg`` a ``configure_client_optimizer`` hook set from server-held state; their batched rules start every
    client from torch's empty state, as a new optimizer starts). Decision (ours): refused by name, so ``auto`` trains
    such clients sequentially, where the hook runs and the state is used."""
    hooks = sorted({h for o in optimizers for h in step_hooks(o)})
    if hooks:
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized' takes the clients' {kind.__name__} steps in one batched rule without "
            f"calling optimizer.step(), so {hooks[0]} on the client optimizer would not run; use "
            "client_execution='sequential' (or 'auto'), or fold the hook into the model or a callback"
        )
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return
    keys = sorted({k for o in optimizers for st in o.state.values() for k in st})
    if keys:
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized' starts every client's {kind.__name__} from empty state, but a client "
            f"optimizer holds state before the round ({', '.join(keys)}; e.g. set by configure_client_optimizer); "
            "use client_execution='sequential' (or 'auto'), which steps from that state"
        )


def make_batched_rule(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor], grad_clip: float | None, device: torch.device
) -> BatchedRule:
    """The batched form of the round's client optimizers (one instance per client, built by the loop).

    Supported: ``torch.optim.SGD`` (momentum, dampening, Nesterov, ``maximize``, ``weight_decay``),
    ``torch.optim.Adam`` and ``AdamW`` (AMSGrad, ``maximize``, ``weight_decay``), each with the loop's gradient
    clipping ``grad_clip``, and every optimizer class that names its batched form in ``batched_rule``
    (:class:`BatchedRule`): :class:`~fedlightning.optim.SgdArmijo`, :class:`~fedlightning.optim.SPS`,
    :class:`~fedlightning.optim.DecSPS`, :class:`~fedlightning.optim.AMSGradClient`,
    :class:`~fedlightning.optim.AdaAlterClient`, :class:`~fedlightning.optim.MimeSGD`,
    :class:`~fedlightning.optim.MimeLiteSGD` (through
    :data:`BUILT_IN_FORMS`), and user optimizers that opt in. Raises
    :class:`VectorizationUnsupportedError` for optimizers without a batched form (RMSprop, Adagrad, ...), for
    settings that differ between clients or parameter groups, and for a ``grad_clip`` the rule does not apply.
    """
    kinds = {type(o) for o in optimizers}
    if len(kinds) != 1:
        raise VectorizationUnsupportedError(
            f"the clients use different optimizer classes {sorted(k.__name__ for k in kinds)}"
        )
    kind = kinds.pop()
    _check_plain_steps(kind, optimizers)
    hp = _same_hyperparameters(optimizers, params)
    if kind is torch.optim.SGD:
        return _BatchedSGD(
            hp["lr"],
            hp.get("weight_decay", 0.0),
            grad_clip,
            len(optimizers),
            device,
            momentum=hp.get("momentum", 0.0),
            dampening=hp.get("dampening", 0.0),
            nesterov=hp.get("nesterov", False),
            maximize=hp.get("maximize", False),
        )
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        tensors = sorted(k for k, v in hp.items() if isinstance(v, Tensor) or (k == "betas" and _holds_tensor(v)))
        if tensors:  # torch's Adam then computes its step size in the tensor's dtype; the batched rule in Python floats
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' takes {kind.__name__}'s {', '.join(tensors)} as numbers, but got "
                f"tensor(s), with which torch computes the step in the tensor's dtype (a float32 lr rounds a float64 "
                "model's steps); pass floats, or use client_execution='sequential' (or 'auto')"
            )
        decoupled = kind is torch.optim.AdamW or bool(hp.get("decoupled_weight_decay", False))
        return _BatchedAdam(hp, decoupled, grad_clip, len(optimizers), device)
    form = _batched_form(kind)
    if form is None:
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized' does not support the client optimizer {kind.__name__}: it names no "
            "batched form (a batched_rule attribute, fedlightning.vectorized.BatchedRule); supported: "
            "torch.optim.SGD, Adam and AdamW, fedlightning.optim.SgdArmijo, SPS, DecSPS, AMSGradClient, "
            "AdaAlterClient, MimeSGD and MimeLiteSGD, and optimizers with a "
            "batched_rule"
        )
    if grad_clip is not None and not form.applies_grad_clip and not getattr(kind, "requires_closure", False):
        raise VectorizationUnsupportedError(
            f"the batched form {form.__name__} of {kind.__name__} does not apply the loop's client_grad_clip "
            "(BatchedRule.applies_grad_clip); use client_execution='sequential', or clip in the rule"
        )
    return form(optimizers, params, device, grad_clip)
