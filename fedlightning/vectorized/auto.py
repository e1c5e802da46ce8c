"""The loop's entry to vectorised client execution, and ``client_execution="auto"``.

:func:`run_vectorized_round` is what ``FederatedLoop.training_step`` calls for every round: the round's
``ClientUpdate`` list from the loop's engine (built once per working copy), or None for sequential training (mode
``"sequential"``; ``"auto"`` when it chose sequential or fell back). :func:`auto_choice` is the rule ``"auto"``
applies to its one-time measurement (:func:`_auto_decide`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fedlightning.state import ClientUpdate, RoundPlan

from .call import _info
from .engine import VectorizedClientTrainer
from .support import VectorizationUnsupportedError

#: Values of ``FederatedLoop(client_execution=...)``.
CLIENT_EXECUTION_MODES = ("sequential", "vectorized", "auto")


def run_vectorized_round(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> Optional[List[ClientUpdate]]:
    """The ClientUpdates of ``client_ids`` for ``plan``, trained in lockstep; None means "train them sequentially".

    Called by :meth:`FederatedLoop.training_step` when ``client_execution`` is ``"vectorized"`` or ``"auto"``. With
    ``"auto"``, the first round decides once for the run (:func:`_auto_decide`), and anything
    :class:`VectorizationUnsupportedError` reports makes the loop fall back to sequential training for the rest of
    the run, with a one-time warning. Per-client optimizer state is read from and written to ``loop.client_state``
    (namespace ``"optimizer"``) exactly as sequential training does.
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
        from lightning.pytorch.utilities import rank_zero_warn

        runtime.vectorized_fallback = True
        runtime.auto_choice = "sequential"
        rank_zero_warn(f"client_execution='auto': training clients sequentially ({err})")
        return None


#: The clock :func:`_auto_decide` times its throw-away rounds with (replaceable, for deterministic tests).
_clock = time.perf_counter

#: ``auto`` picks vectorized only when its round is at least this much faster than sequential (ours: timings of
#: one round on a shared machine vary by several percent, and sequential is the reference path).
AUTO_MARGIN = 1.1


def auto_choice(seconds_sequential: float, seconds_vectorized: float, margin: float = AUTO_MARGIN) -> str:
    """``"vectorized"`` if ``seconds_vectorized * margin < seconds_sequential``, else ``"sequential"``."""
    return "vectorized" if seconds_vectorized * margin < seconds_sequential else "sequential"


def _auto_decide(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> str:
    """``client_execution="auto"``: choose the mode of this run, once, at its first round; logged once.

    Decisions (ours):

    * **Models with random layers** (dropout) train sequentially: vectorised mode draws other (reproducible)
      dropout masks than sequential mode, so letting a timing choose would make the results depend on the machine.
      Set ``client_execution="vectorized"`` to accept that.
    * **Otherwise measure**: the round's clients are trained on throw-away copies both ways, from the round's global
      weights, on the same batches (one untimed vectorised round and one untimed sequential client first, to leave
      one-time costs out: the engine's probes, first calls), then one timed sequential round and one timed
      vectorised round. Throw-away means: no logged values reach the loop, no client state is written, the
      updates are dropped; random streams are forked in both modes; so the real round that follows computes
      exactly what it computes without the measurement (torchmetrics states are restored after each throw-away
      round; both rounds make the metric calls a real round makes, so their cost is timed). Vectorised is chosen
      when it is faster by :data:`AUTO_MARGIN` (:func:`auto_choice`). The measurement costs about one round of
      each mode, once.
    * A model or optimizer the engine cannot train raises :class:`VectorizationUnsupportedError` from the first
      throw-away round: the caller falls back to sequential with its warning, as before.
    """
    engine = _engine(loop)
    device = global_flat.device
    if not engine.deterministic:
        choice, reason = "sequential", (
            f"{type(engine.model).__name__} has random layers (dropout), for which vectorised mode draws other "
            "dropout masks than sequential mode; set client_execution='vectorized' to use it anyway")
    else:
        _run(loop, plan, client_ids, global_flat, throwaway=True)  # warm-up: probes, first calls
        with _throwaway_sequential(loop):
            loop.train_client(plan, client_ids[0], global_flat)  # warm-up
            _sync(device)
            t0 = _clock()
            for cid in client_ids:
                loop.train_client(plan, cid, global_flat)
            _sync(device)
            t1 = _clock()
        _run(loop, plan, client_ids, global_flat, throwaway=True)
        _sync(device)
        t2 = _clock()
        seq, vec = t1 - t0, t2 - t1
        choice = auto_choice(seq, vec)
        reason = (f"one round of {len(client_ids)} clients x {plan.local_steps} local steps took "
                  f"{seq * 1e3:.1f} ms sequential, {vec * 1e3:.1f} ms vectorized ({seq / max(vec, 1e-12):.2f}x; "
                  f"vectorized is chosen when faster by {AUTO_MARGIN}x)")
    loop._runtime.auto_choice, loop._runtime.auto_reason = choice, reason
    _info(f"client_execution='auto': training clients {choice} ({reason})")
    return choice


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
        engine = VectorizedClientTrainer(worker.model, to_device=worker.to_device)
        loop._runtime.vectorized_engine = engine
    return engine


def _run(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor,
         throwaway: bool = False) -> List[ClientUpdate]:
    """``FederatedLoop.train_client`` for all of ``client_ids`` at once (the loop's ``prepare_client`` and
    ``finish_client`` around the engine's round); ``throwaway``: nothing is logged, no client state written and
    torchmetrics states restored (``auto``'s measurement)."""
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
            local_steps=plan.local_steps,
            grad_clip=loop.client_grad_clip,
            terms=[terms for _, terms in prepared],
            router=None if throwaway else getattr(worker, "router", None),
            float_buffer_mask=[b.is_floating_point() for b in gbuffers],
        )
    finally:
        if saved_metrics is not None:
            metrics.restore(saved_metrics)
    for update, opt in zip(updates, optimizers):
        loop.finish_client(update, opt, persist=not throwaway)
    return updates
