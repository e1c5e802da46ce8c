"""Partitioners: split a labelled data set over clients.

Every partitioner is a callable ``partitioner(labels, num_clients, seed) -> list[np.ndarray]`` returning one
sorted ``int64`` index array per client; the arrays are disjoint and together cover ``range(len(labels))``.
They are seeded by the ``seed`` argument only (a private ``numpy.random.Generator``), never by global state.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from fedlightning._validation import integer, positive

__all__ = ["Partitioner", "IID", "Dirichlet", "DirichletEqualSizes", "Shards", "ClassShards", "check_partition"]


class Partitioner:
    """Base class; subclasses implement :meth:`split`."""

    def __call__(self, labels: Sequence[int] | np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        labels = np.asarray(labels)
        if labels.ndim != 1:
            raise ValueError(f"labels must be a 1-D array, got shape {labels.shape}")
        num_clients = integer("num_clients", num_clients)
        if num_clients > len(labels):
            raise ValueError(
                f"num_clients={num_clients} exceeds the number of samples ({len(labels)}): some clients would be empty"
            )
        parts = self.split(labels, int(num_clients), np.random.default_rng(seed))
        return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class IID(Partitioner):
    """Uniformly random split into ``num_clients`` parts whose sizes differ by at most one."""

    def split(self, labels, num_clients, rng):
        return np.array_split(rng.permutation(len(labels)), num_clients)


class Dirichlet(Partitioner):
    r"""Label-skewed split: for every class ``k`` draw ``p_k ~ Dir(α·1_N)`` over the ``N`` clients and deal the
    (shuffled) samples of class ``k`` to clients in proportions ``p_k``.

    This is the per-class Dirichlet split of Yurochkin et al. 2019 and Wang et al. 2020 (FedMA; seed 002's CIFAR
    split) in the form of NIID-Bench (Li et al. 2021); client sizes differ. Small α gives few classes per client;
    α → ∞ approaches IID label proportions. Hsu et al. 2019 ("Measuring the effects of non-identical data
    distribution") draw the proportions per client instead, with equal client sizes in FedExP's reference code
    (seed 000's CIFAR setup): :class:`DirichletEqualSizes`.

    Args:
        alpha: concentration α > 0.
        min_samples: every client receives at least this many samples. Decision (ours): the whole draw is
            repeated until it holds (as NIID-Bench's ``min_require_size`` loop), at most ``max_retries`` times;
            if it still fails (very small α or many clients), the last draw is *repaired* by moving randomly chosen
            samples from the currently largest clients to the deficient ones, so the split always exists and stays
            seeded. Default 1, so no client is ever empty.
        max_retries: see ``min_samples`` (default 10, ours); 0 and 1 both draw once (0: repair at once, the fast
            setting for very many clients, docs/benchmarks_data.md); negative is an error.
    """

    def __init__(self, alpha: float = 0.3, min_samples: int = 1, max_retries: int = 10):
        self.alpha = positive("alpha", alpha, label="Dirichlet alpha", show_name=True)
        self.min_samples = integer("min_samples", min_samples, 0)
        self.max_retries = integer("max_retries", max_retries, minimum=0)

    def split(self, labels, num_clients, rng):
        if self.min_samples * num_clients > len(labels):
            raise ValueError(
                f"min_samples={self.min_samples} x num_clients={num_clients} exceeds the {len(labels)} samples"
            )
        classes = np.unique(labels)
        by_class = [np.flatnonzero(labels == k) for k in classes]
        parts: list[np.ndarray] = []
        for _ in range(max(1, self.max_retries)):
            parts = self._draw(by_class, num_clients, rng)
            if min(len(p) for p in parts) >= self.min_samples:
                return parts
        return self._repair(parts, rng)

    def _draw(self, by_class, num_clients, rng) -> list[np.ndarray]:
        owner_chunks, index_chunks = [], []
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, self.alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            # client c gets idx[cuts[c-1]:cuts[c]]: label every position with its owner, vectorised
            owner_chunks.append(np.searchsorted(cuts, np.arange(len(idx)), side="right"))
            index_chunks.append(idx)
        owners = np.concatenate(owner_chunks)
        indices = np.concatenate(index_chunks)
        order = np.argsort(owners, kind="stable")
        bounds = np.searchsorted(owners[order], np.arange(num_clients + 1))
        return [indices[order[bounds[c] : bounds[c + 1]]] for c in range(num_clients)]

    def _repair(self, parts: list[np.ndarray], rng) -> list[np.ndarray]:
        """Deficient clients, in index order, take samples from the currently largest client (the lowest index
        among equals, as ``np.argmax`` picks) until they hold ``min_samples``. The largest client comes from a heap
        of ``(−size, client)`` entries, an entry pushed at every size change and stale ones dropped when they
        surface, so each move costs ``O(log N)``, not a scan of all ``N`` clients (ours, measured:
        docs/benchmarks_data.md)."""
        parts = [rng.permutation(p) for p in parts]
        sizes = [len(p) for p in parts]
        heap = [(-n, c) for c, n in enumerate(sizes)]
        heapq.heapify(heap)
        for c in [c for c, n in enumerate(sizes) if n < self.min_samples]:
            while sizes[c] < self.min_samples:
                while -heap[0][0] != sizes[heap[0][1]]:  # stale: that client's size changed since
                    heapq.heappop(heap)
                donor = heap[0][1]
                take = int(min(self.min_samples - sizes[c], sizes[donor] - self.min_samples))
                parts[c] = np.concatenate([parts[c], parts[donor][:take]])
                parts[donor] = parts[donor][take:]
                sizes[c] += take
                sizes[donor] -= take
                heapq.heappush(heap, (-sizes[c], c))
                heapq.heappush(heap, (-sizes[donor], donor))
        return parts


class DirichletEqualSizes(Partitioner):
    r"""Label-skewed split with equal client sizes: every client ``i`` draws its class proportions
    ``q_i ~ Dir(α·1_K)`` over the ``K`` classes and receives ``⌊N/n⌋`` samples (``⌊N/n⌋ + 1`` for ``N mod n`` of
    them), each of a class drawn from ``q_i``.

    This is the split of Hsu et al. 2019 (one Dirichlet draw of class proportions per client) in the form of
    FedExP's reference code (``getDirichletData_equal``; seed 000's CIFAR-10/100 setup builds on that code): until
    every sample is dealt, a client is drawn uniformly among those not yet full, a class from its ``q_i``, and the
    next unused sample of that class (in index order) is the client's. :class:`Dirichlet` is the other common form
    (one draw per class over the clients, unequal client sizes).

    Decisions (ours): where the reference draws again when the drawn class has no sample left, the class is drawn
    from ``q_i`` restricted to the classes that have samples left (the same distribution, and it ends when the
    client's remaining mass is tiny); when all of that mass is on used-up classes (a small α underflows the other
    proportions to 0, where the reference would draw forever) the class is uniform over those with samples left.
    Where the reference leaves the ``N mod n`` samples of a division with a remainder out, they go to ``N mod n``
    clients chosen uniformly (one extra sample each), so the split covers the data set as every partitioner does.
    With the CIFAR training sets split over 100 clients the division is exact (50,000 or 45,000 samples: 500 or
    450 each).

    Args:
        alpha: concentration α > 0 (seed 000: 0.3).
    """

    def __init__(self, alpha: float = 0.3):
        self.alpha = positive("alpha", alpha, label="Dirichlet alpha", show_name=True)

    def split(self, labels, num_clients, rng):
        classes, codes = np.unique(labels, return_inverse=True)
        pools = [np.flatnonzero(codes == k) for k in range(len(classes))]
        left = np.array([len(p) for p in pools], dtype=np.int64)
        taken = np.zeros(len(classes), dtype=np.int64)
        q = rng.dirichlet(np.full(len(classes), self.alpha), size=num_clients)
        m, extra = divmod(len(labels), num_clients)
        capacity = np.full(num_clients, m, dtype=np.int64)
        capacity[rng.choice(num_clients, size=extra, replace=False)] += 1
        open_clients = [c for c in range(num_clients) if capacity[c] > 0]
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for _ in range(len(labels)):
            slot = int(rng.integers(len(open_clients)))
            c = open_clients[slot]
            available = np.flatnonzero(left > 0)
            mass = np.cumsum(q[c][available])
            if mass[-1] > 0:
                j = int(np.searchsorted(mass, rng.random() * mass[-1], side="right"))
            else:  # every class of the client's (underflowing) proportions is used up: any class with samples left
                j = int(rng.integers(len(available)))
            k = int(available[min(j, len(available) - 1)])
            parts[c].append(int(pools[k][taken[k]]))
            taken[k] += 1
            left[k] -= 1
            if len(parts[c]) == capacity[c]:
                open_clients[slot] = open_clients[-1]
                open_clients.pop()
        return [np.asarray(p, dtype=np.int64) for p in parts]


class Shards(Partitioner):
    """Pathological non-IID split of McMahan et al. 2017: sort by label, cut into ``num_clients·classes_per_client``
    equal shards, give each client ``classes_per_client`` random shards. A shard that straddles a class boundary
    adds a class, and two shards of one class give one fewer: with MNIST's class sizes and 100 clients, 2 shards
    each, a few clients see 3 classes or 1. :class:`ClassShards` gives every client exactly ``classes_per_client``
    classes.
    """

    def __init__(self, classes_per_client: int = 2):
        self.classes_per_client = integer("classes_per_client", classes_per_client)

    def split(self, labels, num_clients, rng):
        num_shards = num_clients * self.classes_per_client
        if num_shards > len(labels):
            raise ValueError(f"{num_shards} shards requested but only {len(labels)} samples")
        order = np.argsort(labels, kind="stable")
        shards = np.array_split(order, num_shards)
        perm = rng.permutation(num_shards)
        return [
            np.concatenate([shards[s] for s in perm[c * self.classes_per_client : (c + 1) * self.classes_per_client]])
            for c in range(num_clients)
        ]


class ClassShards(Partitioner):
    """Every client holds exactly ``classes_per_client`` classes, in shards of near-equal size: each class is cut
    into shards within the class, ``num_clients·classes_per_client`` shards in all, and each client takes
    ``classes_per_client`` shards of distinct classes.

    Seed 001's non-IID MNIST ("each client gets samples from exactly 2 classes; non-overlapping and balanced, with
    equal sample counts", after Li et al. 2020b). Decisions (ours): every sample is dealt (the split is a cover, as
    every partitioner's); class ``k`` gets a number of shards proportional to its size (largest remainders), cut into
    near-equal parts, so shard sizes differ across classes by the class sizes' rounding (MNIST's 60,000 training
    images, 100 clients: clients of 590 to 614 samples) and client sizes by the sum of such shards; the classes are
    put in a random order, each class's samples shuffled, the shards listed class by class and client ``j`` takes
    shards ``j, j + N, j + 2N, ...`` (``N`` clients): a class with at most ``N`` shards occupies at most ``N``
    consecutive places, which never hold two places ``N`` apart, so a client's shards are of distinct classes. A
    class with more than ``N`` shards (more than a ``1/classes_per_client`` share of the data) cannot be dealt so and
    is refused naming it, as are fewer classes than ``classes_per_client`` and more classes than shards; a small
    class whose share rounds to no shard gets one, from the class with the most.
    """

    def __init__(self, classes_per_client: int = 2):
        self.classes_per_client = integer("classes_per_client", classes_per_client)

    def split(self, labels, num_clients, rng):
        per = self.classes_per_client
        num_shards = num_clients * per
        classes, counts = np.unique(labels, return_counts=True)
        if len(classes) < per:
            raise ValueError(f"ClassShards: classes_per_client={per} exceeds the {len(classes)} classes of the labels")
        if num_shards > len(labels):
            raise ValueError(f"ClassShards: {num_shards} shards requested but only {len(labels)} samples")
        if len(classes) > num_shards:
            raise ValueError(
                f"ClassShards: {len(classes)} classes but {num_shards} shards (num_clients={num_clients} x "
                f"classes_per_client={per}); every class needs a shard for every sample to be dealt"
            )
        exact = counts * num_shards / counts.sum()
        shards = np.floor(exact).astype(np.int64)
        remainder = num_shards - int(shards.sum())
        shards[np.argsort(-(exact - shards), kind="stable")[:remainder]] += 1
        for k in np.flatnonzero(shards == 0):  # a small class rounded to no shard: one, from the class with the most
            shards[int(np.argmax(shards))] -= 1
            shards[k] = 1
        shards = np.minimum(shards, counts)
        while shards.sum() < num_shards:  # a class too small for its share: the others make up the difference
            room = np.flatnonzero(shards < counts)
            shards[room[np.argmax((exact - shards)[room])]] += 1
        crowded = np.flatnonzero(shards > num_clients)
        if len(crowded):
            k = crowded[0]
            label = classes[k].item()
            raise ValueError(
                f"ClassShards: class {label!r} holds {counts[k]} of {len(labels)} samples, {shards[k]} of the "
                f"{num_shards} shards, more than one per client (num_clients={num_clients}); a client would get two "
                f"shards of it. Use fewer classes_per_client or Shards"
            )
        pieces = []
        for k in rng.permutation(len(classes)):
            members = rng.permutation(np.flatnonzero(labels == classes[k]))
            pieces.extend(np.array_split(members, int(shards[k])))
        return [np.concatenate(pieces[j::num_clients]) for j in range(num_clients)]


def check_partition(parts: list[np.ndarray], num_samples: int) -> None:
    """Raise if ``parts`` are not disjoint or do not cover ``range(num_samples)``."""
    allidx = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    if len(allidx) != num_samples or not np.array_equal(np.sort(allidx), np.arange(num_samples)):
        raise ValueError("partition is not a disjoint cover of the data set")
