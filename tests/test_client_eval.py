"""ClientEvaluation and FederatedDataModule.client_eval_indices: per-client values against hand loops over exactly
the clients' rows, the statistics against NumPy, the label-matched deal, natural splits (LEAF files written here),
the seeded client sample, local adaptation (against a hand fine-tuning, and without side effects), W&B objects."""

import copy
import json
import os
from fractions import Fraction

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger, WandbLogger

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.callbacks import ClientEvaluation
from fedlightning.callbacks.client_eval import STATISTICS, ClientResults, client_statistics, wandb_payload
from fedlightning.cli import main
from fedlightning.datamodules import ArrayDataset, DigitsDataModule, Dirichlet, LeafDataModule
from fedlightning.datamodules.base import reiterate
from fedlightning.models import MLP
from fedlightning.optim import SgdArmijo
from fedlightning.state import derive_seed
from numerics import RTOL64, Digits64, assert_close64, float64_data, rtol32, to_float64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def series(self, key):
        return [m[key] for _, m in self.rows if key in m]


def _fit(callbacks, rounds=3, model=None, dm=None, optimizer=None, logger=None, clients=4, **loop_kw):
    """A float64 run on digits (10 clients, Dirichlet(0.5)): values are compared with float64 hand loops."""
    torch.manual_seed(0)
    model = model or to_float64(MLP(input_dim=64, hidden=[8], num_classes=10))
    dm = dm or Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1)
    loop = FederatedLoop(
        model,
        client_optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)),
        local_steps=2,
        clients_per_round=clients,
        seed=2,
        **loop_kw,
    )
    trainer = make_trainer(rounds, callbacks=callbacks, logger=logger or False, log_every_n_steps=1)
    trainer.fit(loop, datamodule=dm)
    return loop, dm, trainer


def _hand_values(net, x, y):
    """Independent: the cross-entropy and accuracy of ``net`` on one client's rows, in one float64 batch."""
    with torch.no_grad():
        logits = net(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(-1) == y).double().mean())


