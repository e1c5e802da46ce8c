"""Small data containers that flow through one federated round, flat-vector helpers and the client state store.

One round, as data (docs/architecture.md describes the round; the strategies sum the updates in a
:class:`RoundStatistics`)::

    RoundPlan  --(each sampled client trains)-->  ClientUpdate  --(strategy aggregates)-->  RoundResult

Sign convention (FedOpt view, Reddi et al. 2021): a client's *delta* is the pseudo-gradient
``Δ_i = w_t − w_i`` (global weights minus the client's final local weights), so the server step is
``w_{t+1} = w_t − η_g · Δ`` with ``Δ`` the (weighted) mean of the ``Δ_i``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "RoundPlan",
    "ClientUpdate",
    "RoundResult",
    "ClientStateStore",
    "RoundStatistics",
    "derive_seed",
    "flat_params",
    "flat_grads",
    "assign_flat_",
    "float_buffers",
    "buffer_values",
    "averaged_buffer_slices",
    "report_buffers",
    "real_parts",
    "squared_norm64",
    "write_averaged_buffer",
    "buffer_report_dtype",
    "loss_report_dtype",
    "sum_dtype",
]


@dataclass
class RoundPlan:
    """What the server decided for one communication round.

    Attributes:
        round: 0-based round index (equals ``trainer.global_step`` when the round starts).
        client_ids: the sampled clients, in sampling order.
        local_steps: number of local optimisation steps ``K`` every client runs this round
            (schedules such as :class:`~fedlightning.callbacks.KDecay` may change it in ``on_round_start``); with
            ``client_steps`` the largest of them.
        client_lr_scale: multiplier applied to the client optimizer's learning rate this round (η-decay schedules).
        extras: free-form per-round information for callbacks (e.g. FedDANE's gradient-phase clients).
        client_steps: each sampled client's own number of local steps, or None when every client runs
            ``local_steps`` (``FederatedLoop(local_epochs=E)`` sets it: ``⌈E · batches per epoch⌉`` per client). An
            ``on_round_start`` hook may set it in any run (FedNova-style heterogeneous steps), one count ``>= 1``
            per sampled client (the loop then sets ``local_steps`` to their largest).
    """

    round: int
    client_ids: list[int]
    local_steps: int
    client_lr_scale: float = 1.0
    extras: dict[str, Any] = field(default_factory=dict)
    client_steps: dict[int, int] | None = None

    def steps_for(self, client_id: int) -> int:
        """The number of local steps client ``client_id`` runs this round."""
        if self.client_steps is None:
            return self.local_steps
        return self.client_steps[client_id]

    def mean_local_steps(self) -> float:
        """The mean local step count of the round's clients (``local_steps`` without per-client counts)."""
        if self.client_steps is None:
            return float(self.local_steps)
        return sum(self.steps_for(c) for c in self.client_ids) / max(len(self.client_ids), 1)

    def with_steps(self, steps: int) -> RoundPlan:
        """A copy of this plan in which every client runs ``steps`` local steps (``client_steps`` dropped)."""
        return dataclasses.replace(self, local_steps=int(steps), client_steps=None)


@dataclass
class ClientUpdate:
    """What one client reports after its local training.

    Attributes:
        client_id: which client.
        delta: flat pseudo-gradient ``w_t − w_i`` over all trainable parameters (float32/64, on the model's device).
        num_samples: the client's number of training samples ``n_i`` (for sample weighting).
        num_steps: local steps actually run.
        first_loss: training loss of the first mini-batch at the global weights (seed 004's ``F_0`` statistic).
        mean_loss: mean of the per-step mini-batch losses (the papers' "training loss reported by a client").
        step_sizes: accepted step size of every local step (for SGD: the learning rate; of the first parameter
            group that holds a trainable parameter when the client optimizer has several).
        param_step_size_sums: when the client optimizer's parameter groups took different learning rates, each
            trainable parameter's sum of its group's learning rates over the local steps (in ``delta``'s order of
            parameters; 0 for a parameter no group holds); None otherwise, where every parameter's sum is
            ``sum(step_sizes)``. SCAFFOLD divides each parameter's update by its own sum.
        backtracks: total line-search backtracks (trial points rejected) over the round.
        forwards: forward passes of the model (gradient evaluations + trial evaluations).
        backwards: backward passes.
        buffers: the flat buffers the round averages (:func:`averaged_buffer_slices`: BatchNorm running statistics,
            ``num_batches_tracked``, a user's counters, masks and complex buffers) at the end of local training, in
            :func:`buffer_report_dtype`, or None.
        payload: extra values a strategy asked the client to send (e.g. control-variate deltas).
        failed: True when the client's training produced a non-finite loss/update or raised.
        failure: a human-readable reason when ``failed``.
    """

    client_id: int
    delta: Tensor | None
    num_samples: int
    num_steps: int = 0
    first_loss: float = float("nan")
    mean_loss: float = float("nan")
    step_sizes: list[float] = field(default_factory=list)
    param_step_size_sums: list[float] | None = None
    backtracks: int = 0
    forwards: int = 0
    backwards: int = 0
    buffers: Tensor | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    failure: str = ""

    @property
    def last_step_size(self) -> float:
        return self.step_sizes[-1] if self.step_sizes else float("nan")


@dataclass
class RoundResult:
    """Outcome of a round, handed to ``on_round_end`` hooks.

    Attributes:
        plan: the round's plan.
        num_clients: clients that reported a healthy update.
        num_failed: clients skipped by the failure policy.
        metrics: scalar statistics of the round (train loss, η_g, ‖Δ‖, step-size statistics, ...); these are logged.
        first_losses / mean_losses: per healthy client, for schedules that need them (K-decay "error").
        pseudo_gradient: the aggregated flat Δ the server applied (None when no client was healthy).
        client_ids: the healthy clients (of every process), in sampling order, as ``first_losses``.
    """

    plan: RoundPlan
    num_clients: int
    num_failed: int
    metrics: dict[str, float] = field(default_factory=dict)
    first_losses: list[float] = field(default_factory=list)
    mean_losses: list[float] = field(default_factory=list)
    pseudo_gradient: Tensor | None = None
    client_ids: list[int] = field(default_factory=list)

    def healthy_local_steps(self) -> float:
        """The local steps of the round's healthy clients, summed: each one's own count with per-client counts
        (``local_epochs``), else ``round/clients`` times ``K``."""
        plan = self.plan
        if plan.client_steps is not None:
            return float(sum(plan.steps_for(c) for c in self.client_ids))
        return float(self.metrics.get("round/clients", self.num_clients)) * plan.local_steps


class RoundStatistics:
    """Named tensors accumulated over a round's clients; each is reduced across processes by sum or max.

    Scalars given as Python numbers are summed (or maxed) as Python floats, i.e. in float64 like the float64
    tensors they become when first read (``stats[key]``, ``values``), so a client's ten telemetry scalars cost no
    tensor operations. Tensor values are accumulated in place into the statistic's own copy.
    """

    def __init__(self) -> None:
        self._values: dict[str, Tensor] = {}
        self._scalars: dict[str, tuple[float, object]] = {}  # key -> (python float, device)
        self.ops: dict[str, str] = {}

    def _scalar(self, key: str, value: float, device, op: str) -> None:
        value = float(value)
        if key in self._values:  # already a tensor (e.g. read, then added to)
            self._tensor(key, torch.tensor(value, dtype=torch.float64, device=device), op)
        elif key in self._scalars:
            old = self._scalars[key][0]
            self._scalars[key] = (old + value if op == "sum" else max(old, value), self._scalars[key][1])
        else:
            self._scalars[key], self.ops[key] = (value, device), op

    def _tensor(self, key: str, value: Tensor, op: str) -> None:
        if key in self._scalars:
            self._materialize(key)
        if key not in self._values:
            self._values[key], self.ops[key] = value.clone(), op
            return
        cur = self._values[key]
        if cur.shape != value.shape:  # a strategy's statistic must have one shape for every client (and process)
            raise ValueError(
                f"round statistic {key!r}: a client adds a value of shape {tuple(value.shape)} to one of shape "
                f"{tuple(cur.shape)}; every client must add the same shape"
            )
        if op == "sum":
            if cur.dtype == value.dtype and cur.shape == value.shape and cur.device == value.device:
                cur.add_(value)
            else:
                self._values[key] = cur + value
        else:
            self._values[key] = torch.maximum(cur, value)

    def _materialize(self, key: str) -> None:
        value, device = self._scalars.pop(key)
        self._values[key] = torch.tensor(value, dtype=torch.float64, device=device)

    def add(self, key: str, value: Tensor | float, device=None) -> None:
        """Add ``value`` into the statistic ``key``, summed over the round's clients and then over every process
        (one ``all_reduce``). A tensor keeps its dtype and must have the same shape for every client; a Python
        number is summed in float64 and becomes a float64 tensor on ``device`` (the updates' device, where the
        cross-process reduction runs) when read."""
        if isinstance(value, Tensor):
            self._tensor(key, value, "sum")
        else:
            self._scalar(key, value, device, "sum")

    def maximum(self, key: str, value: Tensor | float, device=None) -> None:
        """As :meth:`add`, reduced by maximum (elementwise for a tensor) instead of sum."""
        if isinstance(value, Tensor):
            self._tensor(key, value, "max")
        else:
            self._scalar(key, value, device, "max")

    @property
    def values(self) -> dict[str, Tensor]:
        """Every statistic as a tensor (scalars become float64 tensors on the device they were added with)."""
        for key in list(self._scalars):
            self._materialize(key)
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        if key in self._scalars:
            self._materialize(key)
        return self._values[key]

    def __contains__(self, key: str) -> bool:
        return key in self._values or key in self._scalars

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def merge(self, other: RoundStatistics) -> None:
        """Add (or max) every statistic of ``other`` into this one, as if each had been added here; a tensor this
        object does not hold yet is adopted without a copy (``other`` is not used afterwards)."""
        for key, (value, device) in other._scalars.items():
            self._scalar(key, value, device, other.ops[key])
        for key, value in other._values.items():
            if key in self._values or key in self._scalars:
                self._tensor(key, value, other.ops[key])
            else:
                self._values[key], self.ops[key] = value, other.ops[key]

    def unsafe_entry(self, num_terms: int) -> str | None:
        """``"<key> = <value>"`` for the first statistic that is non-finite, or whose sum over ``num_terms`` values of
        its size could overflow its dtype (a summed entry of magnitude ``≥ finfo.max / (2·num_terms)``; Python
        numbers are float64); None when every one is safe. Tensors are measured by their float64 2-norm (one
        reduction each), which bounds every entry."""
        for key, (value, _) in self._scalars.items():
            limit = torch.finfo(torch.float64).max / (2 * num_terms)
            if not math.isfinite(value) or (self.ops[key] == "sum" and abs(value) >= limit):
                return f"{key} = {value!r}"
        for key, value in self._values.items():
            size = float(value.double().pow(2).sum().sqrt().item()) if value.numel() else 0.0
            limit = torch.finfo(value.dtype).max / (2 * num_terms) if value.is_floating_point() else math.inf
            if not math.isfinite(size) or (self.ops[key] == "sum" and size >= limit):
                return f"{key} (norm {size:.4g})"
        return None


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ``parts`` (e.g. ``(seed, "data", round, client_id)``).

    Every random stream of a run is derived this way, never from a shared global generator, so that the same
    client in the same round sees the same randomness whether clients run sequentially, vectorised, or sharded
    over processes, and whether the run was resumed or not. A cryptographic hash (blake2b) keeps the streams
    of neighbouring ``(round, client)`` pairs independent. An integer part counts by its value, whatever its type
    (``numpy.int64(3)`` is ``3``: a callback that passes numpy client ids gets the client's own streams).
    """
    parts = tuple(int(p) if isinstance(p, numbers.Integral) and not isinstance(p, bool) else p for p in parts)
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _trainable(params: Iterable[nn.Parameter]) -> list[Tensor]:
    return [p for p in params if p.requires_grad]


def flat_params(params: Iterable[Tensor]) -> Tensor:
    """Concatenate tensors into one flat vector (a copy, detached)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def flat_grads(params: Iterable[Tensor]) -> Tensor:
    """Flat gradient vector; a parameter without ``.grad`` contributes zeros."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


@torch.no_grad()
def assign_flat_(params: Iterable[Tensor], vector: Tensor) -> None:
    """Copy consecutive slices of ``vector`` into ``params`` in place (inverse of :func:`flat_params`)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vector[offset : offset + n].view_as(p))
        offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} elements but the parameters hold {offset}")


