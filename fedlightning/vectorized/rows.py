r"""How a vmapped ``training_step`` call gives one value per client row: one class per path, with one signature.

:class:`~fedlightning.vectorized.call._ModelCall` owns the model's environment under vmap (parameter slots, the
log collector, normalisation layers, metric recording); the paths here run the model in it. Every path has
``values(views, batch, mask, step, want_cells, stats, effects, min_count)``, the arguments and results of
:meth:`~fedlightning.vectorized.call._ModelCall.row_values` (``stats`` the rows' running statistics already
selected). Whole rows (every client's batch full) take :class:`_WholeRows`. Padded rows (clients' batches of
unequal size) take one of three strategies, chosen once per engine, on its first padded step, by
:func:`choose_padded_rows`:

* :class:`_ProtocolRows`: the model's ``training_step_per_sample``, one call per row;
* :class:`_InterceptedRows`: per-sample loss interception (:mod:`fedlightning.vectorized.losses`), one
  ``training_step`` call per row on its whole padded batch;
* :class:`_SampleRows`: one ``training_step`` call per sample (an inner vmap), the path for any other model.

Decisions (ours): the choice is made once, by probes that run outside the paths
(:meth:`~fedlightning.vectorized.call._ModelCall._check_per_sample_protocol`,
:meth:`~fedlightning.vectorized.call._ModelCall._check_interception`), and a path never rewrites it. The one change
afterwards: loss interception raises :class:`InterceptionFailed` on a call it cannot run (a value it cannot split
per sample, a batched call that raises), and the caller then gives padded steps to :class:`_SampleRows` for the rest
of the engine's life (:func:`per_sample_fallback`), as the first probe would have. Work stays outside vmap where it
can: on padded steps the vmapped function returns every cell's value and the masked per-row sums are taken after
vmap (the same ops without batching rules); the per-sample ``unsqueeze`` is a view taken before vmap; logged
values leave vmap as they are and are detached, reshaped and cast outside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.client import extract_loss as _extract_loss

from .losses import LossInterception
from .support import VectorizationUnsupportedError
from .torch_internals import _is_batched, _rng_state, _set_rng_state, _vmap0, tree_flatten, tree_unflatten

__all__ = [
    "InterceptionFailed",
    "choose_padded_rows",
    "may_recheck_after",
    "recheck_intercepted_rows",
    "recheck_padded_rows",
    "extract_loss",
    "per_sample_fallback",
    "_InterceptedRows",
    "_ProtocolRows",
    "_SampleRows",
    "_WholeRows",
    "_info",
    "_unrecognised",
]


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


def _info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


class _ModuleTracker:
    """Remembers which module was executing when a batched call failed (to name the layer in the error)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stack: list[str] = []
        self.failed_in: str | None = None
        self.handles: list = []

    def __enter__(self) -> _ModuleTracker:
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


def _logged_value(value: Tensor, batch_dims: int) -> Tensor:
    """A logged one-element value as it left vmap (``[R, *shape]`` or ``[R, n_max, *shape]``), detached, with its
    one element per row / cell, as :func:`_as_logged` keeps it."""
    return _as_logged(value.detach().reshape(value.shape[:batch_dims]))


