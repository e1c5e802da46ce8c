"""How the clients' rows are laid out: a step's batches (:class:`_Layout`) and the weights ``W``
(:class:`_WeightsLayout`). Row ``i`` of every batched tensor is client ``i`` (or, for a line search's trial points, one
(client, point) pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .losses import _gathered_rows
from .torch_internals import tree_unflatten

__all__ = ["_Layout", "_WeightsLayout"]


class _Layout:
    """How one step's batches are laid out for the batched model call (row ``i`` = client ``i``).

    * whole (every client's batch has the same size ``n``): row ``i`` is client ``i``'s batch ``[n, ...]`` and
      ``training_step`` sees it exactly as it would sequentially;
    * padded (sizes differ: fewer samples than the batch size, partial last batches): every client's batch is padded
      to the step's largest size ``n_max`` by repeating its own samples (so every cell holds real, finite data) and
      ``mask`` marks the real cells. Every cell gets its own loss (the model's per-sample protocol, per-sample loss
      interception, or one ``training_step`` call on a batch of one sample: the first that applies, see
      :meth:`~fedlightning.vectorized.call._ModelCall.row_values`) and a client's loss is the sum of its real
      cells' losses over ``n_i``, the mean over its samples.

    Decisions (ours): the mean over real cells is the batch loss for any loss that is a mean over samples
    (cross-entropy, MSE: every reference model); a loss that is not (e.g. weighting tokens with ``ignore_index``)
    is averaged per sample instead. Cutting big clients into several rows to pad less is slower on CPU: the extra
    weight gathers cost more than the padded cells they save.
    """

    def __init__(self, leaves: list[Tensor], spec: Any, sizes: list[int], cache: dict | None = None):
        """``leaves``: the step's batch leaves ``[C, n_max, ...]`` (see
        :meth:`~fedlightning.vectorized.batches._RoundBatches.step`); ``cache``: a dict kept over the steps of a round,
        so that steps with the same sizes share their mask and counts."""
        self.num_clients = len(sizes)
        self.sizes, self.min_size = list(sizes), min(sizes)
        self.leaves, self.spec = leaves, spec
        self.batch = tree_unflatten(leaves, spec)
        key = tuple(sizes)
        if cache is not None and key in cache:
            self.mask, self.counts, self._counts_as = cache[key]
            return
        n_max = max(sizes)
        if min(sizes) == n_max:
            self.mask = self.counts = None
        else:
            device = leaves[0].device
            n = torch.tensor(sizes, dtype=torch.long)
            self.mask = (torch.arange(n_max)[None, :] < n[:, None]).to(device)
            self.counts = n.to(device)
        self._counts_as: dict[Any, Tensor] = {}  # by dtype; cell weights by ("weights", dtype)
        if cache is not None:
            cache[key] = (self.mask, self.counts, self._counts_as)

    def counts_as(self, dtype: torch.dtype) -> Tensor:
        """``counts`` converted to ``dtype`` (cached)."""
        out = self._counts_as.get(dtype)
        if out is None:
            out = self._counts_as[dtype] = self.counts.to(dtype)
        return out

    def cell_weights(self, dtype: torch.dtype) -> Tensor:
        """``mask / counts`` ([C, n_max]): each real cell's weight ``1/n_i`` in its client's mean, 0 on padded
        cells (cached with the counts)."""
        key = ("weights", dtype)
        out = self._counts_as.get(key)
        if out is None:
            out = self._counts_as[key] = self.mask.to(dtype) / self.counts_as(dtype)[:, None]
        return out

    def rows(
        self, clients: Tensor, scratch: Callable[..., Tensor], blank: frozenset[int] = frozenset()
    ) -> tuple[Any, Tensor | None, Tensor | None]:
        """Batch, mask and sample counts of the rows ``clients`` (indices; repeats allowed), gathered into the
        engine's reusable ``scratch`` buffers (these rows only live during one trial evaluation).

        The batch leaves ``blank`` (indices of floating leaves) are not gathered: their rows are NaN, of their
        shape (see :meth:`~fedlightning.vectorized.trials._LineTrials.blank_leaves`). Integer leaves (targets) keep
        what the step's loss found of them (:func:`~fedlightning.vectorized.losses._gathered_rows`)."""
        P = clients.shape[0]
        rows = []
        for j, x in enumerate(self.leaves):
            shape = (P, *x.shape[1:])
            if j in blank:
                rows.append(scratch(("blank rows", j), shape, x.dtype, x.device, fill=float("nan")))
                continue
            row = torch.index_select(x, 0, clients, out=scratch(("rows", j), shape, x.dtype, x.device))
            if not row.is_floating_point():
                _gathered_rows(row, x)
            rows.append(row)
        batch = tree_unflatten(rows, self.spec)
        if self.mask is None:
            return batch, None, None
        return batch, self.mask.index_select(0, clients), self.counts.index_select(0, clients)


