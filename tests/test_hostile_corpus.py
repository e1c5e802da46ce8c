"""A hostile corpus, walked through ``train.py``: every bad checkpoint, data file and config ends the run with exit
code 1 and ONE last stderr line ``error: ...`` that names the file (or config key) and the offending value.

The corpus is generated here, in the exact on-disk formats the project reads (Lightning checkpoints written by a
real run, LEAF JSON, CIFAR python pickles, YAML configs), then each entry is run in process through
``fedlightning.cli.main``. A case lists the texts its last line must contain; the file's path is always one of them
for a file case, the config key for a config case. Nothing in the corpus may execute code: the evil pickles would
create a marker file, which must never appear.
"""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from fedlightning.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.path.join(ROOT, "configs", "quickstart.yaml")
QUIET = [
    "--trainer.logger",
    "false",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--test_after_fit",
    "false",
    "--trainer.limit_val_batches",
    "0",
]
TINY = [
    "--config",
    QUICK,
    "--trainer.max_steps",
    "1",
    *QUIET,
    "--data.init_args.num_clients",
    "10",
    "--model.clients_per_round",
    "2",
    "--model.local_steps",
    "1",
]


class _Evil:
    """Unpickling this object would create ``marker`` (through ``os.system``): the corpus's code-execution probe."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    return info.value.code, err, err.rstrip("\n").split("\n")[-1]


def _assert_one_line(code, err, last, needles):
    assert code == 1, err[-3000:]
    assert last.startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in last, f"{needle!r} not in the last line {last!r}"
    for dump in ("usage:", "Does not validate against", "Traceback"):
        assert dump not in err, err[-3000:]


# ====================================================================== checkpoints
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A real checkpoint of the tiny quickstart run (1 round), as train.py writes it."""
    root = tmp_path_factory.mktemp("good")
    main(["fit", *TINY, "--trainer.default_root_dir", str(root)], run=True)
    found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".ckpt")]
    assert found, "the tiny run wrote no checkpoint"
    return torch.load(sorted(found)[0], map_location="cpu", weights_only=True)


def _evil_ckpt(good, marker):
    ckpt = dict(good)
    ckpt["payload"] = _Evil(marker)
    return ckpt


def _nan_weights(good):
    ckpt = dict(good)
    ckpt["state_dict"] = {
        k: (torch.full_like(v, float("nan")) if v.is_floating_point() else v) for k, v in good["state_dict"].items()
    }
    return ckpt


def _other_architecture(good):
    ckpt = dict(good)
    ckpt["state_dict"] = {
        k: (torch.zeros(3, *v.shape[1:]) if v.dim() == 2 else v) for k, v in good["state_dict"].items()
    }
    return ckpt


def _foreign(good):
    return {k: v for k, v in good.items() if k != "fedlightning"}


def _future_format(good):
    ckpt = dict(good)
    ckpt["fedlightning"] = {**good["fedlightning"], "format": 99}
    return ckpt


