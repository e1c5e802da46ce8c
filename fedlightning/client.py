"""Local training of one client: ``K`` manual-optimisation steps from the global weights -> :class:`ClientUpdate`.

The client objective is the wrapped LightningModule's own ``training_step`` loss on the client's current
mini-batch, plus any extra terms that callbacks add (FedProx's ``μ/2‖w − w_t‖²``, SCAFFOLD's and FedDANE's linear
corrections). Two optimizer conventions are supported:

* plain ``torch.optim`` optimizers (SGD, Adam, ...): ``zero_grad(); loss = objective(); loss.backward(); step()``;
* the adaptive optimizers of :mod:`fedlightning.optim` (class attribute ``requires_closure = True``): the closure
  only returns the loss, the optimizer runs ``backward`` itself and re-evaluates the closure under ``no_grad`` at
  trial points (the convention of the reference Sls code).

Trial evaluations (any closure call made with gradients disabled) must not change the model: every buffer
(BatchNorm running statistics, ``num_batches_tracked``) is saved before and restored after such a call. The
optimizers themselves restore the RNG state so each trial sees the gradient evaluation's dropout masks.

**Skipped steps** (Lightning's rule for automatic optimisation, ``training_step`` returning ``None``: no backward,
no parameter update for that batch; ``batch_idx`` still advances). A local step whose ``training_step`` returns
``None`` is one of the client's ``K`` local steps (``ClientUpdate.num_steps`` counts it, the next step gets
``batch_idx = k + 1`` and the next batch, as Lightning's ``batch_idx`` and ``global_step`` advance), but it has no
loss: no objective terms, no ``backward``, no ``optimizer.step()`` (a ``torch.optim`` optimizer stepped without
gradients, as Lightning does, changes neither the parameters nor its state, so skipping the call is the same), no
loss in ``first_loss`` / ``mean_loss`` and no step size. ``on_before_optimizer_step`` and
``on_train_batch_end(outputs={}, ...)`` still run, as in Lightning. A closure-based optimizer (``requires_closure``:
SgdArmijo, SPS, DecSPS) sees it as a skip too: its first closure call (the gradient evaluation) ends the step before
the optimizer has changed anything (:class:`_StepSkipped`), so its step counters and step size are untouched.
``None`` at a line search's *trial* point (the same batch, other weights) is an error: the batch was not skipped.
A client whose every step was skipped is healthy: its update is exactly 0 (its weights are the global ones, which
is what FedAvg's model average reads from it, ours) and its losses are NaN, which the round's ``train/loss`` leaves
out (it averages the clients that had a loss). Nothing of this counts as a failure.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from fedlightning._reference import reference_mode
from fedlightning.state import ClientUpdate, buffer_report_dtype, derive_seed, flat_params

__all__ = ["extract_loss", "LocalTrainer"]


class _StepSkipped(Exception):
    """Raised by the client objective's closure when ``training_step`` returned ``None`` at a gradient evaluation:
    ends a closure-based optimizer's step before it changed anything (caught around ``optimizer.step``)."""

ObjectiveTerm = Callable[[Sequence[Tensor]], Tensor]


def extract_loss(output: Any, model_name: str = "model") -> Tensor:
    """The loss from a ``training_step`` output: a scalar tensor, or a dict with key ``"loss"``."""
    if output is None:
        raise TypeError(
            f"{model_name}.training_step returned None here; None skips a local step (Lightning's rule) only where the "
            "step's loss is taken at the client's weights, not at a line search's trial point on the same batch"
        )
    if isinstance(output, Tensor):
        if output.dim() == 0:  # the common case: no reshape (a view would add an autograd node to every step)
            return output
        loss = output
    elif isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        loss = output["loss"]
    else:
        raise TypeError(
            f"{model_name}.training_step must return the loss (a scalar tensor or a dict with key 'loss') for "
            f"federated training, but returned {type(output).__name__}"
            + (f" with keys {sorted(output)}" if isinstance(output, dict) else "")
        )
    if loss.numel() != 1:
        raise TypeError(f"{model_name}.training_step returned a loss with shape {tuple(loss.shape)}, expected a scalar")
    return loss.reshape(())