def _close64(actual, expected):
    """Two float64 values (numbers or 0-d tensors) agree to numerics.RTOL64."""
    assert_close64(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- values
@pytest.mark.numerics
def test_per_client_values_equal_a_hand_loop_on_exactly_those_rows():
    generic = ClientEvaluation(every_n_rounds=3, vectorize=False, batch_size=7)  # several batches per client
    fast = ClientEvaluation(every_n_rounds=3, prefix="fast")
    loop, dm, _ = _fit([generic, fast])
    rows = dm.client_eval_indices("test")
    ids = [c for c, r in enumerate(rows) if len(r)]
    assert generic.last_results.client_ids.tolist() == ids == fast.last_results.client_ids.tolist()
    assert fast.vectorizable(loop.model) and not generic.vectorizable(loop.model)
    for j, c in enumerate(ids):
        x, y = dm.test_dataset.x[rows[c]], dm.test_dataset.y[rows[c]]
        loss, acc = _hand_values(loop.model.net, x, y)
        assert generic.last_results.num_samples[j] == len(rows[c])
        _close64(generic.last_results.values["test/loss"][j], loss)
        _close64(fast.last_results.values["test/loss"][j], loss)
        _close64(fast.last_results.values["test/acc"][j], acc)
        # torchmetrics' accuracy is a float32 ratio (one rounding of the exact one)
        assert generic.last_results.values["test/acc"][j] == pytest.approx(acc, rel=rtol32(1), abs=0)
    assert len(set(np.round(generic.last_results.values["test/loss"], 6))) > 1  # the clients differ
    assert loop.model.training  # train mode restored


def test_statistics_equal_numpy_and_are_logged():
    logger = RecordingLogger()
    ev = ClientEvaluation(every_n_rounds=2, after_fit=True)
    _fit([ev], rounds=3, logger=logger)
    # after round 2 (scheduled) and after fit (round 3 is not a scheduled one)
    assert len(logger.series("clients/test_acc_p10")) == 2
    values = ev.last_results.values
    assert set(values) == {"test/loss", "test/acc"}
    for name in values:
        v = values[name]
        expected = {
            "mean": np.mean(v),
            "std": np.std(v),
            "min": np.min(v),
            "p10": np.percentile(v, 10),
            "p50": np.median(v),
            "p90": np.percentile(v, 90),
            "max": np.max(v),
        }
        key = name.replace("/", "_")
        for stat in STATISTICS:
            assert logger.series(f"clients/{key}_{stat}")[-1] == pytest.approx(expected[stat], rel=1e-12, abs=0)
    assert logger.series("clients/num_clients")[-1] == len(ev.last_results.client_ids)


def test_client_statistics_leave_out_nan_and_handle_none_left():
    got = client_statistics([3.0, np.nan, 1.0, 2.0])
    assert got["mean"] == 2.0 and got["min"] == 1.0 and got["max"] == 3.0 and got["p50"] == 2.0
    assert got["std"] == pytest.approx(np.std([1.0, 2.0, 3.0]))
    assert all(np.isnan(v) for v in client_statistics([np.nan]).values())


def test_after_fit_is_not_repeated_when_the_last_round_was_evaluated():
    logger = RecordingLogger()
    _fit([ClientEvaluation(every_n_rounds=1)], rounds=2, logger=logger)
    assert len(logger.series("clients/test_loss_mean")) == 2  # rounds 1 and 2; the final model once


def test_the_final_evaluation_is_logged_at_the_last_rounds_step():
    """Evaluated after fit or at its last round, the final model's values go to the step of the last round's
    train/loss (round r at step r): Lightning's count is one more by then, a step no round has."""
    steps = {}
    for every in (None, 3):
        logger = RecordingLogger()
        _fit([ClientEvaluation(every_n_rounds=every)], rounds=3, logger=logger)
        steps[every] = [step for step, m in logger.rows if "clients/test_loss_mean" in m]
        assert max(step for step, m in logger.rows if "train/loss" in m) == 2
    assert steps == {None: [2], 3: [2]}


class _Regression(pl.LightningModule):
    """A module that is not a Classifier: its test_step logs a batch mean without batch_size (Lightning extracts the
    batch size), a sum, a max and a torchmetrics metric."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 1).double()
        import torchmetrics

        self.mae = torchmetrics.MeanAbsoluteError().set_dtype(torch.float64)  # float64 states

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y.double())

    def test_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x).squeeze(-1)
        self.log("test/mse", F.mse_loss(pred, y.double()))
        self.log("test/n", float(len(y)), reduce_fx="sum")
        self.log("test/max_err", (pred - y).abs().max(), reduce_fx="max")
        self.mae(pred, y.double())
        self.log("test/mae", self.mae)


def test_generic_module_values_are_reduced_as_lightning_reduces_epoch_values():
    ev = ClientEvaluation(every_n_rounds=2, batch_size=5)
    loop, dm, _ = _fit([ev], rounds=2, model=_Regression())
    assert not ev.vectorizable(loop.model)
    rows = dm.client_eval_indices()
    for j, c in enumerate(ev.last_results.client_ids.tolist()):
        x, y = dm.test_dataset.x[rows[c]], dm.test_dataset.y[rows[c]].double()
        with torch.no_grad():
            err = loop.model.net(x).squeeze(-1) - y
        v = {k: a[j] for k, a in ev.last_results.values.items()}
        _close64(v["test/mse"], err.pow(2).mean())
        assert v["test/n"] == len(rows[c])
        _close64(v["test/max_err"], err.abs().max())
        _close64(v["test/mae"], err.abs().mean())
    assert loop.model.mae.update_count == 0  # the module's own metric state is as before


def test_validation_split_uses_validation_step_on_the_validation_rows():
    ev = ClientEvaluation(split="val")
    loop, dm, _ = _fit([ev], rounds=1)
    rows = dm.client_eval_indices("val")
    assert set(ev.last_results.values) == {"val/loss", "val/acc"}
    assert sorted(np.concatenate(rows).tolist()) == dm.val_indices.tolist()
    j, c = 0, int(ev.last_results.client_ids[0])
    loss, _ = _hand_values(loop.model.net, dm.train_dataset.x[rows[c]], dm.train_dataset.y[rows[c]])
    assert ev.last_results.values["val/loss"][j] == pytest.approx(loss, rel=RTOL64)
    dm0 = Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, val_fraction=0)
    with pytest.raises(ValueError, match="val_fraction > 0"):
        _fit([ClientEvaluation(split="val")], rounds=1, dm=dm0)


class EpochEndAccuracy(pl.LightningModule):
    """The README's pattern: ``validation_step`` updates a torchmetrics accuracy and collects the losses,
    ``on_validation_epoch_end`` logs the accuracy's ``compute()`` and the collected mean, then resets both."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.net = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        self.losses = []

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        logits = self.net(batch[0])
        self.acc.update(logits, batch[1])
        self.losses.append(F.cross_entropy(logits, batch[1], reduction="sum"))
        self.count = getattr(self, "count", 0) + len(batch[1])

    def on_validation_epoch_end(self):
        self.log("val/acc", self.acc.compute())
        self.log("val/collected_loss", torch.stack(self.losses).sum() / self.count)
        self.acc.reset()
        self.losses.clear()
        self.count = 0


def test_values_logged_in_the_epoch_end_hook_are_each_clients_own():
    """They were dropped without a word (only the step's values were collected), and the outputs the steps collected
    piled up over the clients into the next validation."""
    torch.manual_seed(0)
    ev = ClientEvaluation(split="val", vectorize=False, batch_size=7)
    loop, dm, _ = _fit([ev], rounds=1, model=to_float64(EpochEndAccuracy()))
    rows = dm.client_eval_indices("val")
    assert set(ev.last_results.values) == {"val/acc", "val/collected_loss"}
    for j, c in enumerate(ev.last_results.client_ids.tolist()):
        loss, acc = _hand_values(loop.model.net, dm.train_dataset.x[rows[c]], dm.train_dataset.y[rows[c]])
        _close64(ev.last_results.values["val/collected_loss"][j], loss)
        assert ev.last_results.values["val/acc"][j] == pytest.approx(acc, rel=rtol32(1), abs=0)
    assert loop.model.losses == []  # nothing left over for the run's own validation


# ---------------------------------------------------------------------------------------------- the deal
def _expected_quotas(m, weights):
    """Independent largest-remainder apportionment of ``m`` rows by ``weights`` (exact fractions)."""
    total = sum(weights)
    shares = [Fraction(m * w, total) for w in weights]
    quota = [int(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - quota[i]), i))
    for i in order[: m - sum(quota)]:
        quota[i] += 1
    return quota


