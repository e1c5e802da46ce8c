"""Local training of one client: ``K`` manual-optimisation steps from the global weights -> :class:`ClientUpdate`.

The client objective is the wrapped LightningModule's own ``training_step`` loss on the client's current
mini-batch, plus any extra terms that callbacks add (FedProx's ``μ/2‖w − w_t‖²``, SCAFFOLD's and FedDANE's linear
corrections). Two optimizer conventions are supported:

* plain ``torch.optim`` optimizers (SGD, Adam, ...): ``zero_grad(); loss = objective(); loss.backward(); step()``;
* the adaptive optimizers of :mod:`fedlightning.optim` (class attribute ``requires_closure = True``): the closure
  only returns the loss, the optimizer runs ``backward`` itself and re-evaluates the closure under ``no_grad`` at
  trial points (the convention of the reference Sls code).

:meth:`LocalTrainer.run` resolves once per client how its steps are taken (:class:`_StepPlan`) and runs one of two
step loops with one signature: :func:`_lean_steps` (no objective terms, per-step hooks or closure-based optimizer:
``training_step``'s loss straight) or :func:`_general_steps` (the client objective's closure, the model's per-step
hooks, closure-based optimizers, reference mode). Both compute the same arithmetic.

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
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning._logging_route import discard, routed_logging
from fedlightning._reference import reference_mode
from fedlightning.datamodules.base import reiterate
from fedlightning.objectives import term_value
from fedlightning.optim import step_hooks
from fedlightning.state import ClientUpdate, derive_seed, flat_params, loss_report_dtype, report_buffers

__all__ = ["BufferSlots", "extract_loss", "LocalTrainer"]


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
    # a scalar is returned as it is (a dict's loss too): the vectorised engine recognises the tensor a standard loss
    # returned (loss interception), not a reshape of it
    return loss if loss.dim() == 0 else loss.reshape(())


def _cycle(loader: Iterable, steps: int, reference: bool | None = None) -> Iterator[Any]:
    """Exactly ``steps`` batches from ``loader``, starting a new pass (a new shuffled epoch) whenever it runs out.

    Loaders that know how to do this themselves (``iter_steps``, e.g. the in-memory
    :class:`~fedlightning.datamodules.base.ArrayBatchLoader`) are asked to, except in reference mode (``reference``;
    None: :func:`~fedlightning._reference.reference_mode`); they must give the same batches."""
    iter_steps = getattr(loader, "iter_steps", None)
    if reference is None:
        reference = reference_mode()
    if iter_steps is not None and not reference:
        yield from iter_steps(steps)
        return
    yield from reiterate(loader, steps)


def _plain_sgd_lrs(optimizer: torch.optim.Optimizer) -> list[float] | None:
    """The groups' learning rates when ``optimizer.step()`` is exactly ``p -= lr * p.grad`` for every parameter with a
    gradient (a ``torch.optim.SGD`` without momentum, weight decay, Nesterov, ``maximize`` or step hooks), else None.

    Such a step is then taken with one ``torch._foreach_add_`` per group (:func:`_plain_sgd_step`), the same
    per-tensor ``add_(grad, alpha=-lr)`` that SGD's own loop runs, without its per-call wrappers (~40 µs of a
    ~200 µs step of a 10k-parameter model on a CPU core)."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    if step_hooks(optimizer):
        return None
    lrs = []
    for g in optimizer.param_groups:
        if (
            g.get("momentum", 0) != 0
            or g.get("weight_decay", 0) != 0
            or g.get("nesterov")
            or g.get("maximize")
            or g.get("differentiable")
            or g.get("fused")
            or isinstance(g.get("lr"), Tensor)
        ):
            return None
        lrs.append(float(g["lr"]))
    return lrs


@torch.no_grad()
def _plain_sgd_step(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    for g, lr in zip(optimizer.param_groups, lrs):
        params = [p for p in g["params"] if p.grad is not None]
        if params:
            torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)


