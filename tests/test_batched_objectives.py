"""Client objectives batched over clients (fedlightning.objectives.AnchoredTerm) and FedDANE's batched gradient phase.

* The batched term equals the per-client term (value and gradient, autograd of the per-client value) on random
  inputs: stacked anchors, shared anchors, per-client μ, clients without directions, row selection.
* Vectorised training equals sequential training in float64 (numerics.RTOL64) for FedProx, SCAFFOLD, FedExProx and
  FedDANE (both ``gradient_clients``), with SGD, momentum SGD and Adam clients; with ragged ``local_epochs``; and a
  user's plain-callable term still trains vectorised, its reason said once. float32 vectorised runs are within 1e-4
  of the sequential float32 ones.
* ``FederatedLoop.client_full_gradients`` (vectorised) equals ``client_full_gradient`` client by client, and a
  hand-written float64 full-batch gradient.
"""

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch

import fedlightning.loop as loop_module
from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FedDANE, FedExProx, ProximalTerm, Scaffold
from fedlightning.callbacks.feddane import client_full_gradient
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.objectives import AnchoredTerm
from fedlightning.vectorized import VectorizedClientTrainer
from numerics import RTOL64, Float64Inputs, assert_close64, to_float64
from registry import CLIENT_OPTIMIZERS

ROUNDS, CPR, K, BATCH = 2, 5, 4, 16


class Digits64(Float64Inputs, DigitsDataModule):
    """The digits with float64 inputs."""


def digits(float64=True, num_clients=30):
    cls = Digits64 if float64 else DigitsDataModule
    return cls(num_clients=num_clients, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)


def mlp(float64=True):
    torch.manual_seed(1)
    model = MLP(input_dim=64, hidden=[16], num_classes=10)
    return to_float64(model) if float64 else model


class Recorder(pl.Callback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)


def fit(strategy, optimizer, mode, float64=True, rounds=ROUNDS, extra=(), **loop_kwargs):
    """``(global weights, client updates, loop)`` after ``rounds`` rounds of ``strategy`` (a callback list)."""
    model = mlp(float64)
    rec = Recorder()
    loop_kwargs.setdefault("local_steps", None if "local_epochs" in loop_kwargs else K)
    loop = FederatedLoop(
        model,
        client_optimizer=CLIENT_OPTIMIZERS[optimizer],
        clients_per_round=CPR,
        seed=3,
        client_execution=mode,
        **loop_kwargs,
    )
    trainer = make_trainer(rounds, callbacks=[*copy.deepcopy(strategy), rec, *extra])
    trainer.fit(loop, datamodule=digits(float64))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), rec.updates, loop


STRATEGIES = {
    "fedprox": lambda: [FedAvg(), ProximalTerm(mu=0.5)],
    "scaffold": lambda: [Scaffold()],
    "fedexprox": lambda: [FedExProx(mu=0.5)],
    "feddane-independent": lambda: [FedDANE(mu=0.1)],
    "feddane-same": lambda: [FedDANE(mu=0.0, gradient_clients="same", weighting="samples")],
}


def assert_same(seq, vec, rtol=RTOL64):
    assert_close64(vec[0], seq[0], rtol)
    assert [u.client_id for u in vec[1]] == [u.client_id for u in seq[1]]
    for a, b in zip(seq[1], vec[1]):
        assert (a.num_steps, a.failed) == (b.num_steps, b.failed)
        assert_close64(b.delta, a.delta, rtol)
        for key in a.payload:
            value = a.payload[key]
            if isinstance(value, torch.Tensor):
                assert_close64(b.payload[key], value, rtol)


