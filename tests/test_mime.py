"""Mime and MimeLite (Karimireddy et al. 2021): agreement with a plain-PyTorch float64 reference loop, MimeLite with
β = 0 is FedAvg, Mime's SVRG correction on a quadratic (g(y; ζ) − g(x; ζ) = H_ζ (y − x)) and at the server point
(every client moves along c, dropout included), resume, refused configurations and execution modes."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, Mime, MimeLite
from fedlightning.datamodules import Dirichlet
from fedlightning.models import MLP, LogisticRegression
from fedlightning.optim import MimeLiteSGD, MimeSGD
from fedlightning.state import flat_params
from numerics import Digits64, assert_close64, to_float64
from test_resume import run_resume_equivalence
from test_strategies import Recorder

LR, K, CPR, SEED, ROUNDS, BETA = 0.2, 3, 4, 3, 3, 0.6


def make_dm(batch_size=16):
    return Digits64(num_clients=12, batch_size=batch_size, partition=Dirichlet(0.5), seed=2)


def make_model(kind="logreg"):
    torch.manual_seed(1)
    if kind == "mlp":
        return to_float64(MLP(input_dim=64, hidden=[16], num_classes=10, dropout=0.3))
    return to_float64(LogisticRegression(input_dim=64, num_classes=10))


def run(
    callbacks,
    rounds=ROUNDS,
    kind="logreg",
    local_steps=K,
    batch_size=16,
    lr=LR,
    execution="sequential",
    opt=None,
    accelerator="cpu",
    model=None,
    **loop_args,
):
    loop = FederatedLoop(
        model or make_model(kind),
        client_optimizer=opt or (lambda p: torch.optim.SGD(p, lr=lr)),
        local_steps=local_steps,
        clients_per_round=CPR,
        seed=SEED,
        client_execution=execution,
        **loop_args,
    )
    trainer = make_trainer(rounds, callbacks=callbacks, accelerator=accelerator)
    trainer.fit(loop, datamodule=make_dm(batch_size))
    return loop, trainer


def weights(loop):
    return flat_params(loop.global_parameters())


# ============================================================================ plain-PyTorch reference (float64)
def _grad(f, w, x, y):
    wr = [t.detach().clone().requires_grad_(True) for t in w]
    return [g.detach() for g in torch.autograd.grad(F.cross_entropy(f(wr, x), y), wr)]


def reference_mime(correction, beta=BETA, rounds=ROUNDS, weighting="uniform", faulty=frozenset()):
    """Algorithm 1 of Karimireddy et al. with SGD-momentum as the base optimizer, written out with plain tensors;
    the clients of ``faulty`` (whose every loss is NaN) are left out of ``c`` and of the average."""
    dm = make_dm()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    net = make_model().net
    names = [n for n, _ in net.named_parameters()]
    f = lambda w, x: torch.func.functional_call(net, dict(zip(names, w)), (x,))  # noqa: E731
    x_server = [p.detach().clone() for p in net.parameters()]
    m = [torch.zeros_like(t) for t in x_server]

    def data(k):
        idx = torch.as_tensor(dm.client_indices[k])
        return dm.train_dataset.x[idx], dm.train_dataset.y[idx]

    for r in range(rounds):
        clients = [k for k in dm.sample_clients(r) if k not in faulty]
        w = [float(dm.client_num_samples(k)) if weighting == "samples" else 1.0 for k in clients]
        full = [_grad(f, x_server, *data(k)) for k in clients]
        c = [sum(wk * g[j] for wk, g in zip(w, full)) / sum(w) for j in range(len(x_server))]
        ys = []
        for k in clients:
            y, it = [t.clone() for t in x_server], iter(dm.client_dataloader(k, r, seed=SEED))
            for _ in range(K):
                try:
                    bx, by = next(it)
                except StopIteration:
                    it = iter(dm.client_dataloader(k, r, seed=SEED))
                    bx, by = next(it)
                gy = _grad(f, y, bx, by)
                if correction:
                    gx = _grad(f, x_server, bx, by)
                    d = [a - b + cj for a, b, cj in zip(gy, gx, c)]
                else:
                    d = gy
                y = [yj - LR * ((1 - beta) * dj + beta * mj) for yj, dj, mj in zip(y, d, m)]
            ys.append(y)
        x_server = [sum(wk * y[j] for wk, y in zip(w, ys)) / sum(w) for j in range(len(x_server))]
        m = [(1 - beta) * cj + beta * mj for cj, mj in zip(c, m)]
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return flat(x_server), flat(m)


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", [Mime, MimeLite])
def test_mime_matches_reference_loop(strategy):
    s = strategy(momentum=BETA)
    rec = Recorder()
    loop, _ = run([s, rec])
    ref_x, ref_m = reference_mime(correction=strategy is Mime)
    assert_close64(weights(loop), ref_x)
    assert_close64(s.server_momentum, ref_m)
    assert float(ref_m.norm()) > 0
    per_round = 2.0 if strategy is Mime else 1.0
    assert [m["round/communication_rounds"] for m in rec.metrics] == [per_round * (r + 1) for r in range(ROUNDS)]
    steps = 2 if strategy is Mime else 1  # Mime evaluates each step's batch at y and at x
    assert all(u.forwards == steps * K for round_updates in rec.updates for u in round_updates)


@pytest.mark.numerics
def test_mime_with_sample_weights_matches_reference_loop():
    s = Mime(momentum=BETA, weighting="samples")
    loop, _ = run([s], rounds=2)
    ref_x, ref_m = reference_mime(correction=True, rounds=2, weighting="samples")
    assert_close64(weights(loop), ref_x)
    assert_close64(s.server_momentum, ref_m)


def test_the_correction_changes_the_run_and_momentum_matters():
    a, _ = run([Mime(momentum=BETA)])
    b, _ = run([MimeLite(momentum=BETA)])
    c, _ = run([MimeLite(momentum=0.0)])
    assert not torch.allclose(weights(a), weights(b), atol=1e-6)
    assert not torch.allclose(weights(b), weights(c), atol=1e-6)


def test_mimelite_with_zero_momentum_is_fedavg():
    a, _ = run([MimeLite(momentum=0.0)])
    b, _ = run([FedAvg(weighting="uniform")])
    assert_close64(weights(a), weights(b))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Device(pl.Callback):
    """The device type the model trains on (Lightning moves it back to the CPU when ``fit`` ends)."""

    def on_train_start(self, trainer, pl_module):
        self.seen = next(pl_module.parameters()).device.type


@pytest.mark.parametrize(
    "execution,accelerator",
    [
        ("sequential", "cpu"),
        ("vectorized", "cpu"),
        pytest.param("sequential", "gpu", marks=CUDA),
        pytest.param("vectorized", "gpu", marks=CUDA),
    ],
    ids=["sequential", "vectorized", "sequential-cuda", "vectorized-cuda"],
)
def test_mime_first_step_at_the_server_point_moves_every_client_along_c(execution, accelerator):
    """K = 1: y = x at the only step, so d = g(x; ζ) − g(x; ζ) + c = c exactly — with dropout too (the evaluation at x
    replays the step's dropout masks): every client's update is η(1 − β)c (m = 0 in round 0). Vectorized: the batched
    evaluation at x must put the random state back for the one at y; on a GPU, the device's random state."""
    s, rec = Mime(momentum=BETA), Recorder()

    class Grab(Recorder):
        def on_round_start(self, trainer, loop, plan):
            super().on_round_start(trainer, loop, plan)
            self.c = s._full_gradient.clone()

    grab = Grab()
    run([s, grab, rec], rounds=1, kind="mlp", local_steps=1, execution=execution, accelerator=accelerator)
    assert len(rec.updates[0]) == CPR
    for u in rec.updates[0]:
        assert_close64(u.delta.cpu(), LR * (1 - BETA) * grab.c.cpu())


# ============================================================================ the client step on a quadratic
def _quadratic_closure(w, H, a):
    return lambda: 0.5 * (w - a) @ H @ (w - a)


def test_mime_step_on_a_quadratic_is_the_analytic_svrg_step():
    """f(w; ζ) = ½ (w − a_ζ)ᵀ H_ζ (w − a_ζ): g(y; ζ) − g(x; ζ) = H_ζ (y − x), so one step from y is
    y − η((1 − β)(H_ζ(y − x) + c) + β m), whatever a_ζ is; the parameters are back at y between the evaluations."""
    gen = torch.Generator().manual_seed(0)
    d = 4
    A = torch.randn(d, d, generator=gen, dtype=torch.float64)
    H = A @ A.T + torch.eye(d, dtype=torch.float64)
    a = torch.randn(d, generator=gen, dtype=torch.float64)
    x = torch.randn(d, generator=gen, dtype=torch.float64)
    y0 = x + torch.randn(d, generator=gen, dtype=torch.float64)
    c = torch.randn(d, generator=gen, dtype=torch.float64)
    m = torch.randn(d, generator=gen, dtype=torch.float64)
    lr, beta = 0.05, 0.3
    w = torch.nn.Parameter(y0.clone())
    entered = []

    class Guard:
        def __enter__(self):
            entered.append(w.detach().clone())  # the parameters inside the guard: x

        def __exit__(self, *exc):
            return False

    opt = MimeSGD([w], lr=lr, momentum=beta, server_momentum=[m], anchor=[x], full_gradient=[c], evaluation_guard=Guard)
    for step in range(2):
        y = w.detach().clone()
        opt.zero_grad()
        loss = opt.step(_quadratic_closure(w, H, a))
        assert_close64(loss, 0.5 * (y - a) @ H @ (y - a))  # the loss at y
        assert_close64(w.detach(), y - lr * ((1 - beta) * (H @ (y - x) + c) + beta * m))
        assert torch.equal(entered[step], x)
        assert opt.last_step == {"step_size": lr, "backtracks": 0, "forwards": 2, "backwards": 2}
    assert_close64(m, m.clone())  # the frozen state is not written


def test_mimelite_step_is_sgd_with_the_frozen_momentum():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    m = torch.tensor([0.5, 0.25], dtype=torch.float64)
    opt = MimeLiteSGD([w], lr=0.1, momentum=0.8, server_momentum=[m])
    for _ in range(2):
        before = w.detach().clone()
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step()
        assert_close64(w.detach(), before - 0.1 * (0.2 * 2 * before + 0.8 * m))
    assert torch.equal(m, torch.tensor([0.5, 0.25], dtype=torch.float64))


def test_mime_step_restores_the_rng_and_needs_a_closure():
    w = torch.nn.Parameter(torch.ones(3))
    z = [torch.zeros(3)]
    opt = MimeSGD([w], lr=0.1, momentum=0.0, anchor=z, full_gradient=z)
    draws = []

    def closure():
        draws.append(torch.rand(1))
        return (w * w).sum()

    torch.manual_seed(5)
    opt.step(closure)
    after = torch.rand(1)
    torch.manual_seed(5)
    plain, plain_after = torch.rand(1), torch.rand(1)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], plain)  # same randomness at x and at y
    assert torch.equal(after, plain_after)  # afterwards, the stream a plain step leaves
    with pytest.raises(TypeError, match="closure"):
        opt.step()
    with pytest.raises(ValueError, match="anchor"):
        MimeSGD([w], lr=0.1)


