"""A LightningModule written as a user would (no knowledge of fedlightning), run federatedly.

Each test compares against an independent computation: a hand-written reference loop, plain Lightning on the same
weights, or counts recorded outside the code under test.
"""

import copy
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.optim import SgdArmijo
from fedlightning.user_module import FederatedContractError
from numerics import RTOL64, Digits64, assert_close64, rtol32, to_float64


class UserNet(pl.LightningModule):
    """What a researcher writes: reads the trainer, logs a torchmetrics metric, owns its optimizer."""

    def __init__(self, lr: float = 0.1, warmup_rounds: int = 2, hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.seen = []  # (global_step, current_epoch, batch_idx, correct, total) of every gradient evaluation

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        scale = min(1.0, (self.trainer.global_step + 1) / self.hparams.warmup_rounds)  # warm-up idiom
        if torch.is_grad_enabled():
            correct = int((logits.argmax(-1) == y).sum())
            self.seen.append((self.global_step, self.current_epoch, batch_idx, correct, len(y)))
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc)
        return scale * F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))

    def on_validation_epoch_end(self):
        self.log("val_acc_epoch", self.val_acc.compute())
        self.val_acc.reset()

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc.update(self(x), y)

    def on_test_epoch_end(self):
        self.log("test_acc_epoch", self.test_acc.compute())
        self.test_acc.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _dm(**kw):
    return DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, **kw)


def _dm64(**kw):
    """The same clients with float64 inputs: runs compared with a reference computed another way are float64
    (numerics.RTOL64)."""
    return Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, **kw)


def _reference(net, dm, rounds, cpr, k, lr, seed, warmup=2, lrs=None):
    """FedAvg (sample-weighted) with plain SGD and the warm-up scale, in plain PyTorch."""
    dm.setup("fit")
    dm.configure_rounds(cpr, k, seed)
    glob = [p.detach().clone() for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    for r in range(rounds):
        scale = min(1.0, (r + 1) / warmup)
        lr_r = lrs[r] if lrs is not None else lr
        sums = [torch.zeros_like(g) for g in glob]
        total = 0.0
        for cid in dm.sample_clients(r):
            w = [g.clone().requires_grad_(True) for g in glob]
            loader = dm.client_dataloader(cid, r, seed=seed)
            it = iter(loader)
            for _ in range(k):
                try:
                    x, y = next(it)
                except StopIteration:
                    it = iter(loader)
                    x, y = next(it)
                out = torch.func.functional_call(net, dict(zip(names, w)), (x,))
                grads = torch.autograd.grad(scale * F.cross_entropy(out, y), w)
                w = [(wi - lr_r * gi).detach().requires_grad_(True) for wi, gi in zip(w, grads)]
            n = float(dm.client_num_samples(cid))
            total += n
            for s, g, wi in zip(sums, glob, w):
                s += n * (g - wi.detach())
        glob = [g - s / total for g, s in zip(glob, sums)]
    return glob


class _Record(pl.Callback):
    def __init__(self):
        self.rounds = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rounds.append({k: float(v) for k, v in trainer.callback_metrics.items()})


# ====================================================================== 1. attached to the Trainer
@pytest.mark.numerics
def test_user_module_sees_the_trainer_and_trains_like_the_reference_loop():
    torch.manual_seed(0)
    model = to_float64(UserNet(lr=0.2))
    init = copy.deepcopy(model.net)
    loop = FederatedLoop(model, local_steps=3, clients_per_round=4, seed=5)  # client_optimizer omitted
    trainer = make_trainer(3, callbacks=[FedAvg()])
    trainer.fit(loop, datamodule=_dm64())
    worker = loop.client_worker.model
    # global_step and current_epoch are the round inside training_step; the loss's warm-up scale read them
    assert sorted({(g, e) for g, e, *_ in worker.seen}) == [(0, 0), (1, 1), (2, 2)]
    assert len(worker.seen) == 3 * 4 * 3
    assert worker.trainer is trainer and worker.logger is trainer.logger and worker.hparams.lr == 0.2
    assert worker.device == torch.device("cpu")
    ref = _reference(init, _dm64(), rounds=3, cpr=4, k=3, lr=0.2, seed=5)
    for got, want in zip(loop.model.net.parameters(), ref):
        assert_close64(got.detach(), want)


def test_manual_optimization_api_is_refused_by_name_and_stops_the_run():
    class Manual(UserNet):
        def training_step(self, batch, batch_idx):
            self.optimizers()
            return super().training_step(batch, batch_idx)

    loop = FederatedLoop(Manual(), local_steps=2, clients_per_round=3)
    with pytest.raises(RuntimeError, match=r"round 0: client \d+ raised FederatedContractError") as info:
        make_trainer(2).fit(loop, datamodule=_dm())
    assert isinstance(info.value.__cause__, FederatedContractError)
    assert "Manual.optimizers() is not available" in str(info.value.__cause__)


def test_manual_optimization_module_is_refused_at_setup():
    class Manual(UserNet):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic_optimization = False"):
        make_trainer(1).fit(FederatedLoop(Manual(), local_steps=1, clients_per_round=2), datamodule=_dm())


# ====================================================================== 2. hooks
class Hooked(UserNet):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def setup(self, stage):
        self.calls.append(("setup", stage))

    def on_fit_start(self):
        self.calls.append(("on_fit_start",))

    def on_train_start(self):
        self.calls.append(("on_train_start",))

    def on_train_end(self):
        self.calls.append(("on_train_end",))

    def on_train_epoch_start(self):
        self.calls.append(("epoch_start", self.current_epoch))

    def on_train_epoch_end(self):
        self.calls.append(("epoch_end", self.current_epoch))

    def on_validation_epoch_start(self):
        self.calls.append(("val_epoch_start", self.global_step))

    def on_train_batch_start(self, batch, batch_idx):
        self.calls.append(("batch_start", batch_idx))

    def on_before_zero_grad(self, optimizer):
        self.calls.append(("zero_grad",))

    def on_before_backward(self, loss):
        self.calls.append(("before_backward", float(loss.detach())))

    def on_after_backward(self):
        self.calls.append(("after_backward", all(p.grad is not None for p in self.net.parameters())))

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(("before_step", optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(("batch_end", batch_idx, float(outputs["loss"])))


def test_hooks_run_once_per_fit_per_round_and_per_local_step():
    torch.manual_seed(0)
    model = Hooked(lr=0.1)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=1)
    trainer = make_trainer(2, limit_val_batches=1, val_check_interval=1, check_val_every_n_epoch=None)
    trainer.fit(loop, datamodule=_dm())
    glob = [c for c in model.calls if c[0] != "val_epoch_start"]
    assert glob == [("setup", "fit"), ("on_fit_start",), ("on_train_start",), ("on_train_end",)]
    # Lightning's sanity check, then after rounds 1 and 2
    assert [c for c in model.calls if c[0] == "val_epoch_start"] == [("val_epoch_start", s) for s in (0, 1, 2)]
    client = loop.client_worker.model.calls
    # the working copy was copied after setup: its record starts with the global model's first calls
    client = [c for c in client if c[0] not in ("setup", "on_fit_start", "on_train_start", "val_epoch_start")]
    per_step = ["batch_start", "zero_grad", "before_backward", "after_backward", "before_step", "batch_end"]
    expected = []
    for r in range(2):
        expected.append(("epoch_start", r))
        for _client in range(3):
            for k in range(2):
                expected += [(name, k) if name in ("batch_start",) else (name,) for name in per_step]
        expected.append(("epoch_end", r))
    got = [(c[0], c[1]) if c[0] in ("epoch_start", "epoch_end", "batch_start") else (c[0],) for c in client]
    assert got == expected
    assert all(c[1] for c in client if c[0] == "after_backward")  # gradients exist after backward
    assert all(c[1] == 0.1 for c in client if c[0] == "before_step")
    # outputs["loss"] of on_train_batch_end is the loss on_before_backward saw
    before = [c[1] for c in client if c[0] == "before_backward"]
    after = [c[2] for c in client if c[0] == "batch_end"]
    assert before == after


class Ordered(pl.LightningModule):
    """Records its per-step hooks in order; ``on_after_batch_transfer`` tags the training batch, so that the batch
    ``on_train_batch_start`` gets shows whether the transfer hooks ran before it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.order = []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.order.append("after_transfer")
        return [batch[0], batch[1], "tag"] if self.trainer.training else batch

    def on_train_batch_start(self, batch, batch_idx):
        self.order.append(f"batch_start {batch_idx} tagged={len(batch) == 3}")

    def training_step(self, batch, batch_idx):
        self.order.append(f"training_step {batch_idx}")
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_before_zero_grad(self, optimizer):
        self.order.append("before_zero_grad")

    def on_before_backward(self, loss):
        self.order.append("before_backward")

    def on_after_backward(self):
        self.order.append("after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.order.append("before_optimizer_step")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.order.append(f"batch_end {batch_idx}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_per_step_hooks_run_in_plain_lightnings_order():
    """One client of two local steps against plain Lightning on two batches: the transfer hooks before
    on_train_batch_start (which gets the transferred batch), on_before_zero_grad after training_step."""
    from torch.utils.data import DataLoader, TensorDataset

    module = Ordered()
    loop = FederatedLoop(module, local_steps=2, clients_per_round=1, seed=0)
    make_trainer(1).fit(loop, datamodule=_dm())
    federated = loop.client_worker.model.order
    plain = Ordered()
    data = DataLoader(TensorDataset(torch.randn(16, 64), torch.randint(0, 10, (16,))), batch_size=8)
    trainer = pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(plain, data)
    assert federated == plain.order
    assert federated[:4] == ["after_transfer", "batch_start 0 tagged=True", "training_step 0", "before_zero_grad"]


def test_on_train_batch_start_minus_one_ends_the_clients_local_steps():
    class StopAfterOne(UserNet):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None

    torch.manual_seed(0)
    a = StopAfterOne()
    b = UserNet()
    b.load_state_dict(a.state_dict())
    make_trainer(2).fit(FederatedLoop(a, local_steps=4, clients_per_round=3, seed=2), datamodule=_dm())
    make_trainer(2).fit(FederatedLoop(b, local_steps=1, clients_per_round=3, seed=2), datamodule=_dm())
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_on_train_batch_start_minus_one_at_the_first_step_is_a_healthy_client_with_update_zero():
    """-1 before a client's first step: it runs no step, as Lightning skips the epoch; it is no failure. Here every
    client of round 1 does so: that round leaves the global model as it was (FedAvg of zero updates, all three
    clients healthy) and warns about no client; rounds 0 and 2 train as without the hook. A run whose every round
    does so ends without an error, the model untouched."""

    class NoStepInRound1(UserNet):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if self.global_step == 1 else None

    class Weights(pl.Callback):
        def __init__(self):
            self.after = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.model.parameters()]))

    torch.manual_seed(0)
    a, b = NoStepInRound1(), UserNet()
    b.load_state_dict(a.state_dict())
    rec, wa, wb = _Record(), Weights(), Weights()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"round \d+: client \d+ skipped")  # no client reported skipped
        make_trainer(3, callbacks=[rec, wa]).fit(FederatedLoop(a, local_steps=2, clients_per_round=3, seed=2), _dm())
    make_trainer(3, callbacks=[wb]).fit(FederatedLoop(b, local_steps=2, clients_per_round=3, seed=2), _dm())
    assert torch.equal(wa.after[1], wa.after[0])  # round 1 trained nothing
    assert torch.equal(wa.after[0], wb.after[0]) and not torch.equal(wa.after[2], wa.after[1])
    assert rec.rounds[1]["server/delta_norm"] == 0.0
    assert rec.rounds[1]["round/clients"] == 3 and rec.rounds[1]["round/failed_clients"] == 0

    class NoStepEver(UserNet):
        def on_train_batch_start(self, batch, batch_idx):
            return -1

    torch.manual_seed(0)
    c = NoStepEver()
    start = [p.detach().clone() for p in c.parameters()]
    make_trainer(2).fit(FederatedLoop(c, local_steps=2, clients_per_round=3, seed=2), datamodule=_dm())
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), start))


def test_a_parameter_that_does_not_train_starts_from_its_global_value_for_every_client():
    """A frozen parameter (requires_grad=False) the module changes after a client's last step once carried over to
    the next client (which trained with the changed value). Every client starts from the global value now: the run
    equals one whose module never changes it; the global value is unchanged; one warning names the parameter."""

    class Scaled(UserNet):
        def __init__(self, doubles: bool):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()), requires_grad=False)
            self.doubles = doubles

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x) * self.scale, y)

        def on_train_batch_end(self, outputs, batch, batch_idx):  # after the client's last step (K = 2)
            if self.doubles and batch_idx == 1:
                with torch.no_grad():
                    self.scale.mul_(2.0)

    torch.manual_seed(0)
    a, b = Scaled(doubles=True), Scaled(doubles=False)
    b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match=r"changed Scaled parameter\(s\) scale with requires_grad=False") as caught:
        make_trainer(2).fit(FederatedLoop(a, local_steps=2, clients_per_round=3, seed=2), datamodule=_dm())
    assert len([w for w in caught if "requires_grad=False" in str(w.message)]) == 1
    make_trainer(2).fit(FederatedLoop(b, local_steps=2, clients_per_round=3, seed=2), datamodule=_dm())
    assert float(a.scale) == 1.0
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


STARTS: list[tuple[int, float]] = []  # (round, sum of mu) at each client's first step, of the running RunningMean


class RunningMean(UserNet):
    """Keeps a running mean of its inputs in a buffer, updated in place or by reassignment (``self.mu = ...``), and
    records the buffer's value at each client's first step."""

    def __init__(self, reassign: bool):
        super().__init__()
        self.register_buffer("mu", torch.zeros(64))
        self.reassign = reassign

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0 and torch.is_grad_enabled():
            STARTS.append((self.global_step, float(self.mu.sum())))  # the client working copy's, not the global
        if self.reassign:
            self.mu = (0.9 * self.mu + 0.1 * x.mean(0)).detach()
        else:
            with torch.no_grad():
                self.mu.mul_(0.9).add_(0.1 * x.mean(0))
        return F.cross_entropy(self(x - self.mu), y)


@pytest.mark.parametrize("optimizer", ["sgd", "armijo"])
def test_a_buffer_reassigned_in_training_step_trains_as_one_written_in_place(optimizer):
    """self.mu = ... registers a new tensor under the buffer's name: every client still starts from the global value
    (it had carried over from client to client, and the global buffer never changed), a line search's trial
    evaluations leave it as they found it, and FedAvg averages the clients' values: the run (weights, buffer, the
    buffer each client starts from) equals the one that writes the buffer in place, bit for bit."""
    make_opt = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (lambda p: SgdArmijo(p, eta_max=1.0))
    runs, starts = {}, {}
    for reassign in (False, True):
        torch.manual_seed(0)
        STARTS.clear()
        model = RunningMean(reassign)
        loop = FederatedLoop(model, client_optimizer=make_opt, local_steps=3, clients_per_round=3, seed=2)
        make_trainer(2).fit(loop, datamodule=_dm())
        runs[reassign], starts[reassign] = model, list(STARTS)
    inplace, reassigned = runs[False], runs[True]
    assert starts[True] == starts[False] and len(starts[True]) == 6
    assert [v for r, v in starts[True] if r == 0] == [0.0, 0.0, 0.0]  # every round-0 client from the global 0
    assert len({v for r, v in starts[True] if r == 1}) == 1 and starts[True][-1][1] != 0.0
    assert torch.equal(reassigned.mu, inplace.mu) and float(reassigned.mu.abs().sum()) > 0
    for p, q in zip(reassigned.parameters(), inplace.parameters()):
        assert torch.equal(p, q)


COUNTS: list[tuple[int, int, int, bool]] = []  # (round, batch_idx, count, flag) after each gradient step


class Counting(UserNet):
    """An integer step counter and a bool flag (a mask) that ``training_step`` updates, a large integer constant it
    never touches, and a BatchNorm layer (its ``num_batches_tracked``, momentum=None: a cumulative average)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 10))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("flag", torch.zeros(1, dtype=torch.bool))
        self.register_buffer("salt", torch.tensor([2**60 + 1, -7], dtype=torch.long))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if torch.is_grad_enabled():
            self.steps += 1
            self.flag.fill_(bool(len(y) % 2))  # a client whose batches have an odd size sets it
            COUNTS.append((self.global_step, batch_idx, int(self.steps), bool(self.flag)))
        return loss