def _step_outputs(output: Any, loss: Tensor) -> dict[str, Any]:
    """``on_train_batch_end``'s ``outputs``, as Lightning builds them: ``{"loss": <detached loss>, **extras}``."""
    extras = {}
    if isinstance(output, dict):
        extras = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in output.items() if k != "loss"}
    return {"loss": loss, **extras}


class _NoHooks:
    """The per-step hook flags of a model whose class overrides none of them: the attributes of
    :class:`~fedlightning.user_module.ClientHooks` that :func:`_general_steps` reads, all False."""

    batch_start = transfer = zero_grad = before_backward = after_backward = before_step = batch_end = False


_NO_HOOKS = _NoHooks()


def _drop_grads(params: Sequence[Tensor]) -> None:
    """What ``optimizer.zero_grad(set_to_none=True)`` does to ``params``, without its per-call profiling wrapper."""
    for p in params:
        p.grad = None


@dataclass(frozen=True)
class _StepPlan:
    """How one client takes its local steps: resolved once per :meth:`LocalTrainer.run` (the optimizer and the
    objective terms are the client's), then read by the step loop chosen for it (``lean``).

    Decisions (ours), each a fast path that reference mode (:func:`~fedlightning._reference.reference_mode`, read
    once per run into ``reference``) turns off, with the same arithmetic either way (tests/test_lean_path.py,
    tests/test_reference_mode.py):

    * ``zero_grad``: gradients are cleared by dropping them (:func:`_drop_grads`) unless the optimizer overrides
      ``zero_grad``, which is then called with ``set_to_none=True``;
    * ``optimizer_step``: a plain SGD step is one ``_foreach_add_`` per group (:func:`_plain_sgd_lrs`), any other
      optimizer's is its own ``step()``;
    * ``lean``: a client without objective terms, per-step hooks or a closure-based optimizer runs
      :func:`_lean_steps` (``training_step``'s loss straight, no closure object per step, no hook test); any other
      client, and every client in reference mode, :func:`_general_steps`.

    ``to_device`` is None when batches stay where the loader puts them (the model is not on a CUDA device);
    ``devices`` are the CUDA devices whose RNG the client's model seed forks.
    """

    model: nn.Module
    model_name: str
    params: list[nn.Parameter]
    buffers: BufferSlots
    metrics: Any
    optimizer: torch.optim.Optimizer
    terms: Sequence[ObjectiveTerm]
    hooks: Any
    convert: Callable[[Any], Any] | None
    to_device: Callable[[Any], Any] | None
    devices: list[torch.device]
    zero_grad: Callable[[], None]
    optimizer_step: Callable[[], Any]
    grad_clip: float | None
    adaptive: bool
    reference: bool
    lean: bool


