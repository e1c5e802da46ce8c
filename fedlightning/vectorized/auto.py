"""The loop's entry to vectorised client execution, ``client_execution="auto"`` and ``max_parallel_clients``.

:func:`run_vectorized_round` is what the loop's vectorised executor calls for every round: the round's
``ClientUpdate`` outcomes from the loop's engine (built once per working copy), group after group, or None for
sequential training (mode ``"sequential"``; ``"auto"`` when it chose sequential or fell back). :func:`auto_choice` is
the rule ``"auto"`` applies to its one-time measurement (:func:`_auto_decide`); :func:`group_size_for` the rule of
``max_parallel_clients="auto"``.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.callbacks.base import copy_of_state
from fedlightning.state import ClientUpdate, RoundPlan

from .batches import _DeviceTransfer
from .call import _info
from .engine import VectorizedClientTrainer
from .support import VectorizationUnsupportedError

__all__ = [
    "AUTO_GROUP_MEMORY_FRACTION",
    "AUTO_MARGIN",
    "RoundOutcomes",
    "VectorizedRun",
    "auto_choice",
    "group_size_for",
    "run_vectorized_round",
]

Outcome = ClientUpdate | Exception


@dataclass
class VectorizedRun:
    """The state of vectorised client execution over one run, held by the loop's executor
    (:class:`fedlightning.execution.VectorizedExecutor`): the mode, the engine of the working copy, and for
    ``"auto"`` its choice and the reason (None before the first round), and whether the run fell back to sequential
    training for good; ``group_size``, the most clients one engine call trains (None: ``loop.max_parallel_clients``
    as set; an int once ``max_parallel_clients="auto"`` measured it or a group ran out of memory and was halved), and
    ``footprint``, the bytes per client that ``"auto"`` measured (None before)."""

    mode: str
    engine: VectorizedClientTrainer | None = None
    choice: str | None = None
    reason: str | None = None
    fallback: bool = False
    group_size: int | None = None
    footprint: float | None = None
    #: the engine's padded path as a checkpoint recorded it (``VectorizedClientTrainer.padded_path_state``), given to
    #: the engine :func:`_engine` builds
    padded_path: dict | None = None

    def group_limit(self, max_parallel_clients: int | str | None) -> int | None:
        """The most clients one vectorised computation takes now: the group size in force (measured for
        ``max_parallel_clients="auto"``, or halved after running out of memory), else the int set, else None (all of
        them)."""
        if self.group_size is not None:
            return self.group_size
        return None if max_parallel_clients == "auto" else max_parallel_clients


def run_vectorized_round(
    loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor, run: VectorizedRun
) -> RoundOutcomes | None:
    """The outcomes of ``client_ids`` for ``plan``, in their order, trained in lockstep group after group (each a
    :class:`ClientUpdate`, or the exception sequential training raises in place of a client's update, for a client
    whose training raised); None means "train them sequentially", and an iterator that ends early means "train the
    clients it did not reach sequentially" (``"auto"`` fell back in the middle of the round).

    Called by the loop's vectorised executor when ``client_execution`` is ``"vectorized"`` or ``"auto"``. With
    ``"auto"``, the first round decides once for the run (:func:`_auto_decide`), and anything
    :class:`VectorizationUnsupportedError` reports makes the loop fall back to sequential training for the rest of
    the run, with a one-time warning. Per-client optimizer state is read from and written to ``loop.client_state``
    (namespace ``"optimizer"``) exactly as sequential training does.

    **Client groups** (``loop.max_parallel_clients``; decisions ours). The round's clients (this process's share under
    DDP) are cut, in their order, into consecutive groups of at most ``G`` clients, each trained by one engine call
    and handed to the loop before the next group trains (so a group's ``[G, D]`` buffers and activations are all a
    round holds at once, and the loop consumes clients in sequential training's order: logged ``client/*`` values,
    torchmetrics calls and client state are made client after client, as sequentially). ``G`` is the int set, the
    whole cohort for None, and for ``"auto"`` :func:`group_size_for` the per-client footprint measured on the run's
    first group of :data:`AUTO_GROUP_PROBE_CLIENTS` clients (with ``client_execution="auto"``, on its measurement's
    warm-up). Results do not depend on the grouping for deterministic models. Dropout masks do: each engine call
    seeds its generator with ``derive_seed(seed, "model-vectorized", round, *group_client_ids)``, so a group equal to
    the cohort (None, or an int at least the cohort) draws exactly the masks of ungrouped training, and a fixed int
    reproduces its own masks on any machine; ``"auto"`` and a halved size depend on the machine's memory (set an int
    where a dropout model must reproduce across machines).

    **Out of memory** (``torch.cuda.OutOfMemoryError``). Vectorised clients hold ``G`` clients' activations and ``[G,
    D]`` weights and gradients at once. A group that runs out of memory leaves no trace: the engine's buffers are freed,
    what its call logged or fed to torchmetrics metrics is undone (:func:`_undo_on_failure`), no client state was
    written (that happens after the call), the random streams were forked, and its clients' optimizers are built again
    (the loop's ``prepare_client``, ``configure_client_optimizer`` and ``client_objective`` hooks called again for them,
    after what those hooks changed was put back as after ``"auto"``'s measurement: :func:`_hooks_undone_on_oom`).
    The group is halved and retried until it fits, one warning naming the new size, which is kept for the rest of
    the run (and checkpointed with the loop: a resumed run trains in the same groups unless ``max_parallel_clients``
    was changed). Only a group of one client that does not fit ends vectorised training:
    ``"auto"`` trains the round's remaining clients and the rest of the run sequentially (one warning), ``"vectorized"``
    raises the error again with the setting named. ``"auto"``'s measurement halves its timed group the same way.
    """
    mode = run.mode
    if mode == "sequential" or not client_ids or run.fallback:
        return None
    if mode == "auto" and run.choice is None:
        try:
            with _hooks_leave_no_trace(loop):
                choice = _auto_decide(loop, run, plan, client_ids, global_flat)
            if choice == "sequential":
                run.fallback = True
                return None
        except VectorizationUnsupportedError as err:
            _fall_back(run, str(err))
            return None
        except torch.cuda.OutOfMemoryError as err:  # a group of one client, in the measurement
            _fall_back(run, f"vectorized clients ran out of accelerator memory even one at a time: {_first_line(err)}")
            return None
    return RoundOutcomes(_groups(loop, run, plan, [int(c) for c in client_ids], global_flat))


class RoundOutcomes:
    """What :func:`run_vectorized_round` returns: iterated, the outcomes of the round's clients one by one;
    :meth:`groups`, the same outcomes a group (one engine call) at a time, for a caller that handles a group's
    updates together. Either way a group is trained when the caller asks for its first outcome."""

    def __init__(self, groups: Iterator[list[Outcome]]) -> None:
        self._groups = groups

    def groups(self) -> Iterator[list[Outcome]]:
        return self._groups

    def __iter__(self) -> Iterator[Outcome]:
        for group in self._groups:
            yield from group


def _groups(loop, run: VectorizedRun, plan: RoundPlan, client_ids: list[int], global_flat: Tensor):
    """The generator behind :func:`run_vectorized_round`, one list of outcomes per group (one engine call each; its
    docstring has the rules)."""
    done, halved_from = 0, None
    while done < len(client_ids):
        rest = client_ids[done:]
        probing = _wants_auto_size(loop, run)
        limit = AUTO_GROUP_PROBE_CLIENTS if probing else _group_limit(loop, run)
        group = rest if limit is None else rest[:limit]
        try:
            with _hooks_undone_on_oom(loop, global_flat.device):
                if probing:
                    outcomes = _probe(loop, run, len(group), lambda g=group: _run(loop, run, plan, g, global_flat))
                else:
                    outcomes = _run(loop, run, plan, group, global_flat)
        except VectorizationUnsupportedError as err:
            if run.mode != "auto":
                if str(err).startswith("round "):
                    raise
                raise VectorizationUnsupportedError(f"round {plan.round}: {err}") from err
            _fall_back(run, str(err))
            return
        except torch.cuda.OutOfMemoryError as err:
            _free(run)
            if len(group) > 1:
                halved_from = halved_from or len(group)
                run.group_size = len(group) // 2
                continue
            if run.mode != "auto":
                raise torch.cuda.OutOfMemoryError(
                    f"client_execution='vectorized': one client alone did not fit in accelerator memory in lockstep "
                    f"(max_parallel_clients={getattr(loop, 'max_parallel_clients', None)!r}, halved down to 1; "
                    f"{_first_line(err)}); use client_execution='sequential' or 'auto'"
                ) from err
            _fall_back(run, f"vectorized clients ran out of accelerator memory even one at a time: {_first_line(err)}")
            return
        if halved_from is not None:
            _warn_halved(halved_from, run.group_size)
            halved_from = None
        done += len(group)
        yield outcomes


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _fall_back(run: VectorizedRun, reason: str) -> None:
    """``"auto"`` trains sequentially from here on, saying why once."""
    from lightning.pytorch.utilities import rank_zero_warn

    run.fallback = True
    run.choice, run.reason = "sequential", reason
    rank_zero_warn(f"client_execution='auto': training clients sequentially ({reason})")


def _warn_halved(old: int, new: int) -> None:
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(
        f"max_parallel_clients: a group of {old} vectorized clients ran out of accelerator memory; training in groups "
        f"of {new} from now on"
    )


# ---------------------------------------------------------------- client groups
#: Clients in the group ``max_parallel_clients="auto"`` measures its per-client footprint on (ours: two, so that the
#: measurement's fixed costs, counted in full, weigh half per client and cannot themselves run out of memory where
#: one client fits twice).
AUTO_GROUP_PROBE_CLIENTS = 2

#: The fraction of the free memory ``max_parallel_clients="auto"`` plans a group to use (ours: on CUDA the footprint
#: is measured, and 20 % is kept for the allocator's fragmentation, a larger padded batch than the probe's and what
#: the loop holds meanwhile; a group that still runs out of memory is halved) ...
AUTO_GROUP_MEMORY_FRACTION = 0.8

#: ... and on a CPU, where the footprint is an estimate (activations saved for the backward pass plus
#: :data:`AUTO_GROUP_CPU_ROWS` rows of ``D`` per client) and running out of memory is not recoverable (the
#: operating system ends the process), this fraction of the available RAM (ours).
AUTO_GROUP_CPU_MEMORY_FRACTION = 0.5

#: Rows of the model's size ``D`` a client holds in a vectorised CPU round besides its activations (ours: its
#: weights, gradient and update, up to three optimizer-state rows (Adam with AMSGrad), a line search's trial point
#: and one spare).
AUTO_GROUP_CPU_ROWS = 8


def group_size_for(per_client_bytes: float, free_bytes: float, fraction: float = AUTO_GROUP_MEMORY_FRACTION) -> int:
    """``max_parallel_clients="auto"``'s group size: ``⌊fraction · free / per_client⌋``, at least 1."""
    if per_client_bytes <= 0:
        raise ValueError(f"per_client_bytes must be > 0, got {per_client_bytes}")
    return max(1, int(fraction * free_bytes // per_client_bytes))


def _wants_auto_size(loop, run: VectorizedRun) -> bool:
    return getattr(loop, "max_parallel_clients", None) == "auto" and run.group_size is None


def _group_limit(loop, run: VectorizedRun) -> int | None:
    """The most clients one engine call trains now (None: all of them)."""
    return run.group_limit(getattr(loop, "max_parallel_clients", None))


def _probe(loop, run: VectorizedRun, num_clients: int, call: Callable[[], Any]) -> Any:
    """``call()`` (an engine call of ``num_clients`` clients), measuring its memory for ``max_parallel_clients="auto"``:
    sets ``run.group_size`` (:func:`group_size_for`) and ``run.footprint`` and logs them in one line.

    The footprint per client (ours): on CUDA, the call's peak allocated memory above what was allocated before it
    (``torch.cuda.max_memory_allocated``; fixed costs included, so an overestimate) over ``num_clients``, against the
    driver's free memory plus the allocator's cached free blocks, with :data:`AUTO_GROUP_MEMORY_FRACTION`. On a
    CPU, which has no allocator statistics, the largest sum of the bytes autograd saves for one backward pass
    (one gradient evaluation, counted with ``torch.autograd.graph.saved_tensors_hooks``) over ``num_clients``, plus
    :data:`AUTO_GROUP_CPU_ROWS` rows of the model's ``D`` parameters, against the available RAM
    (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``), with :data:`AUTO_GROUP_CPU_MEMORY_FRACTION`."""
    engine = _engine(loop, run)
    device = next(iter(engine.model.parameters())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = call()
        torch.cuda.synchronize(device)
        per_client = (torch.cuda.max_memory_allocated(device) - before) / num_clients
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
        free -= torch.cuda.memory_allocated(device)
        fraction = AUTO_GROUP_MEMORY_FRACTION
    else:
        saved = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = call()
        itemsize = torch.empty((), dtype=engine.dtype).element_size()
        rows = AUTO_GROUP_CPU_ROWS * sum(p.numel() for p in engine.model.parameters() if p.requires_grad) * itemsize
        per_client = saved.peak / num_clients + rows
        free, fraction = _available_ram(), AUTO_GROUP_CPU_MEMORY_FRACTION
    per_client = max(per_client, 1.0)
    run.footprint = per_client
    run.group_size = group_size_for(per_client, free, fraction)
    _info(
        f"max_parallel_clients='auto': groups of at most {run.group_size} clients ({per_client / 2**20:.1f} MiB per "
        f"client measured on {device.type}, {free / 2**30:.1f} GiB free, planned to use {fraction:.0%} of it)"
    )
    return out


class _SavedBytes:
    """Counts the bytes of the distinct storages autograd saves during one gradient evaluation; ``peak`` is the
    largest such count (a backward pass, seen as the first unpack after packs, ends an evaluation)."""

    def __init__(self) -> None:
        self.peak = 0
        self._current = 0
        self._seen: set[int] = set()
        self._in_backward = False

    def pack(self, t: Tensor) -> Tensor:
        if self._in_backward:
            self._current, self._in_backward = 0, False
            self._seen.clear()
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self._current += storage.nbytes()
                self.peak = max(self.peak, self._current)
        except Exception:  # noqa: BLE001 - a tensor without a plain storage counts nothing
            pass
        return t

    def unpack(self, t: Tensor) -> Tensor:
        self._in_backward = True
        return t


def _available_ram() -> float:
    """Bytes of RAM available to a new allocation: ``MemAvailable`` (Linux), else free pages (``os.sysconf``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float(8 << 30)  # unknown: plan for 8 GiB (ours)


@contextmanager
def _undo_on_failure(worker):
    """An engine call that raises leaves the worker's log router and torchmetrics states as they were before it:
    values it logged are dropped (the router's lists cut back to their lengths) and metric states restored."""
    router = getattr(worker, "router", None)
    metrics = getattr(worker, "metrics", None)
    saved_metrics = metrics.save() if metrics else None
    if router is not None:
        saved_capture = router.save_capture()
        saved_router = (dict(router.metrics), dict(router.metric_paths))
    try:
        yield
    except BaseException:
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
        if router is not None:
            router.restore_capture(saved_capture)
            router.metrics, router.metric_paths = saved_router
        raise


def _free(run: VectorizedRun) -> None:
    """Drop the vectorised engine's reusable buffers and the allocator's cached blocks after running out of memory."""
    engine = run.engine
    if engine is not None:
        engine.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: The clock :func:`_auto_decide` times its throw-away rounds with (replaceable, for deterministic tests).
_clock = time.perf_counter

#: ``auto`` picks vectorized only when its round is at least this much faster than sequential (ours: timings of
#: one round on a shared machine vary by several percent, and sequential is the reference path).
AUTO_MARGIN = 1.1

#: Lockstep steps ``auto`` times vectorised at least (at most the round's ``K``; the budget permitting) ...
AUTO_MEASURE_STEPS = 5

#: ... and clients it times sequentially at least, each with all its local steps (the budget permitting) ...
AUTO_SEQUENTIAL_CLIENTS = 3

#: ... and then more of each, up to a whole round, until that mode's timed part has taken this many seconds (ours:
#: on a CPU a cheap model's client takes ~10 ms for 20 steps and its vectorised step ~3 ms, and another process on
#: the machine can stretch any one of them several times over; 50 ms gives the medians of
#: :func:`_auto_decide` enough samples to pass over a few such interruptions).
AUTO_MEASURE_SECONDS = 0.05

#: What ``auto``'s whole measurement may cost, warm-ups included, in estimated sequential rounds of the run's first
#: round (ours: about one round; its floor is one client and one lockstep step, see :func:`_auto_decide`) ...
AUTO_BUDGET_ROUNDS = 1.0

#: ... but never less than this many seconds (ours: half a second once per run costs nobody anything, and on a
#: cheap round, where the warm-ups' one-time costs can exceed the round, it lets the measurement reach its minimums
#: above instead of its floor).
AUTO_MIN_BUDGET_SECONDS = 0.5


def auto_choice(seconds_sequential: float, seconds_vectorized: float, margin: float = AUTO_MARGIN) -> str:
    """``"vectorized"`` if ``seconds_vectorized * margin < seconds_sequential``, else ``"sequential"``."""
    return "vectorized" if seconds_vectorized * margin < seconds_sequential else "sequential"


def _auto_decide(loop, run: VectorizedRun, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> str:
    """``client_execution="auto"``: choose the mode of this run, once, at its first round; logged once, in plain
    words (``training clients vectorized (3.10x faster than one at a time; timed: 5 local steps of all 20 clients
    vectorized, 4 of the 20 clients one at a time)``); ``run.reason`` (``loop.client_execution_reason``) is the
    line's reason part.

    Decisions (ours; the measurements behind them: ``python benchmarks/auto_zoo.py``, docs/benchmarks.md §3):

    * **Models with dropout train one at a time (sequentially), unmeasured.** This is a reproducibility rule, not a
      speed rule: vectorised mode draws other (reproducible) dropout masks than sequential mode, so a choice made by
      a timing would make the results depend on the machine's speed. Set ``client_execution="vectorized"`` to
      accept that.
    * **Every other model is measured**, recurrent ones included, on any device: no fixed rule leaves a faster mode
      unused (a GRU text classifier trains faster vectorised on a CPU, an LSTM slower).
    * **What is timed.** On throw-away copies, from the round's global weights, on the round's batches: one untimed
      local step of two clients vectorised and of one client sequentially (one-time costs: the engine's probes,
      first calls); then sequentially, one client at a time and each with all its local steps, at least
      :data:`AUTO_SEQUENTIAL_CLIENTS` of the round's clients and more until the timed ones have taken
      :data:`AUTO_MEASURE_SECONDS`, in an order whose every prefix spans the round's batch sizes
      (:func:`_typical_clients`); then vectorised, all the round's ``C`` clients in lockstep for at least
      ``min(K, AUTO_MEASURE_STEPS)`` steps and more until they have taken :data:`AUTO_MEASURE_SECONDS` (at most
      ``K``).
    * **Estimates, from medians.** Another process on the machine only ever adds time, to a minority of the
      samples when the timing is long enough, so the per-sample medians pass over it. A sequential client-step
      costs about the same for every client: the sequential round is estimated as ``R`` = the median over the timed
      clients of (client's time / its steps) × ``Σ_c K_c`` (each client's own step count, ``plan.steps_for``).
      Whole clients are timed because a client's set-up (optimizer, data loader, hooks) timed with a few of its
      steps and scaled to ``K`` would be counted ``K / m`` times over (the zoo's BatchNorm CNN,
      ``benchmarks/auto_zoo.py``: 1.6 ms per step when a client runs 5 steps, 1.0 ms when it runs its 20). A
      vectorised step's cost depends on how many clients share it, so it is timed on all ``C``; the vectorised
      round is estimated as its first step (which also carries the round's start-up, paid once a round) plus
      ``K - 1`` times the median of the later timed steps; after a single step, as that step's time times ``K``
      (which can only tip a close call towards sequential). ``K`` is the largest client's steps: ragged clients
      are masked, not skipped, in a vectorised round. The end of a vectorised round
      (every client's update) is in its last timed step only.
    * **Bounded cost: about one sequential round** (:data:`AUTO_BUDGET_ROUNDS` × ``R``, warm-ups included, ``R``
      re-estimated after each timed client; at least :data:`AUTO_MIN_BUDGET_SECONDS`), also where a round is
      expensive (few clients, ``K`` of 1 or 2, a large model). One more client is timed sequentially only while
      the time spent, that client (at the timed clients' mean) and one vectorised step costing what ``C``
      sequential client-steps cost (the even case; room for the one step vectorised must have) fit in the budget;
      the vectorised round stops after a step when the next one (at its fastest step so far) would not fit, and
      after the step at which a lower bound of its estimate already rules it out: its first step plus ``K - 1``
      times its fastest later step (from the third step on, so that no single interrupted step decides; before,
      the first step alone). A much slower vectorised mode thus costs few of its slow steps, and a stop for a loss
      always agrees with the estimate from the steps timed. At least one client is timed sequentially and one
      lockstep step vectorised, so the cost's floor is the warm-ups, one client's steps and one vectorised step of
      the ``C`` clients: with ``K = 1`` that step is a whole vectorised round (about 1.4 rounds in all for 10
      clients at even speeds; more where vectorised is much slower), which no measurement of a full-size
      vectorised step avoids. Where fewer than :data:`AUTO_SEQUENTIAL_CLIENTS` timed clients chose vectorised, their
      steps are timed once more, beyond the budget (the choice, below).
    * **Groups** (``max_parallel_clients``, :func:`run_vectorized_round`): where the round trains in groups of
      ``G < C`` clients, the vectorised timing runs one group (the round's first ``G`` clients) and the vectorised
      round is estimated as ``⌈C / G⌉`` times that group's round (a smaller last group counted in full: a close call
      tips towards sequential); the warm-up is ``max_parallel_clients="auto"``'s footprint measurement
      (:func:`_probe`). A measurement that runs out of memory is repeated with the group halved (one warning).
    * **The choice**: vectorised when its estimated round is faster by :data:`AUTO_MARGIN` (:func:`auto_choice`).
      Where that choice rests on fewer than :data:`AUTO_SEQUENTIAL_CLIENTS` sequential clients (the budget ran out:
      a stall in the warm-ups uses it up), no median can pass over an interrupted client, and one would make
      sequential look slow (a 3-client round whose modes ran at the same speed read "72x faster"): those clients are
      timed once more, after the vectorised timing, each keeps the smaller of its two times, and the choice is made
      again (ours: another process only ever adds time, and rarely twice to the same client at two moments; the cost
      is those clients' steps, only on this path; the reason then says "(twice)"). A vectorised estimate that an
      interruption inflates can only tip a call towards sequential, the reference path, and is not re-timed.
      After choosing sequential the engine's buffers are released: no vectorised round follows.
    * **Throw-away**: both modes log and make the metric calls a real round makes, so their cost is timed, and
      then no logged value reaches the loop, torchmetrics states are restored (:func:`_throwaway_logs`), no client
      state is written and the updates are dropped; random streams are forked in both modes, so the real round that
      follows computes exactly what it computes without the measurement.
    * A model or optimizer the engine cannot train raises :class:`VectorizationUnsupportedError` from the first
      throw-away round (the vectorised warm-up, before any sequential time is spent): the caller falls back to
      sequential with its warning. What only a later step meets (a ``training_step`` that returns
      None at step 2, batches that stop stacking) is met by the timed vectorised round if it gets that far, else
      by a real round if vectorised is chosen (the same fallback and warning; that round is then trained
      sequentially), and not at all if the timing chooses sequential.
    """
    engine = _engine(loop, run)
    if not engine.deterministic:
        choice, reason = (
            "sequential",
            (
                "the model has dropout, and vectorized training would draw different dropout masks, so results would "
                "depend on this machine's speed; set client_execution='vectorized' to use it anyway"
            ),
        )
    else:
        halved_from = None
        while True:
            try:
                choice, reason = _measure(loop, run, plan, client_ids, global_flat)
                break
            except torch.cuda.OutOfMemoryError:
                _free(run)
                size = min(_group_limit(loop, run) or len(client_ids), len(client_ids))
                if size <= 1:
                    raise
                halved_from = halved_from or size
                run.group_size = size // 2
        if halved_from is not None:
            _warn_halved(halved_from, run.group_size)
        if not engine.deterministic:  # found random draws in its first batched call (F.dropout, noise)
            choice, reason = (
                "sequential",
                "training_step draws random numbers (torch's generator moved in its first batched call), and "
                "vectorized training would draw different ones, so results would depend on this machine's speed; "
                "set client_execution='vectorized' to use it anyway",
            )
        if choice == "sequential":
            _free(run)  # the run trains no vectorised round: its buffers ([C, D] and larger) are not kept
    run.choice, run.reason = choice, reason
    if choice == "vectorized":
        _info(f"client_execution='auto': training clients vectorized ({reason})")
    else:
        _info(f"client_execution='auto': training clients one at a time (sequential): {reason}")
    return choice


def _measure(loop, run: VectorizedRun, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor):
    """``auto``'s timed throw-away rounds (:func:`_auto_decide` says what and why): ``(choice, reason)``."""
    device = global_flat.device
    C, K = len(client_ids), plan.local_steps
    client_steps = sum(plan.steps_for(c) for c in client_ids)
    warm = plan.with_steps(1)
    _sync(device)
    t_start = _clock()
    if _wants_auto_size(loop, run):  # warm-up: probes, first calls; the footprint of max_parallel_clients="auto"
        warm_ids = client_ids[:AUTO_GROUP_PROBE_CLIENTS]
        _probe(loop, run, len(warm_ids), lambda: _run(loop, run, warm, warm_ids, global_flat, throwaway=True))
    else:
        _run(loop, run, warm, client_ids[: min(2, _group_limit(loop, run) or 2)], global_flat, throwaway=True)
    G = min(_group_limit(loop, run) or C, C)  # the clients of one vectorised engine call
    groups = -(-C // G)
    rates, timed_clients = [], []  # seconds per local step of each timed client, and the clients
    with _throwaway_sequential(loop):
        _train_or_fail(loop, warm, client_ids[0], global_flat)  # warm-up
        _sync(device)
        t0 = t1 = _clock()
        for cid in _typical_clients(loop, client_ids):
            _train_or_fail(loop, plan, cid, global_flat)  # all of the client's steps, as in the round
            _sync(device)
            t, t1 = t1, _clock()
            rates.append((t1 - t) / plan.steps_for(cid))
            timed_clients.append(cid)
            seq = statistics.median(rates) * client_steps  # the estimated sequential round
            if t1 - t_start + (t1 - t0) / len(rates) + seq * G / client_steps > _budget(seq):
                break  # one more client and one vectorised step at sequential speed would not fit in the budget
            if len(rates) >= AUTO_SEQUENTIAL_CLIENTS and t1 - t0 >= AUTO_MEASURE_SECONDS:
                break  # timed long enough
    n, m = len(rates), min(K, AUTO_MEASURE_STEPS)
    budget = _budget(seq) - (t1 - t_start)  # what the vectorised round may still cost
    readings, lost = [t1], [False]

    def stop() -> bool:  # after each lockstep step but the last
        _sync(device)
        readings.append(_clock())
        spent, steps = readings[-1] - t1, _diffs(readings)
        later = steps[1:]  # the first step also carries the round's start-up
        fastest = min(later) if len(later) >= 2 else 0.0  # one later step alone may have been interrupted
        lost[0] = auto_choice(seq, groups * (steps[0] + (K - 1) * fastest)) == "sequential"  # its estimate's bound
        enough = len(steps) >= m and spent >= AUTO_MEASURE_SECONDS
        return lost[0] or enough or spent + min(steps) > budget

    timed = client_ids[:G]
    finished = _run(loop, run, plan.with_steps(K), timed, global_flat, throwaway=True, stop=stop) is not None
    if finished:
        _sync(device)
        readings.append(_clock())
    steps = _diffs(readings)
    if len(steps) == 1:
        vec = steps[0] * K  # the start-up counted K times: a close call tips towards sequential
    else:
        vec = steps[0] + (K - 1) * statistics.median(steps[1:])  # the estimated vectorised round of one group
    vec *= groups
    choice = auto_choice(seq, vec)  # sequential after a loss: its estimate only grew since it had lost
    retimed = choice == "vectorized" and n < AUTO_SEQUENTIAL_CLIENTS
    if retimed:  # too few sequential samples for a median to pass over an interruption: time them once more
        rates = [min(r, a) for r, a in zip(rates, _time_again(loop, plan, timed_clients, global_flat))]
        seq = statistics.median(rates) * client_steps
        choice = auto_choice(seq, vec)
    ratio = seq / max(vec, 1e-12)
    everyone = f"all {C} clients" if C > 1 else "the 1 client"
    if G < C:
        everyone = f"a group of {_count(G, 'client')} of {C} ({groups} groups)"
    timed = (
        f"timed: {_count(len(steps), 'local step')} of {everyone} vectorized, "
        f"{'all' if n == C else n} of the {_count(C, 'client')} one at a time{' (twice)' if retimed else ''}"
    )
    if choice == "vectorized":
        return choice, f"{ratio:.2f}x faster than one at a time; {timed}"
    reason = f"vectorized measured {ratio:.2f}x as fast ({timed})"
    if lost[0]:
        reason += (
            f"; its measurement stopped after {_count(len(steps), 'step')}, as it could no longer be "
            f"{AUTO_MARGIN}x faster"
        )
    elif ratio >= 1:
        reason += f"; it is used only when at least {AUTO_MARGIN}x faster"
    return choice, reason


def _time_again(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> list[float]:
    """Seconds per local step of each of ``client_ids`` trained sequentially (throw-away) once more."""
    device, rates = global_flat.device, []
    with _throwaway_sequential(loop):
        for cid in client_ids:
            _sync(device)
            start = _clock()
            _train_or_fail(loop, plan, cid, global_flat)
            _sync(device)
            rates.append((_clock() - start) / plan.steps_for(cid))
    return rates


def _diffs(readings: list[float]) -> list[float]:
    return [b - a for a, b in zip(readings, readings[1:])]


def _budget(sequential_round: float) -> float:
    """The measurement's budget in seconds, for a sequential round estimated at ``sequential_round`` seconds."""
    return max(AUTO_BUDGET_ROUNDS * sequential_round, AUTO_MIN_BUDGET_SECONDS)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _typical_clients(loop, client_ids: Sequence[int]) -> list[int]:
    """``client_ids`` in the order ``auto`` times them sequentially: every prefix spans the round's batch sizes.

    The clients are sorted by batch size (``min(samples, batch_size)``, what a sequential step's cost grows with)
    and taken at the fractions 1/2, 1/4, 3/4, 1/8, 5/8, 3/8, 7/8, ... of that order (van der Corput's sequence),
    each client once: the median client first, then the quartiles, and so on. Ours: the measurement stops after a
    prefix (its budget, its time), and a prefix spread over the sizes estimates the round's mean cost per
    client-step with less spread than the same number of clients in sampled order.
    """
    dm = loop.datamodule
    size = [min(dm.client_num_samples(int(c)), int(dm.batch_size)) for c in client_ids]
    ranked = sorted(range(len(client_ids)), key=lambda i: (size[i], i))
    order, taken, i = [], set(), 1
    while len(order) < len(ranked):
        x, f, j = 0.0, 0.5, i  # the i-th term of van der Corput's sequence: i's binary digits mirrored
        while j:
            x, f, j = x + f * (j & 1), f / 2, j >> 1
        r = int(x * len(ranked))
        if r not in taken:
            taken.add(r)
            order.append(ranked[r])
        i += 1
    return [int(client_ids[k]) for k in order]


def _train_or_fail(loop, plan: RoundPlan, client_id: int, global_flat: Tensor) -> None:
    """``loop.train_client`` in ``auto``'s timed throw-away round: a client whose training raises (a BatchNorm batch
    of one sample) is the failure policy's business in the real round that follows; here it only ends that
    client's share of the timing, as it ends its training."""
    try:
        loop.train_client(plan, client_id, global_flat)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


#: Values :func:`_hooks_leave_no_trace` copies and puts back: Python scalars, strings, tensors, numpy values, and
#: lists, tuples, sets and dicts of them.
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, Tensor, np.ndarray, np.generic)


class _TooDeep:
    """What :func:`_leaves` gives for a container nested more than 8 levels deep (not plain data)."""


def _leaves(value: Any, depth: int = 0) -> Iterator[Any]:
    """The values inside ``value``'s lists, tuples, sets and dicts (keys and values), at any depth up to 8
    (deeper: a :class:`_TooDeep`), or ``value`` itself when it is none of those."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth >= 8:
            yield _TooDeep()
            return
        for v in value.items() if isinstance(value, dict) else value:
            yield from _leaves(v, depth + 1)
    else:
        yield value


def _plain(value: Any) -> bool:
    return all(isinstance(v, _PLAIN_TYPES) for v in _leaves(value))


#: The per-client hooks ``auto``'s measurement calls (``FederatedLoop.prepare_client``).
_MEASURED_HOOKS = ("configure_client_optimizer", "client_objective")


@contextmanager
def _hooks_leave_no_trace(loop):
    """Within the block (``auto``'s measurement), the loop's per-client hooks run for the clients it times
    (``configure_client_optimizer``, ``client_objective``, through ``prepare_client``), some of them again in the
    real round that follows; afterwards the callbacks that define these hooks and ``loop.client_state`` are as they
    were before, so that a hook that counts or records (a client's participation, a per-client value) sees each
    client once per round, as in sequential training, and a resumed run equals an uninterrupted one.

    Decisions (ours; Lightning's tuner likewise restores what its trial runs changed, through a checkpoint): put back
    are each such callback's ``state_dict()`` (through ``load_state_dict``, where the callback defines them) and its
    attributes that hold plain data (:data:`_PLAIN_TYPES`, copied: a ``Counter``, a dict of tensors, a list of
    floats), attributes of plain data the hooks added are removed, and ``loop.client_state``'s entries are put back
    (each entry's dict copied; a tensor changed in place inside an entry is not). State kept in other objects, and
    not in ``state_dict()``, is not restored: hooks that keep such state are documented to be called again there
    (docs/architecture.md, "Extension points"). An attribute is put back in place (:func:`_put_back`): one that the
    hooks left as it was keeps its object, and so what it shares with others (the model's parameters)."""
    saved = _HookState(loop)
    try:
        with loop.client_state.rehearsal():  # the measured clients write their state twice: put back below
            yield
    finally:
        saved.restore()


@contextmanager
def _hooks_undone_on_oom(loop, device: torch.device):
    """Within the block (one real group's engine call), where the group can run out of accelerator memory
    (:func:`_may_run_out_of_memory`), what the per-client hooks change is put back when it does, as after ``auto``'s
    measurement (:func:`_hooks_leave_no_trace`): the group is retried smaller, and its clients' hooks are called
    again, once per client and round as in sequential training. Elsewhere (CPU) nothing is saved: no
    ``torch.cuda.OutOfMemoryError`` comes, and the copies would cost every round. Decision (ours): attributes that
    hold tensors are not copied here (a copy of per-client gradients would take the memory that ran out; a hook
    that keeps tensors per client writes them again when called again); counts, flags and ``state_dict()`` are."""
    if not _may_run_out_of_memory(device):
        yield
        return
    saved = _HookState(loop, tensors=False)
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        saved.restore()
        raise


def _may_run_out_of_memory(device: torch.device) -> bool:
    """Whether an engine call on ``device`` can raise ``torch.cuda.OutOfMemoryError`` (an accelerator's allocator;
    a CPU allocation that fails raises another error, which ends the run)."""
    return device.type != "cpu"


class _HookState:
    """What :func:`_hooks_leave_no_trace` puts back, saved at construction: the plain-data attributes and the
    ``state_dict()`` of the callbacks that define per-client hooks, and ``loop.client_state``'s entries; with
    ``tensors=False``, attributes that hold tensors are left out."""

    def __init__(self, loop, tensors: bool = True) -> None:
        self.loop = loop
        owners = [cb for cb in loop.trainer.callbacks if any(callable(getattr(cb, n, None)) for n in _MEASURED_HOOKS)]
        self.saved = []
        for cb in owners:
            attributes = {}
            for k, v in vars(cb).items():
                if _plain(v) and (tensors or not _holds_tensor(v)):
                    try:
                        attributes[k] = (v, copy.deepcopy(v))
                    except (RuntimeError, TypeError):  # e.g. a tensor with autograd history: left as it is
                        continue
            self.saved.append((cb, set(vars(cb)), attributes, copy_of_state(cb)))
        self.entries = loop.client_state.snapshot()

    def restore(self) -> None:
        for cb, before, attributes, state in self.saved:
            for k in [k for k, v in vars(cb).items() if k not in before and _plain(v)]:
                delattr(cb, k)
            for k, (original, copied) in attributes.items():
                setattr(cb, k, _put_back(original, copied))
            if state is not None:
                cb.load_state_dict(state)
        self.loop.client_state.restore(self.entries)


def _holds_tensor(value: Any) -> bool:
    """Whether plain data (:func:`_plain`) holds a tensor."""
    return any(isinstance(v, Tensor) for v in _leaves(value))


def _equal(a: Any, b: Any) -> bool:
    """Deep equality of plain data (:func:`_plain`), tensors and arrays by type, shape and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equals NaN here
    except Exception:  # noqa: BLE001 - values that do not compare: taken as changed
        return False


def _put_back(original: Any, copied: Any) -> Any:
    """The value an attribute holds again: ``original`` itself, with its contents put back in place where they
    changed (dicts and lists entry by entry, tensors copied into), so that objects it shares with others (a list of
    the model's parameters) stay shared; ``copied`` where ``original`` cannot be changed in place."""
    if _equal(original, copied):
        return original
    if isinstance(original, dict):
        for k in [k for k in original if k not in copied]:
            del original[k]
        for k, v in copied.items():
            original[k] = _put_back(original[k], v) if k in original else v
        return original
    if isinstance(original, list) and len(original) == len(copied):
        original[:] = [_put_back(o, c) for o, c in zip(original, copied)]
        return original
    if isinstance(original, list):
        original[:] = copied
        return original
    if isinstance(original, set):
        original.clear()
        original.update(copied)
        return original
    if isinstance(original, Tensor) and original.shape == copied.shape and original.dtype == copied.dtype:
        with torch.no_grad():
            original.copy_(copied)
        return original
    return copied


@contextmanager
def _throwaway_sequential(loop):
    """``loop.train_client`` calls inside leave no trace: logged values are discarded, torchmetrics states restored
    and no client state is written (``persist_client_state`` off for the block)."""
    persist = loop.persist_client_state
    loop.persist_client_state = False
    try:
        with _throwaway_logs(loop.client_worker):
            yield
    finally:
        loop.persist_client_state = persist


@contextmanager
def _throwaway_logs(worker):
    """Training inside logs and updates metrics as a real round does (so that their cost is timed), and none of it
    stays: the worker's log router (captured values, torchmetrics metrics logged as objects) and its torchmetrics
    states are given back as they were."""
    router = getattr(worker, "router", None)
    metrics = getattr(worker, "metrics", None)
    saved_metrics = metrics.save() if metrics else None
    saved_router = (router.save_capture(), dict(router.metrics), dict(router.metric_paths)) if router else None
    if router is not None:
        router.restore_capture(({}, {}))
    try:
        yield
    finally:
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
        if router is not None:
            router.restore_capture(saved_router[0])
            router.metrics, router.metric_paths = saved_router[1], saved_router[2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(loop, run: VectorizedRun) -> VectorizedClientTrainer:
    """The loop's engine for its working copy (built on first use; raises what the model cannot do)."""
    worker = loop.client_worker
    hooks = getattr(worker, "hooks", None)
    if hooks is not None:
        raise VectorizationUnsupportedError(
            f"{hooks.describe(worker.model_name)}, which client_execution='vectorized' cannot call per client; use "
            "client_execution='sequential' (or 'auto')"
        )
    engine: VectorizedClientTrainer | None = run.engine
    if engine is None or engine.model is not worker.model:
        # the precision plugin's conversion, before the transfer (Lightning's order)
        convert = getattr(worker, "convert_input", None)
        to_device = worker.to_device if convert is None else (lambda b: worker.to_device(convert(b)))
        device = next(iter(worker.model.parameters()), torch.empty(0)).device
        engine = VectorizedClientTrainer(worker.model, to_device=_DeviceTransfer(to_device, device))
        engine.pin_padded_path(run.padded_path)
        run.engine = engine
    return engine


def _run(
    loop,
    run: VectorizedRun,
    plan: RoundPlan,
    client_ids: Sequence[int],
    global_flat: Tensor,
    throwaway: bool = False,
    stop=None,
) -> list[ClientUpdate | Exception] | None:
    """``FederatedLoop.train_client`` for all of ``client_ids`` at once (the loop's ``prepare_client`` and
    ``finish_client`` around the engine's round); ``throwaway`` (``auto``'s measurement): the round logs and
    updates metrics as a real one does, and then nothing logged stays, no client state is written and torchmetrics
    states are restored (:func:`_throwaway_logs`); ``stop`` (throw-away rounds only): the engine's early stop, after
    which the round returns None."""
    if stop is not None and not throwaway:
        raise ValueError("only a throw-away round can stop early")
    worker = loop.client_worker
    engine = _engine(loop, run)
    client_ids = [int(c) for c in client_ids]
    gbuffers = list(loop.model.buffers())
    frozen = getattr(worker, "frozen", None)
    if frozen:  # the clients start from the global values of the parameters that do not train, as sequentially
        with torch.no_grad():
            worker.sync_frozen(loop.global_frozen_parameters())
    # a throw-away round logs and replays the metric calls as a real round does (their time counts), then undoes them;
    # a real round that raises (out of memory: its group is retried smaller) undoes what it logged, the per-client
    # hooks' values (``prepare_client``: configure_client_optimizer, client_objective) included
    with _throwaway_logs(worker) if throwaway else _undo_on_failure(worker):
        # torch.optim optimizers are reset and reused across rounds, one per position in the group (prepare_client)
        prepared = [
            loop.prepare_client(plan, cid, worker.params, reuse=True, slot=c) for c, cid in enumerate(client_ids)
        ]
        optimizers = [opt for opt, _ in prepared]
        updates = engine.run(
            client_ids=client_ids,
            round=plan.round,
            seed=loop.seed,
            global_params=loop.global_parameters(),
            global_buffers=gbuffers,
            global_flat=global_flat,
            datamodule=loop.datamodule,
            optimizers=optimizers,
            local_steps=[plan.steps_for(c) for c in client_ids],
            grad_clip=loop.client_grad_clip,
            terms=[terms for _, terms in prepared],
            router=getattr(worker, "router", None),
            with_buffers=True,
            stop=stop,
        )
        changed = worker.changed_frozen() if frozen else []
        if changed:  # raised inside the block: what the call logged is undone
            raise VectorizationUnsupportedError(
                f"{worker.model_name} writes into its parameter(s) {', '.join(changed[:5])} with requires_grad=False "
                "during client training; vectorized clients share such a parameter (a write applies once per batched "
                "call, not once per client), so they cannot train as sequential clients do; use "
                "client_execution='sequential' (or 'auto')"
            )
    if updates is None:
        return None
    for update, opt in zip(updates, optimizers):
        if not isinstance(update, Exception):  # a client that raised leaves no client state, as sequentially
            loop.finish_client(update, opt, persist=not throwaway)
    return updates
