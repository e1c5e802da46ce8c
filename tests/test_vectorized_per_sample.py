"""The per-sample protocol of the vectorised engine (``training_step_per_sample``).

On steps where the round's clients have batches of different sizes, the engine needs each client's mean loss over
its real samples. Without the protocol every sample is one ``training_step`` call on a batch of one (an inner
vmap); with it, one batched call returns the per-sample losses. Checked here:

* both paths train the same model as sequential mode (and each other) for SGD, SgdArmijo and SPS, and the engine
  really took the path it was meant to;
* ``Classifier.training_step_per_sample`` against ``training_step`` on each sample alone and against a hand-written
  log-softmax, including sequence outputs with ``ignore_index``;
* which models may use the protocol (a subclass that overrides ``training_step`` only must not);
* a protocol that disagrees with ``training_step`` or returns the wrong shape is refused with the values named.

Different computations of the same numbers are compared in float64 (tests/numerics.py).
"""

import copy

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from fedlightning.models import MLP, Classifier
from fedlightning.vectorized.support import _per_sample_protocol
from numerics import assert_close64, assert_rounding_close, flat, rtol32, to_float64
from registry import CLIENT_OPTIMIZERS
from test_vectorized import assert_same_run, fit, mlp


class GenericMLP(MLP):
    """The same network with ``training_step`` overridden (same loss): the protocol inherited from Classifier no
    longer applies, and the returned loss is a product (the same value), not an intercepted loss output
    (``fedlightning.vectorized.losses``), so the engine takes the generic per-sample path."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1.0


def generic_mlp(float64=True):
    model = GenericMLP(input_dim=64, hidden=[16], num_classes=10)
    model.load_state_dict(mlp(float64=False).state_dict())
    return to_float64(model) if float64 else model


def engine_of(run):
    return run[1].vectorized_engine


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sgd", "armijo", "sps"])
def test_protocol_and_generic_paths_equal_sequential(name):
    optimizer = CLIENT_OPTIMIZERS[name]
    seq = fit(mlp(), optimizer, "sequential")
    fast = fit(mlp(), optimizer, "vectorized")
    generic = fit(generic_mlp(), optimizer, "vectorized")
    assert "per-sample protocol" in engine_of(fast).call.probed and "per-sample" not in engine_of(fast).call.probed
    generic_paths = engine_of(generic).call.probed
    assert "per-sample" in generic_paths and "per-sample protocol" not in generic_paths
    assert_same_run(seq, fast)
    assert_same_run(seq, generic)
    assert_close64(fast[0], generic[0])


def test_logged_client_metrics_match_on_both_paths():
    """The logged float32 values' round mean (CPR·K values) agrees to numerics.rtol32(CPR·K + 1)."""
    from test_vectorized import CPR, K

    opt = CLIENT_OPTIMIZERS["sgd"]
    seq = fit(mlp(), opt, "sequential", rounds=2)[3].callback_metrics["client/train/batch_loss"]
    for model in (mlp(), generic_mlp()):
        vec = fit(model, opt, "vectorized", rounds=2)[3].callback_metrics["client/train/batch_loss"]
        assert float(vec) == pytest.approx(float(seq), rel=rtol32(CPR * K + 1))


class TokenTagger(Classifier):
    """A sequence classifier: a label per token, ``logits`` of shape (N, T, C)."""

    def __init__(self, ignore_index=None):
        super().__init__(num_classes=5, ignore_index=ignore_index)
        self.net = nn.Sequential(nn.Embedding(7, 6), nn.Tanh(), nn.Linear(6, 5))


def reference_losses(logits, y, ignore_index):
    """Per-sample mean over non-ignored tokens of −log softmax(logits)[y], written out by hand in float64."""
    logp = logits.double() - logits.double().exp().sum(-1, keepdim=True).log()
    valid = torch.ones_like(y, dtype=torch.bool) if ignore_index is None else y != ignore_index
    picked = torch.where(valid, y, 0)
    nll = -logp.gather(-1, picked.unsqueeze(-1)).squeeze(-1) * valid
    return nll.sum(1) / valid.sum(1)