def _as_logged(value: Tensor) -> Tensor:
    """``value`` in the dtype its per-round mean is taken from: float32 and float64 values as they are (a sequential
    client's logged value keeps its dtype, and the round's mean is summed in float64:
    :meth:`~fedlightning._hooks._LogRouter.pop_means`), other dtypes (half precision, integers, bool) in float64,
    which holds each of their values exactly."""
    return value if value.dtype in (torch.float32, torch.float64) else value.double()


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row sums of ``values`` ([R, n_max]) over the cells ``mask`` marks real (padded cells count zero)."""
    return torch.where(mask, values, values.new_zeros(())).sum(1)


def _padded_result(cells: Tensor, mask: Tensor, as_loss: list[str], kept: list[tuple[str, Tensor]], want_cells: bool):
    """What a padded path returns, from the ``[R, n_max]`` per-sample losses ``cells``: ``(sums, logged)``, or
    ``(cells, sums, logged)`` with ``want_cells`` (``sums`` then computed from the detached cells). ``as_loss`` names
    values logged as the loss tensor itself (their sums are the loss sums, not computed twice); ``kept`` are the
    other logged ``[R, n_max]`` values."""
    sums = _masked_sum(cells.detach() if want_cells else cells, mask)
    logged = [(name, _as_logged(sums.detach())) for name in as_loss] + [(n, _masked_sum(v, mask)) for n, v in kept]
    return (cells, sums, logged) if want_cells else (sums, logged)


class _NotIntercepted(Exception):
    """Per-sample loss interception does not apply to this call (the message says why)."""


class InterceptionFailed(Exception):
    """Raised by :meth:`_InterceptedRows.values` for a call loss interception cannot run, after undoing what the
    attempt did (its random draws, the collector, ``effects``); ``reason`` says why. The caller then takes the
    per-sample path (:func:`per_sample_fallback`) for this call and every later one."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _unrecognised(what: str, interception: LossInterception) -> str:
    if interception.unrecognised:
        calls = ", ".join(sorted(set(interception.unrecognised)))
        return f"{what} is not a recognised mean loss (calls with other arguments or shapes: {calls})"
    return (
        f"{what} is not the output of a standard loss with reduction='mean' (F.cross_entropy, F.nll_loss, "
        "F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy[_with_logits] or their "
        "nn modules)"
    )


def _caller(call: Any, step: int, record: bool, min_count: int, sizes: list[int]) -> Callable:
    """``one_call(vs, st, b, rows, n=0)``: ``training_step(b, step)`` (``rows="padded"``: the model's
    ``training_step_per_sample`` on a padded batch of ``n``) with the parameter slots holding ``vs`` (as
    ``functional_call``) and the normalisation layers the running statistics ``st``; returns the loss, the logged
    values, the metric tensors and the new statistics, and writes the numbers of logged values and metric tensors
    into ``sizes``. ``call``: the :class:`~fedlightning.vectorized.call._ModelCall`."""
    model, collector, metric_calls, norms = call.model, call.collector, call.metric_calls, call.norms
    model_name = type(model).__name__

    def one_call(vs: Sequence[Tensor], st: Sequence[Tensor], b: Any, rows: str, n: int = 0):
        collector.reset(per_sample=rows == "padded")
        metric_calls.begin(record, rows, n)
        norms.begin(st, None, None, min_count)
        if rows == "padded":
            loss = call._per_sample_losses(vs, b, step, n)
        else:
            with call._weights_in_slots(vs):
                loss = extract_loss(model.training_step(b, step), model_name)
        outs = metric_calls.outputs()
        sizes[:] = [len(collector.values), len(outs)]
        return loss, list(collector.values), outs, norms.end()

    return one_call


class _TracedRows:
    """A path whose first call runs under a :class:`_ModuleTracker`, so that a layer ``vmap`` cannot run is reported
    by name (:class:`VectorizationUnsupportedError`); ``probed`` once that call succeeded. Subclasses give
    ``name`` and ``_vmapped`` (the batched call, made inside the model's vmap context)."""

    name = ""

    def __init__(self, call: Any):
        self.call = call  # the _ModelCall whose model runs
        self.probed = False
        #: a padded path's last call's ``[R, n_max]`` cells and logged values (name, ``[R, n_max]``), detached
        self.last_cells: tuple[Tensor, list[tuple[str, Tensor]]] | None = None

    def cells(self, views, batch, mask, step, stats, min_count) -> tuple[Tensor, list[tuple[str, Tensor]]]:
        """A padded path's ``[R, n_max]`` cells and logged values of a call without effects (no metric calls
        recorded, running statistics unchanged), detached: the per-sample side of
        :meth:`~fedlightning.vectorized.call._ModelCall._check_padded_means` where it computes them again."""
        self._vmapped(views, batch, mask, step, True, stats, None, min_count)
        return self.last_cells

    def values(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor | None,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        with call._vmap_context():
            if self.probed:
                return self._vmapped(views, batch, mask, step, want_cells, stats, effects, min_count)
            tracker = _ModuleTracker(call.model)
            try:
                with tracker:
                    out = self._vmapped(views, batch, mask, step, want_cells, stats, effects, min_count)
            except VectorizationUnsupportedError:
                raise
            except Exception as err:  # noqa: BLE001 - re-raised with the layer that failed
                where = tracker.failed_in or f"the model ({type(call.model).__name__})"
                hint = call.shared_write_hint(err)
                after = (
                    f": {hint}. Use client_execution='sequential' (or 'auto')"
                    if hint
                    else ". Use client_execution='sequential' (or 'auto' to fall back automatically); an error of the "
                    "data or the model itself (a target out of range) then names the client whose batch raises it"
                )
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' failed in {where} while running the clients under "
                    f"torch.func.vmap: {type(err).__name__}: {str(err).rstrip('.')}{after}"
                ) from err
            self.probed = True
            return out

    def _vmapped(self, views, batch, mask, step, want_cells, stats, effects, min_count):
        raise NotImplementedError