def test_integer_and_bool_buffers_are_averaged_with_the_clients():
    """Every client starts from the global counter, and the round writes back the clients' mean count rounded to
    an integer, their flags' majority and BatchNorm's count with its statistics; an integer no client changes (here
    beyond 2**53) stays exactly as it was. Local epochs give the clients different step counts."""
    COUNTS.clear()
    torch.manual_seed(0)
    model = Counting()
    loop = FederatedLoop(model, local_epochs=1, clients_per_round=3, seed=2)
    dm = DigitsDataModule(num_clients=10, batch_size=20, partition=Dirichlet(0.5), seed=1)  # no batch of 1 sample
    make_trainer(2, callbacks=[FedAvg(weighting="uniform")]).fit(loop, datamodule=dm)
    clients = []  # (round, first count, last count, last flag) of each client, in training order
    for r, k, count, flag in COUNTS:
        if k == 0:
            clients.append([r, count, count, flag])
        clients[-1][2:] = [count, flag]
    assert len(clients) == 6 and len({c[2] - c[1] for c in clients}) > 1  # the clients ran different step counts
    start = 0
    for r in (0, 1):
        mine = [c for c in clients if c[0] == r]
        assert [c[1] for c in mine] == [start + 1] * 3  # each client's first step counted from the global value
        start = round(sum(c[2] for c in mine) / 3)
    assert int(model.steps) == start
    assert bool(model.flag) == (sum(c[3] for c in clients if c[0] == 1) >= 2)
    assert model.salt.tolist() == [2**60 + 1, -7]
    bn = model.net[1]
    assert int(bn.num_batches_tracked) == start  # one BatchNorm count per gradient step, as the counter


