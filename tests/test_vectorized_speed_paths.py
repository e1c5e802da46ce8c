"""The speed paths of fedlightning.vectorized, each checked against the plain computation it replaces.

* the round's index matrices (``_round_index``): the ClientBatchSampler fast path gives exactly the batches that
  iterating the samplers gives (epochs cycled, partial last batches, clients smaller and larger than the batch);
* the weights' storage order (``_WeightsLayout.learn``): training with the learned (transposed) blocks gives the same
  losses and weights as with the parameters' own order, and the order conversions round-trip;
* SgdArmijo trial points written per client block (CPU) equal the gathered ``W[c] − η g[c]`` bit for bit;
* end-of-round helpers: ``_rows_finite`` and the batched division/masking of logged values (``_feed_router``).
"""

import contextlib
import copy

import numpy as np
import pytest
import torch

from fedlightning._hooks import _concat
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.models import MLP, LogisticRegression
from fedlightning.vectorized import VectorizedClientTrainer, trials
from fedlightning.vectorized.batches import _padded_positions, _round_index, _RoundBatches, _sampler_batches
from fedlightning.vectorized.engine import _rows_finite
from fedlightning.vectorized.layout import _Layout
from fedlightning.vectorized.rules import StepRecord, _BatchedArmijo, _BatchedSGD
from fedlightning.vectorized.step import _feed_router, _StepEvaluator
from numerics import Float64Inputs, assert_close64


class Sized(FederatedDataModule):
    """Clients of chosen sizes (one client per size), to exercise batches smaller than, equal to and larger than
    the batch size."""

    def __init__(self, sizes, batch_size):
        super().__init__(num_clients=len(sizes), batch_size=batch_size, seed=0)
        self.sizes = list(sizes)

    def load(self):
        n = sum(self.sizes)
        g = torch.Generator().manual_seed(0)
        data = ArrayDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
        return data, data, data.y.numpy()

    def natural_clients(self):
        ends = np.cumsum(self.sizes)
        return [np.arange(e - s, e) for e, s in zip(ends, self.sizes)]


def _expected(dm, client_ids, round, steps):
    """Step by step: the padded index matrix built from iterating each client's sampler (the reference)."""
    samplers = [dm.client_dataloader(c, round, seed=0).batch_sampler for c in client_ids]
    per_client = [_sampler_batches(s, steps) for s in samplers]
    out = []
    for k in range(steps):
        chunks = [b[k] for b in per_client]
        sizes = [len(c) for c in chunks]
        out.append((np.concatenate(chunks)[_padded_positions(sizes)], sizes))
    return out


@pytest.mark.parametrize("steps", [1, 3, 7, 20])
@pytest.mark.parametrize("batch_size", [4, 5, 16])
def test_round_index_equals_iterating_the_samplers(steps, batch_size):
    dm = Sized([1, 3, 4, 5, 9, 16, 23], batch_size)
    dm.setup("fit")
    clients = [6, 0, 3, 1, 5, 2, 4]
    for round in range(3):
        samplers = [dm.client_dataloader(c, round, seed=0).batch_sampler for c in clients]
        index, sizes, widths = _round_index(samplers, steps)
        expected = _expected(dm, clients, round, steps)
        offset = 0
        for k, (matrix, ref_sizes) in enumerate(expected):
            assert sizes[k].tolist() == ref_sizes
            assert widths[k] == max(ref_sizes)
            got = index[offset : offset + matrix.size].reshape(matrix.shape)
            np.testing.assert_array_equal(got, matrix)
            offset += matrix.size
        assert offset == index.size


def test_round_batches_generic_samplers_take_the_iterating_path():
    """Samplers that are not the data module's ClientBatchSampler are iterated; the same layout results."""
    dm = Sized([3, 5, 9], 4)
    dm.setup("fit")
    samplers = [dm.client_dataloader(c, 0, seed=0).batch_sampler for c in range(3)]
    listed = [list(_sampler_batches(s, 6)) for s in samplers]

    class Replay:  # a plain batch sampler replaying fixed epochs
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            return iter(self.batches)

    index, sizes, widths = _round_index([Replay(b) for b in listed], 6)
    offset = 0
    for k in range(6):
        chunks = [b[k] for b in listed]
        matrix = np.concatenate(chunks)[_padded_positions([len(c) for c in chunks])]
        np.testing.assert_array_equal(index[offset : offset + matrix.size].reshape(matrix.shape), matrix)
        offset += matrix.size


