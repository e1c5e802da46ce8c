"""SgdArmijo against analytic quadratics, the paper's properties, NaN policy, RNG replay and bad arguments.

For f(w) = ½ Σ_i a_i w_i² (a_i > 0) and g = a ⊙ w, the Armijo condition
f(w − η g) ≤ f(w) − c η ‖g‖² reduces to  η · Σ a_i³ w_i² ≤ 2(1 − c) · Σ a_i² w_i²  (for η > 0), so the accepted step
is the largest grid point η0·β^m below  η* = 2(1 − c) Σ a²w² / Σ a³w²  — computed here without any function
evaluation, independently of the optimizer's trial loop.
"""

import math

import pytest
import torch

from fedlightning.optim import SgdArmijo

DT = torch.float64


def quadratic(params, curvatures):
    """Loss closure ½ Σ a_i w_i² over several tensors (curvatures has one tensor per parameter)."""

    def closure():
        return sum(0.5 * (a * p * p).sum() for p, a in zip(params, curvatures))

    return closure


def armijo_threshold(ws, curvatures, c):
    num = sum(float((a * a * w * w).sum()) for w, a in zip(ws, curvatures))
    den = sum(float((a**3 * w * w).sum()) for w, a in zip(ws, curvatures))
    return 2 * (1 - c) * num / den


def largest_grid_point(eta0, beta, threshold, max_backtracks=100):
    """(accepted step, number of rejected trials) of the grid eta0·β^m, m = 0.."""
    for m in range(max_backtracks + 1):
        eta = eta0 * beta**m
        assert abs(eta - threshold) > 1e-9 * threshold, "test case too close to a grid point"
        if eta <= threshold:
            return eta, m
    return None, max_backtracks + 1