@pytest.mark.parametrize("ignore_index", [None, 4])
def test_classifier_per_sample_losses_sequences(ignore_index):
    torch.manual_seed(0)
    model = TokenTagger(ignore_index).double()
    x = torch.randint(0, 7, (5, 8))
    y = torch.randint(0, 5, (5, 8))
    if ignore_index is not None:
        y[1, :5] = ignore_index  # a sample with some tokens ignored
        y[3] = ignore_index  # every token ignored: 0/0, as training_step on that sample alone
    model.log = lambda *a, **k: None  # outside a Trainer
    with torch.no_grad():
        per = model.training_step_per_sample((x, y), 0)
        alone = torch.stack([model.training_step((x[j : j + 1], y[j : j + 1]), 0) for j in range(5)])
        ref = reference_losses(model(x), y, ignore_index)
    assert per.shape == (5,)
    assert_close64(per, alone)
    assert_close64(per, ref)
    if ignore_index is not None:
        assert torch.isnan(per[3]) and torch.isfinite(per[[0, 1, 2, 4]]).all()


class FlatIgnoring(Classifier):
    """One label per sample, with ignore_index."""

    def __init__(self):
        super().__init__(num_classes=5, ignore_index=4)
        self.net = nn.Linear(3, 5)


def test_classifier_per_sample_losses_flat_outputs_with_ignored_labels():
    """An ignored label: training_step on that sample alone is 0/0 (nan), and so is its per-sample loss."""
    torch.manual_seed(5)
    model = FlatIgnoring().double()
    model.log = lambda *a, **k: None
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([1, 4, 2, 0])
    with torch.no_grad():
        per = model.training_step_per_sample((x, y), 0)
        alone = torch.stack([model.training_step((x[j : j + 1], y[j : j + 1]), 0) for j in range(4)])
        ref = reference_losses(model(x).unsqueeze(1), y.unsqueeze(1), 4)
    assert torch.isnan(per[1]) and torch.isnan(alone[1]) and torch.isfinite(per[[0, 2, 3]]).all()
    assert_close64(per, alone)
    assert_close64(per, ref)


def test_classifier_per_sample_losses_flat_outputs():
    torch.manual_seed(1)
    model = MLP(input_dim=64, hidden=[16], num_classes=10).double()
    model.log = lambda *a, **k: None
    x, y = torch.randn(6, 64, dtype=torch.float64), torch.randint(0, 10, (6,))
    with torch.no_grad():
        per = model.training_step_per_sample((x, y), 0)
        ref = reference_losses(model(x).unsqueeze(1), y.unsqueeze(1), None)
        batch = model.training_step((x, y), 0)
    assert_close64(per, ref)
    assert_close64(per.mean(), batch)


# ---------------------------------------------------------------------------------------------- who may use it
class BothOverridden(MLP):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)

    def training_step_per_sample(self, batch, batch_idx):
        return super().training_step_per_sample(batch, batch_idx)


class PlainModule(nn.Module):
    def training_step(self, batch, batch_idx):
        return batch.sum()


def test_which_models_use_the_protocol():
    assert _per_sample_protocol(mlp()) is not None  # Classifier defines both
    assert _per_sample_protocol(BothOverridden()) is not None
    assert _per_sample_protocol(generic_mlp()) is None  # training_step overridden below the protocol
    assert _per_sample_protocol(PlainModule()) is None  # no protocol


# ---------------------------------------------------------------------------------------------- bad protocols
class Doubled(MLP):
    """A protocol that disagrees with training_step (twice the loss)."""

    def training_step_per_sample(self, batch, batch_idx):
        return 2 * super().training_step_per_sample(batch, batch_idx)


class Averaged(MLP):
    """A protocol that returns the batch mean instead of one loss per sample."""

    def training_step_per_sample(self, batch, batch_idx):
        return super().training_step_per_sample(batch, batch_idx).mean()


@pytest.mark.parametrize(
    "cls,match",
    [
        (Doubled, r"disagrees with training_step: per-sample losses \[[0-9.]+"),
        (Averaged, r"one loss per sample \(a tensor of shape \(\d+,\)"),
    ],
)
def test_bad_protocols_are_refused_with_the_values(cls, match):
    model = cls(input_dim=64, hidden=[16], num_classes=10)
    model.load_state_dict(mlp().state_dict())
    with pytest.raises(ValueError, match=match):
        fit(model, CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=1)
    with pytest.raises(ValueError, match=match):  # not a reason to fall back: the model is wrong, not unsupported
        fit(model, CLIENT_OPTIMIZERS["sgd"], "auto", rounds=1)