def test_label_matched_deal_gives_every_test_sample_to_one_client_in_proportion():
    dm = DigitsDataModule(num_clients=20, batch_size=16, partition=Dirichlet(0.3), seed=3)
    dm.setup()
    rows = dm.client_eval_indices()
    union = np.concatenate(rows)
    assert sorted(union.tolist()) == list(range(len(dm.test_dataset)))  # every test sample exactly once
    ytr, yte = dm.train_dataset.y.numpy(), dm.test_dataset.y.numpy()
    for c in range(10):
        m = int((yte == c).sum())
        n = [int((ytr[ix] == c).sum()) for ix in dm.client_indices]
        got = [int((yte[r] == c).sum()) for r in rows]
        assert got == _expected_quotas(m, n)
        assert all(abs(g - m * k / sum(n)) < 1 for g, k in zip(got, n))  # proportional within rounding
    assert all((np.diff(r) > 0).all() for r in rows)  # sorted rows
    # reproducible from the data module's seed, another seed deals other rows with the same counts
    assert all(np.array_equal(a, b) for a, b in zip(rows, dm.client_eval_indices()))
    other = dm.client_eval_indices(seed=4)
    assert [len(r) for r in other] == [len(r) for r in rows]
    assert any(not np.array_equal(a, b) for a, b in zip(rows, other))
    # the validation split: its rows, dealt the same way
    val = dm.client_eval_indices("val")
    assert sorted(np.concatenate(val).tolist()) == dm.val_indices.tolist()
    # by size: one group, shares of the clients' training sizes
    sized = dm.client_eval_indices(assignment="size")
    assert [len(r) for r in sized] == _expected_quotas(len(dm.test_dataset), [len(ix) for ix in dm.client_indices])


def test_data_without_labels_is_refused_naming_the_option():
    class Unlabelled(DigitsDataModule):
        def _label_array(self, set_name):
            return None

    dm = Unlabelled(num_clients=5, batch_size=16, partition=Dirichlet(1.0), seed=0)
    dm.setup()
    dm.test_dataset = ArrayDataset(dm.test_dataset.x, dm.test_dataset.y)
    dm.train_dataset.labels = dm.train_dataset.y.float() + 0.5  # an attribute that holds no class ids
    with pytest.raises(ValueError, match="assignment='size'"):
        dm.client_eval_indices()
    assert sum(len(r) for r in dm.client_eval_indices(assignment="size")) == len(dm.test_dataset)
    with pytest.raises(ValueError, match="split must be"):
        dm.client_eval_indices("train")


