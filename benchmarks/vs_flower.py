"""fedlightning versus Flower's simulation engine on the same FedAvg workload: rounds per second and final accuracy.

    python benchmarks/vs_flower.py [--rounds 40] [--warmup 2] [--fl-modes sequential,vectorized]

Flower is an optional *benchmark* dependency, never a runtime one (``pip install -e ".[bench]"`` installs
``flwr[simulation]``); without it the script says so and exits 0. To keep the project's environment untouched,
install it into a separate virtual environment that also sees the project's packages, e.g.::

    python3 -m venv /tmp/flwr-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/flwr-venv/lib/python3.11/site-packages/zz_project.pth
    /tmp/flwr-venv/bin/pip install "flwr[simulation]"
    /tmp/flwr-venv/bin/python benchmarks/vs_flower.py

Workload (identical in both): FedAvg (sample-weighted), scikit-learn digits split over 100 clients by
fedlightning's ``DigitsDataModule`` (Dirichlet 0.3, seed 0 — Flower's ClientApp for partition ``i`` trains on exactly
fedlightning's client ``i``), 20 clients per round, K = 20 local SGD steps (lr 0.1) on shuffled epochs of batch 50,
MLP 64-128-10 from the same initial weights; test accuracy of the global model on the same held-out 20 % of the
digits after the last round.

* fedlightning: ``FederatedLoop`` in a Lightning ``Trainer`` (as ``train.py`` runs it), one process, one torch thread,
  with ``client_execution="sequential"`` and ``"vectorized"``.
* Flower: the current Message API (``ServerApp`` + ``flwr.serverapp.strategy.FedAvg``, ``ClientApp`` with a
  ``@train`` function: the usual hand-written PyTorch client loop) in ``flwr.simulation.run_simulation`` with the
  Ray backend, 100 virtual SuperNodes, Ray limited to the machine's 2 CPUs and each client to 1 CPU (so 2 clients
  train in parallel; Flower gets *both* cores, fedlightning one).

Reported: steady-state rounds/second (rounds after ``--warmup``, from a timestamp taken at the end of each round:
for fedlightning a Trainer callback, for Flower the strategy's ``evaluate_fn``, which Flower calls after every
round), the end-to-end wall time of the whole run including start-up (Trainer set-up; Ray start, actor pool, the
actors' imports), the ratio fedlightning / Flower, and the final test accuracy of both (the two sample different
clients each round, so accuracies agree within a band, not exactly).

Target (docs/benchmarks.md): fedlightning >= 5x Flower's rounds/second.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

NUM_CLIENTS, CPR, K, B, LR, SEED = 100, 20, 20, 50, 0.1, 0

# set by main() before the Flower run; read by the ServerApp (a thread of this process)
CONFIG = {"rounds": 40}
STAMPS: list = []
RESULT: dict = {}


def make_dm():
    from fedlightning.datamodules import DigitsDataModule, Dirichlet

    dm = DigitsDataModule(num_clients=NUM_CLIENTS, batch_size=B, partition=Dirichlet(0.3), seed=0)
    dm.setup("fit")
    return dm


def make_model():
    from fedlightning.models import MLP

    return MLP(input_dim=64, hidden=[128], num_classes=10)


def init_state():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in make_model().state_dict().items()}


def test_accuracy(model, dm) -> float:
    x, y = dm.test_dataset.x, dm.test_dataset.y
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


# ---------------------------------------------------------------------------------------------- fedlightning
def run_fedlightning(rounds: int, warmup: int, execution: str) -> dict:
    return train_fedlightning(rounds, warmup, execution)[0]


def train_fedlightning(rounds: int, warmup: int, execution: str, groups: int | None = None):
    """``(rounds/s, wall seconds and test accuracy as a dict, the trained model)`` of fedlightning on this workload;
    ``groups``: ``max_parallel_clients`` of a vectorized run."""
    import lightning.pytorch as pl

    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg

    class Clock(pl.Callback):
        def __init__(self):
            self.stamps = []

        def on_train_batch_end(self, *args):
            self.stamps.append(time.perf_counter())

    model = make_model()
    model.load_state_dict(init_state())
    dm = make_dm()
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        local_steps=K,
        clients_per_round=CPR,
        seed=SEED,
        client_execution=execution,
        max_parallel_clients=groups if execution == "vectorized" else None,
    )
    clock = Clock()
    trainer = pl.Trainer(
        max_steps=rounds,
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
    wall = time.perf_counter() - t0
    s = clock.stamps
    return {"rps": (len(s) - warmup) / (s[-1] - s[warmup - 1]), "wall": wall, "acc": test_accuracy(model, dm)}, model


# ---------------------------------------------------------------------------------------------- Flower
_CLIENT_CACHE: dict = {}


def _client_side():
    """Per-actor cache: the split (identical to fedlightning's) and a working model."""
    if not _CLIENT_CACHE:
        torch.set_num_threads(1)
        dm = make_dm()
        _CLIENT_CACHE.update(
            x=dm.train_dataset.x,
            y=dm.train_dataset.y,
            clients=[torch.as_tensor(ix, dtype=torch.long) for ix in dm.client_indices],
            net=make_model(),
        )
    return _CLIENT_CACHE


def build_flower_apps():
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fedlightning.state import derive_seed

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context):
        c = _client_side()
        pid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        net, x_all, y_all, idx = c["net"], c["x"], c["y"], c["clients"][pid]
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(derive_seed(SEED, "data", rnd, pid))
        batches, losses = iter(()), []
        for _ in range(K):
            bi = next(batches, None)
            if bi is None:  # a new shuffled epoch over the client's samples (last partial batch kept)
                batches = iter(torch.split(idx[torch.randperm(len(idx), generator=gen)], B))
                bi = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x_all[bi]), y_all[bi])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        content = RecordDict(
            {
                "arrays": ArrayRecord(net.state_dict()),
                "metrics": MetricRecord({"train_loss": float(np.mean(losses)), "num-examples": len(idx)}),
            }
        )
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        dm = make_dm()
        rounds = CONFIG["rounds"]

        def evaluate_fn(server_round: int, arrays: ArrayRecord):
            STAMPS.append(time.perf_counter())
            if server_round == rounds:
                model = make_model()
                model.load_state_dict(arrays.to_torch_state_dict())
                RESULT["acc"] = test_accuracy(model, dm)
                return MetricRecord({"accuracy": RESULT["acc"]})
            return None

        strategy = FedAvg(
            fraction_train=CPR / NUM_CLIENTS,
            fraction_evaluate=0.0,
            min_train_nodes=CPR,
            min_available_nodes=NUM_CLIENTS,
        )
        strategy.start(grid=grid, initial_arrays=ArrayRecord(init_state()), num_rounds=rounds, evaluate_fn=evaluate_fn)

    return server_app, client_app


