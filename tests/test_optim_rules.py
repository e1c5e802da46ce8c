"""The step-size rules of fedlightning.optim.rules, and the batched-form extension point (vectorized.BatchedRule).

Every rule gives, for a ``[C]`` batch of clients, exactly (bit for bit) what it gives for each client alone, and the
paper's formula on analytic cases computed by hand. A user optimizer (normalized gradient descent, written here)
that names a batched form trains vectorized to the weights, telemetry and per-client state of sequential training;
one without a batched form is refused with an error naming it.
"""

import math

import lightning.pytorch as pl
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import Dirichlet
from fedlightning.models import MLP
from fedlightning.optim import rules
from fedlightning.vectorized import BatchedRule, VectorizationUnsupportedError
from numerics import Digits64, assert_close64, flat, to_float64

NAN = float("nan")


def batched(values):
    return torch.tensor(values, dtype=torch.float64)


def assert_bitwise(batch, singles):
    """``batch`` ([C] tensor) holds exactly the per-client results ``singles`` (NaN where they are NaN)."""
    expected = torch.tensor([float(v) for v in singles], dtype=batch.dtype if batch.is_floating_point() else None)
    assert batch.shape == expected.shape
    if batch.dtype == torch.bool:
        assert batch.tolist() == [bool(v) for v in singles]
        return
    assert torch.equal(batch.isnan(), expected.isnan())
    assert torch.equal(batch[~batch.isnan()], expected[~expected.isnan()].to(batch.dtype))


def per_client(fn, *columns, **fixed):
    """``fn`` on the batch (tensors) and on each client alone (Python numbers); every output compared bit for bit."""
    got = fn(*[batched(c) if isinstance(c[0], float) else torch.tensor(c) for c in columns], **fixed)
    singles = [fn(*row, **fixed) for row in zip(*columns)]
    if not isinstance(got, tuple):
        got, singles = (got,), [(s,) for s in singles]
    for i, out in enumerate(got):
        if isinstance(out, torch.Tensor):
            assert_bitwise(out, [s[i] for s in singles])
        else:  # a value that does not depend on the client (e.g. "moved" of a fixed-step SPS)
            assert all(s[i] == out for s in singles)
    return got


# losses, squared gradient norms and previous steps of 8 clients: ordinary values, a flat gradient, a zero
# gradient, a non-positive gap, tiny and huge ratios, "no previous step" (NaN)
GAP = [0.7, 1.3, 2.0, 0.0, -0.5, 1e-3, 5.0, 0.25]
GRAD_SQ = [0.9, 1e-17, 0.0, 1.0, 2.0, 40.0, 1e-6, 4.0]
PREV = [0.3, NAN, 1.7, 0.05, NAN, 2.5, 0.9, 1e-4]


@pytest.mark.parametrize("reset", ["max", "last", "grow"])
def test_armijo_initial_step_batch_equals_each_client(reset):
    growth = [2.0 ** (1 / n) for n in (1, 2, 3, 4, 1, 7, 2, 5)]
    per_client(lambda prev, g: rules.armijo_initial_step(reset, 1.5, prev, g), PREV, growth)


def test_armijo_test_and_state_batch_equal_each_client():
    trial = [0.5, 1.2, NAN, 0.1, 3.0, 0.0, 2.0, 0.2]
    loss = [1.0, 1.3, 2.0, 0.15, 2.9, 1e-3, 5.0, 0.25]
    eta = [0.5, 0.25, 1.0, 0.9, 2.0, 1e-3, 3.0, 0.75]
    per_client(lambda t, f, s, e: rules.armijo_accepts(t, f, s, 0.1, e), trial, loss, GRAD_SQ, eta)
    accepted = [True, False, False, True, False, True, False, False]
    exhausted = [False, True, False, False, True, False, False, True]
    last = [0.2, NAN, 0.4, 0.6, 0.8, NAN, 1.0, 0.3]
    per_client(
        lambda e0, a_eta, acc, ex, prev, last: rules.armijo_after_search(e0, a_eta, acc, ex, prev, last, 0.9**101),
        eta,
        trial,
        accepted,
        exhausted,
        PREV,
        last,
    )


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("fixed", [None, 0.3])
def test_sps_batch_equals_each_client(smooth, fixed):
    growth = [2.0 ** (1 / n) for n in (3, 1, 2, 4, 1, 5, 2, 8)] if smooth else None
    if smooth:
        cap = per_client(lambda prev, g: rules.sps_cap(1.0, prev, g), PREV, growth)[0]
    else:
        cap = per_client(lambda prev: rules.sps_cap(1.0, prev), PREV)[0]
    steps = per_client(lambda gap, sq, cap: rules.sps_step(gap, sq, 0.5, cap, 1e-8), GAP, GRAD_SQ, cap.tolist())
    scale = [1.0, 0.5, 2.0, 1.0, 0.1, 1.0, 0.7, 1.0]
    per_client(
        lambda s, d, sc, prev: rules.sps_after_step(s, d, sc, prev, fixed),
        steps[0].tolist(),
        steps[1].tolist(),
        scale,
        PREV,
    )


