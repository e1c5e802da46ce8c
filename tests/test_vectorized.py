"""client_execution="vectorized": the round's clients in lockstep equal sequential training (same seeds, same batches).

Equality is checked on the global weights after several rounds and on every client's telemetry (steps, step sizes,
backtracks, forward/backward counts) and persistent optimizer state, for SGD, SgdArmijo (masked backtracking),
SPS and DecSPS, on digits with clients that hold fewer samples than the batch size and unequal sample counts.
The masked line search is also checked against an analytic quadratic, independent of the sequential code.

The two modes sum in different orders, so they agree to rounding only: the models and data here are float64 and
the runs are compared to ``numerics.RTOL64`` (tests/numerics.py says why); one float32 test checks the mode's
float32 results against a tolerance derived from a float64 reference.
"""

import copy
import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FederatedCallback
from fedlightning.datamodules import IID, ArrayDataset, DigitsDataModule, Dirichlet, FederatedDataModule
from fedlightning.models import MLP, CharGRU, CharLSTM, Classifier, LogisticRegression
from fedlightning.optim import SgdArmijo
from fedlightning.vectorized import VectorizationUnsupportedError, VectorizedClientTrainer, check_model_vectorizable
from fedlightning.vectorized.batches import _padded_positions
from fedlightning.vectorized.layout import _Layout
from fedlightning.vectorized.step import _StepEvaluator
from fedlightning.vectorized.torch_internals import _rnn_forward
from numerics import RTOL64, Float64Inputs, assert_close64, assert_rounding_close, flat, rtol32, to_float64
from registry import CLIENT_OPTIMIZERS, params

ROUNDS, CPR, K, BATCH = 3, 6, 5, 16


class Recorder(pl.Callback):
    """Keeps every ClientUpdate the loop hands to on_client_end."""

    def __init__(self):
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)


class Digits64(Float64Inputs, DigitsDataModule):
    """The digits with float64 inputs."""


def digits(partition=None, batch_size=BATCH, num_clients=40, float64=True):
    cls = Digits64 if float64 else DigitsDataModule
    return cls(
        num_clients=num_clients,
        batch_size=batch_size,
        partition=partition if partition is not None else Dirichlet(0.3),
        seed=0,
    )


def fit(model, optimizer, mode, dm_fn=None, rounds=ROUNDS, callbacks=(), float64=True, **loop_kwargs):
    """Train a copy of ``model`` (in float64 unless ``float64=False``) for ``rounds`` rounds on ``dm_fn()`` (default:
    the digits, float64 inputs when ``float64``): ``(weights, loop, client updates, trainer)``."""
    model = copy.deepcopy(model)
    if float64:
        model = to_float64(model)
    if dm_fn is None:
        dm_fn = lambda: digits(float64=float64)  # noqa: E731
    rec = Recorder()
    loop = FederatedLoop(
        model,
        client_optimizer=optimizer,
        local_steps=K,
        clients_per_round=CPR,
        seed=3,
        client_execution=mode,
        **loop_kwargs,
    )
    trainer = make_trainer(rounds, callbacks=[FedAvg(), rec, *[copy.deepcopy(c) for c in callbacks]])
    trainer.fit(loop, datamodule=dm_fn())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, loop, rec.updates, trainer