# ---------------------------------------------------------------------------------------------- natural split
def _write_leaf(path, users):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "users": list(users),
                "num_samples": [len(y) for _, y in users.values()],
                "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
            },
            f,
        )


@pytest.mark.numerics
def test_natural_split_evaluates_each_user_on_its_own_test_samples(tmp_path):
    rng = np.random.default_rng(0)

    def users(sizes):
        return {
            u: (np.round(rng.random((n, 784)), 3).tolist(), rng.integers(0, 62, n).tolist()) for u, n in sizes.items()
        }

    root = tmp_path / "femnist"
    _write_leaf(str(root / "train" / "a_train.json"), users({"u0": 12, "u1": 6, "u2": 9}))
    _write_leaf(str(root / "test" / "a_test.json"), users({"u0": 3, "u1": 5, "u2": 2}))
    dm = float64_data(
        LeafDataModule(
            name="femnist", data_dir=str(root), cache_dir=str(tmp_path / "cache"), batch_size=4, val_fraction=0
        )
    )
    model = to_float64(MLP(input_dim=784, hidden=[4], num_classes=62))
    ev = ClientEvaluation(clients=None, vectorize=False)
    loop, dm, _ = _fit([ev], rounds=2, model=model, dm=dm, clients=2)
    res = ev.last_results
    assert res.client_ids.tolist() == [0, 1, 2] and res.names == ["u0", "u1", "u2"]
    assert res.num_samples.tolist() == [3, 5, 2]
    for c in range(3):
        rows = dm.client_test_indices[c]
        assert np.array_equal(dm.client_eval_indices()[c], rows)
        loss, acc = _hand_values(loop.model.net, dm.test_dataset.x[rows], dm.test_dataset.y[rows])
        assert res.values["test/loss"][c] == pytest.approx(loss, rel=RTOL64)
        assert res.values["test/acc"][c] == pytest.approx(acc, rel=rtol32(1), abs=0)


# ---------------------------------------------------------------------------------------------- the client sample
def test_sampled_clients_are_the_same_every_time_and_reproducible_from_the_seed():
    seen = []

    class Spy(ClientEvaluation):
        def evaluate(self, pl_module, round_index=0):
            out = super().evaluate(pl_module, round_index)
            seen.append(out.client_ids.tolist())
            return out

    ev = Spy(every_n_rounds=1, clients=4, seed=7)
    loop, dm, _ = _fit([ev], rounds=3)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2] and len(seen[0]) == 4
    eligible = np.asarray([c for c, r in enumerate(dm.client_eval_indices()) if len(r)])
    expected = np.sort(np.random.default_rng(derive_seed(7, "client-eval-sample")).choice(eligible, 4, replace=False))
    assert seen[0] == expected.tolist()
    assert ClientEvaluation(clients=4, seed=7).selected_clients(dm).tolist() == seen[0]
    assert (
        ClientEvaluation(clients=4).selected_clients(dm, loop.seed).tolist()
        == ClientEvaluation(clients=4, seed=loop.seed).selected_clients(dm).tolist()
    )  # default: the loop's seed
    others = {tuple(ClientEvaluation(clients=4, seed=s).selected_clients(dm).tolist()) for s in range(8, 12)}
    assert others - {tuple(seen[0])}
    assert len(ClientEvaluation(clients=99).selected_clients(dm)) == len(eligible)  # all of them