# ---------------------------------------------------------------------------------------------- the term itself
def _random_terms(C, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    terms = []
    for c in range(C):
        anchors = shared if c % 2 == 0 else [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        directions = None if c == 1 else [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        terms.append(AnchoredTerm(anchors, mu=[0.0, 0.3, 1.7, 0.3][c % 4], directions=directions))
    return terms


def _reference(params, term):
    """μ/2‖w − a‖² + ⟨c, w − a⟩ written out for one client, and its autograd gradient."""
    params = [p.detach().clone().requires_grad_(True) for p in params]
    value = sum(0.5 * term.mu * ((p - a) ** 2).sum() for p, a in zip(params, term.anchors))
    if term.directions is not None:
        value = value + sum((c * (p - a)).sum() for p, a, c in zip(params, term.anchors, term.directions))
    grads = torch.autograd.grad(value, params)
    return value.detach(), grads


def test_batched_term_equals_the_per_client_terms():
    shapes = [(3, 4), (4,), (2, 3, 2)]
    C = 6
    terms = _random_terms(C, shapes)
    batched = AnchoredTerm.stack(terms)
    assert not batched.shared_anchors and isinstance(batched.mu, torch.Tensor)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(C, *s, generator=g, dtype=torch.float64) for s in shapes]
    values, grads = batched.value_and_gradient(params)
    assert values.shape == (C,)
    for c, term in enumerate(terms):
        own = [p[c] for p in params]
        ref_value, ref_grads = _reference(own, term)
        assert_close64(values[c], ref_value)
        assert_close64(batched(params)[c], ref_value)
        assert_close64(term(own), ref_value)  # the one-client form
        for got, want in zip(grads, ref_grads):
            assert_close64(got[c], want)
        for got, want in zip(term.gradient(own), ref_grads):
            assert_close64(got, want)
    # rows of the batch (repeats allowed), as a line search's trial points select them
    index = torch.tensor([5, 0, 0, 3])
    picked = batched.rows(index)([p[index] for p in params])
    assert_close64(picked, values[index])
    # one client's term on rows: the same term for every row
    assert_close64(terms[0](params), torch.stack([_reference([p[c] for p in params], terms[0])[0] for c in range(C)]))


def test_stacking_shares_equal_anchors_and_mu():
    shapes = [(5,), (2, 2)]
    anchors = [torch.randn(s, dtype=torch.float64) for s in shapes]
    # new detached views of the same tensors count as the same anchors (global_anchors returns new views per call)
    terms = [AnchoredTerm([a.detach() for a in anchors], mu=0.2) for _ in range(3)]
    batched = AnchoredTerm.stack(terms)
    assert batched.shared_anchors and batched.mu == 0.2 and batched.directions is None
    params = [torch.randn(3, *s, dtype=torch.float64) for s in shapes]
    want = torch.stack([0.1 * sum(((p[c] - a) ** 2).sum() for p, a in zip(params, anchors)) for c in range(3)])
    assert_close64(batched(params), want)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(mu=-1.0), "mu"),
        (dict(mu=True), "mu"),
        (dict(directions=[torch.zeros(2)]), "directions"),
    ],
)
def test_bad_terms_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        AnchoredTerm([torch.zeros(3)], **bad)


def test_a_term_called_on_the_wrong_shapes_says_so():
    term = AnchoredTerm([torch.zeros(3)], mu=1.0)
    with pytest.raises(ValueError, match="shapes"):
        term([torch.zeros(4)])
    with pytest.raises(ValueError, match="rows"):
        AnchoredTerm.stack([term, term])([torch.zeros(3, 3)])


# ---------------------------------------------------------------------------------------------- in training
@pytest.mark.numerics
@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_vectorized_equals_sequential(name, optimizer):
    seq = fit(STRATEGIES[name](), optimizer, "sequential")
    vec = fit(STRATEGIES[name](), optimizer, "vectorized")
    assert_same(seq, vec)
    if optimizer == "sgd":  # the term changed training
        plain = fit([FedAvg()], optimizer, "vectorized")
        assert (vec[0] - plain[0]).abs().max() > 1e-4


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["fedprox", "scaffold", "feddane-independent"])
def test_ragged_local_epochs_equal_sequential(name):
    seq = fit(STRATEGIES[name](), "sgd", "sequential", local_epochs=1)
    vec = fit(STRATEGIES[name](), "sgd", "vectorized", local_epochs=1)
    assert len({u.num_steps for u in seq[1]}) > 1  # ragged
    assert_same(seq, vec)


class SomeClientsTerms(pl.Callback):
    """AnchoredTerms that stack unevenly: clients with an even id get μ_k/2‖w − w_t/2‖² (its own μ, an anchor that is
    not the global weights' memory) and a direction of their own; the others get nothing."""

    def client_objective(self, trainer, loop, plan, client_id):
        if client_id % 2:
            return []
        anchors = [0.5 * p.detach() for p in loop.global_parameters()]
        g = torch.Generator().manual_seed(client_id)
        directions = [0.01 * torch.randn(a.shape, generator=g, dtype=a.dtype).to(a.device) for a in anchors]
        return [AnchoredTerm(anchors, mu=0.1 + client_id / 100.0, directions=directions)]


@pytest.mark.numerics
@pytest.mark.parametrize("optimizer", ["sgd", "armijo"])
@pytest.mark.parametrize("name", ["fedprox", "feddane-independent"])
def test_terms_of_some_clients_and_line_search_equal_sequential(name, optimizer):
    """Layers that miss clients, per-client μ and anchors, and SgdArmijo's trial points (rows of chosen clients)."""
    strategy = [*STRATEGIES[name](), SomeClientsTerms()]
    seq = fit(strategy, optimizer, "sequential")
    vec = fit(strategy, optimizer, "vectorized")
    assert_same(seq, vec)
    if optimizer == "armijo":
        assert sum(u.backtracks for u in seq[1]) > 0  # the search backtracked
        assert [u.backtracks for u in vec[1]] == [u.backtracks for u in seq[1]]


