"""A 2-process CPU run (Lightning DDP, gloo) equals the 1-process run: clients are sharded, statistics all-reduced."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_run.py")


def _run(tmp_path, devices, setup, rounds=3, extra=()):
    out = tmp_path / f"{setup}_{devices}_{rounds}.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--devices", str(devices), "--setup", setup, "--rounds", str(rounds), "--out", str(out),
         *extra],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("setup", ["fedavg", "fedexp_sls", "decsps", "scaffold", "usermodule"])
def test_two_processes_equal_one(tmp_path, setup):
    one = _run(tmp_path, 1, setup)
    two = _run(tmp_path, 2, setup)
    assert one["steps"] == two["steps"] == 3
    torch.testing.assert_close(two["weights"], one["weights"], atol=1e-6, rtol=0)
    # rank 0 holds the per-client state of every client, including those trained by rank 1
    assert two["store_clients"] == one["store_clients"]
    if setup == "usermodule":  # a torchmetrics metric of training_step: reduced over both processes' clients
        assert len(one["round_metrics"]) == 3 and all("client/train_acc" in r for r in one["round_metrics"])
        for a, b in zip(two["round_metrics"], one["round_metrics"]):
            assert a["client/train_acc"] == pytest.approx(b["client/train_acc"], abs=1e-6)
        # the StepLR schedule of configure_optimizers: lr 0.2 * 0.7^r in round r
        assert [r["client/step_size_mean"] for r in two["round_metrics"]] == pytest.approx([0.2, 0.14, 0.098])


def test_two_process_resume_equals_uninterrupted_run(tmp_path):
    """2 processes for 2 rounds, checkpoint, 2 processes resumed to 4 rounds == 1 process for 4 rounds (1e-6), with
    per-client optimizer state (DecSPS counters) that must survive the checkpoint on every rank."""
    ckpt = tmp_path / "mid.ckpt"
    _run(tmp_path, 2, "decsps", rounds=2, extra=("--save-ckpt", str(ckpt)))
    assert ckpt.exists()
    resumed = _run(tmp_path, 2, "decsps", rounds=4, extra=("--ckpt-path", str(ckpt)))
    one = _run(tmp_path, 1, "decsps", rounds=4)
    assert resumed["steps"] == one["steps"] == 4
    torch.testing.assert_close(resumed["weights"], one["weights"], atol=1e-6, rtol=0)
    assert resumed["store_clients"] == one["store_clients"]
