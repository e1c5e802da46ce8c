"""BatchNorm (and instance norm with running statistics) under client_execution="vectorized".

Two references: torch's own layers on a client's real samples alone (the per-client, masked layer of
``fedlightning.vectorized.norms``), and sequential training (the weights, every client's reported buffers and the
global model's buffers after several rounds). The data is a ragged Dirichlet digits split (clients with fewer samples
than the batch size, so steps are padded), K > 1, SGD and SgdArmijo.
"""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.optim import SgdArmijo
from fedlightning.vectorized import VectorizationUnsupportedError, VectorizedClientTrainer
from fedlightning.vectorized.norms import _NormLayers
from fedlightning.vectorized.torch_internals import _vmap0
from test_vectorized_speed_paths import Sized

ROUNDS, CPR, K, BATCH = 3, 6, 4, 16
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2), "armijo": lambda p: SgdArmijo(p, eta_max=4.0, beta=0.7)}


# ---------------------------------------------------------------------------------------------- the layer itself
def _torch_layer(layer, x, n):
    """torch's layer on the first ``n`` samples alone: (output, running mean, running var, batches tracked)."""
    ref = copy.deepcopy(layer)
    out = ref(x[:n])
    return out, ref.running_mean, ref.running_var, ref.num_batches_tracked


@pytest.mark.parametrize("layer,shape", [
    (nn.BatchNorm1d(5), (7, 5)),
    (nn.BatchNorm1d(5, momentum=None), (7, 5, 3)),
    (nn.BatchNorm2d(3, affine=False), (7, 3, 4, 4)),
    (nn.BatchNorm3d(2, momentum=0.3), (7, 2, 2, 3, 2)),
    (nn.InstanceNorm1d(4, affine=True, track_running_stats=True), (7, 4, 6)),
    (nn.InstanceNorm2d(3, track_running_stats=True, momentum=0.5), (7, 3, 3, 3)),
], ids=["bn1d", "bn1d-cumulative-3d", "bn2d-no-affine", "bn3d", "in1d", "in2d"])
def test_masked_layer_equals_torch_on_each_clients_real_samples(layer, shape):
    """Three clients with 7, 4 and 2 real samples in a batch padded to 7: each row's output on its real samples and
    its running statistics equal torch's layer on those samples alone, in training mode (two steps, so the
    cumulative average and the counter are exercised) and in eval mode."""
    torch.manual_seed(0)
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
        xs = torch.randn(3, *shape) * 3 + 1
        norms.install()
        try:
            def per_row(x, m, *stats):
                norms.begin(stats, m.float(), m.float().sum(), min(sizes))
                return (layer(x), *norms.end())

            out = _vmap0(per_row, [xs, mask, *norms.rows()])
        finally:
            norms.uninstall()
        norms.write(out[1:], None)
        for c, n in enumerate(sizes):
            want = refs[c](xs[c, :n])
            torch.testing.assert_close(out[0][c, :n], want, atol=1e-5, rtol=1e-5)
            for got, ref in zip(norms.stats, (refs[c].running_mean, refs[c].running_var, refs[c].num_batches_tracked)):
                torch.testing.assert_close(got[c], ref, atol=1e-6, rtol=1e-5)
    assert int(norms.stats[2][0]) == (2 if isinstance(layer, nn.modules.batchnorm._BatchNorm) else 0)


# ---------------------------------------------------------------------------------------------- against sequential
def digits():
    return DigitsDataModule(num_clients=40, batch_size=BATCH, partition=Dirichlet(0.3), seed=0)


class Recorder(pl.Callback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, loop, plan, update):
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
            self.net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, **bn),
                                     nn.ReLU(), nn.Flatten(), nn.Linear(256, 10))
        elif kind == "instance":
            self.net = nn.Sequential(nn.Unflatten(1, (4, 16)), nn.InstanceNorm1d(4, affine=True, **bn), nn.Flatten(),
                                     nn.Linear(64, 10))
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
    model = copy.deepcopy(model)
    rec = Recorder()
    loop = FederatedLoop(model, client_optimizer=optimizer, local_steps=K, clients_per_round=CPR, seed=3,
                         client_execution=mode)
    make_trainer(rounds, callbacks=[FedAvg(), rec]).fit(loop, datamodule=dm())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buffers = [b.detach().clone() for b in model.buffers()]
    return weights, buffers, rec.updates, loop


