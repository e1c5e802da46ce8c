r"""The vectorised engine: :class:`VectorizedClientTrainer` trains a round's clients in lockstep as one batched
computation, with the same batches and results as sequential training (:mod:`fedlightning.vectorized`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.state import ClientUpdate, averaged_buffer_slices, derive_seed, loss_report_dtype, report_buffers

from .batches import _RoundBatches
from .call import _ClientTerms, _info, _ModelCall
from .layout import _Layout, _WeightsLayout
from .metrics import _replay
from .rules import StepRecord, make_batched_rule
from .step import _feed_router, _StepEvaluator
from .support import VectorizationUnsupportedError, check_model_vectorizable
from .torch_internals import _rng_state, _seed_default_generators, tree_flatten

__all__ = ["VectorizedClientTrainer"]


#: How a padded path pinned on resume announces itself (:meth:`VectorizedClientTrainer.pin_padded_path`)
_RESUMED = "as before the resume: "


class VectorizedClientTrainer:
    r"""Trains a list of clients in lockstep on the loop's working copy of the model.

    For every client ``i`` of the round it computes what :meth:`fedlightning.client.LocalTrainer.run` computes one
    client at a time: ``K`` local steps from the global weights ``w_t`` on the client's own mini-batches,

    .. math::
        w_i^{k+1} = w_i^k - \gamma_i^k\, d_i^k, \qquad k = 0, \dots, K-1, \qquad \Delta_i = w_t - w_i^K,

    with the direction ``d`` and step size ``γ`` of the client optimizer (SGD: ``γ = lr``, ``d = clip(∇f) + λw``;
    SgdArmijo: the largest ``η_0 β^m`` with ``f(w − ηg) ≤ f(w) − cη‖g‖²``; SPS / DecSPS: stochastic Polyak steps;
    see :mod:`fedlightning.optim` for the papers). The ``C`` clients' weights are one ``[C, D]`` tensor ``W``
    (:class:`~fedlightning.vectorized.layout._WeightsLayout`); every client's loss is the wrapped model's own
    ``training_step``, run under :func:`torch.func.vmap` over clients with the clients' parameter tensors in the
    modules' parameter slots (:class:`~fedlightning.vectorized.call._ModelCall`), and one reverse-mode pass over
    ``Σ_i f_i(w_i)`` gives all clients' gradients at once (the losses are independent, so block ``i`` of the
    gradient is ``∇f_i(w_i)``). Per round, the index matrices of all steps are built and the batch rows of all
    steps gathered at once (:class:`~fedlightning.vectorized.batches._RoundBatches`); per step, plain SGD updates
    every parameter's rows of ``W`` with its own gradient (no ``[C, D]`` gradient is assembled) and needs no host
    synchronisation.

    Decisions (ours):

    * **Randomness.** Sequential mode seeds each client with ``derive_seed(seed, "model", round, client_id)``;
      batched random ops cannot reproduce those streams, so a round seeds one forked generator with
      ``derive_seed(seed, "model-vectorized", round, *client_ids)`` and uses ``vmap(randomness="different")``:
      dropout masks are independent across clients and samples and reproducible, but not bit-for-bit those of
      sequential mode. Armijo trials restore the generator state of the gradient evaluation, so they see its
      dropout masks (as the sequential optimizers do). Equality with sequential mode holds for deterministic models
      and data: per-sample augmentation that draws from torch's global generator (CIFAR's random crops and flips)
      is reproducible in either mode but gives different crops in the two, since they consume the generator
      differently.
    * **Failures.** A client whose loss or update is non-finite is reported ``failed`` as sequentially (closure
      optimizers stop it at its first non-finite loss); the other clients are unaffected. A client whose batch
      holds one sample where a BatchNorm layer in training mode sees one value per channel gets, in place of its
      update, the ``ValueError`` torch raises for it in sequential training
      (:attr:`~fedlightning.vectorized.norms._NormLayers.singular`); from that step on its values are neither logged nor
      fed to metrics or running statistics, as a sequential client that raised there, and the loop's
      ``on_client_error`` policy treats it as it treats that client. Any other exception raised inside the
      batched computation concerns all clients together and is raised, not turned into per-client failures.
    * **Running statistics and metrics.** BatchNorm layers keep one row of running statistics per client, moved
      by the client's gradient evaluations only, and every client reports its own buffers in its update, as
      sequential training does (:mod:`fedlightning.vectorized.norms`). torchmetrics calls made in
      ``training_step`` at gradient evaluations are replayed after the last step, client after client
      (:mod:`fedlightning.vectorized.metrics`).
    * **Memory.** A round holds the ``[C, D]`` weights and gradients, the step's padded batches and, for SgdArmijo,
      the trial points of one trial round (reused :meth:`scratch` buffers); activations are those of ``C`` clients
      at once; with torchmetrics metrics, the arguments of the round's metric calls.

    Args:
        model: the working copy (``loop.client_worker.model``); its parameters are only read for names, shapes
            and dtype; the clients' weights live in one ``[C, D]`` tensor during a round.
        to_device: moves a batch to the model's device.
    """

    def __init__(self, model: nn.Module, to_device: Callable[[Any], Any] = lambda b: b):
        check_model_vectorizable(model)
        self.model = model
        self.to_device = to_device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise VectorizationUnsupportedError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' needs one dtype for all trainable parameters, got "
                f"{sorted(map(str, dtypes))}"
            )
        self.dtype = dtypes.pop()
        if self.dtype.is_complex:  # the batched rules, norms and finiteness checks are written for real weights
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' trains real parameters; {named[0][0]} is {self.dtype}. Use "
                "client_execution='sequential' (or 'auto')"
            )
        self.weights = _WeightsLayout([p for _, p in named])
        self.param_names = [n for n, _ in named]
        self.call = _ModelCall(model, named, self.dtype)
        self._scratch: dict[Any, Tensor] = {}
        self._filled: dict[Any, int] = {}  # key -> version of its buffer right after it was filled (scratch(fill=))
        self.layout_learned = False
        #: during a round: ``[C]`` bool of the clients that raised (None while none has), and their exceptions
        self.failed: Tensor | None = None
        # the line search's trial calls leave out the points no layer needs and the batch leaves only the trial-row
        # layers read (vectorized/trials.py) until a check finds something else reading them; each round checks its
        # first such call
        self.skip_line_points = True
        self.skip_line_leaves = True
        self.line_points_checked = False
        self.raised: dict[int, Exception] = {}
        self._told_plain_terms = False  # the one-line reason for terms without a batched form was given

    def fail_clients(self, rows: Tensor, singular: tuple[str, torch.Size]) -> None:
        """The clients ``rows`` ([C] bool) raise, at the current local step, what ``nn.BatchNorm*`` raises for their
        batch of one sample (``singular``: the layer and the input size it would get,
        :attr:`~fedlightning.vectorized.norms._NormLayers.singular`)."""
        new = rows if self.failed is None else rows & ~self.failed
        for c in new.nonzero().flatten().tolist():  # a host sync, on the rare steps that have such a client
            self.raised[c] = ValueError(
                f"Expected more than 1 value per channel when training, got input size {singular[1]}"
            )
        self.failed = rows if self.failed is None else self.failed | rows

    def release(self) -> None:
        """Drop the reusable buffers (:meth:`scratch`) and a round's per-client statistics, e.g. after a round ran
        out of memory (the next round allocates them again)."""
        self._scratch.clear()
        self._filled.clear()
        if self.call.norms:
            self.call.norms.stats = []

    @property
    def padded_path_state(self) -> dict[str, str] | None:
        """``{"per_sample": reason}`` once padded steps have left loss interception for the per-sample path (for the
        rest of the engine's life: a check that failed, a call interception could not run), else None; a resumed run
        gives it to :meth:`pin_padded_path` (the loop's checkpoint keeps it), since the two paths round differently in
        the last bits."""
        if self.call.intercept is False:
            return {"per_sample": self.call.padded_path_reason}
        return None

    def pin_padded_path(self, state: dict[str, str] | None) -> None:
        """Take the padded path :attr:`padded_path_state` recorded (None: choose it on the first padded step)."""
        if state is not None and isinstance(state.get("per_sample"), str):
            reason = state["per_sample"].removeprefix(_RESUMED) or "pinned"
            self.call.pin_per_sample(_RESUMED + reason)

    @property
    def deterministic(self) -> bool:
        """The model has no random layers (dropout): every evaluation of a point gives the same loss."""
        return self.call.deterministic

    def scratch(
        self, key: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device, fill: float | None = None
    ) -> Tensor:
        """A reusable buffer of ``shape`` for ``key`` (grown when needed). Multi-megabyte tensors allocated afresh
        in every trial round cost more in page faults than the work done in them; the engine reuses these.

        ``fill``: every element holds this value (one value per key): written when the buffer is allocated, and
        again whenever something wrote into it since (its version counter moved)."""
        numel = math.prod(shape)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, int(1.5 * buf.numel()) if buf is not None else 0), dtype=dtype, device=device)
            self._scratch[key] = buf
            self._filled.pop(key, None)
        if fill is not None and self._filled.get(key) != buf._version:
            buf.fill_(fill)
            self._filled[key] = buf._version
        return buf[:numel].view(*shape)

    def _probe_layout(self, start: Tensor, layout: _Layout, rng_devices: list) -> None:
        """One gradient evaluation at ``start`` (every client) on ``layout``, to learn the gradients' memory layout
        (:meth:`~fedlightning.vectorized.layout._WeightsLayout.learn`); done once per engine, on the first step of
        its first round (a resumed run probes again, on its first round), outside the round's random stream. Marked
        learned only once the evaluation succeeded: a probe that runs out of memory (a group then halved) is made
        again by the next call."""
        W = start.unsqueeze(0).repeat(layout.num_clients, 1)
        ev = _StepEvaluator(self, layout, 0, None, rng_devices, None, trials=False)
        ev.learn_layout = True
        ev.keep_effects = False
        before = _rng_state(rng_devices)
        try:
            ev.gradient(W, torch.ones(layout.num_clients, dtype=torch.bool, device=W.device), flat=False)
        except torch.cuda.OutOfMemoryError:
            raise  # a group that does not fit: halved by the caller
        except (RuntimeError, NotImplementedError) as err:
            # the forward pass's errors are named by layer (rows._TracedRows); this is the backward pass under vmap
            # (an op without a batching rule, activation checkpointing): the clients cannot run in lockstep, and
            # "auto" trains them sequentially (where an error of the model itself shows as it is)
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' failed in the first gradient evaluation of the clients under "
                f"torch.func.vmap: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Use "
                "client_execution='sequential' (or 'auto' to fall back automatically); an error of the data or the "
                "model itself then names the client whose batch raises it"
            ) from err
        if self.call.deterministic and not _same_rng_state(before, _rng_state(rng_devices)):
            # random draws outside dropout layers (F.dropout, torch.randn_like noise): the model is random after all
            self.call.deterministic = False
            _info(
                f"client_execution='vectorized': {type(self.call.model).__name__}.training_step draws random numbers "
                "(torch's generator moved during its first batched call): its clients draw other numbers than "
                "sequential training's, as with dropout layers"
            )
        self.layout_learned = True

    # ---------------------------------------------------------------- full gradients at the global weights
    def full_gradients(
        self,
        client_batches: Sequence[Sequence[tuple[int, Any]]],
        global_params: Sequence[Tensor],
        global_buffers: Sequence[Tensor],
        seed: int,
    ) -> Tensor:
        r"""``[C, D]``: row ``i`` the gradient at the global weights of client ``i``'s mean loss over all the
        samples of ``client_batches[i]`` (its ``(size, batch)`` chunks on the host, as
        :func:`fedlightning.callbacks.feddane.client_full_batches` yields them), in the parameters' own order
        (``flat_params``): what ``client_full_gradient`` computes client by client,
        ``Σ_chunks (size / n_i) ∇ training_step(chunk)``.

        Decisions (ours): every chunk is one row of a vmapped ``training_step`` at the global weights (rows padded
        to the largest chunk by repeating their own samples, masked out of the loss, as local steps are), and the
        rows of one client share its weights, so one backward pass sums its chunks' gradients. Rows are evaluated
        ``C`` at a time: the activations of ``C`` chunks at once (with ``batch_size`` None, ``C`` clients' whole
        data). BatchNorm layers use each chunk's batch statistics, as sequentially (a chunk of one sample raises the
        ``ValueError`` torch raises for it); running statistics, metric calls and logged values are dropped (the
        working copy's buffers are reset before every client trains). Random layers draw from one forked generator
        seeded with ``seed`` (not the per-client streams of sequential mode, as for local steps). Raises
        :class:`VectorizationUnsupportedError` for batches that cannot be stacked.
        """
        C = len(client_batches)
        rows = [(c, size, batch) for c, chunks in enumerate(client_batches) for size, batch in chunks]
        totals = [sum(size for size, _ in chunks) for chunks in client_batches]

        def groups():
            for first in range(0, len(rows), C):
                group = rows[first : first + C]
                leaves, spec, sizes = _stack_rows([self.to_device(b) for _, _, b in group], [s for _, s, _ in group])
                yield leaves, spec, sizes, [c for c, _, _ in group]

        return self._full_gradients(groups(), totals, global_params, global_buffers, seed)

    def full_gradients_of_rows(
        self,
        batch: Any,
        sizes: Sequence[int],
        row_clients: Sequence[int],
        totals: Sequence[int],
        global_params: Sequence[Tensor],
        global_buffers: Sequence[Tensor],
        seed: int,
    ) -> Tensor:
        """:meth:`full_gradients` from rows already stacked on the host: ``batch`` a batch structure whose tensor
        leaves are ``[R, n_max, ...]`` (row ``r`` a chunk of ``sizes[r]`` samples of client ``row_clients[r]``,
        padded by repeating its own samples), ``totals[i]`` client ``i``'s number of samples. The rows are moved
        (and converted) as one batch and evaluated ``C`` at a time."""
        leaves, spec = tree_flatten(self.to_device(batch))
        C, R = len(totals), len(sizes)

        def groups():
            for first in range(0, R, C):
                part = slice(first, first + C)
                n = max(sizes[part])
                yield [x[part, :n] for x in leaves], spec, list(sizes[part]), list(row_clients[part])

        return self._full_gradients(groups(), totals, global_params, global_buffers, seed)

    def _full_gradients(self, groups, totals, global_params, global_buffers, seed: int) -> Tensor:
        """The vmapped full-batch gradients of :meth:`full_gradients` over ``groups`` of rows ``(leaves, spec,
        sizes, row clients)``."""
        C = len(totals)
        if any(n <= 0 for n in totals):
            raise ValueError(f"every client needs samples for a full gradient, got sample counts {list(totals)}")
        with torch.no_grad():
            start = torch.cat([p.detach().reshape(-1).to(self.dtype) for p in global_params])
        device = start.device
        W = self.weights.stored(start).unsqueeze(0).repeat(C, 1)
        leaves = [v.detach().requires_grad_(True) for v in self.weights.views(W)]
        grads: list[Tensor | None] = [None] * len(leaves)
        rng_devices = [device] if device.type == "cuda" else []
        was_training = self.model.training
        self.model.train()
        norms = self.call.norms
        try:
            with torch.random.fork_rng(devices=rng_devices):
                _seed_default_generators(seed, rng_devices)
                for rows, spec, sizes, row_clients in groups:
                    layout = _Layout(rows, spec, sizes)
                    clients = torch.tensor(row_clients, dtype=torch.long, device=device)
                    share = torch.tensor([1.0 / totals[c] for c in row_clients], dtype=self.dtype, device=device)
                    identity = len(row_clients) == C and all(c == i for i, c in enumerate(row_clients))
                    views = leaves if identity else [v.index_select(0, clients) for v in leaves]
                    if norms:
                        norms.start(global_buffers, len(row_clients))
                        norms.singular = None
                    with torch.enable_grad():
                        if layout.mask is None:
                            losses, _ = self.call.row_values(views, layout.batch, None, 0)
                            real = torch.tensor(layout.sizes, dtype=self.dtype, device=device)
                            root, weight = losses, share * real  # chunk mean × size / n_i
                        else:
                            root, _, _ = self.call.row_values(
                                views, layout.batch, layout.mask, 0, cells=True, min_count=layout.min_size
                            )
                            weight = layout.mask.to(self.dtype) * share[:, None]  # each real sample: 1 / n_i
                        parts = torch.autograd.grad(
                            [root], leaves, grad_outputs=[weight.to(root.dtype)], allow_unused=True
                        )
                    if norms and norms.singular is not None:  # what torch raises for that chunk sequentially
                        raise ValueError(
                            f"Expected more than 1 value per channel when training, got input size {norms.singular[1]}"
                        )
                    grads = [g if p is None else (p if g is None else g + p) for g, p in zip(grads, parts)]
        finally:
            if norms:
                norms.stats = []
                norms.begin([])  # no call's (batched) mask or counts stay behind
            self.call.collector.reset()  # nor the (batched) values training_step logged
            self.model.train(was_training)
        return torch.cat(
            [(torch.zeros_like(v) if g is None else g).reshape(C, -1) for g, v in zip(grads, leaves)], dim=1
        ).detach()

    # ---------------------------------------------------------------- one round
    def run(
        self,
        client_ids: Sequence[int],
        round: int,
        seed: int,
        global_params: Sequence[Tensor],
        global_buffers: Sequence[Tensor],
        global_flat: Tensor,
        datamodule,
        optimizers: Sequence[torch.optim.Optimizer],
        local_steps: int | Sequence[int],
        grad_clip: float | None = None,
        terms: Sequence[Sequence[Callable[[Sequence[Tensor]], Tensor]]] | None = None,
        router=None,
        with_buffers: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> list[ClientUpdate | Exception] | None:
        """Train ``client_ids`` for ``local_steps`` steps from the global weights (one count for every client, or
        one per client: ragged counts, see below); one :class:`ClientUpdate` per client, in order, with the same fields
        as ``LocalTrainer.run``, or, for a client whose training raised (see *Failures* above), the exception sequential
        training raises for it.

        ``stop``: asked after every local step but the last; when it answers True the round ends there and ``run``
        returns None (``auto``'s timed throw-away round, which stops once vectorized can no longer win; the
        optimizers' per-client state and the model's metrics are then left as the steps made them).

        **Ragged step counts** (``local_steps`` a sequence, e.g. ``FederatedLoop(local_epochs=...)``): the round runs
        ``K = max_i K_i`` lockstep steps; at step ``k`` the clients with ``K_i <= k`` are masked as a client that
        stopped is (the rule's ``alive`` mask: closure optimizers leave their weights and state unchanged; their
        losses, logged values, metric calls and running statistics are not recorded), and every client's weights
        are taken as they were after its own last step ``K_i - 1`` (a copy of its row at that step; rules that
        update every row, SGD and Adam, may move a finished row afterwards, which the copy undoes). Each client's
        result is then the one of ``K_i`` steps, as sequentially; the masked steps still cost their share of the
        batched computation (ours: a round costs what ``K`` steps of every client cost).

        ``terms``: each client's client-objective terms (``client_objective``); the
        :class:`~fedlightning.objectives.AnchoredTerm` ones are stacked over the clients of this call and their
        gradients added in closed form, any other callable is evaluated client by client at every step, with a
        one-time log line saying so (:class:`~fedlightning.vectorized.call._ClientTerms`).

        ``optimizers`` are the clients' optimizer instances as the loop builds them (client state already set);
        after the round their per-client state holds what sequential training would have left in them, so
        ``get_client_state()`` / ``client_report()`` can be called on them. The model's torchmetrics metrics are
        updated as sequential training updates them; values logged from them go to ``router``.
        """
        client_ids = [int(c) for c in client_ids]
        C = len(client_ids)
        if C == 0:
            return []
        per_client = [local_steps] * C if not isinstance(local_steps, (list, tuple)) else list(local_steps)
        if len(per_client) != C:
            raise ValueError(f"got {len(per_client)} local step counts for {C} clients")
        for n in per_client:
            if isinstance(n, bool) or int(n) != n or int(n) < 1:
                raise ValueError(f"local_steps must be an integer >= 1, got {n!r}")
        per_client = [int(n) for n in per_client]
        K = max(per_client)
        if len(optimizers) != C:
            raise ValueError(f"got {len(optimizers)} optimizers for {C} clients")
        device = global_flat.device
        params = [p for p in self.model.parameters() if p.requires_grad]
        rule = make_batched_rule(optimizers, params, grad_clip, device)
        if terms is not None and len(terms) != C:
            raise ValueError(f"got objective terms for {len(terms)} clients, expected {C}")
        if not self.model.training:  # as train_client: layers the module put in eval mode stay there
            self.model.train()
        norms = self.call.norms
        if norms:
            norms.start(global_buffers, C)
        self.failed, self.raised = None, {}
        self.line_points_checked = False
        self.call.recheck_padded = True  # the padded path's check, again on this round's first padded step

        with torch.no_grad():
            start = torch.cat([p.detach().reshape(-1).to(self.dtype) for p in global_params])
        record = StepRecord(C, device)
        alive = torch.ones(C, dtype=torch.bool, device=device)
        num_steps = torch.zeros(C, dtype=torch.long, device=device)
        batches = _RoundBatches(datamodule, client_ids, round, seed, K, self.to_device)
        ragged = _RaggedSteps(per_client, device)
        rng_devices = [device] if device.type == "cuda" else []
        log_sink: list | None = [] if router is not None else None
        metric_sink: list | None = [] if self.call.metric_calls else None

        layouts: dict = {}
        with torch.random.fork_rng(devices=rng_devices):
            if not self.layout_learned:  # before the round's seeding: its random draws do not count
                self._probe_layout(start, _Layout(*batches.step(0)), rng_devices)
            W = self.weights.stored(start).expand(C, -1).contiguous()  # [C, D]: client c's weights in row c
            # the terms in the weights' storage order, which the probe above has fixed
            client_terms = None
            if terms is not None and any(terms):
                client_terms = _ClientTerms(terms, self.weights, self.dtype, device)
                if client_terms.plain is not None and not self._told_plain_terms:
                    self._told_plain_terms = True
                    _info(client_terms.plain_reason())
            model_seed = derive_seed(seed, "model-vectorized", round, *client_ids)
            _seed_default_generators(model_seed, rng_devices)  # the generators this round uses, and only them
            for k in range(K):
                layout = _Layout(*batches.step(k), cache=layouts)
                ev = _StepEvaluator(
                    self,
                    layout,
                    k,
                    client_terms,
                    rng_devices,
                    log_sink,
                    trials=rule.uses_trials,
                    metric_sink=metric_sink,
                )
                ev.missing_gradients = rule.check_missing_gradients  # parameters the loss does not reach
                training = ragged.training(k, alive)  # alive, less the clients whose own steps are done
                ev.track_alive = rule.stops_on_nonfinite or training is not alive  # else every client trains
                try:
                    rule.step(W, ev, record, training)
                except RuntimeError as err:
                    if isinstance(err, torch.cuda.OutOfMemoryError) or not _raised_by_vmap(err):
                        raise
                    raise VectorizationUnsupportedError(
                        f"client_execution='vectorized' failed at local step {k} of round {round} under "
                        f"torch.func.vmap: {str(err).splitlines()[0]} (training_step did something it had not done "
                        "in the earlier batched calls). Use client_execution='sequential' (or 'auto', which trains "
                        "this round and the rest sequentially)"
                    ) from err
                num_steps += training.long()
                ragged.keep_finished(k, W)
                if rule.stops_on_nonfinite:
                    alive = alive & torch.isfinite(record.losses[-1])
                if self.failed is not None:
                    alive = alive & ~self.failed
                if stop is not None and k + 1 < K and stop():
                    norms.stats = []
                    norms.begin([])
                    return None
            ragged.restore(W)
        rule.finalize(optimizers)
        try:
            updates = self._updates(
                client_ids, W, global_flat, datamodule, record, num_steps, global_buffers, with_buffers
            )
        finally:
            norms.stats = []
            norms.begin([])  # the last call's mask and counts (vmapped tensors) do not outlive the round
        if log_sink:
            _feed_router(router, log_sink, client_ids)
        if router is not None:  # how the names are logged (reduce_fx, prog_bar, logger), as sequential training
            for name, options in self.call.collector.options.items():
                router.note_options(name, options)
        if metric_sink:  # a client the round leaves out (failed, raised) updates no metric, as sequentially
            failed = frozenset(c for c, u in enumerate(updates) if isinstance(u, Exception) or u.failed)
            _replay(self.call.metric_modules, metric_sink, C, router, client_ids=client_ids, skip=failed)
        return updates

    def _updates(
        self,
        client_ids,
        W,
        global_flat,
        datamodule,
        record: StepRecord,
        num_steps: Tensor,
        global_buffers,
        with_buffers,
    ) -> list[ClientUpdate | Exception]:
        K = len(record.losses)
        losses = torch.stack(record.losses)  # [K, C]
        losses = losses.to(device="cpu", dtype=loss_report_dtype(losses))
        step_sizes = record.step_size_rows()  # [C][K]
        # rules without per-client counts (SGD, Adam) evaluate every client at every step; a client is counted for
        # the steps it trained (fewer with ragged step counts, or when it raised)
        u = num_steps.clamp(max=record.uniform_evaluations)
        backtracks, forwards, backwards = record.totals()
        counts = torch.stack([num_steps, backtracks, forwards + u, backwards + u]).cpu().tolist()
        logical = self.weights.logical(W)
        if logical is not W and logical.dtype == global_flat.dtype:  # a copy of W's own: Δ = start − w in place
            delta = torch.sub(global_flat, logical, out=logical)
        else:
            delta = global_flat.unsqueeze(0) - logical.to(global_flat.dtype)
        finite_delta = _rows_finite(delta).cpu().tolist()
        rows = delta.unbind(0)
        buffers = None
        if with_buffers and averaged_buffer_slices(global_buffers):
            # every client's averaged buffers, as LocalTrainer.run reports them: its running statistics, and the
            # global value of buffers that client training does not change
            norms = self.call.norms
            if norms.stats:
                buffers = norms.client_buffers(global_buffers, len(client_ids)).unbind(0)
            else:
                buffers = [report_buffers(global_buffers)] * len(client_ids)
        # clients that ran all K steps (the usual case): first loss, mean loss and finiteness of all at once
        by_client = losses.t().contiguous()  # [C, K]
        first_all = by_client[:, 0].tolist() if K else []
        mean_all = by_client.mean(dim=1).tolist()
        finite_all = torch.isfinite(by_client).all(dim=1).tolist()
        updates = []
        for c, cid in enumerate(client_ids):
            if c in self.raised:
                updates.append(self.raised[c])
                continue
            n = int(counts[0][c])
            if n == K and K > 0:
                first_loss, mean_loss, finite_loss = first_all[c], mean_all[c], finite_all[c]
            else:
                loss_vec = by_client[c, :n] if n > 0 else torch.tensor([float("nan")])
                first_loss, mean_loss = float(loss_vec[0]), float(loss_vec.mean())
                finite_loss = bool(torch.isfinite(loss_vec).all())
            update = ClientUpdate(
                client_id=cid,
                delta=rows[c],
                num_samples=datamodule.client_num_samples(cid),
                num_steps=n,
                first_loss=first_loss,
                mean_loss=mean_loss,
                step_sizes=step_sizes[c][: min(n, K)],
                backtracks=int(counts[1][c]),
                forwards=int(counts[2][c]),
                backwards=int(counts[3][c]),
            )
            if buffers is not None:
                update.buffers = buffers[c].clone()
            if not finite_loss:
                update.failed, update.failure = True, "non-finite training loss"
            elif not finite_delta[c]:
                update.failed, update.failure = True, "non-finite model update"
            updates.append(update)
        return updates


class _RaggedSteps:
    """The masking of a round whose clients run different numbers of local steps ``K_i`` (see
    :meth:`VectorizedClientTrainer.run`); with one count for all clients every method is a no-op."""

    def __init__(self, steps: Sequence[int], device: torch.device):
        self.steps = list(steps)
        self.uniform = len(set(self.steps)) <= 1
        self.K = max(self.steps) if self.steps else 0
        self.kept: list[tuple[Tensor, Tensor]] = []  # (rows, their weights after their last step)
        self._steps_t = None if self.uniform else torch.tensor(self.steps, device=device)
        self._device = device

    def training(self, k: int, alive: Tensor) -> Tensor:
        """``alive`` itself while every client still has steps (``k < min K_i``), else ``alive & (K_i > k)``."""
        if self.uniform or k < min(self.steps):
            return alive
        return alive & (self._steps_t > k)

    def keep_finished(self, k: int, W: Tensor) -> None:
        """Copy the rows of the clients whose last step was ``k`` (before the round's last step)."""
        if self.uniform or k + 1 >= self.K:
            return
        rows = [c for c, n in enumerate(self.steps) if n == k + 1]
        if rows:
            index = torch.tensor(rows, device=self._device)
            self.kept.append((index, W.index_select(0, index)))

    def restore(self, W: Tensor) -> None:
        """Put every finished client's kept row back into ``W``."""
        for index, rows in self.kept:
            W.index_copy_(0, index, rows)
        self.kept = []


def _raised_by_vmap(err: RuntimeError) -> bool:
    """Whether ``err`` is torch.func.vmap's refusal of an operation it cannot batch (``.item()``, data-dependent
    control flow, an in-place write into an unbatched tensor: messages that start with ``"vmap:"``, or a missing
    batching rule), not an error of the model or the data, which sequential training would raise too."""
    message = str(err)
    return message.startswith("vmap:") or "Batching rule not implemented" in message


def _rows_finite(x: Tensor) -> Tensor:
    """``torch.isfinite(x).all(dim=1)`` for a 2-d ``x``: every entry of a row is finite iff the row's largest and
    smallest entries are (NaN propagates through both reductions); cheaper than ``isfinite`` over ``[C, D]`` on
    CPU (docs/benchmarks.md §3)."""
    return torch.isfinite(x.amax(dim=1)) & torch.isfinite(x.amin(dim=1))


def _stack_rows(batches: Sequence[Any], sizes: Sequence[int]) -> tuple[list[Tensor], Any, list[int]]:
    """``(leaves, spec, sizes)`` of :class:`~fedlightning.vectorized.layout._Layout` from whole batches of
    ``sizes`` samples: each tensor leaf stacked over the batches ``[R, n_max, ...]``, a shorter batch padded by
    repeating its own samples (as :class:`~fedlightning.vectorized.batches._RoundBatches` pads a step's batches).
    Raises :class:`VectorizationUnsupportedError` for batches that differ in structure or in a non-batch
    dimension, or whose leaves are not tensors of ``size`` rows."""
    n_max = max(sizes)
    flat = [tree_flatten(b) for b in batches]
    spec = flat[0][1]
    out: list[list[Tensor]] = [[] for _ in flat[0][0]]
    for (leaves, sp), n in zip(flat, sizes):
        if sp != spec:
            raise VectorizationUnsupportedError("the clients' full batches differ in structure; they cannot be stacked")
        position = torch.arange(n_max) % n
        for j, x in enumerate(leaves):
            if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[0] != n:
                raise VectorizationUnsupportedError(
                    f"leaf {j} of a client's full batch is not a tensor of its {n} samples "
                    f"({type(x).__name__}); its full gradient is computed client by client"
                )
            if out[j] and (x.shape[1:] != out[j][0].shape[1:] or x.dtype != out[j][0].dtype):
                raise VectorizationUnsupportedError(
                    f"leaf {j} of the clients' full batches has shape {tuple(x.shape)} ({x.dtype}) for one client and "
                    f"{tuple(out[j][0].shape)} ({out[j][0].dtype}) for another; only the batch dimension is padded"
                )
            out[j].append(x if n == n_max else x.index_select(0, position.to(x.device)))
    return [torch.stack(parts) for parts in out], spec, list(sizes)


def _same_rng_state(a: tuple[Tensor, list[Tensor]], b: tuple[Tensor, list[Tensor]]) -> bool:
    """Equal generator states (:func:`~fedlightning.vectorized.torch_internals._rng_state`: the CPU's and the
    devices')."""
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