def test_the_reported_buffers_lay_out_every_averaged_buffer_once_in_model_order():
    """``ClientUpdate.buffers`` (state.report_buffers) holds each real buffer at the slice that
    state.averaged_buffer_slices names, in model.buffers() order; a complex buffer as its real and imaginary parts;
    an integer buffer makes the report float64, exact up to 2**53."""
    from fedlightning.state import averaged_buffer_slices, report_buffers

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    net.register_buffer("phase", torch.ones(2, dtype=torch.complex64))
    net.register_buffer("mask", torch.tensor([True, False, True]))
    with torch.no_grad():
        net[1].running_mean.copy_(torch.arange(4.0))
        net[1].num_batches_tracked.fill_(2**52 + 1)
    buffers = list(net.buffers())
    layout = averaged_buffer_slices(buffers)
    assert [i for i, _ in layout] == [0, 1, 2, 3, 4]  # phase, mask, then the BatchNorm's: mean, var, count
    flat = report_buffers(buffers)
    assert flat.dtype == torch.float64 and flat.numel() == 2 * 2 + 3 + 4 + 4 + 1
    for i, part in layout[1:]:
        assert torch.equal(flat[part], buffers[i].reshape(-1).double())
    assert flat[layout[0][1]].tolist() == [1.0, 0.0, 1.0, 0.0]  # (real, imaginary) pairs
    # the global model's buffers decide the layout and dtype when a client's training made one float64
    changed = [b.double() if i == 2 else b for i, b in enumerate(buffers)]
    assert torch.equal(report_buffers(changed, like=buffers), flat)
    float32 = [torch.zeros(2), torch.ones(3)]
    assert report_buffers([float32[0].double(), float32[1]], like=float32).dtype == torch.float32


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_batchnorm_counts_its_batches_across_rounds_in_both_modes(execution):
    """num_batches_tracked of the global BatchNorm advances by the clients' mean count each round (K = 3 steps, 2
    rounds), vectorized clients as sequential ones."""

    class BatchNormNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = BatchNormNet()
    loop = FederatedLoop(model, local_steps=3, clients_per_round=3, seed=2, client_execution=execution)
    dm = DigitsDataModule(num_clients=10, batch_size=20, partition=Dirichlet(0.5), seed=1)
    make_trainer(2).fit(loop, datamodule=dm)
    assert int(model.net[1].num_batches_tracked) == 2 * 3


def test_a_buffer_reassigned_in_training_step_is_refused_vectorized_and_auto_trains_sequentially():
    from fedlightning.vectorized import VectorizationUnsupportedError

    def fit_mode(mode):
        torch.manual_seed(0)
        model = RunningMean(reassign=True)
        loop = FederatedLoop(model, local_steps=3, clients_per_round=3, seed=2, client_execution=mode)
        make_trainer(2).fit(loop, datamodule=_dm())
        return model

    with pytest.raises(VectorizationUnsupportedError, match=r"reassigns its buffer 'mu'"):
        fit_mode("vectorized")
    seq, auto = fit_mode("sequential"), fit_mode("auto")
    assert torch.equal(auto.mu, seq.mu) and auto.mu.shape == (64,)
    for p, q in zip(auto.parameters(), seq.parameters()):
        assert torch.equal(p, q)


def test_a_write_into_a_parameter_that_does_not_train_is_refused_vectorized_and_auto_trains_sequentially():
    """Vectorized clients share a frozen parameter: a write in training_step applies once per batched call, not per
    client, and carried into later rounds. It is refused by name; auto trains such a module sequentially, equal to
    sequential training."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    class Counts(UserNet):
        def __init__(self):
            super().__init__()
            self.seen = nn.Parameter(torch.zeros(()), requires_grad=False)

        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                self.seen += 1
            x, y = batch
            return F.cross_entropy(self(x), y) * (1.0 + 0.01 * self.seen)

    def fit(mode):
        torch.manual_seed(0)
        model = Counts()
        loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2, client_execution=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(2).fit(loop, datamodule=_dm())
        return model

    with pytest.raises(VectorizationUnsupportedError, match=r"Counts writes into its parameter\(s\) seen with "):
        fit("vectorized")
    sequential, auto = fit("sequential"), fit("auto")
    assert float(auto.seen) == float(sequential.seen) == 0.0
    for p, q in zip(auto.net.parameters(), sequential.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_backward_hooks_with_a_closure_optimizer_are_refused_at_setup():
    class WithHook(UserNet):
        def on_after_backward(self):
            pass

        def configure_optimizers(self):
            return SgdArmijo(self.parameters())

    with pytest.raises(ValueError, match="on_after_backward.*SgdArmijo"):
        make_trainer(1).fit(FederatedLoop(WithHook(), local_steps=1, clients_per_round=2), datamodule=_dm())


def test_evaluation_hooks_match_plain_lightning_on_the_same_weights():
    torch.manual_seed(0)
    model = UserNet()
    dm = _dm()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    trainer = make_trainer(2, limit_val_batches=None)
    trainer.fit(loop, datamodule=dm)
    fed_val = trainer.validate(loop, datamodule=dm, verbose=False)[0]
    fed_test = trainer.test(loop, datamodule=dm, verbose=False)[0]
    plain = UserNet()
    plain.load_state_dict(model.state_dict())
    pt = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    ref_val = pt.validate(plain, dataloaders=dm.val_dataloader(), verbose=False)[0]
    ref_test = pt.test(plain, dataloaders=dm.test_dataloader(), verbose=False)[0]
    # the same validation_step / test_step on the same weights and batches: the same numbers
    assert fed_val["val_acc_epoch"] == ref_val["val_acc_epoch"]
    assert fed_val["val_loss"] == ref_val["val_loss"]
    assert fed_test["test_acc_epoch"] == ref_test["test_acc_epoch"]


def test_the_wrapped_module_logs_as_its_own_under_a_plain_trainer_after_and_beside_the_loop():
    """The module a FederatedLoop wraps is still the user's: evaluated by a plain Trainer (after federated
    training, or wrapped but never fitted, or after a fit that raised) its self.log reaches that Trainer, with the
    values of plain Lightning on a fresh copy of the same weights; the loop's own evaluations keep logging."""

    def plain_validate(module, dm):
        pt = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        return pt.validate(module, dataloaders=dm.val_dataloader(), verbose=False)[0]

    torch.manual_seed(0)
    dm = _dm()
    model = UserNet()
    wrapped_only = copy.deepcopy(model)
    FederatedLoop(wrapped_only, local_steps=2, clients_per_round=3)  # constructed, never fitted
    dm.setup("fit")
    assert plain_validate(wrapped_only, dm) == plain_validate(copy.deepcopy(model), dm)

    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    trainer = make_trainer(2, limit_val_batches=None)
    trainer.fit(loop, datamodule=dm)
    after = plain_validate(model, dm)
    fresh = UserNet()
    fresh.load_state_dict(model.state_dict())
    assert after == plain_validate(fresh, dm) and set(after) == {"val_loss", "val_acc_epoch"}
    assert trainer.validate(loop, datamodule=dm, verbose=False)[0] == after  # the loop's evaluation again

    class Fails(UserNet):
        def training_step(self, batch, batch_idx):
            raise KeyError("a bug")

    failing = Fails()
    with pytest.raises(RuntimeError, match="KeyError"):
        make_trainer(2).fit(FederatedLoop(failing, local_steps=2, clients_per_round=3), datamodule=_dm())
    fresh = UserNet()
    fresh.load_state_dict(failing.state_dict())
    assert plain_validate(failing, dm) == plain_validate(fresh, dm)


# ====================================================================== 3. the module's optimizer
@pytest.mark.parametrize("form", ["optimizer", "list", "dict", "tuple_of_lists"])
def test_configure_optimizers_forms_define_the_client_optimizer(form):
    class Forms(UserNet):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.5)
            return {"optimizer": opt, "list": [opt], "dict": {"optimizer": opt}, "tuple_of_lists": ([opt], [])}[form]

    torch.manual_seed(0)
    a = Forms()
    b = UserNet()
    b.load_state_dict(a.state_dict())
    make_trainer(2).fit(FederatedLoop(a, local_steps=3, clients_per_round=3, seed=4), datamodule=_dm())
    explicit = lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5)  # noqa: E731
    make_trainer(2).fit(FederatedLoop(b, explicit, local_steps=3, clients_per_round=3, seed=4), datamodule=_dm())
    moved = sum(float((p - q).abs().sum()) for p, q in zip(a.net.parameters(), UserNet().net.parameters()))
    assert moved > 0
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_explicit_client_optimizer_wins_over_configure_optimizers():
    torch.manual_seed(0)
    a = to_float64(UserNet(lr=5.0))  # configure_optimizers would use lr 5
    init = copy.deepcopy(a.net)
    loop = FederatedLoop(a, lambda p: torch.optim.SGD(p, lr=0.2), local_steps=2, clients_per_round=3, seed=3)
    make_trainer(2).fit(loop, datamodule=_dm64())
    ref = _reference(init, _dm64(), rounds=2, cpr=3, k=2, lr=0.2, seed=3)
    for got, want in zip(a.net.parameters(), ref):
        assert_close64(got.detach(), want)


def test_custom_optimizer_arguments_survive_the_rebuild_per_client():
    class Armijo(UserNet):
        def configure_optimizers(self):
            return SgdArmijo(self.parameters(), eta_max=2.0, c=0.2, reset="last", carry_step_size=True)

    torch.manual_seed(0)
    a = Armijo()
    b = UserNet()
    b.load_state_dict(a.state_dict())
    explicit = lambda p: SgdArmijo(p, eta_max=2.0, c=0.2, reset="last", carry_step_size=True)  # noqa: E731
    make_trainer(3).fit(FederatedLoop(a, local_steps=3, clients_per_round=3, seed=4), datamodule=_dm())
    make_trainer(3).fit(FederatedLoop(b, explicit, local_steps=3, clients_per_round=3, seed=4), datamodule=_dm())
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


