"""A line-search trial call's arithmetic on the digits workload, padded rows against rows cut into chunks of samples
(a layout the engine does not use; timed in isolation, outside vmap):

    python benchmarks/trial_chunks.py [--threads 1] [--points 3] [--steps 5] [--repeats 7]

A trial call of the batched Armijo search (``fedlightning.vectorized.rules._BatchedArmijo``) on the MLP 64-128-10
evaluates ``P`` (client, step size) pairs. Its first layer's rows come from the step's two products
(``A - eta B``, ``vectorized/trials.py``), then the ReLU, the classifier head at the pair's trial point (the
transposed product of ``_linear_rows``), the per-sample cross-entropy and the masked sum over each row's real
samples. Every row is padded to the step's largest batch; on the digits split (100 clients, Dirichlet 0.3, batches
of at most 50) a step's real samples fill about 42 % of the padded cells.

``two calls``: the clients split by batch size into two calls, each padded to its own largest batch (the split with
the fewest padded cells), the arithmetic of both calls summed; the engine's fixed cost of a trial call (docs/
benchmarks.md §9) comes on top of the second. ``chunks of k``: every pair's real samples cut into rows of ``k``
samples (the last one padded), each row carrying its pair's step size and head point, and the rows' sums added per
pair. It computes fewer padded cells and more rows
(more head points to write, more products in the batch). Per sampled step of 20 clients (``--points`` trial points
each), the script prints the padded and the chunked times (best of ``--repeats`` timeit runs), their ratio and the
largest difference of the pairs' losses (float32 sums in another order).
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vectorized_speedup as vs  # noqa: E402
from fedlightning.vectorized.torch_internals import _linear_rows  # noqa: E402

HIDDEN, CLASSES = 128, 10


def best(fn, repeats: int) -> float:
    """Seconds per call: the best of ``repeats`` timeit runs."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeats, number=number)) / number


