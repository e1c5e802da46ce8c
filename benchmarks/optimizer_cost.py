"""Cost of the adaptive client optimizers per client step, relative to plain SGD.

    python benchmarks/optimizer_cost.py [--repeats 30] [--local-steps 20] [--threads 1]

The unit of work is what the FederatedLoop runs for one client: ``LocalTrainer.run`` for ``K`` local steps from the
same global weights on the same client (the largest client of the quickstart split: digits, 100 clients,
Dirichlet(0.3), batch 50), with the model's own ``training_step`` as the loss. Every configuration runs once per
repeat, interleaved; reported are the median CPU time per local step and the median over repeats of the ratio to
the SGD run of the same repeat (CPU time of this process, less sensitive to other processes sharing the machine
than wall time; one intra-op thread by default).

Models: the quickstart MLP (64-128-10) and a small CNN on the 8x8 digit images (defined below). Targets
(docs/benchmarks.md): SgdArmijo <= 1.5x SGD when it averages <= 1 backtrack per step (one extra forward: 2 trial
forwards at most on average), SPS <= 1.05x SGD. The average number of backtracks (rejected trial points) per step is
printed; it depends on ``eta_max`` and the reset policy, so several settings are shown.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fedlightning.client import LocalTrainer
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.models.base import Classifier
from fedlightning.optim import SPS, DecSPS, SgdArmijo
from fedlightning.state import flat_params


class SmallCNN(Classifier):
    """conv3x3(1->16) - ReLU - conv3x3(16->32) - ReLU - maxpool2 - linear(512->10) on 8x8 digit images (ours)."""

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes=num_classes)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, num_classes),
        )


def optimizer_grid():
    return {
        "SGD(lr=0.1)": lambda p: torch.optim.SGD(p, lr=0.1),
        "SgdArmijo(eta_max=1, reset=max)": lambda p: SgdArmijo(p, eta_max=1.0, reset="max"),
        "SgdArmijo(eta_max=0.3, reset=max)": lambda p: SgdArmijo(p, eta_max=0.3, reset="max"),
        "SgdArmijo(eta_max=0.1, reset=max)": lambda p: SgdArmijo(p, eta_max=0.1, reset="max"),
        "SgdArmijo(eta_max=1, reset=last)": lambda p: SgdArmijo(p, eta_max=1.0, reset="last"),
        "SgdArmijo(eta_max=10, reset=grow)": lambda p: SgdArmijo(p, eta_max=10.0, reset="grow"),
        "SPS(polyak_c=0.5, gamma_max=1)": lambda p: SPS(p, polyak_c=0.5, gamma_max=1.0),
        "SPS(smooth)": lambda p: SPS(p, polyak_c=0.5, gamma_max=1.0, smooth=True),
        "DecSPS(c0=0.5, gamma_max=1)": lambda p: DecSPS(p, c0=0.5, gamma_max=1.0),
    }


def bench_model(name, make_model, dm, client_id, local_steps, repeats):
    torch.manual_seed(0)
    model = make_model()
    model.log = lambda *a, **k: None  # the loop routes logging; here it is not measured
    trainer = LocalTrainer(model)
    global_params = [p.detach().clone() for p in trainer.params]
    global_buffers = [b.detach().clone() for b in trainer.buffers]
    global_flat = flat_params(global_params)
    n = dm.client_num_samples(client_id)
    grid = optimizer_grid()
    times = {k: [] for k in grid}
    backtracks = {k: [] for k in grid}

    def run(make):
        opt = make(trainer.params)
        if hasattr(opt, "set_client_data"):
            opt.set_client_data(num_samples=n, batch_size=dm.batch_size)
        loader = dm.client_dataloader(client_id, 0, seed=0)
        t0 = time.process_time()
        update = trainer.run(client_id, 0, 0, global_params, global_buffers, global_flat, loader, opt, local_steps, n)
        return (time.process_time() - t0) / local_steps, update.backtracks / max(update.num_steps, 1)

    for make in grid.values():  # warm-up
        run(make)
    for _ in range(repeats):
        for key, make in grid.items():
            t, b = run(make)
            times[key].append(t)
            backtracks[key].append(b)
    base = times["SGD(lr=0.1)"]
    rows = []
    for key in grid:
        ratios = [t / b for t, b in zip(times[key], base)]  # SGD ran in the same repeat, right before
        rows.append(
            (
                name,
                key,
                statistics.median(times[key]) * 1e6,
                statistics.median(ratios),
                statistics.mean(backtracks[key]),
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dm = DigitsDataModule(num_clients=100, batch_size=50, partition=Dirichlet(0.3), seed=0)
    dm.setup("fit")
    client_id = max(range(dm.num_clients), key=dm.client_num_samples)
    rows = []
    rows += bench_model(
        "MLP 64-128-10", lambda: MLP(input_dim=64, hidden=[128]), dm, client_id, args.local_steps, args.repeats
    )
    rows += bench_model("SmallCNN", SmallCNN, dm, client_id, args.local_steps, args.repeats)
    print(
        f"torch {torch.__version__}, threads={args.threads}, K={args.local_steps}, repeats={args.repeats}, "
        f"client {client_id} ({dm.client_num_samples(client_id)} samples, batch {dm.batch_size})"
    )
    print("| model | optimizer | CPU us / step | x SGD | backtracks / step |")
    print("|---|---|---:|---:|---:|")
    for model, opt, us, ratio, bt in rows:
        print(f"| {model} | {opt} | {us:.0f} | {ratio:.2f} | {bt:.2f} |")


if __name__ == "__main__":
    main()