class _Digits64(Float64Inputs, DigitsDataModule):
    """The digits with float64 inputs."""


def _digits():
    dm = _Digits64(num_clients=40, batch_size=16, partition=Dirichlet(0.3), seed=0)
    dm.setup("fit")
    dm.configure_rounds(6, 5, seed=3)
    return dm


def _train(engine, batches, W, steps, lr=0.3):
    rule = _BatchedSGD(lr, 0.0, None, W.shape[0], W.device)
    record = StepRecord(W.shape[0], W.device)
    alive = torch.ones(W.shape[0], dtype=torch.bool)
    for k in range(steps):
        ev = _StepEvaluator(engine, _Layout(*batches.step(k)), k, None, [], None, trials=False)
        rule.step(W, ev, record, alive)
    return torch.stack(record.losses)


@pytest.mark.numerics
def test_learned_storage_order_gives_the_same_training():
    """In float64: another storage order of the weights sums in another order."""
    torch.manual_seed(1)
    model = MLP(input_dim=64, hidden=[16], num_classes=10).double()
    dm = _digits()
    clients = dm.sample_clients(0)
    batches = _RoundBatches(dm, clients, 0, 3, 5, lambda b: b)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    C = len(clients)

    plain = VectorizedClientTrainer(copy.deepcopy(model))
    W_plain = start.repeat(C, 1)
    losses_plain = _train(plain, batches, W_plain, 5)

    learned = VectorizedClientTrainer(copy.deepcopy(model))
    learned._probe_layout(start, _Layout(*batches.step(0)), [])
    # linear layers with per-client weights give their weight gradients transposed: those blocks are stored so;
    # the 10-output head's comes from _NarrowRowsLinear in row-major order
    assert learned.weights.orders[0] == (1, 0) and learned.weights.orders[1] is None
    assert learned.weights.orders[2] is None
    stored = learned.weights.stored(start)
    assert not torch.equal(stored, start)
    torch.testing.assert_close(learned.weights.logical(stored.unsqueeze(0))[0], start, atol=0, rtol=0)
    W = stored.unsqueeze(0).repeat(C, 1)
    for view, p in zip(learned.weights.views(W), model.parameters()):
        torch.testing.assert_close(view[0], p.detach(), atol=0, rtol=0)
    losses = _train(learned, batches, W, 5)
    assert_close64(losses, losses_plain)
    assert_close64(learned.weights.logical(W), W_plain)
    # flat gradients come out in the storage order (rows of W − ηg are trial points)
    ev = _StepEvaluator(learned, _Layout(*batches.step(0)), 0, None, [], None, trials=False)
    _, g = ev.gradient(W, torch.ones(C, dtype=torch.bool))
    _, parts = ev.gradient(W, torch.ones(C, dtype=torch.bool), flat=False)
    for view, part in zip(learned.weights.views(g), parts):
        torch.testing.assert_close(view, part, atol=0, rtol=0)


def test_vectors_without_permuted_gradients_keep_their_order():
    torch.manual_seed(2)
    model = LogisticRegression(input_dim=64, num_classes=10)
    engine = VectorizedClientTrainer(model)
    grads = [torch.randn(3, *p.shape) for p in model.parameters()]  # row-major gradients: nothing to learn
    engine.weights.learn(grads)
    assert engine.weights.orders == [None, None]
    W = torch.randn(3, engine.weights.num_params)
    assert engine.weights.logical(W) is W


def test_rows_finite():
    x = torch.randn(6, 50)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[4, 49] = -float("inf")
    assert _rows_finite(x).tolist() == torch.isfinite(x).all(dim=1).tolist() == [True, False, False, True, False, True]


