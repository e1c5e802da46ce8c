"""The federated callback contract: declared hooks, core sums computed by the loop, misspelled hooks refused."""

import lightning.pytorch as pl
import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FederatedCallback, ServerStep, ServerStrategy
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP


def _fit(strategy, rounds=2, extra=()):
    torch.manual_seed(0)
    model = MLP(input_dim=64, hidden=[8])
    loop = FederatedLoop(model, lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, clients_per_round=3, seed=1)
    trainer = make_trainer(rounds, callbacks=[strategy, *extra])
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=8, batch_size=16, partition=Dirichlet(0.5), seed=0))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), loop, trainer


def test_strategy_that_forgets_super_still_trains():
    class CountsOnly(FedAvg):
        def accumulate(self, stats, update):  # no super().accumulate: the loop adds the core sums itself
            stats.add("my_count", 1.0, update.delta.device)

        def server_update(self, loop, stats, plan):
            assert float(stats["my_count"]) == float(stats["clients"]) == 3.0
            return super().server_update(loop, stats, plan)

    ref, _, _ = _fit(FedAvg())
    got, _, _ = _fit(CountsOnly())
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_server_step_named_tuple_sets_the_round_lr():
    class HalfStep(ServerStrategy):
        def server_update(self, loop, stats, plan):
            return ServerStep(self.mean_delta(stats), lr=0.5, metrics={"server/custom": 1.0})

    ref, _, _ = _fit(FedAvg(server_lr=0.5))
    got, _, trainer = _fit(HalfStep())
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert float(trainer.callback_metrics["server/custom"]) == 1.0


@pytest.mark.parametrize("base", [FederatedCallback, pl.Callback])
def test_misspelled_hook_is_refused_at_setup(base):
    class Schedule(base):
        def on_round_ends(self, trainer, loop, result):  # "on_round_end" misspelled
            raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"Schedule.on_round_ends looks like the federated hook 'on_round_end'"):
        _fit(FedAvg(), extra=[Schedule()])


def test_declared_hooks_run_and_accessors_are_public():
    calls = []

    class Probe(FederatedCallback):
        def on_round_start(self, trainer, loop, plan):
            calls.append(("start", plan.round, loop.datamodule is trainer.datamodule))

        def on_client_end(self, trainer, loop, plan, update):
            calls.append(("client", plan.round))

        def on_round_end(self, trainer, loop, result):
            n = sum(p.numel() for p in loop.global_parameters())
            calls.append(
                (
                    "end",
                    result.plan.round,
                    n == loop.model.num_params
                    if hasattr(loop.model, "num_params")
                    else n == sum(p.numel() for p in loop.model.parameters() if p.requires_grad),
                )
            )

    _fit(FedAvg(), extra=[Probe()])
    assert calls == [
        ("start", 0, True),
        ("client", 0),
        ("client", 0),
        ("client", 0),
        ("end", 0, True),
        ("start", 1, True),
        ("client", 1),
        ("client", 1),
        ("client", 1),
        ("end", 1, True),
    ]
    # the base declares every hook as a no-op with the documented signature
    cb = FederatedCallback()
    assert cb.client_objective(None, None, None, 0) == [] and cb.on_round_start(None, None, None) is None


class _Order(FederatedCallback):
    """Records every federated hook call: its name, the Trainer and module it got, and the module's current hook
    name during the call; logs a value from on_round_end."""

    def __init__(self):
        self.calls = []

    def _seen(self, name, trainer, pl_module):
        self.calls.append((name, trainer, pl_module, pl_module._current_fx_name))

    def on_round_start(self, trainer, pl_module, plan):
        self._seen("on_round_start", trainer, pl_module)

    def configure_client_optimizer(self, trainer, pl_module, plan, client_id, optimizer):
        self._seen("configure_client_optimizer", trainer, pl_module)

    def client_objective(self, trainer, pl_module, plan, client_id):
        self._seen("client_objective", trainer, pl_module)
        return []

    def on_client_end(self, trainer, pl_module, plan, update):
        self._seen("on_client_end", trainer, pl_module)

    def on_round_end(self, trainer, pl_module, result):
        self._seen("on_round_end", trainer, pl_module)
        pl_module.log("custom/round_plus_one", float(result.plan.round + 1), batch_size=1)