# ---------------------------------------------------------------------------------------------- local adaptation
@pytest.mark.numerics
def test_local_adaptation_equals_fine_tuning_by_hand():
    ev = ClientEvaluation(local_steps=3, clients=3, vectorize=False)
    loop, dm, trainer = _fit([ev], rounds=2)
    assert ev.prefix == "clients_adapted"
    assert "clients_adapted/test_acc_mean" in trainer.callback_metrics
    rows = dm.client_eval_indices()
    seed = derive_seed(loop.seed, "client-eval")
    for j, c in enumerate(ev.last_results.client_ids.tolist()):
        model = copy.deepcopy(loop.model.net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in reiterate(dm.client_dataloader(c, 1, seed=seed), 3):  # after fit: round 1, the last one
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        loss, _ = _hand_values(model, dm.test_dataset.x[rows[c]], dm.test_dataset.y[rows[c]])
        assert ev.last_results.values["test/loss"][j] == pytest.approx(loss, rel=RTOL64)
        plain, _ = _hand_values(loop.model.net, dm.test_dataset.x[rows[c]], dm.test_dataset.y[rows[c]])
        assert abs(loss - plain) > 1e-6  # the adaptation changed the model


class _Scheduled(pl.LightningModule):
    """A float64 MLP whose client optimizer comes from configure_optimizers() with a StepLR halving it per round."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10)).double()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.cross_entropy(self.net(batch[0]), batch[1]), batch_size=len(batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


@pytest.mark.numerics
def test_adaptation_trains_with_the_learning_rate_of_the_evaluated_round_at_its_end_and_after_fit():
    """The module's scheduler halves the client lr after every round. The final model (after round 2) adapted at
    its round's end and after fit, when the scheduler has stepped once more, is adapted alike, with round 2's
    learning rate 0.4 * 0.5**2 (a hand loop), not the next round's."""
    scheduled = ClientEvaluation(every_n_rounds=3, local_steps=3, clients=3, prefix="at_round_end", vectorize=False)
    after_fit = ClientEvaluation(local_steps=3, clients=3, prefix="after_fit", vectorize=False)
    torch.manual_seed(0)
    dm = Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1)
    loop = FederatedLoop(_Scheduled(), local_steps=2, clients_per_round=4, seed=2)
    make_trainer(3, callbacks=[scheduled, after_fit]).fit(loop, datamodule=dm)
    a, b = scheduled.last_results, after_fit.last_results
    assert scheduled._evaluated_round == after_fit._evaluated_round == 2
    assert a.client_ids.tolist() == b.client_ids.tolist()
    assert np.array_equal(a.values["test/loss"], b.values["test/loss"])
    rows, seed = dm.client_eval_indices(), derive_seed(loop.seed, "client-eval")
    for j, c in enumerate(b.client_ids.tolist()):
        model = copy.deepcopy(loop.model.net)
        opt = torch.optim.SGD(model.parameters(), lr=0.4 * 0.5**2)
        for x, y in reiterate(dm.client_dataloader(c, 2, seed=seed), 3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        loss, _ = _hand_values(model, dm.test_dataset.x[rows[c]], dm.test_dataset.y[rows[c]])
        _close64(b.values["test/loss"][j], loss)


def test_the_adapting_clients_training_step_sees_its_own_optimizer_as_in_training():
    """self.trainer.optimizers inside training_step is the training client's optimizer (docs/your_model.md); the
    adaptation is client training too: its optimizer, at the evaluated round's learning rate, not the server's."""
    seen = []

    class Recording(_Scheduled):
        def training_step(self, batch, batch_idx):
            (opt,) = self.trainer.optimizers
            seen.append((self.trainer.state.stage, opt.param_groups[0]["lr"], len(self.trainer.lr_scheduler_configs)))
            return super().training_step(batch, batch_idx)

    evaluation = ClientEvaluation(every_n_rounds=2, local_steps=2, clients=1, vectorize=False)
    dm = Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1)
    loop = FederatedLoop(Recording(), local_steps=2, clients_per_round=2, seed=2)
    make_trainer(2, callbacks=[evaluation]).fit(loop, datamodule=dm)
    # round 0: 2 clients x 2 steps at 0.4; round 1: 2 x 2 at 0.2; then the adaptation of the model after round 1
    assert [lr for _, lr, _ in seen] == pytest.approx([0.4] * 4 + [0.2] * 4 + [0.2] * 2)
    assert {n for *_, n in seen} == {1}  # the module's StepLR, as in training


