"""Where the float32 weight differences of ``algorithms_vectorized.py`` come from (docs/benchmarks.md §9): the modes'
arithmetic, or training that amplifies rounding. Same workload, same configs:

    python benchmarks/float_sensitivity.py [--rounds 10] [--algorithms FedAvg,FedDANE,...]

Printed per algorithm, each as the largest difference of the global weights:

* ``float32 vec vs seq by round``: vectorized against sequential clients in float32 after each round (the last is
  ``max |dw|`` of ``algorithms_vectorized.py``). A jump from about 1e-7 to far above it in one round is a discrete
  event that rounding switched: an Armijo test that holds with near equality, a clipped step, a ReLU input that
  crosses 0 (the gradient through it jumps by that sample's share);
* ``float64 vec vs seq``: the same two runs in float64 (parameters and inputs). About 1e-16 here means the modes
  compute the same thing and only rounding, amplified, separates them in float32;
* ``float64 seq, 1 ulp``: sequential float64 runs from the initial weights and from the same weights each
  multiplied by ``1 ± 2^-52`` (signs at random): what the training alone does with a change of one rounding. Where
  ``float64 vec vs seq`` is of this size, the modes differ by their rounding, amplified alike by the training;
* ``float64 init +1e-7``: float64 vectorized runs from the initial weights and from the same weights plus
  ``1e-7 · N(0, 1)`` each, a change of float32's size (``gain``: that difference over the initial one).

``--activation gelu`` puts a GELU, smooth, in place of the MLP's ReLU, whose kink at 0 makes the gradient jump when
rounding moves an input across it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms_vectorized as av  # noqa: E402
import vectorized_speedup as vs  # noqa: E402
from user_models import UserMLP  # noqa: E402

PERTURBATION = 1e-7


class GeluMLP(UserMLP):
    """:class:`user_models.UserMLP` with a GELU in place of its ReLU (``--activation gelu``)."""

    def __init__(self, lr: float = 0.1):
        super().__init__(lr)
        self.net[1] = nn.GELU()


def float64(base: type[UserMLP]) -> type[UserMLP]:
    """``base`` in float64: its parameters, and its input cast in ``forward``."""

    class Float64(base):
        def __init__(self, lr: float = 0.1):
            super().__init__(lr)
            self.double()

        def forward(self, x):
            return self.net(x.double())

    return Float64


class Trajectory(vs.RoundTimer):
    """The round timer of ``algorithms_vectorized.run`` that also keeps the global weights after every round."""

    def __init__(self):
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.weights.append(torch.cat([p.detach().reshape(-1) for p in pl_module.model.parameters()]).clone())


def trajectory(parts, mode: str, rounds: int, state: dict, model_fn) -> list[torch.Tensor]:
    """The global weights after each of ``rounds`` rounds of one run."""
    dm = vs.digits()
    dm.setup("fit")
    timer = Trajectory()
    av.run(parts, dm, mode, rounds, state, timer=timer, model_fn=model_fn)
    return timer.weights


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds per run")
    ap.add_argument("--algorithms", default=",".join(av.ALGORITHMS), help="comma-separated subset")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the initial weights and of the perturbation")
    ap.add_argument("--activation", choices=("relu", "gelu"), default="relu", help="the MLP's hidden activation")
    args = ap.parse_args()
    names = [n for n in args.algorithms.split(",") if n]
    unknown = [n for n in names if n not in av.ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown algorithms {unknown}; choose from {list(av.ALGORITHMS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(1)
    model32 = UserMLP if args.activation == "relu" else GeluMLP
    model64 = float64(model32)
    torch.manual_seed(args.seed)
    init32 = model32().state_dict()
    init64 = {k: v.double() for k, v in init32.items()}
    moved = {k: v + PERTURBATION * torch.randn(v.shape, dtype=torch.float64) for k, v in init64.items()}
    start = max(_max_diff(init64[k], moved[k]) for k in init64)
    signs = {k: torch.randint(0, 2, v.shape, dtype=torch.float64) * 2 - 1 for k, v in init64.items()}
    ulp = {k: v * (1 + 2.0**-52 * signs[k]) for k, v in init64.items()}
    print(f"{args.rounds} rounds, {args.activation}; float64 initial weights moved by at most {start:.1e}")
    print(
        f"{'algorithm':14s} {'float64 vec vs seq':>18s} {'float64 seq, 1 ulp':>18s} "
        f"{'float64 init +1e-7':>18s} {'gain':>8s}   "
        "float32 vec vs seq by round"
    )
    for name in names:
        parts = av.algorithm_parts(*av.ALGORITHMS[name])
        vec32, seq32 = (trajectory(parts, mode, args.rounds, init32, model32) for mode in ("vectorized", "sequential"))
        vec64 = trajectory(parts, "vectorized", args.rounds, init64, model64)[-1]
        seq64 = trajectory(parts, "sequential", args.rounds, init64, model64)[-1]
        ulp64 = trajectory(parts, "sequential", args.rounds, ulp, model64)[-1]
        moved64 = trajectory(parts, "vectorized", args.rounds, moved, model64)[-1]
        by_round = " ".join(f"{_max_diff(a, b):.0e}" for a, b in zip(vec32, seq32))
        moved_diff = _max_diff(vec64, moved64)
        cells = (_max_diff(vec64, seq64), _max_diff(seq64, ulp64), moved_diff)
        print(
            f"{name:14s} " + " ".join(f"{c:18.1e}" for c in cells) + f" {moved_diff / start:8.1e}   {by_round}",
            flush=True,
        )


if __name__ == "__main__":
    main()
