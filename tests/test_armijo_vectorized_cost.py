"""The vectorized SgdArmijo search evaluates no more than lockstep needs: pass counts of its trial calls.

On f = ½a‖w‖² the Armijo test f(w − ηg) ≤ f(w) − cη‖g‖² reduces to η ≤ 2(1 − c)/a, independent of w, so with
η_max = 1, β = 1/2, c = 0.1 and ``reset="max"`` client a accepts the same grid point m at every step (the smallest m
with 2^-m ≤ 1.8/a), or, when even the last grid point 2^-max_backtracks fails, exhausts the grid at every step (the
weights do not move). Counted per local step (calls and rows of ``_StepEvaluator.trial``):

* models without random layers: no step makes more trial calls than its longest search has trials; from the second
  step on, one call whose rows are exactly the clients' trials (each client's first window ends at the point it
  accepted at the previous step; the exhausted client gets the whole grid);
* models with random layers (one grid point per client and call, every client in order so that the replayed
  generator gives each row its gradient evaluation's dropout masks): the calls of a step are exactly the longest
  search's trials.
"""

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

import fedlightning.vectorized.call as call
import fedlightning.vectorized.step as step_module
from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import ArrayDataset, FederatedDataModule
from fedlightning.optim import SgdArmijo
from fedlightning.vectorized.rules import _BatchedArmijo

CURVATURES = [0.5, 3.0, 10.0, 50.0, 1000.0]
SIZES = [3, 5, 4, 6, 4]  # unequal counts, some below the batch size 4: padded steps
MAX_BACKTRACKS = 6
GRID = MAX_BACKTRACKS + 1
TRIALS = [1, 2, 4, 6, GRID]  # accepted m + 1 (1.8/a = 3.6, 0.6, 0.18, 0.036); a = 1000 exhausts 2^-6 > 1.8e-3
STEPS = 4


class Quadratic(pl.LightningModule):
    """f(w; batch) = mean over the batch of ½·a·‖w‖², every sample of a client carrying its curvature a."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(1.0, 2.0, 3, dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        a, _ = batch
        return (0.5 * a * (self.w**2).sum()).mean()


class CurvatureClients(FederatedDataModule):
    """Client i holds SIZES[i] samples of curvature CURVATURES[i] (a natural split)."""

    def __init__(self):
        super().__init__(num_clients=len(CURVATURES), batch_size=4)

    def load(self):
        a = torch.cat([torch.full((n,), c, dtype=torch.float64) for c, n in zip(CURVATURES, SIZES)])
        data = ArrayDataset(a, torch.zeros(len(a), dtype=torch.long))
        return data, data, np.zeros(len(a), dtype=np.int64)

    def natural_clients(self):
        ends = np.cumsum(SIZES)
        return [np.arange(e - n, e) for e, n in zip(ends, SIZES)]


class Recorder(pl.Callback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, trainer, loop, plan, update):
        self.updates.append(update)


def run_counting(monkeypatch):
    """One vectorized round of STEPS steps; per step the list of trial calls, each a list of its rows' clients."""
    steps = []
    local_step, trial = _BatchedArmijo.step, step_module._StepEvaluator.trial

    def counting_step(self, *args, **kwargs):
        steps.append([])
        return local_step(self, *args, **kwargs)

    def counting_trial(self, points, clients=None, line=None):
        rows = list(range(points.shape[0])) if clients is None else clients.tolist()
        steps[-1].append(rows)
        return trial(self, points, clients, line)

    monkeypatch.setattr(_BatchedArmijo, "step", counting_step)
    monkeypatch.setattr(step_module._StepEvaluator, "trial", counting_trial)
    recorder = Recorder()
    loop = FederatedLoop(
        Quadratic(),
        client_optimizer=lambda p: SgdArmijo(p, eta_max=1.0, beta=0.5, c=0.1, max_backtracks=MAX_BACKTRACKS),
        local_steps=STEPS,
        clients_per_round=len(CURVATURES),
        seed=0,
        client_execution="vectorized",
    )
    make_trainer(1, callbacks=[FedAvg(), recorder]).fit(loop, datamodule=CurvatureClients())
    order = [u.client_id for u in recorder.updates]  # the round's clients, in the order of the batched rows
    for u in recorder.updates:  # the analytic telemetry
        trials = TRIALS[u.client_id]
        exhausted = trials == GRID
        assert u.backtracks == STEPS * (trials if exhausted else trials - 1)
        assert u.forwards == STEPS * (1 + trials) and u.backwards == STEPS
    return steps, [TRIALS[c] for c in order]


def test_windowed_search_evaluates_each_client_trials_once_the_window_is_known(monkeypatch):
    steps, trials = run_counting(monkeypatch)
    assert len(steps) == STEPS
    assert sorted(steps[0][0]) == list(range(len(trials)))  # the round's first call: one point of every client
    for calls in steps:
        assert 1 <= len(calls) <= max(trials)  # never more calls than the longest search has trials
        rows = [c for call_rows in calls for c in call_rows]
        for client, n in enumerate(trials):  # every client's own trials are evaluated, in windows
            assert rows.count(client) >= n
    for calls in steps[1:]:  # windows predicted from the previous step: one call, no row past an accepted point
        assert len(calls) == 1
        assert sorted(calls[0]) == sorted(c for c, n in enumerate(trials) for _ in range(n))


def test_in_order_search_makes_as_many_calls_as_the_longest_search(monkeypatch):
    """The path of models with random layers (forced here on a deterministic model): every call evaluates every
    client in order (the replayed generator gives each row its gradient evaluation's dropout masks), and a step
    makes as many calls as its longest search has trials."""
    monkeypatch.setattr(call, "_has_random_layers", lambda model: True)
    steps, trials = run_counting(monkeypatch)
    assert len(steps) == STEPS
    for calls in steps:
        assert len(calls) == max(trials)
        assert all(rows == list(range(len(trials))) for rows in calls)


