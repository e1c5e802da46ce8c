"""SPS (constant and smoothed cap) and DecSPS against hand-computed quadratics, their invariants, the degenerate-step
and NaN policies, persistence and bad arguments.

Quadratic f(w) = ½ Σ a_i w_i², f* = 0, g = a ⊙ w. Hand-computed case A (a = (1, 4), w0 = (3, −1), c = 0.5):
  step 0: f = 6.5, ‖g‖² = 25, SPS ratio f/(c‖g‖²) = 0.52 -> w1 = (1.44, 1.08)
  step 1: f = 3.3696, ‖g‖² = 20.736, ratio = 0.325     -> w2 = (0.972, −0.324)
  step 2: f = 0.682344, ‖g‖² = 2.6244, ratio = 0.52
"""

import math

import pytest
import torch

from fedlightning.optim import SPS, DecSPS

DT = torch.float64


def quadratic(params, curvatures):
    def closure():
        return sum(0.5 * (a * p * p).sum() for p, a in zip(params, curvatures))

    return closure


def case_a():
    w = torch.nn.Parameter(torch.tensor([3.0, -1.0], dtype=DT))
    return w, quadratic([w], [torch.tensor([1.0, 4.0], dtype=DT)])


def run(opt, closure, steps):
    out = []
    for _ in range(steps):
        opt.zero_grad()
        opt.step(closure)
        out.append(opt.last_step["step_size"])
    return out


# ---------------------------------------------------------------------------------------------------------- SPS
def test_sps_hand_computed():
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=1.0)
    opt.zero_grad()
    loss = opt.step(closure)
    assert loss.item() == pytest.approx(6.5)
    assert opt.last_step == {
        "step_size": pytest.approx(0.52),
        "backtracks": 0,
        "forwards": 1,
        "backwards": 1,
        "sps_step_size": pytest.approx(0.52),
    }
    torch.testing.assert_close(w.detach(), torch.tensor([1.44, 1.08], dtype=DT))
    assert run(opt, closure, 2) == [pytest.approx(0.325), pytest.approx(0.52)]
    expected = torch.tensor([0.972, -0.324], dtype=DT) * (1 - 0.52 * torch.tensor([1.0, 4.0], dtype=DT))
    torch.testing.assert_close(w.detach(), expected)


def test_sps_constant_cap_binds():
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=0.4)
    # ratios 0.52 -> capped 0.4; then from w1 = (3 - 1.2, -1 + 1.6) = (1.8, 0.6): f = 0.5(3.24 + 1.44) = 2.34,
    # ‖g‖² = 3.24 + 5.76 = 9, ratio = 2.34/4.5 = 0.52 -> 0.4 again
    assert run(opt, closure, 2) == [pytest.approx(0.4), pytest.approx(0.4)]
    torch.testing.assert_close(w.detach(), torch.tensor([1.8 * 0.6, 0.6 * (1 - 1.6)], dtype=DT))


def test_sps_smoothed_cap_previous_step_reading():
    """b/n = 1/2, δ = 2: cap_0 = γ_b = 1, cap_t = √2·γ_{t−1}. Steps: 0.52; min(0.325, 0.735) = 0.325;
    min(0.52, √2·0.325 = 0.4596) = 0.4596 (the smoothed cap binds where the constant cap would not)."""
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=1.0, smooth=True, smooth_factor=2.0, n_batches_per_epoch=2)
    steps = run(opt, closure, 3)
    assert steps == [pytest.approx(0.52), pytest.approx(0.325), pytest.approx(math.sqrt(2) * 0.325)]
    assert opt.get_client_state() == {"prev_step": pytest.approx(math.sqrt(2) * 0.325)}


def test_sps_several_tensors_use_the_global_norm():
    """x = (2,), y = (1, 1) with curvatures 1 and (2, 3): f = 2 + 1 + 1.5 = 4.5, ‖g‖² = 4 + 4 + 9 = 17,
    γ = 4.5/(0.5·17) = 9/17."""
    x = torch.nn.Parameter(torch.tensor([2.0], dtype=DT))
    y = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=DT))
    opt = SPS([{"params": [x]}, {"params": [y]}], polyak_c=0.5, gamma_max=10.0)
    opt.zero_grad()
    opt.step(quadratic([x, y], [torch.tensor([1.0], dtype=DT), torch.tensor([2.0, 3.0], dtype=DT)]))
    g = 9 / 17
    assert opt.last_step["step_size"] == pytest.approx(g)
    torch.testing.assert_close(x.detach(), torch.tensor([2.0 - 2 * g], dtype=DT))
    torch.testing.assert_close(y.detach(), torch.tensor([1 - 2 * g, 1 - 3 * g], dtype=DT))


