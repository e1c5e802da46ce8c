"""Collective operations used when clients are sharded over processes (Lightning DDP strategies)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fedlightning.callbacks.base import RoundStatistics

__all__ = ["all_reduce_statistics", "all_gather_objects"]


def all_reduce_statistics(stats: RoundStatistics) -> None:
    """Sum (or max) every statistic over all processes, in place.

    Ranks may hold different keys (a rank whose clients all failed has no ``delta``), so the key set, each key's
    reduction and shape are agreed first with ``all_gather_object``; missing entries are zero (sum) or -inf (max).
    """
    world = dist.get_world_size()
    local = {k: (stats.ops[k], tuple(v.shape), str(v.dtype), str(v.device)) for k, v in stats.values.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    spec = {}
    for g in gathered:
        for k, s in g.items():
            spec.setdefault(k, s)
    for k in sorted(spec):
        op, shape, dtype, _ = spec[k]
        if k in stats.values:
            t = stats.values[k]
        else:
            dt = getattr(torch, dtype.split(".")[-1])
            dev = next(iter(stats.values.values())).device if stats.values else torch.device("cpu")
            t = torch.zeros(shape, dtype=dt, device=dev) if op == "sum" else torch.full(shape, -float("inf"), dtype=dt, device=dev)
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        stats.values[k], stats.ops[k] = t, op


def all_gather_objects(obj):
    """``[obj_from_rank_0, obj_from_rank_1, ...]`` (picklable objects; tensors should be on the CPU)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
