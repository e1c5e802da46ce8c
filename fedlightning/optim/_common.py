"""Shared machinery of the closure-driven client optimizers (:class:`SgdArmijo`, :class:`SPS`, :class:`DecSPS`).

The closure convention (as the reference Sls code, Vaswani et al. 2019): the closure only computes and returns the
mini-batch loss (a scalar tensor); the optimizer calls it once with gradients enabled and runs ``backward`` itself,
and evaluates trial points by calling it again under ``torch.no_grad()``. The user calls ``zero_grad()`` before
``step``. All step-size rules use the squared norm of the gradient over *all* trainable parameters of *all* param
groups jointly (one global ``‖g‖²``, seed 000 §SGD-Armijo, seed 001 Eq. 2).

Numerical policy shared by the three optimizers (ours; see each optimizer's docstring for what it means there):

* non-finite loss or gradient: the parameters are left unchanged, ``last_step["step_size"]`` is ``nan``, the
  per-client state is not advanced, and the (non-finite or finite) loss is returned. A non-finite loss is what the
  FederatedLoop's failure policy detects (the client is skipped); a finite loss with a non-finite gradient is a
  skipped step, like the inf/NaN-gradient steps ``torch.amp.GradScaler`` skips.
* ``‖g‖ < grad_tol``: no parameter change, recorded step size ``0.0`` (the reference Sls/SPS threshold 1e-8).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import integer, non_negative, positive
from fedlightning.optim import rules

__all__ = [
    "ClosureOptimizer",
    "RngSnapshot",
    "epoch_exponent",
    "scale_client_step",
    "check_client_step_scalable",
    "step_hooks",
]


def epoch_exponent(n_batches_per_epoch: float | None, batch_size: int | None, num_samples: int | None) -> float | None:
    """Validate the epoch-length arguments and return the per-step exponent ``1/n_batches_per_epoch`` (None when
    not given), so that a growth factor ``δ`` per local epoch is ``δ**exponent`` per step.

    Either ``n_batches_per_epoch`` (steps per epoch, ``>= 1``, may be fractional like the reference Sls code's
    ``len(data)/b``) or both ``batch_size`` (``b``) and ``num_samples`` (``n``) may be given, not both forms.
    From ``b`` and ``n`` the steps per epoch are ``⌈n/b⌉``: the mini-batches one shuffled epoch of the client's
    loader yields (the last partial batch is kept), so the growth over one epoch is exactly ``δ``. This is the
    reference Sls intent ("over one epoch the growth is δ"; it passes ``n/b``, which agrees whenever ``b`` divides
    ``n``). The reference's ``b/n`` would grow by ``δ^{b/n} > δ`` per step when ``n < b`` (a client of 13 samples
    with batch 50: ×14.4 per step for ``δ = 2``), while such a client's every step is a whole epoch; ``⌈n/b⌉``
    gives ``δ`` per step there (ours).
    """
    if n_batches_per_epoch is not None and (batch_size is not None or num_samples is not None):
        raise ValueError(
            "give either n_batches_per_epoch or batch_size and num_samples, not both "
            f"(got n_batches_per_epoch={n_batches_per_epoch!r}, batch_size={batch_size!r}, num_samples={num_samples!r})"
        )
    if n_batches_per_epoch is not None:
        steps = positive("n_batches_per_epoch", n_batches_per_epoch)
        if steps < 1:
            raise ValueError(
                f"n_batches_per_epoch must be >= 1 (an epoch takes at least one step), got {n_batches_per_epoch!r}; "
                "with fewer samples than the batch size every step is a whole epoch: pass 1"
            )
        return 1.0 / steps
    if (batch_size is None) != (num_samples is None):
        raise ValueError(
            f"batch_size and num_samples must be given together, got batch_size={batch_size!r}, "
            f"num_samples={num_samples!r}"
        )
    if batch_size is None:
        return None
    batch_size, num_samples = integer("batch_size", batch_size), integer("num_samples", num_samples)
    return 1.0 / float(-(-num_samples // batch_size))


def step_hooks(optimizer: torch.optim.Optimizer) -> list[str]:
    """What runs around ``optimizer.step()`` besides the optimizer's own step: ``"a step pre-hook"`` /
    ``"a step post-hook"`` of this optimizer (``register_step_pre_hook`` / ``register_step_post_hook``) and the global
    hooks of every optimizer (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``), one entry
    each; empty when nothing does. A step taken other than through ``optimizer.step()`` (a fused fast path, a batched
    rule) would skip them."""
    from torch.optim import optimizer as opt_module

    found = []
    if getattr(optimizer, "_optimizer_step_pre_hooks", None):
        found.append("a step pre-hook (register_step_pre_hook)")
    if getattr(optimizer, "_optimizer_step_post_hooks", None):
        found.append("a step post-hook (register_step_post_hook)")
    if getattr(opt_module, "_global_optimizer_pre_hooks", None):
        found.append("a global step pre-hook (register_optimizer_step_pre_hook)")
    if getattr(opt_module, "_global_optimizer_post_hooks", None):
        found.append("a global step post-hook (register_optimizer_step_post_hook)")
    return found


def check_client_step_scalable(optimizer: torch.optim.Optimizer) -> None:
    """Raise a ValueError naming the optimizer unless :func:`scale_client_step` can scale its step size: it defines
    ``scale_step(scale)`` (the optimizers of :mod:`fedlightning.optim`) or every param group has an ``lr``."""
    if callable(getattr(optimizer, "scale_step", None)):
        return
    groups = getattr(optimizer, "param_groups", None) or []
    if groups and all("lr" in g for g in groups):
        return
    raise ValueError(
        f"the client optimizer {type(optimizer).__name__} has no step size the client learning-rate scale "
        "(client_lr_scale: KDecay(decay='client_lr'), FedSPSGlobal) can act on: it defines no scale_step(scale) "
        "method and not every param group has an 'lr'. Use KDecay(decay='local_steps'), or give the optimizer a "
        "scale_step(scale) method"
    )


def scale_client_step(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Multiply the step size of a client optimizer by ``scale`` (the round's ``client_lr_scale``).

    * optimizers with a ``scale_step(scale)`` method (:class:`~fedlightning.optim.SgdArmijo`,
      :class:`~fedlightning.optim.SPS`, :class:`~fedlightning.optim.DecSPS`; each docstring says what it scales
      and why) get that call;
    * otherwise every param group's ``lr`` is multiplied (``torch.optim`` optimizers);
    * otherwise a ValueError names the optimizer (:func:`check_client_step_scalable`): a scale is never silently
      dropped.

    ``scale`` must be a finite number >= 0 (0: the clients do not move, as SGD with ``lr = 0``).
    """
    scale = non_negative("client_lr_scale", scale)
    check_client_step_scalable(optimizer)
    method = getattr(optimizer, "scale_step", None)
    if callable(method):
        method(scale)
        return
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale


