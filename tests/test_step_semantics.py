"""Lightning's step semantics inside client training, each checked against an independent computation.

* ``training_step`` returning ``None`` skips that local step's update (Lightning's automatic-optimisation rule) and
  is no failure; a client whose every step was skipped is healthy with update 0; a round in which every step of every
  client was skipped stops the run (a module that forgot to return its loss).
* The Trainer's precision plugin converts client batches (``64-true``).
* Inside sequential client training ``trainer.optimizers`` / ``lr_scheduler_configs`` are the client's (an Adam +
  cosine client follows the closed-form schedule), the server's everywhere else; ``client/lr`` and
  ``LearningRateMonitor``'s ``lr-SGD`` log the two learning rates under distinct names.
* Round metrics reach the loggers every round unless the user set ``log_every_n_steps``.
"""

import copy
import functools
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import FedAvg
from fedlightning.datamodules import DigitsDataModule, Dirichlet
from fedlightning.optim import SgdArmijo
from numerics import Digits64, assert_close64, flat, to_float64

CPR, K, SEED = 4, 5, 3


class SkipNet(pl.LightningModule):
    """Skips (returns None from) every batch without a sample of class 0 (a user's "nothing to learn here" rule),
    or every batch at all with ``skip_all``; records the ``batch_idx`` of every call with gradients."""

    def __init__(self, lr: float = 0.3, skip_all: bool = False):
        super().__init__()
        self.lr, self.skip_all = lr, skip_all
        self.net = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))
        self.calls = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if torch.is_grad_enabled():
            self.calls.append(batch_idx)
        if self.skip_all or not bool((y == 0).any()):
            return None
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _dm():
    return Digits64(num_clients=6, batch_size=8, partition=Dirichlet(0.1), seed=1)


def _batches(dm, cid, r):
    """The ``K`` batches client ``cid`` trains on in round ``r`` (its loader, restarted when it runs out)."""
    loader = dm.client_dataloader(cid, r, seed=SEED)
    it, out = iter(loader), []
    while len(out) < K:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(loader)
    return out


def _add_weighted_delta(sums, glob, local, n):
    """Add ``n · (w_t − w_i)`` of one client to the reference loops' FedAvg sums; returns its weight ``n``."""
    for s, g, w in zip(sums, glob.parameters(), local.parameters()):
        s += n * (g.detach() - w.detach())
    return n


def _skip_reference(net, dm, rounds, lr, make_opt=None):
    """FedAvg (sample-weighted) of plain-PyTorch clients that take no step on a batch without class 0; with
    ``make_opt`` a closure-based optimizer steps only the batches with class 0. Returns the global weights and the
    number of batches skipped in total."""
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    glob = copy.deepcopy(net)
    skipped = 0
    for r in range(rounds):
        sums = [torch.zeros_like(p) for p in glob.parameters()]
        total = 0.0
        for cid in dm.sample_clients(r):
            local = copy.deepcopy(glob)
            opt = make_opt(local.parameters()) if make_opt else None
            if opt is not None and hasattr(opt, "set_client_data"):
                opt.set_client_data(num_samples=dm.client_num_samples(cid), batch_size=dm.batch_size)
            for x, y in _batches(dm, cid, r):
                if not bool((y == 0).any()):
                    skipped += 1
                    continue
                if opt is None:
                    loss = F.cross_entropy(local(x), y)
                    grads = torch.autograd.grad(loss, list(local.parameters()))
                    with torch.no_grad():
                        for p, g in zip(local.parameters(), grads):
                            p -= lr * g
                else:
                    opt.zero_grad()
                    opt.step(lambda local=local, x=x, y=y: F.cross_entropy(local(x), y))
            total += _add_weighted_delta(sums, glob, local, float(dm.client_num_samples(cid)))
        with torch.no_grad():
            for g, s in zip(glob.parameters(), sums):
                g -= s / total
    return torch.cat([p.detach().reshape(-1) for p in glob.parameters()]), skipped


class _Metrics(pl.Callback):
    def __init__(self):
        self.rounds = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rounds.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(model, rounds=2, callbacks=(), **loop_kw):
    loop = FederatedLoop(model, local_steps=K, clients_per_round=CPR, seed=SEED, **loop_kw)
    rec = _Metrics()
    make_trainer(rounds, callbacks=[FedAvg(), rec, *callbacks]).fit(loop, datamodule=_dm())
    return loop, rec


