"""benchmarks/gpu.py's fake CIFAR-10 writer produces files the Cifar10DataModule reads (official pickle layout)."""

import importlib.util
import os
import pickle
import sys

import numpy as np
import pytest

from fedlightning.datamodules import Cifar10DataModule, Dirichlet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_bench():
    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:  # gpu.py imports its neighbour user_models, as a script run from benchmarks/ does
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "benchmarks", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fake_cifar_is_read_by_the_data_module(gpu_bench, tmp_path):
    folder = gpu_bench.write_fake_cifar10(str(tmp_path), n_train=103, n_test=20, seed=1)
    expected = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    assert sorted(os.listdir(folder)) == sorted(expected)
    with open(os.path.join(folder, "data_batch_1"), "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    assert entry["data"].dtype == np.uint8 and entry["data"].shape == (21, 3072) and len(entry["labels"]) == 21

    dm = Cifar10DataModule(
        data_dir=str(tmp_path), download=False, num_clients=5, batch_size=10, partition=Dirichlet(0.3), augment=False
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == 103 and len(dm.test_dataset) == 20
    train_labels = dm.train_dataset.labels.numpy()
    assert train_labels.min() == 0 and train_labels.max() == 9
    assert np.bincount(train_labels, minlength=10).max() - np.bincount(train_labels, minlength=10).min() <= 5
    assert sorted(dm.test_dataset.labels.tolist()) == sorted(list(range(10)) * 2)  # balanced: 2 of each class
    x, y = dm.train_dataset[0]
    assert tuple(x.shape) == (3, 32, 32) and 0 <= int(y) < 10
    assert len(dm.val_indices) == 11  # the default validation split: ceil(0.1 * 103)
    assert sum(len(c) for c in dm.client_indices) == 103 - 11

    again = gpu_bench.write_fake_cifar10(str(tmp_path / "again"), n_train=103, n_test=20, seed=1)
    with open(os.path.join(again, "test_batch"), "rb") as f1, open(os.path.join(folder, "test_batch"), "rb") as f2:
        assert np.array_equal(pickle.load(f1)["data"], pickle.load(f2)["data"])  # seeded: same pixels


def test_fake_cifar_of_the_default_size_is_read_by_the_data_module(gpu_bench, tmp_path):
    """The data module refuses a file of an official file's size whose checksum differs (a corrupted download): the
    benchmark's full-size fake files stay below it, and the writer refuses the official counts."""
    with pytest.raises(ValueError, match="50000 / 10000 images"):
        gpu_bench.write_fake_cifar10(str(tmp_path), n_train=50000, n_test=10000)
    assert not os.path.exists(tmp_path / "cifar-10-batches-py")
    gpu_bench.write_fake_cifar10(str(tmp_path))  # the sizes of a GPU run
    dm = Cifar10DataModule(data_dir=str(tmp_path), download=False, num_clients=100, batch_size=50, val_fraction=0.0)
    dm.setup("fit")
    assert len(dm.train_dataset) == gpu_bench.FAKE_TRAIN and len(dm.test_dataset) == gpu_bench.FAKE_TEST
