r"""Vectorised clients: the round's clients train in lockstep as one batched computation.

For every client ``i`` of the round, :class:`VectorizedClientTrainer` computes what
:meth:`fedlightning.client.LocalTrainer.run` computes one client at a time: ``K`` local steps from the global
weights ``w_t`` on the client's own mini-batches,

.. math::
    w_i^{k+1} = w_i^k - \gamma_i^k\, d_i^k, \qquad k = 0, \dots, K-1, \qquad \Delta_i = w_t - w_i^K,

with the direction ``d`` and step size ``γ`` of the client optimizer (SGD: ``γ = lr``, ``d = clip(∇f) + λw``;
SgdArmijo: the largest ``η_0 β^m`` with ``f(w − ηg) ≤ f(w) − cη‖g‖²``; SPS / DecSPS: stochastic Polyak steps; see
:mod:`fedlightning.optim` for the papers). The ``C`` clients' weights are one ``[C, D]`` tensor; every client's loss
is the wrapped model's own ``training_step``, run under :func:`torch.func.vmap` over clients with the clients'
parameter tensors in the modules' parameter slots (what :func:`torch.func.functional_call` does, without its
per-call name resolution), and one reverse-mode pass over ``Σ_i f_i(w_i)`` gives all clients' gradients at once
(the losses are independent, so block ``i`` of the gradient is ``∇f_i(w_i)``). Step sizes, Armijo tests and Polyak
ratios are ``[C]`` tensors: no Python loop over clients inside a step. Per round, the index matrices of all steps
are built and the batch rows of all steps gathered at once; per step, plain SGD updates every parameter's rows of
``W`` with its own gradient (no ``[C, D]`` gradient is assembled) and needs no host synchronisation.

Where the time goes (CPU, small models; docs/benchmarks.md §3 has the numbers) and what the engine does
about it:

* **Memory order of W.** Each parameter's block of ``W`` is stored in the memory order its gradient comes out of
  the backward pass in (learned once per engine from one gradient evaluation,
  ``VectorizedClientTrainer._learn_layout``): ``linear`` with per-client weights gives weight gradients
  transposed, and adding a transposed gradient to a row-major block (the SGD update, the ``[C, D]`` gradient of
  the line search) was a transposing copy that cost as much as the rest of the update. ``_views`` gives the
  parameters' logical ``[C, *shape]`` views; every ``[R, D]`` tensor of the engine (weights, flat gradients, trial
  points) is in storage order, and only the round's start weights and the deltas are converted. Values and ops
  are unchanged.
* **Outside vmap where possible.** On padded steps the vmapped function returns every cell's value and the
  masked per-client sums are taken after vmap (the same ops without batching rules); the per-sample
  ``unsqueeze`` is a view taken before vmap; logged values leave vmap as they are and are detached, reshaped and
  cast outside; their division by the sample counts and the mask of clients still training are applied once per
  round (:func:`_feed_router`).
* **Host work per round.** The data draw keeps one ``randperm`` call per client and epoch (the sampler's own
  generator, hence the same batches as sequential mode) and builds everything else for all clients and steps with
  a few numpy ops (:func:`_round_index`); the finiteness of the deltas is one ``amax``/``amin`` per row instead of
  ``isfinite`` over ``[C, D]`` (10x slower on CPU).
* **vmap's own cost.** The batched calls go through :func:`_vmap0`, which drives functorch's primitives as
  ``torch.func.vmap`` does but without its per-call pytree walks; padded steps start the backward pass from the
  weighted per-sample losses (the same gradient, fewer autograd nodes).
* **SgdArmijo trial points** are written once per trial round on CPU (one ``addcmul`` per client's block of grid
  points, the client's rows of ``W`` and ``g`` broadcast) instead of gathering both rows first
  (:meth:`_BatchedArmijo._points`); the search itself is unchanged.

Decisions (ours; the task leaves them open):

* **Same data as sequential.** Client ``i`` draws its batches from
  ``datamodule.client_dataloader(i, round, seed=loop.seed)`` in the same order, cycling to a new shuffled epoch
  when the loader runs out (as ``LocalTrainer.run``). For the in-memory ``ArrayBatchLoader`` the index lists are
  read from the loader's own batch sampler and a step's rows of all clients are gathered with one indexing op per
  tensor; other loaders are iterated as they are.
* **Unequal batch sizes** (fewer samples than the batch size, partial last batches). When a step's batches
  differ in size, each is padded to the largest by repeating its own samples, every sample is one
  ``training_step`` call on a batch of one (an inner vmap), and a client's loss is the sum of its real samples'
  losses over their number. This is the batch loss for any loss that is a mean over samples (cross-entropy, MSE:
  every reference model); a loss that is not (e.g. weighting tokens with ``ignore_index``) is averaged per sample
  instead. When all batches of a step have the same size, ``training_step`` sees each client's whole batch,
  exactly as sequentially. (Cutting large clients into several rows to pad less was measured slower on CPU.)
  Padded steps take the first of these paths that applies: the model's per-sample protocol (below); per-sample
  loss interception; the generic path (one ``training_step`` call per sample, an inner vmap).
* **Per-sample loss interception** (ours; :mod:`fedlightning.vectorized_losses`). For a model without the
  protocol, ``training_step`` is called once per client row on the whole padded batch while a
  ``TorchFunctionMode`` replaces the standard losses with ``reduction="mean"`` (``F.cross_entropy``,
  ``F.nll_loss``, ``F.mse_loss``, ``F.l1_loss``, ``F.smooth_l1_loss``, ``F.huber_loss``,
  ``F.binary_cross_entropy[_with_logits]`` and the ``nn`` modules that call them) by their mean over the real
  samples, computed per sample with ops that have batching rules. It applies while ``training_step`` returns such
  a loss and logs only such losses or client-independent constants, and, for models without random layers, after
  a once-per-engine check against ``training_step`` on a client's real samples alone (a loss that is not a mean of
  per-sample losses fails it); otherwise the engine uses the generic path from then on, with the random state
  of the failed attempt restored, and says why in a rank-zero info line
  (:meth:`VectorizedClientTrainer._intercepted_row_values`). A user-written digits MLP then trains as fast as the
  bundled one (docs/benchmarks.md §3).
* **Per-sample protocol** (optional, ours). A model may define ``training_step_per_sample(batch, batch_idx)``
  returning ``[n]`` losses, entry ``j`` being ``training_step``'s loss on sample ``j`` alone (values it logs are
  ``[n]`` tensors, averaged over real samples). Padded steps then make one batched call per row instead of the
  inner vmap: the same numbers, an SGD round of the digits MLP 1.25-1.29x faster (docs/benchmarks.md §3).
  The reference models (:class:`fedlightning.models.Classifier`) define it. It is used only when defined on the
  class that defines ``training_step`` or below it (a subclass that overrides only ``training_step`` keeps the
  generic path), and, for models without random layers, checked once per engine against ``training_step`` on
  single samples (``ValueError`` naming both values if they differ).
* **Masked backtracking** (SgdArmijo): each client walks its own grid and stops at its own first accepted point;
  the result is the sequential search's point by point (see :class:`_BatchedArmijo` for how trials are batched).
  Zero-gradient, exhausted-search, non-finite and persistence policies, telemetry and ``get_client_state`` are the
  optimizer's own: the engine reads each client's optimizer instance (built by the loop, client state set) and
  writes the final per-client state back into it, so ``get_client_state()`` / ``client_report()`` answer exactly as
  after sequential training.
* **Randomness.** Sequential mode seeds each client with ``derive_seed(seed, "model", round, client_id)``;
  batched random ops cannot reproduce those streams, so vectorised mode seeds one forked generator with
  ``derive_seed(seed, "model-vectorized", round, *client_ids)`` and uses ``vmap(randomness="different")``: dropout
  masks are independent across clients and samples and reproducible, but not bit-for-bit those of sequential
  mode. Armijo trials restore the generator state of the gradient evaluation, so they see its dropout masks (as the
  sequential optimizers do). Equality with sequential mode holds for deterministic models and data: per-sample
  augmentation that draws from torch's global generator (CIFAR's random crops and flips) is reproducible in either
  mode but gives different crops in the two, since they consume the generator differently.
* **Recurrent layers.** ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` have no vmap batching rule; inside the batched call
  they run through :func:`_rnn_forward` (the same equations in plain tensor ops). On CPU this is slower than the
  fused kernels sequential mode uses (see docs/benchmarks.md §3).
* **Unsupported** (:class:`VectorizationUnsupportedError`, naming the layer or setting): batch-statistics layers
  (every ``BatchNorm``; ``InstanceNorm`` with running statistics), layers ``vmap`` cannot run (found by the first
  batched call and reported with the module that was executing), RNNs with ``proj_size``, parameters of mixed
  dtypes, batches with non-tensor leaves, and client optimizers other than ``torch.optim.SGD`` without momentum /
  Nesterov / ``maximize`` (``weight_decay`` and the loop's gradient clipping are supported) and SgdArmijo, SPS and
  DecSPS; different settings per parameter group. ``client_execution="auto"`` falls back to sequential mode with a
  one-time warning instead.
* **auto** (ours, :func:`_auto_decide`): at its first round, ``client_execution="auto"`` times one throw-away round
  of the round's clients both ways and trains vectorised only if that is faster by :data:`AUTO_MARGIN`; models
  with random layers train sequentially (their dropout masks would depend on the choice). The choice and both
  timings are logged once; the measurement changes no result.
* **Client objective terms** (``client_objective`` hooks, e.g. FedProx's proximal term) are supported: each term is
  called on the list of its client's parameter tensors (slices of the batched weights), so its gradient flows
  through the same backward pass (one Python call per client and term per evaluation).
* **Failures.** A client whose loss or update is non-finite is reported ``failed`` as sequentially (closure
  optimizers stop it at its first non-finite loss); the other clients are unaffected. An exception raised inside
  the batched computation concerns all clients together and is raised, not turned into per-client failures.
* **Logged values.** ``self.log`` calls inside ``training_step`` are captured per client (per sample and averaged
  over real samples on padded steps) at every gradient evaluation and fed to the loop's log router, so
  ``client/<name>`` metrics are the per-round means of sequential mode (trial evaluations are not logged, as
  sequentially).
* **Storage order.** The learned order of ``W``'s blocks can change the summation order of reductions over a
  parameter (gradient norms for clipping and the Armijo/Polyak tests), i.e. rounding in the last bits; the
  probe runs once per engine, on the first step of its first round (a resumed run probes again, on its first
  round), outside the round's random stream.
* **Memory.** A round holds the ``[C, D]`` weights and gradients, the step's padded batches and, for SgdArmijo, the
  trial points of one trial round (reused buffers); activations are those of ``C`` clients at once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from fedlightning.client import extract_loss

try:  # functorch's own primitives, which torch.func.vmap drives (see _vmap0)
    from torch._C._functorch import _add_batch_dim, _remove_batch_dim, _vmap_decrement_nesting, _vmap_increment_nesting
except ImportError:  # pragma: no cover - a torch without them: the public vmap is used
    _add_batch_dim = None
try:
    from torch._C._functorch import is_batchedtensor as _is_batchedtensor
except ImportError:  # pragma: no cover - every logged value then counts as client-dependent
    _is_batchedtensor = None
from fedlightning.state import ClientUpdate, RoundPlan, derive_seed
from fedlightning.vectorized_losses import LossInterception

__all__ = [
    "CLIENT_EXECUTION_MODES",
    "VectorizationUnsupportedError",
    "VectorizedClientTrainer",
    "auto_choice",
    "check_model_vectorizable",
    "run_vectorized_round",
]

#: Values of ``FederatedLoop(client_execution=...)``.
CLIENT_EXECUTION_MODES = ("sequential", "vectorized", "auto")


class VectorizationUnsupportedError(ValueError):
    """The model, optimizer or data cannot be trained with ``client_execution="vectorized"``."""


# ====================================================================== model checks
def check_model_vectorizable(model: nn.Module) -> None:
    """Raise :class:`VectorizationUnsupportedError` naming the first layer that keeps batch statistics.

    ``BatchNorm`` normalises with statistics of the whole mini-batch (which padded rows would change) and updates
    running statistics in place (which ``vmap`` cannot do on a buffer shared by all clients); ``InstanceNorm`` is
    per-sample and only refused when it tracks running statistics. GroupNorm / LayerNorm are fine.
    """
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    for name, module in model.named_modules():
        label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
        if isinstance(module, _BatchNorm):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: batch-statistics layers (BatchNorm) "
                "depend on the whole mini-batch and update running statistics in place; use GroupNorm/LayerNorm, "
                "or client_execution='sequential' (or 'auto' to fall back automatically)"
            )
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: it updates running statistics in "
                "place (track_running_stats=True); use client_execution='sequential' or 'auto'"
            )


def _rnn_forward(module: nn.RNNBase, input: Tensor, hx: Optional[Any] = None):
    r"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` forward written with plain tensor ops, which ``vmap`` can batch
    (the fused ``aten::lstm`` / ``gru`` / ``rnn`` kernels have no batching rule).

    The gate equations are PyTorch's (gate order LSTM ``i, f, g, o``; GRU ``r, z, n``):

    .. math::
        \text{LSTM: } c' = \sigma(f) c + \sigma(i)\tanh(g),\ h' = \sigma(o)\tanh(c'); \qquad
        \text{GRU: } n = \tanh(W_{in}x + b_{in} + \sigma(r)(W_{hn}h + b_{hn})),\ h' = (1-\sigma(z)) n + \sigma(z) h

    with ``[i|f|g|o] = W_{ih}x + b_{ih} + W_{hh}h + b_{hh}``. Supports ``num_layers``, ``bias``, ``batch_first``,
    ``bidirectional``, inter-layer ``dropout`` (training mode) and unbatched 2-d inputs, as the module does; the input
    projections of all time steps are one matmul per layer and direction, the recurrence a loop over time.
    """
    if not isinstance(input, Tensor):
        raise VectorizationUnsupportedError(f"{type(module).__name__}: packed sequences cannot be vectorised")
    mode = module.mode
    unbatched = input.dim() == 2
    x = input.unsqueeze(1 if not module.batch_first else 0) if unbatched else input
    if not module.batch_first:
        x = x.transpose(0, 1)  # [B, T, F]
    B, T = x.shape[0], x.shape[1]
    H, L = module.hidden_size, module.num_layers
    D = 2 if module.bidirectional else 1
    if hx is None:
        h0 = x.new_zeros(L * D, B, H)
        c0 = x.new_zeros(L * D, B, H) if mode == "LSTM" else None
    else:
        h0, c0 = (hx if mode == "LSTM" else (hx, None))
        if unbatched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
    act = torch.tanh if mode in ("LSTM", "GRU", "RNN_TANH") else torch.relu
    h_n, c_n = [], []
    layer_in = x
    for layer in range(L):
        outs = []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
            b_ih = getattr(module, "bias_ih" + sfx) if module.bias else None
            b_hh = getattr(module, "bias_hh" + sfx) if module.bias else None
            seq = layer_in.flip(1) if d else layer_in
            projected = torch.nn.functional.linear(seq, w_ih, b_ih)  # [B, T, G·H] for all time steps at once
            h = h0[layer * D + d]
            c = c0[layer * D + d] if c0 is not None else None
            steps = []
            for t in range(T):
                rec = torch.nn.functional.linear(h, w_hh, b_hh)
                if mode == "LSTM":
                    i, f, g, o = (projected[:, t] + rec).chunk(4, dim=-1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                elif mode == "GRU":
                    xr, xz, xn = projected[:, t].chunk(3, dim=-1)
                    hr, hz, hn = rec.chunk(3, dim=-1)
                    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
                    h = (1 - z) * torch.tanh(xn + r * hn) + z * h
                else:
                    h = act(projected[:, t] + rec)
                steps.append(h)
            out = torch.stack(steps, dim=1)
            outs.append(out.flip(1) if d else out)
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        layer_in = torch.cat(outs, dim=-1) if D == 2 else outs[0]
        if layer < L - 1 and module.dropout > 0:
            layer_in = torch.nn.functional.dropout(layer_in, module.dropout, module.training)
    output = layer_in if module.batch_first else layer_in.transpose(0, 1)
    h_n_t = torch.stack(h_n)
    c_n_t = torch.stack(c_n) if c_n else None
    if unbatched:
        output = output.squeeze(0 if module.batch_first else 1)
        h_n_t = h_n_t.squeeze(1)
        c_n_t = c_n_t.squeeze(1) if c_n_t is not None else None
    return output, ((h_n_t, c_n_t) if mode == "LSTM" else h_n_t)


def _per_sample_protocol(model: nn.Module) -> Optional[Callable[[Any, int], Tensor]]:
    """The model's bound ``training_step_per_sample``, if it may stand in for ``training_step``, else None.

    It is used only when it is defined on the class that defines ``training_step`` or on a subclass of it: a
    subclass that overrides ``training_step`` (another loss, a regulariser) and inherits
    ``training_step_per_sample`` from its base would otherwise train the base's objective.
    """
    if not callable(getattr(model, "training_step_per_sample", None)):
        return None
    mro = type(model).__mro__

    def owner(name: str) -> Optional[type]:
        return next((cls for cls in mro if name in cls.__dict__), None)

    step_owner, sample_owner = owner("training_step"), owner("training_step_per_sample")
    if sample_owner is None or step_owner is None or not issubclass(sample_owner, step_owner):
        return None
    return model.training_step_per_sample


def _metric_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Metric)]