# ====================================================================== 3a: None skips a step
def test_none_from_training_step_skips_the_update_like_lightning():
    torch.manual_seed(0)
    model = to_float64(SkipNet())
    expected, skipped = _skip_reference(model.net, _dm(), rounds=2, lr=0.3)
    assert 0 < skipped < 2 * CPR * K  # the split makes some batches skip and others train
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no client is reported skipped / failed
        loop, rec = _fit(model, rounds=2)
    assert_close64(flat(loop.model.net), expected)
    assert [m["round/failed_clients"] for m in rec.rounds] == [0.0, 0.0]
    assert [m["round/clients"] for m in rec.rounds] == [CPR, CPR]
    # every skipped step is one of the K local steps: batch_idx runs 0..K-1 for every client
    calls = loop._runtime.worker.model.calls
    assert calls == list(range(K)) * (2 * CPR)
    # forwards count every step, backwards only the steps that were not skipped
    assert sum(m["client/forwards"] for m in rec.rounds) == 2 * CPR * K
    assert sum(m["client/backwards"] for m in rec.rounds) == 2 * CPR * K - skipped


def test_a_round_in_which_every_step_was_skipped_stops_the_run_naming_the_module():
    """None everywhere is a module that forgot to return its loss: the first such round stops the run, naming
    ``training_step``, before the server step (the global model is unchanged)."""
    torch.manual_seed(0)
    model = to_float64(SkipNet(skip_all=True))
    before = flat(model.net).clone()
    loop = FederatedLoop(model, local_steps=K, clients_per_round=CPR, seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes (no validation, ...)
        with pytest.raises(RuntimeError) as info:
            make_trainer(4, callbacks=[FedAvg()]).fit(loop, datamodule=_dm())
    assert str(info.value) == (
        "round 0: SkipNet.training_step returned None for every local step of every client (None skips a step, as "
        "in Lightning), so nothing was trained: SkipNet.training_step must return the loss (a tensor, or a dict with "
        "the key 'loss')"
    )
    assert torch.equal(flat(loop.model.net), before)


def test_a_line_search_client_optimizer_sees_none_as_a_skipped_step():
    torch.manual_seed(0)
    model = to_float64(SkipNet())
    make = lambda params: SgdArmijo(params, eta_max=2.0, c=0.1)  # noqa: E731
    expected, skipped = _skip_reference(model.net, _dm(), rounds=1, lr=None, make_opt=make)
    assert skipped > 0
    loop, rec = _fit(model, rounds=1, client_optimizer=make, persist_client_state=False)
    assert_close64(flat(loop.model.net), expected)
    assert rec.rounds[0]["round/failed_clients"] == 0.0
    assert rec.rounds[0]["client/forwards"] >= CPR * K  # each step at least its gradient evaluation


def test_vectorized_refuses_a_skipped_step_by_name_and_auto_trains_sequentially(monkeypatch):
    class StaticSkip(SkipNet):  # a skip that does not depend on the data: traceable under vmap up to the None
        def training_step(self, batch, batch_idx):
            if batch_idx % 2 == 1:
                return None
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    torch.manual_seed(0)
    model = to_float64(StaticSkip())
    with pytest.raises(ValueError, match=r"StaticSkip\.training_step returned None .*client_execution='sequential'"):
        _fit(copy.deepcopy(model), rounds=1, client_execution="vectorized")
    seq, _ = _fit(copy.deepcopy(model), rounds=2, client_execution="sequential")
    from test_auto_mode import virtual_clock

    virtual_clock(monkeypatch, 4.0, 1.0)  # auto's measurement finds vectorized faster: the refusal decides
    with pytest.warns(UserWarning, match="training clients sequentially .*returned None"):
        auto, _ = _fit(copy.deepcopy(model), rounds=2, client_execution="auto")
    assert torch.equal(flat(auto.model.net), flat(seq.model.net))


# ====================================================================== 5: a curve every round
def _readme_python_example(tmp_path, rounds, **trainer_kw):
    """The README's Python example (its MyModule and FederatedLoop/Trainer block), with fewer local steps and
    rounds (still fewer than Lightning's default log_every_n_steps=50) and a CSVLogger; returns the logged rows."""
    import csv
    import re

    from lightning.pytorch.loggers import CSVLogger

    from test_readme_examples import README

    blocks = re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)
    module = next(b for b in blocks if "class MyModule" in b)
    run = next(b for b in blocks if "pl.Trainer(" in b and "max_steps=60" in b)
    extra = "".join(f", {k}={v!r}" for k, v in trainer_kw.items())
    run = (
        run.replace("local_steps=20, clients_per_round=20", "local_steps=2, clients_per_round=4")
        .replace("max_steps=60", f"max_steps={rounds}")
        .replace(
            'callbacks=[FedAvg(weighting="samples"), RoundCheckpoint(save_last=True)],',
            'callbacks=[FedAvg(weighting="samples"), RoundCheckpoint(save_last=True, dirpath=CKPT)], logger=LOGGER, '
            "enable_progress_bar=False, enable_model_summary=False" + extra + ",",
        )
    )
    assert run.count("LOGGER") == 1 and "local_steps=2" in run
    logger = CSVLogger(str(tmp_path), name="readme")
    namespace = {"LOGGER": logger, "CKPT": str(tmp_path / "checkpoints")}
    exec(compile(module + run, README, "exec"), namespace)  # noqa: S102 - the repository's own README
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_readme_python_example_logs_train_loss_every_round(tmp_path):
    torch.manual_seed(0)
    rows = _readme_python_example(tmp_path, rounds=7)
    steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert steps == list(range(7))  # one train/loss row per round, at the round's step
    assert sorted({int(r["step"]) for r in rows if r.get("server/lr")}) == list(range(7))


