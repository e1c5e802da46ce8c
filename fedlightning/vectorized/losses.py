r"""Per-sample loss interception: the vectorised engine's fast path for padded steps of users' modules.

On a *padded* step (the round's clients have batches of different sizes) every client's batch is padded to the
step's largest size ``n`` by repeating its own samples, and the engine needs each client's loss over its **real**
samples only. A module's ``training_step`` computes a *mean* over the whole (padded) batch, which would count the
repeated samples. While the engine calls ``training_step`` on a client's padded batch, :class:`LossInterception`
(a ``TorchFunctionMode``) catches the standard losses called with ``reduction="mean"``
(:data:`INTERCEPTED_LOSSES`: ``F.cross_entropy``, ``F.nll_loss``, ``F.mse_loss``, ``F.l1_loss``,
``F.smooth_l1_loss``, ``F.huber_loss``, ``F.binary_cross_entropy[_with_logits]`` and the ``nn`` modules that call
them) and returns the mean over the real samples instead, computed per sample with ops that all have ``vmap``
batching rules (``nll_loss`` has none and runs as a slow per-sample decomposition under ``vmap``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .torch_internals import TorchFunctionMode, _batched_nll, _physical

__all__ = ["AutocastLosses", "LossInterception", "INTERCEPTED_LOSSES", "_gathered_rows"]

_HALF = (torch.float16, torch.bfloat16)


def _autocast_upcast(*tensors: Tensor | None):
    """Half-precision floating tensors as float32 when autocast is on for their device (autocast runs these losses
    in float32); others unchanged."""
    out = []
    for t in tensors:
        if isinstance(t, Tensor) and t.dtype in _HALF and torch.is_autocast_enabled(t.device.type):
            t = t.float()
        out.append(t)
    return out


#: The losses that autocast computes in float32 on CPU and on CUDA (both of torch's float32 op lists name them),
#: whose float32 cast ``torch.func.vmap`` loses for some of them (on CPU: cross_entropy, nll_loss,
#: binary_cross_entropy_with_logits, l1_loss, poisson_nll_loss, hinge_embedding_loss, cosine_embedding_loss)
AUTOCAST_FLOAT32_LOSSES = frozenset(
    {
        F.cross_entropy,
        F.nll_loss,
        F.binary_cross_entropy_with_logits,
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.kl_div,
        F.poisson_nll_loss,
        F.hinge_embedding_loss,
        F.cosine_embedding_loss,
        F.margin_ranking_loss,
        F.soft_margin_loss,
        F.multi_margin_loss,
        F.multilabel_margin_loss,
        F.triplet_margin_loss,
    }
)


def _upcast_value(value: Any) -> Any:
    return _autocast_upcast(value)[0] if isinstance(value, Tensor) else value


class AutocastLosses(TorchFunctionMode):
    """Autocast's float32 policy for the losses of :data:`AUTOCAST_FLOAT32_LOSSES` while the model runs under
    ``vmap``: their half-precision floating arguments are cast to float32 when autocast is on for their device,
    as autocast casts them outside ``vmap``; every other call runs unchanged.

    Decision (ours): under ``vmap`` torch computes ``F.cross_entropy`` (and the other losses named above) of
    ``bf16-mixed`` logits in bfloat16, where the same call outside ``vmap`` computes in float32, so without this
    vectorized training's losses (and the step sizes and line-search tests built on them) would be rounded to
    bfloat16 where sequential training's are float32. The engine enters this mode for its batched calls when
    autocast is on (``tests/test_vectorized_per_sample.py``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in AUTOCAST_FLOAT32_LOSSES:
            args = tuple(_upcast_value(a) for a in args)
            kwargs = {k: _upcast_value(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _none_equal(target: Tensor, value: int) -> bool:
    """Whether no element of ``target`` (every row's, under vmap) equals ``value``, when that is known without a
    device synchronisation: checked on CPU tensors only (elsewhere False, and the caller takes its general path).

    Decision (ours, measured): without targets equal to ``ignore_index`` the class losses need neither the validity
    mask nor the weight sums ``D`` (``D`` is then the number of elements, the path ``d = None``), which saves seven of
    the interception's vmapped ops on each padded step; both paths give the same values bit for bit
    (``tests/test_vectorized_user_losses.py``). A step's targets are usually a view of the round's gathered targets:
    the answer for that whole tensor is kept (:data:`_NONE_EQUAL_SEEN`) while it is alive and unchanged (same
    version counter), so the round's steps do not check again; nor do a line search's trial calls, whose rows are
    gathered from them (:func:`_gathered_rows`)."""
    if target.device.type != "cpu":
        return False
    rows = _physical(target)
    if rows is None:
        return False
    base = rows._base
    if base is not None and _gathered_without(rows, base, value):
        return True
    if base is not None and base.numel() <= 64 * rows.numel():
        version = _version(base)
        if version is not None:
            key = (id(base), value)
            seen = _NONE_EQUAL_SEEN.get(key)
            if seen is None or seen[0]() is not base or seen[1] != version:
                if len(_NONE_EQUAL_SEEN) >= 16:
                    _NONE_EQUAL_SEEN.clear()
                seen = _NONE_EQUAL_SEEN[key] = (weakref.ref(base), version, not bool((base == value).any()))
            if seen[2]:
                return True
    return not bool((rows == value).any())


#: (id of a tensor, value) -> (weak reference to the tensor, its version, whether none of its elements equals the
#: value): the tensors :func:`_none_equal` checked whole (the round's targets), at most 16 at a time; an entry counts
#: only while its tensor is that same tensor, unchanged
_NONE_EQUAL_SEEN: dict[tuple[int, int], tuple[Any, int, bool]] = {}

#: id of a reusable buffer -> (weak reference to it, its version, the storage range ``[first, end)`` of the rows
#: gathered into it, the values none of their elements equals): see :func:`_gathered_rows`; at most 16 at a time
_GATHERED: dict[int, tuple[Any, int, tuple[int, int], tuple[int, ...]]] = {}


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (moves on every in-place write); None for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _extent(t: Tensor) -> tuple[int, int] | None:
    """The storage range ``[first, last + 1)`` that ``t`` covers; None for negative strides."""
    if any(stride < 0 for stride in t.stride()):
        return None
    first = t.storage_offset()
    return first, first + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1


def _gathered_rows(dest: Tensor, source: Tensor) -> None:
    """Record that ``dest``, a view of a reusable buffer, now holds rows gathered from ``source``
    (``index_select`` along dimension 0): a value :func:`_none_equal` found in no element of ``source``'s tensor is
    in none of ``dest``'s either, until the buffer is written again (its version moves on).

    Decision (ours): a line search's trial calls gather their rows' targets from the step's, which the step's
    gradient evaluation checked; without this record each trial call checked its gathered targets again (an ``eq``,
    an ``any`` and a synchronisation per call; docs/benchmarks.md §9, "Points no layer needs", has the A/B of this
    change together with the left-out batch rows)."""
    src, dst = source._base, dest._base
    extent = _extent(dest)
    if src is None or dst is None or extent is None:
        return
    src_version, dst_version = _version(src), _version(dst)
    if src_version is None or dst_version is None:
        return
    values = tuple(
        value
        for (ident, value), (ref, version, none) in _NONE_EQUAL_SEEN.items()
        if ident == id(src) and none and version == src_version and ref() is src
    )
    if values:
        if len(_GATHERED) >= 16 and id(dst) not in _GATHERED:
            _GATHERED.clear()
        _GATHERED[id(dst)] = (weakref.ref(dst), dst_version, extent, values)
    else:
        _GATHERED.pop(id(dst), None)


def _gathered_without(rows: Tensor, base: Tensor, value: int) -> bool:
    """Whether ``rows``, a view of ``base``, lies within rows that :func:`_gathered_rows` recorded (unchanged since)
    from a tensor none of whose elements equals ``value``."""
    hit = _GATHERED.get(id(base))
    if hit is None or value not in hit[3] or hit[0]() is not base or _version(base) != hit[1]:
        return False
    inside = _extent(rows)
    return inside is not None and hit[2][0] <= inside[0] and inside[1] <= hit[2][1]


def _flattened(rows: int, n: int, dim: int) -> bool:
    """Whether a loss input whose first dimension is ``rows`` (``dim`` dimensions) is a flattened batch of ``n``
    samples: ``[n·T, ...]`` with ``T ≥ 2``, as ``logits.reshape(-1, C)`` of ``[n, T, C]`` gives (ours: read as
    ``n`` samples of ``T`` consecutive rows each; see :class:`LossInterception`)."""
    return dim >= 1 and rows > n and rows % n == 0


def _per_sample(a: Tensor, d: Tensor | None, n: int) -> tuple[Tensor, Tensor | None]:
    """``a`` and ``d`` of a flattened batch (:func:`_flattened`) as ``[n, T, ...]``: sample ``j``'s rows together."""
    return a.reshape(n, -1, *a.shape[1:]), None if d is None else d.reshape(n, -1, *d.shape[1:])


def _class_loss(
    logp: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, smoothing: float, n: int
) -> tuple[Tensor, Tensor | None] | None:
    """``(a, d)`` for cross-entropy / NLL on log-probabilities ``logp`` ([n, C, ...], or a flattened batch
    ``[n·T, C]``: then ``[n, T]`` each); None if not recognised."""
    if logp.dim() == 2 and _flattened(logp.shape[0], n, 2):
        parts = _class_loss(logp, target, weight, ignore_index, smoothing, logp.shape[0])
        return None if parts is None else _per_sample(*parts, n)
    if logp.dim() < 2 or logp.shape[0] != n:
        return None
    C = logp.shape[1]
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != C):
        return None
    if not target.is_floating_point():  # class indices
        if tuple(target.shape) != (logp.shape[0], *logp.shape[2:]):
            return None
        # without targets equal to ignore_index every target is valid: no validity mask, no weight sums (d = None),
        # the same values with fewer ops
        valid = None if _none_equal(target, ignore_index) else target != ignore_index

        def kept(x: Tensor) -> Tensor:  # x on valid targets, 0 on ignored ones
            return x if valid is None else torch.where(valid, x, 0.0)

        safe = target if valid is None else torch.where(valid, target, 0)
        nll = -logp.gather(1, safe.unsqueeze(1)).squeeze(1)
        if weight is None:
            d = None if valid is None else valid.to(logp.dtype)
            a = kept(nll)
        else:
            d = kept(weight.to(logp.dtype)[safe])
            a = d * nll
        if smoothing > 0:
            wc = logp if weight is None else logp * weight.to(logp.dtype).view(1, C, *([1] * (logp.dim() - 2)))
            a = (1 - smoothing) * a + (smoothing / C) * kept(-wc.sum(1))
        return a, d
    if tuple(target.shape) != tuple(logp.shape):  # class probabilities
        return None
    t = target.to(logp.dtype)
    if smoothing > 0:
        t = t * (1 - smoothing) + smoothing / C
    prod = logp * t
    if weight is not None:
        prod = prod * weight.to(logp.dtype).view(1, C, *([1] * (logp.dim() - 2)))
    return -prod.sum(1), None


def _log_softmax_classes(input: Tensor) -> Tensor:
    """``F.log_softmax(input, 1)``, through the class dimension's transpose for a 2-D float32 CPU input with 3 to 15
    classes.

    Decision (ours, measured): torch's CPU kernel for a log-softmax over the *last* dimension is slow when that
    dimension is shorter than an AVX-512 vector of float32 (16); through the kernel for an inner dimension, forward
    and backward of 20 clients' vmapped ``[31, 10]`` logits (the padded digits batches) run 1.49–1.84× faster, one
    thread (``python benchmarks/engine_paths.py --threads 1``; docs/benchmarks.md §3). The two kernels agree to float
    rounding (``tests/test_vectorized_user_losses.py``). Other devices, dtypes and class counts use the plain call."""
    K = input.shape[1]
    if input.dim() == 2 and 3 <= K < 16 and input.dtype == torch.float32 and input.device.type == "cpu":
        return F.log_softmax(input.transpose(0, 1), 0).transpose(0, 1)
    return F.log_softmax(input, 1)


def _plain_nll(
    n: int, input: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, smoothing: float, log_softmax: bool
) -> tuple[Tensor, None] | None:
    """``(a, None)`` with ``a = −log p_y`` per sample through :func:`_batched_nll` (two kernels on the tensors under
    vmap's batch dimension) for the common case, ``[n, K]`` input and ``[n]`` int64 class targets without class
    weights, label smoothing or targets equal to ``ignore_index``: the values of :func:`_class_loss` bit for bit.
    None otherwise, and :func:`_class_loss` runs. (:func:`_batched_nll` checks the shapes and dtypes itself.)"""
    if (
        weight is not None
        or smoothing > 0
        or input.dim() != 2
        or input.shape[0] != n
        or not _none_equal(target, ignore_index)
    ):
        return None
    a = _batched_nll(input, target, log_softmax)
    return None if a is None else (a, None)


def _cross_entropy(n, input, target, weight=None, ignore_index=-100, label_smoothing=0.0, **_):
    input, weight = _autocast_upcast(input, weight)
    if input.dim() < 2:
        return None
    plain = _plain_nll(n, input, target, weight, ignore_index, float(label_smoothing), True)
    if plain is not None:
        return plain
    return _class_loss(_log_softmax_classes(input), target, weight, ignore_index, float(label_smoothing), n)


def _nll_loss(n, input, target, weight=None, ignore_index=-100, **_):
    input, weight = _autocast_upcast(input, weight)
    if target.is_floating_point():  # nll_loss takes class indices only
        return None
    plain = _plain_nll(n, input, target, weight, ignore_index, 0.0, False)
    if plain is not None:
        return plain
    return _class_loss(input, target, weight, ignore_index, 0.0, n)


def _elementwise(formula: Callable[..., Tensor], weighted: bool = False) -> Callable[..., tuple | None]:
    """A handler for an elementwise loss ``formula(input, target, **options)``; ``weighted``: its ``weight`` /
    ``pos_weight`` arguments are part of the formula (else a given ``weight`` is not recognised)."""

    def handler(n, input, target, weight=None, **options):
        if input.dim() >= 1 and _flattened(input.shape[0], n, input.dim()):
            parts = handler(input.shape[0], input, target, weight, **options)
            return None if parts is None else _per_sample(*parts, n)
        if input.dim() < 1 or input.shape[0] != n or tuple(target.shape) != tuple(input.shape):
            return None
        if weight is not None and not weighted:
            return None
        extra = [options.get("pos_weight")] if "pos_weight" in options else []
        for t in [weight, *extra]:
            if t is not None and torch.broadcast_shapes(t.shape, input.shape) != input.shape:
                return None
        input, target, weight, *extra = _autocast_upcast(input, target, weight, *extra)
        if "pos_weight" in options:
            options = {**options, "pos_weight": extra[0]}
        a = formula(input, target.to(input.dtype), weight=weight, **options)
        return None if a is None else (a, None)

    return handler


def _mse(x, y, weight=None, **_):
    return (x - y) ** 2


def _l1(x, y, weight=None, **_):
    return (x - y).abs()


def _smooth_l1(x, y, weight=None, beta=1.0, **_):
    z = (x - y).abs()
    if beta == 0:
        return z
    return torch.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)


def _huber(x, y, weight=None, delta=1.0, **_):
    z = (x - y).abs()
    return torch.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))


