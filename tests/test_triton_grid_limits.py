"""CUDA caps a grid's second and third dims at 65535 programs; the tl.* attention kernels put (sequence, head)
pairs in the second. Past the cap the pairs fold over the third (``attention_plans.fold``), one launch still:
dense, packed and paged attention, forward and backward, and the paged cache's append run past it instead of
falling back, and only what even the fold can't hold is refused.

With the cap lowered to 4 (the interpreter then runs a few programs a launch), every case is checked at the
cap + 1 and twice the cap + 1 against the float64 reference; on a GPU, the reported shapes at the real cap."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from portable_ops import dispatch
from portable_ops.conformance import GRADIENT_FACTOR, tolerance

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

attn = importlib.import_module("portable_ops.backends.triton.attention")
plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
ref_attn = importlib.import_module("portable_ops.definitions.attention")
ref_varlen = importlib.import_module("portable_ops.definitions.attention_varlen")
ref_paged = importlib.import_module("portable_ops.definitions.paged")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LIMIT = 4  # the cap the CPU tests lower CUDA's to
NEEDS_CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="the real grid limit needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Plan caches of this test alone: a plan built under a lowered cap must not serve another test."""
    monkeypatch.setattr(plans, "fwd_plans", {})
    monkeypatch.setattr(plans, "bwd_plans", {})


@pytest.fixture
def small_grids(monkeypatch):
    monkeypatch.setattr(plans, "MAX_GRID_Y", LIMIT)


def _randn(*shape, dtype=torch.float32, seed=0):
    """Drawn where the test runs: the GPU's cases hold hundreds of millions of elements."""
    return torch.randn(*shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE).to(dtype)


def _close(got, want, dtype, factor=1.0):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), **tolerance("attention", dtype).scaled(factor)
                               ._asdict())


def _launches() -> list:
    """Every tl.* attention launch the plans built: (grid, whether it folds)."""
    found = []
    for plan in plans.fwd_plans.values():
        if plan.hopper is None:
            found += [(plan.fwd.grid, plan.fwd.options["FOLD"]), (plan.combine.grid, False)]
    for plan in plans.bwd_plans.values():
        found.append((plan.delta.grid, plan.delta.options["FOLD"]))
        if plan.hopper is None:
            found += [(launch.grid, launch.options["FOLD"]) for launch in (plan.dkdv, plan.dq)]
    return found


def _assert_folded_within(limit):
    """Every grid within ``limit`` in its second and third dims, and at least one folded (past it unfolded)."""
    launches = _launches()
    assert launches and all(grid[1] <= limit and grid[2] <= limit for grid, _ in launches), launches
    assert any(fold for _, fold in launches), launches


def _dense_check(q, k, v, dtype, **options):
    """(out, lse, dout, grads): the triton backend's forward, and its backward of a random ``dout``."""
    out, lse = attn.attention_fwd(q, k, v, **options)
    dout = _randn(*out.shape, dtype=dtype, seed=99)
    grads = attn.attention_bwd(q, k, v, out, lse, dout, **options)
    return out, lse, dout, grads


def _against_reference(q, k, v, out, lse, dout, grads, **options):
    """A call's results against the float64 reference's; ``q``, ``k``, ``v`` (and the rest) may be a sample of
    its sequences."""
    f64 = [t.double().cpu() for t in (q, k, v)]
    want_out, want_lse = ref_attn.attention_fwd(*f64, **options)
    _close(out, want_out, q.dtype)
    _close(lse, want_lse, q.dtype)
    want = ref_attn.attention_bwd(*f64, want_out, want_lse, dout.double().cpu(), **options)
    for got, expected in zip(grads, want):
        _close(got, expected, q.dtype, GRADIENT_FACTOR)


# ----------------------------------------------------------------------------- dense

