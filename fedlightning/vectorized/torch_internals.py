r"""Every use of torch internals by the vectorised engine, each next to its public fallback.

* :func:`_vmap0`: ``torch.func.vmap(fn, randomness="different")`` through functorch's own primitives (fallback:
  ``torch.func.vmap``); :func:`_is_batched` (fallback: every value counts as batched); :func:`_physical`, the tensor
  under a batched one (fallback: unknown, and its callers take their general path).
* :func:`_batched_linear` / :func:`_linear_forward`: a linear layer with the clients' weights as one ``baddbmm`` on
  the tensors under vmap's batch dimension (fallback: vmap's own rule for ``F.linear``); :func:`_offer_linear_rows`
  lets the engine compute such a layer's rows another way first (a line search's trial rows).
* :func:`_batched_nll`: cross-entropy / NLL per sample for class targets as ``log_softmax`` + ``nll_loss`` on the
  tensors under vmap's batch dimension (fallback: the interception's vmapped formula).
* :func:`_rnn_forward`: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` in plain tensor ops, put
  in the layers' ``forward`` while the model runs under vmap (the fused kernels have no batching rule).
* :func:`_parameter_slots` / :func:`_tensors_in_slots`: the clients' tensors in the modules' parameter dicts
  (``nn.Module._parameters``) during a batched call, which ``torch.func.functional_call`` does per call.
* Random state (:func:`_rng_state`, :func:`_set_rng_state`, :func:`_seed_default_generators`).
* ``tree_flatten`` / ``tree_unflatten`` (``torch.utils._pytree``, no public module); the private base classes of
  batch norm, instance norm and dropout (fallback: their public subclasses); ``torch._foreach_add_`` (fallback: one
  ``add_`` per tensor); ``TorchFunctionMode`` (``torch.overrides``, not in its ``__all__``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode  # the base of losses.LossInterception
from torch.utils._pytree import tree_flatten, tree_unflatten  # the engine's pytree helpers

from .errors import VectorizationUnsupportedError

try:  # functorch's own primitives, which torch.func.vmap drives (see _vmap0)
    from torch._C._functorch import _add_batch_dim, _remove_batch_dim, _vmap_decrement_nesting, _vmap_increment_nesting
except ImportError:  # pragma: no cover - a torch without them: the public vmap is used
    _add_batch_dim = None
try:
    from torch._C._functorch import is_batchedtensor as _is_batchedtensor
except ImportError:  # pragma: no cover - every logged value then counts as client-dependent
    _is_batchedtensor = None
try:  # run a function on plain tensors inside vmap as outside any transform (_NarrowRowsLinear)
    from torch._C._functorch import pop_dynamic_layer_stack as _pop_dynamic_layer_stack
    from torch._C._functorch import push_dynamic_layer_stack as _push_dynamic_layer_stack
except ImportError:  # pragma: no cover - narrow layers' weight gradients then come from baddbmm's backward
    _pop_dynamic_layer_stack = _push_dynamic_layer_stack = None
try:
    from torch._C._functorch import get_unwrapped as _get_unwrapped
except ImportError:  # pragma: no cover - _physical then knows no tensor
    _get_unwrapped = None

__all__ = [
    "BATCH_NORM_TYPES",
    "DROPOUT_TYPES",
    "INSTANCE_NORM_TYPES",
    "SYNC_BATCH_NORM_TYPES",
    "TorchFunctionMode",
    "_EmbeddingLookups",
    "tree_flatten",
    "tree_unflatten",
    "_backward_hooks",
    "_batched_nll",
    "_foreach_add_",
    "_is_batched",
    "_linear_forward",
    "_linear_rows",
    "_offer_linear_rows",
    "_parameter_slots",
    "_physical",
    "_embedding_forward",
    "_plain_linears",
    "_rng_state",
    "_rnn_forward",
    "_seed_default_generators",
    "_set_rng_state",
    "_shadowed_forwards",
    "_tensors_in_slots",
    "_vmap0",
]
_no_torch_function = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)
try:  # the batch level and dimension of a batched tensor (the batched linear layer, _batched_linear)
    from torch._C._functorch import maybe_current_level as _maybe_current_level
    from torch._C._functorch import maybe_get_bdim as _maybe_get_bdim
    from torch._C._functorch import maybe_get_level as _maybe_get_level
except ImportError:  # pragma: no cover - linear layers then run through vmap's own batching rule
    _maybe_current_level = None
try:  # the private bases of the layers the engine runs per client or replays (batch statistics, random masks)
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    BATCH_NORM_TYPES: tuple[type, ...] = (_BatchNorm,)
    INSTANCE_NORM_TYPES: tuple[type, ...] = (_InstanceNorm,)
    DROPOUT_TYPES: tuple[type, ...] = (_DropoutNd,)
except ImportError:  # pragma: no cover - their public subclasses
    BATCH_NORM_TYPES = (
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.LazyBatchNorm1d,
        nn.LazyBatchNorm2d,
        nn.LazyBatchNorm3d,
        nn.SyncBatchNorm,
    )
    INSTANCE_NORM_TYPES = (
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.LazyInstanceNorm1d,
        nn.LazyInstanceNorm2d,
        nn.LazyInstanceNorm3d,
    )
    DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
SYNC_BATCH_NORM_TYPES: tuple[type, ...] = (nn.SyncBatchNorm,)


# ====================================================================== vmap
def _vmap0(fn: Callable[..., tuple[Tensor, ...]], args: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``torch.func.vmap(fn, randomness="different")(*args)`` for the engine's calls: flat tensor arguments all
    batched along dimension 0 (same size), ``fn`` returning a tuple of tensors, outputs batched along dimension 0.

    It drives functorch's primitives (``_vmap_increment_nesting``, ``_add_batch_dim``, ``_remove_batch_dim``)
    directly, as ``vmap``'s own ``_flat_vmap`` does, without the public wrapper's per-call pytree walks over
    arguments, ``in_dims`` and outputs (a fixed cost per call, and a round makes many calls; docs/benchmarks.md §3);
    ``tests/test_vectorized_speed_paths.py`` checks it against ``vmap``. Falls back to ``vmap`` when the primitives
    are missing.
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


def _is_batched(value: Tensor) -> bool:
    """Whether ``value`` carries vmap's batch dimension (depends on the client's weights or data)."""
    return _is_batchedtensor is None or _is_batchedtensor(value)


def _physical(value: Tensor) -> Tensor | None:
    """The plain tensor holding every row's values of ``value``: the tensor under its vmap batch dimension when it
    carries one level of it, ``value`` itself when it carries none; None when it is batched more than once or
    functorch's accessor is missing. For checks on data that hold for all rows at once (read, never written)."""
    if _is_batchedtensor is None or _get_unwrapped is None:  # pragma: no cover
        return None
    if not _is_batchedtensor(value):
        return value
    inner = _get_unwrapped(value)
    return None if _is_batchedtensor(inner) else inner


