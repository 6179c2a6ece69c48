"""The cases of the ``linear_cross_entropy`` family: each reduction, label smoothing, Gemma's softcap (30, and a
small cap that saturates), a bias, ignored tokens (and every token ignored, and an ``ignore_index`` that is a class),
a transposed (non-contiguous) hidden, a vocab wider than the kernels' blocks (4096 columns), a chunk of more tokens
than nki's 128 partitions, one class, no tokens, three dtypes. ``budget`` caps a chunk's logits
(``lm_head.chunk_budget``) so that the tokens span several chunks at these sizes."""

from __future__ import annotations

import torch

from .cases import Case

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

_BASE = dict(shape=(13,), H=24, V=40, reduction="mean", label_smoothing=0.0, softcap=None, bias=False, ignored=2,
             ignore_index=-100, logit_scale=2.0, budget=160)

_VARIANTS = {  # name: (params, dtypes)
    "lce_mean": (dict(shape=(2, 9), H=32, V=77, budget=77 * 4), (F32, BF16, F16)),
    "lce_sum_bias": (dict(shape=(11,), V=50, reduction="sum", bias=True), (F32,)),
    "lce_none": (dict(shape=(3, 5), H=16, V=33, reduction="none", bias=True), (F32, BF16)),
    "lce_label_smoothing": (dict(label_smoothing=0.1), (F32,)),
    "lce_softcap_30": (dict(shape=(10,), H=32, V=64, softcap=30.0, label_smoothing=0.05, logit_scale=20.0),
                       (F32, BF16)),
    "lce_softcap_saturating": (dict(shape=(7,), softcap=2.0, reduction="none", logit_scale=8.0), (F32,)),
    "lce_all_ignored": (dict(shape=(6,), ignored=6, bias=True), (F32,)),
    "lce_ignore_index_is_a_class": (dict(ignore_index=3, ignored=4, reduction="sum"), (F32,)),
    "lce_transposed_hidden": (dict(shape=(4, 3), transposed=True, label_smoothing=0.1), (F32,)),
    "lce_wide_vocab": (dict(shape=(3,), H=16, V=5003, softcap=30.0, logit_scale=10.0, ignored=0, budget=10 ** 6),
                       (F32, BF16)),
    "lce_many_tokens": (dict(shape=(2, 65), H=8, V=20, budget=10 ** 6), (F32,)),  # 130 rows: two nki row tiles
    "lce_one_class": (dict(shape=(5,), H=8, V=1, ignored=1, label_smoothing=0.2), (F32,)),
    "lce_no_tokens": (dict(shape=(0,), ignored=0), (F32,)),
}

CROSS_ENTROPY_CASES: list[Case] = [Case(name, "linear_cross_entropy", dtype, {**_BASE, **params})
                                   for name, (params, dtypes) in _VARIANTS.items() for dtype in dtypes]
