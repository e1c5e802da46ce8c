"""A loop fitted more than once (notebooks, training in stages): ``FederatedLoop._begin_fit``.

* ``trainer.fit`` again on the same Trainer after raising ``max_steps`` continues the run: the server optimizer gets
  the previous fit's state (FedAdam's moments, FedAvgM's momentum), so 4 + 4 rounds equal 8 uninterrupted rounds;
* a fit at round 0 (a new Trainer) of a loop that has trained is a new federated run from the module's weights:
  the loop's client state and the federated callbacks' state start afresh, so it equals a new loop with new
  callbacks from the same weights (SCAFFOLD's ``c`` and ``c_i``, SgdArmijo's carried step sizes);
* a layer unfrozen between stages trains with a new Trainer, and is refused on a continuing one, as is a
  continuation of a fit that an error stopped inside a round; a continued fit stays in the run's epoch.

All in float64 with sequential clients; both sides of each comparison run the same operations in the same order,
so they are equal bit for bit.
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


def test_a_continued_fit_stays_in_the_runs_epoch(tmp_path):
    """Rounds 4..7 of a 4 + 4 continuation log ``epoch`` 0 and are checkpointed as ``epoch=0-step=...``, as in the
    uninterrupted run (Lightning would begin a new epoch for the second fit: ``epoch`` 1, ``epoch=1-step=6.ckpt``)."""
    import csv

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="run")
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        4, callbacks=[FedAdam(server_lr=0.01), saves], logger=logger, enable_checkpointing=True, precision="64-true"
    )
    loop = _loop(_model())
    trainer.fit(loop, datamodule=_data())
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(loop, datamodule=_data())
    with open(f"{logger.log_dir}/metrics.csv") as f:
        epochs = {int(r["step"]): r["epoch"] for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(epochs) == list(range(8)) and set(epochs.values()) == {"0"}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)]


class _FailsOnce(MLP):
    """Raises in one training_step call of round 1 (a fit stopped inside a round)."""

    calls = 0

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            type(self).calls += 1
            if type(self).calls == 4:
                raise RuntimeError("a failing step")
        return super().training_step(batch, batch_idx)


def test_continuing_a_fit_that_stopped_inside_a_round_is_refused():
    """SCAFFOLD's clients of round 1 wrote part of their state before the error: the same Trainer cannot continue
    from there (it replayed round 1 over that state, and stopped on a misleading 'written twice' error); a new
    Trainer starts a new run."""
    torch.manual_seed(0)
    model = _FailsOnce(input_dim=64, hidden=[16], num_classes=10)
    loop, trainer = _loop(model), _trainer(3, Scaffold())
    with pytest.raises(RuntimeError):
        trainer.fit(loop, datamodule=_data())
    assert trainer.global_step == 1 and len(loop.client_state) > 0
    with pytest.raises(ValueError, match=r"previous fit stopped inside round 1 \(an error\)"):
        trainer.fit(loop, datamodule=_data())
    fresh = _trainer(2, Scaffold())
    fresh.fit(loop, datamodule=_data())
    assert fresh.global_step == 2


def test_resuming_a_used_loop_from_a_checkpoint_does_not_announce_a_new_run(tmp_path, caplog):
    """``ckpt_path`` on a used loop restores the file's state: the 'new federated run' line would say otherwise."""
    import logging

    from lightning.pytorch.callbacks import ModelCheckpoint

    loop = _loop(_model())
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    make_trainer(2, callbacks=[Scaffold(), saves], enable_checkpointing=True).fit(loop, datamodule=_data())
    with caplog.at_level(logging.INFO):
        make_trainer(3, callbacks=[Scaffold()]).fit(
            loop, datamodule=_data(), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt")
        )
    assert "starts a new federated run" not in caplog.text
    with caplog.at_level(logging.INFO):
        make_trainer(1, callbacks=[Scaffold()]).fit(loop, datamodule=_data())
    assert "starts a new federated run" in caplog.text
