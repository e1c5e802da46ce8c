"""FedDANE and SCAFFOLD: hand-computed control-variate updates, exact reductions (FedDANE -> FedProx -> FedAvg,
SCAFFOLD with zero variates -> FedAvg), agreement with plain-PyTorch reference loops, the full-batch gradient, and
FedDANE's one-step analytic case (every client moves along g_t). Models and data are float64, so the references,
which sum in other orders, agree to rounding (numerics.RTOL64)."""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FedDANE, FedLiLS, FedSPSNormalized, ProximalTerm, Scaffold
from fedlightning.callbacks.feddane import client_full_gradient
from fedlightning.datamodules import Dirichlet
from fedlightning.models import MLP, LogisticRegression
from fedlightning.state import RoundPlan, derive_seed
from numerics import Digits64, assert_close64, to_float64
from registry import STRATEGIES, params
from test_strategies import Recorder, assert_vec, server_round, setup_rule, upd, weights

LR, K, CPR, SEED, ROUNDS = 0.2, 3, 4, 3, 3


def make_dm(batch_size=16):
    return Digits64(num_clients=12, batch_size=batch_size, partition=Dirichlet(0.5), seed=2)


def make_model(kind="logreg", model_seed=1):
    torch.manual_seed(model_seed)
    if kind == "mlp":
        return to_float64(MLP(input_dim=64, hidden=[16], num_classes=10, dropout=0.3))
    return to_float64(LogisticRegression(input_dim=64, num_classes=10))


def run(
    callbacks,
    rounds=ROUNDS,
    kind="logreg",
    cpr=CPR,
    local_steps=K,
    batch_size=16,
    lr=LR,
    execution="sequential",
    model=None,
    **loop_args,
):
    loop = FederatedLoop(
        model or make_model(kind),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        local_steps=local_steps,
        clients_per_round=cpr,
        seed=SEED,
        client_execution=execution,
        **loop_args,
    )
    trainer = make_trainer(rounds, callbacks=callbacks)
    trainer.fit(loop, datamodule=make_dm(batch_size))
    return loop, trainer


# ============================================================================ plain-PyTorch references
def _functional(net):
    names = [n for n, _ in net.named_parameters()]
    return lambda w, x: torch.func.functional_call(net, dict(zip(names, w)), (x,))


def _grad(f, w, x, y):
    wr = [t.detach().clone().requires_grad_(True) for t in w]
    return [g.detach() for g in torch.autograd.grad(F.cross_entropy(f(wr, x), y), wr)]


def _client_data(dm, k):
    idx = torch.as_tensor(dm.client_indices[k])
    return dm.train_dataset.x[idx], dm.train_dataset.y[idx]


def _local_sgd(f, w0, loader, steps, lr, extra):
    """``steps`` SGD steps on the batch loss plus an explicit extra gradient ``extra(w)`` (cycling the loader)."""
    w, it = [t.clone() for t in w0], iter(loader)
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        g = _grad(f, w, x, y)
        e = extra(w)
        lrs = lr if isinstance(lr, list) else [lr] * len(w)  # per parameter
        w = [wi - li * (gi + ei) for wi, li, gi, ei in zip(w, lrs, g, e)]
    return w


def _setup(dm):
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    model = make_model()
    return _functional(model.net), [p.detach().clone() for p in model.net.parameters()]