def _refuse_metric_update(name: str, *args: Any, **kwargs: Any) -> None:
    raise VectorizationUnsupportedError(
        f"the torchmetrics metric '{name}' is updated in training_step, which client_execution='vectorized' cannot "
        "batch over clients yet; use client_execution='sequential' (or 'auto' to fall back automatically)"
    )


def _has_random_layers(model: nn.Module) -> bool:
    """Dropout layers with p > 0, or stacked RNNs with inter-layer dropout (randomness ``vmap`` must replay)."""
    from torch.nn.modules.dropout import _DropoutNd

    for module in model.modules():
        if isinstance(module, _DropoutNd) and module.p > 0:
            return True
        if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1:
            return True
    return False


def _vmappable_rnns(model: nn.Module) -> List[nn.RNNBase]:
    """The model's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` layers, checked for what :func:`_rnn_forward` supports."""
    found = []
    for name, module in model.named_modules():
        if type(module) in (nn.LSTM, nn.GRU, nn.RNN):
            if getattr(module, "proj_size", 0):
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' cannot train layer '{name}' ({type(module).__name__}) with "
                    "proj_size > 0; use client_execution='sequential' or 'auto'"
                )
            found.append(module)
    return found


class _LogCollector:
    """Stands in for ``model.log`` / ``model.log_dict`` while the model runs under ``vmap``.

    Values are collected as (batched) tensors and returned from the vmapped function as outputs, so they leave
    ``vmap`` as ordinary ``[C]`` tensors (the loop's router would otherwise keep tensors that escaped ``vmap``).
    Like the router, non-scalar values and torchmetrics objects are ignored.
    """

    def __init__(self) -> None:
        self.names: List[str] = []
        self.values: List[Tensor] = []
        self.per_sample = False  # True while ``training_step_per_sample`` runs: only ``[n]`` values are kept

    def reset(self, per_sample: bool = False) -> None:
        self.names, self.values = [], []
        self.per_sample = per_sample

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
            return
        if self.per_sample:  # one value per sample ([n]); anything else has no per-sample meaning
            if isinstance(value, Tensor) and value.dim() == 1:
                self._keep(name, value)
            return
        if isinstance(value, Tensor):
            if value.numel() != 1:
                return
            # returned from vmap as it is; detached, made a scalar and float32 outside (see _logged_value)
        else:
            value = torch.tensor(float(value))
        self._keep(name, value)

    def _keep(self, name: str, value: Tensor) -> None:
        if name in self.names:  # logged twice in one call: keep the last value, as a logger would
            self.values[self.names.index(name)] = value
        else:
            self.names.append(name)
            self.values.append(value)

    def log_dict(self, dictionary: Dict[str, Any], *args: Any, **kwargs: Any) -> None:
        for k, v in dictionary.items():
            self.log(k, v)


def _logged_value(value: Tensor, batch_dims: int) -> Tensor:
    """A logged one-element value as it left vmap (``[R, *shape]`` or ``[R, n_max, *shape]``), detached, with its
    one element per row / cell, as float32: what ``value.detach().reshape(()).float()`` gives inside vmap."""
    return value.detach().reshape(value.shape[:batch_dims]).float()


class _ModuleTracker:
    """Remembers which module was executing when a batched call failed (to name the layer in the error)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stack: List[str] = []
        self.failed_in: Optional[str] = None
        self.handles: list = []

    def __enter__(self) -> "_ModuleTracker":
        for name, module in self.model.named_modules():
            label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

            def pre(mod, args, label=label):
                self.stack.append(label)

            def post(mod, args, out, label=label):
                if self.stack:
                    self.stack.pop()

            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.stack:
            self.failed_in = self.stack[-1]
        for h in self.handles:
            h.remove()
        self.handles = []


# ====================================================================== data
class _RoundBatches:
    """The round's mini-batches of every client, step by step, in the order sequential training draws them.

    ``step(k)`` returns ``(leaves, spec, sizes)``: the batch structure's tensor leaves ``[C, n_max, ...]`` (client
    ``i``'s batch of step ``k`` in row ``i``, padded to the step's largest batch by repeating its own samples, on the
    model's device), the pytree spec of a batch, and the real batch sizes ``n_i`` (see :class:`_Layout`).
    """

    #: largest round of gathered batch rows (bytes) that is gathered at once rather than step by step
    ROUND_GATHER_BYTES = 32 << 20

    def __init__(self, datamodule, client_ids: Sequence[int], round: int, seed: int, local_steps: int,
                 to_device: Callable[[Any], Any]):
        self.local_steps = local_steps
        self.to_device = to_device
        loaders = [datamodule.client_dataloader(cid, round, seed=seed) for cid in client_ids]
        samplers = [self._array_sampler(ld) for ld in loaders]
        if all(s is not None for s in samplers) and len({id(ld.dataset) for ld in loaders}) == 1:
            self._init_fast(loaders[0].dataset, samplers)
        else:
            self._init_generic(loaders)

    @staticmethod
    def _array_sampler(loader):
        """The batch sampler of an in-memory fast-path loader (``ArrayBatchLoader`` over an ArrayDataset), else None."""
        from fedlightning.datamodules.base import ArrayBatchLoader, ArrayDataset

        if type(loader) is ArrayBatchLoader and isinstance(loader.dataset, ArrayDataset):
            return loader.batch_sampler
        return None

    def _init_fast(self, dataset, samplers) -> None:
        """Index lists straight from each client's batch sampler (exactly what its ``ArrayBatchLoader`` yields as
        ``(x[idx], y[idx])``), laid out as one padded ``[C, n_max]`` index matrix per step (all steps' matrices are
        built at once, see :func:`_round_index`). The rows of the whole round are gathered with one
        ``index_select`` per tensor when they fit in :attr:`ROUND_GATHER_BYTES` (each step's batch is then a view
        into them), else step by step."""
        self.fast, self.dataset = True, dataset
        K = self.local_steps
        index, sizes, widths = _round_index(samplers, K)
        C = len(samplers)
        offsets = np.concatenate([[0], np.cumsum(widths * C)]).tolist()
        sizes_list = sizes.tolist()
        self.steps = [(index[offsets[k]:offsets[k + 1]].reshape(C, -1), sizes_list[k]) for k in range(K)]
        self.offsets = offsets
        self.round_leaves = None
        x, y = dataset.x, dataset.y
        probe = torch.from_numpy(index[:1])
        row_bytes = sum(t.numel() * t.element_size() for t in (_take(x, probe), _take(y, probe)))
        if index.size * row_bytes <= self.ROUND_GATHER_BYTES:
            flat = torch.from_numpy(index)
            gathered = self.to_device((_take(x, flat), _take(y, flat)))
            self.round_leaves, self.spec = tree_flatten(gathered)

    def _init_generic(self, loaders) -> None:
        self.fast = False
        K = self.local_steps
        per_step: List[List[Any]] = [[] for _ in range(K)]
        with torch.random.fork_rng(devices=[]):  # DataLoader iterators draw a base seed from the global RNG
            for ld in loaders:
                it = iter(ld)
                for k in range(K):
                    try:
                        b = next(it)
                    except StopIteration:
                        it = iter(ld)
                        b = next(it)
                    per_step[k].append(b)
        self.per_step = per_step

    def step(self, k: int) -> Tuple[List[Tensor], Any, List[int]]:
        """Leaves ``[C, n_max, ...]`` of step ``k``'s batches (each client's rows, padded by repeating its own rows
        up to the largest batch of the step), the batch's pytree spec, and the real sizes ``n_i``."""
        if self.fast:
            index, sizes = self.steps[k]
            shape = index.shape
            if self.round_leaves is not None:  # views into the round's rows
                start, end = self.offsets[k], self.offsets[k + 1]
                leaves = [x[start:end].view(*shape, *x.shape[1:]) for x in self.round_leaves]
                return leaves, self.spec, sizes
            flat = torch.from_numpy(index.reshape(-1))
            x, y = _take(self.dataset.x, flat), _take(self.dataset.y, flat)
            x, y = self.to_device((x.view(*shape, *x.shape[1:]), y.view(*shape, *y.shape[1:])))
            leaves, spec = tree_flatten((x, y))
            return leaves, spec, sizes
        batches = self.per_step[k]
        flats, specs = zip(*(tree_flatten(b) for b in batches))
        spec = specs[0]
        if any(s != spec for s in specs):
            raise VectorizationUnsupportedError("the clients' batches have different structures; cannot stack them")
        sizes = []
        for leaves in flats:
            if not leaves or not all(isinstance(x, Tensor) and x.dim() >= 1 for x in leaves):
                raise VectorizationUnsupportedError(
                    "client_execution='vectorized' needs batches whose leaves are all tensors with a leading batch "
                    f"dimension; got leaves of types {[type(x).__name__ for x in leaves]}"
                )
            n = leaves[0].shape[0]
            if any(x.shape[0] != n for x in leaves):
                raise VectorizationUnsupportedError(
                    f"batch leaves have different leading sizes {[tuple(x.shape) for x in leaves]}; cannot stack them"
                )
            sizes.append(int(n))
        position = torch.from_numpy(_padded_positions(sizes))
        leaves = [torch.cat([f[j] for f in flats])[position] for j in range(len(flats[0]))]
        leaves = tree_flatten(self.to_device(tree_unflatten(leaves, spec)))[0]
        return leaves, spec, sizes


