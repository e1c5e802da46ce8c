"""LeafDataModule on small files written here in LEAF's JSON layout and in the Flower hub's parquet layout: client
ids, sample counts, per-user splits, the sampling options, the Arrow cache, and bad input."""

import json
import os
import warnings

import numpy as np
import pytest
import torch

from fedlightning.datamodules import LeafDataModule
from fedlightning.datamodules.leaf import tokenize_tweet
from fedlightning.datamodules.shakespeare import ALL_LETTERS, decode
from fedlightning.models import BagOfWordsLinear

RNG = np.random.default_rng(0)


def _write_leaf(path, users):
    """users: {name: (x list, y list)} -> one LEAF JSON file."""
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


def _femnist_users(sizes):
    return {u: (np.round(RNG.random((n, 784)), 3).tolist(), RNG.integers(0, 62, n).tolist()) for u, n in sizes.items()}


@pytest.fixture
def femnist_dir(tmp_path):
    tr = _femnist_users({"f_00": 5, "f_01": 3, "f_02": 7, "f_03": 1})
    te = _femnist_users({"f_00": 2, "f_01": 1, "f_02": 1, "f_03": 1})
    root = tmp_path / "femnist"
    _write_leaf(str(root / "train" / "all_data_0_niid_train.json"), {k: tr[k] for k in ("f_00", "f_01")})
    _write_leaf(str(root / "train" / "all_data_1_niid_train.json"), {k: tr[k] for k in ("f_02", "f_03")})
    _write_leaf(str(root / "test" / "all_data_0_niid_test.json"), te)
    return str(root), tr, te


def _dm(root, tmp_path, **kw):
    return LeafDataModule(data_dir=root, cache_dir=str(tmp_path / "hf_cache"), **kw)


def test_femnist_json_given_split(femnist_dir, tmp_path):
    root, tr, te = femnist_dir
    dm = _dm(root, tmp_path, name="femnist")
    dm.setup()
    assert dm.client_names == ["f_00", "f_01", "f_02", "f_03"]
    assert [len(i) for i in dm.client_indices] == [5, 3, 7, 1]
    assert [len(i) for i in dm.client_test_indices] == [2, 1, 1, 1]
    for c, name in enumerate(dm.client_names):
        x, y = dm.train_dataset[dm.client_indices[c]]
        np.testing.assert_allclose(x.numpy(), np.asarray(tr[name][0], dtype=np.float32))
        assert y.tolist() == tr[name][1]
        xt, yt = dm.test_dataset[dm.client_test_indices[c]]
        np.testing.assert_allclose(xt.numpy(), np.asarray(te[name][0], dtype=np.float32))
        assert yt.tolist() == te[name][1]
    assert dm.train_dataset.x.dtype == torch.float32 and dm.train_dataset.x.shape[1] == 784


def test_sampling_options(femnist_dir, tmp_path):
    root, tr, te = femnist_dir
    dm = _dm(root, tmp_path, name="femnist", min_samples=4)  # totals: 7, 4, 8, 2 -> f_03 removed (LEAF -k)
    dm.setup()
    assert dm.client_names == ["f_00", "f_01", "f_02"]
    dm = _dm(root, tmp_path, name="femnist", user_fraction=0.5, seed=3)
    dm.setup()
    assert len(dm.client_names) == 2 and set(dm.client_names) <= set(tr)
    again = _dm(root, tmp_path, name="femnist", user_fraction=0.5, seed=3)
    again.setup()
    assert again.client_names == dm.client_names  # seeded
    dm = _dm(root, tmp_path, name="femnist", num_users=3, min_samples=3)  # f_03 filtered, then 3 of 3 kept
    dm.setup()
    assert dm.client_names == ["f_00", "f_01", "f_02"]
    dm = _dm(root, tmp_path, name="femnist", num_users=2, seed=5)
    dm.setup()
    assert len(dm.client_names) == 2 and dm.num_dropped_users == 2
    sizes = {"f_00": 5, "f_01": 3, "f_02": 7, "f_03": 1}
    assert [len(i) for i in dm.client_indices] == [sizes[n] for n in dm.client_names]
    with pytest.raises(ValueError, match="num_users=5 but only 4 users remain"):
        _dm(root, tmp_path, name="femnist", num_users=5).setup()


