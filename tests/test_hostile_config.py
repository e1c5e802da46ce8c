"""Hostile configurations: every impossible value fails early with a message naming the value (the hostile-input corpus
of docs/reliability.md)."""

import os
import re

import pytest

from fedlightning.cli import FederatedCLI, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")

# (override arguments, text the error must contain)
CASES = [
    (["--model.local_steps", "0"], "local_steps"),
    (["--model.local_steps", "-5"], "local_steps"),
    (["--model.clients_per_round", "0"], "clients_per_round"),
    (["--model.clients_per_round", "500"], "clients_per_round=500"),
    (["--model.client_grad_clip", "-1"], "client_grad_clip"),
    (["--model.on_client_failure", "ignore"], "on_client_failure"),
    (["--data.init_args.num_clients", "0"], "num_clients"),
    (["--data.init_args.num_clients", "5000"], "num_clients=5000"),
    (["--data.init_args.batch_size", "0"], "batch_size"),
    (["--data.init_args.batch_size", "-50"], "batch_size"),
    (["--data.init_args.test_fraction", "1.5"], "test_fraction"),
    (["--data.init_args.test_fraction", "0"], "test_fraction"),
    (["--data.init_args.partition.init_args.alpha", "0"], "alpha"),
    (["--data.init_args.partition.init_args.alpha", "-0.3"], "alpha"),
    (["--data.init_args.partition.init_args.min_samples", "-1"], "min_samples"),
    (["--model.model.init_args.hidden", "[0]"], "hidden"),
    (["--model.model.init_args.dropout", "1.5"], "dropout"),
    (["--model.model.init_args.num_classes", "1"], "num_classes"),
    (["--model.model.class_path", "fedlightning.models.NoSuchModel"], "NoSuchModel"),
    (["--data.class_path", "fedlightning.datamodules.NoSuchData"], "NoSuchData"),
    (["--model.no_such_option", "3"], "no_such_option"),
    (["--trainer.callbacks+=fedlightning.callbacks.FedAvg", "--trainer.callbacks.server_lr", "0"], "server_lr"),
    (["--trainer.callbacks+=fedlightning.callbacks.FedAvg", "--trainer.callbacks.weighting", "bysize"], "weighting"),
    # strategies and schedules with impossible or missing arguments
    (["--trainer.callbacks+=fedlightning.callbacks.FedExP", "--trainer.callbacks.eps", "-1"], "eps"),
    (["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks.tau", "0"], "tau"),
    (["--trainer.callbacks+=fedlightning.callbacks.FedAdam", "--trainer.callbacks.betas", "[1.5, 0.99]"], "betas"),
    (["--trainer.callbacks+=fedlightning.callbacks.KDecay", "--trainer.callbacks.k0", "0"], "k0"),
    (["--trainer.callbacks+=fedlightning.callbacks.KDecay", "--trainer.callbacks.schedule", "linear"], "schedule"),
    (["--trainer.callbacks+=fedlightning.callbacks.RuntimeModel"], "seconds_per_batch"),
    (["--trainer.callbacks+=fedlightning.callbacks.ProximalTerm", "--trainer.callbacks.mu", "-0.1"], "mu"),
    # client optimizers with impossible hyper-parameters (probabilities / factors outside their range)
    (["--model.client_optimizer", "fedlightning.optim.SgdArmijo", "--model.client_optimizer.c", "1.5"], "c"),
    (["--model.client_optimizer", "fedlightning.optim.SgdArmijo", "--model.client_optimizer.beta", "1.0"], "beta"),
    (["--model.client_optimizer", "fedlightning.optim.SPS", "--model.client_optimizer.gamma_max", "0"], "gamma_max"),
    (["--model.client_optimizer", "fedlightning.optim.DecSPS", "--model.client_optimizer.c0", "-1"], "c0"),
    (["--model.client_optimizer", "torch.optim.SGD", "--model.client_optimizer.lr", "-0.1"], "-0.1"),
]


@pytest.fixture
def fit_only(monkeypatch):
    """Build only the ``fit`` subcommand's parser (the cost of an error before training); the ``fit`` path itself
    is unchanged."""
    fit = {"fit": FederatedCLI.subcommands()["fit"]}
    monkeypatch.setattr(FederatedCLI, "subcommands", staticmethod(lambda: fit))


@pytest.mark.parametrize("override,needle", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_config_value_is_named(tmp_path, capsys, fit_only, override, needle):
    """Exit code 1 and a last stderr line ``error: <key>: ...`` that names the value (or the missing argument);
    no traceback, no jsonargparse usage."""
    args = [
        "fit",
        "--config",
        QUICK,
        "--trainer.max_steps",
        "1",
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        *override,
    ]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]
    assert info.value.code == 1, err[-2000:]
    assert re.match(r"error: [\w.\[\]]+: ", last) and needle in last, err[-2000:]
    assert "usage:" not in err and "Traceback" not in err
