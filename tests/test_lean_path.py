"""The lean per-step path of sequential clients computes what the general path computes.

* ``ArrayBatchLoader.iter_steps`` / ``client._cycle`` give the batches of re-iterating the loader, across epochs;
* the lean step (no closure, gradients dropped instead of ``zero_grad``) gives the weights of the general step;
* an optimizer that overrides ``zero_grad`` still has it called;
* ``RoundStatistics`` sums Python scalars exactly as float64 tensors;
* round metrics reach the loggers on Lightning's ``log_every_n_steps`` schedule and ``callback_metrics`` every round.
"""

import csv
import glob
import os

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.callbacks.base import RoundStatistics
from fedlightning.client import _cycle
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.datamodules.base import ArrayBatchLoader, ArrayDataset, ClientBatchSampler
from fedlightning.models import MLP
from numerics import rtol32
from registry import CLIENT_OPTIMIZERS, params


def _manual_cycle(x, y, indices, batch, seed, steps):
    """Independent reference: a fresh permutation per epoch from the same generator, advanced indexing."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(indices)
    out, pending = [], []
    while len(out) < steps:
        if not pending:
            pending = list(torch.split(idx[torch.randperm(len(idx), generator=gen)], batch))
        b = pending.pop(0)
        out.append((x[b], y[b]))
    return out


@pytest.mark.parametrize("n,batch,steps", [(3, 50, 7), (50, 50, 3), (120, 50, 7), (120, 50, 1), (7, 2, 20)])
def test_iter_steps_equals_reiterating_the_loader(n, batch, steps):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 4, (200,), generator=g)
    indices = np.sort(np.random.default_rng(1).choice(200, size=n, replace=False))
    loader = ArrayBatchLoader(ArrayDataset(x, y), ClientBatchSampler(indices, batch, torch.Generator().manual_seed(5)))
    got = list(_cycle(loader, steps))
    want = _manual_cycle(x, y, indices, batch, 5, steps)
    assert len(got) == steps
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_cycle_of_a_generic_loader_restarts_epochs():
    ds = TensorDataset(torch.arange(5.0).unsqueeze(1), torch.arange(5))
    got = [b[1].tolist() for b in _cycle(DataLoader(ds, batch_size=2), 6)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]


def test_cycle_of_an_empty_loader_is_a_clear_error():
    empty = DataLoader(TensorDataset(torch.zeros(0, 1)), batch_size=2)
    with pytest.raises(RuntimeError, match="yielded no batch"):
        list(_cycle(empty, 2))
    loader = ArrayBatchLoader(
        ArrayDataset(torch.zeros(3, 1), torch.zeros(3)), ClientBatchSampler(np.array([], np.int64), 2, None)
    )
    with pytest.raises(RuntimeError, match="yielded no batch"):
        list(_cycle(loader, 2))


def _fit(model, dm, rounds, callbacks, **loop_kwargs):
    loop = FederatedLoop(
        model,
        client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=5,
        clients_per_round=4,
        seed=2,
        **loop_kwargs,
    )
    make_trainer(rounds, callbacks=callbacks).fit(loop, datamodule=dm)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


class _ZeroTerm(Callback):
    """A client-objective term that adds exactly 0: forces the general (closure) path without changing the loss."""

    def client_objective(self, trainer, loop, plan, client_id):
        return [lambda params: params[0].sum() * 0.0]


def test_lean_step_equals_general_step():
    def dm():
        return DigitsDataModule(num_clients=20, batch_size=16, partition=Dirichlet(0.5), seed=0)

    torch.manual_seed(0)
    init = MLP(input_dim=64, hidden=[8], num_classes=10).state_dict()
    lean_model = MLP(input_dim=64, hidden=[8], num_classes=10)
    general_model = MLP(input_dim=64, hidden=[8], num_classes=10)
    lean_model.load_state_dict(init)
    general_model.load_state_dict(init)
    lean = _fit(lean_model, dm(), 3, [FedAvg()])
    general = _fit(general_model, dm(), 3, [FedAvg(), _ZeroTerm()])
    assert not torch.equal(lean, torch.nn.utils.parameters_to_vector(MLP(input_dim=64, hidden=[8]).parameters()))
    torch.testing.assert_close(lean, general, rtol=0, atol=0)  # bit-identical: same per-tensor ops


def test_optimizer_with_its_own_zero_grad_is_called_every_step():
    calls = []

    class CountingSGD(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(1)
            super().zero_grad(set_to_none=set_to_none)

    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]),
        client_optimizer=lambda p: CountingSGD(p, lr=0.1),
        local_steps=3,
        clients_per_round=2,
        seed=0,
    )
    make_trainer(2, callbacks=[FedAvg()]).fit(loop, datamodule=dm)
    assert len(calls) == 2 * 2 * 3  # rounds x clients x local steps


def test_round_statistics_scalars_match_float64_tensors():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=50) * 10.0 ** rng.integers(-8, 8, size=50)
    stats = RoundStatistics()
    ref_sum = torch.zeros((), dtype=torch.float64)
    ref_max = torch.tensor(-np.inf, dtype=torch.float64)
    for v in xs:
        stats.add("s", float(v))
        stats.maximum("m", float(v))
        ref_sum = ref_sum + torch.tensor(float(v), dtype=torch.float64)
        ref_max = torch.maximum(ref_max, torch.tensor(float(v), dtype=torch.float64))
    assert stats["s"].dtype == torch.float64 and torch.equal(stats["s"], ref_sum)
    assert torch.equal(stats["m"], ref_max)
    assert stats.ops == {"s": "sum", "m": "max"}
    # mixing: tensor then scalar, scalar then tensor, and a float32 vector accumulated in place
    stats.add("t", torch.tensor(1.5, dtype=torch.float64))
    stats.add("t", 2.25)
    stats.add("u", 1.0)
    stats.add("u", torch.tensor(0.5, dtype=torch.float64))
    v1, v2 = torch.randn(4), torch.randn(4)
    stats.add("v", v1)
    stats.add("v", v2)
    assert float(stats["t"]) == 3.75 and float(stats["u"]) == 1.5
    assert torch.equal(stats["v"], v1 + v2) and not torch.equal(v1, stats["v"])  # the caller's tensor is untouched
    assert set(stats.values) == {"s", "m", "t", "u", "v"} and "s" in stats and stats.get("nope") is None


class _RecordMetrics(Callback):
    def __init__(self):
        self.round_metrics, self.callback_metrics = [], []

    def on_round_end(self, trainer, loop, result):
        self.round_metrics.append(dict(result.metrics))

    def on_train_batch_end(self, trainer, *args):
        self.callback_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_round_metrics_follow_log_every_n_steps_and_reach_callback_metrics(tmp_path):
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    rec = _RecordMetrics()
    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=3, seed=0)
    trainer = make_trainer(7, callbacks=[FedAvg(), rec], logger=CSVLogger(str(tmp_path), name="m"), log_every_n_steps=3)
    trainer.fit(loop, datamodule=dm)
    assert len(rec.round_metrics) == 7
    # the round's metrics (Python floats) reach Lightning as float32 tensors: one rounding (numerics.rtol32)
    for logged, seen in zip(rec.round_metrics, rec.callback_metrics):  # fresh every round, not only when written
        for key in ("train/loss", "server/delta_norm", "server/eta_g", "round/clients"):
            assert seen[key] == pytest.approx(logged[key], rel=rtol32(1)), key
    (path,) = glob.glob(os.path.join(str(tmp_path), "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        all_rows = list(csv.DictReader(f))
    rows = [r for r in all_rows if r.get("server/delta_norm")]
    losses = {int(r["step"]): float(r["train/loss"]) for r in all_rows if r.get("train/loss")}
    assert [int(r["step"]) for r in rows] == [2, 5]  # Lightning writes steps 3 and 6 (1-based) with log_every_n_steps=3
    assert sorted(losses) == [2, 5]  # ... and train/loss at the same steps
    for r in rows:
        logged = rec.round_metrics[int(r["step"])]
        assert float(r["server/delta_norm"]) == pytest.approx(logged["server/delta_norm"], rel=rtol32(1))
        assert float(r["round/clients"]) == 3.0
        assert losses[int(r["step"])] == pytest.approx(logged["train/loss"], rel=rtol32(1))


@pytest.mark.parametrize("make", params(CLIENT_OPTIMIZERS, "sgd-momentum+wd", "adam"))
def test_reused_torch_optimizer_equals_a_fresh_one_per_client(make):
    """torch.optim optimizers are reset, not rebuilt, between sequential clients: momentum / Adam moments must not
    leak from one client to the next. A subclass defined here is never reused, so it is the fresh reference."""
    base = type(make([torch.nn.Parameter(torch.zeros(1))]))
    Fresh = type("Fresh" + base.__name__, (base,), {})  # same arithmetic, a class outside torch.optim

    def fresh(p):
        opt = make(p)
        opt.__class__ = Fresh
        return opt

    def run(factory):
        torch.manual_seed(0)
        model = MLP(input_dim=64, hidden=[8])
        dm = DigitsDataModule(num_clients=12, batch_size=16, partition=Dirichlet(0.5), seed=0)
        loop = FederatedLoop(model, client_optimizer=factory, local_steps=4, clients_per_round=4, seed=1)
        make_trainer(3, callbacks=[FedAvg()]).fit(loop, datamodule=dm)
        return loop, torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    reused_loop, reused = run(make)
    fresh_loop, reference = run(fresh)
    assert reused_loop._runtime.reusable_client_opt is not None and fresh_loop._runtime.reusable_client_opt is None
    torch.testing.assert_close(reused, reference, rtol=0, atol=0)


def test_plain_sgd_fast_step_only_for_exact_sgd():
    from fedlightning.client import _plain_sgd_lrs, _plain_sgd_step

    p = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(1))]
    assert _plain_sgd_lrs(torch.optim.SGD(p, lr=0.3)) == [0.3]
    assert _plain_sgd_lrs(torch.optim.SGD(p, lr=0.3, momentum=0.9)) is None
    assert _plain_sgd_lrs(torch.optim.SGD(p, lr=0.3, weight_decay=1e-4)) is None
    assert _plain_sgd_lrs(torch.optim.SGD(p, lr=0.3, maximize=True)) is None
    assert _plain_sgd_lrs(torch.optim.Adam(p, lr=0.3)) is None
    assert _plain_sgd_lrs(type("MySGD", (torch.optim.SGD,), {})(p, lr=0.3)) is None
    hooked = torch.optim.SGD(p, lr=0.3)
    hooked.register_step_post_hook(lambda *a: None)
    assert _plain_sgd_lrs(hooked) is None
    # same result as SGD's own step, bit for bit, with two groups and a parameter without a gradient
    torch.manual_seed(0)
    a = [torch.nn.Parameter(t.detach().clone()) for t in p]
    b = [torch.nn.Parameter(t.detach().clone()) for t in p]
    for ps in (a, b):
        ps[0].grad, ps[1].grad = torch.ones(3, 2) * 0.7, torch.arange(2.0)
    ref = torch.optim.SGD([{"params": a[:2], "lr": 0.1}, {"params": a[2:], "lr": 0.5}])
    fast = torch.optim.SGD([{"params": b[:2], "lr": 0.1}, {"params": b[2:], "lr": 0.5}])
    ref.step()
    _plain_sgd_step(fast, _plain_sgd_lrs(fast))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_iter_steps_with_a_batch_sampler_without_epochs():
    from torch.utils.data import BatchSampler, SequentialSampler

    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    loader = ArrayBatchLoader(
        ArrayDataset(x, y), BatchSampler(SequentialSampler(range(5)), batch_size=2, drop_last=False)
    )
    got = [b[1].tolist() for b in loader.iter_steps(5)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