@pytest.mark.parametrize("b,hq,hkv,sq,skv", [
    (5, 1, 1, 20, 20),  # the cap + 1 pairs everywhere
    (9, 1, 1, 17, 33),  # twice the cap + 1, bottom-right causal
    (1, 9, 3, 20, 20),  # heads alone past the cap: the forward and dQ fold, dK/dV's three KV heads don't
    (5, 2, 1, 1, 40),  # decode whose GQA group shares a program: five packed pairs, keys not split
    (3, 3, 3, 2, 70),  # nine pairs of a decode that would split its keys under the cap
])
def test_dense_attention_past_the_grid_limit(small_grids, b, hq, hkv, sq, skv):
    q, k, v = _randn(b, hq, sq, 16, seed=1), _randn(b, hkv, skv, 16, seed=2), _randn(b, hkv, skv, 16, seed=3)
    options = dict(causal=True, scale=0.3, window=(40, None))
    assert attn.attention_supports({"q": q, "k": k, "v": v}) == []
    _against_reference(q, k, v, *_dense_check(q, k, v, q.dtype, **options), **options)
    _assert_folded_within(LIMIT)
    assert all(plan.splits == 1 for plan in plans.fwd_plans.values())


# ----------------------------------------------------------------------------- packed sequences

def _offsets(lens):
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEVICE)


def _varlen_check(lens_q, lens_k, hq, hkv, d=16, dtype=torch.float32, sample=None, **options):
    """Forward and backward of packed sequences against the reference on the sequences ``sample`` names
    (default: all)."""
    q = _randn(sum(lens_q), hq, d, dtype=dtype, seed=4)
    k, v = _randn(sum(lens_k), hkv, d, dtype=dtype, seed=5), _randn(sum(lens_k), hkv, d, dtype=dtype, seed=6)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    assert attn.attention_varlen_supports({"q": q, "cu_seqlens_q": cu_q}) == []
    out, lse = attn.attention_varlen_fwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    dout = _randn(*out.shape, dtype=dtype, seed=7)
    grads = attn.attention_varlen_bwd(q, k, v, out, lse, dout, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(lens_q)) if sample is None else sample:
        rows_q, rows_k = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        dense = [t.transpose(0, 1)[None] for t in (q[rows_q], k[rows_k], v[rows_k], out[rows_q], dout[rows_q])]
        dq, dk, dv = (g.transpose(0, 1)[None] for g in (grads[0][rows_q], grads[1][rows_k], grads[2][rows_k]))
        _against_reference(*dense[:3], dense[3], lse[None, :, rows_q], dense[4], (dq, dk, dv), **options)


@pytest.mark.parametrize("lens_q,lens_k,hq,hkv", [
    ((3, 0, 7, 5, 2), (4, 2, 7, 5, 0), 1, 1),  # the cap + 1 sequences, one without queries, one without keys
    ((2, 9, 1, 4, 0, 6, 3, 5, 8), (2, 9, 1, 4, 3, 6, 3, 5, 8), 1, 1),  # twice the cap + 1
    ((6, 11, 4), (6, 11, 4), 3, 1),  # nine pairs forward and for dQ, three for dK/dV
    ((13,), (13,), 5, 5),  # one sequence of five heads: delta's grid, heads alone, folds too
])
def test_packed_sequences_past_the_grid_limit(small_grids, lens_q, lens_k, hq, hkv):
    _varlen_check(lens_q, lens_k, hq, hkv, causal=True, scale=0.25)
    _assert_folded_within(LIMIT)


# ----------------------------------------------------------------------------- paged cache

