"""``client_execution="auto"`` on a zoo of users' modules: does it pick the faster mode, is it never slower, and what
does its measurement cost?

    python benchmarks/auto_zoo.py [--rounds 20] [--repeats 3] [--threads 1] [--models mlp,cnn,...] [--accelerator cuda]
                                  [--clock process]

For every module of the zoo (written as a user writes them, ``benchmarks/user_models.py``): the same federated run
(FedAvg, 20 clients per round, K = 20 local steps, batch 50, SGD from the module's ``configure_optimizers``, unless
the entry sets another round shape) with ``client_execution`` = ``"sequential"``, ``"vectorized"`` and ``"auto"``,
alternated ``--repeats`` times. A run's time is the sum of its rounds' wall times (the loop's ``training_step``:
clients, aggregation, server step), first round included, so ``auto``'s one-time measurement and the vectorized
engine's first-call probes are counted. Every run of a mode trains the same clients in round r, and other processes
only ever add time, so a mode's time is the sum over rounds of each round's fastest time over the repeats (the
paired per-round minimum of ``vectorized_speedup.py``).

Printed per module: the three times, the faster of sequential and vectorized, ``auto``'s choice and reason,
``auto``'s speed against sequential (sequential time / auto time; the target is >= 0.9), and what ``auto``'s
measurement cost in sequential rounds: the wall time of its decision (``_auto_decide``: warm-ups and timed throw-away
rounds; the fastest over the repeats) divided by one sequential round of the same shape (the mean of the sequential
run's paired-minimum rounds after the first, whose first-call costs a later round does not have).

``--clock process`` (CPU runs only) times the rounds, ``auto``'s decision and ``auto``'s own measurement in the
process's CPU time instead of wall time: on a machine whose cores other jobs share, wall times (and so ``auto``'s
one-shot timing) include the time those jobs took; with ``--threads 1`` the process's CPU time is the work the
modes differ in.

Zoo: ``mlp`` (:class:`UserMLP`), ``metrics-mlp`` (a torchmetrics accuracy in ``training_step``), ``dropout-mlp``
(dropout 0.2), ``wide-mlp`` (two hidden layers of 1024 units), ``cnn`` (conv-ReLU-pool-linear), ``bn-cnn`` (with
BatchNorm2d), all on scikit-learn's digits (100 clients, Dirichlet 0.3); ``char-lstm`` (embedding 8, one LSTM layer of
64 units, lr 0.8) and ``char-gru`` (the same with a GRU layer) on LEAF Shakespeare by role, 20-character windows;
``resnet18-k2``, a round that is expensive on a CPU: torchvision's ``resnet18`` (:class:`UserResNet18`, BatchNorm)
with 5 clients per round, K = 2, batch 16, on seeded random 3x32x32 images (:class:`FakeCifar`: a round's arithmetic
does not depend on pixel values).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

import lightning.pytorch as pl
import torch

import fedlightning.vectorized.auto as auto
import vectorized_speedup
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import IID, ArrayDataset, FederatedDataModule
from user_models import (
    BatchNormCNN,
    DropoutMLP,
    MetricsMLP,
    UserCharGRU,
    UserCharLSTM,
    UserCNN,
    UserMLP,
    UserResNet18,
    WideMLP,
)
from vectorized_speedup import (
    CLIENTS_PER_ROUND,
    LOCAL_STEPS,
    RoundTimer,
    add_common_arguments,
    digits,
    load_data,
    shakespeare,
    start,
)

MODES = ("sequential", "vectorized", "auto")
digits_all = functools.partial(digits, val_fraction=0.0)  # every sample in a client (no validation split)
shakespeare_all = functools.partial(shakespeare, val_fraction=0.0)


class FakeCifar(FederatedDataModule):
    """Seeded random 3x32x32 images with balanced labels 0..9: 20 clients of 64 samples (IID), batch 16."""

    def __init__(self):
        super().__init__(num_clients=20, batch_size=16, partition=IID(), seed=0, val_fraction=0.0)

    def load(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(20 * 64, 3, 32, 32, generator=gen)
        y = torch.arange(20 * 64) % 10
        data = ArrayDataset(x, y)
        return data, data, y.numpy()


#: name: (module class, data module, (clients per round, local steps))
ZOO = {
    "mlp": (UserMLP, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "metrics-mlp": (MetricsMLP, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "dropout-mlp": (DropoutMLP, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "wide-mlp": (WideMLP, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "cnn": (UserCNN, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "bn-cnn": (BatchNormCNN, digits_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "char-lstm": (UserCharLSTM, shakespeare_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "char-gru": (UserCharGRU, shakespeare_all, (CLIENTS_PER_ROUND, LOCAL_STEPS)),
    "resnet18-k2": (UserResNet18, FakeCifar, (5, 2)),
}


class DecisionTimer:
    """Wall time of ``auto``'s decision (``fedlightning.vectorized.auto._auto_decide``) while installed."""

    def __init__(self):
        self.seconds = []

    def __enter__(self):
        self._decide = auto._auto_decide

        def timed(*args, **kwargs):
            t0 = vectorized_speedup._clock()
            try:
                return self._decide(*args, **kwargs)
            finally:
                self.seconds.append(vectorized_speedup._clock() - t0)

        auto._auto_decide = timed
        return self

    def __exit__(self, *exc):
        auto._auto_decide = self._decide