def run_flower(rounds: int, warmup: int, cpus: int) -> dict:
    from flwr.simulation import run_simulation

    CONFIG["rounds"] = rounds
    STAMPS.clear()
    RESULT.clear()
    server_app, client_app = build_flower_apps()
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "num_gpus": 0,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.ERROR,
        },
    }
    t0 = time.perf_counter()
    run_simulation(
        server_app=server_app, client_app=client_app, num_supernodes=NUM_CLIENTS, backend_config=backend_config
    )
    wall = time.perf_counter() - t0
    # STAMPS[0] is the evaluation before round 1, STAMPS[r] the end of round r
    if len(STAMPS) != rounds + 1 or "acc" not in RESULT:
        raise RuntimeError(f"the Flower run did not complete {rounds} rounds ({len(STAMPS) - 1} recorded)")
    return {"rps": (rounds - warmup) / (STAMPS[rounds] - STAMPS[warmup]), "wall": wall, "acc": RESULT["acc"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="communication rounds per run")
    ap.add_argument("--warmup", type=int, default=2, help="rounds excluded from rounds/second")
    ap.add_argument("--fl-modes", default="sequential,vectorized", help="fedlightning client_execution modes to run")
    ap.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 1), help="CPUs Ray may use (default 2)")
    args = ap.parse_args()
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError as err:
        print(
            f"Flower is not installed ({err}); this benchmark is optional: pip install 'flwr[simulation]' "
            "(or the project's [bench] extra) to run it. Nothing measured."
        )
        return 0
    if args.rounds <= args.warmup or args.warmup < 1:
        raise SystemExit("need --rounds > --warmup >= 1")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    print(
        f"flwr {flwr.__version__}, ray {ray.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start; {args.rounds} rounds ({args.warmup} warm-up), "
        f"{NUM_CLIENTS} clients, {CPR}/round, K={K}, batch {B}",
        flush=True,
    )
    results = {}
    for mode in [m.strip() for m in args.fl_modes.split(",") if m.strip()]:
        results[f"fedlightning ({mode}, 1 process, 1 thread)"] = run_fedlightning(args.rounds, args.warmup, mode)
        print("done:", mode, results[f"fedlightning ({mode}, 1 process, 1 thread)"], flush=True)
    flower_name = f"Flower simulation (Ray, {args.cpus} CPUs, 1 CPU/client)"
    results[flower_name] = run_flower(args.rounds, args.warmup, args.cpus)
    flower = results[flower_name]
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    print(f"{'run':52s} {'rounds/s':>9s} {'x Flower':>9s} {'wall s (incl. start-up)':>24s} {'test acc':>9s}")
    for name, r in results.items():
        print(f"{name:52s} {r['rps']:9.2f} {r['rps'] / flower['rps']:9.2f} {r['wall']:24.1f} {r['acc']:9.3f}")
    best = max(r["rps"] for n, r in results.items() if n != flower_name)
    ratio = best / flower["rps"]
    print(
        f"fastest fedlightning / Flower = {ratio:.1f}x (steady-state rounds/s) -> target >= 5x "
        f"{'met' if ratio >= 5 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    # Run as the importable module ``vs_flower`` so that Ray's workers unpickle the ClientApp by reference.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_flower

    sys.exit(vs_flower.main())
