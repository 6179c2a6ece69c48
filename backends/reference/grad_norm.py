"""The global gradient norm as ``torch.nn.utils.clip_grad_norm_(foreach=True)`` takes it: one
``_foreach_norm`` per (device, dtype) group, then the norm of those norms."""

from __future__ import annotations

import math

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def grad_norm(grads, norm_type):
    """The ``norm_type``-norm of all of ``grads`` taken together, as a float32 (float64 for float64) scalar;
    a zero-size grad is skipped for the max and min norms, as in the definition."""
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if norm_type in (math.inf, -math.inf):
        grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=dtype)
    # float32 norms even of half-precision grads (clip_grad_norm_ rounds each to the grads' dtype, which the
    # clip's float32 result can't afford), at the cost of the kernel converting the grads first
    norms = [torch.stack(torch._foreach_norm(group, norm_type, dtype=dtype)).to(grads[0].device)
             for [group], _ in _group_tensors_by_device_and_dtype([grads]).values()]
    return torch.linalg.vector_norm(torch.cat(norms), norm_type)
