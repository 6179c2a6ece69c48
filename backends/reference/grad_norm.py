"""The global gradient norm as ``torch.nn.utils.clip_grad_norm_(foreach=True)`` takes it: one
``_foreach_norm`` per (device, dtype) group, then the norm of those norms in float32 (float64 for float64).

bfloat16 grads' norms are torch's own: accumulated in float32 and rounded once to bfloat16 (at most 2^-9
relative), as ``clip_grad_norm_`` rounds them, where converting the grads to float32 first would be one
more pass through them. float16 grads are converted: a float16 norm overflows past 65504."""

from __future__ import annotations

import math
import operator

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


_dtype = operator.attrgetter("dtype")


def grad_norm(grads, norm_type):
    """The ``norm_type``-norm of all of ``grads`` taken together, as a float32 (float64 for float64) scalar;
    a zero-size grad is skipped for the max and min norms, as in the definition."""
    dtype = torch.float64 if torch.float64 in set(map(_dtype, grads)) else torch.float32  # C-level: every step
    if norm_type in (math.inf, -math.inf):
        grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=dtype)
    norms = [torch.stack(_norms(group, norm_type, dtype)).to(grads[0].device, dtype)
             for [group], _ in _group_tensors_by_device_and_dtype([grads]).values()]
    return torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), norm_type)


def _norms(group, norm_type, dtype):
    if group[0].dtype == torch.bfloat16:
        return torch._foreach_norm(group, norm_type)
    return torch._foreach_norm(group, norm_type, dtype=dtype)