def assert_same_run(seq, vec, rtol=RTOL64):
    """Two float64 runs (weights, loop, client updates, trainer) agree to ``rtol`` (numerics.assert_close64):
    the global weights, every client's update, step sizes and payload, and the persistent client state; counts
    (steps, backtracks, forward/backward calls, failures, samples) exactly. The reported losses are float32 (as
    Lightning logs them): the first loss is one rounding, the mean one of K roundings (numerics.rtol32)."""
    (w_seq, loop_seq, ups_seq, _), (w_vec, loop_vec, ups_vec, _) = seq, vec
    assert_close64(w_vec, w_seq, rtol)
    assert [u.client_id for u in ups_vec] == [u.client_id for u in ups_seq]
    for a, b in zip(ups_seq, ups_vec):
        assert (a.num_steps, a.backtracks, a.forwards, a.backwards, a.failed, a.num_samples) == (
            b.num_steps,
            b.backtracks,
            b.forwards,
            b.backwards,
            b.failed,
            b.num_samples,
        ), a.client_id
        np.testing.assert_allclose(b.step_sizes, a.step_sizes, rtol=rtol, atol=rtol)
        assert b.first_loss == pytest.approx(a.first_loss, rel=rtol32(1), abs=rtol, nan_ok=True)
        assert b.mean_loss == pytest.approx(a.mean_loss, rel=rtol32(K + 1), abs=rtol, nan_ok=True)
        if a.delta is None or b.delta is None:
            assert a.delta is b.delta is None, a.client_id
        else:
            assert_close64(b.delta, a.delta, rtol)
        assert b.payload.keys() == a.payload.keys()
        for key in a.payload:
            assert b.payload[key] == pytest.approx(a.payload[key], rel=rtol, abs=rtol, nan_ok=True), key
    state_seq = loop_seq.client_state.state_dict()
    state_vec = loop_vec.client_state.state_dict()
    assert state_vec.keys() == state_seq.keys()
    for ns in state_seq:
        assert state_vec[ns].keys() == state_seq[ns].keys()
        for cid, st in state_seq[ns].items():
            assert state_vec[ns][cid].keys() == st.keys()
            for key, value in st.items():
                got = state_vec[ns][cid][key]
                if value is None or isinstance(value, int):
                    assert got == value, (cid, key)
                else:
                    assert got == pytest.approx(value, rel=rtol, abs=rtol), (cid, key)  # a step size


def mlp(float64=True):
    torch.manual_seed(1)
    model = MLP(input_dim=64, hidden=[16], num_classes=10)
    return to_float64(model) if float64 else model


def logreg():
    torch.manual_seed(2)
    return to_float64(LogisticRegression(input_dim=64, num_classes=10))


def test_the_test_data_exercises_padding():
    """The digits split used below has sampled clients with fewer samples than the batch size, and clients whose
    sample count is not a multiple of it (partial last batches of different sizes in one step)."""
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    sizes = [dm.client_num_samples(c) for r in range(ROUNDS) for c in dm.sample_clients(r)]
    assert min(sizes) < BATCH
    assert any(n > BATCH and n % BATCH for n in sizes)
    assert len(set(sizes)) > CPR


# ---------------------------------------------------------------------------------------------- equality
@pytest.mark.numerics
@pytest.mark.parametrize(
    "name,clip",
    [
        ("sgd", None),
        ("sgd+wd", 0.5),
        ("armijo", None),
        ("armijo-grow-carry", None),
        ("armijo-exhausted", None),
        ("sps", None),
        ("sps-smooth", None),
        ("decsps", None),
        ("sps-fixed", None),
    ],
)
def test_vectorized_equals_sequential_mlp(name, clip):
    optimizer = CLIENT_OPTIMIZERS[name]
    seq = fit(mlp(), optimizer, "sequential", client_grad_clip=clip)
    vec = fit(mlp(), optimizer, "vectorized", client_grad_clip=clip)
    moved = (seq[0] - torch.cat([p.detach().reshape(-1) for p in mlp().parameters()])).abs().max()
    assert moved > 1e-2
    assert_same_run(seq, vec)
    if name.startswith("armijo"):
        backtracks = {u.backtracks for u in vec[2]}
        assert len(backtracks) > 1  # clients searched for different numbers of trials in the same steps
        assert sum(u.backtracks for u in vec[2]) > 0
    if name == "armijo-exhausted":  # some searches ran out of grid points (recorded step 0, weights unchanged)
        assert any(0.0 in u.step_sizes for u in vec[2])


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "armijo", "armijo-exhausted"))
def test_armijo_search_for_models_with_random_layers_equals_sequential(optimizer, monkeypatch):
    """The line search used for models with dropout (every client at one grid point per trial round, in order)
    also equals sequential training; forced here on a deterministic model so that equality can be checked."""
    import fedlightning.vectorized.call as call

    monkeypatch.setattr(call, "_has_random_layers", lambda model: True)
    vec = fit(mlp(), optimizer, "vectorized")
    assert vec[1].vectorized_engine.deterministic is False
    assert_same_run(fit(mlp(), optimizer, "sequential"), vec)


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd-lr0.5", "armijo-eta2", "sps-default"))
@pytest.mark.parametrize("partition", ["iid-full-batches", "dirichlet"])
def test_vectorized_equals_sequential_logistic_regression(optimizer, partition):
    # IID (35 or 36 of the 1,293 client samples per client) with batch 7 and K=5: every batch is full, so every step
    # takes the unpadded path; Dirichlet: padded partial batches
    dm_fn = (lambda: digits(IID(), batch_size=7, num_clients=36)) if partition.startswith("iid") else digits
    if partition.startswith("iid"):
        dm = dm_fn()
        dm.setup("fit")
        assert min(dm.client_num_samples(c) for c in range(dm.num_clients)) >= K * 7
    assert_same_run(fit(logreg(), optimizer, "sequential", dm_fn), fit(logreg(), optimizer, "vectorized", dm_fn))


