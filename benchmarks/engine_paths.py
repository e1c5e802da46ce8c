"""The vectorised engine's CPU speed paths, each timed against the plain computation it replaces.

    python benchmarks/engine_paths.py [--threads 1] [--repeats 7] [--clients 20]

Shapes are the digits MLP 64-128-10 of ``vectorized_speedup.py`` (D = 9,610 weights) with ``--clients`` clients:

* ``_rows_finite``: the finiteness of every client's delta, ``amax``/``amin`` per row vs ``isfinite(x).all(1)``;
* ``_vmap0``: one batched call of a function of 6 batched tensors (4 parameters and 2 batch leaves, as the MLP's
  call) through functorch's primitives vs ``torch.func.vmap(randomness="different")``; the difference is vmap's
  per-call overhead, which a round pays once per batched call;
* ``_BatchedArmijo._points``: the trial points of 3 grid points per client, one ``addcmul`` per client block vs
  gathering the rows of ``W`` and ``g`` first; at D = 9,610 and at D = 100,000 (a small CNN's size), since the
  blocks trade one kernel call per client for two fewer passes over the points;
* ``losses._log_softmax_classes``: the intercepted cross-entropy's log-softmax of every client's ``[31, 10]`` logits
  under vmap, forward and backward, vs ``F.log_softmax(logits, 1)``;
* linear rows: ``_linear_rows`` as a line search's trial call runs it (without autograd) against one ``baddbmm``,
  for 4, 10, 16 and 62 outputs on ``7.5 C`` rows of ``[50, 128]``; below 16 outputs it computes the transposed
  product;
* head weight gradient: a gradient evaluation's linear layer of 4, 10 and 16 outputs on ``C`` rows of
  ``[50, 128]``, forward and backward (weights and bias), through ``baddbmm``'s own backward against
  ``_linear_rows``; below 16 outputs its weight gradient is the wide product ``g^T x`` (and that product alone
  against ``x^T g``, the one ``baddbmm``'s backward takes); after the table, whether each of the two products equals
  the weight gradient of a per-client ``F.linear`` bit for bit on this machine (float32, 20 clients' ``[50, 128]``
  rows; ``F.linear``'s backward computes ``g^T x`` for a row-major weight), and whether the layer's forward, plain
  (``b + x W^T``, a gradient evaluation's) and transposed (a trial call's), equals a per-client ``F.linear``'s;
* no bucketing: one local step (the MLP's vmapped forward and backward with a masked mean loss) of ``--clients``
  clients padded to 33 samples, vs the same clients split into two buckets of half the clients each, padded to 16
  and to 33 (what bucketing by batch size would run instead on the digits workload's sizes).

Each case is timed with ``timeit`` (best of ``--repeats`` runs of enough calls for about 0.2 s); the same numbers
are computed both ways (the tests in ``tests/test_vectorized_speed_paths.py`` check that).
"""

from __future__ import annotations

import argparse
import os
import timeit

import torch
import torch.nn.functional as F
from torch.func import vmap

from fedlightning.models import MLP
from fedlightning.vectorized import VectorizedClientTrainer
from fedlightning.vectorized.engine import _rows_finite
from fedlightning.vectorized.losses import _log_softmax_classes
from fedlightning.vectorized.rules import _BatchedArmijo
from fedlightning.vectorized.torch_internals import _linear_rows, _vmap0


