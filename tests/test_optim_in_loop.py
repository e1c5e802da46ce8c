"""The adaptive optimizers inside the FederatedLoop: dropout masks and BatchNorm statistics of trial evaluations,
per-client state across rounds and through a checkpoint, per-client epoch length, telemetry logging, NaN policy."""

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.datamodules import IID, DigitsDataModule
from fedlightning.models import MLP
from fedlightning.models.base import Classifier
from fedlightning.optim import SPS, DecSPS, SgdArmijo
from numerics import rtol32
from registry import CLIENT_OPTIMIZERS, params


def digits(num_clients=6, batch_size=16):
    return DigitsDataModule(num_clients=num_clients, batch_size=batch_size, partition=IID(), seed=0)


class UpdateRecorder(Callback):
    """A callback that keeps every client update (on_client_end hook) by round."""

    def __init__(self):
        super().__init__()
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append((plan.round, update))


class ProbeNet(Classifier):
    """Linear - BatchNorm - explicit dropout mask - Linear. Every training_step call records whether gradients were
    enabled, the dropout mask it drew and the BatchNorm statistics it found at entry (class-level list: the loop's
    working copy is a deep copy of the model)."""

    records: list = []

    def __init__(self):
        super().__init__(num_classes=10)
        self.fc1, self.bn, self.fc2 = nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        self._mask = (torch.rand_like(h) > 0.5).to(h.dtype) if self.training else torch.ones_like(h)
        return self.fc2(h * self._mask * 2.0)

    def training_step(self, batch, batch_idx):
        entry = (
            torch.is_grad_enabled(),
            batch_idx,
            self.bn.running_mean.detach().clone(),
            int(self.bn.num_batches_tracked),
        )
        loss = super().training_step(batch, batch_idx)
        ProbeNet.records.append(entry + (self._mask.detach().clone(),))
        return loss


@pytest.fixture(scope="module")
def probe_run():
    ProbeNet.records = []
    torch.manual_seed(0)
    loop = FederatedLoop(
        ProbeNet(),
        client_optimizer=lambda p: SgdArmijo(p, eta_max=5.0, c=0.1, beta=0.5),
        local_steps=4,
        clients_per_round=2,
        seed=0,
    )
    make_trainer(2).fit(loop, datamodule=digits())
    steps = []  # [(gradient record, [trial records])]
    for rec in ProbeNet.records:
        if rec[0]:
            steps.append((rec, []))
        else:
            steps[-1][1].append(rec)
    return steps


def test_trials_see_the_gradient_evaluation_dropout_mask(probe_run):
    assert len(probe_run) == 2 * 2 * 4  # rounds x clients x local steps
    trials = sum(len(t) for _, t in probe_run)
    assert trials > len(probe_run)  # η_max = 5 forces backtracking: several trials per step
    for grad_rec, trial_recs in probe_run:
        assert trial_recs, "every step evaluates at least one trial point"
        for rec in trial_recs:
            assert torch.equal(rec[4], grad_rec[4])
    distinct = {tuple(g[4].flatten().tolist()) for g, _ in probe_run}
    assert len(distinct) == len(probe_run)  # masks do change from step to step (the check is not vacuous)


def test_trials_do_not_update_batchnorm_statistics(probe_run):
    # each client starts from the global counter, the clients' mean count after each round (K = 4 steps each)
    assert [g[3] for g, _ in probe_run if g[1] == 0] == [0, 0, 4, 4]
    for i, (grad_rec, trial_recs) in enumerate(probe_run):
        k = grad_rec[1]
        start = 0 if i < 2 * 4 else 4  # round 0's two clients, then round 1's
        assert grad_rec[3] == start + k  # only gradient forwards count
        for rec in trial_recs:
            assert rec[3] == start + k + 1  # after the gradient forward only
            torch.testing.assert_close(rec[2], trial_recs[0][2], rtol=0, atol=0)
    # the trial-entry statistics are those the next gradient evaluation of the same client finds
    for (g, trials), (g_next, _) in zip(probe_run, probe_run[1:]):
        if g_next[1] == g[1] + 1:
            torch.testing.assert_close(trials[-1][2], g_next[2], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- per-client state
def decsps_fit(rounds, ckpt_path=None, persist=True, recorder=None):
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[16]),
        client_optimizer=lambda p: DecSPS(p, c0=0.5, gamma_max=1.0),
        local_steps=3,
        clients_per_round=2,
        seed=1,
        persist_client_state=persist,
    )
    trainer = make_trainer(rounds, callbacks=[recorder] if recorder else None)
    dm = digits(num_clients=4)
    trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return loop, trainer, dm