def test_feed_router_divides_and_masks_in_evaluation_order():
    """Each value is tagged with its client (the engine's rows are clients 11, 12, 13), so that keep_clients drops
    a client the round leaves out."""
    from fedlightning._hooks import _LogRouter

    router = _LogRouter(loop=None, mode="capture")
    v1, v2, v3 = torch.tensor([2.0, 4.0, 6.0]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([9.0, 8.0, 7.0])
    counts = torch.tensor([2, 4, 3])
    alive = torch.tensor([True, False, True])
    _feed_router(
        router,
        [([("a", v1)], counts, None), ([("a", v2), ("b", v2)], None, alive), ([("a", v3)], counts, alive)],
        [11, 12, 13],
    )
    assert _concat(router.captured["a"]).tolist() == [1.0, 1.0, 2.0, 1.0, 3.0, 4.5, float(torch.tensor(7.0) / 3)]
    assert _concat(router.captured["b"]).tolist() == [1.0, 3.0]
    assert _concat(router.owners["a"]).tolist() == [11, 12, 13, 11, 13, 11, 13]
    router.keep_clients({11, 12})
    assert _concat(router.captured["a"]).tolist() == [1.0, 1.0, 1.0, 4.5]
    assert _concat(router.captured["b"]).tolist() == [1.0]


def test_log_router_means_mix_scalars_and_runs_in_order():
    """pop_means over values captured one by one (sequential clients) and as 1-d runs (the vectorised engine): the
    mean of all of them in logging order, the same bits as the mean of the stacked scalars."""
    from fedlightning._hooks import _LogRouter

    values = torch.randn(50, generator=torch.Generator().manual_seed(0))
    router = _LogRouter(loop=None, mode="capture")
    router.captured = {"a": [values[0], values[1:30], values[30], values[31:]], "b": list(values.unbind(0))}
    means = router.pop_means()
    assert means["client/a"] == means["client/b"] == float(torch.stack(list(values.unbind(0))).double().mean())
    assert router.captured == {}


@pytest.mark.parametrize("gather_bytes", [0, 1 << 30], ids=["client-blocks", "gathered-ranges"])
@pytest.mark.parametrize("columns", [None, [(0, 100), (300, 650)]], ids=["all-columns", "two-ranges"])
def test_trial_points_per_client_blocks_equal_the_gathered_points(monkeypatch, gather_bytes, columns):
    """CPU trial points, written client block by client block or (column ranges up to trials._GATHER_BYTES)
    gathered, equal the accelerators' gathered points and the formula, bit for bit, in the columns asked for."""
    monkeypatch.setattr(trials, "_GATHER_BYTES", gather_bytes)
    torch.manual_seed(3)
    engine = VectorizedClientTrainer(LogisticRegression(input_dim=64, num_classes=10))

    class Ev:
        pass

    ev = Ev()
    ev.engine = engine
    C, D = 5, engine.weights.num_params
    W, g = torch.randn(C, D), torch.randn(C, D)
    widths = [3, 0, 1, 4, 2]
    pair_client = torch.repeat_interleave(torch.arange(C), torch.tensor(widths))
    eta = torch.rand(len(pair_client), dtype=torch.float64) * 4
    neg = (-eta).float()
    blocks = _BatchedArmijo._points(ev, W, g, pair_client, neg, widths, columns).clone()
    gathered = _BatchedArmijo._points(ev, W, g, pair_client, neg, None, columns).clone()
    reference = torch.addcmul(W[pair_client], g[pair_client], (-eta).float().unsqueeze(1))
    for a, b in [(0, D)] if columns is None else columns:
        assert torch.equal(blocks[:, a:b], gathered[:, a:b]) and torch.equal(blocks[:, a:b], reference[:, a:b])


# ---------------------------------------------------------------------------------------------- _vmap0
def test_vmap0_equals_torch_func_vmap():
    """The engine's direct drive of functorch's primitives gives what torch.func.vmap(randomness="different")
    gives: batched and unbatched outputs, nesting, random ops (same generator state, same draws), gradients."""
    from torch.func import vmap

    from fedlightning.vectorized.torch_internals import _vmap0

    w = torch.randn(5, 4, 3, requires_grad=True)
    x = torch.randn(5, 7, 3)

    def f(wi, xi):
        h = torch.nn.functional.dropout(xi @ wi.t(), 0.5)
        inner = vmap(lambda row: (row.sum() * 2,), randomness="different")(h)[0]  # nested inside
        inner0 = _vmap0(lambda row: (row.sum() * 2,), [h])[0]
        return h.sum(), inner, inner0, torch.tensor(3.0)  # the last output does not depend on the batch

    torch.manual_seed(0)
    expected = vmap(f, randomness="different")(w, x)
    g_expected = torch.autograd.grad(expected[0].sum(), w)[0]
    torch.manual_seed(0)
    got = _vmap0(f, [w, x])
    g_got = torch.autograd.grad(got[0].sum(), w)[0]
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b)
    torch.testing.assert_close(got[1], got[2], atol=0, rtol=0)
    assert torch.equal(got[3], torch.full((5,), 3.0))
    assert torch.equal(g_got, g_expected)


