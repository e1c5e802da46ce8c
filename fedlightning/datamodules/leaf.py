"""LEAF federated data sets (Caldas et al. 2018) with their natural per-user clients: FEMNIST, Shakespeare, Sent140.

:class:`LeafDataModule` reads LEAF's JSON files or the Flower hub's parquet files offline through Hugging Face
``datasets`` (cached as Arrow files), applies LEAF's sampling options (``user_fraction`` / ``num_users``,
``min_samples``, the per-user train/test split) and holds out a per-user validation split. Layouts, per-task inputs
and targets, the sampling steps and the validation rule are in its docstring; :func:`tokenize_tweet` is LEAF's
Sent140 tokeniser.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import re
import shutil
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fedlightning._validation import in_range, integer
from fedlightning.datamodules.base import DEFAULT_VAL_FRACTION, ArrayDataset, FederatedDataModule, chronological_holdout
from fedlightning.datamodules.shakespeare import NUM_LETTERS, encode_chars

__all__ = ["LeafDataModule", "LEAF_TASKS", "file_digest", "tokenize_tweet"]

#: number of classes of each LEAF task (FEMNIST: 10 digits + 26 + 26 letters; Shakespeare: LEAF's 80 characters)
LEAF_TASKS: dict[str, int] = {"femnist": 62, "shakespeare": NUM_LETTERS, "sent140": 2}
_DEFAULT_USER_COLUMN = {"femnist": "writer_id", "shakespeare": "character_id", "sent140": "user"}
_TOKEN = re.compile(r"[\w']+|[.,!?;]")
_CACHE_VERSION = "leaf-v2"  # bump when the parsed representation or the cache key changes
_DIGEST_CHUNK = 1 << 20  # bytes read at a time when hashing a data file


def tokenize_tweet(text: str) -> list[str]:
    """LEAF's Sent140 tokeniser (``split_line``: words with apostrophes and the punctuation ``.,!?;``), lower-cased."""
    return _TOKEN.findall(text.lower())


@contextlib.contextmanager
def _quiet_datasets():
    import datasets

    was_disabled = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.enable_progress_bars()


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks: the Arrow cache key of the LEAF files.

    Keyed by content, a rewritten file is re-read even when its size and modification time are unchanged (a key of
    size and mtime served stale labels then). SHA-256 is the fastest of ``hashlib``'s digests on CPUs with SHA
    instructions (about 0.9 GB/s on this project's test machine, against 0.4 GB/s for BLAKE2b); hashing costs
    a small fraction of parsing the same JSON (ours)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_DIGEST_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- JSON -> Arrow
#: With ``true`` / ``false``, the bytes of a LEAF FEMNIST file that may belong to a pixel Arrow would cast without a
#: word (``"0.75"`` to 0.75, ``true`` to 1.0): a quoted number. Only a file that holds one is scanned value by value
#: (:func:`_first_unreadable_input`); a user id that starts with a digit costs that scan, not an error. The three
#: byte searches run at memory speed, a small part of parsing the file.
_QUOTED_NUMBER = re.compile(rb'"(?:[-+.0-9]|\\u)')

#: The range of the int64 labels and pixels Arrow stores (a JSON integer beyond it is refused by name).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _leaf_json_rows(files: list[str], splits: list[str], name: str, stamps: list[str]) -> Iterator[dict]:
    """One row per (file, user): ``{"file", "split", "user", "x", "y"}`` (``stamps`` only key the cache)."""
    for path, split in zip(files, splits):
        try:
            with open(path, "rb") as f:
                raw = f.read()
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed LEAF JSON file {path}: {e}") from None
        utf8 = json.detect_encoding(raw) == "utf-8"  # json also reads UTF-16/32, which the byte searches miss
        if name == "femnist" and (not utf8 or b"true" in raw or b"false" in raw or _QUOTED_NUMBER.search(raw)):
            where = _first_unreadable_input([path], name)  # the exact scan, only for a file that may need it
            if where is not None:
                raise ValueError(f"{where}: the input is not a list of numbers (a string or a true/false pixel)")
        if not isinstance(data, dict):
            raise ValueError(f"LEAF JSON file {path} must hold an object with users/num_samples/user_data")
        for key in ("users", "user_data"):
            if key not in data:
                raise ValueError(f"LEAF JSON file {path} has no {key!r} key (found {sorted(data)})")
        users, user_data = data["users"], data["user_data"]
        num_samples = data.get("num_samples", [None] * len(users) if isinstance(users, list) else None)
        for key, value, kind in (
            ("users", users, list),
            ("num_samples", num_samples, list),
            ("user_data", user_data, dict),
        ):
            if not isinstance(value, kind):
                raise ValueError(
                    f"{path}: {key!r} must be a JSON {'list' if kind is list else 'object'}, got {value!r:.80}"
                )
        if len(num_samples) != len(users):
            raise ValueError(f"{path}: {len(users)} users but {len(num_samples)} num_samples entries")
        for user, declared in zip(users, num_samples):
            if not isinstance(user, str):  # user_data's keys are JSON object keys, strings; a list is not hashable
                raise ValueError(f"{path}: user {user!r:.80} in 'users' is not a string (LEAF's user ids are)")
            if user not in user_data:
                raise ValueError(f"{path}: user {user!r} is listed in 'users' but has no entry in 'user_data'")
            entry = user_data[user]
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("x"), list)
                or not isinstance(entry.get("y"), list)
            ):
                raise ValueError(f"{path}: user_data[{user!r}] must have 'x' and 'y' lists")
            xs, ys = entry["x"], entry["y"]
            if len(xs) != len(ys):
                raise ValueError(f"{path}: user {user!r} has {len(xs)} inputs but {len(ys)} labels")
            if len(ys) == 0:
                raise ValueError(f"{path}: user {user!r} has no samples (LEAF files list only users with data)")
            if declared is not None and _whole_number(declared) != len(ys):
                raise ValueError(f"{path}: user {user!r} declares num_samples={declared!r} but has {len(ys)} samples")
            if name != "shakespeare" and not all(type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in ys):
                ys = [_class_id(v, path, user, i) for i, v in enumerate(ys)]
            if name == "sent140":
                xs = [_tweet_text(s, path, user, i) for i, s in enumerate(xs)]
            if name == "shakespeare":
                for what, values in (("input", xs), ("target", ys)):
                    bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
                    if bad is not None:
                        raise ValueError(
                            f"{path}: user {user!r}, sample {bad}: the Shakespeare {what} {values[bad]!r:.40} is not "
                            "a string"
                        )
            yield {"file": path, "split": split, "user": str(user), "x": xs, "y": ys}