def test_decsps_batch_equals_each_client():
    t = [0.0, 1.0, 2.0, 3.0, 0.0, 10.0, 5.0, 1.0]
    gamma_prev = [1.0, 0.7, 0.5, 0.2, 2.0, 0.01, 0.3, 0.9]
    roots = rules.CountRoots(torch.device("cpu"))
    roots.cover(11)

    def sqrt(x):
        return roots(x) if isinstance(x, torch.Tensor) else math.sqrt(x)

    per_client(lambda t, gp: rules.decsps_bound(0.5, t, gp, sqrt), t, gamma_prev)
    gamma, degenerate = per_client(
        lambda gap, sq, t, gp: rules.decsps_step(gap, sq, t, gp, 0.5, 1e-8, sqrt), GAP, GRAD_SQ, t, gamma_prev
    )
    per_client(
        lambda g, d, s, t, gp: rules.polyak_after_step(g, d, s, t, t + 1) + rules.polyak_after_step(g, d, s, gp, g)[2:],
        gamma.tolist(),
        degenerate.tolist(),
        [1.0, 0.5, 2.0, 1.0, 1.0, 0.3, 1.0, 1.0],
        t,
        gamma_prev,
    )


def test_count_roots_are_math_sqrt():
    """√k of step counts for a batch equals math.sqrt(k) bit for bit (torch.sqrt need not: not correctly rounded on
    every CPU), also after the table grew."""
    roots = rules.CountRoots(torch.device("cpu"))
    roots.cover(3)
    roots.cover(5000)
    counts = torch.arange(0, 5001, dtype=torch.float64).flip(0)
    assert roots(counts).tolist() == [math.sqrt(k) for k in range(5000, -1, -1)]


def test_shared_checks_batch_equal_each_client():
    per_client(lambda f, s: rules.finite_step(f, s), [1.0, NAN, math.inf, 2.0], [1.0, 1.0, 1.0, NAN])
    per_client(lambda s: rules.flat_gradient(s, 1e-8), [1e-17, 0.0, 1e-16, 3.0])


# ---------------------------------------------------------------------------------------- the formulas by hand
def test_armijo_on_a_quadratic_by_hand():
    """f(w) = ½‖w‖², g = w: f(w − ηg) = ½(1 − η)²‖w‖² ≤ ½‖w‖² − cη‖w‖²  ⇔  η ≤ 2(1 − c) (1.8 for c = 0.1)."""
    w_sq = 4.0
    f = 0.5 * w_sq
    for eta, ok in [(1.5, True), (1.8 - 1e-9, True), (1.9, False), (4.0, False)]:
        assert rules.armijo_accepts(0.5 * (1 - eta) ** 2 * w_sq, f, w_sq, 0.1, eta) is ok
    # grid η_0 β^m from η_0 = 4, β = 0.5: 4 and 2 fail, 1 is the largest accepted point (m = 2)
    powers = rules.armijo_powers(0.5, 5)
    assert powers == (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625)
    first = next(
        m for m in range(6) if rules.armijo_accepts(0.5 * (1 - 4 * powers[m]) ** 2 * w_sq, f, w_sq, 0.1, 4 * powers[m])
    )
    assert 4 * powers[first] == 1.0
    # exhausted search (max_backtracks = 5): η_{k-1} is the next grid point η_0 β^6; the last accepted step is kept
    assert rules.armijo_after_search(4.0, NAN, False, True, 0.3, 0.7, powers[-1]) == (4.0 / 64, 0.7)
    assert rules.armijo_after_search(4.0, 1.0, True, False, 0.3, 0.7, powers[-1]) == (1.0, 1.0)
    assert rules.armijo_after_search(4.0, NAN, False, False, 0.3, 0.7, powers[-1]) == (0.3, 0.7)  # no search