def test_vmap0_leaves_no_vmap_level_behind_after_an_exception(monkeypatch):
    import fedlightning.vectorized.torch_internals as internals

    def boom(xi):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        internals._vmap0(boom, [torch.randn(3, 2)])
    assert torch._C._functorch.maybe_current_level() is None  # the level was popped
    assert torch.equal(internals._vmap0(lambda xi: (xi * 2,), [torch.ones(3, 2)])[0], torch.full((3, 2), 2.0))
    monkeypatch.setattr(internals, "_add_batch_dim", None)  # no primitives: torch.func.vmap is used instead
    calls = []
    public = internals.vmap
    monkeypatch.setattr(internals, "vmap", lambda *a, **k: calls.append(k) or public(*a, **k))
    assert torch.equal(internals._vmap0(lambda xi: (xi * 2,), [torch.ones(3, 2)])[0], torch.full((3, 2), 2.0))
    assert calls == [{"randomness": "different"}]


# ---------------------------------------------------------------------------------------------- batched linear layers
def _linear_cases():
    """(name, input, weight, bias, in_dims): weights batched over 4 clients, inputs batched or shared, with and without
    a bias, batch dimensions at the front or elsewhere, 1-d to 4-d inputs."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    W, b = r(4, 6, 5), r(4, 6)
    return [
        ("2-d input, bias", r(4, 7, 5), W, b, (0, 0, 0)),
        ("no bias", r(4, 7, 5), W, None, (0, 0, None)),
        ("1-d input", r(4, 5), W, b, (0, 0, 0)),
        ("4-d input", r(4, 2, 3, 7, 5), W, b, (0, 0, 0)),
        ("shared input", r(7, 5), W, b, (None, 0, 0)),
        ("shared bias", r(4, 7, 5), W, r(6), (0, 0, None)),
        ("batch dimension not in front", r(7, 4, 5), r(6, 4, 5), r(6, 4), (1, 1, 1)),
        # fewer than 16 outputs and at least 16 rows per client: the transposed product
        ("narrow output, transposed", r(4, 20, 5), W, b, (0, 0, 0)),
        ("narrow output, transposed, no bias, 3-d input", r(4, 2, 9, 5), W, None, (0, 0, None)),
        ("16 outputs, plain product", r(4, 20, 5), r(4, 16, 5), r(4, 16), (0, 0, 0)),
    ]


@pytest.mark.numerics
@pytest.mark.parametrize("case", _linear_cases(), ids=lambda c: c[0])
def test_batched_linear_equals_vmap_of_linear(case):
    """A linear layer with the clients' weights, as the engine computes it (one baddbmm on the tensors under vmap's
    batch dimension), gives F.linear's values and gradients under vmap, for every input, weight and bias layout."""
    from torch.func import vmap

    from fedlightning.vectorized import torch_internals as internals

    _, x, W, b, in_dims = case
    used = []

    def fast(xi, wi, bi=None):
        out = internals._batched_linear(xi, wi, bi)
        used.append(out is not None)
        return torch.nn.functional.linear(xi, wi, bi) if out is None else out

    args = [t.clone().requires_grad_(True) if t is not None else None for t in (x, W, b)]
    ref_args = [t.clone().requires_grad_(True) if t is not None else None for t in (x, W, b)]
    got = vmap(fast, in_dims=in_dims)(*args)
    expected = vmap(torch.nn.functional.linear, in_dims=in_dims)(*ref_args)
    assert all(used) and used  # the batched path ran
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    seed = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=expected.dtype)
    leaves = [t for t in args if t is not None]
    ref_leaves = [t for t in ref_args if t is not None]
    for a, e in zip(torch.autograd.grad(got, leaves, seed), torch.autograd.grad(expected, ref_leaves, seed)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.numerics
def test_narrow_linear_rows_without_autograd_are_the_transposed_product():
    """Without autograd (a line search's trial rows), a layer with fewer than 16 outputs and at least 16 rows per
    client comes out of the transposed product (a transposed view) with F.linear's values; with autograd, and for
    16 outputs, the plain product (same values)."""
    from torch.func import vmap

    from fedlightning.vectorized import torch_internals as internals

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 20, 5, generator=g, dtype=torch.float64)
    for out, transposed in ((6, True), (16, False)):
        W = torch.randn(4, out, 5, generator=g, dtype=torch.float64)
        b = torch.randn(4, out, generator=g, dtype=torch.float64)
        expected = vmap(torch.nn.functional.linear)(x, W, b)
        for grad in (False, True):
            seen = []

            def fast(xi, wi, bi, seen=seen):
                out_ = internals._batched_linear(xi, wi, bi)
                seen.append(internals._physical(out_).stride())
                return out_

            with torch.set_grad_enabled(grad):
                got = vmap(fast)(x, W, b)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
            # a transposed result has its rows' outputs strided by the number of rows
            assert (seen[0][-1] != 1) == (transposed and not grad)


