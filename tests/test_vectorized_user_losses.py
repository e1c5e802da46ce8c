"""Per-sample loss interception (``fedlightning.vectorized.losses``): the vectorised engine's fast path for padded
steps of modules written as users write them (``F.cross_entropy(logits, y)``, no ``training_step_per_sample``).

Checked here:

* every intercepted loss, called on a padded batch (also batched over rows with different masks under ``vmap``),
  equals torch's own function on the real samples alone (class weights, ``ignore_index``, label smoothing,
  probability targets, the ``nn`` modules), and calls it does not recognise run unchanged;
* a user-written MLP, a small CNN, an MSE regression module and a module with a per-token and a frozen linear
  layer train to the weights of sequential training (in float64, to numerics.RTOL64) on ragged Dirichlet splits with
  K = 5, for SGD and SgdArmijo, and the engine took the fast path;
* modules it must not take (a logged value it cannot split per sample, a forward pass that mixes samples) fall back
  to the generic path with the reason recorded, and the fallback trains exactly what the generic path trains
  (dropout masks included: the attempt's random draws are undone).
"""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from fedlightning.vectorized import VectorizedClientTrainer
from fedlightning.vectorized.losses import LossInterception
from numerics import RTOL64, assert_rounding_close, rtol32
from registry import CLIENT_OPTIMIZERS
from test_vectorized import CPR, K, assert_same_run, fit

N, REAL, C = 7, 4, 5


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, 3, dtype=torch.double, generator=g)
    y = torch.randint(0, C, (N, 3), generator=g)
    y[1, 2] = 3  # a target that ignore_index=3 drops
    w = torch.rand(C, dtype=torch.double, generator=g) + 0.1
    return _padded(x, REAL), _padded(y, REAL), w


def _padded(a: Tensor, k: int) -> Tensor:
    """``a``'s first ``k`` rows, repeated as the engine pads a client's batch: row ``j`` is row ``j mod k``."""
    return a[torch.arange(a.shape[0]) % k].clone()


