"""FederatedDataModule: one shared data set, per-client index arrays, per-client loaders and a seeded round sampler.

Subclasses implement :meth:`FederatedDataModule.load` (return the train and test data sets and the train
labels) and optionally :meth:`FederatedDataModule.natural_clients` (a natural split such as LEAF users). Clients
never copy data: client ``i`` holds an ``int64`` index array into the one shared training set.

A validation split (``val_fraction``, default 0.1) is held out of the training set before the clients are formed:
``val_dataloader()`` serves it and ``test_dataloader()`` the test set, so hyper-parameters chosen on ``val/*``
never see test data (see :class:`FederatedDataModule` for the rules).
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, SequentialSampler, Subset

from fedlightning._lightning_compat import batches_in_epoch
from fedlightning._reference import reference_mode
from fedlightning._validation import in_range, integer
from fedlightning.datamodules.checks import (
    as_label_array,
    bad_label_rows,
    first_nonfinite_value,
    label_problem,
    nonfinite_rows,
)
from fedlightning.datamodules.partition import IID, Partitioner, check_partition
from fedlightning.state import RoundPlan, derive_seed

__all__ = [
    "ArrayDataset",
    "ArrayBatchLoader",
    "ClientBatchSampler",
    "ClientDataLoader",
    "WholeSplitSampler",
    "FederatedDataModule",
    "RoundPlanLoader",
    "DEFAULT_VAL_FRACTION",
    "check_val_fraction",
    "chronological_holdout",
    "epoch_steps",
    "preserved_random_states",
    "random_states_moved",
    "reiterate",
]

#: Default fraction of the training data held out for validation (ours: a common 90/10 choice that keeps 90 % of
#: every training set for the clients; the seed papers select on the test set and give no validation fraction).
DEFAULT_VAL_FRACTION = 0.1
_EPS = 1e-9  # absorbs float error in fraction * count (0.7 * 10 = 7.000000000000001) before floor / ceil
_SET_NAME = {"train": "training", "test": "test", "val": "validation"}


def _first_of(rows: np.ndarray) -> str:
    return f" (the first of {len(rows)} such samples)" if len(rows) > 1 else ""


def check_val_fraction(value: Any) -> float:
    """``value`` as a float in ``[0, 1)``, or a ValueError naming ``val_fraction`` and the value."""
    return in_range("val_fraction", value, 0.0, 1.0, hint="0 disables validation", show_name=True)


def chronological_holdout(n: int, fraction: float, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train_positions, val_positions)`` of one user's ``n`` time-ordered samples: the last
    ``k = floor(fraction · n)`` samples validate, the ``gap`` samples before them are dropped, the rest train.

    For overlapping sliding windows (``gap = seq_length − 1``), this keeps every validation target out of every
    training window, as LEAF's chronological train/test rule does. A user with ``k = 0`` or without a training
    sample left keeps all its samples for training.
    """
    n = int(n)
    k = int(math.floor(fraction * n + _EPS))
    n_train = n - k - int(gap)
    if k == 0 or n_train < 1:
        return np.arange(n, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.arange(n_train, dtype=np.int64), np.arange(n - k, n, dtype=np.int64)


class ArrayDataset(Dataset):
    """In-memory ``(x, y)`` tensors that also accept a list / tensor of indices and return a whole batch.

    The batched fast path lets a client loader fetch a mini-batch with one tensor indexing operation instead of
    ``batch_size`` ``__getitem__`` calls and a collate; it is what makes small-model simulation cheap.
    """

    def __init__(self, x: Tensor, y: Tensor):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows but y has {len(y)}")
        self.x, self.y = x, y
        self._device_copies: dict[str, tuple[Tensor, Tensor]] = {}

    def on_device(self, device: torch.device | str) -> tuple[Any, Any]:
        """``(x, y)`` on ``device``: the tensors themselves where they are already there (a CPU device for CPU
        data), else a copy made on first use and kept with the data set (the data set's tensors never change), so
        that a run copies its training data to the accelerator once. Non-tensor ``x`` or ``y`` (a view object such
        as Shakespeare's sliding windows) are returned as they are."""
        device = torch.device(device)
        if not (isinstance(self.x, Tensor) and isinstance(self.y, Tensor)):
            return self.x, self.y
        if self.x.device == device and self.y.device == device:
            return self.x, self.y
        copies = self.__dict__.setdefault("_device_copies", {})  # also for subclasses with their own __init__
        key = str(device)
        if key not in copies:
            copies[key] = (self.x.to(device), self.y.to(device))
        return copies[key]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx):
        if isinstance(idx, (list, np.ndarray)):
            idx = torch.as_tensor(idx, dtype=torch.long)
        return self.x[idx], self.y[idx]