def _one_level(value: Tensor, level: int) -> tuple[Tensor | None, bool]:
    """``(physical, batched)``: for a tensor batched once, at ``level``, the plain tensor under it with the batch
    dimension moved to the front (a view) and True; for a plain tensor ``(None, False)``; for any other tensor
    (batched at another level or more than once) ``(None, True)``."""
    if not _is_batchedtensor(value):
        return None, False
    inner = _physical(value) if _maybe_get_level(value) == level else None
    if inner is None:
        return None, True
    bdim = _maybe_get_bdim(value)
    return (inner if bdim == 0 else inner.movedim(bdim, 0)), True


def _current_level(*values: Any) -> int | None:
    """The innermost vmap level when every one of ``values`` is a tensor (None outside vmap, without functorch's
    accessor, or for a non-tensor)."""
    if _maybe_current_level is None or not all(isinstance(v, Tensor) for v in values):  # pragma: no cover
        return None
    return _maybe_current_level()


def _rows_of(value: Tensor, level: int, rows: int) -> Tensor | None:
    """``value``'s rows at ``level`` as a plain tensor with them in front: the tensor under the batch dimension when
    it is batched once at ``level``, ``value`` expanded over ``rows`` when it is not batched (shared by the rows),
    None when it is batched otherwise."""
    physical, batched = _one_level(value, level)
    if physical is not None:
        return physical
    return None if batched else value.expand(rows, *value.shape)


