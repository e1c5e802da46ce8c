r"""FedDANE (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "FedDANE: A Federated Newton-Type Method", Asilomar
2019, Alg. 2; seed 003): :class:`FedDANE`.

One FedDANE iteration is two communication rounds: a gradient phase (``g_t = mean_{k∈S_t} ∇F_k(w_t)`` over a
sampled set ``S_t``), then a local phase in which each client ``k`` of the round's sample inexactly solves

.. math::
    \min_w\; F_k(w) + \langle g_t - \nabla F_k(w_t),\, w - w_t\rangle + \frac{\mu}{2}\lVert w - w_t\rVert^2

and the server averages the returned models. The decisions the paper leaves open (how ``S_t`` is drawn, the full
gradient, weighting, DDP, communication count) are in :class:`FedDANE`'s docstring; the full-batch client gradient
is :func:`client_full_gradient`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning._reference import reference_mode
from fedlightning._validation import integer, non_negative, one_of
from fedlightning.callbacks.fedavg import FedAvg
from fedlightning.callbacks.proximal import global_anchors, split_like
from fedlightning.client import extract_loss
from fedlightning.datamodules.base import ArrayDataset
from fedlightning.distributed import FiniteMean, finite_weighted_mean_over_processes
from fedlightning.objectives import AnchoredTerm
from fedlightning.state import RoundPlan, derive_seed, flat_grads

__all__ = [
    "FedDANE",
    "client_full_batches",
    "client_full_gradient",
    "client_full_rows",
    "leave_out_nonfinite_gradients",
]


def client_full_batches(
    loop, client_id: int, batch_size: int | None = None, direct: bool = False
) -> tuple[int, Iterator[tuple[int, Any]]]:
    """Client ``client_id``'s number of training samples ``n`` and its samples as ``(size, batch)`` pairs in order,
    loaded lazily: one batch of all of them (``batch_size`` None) or consecutive chunks of ``batch_size`` (the last
    one shorter), collated as the client loaders collate them (the user's ``collate_fn`` and loader options:
    :meth:`~fedlightning.datamodules.FederatedDataModule.client_full_dataloader`), on the host. Iterating may draw
    from torch's global generator (a ``DataLoader``'s base seed, any random transform of the data set): callers
    iterate under a forked, seeded generator. ``direct``: an in-memory ``ArrayDataset`` without a ``collate_fn`` is
    indexed with each chunk's indices without a loader (the same batches)."""
    dm = loop.datamodule
    indices = np.asarray(dm.client_indices[client_id])
    n = len(indices)
    if n == 0:
        raise ValueError(f"client {client_id} holds no training samples; it has no gradient")
    chunk = n if batch_size is None else int(batch_size)
    sizes = [min(chunk, n - start) for start in range(0, n, chunk)]
    dataset = dm.train_dataset
    if direct and isinstance(dataset, ArrayDataset) and dm.collate_fn is None and not reference_mode():
        index = torch.as_tensor(indices, dtype=torch.long)
        return n, ((size, dataset[index[start : start + size]]) for start, size in zip(range(0, n, chunk), sizes))
    return n, zip(sizes, dm.client_full_dataloader(client_id, chunk))


