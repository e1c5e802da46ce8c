r"""The model's ``training_step`` run under vmap over client rows: one loss per row and the values it logged.

:class:`_ModelCall` puts each row's weights in the modules' parameter slots and calls ``training_step`` on the row's
batch; on padded steps (clients' batches of different sizes) each row's loss is the mean over its real samples,
from the model's ``training_step_per_sample``, from per-sample loss interception
(:mod:`fedlightning.vectorized.losses`) or from one ``training_step`` call per sample, the first that applies.
Normalisation layers run per client (:mod:`fedlightning.vectorized.norms`) and torchmetrics calls are recorded
(:mod:`fedlightning.vectorized.metrics`); a gradient evaluation's :class:`_Effects` carry both out of the call.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from fedlightning._logging_route import routed_logging
from fedlightning.client import extract_loss as _extract_loss

from .losses import LossInterception
from .metrics import _MetricCalls, _MetricStep, _metric_modules, _metric_types, _Pending
from .norms import _NormLayers
from .support import VectorizationUnsupportedError, _has_random_layers, _per_sample_protocol, _vmappable_rnns
from .torch_internals import (
    _is_batched,
    _linear_forward,
    _parameter_slots,
    _plain_linears,
    _rnn_forward,
    _rng_state,
    _set_rng_state,
    _shadowed_forwards,
    _tensors_in_slots,
    _vmap0,
    tree_flatten,
    tree_unflatten,
)


def extract_loss(output: Any, model_name: str) -> Tensor:
    """The loss of a ``training_step`` output (:func:`fedlightning.client.extract_loss`); ``None`` (Lightning's
    skipped step, which sequential training supports) is refused by name: a step that some clients skip and others
    take cannot be one batched computation, so ``"auto"`` trains such a module sequentially."""
    if output is None:
        raise VectorizationUnsupportedError(
            f"{model_name}.training_step returned None (Lightning's skipped step), which "
            "client_execution='vectorized' cannot run per client; use client_execution='sequential' (or 'auto')"
        )
    return _extract_loss(output, model_name)


class _LogCollector:
    """Stands in for ``model.log`` / ``model.log_dict`` while the model runs under ``vmap``.

    Values are collected as (batched) tensors and returned from the vmapped function as outputs, so they leave
    ``vmap`` as ordinary ``[C]`` tensors (the loop's router would otherwise keep tensors that escaped ``vmap``).
    Like the router, non-scalar values are ignored; torchmetrics metrics and the values they return go to the
    metric recorder (:class:`~fedlightning.vectorized.metrics._MetricCalls`).
    """

    def __init__(self, metrics: Optional[_MetricCalls] = None) -> None:
        self.names: List[str] = []
        self.values: List[Tensor] = []
        self.per_sample = False  # True while ``training_step_per_sample`` runs: only ``[n]`` values are kept
        self.metrics = metrics
        self.metric_types = _metric_types()

    def reset(self, per_sample: bool = False) -> None:
        self.names, self.values = [], []
        self.per_sample = per_sample

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, _Pending):
            if self.metrics is not None:
                self.metrics.log_value(name, value)
            return
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
            if self.metrics is not None and self.metric_types and isinstance(value, self.metric_types):
                self.metrics.log_metric(name, value)
            return
        if self.per_sample:  # one value per sample ([n]); anything else has no per-sample meaning
            if isinstance(value, Tensor) and value.dim() == 1:
                self._keep(name, value)
            return
        if isinstance(value, Tensor):
            if value.numel() != 1:
                return
            # returned from vmap as it is; detached, made a scalar and float32 outside (see _logged_value)
        else:
            value = torch.tensor(float(value))
        self._keep(name, value)

    def _keep(self, name: str, value: Tensor) -> None:
        if name in self.names:  # logged twice in one call: keep the last value, as a logger would
            self.values[self.names.index(name)] = value
        else:
            self.names.append(name)
            self.values.append(value)

    def log_dict(self, dictionary: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        for k, v in dictionary.items():
            self.log(k, v)


def _logged_value(value: Tensor, batch_dims: int) -> Tensor:
    """A logged one-element value as it left vmap (``[R, *shape]`` or ``[R, n_max, *shape]``), detached, with its
    one element per row / cell, as float32: what ``value.detach().reshape(()).float()`` gives inside vmap."""
    return value.detach().reshape(value.shape[:batch_dims]).float()


class _ModuleTracker:
    """Remembers which module was executing when a batched call failed (to name the layer in the error)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stack: List[str] = []
        self.failed_in: Optional[str] = None
        self.handles: list = []

    def __enter__(self) -> "_ModuleTracker":
        for name, module in self.model.named_modules():
            label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

            def pre(mod, args, label=label):
                self.stack.append(label)

            def post(mod, args, out, label=label):
                if self.stack:
                    self.stack.pop()

            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.stack:
            self.failed_in = self.stack[-1]
        for h in self.handles:
            h.remove()
        self.handles = []


class _Effects:
    """What a gradient evaluation's batched ``training_step`` call leaves besides losses and logged values: the
    rows' running statistics after it (``stats``, :class:`~fedlightning.vectorized.norms._NormLayers`; None when
    nothing changed them) and its recorded metric calls (``metrics``, a
    :class:`~fedlightning.vectorized.metrics._MetricStep`; None without metrics)."""

    def __init__(self) -> None:
        self.stats: Optional[List[Tensor]] = None
        self.metrics: Optional[_MetricStep] = None


def _tolerance(dtype: torch.dtype, device: torch.device) -> Tuple[float, float]:
    """``(rtol, atol)`` within which two computations of one loss on batches of different sizes must agree in the
    engine's checks (:meth:`_ModelCall._check_interception`, :meth:`_ModelCall._check_per_sample_protocol`; ours):
    half-precision parameters ("16-true", "bf16-true") 2e-2 / 2e-2; float32 where TF32 kernels may run
    (:func:`_tf32`) 1e-2 / 1e-3 (a torchvision ResNet-18 on an H100, cuDNN's default TF32 convolutions: 4e-4
    relative between a client's 12 samples alone and in a padded batch of 50); otherwise 1e-4 / 1e-6."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if _tf32(device):
        return 1e-2, 1e-3
    return 1e-4, 1e-6


def _tf32(device: torch.device) -> bool:
    """Whether float32 convolutions or matrix products on ``device`` may run in TF32 (10-bit mantissa): on CUDA,
    cuDNN's convolutions do by default (``torch.backends.cudnn.allow_tf32``), matrix products when
    ``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision`` allow it. Then the same
    samples in a batch of another size can give results that differ by ~1e-4 relative per layer (other kernels),
    which :meth:`_ModelCall._check_interception` must tolerate."""
    if device.type != "cuda":
        return False
    try:
        legacy = bool(torch.backends.cudnn.allow_tf32) or bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch refusing to read the legacy switches after the new fp32_precision API was used
        return True
    return legacy or torch.get_float32_matmul_precision() != "highest"


class _ModelCall:
    """The wrapped model's ``training_step`` on rows of client weights and batches, as one vmapped call.

    Each row's parameter tensors go straight into the modules' parameter slots (what ``functional_call`` does,
    without its per-call name resolution). While the model runs under vmap (:meth:`_vmap_context`) ``self.log``
    goes to a :class:`_LogCollector`, RNN layers run in plain tensor ops, normalisation layers run per client with
    the rows' running statistics and torchmetrics calls are recorded. :meth:`row_values` gives one loss per row; the
    first call of each path runs under a :class:`_ModuleTracker`, so a layer ``vmap`` cannot run is reported by name.

    Decisions (ours): work stays outside vmap where it can. On padded steps the vmapped function returns every
    cell's value and the masked per-client sums are taken after vmap (the same ops without batching rules); the
    per-sample ``unsqueeze`` is a view taken before vmap; logged values leave vmap as they are and are detached,
    reshaped and cast outside. The per-sample protocol is not used for models with BatchNorm (a sample's loss
    depends on the client's batch) nor for modules whose ``training_step`` calls a torchmetrics metric (the metric
    calls are ``training_step``'s; found by one call on a sample, once per engine): their padded steps go through
    loss interception, which calls ``training_step`` itself.
    """

    def __init__(self, model: nn.Module, named: Sequence[Tuple[str, Tensor]], dtype: torch.dtype):
        """``named``: the model's trainable parameters (name, Parameter), in the order of the rows' tensors;
        ``dtype``: theirs (one for all)."""
        self.model = model
        self.dtype = dtype
        self.param_slots = _parameter_slots(model, named)
        self.metric_calls = _MetricCalls(_metric_modules(model))
        self.collector = _LogCollector(self.metric_calls)
        self.norms = _NormLayers(model)
        self.per_sample_step = None if self.norms else _per_sample_protocol(model)
        # padded steps of a model without the protocol: per-sample loss interception (losses.py) while it is
        # recognised; None = not tried yet, True = in use, False = generic path (reason in padded_path_reason)
        self.intercept: Optional[bool] = None
        self.padded_path_reason = ""
        # layers computed another way under vmap: recurrent layers in plain tensor ops, linear layers batched
        self.forwards = [(m, _rnn_forward) for m in _vmappable_rnns(model)] + \
            [(m, _linear_forward) for m in _plain_linears(model)]
        self.deterministic = not _has_random_layers(model)
        self.probed: set = set()
        self._mask_terms: Optional[Tuple[Tensor, int, Tuple[Tensor, Tensor, Tensor]]] = None

    def _row_terms(self, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(m, counts, weights)`` of a ``[R, n_max]`` mask of real cells: the mask in the parameters' dtype, the
        rows' counts and ``m / counts``; reused while the same mask tensor comes back unchanged (the steps of a
        round with the same sizes share their layout's mask; an in-place write bumps its version)."""
        hit = self._mask_terms
        if hit is not None and hit[0] is mask and hit[1] == mask._version:
            return hit[2]
        m = mask.to(self.dtype)
        counts = m.sum(1)
        terms = (m, counts, m / counts[:, None])
        self._mask_terms = (mask, mask._version, terms)
        return terms

    @property
    def metric_modules(self) -> List[Tuple[str, nn.Module]]:
        return self.metric_calls.modules

    @contextmanager
    def _vmap_context(self):
        """While the model runs under vmap: ``self.log`` goes to the collector, RNN layers use
        :func:`~fedlightning.vectorized.torch_internals._rnn_forward`, linear layers
        :func:`~fedlightning.vectorized.torch_internals._batched_linear`, normalisation layers
        :class:`~fedlightning.vectorized.norms._NormLayers`, torchmetrics calls are recorded."""
        saved_metrics = self.metric_calls.install()
        self.norms.install()
        try:
            with routed_logging(self.model, self.collector.log, self.collector.log_dict), \
                    _shadowed_forwards(self.forwards):
                yield
        finally:
            self.metric_calls.uninstall(saved_metrics)
            self.norms.uninstall()
            self.metric_calls.begin(False)

    def row_values(self, views: List[Tensor], batch: Any, mask: Optional[Tensor], step: int, cells: bool = False,
                   clients: Optional[Tensor] = None, effects: Optional[_Effects] = None,
                   min_count: Optional[int] = None):
        """One value per row of a :class:`~fedlightning.vectorized.layout._Layout` batch at the row weights
        ``views`` ([R, ...] each), and the values the model logged (list of ``(name, [R] tensor)``): whole rows give
        ``training_step``'s loss of the row; cell rows (``mask`` given) give the sum of the per-sample losses of the
        row's real cells, or, with ``cells``, the ``[R, n_max]`` per-sample losses themselves (padded cells
        included; logged values are still the masked sums).

        ``clients``: the client of each row (None: row ``i`` is client ``i``), whose running statistics the rows
        use; ``effects``: filled with the call's new running statistics and metric calls (None: a trial or check
        evaluation, whose effects are dropped); ``min_count``: the smallest real batch of the rows (read from
        ``mask`` when not given).

        Cell rows take the first path that applies: the model's per-sample protocol (one
        ``training_step_per_sample`` call per row, :func:`~fedlightning.vectorized.support._per_sample_protocol`);
        per-sample loss interception (:meth:`_intercepted_row_values`); the generic path (one ``training_step``
        call per sample, an inner vmap)."""
        stats = self.norms.rows(clients) if self.norms.stats else []
        if mask is None:
            mode = "whole"
            min_count = tree_flatten(batch)[0][0].shape[1]
        else:
            if min_count is None:
                min_count = int(mask.sum(1).min()) if self.norms else 2
            if self.per_sample_step is not None:
                mode = "per-sample protocol"
            elif self.intercept is not False:
                return self._intercepted_row_values(views, batch, mask, step, cells, clients, stats, effects,
                                                   min_count)
            else:
                mode = "per-sample"
                mixing = self.norms.batch_dependent()
                if mixing:
                    raise VectorizationUnsupportedError(
                        f"client_execution='vectorized': {', '.join(mixing)} computes statistics over a client's "
                        "batch, which padded steps (clients' batches of unequal size) can only restrict to the "
                        "client's real samples through loss interception, and it does not apply to "
                        f"{type(self.model).__name__} ({self.padded_path_reason}); return a standard mean loss "
                        "(e.g. F.cross_entropy) from training_step, or use client_execution='sequential' (or 'auto')"
                    )
        with self._vmap_context():
            if mode == "per-sample protocol" and mode not in self.probed and \
                    not self._check_per_sample_protocol(views, batch, mask, step):
                self.per_sample_step = None  # training_step calls a metric: padded steps call training_step
                mode = ""
            elif mode in self.probed:
                return self._row_values_vmapped(views, batch, mask, step, cells, stats, effects, min_count)
            else:
                tracker = _ModuleTracker(self.model)  # first call of each mode: name the layer if vmap fails
                try:
                    with tracker:
                        out = self._row_values_vmapped(views, batch, mask, step, cells, stats, effects, min_count)
                except VectorizationUnsupportedError:
                    raise
                except Exception as err:  # noqa: BLE001 - re-raised with the layer that failed
                    where = tracker.failed_in or f"the model ({type(self.model).__name__})"
                    raise VectorizationUnsupportedError(
                        f"client_execution='vectorized' failed in {where} while running the clients under "
                        f"torch.func.vmap: {type(err).__name__}: {err}. Use client_execution='sequential' (or "
                        "'auto' to fall back automatically)"
                    ) from err
                self.probed.add(mode)
                return out
        return self._intercepted_row_values(views, batch, mask, step, cells, clients, stats, effects, min_count)

    def _row_values_vmapped(self, views: List[Tensor], batch: Any, mask: Optional[Tensor], step: int,
                            want_cells: bool, stats: List[Tensor], effects: Optional[_Effects], min_count: int):
        model, collector, metric_calls, norms = self.model, self.collector, self.metric_calls, self.norms
        model_name = type(model).__name__
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        record = effects is not None
        sizes = [0, 0]  # values logged, metric tensors: the outputs that follow the loss

        def one_call(vs: Sequence[Tensor], st: Sequence[Tensor], b: Any, rows: str, n: int = 0,
                     row_mask: Optional[Tensor] = None, count: Optional[Tensor] = None):
            """``training_step(b, step)`` with the parameter slots holding ``vs`` (as ``functional_call``) and the
            normalisation layers the running statistics ``st``."""
            collector.reset(per_sample=rows == "padded")
            metric_calls.begin(record, rows, n)
            norms.begin(st, row_mask, count, min_count)
            if rows == "padded":
                loss = self._per_sample_losses(vs, b, step, n)
            else:
                with self._weights_in_slots(vs):
                    loss = extract_loss(model.training_step(b, step), model_name)
            outs = metric_calls.outputs()
            sizes[:] = [len(collector.values), len(outs)]
            return loss, list(collector.values), outs, norms.end()

        # flat positional arguments and outputs: vmap's argument handling is a pytree walk per call
        if mask is None:
            def per_row(*args):
                loss, logged, outs, new = one_call(args[:nv], args[nv:nv + ns],
                                                   tree_unflatten(list(args[nv + ns:]), spec), "whole")
                return (loss, *logged, *outs, *new)

            out = _vmap0(per_row, [*views, *stats, *leaves])
            nl, nm = sizes
            self._keep_effects(effects, out[1 + nl:1 + nl + nm], out[1 + nl + nm:], None)
            return out[0], list(zip(list(collector.names), [_logged_value(v, 1) for v in out[1:1 + nl]]))
        if self.per_sample_step is not None:
            n_max = mask.shape[1]
            as_loss: List[str] = []  # names logged with the loss tensor itself (Classifier's train/batch_loss)
            names: List[str] = []

            def per_row_samples(*args):
                """``training_step_per_sample`` on the row's whole (padded) batch: ``[n_max]`` losses."""
                losses, logged, outs, new = one_call(args[:nv], args[nv:nv + ns],
                                                     tree_unflatten(list(args[nv + ns:]), spec), "padded", n_max)
                own = [(n, v) for n, v in zip(collector.names, logged) if v is not losses]
                as_loss[:] = [n for n, v in zip(collector.names, logged) if v is losses]
                names[:] = [n for n, _ in own]
                sizes[0] = len(own)
                return (losses, *[v for _, v in own], *outs, *new)

            out = _vmap0(per_row_samples, [*views, *stats, *leaves])
            collector.reset()
            nl, nm = sizes
            self._keep_effects(effects, out[1 + nl:1 + nl + nm], out[1 + nl + nm:], mask)
            # values logged with another length than the batch have no per-sample meaning: dropped
            kept = [(name, v.detach().float()) for name, v in zip(names, out[1:1 + nl])
                    if tuple(v.shape) == tuple(mask.shape)]
            return self._padded_result(out[0], mask, as_loss, kept, want_cells)

        def per_row_cells(*args):
            vs, st = args[:nv], args[nv:nv + ns]

            def per_sample(*sample_leaves):  # a batch of one sample: [1, ...] each
                loss, logged, outs, _ = one_call(vs, st, tree_unflatten(list(sample_leaves), spec), "cell")
                return (loss, *logged, *outs)

            return _vmap0(per_sample, args[nv + ns:])

        # [R, n_max, 1, ...]: every cell a batch of one (the unsqueeze outside vmap is a plain view)
        cells = _vmap0(per_row_cells, [*views, *stats, *(x.unsqueeze(2) for x in leaves)])
        nl, nm = sizes
        self._keep_effects(effects, cells[1 + nl:1 + nl + nm], None, mask)
        # [R, n_max] values of every cell; padded cells (repeated samples) count zero. The masked sums run
        # outside vmap (the same ops on the same [R, n_max] tensors, without their batching rules)
        kept = list(zip(list(collector.names), [_logged_value(v, 2) for v in cells[1:1 + nl]]))
        return self._padded_result(cells[0], mask, [], kept, want_cells)

    def _keep_effects(self, effects: Optional[_Effects], metric_outs: Sequence[Tensor],
                      stats: Optional[Sequence[Tensor]], mask: Optional[Tensor]) -> None:
        """Fill ``effects`` (if any) from a batched call's outputs: the rows' new running statistics (None: the
        path changes none) and the recorded metric calls (their real sample counts are the layout's)."""
        if effects is None:
            return
        if stats is not None and len(stats):
            effects.stats = list(stats)
        step = self.metric_calls.finish(metric_outs)
        if step is not None and step.calls:
            effects.metrics = step

    def _intercepted_row_values(self, views: List[Tensor], batch: Any, mask: Tensor, step: int, want_cells: bool,
                                clients: Optional[Tensor], stats: List[Tensor], effects: Optional[_Effects],
                                min_count: int):
        """:meth:`row_values` of padded rows through per-sample loss interception
        (:mod:`fedlightning.vectorized.losses`): one ``training_step`` call per row on its whole padded batch, the
        standard losses computed per sample and averaged over the row's real samples.

        Decisions (ours): it is used while it is recognised: ``training_step`` must return the output of an intercepted
        loss, and every value it logs must be one too or not depend on the client (a constant). On the first padded call
        of the engine, for models without random layers, the intercepted loss of the most padded row is checked against
        ``training_step`` on that row's real samples alone (a loss that is not a mean over samples, or a forward that
        mixes samples, fails it). If any of this fails, or the batched call raises, the engine uses the generic path
        (one ``training_step`` per sample) from then on, after restoring the random state the attempt started from, so
        the generic path computes exactly what it computes without this attempt. The path taken is logged once
        (rank-zero info line). A :class:`VectorizationUnsupportedError` (a metric or layer the engine cannot run per
        client) is raised as it is: the generic path would refuse it too.
        """
        devices = [views[0].device] if views[0].device.type == "cuda" else []
        rng = None if self.deterministic else _rng_state(devices)
        first = self.intercept is None
        try:
            with self._vmap_context():
                if first:
                    reason = self._check_interception(views, batch, mask, step, stats)
                    if reason is not None:
                        raise _NotIntercepted(reason)
                out = self._interception_vmapped(views, batch, mask, step, want_cells, stats, effects, min_count)
        except VectorizationUnsupportedError:
            self.collector.reset()
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the fast path: the generic path decides
            self.collector.reset()
            if rng is not None:
                _set_rng_state(rng, devices)
            self.intercept = False
            self.padded_path_reason = str(err) if isinstance(err, _NotIntercepted) else f"{type(err).__name__}: {err}"
            _info(f"client_execution='vectorized': padded steps of {type(self.model).__name__} call training_step "
                  f"once per sample ({self.padded_path_reason})")
            if effects is not None:
                effects.stats = effects.metrics = None
            return self.row_values(views, batch, mask, step, want_cells, clients, effects, min_count)
        if first:
            self.intercept = True
            self.padded_path_reason = "per-sample loss interception"
            _info(f"client_execution='vectorized': padded steps of {type(self.model).__name__} compute its loss per "
                  "sample by loss interception (one training_step call per client)")
        return out

    def _interception_vmapped(self, views: List[Tensor], batch: Any, mask: Tensor, step: int, want_cells: bool,
                              stats: List[Tensor], effects: Optional[_Effects], min_count: int):
        model, collector, metric_calls, norms = self.model, self.collector, self.metric_calls, self.norms
        model_name = type(model).__name__
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        n_max = mask.shape[1]
        m, counts, weights = self._row_terms(mask)
        record = effects is not None
        as_loss: List[str] = []  # names logged with the loss tensor itself
        names: List[str] = []  # other logged values, returned as [n_max] cells
        sizes = [0, 0]

        def per_row(*args):
            vs, row_mask, count, row_weights = args[:nv], args[nv], args[nv + 1], args[nv + 2]
            st = args[nv + 3:nv + 3 + ns]
            collector.reset()
            interception = LossInterception(n_max, row_mask, count, row_weights)
            metric_calls.begin(record, "padded", n_max, interception)
            norms.begin(st, row_mask, count, min_count)
            with self._weights_in_slots(vs), interception:
                loss = extract_loss(model.training_step(tree_unflatten(list(args[nv + 3 + ns:]), spec), step),
                                    model_name)
            new = norms.end()
            cells = interception.cells_of(loss)
            if cells is None:
                raise _NotIntercepted(_unrecognised("the loss training_step returns", interception))
            as_loss.clear()
            names.clear()
            logged = []
            for name, value in zip(collector.names, collector.values):
                own = interception.cells_of(value)
                if own is cells:
                    as_loss.append(name)
                    continue
                if own is None:
                    if _is_batched(value):
                        raise _NotIntercepted(_unrecognised(f"the value logged as {name!r}", interception))
                    own = row_mask * 0 + value.detach().reshape(())  # a constant: the same value in every cell
                names.append(name)
                logged.append(own)
            outs = metric_calls.outputs()
            sizes[:] = [len(logged), len(outs)]
            return (cells, *logged, *outs, *new)

        out = _vmap0(per_row, [*views, m, counts, weights, *stats, *leaves])
        collector.reset()
        nl, nm = sizes
        self._keep_effects(effects, out[1 + nl:1 + nl + nm], out[1 + nl + nm:], mask)
        kept = [(name, v.detach().float()) for name, v in zip(names, out[1:1 + nl])]
        return self._padded_result(out[0], mask, list(as_loss), kept, want_cells)

    def _check_interception(self, views: List[Tensor], batch: Any, mask: Tensor, step: int,
                            stats: List[Tensor]) -> Optional[str]:
        """None if the intercepted loss of a padded row (see below) equals ``training_step`` on its real samples alone
        (at the row's weights and running statistics, without gradients, in full precision), else the reason it does
        not. Skipped (None) for models with random layers, whose two calls draw different random numbers."""
        if not self.deterministic:
            return None
        leaves, spec = tree_flatten(batch)
        counts = mask.sum(1).tolist()
        n_max = mask.shape[1]
        # the most padded row of at least two samples (BatchNorm fails a batch of one value per channel) whose
        # padding is not whole copies of its batch (such copies keep batch means, which would hide a forward pass
        # that mixes samples), else the most padded row
        r = min(range(len(counts)), key=lambda i: (counts[i] < 2, n_max % counts[i] == 0, counts[i]))
        k = int(counts[r])
        row = [v[r].detach() for v in views]
        row_stats = [s[r] for s in stats]
        model_name = type(self.model).__name__
        try:
            full_precision = torch.autocast(device_type=row[0].device.type, enabled=False)
        except RuntimeError:  # a device type autocast does not know
            full_precision = contextlib.nullcontext()
        self.metric_calls.begin(False)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), full_precision, self._weights_in_slots(row):
            row_mask = mask[r].to(self.dtype)
            interception = LossInterception(n_max, row_mask, row_mask.sum())
            self.norms.begin(row_stats, row_mask, row_mask.sum(), k)
            with interception:
                padded = extract_loss(self.model.training_step(tree_unflatten([x[r] for x in leaves], spec), step),
                                      model_name)
            if interception.cells_of(padded) is None:
                self.collector.reset()
                self.norms.end()
                return _unrecognised("the loss training_step returns", interception)
            self.norms.begin(row_stats, None, None, k)
            real = extract_loss(self.model.training_step(tree_unflatten([x[r, :k] for x in leaves], spec), step),
                                model_name)
            self.norms.end()
        self.collector.reset()
        rtol, atol = _tolerance(self.dtype, row[0].device)
        if not torch.allclose(padded.double(), real.double(), rtol=rtol, atol=atol, equal_nan=True):
            return (f"its loss on a client's {k} real samples is {float(real):.6g} but the per-sample interception "
                    f"on the padded batch of {n_max} gives {float(padded):.6g}: the loss is not a mean of per-sample "
                    "losses, or the forward pass mixes samples")
        return None

    @staticmethod
    def _padded_result(cells: Tensor, mask: Tensor, as_loss: List[str], kept: List[Tuple[str, Tensor]],
                       want_cells: bool):
        """What :meth:`row_values` returns for padded rows, from the ``[R, n_max]`` per-sample losses ``cells``:
        ``(sums, logged)``, or ``(cells, sums, logged)`` with ``want_cells`` (``sums`` then computed from the
        detached cells). ``as_loss`` names values logged as the loss tensor itself (their sums are the loss sums,
        not computed twice); ``kept`` are the other logged ``[R, n_max]`` values."""
        sums = _masked_sum(cells.detach() if want_cells else cells, mask)
        logged = [(name, sums.detach().float()) for name in as_loss] + [(n, _masked_sum(v, mask)) for n, v in kept]
        return (cells, sums, logged) if want_cells else (sums, logged)


    def _weights_in_slots(self, vs: Sequence[Tensor]):
        """The modules' parameter slots hold ``vs`` (one tensor per trainable parameter, a row's weights) inside
        the block, their Parameters again afterwards."""
        return _tensors_in_slots(self.param_slots, vs)

    def _per_sample_losses(self, vs: Sequence[Tensor], batch: Any, step: int, n: int) -> Tensor:
        """``model.training_step_per_sample(batch, step)`` with the parameter slots holding ``vs``; checked to be a
        tensor of ``n`` losses."""
        with self._weights_in_slots(vs):
            losses = self.per_sample_step(batch, step)
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (n,):
            got = f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"{type(self.model).__name__}.training_step_per_sample must return one loss per sample (a tensor of "
                f"shape ({n},) for a batch of {n}), got {got}"
            )
        return losses

    def _check_per_sample_protocol(self, views: List[Tensor], batch: Any, mask: Tensor, step: int) -> bool:
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
        # in the parameters' own dtype, without autocast: mixed precision would make two correct computations
        # differ by more than rounding (the same matrix product on batches of different shapes)
        try:
            full_precision = torch.autocast(device_type=row[0].device.type, enabled=False)
        except RuntimeError:  # a device type autocast does not know
            full_precision = contextlib.nullcontext()
        if self.metric_calls:
            devices = [row[0].device] if row[0].device.type == "cuda" else []
            self.metric_calls.begin(True)
            with torch.no_grad(), torch.random.fork_rng(devices=devices), full_precision, \
                    self._weights_in_slots(row):
                self.model.training_step(tree_unflatten([x[0, :1] for x in leaves], spec), step)
            calls = bool(self.metric_calls.calls)
            self.metric_calls.begin(False)
            self.collector.reset()
            if calls:
                return False
        if not self.deterministic:
            return True
        k = min(2, int(mask[0].sum()))
        with torch.no_grad(), torch.random.fork_rng(devices=[]), full_precision:
            per = self._per_sample_losses(row, tree_unflatten([x[0, :k] for x in leaves], spec), step, k)
            with self._weights_in_slots(row):
                alone = torch.stack([
                    extract_loss(self.model.training_step(tree_unflatten([x[0, j:j + 1] for x in leaves], spec), step),
                                 model_name).reshape(())
                    for j in range(k)
                ])
        self.collector.reset()
        rtol, atol = _tolerance(self.dtype, row[0].device)
        if not torch.allclose(per.double(), alone.double(), rtol=rtol, atol=atol, equal_nan=True):
            raise ValueError(
                f"{model_name}.training_step_per_sample disagrees with training_step: per-sample losses "
                f"{per.tolist()} but training_step on each of those samples alone gives {alone.tolist()}. Its entry j "
                "must be training_step's loss on sample j alone; fix it, or remove it to let the vectorised engine "
                "call training_step once per sample"
            )
        return True

    @staticmethod
    def term_values(views: List[Tensor], terms: List[List[Callable]]) -> Tensor:
        """Σ of each client's objective terms, called on that client's parameter tensors (rows of the batch).

        Client objective terms (``client_objective`` hooks, e.g. FedProx's proximal term) are called on the list of
        their client's parameter tensors (slices of the batched weights), so their gradients flow through the same
        backward pass (one Python call per client and term per evaluation)."""
        values = []
        for c, client_terms in enumerate(terms):
            own = [v[c] for v in views]
            total = views[0].new_zeros(())
            for term in client_terms:
                total = total + term(own).reshape(())
            values.append(total)
        return torch.stack(values)


class _NotIntercepted(Exception):
    """Per-sample loss interception does not apply to this call (the message says why)."""


def _unrecognised(what: str, interception: LossInterception) -> str:
    if interception.unrecognised:
        calls = ", ".join(sorted(set(interception.unrecognised)))
        return f"{what} is not a recognised mean loss (calls with other arguments or shapes: {calls})"
    return (f"{what} is not the output of a standard loss with reduction='mean' (F.cross_entropy, F.nll_loss, "
            "F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy[_with_logits] or their "
            "nn modules)")


def _info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row sums of ``values`` ([R, n_max]) over the cells ``mask`` marks real (padded cells count zero)."""
    return torch.where(mask, values, values.new_zeros(())).sum(1)