class ClosureOptimizer(torch.optim.Optimizer):
    """Base class: closure checks, the global squared gradient norm, RNG forking for trial points, telemetry.

    Telemetry: after every ``step``, ``last_step = {"step_size", "backtracks", "forwards", "backwards"}`` (the
    accepted step size, rejected trial points, closure calls and backward passes of that step) and running totals
    ``total_steps``, ``total_backtracks``, ``total_forwards``, ``total_backwards``.
    """

    #: The FederatedLoop's LocalTrainer passes a loss-only closure to ``step`` for optimizers that set this.
    requires_closure = True
    #: ``(hyper-parameter, setting)`` of a growth factor per local epoch (:meth:`per_step_growth`), or None.
    growth_setting: tuple[str, str] | None = None

    def __init__(self, params, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        for group in self.param_groups:
            for key, value in defaults.items():
                if group.get(key) != value:
                    raise ValueError(
                        f"{type(self).__name__} uses one step size for all parameters (global gradient norm), so param "
                        f"groups cannot override {key!r} (constructor value {value!r}, group value {group.get(key)!r})"
                    )
        self.last_step: dict[str, Any] = {}
        self.total_steps = 0
        self.total_backtracks = 0
        self.total_forwards = 0
        self.total_backwards = 0
        # 1/steps-per-epoch for per-epoch growth factors; set by the constructor or by the FederatedLoop.
        self._explicit_exponent: float | None = None
        self._client_exponent: float | None = None
        #: multiplier of every step this optimizer applies (the round's client_lr_scale; see scale_step)
        self.step_scale = 1.0

    # ------------------------------------------------------------------ hyperparameters
    @property
    def hyper(self) -> dict[str, Any]:
        """The hyperparameters (shared by all param groups, checked at construction)."""
        return self.param_groups[0]

    def scale_step(self, scale: float) -> None:
        """Multiply every step this optimizer applies by ``scale`` (>= 0; calls compose by multiplication).

        The step-size rule itself and its per-client state are left in the rule's own units: the rule computes
        its step as without a scale, the update applies ``scale`` times it, and telemetry (``last_step``) records
        the applied step. So a scale acts once per step and never compounds through state that feeds the next
        step (Armijo's ``η_{k-1}``, SPS's smoothed cap, DecSPS's ``γ_{t-1}``). Each optimizer's docstring gives the
        reasoning for its rule. The FederatedLoop calls it through :func:`scale_client_step` with the round's
        ``client_lr_scale`` on a freshly built optimizer.
        """
        self.step_scale = self.step_scale * non_negative("scale", scale)

    def set_client_data(self, num_samples: int, batch_size: int) -> None:
        """Called by the FederatedLoop with the client's number of samples ``n_i`` and batch size ``b`` before it
        trains, so per-epoch growth factors use that client's ``⌈n_i/b⌉`` steps per epoch (:func:`epoch_exponent`).
        An explicit ``n_batches_per_epoch`` (or ``batch_size`` + ``num_samples``) given to the constructor takes
        precedence."""
        self._client_exponent = epoch_exponent(None, int(batch_size), int(num_samples))

    def per_step_growth(self) -> float:
        """:math:`\\delta^{1/\\lceil n/b\\rceil}`: the rule's growth factor per local epoch (the hyper-parameter
        named by ``growth_setting``) as a per-step factor; a ValueError when the epoch length is unknown."""
        factor, what = self.growth_setting
        return rules.per_step_growth(self.hyper[factor], self._epoch_exponent(what))

    def _epoch_exponent(self, what: str) -> float:
        """``1/steps-per-epoch`` (:func:`epoch_exponent`) of this client; a ValueError naming ``what`` if unknown."""
        exponent = self._explicit_exponent if self._explicit_exponent is not None else self._client_exponent
        if exponent is None:
            raise ValueError(
                f"{type(self).__name__}: {what} needs the epoch length (steps per epoch): pass n_batches_per_epoch (or "
                "batch_size and num_samples) to the constructor, or run inside a FederatedLoop, which sets it per "
                "client"
            )
        return exponent

    # ------------------------------------------------------------------ parameters and gradients
    def _params_with_grad(self) -> tuple[list[Tensor], list[Tensor]]:
        params, grads = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    params.append(p)
                    grads.append(p.grad)
        return params, grads

    @staticmethod
    def _loss_and_squared_norm(loss: Tensor, grads: list[Tensor]) -> tuple[float, float]:
        """``(f, Σ_tensors Σ g²)`` as Python floats from one fused norm kernel (per device/dtype group). On an
        accelerator the per-tensor norms and the loss are stacked and read with a single host synchronisation; on the
        CPU (no synchronisation cost) reading each 0-d result directly avoids the extra stacking op, which is what
        dominates for small models. The norms are squared and summed in float64 on the host."""
        norms = torch._foreach_norm(grads)
        if loss.device.type == "cpu" and norms[0].device.type == "cpu":
            host = [n.item() for n in norms]
            return loss.item(), math.fsum(v * v for v in host)
        try:  # stack promotes dtypes; it fails only for tensors on different devices
            host = torch.stack([*norms, loss]).tolist()
        except RuntimeError:
            host = [float(v) for v in norms] + [float(loss)]
        return host[-1], math.fsum(v * v for v in host[:-1])

    def _loss_and_grad(self, closure: Callable[[], Tensor] | None) -> Tensor:
        """First closure call (with gradients) and ``backward``; returns the detached scalar loss."""
        if closure is None or not callable(closure):
            raise TypeError(
                f"{type(self).__name__}.step needs a closure that re-evaluates the loss on the same mini-batch "
                "(it must only compute and return the loss: the optimizer calls backward itself)"
            )
        with torch.enable_grad():
            loss = closure()
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(
                    f"the closure must return the loss as a scalar tensor, got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
                )
            if not loss.requires_grad:
                raise RuntimeError(
                    "the closure's loss does not require grad: it must be computed from the parameters with "
                    "gradients enabled (and must not call backward or detach)"
                )
            loss.backward()
        loss = loss.detach()
        return loss if loss.dim() == 0 else loss.reshape(())

    def _polyak_inputs(self, closure: Callable[[], Tensor] | None):
        """The inputs of a Polyak-type step: ``(loss, params, grads, f - f*, ||g||^2)``.

        ``params`` is None when no step can be taken, and the step is already recorded: no parameter has a gradient
        (step size 0), or the loss or the gradient is not finite (step size NaN; the optimizer does not move).
        """
        loss = self._loss_and_grad(closure)
        params, grads = self._params_with_grad()
        if not params:
            self._record(0.0)
            return loss, None, None, 0.0, 0.0
        loss_value, grad_sq = self._loss_and_squared_norm(loss, grads)
        if not rules.finite_step(loss_value, grad_sq):
            self._record(float("nan"))
            return loss, None, None, 0.0, 0.0
        return loss, params, grads, loss_value - self.hyper["f_star"], grad_sq

    # ------------------------------------------------------------------ telemetry
    def _record(self, step_size: float, backtracks: int = 0, forwards: int = 1, backwards: int = 1, **extra) -> None:
        self.last_step = {
            "step_size": float(step_size),
            "backtracks": int(backtracks),
            "forwards": int(forwards),
            "backwards": int(backwards),
            **extra,
        }
        self.total_steps += 1
        self.total_backtracks += int(backtracks)
        self.total_forwards += int(forwards)
        self.total_backwards += int(backwards)

    # ------------------------------------------------------------------ persistence (subclasses define the fields)
    def get_client_state(self) -> dict[str, Any]:
        return {}

    def set_client_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"client state must be a dict, got {type(state).__name__}")

    @staticmethod
    def _state_step(state: dict[str, Any], key: str, default: float | None = None) -> float | None:
        """``state[key]`` as a finite step size > 0 (``default`` when absent; None stays None)."""
        value = state.get(key, default)
        if value is None:
            return None
        return positive(key, float(value), label=f"client state {key}")

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the per-client state, so a plain PyTorch checkpoint resumes the rule."""
        sd = super().state_dict()
        sd["client_state"] = self.get_client_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        client_state = state_dict.pop("client_state", None)
        super().load_state_dict(state_dict)
        if client_state:
            self.set_client_state(client_state)


class RngSnapshot:
    """The CPU RNG state and the CUDA RNG state of ``device`` (when it is a CUDA device), to replay randomness.

    Trial evaluations of a line search restore the snapshot taken before the gradient evaluation, so dropout draws
    the same masks in every evaluation of one step (the reference Sls reseeds from wall-clock time instead, which
    shares masks across steps that start in the same second; we never reseed).
    """

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device | None):
        self.cpu = torch.get_rng_state()
        self.device = device if (device is not None and device.type == "cuda") else None
        self.cuda = torch.cuda.get_rng_state(self.device) if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