class TensorDigits(Digits64):
    """Digits through a per-sample TensorDataset (the generic DataLoader path, not the ArrayDataset fast path)."""

    def load(self):
        train, test, labels = super().load()
        return torch.utils.data.TensorDataset(train.x, train.y), test, labels


def test_generic_loaders_equal_sequential():
    dm_fn = lambda: TensorDigits(num_clients=40, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)  # noqa: E731
    opt = CLIENT_OPTIMIZERS["sgd"]
    assert_same_run(fit(mlp(), opt, "sequential", dm_fn, rounds=2), fit(mlp(), opt, "vectorized", dm_fn, rounds=2))


class ProxAndShift(pl.Callback):
    """Per-client objective terms: μ/2‖w − w_t‖² plus a client-specific linear term (client id / 100)·Σw."""

    def __init__(self, mu=0.5):
        self.mu = mu

    def client_objective(self, trainer, loop, plan, client_id):
        anchor = [p.detach().clone() for p in loop.model.parameters() if p.requires_grad]
        scale = client_id / 100.0

        def prox(params):
            return 0.5 * self.mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))

        def shift(params):
            return scale * sum(p.sum() for p in params)

        return [prox, shift]


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd", "armijo-eta4"))
def test_client_objective_terms(optimizer):
    seq = fit(mlp(), optimizer, "sequential", callbacks=[ProxAndShift()], rounds=2)
    vec = fit(mlp(), optimizer, "vectorized", callbacks=[ProxAndShift()], rounds=2)
    plain = fit(mlp(), optimizer, "vectorized", rounds=2)
    assert (vec[0] - plain[0]).abs().max() > 1e-3  # the terms changed training
    assert_same_run(seq, vec)


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd", "armijo-eta4"))
def test_logged_client_metrics_match(optimizer):
    """self.log calls inside training_step (Classifier logs train/batch_loss) reach the loop's client/ metrics with
    the same per-round mean as sequentially (one value per gradient evaluation; line-search trials are not logged).
    A float64 run logs float64 values in both modes: the means agree to float64 rounding, and a float32 run's to
    numerics.rtol32(CPR·K + 1)."""
    for float64 in (True, False):
        seq = fit(mlp(float64), optimizer, "sequential", rounds=2, float64=float64)
        vec = fit(mlp(float64), optimizer, "vectorized", rounds=2, float64=float64)
        a = seq[3].callback_metrics["client/train/batch_loss"]
        b = vec[3].callback_metrics["client/train/batch_loss"]
        assert float(b) == pytest.approx(float(a), rel=RTOL64 if float64 else rtol32(CPR * K + 1))


class TiedMLP(Classifier):
    """A hidden Linear applied twice (one module under several names) and a second Linear whose weight is the
    same Parameter (one Parameter in two modules)."""

    def __init__(self):
        super().__init__(num_classes=10)
        self.shared = nn.Linear(16, 16)
        twin = nn.Linear(16, 16)
        twin.weight = self.shared.weight
        self.net = nn.Sequential(
            nn.Linear(64, 16),
            nn.Tanh(),
            self.shared,
            nn.Tanh(),
            self.shared,
            nn.Tanh(),
            twin,
            nn.Tanh(),
            nn.Linear(16, 10),
        )


def test_tied_weights_equal_sequential():
    torch.manual_seed(5)
    model = TiedMLP()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert {"shared.weight", "net.2.weight", "net.4.weight", "net.6.weight"} <= set(names)
    assert model.net[6].weight is model.shared.weight
    opt = CLIENT_OPTIMIZERS["sgd"]
    assert_same_run(fit(model, opt, "sequential", rounds=2), fit(model, opt, "vectorized", rounds=2))


