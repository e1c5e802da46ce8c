"""Where one algorithm's round spends its time, phase by phase, in one mode (the digits workload of
``algorithms_vectorized.py``).

    python benchmarks/round_phases.py --algorithm DSGD --mode vectorized [--rounds 300] [--threads 1]

Wraps the round's phases (``FederatedLoop``'s template: plan, client training, closing, server step, end of round)
and, inside client training, the vectorized engine's call, its batches and its batched rule's steps, and the
admission of the updates, with a wall-clock timer each, then trains ``--rounds`` rounds of one run and prints each
phase's median and mean time per call over the rounds after the first fifth (warm-up). The phases nest: a round's
time holds its phases', client training holds the engine's and the admission's. Sequential runs have no engine
phases; their admission is one call per client.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms_vectorized as av  # noqa: E402
import fedlightning._round as round_module  # noqa: E402
import fedlightning.loop as loop_module  # noqa: E402
import fedlightning.vectorized.batches as batches_module  # noqa: E402
import fedlightning.vectorized.engine as engine_module  # noqa: E402
import vectorized_speedup as vs  # noqa: E402
from user_models import UserMLP  # noqa: E402

#: (owner, attribute, label), outermost first
PHASES = [
    (loop_module.FederatedLoop, "training_step", "round"),
    (loop_module.FederatedLoop, "_plan_round", "  plan"),
    (loop_module.FederatedLoop, "_train_clients", "  client training"),
    (engine_module.VectorizedClientTrainer, "run", "    engine call"),
    (batches_module._RoundBatches, "__init__", "      round's batches"),
    (round_module.RoundTally, "admit_all", "    admission (a group)"),
    (round_module.RoundTally, "admit", "    admission (a client)"),
    (loop_module.FederatedLoop, "_close_clients", "  closing"),
    (loop_module.FederatedLoop, "_step_server", "  server step"),
    (loop_module.FederatedLoop, "_end_round", "  end of round"),
]


def _timed(times: dict, owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="DSGD", help="a config of algorithms_vectorized.py")
    ap.add_argument("--mode", default="vectorized", choices=("vectorized", "sequential"))
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = defaultdict(list)
    for owner, name, label in PHASES:
        _timed(times, owner, name, label)
    # the rule's step: wrapped on the class the engine builds for the algorithm's optimizer, at its first call
    import fedlightning.vectorized.rules as rules_module

    make = rules_module.make_batched_rule

    def make_timed(*a, **k):
        rule = make(*a, **k)
        cls = type(rule)
        if not getattr(cls, "_timed_step", False):
            _timed(times, cls, "step", "      rule steps")
            cls._timed_step = True
        return rule

    engine_module.make_batched_rule = make_timed
    datamodule = vs.digits()
    datamodule.setup("fit")
    torch.manual_seed(0)
    init = UserMLP().state_dict()
    parts = av.algorithm_parts(*av.ALGORITHMS[args.algorithm])
    av.run(parts, datamodule, args.mode, args.rounds, init)
    rounds = len(times["round"])
    print(f"{args.algorithm}, {args.mode}, {rounds} rounds, {torch.get_num_threads()} thread(s); ms per call")
    print(f"{'phase':28s} {'calls/round':>11s} {'median':>8s} {'mean':>8s}")
    for _, _, label in PHASES + [(None, None, "      rule steps")]:
        values = times.get(label)
        if not values:
            continue
        kept = values[len(values) // 5 :]
        print(
            f"{label:28s} {len(values) / rounds:11.1f} {statistics.median(kept) * 1e3:8.3f} "
            f"{statistics.mean(kept) * 1e3:8.3f}"
        )


if __name__ == "__main__":
    main()
