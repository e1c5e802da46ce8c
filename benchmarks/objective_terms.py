"""Rounds per second of the client-objective methods, vectorised and sequential, against FedAvg, in one run.

    python benchmarks/objective_terms.py [--rounds 12] [--repeats 2] [--threads 1] [--clock wall|process]
        [--methods fedprox,...] [--profile METHOD]

Workload (issue 34's, ours): scikit-learn digits, 100 clients from a Dirichlet(0.3) label split, the user MLP
64-128-10 (``user_models.UserMLP``), SGD(lr=0.1) clients, 20 clients per round, K = 20 local steps, batch 50.
Methods: FedAvg, FedProx (ProximalTerm mu 0.1), SCAFFOLD, FedExProx (mu 0.1, GraDS), FedDANE (mu 0.01, independent
gradient clients), with the settings of their configs/ files. Every method trains from the same initial weights in
both modes; runs alternate (sequential, vectorized) ``--repeats`` times, the first two rounds of each run are
warm-up. Printed per method: rounds/s of each mode from the paired per-round minima (each round trains the same
clients in every repeat; its fastest time over the repeats is taken, as in ``vectorized_speedup.py``), vectorized /
sequential, vectorized / FedAvg-vectorized (FedAvg measured in the same run), the median rounds/s of each mode, and
the largest difference of the two modes' final weights. ``--profile METHOD``
prints cProfile's top functions of one vectorised run of METHOD instead.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FedDANE, FedExProx, ProximalTerm, Scaffold
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from user_models import UserMLP  # benchmarks/ is on sys.path when a script runs

METHODS = {
    "fedavg": lambda: [FedAvg()],
    "fedprox": lambda: [FedAvg(), ProximalTerm(mu=0.1)],
    "scaffold": lambda: [Scaffold()],
    "fedexprox": lambda: [FedExProx(mu=0.1, rule="grads")],
    "feddane": lambda: [FedDANE(mu=0.01, gradient_clients="independent")],
}


#: the clock rounds are timed with (``--clock``): wall time, or this process's CPU time (with one thread, what other
#: processes on a shared machine take does not count)
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
clock = CLOCKS["wall"]


class RoundTimer(pl.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(clock() - self._start)


def run(method: str, mode: str, rounds: int, init_state) -> tuple[list[float], torch.Tensor]:
    model = UserMLP()
    model.load_state_dict(init_state)
    loop = FederatedLoop(
        model,
        client_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        local_steps=20,
        clients_per_round=20,
        seed=0,
        client_execution=mode,
    )
    timer = RoundTimer()
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*METHODS[method](), timer],
    )
    dm = DigitsDataModule(num_clients=100, batch_size=50, partition=Dirichlet(0.3), seed=0)
    trainer.fit(loop, datamodule=dm)
    return timer.times[2:], torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--profile", default=None, help="cProfile one vectorised run of this method")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="process: CPU time of this process")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    init_state = UserMLP().state_dict()
    if args.profile:
        run(args.profile, "vectorized", 3, init_state)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        run(args.profile, "vectorized", args.rounds, init_state)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        return
    methods = ["fedavg", *[m for m in args.methods.split(",") if m != "fedavg"]]
    times: dict[tuple[str, str], list[float]] = {}
    weights: dict[tuple[str, str], torch.Tensor] = {}
    for _ in range(args.repeats):
        for method in methods:
            for mode in ("sequential", "vectorized"):
                t, w = run(method, mode, args.rounds, init_state)
                times.setdefault((method, mode), []).append(t)
                weights[(method, mode)] = w
    # every run of a method trains the same clients in round r: each round's fastest time over the repeats (other
    # processes on a shared machine only ever add time), summed
    rate = {key: len(runs[0]) / sum(min(r) for r in zip(*runs)) for key, runs in times.items()}
    median = {key: 1.0 / statistics.median([x for r in runs for x in r]) for key, runs in times.items()}
    print(
        f"threads={args.threads} rounds={args.rounds} repeats={args.repeats} clock={args.clock} "
        "(rounds/s: paired per-round minima)"
    )
    print("| method | vectorized | sequential | vec / seq | vec / FedAvg-vec | medians vec / seq | max weight diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method in methods:
        vec, seq = rate[(method, "vectorized")], rate[(method, "sequential")]
        diff = (weights[(method, "vectorized")] - weights[(method, "sequential")]).abs().max().item()
        print(
            f"| {method} | {vec:.1f} | {seq:.1f} | {vec / seq:.2f}x | {vec / rate[('fedavg', 'vectorized')]:.2f} "
            f"| {median[(method, 'vectorized')]:.1f} / {median[(method, 'sequential')]:.1f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
