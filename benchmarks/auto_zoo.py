"""``client_execution="auto"`` on a zoo of users' modules: does it pick the faster mode, and is it never slower?

    python benchmarks/auto_zoo.py [--rounds 20] [--repeats 3] [--threads 1] [--models mlp,cnn,...] [--accelerator cuda]

For every module of the zoo (written as a user writes them, ``benchmarks/user_models.py``): the same federated run
(FedAvg, 20 clients per round, K = 20 local steps, batch 50, SGD from the module's ``configure_optimizers``) with
``client_execution`` = ``"sequential"``, ``"vectorized"`` and ``"auto"``, alternated ``--repeats`` times. A run's
time is the sum of its rounds' wall times (the loop's ``training_step``: clients, aggregation, server step), first
round included, so ``auto``'s one-time measurement and the vectorized engine's first-call probes are counted.
Every run of a mode trains the same clients in round r, and other processes only ever add time, so a mode's time is
the sum over rounds of each round's fastest time over the repeats (the paired per-round minimum of
``vectorized_speedup.py``).

Printed per module: the three times, the faster of sequential and vectorized, ``auto``'s choice and reason, and
``auto``'s speed against sequential (sequential time / auto time; the target is >= 0.9).

Zoo: ``mlp`` (:class:`UserMLP`), ``metrics-mlp`` (a torchmetrics accuracy in ``training_step``), ``dropout-mlp``
(dropout 0.2), ``wide-mlp`` (two hidden layers of 1024 units), ``cnn`` (conv-ReLU-pool-linear), ``bn-cnn`` (with BatchNorm2d), all on scikit-learn's digits (100
clients, Dirichlet 0.3); ``char-lstm`` (embedding 8, one LSTM layer of 64 units, lr 0.8) on LEAF Shakespeare by role,
20-character windows.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os

import torch

import lightning.pytorch as pl

import vectorized_speedup
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from user_models import BatchNormCNN, DropoutMLP, MetricsMLP, UserCharLSTM, UserCNN, UserMLP, WideMLP
from vectorized_speedup import (CLIENTS_PER_ROUND, LOCAL_STEPS, RoundTimer, add_common_arguments, digits, load_data,
                                shakespeare, start)

MODES = ("sequential", "vectorized", "auto")
digits_all = functools.partial(digits, val_fraction=0.0)  # every sample in a client (no validation split)
shakespeare_all = functools.partial(shakespeare, val_fraction=0.0)

ZOO = {
    "mlp": (UserMLP, digits_all),
    "metrics-mlp": (MetricsMLP, digits_all),
    "dropout-mlp": (DropoutMLP, digits_all),
    "wide-mlp": (WideMLP, digits_all),
    "cnn": (UserCNN, digits_all),
    "bn-cnn": (BatchNormCNN, digits_all),
    "char-lstm": (UserCharLSTM, shakespeare_all),
}


def run(model_cls, datamodule, mode, rounds, init_state):
    """One run; returns (seconds of every round, the loop)."""
    model = model_cls()
    model.load_state_dict(init_state)
    loop = FederatedLoop(model, local_steps=LOCAL_STEPS, clients_per_round=CLIENTS_PER_ROUND, seed=0,
                         client_execution=mode)
    timer = RoundTimer()
    trainer = pl.Trainer(max_steps=rounds, accelerator=vectorized_speedup.ACCELERATOR, devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[FedAvg(), timer])
    trainer.fit(loop, datamodule=datamodule)
    return timer.times, loop


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds per run (all timed)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated subset of " + ", ".join(ZOO))
    add_common_arguments(ap)
    args = ap.parse_args()
    names = start(args, args.models, ZOO, "models", min_rounds=1)
    logging.getLogger("fedlightning").setLevel(logging.WARNING)  # auto's choice is printed in the table
    print(f"{'model':12s} {'sequential s':>12s} {'vectorized s':>12s} {'auto s':>8s} {'faster':>10s} "
          f"{'auto chose':>10s} {'auto vs seq':>11s}  reason")
    rows = []
    for name in names:
        model_cls, dm_fn = ZOO[name]
        datamodule = load_data(name, dm_fn, width=12)
        if datamodule is None:
            continue
        torch.manual_seed(0)
        init_state = model_cls().state_dict()
        rounds = {m: None for m in MODES}
        choices, reason = [], None
        for _ in range(args.repeats):
            for mode in MODES:
                times, loop = run(model_cls, datamodule, mode, args.rounds, init_state)
                rounds[mode] = times if rounds[mode] is None else [min(a, b) for a, b in zip(rounds[mode], times)]
                if mode == "auto":
                    choices.append(loop.client_execution_choice)
                    reason = loop._runtime.auto_reason
        best = {m: sum(t) for m, t in rounds.items()}
        choice = max(set(choices), key=choices.count)
        if len(set(choices)) > 1:  # a measurement near the margin can go either way on a busy machine
            reason = f"chose {', '.join(choices)} over the repeats; last: {reason}"
        faster = "vectorized" if best["vectorized"] < best["sequential"] else "sequential"
        ratio = best["sequential"] / best["auto"]
        rows.append((name, faster, choice, ratio))
        print(f"{name:12s} {best['sequential']:12.2f} {best['vectorized']:12.2f} {best['auto']:8.2f} {faster:>10s} "
              f"{choice:>10s} {ratio:10.2f}x  {reason}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for name, faster, choice, ratio in rows:
        verdict = "picked the faster mode" if faster == choice else "did NOT pick the faster mode"
        print(f"{name}: auto {verdict}; auto is {ratio:.2f}x sequential ({'meets' if ratio >= 0.9 else 'misses'} >= 0.9x)")


if __name__ == "__main__":
    main()
