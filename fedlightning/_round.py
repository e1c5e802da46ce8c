"""The parts of a :class:`~fedlightning.loop.FederatedLoop` round after its plan, each taking its inputs as arguments.

``FederatedLoop.training_step`` is the round's template; its phases use these parts::

    plan   = loop._plan_round(plan)                 # the data module's sample; on_round_start; step counts checked
    tally  = loop._train_clients(plan)              # this process's clients: trained, on_client_end,
                                                    #   screen_update (aggregation checks), summed (RoundTally)
    stats  = loop._close_clients(plan, tally)       # reduce_statistics across processes; FailurePolicy's stops
    result = loop._step_server(plan, stats, tally)  # share_round_state; server_step (Δ -> server optimizer, checked)
    loop._end_round(result)                         # on_round_end; client metrics; log_round; client schedulers

:class:`RoundTally` admits each client's update into the round's sums (or leaves it out), :class:`FailurePolicy`
holds the failure settings and decides when the run stops, :func:`server_step` turns the reduced statistics into the
server optimizer's step and checks its result before it is committed, :func:`log_round` writes the round's metrics.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from fedlightning._lightning_compat import batches_that_stepped, publish_step_metrics, should_write_step_logs
from fedlightning.callbacks.base import RoundStatistics, ServerStrategy, accumulate_core, copy_of_state
from fedlightning.distributed import all_gather_objects, all_reduce_statistics
from fedlightning.state import (
    ClientUpdate,
    RoundPlan,
    averaged_buffer_slices,
    squared_norm64,
    sum_dtype,
    write_averaged_buffer,
)

__all__ = [
    "FailurePolicy",
    "HealthyClient",
    "RoundTally",
    "accumulate_telemetry",
    "align_metric_list_states",
    "client_log_means",
    "log_round",
    "reduce_statistics",
    "screen_update",
    "server_step",
    "share_round_state",
]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.cache
def _largest(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).max`` (cached: the aggregation checks ask for it for every client)."""
    return float(torch.finfo(dtype).max)


class _StrategyState:
    """A copy of the strategy's ``state_dict()``, taken before its ``server_update``, to put back when the round's
    server step fails (an exception, or a result :func:`_check_candidate` refuses). Decision (ours): a checkpoint
    written after the failure (``RoundCheckpoint`` on an exception) holds the round's starting weights and server
    optimizer state, and must hold the strategy's state of that moment too (an adaptive clipping norm, FedExP's
    previous iterate), or a run resumed from it differs from one that never failed. Strategies keep what they
    checkpoint in ``state_dict()``; one without it has nothing to put back."""

    def __init__(self, strategy: ServerStrategy) -> None:
        self.strategy = strategy
        self.state = copy_of_state(strategy)

    def restore(self) -> None:
        if self.state is not None:
            self.strategy.load_state_dict(self.state)


class _ServerState:
    """A copy of the global parameters and of the server optimizer's state and hyper-parameters, taken before the
    server step, to put back when the step's result is refused (:meth:`_RoundEnd._check_candidate`)."""

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params, self.optimizer = params, optimizer
        self.values = [p.detach().clone() for p in params]
        self.state = {
            p: {k: (v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)) for k, v in st.items()}
            for p, st in optimizer.state.items()
        }
        self.groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_([p.detach() for p in self.params], self.values)
        self.optimizer.state.clear()
        self.optimizer.state.update(self.state)
        for group, values in zip(self.optimizer.param_groups, self.groups):
            group.update(values)


def _client_weight(strategy: Any, plan: RoundPlan, update: ClientUpdate) -> Any:
    """``strategy.client_weight(update)``, refused when it is negative: the weights of a weighted mean are ``w_i ≥ 0``
    (:meth:`~fedlightning.callbacks.base.ServerStrategy.client_weight`), and a negative one turns the round's mean into
    an extrapolation whose size depends on how close ``Σ w_i`` comes to 0 (a loss-based weight ``f_i − c``, say).
    A non-finite weight is left to :func:`screen_update` (the client is left out with a warning)."""
    weight = strategy.client_weight(update)
    if weight < 0:
        raise ValueError(
            f"round {plan.round}: {type(strategy).__name__}.client_weight gave client {update.client_id} the weight "
            f"{float(weight):g}; a client's aggregation weight must be >= 0 (0 leaves its update out of the mean)"
        )
    return weight


@torch.no_grad()
def screen_update(
    update: ClientUpdate, weight: float, num_sampled: int, max_update_norm: float | None
) -> Tensor | None:
    """The aggregation checks of one healthy client (the rule: :class:`~fedlightning.loop.FederatedLoop`'s
    ``max_update_norm``): ``‖Δ_i‖²`` (float64, the value the round's sums add) when the client passes; else
    ``update`` is marked failed with the reason and its update norm, and None is returned."""
    sq_norm = squared_norm64(update.delta)
    figures = [sq_norm] if update.buffers is None else [sq_norm, squared_norm64(update.buffers)]
    values = torch.stack(figures).tolist() if len(figures) > 1 else [float(sq_norm.item())]  # one host read
    reason = _screen_reason(update, values, weight, num_sampled, max_update_norm)
    if reason is None:
        return sq_norm
    update.failed, update.failure = True, reason
    return None