def test_a_module_without_the_evaluated_step_is_refused_before_round_0():
    """Lightning's default test_step / validation_step log nothing: an evaluation through them would log only
    num_clients, so it is refused at fit start naming the method."""

    class NoEval(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10).double()

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):  # split="val" has what it needs
            self.log("val/loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    rounds = []

    class Rounds(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rounds.append(batch_idx)

    with pytest.raises(ValueError, match=r"ClientEvaluation\(split='test'\) .* test_step\(\), which .*NoEval does not"):
        _fit([ClientEvaluation(every_n_rounds=1), Rounds()], model=NoEval())
    assert rounds == []
    ev = ClientEvaluation(split="val")
    _fit(
        [ev],
        rounds=1,
        model=NoEval(),
        dm=Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, val_fraction=0.2),
    )
    assert np.isfinite(ev.last_results.values["val/loss"]).all()


def test_two_evaluations_under_one_prefix_are_refused():
    """A test and a val evaluation with the default prefix would both write clients/num_clients."""
    with pytest.raises(ValueError, match=r"two ClientEvaluation callbacks log under prefix='clients'"):
        _fit([ClientEvaluation(), ClientEvaluation(split="val")], rounds=1)
    a, b = ClientEvaluation(), ClientEvaluation(split="val", prefix="clients_val")
    _fit(
        [a, b], rounds=1, dm=Digits64(num_clients=10, batch_size=16, partition=Dirichlet(0.5), seed=1, val_fraction=0.2)
    )
    assert set(a.last_results.values) == {"test/loss", "test/acc"} and set(b.last_results.values) == {
        "val/loss",
        "val/acc",
    }


def test_values_left_out_of_the_statistics_are_named_in_a_warning():
    """A client whose value is NaN (here: not logged for clients with an odd number of rows, NaN for the others'
    'test/bad') is left out of that value's statistics, and a warning says how many; a test_step that logs nothing
    is said too."""

    class Partial(_Regression):
        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test/mse", F.mse_loss(self.net(x).squeeze(-1), y.double()))
            self.log("test/bad", torch.tensor(float("nan"), dtype=torch.float64))

    ev = ClientEvaluation()
    with pytest.warns(
        UserWarning, match=r"'test/bad' is NaN for (\d+) of \1 clients .*clients/test_bad_\* are statistics"
    ):
        _fit([ev], rounds=1, model=Partial())
    n = len(ev.last_results.client_ids)
    assert n > 0 and np.isfinite(ev.last_results.values["test/mse"]).all()

    class Silent(_Regression):
        def test_step(self, batch, batch_idx):
            self.net(batch[0])

    with pytest.warns(UserWarning, match=r"Silent.test_step\(\) logged no value on any of the \d+ clients"):
        _fit([ClientEvaluation()], rounds=1, model=Silent())


def _snapshot(loop):
    return {
        "params": [p.detach().clone() for p in loop.model.parameters()],
        "state": copy.deepcopy(loop.client_state.state_dict()),
        "rng": torch.get_rng_state(),
        "np_rng": np.random.get_state()[1].copy(),
    }


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_local_adaptation_leaves_global_model_client_state_and_rng_unchanged():
    loop, dm, _ = _fit([], rounds=2, optimizer=lambda p: SgdArmijo(p, eta_max=1.0))
    assert len(loop.client_state.clients("optimizer")) > 0  # SgdArmijo stored per-client step sizes
    ev = ClientEvaluation(local_steps=4)
    before = _snapshot(loop)
    router = loop.client_worker.router
    first = ev.evaluate(loop, round_index=1)
    assert _equal(_snapshot(loop), before)
    assert not router.captured  # the adaptation's training_step logs are not the next round's client/* values
    again = ev.evaluate(loop, round_index=1)
    assert all(np.array_equal(first.values[k], again.values[k]) for k in first.values)  # deterministic
    plain = ClientEvaluation().evaluate(loop)
    assert not np.array_equal(first.values["test/loss"], plain.values["test/loss"])


class FrozenCounter(MLP):
    """Adds 1 at every training step to a parameter that does not train (a counter), and reports it from test_step."""

    def __init__(self):
        super().__init__(input_dim=64, hidden=[8], num_classes=10)
        self.counter = torch.nn.Parameter(torch.zeros((), dtype=torch.float64), requires_grad=False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.counter.add_(1.0)
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self.log("test/counter", self.counter.detach().clone())


def test_local_adaptation_starts_every_client_from_the_global_frozen_parameters(recwarn):
    """Parameters that do not train start every adapted client from the global model's value, as in training: after
    3 local steps of adaptation each client reports 3 (they had carried over from the last training client and from
    client to client: 5, 8, 11, ...)."""
    ev = ClientEvaluation(local_steps=3, clients=4, vectorize=False)
    loop, _, _ = _fit([ev], rounds=1, model=to_float64(FrozenCounter()))
    assert float(loop.model.counter) == 0.0
    assert ev.last_results.values["test/counter"].tolist() == [3.0] * 4


def test_the_callback_does_not_change_training():
    def run(callbacks):
        logger = RecordingLogger()
        loop, _, _ = _fit(callbacks, rounds=3, logger=logger)
        return [p.detach().clone() for p in loop.model.parameters()], logger

    with_eval, log_a = run([ClientEvaluation(every_n_rounds=1), ClientEvaluation(every_n_rounds=1, local_steps=2)])
    without, log_b = run([])
    assert all(torch.equal(a, b) for a, b in zip(with_eval, without))
    for key in ("train/loss", "client/train/batch_loss"):
        assert log_a.series(key) == log_b.series(key) and len(log_a.series(key)) == 3


# ---------------------------------------------------------------------------------------------- W&B
def _results():
    return ClientResults(
        client_ids=np.array([0, 3, 5]),
        num_samples=np.array([10, 4, 7]),
        values={"test/acc": np.array([0.5, 0.25, np.nan]), "test/loss": np.array([1.0, 2.0, 3.0])},
        names=["a", "b", "c"],
    )


def test_wandb_payload_holds_a_histogram_per_metric_and_a_client_table():
    import wandb

    payload = wandb_payload(_results())
    assert set(payload) == {"clients/test_acc_hist", "clients/test_loss_hist", "clients/table"}
    hist = payload["clients/test_loss_hist"]
    assert isinstance(hist, wandb.Histogram) and sum(hist.histogram) == 3
    assert sum(payload["clients/test_acc_hist"].histogram) == 2  # the finite values only
    table = payload["clients/table"]
    assert table.columns == ["client", "user", "samples", "test/acc", "test/loss"]
    assert table.data[1] == [3, "b", 4, 0.25, 2.0]
    assert "clients/table" not in wandb_payload(_results(), table=False)


class _FakeWandb(WandbLogger):
    """A WandbLogger whose run is a recorder (no W&B process)."""

    class _Run:
        def __init__(self):
            self.logged = []
            self.config = type("Config", (), {"update": lambda *a, **k: None})()

        def log(self, data, *args, **kwargs):
            self.logged.append(dict(data))

    def __init__(self):
        super().__init__(offline=True)
        self._run = self._Run()

    @property
    def experiment(self):
        return self._run


def test_wandb_logger_receives_histograms_and_the_table():
    logger = _FakeWandb()
    _fit([ClientEvaluation()], rounds=1, logger=logger)
    objects = [d for d in logger.experiment.logged if "clients/table" in d]
    assert len(objects) == 1 and "clients/test_acc_hist" in objects[0] and "trainer/global_step" in objects[0]
    assert any("clients/test_acc_p10" in d for d in logger.experiment.logged)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(split="train"), "split"),
        (dict(local_steps=-1), "local_steps"),
        (dict(clients=0), "clients"),
        (dict(every_n_rounds=0), "every_n_rounds"),
        (dict(assignment="random"), "assignment"),
        (dict(prefix=""), "prefix"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ClientEvaluation(**kwargs)


class _Tagger(MLP):
    """A Classifier with sequence outputs (N, T, C): one target per time step (Classifier flattens them)."""

    def forward(self, x):
        return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], x.shape[1], -1)