def _batched_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    r"""``F.linear(input, weight, bias)`` inside the engine's vmap as one ``baddbmm`` on the plain tensors:
    ``y_c = b_c + x_c W_c^\top`` for every row ``c`` (``bmm`` without a bias), returned batched at the current level;
    None where it does not apply, and the caller runs ``F.linear`` itself.

    It applies inside a vmap (no other functorch transform innermost) when ``weight`` is batched once, at the current
    level (the clients' weights), ``input`` is batched once at that level or not at all (then shared by the rows),
    ``bias`` is None, batched likewise or not at all, and all three have one floating dtype. Under autocast
    (``bf16-mixed``), float32 weights and inputs are cast to autocast's dtype as ``F.linear`` casts them, and the
    product runs in it: torch's own vmap rule for a linear layer with a bias returns float32 under CPU autocast, while
    a sequential client's ``F.linear`` returns bfloat16.

    Decision (ours, measured): vmap's rule for a linear layer with batched weights runs ``addmm``'s decomposition (a
    transpose, expands, reshapes, ``bmm``, ``mul`` by ``beta``, ``add``), about ten operations forward and as many
    autograd nodes backward; here it is one ``baddbmm`` and three views. The values are those of the rule (a
    batched matrix product plus the bias, the same products; ``tests/test_vectorized_speed_paths.py`` compares
    values and gradients); the digits MLPs' vectorized rounds take 3–5 % less time with it
    (``benchmarks/engine_ab.py``, docs/benchmarks.md §3).

    Decision (ours, measured): without autograd (a line search's trial rows) on a CPU, a layer with fewer than 16
    outputs (a classifier head: 2, 4, 10 classes) and at least 16 input rows per client is computed transposed,
    ``y^T = b + W x^T``, and handed on as a transposed view. The batched product with a narrow last dimension takes a
    slow kernel path: 1.5–4.5× the time of the transposed product for 2 to 12 outputs, about equal at 16 and above
    (``benchmarks/engine_paths.py``, "linear rows"). Each output is the same dot product, summed in another order by
    the kernel: a trial loss only decides a line search's step, where rounding already may. Gradient evaluations
    keep the plain product forward, whose values are a per-client ``F.linear``'s bit for bit on this CPU (the
    transposed product's are not; ``benchmarks/engine_paths.py`` prints both checks), and only a narrow layer's
    weight gradient is taken in the fast orientation (:class:`_NarrowRowsLinear`). With the transposed head in
    gradient evaluations too, the float32 runs of the digits workload left sequential training's weights by other
    amounts after 10 rounds, as rounding that grows where a ReLU input or an Armijo test sits at its boundary does:
    FedAvg 6.0e-8 → 2.5e-7, FedSLS 1.2e-7 → 1.3e-4, FedExpSLS 3.1e-7 → 6.7e-3, FedDANE 4.3e-3 → 1.8e-7
    (docs/benchmarks.md §3)."""
    level = _current_level(input, weight)
    if level is None:
        return None
    W, _ = _one_level(weight, level)
    if W is None or W.dim() != 3:
        return None
    x = _rows_of(input, level, W.shape[0])
    if x is None or x.dim() < 2:
        return None
    dtype = W.dtype
    device_type = W.device.type
    autocast = torch.is_autocast_enabled(device_type)  # F.linear's autocast cast; torch's vmap rule keeps float32
    if autocast:
        target = torch.get_autocast_dtype(device_type)
        if dtype != torch.float32 or x.dtype not in (torch.float32, target):
            return None
    elif x.dtype != dtype or not dtype.is_floating_point or x.numel() == 0:
        return None
    C = W.shape[0]
    b = None
    if bias is not None:
        b = _rows_of(bias, level, C) if isinstance(bias, Tensor) else None
        if b is None or b.dim() != 2 or b.dtype != dtype:
            return None
    if autocast:
        with torch.autocast(device_type, enabled=False):
            x2 = x.reshape(C, -1, x.shape[-1]).to(target)
            y = _rows_product(x2, W.to(target), None if b is None else b.to(target))
        return _add_batch_dim(y.reshape(*x.shape[:-1], W.shape[1]), 0, level)
    y = _rows_linear(x, W, b) if _rows_linear is not None else None
    if y is None:
        y = _linear_rows(x, W, b, narrow=not torch.is_grad_enabled())
    return _add_batch_dim(y, 0, level)