def _take(data: Any, index: Tensor) -> Tensor:
    """``data[index]`` for a 1-d int64 ``index``: ``index_select`` for tensors (the same rows, faster than advanced
    indexing), the object's own indexing otherwise (tensor-like views such as Shakespeare's sliding windows)."""
    if isinstance(data, Tensor):
        return torch.index_select(data, 0, index.to(data.device))
    return data[index]


def _sampler_batches(sampler, num: int) -> List[np.ndarray]:
    """The first ``num`` index batches a client's loader yields, cycling to a new epoch (a new ``iter()``) when the
    sampler runs out, exactly as ``LocalTrainer.run`` re-iterates its loader (any batch sampler)."""
    out: List[np.ndarray] = []
    it = iter(sampler)
    while len(out) < num:
        try:
            idx = next(it)
        except StopIteration:  # a new shuffled epoch
            it = iter(sampler)
            idx = next(it)
        out.append(np.asarray(idx, dtype=np.int64).reshape(-1))
    return out


def _round_index(samplers, num: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``num`` index batches of every client's batch sampler (as :func:`_sampler_batches`), laid out for
    the round: returns ``(index, sizes, widths)`` with ``sizes[k, i]`` the size of client ``i``'s batch ``k``,
    ``widths[k] = max_i sizes[k, i]`` and ``index`` the concatenation over ``k`` of the ``[C, widths[k]]`` matrices
    whose row ``i`` holds client ``i``'s batch ``k`` padded by repeating its own rows (see
    :func:`_padded_positions`).

    For :class:`~fedlightning.datamodules.base.ClientBatchSampler` (the data modules' own sampler) the epochs are
    drawn here with the sampler's own generator and operations (one ``randperm`` per epoch, cut into batches of
    ``batch_size``, the last one partial): the same index lists as iterating it, with the per-epoch Python work
    reduced to the ``randperm`` call and everything else done for all clients and steps at once. Other samplers
    are iterated.
    """
    from fedlightning.datamodules.base import ClientBatchSampler

    C = len(samplers)
    fast = all(type(s) is ClientBatchSampler and s.shuffle and len(s.indices) > 0 for s in samplers)
    k = np.arange(num, dtype=np.int64)[:, None]
    if fast:
        n = np.array([len(s.indices) for s in samplers], dtype=np.int64)
        bs = np.array([s.batch_size for s in samplers], dtype=np.int64)
        per_epoch = -(-n // bs)  # batches per epoch
        epochs = -(-num // per_epoch)  # epochs needed for ``num`` batches
        perms = [torch.randperm(int(n_i), generator=s.generator)
                 for s, n_i, e_i in zip(samplers, n.tolist(), epochs.tolist()) for _ in range(e_i)]
        segment = epochs * n  # client i's epochs, one after the other, in ``order``
        seg_start = np.cumsum(segment) - segment
        idx_start = np.cumsum(n) - n
        # order[seg_start_i + e n_i + j] = sampler_i.indices[perm_{i,e}[j]]
        all_indices = torch.cat([s.indices for s in samplers]).numpy()
        order = all_indices[torch.cat(perms).numpy() + np.repeat(idx_start, segment)]
        b = k % per_epoch  # position of batch k in its epoch
        starts = seg_start + (k // per_epoch) * n + b * bs  # [K, C]
        sizes = np.minimum(bs, n - b * bs)
    else:
        chunks = [_sampler_batches(s, num) for s in samplers]
        sizes = np.array([[len(c[j]) for c in chunks] for j in range(num)], dtype=np.int64).reshape(num, C)
        order = np.concatenate([np.concatenate(c) for c in chunks])
        client_start = np.cumsum(sizes.sum(0)) - sizes.sum(0)
        starts = client_start + np.cumsum(sizes, axis=0) - sizes
    widths = sizes.max(axis=1)  # [K]
    # cell (k, i, j) for j < widths[k] holds the client's row j mod sizes[k, i]
    w = np.repeat(widths, C)  # width of every (k, i) row
    row_start = np.cumsum(w) - w
    col = np.arange(int(w.sum()), dtype=np.int64) - np.repeat(row_start, w)
    pos = np.repeat(starts.reshape(-1), w) + col % np.repeat(sizes.reshape(-1), w)
    return order[pos], sizes, widths


def _padded_positions(sizes: List[int]) -> np.ndarray:
    """``[C, n_max]`` positions into the clients' concatenated rows; client ``i``'s cell ``j`` holds its own row
    ``j mod n_i``, so padding cells repeat real samples (finite losses, masked out)."""
    n = np.asarray(sizes, dtype=np.int64)
    start = np.cumsum(n) - n
    return start[:, None] + np.arange(int(n.max()))[None, :] % n[:, None]


class _Layout:
    """How one step's batches are laid out for the batched model call (row ``i`` = client ``i``).

    * whole (every client's batch has the same size ``n``): row ``i`` is client ``i``'s batch ``[n, ...]`` and
      ``training_step`` sees it exactly as it would sequentially;
    * padded (sizes differ): every client's batch is padded to the step's largest size ``n_max`` by repeating its own
      samples (so every cell holds real, finite data) and ``mask`` marks the real cells. Every cell is one
      ``training_step`` call on a batch of one sample (an inner vmap) and a client's loss is the sum of its real
      cells' losses over ``n_i``, the mean over its samples.

    (Cutting big clients into several rows to pad less was measured slower on CPU: the extra weight gathers cost
    more than the padded cells they save.)
    """

    def __init__(self, leaves: List[Tensor], spec: Any, sizes: List[int], cache: Optional[dict] = None):
        """``leaves``: the step's batch leaves ``[C, n_max, ...]`` (see :meth:`_RoundBatches.step`); ``cache``: a
        dict kept over the steps of a round, so that steps with the same sizes share their mask and counts."""
        self.num_clients = len(sizes)
        self.leaves, self.spec = leaves, spec
        self.batch = tree_unflatten(leaves, spec)
        key = tuple(sizes)
        if cache is not None and key in cache:
            self.mask, self.counts, self._counts_as = cache[key]
            return
        n_max = max(sizes)
        if min(sizes) == n_max:
            self.mask = self.counts = None
        else:
            device = leaves[0].device
            n = torch.tensor(sizes, dtype=torch.long)
            self.mask = (torch.arange(n_max)[None, :] < n[:, None]).to(device)
            self.counts = n.to(device)
        self._counts_as: Dict[Any, Tensor] = {}  # by dtype; cell weights by ("weights", dtype)
        if cache is not None:
            cache[key] = (self.mask, self.counts, self._counts_as)

    def counts_as(self, dtype: torch.dtype) -> Tensor:
        """``counts`` converted to ``dtype`` (cached)."""
        out = self._counts_as.get(dtype)
        if out is None:
            out = self._counts_as[dtype] = self.counts.to(dtype)
        return out

    def cell_weights(self, dtype: torch.dtype) -> Tensor:
        """``mask / counts`` ([C, n_max]): each real cell's weight ``1/n_i`` in its client's mean, 0 on padded
        cells (cached with the counts)."""
        key = ("weights", dtype)
        out = self._counts_as.get(key)
        if out is None:
            out = self._counts_as[key] = self.mask.to(dtype) / self.counts_as(dtype)[:, None]
        return out

    def rows(self, clients: Tensor, scratch: Callable[..., Tensor]) -> Tuple[Any, Optional[Tensor], Optional[Tensor]]:
        """Batch, mask and sample counts of the rows ``clients`` (indices; repeats allowed), gathered into the
        engine's reusable ``scratch`` buffers (these rows only live during one trial evaluation)."""
        P = len(clients)
        rows = [torch.index_select(x, 0, clients, out=scratch(("rows", j), (P, *x.shape[1:]), x.dtype, x.device))
                for j, x in enumerate(self.leaves)]
        batch = tree_unflatten(rows, self.spec)
        if self.mask is None:
            return batch, None, None
        return batch, self.mask.index_select(0, clients), self.counts.index_select(0, clients)


# ====================================================================== one step's evaluations
class _StepEvaluator:
    """Evaluates the clients' objectives on the current step's batches (laid out by :class:`_Layout`).

    ``gradient(W, alive)`` returns every client's loss ``[C]`` and gradient ``[C, D]`` at ``W`` ([C, D]): one vmapped
    forward, one backward. ``trial(points, clients)`` returns, under ``no_grad``, the losses of the clients
    ``clients`` ([P] indices, repeats allowed: several trial points of one client) at ``points`` ([P, D]), or of all
    clients in order (``clients=None``), after restoring the random state of the gradient evaluation; the latter
    draws exactly the random numbers of the gradient evaluation (same dropout masks, as the sequential optimizers
    do). ``finish()`` leaves the generator in the state the gradient evaluation left it in, so the number of trials
    does not change later randomness.
    """

    def __init__(self, engine: "VectorizedClientTrainer", layout: _Layout, step: int,
                 terms: Optional[List[List[Callable]]], rng_devices: list, log_sink: Optional[list],
                 trials: bool = True):
        self.engine, self.layout, self.step = engine, layout, step
        self.terms = terms
        self.rng_devices = rng_devices
        self.log_sink = log_sink
        self.replay = trials  # keep the generator state of the gradient evaluation for trial evaluations
        self.rng_before = None
        self.rng_after = None
        self.trials = 0
        self.learn_layout = False  # set by the engine's layout probe
        self.track_alive = True  # False: every client trains every step (logged values need no mask)

    def gradient(self, W: Tensor, alive: Tensor, flat: bool = True) -> Tuple[Tensor, Any]:
        """Losses ``[C]`` and gradients at ``W``: one ``[C, D]`` tensor (``flat``), or the list of per-parameter
        ``[C, *shape]`` gradients (no concatenation; a parameter the loss does not depend on gets zeros)."""
        if self.replay:
            self.rng_before = _rng_state(self.rng_devices)
        layout, engine = self.layout, self.engine
        # one leaf per parameter (views of W's storage): their gradients come out separately, so the backward pass
        # does not concatenate them into a [C, D] tensor unless the optimizer needs one
        leaves = [v.detach().requires_grad_(True) for v in engine._views(W)]
        with torch.enable_grad():
            if layout.mask is None:
                losses, logged = engine._row_values(leaves, layout.batch, None, self.step)
                objective = losses
            else:
                # padded rows: the loss of client i is Σ_j m_ij ℓ_ij / n_i (its real cells' mean); the backward pass
                # starts from Σ_ij ℓ_ij · (m_ij / n_i), whose gradient w.r.t. ℓ is the same m_ij · fl(1/n_i) the
                # masked sum, the division and the sum over clients give (bit for bit), with fewer autograd nodes;
                # the reported losses are computed from the detached cells as before
                cells, values, logged = engine._row_values(leaves, layout.batch, layout.mask, self.step, cells=True)
                losses = values / layout.counts_as(values.dtype)
                objective = (cells * layout.cell_weights(cells.dtype)).sum(1)
            if self.terms is not None:
                terms = engine._term_values(leaves, self.terms)
                losses = losses + terms
                objective = objective + terms
            grads = torch.autograd.grad(objective.sum(), leaves, allow_unused=True)
        grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]
        if self.log_sink is not None and logged:
            # per-client sums over real samples on padded steps: divided by the counts at the end of the round
            self.log_sink.append(([(name, v.detach()) for name, v in logged], layout.counts,
                                  alive if self.track_alive else None))
        if self.learn_layout:
            engine._learn_layout(grads)
        if flat:
            return losses.detach(), engine._flat(grads)
        return losses.detach(), grads

    def trial(self, points: Tensor, clients: Optional[Tensor] = None) -> Tensor:
        """Losses at ``points`` ([P, D]) of the clients ``clients`` ([P] indices, repeats allowed), or of every
        client in order (``clients=None``, ``P = C``)."""
        if self.rng_before is None:
            raise RuntimeError("trial() needs a gradient() evaluation made with trials=True first")
        if self.trials == 0:
            self.rng_after = _rng_state(self.rng_devices)
        self.trials += 1
        _set_rng_state(self.rng_before, self.rng_devices)
        layout, engine = self.layout, self.engine
        with torch.no_grad():
            if clients is None:
                batch, mask, counts, terms = layout.batch, layout.mask, layout.counts, self.terms
            else:
                batch, mask, counts = layout.rows(clients, engine.scratch)
                terms = [self.terms[i] for i in clients.tolist()] if self.terms is not None else None
            views = engine._views(points)
            values, _ = engine._row_values(views, batch, mask, self.step)
            if counts is None:
                losses = values
            else:
                losses = values / (layout.counts_as(values.dtype) if clients is None else counts.to(values.dtype))
            if terms is not None:
                losses = losses + engine._term_values(views, terms)
        return losses

    def finish(self) -> None:
        if self.rng_after is not None:
            _set_rng_state(self.rng_after, self.rng_devices)