@pytest.mark.numerics
def test_one_pass_of_sequence_outputs_gives_each_clients_mean_over_its_targets():
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = to_float64(_Tagger(input_dim=6, hidden=[5], num_classes=4))
    x, y = torch.randn(23, 3, 6, dtype=torch.float64), torch.randint(0, 4, (23, 3))
    data, dm = ArrayDataset(x, y), SimpleNamespace(eval_batch_size=4, collate_fn=None)
    rows = [np.array([0, 5, 6, 7, 20]), np.array([1, 2, 3]), np.arange(8, 20)]
    ids = np.arange(3)
    fast, generic = ClientEvaluation(), ClientEvaluation(vectorize=False)
    assert fast.vectorizable(model)
    one_pass = fast._evaluate_clients(model, dm, data, rows, ids, torch.device("cpu"))
    by_client = generic._evaluate_clients(model, dm, data, rows, ids, torch.device("cpu"))
    for c, r in enumerate(rows):
        with torch.no_grad():
            logits = model(x[r]).reshape(-1, 4)
        loss = F.cross_entropy(logits, y[r].reshape(-1))
        acc = (logits.argmax(-1) == y[r].reshape(-1)).double().mean()
        _close64(one_pass[c]["test/loss"], loss)
        _close64(by_client[c]["test/loss"], loss)
        _close64(one_pass[c]["test/acc"], acc)
        assert by_client[c]["test/acc"] == pytest.approx(float(acc), rel=rtol32(1), abs=0)