def test_sps_f_star_shifts_the_numerator():
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=1.0, f_star=1.5)
    assert run(opt, closure, 1) == [pytest.approx((6.5 - 1.5) / 12.5)]


def _random_quadratic(seed):
    """A stochastic quadratic: batch k has loss ½ Σ a (w − 0.1 z_k)²; returns (w, a, z, closure_for_batch)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(6, generator=g, dtype=DT) * 10 + 0.1
    w = torch.nn.Parameter(torch.randn(6, generator=g, dtype=DT) * 3)
    z = torch.randn(40, 6, generator=g, dtype=DT)

    def closure_for(k):
        return lambda: 0.5 * (a * (w - 0.1 * z[k]) ** 2).sum()

    return w, a, z, closure_for


@pytest.mark.parametrize("smooth", [False, True])
def test_sps_never_exceeds_its_cap_and_matches_formula(smooth):
    w, a, z, closure_for = _random_quadratic(1)
    c, gamma_b, nb = 0.3, 0.7, 5
    opt = SPS([w], polyak_c=c, gamma_max=gamma_b, smooth=smooth, n_batches_per_epoch=nb)
    prev, capped = None, 0
    for k in range(25):
        w0 = w.detach().clone()
        r = w0 - 0.1 * z[k]
        f, g = float((0.5 * a * r * r).sum()), a * r
        cap = gamma_b if (not smooth or prev is None) else 2.0 ** (1 / nb) * prev
        expected = min(f / (c * float((g * g).sum())), cap)
        capped += expected == cap
        opt.zero_grad()
        opt.step(closure_for(k))
        gamma = opt.last_step["step_size"]
        assert gamma == pytest.approx(expected, rel=1e-12)
        assert 0 < gamma <= cap * (1 + 1e-12)
        torch.testing.assert_close(w.detach(), w0 - expected * g, rtol=1e-12, atol=1e-14)
        prev = gamma
    assert 0 < capped < 25  # both branches of the min occurred


def test_sps_zero_gradient_does_not_freeze_the_smoothed_step():
    """The reference SPS stores γ = 0 after a zero-gradient step and then min(δ·0, ·) = 0 forever; here the step
    is skipped and the next step is the normal one (cap √2·0.52 from the last real step)."""
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=1.0, smooth=True, n_batches_per_epoch=2)
    run(opt, closure, 1)  # 0.52
    saved = w.detach().clone()
    with torch.no_grad():
        w.zero_()
    assert run(opt, closure, 1) == [0.0]  # f = 0, g = 0: no step
    assert w.detach().abs().sum().item() == 0.0
    with torch.no_grad():
        w.copy_(saved)
    assert run(opt, closure, 1) == [pytest.approx(0.325)]  # the cap √2·0.52 = 0.735 does not bind
    assert opt.get_client_state() == {"prev_step": pytest.approx(0.325)}


def test_sps_loss_below_f_star_takes_no_step():
    w, closure = case_a()
    opt = SPS([w], f_star=10.0)
    assert run(opt, closure, 1) == [0.0]
    assert w.detach().tolist() == [3.0, -1.0]


def test_sps_fixed_step_mode_measures_sps():
    """lr set (FedSPS-Global clients): the step is lr, SPS is only reported."""
    w, closure = case_a()
    opt = SPS([w], polyak_c=0.5, gamma_max=1.0, fixed_step_size=0.1)
    run(opt, closure, 1)
    assert opt.last_step["step_size"] == 0.1 and opt.last_step["sps_step_size"] == pytest.approx(0.52)
    torch.testing.assert_close(w.detach(), torch.tensor([2.7, -0.6], dtype=DT))
    report = opt.client_report()
    assert report == {
        "sps_last_step_size": pytest.approx(0.52),
        "sps_last_loss": pytest.approx(6.5),
        "sps_last_grad_sq": pytest.approx(25.0),
    }
    assert opt.get_client_state() == {}


def test_sps_smooth_needs_epoch_length():
    w, closure = case_a()
    with pytest.raises(ValueError, match="n_batches_per_epoch"):
        SPS([w], smooth=True).step(closure)
    opt = SPS([w], smooth=True)
    opt.set_client_data(num_samples=100, batch_size=25)  # b/n = 1/4
    run(opt, closure, 1)
    assert opt.cap() == pytest.approx(2**0.25 * 0.52)


# ---------------------------------------------------------------------------------------------------------- DecSPS
def decsps_reference(ratios, c0, gamma_b):
    """Closed form of FedDecSPS's recursion ("Locally Adaptive Federated Learning", Sec. 5): γ_0 = min(r_0/c_0, γ_b),
    γ_t = min(r_t/(c_0√(t+1)), γ_{t−1}·√(t/(t+1)))."""
    out = []
    for t, r in enumerate(ratios):
        if t == 0:
            out.append(min(r / c0, gamma_b))
        else:
            out.append(min(r / (c0 * math.sqrt(t + 1)), out[-1] * math.sqrt(t / (t + 1))))
    return out


def test_decsps_hand_computed():
    """Case A with c0 = 0.5, γ_b = 1: γ_0 = min(0.26/0.5, 1) = 0.52; w1 = (1.44, 1.08);
    γ_1 = min(3.3696/20.736 / (0.5√2), 0.52/√2) = min(0.229810, 0.367696) = 0.229810."""
    w, closure = case_a()
    opt = DecSPS([w], c0=0.5, gamma_max=1.0)
    steps = run(opt, closure, 2)
    assert steps == [pytest.approx(0.52), pytest.approx(0.1625 / (0.5 * math.sqrt(2)))]
    assert opt.get_client_state() == {"t": 2, "gamma_prev": pytest.approx(steps[1])}


def test_decsps_recursion_over_several_steps_with_split_parameters():
    """Ratios measured independently at every iterate; both branches of the min are exercised."""
    torch.manual_seed(3)
    curv = [torch.tensor([0.3, 2.0], dtype=DT), torch.tensor([[5.0], [0.7]], dtype=DT)]
    params = [
        torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=DT)),
        torch.nn.Parameter(torch.tensor([[0.5], [3.0]], dtype=DT)),
    ]
    closure = quadratic(params, curv)
    opt = DecSPS(params, c0=0.5, gamma_max=0.8)
    ratios, steps = [], []
    for _ in range(10):
        ws = [p.detach().clone() for p in params]
        f = sum(float((0.5 * a * w * w).sum()) for w, a in zip(ws, curv))
        gsq = sum(float((a * a * w * w).sum()) for w, a in zip(ws, curv))
        ratios.append(f / gsq)
        opt.zero_grad()
        opt.step(closure)
        steps.append(opt.last_step["step_size"])
        expected = decsps_reference(ratios, 0.5, 0.8)[-1]
        assert steps[-1] == pytest.approx(expected, rel=1e-12)
        for p, w, a in zip(params, ws, curv):
            torch.testing.assert_close(p.detach(), w - expected * a * w, rtol=1e-12, atol=1e-14)
    ref = decsps_reference(ratios, 0.5, 0.8)
    first_branch = [r / (0.5 * math.sqrt(t + 1)) for t, r in enumerate(ratios)]
    assert any(abs(s - fb) < 1e-12 for s, fb in zip(ref, first_branch))  # the ratio branch bound somewhere
    assert any(abs(s - fb) > 1e-6 for s, fb in zip(ref, first_branch))  # and the recursive branch somewhere


def test_decsps_non_increasing_and_bounded():
    w, _, _, closure_for = _random_quadratic(5)
    opt = DecSPS([w], c0=0.3, gamma_max=2.0)
    steps = [run(opt, closure_for(k), 1)[0] for k in range(40)]
    for t in range(1, 40):
        assert steps[t] <= steps[t - 1] * math.sqrt(t / (t + 1)) * (1 + 1e-12)
    for t, s in enumerate(steps):
        assert 0 < s <= 2.0 / math.sqrt(t + 1) * (1 + 1e-12)


def test_decsps_state_persists_across_instances():
    """A new optimizer (next round) given the client state continues the recursion at t = 2."""
    w, closure = case_a()
    first = DecSPS([w], c0=0.5, gamma_max=1.0)
    run(first, closure, 2)
    state = first.get_client_state()
    w_ref = w.detach().clone()
    second = DecSPS([w], c0=0.5, gamma_max=1.0)
    second.set_client_state(state)
    a = torch.tensor([1.0, 4.0], dtype=DT)
    ratio = float((0.5 * a * w_ref**2).sum()) / float((a * a * w_ref**2).sum())
    expected = min(ratio / (0.5 * math.sqrt(3)), state["gamma_prev"] * math.sqrt(2 / 3))
    assert run(second, closure, 1) == [pytest.approx(expected)]
    assert second.get_client_state()["t"] == 3
    fresh = DecSPS([w], c0=0.5, gamma_max=1.0)
    fresh.load_state_dict(second.state_dict())
    assert fresh.get_client_state() == second.get_client_state()


def test_decsps_degenerate_step_keeps_state():
    w, closure = case_a()
    opt = DecSPS([w])
    run(opt, closure, 1)
    state = opt.get_client_state()
    with torch.no_grad():
        w.zero_()
    assert run(opt, closure, 1) == [0.0]
    assert opt.get_client_state() == state


# ---------------------------------------------------------------------------------------------------------- NaN
@pytest.mark.parametrize(
    "make", [lambda w: SPS([w]), lambda w: SPS([w], smooth=True, n_batches_per_epoch=2), lambda w: DecSPS([w])]
)
@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_non_finite_loss_or_gradient_leaves_model_and_state_unchanged(make, bad):
    w, closure = case_a()
    opt = make(w)
    run(opt, closure, 1)
    before, state = w.detach().clone(), opt.get_client_state()
    if bad == "loss":
        bad_closure = lambda: closure() * float("inf")  # noqa: E731
    else:
        bad_closure = lambda: 1.0 + torch.sqrt((w - before).abs().sum())  # noqa: E731  (gradient NaN at w = before)
    opt.zero_grad()
    loss = opt.step(bad_closure)
    assert math.isnan(opt.last_step["step_size"])
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)
    assert opt.get_client_state() == state
    assert math.isfinite(loss.item()) == (bad == "grad")


# ---------------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"polyak_c": 0.0}, "polyak_c must"),
        ({"polyak_c": -1.0}, "polyak_c must"),
        ({"polyak_c": float("nan")}, "polyak_c must"),
        ({"gamma_max": 0.0}, "gamma_max"),
        ({"gamma_max": -2.0}, "gamma_max"),
        ({"gamma_max": float("inf")}, "gamma_max"),
        ({"f_star": float("nan")}, "f_star"),
        ({"smooth_factor": 0.5}, "smooth_factor"),
        ({"n_batches_per_epoch": 0.0}, "n_batches_per_epoch"),
        ({"fixed_step_size": 0.0}, "fixed_step_size"),
        ({"n_batches_per_epoch": 0.5}, "n_batches_per_epoch must be >= 1"),
        ({"grad_tol": -1e-3}, "grad_tol"),
    ],
)
def test_sps_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SPS([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"c0": 0.0}, "c0"),
        ({"c0": -0.5}, "c0"),
        ({"gamma_max": 0.0}, "gamma_max"),
        ({"f_star": float("inf")}, "f_star"),
    ],
)
def test_decsps_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecSPS([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_types_and_states():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="smooth"):
        SPS([p], smooth="yes")
    with pytest.raises(TypeError, match="gamma_max"):
        DecSPS([p], gamma_max=None)
    with pytest.raises(ValueError, match="gamma_prev"):
        DecSPS([p]).set_client_state({"t": 1, "gamma_prev": 0.0})
    with pytest.raises(ValueError, match="t must"):
        DecSPS([p]).set_client_state({"t": -1, "gamma_prev": 0.5})
    with pytest.raises(TypeError, match="closure"):
        SPS([p]).step()
