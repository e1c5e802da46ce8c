"""``FederatedLoop(local_epochs=E)``: each client takes ``⌈E · B_i⌉`` local steps, ``B_i`` the batches of one epoch
of its loader, in every mode.

Checked against independent computations: the rounding rule on hand-worked cases; a whole number of epochs is
``E`` complete passes over each client's data (every sample seen exactly ``E`` times); a sequential run equals a
hand-written float64 FedAvg loop that iterates each client's loader epoch by epoch; vectorised clients with ragged
step counts equal sequential ones for every batched client optimizer (SGD, momentum, Adam, SgdArmijo, SPS,
DecSPS); bad values, ``KDecay``'s step schedules and a callback that edits the wrong field are refused by name.
"""

import copy
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, KDecay
from fedlightning.datamodules import Dirichlet
from fedlightning.datamodules.base import epoch_steps
from numerics import Digits64, assert_close64, to_float64
from registry import CLIENT_OPTIMIZERS, params
from test_vectorized import Recorder, assert_same_run, mlp

CPR, SEED, BATCH = 5, 3, 16


def _dm(drop_last=False, batch_size=BATCH):
    dm = Digits64(num_clients=30, batch_size=batch_size, partition=Dirichlet(0.3), seed=0)
    dm.drop_last = drop_last
    return dm


def _fit(mode="sequential", optimizer="sgd", rounds=2, callbacks=(), dm=None, model=None, **loop_kw):
    model = to_float64(copy.deepcopy(model if model is not None else mlp()))
    loop_kw.setdefault("local_epochs", 1.5)
    rec = Recorder()
    optimizer = CLIENT_OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    loop = FederatedLoop(
        model, client_optimizer=optimizer, clients_per_round=CPR, seed=SEED, client_execution=mode, **loop_kw
    )
    trainer = make_trainer(rounds, callbacks=[FedAvg(), rec, *callbacks])
    trainer.fit(loop, datamodule=dm if dm is not None else _dm())
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return w, loop, rec.updates, trainer


@pytest.mark.parametrize(
    "epochs,batches,steps",
    [
        (1, 7, 7),
        (2, 7, 14),
        (0.5, 7, 4),
        (0.5, 8, 4),
        (1.5, 3, 5),
        (0.1, 30, 3),
        (0.3, 10, 3),
        (0.01, 5, 1),
        (2.5, 1, 3),
    ],
)
def test_epoch_steps_rounds_up_the_decimal_the_user_wrote(epochs, batches, steps):
    assert epoch_steps(epochs, batches) == steps


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_per_epoch_is_what_one_pass_over_the_client_loader_yields(drop_last):
    dm = _dm(drop_last=drop_last)
    dm.setup("fit")
    dm.configure_rounds(CPR, 1, SEED)
    sizes = [dm.client_num_samples(c) for c in range(dm.num_clients)]
    assert min(sizes) < BATCH < max(sizes) and any(n % BATCH for n in sizes)  # the edge cases are exercised
    for cid in range(dm.num_clients):
        assert dm.client_batches_per_epoch(cid) == len(list(dm.client_dataloader(cid, 0, seed=SEED)))


def test_whole_epochs_see_every_sample_exactly_e_times():
    w, loop, updates, _ = _fit(local_epochs=2, rounds=1)
    dm = loop.datamodule
    for u in updates:
        n = dm.client_num_samples(u.client_id)
        assert u.num_steps == 2 * math.ceil(n / BATCH)
        # the same number of batches drawn from the client's loader, cycling as client training does
        loader = dm.client_dataloader(u.client_id, 0, seed=SEED)
        seen, it = [], iter(loader)
        while len(seen) < u.num_steps:
            try:
                seen.append(next(it)[1])
            except StopIteration:
                it = iter(loader)
        rows = torch.cat(seen)
        assert len(rows) == 2 * n


def _epoch_reference(net, dm, rounds, epochs, lr):
    """FedAvg (sample-weighted) of plain-SGD clients that run ``epochs`` (an integer) full passes over their loader."""
    dm.setup("fit")
    dm.configure_rounds(CPR, 1, SEED)
    glob = copy.deepcopy(net)
    for r in range(rounds):
        sums, total = [torch.zeros_like(p) for p in glob.parameters()], 0.0
        for cid in dm.sample_clients(r):
            local = copy.deepcopy(glob)
            loader = dm.client_dataloader(cid, r, seed=SEED)
            for _ in range(epochs):
                for x, y in loader:
                    loss = F.cross_entropy(local(x), y)
                    grads = torch.autograd.grad(loss, list(local.parameters()))
                    with torch.no_grad():
                        for p, g in zip(local.parameters(), grads):
                            p -= lr * g
            n = float(dm.client_num_samples(cid))
            for s, g, p in zip(sums, glob.parameters(), local.parameters()):
                s += n * (g.detach() - p.detach())
            total += n
        with torch.no_grad():
            for g, s in zip(glob.parameters(), sums):
                g -= s / total
    return torch.cat([p.detach().reshape(-1) for p in glob.parameters()])


