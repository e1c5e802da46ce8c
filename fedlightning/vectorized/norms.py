r"""BatchNorm (and InstanceNorm with running statistics) per client while the clients run in lockstep.

:class:`_NormLayers` stands in for the ``forward`` of the model's ``BatchNorm1d/2d/3d`` and tracking
``InstanceNorm1d/2d/3d`` layers under vmap: every client has its own running statistics (rows of ``[C, ...]``
tensors, like the weights), batch statistics are taken over the client's real samples only (padding never enters
them), and each client's output and statistics are what the layer gives on the client's batch alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedlightning.state import averaged_buffer_slices, buffer_report_dtype, buffer_values

from .support import VectorizationUnsupportedError, _norm_layers

__all__ = ["_NormLayers"]

_HALF = (torch.float16, torch.bfloat16)


class _NormLayers:
    r"""The model's normalisation layers with batch or running statistics, and, during a round, every client's
    running statistics (``stats``: ``[C, ...]`` tensors, three per tracking layer: mean, variance,
    ``num_batches_tracked``).

    For a client's ``n`` real samples (channel dimension 1, ``S`` elements per channel and sample, ``m = nS``):

    .. math::
        \mu = \tfrac{1}{m}\textstyle\sum x, \quad \sigma^2 = \tfrac{1}{m}\sum (x-\mu)^2, \quad
        y = \frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}\,\gamma + \beta, \quad
        \hat\mu \leftarrow (1-\rho)\hat\mu + \rho\mu, \quad
        \hat\sigma^2 \leftarrow (1-\rho)\hat\sigma^2 + \rho\,\tfrac{m}{m-1}\sigma^2

    in training mode (``ρ = momentum``, or ``1/num_batches_tracked`` with ``momentum=None``, the counter kept per
    client), and ``μ̂, σ̂²`` in place of ``μ, σ²`` in eval mode, as ``nn.BatchNorm*`` (without running statistics:
    batch statistics in both modes). Instance normalisation takes ``μ, σ²`` per sample and channel and moves its
    running statistics by their mean over the real samples, as ``F.instance_norm``. On a padded step the sums run
    over the client's real samples only (its mask).

    Decisions (ours): refused, with the layer named, are ``SyncBatchNorm`` and subclasses that override ``forward``
    (:func:`~fedlightning.vectorized.support.check_model_vectorizable`) and an input whose first dimension is not the
    padded batch on a padded step. Half-precision inputs are normalised in float32.

    A client batch of one value per channel in training mode (one sample reaching a layer with 1x1 feature maps:
    torchvision's ResNets on 32x32 images at ``layer4``, for a client whose last batch holds one sample) is what
    ``nn.BatchNorm*`` raises a ``ValueError`` for, and sequential training then fails that client (the loop's
    ``on_client_error``). Here the call goes on (the variance of one value is 0, its unbiased correction is
    clamped to stay finite) and :attr:`singular` records the first such layer and the input size the client's
    forward pass would have had; the engine fails the clients whose batch at that step held one sample with torch's
    error, from that step on, as sequential training does (:class:`~fedlightning.vectorized.step._StepEvaluator`).
    """

    def __init__(self, model: nn.Module):
        self.layers: list[tuple[str, nn.Module, bool, int | None]] = []  # (label, module, is_instance, slot)
        self.buffer_index: list[int] = []  # index in model.buffers() of each entry of ``stats``
        index = {id(b): i for i, b in enumerate(model.buffers())}
        for label, module, instance in _norm_layers(model):
            slot = None
            if module.running_mean is not None and module.running_var is not None:
                slot = len(self.buffer_index)
                nbt = module.num_batches_tracked
                self.buffer_index += [
                    index[id(module.running_mean)],
                    index[id(module.running_var)],
                    index[id(nbt)] if nbt is not None else -1,
                ]
            self.layers.append((label, module, instance, slot))
        self.num_buffers = len(index)
        self.stats: list[Tensor] = []
        self.current: list[Tensor] = []
        self.mask: Tensor | None = None
        self.count: Tensor | None = None
        self.min_count = 0
        #: ``(layer label, input size of a one-sample client batch)`` of the first layer since the last reset that
        #: normalised one value per channel in training mode; None if none did (reset by the step evaluator).
        self.singular: tuple[str, torch.Size] | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def batch_dependent(self) -> list[str]:
        """The layers whose output or running statistics depend on the client's whole batch in their current mode:
        BatchNorm in training mode or without running statistics, tracking InstanceNorm in training mode."""
        out = []
        for label, m, instance, slot in self.layers:
            if instance:
                if m.training and slot is not None and m.momentum is not None:
                    out.append(label)
            elif m.training or slot is None:
                out.append(label)
        return out

    # ------------------------------------------------------------------ a round's per-client statistics
    def start(self, global_buffers: Sequence[Tensor], num_clients: int) -> None:
        """Every client's running statistics start from the global model's buffers."""
        if len(global_buffers) != self.num_buffers:
            raise ValueError(f"got {len(global_buffers)} global buffers, the model has {self.num_buffers}")
        self.stats = []
        for i in self.buffer_index:
            if i < 0:  # a layer without num_batches_tracked
                self.stats.append(torch.zeros(num_clients, dtype=torch.long))
            else:
                b = global_buffers[i].detach()
                self.stats.append(b.unsqueeze(0).repeat(num_clients, *([1] * b.dim())))

    def rows(self, clients: Tensor | None = None) -> list[Tensor]:
        """The statistics of every client (``clients=None``) or of the rows ``clients`` (indices)."""
        if clients is None:
            return self.stats
        return [s.index_select(0, clients.to(s.device)) for s in self.stats]

    def write(self, new: Sequence[Tensor], where: Tensor | None) -> None:
        """Store ``new`` ([C, ...] each) for the clients ``where`` marks (all with None)."""
        for i, (old, t) in enumerate(zip(self.stats, new)):
            if where is None:
                self.stats[i] = t.detach()
            else:
                keep = where.to(old.device).view(-1, *([1] * (old.dim() - 1)))
                self.stats[i] = torch.where(keep, t.detach(), old)

    def client_buffers(self, global_buffers: Sequence[Tensor], num_clients: int) -> Tensor:
        """``[C, B]``: every client's averaged buffers, one row each laid out as ``LocalTrainer.run`` reports them
        (:func:`~fedlightning.state.report_buffers`): its running statistics; the global value of other buffers."""
        own = {i: s for i, s in zip(self.buffer_index, self.stats) if i >= 0}
        layout = averaged_buffer_slices(global_buffers)
        dtype = buffer_report_dtype([global_buffers[i] for i, _ in layout])
        parts = []
        for i, _ in layout:
            if i in own:
                parts.append(own[i].reshape(num_clients, -1).to(dtype))
            else:
                parts.append(buffer_values(global_buffers[i].detach()).to(dtype).expand(num_clients, -1))
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------ one batched call
    def begin(
        self, stats: Sequence[Tensor], mask: Tensor | None = None, count: Tensor | None = None, min_count: int = 2
    ) -> None:
        """Start a call: ``stats`` the rows' running statistics (batched under vmap), ``mask`` / ``count`` the row's
        real samples on a padded step (None: the whole batch is real), ``min_count`` the smallest real batch of the
        call (a batch of one value per channel is refused in training mode)."""
        self.current = list(stats)
        self.mask, self.count, self.min_count = mask, count, min_count

    def end(self) -> list[Tensor]:
        """The rows' running statistics after the call."""
        out, self.current = self.current, []
        return out

    def install(self) -> None:
        for i, (_, module, _, _) in enumerate(self.layers):
            module.__dict__["forward"] = _LayerForward(self, i)

    def uninstall(self) -> None:
        for _, module, _, _ in self.layers:
            module.__dict__.pop("forward", None)

    # ------------------------------------------------------------------ the layers
    def forward(self, i: int, input: Tensor) -> Tensor:
        label, module, instance, slot = self.layers[i]
        module._check_input_dim(input)
        if instance:
            if input.dim() == module._get_no_batch_dim():
                return self._instance(label, module, slot, input.unsqueeze(0), unbatched=True).squeeze(0)
            return self._instance(label, module, slot, input)
        return self._batch(label, module, slot, input)

    def _real(self, label: str, x: Tensor) -> tuple[Tensor | None, Any]:
        """The mask ``[n, 1, ...]`` of real samples (None: all) and their number."""
        if self.mask is None:
            return None, x.shape[0]
        if x.shape[0] != self.mask.shape[0]:
            raise VectorizationUnsupportedError(
                f"client_execution='vectorized': layer {label} got an input whose first dimension ({x.shape[0]}) is "
                f"not the client's padded batch ({self.mask.shape[0]}), so its statistics cannot be restricted to the "
                "client's real samples; use client_execution='sequential' (or 'auto')"
            )
        return self.mask.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1))), self.count.to(x.dtype)

    def _batch(self, label: str, module: nn.Module, slot: int | None, input: Tensor) -> Tensor:
        rm = rv = nbt = None
        if slot is not None:
            rm, rv, nbt = self.current[slot : slot + 3]
        training, tracked = module.training, slot is not None
        x = input.float() if input.dtype in _HALF else input
        shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
        if training or not tracked:
            per_channel = math.prod(x.shape[2:])
            singular = self.min_count * per_channel <= 1
            if singular and self.singular is None:
                self.singular = (label, torch.Size([1, *input.shape[1:]]))
            dims = (0,) + tuple(range(2, x.dim()))
            mask, n = self._real(label, x)
            if mask is None:
                mean = x.mean(dims)
                centered = x - mean.reshape(shape)
                var = centered.square().mean(dims)
            else:  # sums over the real samples only
                size = n * per_channel
                mean = (x * mask).sum(dims) / size
                centered = x - mean.reshape(shape)
                var = (centered.square() * mask).sum(dims) / size
            if training and tracked:
                nbt = nbt + 1
                rho = module.momentum if module.momentum is not None else (1.0 / nbt.double()).to(rm.dtype)
                size = n * per_channel
                rm_new = (1 - rho) * rm + rho * mean.to(rm.dtype)
                if singular:  # a one-sample client fails at this step; keep its row finite
                    correction = size / ((size - 1).clamp(min=1) if isinstance(size, Tensor) else max(size - 1, 1))
                else:
                    correction = size / (size - 1)
                rv_new = (1 - rho) * rv + rho * (var * correction).to(rv.dtype)
                self.current[slot : slot + 3] = [rm_new, rv_new, nbt]
        else:
            mean, var = rm.to(x.dtype), rv.to(x.dtype)
            centered = x - mean.reshape(shape)
        scale = torch.rsqrt(var + module.eps)  # per channel: 1/σ·γ, then one fused pass over the input
        if module.weight is not None:
            scale = scale * module.weight.to(x.dtype)
        if module.bias is not None:
            out = torch.addcmul(module.bias.to(x.dtype).reshape(shape), centered, scale.reshape(shape))
        else:
            out = centered * scale.reshape(shape)
        return out.to(input.dtype)

    def _instance(
        self, label: str, module: nn.Module, slot: int | None, input: Tensor, unbatched: bool = False
    ) -> Tensor:
        x = input.float() if input.dtype in _HALF else input
        tracked = slot is not None
        channel = (1, x.shape[1]) + (1,) * (x.dim() - 2)
        if module.training or not tracked:
            dims = tuple(range(2, x.dim()))
            mean = x.mean(dims, keepdim=True)
            var = (x - mean).square().mean(dims, keepdim=True)
            out = (x - mean) * torch.rsqrt(var + module.eps)
            if module.training and tracked and module.momentum is not None:
                rm, rv, nbt = self.current[slot : slot + 3]
                per_channel = math.prod(x.shape[2:])
                unbiased = var * (per_channel / (per_channel - 1))
                mask, n = (None, x.shape[0]) if unbatched else self._real(label, x)
                mean_s, var_s = mean.flatten(1), unbiased.flatten(1)  # [n, channels]
                if mask is None:
                    mean_s, var_s = mean_s.mean(0), var_s.mean(0)
                else:
                    mask = mask.reshape(-1, 1)
                    mean_s, var_s = (mean_s * mask).sum(0) / n, (var_s * mask).sum(0) / n
                rho = module.momentum
                self.current[slot : slot + 3] = [
                    (1 - rho) * rm + rho * mean_s.to(rm.dtype),
                    (1 - rho) * rv + rho * var_s.to(rv.dtype),
                    nbt,
                ]
        else:
            rm, rv = self.current[slot], self.current[slot + 1]
            out = (x - rm.to(x.dtype).reshape(channel)) * torch.rsqrt(rv.to(x.dtype).reshape(channel) + module.eps)
        if module.weight is not None:
            out = out * module.weight.to(out.dtype).reshape(channel)
        if module.bias is not None:
            out = out + module.bias.to(out.dtype).reshape(channel)
        return out.to(input.dtype)


class _LayerForward:
    """A normalisation layer's ``forward`` while the clients run in lockstep (an instance attribute)."""

    __slots__ = ("norms", "index")

    def __init__(self, norms: _NormLayers, index: int):
        self.norms, self.index = norms, index

    def __call__(self, input: Tensor) -> Tensor:
        return self.norms.forward(self.index, input)