# ============================================================================ resume, configuration, execution
@pytest.mark.parametrize("strategy", [Mime, MimeLite])
@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_resume_equals_an_uninterrupted_run(tmp_path, strategy, execution):
    """The server momentum and Mime's server point and full gradient come back from the checkpoint: the resumed
    run's weights are the uninterrupted run's bit for bit, with either execution mode."""
    full, resumed, loop = run_resume_equivalence(
        tmp_path,
        lambda: strategy(momentum=0.5),
        lambda p: torch.optim.SGD(p, lr=0.1),
        total=4,
        cut=2,
        client_execution=execution,
    )
    assert (loop.vectorized_engine is not None) == (execution == "vectorized")
    assert torch.equal(full, resumed)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5, float("nan")])
def test_momentum_outside_the_unit_interval_is_refused(momentum):
    with pytest.raises(ValueError, match="momentum"):
        Mime(momentum=momentum)
    with pytest.raises(ValueError, match="momentum"):
        MimeLite(momentum=momentum)


@pytest.mark.parametrize(
    "opt,what",
    [
        (lambda p: torch.optim.Adam(p, lr=0.01), "it is Adam"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum=0.9"),
        (lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-4), "weight_decay"),
    ],
)
def test_a_client_optimizer_other_than_plain_sgd_is_refused(opt, what):
    with pytest.raises(TypeError, match="model.client_optimizer") as err:
        run([Mime()], rounds=1, opt=opt)
    assert what in str(err.value)


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["logreg", "mlp"])
def test_mime_vectorized_clients_train_as_sequential_ones(kind):
    """Mime's batched form (vectorized/rules.py, two batched gradient evaluations per step): the global weights and
    the server momentum of sequential training in float64, and the same counts (2 forward and 2 backward passes per
    step). The MLP has dropout: its masks differ between the modes, so the weights are compared on the logistic
    regression, and on the MLP the counts and that both modes train."""
    seq, vec = Mime(momentum=BETA), Mime(momentum=BETA)
    rec_a, rec_b = Recorder(), Recorder()
    a, _ = run([seq, rec_a], kind=kind)
    b, _ = run([vec, rec_b], kind=kind, execution="vectorized")
    counts = [[(u.forwards, u.backwards, u.num_steps) for u in r] for r in rec_a.updates]
    assert counts == [[(u.forwards, u.backwards, u.num_steps) for u in r] for r in rec_b.updates]
    assert counts[0][0] == (2 * K, 2 * K, K)
    if kind == "logreg":
        assert_close64(weights(b), weights(a))
        assert_close64(vec.server_momentum, seq.server_momentum)
    lite, _ = run([MimeLite(momentum=BETA)], kind=kind, execution="vectorized")
    assert float((weights(lite) - weights(b)).abs().max()) > 1e-4  # the correction moved the run


