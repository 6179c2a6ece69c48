"""The cases of the ``rope`` family: both layouts, partial rotary, q and k as transposed slices of one fused
projection, DeepSeek's rope part (the last dims of each head, a strided view), per-batch and batch-1 tables,
float32 tables beside half-precision q and k (autocast's mix), tables that are not a rotation's (the element-wise
formula), one token and no tokens, sizes off every block size, inf and NaN, and ``rope_`` in place."""

from __future__ import annotations

import torch

from .cases import Case

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _cases() -> list[Case]:
    base = dict(B=2, Hq=4, Hk=2, S=17, D=64, R=64, interleaved=False)
    variants = {  # name: (params, dtypes)
        "rope_half_gqa": (base, (F32, BF16, F16)),
        "rope_interleaved": (dict(base, interleaved=True), (F32, BF16)),
        "rope_partial_d80_r32": (dict(base, D=80, R=32, Hq=3, Hk=3), (F32, BF16)),
        "rope_partial_interleaved_r16": (dict(base, R=16, interleaved=True), (F32, F16)),
        "rope_fused_qkv_per_batch_tables": (dict(base, layout="fused", tables="per_batch"), (F32, BF16)),
        "rope_fused_qkv_interleaved": (dict(base, layout="fused", interleaved=True, S=33, D=32, R=32), (BF16,)),
        "rope_deepseek_rope_part": (dict(base, layout="tail", D=48, R=16, Hk=1, Hq=3), (F32, BF16)),
        "rope_batch1_tables": (dict(base, tables="batch1", B=3, S=5), (F32,)),
        "rope_f32_tables_bf16_qk": (dict(base, table_dtype=F32), (BF16, F16)),
        "rope_any_tables": (dict(base, tables="random", R=32), (F32,)),  # not a rotation: transformers' formula
        "rope_long_rows_d128": (dict(B=1, Hq=3, Hk=1, S=300, D=128, R=128, interleaved=False), (F32, BF16)),
        "rope_long_rows_interleaved_partial": (dict(B=2, Hq=2, Hk=1, S=260, D=96, R=64, interleaved=True,
                                                    layout="fused"), (F32,)),
        "rope_one_token": (dict(base, B=3, S=1, layout="fused"), (F32, BF16)),
        "rope_no_tokens": (dict(base, S=0), (F32,)),
        "rope_nonfinite": (dict(base, nonfinite=True), (F32, BF16)),
        "rope_inplace_half_partial": (dict(base, D=80, R=64, layout="fused", inplace=True), (F32, BF16)),
        "rope_inplace_interleaved": (dict(base, interleaved=True, layout="tail", D=48, R=16, inplace=True),
                                     (F32, F16)),
    }
    return [Case(name, "rope", dtype, params) for name, (params, dtypes) in variants.items() for dtype in dtypes]


ROPE_CASES: list[Case] = _cases()
