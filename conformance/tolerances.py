"""How far a backend's result may be from its oracle: one table, by op family and dtype, for the conformance
suite and for every test that compares a backend with an oracle or with torch.

A value passes when ``|out - ref| <= atol + rtol * |ref|`` elementwise. Where a comparison needs a looser
bound for a reason of its own, it scales :func:`tolerance` by one of the named factors below, never by a
table of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from portable_ops.ops import families

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class Tolerance(NamedTuple):
    atol: float
    rtol: float

    def scaled(self, factor: float) -> Tolerance:
        return Tolerance(self.atol * factor, self.rtol * factor)


# Optimizer: one step's rounding of the stored dtype from the same starting state (the conformance
# suite's float64 oracle is re-seeded from the backend's state every step). Attention: fp32 allows
# TF32 matrix units; half types round P before P@V.
_ATTENTION = {F32: Tolerance(2e-3, 2e-3), F16: Tolerance(4e-3, 4e-3), BF16: Tolerance(3e-2, 3e-2)}
# Norms: float32 statistics over one row, then one rounding of the output to the case's dtype.
_NORMS = {F32: Tolerance(1e-5, 1e-5), F16: Tolerance(2e-3, 2e-3), BF16: Tolerance(1.6e-2, 1.6e-2)}
# Linear cross-entropy: the logits rounded once to the inputs' dtype (the oracles round theirs the same way, but the
# matmuls' float32 sums may round a logit to its other neighbour), then float32.
_CROSS_ENTROPY = {F32: Tolerance(1e-4, 1e-4), F16: Tolerance(4e-3, 4e-3), BF16: Tolerance(3e-2, 3e-2)}
# RoPE: a float32 rotation (two products and a sum per element), then one rounding to the case's dtype (half an
# ulp: 2^-11 relative in float16, 2^-8 in bfloat16), with room for a tie and for the products' float32 rounding.
# Its gradients are the same rotation: the same tolerance.
_ROPE = {F32: Tolerance(1e-6, 1e-5), F16: Tolerance(1e-3, 1e-3), BF16: Tolerance(8e-3, 8e-3)}
_TABLE = {
    "adam": {F32: Tolerance(1e-6, 1e-5), F16: Tolerance(1e-5, 2e-3), BF16: Tolerance(1e-4, 1.6e-2)},
    # SGD: the same one step's rounding of the stored dtype (param and momentum buffer).
    "sgd": {F32: Tolerance(1e-6, 1e-5), F16: Tolerance(1e-5, 2e-3), BF16: Tolerance(1e-4, 1.6e-2)},
    "clip_grad_norm_": {F32: Tolerance(1e-6, 1e-5), F16: Tolerance(1e-4, 2e-3), BF16: Tolerance(1e-3, 1.6e-2)},
    "attention": _ATTENTION,
    # Packed and paged attention are dense attention per sequence: the same tolerances.
    "attention_varlen": _ATTENTION,
    "paged_attention": _ATTENTION,
    "rms_norm": _NORMS,
    "layer_norm": _NORMS,
    "linear_cross_entropy": _CROSS_ENTROPY,
    "rope": _ROPE,
}
if set(_TABLE) != set(families()):  # a family of portable_ops/ops.py without tolerances, or the reverse
    raise ImportError(f"tolerances for {sorted(_TABLE)}; portable_ops/ops.py's families are {sorted(families())}")

# A half-precision param stepped from float32 moments: the float32 step, then one rounding to nearest
# in the param's dtype: half an ulp (float16 2**-11, bfloat16 2**-8 relative) with room for a tie. The
# Triton interpreter truncates float32 to bfloat16; the triton kernels round by hand there
# (backends/triton/interpreter.py), so a truncating store fails this.
_ONE_ROUNDING = {F16: Tolerance(1e-7, 1e-3), BF16: Tolerance(1e-7, 4e-3)}

# Gradients of attention sum over a whole sequence, a norm's over its row and (weight, bias) its rows, linear
# cross-entropy's over the vocab (hidden) and the tokens (weight, bias): a few times the forward's error.
GRADIENT_FACTOR = 4.0


def tolerance(op: str, dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> Tolerance:
    """The tolerance of ``op``'s (a family of portable_ops/ops.py) outputs in ``dtype``. For ``adam`` with
    ``state_dtype=torch.float32`` under a half-precision param: the param's, one rounding of a float32 step."""
    if op == "adam" and state_dtype is not None and dtype in _ONE_ROUNDING:
        return _ONE_ROUNDING[dtype]
    if op not in _TABLE:
        raise ValueError(f"no tolerances for {op!r}; the families are {', '.join(_TABLE)}")
    if dtype not in _TABLE[op]:
        raise ValueError(f"no tolerance for {op} in {dtype}; there are for {', '.join(map(str, _TABLE[op]))}")
    return _TABLE[op][dtype]
