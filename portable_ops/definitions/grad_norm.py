"""Global gradient norm over a list of tensors, in plain PyTorch."""

from __future__ import annotations

import math

import torch


def grad_norm(grads, norm_type):
    """The ``norm_type``-norm of all of ``grads`` taken together, as a float32 (float64 for float64) scalar.

    torch's composition for every ``norm_type``: the norm of the per-tensor norms (for 0, which counts
    non-zeros, that is the number of grads holding one, as ``torch.nn.utils.clip_grad_norm_`` gives).
    """
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if norm_type in (math.inf, -math.inf):
        # A zero-size grad holds no element to take the max or min of: skip it, as the kernels do
        # (torch raises, because its per-tensor reduction has no identity).
        grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=dtype)
    per_tensor = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in grads])
    return torch.linalg.vector_norm(per_tensor, norm_type)
