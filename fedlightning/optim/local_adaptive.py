r"""Client optimizers of the local adaptive methods whose statistics the server synchronises: :class:`AdaAlterClient`
(Local AdaAlter) and :class:`AMSGradClient` (Local AMSGrad).

* **Local AdaAlter** — Xie, Koyejo, Gupta & Lin, "Local AdaAlter: Communication-Efficient Stochastic Gradient Descent
  with Adaptive Learning Rates" (arXiv:1911.09030, 2019). AdaGrad whose denominator lags ("alternates"): the step
  uses the accumulator :math:`B^2` of the last synchronisation plus a placeholder :math:`k\varepsilon^2` for the
  :math:`k` squared gradients not yet in it, and the squared gradients are accumulated for the next
  synchronisation::

      y ← y − η · g / √(B² + k ε²)        (k = 1, 2, … the local step of the round)
      A² ← A² + g²                         (A² starts the round at B²)

* **Local AMSGrad** — Chen, Li & Li, "Toward Communication Efficient Adaptive Gradient Method" (FODS 2020). AMSGrad
  moments updated on the client, the max-stabilised second moment :math:`\hat v` shared and frozen between
  synchronisations::

      m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²,   y ← y − η · m / √max(v̂, ε)

The server halves (averaging :math:`A^2`, :math:`m`, :math:`v`, the max of :math:`\hat v`, the checkpointed state)
are :class:`fedlightning.callbacks.LocalAdaAlter` and :class:`~fedlightning.callbacks.LocalAMSGrad`, which set the
state with :meth:`set_server_state` (``configure_client_optimizer``) and read the client's statistics from
:meth:`client_report` (``update.payload``). Both optimizers take plain ``step()`` calls on ``.grad`` (the
FederatedLoop's ``client_grad_clip`` applies) and keep each param group's ``lr`` (so the round's ``client_lr_scale``
multiplies it). Their batched forms for ``client_execution="vectorized"`` live in :mod:`fedlightning.vectorized.rules`
(which maps these classes to them); they read and write a client's statistics through :meth:`client_statistics` and
:meth:`load_client_statistics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning._validation import in_range, positive

__all__ = ["AdaAlterClient", "AMSGradClient"]


class _ServerStateOptimizer(torch.optim.Optimizer):
    """Shared parts: per-parameter server state set by a strategy, a report of the client's statistics."""

    #: state entries the server sets (names of :meth:`set_server_state`'s keys), cloned when set unless frozen
    server_keys: tuple[str, ...] = ()
    frozen_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict[str, Any]):
        super().__init__(params, defaults)
        for group in self.param_groups:
            positive("lr", group["lr"], label="param group lr")
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.local_steps = 0  # steps taken since the server state was set

    def set_server_state(self, state: dict[str, Sequence[Tensor]]) -> None:
        """Set the server's statistics, one tensor per parameter in param-group order for each key of
        ``server_keys``; the client's own statistics restart from them (frozen keys are used as given, others
        copied) and the local step count restarts at 0."""
        missing = [k for k in self.server_keys if k not in state]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.set_server_state needs {list(self.server_keys)}, missing {missing}"
            )
        for key in self.server_keys:
            tensors = list(state[key])
            if len(tensors) != len(self._params):
                raise ValueError(f"server state {key!r} has {len(tensors)} tensors for {len(self._params)} parameters")
            for p, t in zip(self._params, tensors):
                if t.shape != p.shape:
                    raise ValueError(f"server state {key!r}: shape {tuple(t.shape)} for a parameter {tuple(p.shape)}")
                value = t.detach().to(device=p.device, dtype=p.dtype)
                self.state[p][key] = value if key in self.frozen_keys else value.clone()
        self.local_steps = 0

    def client_statistics(self) -> dict[str, list[Tensor]]:
        """The optimizer's statistics now, ``{key: [one tensor per parameter, in param-group order]}`` for every key
        of ``server_keys`` (zeros where never set; the tensors themselves, not copies). A batched form
        (:mod:`fedlightning.vectorized`) reads the round's start from it."""
        return {key: [self._state(p)[key] for p in self._params] for key in self.server_keys}

    def load_client_statistics(self, statistics: dict[str, Sequence[Tensor]], local_steps: int) -> None:
        """Put the optimizer in the state its own steps would have left: the statistics of ``statistics`` (keys of
        ``server_keys`` that are not frozen, one tensor per parameter in param-group order, copied) and
        ``local_steps`` steps since the server state was set. A batched form writes a client's round back with it,
        so that :meth:`client_report` answers as after sequential training."""
        frozen = [key for key in statistics if key in self.frozen_keys or key not in self.server_keys]
        if frozen:
            raise ValueError(f"{type(self).__name__}.load_client_statistics: {frozen} are not client statistics")
        if isinstance(local_steps, bool) or int(local_steps) != local_steps or local_steps < 0:
            raise ValueError(f"local_steps must be an integer >= 0, got {local_steps!r}")
        values = {key: list(tensors) for key, tensors in statistics.items()}
        for key, tensors in values.items():  # every check before anything is written
            if len(tensors) != len(self._params):
                raise ValueError(f"statistics {key!r} has {len(tensors)} tensors for {len(self._params)} parameters")
            for p, t in zip(self._params, tensors):
                if t.shape != p.shape:
                    raise ValueError(f"statistics {key!r}: shape {tuple(t.shape)} for a parameter {tuple(p.shape)}")
        for key, tensors in values.items():
            for p, t in zip(self._params, tensors):
                self._state(p)[key] = t.detach().to(device=p.device, dtype=p.dtype).clone()
        self.local_steps = int(local_steps)

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        st = self.state[p]
        for key in self.server_keys:
            if key not in st:
                st[key] = torch.zeros_like(p)
        return st

    def _report(self, keys: dict[str, str]) -> dict[str, list[Tensor]]:
        return {name: [self._state(p)[key] for p in self._params] for name, key in keys.items()}