def client_full_rows(
    loop, client_ids: Sequence[int], batch_size: int | None = None
) -> tuple[tuple[Tensor, Tensor], list[int], list[int], list[int]] | None:
    """The samples of several clients as rows of one padded batch, gathered with one indexing op per tensor:
    ``((x_rows, y_rows), sizes, row_clients, totals)``, row ``r`` a chunk of :func:`client_full_batches` (client
    ``client_ids[row_clients[r]]``, ``sizes[r]`` samples, padded to the largest chunk by repeating its own
    samples), ``totals[i]`` the samples of ``client_ids[i]``; on the host. None unless the training data is an
    in-memory ``ArrayDataset`` of two tensors indexed by its own ``__getitem__`` (reference mode off): the chunks
    are then exactly ``client_full_batches``' ``dataset[indices]``."""
    dm = loop.datamodule
    dataset = dm.train_dataset
    if (
        reference_mode()
        or dm.collate_fn is not None
        or not isinstance(dataset, ArrayDataset)
        or type(dataset).__getitem__ is not ArrayDataset.__getitem__
        or not (isinstance(dataset.x, Tensor) and isinstance(dataset.y, Tensor))
    ):
        return None
    chunks, sizes, row_clients, totals = [], [], [], []
    for i, k in enumerate(client_ids):
        indices = np.asarray(dm.client_indices[k], dtype=np.int64)
        n = len(indices)
        if n == 0:
            raise ValueError(f"client {k} holds no training samples; it has no gradient")
        chunk = n if batch_size is None else int(batch_size)
        for start in range(0, n, chunk):
            chunks.append(indices[start : start + chunk])
            sizes.append(len(chunks[-1]))
            row_clients.append(i)
        totals.append(n)
    n_max = max(sizes)
    index = np.stack([c[np.arange(n_max) % len(c)] for c in chunks])  # [R, n_max], padded with own samples
    flat = torch.from_numpy(index.reshape(-1))
    x, y = dataset.x, dataset.y
    rows = (
        x.index_select(0, flat).view(len(chunks), n_max, *x.shape[1:]),
        y.index_select(0, flat).view(len(chunks), n_max, *y.shape[1:]),
    )
    return rows, sizes, row_clients, totals


@torch.enable_grad()
def client_full_gradient(
    loop, client_id: int, round: int, batch_size: int | None = None, tag: str = "feddane-gradient"
) -> Tensor:
    """Flat gradient of client ``client_id``'s mean training loss over all its samples at the global weights.

    Uses the FederatedLoop's working copy of the model (its weights, buffers and parameters that do not train are
    reset to the global ones first, ``LocalTrainer.start_from``; each client's local training resets them again)
    and leaves the loop's global model, the global RNG, the round's captured client values and the working copy's
    torchmetrics states untouched. The samples are :func:`client_full_batches`' (chunks of ``batch_size``, each
    chunk's loss weighted by its share of the samples); model randomness (dropout) is seeded by
    ``(loop.seed, tag, round, client_id)`` in a forked generator. :meth:`FederatedLoop.client_full_gradients`
    computes the gradients of several clients at once.
    """
    worker = loop.client_worker
    model, params = worker.model, worker.params
    frozen = loop.global_frozen_parameters() if worker.frozen else ()
    worker.start_from(loop.global_parameters(), list(loop.model.buffers()), frozen)
    n, batches = client_full_batches(loop, client_id, batch_size)
    router = getattr(worker, "router", None)
    saved_capture = router.save_capture() if router is not None else None
    # the torchmetrics metrics training_step updates count the round's local steps, not this evaluation's batches
    saved_metrics = worker.metrics.save() if worker.metrics is not None else None
    was_training = model.training
    model.train()
    for p in params:
        p.grad = None
    devices = [params[0].device] if params and params[0].device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(loop.seed, tag, round, client_id))
            for size, batch in batches:
                batch = worker.prepare_batch(batch)  # as a local step gets it: conversion, transfer hooks
                loss = extract_loss(model.training_step(batch, 0), worker.model_name)
                (loss * (size / n)).backward()
        grad = flat_grads(params).detach().clone()
    finally:
        for p in params:
            p.grad = None
        model.train(was_training)
        if router is not None:
            router.restore_capture(saved_capture)
        if saved_metrics is not None:
            worker.metrics.restore(saved_metrics)
    return grad