def test_decsps_state_persists_across_rounds():
    rec = UpdateRecorder()
    loop, _, dm = decsps_fit(4, recorder=rec)
    participation = {}
    for r in range(4):
        for cid in dm.sample_clients(r):
            participation[cid] = participation.get(cid, 0) + 1
    assert sorted(loop.client_state.clients("optimizer")) == sorted(participation)  # nothing for absent clients
    assert max(participation.values()) >= 2  # some client trained in several rounds
    for cid, times in participation.items():
        state = loop.client_state.get("optimizer", cid)
        assert state["t"] == 3 * times
        steps = [s for _, u in rec.updates if u.client_id == cid for s in u.step_sizes]
        assert state["gamma_prev"] == pytest.approx(steps[-1])
        # one DecSPS recursion over all of the client's rounds: γ_t <= γ_{t-1}·sqrt(t/(t+1)) and γ_t <= γ_b/sqrt(t+1)
        for t in range(1, len(steps)):
            assert steps[t] <= steps[t - 1] * math.sqrt(t / (t + 1)) * (1 + 1e-9)
        assert all(s <= 1.0 / math.sqrt(t + 1) * (1 + 1e-9) for t, s in enumerate(steps))


def test_without_persistence_each_round_restarts_the_recursion():
    rec = UpdateRecorder()
    loop, _, dm = decsps_fit(4, persist=False, recorder=rec)
    assert len(loop.client_state) == 0
    restarted = False
    for cid in {u.client_id for _, u in rec.updates}:
        rounds = [u.step_sizes for _, u in rec.updates if u.client_id == cid]
        for earlier, later in zip(rounds, rounds[1:]):
            restarted |= later[0] > earlier[-1]  # γ_0 again, not bounded by the previous round's recursion
    assert restarted