# ---------------------------------------------------------------------------------------------------------- analytic
def test_hand_computed_first_steps():
    """1-D, a = 3, c = 0.1: η* = 2·0.9/3 = 0.6. Grid 1, 0.5: accept 0.5 after 1 rejection; w: 1 → -0.5 → 0.25."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="max")
    closure = quadratic([w], [torch.tensor([3.0], dtype=DT)])
    opt.zero_grad()
    loss = opt.step(closure)
    assert float(loss) == pytest.approx(1.5)  # loss at the ORIGINAL point
    assert opt.last_step == {"step_size": 0.5, "backtracks": 1, "forwards": 3, "backwards": 1}
    assert w.item() == pytest.approx(-0.5, abs=1e-15)
    opt.zero_grad()
    opt.step(closure)
    assert w.item() == pytest.approx(0.25, abs=1e-15)
    assert (opt.total_steps, opt.total_backtracks, opt.total_forwards, opt.total_backwards) == (2, 2, 6, 2)


@pytest.mark.parametrize(
    "reset,expected",
    [
        # (accepted step, backtracks) per step; 1-D a = 3, c = 0.1, β = 0.5, η_max = 1, η* = 0.6
        ("max", [(0.5, 1), (0.5, 1), (0.5, 1)]),
        ("last", [(0.5, 1), (0.5, 0), (0.5, 0)]),
        # grow with δ = 2 and b/n = 1/2: η0 = min(η_prev·√2, 1): 1 -> rej, 0.5 ok; 0.7071 rej, 0.3536 ok; 0.5 ok
        ("grow", [(0.5, 1), (math.sqrt(2) / 4, 1), (0.5, 0)]),
    ],
)
def test_reset_policies_hand_computed(reset, expected):
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset=reset, delta=2.0, n_batches_per_epoch=2)
    closure = quadratic([w], [torch.tensor([3.0], dtype=DT)])
    value = 1.0
    for eta, backtracks in expected:
        opt.zero_grad()
        opt.step(closure)
        value *= 1 - 3 * eta
        assert opt.last_step["step_size"] == pytest.approx(eta, rel=1e-12)
        assert opt.last_step["backtracks"] == backtracks
        assert opt.last_step["forwards"] == 1 + backtracks + 1
        assert w.item() == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("reset", ["max", "last", "grow"])
def test_reset_policies_match_analytic_threshold_on_split_parameters(reset):
    """Parameters in three tensors; the accepted step follows the JOINT norm; compared step by step with the
    analytic threshold and the reset rule of seed 000 Alg. 3 (grow capped at η_max)."""
    torch.manual_seed(0)
    ws = [torch.randn(3, dtype=DT), torch.randn(2, 2, dtype=DT), torch.randn(1, dtype=DT)]
    curv = [
        torch.tensor([0.5, 1.0, 2.0], dtype=DT),
        torch.tensor([[3.0, 0.2], [1.5, 4.0]], dtype=DT),
        torch.tensor([6.0], dtype=DT),
    ]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    c, beta, eta_max, delta, nb = 0.3, 0.7, 2.0, 3.0, 4.0
    opt = SgdArmijo(params, eta_max=eta_max, c=c, beta=beta, reset=reset, delta=delta, n_batches_per_epoch=nb)
    closure = quadratic(params, curv)
    ref = [w.clone() for w in ws]
    prev = None
    for k in range(8):
        threshold = armijo_threshold(ref, curv, c)
        if prev is None or reset == "max":
            eta0 = eta_max
        elif reset == "last":
            eta0 = prev
        else:
            eta0 = min(prev * delta ** (1 / nb), eta_max)
        eta, m = largest_grid_point(eta0, beta, threshold)
        ref = [w - eta * a * w for w, a in zip(ref, curv)]
        prev = eta
        opt.zero_grad()
        opt.step(closure)
        assert opt.last_step["step_size"] == pytest.approx(eta, rel=1e-12), k
        assert opt.last_step["backtracks"] == m
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-14)


def test_global_norm_not_first_tensor():
    """x = (1,), y = (1,) with curvatures 1 and 2, c = 0.5: joint threshold Σa²w²/Σa³w² = 5/9 → with β = 0.9 and
    η_max = 1 the accepted step is 0.9^6 = 0.531441 (0.59049 > 5/9 is rejected)."""
    x = torch.nn.Parameter(torch.ones(1, dtype=DT))
    y = torch.nn.Parameter(torch.ones(1, dtype=DT))
    opt = SgdArmijo([{"params": [x]}, {"params": [y]}], eta_max=1.0, c=0.5, beta=0.9)
    opt.zero_grad()
    opt.step(quadratic([x, y], [torch.ones(1, dtype=DT), 2 * torch.ones(1, dtype=DT)]))
    assert opt.last_step["step_size"] == pytest.approx(0.9**6)
    assert opt.last_step["backtracks"] == 6
    assert x.item() == pytest.approx(1 - 0.9**6) and y.item() == pytest.approx(1 - 2 * 0.9**6)


# ---------------------------------------------------------------------------------------------------------- properties
def _logreg_problem(seed=0, n=40, d=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=DT)
    y = (torch.rand(n, generator=g) > 0.5).to(DT)
    return x, y


def _logreg_loss(w, b, x, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)


@pytest.mark.parametrize("reset", ["max", "last", "grow"])
def test_armijo_condition_and_largest_grid_point_on_logistic_regression(reset):
    """At every step: the accepted step satisfies the Armijo condition (independent float64 evaluation), and the
    previous grid point η/β (when it was tried) violates it."""
    x, y = _logreg_problem()
    w = torch.nn.Parameter(torch.zeros(5, dtype=DT))
    b = torch.nn.Parameter(torch.zeros(1, dtype=DT))
    c, beta = 0.1, 0.8
    opt = SgdArmijo([w, b], eta_max=20.0, c=c, beta=beta, reset=reset, n_batches_per_epoch=3)
    for k in range(15):
        batch = slice((k * 10) % 40, (k * 10) % 40 + 10)
        w0, b0 = w.detach().clone(), b.detach().clone()
        wr, br = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        f0 = _logreg_loss(wr, br, x[batch], y[batch])
        gw, gb = torch.autograd.grad(f0, (wr, br))
        gsq = float(gw.pow(2).sum() + gb.pow(2).sum())
        opt.zero_grad()
        opt.step(lambda batch=batch: _logreg_loss(w, b, x[batch], y[batch]))
        eta, m = opt.last_step["step_size"], opt.last_step["backtracks"]
        assert eta > 0
        torch.testing.assert_close(w.detach(), w0 - eta * gw, rtol=1e-12, atol=1e-14)
        f_new = float(_logreg_loss(w0 - eta * gw, b0 - eta * gb, x[batch], y[batch]))
        assert f_new <= f0.item() - c * eta * gsq
        if m > 0:
            bigger = eta / beta
            f_big = float(_logreg_loss(w0 - bigger * gw, b0 - bigger * gb, x[batch], y[batch]))
            assert f_big > f0.item() - c * bigger * gsq
        if reset != "last":
            assert eta <= 20.0 * (1 + 1e-12)


# ---------------------------------------------------------------------------------------------------------- edge cases
def test_zero_gradient_takes_no_step_and_keeps_previous_step():
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last")
    closure = quadratic([w], [torch.tensor([3.0], dtype=DT)])
    opt.zero_grad()
    opt.step(closure)  # accepts 0.5
    with torch.no_grad():
        w.zero_()
    opt.zero_grad()
    opt.step(closure)
    assert opt.last_step == {"step_size": 0.0, "backtracks": 0, "forwards": 1, "backwards": 1}
    assert w.item() == 0.0
    assert opt.get_client_state() == {"step_size": 0.5, "accepted_step_size": 0.5}


def test_exhausted_backtracking_leaves_parameters_unchanged():
    """½·1000·w²: η* = 2·0.9/1000 = 0.0018, below the whole grid 1, 0.5, 0.25, 0.125 (max_backtracks = 3)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last", max_backtracks=3)
    opt.zero_grad()
    loss = opt.step(quadratic([w], [torch.tensor([1000.0, 1000.0], dtype=DT)]))
    assert float(loss) == 2500.0
    assert opt.last_step == {"step_size": 0.0, "backtracks": 4, "forwards": 5, "backwards": 1}
    assert w.detach().tolist() == [1.0, 2.0]
    assert opt.get_client_state()["step_size"] == pytest.approx(0.5**4)  # next search continues below the grid
    assert opt.get_client_state()["accepted_step_size"] is None  # ...but that grid point was never accepted