def test_models_with_random_layers_skip_the_check_and_are_reproducible():
    """Dropout draws differ between one batched call and single-sample calls, so the check is skipped (it would
    refuse a correct protocol); runs stay reproducible from the seed."""
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[32], dropout=0.5)
    opt = CLIENT_OPTIMIZERS["armijo"]
    a = fit(copy.deepcopy(model), opt, "vectorized", rounds=2)
    b = fit(copy.deepcopy(model), opt, "vectorized", rounds=2)
    assert "per-sample protocol" in engine_of(a).call.probed
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)


@pytest.mark.parametrize("ignore_index", [None, 3])
def test_token_losses_equal_cross_entropy_bit_for_bit(ignore_index):
    torch.manual_seed(2)
    model = TokenTagger(ignore_index)
    logits, y = torch.randn(40, 5) * 3, torch.randint(0, 5, (40,))
    kw = {} if ignore_index is None else {"ignore_index": ignore_index}
    expected = torch.nn.functional.cross_entropy(logits, y, reduction="none", **kw)
    assert torch.equal(model._token_losses(logits, y), expected)
    if ignore_index is not None:
        assert (expected[y == ignore_index] == 0).all() and (y == ignore_index).any()


# ---------------------------------------------------------------------------------------------- mixed precision
def test_token_losses_follow_cross_entropy_under_autocast():
    """CPU autocast runs cross_entropy in float32 but leaves log_softmax in bfloat16: the per-sample losses upcast
    first, so they are cross_entropy's float32 numbers, not bfloat16 ones."""
    torch.manual_seed(3)
    model = TokenTagger()
    x, w = torch.randn(16, 6), torch.randn(5, 6)
    y = torch.randint(0, 5, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(x, w)
        assert logits.dtype == torch.bfloat16
        expected = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        got = model._token_losses(logits, y)
    assert expected.dtype == got.dtype == torch.float32
    assert torch.equal(got, expected)


def fit_bf16(model, mode):
    from conftest import make_trainer
    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from test_vectorized import digits

    model = copy.deepcopy(model)
    loop = FederatedLoop(
        model,
        client_optimizer=CLIENT_OPTIMIZERS["sgd"],
        local_steps=5,
        clients_per_round=6,
        seed=3,
        client_execution=mode,
    )
    make_trainer(2, callbacks=[FedAvg()], precision="bf16-mixed").fit(loop, datamodule=digits(float64=False))
    return flat(model), loop


@pytest.mark.numerics
def test_bf16_mixed_uses_the_protocol_and_stays_close_to_sequential():
    """The once-per-engine check runs without autocast, so bf16 rounding (the same product on batches of different
    shapes) does not reject a correct protocol; a wrong one is still refused. Both modes' bf16 runs are roundings
    of the same float64 run: the vectorised one is within k times the sequential one's bf16 error of it."""
    seq, _ = fit_bf16(mlp(float64=False), "sequential")
    vec, loop = fit_bf16(mlp(float64=False), "vectorized")
    exact = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=2)[0]  # the same run in float64
    assert "per-sample protocol" in loop.vectorized_engine.call.probed
    assert (exact - flat(mlp())).abs().max() > 1e-2  # trained
    assert_rounding_close(vec, seq, exact)  # bf16 matmuls: rounding, not another objective
    doubled = Doubled(input_dim=64, hidden=[16], num_classes=10)
    doubled.load_state_dict(mlp().state_dict())
    with pytest.raises(ValueError, match="disagrees with training_step"):
        fit_bf16(doubled, "vectorized")