class WrongShapes(pl.Callback):
    def client_objective(self, trainer, loop, plan, client_id):
        return [AnchoredTerm([torch.zeros(3, dtype=torch.float64)], mu=1.0)]


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_term_over_other_shapes_is_refused_naming_them(mode):
    with pytest.raises((ValueError, RuntimeError), match="AnchoredTerm.*shapes"):  # sequential: the round's error
        fit([FedAvg(), WrongShapes()], "sgd", mode, rounds=1)


@pytest.mark.numerics
def test_terms_stack_per_group_of_clients(monkeypatch):
    """With max_parallel_clients the engine trains the round's clients in groups; each group stacks its own terms."""
    sizes = []
    run = VectorizedClientTrainer.run

    def spy(self, client_ids, *args, **kwargs):
        sizes.append(len(client_ids))
        return run(self, client_ids, *args, **kwargs)

    monkeypatch.setattr(VectorizedClientTrainer, "run", spy)
    strategy = [*STRATEGIES["feddane-independent"](), SomeClientsTerms()]
    seq = fit(strategy, "sgd", "sequential")
    vec = fit(strategy, "sgd", "vectorized", max_parallel_clients=2)
    assert max(sizes) == 2 and len(sizes) > ROUNDS  # groups of the rounds' clients
    assert_same(seq, vec)


class PlainShift(pl.Callback):
    """A user's term without a batched form: (client id / 100)·Σw, a plain callable."""

    def client_objective(self, trainer, loop, plan, client_id):
        scale = client_id / 100.0

        def shift(params):
            return scale * sum(p.sum() for p in params)

        return [shift]


@pytest.mark.numerics
def test_plain_callable_terms_still_train_vectorized_and_say_why_once(caplog):
    strategy = [*STRATEGIES["fedprox"](), PlainShift()]
    seq = fit(strategy, "sgd", "sequential")
    with caplog.at_level(logging.INFO):
        vec = fit(strategy, "sgd", "vectorized", rounds=3)
    lines = [r.getMessage() for r in caplog.records if "no batched form" in r.getMessage()]
    assert len(lines) == 1 and "shift" in lines[0], lines
    seq3 = fit(strategy, "sgd", "sequential", rounds=3)
    assert_same(seq3, vec)
    assert (seq3[0] - seq[0]).abs().max() > 0


class WeightsOnlyPull(AnchoredTerm):
    """A user's subclass that changes the term: μ/2·‖w − a‖² over the weight matrices only (biases left free)."""

    def __call__(self, params):
        rows = self.num_rows is not None
        return 0.5 * self.mu * sum(((p - a) ** 2).sum() for p, a in zip(params, self.anchors) if p.dim() - rows == 2)


class NamedPull(AnchoredTerm):
    """A subclass that only adds a constructor: AnchoredTerm's own term."""

    def __init__(self, anchors, strength):
        super().__init__(anchors, mu=strength)


class SubclassTerms(pl.Callback):
    def __init__(self, cls, **kwargs):
        self.cls, self.kwargs = cls, kwargs

    def client_objective(self, trainer, loop, plan, client_id):
        return [self.cls([p.detach() for p in loop.global_parameters()], **self.kwargs)]


@pytest.mark.numerics
def test_an_anchored_term_subclass_that_overrides_the_term_is_evaluated_client_by_client(caplog):
    """A subclass overriding ``__call__`` computes another term than AnchoredTerm's closed form, which vectorized
    training stacked in its place; it now runs client by client (as sequentially), saying why, while a subclass that
    only adds a constructor keeps the batched form."""
    own = [FedAvg(), SubclassTerms(WeightsOnlyPull, mu=2.0)]
    seq = fit(own, "sgd", "sequential")
    with caplog.at_level(logging.INFO):
        vec = fit(own, "sgd", "vectorized")
    assert_same(seq, vec)
    lines = [r.getMessage() for r in caplog.records if "no batched form" in r.getMessage()]
    assert len(lines) == 1 and "overrides AnchoredTerm.__call__" in lines[0], lines
    base = fit([FedAvg(), SubclassTerms(AnchoredTerm, mu=2.0)], "sgd", "sequential")
    assert (base[0] - seq[0]).abs().max() > 1e-3  # the override changed the training
    caplog.clear()
    named = [FedAvg(), SubclassTerms(NamedPull, strength=2.0)]
    with caplog.at_level(logging.INFO):
        vec_named = fit(named, "sgd", "vectorized")
    assert not [r for r in caplog.records if "no batched form" in r.getMessage()]
    assert_same(base, vec_named)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["fedprox", "scaffold", "feddane-same"])
