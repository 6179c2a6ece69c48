"""The shared case catalogue: the same cases for every backend.

A case names an op family (``portable_ops.ops.families()``: ``adam``, ``sgd``, ``clip_grad_norm_``, ``attention``,
``attention_varlen``, ``paged_attention``, ``rms_norm``, ``layer_norm``, ``rope``, ``linear_cross_entropy``), a
seed, its parameters and a dtype. Inputs are drawn from the seed on the CPU and moved to the backend's device, so every
backend sees the same numbers. Tolerances come from tolerances.py, by family and dtype: a value passes when
``|out - ref| <= atol + rtol * |ref|`` elementwise, against each oracle. Adam cases with ``state_dtype`` in
their params keep the moments in that dtype and check them with its tolerance.

A ``long`` case (attention at 16k and 32k keys) is checked on ``sampled_rows`` only, blocks of query
rows (runner.py says why that is exact), and is run only where its backend's tensors are on an
accelerator, or when asked (``--long``, ``PORTABLE_OPS_CONFORMANCE_LONG=1``): elsewhere it is
reported as not run, never as a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .tolerances import Tolerance, tolerance

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # the family: a key of portable_ops.ops.families(), and of the runner's RUNNERS
    dtype: torch.dtype
    params: dict = field(default_factory=dict)
    seed: int = 0
    long: bool = False  # too slow for a CPU run by default: see the runner's run policy

    @property
    def tolerance(self) -> Tolerance:
        """The param's (or output's) tolerance."""
        return tolerance(self.op, self.dtype, self.params.get("state_dtype"))

    @property
    def state_tolerance(self) -> Tolerance:
        """The optimizer moments' tolerance: their own dtype's."""
        return tolerance(self.op, self.params.get("state_dtype") or self.dtype)

    @property
    def id(self) -> str:
        return f"{self.name}[{str(self.dtype).removeprefix('torch.')}]"


ODD_SIZES = [(1,), (3,), (127,), (129,), (1000,), (33, 65), (5, 7, 11)]


def _mixed_sizes(count: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(int(n) for n in torch.randint(1, 3000, (1,), generator=g)) for _ in range(count)]


def _adam_cases() -> list[Case]:
    base = dict(shapes=ODD_SIZES, steps=5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                decoupled=False, amsgrad=False, maximize=False)
    variants = {
        "adam_odd_sizes": {},
        "adam_l2_decay": dict(weight_decay=0.01),
        "adamw_decoupled": dict(weight_decay=0.1, decoupled=True),
        "adam_amsgrad": dict(amsgrad=True, weight_decay=0.01),
        "adamw_amsgrad_maximize": dict(amsgrad=True, maximize=True, decoupled=True, weight_decay=0.05),
        "adamw_lr_tensor": dict(lr_tensor=True, decoupled=True, weight_decay=0.01, lr=3e-3),
        "adamw_grad_scale": dict(grad_scale=1024.0, decoupled=True, weight_decay=0.01),
        "adamw_clip_coef": dict(clip_coef=0.25, decoupled=True, weight_decay=0.01),
    }
    cases = []
    for name, extra in variants.items():
        for dtype in (F32, BF16, F16):
            cases.append(Case(name, "adam", dtype, {**base, **extra}))
    cases += [
        Case("adam_one_element", "adam", F32, {**base, "shapes": [(1,)]}),
        Case("adam_many_mixed", "adam", F32, {**base, "shapes": _mixed_sizes(40, 7), "steps": 3}),
        Case("adam_empty_list", "adam", F32, {**base, "shapes": []}),
        # found_inf set on a step whose grads hold inf and NaN: nothing may change.
        Case("adamw_found_inf_skips", "adam", F32,
             {**base, "decoupled": True, "weight_decay": 0.01, "grad_scale": 65536.0, "found_inf_steps": (1, 3),
              "nonfinite_steps": (1, 3)}),
        Case("adamw_found_inf_skips", "adam", BF16,
             {**base, "decoupled": True, "grad_scale": 8.0, "found_inf_steps": (2,), "nonfinite_steps": (2,)}),
        # Without found_inf a non-finite grad propagates, as in torch: NaN where the oracle has NaN.
        Case("adam_nonfinite_grad_propagates", "adam", F32, {**base, "nonfinite_steps": (2,)}),
    ]
    fp32_state = {
        "adam_fp32_state": dict(weight_decay=0.01),
        "adamw_fp32_state": dict(weight_decay=0.1, decoupled=True),
        # masked stores through float32 pointers: a skipped step must leave the fp32 moments as they were
        "adamw_amsgrad_fp32_state_found_inf": dict(amsgrad=True, decoupled=True, weight_decay=0.05,
                                                   grad_scale=8.0, found_inf_steps=(2,), nonfinite_steps=(2,)),
    }
    for name, extra in fp32_state.items():
        for dtype in (BF16, F16):
            cases.append(Case(name, "adam", dtype, {**base, **extra, "state_dtype": F32}))
    for name, extra in {"trajectory_adam": {}, "trajectory_adamw": dict(decoupled=True, weight_decay=0.01),
                        "trajectory_adamw_amsgrad": dict(decoupled=True, weight_decay=0.01, amsgrad=True),
                        "trajectory_adam_amsgrad": dict(weight_decay=0.01, amsgrad=True)}.items():
        cases.append(Case(name, "adam", F32, {**base, **extra, "steps": 50, "shapes": [(7, 13), (300,), (1,)]}))
    cases.append(Case("trajectory_adamw_fp32_state", "adam", BF16,
                      {**base, "decoupled": True, "weight_decay": 0.01, "amsgrad": True, "state_dtype": F32,
                       "steps": 50, "shapes": [(7, 13), (300,), (1,)]}))
    return cases


def _sgd_cases() -> list[Case]:
    """lr 0.1: an update a bfloat16 param keeps (a backend that skipped the step would fail every dtype)."""
    base = dict(shapes=ODD_SIZES, steps=5, lr=0.1)
    momentum = dict(momentum=0.9)
    variants = {
        "sgd_plain": {},
        "sgd_momentum": momentum,
        "sgd_momentum_dampening": dict(momentum=0.9, dampening=0.5),
        "sgd_nesterov_weight_decay": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
        "sgd_weight_decay_maximize": dict(momentum=0.8, weight_decay=0.1, maximize=True),
        "sgd_plain_weight_decay_maximize": dict(weight_decay=0.1, maximize=True),
        "sgd_lr_tensor": dict(momentum=0.9, lr_tensor=True, lr=0.05),
        "sgd_grad_scale": dict(momentum=0.9, grad_scale=1024.0, weight_decay=0.01),
        "sgd_clip_coef": dict(momentum=0.9, nesterov=True, clip_coef=0.25),
    }
    cases = [Case(name, "sgd", dtype, {**base, **extra}) for name, extra in variants.items()
             for dtype in (F32, BF16, F16)]
    cases += [
        Case("sgd_one_element", "sgd", F32, {**base, **momentum, "shapes": [(1,)]}),
        Case("sgd_many_mixed", "sgd", F32, {**base, **momentum, "shapes": _mixed_sizes(40, 7), "steps": 3}),
        Case("sgd_empty_list", "sgd", F32, {**base, **momentum, "shapes": []}),
        # float32, bfloat16 and float16 params in one call: one launch per dtype group
        Case("sgd_mixed_dtypes", "sgd", F32, {**base, "momentum": 0.9, "nesterov": True,
                                              "dtypes": (F32, BF16, F16), "shapes": _mixed_sizes(12, 3)}),
        # params 1 and 4 get their first grad on step 3: new and old momentum buffers in one call
        Case("sgd_late_params", "sgd", F32, {**base, **momentum, "dampening": 0.3, "late": ((1, 2), (4, 2))}),
        Case("sgd_late_params", "sgd", BF16, {**base, **momentum, "late": ((0, 1), (6, 3))}),
        # found_inf on the first step (no buffer may be made) and a later one, with inf and NaN grads
        Case("sgd_found_inf_skips", "sgd", F32,
             {**base, **momentum, "dampening": 0.1, "grad_scale": 65536.0, "found_inf_steps": (0, 3),
              "nonfinite_steps": (0, 3)}),
        Case("sgd_found_inf_skips", "sgd", BF16,
             {**base, **momentum, "grad_scale": 8.0, "found_inf_steps": (2,), "nonfinite_steps": (2,)}),
        # without found_inf a non-finite grad propagates, as in torch: NaN where the oracle has NaN
        Case("sgd_nonfinite_grad_propagates", "sgd", F32, {**base, **momentum, "nonfinite_steps": (2,)}),
        # optim.SGD(max_grad_norm=...): norm, then a step that scales each grad as it reads it
        Case("sgd_max_grad_norm", "sgd", F32, {**base, **momentum, "weight_decay": 0.01, "max_grad_norm": 0.5}),
        Case("sgd_max_grad_norm", "sgd", BF16, {**base, **momentum, "nesterov": True, "max_grad_norm": 0.5,
                                                "steps": 3}),
    ]
    trajectories = {"trajectory_sgd_momentum": dict(momentum=0.9, weight_decay=0.01),
                    "trajectory_sgd_nesterov": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                    "trajectory_sgd_dampening_maximize": dict(momentum=0.5, dampening=0.5, maximize=True)}
    for name, extra in trajectories.items():
        cases.append(Case(name, "sgd", F32, {**base, **extra, "lr": 0.01, "steps": 50,
                                             "shapes": [(7, 13), (300,), (1,)]}))
    return cases


def _clip_cases() -> list[Case]:
    cases = []
    clip = "clip_grad_norm_"
    for dtype in (F32, BF16, F16):
        cases.append(Case("clip_l2_odd_sizes", clip, dtype, dict(shapes=ODD_SIZES, max_norm=1.0, norm_type=2.0)))
        cases.append(Case("clip_inf_norm", clip, dtype, dict(shapes=ODD_SIZES, max_norm=0.5, norm_type=float("inf"))))
    cases += [
        Case("clip_below_threshold", clip, F32, dict(shapes=ODD_SIZES, max_norm=1e6, norm_type=2.0)),
        # max_norm=inf: measure the norm, scale by exactly 1 (torch's idiom)
        Case("clip_measure_only", clip, F32, dict(shapes=ODD_SIZES, max_norm=float("inf"), norm_type=2.0)),
        Case("clip_one_element", clip, F32, dict(shapes=[(1,)], max_norm=0.1, norm_type=2.0)),
        Case("clip_many_mixed", clip, F32, dict(shapes=_mixed_sizes(60, 11), max_norm=2.0, norm_type=2.0)),
        Case("clip_empty_list", clip, F32, dict(shapes=[], max_norm=1.0, norm_type=2.0)),
        # max_grad_norm fused into AdamW: norm, then a step that scales each grad as it reads it.
        Case("adamw_fused_clip_step", clip, F32,
             dict(shapes=ODD_SIZES, max_norm=0.5, norm_type=2.0, fused_step=True, steps=5)),
        Case("adamw_fused_clip_step", clip, BF16,
             dict(shapes=ODD_SIZES, max_norm=0.5, norm_type=2.0, fused_step=True, steps=3)),
    ]
    return cases


def _attention_cases() -> list[Case]:
    shapes = {  # name: (B, Hq, Hkv, Sq, Skv, D, causal)
        "attn_square": (2, 4, 4, 64, 64, 64, False),
        "attn_causal_ragged": (1, 2, 2, 77, 77, 64, True),
        "attn_gqa_causal": (1, 8, 2, 50, 50, 32, True),
        "attn_cross_lengths": (1, 2, 1, 37, 101, 64, False),
        "attn_causal_bottom_right": (1, 2, 1, 37, 101, 64, True),
        "attn_causal_more_queries": (1, 2, 2, 20, 12, 32, True),  # first rows see no key
        "attn_decode_kv_cache": (2, 8, 2, 1, 300, 64, True),
        "attn_decode_long_cache": (1, 2, 1, 1, 1100, 64, True),  # few heads: keys split across programs
        "attn_chunked_prefill": (1, 2, 1, 5, 900, 64, True),
        "attn_head_dim_128": (1, 2, 2, 70, 70, 128, True),
        "attn_head_dim_256": (1, 1, 1, 40, 40, 256, False),
        "attn_one_token": (1, 1, 1, 1, 1, 32, True),
        # head dims that are not powers of two (Phi, StableLM, DeepSeek's 192)
        "attn_head_dim_40_causal": (1, 2, 2, 45, 45, 40, True),
        "attn_head_dim_80_gqa_causal": (1, 4, 2, 33, 33, 80, True),
        "attn_head_dim_96_cross": (1, 2, 1, 19, 50, 96, False),
        "attn_head_dim_192_causal": (1, 1, 1, 30, 30, 192, True),
        "attn_head_dim_80_decode_gqa": (1, 8, 2, 1, 300, 80, True),
    }
    scales = {  # name: (shape as above, scale): SDPA takes any finite scale
        "attn_scale_zero": ((1, 2, 1, 20, 20, 32, True), 0.0),  # the uniform average of the visible values
        "attn_scale_negative": ((1, 4, 2, 33, 33, 64, True), -0.3),
    }
    keys = ("B", "Hq", "Hkv", "Sq", "Skv", "D", "causal")
    cases = []
    for name, shape in shapes.items():
        dtypes = (F16, BF16, F32) if name in ("attn_square", "attn_causal_ragged", "attn_gqa_causal") else (F16,)
        for dtype in dtypes:
            cases.append(Case(name, "attention", dtype, dict(zip(keys, shape))))
    for name, (shape, scale) in scales.items():
        cases.append(Case(name, "attention", F16, dict(zip(keys, shape), scale=scale)))
    long_shapes = {  # name: ((B, Hq, Hkv, S, D, causal), dtypes); few heads, the length is the point
        "attn_long_16k_causal_gqa": ((1, 4, 2, 16384, 128, True), (BF16, F16)),
        "attn_long_16k_gqa": ((1, 4, 1, 16384, 64, False), (BF16,)),
        "attn_long_32k_causal": ((1, 2, 2, 32768, 128, True), (BF16,)),
    }
    for name, (shape, dtypes) in long_shapes.items():
        for dtype in dtypes:
            cases.append(Case(name, "attention", dtype, long_attention_params(*shape), long=True))
    return cases


# At scale 1/sqrt(D) a row's softmax over 16k random keys is nearly uniform: out and the gradients are ~0.01,
# inside the bf16 atol (3e-2), so a kernel that returned zeros would pass. Scores of std 3 put a row's weight
# on some 60 keys (a peaked softmax), and out and dq of order 0.1-1 (docs/conformance.md).
LONG_SCORE_STD = 3.0


def long_attention_params(B: int, Hq: int, Hkv: int, S: int, D: int, causal: bool, block: int = 128) -> dict:
    """A long case's params: Sq = Skv = S, checked on ``sampled_rows(S, block)``, scores of std ``LONG_SCORE_STD``."""
    return dict(B=B, Hq=Hq, Hkv=Hkv, Sq=S, Skv=S, D=D, causal=causal, scale=LONG_SCORE_STD / math.sqrt(D),
                sampled_rows=sampled_rows(S, block))