def _rng_state(cuda_devices) -> Tuple[Tensor, List[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda_devices]


def _set_rng_state(state, cuda_devices) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(cuda_devices, state[1]):
        torch.cuda.set_rng_state(s, d)


# ====================================================================== batched optimizer rules
class _StepRecord:
    """Per-step telemetry of every client, kept as tensors until the end of the round (one host sync)."""

    def __init__(self, num_clients: int, device: torch.device):
        self.losses: List[Tensor] = []
        self.step_sizes: List[Tensor] = []
        self.backtracks = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.forwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.backwards = torch.zeros(num_clients, dtype=torch.long, device=device)
        self.uniform_evaluations = 0  # one forward and one backward of every client (SGD steps), added at the end


class _BatchedRule:
    """Base of the batched client optimizers: one local step of every client at once, on ``W`` ([C, D]) in place.

    ``alive`` ([C] bool) marks the clients that still train: ``LocalTrainer.run`` stops a client whose loss is
    non-finite under a closure optimizer (``stops_on_nonfinite``); stopped clients are still computed (their rows
    ride along in the batched ops) but neither their weights, state nor telemetry change any more.
    """

    stops_on_nonfinite = False
    uses_trials = False  # evaluates trial points (line search): the evaluator keeps the RNG state to replay

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        raise NotImplementedError

    def finalize(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Write the batched per-client state back into each client's optimizer instance (whose own
        ``get_client_state`` / ``client_report`` then give exactly what a sequential run stores)."""


class _BatchedSGD(_BatchedRule):
    """``torch.optim.SGD`` without momentum: ``d = clip(g) + λ w``; ``w ← w − lr · d`` (the same ops as torch).

    A parameter the loss does not depend on gets a zero gradient here, while torch's SGD skips a parameter whose
    ``.grad`` is None: the two agree except that such a parameter still decays when ``weight_decay > 0``.
    """

    def __init__(self, lr: float, weight_decay: float, grad_clip: Optional[float], num_clients: int, device):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.grad_clip = grad_clip
        self.lr_vector = torch.full((num_clients,), self.lr, dtype=torch.float64, device=device)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        if self.grad_clip is None and self.weight_decay == 0.0:
            # plain SGD: w <- w - lr g on every parameter's rows of W, the gradients as the backward pass made them
            loss, grads = ev.gradient(W, alive, flat=False)
            torch._foreach_add_(ev.engine._views(W), grads, alpha=-self.lr)
            record.losses.append(loss)
            record.step_sizes.append(self.lr_vector)
            record.uniform_evaluations += 1
            return
        loss, g = ev.gradient(W, alive)
        if self.grad_clip is not None:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (‖g‖ + 1e-6), clamped to 1, always multiplied
            norm = torch.linalg.vector_norm(g, dim=1)
            coef = (float(self.grad_clip) / (norm + 1e-6)).clamp(max=1.0)
            g = g * coef[:, None]
        if self.weight_decay != 0.0:
            g = g.add(W, alpha=self.weight_decay)
        W.add_(g, alpha=-self.lr)
        record.losses.append(loss)
        record.step_sizes.append(self.lr_vector)
        record.uniform_evaluations += 1


def _loss_and_grad_sq(loss: Tensor, g: Tensor, ev: _StepEvaluator) -> Tuple[Tensor, Tensor, Tensor]:
    """float64 loss and ‖g‖² per client, and the mask of clients whose step is finite (the optimizers' policy:
    a non-finite loss or gradient leaves the weights and the state unchanged, step size nan).

    ‖g‖² is computed as the optimizers of :mod:`fedlightning.optim` compute it (per-tensor norms in the parameters'
    dtype, squared and summed in float64), so the Armijo / Polyak decisions see the same numbers up to rounding.
    """
    parts = g if isinstance(g, (list, tuple)) else ev.engine._views(g)
    norms = [torch.linalg.vector_norm(v, dim=tuple(range(1, v.dim()))) if v.dim() > 1 else v.abs() for v in parts]
    grad_sq = torch.stack(norms).double().square().sum(dim=0)
    loss64 = loss.double()
    finite = torch.isfinite(loss64) & torch.isfinite(grad_sq)
    return loss64, grad_sq, finite


def _move(W: Tensor, g: Any, step: Tensor, where: Tensor, views: Optional[Callable] = None) -> None:
    """``w ← w − step · g`` for the clients in ``where`` (same rounding as ``torch._foreach_add_(alpha=-step)``);
    the other rows are left bit-for-bit unchanged (their gradient may be non-finite). ``g`` is ``[C, D]``, or the
    per-parameter gradients, applied to the parameters' views of ``W`` (``views(W)``)."""
    neg = (-step).to(W.dtype)
    if isinstance(g, Tensor):
        moved = torch.addcmul(W, g, neg[:, None])
        torch.where(where[:, None], moved, W, out=W)
        return
    for w, gi in zip(views(W), g):
        shape = (-1,) + (1,) * (w.dim() - 1)
        moved = torch.addcmul(w, gi, neg.view(shape))
        w.copy_(torch.where(where.view(shape), moved, w))


class _BatchedArmijo(_BatchedRule):
    """:class:`fedlightning.optim.SgdArmijo` for every client at once, with masked backtracking.

    Every client starts from its own ``η_0`` (reset policy, its own last accepted step and ``b/n_i``) and walks the
    grid ``η_0 β^m``, ``m = 0, 1, …``; it stops at its first accepted ``m`` while the others go on. The outcome
    (accepted step, backtracks, forward count, state) is the sequential search's, grid point by grid point; only
    the batching differs:

    * deterministic models: a trial round evaluates every client still searching at a window of its next grid
      points, all (client, point) pairs in one batched call. A client's first window reaches one point past the
      ``m`` it accepted at its previous step of the round (the accepted ``m`` changes little from step to step), and
      each further window doubles, so searches end in one or two rounds with few points past the accepted one.
      Those extra points are computed but not counted: telemetry counts the search's own evaluations;
    * models with random layers (dropout): every client at one grid point per round, in order, so the replayed
      generator gives every trial the dropout masks of its gradient evaluation.

    One host synchronisation per trial round. Zero-gradient, exhausted-search and non-finite policies, telemetry
    and per-client state are SgdArmijo's (see :mod:`fedlightning.optim.armijo`).
    """

    stops_on_nonfinite = True
    uses_trials = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.eta_max, self.c, self.beta = hp["eta_max"], hp["c"], hp["beta"]
        self.reset, self.delta = hp["reset"], hp["delta"]
        self.max_backtracks, self.grad_tol = hp["max_backtracks"], hp["grad_tol"]
        f64 = dict(dtype=torch.float64, device=device)
        if self.reset == "grow":  # δ^{b/n_i} per client, computed as SgdArmijo does (Python float power)
            self.growth = torch.tensor([self.delta ** o._epoch_exponent('reset="grow"') for o in optimizers], **f64)
        # β^m for m = 0 .. max_backtracks + 1, as SgdArmijo computes them (Python float powers)
        self.powers = torch.tensor([self.beta**m for m in range(self.max_backtracks + 2)], **f64)
        # η_{k-1}: the step a client accepted last this round; before its first step, the carried step when
        # carry_step_size (SgdArmijo.initial_step_size), else none (NaN) and the search starts at eta_max
        starts = [o._carried_step if (o.carry_step_size and o._carried_step is not None) else None for o in optimizers]
        self.prev = torch.tensor([float("nan") if s is None else s for s in starts], **f64)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        accepted = [o._accepted_step for o in optimizers]  # last accepted step (client state, across rounds)
        self.accepted_step = torch.tensor([float("nan") if a is None else a for a in accepted], **f64)
        self.accepted_any = torch.zeros(num_clients, dtype=torch.bool, device=device)
        self.last_m = torch.zeros(num_clients, dtype=torch.long, device=device)  # window prediction

    def initial_step_size(self) -> Tensor:
        eta_max = torch.full_like(self.prev, self.eta_max)
        if self.reset == "max":
            return eta_max
        prev = self.prev
        start = prev if self.reset == "last" else torch.minimum(prev * self.growth, eta_max)
        return torch.where(torch.isnan(prev), eta_max, start)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        flat = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0)
        searching = alive & finite & ~flat
        eta0 = self.initial_step_size()
        grid = self.max_backtracks + 1  # grid points m = 0 .. max_backtracks
        if ev.engine.deterministic:
            first_m, trials = self._search_windows(W, g, ev, loss64, grad_sq, eta0, searching, grid)
        else:
            first_m, trials = self._search_in_order(W, g, ev, loss64, grad_sq, eta0, searching, grid)
        ev.finish()
        accepted = first_m < grid
        accepted_eta = torch.where(accepted, eta0 * self.powers[first_m.clamp(max=grid)], torch.zeros_like(eta0))
        exhausted = searching & ~accepted
        _move(W, g, accepted_eta * self.scale, accepted)  # SgdArmijo applies s·η_k
        # η_{k-1}: accepted step; after an exhausted search the next grid point η_0 β^{max_backtracks+1}
        next_grid = eta0 * self.powers[grid]
        self.prev = torch.where(accepted, accepted_eta, torch.where(exhausted, next_grid, self.prev))
        self.accepted_step = torch.where(accepted, accepted_eta, self.accepted_step)
        self.accepted_any |= accepted | exhausted
        self.last_m = torch.where(accepted, first_m, self.last_m)
        nan = torch.full_like(eta0, float("nan"))
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, accepted_eta * self.scale, nan))
        live = alive.long()
        record.backtracks += torch.where(accepted, trials - 1, trials) * live
        record.forwards += (1 + trials) * live
        record.backwards += live

    def _accepts(self, trial_loss: Tensor, loss64: Tensor, grad_sq: Tensor, eta: Tensor) -> Tensor:
        """The Armijo test f(w − ηg) ≤ f(w) − c·η·‖g‖², with SgdArmijo's float64 operations and order."""
        return trial_loss.double() <= loss64 - (self.c * eta) * grad_sq

    def _search_windows(self, W, g, ev, loss64, grad_sq, eta0, searching, grid):
        """Deterministic models: (client, grid point) pairs of all searching clients in one call per round."""
        C = W.shape[0]
        device = W.device
        never = torch.full((C,), grid, dtype=torch.long, device=device)
        first_m = never.clone()  # first accepted grid point (grid = none)
        trials = torch.zeros(C, dtype=torch.long, device=device)
        next_m = torch.zeros(C, dtype=torch.long, device=device)
        width = self.last_m + 2  # first window: up to one point past the client's previous accepted m
        while True:
            width = torch.minimum(width, grid - next_m) * searching.long()
            widths = width.tolist()  # the one host synchronisation of this trial round
            total = sum(widths)
            if total == 0:
                break
            pair_client = torch.repeat_interleave(torch.arange(C, device=device), width, output_size=total)
            offset = torch.cumsum(width, 0) - width
            pair_m = next_m[pair_client] + torch.arange(total, device=device) - offset[pair_client]
            eta = eta0[pair_client] * self.powers[pair_m]
            points = self._points(ev, W, g, pair_client, eta, widths)
            trial_loss = ev.trial(points, pair_client)
            ok = self._accepts(trial_loss, loss64[pair_client], grad_sq[pair_client], eta)
            hit = never.scatter_reduce(0, pair_client, torch.where(ok, pair_m, grid), reduce="amin")
            found = hit < grid
            first_m = torch.where(found, hit, first_m)
            trials += torch.where(found, hit - next_m + 1, width)
            next_m = next_m + width
            searching = searching & ~found & (next_m < grid)
            width = width * 2
        return first_m, trials

    @staticmethod
    def _points(ev: _StepEvaluator, W: Tensor, g: Tensor, pair_client: Tensor, eta: Tensor,
                widths: Optional[List[int]] = None) -> Tensor:
        """Trial points ``w_c − η g_c`` of the (client, grid point) pairs, written into the engine's scratch
        buffers (same rounding as ``torch.addcmul``, hence as SgdArmijo's ``_foreach_add_(alpha=-η)``).

        On CPU, with ``widths`` (pairs per client, ``pair_client`` sorted by client as ``repeat_interleave`` makes
        it), each client's block of pairs is one ``addcmul`` of its row of ``W`` and ``g`` broadcast over the block:
        the points are written once instead of gathering ``W``'s and ``g``'s rows first (3 passes over ``[P, D]``;
        measured 35 % faster with one thread, even with two). On accelerators three large kernels beat one small
        kernel per client."""
        shape = (len(pair_client), W.shape[1])
        neg = (-eta).to(W.dtype).unsqueeze(1)
        if widths is not None and W.device.type == "cpu":
            points = ev.engine.scratch("points", shape, W.dtype, W.device)
            start = 0
            for c, w in enumerate(widths):
                if w:
                    end = start + w
                    torch.addcmul(W[c].expand(w, -1), g[c].expand(w, -1), neg[start:end], out=points[start:end])
                    start = end
            return points
        points = torch.index_select(W, 0, pair_client, out=ev.engine.scratch("points", shape, W.dtype, W.device))
        g_rows = torch.index_select(g, 0, pair_client, out=ev.engine.scratch("g_rows", shape, W.dtype, W.device))
        return points.addcmul_(g_rows, neg)

    def _search_in_order(self, W, g, ev, loss64, grad_sq, eta0, searching, grid):
        """Models with random layers: every client at one grid point per round, all clients in order."""
        C = W.shape[0]
        first_m = torch.full((C,), grid, dtype=torch.long, device=W.device)
        trials = torch.zeros(C, dtype=torch.long, device=W.device)
        for m in range(grid):
            if not bool(searching.any()):  # the one host synchronisation of this trial round
                break
            eta = eta0 * self.powers[m]
            points = torch.addcmul(W, g, (-eta).to(W.dtype).unsqueeze(1))
            ok = searching & self._accepts(ev.trial(points), loss64, grad_sq, eta)
            first_m = torch.where(ok, torch.full_like(first_m, m), first_m)
            trials += searching.long()
            searching = searching & ~ok
        return first_m, trials

    def finalize(self, optimizers) -> None:
        prev = self.prev.tolist()
        took = self.accepted_any.tolist()
        accepted = self.accepted_step.tolist()
        for o, p, t, a in zip(optimizers, prev, took, accepted):
            if t:  # a search ended this round (accepted or exhausted): SgdArmijo's _prev_step
                o._prev_step = p
            o._accepted_step = None if math.isnan(a) else a