@pytest.mark.parametrize("bad", ["loss", "grad"])
def test_non_finite_loss_or_gradient_leaves_parameters_unchanged(bad):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=DT))
    opt = SgdArmijo([w], eta_max=1.0, reset="last")
    opt.zero_grad()
    opt.step(lambda: (w * w).sum())
    before, prev = w.detach().clone(), opt.get_client_state()
    if bad == "loss":
        closure = lambda: (w * w).sum() * float("nan")  # noqa: E731
    else:  # finite loss, NaN gradient: d/dx sqrt(|x|) at 0 is inf, times sign(0) = 0 -> nan
        closure = lambda: 1.0 + torch.sqrt((w - before).abs().sum())  # noqa: E731
    opt.zero_grad()
    loss = opt.step(closure)
    assert math.isnan(opt.last_step["step_size"])
    assert opt.last_step["forwards"] == 1
    torch.testing.assert_close(w.detach(), before, rtol=0, atol=0)
    assert opt.get_client_state() == prev
    assert math.isfinite(float(loss)) == (bad == "grad")


def test_non_finite_trial_loss_is_rejected():
    """f(w) = ½w² but inf for |w| > 1.5: from w = 1 the trial η = 4 (w = -3) is inf and rejected, then 2 (w = -1)
    satisfies Armijo? ½ ≤ ½ − 0.1·2·1 fails; η = 1 (w = 0): 0 ≤ 0.5 − 0.1 passes -> accepted 1 after 2 rejections."""
    w = torch.nn.Parameter(torch.tensor(1.0, dtype=DT))
    opt = SgdArmijo([w], eta_max=4.0, c=0.1, beta=0.5)

    def closure():
        return torch.where(w.abs() > 1.5, torch.tensor(float("inf"), dtype=DT), 0.5 * w * w)

    opt.zero_grad()
    opt.step(closure)
    assert opt.last_step["step_size"] == 1.0 and opt.last_step["backtracks"] == 2
    assert w.item() == 0.0


