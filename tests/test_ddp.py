"""Lightning DDP with CPU processes (gloo): a 2-process run equals the 1-process run (clients are sharded,
statistics all-reduced), a resumed 2-process run equals the uninterrupted one, and a process that freezes makes the
other exit within the collective timeout with an error naming the collective, round and rank.

The 2-process and 1-process runs sum the clients' updates in different orders, so they are compared in float64
(``--float64``) to numerics.RTOL64.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from numerics import assert_close64, rtol32

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_run.py")


def _run(tmp_path, devices, setup, rounds=3, extra=()):
    out = tmp_path / f"{setup}_{devices}_{rounds}.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--devices",
            str(devices),
            "--setup",
            setup,
            "--rounds",
            str(rounds),
            "--out",
            str(out),
            *extra,
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


SETUPS = ["fedavg", "fedexp_sls", "decsps", "scaffold", "feddane", "feddane_faulty", "usermodule", "auroc_one_client"]


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    """Every setup of SETUPS in one 1-process and one 2-process invocation (float64), run one after the other in the
    same processes: ``{devices: {setup: results}}`` (a process start costs more than the setup's 3 rounds)."""
    tmp = tmp_path_factory.mktemp("ddp_setups")
    return {devices: _run(tmp, devices, ",".join(SETUPS), extra=("--float64",)) for devices in (1, 2)}


@pytest.mark.parametrize("setup", SETUPS)
def test_two_processes_equal_one(one_and_two, setup):
    one, two = one_and_two[1][setup], one_and_two[2][setup]
    assert one["steps"] == two["steps"] == 3
    assert_close64(two["weights"], one["weights"])
    # rank 0 holds the per-client state of every client, including those trained by rank 1
    assert two["store_clients"] == one["store_clients"]
    if setup == "fedavg":  # pl_module.log in on_client_end: one value per client, reduced over both processes
        for a, b in zip(two["round_metrics"], one["round_metrics"], strict=True):
            assert a["client/hook_norm"] == pytest.approx(b["client/hook_norm"], rel=rtol32(3))
            assert a["client/hook_samples"] == b["client/hook_samples"]
    if setup == "fedavg":  # every process evaluates the whole split: the global model's metrics of one process
        assert one["evaluated"].keys() == {"validate", "test"} and one["evaluated"]["validate"][0]
        for stage in ("validate", "test"):
            (a,), (b,) = two["evaluated"][stage], one["evaluated"][stage]
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-12), (stage, key)
    if setup == "usermodule":  # a torchmetrics sum in validation_step / test_step: each sample counted once
        for stage in ("validate", "test"):
            (a,), (b,) = two["evaluated"][stage], one["evaluated"][stage]
            key = "val" if stage == "validate" else "test"
            assert a[f"{key}/seen"] == b[f"{key}/seen"] == one["split_sizes"][stage]
            assert a[f"{key}/loss"] == pytest.approx(b[f"{key}/loss"], rel=1e-12)
    if setup == "auroc_one_client":  # a metric with list states; one client a round, so one process has none
        assert len(one["round_metrics"]) == 3
        for a, b in zip(two["round_metrics"], one["round_metrics"]):
            assert 0 < a["client/auroc"] == pytest.approx(b["client/auroc"], rel=rtol32(1))
            assert a["client/lr"] == b["client/lr"]
        # the process that trains no client logs the same names (client/lr included): a callback monitoring one
        # runs the same collectives on both
        (rank0, _), (rank1, _) = two["round_metric_names"]
        assert rank0 == rank1 and all("client/lr" in names for names in rank1)
    if setup == "feddane_faulty":  # NaN full gradients left out of g_t by whichever process computed them
        used = [r["feddane/gradient_clients"] for r in one["round_metrics"]]
        assert [r["feddane/gradient_clients"] for r in two["round_metrics"]] == used and min(used) < 5
        failed = [r["round/failed_clients"] for r in one["round_metrics"]]
        assert [r["round/failed_clients"] for r in two["round_metrics"]] == failed
    if setup == "usermodule":  # a torchmetrics metric of training_step: reduced over both processes' clients
        assert len(one["round_metrics"]) == 3 and all("client/train_acc" in r for r in one["round_metrics"])
        for a, b in zip(two["round_metrics"], one["round_metrics"]):
            # ratios of the same integer counts, logged as float32 (one rounding each)
            assert a["client/train_acc"] == pytest.approx(b["client/train_acc"], rel=rtol32(1))
            # plain values logged in training_step: the mean over every client's steps, not process 0's alone
            # (float32 values, their float64 sums in another order; logged as float32)
            assert a["client/my_count"] == pytest.approx(b["client/my_count"], rel=rtol32(1))
            assert a["client/my_loss"] == pytest.approx(b["client/my_loss"], rel=rtol32(3))
        # the StepLR schedule of configure_optimizers: lr 0.2 * 0.7^r in round r
        assert [r["client/step_size_mean"] for r in two["round_metrics"]] == pytest.approx(
            [0.2, 0.14, 0.098], rel=rtol32(1)
        )


