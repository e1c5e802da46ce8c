"""What the vectorised engine can train, and the model features it adapts to.

:func:`check_model_vectorizable` refuses batch-statistics layers; the other refusals
(:class:`VectorizationUnsupportedError`, naming the layer or setting) come from the probes here (RNNs with
``proj_size``, torchmetrics updated in ``training_step``), from the engine (parameters of mixed dtypes, batches with
non-tensor leaves, layers ``vmap`` cannot run: found by the first batched call and reported with the module that was
executing), and from :func:`fedlightning.vectorized.rules.make_batched_rule` (client optimizers). With
``client_execution="auto"`` any of them makes the run fall back to sequential training with one warning.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from torch import Tensor, nn

from .torch_internals import BATCH_NORM_TYPES, DROPOUT_TYPES, INSTANCE_NORM_TYPES


class VectorizationUnsupportedError(ValueError):
    """The model, optimizer or data cannot be trained with ``client_execution="vectorized"``."""


def check_model_vectorizable(model: nn.Module) -> None:
    """Raise :class:`VectorizationUnsupportedError` naming the first layer that keeps batch statistics.

    ``BatchNorm`` normalises with statistics of the whole mini-batch (which padded rows would change) and updates
    running statistics in place (which ``vmap`` cannot do on a buffer shared by all clients); ``InstanceNorm`` is
    per-sample and only refused when it tracks running statistics. GroupNorm / LayerNorm are fine.
    """
    for name, module in model.named_modules():
        label = f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
        if isinstance(module, BATCH_NORM_TYPES):
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: batch-statistics layers (BatchNorm) "
                "depend on the whole mini-batch and update running statistics in place; use GroupNorm/LayerNorm, "
                "or client_execution='sequential' (or 'auto' to fall back automatically)"
            )
        if isinstance(module, INSTANCE_NORM_TYPES) and module.track_running_stats:
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized' cannot train layer {label}: it updates running statistics in "
                "place (track_running_stats=True); use client_execution='sequential' or 'auto'"
            )


def _per_sample_protocol(model: nn.Module) -> Optional[Callable[[Any, int], Tensor]]:
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
    for module in model.modules():
        if isinstance(module, DROPOUT_TYPES) and module.p > 0:
            return True
        if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1:
            return True
    return False


def _vmappable_rnns(model: nn.Module) -> List[nn.RNNBase]:
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