def _screen_reason(
    update: ClientUpdate, values: list[float], weight: float, num_sampled: int, max_update_norm: float | None
) -> str | None:
    """Why :func:`screen_update` leaves ``update`` out (None: it passes), from ``values``: ``[‖Δ_i‖²]``, or
    ``[‖Δ_i‖², ‖b_i‖²]`` for a client with float buffers."""
    norm, w, n = math.sqrt(values[0]), abs(weight), 2 * num_sampled
    f64 = _largest(torch.float64)
    summed = sum_dtype(update.delta.dtype)  # the dtype of the round's Σ w_i Δ_i (accumulate_core)
    limit = _largest(summed) / n
    reason = None
    if not math.isfinite(weight):
        reason = f"non-finite aggregation weight {weight!r}"
    elif not math.isfinite(values[0]) and not bool(torch.isfinite(update.delta).all()):
        # the training's own check (client.py) came before on_client_end, which may have changed the update
        reason = "non-finite model update"
    elif max_update_norm is not None and norm > max_update_norm:
        reason = f"update norm {norm:.4g} > max_update_norm={max_update_norm:g}"
    elif w * norm >= limit:
        reason = (
            f"update norm {norm:.4g}: its weighted update (weight {weight:g}) could overflow the "
            f"{_dtype_name(summed)} sum of the round's {num_sampled} clients (limit "
            f"|w|·‖Δ‖ < {limit:.4g})"
        )
    elif values[0] * max(w, 1.0) >= f64 / n:
        reason = f"update norm {norm:.4g}: its squared norm could overflow the float64 sums of the round"
    elif len(values) > 1:
        buffer_norm = math.sqrt(values[1])
        buffer_limit = _largest(update.buffers.dtype) / n
        if not math.isfinite(buffer_norm):
            reason = f"update norm {norm:.4g}: non-finite float buffers (e.g. BatchNorm running statistics)"
        elif w * buffer_norm >= buffer_limit:
            reason = (
                f"update norm {norm:.4g}, float buffers norm {buffer_norm:.4g}: its weighted buffers "
                f"could overflow the {_dtype_name(update.buffers.dtype)} sum of the round's {num_sampled} "
                "clients"
            )
    return reason


def accumulate_telemetry(stats: RoundStatistics, u: ClientUpdate, device) -> None:
    """Add one healthy client's telemetry (losses, step sizes, passes, steps) to the round's statistics."""
    # a healthy client without a loss (every local step skipped: training_step returned None) adds no loss
    has_loss = math.isfinite(u.mean_loss)
    stats.add("loss_sum", u.mean_loss if has_loss else 0.0, device)
    stats.add("first_loss_sum", u.first_loss if has_loss else 0.0, device)
    stats.add("loss_clients", 1.0 if has_loss else 0.0, device)
    steps = max(u.num_steps, 1)
    stats.add("backtracks_per_step_sum", u.backtracks / steps, device)
    stats.add("forwards", float(u.forwards), device)
    stats.add("backwards", float(u.backwards), device)
    stats.add("local_steps_sum", float(u.num_steps), device)
    finite = [s for s in u.step_sizes if math.isfinite(s)]
    if finite:
        stats.add("step_size_sum", float(sum(finite)), device)
        stats.add("step_size_count", float(len(finite)), device)
        stats.maximum("step_size_max", max(finite), device)
        stats.maximum("neg_step_size_min", -min(finite), device)


#: The most bytes of float64 squares :meth:`RoundTally.admit_all` computes at once, the size of its kept buffer
#: (ours: small models' groups are taken whole, where per-client operations cost more than their arithmetic; a
#: model of over 500k parameters is admitted client by client, where they do not).
ADMIT_CHUNK_BYTES = 8 << 20

#: The update dtypes :meth:`RoundTally.admit_all` weights together (``Δ·w`` with ``w`` rounded to the dtype is then
#: ``Δ·w`` with a Python float ``w``; half precision computes the product in float32 instead).
_BATCHED_DTYPES = (torch.float32, torch.float64)


class HealthyClient(NamedTuple):
    """What a round keeps of a healthy client once its update is in the round's sums."""

    client_id: int
    first_loss: float
    mean_loss: float


