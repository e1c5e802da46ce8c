"""Evaluating one local step of every client at once: losses and gradients (:class:`_StepEvaluator`), line-search
trial losses, and the values the model logged, handed to the loop's log router once per round (:func:`_feed_router`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from .call import _ClientTerms, _Effects, _ModelCall
from .layout import _Layout, _WeightsLayout
from .torch_internals import _rng_state, _set_rng_state, tree_flatten
from .trials import _LineTrials, _same_losses, _TrialLine, _write_points

__all__ = ["_StepEvaluator", "_feed_router"]


class _Engine(Protocol):
    """What a step evaluator uses of the round's engine
    (:class:`~fedlightning.vectorized.engine.VectorizedClientTrainer`, which builds the evaluators): a Protocol, so
    that this module, which the engine imports, does not import it."""

    weights: _WeightsLayout
    call: _ModelCall
    failed: Tensor | None
    skip_line_points: bool
    line_points_checked: bool

    @property
    def deterministic(self) -> bool: ...

    def fail_clients(self, rows: Tensor, singular: tuple[str, torch.Size]) -> None: ...

    def scratch(self, key: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor: ...


class _StepEvaluator:
    """Evaluates the clients' objectives on the current step's batches (laid out by :class:`_Layout`).

    ``gradient(W, alive)`` returns every client's loss ``[C]`` and gradient ``[C, D]`` at ``W`` ([C, D]): one vmapped
    forward, one backward. ``trial(points, clients)`` returns, under ``no_grad``, the losses of the clients
    ``clients`` ([P] indices, repeats allowed: several trial points of one client) at ``points`` ([P, D]), or of all
    clients in order (``clients=None``), after restoring the random state of the gradient evaluation; the latter
    draws exactly the random numbers of the gradient evaluation (same dropout masks, as the sequential optimizers
    do). ``finish()`` leaves the generator in the state the gradient evaluation left it in, so the number of trials
    does not change later randomness.

    A gradient evaluation also moves the running statistics of the clients it evaluates (those still training) and
    records its metric calls into ``metric_sink`` (with the step's real sample counts and the clients still
    training), replayed at the end of the round; trial evaluations change neither.
    """

    def __init__(
        self,
        engine: _Engine,
        layout: _Layout,
        step: int,
        terms: _ClientTerms | None,
        rng_devices: list,
        log_sink: list | None,
        trials: bool = True,
        metric_sink: list | None = None,
    ):
        self.engine, self.layout, self.step = engine, layout, step
        self.terms = terms
        self.rng_devices = rng_devices
        self.log_sink = log_sink
        self.metric_sink = metric_sink
        self.keep_effects = True  # False: the engine's layout probe (running statistics and metrics untouched)
        self.replay = trials  # keep the generator state of the gradient evaluation for trial evaluations
        self.rng_before = None
        self.rng_after = None
        self.trials = 0
        self.learn_layout = False  # set by the engine's layout probe
        self.track_alive = True  # False: every client trains every step (logged values need no mask)
        self.line_trials: _LineTrials | None = None  # the step's trial rows on lines (trial(line=...))
        self._arange: Tensor | None = None
        self._columns: tuple[frozenset[int], list[tuple[int, int]] | None] | None = None  # trial_columns, per step
        #: called with the indices and names of the parameters that got no gradient (the rule's
        #: :meth:`~fedlightning.vectorized.rules.BatchedRule.check_missing_gradients`; None: not checked)
        self.missing_gradients: Callable[[list[int], list[str]], None] | None = None

    def gradient(self, W: Tensor, alive: Tensor, flat: bool = True) -> tuple[Tensor, Any]:
        """Losses ``[C]`` and gradients at ``W``: one ``[C, D]`` tensor (``flat``), or the list of per-parameter
        ``[C, *shape]`` gradients (no concatenation; a parameter the loss does not depend on gets zeros)."""
        if self.replay:
            self.rng_before = _rng_state(self.rng_devices)
        layout, engine = self.layout, self.engine
        # one leaf per parameter (views of W's storage): their gradients come out separately, so the backward pass
        # does not concatenate them into a [C, D] tensor unless the optimizer needs one
        leaves = [v.detach().requires_grad_(True) for v in engine.weights.views(W)]
        effects = _Effects() if self.keep_effects else None
        norms = engine.call.norms
        if norms:
            norms.singular = None
        recording = contextlib.nullcontext()
        if self.replay:  # a line search follows: keep the outputs of the layers that read the batch (_LineTrials)
            self.line_trials = _LineTrials(engine.weights.views(W), layout.leaves, engine.scratch)
            recording = self.line_trials.recording(leaves)
        with torch.enable_grad(), recording:
            if layout.mask is None:
                losses, logged = engine.call.row_values(leaves, layout.batch, None, self.step, effects=effects)
                roots, seeds = [losses], [None]
            else:
                # padded rows: the loss of client i is Σ_j m_ij ℓ_ij / n_i (its real cells' mean); the backward pass
                # starts at the cells ℓ with the gradient m_ij · fl(1/n_i), the one the masked sum, the division and
                # the sum over clients give (bit for bit), without building those nodes; the reported losses are
                # computed from the detached cells
                cells, values, logged = engine.call.row_values(
                    leaves, layout.batch, layout.mask, self.step, cells=True, effects=effects, min_count=layout.min_size
                )
                losses = values / layout.counts_as(values.dtype)
                roots, seeds = [cells], [layout.cell_weights(cells.dtype)]
            if self.terms is not None and self.terms.plain is not None:  # terms without a batched form: autograd
                terms = engine.call.term_values(leaves, self.terms.plain)
                losses = losses + terms
                if terms.requires_grad:  # not when every term is a constant (a number, a tensor of no parameter)
                    roots.append(terms)
                    seeds.append(None)
            seeds = [torch.ones_like(r) if g is None else g for r, g in zip(roots, seeds)]
            grads = torch.autograd.grad(roots, leaves, grad_outputs=seeds, allow_unused=True)
        # an AnchoredTerm (proximal, control variates) reads every parameter: with stacked terms, as sequentially,
        # no parameter is without a gradient
        stacked = self.terms is not None and bool(self.terms.layers)
        missing = [] if stacked else [k for k, g in enumerate(grads) if g is None]
        if self.missing_gradients is not None:  # also without missing ones: the rule notes which had a gradient
            self.missing_gradients(missing, engine.param_names)
        grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]
        if self.terms is not None and self.terms.layers:  # stacked terms: values and closed-form gradients
            values, grads = self.terms.closed_form(W, grads)
            losses = losses + values
        evaluated = alive if self.track_alive else None
        if effects is not None and norms and norms.singular is not None:
            engine.fail_clients(self._one_sample_rows(alive), norms.singular)
        if engine.failed is not None:  # clients that raised (this step or before) are no longer evaluated
            evaluated = (alive if evaluated is None else evaluated) & ~engine.failed
        if effects is not None:
            if effects.stats is not None:
                engine.call.norms.write(effects.stats, evaluated)
            if effects.metrics is not None and self.metric_sink is not None:
                effects.metrics.counts = layout.sizes if layout.mask is not None else None
                effects.metrics.alive = evaluated
                self.metric_sink.append(effects.metrics)
        if self.log_sink is not None and logged:
            # per-client sums over real samples on padded steps: divided by the counts at the end of the round
            self.log_sink.append(([(name, v.detach()) for name, v in logged], layout.counts, evaluated))
        if self.learn_layout:
            engine.weights.learn(grads)
        if flat:
            return losses.detach(), engine.weights.flat(grads)
        return losses.detach(), grads

    def _one_sample_rows(self, alive: Tensor) -> Tensor:
        """``[C]`` bool: the clients still training whose batch at this step holds one sample."""
        one = torch.tensor([n == 1 for n in self.layout.sizes], dtype=torch.bool, device=alive.device)
        return one & alive

    def views(self, W: Tensor) -> list[Tensor]:
        """The per-parameter views ``[R, *shape]`` of ``W`` ([R, D])."""
        return self.engine.weights.views(W)

    @property
    def deterministic(self) -> bool:
        """The model has no random layers (dropout)."""
        return self.engine.deterministic

    def trial(self, points: Tensor, clients: Tensor | None = None, line: _TrialLine | None = None) -> Tensor:
        """Losses at ``points`` ([P, D]) of the clients ``clients`` ([P] indices sorted by client, repeats
        allowed), or of every client in order (``clients=None``, ``P = C``).

        ``line``: given when every point lies on its client's line ``W[c] + neg_eta[p] · g[c]`` (``W`` and ``g``
        fixed for the step); linear layers that read the batch then compute their trial rows from two products per
        client and step (:class:`~fedlightning.vectorized.trials._LineTrials`)."""
        if self.rng_before is None:
            raise RuntimeError("trial() needs a gradient() evaluation made with trials=True first")
        if self.trials == 0:
            self.rng_after = _rng_state(self.rng_devices)
        self.trials += 1
        engine = self.engine
        skipped = line.skipped if line is not None else frozenset()
        if skipped and not engine.skip_line_points:  # switched off by an earlier call: the points in full
            self._fill_skipped(points, clients, line)
            skipped = frozenset()
        blank = frozenset()
        if skipped and clients is not None and engine.skip_line_leaves:
            blank = self.line_trials.blank_leaves()
        losses = self._evaluate(points, clients, line, skipped, blank)
        if skipped and (not engine.line_points_checked or not all(map(math.isfinite, losses.tolist()))):
            # the round's first such call, and any with a non-finite loss, again with the skipped points written and
            # the blank leaves gathered: a difference means something besides the layers computed from A and B reads
            # them (trials.py)
            engine.line_points_checked = True
            self._fill_skipped(points, clients, line)
            full = self._evaluate(points, clients, line, frozenset(), frozenset())
            if not _same_losses(full, losses):
                engine.skip_line_leaves = False
                # with blank leaves: the points' leaving-out alone (the leaves gathered) tells whether it is off too
                if not blank or not _same_losses(full, self._evaluate(points, clients, line, skipped)):
                    engine.skip_line_points = False
            losses = full
        return losses

    def _evaluate(
        self,
        points: Tensor,
        clients: Tensor | None,
        line: _TrialLine | None,
        skipped: frozenset[int],
        blank: frozenset[int] = frozenset(),
    ) -> Tensor:
        """One trial call (see :meth:`trial`); the parameters ``skipped`` read NaN
        (:meth:`~fedlightning.vectorized.trials._LineTrials.sentinel_views`), and so do the rows of the batch leaves
        ``blank`` (:meth:`~fedlightning.vectorized.layout._Layout.rows`)."""
        _set_rng_state(self.rng_before, self.rng_devices)
        layout, engine = self.layout, self.engine
        with torch.no_grad():
            if clients is None:
                batch, mask, counts = layout.batch, layout.mask, layout.counts
            else:
                batch, mask, counts = layout.rows(clients, engine.scratch, blank)
            views = engine.weights.views(points)
            rows = contextlib.nullcontext()
            if line is not None:
                trials = self._line_trials(line)
                if skipped:
                    views = trials.sentinel_views(views, skipped)
                pairs = self._all_clients(points) if clients is None else clients
                rows = trials.rows(views, tree_flatten(batch)[0], pairs, line)
            with rows:
                values, _ = engine.call.row_values(
                    views, batch, mask, self.step, clients=clients, min_count=layout.min_size
                )
            if counts is None:
                losses = values
            else:
                losses = values / (layout.counts_as(values.dtype) if clients is None else counts.to(values.dtype))
            if self.terms is not None:
                losses = losses + self.terms.values(points, views, clients)
        return losses

    def trial_columns(self) -> tuple[frozenset[int], list[tuple[int, int]] | None]:
        """``(skipped, columns)`` for the step's next trial call: the parameters whose trial points no layer needs
        (:meth:`~fedlightning.vectorized.trials._LineTrials.skippable`; none with client-objective terms, which
        read the points, or once the engine has switched skipping off) and the column ranges of ``[P, D]`` points
        the others take (None: all)."""
        trials = self.line_trials
        if trials is None or self.terms is not None or not self.engine.skip_line_points:
            return frozenset(), None
        if self._columns is None:  # fixed for the step once its gradient evaluation has run
            skipped = trials.skippable()
            kept = [k for k in range(len(self.engine.weights.numels)) if k not in skipped]
            self._columns = (skipped, self._column_ranges(kept)) if skipped else (frozenset(), None)
        return self._columns

    def _column_ranges(self, params) -> list[tuple[int, int]]:
        """The column ranges of ``[R, D]`` holding the parameters ``params`` (indices), adjacent ones merged."""
        numels = self.engine.weights.numels
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        ranges: list[tuple[int, int]] = []
        for k in sorted(params):
            a, b = offsets[k], offsets[k + 1]
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        return ranges

    def _fill_skipped(self, points: Tensor, clients: Tensor | None, line: _TrialLine) -> None:
        """Write the points of the parameters ``line.skipped``."""
        pairs = self._all_clients(points) if clients is None else clients
        columns = self._column_ranges(line.skipped)
        _write_points(points, line.W, line.g, pairs, line.neg_eta, line.widths, self.engine.scratch, columns)

    def _line_trials(self, line: _TrialLine) -> _LineTrials:
        """The step's :class:`_LineTrials`, made by its gradient evaluation at ``line.W`` (``W`` and ``g`` do not
        change during the step's search)."""
        trials = self.line_trials
        if trials.g_views is None:
            trials.set_gradients(self.engine.weights.views(line.g))
        return trials

    def _all_clients(self, points: Tensor) -> Tensor:
        if self._arange is None:
            self._arange = torch.arange(points.shape[0], device=points.device)
        return self._arange

    def finish(self) -> None:
        if self.rng_after is not None:
            _set_rng_state(self.rng_after, self.rng_devices)