def _cycle(loader: Iterable, steps: int) -> Iterator[Any]:
    """Exactly ``steps`` batches from ``loader``, starting a new pass (a new shuffled epoch) whenever it runs out.

    Loaders that know how to do this themselves (``iter_steps``, e.g. the in-memory
    :class:`~fedlightning.datamodules.base.ArrayBatchLoader`) are asked to, except in reference mode; they must give
    the same batches."""
    iter_steps = getattr(loader, "iter_steps", None)
    if iter_steps is not None and not reference_mode():
        yield from iter_steps(steps)
        return
    yield from reiterate(loader, steps)


def reiterate(loader: Iterable, steps: int) -> Iterator[Any]:
    """Exactly ``steps`` batches of ``loader``, calling ``iter(loader)`` again whenever it runs out."""
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:  # cycle: a new shuffled epoch over the client's data
            it = iter(loader)
            try:
                batch = next(it)
            except StopIteration:
                raise RuntimeError("the client's data loader yielded no batch (a client without samples?)") from None
        yield batch


def _plain_sgd_lrs(optimizer: torch.optim.Optimizer) -> Optional[List[float]]:
    """The groups' learning rates when ``optimizer.step()`` is exactly ``p -= lr * p.grad`` for every parameter with a
    gradient (a ``torch.optim.SGD`` without momentum, weight decay, Nesterov, ``maximize`` or step hooks), else None.

    Such a step is then taken with one ``torch._foreach_add_`` per group (:func:`_plain_sgd_step`), the same
    per-tensor ``add_(grad, alpha=-lr)`` that SGD's own loop runs, without its per-call wrappers (~40 µs of a
    ~200 µs step of a 10k-parameter model on a CPU core)."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return None
    from torch.optim import optimizer as _opt_module

    if getattr(_opt_module, "_global_optimizer_pre_hooks", None) or getattr(_opt_module, "_global_optimizer_post_hooks", None):
        return None
    lrs = []
    for g in optimizer.param_groups:
        if (g.get("momentum", 0) != 0 or g.get("weight_decay", 0) != 0 or g.get("nesterov") or g.get("maximize")
                or g.get("differentiable") or g.get("fused") or isinstance(g.get("lr"), Tensor)):
            return None
        lrs.append(float(g["lr"]))
    return lrs


@torch.no_grad()
def _plain_sgd_step(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    for g, lr in zip(optimizer.param_groups, lrs):
        params = [p for p in g["params"] if p.grad is not None]
        if params:
            torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)


def _step_outputs(output: Any, loss: Tensor) -> Dict[str, Any]:
    """``on_train_batch_end``'s ``outputs``, as Lightning builds them: ``{"loss": <detached loss>, **extras}``."""
    extras = {}
    if isinstance(output, dict):
        extras = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in output.items() if k != "loss"}
    return {"loss": loss, **extras}


