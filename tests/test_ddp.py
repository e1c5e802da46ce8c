"""A 2-process CPU run (Lightning DDP, gloo) equals the 1-process run: clients are sharded, statistics all-reduced."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_run.py")


def _run(tmp_path, devices, setup, rounds=3):
    out = tmp_path / f"{setup}_{devices}.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--devices", str(devices), "--setup", setup, "--rounds", str(rounds), "--out", str(out)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("setup", ["fedavg", "fedexp_sls", "decsps", "scaffold"])
def test_two_processes_equal_one(tmp_path, setup):
    if setup != "fedavg":
        pytest.importorskip("fedlightning.optim" if setup != "scaffold" else "fedlightning.callbacks")
        try:
            sys.path.insert(0, os.path.dirname(SCRIPT))
            from ddp_run import build

            build(setup)
        except (ImportError, AttributeError) as err:
            pytest.skip(f"{setup} not available: {err}")
    one = _run(tmp_path, 1, setup)
    two = _run(tmp_path, 2, setup)
    assert one["steps"] == two["steps"] == 3
    torch.testing.assert_close(two["weights"], one["weights"], atol=1e-6, rtol=0)
    # rank 0 holds the per-client state of every client, including those trained by rank 1
    assert two["store_clients"] == one["store_clients"]
