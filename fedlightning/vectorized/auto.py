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

#: Local steps of every client that ``auto`` times in each mode (at most the round's ``K``; ours: enough steps to
#: average out one step's noise, few enough that the measurement costs a fraction of a round).
AUTO_MEASURE_STEPS = 5


def auto_choice(seconds_sequential: float, seconds_vectorized: float, margin: float = AUTO_MARGIN) -> str:
    """``"vectorized"`` if ``seconds_vectorized * margin < seconds_sequential``, else ``"sequential"``."""
    return "vectorized" if seconds_vectorized * margin < seconds_sequential else "sequential"


def _auto_decide(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> str:
    """``client_execution="auto"``: choose the mode of this run, once, at its first round; logged once.

    Decisions (ours; the measurements behind them: ``python benchmarks/auto_zoo.py``, docs/benchmarks.md §3):

    * **Models with random layers** (dropout) train sequentially: vectorised mode draws other (reproducible)
      dropout masks than sequential mode, so letting a timing choose would make the results depend on the machine.
      Set ``client_execution="vectorized"`` to accept that.
    * **Recurrent layers on a CPU** (``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``) train sequentially without measuring:
      their fused kernels have no vmap batching rule, the engine runs the gate equations one time step at a time
      (:func:`~fedlightning.vectorized.torch_internals._rnn_forward`), and that measured 0.26–0.61x sequential on
      2 CPU cores, so a measurement would only cost time. On an accelerator they are measured like any model.
    * **Otherwise measure**: the round's clients are trained on throw-away copies both ways, from the round's global
      weights, on the same batches: first one untimed local step of two clients vectorised and of one client
      sequentially (one-time costs: the engine's probes, first calls; few clients, as a large model's per-round
      weight layout costs in proportion to them), then :data:`AUTO_MEASURE_STEPS` local steps (at most the round's ``K``) timed
      sequentially and vectorised. Per-step costs do not depend on how many steps follow, so a few steps decide as
      well as a whole round at a fraction of its cost; per-round fixed costs (the engine's weight layout, which grows
      with the model) weigh more in 5 steps than in ``K``, which can only tip a close call towards sequential, the
      reference path. The vectorised timed round stops after the step at which its time so far already rules it
      out (sequential is then chosen without the remaining steps: a model for which vectorised is much slower
      costs fewer of its slow steps). Throw-away means: no logged values reach the loop, no client
      state is written, the updates are dropped; random streams are forked in both modes; so the real round that
      follows computes exactly what it computes without the measurement (torchmetrics states are restored after
      each throw-away round; both rounds make the metric calls a real round makes, so their cost is timed).
      Vectorised is chosen when it is faster by :data:`AUTO_MARGIN` (:func:`auto_choice`).
    * A model or optimizer the engine cannot train raises :class:`VectorizationUnsupportedError` from the first
      throw-away round: the caller falls back to sequential with its warning, as before.
    """
    engine = _engine(loop)
    device = global_flat.device
    rnns = [type(m).__name__ for m in engine.model.modules() if isinstance(m, torch.nn.RNNBase)]
    if not engine.deterministic:
        choice, reason = "sequential", (
            f"{type(engine.model).__name__} has random layers (dropout), for which vectorised mode draws other "
            "dropout masks than sequential mode; set client_execution='vectorized' to use it anyway")
    elif rnns and device.type == "cpu":
        choice, reason = "sequential", (
            f"{type(engine.model).__name__} has recurrent layers ({', '.join(sorted(set(rnns)))}), which vectorised "
            "mode runs one time step at a time, slower than sequential training on a CPU; set "
            "client_execution='vectorized' to use it anyway")
    else:
        warm = plan.with_steps(1)
        timed = plan.with_steps(min(plan.local_steps, AUTO_MEASURE_STEPS))
        _run(loop, warm, client_ids[:2], global_flat, throwaway=True)  # warm-up: probes, first calls
        with _throwaway_sequential(loop):
            _train_or_fail(loop, warm, client_ids[0], global_flat)  # warm-up
            _sync(device)
            t0 = _clock()
            for cid in client_ids:
                _train_or_fail(loop, timed, cid, global_flat)
            _sync(device)
            t1 = _clock()
        seq = t1 - t0
        steps = [0]

        def lost() -> bool:  # vectorized can no longer be chosen: the rest of its timed round is not needed
            steps[0] += 1
            _sync(device)
            return auto_choice(seq, _clock() - t1) == "sequential"

        finished = _run(loop, timed, client_ids, global_flat, throwaway=True, stop=lost) is not None
        _sync(device)
        vec = _clock() - t1
        choice = auto_choice(seq, vec)  # sequential after a stop: vec only grew since it had lost
        if finished:
            measured = f"{vec * 1e3:.1f} ms vectorized ({seq / max(vec, 1e-12):.2f}x; "
        else:
            measured = f"{steps[0]} took {vec * 1e3:.1f} ms vectorized, measurement stopped ("
        reason = (f"{timed.local_steps} local steps of {len(client_ids)} clients took {seq * 1e3:.1f} ms sequential, "
                  f"{measured}vectorized is chosen when faster by {AUTO_MARGIN}x)")
    loop._runtime.auto_choice, loop._runtime.auto_reason = choice, reason
    _info(f"client_execution='auto': training clients {choice} ({reason})")
    return choice


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
