"""Random augmentations in the user's data set draw from the client's own stream (``ClientDataLoader``): without
worker processes, a client's batches are fetched under random states seeded as a DataLoader seeds its worker 0, so
the draws depend only on ``(seed, round, client)``: sequential and vectorized training draw the same ones, no round
repeats another's, ``num_workers=0`` equals ``num_workers=1``, and the process's random states are left alone."""

import functools
import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.datamodules import IID, ClientDataLoader, FederatedDataModule

DRAWS: list[list[float]] = []  # per round: the noise values the data set drew in this process, in order


class Noisy(Dataset):
    """Features plus noise drawn in ``__getitem__`` from torch, ``random`` and numpy (announced as a transform, so
    samples are read one by one)."""

    transform = "noise"

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(60, 3, dtype=torch.float64, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = torch.rand(3, dtype=torch.float64) + random.random() + float(np.random.rand())
        if DRAWS:
            DRAWS[-1].append(float(noise[0]))
        return self.x[i] + 0.1 * noise, i % 2


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class RoundMark(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        DRAWS.append([])


def _fit(mode, workers=0, rounds=3, local_steps=3, worker_init_fn=None):
    DRAWS.clear()
    dm = FederatedDataModule.from_datasets(
        Noisy(),
        partition=IID(),
        num_clients=6,
        batch_size=4,
        seed=0,
        val_fraction=0,
        num_workers=workers,
        worker_init_fn=worker_init_fn,
    )
    net = Net()
    loop = FederatedLoop(net, local_steps=local_steps, clients_per_round=3, seed=0, client_execution=mode)
    make_trainer(rounds, callbacks=[RoundMark()]).fit(loop, datamodule=dm)
    return net.lin.weight.detach().clone(), [list(d) for d in DRAWS]


def test_both_modes_draw_the_same_augmentations_and_no_round_repeats_another():
    seq, seq_draws = _fit("sequential")
    vec, vec_draws = _fit("vectorized")
    assert len(seq_draws) == 3 and all(len(d) == 3 * 10 for d in seq_draws)  # 3 clients x batches of 4, 4, 2
    assert sorted(map(sorted, vec_draws)) == sorted(map(sorted, seq_draws))  # the same draws, round by round
    assert vec_draws == seq_draws  # and in the same order (client by client, step by step)
    assert len({tuple(d[:4]) for d in vec_draws}) == 3  # each round draws anew
    torch.testing.assert_close(vec, seq, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_no_workers_serve_the_batches_of_one_worker(mode):
    """Worker 0 of a one-worker loader is seeded from the loader's base seed; the process emulates exactly that."""
    zero, _ = _fit(mode, workers=0, rounds=2)
    one, _ = _fit(mode, workers=1, rounds=2)
    assert torch.equal(zero, one)


def seed_worker(worker_id, log=None):
    """PyTorch's reproducibility recipe: numpy and ``random`` seeded from the worker's torch seed; ``log``: a file
    that gets one line per call (one per worker start)."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    assert torch.utils.data.get_worker_info().id == worker_id == 0
    if log is not None:
        with open(log, "a") as f:
            f.write(f"{worker_id}\n")


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_no_workers_serve_the_batches_of_one_worker_over_several_epochs_with_a_worker_init_fn(mode, tmp_path):
    """9 local steps of clients with 3 batches per epoch: 3 epochs per client and round. A worker_init_fn that
    reseeds numpy and random from torch's worker seed runs for the loader without workers as in worker 0 (the
    batches are equal), and the one-worker loader starts its worker once per client and round, not per epoch."""
    log = tmp_path / "starts.txt"
    zero, zero_draws = _fit(mode, 0, 2, 9, functools.partial(seed_worker, log=str(log)))
    assert log.read_text().count("0") == 2 * 3  # called in this process once per client and round
    log.unlink()
    one, _ = _fit(mode, 1, 2, 9, functools.partial(seed_worker, log=str(log)))
    assert log.read_text().count("0") == 2 * 3  # one worker start per client and round
    assert torch.equal(zero, one)
    plain, plain_draws = _fit(mode, 0, 2, 9)
    assert not torch.equal(plain, zero)  # the function changed the draws: it did run
    assert all(len(d) == 3 * 9 * 4 - 3 * 3 * 2 for d in zero_draws)  # 3 clients x 9 batches of 4, 4, 2, ...


def _datamodule(dataset):
    dm = FederatedDataModule.from_datasets(
        dataset, partition=IID(), num_clients=6, batch_size=4, seed=0, val_fraction=0
    )
    dm.setup("fit")
    dm.configure_rounds(3, 3, seed=0)
    return dm


def test_iterating_a_client_loader_leaves_the_process_random_states_alone():
    dm = _datamodule(Noisy())
    loader = dm.client_dataloader(2, round=1)
    assert isinstance(loader, ClientDataLoader)
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    first = [b[0] for b in loader]
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])
    torch.manual_seed(7)  # another process state: the loader's batches do not change
    again = [b[0] for b in dm.client_dataloader(2, round=1)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other_round = [b[0] for b in dm.client_dataloader(2, round=2)]
    assert not all(torch.equal(a, b) for a, b in zip(first, other_round))


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_resumed_run_draws_the_augmentations_of_the_uninterrupted_run(mode, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fedlightning.checkpoint import AtomicCheckpointIO

    def run(rounds, callbacks=(), ckpt_path=None, **kw):
        DRAWS.clear()
        dm = FederatedDataModule.from_datasets(
            Noisy(), partition=IID(), num_clients=6, batch_size=4, seed=0, val_fraction=0
        )
        net = Net()
        loop = FederatedLoop(net, local_steps=3, clients_per_round=3, seed=0, client_execution=mode)
        trainer = make_trainer(rounds, callbacks=[RoundMark(), *callbacks], plugins=[AtomicCheckpointIO()], **kw)
        trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
        return net.lin.weight.detach().clone(), [list(d) for d in DRAWS]

    full, full_draws = run(4)
    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    run(2, [ck], enable_checkpointing=True, default_root_dir=str(tmp_path))
    resumed, resumed_draws = run(4, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert resumed_draws == full_draws[2:]
    assert torch.equal(resumed, full)


class TorchOnly(Noisy):
    """Noise from torch only: the loader stops swapping Python's and numpy's states after its first batch."""

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(3, dtype=torch.float64), i % 2


def test_a_loader_swaps_only_the_random_sources_its_data_set_draws_from():
    dm = _datamodule(TorchOnly())
    loader = dm.client_dataloader(1, round=0)
    first = [b[0] for b in loader]
    assert loader._sources == [0]  # torch only
    again = [b[0] for b in loader]  # a second epoch: new draws, from the loader's own torch stream
    assert not all(torch.equal(a, b) for a, b in zip(first, again))
    fresh = dm.client_dataloader(1, round=0)  # the same (seed, round, client): the same draws
    assert all(torch.equal(a, b) for a, b in zip(first, [b[0] for b in fresh]))


class SmallCNN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
        self.head = torch.nn.Linear(4 * 64, 3, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.relu(self.conv(x)).flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_torchvision_random_transforms_train_the_same_in_both_modes():
    """What a user brings: a torchvision data set with random crop and flip (transforms v2) in the main process;
    vectorized training draws the augmentations sequential training draws, so the float64 weights agree."""
    import torchvision
    from torchvision.transforms import v2

    augment = v2.Compose(
        [
            v2.PILToTensor(),
            v2.RandomCrop(8, padding=2),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float64, scale=True),
        ]
    )
    train = torchvision.datasets.FakeData(size=96, image_size=(3, 8, 8), num_classes=3, transform=augment)

    def fit(mode):
        dm = FederatedDataModule.from_datasets(
            train, partition=IID(), num_clients=6, batch_size=5, seed=0, val_fraction=0, num_classes=3
        )
        net = SmallCNN()
        loop = FederatedLoop(net, local_steps=3, clients_per_round=3, seed=0, client_execution=mode)
        make_trainer(2).fit(loop, datamodule=dm)
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    seq, vec = fit("sequential"), fit("vectorized")
    assert not torch.equal(seq, torch.cat([p.detach().reshape(-1) for p in SmallCNN().parameters()]))
    torch.testing.assert_close(vec, seq, rtol=1e-10, atol=1e-12)