def leave_out_nonfinite_gradients(loop, plan: RoundPlan, result: FiniteMean, what: str) -> None:
    """The failure policy for the clients whose full gradient at the global weights held a NaN or an infinity
    (``result.left_out``, already left out of ``what``, the mean they would have entered): under the loop's
    ``on_client_failure="skip"`` a warning names each of this process's such clients and the round; under
    ``"raise"`` every process stops the run with a ``FloatingPointError`` (the count is all-reduced, so no process
    waits for the others in a later collective).

    Decision (ours): such a client is a failed client of the gradient phase, as a client with a NaN update is of
    the local phase. Its own training then goes by the loop's usual checks: under FedDANE its correction
    ``g_t − ∇F_k(w_t)`` is NaN, so its update is too and it is left out of the round; under Mime and MimeLite its
    local steps do not use its own full gradient, and its update counts if it is finite. A client whose computation
    raised under ``on_client_error="skip"`` (``FederatedLoop.full_gradient_errors``, passed to the mean as ``raised``)
    was warned about by the loop and is not counted here."""
    if not result.left_out_total:
        return
    if loop.on_client_failure == "raise":
        mine = ", ".join(str(k) for k in result.left_out)
        who = f"client {mine}" if len(result.left_out) == 1 else (f"clients {mine}" if mine else "a client")
        where = "" if mine else " on another process"
        raise FloatingPointError(
            f"{who}{where} failed in round {plan.round}: the full gradient at the global weights is NaN/inf "
            f"({what}; on_client_failure='raise')"
        )
    for k in result.left_out:
        warnings.warn(
            f"round {plan.round}: client {k}'s full gradient at the global weights is NaN/inf; it is left out of "
            f"{what}",
            UserWarning,
            stacklevel=3,
        )


