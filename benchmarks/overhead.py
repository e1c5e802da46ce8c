"""Framework overhead: the quickstart workload through the FederatedLoop (Trainer, as ``python train.py`` runs it)
versus a minimal hand-written PyTorch FedAvg loop doing the same client steps, in one process.

    python benchmarks/overhead.py [--rounds 30] [--repeats 3] [--execution sequential]

Both run FedAvg on the digits (100 clients, Dirichlet 0.3, 20 clients/round, 20 local SGD steps, batch 50, MLP
64-128-10). Runs alternate and the median round time of each is compared; the ratio FederatedLoop / plain loop is
printed (target <= 1.10). Validation is disabled in both (it is not part of the client workload). Round 0 of
each run is a warm-up; the Trainer's one-off start-up cost is printed separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import lightning.pytorch as pl
from fedlightning import FederatedLoop
from fedlightning.datamodules import Dirichlet, DigitsDataModule
from fedlightning.models import MLP

NUM_CLIENTS, CPR, K, B, LR = 100, 20, 20, 50, 0.1


def make_dm():
    dm = DigitsDataModule(num_clients=NUM_CLIENTS, batch_size=B, partition=Dirichlet(0.3), seed=0)
    dm.setup("fit")
    return dm


class _RoundClock(pl.Callback):
    """Timestamps at the end of every round: steady-state round time excludes Trainer start-up."""

    def __init__(self):
        self.stamps = []

    def on_train_batch_end(self, *args):
        self.stamps.append(time.perf_counter())


STARTUP = []


def run_framework(rounds: int, execution: str) -> float:
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[128])
    kw = {} if execution == "sequential" else {"client_execution": execution}
    loop = FederatedLoop(model, client_optimizer=lambda p: torch.optim.SGD(p, lr=LR), local_steps=K,
                         clients_per_round=CPR, seed=0, **kw)
    clock = _RoundClock()
    trainer = pl.Trainer(max_steps=rounds + 1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[clock])
    dm = make_dm()
    t0 = time.perf_counter()
    trainer.fit(loop, datamodule=dm)
    # round 0 absorbs start-up (Trainer setup, first-iteration allocations); rounds 1..R are steady state
    STARTUP.append(clock.stamps[0] - t0)
    return (clock.stamps[-1] - clock.stamps[0]) / rounds


def run_plain(rounds: int) -> float:
    """What a researcher writes by hand: tensors indexed directly, one model copy reused for every client."""
    torch.manual_seed(0)
    dm = make_dm()
    x_all, y_all = dm.train_dataset.x, dm.train_dataset.y
    clients = [torch.as_tensor(ix) for ix in dm.client_indices]
    sizes = np.array([len(c) for c in clients], dtype=np.float64)
    model = MLP(input_dim=64, hidden=[128]).net
    work = MLP(input_dim=64, hidden=[128]).net
    gparams, wparams = list(model.parameters()), list(work.parameters())
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for r in range(rounds + 1):
        if r == 1:
            t0 = time.perf_counter()  # as for the framework: round 0 is warm-up
        chosen = rng.choice(NUM_CLIENTS, CPR, replace=False)
        acc = [torch.zeros_like(p) for p in gparams]
        total = 0.0
        for c in chosen:
            with torch.no_grad():
                for w, g in zip(wparams, gparams):
                    w.copy_(g)
            opt = torch.optim.SGD(wparams, lr=LR)
            idx = clients[c]
            perm, pos = idx[torch.randperm(len(idx), generator=gen)], 0
            for _ in range(K):
                if pos >= len(perm):
                    perm, pos = idx[torch.randperm(len(idx), generator=gen)], 0
                bi = perm[pos : pos + B]
                pos += B
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(work(x_all[bi]), y_all[bi])
                loss.backward()
                opt.step()
            wgt = sizes[c]
            total += wgt
            with torch.no_grad():
                for a, g, w in zip(acc, gparams, wparams):
                    a.add_(g - w, alpha=wgt)
        with torch.no_grad():
            for g, a in zip(gparams, acc):
                g.sub_(a / total)
    return (time.perf_counter() - t0) / rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--execution", default="sequential", choices=["sequential", "vectorized", "auto"])
    args = ap.parse_args()
    run_plain(2), run_framework(2, args.execution)  # warm-up
    fw, plain = [], []
    for _ in range(args.repeats):
        plain.append(run_plain(args.rounds))
        fw.append(run_framework(args.rounds, args.execution))
    p, f = statistics.median(plain), statistics.median(fw)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, rounds {args.rounds} x {args.repeats}")
    print(f"plain loop     : {p * 1e3:8.2f} ms/round")
    print(f"FederatedLoop ({args.execution}): {f * 1e3:8.2f} ms/round")
    print(f"ratio FederatedLoop / plain = {f / p:.3f}  (target <= 1.10; steady-state rounds)")
    print(f"Trainer start-up + first round: {statistics.median(STARTUP):.2f} s (one-off per run)")


if __name__ == "__main__":
    main()