class RoundTally:
    """This process's share of a round, client by client: each update admitted into the round's sums or left out.

    ``admit`` applies, in order, the aggregation checks (:func:`screen_update`), the strategy's extra statistics
    (checked with :meth:`~fedlightning.callbacks.RoundStatistics.unsafe_entry`) and the failure policy; ``raised``
    records a client whose training raised (``on_client_error``). ``close`` adds the counts the failure policy reads
    after the reduction. ``stop`` is ``(client, exception or failure)`` when the policy stops the run after the
    reduction (every process reaches it first)."""

    def __init__(
        self,
        strategy: ServerStrategy,
        num_sampled: int,
        device: torch.device,
        policy: FailurePolicy,
        max_update_norm: float | None,
        scratch: dict | None = None,
    ) -> None:
        """``scratch``: a dict the caller keeps across rounds, where :meth:`admit_all` keeps its float64 buffer (a
        buffer allocated afresh every round costs more in page faults than the work done in it); None: a fresh
        one per tally."""
        self.scratch = {} if scratch is None else scratch
        self.strategy, self.num_sampled, self.device = strategy, num_sampled, device
        self.policy, self.max_update_norm = policy, max_update_norm
        self.stats = RoundStatistics()
        #: the healthy clients' scalars ``(client_id, first_loss, mean_loss)``, not their updates: a client's delta
        #: is freed once it is in the round's sums, so a round holds one model-sized vector per client in flight
        #: (a group of vectorised clients), not one per client of the round
        self.healthy: list[HealthyClient] = []
        self.failed = 0
        self.first_error: tuple | None = None  # (client, exception) of the first client that raised, under "skip"
        self.first_failure: tuple[int, str] | None = None  # (client, reason) of the first client left out
        self.stop: tuple | None = None
        self._raised: set = set()
        self._has_extras = type(strategy).accumulate is not ServerStrategy.accumulate  # else nothing to check or merge

    def raised(self, client_id: int, err: Exception) -> ClientUpdate | None:
        """A client whose training raised ``err``: None when the policy stops the run (``on_client_error="raise"``),
        else its failed update (left out of the round, counted)."""
        if self.policy.on_client_error == "raise":
            self.stop = (client_id, err)
            return None
        self._raised.add(client_id)
        self.stats.add("raised", 1.0, self.device)
        if self.first_error is None:
            self.first_error = (client_id, err)
        return ClientUpdate(client_id=client_id, delta=None, num_samples=0, failed=True, failure=repr(err))

    def admit(self, plan: RoundPlan, update: ClientUpdate) -> bool:
        """Screen ``update`` and add it to the round's sums, or leave it out with a warning; False when the policy
        stops the run (``on_client_failure="raise"``): no further client of this process is trained."""
        strategy = self.strategy
        if not update.failed:
            weight = _client_weight(strategy, plan, update)
            sq_norm = screen_update(update, weight, self.num_sampled, self.max_update_norm)
        extras = self._extras(update)
        if update.failed:
            return self._leave_out(plan, update)
        with torch.no_grad():
            accumulate_core(strategy, self.stats, update, weight=weight, sq_norm=sq_norm)
        self._add_client(update, extras)
        return True

    def admit_all(self, plan: RoundPlan, updates: list[ClientUpdate]) -> bool:
        """:meth:`admit` for each of ``updates`` in order, stopping where it stops (False): the same checks and the
        same sums, bit for bit, with the tensor work of a group's healthy clients done together.

        For a vectorised group (updates of one dtype, float32 or float64, without float buffers) the squared norms
        ``‖Δ_i‖²`` of the aggregation checks and the weighted updates ``w_i Δ_i`` of the core sums
        (:func:`~fedlightning.callbacks.base.accumulate_core`) are computed for all of them at once, in chunks of at
        most :data:`ADMIT_CHUNK_BYTES` of float64 squares (kept in ``scratch`` across rounds): entry by entry the
        same operations (each ``‖Δ_i‖²`` the one-dimensional float64 sum of its own row, each weighted row added to
        the round's sum in the clients' order, the scalar sums added in float64 as Python floats) and one host read
        per chunk, so a group costs a few tensor operations and one addition per client instead of about ten
        operations and a host read per client. Updates it cannot take together (failed already, with buffers, other
        dtypes, a model too large for two rows in a chunk) go through :meth:`admit`."""
        i = 0
        while i < len(updates):
            chunk = self._chunk(updates, i)
            if len(chunk) < 2:
                if not self.admit(plan, updates[i]):
                    return False
                i += 1
                continue
            if not self._admit_chunk(plan, chunk):
                return False
            i += len(chunk)
        return True

    def _chunk(self, updates: list[ClientUpdate], start: int) -> list[ClientUpdate]:
        """The longest run of updates from ``start`` that :meth:`_admit_chunk` takes together."""
        first = updates[start]
        delta = first.delta
        if first.failed or delta is None or first.buffers is not None or delta.dtype not in _BATCHED_DTYPES:
            return [first]
        rows = max(1, ADMIT_CHUNK_BYTES // max(8 * delta.numel(), 1))
        chunk = [first]
        for u in updates[start + 1 : start + rows]:
            d = u.delta
            if u.failed or d is None or u.buffers is not None or d.dtype != delta.dtype or d.shape != delta.shape:
                break
            if d.device != delta.device:
                break
            chunk.append(u)
        return chunk

    @torch.no_grad()
    def _admit_chunk(self, plan: RoundPlan, chunk: list[ClientUpdate]) -> bool:
        """:meth:`admit` for ``chunk`` (healthy updates of one dtype, shape and device, without buffers)."""
        strategy, stats = self.strategy, self.stats
        weights = [_client_weight(strategy, plan, u) for u in chunk]
        deltas = torch.stack([u.delta for u in chunk])
        # squared norms as screen_update computes them: each row's own 1-d float64 sum (a [C] row reduction may
        # split a row's sum differently across threads), of its squares converted in the kept buffer
        squares = self._buffer(deltas.shape, deltas.device).copy_(deltas).pow_(2)
        sq_values = torch.stack([row.sum() for row in squares]).tolist()  # one host read
        scale = torch.tensor(weights, dtype=deltas.dtype, device=deltas.device)  # float32: Δ·w rounds w so too
        weighted = deltas.mul_(scale.unsqueeze(1))  # deltas is this method's own copy
        device = chunk[0].delta.device
        for j, update in enumerate(chunk):
            weight, sq = weights[j], sq_values[j]
            reason = _screen_reason(update, [sq], weight, self.num_sampled, self.max_update_norm)
            if reason is not None:
                update.failed, update.failure = True, reason
            extras = self._extras(update)
            if update.failed:
                if not self._leave_out(plan, update):
                    return False
                continue
            # accumulate_core's sums for this client (its delta · weight being row j of weighted)
            stats.add("delta", weighted[j])
            stats.add("weight", weight, device)
            stats.add("clients", 1.0, device)
            stats.add("sq_norm_sum", sq, device)
            stats.add("weighted_sq_norm_sum", sq * weight, device)
            self._add_client(update, extras)
        return True

    def _buffer(self, shape: torch.Size, device: torch.device) -> Tensor:
        """A float64 tensor of ``shape`` from the kept buffer (grown when needed)."""
        numel = shape[0] * shape[1]
        buf = self.scratch.get("squares")
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self.scratch["squares"] = torch.empty(numel, dtype=torch.float64, device=device)
        return buf[:numel].view(shape)

    def _extras(self, update: ClientUpdate) -> RoundStatistics | None:
        """The strategy's extra statistics of a healthy update (None without any); an unsafe one marks it failed."""
        if update.failed or not self._has_extras:
            return None
        delta, version = update.delta, update.delta._version
        with torch.no_grad():
            extras = RoundStatistics()
            self.strategy.accumulate(extras, update)
        if update.delta is not delta or delta._version != version:
            name = type(self.strategy).__name__
            raise RuntimeError(
                f"{name}.accumulate changed client {update.client_id}'s update.delta; accumulate adds the strategy's "
                f"own statistics only (the loop has screened the delta and sums it itself). To change a client's "
                "update (clipping, compression), assign update.delta in on_client_end, which runs before the update "
                "is screened and aggregated"
            )
        unsafe = extras.unsafe_entry(self.num_sampled)
        if unsafe is not None:
            update.failed, update.failure = True, f"{type(self.strategy).__name__} statistic {unsafe}"
        return extras

    def _leave_out(self, plan: RoundPlan, update: ClientUpdate) -> bool:
        """A failed update, left out of the round with a warning; False when the policy stops the run."""
        if self.policy.on_client_failure == "raise" and update.client_id not in self._raised:
            self.stop = (update.client_id, update.failure)
            return False
        self.failed += 1
        # every process names its own clients (rank_zero_warn would drop the other processes' ones)
        reason = update.failure or "marked failed, no reason given"
        if self.first_failure is None:
            self.first_failure = (update.client_id, reason)
        warnings.warn(f"round {plan.round}: client {update.client_id} skipped ({reason})", UserWarning, stacklevel=4)
        return True

    def _add_client(self, update: ClientUpdate, extras: RoundStatistics | None) -> None:
        """After a healthy update's core sums: the strategy's extras, the telemetry and its scalars."""
        if extras is not None:
            self.stats.merge(extras)
        accumulate_telemetry(self.stats, update, self.device)
        self.healthy.append(HealthyClient(update.client_id, update.first_loss, update.mean_loss))

    def close(self) -> RoundStatistics:
        """The round's statistics on this process, with the counts ``failed``, ``raised`` and ``stopped``."""
        self.stats.add("failed", float(self.failed), self.device)
        self.stats.add("raised", 0.0, self.device)
        self.stats.add("stopped", 1.0 if self.stop is not None else 0.0, self.device)
        return self.stats


class FailurePolicy:
    """The failure settings of a :class:`~fedlightning.loop.FederatedLoop` (``on_client_failure``,
    ``on_client_error``, ``max_failed_rounds``; their rules are documented there) and the count of consecutive rounds
    without a healthy client (checkpointed by the loop); decides when the run stops."""

    def __init__(self, on_client_failure: str, on_client_error: str, max_failed_rounds: int | None) -> None:
        self.on_client_failure = on_client_failure
        self.on_client_error = on_client_error
        self.max_failed_rounds = max_failed_rounds
        self.rounds_without_healthy_client = 0
        #: ``(round, client, reason)``: this process's first client left out in the latest round without a healthy
        #: client (named by the stops; not checkpointed: a resumed run names the rounds it trained itself)
        self.last_failure: tuple[int, int, str] | None = None

    def stop_run(self, plan: RoundPlan, stats: RoundStatistics, stop: tuple | None, trainer: Any) -> None:
        """Stop the run when a client of this round raised under ``on_client_error="raise"`` or failed under
        ``on_client_failure="raise"`` (``stop``: ``(client, exception or failure text)`` on this process). Every
        process decides from the reduced count; with several processes the stop of the client first in sampling
        order is raised on all of them."""
        if not float(stats["stopped"].item()):
            return
        pos = {cid: i for i, cid in enumerate(plan.client_ids)}

        def describe(s):
            if s is None:
                return None
            cid, what = s
            if isinstance(what, BaseException):
                return (pos.get(cid, -1), cid, f"{type(what).__name__}: {what}", True)
            return (pos.get(cid, -1), cid, str(what), False)

        mine = describe(stop)
        everything = [mine]
        if _distributed(trainer):
            everything = all_gather_objects(mine, round=plan.round, what="the client that stops the run")
        _, cid, what, raised = min(d for d in everything if d is not None)
        cause = stop[1] if stop is not None and stop[0] == cid and isinstance(stop[1], BaseException) else None
        if raised:
            raise RuntimeError(
                f"round {plan.round}: client {cid} raised {what}. An exception in client training is a bug in the "
                "model, the data or a callback's hook, not a faulty client, so the run stops (on_client_error='skip' "
                "would leave such clients out of their round)"
            ) from cause
        raise FloatingPointError(f"client {cid} failed in round {plan.round}: {what}")

    def check_round(
        self,
        plan: RoundPlan,
        stats: RoundStatistics,
        first_error: tuple | None,
        model_name: str,
        first_failure: tuple[int, str] | None = None,
    ) -> None:
        """The failure policy's stops (the ``"skip"`` policies; identical on every process, from the reduced
        counts): every client raised → the round's first exception, chained; ``max_failed_rounds`` consecutive
        rounds without a healthy client → ``FloatingPointError``.

        **A round in which no local step returned a loss** stops the run too (ours): ``None`` from ``training_step``
        skips that step, as in Lightning, but when every step of every healthy client of a round was skipped the module
        almost certainly forgot to return its loss, and the run would otherwise train nothing without a word. A
        round in which some step of some client returned a loss goes on as usual, and so does a round whose clients
        ran no step (``on_train_batch_start`` returned -1 at their first one: each a healthy update 0)."""
        n_healthy = float(stats["clients"].item()) if "clients" in stats else 0.0
        if n_healthy > 0:
            no_loss = "loss_clients" in stats and float(stats["loss_clients"].item()) == 0
            # (steps ran: clients whose on_train_batch_start returned -1 at their first step ran none, no mistake)
            if no_loss and float(stats["local_steps_sum"].item()) > 0:
                name = model_name
                raise RuntimeError(
                    f"round {plan.round}: {name}.training_step returned None for every local step of every client "
                    f"(None skips a step, as in Lightning), so nothing was trained: {name}.training_step must return "
                    "the loss (a tensor, or a dict with the key 'loss')"
                )
            self.rounds_without_healthy_client = 0
            return
        raised = int(stats["raised"].item())
        if raised and raised == len(plan.client_ids):
            if first_error is not None:
                what = f"client {first_error[0]}: {type(first_error[1]).__name__}: {first_error[1]}"
            else:
                what = "the exceptions were raised on another process"
            message = (
                f"round {plan.round}: every client raised an exception ({what}); this is a bug in the model or the "
                "data, not a faulty client, so the run stops"
            )
            raise RuntimeError(message) from (first_error[1] if first_error is not None else None)
        self.rounds_without_healthy_client += 1
        if first_failure is not None:
            self.last_failure = (plan.round, *first_failure)
        elif first_error is not None:
            self.last_failure = (plan.round, first_error[0], f"raised {type(first_error[1]).__name__}")
        limit = self.max_failed_rounds
        if limit is not None and self.rounds_without_healthy_client >= limit:
            raise FloatingPointError(
                f"round {plan.round}: {self.rounds_without_healthy_client} consecutive rounds without a healthy client "
                f"(max_failed_rounds={limit}): every client was left out of its round{self._example()}. "
                f"{_REMEDIES} or raise max_failed_rounds"
            )

    def _example(self) -> str:
        """``"; e.g. client c in round r: <reason>"``, from :attr:`last_failure` (empty without one)."""
        if self.last_failure is None:
            return ""
        round_, client, reason = self.last_failure
        return f"; e.g. client {client} in round {round_}: {reason}"

    def check_run(self, rounds: int) -> None:
        """At the end of training: a run in which no round had a healthy client (the global model never changed)
        stops with a ``FloatingPointError``, unless ``max_failed_rounds`` is None. Resumed runs count their rounds
        before the checkpoint: ``rounds_without_healthy_client`` is checkpointed and consecutive, so it equals the
        number of rounds trained exactly when none had a healthy client."""
        if self.max_failed_rounds is None or rounds == 0 or self.rounds_without_healthy_client < rounds:
            return
        raise FloatingPointError(
            f"no round of this run had a healthy client ({rounds} round{'s' if rounds != 1 else ''}: every client was "
            f"left out of its round{self._example()}), so the global model was never updated. {_REMEDIES}"
        )


#: What the stops for rounds without a healthy client suggest; which applies shows in the reason they name (each
#: client's reason is also in its round's warning)
_REMEDIES = (
    "For NaN/inf losses or updates: lower the client learning rate or clip client gradients (client_grad_clip, for "
    "client optimizers other than the line searches and SPS); for 'max_update_norm': raise it; for updates that "
    "could overflow: lower the learning rate"
)


def _distributed(trainer: Any) -> bool:
    """Whether the round's clients are spread over several processes of an initialised process group."""
    return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


def reduce_statistics(stats: RoundStatistics, trainer: Any, round: int) -> None:
    """Combine the round's statistics of all processes (no-op on one process)."""
    if _distributed(trainer):
        all_reduce_statistics(stats, round=round)


def client_log_means(router: Any, trainer: Any, round: int) -> dict[str, float]:
    """``client/<name>``: the values the round's clients logged in ``training_step``, reduced with the call's
    ``reduce_fx`` (the mean by default; :func:`~fedlightning._logging_route.round_log_options`) over the clients of
    every process: with several processes each sends its sums (or maximum, minimum) and counts, so the value is the
    one a single process computes, up to the order of the float64 sums (one process: the router's own). A value
    logged in the working copy's ``on_train_epoch_start`` / ``_end`` (once per round on each process, over its own
    clients) is one value per process, and the reduction is over the processes."""
    if not _distributed(trainer):
        return router.pop_means()
    total: dict[str, tuple[str, float, int]] = {}
    for part in all_gather_objects(router.pop_sums(), round=round, what="values logged in training_step"):
        for name, (reduce, value, n) in part.items():
            if name not in total:
                total[name] = (reduce, value, n)
                continue
            _, a, b = total[name]
            combined = max(a, value) if reduce == "max" else min(a, value) if reduce == "min" else a + value
            total[name] = (reduce, combined, b + n)
    return {f"client/{name}": v / n if r == "mean" else v for name, (r, v, n) in sorted(total.items()) if n}


def share_round_state(
    plan: RoundPlan,
    healthy: list[HealthyClient],
    trainer: Any,
    client_state: Any,
    router: Any,
    sigterm: bool = False,
    client_lr: tuple | None = None,
) -> tuple[list[tuple], bool, tuple | None]:
    """Per-client scalars of the round's healthy clients, from every process, in sampling order; and, with
    several processes, the client-state entries written this round are exchanged so every process holds the
    whole ClientStateStore. Second: whether any process received SIGTERM (``sigterm``: this one's mark), the same
    answer on every process. Third: ``(round, lr)`` of the last client optimizer built (``client_lr``: this
    process's), the first process's that built one this round, so that a process that trained no client of the
    round (fewer clients than processes) logs ``client/lr`` too, with the same value (a callback monitoring it runs
    the same collectives on every process)."""
    pos = {cid: i for i, cid in enumerate(plan.client_ids)}
    mine = [(pos.get(u.client_id, -1), u.client_id, u.first_loss, u.mean_loss) for u in healthy]
    if not _distributed(trainer):
        client_state.pop_dirty()
        return mine, sigterm, client_lr
    dirty = client_state.pop_dirty()
    dirty_cpu = {
        k: {n: (v.detach().cpu() if isinstance(v, Tensor) else v) for n, v in d.items()} for k, d in dirty.items()
    }
    everything = all_gather_objects(
        (mine, dirty_cpu, dict(router.metric_paths), bool(sigterm), client_lr),
        round=plan.round,
        what="client summaries and client state of the round",
    )
    summaries: list[tuple] = []
    for rank, (theirs, entries, metric_paths, _, _) in enumerate(everything):
        summaries.extend(theirs)
        if rank != trainer.global_rank:
            client_state.update_from(entries)
            router.adopt_metrics(metric_paths)  # every process computes (a collective) the same metrics
    lrs = [lr for *_, lr in everything if lr is not None and lr[0] == plan.round]
    return sorted(summaries), any(stop for *_, stop, _ in everything), lrs[0] if lrs else None


def align_metric_list_states(router: Any, trainer: Any, round: int) -> None:
    """With several processes, before the torchmetrics metrics logged in training_step are computed (a sync over
    the processes): the list states one process holds empty get the dtype and shape the others' hold
    (:meth:`~fedlightning._hooks._LogRouter.fill_empty_list_states`), in one exchange; nothing for metrics without
    list states or on one process."""
    if not _distributed(trainer):
        return
    mine = router.list_state_layouts()
    if mine is None:
        return
    layouts = all_gather_objects(mine, round=round, what="the dtypes and shapes of the metrics' list states")
    router.fill_empty_list_states(layouts)


@torch.no_grad()
def server_step(
    pl_module: Any,
    strategy: ServerStrategy,
    optimizer: Any,
    params: list[Tensor],
    stats: RoundStatistics,
    plan: RoundPlan,
    client_lr: tuple | None,
) -> tuple[dict[str, float], Tensor | None]:
    """The server step of the round: ``Δ, η = strategy.server_update(pl_module, stats, plan)``; ``Δ`` written into
    the global ``params``' ``.grad`` and ``optimizer`` (the loop's ``LightningOptimizer``, so Lightning counts the
    round) stepped with ``η``; the result checked before it is committed (:func:`_check_candidate`); the float
    buffers set to the weighted mean of the clients'. Returns the round's metrics and ``Δ`` (None without a healthy
    client). ``client_lr``: ``(round, lr)`` of the last client optimizer built."""
    opt = optimizer
    n_clients = float(stats["clients"].item()) if "clients" in stats else 0.0
    metrics: dict[str, float] = {"round/clients": n_clients, "round/failed_clients": float(stats["failed"].item())}
    # the planned local steps of the round's clients (their mean with per-client counts, local_epochs)
    metrics["round/local_steps"] = plan.mean_local_steps()
    # client/lr: the learning rate the round's clients trained with (their optimizer's first parameter group,
    # after the client scheduler's steps and the round's client_lr_scale); absent for optimizers without "lr"
    if client_lr is not None and client_lr[0] == plan.round and client_lr[1] is not None:
        metrics["client/lr"] = client_lr[1]
    if n_clients == 0:
        rank_zero_warn(f"round {plan.round}: no healthy client; the global model is left unchanged")
        for p in params:
            p.grad = None  # optimizers skip parameters without a gradient: no state change
        opt.step()
        return metrics, None
    if float(stats["weight"].item()) == 0.0:
        raise ValueError(
            f"round {plan.round}: {type(strategy).__name__}.client_weight gave each of the round's {int(n_clients)} "
            "healthy client(s) weight 0, so their weighted mean is not defined; give some client a positive weight"
        )
    strategy_state = _StrategyState(strategy)
    try:
        pseudo_grad, lr, extra = _step_and_check(pl_module, strategy, opt, params, stats, plan)
    except BaseException:  # the round is not counted: the strategy's state is put back with the model's
        strategy_state.restore()
        raise
    for p in params:
        p.grad = None
    if "buffers" in stats:
        avg = stats["buffers"] / stats["weight"].to(stats["buffers"].dtype)
        buffers = list(pl_module.model.buffers())
        for i, part in averaged_buffer_slices(buffers):
            write_averaged_buffer(buffers[i], avg[part])
    metrics.update(extra)
    n_loss = float(stats["loss_clients"].item())  # the clients with a loss (n_clients unless steps were skipped)
    if n_loss > 0:
        metrics["train/loss"] = float(stats["loss_sum"].item()) / n_loss
        metrics["train/first_loss"] = float(stats["first_loss_sum"].item()) / n_loss
    metrics["server/lr"] = float(lr if lr is not None else opt.optimizer.param_groups[0].get("lr", float("nan")))
    # η_g of every strategy under one name: strategies that compute it (FedExP, FedExProx, FedLi) report it and
    # its unclipped value; for the others it is the server optimizer's learning rate, which nothing clips.
    metrics.setdefault("server/eta_g", metrics["server/lr"])
    metrics.setdefault("server/eta_g_raw", metrics["server/eta_g"])
    metrics["server/delta_norm"] = float(pseudo_grad.double().norm().item())
    metrics["server/mean_client_delta_sq_norm"] = float(stats["sq_norm_sum"].item()) / n_clients
    metrics["client/backtracks_per_step"] = float(stats["backtracks_per_step_sum"].item()) / n_clients
    metrics["client/forwards"] = float(stats["forwards"].item())
    metrics["client/backwards"] = float(stats["backwards"].item())
    if "step_size_sum" in stats:
        metrics["client/step_size_mean"] = float(stats["step_size_sum"].item() / stats["step_size_count"].item())
        metrics["client/step_size_max"] = float(stats["step_size_max"].item())
        metrics["client/step_size_min"] = -float(stats["neg_step_size_min"].item())
    return metrics, pseudo_grad


def _step_and_check(
    pl_module: Any, strategy: ServerStrategy, opt: Any, params: list[Tensor], stats: RoundStatistics, plan: RoundPlan
) -> tuple[Tensor, float | None, dict[str, float]]:
    """:func:`server_step`'s step: ``strategy.server_update``, the optimizer step with its ``η`` and the check of the
    result (:func:`_check_candidate`, which puts the parameters and the optimizer state back when it refuses it);
    returns ``(Δ, η, extra metrics)``."""
    pseudo_grad, lr, extra = _server_update(strategy, pl_module, stats, plan, params)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = pseudo_grad[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n
    server_opt = opt.optimizer
    saved = _ServerState(params, server_opt)
    own_lrs = [g.get("lr") for g in server_opt.param_groups]
    if lr is not None:  # this round's only: the optimizer's own learning rates are put back after the step
        for g in server_opt.param_groups:
            g["lr"] = lr

    checked = []

    def check(*_):  # after the step, before Lightning counts it (a post hook runs inside optimizer.step)
        checked.append(True)
        _check_candidate(pl_module.model, strategy, plan, params, server_opt, saved, pseudo_grad, lr, extra)

    handle = server_opt.register_step_post_hook(check)
    try:
        opt.step()
    except Exception as err:
        if not checked:  # an optimizer that raised half-way (e.g. an lr beyond float32) changes nothing either
            saved.restore()
            for p in params:
                p.grad = None
        if not checked and isinstance(err, RuntimeError) and "without overflow" in str(err):
            step_lr = lr if lr is not None else own_lrs[0]
            raise FloatingPointError(
                f"round {plan.round}: the server step of {type(strategy).__name__} overflows the global model's "
                f"{_dtype_name(params[0].dtype)} (server/lr = {step_lr!r}: {str(err).splitlines()[0]}). The global "
                "model and the server optimizer state are left as they were before this round and the run stops; "
                "lower the server learning rate or train in a wider precision"
            ) from err
        raise
    finally:
        handle.remove()
        if lr is not None:
            for g, own in zip(server_opt.param_groups, own_lrs):
                g["lr"] = own
    if not checked:  # a step that does not run torch's step hooks: checked now, after Lightning counted it
        _check_candidate(pl_module.model, strategy, plan, params, server_opt, saved, pseudo_grad, lr, extra)
    return pseudo_grad, lr, extra


def _server_update(
    strategy: ServerStrategy, pl_module: Any, stats: RoundStatistics, plan: RoundPlan, params: list[Tensor]
) -> tuple[Tensor, float | None, dict[str, float]]:
    """``strategy.server_update(pl_module, stats, plan)``, its result checked: a :class:`ServerStep` or a tuple
    ``(Δ, lr, metrics)`` with ``Δ`` a 1-d tensor of one entry per trainable global parameter entry, ``lr`` None or
    a number, ``metrics`` a dict (or None); anything else is a ``TypeError`` / ``ValueError`` naming the strategy's
    ``server_update`` and what it returned."""
    where = f"{type(strategy).__name__}.server_update (round {plan.round})"
    out = strategy.server_update(pl_module, stats, plan)
    if not isinstance(out, tuple) or len(out) != 3:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"{where} returned {got}; it must return ServerStep(pseudo_gradient, lr, metrics) or the tuple "
            "(pseudo_gradient, lr, metrics), lr and metrics may be None"
        )
    pseudo_grad, lr, extra = out
    expected = sum(p.numel() for p in params)
    if not isinstance(pseudo_grad, Tensor):
        raise TypeError(f"{where} returned a pseudo-gradient of type {type(pseudo_grad).__name__}, not a tensor")
    if not (pseudo_grad.is_floating_point() or pseudo_grad.is_complex()):
        raise TypeError(
            f"{where} returned a pseudo-gradient of dtype {pseudo_grad.dtype}; it must be a floating-point tensor "
            "(the global parameters' dtype: an integer one would truncate the step)"
        )
    if pseudo_grad.dim() != 1 or pseudo_grad.numel() != expected:
        raise ValueError(
            f"{where} returned a pseudo-gradient of shape {tuple(pseudo_grad.shape)}; it must be flat, one entry per "
            f"entry of the global model's trainable parameters: shape ({expected},) (the layout of "
            "self.mean_delta(stats))"
        )
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (numbers.Real, Tensor))):
        raise TypeError(f"{where} returned the server learning rate {lr!r}; it must be a number or None")
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where} returned a server learning rate of shape {tuple(lr.shape)}, not one number")
        lr = float(lr.item())
    if lr is not None and lr < 0:  # (a NaN or infinite one is refused with the step's result)
        raise ValueError(
            f"{where} returned the server learning rate {lr!r}; it must be >= 0 (or None: the server optimizer's own)"
        )
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise TypeError(f"{where} returned metrics of type {type(extra).__name__}; they must be a dict (or None)")
    bad = next((k for k, v in extra.items() if not _is_number(v)), None)
    if bad is not None:
        raise TypeError(
            f"{where} returned the metric {bad!r} = {extra[bad]!r}; a metric must be a number (a float, an int or a "
            "tensor of one element)"
        )
    return pseudo_grad, lr, {k: float(v) for k, v in extra.items()}