class BufferSlots:
    """A model's buffers by owner and name, in ``model.buffers()`` order. ``training_step`` may update a buffer by
    reassigning it (``self.mu = 0.9 * self.mu + 0.1 * x.mean(0)``), which registers a new tensor under the name:
    :meth:`current` reads the tensors registered now, :meth:`put_back` registers the original ones again (a client
    starts from the global values copied into them), and :meth:`snapshot` / :meth:`restore` undo a line search's
    trial evaluation, identities and values. Decision (ours): reassigning a buffer is as valid as writing it in place;
    both train each client from the global value, and FedAvg averages the clients' final values."""

    def __init__(self, model: nn.Module) -> None:
        self.slots: list[tuple[nn.Module, str, str, Tensor]] = []
        for full, tensor in model.named_buffers():
            prefix, _, leaf = full.rpartition(".")
            self.slots.append((model.get_submodule(prefix) if prefix else model, leaf, full, tensor))
        self.originals: list[Tensor] = [t for *_, t in self.slots]

    def __bool__(self) -> bool:
        return bool(self.slots)

    def current(self) -> list[Tensor]:
        """The tensors registered under the buffers' names now."""
        return [getattr(module, leaf) for module, leaf, _, _ in self.slots]

    def put_back(self, tensors: Sequence[Tensor] | None = None) -> None:
        """Register ``tensors`` (default: the original buffers) under the buffers' names where another is."""
        for (module, leaf, _, _), tensor in zip(self.slots, self.originals if tensors is None else tensors):
            if getattr(module, leaf) is not tensor:
                setattr(module, leaf, tensor)

    def snapshot(self) -> tuple[list[Tensor], list[Tensor]]:
        now = self.current()
        return now, [t.clone() for t in now]

    @torch.no_grad()
    def restore(self, snapshot: tuple[list[Tensor], list[Tensor]]) -> None:
        tensors, values = snapshot
        self.put_back(tensors)
        for t, v in zip(tensors, values):
            t.copy_(v)

    def final(self, model_name: str) -> list[Tensor]:
        """The buffers' values at a client's end (:meth:`current`), each checked to keep its shape: a buffer
        reassigned to another shape cannot be averaged with the global one (a ``ValueError`` naming it)."""
        now = self.current()
        for (_, _, full, original), tensor in zip(self.slots, now):
            if not isinstance(tensor, Tensor) or tensor.shape != original.shape:
                got = f"shape {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(
                    f"training_step of {model_name} replaced its buffer {full!r} of shape {tuple(original.shape)} "
                    f"with {got}; a buffer keeps its shape (the global model's is the clients' average)"
                )
        return now


@dataclass
class _Tally:
    """What a client's step loop counted: its losses (detached scalars of the steps that had one), step sizes, steps
    run (skipped ones included), forward and backward passes and line-search backtracks."""

    losses: list[Tensor]
    step_sizes: list[float]
    steps_run: int
    forwards: int
    backwards: int
    backtracks: int = 0
    #: per trainable parameter, the sum of its parameter group's learning rates over the steps, when the groups'
    #: sums differ (:attr:`~fedlightning.state.ClientUpdate.param_step_size_sums`); None otherwise
    param_step_sums: list[float] | None = None


def _group_lr_sums(param_groups: list[dict]) -> list[float] | None:
    """Running per-group sums of the learning rates of an optimizer with several parameter groups, else None."""
    return [0.0] * len(param_groups) if len(param_groups) > 1 else None


def _add_group_lrs(sums: list[float], param_groups: list[dict]) -> None:
    for i, group in enumerate(param_groups):
        sums[i] += float(group.get("lr", float("nan")))


def _param_step_sums(
    params: Sequence[Tensor], param_groups: list[dict], sums: list[float] | None
) -> list[float] | None:
    """Each trainable parameter's sum of its group's learning rates (0 for one no group holds, which the optimizer
    does not move), when the groups' sums differ; None when every parameter took the same steps (``step_sizes``
    describes them all)."""
    if sums is None:
        return None
    group_of = {id(p): i for i, group in enumerate(param_groups) for p in group["params"]}
    per = [sums[group_of[id(p)]] if id(p) in group_of else 0.0 for p in params]
    return None if len(set(per)) <= 1 else per  # a group of frozen parameters only does not count


def _step_size_group(param_groups: list[dict], params: Sequence[Tensor]) -> int:
    """The parameter group whose learning rate a step records as its step size: the first that holds a trainable
    parameter (a first group of frozen parameters only moves nothing), as vectorized training records it."""
    if len(param_groups) == 1:
        return 0
    ids = {id(p) for p in params}
    return next((i for i, group in enumerate(param_groups) if any(id(p) in ids for p in group["params"])), 0)


