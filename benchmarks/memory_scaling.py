"""Memory versus number of clients: peak RSS of a short federated run with 1k, 10k and 100k synthetic clients.

    python benchmarks/memory_scaling.py [--clients 1000,10000,100000] [--rounds 5] [--samples 200000]

Each client count runs in a fresh subprocess (``--worker``), so every RSS figure is that run's alone. The data are
the same in every run: ``--samples`` synthetic points x ~ N(0, I_60) labelled by a fixed random linear model
(10 classes), split into N contiguous equal blocks (a natural split, one block per client: with 100k clients every
client holds 2 samples). Only the number of clients changes, so any growth of memory with N is the framework's
per-client cost: the index arrays (``int64``, the same 8 bytes per sample in every run, plus a numpy header per
client), the per-client bookkeeping of the data module, and the ``ClientStateStore`` entries (here SgdArmijo's step
size, persisted for every client that has been sampled: 20 per round, so bounded by the rounds, not by N).

The run: ``FederatedLoop`` + ``Trainer`` (as ``train.py``), logistic regression 60-10, SgdArmijo (eta_max=1,
reset="last") as the client optimizer, 20 clients per round, K = 5 local steps, batch 50, ``--rounds`` rounds.

Reported per N: the set-up time, RSS after ``setup()`` (data + split), peak RSS of the process (``VmHWM``), the
memory of the index arrays, the number of client-state entries, and the peak RSS growth per client beyond the 1k
run: ``(peak_N - peak_1k) / (N - 1000)``, in total and without the index arrays' own growth.

Target (docs/benchmarks.md): memory flat in the number of clients apart from the data indices and client state
(< 1 KB per unsampled client beyond its index array).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def worker(args) -> None:
    import logging

    import numpy as np
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lightning.pytorch as pl

    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import ArrayDataset, FederatedDataModule
    from fedlightning.models import LogisticRegression
    from fedlightning.optim import SgdArmijo

    class SyntheticPool(FederatedDataModule):
        def __init__(self, num_clients, samples, dim=60, classes=10):
            super().__init__(num_clients=num_clients, batch_size=50, seed=0)
            self.samples, self.dim, self.classes = samples, dim, classes

        def load(self):
            rng = np.random.default_rng(0)
            x = rng.standard_normal((self.samples, self.dim), dtype=np.float32)
            w = rng.standard_normal((self.dim, self.classes)).astype(np.float32)
            y = np.argmax(x @ w, axis=1).astype(np.int64)
            data = ArrayDataset(torch.from_numpy(x), torch.from_numpy(y))
            return data, data, y

        def natural_clients(self):
            return np.array_split(np.arange(self.samples, dtype=np.int64), self._num_clients)

    rss_import = _status_kb("VmRSS")
    dm = SyntheticPool(args.clients, args.samples)
    t0 = time.perf_counter()
    dm.setup("fit")
    setup_s = time.perf_counter() - t0
    rss_setup = _status_kb("VmRSS")
    torch.manual_seed(0)
    loop = FederatedLoop(
        LogisticRegression(input_dim=60, num_classes=10),
        client_optimizer=lambda p: SgdArmijo(p, eta_max=1.0, reset="last"),
        local_steps=5,
        clients_per_round=20,
        seed=0,
    )
    trainer = pl.Trainer(
        max_steps=args.rounds,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg()],
    )
    t0 = time.perf_counter()
    trainer.fit(loop, datamodule=dm)
    fit_s = time.perf_counter() - t0
    store = loop.client_state.state_dict()
    with open(args.out, "w") as f:
        json.dump(
            {
                "rss_import_kb": rss_import,
                "rss_setup_kb": rss_setup,
                "rss_end_kb": _status_kb("VmRSS"),
                "peak_kb": _status_kb("VmHWM"),
                "setup_s": setup_s,
                "fit_s": fit_s,
                "index_bytes": int(sum(ix.nbytes for ix in dm.client_indices)),
                "state_entries": int(sum(len(d) for d in store.values())),
                "rounds": trainer.global_step,
            },
            f,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1000,10000,100000", help="comma-separated client counts (first = baseline)")
    ap.add_argument("--samples", type=int, default=200_000, help="training samples shared by all runs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.clients = int(args.clients)
        worker(args)
        return
    counts = [int(c) for c in args.clients.split(",")]
    if any(c > args.samples for c in counts) or any(c < 20 for c in counts):
        raise SystemExit("every client count must be in [20, --samples]")
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.samples:,} samples x 60 features shared by every run, "
        f"{args.rounds} rounds, 20 clients/round, K=5, SgdArmijo (per-client state)"
    )
    rows = []
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "mem.json")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--clients",
                str(n),
                "--samples",
                str(args.samples),
                "--rounds",
                str(args.rounds),
                "--out",
                out,
            ]
            proc = subprocess.run(
                cmd, cwd=tmp, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONWARNINGS="ignore")
            )
            if proc.returncode != 0:
                raise RuntimeError(f"worker for {n} clients failed:\n{proc.stderr[-3000:]}")
            with open(out) as f:
                rows.append((n, json.load(f)))
    base_n, base = rows[0]
    print(
        f"{'clients':>8s} {'setup s':>8s} {'RSS after setup MB':>19s} {'peak RSS MB':>12s} {'index MB':>9s} "
        f"{'state entries':>14s} {'peak growth B/client':>21s} {'same, beyond index':>19s}"
    )
    for n, r in rows:
        if n == base_n:
            per, per_ix = "(baseline)", ""
        else:
            grow = (r["peak_kb"] - base["peak_kb"]) * 1024 / (n - base_n)
            grow_ix = grow - (r["index_bytes"] - base["index_bytes"]) / (n - base_n)
            per, per_ix = f"{grow:.0f}", f"{grow_ix:.0f}"
        print(
            f"{n:8,d} {r['setup_s']:8.2f} {r['rss_setup_kb'] / 1024:19.1f} {r['peak_kb'] / 1024:12.1f} "
            f"{r['index_bytes'] / 2**20:9.2f} {r['state_entries']:14d} {per:>21s} {per_ix:>19s}"
        )
    print(
        "RSS after imports (same code in every run): "
        + ", ".join(f"{n:,}: {r['rss_import_kb'] / 1024:.0f} MB" for n, r in rows)
    )


if __name__ == "__main__":
    main()
