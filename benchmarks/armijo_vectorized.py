"""Where the vectorized SgdArmijo step spends its passes and time, against the passes the sequential search makes.

    python benchmarks/armijo_vectorized.py [--rounds 10] [--threads 1] [--clock process] [--workload ...]
    python benchmarks/armijo_vectorized.py --algorithm FedExpSLS ...   # a line-search config of algorithms_vectorized

Runs one vectorized run of a ``vectorized_speedup.py`` workload (default: FedSLS's client optimizer on the digits
workload with the user-written MLP) and counts, per local step of the round's clients in lockstep: the batched trial
calls and the rows (one (client, grid point) pair each) they evaluate, next to the trials the sequential searches
make (the telemetry both modes share: forward passes minus backward passes, summed over clients) and the trials of
the step's longest search (the fewest calls a lockstep search can make is one, its rows at least the trials).
``--algorithm`` runs a config of ``algorithms_vectorized.py`` instead (its callbacks and client optimizer on that
script's workload: FedSLS, FedExpSLS, FedLiLS). Times
per step: the gradient evaluation (one batched forward and backward), the trial calls (with the trial points), and
the rest of the rule's step; and a least-squares fit of a trial call's time as ``fixed + per row × rows``. Counts
are exact; times are wall clock (``--clock process``: this process's CPU time; ``--threads 1`` for the docs' numbers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms_vectorized as av  # noqa: E402
import fedlightning.vectorized.rules as rules  # noqa: E402
import fedlightning.vectorized.step as step_module  # noqa: E402
import vectorized_speedup as vs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of the run (every round's steps are counted)")
    ap.add_argument("--workload", default="digits-usermlp-armijo", help="a vectorized_speedup.py workload")
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="time by wall clock (default) or by this process's CPU time (CPU runs only)",
    )
    ap.add_argument("--algorithm", default=None, help="a line-search config of algorithms_vectorized.py instead")
    vs.add_common_arguments(ap)
    args = ap.parse_args()
    if args.clock == "process":
        if args.accelerator != "cpu":
            raise SystemExit("--clock process: CPU runs only (GPU work is not the process's CPU time)")
        vs._clock = time.process_time
    args.repeats = 1
    vs.start(args, args.workload, vs.WORKLOADS, "workload", min_rounds=3)
    model_fn, optimizer, dm_fn = vs.WORKLOADS[args.workload]
    datamodule = vs.load_data(args.workload, dm_fn, width=20)
    if datamodule is None:
        return
    torch.manual_seed(0)
    init_state = model_fn().state_dict()
    if args.algorithm is not None:
        if args.algorithm not in av.ALGORITHMS:
            raise SystemExit(f"unknown algorithm {args.algorithm!r}; choose from {list(av.ALGORITHMS)}")
        parts = av.algorithm_parts(*av.ALGORITHMS[args.algorithm])
        torch.manual_seed(0)
        init_state = av.UserMLP().state_dict()
        datamodule = vs.digits()
        datamodule.setup("fit")

    steps = []  # per local step: dict of counts and times
    calls = []  # (rows, seconds) of every trial call
    local_step, trial = rules._BatchedArmijo.step, step_module._StepEvaluator.trial
    gradient, points = step_module._StepEvaluator.gradient, rules._BatchedArmijo._points

    def counted_step(self, W, ev, record, alive):
        before = record.forwards.clone()
        entry = {"calls": 0, "rows": 0, "trial_s": 0.0, "gradient_s": 0.0, "points_s": 0.0}
        steps.append(entry)
        start = vs._clock()
        local_step(self, W, ev, record, alive)
        entry["step_s"] = vs._clock() - start
        trials = (record.forwards - before - alive.long()).tolist()  # forwards beyond the gradient evaluation
        entry["trials"], entry["longest"] = sum(trials), max(trials)

    def counted_trial(self, points, clients=None, line=None):
        start = vs._clock()
        out = trial(self, points, clients, line)
        seconds = vs._clock() - start
        calls.append((points.shape[0], seconds))
        entry = steps[-1]
        entry["calls"] += 1
        entry["rows"] += points.shape[0]
        entry["trial_s"] += seconds
        return out

    def timed_gradient(self, *a, **k):
        start = vs._clock()
        out = gradient(self, *a, **k)
        if steps and self.replay:
            steps[-1]["gradient_s"] += vs._clock() - start
        return out

    def timed_points(*a, **k):
        start = vs._clock()
        out = points(*a, **k)
        steps[-1]["points_s"] += vs._clock() - start
        return out

    rules._BatchedArmijo.step = counted_step
    rules._BatchedArmijo._points = staticmethod(timed_points)
    step_module._StepEvaluator.trial = counted_trial
    step_module._StepEvaluator.gradient = timed_gradient
    try:
        if args.algorithm is None:
            vs.run(model_fn, optimizer, datamodule, "vectorized", args.rounds, init_state)
        else:
            av.run(parts, datamodule, "vectorized", args.rounds, init_state)
    finally:
        rules._BatchedArmijo.step = local_step
        step_module._StepEvaluator.trial = trial
        step_module._StepEvaluator.gradient = gradient
        rules._BatchedArmijo._points = staticmethod(points)

    n = len(steps)

    def mean(key):
        return sum(s[key] for s in steps) / n

    print(f"{n} local steps of {vs.CLIENTS_PER_ROUND} clients in lockstep ({args.rounds} rounds), per step:")
    print(f"  sequential trials (sum over clients)  {mean('trials'):8.1f}")
    print(f"  trials of the longest search          {mean('longest'):8.1f}")
    print(f"  vectorized trial calls                {mean('calls'):8.2f}")
    print(
        f"  vectorized trial rows                 {mean('rows'):8.1f}   ({mean('rows') / mean('trials'):.2f} per trial)"
    )
    rest = [s["step_s"] - s["gradient_s"] - s["trial_s"] - s["points_s"] for s in steps]
    print(
        f"  ms: gradient evaluation {mean('gradient_s') * 1e3:.2f}, trial calls {mean('trial_s') * 1e3:.2f}, "
        f"trial points {mean('points_s') * 1e3:.2f}, "
        f"rest of the step {sum(rest) / n * 1e3:.2f} (medians {statistics.median(s['step_s'] for s in steps) * 1e3:.2f}"
        f" per step)"
    )
    rows = np.array([r for r, _ in calls], dtype=float)
    secs = np.array([t for _, t in calls])
    fixed, per_row = np.linalg.lstsq(np.stack([np.ones_like(rows), rows], 1), secs, rcond=None)[0]
    print(
        f"  a trial call: {fixed * 1e3:.2f} ms + {per_row * 1e6:.1f} us per row (least squares over {len(calls)} calls)"
    )


if __name__ == "__main__":
    main()