class AdaAlterClient(_ServerStateOptimizer):
    r"""Local AdaAlter's client step: :math:`y \leftarrow y - \eta\, g/\sqrt{B^2 + k\varepsilon^2}`, :math:`A^2
    \leftarrow A^2 + g^2`.

    :math:`B^2` (``"accumulator"``, frozen) is the accumulator of the last synchronisation, set by
    :class:`fedlightning.callbacks.LocalAdaAlter` (zeros outside it); :math:`k` counts the steps since then
    (1 at the first step); :math:`k\varepsilon^2` stands in for the :math:`k` squared gradients the frozen
    :math:`B^2` lacks (Xie et al.'s placeholder; AdaAlter's :math:`\varepsilon^2` for one step). The client's
    increment :math:`\sum_k g_k^2` (``"increment"``) is what :meth:`client_report` sends
    (``adaalter_accumulator_increment``): the server's new :math:`B^2` is the average of the clients'
    :math:`A^2 = B^2 + \sum_k g_k^2`.

    Args:
        params: parameters or param groups (each group may set ``lr``).
        lr: :math:`\eta > 0`. Default 0.1 (ours: AdaGrad-type steps start near :math:`\eta g/(\sqrt{k}\varepsilon)`).
        eps: :math:`\varepsilon > 0` of the placeholder. Default 1.0 (ours: the placeholder stands for a squared
            gradient, so it is of the order of one; Xie et al. do not fix a value for our settings).
    """

    server_keys = ("accumulator", "increment")
    frozen_keys = ("accumulator",)

    def __init__(self, params, lr: float = 0.1, eps: float = 1.0):
        super().__init__(params, dict(lr=positive("lr", lr), eps=positive("eps", eps)))

    def set_server_state(self, state: dict[str, Sequence[Tensor]]) -> None:
        """Set ``{"accumulator": B²}`` (per parameter); the increment restarts at 0."""
        if "accumulator" not in state:
            raise ValueError("AdaAlterClient.set_server_state needs {'accumulator': [...]} (B², one per parameter)")
        zeros = [torch.zeros_like(p) for p in self._params]
        super().set_server_state({"accumulator": state["accumulator"], "increment": zeros})

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.local_steps += 1
        k = float(self.local_steps)
        for group in self.param_groups:
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self._state(p)
                denom = st["accumulator"].add(k * eps * eps).sqrt_()
                p.addcdiv_(g, denom, value=-lr)
                st["increment"].addcmul_(g, g)
        return loss

    def client_report(self) -> dict[str, list[Tensor]]:
        """``{"adaalter_accumulator_increment": [Σ_k g_k² per parameter]}`` since the server state was set."""
        return self._report({"adaalter_accumulator_increment": "increment"})


class AMSGradClient(_ServerStateOptimizer):
    r"""Local AMSGrad's client step with the shared second moment frozen:
    :math:`m \leftarrow \beta_1 m + (1-\beta_1)g`, :math:`v \leftarrow \beta_2 v + (1-\beta_2)g^2`,
    :math:`y \leftarrow y - \eta\, m/\sqrt{\max(\hat v, \varepsilon)}`.

    :math:`m` (``"exp_avg"``) and :math:`v` (``"exp_avg_sq"``) start the round from the server's averages and are
    updated every local step; :math:`\hat v` (``"max_exp_avg_sq"``) is the server's max-stabilised second moment,
    frozen during the round (the same preconditioner on every client between synchronisations). :math:`\varepsilon`
    floors :math:`\hat v` (FedAMS's max stabilisation, Wang et al. 2022). No bias correction (AMSGrad, Reddi et al.
    2018, has none). :meth:`client_report` sends the client's final :math:`m` and :math:`v`.

    Args:
        params: parameters or param groups (each group may set ``lr``).
        lr: :math:`\eta > 0`. Default 0.01 (ours: Adam-type steps are about :math:`\eta` per coordinate).
        betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``. Default (0.9, 0.99) (seed 001's FedAMS values).
        eps: :math:`\varepsilon > 0`. Default 1e-3 (seed 001, FedAMS's best max-stabilisation on MNIST).
    """

    server_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    frozen_keys = ("max_exp_avg_sq",)

    def __init__(self, params, lr: float = 0.01, betas: Sequence[float] = (0.9, 0.99), eps: float = 1e-3):
        try:
            b1, b2 = (float(b) for b in betas)
        except (TypeError, ValueError):
            raise ValueError(f"betas must be a pair of numbers, got {betas!r}") from None
        b1, b2 = in_range("betas[0]", b1, 0.0, 1.0), in_range("betas[1]", b2, 0.0, 1.0)
        super().__init__(params, dict(lr=positive("lr", lr), betas=(b1, b2), eps=positive("eps", eps)))

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.local_steps += 1
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self._state(p)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = st["max_exp_avg_sq"].clamp(min=eps).sqrt_()
                p.addcdiv_(m, denom, value=-lr)
        return loss

    def client_report(self) -> dict[str, list[Tensor]]:
        """``{"amsgrad_exp_avg": [m], "amsgrad_exp_avg_sq": [v]}``, per parameter, after the client's steps."""
        return self._report({"amsgrad_exp_avg": "exp_avg", "amsgrad_exp_avg_sq": "exp_avg_sq"})
