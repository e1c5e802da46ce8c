import numpy as np
import pytest

from fedlightning.datamodules import IID, ClassShards, Dirichlet, DirichletEqualSizes, Shards, check_partition


def labels(n=2000, k=10, seed=0):
    return np.random.default_rng(seed).integers(0, k, size=n)


@pytest.mark.parametrize(
    "part", [IID(), Dirichlet(0.3), Dirichlet(5.0, min_samples=5), Shards(2), ClassShards(2), ClassShards(3)]
)
def test_disjoint_complete_seeded(part):
    y = labels()
    a = part(y, 40, seed=7)
    b = part(y, 40, seed=7)
    c = part(y, 40, seed=8)
    assert len(a) == 40
    check_partition(a, len(y))
    allidx = np.concatenate(a)
    assert len(np.unique(allidx)) == len(y)
    assert all(np.array_equal(x, z) for x, z in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def test_iid_sizes_balanced():
    parts = IID()(labels(1003), 10, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def _label_tv_distance(parts, y, k=10):
    """Mean total-variation distance between each client's label distribution and the global one."""
    glob = np.bincount(y, minlength=k) / len(y)
    d = []
    for p in parts:
        h = np.bincount(y[p], minlength=k) / len(p)
        d.append(0.5 * np.abs(h - glob).sum())
    return float(np.mean(d))


def test_dirichlet_alpha_controls_skew():
    y = labels(20000, 10)
    near_iid = Dirichlet(1000.0)(y, 20, seed=0)
    skewed = Dirichlet(0.05)(y, 20, seed=0)
    assert _label_tv_distance(near_iid, y) < 0.05
    assert _label_tv_distance(skewed, y) > 0.5
    # strongly skewed: most clients hold very few classes with >90% of their samples
    dominant = [np.sort(np.bincount(y[p], minlength=10))[::-1][:2].sum() / len(p) for p in skewed]
    assert np.median(dominant) > 0.9


def test_dirichlet_min_samples_guarantees_no_empty_client():
    y = labels(500, 10)
    parts = Dirichlet(0.1, min_samples=3)(y, 50, seed=1)  # infeasible by rejection: exercised the repair
    assert min(len(p) for p in parts) >= 3
    check_partition(parts, len(y))
    assert all(np.array_equal(a, b) for a, b in zip(parts, Dirichlet(0.1, min_samples=3)(y, 50, seed=1)))


def test_dirichlet_impossible_min_samples_is_clear_error():  # more than the data holds
    with pytest.raises(ValueError, match="min_samples=20"):
        Dirichlet(0.3, min_samples=20)(labels(100), 10, seed=0)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf")])
def test_dirichlet_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        Dirichlet(alpha)


def test_shards_classes_per_client():
    y = np.repeat(np.arange(10), 100)
    parts = Shards(2)(y, 50, seed=0)
    assert all(len(np.unique(y[p])) <= 2 for p in parts)
    with pytest.raises(ValueError, match="classes_per_client"):
        Shards(0)


#: MNIST's training images per class
MNIST_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _mnist_labels():
    y = np.concatenate([np.full(c, k) for k, c in enumerate(MNIST_COUNTS)])
    return np.random.default_rng(1).permutation(y)


def test_class_shards_give_every_client_exactly_its_classes():
    """Seed 001's non-IID MNIST: exactly 2 classes per client, near-equal sizes; McMahan's Shards straddle class
    boundaries on MNIST's unequal class sizes (some clients see 1 or 3 classes)."""
    y = _mnist_labels()
    for per in (1, 2, 3):
        parts = ClassShards(per)(y, 100, seed=0)
        check_partition(parts, len(y))
        assert all(len(np.unique(y[p])) == per for p in parts)
        # shard counts ∝ class sizes (whole shards), so client sizes stay within a few % of the mean
        sizes = np.array([len(p) for p in parts])
        assert np.abs(sizes / sizes.mean() - 1).max() < 0.05, (per, sizes.min(), sizes.max())
    straddled = [len(np.unique(y[p])) for p in Shards(2)(y, 100, seed=0)]
    assert set(straddled) != {2}  # the reason ClassShards exists
    shards = ClassShards(2)(y, 100, seed=0)
    assert (min(map(len, shards)), max(map(len, shards))) == (590, 614)  # the docstring's figures


def test_a_small_class_still_gets_a_shard():
    """Class sizes 100, 100, 1 over 3 clients with 1 class each: the third class's share rounds to no shard; it gets
    one (from a large class), so every sample is dealt and every client still holds exactly 1 class."""
    y = np.repeat([0, 1, 2], [100, 100, 1])
    parts = ClassShards(1)(y, 3, seed=0)
    check_partition(parts, len(y))
    assert sorted(len(np.unique(y[p])) for p in parts) == [1, 1, 1]
    assert sorted(len(p) for p in parts) == [1, 100, 100]


def test_class_shards_refuse_what_cannot_be_dealt():
    with pytest.raises(ValueError, match=r"10 classes but 4 shards \(num_clients=2 x classes_per_client=2\)"):
        ClassShards(2)(np.repeat(np.arange(10), 10), 2, seed=0)
    with pytest.raises(ValueError, match=r"classes_per_client=3 exceeds the 2 classes"):
        ClassShards(3)(np.repeat([0, 1], 50), 10, seed=0)
    # class 0 holds 80 % of the samples: 16 of 20 shards, more than one per client
    with pytest.raises(ValueError, match=r"class 0 holds 800 of 1000 samples, 16 of the 20 shards"):
        ClassShards(2)(np.repeat([0, 1, 2], [800, 100, 100]), 10, seed=0)
    with pytest.raises(ValueError, match="classes_per_client"):
        ClassShards(0)


def test_too_many_clients():
    with pytest.raises(ValueError, match="num_clients=200"):
        IID()(labels(100), 200, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        IID()(labels(100), 0, seed=0)


def test_dirichlet_equal_sizes_covers_with_equal_sizes_and_follows_alpha():
    """DirichletEqualSizes (Hsu et al. 2019 as FedExP's code deals it): a seeded disjoint cover, every client
    ⌊N/n⌋ or ⌊N/n⌋ + 1 samples (the N mod n extra samples one each), label skew set by α as Dirichlet's."""
    y = labels(20000, 10)
    a = DirichletEqualSizes(0.3)(y, 30, seed=7)
    check_partition(a, len(y))
    assert sorted(len(p) for p in a) == [666] * 10 + [667] * 20  # 20000 = 30·666 + 20
    assert all(np.array_equal(x, z) for x, z in zip(a, DirichletEqualSizes(0.3)(y, 30, seed=7)))
    assert not all(np.array_equal(x, z) for x, z in zip(a, DirichletEqualSizes(0.3)(y, 30, seed=8)))
    assert _label_tv_distance(DirichletEqualSizes(1000.0)(y, 20, seed=0), y) < 0.05
    assert _label_tv_distance(DirichletEqualSizes(0.05)(y, 20, seed=0), y) > 0.5
    # α so small that the proportions underflow to 0 outside one class: the classes run out, the split still ends
    tiny = DirichletEqualSizes(1e-4)(y, 100, seed=0)
    check_partition(tiny, len(y))
    assert sorted({len(p) for p in tiny}) == [200]


def test_dirichlet_equal_sizes_takes_a_class_from_the_clients_own_proportions():
    """Two classes, two clients, α small: each client's proportions put nearly all mass on one class; the sample
    of a class drawn for a client comes from that class's unused samples, so while both classes last every client's
    draws follow its own proportions: with 1,000 of each class and one-hot proportions on different classes, each
    client gets only its class."""
    y = np.repeat([0, 1], 1000)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        q = rng.dirichlet(np.full(2, 1e-3), size=2)
        if not (q[0].argmax() != q[1].argmax() and q.max(axis=1).min() > 1 - 1e-12):
            continue
        parts = DirichletEqualSizes(1e-3)(y, 2, seed=seed)
        assert [len(np.unique(y[p])) for p in parts] == [1, 1]
        assert [int(y[p][0]) for p in parts] == q.argmax(axis=1).tolist()
        return
    pytest.skip("no seed gave one-hot proportions on different classes")


def test_dirichlet_equal_sizes_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        DirichletEqualSizes(0.0)