def test_armijo_reset_policies_by_hand():
    """Vaswani et al. 2019 / "Painless Federated Learning" Alg. 3: max, last, grow = min{η_{k-1} δ^{b/n}, η_max}."""
    growth = rules.per_step_growth(2.0, 1 / 4)
    assert growth == 2.0**0.25
    assert rules.armijo_initial_step("max", 1.0, 0.3) == 1.0
    assert rules.armijo_initial_step("last", 1.0, 0.3) == 0.3
    assert rules.armijo_initial_step("grow", 1.0, 0.5, growth) == pytest.approx(0.5 * 2**0.25)
    assert rules.armijo_initial_step("grow", 1.0, 0.9, growth) == 1.0  # capped at η_max
    assert rules.armijo_initial_step("grow", 1.0, NAN, growth) == 1.0  # first step
    assert rules.armijo_initial_step("last", 1.0, NAN) == 1.0


def test_sps_by_hand():
    """Loizou et al. 2021, SPS_max: γ = min{(f − ℓ*)/(c‖g‖²), γ_b}; (2 − 0)/(0.5 · 4) = 1."""
    assert rules.sps_step(2.0, 4.0, 0.5, 2.0, 1e-8) == (1.0, False)
    assert rules.sps_step(2.0, 4.0, 0.5, 0.8, 1e-8) == (0.8, False)  # the cap
    assert rules.sps_step(2.0, 0.0, 0.5, 0.8, 1e-8) == (0.8, True)  # zero gradient: ratio +inf, no step
    assert rules.sps_step(-1.0, 4.0, 0.5, 0.8, 1e-8) == (0.0, True)  # f <= ℓ*: ratio <= 0, no step
    # smoothed cap γ_{b,t} = δ^{b/n} γ_{t-1}; γ_b before the first step
    assert rules.sps_cap(1.0, 0.5, 2.0**0.5) == 0.5 * 2.0**0.5
    assert rules.sps_cap(1.0, NAN, 2.0**0.5) == 1.0
    assert rules.sps_cap(1.0, 0.5) == 1.0
    # applied step s·γ; state advanced only on a real step; FedSPS-Global: the fixed step, state unchanged
    assert rules.sps_after_step(0.8, False, 0.5, 0.3) == (0.4, True, 0.8)
    assert rules.sps_after_step(0.8, True, 0.5, 0.3) == (0.0, False, 0.3)
    assert rules.sps_after_step(0.8, True, 0.5, 0.3, fixed_step_size=0.2) == (0.1, True, 0.3)


def test_decsps_by_hand():
    """Orvieto et al. 2022: γ_t = min{(f − ℓ*)/‖g‖², c_{t−1}γ_{t−1}}/c_t, c_t = c_0√(t+1), c_{−1} = c_0."""
    # t = 0, γ_{-1} = γ_b = 1, c0 = 0.5: γ_0 = min{ratio/c0, γ_b}; ratio 1/4 -> 0.5, ratio 1 -> γ_b
    assert rules.decsps_step(1.0, 4.0, 0, 1.0, 0.5, 1e-8) == (0.5, False)
    assert rules.decsps_step(4.0, 4.0, 0, 1.0, 0.5, 1e-8) == (1.0, False)
    # t = 3: c_2 = 0.5√3, c_3 = 1
    gamma, degenerate = rules.decsps_step(1.0, 2.0, 3, 0.4, 0.5, 1e-8)
    assert not degenerate and gamma == pytest.approx(min(0.5, 0.5 * math.sqrt(3) * 0.4))
    gamma, _ = rules.decsps_step(1.0, 4.0, 3, 0.4, 0.5, 1e-8)
    assert gamma == 0.25
    bound, c_t = rules.decsps_bound(0.5, 3, 0.4)
    assert (bound, c_t) == (0.5 * math.sqrt(3) * 0.4, 1.0)
    assert rules.decsps_step(0.0, 4.0, 3, 0.4, 0.5, 1e-8)[1] is True
    assert rules.polyak_after_step(0.25, False, 2.0, (3, 0.4), (4, 0.25)) == (0.5, True, (4, 0.25))
    assert rules.polyak_after_step(0.25, True, 2.0, (3, 0.4), (4, 0.25)) == (0.0, False, (3, 0.4))