def _linear_rows(x: Tensor, W: Tensor, b: Tensor | None, narrow: bool = False) -> Tensor:
    """The rows' linear layer on plain tensors, rows in front: ``x`` ``[R, ..., in]``, ``W`` ``[R, out, in]``, ``b``
    ``[R, out]`` or None; ``[R, ..., out]`` (see :func:`_batched_linear`; ``narrow``: a narrow layer may be computed
    transposed). A narrow CPU layer whose weights need a gradient goes through :class:`_NarrowRowsLinear`."""
    x2 = x.reshape(W.shape[0], -1, x.shape[-1])
    out = W.shape[1]
    if narrow and out < _NARROW_OUT and x2.shape[1] >= _NARROW_OUT and W.device.type == "cpu":  # y^T = W x^T
        yt = torch.bmm(W, x2.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(2), W, x2.transpose(1, 2))
        y = yt.transpose(1, 2)
    else:
        y = _narrow_weight_gradient(x2, W, b) if _narrow_weight_gradient_applies(x2, W) else None
        if y is None:
            y = _rows_product(x2, W, b)
    return y.reshape(*x.shape[:-1], out)


def _rows_product(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
    r"""``b + x W^\top`` per row as one batched product (``x`` ``[R, m, in]``, ``W`` ``[R, out, in]``, ``b``
    ``[R, out]`` or None): the plain forward of :func:`_linear_rows`, which :class:`_NarrowRowsLinear` computes too."""
    return torch.bmm(x, W.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), x, W.transpose(1, 2))


def _narrow_weight_gradient_applies(x: Tensor, W: Tensor) -> bool:
    """Whether ``W``'s gradient may be taken through :class:`_NarrowRowsLinear`: a CPU layer with fewer than
    ``_NARROW_OUT`` outputs and at least as many inputs, its weights needing a gradient."""
    return (
        W.shape[1] < _NARROW_OUT <= x.shape[-1]
        and W.device.type == "cpu"
        and W.requires_grad
        and torch.is_grad_enabled()
        and _pop_dynamic_layer_stack is not None
    )


def _narrow_weight_gradient(x: Tensor, W: Tensor, b: Tensor | None) -> Tensor | None:
    """:class:`_NarrowRowsLinear` on the plain tensors ``x``, ``W``, ``b``, outside vmap or inside one vmap level (the
    engine's), which is set aside for the call; None inside more levels (the caller takes the plain product)."""
    if not torch._C._are_functorch_transforms_active():
        return _NarrowRowsLinear.apply(x, W, b)
    saved = _pop_dynamic_layer_stack()
    try:
        if torch._C._are_functorch_transforms_active():  # another transform around the engine's vmap
            return None
        return _NarrowRowsLinear.apply(x, W, b)
    finally:
        _push_dynamic_layer_stack(saved)