def test_resplit_follows_leaf_rule(femnist_dir, tmp_path):
    root, tr, te = femnist_dir
    dm = _dm(root, tmp_path, name="femnist", train_fraction=0.5, seed=1)
    dm.setup()
    # pooled n = 7, 4, 8, 2 -> n_train = int(0.5 n) = 3, 2, 4 and 1 (n == 2)
    assert [len(i) for i in dm.client_indices] == [3, 2, 4, 1]
    assert [len(i) for i in dm.client_test_indices] == [4, 2, 4, 1]
    for c, name in enumerate(dm.client_names):
        pooled = np.asarray(tr[name][0] + te[name][0], dtype=np.float32)
        got = np.concatenate(
            [dm.train_dataset[dm.client_indices[c]][0].numpy(), dm.test_dataset[dm.client_test_indices[c]][0].numpy()]
        )
        # train and test of a user are a disjoint cover of its pooled samples
        assert sorted(map(tuple, got.round(3))) == sorted(map(tuple, pooled.round(3)))


def test_all_data_layout_defaults_to_leaf_90_10(tmp_path):
    users = _femnist_users({"a": 10, "b": 1, "c": 21})
    _write_leaf(str(tmp_path / "all" / "all_data_0.json"), users)
    dm = _dm(str(tmp_path / "all"), tmp_path, name="femnist", val_fraction=0)  # LEAF's split itself
    dm.setup()
    assert dm.client_names == ["a", "c"]  # b has < 2 samples: dropped by LEAF's split
    assert [len(i) for i in dm.client_indices] == [9, 18]
    assert [len(i) for i in dm.client_test_indices] == [1, 3]


def _windows(text, L=80):
    return [text[i : i + L] for i in range(len(text) - L)], [text[i + L] for i in range(len(text) - L)]


def test_shakespeare_json(tmp_path):
    t1 = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer " * 8)[:600]
    t2 = "Now is the winter of our discontent Made glorious summer by this sun of York; And all the clouds"
    x1, y1 = _windows(t1)
    x2, y2 = _windows(t2)
    _write_leaf(
        str(tmp_path / "sh" / "train" / "a.json"), {"HAMLET": (x1[:400], y1[:400]), "RICHARD": (x2[:10], y2[:10])}
    )
    _write_leaf(
        str(tmp_path / "sh" / "test" / "a.json"), {"HAMLET": (x1[400:], y1[400:]), "RICHARD": (x2[10:], y2[10:])}
    )
    dm = _dm(str(tmp_path / "sh"), tmp_path, name="shakespeare", val_fraction=0)  # LEAF's split itself
    dm.setup()
    assert dm.client_names == ["HAMLET", "RICHARD"]
    assert [len(i) for i in dm.client_indices] == [400, 10]
    assert [len(i) for i in dm.client_test_indices] == [120, 6]
    x, y = dm.train_dataset[dm.client_indices[0]]
    assert [decode(r) for r in x] == x1[:400] and decode(y) == "".join(y1[:400])
    assert int(dm.train_dataset.x.max()) < len(ALL_LETTERS)
    # chronological re-split of the pooled 520 windows: train = first int(0.8 n) = 416, test from 416 + 79 = 495;
    # RICHARD (16 windows: 12 train, test from 91) has no test window and is dropped, as in LEAF
    dm = _dm(str(tmp_path / "sh"), tmp_path, name="shakespeare", train_fraction=0.8)
    dm.setup()
    assert dm.client_names == ["HAMLET"] and dm.num_dropped_users == 1
    x, _ = dm.train_dataset[dm.client_indices[0]]
    xt, yt = dm.test_dataset[dm.client_test_indices[0]]
    # default val_fraction 0.1: the last int(0.1 * 416) = 41 train windows validate, the 79 before them are dropped
    assert [decode(r) for r in x] == x1[: 416 - 41 - 79]
    xv, yv = dm.train_dataset[dm.client_val_indices[0]]
    assert [decode(r) for r in xv] == x1[416 - 41 : 416] and decode(yv) == "".join(y1[416 - 41 : 416])
    assert [decode(r) for r in xt] == x1[495:] and decode(yt) == "".join(y1[495:])