class MixedCurvatureClients(FederatedDataModule):
    """Clients whose samples carry different curvatures, so that a batch's mean curvature, and with it the grid point
    the client accepts, changes from step to step (batches of 2 drawn by the client's shuffling sampler)."""

    MIXES = [[1.3, 1.3, 47.0, 47.0, 6.1, 6.1], [2.3, 93.0, 2.3, 9.7, 31.0, 2.3], [310.0, 3.3, 3.3, 21.0]]

    def __init__(self):
        super().__init__(num_clients=len(self.MIXES), batch_size=2)

    def load(self):
        a = torch.tensor([v for mix in self.MIXES for v in mix], dtype=torch.float64)
        data = ArrayDataset(a, torch.zeros(len(a), dtype=torch.long))
        return data, data, np.zeros(len(a), dtype=np.int64)

    def natural_clients(self):
        ends = np.cumsum([len(m) for m in self.MIXES])
        return [np.arange(e - len(m), e) for e, m in zip(ends, self.MIXES)]


def test_first_window_ends_at_the_larger_of_the_last_two_accepted_points(monkeypatch):
    """Each client's first window of a step ends at the larger grid point it accepted at its previous two steps of
    the round (one point at the first step): a step whose every search accepts within that makes one trial call,
    with exactly those rows; the data makes steps where the previous step's point alone would not have sufficed."""
    steps, accepted = [], []
    local_step, trial, search = _BatchedArmijo.step, step_module._StepEvaluator.trial, _BatchedArmijo._search_windows

    def counting_step(self, *args, **kwargs):
        steps.append([])
        return local_step(self, *args, **kwargs)

    def counting_trial(self, points, clients=None, line=None):
        steps[-1].append(clients.tolist())
        return trial(self, points, clients, line)

    def recording_search(self, *args):
        first_m, trials = search(self, *args)
        accepted.append(list(first_m))
        return first_m, trials

    monkeypatch.setattr(_BatchedArmijo, "step", counting_step)
    monkeypatch.setattr(_BatchedArmijo, "_search_windows", recording_search)
    monkeypatch.setattr(step_module._StepEvaluator, "trial", counting_trial)
    clients = len(MixedCurvatureClients.MIXES)
    loop = FederatedLoop(
        Quadratic(),
        client_optimizer=lambda p: SgdArmijo(p, eta_max=1.0, beta=0.5, c=0.1, max_backtracks=12),
        local_steps=8,
        clients_per_round=clients,
        seed=0,
        client_execution="vectorized",
    )
    make_trainer(1, callbacks=[FedAvg()]).fit(loop, datamodule=MixedCurvatureClients())
    assert len(steps) == 8 and all(max(m) <= 12 for m in accepted)  # every search accepts
    assert sorted(steps[0][0]) == list(range(clients))
    covered_by_two_only = 0
    for k in range(1, len(steps)):
        window = [max(accepted[max(k - 2, 0) : k][j][c] for j in range(min(k, 2))) + 1 for c in range(clients)]
        first_rows = [steps[k][0].count(c) for c in range(clients)]
        assert first_rows == window
        within = all(accepted[k][c] < window[c] for c in range(clients))
        assert (len(steps[k]) == 1) == within
        if within and any(accepted[k][c] > accepted[k - 1][c] for c in range(clients)):
            covered_by_two_only += 1
    assert covered_by_two_only >= 1


def test_host_telemetry_reads_back_as_tensor_telemetry():
    """``StepRecord.add_host`` (the Armijo rule's per-step telemetry as host lists) gives the round the same step sizes,
    backtracks, forward and backward counts as ``add`` with tensors, also when a round mixes the two; only clients
    marked live are counted."""
    from fedlightning.vectorized.rules import StepRecord

    cpu = torch.device("cpu")
    nan = float("nan")
    steps = [
        ([0.5, nan, 0.25], [True, True, False], [2, 1, 3], [1, 0, 2]),
        ([0.1, 0.2, 0.3], [True, False, True], [1, 4, 1], [0, 3, 0]),
        ([0.0, 0.125, 1.0], [False, True, True], [5, 2, 1], [5, 1, 0]),
    ]

    def fill(record, host):
        for k, (sizes, live, forwards, backtracks) in enumerate(steps):
            loss = torch.full((3,), float(k))
            if host[k]:
                record.add_host(loss, sizes, live, forwards, backtracks)
            else:
                record.add(
                    loss,
                    torch.tensor(sizes, dtype=torch.float64),
                    torch.tensor(live),
                    forwards=torch.tensor(forwards),
                    backtracks=torch.tensor(backtracks),
                )
        return torch.tensor(record.step_size_rows(), dtype=torch.float64), [t.tolist() for t in record.totals()]

    expected_sizes = torch.tensor([s for s, _, _, _ in steps], dtype=torch.float64).t()
    live = torch.tensor([lv for _, lv, _, _ in steps])
    expected_counts = [
        (torch.tensor([b for _, _, _, b in steps]) * live).sum(0).tolist(),
        (torch.tensor([f for _, _, f, _ in steps]) * live).sum(0).tolist(),
        live.long().sum(0).tolist(),
    ]
    assert expected_counts == [[1, 1, 0], [3, 3, 2], [2, 2, 2]]  # the hand count of the table above
    for host in ([False] * 3, [True] * 3, [False, True, False], [True, False, True]):
        sizes, counts = fill(StepRecord(3, cpu), host)
        torch.testing.assert_close(sizes, expected_sizes, rtol=0, atol=0, equal_nan=True)
        assert counts == expected_counts