def _objective(plan: _StepPlan, batch: Any, step: int) -> Callable[[], Tensor]:
    """The client objective on ``batch`` as a closure: ``training_step``'s loss plus the plan's terms. A call with
    gradients disabled (a line search's trial point) drops what ``training_step`` logs and restores every buffer and
    metric state afterwards; a gradient evaluation whose ``training_step`` returns None raises :class:`_StepSkipped`
    and keeps ``training_step``'s output in ``closure.output`` when the model's ``on_train_batch_end`` needs it."""
    model, params, buffers, metrics, terms = plan.model, plan.params, plan.buffers, plan.metrics, plan.terms
    model_name, keep_output = plan.model_name, plan.hooks.batch_end

    def closure() -> Tensor:
        trial = not torch.is_grad_enabled()
        saved = buffers.snapshot() if (trial and buffers) else None
        saved_metrics = metrics.save() if (trial and metrics is not None) else None
        if trial:  # not a training step: what it logs is dropped (a step's own no_grad blocks log as usual)
            with routed_logging(model, discard, discard):
                output = model.training_step(batch, step)
        else:
            output = model.training_step(batch, step)
        if output is None and not trial:  # Lightning's skipped step (module docstring): nothing to restore
            raise _StepSkipped
        loss = extract_loss(output, model_name)
        if keep_output and not trial:
            closure.output = output  # for on_train_batch_end
        for term in terms:
            loss = loss + term_value(term, params)
        if saved is not None:
            buffers.restore(saved)
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
        return loss

    closure.output = None
    return closure


def _lean_steps(plan: _StepPlan, batches: Iterable[Any]) -> _Tally:
    """The local steps of a client without objective terms, per-step hooks or a closure-based optimizer, outside
    reference mode: ``zero_grad; loss = training_step; backward; [clip]; step`` with nothing else per step. A step
    whose ``training_step`` returns None is skipped (module docstring)."""
    model, model_name, params, param_groups = plan.model, plan.model_name, plan.params, plan.optimizer.param_groups
    convert, to_device, zero_grad, optimizer_step = plan.convert, plan.to_device, plan.zero_grad, plan.optimizer_step
    grad_clip = plan.grad_clip
    losses: list[Tensor] = []
    step_sizes: list[float] = []
    group_sums = _group_lr_sums(param_groups)
    lr_group = param_groups[_step_size_group(param_groups, params)]
    steps_run = forwards = backwards = 0
    for k, batch in enumerate(batches):
        if convert is not None:
            batch = convert(batch)
        if to_device is not None:
            batch = to_device(batch)
        zero_grad()
        steps_run += 1
        output = model.training_step(batch, k)
        forwards += 1
        if output is None:  # a skipped step: no backward, no optimizer step, no loss
            continue
        loss = extract_loss(output, model_name)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer_step()
        step_sizes.append(float(lr_group.get("lr", float("nan"))))
        if group_sums is not None:
            _add_group_lrs(group_sums, param_groups)
        backwards += 1
        losses.append(loss.detach())  # a scalar already (extract_loss); cast once after the loop
    sums = _param_step_sums(params, param_groups, group_sums)
    return _Tally(losses, step_sizes, steps_run, forwards, backwards, param_step_sums=sums)