# ---------------------------------------------------------------------------------------------- the example config
def test_example_config_runs_both_evaluations_through_the_cli(tmp_path):
    cli = main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "examples", "client_eval.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.local_steps",
            "2",
        ],
        run=True,
    )
    evaluations = [cb for cb in cli.trainer.callbacks if isinstance(cb, ClientEvaluation)]
    assert [(e.every_n_rounds, e.local_steps, e.prefix) for e in evaluations] == [
        (20, 0, "clients"),
        (None, 5, "clients_adapted"),
    ]
    metrics = cli.trainer.callback_metrics
    assert "clients/test_acc_p10" in metrics and "clients_adapted/test_loss_max" in metrics  # both after fit
    assert int(metrics["clients/num_clients"]) == len(evaluations[0].last_results.client_ids) > 0


def _dict_net():
    """test_data_contract's dict-batch classifier with a ``test_step``."""
    from test_data_contract import Net

    class Evaluated(Net):
        def test_step(self, batch, batch_idx):
            self.log("test/loss", F.cross_entropy(self.lin(batch["x"]), batch["y"]))

    return Evaluated("dict")


@pytest.mark.parametrize("every_n_rounds,after_fit", [(None, True), (2, False)])
def test_an_evaluation_that_cannot_deal_the_data_stops_the_run_before_its_first_round(every_n_rounds, after_fit):
    """assignment="labels" on data without known class labels (dict samples whose class is under a key no label
    source knows, and labels= not given): the error names the fix, and comes from on_fit_start, before any round has
    trained (not after them, at the first scheduled evaluation)."""
    from torch.utils.data import DataLoader

    import test_data_contract as contract
    from fedlightning.datamodules import IID, FederatedDataModule

    class Unlabelled(contract.Dicts):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return {"features": sample["features"], "answer": sample["label"], "idx": sample["idx"]}

    def collate(samples):
        return contract.dict_collate([{**s, "label": s["answer"]} for s in samples])

    class UserDataModule(contract.UserDataModule):
        def setup(self, stage):
            self.train, self.val, self.test = Unlabelled(40), Unlabelled(10, offset=100), Unlabelled(12, offset=200)

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=5, shuffle=True, collate_fn=collate, drop_last=True)

        def val_dataloader(self):
            return DataLoader(self.val, batch_size=4, collate_fn=collate)

        def test_dataloader(self):
            return DataLoader(self.test, batch_size=4, collate_fn=collate)

    rounds = []

    class Rounds(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rounds.append(batch_idx)

    dm = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    loop = FederatedLoop(_dict_net(), local_steps=2, clients_per_round=2, seed=0)
    evaluation = ClientEvaluation(every_n_rounds=every_n_rounds, after_fit=after_fit)
    trainer = make_trainer(3, callbacks=[evaluation, Rounds()])
    with pytest.raises(ValueError, match="assignment='size'"):
        trainer.fit(loop, datamodule=dm)
    assert rounds == [] and trainer.global_step == 0
    # the same data dealt by size evaluates
    dm = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    loop = FederatedLoop(_dict_net(), local_steps=2, clients_per_round=2, seed=0)
    evaluation = ClientEvaluation(every_n_rounds=every_n_rounds, after_fit=after_fit, assignment="size")
    make_trainer(2, callbacks=[evaluation]).fit(loop, datamodule=dm)
    assert evaluation.last_results is not None and len(evaluation.last_results.client_ids) == 4
    assert np.isfinite(evaluation.last_results.values["test/loss"]).all()


def test_split_val_with_a_separate_validation_set_names_what_to_do():
    """A data module whose validation set is a separate data set (from_datamodule's val_dataloader data) has no
    per-client validation rows: the error says so and names the alternatives, before the first round."""
    from fedlightning.datamodules import IID, FederatedDataModule
    from test_data_contract import Net, UserDataModule

    dm = FederatedDataModule.from_datamodule(UserDataModule(), partition=IID(), num_clients=4, seed=0)
    loop = FederatedLoop(Net("dict"), local_steps=2, clients_per_round=2, seed=0)
    trainer = make_trainer(2, callbacks=[ClientEvaluation(split="val", assignment="size")])
    with pytest.raises(ValueError, match=r"separate data set \(val=.*split='test'.*val_fraction"):
        trainer.fit(loop, datamodule=dm)
    assert trainer.global_step == 0
