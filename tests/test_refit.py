"""A loop fitted more than once (notebooks, training in stages): ``FederatedLoop._begin_fit``.

* ``trainer.fit`` again on the same Trainer after raising ``max_steps`` continues the run: the server optimizer gets
  the previous fit's state (FedAdam's moments, FedAvgM's momentum), so 4 + 4 rounds equal 8 uninterrupted rounds;
* a fit at round 0 (a new Trainer) of a loop that has trained is a new federated run from the module's weights:
  the loop's client state and the federated callbacks' state start afresh, so it equals a new loop with new
  callbacks from the same weights (SCAFFOLD's ``c`` and ``c_i``, SgdArmijo's carried step sizes);
* a layer unfrozen between stages trains with a new Trainer, and is refused on a continuing one.

All in float64; both sides of each comparison run the same operations in the same order, so they are equal bit
for bit.
"""

import copy

import pytest
import torch

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAdam, FedAvg, FedAvgM, Scaffold
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from fedlightning.optim import SgdArmijo

STRATEGIES = {
    "FedAdam": lambda: FedAdam(server_lr=0.01),
    "FedAvgM": lambda: FedAvgM(server_lr=1.0, momentum=0.9),
    "Scaffold": Scaffold,
}


def _data():
    return DigitsDataModule(num_clients=20, batch_size=20, partition=Dirichlet(alpha=0.5), seed=0)


def _model():
    torch.manual_seed(0)
    return MLP(input_dim=64, hidden=[16], num_classes=10)


def _loop(model, optimizer=None):
    return FederatedLoop(model, client_optimizer=optimizer, local_steps=3, clients_per_round=5, seed=1)


def _trainer(rounds, callback):
    return make_trainer(rounds, callbacks=[callback], precision="64-true", num_sanity_val_steps=0)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fitting_the_same_trainer_again_continues_the_run(name):
    base = _model()
    whole = copy.deepcopy(base)
    _trainer(8, STRATEGIES[name]()).fit(_loop(whole), datamodule=_data())
    staged = copy.deepcopy(base)
    loop = _loop(staged)
    trainer = _trainer(4, STRATEGIES[name]())
    trainer.fit(loop, datamodule=_data())
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(loop, datamodule=_data())
    assert trainer.global_step == 8
    assert torch.equal(_flat(staged), _flat(whole))


@pytest.mark.parametrize(
    "strategy,optimizer",
    [(Scaffold, None), (FedAvg, lambda p: SgdArmijo(p, eta_max=1.0, reset="grow", carry_step_size=True))],
    ids=["Scaffold", "SgdArmijo"],
)
def test_a_new_trainer_starts_a_new_run_from_the_current_weights(strategy, optimizer):
    """The same loop and the same callback object in a new Trainer: as a new loop with a new callback."""
    model = _model()
    loop, callback = _loop(model, optimizer), strategy()
    _trainer(3, callback).fit(loop, datamodule=_data())
    assert len(loop.client_state) > 0
    middle = copy.deepcopy(model)
    _trainer(3, callback).fit(loop, datamodule=_data())
    fresh = copy.deepcopy(middle)
    _trainer(3, strategy()).fit(_loop(fresh, optimizer), datamodule=_data())
    assert torch.equal(_flat(model), _flat(fresh))


def test_a_layer_unfrozen_between_stages_trains_with_a_new_trainer_and_is_refused_on_a_continuing_one():
    """SCAFFOLD's control variates cover the trainable parameters: with a new Trainer the second stage starts them
    afresh over the new set (before, it stopped in round 0 on a shape mismatch); the same Trainer continuing its run
    cannot carry them, nor the server optimizer's state, and is refused before round 0."""
    model = _model()
    first = next(model.parameters())
    first.requires_grad_(False)
    loop, callback = _loop(model), Scaffold()
    trainer = _trainer(2, callback)
    trainer.fit(loop, datamodule=_data())
    first.requires_grad_(True)
    trainer.fit_loop.epoch_loop.max_steps = 4
    with pytest.raises(ValueError, match=r"continues this Trainer's run at round 2, but the trainable parameters"):
        trainer.fit(loop, datamodule=_data())
    middle = copy.deepcopy(model)
    _trainer(2, callback).fit(loop, datamodule=_data())
    fresh = copy.deepcopy(middle)
    _trainer(2, Scaffold()).fit(_loop(fresh), datamodule=_data())
    assert torch.equal(_flat(model), _flat(fresh))
    assert not torch.equal(_flat(model)[: first.numel()], _flat(middle)[: first.numel()])  # the layer trained
