"""Checkpoints that cannot run code, are written atomically, keep a run's final round, and fail with one clear line.

* :func:`read_checkpoint`: the one reader of checkpoint files (``torch.load`` with ``weights_only=True`` and the
  allow-listed data types of :func:`safe_types`; ``weights_only=False`` only as a warned opt-in).
* :class:`AtomicCheckpointIO`: Lightning's checkpoint IO through :func:`read_checkpoint`, writing to a temporary file
  that ``os.replace`` moves over the target, so a checkpoint path always holds a complete checkpoint.
* :class:`RoundCheckpoint`: Lightning's ``ModelCheckpoint`` that also saves the final round of a run.
* :func:`check_checkpoint`: one :class:`CheckpointError` (``checkpoint <path>: ...``) naming why a file cannot be
  used (missing, empty, corrupt, a type that could run code, not a FederatedLoop checkpoint, weights that do not fit).
* :func:`checkpoint_round` / :func:`remove_interrupted_writes`: what ``--ckpt_path last`` ranks and cleans up.
* :class:`StoreConfigCallback` / :func:`config_differences`: the run's resolved CLI configuration stored in every
  checkpoint (``CONFIG_KEY``) and the training-relevant settings in which two configurations differ.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickletools
import re
import socket
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from fedlightning._lightning_compat import validation_follows

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "RoundCheckpoint",
    "check_checkpoint",
    "check_fits_model",
    "check_resumable",
    "global_model_state",
    "load_global_model",
    "non_persistent_buffers",
    "load_non_persistent_buffers",
    "read_checkpoint",
    "checkpoint_round",
    "verify_checksums",
    "remove_interrupted_writes",
    "safe_types",
    "StoreConfigCallback",
    "config_differences",
    "CONFIG_KEY",
    "FEDLIGHTNING_FORMAT",
    "TEMP_PREFIX",
    "STALE_TEMP_SECONDS",
    "SIGTERM_EXIT_STATUS",
]

CONFIG_KEY = "fedlightning_config"
FEDLIGHTNING_FORMAT = 1  #: the ``format`` number FederatedLoop writes into the checkpoint's ``fedlightning`` section
TEMP_PREFIX = ".tmp-"  #: name prefix of :class:`AtomicCheckpointIO`'s temporary files (``.tmp-<host>-<pid>-*.ckpt``)
STALE_TEMP_SECONDS = 3600  #: a temporary file nobody can vouch for is a leftover after this long unmodified (ours)
#: Exit status of a run stopped by SIGTERM (128 + 15, as a shell reports a process that SIGTERM ended).
SIGTERM_EXIT_STATUS = 143
_LIST_AT_MOST = 5
_TRUST_HINT = "pass --weights_only false (Python: weights_only=False) to load a checkpoint you trust"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message starts with ``checkpoint <path>:``.

    ``unsafe_type`` is the name of the type a refused file needs (``None`` for every other problem); ``weights_only``
    is True for a readable checkpoint refused only because it holds no training state (:func:`check_resumable`)."""

    def __init__(
        self,
        path,
        problem: str,
        details: list[str] | None = None,
        unsafe_type: str | None = None,
        weights_only: bool = False,
    ):
        self.path = os.fspath(path)
        self.problem = problem
        self.details = list(details or [])
        self.unsafe_type = unsafe_type
        self.weights_only = weights_only
        super().__init__(self.summary_line() + ("".join(f"\n  {d}" for d in self.details)))

    def summary_line(self) -> str:
        """``checkpoint <path>: <problem>`` without the details (the CLI prints those on the lines above)."""
        return f"checkpoint {self.path}: {self.problem}"