class _WholeRows(_TracedRows):
    """Whole rows: ``training_step`` on each row's batch, its loss per row."""

    name = "whole"

    def _vmapped(
        self,
        views: list[Tensor],
        batch: Any,
        mask: None,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        sizes = [0, 0]  # values logged, metric tensors: the outputs that follow the loss
        one_call = _caller(call, step, effects is not None, min_count, sizes)

        # flat positional arguments and outputs: vmap's argument handling is a pytree walk per call
        def per_row(*args):
            loss, logged, outs, new = one_call(
                args[:nv], args[nv : nv + ns], tree_unflatten(list(args[nv + ns :]), spec), "whole"
            )
            return (loss, *logged, *outs, *new)

        out = _vmap0(per_row, [*views, *stats, *leaves])
        nl, nm = sizes
        call._keep_effects(effects, out[1 + nl : 1 + nl + nm], out[1 + nl + nm :], None)
        return out[0], list(zip(list(call.collector.names), [_logged_value(v, 1) for v in out[1 : 1 + nl]]))


class _ProtocolRows(_TracedRows):
    """Padded rows through the model's per-sample protocol
    (:func:`~fedlightning.vectorized.support._per_sample_protocol`): one ``training_step_per_sample`` call per row
    on its whole padded batch, ``[n_max]`` losses; values it logs are ``[n_max]`` tensors (others are dropped)."""

    name = "per-sample protocol"
    reason = "the model's training_step_per_sample"

    def values(self, views, batch, mask, step, want_cells, stats, effects, min_count):
        """Decision (ours): a user's protocol is checked on every step that computes cells, as the per-sample path
        is (:class:`_SampleRows`): a ``training_step_per_sample`` that gives each sample's own mean (right sample by
        sample, so its once-per-engine check passes) next to a ``training_step`` that weighs the samples (a token
        mean over sequences of different lengths) would train another objective. The bundled models' protocols
        (``fedlightning.models``, checked by the test suite) are not checked again."""
        out = super().values(views, batch, mask, step, want_cells, stats, effects, min_count)
        if want_cells and not _bundled_protocol(self.call.model):
            refusal = self.call._check_padded_means(self, views, batch, mask, step, stats, min_count)
            if refusal is not None:
                raise _not_a_mean(self.call, "its training_step_per_sample losses", refusal)
        return out

    def _vmapped(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        n_max = mask.shape[1]
        sizes = [0, 0]
        one_call = _caller(call, step, effects is not None, min_count, sizes)
        as_loss: list[str] = []  # names logged with the loss tensor itself (Classifier's train/batch_loss)
        names: list[str] = []
        collector = call.collector

        def per_row_samples(*args):
            """``training_step_per_sample`` on the row's whole (padded) batch: ``[n_max]`` losses."""
            losses, logged, outs, new = one_call(
                args[:nv], args[nv : nv + ns], tree_unflatten(list(args[nv + ns :]), spec), "padded", n_max
            )
            own = [(n, v) for n, v in zip(collector.names, logged) if v is not losses]
            as_loss[:] = [n for n, v in zip(collector.names, logged) if v is losses]
            names[:] = [n for n, _ in own]
            sizes[0] = len(own)
            return (losses, *[v for _, v in own], *outs, *new)

        out = _vmap0(per_row_samples, [*views, *stats, *leaves])
        collector.reset()
        nl, nm = sizes
        call._keep_effects(effects, out[1 + nl : 1 + nl + nm], out[1 + nl + nm :], mask)
        # values logged with another length than the batch have no per-sample meaning: dropped
        shape = tuple(mask.shape)
        kept = [(name, _as_logged(v.detach())) for name, v in zip(names, out[1 : 1 + nl]) if tuple(v.shape) == shape]
        self.last_cells = (out[0].detach(), kept)
        return _padded_result(out[0], mask, as_loss, kept, want_cells)


class _SampleRows(_TracedRows):
    """Padded rows through one ``training_step`` call per sample (an inner vmap over the row's cells, each a batch of
    one): the path for any model, and the only one that cannot restrict batch statistics (BatchNorm in training
    mode) to a client's real samples, so such layers are refused here. ``reason``: why padded steps take it.

    Decisions (ours): the check that the loss is a mean over samples (``_check_sample_mean``, on a probe of samples
    from every client and on each client's two halves) runs on the path's first call of each round. Every call that
    computes a step's cells (a local step's gradient evaluation, a full-gradient phase; not a line search's trial
    calls, which evaluate the same batch at other weights) is also checked on its own rows
    (:meth:`~fedlightning.vectorized.call._ModelCall._check_padded_means`): each row's ``training_step`` loss on its
    whole padded batch must equal the mean of its cells (the padding repeats the row's own samples, so a mean over
    samples gives the same value either way), and so must every logged value. A loss whose per-sample weights vary
    within a client's batch (a token-weighted mean over sequences with different numbers of ignored targets, a mean
    weighted by class or by an input) fails it on the first step where they vary, whatever the earlier steps held, so
    it is refused there (``"auto"`` trains the rest sequentially), never trained as a mean of per-sample means. The
    check costs one batched ``training_step`` call without gradients per such step (two for models with random
    layers or under autocast, whose check computes the cells again in eval mode and full precision)."""

    name = "per-sample"

    def __init__(self, call: Any, reason: str):
        super().__init__(call)
        self.reason = reason
        self.checked = False  # the loss is a mean over samples (_ModelCall._check_sample_mean), on the first call

    def values(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor | None,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        mixing = self.call.norms.batch_dependent()
        if mixing:
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized': {', '.join(mixing)} computes statistics over a client's "
                "batch, which padded steps (clients' batches of unequal size) can only restrict to the "
                "client's real samples through loss interception, and it does not apply to "
                f"{type(self.call.model).__name__} ({self.reason}); return a standard mean loss "
                "(e.g. F.cross_entropy) from training_step, or use client_execution='sequential' (or 'auto')"
            )
        how = f"one training_step per sample ({self.reason})"
        if not self.checked:
            with self.call._vmap_context():
                refusal = self.call._check_sample_mean(views, batch, mask, step, stats, halves=True)
                if refusal is None:
                    self.call._check_metric_arguments(views, batch, mask, step, stats, alone=True)
            if refusal is not None:
                raise _not_a_mean(self.call, how, refusal)
            self.checked = True
        out = super().values(views, batch, mask, step, want_cells, stats, effects, min_count)
        if want_cells:
            refusal = self.call._check_padded_means(self, views, batch, mask, step, stats, min_count)
            if refusal is not None:
                raise _not_a_mean(self.call, how, refusal)
        return out

    def _vmapped(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        sizes = [0, 0]
        one_call = _caller(call, step, effects is not None, min_count, sizes)

        def per_row_cells(*args):
            vs, st = args[:nv], args[nv : nv + ns]

            def per_sample(*sample_leaves):  # a batch of one sample: [1, ...] each
                loss, logged, outs, _ = one_call(vs, st, tree_unflatten(list(sample_leaves), spec), "cell")
                return (loss, *logged, *outs)

            return _vmap0(per_sample, args[nv + ns :])

        # [R, n_max, 1, ...]: every cell a batch of one (the unsqueeze outside vmap is a plain view)
        cells = _vmap0(per_row_cells, [*views, *stats, *(x.unsqueeze(2) for x in leaves)])
        nl, nm = sizes
        call._keep_effects(effects, cells[1 + nl : 1 + nl + nm], None, mask)
        # [R, n_max] values of every cell; padded cells (repeated samples) count zero. The masked sums run
        # outside vmap (the same ops on the same [R, n_max] tensors, without their batching rules)
        kept = list(zip(list(call.collector.names), [_logged_value(v, 2) for v in cells[1 : 1 + nl]]))
        self.last_cells = (cells[0].detach(), kept)
        return _padded_result(cells[0], mask, [], kept, want_cells)


class _InterceptedRows:
    """Padded rows through per-sample loss interception (:mod:`fedlightning.vectorized.losses`): one
    ``training_step`` call per row on its whole padded batch, the standard losses computed per sample and averaged
    over the row's real samples.

    Decisions (ours): ``training_step`` must return the output of an intercepted loss, and every value it logs must
    be one too or not depend on the client (a constant). A call where this fails, or whose batched call raises,
    raises :class:`InterceptionFailed` after restoring the random state the attempt started from, so the per-sample
    path computes exactly what it computes without this attempt. A :class:`VectorizationUnsupportedError` (a metric
    or layer the engine cannot run per client) is raised as it is: the per-sample path would refuse it too. The path
    is announced once (rank-zero info line), after its first call succeeded.
    """

    name = "loss interception"
    reason = "per-sample loss interception"

    def __init__(self, call: Any):
        self.call = call  # the _ModelCall whose model runs
        self.announced = False
        self._mask_terms: tuple[Tensor, int, tuple[Tensor, Tensor, Tensor]] | None = None

    def _row_terms(self, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(m, counts, weights)`` of a ``[R, n_max]`` mask of real cells: the mask in the parameters' dtype, the
        rows' counts and ``m / counts``; reused while the same mask tensor comes back unchanged (the steps of a
        round with the same sizes share their layout's mask; an in-place write bumps its version)."""
        hit = self._mask_terms
        if hit is not None and hit[0] is mask and hit[1] == mask._version:
            return hit[2]
        m = mask.to(self.call.dtype)
        counts = m.sum(1)
        terms = (m, counts, m / counts[:, None])
        self._mask_terms = (mask, mask._version, terms)
        return terms

    def values(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        devices = [views[0].device] if views[0].device.type == "cuda" else []
        rng = None if call.deterministic else _rng_state(devices)
        try:
            with call._vmap_context():
                out = self._vmapped(views, batch, mask, step, want_cells, stats, effects, min_count)
        except VectorizationUnsupportedError:
            call.collector.reset()
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the fast path: the per-sample path decides
            call.collector.reset()
            if rng is not None:
                _set_rng_state(rng, devices)
            if effects is not None:
                effects.stats = effects.metrics = None
            raise InterceptionFailed(
                str(err) if isinstance(err, _NotIntercepted) else f"{type(err).__name__}: {err}"
            ) from err
        if not self.announced:
            self.announced = True
            _info(
                f"client_execution='vectorized': padded steps of {type(call.model).__name__} compute its loss per "
                "sample by loss interception (one training_step call per client)"
            )
        return out

    def _vmapped(
        self,
        views: list[Tensor],
        batch: Any,
        mask: Tensor,
        step: int,
        want_cells: bool,
        stats: list[Tensor],
        effects: Any,
        min_count: int,
    ):
        call = self.call
        model, collector, metric_calls, norms = call.model, call.collector, call.metric_calls, call.norms
        model_name = type(model).__name__
        leaves, spec = tree_flatten(batch)
        nv, ns = len(views), len(stats)
        n_max = mask.shape[1]
        m, counts, weights = self._row_terms(mask)
        record = effects is not None
        as_loss: list[str] = []  # names logged with the loss tensor itself
        names: list[str] = []  # other logged values, returned as [n_max] cells
        sizes = [0, 0]

        def per_row(*args):
            vs, row_mask, count, row_weights = args[:nv], args[nv], args[nv + 1], args[nv + 2]
            st = args[nv + 3 : nv + 3 + ns]
            collector.reset()
            interception = LossInterception(n_max, row_mask, count, row_weights, flattened=call.deterministic)
            metric_calls.begin(record, "padded", n_max, interception)
            norms.begin(st, row_mask, count, min_count)
            with call._weights_in_slots(vs), interception:
                loss = extract_loss(
                    model.training_step(tree_unflatten(list(args[nv + 3 + ns :]), spec), step), model_name
                )
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
        call._keep_effects(effects, out[1 + nl : 1 + nl + nm], out[1 + nl + nm :], mask)
        kept = [(name, _as_logged(v.detach())) for name, v in zip(names, out[1 : 1 + nl])]
        return _padded_result(out[0], mask, list(as_loss), kept, want_cells)


def _bundled_protocol(model: Any) -> bool:
    """Whether the model's ``training_step`` and ``training_step_per_sample`` are both fedlightning's own (the bundled
    models of :mod:`fedlightning.models`)."""

    def owner(name: str) -> str:
        cls = next((c for c in type(model).__mro__ if name in c.__dict__), None)
        return "" if cls is None else cls.__module__

    return all(owner(n).startswith("fedlightning.") for n in ("training_step", "training_step_per_sample"))


def _not_a_mean(call: Any, how: str, refusal: str) -> VectorizationUnsupportedError:
    """The refusal of a model whose loss is not a mean over samples
    (:meth:`~fedlightning.vectorized.call._ModelCall._check_sample_mean`): padded steps average per-sample losses
    (``how``) over each client's real samples, which computes another objective for it."""
    return VectorizationUnsupportedError(
        f"client_execution='vectorized': padded steps (clients' batches of unequal size) average "
        f"{type(call.model).__name__}'s loss and logged values over each client's real samples, {how}, but "
        f"{refusal}. Return and log means over the batch from training_step, or use client_execution='sequential' "
        "(or 'auto')"
    )


def per_sample_fallback(call: Any, reason: str) -> _SampleRows:
    """The per-sample path for padded steps that loss interception cannot run (``reason``), announced once (rank-zero
    info line)."""
    _info(
        f"client_execution='vectorized': padded steps of {type(call.model).__name__} call training_step "
        f"once per sample ({reason})"
    )
    return _SampleRows(call, reason)


def _interception_refusal(
    call: Any, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor]
) -> str | None:
    """None if loss interception passes its check on this padded step
    (:meth:`~fedlightning.vectorized.call._ModelCall._check_interception`, run in the model's vmap context), else
    why not; a check that raises is a refusal with the error as its reason, except a
    :class:`VectorizationUnsupportedError`, raised as it is."""
    try:
        with call._vmap_context():
            return call._check_interception(views, batch, mask, step, stats)
    except VectorizationUnsupportedError:
        call.collector.reset()
        raise
    except Exception as err:  # noqa: BLE001 - the check failed to run: interception does not apply
        call.collector.reset()
        return f"{type(err).__name__}: {err}"


def may_recheck_after(call: Any, device: torch.device) -> bool:
    """Whether this round's check of the padded path (:func:`recheck_padded_rows`) can run on the step's own result
    (:func:`recheck_intercepted_rows`): loss interception on a model without random layers (whose check runs), outside
    autocast (where the step computes in the precision the check computes in)."""
    return (
        isinstance(call.padded_rows, _InterceptedRows)
        and call.deterministic
        and not torch.is_autocast_enabled(device.type)
    )


def recheck_intercepted_rows(
    call: Any, result: tuple, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor]
) -> bool:
    """:func:`recheck_padded_rows` for loss interception, after the step (``result``: its values;
    :meth:`~fedlightning.vectorized.call._ModelCall._recheck_interception`). True: the path stands and ``result`` is
    the step's; False: interception no longer matches and the per-sample path replaces it (as
    :func:`recheck_padded_rows` does), and the caller computes the step again on it. Decision (ours): the check
    compares the step's own intercepted loss with one ``training_step`` call on a client's real samples, where a
    check before the step costs two calls; a step whose check fails is computed again, so no step of a loss that no
    longer matches enters training."""
    try:
        with call._vmap_context():
            reason = call._recheck_interception(result, views, batch, mask, step, stats)
    except VectorizationUnsupportedError:
        call.collector.reset()
        raise
    except Exception as err:  # noqa: BLE001 - the check failed to run: interception does not apply
        call.collector.reset()
        reason = f"{type(err).__name__}: {err}"
    if reason is None:
        return True
    call.padded_rows = per_sample_fallback(call, f"at local step {step} of a later round: {reason}")
    return False


def recheck_padded_rows(call: Any, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor]):
    """The check of the padded path chosen in an earlier round (:func:`choose_padded_rows`), again on this round's
    first padded step. Decision (ours): a loss can pass on the step the path was chosen at and mix samples later (a
    batch-level term whose learnable gate starts at 0); rechecking once per round costs two or nine small
    ``training_step`` calls (one for loss interception checked on the step's own result,
    :func:`recheck_intercepted_rows`, which the caller runs instead where :func:`may_recheck_after`). Loss
    interception that no longer matches falls back to the per-sample path, whose first call checks that the loss is
    a mean over samples; that check and the protocol's raise
    :class:`VectorizationUnsupportedError` when it fails (``"auto"`` trains the rest of the run sequentially)."""
    path = call.padded_rows
    if isinstance(path, _InterceptedRows):
        if not call.deterministic:
            return
        reason = _interception_refusal(call, views, batch, mask, step, stats)
        if reason is not None:
            call.padded_rows = per_sample_fallback(call, f"at local step {step} of a later round: {reason}")
    elif isinstance(path, _SampleRows):
        path.checked = False
    elif isinstance(path, _ProtocolRows) and not call.norms.batch_dependent():
        with call._vmap_context():
            refusal = call._check_sample_mean(views, batch, mask, step, stats)
        if refusal is not None:
            raise _not_a_mean(call, "its training_step_per_sample losses", refusal)


def choose_padded_rows(
    call: Any, views: list[Tensor], batch: Any, mask: Tensor, step: int, stats: list[Tensor], intercept: bool = True
):
    """The path of the engine's padded steps, chosen on its first padded step (``views``, ``batch``, ``mask``,
    ``step``, ``stats`` are that step's), the first that applies:

    * :class:`_ProtocolRows` for a model with a per-sample protocol (``call.protocol``) that passes
      :meth:`~fedlightning.vectorized.call._ModelCall._check_per_sample_protocol` (False when ``training_step``
      calls a torchmetrics metric; a protocol that disagrees with ``training_step`` raises ``ValueError``), and
      whose loss is a mean over samples (``_check_sample_mean``; else :class:`VectorizationUnsupportedError`);
    * :class:`_InterceptedRows` when loss interception passes its check (:func:`_interception_refusal`; models with
      random layers skip the check and find out on their first call); its torchmetrics calls must then get the same
      arguments that are not one per sample on a padded row as on its real samples
      (:meth:`~fedlightning.vectorized.call._ModelCall._check_metric_arguments`; else
      :class:`VectorizationUnsupportedError`), as must the per-sample path's on a few samples and on one;
    * :class:`_SampleRows` otherwise (:func:`per_sample_fallback`), or at once, unannounced, with ``intercept=False``
      (the per-sample path pinned by the caller); its first call checks that the loss is a mean over samples
      (``_check_sample_mean``) and raises :class:`VectorizationUnsupportedError` when it is not (a summed loss, a
      forward pass that mixes samples).
    """
    if call.protocol is not None:
        with call._vmap_context():
            usable = call._check_per_sample_protocol(views, batch, mask, step)
            check = usable and not call.norms.batch_dependent()  # BatchNorm: no batches of one sample to compare
            refusal = call._check_sample_mean(views, batch, mask, step, stats) if check else None
        if refusal is not None:
            raise _not_a_mean(call, "its training_step_per_sample losses", refusal)
        if usable:
            return _ProtocolRows(call)
    if not intercept:
        return _SampleRows(call, "")
    reason = _interception_refusal(call, views, batch, mask, step, stats)
    if reason is None:
        with call._vmap_context():
            call._check_metric_arguments(views, batch, mask, step, stats, alone=False)
        return _InterceptedRows(call)
    return per_sample_fallback(call, reason)
