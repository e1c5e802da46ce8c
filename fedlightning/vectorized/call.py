r"""The model's ``training_step`` run under vmap over client rows: one loss per row and the values it logged.

:class:`_ModelCall` puts each row's weights in the modules' parameter slots and calls ``training_step`` on the row's
batch through one of the paths of :mod:`fedlightning.vectorized.rows`: whole rows take ``training_step``'s loss; on
padded steps (clients' batches of different sizes) each row's loss is the mean over its real samples, from the
model's ``training_step_per_sample``, from per-sample loss interception (:mod:`fedlightning.vectorized.losses`) or
from one ``training_step`` call per sample, the first that applies, chosen once per engine
(:func:`~fedlightning.vectorized.rows.choose_padded_rows`). Normalisation layers run per client
(:mod:`fedlightning.vectorized.norms`) and torchmetrics calls are recorded (:mod:`fedlightning.vectorized.metrics`);
a gradient evaluation's :class:`_Effects` carry both out of the call.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning._lightning_compat import attached_trainer, strategy_optimizers
from fedlightning._logging_route import (
    RoundLogOptions,
    note_round_log_options,
    round_log_options,
    round_log_value,
    routed_logging,
)
from fedlightning.client import BufferSlots
from fedlightning.objectives import AnchoredTerm, term_value

from .losses import AutocastLosses, LossInterception
from .metrics import _constants_mismatch, _metric_modules, _metric_types, _MetricCalls, _MetricStep, _Pending
from .norms import _NormLayers
from .rows import (
    InterceptionFailed,
    _info,  # the package's rank-zero info line (vectorized.auto imports it from here)
    _InterceptedRows,
    _ProtocolRows,
    _SampleRows,
    _unrecognised,
    _WholeRows,
    choose_padded_rows,
    extract_loss,
    may_recheck_after,
    per_sample_fallback,
    recheck_intercepted_rows,
    recheck_padded_rows,
)
from .support import (
    VectorizationUnsupportedError,
    _has_random_layers,
    _padded_embeddings,
    _per_sample_protocol,
    _vmappable_rnns,
)
from .torch_internals import (
    _embedding_forward,
    _EmbeddingLookups,
    _linear_forward,
    _offer_linear_rows,
    _parameter_slots,
    _plain_linears,
    _rnn_forward,
    _shadowed_forwards,
    _tensors_in_slots,
    tree_flatten,
    tree_unflatten,
)

__all__ = [
    "extract_loss",
    "_ClientTerms",
    "_Effects",
    "_LogCollector",
    "_ModelCall",
    "_info",
    "_tf32",
    "_tolerance",
]


class _LogCollector:
    """Stands in for ``model.log`` / ``model.log_dict`` while the model runs under ``vmap``.

    Values are collected as (batched) tensors and returned from the vmapped function as outputs, so they leave
    ``vmap`` as ordinary ``[C]`` tensors (the loop's router would otherwise keep tensors that escaped ``vmap``).
    Like the router, a value that is not one number per client is refused, and each name's options are recorded
    (``options``, handed to the router with the round's values); torchmetrics metrics and the values they return go
    to the metric recorder (:class:`~fedlightning.vectorized.metrics._MetricCalls`).
    """

    def __init__(self, metrics: _MetricCalls | None = None) -> None:
        self.names: list[str] = []
        self.values: list[Tensor] = []
        self.per_sample = False  # True while ``training_step_per_sample`` runs: only ``[n]`` values are kept
        self.metrics = metrics
        self.metric_types = _metric_types()
        self.options: dict[str, RoundLogOptions] = {}

    def reset(self, per_sample: bool = False) -> None:
        self.names, self.values = [], []
        self.per_sample = per_sample

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not self.per_sample:
            note_round_log_options(self.options, name, round_log_options(name, args, kwargs))
        if isinstance(value, _Pending):
            if self.metrics is not None:
                self.metrics.log_value(name, value)
            return
        if self.metrics is not None and self.metric_types and isinstance(value, self.metric_types):
            self.metrics.log_metric(name, value)
            return
        if self.per_sample:  # one value per sample ([n]); anything else has no per-sample meaning
            if isinstance(value, Tensor) and value.dim() == 1:
                self._keep(name, value)
            return
        if isinstance(value, Tensor) and value.numel() == 1:
            pass  # returned from vmap as it is; detached and made a scalar outside (see rows._logged_value)
        else:
            value = round_log_value(name, value)  # a number; refuses anything else, as sequential training does
        self._keep(name, value)

    def _keep(self, name: str, value: Tensor) -> None:
        if name in self.names:  # logged twice in one call: keep the last value, as a logger would
            self.values[self.names.index(name)] = value
        else:
            self.names.append(name)
            self.values.append(value)

    def log_dict(self, dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        for k, v in dictionary.items():
            self.log(k, v)


class _Effects:
    """What a gradient evaluation's batched ``training_step`` call leaves besides losses and logged values: the
    rows' running statistics after it (``stats``, :class:`~fedlightning.vectorized.norms._NormLayers`; None when
    nothing changed them) and its recorded metric calls (``metrics``, a
    :class:`~fedlightning.vectorized.metrics._MetricStep`; None without metrics)."""

    def __init__(self) -> None:
        self.stats: list[Tensor] | None = None
        self.metrics: _MetricStep | None = None


class _full_precision:
    """A context in which the checks that compare two computations run in the parameters' own dtype: without autocast
    on ``device`` (nothing for a device type autocast does not know), where mixed precision would make two correct
    computations differ by more than rounding, and on CUDA without TF32 (:func:`_ieee_float32`), so that both
    computations of a float32 check are float32 and the check holds them to float32's tolerance. Reusable: each
    ``with`` enters afresh."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.autocast(device_type=self.device.type, enabled=False))
        except RuntimeError:  # a device type autocast does not know
            pass
        if self.device.type == "cuda":
            stack.enter_context(_ieee_float32())
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def _attribute(owner: Any, name: str, strict: Any) -> tuple[Callable[[], Any], Callable[[Any], None], Any]:
    """(getter, setter, strict value) of a settings attribute, for :func:`_ieee_float32`."""
    return lambda: getattr(owner, name), lambda v: setattr(owner, name, v), strict


@contextmanager
def _ieee_float32():
    """CUDA float32 convolutions and matrix products in full float32 (no TF32) inside the context; the user's
    settings put back after. Decision (ours): the engine's checks compare a loss on a padded batch with the loss on
    its real samples alone (another batch size, so other kernels); with cuDNN's default TF32 convolutions the two
    differ by ~1e-4 relative per layer, and a tolerance loose enough for that (1e-2) let a forward pass that mixes
    samples (a batch mean subtracted) pass the check on a GPU. The checks run without gradients on one row, so full
    float32 costs little there. torch has two views of these settings: the legacy switches (``allow_tf32``,
    ``set_float32_matmul_precision``) and, since 2.9, ``fp32_precision`` per backend; the legacy ones raise when read
    after the two were set apart, and then the per-backend ones are saved and set instead."""
    backends = torch.backends
    switches = []
    try:
        backends.cudnn.allow_tf32  # noqa: B018 - readable: the legacy switch (it sets convolutions and RNNs)
        switches.append(_attribute(backends.cudnn, "allow_tf32", False))
    except RuntimeError:
        switches += [_attribute(backends.cudnn.conv, "fp32_precision", "ieee")]
        switches += [_attribute(backends.cudnn.rnn, "fp32_precision", "ieee")]
    try:
        torch.get_float32_matmul_precision()
        switches.append((torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "highest"))
    except RuntimeError:
        switches.append(_attribute(backends.cuda.matmul, "fp32_precision", "ieee"))
    saved = [(setter, getter()) for getter, setter, _ in switches]
    try:
        for _, setter, strict in switches:
            setter(strict)
        yield
    finally:
        for setter, value in reversed(saved):
            setter(value)


_MODULE_KEYS: set[str] = set()  # the attributes every LightningModule has (its own state, not the user's)


class _LockstepOptimizers:
    """``trainer.optimizers`` / ``trainer.lr_scheduler_configs`` while the clients run in lockstep: any read refuses
    the module, naming what was read. Decision (ours): a sequential client's ``training_step`` reads its own
    optimizer there (``self.trainer.optimizers[0].param_groups[0]["lr"]``, its state) and its client schedulers;
    the clients in lockstep have one optimizer each and a single ``training_step`` call, so no one object is right
    for all of them, and the server's (what the trainer holds between clients) would be silently wrong."""

    def __init__(self, model: nn.Module, what: str):
        self._message = (
            f"client_execution='vectorized': training_step of {type(model).__name__} reads self.trainer.{what}; "
            "a sequential client reads its own there, while the clients in lockstep run one training_step call for "
            "all of them (each with its own optimizer). Use client_execution='sequential' (or 'auto')"
        )

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise VectorizationUnsupportedError(self._message)

    __getitem__ = __iter__ = __len__ = __bool__ = __contains__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()


@contextmanager
def _lockstep_optimizers(model: nn.Module, refused: tuple[_LockstepOptimizers, _LockstepOptimizers]):
    """Within the block, the model's trainer holds ``refused`` (:class:`_LockstepOptimizers` for its optimizers and
    scheduler configs), as before afterwards."""
    trainer = attached_trainer(model)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if strategy is None:
        yield
        return
    with strategy_optimizers(strategy, *refused):
        yield


#: ``size`` of a number attribute in :func:`_tensor_attributes`.
_NUMBER = -2


def _same_number(a: Any, b: Any) -> bool:
    """Equal numbers, NaN equal to NaN."""
    return a == b or (a != a and b != b)


def _tensor_attributes(model: nn.Module) -> dict[tuple[int, str], tuple[nn.Module, str, Any, int | None]]:
    """The user's attributes of ``model``'s modules (torchmetrics metrics aside: their states are replayed per
    client): ``(id(module), name) -> (module, name, value, size)``; ``size`` is the length of a list, tuple or dict
    holding a tensor, -1 for a tensor, :data:`_NUMBER` for an int or float (not a bool), None for anything else."""
    if not _MODULE_KEYS:
        import lightning.pytorch as pl

        _MODULE_KEYS.update(vars(pl.LightningModule()))
    skip = {id(m) for _, metric in _metric_modules(model) for m in metric.modules()}
    found = {}
    for module in model.modules():
        if id(module) in skip:
            continue
        for key, value in vars(module).items():
            if key in _MODULE_KEYS:
                continue
            size = None
            if isinstance(value, Tensor):
                size = -1
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                size = _NUMBER
            elif isinstance(value, (list, tuple, dict)):
                items = value.values() if isinstance(value, dict) else value
                if any(isinstance(v, Tensor) for v in items):
                    size = len(value)
            found[(id(module), key)] = (module, key, value, size)
    return found


#: Samples :meth:`_ModelCall._check_sample_mean` evaluates together and one by one, at most.
PROBE_SAMPLES = 8


def _probe_cells(leaves: list[Tensor], counts: list[int], limit: int = PROBE_SAMPLES) -> list[tuple[int, int]]:
    """``(row, cell)`` of up to ``limit`` real samples of a padded batch (leaves ``[R, n_max, ...]``, ``counts`` real
    samples per row) for the sample-mean check, scanning the rows in order: first samples that bring a value of a
    *label-like* leaf not met before (an integer leaf: a target, a token label sequence; or a per-sample scalar:
    a sample weight), up to ``limit - 2``; then the first samples that repeat a value already picked (a class met
    twice), up to ``limit``; then the first samples of the row with the most. Decisions (ours): a weighted mean is
    told from a plain one only on samples of different weight, which a probe of one client's first samples misses
    under label skew, and a rare sample weight is in the probe when the step's batch holds it; a mean weighted by
    the batch's own class counts (``weight=1 / bincount(y)``) equals the plain mean on samples of distinct classes,
    and is told from it by the samples that repeat a class."""
    labels = [
        x.detach().reshape(x.shape[0], x.shape[1], -1).cpu()
        for x in leaves
        if isinstance(x, Tensor)
        and x.dim() >= 2
        and not x.is_complex()
        and (not x.is_floating_point() or x[0, 0].numel() == 1)
    ]
    picked: list[tuple[int, int]] = []
    repeats: list[tuple[int, int]] = []
    seen: list[set] = [set() for _ in labels]
    for row, n in enumerate(counts if labels else []):
        for cell in range(int(n)):
            if len(picked) >= limit - 2 and len(repeats) >= 2:
                break
            new = False
            for j, y in enumerate(labels):
                key = tuple(y[row, cell].tolist())
                if key not in seen[j]:
                    seen[j].add(key)
                    new = True
            if new and len(picked) < limit - 2:
                picked.append((row, cell))
            elif not new and len(repeats) < 2:
                repeats.append((row, cell))
    picked += repeats
    r = max(range(len(counts)), key=lambda i: (counts[i], -i))
    for cell in range(int(counts[r])):
        if len(picked) >= limit:
            break
        if (r, cell) not in picked:
            picked.append((r, cell))
    return picked[:limit]


def _tolerance(dtype: torch.dtype, tf32: bool = False) -> tuple[float, float]:
    """``(rtol, atol)`` within which two computations of one loss on batches of different sizes must agree in the
    engine's checks (ours): half-precision parameters ("16-true", "bf16-true") 2e-2 / 2e-2; float64 1e-9 / 1e-12 (the
    same float64 sums in another order: rounding of ~1e-15 relative; a term that is small when checked, e.g. a
    learnable batch-mean term whose gate starts near 0, is then seen); float32 1e-4 / 1e-6, or 1e-2 / 1e-3 where one
    of the two computations may have run TF32 kernels (``tf32``: :meth:`_ModelCall._recheck_interception` compares
    the training step's own loss with a check's; a torchvision ResNet-18 on an H100 with cuDNN's default TF32
    convolutions: 4e-4 relative between a client's 12 samples alone and in a padded batch of 50). The checks that
    compute both sides themselves run them in full float32 (:class:`_full_precision`), where TF32 never applies;
    TF32 never applies to float64 either."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype == torch.float64:
        return 1e-9, 1e-12
    if tf32:
        return 1e-2, 1e-3
    return 1e-4, 1e-6


def _no_rows(x: Tensor, W: Tensor, b: Tensor | None) -> None:
    """Leaves every batched linear layer to its product (:func:`_offer_linear_rows`): a check inside a line search's
    gradient evaluation records nothing for its trial rows."""
    return None


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    """``torch.allclose`` of two numbers, NaN equal to NaN: ``|a - b| <= atol + rtol * |b|``."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _loss_mismatch(k: int, n_max: int, real: Tensor | float, padded: Tensor | float) -> str:
    """The interception check's refusal of a loss that differs on a client's ``k`` real samples alone."""
    return (
        f"its loss on a client's {k} real samples is {float(real):.6g} but the per-sample interception "
        f"on the padded batch of {n_max} gives {float(padded):.6g}: the loss is not a mean of per-sample "
        "losses, or the forward pass mixes samples"
    )


def _logged_mismatch(name: str, k: int, n_max: int, mine: Tensor | float, theirs: Any) -> str:
    """The interception check's refusal of a logged value that differs on a client's ``k`` real samples alone."""
    shown = "nothing" if theirs is None else f"{float(theirs):.6g}"
    return (
        f"the value it logs as {name!r} is {float(mine):.6g} on the padded batch of {n_max} but "
        f"{shown} on the client's {k} real samples: a value logged in training_step must be the loss "
        "or not depend on the batch (a batch size, a sum over samples)"
    )


def _shown(value: Any) -> str:
    """A metric argument for a message: a number or one-element tensor as its value, another tensor by its shape."""
    if isinstance(value, Tensor):
        return f"{float(value):.6g}" if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def _tf32(device: torch.device) -> bool:
    """Whether float32 convolutions or matrix products on ``device`` may run in TF32 (10-bit mantissa): on CUDA,
    cuDNN's convolutions do by default (``torch.backends.cudnn.allow_tf32``), matrix products when
    ``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision`` allow it. Then the same
    samples in a batch of another size can give results that differ by ~1e-4 relative per layer (other kernels),
    which :meth:`_ModelCall._recheck_interception` must tolerate (:func:`_tolerance`)."""
    if device.type != "cuda":
        return False
    try:
        legacy = bool(torch.backends.cudnn.allow_tf32) or bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch refusing to read the legacy switches after the new fp32_precision API was used
        return True
    return legacy or torch.get_float32_matmul_precision() != "highest"


def _eager() -> contextlib.AbstractContextManager:
    """``torch.compile`` directives ignored in the block (``torch.compiler.set_stance("force_eager")``; torch
    versions without it: nothing)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class _ModelCall:
    """The wrapped model's ``training_step`` on rows of client weights and batches, as one vmapped call.

    Each row's parameter tensors go straight into the modules' parameter slots (what ``functional_call`` does,
    without its per-call name resolution). While the model runs under vmap (:meth:`_vmap_context`) ``self.log``
    goes to a :class:`_LogCollector`, RNN layers run in plain tensor ops, normalisation layers run per client with
    the rows' running statistics and torchmetrics calls are recorded. :meth:`row_values` gives one loss per row
    through a path of :mod:`fedlightning.vectorized.rows`: ``whole_rows`` for whole rows, ``padded_rows`` for
    padded ones, chosen on the first padded step (None until then).

    Decisions (ours): the per-sample protocol is not used for models with BatchNorm (a sample's loss depends on the
    client's batch) nor for modules whose ``training_step`` calls a torchmetrics metric (the metric calls are
    ``training_step``'s; found by one call on a sample, once per engine): their padded steps go through loss
    interception, which calls ``training_step`` itself. The padded path is chosen once; the only change after that
    is loss interception giving way to the per-sample path on a call it cannot run
    (:class:`~fedlightning.vectorized.rows.InterceptionFailed`), for good.
    """

    def __init__(self, model: nn.Module, named: Sequence[tuple[str, Tensor]], dtype: torch.dtype):
        """``named``: the model's trainable parameters (name, Parameter), in the order of the rows' tensors;
        ``dtype``: theirs (one for all)."""
        self.model = model
        self.dtype = dtype
        self.device_type = named[0][1].device.type if named else "cpu"  # autocast's device type (_vmap_context)
        # layers the user compiled (torch.compile's wrapper keeps the module as ``_orig_mod``): run eagerly under
        # vmap (_vmap_context); set only for them, since entering the compiler's stance costs ~0.1 ms a call
        self.compiled_layers = any(hasattr(m, "_orig_mod") for m in model.modules())
        self.param_slots = _parameter_slots(model, named)
        self.metric_calls = _MetricCalls(_metric_modules(model))
        self.collector = _LogCollector(self.metric_calls)
        self.norms = _NormLayers(model)
        #: whether the model makes ``F.embedding`` lookups that :class:`_EmbeddingLookups` rewrites or refuses (None:
        #: not known before the first batched call, which runs under it; True: every call runs under it)
        self.lookups: bool | None = None
        #: the model's ``training_step_per_sample`` if padded steps may use it (never with normalisation layers)
        self.protocol = None if self.norms else _per_sample_protocol(model)
        # layers computed another way under vmap: recurrent layers in plain tensor ops, linear layers batched
        self.forwards = [
            *((m, _rnn_forward) for m in _vmappable_rnns(model)),
            *((m, _linear_forward) for m in _plain_linears(model)),
            *((m, _embedding_forward) for m in _padded_embeddings(model)),
        ]
        self.deterministic = not _has_random_layers(model)
        self._attributes_checked = False  # the first batched call's writes to module attributes (_check_attributes)
        self.whole_rows = _WholeRows(self)
        self.padded_rows: Any | None = None  # chosen on the first padded step (choose_padded_rows)
        self.recheck_padded = False  # set at each round's start: its first padded step checks the path again
        # buffers other than the normalisation layers' running statistics (which run per client): the engine shares
        # them between the clients, so training_step must not write them (_check_buffers)
        norm_modules = {id(m) for _, m, _, _ in self.norms.layers}
        self._shared_buffers = [
            (f"{name}.{b}" if name else b, t)
            for name, module in model.named_modules()
            if id(module) not in norm_modules
            for b, t in module.named_buffers(recurse=False)
            if t is not None
        ]
        self._may_intercept = True  # False: padded steps without the protocol take the per-sample path (intercept)
        # what the trainer holds for its optimizers and scheduler configs while the model runs (_vmap_context)
        self._lockstep = (_LockstepOptimizers(model, "optimizers"), _LockstepOptimizers(model, "lr_scheduler_configs"))
        self._buffer_slots = BufferSlots(model)  # a buffer training_step reassigns: _check_buffers

    # ------------------------------------------------------------------ the chosen paths, as tests read them
    @property
    def per_sample_step(self) -> Callable[[Any, int], Tensor] | None:
        """The model's ``training_step_per_sample`` while padded steps use it or have not been chosen yet, else
        None."""
        if self.padded_rows is None or isinstance(self.padded_rows, _ProtocolRows):
            return self.protocol
        return None

    @property
    def intercept(self) -> bool | None:
        """Whether padded steps use loss interception: True, False (the per-sample path), None (not chosen yet, or
        the per-sample protocol). Setting it to False pins padded steps without the protocol to the per-sample path
        (tests compare the two paths this way)."""
        if isinstance(self.padded_rows, _InterceptedRows):
            return True
        if isinstance(self.padded_rows, _SampleRows):
            return False
        return None

    @intercept.setter
    def intercept(self, value: bool) -> None:
        if value is not False:
            raise ValueError(f"intercept can only be set to False (the per-sample path), got {value!r}")
        self._may_intercept = False
        if isinstance(self.padded_rows, _InterceptedRows):
            self.padded_rows = _SampleRows(self, "")

    def pin_per_sample(self, reason: str) -> None:
        """Padded steps take the per-sample path from now on, announced with ``reason``: a run resumed from a
        checkpoint whose run had left loss interception for it (:attr:`VectorizedClientTrainer.padded_path_state`),
        so the resumed run computes its padded steps as the uninterrupted run does."""
        self._may_intercept = False
        if not isinstance(self.padded_rows, _SampleRows):
            self.padded_rows = per_sample_fallback(self, reason)

    @property
    def padded_path_reason(self) -> str:
        """Why padded steps take their path ("" before the first padded step)."""
        return self.padded_rows.reason if self.padded_rows is not None else ""

    @property
    def probed(self) -> set:
        """The names of the paths whose first call ran (under the layer tracker) and succeeded."""
        return {rows.name for rows in (self.whole_rows, self.padded_rows) if getattr(rows, "probed", False)}

    @property
    def metric_modules(self) -> list[tuple[str, nn.Module]]:
        return self.metric_calls.modules

    @contextmanager
    def _vmap_context(self):
        """While the model runs under vmap: ``self.log`` goes to the collector, RNN layers use
        :func:`~fedlightning.vectorized.torch_internals._rnn_forward`, linear layers
        :func:`~fedlightning.vectorized.torch_internals._batched_linear`, normalisation layers
        :class:`~fedlightning.vectorized.norms._NormLayers`, torchmetrics calls are recorded, and layers the user
        compiled (``torch.compile``) run eagerly: dynamo would trace into the batched calls, recompile for each of
        their shapes and fall back to eager at its recompile limit, with a warning per graph break (decision ours;
        the compiled code runs everywhere else, sequential clients and evaluation included)."""
        saved_metrics = self.metric_calls.install()
        self.norms.install()
        upcast = AutocastLosses() if torch.is_autocast_enabled(self.device_type) else contextlib.nullcontext()
        # functional embedding lookups: watched until the first batched call has run, kept for models that make one
        lookups = _EmbeddingLookups() if self.lookups is not False else None
        try:
            with (
                routed_logging(self.model, self.collector.log, self.collector.log_dict),
                _shadowed_forwards(self.forwards),
                upcast,
                lookups if lookups is not None else contextlib.nullcontext(),
                _lockstep_optimizers(self.model, self._lockstep),
                _eager() if self.compiled_layers else contextlib.nullcontext(),
            ):
                yield
        finally:
            if lookups is not None and lookups.seen:
                self.lookups = True
            self.metric_calls.uninstall(saved_metrics)
            self.norms.uninstall()
            self.metric_calls.begin(False)

    def row_values(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor | None,
        step: int,
        cells: bool = False,
        clients: Tensor | None = None,
        effects: _Effects | None = None,
        min_count: int | None = None,
    ):
        """One value per row of a :class:`~fedlightning.vectorized.layout._Layout` batch at the row weights
        ``views`` ([R, ...] each), and the values the model logged (list of ``(name, [R] tensor)``): whole rows give
        ``training_step``'s loss of the row; cell rows (``mask`` given) give the sum of the per-sample losses of the
        row's real cells, or, with ``cells``, the ``[R, n_max]`` per-sample losses themselves (padded cells
        included; logged values are still the masked sums).

        ``clients``: the client of each row (None: row ``i`` is client ``i``), whose running statistics the rows
        use; ``effects``: filled with the call's new running statistics and metric calls (None: a trial or check
        evaluation, whose effects are dropped); ``min_count``: the smallest real batch of the rows (read from
        ``mask`` when not given).

        Whole rows take ``whole_rows``; cell rows take ``padded_rows``, chosen on the first of them by
        :func:`~fedlightning.vectorized.rows.choose_padded_rows` (the model's per-sample protocol, per-sample loss
        interception or one ``training_step`` call per sample, the first that applies)."""
        versions = [t._version for _, t in self._shared_buffers]
        attributes = None if self._attributes_checked else _tensor_attributes(self.model)
        try:
            out = self._row_values(views, batch, mask, step, cells, effects, min_count, clients)
        finally:
            if attributes is not None:
                self._check_attributes(attributes)
        self._attributes_checked = True
        if self.lookups is None:  # the first batched call made no lookup _EmbeddingLookups rewrites: no mode from now
            self.lookups = False
        self._check_buffers(versions)
        return out

    def _check_attributes(self, before: dict[tuple[int, str], tuple[nn.Module, str, Any, int | None]]) -> None:
        """Raise :class:`VectorizationUnsupportedError` naming a tensor attribute of the model's modules that the
        first batched call set or grew (``self.ema = 0.9 * self.ema + 0.1 * loss``, ``self.history.append(loss)``),
        or a number attribute it changed (``self.calls += 1``), after putting every such attribute back as it was.
        Decision (ours): each sequential client reads and writes its own value, and calls ``training_step`` once per
        local step and line-search trial; the clients in lockstep would leave one batched value there (which
        sequential training cannot read after a fallback), and call ``training_step`` once for all of them, so a
        counter would count other calls. The module is refused (``"auto"`` trains it sequentially). A bool flag
        (``self.logged_once = True``) ends as sequential training leaves it and is not checked; a number first set
        by the call (a constant cached on first use as well as a counter started there) is refused too, which
        costs such a module only the speed-up."""
        after = _tensor_attributes(self.model)
        changed = []
        for k, (module, key, value, size) in after.items():
            if size is None:
                continue
            old = before.get(k)
            if size == _NUMBER:
                if old is None or old[3] != _NUMBER or not _same_number(old[2], value):
                    changed.append((module, key, f" ({'unset' if old is None else old[2]!r} -> {value!r})"))
            elif old is None or old[2] is not value or old[3] != size:
                changed.append((module, key, ""))
        if not changed:
            return
        for module, key, _ in changed:
            kept = before.get((id(module), key))
            if kept is None:
                delattr(module, key)
            else:
                object.__setattr__(module, key, kept[2])
        names = {id(m): n for n, m in self.model.named_modules()}
        where = ", ".join(f"'{(names[id(m)] + '.') if names[id(m)] else ''}{k}'{how}" for m, k, how in changed)
        if all(how for _, _, how in changed):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized': training_step of {type(self.model).__name__} changes the number "
                f"attributes {where} of the module; each sequential client calls training_step once per local step "
                "(and per line-search trial), the clients in lockstep call it once for all of them, so the values "
                "would differ. Use client_execution='sequential' (or 'auto')"
            )
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized': training_step of {type(self.model).__name__} stores tensors in the "
            f"module's attributes ({where}); each sequential client keeps its own, the clients in lockstep would "
            "share one. Use client_execution='sequential' (or 'auto')"
        )

    def shared_write_hint(self, err: BaseException) -> str:
        """For an error that an in-place write into a tensor all clients share raises under vmap (``output with shape
        [..] doesn't match the broadcast shape [..]``: ``self.ema.mul_(0.9).add_(0.1 * loss)``, ``self.counts +=
        bincount(y)``, an EMA copy without gradient), a sentence naming the model's shared tensors of the written
        shape (buffers, parameters without gradient); "" for any other error."""
        found = re.search(r"output with shape \[([0-9, ]*)\] doesn't match the broadcast shape", str(err))
        if found is None:
            return ""
        shape = tuple(int(n) for n in found.group(1).replace(" ", "").split(",") if n)
        shared = [name for name, t in self._shared_buffers if tuple(t.shape) == shape]
        shared += [name for name, p in self.model.named_parameters() if not p.requires_grad and tuple(p.shape) == shape]
        which = f" ({', '.join(repr(n) for n in shared)} of shape {list(shape)})" if shared else ""
        return (
            "training_step writes values that differ by client in place into a tensor all clients share "
            f"(a buffer or a parameter without gradient{which}); each sequential client writes its own"
        )

    def _check_buffers(self, versions: list[int]) -> None:
        """Raise :class:`VectorizationUnsupportedError` naming a shared buffer whose version counter moved since
        ``versions``: ``training_step`` wrote it in place. Decision (ours): the clients in lockstep share the model's
        buffers (only normalisation layers' running statistics are kept per client), so such a write would be one
        write for all clients, not each client's own as sequential training makes it; the round stops instead
        (``"auto"`` trains sequentially). A buffer that ``training_step`` reassigns (``self.mu = ...``, a new
        tensor under its name, which under vmap holds every row's value) is refused alike, after the original is
        registered again."""
        slots = self._buffer_slots
        replaced = [full for (_, _, full, t), now in zip(slots.slots, slots.current()) if now is not t]
        if replaced:
            slots.put_back()
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized': training_step of {type(self.model).__name__} reassigns its buffer "
                f"'{replaced[0]}' (self.<name> = ...); the clients in lockstep share the model's buffers, so each "
                "client's own value would be lost. Use client_execution='sequential' (or 'auto'), which trains "
                "each client from the global value and averages the clients' values (integers rounded)"
            )
        for (name, t), before in zip(self._shared_buffers, versions):
            if t._version != before:
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized': training_step of {type(self.model).__name__} writes its buffer "
                    f"'{name}' in place; the clients in lockstep share the model's buffers (only BatchNorm and "
                    "InstanceNorm running statistics are kept per client), so each client's own update of it would "
                    "be lost. Use client_execution='sequential' (or 'auto')"
                )

    def _row_values(self, views, batch, mask, step, cells, effects, min_count, clients):
        stats = self.norms.rows(clients) if self.norms.stats else []
        if mask is None:
            min_count = tree_flatten(batch)[0][0].shape[1]
            return self.whole_rows.values(views, batch, None, step, cells, stats, effects, min_count)
        if min_count is None:
            min_count = int(mask.sum(1).min()) if self.norms else 2
        recheck_after = False  # the padded path's check, on this step's own result (recheck_intercepted_rows)
        if self.padded_rows is None:
            self.padded_rows = choose_padded_rows(self, views, batch, mask, step, stats, self._may_intercept)
            self.recheck_padded = False
        elif self.recheck_padded and clients is None:  # a round's first padded gradient evaluation
            self.recheck_padded = False
            recheck_after = may_recheck_after(self, views[0].device)
            if not recheck_after:
                recheck_padded_rows(self, views, batch, mask, step, stats)
        try:
            out = self.padded_rows.values(views, batch, mask, step, cells, stats, effects, min_count)
        except InterceptionFailed as failed:  # loss interception cannot run this call: the per-sample path, for good
            self.padded_rows = per_sample_fallback(self, failed.reason)
            return self.padded_rows.values(views, batch, mask, step, cells, stats, effects, min_count)
        if recheck_after and not recheck_intercepted_rows(self, out, views, batch, mask, step, stats):
            out = self.padded_rows.values(views, batch, mask, step, cells, stats, effects, min_count)
        return out

    def _keep_effects(
        self,
        effects: _Effects | None,
        metric_outs: Sequence[Tensor],
        stats: Sequence[Tensor] | None,
        mask: Tensor | None,
    ) -> None:
        """Fill ``effects`` (if any) from a batched call's outputs: the rows' new running statistics (None: the
        path changes none) and the recorded metric calls (their real sample counts are the layout's)."""
        if effects is None:
            return
        if stats is not None and len(stats):
            effects.stats = list(stats)
        step = self.metric_calls.finish(metric_outs)
        if step is not None and step.calls:
            effects.metrics = step

    def _weights_in_slots(self, vs: Sequence[Tensor]):
        """The modules' parameter slots hold ``vs`` (one tensor per trainable parameter, a row's weights) inside
        the block, their Parameters again afterwards."""
        return _tensors_in_slots(self.param_slots, vs)

    @contextmanager
    def _checking(self, device: torch.device, eval_random: bool = False):
        """The context of the checks' ``training_step`` calls (ours, one for every check): no gradients, the random
        state put back (the CPU's, and ``device``'s on CUDA), full precision (:class:`_full_precision`); with
        ``eval_random``, a model with random layers in eval mode (what such a check compares does not depend on their
        draws), its modules' modes put back one by one after (a layer the module keeps frozen in eval stays so)."""
        modes = [(m, m.training) for m in self.model.modules()] if eval_random else []
        if eval_random and not self.deterministic:
            self.model.eval()
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices), _full_precision(device):
                yield
        finally:
            for m, training in modes:
                m.training = training

    def _per_sample_losses(self, vs: Sequence[Tensor], batch: Any, step: int, n: int) -> Tensor:
        """``model.training_step_per_sample(batch, step)`` with the parameter slots holding ``vs``; checked to be a
        tensor of ``n`` losses. Outside a padded step (the protocol's check) the values it logs are dropped."""
        collector = self.collector
        checking = not collector.per_sample
        kept = collector.names, collector.values
        if checking:
            collector.reset(per_sample=True)  # its logged values are per sample
        try:
            with self._weights_in_slots(vs):
                losses = self.protocol(batch, step)
        finally:
            if checking:
                collector.names, collector.values = kept
                collector.per_sample = False
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (n,):
            got = f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"{type(self.model).__name__}.training_step_per_sample must return one loss per sample (a tensor of "
                f"shape ({n},) for a batch of {n}), got {got}"
            )
        return losses

    def _check_interception(
        self, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor]
    ) -> str | None:
        """None if the intercepted loss of a padded row (see below) equals ``training_step`` on its real samples alone
        (at the row's weights and running statistics, without gradients, in full precision), else the reason it does
        not. Skipped (None) for models with random layers, whose two calls draw different random numbers."""
        if not self.deterministic:
            return None
        leaves, spec = tree_flatten(batch)
        r, k = self._interception_row(mask)
        n_max = mask.shape[1]
        row = [v[r].detach() for v in views]
        row_stats = [s[r] for s in stats]
        model_name = type(self.model).__name__
        self.metric_calls.begin(False)
        with self._checking(row[0].device):
            with self._weights_in_slots(row):
                row_mask = mask[r].to(self.dtype)
                interception = LossInterception(n_max, row_mask, row_mask.sum(), flattened=self.deterministic)
                self.norms.begin(row_stats, row_mask, row_mask.sum(), k)
                self.collector.reset()
                try:
                    with interception:
                        padded = extract_loss(
                            self.model.training_step(tree_unflatten([x[r] for x in leaves], spec), step), model_name
                        )
                finally:
                    self.norms.end()
                if interception.cells_of(padded) is None:
                    self.collector.reset()
                    return _unrecognised("the loss training_step returns", interception)
                # values logged as constants (not the loss's cells): the same on the client's real samples?
                constants = {
                    n: v
                    for n, v in zip(self.collector.names, self.collector.values)
                    if interception.cells_of(v) is None
                }
            real, real_logged = self._real_row(views, batch, r, k, step, stats)
        rtol, atol = _tolerance(self.dtype)
        if not torch.allclose(padded.double(), real.double(), rtol=rtol, atol=atol, equal_nan=True):
            return _loss_mismatch(k, n_max, real, padded)
        for name, value in constants.items():
            mine, theirs = torch.as_tensor(value).double(), real_logged.get(name)
            if theirs is None or not torch.allclose(
                mine, torch.as_tensor(theirs).double(), rtol=rtol, atol=atol, equal_nan=True
            ):
                return _logged_mismatch(name, k, n_max, mine, theirs)
        return None

    def _interception_row(self, mask: Tensor) -> tuple[int, int]:
        """``(r, k)``: the row the interception checks compare and its number of real samples: the most padded row of
        at least two samples (BatchNorm fails a batch of one value per channel) whose padding is not whole copies of
        its batch (such copies keep batch means, which would hide a forward pass that mixes samples), else the most
        padded row."""
        counts = mask.sum(1).tolist()
        n_max = mask.shape[1]
        r = min(range(len(counts)), key=lambda i: (counts[i] < 2, n_max % counts[i] == 0, counts[i]))
        return r, int(counts[r])

    def _recheck_interception(
        self, result: tuple, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor]
    ) -> str | None:
        """:meth:`_check_interception` on a padded step that loss interception has just computed (``result``: what
        :meth:`~fedlightning.vectorized.rows._InterceptedRows.values` returned): the step's own intercepted loss of
        the check's row (the sum of its real cells over their count) and its logged values take the place of a
        second call on the padded row, so the check costs one ``training_step`` call (the row's real samples alone,
        without gradients). Logged values are compared at their dtype's tolerance (float32's for anything but
        float64). Run only where :meth:`_check_interception` would run in the same precision (no autocast) on a model
        without random layers."""
        sums, logged = result[-2], result[-1]
        r, k = self._interception_row(mask)
        real, real_logged = self._real_row(views, batch, r, k, step, stats)
        # one host read each of the row's values: the step's own (sums over its k real cells), and its real
        # samples' alone
        names = [name for name, _ in logged]
        mine = torch.stack([sums[r].detach().double(), *(v[r].double() for _, v in logged)]).div_(k).tolist()
        found = [name for name in names if name in real_logged]
        seen = [torch.as_tensor(real_logged[name]).double().reshape(()) for name in found]
        theirs = torch.stack([real.detach().double().reshape(()), *seen]).tolist()
        device = views[0].device
        tf32 = _tf32(device)  # the step's own loss may come from TF32 kernels, the check's never does
        rtol, atol = _tolerance(self.dtype, tf32)
        if not _close(mine[0], theirs[0], rtol, atol):
            return _loss_mismatch(k, mask.shape[1], theirs[0], mine[0])
        real_values = dict(zip(found, theirs[1:]))
        for (name, logged_value), value in zip(logged, mine[1:]):
            dtype = torch.float64 if logged_value.dtype == torch.float64 else torch.float32
            rtol, atol = _tolerance(dtype, tf32)
            if name not in real_values or not _close(value, real_values[name], rtol, atol):
                return _logged_mismatch(name, k, mask.shape[1], value, real_values.get(name))
        return None

    def _real_row(
        self, views: list[Tensor], batch: Any, r: int, k: int, step: int, stats: list[Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``training_step``'s loss and logged values on row ``r``'s ``k`` real samples alone, at the row's weights
        and running statistics, without gradients, in full precision, the random state kept."""
        leaves, spec = tree_flatten(batch)
        row = [v[r].detach() for v in views]
        self.metric_calls.begin(False)
        self.collector.reset()
        with self._checking(row[0].device):
            with self._weights_in_slots(row):
                self.norms.begin([s[r] for s in stats], None, None, k)
                try:
                    real = extract_loss(
                        self.model.training_step(tree_unflatten([x[r, :k] for x in leaves], spec), step),
                        type(self.model).__name__,
                    )
                    return real, dict(zip(self.collector.names, self.collector.values))
                finally:
                    self.norms.end()
                    self.collector.reset()

    def _check_sample_mean(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor,
        step: int,
        stats: list[Tensor],
        halves: bool = False,
    ) -> str | None:
        """None if ``training_step``'s loss on a few real samples of the step's batch (:func:`_probe_cells`: up to
        8, at least 2) equals the mean of its losses on each of those samples alone (at the weights and running
        statistics of the row with the most samples, without gradients, in full precision, metrics and logged values
        dropped, random state kept), else the two values: the per-sample path (one ``training_step`` per sample,
        averaged over a client's real samples) computes the client's loss only for a loss that is a mean over
        samples. A ``reduction="sum"`` loss, a term computed over the whole batch, a mean weighted by class
        (``cross_entropy(weight=...)``) or one that leaves samples out (``ignore_index``) fails, the last two when
        the probe holds samples of classes of different weight, or an ignored one: the probe takes samples of as many
        distinct values of the batch's integer leaves (targets) as it can, from every client's rows. Models with
        random layers are checked in eval mode (dropout off): the check is about how the loss reduces over samples,
        which their random draws would hide.

        With ``halves`` (the per-sample path's check, ours), also every client row's real samples: its loss on them
        must equal the size-weighted mean of its losses on their two halves (as a mean over samples does), which a
        mean weighted by something of the inputs fails where its heavy samples fall in one half, whatever the
        probe holds (``3 R`` more small calls, once per round)."""
        leaves, spec = tree_flatten(batch)
        counts = mask.sum(1).tolist()
        r = max(range(len(counts)), key=lambda i: (counts[i], -i))
        cells = _probe_cells(leaves, counts)
        k = len(cells)
        if k < 2:
            return None
        at_rows = torch.tensor([c[0] for c in cells], device=mask.device)
        at_cols = torch.tensor([c[1] for c in cells], device=mask.device)
        probe = [x.detach()[at_rows, at_cols] for x in leaves]
        row = [v[r].detach() for v in views]
        row_stats = [s[r] for s in stats]
        model_name = type(self.model).__name__
        self.metric_calls.begin(False)

        def loss(lo: int, hi: int, samples=probe, stats=row_stats) -> tuple[Tensor, dict[str, Tensor]]:
            self.norms.begin(stats, None, None, hi - lo)
            self.collector.reset()
            try:
                b = tree_unflatten([x[lo:hi] for x in samples], spec)
                value = extract_loss(self.model.training_step(b, step), model_name).double().reshape(())
                logged = {
                    n: v.detach().double().reshape(()) for n, v in zip(self.collector.names, self.collector.values)
                }
                return value, logged
            finally:
                self.norms.end()

        splits: list[tuple[int, int, Tensor, Tensor]] = []  # (row, real samples, whole batch, size-weighted halves)
        try:
            with self._checking(row[0].device, eval_random=True):
                with self._weights_in_slots(row):
                    together, logged = loss(0, k)
                    each = [loss(j, j + 1) for j in range(k)]
                for i, n in enumerate(int(c) for c in counts):
                    if not halves or n < 2:
                        continue
                    real, h = [x.detach()[i, :n] for x in leaves], n // 2
                    stats_i = [s_[i] for s_ in stats]
                    with self._weights_in_slots([v[i].detach() for v in views]):
                        whole = loss(0, n, real, stats_i)[0]
                        parts = (h * loss(0, h, real, stats_i)[0] + (n - h) * loss(h, n, real, stats_i)[0]) / n
                    splits.append((i, n, whole, parts))
        finally:
            self.collector.reset()
        rtol, atol = _tolerance(self.dtype)
        alone = torch.stack([v for v, _ in each])
        if not torch.allclose(together, alone.mean(), rtol=rtol, atol=atol, equal_nan=True):
            return (
                f"its loss on {k} samples of the clients' batches is {float(together):.6g} while the mean of its "
                f"losses on each of them alone is {float(alone.mean()):.6g} "
                f"(per sample: {[round(float(v), 6) for v in alone]}): "
                "the loss is not a mean over samples (reduction='sum'? a term over the whole batch? class weights or "
                "ignore_index, which weight the samples in the mean?)"
            )
        for i, n, whole, parts in splits:  # every client's real samples: a mean over them splits into its halves
            if not torch.allclose(whole, parts, rtol=rtol, atol=atol, equal_nan=True):
                return (
                    f"its loss on the {n} real samples of client row {i}'s batch is {float(whole):.6g} while the "
                    f"size-weighted mean of its losses on the batch's two halves is {float(parts):.6g}: the loss is "
                    "not a mean over samples (a mean weighted by something of the samples, such as a weight computed "
                    "from the inputs? a term over the whole batch?)"
                )
        for name, value in logged.items():  # logged values are averaged over a client's samples the same way
            per = [lg.get(name) for _, lg in each]
            if any(v is None for v in per):
                continue  # not logged on a single sample: nothing to average (the per-sample path drops it too)
            mean = torch.stack(per).mean()
            if not torch.allclose(value, mean, rtol=rtol, atol=atol, equal_nan=True):
                return (
                    f"the value it logs as {name!r} is {float(value):.6g} on {k} samples of the clients' batches while "
                    f"the mean of its values on each of them alone is {float(mean):.6g}: a value logged in "
                    "training_step must be a mean over samples (or not depend on the batch), not a batch size or a "
                    "sum, to be logged per client from padded steps"
                )
        return None

    def _check_padded_means(
        self, path: Any, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor], min_count: int
    ) -> str | None:
        """None if, on every row with two real samples or more, ``training_step``'s loss on the row's whole padded
        batch equals the mean of a padded path's cells of that batch (``path``: the per-sample path,
        :class:`~fedlightning.vectorized.rows._SampleRows`, or a user's per-sample protocol,
        :class:`~fedlightning.vectorized.rows._ProtocolRows`, whose call has just computed them), and so does every
        value it logs; else the first difference. The padding repeats the row's own samples, so for a mean over
        samples both are the same mean; a mean weighted per sample (tokens that are not ignored, class weights, an
        input) differs as soon as the weights differ within a row, and with them the client's true loss and the
        path's.

        Decisions (ours): the batch call runs without gradients or effects, in full precision, with the random state
        put back (:meth:`_checking`) and no line-search recording; a model with random layers, or one under autocast,
        gets its cells computed again the same way (in eval mode), others reuse the step's own (TF32's tolerance on
        CUDA where the step's may come from TF32 kernels). Rows with one real sample hold one sample ``n_max`` times,
        where any mean is that sample's."""
        counts = mask.sum(1).tolist()
        if max(counts) < 2:
            return None
        device = views[0].device
        plain = [v.detach() for v in views]
        reuse = self.deterministic and not torch.is_autocast_enabled(device.type)
        try:
            with self._vmap_context(), self._checking(device, eval_random=True), _offer_linear_rows(_no_rows):
                if reuse:
                    cells, cell_logged = path.last_cells
                else:
                    cells, cell_logged = path.cells(plain, batch, mask, step, stats, min_count)
                whole, whole_logged = self.whole_rows._vmapped(plain, batch, None, step, False, stats, None, min_count)
        finally:
            self.collector.reset()
        rows = [i for i, k in enumerate(counts) if k >= 2]
        at = torch.tensor(rows, device=cells.device)
        per_name = dict(whole_logged)
        pairs = [("the loss", whole, cells)]
        pairs += [(repr(name), per_name[name], v) for name, v in cell_logged if name in per_name]
        n_max = mask.shape[1]
        tf32 = reuse and _tf32(device)
        for what, batch_values, cell_values in pairs:
            got = batch_values.detach().reshape(-1)[at].double().tolist()
            mean = cell_values.double().mean(1)[at].tolist()
            dtype = torch.float64 if cell_values.dtype == torch.float64 else self.dtype
            rtol, atol = _tolerance(dtype, tf32)
            for i, a, b in zip(rows, got, mean):
                if not _close(a, b, rtol, atol):
                    return (
                        f"{what} of training_step on client row {i}'s padded batch of {n_max} ({counts[i]} real "
                        f"samples, the others repeated) is {a:.6g} while the mean over its samples alone is {b:.6g} "
                        f"(local step {step}): the loss is not a mean over samples here (a mean over tokens or "
                        "elements whose count differs between samples, e.g. ignore_index or a padding mask; class "
                        "weights; a weight computed from the inputs), and averaging per sample would train a "
                        "client on another objective than its own batch's"
                    )
        return None

    def _check_metric_arguments(
        self, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor], alone: bool
    ) -> None:
        """Raise :class:`VectorizationUnsupportedError` naming the metric and the argument if a torchmetrics call in
        ``training_step`` gets an argument that is not one value per sample (a Python number, a tensor whose first
        dimension is not the batch's) and differs between the value a padded path records and the client's real
        samples: with ``alone`` False (loss interception) the padded row's call against its real samples alone, with
        ``alone`` True (the per-sample path) the row's real samples against the first of them alone. Such an
        argument (``weight=len(y)``, ``torch.tensor(len(y))``, a statistic of the batch) is replayed once per step
        for every client with the recorded value (:mod:`fedlightning.vectorized.metrics`), which would then count
        the padding where sequential training counts the real samples. Nothing for a module without metrics. Two
        ``training_step`` calls on the row that :meth:`_interception_row` picks, without gradients, in full
        precision, in eval mode for models with random layers (what is compared does not depend on their draws),
        random state kept; once when the path is chosen."""
        if not self.metric_calls:
            return
        leaves, spec = tree_flatten(batch)
        r, k = self._interception_row(mask)
        if alone and k < 2:
            return
        n = mask.shape[1]
        row = [v[r].detach() for v in views]
        row_stats = [s[r] for s in stats]

        def constants(size: int, padded: bool) -> list:
            interception, weights = None, None
            if padded:
                weights = mask[r].to(self.dtype)
                interception = LossInterception(n, weights, weights.sum(), flattened=self.deterministic)
            self.metric_calls.begin(False, n=size, interception=interception, constants=True)
            self.norms.begin(row_stats, weights, None if weights is None else weights.sum(), k if padded else size)
            self.collector.reset()
            try:
                with interception if interception is not None else contextlib.nullcontext():
                    self.model.training_step(tree_unflatten([x[r, :size] for x in leaves], spec), step)
            finally:
                self.norms.end()
            return list(self.metric_calls.constants)

        try:
            with self._checking(row[0].device, eval_random=True), self._weights_in_slots(row):
                real = constants(k, False)
                other = constants(1, False) if alone else constants(n, True)
        finally:
            self.metric_calls.begin(False)
            self.collector.reset()
        rtol, atol = _tolerance(self.dtype)
        names = [name for name, _ in self.metric_calls.modules]
        found = _constants_mismatch(names, other, real, rtol, atol)
        if found is None:
            return
        metric, argument, theirs, mine = found
        if argument:
            theirs, mine = _shown(theirs), _shown(mine)
        if alone:  # (value, where) of both calls, in the order the message names them
            first, second = (mine, f"a client's {k} real samples"), (theirs, "one of them alone")
        else:
            first, second = (theirs, f"a client's batch padded to {n} samples"), (mine, f"its {k} real ones")
        if argument:
            what = f"updates the torchmetrics metric {metric!r} ({argument}) with "
        else:
            what = "makes a different number of torchmetrics calls: "
        what += f"{first[0]} on {first[1]} but {second[0]} on {second[1]}"
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized': {type(self.model).__name__}.training_step {what}: an argument of a "
            "metric that is not one value per sample is replayed once per step for every client, with the value "
            "the batched step saw, so it must not depend on the batch (its size, a statistic of it). Update metrics "
            "with per-sample tensors (first dimension the batch) or the loss, or use client_execution='sequential' "
            "(or 'auto')"
        )

    def _check_per_sample_protocol(self, views: list[Tensor], batch: Any, mask: Tensor, step: int) -> bool:
        """Once per engine, before the protocol is first used. False if ``training_step`` calls a torchmetrics
        metric (one call on the first client's first sample, without gradients, random state restored): padded
        steps must then call ``training_step`` itself. Else ``training_step_per_sample(b)[j]`` must equal
        ``training_step`` on sample ``j`` alone (first client, its first two real samples, at the current weights,
        without gradients); skipped for models with random layers, whose two calls draw different random numbers.
        A mismatch raises ``ValueError`` naming both values (a protocol that disagrees with ``training_step`` would
        silently train another objective in vectorised mode)."""
        leaves, spec = tree_flatten(batch)
        row = [v[0].detach() for v in views]
        model_name = type(self.model).__name__
        device = row[0].device
        if self.metric_calls:
            self.metric_calls.begin(True)
            with self._checking(device), self._weights_in_slots(row):
                self.model.training_step(tree_unflatten([x[0, :1] for x in leaves], spec), step)
            calls = bool(self.metric_calls.calls)
            self.metric_calls.begin(False)
            self.collector.reset()
            if calls:
                return False
        if not self.deterministic:
            return True
        k = min(2, int(mask[0].sum()))
        with self._checking(device):
            per = self._per_sample_losses(row, tree_unflatten([x[0, :k] for x in leaves], spec), step, k)
            with self._weights_in_slots(row):
                alone = torch.stack(
                    [
                        extract_loss(
                            self.model.training_step(tree_unflatten([x[0, j : j + 1] for x in leaves], spec), step),
                            model_name,
                        ).reshape(())
                        for j in range(k)
                    ]
                )
        self.collector.reset()
        rtol, atol = _tolerance(self.dtype)
        if not torch.allclose(per.double(), alone.double(), rtol=rtol, atol=atol, equal_nan=True):
            raise ValueError(
                f"{model_name}.training_step_per_sample disagrees with training_step: per-sample losses "
                f"{per.tolist()} but training_step on each of those samples alone gives {alone.tolist()}. Its entry j "
                "must be training_step's loss on sample j alone; fix it, or remove it to let the vectorised engine "
                "call training_step once per sample"
            )
        return True

    @staticmethod
    def term_values(views: list[Tensor], terms: list[list[Callable]]) -> Tensor:
        """Σ of each client's objective terms, called on that client's parameter tensors (rows of the batch).

        Client objective terms without a batched form (a ``client_objective`` hook's plain callables) are called on
        the list of their client's parameter tensors (slices of the batched weights), so their gradients flow
        through the same backward pass (one Python call per client and term per evaluation); the terms with a
        batched form are :class:`_ClientTerms`' stacked ones."""
        values = []
        for c, client_terms in enumerate(terms):
            own = [v[c] for v in views]
            total = views[0].new_zeros(())
            for term in client_terms:
                total = total + term_value(term, own)
            values.append(total)
        return torch.stack(values)


#: The methods that define an :class:`~fedlightning.objectives.AnchoredTerm`'s value and gradient; a subclass that
#: overrides one computes another term than the closed form the engine stacks
_TERM_METHODS = ("__call__", "values_from_differences", "gradient", "value_and_gradient", "_mu_rows", "_rowwise")


def _own_term_methods(term: Any) -> list[str]:
    """The methods of :data:`_TERM_METHODS` that ``term``'s class overrides (empty for other objects)."""
    if not isinstance(term, AnchoredTerm):
        return []
    return [m for m in _TERM_METHODS if getattr(type(term), m) is not getattr(AnchoredTerm, m)]


def _stackable(term: Any) -> bool:
    """Whether ``term`` is a one-client :class:`~fedlightning.objectives.AnchoredTerm` whose value and gradient are
    AnchoredTerm's own (a subclass that only adds a constructor qualifies; one that overrides ``__call__`` or the
    gradient is evaluated client by client, as sequential training evaluates it)."""
    return isinstance(term, AnchoredTerm) and term.num_rows is None and not _own_term_methods(term)


class _ClientTerms:
    r"""The client-objective terms of one engine call's clients, stacked once per call.

    ``terms[c]`` is client ``c``'s list (the ``client_objective`` hooks' terms, in order). Its
    :class:`~fedlightning.objectives.AnchoredTerm`\ s are stacked into batched terms, one per position: the
    ``j``-th AnchoredTerm of every client that has at least ``j + 1`` of them (``layers``; a layer that misses
    some clients keeps the indices of its rows). Every other callable is ``plain``: evaluated client by client
    (:meth:`_ModelCall.term_values`). Stacking happens per call from the clients it receives, so any subset of a
    round's clients (a group of them) is stacked on its own.

    Decisions (ours): a stacked term is laid out as the engine's weights are, one flat ``[D]`` (shared) or
    ``[C, D]`` anchor and ``[C, D]`` directions in the storage order of ``W``
    (:class:`~fedlightning.vectorized.layout._WeightsLayout`), so that its value is two row-wise dot products over
    ``W − a`` and its gradient ``μ(W − a) + c`` is added to the backward pass's per-parameter gradients in place
    (:meth:`closed_form`), without an autograd graph: a handful of ``[C, D]`` operations per step, the value still
    entering the reported losses and the line search's tests. The closed form equals autograd's gradient of the
    term up to the order in which the gradient's parts are summed.
    """

    def __init__(self, terms: Sequence[Sequence[Callable]], weights: Any, dtype: torch.dtype, device: torch.device):
        C = len(terms)
        self.num_clients = C
        self.weights = weights
        stackable = [[t for t in ts if _stackable(t)] for ts in terms]
        plain = [[t for t in ts if not _stackable(t)] for ts in terms]
        self.plain: list[list[Callable]] | None = plain if any(plain) else None
        #: (rows: [R] indices or None for all clients, positions: [C] row of each client or -1, None for all,
        #: the batched term over the flat weights ``[R, D]``)
        self.layers: list[tuple[Tensor | None, Tensor | None, AnchoredTerm]] = []
        flat_anchors: list[tuple[AnchoredTerm, Tensor]] = []  # one flat copy per distinct anchor list

        def flat(tensors: Sequence[Tensor]) -> Tensor:  # in the parameters' own order
            return torch.cat([t.detach().reshape(-1) for t in tensors]).to(dtype=dtype, device=device)

        def stored_rows(rows: Tensor) -> Tensor:  # [R, D] from the parameters' own order to W's storage order
            if all(order is None for order in weights.orders):
                return rows
            parts = torch.split(rows, weights.numels, dim=1)
            return weights.flat([t.view(rows.shape[0], *shape) for t, shape in zip(parts, weights.shapes)])

        shapes = [tuple(shape) for shape in weights.shapes]

        def flat_term(term: AnchoredTerm) -> AnchoredTerm:
            if term.shapes != shapes:
                raise ValueError(
                    f"a client objective's AnchoredTerm is over parameters of shapes {term.shapes}, but the model's "
                    f"trainable parameters have shapes {shapes}"
                )
            anchor = next((a for other, a in flat_anchors if other.shares_anchors(term)), None)
            if anchor is None:
                anchor = flat(term.anchors)
                flat_anchors.append((term, anchor))
            directions = None if term.directions is None else [flat(term.directions)]
            return AnchoredTerm([anchor], mu=term.mu, directions=directions)

        for j in range(max((len(b) for b in stackable), default=0)):
            rows = [c for c in range(C) if len(stackable[c]) > j]
            term = AnchoredTerm.stack([flat_term(stackable[c][j]) for c in rows])
            term.anchors = [weights.stored(term.anchors[0]) if term.shared_anchors else stored_rows(term.anchors[0])]
            if term.directions is not None:
                term.directions = [stored_rows(term.directions[0])]
            if len(rows) == C:
                self.layers.append((None, None, term))
            else:
                index = torch.tensor(rows, dtype=torch.long, device=device)
                positions = torch.full((C,), -1, dtype=torch.long, device=device)
                positions[index] = torch.arange(len(rows), device=device)
                self.layers.append((index, positions, term))
        self._diff: tuple[Tensor, list[Tensor]] | None = None  # a reusable [C, D] buffer of W − a, and its views
        self._layer_views: dict[int, tuple[list[Tensor] | None, list[Any]]] = {}

    def plain_reason(self) -> str | None:
        """Why some terms are evaluated client by client (None when none is), naming the first such term."""
        if self.plain is None:
            return None
        term = next(t for ts in self.plain for t in ts)
        name = getattr(term, "__qualname__", None) or type(term).__qualname__
        own = _own_term_methods(term)
        why = (
            f"its class overrides AnchoredTerm.{own[0]}, so AnchoredTerm's closed form is not its gradient"
            if own
            else "it is not a fedlightning.objectives.AnchoredTerm"
        )
        return (
            f"client objective term {name} has no batched form ({why}): vectorized training evaluates it client by "
            "client at every step"
        )

    def _diff_buffer(self, W: Tensor) -> tuple[Tensor, list[Tensor]]:
        """A ``[C, D]`` buffer shaped as ``W`` and its per-parameter views (allocated once per engine call)."""
        if self._diff is None or self._diff[0].shape != W.shape:
            buf = torch.empty_like(W)
            self._diff = (buf, [v for v in self.weights.views(buf)])
        return self._diff

    def _views_of(self, i: int, term: AnchoredTerm, like: Sequence[Tensor]) -> tuple[list[Tensor] | None, list[Any]]:
        """Layer ``i``'s directions as per-parameter views and ``μ`` shaped to broadcast over each parameter's rows
        (cached per layer)."""
        cached = self._layer_views.get(i)
        if cached is None:
            directions = None if term.directions is None else list(self.weights.views(term.directions[0]))
            mu = term.mu
            mus = [mu.view(-1, *([1] * (v.dim() - 1))) if isinstance(mu, Tensor) else mu for v in like]
            cached = self._layer_views[i] = (directions, mus)
        return cached

    def closed_form(self, W: Tensor, grads: list[Tensor]) -> tuple[Tensor | None, list[Tensor]]:
        """The stacked terms' ``[C]`` values at the clients' weights ``W`` ([C, D], storage order; None without
        stacked terms) and ``grads`` (per-parameter ``[C, *shape]``, from the backward pass) with their
        closed-form gradients ``μ(W − a) + c`` added, in place where the gradient tensor allows it."""
        total = None
        grads = list(grads)
        for i, (index, _, term) in enumerate(self.layers):
            if index is not None:  # a layer of some of the clients: its rows gathered
                rows = W.index_select(0, index)
                value, (part,) = term.value_and_gradient([rows])
                for j, d in enumerate(self.weights.views(part)):
                    grads[j] = grads[j].index_add(0, index, d)
                value = value.new_zeros(self.num_clients).index_add_(0, index, value)
            else:
                buf, diffs = self._diff_buffer(W)
                d = torch.sub(W, term.anchors[0], out=buf)
                value = term.values_from_differences([d])
                directions, mus = self._views_of(i, term, diffs)
                for j, g in enumerate(grads):
                    if 0 in g.stride():  # an expanded gradient cannot be written in place
                        grads[j] = g.clone()
                if isinstance(term.mu, Tensor):
                    torch._foreach_addcmul_(grads, mus, diffs)
                elif term.mu != 0.0:
                    torch._foreach_add_(grads, diffs, alpha=term.mu)
                if directions is not None:
                    torch._foreach_add_(grads, directions)
            total = value if total is None else total + value
        return total, grads

    def values(self, W: Tensor, views: Sequence[Tensor], clients: Tensor | None = None) -> Tensor:
        """Σ of the terms of every row of ``W`` ([P, D], storage order; ``views`` its per-parameter views): the rows
        belong to the clients ``clients`` ([P] indices, repeats allowed: a line search's trial points), or row
        ``r`` to client ``r`` (None)."""
        P = W.shape[0]
        total = W.new_zeros(P)
        for index, positions, term in self.layers:
            if clients is None:
                if index is None:
                    total = total + term([W])
                else:
                    total = total.index_add(0, index, term([W.index_select(0, index)]))
            elif index is None:
                total = total + term.rows(clients)([W])
            else:
                rows = positions.index_select(0, clients)
                keep = (rows >= 0).nonzero().flatten()
                if len(keep):
                    own = term.rows(rows.index_select(0, keep))([W.index_select(0, keep)])
                    total = total.index_add(0, keep, own)
        if self.plain is not None:
            plain = self.plain if clients is None else [self.plain[i] for i in clients.tolist()]
            total = total + _ModelCall.term_values(list(views), plain)
        return total