class PlainUserNet(pl.LightningModule):
    """A user's module: a linear layer, ReLU, a linear head and F.cross_entropy (mean) in training_step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def first_losses_bf16_mixed(mode):
    from conftest import make_trainer
    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import IID
    from test_vectorized import Recorder, digits

    rec = Recorder()
    loop = FederatedLoop(
        PlainUserNet(),
        client_optimizer=CLIENT_OPTIMIZERS["sgd"],
        local_steps=2,
        clients_per_round=6,
        seed=3,
        client_execution=mode,
    )
    dm = digits(partition=IID(), batch_size=10, num_clients=30, float64=False)  # ≥ 20 samples each: whole batches
    make_trainer(2, callbacks=[FedAvg(), rec], precision="bf16-mixed").fit(loop, datamodule=dm)
    return torch.tensor([u.first_loss for u in rec.updates], dtype=torch.float64), loop


def test_bf16_mixed_whole_batches_compute_the_loss_in_float32_as_sequentially():
    """Under vmap torch computes F.cross_entropy of bf16-mixed logits in bfloat16, where autocast computes it in
    float32 outside vmap; the engine restores autocast's float32 for the standard losses. Every loss of the
    vectorised run was a bfloat16 number (half-ulp 2^-9 relative); now the modes differ by float32 rounding of the
    same bf16 logits, far below a bfloat16 rounding of the loss."""
    seq, _ = first_losses_bf16_mixed("sequential")
    vec, loop = first_losses_bf16_mixed("vectorized")
    assert loop.vectorized_engine is not None and len(vec) == len(seq) == 12
    assert (vec != vec.to(torch.bfloat16).double()).any()  # not bfloat16 values
    on_cpu = isinstance(loop.trainer.accelerator, pl.accelerators.CPUAccelerator)
    if on_cpu:  # (a GPU's bf16 matrix products of other shapes round some logits differently)
        assert ((vec - seq).abs() / seq.abs()).max() < 2.0**-12  # a bfloat16 rounding is up to 2^-9


# ---------------------------------------------------------------------------------------------- padded gradients
@pytest.mark.numerics
@pytest.mark.parametrize("protocol", [True, False], ids=["protocol", "generic"])
def test_padded_step_losses_and_gradients_equal_per_client_autograd(protocol):
    """One padded step of the engine (clients of 3, 7, 1 and 5 samples) against plain autograd on each client's
    real samples alone: loss = training_step on the client's batch, gradient of that loss. The engine starts its
    backward pass from the weighted cells Σ ℓ_ij m_ij / n_i; the logged train/batch_loss is the per-client sum.
    In float64: the padded batch sums in another order than autograd on the client's samples alone. The logged
    sums are float32 (as Lightning logs): one rounding (numerics.rtol32(1))."""
    from torch.utils._pytree import tree_flatten

    from fedlightning.vectorized import VectorizedClientTrainer
    from fedlightning.vectorized.batches import _padded_positions
    from fedlightning.vectorized.layout import _Layout
    from fedlightning.vectorized.step import _StepEvaluator

    torch.manual_seed(4)
    model = mlp() if protocol else generic_mlp()
    engine = VectorizedClientTrainer(copy.deepcopy(model))
    engine.model.train()
    sizes = [3, 7, 1, 5]
    x, y = torch.randn(sum(sizes), 64, dtype=torch.float64), torch.randint(0, 10, (sum(sizes),))
    position = torch.from_numpy(_padded_positions(sizes))
    C = len(sizes)
    layout = _Layout([x[position].view(C, -1, 64), y[position].view(C, -1)], tree_flatten((x, y))[1], sizes)
    w0 = flat(model)
    W = torch.stack([w0 + 0.05 * torch.randn_like(w0) for _ in range(C)])  # every client its own weights
    sink = []
    ev = _StepEvaluator(engine, layout, 0, None, [], sink, trials=False)
    losses, grads = ev.gradient(W, torch.ones(C, dtype=torch.bool))
    assert engine.call.probed == {"per-sample protocol" if protocol else "per-sample"}

    reference = copy.deepcopy(model)
    reference.log = lambda *a, **k: None
    params = list(reference.parameters())
    ends = np.cumsum(sizes)
    for c, (n, end) in enumerate(zip(sizes, ends)):
        torch.nn.utils.vector_to_parameters(W[c], params)
        loss = reference.training_step((x[end - n : end], y[end - n : end]), 0)
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        assert_close64(losses[c], loss.detach())
        assert_close64(engine.weights.logical(grads[c : c + 1])[0], g)
    ((name, logged),) = sink[0][0]
    assert name == "train/batch_loss"
    assert logged.dtype == torch.float64  # a float64 model's logged value keeps its dtype, as a sequential client's
    assert_close64(logged / torch.tensor(sizes, dtype=torch.float64), losses)
