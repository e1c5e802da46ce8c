"""``FederatedLoop(max_parallel_clients=...)``: vectorised clients trained in groups equal sequential training.

The reference is sequential training (one client after the other, the plain loop) in float64: every group size
gives its weights, client updates and persistent client state to ``numerics.RTOL64`` (test_vectorized.assert_same_run),
for plain SGD, Adam, SgdArmijo, SgdArmijo carrying its step size across rounds (per-client state) and ragged
``local_epochs``. Running out of accelerator memory is simulated as tests/test_auto_mode.py does: the engine raises
``torch.cuda.OutOfMemoryError`` for groups larger than a size, here after it trained, logged and updated the
client optimizers' state, so that the retry is checked to start from an unchanged state.
"""

import os
import warnings

import pytest
import torch

import fedlightning.vectorized.auto as auto
import test_vectorized
from fedlightning import FederatedLoop
from fedlightning.vectorized import VectorizedClientTrainer
from fedlightning.vectorized.auto import group_size_for
from registry import CLIENT_OPTIMIZERS, params
from test_auto_mode import virtual_clock
from test_vectorized import CPR, assert_same_run, fit, mlp
from test_vectorized_user_losses import UserMLP


def engine_calls(monkeypatch, oom_above=None, from_call=1):
    """Record the group size of every engine call; with ``oom_above``, a call of more clients (from the
    ``from_call``-th call on, 1-based) runs to the end (logging, metric replay, optimizer state written) and then
    raises CUDA's out-of-memory error."""
    sizes = []
    run = VectorizedClientTrainer.run

    def recording(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        sizes.append(len(kwargs["client_ids"]))
        if oom_above is not None and len(sizes) >= from_call and len(kwargs["client_ids"]) > oom_above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.\nmore details")
        return out

    monkeypatch.setattr(VectorizedClientTrainer, "run", recording)
    return sizes


def client_logs(trainer):
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("client/")}


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd", "adam", "armijo", "armijo-grow-carry"))
def test_groups_equal_sequential(optimizer, monkeypatch):
    sequential = fit(mlp(), optimizer, "sequential")
    for groups in (1, 3, 4, 7, None):
        sizes = engine_calls(monkeypatch)
        grouped = fit(mlp(), optimizer, "vectorized", max_parallel_clients=groups)
        assert_same_run(sequential, grouped)
        g = CPR if groups is None else min(groups, CPR)
        assert sizes == ([g] * (CPR // g) + [CPR % g] * (CPR % g > 0)) * 3, (groups, sizes)
        monkeypatch.undo()


def test_groups_with_local_epochs_and_logged_values(monkeypatch):
    """Ragged step counts (one epoch of each client's own data) and the values the module logs (client/* means)."""
    monkeypatch.setattr(test_vectorized, "K", None)  # fit's local_steps: None, so that local_epochs applies
    sequential = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "sequential", local_epochs=1.0)
    sizes = engine_calls(monkeypatch)
    grouped = fit(UserMLP(), CLIENT_OPTIMIZERS["sgd"], "vectorized", local_epochs=1.0, max_parallel_clients=4)
    steps = max(u.num_steps for u in sequential[2])
    monkeypatch.setattr(test_vectorized, "K", steps)  # assert_same_run's bound on the mean loss's rounding
    assert sizes == [4, 2] * 3
    assert_same_run(sequential, grouped)
    assert len({u.num_steps for u in grouped[2]}) > 1  # the clients' step counts differ
    seq_logs, grouped_logs = client_logs(sequential[3]), client_logs(grouped[3])
    assert seq_logs.keys() == grouped_logs.keys() and seq_logs
    for k in seq_logs:
        assert grouped_logs[k] == pytest.approx(seq_logs[k], rel=1e-6), k


@pytest.mark.parametrize("optimizer", params(CLIENT_OPTIMIZERS, "sgd", "armijo-grow-carry"))
def test_a_group_that_runs_out_of_memory_is_halved_and_retried_unchanged(optimizer, monkeypatch):
    """Groups of more than 3 clients run out of memory after training (logged values, metric states and client
    optimizer state already made): the whole cohort of 6 runs out and is halved to 3, which fits; one warning names
    3, which is kept for the rest of the run, and the run equals sequential training (weights, updates, client
    state, logged client/* values)."""
    sequential = fit(UserMLP(), optimizer, "sequential")
    sizes = engine_calls(monkeypatch, oom_above=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grouped = fit(UserMLP(), optimizer, "vectorized")
    halved = [str(w.message) for w in caught if "max_parallel_clients" in str(w.message)]
    assert halved == [
        "max_parallel_clients: a group of 6 vectorized clients ran out of accelerator memory; training in groups of 3 "
        "from now on"
    ]
    assert sizes == [6, 3, 3] + [3, 3] * 2  # kept for the later rounds
    assert grouped[1]._executor.run.group_size == 3
    assert_same_run(sequential, grouped)
    seq_logs, grouped_logs = client_logs(sequential[3]), client_logs(grouped[3])
    assert seq_logs.keys() == grouped_logs.keys() and seq_logs
    for k in seq_logs:
        assert grouped_logs[k] == pytest.approx(seq_logs[k], rel=1e-6), k


def test_halving_repeats_until_a_group_fits(monkeypatch):
    sizes = engine_calls(monkeypatch, oom_above=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grouped = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=2, max_parallel_clients=5)
    halved = [str(w.message) for w in caught if "max_parallel_clients" in str(w.message)]
    assert len(halved) == 1 and "a group of 5 " in halved[0] and "groups of 1 " in halved[0]
    assert sizes == [5, 2] + [1] * (CPR + CPR)
    assert_same_run(fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=2), grouped)


def test_a_client_that_does_not_fit_alone(monkeypatch):
    """Vectorized raises naming the setting; auto trains the rest of the round and of the run sequentially."""
    engine_calls(monkeypatch, oom_above=0)  # every call
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"max_parallel_clients=2, halved down to 1"):
        fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=1, max_parallel_clients=2)
    monkeypatch.undo()
    virtual_clock(monkeypatch, 4.0, 1.0)  # vectorized is chosen
    sizes = engine_calls(monkeypatch, oom_above=0, from_call=4)  # after the measurement and round 0's first group
    with pytest.warns(UserWarning, match=r"training clients sequentially \(vectorized clients ran out of accelerator "):
        run = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2, max_parallel_clients=4)
    assert run[1].client_execution_choice == "sequential"
    # warm-up, timed group, round 0's first group; its second group of 2 halved to 1: its clients sequential
    assert sizes == [2, 4, 4, 2, 1]
    assert_same_run(fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=2), run)