class _Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_an_epoch_run_equals_a_hand_written_epoch_loop(mode):
    torch.manual_seed(0)
    net = to_float64(_Net())
    expected = _epoch_reference(net.net, _dm(), rounds=2, epochs=2, lr=0.3)
    w, loop, updates, _ = _fit(mode, model=net, local_epochs=2)
    assert len({u.num_steps for u in updates}) > 1  # ragged: clients of different sizes
    assert_close64(w, expected)


@pytest.mark.parametrize(
    "optimizer", params(CLIENT_OPTIMIZERS, "sgd", "sgd-momentum", "adam", "armijo", "sps", "decsps")
)
def test_vectorized_ragged_epochs_equal_sequential(optimizer):
    seq = _fit("sequential", optimizer)
    vec = _fit("vectorized", optimizer)
    dm = seq[1].datamodule
    steps = [u.num_steps for u in seq[2]]
    assert steps == [epoch_steps(1.5, dm.client_batches_per_epoch(u.client_id)) for u in seq[2]]
    assert len(set(steps)) > 1
    assert_same_run(seq, vec)


def test_drop_last_counts_full_batches_only():
    _, loop, updates, trainer = _fit(local_epochs=1, dm=_dm(drop_last=True), rounds=1)
    dm = loop.datamodule
    for u in updates:
        n = dm.client_num_samples(u.client_id)
        assert u.num_steps == (n // BATCH if n >= BATCH else 1)
    mean = np.mean([u.num_steps for u in updates])
    assert float(trainer.callback_metrics["round/local_steps"]) == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"local_epochs": 0}, "local_epochs"),
        ({"local_epochs": -1.0}, "local_epochs"),
        ({"local_epochs": float("nan")}, "local_epochs"),
        ({"local_epochs": 1, "local_steps": 5}, "local_steps=5 and local_epochs=1"),
    ],
)
def test_bad_local_epochs_are_refused_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FederatedLoop(mlp(), client_optimizer=CLIENT_OPTIMIZERS["sgd"], **kwargs)


def test_default_is_twenty_local_steps():
    loop = FederatedLoop(mlp(), client_optimizer=CLIENT_OPTIMIZERS["sgd"])
    assert (loop.local_steps, loop.local_epochs) == (20, None)


def test_kdecay_step_schedules_are_refused_and_client_lr_decay_keeps_the_epochs():
    with pytest.raises(ValueError, match="KDecay\\(decay='local_steps'\\).*local_epochs=1.5"):
        _fit(callbacks=[KDecay(schedule="rounds")], rounds=1)
    _, loop, updates, _ = _fit(callbacks=[KDecay(schedule="rounds", decay="client_lr")], rounds=2)
    dm = loop.datamodule
    assert [u.num_steps for u in updates] == [
        epoch_steps(1.5, dm.client_batches_per_epoch(u.client_id)) for u in updates
    ]
    # η-decay: round r+1's client step is lr / sqrt(r+1) (KDecay's rounds_lr_scale)
    lr = CLIENT_OPTIMIZERS["sgd"].settings["lr"]
    assert [u.step_sizes[0] for u in updates[CPR:]] == [pytest.approx(lr / math.sqrt(2), rel=1e-12)] * CPR


class _EditSteps(pl.Callback):
    def __init__(self, field):
        self.field = field

    def on_round_start(self, trainer, loop, plan):
        if self.field == "local_steps":
            plan.local_steps = 2
        else:
            plan.client_steps = {c: 1 + i for i, c in enumerate(plan.client_ids)}


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_callback_sets_each_clients_steps_through_client_steps(mode):
    _, _, updates, trainer = _fit(mode, callbacks=[_EditSteps("client_steps")], rounds=1)
    assert [u.num_steps for u in updates] == list(range(1, CPR + 1))
    assert float(trainer.callback_metrics["round/local_steps"]) == pytest.approx(3.0)


def test_a_callback_that_sets_local_steps_under_local_epochs_is_refused_by_name():
    with pytest.raises(ValueError, match=r"on_round_start \(_EditSteps\) set plan.local_steps=2.*local_epochs=1.5"):
        _fit(callbacks=[_EditSteps("local_steps")], rounds=1)
