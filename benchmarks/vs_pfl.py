"""fedlightning versus Apple's pfl-research (PyPI ``pfl``) on the same FedAvg workload: rounds/s, accuracy, weights.

    python benchmarks/vs_pfl.py [--rounds 40] [--warmup 2] [--fl-modes sequential,vectorized] [--groups 20]

pfl is an optional *benchmark* dependency, never a runtime one; without it the script says so and exits 0. Its
install upgrades packages the project's environment pins (``pip install --dry-run pfl`` lists them), so install it
into a separate virtual environment that also sees the project's packages::

    python3 -m venv ../pfl-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > ../pfl-venv/lib/python3.11/site-packages/zz_project.pth
    ../pfl-venv/bin/pip install pfl
    ../pfl-venv/bin/python benchmarks/vs_pfl.py

Workload (identical in all runs, the one of benchmarks/vs_flower.py): FedAvg (sample-weighted, server learning rate
1), scikit-learn digits over 100 clients by fedlightning's ``DigitsDataModule`` (Dirichlet 0.3, seed 0), 20 clients
per round, K = 20 local SGD steps (lr 0.1) of batch 50 on shuffled epochs, MLP 64-128-10 from the same initial
weights, one process, one torch thread; test accuracy of the global model after the last round.

* fedlightning: ``FederatedLoop`` in a Lightning ``Trainer`` with ``client_execution="sequential"`` and
  ``"vectorized"`` (and ``max_parallel_clients=--groups``, default the cohort: one group).
* pfl: its PyTorch simulation (``FederatedAveraging`` with ``SimulatedBackend``, ``PyTorchModel`` with a local SGD
  and a central SGD of learning rate 1, ``WeightByDatapoints``), driven with fedlightning's cohorts (a user sampler
  that yields each round's ``round_plan`` clients) and batches (each user's ``Dataset.iter`` yields the index batches
  of fedlightning's ``client_batch_sampler``), so the two compute the same algorithm on the same data.

Reported: steady-state rounds/second (rounds after ``--warmup``, from a timestamp taken at the end of each round), the
wall time of the whole run, the ratio to pfl, the final test accuracy, and max |w_fedlightning − w_pfl| of the final
global weights (same algorithm, same clients and batches: float32 summation order apart).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_flower import (  # noqa: E402
    CPR,
    LR,
    NUM_CLIENTS,
    SEED,
    K,
    init_state,
    make_dm,
    make_model,
    test_accuracy,
    train_fedlightning,
)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------------------------------------- fedlightning
def run_fedlightning(rounds: int, warmup: int, execution: str, groups: int | None) -> dict:
    result, model = train_fedlightning(rounds, warmup, execution, groups)
    return {**result, "weights": flat(model)}


def run_pfl(rounds: int, warmup: int) -> dict:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    dm = make_dm()
    dm.configure_rounds(CPR, K, SEED)
    x_all, y_all = dm.train_dataset.x, dm.train_dataset.y

    class Net(torch.nn.Module):
        """fedlightning's MLP with the ``loss`` and ``metrics`` pfl's PyTorchModel calls."""

        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.net.load_state_dict(init_state())

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            return F.cross_entropy(self.net(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=False):
            logits = self.net(x)
            return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y))}

    class ClientBatches(Dataset):
        """One client's data; ``iter`` yields fedlightning's index batches of the round (new shuffle per epoch)."""

        def __init__(self, client_id: int, round_: int):
            sampler = dm.client_batch_sampler(client_id, round_, seed=SEED)
            self.batches, it = [], iter(sampler)
            while len(self.batches) < K:
                idx = next(it, None)
                if idx is None:
                    it = iter(sampler)
                    continue
                self.batches.append(idx)
            idx = torch.as_tensor(dm.client_indices[client_id], dtype=torch.long)
            super().__init__(raw_data=[x_all[idx], y_all[idx]], user_id=str(client_id))

        def iter(self, batch_size):  # noqa: A003 - pfl's name
            for idx in self.batches:
                yield [x_all[idx], y_all[idx]]

    state = {"calls": 0}

    def user_sampler():  # fedlightning's cohort of each round, client after client
        r, i = divmod(state["calls"], CPR)
        state["calls"] += 1
        state["round"] = r
        return int(dm.round_plan(r).client_ids[i])

    def make_dataset(user_id):
        return ClientBatches(int(user_id), state["round"])

    federated = FederatedDataset(make_dataset, user_sampler)
    net = Net()
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[WeightByDatapoints()])
    stamps: list[float] = []

    class Clock(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            return False, Metrics()

    t0 = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds + 1, train_cohort_size=CPR, val_cohort_size=0
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=LR, local_num_epochs=None, local_num_steps=K, local_batch_size=None
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[Clock()],
        send_metrics_to_platform=False,
    )
    wall = time.perf_counter() - t0
    if len(stamps) != rounds:
        raise RuntimeError(f"the pfl run recorded {len(stamps)} of {rounds} rounds")
    return {
        "rps": (rounds - warmup) / (stamps[-1] - stamps[warmup - 1]),
        "wall": wall,
        "acc": test_accuracy(net.net, dm),
        "weights": flat(net.net),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="communication rounds per run")
    ap.add_argument("--warmup", type=int, default=2, help="rounds excluded from rounds/second")
    ap.add_argument("--fl-modes", default="sequential,vectorized", help="fedlightning client_execution modes to run")
    ap.add_argument("--groups", type=int, default=None, help="max_parallel_clients of the vectorized run")
    args = ap.parse_args()
    try:
        import pfl  # noqa: F401
        from pfl.model.pytorch import PyTorchModel  # noqa: F401
    except ImportError as err:
        print(f"pfl is not installed ({err}); this benchmark is optional (see its docstring). Nothing measured.")
        return 0
    if args.rounds <= args.warmup or args.warmup < 1:
        raise SystemExit("need --rounds > --warmup >= 1")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("pfl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    from importlib.metadata import version

    print(
        f"pfl {version('pfl')}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f} at start; {args.rounds} rounds ({args.warmup} warm-up), {NUM_CLIENTS} clients, "
        f"{CPR}/round, K={K}, one thread",
        flush=True,
    )
    results = {}
    for mode in [m.strip() for m in args.fl_modes.split(",") if m.strip()]:
        name = f"fedlightning ({mode}{f', groups of {args.groups}' if mode == 'vectorized' and args.groups else ''})"
        results[name] = run_fedlightning(args.rounds, args.warmup, mode, args.groups)
        print("done:", name, flush=True)
    pfl_name = "pfl-research (PyTorch simulation)"
    results[pfl_name] = run_pfl(args.rounds, args.warmup)
    ref = results[pfl_name]
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    print(f"{'run':44s} {'rounds/s':>9s} {'x pfl':>7s} {'wall s':>8s} {'test acc':>9s} {'max|w - w_pfl|':>15s}")
    for name, r in results.items():
        diff = float((r["weights"] - ref["weights"]).abs().max())
        print(f"{name:44s} {r['rps']:9.2f} {r['rps'] / ref['rps']:7.2f} {r['wall']:8.1f} {r['acc']:9.3f} {diff:15.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
