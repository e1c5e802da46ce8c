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

The calls, rows and sequential trials are also printed by local step of the round (a round's first steps make the
most calls).

``--baseline`` (with ``--algorithm``) runs FedAvg's config on the same workload side by side with the line search
(threads taking turns round by round, ``algorithms_vectorized.run_side_by_side``) and prints the median time of a
gradient evaluation in each (the same products on the same shapes; the line search's also concatenates the flat
gradient and keeps the outputs of the layers that read the batch). The share of real cells in the steps' padded
batches is printed either way.

``--repeat-gradient`` (with ``--algorithm``) also times one step's gradient evaluation (the sixth local step of the
first round) again and again at that step's weights and batch: as the line search makes it (keeping the generator
state and the outputs ``A``, the flat ``[C, D]`` gradient) and as FedAvg's rule makes it (per-parameter gradients),
each in a tight loop and after writing 8 MiB of other memory before every repetition (the trial calls' own memory
traffic comes between two gradient evaluations of a line search; FedAvg's rule has nothing in between).

``--windows`` also replays the run's searches (each client's first accepted grid point per step) under other window
policies: the first window ending at the largest point accepted at the client's last ``n`` steps of the round plus
``k``, second windows of ``s`` points, later ones doubling; it prints each policy's calls and rows per step and
their cost under the fitted call and row times (the policy ``_BatchedArmijo`` uses is marked).
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--windows", action="store_true", help="replay the searches under other window policies")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="with --algorithm: time FedAvg's gradient evaluations on the same workload, side by side",
    )
    ap.add_argument(
        "--repeat-gradient",
        action="store_true",
        help="with --algorithm: time one step's gradient evaluation in a loop, both forms, with and without 8 MiB "
        "written in between",
    )
    vs.add_common_arguments(ap)
    args = ap.parse_args()
    if args.clock == "process":
        if args.accelerator != "cpu":
            raise SystemExit("--clock process: CPU runs only (GPU work is not the process's CPU time)")
        vs._clock = time.process_time
    if (args.baseline or args.repeat_gradient) and args.algorithm is None:
        raise SystemExit("--baseline and --repeat-gradient need --algorithm (a config of algorithms_vectorized.py)")
    if args.repeat_gradient and args.accelerator != "cpu":
        raise SystemExit("--repeat-gradient: CPU runs only (it times CPU caches)")
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
    searches = []  # per local step: (searching [C], first accepted grid point [C], grid)
    fedavg_gradient_s = []  # --baseline: every gradient evaluation's time in FedAvg's run
    local_step, trial = rules._BatchedArmijo.step, step_module._StepEvaluator.trial
    search_windows = rules._BatchedArmijo._search_windows

    def recorded_search(self, W, g, ev, losses, norms, eta0, searching, grid):
        first_m, trials = search_windows(self, W, g, ev, losses, norms, eta0, searching, grid)
        searches.append((list(searching), list(first_m), grid))
        return first_m, trials

    gradient, points = step_module._StepEvaluator.gradient, rules._BatchedArmijo._points

    repeated = {}  # --repeat-gradient: form -> median ms

    def counted_step(self, W, ev, record, alive):
        if args.repeat_gradient and not repeated and len(steps) == 5:
            repeated.update(repeat_gradient(gradient, ev, W, alive))
        before = record.totals()[1].clone()
        entry = {"calls": 0, "rows": 0, "trial_s": 0.0, "gradient_s": 0.0, "points_s": 0.0}
        steps.append(entry)
        start = vs._clock()
        local_step(self, W, ev, record, alive)
        entry["step_s"] = vs._clock() - start
        trials = (record.totals()[1] - before - alive.long()).tolist()  # forwards beyond the gradient evaluation
        entry["trials"], entry["longest"] = sum(trials), max(trials)
        sizes = ev.layout.sizes  # the clients' real batch sizes, padded to the largest
        entry["cells"], entry["real_cells"] = len(sizes) * max(sizes), sum(sizes)

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
        seconds = vs._clock() - start
        if not self.replay and self.keep_effects:  # FedAvg's (a line search's replay), not a layout probe
            fedavg_gradient_s.append(seconds)
        if steps and self.replay:
            steps[-1]["gradient_s"] += seconds
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
    rules._BatchedArmijo._search_windows = recorded_search
    try:
        if args.algorithm is None:
            vs.run(model_fn, optimizer, datamodule, "vectorized", args.rounds, init_state)
        elif args.baseline:
            baseline = vs.digits()
            baseline.setup("fit")
            fedavg = av.algorithm_parts(*av.ALGORITHMS["FedAvg"])
            runs = {"line": (parts, "vectorized"), "FedAvg": (fedavg, "vectorized")}
            av.run_side_by_side(runs, {"line": datamodule, "FedAvg": baseline}, args.rounds, init_state, vs._clock)
        else:
            av.run(parts, datamodule, "vectorized", args.rounds, init_state)
    finally:
        rules._BatchedArmijo.step = local_step
        step_module._StepEvaluator.trial = trial
        step_module._StepEvaluator.gradient = gradient
        rules._BatchedArmijo._points = staticmethod(points)
        rules._BatchedArmijo._search_windows = search_windows

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
    K = vs.LOCAL_STEPS
    if n % K == 0:  # every round ran K steps: the steps at local step k of their round are steps[k::K]
        print("  by local step of the round (k = 0 .. K-1):")
        for label, key, digits in (("calls", "calls", 1), ("rows", "rows", 0), ("sequential trials", "trials", 0)):
            values = " ".join(f"{sum(s[key] for s in steps[k::K]) / (n // K):.{digits}f}" for k in range(K))
            print(f"    {label:<18} {values}")
    rest = [s["step_s"] - s["gradient_s"] - s["trial_s"] - s["points_s"] for s in steps]
    print(
        f"  ms: gradient evaluation {mean('gradient_s') * 1e3:.2f}, trial calls {mean('trial_s') * 1e3:.2f}, "
        f"trial points {mean('points_s') * 1e3:.2f}, "
        f"rest of the step {sum(rest) / n * 1e3:.2f} (medians {statistics.median(s['step_s'] for s in steps) * 1e3:.2f}"
        f" per step)"
    )
    cells, real = sum(s["cells"] for s in steps), sum(s["real_cells"] for s in steps)
    print(f"  real cells of the padded batches      {real / cells:8.1%}   ({real / n:.0f} of {cells / n:.0f})")
    if args.baseline:
        line = statistics.median(s["gradient_s"] for s in steps) * 1e3  # one gradient evaluation per step
        fedavg = statistics.median(fedavg_gradient_s) * 1e3
        print(f"  gradient evaluation, median ms: {args.algorithm} {line:.2f}, FedAvg {fedavg:.2f} (side by side)")
    if repeated:
        print("  one step's gradient evaluation repeated, median ms:")
        for form, ms in repeated.items():
            print(f"    {form:55s} {ms:6.2f}")
    rows = np.array([r for r, _ in calls], dtype=float)
    secs = np.array([t for _, t in calls])
    fixed, per_row = np.linalg.lstsq(np.stack([np.ones_like(rows), rows], 1), secs, rcond=None)[0]
    print(
        f"  a trial call: {fixed * 1e3:.2f} ms + {per_row * 1e6:.1f} us per row (least squares over {len(calls)} calls)"
    )
    if args.windows:
        replay_windows(searches, vs.LOCAL_STEPS, fixed, per_row)


