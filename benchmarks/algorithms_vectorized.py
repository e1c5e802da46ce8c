"""Every algorithm of configs/ with vectorized and with sequential clients: rounds per second, in one run.

    python benchmarks/algorithms_vectorized.py [--rounds 10] [--repeats 3] [--threads 1] [--algorithms FedAvg,...]
    python benchmarks/algorithms_vectorized.py --smoke      # 3 rounds, 1 repeat: every algorithm builds and runs

The workload is the same for every algorithm (issue 34's): scikit-learn digits, 100 clients from a Dirichlet(0.3)
label split, 20 clients per round, K = 20 local steps of batch 50, the MLP 64-128-10 written as a user writes it
(``user_models.UserMLP``: a plain ``LightningModule``). From each algorithm's config the script takes only what
makes the algorithm: its callbacks (strategy, client objective, ...) and its client optimizer, built from the
configs' ``class_path`` / ``init_args``, and loop arguments other than the round shape (``persist_client_state``).
Exception: DSGD is FedAvg with K = 1 (configs/dsgd.yaml), so it keeps its ``local_steps``. The algorithms are those
of the top-level configs (the K-decay schedules included, which change K from round to round) and the baselines of
seed 001 that only configs/fedsps/ holds (Local AMSGrad, Local AdaAlter, MimeLite, Mime: their digits CPU configs);
the other configs in configs/*/ run these algorithms on other data and models.

For every algorithm the two modes train the same model from the same initial weights on the same clients and
batches, ``--repeats`` times; the first two rounds of each run are warm-up, and the time of a round is the wall time
(``--clock process``: CPU time) of the loop's ``training_step`` (clients, aggregation and server step, as a Trainer
runs it). ``--schedule rounds`` (the default) runs the modes' fits side by side in threads that take turns round by
round (one thread runs at any time: the vectorized run's round 1, the sequential run's round 1, ..., setup and
teardown included in the turns), so that every mode's round k is measured within about a second of the others' and
a machine whose speed drifts over seconds (a shared VM) slows all modes alike; with ``--clock process`` a round's
time is then its thread's CPU time. ``--schedule runs`` alternates whole runs (vectorized, sequential, vectorized,
...). The rounds of every run are the same either way (each round's clients, batches and random streams derive
from the seed and the round, not from what ran before). Printed per algorithm:
rounds/s of each mode (the inverse of the median round time over all repeats), vectorized / sequential,
vectorized / FedAvg's vectorized rounds/s (a FedAvg vectorized run alternates with the two modes of every
algorithm, so that both rates come from the same minutes), and the largest difference between the two
modes' global weights after the last repeat (float32; a line search or clipping decides discretely, so rounding
can grow there). An algorithm that cannot run vectorized prints the reason instead.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import sys
import threading
import time

import lightning.pytorch as pl
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vectorized_speedup as vs  # noqa: E402
from fedlightning import FederatedLoop  # noqa: E402
from fedlightning.vectorized import VectorizationUnsupportedError  # noqa: E402
from user_models import UserMLP  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

#: name -> (config file, loop arguments kept from the config besides the callbacks and the client optimizer)
ALGORITHMS = {
    "FedAvg": ("quickstart.yaml", ()),
    "FedProx": ("fedprox.yaml", ()),
    "SCAFFOLD": ("scaffold.yaml", ()),
    "FedExP": ("fedexp.yaml", ()),
    "FedExProx": ("fedexprox.yaml", ()),
    "FedDANE": ("feddane.yaml", ()),
    "FedSLS": ("fedsls.yaml", ()),
    "FedExpSLS": ("fedexpsls.yaml", ()),
    "FedAdam": ("fedadam.yaml", ()),
    "FedYogi": ("fedyogi.yaml", ()),
    "FedAdagrad": ("fedadagrad.yaml", ()),
    "FedAMS": ("fedams.yaml", ()),
    "FedAvgM": ("fedavgm.yaml", ()),
    "FedSPS": ("fedsps.yaml", ()),
    "FedSPS-Global": ("fedsps_global.yaml", ()),
    "FedSPS-Norm": ("fedsps_normalized.yaml", ()),
    "FedDecSPS": ("feddecsps.yaml", ("persist_client_state",)),
    "FedLiLS": ("fedlils.yaml", ()),
    "FedLiLU": ("fedlilu.yaml", ()),
    "DSGD": ("dsgd.yaml", ("local_steps",)),
    "DPFedAvg": ("dpfedavg.yaml", ()),
    "KDecay-step": ("kdecay_step.yaml", ()),
    "KDecay-rounds": ("kdecay_rounds.yaml", ()),
    "KDecay-error": ("kdecay_error.yaml", ()),
    "LocalAMSGrad": ("fedsps/digits_local_amsgrad_cpu.yaml", ()),
    "LocalAdaAlter": ("fedsps/digits_local_adaalter_cpu.yaml", ()),
    "MimeLite": ("fedsps/digits_mimelite_cpu.yaml", ()),
    "Mime": ("fedsps/digits_mime_cpu.yaml", ()),
}


def _build(spec: dict):
    """The class named by ``spec["class_path"]`` and its ``init_args``."""
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name), dict(spec.get("init_args") or {})


def algorithm_parts(config: str, kept: tuple[str, ...]):
    """``(callbacks factory, client optimizer factory, loop arguments)`` of one config file."""
    with open(os.path.join(CONFIGS, config)) as f:
        cfg = yaml.safe_load(f)
    specs = [_build(c) for c in (cfg.get("trainer", {}).get("callbacks") or [])]
    model_cfg = cfg["model"]
    opt_cls, opt_args = _build(model_cfg["client_optimizer"])
    loop_args = {k: model_cfg[k] for k in kept if k in model_cfg}

    def callbacks():
        return [cls(**copy.deepcopy(args)) for cls, args in specs]

    def optimizer(params):
        return opt_cls(params, **opt_args)

    return callbacks, optimizer, loop_args


class _Turns:
    """Threads that take turns: one holds the turn at a time, and hands it to the next active thread in a fixed
    cycle (``--schedule rounds``)."""

    def __init__(self, names):
        self.active = list(names)
        self.current = self.active[0]
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.current == name)

    def hand_on(self, name: str, leave: bool = False) -> None:
        with self.cond:
            i = self.active.index(name)
            if leave:
                self.active.remove(name)
            if self.current == name and self.active:
                self.current = self.active[(i if leave else i + 1) % len(self.active)]
            self.cond.notify_all()


class _TurnTimer(pl.Callback):
    """A round's CPU time of this thread (``--clock process``) or its wall time, taken within the thread's turns:
    each round waits for the turn and hands it on, except the last, whose thread keeps it through teardown."""

    def __init__(self, turns: _Turns, name: str, rounds: int, clock):
        self.turns, self.name, self.rounds, self.clock = turns, name, rounds, clock
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.turns.wait(self.name)
        self._start = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(self.clock() - self._start)
        if len(self.times) < self.rounds:
            self.turns.hand_on(self.name)


def run_side_by_side(runs: dict, datamodules: dict, rounds: int, init_state: dict, clock) -> dict:
    """The fits of ``runs`` (name -> (parts, mode)) in threads taking turns round by round (``--schedule rounds``):
    name -> (round times after 2 warm-up rounds, final global weights). A fit that raises leaves the others running
    and is re-raised afterwards."""
    turns = _Turns(list(runs))
    out, errors = {}, {}

    def fit(name):
        parts, mode = runs[name]
        try:
            turns.wait(name)  # setup in turn as well: one thread runs at any time
            timer = _TurnTimer(turns, name, rounds, clock)
            out[name] = run(parts, datamodules[name], mode, rounds, init_state, timer)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            errors[name] = err
        finally:
            turns.hand_on(name, leave=True)

    threads = [threading.Thread(target=fit, args=(name,), name=f"fit {name}") for name in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for err in errors.values():
        raise err
    return out


def run(
    parts,
    datamodule,
    mode: str,
    rounds: int,
    init_state: dict,
    timer: pl.Callback | None = None,
    model_fn=UserMLP,
):
    """One run of ``rounds`` rounds: ``(round times after 2 warm-up rounds, final global weights)``; ``timer``
    (default :class:`vectorized_speedup.RoundTimer`) has the round times in ``times``; ``model_fn`` builds the
    model (default :class:`user_models.UserMLP`)."""
    callbacks, optimizer, loop_args = parts
    model = model_fn()
    model.load_state_dict(init_state)
    args = {"local_steps": vs.LOCAL_STEPS, "clients_per_round": vs.CLIENTS_PER_ROUND, **loop_args}
    loop = FederatedLoop(model, client_optimizer=optimizer, seed=0, client_execution=mode, **args)
    timer = timer if timer is not None else vs.RoundTimer()
    trainer = pl.Trainer(
        max_steps=rounds,
        accelerator=vs.ACCELERATOR,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*callbacks(), timer],
    )
    trainer.fit(loop, datamodule=datamodule)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return timer.times[2:], weights


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds per run (the first 2 are warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per mode")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset of the table")
    ap.add_argument("--smoke", action="store_true", help="3 rounds, 1 repeat: check that everything runs")
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="time rounds by wall clock (default) or by this process's CPU time (CPU runs only: less disturbed by "
        "other processes on a shared machine)",
    )
    ap.add_argument(
        "--schedule",
        choices=("rounds", "runs"),
        default="rounds",
        help="the modes take turns round by round, in threads (default), or run by run",
    )
    ap.add_argument(
        "--init-seed",
        type=int,
        default=0,
        help="torch seed of the model's initial weights (default 0; other seeds give other trajectories, e.g. to "
        "compare max |dw| over several)",
    )
    vs.add_common_arguments(ap)
    args = ap.parse_args()
    if args.clock == "process":
        if args.accelerator != "cpu":
            raise SystemExit("--clock process: CPU runs only (GPU work is not the process's CPU time)")
        vs._clock = time.process_time  # RoundTimer's clock
    if args.smoke:
        args.rounds, args.repeats = 3, 1
    names = vs.start(args, args.algorithms, ALGORITHMS, "algorithms", min_rounds=3)
    # side by side, each fit has its own data module (a fit keeps its round's loaders on it); run by run, one serves
    modes = ("vectorized", "sequential", "FedAvg vectorized") if args.schedule == "rounds" else ("runs",)
    datamodules = {mode: vs.digits() for mode in modes}
    for dm in datamodules.values():
        dm.setup("fit")
    datamodule = datamodules[modes[0]]
    thread_clock = time.thread_time if args.clock == "process" else vs._clock
    torch.manual_seed(args.init_seed)
    init_state = UserMLP().state_dict()
    print(f"clock: {args.clock} time; schedule: {args.schedule}")
    print(
        f"{'algorithm':14s} {'vectorized r/s':>15s} {'sequential r/s':>15s} {'vec/seq':>8s} "
        f"{'vec/FedAvg-vec':>15s} {'max |dw|':>9s}"
    )
    fedavg = algorithm_parts(*ALGORITHMS["FedAvg"])
    for name in names:
        parts = algorithm_parts(*ALGORITHMS[name])
        # FedAvg vectorized, the reference of the vec/FedAvg-vec column, alternates with the two modes
        runs = {"vectorized": parts, "sequential": parts, "FedAvg vectorized": fedavg}
        if name == "FedAvg":
            del runs["FedAvg vectorized"]
        times = {mode: [] for mode in runs}
        weights = {}
        try:
            for _ in range(args.repeats):
                if args.schedule == "rounds":
                    named = {mode: (mode_parts, mode.split()[-1]) for mode, mode_parts in runs.items()}
                    done = run_side_by_side(named, datamodules, args.rounds, init_state, thread_clock)
                    for mode, (t, weights[mode]) in done.items():
                        times[mode].extend(t)
                    continue
                for mode, mode_parts in runs.items():
                    t, weights[mode] = run(mode_parts, datamodule, mode.split()[-1], args.rounds, init_state)
                    times[mode].extend(t)
        except VectorizationUnsupportedError as err:  # an algorithm that trains sequentially only: its reason
            print(f"{name:14s} sequential only: {str(err).splitlines()[0][:150]}", flush=True)
            continue
        except Exception as err:  # noqa: BLE001 - one algorithm's failure is a line of the table
            print(f"{name:14s} failed: {type(err).__name__}: {str(err).splitlines()[0][:150]}", flush=True)
            continue
        rate = {m: 1.0 / statistics.median(t) for m, t in times.items()}
        reference = rate.get("FedAvg vectorized", rate["vectorized"])
        diff = float((weights["vectorized"] - weights["sequential"]).abs().max())
        print(
            f"{name:14s} {rate['vectorized']:15.1f} {rate['sequential']:15.1f} "
            f"{rate['vectorized'] / rate['sequential']:7.2f}x {rate['vectorized'] / reference:15.2f} {diff:9.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