def _general_steps(plan: _StepPlan, batches: Iterable[Any]) -> _Tally:
    """The local steps of any client: the loss through the client objective's closure (:func:`_objective`), the
    model's per-step hooks in Lightning's order (:class:`~fedlightning.user_module.ClientHooks`), closure-based
    optimizers (``optimizer.step(closure)``, their step size and counts from ``optimizer.last_step``; a non-finite
    loss ends the client's steps), skipped steps (module docstring)."""
    model, optimizer, h = plan.model, plan.optimizer, plan.hooks
    convert, to_device, zero_grad, optimizer_step = plan.convert, plan.to_device, plan.zero_grad, plan.optimizer_step
    adaptive, grad_clip, params = plan.adaptive, plan.grad_clip, plan.params
    losses: list[Tensor] = []
    step_sizes: list[float] = []
    group_sums = None if adaptive else _group_lr_sums(optimizer.param_groups)
    lr_group = optimizer.param_groups[_step_size_group(optimizer.param_groups, params)]
    steps_run = forwards = backwards = backtracks = 0
    for k, batch in enumerate(batches):
        if convert is not None:  # Lightning: precision conversion, the transfer hooks, then on_train_batch_start
            batch = convert(batch)
        if h.transfer:
            batch = h.transfer_batch(model, batch)
        elif to_device is not None:
            batch = to_device(batch)
        if h.batch_start and model.on_train_batch_start(batch, k) == -1:
            break  # Lightning's "skip the rest of the epoch": this client's local steps end here
        steps_run += 1
        closure = _objective(plan, batch, k)
        if adaptive:
            if h.zero_grad:
                model.on_before_zero_grad(optimizer)
            zero_grad()
            try:
                loss = optimizer.step(closure)
            except _StepSkipped:  # training_step returned None: the optimizer changed nothing
                loss = None
                forwards += 1
            else:
                info = getattr(optimizer, "last_step", None) or {}
                step_sizes.append(float(info.get("step_size", float("nan"))))
                backtracks += int(info.get("backtracks", 0))
                forwards += int(info.get("forwards", 1))
                backwards += int(info.get("backwards", 1))
        else:
            try:
                loss = closure()
            except _StepSkipped:
                loss = None
            forwards += 1
            if h.zero_grad:  # after training_step, as Lightning's closure zeroes the gradients
                model.on_before_zero_grad(optimizer)
            zero_grad()
            if loss is not None:
                if h.before_backward:
                    model.on_before_backward(loss)
                loss.backward()
                if h.after_backward:
                    model.on_after_backward()
            if h.before_step:
                model.on_before_optimizer_step(optimizer)
            if loss is not None:
                if grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, grad_clip)
                optimizer_step()
                step_sizes.append(float(lr_group.get("lr", float("nan"))))
                if group_sums is not None:
                    _add_group_lrs(group_sums, optimizer.param_groups)
                backwards += 1
        if loss is None:  # a skipped step: Lightning's on_train_batch_end outputs are {}
            if h.batch_end:
                model.on_train_batch_end({}, batch, k)
            continue
        losses.append(loss.detach())  # a scalar already (extract_loss); cast once after the loop
        if h.batch_end:
            model.on_train_batch_end(_step_outputs(closure.output, losses[-1]), batch, k)
        if adaptive and not math.isfinite(float(losses[-1])):
            break  # adaptive optimizers refuse non-finite losses; stop early, the update is discarded
    sums = _param_step_sums(params, optimizer.param_groups, group_sums)
    return _Tally(losses, step_sizes, steps_run, forwards, backwards, backtracks, sums)


