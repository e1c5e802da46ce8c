"""What DataLoader workers cost a federated round: a client's loader with workers, iterated once per client and round
(``ClientDataLoader.one_pass``) against re-iterated once per local epoch (each pass starting its workers again).

    python benchmarks/loader_workers.py                 # 3 rounds of 20 clients x 20 local steps, batch 16
    python benchmarks/loader_workers.py --rounds 5 --workers 2

The data set is scikit-learn's digits served per sample as dicts with a ``collate_fn`` (a user's data pipeline on
the per-sample path; 70 samples per client, so 20 local steps are 4 to 5 local epochs). Each setting trains the same
rounds from the same seed in this process; the script prints the wall time of each, its ratio to the one-pass
loader with workers, and whether the final weights equal the first setting's (all settings serve the same index
batches; with a random transform the draws of the re-iterated loader would differ from epoch 2 on).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

from fedlightning import FederatedLoop
from fedlightning.datamodules import IID, ClientDataLoader, DatasetDataModule


class DictDigits(Dataset):
    def __init__(self):
        d = load_digits()
        self.x = torch.from_numpy((d.data / 16.0).astype(np.float32))
        self.y = torch.from_numpy(d.target.astype(np.int64))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": int(self.y[i])}


def collate(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "y": torch.tensor([s["y"] for s in samples])}


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _reiterated(self, steps):
    """The loader re-iterated once per local epoch (each pass starts its workers again): the baseline."""
    it = iter(self)
    for _ in range(steps):
        try:
            yield next(it)
        except StopIteration:
            it = iter(self)
            yield next(it)


def run(rounds: int, workers: int, persistent: bool, reiterate: bool) -> tuple[float, torch.Tensor]:
    dm = DatasetDataModule(
        DictDigits(),
        collate_fn=collate,
        num_clients=25,
        batch_size=16,
        partition=IID(),
        seed=0,
        val_fraction=0,
        num_workers=workers,
        persistent_workers=persistent,
    )
    torch.manual_seed(0)
    net = Net()
    loop = FederatedLoop(net, local_steps=20, clients_per_round=20, seed=0)
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    kept = ClientDataLoader.one_pass
    if reiterate:
        ClientDataLoader.one_pass = _reiterated
    try:
        start = time.perf_counter()
        trainer.fit(loop, datamodule=dm)
        seconds = time.perf_counter() - start
    finally:
        ClientDataLoader.one_pass = kept
    return seconds, torch.nn.utils.parameters_to_vector(net.parameters()).detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = args.workers
    settings = [
        (f"{w} workers, one pass per client and round", w, False, False),
        (f"{w} workers, re-iterated per local epoch", w, False, True),
        (f"{w} workers, persistent, re-iterated per local epoch", w, True, True),
        ("no workers", 0, False, False),
    ]
    print(f"torch {torch.__version__}, {args.rounds} rounds of 20 clients x 20 local steps, batch 16")
    base, first = None, None
    for name, workers, persistent, reit in settings:
        seconds, weights = run(args.rounds, workers, persistent, reit)
        base = seconds if base is None else base
        first = weights if first is None else first
        print(f"{name:<52} {seconds:7.2f} s  x{seconds / base:5.2f}  weights equal: {torch.equal(weights, first)}")


if __name__ == "__main__":
    main()