def repeat_gradient(gradient, ev, W, alive, repeats: int = 300) -> dict[str, float]:
    """Median ms of a gradient evaluation (``gradient``: the evaluator's method) at ``W`` in the line search's form
    and in FedAvg's, the forms taking turns repetition by repetition, ``repeats`` times each in a row and as many
    with 8 MiB written before each (see the module docstring); no effects are kept (running statistics, metrics,
    logged values), and the evaluator's settings and the random state are put back: the run goes on as without."""
    other = torch.zeros(2 << 20)  # 8 MiB of float32
    forms = {
        "line search (generator state, A kept, flat gradient)": (True, True),
        "FedAvg (per-parameter)": (False, False),
    }
    out = {}
    devices = [W.device.index or 0] if W.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _restored(ev):
        ev.keep_effects, ev.log_sink, ev.metric_sink = False, None, None
        for flush in (False, True):
            times = {form: [] for form in forms}
            for i in range(repeats + 10):
                for form, (replay, flat) in forms.items():
                    ev.replay = replay
                    if flush:
                        other.add_(1.0)
                    start = vs._clock()
                    gradient(ev, W, alive, flat=flat)
                    if i >= 10:  # 10 warm-up repetitions
                        times[form].append(vs._clock() - start)
            for form, t in times.items():
                out[f"{form}, {'8 MiB written before each' if flush else 'in a row'}"] = statistics.median(t) * 1e3
    return out