class Step:
    """One local step's trial call: ``C`` clients of batch sizes ``sizes``, ``points`` pairs per client."""

    def __init__(self, sizes: list[int], points: int, generator: torch.Generator):
        self.sizes, C = sizes, len(sizes)
        self.width = max(sizes)
        self.widths = [points] * C
        self.P = points * C
        self.A = torch.randn(C, self.width, HIDDEN, generator=generator)
        self.B = torch.randn(C, self.width, HIDDEN, generator=generator) * 0.1
        self.W2 = torch.randn(C, CLASSES, HIDDEN, generator=generator) * 0.1
        self.G2 = torch.randn(C, CLASSES, HIDDEN, generator=generator) * 0.01
        self.b2, self.g2 = torch.randn(C, CLASSES, generator=generator), torch.randn(C, CLASSES, generator=generator)
        self.y = torch.randint(0, CLASSES, (C, self.width), generator=generator)
        self.clients = torch.repeat_interleave(torch.arange(C), torch.tensor(self.widths))
        self.neg = -torch.rand(self.P, generator=generator)
        counts = torch.tensor(sizes)[self.clients]
        self.mask = (torch.arange(self.width)[None, :] < counts[:, None]).float()

    def head_points(self, rows: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        W = torch.addcmul(self.W2.index_select(0, rows), self.G2.index_select(0, rows), neg.view(-1, 1, 1))
        b = torch.addcmul(self.b2.index_select(0, rows), self.g2.index_select(0, rows), neg.view(-1, 1))
        return W, b

    def padded(self) -> torch.Tensor:
        """Pair losses (sums over real samples) with every row padded to the step's largest batch."""
        h = torch.empty(self.P, self.width, HIDDEN)
        for c, n, out in zip(range(len(self.sizes)), self.neg.split(self.widths), h.split(self.widths)):
            torch.addcmul(self.A[c], self.B[c], n.view(-1, 1, 1), out=out)  # the engine's per-client blocks
        h = F.relu(h)
        W, b = self.head_points(self.clients, self.neg)
        logits = _linear_rows(h, W, b, narrow=True)
        y = self.y.index_select(0, self.clients)
        cells = F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1), reduction="none").view(self.P, -1)
        return (cells * self.mask).sum(1)

    def chunked(self, k: int):
        """A function computing the pair losses from rows of ``k`` samples (its index tensors built once)."""
        C, width = len(self.sizes), self.width  # a chunk's cells past the client's batch repeat its own cells
        pair, client, start = [], [], []
        for p, c in enumerate(self.clients.tolist()):
            for s in range(0, self.sizes[c], k):
                pair.append(p)
                client.append(c)
                start.append(s)
        pair_t, client_t = torch.tensor(pair), torch.tensor(client)
        cell = torch.tensor([[c * width + (s + j) % width for j in range(k)] for c, s in zip(client, start)])
        mask = torch.tensor(start)[:, None] + torch.arange(k)[None, :] < torch.tensor(self.sizes)[client_t][:, None]
        mask = mask.float()
        A, B, y = self.A.reshape(C * width, HIDDEN), self.B.reshape(C * width, HIDDEN), self.y.reshape(-1)
        flat = cell.reshape(-1)

        def run() -> torch.Tensor:
            neg = self.neg.index_select(0, pair_t)
            h = A.index_select(0, flat).view(-1, k, HIDDEN)
            h = F.relu(h.addcmul_(B.index_select(0, flat).view(-1, k, HIDDEN), neg.view(-1, 1, 1)))
            W, b = self.head_points(client_t, neg)
            logits = _linear_rows(h, W, b, narrow=True)
            cells = F.cross_entropy(logits.reshape(-1, CLASSES), y.index_select(0, flat), reduction="none")
            sums = (cells.view(-1, k) * mask).sum(1)
            return torch.zeros(self.P).index_add_(0, pair_t, sums)

        return run, len(pair)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--points", type=int, default=3, help="trial points per client in the call")
    ap.add_argument("--steps", type=int, default=5, help="steps of sampled clients to time")
    ap.add_argument("--repeats", type=int, default=7, help="timeit repeats per case (the best is kept)")
    ap.add_argument("--chunks", default="8,16", help="comma-separated chunk sizes")
    args = ap.parse_args()
    if min(args.points, args.steps, args.repeats) < 1:
        raise SystemExit("--points, --steps and --repeats must be at least 1")
    chunk_sizes = [int(k) for k in args.chunks.split(",") if k]
    if not chunk_sizes or min(chunk_sizes) < 1:
        raise SystemExit(f"--chunks must name sizes of at least 1, got {args.chunks!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dm = vs.digits()
    dm.setup("fit")
    batch = vs.BATCH
    sizes_all = [min(batch, dm.client_num_samples(i)) for i in range(dm.num_clients)]
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    print(
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; {vs.CLIENTS_PER_ROUND} clients x "
        f"{args.points} points per step, the digits split's batch sizes"
    )
    print(
        f"{'step':>4} {'widest':>6} {'real cells':>10} {'padded (µs)':>12} {'two calls (µs)':>15}"
        + "".join(f" {'chunks of ' + str(k) + ' (µs)':>20} {'ratio':>6} {'max |dloss|':>11}" for k in chunk_sizes)
    )
    for s in range(args.steps):
        sizes = [sizes_all[i] for i in rng.choice(len(sizes_all), vs.CLIENTS_PER_ROUND, replace=False)]
        step = Step(sizes, args.points, generator)
        reference = step.padded()
        t_padded = best(step.padded, args.repeats)
        line = f"{s:>4} {step.width:>6} {sum(sizes) / (len(sizes) * step.width):>10.0%} {t_padded * 1e6:>12.1f}"
        order = sorted(sizes)
        cut = min(range(1, len(order)), key=lambda i: i * order[i - 1] + (len(order) - i) * order[-1])
        two = sum(best(Step(part, args.points, generator).padded, args.repeats) for part in (order[:cut], order[cut:]))
        line += f" {two * 1e6:>15.1f}"
        for k in chunk_sizes:
            run, _ = step.chunked(k)
            diff = float((run() - reference).abs().max())
            t = best(run, args.repeats)
            line += f" {t * 1e6:>20.1f} {t_padded / t:>5.2f}x {diff:>11.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