def reference_feddane(mu, mode, rounds=ROUNDS, faulty=frozenset()):
    """FedDANE written out with plain tensors; the clients of ``faulty`` (whose every loss is NaN) are left out of
    ``g_t`` and of the average."""
    dm = make_dm()
    f, glob = _setup(dm)
    eligible = [k for k in range(dm.num_clients) if dm.client_num_samples(k) > 0]
    grad_sets = []
    for r in range(rounds):
        clients = dm.sample_clients(r)
        if mode == "same":
            grad_set = list(clients)
        else:
            gen = torch.Generator().manual_seed(derive_seed(SEED, "feddane", r))
            grad_set = [eligible[i] for i in torch.randperm(len(eligible), generator=gen)[:CPR].tolist()]
        grad_sets.append(grad_set)
        grads = {k: _grad(f, glob, *_client_data(dm, k)) for k in set(grad_set) | set(clients)}
        used = [k for k in grad_set if k not in faulty]
        g = [sum(grads[k][j] for k in used) / len(used) for j in range(len(glob))]
        new = []
        for k in (k for k in clients if k not in faulty):
            corr = [g[j] - grads[k][j] for j in range(len(glob))]
            loader = dm.client_dataloader(k, r, seed=SEED)
            new.append(
                _local_sgd(
                    f,
                    glob,
                    loader,
                    K,
                    LR,
                    lambda w, corr=corr, glob=glob: [c + mu * (wi - gi) for c, wi, gi in zip(corr, w, glob)],
                )
            )
        if new:
            glob = [sum(w[j] for w in new) / len(new) for j in range(len(glob))]
    return glob, grad_sets


def reference_scaffold(rounds=ROUNDS, lrs=None):
    """SCAFFOLD option II; ``lrs``: a learning rate per parameter (weight, bias), each parameter's ``c_i`` updated
    over its own ``K η`` and kept where ``η = 0``."""
    dm = make_dm()
    f, glob = _setup(dm)
    zeros = lambda: [torch.zeros_like(t) for t in glob]  # noqa: E731
    c, ci = zeros(), {}
    for r in range(rounds):
        deltas, dcs = [], []
        for k in dm.sample_clients(r):
            cik = ci.get(k, zeros())
            loader = dm.client_dataloader(k, r, seed=SEED)
            lr = lrs or [LR] * len(glob)
            w = _local_sgd(f, glob, loader, K, lr, lambda w, c=c, cik=cik: [cj - cij for cj, cij in zip(c, cik)])
            delta = [g - wi for g, wi in zip(glob, w)]
            cnew = [cij - cj + d / (K * li) if li > 0 else cij for cij, cj, d, li in zip(cik, c, delta, lr)]
            dcs.append([a - b for a, b in zip(cnew, cik)])
            ci[k] = cnew
            deltas.append(delta)
        glob = [g - sum(d[j] for d in deltas) / len(deltas) for j, g in enumerate(glob)]
        holding = sum(1 for k in range(dm.num_clients) if dm.client_num_samples(k) > 0)  # N
        c = [cj + sum(d[j] for d in dcs) / holding for j, cj in enumerate(c)]
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return flat(glob), flat(c), {k: flat(v) for k, v in ci.items()}


def test_scaffold_server_control_is_the_mean_over_the_clients_that_hold_data():
    """With clients left empty by the split (never sampled, ``c_i = 0`` for ever), ``c = (1/N) Σ_i c_i`` over the
    ``N`` clients that hold data: the invariant the server step keeps, checked against the stored ``c_i``."""
    dm = Digits64(num_clients=20, batch_size=16, partition=Dirichlet(0.02, min_samples=0), seed=2)
    dm.setup("fit")
    holding = sum(1 for k in range(dm.num_clients) if dm.client_num_samples(k) > 0)
    assert CPR <= holding < dm.num_clients  # some clients are empty
    assert dm.clients_with_data().tolist() == [k for k in range(20) if dm.client_num_samples(k) > 0]
    s = Scaffold()
    loop = FederatedLoop(
        make_model(),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        local_steps=K,
        clients_per_round=CPR,
        seed=SEED,
    )
    make_trainer(4, callbacks=[s]).fit(loop, datamodule=dm)
    stored = [loop.client_state.get("scaffold", k)["control"] for k in loop.client_state.clients("scaffold")]
    assert len(stored) > CPR and float(s.server_control.norm()) > 0
    assert_close64(s.server_control, sum(stored) / holding)