class _BatchedSPS(_BatchedRule):
    """:class:`fedlightning.optim.SPS` (SPS_max, constant or smoothed cap; ``fixed_step_size`` FedSPS-Global mode) for
    every client at once: ``γ_i = min{(f_i − ℓ*)/(c‖g_i‖²), γ_{b,i}}``, degenerate steps and state as SPS."""

    stops_on_nonfinite = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.c, self.gamma_max, self.f_star = hp["polyak_c"], hp["gamma_max"], hp["f_star"]
        self.smooth, self.grad_tol = hp["smooth"], hp["grad_tol"]
        self.fixed_lr = hp.get("fixed_step_size")
        f64 = dict(dtype=torch.float64, device=device)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)
        if self.smooth:  # δ^{b/n_i} per client, as SPS.cap computes it
            self.growth = torch.tensor(
                [hp["smooth_factor"] ** o._epoch_exponent("smooth=True") for o in optimizers], **f64)
        self.prev = torch.tensor([float("nan") if o._prev_step is None else o._prev_step for o in optimizers], **f64)
        nan = torch.full((num_clients,), float("nan"), **f64)
        self.report = (nan.clone(), nan.clone(), nan.clone())  # last step's (sps step, f, ‖g‖²): SPS.client_report
        self.reported = torch.zeros(num_clients, dtype=torch.bool, device=device)

    def cap(self) -> Tensor:
        gamma_max = torch.full_like(self.prev, self.gamma_max)
        if not self.smooth:
            return gamma_max
        return torch.where(torch.isnan(self.prev), gamma_max, self.growth * self.prev)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        gap = loss64 - self.f_star
        cap = self.cap()
        degenerate = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0) | (gap <= 0.0)
        ratio = torch.minimum(gap / (self.c * grad_sq), cap)
        sps_step = torch.where(degenerate, torch.where(gap <= 0.0, torch.zeros_like(cap), cap), ratio)
        report = alive & finite
        self.report = tuple(torch.where(report, new, old) for new, old in zip((sps_step, loss64, grad_sq), self.report))
        self.reported |= report
        zeros, nan = torch.zeros_like(cap), torch.full_like(cap, float("nan"))
        if self.fixed_lr is not None:  # FedSPS-Global client: the constant step, SPS only measured
            step = torch.full_like(cap, self.fixed_lr) * self.scale
            moves = alive & finite
        else:
            step = torch.where(degenerate, zeros, sps_step * self.scale)
            moves = alive & finite & ~degenerate
            self.prev = torch.where(moves, sps_step, self.prev)
        _move(W, g, step, moves, ev.engine._views)
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, step, nan))
        record.forwards += alive.long()
        record.backwards += alive.long()

    def finalize(self, optimizers) -> None:
        prev = self.prev.tolist()
        reports = torch.stack(self.report).tolist()
        reported = self.reported.tolist()
        for i, o in enumerate(optimizers):
            o._prev_step = None if math.isnan(prev[i]) else prev[i]
            if reported[i]:
                o._report = {"sps_last_step_size": reports[0][i], "sps_last_loss": reports[1][i],
                             "sps_last_grad_sq": reports[2][i]}


class _BatchedDecSPS(_BatchedRule):
    """:class:`fedlightning.optim.DecSPS` for every client at once:
    ``γ_t = min{(f − ℓ*)/‖g‖², c_{t−1} γ_{t−1}} / c_t``, ``c_t = c_0 √(t+1)``, with each client's own ``(t, γ_{t−1})``."""

    stops_on_nonfinite = True

    def __init__(self, optimizers, params, num_clients: int, device):
        hp = dict(optimizers[0].hyper)
        self.c0, self.f_star, self.grad_tol = hp["c0"], hp["f_star"], hp["grad_tol"]
        f64 = dict(dtype=torch.float64, device=device)
        self.t = torch.tensor([float(o.t) for o in optimizers], **f64)
        self.gamma_prev = torch.tensor([float(o.gamma_prev) for o in optimizers], **f64)
        self.scale = torch.tensor([o.step_scale for o in optimizers], **f64)  # client step scale (scale_step)

    def step(self, W: Tensor, ev: _StepEvaluator, record: _StepRecord, alive: Tensor) -> None:
        loss, g = ev.gradient(W, alive, flat=False)
        loss64, grad_sq, finite = _loss_and_grad_sq(loss, g, ev)
        gap = loss64 - self.f_star
        degenerate = (grad_sq < self.grad_tol**2) | (grad_sq == 0.0) | (gap <= 0.0)
        t = self.t
        c_prev = torch.where(t >= 1, self.c0 * torch.sqrt(t), torch.full_like(t, self.c0))
        c_t = self.c0 * torch.sqrt(t + 1)
        gamma = torch.minimum(gap / grad_sq, c_prev * self.gamma_prev) / c_t
        moves = alive & finite & ~degenerate
        step = torch.where(moves, gamma * self.scale, torch.zeros_like(gamma))
        _move(W, g, step, moves, ev.engine._views)
        self.t = torch.where(moves, t + 1, t)
        self.gamma_prev = torch.where(moves, gamma, self.gamma_prev)
        record.losses.append(loss)
        record.step_sizes.append(torch.where(finite, step, torch.full_like(step, float("nan"))))
        record.forwards += alive.long()
        record.backwards += alive.long()

    def finalize(self, optimizers) -> None:
        ts, gammas = self.t.tolist(), self.gamma_prev.tolist()
        for o, t, gp in zip(optimizers, ts, gammas):
            o.t, o.gamma_prev = int(t), gp


def _same_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor]) -> Dict[str, Any]:
    """The hyper-parameters shared by every param group of every client optimizer (else unsupported)."""
    ids = {id(p) for p in params}
    first = None
    for opt in optimizers:
        covered = set()
        for group in opt.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            covered.update(id(p) for p in group["params"])
            if first is None:
                first = hp
            elif hp != first:
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' needs the same {type(opt).__name__} settings for every "
                    f"parameter group and client; got {first} and {hp}"
                )
        if covered != ids:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' needs the client optimizer to cover all trainable parameters"
            )
    return first or {}


#: Batched counterparts of the optimizers of fedlightning.optim, by class name.
_ADAPTIVE_RULES: Dict[str, Callable[..., _BatchedRule]] = {
    "SgdArmijo": _BatchedArmijo,
    "SPS": _BatchedSPS,
    "DecSPS": _BatchedDecSPS,
}


def make_batched_rule(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[Tensor],
                      grad_clip: Optional[float], device: torch.device) -> _BatchedRule:
    """The batched counterpart of the round's client optimizers (one instance per client, built by the loop).

    Raises :class:`VectorizationUnsupportedError` for optimizers without a batched rule (Adam, SGD with momentum,
    ...) and for settings that differ between clients or parameter groups.
    """
    kinds = {type(o) for o in optimizers}
    if len(kinds) != 1:
        raise VectorizationUnsupportedError(
            f"the clients use different optimizer classes {sorted(k.__name__ for k in kinds)}")
    kind = kinds.pop()
    num_clients = len(optimizers)
    hp = _same_hyperparameters(optimizers, params)
    if kind is torch.optim.SGD:
        bad = {k: hp.get(k) for k in ("momentum", "nesterov", "maximize") if hp.get(k)}
        if bad:
            raise VectorizationUnsupportedError(
                "client_execution='vectorized' supports torch.optim.SGD without momentum, nesterov or maximize; got "
                + ", ".join(f"{k}={v}" for k, v in bad.items())
            )
        return _BatchedSGD(hp["lr"], hp.get("weight_decay", 0.0), grad_clip, num_clients, device)
    batched = _ADAPTIVE_RULES.get(kind.__name__) if kind.__module__.startswith("fedlightning.optim") else None
    if batched is not None:
        return batched(optimizers, params, num_clients, device)
    raise VectorizationUnsupportedError(
        f"client_execution='vectorized' does not support the client optimizer {kind.__name__}; supported: "
        "torch.optim.SGD without momentum, fedlightning.optim.SgdArmijo, SPS and DecSPS"
    )


