"""Each sequential client's local steps and each vectorised engine's padded steps take one path, chosen once.

* sequential clients: the step plan (``client._StepPlan``) picks the lean loop exactly when the client has no
  objective terms, per-step hooks or closure-based optimizer and reference mode is off, reading reference mode once
  per client; the lean and the general loop, run from the same weights on the same batches (a skipped step and
  gradient clipping included), take the same steps bit for bit;
* vectorised engine: the padded path is chosen once per engine (each probe runs once, however many padded steps
  follow), and loss interception that fails on a later step gives way to the per-sample path for good, which
  trains what sequential training trains.
"""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedlightning.client as client_module
from fedlightning import set_reference_mode
from fedlightning.client import LocalTrainer, _general_steps, _lean_steps
from fedlightning.optim import SgdArmijo
from fedlightning.user_module import ClientHooks
from fedlightning.vectorized.call import _ModelCall
from fedlightning.vectorized.rows import _InterceptedRows, _ProtocolRows, _SampleRows
from registry import CLIENT_OPTIMIZERS
from test_vectorized import ROUNDS, assert_same_run, fit, mlp
from test_vectorized_user_losses import UserMLP

STEPS, BATCH = 6, 8


class Net(pl.LightningModule):
    """A small classifier whose ``training_step`` returns None at step ``skip`` (Lightning's skipped step)."""

    def __init__(self, skip=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.skip = skip

    def training_step(self, batch, batch_idx):
        if batch_idx == self.skip:
            return None
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class HookedNet(Net):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen = getattr(self, "seen", 0) + 1


def _batches():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(STEPS * BATCH, 6, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g)
    return [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(STEPS)]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.3),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


@pytest.mark.parametrize(
    "case,lean",
    [("sgd", True), ("adam", True), ("terms", False), ("hooks", False), ("armijo", False), ("reference", False)],
)
def test_the_plan_takes_the_lean_loop_only_without_terms_hooks_closures_or_reference_mode(case, lean):
    model = HookedNet() if case == "hooks" else Net()
    trainer = LocalTrainer(model, hooks=ClientHooks(model) if case == "hooks" else None)
    if case == "armijo":
        opt = SgdArmijo(trainer.params)
    else:
        opt = OPTIMIZERS["adam" if case == "adam" else "sgd"](trainer.params)
    terms = [lambda params: params[0].sum() * 0.0] if case == "terms" else ()
    set_reference_mode(case == "reference")
    try:
        plan = trainer._plan(opt, terms)
    finally:
        set_reference_mode(None)
    assert plan.lean is lean and plan.reference is (case == "reference")
    # the fast gradient clearing and the one-_foreach_add_ SGD step follow reference mode, not the loop taken
    fast_sgd = case in ("sgd", "terms", "hooks")
    assert (getattr(plan.optimizer_step, "func", None) is client_module._plain_sgd_step) is fast_sgd
    assert (getattr(plan.zero_grad, "func", None) is client_module._drop_grads) is (case != "reference")


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.05])
def test_lean_and_general_loops_take_the_same_steps(opt, clip):
    def run(steps):
        trainer = LocalTrainer(Net(skip=2), grad_clip=clip)
        plan = trainer._plan(OPTIMIZERS[opt](trainer.params), ())
        assert plan.lean
        start = torch.cat([p.detach().reshape(-1) for p in trainer.params])
        tally = steps(plan, _batches())
        return start, torch.cat([p.detach().reshape(-1) for p in trainer.params]), tally

    start, lean_w, lean = run(_lean_steps)
    _, general_w, general = run(_general_steps)
    assert not torch.equal(start, lean_w)  # they trained
    assert torch.equal(lean_w, general_w)
    # every step counts, the skipped one has no loss, backward or step size
    assert (lean.steps_run, lean.forwards, lean.backwards, len(lean.losses)) == (STEPS, STEPS, STEPS - 1, STEPS - 1)
    assert (general.steps_run, general.forwards, general.backwards) == (lean.steps_run, lean.forwards, lean.backwards)
    assert lean.step_sizes == general.step_sizes and len(lean.step_sizes) == STEPS - 1
    assert torch.equal(torch.stack(lean.losses), torch.stack(general.losses))


def test_reference_mode_is_read_once_per_client(monkeypatch):
    reads = []
    monkeypatch.setattr(client_module, "reference_mode", lambda: reads.append(1) or False)
    trainer = LocalTrainer(Net())
    opt = OPTIMIZERS["sgd"](trainer.params)
    params = [p.detach().clone() for p in trainer.params]
    flat = torch.cat([p.reshape(-1) for p in params])
    update = trainer.run(0, 0, 0, params, [], flat, _batches(), opt, STEPS, STEPS * BATCH)
    assert update.num_steps == STEPS and not update.failed
    assert len(reads) == 1


def _counting(monkeypatch, name):
    calls = []
    original = getattr(_ModelCall, name)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_ModelCall, name, counted)
    return calls


@pytest.mark.parametrize(
    "model_fn,probe,path",
    [
        (UserMLP, "_check_interception", _InterceptedRows),
        (mlp, "_check_per_sample_protocol", _ProtocolRows),
    ],
)
def test_the_padded_path_is_chosen_once_per_engine(monkeypatch, model_fn, probe, path):
    """The path is chosen on the engine's first padded step and kept; loss interception's check runs again on each
    later round's first padded step, on the step's own result (``rows.recheck_intercepted_rows``), the protocol's
    choice once."""
    calls = _counting(monkeypatch, probe)
    rechecks = _counting(monkeypatch, "_recheck_interception")
    run = fit(model_fn(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    call = run[1].vectorized_engine.call
    assert isinstance(call.padded_rows, path)
    assert len(calls) == 1
    assert len(rechecks) == (ROUNDS - 1 if path is _InterceptedRows else 0)


class LateAccuracy(UserMLP):
    """Logs a batch accuracy (a batch mean loss interception cannot split per sample) from step 2 on only: the
    first padded steps run through loss interception, a later one cannot."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if batch_idx >= 2:
            self.log("train_acc", (logits.argmax(1) == y).float().mean())
        return loss


@pytest.mark.numerics
def test_interception_failing_on_a_later_step_gives_way_to_the_per_sample_path_for_good(monkeypatch):
    import fedlightning.vectorized.rows as rows

    calls = _counting(monkeypatch, "_check_interception")
    said = []
    monkeypatch.setattr(rows, "_info", said.append)
    vec = fit(LateAccuracy(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    call = vec[1].vectorized_engine.call
    assert len(calls) == 1  # chosen once: interception ran padded steps first, then gave way
    assert len(said) == 2 and "by loss interception" in said[0] and "once per sample" in said[1], said
    assert isinstance(call.padded_rows, _SampleRows) and call.intercept is False
    assert "'train_acc'" in call.padded_path_reason and "per-sample" in call.probed
    assert_same_run(fit(LateAccuracy(), CLIENT_OPTIMIZERS["sgd"], "sequential"), vec)
