"""The nki backend's ops on CPU tensors (forced with use_backend("nki"): the NKI emulator runs the
kernels) against backends/reference in float64, at sizes that cross tile boundaries; plus the
device wiring with the Neuron SDK mocked at the import boundary (a fake ``nki`` in sys.modules).
"""

import importlib
import math
import sys
import types
import warnings

import pytest
import torch

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import GRADIENT_FACTOR, tolerance
from portable_ops.backends import nki as nki_backend
from portable_ops.backends.nki import compat, emulator, runtime
from portable_ops.backends.nki.emulator import torch_neuronx as torch_neuronx_double
from portable_ops.definitions.adam import adam as reference_adam
from portable_ops.definitions.attention import attention_bwd as reference_bwd
from portable_ops.definitions.attention import attention_fwd as reference_fwd
from portable_ops.definitions.attention import visible
from portable_ops.definitions.grad_norm import grad_norm as reference_grad_norm

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = nki_backend.BACKEND.ops


# A neuron device as dispatch reads it (only .type): naming PrivateUse1 "neuron" can't be undone in a process.
NEURON = types.SimpleNamespace(type="neuron")


def close(out, ref, tol):
    atol, rtol = tol
    out, ref = out.double(), ref.double()
    bound = atol + rtol * ref.abs()
    both_nan = out.isnan() & ref.isnan()
    assert bool(((out - ref).abs() <= bound).logical_or(both_nan).all()), float((out - ref).abs().max())


def test_backend_is_available_and_default_for_trainium_devices():
    assert dispatch.unavailable_reason("nki") is None
    assert nki_backend.BACKEND.device_reasons(torch.device("cpu")) == []
    assert dispatch.preference(NEURON)[0] == "nki"
    if not compat.USING_SDK:
        reasons = nki_backend.BACKEND.device_reasons(NEURON)
        assert reasons and "Neuron SDK" in reasons[0]


# 129 and 300 are not multiples of 128; 128*2048 + 129 crosses the 2048-wide free-axis tile.
ADAM_SHAPES = [(1,), (129,), (3, 100), (128 * 2048 + 129,)]
ADAM_VARIANTS = {
    "adam": {},
    "adam_l2": dict(weight_decay=0.01),
    "adamw": dict(weight_decay=0.1, decoupled_weight_decay=True),
    "amsgrad_maximize": dict(amsgrad=True, maximize=True, weight_decay=0.05, decoupled_weight_decay=True),
    "scaled_clipped_lr_tensor": dict(grad_scale=1024.0, clip_coef=0.25, found_inf=0.0, lr="tensor"),
}


def _adam_state(dtype, amsgrad, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in ADAM_SHAPES]
    grads = [torch.randn(s, generator=g).to(dtype) for s in ADAM_SHAPES]
    exp_avgs = [(0.1 * torch.randn(s, generator=g)).to(dtype) for s in ADAM_SHAPES]
    exp_avg_sqs = [(0.01 * torch.rand(s, generator=g)).to(dtype) for s in ADAM_SHAPES]
    maxes = [(v.float() * 1.5).to(dtype) for v in exp_avg_sqs] if amsgrad else []
    steps = [torch.tensor(float(i + 2)) for i in range(len(ADAM_SHAPES))]
    return params, grads, exp_avgs, exp_avg_sqs, maxes, steps


def _adam_kwargs(dtype_dev, extra):
    kw = dict(amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.0, eps=1e-8, maximize=False,
              decoupled_weight_decay=False, grad_scale=None, found_inf=None, clip_coef=None)
    kw.update(extra)
    for key in ("grad_scale", "clip_coef", "found_inf"):
        if kw[key] is not None:
            kw[key] = torch.tensor(kw[key], dtype=dtype_dev)
    if kw["lr"] == "tensor":
        kw["lr"] = torch.tensor(3e-3)
    return kw


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("variant", ADAM_VARIANTS)
def test_adam_matches_float64_reference(variant, dtype):
    extra = ADAM_VARIANTS[variant]
    kw = _adam_kwargs(torch.float32, extra)
    state = _adam_state(dtype, kw["amsgrad"])
    oracle = [[t.double() for t in group] for group in state]
    oracle[5] = [s.double() for s in state[5]]
    OPS["adam"].run(*state, **kw)
    ref_kw = dict(kw, lr=kw["lr"].double() if isinstance(kw["lr"], torch.Tensor) else kw["lr"])
    reference_adam(*oracle, **ref_kw)
    for k in (0, 2, 3, 4):  # params and moments; the grads a scaled step writes: tests/test_nki_scaled_grads.py
        for a, b in zip(state[k], oracle[k]):
            assert a.dtype == dtype
            # the oracle rounds once to the stored dtype, like the kernel
            close(a, b.to(dtype), tolerance("adam", dtype))
    assert [float(s) for s in state[5]] == [float(s) for s in oracle[5]]


