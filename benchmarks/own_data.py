"""Your own data: the in-memory path of ``DatasetDataModule`` against per-sample loading, in one run.

The same custom tuple data set (``(x_i, int label)`` from ``__getitem__``, no ``targets`` attribute) is wrapped twice
with ``FederatedDataModule.from_datasets``: ``in_memory="auto"`` (read once into an ArrayDataset) and
``in_memory=False`` (a DataLoader over the samples, the baseline). Timed: ``setup()`` (materialisation and labels)
and the local steps of clients (``iter_steps`` / re-iterated loader, what a round's client training reads), with
the data only (no model), so the ratio is the data path's own cost.

    python benchmarks/own_data.py [--samples 20000] [--dim 784] [--steps 2000] [--batch 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from fedlightning.datamodules import Dirichlet, FederatedDataModule
from fedlightning.datamodules.base import reiterate


class Rows(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


def steps(dm, clients, n_steps: int) -> float:
    t0 = time.perf_counter()
    for c in clients:
        loader = dm.client_dataloader(c, round=0, seed=0)
        it = loader.iter_steps(n_steps) if hasattr(loader, "iter_steps") else reiterate(loader, n_steps)
        for _batch in it:
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=784)
    ap.add_argument("--steps", type=int, default=2000, help="local steps per client timed")
    ap.add_argument("--clients", type=int, default=5, help="clients timed")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, args.dim, generator=g)
    y = torch.randint(0, 10, (args.samples,), generator=g)
    out = {
        "samples": args.samples,
        "dim": args.dim,
        "batch": args.batch,
        "steps_per_client": args.steps,
        "clients_timed": args.clients,
    }
    for name, in_memory in (("per_sample", False), ("in_memory", "auto")):
        dm = FederatedDataModule.from_datasets(
            Rows(x, y), num_clients=100, batch_size=args.batch, partition=Dirichlet(alpha=0.3), in_memory=in_memory
        )
        t0 = time.perf_counter()
        dm.setup()
        out[f"{name}_setup_s"] = time.perf_counter() - t0
        assert dm.in_memory is (in_memory == "auto")
        clients = list(np.argsort(-dm._num_samples)[: args.clients])
        out[f"{name}_steps_s"] = steps(dm, clients, args.steps)
    out["steps_speedup"] = out["per_sample_steps_s"] / out["in_memory_steps_s"]
    out["setup_ratio"] = out["in_memory_setup_s"] / out["per_sample_setup_s"]
    for k, v in out.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