def _whole_number(value) -> int | None:
    """``value`` as an int when it is a whole number (an int, not a bool, or a float with no fraction), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _class_id(value, path: str, user, index: int) -> int:
    """A LEAF label as a class id; a fraction, a bool, a string or null is an error naming the file, user and sample
    (Arrow would truncate 3.5 to class 3)."""
    whole = _whole_number(value)
    if whole is None:
        raise ValueError(
            f"{path}: user {user!r}, sample {index}: the label {value!r} is not a class id (a whole number)"
        )
    if not _INT64_MIN <= whole <= _INT64_MAX:
        raise ValueError(f"{path}: user {user!r}, sample {index}: the label {value!r} is outside int64")
    return whole


def _plain(value):
    """A numpy scalar as the Python value it holds (for messages); anything else unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def _tweet_text(sample, path: str, user, index: int) -> str:
    """The text of a Sent140 input: field 4 of LEAF's 5-field list (a plain string is taken as the text); anything
    else (null, an object, a number, a short list, a non-string text) is an error naming the file, user and sample
    (``str()`` would have turned null into the word "none")."""
    text = sample[4] if isinstance(sample, (list, tuple)) and len(sample) >= 5 else sample
    if not isinstance(text, str):
        raise ValueError(
            f"{path}: user {user!r}, sample {index}: Sent140 inputs must be LEAF's 5-field lists whose field 4 is the "
            f"tweet's text, got {sample!r:.80}"
        )
    return text


def _first_unreadable_input(files: list[str], name: str) -> str | None:
    """Where the first input of the LEAF files that Arrow cannot store as the data set's type is (``<file>: user
    <u>, sample <i>``), or None; run only after Arrow refused a row (it names neither file nor user)."""
    for path in files:
        with open(path, "rb") as f:
            data = json.loads(f.read())  # UTF-8, -16 or -32, as _leaf_json_rows reads it
        for user, entry in data["user_data"].items():
            for i, x in enumerate(entry["x"]):
                if name == "femnist":
                    ok = isinstance(x, list) and all(
                        isinstance(p, float) or (type(p) is int and _INT64_MIN <= p <= _INT64_MAX) for p in x
                    )
                else:
                    ok = isinstance(x, (str, list))
                if not ok:
                    return f"{path}: user {user!r}, sample {i}"
    return None


#: Suffix of the file next to each Arrow cache file holding its CRC-32, written when the cache is first read.
_CRC_SUFFIX = ".crc32"


def _crc32(path: str) -> str:
    value = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            value = zlib.crc32(chunk, value)
    return f"{value:08x} {os.path.getsize(path)}"


def _damaged_cache_file(ds) -> str | None:
    """A description of the first of ``ds``'s Arrow cache files whose bytes differ from the CRC-32 recorded next to
    it (a copy damaged after it was written: Arrow maps it and reads whatever it holds), else None; files without a
    record get one. Decision (ours): zlib's CRC-32 over 100 MB in the page cache takes 24 ms, little next to the JSON
    files' hashing that keys the cache."""
    for entry in getattr(ds, "cache_files", None) or []:
        path = entry["filename"]
        record = path + _CRC_SUFFIX
        actual = _crc32(path)
        if not os.path.isfile(record):
            with open(record, "w") as f:
                f.write(actual)
            continue
        with open(record) as f:
            expected = f.read().strip()
        if expected != actual:
            return f"{path} does not match the checksum recorded when it was written"
    return None


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _check_unique_users(split: str, users: list[str], files: list[str]) -> None:
    """A ValueError when a user has two rows (file, user) in one split: listed twice in a file's ``users``, or in two
    files of the split (its samples would be trained on twice, and a copy could land in validation)."""
    first: dict[str, str] = {}
    for user, path in zip(users, files):
        if user in first:
            where = (
                f"{path}: user {user!r} is listed twice in 'users'"
                if first[user] == path
                else f"user {user!r} is listed in two {split} files, {first[user]} and {path}"
            )
            raise ValueError(
                f"{where}; a LEAF user must appear once per split (its samples would be trained on twice and could "
                f"leak into the validation split)"
            )
        first[user] = path


def _json_features(name: str):
    from datasets import Features, Sequence, Value

    x = {
        "femnist": Sequence(Sequence(Value("float32"))),
        "shakespeare": Sequence(Value("string")),
        "sent140": Sequence(Value("string")),
    }[name]
    y = Sequence(Value("string")) if name == "shakespeare" else Sequence(Value("int64"))
    return Features({"file": Value("string"), "split": Value("string"), "user": Value("string"), "x": x, "y": y})