def _is_number(value: Any) -> bool:
    """A real number or a tensor of one element."""
    return value.numel() == 1 if isinstance(value, Tensor) else isinstance(value, numbers.Real)


def _check_candidate(
    model: torch.nn.Module,
    strategy: ServerStrategy,
    plan: RoundPlan,
    params: list[Tensor],
    server_opt,
    saved: _ServerState,
    pseudo_grad: Tensor,
    lr: float | None,
    extra: dict[str, float],
) -> None:
    """The server step check (rule: :class:`~fedlightning.loop.FederatedLoop`'s ``max_update_norm``): if a
    global parameter or a floating tensor of the server optimizer's state is non-finite after the step, both are
    restored from ``saved`` and a ``FloatingPointError`` names the round, the strategy and the statistic."""
    state_tensors = [
        v for st in server_opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.is_floating_point()
    ]
    peak = torch.nn.utils.get_total_norm(list(params) + state_tensors, norm_type=math.inf)
    if math.isfinite(float(peak.item())):
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    where = next((f"parameter {n}" for n, p in zip(names, params) if not bool(torch.isfinite(p).all())), None)
    if where is None:
        by_param = {id(p): n for n, p in zip(names, params)}
        where = next(
            f"server optimizer state {k!r} of {by_param.get(id(p), 'a parameter')}"
            for p, st in server_opt.state.items()
            for k, v in st.items()
            if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
        )
    saved.restore()
    for p in params:
        p.grad = None
    step_lr = lr if lr is not None else server_opt.param_groups[0].get("lr", float("nan"))
    delta_norm = float(pseudo_grad.double().norm().item())
    if not bool(torch.isfinite(pseudo_grad).all()):
        statistic = "the pseudo-gradient Δ from server_update is non-finite"
    elif not math.isfinite(float(step_lr)):
        statistic = f"the server learning rate server/lr = {step_lr!r} is non-finite"
    else:
        shown = ", ".join(f"{k} = {v:.4g}" for k, v in extra.items() if isinstance(v, (int, float)))
        figures = f"server/lr = {float(step_lr):.4g}, server/delta_norm = {delta_norm:.4g}" + (
            f" ({shown})" if shown else ""
        )
        if where.startswith("server optimizer state"):  # e.g. Adam's Σ Δ² past the float range, the step itself fine
            statistic = f"the server optimizer's state overflows on this Δ: {figures}"
        else:
            statistic = f"the step server/lr·Δ overflows: {figures}"
    raise FloatingPointError(
        f"round {plan.round}: the server step of {type(strategy).__name__} would make the global model "
        f"non-finite ({where}): {statistic}. The global model and the server optimizer state are left as they "
        "were before this round and the run stops; every client update passed the aggregation checks, so the "
        "strategy or its hyper-parameters are at fault, not a client"
    )