def _paged_cache(lens, page, hkv, d, dtype, seed=8):
    """k/v caches with the pages of each sequence drawn from a shuffled pool, and the block table."""
    per_seq = max(-(-n // page) for n in lens)
    pool = torch.randperm(len(lens) * per_seq, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = pool.view(len(lens), per_seq).to(DEVICE)
    caches = [_randn(len(lens) * per_seq, page, hkv, d, dtype=dtype, seed=seed + i) for i in (1, 2)]
    return *caches, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _paged_against_reference(q, k_cache, v_cache, table, seqlens, out, sample, **options):
    """The sampled sequences of ``out`` against the reference, over a cache of their pages alone."""
    index = torch.tensor(sample, device=DEVICE)
    rows = table[index]
    sub = [c[rows.flatten().long()].double().cpu() for c in (k_cache, v_cache)]
    sub_table = torch.arange(rows.numel(), dtype=torch.int32).view(rows.shape)
    want, _ = ref_paged.paged_attention(q[index].double().cpu(), *sub, sub_table, seqlens[index].cpu(), **options)
    _close(out[index], want, q.dtype)


@pytest.mark.parametrize("b,sq,hq,hkv", [
    (5, 1, 4, 1),  # decode under GQA: five packed pairs, though batch x query heads is twenty
    (9, 1, 2, 1),  # twice the cap + 1, packed
    (5, 2, 1, 1),  # the cap + 1 without GQA
    (3, 12, 3, 1),  # a group too tall to share a program: nine pairs
])
def test_paged_decode_past_the_grid_limit(small_grids, b, sq, hq, hkv):
    lens = [(7 * i + 5) % 23 + sq for i in range(b)]
    k_cache, v_cache, table, seqlens = _paged_cache(lens, 4, hkv, 16, torch.float32)
    q = _randn(b, sq, hq, 16, seed=9)
    assert attn.paged_attention_supports({"q": q, "k_cache": k_cache}) == []
    options = dict(scale=0.25, window=(9, None))
    out, _ = attn.paged_attention(q, k_cache, v_cache, table, seqlens, **options)
    _paged_against_reference(q, k_cache, v_cache, table, seqlens, out, range(b), **options)
    _assert_folded_within(LIMIT)


class _Recorded:
    """A kernel that records each launch's grid and launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _append_check(b, sn, hkv, d, page=4):
    lens = [3 * i + 1 for i in range(b)]
    k_cache, v_cache, table, seqlens = _paged_cache([n + sn for n in lens], page, hkv, d, torch.float16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    k_new, v_new = _randn(b, sn, hkv, d, dtype=torch.float16, seed=10), _randn(b, sn, hkv, d, dtype=torch.float16,
                                                                               seed=11)
    assert attn.paged_kv_append_supports({"k_new": k_new, "k_cache": k_cache, "v_cache": v_cache}) == []
    want = [c.clone() for c in (k_cache, v_cache)]
    ref_paged.paged_kv_append(*want, table, seqlens, k_new, v_new)
    attn.paged_kv_append(k_cache, v_cache, table, seqlens, k_new, v_new)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


@pytest.mark.parametrize("hkv", [LIMIT + 1, 2 * LIMIT + 1])
def test_paged_append_of_more_kv_heads_than_the_grid_limit(small_grids, hkv, monkeypatch):
    recorded = _Recorded(attn.append_kernel)
    monkeypatch.setattr(attn, "append_kernel", recorded)
    _append_check(3, 2, hkv, 8)
    (grid,) = recorded.grids
    assert grid[1] <= LIMIT and grid[2] == math.ceil(hkv / LIMIT) and grid[1] * grid[2] >= hkv


# ----------------------------------------------------------------------------- what is refused

def test_only_pairs_past_what_the_fold_holds_are_refused(small_grids):
    most = LIMIT * LIMIT  # the fold's parts, each within the cap too
    q = torch.empty(most, 1, 1, 8)
    assert attn.attention_supports({"q": q}) == []
    (reason,) = attn.attention_supports({"q": torch.empty(most + 1, 1, 1, 8)})
    assert reason.startswith(f"{most + 1} batch x heads: a launch takes at most {most}")
    cu = torch.zeros(most + 2, dtype=torch.int32)
    assert "sequences x heads" in attn.attention_varlen_supports({"q": q, "cu_seqlens_q": cu})[0]
    # paged decode is refused by the pairs its grid takes: a GQA group's heads share a program
    cache = torch.empty(1, 4, 1, 8)
    assert attn.paged_attention_supports({"q": torch.empty(most, 1, 8, 8), "k_cache": cache}) == []
    assert "sequences x KV heads" in attn.paged_attention_supports({"q": torch.empty(most + 1, 1, 8, 8),
                                                                    "k_cache": cache})[0]
    assert "sequences x heads" in attn.paged_attention_supports({"q": torch.empty(most, 3, 8, 8), "k_cache": cache})[0]
    wide = torch.empty(1, 1, most + 1, 8)
    assert "KV heads" in attn.paged_kv_append_supports({"k_new": wide, "k_cache": wide, "v_cache": wide})[0]


def test_the_fold_keeps_the_second_dim_under_the_cap_in_even_parts():
    assert plans.fold(0) == (0, 1) and plans.fold(65535) == (65535, 1)
    assert plans.fold(65536) == (32768, 2) and plans.fold(2049 * 32) == (32784, 2)
    assert plans.fold(3 * 65535 + 1) == (49152, 4)
    assert plans.most_pairs() == 2**31 - 65535  # pairs are numbered in int32


# ----------------------------------------------------------------------------- at the real limit, on a GPU

@NEEDS_CUDA
@pytest.mark.parametrize("b,sq,folds", [
    (520, 1, False),  # 520 x 128 query heads, but the grid takes 520 x 8 packed pairs: never past the cap
    (520, 2, True),  # a group of 2 x 16 rows is too tall to pack in a decode tile: 66560 pairs
    (8193, 1, True),  # 8193 x 8 packed pairs
])
def test_paged_decode_past_the_real_grid_limit(b, sq, folds):
    hq, hkv, d = 128, 8, 128
    lens = [(37 * i) % 61 + sq for i in range(b)]
    k_cache, v_cache, table, seqlens = _paged_cache(lens, 16, hkv, d, torch.bfloat16)
    q = _randn(b, sq, hq, d, dtype=torch.bfloat16, seed=12)
    assert attn.paged_attention_supports({"q": q, "k_cache": k_cache}) == []
    out, _ = attn.paged_attention(q, k_cache, v_cache, table, seqlens, scale=d ** -0.5)
    (plan,) = plans.fwd_plans.values()
    assert plan.fwd.options["FOLD"] == folds and plan.fwd.grid[1] <= plans.MAX_GRID_Y
    _paged_against_reference(q, k_cache, v_cache, table, seqlens, out, [0, 1, b // 2, b - 2, b - 1],
                             scale=d ** -0.5)


@NEEDS_CUDA
def test_packed_sequences_past_the_real_grid_limit():
    sequences = 65536 // 32 + 1  # 2049 x 32 heads: 65568 pairs
    lens = [(13 * i) % 64 + 1 for i in range(sequences)]
    _varlen_check(lens, lens, 32, 8, d=64, dtype=torch.bfloat16, sample=[0, 1, 1024, sequences - 1], causal=True,
                  scale=0.125)
    assert any(fold for _, fold in _launches())


@NEEDS_CUDA
@pytest.mark.parametrize("hkv", [8, 32])  # the Hopper backward takes 2049 x 8 pairs; 2049 x 32 go to the tl.* one
def test_dense_attention_past_the_real_grid_limit(hkv):
    b, hq, s, d = 2049, 32, 128, 64
    q = _randn(b, hq, s, d, dtype=torch.bfloat16, seed=13)
    k, v = _randn(b, hkv, s, d, dtype=torch.bfloat16, seed=14), _randn(b, hkv, s, d, dtype=torch.bfloat16, seed=15)
    options = dict(causal=True, scale=0.125)
    out, lse, dout, grads = _dense_check(q, k, v, q.dtype, **options)
    for i in (0, 1, b // 2, b - 1):
        sample = slice(i, i + 1)
        _against_reference(q[sample], k[sample], v[sample], out[sample], lse[sample], dout[sample],
                           [g[sample] for g in grads], **options)
    assert any(fold for _, fold in _launches())


@NEEDS_CUDA
def test_paged_append_past_the_real_grid_limit():
    _append_check(2, 3, plans.MAX_GRID_Y + 2, 16)