@pytest.mark.parametrize("layout", ["json", "parquet"])
def test_shakespeare_characters_outside_the_vocabulary_keep_every_window_in_place(tmp_path, layout):
    """Non-ASCII characters whose cleaned form is longer (``—`` → ``--``, ``…``, ``ﬁ``) or empty (a combining accent)
    once moved every later window and target of the split into the next one, across users; each is one index now."""
    win_a = "a" * 40 + "\u2014x\u2026y\ufb01z" + "e\u0301" + "b" * 32
    assert len(win_a) == 80
    xa, ya = [win_a, "c" * 80, "d" * 80], ["b", "\u2014", "\u00e9"]
    xb, yb = ["e" * 80, "f" * 80, "g" * 80, "h" * 80], ["e", "f", "g", "h"]
    root = tmp_path / "sh"
    if layout == "json":
        _write_leaf(str(root / "train" / "a.json"), {"A": (xa, ya), "B": (xb, yb)})
        _write_leaf(str(root / "test" / "a.json"), {"A": (["i" * 80], ["j"]), "B": (["k" * 80], ["l"])})
    else:
        import pandas as pd

        root.mkdir()
        pd.DataFrame({"character_id": ["A"] * 3 + ["B"] * 4, "x": xa + xb, "y": ya + yb}).to_parquet(
            root / "train-0.parquet"
        )
        pd.DataFrame({"character_id": ["A", "B"], "x": ["i" * 80, "k" * 80], "y": ["j", "l"]}).to_parquet(
            root / "test-0.parquet"
        )
    dm = _dm(str(root), tmp_path, name="shakespeare", val_fraction=0)
    dm.setup()
    assert dm.client_names == ["A", "B"]
    x, y = dm.train_dataset[dm.client_indices[0]]
    assert [decode(r) for r in x] == ["a" * 40 + "-x.yfz" + "e " + "b" * 32, "c" * 80, "d" * 80]
    assert decode(y) == "b-e"
    x, y = dm.train_dataset[dm.client_indices[1]]
    assert [decode(r) for r in x] == xb and decode(y) == "efgh"
    xt, yt = dm.test_dataset[dm.client_test_indices[1]]
    assert [decode(r) for r in xt] == ["k" * 80] and decode(yt) == "l"


def test_sent140_bag_of_words(tmp_path):
    def tweet(text):
        return ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "user", text]

    tr = {
        "u1": ([tweet("I love this, love it!"), tweet("so sad today")], [1, 0]),
        "u2": ([tweet("Love the sun"), tweet("sad sad sad..."), tweet("ok")], [1, 0, 1]),
    }
    te = {"u1": ([tweet("love unknownword")], [1]), "u2": ([tweet("zzz")], [0])}
    _write_leaf(str(tmp_path / "s140" / "train" / "a.json"), tr)
    _write_leaf(str(tmp_path / "s140" / "test" / "a.json"), te)
    dm = _dm(str(tmp_path / "s140"), tmp_path, name="sent140", vocab_size=3)
    dm.setup()
    # training token counts: love 3, sad 4, "," 1, "!" 1, "." 3, ... -> top 3 by count then alphabetically
    counts = {}
    for xs, _ in tr.values():
        for s in xs:
            for t in tokenize_tweet(s[4]):
                counts[t] = counts.get(t, 0) + 1
    expected_vocab = sorted(counts, key=lambda w: (-counts[w], w))[:3]
    assert dm.vocabulary == expected_vocab == ["sad", ".", "love"]
    x, y = dm.train_dataset[dm.client_indices[0]]
    assert y.tolist() == [1, 0]
    # the BoW linear model on padded ids equals nn.Linear on the L1-normalised count vector
    model = BagOfWordsLinear(vocab_size=3, num_classes=2)
    dense = torch.zeros(len(x), 3)
    for i, s in enumerate(xs[4] for xs in tr["u1"][0]):
        toks = [expected_vocab.index(t) for t in tokenize_tweet(s) if t in expected_vocab]
        for t in toks:
            dense[i, t] += 1.0 / len(toks)
    torch.testing.assert_close(model(x), model.linear(dense))
    xt, _ = dm.test_dataset[dm.client_test_indices[1]]
    assert (xt == -1).all()  # "zzz" has no vocabulary token: the model outputs its bias
    torch.testing.assert_close(model(xt), model.linear.bias.expand(1, 2))