def assert_same(seq, vec, atol=1e-4):
    torch.testing.assert_close(vec[0], seq[0], atol=atol, rtol=0)
    assert len(vec[1]) == len(seq[1])
    for a, b in zip(seq[1], vec[1]):
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
    assert [u.client_id for u in vec[2]] == [u.client_id for u in seq[2]]
    for a, b in zip(seq[2], vec[2]):
        assert (a.buffers is None) == (b.buffers is None)
        if a.buffers is not None:
            torch.testing.assert_close(b.buffers, a.buffers, atol=atol, rtol=0)


def test_the_split_is_ragged():
    dm = digits()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, seed=3)
    sizes = [dm.client_num_samples(c) for r in range(ROUNDS) for c in dm.sample_clients(r)]
    assert min(sizes) < BATCH and len(set(sizes)) > CPR


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("kind,bn", [
    ("mlp", {}),
    ("cnn", {}),
    ("mlp", {"momentum": None}),
    ("mlp", {"track_running_stats": False}),
    ("cnn", {"affine": False, "momentum": 0.5}),
    ("instance", {"track_running_stats": True}),
], ids=["mlp", "cnn", "cumulative", "no-running-stats", "cnn-no-affine", "instance-norm"])
def test_batchnorm_equals_sequential(opt, kind, bn):
    seq = fit(BNNet(kind, **bn), OPTIMIZERS[opt], "sequential")
    vec = fit(BNNet(kind, **bn), OPTIMIZERS[opt], "vectorized")
    assert_same(seq, vec)
    start = [b.clone() for b in BNNet(kind, **bn).buffers()]
    if start:  # the running statistics moved, and differ between clients
        assert (seq[1][0] - start[0]).abs().max() > 1e-2
        assert len({round(float(u.buffers[0]), 5) for u in vec[2]}) > 1
    if opt == "armijo":
        assert sum(u.backtracks for u in vec[2]) > 0  # trial evaluations ran (and did not move the statistics)


@pytest.mark.parametrize("opt,loss", [("sgd", "cross_entropy"), ("armijo", "cross_entropy"), ("sgd", "own")],
                         ids=["sgd", "armijo", "one-call-per-sample"])
def test_a_batchnorm_the_module_freezes_uses_its_running_statistics(opt, loss):
    """In eval mode a BatchNorm normalises each sample with the running statistics: it mixes no samples, so even
    the path that calls training_step once per sample (a loss the engine does not intercept) runs it."""
    seq = fit(BNNet("mlp", frozen=True, loss=loss), OPTIMIZERS[opt], "sequential")
    vec = fit(BNNet("mlp", frozen=True, loss=loss), OPTIMIZERS[opt], "vectorized")
    assert vec[3].vectorized_engine.call.intercept is (loss == "cross_entropy")
    assert_same(seq, vec)
    start = [b.clone() for b in BNNet("mlp").buffers()]
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


# ---------------------------------------------------------------------------------------------- refusals
def test_a_client_batch_of_one_sample_is_refused_naming_the_layer():
    """Sequential training fails a client whose BatchNorm1d batch has one sample (torch raises); vectorised clients
    cannot fail one client alone, so the round is refused and "auto" trains sequentially."""

    class Small(BNNet):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))

    def dm():
        return Sized([1, 5, 9, 12], batch_size=4)

    def make(mode):
        return FederatedLoop(Small(), client_optimizer=OPTIMIZERS["sgd"], local_steps=2, clients_per_round=4, seed=0,
                             client_execution=mode)

    with pytest.raises(VectorizationUnsupportedError, match=r"layer 'net\.1' \(BatchNorm1d\) would normalise a batch "
                                                            r"of one value per channel"):
        make_trainer(1).fit(make("vectorized"), datamodule=dm())
    with pytest.warns(UserWarning, match="training clients sequentially"):
        make_trainer(1).fit(make("auto"), datamodule=dm())


@pytest.mark.parametrize("kind,loss,match", [
    ("mlp", "own", r"'net\.1' \(BatchNorm1d\) computes statistics over a client's batch"),
    ("tokens", "cross_entropy", r"layer 'bn' \(BatchNorm1d\) got an input whose first dimension \(\d+\) is not the "
                                r"client's padded batch"),
])
def test_what_cannot_be_restricted_to_real_samples_is_refused(kind, loss, match):
    with pytest.raises(VectorizationUnsupportedError, match=match):
        fit(BNNet(kind, loss=loss), OPTIMIZERS["sgd"], "vectorized", rounds=1)
    fit(BNNet(kind, loss=loss), OPTIMIZERS["sgd"], "sequential", rounds=1)  # sequential training runs it