X, Y, W = _data()
T = (X.flip(1) * 0.3).detach()
CASES = {
    "ce": lambda x, y, t: F.cross_entropy(x[:, :, 0], y[:, 0]),
    "ce-seq": lambda x, y, t: F.cross_entropy(x, y),
    "ce-weight-smooth": lambda x, y, t: F.cross_entropy(x, y, weight=W, label_smoothing=0.2),
    "ce-ignore-smooth": lambda x, y, t: F.cross_entropy(x, y, ignore_index=3, label_smoothing=0.1),
    "ce-module-weight-ignore": lambda x, y, t: nn.CrossEntropyLoss(weight=W, ignore_index=3)(x, y),
    "ce-probabilities": lambda x, y, t: F.cross_entropy(x, torch.softmax(2 * t, 1), weight=W, label_smoothing=0.1),
    "nll": lambda x, y, t: F.nll_loss(F.log_softmax(x, 1), y, weight=W),
    "mse": lambda x, y, t: F.mse_loss(x, t),
    "l1-module": lambda x, y, t: nn.L1Loss()(x, t),
    "smooth-l1": lambda x, y, t: F.smooth_l1_loss(x, t, beta=0.5),
    "huber-module": lambda x, y, t: nn.HuberLoss(delta=0.7)(x, t),
    "bce": lambda x, y, t: F.binary_cross_entropy(torch.sigmoid(x), (t > 0).double(), weight=W.view(1, C, 1)),
    "bce-logits": lambda x, y, t: F.binary_cross_entropy_with_logits(x, (t > 0).double(), pos_weight=W.view(C, 1)),
    "bce-logits-module": lambda x, y, t: nn.BCEWithLogitsLoss(weight=W.view(C, 1))(x, torch.sigmoid(t)),
    # flattened batches ([N·T, ...], sample-major, as reshape gives): a language model's token loss
    "ce-flat-ignore": lambda x, y, t: F.cross_entropy(x.transpose(1, 2).reshape(-1, C), y.reshape(-1), ignore_index=3),
    "ce-flat-weight-smooth": lambda x, y, t: F.cross_entropy(
        x.transpose(1, 2).reshape(-1, C), y.reshape(-1), weight=W, ignore_index=3, label_smoothing=0.2
    ),
    "nll-flat": lambda x, y, t: F.nll_loss(F.log_softmax(x.transpose(1, 2).reshape(-1, C), 1), y.reshape(-1)),
    "mse-flat": lambda x, y, t: F.mse_loss(x.reshape(-1), t.reshape(-1)),
    "bce-logits-flat": lambda x, y, t: F.binary_cross_entropy_with_logits(
        x.reshape(-1, 3), (t > 0).reshape(-1, 3).double()
    ),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_intercepted_loss_is_torchs_loss_on_the_real_samples(name):
    f = CASES[name]
    mask = (torch.arange(N) < REAL).double()
    x = X.clone().requires_grad_(True)
    interception = LossInterception(N, mask, mask.sum(), flattened=True)
    with interception:
        out = f(x, Y, T)
    cells = interception.cells_of(out)
    assert cells is not None and cells.shape == (N,) and not interception.unrecognised
    xr = X[:REAL].clone().requires_grad_(True)
    ref = f(xr, Y[:REAL], T[:REAL])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((cells * mask).sum() / REAL, ref, rtol=1e-12, atol=1e-12)
    # the gradient reaches the real samples only, and equals torch's
    out.backward()
    ref.backward()
    torch.testing.assert_close(x.grad[:REAL], xr.grad, rtol=1e-10, atol=1e-12)
    assert float(x.grad[REAL:].abs().max()) == 0.0


@pytest.mark.parametrize(
    "name",
    [
        "ce-module-weight-ignore",
        "ce-probabilities",
        "mse",
        "bce-logits",
        "ce-weight-smooth",
        "ce-flat-ignore",
        "mse-flat",
    ],
)
def test_intercepted_loss_under_vmap_rows_with_different_masks(name):
    """Rows of one batched call hold 4, 7 and 1 real samples; row r's loss is torch's on its own real samples."""
    f = CASES[name]
    counts = [4, 7, 1]
    masks = torch.stack([(torch.arange(N) < k).double() for k in counts])
    xs = torch.stack([_padded(a, k) for a, k in zip([X, X.roll(1, 0), 2 * X], counts)])
    ys = torch.stack([_padded(a, k) for a, k in zip([Y, Y.roll(2, 0), Y], counts)])
    ts = torch.stack([_padded(a, k) for a, k in zip([T, T, -T], counts)])

    def row(x, y, t, m):
        interception = LossInterception(N, m, m.sum(), flattened=True)
        with interception:
            out = f(x, y, t)
        assert interception.cells_of(out) is not None
        return out

    got = vmap(row)(xs, ys, ts, masks)
    want = torch.stack([f(xs[r, :k], ys[r, :k], ts[r, :k]) for r, k in enumerate(counts)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_merged_defaults_bind_as_the_signature_does(name, monkeypatch):
    """``torch.nn.functional`` hands a loss to the mode as ``f(input, target, **options)``: merged with the loss's
    defaults without ``inspect.Signature.bind`` (which a per-step call would pay), to the same output and cells, bit
    for bit, as binding the signature."""
    import inspect

    import fedlightning.vectorized.losses as losses

    f = CASES[name]
    mask = (torch.arange(N) < REAL).double()
    bind = inspect.Signature.bind
    binds = []
    monkeypatch.setattr(inspect.Signature, "bind", lambda self, *a, **k: binds.append(1) or bind(self, *a, **k))
    results = []
    for merged in (True, False):
        if not merged:
            monkeypatch.setattr(losses, "_TWO_ARGUMENT_CALLS", {})
        interception = LossInterception(N, mask, mask.sum(), flattened=True)
        with interception:
            out = f(X, Y, T)
        results.append((out, interception.cells_of(out), len(binds)))
    (a, cells_a, binds_merged), (b, cells_b, binds_total) = results
    assert binds_merged == 0 and binds_total > 0
    assert cells_a is not None and cells_b is not None
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(cells_a, cells_b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.cross_entropy(x[:, :, 0], Y[:, 0], reduction="sum"),  # not a mean
        lambda x: F.mse_loss(x[:, :, :1], x[:, :1, 0].unsqueeze(-1).expand(N, 1, 1)),  # shapes differ
        lambda x: F.mse_loss(x[0], T[0]),  # first dimension is not the batch
        lambda x: F.mse_loss(x, T, weight=torch.ones_like(T)),  # mse with weight: not recognised
        # flattened time-major ([T·N, C]) and two views concatenated: the padding rows' targets do not repeat
        lambda x: F.cross_entropy(x.permute(2, 0, 1).reshape(-1, C), Y.t().reshape(-1)),
        lambda x: F.cross_entropy(torch.cat([x[:, :, 0], x[:, :, 1]]), torch.cat([Y[:, 0], Y[:, 1]])),
    ],
)
def test_unrecognised_calls_run_unchanged(call):
    mask = (torch.arange(N) < REAL).double()
    interception = LossInterception(N, mask, mask.sum(), flattened=True)
    with interception:
        out = call(X)
    assert interception.cells_of(out) is None
    torch.testing.assert_close(out, call(X), rtol=0, atol=0)


def test_a_flattened_batch_is_read_per_sample_only_when_asked():
    """Without ``flattened`` (the engine's setting for models with random layers, whose check does not run) a
    ``[N·T, C]`` call is not recognised; with it, the same call is."""
    mask = (torch.arange(N) < REAL).double()
    for flattened in (False, True):
        interception = LossInterception(N, mask, mask.sum(), flattened=flattened)
        with interception:
            out = CASES["ce-flat-ignore"](X, Y, T)
        assert (interception.cells_of(out) is not None) is flattened


CLASS_CASES = ["ce", "ce-seq", "ce-weight-smooth", "ce-ignore-smooth", "ce-module-weight-ignore", "nll"]


@pytest.mark.parametrize("name", CLASS_CASES)
@pytest.mark.parametrize("batched", [False, True])
def test_class_losses_without_ignored_targets_skip_the_validity_mask_to_the_same_bits(name, batched, monkeypatch):
    """When no target equals ``ignore_index`` (checked on the CPU tensor holding every row's targets) the class
    losses take a shorter path without the validity mask and weight sums: the same loss and cells, bit for bit, as
    the general path. Targets that are ignored (``ignore_index=3`` here: ``Y`` holds a 3) keep the general path."""
    import fedlightning.vectorized.losses as losses

    f = CASES[name]
    counts = [4, 7, 1]
    masks = torch.stack([(torch.arange(N) < k).double() for k in counts])
    xs, ys = torch.stack([X, X.roll(1, 0), 2 * X]), torch.stack([Y, Y.roll(2, 0), Y])
    taken = []
    none_equal = losses._none_equal

    def run(general: bool):
        def recorded(t, v):
            taken.append(none_equal(t, v))
            return taken[-1]

        monkeypatch.setattr(losses, "_none_equal", (lambda t, v: False) if general else recorded)

        def row(x, y, m):
            interception = LossInterception(N, m, m.sum(), flattened=True)
            with interception:
                out = f(x, y, T)
            return out, interception.cells_of(out)

        if batched:
            return vmap(row)(xs, ys, masks)
        return row(xs[0], ys[0], masks[0])

    fast, general = run(False), run(True)
    assert taken and all(taken) == (name in ("ce", "ce-seq", "ce-weight-smooth", "nll"))
    for a, b in zip(fast, general):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_none_equal_reads_every_row_and_never_synchronises_a_device():
    """``_none_equal`` sees the targets of all rows under vmap (one row holding the value is enough), and answers
    False without looking on a device other than the CPU."""
    from fedlightning.vectorized.losses import _none_equal
    from fedlightning.vectorized.torch_internals import _physical

    y = torch.tensor([[0, 1, 2], [2, 1, -100]])
    assert _none_equal(y[0], -100) and not _none_equal(y, -100)
    assert vmap(lambda r: torch.tensor(_none_equal(r, -100)))(y).tolist() == [False, False]
    assert vmap(lambda r: torch.tensor(_none_equal(r, 5)))(y).tolist() == [True, True]
    assert vmap(lambda r: torch.tensor(_physical(r) is y))(y).tolist() == [True, True]
    assert vmap(vmap(lambda r: torch.tensor(_physical(r) is None)))(y).tolist() == [[True] * 3] * 2
    assert not _none_equal(torch.zeros(3, dtype=torch.long, device="meta"), -100)


def test_none_equal_answers_for_the_whole_round_tensor_while_it_is_unchanged(monkeypatch):
    """Steps' targets are views of the round's gathered targets: the whole tensor is checked once and the answer
    reused for its views, until the tensor is written (its version changes) or replaced; a view whose base holds the
    value elsewhere is checked itself."""
    from fedlightning.vectorized import losses

    round_targets = torch.arange(60).remainder(7)  # 4 steps of [3, 5]
    steps = [round_targets[15 * k : 15 * (k + 1)].view(3, 5) for k in range(4)]
    checked = []
    real_any = Tensor.any
    monkeypatch.setattr(Tensor, "any", lambda t, *a: checked.append(t.numel()) or real_any(t, *a))
    assert all(vmap(lambda r: torch.tensor(losses._none_equal(r, -100)))(y).all() for y in steps)
    assert checked == [60]  # the round tensor once, no step on its own
    steps[2][1, 4] = -100  # an ignored target written into step 2 (the round tensor's version changes)
    answers = [bool(vmap(lambda r: torch.tensor(losses._none_equal(r, -100)))(y).all()) for y in steps]
    assert answers == [True, True, False, True]
    assert checked == [60, 60, 15, 15, 15, 15]  # the base again, then each step itself (the base holds the value)
    fresh = torch.arange(60).remainder(7)
    assert losses._none_equal(fresh[:15], -100) and checked[-1] == 60  # another tensor: checked anew


def test_none_equal_answers_for_rows_gathered_from_a_checked_tensor(monkeypatch):
    """A line search's trial rows are gathered (``index_select``) from the step's targets into a reusable buffer: a
    value the step's targets were found not to hold is not looked for in those rows again, while the buffer holds
    that gather; rows gathered from targets that hold it, a buffer written since, and a view reaching past the
    gathered rows are checked themselves (and answer correctly)."""
    from fedlightning.vectorized import losses

    round_targets = torch.arange(60).remainder(7)
    step = round_targets[:15].view(3, 5)
    buffer = torch.zeros(40, dtype=torch.long)  # the engine's scratch buffer: views of its first elements
    checked = []
    real_any = Tensor.any
    monkeypatch.setattr(Tensor, "any", lambda t, *a: checked.append(t.numel()) or real_any(t, *a))
    assert losses._none_equal(step, -100) and checked == [60]  # the step's gradient evaluation: the round tensor

    def gather(source, clients):
        rows = torch.index_select(source, 0, torch.tensor(clients), out=buffer[: 5 * len(clients)].view(-1, 5))
        losses._gathered_rows(rows, source)
        return rows

    rows = gather(step, [0, 0, 2, 1, 2])
    assert vmap(lambda r: torch.tensor(losses._none_equal(r, -100)))(rows).all() and checked == [60]
    assert losses._none_equal(rows[1:3, :2], -100) and checked == [60]  # a view inside the gathered rows
    assert not losses._none_equal(rows, 3) and checked[-1] == 25  # a value not recorded: checked (the rows hold it)
    before = len(checked)
    assert losses._none_equal(buffer[:30], -100) and len(checked) > before  # past the gathered rows: checked
    rows[0, 0] = -100  # the buffer written: the record no longer holds
    assert not losses._none_equal(rows, -100)
    step[2, 4] = -100  # targets holding the value: their gathered rows are checked, whole
    rows = gather(step, [2, 1])
    before = len(checked)
    assert not losses._none_equal(rows, -100) and len(checked) > before


@pytest.mark.numerics
@pytest.mark.parametrize("classes", [2, 3, 10, 15, 16, 40])
def test_float32_cross_entropy_on_cpu_through_the_transposed_log_softmax(classes):
    """On CPU, float32 logits with 3 to 15 classes take the log-softmax over the transposed class dimension (torch's
    kernel for a short last dimension is slow): the loss of each row equals torch's cross-entropy on its real samples
    to float32 rounding, with gradients, for class counts on both sides of the range. Float32 rounding: within k
    times the error of torch's float32 loss against the float64 loss (numerics.assert_rounding_close)."""
    g = torch.Generator().manual_seed(classes)
    counts = [4, 7, 1]
    xs = torch.randn(3, N, classes, generator=g)
    ys = torch.randint(0, classes, (3, N), generator=g)
    masks = torch.stack([(torch.arange(N) < k).float() for k in counts])

    def row(x, y, m):
        with LossInterception(N, m, m.sum()) as interception:
            out = F.cross_entropy(x, y)
        assert interception.cells_of(out) is not None
        return out

    x1 = xs.clone().requires_grad_(True)
    got = vmap(row)(x1, ys, masks)
    got.sum().backward()
    x2 = xs.clone().requires_grad_(True)
    want = torch.stack([F.cross_entropy(x2[r, :k], ys[r, :k]) for r, k in enumerate(counts)])
    want.sum().backward()
    x3 = xs.double().requires_grad_(True)
    exact = torch.stack([F.cross_entropy(x3[r, :k], ys[r, :k]) for r, k in enumerate(counts)])
    exact.sum().backward()
    assert got.dtype == torch.float32
    assert_rounding_close(got.detach(), want.detach(), exact.detach())
    assert_rounding_close(x1.grad, x2.grad, x3.grad)


# ---------------------------------------------------------------------------------------------- in the loop
class UserMLP(pl.LightningModule):
    """Written as a user would: mean cross-entropy, the loss logged."""

    def __init__(self, dropout=0.0, log_accuracy=False):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 10))
        self.log_accuracy = log_accuracy

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        if self.log_accuracy:  # a batch mean the engine cannot split per sample
            self.log("train_acc", (logits.argmax(1) == y).float().mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class UserCNN(UserMLP):
    """A small CNN on the 8x8 digit images, loss through ``nn.CrossEntropyLoss`` with label smoothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.net = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10)
        )
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        self.log("train_loss", loss.detach())
        return loss


class UserRegression(UserMLP):
    """Mean squared error against one-hot targets."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        return F.mse_loss(out, F.one_hot(y, 10).to(out.dtype))


class BatchCentred(UserMLP):
    """Its forward subtracts the batch mean: the loss is not a mean of per-sample losses."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x - x.mean(0)), y)


class UserTokens(UserMLP):
    """Linear layers as users also write them: one applied to every token of a sequence (a 3-d input), one frozen
    (its weights shared by all clients, not trained)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(8, 12)
        self.frozen = nn.Linear(12, 12).requires_grad_(False)
        self.head = nn.Linear(12, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        tokens = torch.relu(self.embed(x.view(-1, 8, 8)))  # [B, 8 tokens, 12]
        loss = F.cross_entropy(self.head(torch.tanh(self.frozen(tokens.mean(1)))), y)
        self.log("train_loss", loss)
        return loss


class UserDictLoss(UserMLP):
    """Returns ``{"loss": F.cross_entropy(...)}``, Lightning's other form of the loss."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)}


def engine_of(run):
    return run[1].vectorized_engine


@pytest.mark.numerics
@pytest.mark.parametrize(
    "model_fn,opt",
    [
        (UserMLP, "sgd"),
        (UserMLP, "armijo"),
        (UserCNN, "sgd"),
        (UserCNN, "armijo"),
        (UserRegression, "sgd"),
        (UserTokens, "sgd"),
        (UserDictLoss, "sgd"),  # its loss was reshaped first, which interception did not recognise: path 3
    ],
)
def test_users_modules_take_the_fast_path_and_equal_sequential(model_fn, opt):
    seq = fit(model_fn(), CLIENT_OPTIMIZERS[opt], "sequential")
    vec = fit(model_fn(), CLIENT_OPTIMIZERS[opt], "vectorized")
    engine = engine_of(vec)
    assert engine.call.intercept is True and "per-sample" not in engine.call.probed
    assert_same_run(seq, vec)
    if model_fn is not UserRegression:  # the per-round mean of the logged loss, as sequential mode logs it
        got, want = vec[3].callback_metrics["client/train_loss"], seq[3].callback_metrics["client/train_loss"]
        assert float(got) == pytest.approx(float(want), rel=rtol32(CPR * K + 1))  # float32 logged values


def test_a_forward_that_mixes_samples_is_refused_and_auto_trains_it_sequentially():
    """Loss interception finds that the loss is not a mean of per-sample losses; the per-sample path would train
    another objective (each sample centred on itself: x − x = 0), so its own check refuses the model by name, and
    "auto" trains it sequentially."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"the loss is not a mean over samples") as err:
        fit(BatchCentred(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    assert "not a mean of per-sample losses, or the forward pass mixes samples" in str(err.value)  # why not intercepted
    seq = fit(BatchCentred(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    auto = fit(BatchCentred(), CLIENT_OPTIMIZERS["sgd"], "auto")
    torch.testing.assert_close(auto[0], seq[0], rtol=0, atol=0)


class SummedLoss(UserMLP):
    """A summed cross-entropy (``reduction="sum"``), which loss interception does not recognise."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="sum")


class SummedLossPerSample(SummedLoss):
    """The same loss with a per-sample protocol whose entries are right one sample at a time."""

    def training_step_per_sample(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="none")


@pytest.mark.parametrize("model_fn", [SummedLoss, SummedLossPerSample], ids=["per-sample calls", "protocol"])
def test_a_summed_loss_is_refused_on_padded_steps_and_auto_trains_it_sequentially(model_fn):
    """A client's summed loss is not the mean of its samples' losses that padded steps compute (both paths: one
    ``training_step`` per sample, and the model's per-sample protocol): refused, naming both values; "auto" trains
    such a model sequentially."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    how = "one training_step per sample" if model_fn is SummedLoss else "its training_step_per_sample losses"
    with pytest.raises(VectorizationUnsupportedError, match=rf"{how}.*is not a mean over samples \(reduction='sum'\?"):
        fit(model_fn(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    seq = fit(model_fn(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    auto = fit(model_fn(), CLIENT_OPTIMIZERS["sgd"], "auto")
    torch.testing.assert_close(auto[0], seq[0], rtol=0, atol=0)


def test_fallback_with_dropout_trains_exactly_what_the_generic_path_trains(monkeypatch):
    """A dropout model that logs a batch accuracy: the fast attempt draws dropout masks before it finds the logged
    value it cannot split; the fallback undoes those draws, so the run is bit-identical to the generic path."""
    model = UserMLP(dropout=0.3, log_accuracy=True)
    attempted = fit(model, CLIENT_OPTIMIZERS["sgd"], "vectorized")
    engine = engine_of(attempted)
    assert engine.call.intercept is False and "'train_acc'" in engine.call.padded_path_reason

    init = VectorizedClientTrainer.__init__

    def generic_only(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.call.intercept = False

    monkeypatch.setattr(VectorizedClientTrainer, "__init__", generic_only)
    generic = fit(model, CLIENT_OPTIMIZERS["sgd"], "vectorized")
    torch.testing.assert_close(attempted[0], generic[0], rtol=0, atol=0)


class TooFewClasses(UserMLP):
    """A head with 4 outputs for the digits' 10 classes: targets out of range, a user's mistake."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))


def test_class_targets_out_of_range_stop_the_run_with_torchs_error_as_sequential_does():
    """Targets beyond the logits' classes: the batched class loss raises, the engine retries on its generic path,
    whose error names torch's own message with the bad target; sequential mode stops the run at the first client
    that raised it. Neither trains on."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(RuntimeError, match=r"round 0: client \d+ raised IndexError: Target \d+ is out of bounds"):
        fit(TooFewClasses(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    with pytest.raises(VectorizationUnsupportedError, match=r"(Target|index) \d+ is out of bounds"):
        fit(TooFewClasses(), CLIENT_OPTIMIZERS["sgd"], "vectorized")


class LogsBatchSize(UserMLP):
    """Logs a batch accuracy (a mean over samples, which loss interception cannot split: the per-sample path) and
    the batch size (not a mean over samples)."""

    def __init__(self, log_size=True):
        super().__init__()
        self.log_size = log_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("batch_acc", (logits.argmax(-1) == y).float().mean())
        if self.log_size:
            self.log("batch_size", float(len(y)))
        return F.cross_entropy(logits, y)


def test_a_logged_value_that_is_not_a_mean_over_samples_is_refused_and_a_mean_is_kept():
    """The per-sample path averages logged values over a client's real samples too: a batch accuracy comes out as
    sequential training logs it, a batch size would come out as 1 on padded steps, so it is refused by name."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"the value it logs as 'batch_size' is \d+ on \d+ samples"):
        fit(LogsBatchSize(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    seq = fit(LogsBatchSize(log_size=False), CLIENT_OPTIMIZERS["sgd"], "sequential")
    vec = fit(LogsBatchSize(log_size=False), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    assert "per-sample" in engine_of(vec).call.probed
    got, want = vec[3].callback_metrics["client/batch_acc"], seq[3].callback_metrics["client/batch_acc"]
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    auto = fit(LogsBatchSize(), CLIENT_OPTIMIZERS["sgd"], "auto")
    seq_size = fit(LogsBatchSize(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    assert float(auto[3].callback_metrics["client/batch_size"]) == float(
        seq_size[3].callback_metrics["client/batch_size"]
    )


CLASS_WEIGHTS = torch.linspace(0.2, 3.0, 10, dtype=torch.double)


class WeightedLossLogsAccuracy(LogsBatchSize):
    """A class-weighted cross-entropy (``weight=``, or ``ignore_index``: a mean weighted by sample) with a logged batch
    accuracy, which sends padded steps to the per-sample path; ``by_hand``: the same weighted mean written out."""

    def __init__(self, how="weight"):
        super().__init__(log_size=False)
        self.how = how

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("batch_acc", (logits.argmax(-1) == y).float().mean())
        w = CLASS_WEIGHTS.to(logits)  # the logits' dtype and device
        if self.how == "weight":
            return F.cross_entropy(logits, y, weight=w)
        if self.how == "ignore_index":
            return F.cross_entropy(logits, y, ignore_index=3)
        if self.how == "batch_counts":  # inverse class frequency in this batch: 1 on samples of distinct classes
            return F.cross_entropy(
                logits, y, weight=1.0 / torch.bincount(y, minlength=10).to(logits.dtype).clamp(min=1)
            )
        per = F.cross_entropy(logits, y, reduction="none")
        return (per * w[y]).sum() / w[y].sum()


@pytest.mark.parametrize("how", ["weight", "ignore_index", "by_hand", "batch_counts"])
def test_a_mean_weighted_by_class_is_refused_on_the_per_sample_path_and_auto_trains_it_sequentially(how):
    """One training_step per sample averages the samples' losses with equal weights, which is not a class-weighted
    mean (nor one that leaves ``ignore_index`` samples out): the sample-mean check draws its samples from every
    client's rows, covering the batch's distinct targets (the first client's first samples are often of one class
    under label skew, where the weighting does not show) and samples that repeat a class (where weights from the
    batch's own class counts show), and refuses the model; "auto" trains it sequentially."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"the loss is not a mean over samples"):
        fit(WeightedLossLogsAccuracy(how), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    seq = fit(WeightedLossLogsAccuracy(how), CLIENT_OPTIMIZERS["sgd"], "sequential")
    auto = fit(WeightedLossLogsAccuracy(how), CLIENT_OPTIMIZERS["sgd"], "auto")
    torch.testing.assert_close(auto[0], seq[0], rtol=0, atol=0)


class FeatureWeighted(UserMLP):
    """A mean weighted by something of the inputs (5 times the weight for samples whose pixel 5 is nearly white, 8 %
    of the digits), written out by hand: not a class weighting, so the probe's distinct targets need not show it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per = F.cross_entropy(self.net(x), y, reduction="none")
        w = 1 + 4 * (x[:, 5] > 0.9375).to(per.dtype)
        return (per * w).sum() / w.sum()


def test_a_mean_weighted_by_the_inputs_is_refused_on_the_per_sample_path_and_auto_trains_it_sequentially():
    """The sample-mean check also splits every client's real samples in two: a mean over samples is the
    size-weighted mean of its halves' means, a mean weighted by the inputs is not where the heavy samples fall in
    one half. The probe of 8 samples missed this one, and vectorized training moved the weights 5.6e-2 away from
    sequential training's, in silence."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"real samples of client row \d+'s batch .* two halves"):
        fit(FeatureWeighted(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    seq = fit(FeatureWeighted(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    auto = fit(FeatureWeighted(), CLIENT_OPTIMIZERS["sgd"], "auto")
    torch.testing.assert_close(auto[0], seq[0], rtol=0, atol=0)


class BatchContextFromRound1(UserMLP):
    """A batch-context term switched on from round 1 (a curriculum, a warm-up): the loss is a mean over samples
    when the padded path is chosen (round 0) and mixes samples afterwards."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.net[0](x))
        if self.global_step >= 1:
            h = h - 0.5 * h.mean(0, keepdim=True)
        return F.cross_entropy(self.net[3](h), y)


def test_a_loss_that_starts_mixing_samples_in_a_later_round_is_caught_there(monkeypatch):
    """The padded path's check runs again at every round's first padded step: in round 1 the loss no longer matches
    training_step on a client's real samples. Vectorized refuses it there (not in round 0); "auto" trains the rest
    sequentially, and equals sequential training."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    rounds = []
    monkeypatch.setattr(BatchContextFromRound1, "on_train_epoch_start", lambda self: rounds.append(self.global_step))
    with pytest.raises(VectorizationUnsupportedError, match=r"not a mean over samples"):
        fit(BatchContextFromRound1(), CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=3)
    assert rounds == [0, 1]  # refused in round 1
    seq = fit(BatchContextFromRound1(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=3)
    auto = fit(BatchContextFromRound1(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=3)
    torch.testing.assert_close(auto[0], seq[0], rtol=RTOL64, atol=0)


def test_a_step_whose_recheck_fails_is_computed_again_on_the_per_sample_path(monkeypatch):
    """The round's recheck of loss interception runs on the step's own result: when it fails (here: an interception
    that returns twice its values from round 1 on), the step is computed again on the per-sample path, and none of
    the refused values enter training: the run equals sequential training (float64)."""
    from fedlightning.vectorized import rows

    said = []
    monkeypatch.setattr(rows, "_info", said.append)
    values = rows._InterceptedRows.values

    def wrong_from_round_1(self, *args, **kwargs):
        out = values(self, *args, **kwargs)
        if self.call.model.global_step < 1:
            return out
        return (*out[:-2], out[-2] * 2, out[-1])

    monkeypatch.setattr(rows._InterceptedRows, "values", wrong_from_round_1)
    vec = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=3)
    assert len(said) == 2 and "by loss interception" in said[0], said
    assert "once per sample" in said[1] and "of a later round" in said[1] and "the per-sample interception" in said[1]
    assert isinstance(vec[1].vectorized_engine.call.padded_rows, rows._SampleRows)
    seq = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=3)
    torch.testing.assert_close(vec[0], seq[0], rtol=RTOL64, atol=0)


def test_probe_cells_cover_the_distinct_targets_of_every_row():
    """The check's samples: every first occurrence of a target value across the rows (up to limit - 2), two samples
    that repeat a target, then the fullest row's first samples, up to the limit; real cells only. A per-sample
    float scalar (a sample weight) counts as a target: a rare weight is in the probe."""
    from fedlightning.vectorized.call import _probe_cells

    y = torch.tensor([[2, 2, 2, 0], [2, 5, 0, 0], [7, 2, 2, 2]])  # row 1 has 2 real cells, row 0 has 3
    x = torch.zeros(3, 4, 6)
    cells = _probe_cells([x, y], [3, 2, 4], limit=6)
    assert cells[:3] == [(0, 0), (1, 1), (2, 0)]  # targets 2, 5, 7 at their first real cell
    assert cells[3:5] == [(0, 1), (0, 2)]  # two samples of a target met before
    assert cells[5:] == [(2, 1)]  # then the fullest row (2, four real cells)
    assert _probe_cells([x], [3, 2, 4], limit=3) == [(2, 0), (2, 1), (2, 2)]  # no target
    w = torch.ones(3, 4)
    w[2, 3] = 4.0  # one sample of weight 4, the fullest row's last
    cells = _probe_cells([x, torch.zeros(3, 4, dtype=torch.long), w], [3, 2, 4], limit=4)
    assert (2, 3) in cells and len(cells) == 4


class LogsLossAndBatchSize(UserMLP):
    """The loss (which loss interception splits per sample) and the batch size, a Python number that looks constant
    inside the batched call: the padded batch's size there, the client's own in sequential training."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log("batch_size", float(len(y)))
        return loss


def test_a_logged_batch_size_is_not_taken_for_a_constant_on_padded_steps():
    """Loss interception's check compares the values logged as constants on a padded row with those on the client's
    real samples: the batch size differs, so the path is not taken (the per-sample path then refuses it by name) and
    "auto" logs sequential training's batch size."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"the value it logs as 'batch_size' is \d+ on"):
        fit(LogsLossAndBatchSize(), CLIENT_OPTIMIZERS["sgd"], "vectorized")
    seq = fit(LogsLossAndBatchSize(), CLIENT_OPTIMIZERS["sgd"], "sequential")
    auto = fit(LogsLossAndBatchSize(), CLIENT_OPTIMIZERS["sgd"], "auto")
    got, want = auto[3].callback_metrics["client/batch_size"], seq[3].callback_metrics["client/batch_size"]
    assert float(got) == float(want)


class TokenLM(pl.LightningModule):
    """A sequence model whose loss is the token-weighted mean of ``F.cross_entropy`` over flattened ``[B·T, V]``
    logits (``ignore_index=-100`` by default), as language models write it; ``by_hand``: the same mean written out,
    ``Σ mask · ce / Σ mask``, which loss interception does not recognise (the per-sample path's form)."""

    def __init__(self, by_hand=False, time_major=False, dropout=0.0, zero_head=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.hidden, self.out = nn.Embedding(7, 5), nn.Linear(5, 5), nn.Linear(5, 7)
        self.drop = nn.Dropout(dropout)
        if zero_head:  # every token's loss log 7 at the start, whichever sample it is read as
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)
        self.by_hand, self.time_major = by_hand, time_major

    def logits(self, tokens):
        return self.out(self.drop(torch.tanh(self.hidden(self.emb(tokens)))))

    def training_step(self, batch, batch_idx):
        tokens, targets, _ = batch
        logits = self.logits(tokens)
        if self.time_major:  # flattened time step by time step: [T·B, V]
            return F.cross_entropy(logits.transpose(0, 1).reshape(-1, 7), targets.t().reshape(-1))
        if not self.by_hand:
            return F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
        kept = (targets != -100).to(logits.dtype)
        ce = F.cross_entropy(logits.transpose(1, 2), targets.clamp_min(0), reduction="none")
        return (ce * kept).sum() / kept.sum()


class ProtocolTokenLM(TokenLM):
    """The token mean of ``TokenLM`` with a ``training_step_per_sample`` that gives each sequence its own token
    mean: right sample by sample, but the loss of a batch weighs its sequences by their numbers of targets."""

    def training_step_per_sample(self, batch, batch_idx):
        tokens, targets, _ = batch
        ce = F.cross_entropy(self.logits(tokens).transpose(1, 2), targets, reduction="none")
        kept = (targets != -100).to(ce.dtype)
        return (ce * kept).sum(1) / kept.sum(1)


def _token_run(mode, short, by_hand=False, tail=False, cls=None, **options):
    """``short``: 4 of 120 sequences end after 2 targets (the rest ignored, -100), so the loss is a mean over
    tokens that a mean over samples is not; on this data a round's first padded step holds none of them. ``tail``:
    every sequence's last target is ignored too, so the steps checked first hold -100 already (with one count of
    ignored targets per sequence)."""
    from conftest import make_trainer
    from fedlightning import FederatedLoop
    from fedlightning.callbacks import FedAvg
    from fedlightning.datamodules import Dirichlet, FederatedDataModule

    g = torch.Generator().manual_seed(104)
    tokens = torch.randint(1, 7, (120, 6), generator=g)
    targets = tokens.roll(-1, 1).clone()
    rare = torch.randperm(120, generator=g)[:4]
    if tail:
        targets[:, 5:] = -100
    if short:
        targets[rare, 2:] = -100
    labels = torch.randint(0, 3, (120,), generator=g)
    dm = FederatedDataModule.from_datasets(
        torch.utils.data.TensorDataset(tokens, targets, labels),
        partition=Dirichlet(alpha=0.3),
        labels=labels.tolist(),
        num_clients=8,
        batch_size=12,
        seed=0,
        val_fraction=0,
    )
    model = (cls or TokenLM)(by_hand, **options).double()
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    loop = FederatedLoop(model, client_optimizer=sgd, local_steps=4, clients_per_round=4, seed=3, client_execution=mode)
    make_trainer(2, callbacks=[FedAvg()]).fit(loop, datamodule=dm)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), loop


@pytest.mark.numerics
def test_a_flattened_token_loss_takes_loss_interception_and_equals_sequential():
    """``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))`` with ignored targets in a few sequences: loss
    interception reads the flattened ``[B·T, V]`` batch per sample, so padded steps average over each client's real
    tokens as sequential training does (float64), without the per-sample path."""
    seq, _ = _token_run("sequential", short=True)
    vec, loop = _token_run("vectorized", short=True)
    call = loop.vectorized_engine.call
    assert call.intercept is True and "per-sample" not in call.probed
    torch.testing.assert_close(vec, seq, rtol=RTOL64, atol=1e-12)


@pytest.mark.parametrize("tail", [False, True])
def test_a_token_weighted_mean_on_the_per_sample_path_is_refused_on_the_step_where_counts_differ(tail, monkeypatch):
    """The per-sample path checks every step's rows: the loss of each row's padded batch against the mean of its
    cells. A token-weighted mean written by hand is refused on the first step whose sequences hold different
    numbers of ignored targets, also when the steps checked before held ignored targets already (``tail``: one in
    every sequence; vectorized training then averaged per-sample means in silence, 1.6e-03 off after 2 rounds);
    ``auto`` trains it sequentially. With one count of ignored targets in every sequence the per-sample mean is the
    token mean, and the path trains as sequential training does."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match="not a mean over samples"):
        _token_run("vectorized", short=True, by_hand=True, tail=tail)
    seq, _ = _token_run("sequential", short=True, by_hand=True, tail=tail)
    import fedlightning.vectorized.auto as auto_module

    # auto's timing reaches the refusing step whatever the machine's load (its budget would end it earlier there)
    monkeypatch.setattr(auto_module, "AUTO_MIN_BUDGET_SECONDS", 1e6)
    auto, loop = _token_run("auto", short=True, by_hand=True, tail=tail)
    assert torch.equal(auto, seq)
    full_seq, _ = _token_run("sequential", short=False, by_hand=True, tail=tail)
    full_vec, loop = _token_run("vectorized", short=False, by_hand=True, tail=tail)
    assert loop.client_execution_choice == "vectorized" and "per-sample" in loop.vectorized_engine.call.probed
    torch.testing.assert_close(full_vec, full_seq, rtol=RTOL64, atol=1e-12)


@pytest.mark.parametrize("options", [{"dropout": 1e-12}, {"zero_head": True}], ids=["random-layers", "zero-head"])
def test_a_time_major_flatten_is_not_read_per_sample_and_trains_as_sequential(options):
    """``F.cross_entropy(logits.transpose(0, 1).reshape(-1, V), ...)`` is not sample-major: loss interception
    does not read it per sample, neither for a model with random layers (whose interception check does not run;
    a dropout that never drops keeps the runs comparable) nor where the check's losses agree by chance (a
    zero-initialised head: every loss log V). Before, both trained another objective (1e-02 and 7e-03 off); now the
    padded steps take the per-sample path, which trains the token mean as sequential training does."""
    seq, _ = _token_run("sequential", short=False, time_major=True, **options)
    vec, loop = _token_run("vectorized", short=False, time_major=True, **options)
    assert "per-sample" in loop.vectorized_engine.call.probed
    torch.testing.assert_close(vec, seq, rtol=RTOL64, atol=1e-12)


def test_a_users_per_sample_protocol_is_checked_on_every_step():
    """A user's ``training_step_per_sample`` of per-sequence means next to a token-mean ``training_step``: refused
    on the step where the sequences' numbers of targets differ (before: 7e-04 off in silence); ``auto`` trains it
    sequentially; with one number of targets per sequence the protocol's padded steps equal sequential training."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match="not a mean over samples"):
        _token_run("vectorized", short=True, cls=ProtocolTokenLM)
    seq, _ = _token_run("sequential", short=True, cls=ProtocolTokenLM)
    auto, _ = _token_run("auto", short=True, cls=ProtocolTokenLM)
    assert torch.equal(auto, seq)
    full_seq, _ = _token_run("sequential", short=False, cls=ProtocolTokenLM)
    full_vec, loop = _token_run("vectorized", short=False, cls=ProtocolTokenLM)
    assert "per-sample protocol" in loop.vectorized_engine.call.probed
    torch.testing.assert_close(full_vec, full_seq, rtol=RTOL64, atol=1e-12)