def _hf_femnist_parquet(path, rows):
    import datasets
    from PIL import Image

    feats = datasets.Features(
        {
            "image": datasets.Image(),
            "writer_id": datasets.Value("string"),
            "hsf_id": datasets.Value("int64"),
            "character": datasets.ClassLabel(num_classes=62),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "image": [Image.fromarray(img) for img, _, _ in rows],
            "writer_id": [w for _, w, _ in rows],
            "hsf_id": [0] * len(rows),
            "character": [c for _, _, c in rows],
        },
        features=feats,
    )
    ds.to_parquet(path)


def test_femnist_flower_parquet(tmp_path):
    imgs = RNG.integers(0, 256, (9, 28, 28)).astype(np.uint8)
    writers = ["f0000_14"] * 4 + ["f0001_41"] * 3 + ["f0002_01"] * 2
    labels = RNG.integers(0, 62, 9).tolist()
    root = tmp_path / "flwr_femnist" / "data"
    root.mkdir(parents=True)
    _hf_femnist_parquet(str(root / "train-00000-of-00001.parquet"), list(zip(imgs, writers, labels)))
    dm = LeafDataModule(
        name="femnist",
        data_dir=str(tmp_path / "flwr_femnist"),
        train_fraction=0.5,
        cache_dir=str(tmp_path / "hf_cache"),
        seed=0,
    )
    dm.setup()
    assert dm.client_names == ["f0000_14", "f0001_41", "f0002_01"]
    assert [len(i) for i in dm.client_indices] == [2, 1, 1]  # n = 4, 3, 2 -> int(0.5 n) = 2, 1 and 1 (n == 2)
    assert [len(i) for i in dm.client_test_indices] == [2, 2, 1]
    # pixels are grey / 255 (as LEAF's JSON) and every sample keeps its label
    lookup = {img.tobytes(): lab for img, lab in zip(imgs, labels)}
    for ds, parts in ((dm.train_dataset, dm.client_indices), (dm.test_dataset, dm.client_test_indices)):
        for c, idx in enumerate(parts):
            x, y = ds[idx]
            for row, lab in zip(x.numpy(), y.tolist()):
                key = np.rint(row * 255).astype(np.uint8).reshape(28, 28).tobytes()
                assert lookup[key] == lab
                assert writers[[i.tobytes() for i in imgs].index(key)] == dm.client_names[c]


def test_shakespeare_flower_parquet_with_test_files(tmp_path):
    import pandas as pd

    text = "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name; Or if thou wilt not, " * 2
    xs, ys = _windows(text)
    root = tmp_path / "flwr_sh"
    root.mkdir()
    pd.DataFrame({"character_id": ["JULIET"] * 15 + ["NURSE"] * 5, "x": xs[:20], "y": ys[:20]}).to_parquet(
        root / "train-0.parquet"
    )
    pd.DataFrame({"character_id": ["JULIET"] * 3, "x": xs[20:23], "y": ys[20:23]}).to_parquet(root / "test-0.parquet")
    dm = LeafDataModule(name="shakespeare", data_dir=str(root), cache_dir=str(tmp_path / "hf_cache"))
    dm.setup()
    assert dm.client_names == ["JULIET", "NURSE"]
    assert [len(i) for i in dm.client_indices] == [15, 5]
    assert [len(i) for i in dm.client_test_indices] == [3, 0]
    x, y = dm.test_dataset[dm.client_test_indices[0]]
    assert [decode(r) for r in x] == xs[20:23] and decode(y) == "".join(ys[20:23])