def log_round(
    trainer: Any, metrics: dict[str, float], shown: tuple[str, ...] = (), hidden: tuple[str, ...] = ()
) -> None:
    """Log the round's metrics, as ``self.log`` in a ``training_step`` logs a value (``train/loss`` with
    ``prog_bar=True``), without Lightning's result collection.

    Decision (ours, measured): one ``self.log`` call costs about 0.5 ms (the result collection moves its metric
    object to the value's device at every call), 9 % of a DSGD round of vectorized clients on the digits workload
    (``benchmarks/algorithms_vectorized.py --algorithms DSGD``, docs/benchmarks.md §9). Every round the metrics are
    put into ``trainer.callback_metrics`` (for ``ModelCheckpoint(monitor=...)``, ``EarlyStopping``, schedules) and
    ``trainer.logged_metrics``, and ``train/loss`` onto the progress bar; on the rounds Lightning writes step
    metrics (every ``log_every_n_steps`` rounds, or when the trainer is stopping) they are written to the loggers
    as one row at the round's step, with Lightning's ``epoch`` added, and each logger saved, as Lightning's
    ``log_metrics`` does. ``shown``: further keys for the progress bar; ``hidden``: keys kept out of the loggers
    (and of ``trainer.logged_metrics``), as ``self.log(..., prog_bar=True)`` / ``logger=False`` asked."""
    values = {k: float(v) for k, v in metrics.items()}
    if not values:
        return
    # float64 tensors: the trainer's metrics hold the values the loggers get (self.log would round to float32)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
    publish_step_metrics(trainer, tensors, progress_bar=("train/loss", *shown), unlogged=hidden)
    if _step_logs_written(trainer):
        step = batches_that_stepped(trainer)
        row = {**{k: v for k, v in values.items() if k not in hidden}, "epoch": trainer.current_epoch}
        for logger in trainer.loggers:
            logger.log_metrics(row, step=step)
            logger.save()


def _step_logs_written(trainer: Any) -> bool:
    """Whether Lightning writes this round's step metrics to the loggers: its own rule, as its training loop
    applies it (``update_train_step_metrics``: ``should_update_logs``, i.e. every ``log_every_n_steps`` rounds
    or when the trainer is stopping, unless ``log_every_n_steps=0``; or ``fast_dev_run``)."""
    return bool(trainer.loggers) and bool(trainer.fast_dev_run or should_write_step_logs(trainer))
