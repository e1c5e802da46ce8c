"""benchmarks/algorithms_vectorized.py ``--schedule rounds``: fits in threads take turns round by round."""

import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import algorithms_vectorized as av  # noqa: E402


def _fit(turns, name, rounds, log, fail_after=None):
    """The protocol of run_side_by_side and _TurnTimer with the fit replaced by a log of its rounds."""
    try:
        turns.wait(name)
        log.append((name, "setup"))
        for k in range(1, rounds + 1):
            turns.wait(name)
            log.append((name, k))
            if fail_after == k:
                raise RuntimeError("a fit that fails")
            if k < rounds:
                turns.hand_on(name)
        log.append((name, "teardown"))
    except RuntimeError:
        log.append((name, "failed"))
    finally:
        turns.hand_on(name, leave=True)


def test_turns_run_one_round_of_each_fit_at_a_time_in_a_fixed_cycle():
    log = []
    turns = av._Turns(["vec", "seq", "ref"])
    fails = {"ref": 2}
    threads = [
        threading.Thread(target=_fit, args=(turns, name, 3, log, fails.get(name))) for name in ("ref", "seq", "vec")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert log == [
        ("vec", "setup"),
        ("vec", 1),
        ("seq", "setup"),
        ("seq", 1),
        ("ref", "setup"),
        ("ref", 1),
        ("vec", 2),
        ("seq", 2),
        ("ref", 2),
        ("ref", "failed"),  # its turn passes on; the others go on in their cycle
        ("vec", 3),
        ("vec", "teardown"),  # the last round keeps the turn through teardown
        ("seq", 3),
        ("seq", "teardown"),
    ]


def test_fits_side_by_side_train_as_they_do_alone():
    """Two Lightning fits in turns (vectorized and sequential FedAvg, 3 rounds) end with the weights each ends with
    when run alone, bit for bit: nothing of one fit leaks into the other."""
    import torch

    parts = av.algorithm_parts(*av.ALGORITHMS["FedAvg"])
    torch.manual_seed(0)
    init = av.UserMLP().state_dict()

    def data():
        dm = av.vs.digits()
        dm.setup("fit")
        return dm

    runs = {"vectorized": (parts, "vectorized"), "sequential": (parts, "sequential")}
    together = av.run_side_by_side(runs, {m: data() for m in runs}, 3, init, av.time.thread_time)
    for mode in runs:
        times, weights = together[mode]
        assert len(times) == 1  # 3 rounds, the first 2 warm-up
        alone = av.run(parts, data(), mode, 3, init)[1]
        assert torch.equal(weights, alone), mode