# ============================================================================ FedDANE
def test_feddane_without_correction_is_fedprox_and_with_mu_zero_fedavg_exactly():
    a, _ = run([FedDANE(mu=0.3, correction=False)])
    b, _ = run([FedAvg(weighting="uniform"), ProximalTerm(0.3)])
    assert torch.equal(weights(a), weights(b))
    c, _ = run([FedDANE(mu=0.0, correction=False)])
    d, _ = run([FedAvg(weighting="uniform")])
    assert torch.equal(weights(c), weights(d))
    assert not torch.equal(weights(a), weights(c))  # μ matters


def test_feddane_gradient_phase_leaves_the_run_untouched_when_the_correction_vanishes():
    """One client per round, S_t = S'_t: g_t = ∇F_k(w_t), the correction is exactly 0, so FedDANE == FedProx bit
    for bit even with dropout — the gradient phase perturbs neither weights, RNG streams nor logged client metrics."""
    rec = Recorder()
    a, ta = run([FedDANE(mu=0.3, gradient_clients="same"), rec], kind="mlp", cpr=1)
    b, tb = run([FedAvg(weighting="uniform"), ProximalTerm(0.3)], kind="mlp", cpr=1)
    assert torch.equal(weights(a), weights(b))
    key = "client/train/batch_loss"
    assert float(ta.callback_metrics[key]) == float(tb.callback_metrics[key])
    assert all(m["feddane/gradient_norm"] > 0 for m in rec.metrics)  # the gradient phase did run


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["independent", "same"])
def test_feddane_matches_reference_loop(mode):
    rec = Recorder()
    loop, _ = run([FedDANE(mu=0.1, gradient_clients=mode), rec])
    ref, grad_sets = reference_feddane(mu=0.1, mode=mode)
    got = list(loop.model.net.parameters())
    for g, r in zip(got, ref):
        assert_close64(g.detach(), r)
    assert [p.extras["feddane_gradient_clients"] for p in rec.plans] == grad_sets
    assert [m["round/communication_rounds"] for m in rec.metrics] == [2.0, 4.0, 6.0]
    if mode == "same":
        assert all(p.extras["feddane_gradient_clients"] == p.client_ids for p in rec.plans)
    else:
        assert any(p.extras["feddane_gradient_clients"] != p.client_ids for p in rec.plans)
    plain, _ = run([FedAvg(weighting="uniform"), ProximalTerm(0.1)])
    assert not torch.allclose(weights(loop), weights(plain), atol=1e-4)  # the correction changes the run


def test_feddane_one_full_batch_step_moves_every_client_along_g_t():
    """K = 1 full-batch step: ∇h_k(w_t) = ∇F_k(w_t) + g_t − ∇F_k(w_t) = g_t, so w_1 = w_0 − lr·g_t exactly."""
    rec = Recorder()
    run([FedDANE(mu=0.5), rec], rounds=1, local_steps=1, batch_size=10_000)
    dm = make_dm(10_000)
    dm.setup("fit")
    f, w0 = _setup(dm)
    grad_set = rec.plans[0].extras["feddane_gradient_clients"]
    g = torch.stack([torch.cat([t.reshape(-1) for t in _grad(f, w0, *_client_data(dm, k))]) for k in grad_set]).mean(0)
    assert_close64(rec.after[0], rec.before[0] - LR * g)
    for u in rec.updates[0]:
        assert_close64(u.delta, LR * g)


class CountsSamples(MLP):
    """Counts the samples of its training steps in a torchmetrics sum (logged as client/seen)."""

    def __init__(self):
        super().__init__(input_dim=64, hidden=[8], num_classes=10)
        import torchmetrics

        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        self.seen.update(torch.tensor(float(len(batch[1]))))
        self.log("seen", self.seen)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
