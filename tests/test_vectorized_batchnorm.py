"""BatchNorm (and instance norm with running statistics) under client_execution="vectorized".

Two references: torch's own layers on a client's real samples alone (the per-client, masked layer of
``fedlightning.vectorized.norms``), and sequential training (the weights, every client's reported buffers and the
global model's buffers after several rounds). The data is a ragged Dirichlet digits split (clients with fewer samples
than the batch size, so steps are padded), K > 1, SGD and SgdArmijo. Both references compute the same numbers in
another order, so the comparisons run in float64 (tests/numerics.py).
"""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
import torchvision
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet
from fedlightning.optim import SgdArmijo
from fedlightning.vectorized import VectorizationUnsupportedError, VectorizedClientTrainer
from fedlightning.vectorized.norms import _NormLayers
from fedlightning.vectorized.torch_internals import _vmap0
from numerics import Float64Inputs, assert_close64, rtol32, to_float64
from test_vectorized_speed_paths import Sized

ROUNDS, CPR, K, BATCH = 3, 6, 4, 16
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2), "armijo": lambda p: SgdArmijo(p, eta_max=4.0, beta=0.7)}


# ---------------------------------------------------------------------------------------------- the layer itself
def _torch_layer(layer, x, n):
    """torch's layer on the first ``n`` samples alone: (output, running mean, running var, batches tracked)."""
    ref = copy.deepcopy(layer)
    out = ref(x[:n])
    return out, ref.running_mean, ref.running_var, ref.num_batches_tracked


@pytest.mark.numerics
@pytest.mark.parametrize(
    "layer,shape",
    [
        (nn.BatchNorm1d(5), (7, 5)),
        (nn.BatchNorm1d(5, momentum=None), (7, 5, 3)),
        (nn.BatchNorm2d(3, affine=False), (7, 3, 4, 4)),
        (nn.BatchNorm3d(2, momentum=0.3), (7, 2, 2, 3, 2)),
        (nn.InstanceNorm1d(4, affine=True, track_running_stats=True), (7, 4, 6)),
        (nn.InstanceNorm2d(3, track_running_stats=True, momentum=0.5), (7, 3, 3, 3)),
    ],
    ids=["bn1d", "bn1d-cumulative-3d", "bn2d-no-affine", "bn3d", "in1d", "in2d"],
)
def test_masked_layer_equals_torch_on_each_clients_real_samples(layer, shape):
    """Three clients with 7, 4 and 2 real samples in a batch padded to 7: each row's output on its real samples and
    its running statistics equal torch's layer on those samples alone, in training mode (two steps, so the
    cumulative average and the counter are exercised) and in eval mode."""
    torch.manual_seed(0)
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 1.5)
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    model = nn.Sequential(layer)
    norms = _NormLayers(model)
    sizes = [7, 4, 2]
    mask = torch.arange(7)[None, :] < torch.tensor(sizes)[:, None]
    norms.start(list(model.buffers()), 3)
    refs = [copy.deepcopy(layer) for _ in sizes]
    for mode in ("train", "train", "eval"):
        layer.train(mode == "train")
        for r in refs:
            r.train(mode == "train")
        xs = torch.randn(3, *shape, dtype=torch.float64) * 3 + 1
        norms.install()
        try:

            def per_row(x, m, *stats):
                norms.begin(stats, m.double(), m.double().sum(), min(sizes))
                return (layer(x), *norms.end())

            out = _vmap0(per_row, [xs, mask, *norms.rows()])
        finally:
            norms.uninstall()
        norms.write(out[1:], None)
        for c, n in enumerate(sizes):
            want = refs[c](xs[c, :n])
            assert_close64(out[0][c, :n], want)
            for got, ref in zip(norms.stats, (refs[c].running_mean, refs[c].running_var, refs[c].num_batches_tracked)):
                assert_buffer_close(got[c], ref)
    assert int(norms.stats[2][0]) == (2 if isinstance(layer, nn.modules.batchnorm._BatchNorm) else 0)