# ====================================================================== the engine
class VectorizedClientTrainer:
    """Trains a list of clients in lockstep on the loop's working copy of the model (see the module docstring).

    Args:
        model: the working copy (``loop._worker_trainer().model``); its parameters are only read for names, shapes
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
        # one name per (module, attribute) slot that holds a trainable parameter, tied parameters (one Parameter in
        # several modules) included, so functional_call can skip its own untie/retie pass (tie_weights=False) and
        # still give every slot the client's tensor; a shared module reached under several paths is one slot
        index = {id(p): i for i, (_, p) in enumerate(named)}
        slots: Dict[Tuple[int, str], str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) in index:
                owner, _, attr = n.rpartition(".")
                slots.setdefault((id(model.get_submodule(owner)), attr), n)
        self.alias_index = [("model." + n, index[id(model.get_parameter(n))]) for n in slots.values()]
        # the same slots as (module, attribute, index of the client tensor): the batched call puts the clients'
        # tensors straight into the modules' parameter dicts (what functional_call does, without its per-call
        # name resolution), and puts the Parameters back afterwards
        self.param_slots = []
        for (_, i), n in zip(self.alias_index, slots.values()):
            owner, _, attr = n.rpartition(".")
            self.param_slots.append((model.get_submodule(owner)._parameters, attr, i))
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.num_params = sum(self.numels)
        self.collector = _LogCollector()
        self.metric_modules = _metric_modules(model)
        self.per_sample_step = _per_sample_protocol(model)
        # padded steps of a model without the protocol: per-sample loss interception (vectorized_losses) while it
        # is recognised; None = not tried yet, True = in use, False = generic path (reason in padded_path_reason)
        self.intercept: Optional[bool] = None
        self.padded_path_reason = ""
        self.rnns = _vmappable_rnns(model)
        self.deterministic = not _has_random_layers(model)
        self.probed: set = set()
        self._scratch: Dict[Any, Tensor] = {}
        self._views_of: Optional[Tuple[Tensor, List[Tensor]]] = None
        # storage order of each parameter's block of W (None: the parameter's own), see _learn_layout
        self.orders: List[Optional[Tuple[int, ...]]] = [None] * len(self.shapes)
        self.layout_learned = False

    def scratch(self, key: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A reusable buffer of ``shape`` for ``key`` (grown when needed). Multi-megabyte tensors allocated afresh
        in every trial round cost more in page faults than the work done in them; the engine reuses these."""
        numel = math.prod(shape)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, int(1.5 * buf.numel()) if buf is not None else 0), dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel].view(*shape)

    # ---------------------------------------------------------------- batched loss
    def _views(self, W: Tensor) -> List[Tensor]:
        """The per-parameter views ``[R, *shape]`` of ``W`` ([R, D], each parameter's block in its storage order,
        see :meth:`_learn_layout`); the views of the round's weights are cached (``W`` keeps its storage for the
        whole round: every update is in place)."""
        cached = self._views_of
        if cached is not None and cached[0] is W:
            return cached[1]
        R = W.shape[0]
        views = []
        for t, shape, order in zip(torch.split(W, self.numels, dim=1), self.shapes, self.orders):
            if order is None:
                views.append(t.view(R, *shape))
            else:  # block stored as the parameter permuted by ``order``; the view puts the dimensions back
                stored = t.view(R, *(shape[d] for d in order))
                views.append(stored.permute(0, *(1 + order.index(d) for d in range(len(shape)))))
        self._views_of = (W, views)
        return views

    def _flat(self, parts: Sequence[Tensor]) -> Tensor:
        """``[R, D]`` in the storage order of ``W`` from per-parameter ``[R, *shape]`` tensors (e.g. gradients)."""
        R = parts[0].shape[0]
        return torch.cat([(t if order is None else t.permute(0, *(1 + d for d in order))).reshape(R, -1)
                          for t, order in zip(parts, self.orders)], dim=1)

    def _logical(self, W: Tensor) -> Tensor:
        """``W`` ([R, D], storage order) in the parameters' own order (``flat_params``' order)."""
        if all(order is None for order in self.orders):
            return W
        return torch.cat([v.reshape(W.shape[0], -1) for v in self._views(W)], dim=1)

    def _stored(self, flat: Tensor) -> Tensor:
        """A ``[D]`` vector in the parameters' own order, in the storage order of ``W``."""
        if all(order is None for order in self.orders):
            return flat
        return self._flat([t.view(1, *shape) for t, shape in zip(torch.split(flat, self.numels), self.shapes)])[0]

    def _probe_layout(self, start: Tensor, layout: "_Layout", rng_devices: list) -> None:
        """One gradient evaluation at ``start`` (every client) on ``layout``, to learn the gradients' memory layout
        (:meth:`_learn_layout`); done once per engine, on the first step of its first round."""
        self.layout_learned = True
        W = start.unsqueeze(0).repeat(layout.num_clients, 1)
        ev = _StepEvaluator(self, layout, 0, None, rng_devices, None, trials=False)
        ev.learn_layout = True
        ev.gradient(W, torch.ones(layout.num_clients, dtype=torch.bool, device=W.device), flat=False)

    def _learn_layout(self, grads: Sequence[Tensor]) -> None:
        """Store every parameter of ``W`` in the memory order its gradient comes out of the backward pass in.

        Batching rules produce some gradients as permuted views (``linear`` with per-client weights gives the
        weight gradient transposed, ``[C, out, in]`` with strides of ``[C, in, out]``); adding such a gradient to
        a row-major block is a transposing copy that cost more than the rest of the SGD update. With the block
        stored in the gradient's order, updates, trial points and gradient concatenation are plain contiguous
        passes. Called on the first gradient evaluation of the engine; only the memory layout of ``W`` changes
        (the values and the ops on them are the same, up to the summation order of reductions such as norms)."""
        orders: List[Optional[Tuple[int, ...]]] = []
        for g, shape in zip(grads, self.shapes):
            order = None
            if g.dim() > 2 and g.shape[1:] == torch.Size(shape):
                dims = sorted(range(len(shape)), key=lambda d: (-g.stride(1 + d), d))
                if dims != list(range(len(shape))) and g.permute(0, *(1 + d for d in dims)).is_contiguous():
                    order = tuple(dims)
            orders.append(order)
        self.orders = orders
        self._views_of = None

    @contextmanager
    def _vmap_context(self):
        """While the model runs under vmap: ``self.log`` goes to the collector, RNN layers use :func:`_rnn_forward`."""
        model = self.model
        saved = {k: model.__dict__[k] for k in ("log", "log_dict") if k in model.__dict__}
        model.__dict__["log"], model.__dict__["log_dict"] = self.collector.log, self.collector.log_dict
        for rnn in self.rnns:
            rnn.__dict__["forward"] = functools.partial(_rnn_forward, rnn)
        saved_updates = [(m, m.__dict__.get("update")) for _, m in self.metric_modules]
        for name, m in self.metric_modules:
            m.__dict__["update"] = functools.partial(_refuse_metric_update, name)
        try:
            yield
        finally:
            for k in ("log", "log_dict"):
                model.__dict__.pop(k, None)
            model.__dict__.update(saved)
            for rnn in self.rnns:
                rnn.__dict__.pop("forward", None)
            for m, update in saved_updates:
                if update is None:
                    m.__dict__.pop("update", None)
                else:
                    m.__dict__["update"] = update

    def _row_values(self, views: List[Tensor], batch: Any, mask: Optional[Tensor], step: int, cells: bool = False):
        """One value per row of a :class:`_Layout` batch at the row weights ``views`` ([R, ...] each), and the
        values the model logged (list of ``(name, [R] tensor)``): whole rows give ``training_step``'s loss of the
        row; cell rows (``mask`` given) give the sum of the per-sample losses of the row's real cells, or, with
        ``cells``, the ``[R, n_max]`` per-sample losses themselves (padded cells included; logged values are still
        the masked sums)."""
        if mask is None:
            mode = "whole"
        elif self.per_sample_step is not None:
            mode = "per-sample protocol"
        elif self.intercept is not False:
            return self._intercepted_row_values(views, batch, mask, step, cells)
        else:
            mode = "per-sample"
        with self._vmap_context():
            if mode in self.probed:
                return self._row_values_vmapped(views, batch, mask, step, cells)
            if mode == "per-sample protocol":
                self._check_per_sample_protocol(views, batch, mask, step)
            tracker = _ModuleTracker(self.model)  # first call of each mode: name the layer if vmap fails
            try:
                with tracker:
                    out = self._row_values_vmapped(views, batch, mask, step, cells)
            except Exception as err:  # noqa: BLE001 - re-raised with the layer that failed
                where = tracker.failed_in or f"the model ({type(self.model).__name__})"
                raise VectorizationUnsupportedError(
                    f"client_execution='vectorized' failed in {where} while running the clients under "
                    f"torch.func.vmap: {type(err).__name__}: {err}. Use client_execution='sequential' (or 'auto' "
                    "to fall back automatically)"
                ) from err
            self.probed.add(mode)
            return out

    def _row_values_vmapped(self, views: List[Tensor], batch: Any, mask: Optional[Tensor], step: int,
                            want_cells: bool = False):
        model, collector = self.model, self.collector
        model_name = type(model).__name__
        leaves, spec = tree_flatten(batch)
        nv = len(views)

        def one_call(vs: Sequence[Tensor], b: Any):
            """``training_step(b, step)`` with the parameter slots holding ``vs`` (as ``functional_call``)."""
            collector.reset()
            with self._weights_in_slots(vs):
                loss = extract_loss(model.training_step(b, step), model_name)
            return (loss, *collector.values)

        # flat positional arguments and outputs: vmap's argument handling is a pytree walk per call
        if mask is None:
            def per_row(*args):
                return one_call(args[:nv], tree_unflatten(list(args[nv:]), spec))

            out = _vmap0(per_row, [*views, *leaves])
        elif self.per_sample_step is not None:
            n_max = mask.shape[1]

            as_loss: List[str] = []  # names logged with the loss tensor itself (Classifier's train/batch_loss)
            names: List[str] = []

            def per_row_samples(*args):
                """``training_step_per_sample`` on the row's whole (padded) batch: ``[n_max]`` losses."""
                collector.reset(per_sample=True)
                losses = self._per_sample_losses(args[:nv], tree_unflatten(list(args[nv:]), spec), step, n_max)
                own = [(n, v) for n, v in zip(collector.names, collector.values) if v is not losses]
                as_loss[:] = [n for n, v in zip(collector.names, collector.values) if v is losses]
                names[:] = [n for n, _ in own]
                return (losses, *[v for _, v in own])

            out = _vmap0(per_row_samples, [*views, *leaves])
            collector.reset()
            # values logged with another length than the batch have no per-sample meaning: dropped
            kept = [(name, v.detach().float()) for name, v in zip(names, out[1:]) if tuple(v.shape) == tuple(mask.shape)]
            return self._padded_result(out[0], mask, as_loss, kept, want_cells)
        else:
            def per_row_cells(*args):
                vs = args[:nv]

                def per_sample(*sample_leaves):  # a batch of one sample: [1, ...] each
                    return one_call(vs, tree_unflatten(list(sample_leaves), spec))

                return _vmap0(per_sample, args[nv:])

            # [R, n_max, 1, ...]: every cell a batch of one (the unsqueeze outside vmap is a plain view)
            cells = _vmap0(per_row_cells, [*views, *(x.unsqueeze(2) for x in leaves)])
            # [R, n_max] values of every cell; padded cells (repeated samples) count zero. The masked sums run
            # outside vmap (the same ops on the same [R, n_max] tensors, without their batching rules)
            kept = list(zip(list(collector.names), [_logged_value(v, 2) for v in cells[1:]]))
            return self._padded_result(cells[0], mask, [], kept, want_cells)
        return out[0], list(zip(list(collector.names), [_logged_value(v, 1) for v in out[1:]]))

    def _intercepted_row_values(self, views: List[Tensor], batch: Any, mask: Tensor, step: int, want_cells: bool):
        """:meth:`_row_values` of padded rows through per-sample loss interception
        (:mod:`fedlightning.vectorized_losses`): one ``training_step`` call per row on its whole padded batch, the
        standard losses computed per sample and averaged over the row's real samples.

        Used while it is recognised: ``training_step`` must return the output of an intercepted loss, and every
        value it logs must be one too or not depend on the client (a constant). On the first padded call of the
        engine, for models without random layers, the intercepted loss of the most padded row is checked against
        ``training_step`` on that row's real samples alone (a loss that is not a mean over samples, or a forward
        that mixes samples, fails it). If any of this fails, or the batched call raises, the engine uses the
        generic path (one ``training_step`` per sample) from then on, after restoring the random state the
        attempt started from, so the generic path computes exactly what it computes without this attempt. The
        path taken is logged once (rank-zero info line).
        """
        devices = [views[0].device] if views[0].device.type == "cuda" else []
        rng = None if self.deterministic else _rng_state(devices)
        first = self.intercept is None
        try:
            with self._vmap_context():
                if first:
                    reason = self._check_interception(views, batch, mask, step)
                    if reason is not None:
                        raise _NotIntercepted(reason)
                out = self._interception_vmapped(views, batch, mask, step, want_cells)
        except Exception as err:  # noqa: BLE001 - any failure of the fast path: the generic path decides
            self.collector.reset()
            if rng is not None:
                _set_rng_state(rng, devices)
            self.intercept = False
            self.padded_path_reason = str(err) if isinstance(err, _NotIntercepted) else f"{type(err).__name__}: {err}"
            _info(f"client_execution='vectorized': padded steps of {type(self.model).__name__} call training_step "
                  f"once per sample ({self.padded_path_reason})")
            return self._row_values(views, batch, mask, step, want_cells)
        if first:
            self.intercept = True
            self.padded_path_reason = "per-sample loss interception"
            _info(f"client_execution='vectorized': padded steps of {type(self.model).__name__} compute its loss per "
                  "sample by loss interception (one training_step call per client)")
        return out

    def _interception_vmapped(self, views: List[Tensor], batch: Any, mask: Tensor, step: int, want_cells: bool):
        model, collector = self.model, self.collector
        model_name = type(model).__name__
        leaves, spec = tree_flatten(batch)
        nv = len(views)
        n_max = mask.shape[1]
        m = mask.to(self.dtype)
        counts = m.sum(1)
        as_loss: List[str] = []  # names logged with the loss tensor itself
        names: List[str] = []  # other logged values, returned as [n_max] cells

        def per_row(*args):
            vs, row_mask, count = args[:nv], args[nv], args[nv + 1]
            collector.reset()
            interception = LossInterception(n_max, row_mask, count)
            with self._weights_in_slots(vs), interception:
                loss = extract_loss(model.training_step(tree_unflatten(list(args[nv + 2:]), spec), step), model_name)
            cells = interception.cells_of(loss)
            if cells is None:
                raise _NotIntercepted(_unrecognised("the loss training_step returns", interception))
            as_loss.clear()
            names.clear()
            logged = []
            for name, value in zip(collector.names, collector.values):
                own = interception.cells_of(value)
                if own is cells:
                    as_loss.append(name)
                    continue
                if own is None:
                    if _is_batched(value):
                        raise _NotIntercepted(_unrecognised(f"the value logged as {name!r}", interception))
                    own = row_mask * 0 + value.detach().reshape(())  # a constant: the same value in every cell
                names.append(name)
                logged.append(own)
            return (cells, *logged)

        out = _vmap0(per_row, [*views, m, counts, *leaves])
        collector.reset()
        kept = [(name, v.detach().float()) for name, v in zip(names, out[1:])]
        return self._padded_result(out[0], mask, list(as_loss), kept, want_cells)

    def _check_interception(self, views: List[Tensor], batch: Any, mask: Tensor, step: int) -> Optional[str]:
        """None if the intercepted loss of a padded row (see below) equals ``training_step`` on its real samples alone
        (at the row's weights, without gradients, in full precision), else the reason it does not. Skipped (None)
        for models with random layers, whose two calls draw different random numbers."""
        if not self.deterministic:
            return None
        leaves, spec = tree_flatten(batch)
        counts = mask.sum(1).tolist()
        n_max = mask.shape[1]
        # the most padded row whose padding is not whole copies of its batch (such copies keep batch means, which
        # would hide a forward pass that mixes samples), else the most padded row
        r = min(range(len(counts)), key=lambda i: (n_max % counts[i] == 0, counts[i]))
        k = int(counts[r])
        row = [v[r].detach() for v in views]
        model_name = type(self.model).__name__
        try:
            full_precision = torch.autocast(device_type=row[0].device.type, enabled=False)
        except RuntimeError:  # a device type autocast does not know
            full_precision = contextlib.nullcontext()
        with torch.no_grad(), torch.random.fork_rng(devices=[]), full_precision, self._weights_in_slots(row):
            interception = LossInterception(n_max, mask[r].to(self.dtype), mask[r].to(self.dtype).sum())
            with interception:
                padded = extract_loss(self.model.training_step(tree_unflatten([x[r] for x in leaves], spec), step),
                                      model_name)
            if interception.cells_of(padded) is None:
                self.collector.reset()
                return _unrecognised("the loss training_step returns", interception)
            real = extract_loss(self.model.training_step(tree_unflatten([x[r, :k] for x in leaves], spec), step),
                                model_name)
        self.collector.reset()
        low = self.dtype in (torch.float16, torch.bfloat16)
        if not torch.allclose(padded.double(), real.double(), rtol=2e-2 if low else 1e-4, atol=2e-2 if low else 1e-6,
                              equal_nan=True):
            return (f"its loss on a client's {k} real samples is {float(real):.6g} but the per-sample interception "
                    f"on the padded batch of {n_max} gives {float(padded):.6g}: the loss is not a mean of per-sample "
                    "losses, or the forward pass mixes samples")
        return None

    @staticmethod
    def _padded_result(cells: Tensor, mask: Tensor, as_loss: List[str], kept: List[Tuple[str, Tensor]],
                       want_cells: bool):
        """What :meth:`_row_values` returns for padded rows, from the ``[R, n_max]`` per-sample losses ``cells``:
        ``(sums, logged)``, or ``(cells, sums, logged)`` with ``want_cells`` (``sums`` then computed from the
        detached cells). ``as_loss`` names values logged as the loss tensor itself (their sums are the loss sums,
        not computed twice); ``kept`` are the other logged ``[R, n_max]`` values."""
        sums = _masked_sum(cells.detach() if want_cells else cells, mask)
        logged = [(name, sums.detach().float()) for name in as_loss] + [(n, _masked_sum(v, mask)) for n, v in kept]
        return (cells, sums, logged) if want_cells else (sums, logged)

    @contextmanager
    def _weights_in_slots(self, vs: Sequence[Tensor]):
        """The modules' parameter slots hold ``vs`` (one tensor per trainable parameter, a client's or a row's
        weights) inside the block, their Parameters again afterwards: what ``functional_call`` does, without its
        per-call name resolution."""
        slots = self.param_slots
        saved = [d[attr] for d, attr, _ in slots]
        try:
            for d, attr, i in slots:
                d[attr] = vs[i]
            yield
        finally:
            for (d, attr, _), t in zip(slots, saved):
                d[attr] = t

    def _per_sample_losses(self, vs: Sequence[Tensor], batch: Any, step: int, n: int) -> Tensor:
        """``model.training_step_per_sample(batch, step)`` with the parameter slots holding ``vs``; checked to be a
        tensor of ``n`` losses."""
        with self._weights_in_slots(vs):
            losses = self.per_sample_step(batch, step)
        if not isinstance(losses, Tensor) or tuple(losses.shape) != (n,):
            got = f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"{type(self.model).__name__}.training_step_per_sample must return one loss per sample (a tensor of "
                f"shape ({n},) for a batch of {n}), got {got}"
            )
        return losses

    def _check_per_sample_protocol(self, views: List[Tensor], batch: Any, mask: Tensor, step: int) -> None:
        """Once per engine, before the protocol is first used: ``training_step_per_sample(b)[j]`` must equal
        ``training_step`` on sample ``j`` alone (first client, its first two real samples, at the current weights,
        without gradients). Skipped for models with random layers, whose two calls draw different random numbers.
        A mismatch raises ``ValueError`` naming both values (a protocol that disagrees with ``training_step`` would
        silently train another objective in vectorised mode)."""
        if not self.deterministic:
            return
        leaves, spec = tree_flatten(batch)
        k = min(2, int(mask[0].sum()))
        row = [v[0].detach() for v in views]
        model_name = type(self.model).__name__
        # in the parameters' own dtype, without autocast: mixed precision would make two correct computations
        # differ by more than rounding (the same matrix product on batches of different shapes)
        try:
            full_precision = torch.autocast(device_type=row[0].device.type, enabled=False)
        except RuntimeError:  # a device type autocast does not know
            full_precision = contextlib.nullcontext()
        with torch.no_grad(), torch.random.fork_rng(devices=[]), full_precision:
            per = self._per_sample_losses(row, tree_unflatten([x[0, :k] for x in leaves], spec), step, k)
            with self._weights_in_slots(row):
                alone = torch.stack([
                    extract_loss(self.model.training_step(tree_unflatten([x[0, j:j + 1] for x in leaves], spec), step),
                                 model_name).reshape(())
                    for j in range(k)
                ])
        self.collector.reset()
        low = self.dtype in (torch.float16, torch.bfloat16)  # half-precision parameters ("16-true", "bf16-true")
        if not torch.allclose(per.double(), alone.double(), rtol=2e-2 if low else 1e-4, atol=2e-2 if low else 1e-6,
                              equal_nan=True):
            raise ValueError(
                f"{model_name}.training_step_per_sample disagrees with training_step: per-sample losses "
                f"{per.tolist()} but training_step on each of those samples alone gives {alone.tolist()}. Its entry j "
                "must be training_step's loss on sample j alone; fix it, or remove it to let the vectorised engine "
                "call training_step once per sample"
            )

    @staticmethod
    def _term_values(views: List[Tensor], terms: List[List[Callable]]) -> Tensor:
        """Σ of each client's objective terms, called on that client's parameter tensors (rows of the batch)."""
        values = []
        for c, client_terms in enumerate(terms):
            own = [v[c] for v in views]
            total = views[0].new_zeros(())
            for term in client_terms:
                total = total + term(own).reshape(())
            values.append(total)
        return torch.stack(values)

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
        local_steps: int,
        grad_clip: Optional[float] = None,
        terms: Optional[Sequence[Sequence[Callable[[Sequence[Tensor]], Tensor]]]] = None,
        router=None,
        float_buffer_mask: Optional[Sequence[bool]] = None,
    ) -> List[ClientUpdate]:
        """Train ``client_ids`` for ``local_steps`` steps from the global weights; one :class:`ClientUpdate` per
        client, in order, with the same fields as ``LocalTrainer.run``.

        ``optimizers`` are the clients' optimizer instances as the loop builds them (client state already set);
        after the round their per-client state holds what sequential training would have left in them, so
        ``get_client_state()`` / ``client_report()`` can be called on them.
        """
        client_ids = [int(c) for c in client_ids]
        C = len(client_ids)
        if C == 0:
            return []
        if isinstance(local_steps, bool) or int(local_steps) < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        if len(optimizers) != C:
            raise ValueError(f"got {len(optimizers)} optimizers for {C} clients")
        device = global_flat.device
        params = [p for p in self.model.parameters() if p.requires_grad]
        rule = make_batched_rule(optimizers, params, grad_clip, device)
        if terms is not None and len(terms) != C:
            raise ValueError(f"got objective terms for {len(terms)} clients, expected {C}")
        term_lists = [list(t) for t in terms] if terms is not None and any(terms) else None
        self.model.train()

        with torch.no_grad():
            start = torch.cat([p.detach().reshape(-1).to(self.dtype) for p in global_params])
        record = _StepRecord(C, device)
        alive = torch.ones(C, dtype=torch.bool, device=device)
        num_steps = torch.zeros(C, dtype=torch.long, device=device)
        batches = _RoundBatches(datamodule, client_ids, round, seed, int(local_steps), self.to_device)
        rng_devices = [device] if device.type == "cuda" else []
        log_sink: Optional[list] = [] if router is not None else None

        layouts: dict = {}
        with torch.random.fork_rng(devices=rng_devices):
            if not self.layout_learned:  # before the round's seeding: its random draws do not count
                self._probe_layout(start, _Layout(*batches.step(0)), rng_devices)
            W = self._stored(start).unsqueeze(0).repeat(C, 1)  # [C, D]: client c's weights in row c
            model_seed = derive_seed(seed, "model-vectorized", round, *client_ids)
            # what torch.manual_seed does to the generators this round uses (and only to them: torch.manual_seed
            # would also queue seeding of every lazily initialised accelerator, which fork_rng does not restore)
            torch.default_generator.manual_seed(model_seed)
            for d in rng_devices:
                torch.cuda.default_generators[d.index if d.index is not None else torch.cuda.current_device()
                                              ].manual_seed(model_seed)
            for k in range(int(local_steps)):
                layout = _Layout(*batches.step(k), cache=layouts)
                ev = _StepEvaluator(self, layout, k, term_lists, rng_devices, log_sink, trials=rule.uses_trials)
                ev.track_alive = rule.stops_on_nonfinite  # else every client trains every step
                rule.step(W, ev, record, alive)
                num_steps += alive.long()
                if rule.stops_on_nonfinite:
                    alive = alive & torch.isfinite(record.losses[-1])
        rule.finalize(optimizers)
        if log_sink:
            _feed_router(router, log_sink)
        return self._updates(client_ids, W, global_flat, datamodule, record, num_steps, global_buffers,
                             float_buffer_mask)

    def _updates(self, client_ids, W, global_flat, datamodule, record: _StepRecord, num_steps: Tensor,
                 global_buffers, float_buffer_mask) -> List[ClientUpdate]:
        K = len(record.losses)
        losses = torch.stack(record.losses).float().cpu()  # [K, C]
        step_sizes = torch.stack(record.step_sizes).double().cpu().t().tolist()  # [C][K]
        u = record.uniform_evaluations
        counts = torch.stack([num_steps, record.backtracks, record.forwards + u, record.backwards + u]).cpu().tolist()
        delta = global_flat.unsqueeze(0) - self._logical(W).to(global_flat.dtype)
        finite_delta = _rows_finite(delta).cpu().tolist()
        rows = delta.unbind(0)
        buffers = None
        if float_buffer_mask is not None and any(float_buffer_mask):
            # batch-statistics layers are refused, so no buffer changes during client training: every client
            # reports the global buffers, as LocalTrainer.run does for a model whose buffers stay untouched
            buffers = torch.cat([b.detach().reshape(-1).float() for b, m in zip(global_buffers, float_buffer_mask) if m])
        # clients that ran all K steps (the usual case): first loss, mean loss and finiteness of all at once
        by_client = losses.t().contiguous()  # [C, K]
        first_all = by_client[:, 0].tolist() if K else []
        mean_all = by_client.mean(dim=1).tolist()
        finite_all = torch.isfinite(by_client).all(dim=1).tolist()
        updates = []
        for c, cid in enumerate(client_ids):
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
                update.buffers = buffers.clone()
            if not finite_loss:
                update.failed, update.failure = True, "non-finite training loss"
            elif not finite_delta[c]:
                update.failed, update.failure = True, "non-finite model update"
            updates.append(update)
        return updates