@pytest.mark.parametrize("gradient_clients", ["independent", "same"])
def test_the_gradient_phase_leaves_the_modules_torchmetrics_as_the_local_steps_left_them(gradient_clients, execution):
    """FedDANE's full gradients run training_step over every sample of the gradient clients: a torchmetrics metric it
    updates must count the round's local steps only, the count of the same run under FedAvg (the same clients and
    batches)."""

    def seen(strategy):
        torch.manual_seed(0)
        model = to_float64(CountsSamples())
        loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=1, client_execution=execution)
        trainer = make_trainer(2, callbacks=[strategy])
        trainer.fit(loop, datamodule=make_dm())
        return float(trainer.callback_metrics["client/seen"])

    expected = seen(FedAvg())
    assert expected == 3 * 2 * 16  # three clients, two steps of 16 samples (round 1's own count: reset per round)
    assert seen(FedDANE(mu=0.1, gradient_clients=gradient_clients)) == expected


@pytest.mark.parametrize("chunk", [None, 5])
def test_client_full_gradient_is_the_mean_loss_gradient_over_all_samples(chunk):
    loop, trainer = run([FedAvg()], rounds=1)
    dm = trainer.datamodule
    before = weights(loop).clone()
    k = max(range(dm.num_clients), key=dm.client_num_samples)
    got = client_full_gradient(loop, k, round=0, batch_size=chunk)
    f = _functional(loop.model.net)
    ref = torch.cat([t.reshape(-1) for t in _grad(f, list(loop.model.net.parameters()), *_client_data(dm, k))])
    assert_close64(got, ref)
    assert torch.equal(weights(loop), before)


class ScaledAfterSteps(MLP):
    """Scales its logits by a parameter that does not train, which it doubles after every local step."""

    def __init__(self):
        super().__init__(input_dim=64, hidden=[8], num_classes=10)
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        return super().forward(x) * self.scale

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            self.scale.mul_(2.0)


def test_client_full_gradient_starts_from_the_global_values_of_the_parameters_that_do_not_train():
    """After local training doubled the working copy's frozen scale, a client's full gradient is still the one at
    the global model: its scale (1) included, as every client's training starts from it."""
    torch.manual_seed(0)
    loop = FederatedLoop(
        to_float64(ScaledAfterSteps()),
        client_optimizer=lambda p: torch.optim.SGD(p, lr=LR),
        local_steps=K,
        clients_per_round=CPR,
        seed=SEED,
    )
    with pytest.warns(UserWarning, match="requires_grad=False"):
        make_trainer(1).fit(loop, datamodule=make_dm())
    assert float(loop.model.scale) == 1.0 and float(loop.client_worker.model.scale) == 2.0**K
    dm = loop.datamodule
    k = max(range(dm.num_clients), key=dm.client_num_samples)
    got = client_full_gradient(loop, k, round=0)
    reference = copy.deepcopy(loop.model)
    x, y = _client_data(dm, k)
    F.cross_entropy(reference(x), y).backward()
    assert_close64(got, torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.requires_grad]))