def epoch_steps(epochs: float, batches_per_epoch: int) -> int:
    """Local steps for ``epochs`` local epochs of ``batches_per_epoch`` mini-batches: ``⌈E · B⌉``, at least 1.

    Decisions: for a whole number of epochs this is ``E · ⌈n_i/b⌉``, seed 002's ``K = E·⌈n_i/B⌉`` (its reference
    code's epoch loop; FedAvg's ``E·n_k/B`` when ``b`` divides ``n_i``): every sample is seen ``E`` times, each epoch
    a new shuffle, its last batch partial (dropped with ``drop_last``). A fractional ``E`` (ours) rounds up, so
    ``E = 0.5`` of a 7-batch client is 4 steps. ``E`` is read as the decimal the user wrote (``Fraction(repr(E))``),
    so ``0.1 · 30`` is 3 steps, not the 4 that binary rounding of ``0.1`` would give."""
    from fractions import Fraction

    exact = Fraction(repr(float(epochs))) * int(batches_per_epoch)
    return max(1, -((-exact.numerator) // exact.denominator))


class ClientBatchSampler(Sampler[list[int]]):
    """Yields the index lists of one shuffled epoch over ``indices`` (last partial batch kept unless ``drop_last``).

    Each ``iter()`` draws a fresh permutation from ``generator``, so re-iterating cycles through new epochs in a
    reproducible order. ``shuffle=False`` gives sequential batches (evaluation).

    ``drop_last`` (decision, ours): every epoch drops its last partial batch, as ``DataLoader(drop_last=True)``,
    except that a client with fewer than ``batch_size`` samples serves all of them as one batch per epoch: dropping
    it would leave the client without a batch, and a client sampled for a round must take its local steps
    (``DataLoader`` would yield nothing and the client would fail).
    """

    def __init__(
        self,
        indices: np.ndarray,
        batch_size: int,
        generator: torch.Generator | None,
        shuffle=True,
        drop_last: bool = False,
    ):
        self.indices = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        self.batch_size = int(batch_size)
        self.generator = generator
        self.shuffle = shuffle
        self.drop_last = bool(drop_last)

    def __len__(self) -> int:
        n = len(self.indices)
        if self.drop_last and n >= self.batch_size:
            return n // self.batch_size
        return math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Tensor]:
        yield from self._split()

    def epoch(self) -> tuple[Tensor, ...]:
        """The index batches of one epoch at once (the same draw as one ``iter()``; none for an empty client)."""
        return self._split()

    def _split(self) -> tuple[Tensor, ...]:
        if not len(self.indices):  # an empty client: no batch (torch.split would give one empty chunk)
            return ()
        if self.shuffle:
            order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
        else:
            order = self.indices
        if self.drop_last and len(order) >= self.batch_size:
            order = order[: len(order) - len(order) % self.batch_size]
        return torch.split(order, self.batch_size)


#: The process's global random sources that a data set's ``__getitem__`` may draw from, as ``(get, set)`` pairs:
#: torch's CPU generator, Python's ``random`` and numpy's global generator.
_RANDOM_SOURCES: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = (
    (torch.get_rng_state, torch.set_rng_state),
    (random.getstate, random.setstate),
    (np.random.get_state, np.random.set_state),
)


@contextlib.contextmanager
def preserved_random_states() -> Iterator[None]:
    """Puts the process's global random states (torch's CPU generator, Python's ``random``, numpy's global generator:
    :data:`_RANDOM_SOURCES`) back as they were when the block exits, also on an exception: for reads of a user's
    samples outside training (a data module's construction and setup), whose ``__getitem__`` may draw from them."""
    states = [get() for get, _ in _RANDOM_SOURCES]
    try:
        yield
    finally:
        for (_, put), state in zip(_RANDOM_SOURCES, states):
            put(state)


@contextlib.contextmanager
def random_states_moved() -> Iterator[Callable[[], bool]]:
    """Inside the block, the yielded function tells whether any of the process's global random states
    (:data:`_RANDOM_SOURCES`) has moved since the block began: a data set's ``__getitem__`` that draws from one."""
    before = [get() for get, _ in _RANDOM_SOURCES]
    yield lambda: not all(_same_state(get(), state) for (get, _), state in zip(_RANDOM_SOURCES, before))


def _same_state(a: Any, b: Any) -> bool:
    """Equal random states (torch's byte tensor, ``random``'s tuple, numpy's tuple with its key array)."""
    if isinstance(a, Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == len(b):
        return all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _worker_zero_states(base_seed: int, sources: Sequence[int]) -> dict[int, Any]:
    """The random states a DataLoader gives its worker 0, for the sources ``sources`` (indices of
    :data:`_RANDOM_SOURCES`): torch and ``random`` seeded with ``base_seed``, numpy with torch's own derivation of the
    worker's numpy seed; made on generators of their own, without touching the process's states."""
    states: dict[int, Any] = {}
    for i in sources:
        if i == 0:
            states[i] = torch.Generator().manual_seed(base_seed).get_state()
        elif i == 1:
            states[i] = random.Random(base_seed).getstate()
        else:
            try:
                from torch.utils.data._utils.worker import _generate_state

                seed = _generate_state(base_seed, 0)
            except ImportError:  # pragma: no cover - torch's helper moved: a seed of its own
                seed = base_seed % (1 << 32)
            states[i] = np.random.RandomState(seed).get_state()
    return states


@contextlib.contextmanager
def _as_worker_zero(loader: DataLoader, seed: int) -> Iterator[None]:
    """Inside the block ``torch.utils.data.get_worker_info()`` describes worker 0 of 1 of ``loader`` (``id``,
    ``num_workers``, ``seed``, ``dataset``), as in a DataLoader worker; torch keeps that description in a private
    module attribute, which a torch without it leaves alone (the block then changes nothing)."""
    from torch.utils.data._utils import worker

    if not hasattr(worker, "_worker_info"):  # pragma: no cover - torch moved it
        yield
        return
    kept = worker._worker_info
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=seed, dataset=loader.dataset)
    try:
        yield
    finally:
        worker._worker_info = kept


def _initialised_worker_zero_states(base_seed: int, loader: DataLoader) -> dict[int, Any]:
    """The random states of :func:`_worker_zero_states` (all sources) after the loader's ``worker_init_fn(0)`` ran
    under them as in worker 0 of a DataLoader: ``torch.initial_seed()`` is the worker's seed and ``get_worker_info()``
    describes worker 0 of 1 (:func:`_as_worker_zero`); a function that reseeds numpy and ``random`` from
    ``torch.initial_seed()`` (PyTorch's reproducibility recipe) then gives them what it gives a worker. The process's
    states are put back afterwards."""
    sources = range(len(_RANDOM_SOURCES))
    states = _worker_zero_states(base_seed, sources)
    with preserved_random_states():
        torch.default_generator.manual_seed(base_seed)  # its state is states[0]; initial_seed() is the worker's seed
        for i in sources:
            if i:
                _RANDOM_SOURCES[i][1](states[i])
        with _as_worker_zero(loader, base_seed):
            loader.worker_init_fn(0)
        return {i: _RANDOM_SOURCES[i][0]() for i in sources}


class _SeededFetches:
    """An iterator over a DataLoader without workers whose every batch is fetched under the loader's own random
    states (see :class:`ClientDataLoader`); the process's states are put back after each batch.

    Decision (ours, measured): swapping numpy's state costs about 70 µs per batch (its 2.5 kB key array copied in
    and out twice), Python's ``random`` about 20 µs and torch's about 2.5 µs. The first batch of a loader's first
    iteration swaps all three; a source that batch did not draw from is not swapped again by that loader (a data
    set that draws from a source for some samples only, and not in that batch, then draws it from the process's
    state)."""

    def __init__(self, batches: Iterator[Any], base_seed: int, loader: ClientDataLoader):
        self._batches = batches
        self._loader = loader
        self._sources = list(range(len(_RANDOM_SOURCES))) if loader._sources is None else loader._sources
        if loader.worker_init_fn is None:
            self._states = _worker_zero_states(base_seed, self._sources)
        else:
            self._states = _initialised_worker_zero_states(base_seed, loader)

    def __iter__(self) -> _SeededFetches:
        return self

    def __next__(self) -> Any:
        sources, states = self._sources, self._states
        outer = [_RANDOM_SOURCES[i][0]() for i in sources]
        for i in sources:
            _RANDOM_SOURCES[i][1](states[i])
        try:
            return next(self._batches)
        finally:
            probing = self._loader._sources is None
            kept = []
            for i, before in zip(sources, outer):
                get, put = _RANDOM_SOURCES[i]
                drawn = get()
                if not (probing and i > 0 and _same_state(drawn, states[i])):  # else not drawn from: dropped
                    kept.append(i)
                states[i] = drawn
                put(before)
            if probing:
                self._sources = self._loader._sources = kept

    def __len__(self) -> int:
        return len(self._batches)


class WholeSplitSampler(DistributedSampler):
    """Every item of ``sampler``, in its order, in every process: the evaluation loaders' sampler.

    Decision (ours): with several processes, every process evaluates the global model (the same on all of them) on
    the whole split, so validation and test metrics are exactly one process's. Lightning would otherwise replace an
    evaluation loader's sampler with a ``DistributedSampler``, which pads the split to a multiple of the processes by
    repeating samples (or whole batches of the in-memory path), and a value logged without ``sync_dist`` would be
    process 0's share alone. Being a ``DistributedSampler``, this one is left as it is. The cost: each process
    evaluates every sample (evaluation is not split across processes); a value logged with ``sync_dist=True`` and
    ``reduce_fx="sum"`` counts each sample once per process."""

    def __init__(self, sampler: Any):
        super().__init__(range(len(sampler)), num_replicas=1, rank=0, shuffle=False)  # no process-group reads
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class ClientDataLoader(DataLoader):
    """A client's per-sample DataLoader (:meth:`FederatedDataModule.client_dataloader`).

    With ``num_workers > 0`` it is a plain DataLoader: each worker's random states are seeded from the loader's base
    seed, which its seeded ``generator`` gives. Without workers, the samples would be fetched under the process's
    global random states, so a random augmentation in the data set (torchvision transforms, the bundled CIFAR crop
    and flip, noise drawn in ``__getitem__``) would draw from whatever the process drew before: the model's random
    stream in sequential training, the same restored state at every round in vectorized training (which loads the
    round's batches ahead). Decision (ours): every iteration of a loader without workers fetches under random states
    of its own, seeded as the DataLoader seeds its worker 0 (torch's CPU generator and ``random`` with the base seed,
    numpy with torch's derivation), and kept between batches; the process's states are put back after each batch.
    So augmentations depend only on ``(seed, round, client)``, both execution modes draw the same ones, a resumed
    run draws what the uninterrupted one did, and ``num_workers=0`` and ``num_workers=1`` serve equal batches.
    ``torch.utils.data.get_worker_info()`` stays None in this process."""

    #: indices of :data:`_RANDOM_SOURCES` swapped around each batch; None until a first batch showed which the data
    #: set draws from (:class:`_SeededFetches`)
    _sources: list[int] | None = None

    def __init__(self, dataset: Dataset, **options: Any) -> None:
        super().__init__(dataset, **options)
        self._options = options

    def one_pass(self, steps: int) -> Iterator[Any]:
        """Exactly ``steps`` batches in one pass of a loader (what :func:`reiterate` gives for this loader): the
        index batches of the epochs that re-iterating would take (the same permutations, drawn in the same order
        from the batch sampler's generator), concatenated, and fetched by one iterator, whose base seed is the one
        the first epoch's iterator would draw.

        Decision (ours, measured): re-iterating a loader with workers starts its worker processes again for every
        local epoch of every client (a client with fewer samples than the batch size has an epoch per step); one
        pass per client and round starts them once (3.4x faster with 2 workers, ``benchmarks/loader_workers.py``;
        docs/benchmarks_data.md). The random states of the fetches (workers', or the
        loader's own without workers) are seeded once per client and round and go on across its epochs, the same
        with and without workers. A batch sampler other than :class:`ClientBatchSampler` is re-iterated."""
        epoch = getattr(self.batch_sampler, "epoch", None)
        if epoch is None:
            yield from _cycled(self, steps)
            return
        batches: list[Tensor] = []
        while len(batches) < steps:
            more = epoch()
            if not more:
                raise RuntimeError("the client's data loader yielded no batch (a client without samples?)")
            batches.extend(more[: steps - len(batches)])
        options = {**self._options, "batch_sampler": batches}
        if options.get("num_workers", 0) > 0:
            options["persistent_workers"] = False  # one pass: nothing to keep the workers for
        yield from ClientDataLoader(self.dataset, **options)

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        if self.num_workers > 0:
            return batches
        base_seed = getattr(batches, "_base_seed", None)  # torch's iterator draws it from the loader's generator
        if base_seed is None:  # pragma: no cover - a torch without that attribute: one draw of our own
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        return _SeededFetches(batches, int(base_seed), self)


class ArrayBatchLoader:
    """A minimal loader over an :class:`ArrayDataset`: iterating yields ``dataset[batch_indices]`` for each index
    batch of ``batch_sampler``. It behaves like ``DataLoader(dataset, batch_sampler=...)`` (same batches, same
    order) without the per-batch overhead of the DataLoader machinery, which dominates for small models."""

    def __init__(self, dataset: ArrayDataset, batch_sampler: Sampler):
        self.dataset = dataset
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        take = _row_taker(self.dataset)
        for idx in self.batch_sampler:
            yield take(idx)

    def iter_steps(self, steps: int) -> Iterator[tuple[Any, Any]]:
        """Exactly ``steps`` batches, a new epoch (new permutation) whenever one runs out: the batches that
        re-iterating this loader gives (:func:`reiterate`), with one permutation and one split per epoch and no
        nested generators (the per-step cost matters for small models)."""
        epoch = getattr(self.batch_sampler, "epoch", None)
        if epoch is None:
            yield from reiterate(self, steps)
            return
        take = _row_taker(self.dataset)
        done = 0
        while done < steps:
            batches = epoch()
            if not batches:
                raise RuntimeError("the client's data loader yielded no batch (a client without samples?)")
            for idx in batches[: steps - done]:
                yield take(idx)
            done += len(batches)


def reiterate(loader: Iterable, steps: int) -> Iterator[Any]:
    """Exactly ``steps`` batches of ``loader``, calling ``iter(loader)`` again whenever it runs out (a new shuffled
    epoch over a client's data): the batches a client takes from any loader, and the ones ``iter_steps`` of
    :class:`ArrayBatchLoader` must give. A :class:`ClientDataLoader` gives them in one pass
    (:meth:`ClientDataLoader.one_pass`). It lives with the loaders so that they, the client trainer
    (:mod:`fedlightning.client`, one layer up) and the vectorized engine share it."""
    if isinstance(loader, ClientDataLoader):
        return loader.one_pass(steps)
    return _cycled(loader, steps)


def _cycled(loader: Iterable, steps: int) -> Iterator[Any]:
    """:func:`reiterate` by calling ``iter(loader)`` again whenever it runs out."""
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


def _row_taker(dataset: ArrayDataset):
    """``idx -> (x[idx], y[idx])`` with ``index_select`` (same rows as advanced indexing, less dispatch work)."""
    x, y = dataset.x, dataset.y
    if isinstance(x, Tensor) and isinstance(y, Tensor):

        def take(idx):
            if not isinstance(idx, Tensor):  # index lists from a generic batch sampler
                idx = torch.as_tensor(idx, dtype=torch.long)
            return x.index_select(0, idx), y.index_select(0, idx)

        return take
    return lambda idx: (x[idx], y[idx])


class RoundPlanLoader:
    """The train "data loader" of a federated run: one item per communication round.

    Rounds are numbered from the trainer's ``global_step`` at ``iter()`` time, so a resumed run continues with the
    same clients an uninterrupted run would have sampled (the sample of round ``r`` depends only on
    ``(seed, r)``).
    """

    def __init__(self, datamodule: FederatedDataModule, length: int):
        self.datamodule = datamodule
        self.length = int(length)

    def __len__(self) -> int:
        return self.length

    # Resumable without state: the next round is always the trainer's global step (see class docstring).
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __iter__(self) -> Iterator[RoundPlan]:
        dm = self.datamodule
        trainer = dm._trainer_ref()
        start = int(trainer.global_step) if trainer is not None else 0
        for r in range(start, start + self.length):
            yield dm.round_plan(r)


class FederatedDataModule(pl.LightningDataModule):
    """Base class of every federated data set.

    Args:
        num_clients: number of clients (ignored by natural splits, which define their own).
        batch_size: client mini-batch size ``b``.
        partition: how to split the training set over clients (an :class:`~fedlightning.datamodules.IID`,
            :class:`~fedlightning.datamodules.Dirichlet` or :class:`~fedlightning.datamodules.Shards` instance).
            Default IID.
        seed: seed of the partition (and of any data generation). The *training* randomness (client sampling and
            data order) is seeded by the FederatedLoop's ``seed``.
        eval_batch_size: batch size of the global validation/test loaders.
        num_workers: workers of the evaluation loaders and of per-sample (non in-memory) client loaders.
        rounds_per_epoch: length of one Lightning "epoch" of rounds when ``trainer.max_steps`` is not set.
        val_fraction: fraction of the training data held out as the validation split, in ``[0, 1)``; default
            ``DEFAULT_VAL_FRACTION`` = 0.1 (ours). ``0`` disables validation.

    Your own data sets: ``FederatedDataModule.from_datasets(train, test, ...)`` and
    ``FederatedDataModule.from_datamodule(lightning_datamodule, ...)`` build a
    :class:`~fedlightning.datamodules.DatasetDataModule`. Both are defined in
    :mod:`fedlightning.datamodules.generic` next to that subclass and attached to this class there (this module
    cannot import its own subclass without an import cycle); the package's ``__init__`` imports that module, so
    they are in place whenever this class can be imported.

    Validation split (decisions, ours). The split is drawn once in :meth:`setup`, before the clients are formed,
    with generators seeded by ``(seed, "val")`` (independent of the partition's stream). Validation rows stay in
    the shared training set; ``val_indices`` indexes them and no client index array contains them.

    * *Partitioned data* (no :meth:`natural_clients`): ``ceil(val_fraction · n)`` of the ``n`` training samples
      (scikit-learn's rounding of a fractional ``test_size``: any ``val_fraction > 0`` validates), stratified by
      label with scikit-learn's ``StratifiedShuffleSplit`` (so validation has the training set's class
      proportions); the partitioner then splits the remaining samples. Classes with a single sample cannot be
      stratified: they stay in training, and the others are stratified. When there are fewer validation (or
      remaining training) samples than classes, stratification is impossible and the validation samples are a
      seeded uniform draw (scikit-learn's ``train_test_split``) from the classes with two or more samples. A
      fraction that leaves the training set or any class without a training sample is a ValueError.
    * *Natural splits* (:meth:`natural_clients`, e.g. LEAF users): every user gives ``floor(val_fraction · n_u)``
      of its ``n_u`` training samples (:meth:`user_validation_split`; seeded uniform draw, users in order), so
      validation has the same user population as training; users too small to give one sample keep all (rounding
      down never takes a user's last sample). Sequence data whose samples overlap (Shakespeare windows) hold out
      each user's last windows instead, with a gap (:func:`chronological_holdout`). ``client_val_indices`` holds
      every user's validation rows. When no user can give a sample, validation is empty and a warning says so.
    * ``val_fraction=0``: nothing is held out (the clients split the whole training set, as before any hold-out) and
      :meth:`val_dataloader` returns an empty list, so Lightning skips validation — it never falls back to the test
      set. A callback that monitors a ``val/`` metric (``ModelCheckpoint``, ``EarlyStopping``, ``KDecay``) then
      makes :meth:`val_dataloader` raise a ValueError, since it would otherwise never see its metric.

    Round sampling (:meth:`sample_clients`): ``clients_per_round`` clients drawn uniformly *without* replacement
    within a round and independently across rounds from the clients that hold at least one sample, with a
    generator seeded by ``(seed, "sample", round)``.

    Data checks (decisions, ours; :meth:`setup` runs them once, after the clients are formed; docs/datasets.md has the
    table of checks and messages). A training, test or separate validation set (:meth:`_checked_sets`) held in memory
    (an :class:`ArrayDataset` whose ``x`` is a tensor or array) is scanned for NaN / ±inf inputs, and its 1-D labels
    for values that are not class ids: not finite; negative (integer labels); with :attr:`num_classes` known, not a
    whole number or ``>= num_classes``. The first offending sample of the rows in use (client, validation and test
    rows; rows no split uses are ignored) stops ``setup`` with a ValueError naming the split, the client (and user,
    for natural splits) and the sample's row in its data set, and the value. Float labels without a known
    :attr:`num_classes` are targets of the user's own loss and are only checked for being finite. Data sets that load
    samples lazily (any other ``Dataset``) are not scanned: reading every sample would cost a pass over the data
    (image decoding, transforms); their subclasses check what they read (CIFAR's, MNIST's and LIBSVM's readers check
    labels against their classes). ``check_labels = False`` turns the label checks off (targets that are not class
    ids, e.g. ±1).
    """

    #: Number of classes of the labels when the data set knows it (the bundled data sets;
    #: :class:`~fedlightning.datamodules.DatasetDataModule`'s ``num_classes`` or ``ClassLabel``); None: unknown, so
    #: labels are only checked for being finite and, when integers, non-negative.
    num_classes: int | None = None
    #: Whether :meth:`setup` checks the labels as class ids (the class docstring, "Data checks").
    check_labels: bool = True

    def __init__(
        self,
        num_clients: int = 100,
        batch_size: int = 50,
        partition: Partitioner | None = None,
        seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__()
        self._num_clients = integer("num_clients", num_clients)
        self.batch_size = integer("batch_size", batch_size)
        self.eval_batch_size = integer("eval_batch_size", eval_batch_size)
        self.num_workers = integer("num_workers", num_workers, 0)
        rounds_per_epoch = integer("rounds_per_epoch", rounds_per_epoch)
        self.partition = partition if partition is not None else IID()
        self.seed = integer("seed", seed, minimum=0)
        if self.seed >= 2**32:  # scikit-learn's and numpy's random_state (the stratified splits) take 32-bit seeds
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.rounds_per_epoch = int(rounds_per_epoch)
        self.val_fraction = check_val_fraction(val_fraction)
        self.train_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.client_indices: list[np.ndarray] = []
        self.client_test_indices: list[np.ndarray] | None = None
        #: sorted rows of the training set held out for validation (set by setup)
        self.val_indices: np.ndarray = np.empty(0, dtype=np.int64)
        #: natural splits: every user's validation rows (None for partitioned data)
        self.client_val_indices: list[np.ndarray] | None = None
        # Set by the FederatedLoop (see configure_rounds).
        self.clients_per_round: int | None = None
        self.local_steps: int = 1
        self.local_epochs: float | None = None
        self.sampling_seed: int = 0

    # ------------------------------------------------------------------ to implement
    def load(self) -> tuple[Dataset, Dataset | None, np.ndarray]:
        """Return ``(train_dataset, test_dataset, train_labels)``. ``train_labels`` drives the partitioner."""
        raise NotImplementedError

    def natural_clients(self) -> list[np.ndarray] | None:
        """Override to return a natural split (one index array per user); None means use ``partition``."""
        return None

    def user_validation_split(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(train_positions, val_positions)`` into one user's index array of ``n`` training samples (natural
        splits). Default: ``floor(val_fraction · n)`` positions drawn uniformly without replacement from ``rng``
        (none, and no draw, when that is 0). Override for data whose samples are not exchangeable (Shakespeare's
        overlapping windows use :func:`chronological_holdout`)."""
        k = min(int(math.floor(self.val_fraction * n + _EPS)), n - 1)  # val_fraction < 1 leaves one sample
        if k <= 0:
            return np.arange(n, dtype=np.int64), np.empty(0, dtype=np.int64)
        val = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        return np.setdiff1d(np.arange(n, dtype=np.int64), val, assume_unique=True), val

    def evaluation_view(self) -> Dataset:
        """The training set as the validation and train-evaluation loaders read it: ``train_dataset`` itself by
        default; data sets that augment training samples (CIFAR) return an un-augmented view of the same storage."""
        return self.train_dataset

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        self.train_dataset, self.test_dataset, labels = self.load()
        try:
            self._form_clients(labels)
            self._check_data()
        except BaseException:  # a later setup() must not find a half-checked data set and skip the checks
            self.train_dataset = None
            raise

    def _form_clients(self, labels: Any) -> None:
        """The validation split and the client index arrays (rules: class docstring)."""
        natural = self.natural_clients()
        if natural is not None:
            users = [np.asarray(ix, dtype=np.int64) for ix in natural]
            self.client_indices, self.client_val_indices = self._natural_holdout(users)
            val = [v for v in self.client_val_indices if len(v)]
            self.val_indices = np.sort(np.concatenate(val)) if val else np.empty(0, dtype=np.int64)
            if self.val_fraction > 0 and not len(self.val_indices):
                warnings.warn(
                    f"{type(self).__name__}: val_fraction={self.val_fraction} holds out no validation sample (no "
                    f"user has enough training samples to give one), so validation is skipped; raise val_fraction, or "
                    f"set val_fraction=0 to disable validation explicitly",
                    stacklevel=3,
                )
        else:
            labels = np.asarray(labels)
            if labels.ndim != 1 or len(labels) != len(self.train_dataset):
                raise ValueError(
                    f"{type(self).__name__}.load() returned {labels.shape} train labels for a training set of "
                    f"{len(self.train_dataset)} samples; it must return one label per training sample"
                )
            train_rows, self.val_indices = self._stratified_holdout(labels)
            parts = self.partition(labels[train_rows], self._num_clients, seed=self.seed)
            check_partition(parts, len(train_rows))
            self.client_indices = [train_rows[p] for p in parts]
        self._num_samples = np.array([len(ix) for ix in self.client_indices], dtype=np.int64)
        self._eligible = np.flatnonzero(self._num_samples > 0)

    # ------------------------------------------------------------------ data checks
    def _checked_sets(self) -> list[tuple[str, Dataset | None]]:
        """``(set name, data set)`` of every data set the data checks scan: ``"train"`` and ``"test"``; a subclass
        with a separate validation set adds ``("val", it)``."""
        return [("train", self.train_dataset), ("test", self.test_dataset)]

    def _check_data(self) -> None:
        """The setup-time data checks (class docstring, "Data checks"): a ValueError for the first offending row."""
        for set_name, dataset in self._checked_sets():
            if isinstance(dataset, ArrayDataset):
                rows = self._used_rows(set_name, nonfinite_rows(dataset.x))
                if len(rows):
                    row = int(rows[0])
                    split, owner = self._row_owner(set_name, row)
                    raise ValueError(
                        f"{type(self).__name__}: non-finite input in the {split} split: sample {row} of the "
                        f"{_SET_NAME[set_name]} set{owner} holds {first_nonfinite_value(dataset.x[row])}"
                        f"{_first_of(rows)}; fix or drop it: a NaN or infinite input makes the loss, and through the "
                        f"average the global model, non-finite"
                    )
            labels = self._label_array(set_name) if self.check_labels else None
            if labels is None:
                continue
            rows = self._used_rows(set_name, bad_label_rows(labels, self.num_classes))
            if len(rows):
                row = int(rows[0])
                value = labels[row].item()
                split, owner = self._row_owner(set_name, row)
                problem = label_problem(value, self.num_classes)
                raise ValueError(
                    f"{type(self).__name__}: bad label in the {split} split: sample {row} of the "
                    f"{_SET_NAME[set_name]} set{owner} has label {value!r}{_first_of(rows)}, "
                    f"{self._label_problem_text(problem)}{self._label_hint() if problem != 'not finite' else ''}"
                )

    def _label_array(self, set_name: str) -> np.ndarray | None:
        """The 1-D labels that ``set_name`` (a name of :meth:`_checked_sets`) serves, when known without reading
        samples (an :class:`ArrayDataset`'s ``y``); None: not checked."""
        dataset = dict(self._checked_sets()).get(set_name)
        return as_label_array(dataset.y) if isinstance(dataset, ArrayDataset) else None

    def _labels_by_reading(self, set_name: str) -> np.ndarray | None:
        """The labels of ``set_name`` read from its samples, one pass (:meth:`client_eval_indices`' last source);
        None here: a data module whose labels are not in its samples' structure."""
        return None

    def _num_classes_source(self) -> str:
        """How error messages name where :attr:`num_classes` comes from."""
        return f"num_classes={self.num_classes}"

    def _label_hint(self) -> str:
        """Appended to a label error (subclasses name their way to turn the check off)."""
        return ""

    def _label_problem_text(self, problem: str) -> str:
        c = self.num_classes
        return {
            "not finite": "which is not finite",
            "not a whole number": f"not a whole number, but {self._num_classes_source()} makes the labels class ids",
            "negative": "which is negative: class labels are 0, 1, ..., num_classes - 1",
            "outside": f"outside the classes 0 to {c - 1 if c else 0} of {self._num_classes_source()}",
        }[problem]

    def _used_rows(self, set_name: str, rows: np.ndarray) -> np.ndarray:
        """``rows`` that some split reads: every test row and every row of a separate validation set; training rows
        held by a client or the validation split."""
        if set_name != "train" or not len(rows):
            return rows
        used = [self.val_indices] + [ix for ix in self.client_indices if len(ix)]
        return rows[np.isin(rows, np.concatenate(used))]

    def _row_owner(self, set_name: str, row: int) -> tuple[str, str]:
        """``(split, " (client c ...)")`` of a row of the training (``"train"``), test or separate validation
        (``"val"``) set, for error messages."""
        if set_name == "val":
            return "validation", ""
        if set_name == "test":
            for c, ix in enumerate(self.client_test_indices or []):
                if np.any(ix == row):
                    return "test", f" ({self._client_label(c, 'test')})"
            return "test", ""
        for c, ix in enumerate(self.client_indices):
            if np.any(ix == row):
                return "training", f" ({self._client_label(c, 'train')})"
        for c, ix in enumerate(self.client_val_indices or []):
            if np.any(ix == row):
                return "validation", f" ({self._client_label(c, 'train')})"
        return "validation", ""

    def _client_label(self, client_id: int, set_name: str) -> str:
        """How error messages name a client: ``client 3``, with the user id of natural splits (``client_names``)."""
        names = getattr(self, "client_names", None)
        if names is not None and client_id < len(names):
            return f"client {client_id}, user {names[client_id]!r}"
        return f"client {client_id}"

    def _stratified_holdout(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(train_rows, val_rows)`` (sorted) of a partitioned data set (rules: class docstring)."""
        n = len(labels)
        if self.val_fraction == 0.0:
            return np.arange(n, dtype=np.int64), np.empty(0, dtype=np.int64)
        from sklearn.model_selection import StratifiedShuffleSplit, train_test_split

        f = self.val_fraction
        n_val = int(math.ceil(f * n - _EPS))
        if n_val >= n:
            raise ValueError(
                f"val_fraction={f} holds out {n_val} of the {n} training samples and leaves the training set empty; "
                f"lower val_fraction (0 disables validation)"
            )
        classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        pool = np.flatnonzero(counts[inverse] >= 2)  # rows of the classes that can be stratified
        k = int((counts >= 2).sum())
        random_state = derive_seed(self.seed, "val") % (2**32)
        if n_val > len(pool):  # would need the single samples of classes too: they would vanish from training
            val = np.arange(n)  # reported by the class check below
        elif k <= n_val and k <= len(pool) - n_val:
            splitter = StratifiedShuffleSplit(n_splits=1, test_size=n_val, random_state=random_state)
            _, pos = next(splitter.split(np.zeros((len(pool), 1)), inverse[pool]))
            val = pool[pos]
        else:  # fewer validation (or remaining training) samples than classes: no stratified split exists
            _, val = train_test_split(pool, test_size=n_val, random_state=random_state)
        val = np.sort(np.asarray(val, dtype=np.int64))
        train = np.setdiff1d(np.arange(n, dtype=np.int64), val, assume_unique=True)
        missing = np.setdiff1d(np.arange(len(classes)), np.unique(inverse[train]))
        if len(missing):
            c = int(missing[0])
            label = classes[c].item() if isinstance(classes[c], np.generic) else classes[c]
            raise ValueError(
                f"val_fraction={f} leaves class {label!r} ({int(counts[c])} training sample(s)) without a "
                f"training sample; lower val_fraction (0 disables validation)"
            )
        return train, val

    def _natural_holdout(self, users: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-user ``(train, val)`` index arrays of a natural split (rules: class docstring)."""
        if self.val_fraction == 0.0:
            return users, [np.empty(0, dtype=np.int64) for _ in users]
        rng = np.random.default_rng(derive_seed(self.seed, "val"))
        train, val = [], []
        for ix in users:
            tr, va = self.user_validation_split(len(ix), rng)
            train.append(ix[tr])
            val.append(ix[va])
        return train, val

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            self.setup("fit")

    # ------------------------------------------------------------------ clients
    @property
    def num_clients(self) -> int:
        if self.client_indices:
            return len(self.client_indices)
        return self._num_clients

    def client_num_samples(self, client_id: int) -> int:
        self._require_setup()
        return int(self._num_samples[client_id])

    def clients_with_data(self) -> np.ndarray:
        """The ids of the clients that hold training data, ascending: the clients :meth:`sample_clients` draws from
        (a partition may leave clients empty: ``Dirichlet(min_samples=0)``, a natural split's users without
        training samples). A read-only view of the array kept since setup, so a callback can read it every round
        without a pass over all clients."""
        self._require_setup()
        view = self._eligible.view()
        view.flags.writeable = False
        return view

    def client_dataset(self, client_id: int) -> Dataset:
        self._require_setup()
        return Subset(self.train_dataset, self.client_indices[client_id].tolist())

    #: DataLoader options of the per-sample loaders (set by :class:`~fedlightning.datamodules.DatasetDataModule`;
    #: the bundled modules keep these defaults): the user's ``collate_fn`` (None: torch's default collate), and
    #: ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ``worker_init_fn`` as ``DataLoader`` takes them.
    #: ``drop_last`` applies to client loaders only (:class:`ClientBatchSampler`); evaluation reads every sample.
    collate_fn: Any | None = None
    drop_last: bool = False
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    worker_init_fn: Any | None = None

    def _check_client_id(self, client_id: int) -> None:
        if not 0 <= client_id < self.num_clients:
            raise IndexError(f"client_id {client_id} out of range [0, {self.num_clients})")

    def client_batch_sampler(self, client_id: int, round: int = 0, seed: int | None = None) -> ClientBatchSampler:
        """The index batches of :meth:`client_dataloader` (the same sampler, seeded the same way), without a loader:
        for a vectorised round that gathers the rows itself (:meth:`in_memory_train_data`)."""
        self._require_setup()
        self._check_client_id(client_id)
        seed = self.sampling_seed if seed is None else seed
        gen = torch.Generator().manual_seed(derive_seed(seed, "data", round, client_id))
        return ClientBatchSampler(self.client_indices[client_id], self.batch_size, gen, drop_last=self.drop_last)

    def in_memory_train_data(self) -> ArrayDataset | None:
        """The training :class:`ArrayDataset` when every client loader is an :class:`ArrayBatchLoader` over it with
        :meth:`client_batch_sampler`'s sampler (in-memory tensors, no ``collate_fn``, reference mode off, and
        neither :meth:`client_dataloader` nor its loader construction overridden), else None: a caller may then
        gather ``dataset[sampler batch]`` itself, e.g. on the accelerator, and get the loader's batches."""
        cls = type(self)
        if (
            cls.client_dataloader is not FederatedDataModule.client_dataloader
            or cls._loader_from_batches is not FederatedDataModule._loader_from_batches
            or cls.client_batch_sampler is not FederatedDataModule.client_batch_sampler
            or not isinstance(self.train_dataset, ArrayDataset)
            or self.collate_fn is not None
            or reference_mode()
        ):
            return None
        return self.train_dataset

    def client_dataloader(self, client_id: int, round: int = 0, seed: int | None = None) -> DataLoader:
        """Shuffled epochs over client ``client_id``'s samples (last partial batch kept unless ``drop_last``): each
        pass over the loader is one epoch, and the next pass a new shuffle. A client's round takes its ``K`` batches
        from consecutive passes (``fedlightning.client``), so to rebuild a round's batches by hand iterate the same
        loader again until ``K`` batches are taken.

        The data order is seeded by ``(seed, "data", round, client_id)`` (``seed`` defaults to the sampling seed
        the FederatedLoop configured), so it does not depend on which other clients ran before. With
        ``num_workers > 0`` the workers' base seed comes from a generator seeded by ``(seed, "workers", round,
        client_id)`` (ours), so random transforms in workers are reproducible too.
        """
        sampler = self.client_batch_sampler(client_id, round, seed)
        seed = self.sampling_seed if seed is None else seed
        workers = torch.Generator().manual_seed(derive_seed(seed, "workers", round, client_id))
        return self._loader_from_batches(self.train_dataset, sampler, workers=self.num_workers, generator=workers)

    def client_full_dataloader(self, client_id: int, batch_size: int | None = None):
        """Client ``client_id``'s training samples in index order, unshuffled, as one batch (``batch_size`` None)
        or consecutive chunks of ``batch_size`` (the last one shorter; ``drop_last`` does not apply: every sample is
        read), collated as :meth:`client_dataloader` collates them (the user's ``collate_fn`` and loader options;
        one tensor indexing per batch for in-memory tensors without one), in this process (no worker processes):
        the batches of a client's full-batch gradient (FedDANE's gradient phase, Mime's full gradient). The batches
        are the data set's, on the CPU, as any loader gives them: the Trainer's device transfer and precision
        conversion (``precision="64-true"`` makes float inputs float64) are applied by the loop's own uses
        (``FederatedLoop.client_full_gradients``), not here; a callback that reads them itself applies
        ``trainer.strategy.batch_to_device`` and ``trainer.precision_plugin.convert_input``."""
        self._require_setup()
        self._check_client_id(client_id)
        indices = self.client_indices[client_id]
        batch_size = integer("batch_size", batch_size, 1, allow_none=True, show_name=True)
        chunk = max(len(indices), 1) if batch_size is None else batch_size
        sampler = ClientBatchSampler(indices, chunk, None, shuffle=False)
        return self._loader_from_batches(self.train_dataset, sampler, workers=0)

    def client_eval_indices(
        self, split: str = "test", assignment: str = "labels", seed: int | None = None
    ) -> list[np.ndarray]:
        """Each client's own evaluation rows: one sorted ``int64`` array per client, rows of :attr:`test_dataset`
        (``split="test"``) or of the training set (``split="val"``; read through :meth:`evaluation_view`).

        * Data sets with per-client evaluation rows (natural splits: LEAF users, Synthetic devices, Shakespeare
          roles): :attr:`client_test_indices` (``"test"``) or :attr:`client_val_indices` (``"val"``), the user's own
          samples; ``assignment`` and ``seed`` are not used.
        * Partitioned data (decisions, ours): the split's rows are dealt to the clients. ``assignment="labels"``
          (default) matches labels, so that every client's evaluation labels follow its training label
          distribution: for each class ``c`` with ``m_c`` rows in the split, client ``i`` with ``n_ic`` of the
          ``N_c = Σ_i n_ic`` client training samples of class ``c`` gets ``⌊m_c·n_ic / N_c⌋`` rows, and the rows
          left over go one each to the clients with the largest remainders ``m_c·n_ic mod N_c`` (ties: lower client
          id; the largest-remainder rule, in exact integers). The class's rows are shuffled by one generator seeded
          with ``derive_seed(seed, "client-eval", split)`` (classes in sorted order) and dealt in client order. Every
          row of a class that some client trains on goes to exactly one client; rows of a class no client trains on
          go to none (a warning counts them). ``assignment="size"`` applies the same rule to all the split's rows
          as one class (``n_i``: the client's training samples), for data without class labels. The labels are
          those the data checks read (an in-memory data set's ``y``; the label sources of
          :class:`~fedlightning.datamodules.DatasetDataModule`, the training labels given with ``labels=`` among
          them), else the data set's 1-D ``targets`` or ``labels`` attribute (torchvision's convention; CIFAR's
          images), else, for :class:`~fedlightning.datamodules.DatasetDataModule`, the labels its samples hold
          (read once, for this call: ``_labels_by_reading``); without whole-number labels for both sets
          ``assignment="labels"`` is a ValueError naming ``assignment="size"``.

        Args:
            split: ``"test"`` or ``"val"``.
            assignment: ``"labels"`` or ``"size"`` (partitioned data only).
            seed: the shuffle's seed (default: the data module's ``seed``).
        """
        if split not in ("test", "val") or assignment not in ("labels", "size"):
            raise ValueError(
                f"client_eval_indices: split must be 'test' or 'val' and assignment 'labels' or 'size', "
                f"got split={split!r}, assignment={assignment!r}"
            )
        self._require_setup()
        own = self.client_test_indices if split == "test" else self.client_val_indices
        if own is not None:
            return [np.sort(np.asarray(ix, dtype=np.int64)) for ix in own]
        if split == "test" and self.test_dataset is None:
            raise RuntimeError(f"{type(self).__name__} has no test set")
        rows = np.arange(len(self.test_dataset), dtype=np.int64) if split == "test" else np.asarray(self.val_indices)
        num_clients = len(self.client_indices)
        if not len(rows):
            return [np.empty(0, dtype=np.int64) for _ in range(num_clients)]
        owner = np.full(len(self.train_dataset), -1, dtype=np.int64)
        for i, ix in enumerate(self.client_indices):
            owner[ix] = i
        if assignment == "size":
            groups = [(rows, self._num_samples.astype(np.int64))]
        else:

            def labels_of(set_name: str) -> np.ndarray | None:
                known = self._label_array(set_name)
                if known is None:
                    dataset = self.train_dataset if set_name == "train" else self.test_dataset
                    for attr in ("targets", "labels"):
                        known = as_label_array(getattr(dataset, attr, None))
                        if known is not None and len(known) == len(dataset):
                            break
                        known = None
                if known is None:
                    known = self._labels_by_reading(set_name)
                if known is not None and known.dtype.kind == "f":
                    with np.errstate(invalid="ignore"):
                        known = known if bool(np.all(known == np.round(known))) else None  # NaN, inf: not classes
                return known

            train_labels = labels_of("train")
            eval_labels = train_labels if split == "val" else labels_of("test")
            if train_labels is None or eval_labels is None:
                raise ValueError(
                    f"{type(self).__name__}: per-client {split} data with assignment='labels' deals the {split} "
                    f"samples to the clients by class label, but the {'training' if train_labels is None else 'test'} "
                    f"set has no known class labels (one whole number per sample); use assignment='size' to deal them "
                    f"in proportion to the clients' training sizes"
                )
            eval_labels = eval_labels[rows]
            classes, inverse = np.unique(eval_labels, return_inverse=True)
            held = owner >= 0
            pos = np.minimum(np.searchsorted(classes, train_labels[held]), len(classes) - 1)
            match = classes[pos] == train_labels[held]  # client training samples of a class the split holds
            counts = np.zeros((len(classes), num_clients), dtype=np.int64)
            np.add.at(counts, (pos[match], owner[held][match]), 1)
            groups = [(rows[inverse.reshape(-1) == c], counts[c]) for c in range(len(classes))]
        rng = np.random.default_rng(derive_seed(self.seed if seed is None else int(seed), "client-eval", split))
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        unassigned = 0
        for group, weights in groups:
            total, m = int(weights.sum()), len(group)
            if total == 0:
                unassigned += m
                continue
            quota, remainder = np.divmod(m * weights, total)
            order = np.lexsort((np.arange(num_clients), -remainder))  # largest remainder first, then lower id
            quota[order[: m - int(quota.sum())]] += 1
            dealt = group[rng.permutation(m)]
            bounds = np.concatenate([[0], np.cumsum(quota)])
            for i in np.flatnonzero(quota):
                parts[i].append(dealt[bounds[i] : bounds[i + 1]])
        if unassigned:
            warnings.warn(
                f"{type(self).__name__}: {unassigned} {split} sample(s) have a class that no client trains on and "
                f"belong to no client's {split} data",
                stacklevel=2,
            )
        return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.empty(0, dtype=np.int64) for p in parts]

    def _loader_options(self, workers: int) -> dict:
        """The user's DataLoader options (class attributes above) for a per-sample loader with ``workers``."""
        options = dict(
            num_workers=workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            worker_init_fn=self.worker_init_fn,
        )
        if workers > 0:
            options.update(persistent_workers=self.persistent_workers, prefetch_factor=self.prefetch_factor)
        return options

    def _loader_from_batches(
        self, dataset: Dataset, batch_sampler: Sampler, workers: int = 0, generator: torch.Generator | None = None
    ):
        if isinstance(dataset, ArrayDataset) and self.collate_fn is None and not reference_mode():
            # batched fast path: one tensor indexing per batch, no per-sample fetch/collate, no DataLoader machinery
            return ArrayBatchLoader(dataset, batch_sampler)
        return ClientDataLoader(
            dataset, batch_sampler=batch_sampler, generator=generator, **self._loader_options(workers)
        )

    # ------------------------------------------------------------------ rounds
    def client_batches_per_epoch(self, client_id: int) -> int:
        """Mini-batches in one epoch of ``client_dataloader(client_id)``: ``⌈n_i/b⌉``, or ``⌊n_i/b⌋`` with
        ``drop_last`` (a client with fewer than ``b`` samples: one batch, :class:`ClientBatchSampler`; a client
        without samples, which is never sampled: none)."""
        self._require_setup()
        n, b = self.client_num_samples(client_id), int(self.batch_size)
        if self.drop_last and n >= b:
            return n // b
        return math.ceil(n / b)

    def client_epoch_steps(self, client_id: int, epochs: float) -> int:
        """Local steps of client ``client_id`` for ``epochs`` local epochs: ``⌈E · B_i⌉`` with ``B_i``
        :meth:`client_batches_per_epoch`, at least 1 (:func:`epoch_steps`)."""
        return epoch_steps(epochs, self.client_batches_per_epoch(client_id))

    def configure_rounds(
        self, clients_per_round: int, local_steps: int | None, seed: int, local_epochs: float | None = None
    ) -> None:
        """Called by the FederatedLoop at setup: how many clients a round samples, with which seed, and how many
        local steps each runs (``local_steps`` for all, or ``local_epochs``: :meth:`client_epoch_steps` each)."""
        self._require_setup()
        eligible = len(self._eligible)
        clients_per_round = integer("clients_per_round", clients_per_round)
        if clients_per_round > eligible:
            fix = (
                " (the clients are the data's own users, a natural split, which num_clients does not change)"
                if self.natural_clients() is not None
                else " or use more clients"
            )
            raise ValueError(
                f"clients_per_round={clients_per_round} exceeds the number of clients with data ({eligible} of "
                f"{self.num_clients}); lower clients_per_round{fix}"
            )
        self.clients_per_round = int(clients_per_round)
        self.local_epochs = None if local_epochs is None else float(local_epochs)
        self.local_steps = int(local_steps) if local_steps is not None else 1
        self.sampling_seed = int(seed)

    def sample_clients(self, round: int) -> list[int]:
        if self.clients_per_round is None:
            raise RuntimeError("configure_rounds() has not been called; use the data module with a FederatedLoop")
        gen = torch.Generator().manual_seed(derive_seed(self.sampling_seed, "sample", round))
        pick = torch.randperm(len(self._eligible), generator=gen)[: self.clients_per_round]
        return [int(self._eligible[i]) for i in pick.tolist()]

    def round_plan(self, round: int) -> RoundPlan:
        """Round ``round``'s clients and local steps (with ``local_epochs``: each client's own, in
        ``plan.client_steps``, and ``plan.local_steps`` the largest)."""
        clients = self.sample_clients(round)
        if self.local_epochs is None:
            return RoundPlan(round=round, client_ids=clients, local_steps=self.local_steps)
        steps = {cid: self.client_epoch_steps(cid, self.local_epochs) for cid in clients}
        return RoundPlan(round=round, client_ids=clients, local_steps=max(steps.values()), client_steps=steps)

    def _trainer_ref(self):
        return getattr(self, "trainer", None)

    def train_dataloader(self) -> RoundPlanLoader:
        """The rounds as Lightning's training batches: one epoch of ``max_steps`` rounds when ``trainer.max_steps``
        is set (else epochs of ``rounds_per_epoch``). After a resume from a checkpoint written mid-epoch the epoch
        keeps its length from its own first round (``global_step`` minus the epoch's rounds done), so that it ends,
        and validations tied to it (``check_val_every_n_epoch``, a fractional ``val_check_interval``) fall, at the
        rounds of the uninterrupted run."""
        trainer = self._trainer_ref()
        length = self.rounds_per_epoch
        if trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0:
            epoch_start = max(0, trainer.global_step - batches_in_epoch(trainer))
            length = max(1, trainer.max_steps - epoch_start)
        return RoundPlanLoader(self, length)

    # ------------------------------------------------------------------ global evaluation
    def _eval_loader(
        self,
        dataset: Dataset | None,
        indices: np.ndarray | None = None,
        batch_size: int | None = None,
        workers: int | None = None,
        batch_indices: bool = False,
    ) -> DataLoader:
        """Sequential batches of ``batch_size`` (None: ``eval_batch_size``) over ``dataset`` (or its rows
        ``indices``), loaded by ``workers`` processes (None: ``num_workers``). An :class:`ArrayDataset` is read a
        whole batch per tensor indexing (the in-memory fast path), unless ``batch_indices``: then every loader is a
        DataLoader with a batch size, whose batches' sample indices Lightning records for a prediction writer."""
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__} has no evaluation data set")
        size = self.eval_batch_size if batch_size is None else int(batch_size)
        fast = not batch_indices and self.collate_fn is None and not reference_mode()
        if isinstance(dataset, ArrayDataset) and fast:
            rows = np.arange(len(dataset)) if indices is None else indices
            sampler = WholeSplitSampler(ClientBatchSampler(rows, size, None, shuffle=False))
            return DataLoader(dataset, sampler=sampler, batch_size=None)  # a real DataLoader for Lightning
        if indices is not None:
            dataset = Subset(dataset, np.asarray(indices).tolist())
        workers = self.num_workers if workers is None else int(workers)
        sampler = WholeSplitSampler(SequentialSampler(dataset))
        return DataLoader(dataset, batch_size=size, sampler=sampler, **self._loader_options(workers))

    def evaluation_rows(self, split: str) -> tuple[Dataset | None, np.ndarray]:
        """``(data set, rows)`` a split's evaluation reads: ``"train"`` the clients' training samples
        (:meth:`training_rows`) and ``"val"`` the validation hold-out (``val_indices``), both of the training set as
        evaluation reads it (:meth:`evaluation_view`: un-augmented); ``"test"`` every row of the test set. A data
        module with a separate validation set returns it for ``"val"``."""
        self._require_setup()
        if split == "train":
            return self.evaluation_view(), self.training_rows()
        if split == "val":
            return self.evaluation_view(), np.asarray(self.val_indices, dtype=np.int64)
        if split == "test":
            n = 0 if self.test_dataset is None else len(self.test_dataset)
            return self.test_dataset, np.arange(n, dtype=np.int64)
        raise ValueError(f"split={split!r} must be 'train', 'val' or 'test'")

    def evaluation_dataloader(
        self, split: str, rows: np.ndarray | None = None, batch_size: int | None = None
    ) -> DataLoader:
        """Sequential batches over ``rows`` (None: all of the split's, :meth:`evaluation_rows`) of a split's
        evaluation data set, ``batch_size`` samples each (None: ``eval_batch_size``), collated as the validation and
        test loaders collate them (the user's ``collate_fn``; one tensor indexing per batch for in-memory tensors
        without one), loaded in this process (no worker processes): what a callback evaluating the global model on a
        subset reads."""
        dataset, split_rows = self.evaluation_rows(split)
        batch_size = integer("batch_size", batch_size, 1, allow_none=True, show_name=True)
        return self._eval_loader(dataset, split_rows if rows is None else rows, batch_size, workers=0)

    def _val_monitors(self) -> list[str]:
        trainer = self._trainer_ref()
        found = []
        for cb in getattr(trainer, "callbacks", None) or []:
            monitor = getattr(cb, "monitor", None)
            if isinstance(monitor, str) and monitor.startswith("val/"):
                found.append(f"{type(cb).__name__}(monitor={monitor!r})")
        return found

    def val_dataloader(self):
        """The validation split (``val_indices`` rows of the training set, un-augmented), sequential.

        With no validation rows (``val_fraction=0``, or a natural split whose users are all too small) this is an
        empty list, so Lightning skips validation; a callback monitoring a ``val/`` metric then raises a ValueError.
        """
        self._require_setup()
        if len(self.val_indices) == 0:
            monitors = self._val_monitors()
            if monitors:
                raise ValueError(
                    f"{type(self).__name__} has no validation split (val_fraction={self.val_fraction}) but "
                    f"{', '.join(monitors)} monitors a validation metric; set data val_fraction > 0 (e.g. "
                    f"{DEFAULT_VAL_FRACTION}) or monitor another metric"
                )
            return []
        return self._eval_loader(self.evaluation_view(), self.val_indices)

    def test_dataloader(self) -> DataLoader:
        """The global test set, sequential."""
        self._require_setup()
        return self._eval_loader(self.test_dataset)

    def predict_dataloader(self) -> DataLoader:
        """The global test set in :meth:`test_dataloader`'s order and batches (Lightning's ``predict`` stage: the
        global model's ``predict_step`` over the test split; decision, ours: the data modules hold no other unlabelled
        split). A subclass defines its own to predict on other data.

        Decision (ours): an in-memory test set is read sample by sample here, not a whole batch per tensor indexing
        as the evaluation loaders read it, so that Lightning records each batch's test-set indices
        (``BasePredictionWriter``'s ``batch_indices``), which map the predictions to their samples; the batches
        hold the same values."""
        self._require_setup()
        return self._eval_loader(self.test_dataset, batch_indices=True)

    def training_rows(self) -> np.ndarray:
        """Sorted rows of the training set that clients hold (the union of ``client_indices``; no validation row)."""
        self._require_setup()
        parts = [ix for ix in self.client_indices if len(ix)]
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def train_eval_dataloader(self) -> DataLoader:
        """The clients' training samples (:meth:`training_rows`), un-augmented and sequential (global-model
        training loss/accuracy)."""
        self._require_setup()
        return self._eval_loader(self.evaluation_view(), self.training_rows())

    def statistics(self) -> dict:
        """Clients and training samples per client (mean, std, min, max) of the split, and the validation size."""
        self._require_setup()
        n = self._num_samples
        return {
            "clients": int(len(n)),
            "samples": int(n.sum()),
            "samples_per_client_mean": float(n.mean()),
            "samples_per_client_std": float(n.std()),
            "samples_per_client_min": int(n.min()),
            "samples_per_client_max": int(n.max()),
            "validation_samples": int(len(self.val_indices)),
        }