def test_a_log_every_n_steps_the_user_set_is_kept(tmp_path):
    torch.manual_seed(0)
    rows = _readme_python_example(tmp_path, rounds=7, log_every_n_steps=3)
    # Lightning's rule: rounds r with (r + 1) % 3 == 0 (reaching max_steps does not set trainer.should_stop)
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == [2, 5]


# ============================================================ 3c: the precision plugin converts client batches
def _dm32():
    return DigitsDataModule(num_clients=6, batch_size=8, partition=Dirichlet(0.1), seed=1)


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_64_true_converts_client_batches_and_equals_a_float64_hand_run(mode):
    class Net(SkipNet):
        def training_step(self, batch, batch_idx):
            x, y = batch
            assert x.dtype == torch.float64  # converted by the precision plugin, as Lightning converts batches
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Net() if mode == "sequential" else _NoSkip()
    ref_net = to_float64(copy.deepcopy(model.net))
    loop = FederatedLoop(model, local_steps=K, clients_per_round=CPR, seed=SEED, client_execution=mode)
    make_trainer(2, callbacks=[FedAvg()], precision="64-true").fit(loop, datamodule=_dm32())
    if mode == "sequential":
        expected, _ = _skip_reference(ref_net, _dm(), rounds=2, lr=0.3)
    else:
        expected = _plain_reference(ref_net, _dm(), rounds=2, lr=0.3)
    got = flat(loop.model.net)
    assert got.dtype == torch.float64
    assert_close64(got, expected, rtol=1e-12)


class _NoSkip(SkipNet):  # vectorizable: no skipped step
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def _plain_reference(net, dm, rounds, lr):
    """FedAvg of plain-SGD clients on every batch (the ``_skip_reference`` loop without the skip rule)."""
    dm.setup("fit")
    dm.configure_rounds(CPR, K, SEED)
    glob = copy.deepcopy(net)
    for r in range(rounds):
        sums, total = [torch.zeros_like(p) for p in glob.parameters()], 0.0
        for cid in dm.sample_clients(r):
            local = copy.deepcopy(glob)
            for x, y in _batches(dm, cid, r):
                grads = torch.autograd.grad(F.cross_entropy(local(x), y), list(local.parameters()))
                with torch.no_grad():
                    for p, g in zip(local.parameters(), grads):
                        p -= lr * g
            total += _add_weighted_delta(sums, glob, local, float(dm.client_num_samples(cid)))
        with torch.no_grad():
            for g, s in zip(glob.parameters(), sums):
                g -= s / total
    return torch.cat([p.detach().reshape(-1) for p in glob.parameters()])