@contextlib.contextmanager
def _restored(ev):
    """Put back the evaluator's settings that :func:`repeat_gradient` changes."""
    kept = ev.replay, ev.keep_effects, ev.log_sink, ev.metric_sink
    try:
        yield
    finally:
        ev.replay, ev.keep_effects, ev.log_sink, ev.metric_sink = kept


def replay_policy(searches, steps_per_round: int, last: int, extra: int, second: int) -> tuple[float, float]:
    """Trial calls and rows per step if the first window ended at the largest point accepted at the client's last
    ``last`` steps of the round plus ``extra`` (one point at the round's first step, the whole grid after an exhausted
    search), the second had ``second`` points and later ones doubled."""
    calls = rows = 0
    history: list[list[int]] = []
    for k, (searching, first_m, grid) in enumerate(searches):
        C = len(first_m)
        if k % steps_per_round == 0:
            history = [[] for _ in range(C)]
        width = []
        for c in range(C):
            recent = history[c][-last:]
            if recent and recent[-1] >= grid:
                width.append(grid)
            else:
                accepted = [m for m in recent if m < grid]
                width.append(min(grid, max(accepted) + 1 + extra) if accepted else 1)
        todo, nxt, extended = list(searching), [0] * C, [False] * C
        while any(todo):
            w = [min(width[c], grid - nxt[c]) if todo[c] else 0 for c in range(C)]
            calls, rows = calls + 1, rows + sum(w)
            for c in range(C):
                if not w[c]:
                    continue
                if first_m[c] < nxt[c] + w[c]:
                    todo[c] = False
                    continue
                nxt[c] += w[c]
                todo[c] = nxt[c] < grid
                width[c] = 2 * w[c] if extended[c] else second
                extended[c] = True
        for c in range(C):
            if searching[c]:
                history[c].append(first_m[c])
    return calls / len(searches), rows / len(searches)


def replay_windows(searches, steps_per_round: int, fixed: float, per_row: float) -> None:
    print(
        f"window policies replayed on the run's searches (cost: calls x {fixed * 1e3:.2f} ms + rows x "
        f"{per_row * 1e6:.1f} us, per step):"
    )
    print("  last n  +k  second   calls    rows   cost ms")
    used = (2, 0, rules._SECOND_WINDOW)
    for last in (1, 2, 3, 5):
        for extra in (0, 1):
            for second in (4, 8):
                c, r = replay_policy(searches, steps_per_round, last, extra, second)
                mark = "  <- _BatchedArmijo" if (last, extra, second) == used else ""
                print(
                    f"  {last:6d} {extra:3d} {second:7d} {c:7.2f} {r:7.1f} {(c * fixed + r * per_row) * 1e3:9.2f}{mark}"
                )


if __name__ == "__main__":
    main()
