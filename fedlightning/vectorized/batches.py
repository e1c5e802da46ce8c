"""The round's mini-batches of every client, drawn as sequential training draws them, padded per step.

:class:`_RoundBatches` gives, step by step, the batch leaves ``[C, n_max, ...]`` of all clients (client ``i``'s
batch in row ``i``, padded to the step's largest batch by repeating its own samples) and the real sizes ``n_i``;
:func:`_round_index` builds the index matrices of all steps of a round at once for the data modules' own sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.datamodules.base import ArrayBatchLoader, ArrayDataset, ClientBatchSampler, reiterate

from .support import VectorizationUnsupportedError
from .torch_internals import tree_flatten, tree_unflatten

__all__ = ["_DeviceTransfer", "_RoundBatches"]


class _DeviceTransfer:
    """A batch transfer ``fn`` (the loop's ``to_device``, precision conversion included) that also names the device
    it moves batches to, so that :class:`_RoundBatches` can keep in-memory training data there."""

    def __init__(self, fn: Callable[[Any], Any], device: torch.device):
        self.fn, self.device = fn, torch.device(device)

    def __call__(self, batch: Any) -> Any:
        return self.fn(batch)


#: In-memory training data is kept on an accelerator only while it takes at most this fraction of the device's free
#: memory (ours: the clients' activations need the rest; larger data is gathered on the host, as on a CPU).
DEVICE_DATA_MAX_FRACTION = 0.25


def _gather_source(dataset: ArrayDataset, device: torch.device | None) -> tuple[Any, Any]:
    """The ``(x, y)`` a round gathers its rows from: the data set's copy on ``device`` (made once per run,
    :meth:`~fedlightning.datamodules.base.ArrayDataset.on_device`; on a CPU the tensors themselves), or the host
    tensors where the device is unknown or the data would take more than :data:`DEVICE_DATA_MAX_FRACTION` of a CUDA
    device's free memory."""
    x, y = dataset.x, dataset.y
    if device is None or not (isinstance(x, Tensor) and isinstance(y, Tensor)):
        return x, y
    if device.type == "cuda" and str(device) not in dataset.__dict__.get("_device_copies", {}):
        size = x.numel() * x.element_size() + y.numel() * y.element_size()
        if size > DEVICE_DATA_MAX_FRACTION * torch.cuda.mem_get_info(device)[0]:
            return x, y
    return dataset.on_device(device)


