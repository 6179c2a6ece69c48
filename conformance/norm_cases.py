"""The cases of the norm families (``rms_norm``, ``layer_norm``): last dims off every block size (1, 7, 80,
4096 + 3), no rows and many rows, a transposed (non-contiguous) x, with and without weight, bias and the
fused residual, three dtypes, and rows holding inf and NaN."""

from __future__ import annotations

import torch

from .cases import Case

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _cases(op: str, prefix: str, eps: float, layer: bool) -> list[Case]:
    affine = dict(weight=True, bias=layer)
    variants = {  # name: (params, dtypes)
        "d1": (dict(shape=(6, 1), **affine, **({"eps": 1e-2} if layer else {})), (F32,)),
        "d7_residual": (dict(shape=(3, 5, 7), residual=True, **affine), (F32, BF16, F16)),
        "d80_transposed": (dict(shape=(4, 6, 80), transposed=True, **affine), (F32, BF16)),
        "d80_transposed_residual": (dict(shape=(4, 6, 80), transposed=True, residual=True, **affine), (F16,)),
        "d4099_residual": (dict(shape=(3, 4099), residual=True, **affine), (F32, BF16)),
        "no_weight": (dict(shape=(9, 80), weight=False, bias=False), (F32, BF16)),
        "no_rows": (dict(shape=(0, 80), residual=True, **affine), (F32,)),
        "many_rows": (dict(shape=(2, 130, 33), residual=True, **affine), (F32, BF16)),
        "nonfinite": (dict(shape=(4, 80), nonfinite=True, residual=True, **affine), (F32, BF16)),
    }
    if layer:
        variants["bias_only"] = (dict(shape=(5, 7), weight=False, bias=True), (F32,))
        variants["weight_only"] = (dict(shape=(5, 80), weight=True, bias=False, residual=True), (F32,))
    # LayerNorm over one element: x - mean is 0, and any rounding of the mean (torch's) is amplified by
    # 1/sqrt(eps), hence that case's larger eps
    return [Case(f"{prefix}_{name}", op, dtype, {"eps": eps, **params}) for name, (params, dtypes) in variants.items()
            for dtype in dtypes]


NORM_CASES: list[Case] = _cases("rms_norm", "rms", 1e-6, layer=False) + _cases("layer_norm", "ln", 1e-5, layer=True)
