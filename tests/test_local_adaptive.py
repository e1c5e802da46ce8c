"""Local AdaAlter (Xie et al. 2019) and Local AMSGrad (Chen et al. 2020): agreement with plain-PyTorch float64 reference
loops (models and server statistics), the client steps by hand, parameter order, resume, refused configurations and
execution modes."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, LocalAdaAlter, LocalAMSGrad
from fedlightning.datamodules import Dirichlet
from fedlightning.models import LogisticRegression
from fedlightning.optim import AdaAlterClient, AMSGradClient
from fedlightning.state import flat_params
from numerics import Digits64, assert_close64, to_float64
from test_resume import run_resume_equivalence
from test_strategies import Recorder

K, CPR, SEED, ROUNDS = 3, 4, 3, 3
ADAALTER = dict(lr=0.3, eps=0.5)
AMSGRAD = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-3)


def make_dm():
    return Digits64(num_clients=12, batch_size=16, partition=Dirichlet(0.5), seed=2)


def make_model():
    torch.manual_seed(1)
    return to_float64(LogisticRegression(input_dim=64, num_classes=10))


def run(strategy, opt, rounds=ROUNDS, execution="sequential", extra=(), accelerator="cpu", **loop_args):
    loop_args = {"local_steps": K, **loop_args}
    loop = FederatedLoop(
        make_model(), client_optimizer=opt, clients_per_round=CPR, seed=SEED, client_execution=execution, **loop_args
    )
    trainer = make_trainer(rounds, callbacks=[strategy, *extra], accelerator=accelerator)
    trainer.fit(loop, datamodule=make_dm())
    return loop


def weights(loop):
    return flat_params(loop.global_parameters())


# ============================================================================ plain-PyTorch references (float64)
def reference(client_step, server_init, server_sync, weighting="uniform", rounds=ROUNDS):
    """Rounds of local steps ``client_step(k, y, g, client_stats, server) -> y`` from the server's statistics and a
    weighted average of models and client statistics (``server_sync(server, mean_client_stats)``)."""
    dm = make_dm()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    net = make_model().net
    names = [n for n, _ in net.named_parameters()]
    f = lambda w, x: torch.func.functional_call(net, dict(zip(names, w)), (x,))  # noqa: E731
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    x_server = flat(p.detach().clone() for p in net.parameters())
    shapes = [p.shape for p in net.parameters()]

    def grad(y, bx, by):
        parts, o = [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            parts.append(y[o : o + n].view(s))
            o += n
        w = [t.detach().clone().requires_grad_(True) for t in parts]
        return flat(torch.autograd.grad(F.cross_entropy(f(w, bx), by), w))

    server = server_init(x_server)
    for r in range(rounds):
        ys, stats, ws = [], [], []
        for k in dm.sample_clients(r):
            y, it = x_server.clone(), iter(dm.client_dataloader(k, r, seed=SEED))
            own = None
            for step in range(1, K + 1):
                try:
                    bx, by = next(it)
                except StopIteration:
                    it = iter(dm.client_dataloader(k, r, seed=SEED))
                    bx, by = next(it)
                y, own = client_step(step, y, grad(y, bx, by), own, server)
            ys.append(y)
            stats.append(own)
            ws.append(float(dm.client_num_samples(k)) if weighting == "samples" else 1.0)
        total = sum(ws)
        x_server = sum(w * y for w, y in zip(ws, ys)) / total
        means = {key: sum(w * s[key] for w, s in zip(ws, stats)) / total for key in stats[0]}
        server = server_sync(server, means)
    return x_server, server


def adaalter_reference(weighting="uniform", initial=0.0):
    lr, eps = ADAALTER["lr"], ADAALTER["eps"]

    def step(k, y, g, own, server):
        own = own or {"increment": torch.zeros_like(y)}
        y = y - lr * g / torch.sqrt(server["accumulator"] + k * eps * eps)  # B² frozen, k ε² the placeholder
        return y, {"increment": own["increment"] + g * g}

    return reference(
        step,
        lambda x: {"accumulator": torch.full_like(x, initial)},
        lambda server, mean: {"accumulator": server["accumulator"] + mean["increment"]},
        weighting,
    )


def amsgrad_reference():
    lr, (b1, b2), eps = AMSGRAD["lr"], AMSGRAD["betas"], AMSGRAD["eps"]

    def step(k, y, g, own, server):
        own = own or {"m": server["m"].clone(), "v": server["v"].clone()}
        m = b1 * own["m"] + (1 - b1) * g
        v = b2 * own["v"] + (1 - b2) * g * g
        return y - lr * m / torch.sqrt(torch.clamp(server["vhat"], min=eps)), {"m": m, "v": v}  # v̂ frozen

    def sync(server, mean):
        return {"m": mean["m"], "v": mean["v"], "vhat": torch.maximum(server["vhat"], mean["v"])}

    return reference(step, lambda x: {k: torch.zeros_like(x) for k in ("m", "v", "vhat")}, sync)


@pytest.mark.numerics
@pytest.mark.parametrize("weighting,initial", [("uniform", 0.0), ("samples", 0.5)])
def test_local_adaalter_matches_reference_loop(weighting, initial):
    s, rec = LocalAdaAlter(initial_accumulator=initial, weighting=weighting), Recorder()
    loop = run(s, lambda p: AdaAlterClient(p, **ADAALTER), extra=[rec])
    ref_x, ref_server = adaalter_reference(weighting, initial)
    assert_close64(weights(loop), ref_x)
    assert_close64(s.statistics["accumulator"], ref_server["accumulator"])
    assert float(ref_server["accumulator"].max()) > initial
    assert rec.metrics[-1]["server/accumulator_max"] == pytest.approx(float(ref_server["accumulator"].max()))


@pytest.mark.numerics
def test_local_amsgrad_matches_reference_loop():
    s, rec = LocalAMSGrad(), Recorder()
    loop = run(s, lambda p: AMSGradClient(p, **AMSGRAD), extra=[rec])
    ref_x, ref = amsgrad_reference()
    assert_close64(weights(loop), ref_x)
    assert_close64(s.statistics["exp_avg"], ref["m"])
    assert_close64(s.statistics["exp_avg_sq"], ref["v"])
    assert_close64(s.statistics["max_exp_avg_sq"], ref["vhat"])
    assert rec.metrics[-1]["server/second_moment_max"] == pytest.approx(float(ref["vhat"].max()))
    fedavg = run(FedAvg(weighting="uniform"), lambda p: torch.optim.SGD(p, lr=AMSGRAD["lr"]))
    assert not torch.allclose(weights(loop), weights(fedavg), atol=1e-4)


# ============================================================================ client steps by hand
def test_adaalter_client_step_by_hand():
    w = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    opt = AdaAlterClient([w], lr=0.5, eps=2.0)
    opt.set_server_state({"accumulator": [torch.tensor([12.0, 0.0], dtype=torch.float64)]})
    b2 = torch.tensor([12.0, 0.0], dtype=torch.float64)
    for k, g in enumerate([[2.0, 3.0], [-1.0, 1.0]], start=1):
        before = w.detach().clone()
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        assert_close64(w.detach(), before - 0.5 * w.grad / torch.sqrt(b2 + 4.0 * k))  # y − η g / √(B² + k ε²)
    (inc,) = opt.client_report()["adaalter_accumulator_increment"]
    assert_close64(inc, torch.tensor([5.0, 10.0], dtype=torch.float64))
    opt.set_server_state({"accumulator": [torch.zeros(2, dtype=torch.float64)]})  # a new round: k and Σg² restart
    assert opt.local_steps == 0 and float(opt.client_report()["adaalter_accumulator_increment"][0].abs().sum()) == 0


def test_amsgrad_client_step_by_hand():
    w = torch.nn.Parameter(torch.tensor([0.0, 0.0], dtype=torch.float64))
    opt = AMSGradClient([w], lr=0.1, betas=(0.5, 0.75), eps=0.01)
    m0, v0, vhat = (torch.tensor(t, dtype=torch.float64) for t in ([1.0, 0.0], [4.0, 0.0], [16.0, 0.0]))
    opt.set_server_state({"exp_avg": [m0], "exp_avg_sq": [v0], "max_exp_avg_sq": [vhat]})
    w.grad = torch.tensor([2.0, 1.0], dtype=torch.float64)
    opt.step()
    m = 0.5 * m0 + 0.5 * w.grad
    v = 0.75 * v0 + 0.25 * w.grad**2
    assert_close64(w.detach(), -0.1 * m / torch.sqrt(torch.tensor([16.0, 0.01], dtype=torch.float64)))
    report = opt.client_report()
    assert_close64(report["amsgrad_exp_avg"][0], m)
    assert_close64(report["amsgrad_exp_avg_sq"][0], v)
    assert torch.equal(m0, torch.tensor([1.0, 0.0], dtype=torch.float64))  # the server's tensors are not written


def test_parameter_groups_in_another_order_give_the_same_run():
    """The statistics are matched to the optimizer's parameters by identity, not by position."""

    def reversed_groups(p):
        return AdaAlterClient([{"params": [q]} for q in reversed(list(p))], **ADAALTER)

    a = run(LocalAdaAlter(), lambda p: AdaAlterClient(p, **ADAALTER))
    b = run(LocalAdaAlter(), reversed_groups)
    assert_close64(weights(b), weights(a))


