"""Run a few federated rounds with N CPU processes (Lightning DDP, gloo) and save the global weights.

    python tests/scripts/ddp_run.py --devices 2 --setup fedavg --rounds 3 --out weights.pt
    python tests/scripts/ddp_run.py --devices 2 --setup fedavg,scaffold --rounds 3 --out results.pt   # {setup: ...}

Used by tests/test_ddp.py to compare a 2-process run with a 1-process run of the same configuration (``--float64``:
model and data in float64, where the two must agree to rounding), a 2-process
run interrupted after some rounds (``--save-ckpt``) and resumed (``--ckpt-path``) with the uninterrupted one, and a
run in which one rank freezes itself (``--freeze-rank 1 --freeze-round 1 --freeze-file F``: at the start of that
round the rank writes ``<pid> <time.time()>`` to F and sends itself SIGSTOP), and a run one of whose ranks receives
SIGTERM (``--sigterm-rank 1 --sigterm-round 1 --sigterm-times 2 --last-dir D``: it stops, and with ``--last-dir``
RoundCheckpoint saves ``D/last.ckpt``).
"""

import argparse
import functools
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from fedlightning import FederatedLoop  # noqa: E402
from fedlightning.callbacks import FederatedCallback  # noqa: E402
from fedlightning.checkpoint import RoundCheckpoint  # noqa: E402
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet  # noqa: E402
from fedlightning.distributed import release_process_group  # noqa: E402
from fedlightning.models import MLP  # noqa: E402


class UserModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        import torchmetrics

        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.seen = torchmetrics.SumMetric()  # validation and test samples

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.acc(logits, y)
        self.log("train_acc", self.acc)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("my_loss", loss)  # a plain value: its round mean is over both processes' clients
        self.log("my_count", float(len(y)))
        return loss

    def validation_step(self, batch, batch_idx):
        """A count and a torchmetrics sum: every process evaluates the whole split, each sample counted once."""
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage):
        x, y = batch
        self.seen.update(torch.tensor(float(len(y)), device=self.device))
        self.log(f"{stage}/seen", self.seen, on_epoch=True)  # a Metric object: Lightning calls compute()
        self.log(f"{stage}/loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


class AurocModule(UserModule):
    """A metric with list states (AUROC keeps every score and target) logged in training_step."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.auroc = torchmetrics.classification.MulticlassAUROC(num_classes=10, thresholds=None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.auroc.update(logits.softmax(-1), y)
        self.log("auroc", self.auroc)
        return torch.nn.functional.cross_entropy(logits, y)


class Digits64(DigitsDataModule):
    """The digits with float64 inputs."""

    def load(self):
        train, test, labels = super().load()
        return ArrayDataset(train.x.double(), train.y), ArrayDataset(test.x.double(), test.y), labels


class RoundMetrics(pl.Callback):
    def __init__(self):
        self.rounds = []
        self.validations = 0

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        kept = ("client/", "feddane/gradient_clients", "round/failed_clients")
        self.rounds.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(kept)})


class HookLog(FederatedCallback):
    """Logs each client's update norm from ``on_client_end``, which runs on the process that trained the client
    (``sync_dist=True``: with 5 clients over 2 processes the ranks call the hook 3 and 2 times)."""

    def on_client_end(self, trainer, pl_module, plan, update):
        pl_module.log("hook_norm", float(update.delta.norm()), sync_dist=True)
        pl_module.log("hook_samples", float(update.num_samples), reduce_fx="sum")


class NaNOnRows(MLP):
    """Every loss of a batch that holds one of the rows ``bad`` is NaN (the rows of faulty clients)."""

    def __init__(self, bad, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def training_step(self, batch, batch_idx):
        hit = (batch[0].unsqueeze(-2) == self.bad).all(-1).any()
        return super().training_step(batch, batch_idx) * torch.where(hit, float("nan"), 1.0)


class Freeze(pl.Callback):
    """At the start of round ``round`` on rank ``rank``: record this process's pid and the time, then SIGSTOP."""

    def __init__(self, rank, round, path):
        self.rank, self.round, self.path = rank, round, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.round:
            with open(self.path + ".part", "w") as f:
                f.write(f"{os.getpid()} {time.time()!r}")
            os.replace(self.path + ".part", self.path)
            os.kill(os.getpid(), signal.SIGSTOP)


class Terminate(pl.Callback):
    """At the start of round ``round`` on rank ``rank``: send this process SIGTERM ``times`` times (a job's signal
    and the one a launcher forwards)."""

    def __init__(self, rank, round, times):
        self.rank, self.round, self.times = rank, round, times

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.round:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGTERM)