# ============================================================================ SCAFFOLD
def test_scaffold_control_variates_by_hand():
    s = Scaffold(server_lr=1.0)
    loop, opt = setup_rule(s, [1.0, 1.0])
    loop.num_clients = 4
    plan = RoundPlan(0, [0], 1)
    # round 0, c = c_0 = 0: the correction term is zero
    (term,) = s.client_objective(None, loop, plan, 0)
    p = torch.tensor([3.0, -1.0], dtype=torch.float64, requires_grad=True)
    term([p]).backward()
    assert_vec(p.grad, [0.0, 0.0])
    u = upd(0, [0.2, 0.4], step_sizes=[0.1, 0.1])
    s.on_client_end(None, loop, plan, u)
    # c_0+ = c_0 − c + Δ/(Kη) = [0.2, 0.4]/0.2 = [1, 2], stored when the round admits the client (accumulate)
    assert loop.client_state.get("scaffold", 0) is None
    assert_vec(u.payload["scaffold_control_delta"], [1.0, 2.0])
    server_round(s, loop, opt, [u])
    assert_vec(loop.client_state.get("scaffold", 0)["control"], [1.0, 2.0])
    assert_vec(s.server_control, [0.25, 0.5])  # c += Σ Δc_i / N, N = 4
    assert_vec(loop.w, [0.8, 0.6])  # w − η_g Δ
    # round 1, client 0 again: the term's gradient is c − c_0 = [−0.75, −1.5], and it is zero at w_t
    (term,) = s.client_objective(None, loop, RoundPlan(1, [0], 1), 0)
    p = loop.w.detach().clone().requires_grad_(True)
    value = term([p])
    assert float(value.detach()) == 0.0
    value.backward()
    assert_vec(p.grad, [-0.75, -1.5])
    u = upd(0, [0.1, 0.0], step_sizes=[0.05, 0.05])
    s.on_client_end(None, loop, RoundPlan(1, [0], 1), u)
    server_round(s, loop, opt, [u], round=1)
    assert_vec(loop.client_state.get("scaffold", 0)["control"], [1.0 - 0.25 + 1.0, 2.0 - 0.5 + 0.0])
    # a client without positive step sizes cannot form option II: it is marked failed, its variate untouched
    bad = upd(1, [0.1, 0.0], step_sizes=[0.0])
    s.on_client_end(None, loop, RoundPlan(1, [1], 1), bad)
    assert bad.failed and "step sizes" in bad.failure and loop.client_state.get("scaffold", 1) is None


def test_scaffold_first_round_with_zero_variates_equals_fedavg_exactly():
    a, _ = run([Scaffold()], rounds=1)
    b, _ = run([FedAvg(weighting="uniform")], rounds=1)
    assert torch.equal(weights(a), weights(b))
    c, _ = run([Scaffold()], rounds=2)
    d, _ = run([FedAvg(weighting="uniform")], rounds=2)
    assert not torch.equal(weights(c), weights(d))  # from round 2 on the control variates act


@pytest.mark.numerics
def test_scaffold_matches_reference_loop():
    s = Scaffold()
    loop, _ = run([s])
    glob, c, ci = reference_scaffold()
    assert_close64(weights(loop), glob)
    assert_close64(s.server_control, c)
    assert sorted(loop.client_state.clients("scaffold")) == sorted(ci)
    for k, v in ci.items():
        assert_close64(loop.client_state.get("scaffold", k)["control"], v)
    assert float(c.norm()) > 0


@pytest.mark.numerics
@pytest.mark.parametrize("bias_lr", [0.05, 0.0])
def test_scaffold_divides_each_parameter_by_its_own_groups_learning_rates(bias_lr):
    """A client optimizer with a learning rate per parameter group (weight 0.2, bias 0.05 or 0, a group frozen by
    its rate): each parameter's c_i is its update over its own K·η, and a parameter that did not move keeps its c_i,
    against the reference loop; the runs with FedSPS-Normalized or FedLiLS stop naming the groups' rates."""

    def grouped(params):
        weight, bias = params
        return torch.optim.SGD([{"params": [weight], "lr": LR}, {"params": [bias], "lr": bias_lr}])

    def fit(callbacks, rounds=ROUNDS):
        loop = FederatedLoop(
            make_model(), client_optimizer=lambda p: grouped(list(p)), local_steps=K, clients_per_round=CPR, seed=SEED
        )
        make_trainer(rounds, callbacks=callbacks).fit(loop, datamodule=make_dm())
        return loop

    s = Scaffold()
    loop = fit([s])
    glob, c, ci = reference_scaffold(lrs=[LR, bias_lr])
    assert_close64(weights(loop), glob)
    assert_close64(s.server_control, c)
    for k, v in ci.items():
        assert_close64(loop.client_state.get("scaffold", k)["control"], v)
    bias = slice(-10, None)  # the logistic regression's last 10 parameters
    assert (float(c[bias].norm()) == 0.0) == (bias_lr == 0.0) and float(c[:-10].norm()) > 0
    for strategy in (FedSPSNormalized(), FedLiLS()):
        with pytest.raises(ValueError, match="parameter groups took different learning rates"):
            fit([strategy], rounds=1)