def test_auto_group_size_from_the_measured_footprint(monkeypatch):
    """``max_parallel_clients="auto"`` on a CPU: the first group of 2 clients is measured, the group size is
    ``group_size_for`` of that footprint and the available RAM (here room for 3.5 clients' worth at the planned
    fraction), and the run equals sequential training."""
    monkeypatch.setattr(auto, "_available_ram", lambda: 1e12)
    first = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "vectorized", rounds=1, max_parallel_clients="auto")
    footprint = first[1]._executor.run.footprint
    D = sum(p.numel() for p in mlp().parameters())
    assert footprint > auto.AUTO_GROUP_CPU_ROWS * D * 8  # float64 rows plus the saved activations
    assert first[1]._executor.run.group_size == group_size_for(footprint, 1e12, auto.AUTO_GROUP_CPU_MEMORY_FRACTION)
    monkeypatch.setattr(auto, "_available_ram", lambda: 3.5 * footprint / auto.AUTO_GROUP_CPU_MEMORY_FRACTION)
    sizes = engine_calls(monkeypatch)
    grouped = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "vectorized", max_parallel_clients="auto")
    assert grouped[1]._executor.run.footprint == footprint  # the same measurement: the same clients and batches
    assert sizes == [2, 3, 1] + [3, 3] * 2
    assert_same_run(fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential"), grouped)


def test_group_size_rule():
    assert group_size_for(100.0, 1000.0, 0.8) == 8
    assert group_size_for(100.0, 50.0, 0.8) == 1  # at least one client
    with pytest.raises(ValueError, match="per_client_bytes"):
        group_size_for(0.0, 1000.0)


def test_auto_measures_one_group_when_groups_are_set(monkeypatch, caplog):
    """``client_execution="auto"`` with groups of 4 of the round's 6 clients times one group vectorised and
    estimates the round as 2 groups (here at a quarter of sequential's cost per client-step: chosen)."""
    seen = virtual_clock(monkeypatch, 4.0, 1.0)
    with caplog.at_level("INFO"):
        run = fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "auto", rounds=2, max_parallel_clients=4)
    assert run[1].client_execution_choice == "vectorized"
    assert "of a group of 4 clients of 6 (2 groups) vectorized" in run[1].client_execution_reason
    assert (seen["vectorized"] - 2) % 4 == 0 and seen["vectorized"] > 2  # warm-up of 2, then steps of one group of 4
    assert_same_run(fit(mlp(), CLIENT_OPTIMIZERS["sgd"], "sequential", rounds=2), run)


