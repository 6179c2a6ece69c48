"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel): kernels see local shards.

The fused step is elementwise, so it runs on each rank's local shard as is. The global
norm is not: each rank takes the norm of its shards with the backend's kernel, then
ranks combine ``norm ** p`` (sum), or the max (the min for ``-inf``), over the mesh dimensions
the grads are sharded on, through torch.distributed, so every rank clips by the same coefficient.
"""

from __future__ import annotations

import math
import operator
import sys

import torch


def _dtensor_type():
    """DTensor, or () while torch.distributed.tensor is not imported: no DTensor exists before it is, and
    importing it here would cost every ``import portable_ops`` most of its time."""
    global _DTENSOR
    if not _DTENSOR:
        # absent: not imported yet, or torch built without distributed; no DTensor yet: still importing
        _DTENSOR = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    return _DTENSOR


_DTENSOR = ()  # resolved once found: this is asked of every tensor of every step


def is_dtensor(t) -> bool:
    return isinstance(t, _dtensor_type())


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a DTensor (writes to it write the DTensor), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def any_dtensor(tensors) -> bool:
    """Whether any of ``tensors`` is a DTensor, in C-level passes over the list (it runs on every step)."""
    dtensor = _dtensor_type()
    return bool(dtensor) and any(issubclass(kind, dtensor) for kind in set(map(type, tensors)))


def locals_of(tensors) -> list[torch.Tensor]:
    """:func:`local` of each of ``tensors``."""
    return list(map(local, tensors)) if any_dtensor(tensors) else list(tensors)


_device = operator.attrgetter("device")


def global_norm(grads, norm_type: float, local_norm) -> torch.Tensor:
    """The norm of ``grads`` (plain tensors or DTensors) across every rank that holds a shard of them.

    ``local_norm(tensors, norm_type)`` is the backend's norm of plain local tensors.
    """
    # The common case, plain tensors on one device, decided by C-level passes over the list: this
    # runs on every clipped optimizer step, over hundreds of grads.
    if not any_dtensor(grads) and len(set(map(_device, grads))) == 1:
        return local_norm(list(grads), norm_type)
    groups: dict[tuple, list] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if is_dtensor(g) else (g.device,)
        groups.setdefault(key, []).append(local(g))
    norms = []
    for key, tensors in groups.items():
        norm = local_norm(tensors, norm_type)
        if len(key) == 2:
            norm = _reduce_over_shards(norm, norm_type, *key)
        norms.append(norm)
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    # The norm of the groups' norms is the norm of all the grads (max for inf, min for -inf), except for
    # torch's 0-"norm", which counts the grads holding a non-zero: the groups' counts add up.
    return stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)


def _reduce_over_shards(norm, norm_type, mesh, placements):
    import torch.distributed as dist

    if any(p.is_partial() for p in placements):
        raise ValueError("grads with Partial placements are not reduced yet; redistribute them to Shard or "
                         "Replicate before clipping")
    sharded = [dim for dim, p in enumerate(placements) if p.is_shard()]
    if not sharded:
        return norm
    if norm_type == 0:
        raise ValueError("norm_type 0 of sharded grads: torch's 0-norm counts the grads holding a non-zero, "
                         "which a rank's shards can't tell; use another norm_type")
    if math.isinf(norm_type):  # min(x) = -max(-x)
        sign = 1.0 if norm_type > 0 else -1.0
        return sign * _max_over_shards(sign * norm, [mesh.get_group(dim) for dim in sharded])
    value = norm.pow(norm_type)  # a sum carries a NaN
    for dim in sharded:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return value.pow(1.0 / norm_type)


def _max_over_shards(norm, groups):
    """The largest ``norm`` of the ranks, NaN if any rank's is: a MAX all-reduce may drop a NaN (gloo's keeps
    it only from rank 0), so it travels as a flag beside the value, reduced in the same collective."""
    import torch.distributed as dist

    nan = norm.isnan()
    value = torch.stack([norm.masked_fill(nan, -math.inf), nan.to(norm.dtype)])
    for group in groups:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value[0].masked_fill(value[1] > 0, math.nan)