def assert_buffer_close(got, want):
    """Float buffers to numerics.RTOL64 (a float64 model's clients report and average them in float64), integer ones
    (num_batches_tracked) exactly."""
    assert got.dtype == want.dtype
    if not want.is_floating_point():
        assert torch.equal(got, want)
    else:
        assert_close64(got, want)


# ---------------------------------------------------------------------------------------------- against sequential
class Digits64(Float64Inputs, DigitsDataModule):
    """The digits with float64 inputs."""


def digits():
    return Digits64(num_clients=40, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)


class Recorder(pl.Callback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)


class BNNet(pl.LightningModule):
    """A user's MLP with BatchNorm1d, or CNN with BatchNorm2d, on the 8x8 digit images."""

    def __init__(self, kind="mlp", frozen=False, loss="cross_entropy", **bn):
        super().__init__()
        torch.manual_seed(1)
        self.kind, self.frozen, self.loss_kind = kind, frozen, loss
        if kind == "mlp":
            self.net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16, **bn), nn.ReLU(), nn.Linear(16, 10))
        elif kind == "cnn":
            self.net = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 4, 3, padding=1),
                nn.BatchNorm2d(4, **bn),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(256, 10),
            )
        elif kind == "instance":
            self.net = nn.Sequential(
                nn.Unflatten(1, (4, 16)), nn.InstanceNorm1d(4, affine=True, **bn), nn.Flatten(), nn.Linear(64, 10)
            )
        elif kind == "tokens":  # BatchNorm over every (sample, position): its first dimension is not the batch
            self.net = nn.Sequential(nn.Unflatten(1, (8, 8)), nn.Linear(8, 8))
            self.bn = nn.BatchNorm1d(8)
            self.head = nn.Linear(64, 10)

    def forward(self, x):
        if self.kind == "tokens":
            h = self.net(x)
            return self.head(self.bn(h.reshape(-1, 8)).reshape(x.shape[0], 64))
        return self.net(x)

    def on_train_epoch_start(self):
        if self.frozen:  # the module freezes its BatchNorm: running statistics used and kept
            self.net[1].eval()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        if self.loss_kind == "cross_entropy":
            return F.cross_entropy(logits, y)
        return -(F.log_softmax(logits, 1) * F.one_hot(y, 10)).sum(1).mean()  # not intercepted


def fit(model, optimizer, mode, rounds=ROUNDS, dm=digits):
    """A float64 copy of ``model`` trained on ``dm()``: (weights, buffers, client updates, loop)."""
    model = to_float64(copy.deepcopy(model))
    rec = Recorder()
    loop = FederatedLoop(
        model, client_optimizer=optimizer, local_steps=K, clients_per_round=CPR, seed=3, client_execution=mode
    )
    make_trainer(rounds, callbacks=[FedAvg(), rec]).fit(loop, datamodule=dm())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buffers = [b.detach().clone() for b in model.buffers()]
    return weights, buffers, rec.updates, loop


def assert_same(seq, vec):
    """Weights, buffers and every client's reported buffers of two float64 runs agree to numerics.RTOL64: a float64
    model's clients report their float buffers in float64 (state.buffer_report_dtype), so the global buffers are a
    float64 weighted mean."""
    assert_close64(vec[0], seq[0])
    assert len(vec[1]) == len(seq[1])
    for a, b in zip(seq[1], vec[1]):
        assert_buffer_close(b, a)
    assert [u.client_id for u in vec[2]] == [u.client_id for u in seq[2]]
    for a, b in zip(seq[2], vec[2]):
        assert (a.buffers is None) == (b.buffers is None)
        if a.buffers is not None:
            assert a.buffers.dtype == b.buffers.dtype == torch.float64
            assert_close64(b.buffers, a.buffers)


def test_the_split_is_ragged():
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    sizes = [dm.client_num_samples(c) for r in range(ROUNDS) for c in dm.sample_clients(r)]
    assert min(sizes) < BATCH and len(set(sizes)) > CPR


