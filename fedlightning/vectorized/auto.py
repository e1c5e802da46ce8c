"""The loop's entry to vectorised client execution, and ``client_execution="auto"``.

:func:`run_vectorized_round` is what ``FederatedLoop.training_step`` calls for every round: the round's
``ClientUpdate`` list from the loop's engine (built once per working copy), or None for sequential training (mode
``"sequential"``; ``"auto"`` when it chose sequential or fell back). :func:`auto_choice` is the rule ``"auto"``
applies to its one-time measurement (:func:`_auto_decide`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from fedlightning.state import ClientUpdate, RoundPlan

from .call import _info
from .engine import VectorizedClientTrainer
from .support import VectorizationUnsupportedError

#: Values of ``FederatedLoop(client_execution=...)``.
CLIENT_EXECUTION_MODES = ("sequential", "vectorized", "auto")


def run_vectorized_round(loop, plan: RoundPlan, client_ids: Sequence[int],
                         global_flat: Tensor) -> Optional[List[Union[ClientUpdate, Exception]]]:
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
    mode, runtime = loop.client_execution, loop._runtime
    if mode == "sequential" or not client_ids or runtime.vectorized_fallback:
        return None
    try:
        if mode == "auto" and runtime.auto_choice is None:
            if _auto_decide(loop, plan, client_ids, global_flat) == "sequential":
                runtime.vectorized_fallback = True
                return None
        return _run(loop, plan, client_ids, global_flat)
    except VectorizationUnsupportedError as err:
        if mode != "auto":
            raise
        reason = str(err)
    except torch.cuda.OutOfMemoryError as err:
        _free(loop)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if mode != "auto":
            raise torch.cuda.OutOfMemoryError(
                f"client_execution='vectorized': the round's {len(client_ids)} clients in lockstep did not fit in "
                f"accelerator memory ({first}); use client_execution='sequential' or 'auto', or fewer "
                "clients_per_round") from err
        reason = f"vectorized clients ran out of accelerator memory: {first}"
    from lightning.pytorch.utilities import rank_zero_warn

    runtime.vectorized_fallback = True
    runtime.auto_choice, runtime.auto_reason = "sequential", reason
    rank_zero_warn(f"client_execution='auto': training clients sequentially ({reason})")
    return None


def _free(loop) -> None:
    """Drop the vectorised engine's reusable buffers and the allocator's cached blocks after running out of memory."""
    engine = loop._runtime.vectorized_engine
    if engine is not None:
        engine.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: The clock :func:`_auto_decide` times its throw-away rounds with (replaceable, for deterministic tests).
_clock = time.perf_counter

#: ``auto`` picks vectorized only when its round is at least this much faster than sequential (ours: timings of
#: one round on a shared machine vary by several percent, and sequential is the reference path).
AUTO_MARGIN = 1.1

#: Most local steps per client that ``auto`` times in each mode (at most the round's ``K``; ours: enough steps to
#: average out one step's noise on a cheap model; on an expensive round :data:`AUTO_BUDGET_ROUNDS` may allow fewer).
AUTO_MEASURE_STEPS = 5

#: Clients ``auto`` times sequentially at least, the budget permitting (ours: a sequential client-step costs about the
#: same for every client, so a few clients of typical batch sizes stand for the round's; three average out one
#: client's size) ...
AUTO_SEQUENTIAL_CLIENTS = 3

#: ... and then more clients, up to all of the round's, until the timed ones have taken this many seconds (ours: a
#: cheap model's client takes 2-3 ms for 5 steps on a CPU, where a scheduler's interruption of a few milliseconds
#: would move an estimate from three clients by tens of percent; 50 ms of timing makes it a few percent).
AUTO_SEQUENTIAL_SECONDS = 0.05

#: What ``auto``'s whole measurement may cost, warm-ups included, in estimated sequential rounds of the run's first
#: round (ours: about one round; its floor is one local step of each mode, see :func:`_auto_decide`).
AUTO_BUDGET_ROUNDS = 1.0

#: ... but never less than this many seconds (ours: half a second once per run costs nobody anything, and on a
#: cheap round, where the warm-ups' one-time costs can exceed the round, it lets the measurement time its
#: sequential clients and ``min(K, AUTO_MEASURE_STEPS)`` vectorised steps instead of its one-step floor).
AUTO_MIN_BUDGET_SECONDS = 0.5


def auto_choice(seconds_sequential: float, seconds_vectorized: float, margin: float = AUTO_MARGIN) -> str:
    """``"vectorized"`` if ``seconds_vectorized * margin < seconds_sequential``, else ``"sequential"``."""
    return "vectorized" if seconds_vectorized * margin < seconds_sequential else "sequential"


def _auto_decide(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> str:
    """``client_execution="auto"``: choose the mode of this run, once, at its first round; logged once, in plain
    words (``training clients vectorized (3.10x faster than one at a time, measured on 5 local steps of 20
    clients, 3 of them one at a time)``); ``loop._runtime.auto_reason`` is the line's reason part.

    Decisions (ours; the measurements behind them: ``python benchmarks/auto_zoo.py``, docs/benchmarks.md §3):

    * **Models with dropout train one at a time (sequentially), unmeasured.** This is a reproducibility rule, not a
      speed rule: vectorised mode draws other (reproducible) dropout masks than sequential mode, so a choice made by
      a timing would make the results depend on the machine's speed. Set ``client_execution="vectorized"`` to
      accept that.
    * **Every other model is measured**, recurrent ones included, on any device: no fixed rule leaves a faster mode
      unused (a GRU text classifier trains faster vectorised on a CPU, an LSTM slower).
    * **What is timed.** On throw-away copies, from the round's global weights, on the round's batches: one untimed
      local step of two clients vectorised and of one client sequentially (one-time costs: the engine's probes,
      first calls); then sequentially :data:`AUTO_SEQUENTIAL_CLIENTS` clients, and more until the timed ones have
      taken :data:`AUTO_SEQUENTIAL_SECONDS`, in an order whose every prefix spans the round's batch sizes
      (:func:`_typical_clients`), ``m = min(K, AUTO_MEASURE_STEPS)`` local steps each, one client at a time; then
      vectorised all the round's ``C`` clients, up to ``m`` lockstep steps. A sequential client-step costs about
      the same for every client, so a few clients give its cost ``s``, and the sequential round is estimated as
      ``R = s × Σ_c K_c`` (each client's own step count, ``plan.steps_for``). A vectorised step's cost depends on
      how many clients share it, so it is timed on all ``C``; the vectorised round is estimated as
      ``K × (its time per lockstep step)`` (``K`` = the largest client's steps: ragged clients are masked, not
      skipped). Per-step costs do not depend on how many steps follow, so a few steps decide as well as a whole
      round; per-round fixed costs (the engine's weight layout, per-client set-up) weigh more in a few steps than
      in ``K``, in both modes.
    * **Bounded cost: about one sequential round** (:data:`AUTO_BUDGET_ROUNDS` × ``R``, warm-ups included, ``R``
      re-estimated after each timed client; at least :data:`AUTO_MIN_BUDGET_SECONDS`), also where a round is
      expensive (few clients, ``K`` of 1 or 2, a large model). One more client is timed sequentially only while
      the time spent, that client's ``m`` steps and one vectorised step costing what ``C`` sequential client-steps
      cost (the even case; room for the one step vectorised must have) fit in the budget; the vectorised round
      stops after a step when the next one would not fit, and after the step at which its time so far already
      rules it out even if its remaining steps took no time (a much slower vectorised mode costs few of its slow
      steps). At least one client is timed sequentially and one lockstep step vectorised, so the cost's floor is
      the warm-ups, one client's ``m`` steps and one vectorised step of the ``C`` clients: with ``K = 1`` that
      step is a whole vectorised round (about 1.4 rounds in all for 10 clients at even speeds; more where
      vectorised is much slower), which no measurement of a full-size vectorised step avoids.
    * **The choice**: vectorised when its estimated round is faster by :data:`AUTO_MARGIN` (:func:`auto_choice`).
    * **Throw-away**: no logged values reach the loop, no client state is written, the updates are dropped; random
      streams are forked in both modes, so the real round that follows computes exactly what it computes without
      the measurement (torchmetrics states are restored after each throw-away round; both modes make the metric
      calls a real round makes, so their cost is timed).
    * A model or optimizer the engine cannot train raises :class:`VectorizationUnsupportedError` from the first
      throw-away round (the vectorised warm-up, before any sequential time is spent): the caller falls back to
      sequential with its warning. What only a later step meets (a ``training_step`` that returns
      None at step 2, batches that stop stacking) is met by the timed vectorised round if it gets that far, else
      by a real round if vectorised is chosen (the same fallback and warning; that round is then trained
      sequentially), and not at all if the timing chooses sequential.
    """
    engine = _engine(loop)
    if not engine.deterministic:
        choice, reason = "sequential", (
            "the model has dropout, and vectorized training would draw different dropout masks, so results would "
            "depend on this machine's speed; set client_execution='vectorized' to use it anyway")
    else:
        choice, reason = _measure(loop, plan, client_ids, global_flat)
    loop._runtime.auto_choice, loop._runtime.auto_reason = choice, reason
    if choice == "vectorized":
        _info(f"client_execution='auto': training clients vectorized ({reason})")
    else:
        _info(f"client_execution='auto': training clients one at a time (sequential): {reason}")
    return choice


def _measure(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor):
    """``auto``'s timed throw-away rounds (:func:`_auto_decide` says what and why): ``(choice, reason)``."""
    device = global_flat.device
    C, K = len(client_ids), plan.local_steps
    client_steps = sum(plan.steps_for(c) for c in client_ids)
    m = min(K, AUTO_MEASURE_STEPS)
    warm, timed = plan.with_steps(1), plan.with_steps(m)
    _sync(device)
    t_start = _clock()
    _run(loop, warm, client_ids[:2], global_flat, throwaway=True)  # warm-up: probes, first calls
    with _throwaway_sequential(loop):
        _train_or_fail(loop, warm, client_ids[0], global_flat)  # warm-up
        _sync(device)
        t0 = t1 = _clock()
        n = 0
        for cid in _typical_clients(loop, client_ids):
            _train_or_fail(loop, timed, cid, global_flat)
            n += 1
            _sync(device)
            t1 = _clock()
            step = (t1 - t0) / (n * m)  # one client's local step, sequentially
            if t1 - t_start + (m + C) * step > _budget(step * client_steps):
                break  # one more client and one vectorised step at sequential speed would not fit in the budget
            if n >= AUTO_SEQUENTIAL_CLIENTS and t1 - t0 >= AUTO_SEQUENTIAL_SECONDS:
                break  # timed long enough
    seq = (t1 - t0) / (n * m) * client_steps  # the estimated sequential round
    budget = _budget(seq) - (t1 - t_start)  # what the vectorised round may still cost
    done, lost = [0], [False]

    def stop() -> bool:  # after each lockstep step but the last
        done[0] += 1
        _sync(device)
        spent = _clock() - t1
        lost[0] = auto_choice(seq, spent / m * K) == "sequential"  # even if its remaining steps took no time
        return lost[0] or spent * (done[0] + 1) / done[0] > budget

    finished = _run(loop, timed, client_ids, global_flat, throwaway=True, stop=stop) is not None
    _sync(device)
    steps = m if finished else done[0]
    vec = (_clock() - t1) / steps * K  # the estimated vectorised round
    choice = auto_choice(seq, vec)  # sequential after a loss: its estimate only grew since it had lost
    ratio = seq / max(vec, 1e-12)
    on = f"on {_count(steps, 'local step')} of {_count(C, 'client')}"
    if steps != m:
        on += f" vectorized and {_count(m, 'step')} of {_count(n, 'client')} one at a time"
    elif n < C:
        on += f", {n} of them one at a time"
    if choice == "vectorized":
        return choice, f"{ratio:.2f}x faster than one at a time, measured {on}"
    reason = f"vectorized measured {ratio:.2f}x as fast {on}"
    if lost[0] and not finished:
        reason += f"; its measurement stopped after {steps} of {m} steps, as it could no longer be faster"
    elif ratio >= 1:
        reason += f"; it is used only when at least {AUTO_MARGIN}x faster"
    return choice, reason


def _budget(sequential_round: float) -> float:
    """The measurement's budget in seconds, for a sequential round estimated at ``sequential_round`` seconds."""
    return max(AUTO_BUDGET_ROUNDS * sequential_round, AUTO_MIN_BUDGET_SECONDS)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _typical_clients(loop, client_ids: Sequence[int]) -> List[int]:
    """``client_ids`` in the order ``auto`` times them sequentially: every prefix spans the round's batch sizes.

    The clients are sorted by batch size (``min(samples, batch_size)``, what a sequential step's cost grows with)
    and taken at the fractions 1/2, 1/4, 3/4, 1/8, 5/8, 3/8, 7/8, ... of that order (van der Corput's sequence),
    each client once: the median client first, then the quartiles, and so on. Ours: the measurement stops after a
    prefix (its budget, its time), and a prefix spread over the sizes estimates the round's mean cost per
    client-step with less spread than the same number of clients in sampled order.
    """
    dm = loop._datamodule()
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
    worker = loop._worker_trainer()
    router = getattr(worker, "router", None)
    metrics = getattr(worker, "metrics", None)
    saved_metrics = metrics.save() if metrics else None
    captured = router.captured if router is not None else None
    logged = (dict(router.metrics), dict(router.metric_paths)) if router is not None else None
    persist = loop.persist_client_state
    loop.persist_client_state = False
    if router is not None:
        router.captured = {}
    try:
        yield
    finally:
        loop.persist_client_state = persist
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
        if router is not None:
            router.captured = captured
            router.metrics, router.metric_paths = logged


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(loop) -> VectorizedClientTrainer:
    """The loop's engine for its working copy (built on first use; raises what the model cannot do)."""
    worker = loop._worker_trainer()
    hooks = getattr(worker, "hooks", None)
    if hooks is not None:
        raise VectorizationUnsupportedError(
            f"{worker.model_name} overrides the per-step hook(s) {', '.join(hooks.overridden)}, which "
            "client_execution='vectorized' cannot call per client; use client_execution='sequential' (or 'auto')"
        )
    engine: Optional[VectorizedClientTrainer] = loop._runtime.vectorized_engine
    if engine is None or engine.model is not worker.model:
        convert = getattr(worker, "convert_input", None)  # the precision plugin's, before the transfer (Lightning's order)
        to_device = worker.to_device if convert is None else (lambda b: worker.to_device(convert(b)))
        engine = VectorizedClientTrainer(worker.model, to_device=to_device)
        loop._runtime.vectorized_engine = engine
    return engine


def _run(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor,
         throwaway: bool = False, stop=None) -> Optional[List[Union[ClientUpdate, Exception]]]:
    """``FederatedLoop.train_client`` for all of ``client_ids`` at once (the loop's ``prepare_client`` and
    ``finish_client`` around the engine's round); ``throwaway``: nothing is logged, no client state written and
    torchmetrics states restored (``auto``'s measurement); ``stop`` (throw-away rounds only): the engine's early
    stop, after which the round returns None."""
    if stop is not None and not throwaway:
        raise ValueError("only a throw-away round can stop early")
    worker = loop._worker_trainer()
    engine = _engine(loop)
    client_ids = [int(c) for c in client_ids]
    prepared = [loop.prepare_client(plan, cid, worker.params) for cid in client_ids]
    optimizers = [opt for opt, _ in prepared]
    gbuffers = list(loop.model.buffers())
    # a throw-away round replays the metric calls as a real round does (its time counts) and then restores them
    metrics = getattr(worker, "metrics", None)
    saved_metrics = metrics.save() if throwaway and metrics else None
    try:
        updates = engine.run(
            client_ids=client_ids,
            round=plan.round,
            seed=loop.seed,
            global_params=loop._global_params(),
            global_buffers=gbuffers,
            global_flat=global_flat,
            datamodule=loop._datamodule(),
            optimizers=optimizers,
            local_steps=[plan.steps_for(c) for c in client_ids],
            grad_clip=loop.client_grad_clip,
            terms=[terms for _, terms in prepared],
            router=None if throwaway else getattr(worker, "router", None),
            float_buffer_mask=[b.is_floating_point() for b in gbuffers],
            stop=stop,
        )
    finally:
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
    if updates is None:
        return None
    for update, opt in zip(updates, optimizers):
        if not isinstance(update, Exception):  # a client that raised leaves no client state, as sequentially
            loop.finish_client(update, opt, persist=not throwaway)
    return updates
