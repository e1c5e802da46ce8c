"""Checkpoint/resume: an interrupted and resumed run equals the uninterrupted run bit for bit (CPU), every checkpoint
read with ``weights_only=True`` (the project's safe reader)."""

import glob
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.checkpoint import AtomicCheckpointIO
from fedlightning.cli import main
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.models import MLP
from registry import CLIENT_OPTIMIZERS, STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(strategy_fn=None, opt=None, client_execution="sequential"):
    pl.seed_everything(0, verbose=False)
    loop = FederatedLoop(
        MLP(input_dim=64, hidden=[16], dropout=0.3),
        client_optimizer=opt,
        local_steps=3,
        clients_per_round=4,
        seed=2,
        client_execution=client_execution,
    )
    dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
    return loop, dm, ([strategy_fn()] if strategy_fn else [])


def _weights(loop):
    return torch.nn.utils.parameters_to_vector(loop.model.parameters()).detach().clone()


def run_resume_equivalence(tmp_path, strategy_fn=None, opt=None, total=6, cut=3, client_execution="sequential"):
    """Uninterrupted `total` rounds vs `cut` rounds (periodic checkpoints) + resume from the round-`cut` checkpoint."""
    loop, dm, cbs = _setup(strategy_fn, opt, client_execution)
    make_trainer(total, callbacks=cbs).fit(loop, datamodule=dm)
    full = _weights(loop)

    ckdir = tmp_path / "ck"
    loop, dm, cbs = _setup(strategy_fn, opt, client_execution)
    ck = ModelCheckpoint(dirpath=str(ckdir), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    make_trainer(
        total,
        callbacks=cbs + [ck],
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(tmp_path),
    ).fit(loop, datamodule=dm)
    torch.testing.assert_close(_weights(loop), full, atol=0, rtol=0)  # checkpointing itself changes nothing
    path = str(ckdir / f"step={cut}.ckpt")
    assert os.path.exists(path), os.listdir(ckdir)

    # fresh process state: the new model's initial weights are overwritten by the checkpoint
    loop, dm, cbs = _setup(strategy_fn, opt, client_execution)
    trainer = make_trainer(total, callbacks=cbs, plugins=[AtomicCheckpointIO()])
    trainer.fit(loop, datamodule=dm, ckpt_path=path, weights_only=True)  # the safe reader: no pickled code
    assert trainer.global_step == total
    return full, _weights(loop), loop


def test_resume_fedavg_bit_identical(tmp_path):
    full, resumed, _ = run_resume_equivalence(tmp_path)
    assert torch.equal(full, resumed)


@pytest.mark.parametrize("opt", [None, "armijo-carry"], ids=["sgd", "armijo-carry"])
def test_resume_vectorized_bit_identical(tmp_path, opt):
    """Vectorised clients: dropout streams derived per round, the layout probe (repeated by the resumed engine)
    outside them, and SgdArmijo's carried per-client step in the checkpointed client state."""
    make = CLIENT_OPTIMIZERS["armijo-last-carry"] if opt else None
    full, resumed, loop = run_resume_equivalence(tmp_path, opt=make, client_execution="vectorized")
    assert loop.vectorized_engine is not None
    assert torch.equal(full, resumed)
    if opt:
        assert len(loop.client_state.state_dict().get("optimizer", {})) > 0  # carried steps were checkpointed


def _fedexpsls():
    return STRATEGIES["fedexp"], CLIENT_OPTIMIZERS["armijo-default"]


def _feddecsps():
    return None, CLIENT_OPTIMIZERS["decsps-gamma1"]


def _scaffold():
    return STRATEGIES["scaffold"], None


def _kdecay_error():
    from fedlightning.callbacks import KDecay

    # K0 = 40 and a one-round window: K_r = ceil(40 F_r / F_0) moves every round, so the resumed run depends on
    # F_0 and the loss window restored from the checkpoint
    return (lambda: KDecay(schedule="error", window=1, k0=40)), None


def _fedadam():
    return STRATEGIES["fedadam"].but(server_lr=0.03), None


@pytest.mark.parametrize(
    "make",
    [_fedexpsls, _feddecsps, _scaffold, _kdecay_error, _fedadam],
    ids=["fedexpsls", "feddecsps", "scaffold", "kdecay_error", "fedadam"],
)
def test_resume_bit_identical_with_stateful_parts(tmp_path, make):
    """Server state (Adam moments, control variates, the K-decay loss window), per-client optimizer state (DecSPS
    counters, last Armijo step) and every RNG come back from the checkpoint: the resumed run equals the
    uninterrupted one bit for bit, and its state is not trivially empty."""
    strategy_fn, opt = make()
    full, resumed, loop = run_resume_equivalence(tmp_path, strategy_fn, opt)
    assert torch.equal(full, resumed)


def test_cli_resume_with_ckpt_path_last(tmp_path):
    base = [
        "--config",
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.val_check_interval",
        "2",
        "--data.init_args.num_clients",
        "20",
        "--model.clients_per_round",
        "4",
        "--model.local_steps",
        "3",
    ]
    full = main(["fit", *base, "--trainer.max_steps", "5"])
    w_full = _weights(full.model)
    # "interrupted" run: a separate save_dir, 3 rounds with a checkpoint every round, then resumed with 'last'
    other = str(tmp_path / "interrupted")
    base2 = [a if a != str(tmp_path) else other for a in base]
    from fedlightning.cli import FederatedCLI

    FederatedCLI.checkpoint_every_n_rounds = 1
    try:
        main(["fit", *base2, "--trainer.max_steps", "3"])
        assert glob.glob(os.path.join(other, "quickstart", "version_0", "checkpoints", "last.ckpt"))
        resumed = main(["fit", *base2, "--trainer.max_steps", "5", "--ckpt_path", "last", "--weights_only", "true"])
    finally:
        FederatedCLI.checkpoint_every_n_rounds = 10
    assert resumed.trainer.global_step == 5
    assert torch.equal(_weights(resumed.model), w_full)


def test_resuming_at_or_past_max_steps_warns_that_no_round_trains(tmp_path):
    """A checkpoint at round 2 resumed with max_steps 2 (or less): Lightning trains nothing; the warning names the
    checkpoint's round and max_steps. The weights are the checkpoint's; a larger max_steps trains on without it."""
    loop, dm, _ = _setup()
    trainer = make_trainer(2, plugins=[AtomicCheckpointIO()])
    trainer.fit(loop, datamodule=dm)
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    at_two = _weights(loop)
    for max_steps in (2, 1):
        loop, dm, _ = _setup()
        again = make_trainer(max_steps, plugins=[AtomicCheckpointIO()])
        with pytest.warns(UserWarning, match=rf"checkpoint is at round 2, at or past trainer.max_steps={max_steps}"):
            again.fit(loop, datamodule=dm, ckpt_path=path, weights_only=True)
        assert again.global_step == 2 and torch.equal(_weights(loop), at_two)
    loop, dm, _ = _setup()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the checkpoint is at round")
        make_trainer(3, plugins=[AtomicCheckpointIO()]).fit(loop, datamodule=dm, ckpt_path=path, weights_only=True)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    loop, dm, cbs = _setup()
    with pytest.raises(ValueError, match="corrupt, truncated or not a checkpoint"):
        make_trainer(2, plugins=[AtomicCheckpointIO()]).fit(loop, datamodule=dm, ckpt_path=str(bad))


def test_checkpoint_without_federated_section_is_rejected(tmp_path):
    loop, dm, cbs = _setup()
    trainer = make_trainer(1, plugins=[AtomicCheckpointIO()])
    trainer.fit(loop, datamodule=dm)
    path = tmp_path / "x.ckpt"
    trainer.save_checkpoint(str(path))
    ck = torch.load(path, weights_only=False)
    del ck["fedlightning"]
    torch.save(ck, path)
    loop, dm, cbs = _setup()
    with pytest.raises(ValueError, match="not written by a FederatedLoop"):
        make_trainer(2, plugins=[AtomicCheckpointIO()]).fit(loop, datamodule=dm, ckpt_path=str(path))


def test_atomic_save_keeps_previous_checkpoint_when_writing_fails(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"a": torch.ones(3)}, path)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"a": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(io.load_checkpoint(path)["a"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_failed_save_names_the_checkpoint_and_keeps_the_previous_one(tmp_path, monkeypatch, where):
    """A full disk during the write, or a folder made read-only before the rename (whose temporary file then cannot
    be removed either): the error is the write's, of its kind (ENOSPC, EACCES), and names the checkpoint being
    written, not the temporary file; the previous file is intact."""
    import errno
    import os

    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"a": torch.ones(3)}, path)
    code = errno.ENOSPC if where == "write" else errno.EACCES

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / ".tmp-x.ckpt"))

    monkeypatch.setattr(torch if where == "write" else os, "save" if where == "write" else "replace", fail)
    if where == "rename":
        monkeypatch.setattr(os, "unlink", fail)
    with pytest.raises(OSError) as info:
        io.save_checkpoint({"a": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert info.value.errno == code and isinstance(info.value, PermissionError) == (where == "rename")
    assert info.value.filename == str(path) and "could not write the checkpoint" in str(info.value)
    assert torch.equal(io.load_checkpoint(path)["a"], torch.ones(3))


class _Steps(pl.Callback):
    """The step each round's metrics go to the loggers at (Lightning's batches-that-stepped count), per round."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from fedlightning._lightning_compat import batches_that_stepped

        self.steps.append((trainer.global_step - 1, batches_that_stepped(trainer)))  # global_step: rounds done


@pytest.mark.parametrize("validate", [False, True], ids=["no validation", "validation every round"])
def test_a_resumed_run_logs_each_round_at_its_own_step(tmp_path, validate):
    """Round r's metrics are logged at step r, in the first run and after resuming from the checkpoint that
    RoundCheckpoint writes when training ends (after the last round's validation): Lightning adds one to its count on
    a restore it takes for a save inside a round, which would shift every later round's metrics by one step."""
    from fedlightning.checkpoint import RoundCheckpoint

    val = {"limit_val_batches": None, "val_check_interval": 1, "num_sanity_val_steps": 0} if validate else {}
    loop, dm, _ = _setup()
    ck = RoundCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=10)
    first = _Steps()
    make_trainer(3, callbacks=[ck, first], enable_checkpointing=True, **val).fit(loop, datamodule=dm)
    loop, dm, _ = _setup()
    resumed = _Steps()
    make_trainer(5, callbacks=[resumed], **val).fit(loop, datamodule=dm, ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.steps == [(0, 0), (1, 1), (2, 2)]
    assert resumed.steps == [(3, 3), (4, 4)]


def test_a_float64_run_resumes_bit_for_bit(tmp_path):
    """``precision="64-true"``: the float64 checkpoint is loaded into the float64 model (the precision plugin converts
    the modules before the weights are loaded, not after), so the resumed run equals the uninterrupted one; loading
    into the float32 parameters the module is built with would round the weights to float32 first."""
    loop, dm, _ = _setup()
    make_trainer(4, precision="64-true").fit(loop, datamodule=dm)
    full = _weights(loop)
    assert full.dtype == torch.float64
    loop, dm, _ = _setup()
    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(2, precision="64-true", callbacks=[ck], enable_checkpointing=True).fit(loop, datamodule=dm)
    loop, dm, _ = _setup()
    make_trainer(4, precision="64-true").fit(loop, datamodule=dm, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert torch.equal(_weights(loop), full)


@pytest.mark.parametrize(
    "validation, total, cut, rounds",
    [
        ({}, 6, 2, [6]),  # Lightning's default: once per epoch, the epoch being the run's max_steps rounds
        ({"val_check_interval": 0.5}, 6, 2, [3, 6]),
        ({"val_check_interval": 0.25}, 8, 3, [4, 6, 8]),  # round 2's validation came before the cut
    ],
)
def test_validations_tied_to_the_epoch_fall_at_the_same_rounds_after_a_resume(tmp_path, validation, total, cut, rounds):
    """The epoch of rounds keeps its length from its first round after a mid-epoch resume: the validations after the
    resume fall where the uninterrupted run has them (they once moved: the resumed epoch ended early and a second
    epoch began; a ReduceLROnPlateau on a validation metric then stepped at other rounds), and the weights are
    equal."""

    class Seen(pl.Callback):
        def __init__(self):
            self.rounds = []

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.rounds.append(trainer.global_step)

    def setup():
        pl.seed_everything(0, verbose=False)
        loop = FederatedLoop(MLP(input_dim=64, hidden=[16]), local_steps=3, clients_per_round=4, seed=2)
        dm = DigitsDataModule(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=0)
        return loop, dm

    kw = dict(limit_val_batches=None, num_sanity_val_steps=0, **validation)
    loop, dm = setup()
    full_seen = Seen()
    make_trainer(total, callbacks=[full_seen], **kw).fit(loop, datamodule=dm)
    full = _weights(loop)
    loop, dm = setup()
    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    make_trainer(total, callbacks=[ck], enable_checkpointing=True, plugins=[AtomicCheckpointIO()], **kw).fit(
        loop, datamodule=dm
    )
    loop, dm = setup()
    resumed_seen = Seen()
    make_trainer(total, callbacks=[resumed_seen], plugins=[AtomicCheckpointIO()], **kw).fit(
        loop, datamodule=dm, ckpt_path=str(tmp_path / f"step={cut}.ckpt"), weights_only=True
    )
    assert [r for r in full_seen.rounds if r > cut] == resumed_seen.rounds == rounds
    torch.testing.assert_close(_weights(loop), full, atol=0, rtol=0)


def test_validations_after_resuming_a_run_stopped_at_a_rounds_start_fall_at_the_same_rounds(tmp_path):
    """Ctrl-C at the start of the fourth round leaves RoundCheckpoint's file of three rounds recording the fourth as
    started; the resumed run validates when 4, 6 and 8 rounds are done, as the uninterrupted one does (it validated
    at 5 and 7, one round early, and never after the last round), with equal weights."""
    from fedlightning.checkpoint import RoundCheckpoint

    class Seen(pl.Callback):
        def __init__(self, stop_at=None):
            self.rounds, self.stop_at = [], stop_at

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == self.stop_at:
                raise KeyboardInterrupt

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.rounds.append(trainer.global_step)

    kw = dict(limit_val_batches=None, num_sanity_val_steps=0, val_check_interval=2, check_val_every_n_epoch=None)
    loop, dm, _ = _setup()
    full = Seen()
    make_trainer(8, callbacks=[full], **kw).fit(loop, datamodule=dm)
    expected = _weights(loop)
    assert full.rounds == [2, 4, 6, 8]
    loop, dm, _ = _setup()
    ck = RoundCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=100)
    stopped = Seen(stop_at=3)
    trainer = make_trainer(8, callbacks=[ck, stopped], enable_checkpointing=True, **kw)
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
        trainer.fit(loop, datamodule=dm)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    loop, dm, _ = _setup()
    resumed = Seen()
    make_trainer(8, callbacks=[resumed], **kw).fit(loop, datamodule=dm, ckpt_path=str(tmp_path / "last.ckpt"))
    assert stopped.rounds == [2] and resumed.rounds == [4, 6, 8]
    torch.testing.assert_close(_weights(loop), expected, atol=0, rtol=0)


@pytest.mark.parametrize("every", [100, 3], ids=["saved-after-the-fit", "saved-at-the-last-rounds-end"])
def test_a_finished_run_extended_goes_on_in_its_epoch_as_an_uninterrupted_run_does(tmp_path, every):
    """A fit that ended at max_steps=3, resumed with max_steps=6: Lightning began a new epoch, so the later rounds
    were logged with epoch 1 (an uninterrupted 6-round run logs 0) and checkpoint names read epoch=1-...; now the
    epoch goes on: the same epochs, validations, checkpoint names and weights as the uninterrupted run. Its
    last.ckpt is written after the fit (the epoch ended) or, when a save falls on the last round (the quickstart's
    every 10 rounds with max_steps 10), at that round's end (the epoch's last batch done, the epoch not ended)."""
    from fedlightning.checkpoint import RoundCheckpoint

    class Seen(pl.Callback):
        def __init__(self):
            self.rounds, self.validations = [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rounds.append((trainer.global_step, trainer.current_epoch))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self.validations.append(trainer.global_step)

    def saves(path):
        return ModelCheckpoint(dirpath=str(path), every_n_train_steps=2, save_top_k=-1, filename="{epoch}-{step}")

    kw = dict(limit_val_batches=None, num_sanity_val_steps=0, val_check_interval=2, check_val_every_n_epoch=None)
    loop, dm, _ = _setup()
    full = Seen()
    make_trainer(6, callbacks=[full, saves(tmp_path / "full")], enable_checkpointing=True, **kw).fit(
        loop, datamodule=dm
    )
    expected = _weights(loop)
    loop, dm, _ = _setup()
    first = Seen()
    ck = RoundCheckpoint(dirpath=str(tmp_path / "cut"), save_last=True, every_n_train_steps=every)
    make_trainer(3, callbacks=[first, ck], enable_checkpointing=True, **kw).fit(loop, datamodule=dm)
    loop, dm, _ = _setup()
    resumed = Seen()
    trainer = make_trainer(6, callbacks=[resumed, saves(tmp_path / "resumed")], enable_checkpointing=True, **kw)
    trainer.fit(loop, datamodule=dm, ckpt_path=str(tmp_path / "cut" / "last.ckpt"))
    assert first.rounds + resumed.rounds == full.rounds == [(r, 0) for r in range(1, 7)]
    assert first.validations + resumed.validations == full.validations == [2, 4, 6]
    names = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == names[1:]
    torch.testing.assert_close(_weights(loop), expected, atol=0, rtol=0)


class _WarmUpPenalty(pl.LightningModule):
    """A logit penalty in round 0 only: loss interception refuses that round's loss, and padded steps move to the
    per-sample path for the rest of the engine's life."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x.double())
        loss = torch.nn.functional.cross_entropy(logits, y)
        if self.global_step == 0:
            loss = loss + 1e-3 * logits.pow(2).mean()
        return loss


def _warm_up_fit(tmp_path, rounds, ckpt_path=None):
    loop = FederatedLoop(_WarmUpPenalty(), client_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=3,
                         clients_per_round=4, seed=0, client_execution="vectorized")  # fmt: skip
    ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = make_trainer(rounds, callbacks=[ck], enable_checkpointing=True)
    dm = DigitsDataModule(num_clients=20, batch_size=32, partition=Dirichlet(0.3), seed=3)
    trainer.fit(loop, datamodule=dm, ckpt_path=ckpt_path)
    return loop


def test_a_vectorized_run_resumes_on_the_padded_path_it_had_moved_to(tmp_path):
    """The resumed engine chose loss interception again (it never saw round 0's penalty), where the uninterrupted run
    had moved to the per-sample path: 2.8e-17 apart in float64. The checkpoint records the path now."""
    full = _warm_up_fit(tmp_path / "full", 4)
    assert full.vectorized_engine.padded_path_state is not None  # the case under test: the path moved
    resumed = _warm_up_fit(tmp_path / "cut", 4, ckpt_path=str(tmp_path / "full" / "step=2.ckpt"))
    assert resumed.vectorized_engine.padded_path_state == {
        "per_sample": "as before the resume: " + full.vectorized_engine.padded_path_state["per_sample"]
    }
    assert torch.equal(_weights(resumed), _weights(full))


# ====================================================================== a run max_time stopped, resumed
class _Clock:
    """Lightning's Timer reads ``time.monotonic``; this one advances by one unit at every round's start, so
    ``max_time`` of n units stops the fit at the end of round n - 1 (0-based) on any machine."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


class _Tick(pl.Callback):
    def __init__(self, clock):
        self.clock = clock

    def on_train_batch_start(self, *args):
        self.clock.now += 1.0


class _Validations(pl.Callback):
    def __init__(self):
        self.rounds = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.rounds.append(int(trainer.global_step))


def _early_stopped_fit(folder, max_steps, clock=None, max_time=None, ckpt_path=None):
    from lightning.pytorch.callbacks import EarlyStopping

    from fedlightning.checkpoint import RoundCheckpoint

    torch.manual_seed(0)
    module = MLP(input_dim=64, num_classes=10, hidden=[8])
    seen = _Validations()
    stop = EarlyStopping(monitor="val/loss", patience=2, min_delta=0.05)
    callbacks = [seen, stop, RoundCheckpoint(dirpath=str(folder), save_last=True)]
    if clock is not None:
        callbacks.append(_Tick(clock))
    trainer = make_trainer(
        max_steps,
        callbacks=callbacks,
        enable_checkpointing=True,
        limit_val_batches=1,
        val_check_interval=3,
        num_sanity_val_steps=0,
        max_time=max_time,
    )
    loop = FederatedLoop(module, local_steps=2, clients_per_round=2, seed=0)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=10, batch_size=16, seed=0), ckpt_path=ckpt_path)
    return trainer, module, seen.rounds


def test_a_run_max_time_stopped_resumes_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """Lightning validates whenever a stop is requested, so a run that max_time stopped after round 4 validated there
    although validation is every 3 rounds, and EarlyStopping counted that validation: the run resumed from its last
    round stopped earlier than the uninterrupted one, with other weights. The timed stop now skips a validation
    that was not due (and one that was due still runs), and the resumed run validates, stops and ends as the
    uninterrupted run does."""
    import lightning.pytorch.callbacks.timer as timer_module

    full, full_module, full_rounds = _early_stopped_fit(tmp_path / "full", 40)
    assert full_rounds[:2] == [3, 6] and 6 < full.global_step < 40  # EarlyStopping ended it, after round 6
    for stop_after, validated in ((4, [3]), (6, [3, 6])):  # not due after round 4; due after round 6
        clock = _Clock()
        monkeypatch.setattr(timer_module, "time", clock)
        folder = tmp_path / f"timed{stop_after}"
        timed, _, rounds = _early_stopped_fit(folder, 40, clock=clock, max_time={"seconds": stop_after})
        assert timed.global_step == stop_after and rounds == validated
        monkeypatch.undo()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed, module, rest = _early_stopped_fit(folder, 40, ckpt_path=str(folder / "last.ckpt"))
        assert not [w for w in caught if "before that round's validation" in str(w.message)]
        assert rest == [r for r in full_rounds if r > stop_after]
        assert resumed.global_step == full.global_step
        assert resumed.current_epoch == full.current_epoch  # the stopped epoch goes on: not a new one
        for p, q in zip(module.parameters(), full_module.parameters()):
            torch.testing.assert_close(p, q, atol=0, rtol=0)


# ====================================================================== a buffer registered with persistent=False
class _Tempered(pl.LightningModule):
    """A temperature that training raises, registered with ``persistent=False`` (so not in ``state_dict``)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
        self.register_buffer("temp", torch.tensor(1.0), persistent=False)
        self.register_buffer("ids", torch.arange(4), persistent=False)  # a constant: not saved

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.temp = self.temp + 0.1
        return torch.nn.functional.cross_entropy(self.net(x) / self.temp, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tempered_fit(folder, max_steps, ckpt_path=None):
    from fedlightning.checkpoint import RoundCheckpoint

    torch.manual_seed(0)
    model = _Tempered()
    loop = FederatedLoop(model, local_steps=3, clients_per_round=3, seed=2)
    trainer = make_trainer(max_steps, [RoundCheckpoint(dirpath=str(folder), save_last=True)], enable_checkpointing=True)
    trainer.fit(loop, datamodule=DigitsDataModule(num_clients=6, batch_size=16, seed=1), ckpt_path=ckpt_path)
    return model


def test_a_buffer_training_writes_with_persistent_false_resumes(tmp_path):
    """The aggregation averages every buffer, a non-persistent one too, but Lightning's checkpoint (``state_dict``)
    leaves it out: the resumed run restarted the temperature at 1.0 (1.6 against 2.2 after 4 rounds of 3 steps) and
    its weights left the uninterrupted run's. The loop saves such floating-point buffers itself; integer ones
    (constants) are not saved."""
    from fedlightning.checkpoint import read_checkpoint

    full = _tempered_fit(tmp_path / "full", 4)
    assert float(full.temp) == pytest.approx(1.0 + 4 * 3 * 0.1)
    _tempered_fit(tmp_path / "cut", 2)
    assert set(read_checkpoint(str(tmp_path / "cut" / "last.ckpt"))["fedlightning"]["non_persistent_buffers"]) == {
        "temp"
    }
    resumed = _tempered_fit(tmp_path / "cut", 4, ckpt_path=str(tmp_path / "cut" / "last.ckpt"))
    assert torch.equal(resumed.temp, full.temp)
    for p, q in zip(resumed.parameters(), full.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_load_global_model_and_init_weights_put_non_persistent_buffers_back(tmp_path):
    """``load_global_model`` (evaluating a trained model) and ``init_weights`` (starting a run from another's
    model) read the same checkpoint as a resume: the temperature training wrote must come back with the weights,
    not stay at the fresh module's 1.0."""
    from fedlightning.checkpoint import load_global_model

    trained = _tempered_fit(tmp_path / "run", 2)
    assert float(trained.temp) == pytest.approx(1.0 + 2 * 3 * 0.1)
    loaded = load_global_model(tmp_path / "run" / "last.ckpt", _Tempered())
    assert torch.equal(loaded.temp, trained.temp)
    assert torch.equal(loaded.ids, torch.arange(4))  # an integer constant keeps its __init__ value
    for p, q in zip(loaded.parameters(), trained.parameters()):
        assert torch.equal(p, q)

    torch.manual_seed(0)
    started = _Tempered()
    loop = FederatedLoop(
        started, local_steps=3, clients_per_round=3, seed=2, init_weights=str(tmp_path / "run" / "last.ckpt")
    )
    make_trainer(1, []).fit(loop, datamodule=DigitsDataModule(num_clients=6, batch_size=16, seed=1))
    assert float(started.temp) == pytest.approx(float(trained.temp) + 3 * 0.1)  # one round of 3 steps on top