def run(model_cls, datamodule, mode, rounds, init_state, shape):
    """One run; returns (seconds of every round, the loop, seconds of auto's decision or None)."""
    model = model_cls()
    model.load_state_dict(init_state)
    clients, steps = shape
    loop = FederatedLoop(model, local_steps=steps, clients_per_round=clients, seed=0, client_execution=mode)
    timer = RoundTimer()
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator=vectorized_speedup.ACCELERATOR,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[FedAvg(), timer],
    )
    with DecisionTimer() as decision:
        trainer.fit(loop, datamodule=datamodule)
    return timer.times, loop, (decision.seconds[0] if decision.seconds else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds per run (all timed)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated subset of " + ", ".join(ZOO))
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall time (default) or the process's CPU time, for rounds and auto's measurement (CPU only)",
    )
    add_common_arguments(ap)
    args = ap.parse_args()
    if args.clock == "process":
        if args.accelerator != "cpu":
            raise SystemExit("--clock process: CPU runs only (GPU work is not the process's CPU time)")
        vectorized_speedup._clock = time.process_time  # RoundTimer's and DecisionTimer's clock
        auto._clock = time.process_time
    names = start(args, args.models, ZOO, "models", min_rounds=2)
    print(f"clock: {args.clock} time")
    logging.getLogger("fedlightning").setLevel(logging.WARNING)  # auto's choice is printed in the table
    print(
        f"{'model':12s} {'C,K':>5s} {'sequential s':>12s} {'vectorized s':>12s} {'auto s':>8s} {'faster':>10s} "
        f"{'auto chose':>10s} {'auto vs seq':>11s} {'measure/round':>13s}  reason"
    )
    rows = []
    for name in names:
        model_cls, dm_fn, shape = ZOO[name]
        datamodule = load_data(name, dm_fn, width=12)
        if datamodule is None:
            continue
        torch.manual_seed(0)
        init_state = model_cls().state_dict()
        rounds = {m: None for m in MODES}
        choices, reason, decisions = [], None, []
        for _ in range(args.repeats):
            for mode in MODES:
                times, loop, decided = run(model_cls, datamodule, mode, args.rounds, init_state, shape)
                rounds[mode] = times if rounds[mode] is None else [min(a, b) for a, b in zip(rounds[mode], times)]
                if mode == "auto":
                    choices.append(loop.client_execution_choice)
                    reason = loop.client_execution_reason
                    if decided is not None:
                        decisions.append(decided)
        best = {m: sum(t) for m, t in rounds.items()}
        choice = max(set(choices), key=choices.count)
        if len(set(choices)) > 1:  # a measurement near the margin can go either way on a busy machine
            reason = f"chose {', '.join(choices)} over the repeats; last: {reason}"
        faster = "vectorized" if best["vectorized"] < best["sequential"] else "sequential"
        ratio = best["sequential"] / best["auto"]
        later = rounds["sequential"][1:]
        cost = min(decisions) / (sum(later) / len(later)) if decisions else float("nan")
        rows.append((name, faster, choice, ratio, cost))
        print(
            f"{name:12s} {f'{shape[0]},{shape[1]}':>5s} {best['sequential']:12.2f} {best['vectorized']:12.2f} "
            f"{best['auto']:8.2f} {faster:>10s} {choice:>10s} {ratio:10.2f}x {cost:12.2f}x  {reason}",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for name, faster, choice, ratio, cost in rows:
        verdict = "picked the faster mode" if faster == choice else "did NOT pick the faster mode"
        print(
            f"{name}: auto {verdict}; auto is {ratio:.2f}x sequential ({'meets' if ratio >= 0.9 else 'misses'} "
            f">= 0.9x); its measurement cost {cost:.2f} sequential rounds"
        )


if __name__ == "__main__":
    main()
