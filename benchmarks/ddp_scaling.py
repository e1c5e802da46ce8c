"""Scaling over processes: round time of one FederatedLoop run on 1 versus 2 CPU processes (Lightning DDP, gloo).

    python benchmarks/ddp_scaling.py [--rounds 8] [--warmup 2] [--repeats 2] [--hidden 512,512]

Workload: FedAvg on the digits (100 clients, Dirichlet 0.3), 20 clients per round, K = 20 local SGD steps (lr 0.1),
batch 50, and a wider MLP than the quickstart (64-512-512-10 by default, ~300k parameters) so that a round has
enough arithmetic to be worth splitting: with two processes each trains 10 of the round's 20 clients (round-robin
by sampling position), the strategy statistics are all-reduced and the client-state entries exchanged over gloo,
and both apply the same server step (``README.md``, "Many GPUs and nodes"). Every run is a fresh subprocess
(``--worker``) with the same Trainer flags as ``tests/scripts/ddp_run.py`` (``accelerator="cpu"``,
``devices=N``, ``strategy="ddp"`` for N > 1) and one torch thread per process.

Configurations, alternated ``--repeats`` times:

* ``1 process x 1 thread`` — the baseline t1 of the parallel efficiency;
* ``2 processes x 1 thread`` — DDP, t2; parallel efficiency = t1 / (2 t2) (1.0 = perfect, 0.5 = no gain);
* ``1 process x 2 threads`` — for reference: the other way to use two cores (intra-op threads).

A round's time is measured on rank 0 from the end of one round to the end of the next (after the all-reduce, so
it is the slowest rank's time); the first ``--warmup`` rounds are excluded; the table gives the median over all timed
rounds of all repeats and the minimum of the per-run means. The machine of this project has 2 cores shared with
other jobs: with other work running, two busy processes cannot both get a full core, which caps the efficiency.

Target (docs/benchmarks.md): report the scaling; no fixed number (ideal parallel efficiency 1.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lightning.pytorch as pl

    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import DigitsDataModule, Dirichlet
    from fedlightning.models import MLP

    class Clock(pl.Callback):
        def __init__(self):
            self.stamps = []

        def on_train_batch_end(self, *a):
            self.stamps.append(time.perf_counter())

    pl.seed_everything(0, verbose=False)
    hidden = [int(h) for h in args.hidden.split(",")]
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=hidden),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=20,
        clients_per_round=args.clients_per_round,
        seed=0,
    )
    dm = DigitsDataModule(num_clients=100, batch_size=50, partition=Dirichlet(0.3), seed=0)
    clock = Clock()
    trainer = pl.Trainer(
        max_steps=args.warmup + args.rounds,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg(), clock],
    )
    trainer.fit(loop, datamodule=dm)
    if trainer.global_rank == 0:
        s = clock.stamps
        times = [b - a for a, b in zip(s[args.warmup - 1 :], s[args.warmup :])]
        with open(args.out, "w") as f:
            json.dump({"times": times, "params": sum(p.numel() for p in loop.model.parameters())}, f)


def run_config(args, devices: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--devices",
            str(devices),
            "--threads",
            str(threads),
            "--rounds",
            str(args.rounds),
            "--warmup",
            str(args.warmup),
            "--hidden",
            args.hidden,
            "--clients-per-round",
            str(args.clients_per_round),
            "--out",
            out,
        ]
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed (devices={devices}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds at the start of every run")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per configuration")
    ap.add_argument("--hidden", default="512,512", help="MLP hidden sizes, comma-separated")
    ap.add_argument("--clients-per-round", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.rounds < 1 or args.warmup < 1 or args.repeats < 1:
        raise SystemExit("need --rounds, --warmup and --repeats >= 1")
    configs = [
        ("1 process x 1 thread", 1, 1),
        ("2 processes x 1 thread (DDP, gloo)", 2, 1),
        ("1 process x 2 threads", 1, 2),
    ]
    load0 = os.getloadavg()[0]
    times = {c[0]: [] for c in configs}
    means = {c[0]: [] for c in configs}
    params = None
    for _ in range(args.repeats):
        for name, devices, threads in configs:
            res = run_config(args, devices, threads)
            times[name] += res["times"]
            means[name].append(statistics.mean(res["times"]))
            params = res["params"]
    print(
        f"{os.cpu_count()} CPUs, load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"MLP 64-{args.hidden.replace(',', '-')}-10 ({params:,} parameters), {args.clients_per_round} clients/round, "
        f"K=20, batch 50; {args.rounds} timed rounds (+{args.warmup} warm-up) x {args.repeats} repeats"
    )
    print(
        f"{'configuration':38s} {'s/round median':>15s} {'min of run means':>17s} {'speed-up':>9s} {'efficiency':>11s}"
    )
    t1 = statistics.median(times[configs[0][0]])
    for name, devices, threads in configs:
        med = statistics.median(times[name])
        cores = devices * threads
        print(f"{name:38s} {med:15.3f} {min(means[name]):17.3f} {t1 / med:9.2f} {t1 / (cores * med):11.2f}")
    t2 = statistics.median(times[configs[1][0]])
    print(f"parallel efficiency of DDP t1 / (2 t2) = {t1 / (2 * t2):.2f} (median round times; 1.0 = perfect)")


if __name__ == "__main__":
    main()