@CUDA
@pytest.mark.parametrize("strategy", [Mime, MimeLite])
def test_vectorized_clients_on_cuda_train_as_sequential_ones(strategy):
    """On a GPU: the global weights and server momentum of float64 vectorized training equal sequential training on
    the same GPU and on the CPU."""
    a, b, c = strategy(momentum=BETA), strategy(momentum=BETA), strategy(momentum=BETA)
    where = Device()
    seq, _ = run([a], accelerator="gpu")
    vec, _ = run([b, where], execution="vectorized", accelerator="gpu")
    cpu, _ = run([c])
    assert where.seen == "cuda"
    assert_close64(weights(vec).cpu(), weights(seq).cpu())
    assert_close64(weights(vec).cpu(), weights(cpu))
    assert_close64(b.server_momentum.cpu(), a.server_momentum.cpu())


@pytest.mark.numerics
@pytest.mark.parametrize("loop_args", [{}, {"client_grad_clip": 0.05}], ids=["plain", "grad-clip"])
def test_mimelite_vectorized_clients_train_as_sequential_ones(loop_args):
    """MimeLite's batched form (vectorized/rules.py): the global weights and the server momentum of sequential
    training in float64 (the momentum is built from the clients' full-batch gradients at each round's server point,
    so a client whose step used the wrong frozen momentum moves every later round), with and without the loop's
    gradient clipping."""
    seq, vec = MimeLite(momentum=BETA), MimeLite(momentum=BETA)
    a, _ = run([seq], **loop_args)
    b, _ = run([vec], execution="vectorized", **loop_args)
    assert_close64(weights(b), weights(a))
    assert_close64(vec.server_momentum, seq.server_momentum)
    lite_without_momentum, _ = run([MimeLite(momentum=0.0)], execution="vectorized", **loop_args)
    assert float((weights(lite_without_momentum) - weights(a)).abs().max()) > 1e-4  # the momentum moved the run


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_the_evaluation_at_the_server_point_leaves_no_trace_in_buffers_or_metrics(execution):
    """A BatchNorm on the inputs and a torchmetrics sum of the batch sizes depend on the data only, not on the
    weights: Mime (two evaluations per step) must leave the same running statistics and the same logged count as
    MimeLite (one evaluation per step), in either execution mode."""
    import torchmetrics

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(64)
            self.lin = torch.nn.Linear(64, 10)
            self.seen = torchmetrics.SumMetric()

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.update(torch.ones_like(y, dtype=torch.float64))  # the batch's size, one 1 per sample
            self.log("seen", self.seen)
            return F.cross_entropy(self.lin(self.bn(x)), y)

    def fit(strategy):
        torch.manual_seed(1)
        loop = FederatedLoop(
            to_float64(Net()),
            client_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
            local_steps=K,
            clients_per_round=CPR,
            seed=SEED,
            client_execution=execution,
        )
        trainer = make_trainer(2, callbacks=[strategy])
        trainer.fit(loop, datamodule=make_dm())
        return loop, float(trainer.callback_metrics["client/seen"])

    (a, seen_a), (b, seen_b) = fit(Mime(momentum=BETA)), fit(MimeLite(momentum=BETA))
    assert seen_a == seen_b > 0
    assert torch.equal(a.model.bn.running_mean, b.model.bn.running_mean)
    assert torch.equal(a.model.bn.running_var, b.model.bn.running_var)
    assert not torch.equal(weights(a), weights(b))


def test_vectorized_clients_with_different_momentum_or_correction_are_refused():
    """Lockstep steps share β (and Mime's correction): clients built with different ones (not what Mime / MimeLite
    build) are refused by name when the batched form is made."""
    from fedlightning.vectorized import VectorizationUnsupportedError, make_batched_rule

    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    cpu = torch.device("cpu")
    lite = [MimeLiteSGD([w], lr=LR, momentum=0.5), MimeLiteSGD([w], lr=LR, momentum=0.9)]
    with pytest.raises(VectorizationUnsupportedError, match="momentum"):
        make_batched_rule(lite, [w], None, cpu)
    point = [torch.zeros(3, dtype=torch.float64)]
    full = dict(anchor=point, full_gradient=point)
    mime = [MimeSGD([w], lr=LR, momentum=0.5, correction=c, **full) for c in (True, False)]
    with pytest.raises(VectorizationUnsupportedError, match="correction"):
        make_batched_rule(mime, [w], None, cpu)
