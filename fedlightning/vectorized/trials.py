r"""A line search's trial rows through the linear layers that read the clients' batches.

The batched Armijo search (:class:`~fedlightning.vectorized.rules._BatchedArmijo`) evaluates trial rows
``p = (c, η)``: client ``c``'s batch at the weights ``w_c − η g_c``. A linear layer whose input is the batch itself
(or a view of it: a model's first layer, after a flatten) gives on such a row

.. math::
    x_c (W_c - \eta G_c)^\top + (b_c - \eta\, g_{b,c}) = A_c - \eta B_c,
    \qquad A_c = x_c W_c^\top + b_c,\quad B_c = x_c G_c^\top + g_{b,c},

because its input does not depend on the weights. :class:`_LineTrials` computes ``A`` and ``B`` once per local step
(two batched products over the clients) and each trial row of the layer as one multiply-add of ``[n, out]``, instead
of an ``[n, in] × [in, out]`` product per row; every other layer, and anything else that reads the weights (a term
of the loss, a weight norm), still reads the trial points.

Decision (ours, measured): the layer's output is the exact value of the product at the trial point, rounded in
another order (the two products are rounded, then the multiply-add; the sequential search rounds the point first).
Float64 runs agree with sequential training to rounding, as before; in float32 an Armijo test that holds with near
equality may accept a neighbouring grid point, as the batched products already could
(docs/benchmarks.md §9 has the speed and the weight differences).

The points of parameters that only such layers read are then not needed: a trial call leaves their columns of
the ``[P, D]`` points unwritten (on the digits MLP, 8,320 of 9,610) and puts NaN in their parameter slots (one value,
expanded), so that anything else reading them (a weight penalty in ``training_step``, a tied layer) turns the trial
loss NaN. Which parameters qualify is learned from the step's gradient evaluation (a parameter some other linear layer
reads never does). Nor are the rows of the batch leaves those layers read (the digits batch, ``[P, n, 64]``): such a
call passes a buffer of NaN of their shape instead of gathering them (:meth:`_LineTrials.blank_leaves`). Decision
(ours): the round's first such call, and every call with a non-finite trial loss, is evaluated again with every point
written and every leaf gathered; a difference (a read that NaN does not reach, e.g. through a comparison ``w > 0``)
switches the leaves' leaving-out off for the engine from then on, and the points' too unless that call evaluated
with the points left out and the leaves gathered gives the same losses (``tests/test_line_trials.py`` has both kinds
of read, of the weights and of the batch). Client-objective terms read the points, so with terms every point is
written and every leaf gathered.

Where it applies (all checked per layer, per call; otherwise the layer runs its batched product): the layer's
weight (and bias, if any) are trial points' parameters, unchanged (not a parametrization of them); its input shares
storage with one of the trial call's batch tensors, with that tensor's row stride, each row's view inside its own
row (a view, a reshape, a slice of the batch); the batch tensor has the memory layout of the step's batch. A batch
the model transforms first (``x / 255``, a dropout on the input) is not a view, and its layer keeps the products.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .torch_internals import _linear_rows, _offer_linear_rows

__all__ = ["_LineTrials", "_TrialLine", "_same_losses", "_write_points"]


class _TrialLine(NamedTuple):
    """Where a trial call's points lie: point ``p`` is ``W[c] + neg_eta[p] · g[c]`` for its client ``c``."""

    W: Tensor  # [C, D], the clients' weights (fixed during the step's search)
    g: Tensor  # [C, D], their gradients
    neg_eta: Tensor  # [P], minus the step sizes, in W's dtype
    widths: list[int]  # pairs per client (the pairs sorted by client)
    #: parameters whose columns of the points were not written (:meth:`_LineTrials.skippable`)
    skipped: frozenset[int] = frozenset()


#: Device types whose trial points and rows are written one client block at a time (elsewhere: gathered rows).
_BLOCK_DEVICES = ("cpu",)

#: Largest column range of trial points (bytes, all pairs) that :func:`_write_points` gathers rather than writing
#: client block by client block on CPU, and largest trial rows of a layer that :meth:`_LineTrials.rows` gathers from
#: ``A`` and ``B`` (ours, measured: below it the three gathering kernels are faster; for rows of 28 × 128 float32,
#: 20 clients: 29 µs against 62 µs at 23 pairs, 69 against 86 at 74, 125 against 119 at 145).
_GATHER_BYTES = 1 << 20