def test_client_state_round_trips_through_a_checkpoint(tmp_path):
    full, _, _ = decsps_fit(4)
    first, trainer, _ = decsps_fit(2)
    path = str(tmp_path / "two_rounds.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["fedlightning"]["client_state"]["optimizer"]
    assert saved.keys() == set(first.client_state.clients("optimizer"))
    for cid, state in saved.items():
        assert state == first.client_state.get("optimizer", cid)
    resumed, _, _ = decsps_fit(4, ckpt_path=path)
    assert resumed.client_state.clients("optimizer") == full.client_state.clients("optimizer")
    for cid in full.client_state.clients("optimizer"):
        a, b = full.client_state.get("optimizer", cid), resumed.client_state.get("optimizer", cid)
        assert a["t"] == b["t"] and a["gamma_prev"] == b["gamma_prev"]  # the same computation: bit for bit
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- telemetry + b/n
def test_loop_logs_step_sizes_and_backtracks_and_sets_client_epoch_length():
    rec = UpdateRecorder()
    built = []

    def factory(params):
        opt = SgdArmijo(params, eta_max=4.0, c=0.1, beta=0.7, reset="grow", delta=2.0)  # no b/n given here
        built.append(opt)
        return opt

    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[16]), client_optimizer=factory, local_steps=5, clients_per_round=3, seed=2
    )
    trainer = make_trainer(2, callbacks=[rec])
    dm = digits(num_clients=5, batch_size=20)
    trainer.fit(loop, datamodule=dm)
    # the loop gave every client optimizer that client's epoch length ⌈n_i/b⌉
    built = [o for o in built if o.total_steps > 0]  # the loop also builds one at setup to validate it; it never steps
    assert len(built) == len(rec.updates) == 6
    for opt, (_, u) in zip(built, rec.updates):
        # growth delta per local epoch of ⌈n_i/b⌉ steps (the loader keeps the last partial batch)
        assert opt._client_exponent == pytest.approx(1 / math.ceil(dm.client_num_samples(u.client_id) / 20))
        assert u.forwards == u.num_steps + sum(1 for s in u.step_sizes if s > 0) + u.backtracks
        assert u.backwards == u.num_steps
    last = [u for r, u in rec.updates if r == 1]
    m = trainer.callback_metrics  # float32 values: one rounding of the loop's float64 statistics (numerics.rtol32)
    assert float(m["client/backtracks_per_step"]) == pytest.approx(
        sum(u.backtracks / u.num_steps for u in last) / 3, rel=rtol32(1)
    )
    sizes = [s for u in last for s in u.step_sizes]
    assert float(m["client/step_size_mean"]) == pytest.approx(sum(sizes) / len(sizes), rel=rtol32(1))
    assert float(m["client/step_size_max"]) == pytest.approx(max(sizes), rel=rtol32(1))
    assert float(m["client/step_size_min"]) == pytest.approx(min(sizes), rel=rtol32(1))
    assert float(m["client/forwards"]) == sum(u.forwards for u in last)
    # the model's own training_step logs are averaged over gradient evaluations only, not over trial points: a
    # float32 mean of the 3 x 5 float32 batch losses against the mean of the 3 clients' float32 means of 5
    assert float(m["client/train/batch_loss"]) == pytest.approx(sum(u.mean_loss for u in last) / 3, rel=rtol32(15 + 5))
    assert sum(u.backtracks for u in last) > 0  # the metric is not trivially zero


def test_smoothed_sps_in_loop_uses_client_epoch_length():
    built = []

    def factory(params):
        built.append(SPS(params, smooth=True))
        return built[-1]

    rec = UpdateRecorder()
    loop = FederatedLoop(MLP(input_dim=64, hidden=[16]), client_optimizer=factory, local_steps=4, clients_per_round=2)
    dm = digits(num_clients=4, batch_size=25)
    make_trainer(1, callbacks=[rec]).fit(loop, datamodule=dm)
    built = [o for o in built if o.total_steps > 0]  # without the never-stepped one built at setup to validate it
    assert len(built) == len(rec.updates)
    for _, u in rec.updates:
        growth = 2.0 ** (25 / dm.client_num_samples(u.client_id))
        for prev, nxt in zip(u.step_sizes, u.step_sizes[1:]):
            assert nxt <= growth * prev * (1 + 1e-9)  # the smoothed cap with this client's b/n_i
        assert loop.client_state.get("optimizer", u.client_id) == {"prev_step": pytest.approx(u.step_sizes[-1])}


class NaNLoss(Classifier):
    def __init__(self):
        super().__init__(num_classes=10)
        self.net = nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


@pytest.mark.parametrize("make", params(CLIENT_OPTIMIZERS, "armijo-default", "sps-default", "decsps-default"))
def test_non_finite_loss_skips_the_client_and_keeps_the_model(make):
    torch.manual_seed(0)
    model = NaNLoss()
    before = [p.detach().clone() for p in model.parameters()]
    loop = FederatedLoop(model, client_optimizer=make, local_steps=3, clients_per_round=2)
    rec = UpdateRecorder()
    with pytest.warns(UserWarning, match="skipped"), pytest.raises(FloatingPointError, match="no round of this run"):
        make_trainer(1, callbacks=[rec]).fit(loop, datamodule=digits(num_clients=3))  # its only round had none healthy
    assert [u.failed for _, u in rec.updates] == [True, True]
    assert all(u.num_steps == 1 and math.isnan(u.step_sizes[0]) for _, u in rec.updates)  # stopped at once
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert len(loop.client_state) == 0  # a failed client's state is not stored