class Scheduled(UserNet):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def _assert_halving_rounds(module):
    """Three float64 rounds of ``module`` (lr 0.4, a schedule that halves it after every round): the rounds' client
    step sizes are 0.4, 0.2, 0.1 (a float64 mean, numerics.RTOL64) and the weights the reference loop's."""
    torch.manual_seed(0)
    model = to_float64(module)
    init = copy.deepcopy(model.net)
    rec = _Record()
    make_trainer(3, callbacks=[rec]).fit(
        FederatedLoop(model, local_steps=2, clients_per_round=3, seed=6), datamodule=_dm64()
    )
    assert [r["client/step_size_mean"] for r in rec.rounds] == pytest.approx([0.4, 0.2, 0.1], rel=RTOL64)
    ref = _reference(init, _dm64(), rounds=3, cpr=3, k=2, lr=None, seed=6, lrs=[0.4, 0.2, 0.1])
    for got, want in zip(model.net.parameters(), ref):
        assert_close64(got.detach(), want)


def test_lr_scheduler_is_stepped_once_per_round():
    _assert_halving_rounds(Scheduled(lr=0.4))


class ScheduledPerStep(UserNet):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_scheduler_with_interval_step_steps_once_per_round_and_says_so():
    """In plain Lightning ``interval: "step"`` steps the scheduler every training batch; here a round is one step of
    the global model, so it steps once per round (the rounds' step sizes 0.4, 0.2, 0.1, not halved per local
    step), with a warning that names the scheduler; ``"epoch"`` (the default) warns nothing."""
    with pytest.warns(UserWarning, match=r"StepLR has interval 'step', which steps it once per round") as caught:
        _assert_halving_rounds(ScheduledPerStep(lr=0.4))
    assert len([w for w in caught if "interval 'step'" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_halving_rounds(Scheduled(lr=0.4))
    assert not [w for w in caught if "interval 'step'" in str(w.message)]


class _EpochHalving:
    """A scheduler outside torch.optim (timm's kind): ``step`` needs the epoch, so Lightning needs the module's
    ``lr_scheduler_step``."""

    def __init__(self, optimizer, base):
        self.optimizer, self.base = optimizer, base

    def step(self, epoch):
        for g in self.optimizer.param_groups:
            g["lr"] = self.base * 0.5**epoch

    def state_dict(self):
        return {"base": self.base}

    def load_state_dict(self, state):
        self.base = state["base"]


def test_a_modules_lr_scheduler_step_steps_its_scheduler_once_per_round():
    class TimmStyle(UserNet):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": _EpochHalving(opt, self.hparams.lr)}

        def lr_scheduler_step(self, scheduler, metric):
            self.scheduler_steps = getattr(self, "scheduler_steps", 0) + 1
            scheduler.step(epoch=self.scheduler_steps)

    _assert_halving_rounds(TimmStyle(lr=0.4))


@pytest.mark.parametrize(
    "hook,instead",
    [
        ("optimizer_step", "on_before_optimizer_step"),
        ("optimizer_zero_grad", "on_before_zero_grad"),
        ("configure_gradient_clipping", "client_grad_clip"),
        ("backward", "on_before_backward"),
    ],
)
def test_optimization_step_hooks_client_training_does_not_call_are_refused_at_setup(hook, instead):
    """Plain Lightning calls these around each optimizer step; client training runs the step itself and would skip
    the override silently (a warm-up in optimizer_step trained without its warm-up)."""

    def override(self, *args, **kwargs):
        raise AssertionError("never called")

    Overriding = type("Overriding", (UserNet,), {hook: override})
    with pytest.raises(ValueError, match=rf"Overriding overrides {hook}\(\), which federated client training does "
                       rf"not call.*{instead}"):  # fmt: skip
        make_trainer(1).fit(FederatedLoop(Overriding(), local_steps=1, clients_per_round=2), datamodule=_dm())


def test_lr_scheduler_state_is_resumed(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    full = Scheduled(lr=0.4)
    part = Scheduled(lr=0.4)
    part.load_state_dict(full.state_dict())
    make_trainer(4).fit(FederatedLoop(full, local_steps=2, clients_per_round=3, seed=6), datamodule=_dm())
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    make_trainer(2, callbacks=[ckpt], enable_checkpointing=True).fit(
        FederatedLoop(part, local_steps=2, clients_per_round=3, seed=6), datamodule=_dm()
    )
    resumed = Scheduled(lr=0.4)
    rec = _Record()
    make_trainer(4, callbacks=[rec]).fit(
        FederatedLoop(resumed, local_steps=2, clients_per_round=3, seed=6),
        datamodule=_dm(),
        ckpt_path=str(tmp_path / "last.ckpt"),
    )
    assert [r["client/step_size_mean"] for r in rec.rounds] == pytest.approx([0.1, 0.05])
    for p, q in zip(resumed.net.parameters(), full.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_optimizer_misconfigurations_are_clear_errors():
    class Two(UserNet):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]

    class NoOptimizer(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.lin(batch[0]), batch[1])

    with pytest.raises(ValueError, match="returned 2 optimizers"):
        make_trainer(1).fit(FederatedLoop(Two(), local_steps=1, clients_per_round=2), datamodule=_dm())
    with pytest.raises(ValueError, match="NoOptimizer does not define configure_optimizers"):
        make_trainer(1).fit(FederatedLoop(NoOptimizer(), local_steps=1, clients_per_round=2), datamodule=_dm())


# ====================================================================== 4. training metrics
@pytest.mark.parametrize("optimizer", ["sgd", "armijo"])
def test_torchmetrics_metric_in_training_step_is_a_round_metric(optimizer):
    torch.manual_seed(0)
    model = UserNet()
    factory = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (lambda p: SgdArmijo(p))
    rec = _Record()
    loop = FederatedLoop(model, factory, local_steps=3, clients_per_round=4, seed=2)
    make_trainer(3, callbacks=[rec]).fit(loop, datamodule=_dm())
    seen = loop.client_worker.model.seen  # only gradient evaluations (a line search's trials excluded)
    for r in range(3):
        steps = [s for s in seen if s[0] == r]
        assert len(steps) == 4 * 3
        want = sum(s[3] for s in steps) / sum(s[4] for s in steps)
        # torchmetrics' float32 ratio of the same counts: one rounding (numerics.rtol32)
        assert rec.rounds[r]["client/train_acc"] == pytest.approx(want, rel=rtol32(1))


@pytest.mark.parametrize("optimizer", ["sgd", "armijo"])
@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_values_logged_inside_a_no_grad_block_of_training_step_are_round_metrics(optimizer, mode):
    """A batch accuracy computed and logged under ``torch.no_grad()`` inside ``training_step`` (a common idiom) is a
    ``client/*`` mean as any other logged value; a line search's trial calls (grad disabled around the whole
    ``training_step``) log nothing. Logged: 1 from a training step, 100 from a trial call."""

    class LogsWithoutGrad(UserNet):
        def training_step(self, batch, batch_idx):
            trial = not torch.is_grad_enabled()
            loss = F.cross_entropy(self(batch[0]), batch[1])
            with torch.no_grad():
                self.log("no_grad_value", 100.0 if trial else 1.0)
                self.log("step_index", float(batch_idx))
            return loss

    torch.manual_seed(0)
    factory = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (lambda p: SgdArmijo(p))
    rec = _Record()
    loop = FederatedLoop(LogsWithoutGrad(), factory, local_steps=3, clients_per_round=4, seed=2, client_execution=mode)
    make_trainer(2, callbacks=[rec]).fit(loop, datamodule=_dm())
    for r in range(2):
        assert rec.rounds[r]["client/no_grad_value"] == 1.0
        assert rec.rounds[r]["client/step_index"] == 1.0  # the mean of 0, 1, 2 over each client's steps


# ====================================================================== 5. failures that are bugs
def test_a_bug_in_every_client_stops_the_run_with_the_exception_chained():
    class Buggy(UserNet):
        def training_step(self, batch, batch_idx):
            return {"los": super().training_step(batch, batch_idx)}["loss"]

    with pytest.raises(RuntimeError, match=r"round 0: every client raised an exception \(client \d+: KeyError") as e:
        make_trainer(3).fit(
            FederatedLoop(Buggy(), local_steps=1, clients_per_round=2, on_client_error="skip"), datamodule=_dm()
        )
    assert isinstance(e.value.__cause__, KeyError)


def test_one_failing_client_is_still_skipped():
    class FailsOnce(UserNet):
        calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            if self.calls == 1:  # the first client of round 0
                raise KeyError("client data")
            return super().training_step(batch, batch_idx)

    rec = _Record()
    with pytest.warns(UserWarning, match=r"round 0: client \d+ skipped \(KeyError\('client data'\)\)"):
        make_trainer(2, callbacks=[rec]).fit(
            FederatedLoop(FailsOnce(), local_steps=1, clients_per_round=3, on_client_error="skip"), datamodule=_dm()
        )
    assert [(r["round/failed_clients"], r["round/clients"]) for r in rec.rounds] == [(1, 2), (0, 3)]


def test_consecutive_diverged_rounds_stop_after_max_failed_rounds():
    torch.manual_seed(0)
    model = UserNet(lr=1e37)  # finite (an infinite lr is refused at setup); every client diverges
    before = [p.detach().clone() for p in model.parameters()]
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, max_failed_rounds=3)
    trainer = make_trainer(10)
    with pytest.raises(FloatingPointError, match=r"round 2: 3 consecutive rounds without a healthy client"):
        trainer.fit(loop, datamodule=_dm())
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, atol=0, rtol=0)  # the global model was never corrupted
    tolerant = FederatedLoop(UserNet(lr=1e37), local_steps=2, clients_per_round=3, max_failed_rounds=None)
    with pytest.warns(UserWarning, match="no healthy client"):
        make_trainer(4).fit(tolerant, datamodule=_dm())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_failed_rounds_is_validated(bad):
    with pytest.raises(ValueError, match="max_failed_rounds"):
        FederatedLoop(UserNet(), max_failed_rounds=bad)


# ====================================================================== vectorized mode
def test_vectorized_runs_a_trainer_reading_module_and_refuses_what_it_cannot_batch():
    from fedlightning.vectorized import VectorizationUnsupportedError

    class NoMetric(UserNet):
        def training_step(self, batch, batch_idx):
            x, y = batch
            scale = min(1.0, (self.trainer.global_step + 1) / self.hparams.warmup_rounds)
            return scale * F.cross_entropy(self(x), y)

    torch.manual_seed(0)
    a = to_float64(NoMetric())
    b = to_float64(NoMetric())
    b.load_state_dict(a.state_dict())
    make_trainer(3).fit(
        FederatedLoop(a, local_steps=2, clients_per_round=3, seed=1, client_execution="vectorized"), datamodule=_dm64()
    )
    make_trainer(3).fit(FederatedLoop(b, local_steps=2, clients_per_round=3, seed=1), datamodule=_dm64())
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        assert_close64(p, q)

    class LabelCount(torchmetrics.Metric):
        """Counts labels given as a list of tensors (an argument vectorised mode cannot record per client)."""

        def __init__(self):
            super().__init__()
            self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

        def update(self, labels):
            self.n += sum(len(t) for t in labels)

        def compute(self):
            return self.n

    class ListMetric(UserNet):
        def __init__(self):
            super().__init__()
            self.labels = LabelCount()

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.labels.update([y])
            self.log("labels", self.labels)
            return F.cross_entropy(self(x), y)

    with pytest.raises(
        VectorizationUnsupportedError, match="'labels' is updated in training_step with an argument of type list"
    ):
        make_trainer(1).fit(
            FederatedLoop(ListMetric(), local_steps=1, clients_per_round=2, client_execution="vectorized"),
            datamodule=_dm(),
        )
    with pytest.raises(VectorizationUnsupportedError, match="per-step hook"):
        make_trainer(1).fit(
            FederatedLoop(Hooked(), local_steps=1, clients_per_round=2, client_execution="vectorized"), datamodule=_dm()
        )
    # auto falls back to sequential and gives the sequential result
    torch.manual_seed(0)
    c, d = ListMetric(), ListMetric()
    d.load_state_dict(c.state_dict())
    with pytest.warns(UserWarning, match="training clients sequentially"):
        make_trainer(2).fit(
            FederatedLoop(c, local_steps=2, clients_per_round=3, client_execution="auto"), datamodule=_dm()
        )
    make_trainer(2).fit(FederatedLoop(d, local_steps=2, clients_per_round=3), datamodule=_dm())
    for p, q in zip(c.net.parameters(), d.net.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_python_trainer_gets_the_round_progress_bar():
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.callbacks.progress import ProgressBar

    from fedlightning.callbacks.progress import ROUND_DESCRIPTION, RoundProgressBar, RoundTQDMProgressBar

    trainer = make_trainer(2, enable_progress_bar=True)
    default = type(trainer.progress_bar_callback)  # Lightning's default ("Epoch 0"): rich when installed, else tqdm
    assert default.__module__.startswith("lightning.")
    trainer.fit(FederatedLoop(UserNet(), local_steps=1, clients_per_round=2), datamodule=_dm())
    bars = [cb for cb in trainer.callbacks if isinstance(cb, ProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], default) and type(bars[0]) is not default
    assert isinstance(bars[0], RoundProgressBar) or isinstance(bars[0], RoundTQDMProgressBar)
    if isinstance(bars[0], TQDMProgressBar):
        assert bars[0].train_progress_bar.desc.startswith(ROUND_DESCRIPTION)
    else:
        assert bars[0]._get_train_description(0).startswith(ROUND_DESCRIPTION)
    custom = RoundTQDMProgressBar(refresh_rate=5)  # a bar the user chose is kept
    trainer = make_trainer(1, enable_progress_bar=True, callbacks=[custom])
    trainer.fit(FederatedLoop(UserNet(), local_steps=1, clients_per_round=2), datamodule=_dm())
    assert trainer.progress_bar_callback is custom


# ============================================================================ batch-transfer hooks
_TG = torch.Generator().manual_seed(3)
_TX = torch.randn(90, 4, dtype=torch.float64, generator=_TG)
_TY = (_TX[:, 0] - _TX[:, 1] > 0).long()


class _PlainLinear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", F.cross_entropy(self.lin(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


class _TransferHooks(_PlainLinear):
    """Reads its batches only as its transfer hooks leave them: a dict, the inputs doubled on the device."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return {"x": x, "y": y, "stage": "before"}

    def on_after_batch_transfer(self, batch, dataloader_idx):
        assert batch["stage"] == "before"
        return {"x": 2 * batch["x"], "y": batch["y"], "stage": "after"}

    def training_step(self, batch, batch_idx):
        assert batch["stage"] == "after", "training_step got a batch that skipped the transfer hooks"
        return super().training_step((batch["x"], batch["y"]), batch_idx)

    def validation_step(self, batch, batch_idx):
        assert batch["stage"] == "after"
        return super().validation_step((batch["x"], batch["y"]), batch_idx)


def _transfer_run(module, x, strategy: str, accelerator: str = "cpu"):
    from torch.utils.data import TensorDataset

    from fedlightning.callbacks import FedDANE, FedSPSGlobal, GlobalEvaluation, Mime
    from fedlightning.datamodules import IID, FederatedDataModule
    from fedlightning.optim import SPS

    callbacks = {
        "FedAvg": lambda: [FedAvg()],
        "FedDANE": lambda: [FedDANE(mu=0.1, gradient_batch_size=4)],
        "Mime": lambda: [Mime(momentum=0.5)],
        "FedSPSGlobal": lambda: [FedSPSGlobal(initial_step_size=0.2)],
    }[strategy]()
    evaluation = GlobalEvaluation(split="train", every_n_rounds=1, batch_size=7)
    dm = FederatedDataModule.from_datasets(
        TensorDataset(x, _TY), num_clients=6, batch_size=5, partition=IID(), seed=0, val_fraction=0.2
    )
    opt = (lambda p: SPS(p, fixed_step_size=1.0)) if strategy == "FedSPSGlobal" else None
    loop = FederatedLoop(module, client_optimizer=opt, local_steps=3, clients_per_round=3, seed=0)
    trainer = make_trainer(
        3,
        callbacks=[*callbacks, evaluation],
        limit_val_batches=1.0,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        accelerator=accelerator,
    )
    trainer.fit(loop, datamodule=dm)
    metrics = trainer.callback_metrics
    return flat_weights(loop), float(metrics["train_eval/loss"]), float(metrics["loss"])  # "loss": validation_step's


def flat_weights(loop):
    return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().cpu().clone()


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["FedAvg", "FedDANE", "Mime", "FedSPSGlobal"])
@pytest.mark.parametrize(
    "accelerator",
    ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
    ids=["cpu", "cuda"],
)
def test_every_batch_the_model_reads_goes_through_its_transfer_hooks(strategy, accelerator):
    """Local steps, FedDANE's and Mime's full-batch gradients, FedSPS-Global's probe of the first client,
    GlobalEvaluation and validation all hand training_step / validation_step the batch its transfer hooks make (a
    dict with the inputs doubled): the run equals, in float64, the same run of a module without hooks on doubled
    data."""
    hooked = _transfer_run(_TransferHooks(), _TX, strategy, accelerator)
    plain = _transfer_run(_PlainLinear(), 2 * _TX, strategy, accelerator)
    assert_close64(hooked[0], plain[0])
    assert_close64(torch.tensor(hooked[1:], dtype=torch.float64), torch.tensor(plain[1:], dtype=torch.float64))
    assert not torch.equal(plain[0], torch.nn.utils.parameters_to_vector(_PlainLinear().parameters()))  # trained


# ====================================================================== several evaluation loaders, configure_model
class TwoLoaders(UserNet):
    """Evaluation steps that branch on ``dataloader_idx``, as plain Lightning passes it with several loaders."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log(f"val_loss_{dataloader_idx}", F.cross_entropy(self(x), y), add_dataloader_idx=False)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log(f"test_loss_{dataloader_idx}", F.cross_entropy(self(x), y), add_dataloader_idx=False)


def test_evaluation_steps_get_dataloader_idx_as_in_plain_lightning():
    """With two validation or test loaders the global model's steps get ``dataloader_idx`` 0 and 1, so each loader's
    metric comes out as plain Lightning computes it on the same weights; a step without the argument is refused by
    name, as Lightning refuses it."""
    torch.manual_seed(0)
    model, dm = TwoLoaders(), _dm()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    trainer = make_trainer(1, limit_val_batches=None)
    trainer.fit(loop, datamodule=dm)
    dm.setup("test")
    loaders = [dm.val_dataloader(), dm.test_dataloader()]
    plain = TwoLoaders()
    plain.load_state_dict(model.state_dict())
    pt = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    for run in ("validate", "test"):
        fed = getattr(trainer, run)(loop, dataloaders=loaders, verbose=False)
        ref = getattr(pt, run)(plain, dataloaders=loaders, verbose=False)
        assert fed == ref, run
        key = "val_loss" if run == "validate" else "test_loss"
        assert fed[0][f"{key}_0"] != fed[1][f"{key}_1"]  # each loader's own batches

    class NoIndex(UserNet):
        def validation_step(self, batch, batch_idx):
            return super().validation_step(batch, batch_idx)

    loop = FederatedLoop(NoIndex(), local_steps=2, clients_per_round=3)
    with pytest.raises(RuntimeError, match=r"NoIndex.validation_step\(\), but it has no `dataloader_idx`"):
        make_trainer(1, limit_val_batches=None).validate(loop, dataloaders=loaders, verbose=False)


class _Plain(pl.LightningModule):
    """The digits MLP with a mean cross-entropy and SGD, nothing else."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BuiltInConfigureModel(_Plain):
    """Creates its layers in ``configure_model`` (Lightning's place for them), once per process."""

    def __init__(self):
        super().__init__()
        del self.net
        self.net = None
        self.configured = 0

    def configure_model(self):
        self.configured += 1
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_parameters_created_in_configure_model_train_like_the_same_module_built_eagerly(mode):
    """The parameters exist before the client optimizer is built and checked; the run equals the same layers built in
    ``__init__`` (``precision="64-true"``: ``configure_model`` runs under Lightning's float64 init context, as in
    plain Lightning, so the eager layers are drawn in float64 too); Lightning's ``configure_model`` call of the stage
    does not call the hook a second time."""
    model = BuiltInConfigureModel()
    loop = FederatedLoop(model, local_steps=3, clients_per_round=4, seed=5, client_execution=mode)
    make_trainer(2, callbacks=[FedAvg()], precision="64-true").fit(loop, datamodule=_dm())
    assert model.configured == 1 and model.net[0].weight.dtype == torch.float64
    eager = _Plain()
    torch.manual_seed(0)
    eager.net = nn.Sequential(nn.Linear(64, 16, dtype=torch.float64), nn.ReLU(), nn.Linear(16, 10, dtype=torch.float64))
    loop = FederatedLoop(eager, local_steps=3, clients_per_round=4, seed=5, client_execution=mode)
    make_trainer(2, callbacks=[FedAvg()], precision="64-true").fit(loop, datamodule=_dm())
    for got, want in zip(model.net.parameters(), eager.net.parameters()):
        assert torch.equal(got, want)


@pytest.mark.skipif(not hasattr(pl.callbacks, "WeightAveraging"), reason="Lightning < 2.5 has no WeightAveraging")
def test_weight_averaging_averages_the_global_model_of_every_round_without_a_sharding_warning():
    """Lightning's WeightAveraging (an EMA of the weights after every step) keeps an EMA of the global model after
    every round and puts it into the model when the fit ends; a module without configure_model gets no warning
    about one (the loop overrides configure_model only for a module that does)."""
    import warnings

    from torch.optim.swa_utils import get_ema_avg_fn

    rounds = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rounds.append([p.detach().clone() for p in pl_module.model.parameters()])

    torch.manual_seed(0)
    model = _Plain()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=5)
    averaging = pl.callbacks.WeightAveraging(avg_fn=get_ema_avg_fn(0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(3, callbacks=[FedAvg(), Record(), averaging], precision="64-true")
        trainer.fit(loop, datamodule=_dm())
    assert not [w for w in caught if "configure_model" in str(w.message)]
    ema = rounds[0]
    for weights in rounds[1:]:
        ema = [0.5 * e + 0.5 * w for e, w in zip(ema, weights)]
    assert len(rounds) == 3 and not torch.equal(ema[0], rounds[-1][0])
    for got, want in zip(model.parameters(), ema):  # Lightning's average lives in float32 (built before 64-true)
        torch.testing.assert_close(got, want, rtol=rtol32(3), atol=0)


class FrozenFirstLayer(_Plain):
    """A frozen first layer, with ``configure_optimizers`` handing ``self.parameters()`` over (frozen ones
    included) or one group of the frozen layer with its own settings."""

    def __init__(self, groups=False):
        super().__init__()
        self.net[0].requires_grad_(False)
        self.groups = groups

    def configure_optimizers(self):
        if self.groups:
            return torch.optim.SGD(
                [{"params": self.net[0].parameters(), "lr": 0.0}, {"params": self.net[2].parameters()}], lr=0.1
            )
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)


@pytest.mark.numerics
@pytest.mark.parametrize("groups", [False, True], ids=["self.parameters()", "frozen group"])
def test_a_frozen_layer_in_the_optimizer_trains_vectorized_as_sequentially(groups):
    """torch's optimizers never step a parameter without a gradient, so a frozen layer in the optimizer's groups
    changes nothing: vectorized training accepts it and equals sequential training; the frozen layer stays put."""
    runs = {}
    for mode in ("sequential", "vectorized"):
        torch.manual_seed(0)
        model = to_float64(FrozenFirstLayer(groups))
        frozen = model.net[0].weight.detach().clone()
        loop = FederatedLoop(model, local_steps=3, clients_per_round=4, seed=5, client_execution=mode)
        make_trainer(2, callbacks=[FedAvg()]).fit(loop, datamodule=_dm64())
        assert torch.equal(model.net[0].weight, frozen)
        runs[mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert_close64(runs["vectorized"], runs["sequential"])


# ====================================================================== ReduceLROnPlateau on a validation metric
class OnPlateau(_Plain):
    """The Lightning idiom: ``ReduceLROnPlateau`` monitoring the validation loss (patience 0, so the learning rate
    follows the validation values closely); records the values its scheduler received and the validation losses."""

    def __init__(self, strict=True, monitor="val_loss"):
        super().__init__()
        self.strict, self.monitor = strict, monitor
        self.validated, self.stepped = [], []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            self.validated.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        plateau = _RecordedPlateau(opt, patience=0, factor=0.5, threshold=0.5)
        plateau.record = self.stepped
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "monitor": self.monitor, "strict": self.strict},
        }


class _RecordedPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    record: list = []

    def step(self, metrics, epoch=None):
        self.record.append(float(metrics))
        return super().step(metrics)

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "record"}


def _plateau_fit(model, rounds, every=1, callbacks=(), ckpt_path=None, **kw):
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=6)
    trainer = make_trainer(
        rounds,
        callbacks=list(callbacks),
        limit_val_batches=None,
        val_check_interval=every,
        num_sanity_val_steps=0,
        **kw,
    )
    trainer.fit(loop, datamodule=_dm(), ckpt_path=ckpt_path)
    return trainer