class CharWindows(FederatedDataModule):
    """Random 6-character windows over a 10-symbol vocabulary, 6 clients of unequal sizes (natural split)."""

    def __init__(self):
        super().__init__(num_clients=6, batch_size=4)

    def load(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 10, (60, 6), generator=gen)
        y = torch.randint(0, 10, (60,), generator=gen)
        data = ArrayDataset(x, y)
        return data, data, y.numpy()

    def natural_clients(self):
        sizes = [3, 5, 7, 9, 14, 22]
        ends = np.cumsum(sizes)
        return [np.arange(e - n, e) for e, n in zip(ends, sizes)]


@pytest.mark.numerics
@pytest.mark.parametrize("model_cls", [CharLSTM, CharGRU])
@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd-lr0.5", "armijo-default"))
def test_recurrent_models_equal_sequential(model_cls, optimizer):
    """nn.LSTM / nn.GRU have no vmap batching rule; the engine runs them through _rnn_forward (plain tensor ops)."""
    torch.manual_seed(6)
    model = model_cls(vocab_size=10, embedding_dim=4, hidden_size=8, num_layers=2)
    seq = fit(model, optimizer, "sequential", dm_fn=CharWindows, rounds=2)
    vec = fit(model, optimizer, "vectorized", dm_fn=CharWindows, rounds=2)
    assert_same_run(seq, vec)


@pytest.mark.numerics
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first,bidirectional", [(True, False), (False, True)])
def test_rnn_forward_equals_the_fused_kernels(cls, batch_first, bidirectional):
    """In float64: the gates one time step at a time against torch's fused kernels (other summation orders)."""
    torch.manual_seed(7)
    rnn = cls(5, 7, num_layers=2, batch_first=batch_first, bidirectional=bidirectional).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    for args in [(x,), (x[0],)]:  # batched and unbatched input
        want, got = rnn(*args), _rnn_forward(rnn, *args)
        assert_close64(got[0], want[0])
        if cls is nn.LSTM:
            assert_close64(got[1][0], want[1][0])
            assert_close64(got[1][1], want[1][1])
        else:
            assert_close64(got[1], want[1])