# (id, writer of the file: (path, good checkpoint, marker) -> None, texts of the last line besides the path)
CHECKPOINTS = [
    ("missing", None, ["file not found"]),
    ("directory", lambda p, g, m: os.makedirs(p), ["is a directory"]),
    ("empty", lambda p, g, m: open(p, "wb").close(), ["empty (0 bytes)"]),
    (
        "random bytes",
        lambda p, g, m: open(p, "wb").write(np.random.default_rng(0).bytes(4096)),
        ["corrupt, truncated or not a checkpoint"],
    ),
    ("truncated", lambda p, g, m: (torch.save(g, p), _truncate(p)), ["corrupt, truncated or not a checkpoint"]),
    ("not a Lightning checkpoint", lambda p, g, m: torch.save({"weights": torch.zeros(3)}, p), ["no 'state_dict'"]),
    ("another LightningModule", lambda p, g, m: torch.save(_foreign(g), p), ["not of a FederatedLoop"]),
    ("future format", lambda p, g, m: torch.save(_future_format(g), p), ["format 99"]),
    (
        "another architecture",
        lambda p, g, m: torch.save(_other_architecture(g), p),
        ["do not fit the configured model", "(3, 64) vs (128, 64)"],
    ),
    ("code on load", lambda p, g, m: torch.save(_evil_ckpt(g, m), p), ["os.system", "--weights_only false"]),
    ("non-finite weights", lambda p, g, m: torch.save(_nan_weights(g), p), ["non-finite", "nan"]),
]


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
@pytest.mark.parametrize("case", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_hostile_checkpoint(case, subcommand, good_checkpoint, tmp_path, capsys):
    name, write, needles = case
    path = str(tmp_path / "hostile.ckpt")
    marker = str(tmp_path / "code-ran")
    if write is not None:
        write(path, good_checkpoint, marker)
    args = [subcommand, *TINY, "--trainer.default_root_dir", str(tmp_path / "root"), "--ckpt_path", path]
    if subcommand != "fit":  # --test_after_fit is an option of fit only
        i = args.index("--test_after_fit")
        del args[i : i + 2]
    code, err, last = _run(args, capsys)
    _assert_one_line(code, err, last, [f"checkpoint {path}:"] + needles)
    assert not os.path.exists(marker), "loading the checkpoint ran code"


def test_planted_last_checkpoint(good_checkpoint, tmp_path, capsys):
    """An evil file planted among a config's runs is refused by ``--ckpt_path last``, naming it; no code runs."""
    root = tmp_path / "root"
    main(["fit", *TINY, "--trainer.default_root_dir", str(root)])
    ckpts = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".ckpt")]
    planted = os.path.join(os.path.dirname(ckpts[0]), "last-v1.ckpt")
    marker = str(tmp_path / "code-ran")
    ckpt = _evil_ckpt(good_checkpoint, marker)
    ckpt["global_step"] = 10**6  # would be the newest round
    torch.save(ckpt, planted)
    code, err, last = _run(["fit", *TINY, "--trainer.default_root_dir", str(root), "--ckpt_path", "last"], capsys)
    _assert_one_line(code, err, last, [f"checkpoint {planted}:", "os.system"])
    assert not os.path.exists(marker)


# ====================================================================== data files
def _femnist_user(rng, n):
    return {"x": np.round(rng.random((n, 784)), 3).tolist(), "y": rng.integers(0, 62, n).tolist()}


def _leaf_json(users, num_samples=None, names=None):
    names = list(users) if names is None else names
    return {"users": names, "num_samples": num_samples or [len(users[u]["y"]) for u in names], "user_data": users}


def _leaf_dir(tmp_path, train_doc, test_doc=None, raw_train=None):
    root = tmp_path / "femnist"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    train_file = root / "train" / "all_data_0_niid_train.json"
    if raw_train is not None:
        train_file.write_text(raw_train)
    else:
        train_file.write_text(json.dumps(train_doc))
    rng = np.random.default_rng(1)
    test_users = {u: _femnist_user(rng, 2) for u in ("f_0", "f_1", "f_2", "f_3")}
    (root / "test" / "all_data_0_niid_test.json").write_text(json.dumps(test_doc or _leaf_json(test_users)))
    return str(root), str(train_file)


def _good_users():
    rng = np.random.default_rng(0)
    return {u: _femnist_user(rng, n) for u, n in (("f_0", 6), ("f_1", 5), ("f_2", 7), ("f_3", 4))}


def _with(users, user, key, index, value):
    users[user][key][index] = value
    return users


def _leaf_case_duplicate():
    users = _good_users()
    return _leaf_json(users, names=["f_0", "f_1", "f_2", "f_3", "f_1"], num_samples=[6, 5, 7, 4, 5]), ["f_1"]


def _leaf_case_count():
    users = _good_users()
    return _leaf_json(users, num_samples=[6, 9, 7, 4]), ["f_1", "9", "5"]