def test_sgd_direction_by_hand():
    g, w = torch.tensor([[1.0, -2.0]]), torch.tensor([[10.0, 4.0]])
    assert torch.equal(rules.sgd_direction(g, w, 0.1), torch.tensor([[2.0, -1.6]]))
    assert rules.sgd_direction(g, w, 0.0) is g


# ---------------------------------------------------------------------------------------- a user's batched form
class _BatchedNGD(BatchedRule):
    """Normalized gradient descent for every client at once: ``w ← w − lr g/‖g‖`` per row of ``W``."""

    def __init__(self, optimizers, params, device, grad_clip=None):
        super().__init__(optimizers, params, device, grad_clip)
        self.lr = optimizers[0].param_groups[0]["lr"]
        self.steps = torch.tensor([o.get_client_state()["steps"] for o in optimizers], device=device)

    def step(self, W, ev, record, alive):
        loss, g = ev.gradient(W, alive)
        norm = torch.linalg.vector_norm(g, dim=1).double()
        moves = alive & (norm > 0)
        self.move(W, g, torch.where(moves, self.lr / norm, 0.0), moves)
        self.steps += moves.long()
        record.add(loss, torch.full_like(norm, self.lr), alive)  # sequential records the group's lr

    def finalize(self, optimizers):
        for o, n in zip(optimizers, self.steps.tolist()):
            o.set_client_state({"steps": n})


@torch.no_grad()
def normalized_step(optimizer):
    """``w ← w − lr g/‖g‖`` with the norm over all parameters (no step for a zero gradient); True if it moved."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
    if norm > 0:
        torch._foreach_add_(params, grads, alpha=-optimizer.param_groups[0]["lr"] / norm)
    return norm > 0


class NormalizedGD(torch.optim.Optimizer):
    """Normalized gradient descent that counts this client's steps across rounds (its per-client state)."""

    batched_rule = _BatchedNGD

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self.steps = 0

    def step(self, closure=None):
        self.steps += int(normalized_step(self))

    def get_client_state(self):
        return {"steps": self.steps}

    def set_client_state(self, state):
        self.steps = int(state["steps"])

    def client_report(self):
        return {"ngd_steps": float(self.steps)}


class PlainNGD(torch.optim.Optimizer):
    """Normalized gradient descent without a batched form."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        normalized_step(self)


class TweakedNGD(NormalizedGD):
    """Overrides ``step``: its parent's batched form is not its own."""

    def step(self, closure=None):
        super().step(closure)


class Recorder(pl.Callback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)


def fit(optimizer, mode, rounds=3, **loop_kwargs):
    """A float64 run (the modes sum in different orders: compared to numerics.RTOL64)."""
    torch.manual_seed(1)
    model = to_float64(MLP(input_dim=64, hidden=[16], num_classes=10))
    rec = Recorder()
    loop = FederatedLoop(
        model,
        client_optimizer=optimizer,
        local_steps=5,
        clients_per_round=6,
        seed=3,
        client_execution=mode,
        **loop_kwargs,
    )
    make_trainer(rounds, callbacks=[FedAvg(), rec]).fit(
        loop, datamodule=Digits64(num_clients=40, batch_size=16, partition=Dirichlet(0.3), seed=0)
    )
    return flat(model), loop, rec.updates