def _feed_router(
    router,
    log_sink: list[tuple[list[tuple[str, Tensor]], Tensor | None, Tensor | None]],
    client_ids: Sequence[int],
) -> None:
    """Give the loop's log router one value per gradient evaluation of every client still training, as sequential
    training does (the router ignores a line search's trial evaluations, which run without gradients).

    Decisions (ours): ``self.log`` calls inside ``training_step`` are captured per client (per sample and averaged
    over real samples on padded steps; :class:`~fedlightning.vectorized.call._LogCollector`) at every gradient
    evaluation and fed to the router here, so ``client/<name>`` metrics are the per-round means of sequential mode.

    ``log_sink`` holds, per gradient evaluation, the logged ``[C]`` values (sums over real samples on padded steps),
    the sample counts to divide them by (None: whole batches) and the mask of clients still training (None: all);
    the values of all evaluations are divided and masked at once, in evaluation order, each tagged with its client
    (``client_ids``: the client of each row), so that the round can leave out a client it leaves out."""
    by_name: dict[str, list[tuple[Tensor, Tensor | None, Tensor | None]]] = {}
    for logged, counts, evaluated in log_sink:
        for name, values in logged:
            by_name.setdefault(name, []).append((values, counts, evaluated))
    clients = torch.tensor(list(client_ids), dtype=torch.long)
    for name, parts in by_name.items():
        # float64 where any evaluation logged float64 (a float64 run), else float32 (rows._as_logged)
        dtype = torch.float64 if any(v.dtype == torch.float64 for v, _, _ in parts) else torch.float32
        values = torch.stack([v.to(dtype) for v, _, _ in parts])  # [evaluations, C]
        if any(n is not None for _, n, _ in parts):
            ones = torch.ones(values.shape[1], dtype=torch.long, device=values.device)
            values = values / torch.stack([ones if n is None else n for _, n, _ in parts])  # x / 1 is exact
        owners = clients.expand(values.shape[0], -1)
        if any(e is not None for _, _, e in parts):
            everyone = torch.ones(values.shape[1], dtype=torch.bool, device=values.device)
            taken = torch.stack([everyone if e is None else e for _, _, e in parts])
            values, owners = values[taken], owners[taken.cpu()]
        router.capture_run(name, values.reshape(-1), owners.reshape(-1))  # one 1-d run of the round's values
