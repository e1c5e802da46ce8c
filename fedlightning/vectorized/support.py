"""What the vectorised engine can train, and the model features it adapts to.

:func:`check_model_vectorizable` refuses normalisation layers it cannot run per client (``SyncBatchNorm``, subclasses
that override ``forward``); BatchNorm and instance norm with running statistics run per client
(:mod:`fedlightning.vectorized.norms`), torchmetrics metrics used in ``training_step`` are recorded and replayed per
client (:mod:`fedlightning.vectorized.metrics`). The other refusals (:class:`VectorizationUnsupportedError`, naming
the layer, metric or setting) come from the probes here (RNNs with ``proj_size``), from those two modules (metric
arguments that cannot be split per client, a batch of one value per channel), from the engine (parameters of mixed
dtypes, batches with non-tensor leaves, layers ``vmap`` cannot run: found by the first batched call and reported with
the module that was executing) and from :func:`fedlightning.vectorized.rules.make_batched_rule` (client optimizers).
With ``client_execution="auto"`` any of them makes the run fall back to sequential training with one warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .errors import VectorizationUnsupportedError
from .torch_internals import (
    BATCH_NORM_TYPES,
    DROPOUT_TYPES,
    INSTANCE_NORM_TYPES,
    SYNC_BATCH_NORM_TYPES,
    _backward_hooks,
)

__all__ = [
    "VectorizationUnsupportedError",
    "check_model_vectorizable",
    "_has_random_layers",
    "_norm_layers",
    "_padded_embeddings",
    "_per_sample_protocol",
    "_vmappable_rnns",
]


def check_model_vectorizable(model: nn.Module) -> None:
    """Raise :class:`VectorizationUnsupportedError` naming the first normalisation layer the engine cannot run per
    client: ``SyncBatchNorm`` (its statistics span processes) and subclasses of BatchNorm / InstanceNorm that override
    ``forward`` (the engine runs the layers' standard computation, :mod:`fedlightning.vectorized.norms`).
    BatchNorm, InstanceNorm, GroupNorm and LayerNorm are fine. Also refused: hooks on the backward pass (a module's
    backward hook, a parameter's gradient hook), which the batched gradients never call, so the clients would train
    as if they were not there (forward hooks and forward pre-hooks run)."""
    hooks = _backward_hooks(model)
    if hooks:
        raise VectorizationUnsupportedError(
            f"client_execution='vectorized' cannot run {hooks[0]}"
            + (f" (and {len(hooks) - 1} more)" if len(hooks) > 1 else "")
            + ": the clients' gradients are computed in one batched call that calls no backward hook, so they would "
            "train as if it were not there; use client_execution='sequential' (or 'auto' to fall back automatically)"
        )
    _norm_layers(model)


def _norm_layers(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(label, module, is_instance_norm)`` of the BatchNorm layers and of the InstanceNorm layers that track running
    statistics (the layers :class:`~fedlightning.vectorized.norms._NormLayers` runs); refuses the others (see
    :func:`check_model_vectorizable`)."""
    found = []
    for name, module in model.named_modules():
        label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
        if isinstance(module, SYNC_BATCH_NORM_TYPES):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: SyncBatchNorm computes its statistics "
                "across processes; use BatchNorm, or client_execution='sequential' (or 'auto' to fall back "
                "automatically)"
            )
        instance = isinstance(module, INSTANCE_NORM_TYPES)
        if not (isinstance(module, BATCH_NORM_TYPES) or instance):
            continue
        base = INSTANCE_NORM_TYPES[0] if instance else BATCH_NORM_TYPES[0]
        if getattr(type(module), "forward", None) is not getattr(base, "forward", None):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: it overrides forward, and the engine runs "
                f"{base.__name__}'s own computation per client; use client_execution='sequential' (or 'auto')"
            )
        if instance and not module.track_running_stats:
            continue  # per-sample statistics, no buffers: vmap runs it as it is
        found.append((label, module, instance))
    return found


def _per_sample_protocol(model: nn.Module) -> Callable[[Any, int], Tensor] | None:
    """The model's bound ``training_step_per_sample``, if it may stand in for ``training_step``, else None.

    Decisions (ours): the protocol is optional. A model may define ``training_step_per_sample(batch, batch_idx)``
    returning ``[n]`` losses, entry ``j`` being ``training_step``'s loss on sample ``j`` alone (values it logs are
    ``[n]`` tensors, averaged over real samples). Padded steps then make one batched call per client row instead of
    one ``training_step`` call per sample: the same numbers, faster (docs/benchmarks.md §3). The reference models
    (:class:`fedlightning.models.Classifier`) define it. For models without random layers it is checked once per
    engine against ``training_step`` on single samples (``_ModelCall._check_per_sample_protocol`` in
    :mod:`fedlightning.vectorized.call`).

    It is used only when it is defined on the class that defines ``training_step`` or on a subclass of it: a
    subclass that overrides ``training_step`` (another loss, a regulariser) and inherits
    ``training_step_per_sample`` from its base would otherwise train the base's objective.
    """
    if not callable(getattr(model, "training_step_per_sample", None)):
        return None
    mro = type(model).__mro__

    def owner(name: str) -> type | None:
        return next((cls for cls in mro if name in cls.__dict__), None)

    step_owner, sample_owner = owner("training_step"), owner("training_step_per_sample")
    if sample_owner is None or step_owner is None or not issubclass(sample_owner, step_owner):
        return None
    return model.training_step_per_sample


def _has_random_layers(model: nn.Module) -> bool:
    """Dropout layers with p > 0, or stacked RNNs with inter-layer dropout (randomness ``vmap`` must replay)."""
    for module in model.modules():
        if isinstance(module, DROPOUT_TYPES) and module.p > 0:
            return True
        if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1:
            return True
    return False


def _vmappable_rnns(model: nn.Module) -> list[nn.RNNBase]:
    """The model's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` layers, checked for what
    :func:`~fedlightning.vectorized.torch_internals._rnn_forward` supports."""
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


def _padded_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The model's ``nn.Embedding`` layers with a ``padding_idx`` that run the class's own ``forward``: under vmap they
    compute through :func:`_embedding_forward`. ``scale_grad_by_freq`` (the gradient divided by each index's count in
    the batch, which padded cells would change), ``sparse`` gradients and ``max_norm`` (the looked-up rows renormalised
    in place in the weight, a write into every client's shared tensor that autograd then refuses) are refused by name
    (decision, ours)."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding):
            continue
        if m.scale_grad_by_freq or m.sparse or m.max_norm is not None:
            setting = (
                "scale_grad_by_freq=True"
                if m.scale_grad_by_freq
                else "sparse=True"
                if m.sparse
                else f"max_norm={m.max_norm!r}"
            )
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer '{name}' (Embedding) with {setting}: "
                "use client_execution='sequential' (or 'auto' to fall back automatically)"
            )
        if m.padding_idx is not None and type(m).forward is nn.Embedding.forward and "forward" not in m.__dict__:
            found.append(m)
    return found