def _leaf_case_nan():
    users = _good_users()
    users["f_2"]["x"][3][10] = float("nan")
    return _leaf_json(users), ["nan", "f_2"]


def _leaf_case_label():
    users = _with(_good_users(), "f_3", "y", 1, 99)
    return _leaf_json(users), ["user 'f_3', sample 1: label 99"]


def _leaf_case_negative_label():
    users = _with(_good_users(), "f_0", "y", 0, -4)
    return _leaf_json(users), ["user 'f_0', sample 0: label -4"]


LEAF_CASES = [
    ("duplicate user", _leaf_case_duplicate),
    ("num_samples mismatch", _leaf_case_count),
    ("nan feature", _leaf_case_nan),
    ("label out of range", _leaf_case_label),
    ("negative label", _leaf_case_negative_label),
]

LEAF_ARGS = [
    "--data",
    "fedlightning.datamodules.LeafDataModule",
    "--data.init_args.name",
    "femnist",
    "--data.init_args.batch_size",
    "4",
    "--data.init_args.val_fraction",
    "0",
    "--model.model",
    "fedlightning.models.LogisticRegression",
    "--model.model.init_args.input_dim",
    "784",
    "--model.model.init_args.num_classes",
    "62",
    "--model.clients_per_round",
    "2",
    "--model.local_steps",
    "1",
    "--trainer.max_steps",
    "1",
    *QUIET,
]


def _leaf_run(tmp_path, capsys, data_dir):
    return _run(
        [
            "fit",
            "--config",
            QUICK,
            *LEAF_ARGS,
            "--trainer.default_root_dir",
            str(tmp_path / "root"),
            "--data.init_args.data_dir",
            data_dir,
            "--data.init_args.cache_dir",
            str(tmp_path / "cache"),
        ],
        capsys,
    )


@pytest.mark.parametrize("case", LEAF_CASES, ids=[c[0] for c in LEAF_CASES])
def test_hostile_leaf_file(case, tmp_path, capsys):
    _, make = case
    doc, needles = make()
    data_dir, train_file = _leaf_dir(tmp_path, doc)
    code, err, last = _leaf_run(tmp_path, capsys, data_dir)
    _assert_one_line(code, err, last, [os.path.basename(train_file)] + needles)


@pytest.mark.parametrize(
    "raw",
    ['{"users": ["f_0"], "num_samples": [1], "user_da', "[1, 2, 3]", ""],
    ids=["truncated JSON", "not an object", "empty file"],
)
def test_malformed_leaf_json(raw, tmp_path, capsys):
    data_dir, train_file = _leaf_dir(tmp_path, None, raw_train=raw)
    code, err, last = _leaf_run(tmp_path, capsys, data_dir)
    _assert_one_line(code, err, last, [os.path.basename(train_file)])


def test_good_leaf_corpus_trains(tmp_path):
    """The corpus's baseline: the same LEAF files without the defect train (so each case fails for its defect)."""
    data_dir, _ = _leaf_dir(tmp_path, _leaf_json(_good_users()))
    cli = main(
        [
            "fit",
            "--config",
            QUICK,
            *LEAF_ARGS,
            "--trainer.default_root_dir",
            str(tmp_path / "root"),
            "--data.init_args.data_dir",
            data_dir,
            "--data.init_args.cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    assert cli.trainer.global_step == 1


def _cifar_dir(tmp_path, bad_name, bad_bytes):
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (8, 3072)).astype(np.uint8), "labels": rng.integers(0, 10, 8).tolist()}
        with open(folder / name, "wb") as f:
            f.write(bad_bytes if name == bad_name else pickle.dumps(entry))
    return str(tmp_path / "cifar"), str(folder / bad_name)


CIFAR_ARGS = [
    "--data",
    "fedlightning.datamodules.Cifar10DataModule",
    "--data.init_args.num_clients",
    "4",
    "--data.init_args.batch_size",
    "4",
    "--data.init_args.val_fraction",
    "0",
    "--model.model",
    "fedlightning.models.LogisticRegression",
    "--model.model.init_args.input_dim",
    "3072",
    "--model.model.init_args.num_classes",
    "10",
    "--model.clients_per_round",
    "2",
    "--model.local_steps",
    "1",
    "--trainer.max_steps",
    "1",
    *QUIET,
]