def _bce(p, y, weight=None, **_):
    if torch.is_autocast_enabled(p.device.type):
        return None  # torch refuses binary_cross_entropy under autocast: let the original call say so
    a = -(y * torch.clamp_min(torch.log(p), -100) + (1 - y) * torch.clamp_min(torch.log(1 - p), -100))
    return a if weight is None else a * weight


def _bce_logits(x, y, weight=None, pos_weight=None, **_):
    log_sig = F.logsigmoid(x)
    if pos_weight is None:
        a = (1 - y) * x - log_sig
    else:
        a = (1 - y) * x - (1 + (pos_weight - 1) * y) * log_sig
    return a if weight is None else a * weight


#: The functions :class:`LossInterception` recognises, with their handlers.
INTERCEPTED_LOSSES: dict[Callable, Callable[..., tuple | None]] = {
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_loss,
    F.mse_loss: _elementwise(_mse),
    F.l1_loss: _elementwise(_l1),
    F.smooth_l1_loss: _elementwise(_smooth_l1),
    F.huber_loss: _elementwise(_huber),
    F.binary_cross_entropy: _elementwise(_bce, weighted=True),
    F.binary_cross_entropy_with_logits: _elementwise(_bce_logits, weighted=True),
}
_SIGNATURES = {f: inspect.signature(f) for f in INTERCEPTED_LOSSES}


