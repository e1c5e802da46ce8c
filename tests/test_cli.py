"""The quickstart config runs end to end through the CLI and logs per-round metrics to CSV."""

import csv
import glob
import os

import pytest

from fedlightning.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_metrics(save_dir):
    files = glob.glob(os.path.join(save_dir, "**", "metrics.csv"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return list(csv.DictReader(f))


def test_quickstart_cli_end_to_end(tmp_path):
    args = [
        "fit",
        "--config",
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "3",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    ]
    cli = main(args)
    assert cli.trainer.global_step == 6
    rows = _read_metrics(str(tmp_path))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    acc = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
    client_logged = [r for r in rows if r.get("client/train/batch_loss")]
    assert len(train) == 6  # one train loss per round
    assert train[-1] < train[0]  # FedAvg on digits makes progress within 6 rounds
    assert len(acc) >= 2 and 0.0 <= acc[-1] <= 1.0 and acc[-1] > 0.3  # better than chance (0.1)
    assert len(client_logged) == 6  # the wrapped model's self.log in training_step is routed, not crashed
    assert glob.glob(os.path.join(str(tmp_path), "**", "*.ckpt"), recursive=True)  # checkpoint written
    # the final model's test/* at the last round's step (5), where its round and the validation after it are
    steps = {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("train/loss", "val/acc", "test/acc")}
    assert steps["train/loss"] == list(range(6))
    assert steps["val/acc"] == [2, 5] and steps["test/acc"] == [5]


def test_cli_validate_subcommand(tmp_path):
    args = [
        "validate",
        "--config",
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        "--trainer.logger",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    ]
    with pytest.warns(UserWarning, match=r"validate without --ckpt_path evaluates the model as the config builds it"):
        cli = main(args)
    acc = float(cli.trainer.callback_metrics["val/acc"])  # untrained global model: near chance
    assert 0.0 <= acc < 0.5


def test_progress_bar_counts_rounds(tmp_path):
    """The CLI's default progress bar is over rounds: described as 'Round', without v_num (rich or tqdm variant)."""
    from fedlightning.callbacks.progress import RoundProgressBar, RoundTQDMProgressBar

    cli = main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "quickstart.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.limit_val_batches",
            "0",
        ]
    )
    bars = [cb for cb in cli.trainer.callbacks if isinstance(cb, RoundProgressBar)]
    assert len(bars) == 1 and cli.trainer.progress_bar_callback is bars[0]
    assert "v_num" not in bars[0].get_metrics(cli.trainer, cli.model)
    if isinstance(bars[0], RoundTQDMProgressBar):
        assert bars[0].train_progress_bar.desc.startswith("Round")
    else:
        assert bars[0]._get_train_description(0).strip() == "Round"


def test_tqdm_round_progress_bar_without_rich(tmp_path):
    """The tqdm variant (used when rich is not installed) counts the rounds: total = max_steps, description 'Round'."""
    from fedlightning.callbacks.progress import RoundTQDMProgressBar

    bar = RoundTQDMProgressBar()
    from conftest import make_trainer
    from fedlightning import FederatedLoop
    from fedlightning.datamodules import DigitsDataModule
    from fedlightning.models import MLP

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=3, seed=0)
    trainer = make_trainer(4, callbacks=[bar], enable_progress_bar=True)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0))
    assert bar.train_progress_bar.desc.startswith("Round")
    assert bar.train_progress_bar.total == 4 and bar.train_progress_bar.n == 4
    assert "v_num" not in bar.get_metrics(trainer, loop)


def test_vectorized_quickstart_equals_the_sequential_one(tmp_path):
    """configs/quickstart_vectorized.yaml differs from the quickstart only in client_execution, and trains the
    same global model (float rounding apart)."""
    import torch

    def run(name):
        cli = main(
            [
                "fit",
                "--config",
                os.path.join(ROOT, "configs", name),
                "--trainer.max_steps",
                "3",
                "--trainer.logger",
                "false",
                "--trainer.enable_checkpointing",
                "false",
                "--trainer.limit_val_batches",
                "0",
                "--trainer.default_root_dir",
                str(tmp_path / name),
                "--trainer.enable_progress_bar",
                "false",
            ]
        )
        assert cli.trainer.global_step == 3
        return cli.model, torch.cat([p.detach().reshape(-1) for p in cli.model.model.parameters()])

    seq_loop, seq = run("quickstart.yaml")
    vec_loop, vec = run("quickstart_vectorized.yaml")
    assert (seq_loop.client_execution, vec_loop.client_execution) == ("sequential", "vectorized")
    assert vec_loop.vectorized_engine is not None  # the batched engine really ran
    torch.testing.assert_close(vec, seq, atol=1e-5, rtol=0)