class FedDANE(FedAvg):
    r"""FedDANE: two communication rounds per iteration, a gradient phase and a corrected local phase.

    One FedDANE iteration = two communication rounds:

    1. *Gradient phase.* A sampled set ``S_t`` of clients computes full-batch local gradients at the global weights;
       the server forms ``g_t = mean_{k∈S_t} ∇F_k(w_t)``.
    2. *Local phase.* Each client ``k`` of ``S'_t`` (the round's sampled clients, ``plan.client_ids``) solves
       inexactly (its local SGD steps)

       .. math::
           \min_w\; F_k(w) + \langle g_t - \nabla F_k(w_t),\, w - w_t\rangle + \frac{\mu}{2}\lVert w - w_t\rVert^2

       and the server averages the returned models (FedAvg with ``η_g = 1``).

    Dropping the correction gives FedProx; dropping it and setting ``μ = 0`` gives FedAvg (``correction=False``).

    Decisions (what FedDANE's Algorithm 2 leaves open, and where the reference code departs from it):

    * ``S'_t`` is the data module's round sample; ``S_t`` is drawn **independently** by default (the paper), uniformly
      without replacement from the clients that hold data, with a generator seeded by
      ``derive_seed(loop.seed, "feddane", round)``; ``gradient_clients="same"`` uses ``S_t = S'_t`` (what the
      reference code does, its two ``select_clients`` calls share a seed). ``|S_t|`` defaults to ``|S'_t|``.
    * ``∇F_k(w_t)`` is the gradient of the client's mean training loss over **all** its samples (the reference code's
      full batch), computed with the wrapped model's ``training_step`` in training mode on the FederatedLoop's working
      copy, chunked by ``gradient_batch_size`` (None: one batch) with chunk losses weighted by chunk size. Model
      randomness (dropout) is seeded by ``(seed, "feddane-gradient", round, client)`` in a forked RNG (vectorised:
      one forked stream per round, ``(seed, "feddane-gradient-vectorized", round, *clients)``). Only the
      model loss enters the gradient (no other client-objective terms). The gradients of ``S_t`` and of the round's
      clients ``S'_t`` (each client of ``S'_t`` computes its own ``∇F_k(w_t)``: the paper's extra computation, no
      extra upload) are computed together at the start of the round, once per client of ``S_t ∪ S'_t``, by
      :meth:`~fedlightning.FederatedLoop.client_full_gradients` (all at once when clients train vectorised); the
      ``∇F_k(w_t)`` of ``S'_t`` are kept until the round ends: a ``[|S'_t|, D]`` tensor per round (``D`` the
      number of trainable parameters; with DDP, this process's share of ``S'_t``).
    * The local-phase term ``⟨g_t − ∇F_k(w_t), w − w_t⟩ + μ/2‖w − w_t‖²`` is an
      :class:`~fedlightning.objectives.AnchoredTerm` (vectorised training stacks it over the clients and adds its
      gradient in closed form).
    * ``g_t`` and the model average use the strategy's ``weighting``: ``"uniform"`` (default, the paper's ``1/K``) or
      ``"samples"`` (the reference code's ``n_k``-weighted averages).
    * Under DDP every process computes the gradients of its share of ``S_t`` and the sum is all-reduced.
    * The correction is written relative to ``w_t`` (as in the paper's eq. 3), so it is zero at ``w_t``.
    * A client of ``S_t`` whose full gradient holds a NaN or an infinity is left out of ``g_t`` (its weight too) with
      a warning, or stops the run under ``on_client_failure="raise"`` (:func:`leave_out_nonfinite_gradients`):
      otherwise one faulty client would make every client's correction NaN. A client of ``S'_t`` with such a
      gradient has a NaN correction, so its update is NaN and the loop leaves it out of the round.
    * Communication: ``round/communication_rounds`` logs the cumulative count, 2 per FedDANE iteration (the paper
      plots per iteration, which favours FedDANE; divide by 2 to compare per communication round).

    Logged: ``feddane/gradient_norm`` (‖g_t‖), ``feddane/gradient_clients`` (the clients of ``S_t`` whose gradient
    entered ``g_t``), ``round/communication_rounds``.

    Args:
        mu: proximal coefficient ``μ ≥ 0`` (default 0.0: the reference code's default; the paper tunes
            ``μ ∈ {0, 0.001, 0.01, 0.1, 1}``).
        gradient_clients: ``"independent"`` (default, the paper) or ``"same"`` (the reference code).
        gradient_clients_per_round: ``|S_t|`` (None: the round's number of sampled clients, the paper's ``K``).
        gradient_batch_size: chunk size of the full-batch gradient (None: the client's whole data at once).
        correction: include ``⟨g_t − ∇F_k(w_t), w − w_t⟩`` (default True). False reduces FedDANE to FedProx
            (and, with ``mu=0``, to FedAvg) and skips the gradient phase.
        weighting: ``"uniform"`` (default, the paper) or ``"samples"`` (the reference code).
    """

    def __init__(
        self,
        mu: float = 0.0,
        gradient_clients: str = "independent",
        gradient_clients_per_round: int | None = None,
        gradient_batch_size: int | None = None,
        correction: bool = True,
        weighting: str = "uniform",
    ):
        super().__init__(server_lr=1.0, weighting=weighting)
        self.mu = non_negative("mu", mu)
        self.gradient_clients = one_of("gradient_clients", gradient_clients, ("independent", "same"))
        self.gradient_clients_per_round = integer(
            "gradient_clients_per_round", gradient_clients_per_round, allow_none=True
        )
        self.gradient_batch_size = integer("gradient_batch_size", gradient_batch_size, allow_none=True)
        self.correction = bool(correction)
        self._round: int | None = None
        self._global_gradient: Tensor | None = None  # g_t of the current round
        self._gradient_client_ids: list[int] = []
        self._client_gradients: dict[int, Tensor] = {}  # ∇F_k(w_t) of this process's clients of the round
        self._gradient_clients_used = 0  # |S_t| less the clients whose full gradient was NaN/inf

    # ------------------------------------------------------------------ gradient phase
    def sample_gradient_clients(self, loop, plan: RoundPlan) -> list[int]:
        """``S_t``: the round's clients (``"same"``) or an independent seeded sample of the clients with data."""
        if self.gradient_clients == "same":
            return list(plan.client_ids)
        dm = loop.datamodule
        eligible = dm.clients_with_data()
        m = self.gradient_clients_per_round or len(plan.client_ids)
        if m > len(eligible):
            raise ValueError(f"gradient_clients_per_round={m} exceeds the {len(eligible)} clients that hold data")
        gen = torch.Generator().manual_seed(derive_seed(loop.seed, "feddane", plan.round))
        pick = torch.randperm(len(eligible), generator=gen)[:m]
        return [int(eligible[i]) for i in pick.tolist()]

    def on_round_start(self, trainer, pl_module, plan: RoundPlan) -> None:
        self._round = plan.round
        self._global_gradient = None
        self._client_gradients = {}
        if not self.correction:
            self._gradient_client_ids = []
            return
        ids = self.sample_gradient_clients(pl_module, plan)
        self._gradient_client_ids = ids
        plan.extras["feddane_gradient_clients"] = list(ids)
        dm = pl_module.datamodule
        weights = {k: (float(dm.client_num_samples(k)) if self.weighting == "samples" else 1.0) for k in ids}
        share = pl_module.process_share(ids)  # this process's part of S_t
        own = pl_module.process_share(list(plan.client_ids))  # and of S'_t, whose ∇F_k(w_t) the local phase needs
        union = list(dict.fromkeys([*share, *own]))
        grads = pl_module.client_full_gradients(union, plan.round, self.gradient_batch_size)  # [len(union), D]
        row = {k: i for i, k in enumerate(union)}
        result = finite_weighted_mean_over_processes(
            ((k, weights[k], grads[row[k]]) for k in share),
            grads.new_empty(grads.shape[1]),
            "FedDANE's global gradient",
            plan.round,
            raised=pl_module.full_gradient_errors(plan.round),
        )
        leave_out_nonfinite_gradients(pl_module, plan, result, "FedDANE's global gradient g_t")
        self._global_gradient = result.mean
        self._gradient_clients_used = result.used_total
        if own:
            kept = grads if len(own) == len(union) else grads[[row[k] for k in own]]
            self._client_gradients = {k: kept[i] for i, k in enumerate(own)}

    # ------------------------------------------------------------------ local phase
    def client_objective(self, trainer, pl_module, plan: RoundPlan, client_id: int):
        if not self.correction and self.mu == 0.0:
            return []
        anchors = global_anchors(pl_module)
        directions = None
        if self.correction:
            if self._global_gradient is None or self._round != plan.round:
                raise RuntimeError(
                    "FedDANE's gradient phase did not run for this round (on_round_start was not called)"
                )
            own = self._client_gradients.get(client_id)
            if own is None:  # a client outside this process's share of the round's sample
                own = client_full_gradient(pl_module, client_id, plan.round, self.gradient_batch_size)
            directions = split_like(self._global_gradient - own, anchors)
        return [AnchoredTerm(anchors, mu=self.mu, directions=directions)]

    # ------------------------------------------------------------------ server
    def server_update(self, loop, stats, plan: RoundPlan):
        delta, lr, metrics = super().server_update(loop, stats, plan)
        metrics = dict(metrics)
        per_round = 2 if self.correction else 1  # without the correction there is no gradient phase (FedProx)
        metrics["round/communication_rounds"] = float(per_round * (plan.round + 1))
        if self._global_gradient is not None:
            metrics["feddane/gradient_norm"] = float(self._global_gradient.double().norm().item())
            metrics["feddane/gradient_clients"] = float(self._gradient_clients_used)
        return delta, lr, metrics

    def on_round_end(self, trainer, pl_module, result) -> None:
        self._global_gradient = None  # free the model-sized vectors between rounds
        self._client_gradients = {}

    def __repr__(self) -> str:
        return (
            f"FedDANE(mu={self.mu}, gradient_clients={self.gradient_clients!r}, correction={self.correction}, "
            f"weighting={self.weighting!r})"
        )