# ---------------------------------------------------------------------------------------------- in-memory form
@dataclass
class _Part:
    """Samples of one split: ``x`` (numpy, first axis = sample; for sent140 a list of strings), ``y`` int64 and
    ``user`` (int code per sample into the module's user list)."""

    x: object
    y: np.ndarray
    user: np.ndarray


def _take(x, idx: np.ndarray):
    if isinstance(x, list):
        return [x[i] for i in idx.tolist()]
    if len(idx) and idx[-1] - idx[0] + 1 == len(idx) and bool((np.diff(idx) == 1).all()):
        return x[idx[0] : idx[-1] + 1]  # already user-contiguous (the usual case): a view, no copy of the inputs
    return x[idx]


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor owning writable memory (views into the memory-mapped Arrow cache are read-only: copied once)."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def _concat(parts: list[object]):
    if isinstance(parts[0], list):
        return [s for p in parts for s in p]
    return np.concatenate(parts)


class LeafDataModule(FederatedDataModule):
    r"""LEAF natural-split data: layouts, tasks and sampling below.

    Two on-disk layouts are read, both offline, through Hugging Face ``datasets`` (results cached as Arrow files, so a
    second run memory-maps them instead of re-parsing):

    * **LEAF JSON** (what LEAF's ``preprocess.sh`` writes): ``<data_dir>/train/*.json`` and ``<data_dir>/test/*.json``
      (or ``*.json`` directly in ``data_dir``, e.g. ``all_data/``, which has no split), each file
      ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``.
      Hugging Face's ``json`` builder cannot read this layout: the per-user keys of ``user_data`` make the Arrow schema
      differ from file to file, and the build fails as soon as two files hold different users. The files are therefore
      parsed here (with clear errors naming the file) and streamed, one row per (file, user), into
      ``datasets.Dataset.from_generator``, fingerprinted by the files' paths and the SHA-256 of their bytes
      (:func:`file_digest`), so a rewritten file is parsed again even with its old size and modification time.
    * **Flower hub parquet** (``flwrlabs/femnist``: columns ``image``, ``writer_id``, ``hsf_id``, ``character``;
      ``flwrlabs/shakespeare``: ``character_id``, ``x``, ``y``): one row per sample, read with the ``parquet`` (or
      ``csv``) builder; files whose name contains ``test`` form the test split, the others the train split. FEMNIST
      PNG images are decoded once (a cached ``map``). The builder's config is named by the files' SHA-256 (``datasets``
      itself keys local files by their modification time only).

    Per task (``name``): inputs / targets / classes.

    * ``femnist``: 784 pixel values in [0, 1] (float32; LEAF stores ``grey/255`` of the 28×28 image, Flower's PNGs are
      decoded the same way), label in [0, 62). Models reshape flat rows to 1×28×28.
    * ``shakespeare``: 80 character codes of LEAF's vocabulary (uint8, see :mod:`.shakespeare`), target the next
      character's code in [0, 80).
    * ``sent140``: tweet text (LEAF's ``x[4]``) as token ids of the ``vocab_size`` most frequent training tokens
      (int32, padded with -1, tokens outside the vocabulary dropped; tokeniser: LEAF's ``[\w']+|[.,!?;]`` on lower-cased
      text), label in {0, 1}. Use :class:`~fedlightning.models.BagOfWordsLinear` (seed 004's normalised BoW linear
      model).

    LEAF's sampling options, applied in LEAF's order (``sample.py`` → ``remove_users.py`` → ``split_data.py``):

    1. ``user_fraction``: a seeded random subset of ``max(1, round(f · U))`` users (LEAF's ``--sf`` draws random users
       until a fraction of the *samples* is reached; counting users instead is our simplification).
       ``num_users`` (ours) instead fixes the number of clients exactly: after steps 2 and 3, a seeded random subset of
       that many of the remaining users is kept (papers that state a client count, e.g. seed 004's 3,000 FEMNIST
       clients, seed 002's 100 clients).
    2. ``min_samples``: users with fewer samples (train + test) are removed (LEAF ``-k``).
    3. Per-user train/test split. ``train_fraction=None`` keeps the split on disk when there is one; a number (or data
       without a test part, where LEAF's default 0.9 is used) re-splits every user's pooled samples with LEAF's
       ``-t sample`` rule: ``n_train = max(1, int(f · n))`` (1 when ``n = 2``), users with ``n < 2`` dropped; FEMNIST
       and Sent140 draw the train samples at random (one seeded generator, users in order); Shakespeare keeps the order
       and leaves a gap of 79 windows (train = first ``n_train``, test from ``n_train + 79``) so test targets never
       appear in a train window. Users left without a train or a test sample are dropped (LEAF keeps only users with
       both).

    Checks of the JSON layout (ValueErrors name the file and the user): a user listed twice in a file's ``users``,
    or in two files of one split (train or test); ``num_samples[i]`` different from the length of that user's
    ``user_data[...]["y"]``; a user without samples, inputs and labels of different lengths, labels outside the task's
    classes, inputs of the wrong size. Test users without a training sample (on-disk split kept) are left out with
    their test samples, with a warning that counts and names them (decision, ours: LEAF's model code trains and tests
    the same users, and the global test set stays the union of the clients' test parts, as for the users that
    ``user_fraction`` and ``num_users`` leave out; ``train_fraction=`` pools and re-splits them instead). Non-finite
    inputs and labels are checked by :class:`~fedlightning.datamodules.FederatedDataModule` at setup; its messages
    name the client, the user and the user's files.

    Clients are the kept users, in order of first appearance (files sorted by name); ``client_names`` holds their ids.
    The train set is stored user-contiguous, so each client's index array is a range; ``client_test_indices`` index the
    (user-contiguous) test set, which is also the global test set.

    Validation (ours; :class:`~fedlightning.datamodules.FederatedDataModule`): every kept user holds out
    ``floor(val_fraction · n_train)`` of its train samples (default ``val_fraction`` 0.1), so validation has the same
    user population. FEMNIST and Sent140 draw them at random (seeded by ``(seed, "val")``, users in order); Shakespeare
    holds out the user's last train windows after a gap of 79 windows (as for LEAF's test windows; overlapping windows
    would otherwise put validation targets inside training inputs). Users too small to give one sample keep all;
    ``client_val_indices`` lists every user's validation rows. The Sent140 vocabulary is built from the whole train part
    (validation included: it holds no labels).

    Args:
        name: ``"femnist"``, ``"shakespeare"`` or ``"sent140"``.
        data_dir: the data folder (LEAF's ``data/`` with ``train/`` and ``test/``, an ``all_data/`` folder of JSON
            files, or a folder of Flower-hub parquet / csv files).
        user_fraction: fraction of users kept (seeded), in (0, 1]. Default 1.
        min_samples: minimum samples (train + test) per user, LEAF's ``-k``. Default 0.
        train_fraction: ``None`` keeps the on-disk split (LEAF's default 0.9 where there is none); a number in
            (0, 1) re-splits each user with LEAF's rule.
        num_users: keep exactly this many users (seeded, after the other filters); default all.
        user_column: user id column of the parquet/csv layout (default ``writer_id`` for FEMNIST, ``character_id``
            for Shakespeare).
        vocab_size: Sent140 vocabulary size (seed 004: 5000 most frequent training tokens).
        cache_dir: Hugging Face ``datasets`` cache folder (default: the library's).
        batch_size: client batch size; default 50 (seed 000).
        seed, eval_batch_size, num_workers, rounds_per_epoch: as :class:`FederatedDataModule`; ``seed`` drives
            ``user_fraction``, ``num_users``, the per-user random split and the validation hold-out.
        val_fraction: per-user fraction of the train samples held out for validation (see above); default
            0.1 (ours), ``0`` disables validation.
    """

    def __init__(
        self,
        name: str = "femnist",
        data_dir: str = "data/leaf/femnist",
        user_fraction: float = 1.0,
        min_samples: int = 0,
        train_fraction: float | None = None,
        num_users: int | None = None,
        user_column: str | None = None,
        vocab_size: int = 5000,
        cache_dir: str | None = None,
        batch_size: int = 50,
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
        if name not in LEAF_TASKS:
            raise ValueError(f"unknown LEAF data set name {name!r}; choose one of {sorted(LEAF_TASKS)}")
        self.num_users = integer("num_users", num_users, allow_none=True)
        self.name = name
        self.data_dir = data_dir
        self.user_fraction = in_range("user_fraction", user_fraction, 0.0, 1.0, low_closed=False, high_closed=True)
        self.min_samples = integer("min_samples", min_samples, 0)
        self.train_fraction = in_range("train_fraction", train_fraction, 0.0, 1.0, low_closed=False, allow_none=True)
        self.user_column = user_column or _DEFAULT_USER_COLUMN[name]
        self.vocab_size = integer("vocab_size", vocab_size)
        self.cache_dir = cache_dir
        self.num_classes = LEAF_TASKS[name]
        self.seq_length = 80
        self.client_names: list[str] = []
        self.num_dropped_users = 0
        self.vocabulary: list[str] | None = None
        self._natural: list[np.ndarray] = []
        self._files: list[str] = []  # the data files (their index names a client's file in error messages)
        self._pending_files: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._client_files: dict[str, np.ndarray] = {}  # split -> index into _files of every client's file
        self._resplit = False

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> tuple[str, dict[str, list[str]]]:
        root = self.data_dir
        if not os.path.isdir(root):
            raise FileNotFoundError(
                f"LEAF data_dir {root!r} does not exist; put LEAF's preprocessed data there (data/train/*.json and "
                f"data/test/*.json from `./preprocess.sh` in leaf/data/{self.name}), or the Flower hub parquet files"
            )
        tr = sorted(glob.glob(os.path.join(root, "train", "*.json")))
        te = sorted(glob.glob(os.path.join(root, "test", "*.json")))
        if tr or te:
            if not tr:
                raise FileNotFoundError(f"{root}/test has JSON files but {root}/train has none")
            return "json", {"train": tr, "test": te}
        flat = sorted(glob.glob(os.path.join(root, "*.json")))
        if flat:
            return "json", {"train": flat, "test": []}
        for ext in ("parquet", "csv"):
            files = sorted(glob.glob(os.path.join(root, "**", f"*.{ext}"), recursive=True))
            if files:
                test = [f for f in files if "test" in os.path.basename(f).lower()]
                train = [f for f in files if f not in test]
                if not train:
                    raise FileNotFoundError(f"{root}: only test {ext} files found ({test})")
                return ext, {"train": train, "test": test}
        raise FileNotFoundError(
            f"no LEAF data under {root!r}: expected train/*.json + test/*.json (LEAF), *.json, or *.parquet / *.csv"
        )

    # ------------------------------------------------------------------ reading
    def _read_json(self, files: dict[str, list[str]], users: dict[str, int]) -> dict[str, _Part | None]:
        import datasets
        import pyarrow

        paths = files["train"] + files["test"]
        splits = ["train"] * len(files["train"]) + ["test"] * len(files["test"])
        stamps = [f"{os.path.abspath(p)}:{file_digest(p)}" for p in paths]
        fingerprint = hashlib.sha256("|".join([_CACHE_VERSION, self.name] + stamps).encode()).hexdigest()[:32]
        root = str(self.cache_dir or datasets.config.HF_DATASETS_CACHE)
        for attempt in (0, 1):
            problem = None
            with _quiet_datasets():
                try:
                    ds = datasets.Dataset.from_generator(
                        _leaf_json_rows,
                        features=_json_features(self.name),
                        cache_dir=self.cache_dir,
                        gen_kwargs={"files": paths, "splits": splits, "name": self.name, "stamps": stamps},
                        fingerprint=fingerprint,
                    )
                except (
                    datasets.exceptions.DatasetGenerationError,
                    pyarrow.ArrowException,
                    OSError,
                    json.JSONDecodeError,  # a cache's dataset_info.json cut short
                ) as e:
                    # surface our own error naming the file; Arrow's own refusals (a string pixel) name none
                    generating = isinstance(e, datasets.exceptions.DatasetGenerationError)
                    cause = e.__cause__ if generating else e
                    ours = isinstance(cause, (ValueError, OSError)) and not isinstance(cause, pyarrow.ArrowException)
                    if generating and ours:
                        raise cause from None
                    where = _first_unreadable_input(paths, self.name)
                    if where is not None:  # Arrow's own refusal (a string pixel) names no file: find the sample
                        raise ValueError(
                            f"{where}: the input is not {'a list of numbers' if self.name == 'femnist' else 'text'} "
                            f"({type(cause).__name__}: {cause})"
                        ) from None
                    if generating:
                        raise
                    problem = f"{type(e).__name__}: {_first_line(e)}"  # reading the cache failed
            if problem is None:
                problem = _damaged_cache_file(ds)
                if problem is None:
                    break
            if attempt:
                raise OSError(
                    f"LEAF {self.name}: the Arrow cache in {root} is unreadable even after a rebuild ({problem})"
                )
            warnings.warn(
                f"LEAF {self.name}: the Arrow cache in {root} is damaged ({problem}); building it again from the JSON "
                "files",
                stacklevel=2,
            )
            for folder in glob.glob(os.path.join(glob.escape(root), "generator", f"*fingerprint={fingerprint}*")):
                shutil.rmtree(folder, ignore_errors=True)
        table = ds.data.table
        out: dict[str, _Part | None] = {"train": None, "test": None}
        split_col = np.asarray(table.column("split").to_pylist())
        user_col = table.column("user").to_pylist()
        file_col = table.column("file").to_pylist()
        for split in ("train", "test"):
            rows = np.flatnonzero(split_col == split)
            if len(rows) == 0:
                continue
            _check_unique_users(split, [user_col[r] for r in rows], [file_col[r] for r in rows])
            contiguous = rows[-1] - rows[0] + 1 == len(rows)  # the generator writes train files, then test files
            sub = table.slice(int(rows[0]), len(rows)) if contiguous else table.take(rows)
            counts = np.asarray(sub.column("y").combine_chunks().value_lengths().to_numpy(zero_copy_only=False))
            codes = np.array([users.setdefault(user_col[r], len(users)) for r in rows], dtype=np.int64)
            self._note_files(split, codes, [file_col[r] for r in rows])
            x = self._decode_json_x(sub, counts, [file_col[r] for r in rows])
            y = self._decode_labels(
                sub.column("y").combine_chunks().flatten(), np.repeat(rows, counts), file_col, user_col
            )
            out[split] = _Part(x=x, y=y, user=np.repeat(codes, counts))
        return out

    def _decode_json_x(self, sub, counts: np.ndarray, row_files: list[str]):
        import pyarrow.compute as pc

        samples = sub.column("x").combine_chunks().flatten()  # one entry per sample
        if self.name == "femnist":
            lengths = pc.list_value_length(samples).to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(lengths != 784)
            if len(bad):
                row = int(np.searchsorted(np.cumsum(counts), bad[0], side="right"))
                raise ValueError(
                    f"{row_files[row]}: FEMNIST inputs must have 784 values (28x28), got {int(lengths[bad[0]])}"
                )
            return samples.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, 784)
        if self.name == "shakespeare":
            ends = np.cumsum(counts)
            return self._encode_windows(samples, lambda i: row_files[int(np.searchsorted(ends, i, side="right"))])
        return samples.to_pylist()  # sent140 texts

    def _encode_windows(self, strings, where) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        what = f"Shakespeare inputs must be {self.seq_length}-character strings"
        if not (pa.types.is_string(strings.type) or pa.types.is_large_string(strings.type)):
            raise ValueError(f"{where(0)}: {what}, got values of type {strings.type}")
        if strings.null_count:
            missing = np.flatnonzero(strings.is_null().to_numpy(zero_copy_only=False))
            raise ValueError(f"{where(int(missing[0]))}: {what}, got a missing value")
        lengths = pc.utf8_length(strings).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != self.seq_length)
        if len(bad):
            raise ValueError(
                f"{where(int(bad[0]))}: Shakespeare inputs must be {self.seq_length}-character strings, got one of "
                f"length {int(lengths[bad[0]])}"
            )
        return encode_chars("".join(strings.to_pylist())).reshape(-1, self.seq_length)

    def _decode_labels(
        self, values, sample_rows: np.ndarray, row_file: list[str], row_user: list[str] | None = None
    ) -> np.ndarray:
        """Labels as int64 in [0, num_classes), or a ValueError naming the file, the user (``row_user``: the user of
        each table row, when the rows are users) and the value."""
        if self.name == "shakespeare":
            chars = values.to_pylist()
            bad = [i for i, c in enumerate(chars) if not isinstance(c, str) or len(c) != 1]
            if bad:
                raise ValueError(
                    f"{row_file[int(sample_rows[bad[0]])]}: Shakespeare targets must be single characters, "
                    f"got {chars[bad[0]]!r}"
                )
            return encode_chars("".join(chars)).astype(np.int64)
        raw = values.to_numpy(zero_copy_only=False)
        if raw.dtype.kind not in "iu":  # floats (3.5 would truncate to class 3), nulls, strings, booleans
            numeric = raw.dtype.kind == "f"
            whole = np.isfinite(raw) & (raw == np.floor(raw)) if numeric else np.zeros(len(raw), dtype=bool)
            bad = np.flatnonzero(~whole)
            if len(bad):
                value = _plain(raw[bad[0]])
                raise ValueError(
                    f"{row_file[int(sample_rows[bad[0]])]}: the label {value!r} is not a class id (a whole number) of "
                    f"{self.name}"
                )
        y = raw.astype(np.int64)
        bad = np.flatnonzero((y < 0) | (y >= self.num_classes))
        if len(bad):
            row = int(sample_rows[bad[0]])
            who = ""
            if row_user is not None:
                first = int(np.flatnonzero(sample_rows == row)[0])
                who = f" user {row_user[row]!r}, sample {int(bad[0]) - first}:"
            raise ValueError(
                f"{row_file[row]}:{who} label {int(y[bad[0]])} is outside the class range "
                f"[0, {self.num_classes}) of {self.name}"
            )
        return y

    def _read_table(self, fmt: str, files: dict[str, list[str]], users: dict[str, int]) -> dict[str, _Part | None]:
        import datasets

        data_files = {k: v for k, v in files.items() if v}
        # datasets keys the cache of local files by their modification time only: name the config by their content
        stamps = [f"{split}:{os.path.abspath(p)}:{file_digest(p)}" for split, v in data_files.items() for p in v]
        config = "leaf-" + hashlib.sha256("|".join([_CACHE_VERSION] + stamps).encode()).hexdigest()[:32]
        try:
            with _quiet_datasets():
                dsd = datasets.load_dataset(fmt, name=config, data_files=data_files, cache_dir=self.cache_dir)
        except Exception as err:  # pyarrow / datasets errors name neither the file nor the layout
            listed = ", ".join(f for v in data_files.values() for f in v)
            raise ValueError(
                f"cannot read the {fmt} files of the Flower-hub layout ({listed}): the file is truncated, corrupt or "
                f"not {fmt} ({type(err).__name__}: {err})"
            ) from err
        out: dict[str, _Part | None] = {"train": None, "test": None}
        for split, ds in dsd.items():
            where = ", ".join(os.path.basename(f) for f in data_files[split])
            cols = ds.column_names
            if self.user_column not in cols:
                raise ValueError(
                    f"{where}: no user column {self.user_column!r} (columns: {cols}); pass user_column= to name it"
                )
            if self.name == "femnist":
                x, y = self._femnist_table(ds, where)
            elif self.name == "shakespeare":
                for c in ("x", "y"):
                    if c not in cols:
                        raise ValueError(f"{where}: Shakespeare table needs columns 'x' and 'y' (columns: {cols})")
                table = ds.data.table
                x = self._encode_windows(table.column("x").combine_chunks(), lambda i, where=where: where)
                y = self._decode_labels(table.column("y").combine_chunks(), np.zeros(len(ds), dtype=np.int64), [where])
            else:
                raise ValueError("the parquet/csv layout is supported for femnist and shakespeare (Flower hub)")
            names = ds.data.table.column(self.user_column).to_pylist()
            codes = np.array([users.setdefault(str(u), len(users)) for u in names], dtype=np.int64)
            self._note_files(split, codes, where)
            out[split] = _Part(x=x, y=y, user=codes)
        return out

    def _femnist_table(self, ds, where: str) -> tuple[np.ndarray, np.ndarray]:
        import datasets

        cols = ds.column_names
        label = next((c for c in ("character", "label", "y") if c in cols), None)
        image = next((c for c in ("image", "x", "pixels") if c in cols), None)
        if label is None or image is None:
            raise ValueError(f"{where}: FEMNIST table needs an image and a label column (columns: {cols})")
        if isinstance(ds.features[image], datasets.Image):
            ds = ds.cast_column(image, datasets.Image(decode=False))

        def decode(batch):
            from PIL import Image as PILImage

            out = []
            for v in batch[image]:
                if isinstance(v, dict):
                    v = v.get("bytes")
                    if v is None:
                        raise ValueError(f"{where}: an image of column {image!r} has no image bytes")
                if isinstance(v, (bytes, bytearray)):
                    try:
                        arr = np.asarray(PILImage.open(io.BytesIO(v)).convert("L"), dtype=np.uint8)
                    except OSError as e:  # PIL's UnidentifiedImageError, a truncated image
                        raise ValueError(
                            f"{where}: an image of column {image!r} is not a readable image file ({e})"
                        ) from None
                else:
                    try:
                        arr = np.asarray(v, dtype=np.float32)
                    except (TypeError, ValueError) as e:  # text, ragged lists
                        raise ValueError(
                            f"{where}: an image of column {image!r} is neither an image file nor a list of pixel "
                            f"values ({e})"
                        ) from None
                    if not np.isfinite(arr).all():
                        raise ValueError(f"{where}: an image of column {image!r} holds non-finite pixel values")
                    low, high = float(arr.min(initial=0)), float(arr.max(initial=0))
                    if low < 0 or high > 255:
                        raise ValueError(
                            f"{where}: the pixel values of column {image!r} must lie in [0, 1] or [0, 255], got an "
                            f"image with values in [{low:g}, {high:g}]"
                        )
                    arr = np.rint(arr * 255.0 if high <= 1.0 else arr).astype(np.uint8)
                if arr.size != 784:
                    raise ValueError(f"{where}: FEMNIST images must be 28x28, got {arr.shape}")
                out.append(arr.reshape(-1))
            return {"pixels": out}

        with _quiet_datasets():
            pix = ds.map(
                decode,
                batched=True,
                batch_size=1000,
                remove_columns=[c for c in cols if c != label],
                features=datasets.Features(
                    {label: ds.features[label], "pixels": datasets.Sequence(datasets.Value("uint8"))}
                ),
            )
        table = pix.data.table
        x = table.column("pixels").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        x = x.reshape(-1, 784).astype(np.float32) / 255.0
        y = self._decode_labels(table.column(label).combine_chunks(), np.zeros(len(pix), dtype=np.int64), [where])
        return x, y

    # ------------------------------------------------------------------ sampling and splitting
    def _group(self, part: _Part, num_users: int) -> tuple[np.ndarray, np.ndarray]:
        """``(order, bounds)``: sample order grouping users contiguously (stable), user ``u`` at
        ``order[bounds[u]:bounds[u+1]]``."""
        order = np.argsort(part.user, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(part.user, minlength=num_users))])
        return order, bounds

    def load(self):
        fmt, files = self._discover()
        users: dict[str, int] = {}
        self._files, self._pending_files, self._client_files = [], {}, {}
        parts = self._read_json(files, users) if fmt == "json" else self._read_table(fmt, files, users)
        train, test = parts["train"], parts["test"]
        if train is None:
            raise ValueError(f"{self.data_dir}: the train split holds no samples")
        names = list(users)
        U = len(names)
        resplit = self.train_fraction is not None or test is None
        if resplit and test is not None:  # pool each user's samples, train part first (LEAF splits all_data)
            train = _Part(
                x=_concat([train.x, test.x]),
                y=np.concatenate([train.y, test.y]),
                user=np.concatenate([train.user, test.user]),
            )
            test = None
        self._resplit = resplit
        tr_order, tr_bounds = self._group(train, U)
        te_order, te_bounds = self._group(test, U) if test is not None else (None, None)
        totals = np.diff(tr_bounds) + (np.diff(te_bounds) if test is not None else 0)
        if test is not None:
            self._warn_test_only_users(names, np.diff(tr_bounds), np.diff(te_bounds))

        rng = np.random.default_rng(self.seed)
        keep = np.arange(U)
        if self.user_fraction < 1.0:  # 1. LEAF sample.py (by users, see LeafDataModule)
            k = max(1, int(round(self.user_fraction * U)))
            keep = np.sort(rng.choice(U, size=k, replace=False))
        keep = keep[totals[keep] >= self.min_samples]  # 2. LEAF remove_users.py (-k)

        fraction = self.train_fraction if self.train_fraction is not None else 0.9  # LEAF split_data.py default
        train_sel: list[np.ndarray] = []
        test_sel: list[np.ndarray] = []
        kept_names: list[str] = []
        kept_codes: list[int] = []
        for u in keep.tolist():
            tr_u = tr_order[tr_bounds[u] : tr_bounds[u + 1]]
            if resplit:  # 3. LEAF split_data.py -t sample, on the pooled samples of the user
                n = len(tr_u)
                if n < 2:
                    continue
                n_train = 1 if n == 2 else max(1, int(fraction * n))
                if self.name == "shakespeare":  # chronological, with a gap of seq_length - 1 windows
                    pick_tr, pick_te = np.arange(n_train), np.arange(n_train + self.seq_length - 1, n)
                else:
                    pick_tr = np.sort(rng.choice(n, size=n_train, replace=False))
                    pick_te = np.setdiff1d(np.arange(n), pick_tr)
                if len(pick_te) == 0:
                    continue
                train_sel.append(tr_u[pick_tr])
                test_sel.append(tr_u[pick_te])
            else:
                if len(tr_u) == 0:
                    continue
                train_sel.append(tr_u)
                test_sel.append(te_order[te_bounds[u] : te_bounds[u + 1]])
            kept_names.append(names[u])
            kept_codes.append(u)
        if not kept_names:
            raise ValueError(
                f"{self.data_dir}: no user left after user_fraction={self.user_fraction}, "
                f"min_samples={self.min_samples} and the per-user split"
            )
        if self.num_users is not None:
            if self.num_users > len(kept_names):
                raise ValueError(
                    f"num_users={self.num_users} but only {len(kept_names)} users remain in {self.data_dir} after "
                    f"the filters"
                )
            rng = np.random.default_rng([self.seed, 1])
            chosen = np.sort(rng.choice(len(kept_names), self.num_users, replace=False))
            kept_names = [kept_names[i] for i in chosen.tolist()]
            kept_codes = [kept_codes[i] for i in chosen.tolist()]
            train_sel = [train_sel[i] for i in chosen.tolist()]
            test_sel = [test_sel[i] for i in chosen.tolist()]
        self.num_dropped_users = U - len(kept_names)
        test_source = train if resplit else test
        n_tr = np.asarray([len(i) for i in train_sel], dtype=np.int64)
        n_te = np.asarray([len(i) for i in test_sel], dtype=np.int64)
        tr_all = np.concatenate(train_sel)
        te_all = np.concatenate(test_sel) if n_te.sum() else np.zeros(0, np.int64)
        x_tr, y_tr = _take(train.x, tr_all), train.y[tr_all]
        x_te = _take(test_source.x, te_all) if test_source is not None else _take(train.x, te_all)
        y_te = test_source.y[te_all] if test_source is not None else np.zeros(0, np.int64)
        if self.name == "sent140":
            x_tr, x_te = self._bag_of_words(x_tr, x_te)
        self.client_names = kept_names
        self._keep_client_files(U, kept_codes)
        off_tr = np.concatenate([[0], np.cumsum(n_tr)])
        off_te = np.concatenate([[0], np.cumsum(n_te)])
        self._natural = [np.arange(off_tr[i], off_tr[i + 1], dtype=np.int64) for i in range(len(kept_names))]
        self.client_test_indices = [np.arange(off_te[i], off_te[i + 1], dtype=np.int64) for i in range(len(kept_names))]
        train_ds = ArrayDataset(_tensor(x_tr), _tensor(y_tr.astype(np.int64)))
        test_ds = ArrayDataset(_tensor(x_te), _tensor(y_te.astype(np.int64))) if len(y_te) else None
        return train_ds, test_ds, y_tr

    def _warn_test_only_users(self, names: list[str], n_train: np.ndarray, n_test: np.ndarray) -> None:
        """Warns when test users have no training sample: they are left out with their test samples (LeafDataModule
        docstring)."""
        orphans = np.flatnonzero((n_train == 0) & (n_test > 0))
        if not len(orphans):
            return
        shown = ", ".join(repr(names[u]) for u in orphans[:3]) + (", ..." if len(orphans) > 3 else "")
        warnings.warn(
            f"LeafDataModule: {len(orphans)} test user(s) in {self.data_dir} have no training sample and are left out "
            f"with their {int(n_test[orphans].sum())} test samples (LEAF trains and tests the same users): {shown}; "
            f"pass train_fraction= to pool and re-split every user's samples instead",
            stacklevel=4,
        )

    def _note_files(self, split: str, codes: np.ndarray, paths: str | list[str]) -> None:
        """Records which file holds each row (user ``codes[i]`` of ``split`` is in ``paths[i]``, or in ``paths`` for
        all rows) until :meth:`_keep_client_files` keeps it for the kept users."""
        ids: dict[str, int] = {p: i for i, p in enumerate(self._files)}
        if isinstance(paths, str):
            index = np.full(len(codes), ids.setdefault(paths, len(ids)), dtype=np.int32)
        else:
            index = np.array([ids.setdefault(p, len(ids)) for p in paths], dtype=np.int32)
        self._files = list(ids)
        self._pending_files[split] = (codes, index)

    def _keep_client_files(self, num_users: int, kept_codes: list[int]) -> None:
        """Per split, the index into ``_files`` of every kept client's file (−1: none); 4 bytes per client and split,
        for error messages (:meth:`_client_label`)."""
        for split, (codes, index) in self._pending_files.items():
            lookup = np.full(num_users, -1, dtype=np.int32)
            lookup[codes] = index
            self._client_files[split] = lookup[np.asarray(kept_codes, dtype=np.int64)]
        self._pending_files = {}

    def _client_label(self, client_id: int, set_name: str) -> str:
        """``client 3, user 'f_0003', in <its files>`` (the files of the split the row comes from)."""
        label = super()._client_label(client_id, set_name)
        splits = ("train", "test") if self._resplit else (set_name,)
        files = [
            self._files[int(self._client_files[split][client_id])]
            for split in splits
            if split in self._client_files and self._client_files[split][client_id] >= 0
        ]
        return label + (f", in {', '.join(files)}" if files else "")

    def _bag_of_words(self, texts_tr: list[str], texts_te: list[str]) -> tuple[np.ndarray, np.ndarray]:
        tok_tr = [tokenize_tweet(t) for t in texts_tr]
        tok_te = [tokenize_tweet(t) for t in texts_te]
        counts = Counter(t for toks in tok_tr for t in toks)
        # most frequent first; ties broken alphabetically so the vocabulary does not depend on data order
        vocab = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.vocab_size]]
        self.vocabulary = vocab
        index = {w: i for i, w in enumerate(vocab)}

        def encode(tokens: list[list[str]]) -> np.ndarray:
            ids = [[index[t] for t in toks if t in index] for toks in tokens]
            width = max([1] + [len(r) for r in ids])
            out = np.full((len(ids), width), -1, dtype=np.int32)
            for i, r in enumerate(ids):
                out[i, : len(r)] = r
            return out

        return encode(tok_tr), encode(tok_te)

    def natural_clients(self) -> list[np.ndarray]:
        return self._natural

    def user_validation_split(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Shakespeare: the user's last train windows after a gap of ``seq_length − 1``; otherwise a seeded random
        ``floor(val_fraction · n)`` (LeafDataModule docstring)."""
        if self.name == "shakespeare":
            return chronological_holdout(n, self.val_fraction, self.seq_length - 1)
        return super().user_validation_split(n, rng)