def buffer_report_dtype(buffers: Iterable[Tensor]) -> torch.dtype:
    """The dtype in which a client reports its buffers (``ClientUpdate.buffers``): float64 when any of them is
    float64 (a float64 model's BatchNorm statistics keep their precision through the average) or not a float (an
    integer counter such as ``num_batches_tracked`` is exact in float64 up to 2**53; a complex one's parts), else
    float32 (half and bfloat16 statistics are averaged in float32, ours)."""
    return (
        torch.float64 if any(b.dtype == torch.float64 or not b.is_floating_point() for b in buffers) else torch.float32
    )


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a round sums its clients' weighted updates of ``dtype`` (``RoundStatistics["delta"]``):
    float32 for half-precision updates (``"16-true"``, ``"bf16-true"`` runs), else their own. Decision (ours): a
    float16 sum of ``w_i Δ_i`` with sample-count weights overflows at a few thousand samples per client (65504 is
    float16's largest value), which left the largest clients out of every round, and a bfloat16 sum of 100 clients
    is 5 roundings off the mean; float32 holds both, and the mean is rounded once into the parameters' dtype when the
    server step writes it."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def real_parts(t: Tensor) -> Tensor:
    """``t`` as real numbers: a complex tensor as its real and imaginary parts (a view with a last dimension of 2,
    as :func:`torch.view_as_real` lays them out, so writes reach ``t``), any other tensor as it is. The server side
    treats a complex parameter, update or buffer as these pairs of reals, as ``torch.optim.Adam`` does."""
    return torch.view_as_real(t) if t.is_complex() else t


def squared_norm64(t: Tensor) -> Tensor:
    """``‖t‖²`` summed in float64 (0-d): ``Σ t²`` for a real tensor, ``Σ |t|²`` for a complex one (a model with
    complex parameters: its flat update is complex, and ``.double()`` would drop the imaginary parts)."""
    return real_parts(t).double().pow(2).sum()


#: The largest magnitude of an integer buffer that the average writes back (float64 holds every integer up to it).
EXACT_INTEGER = 2**53


def buffer_values(buffer: Tensor) -> Tensor:
    """``buffer``'s values as real numbers, flattened: a complex buffer as its real and imaginary parts (pairs, as
    :func:`torch.view_as_real` lays them out), any other as it is. The round averages every buffer through these
    (:func:`averaged_buffer_slices`): the mean of complex numbers is the mean of their parts."""
    return real_parts(buffer).reshape(-1)


def averaged_buffer_slices(buffers: Sequence[Tensor]) -> list[tuple[int, slice]]:
    """The layout of ``ClientUpdate.buffers`` for a model whose buffers are ``buffers`` (``model.buffers()`` order):
    ``(i, s)`` for every buffer (float, integer, bool and complex: the round averages them all),
    :func:`buffer_values` of ``buffers[i]`` at ``ClientUpdate.buffers[s]``, one after the other in that order."""
    out, offset = [], 0
    for i, b in enumerate(buffers):
        size = real_parts(b).numel()  # a complex buffer: its real and imaginary parts
        out.append((i, slice(offset, offset + size)))
        offset += size
    return out


def report_buffers(buffers: Sequence[Tensor], like: Sequence[Tensor] | None = None) -> Tensor | None:
    """``ClientUpdate.buffers`` of a client whose model's buffers are ``buffers`` after its training
    (``model.buffers()`` order): the averaged ones laid out as :func:`averaged_buffer_slices` says for ``like`` (the
    global model's buffers; default ``buffers``), in :func:`buffer_report_dtype`; None when the model has none."""
    reference = buffers if like is None else like
    layout = averaged_buffer_slices(reference)
    if not layout:
        return None
    dtype = buffer_report_dtype([reference[i] for i, _ in layout])
    return torch.cat([buffer_values(buffers[i].detach()).to(dtype) for i, _ in layout])


def write_averaged_buffer(buffer: Tensor, average: Tensor) -> None:
    """Write the clients' weighted ``average`` (flat, float) into the global ``buffer``.

    Decisions (ours): a float buffer takes the average as it is. An integer buffer takes it rounded to the nearest
    integer (half to even): ``num_batches_tracked`` and a step counter that every client advances by its local
    steps move by their mean, as the clients' BatchNorm statistics move by the mean of theirs (a BatchNorm layer
    with ``momentum=None`` averages over ``num_batches_tracked`` batches, so its count and its statistics go
    together), and a value no client changes stays exactly as it was. One whose average or global value exceeds
    2**53 in magnitude keeps the global value, which float64 could not average exactly. A bool buffer (a mask)
    takes the weighted majority (ties: True). A complex buffer takes the average of its real and imaginary parts
    (:func:`buffer_values`)."""
    if buffer.is_complex():
        parts = real_parts(buffer)  # a view: writing it writes the buffer
        parts.copy_(average.view_as(parts))
        return
    average = average.view_as(buffer)
    if buffer.is_floating_point():
        buffer.copy_(average)
    elif buffer.dtype == torch.bool:
        buffer.copy_(average >= 0.5)
    else:
        rounded = average.round()
        if buffer.numel() and max(float(rounded.abs().max()), float(buffer.abs().max())) > EXACT_INTEGER:
            return
        buffer.copy_(rounded)


def loss_report_dtype(losses: Tensor) -> torch.dtype:
    """The dtype in which a client reports its losses (``ClientUpdate.first_loss`` / ``mean_loss``, their mean
    taken in it): float64 losses (a ``64-true`` run) stay float64, others are widened to float32 (ours)."""
    return torch.float64 if losses.dtype == torch.float64 else torch.float32


def float_buffers(module: nn.Module) -> list[Tensor]:
    """The floating-point buffers of a module (BatchNorm running mean/var)."""
    return [b for b in module.buffers() if b.is_floating_point()]


class ClientStateStore:
    """Persistent per-client state (optimizer step sizes, DecSPS counters, SCAFFOLD control variates, ...).

    A plain ``dict`` keyed by ``(namespace, client_id)``: clients that never participated cost nothing.
    Values are dicts of tensors / Python scalars (and lists or tuples of them). The store is saved in, and restored
    from, the FederatedLoop's checkpoint. Tensors are kept on the device they were stored from; ``state_dict`` moves
    them to CPU so checkpoints are device independent. Readers must ``.to(device)`` tensors they get back: with
    several processes, the entries written by the other processes arrive on the CPU (every process keeps the
    whole store after each round, so any process can train any client and rank 0's checkpoint is complete).
    """

    def __init__(self) -> None:
        self._data: dict[str, dict[int, dict[str, Any]]] = {}
        self._dirty: set = set()
        self._rehearsing = 0

    @contextmanager
    def rehearsal(self) -> Iterator[None]:
        """A block that trains clients a second time in a round and puts the store back afterwards (``auto``'s
        measurement): its writes are not checked for repeats (:meth:`set`)."""
        self._rehearsing += 1
        try:
            yield
        finally:
            self._rehearsing -= 1

    def get(self, namespace: str, client_id: int) -> dict[str, Any] | None:
        return self._data.get(namespace, {}).get(int(client_id))

    def set(self, namespace: str, client_id: int, value: dict[str, Any]) -> None:
        """Store client ``client_id``'s entry of ``namespace``: at most once per round (between two
        :meth:`pop_dirty`, which the loop calls at every round's end).

        Decision (ours): a second write in one round means the round's plan holds the client twice (sampling with
        replacement) in a run whose clients keep state across rounds; sequential training would start the second
        copy from the state the first wrote and vectorized training both from the round's start, so the run is
        refused (a ``ValueError`` naming the client and the state) rather than trained one way or the other. Not
        checked inside :meth:`rehearsal`."""
        key = (namespace, int(client_id))
        if key in self._dirty and not self._rehearsing:
            raise ValueError(
                f"client {key[1]}'s {namespace!r} state is written twice in one round: the round's plan holds the "
                "client more than once (sampling with replacement), and clients that keep state across rounds "
                "(SCAFFOLD's control variates, a client optimizer's carried state) must be sampled without "
                "replacement: make sample_clients draw distinct clients"
            )
        self._data.setdefault(namespace, {})[key[1]] = value
        self._dirty.add(key)

    @property
    def has_dirty(self) -> bool:
        """Whether entries were written since the last :meth:`pop_dirty` (during a round: its clients wrote state)."""
        return bool(self._dirty)

    def pop_dirty(self) -> dict[tuple, dict[str, Any]]:
        """Entries written since the last call (what a process must share with the others after a round)."""
        out = {key: self._data[key[0]][key[1]] for key in sorted(self._dirty)}
        self._dirty = set()
        return out

    def update_from(self, entries: dict[tuple, dict[str, Any]]) -> None:
        """Write entries received from other processes (without marking them dirty)."""
        for (ns, cid), value in entries.items():
            self._data.setdefault(ns, {})[int(cid)] = value

    def clients(self, namespace: str) -> list[int]:
        return sorted(self._data.get(namespace, {}))

    def snapshot(self) -> tuple:
        """The entries and the record of written ones, for :meth:`restore`: cheap (each entry's dict is copied, its
        values are not; a tensor changed in place inside an entry stays changed)."""
        entries = {
            ns: {cid: dict(v) if isinstance(v, dict) else v for cid, v in d.items()} for ns, d in self._data.items()
        }
        return entries, set(self._dirty)

    def restore(self, snapshot: tuple) -> None:
        """Put back the entries of :meth:`snapshot`: entries written since are undone."""
        entries, dirty = snapshot
        self._data = {ns: dict(d) for ns, d in entries.items()}
        self._dirty = set(dirty)

    def __len__(self) -> int:
        return sum(len(v) for v in self._data.values())

    def state_dict(self) -> dict[str, dict[int, dict[str, Any]]]:
        def cpu(v: Any) -> Any:
            if isinstance(v, Tensor):
                return v.detach().cpu().clone()
            if isinstance(v, dict):
                return {k: cpu(x) for k, x in v.items()}
            if isinstance(v, tuple) and hasattr(v, "_fields"):  # a namedtuple
                return type(v)(*(cpu(x) for x in v))
            if isinstance(v, (list, tuple)):  # e.g. one tensor per parameter
                return type(v)(cpu(x) for x in v)
            return v

        return {ns: {cid: cpu(val) for cid, val in d.items()} for ns, d in self._data.items()}

    def load_state_dict(self, state: dict[str, dict[int, dict[str, Any]]]) -> None:
        self._data = {ns: {int(cid): val for cid, val in d.items()} for ns, d in state.items()}
        self._dirty = set()
