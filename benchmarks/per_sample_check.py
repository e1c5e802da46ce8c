"""The per-sample path's check of every padded step, timed against the same runs without it.

    python benchmarks/per_sample_check.py [--rounds 6] [--repeats 3] [--threads 1]

Workload: digits, 100 clients (Dirichlet 0.3, so most steps are padded), 20 clients per round, K = 20, batch 50,
the MLP 64-128-10 written as a user writes it with a logged batch accuracy, which loss interception cannot split
per sample: its padded steps take the per-sample path (one ``training_step`` per sample), and each of them is also
checked on its own rows (``_ModelCall._check_padded_means``: one batched ``training_step`` call without gradients).
The baseline is the same vectorized run with that check replaced by a no-op; sequential training is shown for
reference. Runs alternate (check, no check, sequential) ``--repeats`` times; rounds/s is the median round's inverse
(process CPU time, the first 2 rounds dropped). Both vectorized runs end with the same weights (printed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.vectorized import call as vcall


class LogsAccuracy(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("batch_acc", (logits.argmax(-1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class RoundTimes(pl.Callback):
    def __init__(self):
        self.times, self._t = [], 0.0

    def on_train_batch_start(self, *args):
        self._t = time.process_time()

    def on_train_batch_end(self, *args):
        self.times.append(time.process_time() - self._t)


def run(mode: str, rounds: int, check: bool) -> tuple[float, torch.Tensor]:
    original = vcall._ModelCall._check_padded_means
    if not check:
        vcall._ModelCall._check_padded_means = lambda self, *a, **k: None
    try:
        model, timer = LogsAccuracy(), RoundTimes()
        loop = FederatedLoop(model, local_steps=20, clients_per_round=20, seed=0, client_execution=mode)
        dm = DigitsDataModule(num_clients=100, batch_size=50, partition=Dirichlet(alpha=0.3), seed=0)
        trainer = pl.Trainer(
            max_steps=rounds,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[FedAvg(), timer],
        )
        trainer.fit(loop, datamodule=dm)
    finally:
        vcall._ModelCall._check_padded_means = original
    if mode == "vectorized":
        assert "per-sample" in loop.vectorized_engine.call.probed, "the workload did not take the per-sample path"
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return 1.0 / statistics.median(timer.times[2:]), weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rates: dict[str, list[float]] = {"check": [], "no check": [], "sequential": []}
    weights = {}
    for _ in range(args.repeats):
        for name, mode, check in (
            ("check", "vectorized", True),
            ("no check", "vectorized", False),
            ("sequential", "sequential", True),
        ):
            rate, weights[name] = run(mode, args.rounds, check)
            rates[name].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.repeats} repeats")
    for name, rate in med.items():
        print(f"{name:12s} {rate:7.2f} rounds/s")
    ratio, versus = med["check"] / med["no check"], med["check"] / med["sequential"]
    print(f"check / no check: {ratio:.3f}; check / sequential: {versus:.2f}")
    print(f"vectorized weights with and without the check equal: {torch.equal(weights['check'], weights['no check'])}")


if __name__ == "__main__":
    main()
