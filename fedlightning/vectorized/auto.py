"""The loop's entry to vectorised client execution, and ``client_execution="auto"``.

:func:`run_vectorized_round` is what ``FederatedLoop.training_step`` calls for every round: the round's
``ClientUpdate`` list from the loop's engine (built once per working copy), or None for sequential training (mode
``"sequential"``; ``"auto"`` when it chose sequential or fell back). :func:`auto_choice` is the rule ``"auto"``
applies to its one-time measurement (:func:`_auto_decide`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from fedlightning.state import ClientUpdate, RoundPlan

from .call import _info
from .engine import VectorizedClientTrainer
from .support import VectorizationUnsupportedError

__all__ = ["AUTO_MARGIN", "VectorizedRun", "auto_choice", "run_vectorized_round"]


@dataclass
class VectorizedRun:
    """The state of vectorised client execution over one run, held by the loop's executor
    (:class:`fedlightning.execution.VectorizedExecutor`): the mode, the engine of the working copy, and for
    ``"auto"`` its choice and the reason (None before the first round), and whether the run fell back to sequential
    training for good."""

    mode: str
    engine: VectorizedClientTrainer | None = None
    choice: str | None = None
    reason: str | None = None
    fallback: bool = False


def run_vectorized_round(
    loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor, run: VectorizedRun
) -> list[ClientUpdate | Exception] | None:
    """The ClientUpdates of ``client_ids`` for ``plan``, trained in lockstep (the exception sequential training
    raises in place of a client's update, for a client whose training raised); None means "train them
    sequentially".

    Called by :meth:`FederatedLoop.training_step` when ``client_execution`` is ``"vectorized"`` or ``"auto"``. With
    ``"auto"``, the first round decides once for the run (:func:`_auto_decide`), and anything
    :class:`VectorizationUnsupportedError` reports makes the loop fall back to sequential training for the rest of
    the run, with a one-time warning. Per-client optimizer state is read from and written to ``loop.client_state``
    (namespace ``"optimizer"``) exactly as sequential training does.

    Accelerator memory (ours): the round's ``C`` clients in lockstep hold ``C`` clients' activations and a ``[C, D]``
    weight and gradient matrix, so a model that trains sequentially can run out of memory vectorised. With
    ``"auto"`` that is one more reason to train sequentially: the engine's buffers are freed, the round (its
    measurement, or a real round, which has then changed no client state, metric or logged value) is trained
    sequentially, and so is the rest of the run, with a one-time warning. With ``"vectorized"`` the
    ``OutOfMemoryError`` is raised again with the setting named.
    """
    mode = run.mode
    if mode == "sequential" or not client_ids or run.fallback:
        return None
    try:
        if mode == "auto" and run.choice is None:
            if _auto_decide(loop, run, plan, client_ids, global_flat) == "sequential":
                run.fallback = True
                return None
        return _run(loop, run, plan, client_ids, global_flat)
    except VectorizationUnsupportedError as err:
        if mode != "auto":
            raise
        reason = str(err)
    except torch.cuda.OutOfMemoryError as err:
        _free(run)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if mode != "auto":
            raise torch.cuda.OutOfMemoryError(
                f"client_execution='vectorized': the round's {len(client_ids)} clients in lockstep did not fit in "
                f"accelerator memory ({first}); use client_execution='sequential' or 'auto', or fewer "
                "clients_per_round"
            ) from err
        reason = f"vectorized clients ran out of accelerator memory: {first}"
    from lightning.pytorch.utilities import rank_zero_warn

    run.fallback = True
    run.choice, run.reason = "sequential", reason
    rank_zero_warn(f"client_execution='auto': training clients sequentially ({reason})")
    return None


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
      vectorised step avoids.
    * **The choice**: vectorised when its estimated round is faster by :data:`AUTO_MARGIN` (:func:`auto_choice`).
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
        choice, reason = _measure(loop, run, plan, client_ids, global_flat)
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
    _run(loop, run, warm, client_ids[:2], global_flat, throwaway=True)  # warm-up: probes, first calls
    rates = []  # seconds per local step of each timed client
    with _throwaway_sequential(loop):
        _train_or_fail(loop, warm, client_ids[0], global_flat)  # warm-up
        _sync(device)
        t0 = t1 = _clock()
        for cid in _typical_clients(loop, client_ids):
            _train_or_fail(loop, plan, cid, global_flat)  # all of the client's steps, as in the round
            _sync(device)
            t, t1 = t1, _clock()
            rates.append((t1 - t) / plan.steps_for(cid))
            seq = statistics.median(rates) * client_steps  # the estimated sequential round
            if t1 - t_start + (t1 - t0) / len(rates) + seq * C / client_steps > _budget(seq):
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
        lost[0] = auto_choice(seq, steps[0] + (K - 1) * fastest) == "sequential"  # a bound of its estimate below
        enough = len(steps) >= m and spent >= AUTO_MEASURE_SECONDS
        return lost[0] or enough or spent + min(steps) > budget

    finished = _run(loop, run, plan.with_steps(K), client_ids, global_flat, throwaway=True, stop=stop) is not None
    if finished:
        _sync(device)
        readings.append(_clock())
    steps = _diffs(readings)
    if len(steps) == 1:
        vec = steps[0] * K  # the start-up counted K times: a close call tips towards sequential
    else:
        vec = steps[0] + (K - 1) * statistics.median(steps[1:])  # the estimated vectorised round
    choice = auto_choice(seq, vec)  # sequential after a loss: its estimate only grew since it had lost
    ratio = seq / max(vec, 1e-12)
    everyone = f"all {C} clients" if C > 1 else "the 1 client"
    timed = (
        f"timed: {_count(len(steps), 'local step')} of {everyone} vectorized, "
        f"{'all' if n == C else n} of the {_count(C, 'client')} one at a time"
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
    saved_router = (router.captured, dict(router.metrics), dict(router.metric_paths)) if router is not None else None
    if router is not None:
        router.captured = {}
    try:
        yield
    finally:
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
        if router is not None:
            router.captured, router.metrics, router.metric_paths = saved_router


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(loop, run: VectorizedRun) -> VectorizedClientTrainer:
    """The loop's engine for its working copy (built on first use; raises what the model cannot do)."""
    worker = loop.client_worker
    hooks = getattr(worker, "hooks", None)
    if hooks is not None:
        raise VectorizationUnsupportedError(
            f"{worker.model_name} overrides the per-step hook(s) {', '.join(hooks.overridden)}, which "
            "client_execution='vectorized' cannot call per client; use client_execution='sequential' (or 'auto')"
        )
    engine: VectorizedClientTrainer | None = run.engine
    if engine is None or engine.model is not worker.model:
        # the precision plugin's conversion, before the transfer (Lightning's order)
        convert = getattr(worker, "convert_input", None)
        to_device = worker.to_device if convert is None else (lambda b: worker.to_device(convert(b)))
        engine = VectorizedClientTrainer(worker.model, to_device=to_device)
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
    prepared = [loop.prepare_client(plan, cid, worker.params) for cid in client_ids]
    optimizers = [opt for opt, _ in prepared]
    gbuffers = list(loop.model.buffers())
    # a throw-away round logs and replays the metric calls as a real round does (their time counts), then undoes them
    with _throwaway_logs(worker) if throwaway else nullcontext():
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
            float_buffer_mask=[b.is_floating_point() for b in gbuffers],
            stop=stop,
        )
    if updates is None:
        return None
    for update, opt in zip(updates, optimizers):
        if not isinstance(update, Exception):  # a client that raised leaves no client state, as sequentially
            loop.finish_client(update, opt, persist=not throwaway)
    return updates