class _RoundBatches:
    """The round's mini-batches of every client, step by step, in the order sequential training draws them.

    ``step(k)`` returns ``(leaves, spec, sizes)``: the batch structure's tensor leaves ``[C, n_max, ...]`` (client
    ``i``'s batch of step ``k`` in row ``i``, padded to the step's largest batch by repeating its own samples, on the
    model's device), the pytree spec of a batch, and the real batch sizes ``n_i`` (see
    :class:`~fedlightning.vectorized.layout._Layout`).

    Decisions (ours): the same data as sequential training. Client ``i`` draws its batches from
    ``datamodule.client_dataloader(i, round, seed=loop.seed)`` in the same order, cycling to a new shuffled epoch
    when the loader runs out (as ``LocalTrainer.run``). Other loaders are iterated as they are. For in-memory data
    (``datamodule.in_memory_train_data()``: an ``ArrayDataset`` served by ``ArrayBatchLoader``) no loader is built:
    the index lists come from ``datamodule.client_batch_sampler`` (the loader's own sampler), the training tensors
    are kept on the model's device (``to_device.device``, :class:`_DeviceTransfer`; copied once per run,
    :func:`_gather_source`) with the round's index matrices moved there once per round, and a step's rows of all
    clients are gathered there with one indexing op per tensor: no host-to-device copy of batch data per step. The
    rows are bit for bit the loader's (``index_select`` of the same indices). On a CPU this is the same code with
    the data where it already is; its payoff is on an accelerator.
    """

    #: largest round of gathered batch rows (bytes) that is gathered at once rather than step by step
    ROUND_GATHER_BYTES = 32 << 20

    def __init__(
        self,
        datamodule,
        client_ids: Sequence[int],
        round: int,
        seed: int,
        local_steps: int,
        to_device: Callable[[Any], Any],
    ):
        self.local_steps = local_steps
        self.to_device = to_device
        in_memory = getattr(datamodule, "in_memory_train_data", None)
        dataset = in_memory() if in_memory is not None else None
        if dataset is not None:
            samplers = [datamodule.client_batch_sampler(cid, round, seed) for cid in client_ids]
            self._init_fast(dataset, samplers)
            return
        loaders = [datamodule.client_dataloader(cid, round, seed=seed) for cid in client_ids]
        samplers = [self._array_sampler(ld) for ld in loaders]
        if all(s is not None for s in samplers) and len({id(ld.dataset) for ld in loaders}) == 1:
            self._init_fast(loaders[0].dataset, samplers)
        else:
            self._init_generic(loaders)

    @staticmethod
    def _array_sampler(loader):
        """The batch sampler of an in-memory fast-path loader (``ArrayBatchLoader`` over an ArrayDataset), else None."""
        if type(loader) is ArrayBatchLoader and isinstance(loader.dataset, ArrayDataset):
            return loader.batch_sampler
        return None

    def _init_fast(self, dataset, samplers) -> None:
        """Index lists straight from each client's batch sampler (exactly what its ``ArrayBatchLoader`` yields as
        ``(x[idx], y[idx])``), laid out as one padded ``[C, n_max]`` index matrix per step (all steps' matrices are
        built at once, see :func:`_round_index`). The rows of the whole round are gathered with one
        ``index_select`` per tensor when they fit in :attr:`ROUND_GATHER_BYTES` (each step's batch is then a view
        into them), else step by step."""
        self.fast, self.dataset = True, dataset
        K = self.local_steps
        index, sizes, widths = _round_index(samplers, K)
        C = len(samplers)
        offsets = np.concatenate([[0], np.cumsum(widths * C)]).tolist()
        sizes_list = sizes.tolist()
        self.steps = [(index[offsets[k] : offsets[k + 1]].reshape(C, -1), sizes_list[k]) for k in range(K)]
        self.offsets = offsets
        self.round_leaves = None
        x, y = _gather_source(dataset, getattr(self.to_device, "device", None))
        self.x, self.y = x, y
        where = x.device if isinstance(x, Tensor) else torch.device("cpu")
        self.flat_index = torch.from_numpy(index).to(where)  # the round's indices, moved once
        probe = self.flat_index[:1]
        row_bytes = sum(t.numel() * t.element_size() for t in (_take(x, probe), _take(y, probe)))
        if index.size * row_bytes <= self.ROUND_GATHER_BYTES:
            gathered = self.to_device((_take(x, self.flat_index), _take(y, self.flat_index)))
            self.round_leaves, self.spec = tree_flatten(gathered)

    def _init_generic(self, loaders) -> None:
        self.fast = False
        K = self.local_steps
        per_step: list[list[Any]] = [[] for _ in range(K)]
        with torch.random.fork_rng(devices=[]):  # DataLoader iterators draw a base seed from the global RNG
            for ld in loaders:
                for k, b in enumerate(reiterate(ld, K)):  # the batches sequential training takes
                    per_step[k].append(b)
        self.per_step = per_step
        for k in range(K):  # refused before the round computes anything (auto then falls back cleanly)
            _check_stackable(per_step[k], k)

    def step(self, k: int) -> tuple[list[Tensor], Any, list[int]]:
        """Leaves ``[C, n_max, ...]`` of step ``k``'s batches (each client's rows, padded by repeating its own rows
        up to the largest batch of the step), the batch's pytree spec, and the real sizes ``n_i``."""
        if self.fast:
            index, sizes = self.steps[k]
            shape = index.shape
            if self.round_leaves is not None:  # views into the round's rows
                start, end = self.offsets[k], self.offsets[k + 1]
                leaves = [x[start:end].view(*shape, *x.shape[1:]) for x in self.round_leaves]
                return leaves, self.spec, sizes
            flat = self.flat_index[self.offsets[k] : self.offsets[k + 1]]
            x, y = _take(self.x, flat), _take(self.y, flat)
            x, y = self.to_device((x.view(*shape, *x.shape[1:]), y.view(*shape, *y.shape[1:])))
            leaves, spec = tree_flatten((x, y))
            return leaves, spec, sizes
        batches = self.per_step[k]
        flats, specs = zip(*(tree_flatten(b) for b in batches))
        spec = specs[0]
        if any(s != spec for s in specs):
            raise VectorizationUnsupportedError("the clients' batches have different structures; cannot stack them")
        sizes = []
        for leaves in flats:
            if not leaves or not all(isinstance(x, Tensor) and x.dim() >= 1 for x in leaves):
                raise VectorizationUnsupportedError(
                    "client_execution='vectorized' needs batches whose leaves are all tensors with a leading batch "
                    f"dimension; got leaves of types {[type(x).__name__ for x in leaves]}"
                )
            n = leaves[0].shape[0]
            if any(x.shape[0] != n for x in leaves):
                raise VectorizationUnsupportedError(
                    f"batch leaves have different leading sizes {[tuple(x.shape) for x in leaves]}; cannot stack them"
                )
            sizes.append(int(n))
        position = torch.from_numpy(_padded_positions(sizes))
        leaves = [torch.cat([f[j] for f in flats])[position] for j in range(len(flats[0]))]
        leaves = tree_flatten(self.to_device(tree_unflatten(leaves, spec)))[0]
        return leaves, spec, sizes