def test_adam_found_inf_changes_nothing_even_with_nonfinite_grads():
    kw = _adam_kwargs(torch.float32, dict(grad_scale=8.0, found_inf=1.0, amsgrad=True, weight_decay=0.1,
                                          decoupled_weight_decay=True))
    state = _adam_state(BF16, True)
    state[1][0].fill_(float("inf"))
    state[1][1][5] = float("nan")
    before = [[t.clone() for t in group] for group in state]
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")
    call = dict(zip(names, state), **kw)
    with portable_ops.use_backend("nki"):
        assert dispatch.select("adam", call, torch.device("cpu")).backend == "nki"
        dispatch.dispatch("adam", call, torch.device("cpu")).run(**call)
    for group, old in zip(state, before):
        for a, b in zip(group, old):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_grad_norm_matches_float64_reference(norm_type, dtype):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=g).to(dtype) for s in [(1,), (127,), (129,), (5, 7, 11), (128 * 2048 + 3,)]]
    out = OPS["grad_norm"].run(grads=grads, norm_type=norm_type)
    ref = reference_grad_norm([x.double() for x in grads], norm_type)
    assert out.dtype == torch.float32 and out.shape == ()
    close(out, ref, (1e-6, 1e-5))


@pytest.mark.parametrize("max_nan", ["propagate", "drop"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_norm_is_nan_when_a_grad_holds_nan_whatever_max_does_with_nan(norm_type, max_nan):
    # The NKI docs do not say what the engines' maximum does with NaN; under "drop" (IEEE maxNum)
    # a kernel that relied on max propagating NaN returned the largest finite |g|.
    grads = [torch.randn(300), torch.randn(4, 129), torch.randn(7)]
    grads[1][2, 5] = float("nan")
    with emulator.max_nan_semantics(max_nan):
        out = OPS["grad_norm"].run(grads=grads, norm_type=norm_type)
        grads[1][2, 5] = float("inf")  # inf without NaN stays inf
        inf_out = OPS["grad_norm"].run(grads=grads, norm_type=norm_type)
    assert out.isnan(), float(out)
    assert inf_out.isinf() and inf_out > 0, float(inf_out)


def _gpt2_medium_state(dtype=torch.float32):
    """The 292-tensor, 354.9M-element list of the optimizer bench, as meta tensors (no storage)."""
    from portable_ops.bench.optimizer import gpt2_medium_shapes
    shapes = gpt2_medium_shapes()
    made = [[torch.empty(s, device="meta", dtype=dtype) for s in shapes] for _ in range(4)]
    steps = [torch.zeros((), device="meta") for _ in shapes]
    return made, steps


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_step_over_the_292_tensor_list_is_one_launch_writing_each_output_once(amsgrad):
    (params, grads, exp_avgs, exp_avg_sqs), steps = _gpt2_medium_state()
    maxes = [torch.empty_like(p) for p in params] if amsgrad else []
    kw = _adam_kwargs(torch.float32, dict(weight_decay=0.1, decoupled_weight_decay=True, amsgrad=amsgrad))
    with emulator.count_only(), emulator.count_instructions() as stats:
        OPS["adam"].run(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, **kw)
    n = sum(p.numel() for p in params)
    assert len(params) == 292 and n == 354_823_168
    assert stats.launches == 1
    states = 4 if amsgrad else 3  # param, moments: read and written once each, in place; the grad read once
    assert stats.dma_bytes_out == states * 4 * n
    assert stats.dma_bytes_in - states * 4 * n - 4 * n < 128 * 4 * 1024  # + the hyperparameter table


def test_clip_norm_over_the_292_tensor_list_is_one_launch():
    (_, grads, _, _), _ = _gpt2_medium_state(torch.bfloat16)
    with emulator.count_only(), emulator.count_instructions() as stats:
        OPS["grad_norm"].run(grads=grads, norm_type=2.0)
    assert stats.launches == 1
    assert stats.dma_bytes_in == 2 * sum(g.numel() for g in grads)


def test_adam_mixed_dtypes_and_odd_sizes_in_one_launch_match_the_reference():
    g = torch.Generator().manual_seed(1)
    shapes = [(3, 100), (129,), (1,), (128 * 9,), (5, 130)] * 60  # 300 tensors, most with a tail
    dtypes = [F32, BF16, F16]
    params = [torch.randn(s, generator=g).to(dtypes[i % 3]) for i, s in enumerate(shapes)]
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    exp_avgs = [(0.1 * torch.randn(p.shape, generator=g)).float() for p in params]  # float32 state
    exp_avg_sqs = [(0.01 * torch.rand(p.shape, generator=g)).float() for p in params]
    steps = [torch.tensor(float(i % 7)) for i in range(len(params))]  # steps differ between tensors
    state = [params, grads, exp_avgs, exp_avg_sqs, [], steps]
    oracle = [[t.double() for t in group] for group in state]
    kw = _adam_kwargs(torch.float32, dict(weight_decay=0.05, decoupled_weight_decay=True))
    before = [p.data_ptr() for p in params]
    with emulator.count_instructions() as stats:
        OPS["adam"].run(*state, **kw)
    reference_adam(*oracle, **kw)
    assert stats.launches == 1
    assert [p.data_ptr() for p in params] == before
    for mine, ref in zip(state[:4], oracle[:4]):
        for a, b in zip(mine, ref):
            close(a, b.to(a.dtype), tolerance("adam", a.dtype))
    assert [float(s) for s in steps] == [float(s) for s in oracle[5]]


def test_grad_norm_declines_other_norms_with_a_reason():
    reasons = nki_backend.BACKEND.reasons("grad_norm", dict(grads=[torch.zeros(3)], norm_type=1.0))
    assert reasons == ["norm_type 1 is not supported (2 and inf are)"]
    assert nki_backend.BACKEND.reasons("grad_norm", dict(grads=[torch.zeros(3, dtype=torch.float64)], norm_type=2.0))


ATTN_SHAPES = {  # (B, Hq, Hkv, Sq, Skv, D, causal)
    "square_crosses_tiles": (1, 2, 2, 130, 130, 32, True),
    "gqa_cross_lengths": (1, 4, 2, 70, 200, 64, False),
    "causal_bottom_right": (1, 2, 1, 37, 150, 16, True),
    "more_queries_than_keys": (1, 2, 2, 140, 12, 32, True),  # the first 128 rows see no key
    "decode": (2, 4, 1, 1, 260, 64, True),
    "head_dim_128": (1, 1, 1, 20, 20, 128, True),
    # head dims over 128: Q K^T and dO V^T contract over two chunks of partitions (192 = 128 + 64)
    "head_dim_192_gqa_causal": (1, 4, 2, 130, 150, 192, True),
    "head_dim_192_decode": (1, 2, 1, 1, 200, 192, True),
    "head_dim_256_causal": (1, 2, 2, 140, 140, 256, True),
    "head_dim_256_gqa_cross": (1, 4, 1, 70, 200, 256, False),
    "head_dim_256_decode": (2, 4, 2, 1, 260, 256, True),
}


def _check_attention(shape, dtype, seed=5, key_std=1.0, scale=None, **features):
    """The nki forward and backward on ``shape`` = (B, Hq, Hkv, Sq, Skv, D, causal) against the float64
    reference, with ``features`` (window, softcap) passed to both. Rows that see no key must come out
    exactly as the reference's convention: out 0, lse -inf, dQ 0. Returns (out, lse, grads)."""
    B, Hq, Hkv, Sq, Skv, D, causal = shape
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, Hq, Sq, D, generator=g).to(dtype) for _ in range(2))
    k, v = ((key_std * torch.randn(B, Hkv, Skv, D, generator=g)).to(dtype) for _ in range(2))
    options = dict(causal=causal, scale=D ** -0.5 if scale is None else scale, **features)
    out, lse = OPS["attention_fwd"].run(q=q, k=k, v=v, **options)
    r_out, r_lse = reference_fwd(q.double(), k.double(), v.double(), **options)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq)
    close(out, r_out, tolerance("attention", dtype))
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    close(lse.nan_to_num(neginf=0.0), r_lse.nan_to_num(neginf=0.0), tolerance("attention", F32))
    grads = OPS["attention_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=do, **options)
    r_grads = reference_bwd(q.double(), k.double(), v.double(), r_out, r_lse, do.double(), **options)
    for mine, ref, like in zip(grads, r_grads, (q, k, v)):
        assert mine.shape == like.shape and mine.dtype == dtype
        close(mine, ref, tolerance("attention", dtype).scaled(GRADIENT_FACTOR))
    seen = visible(torch.arange(Sq) + Skv - Sq, torch.arange(Skv), causal, features.get("window"))
    blind = torch.zeros(Sq, dtype=torch.bool) if seen is None else ~seen.any(-1)  # rows that see no key
    assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind]))
    assert bool((lse[:, :, blind] == -math.inf).all()) and bool(lse[:, :, ~blind].isfinite().all())
    assert torch.equal(grads[0][:, :, blind], torch.zeros_like(grads[0][:, :, blind]))
    return out, lse, grads


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name", ATTN_SHAPES)
def test_attention_fwd_bwd_match_float64_reference(name, dtype):
    _check_attention(ATTN_SHAPES[name], dtype)