class _NarrowRowsLinear(torch.autograd.Function):
    r"""``y = b + x W^\top`` per row (``x`` ``[R, m, in]``, ``W`` ``[R, out, in]``, ``b`` ``[R, out]`` or None) whose
    backward pass computes the weight gradient as ``g_y^\top x`` (``[R, out, in]``, the last dimension wide).

    Decision (ours, measured): for a narrow layer on CPU (fewer than 16 outputs, at least 16 inputs: a classifier
    head), the weight gradient of ``baddbmm``'s own backward pass, ``(x^\top g_y)^\top``, is a batched product whose
    last dimension is ``out``: the slow kernel path that :func:`_batched_linear` describes, 4.4–6× the time of
    ``g_y^\top x`` for 4 to 10 outputs, about equal at 16 (``benchmarks/engine_paths.py``, "head weight gradient"
    and "its product alone"; the digits MLP's vectorized SGD rounds about 6 % faster, ``benchmarks/engine_ab.py``).
    Each entry is the same sum over the rows' samples; ``g_y^\top x`` is the orientation ``F.linear``'s own backward
    takes for a row-major weight (``mm_mat2_backward``), and on this CPU it equals a per-client ``F.linear``'s
    weight gradient bit for bit, which ``baddbmm``'s ``(x^\top g_y)^\top`` does not for narrow layers (a few
    float32 ulps; ``benchmarks/engine_paths.py`` prints both checks). The forward product, and the input and bias
    gradients, are the plain ``baddbmm``'s (same calls, same values): the forward values decide ReLU kinks, where
    rounding would grow (see :func:`_batched_linear`).

    Every gradient evaluation takes it, those before a line search included. An Armijo test at a grid point close
    to its boundary turns on the gradient's last bits, so either product moves some float32 trajectories away from
    sequential training's; over 24 runs (three line searches, eight initial weights, 10 rounds;
    docs/benchmarks.md §3) the two products left the weights equally close to sequential training's (``g_y^\top x``
    closer in 8 runs, ``(x^\top g_y)^\top`` in 5, equal in 11).

    The engine applies it to the plain tensors under vmap's batch dimension with functorch's layer stack set aside
    for the call (:func:`_linear_rows`): an ``autograd.Function`` applied under vmap would need a vmap rule, and
    functorch's path for one costs more than the product saves; set aside, it records one autograd node, as outside
    vmap."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds its arguments through
    # inspect.signature on every call (1.4 % of a FedExpSLS round: benchmarks/engine_ab.py --algorithm FedExpSLS)
    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, W)
        ctx.has_bias = b is not None
        return _rows_product(x, W, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, W = ctx.saved_tensors
        gx = torch.bmm(g, W) if ctx.needs_input_grad[0] else None
        gW = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gW, gb


#: Output widths below this are computed transposed on CPU (:func:`_batched_linear`).
_NARROW_OUT = 16


#: Set by :func:`_offer_linear_rows` (None: not offered): a callable that :func:`_batched_linear` offers the plain
#: tensors of every batched linear layer first, see there.
_rows_linear: Callable[[Tensor, Tensor, Tensor | None], Tensor | None] | None = None


@contextmanager
def _offer_linear_rows(fn: Callable[[Tensor, Tensor, Tensor | None], Tensor | None]):
    """While active, :func:`_batched_linear` first calls ``fn(x, W, b)`` with a batched linear layer's plain tensors,
    rows in front (``x`` ``[R, ..., in]``, ``W`` ``[R, out, in]``, ``b`` ``[R, out]`` or None); a tensor ``fn``
    returns (``[R, ..., out]``) is the layer's output, None leaves the layer to the batched product. The engine's
    line search uses it to compute trial rows whose weights are known to lie on a line
    (:class:`~fedlightning.vectorized.trials._LineTrials`)."""
    global _rows_linear
    previous, _rows_linear = _rows_linear, fn
    try:
        yield
    finally:
        _rows_linear = previous


def _batched_nll(input: Tensor, target: Tensor, log_softmax: bool) -> Tensor | None:
    r"""``-log p_y`` of every sample (``[n]``, batched at the current level) for logits (``log_softmax``) or
    log-probabilities ``input`` ``[n, K]`` and class indices ``target`` ``[n]`` (int64) inside the engine's vmap,
    computed on the tensors under the batch dimension: ``log_softmax`` over the classes and one ``nll_loss`` with
    ``reduction="none"`` for all rows; None where it does not apply, and the caller takes its vmapped formula.

    It applies when ``input`` is batched once, at the current level, with two logical dimensions and a floating
    dtype, and ``target`` is an int64 ``[n]`` batched likewise or not at all (shared by the rows). The caller checks
    that no target equals ``ignore_index`` (``nll_loss`` would give those 0, the formula's masked value).

    Decision (ours, measured): vmap's rules for the formula ``-gather(log_softmax(x), y)`` run about fifteen
    operations forward and backward (views, ``gather``, ``neg``, and ``new_zeros`` + ``scatter_add`` backward);
    here it is two kernels each way, the same values bit for bit (``nll_loss`` negates the gathered entry;
    ``tests/test_vectorized_speed_paths.py``). For float32 CPU logits with 3 to 15 classes the log-softmax runs over
    the class dimension transposed to the middle, as :func:`~fedlightning.vectorized.losses._log_softmax_classes`
    decides and for the same measured reason."""
    level = _current_level(input, target)
    if level is None:
        return None
    X, _ = _one_level(input, level)
    if X is None or X.dim() != 3 or not X.dtype.is_floating_point or target.dtype != torch.int64:
        return None
    C, n, K = X.shape
    T = _rows_of(target, level, C)
    if T is None or tuple(T.shape) != (C, n) or n == 0 or K == 0:
        return None
    nll = torch.nn.functional.nll_loss
    with _no_torch_function():  # plain kernels: the engine's loss interception would otherwise see these calls
        if log_softmax and X.device.type == "cpu" and X.dtype == torch.float32 and 3 <= K < 16:
            cells = nll(torch.log_softmax(X.transpose(1, 2), 1), T, reduction="none")
        else:
            if log_softmax:
                X = torch.log_softmax(X, 2)
            cells = nll(X.reshape(C * n, K), T.reshape(C * n), reduction="none").view(C, n)
        return _add_batch_dim(cells, 0, level)


def _linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)``, through :func:`_batched_linear` where it applies. Its operations bypass
    ``__torch_function__`` handling (``torch._C.DisableTorchFunction``): the engine's loss interception, a function
    mode, would otherwise take a Python call for each of them."""
    with _no_torch_function():
        out = _batched_linear(input, weight, bias)
    return torch.nn.functional.linear(input, weight, bias) if out is None else out


def _linear_forward(module: nn.Linear, input: Tensor) -> Tensor:
    return _linear(input, module.weight, module.bias)


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's ``nn.Linear`` layers (and subclasses) that run ``nn.Linear``'s own ``forward``: while the model runs
    under vmap, the engine has them compute through :func:`_linear_forward` (:func:`_shadowed_forwards`).

    Decision (ours, measured): the layers, not ``F.linear`` itself, are redirected. Catching ``F.linear`` with a
    ``TorchFunctionMode`` costs a Python call on every torch function the model calls, which took back the gain on
    the bundled MLP (``benchmarks/engine_ab.py``); a module's own ``F.linear`` calls keep vmap's rule."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__
    ]