def test_arrow_cache_is_invalidated_when_files_change(femnist_dir, tmp_path):
    root, tr, te = femnist_dir
    dm = _dm(root, tmp_path, name="femnist")
    dm.setup()
    assert any(f.endswith(".arrow") for _, _, fs in os.walk(tmp_path / "hf_cache") for f in fs)
    changed = {k: (v[0], [(lab + 1) % 62 for lab in v[1]]) for k, v in tr.items() if k in ("f_00", "f_01")}
    path = os.path.join(root, "train", "all_data_0_niid_train.json")
    _write_leaf(path, changed)
    os.utime(path, (1e9, 1e9))
    dm2 = _dm(root, tmp_path, name="femnist")
    dm2.setup()
    assert dm2.train_dataset[dm2.client_indices[0]][1].tolist() == changed["f_00"][1]


def test_bad_input(femnist_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _dm(str(tmp_path / "nope"), tmp_path, name="femnist").setup()
    with pytest.raises(ValueError, match="unknown LEAF data set name 'cifar'"):
        LeafDataModule(name="cifar", data_dir=str(tmp_path))
    bad = tmp_path / "bad"
    (bad / "train").mkdir(parents=True)
    (bad / "train" / "broken.json").write_text('{"users": ["a"], "num_samples": [1], "user_data": {')
    with pytest.raises(ValueError, match="malformed LEAF JSON file .*broken.json"):
        _dm(str(bad), tmp_path, name="femnist").setup()
    empty = tmp_path / "empty_user"
    _write_leaf(str(empty / "train" / "x.json"), {"a": ([], [])})
    with pytest.raises(ValueError, match="user 'a' has no samples"):
        _dm(str(empty), tmp_path, name="femnist").setup()
    lab = tmp_path / "label"
    _write_leaf(str(lab / "train" / "y.json"), {"a": (np.zeros((2, 784)).tolist(), [3, 62])})
    with pytest.raises(ValueError, match="y.json: user 'a', sample 1: label 62 is outside the class range"):
        _dm(str(lab), tmp_path, name="femnist").setup()
    shape = tmp_path / "shape"
    _write_leaf(str(shape / "train" / "s.json"), {"a": (np.zeros((2, 10)).tolist(), [3, 4])})
    with pytest.raises(ValueError, match="s.json: FEMNIST inputs must have 784 values"):
        _dm(str(shape), tmp_path, name="femnist").setup()
    mism = tmp_path / "mismatch"
    os.makedirs(mism / "train")
    with open(mism / "train" / "m.json", "w") as f:
        json.dump({"users": ["a"], "num_samples": [3], "user_data": {"a": {"x": [[0.0] * 784], "y": [1]}}}, f)
    with pytest.raises(ValueError, match="declares num_samples=3 but has 1"):
        _dm(str(mism), tmp_path, name="femnist").setup()
    nokey = tmp_path / "nokey"
    os.makedirs(nokey / "train")
    (nokey / "train" / "k.json").write_text('{"users": []}')
    with pytest.raises(ValueError, match="k.json has no 'user_data' key"):
        _dm(str(nokey), tmp_path, name="femnist").setup()
    root, _, _ = femnist_dir
    for kw, match in (
        ({"user_fraction": 0.0}, "user_fraction"),
        ({"min_samples": -1}, "min_samples"),
        ({"train_fraction": 1.5}, "train_fraction"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_users": 0}, "num_users"),
    ):
        with pytest.raises(ValueError, match=match):
            _dm(root, tmp_path, name="femnist", **kw)
    with pytest.raises(ValueError, match="no user left"):
        _dm(root, tmp_path, name="femnist", min_samples=100).setup()


def _raw_leaf(folder, data):
    os.makedirs(folder / "train")
    with open(folder / "train" / "d.json", "w") as f:
        json.dump(data, f)
    return str(folder)


def _one_user(**changes):
    data = {"users": ["a"], "num_samples": [2], "user_data": {"a": {"x": [[0.5] * 784, [0.25] * 784], "y": [3, 4]}}}
    for key, value in changes.items():
        if key in ("x", "y"):
            data["user_data"]["a"][key] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"y": [3.5, 4]}, r"d.json: user 'a', sample 0: the label 3.5 is not a class id"),  # Arrow: class 3
        ({"y": [3, True]}, r"d.json: user 'a', sample 1: the label True is not a class id"),
        ({"y": [3, "4"]}, r"d.json: user 'a', sample 1: the label '4' is not a class id"),
        ({"num_samples": [5.7]}, r"d.json: user 'a' declares num_samples=5.7 but has 2 samples"),
        ({"num_samples": 2}, r"d.json: 'num_samples' must be a JSON list, got 2"),
        ({"users": "a"}, r"d.json: 'users' must be a JSON list"),
        ({"users": [["a"]]}, r"d.json: user \['a'\] in 'users' is not a string"),  # was a TypeError of Arrow's reader
        ({"users": [{"id": "a"}]}, r"d.json: user \{'id': 'a'\} in 'users' is not a string"),
        ({"users": [7]}, r"d.json: user 7 in 'users' is not a string"),
        ({"y": 5}, r"d.json: user_data\['a'\] must have 'x' and 'y' lists"),
        ({"x": [[0.5] * 783 + ["dark"], [0.25] * 784]}, r"d.json: user 'a', sample 0: the input is not a list of"),
        # Arrow casts these without a word (0.75, 1.0)
        ({"x": [[0.5] * 784, [0.25] * 783 + ["0.75"]]}, r"d.json: user 'a', sample 1: the input is not a list of"),
        ({"x": [[0.5] * 783 + [True], [0.25] * 784]}, r"d.json: user 'a', sample 0: the input is not a list of"),
        ({"y": [3, 2**70]}, r"d.json: user 'a', sample 1: the label 1180591620717411303424 is outside int64"),
        ({"x": [[0.5] * 784, [0.25] * 783 + [10**30]]}, r"d.json: user 'a', sample 1: the input is not a list of"),
    ],
)  # fmt: skip
def test_malformed_femnist_json_names_file_user_and_sample(tmp_path, changes, match):
    root = _raw_leaf(tmp_path / "leaf", _one_user(**changes))
    with pytest.raises(ValueError, match=match):
        _dm(root, tmp_path, name="femnist").setup()