class _ShiftedClock:
    """``time`` for Lightning's Timer module: ``monotonic`` a day ahead of the real clock."""

    def monotonic(self):
        return time.monotonic() + 86400.0


class TimeUp(pl.Callback):
    """At the start of round ``round`` on rank ``rank``: this process's clock, as the Timer reads it, jumps a day
    ahead, so that its ``max_time`` is up at the end of that round on that process only."""

    def __init__(self, rank, round):
        self.rank, self.round = rank, round

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.round:
            import lightning.pytorch.callbacks.timer as timer_module

            timer_module.time = _ShiftedClock()


def build(setup: str):
    callbacks, opt = [], functools.partial(torch.optim.SGD, lr=0.1)
    if setup == "fedavg":
        from fedlightning.callbacks import FedAvg

        callbacks = [FedAvg(), HookLog()]
    elif setup == "fedexp_sls":
        from fedlightning.callbacks import FedExP
        from fedlightning.optim import SgdArmijo

        callbacks, opt = [FedExP()], functools.partial(SgdArmijo, eta_max=1.0)
    elif setup == "decsps":
        from fedlightning.callbacks import FedAvg
        from fedlightning.optim import DecSPS

        callbacks, opt = [FedAvg(weighting="uniform")], functools.partial(DecSPS, c0=0.5, gamma_max=1.0)
    elif setup == "scaffold":
        from fedlightning.callbacks import Scaffold

        callbacks = [Scaffold()]
    elif setup in ("feddane", "feddane_faulty"):  # the global gradient: every process's share of S_t, all-reduced
        from fedlightning.callbacks import FedDANE

        callbacks = [FedDANE(mu=0.1)]
    elif setup == "usermodule":  # a user's module: its optimizer and LR schedule, a torchmetrics metric
        from fedlightning.callbacks import FedAvg

        callbacks, opt = [FedAvg()], None
    elif setup == "auroc_one_client":  # one client per round: the second process trains none
        from fedlightning.callbacks import FedAvg

        callbacks = [FedAvg()]
    else:
        raise SystemExit(f"unknown setup {setup}")
    return callbacks, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--setup", default="fedavg")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-ckpt", default=None, help="write a checkpoint here at the end (all ranks call save)")
    ap.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    ap.add_argument("--freeze-rank", type=int, default=None, help="this rank stops itself (SIGSTOP)")
    ap.add_argument("--freeze-round", type=int, default=1, help="... at the start of this round")
    ap.add_argument("--freeze-file", default=None, help="... after writing '<pid> <time>' here")
    ap.add_argument("--sigterm-rank", type=int, default=None, help="this rank sends itself SIGTERM ...")
    ap.add_argument("--sigterm-round", type=int, default=1, help="... at the start of this round ...")
    ap.add_argument("--sigterm-times", type=int, default=1, help="... this many times")
    ap.add_argument("--time-up-rank", type=int, default=None, help="max_time is up on this rank only ...")
    ap.add_argument("--time-up-round", type=int, default=1, help="... at the end of this round (max_time 1 hour)")
    ap.add_argument("--validate-every", type=int, default=None, help="validate every this many rounds")
    ap.add_argument("--last-dir", default=None, help="RoundCheckpoint(save_last=True) into this folder")
    ap.add_argument("--float64", action="store_true", help="model and data in float64 (default dtype float64)")
    ap.add_argument("--execution", default="sequential", help="FederatedLoop(client_execution=...)")
    ap.add_argument("--groups", type=int, default=None, help="FederatedLoop(max_parallel_clients=...)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.float64:
        torch.set_default_dtype(torch.float64)
    setups = args.setup.split(",")
    results = {setup: fit(args, setup) for setup in setups}
    if results[setups[-1]] is not None:  # rank 0
        torch.save(results[setups[0]] if len(setups) == 1 else results, args.out)
    release_process_group()  # as train.py: no gloo threads left for the interpreter's finalization
    # the results are written: end without the interpreter's finalization, where a gloo process still aborts now and
    # then ("terminate called without an active exception") after a run that finished, failing the test by its status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _trainer(args, **kwargs) -> pl.Trainer:
    """A quiet CPU Trainer on ``args.devices`` processes (DDP with more than one)."""
    return pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit(args, setup: str):
    """One run of ``setup``; rank 0 returns its results (None elsewhere). Several setups in one invocation run one
    after the other in the same processes (the later Trainers find the processes and the process group there)."""
    pl.seed_everything(0, verbose=False)
    callbacks, opt = build(setup)
    data_cls = Digits64 if args.float64 else DigitsDataModule
    data_args = dict(num_clients=12, batch_size=20, partition=Dirichlet(0.5), seed=0)
    net = UserModule() if setup == "usermodule" else MLP(input_dim=64, hidden=[16])
    if setup == "auroc_one_client":
        net = AurocModule()
    if setup == "feddane_faulty":  # clients 1 and 6: NaN full gradients, left out of g_t on whichever process
        dm = data_cls(**data_args)
        dm.setup("fit")
        bad = torch.cat([dm.train_dataset.x[torch.as_tensor(dm.client_indices[k])] for k in (1, 6)])
        net = NaNOnRows(bad, input_dim=64, hidden=[16])
    loop = FederatedLoop(
        net,
        client_optimizer=opt,
        local_steps=4,
        clients_per_round=1 if setup == "auroc_one_client" else 5,
        seed=1,
        client_execution=args.execution,
        max_parallel_clients=args.groups,
    )
    recorder = RoundMetrics()
    callbacks = callbacks + [recorder]
    if args.freeze_rank is not None:
        callbacks.append(Freeze(args.freeze_rank, args.freeze_round, args.freeze_file))
    if args.sigterm_rank is not None:
        callbacks.append(Terminate(args.sigterm_rank, args.sigterm_round, args.sigterm_times))
    if args.time_up_rank is not None:
        callbacks.append(TimeUp(args.time_up_rank, args.time_up_round))
    if args.last_dir:  # only the save at an exception (no round reaches every_n_train_steps)
        callbacks.append(RoundCheckpoint(dirpath=args.last_dir, save_last=True, save_top_k=0, every_n_train_steps=99))
    dm = data_cls(**data_args)
    validation = {"limit_val_batches": 0}
    if args.validate_every:
        validation = {"limit_val_batches": 1, "val_check_interval": args.validate_every, "num_sanity_val_steps": 0}
    trainer = _trainer(
        args,
        max_steps=args.rounds,
        max_time={"hours": 1} if args.time_up_rank is not None else None,
        enable_checkpointing=bool(args.last_dir),
        callbacks=callbacks,
        **validation,
    )
    stopped = False
    try:
        trainer.fit(loop, datamodule=dm, ckpt_path=args.ckpt_path)
    except SIGTERMException:
        stopped = True
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
    evaluated = {}
    if setup in ("fedavg", "usermodule"):  # the global model's validation and test, in batches of 70 (an odd number)
        dm.eval_batch_size = 70
        evaluator = _trainer(args)
        evaluated = {
            "validate": evaluator.validate(loop, datamodule=dm, verbose=False),
            "test": evaluator.test(loop, datamodule=dm, verbose=False),
        }
    keys = ([sorted(r) for r in recorder.rounds], recorder.validations)  # every process's metric names, validations
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        every_rank_keys = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every_rank_keys, keys)
    else:
        every_rank_keys = [keys]
    if trainer.global_rank != 0:
        return None
    store = loop.client_state.state_dict()
    return {
        "evaluated": evaluated,
        "split_sizes": {"validate": len(dm.val_indices), "test": len(dm.test_dataset)},
        "weights": torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach(),
        "store_clients": {ns: sorted(d) for ns, d in store.items()},
        "steps": trainer.global_step,
        "stopped_by_sigterm": stopped,
        "round_metrics": recorder.rounds,
        "round_metric_names": every_rank_keys,
    }


if __name__ == "__main__":
    main()