def sampled_rows(sq: int, block: int = 128) -> tuple[tuple[int, int], ...]:
    """The query rows a long case is checked on, as ``(start, end)`` blocks: the first rows (causal: the
    fewest keys), a block in the middle that starts and ends off any power-of-two tile, and the last rows
    (causal: the most keys)."""
    middle = sq // 2 + 5
    return ((0, block // 2), (middle, middle + block), (sq - block, sq))


# Scores of std 10 against a softcap of 30 or 50: tanh bends them enough that a backend ignoring the softcap
# fails on 29-77% of out's elements (bf16 to fp32, at these tolerances). Not more: dq grows with the scale, and
# the backward's rowsum(dout * out), taken from the rounded fp16/bf16 out as every flash backward takes it,
# is amplified with it; at std 40 the reference's own fp16 and bf16 dq missed the float64 oracle by 1.8x the
# tolerance (docs/conformance.md).
CAPPED_SCORE_STD = 10.0


def _capped_scale(d: int) -> float:
    return CAPPED_SCORE_STD / math.sqrt(d)


def _window_softcap_cases() -> list[Case]:
    """Dense attention with a sliding window or a softcap: one family each."""
    keys = ("B", "Hq", "Hkv", "Sq", "Skv", "D", "causal")
    windows = {  # name: (shape as in _attention_cases, window, dtypes)
        "attn_window_0_0": ((1, 2, 2, 40, 40, 32, False), (0, 0), (F16,)),  # each query sees its own key only
        "attn_window_3_5_gqa": ((1, 8, 2, 37, 37, 64, False), (3, 5), (F16, BF16, F32)),
        "attn_window_3_5_causal": ((1, 4, 2, 45, 45, 64, True), (3, 5), (F16,)),  # right side moot
        "attn_window_right_7": ((1, 2, 1, 30, 50, 64, False), (None, 7), (F16,)),
        "attn_window_left_128_causal": ((1, 2, 1, 77, 300, 64, True), (128, None), (F16,)),
        "attn_window_left_5_right_0": ((1, 2, 2, 33, 33, 32, False), (5, 0), (F16,)),  # spelled as causal
        "attn_window_more_queries": ((1, 2, 2, 20, 12, 32, False), (2, 1), (F16,)),  # first rows see no key
        "attn_window_decode": ((2, 8, 2, 1, 300, 64, True), (128, None), (F16,)),
    }
    cases = []
    for name, (shape, window, dtypes) in windows.items():
        for dtype in dtypes:
            cases.append(Case(name, "attention", dtype, dict(zip(keys, shape), window=window)))
    softcaps = {  # name: (shape, softcap, window, dtypes)
        "attn_softcap_30": ((1, 4, 2, 50, 50, 64, True), 30.0, None, (F16, BF16, F32)),
        "attn_softcap_50_cross": ((1, 2, 1, 19, 70, 64, False), 50.0, None, (F16,)),
        "attn_softcap_30_window": ((1, 4, 4, 41, 41, 32, False), 30.0, (16, 4), (F16,)),
        "attn_softcap_50_decode": ((2, 8, 2, 1, 200, 128, True), 50.0, None, (F16,)),
    }
    for name, (shape, softcap, window, dtypes) in softcaps.items():
        for dtype in dtypes:
            cases.append(Case(name, "attention", dtype, dict(zip(keys, shape), softcap=softcap, window=window,
                                                             scale=_capped_scale(shape[5]))))
    return cases


def _sinks_lse_value_dim_cases() -> list[Case]:
    """gpt-oss's sinks, in every family: rows that see no key (whose lse is their sink), GQA, a decode whose keys
    are split across programs (the merge adds the sink once), packed and paged sequences. ``lse``: the case
    returns lse (compared) and sends a gradient back through it (every paged case compares lse). ``Dv``: v's
    head dim, where it has its own (DeepSeek's MLA)."""
    keys = ("B", "Hq", "Hkv", "Sq", "Skv", "D", "causal")
    dense = {  # name: (shape as in _attention_cases, options, dtypes)
        "attn_sinks_lse_gqa_window_more_queries": ((1, 8, 2, 20, 12, 32, False), dict(window=(2, 1), sinks=True,
                                                                                      lse=True), (F16, F32)),
        # v of its own head dim, two column chunks (32 + 16) where q and k have one
        "attn_sinks_decode_split_keys_dv_48": ((1, 4, 1, 1, 600, 64, True), dict(sinks=True, Dv=48), (F16,)),
        "attn_lse_causal_more_queries": ((1, 2, 2, 20, 12, 32, True), dict(lse=True), (F16,)),  # lse -inf rows
    }
    cases = [Case(name, "attention", dtype, dict(zip(keys, shape), **options))
             for name, (shape, options, dtypes) in dense.items() for dtype in dtypes]
    cases.append(Case("varlen_sinks_lse_dv_causal_cross_lengths", "attention_varlen", F16,
                      dict(lens_q=(9, 4, 0, 21), lens_k=(14, 2, 3, 21), Hq=4, Hkv=2, D=32, Dv=16, causal=True,
                           sinks=True, lse=True)))
    cases.append(Case("paged_sinks_decode_page16", "paged_attention", F16,
                      dict(Hq=8, Hkv=2, D=64, lens=(1, 17, 100), Sq=1, page_size=16, sinks=True)))
    # DeepSeek's MLA: q and k of 192 (128 + 64 rope), v of 128; its absorbed decode's one KV head of a wider k
    # (the model's 576 and 512 are past the triton kernels' 256, here in small)
    cases.append(Case("attn_mla_dv_192_128_causal", "attention", F16, dict(B=1, Hq=2, Hkv=2, Sq=33, Skv=33, D=192,
                                                                           Dv=128, causal=True)))
    cases.append(Case("paged_mla_absorbed_decode_page16", "paged_attention", F16,
                      dict(Hq=8, Hkv=1, D=96, Dv=64, lens=(1, 17, 100), Sq=1, page_size=16)))
    return cases


def _varlen_cases() -> list[Case]:
    """Packed sequences (attention_varlen): lengths not multiples of 16, an empty sequence, queries and
    keys of different lengths per sequence (bottom-right masks per sequence)."""
    cases = {  # name: (params, dtypes)
        "varlen_ragged": (dict(lens_q=(17, 0, 33, 5, 64), Hq=2, Hkv=2, D=64, causal=False), (F16, BF16, F32)),
        "varlen_causal_gqa": (dict(lens_q=(29, 1, 47), Hq=8, Hkv=2, D=32, causal=True), (F16,)),
        "varlen_cross_lengths_causal": (dict(lens_q=(5, 0, 12, 9), lens_k=(20, 7, 12, 4), Hq=4, Hkv=2, D=64,
                                             causal=True), (F16,)),  # the last sequence: more queries than keys
        "varlen_window_3_5": (dict(lens_q=(40, 23, 0, 18), Hq=4, Hkv=1, D=64, causal=False, window=(3, 5)), (F16,)),
        "varlen_window_causal_softcap": (dict(lens_q=(31, 66, 2), Hq=2, Hkv=2, D=64, causal=True, window=(8, None),
                                              softcap=30.0, scale=_capped_scale(64)), (F16,)),
        "varlen_one_sequence": (dict(lens_q=(50,), lens_k=(90,), Hq=2, Hkv=1, D=128, causal=True), (F16,)),
    }
    return [Case(name, "attention_varlen", dtype, params) for name, (params, dtypes) in cases.items()
            for dtype in dtypes]


def _paged_cases() -> list[Case]:
    """A decode step on a paged KV cache: append each sequence's Sq new tokens (paged_kv_append, compared
    bit for bit), then attend (paged_attention). Pages are shuffled across the pool; ``lens`` are the
    lengths after the append."""
    base = dict(Hq=8, Hkv=2, D=64)
    cases = {  # name: (params, dtypes)
        "paged_decode_page16": (dict(base, lens=(1, 17, 100, 33), Sq=1, page_size=16), (F16, BF16, F32)),
        "paged_speculative_page16": (dict(base, lens=(3, 40, 77), Sq=3, page_size=16), (F16,)),
        "paged_decode_page256": (dict(base, lens=(300, 5, 513), Sq=1, page_size=256), (F16,)),
        # pages wholly before the window are marked -1 in the table: they must not be read
        "paged_speculative_page256_window": (dict(base, lens=(600, 260), Sq=3, page_size=256, window=(128, None)),
                                             (F16,)),
        "paged_decode_window_page16": (dict(base, lens=(90, 12), Sq=1, page_size=16, window=(20, None)), (F16,)),
        "paged_softcap_page16": (dict(Hq=4, Hkv=4, D=128, lens=(70, 31), Sq=1, page_size=16, softcap=30.0,
                                      scale=_capped_scale(128)), (F16,)),
    }
    return [Case(name, "paged_attention", dtype, params) for name, (params, dtypes) in cases.items()
            for dtype in dtypes]


def _norm_cases() -> list[Case]:
    from .norm_cases import NORM_CASES  # its own module: it imports Case from here

    return NORM_CASES


def _rope_cases() -> list[Case]:
    from .rope_cases import ROPE_CASES  # its own module, as the norms'

    return ROPE_CASES


def _cross_entropy_cases() -> list[Case]:
    from .cross_entropy_cases import CROSS_ENTROPY_CASES  # its own module: it imports Case from here

    return CROSS_ENTROPY_CASES


CASES: list[Case] = (_adam_cases() + _sgd_cases() + _clip_cases() + _attention_cases() + _window_softcap_cases()
                     + _varlen_cases() + _paged_cases() + _sinks_lse_value_dim_cases() + _norm_cases() + _rope_cases()
                     + _cross_entropy_cases())