def test_bf16_true_converts_client_batches_on_cpu():
    seen = []

    class Net(_NoSkip):
        def training_step(self, batch, batch_idx):
            seen.append((batch[0].dtype, next(self.parameters()).dtype))
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Net()
    before = flat(model.net).double()
    loop = FederatedLoop(model, local_steps=2, clients_per_round=2, seed=SEED)
    make_trainer(1, callbacks=[FedAvg()], precision="bf16-true").fit(loop, datamodule=_dm32())
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    after = flat(loop.model.net)
    assert after.dtype == torch.bfloat16 and bool(torch.isfinite(after).all())
    assert not torch.equal(after.double(), before.to(torch.bfloat16).double())  # it trained


def test_16_mixed_with_a_loss_scaler_is_refused_before_round_0_naming_the_precision():
    """``precision="16-mixed"`` on CUDA is Lightning's MixedPrecision with a GradScaler, which client training does
    not apply: refused at setup, before any client trains (it used to fail in the scaler's ``unscale_`` at round 0's
    server step). Built here on the CPU with a CPU GradScaler, since Lightning runs 16-mixed as bf16-mixed on the CPU.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    from fedlightning._validation import SettingError

    calls = []

    class Net(_NoSkip):
        def training_step(self, batch, batch_idx):
            calls.append(batch_idx)
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Net()
    before = flat(model.net).clone()
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    loop = FederatedLoop(model, local_steps=2, clients_per_round=2, seed=SEED)
    with pytest.raises(SettingError, match=r"precision='16-mixed' trains with a loss scaler .*'bf16-mixed'") as err:
        make_trainer(1, callbacks=[FedAvg()], plugins=[plugin]).fit(loop, datamodule=_dm32())
    assert err.value.config_key == "trainer.precision"
    assert calls == [] and torch.equal(flat(loop.model.net), before)
    # precision="16-mixed" on the CPU (Lightning: bf16-mixed, no scaler) trains
    loop = FederatedLoop(model, local_steps=2, clients_per_round=2, seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(1, callbacks=[FedAvg()], accelerator="cpu", precision="16-mixed").fit(loop, datamodule=_dm32())
    assert len(calls) == 4 and not torch.equal(flat(loop.model.net), before)


@pytest.mark.parametrize(
    ("optimizer", "precision", "key"),
    [
        (functools.partial(torch.optim.Adam, lr=1e-2), "16-true", "model.client_optimizer.init_args.eps"),
        (functools.partial(torch.optim.Adagrad, lr=1e-2), "16-true", "model.client_optimizer.init_args.eps"),
        (None, "16-true", "model.model"),  # the module's configure_optimizers(): Adam, default eps
    ],
)
def test_an_optimizer_eps_that_is_zero_in_float16_is_refused_before_round_0(optimizer, precision, key):
    """Under ``16-true`` torch's default ``eps`` (1e-8 for Adam, 1e-10 for Adagrad) is 0 in float16: every client's
    step divides by zero and every client fails. Refused at setup naming eps and float16; the check follows float16
    (the same eps trains under bf16-true, and 1e-4 trains under 16-true)."""
    from fedlightning._validation import SettingError

    class Net(_NoSkip):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model = Net()
    before = flat(model.net).clone()
    loop = FederatedLoop(model, client_optimizer=optimizer, local_steps=2, clients_per_round=2, seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SettingError, match=r"eps=1e-(08|10) is 0 in float16") as err:
            make_trainer(1, callbacks=[FedAvg()], precision=precision).fit(loop, datamodule=_dm32())
        assert err.value.config_key == key
        got = flat(loop.model.net)
        assert torch.equal(got, before.to(got.dtype))  # untrained (the precision's conversion aside)
        for prec, eps in (("bf16-true", 1e-8), ("16-true", 1e-4)):
            factory = functools.partial(torch.optim.Adam, lr=1e-2, eps=eps)
            loop = FederatedLoop(Net(), client_optimizer=factory, local_steps=2, clients_per_round=2, seed=SEED)
            make_trainer(1, callbacks=[FedAvg()], precision=prec).fit(loop, datamodule=_dm32())
            assert bool(torch.isfinite(flat(loop.model.net)).all())


def test_float16_true_warns_by_its_own_name_and_a_server_lr_beyond_float16_stops_naming_it():
    """16-true has no loss scaling either: the warning names the precision the run uses. A server learning rate
    beyond float16's range (torch's raw "cannot be converted ... without overflow" inside SGD's step) stops the run
    with the server step's error naming the strategy and server/lr, the global model unchanged."""
    torch.manual_seed(0)
    model = _NoSkip()
    loop = FederatedLoop(model, local_steps=1, clients_per_round=2, seed=SEED)
    with pytest.warns(UserWarning, match=r"precision='16-true' has no loss scaling"):
        make_trainer(1, callbacks=[FedAvg()], precision="16-true").fit(loop, datamodule=_dm32())
    torch.manual_seed(0)
    model = _NoSkip()
    before = flat(model.net).clone()
    loop = FederatedLoop(model, local_steps=1, clients_per_round=2, seed=SEED)
    trainer = make_trainer(1, callbacks=[FedAvg(server_lr=1e6)], precision="16-true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            FloatingPointError,
            match=r"server step of FedAvg overflows the global model's float16 "
            r"\(server/lr = 1000000\.0",
        ):
            trainer.fit(loop, datamodule=_dm32())
    assert torch.equal(flat(loop.model.net), before.to(torch.float16))  # the round's step was undone