def test_trials_replay_the_gradient_evaluation_randomness():
    """Dropout-like randomness: every trial sees the gradient evaluation's mask, and afterwards the RNG continues as
    if only the gradient evaluation had drawn numbers."""
    torch.manual_seed(123)
    w = torch.nn.Parameter(torch.ones(50, dtype=DT))
    masks = []

    def closure():
        mask = (torch.rand(50) > 0.5).to(DT)
        masks.append((torch.is_grad_enabled(), mask))
        return 0.5 * 25.0 * (mask * w * w).sum()

    opt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5)
    torch.manual_seed(7)
    expected_mask = (torch.rand(50) > 0.5).to(DT)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    opt.zero_grad()
    opt.step(closure)
    assert opt.last_step["backtracks"] >= 1  # a = 25: several trials were needed
    assert masks[0][0] and not any(g for g, _ in masks[1:])
    for _, m in masks:
        torch.testing.assert_close(m, expected_mask)
    torch.testing.assert_close(torch.rand(3), expected_next)


def test_carry_step_size_across_instances():
    """The FederatedLoop's persistence: get_client_state of one round's optimizer given to the next one."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    closure = quadratic([w], [torch.tensor([3.0], dtype=DT)])
    first = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last", carry_step_size=True)
    first.zero_grad()
    first.step(closure)
    state = first.get_client_state()
    assert state == {"step_size": 0.5, "accepted_step_size": 0.5}
    for carry, backtracks in ((True, 0), (False, 1)):  # without carrying, the round restarts at η_max (Alg. 3, k = 1)
        nxt = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last", carry_step_size=carry)
        nxt.set_client_state(state)
        nxt.zero_grad()
        nxt.step(closure)
        assert nxt.last_step["step_size"] == 0.5 and nxt.last_step["backtracks"] == backtracks
    sd = nxt.state_dict()
    again = SgdArmijo([w], eta_max=1.0, c=0.1, beta=0.5, reset="last", carry_step_size=True)
    again.load_state_dict(sd)
    assert again.get_client_state() == {"step_size": 0.5, "accepted_step_size": 0.5}


def test_grow_needs_epoch_length():
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo([w], reset="grow")
    with pytest.raises(ValueError, match="n_batches_per_epoch"):
        opt.step(lambda: (w * w).sum())
    opt.set_client_data(num_samples=40, batch_size=10)  # what the FederatedLoop does: b/n = 1/4
    opt.zero_grad()
    opt.step(quadratic([w], [torch.tensor([3.0], dtype=DT)]))
    assert opt.initial_step_size() == pytest.approx(min(opt.last_step["step_size"] * 2.0**0.25, 1.0))
    explicit = SgdArmijo([w], reset="grow", batch_size=5, num_samples=40)
    explicit.set_client_data(num_samples=40, batch_size=10)  # the explicit value wins
    assert explicit._epoch_exponent("x") == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "eta_max,expected",
    [
        # 1-D a = 0.4, c = 0.1, β = 0.5: η* = 2·0.9/0.4 = 4.5; init 1, δ = 2 per step (one batch per epoch).
        # Cap 10: 1, 2, 4 accepted, then 8 rejected -> 4 (the step grows past its first value)
        (10.0, [(1.0, 0), (2.0, 0), (4.0, 0), (4.0, 1)]),
        # cap 1.5: 1 ok, min(2, 1.5) = 1.5 ok, then 1.5 again
        (1.5, [(1.0, 0), (1.5, 0), (1.5, 0), (1.5, 0)]),
    ],
)
def test_init_step_size_starts_below_the_cap_and_grows(eta_max, expected):
    """Seed 002's reference code starts at init_step_size = 1 and grows from there; eta_max stays the cap."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    opt = SgdArmijo(
        [w], eta_max=eta_max, init_step_size=1.0, c=0.1, beta=0.5, reset="grow", delta=2.0, n_batches_per_epoch=1
    )
    closure = quadratic([w], [torch.tensor([0.4], dtype=DT)])
    value = 1.0
    for eta, backtracks in expected:
        opt.zero_grad()
        opt.step(closure)
        value *= 1 - 0.4 * eta
        assert opt.last_step["step_size"] == eta and opt.last_step["backtracks"] == backtracks
        assert w.item() == pytest.approx(value, rel=1e-14)
    # a new round (the loop builds a new optimizer) starts at init_step_size again, or carries the last step
    fresh = SgdArmijo([w], eta_max=eta_max, init_step_size=1.0, reset="grow", n_batches_per_epoch=1)
    assert fresh.initial_step_size() == 1.0
    carried = SgdArmijo(
        [w], eta_max=eta_max, init_step_size=1.0, reset="last", n_batches_per_epoch=1, carry_step_size=True
    )
    assert carried.initial_step_size() == 1.0
    carried.set_client_state(opt.get_client_state())
    assert carried.initial_step_size() == expected[-1][0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(eta_max=1.0, init_step_size=2.0, reset="grow"), r"init_step_size=2\.0 exceeds eta_max=1\.0"),
        (dict(eta_max=1.0, init_step_size=0.5, reset="max"), r"init_step_size=0\.5 has no effect with reset='max'"),
        (dict(eta_max=1.0, carry_step_size=True), r"carry_step_size=True has no effect with reset='max'"),
        (dict(init_step_size=0.0, reset="grow"), "init_step_size"),
        (dict(init_step_size=float("nan"), reset="grow"), "init_step_size"),
    ],
)
def test_bad_init_step_size_is_refused(kwargs, match):
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=DT))
    with pytest.raises(ValueError, match=match):
        SgdArmijo([w], **kwargs)