def test_reduce_on_plateau_steps_after_each_rounds_validation_with_its_value():
    """As plain Lightning steps it after the epoch's validation: round r's step gets round r's validation loss, so the
    learning rate of round r + 1 reacts to the validation after round r."""
    torch.manual_seed(0)
    model = OnPlateau()
    rec = _Record()
    _plateau_fit(model, 4, callbacks=[rec])
    assert len(model.validated) == 4 and model.stepped == model.validated
    lrs = [r["client/step_size_mean"] for r in rec.rounds]
    expected, lr, best = [], 0.5, float("inf")  # ReduceLROnPlateau(patience=0, threshold=0.5, rel): by hand
    for value in model.validated:
        expected.append(lr)
        if value < best * (1 - 0.5):
            best = value
        else:
            lr *= 0.5
            best = min(best, value) if best != float("inf") else value
    assert lrs == pytest.approx(expected, rel=1e-6)


def test_reduce_on_plateau_without_a_validation_after_the_round_is_an_error_or_skipped():
    """Validation every 2 rounds: the rounds without one have no value for the monitor; strict names it and what to
    do, strict=False steps after the validated rounds only; a monitor nothing logs is named with the metrics there
    are."""
    torch.manual_seed(0)
    with pytest.raises(
        ValueError, match=r"monitors 'val_loss', which is not among round 0's metrics, and no validation"
    ) as info:
        _plateau_fit(OnPlateau(), 4, every=2)
    # the hint names metrics the round has, not a name the module may not log
    assert "monitor one of the round's metrics such as 'train/loss' (or client/<name>" in str(info.value)
    assert "client/train_loss" not in str(info.value)
    model = OnPlateau(strict=False)
    _plateau_fit(model, 4, every=2)
    assert len(model.validated) == 2 and model.stepped == model.validated
    with pytest.raises(
        ValueError, match=r"monitors 'val_acc', which is neither among round 0's metrics nor .*val_loss"
    ):
        _plateau_fit(OnPlateau(monitor="val_acc"), 2)