# ============================================================================ vectorised clients, |S_t| option
@pytest.mark.numerics
@pytest.mark.parametrize("make", params(STRATEGIES, "scaffold", "feddane"))
def test_objective_terms_work_with_vectorised_clients(make):
    """The correction terms are called on slices of the batched weights in vectorised mode: same result."""
    a, _ = run([make()])
    b, _ = run([make()], execution="vectorized")
    assert_close64(weights(b), weights(a))


def test_feddane_gradient_sample_size_option():
    rec = Recorder()
    run([FedDANE(mu=0.1, gradient_clients_per_round=2), rec], rounds=2)
    assert all(len(p.extras["feddane_gradient_clients"]) == 2 for p in rec.plans)
    assert all(m["feddane/gradient_clients"] == 2.0 for m in rec.metrics)


# ============================================================================ bad arguments
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FedDANE(mu=-0.1), "mu"),
        (lambda: FedDANE(mu=float("nan")), "mu"),
        (lambda: FedDANE(gradient_clients="previous"), "gradient_clients"),
        (lambda: FedDANE(gradient_clients_per_round=0), "gradient_clients_per_round"),
        (lambda: FedDANE(gradient_batch_size=0), "gradient_batch_size"),
        (lambda: FedDANE(weighting="none"), "weighting"),
        (lambda: Scaffold(weighting="none"), "weighting"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_feddane_gradient_sample_larger_than_population_is_rejected():
    with pytest.raises(ValueError, match="gradient_clients_per_round"):
        run([FedDANE(gradient_clients_per_round=50)], rounds=1)


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_scaffold_keeps_the_control_variate_of_a_client_the_aggregation_checks_leave_out(execution):
    """on_client_end ran before the aggregation checks, so a client that max_update_norm left out stored its c_i⁺
    while its change never reached c: c = (1/N) Σ_i c_i (both start at 0) was off by 38 %. c_i⁺ is now stored when the
    client is admitted; the invariant holds in float64 and a client left out in every round it was sampled has no
    c_i."""
    import warnings

    from fedlightning.datamodules import DigitsDataModule

    torch.manual_seed(1)
    model = MLP(input_dim=64, hidden=[16], num_classes=10).double()
    loop = FederatedLoop(
        model, client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=5, clients_per_round=10, seed=3,
        max_update_norm=0.6, client_execution=execution,
    )  # fmt: skip
    scaffold, rec = Scaffold(), Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(2, callbacks=[scaffold, rec], precision="64-true").fit(
            loop, datamodule=DigitsDataModule(num_clients=24, batch_size=20, partition=Dirichlet(0.3), seed=0)
        )
    skipped = set()  # (round, client) left out by max_update_norm
    for w in caught:
        text = str(w.message)
        if "max_update_norm" in text:
            skipped.add((int(text.split("round ")[1].split(":")[0]), int(text.split("client ")[1].split()[0])))
    healthy = {u.client_id for r, ups in enumerate(rec.updates) for u in ups if (r, u.client_id) not in skipped}
    assert skipped and healthy
    stored = loop.client_state.state_dict()["scaffold"]
    assert set(stored) == healthy  # only admitted clients have a c_i
    mean_ci = sum(v["control"] for v in stored.values()) / 24
    c = scaffold.server_control
    assert float((c - mean_ci).norm()) <= 1e-12 * float(c.norm())


@pytest.mark.numerics
def test_a_first_parameter_group_of_frozen_parameters_does_not_set_the_step_size():
    """Group 0 holds only a frozen weight (lr 0.01), group 1 the trainable bias (lr 0.2): a step's size is the
    trainable group's learning rate in both modes (sequential recorded group 0's), so FedSPS-Normalized, which
    normalizes by the step sizes, runs (it was refused) and gives the same weights in both modes."""
    from fedlightning.callbacks import FederatedCallback

    class Sizes(FederatedCallback):
        def __init__(self):
            self.sizes = []

        def on_client_end(self, trainer, pl_module, plan, update):
            self.sizes.append(list(update.step_sizes))

    class FrozenFirst(LogisticRegression):
        def configure_optimizers(self):
            weight, bias = self.parameters()
            return torch.optim.SGD([{"params": [weight], "lr": 0.01}, {"params": [bias], "lr": LR}])

    runs = {}
    for execution in ("sequential", "vectorized"):
        torch.manual_seed(1)
        model = to_float64(FrozenFirst(input_dim=64, num_classes=10))
        next(model.parameters()).requires_grad_(False)
        sizes = Sizes()
        loop = FederatedLoop(model, local_steps=K, clients_per_round=CPR, seed=SEED, client_execution=execution)
        make_trainer(2, callbacks=[FedSPSNormalized(), sizes]).fit(loop, datamodule=make_dm())
        runs[execution] = (weights(loop), sizes.sizes)
    assert runs["sequential"][1] == runs["vectorized"][1] == [[LR] * K] * (2 * CPR)
    assert_close64(runs["vectorized"][0], runs["sequential"][0])


class _RaisesForOneSample(pl.LightningModule):
    """BatchNorm in training mode raises on a batch of one sample: a client whose full-data chunks end in one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _full_gradient_fit(strategy, policy, mode):
    from fedlightning.callbacks import Mime
    from fedlightning.datamodules import DigitsDataModule, Dirichlet

    dm = DigitsDataModule(num_clients=20, batch_size=8, partition=Dirichlet(0.3), seed=3)
    loop = FederatedLoop(_RaisesForOneSample(), client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=1,
                         clients_per_round=20, seed=3, on_client_error=policy, client_execution=mode)  # fmt: skip
    if strategy == "FedDANE":
        cb = FedDANE(mu=0.01, gradient_clients="same", gradient_batch_size=8)
    else:
        cb = Mime(momentum=0.9, gradient_batch_size=8)
    metrics = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = make_trainer(1, [cb, Record()])
    return trainer, loop, dm, metrics


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
@pytest.mark.parametrize("strategy", ["FedDANE", "Mime"])
def test_a_client_raising_in_the_full_gradient_phase_follows_on_client_error(strategy, mode):
    """The exception escaped bare (no round, no client) and on_client_error='skip' did not apply. Now 'raise' names
    the round, the client and the phase, and 'skip' leaves the raising clients out of the gradient mean: the mean
    counts exactly the clients whose chunks of 8 never leave one sample alone (vectorized: the batched call raises
    and the clients are computed one by one, which finds them)."""
    trainer, loop, dm, _ = _full_gradient_fit(strategy, "raise", mode)
    refused = r"^round 0: client \d+ raised ValueError: Expected more than 1 value per channel .*, in its full "
    with pytest.raises(RuntimeError, match=refused + r"gradient at the global weights \((feddane|mime)-gradient\)"):
        trainer.fit(loop, datamodule=dm)

    trainer, loop, dm, metrics = _full_gradient_fit(strategy, "skip", mode)
    with pytest.warns(UserWarning, match=r"round 0: client \d+ raised ValueError: .* it is left out"):
        trainer.fit(loop, datamodule=dm)
    lone = [k for k in range(20) if dm.client_num_samples(k) % 8 == 1]
    assert lone, "the split must hold a client whose last chunk is one sample"
    key = "feddane/gradient_clients" if strategy == "FedDANE" else "mime/gradient_clients"
    assert metrics[0][key] == 20 - len(lone)  # every client of the round is in S_t
    assert loop.full_gradient_errors(0) == frozenset(lone)
    assert torch.isfinite(torch.cat([p.reshape(-1) for p in loop.model.parameters()])).all()