def test_two_processes_with_vectorized_client_groups_equal_one_sequential(tmp_path, one_and_two):
    """Each process trains its share of the round's clients vectorized in groups of 2 (max_parallel_clients; the
    shares hold 3 and 2 of the 5 clients): the same weights and client state as one process training sequentially
    (SCAFFOLD: stacked objective terms and per-client control variates)."""
    setup = "scaffold"
    one = one_and_two[1][setup]  # one process, sequential
    two = _run(tmp_path, 2, setup, extra=("--float64", "--execution", "vectorized", "--groups", "2"))
    assert one["steps"] == two["steps"] == 3
    assert_close64(two["weights"], one["weights"])
    assert two["store_clients"] == one["store_clients"]


def test_two_process_resume_equals_uninterrupted_run(tmp_path):
    """2 processes for 2 rounds, checkpoint, 2 processes resumed to 4 rounds == 1 process for 4 rounds (float64,
    numerics.RTOL64), with per-client optimizer state (DecSPS counters) that must survive the checkpoint on every
    rank."""
    ckpt = tmp_path / "mid.ckpt"
    _run(tmp_path, 2, "decsps", rounds=2, extra=("--save-ckpt", str(ckpt), "--float64"))
    assert ckpt.exists()
    resumed = _run(tmp_path, 2, "decsps", rounds=4, extra=("--ckpt-path", str(ckpt), "--float64"))
    one = _run(tmp_path, 1, "decsps", rounds=4, extra=("--float64",))
    assert resumed["steps"] == one["steps"] == 4
    assert_close64(resumed["weights"], one["weights"])
    assert resumed["store_clients"] == one["store_clients"]


