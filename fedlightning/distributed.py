"""Collective operations used when clients are sharded over processes (Lightning DDP strategies), with a timeout.

A process that stops answering (frozen by ``SIGSTOP``, swapped out, a hung device, a host that went away without
closing its sockets) would leave the other processes waiting in the round's next collective for torch's default
process-group timeout: 30 minutes for gloo (the CPU backend), 10 minutes for NCCL. Every collective of a federated
round therefore runs under the **collective timeout** (default :data:`DEFAULT_COLLECTIVE_TIMEOUT_S` = 300 s, ours;
the environment variable ``FEDLIGHTNING_COLLECTIVE_TIMEOUT`` = seconds, e.g. ``1800``), and a collective that fails
raises :class:`CollectiveError` naming the collective, the round and this process's rank, chained to torch's
error.

Decisions (ours):

* The timeout is the process group's own (``torch.distributed.set_timeout`` on the default group, which gloo and
  NCCL honour; Lightning's ``DDPStrategy(timeout=...)`` passes its value to ``init_process_group`` the same way). It
  is set at the first federated collective of the process (round 0's ``all_reduce_statistics``), so from then on it
  also bounds Lightning's own collectives on that group (checkpoint barriers, ``sync_dist`` logging); it replaces a
  ``timeout`` given to the strategy. Collectives before round 0 (Lightning's setup barriers) keep the strategy's
  timeout.
* 300 s: the other processes wait in a collective for as long as the slowest one takes to reach it, i.e. the
  imbalance of one round's client training, a validation or a checkpoint write, normally seconds; five minutes
  leaves a wide margin and still ends a run whose process froze long before torch's 30 minutes. A run whose ranks
  legitimately drift further apart (very unequal clients, a slow shared file system) sets the variable higher.
* gloo (CPU): the waiting processes raise, and :class:`CollectiveError` says which collective, round and rank.
  NCCL (GPU): torch's watchdog aborts the process when the timeout passes (its message names the operation by
  torch's name and sequence number), because CUDA work after a failed NCCL operation is unsafe; the timeout is the
  same.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Collection, Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fedlightning.state import RoundStatistics

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "CollectiveError",
    "collective_timeout",
    "apply_collective_timeout",
    "all_reduce_statistics",
    "all_gather_objects",
    "named_collective",
    "FiniteMean",
    "finite_weighted_mean_over_processes",
    "release_process_group",
]

#: environment variable: the collective timeout in seconds (a positive number)
COLLECTIVE_TIMEOUT_ENV = "FEDLIGHTNING_COLLECTIVE_TIMEOUT"
#: the collective timeout when the variable is not set (ours, see the module docstring)
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0

# the default process group the timeout was last set on (a new group, e.g. a second Trainer.fit, gets it again)
_timeout_group: object | None = None


class CollectiveError(RuntimeError):
    """A collective of a federated round failed or timed out: another process crashed, froze or fell behind."""


def collective_timeout() -> timedelta:
    """The collective timeout: ``FEDLIGHTNING_COLLECTIVE_TIMEOUT`` seconds, else :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`.

    Raises ``ValueError`` naming the variable and its value when it is not a positive finite number.
    """
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not raw:
        return timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{COLLECTIVE_TIMEOUT_ENV}={raw!r}: the collective timeout must be a positive number of seconds "
            f"(default {DEFAULT_COLLECTIVE_TIMEOUT_S:g})"
        )
    return timedelta(seconds=seconds)


def apply_collective_timeout() -> timedelta:
    """Set the collective timeout on the default process group (once per group) and return it."""
    global _timeout_group
    timeout = collective_timeout()
    group = dist.group.WORLD
    if group is not _timeout_group:
        dist.set_timeout(timeout)
        _timeout_group = group
    return timeout


@contextlib.contextmanager
def _named(collective: str, round: int | None, timeout: timedelta) -> Iterator[None]:
    """Re-raise a collective's ``RuntimeError`` (torch's ``DistError`` family and gloo's errors are RuntimeErrors)
    as :class:`CollectiveError` naming the collective, the round, this rank and the timeout."""
    start = time.monotonic()
    try:
        yield
    except RuntimeError as err:
        waited = time.monotonic() - start
        limit = timeout.total_seconds()
        where = f"round {round}, rank {dist.get_rank()}" if round is not None else f"rank {dist.get_rank()}"
        if waited >= 0.9 * limit:
            why = (
                f"did not complete within the collective timeout of {limit:g} s ({COLLECTIVE_TIMEOUT_ENV}): another "
                f"process crashed, froze or is more than {limit:g} s behind this one"
            )
        else:
            why = f"failed after {waited:.1f} s (another process may have exited)"
        raise CollectiveError(f"{where}: collective {collective} {why}; torch: {err}") from err


@contextlib.contextmanager
def named_collective(what: str, round: int | None = None) -> Iterator[None]:
    """Collectives made inside the block by other code (torchmetrics' sync of a metric's states) under the
    collective timeout, a failure raised as :class:`CollectiveError` naming ``what`` and ``round`` (a process that
    raised and exited otherwise leaves the others with the backend's own message); nothing with one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    with _named(what, round, apply_collective_timeout()):
        yield


def all_reduce_statistics(stats: RoundStatistics, round: int | None = None) -> None:
    """Sum (or max) every statistic over all processes, in place; ``round`` names the round in errors.

    Ranks may hold different keys (a rank whose clients all failed has no ``delta``), so the key set, each key's
    reduction and shape are agreed first with ``all_gather_object``; missing entries are zero (sum) or -inf (max).
    Runs under the collective timeout; a failure raises :class:`CollectiveError`.
    """
    timeout = apply_collective_timeout()
    world = dist.get_world_size()
    local = {k: (stats.ops[k], tuple(v.shape), str(v.dtype), str(v.device)) for k, v in stats.values.items()}
    gathered = [None] * world
    with _named("all_gather_object (the keys of the round statistics)", round, timeout):
        dist.all_gather_object(gathered, local)
    spec = {}
    for g in gathered:
        for k, s in g.items():
            spec.setdefault(k, s)
    for k in sorted(spec):
        op, shape, dtype, _ = spec[k]
        if k in stats.values:
            t = stats.values[k]
        else:
            dt = getattr(torch, dtype.split(".")[-1])
            dev = next(iter(stats.values.values())).device if stats.values else torch.device("cpu")
            t = (
                torch.zeros(shape, dtype=dt, device=dev)
                if op == "sum"
                else torch.full(shape, -float("inf"), dtype=dt, device=dev)
            )
        t = t.contiguous()
        with _named(f"all_reduce (round statistic {k!r}, {op})", round, timeout):
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        stats.values[k], stats.ops[k] = t, op


def all_gather_objects(obj, round: int | None = None, what: str = "objects"):
    """``[obj_from_rank_0, obj_from_rank_1, ...]`` (picklable objects; tensors should be on the CPU).

    Runs under the collective timeout; a failure raises :class:`CollectiveError` naming ``what``, ``round`` and
    the rank.
    """
    timeout = apply_collective_timeout()
    out = [None] * dist.get_world_size()
    with _named(f"all_gather_object ({what})", round, timeout):
        dist.all_gather_object(out, obj)
    return out


class FiniteMean(NamedTuple):
    """:func:`finite_weighted_mean_over_processes`' result."""

    mean: Tensor  #: the weighted mean of the finite terms of every process (NaN where no term was finite)
    left_out: list[Any]  #: the keys of this process's terms whose vector holds a NaN or an infinity
    left_out_total: int  #: how many terms were left out, over every process
    used_total: int  #: how many terms entered the mean, over every process


def finite_weighted_mean_over_processes(
    terms: Iterable[tuple[Any, float, Tensor]],
    like: Tensor,
    what: str,
    round: int | None = None,
    raised: Collection[Any] = (),
) -> FiniteMean:
    """``Σ w_k v_k / Σ w_k`` over the terms ``(key, w_k, v_k)`` of every process (each process passes its own share)
    whose vector ``v_k`` is finite, summed in float64 in the order given and returned in ``like``'s dtype and
    shape, with the keys of this process's terms that were left out (a NaN or an infinity in ``v_k``). When no term
    of any process is finite the mean is NaN. Under a process group the partial sums, the summed weight and the
    counts are all-reduced together, under the collective timeout (a failure raises :class:`CollectiveError` naming
    ``what`` and ``round``); in one process this is the weighted mean of the finite terms. The terms whose key is in
    ``raised`` (this process's clients whose computation raised, their vectors NaN) are left out too, and not
    counted in ``left_out`` / ``left_out_total`` (their callers report them)."""
    numel = like.numel()
    acc = torch.zeros(numel + 3, dtype=torch.float64, device=like.device)
    body = acc[:numel]
    left_out: list[Any] = []
    weight, used = 0.0, 0
    for key, w, v in terms:
        if key in raised:
            continue
        if not bool(torch.isfinite(v).all()):
            left_out.append(key)
            continue
        body += w * v.double().reshape(-1)
        weight += w
        used += 1
    acc[numel] = weight
    acc[numel + 1] = used
    acc[numel + 2] = len(left_out)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        timeout = apply_collective_timeout()
        with _named(f"all_reduce ({what})", round, timeout):
            dist.all_reduce(acc)
    weight, used, dropped = acc[numel:].tolist()
    mean = body / weight if used else torch.full_like(body, float("nan"))
    return FiniteMean(mean.to(like.dtype).view(like.shape), left_out, int(dropped), int(used))


def release_process_group() -> None:
    """Destroy the default process group, if one exists, before the process exits. Lightning leaves it alive after
    a fit (another may follow in the same processes); a process that exits with a gloo group alive can abort in the
    interpreter's finalization ("terminate called without an active exception", exit status -6) after a run that
    finished, which a restart loop or a job scheduler takes for a crash. The command line (:func:`fedlightning.cli.main`
    from ``sys.argv``) calls it when it is done. With several processes they meet at a barrier first (ours): a
    process that destroyed its group while another was still closing its last collective's connections aborted the
    same way, now and then."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            with _named("barrier before the process group is released", None, apply_collective_timeout()):
                dist.barrier()
        dist.destroy_process_group()
