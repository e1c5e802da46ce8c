"""Same-process A/B of two versions of the vectorised engine (the package ``fedlightning/vectorized/``).

    mkdir -p /tmp/old && git archive <commit> fedlightning/vectorized | tar -x -C /tmp/old
    python benchmarks/engine_ab.py --old /tmp/old/fedlightning/vectorized [--workload digits-mlp-sgd] [--rounds 10]
        [--repeats 4] [--threads 1] [--algorithm FedExpSLS] [--clock process]

Loads the package folder given by ``--old`` as a second package beside the installed ``fedlightning.vectorized``
(the package's modules import each other relatively, so the old version's modules come from that folder) and runs
the same vectorized workload of ``vectorized_speedup.py`` (or, with ``--algorithm``, a config of
``algorithms_vectorized.py`` on its digits workload) with each, alternating (old, new, old, new, ...), in one
process, so that both see the same machine conditions (the position in a pair still matters:
identical code read 2.5–7.7 % slower in the second position with ``--algorithm FedExpSLS --clock process``,
docs/benchmarks.md §9, so compare a change in both orders). The loop's vectorized executor (``fedlightning.execution``)
calls the ``run_vectorized_round`` and builds the ``VectorizedRun`` of that module, which are swapped for each run
(both versions must have them: versions before the executor protocol cannot be loaded). Prints the median and
minimum round time (first 2 rounds of each run dropped), the paired per-round minimum sum of each version, and the
largest difference between the two versions' global weights (0.0 for a change that keeps every value).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms_vectorized as av  # noqa: E402
import fedlightning.execution as execution  # noqa: E402
import fedlightning.vectorized as new_engine  # noqa: E402
import vectorized_speedup as vs  # noqa: E402


def _use_engine(module) -> None:
    """Make the loop's vectorized executor run ``module``'s engine (its entry and its per-run state)."""
    sys.modules["fedlightning.vectorized"] = module
    execution.run_vectorized_round = module.run_vectorized_round
    execution.VectorizedRun = module.VectorizedRun


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="folder of the other version of the fedlightning.vectorized package")
    ap.add_argument("--workload", default="digits-mlp-sgd", help="one of " + ", ".join(vs.WORKLOADS))
    ap.add_argument("--rounds", type=int, default=10, help="rounds per run (the first 2 are warm-up)")
    ap.add_argument("--repeats", type=int, default=4, help="alternating runs per version")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--algorithm", default=None, help="a config of algorithms_vectorized.py instead of --workload")
    ap.add_argument(
        "--clock", choices=("wall", "process"), default="wall", help="time rounds by wall clock or this process's CPU"
    )
    args = ap.parse_args()
    if args.algorithm is not None and args.algorithm not in av.ALGORITHMS:
        raise ValueError(f"unknown algorithm {args.algorithm!r}; choose from {list(av.ALGORITHMS)}")
    if args.workload not in vs.WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r}; choose from {list(vs.WORKLOADS)}")
    if args.rounds < 3 or args.repeats < 1:
        raise ValueError(f"need --rounds >= 3 and --repeats >= 1, got {args.rounds} and {args.repeats}")
    init = os.path.join(args.old, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"--old {args.old!r} is not a package folder (no __init__.py in it)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    name = "fedlightning.vectorized_old"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[args.old])
    old_engine = importlib.util.module_from_spec(spec)
    sys.modules[name] = old_engine  # its relative imports resolve to fedlightning.vectorized_old.<module>
    spec.loader.exec_module(old_engine)

    if args.clock == "process":
        vs._clock = time.process_time
    model_fn, optimizer, dm_fn = vs.WORKLOADS[args.workload]
    if args.algorithm is not None:
        model_fn, dm_fn = av.UserMLP, vs.digits
        parts = av.algorithm_parts(*av.ALGORITHMS[args.algorithm])
    datamodule = dm_fn()
    datamodule.setup("fit")
    torch.manual_seed(0)
    init_state = model_fn().state_dict()
    runs = {"old": [], "new": []}
    weights = {}
    try:
        for _ in range(args.repeats):
            for tag, module in (("old", old_engine), ("new", new_engine)):
                _use_engine(module)
                if args.algorithm is None:
                    times, w, _ = vs.run(model_fn, optimizer, datamodule, "vectorized", args.rounds, init_state)
                else:
                    times, w = av.run(parts, datamodule, "vectorized", args.rounds, init_state)
                runs[tag].append(times)
                weights[tag] = w
    finally:
        _use_engine(new_engine)
    print(
        f"{args.algorithm or args.workload}: {args.rounds} rounds x {args.repeats} alternating runs per version, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )
    for tag, r in runs.items():
        flat = [x for t in r for x in t]
        paired = sum(min(t[i] for t in r) for i in range(len(r[0])))
        print(
            f"  {tag}: median {statistics.median(flat) * 1e3:.2f} ms/round, min {min(flat) * 1e3:.2f}, "
            f"paired per-round minimum sum {paired * 1e3:.1f} ms"
        )
    print(f"  max |w_old - w_new| = {float((weights['old'] - weights['new']).abs().max()):.1e}")


if __name__ == "__main__":
    main()