class _NotIntercepted(Exception):
    """Per-sample loss interception does not apply to this call (the message says why)."""


def _unrecognised(what: str, interception: LossInterception) -> str:
    if interception.unrecognised:
        calls = ", ".join(sorted(set(interception.unrecognised)))
        return f"{what} is not a recognised mean loss (calls with other arguments or shapes: {calls})"
    return (f"{what} is not the output of a standard loss with reduction='mean' (F.cross_entropy, F.nll_loss, "
            "F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy[_with_logits] or their "
            "nn modules)")


def _is_batched(value: Tensor) -> bool:
    """Whether ``value`` carries vmap's batch dimension (depends on the client's weights or data)."""
    return _is_batchedtensor is None or _is_batchedtensor(value)


def _info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def _vmap0(fn: Callable[..., Tuple[Tensor, ...]], args: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """``torch.func.vmap(fn, randomness="different")(*args)`` for the engine's calls: flat tensor arguments all
    batched along dimension 0 (same size), ``fn`` returning a tuple of tensors, outputs batched along dimension 0.

    It drives functorch's primitives (``_vmap_increment_nesting``, ``_add_batch_dim``, ``_remove_batch_dim``)
    directly, as ``vmap``'s own ``_flat_vmap`` does, without the public wrapper's per-call pytree walks over
    arguments, ``in_dims`` and outputs (~45 µs per call, 20+ calls per round); ``tests/test_vectorized_speed_paths.py``
    checks it against ``vmap``. Falls back to ``vmap`` when the primitives are missing.
    """
    if _add_batch_dim is None:  # pragma: no cover
        return vmap(fn, randomness="different")(*args)
    size = args[0].shape[0]
    level = _vmap_increment_nesting(size, "different")
    try:
        outs = fn(*[_add_batch_dim(a, 0, level) for a in args])
        return tuple(_remove_batch_dim(o, level, size, 0) for o in outs)
    finally:
        _vmap_decrement_nesting()


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row sums of ``values`` ([R, n_max]) over the cells ``mask`` marks real (padded cells count zero)."""
    return torch.where(mask, values, values.new_zeros(())).sum(1)


def _rows_finite(x: Tensor) -> Tensor:
    """``torch.isfinite(x).all(dim=1)`` for a 2-d ``x``: every entry of a row is finite iff the row's largest and
    smallest entries are (NaN propagates through both reductions); about 10x cheaper than ``isfinite`` on CPU."""
    return torch.isfinite(x.amax(dim=1)) & torch.isfinite(x.amin(dim=1))


def _feed_router(router, log_sink: List[Tuple[List[Tuple[str, Tensor]], Optional[Tensor], Optional[Tensor]]]) -> None:
    """Give the loop's log router one value per gradient evaluation of every client still training, as sequential
    training does (the router ignores a line search's trial evaluations, which run without gradients).

    ``log_sink`` holds, per gradient evaluation, the logged ``[C]`` values (sums over real samples on padded steps),
    the sample counts to divide them by (None: whole batches) and the mask of clients still training (None: all);
    the values of all evaluations are divided and masked at once, in evaluation order."""
    by_name: Dict[str, List[Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]] = {}
    for logged, counts, evaluated in log_sink:
        for name, values in logged:
            by_name.setdefault(name, []).append((values, counts, evaluated))
    for name, parts in by_name.items():
        values = torch.stack([v.float() for v, _, _ in parts])  # [evaluations, C]
        if any(n is not None for _, n, _ in parts):
            ones = torch.ones(values.shape[1], dtype=torch.long, device=values.device)
            values = values / torch.stack([ones if n is None else n for _, n, _ in parts])  # x / 1 is exact
        if any(e is not None for _, _, e in parts):
            everyone = torch.ones(values.shape[1], dtype=torch.bool, device=values.device)
            values = values[torch.stack([everyone if e is None else e for _, _, e in parts])]
        router.captured.setdefault(name, []).extend(values.reshape(-1).unbind(0))


# ====================================================================== loop integration
def run_vectorized_round(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor) -> Optional[List[ClientUpdate]]:
    """The ClientUpdates of ``client_ids`` for ``plan``, trained in lockstep; None means "train them sequentially".

    Called by :meth:`FederatedLoop.training_step` when ``client_execution`` is ``"vectorized"`` or ``"auto"``. With
    ``"auto"``, the first round decides once for the run (:func:`_auto_decide`), and anything
    :class:`VectorizationUnsupportedError` reports makes the loop fall back to sequential training for the rest of
    the run, with a one-time warning. Per-client optimizer state is read from and written to ``loop.client_state``
    (namespace ``"optimizer"``) exactly as sequential training does.
    """
    mode = loop.client_execution
    if mode == "sequential" or not client_ids or loop.__dict__.get("_vectorized_fallback"):
        return None
    try:
        if mode == "auto" and "_auto_choice" not in loop.__dict__:
            if _auto_decide(loop, plan, client_ids, global_flat) == "sequential":
                loop.__dict__["_vectorized_fallback"] = True
                return None
        return _run(loop, plan, client_ids, global_flat)
    except VectorizationUnsupportedError as err:
        if mode != "auto":
            raise
        from lightning.pytorch.utilities import rank_zero_warn

        loop.__dict__["_vectorized_fallback"] = True
        loop.__dict__["_auto_choice"] = "sequential"
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
      exactly what it computes without the measurement. Vectorised is chosen when it is faster by
      :data:`AUTO_MARGIN` (:func:`auto_choice`). The measurement costs about one round of each mode, once.
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
    loop.__dict__["_auto_choice"] = choice
    loop.__dict__["_auto_reason"] = reason
    _info(f"client_execution='auto': training clients {choice} ({reason})")
    return choice


@contextmanager
def _throwaway_sequential(loop):
    """``loop.train_client`` calls inside leave no trace: logged values are discarded and no client state is
    written (``persist_client_state`` off for the block)."""
    router = getattr(loop._worker_trainer(), "router", None)
    captured = router.captured if router is not None else None
    persist = loop.persist_client_state
    loop.persist_client_state = False
    if router is not None:
        router.captured = {}
    try:
        yield
    finally:
        loop.persist_client_state = persist
        if router is not None:
            router.captured = captured


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(loop) -> "VectorizedClientTrainer":
    """The loop's engine for its working copy (built on first use; raises what the model cannot do)."""
    worker = loop._worker_trainer()
    hooks = getattr(worker, "hooks", None)
    if hooks is not None:
        raise VectorizationUnsupportedError(
            f"{worker.model_name} overrides the per-step hook(s) {', '.join(hooks.overridden)}, which "
            "client_execution='vectorized' cannot call per client; use client_execution='sequential' (or 'auto')"
        )
    engine: Optional[VectorizedClientTrainer] = loop.__dict__.get("_vectorized_engine")
    if engine is None or engine.model is not worker.model:
        engine = VectorizedClientTrainer(worker.model, to_device=worker.to_device)
        loop.__dict__["_vectorized_engine"] = engine
    return engine


def _run(loop, plan: RoundPlan, client_ids: Sequence[int], global_flat: Tensor,
         throwaway: bool = False) -> List[ClientUpdate]:
    """Mirror of ``FederatedLoop.train_client`` for all of ``client_ids`` at once; ``throwaway``: nothing is
    logged and no client state written (``auto``'s measurement)."""
    worker = loop._worker_trainer()
    engine = _engine(loop)
    dm = loop._datamodule()
    client_ids = [int(c) for c in client_ids]
    optimizers = []
    for cid in client_ids:
        opt = loop._make_client_optimizer(worker.params, cid, plan.client_lr_scale)
        if hasattr(opt, "set_client_data"):  # per-client epoch length b/n_i, as train_client
            opt.set_client_data(num_samples=dm.client_num_samples(cid), batch_size=dm.batch_size)
        optimizers.append(opt)
    hooks = loop._callbacks_with("client_objective")
    terms = []
    for cid in client_ids:
        client_terms: list = []
        for cb in hooks:
            client_terms.extend(cb.client_objective(loop, plan, cid) or [])
        terms.append(client_terms)
    gbuffers = list(loop.model.buffers())
    updates = engine.run(
        client_ids=client_ids,
        round=plan.round,
        seed=loop.seed,
        global_params=loop._global_params(),
        global_buffers=gbuffers,
        global_flat=global_flat,
        datamodule=dm,
        optimizers=optimizers,
        local_steps=plan.local_steps,
        grad_clip=loop.client_grad_clip,
        terms=terms,
        router=None if throwaway else getattr(worker, "router", None),
        float_buffer_mask=[b.is_floating_point() for b in gbuffers],
    )
    for update, opt in zip(updates, optimizers):
        if hasattr(opt, "client_report"):  # last-step scalars a strategy may use (FedSPS-Global)
            update.payload.update(opt.client_report())
        if loop.persist_client_state and not throwaway and hasattr(opt, "get_client_state") and not update.failed:
            loop.client_state.set("optimizer", update.client_id, opt.get_client_state())
    return updates