def test_every_federated_hook_gets_trainer_and_module_with_its_name_set_and_may_log():
    from lightning.pytorch.profilers import SimpleProfiler

    cb = _Order()
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]), lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, clients_per_round=3, seed=1
    )
    profiler = SimpleProfiler()
    trainer = make_trainer(2, callbacks=[FedAvg(), cb], profiler=profiler)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=8, batch_size=16, partition=Dirichlet(0.5), seed=0))
    per_round = ["on_round_start"] + ["configure_client_optimizer", "client_objective", "on_client_end"] * 3
    per_round += ["on_round_end"]
    assert [c[0] for c in cb.calls] == per_round * 2
    assert all(t is trainer and m is loop and fx == name for name, t, m, fx in cb.calls)
    assert float(trainer.callback_metrics["custom/round_plus_one"]) == 2.0
    assert loop._current_fx_name != "on_round_end"  # restored after the call
    profiled = {k for k in profiler.recorded_durations if "_Order" in k and k.rsplit(".", 1)[1] in per_round}
    assert profiled == {f"[Callback]_Order.{n}" for n in set(per_round)}


def test_old_hook_signatures_still_work_with_one_warning_naming_the_new_one():
    class Old(FederatedCallback):
        def __init__(self):
            self.ends, self.objectives = [], []

        def client_objective(self, loop, plan, client_id):  # the previous signature (no trainer)
            self.objectives.append((loop, client_id))
            return []

        def on_client_end(self, loop, plan, update):
            self.ends.append((loop, update.client_id))

    old = Old()
    with pytest.warns(
        FutureWarning,
        match=r"Old.on_client_end\(loop, plan, update\) uses the old signature.*"
        r"on_client_end\(self, trainer, pl_module, \.\.\.\)",
    ) as record:
        _, loop, _ = _fit(FedAvg(), extra=[old])
    assert len(old.ends) == len(old.objectives) == 6 and all(m is loop for m, _ in old.ends + old.objectives)
    assert sum("uses the old signature" in str(w.message) for w in record) == 2  # once per hook and class


class _HalveLr(FederatedCallback):
    """Sets server-held state into each client's optimizer (halves its lr) and, for client 3, replaces it."""

    def __init__(self):
        self.seen = []

    def configure_client_optimizer(self, trainer, pl_module, plan, client_id, optimizer):
        self.seen.append((plan.round, client_id, type(optimizer).__name__))
        if client_id == 3:
            return torch.optim.SGD(optimizer.param_groups[0]["params"], lr=0.0)
        for group in optimizer.param_groups:
            group["lr"] *= 0.5
        return None


def test_configure_client_optimizer_sets_state_or_replaces_the_clients_optimizer():
    """Every client's optimizer passes through the hook before it trains: in-place changes apply (each client
    trains with lr 0.05: the same computation as a plain loop trained with lr 0.05) and a returned optimizer replaces it
    (client 3 with lr 0 returns a zero update)."""
    dm_args = dict(num_clients=6, batch_size=16, partition=Dirichlet(0.5), seed=0)

    def run(callbacks, lr):
        torch.manual_seed(0)
        loop = FederatedLoop(
            MLP(input_dim=64, hidden=[8]),
            lambda p: torch.optim.SGD(p, lr=lr),
            local_steps=2,
            clients_per_round=6,
            seed=1,
        )
        deltas = {}

        class Record(FederatedCallback):
            def on_client_end(self, trainer, pl_module, plan, update):
                deltas[update.client_id] = update.delta.clone()

        trainer = make_trainer(1, callbacks=[FedAvg(), *callbacks, Record()])
        trainer.fit(loop, datamodule=DigitsDataModule(**dm_args))
        return deltas

    halve = _HalveLr()
    hooked = run([halve], 0.1)
    plain = run([], 0.05)
    assert sorted(c for _, c, _ in halve.seen) == list(range(6))
    assert torch.count_nonzero(hooked[3]) == 0 and torch.count_nonzero(plain[3]) > 0
    for cid in (0, 1, 2, 4, 5):
        assert torch.equal(hooked[cid], plain[cid])  # 0.1 * 0.5 == 0.05 exactly: the same computation