# ---------------------------------------------------------------------------------------------- masked line search
class Quadratic(pl.LightningModule):
    """f(w; batch) = mean over the batch of ½·a·‖w‖², where each client's samples all carry its curvature a."""

    def __init__(self, dim=3):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(1.0, 2.0, dim, dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        a, _ = batch
        return (0.5 * a * (self.w**2).sum()).mean()


class CurvatureClients(FederatedDataModule):
    """Client i holds sizes[i] samples, all with curvature curvatures[i] (a natural split)."""

    def __init__(self, curvatures, sizes, batch_size=4):
        super().__init__(num_clients=len(curvatures), batch_size=batch_size)
        self.curvatures, self.sizes = curvatures, sizes

    def load(self):
        a = torch.cat([torch.full((n,), float(c), dtype=torch.float64) for c, n in zip(self.curvatures, self.sizes)])
        data = ArrayDataset(a, torch.zeros(len(a), dtype=torch.long))
        return data, data, np.zeros(len(a), dtype=np.int64)

    def natural_clients(self):
        ends = np.cumsum(self.sizes)
        return [np.arange(e - n, e) for e, n in zip(ends, self.sizes)]


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_masked_backtracking_matches_analytic_quadratic(mode):
    """On f = ½a‖w‖², w − ηg = (1 − ηa)w and the Armijo test f(w − ηg) ≤ f(w) − cη‖g‖² reduces to η ≤ 2(1 − c)/a,
    independent of w. So with η_max = 1, β = 1/2, c = 0.1 client a accepts η_max·β^m with the smallest m such that
    β^m ≤ 1.8/a, after m backtracks, at every one of its K steps, and ends at (1 − ηa)^K w_0 (all in float64)."""
    curvatures = [0.5, 3.0, 10.0, 50.0]
    sizes = [3, 5, 4, 6]  # unequal counts, some below the batch size 4
    expected_m = [0, 1, 3, 5]  # 1.8/a = 3.6, 0.6, 0.18, 0.036
    for a, m in zip(curvatures, expected_m):
        assert 0.5**m <= 1.8 / a and (m == 0 or 0.5 ** (m - 1) > 1.8 / a)
    steps = 3
    model = Quadratic()
    w0 = model.w.detach().clone()
    rec = Recorder()
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: SgdArmijo(p, eta_max=1.0, beta=0.5, c=0.1),
        local_steps=steps,
        clients_per_round=4,
        seed=0,
        client_execution=mode,
    )
    trainer = make_trainer(1, callbacks=[FedAvg(weighting="samples"), rec])
    trainer.fit(loop, datamodule=CurvatureClients(curvatures, sizes))
    assert sorted(u.client_id for u in rec.updates) == [0, 1, 2, 3]
    expected_w = torch.zeros_like(w0)
    for u in rec.updates:
        a, m = curvatures[u.client_id], expected_m[u.client_id]
        eta = 0.5**m
        assert u.step_sizes == pytest.approx([eta] * steps, rel=1e-12)
        assert u.backtracks == m * steps
        assert u.forwards == steps * (2 + m) and u.backwards == steps
        expected_w += sizes[u.client_id] * (1 - eta * a) ** steps * w0
    expected_w /= sum(sizes)
    assert_close64(model.w.detach(), expected_w)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_init_step_size_below_the_cap_grows_per_client(mode):
    """Seed 002's start: ``init_step_size`` 1 below the cap ``eta_max`` 10 with ``reset="grow"``. On f = ½a‖w‖²
    client a accepts the largest grid point η_0 β^m ≤ 1.8/a, with η_0 = 1 at its first step and
    min(η_{k−1}·δ^{1/⌈n/b⌉}, 10) after; the steps are recomputed here in Python floats, client by client."""
    curvatures = [0.1, 0.3, 3.0, 10.0]
    sizes = [3, 5, 4, 6]  # batch 4: 1, 2, 1, 2 batches per epoch
    steps, beta = 4, 0.5
    model = Quadratic()
    w0 = model.w.detach().clone()
    rec = Recorder()
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: SgdArmijo(
            p, eta_max=10.0, init_step_size=1.0, beta=beta, c=0.1, reset="grow", delta=2.0
        ),
        local_steps=steps,
        clients_per_round=4,
        seed=0,
        client_execution=mode,
    )
    make_trainer(1, callbacks=[FedAvg(weighting="samples"), rec]).fit(
        loop, datamodule=CurvatureClients(curvatures, sizes)
    )
    expected_w = torch.zeros_like(w0)
    grew = False
    for u in rec.updates:
        a, n = curvatures[u.client_id], sizes[u.client_id]
        growth, prev, etas = 2.0 ** (1 / math.ceil(n / 4)), None, []
        for _ in range(steps):
            eta = 1.0 if prev is None else min(prev * growth, 10.0)
            while eta > 1.8 / a:
                eta *= beta
            etas.append(eta)
            prev = eta
        grew = grew or max(etas) > 1.0
        assert u.step_sizes == pytest.approx(etas, rel=1e-12)
        expected_w += n * math.prod(1 - eta * a for eta in etas) * w0
    assert grew  # some client's step grew past init_step_size, which eta_max as the start would never allow
    assert_close64(model.w.detach(), expected_w / sum(sizes))


# ---------------------------------------------------------------------------------------------- failures
class PoisonClient(pl.Callback):
    """Adds a NaN objective term for one client (its loss is non-finite from the first step on)."""

    def __init__(self, client_id):
        self.client_id = client_id

    def client_objective(self, trainer, loop, plan, client_id):
        if client_id != self.client_id:
            return []
        return [lambda params: params[0].sum() * float("nan")]