# ====================================================================== reading: no code from files
def safe_types() -> list[Any]:
    """The types and constructors, beyond torch's own ``weights_only`` set, that a checkpoint may need.

    **What ``weights_only`` admits.** Every checkpoint read of fedlightning (the CLI's checks, ``--ckpt_path last`` /
    ``best``, the resume comparison and the Trainer's own read for fit / validate / test / predict through
    :class:`AtomicCheckpointIO`) unpickles with ``torch.load(weights_only=True)``: tensors, parameters, torch sizes,
    dtypes and devices, ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` / ``set``, strings, bytes and numbers (torch's
    set), plus these plain data types (ours):

    * ``pathlib`` paths (``PosixPath``, ``WindowsPath``, ``PurePosixPath``, ``PureWindowsPath``): e.g. a directory in
      a callback's state;
    * numpy scalars and arrays of numeric, boolean, string, bytes, datetime and timedelta dtypes (numpy's
      ``scalar`` / ``_reconstruct`` constructors, ``ndarray``, ``dtype`` and these dtype classes; under their numpy 1
      and numpy 2 module names): e.g. a metric a user's ``on_save_checkpoint`` stores. Object and structured (void)
      dtypes are not admitted: their elements could be anything.

    Every checkpoint written by ``train.py`` with the bundled configs, and by a user's module with
    ``save_hyperparameters()``, torchmetrics metrics and a learning-rate scheduler (StepLR, CosineAnnealingLR,
    ReduceLROnPlateau, OneCycleLR, SequentialLR), needs only torch's own set (checked with
    ``torch.serialization.get_unsafe_globals_in_checkpoint``: the FederatedLoop stores no hyper-parameters, Lightning
    stores a module's ``hparams`` as a plain ``dict``, and scheduler / optimizer / callback states are plain data).
    Nothing callable beyond these constructors is admitted; Lightning's ``AttributeDict`` is not needed (torch's
    reader cannot fill a ``dict`` subclass anyway).
    """
    import pathlib

    import numpy as np

    out: list[Any] = []
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        out += [cls, (cls, f"pathlib.{cls.__name__}")]
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    for fn in (core.multiarray.scalar, core.multiarray._reconstruct):
        out.append(fn)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            out.append((fn, f"{module}.{fn.__name__}"))
    out += [np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # numpy >= 1.25: every dtype instance is of its own class
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            if name.endswith("DType") and isinstance(cls, type) and name not in ("ObjectDType", "VoidDType"):
                out.append(cls)
    return out


@contextlib.contextmanager
def _allowing_safe_types() -> Iterator[None]:
    """``torch.serialization.safe_globals`` for the :func:`safe_types` not already allow-listed (so that leaving it
    does not remove a type the user allow-listed process-wide)."""
    present = set(map(_global_key, torch.serialization.get_safe_globals()))
    added = [g for g in safe_types() if _global_key(g) not in present]
    with torch.serialization.safe_globals(added):
        yield


def _global_key(g: Any) -> Any:
    return (id(g[0]), g[1]) if isinstance(g, tuple) else id(g)


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL (\S+)")
_CLASS_IN_MESSAGE = re.compile(r"but got <class '([^']+)'>")
_FUNCTION_IN_MESSAGE = re.compile(r"unrecognized function (\S+)")


def _readable_name(name: str) -> str:
    """``posix.system`` -> ``os.system`` (how Python users know it), otherwise as the file names it."""
    module, _, attr = name.rpartition(".")
    if module in ("posix", "nt") and hasattr(os, attr):
        return f"os.{attr}"
    return name


def _pickle_globals(path: str) -> list[str]:
    """The globals a pickle names (``GLOBAL`` and protocol-4 ``STACK_GLOBAL``), read statically with pickletools
    (nothing is executed): ``data.pkl`` of a torch zip checkpoint, or the file itself."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                names = [n for n in z.namelist() if n.endswith("data.pkl")]
                data = z.read(names[0]) if names else b""
        else:
            with open(path, "rb") as f:
                data = f.read(64 << 20)
    except (OSError, zipfile.BadZipFile, KeyError):
        return []
    found: list[str] = []
    stream = io.BytesIO(data)
    recent: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        while stream.tell() < len(data):
            for op, arg, _ in pickletools.genops(stream):
                if op.name == "GLOBAL":
                    found.append(str(arg).replace(" ", "."))
                    recent.append(None)
                elif op.name == "STACK_GLOBAL":
                    if len(recent) >= 2 and isinstance(recent[-1], str) and isinstance(recent[-2], str):
                        found.append(f"{recent[-2]}.{recent[-1]}")
                    recent.append(None)
                elif op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                    memo[len(memo) if op.name == "MEMOIZE" else int(arg)] = recent[-1] if recent else None
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    recent.append(memo.get(int(arg)))
                else:
                    recent.append(arg if isinstance(arg, str) else None)
                del recent[:-8]
    except Exception:  # noqa: BLE001 - not a (complete) pickle: report what was read
        pass
    return found


def _unsafe_type(path: str, err: BaseException) -> str | None:
    """The type that ``weights_only`` refused, from torch's message, else from a static read of the pickle."""
    message = str(err)
    if "Weights only load failed" not in message and "WeightsUnpickler" not in message:
        return None
    for pattern in (_GLOBAL_IN_MESSAGE, _CLASS_IN_MESSAGE, _FUNCTION_IN_MESSAGE):
        m = pattern.search(message)
        if m:
            return _readable_name(m.group(1))
    allowed = _admitted_names()
    for name in _pickle_globals(path):
        if name not in allowed and not (allowed is _NO_NAMES and name.startswith(("torch.", "collections."))):
            return _readable_name(name)
    return None


_NO_NAMES: frozenset = frozenset()


def _admitted_names() -> Any:
    """The global names torch's ``weights_only`` reader admits with :func:`safe_types` (torch keeps the list in its
    private reader module; without it, ``torch.*`` and ``collections.*`` names count as admitted, for naming only)."""
    from torch import _weights_only_unpickler as wou

    default, user = getattr(wou, "_get_allowed_globals", None), getattr(wou, "_get_user_allowed_globals", None)
    if default is None or user is None:
        return _NO_NAMES
    with _allowing_safe_types():
        return set(default()) | set(user())


def _reader_detail(err: BaseException) -> str:
    """The first sentence of a reader error; for torch's weights_only message, the unpickler's own line."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()
        if detail:
            return f"{type(err).__name__}: {detail[0].strip()}"
    return _first_line(err)


_warned_untrusted: set = set()


def _warn_untrusted(path: str) -> None:
    if path not in _warned_untrusted:
        _warned_untrusted.add(path)
        rank_zero_warn(
            f"checkpoint {path}: loading with weights_only=False (--weights_only false): any code pickled "
            "in the file runs now; only do this for a checkpoint you trust"
        )


#: Files whose checksums :func:`verify_checksums` found intact: path -> (size, modification time in ns).
_intact: dict[str, tuple[int, int]] = {}


def verify_checksums(path) -> None:
    """Raise :class:`CheckpointError` when a zip checkpoint (``torch.save``'s format) holds an entry whose bytes do
    not match the CRC-32 stored with it: a copy damaged on disk or in transfer. ``torch.load`` does not compare them,
    so without this check the damaged bytes are read as weights. Ours: every entry is read once (a 100 MB checkpoint
    in the page cache: 30 ms); a file found intact is not read again while its size and modification time stay the
    same. Files that are not zip archives (legacy ``torch.save`` format) have no checksums and pass."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError:
        return  # the reader names a missing file
    stamp = (st.st_size, st.st_mtime_ns)
    if _intact.get(path) == stamp or not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as err:
        raise CheckpointError(path, f"corrupt, truncated or not a checkpoint ({_first_line(err)})") from err
    if bad is not None:
        raise CheckpointError(
            path,
            f"corrupt: the bytes of its entry {bad!r} do not match their checksum (the file was damaged after it was "
            "written); use another checkpoint",
        )
    _intact[path] = stamp


def read_checkpoint(path, weights_only: bool | None = None, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path)`` under fedlightning's policy; every failure is one :class:`CheckpointError`.

    **No code from files** (ours; torch's and Lightning's ``weights_only`` argument). ``weights_only`` ``None``
    (Lightning's default) or ``True``: the file is unpickled with ``weights_only=True`` and :func:`safe_types`
    allow-listed, so no pickled callable runs; a file that needs any other type is refused with
    ``checkpoint <path>: refuses to load: it needs the type <module.name>, ...`` (the name from torch's reader, or from
    a static read of the pickle when torch names none). ``False`` (``--weights_only false``): the explicit opt-in for a
    checkpoint the user trusts, loaded with ``weights_only=False`` after a warning naming the file (once per file and
    process). ``mmap`` maps the tensors' storage instead of reading it (zip checkpoints only): cheap for reading a
    checkpoint's round. A read without ``mmap`` first checks the file's checksums (:func:`verify_checksums`).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(path, "file not found")
    if not mmap:
        verify_checksums(path)
    if weights_only is False:
        _warn_untrusted(path)
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(path, f"corrupt, truncated or not a checkpoint ({_first_line(err)})") from err
    use_mmap = bool(mmap) and zipfile.is_zipfile(path)
    return _safe_load(path, lambda: torch.load(path, map_location=map_location, weights_only=True, mmap=use_mmap))


def _safe_load(path: str, load: Callable[[], Any]) -> Any:
    """``load()`` (a ``weights_only=True`` read) with :func:`safe_types` allow-listed; failures as CheckpointError."""
    try:
        with _allowing_safe_types():
            loaded = load()
    except Exception as err:  # noqa: BLE001 - any reader failure means the same thing to the user
        unsafe = _unsafe_type(path, err)
        if unsafe is not None:
            raise CheckpointError(
                path,
                f"refuses to load: it needs the type {unsafe}, which is not an allow-listed data type and "
                f"could run code; {_TRUST_HINT}",
                unsafe_type=unsafe,
            ) from err
        raise CheckpointError(path, f"corrupt, truncated or not a checkpoint ({_reader_detail(err)})") from err
    where = _object_array(loaded)
    if where is not None:
        raise CheckpointError(
            path,
            f"refuses to load: it holds a numpy array of {where} dtype, which is not an allow-listed data type (its "
            f"elements could be any object); {_TRUST_HINT}",
            unsafe_type=f"numpy {where} array",
        )
    return loaded


def _object_array(value: Any, depth: int = 0) -> str | None:
    """``"object"`` / ``"structured"`` when a numpy array or scalar of such a dtype is anywhere in ``value`` (dicts,
    lists, tuples, sets), else None. The safe reader refuses their dtype classes, but a pickle can build the dtype
    through ``numpy.dtype("O8")``, which it admits for numeric dtypes."""
    import numpy as np

    if isinstance(value, (np.ndarray, np.generic)):
        kind = value.dtype.kind
        return "object" if kind == "O" else "structured" if kind == "V" else None
    if depth > 64 or isinstance(value, (str, bytes, torch.Tensor)):
        return None
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            found = _object_array(item, depth + 1)
            if found is not None:
                return found
    return None


def checkpoint_round(checkpoint: Mapping[str, Any]) -> int:
    """The number of rounds a FederatedLoop checkpoint holds (Lightning's ``global_step``; one step = one round)."""
    step = checkpoint.get("global_step")
    if isinstance(step, torch.Tensor):
        step = int(step.item())
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"global_step {step!r} is not a round count")
    return step


# ====================================================================== writing: atomic, umask, final round
def _umask() -> int:
    """The process's umask, read without changing it where Linux exposes it (``os.umask`` sets it to read it, which
    races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-.*\.ckpt")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes, the umask's permissions and the ``weights_only`` policy.

    **Atomic writes.** Lightning's default checkpoint IO writes the file in place: a process killed during
    ``save_checkpoint`` leaves a truncated file that replaces the previous good one. :class:`AtomicCheckpointIO` writes
    to a temporary file ``.tmp-<host>-<pid>-<random>.ckpt`` in the same directory, flushes it to disk, gives it the
    permissions a new file gets (``0o666 & ~umask``: ``mkstemp`` creates it ``0o600``), then ``os.replace``s it over
    the target (atomic on POSIX), so a checkpoint path always holds either the old or the new complete checkpoint.
    A process killed mid-write leaves its temporary file; :func:`remove_interrupted_writes` (run by
    ``--ckpt_path last``) deletes it. The FederatedCLI installs this IO by default.

    **Reading** goes through :func:`read_checkpoint` with the ``weights_only`` Lightning passes from
    ``fit`` / ``validate`` / ``test`` / ``predict(weights_only=...)`` (LightningCLI's ``--weights_only``): ``None`` and
    ``True`` load safely, ``False`` is the warned opt-in.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = os.fspath(path)
        if "://" in path:  # remote file systems: fall back to Lightning's writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{_host_tag()}-{os.getpid()}-", suffix=".ckpt", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "fchmod"):
                    os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException as err:
            with contextlib.suppress(OSError):  # a folder made read-only: the write's own error is the one to see
                os.unlink(tmp)
            if isinstance(err, OSError) and err.errno is not None:  # the file it was writing, not the temporary one
                raise OSError(err.errno, f"could not write the checkpoint: {err.strerror}", path) from err
            raise

    def load_checkpoint(
        self, path, map_location: Callable | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = os.fspath(path)
        if "://" in path:  # remote: Lightning's reader (fsspec) under the same policy
            if weights_only is False:
                _warn_untrusted(path)
                return super().load_checkpoint(path, map_location=map_location, weights_only=False)
            return _safe_load(
                path,
                lambda: super(AtomicCheckpointIO, self).load_checkpoint(
                    path, map_location=map_location, weights_only=True
                ),
            )
        if not os.path.isfile(path):
            raise CheckpointError(path, "file not found")
        return read_checkpoint(path, weights_only=weights_only, map_location=map_location)


def remove_interrupted_writes(directories: Sequence[str]) -> list[str]:
    """Delete the temporary files of interrupted :class:`AtomicCheckpointIO` writes in ``directories``; return them.

    **Which temporary files are leftovers** (ours): ``.tmp-<host>-<pid>-*.ckpt`` written on this host by a process
    that no longer runs (or by this process, which is not writing while it resolves ``--ckpt_path``); any other
    ``.tmp-*.ckpt`` (another host of a shared file system, another writer's name, a system without process checks)
    once it has not been modified for :data:`STALE_TEMP_SECONDS` (1 hour), so that a run still writing into a
    sibling version directory never loses its file mid-write.
    """
    host, now, removed = _host_tag(), time.time(), []
    for directory in dict.fromkeys(os.path.abspath(d) for d in directories):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in sorted(names):
            if not (name.startswith(TEMP_PREFIX) and name.endswith(".ckpt")):
                continue
            path = os.path.join(directory, name)
            m = _TEMP_NAME.fullmatch(name)
            try:
                if m and m["host"] == host and os.name == "posix":
                    pid = int(m["pid"])
                    leftover = pid == os.getpid() or not _process_running(pid)
                else:
                    leftover = now - os.path.getmtime(path) > STALE_TEMP_SECONDS
                if leftover and os.path.isfile(path):
                    os.unlink(path)
                    removed.append(path)
            except FileNotFoundError:  # another process (rank) removed it first
                continue
    return removed


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # POSIX only: signal 0 checks existence (on Windows os.kill would terminate the process)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RoundCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that keeps the last round a run completed (the FederatedCLI's default).

    **What is saved when** (ours; Lightning's ``ModelCheckpoint`` saves ``last`` at ``every_n_train_steps`` and at the
    end of training only if it saved nothing before, so a run of 13 rounds with saves every 10 ended at round 10):

    * every ``every_n_train_steps`` rounds, as ``ModelCheckpoint`` does;
    * when training ends normally — ``max_steps`` reached, ``EarlyStopping`` or any callback setting
      ``trainer.should_stop``, ``max_time`` — the final round as ``last`` (with ``save_last``), unless that round
      is already saved;
    * with a ``monitor``, a round is ranked by its own metrics (ours): when a validation follows a round that
      ``every_n_train_steps`` saves, its top-k file is written after that validation, with that validation's value
      of the monitored metric; ``last`` is written at the round's end as without a monitor. Lightning's
      ``ModelCheckpoint`` ranks such a round by the value of the validation before it (a round earlier), so its
      ``best_model_path`` can name the round after the best one. A saved round that no validation follows gets no
      top-k file when the monitored metric comes from validations (its value would be an earlier round's; a
      warning says so once: make ``every_n_train_steps`` a multiple of the validation interval); a monitored
      metric that the rounds log themselves ranks a round at its end, as in Lightning;
    * when an exception stops a one-process run (``max_failed_rounds``, ``on_client_failure="raise"``, Ctrl-C, an
      error in validation), the last completed round as ``last``, only where the model is at a round boundary: no
      round was in progress, or the round in progress changed nothing yet (its server step did not run and no
      client wrote persistent state). A round part-way through its clients' state is never saved. With several
      processes nothing is saved on an exception (the exception may be on one process only, and a save waits for
      all), except on SIGTERM, where the FederatedLoop has every process stop at the end of the same round
      (``stopping_on_sigterm``). A failure of that save is a warning; the original exception goes on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._round_started_at: int | None = None
        self._pending: int | None = None  # state_dict's validation_pending while a file is written
        self._written: list[str] = []  # files written at the current round's end
        self._written_at: int | None = None  # the round they were written at, until its validation writes them again
        self._at_round_end = False  # inside on_train_batch_end
        self._rank_after_validation: int | None = None  # the round whose top-k save waits for its validation
        self._monitor_at_validation_start: Any = None
        self._monitor_from_validation = False  # the last validation logged the monitored metric
        self._warned_unranked = False
        self._validating: int | None = None  # the round whose validation has started and not ended
        self._inherited: set[str] = set()  # top-k files of the run resumed from, in its directory (load_state_dict)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._round_started_at = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._round_started_at = None
        self._written = []  # the files this round's end writes (_save_checkpoint)
        self._at_round_end = True
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._at_round_end = False
        self._written_at = trainer.global_step if self._written else None

    def _save_topk_checkpoint(self, trainer, monitor_candidates: dict[str, Any]) -> None:
        """At a round's end with a ``monitor`` and a validation to follow: the save waits for that validation
        (:meth:`on_validation_end`), whose metrics are the round's own."""
        if self._at_round_end and self.monitor is not None and self.save_top_k != 0:
            if validation_follows(trainer):
                self._rank_after_validation = trainer.global_step
                return
            if self._monitor_from_validation:
                if not self._warned_unranked:
                    self._warned_unranked = True
                    rank_zero_warn(
                        f"RoundCheckpoint(monitor={self.monitor!r}): round {trainer.global_step} gets no top-k file: "
                        f"no validation follows it, and the value of {self.monitor!r} is an earlier round's; "
                        f"make every_n_train_steps ({self._every_n_train_steps}) a multiple of the validation "
                        "interval to rank the saved rounds"
                    )
                return
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        self._monitor_at_validation_start = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._validating = trainer.global_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore, and (ours) with a ``monitor``, for a run resumed into another directory (``train.py``
        opens a new version directory for every run): the ranking of the earlier run's top-k files that still
        exist, which Lightning drops when the directory changed, so that ``best_model_path`` (and ``--ckpt_path
        best``) name the best round of the whole run, as without the interruption. An earlier run's file that falls
        out of the top k stays in its directory (nothing a run wrote is removed by another), and ``last`` is this
        run's own."""
        saved_dir = state_dict.get("dirpath", self.dirpath)
        best_k = state_dict.get("best_k_models") or {}
        kept = {p: v for p, v in best_k.items() if isinstance(p, str) and os.path.isfile(p)}
        if self.monitor is None or self.dirpath is None or saved_dir == self.dirpath or not kept:
            super().load_state_dict(state_dict)
            return
        ranked = sorted(kept, key=lambda p: float(kept[p]), reverse=self.mode == "max")  # best first
        super().load_state_dict(
            {
                **state_dict,
                "dirpath": self.dirpath,
                "best_k_models": kept,
                "best_model_path": ranked[0],
                "best_model_score": kept[ranked[0]],
                "kth_best_model_path": ranked[-1],
                "kth_value": kept[ranked[-1]],
                "last_model_path": "",
            }
        )
        self._inherited = set(kept)

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        if filepath in self._inherited:  # the earlier run's file, out of the top k now: it stays (load_state_dict)
            self._inherited.discard(filepath)
            return
        super()._remove_checkpoint(trainer, filepath)

    def state_dict(self) -> dict[str, Any]:
        """Lightning's state, and ``validation_pending``: the round of a file written before that round's validation
        completed (at the round's end with a validation to follow, or after an exception in the validation), else
        None. A run resumed from such a file says that it does not run the validation (the FederatedLoop warns)."""
        return {**super().state_dict(), "validation_pending": self._pending}

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        round_ = trainer.global_step
        if self._validating == round_ or (self._at_round_end and validation_follows(trainer)):
            self._pending = round_
        try:
            super()._save_checkpoint(trainer, filepath)
        finally:
            self._pending = None
        self._written.append(filepath)

    def on_validation_end(self, trainer, pl_module) -> None:
        """The files written at the round's end, written again after the round's validation, so that they hold what
        the validation changed (EarlyStopping's counters, a client scheduler stepped on a validation metric): a
        resumed run does not run that validation again (Lightning goes on with the next round)."""
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if fitting:
            self._validating = None  # the validation is complete: Lightning's saves below hold its results
        super().on_validation_end(trainer, pl_module)
        if not fitting:
            return
        if self.monitor is not None:
            value = trainer.callback_metrics.get(self.monitor)
            self._monitor_from_validation = value is not None and value is not self._monitor_at_validation_start
        written = list(dict.fromkeys(self._written)) if self._written_at == trainer.global_step else []
        self._written_at = None
        if self._rank_after_validation == trainer.global_step:
            self._rank_after_validation = None
            super()._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        for filepath in written:
            super()._save_checkpoint(trainer, filepath)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        agreed = isinstance(exception, SIGTERMException) and bool(getattr(pl_module, "stopping_on_sigterm", False))
        if (
            not self.save_last
            or (trainer.world_size > 1 and not agreed)
            or self._should_skip_saving_checkpoint(trainer)
        ):
            return
        started = self._round_started_at
        store = getattr(pl_module, "client_state", None)
        if started is not None and (trainer.global_step != started or store is None or store.has_dirty):
            return  # part-way through a round: not a state any run passes through
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        except Exception as err:  # noqa: BLE001 - never hide the exception that stopped the run
            rank_zero_warn(
                f"the last completed round (round {trainer.global_step}) could not be saved after the run "
                f"stopped: {type(err).__name__}: {err}"
            )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    if not text:
        return type(err).__name__
    first = text[0].split(". ")[0]  # the first sentence: torch's reader errors go on with generic advice
    return f"{type(err).__name__}: {first}"


def _listed(items: list[str]) -> str:
    more = len(items) - _LIST_AT_MOST
    return ", ".join(items[:_LIST_AT_MOST]) + (f" (and {more} more)" if more > 0 else "")


def check_checkpoint(
    path,
    model: torch.nn.Module | None = None,
    weights_only: bool | None = None,
    mmap: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Load ``path`` on the CPU and return the checkpoint, or raise :class:`CheckpointError` naming the problem
    (listed below). With ``model`` (the :class:`~fedlightning.FederatedLoop` the run will load it into),
    the checkpoint's ``state_dict`` must have exactly the model's keys and shapes.

    **Checking a checkpoint before Lightning reads it.** :func:`check_checkpoint` opens a file and raises one
    :class:`CheckpointError` (a ``ValueError``) whose message starts with ``checkpoint <path>:`` and names the problem:

    * the file does not exist, is a directory, or is empty;
    * ``torch.load`` cannot read it (truncated, random bytes, another format): "corrupt, truncated or not a checkpoint";
    * it needs a type that ``weights_only`` does not admit (:func:`read_checkpoint`): "refuses to load: it needs the
      type <name>, ...";
    * it is not a Lightning checkpoint (no ``state_dict`` mapping);
    * it is a Lightning checkpoint of another LightningModule (no ``fedlightning`` section, which
      :meth:`~fedlightning.FederatedLoop.on_save_checkpoint` writes) or of an unknown ``fedlightning`` format;
    * with ``model=``: its ``state_dict`` does not fit the model (missing / unexpected keys, different shapes: another
      architecture), listing up to 5 of each (ours), or holds a NaN / infinity (:func:`check_fits_model`);
    * with ``resume=True`` (the checkpoint of a ``fit``): it holds the weights only (a ``ModelCheckpoint`` with
      ``save_weights_only=True``: no optimizer state nor loop progress, so it cannot resume training; validate and
      test read such a file).

    The file is read by :func:`read_checkpoint` with ``weights_only`` (``None`` / ``True``: safely; ``False``: the
    warned opt-in), exactly as :class:`AtomicCheckpointIO` (and so the Trainer) reads it afterwards. Remote paths
    (``scheme://``) are not checked here (ours: opening them costs a download); Lightning reads them through
    :class:`AtomicCheckpointIO` with the same policy.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(path, "file not found")
    if os.path.isdir(path):
        raise CheckpointError(path, "is a directory, not a checkpoint file")
    if os.path.getsize(path) == 0:
        raise CheckpointError(path, "the file is empty (0 bytes): corrupt, truncated or not a checkpoint")
    ckpt = read_checkpoint(path, weights_only=weights_only, mmap=mmap)
    if not isinstance(ckpt, Mapping) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(
            path, "not a Lightning checkpoint (no 'state_dict'); pass a .ckpt file a fedlightning run wrote"
        )
    fed = ckpt.get("fedlightning")
    if not isinstance(fed, Mapping):
        raise CheckpointError(
            path,
            "a Lightning checkpoint of another LightningModule, not of a FederatedLoop (no "
            "'fedlightning' section): it cannot resume a federated run",
        )
    if fed.get("format") != FEDLIGHTNING_FORMAT:
        raise CheckpointError(
            path,
            f"unsupported fedlightning checkpoint format {fed.get('format')!r} (this version "
            f"reads format {FEDLIGHTNING_FORMAT})",
        )
    _check_fedlightning_section(path, fed)
    if resume:
        check_resumable(path, ckpt)
    if model is not None:
        check_fits_model(path, ckpt, model)
    return ckpt


def _client_id_key(key: Any) -> bool:
    """An integer client id as the client state stores it (an int, or its decimal string)."""
    if isinstance(key, bool):
        return False
    return isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit())


def _check_fedlightning_section(path, fed: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the first field of the ``fedlightning`` section that is not of the type
    :meth:`~fedlightning.FederatedLoop.on_save_checkpoint` writes (a hand-edited or damaged file would otherwise fail
    inside the restore with a traceback): ``client_state`` a mapping of namespaces to mappings of client ids, the
    counters integers, ``module_optimizer`` and ``client_groups`` mappings or absent."""
    state = fed.get("client_state", {})
    bad = None
    if not isinstance(state, Mapping):
        bad = f"client_state is {type(state).__name__}, not a mapping"
    else:
        ns = next((k for k, v in state.items() if not isinstance(v, Mapping)), None)
        if ns is not None:
            bad = f"client_state[{ns!r}] is {type(state[ns]).__name__}, not a mapping of client ids"
        else:
            ids = next((c for v in state.values() for c in v if not _client_id_key(c)), None)
            if ids is not None:
                bad = f"client_state holds the client id {ids!r}, not an integer"
    for key in ("failed_clients_total", "rounds_without_healthy_client"):
        value = fed.get(key, 0)
        if bad is None and (isinstance(value, bool) or not isinstance(value, int)):
            bad = f"{key} is {value!r:.40}, not an integer"
    for key in ("module_optimizer", "client_groups"):
        value = fed.get(key)
        if bad is None and value is not None and not isinstance(value, Mapping):
            bad = f"{key} is {type(value).__name__}, not a mapping"
    if bad is not None:
        raise CheckpointError(path, f"its fedlightning section is malformed: {bad}")


def check_resumable(path, ckpt: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` when ``ckpt`` cannot resume training: a weights-only checkpoint (Lightning's
    ``save_weights_only=True`` writes no ``optimizer_states`` nor ``loops``), which Lightning would refuse with a
    ``KeyError`` after the run has started."""
    if "optimizer_states" not in ckpt or "loops" not in ckpt:
        raise CheckpointError(
            path,
            "a weights-only checkpoint (save_weights_only: no optimizer state nor loop progress): it cannot resume "
            "training; resume a full checkpoint, or evaluate this one with validate / test",
            weights_only=True,
        )


def check_fits_model(path, ckpt: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Raise :class:`CheckpointError` unless the checkpoint's ``state_dict`` has exactly ``model``'s keys and shapes
    and every floating-point tensor in it is finite.

    **Non-finite weights are refused** (ours): a global model holding NaN or ±inf cannot be trained on (every client
    would diverge and be skipped) nor evaluated (every metric NaN), so resuming or evaluating it would end in a run
    that reports nothing useful; the error names the first such tensor (in ``state_dict`` order) and one of its
    non-finite values. The check reads every tensor once (a fraction of a round for any model that fits in memory).
    """
    path = os.fspath(path)
    saved = ckpt["state_dict"]
    _check_state_dict(path, saved, model.state_dict())
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            bad = ~torch.isfinite(value)
            if bool(bad.any()):
                first = float(value.reshape(-1)[bad.reshape(-1)][0])
                raise CheckpointError(
                    path,
                    f"its weights are non-finite: {key} holds {first} ({int(bad.sum())} of "
                    f"{value.numel()} values); a diverged model cannot be resumed or "
                    "evaluated: resume an earlier checkpoint",
                )


def _non_persistent_buffer_slots(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the buffers :func:`non_persistent_buffers` saves, ``module``'s own tensors."""
    for module_name, sub in module.named_modules():
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            tensor = sub._buffers.get(name)
            if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex()):
                yield (f"{module_name}.{name}" if module_name else name), tensor


def non_persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``module``'s floating-point buffers registered with ``persistent=False``, by name.

    Its ``state_dict``, which Lightning saves, leaves them out, but a client's training may write them (a
    temperature, a running estimate) and the aggregation averages them as any buffer, so they are part of a
    federated run's state: :class:`~fedlightning.loop.FederatedLoop` saves them in its checkpoints
    (``checkpoint["fedlightning"]["non_persistent_buffers"]``), and resuming, ``validate`` / ``test`` with
    ``ckpt_path`` and :func:`load_global_model` put them back. Decision (ours): floating-point and complex ones only,
    the ones training writes and aggregation averages; integer and boolean ones (position ids, masks) are constants a
    module builds in ``__init__``."""
    return {name: tensor.detach().clone() for name, tensor in _non_persistent_buffer_slots(module)}


def load_non_persistent_buffers(module: torch.nn.Module, saved: Any) -> None:
    """Copy the buffers :func:`non_persistent_buffers` saved into ``module``'s buffers of the same name and shape
    (``saved`` from an older checkpoint without them, ``None``, changes nothing)."""
    if not isinstance(saved, Mapping):
        return
    with torch.no_grad():
        for name, tensor in _non_persistent_buffer_slots(module):
            value = saved.get(name)
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                tensor.copy_(value)


def _global_model(path, weights_only: bool | None) -> tuple[dict[str, torch.Tensor], Any]:
    """The global model's ``state_dict`` in the file ``path`` and its saved non-persistent buffers (or None)."""
    path = os.fspath(path)
    ckpt = read_checkpoint(path, weights_only=weights_only)
    state = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            path,
            "holds no state dict of tensors (a Lightning or fedlightning checkpoint, or a torch.save'd state_dict)",
        )
    if isinstance(ckpt, Mapping) and "fedlightning" in ckpt:  # a federated run's checkpoint: its global model
        model = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        fed = ckpt["fedlightning"]
        return model, fed.get("non_persistent_buffers") if isinstance(fed, Mapping) else None
    return dict(state), None


def global_model_state(path, weights_only: bool | None = None) -> dict[str, torch.Tensor]:
    """The global model's ``state_dict`` in the file ``path``, read by :func:`read_checkpoint` (no code runs unless
    ``weights_only=False``, the opt-in for a file you trust that needs other types, such as a Lightning checkpoint
    whose ``save_hyperparameters()`` holds an ``Enum``): from a fedlightning checkpoint its global model (the keys of
    your module, without the loop's ``model.`` prefix), from a Lightning checkpoint of your module its
    ``state_dict``, or a ``torch.save``'d state dict itself. A file that holds none of these is a
    :class:`CheckpointError`."""
    return _global_model(path, weights_only)[0]


def load_global_model(path, module: torch.nn.Module, weights_only: bool | None = None) -> torch.nn.Module:
    """Load the global model of the checkpoint ``path`` (:func:`global_model_state`) into ``module`` (your
    LightningModule, built as for training) and return it, e.g. to evaluate or predict with the trained model::

        model = load_global_model("runs/quickstart/version_0/checkpoints/last.ckpt", MyModule())

    Its keys, shapes and finiteness are checked first (:func:`check_fits_model`): a :class:`CheckpointError` names
    the difference. The floating-point buffers registered with ``persistent=False`` that a federated checkpoint
    holds are put back too (:func:`non_persistent_buffers`). (``MyModule.load_from_checkpoint`` cannot read a
    federated checkpoint: it holds the ``FederatedLoop``, whose keys carry the ``model.`` prefix.)
    ``weights_only``: as for :func:`global_model_state`."""
    state, buffers = _global_model(path, weights_only)
    check_fits_model(path, {"state_dict": state}, module)
    module.load_state_dict(state)
    load_non_persistent_buffers(module, buffers)
    return module


def _check_state_dict(path: str, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in saved
        and hasattr(saved[k], "shape")
        and hasattr(expected[k], "shape")
        and tuple(saved[k].shape) != tuple(expected[k].shape)
    ]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if shapes:
        parts.append(f"different shapes (checkpoint vs model): {_listed(shapes)}")
    if missing:
        parts.append(f"missing in the checkpoint: {_listed(missing)}")
    if unexpected:
        parts.append(f"not in the model: {_listed(unexpected)}")
    raise CheckpointError(
        path, "its weights do not fit the configured model (another architecture?): " + "; ".join(parts)
    )


# ====================================================================== the configuration stored in checkpoints
class StoreConfigCallback(Callback):
    """Adds ``config`` (the resolved CLI configuration, plain data) to every checkpoint as ``checkpoint[CONFIG_KEY]``.

    A top-level key rather than callback state (``state_dict``): resuming must not overwrite the new run's config.
    """

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):  # an empty mapping adds no key: ``init_args: {}`` equals no init_args
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


#: Callbacks whose settings :func:`config_differences` leaves out: Lightning's own and fedlightning's checkpointing
#: (where and how often checkpoints are written does not change the training)
_NOT_COMPARED = ("lightning.", "fedlightning.checkpoint.")


def _compared(config: Mapping[str, Any]) -> dict[str, Any]:
    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
    if isinstance(callbacks, Mapping):
        callbacks = [callbacks]
    callbacks = [
        cb
        for cb in (callbacks or [])
        if not (isinstance(cb, Mapping) and str(cb.get("class_path", "")).startswith(_NOT_COMPARED))
    ]
    out: dict[str, Any] = {}
    for key in ("model", "data", "seed_everything"):
        _flatten(config.get(key), key, out)
    _flatten(callbacks, "trainer.callbacks", out)
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"key: checkpoint <a> -> now <b>"`` for every compared setting that differs.

    **Stored configuration.** :class:`StoreConfigCallback` adds the run's resolved CLI configuration to every checkpoint
    under the top-level key ``fedlightning_config`` (the key :data:`CONFIG_KEY`); :func:`config_differences` lists the
    settings that decide the training trajectory (``model``, ``data``, ``seed_everything`` and the non-Lightning
    ``trainer.callbacks``: strategies, schedules, telemetry; not Lightning's callbacks nor
    :class:`RoundCheckpoint`) in which two such configurations differ. Every other
    ``trainer`` setting (``max_steps`` included: extending a run is normal; devices, logger, validation interval) is
    not compared (ours).
    """
    a, b = _compared(saved), _compared(current)
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            fa = "(not set)" if va is missing else repr(va)
            fb = "(not set)" if vb is missing else repr(vb)
            lines.append(f"{key}: checkpoint {fa} -> now {fb}")
    return lines