def test_float32_vectorized_close_to_sequential(name):
    seq = fit(STRATEGIES[name](), "sgd", "sequential", float64=False)
    vec = fit(STRATEGIES[name](), "sgd", "vectorized", float64=False)
    assert vec[0].dtype == torch.float32
    torch.testing.assert_close(vec[0], seq[0], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- full gradients
class GradientProbe(pl.Callback):
    """At the first round start: the vectorised full gradients of some clients, and the per-client ones."""

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.result = None

    def on_train_start(self, trainer, loop):
        ids = [3, 0, 7, 12, 3]
        together = loop.client_full_gradients(ids, 0, self.batch_size)
        alone = [client_full_gradient(loop, k, 0, self.batch_size) for k in ids]
        hand = [_hand_gradient(loop, k) for k in ids] if getattr(self, "hand", True) else None
        self.result = (ids, together, alone, hand, loop)


def _hand_gradient(loop, client_id):
    """∇ of the mean cross-entropy over all of the client's samples, written out on a copy of the global model."""
    dm = loop.datamodule
    x, y = dm.train_dataset[list(dm.client_indices[client_id])]
    model = copy.deepcopy(loop.model)
    device = next(model.parameters()).device
    loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.numerics
@pytest.mark.parametrize("gather", ["rows", "batches"])
@pytest.mark.parametrize("batch_size", [None, 7])
def test_client_full_gradients_vectorized_equal_client_by_client(batch_size, gather, monkeypatch):
    """Both ways to the rows: one gather from the in-memory data (client_full_rows), or the clients' chunks as
    client_full_batches loads them, stacked by the engine."""
    if gather == "batches":
        monkeypatch.setattr(loop_module, "client_full_rows", lambda *args, **kwargs: None)
    probe = GradientProbe(batch_size)
    fit([FedAvg()], "sgd", "vectorized", rounds=1, extra=[probe])
    ids, together, alone, hand, loop = probe.result
    assert loop._runtime.full_gradient_engine is not None  # the vectorised path ran
    assert together.shape == (len(ids), alone[0].numel())
    for row, grad, want in zip(together, alone, hand):
        assert_close64(grad, want)
        assert_close64(row, want)


class BatchNormMLP(pl.LightningModule):
    """An MLP with BatchNorm1d: a chunk's gradient depends on its batch statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _batchnorm_loop() -> FederatedLoop:
    """A vectorized loop of the float64 BatchNormMLP, 3 clients a round, 2 local steps."""
    return FederatedLoop(
        to_float64(BatchNormMLP()),
        client_optimizer=CLIENT_OPTIMIZERS["sgd"],
        local_steps=2,
        clients_per_round=3,
        seed=0,
        client_execution="vectorized",
    )


@pytest.mark.numerics
def test_client_full_gradients_with_batchnorm_equal_client_by_client():
    probe = GradientProbe(None)
    loop = _batchnorm_loop()
    probe.hand = False
    make_trainer(1, callbacks=[FedAvg(), probe]).fit(loop, datamodule=digits())
    ids, together, alone, _, loop = probe.result
    assert loop._runtime.full_gradient_engine is not None
    for row, grad in zip(together, alone):
        assert_close64(row, grad)


class DeepCopyAfterRound(pl.Callback):
    def __init__(self):
        self.copied = 0

    def on_train_batch_end(self, trainer, loop, *args):
        copy.deepcopy(loop.model)  # reaches the engine through the trainer: no vmapped tensor may stay behind
        self.copied += 1


def test_no_vmapped_tensor_outlives_a_batchnorm_round():
    probe = DeepCopyAfterRound()
    loop = _batchnorm_loop()
    make_trainer(2, callbacks=[FedDANE(mu=0.1), probe]).fit(loop, datamodule=digits())
    assert probe.copied == 2


@pytest.mark.numerics
def test_client_full_gradients_follow_the_client_groups(monkeypatch):
    """With max_parallel_clients=2 the full gradients of 5 clients are 3 batched computations of at most 2 clients
    (the group size local training uses), equal to client by client."""
    sizes = []
    real = VectorizedClientTrainer.full_gradients_of_rows

    def spy(self, rows, row_sizes, row_clients, totals, *args, **kwargs):
        sizes.append(len(totals))
        return real(self, rows, row_sizes, row_clients, totals, *args, **kwargs)

    monkeypatch.setattr(VectorizedClientTrainer, "full_gradients_of_rows", spy)
    probe = GradientProbe(None)
    fit([FedAvg()], "sgd", "vectorized", rounds=1, extra=[probe], max_parallel_clients=2)
    ids, together, alone, hand, loop = probe.result
    assert sizes == [2, 2, 1]
    for row, grad, want in zip(together, alone, hand):
        assert_close64(grad, want)
        assert_close64(row, want)
