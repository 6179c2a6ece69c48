"""Global gradient norm over a list of tensors, in plain PyTorch."""

from __future__ import annotations

import math

import torch


def grad_norm(grads, norm_type):
    """The ``norm_type``-norm of all of ``grads`` taken together, as a float32 (float64 for float64) scalar."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    per_tensor = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in grads])
    if math.isinf(norm_type):
        return per_tensor.max() if norm_type > 0 else per_tensor.min()
    return torch.linalg.vector_norm(per_tensor, norm_type)
