"""Dirichlet's repair step (the largest client from a heap of sizes) gives exactly the split of the original
list-based loop, and every client ends with at least ``min_samples``."""

import numpy as np

from fedlightning.datamodules import Dirichlet


def _repair_reference(parts, rng, min_samples):
    """The repair loop as first written: a fresh list of sizes for every move."""
    parts = [rng.permutation(p) for p in parts]
    for c in range(len(parts)):
        while len(parts[c]) < min_samples:
            donor = int(np.argmax([len(p) for p in parts]))
            take = min(min_samples - len(parts[c]), len(parts[donor]) - min_samples)
            parts[c] = np.concatenate([parts[c], parts[donor][:take]])
            parts[donor] = parts[donor][take:]
    return parts


def test_repair_matches_the_reference_loop_and_holds_min_samples():
    labels = np.random.default_rng(0).integers(0, 10, 3000)
    by_class = [np.flatnonzero(labels == k) for k in range(10)]
    for min_samples in (1, 5, 12):
        d = Dirichlet(alpha=0.1, min_samples=min_samples)
        draw = d._draw(by_class, 200, np.random.default_rng(1))
        assert min(len(p) for p in draw) < min_samples  # the case the repair exists for
        got = d._repair([p.copy() for p in draw], np.random.default_rng(2))
        ref = _repair_reference([p.copy() for p in draw], np.random.default_rng(2), min_samples)
        assert all(np.array_equal(a, b) for a, b in zip(got, ref))
        assert min(len(p) for p in got) >= min_samples
        assert np.array_equal(np.sort(np.concatenate(got)), np.arange(3000))


def test_many_clients_split_is_a_cover_with_no_empty_client():
    labels = np.random.default_rng(3).integers(0, 10, 50_000)
    parts = Dirichlet(alpha=0.3, max_retries=0)(labels, 10_000, seed=0)
    assert len(parts) == 10_000 and min(len(p) for p in parts) >= 1
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(50_000))


def test_an_empty_client_serves_no_batch():
    """Dirichlet(min_samples=0) may leave a client without samples (never sampled for training); its loaders said
    len 0 but yielded one batch of 0 rows (torch.split of an empty index list), and its full-batch loader a 0-row
    batch whose mean loss is NaN. Both now yield nothing, and its epoch has no batch."""
    from fedlightning.datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=300, partition=Dirichlet(0.01, min_samples=0), seed=0)
    dm.setup()
    empty = [c for c in range(dm.num_clients) if dm.client_num_samples(c) == 0]
    full = next(c for c in range(dm.num_clients) if dm.client_num_samples(c) > 0)
    assert empty
    for c in empty[:3]:
        assert len(dm.client_dataloader(c)) == 0 and list(dm.client_dataloader(c)) == []
        assert list(dm.client_full_dataloader(c)) == []
        assert dm.client_batches_per_epoch(c) == 0
    n = dm.client_num_samples(full)
    assert sum(len(b[1]) for b in dm.client_dataloader(full)) == n  # the others are served as before
    assert dm.client_batches_per_epoch(full) == -(-n // dm.batch_size)


def test_clients_with_data_are_the_clients_sampling_draws_from():
    import pytest

    from fedlightning.datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=300, partition=Dirichlet(0.01, min_samples=0), seed=0)
    dm.setup()
    ids = dm.clients_with_data()
    holding = [c for c in range(dm.num_clients) if dm.client_num_samples(c) > 0]
    assert ids.tolist() == holding and len(holding) < dm.num_clients
    with pytest.raises(ValueError, match="read-only"):
        ids[0] = 1  # the data module's own array: not to be changed by a caller
    dm.configure_rounds(len(holding), 1, seed=0)
    assert sorted(dm.sample_clients(0)) == holding