def test_reduce_on_plateau_on_validation_resumes_like_the_uninterrupted_run(tmp_path):
    """The checkpoint of round 2 is written again after round 2's validation (a resumed run does not run it again),
    so it holds the scheduler step that validation caused: the resumed run's learning rates and weights are the
    uninterrupted run's."""
    from fedlightning.checkpoint import RoundCheckpoint

    torch.manual_seed(0)
    init = OnPlateau().state_dict()
    full = OnPlateau()
    full.load_state_dict(init)
    rec_full = _Record()
    _plateau_fit(full, 4, callbacks=[rec_full])
    part = OnPlateau()
    part.load_state_dict(init)
    ckpt = RoundCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    _plateau_fit(part, 2, callbacks=[ckpt], enable_checkpointing=True)
    resumed = OnPlateau()
    rec = _Record()
    _plateau_fit(resumed, 4, callbacks=[rec], ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    lrs_full = [r["client/step_size_mean"] for r in rec_full.rounds]
    assert len(set(lrs_full)) > 1  # the scheduler acted
    assert [r["client/step_size_mean"] for r in rec.rounds] == lrs_full[2:]
    for p, q in zip(resumed.parameters(), full.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_a_checkpoint_written_before_the_rounds_validation_warns_of_the_skipped_step(tmp_path):
    """Lightning's own ModelCheckpoint writes the round's file before its validation: the scheduler step waiting for
    that validation is not in it, and a resumed run, which does not run that validation again, says so."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _plateau_fit(OnPlateau(), 2, callbacks=[ckpt], enable_checkpointing=True)
    with pytest.warns(UserWarning, match=r"before the validation after round 1 ended.*not stepped for round 1"):
        _plateau_fit(OnPlateau(), 3, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))


def test_a_step_waiting_after_a_round_no_validation_follows_resumes_without_a_warning(tmp_path):
    """Validation every 2 rounds, ``strict: False``: the file of round 3 holds the step of round 2 (0-based) still
    waiting, and no validation follows round 2 in any run. The resumed run keeps it waiting (the next round's end
    skips it, as in the uninterrupted run) without the warning of a skipped validation, and ends with the
    uninterrupted run's weights."""
    import warnings

    from fedlightning.checkpoint import RoundCheckpoint

    torch.manual_seed(0)
    init = OnPlateau(strict=False).state_dict()
    full = OnPlateau(strict=False)
    full.load_state_dict(init)
    _plateau_fit(full, 4, every=2)
    part = OnPlateau(strict=False)
    part.load_state_dict(init)
    ckpt = RoundCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)
    _plateau_fit(part, 3, every=2, callbacks=[ckpt], enable_checkpointing=True)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["fedlightning"]["module_optimizer"]["waiting"]
    resumed = OnPlateau(strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _plateau_fit(resumed, 4, every=2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert not [w for w in caught if "ReduceLROnPlateau" in str(w.message)]
    assert resumed.validated == full.validated[1:] and resumed.stepped == full.stepped[1:]
    for p, q in zip(resumed.parameters(), full.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


class Predicts(_Plain):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.net(x).argmax(-1)


def test_predict_runs_the_global_models_predict_step_over_the_test_split():
    """``trainer.predict`` (and ``train.py predict``) with a federated data module: the global model's predict_step
    over the test set, in order: the predictions of the model on every test sample."""
    torch.manual_seed(0)
    model, dm = Predicts(), _dm()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    trainer = make_trainer(1)
    trainer.fit(loop, datamodule=dm)
    got = torch.cat(trainer.predict(loop, datamodule=dm))
    dm.setup("test")
    x = torch.stack([dm.test_dataset[i][0] for i in range(len(dm.test_dataset))])
    assert torch.equal(got, model.net(x).argmax(-1))


def test_a_prediction_writer_gets_the_test_indices_of_every_batch():
    """Lightning's ``BasePredictionWriter`` maps predictions to samples through ``batch_indices``: the predict loader
    of an in-memory test set gives them (the evaluation loaders' whole-batch reads give none), in the test set's
    order, each batch's predictions those of its samples."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__(write_interval="epoch")
            self.written = None

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.written = (predictions, batch_indices)

    torch.manual_seed(0)
    model, dm = Predicts(), _dm(eval_batch_size=100)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    make_trainer(1).fit(loop, datamodule=dm)
    writer = Writer()
    make_trainer(1, callbacks=[writer]).predict(loop, datamodule=dm, return_predictions=False)
    predictions, (indices,) = writer.written
    dm.setup("test")
    flat = [i for batch in indices for i in batch]
    assert flat == list(range(len(dm.test_dataset))) and len(indices) > 1
    for batch, rows in zip(predictions, indices):
        x = torch.stack([dm.test_dataset[i][0] for i in rows])
        assert torch.equal(batch, model.net(x).argmax(-1))


def test_a_test_after_fit_in_python_logs_at_the_last_rounds_step_as_the_cli_does(tmp_path):
    """``trainer.test`` after ``trainer.fit`` (the README's Python form of ``train.py fit``) writes its ``test/*``
    row at the fit's last round (step 2 of rounds 0..2), where ``train.py`` writes it, not one step past it; a
    later fit of the same Trainer logs its rounds at their own steps again."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    class Tests(Predicts):
        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test/acc", (self.net(x).argmax(-1) == y).float().mean())

    torch.manual_seed(0)
    model, dm = Tests(), _dm()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3)
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = make_trainer(3, logger=logger)
    trainer.fit(loop, datamodule=dm)
    trainer.test(loop, datamodule=dm)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(loop, datamodule=dm)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steps = {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("train/loss", "test/acc")}
    assert steps == {"train/loss": [0, 1, 2, 3], "test/acc": [2]}


class Staged(pl.LightningModule):
    """A frozen body and a trainable head; ``thaw_in_hook``: unfreezes the body in its own on_train_epoch_start
    from round 1 (the plain-Lightning pattern of gradual unfreezing)."""

    def __init__(self, thaw_in_hook: bool):
        super().__init__()
        self.thaw_in_hook = thaw_in_hook
        self.body, self.head = nn.Linear(64, 8), nn.Linear(8, 10)
        self.body.requires_grad_(False)

    def on_train_epoch_start(self):
        if self.thaw_in_hook and self.current_epoch >= 1:
            self.body.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.body(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Toggle(pl.Callback):
    """Sets ``requires_grad`` of the global model's ``layer`` to ``value`` from round 1 on."""

    def __init__(self, layer: str, value: bool):
        self.layer, self.value = layer, value

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 1:
            getattr(pl_module.model, self.layer).requires_grad_(self.value)


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
@pytest.mark.parametrize(
    "hook,callback,match",
    [
        (True, None, r"in the clients' working copy: body\.weight \(now trainable\), body\.bias \(now trainable\)"),
        (False, ("body", True), r"in the global model: body\.weight \(now trainable\), body\.bias \(now trainable\)"),
        (False, ("head", False), r"in the global model: head\.weight \(now frozen\), head\.bias \(now frozen\)"),
    ],
    ids=["module-hook-thaws", "callback-thaws", "callback-freezes"],
)
def test_requires_grad_changed_during_fit_stops_the_run_naming_the_parameters(execution, hook, callback, match):
    """The trainable parameters are fixed when fit starts: a layer thawed or frozen later, in the module's own hook
    (on the clients' working copy) or by a callback (on the global model), stops the run at that round naming it
    (it crashed inside the round's sums, or dropped the thawed layer's training without a word), with the
    weights of the rounds before it."""
    torch.manual_seed(0)
    model = Staged(thaw_in_hook=hook)
    body_before = model.body.weight.detach().clone()
    callbacks = [Toggle(*callback)] if callback else []
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2, client_execution=execution)
    with pytest.raises(ValueError, match=r"round 1: requires_grad changed during fit " + match):
        make_trainer(3, callbacks=callbacks).fit(loop, datamodule=_dm())
    assert loop.global_step == 1 and torch.equal(model.body.weight, body_before)


class ComplexNet(pl.LightningModule):
    """A complex-valued first layer (magnitudes into a real head), complex128 / float64."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(0.1 * torch.randn(64, 8, dtype=torch.complex128, generator=g))
        self.head = nn.Linear(8, 10, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head((x.to(torch.complex128) @ self.w).abs()), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_complex_parameters_train_under_fedprox_and_their_update_norms_count_the_imaginary_parts():
    """FedProx's penalty on complex parameters is μ/2·Σ|w − w_t|² (real; it made the loss complex and stopped the
    run), and the round's squared update norms are Σ|Δ|² (they dropped the imaginary parts): against a hand
    loop in complex128."""
    from fedlightning.callbacks import ProximalTerm

    mu, K, rounds = 0.5, 2, 2
    torch.manual_seed(0)
    model = ComplexNet()
    start = copy.deepcopy(model.state_dict())
    dm = _dm64()
    loop = FederatedLoop(model, local_steps=K, clients_per_round=3, seed=2)
    trainer = make_trainer(rounds, callbacks=[FedAvg(), ProximalTerm(mu=mu)])
    trainer.fit(loop, datamodule=dm)

    ref = ComplexNet()
    ref.load_state_dict(start)
    for r in range(rounds):
        anchor = [p.detach().clone() for p in ref.parameters()]
        deltas, weights = [], []
        for cid in dm.sample_clients(r):
            client = copy.deepcopy(ref)
            opt = torch.optim.SGD(client.parameters(), lr=0.05)
            batches = iter(dm.client_dataloader(cid, r, seed=2))
            for k in range(K):
                opt.zero_grad()
                penalty = sum(
                    torch.view_as_real(p - a).pow(2).sum() if p.is_complex() else (p - a).pow(2).sum()
                    for p, a in zip(client.parameters(), anchor)
                )
                (client.training_step(next(batches), k) + 0.5 * mu * penalty).backward()
                opt.step()
            deltas.append([a - p.detach() for a, p in zip(anchor, client.parameters())])
            weights.append(float(dm.client_num_samples(cid)))
        with torch.no_grad():
            for j, p in enumerate(ref.parameters()):
                p.sub_(sum(w * d[j] for w, d in zip(weights, deltas)) / sum(weights))
        sq = [sum(float((d.abs() ** 2).sum()) for d in ds) for ds in deltas]
    for p, q in zip(model.parameters(), ref.parameters()):  # real and imaginary parts
        assert_close64(
            torch.view_as_real(p.detach()) if p.is_complex() else p,
            torch.view_as_real(q.detach()) if q.is_complex() else q,
        )
    logged = float(trainer.callback_metrics["server/mean_client_delta_sq_norm"])  # Lightning keeps it in float32
    assert logged == pytest.approx(sum(sq) / len(sq), rel=2**-22)


class CompiledLayers(_Plain):
    """Its layers compiled in configure_model, as torch.compile is applied inside a LightningModule."""

    def configure_model(self):
        self.net = torch.compile(self.net, backend="eager")


def test_a_compiled_module_is_refused_naming_the_way_to_compile_its_layers_which_trains_as_uncompiled():
    """``torch.compile(module)`` is a wrapper whose training_step the clients' working copies cannot use: refused,
    naming torch.compile and what to do instead; layers compiled in configure_model train as the uncompiled module."""
    with pytest.raises(TypeError, match=r"got OptimizedModule \(torch\.compile of UserNet\).*configure_model"):
        FederatedLoop(torch.compile(UserNet(), backend="eager"), local_steps=2, clients_per_round=3)

    def run(cls, mode="sequential"):
        torch.manual_seed(0)
        model = to_float64(cls())
        loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2, client_execution=mode)
        make_trainer(2, callbacks=[FedAvg()]).fit(loop, datamodule=_dm64())
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    plain = run(_Plain)
    assert_close64(run(CompiledLayers), plain)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_close64(run(CompiledLayers, "vectorized"), plain)
    # the batched calls run the compiled layers eagerly: dynamo does not trace into them (no graph-break warnings)
    assert not [str(w.message) for w in seen if "Dynamo" in str(w.message) or "dynamo" in str(w.message)]


def test_a_model_that_cannot_be_deep_copied_is_named_with_the_replacement_of_the_old_weight_norm():
    """torch.nn.utils.weight_norm (hook-based, deprecated) cannot be deep-copied; the error names the working copy
    the clients train and the parametrization that replaces it (it was torch's deepcopy error alone)."""

    class OldWeightNorm(Staged):
        def __init__(self):
            super().__init__(thaw_in_hook=False)
            self.head = torch.nn.utils.weight_norm(nn.Linear(8, 10))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of weight_norm
        model = OldWeightNorm()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2)
    with pytest.raises(RuntimeError, match=r"working copy of OldWeightNorm made with copy\.deepcopy.*"
                       r"use torch\.nn\.utils\.parametrizations\.weight_norm"):  # fmt: skip
        make_trainer(1).fit(loop, datamodule=_dm())


class FitStartToggle(pl.Callback):
    """Sets ``requires_grad`` of the global model's ``layer`` in ``on_fit_start`` (after configure_optimizers)."""

    def __init__(self, layer: str, value: bool):
        self.layer, self.value = layer, value

    def on_fit_start(self, trainer, pl_module):
        getattr(pl_module.model, self.layer).requires_grad_(self.value)


def test_a_layer_frozen_in_on_fit_start_stays_frozen_and_one_thawed_there_is_refused():
    """The trainable parameters are fixed at the first round: a layer frozen in on_fit_start (after Lightning built
    the server optimizer) is not trained, as in plain Lightning; one thawed there is refused by name, since the
    server optimizer built before it does not hold it (its clients' work was dropped without a word)."""
    torch.manual_seed(0)
    model = Staged(thaw_in_hook=False)
    model.body.requires_grad_(True)
    body, head = model.body.weight.detach().clone(), model.head.weight.detach().clone()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2)
    make_trainer(2, callbacks=[FitStartToggle("body", False)]).fit(loop, datamodule=_dm())
    assert torch.equal(model.body.weight, body) and not torch.equal(model.head.weight, head)

    model = Staged(thaw_in_hook=False)  # its body frozen in __init__
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2)
    with pytest.raises(ValueError, match=r"round 0: body\.weight, body\.bias became trainable after the server opt"):
        make_trainer(2, callbacks=[FitStartToggle("body", True)]).fit(loop, datamodule=_dm())


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_unfreezing_in_stages_one_fit_per_stage_with_the_same_loop(execution):
    """Stage 1 trains the head; the body is thawed between the fits; stage 2 (the same loop, a new Trainer) trains
    both: its working copy is rebuilt with the new trainable parameters (it kept the first fit's and stopped)."""
    torch.manual_seed(0)
    model = Staged(thaw_in_hook=False)
    loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2, client_execution=execution)
    make_trainer(2).fit(loop, datamodule=_dm())
    body = model.body.weight.detach().clone()
    model.body.requires_grad_(True)
    make_trainer(2).fit(loop, datamodule=_dm())
    assert not torch.equal(model.body.weight, body)
    assert all(p.requires_grad for p in loop.client_worker.params) and len(loop.client_worker.params) == 4


