"""A client whose full gradient at the global weights is NaN/inf (the gradient phase of Mime, MimeLite and FedDANE)
is left out of the shared statistic (Mime's ``c``, FedDANE's ``g_t``) instead of making every client's steps NaN:
the runs equal the papers' algorithms written out with plain tensors over the healthy clients, and
``on_client_failure="raise"`` stops the run naming the client and round. The gradient phase shows ``training_step``
the round's ``global_step``, as the local steps after it do."""

import pytest
import torch

from fedlightning.callbacks import FedDANE, Mime, MimeLite
from fedlightning.models import LogisticRegression
from numerics import assert_close64, to_float64
from test_feddane_scaffold import SEED as DANE_SEED
from test_feddane_scaffold import reference_feddane
from test_feddane_scaffold import run as run_dane
from test_mime import BETA, CPR, SEED, K, make_dm, reference_mime, weights
from test_mime import run as run_mime
from test_strategies import Recorder


class NaNOnRows(LogisticRegression):
    """Every loss of a batch that holds one of the rows ``bad`` is NaN (the rows of a faulty client)."""

    def __init__(self, bad, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def _poison(self, x):
        hit = (x.unsqueeze(-2) == self.bad).all(-1).any(-1)  # per row of x
        return torch.where(hit, float("nan"), 1.0)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self._poison(batch[0]).prod()

    def training_step_per_sample(self, batch, batch_idx):
        return super().training_step_per_sample(batch, batch_idx) * self._poison(batch[0])


def faulty_model(faulty):
    dm = make_dm()
    dm.setup("fit")
    rows = torch.cat([dm.train_dataset.x[torch.as_tensor(dm.client_indices[k])] for k in faulty])
    torch.manual_seed(1)  # make_model's initial values
    return to_float64(NaNOnRows(rows, input_dim=64, num_classes=10))


def round_samples(rounds=3):
    dm = make_dm()
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    return [dm.sample_clients(r) for r in range(rounds)]


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
@pytest.mark.parametrize("strategy", [Mime, MimeLite])
def test_a_client_with_a_nan_full_gradient_is_left_out_of_mimes_c(strategy, execution):
    faulty = {round_samples()[0][0]}  # sampled in round 0 with three healthy clients
    s, rec = strategy(momentum=BETA), Recorder()
    with pytest.warns(UserWarning, match=rf"round 0: client {min(faulty)}'s full gradient .* NaN/inf; it is left out"):
        loop, _ = run_mime([s, rec], model=faulty_model(faulty), execution=execution)
    ref_x, ref_m = reference_mime(correction=strategy is Mime, faulty=faulty)
    assert_close64(weights(loop), ref_x)
    assert_close64(s.server_momentum, ref_m)
    assert torch.isfinite(s.server_momentum).all() and float(ref_m.norm()) > 0
    samples = round_samples()
    assert [m["mime/gradient_clients"] for m in rec.metrics] == [float(len(set(c) - faulty)) for c in samples]
    assert [m["round/failed_clients"] for m in rec.metrics] == [float(len(set(c) & faulty)) for c in samples]


def test_a_nan_full_gradient_stops_a_mime_run_under_on_client_failure_raise():
    k = round_samples()[0][1]
    with pytest.raises(FloatingPointError, match=rf"client {k} failed in round 0: the full gradient .* NaN/inf"):
        run_mime([Mime(momentum=BETA)], model=faulty_model({k}), on_client_failure="raise")


def test_a_round_without_a_finite_full_gradient_leaves_mimelites_momentum_unchanged():
    """Every client of round 1 is faulty (round 0 has healthy ones): MimeLite's momentum after round 1 is its value
    after round 0."""
    samples = round_samples()
    faulty = set(samples[1])
    assert set(samples[0]) - faulty
    seen = []

    class Momentum(Recorder):
        def on_round_end(self, trainer, loop, result):
            seen.append(None if s.server_momentum is None else s.server_momentum.clone())

    s = MimeLite(momentum=BETA)
    with pytest.warns(UserWarning, match="round 1: no healthy client"):
        run_mime([s, Momentum()], rounds=2, model=faulty_model(faulty))
    assert torch.isfinite(seen[0]).all() and float(seen[0].norm()) > 0
    assert torch.equal(seen[1], seen[0])


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
def test_a_client_with_a_nan_full_gradient_is_left_out_of_feddanes_global_gradient(execution):
    """One faulty client of ``S_t`` only (its gradient would enter g_t) and one of the round's sample too."""
    _, grad_sets = reference_feddane(mu=0.1, mode="independent")
    samples = round_samples()
    only_gradient = next(k for k in grad_sets[0] if all(k not in c for c in samples))
    trained = samples[0][0]
    faulty = {only_gradient, trained}
    rec = Recorder()
    with pytest.warns(UserWarning, match=rf"round 0: client {only_gradient}'s full gradient .* left out of FedDANE"):
        loop, _ = run_dane(
            [FedDANE(mu=0.1, gradient_clients="independent"), rec], model=faulty_model(faulty), execution=execution
        )
    ref, _ = reference_feddane(mu=0.1, mode="independent", faulty=faulty)
    for got, want in zip(loop.model.net.parameters(), ref):
        assert_close64(got.detach(), want)
    assert [m["feddane/gradient_clients"] for m in rec.metrics] == [float(len(set(g) - faulty)) for g in grad_sets]
    assert [m["round/failed_clients"] for m in rec.metrics] == [float(len(set(c) & faulty)) for c in samples]
    assert DANE_SEED == SEED


def test_a_nan_full_gradient_stops_a_feddane_run_under_on_client_failure_raise():
    _, grad_sets = reference_feddane(mu=0.1, mode="same")
    k = grad_sets[0][2]
    with pytest.raises(FloatingPointError, match=rf"client {k} failed in round 0: the full gradient .*FedDANE"):
        run_dane([FedDANE(mu=0.1, gradient_clients="same")], model=faulty_model({k}), on_client_failure="raise")


class RecordsSteps(LogisticRegression):
    """Records ``(self.global_step, self.current_epoch, trainer.global_step)`` at every ``training_step`` in the
    class's list (the client working copy is a deep copy of the module)."""

    seen: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, self.current_epoch, self.trainer.global_step))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("execution", ["sequential", "vectorized"])
@pytest.mark.parametrize("strategy", [lambda: FedDANE(mu=0.1), lambda: Mime(momentum=BETA)], ids=["FedDANE", "Mime"])
def test_the_gradient_phase_shows_training_step_the_rounds_global_step(strategy, execution):
    torch.manual_seed(1)
    model = to_float64(RecordsSteps(input_dim=64, num_classes=10))
    seen = RecordsSteps.seen
    seen.clear()
    run_mime([strategy()], model=model, execution=execution)
    assert {s[2] for s in seen} == {0, 1, 2}  # every round's full gradients and local steps were recorded
    assert all(step == epoch == round for step, epoch, round in seen), sorted(set(seen))