@pytest.mark.parametrize(
    "optimizer,steps_of_failed",
    [(CLIENT_OPTIMIZERS["sgd"], K), (CLIENT_OPTIMIZERS["armijo-eta4"], 1)],
    ids=["sgd", "armijo-eta4"],
)
def test_a_failing_client_is_skipped_and_others_are_unaffected(optimizer, steps_of_failed):
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    victim = dm.sample_clients(0)[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq = fit(mlp(), optimizer, "sequential", callbacks=[PoisonClient(victim)], rounds=2)
        vec = fit(mlp(), optimizer, "vectorized", callbacks=[PoisonClient(victim)], rounds=2)
    failed = [u for u in vec[2] if u.failed]
    assert [u.client_id for u in failed] == [victim]
    assert failed[0].failure == "non-finite training loss"
    assert failed[0].num_steps == steps_of_failed  # closure optimizers stop a client at its first non-finite loss
    assert torch.isfinite(vec[0]).all()
    assert vec[1].failed_clients_total == seq[1].failed_clients_total == 1
    assert_same_run(seq, vec)


# ---------------------------------------------------------------------------------------------- randomness
def test_dropout_masks_are_reproducible_and_replayed_in_trials():
    """With dropout, vectorised randomness is reproducible (same seed, same result) and a trial evaluation at the
    gradient point sees the gradient evaluation's masks (same loss), while a new evaluation draws new masks."""
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[32], dropout=0.5)
    opt = CLIENT_OPTIMIZERS["armijo-eta2"]
    a = fit(model, opt, "vectorized", rounds=2)[0]
    b = fit(model, opt, "vectorized", rounds=2)[0]
    torch.testing.assert_close(a, b, atol=0, rtol=0)

    engine = VectorizedClientTrainer(copy.deepcopy(model))
    engine.model.train()
    W = torch.cat([p.detach().reshape(-1) for p in engine.model.parameters()]).repeat(3, 1)
    everyone = torch.ones(3, dtype=torch.bool)
    x = torch.randn(1, 64).repeat(24, 1)  # every client sees the same sample
    y = torch.zeros(24, dtype=torch.long)
    for sizes in ([8, 8, 8], [8, 5, 3]):  # whole-batch rows, and cells of unequal clients
        n = sum(sizes)
        position = torch.from_numpy(_padded_positions(sizes))
        layout = _Layout([x[:n][position], y[:n][position]], tree_flatten((x, y))[1], sizes)
        assert (layout.mask is None) == (sizes[0] == sizes[2])
        ev = _StepEvaluator(engine, layout, 0, None, [], None)
        loss, _ = ev.gradient(W, everyone)
        torch.testing.assert_close(ev.trial(W), loss, atol=0, rtol=0)
        torch.testing.assert_close(ev.trial(W), loss, atol=0, rtol=0)
        ev.finish()
        again, _ = _StepEvaluator(engine, layout, 0, None, [], None).gradient(W, everyone)
        assert not torch.equal(again, loss)
        assert len(set(loss.tolist())) == 3  # identical clients and data, different masks per client


# ---------------------------------------------------------------------------------------------- unsupported
class SyncBNClassifier(Classifier):
    def __init__(self):
        super().__init__(num_classes=10)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.SyncBatchNorm(16), nn.ReLU(), nn.Linear(16, 10))


class OwnBatchNorm(nn.BatchNorm1d):
    def forward(self, x):
        return super().forward(x) * 2.0


class OwnBNClassifier(Classifier):
    def __init__(self):
        super().__init__(num_classes=10)
        self.net = nn.Sequential(nn.Linear(64, 16), OwnBatchNorm(16), nn.ReLU(), nn.Linear(16, 10))


def sync_bn_model():
    torch.manual_seed(4)
    return SyncBNClassifier()


class ItemGate(nn.Module):
    """Data-dependent Python control flow (.item()), which vmap cannot batch."""

    def forward(self, x):
        return x if x.sum().item() > -1e30 else -x


class ItemClassifier(Classifier):
    def __init__(self):
        super().__init__(num_classes=10)
        self.net = nn.Sequential(nn.Linear(64, 10), ItemGate())


def test_sync_batchnorm_and_own_forward_are_refused_naming_the_layer():
    with pytest.raises(VectorizationUnsupportedError, match=r"'net\.1' \(SyncBatchNorm\)"):
        check_model_vectorizable(SyncBNClassifier())
    with pytest.raises(VectorizationUnsupportedError, match=r"'net\.1' \(SyncBatchNorm\)"):
        fit(SyncBNClassifier(), lambda p: torch.optim.SGD(p, lr=0.1), "vectorized", rounds=1)
    with pytest.raises(VectorizationUnsupportedError, match=r"'net\.1' \(OwnBatchNorm\): it overrides forward"):
        check_model_vectorizable(OwnBNClassifier())
    check_model_vectorizable(
        nn.Sequential(
            nn.Linear(4, 4),
            nn.GroupNorm(2, 4),
            nn.LayerNorm(4),
            nn.BatchNorm1d(4),
            nn.InstanceNorm1d(4, track_running_stats=True),
        )
    )


def test_layer_vmap_cannot_run_is_named():
    with pytest.raises(VectorizationUnsupportedError, match=r"'net\.1' \(ItemGate\)"):
        fit(ItemClassifier(), lambda p: torch.optim.SGD(p, lr=0.1), "vectorized", rounds=1)