def _two_argument_defaults(sig: inspect.Signature) -> dict[str, Any] | None:
    """The defaults of every parameter after ``input`` and ``target`` when the signature starts with those two and
    all the others have defaults; None otherwise."""
    params = list(sig.parameters.values())
    if len(params) < 2 or [p.name for p in params[:2]] != ["input", "target"]:
        return None
    if any(p.default is inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[2:]):
        return None
    return {p.name: p.default for p in params[2:]}


#: Defaults of the losses' optional parameters: a call ``f(input, target, **options)`` (how ``torch.nn.functional``
#: hands its losses to a function mode: the two tensors positional, every option by keyword) is bound by a dict
#: merge instead of ``inspect.Signature.bind`` on every step.
_TWO_ARGUMENT_CALLS = {
    f: d for f, d in ((f, _two_argument_defaults(s)) for f, s in _SIGNATURES.items()) if d is not None
}
_ALIASES = (Tensor.detach, Tensor.clone, torch.clone)


class LossInterception(TorchFunctionMode):
    r"""While active, the losses of :data:`INTERCEPTED_LOSSES` with ``reduction="mean"`` on a padded batch of ``n``
    samples return the mean over the real samples:

    ===================================================  ===============================================================
    function (and the ``nn`` module that calls it)        per-element loss ``a`` and weight ``d`` (``L = Σa / Σd``)
    ===================================================  ===============================================================
    ``F.cross_entropy`` (``nn.CrossEntropyLoss``),        class targets: ``a = v·[(1−ε)·w_y·(−log p_y) +
    ``F.nll_loss`` (``nn.NLLLoss``; ``ε = 0``, input      ε/C·Σ_c w_c(−log p_c)]``, ``d = v·w_y`` (``v``: target ≠
    are the log-probabilities)                            ``ignore_index``; ``w``: class ``weight``, 1 without);
                                                          probability targets: ``a = −Σ_c w_c·t'_c·log p_c`` with
                                                          ``t' = (1−ε)t + ε/C``, ``d = 1``
    ``F.mse_loss`` / ``F.l1_loss``                        ``(x−y)²`` / ``|x−y|``, ``d = 1``
    ``F.smooth_l1_loss(beta)`` / ``F.huber_loss(delta)``  torch's piecewise formulas, ``d = 1``
    ``F.binary_cross_entropy``                            ``−w·(y·max(log p, −100) + (1−y)·max(log(1−p), −100))``,
                                                          ``d = 1``
    ``F.binary_cross_entropy_with_logits``                ``w·((1−y)·x − (1 + (pw−1)·y)·logσ(x))``, ``d = 1``
    ===================================================  ===============================================================

    These are the reductions torch documents for ``reduction="mean"`` (for class targets the weighted mean
    ``Σ w_y ℓ / Σ w_y`` over the targets that are not ignored, label smoothing sharing that denominator; otherwise the
    mean over all elements). With the padded batch's first dimension as the sample dimension, ``A_j`` / ``D_j`` are the
    sums of ``a`` / ``d`` over sample ``j``'s elements, and the intercepted call returns

    .. math::
        L = \frac{\sum_j m_j A_j}{\sum_j m_j D_j} = \sum_j \frac{m_j}{n_i} c_j, \qquad
        c_j = \frac{A_j}{\tfrac{1}{n_i}\sum_k m_k D_k}

    (``m``: the row's mask of real samples, ``n_i`` its count): exactly the loss sequential training computes on the
    client's real batch, written as the weighted sum of per-sample *cells* ``c_j`` the engine's padded-step backward
    uses. Without class weights or ignored targets ``D_j`` is the number of elements per sample and
    ``Σ_k m_k D_k / n_i`` is that number exactly, so ``c_j`` is sample ``j``'s own mean loss.

    What is recognised (anything else runs the original function unchanged; decisions ours):

    * ``reduction="mean"`` with the legacy ``size_average`` / ``reduce`` unset; ``input.dim() >= 1`` (``>= 2`` for the
      class losses) with ``input.shape[0] == n``; elementwise losses need ``target.shape == input.shape`` (a
      broadcasting pair mixes samples) and ``weight`` / ``pos_weight`` that broadcast to ``input``'s shape; class
      targets of shape ``input.shape[:1] + input.shape[2:]`` or probability targets of ``input``'s shape.
    * With ``flattened`` (the engine sets it for models without random layers, whose interception check runs), a
      flattened batch: ``input.shape[0] = n·T`` with ``T ≥ 2`` (2-D for the class losses: ``[n·T, C]`` logits and
      ``[n·T]`` targets, the language-model form ``F.cross_entropy(logits.reshape(-1, C), labels.reshape(-1))``) is
      read as ``n`` samples of ``T`` consecutive rows each, the order ``reshape`` of a ``[n, T, ...]`` tensor gives,
      where every call's targets confirm it (:meth:`_sample_major`: the padding samples' target rows repeat those of
      the samples they copy). Another order (a time-major ``[T, n, ...]`` flattened, two views concatenated along the
      batch) fails that on a padded step and is not recognised, as the engine's check of the path (a client's
      intercepted loss against ``training_step`` on its real samples alone) would find; the padded steps then take
      the per-sample path.
    * ``F.mse_loss`` / ``F.l1_loss`` / ``F.huber_loss`` with their ``weight`` argument are not recognised (its mean
      normalisation is not a documented per-element formula); ``F.binary_cross_entropy`` under autocast is not
      recognised (torch refuses it there).
    * Under autocast, half-precision inputs are upcast to float32 first, as autocast's policy does for these losses.
    * The output of a recognised call is remembered (with its cells); ``Tensor.detach`` / ``clone`` of it are
      remembered as the same loss. The engine uses the cells only when ``training_step`` returns such an output and
      every value it logs is one (or does not depend on the client); otherwise it falls back to its generic path.

    Args:
        n: the padded batch size (the first dimension of the loss inputs).
        mask: ``[n]`` 1 for real samples, 0 for padding (floating; under ``vmap`` a client's row).
        count: the number of real samples (``mask.sum()``; a scalar tensor).
        weights: ``mask / count`` (computed when not given; the engine passes the rows' weights, computed once for
            all clients outside ``vmap``).

    After the call, :meth:`cells_of` gives the ``[n]`` per-sample cells of an intercepted output (None for any
    other tensor), and ``unrecognised`` names the loss calls that ran unchanged.
    """

    def __init__(self, n: int, mask: Tensor, count: Tensor, weights: Tensor | None = None, flattened: bool = False):
        super().__init__()
        self.n, self.mask, self.count = n, mask, count
        self.flattened = flattened
        self.weights = mask / count if weights is None else weights  # m_j / n_i
        self._outputs: dict[int, tuple[Tensor, Tensor]] = {}  # id(output) -> (output, cells); output kept alive
        self.unrecognised: list = []

    def _sample_major(self, target: Tensor) -> bool:
        """Whether a flattened batch's ``target`` (``[n·T, ...]``) read as ``n`` samples of ``T`` consecutive rows
        repeats each padding sample's rows where the padding repeats its samples (sample ``j ≥ n_i`` is a copy of
        sample ``j mod n_i``), in every client row: a structural check of the reading, on the data, not on the
        losses (which can agree by chance, e.g. every loss ``log V`` under a zero-initialised head, where the
        gradient still reaches the wrong samples). A time-major flatten or two views concatenated along the batch
        fail it wherever a client's batch is padded."""
        try:
            t = target.reshape(self.n, -1)
            idx = torch.arange(self.n, device=t.device) % self.count.to(torch.long).clamp_min(1)
            same = (t.index_select(0, idx) == t).all()
        except RuntimeError:
            return False
        plain = _physical(same)
        return plain is not None and bool(plain.all())

    def cells_of(self, value: Any) -> Tensor | None:
        hit = self._outputs.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = INTERCEPTED_LOSSES.get(func)
        if handler is not None:
            out = self._intercept(func, handler, args, kwargs)
            if out is not None:
                return out
            self.unrecognised.append(func.__name__)
        out = func(*args, **kwargs)
        if func in _ALIASES and args and isinstance(out, Tensor):
            cells = self.cells_of(args[0])
            if cells is not None:
                self._outputs[id(out)] = (out, cells.detach() if func is Tensor.detach else cells)
        return out

    def _intercept(self, func, handler, args, kwargs) -> Tensor | None:
        defaults = _TWO_ARGUMENT_CALLS.get(func) if len(args) == 2 else None
        if defaults is not None and kwargs.keys() <= defaults.keys():
            options = {**defaults, **kwargs, "input": args[0], "target": args[1]}
        else:
            try:
                bound = _SIGNATURES[func].bind(*args, **kwargs)
            except TypeError:
                return None  # let the original call raise its own error
            bound.apply_defaults()
            options = dict(bound.arguments)
        if options.pop("reduction") != "mean":
            return None
        if options.pop("size_average", None) is not None or options.pop("reduce", None) is not None:
            return None
        if not isinstance(options.get("input"), Tensor) or not isinstance(options.get("target"), Tensor):
            return None
        rows, dim = (options["input"].shape[0], options["input"].dim()) if options["input"].dim() else (0, 0)
        if rows != self.n and _flattened(rows, self.n, dim):
            if not self.flattened or not self._sample_major(options["target"]):
                return None
        parts = handler(self.n, **options)
        if parts is None:
            return None
        a, d = parts
        n = self.n
        w = self.weights if self.weights.dtype == a.dtype else self.weights.to(a.dtype)
        one_per_sample = a.dim() == 1  # [n]: one element per sample, no per-sample sums
        A = a if one_per_sample else a.reshape(n, -1).sum(1)
        per_sample = 1 if one_per_sample else a[0].numel()
        if d is None:  # every element weighs 1: Σ_k m_k D_k / n_i is the number of elements per sample
            cells = A if per_sample == 1 else A / per_sample
        else:
            D = d if one_per_sample else d.reshape(n, -1).sum(1)
            mask = self.mask if self.mask.dtype == a.dtype else self.mask.to(a.dtype)
            count = self.count if self.count.dtype == a.dtype else self.count.to(a.dtype)
            cells = A / ((mask * D).sum() / count)  # exactly A / per-sample elements when no weight or ignored target
        loss = (cells * w).sum()
        self._outputs[id(loss)] = (loss, cells)
        return loss