class _WeightsLayout:
    """Where each trainable parameter lives in a row of ``W`` ([R, D], row ``r`` one client's flat weights or one
    trial point), and in which memory order.

    Decisions (ours): each parameter's block of ``W`` is stored in the memory order its gradient comes out of the
    backward pass in (learned once per engine from one gradient evaluation, :meth:`learn`): ``linear`` with
    per-client weights gives weight gradients transposed, and adding a transposed gradient to a row-major block
    (the SGD update, the ``[C, D]`` gradient of the line search) is a transposing copy that costs as much as the
    rest of the update. :meth:`views` gives the parameters' logical ``[R, *shape]`` views; every ``[R, D]`` tensor
    of the engine (weights, flat gradients, trial points) is in storage order, and only the round's start weights
    (:meth:`stored`) and the deltas (:meth:`logical`) are converted. Values and ops are unchanged; the storage order
    can change the summation order of reductions over a parameter (gradient norms for clipping and the Armijo /
    Polyak tests), i.e. rounding in the last bits.
    """

    def __init__(self, params: Sequence[Tensor]):
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.num_params = sum(self.numels)
        self._views_of: tuple[Tensor, list[Tensor]] | None = None
        # storage order of each parameter's block of W (None: the parameter's own), see learn
        self.orders: list[tuple[int, ...] | None] = [None] * len(self.shapes)

    def views(self, W: Tensor) -> list[Tensor]:
        """The per-parameter views ``[R, *shape]`` of ``W`` ([R, D], each parameter's block in its storage order,
        see :meth:`learn`); the views of the round's weights are cached (``W`` keeps its storage for the
        whole round: every update is in place)."""
        cached = self._views_of
        if cached is not None and cached[0] is W:
            return cached[1]
        R = W.shape[0]
        views = []
        for t, shape, order in zip(W.split_with_sizes(self.numels, 1), self.shapes, self.orders):
            if order is None:
                views.append(t.view(R, *shape))
            else:  # block stored as the parameter permuted by ``order``; the view puts the dimensions back
                stored = t.view(R, *(shape[d] for d in order))
                views.append(stored.permute(0, *(1 + order.index(d) for d in range(len(shape)))))
        self._views_of = (W, views)
        return views

    def flat(self, parts: Sequence[Tensor]) -> Tensor:
        """``[R, D]`` in the storage order of ``W`` from per-parameter ``[R, *shape]`` tensors (e.g. gradients)."""
        R = parts[0].shape[0]
        return torch.cat(
            [
                (t if order is None else t.permute(0, *(1 + d for d in order))).reshape(R, -1)
                for t, order in zip(parts, self.orders)
            ],
            dim=1,
        )

    def logical(self, W: Tensor) -> Tensor:
        """``W`` ([R, D], storage order) in the parameters' own order (``flat_params``' order)."""
        if all(order is None for order in self.orders):
            return W
        return torch.cat([v.reshape(W.shape[0], -1) for v in self.views(W)], dim=1)

    def stored(self, flat: Tensor) -> Tensor:
        """A ``[D]`` vector in the parameters' own order, in the storage order of ``W``."""
        if all(order is None for order in self.orders):
            return flat
        return self.flat([t.view(1, *shape) for t, shape in zip(torch.split(flat, self.numels), self.shapes)])[0]

    def learn(self, grads: Sequence[Tensor]) -> None:
        """Store every parameter of ``W`` in the memory order its gradient comes out of the backward pass in (see
        the class docstring): a gradient that is a permuted view of a contiguous tensor (``linear``'s weight
        gradient ``[C, out, in]`` with the strides of ``[C, in, out]``) gives its permutation, any other keeps the
        parameter's own order. Called on the first gradient evaluation of the engine."""
        orders: list[tuple[int, ...] | None] = []
        for g, shape in zip(grads, self.shapes):
            order = None
            if g.dim() > 2 and g.shape[1:] == torch.Size(shape):
                dims = sorted(range(len(shape)), key=lambda d: (-g.stride(1 + d), d))
                if dims != list(range(len(shape))) and g.permute(0, *(1 + d for d in dims)).is_contiguous():
                    order = tuple(dims)
            orders.append(order)
        self.orders = orders
        self._views_of = None