@pytest.mark.parametrize("how", ["escaped string", "utf-16 true"])
def test_string_and_boolean_pixels_are_refused_however_the_file_spells_them(tmp_path, how):
    """The quick byte scan for quoted numbers and true/false missed a pixel written as the JSON string "\\u0030.75"
    and a UTF-16 file (json reads it; its bytes hold no b"true"): Arrow then served 0.75 and 1.0 as pixels."""
    folder = tmp_path / "leaf" / "train"
    folder.mkdir(parents=True)
    if how == "escaped string":
        text = json.dumps(_one_user()).replace("0.25", '"\\u0030.75"', 1)
        (folder / "d.json").write_text(text)
    else:
        (folder / "d.json").write_bytes(json.dumps(_one_user(x=[[0.5] * 783 + [True], [0.25] * 784])).encode("utf-16"))
    with pytest.raises(ValueError, match=r"d.json: user 'a', sample [01]: the input is not a list of numbers"):
        _dm(str(tmp_path / "leaf"), tmp_path, name="femnist").setup()


@pytest.mark.parametrize(
    "name, field, value, match",
    [
        ("sent140", "x", None, r"sample 0: Sent140 inputs must be LEAF's 5-field lists .* got None"),
        ("sent140", "x", {"text": "hi"}, r"sample 0: Sent140 inputs must be LEAF's 5-field lists"),
        ("sent140", "x", ["1", "d", "q", "u", 7], r"sample 0: Sent140 inputs must be LEAF's 5-field lists"),
        ("shakespeare", "y", 5, r"sample 0: the Shakespeare target 5 is not a string"),
        ("shakespeare", "x", 7, r"sample 0: the Shakespeare input 7 is not a string"),
    ],
)
def test_sent140_and_shakespeare_samples_of_another_type_are_refused(tmp_path, name, field, value, match):
    """str() had turned a null tweet into the word "none", an object into its repr, and an integer Shakespeare
    target into the character '5'; each is now refused naming the file, user and sample."""
    if name == "sent140":
        x, y = ["1", "date", "NO_QUERY", "user", "good day"], 1
    else:
        x, y = "a" * 80, "b"
    sample = {"x": x, "y": y, field: value}
    data = {"users": ["a"], "num_samples": [1], "user_data": {"a": {"x": [sample["x"]], "y": [sample["y"]]}}}
    root = _raw_leaf(tmp_path / "leaf", data)
    with pytest.raises(ValueError, match=r"d.json: user 'a', " + match):
        _dm(root, tmp_path, name=name).setup()