ATTN_FEATURES = {  # name: ((B, Hq, Hkv, Sq, Skv, D, causal), window, softcap)
    "window_gqa_ragged": ((1, 4, 2, 150, 150, 32, False), (20, 9), None),
    "window_0_0": ((1, 2, 1, 130, 130, 16, False), (0, 0), None),  # each query sees its own key only
    "window_causal_skips_blocks": ((1, 2, 1, 300, 300, 32, True), (40, None), None),
    "window_causal_wide_left": ((1, 2, 2, 200, 330, 16, True), (150, None), None),
    "window_right_only_cross": ((1, 2, 2, 70, 260, 16, False), (None, 5), None),
    "window_left_only_cross": ((1, 4, 1, 140, 90, 16, False), (3, None), None),
    # Sq > Skv: the first rows' bands end before key 0, so they see no key at all
    "window_more_queries": ((1, 2, 2, 140, 12, 32, False), (2, 1), None),
    "window_causal_more_queries_gqa": ((1, 4, 2, 200, 70, 16, True), (10, None), None),
    "window_decode": ((2, 4, 1, 1, 260, 64, True), (128, None), None),
    "window_head_dim_192": ((1, 2, 1, 130, 150, 192, False), (60, 20), None),
    "softcap_causal_gqa": ((1, 4, 2, 130, 130, 32, True), None, 1.5),
    "softcap_cross": ((1, 2, 1, 90, 200, 64, False), None, 2.0),
    "softcap_window_gqa": ((1, 4, 2, 150, 170, 32, False), (30, 12), 2.0),
    "softcap_window_causal_more_queries": ((1, 2, 2, 140, 12, 32, True), (4, None), 1.0),
    "softcap_decode": ((2, 8, 2, 1, 200, 128, True), None, 5.0),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name", ATTN_FEATURES)
def test_attention_window_and_softcap_match_float64_reference(name, dtype):
    shape, window, softcap = ATTN_FEATURES[name]
    # keys of std 3 make scores of std ~3: a softcap of 1 to 5 bends them, so ignoring it would fail
    _check_attention(shape, dtype, key_std=3.0, window=window, softcap=softcap)


@pytest.mark.parametrize("features", [dict(causal=True), dict(causal=False, window=(300, 40), softcap=2.0)],
                         ids=["causal", "window_softcap"])
def test_attention_over_several_resident_sections_matches_the_reference(features):
    """Keys resident 512 at a time and, in the backward, query rows 128 at a time: the forward carries each query
    tile's ``[P V, rowsum, -max]`` through HBM between the key sections it sees and joins them at the larger max,
    the backward carries dQ's sum between key sections and sums dK, dV over query sections; out, lse and the
    gradients (the sink's included) agree with the reference, with GQA, ragged lengths and a sink (three key
    sections here, where the defaults would hold every key and row in one)."""
    from portable_ops.backends.nki import attention as nki_attention
    from portable_ops.backends.nki.attention_backward import attention_bwd_kernel
    from portable_ops.backends.nki.attention_forward import attention_fwd_kernel
    g = torch.Generator().manual_seed(7)
    q, do = (torch.randn(1, 2, 140, 32, generator=g) for _ in range(2))
    k, v = (3.0 * torch.randn(1, 1, 1100, 32, generator=g) for _ in range(2))
    sinks = torch.randn(2, generator=g)
    static = nki_attention._static(features.get("causal"), 0.2, features.get("window"), features.get("softcap"))
    sink_rows = nki_attention._sinks_down_partitions(sinks)
    out, lse = runtime.launch(attention_fwd_kernel, q, k, v, sinks=sink_rows, section_keys=512, **static)
    grads = runtime.launch(attention_bwd_kernel, q, k, v, out, lse, do, sinks=sink_rows, section_rows=128,
                           section_keys=512, **static)
    options = dict(scale=0.2, sinks=sinks.double(), **features)
    r_out, r_lse = reference_fwd(q.double(), k.double(), v.double(), **options)
    close(out, r_out, tolerance("attention", F32))
    close(lse.reshape(r_lse.shape), r_lse, tolerance("attention", F32))
    r_grads = reference_bwd(q.double(), k.double(), v.double(), r_out, r_lse, do.double(), **options)
    for mine, ref in zip((*grads[:3], grads[3].sum((0, 2, 3))), r_grads):
        close(mine, ref, tolerance("attention", F32).scaled(GRADIENT_FACTOR))


def test_packed_sequences_with_no_key_or_no_query_match_the_definition():
    """Packed attention runs each sequence through the dense kernels; a sequence with queries but no keys (its rows
    see only their sink), and one with keys but no queries, take the zero-size answer, gradients included: out,
    lse, dq, dk, dv and dsinks (a gradient through lse too) agree with the float64 definition."""
    from portable_ops.definitions import attention_varlen as varlen
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = (3, 0, 40), (0, 6, 37)
    q, do = (torch.randn(sum(lens_q), 2, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 1, 16, generator=g) for _ in range(2))
    sinks, dlse = torch.randn(2, generator=g), torch.randn(2, sum(lens_q), generator=g)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    options = dict(causal=True, scale=0.3, sinks=sinks)
    out, lse = OPS["attention_varlen_fwd"].run(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                                               max_seqlen_k=37, **options)
    double = dict(options, sinks=sinks.double())
    r_out, r_lse = varlen.attention_varlen_fwd(q.double(), k.double(), v.double(), cu_q, cu_k, 40, 37, **double)
    close(out, r_out, tolerance("attention", F32))
    close(lse, r_lse, tolerance("attention", F32))
    grads = OPS["attention_varlen_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=do, cu_seqlens_q=cu_q,
                                            cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=37, dlse=dlse, **options)
    r_grads = varlen.attention_varlen_bwd(q.double(), k.double(), v.double(), r_out, r_lse, do.double(), cu_q, cu_k,
                                          40, 37, dlse=dlse.double(), **double)
    for mine, ref in zip(grads, r_grads):
        close(mine, ref, tolerance("attention", F32).scaled(GRADIENT_FACTOR))


def test_softcap_saturates_huge_scores_and_keeps_gradients_finite():
    """Scores of ~1e4 against a softcap of 2: nearly every capped score is +-2, as in the reference."""
    out, lse, grads = _check_attention((1, 2, 1, 40, 50, 16, False), F32, scale=2e3, softcap=2.0)
    assert all(bool(t.isfinite().all()) for t in (out, lse, *grads))


def test_window_skips_invisible_blocks_and_masks_only_the_edge_blocks(monkeypatch):
    """At trace time: a (query tile, 128-key block) pair is computed iff some query of the tile sees some key of
    the block, and only blocks a band edge crosses are masked: in the forward by one bias matmul each (a mask
    added to the scores in PSUM), in the backward by one affine_select on P per edge. Counted on the matmuls whose
    moving operand is the pair's V block with its ones column (forward: one per pair), a [rows, D] tile (backward:
    dV, dK and dQ, three per pair) or a mask (accumulating onto the scores), and on affine_select calls."""
    from portable_ops.backends.nki.compat import nisa
    B, H, Sq, Skv, D = 1, 1, 300, 520, 32
    cases = [(False, (100, 30)), (True, (150, None)), (False, (None, 7)), (False, (3, None)), (True, None)]
    for causal, window in cases:
        seen = visible(torch.arange(Sq) + Skv - Sq, torch.arange(Skv), causal, window)
        left, right = window or (None, None)
        offset = torch.arange(Skv)[None, :] - (torch.arange(Sq) + Skv - Sq)[:, None]  # key minus query position
        pairs = edges = cut = 0
        for q0 in range(0, Sq, 128):
            for k0 in range(0, Skv, 128):
                block, off = seen[q0:q0 + 128, k0:k0 + 128], offset[q0:q0 + 128, k0:k0 + 128]
                if block.any():
                    pairs += 1
                    right_edge = 0 if causal and (right is None or right > 0) else right
                    sides = (int(right_edge is not None and bool((off > right_edge).any()))
                             + int(left is not None and bool((off < -left).any())))
                    edges, cut = edges + sides, cut + bool(sides)
        n_q, n_k = -(-Sq // 128), -(-Skv // 128)
        selects, moving = [], []  # each affine_select's first pattern step (-1: a mask; 0: a row fix-up), each
        # matmul's moving free size

        def select(dst, pattern, real=nisa.affine_select, **kwargs):
            selects.append(pattern[0][0])
            return real(dst, pattern, **kwargs)

        def matmul(dst, stationary, mover, real=nisa.nc_matmul, **kwargs):
            moving.append((mover.shape[-1], kwargs.get("accumulate")))
            return real(dst, stationary, mover, **kwargs)

        monkeypatch.setattr(nisa, "affine_select", select)
        monkeypatch.setattr(nisa, "nc_matmul", matmul)
        q, do = torch.randn(B, H, Sq, D), torch.randn(B, H, Sq, D)
        k, v = torch.randn(B, H, Skv, D), torch.randn(B, H, Skv, D)
        options = dict(causal=causal, scale=0.2, window=window)
        out, lse = OPS["attention_fwd"].run(q=q, k=k, v=v, **options)
        fwd_pv = sum(n == D + 1 for n, _ in moving)
        fwd_masks = sum(n != D + 1 and bool(accumulate) for n, accumulate in moving)  # D <= 128: no chunk sums
        selects[:], moving[:] = [], []
        OPS["attention_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=do, **options)
        monkeypatch.undo()
        assert fwd_pv == pairs and sum(n == D for n, _ in moving) == 3 * pairs, (causal, window)
        assert fwd_masks == cut and selects.count(-1) == edges, (causal, window)
        assert pairs < n_q * n_k or window is None


def test_attention_takes_window_and_softcap_through_the_public_api_with_autograd():
    """Dispatch keeps window and softcap calls on nki (no fallback), and autograd's gradients are the
    reference's."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 150, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 150, 32, generator=g, requires_grad=True) for _ in range(2))
    for options in (dict(window=(20, 3)), dict(causal=True, window=(40, None), softcap=3.0), dict(softcap=1.0)):
        with portable_ops.use_backend("nki"):
            call = dict(q=q, k=k, v=v, scale=1.0, causal=False, window=None, softcap=None) | options
            assert nki_backend.BACKEND.reasons("attention_fwd", call) == []
            assert portable_ops.explain("attention", q, k, v, **options).backend == "nki", options
            with warnings.catch_warnings():
                warnings.simplefilter("error", portable_ops.FallbackWarning)
                out = portable_ops.attention(q, k, v, **options)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        with portable_ops.use_backend("reference"):
            ref = portable_ops.attention(q, k, v, **options)
            r_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref, **tolerance("attention", F32)._asdict())
        for a, b in zip(grads, r_grads):
            torch.testing.assert_close(a, b, **tolerance("attention", F32).scaled(GRADIENT_FACTOR)._asdict())


@pytest.mark.parametrize("D", [40, 72, 80, 96, 160, 192])
def test_attention_at_head_dims_that_are_not_powers_of_two_with_zero_and_negative_scales(D):
    g = torch.Generator().manual_seed(D)
    q, do = (torch.randn(1, 2, 70, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 1, 130, D, generator=g) for _ in range(2))
    for scale, causal in ((0.0, True), (-0.3, False), (D ** -0.5, True)):
        out, lse = OPS["attention_fwd"].run(q=q, k=k, v=v, causal=causal, scale=scale)
        r_out, r_lse = reference_fwd(q.double(), k.double(), v.double(), causal=causal, scale=scale)
        close(out, r_out, tolerance("attention", F32))
        close(lse, r_lse, tolerance("attention", F32))
        grads = OPS["attention_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=do, causal=causal, scale=scale)
        r_grads = reference_bwd(q.double(), k.double(), v.double(), r_out, r_lse, do.double(), causal=causal,
                                scale=scale)
        for mine, ref in zip(grads, r_grads):
            close(mine, ref, tolerance("attention", F32).scaled(GRADIENT_FACTOR))


@pytest.mark.parametrize("heads_inner", [False, True])
def test_attention_outputs_follow_the_layout_rule(heads_inner):
    from portable_ops import layout
    g = torch.Generator().manual_seed(2)

    def make(s, h):  # [B, H, S, D], heads inner to the sequence when transposed out of [B, S, H, D]
        t = torch.randn(2, s, h, 32, generator=g)
        return t.transpose(1, 2) if heads_inner else t.transpose(1, 2).contiguous()

    q, k, v = make(33, 4), make(40, 2), make(40, 2)
    out, lse = OPS["attention_fwd"].run(q=q, k=k, v=v, causal=True, scale=0.2)
    grads = OPS["attention_bwd"].run(q=q, k=k, v=v, out=out, lse=lse, dout=torch.ones_like(out), causal=True, scale=0.2)
    assert out.stride() == layout.strides_like(q)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.stride() == layout.strides_like(like)
    assert torch.equal(out, OPS["attention_fwd"].run(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                                     causal=True, scale=0.2)[0])


def test_attention_through_the_public_api_with_autograd():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 33, 32, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 33, 32, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 33, 32, generator=g, requires_grad=True)
    with portable_ops.use_backend("nki"):
        assert portable_ops.explain("attention", q, k, v, causal=True).backend == "nki"
        out = portable_ops.attention(q, k, v, causal=True)
        out.sum().backward()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, **tolerance("attention", F32)._asdict())
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True).sum().backward()
    for a, b in zip((q, k, v), (qr, kr, vr)):
        torch.testing.assert_close(a.grad, b.grad, **tolerance("attention", F32).scaled(GRADIENT_FACTOR)._asdict())


def test_attention_takes_head_dims_up_to_256_and_declines_larger_with_a_reason():
    for d in (160, 256):
        q = torch.zeros(1, 1, 4, d)
        assert nki_backend.BACKEND.reasons("attention_fwd", dict(q=q, k=q, v=q, causal=False, scale=1.0)) == []
    q = torch.zeros(1, 1, 4, 320)
    reasons = nki_backend.BACKEND.reasons("attention_fwd", dict(q=q, k=q, v=q, causal=False, scale=1.0))
    assert reasons == ["head_dim 320 is over 256, the largest the nki kernels take"]


# ----------------------------------------------------------------------------- SDK wiring, mocked
@pytest.fixture
def fake_sdk(monkeypatch):
    """A stand-in Neuron SDK at the import boundary: ``nki`` with jit/simulate; language/isa are
    the emulator's (so kernels still compute), and every simulate/jit call is recorded; with ``torch_neuronx``, a
    ``torch_neuronx`` whose ``nki_op`` is the project's test double of it."""
    calls = []

    def install(functional=True, torch_neuronx=True):
        nki = types.ModuleType("nki")
        if functional:
            nki.jit = emulator.jit

            def simulate(kernel):
                calls.append(("simulate", getattr(kernel, "__name__", kernel)))
                return emulator.simulate(kernel)

            nki.simulate = simulate
            monkeypatch.setitem(sys.modules, "nki.language", emulator.language)
            monkeypatch.setitem(sys.modules, "nki.isa", emulator.isa)
            nki.language, nki.isa = emulator.language, emulator.isa
        else:  # what PyPI's placeholder looks like: an importable, empty package
            monkeypatch.setitem(sys.modules, "nki.language", types.ModuleType("nki.language"))
            monkeypatch.setitem(sys.modules, "nki.isa", types.ModuleType("nki.isa"))
        monkeypatch.setitem(sys.modules, "nki", nki)
        monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(nki_op=torch_neuronx_double.nki_op)
                            if torch_neuronx else None)  # None in sys.modules: the import raises ImportError
        monkeypatch.delenv("PORTABLE_OPS_NKI_EMULATOR", raising=False)
        importlib.reload(compat)
        return calls

    yield install
    monkeypatch.undo()
    importlib.reload(compat)


def test_real_sdk_is_used_when_functional_and_cpu_tensors_go_through_nki_simulate(fake_sdk):
    calls = fake_sdk(functional=True)
    assert compat.USING_SDK and compat.HAS_SIMULATOR and compat.MODE == "sdk"
    assert compat.USING_TORCH_NEURONX and compat.nki_op is sys.modules["torch_neuronx"].nki_op
    assert runtime.where(torch.device("cpu")) == "simulator"
    assert runtime.where(NEURON) == "device"
    assert nki_backend.BACKEND.device_reasons(NEURON) == []
    grads = [torch.randn(300)]
    out = OPS["grad_norm"].run(grads=grads, norm_type=2.0)
    torch.testing.assert_close(out, grads[0].norm())
    assert [c[0] for c in calls] == ["simulate"]  # the one launch of the norm went to nki.simulate


def test_trainium_tensors_call_the_jit_kernel_directly(fake_sdk, monkeypatch):
    fake_sdk(functional=True)
    seen = []

    def kernel(*args, **static):
        seen.append((args, static))
        return "device result"

    monkeypatch.setattr(runtime, "where", lambda device: "device")
    assert runtime.launch(kernel, torch.zeros(2), scale=0.5) == "device result"
    assert seen and seen[0][1] == {"scale": 0.5}


def test_neuron_tensors_need_torch_neuronxs_nki_op_besides_the_sdk(fake_sdk):
    fake_sdk(functional=True, torch_neuronx=False)
    assert compat.USING_SDK and not compat.USING_TORCH_NEURONX and compat.nki_op is torch_neuronx_double.nki_op
    reasons = nki_backend.BACKEND.device_reasons(NEURON)
    assert reasons and "torch-neuronx's nki_op" in reasons[0] and "not installed" in reasons[0]
    assert nki_backend.BACKEND.device_reasons(torch.device("cpu")) == []  # nki.simulate, through the double


def test_placeholder_nki_package_falls_back_to_the_emulator(fake_sdk):
    fake_sdk(functional=False)
    assert not compat.USING_SDK and compat.nki is emulator
    assert "placeholder" in compat.SDK_REASON
    reasons = nki_backend.BACKEND.device_reasons(NEURON)
    assert reasons and "placeholder" in reasons[0]
    assert runtime.where(torch.device("cpu")) == "emulator"


nki_attention = importlib.import_module("portable_ops.backends.nki.attention")


def _attention_counts(sq, skv, d, causal, window=None, softcap=None):
    """Instructions of the forward and the backward kernels (count-only) for one query head, with a sink."""
    q, k = (torch.zeros(1, 1, n, d, dtype=BF16, device="meta") for n in (sq, skv))
    lse = torch.zeros(1, 1, sq, device="meta")
    options = dict(causal=causal, scale=0.1, window=window, softcap=softcap, sinks=torch.zeros(1, device="meta"))
    counts = []
    for op, args in (("attention_fwd", {}), ("attention_bwd", dict(out=q, lse=lse, dout=q, dlse=lse))):
        with emulator.count_only(), emulator.count_instructions() as stats:
            OPS[op].run(q=q, k=k, v=k, **args, **options)
        counts.append(sum(stats.instructions.values()))
    return counts


def test_the_head_instruction_estimate_bounds_both_attention_kernels():
    """The host splits heads into launches by :func:`head_instructions`: never under what either kernel issues for
    a head (a launch past the compiler's threshold fails), and not far over it on a long sequence."""
    for sq, skv, d, causal, window, softcap in ((8192, 8192, 128, True, None, None), (2048, 512, 8, True, None, 5.0),
                                                (512, 2048, 256, False, (300, 40), None)):
        counted = max(_attention_counts(sq, skv, d, causal, window, softcap))
        estimate = nki_attention.head_instructions(sq, skv, causal, window)
        assert counted <= estimate
    assert estimate <= 8 * counted and nki_attention.head_instructions(8192, 8192, True, None) <= 2.5 * max(
        _attention_counts(8192, 8192, 128, True))


def test_attention_past_the_instruction_budget_runs_in_several_launches(monkeypatch):
    """Both kernels issue every (batch, head) of a call in one launch: 32 heads of 32K causal keys pass the
    compiler's 5,000,000 instructions in the backward, so the host splits the batch and the KV heads."""
    one = nki_attention.head_instructions(200, 200, True, None)
    monkeypatch.setattr(runtime, "INSTRUCTION_BUDGET", 3 * one)  # one KV head of two query heads a launch
    q, k, v = (torch.randn(2, h, 200, 8, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, requires_grad=True)
    needs = 2 * max(_attention_counts(200, 200, 8, True))  # a launch's two query heads: the whole call's a quarter
    with emulator.instruction_budget(needs), emulator.count_instructions() as stats:
        with portable_ops.use_backend("nki"):
            out = portable_ops.attention(q, k, v, causal=True, sinks=sinks)
            got = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    assert stats.launches == 8
    ref_out, ref_lse = reference_fwd(*(t.detach().double() for t in (q, k, v)), causal=True, scale=8 ** -0.5,
                                     sinks=sinks.detach().double())
    close(out, ref_out, (1e-5, 1e-5))
    want = reference_bwd(*(t.detach().double() for t in (q, k, v)), ref_out, ref_lse, 2 * ref_out, causal=True,
                         scale=8 ** -0.5, sinks=sinks.detach().double())
    for g, w in zip(got, want):
        close(g, w, (1e-4, 1e-4))
    monkeypatch.setattr(runtime, "INSTRUCTION_BUDGET", one - 1)
    with portable_ops.use_backend("nki"):
        reasons = portable_ops.explain("attention", q, k, v, causal=True).rejected["nki"]
        packed = portable_ops.explain("attention_varlen", q[0].transpose(0, 1), k[0].transpose(0, 1),
                                      v[0].transpose(0, 1), torch.tensor([0, 200], dtype=torch.int32),
                                      torch.tensor([0, 200], dtype=torch.int32), 200, 200, causal=True)
    assert reasons == packed.rejected["nki"] == [f"one head of 200 queries over 200 keys takes up to {one} "
                                                 f"instructions, past the Neuron compiler's {one - 1} a launch"]