def _key(t: Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def _write_points(
    points: Tensor,
    W: Tensor,
    g: Tensor,
    pair_client: Tensor,
    neg: Tensor,
    widths: list[int] | None,
    scratch: Callable[..., Tensor],
    columns: Sequence[tuple[int, int]] | None = None,
) -> Tensor:
    """``points[p, a:b] = W[c_p, a:b] + neg[p] · g[c_p, a:b]`` for the column ranges ``columns`` (None: all), with
    ``torch.addcmul``'s rounding (SgdArmijo's ``_foreach_add_(alpha=-η)``'s).

    On CPU, with ``widths`` (pairs per client, ``pair_client`` sorted by client), each client's block of pairs is
    one ``addcmul`` of its row of ``W`` and ``g`` broadcast against the block's ``[w, 1]`` step sizes: the points
    are written once instead of gathering ``W``'s and ``g``'s rows first (3 passes over ``[P, D]``), at the price
    of one kernel call per client: faster for large ``D``, slower for the smallest models (docs/benchmarks.md
    §3). A column range of at most :data:`_GATHER_BYTES` of points (the classifier head's 1,290 columns of the
    digits MLP, whose other columns trial calls leave out) is gathered instead: three kernels beat twenty there
    (83 µs instead of 153 µs for 80 pairs of 20 clients; per-client blocks again from 240 pairs). Both give the
    same values. On accelerators three large kernels beat one small kernel per client."""
    neg = neg.unsqueeze(1)
    by_client = widths is not None and W.device.type in _BLOCK_DEVICES
    if columns is None and not by_client:
        torch.index_select(W, 0, pair_client, out=points)
        g_rows = torch.index_select(g, 0, pair_client, out=scratch("g_rows", points.shape, W.dtype, W.device))
        return points.addcmul_(g_rows, neg)
    if by_client:
        clients = [c for c, w in enumerate(widths) if w]
        sizes = [widths[c] for c in clients]
    negs = None
    for a, b in [(0, W.shape[1])] if columns is None else columns:
        if not by_client or len(pair_client) * (b - a) * W.element_size() <= _GATHER_BYTES:  # gathered
            rows_w, rows_g = W[:, a:b].index_select(0, pair_client), g[:, a:b].index_select(0, pair_client)
            torch.addcmul(rows_w, neg, rows_g, out=points[:, a:b])
            continue
        negs = neg.split_with_sizes(sizes) if negs is None else negs
        # views made in a few calls, not per client: the loop runs one kernel per client
        W_rows, g_rows, blocks = W[:, a:b].unbind(0), g[:, a:b].unbind(0), points[:, a:b].split_with_sizes(sizes)
        for i, c in enumerate(clients):
            torch.addcmul(W_rows[c], negs[i], g_rows[c], out=blocks[i])
    return points


def _same_losses(a: Tensor, b: Tensor) -> bool:
    """Equal entry by entry, NaN equal to NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


class _LineTrials:
    """One local step's trial rows on the lines ``w_c − η g_c``: ``W_views`` are the per-parameter ``[C, *shape]``
    views of the clients' weights, ``client_leaves`` the step's batch leaves ``[C, n, ...]``, ``scratch`` the
    engine's reusable buffers (:meth:`~fedlightning.vectorized.engine.VectorizedClientTrainer.scratch`).

    :meth:`recording` wraps the step's gradient evaluation: the outputs ``A`` of the layers that read the batch are
    kept from it (the same computation, so the same values), and only ``B`` is computed for the search;
    :meth:`rows` wraps one trial call, once :meth:`set_gradients` has given ``g``."""

    def __init__(self, W_views: Sequence[Tensor], client_leaves: Sequence[Tensor], scratch: Callable[..., Tensor]):
        self.W_views = list(W_views)
        self.g_views: list[Tensor] | None = None
        self.client_leaves = list(client_leaves)
        self.scratch = scratch
        self._A: dict[tuple, Tensor] = {}  # (weight, bias, input view) -> A, [C, m, out]
        self._B: dict[tuple, Tensor] = {}
        self._rows_of: dict[tuple, tuple] = {}  # the clients' rows of A and B (_unbound)
        self._call: tuple | None = None
        self._slot_uses: dict[tuple, int] = {}  # buffers handed out in the current call (_linear)
        self._read_elsewhere: set[int] = set()  # parameters some layer not computed from A and B reads as well
        self._sentinels: dict[int, Tensor] = {}
        self.served = 0  # layer calls computed from A and B (tests and benchmarks read it)

    def set_gradients(self, g_views: Sequence[Tensor]) -> None:
        """The per-parameter ``[C, *shape]`` views of the clients' gradients at ``W``."""
        self.g_views = list(g_views)

    @contextlib.contextmanager
    def recording(self, weight_views: Sequence[Tensor]) -> Iterator[None]:
        """Within the block (the gradient evaluation at the weights ``weight_views``, per parameter ``[C, *shape]``
        tensors sharing ``W``'s storage), the outputs of linear layers that read the batch are kept as ``A``."""
        params = {_key(v): k for k, v in enumerate(weight_views)}

        def record(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
            key = self._layer(params, x, W, b, self.client_leaves)
            if key is None:
                self._read_elsewhere.update(params.get(_key(t)) for t in (W, b) if t is not None)
                return None
            y = _linear_rows(x, W, b)
            self._A[key] = y.detach().reshape(W.shape[0], -1, W.shape[1])
            return y

        with _offer_linear_rows(record):
            yield

    def skippable(self) -> frozenset[int]:
        """The parameters that only layers computed from ``A`` and ``B`` read in the gradient evaluation (weights and
        biases): a trial call needs none of their points (see :meth:`sentinel_views`)."""
        used = {k for key in self._A for k in key[:2] if k is not None}
        return frozenset(used - self._read_elsewhere)

    def blank_leaves(self) -> frozenset[int]:
        """The batch leaves (indices, floating point) that layers computed from ``A`` and ``B`` read: a trial call
        whose points leave out those layers' parameters (:meth:`skippable`) needs none of their rows either, and
        passes NaN rows of their shape instead of gathering them (:meth:`~fedlightning.vectorized.layout._Layout.rows`),
        so that anything else reading them turns the trial loss NaN."""
        return frozenset(key[2] for key in self._A if self.client_leaves[key[2]].is_floating_point())

    def sentinel_views(self, views: Sequence[Tensor], skipped: frozenset[int]) -> list[Tensor]:
        """``views`` with each parameter of ``skipped`` replaced by NaN of its shape (one value, expanded: no
        memory): where anything but a layer computed from ``A`` and ``B`` reads it, the trial loss turns NaN."""
        out = list(views)
        for k in skipped:
            v = views[k]
            nan = self._sentinels.get(k)
            if nan is None or nan.dtype != v.dtype or nan.device != v.device:
                nan = self._sentinels[k] = torch.full((1,) * v.dim(), float("nan"), dtype=v.dtype, device=v.device)
            out[k] = nan.expand(v.shape)
        return out

    @contextlib.contextmanager
    def rows(
        self, point_views: Sequence[Tensor], row_leaves: Sequence[Tensor], pair_client: Tensor, line: _TrialLine
    ) -> Iterator[None]:
        """Within the block, linear layers of the trial call whose rows are ``pair_client`` (``[P]`` client
        indices, ``line.widths`` per client) at the points ``point_views`` (per parameter ``[P, *shape]``) on the
        batch leaves ``row_leaves`` (``[P, n, ...]``) take ``A − η B``."""
        params = {_key(v): k for k, v in enumerate(point_views)}
        self._call = (params, list(row_leaves), pair_client, line.neg_eta, line.widths)
        self._slot_uses = {}
        try:
            with _offer_linear_rows(self._linear):
                yield
        finally:
            self._call = None

    def _layer(self, params: dict, x: Tensor, W: Tensor, b: Tensor | None, row_leaves: Sequence[Tensor]):
        """``(weight, bias, leaf, offset, shape, strides)``: the layer's parameters (indices of ``params``) and its
        input as a view into the rows of one of ``row_leaves``; None where the layer does not read the batch."""
        k = params.get(_key(W))
        kb = None if b is None else params.get(_key(b))
        if k is None or (b is not None and kb is None) or W.dim() != 3:
            return None
        source = self._source(x, row_leaves, W.shape[0])
        return None if source is None else (k, kb, *source)

    def _linear(self, x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
        params, row_leaves, pair_client, neg_eta, widths = self._call
        key = self._layer(params, x, W, b, row_leaves)
        if key is None or self.g_views is None:
            return None
        A, B = self._products(key)
        P = pair_client.shape[0]
        # the buffers are reused whatever the batch's shape (a padded batch's size changes from step to step, and
        # one set per shape would stay allocated): by layer, input and the use's number within the call
        uses = self._slot_uses
        slot = (*key[:4], uses.get(key[:4], 0))
        uses[key[:4]] = slot[-1] + 1
        rows = self.scratch(("line rows", slot), (P, *A.shape[1:]), A.dtype, A.device)
        neg = neg_eta.view(-1, 1, 1)
        if A.device.type in _BLOCK_DEVICES and rows.numel() * rows.element_size() > _GATHER_BYTES:
            # large calls on CPU: one multiply-add per client block, no gathered copies of A and B
            clients = [c for c, w in enumerate(widths) if w]
            sizes = [widths[c] for c in clients]
            A_rows, B_rows = self._unbound(key, A, B)
            for c, n, out in zip(clients, neg.split_with_sizes(sizes), rows.split_with_sizes(sizes)):
                torch.addcmul(A_rows[c], B_rows[c], n, out=out)
        else:  # accelerators, and CPU calls up to _GATHER_BYTES of rows: three kernels rather than one per client
            torch.index_select(A, 0, pair_client, out=rows)
            B_rows = self.scratch(("line B rows", slot), rows.shape, B.dtype, B.device)
            rows.addcmul_(torch.index_select(B, 0, pair_client, out=B_rows), neg)
        self.served += 1
        return rows.view(*x.shape[:-1], A.shape[-1])

    def _unbound(self, key: tuple, A: Tensor, B: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The clients' rows of ``A`` and ``B`` as views, made once per step."""
        out = self._rows_of.get(key)
        if out is None:
            out = self._rows_of[key] = (A.unbind(0), B.unbind(0))
        return out

    def _source(self, x: Tensor, row_leaves: Sequence[Tensor], R: int) -> tuple | None:
        """``(leaf index, offset, shape, strides)`` of ``x`` ([R, ..., in]) as a view into the rows of one of
        ``row_leaves``, the same view of every row; None when it is not one."""
        if x.dim() < 2 or x.shape[0] != R:
            return None
        for j, leaf in enumerate(row_leaves):
            client = self.client_leaves[j]
            if leaf.dtype != x.dtype or leaf.dim() < 1 or leaf.shape[0] != R:
                continue
            if leaf.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                continue
            row = leaf.stride(0)
            if x.stride(0) != row or client.stride() != leaf.stride() or client.shape[1:] != leaf.shape[1:]:
                return None
            offset = x.storage_offset() - leaf.storage_offset()
            if min(x.stride()) < 0 or offset < 0:
                return None
            extent = offset + sum((size - 1) * stride for size, stride in zip(x.shape[1:], x.stride()[1:]))
            if max(x.shape[1:], default=1) == 0 or extent >= row:
                return None
            return j, offset, tuple(x.shape[1:]), tuple(x.stride()[1:])
        return None

    def _products(self, key: tuple) -> tuple[Tensor, Tensor]:
        """``A = x W^T + b`` (kept from the gradient evaluation, else computed) and ``B = x G^T + g_b`` of every
        client, ``[C, m, out]``, through the same batched product as the layer itself."""
        A, B = self._A.get(key), self._B.get(key)
        if A is not None and B is not None:
            return A, B
        k, kb, j, offset, shape, strides = key
        client = self.client_leaves[j]
        C = client.shape[0]
        x = client.as_strided((C, *shape), (client.stride(0), *strides), client.storage_offset() + offset)
        if A is None:
            b = None if kb is None else self.W_views[kb]
            A = self._A[key] = _linear_rows(x, self.W_views[k], b).reshape(C, -1, self.W_views[k].shape[1])
        gb = None if kb is None else self.g_views[kb]
        B = self._B[key] = _linear_rows(x, self.g_views[k], gb).reshape(C, -1, self.g_views[k].shape[1])
        return A, B