# ============================================================================ resume, configuration, execution
@pytest.mark.parametrize(
    "strategy,opt",
    [
        (LocalAdaAlter, lambda p: AdaAlterClient(p, lr=0.1)),
        (LocalAMSGrad, lambda p: AMSGradClient(p, lr=0.01)),
    ],
    ids=["adaalter", "amsgrad"],
)
@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_resume_equals_an_uninterrupted_run(tmp_path, strategy, opt, execution):
    """The server's statistics and the clients' optimizer state come back from the checkpoint: the resumed run's
    weights are the uninterrupted run's bit for bit, with either execution mode."""
    full, resumed, loop = run_resume_equivalence(tmp_path, strategy, opt, total=4, cut=2, client_execution=execution)
    assert (loop.vectorized_engine is not None) == (execution == "vectorized")
    assert torch.equal(full, resumed)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: LocalAdaAlter(initial_accumulator=-1.0), "initial_accumulator"),
        (lambda: LocalAdaAlter(weighting="none"), "weighting"),
        (lambda: LocalAMSGrad(weighting="none"), "weighting"),
        (lambda: AdaAlterClient([torch.nn.Parameter(torch.ones(1))], lr=0.0), "lr"),
        (lambda: AdaAlterClient([torch.nn.Parameter(torch.ones(1))], eps=-1.0), "eps"),
        (lambda: AMSGradClient([torch.nn.Parameter(torch.ones(1))], betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda: AMSGradClient([torch.nn.Parameter(torch.ones(1))], betas=(-0.1, 0.9)), r"betas\[0\]"),
        (lambda: AMSGradClient([torch.nn.Parameter(torch.ones(1))], eps=0.0), "eps"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "strategy,opt,wanted",
    [
        (LocalAdaAlter, lambda p: torch.optim.SGD(p, lr=0.1), "AdaAlterClient"),
        (LocalAMSGrad, lambda p: AdaAlterClient(p), "AMSGradClient"),
    ],
)
def test_another_client_optimizer_is_refused(strategy, opt, wanted):
    with pytest.raises(TypeError, match="model.client_optimizer") as err:
        run(strategy(), opt, rounds=1)
    assert wanted in str(err.value)


CLIENTS = {
    "adaalter": (LocalAdaAlter, lambda p: AdaAlterClient(p, **ADAALTER), ("accumulator",)),
    "amsgrad": (LocalAMSGrad, lambda p: AMSGradClient(p, **AMSGRAD), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(CLIENTS))
@pytest.mark.parametrize(
    "loop_args",
    [{}, {"client_grad_clip": 0.05}, {"local_steps": None, "local_epochs": 1.0}],
    ids=["plain", "grad-clip", "ragged-steps"],
)
def test_vectorized_clients_train_as_sequential_ones(name, loop_args):
    """The batched forms (vectorized/rules.py) give the sequential run's global weights and server statistics in
    float64: the statistics are built from every client's report, so a client whose state the batched step left
    wrong (a finished client's moments moved on with ragged step counts, a step count off by one in AdaAlter's
    placeholder) changes them. Gradient clipping, and ragged step counts (one local epoch: 1 to 5 steps per client
    here), included."""
    strategy, opt, keys = CLIENTS[name]
    seq, vec = strategy(), strategy()
    a = run(seq, opt, **loop_args)
    b = run(vec, opt, execution="vectorized", **loop_args)
    assert_close64(weights(b), weights(a))
    for key in keys:
        assert_close64(vec.statistics[key], seq.statistics[key], msg=key)
    moved = weights(a) - flat_params(make_model().parameters())
    assert float(moved.abs().max()) > 1e-3  # the runs trained


class Device(pl.Callback):
    """The device type the model trains on (Lightning moves it back to the CPU when ``fit`` ends)."""

    def on_train_start(self, trainer, pl_module):
        self.seen = next(pl_module.parameters()).device.type


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_vectorized_clients_on_cuda_train_as_sequential_ones(name):
    """On a GPU the batched forms keep the server's statistics and the clients' rows on the device: float64
    vectorized equals float64 sequential on the same GPU and the CPU run, ragged step counts included."""
    strategy, opt, keys = CLIENTS[name]
    seq, vec, cpu = strategy(), strategy(), strategy()
    ragged = {"local_steps": None, "local_epochs": 1.0}
    where = Device()
    a = run(seq, opt, accelerator="gpu", **ragged)
    b = run(vec, opt, execution="vectorized", accelerator="gpu", extra=[where], **ragged)
    c = run(cpu, opt, **ragged)
    assert where.seen == "cuda"
    assert_close64(weights(b).cpu(), weights(a).cpu())
    assert_close64(weights(b).cpu(), weights(c))
    for key in keys:
        assert_close64(vec.statistics[key].cpu(), seq.statistics[key].cpu(), msg=key)


def test_vectorized_clients_step_counts_and_reports_with_ragged_steps():
    """With ragged step counts the clients' reports (the statistics the server averages) match sequential training
    client by client, and the optimizers' step counts are each client's own."""
    reports = {}
    for mode in ("sequential", "vectorized"):
        seen = []
        original = AMSGradClient.client_report

        def report(self, seen=seen, original=original):
            out = original(self)
            seen.append((self.local_steps, [t.detach().clone() for t in out["amsgrad_exp_avg_sq"]]))
            return out

        AMSGradClient.client_report = report
        try:
            opt = lambda p: AMSGradClient(p, **AMSGRAD)  # noqa: E731
            run(LocalAMSGrad(), opt, rounds=2, execution=mode, local_steps=None, local_epochs=1.0)
        finally:
            AMSGradClient.client_report = original
        reports[mode] = seen
    seq, vec = reports["sequential"], reports["vectorized"]
    assert len(seq) == len(vec) == 2 * CPR
    assert [n for n, _ in vec] == [n for n, _ in seq]
    assert len({n for n, _ in seq}) > 1  # the clients took different numbers of steps
    for (_, a), (_, b) in zip(seq, vec):
        for x, y in zip(b, a):
            assert_close64(x, y)


def test_vectorized_adaalter_clients_at_different_step_counts_are_refused():
    """Lockstep steps share AdaAlter's placeholder k: optimizers that start the round at different counts (not
    what LocalAdaAlter does) are refused with the counts, before any step is taken."""
    from fedlightning.vectorized import VectorizationUnsupportedError, make_batched_rule

    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opts = [AdaAlterClient([w], **ADAALTER) for _ in range(2)]
    opts[1].local_steps = 2
    rule = make_batched_rule(opts, [w], None, torch.device("cpu"))

    class Ev:
        def gradient(self, W, alive, flat=True):
            return torch.zeros(2, dtype=W.dtype), torch.ones_like(W)

        def views(self, W):
            return [W]

    with pytest.raises(VectorizationUnsupportedError, match=r"\[0, 2\]"):
        rule.step(torch.zeros(2, 3, dtype=torch.float64), Ev(), None, torch.ones(2, dtype=torch.bool))


def test_load_client_statistics_sets_the_report_and_refuses_bad_input():
    """What a batched form writes back (``load_client_statistics``) is what ``client_report`` then sends, copied; the
    frozen statistic, a wrong count or shape, and a bad step count are refused by name."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = AMSGradClient([w], **AMSGRAD)
    m, v = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float64)
    opt.load_client_statistics({"exp_avg": [m], "exp_avg_sq": [v]}, local_steps=5)
    report = opt.client_report()
    assert torch.equal(report["amsgrad_exp_avg"][0], m) and torch.equal(report["amsgrad_exp_avg_sq"][0], v)
    assert opt.local_steps == 5
    m.add_(1.0)  # the optimizer holds a copy
    assert float(opt.client_report()["amsgrad_exp_avg"][0][0]) == 1.0
    assert torch.equal(opt.client_statistics()["exp_avg_sq"][0], v)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        opt.load_client_statistics({"max_exp_avg_sq": [v]}, local_steps=1)
    with pytest.raises(ValueError, match="2 tensors for 1 parameters"):
        opt.load_client_statistics({"exp_avg": [m, m]}, local_steps=1)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        opt.load_client_statistics({"exp_avg": [torch.zeros(3, dtype=torch.float64)]}, local_steps=1)
    with pytest.raises(ValueError, match="local_steps"):
        opt.load_client_statistics({"exp_avg": [torch.zeros(2, dtype=torch.float64)]}, local_steps=-1)
    assert float(opt.client_report()["amsgrad_exp_avg"][0][0]) == 1.0 and opt.local_steps == 5  # nothing written