def _embedding_forward(module: nn.Embedding, input: Tensor) -> Tensor:
    """``nn.Embedding.forward`` of a layer with ``padding_idx`` under the engine's vmap: the lookup without
    ``padding_idx``, and the padding positions' rows detached, so that they read the padding row's value (forward
    unchanged) and send it no gradient, as ``padding_idx`` does.

    Decision (ours, measured): torch's batching rule of the embedding backward with a ``padding_idx`` keeps the
    padding row's gradient at zero for the first client only; the other clients' padding rows received the
    gradient of every padding position (``tests/test_vectorized_shared_state.py``)."""
    out = torch.nn.functional.embedding(input, module.weight, None, module.max_norm, module.norm_type, False, False)
    return torch.where((input == module.padding_idx).unsqueeze(-1), out.detach(), out)


class _EmbeddingLookups(TorchFunctionMode):
    """While active, ``F.embedding`` calls that do not come through an ``nn.Embedding`` layer the engine redirects
    (:func:`_embedding_forward`) — the function called in the module's own code, an ``nn.Embedding`` subclass with
    its own ``forward`` — compute as the engine needs: with a ``padding_idx``, the lookup without it and the padding
    positions' rows detached (:func:`_embedding_forward`'s form: the same values, and no gradient to the padding
    row, which torch's batching rule gives every client but the first); with ``max_norm``, ``scale_grad_by_freq`` or
    ``sparse``, refused by name (:func:`~fedlightning.vectorized.support._padded_embeddings` refuses them on layers).
    Other calls run unchanged. ``seen``: whether such a call was made.

    Decision (ours): a mode costs a Python call on every torch function the model calls, so the engine keeps it on
    only for models whose first batched call made such a lookup (``_ModelCall``); a lookup that only later steps
    make (behind a condition on the step) is not caught."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.embedding:
            return func(*args, **kwargs)
        bound = _EMBEDDING_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        settings = [
            f"{name}={a[name]!r}"
            for name, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False))
            if a[name] != off
        ]
        if settings:
            self.seen = True
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train an embedding looked up with {', '.join(settings)} "
                "(F.embedding called in the module's code): use client_execution='sequential' (or 'auto' to fall "
                "back automatically)"
            )
        if a["padding_idx"] is None:
            return func(*args, **kwargs)
        self.seen = True
        input, weight, padding_idx = a["input"], a["weight"], int(a["padding_idx"])
        if padding_idx < 0:
            padding_idx += weight.shape[0]
        out = torch.nn.functional.embedding(input, weight)
        return torch.where((input == padding_idx).unsqueeze(-1), out.detach(), out)


_EMBEDDING_SIGNATURE = inspect.signature(torch.nn.functional.embedding)


# ====================================================================== recurrent layers
def _rnn_forward(module: nn.RNNBase, input: Tensor, hx: Any | None = None):
    r"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` forward written with plain tensor ops, which ``vmap`` can batch
    (the fused ``aten::lstm`` / ``gru`` / ``rnn`` kernels have no batching rule).

    The gate equations are PyTorch's (gate order LSTM ``i, f, g, o``; GRU ``r, z, n``):

    .. math::
        \text{LSTM: } c' = \sigma(f) c + \sigma(i)\tanh(g),\ h' = \sigma(o)\tanh(c'); \qquad
        \text{GRU: } n = \tanh(W_{in}x + b_{in} + \sigma(r)(W_{hn}h + b_{hn})),\ h' = (1-\sigma(z)) n + \sigma(z) h

    with ``[i|f|g|o] = W_{ih}x + b_{ih} + W_{hh}h + b_{hh}``. Supports ``num_layers``, ``bias``, ``batch_first``,
    ``bidirectional``, inter-layer ``dropout`` (training mode) and unbatched 2-d inputs, as the module does; the input
    projections of all time steps are one matmul per layer and direction, the recurrence a loop over time. On a CPU
    this per-time-step loop is slower than the fused kernels sequential training uses (docs/benchmarks.md §3).
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
        h0, c0 = hx if mode == "LSTM" else (hx, None)
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
            projected = _linear(seq, w_ih, b_ih)  # [B, T, G·H] for all time steps at once
            h = h0[layer * D + d]
            c = c0[layer * D + d] if c0 is not None else None
            steps = []
            for t in range(T):
                rec = _linear(h, w_hh, b_hh)
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


@contextmanager
def _shadowed_forwards(forwards: Sequence[tuple[nn.Module, Callable[..., Any]]]):
    """Inside the block, each module of ``forwards`` (``(module, fn)`` pairs) runs ``fn(module, *args)`` (an instance
    ``forward`` that shadows the class's; hooks still run, as ``nn.Module.__call__`` calls it); the class's own
    ``forward`` again afterwards. The engine pairs recurrent layers with :func:`_rnn_forward` and linear layers
    (:func:`_plain_linears`) with :func:`_linear_forward`."""
    for module, fn in forwards:
        module.__dict__["forward"] = functools.partial(fn, module)
    try:
        yield
    finally:
        for module, _ in forwards:
            module.__dict__.pop("forward", None)


# ====================================================================== parameter slots
def _parameter_slots(model: nn.Module, named: Sequence[tuple[str, Tensor]]) -> list[tuple[dict[str, Any], str, int]]:
    """``(module._parameters, attribute, index into named)`` for every (module, attribute) slot that holds one of
    the trainable parameters ``named``.

    Tied parameters (one Parameter in several modules) give one slot per module, so every slot receives the
    client's tensor (``functional_call``'s untie/retie pass is not needed); a shared module reached under several
    paths is one slot.
    """
    index = {id(p): i for i, (_, p) in enumerate(named)}
    slots: dict[tuple[int, str], str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in index:
            owner, _, attr = n.rpartition(".")
            slots.setdefault((id(model.get_submodule(owner)), attr), n)
    out = []
    for n in slots.values():
        owner, _, attr = n.rpartition(".")
        out.append((model.get_submodule(owner)._parameters, attr, index[id(model.get_parameter(n))]))
    return out


@contextmanager
def _tensors_in_slots(slots: Sequence[tuple[dict[str, Any], str, int]], vs: Sequence[Tensor]):
    """The parameter ``slots`` (:func:`_parameter_slots`) hold ``vs`` (one tensor per trainable parameter, a
    client's or a row's weights) inside the block, their Parameters again afterwards: what ``functional_call``
    does, without its per-call name resolution."""
    saved = [d[attr] for d, attr, _ in slots]
    try:
        for d, attr, i in slots:
            d[attr] = vs[i]
        yield
    finally:
        for (d, attr, _), t in zip(slots, saved):
            d[attr] = t


# ====================================================================== random state
def _rng_state(cuda_devices) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda_devices]


def _set_rng_state(state, cuda_devices) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(cuda_devices, state[1]):
        torch.cuda.set_rng_state(s, d)


def _seed_default_generators(seed: int, cuda_devices: Sequence[torch.device]) -> None:
    """What ``torch.manual_seed(seed)`` does to the CPU generator and to the default generators of
    ``cuda_devices``, and only to them: ``torch.manual_seed`` would also queue seeding of every lazily initialised
    accelerator, which ``torch.random.fork_rng`` does not restore."""
    torch.default_generator.manual_seed(seed)
    for d in cuda_devices:
        index = d.index if d.index is not None else torch.cuda.current_device()
        generators = getattr(torch.cuda, "default_generators", None)
        if generators is None:  # pragma: no cover - the public per-device call
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        else:
            generators[index].manual_seed(seed)


# ====================================================================== foreach
def _foreach_add_(tensors: list[Tensor], others: Sequence[Tensor], alpha: float) -> None:
    """``t += alpha * o`` for every pair: ``torch._foreach_add_`` (one fused call), else one ``add_`` per tensor."""
    if hasattr(torch, "_foreach_add_"):
        torch._foreach_add_(tensors, others, alpha=alpha)
    else:  # pragma: no cover
        for t, o in zip(tensors, others):
            t.add_(o, alpha=alpha)


def _backward_hooks(model: nn.Module) -> list[str]:
    """What runs on ``model``'s backward pass outside its functional computation, which the engine's batched
    gradients (``torch.func`` over the clients' stacked weights) never call: each module's full backward hooks and
    backward pre-hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``, and the older
    ``register_backward_hook``), the global module backward hooks (``torch.nn.modules.module``), and each parameter's
    gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``); described, e.g. ``"a backward hook on
    'net.2' (Linear)"``."""
    from torch.nn.modules import module as module_registry

    found = []
    for kind in ("_global_backward_hooks", "_global_backward_pre_hooks"):
        if getattr(module_registry, kind, None):
            found.append("a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook)")
            break
    for name, module in model.named_modules():
        label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
        if getattr(module, "_backward_hooks", None) or getattr(module, "_backward_pre_hooks", None):
            found.append(f"a backward hook on {label}")
    for name, param in model.named_parameters():
        if getattr(param, "_backward_hooks", None) or getattr(param, "_post_accumulate_grad_hooks", None):
            found.append(f"a gradient hook on parameter '{name}'")
    return found