# ---------------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"c": 0.0}, "c must"),
        ({"c": -0.1}, "c must"),
        ({"c": 1.0}, "c must"),
        ({"c": float("nan")}, "c must"),
        ({"beta": 0.0}, "beta"),
        ({"beta": 1.0}, "beta"),
        ({"beta": 1.5}, "beta"),
        ({"eta_max": 0.0}, "eta_max"),
        ({"eta_max": -1.0}, "eta_max"),
        ({"eta_max": float("inf")}, "eta_max"),
        ({"reset": "sometimes"}, "reset"),
        ({"reset": 1}, "reset"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.5}, "delta"),
        ({"max_backtracks": -1}, "max_backtracks"),
        ({"max_backtracks": 2.5}, "max_backtracks"),
        ({"max_backtracks": True}, "max_backtracks"),
        ({"n_batches_per_epoch": 0}, "n_batches_per_epoch"),
        ({"n_batches_per_epoch": -2.0}, "n_batches_per_epoch"),
        ({"batch_size": 10}, "together"),
        ({"batch_size": 0, "num_samples": 5}, "batch_size"),
        ({"n_batches_per_epoch": 2, "batch_size": 10, "num_samples": 20}, "either"),
        ({"grad_tol": -1.0}, "grad_tol"),
    ],
)
def test_bad_arguments(kwargs, match):
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=match):
        SgdArmijo([w], **kwargs)


def test_bad_types_and_closure():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="eta_max"):
        SgdArmijo([w], eta_max="1")
    with pytest.raises(ValueError, match="override 'c'"):
        SgdArmijo([{"params": [w], "c": 0.5}], c=0.1)
    opt = SgdArmijo([w])
    with pytest.raises(TypeError, match="closure"):
        opt.step()
    with pytest.raises(TypeError, match="scalar"):
        opt.step(lambda: w * 2)
    with pytest.raises(RuntimeError, match="require grad"):
        opt.step(lambda: (w * w).sum().detach())
    with pytest.raises(ValueError, match="step_size"):
        opt.set_client_state({"step_size": -1.0})


def test_failing_trial_evaluation_restores_the_parameters():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=DT))
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        if len(calls) == 3:
            raise RuntimeError("out of memory in the second trial")
        return 0.5 * 100 * (w * w).sum()

    opt = SgdArmijo([w], eta_max=1.0, beta=0.5)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="second trial"):
        opt.step(closure)
    assert w.detach().tolist() == [1.0, 2.0]