def _seed_model_rng(seed: int, devices: Sequence[torch.device]) -> None:
    """Seed the CPU generator and those of ``devices`` (CUDA) with ``seed``; not ``torch.manual_seed``, which also
    queues a lazy CUDA seeding (with a stack trace) on every call."""
    torch.default_generator.manual_seed(seed)
    for dev in devices:
        torch.cuda.default_generators[dev.index if dev.index is not None else 0].manual_seed(seed)


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

    def __init__(
        self,
        model: nn.Module,
        to_device: Callable[[Any], Any] = lambda b: b,
        grad_clip: float | None = None,
        hooks: Any = None,
        metrics: Any = None,
        convert_input: Callable[[Any], Any] | None = None,
    ):
        self.model = model
        self.to_device = to_device
        self.convert_input = convert_input
        self.grad_clip = grad_clip
        self.hooks = hooks
        self.metrics = metrics if metrics else None
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        self.buffer_slots = BufferSlots(model)
        self.buffers: list[Tensor] = self.buffer_slots.originals
        self.model_name = type(model).__name__
        # parameters that do not train (requires_grad=False): see sync_frozen
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.frozen_names = [n for n, _ in frozen]
        self.frozen: list[nn.Parameter] = [p for _, p in frozen]
        self._frozen_versions: list[int] | None = None  # (ours, then the global model's) versions when last synced
        self._global_frozen_versions: list[int] | None = None
        self._told_frozen = False

    def prepare_batch(self, batch: Any) -> Any:
        """``batch`` (as the client's loader gives it) as a client step hands it to ``training_step``: the precision
        plugin's input conversion, then the model's batch-transfer hooks when its class overrides one of them, else
        the move to the model's device. For computations on the working copy besides local steps (a client's
        full-batch gradient)."""
        if self.convert_input is not None:
            batch = self.convert_input(batch)
        if self.hooks is not None and self.hooks.transfer:
            return self.hooks.transfer_batch(self.model, batch)
        return self.to_device(batch)

    def _plan(self, optimizer: torch.optim.Optimizer, terms: Sequence[ObjectiveTerm]) -> _StepPlan:
        """This client's :class:`_StepPlan` (its decisions are documented there)."""
        reference = reference_mode()
        adaptive = bool(getattr(optimizer, "requires_closure", False))
        hooks = self.hooks if (self.hooks is not None and self.hooks.any) else _NO_HOOKS
        if not reference and type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad:
            zero_grad = partial(_drop_grads, [p for g in optimizer.param_groups for p in g["params"]])
        else:
            zero_grad = partial(optimizer.zero_grad, set_to_none=True)
        sgd_lrs = None if (adaptive or reference) else _plain_sgd_lrs(optimizer)
        optimizer_step = optimizer.step if sgd_lrs is None else partial(_plain_sgd_step, optimizer, sgd_lrs)
        devices = [self.params[0].device] if self.params and self.params[0].device.type == "cuda" else []
        return _StepPlan(
            model=self.model,
            model_name=self.model_name,
            params=self.params,
            buffers=self.buffer_slots,
            metrics=self.metrics,
            optimizer=optimizer,
            terms=terms,
            hooks=hooks,
            convert=self.convert_input,
            to_device=self.to_device if devices else None,
            devices=devices,
            zero_grad=zero_grad,
            optimizer_step=optimizer_step,
            grad_clip=self.grad_clip,
            adaptive=adaptive,
            reference=reference,
            lean=not (reference or adaptive or terms or hooks is not _NO_HOOKS),
        )

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
        with_buffers: bool = False,
        global_frozen: Sequence[Tensor] = (),
    ) -> ClientUpdate:
        """Train client ``client_id`` for ``local_steps`` steps from the global weights; return its update (with
        its averaged buffers when ``with_buffers``: :func:`~fedlightning.state.report_buffers`).
        ``global_frozen``: the global model's parameters that do not train, in order (:meth:`sync_frozen`).

        Dropout and any other ``torch`` randomness inside the model is seeded by ``(seed, "model", round,
        client_id)`` in a forked RNG, so it does not depend on the other clients of the round and leaves the
        global RNG untouched. The step loop (:func:`_lean_steps` or :func:`_general_steps`) is chosen once, by the
        client's :class:`_StepPlan`.
        """
        plan = self._plan(optimizer, terms)
        steps = _lean_steps if plan.lean else _general_steps
        self.start_from(global_params, global_buffers, global_frozen)
        with torch.random.fork_rng(devices=plan.devices):
            _seed_model_rng(derive_seed(seed, "model", round, client_id), plan.devices)
            tally = steps(plan, _cycle(loader, local_steps, plan.reference))
        if self.frozen:
            self._tell_frozen_changes(client_id, round)
        return self._update(client_id, global_flat, num_samples, tally, with_buffers)

    @torch.no_grad()
    def start_from(
        self, global_params: Sequence[Tensor], global_buffers: Sequence[Tensor], global_frozen: Sequence[Tensor] = ()
    ) -> None:
        """The working copy at the global model: its trainable parameters, its buffers (the registered ones again
        where the last client reassigned one, :class:`BufferSlots`) and its parameters that do not train
        (:meth:`sync_frozen`), each set to the global value."""
        torch._foreach_copy_(self.params, list(global_params))
        if self.buffers:
            self.buffer_slots.put_back()
            torch._foreach_copy_(self.buffers, list(global_buffers))
        if self.frozen:
            self.sync_frozen(global_frozen)

    def sync_frozen(self, global_frozen: Sequence[Tensor]) -> None:
        """Every client starts from the global model's values of the parameters that do not train
        (``requires_grad=False``), as from its trainable ones: they are copied where either side changed since the
        last copy (their version counters; a frozen backbone that nothing changes costs no copy per client)."""
        if len(global_frozen) != len(self.frozen):
            return  # the module changed which parameters train: nothing to pair them with
        mine = [p._version for p in self.frozen]
        theirs = [p._version for p in global_frozen]
        if mine != self._frozen_versions or theirs != self._global_frozen_versions:
            torch._foreach_copy_(self.frozen, list(global_frozen))
            self._frozen_versions = [p._version for p in self.frozen]
            self._global_frozen_versions = theirs

    def changed_frozen(self) -> list[str]:
        """The names of the parameters that do not train which something wrote into since :meth:`sync_frozen`."""
        if self._frozen_versions is None:
            return []
        return [n for n, p, v in zip(self.frozen_names, self.frozen, self._frozen_versions) if p._version != v]

    def _tell_frozen_changes(self, client_id: int, round: int) -> None:
        """Decision (ours, documented in docs/your_model.md): what client training writes into a parameter that does
        not train (an EMA teacher, a counter) is not aggregated and does not reach the next client (it starts from
        the global value again, :meth:`sync_frozen`); said once per run, naming the parameters. State that should
        be averaged over the clients belongs in buffers (``register_buffer``), which FedAvg averages with the
        client weights, as BatchNorm's running statistics."""
        if self._told_frozen:
            return
        changed = self.changed_frozen()
        if changed:
            self._told_frozen = True
            warnings.warn(
                f"round {round}: client {client_id}'s training changed {self.model_name} parameter(s) "
                f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} with requires_grad=False; such "
                "parameters are not aggregated, and every client starts from their global value: keep state that "
                "clients should average in buffers (register_buffer), as BatchNorm's running statistics",
                UserWarning,
                stacklevel=2,
            )

    def _update(
        self,
        client_id: int,
        global_flat: Tensor,
        num_samples: int,
        tally: _Tally,
        with_buffers: bool,
    ) -> ClientUpdate:
        """The :class:`ClientUpdate` of the client whose steps ``tally`` counted: its delta from the global weights,
        losses, counts, averaged buffers (``with_buffers``: float, integer and bool ones) and failure (a
        non-finite loss or update)."""
        delta = global_flat - flat_params(self.params).to(global_flat.dtype)
        if tally.losses:
            loss_vec = torch.stack(tally.losses)
            loss_vec = loss_vec.to(loss_report_dtype(loss_vec))
            # one host transfer for the four per-client scalars (one sync on an accelerator instead of four)
            first, mean, loss_ok, delta_ok = torch.stack(
                [
                    loss_vec[0],
                    loss_vec.mean(),
                    torch.isfinite(loss_vec).all().float(),
                    torch.isfinite(delta).all().float(),
                ]
            ).tolist()
        else:  # every step skipped, or none run (on_train_batch_start -1 at k = 0): healthy, update 0, no loss
            first = mean = float("nan")
            loss_ok, delta_ok = 1.0, float(bool(torch.isfinite(delta).all()))
        update = ClientUpdate(
            client_id=client_id,
            delta=delta,
            num_samples=num_samples,
            num_steps=tally.steps_run,
            first_loss=first,
            mean_loss=mean,
            step_sizes=tally.step_sizes,
            param_step_size_sums=tally.param_step_sums,
            backtracks=tally.backtracks,
            forwards=tally.forwards,
            backwards=tally.backwards,
        )
        if with_buffers:
            update.buffers = report_buffers(self.buffer_slots.final(self.model_name), like=self.buffers)
        if not loss_ok:
            update.failed, update.failure = True, "non-finite training loss"
        elif not delta_ok:
            update.failed, update.failure = True, "non-finite model update"
        return update