@pytest.mark.numerics
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_narrow_layer_weight_gradient_is_the_wide_product(bias, input_grad):
    """A CPU layer with fewer than 16 outputs and at least 16 inputs whose weights need a gradient goes through
    _NarrowRowsLinear inside the engine's vmap: the forward values are the plain baddbmm's bit for bit, and the
    gradients of the input, weights and bias equal vmapped F.linear's (float64); a wider layer keeps baddbmm's own
    backward."""
    from torch.func import vmap

    from fedlightning.vectorized import torch_internals as internals

    g = torch.Generator().manual_seed(3)
    for out, narrow in ((10, True), (16, False)):
        x = torch.randn(4, 20, 24, generator=g, dtype=torch.float64, requires_grad=input_grad)
        W = torch.randn(4, out, 24, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(4, out, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
        nodes = []

        def fast(xi, wi, bi=None, nodes=nodes):
            y = internals._batched_linear(xi, wi, bi)
            node = internals._physical(y).grad_fn
            while type(node).__name__.startswith(("View", "Reshape", "UnsafeView")):  # the output's reshape
                node = node.next_functions[0][0]
            nodes.append(type(node).__name__)
            return y

        inputs = (x, W, b) if bias else (x, W)
        got = vmap(fast)(*inputs)
        plain = torch.baddbmm(b.unsqueeze(1), x, W.transpose(1, 2)) if bias else torch.bmm(x, W.transpose(1, 2))
        assert torch.equal(got, plain)  # the same forward call
        assert ("_NarrowRowsLinearBackward" in nodes[0]) == narrow, nodes
        leaves = [t for t in inputs if t.requires_grad]
        seed = torch.randn(got.shape, generator=g, dtype=got.dtype)
        expected = vmap(torch.nn.functional.linear)(*inputs)
        for a, e in zip(torch.autograd.grad(got, leaves, seed), torch.autograd.grad(expected, leaves, seed)):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_narrow_weight_gradient_outside_vmap_and_under_another_transform():
    """_linear_rows on plain tensors outside any vmap takes the same function (no functorch layer to set aside);
    under a transform around the engine's vmap level it takes the plain product."""
    from torch.func import vmap

    from fedlightning.vectorized import torch_internals as internals

    x = torch.randn(3, 20, 32, dtype=torch.float64)
    W = torch.randn(3, 4, 32, dtype=torch.float64, requires_grad=True)
    y = internals._narrow_weight_gradient(x, W, None)
    assert type(y.grad_fn).__name__ == "_NarrowRowsLinearBackward"
    (gW,) = torch.autograd.grad(y.sum(), W)
    torch.testing.assert_close(gW, torch.ones(3, 20, 4, dtype=torch.float64).transpose(1, 2) @ x)
    seen = []

    def inner(xi):
        seen.append(internals._narrow_weight_gradient(x, W, None))
        return xi

    vmap(lambda v: vmap(inner)(v))(torch.zeros(2, 3))
    assert seen == [None]


@pytest.mark.parametrize("line_search", [False, True])
def test_every_gradient_evaluation_takes_the_wide_weight_gradient(monkeypatch, line_search):
    """In a vectorized round, a narrow head's weight gradient comes from _NarrowRowsLinear at every gradient
    evaluation, SGD's and SgdArmijo's alike, and not at a line search's trial calls (no autograd there); float64
    equality with sequential training, line searches included, is tests/test_vectorized.py's (digits MLP, 10-output
    head)."""
    from fedlightning.optim import SgdArmijo
    from fedlightning.vectorized import step as step_module
    from fedlightning.vectorized import torch_internals as internals

    applied, gradients = [], []
    real = internals._NarrowRowsLinear.apply
    monkeypatch.setattr(internals._NarrowRowsLinear, "apply", lambda *a: applied.append(1) or real(*a))
    real_gradient = step_module._StepEvaluator.gradient
    monkeypatch.setattr(
        step_module._StepEvaluator, "gradient", lambda *a, **k: gradients.append(1) or real_gradient(*a, **k)
    )
    dm = Sized([20, 24, 30, 36], batch_size=16)
    dm.setup("fit")
    model = MLP(input_dim=8, hidden=[32], num_classes=3)  # head: 3 outputs from 32 inputs
    trainer = VectorizedClientTrainer(model)
    params = [p.detach().clone() for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    if line_search:
        optimizers = [SgdArmijo(model.parameters(), eta_max=1.0, n_batches_per_epoch=2) for _ in range(4)]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(4)]
    trainer.run([0, 1, 2, 3], 0, 0, params, [], flat, dm, optimizers, 2)
    assert len(applied) == len(gradients) == 3  # the layout probe and two local steps, one head each


def test_batched_linear_declines_what_it_does_not_cover():
    """Outside vmap, weights not batched (a frozen layer), nested vmap levels and mixed dtypes: None, and the caller
    runs F.linear. Under CPU autocast it casts as F.linear does: each row's output is bfloat16, equal to a per-row
    F.linear under autocast (torch's own vmap rule returns float32 there)."""
    from torch.func import vmap

    from fedlightning.vectorized.torch_internals import _batched_linear, _linear

    x, W, b = torch.randn(4, 3, 5), torch.randn(4, 6, 5), torch.randn(4, 6)
    assert _batched_linear(x[0], W[0], b[0]) is None  # no vmap
    seen = []

    def record(*args):
        out = _batched_linear(*args)
        seen.append(out is None)
        return _linear(*args)

    vmap(record, in_dims=(0, None, None))(x, W[0], b[0])  # weights shared by the rows
    vmap(lambda xi, wi: vmap(lambda s: record(s, wi))(xi), in_dims=(0, 0))(x, W)  # weight one level out
    vmap(lambda *a: seen.append(_batched_linear(*a) is None) or a[0])(x.double(), W, b)  # mixed dtypes
    assert seen == [True, True, True]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = vmap(record)(x, W, b)
        rows = torch.stack([torch.nn.functional.linear(x[i], W[i], b[i]) for i in range(4)])
    assert seen[-1] is False and out.dtype == rows.dtype == torch.bfloat16
    reference = torch.stack([x[i] @ W[i].T + b[i] for i in range(4)]).double()  # float64 products
    # both are the bfloat16 products of bfloat16-rounded inputs: within a few bfloat16 roundings of float64
    torch.testing.assert_close(out.double(), reference, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(rows.double(), reference, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(vmap(_linear)(x, W, b), vmap(torch.nn.functional.linear)(x, W, b))


def test_engine_runs_linear_layers_batched_and_restores_them(monkeypatch):
    """In a vectorized round, nn.Linear layers (the bundled MLP's, a user's) compute through _batched_linear, and
    afterwards run their class's own forward again."""
    from fedlightning.vectorized import torch_internals as internals

    calls = []
    real = internals._batched_linear
    monkeypatch.setattr(internals, "_batched_linear", lambda *a: calls.append(1) or real(*a))
    dm = Sized([3, 5, 8, 13], batch_size=4)
    dm.setup("fit")
    model = MLP(input_dim=8, hidden=[16], num_classes=3)
    trainer = VectorizedClientTrainer(model)
    params = [p.detach().clone() for p in model.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    trainer.run([0, 1, 2, 3], 0, 0, params, [], flat, dm, [torch.optim.SGD(model.parameters(), lr=0.1)] * 4, 3)
    assert len(calls) >= 2 * 3  # two layers, three steps
    assert all("forward" not in m.__dict__ for m in model.modules())


# ------------------------------------------------------------------------------- per-sample class losses (batched)
def _gathered_nll(logits: bool):
    """The interception's vmapped formula for one row: ``-gather(log_softmax(x), y)`` (or of log-probabilities),
    with the interception's choice of log-softmax kernel."""
    from fedlightning.vectorized.losses import _log_softmax_classes

    def f(x, y):
        logp = _log_softmax_classes(x) if logits else x
        return -logp.gather(1, y.unsqueeze(1)).squeeze(1)

    return f


@pytest.mark.numerics
@pytest.mark.parametrize("classes", [10, 20, 2])
@pytest.mark.parametrize("logits", [True, False], ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("layout", ["rows in front", "shared targets", "batch dimension not in front", "float64"])
def test_batched_nll_equals_the_vmapped_formula(classes, logits, layout):
    """Per-sample cross-entropy / NLL as the engine computes it on the tensors under vmap's batch dimension
    (log_softmax + one nll_loss) gives the vmapped gather formula's values and gradients bit for bit, for both
    log-softmax kernels (3-15 classes through the transpose, others over the last dimension), shared targets and
    a batch dimension elsewhere than in front."""
    from torch.func import vmap

    from fedlightning.vectorized.torch_internals import _batched_nll

    g = torch.Generator().manual_seed(classes)
    dtype = torch.float64 if layout == "float64" else torch.float32
    x = torch.randn(4, 7, classes, generator=g, dtype=dtype) * 3
    y = torch.randint(0, classes, (4, 7), generator=g)
    in_dims = (0, 0)
    if layout == "shared targets":
        y, in_dims = y[0], (0, None)
    elif layout == "batch dimension not in front":
        x, y, in_dims = x.transpose(0, 1).contiguous(), y.t().contiguous(), (1, 1)
    if not logits:
        x = torch.log_softmax(x, -1)
    used = []

    def fast(xi, yi):
        out = _batched_nll(xi, yi, logits)
        used.append(out is not None)
        return out

    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got = vmap(fast, in_dims=in_dims)(xa, y)
    expected = vmap(_gathered_nll(logits), in_dims=in_dims)(xb, y)
    assert used == [True]
    assert torch.equal(got, expected)
    seed = torch.rand(expected.shape, generator=g, dtype=dtype)
    assert torch.equal(torch.autograd.grad(got, xa, seed)[0], torch.autograd.grad(expected, xb, seed)[0])


def test_batched_nll_declines_what_it_does_not_cover():
    """Outside vmap, inputs not batched, nested vmap levels, targets that are not int64 and inputs with more than
    two dimensions: None (the interception's vmapped formula runs)."""
    from torch.func import vmap

    from fedlightning.vectorized.torch_internals import _batched_nll

    x, y = torch.randn(4, 5, 3), torch.randint(0, 3, (4, 5))
    assert _batched_nll(x[0], y[0], True) is None  # no vmap
    seen = []

    def record(xi, yi):
        seen.append(_batched_nll(xi, yi, True) is None)
        return xi.sum()

    vmap(record, in_dims=(None, 0))(x[0], y)  # logits shared by the rows
    vmap(lambda xi, yi: vmap(record)(xi, yi))(x.unsqueeze(1).expand(4, 2, 5, 3), y.unsqueeze(1).expand(4, 2, 5))
    vmap(record)(x, y.int())  # int32 targets
    vmap(record)(x.unsqueeze(-1), y.unsqueeze(-1))  # [n, K, 1] logits
    assert seen == [True, True, True, True]


@pytest.mark.numerics
def test_interception_takes_the_batched_nll_only_without_ignored_targets(monkeypatch):
    """F.cross_entropy intercepted on padded rows: the batched nll path for plain class targets, the general formula
    (validity mask and weight sums) when a target equals ignore_index, with class weights or label smoothing; every
    call gives the masked mean the sequential loss gives on the real samples (float64: other summation orders)."""
    from torch.func import vmap

    from fedlightning.vectorized import losses

    calls = []
    real = losses._batched_nll
    monkeypatch.setattr(losses, "_batched_nll", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, 6, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (3, 6), generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.float64)
    weight = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    ignored = y.clone()
    ignored[0, 1] = ignored[1, 0] = -100
    cases = [({}, y, True), ({"weight": weight}, y, False), ({"label_smoothing": 0.1}, y, False), ({}, ignored, False)]
    for kwargs, targets, batched in cases:
        calls.clear()

        def row(xi, yi, mi, kwargs=kwargs):
            with losses.LossInterception(6, mi, mi.sum()):
                return torch.nn.functional.cross_entropy(xi, yi, **kwargs)

        got = vmap(row)(x, targets, mask)
        for i in range(3):
            k = int(mask[i].sum())
            expected = torch.nn.functional.cross_entropy(x[i, :k], targets[i, :k], **kwargs)
            assert_close64(got[i], expected)
        assert bool(calls) == batched, kwargs


def test_check_tolerance_follows_tf32_switches():
    """The engine's interception and per-sample checks compare two computations of a loss on batches of different
    sizes: strict in float32 where both run in full float32, looser where one of them may have run TF32 kernels
    (cuDNN's default TF32 convolutions, TF32 matrix products; only the recheck compares the training step's own loss),
    float64 always strict (TF32 never applies to it), loosest for half-precision parameters."""
    from fedlightning.vectorized.call import _tf32, _tolerance

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = False, False
        torch.set_float32_matmul_precision("highest")
        assert not _tf32(cuda)
        for switch in ("conv", "matmul", "precision"):
            torch.set_float32_matmul_precision("high" if switch == "precision" else "highest")
            torch.backends.cudnn.allow_tf32 = switch == "conv"
            if switch == "matmul":  # (setting the precision sets this switch too)
                torch.backends.cuda.matmul.allow_tf32 = True
            assert _tf32(cuda) and not _tf32(cpu), switch
        assert _tolerance(torch.float32) == (1e-4, 1e-6)
        assert _tolerance(torch.float32, tf32=True) == (1e-2, 1e-3)
        assert _tolerance(torch.float64) == _tolerance(torch.float64, tf32=True) == (1e-9, 1e-12)
        assert _tolerance(torch.bfloat16) == _tolerance(torch.float16, tf32=True) == (2e-2, 2e-2)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("api", ["legacy", "fp32_precision"])
def test_the_checks_run_cuda_float32_without_tf32_and_put_the_users_settings_back(api):
    """A check's two computations run in full float32 on CUDA (its tolerance is float32's): inside
    ``_full_precision`` TF32 is off through whichever of torch's APIs the user set it with, and the user's settings
    are back afterwards, on leaving normally and on an error (the switches are global settings, readable without a
    GPU)."""
    from fedlightning.vectorized.call import _full_precision, _tf32

    cuda, backends = torch.device("cuda"), torch.backends
    conv, matmul = backends.cudnn.conv, backends.cuda.matmul
    saved = (backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    try:
        if api == "legacy":
            backends.cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("medium")
        else:
            conv.fp32_precision = matmul.fp32_precision = "tf32"
        before = (conv.fp32_precision, matmul.fp32_precision)
        ctx = _full_precision(cuda)
        for raised in (False, True):  # the same context object entered twice, as the checks do
            with contextlib.suppress(KeyError), ctx:
                assert not _tf32(cuda)
                if api == "legacy":
                    assert torch.get_float32_matmul_precision() == "highest" and not backends.cudnn.allow_tf32
                else:  # ("none": not TF32, the default)
                    assert "tf32" not in (conv.fp32_precision, backends.cudnn.rnn.fp32_precision, matmul.fp32_precision)
                if raised:
                    raise KeyError
            assert _tf32(cuda)
            assert (conv.fp32_precision, matmul.fp32_precision) == before
            if api == "legacy":
                assert torch.get_float32_matmul_precision() == "medium" and backends.cudnn.allow_tf32
    finally:
        conv.fp32_precision = matmul.fp32_precision = "none"
        backends.cudnn.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])
