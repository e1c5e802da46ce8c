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

from .torch_internals import _offer_linear_rows

__all__ = ["_LineTrials", "_TrialLine"]


class _TrialLine(NamedTuple):
    """Where a trial call's points lie: point ``p`` is ``W[c] + neg_eta[p] · g[c]`` for its client ``c``."""

    W: Tensor  # [C, D], the clients' weights (fixed during the step's search)
    g: Tensor  # [C, D], their gradients
    neg_eta: Tensor  # [P], minus the step sizes, in W's dtype
    widths: list[int]  # pairs per client (the pairs sorted by client)


def _key(t: Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


class _LineTrials:
    """One local step's trial rows on the lines ``w_c − η g_c``: ``W_views`` / ``g_views`` are the per-parameter
    ``[C, *shape]`` views of the clients' weights and gradients, ``client_leaves`` the step's batch leaves
    ``[C, n, ...]``. :meth:`rows` wraps one trial call."""

    def __init__(
        self,
        W_views: Sequence[Tensor],
        g_views: Sequence[Tensor],
        client_leaves: Sequence[Tensor],
        scratch: Callable[..., Tensor],
    ):
        self.W_views, self.g_views = list(W_views), list(g_views)
        self.client_leaves = list(client_leaves)
        self.scratch = scratch  # the engine's reusable buffers (VectorizedClientTrainer.scratch)
        self._products: dict[tuple, tuple[Tensor, Tensor]] = {}  # (weight, bias, input view) -> (A, B), [C, m, out]
        self._call: tuple | None = None
        self.served = 0  # layer calls computed from A and B (tests and benchmarks read it)

    @contextlib.contextmanager
    def rows(
        self, point_views: Sequence[Tensor], row_leaves: Sequence[Tensor], pair_client: Tensor, line: _TrialLine
    ) -> Iterator[None]:
        """Within the block, linear layers of the trial call whose rows are ``pair_client`` (``[P]`` client
        indices, ``line.widths`` per client) at the points ``point_views`` (per parameter ``[P, *shape]``) on the
        batch leaves ``row_leaves`` (``[P, n, ...]``) take ``A − η B``."""
        params = {_key(v): k for k, v in enumerate(point_views)}
        self._call = (params, list(row_leaves), pair_client, line.neg_eta, line.widths)
        try:
            with _offer_linear_rows(self._linear):
                yield
        finally:
            self._call = None

    def _linear(self, x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
        params, row_leaves, pair_client, neg_eta, widths = self._call
        k = params.get(_key(W))
        kb = None if b is None else params.get(_key(b))
        if k is None or (b is not None and kb is None) or W.dim() != 3:
            return None
        source = self._source(x, row_leaves, pair_client.shape[0])
        if source is None:
            return None
        key = (k, kb, *source)
        products = self._products.get(key)
        if products is None:
            products = self._products[key] = self._compute(k, kb, *source)
        A, B = products
        P = pair_client.shape[0]
        rows = self.scratch(("line rows", key), (P, *A.shape[1:]), A.dtype, A.device)
        neg = neg_eta.view(-1, 1, 1)
        if A.device.type == "cpu":  # one multiply-add per client block: no gathered copies of A and B
            start = 0
            for c, w in enumerate(widths):
                if w:
                    torch.addcmul(A[c], B[c], neg[start : start + w], out=rows[start : start + w])
                    start += w
        else:  # accelerators: three large kernels rather than one small kernel per client
            torch.index_select(A, 0, pair_client, out=rows)
            rows.addcmul_(B.index_select(0, pair_client), neg)
        self.served += 1
        return rows.view(*x.shape[:-1], A.shape[-1])

    def _source(self, x: Tensor, row_leaves: Sequence[Tensor], P: int) -> tuple | None:
        """``(leaf index, offset, shape, strides)`` of ``x`` ([P, ..., in]) as a view into the rows of one of
        ``row_leaves``, the same view of every row; None when it is not one."""
        if x.dim() < 2 or x.shape[0] != P:
            return None
        for j, leaf in enumerate(row_leaves):
            client = self.client_leaves[j]
            if leaf.dtype != x.dtype or leaf.dim() < 1 or leaf.shape[0] != P:
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

    def _compute(self, k: int, kb: int | None, j: int, offset: int, shape: tuple, strides: tuple):
        """``A = x W^T + b`` and ``B = x G^T + g_b`` of every client, ``[C, m, out]``."""
        client = self.client_leaves[j]
        C = client.shape[0]
        x = client.as_strided((C, *shape), (client.stride(0), *strides), client.storage_offset() + offset)
        x = x.reshape(C, -1, shape[-1])
        W, G = self.W_views[k], self.g_views[k]
        if kb is None:
            return torch.bmm(x, W.transpose(1, 2)), torch.bmm(x, G.transpose(1, 2))
        b, gb = self.W_views[kb].unsqueeze(1), self.g_views[kb].unsqueeze(1)
        return torch.baddbmm(b, x, W.transpose(1, 2)), torch.baddbmm(gb, x, G.transpose(1, 2))
