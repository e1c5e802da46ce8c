"""The validation split: held out of the training data before the clients are formed (stratified for partitioned
data, per user for natural splits), seeded, disjoint from every client and from the test set; ``val_dataloader``
serves it (in-memory fast path for ArrayDataset), ``test_dataloader`` the test set; the CLI tests the final model
after fit; bad ``val_fraction`` values fail early with a message naming the field and the value."""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_trainer
from fedlightning import FederatedLoop
from fedlightning.cli import FederatedCLI, main
from fedlightning.datamodules import (
    ArrayDataset,
    DigitsDataModule,
    Dirichlet,
    FederatedDataModule,
    ShakespeareDataModule,
    SyntheticDataModule,
)
from fedlightning.datamodules.base import ClientBatchSampler
from fedlightning.models import MLP
from numerics import rtol32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Labelled(FederatedDataModule):
    """A partitioned data set over a given label vector (feature = row number, so rows are identifiable)."""

    def __init__(self, labels, dataset_cls=ArrayDataset, **kw):
        kw.setdefault("num_clients", 1)
        super().__init__(**kw)
        self.labels = np.asarray(labels)
        self.dataset_cls = dataset_cls

    def load(self):
        x = torch.arange(len(self.labels), dtype=torch.float32)[:, None]
        data = self.dataset_cls(x, torch.as_tensor(self.labels))
        return data, data, self.labels


class Users(FederatedDataModule):
    """A natural split: user ``u`` holds ``sizes[u]`` consecutive rows."""

    def __init__(self, sizes, **kw):
        super().__init__(num_clients=len(sizes), **kw)
        self.sizes = list(sizes)

    def load(self):
        n = sum(self.sizes)
        data = ArrayDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.zeros(n, dtype=torch.long))
        return data, data, data.y.numpy()

    def natural_clients(self):
        ends = np.cumsum(self.sizes)
        return [np.arange(e - s, e) for e, s in zip(ends, self.sizes)]


def _digits(**kw):
    kw.setdefault("num_clients", 20)
    kw.setdefault("partition", Dirichlet(alpha=0.5))
    return DigitsDataModule(**kw)


# ---------------------------------------------------------------------------------------------- partitioned data
def test_val_clients_and_test_are_disjoint_and_cover_the_training_set():
    dm = _digits(seed=0)
    dm.setup()
    n = len(dm.train_dataset)
    clients = np.concatenate(dm.client_indices)
    assert len(dm.val_indices) == math.ceil(0.1 * n)  # the default val_fraction, scikit-learn's ceil rule
    assert len(np.unique(clients)) == len(clients)  # clients pairwise disjoint
    assert len(np.intersect1d(clients, dm.val_indices)) == 0  # no client holds a validation row
    assert np.array_equal(np.sort(np.concatenate([clients, dm.val_indices])), np.arange(n))  # together: all rows
    assert np.array_equal(dm.training_rows(), np.sort(clients))
    # the validation rows are training-set rows; the test loader serves the separate test set, whole and in order
    val_x = torch.cat([x for x, _ in dm.val_dataloader()])
    assert torch.equal(val_x, dm.train_dataset.x[torch.as_tensor(dm.val_indices)])
    test_x = torch.cat([x for x, _ in dm.test_dataloader()])
    assert torch.equal(test_x, dm.test_dataset.x)
    # and no validation image is also a test image (digits holds no duplicate across its split)
    val_rows = {tuple(r) for r in val_x.tolist()}
    assert not val_rows & {tuple(r) for r in test_x.tolist()}
    assert dm.statistics()["validation_samples"] == len(dm.val_indices)
    assert dm.statistics()["samples"] == len(clients)


def test_validation_is_stratified_by_label():
    dm = _digits(seed=3)
    dm.setup()
    y = dm.train_dataset.y.numpy()
    per_class = np.bincount(y, minlength=10)
    in_val = np.bincount(y[dm.val_indices], minlength=10)
    # StratifiedShuffleSplit: every class gets its share of the validation size, up to rounding (at most 1 off)
    expected = per_class * len(dm.val_indices) / len(y)
    assert np.abs(in_val - expected).max() < 1.0
    # the clients' union keeps the rest of every class
    clients = np.concatenate(dm.client_indices)
    assert np.array_equal(np.bincount(y[clients], minlength=10), per_class - in_val)