# ====================================================================== 3b: the trainer shows the client's optimizer
LR0, ETA_MIN, T_MAX = 0.05, 0.005, 4


def _cosine(r):
    """CosineAnnealingLR's closed form (float64): the learning rate after ``r`` scheduler steps."""
    return ETA_MIN + (LR0 - ETA_MIN) * (1 + math.cos(math.pi * r / T_MAX)) / 2


class AdamCosineNet(_NoSkip):
    """Adam + CosineAnnealingLR client (configure_optimizers); records what ``self.trainer`` shows in training_step;
    with ``raise_once`` the first client of round 0 raises."""

    def __init__(self, raise_once: bool = False):
        super().__init__()
        self.seen, self.raise_once = [], raise_once

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            opt = self.trainer.optimizers[0]
            steps = {int(s["step"]) for s in opt.state.values()} if opt.state else {0}
            configs = self.trainer.lr_scheduler_configs
            self.seen.append(
                (
                    self.global_step,
                    batch_idx,
                    type(opt).__name__,
                    opt.param_groups[0]["lr"],
                    steps,
                    [type(c.scheduler).__name__ for c in configs],
                )
            )
            if self.raise_once:
                self.raise_once = False
                raise RuntimeError("a client bug")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=LR0)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_MAX, ETA_MIN)}


class _ServerView(pl.Callback):
    """What callbacks (and checkpoints) see after every round: the server optimizer and schedulers."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(
            (
                type(trainer.optimizers[0]).__name__,
                trainer.optimizers[0].param_groups[0]["lr"],
                list(trainer.lr_scheduler_configs),
            )
        )


def test_inside_client_training_the_trainer_shows_the_client_optimizer_and_logs_client_lr(tmp_path):
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    rounds = 5
    model = AdamCosineNet(raise_once=True)
    loop = FederatedLoop(
        model, local_steps=K, clients_per_round=CPR, seed=SEED, on_client_error="skip", client_execution="sequential"
    )
    server, logger = _ServerView(), CSVLogger(str(tmp_path), name="lr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped client's warning
        make_trainer(
            rounds, callbacks=[FedAvg(), server, LearningRateMonitor()], logger=logger, log_every_n_steps=1
        ).fit(loop, datamodule=_dm32())
    seen = loop._runtime.worker.model.seen
    assert len(seen) == rounds * CPR * K - (K - 1)  # the client that raised took one step
    for r, k, name, lr, steps, scheds in seen:
        assert name == "Adam" and scheds == ["CosineAnnealingLR"]
        assert lr == pytest.approx(_cosine(r), rel=1e-12, abs=0)
        assert steps == {k}  # the client's own fresh optimizer: k steps taken before local step k
    # after every round (and after the client that raised): the server's SGD (FedAvg, lr 1.0), no server scheduler
    assert server.seen == [("SGD", 1.0, [])] * rounds
    assert type(loop.trainer.optimizers[0]) is torch.optim.SGD
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    client_lr = {int(r["step"]): float(r["client/lr"]) for r in rows if r.get("client/lr")}
    assert sorted(client_lr) == list(range(rounds))
    for r, lr in client_lr.items():
        assert lr == pytest.approx(_cosine(r), rel=1e-12, abs=0)
    server_lr = [(int(r["step"]), float(r["lr-SGD"])) for r in rows if r.get("lr-SGD")]
    assert {s for s, _ in server_lr} == set(range(rounds)) and {lr for _, lr in server_lr} == {1.0}
    assert not any(k.startswith("lr-Adam") for k in rows[0])