@pytest.mark.numerics
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "kind,bn",
    [
        ("mlp", {}),
        ("cnn", {}),
        ("mlp", {"momentum": None}),
        ("mlp", {"track_running_stats": False}),
        ("cnn", {"affine": False, "momentum": 0.5}),
        ("instance", {"track_running_stats": True}),
    ],
    ids=["mlp", "cnn", "cumulative", "no-running-stats", "cnn-no-affine", "instance-norm"],
)
def test_batchnorm_equals_sequential(opt, kind, bn):
    seq = fit(BNNet(kind, **bn), OPTIMIZERS[opt], "sequential")
    vec = fit(BNNet(kind, **bn), OPTIMIZERS[opt], "vectorized")
    assert_same(seq, vec)
    start = [b.clone() for b in to_float64(BNNet(kind, **bn)).buffers()]
    if start:  # the running statistics moved, and differ between clients
        assert (seq[1][0] - start[0]).abs().max() > 1e-2
        assert len({round(float(u.buffers[0]), 5) for u in vec[2]}) > 1
    if opt == "armijo":
        assert sum(u.backtracks for u in vec[2]) > 0  # trial evaluations ran (and did not move the statistics)


@pytest.mark.parametrize(
    "opt,loss",
    [("sgd", "cross_entropy"), ("armijo", "cross_entropy"), ("sgd", "own")],
    ids=["sgd", "armijo", "one-call-per-sample"],
)
def test_a_batchnorm_the_module_freezes_uses_its_running_statistics(opt, loss):
    """In eval mode a BatchNorm normalises each sample with the running statistics: it mixes no samples, so even
    the path that calls training_step once per sample (a loss the engine does not intercept) runs it."""
    seq = fit(BNNet("mlp", frozen=True, loss=loss), OPTIMIZERS[opt], "sequential")
    vec = fit(BNNet("mlp", frozen=True, loss=loss), OPTIMIZERS[opt], "vectorized")
    assert vec[3].vectorized_engine.call.intercept is (loss == "cross_entropy")
    assert_same(seq, vec)
    start = [b.clone() for b in to_float64(BNNet("mlp")).buffers()]
    for a, b in zip(start, vec[1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # eval mode: the running statistics were not moved


def test_auto_picks_a_mode_and_keeps_the_results():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = fit(BNNet("cnn"), OPTIMIZERS["sgd"], "auto")
    assert not [w for w in caught if "training clients sequentially" in str(w.message)]
    assert isinstance(auto[3].vectorized_engine, VectorizedClientTrainer)
    assert auto[3].client_execution_choice in ("sequential", "vectorized")
    assert_same(fit(BNNet("cnn"), OPTIMIZERS["sgd"], "sequential"), auto)


# ---------------------------------------------------------------------------------------------- one-sample batches
class OneSampleNet(BNNet):
    """Linear, BatchNorm1d, ReLU, linear on 8 features, 3 classes; logs its loss and a torchmetrics accuracy."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.acc(logits, y)
        self.log("acc", self.acc)
        self.log("train_loss", loss)
        return loss


class RoundLog(pl.Callback):
    """Every round's client/* and round/failed_clients values."""

    def __init__(self):
        self.rounds = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rounds.append(
            {
                k: float(v)
                for k, v in trainer.callback_metrics.items()
                if k.startswith("client/") or k == "round/failed_clients"
            }
        )


class Sized64(Float64Inputs, Sized):
    """Clients of chosen sizes, float64 inputs."""


def fit_one_sample(mode, opt, sizes, rounds=2, **loop_kwargs):
    """A run on clients of ``sizes`` samples (batch 4, K = 3): (weights, buffers, client updates, per-round logged
    values, the "client ... skipped" warnings). Clients that raise are skipped (``on_client_error="skip"``) unless
    ``loop_kwargs`` say otherwise."""
    loop_kwargs.setdefault("on_client_error", "skip")
    model, rec, log = to_float64(OneSampleNet()), Recorder(), RoundLog()
    loop = FederatedLoop(
        model,
        client_optimizer=OPTIMIZERS[opt],
        local_steps=3,
        clients_per_round=len(sizes),
        seed=0,
        client_execution=mode,
        **loop_kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(rounds, callbacks=[FedAvg(), rec, log]).fit(loop, datamodule=Sized64(sizes, batch_size=4))
    skipped = sorted(str(w.message) for w in caught if "skipped" in str(w.message))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return weights, [b.detach().clone() for b in model.buffers()], rec.updates, log.rounds, skipped


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_a_client_batch_of_one_sample_fails_that_client_as_sequentially(opt):
    """torch's BatchNorm raises for a training batch of one value per channel, and sequential training leaves such a
    client out of the round (on_client_error="skip"). Clients of 1, 5 and 9 samples with batch 4 and K = 3 meet a
    one-sample batch at steps 0, 1 and 2 (the 9-sample client's data order reshuffles, the sizes stay 4, 4, 1): in
    vectorised mode they fail with the same error, their steps before it are logged and fed to the metric, and the
    global model, buffers and logged values equal sequential training's (float64; the logged values are float32
    means of a round's values, numerics.rtol32)."""
    sizes = [1, 5, 9, 12]
    seq = fit_one_sample("sequential", opt, sizes)
    vec = fit_one_sample("vectorized", opt, sizes)
    assert len(seq[4]) == 2 * 3 and seq[4] == vec[4]  # clients 0, 1, 2 in both rounds
    assert (
        "client 0 skipped (ValueError('Expected more than 1 value per channel when training, got input size "
        "torch.Size([1, 6])'))" in seq[4][0]
    )
    assert [(u.client_id, u.failed) for u in vec[2]] == [(u.client_id, u.failed) for u in seq[2]]
    assert {u.client_id for u in seq[2] if u.failed} == {0, 1, 2}
    assert_close64(vec[0], seq[0])
    for a, b in zip(seq[1], vec[1]):
        assert_buffer_close(b, a)
    assert [r["round/failed_clients"] for r in vec[3]] == [r["round/failed_clients"] for r in seq[3]] == [3.0, 3.0]
    logged_per_round = len(sizes) * 3  # one value per client and local step (K = 3)
    for a, b in zip(seq[3], vec[3]):
        assert a.keys() == b.keys() and {"client/acc", "client/train_loss"} <= a.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=rtol32(logged_per_round + 1)), key
    healthy = fit_one_sample("sequential", opt, [12])  # the failed clients' partial steps are in the logged values
    assert seq[3][0]["client/train_loss"] != pytest.approx(healthy[3][0]["client/train_loss"], abs=1e-3)
    auto = fit_one_sample("auto", opt, sizes)  # its throw-away measurement meets the failing clients too
    assert auto[4] == seq[4]
    assert_close64(auto[0], seq[0])


def test_a_client_batch_of_one_sample_under_on_client_error_raise_and_when_every_client_fails():
    """The failure policy's other outcomes, with the same messages in both modes: on_client_error="raise" (the
    default) stops at the client; under "skip", a round in which every client raised (at steps 0, 0 and 1) stops the
    run with the first error."""
    messages = []
    for mode in ("sequential", "vectorized"):
        with pytest.raises(
            RuntimeError,
            match=r"round 0: client 0 raised ValueError: Expected more than 1 value per "
            r"channel when training, got input size torch\.Size\(\[1, 6\]\)",
        ):
            fit_one_sample(mode, "sgd", [1, 12], on_client_error="raise")
        with pytest.raises(
            RuntimeError,
            match=r"round 0: every client raised an exception \(client \d: ValueError: "
            r"Expected more than 1 value per channel",
        ) as err:
            fit_one_sample(mode, "sgd", [1, 1, 5], rounds=1)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kind,loss,match",
    [
        ("mlp", "own", r"'net\.1' \(BatchNorm1d\) computes statistics over a client's batch"),
        (
            "tokens",
            "cross_entropy",
            r"layer 'bn' \(BatchNorm1d\) got an input whose first dimension \(\d+\) is not the "
            r"client's padded batch",
        ),
    ],
)
def test_what_cannot_be_restricted_to_real_samples_is_refused(kind, loss, match):
    with pytest.raises(VectorizationUnsupportedError, match=match):
        fit(BNNet(kind, loss=loss), OPTIMIZERS["sgd"], "vectorized", rounds=1)
    fit(BNNet(kind, loss=loss), OPTIMIZERS["sgd"], "sequential", rounds=1)  # sequential training runs it


# ---------------------------------------------------------------------------------------------- torchvision's ResNet
class Images(Sized):
    """Clients of chosen sizes holding random 3x16x16 images of 10 classes."""

    def load(self):
        data, _, _ = super().load()
        g = torch.Generator().manual_seed(1)
        images = ArrayDataset(torch.randn(len(data), 3, 16, 16, generator=g), data.y)
        return images, images, images.y.numpy()


class TorchvisionResNet(pl.LightningModule):
    """torchvision's ``resnet18`` (BatchNorm, residual downsampling, 1x1 feature maps on 16x16 images from
    ``layer3`` on) as a user trains it, in float64 so that both modes' arithmetic can be compared to rounding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.resnet18(num_classes=10).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.double()), y)


def test_torchvision_resnet18_equals_sequential_with_one_sample_batches():
    """A user's torchvision ResNet-18: per-client BatchNorm statistics over real samples, padded steps, and the
    clients whose batch of one sample reaches the 1x1 maps failing as sequentially (clients of 1, 9, 17 and 25
    samples, batch 8, K = 2: the first two fail at steps 0 and 1). Compared in float64: on batches of 1-3 samples
    this network's training amplifies rounding (``benchmarks/bn_conditioning.py``: scaling the initial weights by
    1 + 1e-15 moves a float64 run by 1e-3), so the split keeps the real batches at 8 samples, where it moves it by
    1e-14."""

    def run(mode):
        model, rec = TorchvisionResNet(), Recorder()
        loop = FederatedLoop(
            model,
            client_optimizer=OPTIMIZERS["sgd"],
            local_steps=2,
            clients_per_round=4,
            seed=0,
            client_execution=mode,
            on_client_error="skip",
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(1, callbacks=[FedAvg(), rec]).fit(loop, datamodule=Images([1, 9, 17, 25], batch_size=8))
        return model, rec.updates, sorted(str(w.message) for w in caught if " skipped (" in str(w.message))

    seq, vec = run("sequential"), run("vectorized")
    assert len(seq[2]) == 2 and seq[2] == vec[2]  # the 1- and 9-sample clients (steps 0 and 1)
    assert "got input size torch.Size([1, 256, 1, 1])" in seq[2][0]  # layer3's first BatchNorm
    for a, b in zip(seq[0].state_dict().values(), vec[0].state_dict().values()):
        assert_buffer_close(b, a)
    moved = TorchvisionResNet().state_dict()
    assert max(float((a.double() - moved[k].double()).abs().max()) for k, a in seq[0].state_dict().items()) > 1e-3


def test_armijo_trial_calls_are_split_under_the_memory_cap(monkeypatch):
    """The batched Armijo search evaluates its (client, grid point) pairs in calls of at most
    max(C, TRIAL_POINT_BYTES / row bytes) rows: with the cap at 1 byte every call holds at most C = 6 rows, the search
    needed more pairs than that, and the run equals the uncapped one and sequential training."""
    import fedlightning.vectorized.rules as rules
    from fedlightning.vectorized.step import _StepEvaluator

    rows = []
    trial = _StepEvaluator.trial

    def spy(self, points, clients=None, line=None):
        rows.append(points.shape[0])
        return trial(self, points, clients, line)

    monkeypatch.setattr(_StepEvaluator, "trial", spy)
    uncapped = fit(BNNet("mlp"), OPTIMIZERS["armijo"], "vectorized")
    assert max(rows) > CPR  # windows of more pairs than clients
    rows.clear()
    monkeypatch.setattr(rules, "TRIAL_POINT_BYTES", 1)
    capped = fit(BNNet("mlp"), OPTIMIZERS["armijo"], "vectorized")
    assert max(rows) <= CPR
    assert_same(uncapped, capped)
    assert [u.backtracks for u in capped[2]] == [u.backtracks for u in uncapped[2]]
    assert_same(fit(BNNet("mlp"), OPTIMIZERS["armijo"], "sequential"), capped)
