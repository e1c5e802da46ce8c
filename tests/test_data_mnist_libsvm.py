"""MnistDataModule on IDX files and LibsvmDataModule on svmlight files written here in the exact on-disk formats."""

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from fedlightning.datamodules import IID, ClassShards, LibsvmDataModule, MnistDataModule
from fedlightning.datamodules.mnist import MNIST_MEAN, MNIST_STD, read_idx

RNG = np.random.default_rng(0)


def _idx_bytes(arr: np.ndarray, magic_dims: int) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, magic_dims) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_mnist(folder, n_train=200, n_test=40, gz=False):
    os.makedirs(folder, exist_ok=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = RNG.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        y = np.repeat(np.arange(10), n // 10).astype(np.uint8)
        RNG.shuffle(y)
        for name, arr, dims in ((f"{prefix}-images-idx3-ubyte", x, 3), (f"{prefix}-labels-idx1-ubyte", y, 1)):
            raw = _idx_bytes(arr, dims)
            if gz:
                with gzip.open(os.path.join(folder, name + ".gz"), "wb") as f:
                    f.write(raw)
            else:
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(raw)
        out[prefix] = (x, y)
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_and_two_class_shards(tmp_path, gz):
    folder = str(tmp_path / "MNIST" / "raw")  # torchvision's layout under data_dir
    data = write_mnist(folder, gz=gz)
    dm = MnistDataModule(data_dir=str(tmp_path), num_clients=10, val_fraction=0)  # seed 001's shards of all images
    dm.setup()
    x, y = dm.train_dataset[np.arange(200)]
    assert x.shape == (200, 1, 28, 28) and x.dtype == torch.float32
    expected = (torch.from_numpy(data["train"][0]).float() / 255 - MNIST_MEAN) / MNIST_STD
    torch.testing.assert_close(x[:, 0], expected)
    assert y.tolist() == data["train"][1].tolist()
    assert len(dm.test_dataset) == 40
    assert isinstance(dm.partition, ClassShards) and dm.partition.classes_per_client == 2
    ytr = data["train"][1]
    # 10 clients x 2 shards within classes (the 200 images' labels are balanced: 10 of each per shard): 20 samples
    # of exactly 2 classes each
    for idx in dm.client_indices:
        assert len(idx) == 20
        assert len(np.unique(ytr[idx])) == 2


def test_mnist_iid_option_and_read_idx(tmp_path):
    data = write_mnist(str(tmp_path))
    np.testing.assert_array_equal(read_idx(str(tmp_path / "train-images-idx3-ubyte")), data["train"][0])
    dm = MnistDataModule(data_dir=str(tmp_path), num_clients=4, partition=IID())
    dm.setup()
    assert len(dm.val_indices) == 20  # the default stratified 10 % of the 200 training images
    assert [len(i) for i in dm.client_indices] == [45] * 4


def test_mnist_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        MnistDataModule(data_dir=str(tmp_path / "missing")).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        MnistDataModule(data_dir=str(tmp_path / "empty")).setup()
    write_mnist(str(tmp_path / "bad"))
    p = tmp_path / "bad" / "train-labels-idx1-ubyte"
    y = np.zeros(200, np.uint8)
    y[5] = 11
    p.write_bytes(_idx_bytes(y, 1))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte: label 11 is outside the class range"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()
    p.write_bytes(b"\x00\x00\x0c\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte is not a uint8 IDX file"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()
    p.write_bytes(_idx_bytes(np.zeros(150, np.uint8), 1))
    with pytest.raises(ValueError, match="200 images but .* has 150 labels"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()
    p.write_bytes(_idx_bytes(np.zeros(150, np.uint8), 1)[:-3])
    with pytest.raises(ValueError, match="header says"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()
    # a header whose sizes multiply past int64 (numpy's product wrapped to 0 and matched an empty file)
    p.write_bytes(b"\x00\x00\x08\x04" + (65536).to_bytes(4, "big") * 4)
    with pytest.raises(ValueError, match=r"header says \(65536, 65536, 65536, 65536\) = 18446744073709551616 values"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()
    # a truncated .gz: named, not a bare EOFError
    p.unlink()
    gz = tmp_path / "bad" / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gzip.compress(_idx_bytes(np.zeros(200, np.uint8), 1))[:-20])
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte.gz cannot be read: EOFError"):
        MnistDataModule(data_dir=str(tmp_path / "bad")).setup()


def _svm(path, x, y):
    from sklearn.datasets import dump_svmlight_file

    dump_svmlight_file(x, y, str(path), zero_based=False)


def test_libsvm_w8a_with_test_file(tmp_path):
    x = (RNG.random((60, 300)) < 0.05).astype(np.float64)
    y = np.where(RNG.random(60) < 0.3, 1, -1)
    xt = (RNG.random((15, 300)) < 0.05).astype(np.float64)
    yt = np.where(RNG.random(15) < 0.3, 1, -1)
    x[0, 299] = 1.0  # the last feature index (300, one-based) is in range
    _svm(tmp_path / "w8a", x, y)
    _svm(tmp_path / "w8a.t", xt[:, :200], yt)  # fewer features in the file: still 300 columns
    dm = LibsvmDataModule(name="w8a", data_dir=str(tmp_path), num_clients=6, val_fraction=0)
    dm.setup()
    xs, ys = dm.train_dataset[np.arange(60)]
    np.testing.assert_array_equal(xs.numpy(), x.astype(np.float32))
    assert ys.tolist() == (y == 1).astype(int).tolist()  # -1 -> 0, +1 -> 1
    xte, yte = dm.test_dataset[np.arange(15)]
    assert xte.shape == (15, 300) and yte.tolist() == (yt == 1).astype(int).tolist()
    assert [len(i) for i in dm.client_indices] == [10] * 6  # i.i.d. by default (seed 001)


def test_libsvm_mushrooms_without_test_file(tmp_path):
    x = RNG.random((50, 112))
    y = np.where(np.arange(50) % 2 == 0, 1, 2)
    _svm(tmp_path / "mushrooms", x, y)
    dm = LibsvmDataModule(name="mushrooms", data_dir=str(tmp_path), num_clients=5, test_fraction=0.2)
    dm.setup()
    assert len(dm.train_dataset) == 40 and len(dm.test_dataset) == 10
    assert set(dm.train_dataset.y.tolist()) == {0, 1}  # labels 1 / 2 -> 0 / 1
    assert int(dm.test_dataset.y.sum()) == 5  # stratified hold-out


def test_libsvm_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown LIBSVM data set 'iris'"):
        LibsvmDataModule(name="iris")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LibsvmDataModule(name="a9a", data_dir=str(tmp_path / "none")).setup()
    with pytest.raises(FileNotFoundError, match="a9a"):
        LibsvmDataModule(name="a9a", data_dir=str(tmp_path)).setup()
    _svm(tmp_path / "phishing", RNG.random((10, 68)), np.array([0, 1] * 4 + [0, 3]))
    with pytest.raises(ValueError, match="phishing: label 3 is outside phishing's label pair"):
        LibsvmDataModule(name="phishing", data_dir=str(tmp_path), num_clients=2).setup()
    _svm(tmp_path / "ijcnn1", RNG.random((10, 30)), np.array([1, -1] * 5))
    with pytest.raises(ValueError, match="ijcnn1 is not a valid svmlight file for ijcnn1 \\(22 features\\)"):
        LibsvmDataModule(name="ijcnn1", data_dir=str(tmp_path), num_clients=2).setup()
    with pytest.raises(ValueError, match="test_fraction"):
        LibsvmDataModule(name="a9a", test_fraction=0.0)
    import bz2

    for suffix, compress in ((".gz", gzip.compress), (".bz2", bz2.compress)):  # truncated: named, not a bare EOFError
        folder = tmp_path / f"cut{suffix}"
        folder.mkdir()
        _svm(folder / "plain", RNG.random((10, 112)), np.array([1, 2] * 5))
        (folder / f"mushrooms{suffix}").write_bytes(compress((folder / "plain").read_bytes())[:-30])
        with pytest.raises(ValueError, match=rf"mushrooms\{suffix} cannot be read: EOFError"):
            LibsvmDataModule(name="mushrooms", data_dir=str(folder), num_clients=2).setup()


@pytest.mark.parametrize("compress", ["", ".gz"])
def test_libsvm_feature_index_0_is_refused_not_read_as_zero_based(tmp_path, compress):
    """One stray ``0:`` index: scikit-learn's default would read the whole file as 0-based (every feature one column
    off, silently); LIBSVM counts from 1, so the line is named."""
    lines = [f"{1 + i % 2} " + " ".join(f"{j}:1" for j in (1 + i % 5, 7, 112)) for i in range(20)]
    good = tmp_path / "good"
    good.mkdir()
    (good / "mushrooms").write_text("\n".join(lines) + "\n")
    dm = LibsvmDataModule(name="mushrooms", data_dir=str(good), num_clients=2, val_fraction=0.0)
    dm.setup()
    x = np.concatenate([dm.train_dataset.x.numpy(), dm.test_dataset.x.numpy()])
    assert x[:, 6].sum() == 20 and x[:, 111].sum() == 20 and x[:, 5].sum() == 0  # 1-based: "7:" is column 6
    lines[3] = "2 0:1 7:1"
    bad = tmp_path / "bad"
    bad.mkdir()
    text = ("\n".join(lines) + "\n").encode()
    if compress:
        with gzip.open(bad / "mushrooms.gz", "wb") as f:
            f.write(text)
    else:
        (bad / "mushrooms").write_bytes(text)
    with pytest.raises(ValueError, match=r"mushrooms(\.gz)?: line 4 has the feature index 0, but LIBSVM files count"):
        LibsvmDataModule(name="mushrooms", data_dir=str(bad), num_clients=2).setup()


def test_mnist_failed_download_says_where_to_put_the_files(tmp_path, monkeypatch):
    """download=True without network: torchvision tries every mirror for the first file, then a FileNotFoundError
    names the download error and the two folders the IDX files may go into."""
    import urllib.error

    import torchvision.datasets.mnist as tv_mnist

    calls = []

    def offline(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", offline)
    root = str(tmp_path / "mnist")
    with pytest.raises(FileNotFoundError) as info:
        MnistDataModule(data_dir=root, download=True).setup()
    msg = str(info.value)
    assert len(calls) == len(tv_mnist.MNIST.mirrors) and all(u.endswith("train-images-idx3-ubyte.gz") for u in calls)
    assert "download=True failed (RuntimeError: Error downloading train-images-idx3-ubyte.gz" in msg
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        assert name in msg
    assert repr(root) in msg and repr(os.path.join(root, "MNIST", "raw")) in msg