@pytest.mark.parametrize(
    "optimizer,match",
    [
        (lambda p: torch.optim.RMSprop(p, lr=0.01), "RMSprop: it names no batched form"),
        (lambda p: torch.optim.Adagrad(p, lr=0.01), "Adagrad: it names no batched form"),
        (
            lambda p: torch.optim.SGD([{"params": list(p)[:1], "lr": 0.1}, {"params": list(p)[1:], "lr": 0.2}]),
            "same SGD settings",
        ),
        (
            lambda p: torch.optim.Adam([{"params": list(p)[:1]}, {"params": list(p)[1:], "betas": (0.5, 0.9)}]),
            "same Adam settings",
        ),
        (lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01)), r"takes Adam's lr as numbers, but got tensor"),
    ],
    ids=["rmsprop", "adagrad", "sgd-groups", "adam-groups", "adam-tensor-lr"],
)
def test_unsupported_optimizers_are_refused(optimizer, match):
    with pytest.raises(VectorizationUnsupportedError, match=match):
        fit(mlp(), optimizer, "vectorized", rounds=1)


@pytest.mark.parametrize(
    "model_fn,optimizer",
    [
        (sync_bn_model, lambda p: torch.optim.SGD(p, lr=0.1)),
        (mlp, lambda p: torch.optim.RMSprop(p, lr=0.01)),
        (mlp, lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01))),
    ],
    ids=["syncbatchnorm", "rmsprop", "adam-tensor-lr"],
)
def test_auto_falls_back_to_sequential_with_one_warning(model_fn, optimizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = fit(model_fn(), optimizer, "auto", rounds=2)
    fallbacks = [w for w in caught if "client_execution='auto'" in str(w.message)]
    assert len(fallbacks) == 1
    seq = fit(model_fn(), optimizer, "sequential", rounds=2)
    torch.testing.assert_close(auto[0], seq[0], atol=0, rtol=0)


def _shrink_gradients(optimizer, args, kwargs):
    """A step pre-hook: scales every gradient by 0.1 before the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.1)


def _sgd_with_pre_hook(params):
    opt = torch.optim.SGD(params, lr=0.3)
    opt.register_step_pre_hook(_shrink_gradients)
    return opt


class _ServerMomentum(FederatedCallback):
    """Sets a server-held momentum (SGD) or first moment (Adam) into each client optimizer before its steps."""

    def configure_client_optimizer(self, trainer, pl_module, plan, client_id, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(optimizer, torch.optim.SGD):
                    optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 0.05)
                else:
                    optimizer.state[p]["step"] = torch.tensor(10.0, dtype=torch.float64)
                    optimizer.state[p]["exp_avg"] = torch.full_like(p, 0.05)
                    optimizer.state[p]["exp_avg_sq"] = torch.full_like(p, 1e-3)


@pytest.mark.parametrize(
    "optimizer,callbacks,match",
    [
        (_sgd_with_pre_hook, (), r"a step pre-hook \(register_step_pre_hook\) on the client optimizer would not run"),
        (
            lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9),
            (_ServerMomentum(),),
            r"holds state before the round \(momentum_buffer",
        ),
        (
            lambda p: torch.optim.Adam(p, lr=0.01),
            (_ServerMomentum(),),
            r"holds state before the round \(exp_avg, exp_avg_sq, step",
        ),
    ],
    ids=["step-pre-hook", "sgd-momentum-set", "adam-moments-set"],
)
def test_steps_the_batched_rule_would_not_take_are_refused_and_auto_trains_them_sequentially(
    optimizer, callbacks, match
):
    """A step hook on the client optimizer, or SGD / Adam state that ``configure_client_optimizer`` set from the
    server, changes the sequential step; the batched rules never call ``optimizer.step()`` and start from empty
    state, so vectorized refuses by name (it trained without them before) and auto equals sequential."""
    with pytest.raises(VectorizationUnsupportedError, match=match):
        fit(mlp(), optimizer, "vectorized", rounds=1, callbacks=callbacks)
    seq = fit(mlp(), optimizer, "sequential", rounds=2, callbacks=callbacks)
    auto = fit(mlp(), optimizer, "auto", rounds=2, callbacks=callbacks)
    torch.testing.assert_close(auto[0], seq[0], atol=0, rtol=0)
    plain = fit(mlp(), lambda p: torch.optim.SGD(p, lr=0.3), "sequential", rounds=2)
    assert (seq[0] - plain[0]).abs().max() > 1e-3  # the hook / the state changed the steps


def test_a_global_optimizer_step_hook_is_refused_by_vectorized():
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: seen.append(type(opt).__name__))
    try:
        with pytest.raises(VectorizationUnsupportedError, match=r"a global step post-hook"):
            fit(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), "vectorized", rounds=1)
    finally:
        handle.remove()
    fit(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), "vectorized", rounds=1)  # without it: trains


@pytest.mark.numerics
@pytest.mark.parametrize(
    "optimizer,clip",
    [
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), None),
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=5e-3), 1.0),
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3), None),
        (lambda p: torch.optim.SGD(p, lr=0.05, maximize=True), None),
        (lambda p: torch.optim.Adam(p, lr=0.01), None),
        (lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), weight_decay=1e-2, amsgrad=True), 1.0),
        (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), None),
        (lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True, maximize=True), None),
    ],
    ids=[
        "momentum",
        "momentum-dampening-decay-clip",
        "nesterov",
        "maximize",
        "adam",
        "adam-amsgrad-decay-clip",
        "adamw",
        "adamw-amsgrad-maximize",
    ],
)
def test_momentum_sgd_and_adam_equal_sequential(optimizer, clip):
    """torch's SGD with momentum and Adam / AdamW, the optimizers users' ``configure_optimizers`` return most
    often, run vectorised with one moment row per client, fresh every round as the loop's fresh client optimizers
    are: same weights, losses and per-client updates as sequential training on the ragged split."""
    seq = fit(mlp(), optimizer, "sequential", client_grad_clip=clip)
    vec = fit(mlp(), optimizer, "vectorized", client_grad_clip=clip)
    assert_same_run(seq, vec)
    plain = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    assert (seq[0] - plain[0]).abs().max() > 1e-3  # the optimizer's own arithmetic was exercised


def test_auto_vectorizes_supported_models():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2)
    assert not [w for w in caught if "client_execution='auto'" in str(w.message)]
    assert isinstance(auto[1].vectorized_engine, VectorizedClientTrainer)
    assert_same_run(fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=2), auto)


@pytest.mark.parametrize("bad", ["fast", "Vectorized", "", None, 1])
def test_bad_client_execution_is_rejected(bad):
    with pytest.raises(ValueError, match="client_execution"):
        FederatedLoop(mlp(), client_execution=bad)


def test_engine_rejects_bad_arguments():
    engine = VectorizedClientTrainer(mlp())
    params = [p for p in engine.model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    common = dict(round=0, seed=0, global_params=params, global_buffers=[], global_flat=flat, datamodule=None)
    opts = [torch.optim.SGD(params, lr=0.1) for _ in range(2)]
    with pytest.raises(ValueError, match="local_steps"):
        engine.run(client_ids=[0, 1], optimizers=opts, local_steps=0, **common)
    with pytest.raises(ValueError, match="2 optimizers for 3 clients"):
        engine.run(client_ids=[0, 1, 2], optimizers=opts, local_steps=1, **common)
    with pytest.raises(ValueError, match="objective terms for 1 clients"):
        engine.run(client_ids=[0, 1], optimizers=opts, local_steps=1, terms=[[]], **common)
    assert engine.run(client_ids=[], optimizers=[], local_steps=1, **common) == []


# ---------------------------------------------------------------------------------------------- float32
@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sgd", "armijo", "sps"])
def test_float32_vectorized_is_as_close_to_the_float64_run_as_sequential(name):
    """The float32 runs of both modes are float32 images of one exact computation: the vectorised run is within
    k = 16 times the sequential float32 run's own rounding error of the float64 run (numerics.assert_rounding_close),
    a tolerance measured on the machine that runs the test rather than tuned to one."""
    optimizer = CLIENT_OPTIMIZERS[name]
    exact = fit(mlp(), optimizer, "sequential")
    seq = fit(mlp(float64=False), optimizer, "sequential", float64=False)
    vec = fit(mlp(float64=False), optimizer, "vectorized", float64=False)
    assert exact[0].dtype == torch.float64 and seq[0].dtype == vec[0].dtype == torch.float32
    assert (exact[0] - flat(mlp())).abs().max() > 1e-2  # trained
    assert_rounding_close(vec[0], seq[0], exact[0])
