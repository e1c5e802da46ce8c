"""The cost of client groups on a CPU: vectorized/sequential round-time ratio with ``max_parallel_clients=None`` and
with an int equal to the cohort (one group either way), and with smaller groups, measured in one run.

    python benchmarks/groups_overhead.py [--workload digits-usermlp-sgd] [--rounds 12] [--repeats 3] [--threads 1]
        [--groups 20,10,5]

Runs ``vectorized_speedup.py``'s workload (20 clients per round, K = 20, batch 50; the user-written MLP by default)
alternating sequential, vectorized with ``max_parallel_clients=None`` and vectorized with each ``--groups`` value,
``--repeats`` times; the first two rounds of each run are warm-up. Prints each mode's median round time, its ratio
sequential / mode (median and paired per-round minimum, as vectorized_speedup.py) and the largest weight difference
to sequential.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vectorized_speedup as vs  # noqa: E402
from fedlightning import FederatedLoop  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="digits-usermlp-sgd", help="one of " + ", ".join(vs.WORKLOADS))
    ap.add_argument("--rounds", type=int, default=12, help="rounds per run (the first 2 are warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--groups", default="20,10,5", help="max_parallel_clients values to run besides None")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model_fn, optimizer, dm_fn = vs.WORKLOADS[args.workload]
    datamodule = dm_fn()
    torch.manual_seed(0)
    init_state = model_fn().state_dict()
    groups = [None] + [int(g) for g in args.groups.split(",") if g.strip()]
    modes = ["sequential"] + [f"vectorized/{g}" for g in groups]
    per_run = {m: [] for m in modes}
    weights = {}
    for _ in range(args.repeats):
        for mode in modes:
            limit = None if mode == "sequential" else mode.split("/")[1]
            limit = None if limit in (None, "None") else int(limit)

            def loop_with_groups(*a, _limit=limit, **kw):
                return FederatedLoop(*a, max_parallel_clients=_limit, **kw)

            vs.FederatedLoop = loop_with_groups
            times, w, _ = vs.run(model_fn, optimizer, datamodule, mode.split("/")[0], args.rounds, init_state)
            per_run[mode].append(times)
            weights[mode] = w
    paired = {m: sum(min(r[i] for r in runs) for i in range(len(runs[0]))) for m, runs in per_run.items()}
    median = {m: statistics.median([x for r in runs for x in r]) for m, runs in per_run.items()}
    print(f"{args.workload}, {args.rounds} rounds x {args.repeats} repeats, {args.threads} thread(s)")
    print(f"{'mode (max_parallel_clients)':30s} {'ms/round':>9s} {'seq/mode':>9s} {'paired':>7s} {'max|dw|':>9s}")
    for m in modes:
        diff = float((weights[m] - weights["sequential"]).abs().max())
        print(
            f"{m:30s} {median[m] * 1e3:9.1f} {median['sequential'] / median[m]:8.2f}x "
            f"{paired['sequential'] / paired[m]:6.2f}x {diff:9.1e}"
        )


if __name__ == "__main__":
    main()