class LocalTrainer:
    """Runs the local steps of one client on a working copy of the model.

    Args:
        model: the working copy (a LightningModule); its parameters are overwritten with the global weights.
        to_device: moves a batch to the model's device (identity on CPU).
        grad_clip: optional max-norm clipping of the client gradient (plain optimizers only: clipping would change
            the search direction of a line search, so adaptive optimizers ignore it).
        hooks: the per-local-step hooks the model's class overrides
            (:class:`~fedlightning.user_module.ClientHooks`); None when it overrides none (the lean path).
        metrics: the model's torchmetrics states, saved and restored around trial evaluations
            (:class:`~fedlightning.user_module.MetricStates`).
        convert_input: the Trainer's precision plugin's ``convert_input`` (``"64-true"``: floating tensors to
            float64; ``"16-true"`` / ``"bf16-true"``: to half / bfloat16), applied to every client batch before the
            batch-transfer hooks, where Lightning's training loop applies it; None when the plugin leaves batches
            as they are (32-bit and mixed precision: autocast is the Trainer's around the whole round).
    """

    def __init__(self, model: nn.Module, to_device: Callable[[Any], Any] = lambda b: b, grad_clip: Optional[float] = None,
                 hooks: Any = None, metrics: Any = None, convert_input: Optional[Callable[[Any], Any]] = None):
        self.model = model
        self.to_device = to_device
        self.convert_input = convert_input
        self.grad_clip = grad_clip
        self.hooks = hooks
        self.metrics = metrics if metrics else None
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        self.buffers: List[Tensor] = list(model.buffers())
        self.model_name = type(model).__name__

    # ------------------------------------------------------------------
    def _objective(self, batch: Any, step: int, terms: Sequence[ObjectiveTerm]) -> Callable[[], Tensor]:
        model, params, buffers, metrics = self.model, self.params, self.buffers, self.metrics
        hooks = self.hooks if (self.hooks is not None and self.hooks.batch_end) else None

        def closure() -> Tensor:
            trial = not torch.is_grad_enabled()
            saved = [b.clone() for b in buffers] if (trial and buffers) else None
            saved_metrics = metrics.save() if (trial and metrics is not None) else None
            output = model.training_step(batch, step)
            if output is None and not trial:  # Lightning's skipped step (module docstring): nothing to restore
                raise _StepSkipped
            loss = extract_loss(output, self.model_name)
            if hooks is not None and not trial:
                closure.output = output  # for on_train_batch_end
            for term in terms:
                loss = loss + term(params)
            if saved is not None:
                with torch.no_grad():
                    for b, s in zip(buffers, saved):
                        b.copy_(s)
            if saved_metrics is not None:
                metrics.restore(saved_metrics)
            return loss

        closure.output = None

        return closure

    def run(
        self,
        client_id: int,
        round: int,
        seed: int,
        global_params: Sequence[Tensor],
        global_buffers: Sequence[Tensor],
        global_flat: Tensor,
        loader: Iterable,
        optimizer: torch.optim.Optimizer,
        local_steps: int,
        num_samples: int,
        terms: Sequence[ObjectiveTerm] = (),
        float_buffer_mask: Optional[Sequence[bool]] = None,
    ) -> ClientUpdate:
        """Train client ``client_id`` for ``local_steps`` steps from the global weights; return its update.

        Dropout and any other ``torch`` randomness inside the model is seeded by ``(seed, "model", round,
        client_id)`` in a forked RNG, so it does not depend on the other clients of the round and leaves the
        global RNG untouched.
        """
        with torch.no_grad():
            torch._foreach_copy_(self.params, list(global_params))
            if self.buffers:
                torch._foreach_copy_(self.buffers, list(global_buffers))
        adaptive = getattr(optimizer, "requires_closure", False)
        losses: List[Tensor] = []
        step_sizes: List[float] = []
        backtracks = forwards = backwards = steps_run = 0
        devices = [self.params[0].device] if self.params and self.params[0].device.type == "cuda" else []
        # Per-step path kept lean for small models: without extra objective terms the loss is the model's own
        # training_step (no closure object per step); gradients are cleared by dropping them (what
        # ``zero_grad(set_to_none=True)`` does, without its per-call profiling wrapper) unless the optimizer
        # overrides ``zero_grad``; a plain SGD step is one ``_foreach_add_`` per group (``_plain_sgd_lrs``).
        # Same arithmetic as the closure and ``optimizer.step()`` (tests/test_lean_path.py); reference mode
        # (fedlightning._reference) takes the general path.
        lean = not reference_mode()
        plain_zero = lean and type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad
        opt_params = [p for g in optimizer.param_groups for p in g["params"]] if plain_zero else []
        sgd_lrs = None if (adaptive or not lean) else _plain_sgd_lrs(optimizer)
        model, model_name, to_device = self.model, self.model_name, self.to_device
        on_cpu = not devices
        convert = self.convert_input
        h = self.hooks  # None unless the model's class overrides a per-step hook (user_module.ClientHooks)
        with torch.random.fork_rng(devices=devices):
            model_seed = derive_seed(seed, "model", round, client_id)
            # not torch.manual_seed: that also queues a lazy CUDA seeding (with a stack trace) on every call
            torch.default_generator.manual_seed(model_seed)
            for dev in devices:
                torch.cuda.default_generators[dev.index if dev.index is not None else 0].manual_seed(model_seed)
            for k, batch in enumerate(_cycle(loader, local_steps)):
                if convert is not None:  # Lightning: precision conversion, then on_train_batch_start and transfer
                    batch = convert(batch)
                if h is not None and h.batch_start and model.on_train_batch_start(batch, k) == -1:
                    break  # Lightning's "skip the rest of the epoch": this client's local steps end here
                if h is not None and h.transfer:
                    batch = h.transfer_batch(model, batch)
                elif not on_cpu:
                    batch = to_device(batch)
                if h is not None and h.zero_grad:
                    model.on_before_zero_grad(optimizer)
                if plain_zero:
                    for p in opt_params:
                        p.grad = None
                else:
                    optimizer.zero_grad(set_to_none=True)
                steps_run += 1
                if adaptive:
                    closure = self._objective(batch, k, terms)
                    try:
                        loss = optimizer.step(closure)
                    except _StepSkipped:  # training_step returned None: the optimizer changed nothing
                        loss = None
                        forwards += 1
                    else:
                        output = closure.output
                        info = getattr(optimizer, "last_step", None) or {}
                        step_sizes.append(float(info.get("step_size", float("nan"))))
                        backtracks += int(info.get("backtracks", 0))
                        forwards += int(info.get("forwards", 1))
                        backwards += int(info.get("backwards", 1))
                else:
                    if terms or not lean:
                        closure = self._objective(batch, k, terms)
                        try:
                            loss = closure()
                            output = closure.output
                        except _StepSkipped:
                            loss = None
                    else:
                        output = model.training_step(batch, k)
                        loss = None if output is None else extract_loss(output, model_name)
                    forwards += 1
                    if loss is not None:
                        if h is not None and h.before_backward:
                            model.on_before_backward(loss)
                        loss.backward()
                        if h is not None and h.after_backward:
                            model.on_after_backward()
                    if h is not None and h.before_step:
                        model.on_before_optimizer_step(optimizer)
                    if loss is not None:
                        if self.grad_clip is not None:
                            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
                        if sgd_lrs is not None:
                            _plain_sgd_step(optimizer, sgd_lrs)
                        else:
                            optimizer.step()
                        step_sizes.append(float(optimizer.param_groups[0].get("lr", float("nan"))))
                        backwards += 1
                if loss is None:  # a skipped step: Lightning's on_train_batch_end outputs are {}
                    if h is not None and h.batch_end:
                        model.on_train_batch_end({}, batch, k)
                    continue
                losses.append(loss.detach())  # a scalar already (extract_loss); cast once after the loop
                if h is not None and h.batch_end:
                    model.on_train_batch_end(_step_outputs(output, losses[-1]), batch, k)
                if adaptive and not math.isfinite(float(losses[-1])):
                    break  # adaptive optimizers refuse non-finite losses; stop early, the update is discarded
        delta = global_flat - flat_params(self.params).to(global_flat.dtype)
        if losses:
            loss_vec = torch.stack(losses).float()
            # one host transfer for the four per-client scalars (one sync on an accelerator instead of four)
            first, mean, loss_ok, delta_ok = torch.stack([
                loss_vec[0], loss_vec.mean(), torch.isfinite(loss_vec).all().float(),
                torch.isfinite(delta).all().float(),
            ]).tolist()
        else:  # every step skipped (healthy, update 0), or none run (on_train_batch_start -1 at k = 0: failed)
            first = mean = float("nan")
            loss_ok, delta_ok = float(steps_run > 0), float(bool(torch.isfinite(delta).all()))
        update = ClientUpdate(
            client_id=client_id,
            delta=delta,
            num_samples=num_samples,
            num_steps=steps_run,
            first_loss=first,
            mean_loss=mean,
            step_sizes=step_sizes,
            backtracks=backtracks,
            forwards=forwards,
            backwards=backwards,
        )
        if float_buffer_mask is not None and any(float_buffer_mask):
            kept = [b for b, m in zip(self.buffers, float_buffer_mask) if m]
            dtype = buffer_report_dtype(kept)
            update.buffers = torch.cat([b.detach().reshape(-1).to(dtype) for b in kept])
        if not loss_ok:
            update.failed, update.failure = True, "non-finite training loss"
        elif not delta_ok:
            update.failed, update.failure = True, "non-finite model update"
        return update