class ComplexOnly(pl.LightningModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(0.1 * torch.randn(64, 10, dtype=torch.complex128, generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy((x.to(torch.complex128) @ self.w).abs(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_model_of_complex_parameters_only_is_refused_vectorized_and_auto_trains_it_sequentially():
    """It crashed in the engine's finiteness check (no max of complex values), auto included."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    with pytest.raises(VectorizationUnsupportedError, match=r"trains real parameters; w is torch\.complex128"):
        make_trainer(1).fit(FederatedLoop(ComplexOnly(), local_steps=2, clients_per_round=3, seed=2,
                                          client_execution="vectorized"), datamodule=_dm64())  # fmt: skip
    weights = {}
    for mode in ("sequential", "auto"):
        model = ComplexOnly()
        loop = FederatedLoop(model, local_steps=2, clients_per_round=3, seed=2, client_execution=mode)
        make_trainer(2).fit(loop, datamodule=_dm64())
        weights[mode] = model.w.detach()
    assert torch.equal(weights["auto"], weights["sequential"])


# ====================================================================== hooks on the backward pass
def _zero_grad(param):
    param.grad.zero_()


class _Hooked(pl.LightningModule):
    """An MLP with a hook on its backward pass registered in ``__init__``: ``"freeze"`` zeroes the first layer's
    weight gradient (``Tensor.register_hook``), ``"after"`` zeroes it after accumulation
    (``register_post_accumulate_grad_hook``), ``"module"`` halves the gradient into the last layer's input
    (``register_full_backward_hook``)."""

    def __init__(self, hook=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))
        weight = self.net[0].weight
        if hook == "freeze":
            weight.register_hook(torch.zeros_like)
        elif hook == "after":
            weight.register_post_accumulate_grad_hook(_zero_grad)
        elif hook == "module":
            self.net[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _hooked_fit(hook, mode="sequential"):
    torch.manual_seed(0)
    model = _Hooked(hook)
    loop = FederatedLoop(model, local_steps=3, clients_per_round=3, seed=2, client_execution=mode)
    make_trainer(2).fit(loop, datamodule=_dm())
    return model, loop


@pytest.mark.parametrize("hook", ["freeze", "after"])
def test_a_parameters_gradient_hook_reaches_the_clients(hook):
    """The clients train a deep copy of the module, and ``copy.deepcopy`` drops a parameter's hooks: a hook that
    zeroes the first layer's gradient was ignored and the layer trained. Now the copy has the hook: that weight is
    exactly its initial value after two rounds, while the other parameters train as without the hook's layer."""
    torch.manual_seed(0)
    start = _Hooked(hook).net[0].weight.detach().clone()
    model, _ = _hooked_fit(hook)
    assert torch.equal(model.net[0].weight.detach(), start)
    assert not torch.equal(model.net[0].bias.detach(), _Hooked(None).net[0].bias.detach())
    free, _ = _hooked_fit(None)
    assert not torch.equal(free.net[0].weight.detach(), start)


@pytest.mark.parametrize("hook", ["freeze", "after", "module"])
def test_vectorized_refuses_hooks_on_the_backward_pass_and_auto_trains_sequentially(hook):
    """The vectorized engine's batched gradients call no backward hook, so its clients trained as if the hook were
    not there (the hook-free weights, bit for bit); it now refuses by name, and "auto" trains sequentially, to
    sequential training's weights."""
    from fedlightning.vectorized import VectorizationUnsupportedError

    where = "a backward hook on 'net.2' (Linear)" if hook == "module" else "a gradient hook on parameter 'net.0.weight'"
    with pytest.raises(VectorizationUnsupportedError, match=re.escape(f"cannot run {where}: the clients' gradients")):
        _hooked_fit(hook, "vectorized")
    with pytest.warns(UserWarning, match="training clients sequentially"):
        auto, loop = _hooked_fit(hook, "auto")
    sequential, _ = _hooked_fit(hook)
    assert loop.client_execution_choice == "sequential"
    for p, q in zip(auto.parameters(), sequential.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
