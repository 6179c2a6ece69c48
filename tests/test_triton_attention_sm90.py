"""The Hopper (sm_90) Gluon attention kernels: every path the forward and backward take (GQA, transposed
inputs, ragged tiles, bottom-right causal, persistent grids, tiles wholly past Sq), their launch choices,
configs and tile counters. Skipped where no sm_90 GPU is present, but for the host-side choices."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from triton_attention_checks import DEVICE, attn, check_against_reference, inputs

import portable_ops
from portable_ops import dispatch, layout

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
sm90 = importlib.import_module("portable_ops.backends.triton.attention_sm90")
launch_mod = importlib.import_module("portable_ops.backends.triton.launch")
ON_SM90 = DEVICE.type == "cuda" and not sm90.supports(*inputs(1, 1, 1, 128, 128, 64, torch.bfloat16), False,
                                                      (8192, 8192, 64, 1))


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper forward)")
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,causal,heads_inner,dtype,scale", [
    (2, 4, 4, 256, 256, 64, False, False, torch.bfloat16, None),  # two key tiles, slots reused at D 128
    (1, 8, 2, 1000, 1000, 128, True, True, torch.float16, None),  # GQA, transposed, ragged, many tiles
    (2, 4, 1, 300, 777, 128, True, True, torch.bfloat16, -0.3),  # bottom-right causal, negative scale
    (1, 2, 2, 100, 100, 64, True, False, torch.float16, None),  # the second warpgroup's rows past Sq
    (3, 6, 3, 129, 200, 128, False, False, torch.bfloat16, 0.0),  # a ragged key tail; uniform weights
    (1, 2, 2, 65, 4097, 64, False, True, torch.float16, None),  # Sq just over decode's, 33 key tiles
    (2, 8, 2, 333, 517, 128, False, True, torch.bfloat16, None),  # the unmasked D 128 backward: GQA, ragged
    (3, 4, 2, 200, 333, 64, False, True, torch.bfloat16, None),  # D 64 unmasked: 192-row tiles, the second ragged
    # persistent, and two of the second tile's three consumers wholly past Sq; a negative scale
    (40, 8, 2, 200, 200, 64, False, True, torch.bfloat16, -0.3),
    # persistent grids, each program taking many work tiles: separate O buffers (D 64) and O through Q (D 128);
    # fewer key tiles than ring slots, so a tile's ring positions start mid-ring
    (40, 8, 2, 520, 520, 64, False, True, torch.bfloat16, None),
    (24, 8, 8, 1000, 1000, 128, False, False, torch.float16, None),
    (300, 4, 4, 130, 130, 128, False, True, torch.bfloat16, None),
    (30, 8, 4, 700, 700, 128, True, True, torch.bfloat16, None),  # causal: tiles of every weight, taken as freed
    # D 64, each program taking many work tiles, so each Q tile is freed after its last S and reloaded: causal
    # (tiles of one to five key tiles, the first with none unmasked); one key tile a work tile (both loops of
    # the consumer empty); every key tile unmasked
    (24, 8, 2, 520, 520, 64, True, True, torch.bfloat16, None),
    (64, 8, 2, 200, 128, 64, False, True, torch.bfloat16, None),
    (40, 8, 2, 256, 256, 64, False, True, torch.bfloat16, None),
    # D 256 (64-key tiles, O through Q; the backward is the tl.* one): ragged, GQA, bottom-right causal, persistent
    (2, 4, 2, 300, 333, 256, True, True, torch.bfloat16, None),
    (1, 2, 2, 200, 1000, 256, False, False, torch.float16, -0.3),
    (40, 4, 4, 130, 130, 256, False, True, torch.bfloat16, None),
])
def test_hopper_forward_against_float64(b, hq, hkv, sq, skv, d, causal, heads_inner, dtype, scale):
    q, k, v = inputs(b, hq, hkv, sq, skv, d, dtype, heads_inner=heads_inner)
    assert not sm90.supports(q, k, v, causal, layout.strides_like(q))  # the case reaches the Gluon kernel
    check_against_reference(q, k, v, causal, 1 / math.sqrt(d) if scale is None else scale)
    torch.cuda.synchronize()
    # every launch's last program has set its stream's work-tile counter back for the next launch
    assert all(not counter.any() for counter in sm90._TILE_COUNTERS.values())
    backward = next(p for key, p in plans.bwd_plans.items() if key[:2] == (q.shape, q.stride()))
    # and its backward too, at the head dims the Hopper backward takes
    assert (backward.hopper is not None) == (d in sm90.BWD_HEAD_DIMS)


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper forward)")
def test_hopper_forward_relaunches_over_other_tensors():
    """One plan, launched directly after its first call, over tensors at other addresses and over the
    first tensors again with new contents: each result is the current inputs' (the encoded TMA
    descriptors are kept per base address, launch.py)."""
    first = inputs(1, 4, 2, 384, 384, 128, torch.bfloat16, seed=1, heads_inner=True)
    second = inputs(1, 4, 2, 384, 384, 128, torch.bfloat16, seed=2, heads_inner=True)
    for q, k, v in (first, second, first, second):
        check_against_reference(q, k, v, True, 0.1)
        for t in (q, k, v):
            t.mul_(-1)
    launch = next(p.hopper.launch for p in plans.fwd_plans.values() if p.hopper is not None and p.hopper.args[3] == 384)
    compiled = next(iter(launch.compiled.values()))
    if launch_mod.TRITON_RELEASE == (3, 6):  # the release whose launcher the cached-descriptor path was read from
        assert compiled.entry is not None and all(len(m) >= 2 for m in compiled.tensor_maps[:3])


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper forward)")
def test_hopper_forward_on_two_streams_at_once():
    """Persistent launches running at the same time on two streams each count their own work tiles
    (one counter per stream): each result is the one the same launch gives alone."""
    cases = [inputs(24, 8, 8, 600, 600, 64, torch.bfloat16, seed=seed) for seed in (1, 2)]
    alone = [attn.attention_fwd(q, k, v, causal=True, scale=0.125)[0] for q, k, v in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()
    together = []
    for _ in range(3):
        for (q, k, v), stream in zip(cases, streams):
            with torch.cuda.stream(stream):
                together.append(attn.attention_fwd(q, k, v, causal=True, scale=0.125)[0])
    torch.cuda.synchronize()
    assert all(torch.equal(out, alone[i % 2]) for i, out in enumerate(together))


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper forward)")
def test_hopper_forward_in_cuda_graphs_replayed_in_any_order():
    """Each capture zero-fills a work-tile counter of its own: two graphs captured on one stream give
    the eager results replayed in either order, the second before the first has ever run."""
    cases = [inputs(24, 8, 8, 600, 600, 64, torch.bfloat16, seed=seed) for seed in (3, 4)]
    eager = [attn.attention_fwd(q, k, v, causal=True, scale=0.125)[0] for q, k, v in cases]
    graphs, outs = [], []
    for q, k, v in cases:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(attn.attention_fwd(q, k, v, causal=True, scale=0.125)[0])
        graphs.append(graph)
    for order in ((1, 0), (0, 1, 1)):
        for i in order:
            outs[i].zero_()
            graphs[i].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[i], eager[i])


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper forward)")
def test_hopper_forward_under_compile_reduce_overhead():
    """torch.compile's CUDA graphs (cudagraph trees, which check that their memory pool holds only
    tensors they track) around a call that reaches the persistent forward."""
    q, k, v = inputs(24, 8, 8, 600, 600, 64, torch.bfloat16, seed=5)
    compiled = torch.compile(lambda q, k, v: portable_ops.attention(q, k, v, causal=True) * 2, mode="reduce-overhead")
    want = portable_ops.attention(q, k, v, causal=True) * 2
    for _ in range(4):
        got = compiled(q, k, v)
        assert torch.equal(got, want)


def test_hopper_forward_grid_is_persistent_only_for_short_rows(monkeypatch):
    """One program per SM where rows read at most 8192 x 128 keys x head dim, one per tile past that;
    a tile is 64 rows for each consumer warpgroup (three at D 64 unmasked, else two)."""
    monkeypatch.setattr(sm90, "_multiprocessors", lambda device: 132)

    def grid(b, h, s, d, causal=True):
        q = torch.empty(b, h, s, d, device="meta")
        return sm90.programs(q, q, causal)

    assert grid(16, 16, 1024, 128) == 132
    assert grid(1, 16, 16384, 64) == 132 and grid(1, 16, 16384, 128) == 16 * 128
    assert grid(1, 16, 16385, 64) == 16 * 129
    assert grid(1, 2, 300, 64) == 2 * 3  # fewer tiles than SMs: one program each
    for release, consumers in (((3, 6), 3), ((3, 9), 2)):  # three consumers only where they were timed
        monkeypatch.setattr(sm90, "TRITON_RELEASE", release)
        assert sm90.config(64, False).consumers == consumers and sm90.config(64, True).consumers == 2
        assert grid(1, 16, 16385, 64, False) == 16 * -(-16385 // (64 * consumers))
        assert grid(1, 2, 300, 64, False) == 2 * -(-300 // (64 * consumers))


def test_hopper_backward_bands_fill_the_gpu_about_once_and_divide_the_pairs():
    """Unmasked: one (batch, KV head) pair a band (every program has the same work). Causal: the divisor
    of the pairs whose programs come nearest one wave, within half to twice it, else one pair."""
    assert sm90.band(32, 64, False, 132) == 1
    # 16k-token batches (the timed ones): 16, 8, 4, 2, 1, 1 pairs at 1k-32k keys, 16 or 64 pairs in all
    for pairs in (16, 64):
        assert [sm90.band(s // 128, pairs, True, 132) for s in (1024, 2048, 4096, 8192, 16384, 32768)] == \
            [16, 8, 4, 2, 1, 1]
    assert sm90.band(16, 11, True, 132) == 11  # 1.3 waves: the nearest divisor within twice one
    assert sm90.band(8, 61, True, 132) == 1  # 61 pairs (3.7 waves) or 1: neither within, the old order
    assert sm90.band(32, 36, True, 132) == 4 and sm90.band(32, 13, True, 132) == 1
    assert sm90.band(4, 2, True, 132) == 2 and sm90.band(1, 1, True, 132) == 1  # under half a wave: one band
    for blocks, pairs in ((1, 1), (5, 12), (64, 100), (3, 1000), (512, 7)):
        c = sm90.band(blocks, pairs, True, 132)
        assert pairs % c == 0 and (c == 1 or c * blocks <= 2 * 132)


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU and a Triton with Gluon (the Hopper backward)")
@pytest.mark.parametrize("band", [1, 3, 5, 100])
def test_hopper_backward_in_bands_that_do_not_divide_the_pairs(band, monkeypatch):
    """The kernel takes any band: the last one short (3 or 5 of 8 pairs), or one wider than every pair."""
    monkeypatch.setattr(sm90, "band", lambda *args, **kwargs: band)
    monkeypatch.setattr(plans, "bwd_plans", {})  # plans with this band stay in the test
    q, k, v = inputs(2, 8, 4, 300, 700, 128, torch.bfloat16, heads_inner=True)
    check_against_reference(q, k, v, True, 1 / math.sqrt(128))
    plan = next(p for key, p in plans.bwd_plans.items() if key[:2] == (q.shape, q.stride()))
    assert plan.hopper is not None and plan.hopper.args[-1] == band


def test_hopper_forward_declines_with_reasons():
    q, k, v = inputs(1, 2, 2, 128, 128, 64, torch.bfloat16)
    stride = layout.strides_like(q)
    reasons = " | ".join(sm90.supports(q.float(), k.float(), v.float(), False, stride) +
                         sm90.supports(q[..., :16], k[..., :16], v[..., :16], True, stride) +
                         # rows 136 bytes apart: not a multiple of 16
                         sm90.supports(torch.zeros(1, 2, 128, 68, dtype=q.dtype, device=DEVICE)[..., :64], k, v, False,
                                       stride) +
                         sm90.supports(q, k[:, :1].expand(1, 2, 128, 64), v, False, stride) +
                         sm90.supports(q, k[:, :, :64], v[:, :, :64], True, stride))
    if sm90.gluon is None:
        assert reasons == "this Triton has no Gluon | " * 4 + "this Triton has no Gluon"
        return
    for reason in ("only float16/bfloat16", "head_dim 16 is not one of (64, 128, 256)", "k is broadcast",
                   "causal with Sq > Skv", "q's strides or base are not 16-byte aligned"):
        assert reason in reasons, reasons
    if DEVICE.type == "cpu":
        assert "not an sm_90 GPU" in reasons
    for causal in (False, True):  # every mask the forward takes at D 64, the backward takes too
        assert not any("faster" in r for r in sm90.supports_backward(q, k, v, q, causal, (stride,) * 3))
    wide = inputs(1, 2, 2, 128, 128, 256, torch.bfloat16)  # the forward's alone
    assert not any("head_dim" in r for r in sm90.supports(*wide, True, layout.strides_like(wide[0])))
    assert any("head_dim 256: the Hopper backward takes (64, 128)" in r
               for r in sm90.supports_backward(*wide, wide[0], True, (layout.strides_like(wide[0]),) * 3))
    backward = " | ".join(sm90.supports_backward(q, k, v, q.float(), True, (stride,) * 3) +
                          sm90.supports_backward(q, k, v, q[:, :1].expand(q.shape), True, (stride,) * 3))
    for reason in ("dout has dtype torch.float32", "dout is broadcast"):
        assert reason in backward, backward
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in " ".join(sm90.supports_backward(q, k, v, q, True, (stride,) * 3))
    finally:
        torch.use_deterministic_algorithms(was)


def test_backward_plans_tell_aligned_bases_apart():
    """TMA needs 16-byte aligned bases and a stride check can't see them: a dO at an odd address,
    with the shape and strides of an earlier aligned one, gets its own plan (on Hopper, the tl.*
    kernels) instead of the aligned call's."""
    q, k, v = inputs(1, 2, 2, 96, 96, 64, torch.float16)
    out, lse = attn.attention_fwd(q, k, v, causal=True, scale=0.125)
    store = torch.randn(out.numel() + 1, generator=torch.Generator().manual_seed(3)).to(q.dtype).to(DEVICE)
    aligned, odd = store[:-1].view(out.shape), store[1:].view(out.shape)
    plans.bwd_plans.clear()
    first = attn.attention_bwd(q, k, v, out, lse, aligned, causal=True, scale=0.125)
    second = attn.attention_bwd(q, k, v, out, lse, odd, causal=True, scale=0.125)
    assert sorted(key[-1] for key in plans.bwd_plans) == [False, True]
    assert not torch.equal(first[0], second[0])


def test_batch_times_heads_over_the_grid_limit_folds_over_the_grids_third_dim(monkeypatch):
    """CUDA caps a grid's second dimension (batch x heads here) at 65535: a larger call's pairs fold over
    the third, into outputs in the layout the whole call would have had (tests/test_triton_grid_limits.py
    takes every kernel past it)."""
    monkeypatch.setattr(plans, "MAX_GRID_Y", 8)
    monkeypatch.setattr(plans, "fwd_plans", {})
    monkeypatch.setattr(plans, "bwd_plans", {})
    q, k, v = inputs(3, 4, 2, 20, 20, 16, heads_inner=True, seed=5)
    out, _, grads = check_against_reference(q, k, v, True, 0.25)
    assert out.stride() == layout.strides_like(q) and grads[1].stride() == layout.strides_like(k)
    (plan,) = plans.fwd_plans.values()
    assert plan.fwd.grid[1:] == (6, 2) and plan.fwd.options["FOLD"]
    monkeypatch.setattr(plans, "MAX_GRID_Y", 3)
    assert "12 batch x heads: a launch takes at most 9" in " ".join(attn.attention_supports({"q": q, "k": k, "v": v}))