@pytest.mark.numerics
def test_user_optimizer_with_a_batched_form_trains_vectorized_as_sequential():
    w_seq, loop_seq, ups_seq = fit(lambda p: NormalizedGD(p, lr=0.05), "sequential")
    w_vec, loop_vec, ups_vec = fit(lambda p: NormalizedGD(p, lr=0.05), "vectorized")
    torch.manual_seed(1)
    w_init = flat(to_float64(MLP(input_dim=64, hidden=[16], num_classes=10)))
    assert (w_seq - w_init).abs().max() > 1e-2  # the clients moved
    assert_close64(w_vec, w_seq)
    assert [u.client_id for u in ups_vec] == [u.client_id for u in ups_seq]
    sizes = {u.num_samples for u in ups_seq}
    assert min(sizes) < 16 and len({n % 16 for n in sizes}) > 1  # ragged: clients below one batch, partial batches
    for a, b in zip(ups_seq, ups_vec):
        assert (a.num_steps, a.forwards, a.backwards, a.step_sizes) == (
            b.num_steps,
            b.forwards,
            b.backwards,
            b.step_sizes,
        )
        assert a.payload == b.payload and a.payload["ngd_steps"] >= 5  # client_report, after its state came back
    state_seq = loop_seq.client_state.state_dict()
    assert state_seq == loop_vec.client_state.state_dict() and state_seq["optimizer"]  # per-client state persisted


@pytest.mark.parametrize("optimizer", [PlainNGD, TweakedNGD], ids=["no-batched-form", "overridden-step"])
def test_user_optimizer_without_a_batched_form_is_refused_by_name(optimizer):
    with pytest.raises(VectorizationUnsupportedError, match=rf"client optimizer {optimizer.__name__}: it names no "):
        fit(lambda p: optimizer(p, lr=0.05), "vectorized", rounds=1)


def test_auto_falls_back_to_sequential_for_an_optimizer_without_a_batched_form():
    with pytest.warns(UserWarning, match="training clients sequentially .*client optimizer PlainNGD"):
        w_auto, loop, _ = fit(lambda p: PlainNGD(p, lr=0.05), "auto", rounds=2)
    assert loop.client_execution_choice == "sequential"
    w_seq, _, _ = fit(lambda p: PlainNGD(p, lr=0.05), "sequential", rounds=2)
    assert torch.equal(w_auto, w_seq)


def test_a_batched_form_that_does_not_clip_refuses_client_grad_clip():
    with pytest.raises(
        VectorizationUnsupportedError, match="_BatchedNGD of NormalizedGD does not apply the loop's client_grad_clip"
    ):
        fit(lambda p: NormalizedGD(p, lr=0.05), "vectorized", rounds=1, client_grad_clip=1.0)


def test_batched_rule_must_be_a_batched_rule():
    class Wrong(NormalizedGD):
        batched_rule = dict

    with pytest.raises(TypeError, match="Wrong.batched_rule must be a subclass of"):
        fit(lambda p: Wrong(p, lr=0.05), "vectorized", rounds=1)


def test_built_in_optimizers_and_their_subclasses_have_their_batched_form_unless_step_is_overridden():
    from fedlightning.optim import SPS, AdaAlterClient, AMSGradClient, DecSPS, MimeLiteSGD, MimeSGD, SgdArmijo
    from fedlightning.vectorized.rules import BUILT_IN_FORMS, _batched_form

    class QuietArmijo(SgdArmijo):  # same step: keeps the batched form
        pass

    class OwnStep(SPS):  # a new step: its parent's batched form no longer describes it
        def step(self, closure=None):
            return super().step(closure)

    class OwnStepWithForm(OwnStep):
        batched_rule = BUILT_IN_FORMS[DecSPS]

    built_in = (SgdArmijo, SPS, DecSPS, AMSGradClient, AdaAlterClient, MimeLiteSGD, MimeSGD)
    assert [_batched_form(k) for k in built_in] == [BUILT_IN_FORMS[k] for k in built_in]
    assert len(set(BUILT_IN_FORMS.values())) == len(BUILT_IN_FORMS) == 7
    # MimeSGD overrides MimeLiteSGD's step: its own form, not its parent's
    assert BUILT_IN_FORMS[MimeSGD] is not BUILT_IN_FORMS[MimeLiteSGD]
    assert _batched_form(QuietArmijo) is BUILT_IN_FORMS[SgdArmijo]
    assert _batched_form(OwnStep) is None
    assert _batched_form(OwnStepWithForm) is BUILT_IN_FORMS[DecSPS]
    assert _batched_form(torch.optim.RMSprop) is None