@pytest.mark.parametrize("bad", [0, -1, "big", 1.5, True])
def test_bad_max_parallel_clients_is_rejected(bad):
    with pytest.raises((ValueError, TypeError), match="max_parallel_clients"):
        FederatedLoop(mlp(), max_parallel_clients=bad)


def test_example_config_trains_in_groups_through_the_cli(tmp_path, monkeypatch):
    from fedlightning.cli import main

    sizes = engine_calls(monkeypatch)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cli = main(
        [
            "fit",
            "--config",
            os.path.join(root, "configs", "examples", "client_groups.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.local_steps",
            "2",
        ],
        run=True,
    )
    assert cli.model.max_parallel_clients == 5
    assert sizes == [5] * 8  # 2 rounds of 20 clients in groups of 5


def test_a_resumed_run_keeps_the_halved_group_size(tmp_path):
    """A dropout model (its masks are seeded per group of clients): the run halves its groups of 6 to 3 in round 0
    (simulated out of memory) and is checkpointed after round 2; resumed where memory no longer runs out, it trains
    in the checkpointed groups of 3 and equals the uninterrupted run bit for bit (with the setting changed, the new
    setting applies)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from conftest import make_trainer
    from fedlightning.callbacks import FedAvg
    from fedlightning.checkpoint import AtomicCheckpointIO
    from fedlightning.models import MLP
    from test_vectorized import digits

    def setup(max_parallel_clients=None):
        torch.manual_seed(1)
        model = MLP(input_dim=64, hidden=[16], num_classes=10, dropout=0.3)
        loop = FederatedLoop(
            model,
            client_optimizer=CLIENT_OPTIMIZERS["sgd"],
            local_steps=3,
            clients_per_round=6,
            seed=3,
            client_execution="vectorized",
            max_parallel_clients=max_parallel_clients,
        )
        return loop, model

    def weights(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine_calls(mp, oom_above=3)
        loop, model = setup()
        make_trainer(4, callbacks=[FedAvg()]).fit(loop, datamodule=digits(float64=False))
        full = weights(model)
        loop, model = setup()
        ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = make_trainer(4, callbacks=[FedAvg(), ck], enable_checkpointing=True, plugins=[AtomicCheckpointIO()])
        trainer.fit(loop, datamodule=digits(float64=False))
        assert torch.equal(weights(model), full)
    path = str(tmp_path / "step=2.ckpt")

    def resume(max_parallel_clients=None):
        loop, model = setup(max_parallel_clients)
        sizes_mp = pytest.MonkeyPatch()
        sizes = engine_calls(sizes_mp)
        try:
            trainer = make_trainer(4, callbacks=[FedAvg()], plugins=[AtomicCheckpointIO()])
            trainer.fit(loop, datamodule=digits(float64=False), ckpt_path=path, weights_only=True)
        finally:
            sizes_mp.undo()
        return weights(model), sizes

    resumed, sizes = resume()
    assert sizes == [3, 3, 3, 3]
    assert torch.equal(resumed, full)
    changed, sizes = resume(max_parallel_clients=2)
    assert sizes == [2, 2, 2] * 2