def test_whole_float_labels_and_counts_are_read_as_ints(tmp_path):
    # a user id that starts with a digit looks like a quoted pixel to the quick test: the exact scan finds none
    root = _raw_leaf(tmp_path / "leaf", {**_one_user(y=[3.0, 4], num_samples=[2.0]), "users": ["7a"]})
    data = json.load(open(os.path.join(root, "train", "d.json")))
    data["user_data"] = {"7a": data["user_data"].pop("a")}
    with open(os.path.join(root, "train", "d.json"), "w") as f:
        json.dump(data, f)
    dm = _dm(root, tmp_path, name="femnist", val_fraction=0.0)
    dm.setup()
    sets = (dm.train_dataset, dm.test_dataset)  # a train folder alone: LEAF's own split of each user's samples
    assert sorted(int(d[i][1]) for d in sets for i in range(len(d))) == [3, 4]


@pytest.mark.parametrize("damage", ["truncated", "bytes flipped"])
def test_a_damaged_arrow_cache_is_rebuilt_from_the_json_files(femnist_dir, tmp_path, damage):
    """Arrow maps its cache and reads whatever it holds: a cache file cut short (unreadable) or with bytes flipped
    (read silently before) is found (its CRC-32 recorded when first read), deleted and built again, with a warning;
    the data equal the first read's."""
    import glob

    root, _, _ = femnist_dir

    def load():
        dm = _dm(root, tmp_path, name="femnist", val_fraction=0.0)
        dm.setup()
        return dm.train_dataset.x.clone(), dm.train_dataset.y.clone()

    x0, y0 = load()
    (arrow,) = glob.glob(str(tmp_path / "hf_cache" / "**" / "*.arrow"), recursive=True)
    data = bytearray(open(arrow, "rb").read())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0x55 for b in data[middle : middle + 64])
    open(arrow, "wb").write(bytes(data))
    with pytest.warns(UserWarning, match=r"LEAF femnist: the Arrow cache in .* is damaged .*building it again"):
        x1, y1 = load()
    assert torch.equal(x1, x0) and torch.equal(y1, y0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt: read again without a warning
        x2, _ = load()
    assert torch.equal(x2, x0)


def test_bad_parquet_files_are_named(tmp_path):
    """Hostile parquet inputs (the hostile-input corpus): a truncated file, a file that is not parquet, a table without
    the client column, and labels outside the class range each fail with an error naming the file or the value."""
    import pandas as pd

    text = "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name; Or if thou wilt not, " * 2
    xs, ys = _windows(text)
    good = pd.DataFrame({"character_id": ["JULIET"] * 10, "x": xs[:10], "y": ys[:10]})

    def load(root):
        LeafDataModule(name="shakespeare", data_dir=str(root), cache_dir=str(tmp_path / "hf_cache")).setup()

    trunc = tmp_path / "trunc"
    trunc.mkdir()
    good.to_parquet(trunc / "train-0.parquet")
    data = (trunc / "train-0.parquet").read_bytes()
    (trunc / "train-0.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="train-0.parquet"):
        load(trunc)

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "train-0.parquet").write_text("users,x,y\nJULIET,abc,d\n")
    with pytest.raises(ValueError, match="train-0.parquet"):
        load(junk)

    nocol = tmp_path / "nocol"
    nocol.mkdir()
    good.rename(columns={"character_id": "speaker"}).to_parquet(nocol / "train-0.parquet")
    with pytest.raises(ValueError, match="character_id"):
        load(nocol)


@pytest.mark.parametrize("case", ["fractional femnist label", "integer shakespeare target", "null shakespeare target",
                                  "damaged png", "nan pixels", "pixels out of range", "text pixels",
                                  "image without bytes", "integer shakespeare input",
                                  "null shakespeare input"])  # fmt: skip
def test_parquet_values_a_cast_would_change_are_refused_naming_the_file(tmp_path, case):
    """The Flower-hub parquet layout: a FEMNIST label 3.5 was served as class 3 (the JSON layout refuses it), integer
    or null Shakespeare targets failed with a bare TypeError, and an unreadable PNG with PIL's error naming no file;
    pixel lists of NaN were served as 0 and values outside [0, 255] clipped, in silence; text pixels, an image
    without bytes and integer or null Shakespeare inputs failed naming no file."""
    import io

    import pandas as pd
    from PIL import Image

    root = tmp_path / "pq"
    root.mkdir()
    if "shakespeare input" in case:
        inputs = [1, 2, 3, 4] if case.startswith("integer") else ["a" * 80, None, "a" * 80, "a" * 80]
        frame = pd.DataFrame({"character_id": ["JULIET"] * 4, "x": inputs, "y": ["b", "c", "d", "e"]})
        name = "shakespeare"
        match = r"train-0.parquet: Shakespeare inputs must be 80-character strings, got (values of type|a missing)"
    elif "shakespeare" in case:
        targets = [5, 6, 7, 8] if case.startswith("integer") else ["b", "c", None, "d"]
        frame = pd.DataFrame({"character_id": ["JULIET"] * 4, "x": ["a" * 80] * 4, "y": targets})
        name, match = "shakespeare", r"train-0.parquet: Shakespeare targets must be single characters, got (5|None)"
    elif "pixels" in case:
        pixels = {"nan pixels": [float("nan")] * 784, "pixels out of range": [-5.0] + [1000.0] * 783}
        images = [[0.5] * 784, pixels[case]] if case in pixels else ["not-an-image", "nor-this"]
        frame = pd.DataFrame({"x": images, "writer_id": ["f0", "f1"], "character": [1, 2]})
        name = "femnist"
        match = {
            "nan pixels": r"train-0.parquet: an image of column 'x' holds non-finite pixel values",
            "pixels out of range": r"train-0.parquet: the pixel values of column 'x' must lie in \[0, 1\] or "
            r"\[0, 255\], got an image with values in \[-5, 1000\]",
            "text pixels": r"train-0.parquet: an image of column 'x' is neither an image file nor a list of pixel",
        }[case]
    else:
        png = io.BytesIO()
        Image.fromarray(RNG.integers(0, 256, (28, 28)).astype(np.uint8)).save(png, format="PNG")
        good = {"bytes": png.getvalue(), "path": None}
        if case == "damaged png":
            images, labels = [good, {"bytes": b"\x89PNG damaged", "path": None}], [1, 2]
            match = r"train-0.parquet: an image of column 'image' is not a readable image file"
        elif case == "image without bytes":
            images, labels = [good, {"bytes": None, "path": "/etc/hostname"}], [1, 2]
            match = r"train-0.parquet: an image of column 'image' has no image bytes"
        else:
            images, labels = [good, good], [1.0, 3.5]
            match = r"train-0.parquet: the label 3.5 is not a class id"
        frame = pd.DataFrame({"image": images, "writer_id": ["f0", "f1"], "character": labels})
        name = "femnist"
    frame.to_parquet(root / "train-0.parquet")
    with pytest.raises(ValueError, match=match):
        LeafDataModule(name=name, data_dir=str(root), cache_dir=str(tmp_path / "hf_cache")).setup()


def test_a_cut_short_cache_info_file_is_rebuilt(femnist_dir, tmp_path):
    """The cache's dataset_info.json cut short (an interrupted write) ended setup in a bare JSONDecodeError naming no
    file; it is now a damaged cache, rebuilt with a warning, with the same data."""
    import glob

    root, _, _ = femnist_dir

    def load():
        dm = _dm(root, tmp_path, name="femnist", val_fraction=0.0)
        dm.setup()
        return dm.train_dataset.x.clone()

    x0 = load()
    infos = glob.glob(str(tmp_path / "hf_cache" / "**" / "dataset_info.json"), recursive=True)
    assert infos
    for path in infos:
        text = open(path).read()
        open(path, "w").write(text[:40])
    with pytest.warns(UserWarning, match=r"LEAF femnist: the Arrow cache in .* is damaged \(JSONDecodeError"):
        x1 = load()
    assert torch.equal(x1, x0)