def _check_stackable(batches: Sequence[Any], step: int) -> None:
    """Raise :class:`VectorizationUnsupportedError` naming the leaf of the clients' batches of local step ``step``
    that cannot be stacked: one that is not a tensor with a batch dimension (e.g. the list of strings the default
    collate makes of a string field), one that only some clients' batches have, or one whose non-batch shape or
    dtype differs between the clients' batches (e.g. sequences padded per batch by a pad ``collate_fn``).

    Decision (ours): the engine pads only the batch dimension (by repeating a client's own samples, masked out of
    its loss). It never pads another dimension: whether a longer padding leaves ``training_step``'s loss unchanged
    depends on the user's pad value and masking, which the engine cannot prove, so such batches are refused by name
    (``client_execution="auto"`` then trains sequentially, saying why). A collate that pads to a fixed length
    stacks."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    fix = "or use client_execution='sequential' (or 'auto')"
    flat = [[(keystr(path), leaf) for path, leaf in tree_flatten_with_path(batch)[0]] for batch in batches]
    for leaves in flat:
        for path, leaf in leaves:
            if not (isinstance(leaf, Tensor) and leaf.dim() >= 1):
                what = f"a 0-d tensor ({leaf.dtype})" if isinstance(leaf, Tensor) else f"a {type(leaf).__name__}"
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' needs batches whose leaves are all tensors with a leading batch "
                    f"dimension; leaf batch{path} of local step {step} is {what}. Leave it out of the batch in your "
                    f"collate_fn (or make it a tensor with one row per sample), {fix}"
                )
    first = flat[0]
    for leaves in flat[1:]:
        if [p for p, _ in leaves] != [p for p, _ in first]:
            a, b = [p for p, _ in first], [p for p, _ in leaves]
            only = sorted(set(a) ^ set(b)) or a
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot stack the clients' batches of local step {step}: their "
                f"structures differ (leaf batch{only[0]} is in one client's batch and not in another's); give every "
                f"batch the same structure, {fix}"
            )
        for (path, a), (_, b) in zip(first, leaves):
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' cannot stack the clients' batches of local step {step}: leaf "
                    f"batch{path} has shape {tuple(a.shape)} ({a.dtype}) in one client's batch and {tuple(b.shape)} "
                    f"({b.dtype}) in another's; only the batch dimension is padded (padding another dimension could "
                    f"change the loss). Pad to a fixed length in your collate_fn, {fix}"
                )


def _take(data: Any, index: Tensor) -> Tensor:
    """``data[index]`` for a 1-d int64 ``index``: ``index_select`` for tensors (the same rows, faster than advanced
    indexing), the object's own indexing otherwise (tensor-like views such as Shakespeare's sliding windows)."""
    if isinstance(data, Tensor):
        return torch.index_select(data, 0, index.to(data.device))
    return data[index]


def _sampler_batches(sampler, num: int) -> list[np.ndarray]:
    """The first ``num`` index batches a client's loader yields, cycling to a new epoch (a new ``iter()``) when the
    sampler runs out, exactly as ``LocalTrainer.run`` re-iterates its loader (any batch sampler)."""
    out: list[np.ndarray] = []
    it = iter(sampler)
    while len(out) < num:
        try:
            idx = next(it)
        except StopIteration:  # a new shuffled epoch
            it = iter(sampler)
            idx = next(it)
        out.append(np.asarray(idx, dtype=np.int64).reshape(-1))
    return out


def _round_index(samplers, num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``num`` index batches of every client's batch sampler (as :func:`_sampler_batches`), laid out for
    the round: returns ``(index, sizes, widths)`` with ``sizes[k, i]`` the size of client ``i``'s batch ``k``,
    ``widths[k] = max_i sizes[k, i]`` and ``index`` the concatenation over ``k`` of the ``[C, widths[k]]`` matrices
    whose row ``i`` holds client ``i``'s batch ``k`` padded by repeating its own rows (see
    :func:`_padded_positions`).

    For :class:`~fedlightning.datamodules.base.ClientBatchSampler` (the data modules' own sampler) the epochs are
    drawn here with the sampler's own generator and operations (one ``randperm`` per epoch, cut into batches of
    ``batch_size``, the last one partial): the same index lists as iterating it, with the per-epoch Python work
    reduced to the ``randperm`` call and everything else done for all clients and steps at once (the host work of a
    round is then a few numpy ops besides one ``randperm`` per client and epoch). Other samplers are iterated.
    """
    C = len(samplers)
    # sizes as shape[0]: len() of a tensor costs a Python-level call each, which a round pays per client
    fast = all(type(s) is ClientBatchSampler and s.shuffle and s.indices.shape[0] > 0 for s in samplers)
    k = np.arange(num, dtype=np.int64)[:, None]
    if fast:
        n = np.array([s.indices.shape[0] for s in samplers], dtype=np.int64)
        bs = np.array([s.batch_size for s in samplers], dtype=np.int64)
        drop = np.array([s.drop_last for s in samplers]) & (n >= bs)
        per_epoch = np.where(drop, n // bs, -(-n // bs))  # batches per epoch (drop_last: full batches only)
        epochs = -(-num // per_epoch)  # epochs needed for ``num`` batches
        perms = [
            torch.randperm(int(n_i), generator=s.generator)
            for s, n_i, e_i in zip(samplers, n.tolist(), epochs.tolist())
            for _ in range(e_i)
        ]
        segment = epochs * n  # client i's epochs, one after the other, in ``order``
        seg_start = np.cumsum(segment) - segment
        idx_start = np.cumsum(n) - n
        # order[seg_start_i + e n_i + j] = sampler_i.indices[perm_{i,e}[j]]
        all_indices = torch.cat([s.indices for s in samplers]).numpy()
        order = all_indices[torch.cat(perms).numpy() + np.repeat(idx_start, segment)]
        b = k % per_epoch  # position of batch k in its epoch
        starts = seg_start + (k // per_epoch) * n + b * bs  # [K, C]
        sizes = np.minimum(bs, n - b * bs)
    else:
        chunks = [_sampler_batches(s, num) for s in samplers]
        sizes = np.array([[len(c[j]) for c in chunks] for j in range(num)], dtype=np.int64).reshape(num, C)
        order = np.concatenate([np.concatenate(c) for c in chunks])
        client_start = np.cumsum(sizes.sum(0)) - sizes.sum(0)
        starts = client_start + np.cumsum(sizes, axis=0) - sizes
    widths = sizes.max(axis=1)  # [K]
    # cell (k, i, j) for j < widths[k] holds the client's row j mod sizes[k, i]
    w = np.repeat(widths, C)  # width of every (k, i) row
    row_start = np.cumsum(w) - w
    col = np.arange(int(w.sum()), dtype=np.int64) - np.repeat(row_start, w)
    pos = np.repeat(starts.reshape(-1), w) + col % np.repeat(sizes.reshape(-1), w)
    return order[pos], sizes, widths


def _padded_positions(sizes: list[int]) -> np.ndarray:
    """``[C, n_max]`` positions into the clients' concatenated rows; client ``i``'s cell ``j`` holds its own row
    ``j mod n_i``, so padding cells repeat real samples (finite losses, masked out)."""
    n = np.asarray(sizes, dtype=np.int64)
    start = np.cumsum(n) - n
    return start[:, None] + np.arange(int(n.max()))[None, :] % n[:, None]