@pytest.mark.parametrize("bad", ["evil", "truncated", "no labels"])
def test_hostile_cifar_pickle(bad, tmp_path, capsys):
    marker = str(tmp_path / "code-ran")
    entry = {"data": np.zeros((8, 3072), dtype=np.uint8), "labels": [0] * 8}
    payload = {
        "evil": pickle.dumps({**entry, "x": _Evil(marker)}),
        "truncated": pickle.dumps(entry)[:100],
        "no labels": pickle.dumps({"data": entry["data"]}),
    }[bad]
    data_dir, path = _cifar_dir(tmp_path, "data_batch_3", payload)
    code, err, last = _run(
        [
            "fit",
            "--config",
            QUICK,
            *CIFAR_ARGS,
            "--trainer.default_root_dir",
            str(tmp_path / "root"),
            "--data.init_args.data_dir",
            data_dir,
        ],
        capsys,
    )
    needles = [path] + (["system"] if bad == "evil" else [])  # os.system pickles as posix.system
    _assert_one_line(code, err, last, needles)
    assert not os.path.exists(marker), "reading the data file ran code"


# ====================================================================== configs
# (id, YAML config given after the quickstart, the key of the last line, the value it must name)
CONFIGS = [
    ("more clients per round than clients", "model:\n  clients_per_round: 500\n", "model.clients_per_round", "500"),
    ("K = 0", "model:\n  local_steps: 0\n", "model.local_steps", "0"),
    (
        "negative alpha",
        "data:\n  init_args:\n    partition:\n      class_path: fedlightning.datamodules.Dirichlet\n"
        "      init_args:\n        alpha: -0.5\n",
        "data.init_args.partition.init_args.alpha",
        "-0.5",
    ),
    (
        "nan alpha",
        "data:\n  init_args:\n    partition:\n      class_path: fedlightning.datamodules.Dirichlet\n"
        "      init_args:\n        alpha: .nan\n",
        "data.init_args.partition.init_args.alpha",
        "nan",
    ),
    ("string where a number goes", "model:\n  clients_per_round: many\n", "model.clients_per_round", "'many'"),
    ("list where a mapping goes", "model:\n  client_optimizer: [1, 2]\n", "model.client_optimizer", "[1, 2]"),
    ("negative batch size", "data:\n  init_args:\n    batch_size: -3\n", "data.init_args.batch_size", "-3"),
    ("validation fraction 1", "data:\n  init_args:\n    val_fraction: 1.0\n", "data.init_args.val_fraction", "1.0"),
    (
        "negative server lr",
        "trainer:\n  callbacks:\n    - class_path: fedlightning.callbacks.FedAvg\n"
        "      init_args:\n        server_lr: -1.0\n",
        "trainer.callbacks[0].init_args.server_lr",
        "-1.0",
    ),
    ("zero rounds", "trainer:\n  max_steps: 0\n", "trainer.max_steps", "0"),
    ("negative seed", "model:\n  seed: -7\n", "model.seed", "-7"),
    (
        "infinite lr",
        "model:\n  client_optimizer:\n    class_path: torch.optim.SGD\n    init_args:\n      lr: .inf\n",
        "model.client_optimizer.init_args.lr",
        "inf",
    ),
    ("misspelled key", "model:\n  local_stepz: 3\n", "model.local_stepz", "local_steps"),
]


@pytest.mark.parametrize("case", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_hostile_config_file(case, tmp_path, capsys):
    _, text, key, value = case
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    code, err, last = _run(
        ["fit", *TINY, "--trainer.default_root_dir", str(tmp_path / "root"), "--config", str(path)], capsys
    )
    _assert_one_line(code, err, last, [f"error: {key}: ", value])
