import numpy as np
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop, RoundPlan
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.models import MLP


class TinyNatural(FederatedDataModule):
    """Natural split with an empty client (id 1)."""

    def load(self):
        x = torch.randn(30, 4)
        y = torch.arange(30) % 2
        return ArrayDataset(x, y), ArrayDataset(x, y), y.numpy()

    def natural_clients(self):
        return [np.arange(0, 10), np.arange(0, 0), np.arange(10, 20), np.arange(20, 25), np.arange(25, 30)]


def test_round_sampler_uniform_without_replacement_and_skips_empty_clients():
    dm = TinyNatural(num_clients=5, batch_size=4)
    dm.setup("fit")
    dm.configure_rounds(3, 2, seed=0)
    counts = np.zeros(5)
    seen = set()
    for r in range(600):
        c = dm.sample_clients(r)
        assert len(c) == len(set(c)) == 3
        assert 1 not in c
        counts[c] += 1
        seen.add(tuple(c))
    assert counts[1] == 0
    # each of the 4 eligible clients is in 3/4 of the rounds
    np.testing.assert_allclose(counts[[0, 2, 3, 4]] / 600, 0.75, atol=0.06)
    assert len(seen) > 4  # rounds differ
    assert dm.sample_clients(17) == dm.sample_clients(17)
    with pytest.raises(ValueError, match="clients_per_round=5"):
        dm.configure_rounds(5, 2, seed=0)


def test_round_plans_follow_global_step():
    dm = DigitsDataModule(num_clients=20, seed=0)
    dm.setup("fit")
    dm.configure_rounds(4, 3, seed=9)
    loader = dm.train_dataloader()
    plans = list(loader)
    assert len(plans) == dm.rounds_per_epoch
    assert isinstance(plans[0], RoundPlan) and plans[5].round == 5
    assert plans[5].client_ids == dm.sample_clients(5) and plans[5].local_steps == 3


def _run(seed, rounds=3, cpr=4):
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[16], dropout=0.2)
    dm = DigitsDataModule(num_clients=10, batch_size=20, partition=Dirichlet(0.5), seed=0)
    loop = FederatedLoop(model, local_steps=3, clients_per_round=cpr, seed=seed)
    make_trainer(rounds).fit(loop, datamodule=dm)
    return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach()


def test_same_seed_same_weights_with_dropout():
    a, b = _run(seed=5), _run(seed=5)
    assert torch.equal(a, b)
    c = _run(seed=6)
    assert not torch.equal(a, c)


def test_global_rng_is_not_consumed_by_training():
    """Client randomness lives in forked, derived generators: the global torch RNG is untouched."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    model = MLP(input_dim=64, hidden=[8], dropout=0.5)
    dm = DigitsDataModule(num_clients=10, seed=0)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    torch.manual_seed(123)
    make_trainer(2).fit(loop, datamodule=dm)
    # Lightning itself does not draw from the global RNG in this configuration, nor do we
    assert torch.equal(torch.rand(3), expected)


def test_numpy_client_ids_and_rounds_give_the_clients_own_batches():
    """Seeds were hashed from the repr of their parts, so a callback passing numpy ids (np.int64(3), as a numpy
    array of sampled clients gives them) drew another shuffle than the loop's own client_dataloader(3, ...)."""
    dm = DigitsDataModule(num_clients=10, batch_size=8, partition=Dirichlet(0.5), seed=0)
    dm.setup()
    dm.configure_rounds(2, 2, seed=5)
    ids = np.asarray(dm.sample_clients(1))
    for c in ids:
        ours = [b[1].tolist() for b in dm.client_dataloader(int(c), 1, seed=5)]
        theirs = [b[1].tolist() for b in dm.client_dataloader(c, np.int64(1), seed=np.int32(5))]
        assert ours == theirs
    assert [b[1].tolist() for b in dm.client_dataloader(int(ids[0]), 1, seed=5)] != [
        b[1].tolist() for b in dm.client_dataloader(int(ids[0]), 2, seed=5)
    ]
