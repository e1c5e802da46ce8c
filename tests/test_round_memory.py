"""A round holds one client update in flight, not one per client: once a healthy client's delta is in the round's
sums the loop keeps only its scalars (``fedlightning._round.HealthyClient``), so a round of many clients does not
keep a model-sized vector per client until the server step (sequential clients, and vectorised clients in groups)."""

import gc
import weakref

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg, FederatedCallback
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP


class _Alive(FederatedCallback):
    """Weak references to every client's delta; counts how many are still alive when the next client ends and at
    the server step's end."""

    def __init__(self):
        self.refs, self.alive_at_client_end, self.alive_at_round_end = [], [], []

    def on_round_start(self, trainer, pl_module, plan):
        self.refs = []

    def on_client_end(self, trainer, pl_module, plan, update):
        gc.collect()
        self.alive_at_client_end.append(sum(r() is not None for r in self.refs))
        self.refs.append(weakref.ref(update.delta))

    def on_round_end(self, trainer, pl_module, result):
        gc.collect()
        self.alive_at_round_end.append(sum(r() is not None for r in self.refs))


@pytest.mark.parametrize("execution, groups", [("sequential", None), ("vectorized", 2)])
def test_a_rounds_admitted_client_deltas_are_freed(execution, groups):
    alive = _Alive()
    torch.manual_seed(0)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[8]),
        lambda p: torch.optim.SGD(p, lr=0.1),
        local_steps=2,
        clients_per_round=6,
        seed=1,
        client_execution=execution,
        max_parallel_clients=groups,
    )
    trainer = make_trainer(2, callbacks=[FedAvg(), alive])
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=8, batch_size=16, partition=Dirichlet(0.5), seed=0))
    assert len(alive.alive_at_client_end) == 12 and alive.alive_at_round_end == [0, 0]
    # the previous clients' deltas are gone when a client ends, but those of its own vectorised group
    in_flight = 1 if groups is None else groups
    assert max(alive.alive_at_client_end) <= in_flight - 1