def test_split_is_seeded_by_the_data_module_seed():
    def split(seed):
        dm = _digits(seed=seed)
        dm.setup()
        return dm.val_indices, dm.client_indices

    (v0, c0), (v0b, c0b), (v1, _) = split(0), split(0), split(1)
    assert np.array_equal(v0, v0b) and all(np.array_equal(a, b) for a, b in zip(c0, c0b))
    assert not np.array_equal(v0, v1)


def test_val_fraction_zero_keeps_the_original_partition_and_has_no_val_loader():
    dm = _digits(seed=4, val_fraction=0)
    dm.setup()
    labels = dm.train_dataset.y.numpy()
    expected = Dirichlet(alpha=0.5)(labels, 20, seed=4)  # the partition of the whole training set
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_indices, expected))
    assert len(dm.val_indices) == 0 and dm.val_dataloader() == []
    assert dm.statistics()["validation_samples"] == 0


def test_val_fraction_zero_skips_validation_in_fit_and_never_evaluates_the_test_set():
    def fit(val_fraction):
        torch.manual_seed(0)
        loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=3, seed=0)
        trainer = make_trainer(2, limit_val_batches=1.0, val_check_interval=1, check_val_every_n_epoch=None)
        trainer.fit(loop, datamodule=_digits(num_clients=10, val_fraction=val_fraction))
        assert trainer.global_step == 2
        return trainer.callback_metrics

    assert "val/acc" in fit(0.1)  # the same trainer validates when there is a split
    assert not [k for k in fit(0) if k.startswith(("val/", "test/"))]


