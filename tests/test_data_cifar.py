"""CIFAR data modules on small python-pickle files written here in the official layout; per-sample augmentation
checked against every possible crop/flip of the padded image; the CIFAR-100 Pachinko split."""

import os
import pickle

import numpy as np
import pytest
import torch

from fedlightning.datamodules import Cifar10DataModule, Cifar100DataModule, CifarImages, Dirichlet, PachinkoPartition
from fedlightning.datamodules.cifar import _CIFAR, read_cifar

RNG = np.random.default_rng(0)


def _pickle(path, entry):
    with open(path, "wb") as f:
        pickle.dump(entry, f)


def write_cifar10(root, per_batch=20, test=10, byte_keys=False):
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    key = (lambda k: k.encode()) if byte_keys else (lambda k: k)
    data = {}
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        x = RNG.integers(0, 256, (n, 3072)).astype(np.uint8)
        y = RNG.integers(0, 10, n).tolist()
        _pickle(os.path.join(folder, name), {key("data"): x, key("labels"): y, key("batch_label"): name})
        data[name] = (x, y)
    return data


def write_cifar100(root, n_train=400, n_test=50):
    folder = os.path.join(root, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    coarse_of_fine = np.repeat(np.arange(20), 5)  # fine labels 5k..5k+4 belong to coarse label k
    out = {}
    for name, n in (("train", n_train), ("test", n_test)):
        fine = np.concatenate([np.arange(100), RNG.integers(0, 100, n - 100)]) if n >= 100 else RNG.integers(0, 100, n)
        x = RNG.integers(0, 256, (n, 3072)).astype(np.uint8)
        _pickle(
            os.path.join(folder, name),
            {"data": x, "fine_labels": fine.tolist(), "coarse_labels": coarse_of_fine[fine].tolist()},
        )
        out[name] = (x, fine)
    return out, coarse_of_fine


@pytest.mark.parametrize("byte_keys", [False, True])
def test_cifar10_reads_pickles_and_splits(tmp_path, byte_keys):
    data = write_cifar10(str(tmp_path), byte_keys=byte_keys)
    dm = Cifar10DataModule(data_dir=str(tmp_path), num_clients=10, partition=Dirichlet(alpha=0.5), augment=False)
    dm.setup()
    assert len(dm.train_dataset) == 100 and len(dm.test_dataset) == 10
    xs = np.concatenate([data[f"data_batch_{i}"][0] for i in range(1, 6)])
    ys = sum((data[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    mean = torch.tensor(_CIFAR[10]["mean"]).view(3, 1, 1)
    std = torch.tensor(_CIFAR[10]["std"]).view(3, 1, 1)
    for i in (0, 37, 99):
        x, y = dm.train_dataset[i]
        expected = (torch.from_numpy(xs[i].reshape(3, 32, 32)).float() / 255 - mean) / std
        torch.testing.assert_close(x, expected)
        assert int(y) == ys[i]
    assert len(dm.val_indices) == 10  # the default stratified 10 % validation split
    assert sum(len(c) for c in dm.client_indices) == 90 and dm.num_clients == 10


def _padded(img_uint8):
    return torch.nn.functional.pad(torch.from_numpy(img_uint8.reshape(3, 32, 32)), (4, 4, 4, 4))


def _matches_some_crop(out, img_uint8, mean, std):
    """Is ``out`` one of the 81 crops x 2 flips of the zero-padded image (normalised)?"""
    raw = torch.round((out * std + mean) * 255).to(torch.int64)
    padded = _padded(img_uint8).to(torch.int64)
    found = set()
    for top in range(9):
        for left in range(9):
            crop = padded[:, top : top + 32, left : left + 32]
            if torch.equal(raw, crop):
                found.add((top, left, False))
            if torch.equal(raw, crop.flip(-1)):
                found.add((top, left, True))
    return found


def test_per_sample_augmentation_is_a_random_crop_and_flip(tmp_path):
    data = write_cifar10(str(tmp_path))
    dm = Cifar10DataModule(data_dir=str(tmp_path), num_clients=5)
    dm.setup()
    ds = dm.train_dataset
    mean, std = ds.mean, ds.std
    xs = data["data_batch_1"][0]
    torch.manual_seed(0)
    seen = set()
    for i in range(8):  # __getitem__: one sample
        out, _ = ds[i]
        found = _matches_some_crop(out, xs[i], mean, std)
        assert found, "augmented sample is not a crop/flip of the padded image"
        seen |= found
    batch = ds.__getitems__(list(range(16)))  # the DataLoader batch path: every sample its own crop
    offsets = []
    for i, (out, y) in enumerate(batch):
        found = _matches_some_crop(out, xs[i], mean, std)
        assert found
        offsets.append(sorted(found)[0])
        assert int(y) == data["data_batch_1"][1][i]
    assert len(set(offsets)) > 4  # per-sample randomness, not one crop for the whole batch
    assert any(f for (_, _, f) in offsets) and not all(f for (_, _, f) in offsets)
    # test images are never augmented
    x_te, _ = dm.test_dataset[0]
    expected = (torch.from_numpy(data["test_batch"][0][0].reshape(3, 32, 32)).float() / 255 - mean) / std
    torch.testing.assert_close(x_te, expected)
    # the client loader goes through the DataLoader batch path
    dm.configure_rounds(clients_per_round=1, local_steps=1, seed=0)
    c = int(np.argmax([len(i) for i in dm.client_indices]))
    xb, yb = next(iter(dm.client_dataloader(c)))
    assert xb.shape[1:] == (3, 32, 32) and xb.dtype == torch.float32 and yb.dtype == torch.int64


def test_cifar100_dirichlet_default_and_pachinko(tmp_path):
    data, coarse_of_fine = write_cifar100(str(tmp_path))
    dm = Cifar100DataModule(data_dir=str(tmp_path), num_clients=8)
    dm.setup()
    assert isinstance(dm.partition, Dirichlet) and dm.partition.alpha == 0.3
    assert np.array_equal(dm.coarse_labels, coarse_of_fine[data["train"][1]])

    pam = Cifar100DataModule(data_dir=str(tmp_path), num_clients=7, partition=PachinkoPartition(), augment=False)
    pam.setup()
    assert np.array_equal(pam.partition.coarse_of_fine, coarse_of_fine)  # filled from the data
    sizes = [len(c) for c in pam.client_indices]
    assert len(pam.val_indices) == 40  # the default 10 % validation split is held out before the partition
    assert sizes == [52] * 3 + [51] * 4  # 360 images over 7 clients: 360 // 7 = 51, the first 360 % 7 get one more
    allidx = np.sort(np.concatenate(pam.client_indices))
    assert np.array_equal(allidx, np.setdiff1d(np.arange(400), pam.val_indices))  # disjoint cover of the rest


def test_pachinko_concentrates_on_few_coarse_labels():
    labels = np.repeat(np.arange(100), 20)  # 2,000 samples, 20 per fine label
    coarse_of_fine = np.repeat(np.arange(20), 5)

    def coarse_per_client(alpha):
        parts = PachinkoPartition(alpha=alpha, beta=10.0, coarse_of_fine=coarse_of_fine)(labels, 40, seed=0)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(2000))
        return np.mean([len(np.unique(coarse_of_fine[labels[p]])) for p in parts])

    # 50 samples per client: with alpha = 0.1 a client's samples come from a few coarse labels (until the pools
    # of its favourite labels run out), with alpha = 100 from nearly all 20
    few, many = coarse_per_client(0.1), coarse_per_client(100.0)
    assert few < 10 < many


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*download=True"):
        Cifar10DataModule(data_dir=str(tmp_path / "nowhere")).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        Cifar10DataModule(data_dir=str(tmp_path / "empty")).setup()
    write_cifar10(str(tmp_path / "badlab"))
    path = tmp_path / "badlab" / "cifar-10-batches-py" / "data_batch_3"
    _pickle(str(path), {"data": np.zeros((2, 3072), np.uint8), "labels": [1, 10]})
    with pytest.raises(ValueError, match="data_batch_3: label 10 is outside the class range"):
        Cifar10DataModule(data_dir=str(tmp_path / "badlab")).setup()
    path.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR python pickle"):
        Cifar10DataModule(data_dir=str(tmp_path / "badlab")).setup()
    with pytest.raises(ValueError, match="alpha"):
        PachinkoPartition(alpha=0.0)
    with pytest.raises(ValueError, match="coarse_of_fine"):
        PachinkoPartition()(np.arange(10) % 3, 2)
    with pytest.raises(ValueError, match="uint8"):
        CifarImages(torch.zeros(2, 3, 32, 32), torch.zeros(2), (0, 0, 0), (1, 1, 1), True)


@pytest.mark.parametrize(
    "entry,match",
    [
        (
            {"data": np.full((2, 3072), 0.5), "labels": [0, 1]},
            r"data holds float64 values \(e\.g\. 0\.5\); CIFAR pixels",
        ),
        (
            {"data": np.array([[300] * 3072, [1] * 3072]), "labels": [0, 1]},
            r"data holds the pixel value 300, outside 0\.\.255",
        ),
        (
            {"data": np.array([[1] * 3072, [-1] * 3072]), "labels": [0, 1]},
            r"data holds the pixel value -1, outside 0\.\.255",
        ),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [1.5, 2.0]}, r"labels holds the value 1\.5"),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": ["3", "7"]}, r"labels holds the value '3'"),
        ({"data": np.zeros((2, 3072), np.uint8), "labels": [True, False]}, r"labels holds the value True"),
        (
            {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 2**70]},
            r"labels holds the value 1180591620717411303424",
        ),
        (
            {"data": np.zeros((2, 3072), np.uint8), "labels": [[0], [1]]},
            r"labels must be a flat list .* shape \(2, 1\)",
        ),
    ],
    ids=[
        "float-pixels",
        "pixel-300",
        "pixel-negative",
        "fractional-label",
        "string-label",
        "bool-label",
        "huge-label",
        "nested-labels",
    ],
)
def test_values_a_uint8_or_int64_cast_would_change_are_refused_naming_the_file(tmp_path, entry, match):
    """A batch whose pixels are not bytes or whose labels are not integers was cast silently (0.5 -> 0, 300 -> 44,
    1.5 -> 1, '3' -> 3) and trained on other data; each is now refused naming the file and the field."""
    write_cifar10(str(tmp_path))
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    _pickle(str(path), entry)
    with pytest.raises(ValueError, match="data_batch_3: " + match):
        read_cifar(str(tmp_path), 10, "train")


@pytest.mark.parametrize(
    "cls,folder", [(Cifar10DataModule, "cifar-10-batches-py"), (Cifar100DataModule, "cifar-100-python")]
)
def test_failed_download_says_where_to_put_the_files(tmp_path, monkeypatch, cls, folder):
    """download=True without network: a FileNotFoundError naming the download error, the URL and the folder."""
    import urllib.error

    import torchvision.datasets.cifar as tv_cifar

    calls = []

    def offline(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", offline)
    spec = _CIFAR[cls.num_classes]
    with pytest.raises(FileNotFoundError) as info:
        cls(data_dir=str(tmp_path / "data"), download=True).setup()
    msg = str(info.value)
    assert calls == [spec["url"]]  # torchvision really tried the official archive
    assert "download=True failed (URLError" in msg and "name resolution" in msg
    assert spec["url"] in msg and os.path.join(str(tmp_path / "data"), folder) in msg
    assert all(name in msg for name in spec["train"] + spec["test"])
    assert isinstance(info.value.__cause__, urllib.error.URLError)