def test_sigterm_on_one_process_stops_every_process_at_a_round_boundary_and_the_round_is_resumable(tmp_path):
    """A SIGTERM that reaches one process twice (the job's and the one a launcher forwards), at the start of round
    1: every process finishes that round and stops, RoundCheckpoint saves it as last.ckpt, and the run resumed from
    it with 2 processes equals an uninterrupted 1-process run (float64, numerics.RTOL64). Lightning's own handler
    broadcasts from inside the signal handler, which parts the processes' collectives: the run hung until the
    collective timeout and saved nothing."""
    last = tmp_path / "last"
    extra = ("--float64", "--sigterm-rank", "1", "--sigterm-round", "1", "--sigterm-times", "2")
    stopped = _run(tmp_path, 2, "decsps", rounds=6, extra=(*extra, "--last-dir", str(last)))
    assert stopped["stopped_by_sigterm"] and stopped["steps"] == 2
    saved = torch.load(last / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2
    resumed = _run(tmp_path, 2, "decsps", rounds=4, extra=("--ckpt-path", str(last / "last.ckpt"), "--float64"))
    one = _run(tmp_path, 1, "decsps", rounds=4, extra=("--float64",))
    assert resumed["steps"] == one["steps"] == 4 and not resumed["stopped_by_sigterm"]
    assert_close64(resumed["weights"], one["weights"])
    assert resumed["store_clients"] == one["store_clients"]


def test_a_max_time_stop_skips_the_same_validation_on_every_process(tmp_path):
    """max_time on rank 0's clock (the Timer broadcasts rank 0's decision) is up at the end of round 1, where no
    validation is due (every 3 rounds): every process skips Lightning's validation on the stop, also the one whose
    own clock has time left (deciding by each process's clock would run the validation's collectives on one process
    only), and the run ends after round 1 without a validation."""
    got = _run(
        tmp_path, 2, "fedavg", rounds=6, extra=("--time-up-rank", "0", "--time-up-round", "1", "--validate-every", "3")
    )
    assert got["steps"] == 2
    assert [validations for _, validations in got["round_metric_names"]] == [0, 0]


def test_a_frozen_rank_makes_the_other_exit_within_the_collective_timeout(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at the start of round 1; rank 0 trains its clients, waits in the round's first
    collective for FEDLIGHTNING_COLLECTIVE_TIMEOUT = 10 s and exits non-zero with a CollectiveError naming the
    collective, round 1 and rank 0 (instead of torch's default 30 minutes). The stopped process is killed in any
    case."""
    timeout = 10
    freeze, stderr_path = tmp_path / "frozen", tmp_path / "stderr.txt"
    env = dict(os.environ, PYTHONWARNINGS="ignore", FEDLIGHTNING_COLLECTIVE_TIMEOUT=str(timeout))
    cmd = [
        sys.executable,
        SCRIPT,
        "--devices",
        "2",
        "--rounds",
        "3",
        "--out",
        str(tmp_path / "out.pt"),
        "--freeze-rank",
        "1",
        "--freeze-round",
        "1",
        "--freeze-file",
        str(freeze),
    ]
    # stderr to a file: the stopped rank inherits the launcher's pipes and would hold them open
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        returncode = proc.wait(timeout=240)
        exited = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if freeze.exists():
            os.kill(int(freeze.read_text().split()[0]), signal.SIGKILL)
    stderr = stderr_path.read_text()
    assert freeze.exists(), stderr[-3000:]  # rank 1 did stop
    frozen_at = float(freeze.read_text().split()[1])
    assert returncode != 0
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert (
        "CollectiveError: round 1, rank 0: collective all_gather_object (the keys of the round statistics) did "
        f"not complete within the collective timeout of {timeout} s (FEDLIGHTNING_COLLECTIVE_TIMEOUT)" in last
    ), last
    assert "Timed out" in last  # torch's own message is kept
    # rank 0 waited for the timeout, not for torch's 30 minutes (the rest: raising, Lightning's teardown, exit)
    assert timeout - 2 <= exited - frozen_at <= timeout + 60, exited - frozen_at


def test_the_collective_timeout_setting_is_checked(monkeypatch):
    from datetime import timedelta

    from fedlightning.distributed import COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S, collective_timeout

    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert collective_timeout() == timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S) == timedelta(minutes=5)
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "2.5")
    assert collective_timeout() == timedelta(seconds=2.5)
    for bad in ["0", "-3", "nan", "inf", "ten"]:
        monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, bad)
        with pytest.raises(
            ValueError,
            match=rf"^FEDLIGHTNING_COLLECTIVE_TIMEOUT='{bad}': the collective timeout must "
            r"be a positive number of seconds \(default 300\)$",
        ):
            collective_timeout()


def test_a_collective_made_by_other_code_fails_with_a_collective_error_naming_it(monkeypatch):
    """torchmetrics' sync of a training metric runs inside ``named_collective``: a peer that raised and exited leaves
    this process with a CollectiveError naming the sync, the round and the rank, not gloo's bare message; one
    process makes no collective and the block runs as it is."""
    from datetime import timedelta

    import torch.distributed as dist

    import fedlightning.distributed as distributed

    with distributed.named_collective("a sync", 3):  # one process: nothing to name
        pass
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(distributed, "apply_collective_timeout", lambda: timedelta(seconds=300))
    with pytest.raises(distributed.CollectiveError, match=r"^round 3, rank 1: collective a sync failed after .* s "):
        with distributed.named_collective("a sync", 3):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
