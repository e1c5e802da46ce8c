"""Federated rounds with N CPU processes (Lightning DDP, gloo) in which the client sampled second misbehaves.

    python tests/scripts/ddp_client_faults.py --devices 2 --rounds 2 --out result.pt

Round 0: that client's update is replaced by -3e38 (the aggregation checks skip it); rank 0 saves the global weights
and the round's counts after the round, and every rank writes the "skipped" warnings it gave to ``<out>.rank<r>``.
Round 1: its training_step raises IndexError (the run stops on every process). With two processes the client sampled
second is trained by rank 1. Used by tests/test_client_faults.py, which also imports :func:`fit` for the one-process
reference.
"""

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402

from fedlightning import FederatedLoop  # noqa: E402
from fedlightning.callbacks import FedAvg, FederatedCallback  # noqa: E402
from fedlightning.datamodules import DigitsDataModule, Dirichlet  # noqa: E402
from fedlightning.models import MLP  # noqa: E402

VICTIM_POSITION = 1


class Faults(FederatedCallback):
    """Makes the client at VICTIM_POSITION of the round's sample overflow (round 0) or raise (round 1); records the
    global model before each round, this process's client updates ``(round, position, delta, num_samples)``, the
    rounds' counts, and (``out``, rank 0) saves the weights and counts after each round."""

    def __init__(self, out=None):
        super().__init__()
        self.out, self.start, self.updates, self.results = out, [], [], []

    def on_round_start(self, trainer, loop, plan):
        self.start.append(torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().double().clone())

    def client_objective(self, trainer, loop, plan, client_id):
        loop.client_worker.model.raising = plan.round == 1 and plan.client_ids.index(client_id) == VICTIM_POSITION
        return []

    def on_client_end(self, trainer, loop, plan, update):
        position = plan.client_ids.index(update.client_id)
        if plan.round == 0 and position == VICTIM_POSITION:
            update.delta.fill_(-3e38)
        if not update.failed:
            self.updates.append((plan.round, position, update.delta.double().clone(), update.num_samples))

    def on_round_end(self, trainer, loop, result):
        self.results.append((result.plan.client_ids, result.num_clients, result.num_failed))
        if self.out and trainer.global_rank == 0:
            torch.save(
                {
                    "weights": torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach(),
                    "results": self.results,
                },
                self.out,
            )


class Net(MLP):
    raising = False

    def training_step(self, batch, batch_idx):
        if self.raising:
            raise IndexError("Target 12 is out of bounds")
        return super().training_step(batch, batch_idx)


def fit(devices: int, rounds: int, out=None):
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    loop = FederatedLoop(
        Net(input_dim=64, hidden=[16]),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=3,
        clients_per_round=4,
        seed=1,
    )
    faults = Faults(out)
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg(), faults],
    )
    dm = DigitsDataModule(num_clients=12, batch_size=20, partition=Dirichlet(0.5), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(loop, datamodule=dm)
        finally:
            if out:
                skipped = [str(w.message) for w in caught if " skipped (" in str(w.message)]
                with open(f"{out}.rank{trainer.global_rank}", "w") as f:
                    f.write("\n".join(skipped))
    return loop, faults


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fit(args.devices, args.rounds, args.out)


if __name__ == "__main__":
    main()