def test_cifar_validation_reads_the_images_without_augmentation(tmp_path):
    from fedlightning.datamodules import Cifar10DataModule
    from fedlightning.datamodules.cifar import _CIFAR
    from test_data_cifar import write_cifar10

    data = write_cifar10(str(tmp_path))
    dm = Cifar10DataModule(data_dir=str(tmp_path), num_clients=5, augment=True, eval_batch_size=4)
    dm.setup()
    raw = np.concatenate([data[f"data_batch_{i}"][0] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    mean = torch.tensor(_CIFAR[10]["mean"]).view(3, 1, 1)
    std = torch.tensor(_CIFAR[10]["std"]).view(3, 1, 1)
    expected = (torch.from_numpy(raw[dm.val_indices]).float() / 255 - mean) / std
    for _ in range(2):  # no random crop or flip: the same images every time
        got = torch.cat([x for x, _ in dm.val_dataloader()])
        torch.testing.assert_close(got, expected)
    assert dm.train_dataset.augment and dm.evaluation_view().images is dm.train_dataset.images  # shared storage


def test_cifar_global_evaluation_of_the_training_data_reads_the_images_without_augmentation(tmp_path):
    """GlobalEvaluation(split="train") evaluates the clients' training images as the validation loader reads them
    (no random crop or flip): its loss is the same at every call and equals the loss on the raw images."""
    from fedlightning.callbacks import GlobalEvaluation
    from fedlightning.datamodules import Cifar10DataModule
    from fedlightning.datamodules.cifar import _CIFAR
    from test_data_cifar import write_cifar10

    data = write_cifar10(str(tmp_path))
    dm = Cifar10DataModule(data_dir=str(tmp_path), num_clients=5, augment=True, eval_batch_size=7)
    dm.setup()
    raw = np.concatenate([data[f"data_batch_{i}"][0] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([data[f"data_batch_{i}"][1] for i in range(1, 6)])
    mean = torch.tensor(_CIFAR[10]["mean"]).view(3, 1, 1)
    std = torch.tensor(_CIFAR[10]["std"]).view(3, 1, 1)
    rows = dm.training_rows()
    images = (torch.from_numpy(raw[rows]).float() / 255 - mean) / std
    torch.manual_seed(0)
    model = MLP(input_dim=3 * 32 * 32, hidden=[8], num_classes=10)
    evaluation = GlobalEvaluation(split="train")
    first = evaluation.evaluate(model, dm, torch.device("cpu"))["train_eval/loss"]
    assert evaluation.evaluate(model, dm, torch.device("cpu"))["train_eval/loss"] == first
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(images), torch.as_tensor(labels[rows]).long()).item()
    assert abs(first - expected) <= 1e-5 * max(1.0, abs(expected))


def test_val_fraction_zero_with_a_val_monitor_is_an_error(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    loop = FederatedLoop(MLP(input_dim=64, hidden=[8]), local_steps=2, clients_per_round=3, seed=0)
    ckpt = ModelCheckpoint(monitor="val/acc", mode="max")
    trainer = make_trainer(
        2, callbacks=[ckpt], limit_val_batches=1.0, enable_checkpointing=True, default_root_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"val_fraction=0\.0.*ModelCheckpoint\(monitor='val/acc'\)"):
        trainer.fit(loop, datamodule=_digits(num_clients=10, val_fraction=0))


def test_single_sample_classes_stay_in_training():
    labels = np.array([0] * 10 + [1] * 10 + [2])  # class 2 has one sample: it cannot be stratified
    dm = Labelled(labels, val_fraction=0.3, seed=0)
    dm.setup()
    assert len(dm.val_indices) == math.ceil(0.3 * 21)
    assert 20 not in dm.val_indices  # the single class-2 sample trains
    assert sorted(np.bincount(labels[dm.val_indices], minlength=3)[:2].tolist()) == [3, 4]  # 7 over two classes


def test_too_few_validation_samples_for_one_per_class_fall_back_to_a_seeded_uniform_draw():
    labels = np.repeat(np.arange(10), 5)  # 10 classes, 50 samples: ceil(0.1 * 50) = 5 < 10 classes
    first = Labelled(labels, val_fraction=0.1, seed=2)
    first.setup()
    again = Labelled(labels, val_fraction=0.1, seed=2)
    again.setup()
    assert len(first.val_indices) == 5 and np.array_equal(first.val_indices, again.val_indices)
    assert set(labels[first.client_indices[0]]) == set(range(10))  # every class still trains


def test_validation_loader_keeps_the_in_memory_fast_path():
    calls = []

    class Counting(ArrayDataset):
        def __getitem__(self, idx):
            calls.append(idx)
            return super().__getitem__(idx)

    labels = np.repeat(np.arange(4), 50)
    dm = Labelled(labels, dataset_cls=Counting, eval_batch_size=7, seed=0)
    dm.setup()
    loader = dm.val_dataloader()
    assert isinstance(loader.sampler.sampler, ClientBatchSampler)  # inside the WholeSplitSampler
    assert np.array_equal(loader.sampler.sampler.indices.numpy(), dm.val_indices)
    calls.clear()
    batches = list(loader)
    assert len(calls) == len(batches) == math.ceil(len(dm.val_indices) / 7)  # one indexing per batch, no collate
    assert all(isinstance(c, torch.Tensor) and c.dim() == 1 for c in calls)
    xs = torch.cat([x for x, _ in batches])[:, 0].long().numpy()  # the feature is the row number
    assert np.array_equal(xs, dm.val_indices)


def test_generic_datasets_serve_the_validation_rows_through_a_subset():
    class Plain(torch.utils.data.Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    labels = np.repeat(np.arange(3), 20)
    dm = Labelled(labels, dataset_cls=Plain, eval_batch_size=4, seed=1)
    dm.setup()
    rows = torch.cat([x for x, _ in dm.val_dataloader()])[:, 0].long().numpy()
    assert np.array_equal(rows, dm.val_indices)
    rows = torch.cat([x for x, _ in dm.train_eval_dataloader()])[:, 0].long().numpy()
    assert np.array_equal(rows, np.sort(np.concatenate(dm.client_indices)))  # train evaluation: no validation row


# ---------------------------------------------------------------------------------------------- natural splits
def test_natural_split_holds_out_floor_fraction_of_every_user():
    sizes = [3, 9, 10, 25, 40]
    dm = Users(sizes, val_fraction=0.1, seed=5)
    dm.setup()
    assert [len(v) for v in dm.client_val_indices] == [0, 0, 1, 2, 4]  # floor(0.1 n); users below 10 keep all
    ends = np.cumsum(sizes)
    for u, (n, e) in enumerate(zip(sizes, ends)):
        own = np.arange(e - n, e)
        train, val = dm.client_indices[u], dm.client_val_indices[u]
        assert len(np.intersect1d(train, val)) == 0
        assert np.array_equal(np.sort(np.concatenate([train, val])), own)  # the user's own rows, nothing else
    assert np.array_equal(dm.val_indices, np.sort(np.concatenate(dm.client_val_indices)))
    again = Users(sizes, val_fraction=0.1, seed=5)
    again.setup()
    other = Users(sizes, val_fraction=0.1, seed=6)
    other.setup()
    assert np.array_equal(again.val_indices, dm.val_indices)
    assert not np.array_equal(other.val_indices, dm.val_indices)


def test_natural_split_without_any_validation_sample_warns_and_skips_validation():
    dm = Users([3, 4, 5], val_fraction=0.1)
    with pytest.warns(UserWarning, match=r"val_fraction=0\.1 holds out no validation sample"):
        dm.setup()
    assert dm.val_dataloader() == [] and [len(c) for c in dm.client_indices] == [3, 4, 5]


def test_synthetic_users_hold_out_their_own_training_samples():
    full = SyntheticDataModule(alpha=1.0, beta=1.0, seed=1, val_fraction=0)
    full.setup()
    dm = SyntheticDataModule(alpha=1.0, beta=1.0, seed=1)
    dm.setup()
    assert torch.equal(dm.train_dataset.x, full.train_dataset.x)  # same data; only the clients' arrays change
    for k, own in enumerate(full.client_indices):
        val = dm.client_val_indices[k]
        assert len(val) == int(0.1 * len(own))
        assert np.array_equal(np.sort(np.concatenate([dm.client_indices[k], val])), own)
    assert all(np.array_equal(a, b) for a, b in zip(dm.client_test_indices, full.client_test_indices))


def test_shakespeare_validation_windows_never_overlap_training_targets(tmp_path):
    play = "# Gap Play\n\n**ALPHA**  \n" + "  \n".join(f"Alpha says line {i:02d} of a long speech." for i in range(40))
    (tmp_path / "gap.md").write_text(play + "\n", encoding="utf-8")
    L = 20
    full = ShakespeareDataModule(data_dir=str(tmp_path), seq_length=L, val_fraction=0)
    full.setup()
    dm = ShakespeareDataModule(data_dir=str(tmp_path), seq_length=L)
    dm.setup()
    n = len(full.client_indices[0])
    k = int(0.1 * n)
    assert k > 0
    assert np.array_equal(dm.client_val_indices[0], full.client_indices[0][n - k :])  # the last k windows
    assert np.array_equal(dm.client_indices[0], full.client_indices[0][: n - k - (L - 1)])  # gap of L - 1
    starts = dm.train_dataset.x.starts
    train_starts, val_starts = starts[dm.client_indices[0]], starts[dm.client_val_indices[0]]
    # every validation window starts at or after the target of the last training window: no validation target
    # (and no validation input beyond that one character) lies inside a training window's text
    assert int(val_starts.min()) >= int(train_starts.max()) + L


# ---------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.1", None])
def test_bad_val_fraction_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"val_fraction.*got val_fraction=" + __import__("re").escape(repr(bad))):
        DigitsDataModule(val_fraction=bad)


@pytest.mark.parametrize("cls", [SyntheticDataModule, ShakespeareDataModule])
def test_bad_val_fraction_in_natural_modules(cls):
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\).*got val_fraction=-0\.5"):
        cls(val_fraction=-0.5)


def test_val_fraction_that_empties_the_training_set_is_an_error():
    dm = Labelled([0, 1, 2], val_fraction=0.9)  # ceil(0.9 * 3) = 3 of 3 samples
    with pytest.raises(
        ValueError,
        match=r"val_fraction=0\.9 holds out 3 of the 3 training samples and leaves the "
        r"training set empty",
    ):
        dm.setup()


def test_val_fraction_that_empties_a_class_is_an_error():
    # class 0 has 2 of 12 samples; 10 validation samples: its stratified share 1.67 rounds up to both
    dm = Labelled([0] * 2 + [1] * 10, val_fraction=0.8)
    with pytest.raises(
        ValueError,
        match=r"val_fraction=0\.8 leaves class 0 \(2 training sample\(s\)\) without a "
        r"training sample",
    ):
        dm.setup()


# ---------------------------------------------------------------------------------------------- through the CLI
def _quickstart(tmp_path, *extra, cli_cls=None):
    args = [
        "fit",
        "--config",
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--model.local_steps",
        "3",
        *extra,
    ]
    if cli_cls is None:
        return main(args)
    os.environ.setdefault("WANDB_MODE", "offline")
    return cli_cls(args=args)


def _logged(save_dir):
    """The last logged value of every metric in the run's metrics.csv."""
    import csv
    import glob

    (path,) = glob.glob(os.path.join(str(save_dir), "**", "metrics.csv"), recursive=True)
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return out


def test_fit_validates_on_the_val_rows_and_tests_the_final_model_on_the_test_set(tmp_path):
    cli = _quickstart(tmp_path)
    metrics = _logged(tmp_path)
    dm, net = cli.datamodule, cli.model.model
    net.eval()
    with torch.no_grad():
        xv = dm.train_dataset.x[torch.as_tensor(dm.val_indices)]
        yv = dm.train_dataset.y[torch.as_tensor(dm.val_indices)]
        val_logits = net(xv)
        test_logits = net(dm.test_dataset.x)
    # the last validation ran after round 2, the final model's test after fit: both hand-computed here. The float32
    # accuracies are one rounding of the same ratio of counts; a float32 mean loss over n rows may sum in another
    # order than Lightning's evaluation (then its batch-size weighted mean): numerics.rtol32(n + 4)
    yt = dm.test_dataset.y
    assert float(metrics["val/acc"]) == pytest.approx(
        float((val_logits.argmax(-1) == yv).float().mean()), rel=rtol32(1)
    )
    assert float(metrics["val/loss"]) == pytest.approx(float(F.cross_entropy(val_logits, yv)), rel=rtol32(len(yv) + 4))
    assert float(metrics["test/acc"]) == pytest.approx(
        float((test_logits.argmax(-1) == yt).float().mean()), rel=rtol32(1)
    )
    assert float(metrics["test/loss"]) == pytest.approx(
        float(F.cross_entropy(test_logits, yt)), rel=rtol32(len(yt) + 4)
    )
    assert len(yv) == 144 and len(yt) == 360  # digits: 20 % test, then 10 % of the remaining 1,437 validate
    assert float(metrics["val/loss"]) != float(metrics["test/loss"])  # different rows, different numbers


def test_test_after_fit_can_be_switched_off(tmp_path):
    cli = _quickstart(tmp_path / "option", "--test_after_fit", "false")
    assert "val/acc" in cli.trainer.callback_metrics
    assert not [k for k in _logged(tmp_path / "option") if k.startswith("test/")]

    class NoTest(FederatedCLI):
        test_after_fit = False

    cli = _quickstart(tmp_path / "attribute", cli_cls=NoTest)
    assert cli.trainer.global_step == 2 and "val/acc" in cli.trainer.callback_metrics
    assert not [k for k in _logged(tmp_path / "attribute") if k.startswith("test/")]


def test_after_fit_keeps_the_fit_metrics_next_to_the_test_metrics(tmp_path):
    cli = _quickstart(tmp_path)
    metrics, logged = cli.trainer.callback_metrics, _logged(tmp_path)
    for key in ("train/loss", "val/acc", "test/acc"):  # trainer.test alone would leave only test/*
        assert float(metrics[key]) == logged[key], key  # the same value, written to the CSV exactly


def test_after_fit_without_a_test_set_warns_and_skips(tmp_path):
    cli = _quickstart(tmp_path)
    cli.trainer.callback_metrics.clear()
    cli.datamodule.test_dataset = None
    with pytest.warns(UserWarning, match="DigitsDataModule has no test set: test_after_fit skipped"):
        cli.after_fit()
    assert not [k for k in cli.trainer.callback_metrics if k.startswith("test/")]