def best(fn, repeats: int) -> float:
    """Seconds per call: the best of ``repeats`` timeit runs."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeats, number=number)) / number


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=7, help="timeit repeats per case (the best is kept)")
    ap.add_argument("--clients", type=int, default=20, help="clients per round")
    args = ap.parse_args()
    if args.repeats < 1 or args.clients < 1:
        raise ValueError(f"need --repeats >= 1 and --clients >= 1, got {args.repeats} and {args.clients}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    C = args.clients
    engine = VectorizedClientTrainer(MLP(input_dim=64, hidden=[128], num_classes=10))
    D = engine.weights.num_params
    rows = []

    x = torch.randn(C, D)
    rows.append(("finiteness of [C, D] deltas", lambda: torch.isfinite(x).all(dim=1), lambda: _rows_finite(x)))

    leaves = [torch.randn(C, *shape) for shape in engine.weights.shapes] + [torch.randn(C, 16, 64), torch.randn(C, 16)]

    def fn(*a):
        return (a[0].sum() + a[-1].sum(),)

    public = vmap(fn, randomness="different")
    rows.append(("one batched call of 6 tensors", lambda: public(*leaves), lambda: _vmap0(fn, leaves)))

    class Ev:  # what _points reads of the step evaluator
        pass

    ev = Ev()
    ev.engine = engine
    widths = [3] * C
    pair_client = torch.repeat_interleave(torch.arange(C), torch.tensor(widths))
    neg = -torch.rand(len(pair_client), dtype=torch.float64).float()
    for dim in (D, 100_000):
        W, g = torch.randn(C, dim), torch.randn(C, dim)
        rows.append(
            (
                f"Armijo trial points, D = {dim:,}",
                lambda W=W, g=g: _BatchedArmijo._points(ev, W, g, pair_client, neg),
                lambda W=W, g=g: _BatchedArmijo._points(ev, W, g, pair_client, neg, widths),
            )
        )

    logits = torch.randn(C, 31, 10)
    seed = torch.randn(C, 31, 10)

    def log_softmax_step(f):
        z = logits.clone().requires_grad_(True)
        return torch.autograd.grad(vmap(f)(z), z, seed)

    rows.append(
        (
            "log-softmax of [C, 31, 10], fwd+bwd",
            lambda: log_softmax_step(lambda r: F.log_softmax(r, 1)),
            lambda: log_softmax_step(_log_softmax_classes),
        )
    )

    def mlp_loss(W1, b1, W2, b2, x, y, w):
        logp = _log_softmax_classes(F.linear(F.relu(F.linear(x, W1, b1)), W2, b2))
        return -(logp.gather(1, y.unsqueeze(1)).squeeze(1) * w).sum()

    def padded_step(rows_, n):
        weights = [v[:rows_].clone() for v in engine.weights.views(torch.randn(C, D) * 0.1)]
        x, y = torch.randn(rows_, n, 64), torch.randint(0, 10, (rows_, n))
        w = torch.full((rows_, n), 1.0 / n)

        def step():
            ps = [p.detach().requires_grad_(True) for p in weights]
            return torch.autograd.grad(vmap(mlp_loss)(*ps, x, y, w).sum(), ps)

        return step

    one, low, high = padded_step(C, 33), padded_step(C // 2, 16), padded_step(C - C // 2, 33)
    rows.append(("MLP step, 2 buckets vs 1 padded", lambda: (low(), high()), one))

    # narrow linear layers: rows x [R, 50, 128] through [R, out, 128] weights, the plain batched product against
    # _linear_rows (transposed below 16 outputs); R = 7.5 C, the rows of a line search's trial call
    R = int(7.5 * C)
    h = torch.randn(R, 50, 128)
    for out in (4, 10, 16, 62):
        Wn, bn = torch.randn(R, out, 128), torch.randn(R, out)
        rows.append(
            (
                f"linear rows, {out} outputs",
                lambda Wn=Wn, bn=bn: torch.baddbmm(bn.unsqueeze(1), h, Wn.transpose(1, 2)),
                lambda Wn=Wn, bn=bn: _linear_rows(h, Wn, bn, narrow=True),
            )
        )

    # a narrow layer's weight gradient in a gradient evaluation: baddbmm's own backward, (x^T g)^T, against
    # _linear_rows (_NarrowRowsLinear: g^T x), forward and backward, on C clients' [50, 128] rows
    hx = torch.randn(C, 50, 128)
    for out in (4, 10, 16):
        Wg = torch.randn(C, out, 128, requires_grad=True)
        bg = torch.randn(C, out, requires_grad=True)
        g_out = torch.randn(C, 50, out)

        def plain_grad(Wg=Wg, bg=bg, g_out=g_out):
            return torch.autograd.grad(torch.baddbmm(bg.unsqueeze(1), hx, Wg.transpose(1, 2)), (Wg, bg), g_out)

        def engine_grad(Wg=Wg, bg=bg, g_out=g_out):
            return torch.autograd.grad(_linear_rows(hx, Wg, bg), (Wg, bg), g_out)

        rows.append((f"head weight gradient, {out} outputs", plain_grad, engine_grad))
        # the weight gradient's product alone: (x^T g)^T as baddbmm's backward takes it, against g^T x
        rows.append(
            (
                f"  its product alone, {out} outputs",
                lambda g_out=g_out: torch.bmm(hx.transpose(1, 2), g_out),
                lambda g_out=g_out: torch.bmm(g_out.transpose(1, 2), hx),
            )
        )

    print(f"C = {C}, D = {D}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':<34} {'plain (µs)':>11} {'engine (µs)':>12} {'ratio':>7}")
    for name, plain, fast in rows:
        t_plain, t_fast = best(plain, args.repeats), best(fast, args.repeats)
        print(f"{name:<34} {t_plain * 1e6:>11.1f} {t_fast * 1e6:>12.1f} {t_plain / t_fast:>6.2f}x")
    print_bit_checks(C)


def _bits(name: str, value: torch.Tensor, ref: torch.Tensor) -> str:
    """``name yes|no (max |value − ref|)``: whether ``value`` equals ``ref`` bit for bit."""
    return f"{name} {'yes' if torch.equal(value, ref) else 'no'} ({(value - ref).abs().max().item():.1e})"


def print_bit_checks(C: int) -> None:
    """For 4, 10 and 16 outputs, on ``C`` clients' ``[50, 128]`` rows (float32; the answers are this machine's
    kernels'): does the plain batched product ``b + x W^T`` (a gradient evaluation's forward) and does the transposed
    one ``(b + W x^T)^T`` (a trial call's narrow layer) equal each client's own ``F.linear`` bit for bit; and does
    ``g^T x`` (the engine's narrow-layer weight gradient) and does ``(x^T g)^T`` (``baddbmm``'s backward) equal the
    weight gradient each client's ``F.linear`` gets from autograd?"""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(C, 50, 128, generator=gen)
    forward, gradient = [], []
    for out in (4, 10, 16):
        W = torch.randn(C, out, 128, generator=gen)
        b = torch.randn(C, out, generator=gen)
        g = torch.randn(C, 50, out, generator=gen)
        ref = torch.stack([F.linear(x[c], W[c], b[c]) for c in range(C)])
        plain = torch.baddbmm(b.unsqueeze(1), x, W.transpose(1, 2))
        transposed = torch.baddbmm(b.unsqueeze(2), W, x.transpose(1, 2)).transpose(1, 2)
        forward.append(f"  {out} outputs: {_bits('b + x W^T', plain, ref)}, {_bits('(b + W x^T)^T', transposed, ref)}")
        reference = []
        for c in range(C):
            Wc = W[c].clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(F.linear(x[c], Wc, b[c]), Wc, g[c])
            reference.append(grad)
        ref = torch.stack(reference)
        wide = torch.bmm(g.transpose(1, 2), x)
        narrow = torch.bmm(x.transpose(1, 2), g).transpose(1, 2)
        gradient.append(f"  {out} outputs: {_bits('g^T x', wide, ref)}, {_bits('(x^T g)^T', narrow, ref)}")
    print("linear layer's forward equal to per-client F.linear's (float32, bit for bit; max |difference|):")
    print("\n".join(forward))
    print("weight gradient equal to per-client F.linear's (float32, bit for bit; max |difference|):")
    print("\n".join(gradient))


if __name__ == "__main__":
    main()
