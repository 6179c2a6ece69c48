"""Decoding from a paged KV cache and appending to it (``paged_attention``, ``paged_kv_append``), each compared
with dense causal attention from its definition on the cache gathered position by position, in float64.
Bad input is refused before anything runs, naming the argument, and a refused append leaves the caches
bit-identical. torch.compile and opcheck: tests/test_compile.py."""

import pytest
import torch
from attention_definitions import DECLINING_PAGED, F64, TAKING, TAKING_PAGED, definition, gathered, packed, paged_cache
from conftest import assert_bit_identical, snapshot

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance.runner import RELEASED, default_device, forced_strict


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("options", [dict(), dict(window=(5, None)), dict(softcap=5.0, scale=2.0),
                                     dict(window=(0, 3), softcap=30.0)], ids=["plain", "window", "softcap", "both"])
def test_paged_attention_is_dense_causal_attention_on_the_gathered_cache(page_size, sq, options):
    lens = [sq, 23, 40, 7]
    k_cache, v_cache, table, seqlens = paged_cache(lens, page_size, hkv=2)
    q = torch.randn(len(lens), sq, 4, 8, dtype=F64)
    out = portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens, **options)
    assert out.shape == q.shape and out.is_contiguous()
    for b, length in enumerate(lens):
        keys = [gathered(c, table, b, length, page_size) for c in (k_cache, v_cache)]
        want = definition(q[b].transpose(0, 1)[None], *keys, causal=True, **options)
        torch.testing.assert_close(out[b], want[0].transpose(0, 1), atol=1e-12, rtol=1e-12)


def test_paged_attention_with_an_empty_sequence_and_more_queries_than_tokens():
    k_cache, v_cache, table, _ = paged_cache([6, 2], 4)
    q = torch.randn(2, 3, 4, 8, dtype=F64)
    out = portable_ops.paged_attention(q, k_cache, v_cache, table, torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no token: no key
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))  # query 0 sits at position -1
    assert out[1, 1:].abs().sum() > 0


def test_pages_wholly_before_the_window_are_never_read():
    """A cache may release the pages a sliding window has left behind: their table entries may be anything.
    Here a page number far past the pool, which any read would fail on (-1 would not: it indexes the last
    page)."""
    k_cache, v_cache, table, seqlens = paged_cache([40], 4)
    q = torch.randn(1, 2, 4, 8, dtype=F64)
    want = portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens, window=(6, None))
    table[0, :8] = RELEASED  # positions 0-31; the window starts at 40 - 2 - 6 = 32
    torch.testing.assert_close(portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens, window=(6, None)),
                               want)
    with pytest.raises(ValueError, match=rf"block_table\[0, 7\] is {RELEASED}, not a page of the cache .* positions "
                                         rf"31 to 31"):
        portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens, window=(7, None))


def test_append_then_attend_is_a_decode_step():
    lens = [5, 16, 30]
    k_cache, v_cache, table, seqlens = paged_cache([n + 2 for n in lens], 4, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    k_new, v_new = (torch.randn(3, 2, 2, 8, generator=g) for _ in range(2))
    before = snapshot([k_cache, v_cache])
    with torch.no_grad():
        portable_ops.paged_kv_append(k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), k_new, v_new)
    expected = [c.clone() for c in before]
    for b, n in enumerate(lens):
        for t in range(2):
            page, offset = int(table[b, (n + t) // 4]), (n + t) % 4
            expected[0][page, offset], expected[1][page, offset] = k_new[b, t], v_new[b, t]
    assert_bit_identical(expected, [k_cache, v_cache])  # those slots written, every other bit as it was
    q = torch.randn(3, 2, 4, 8, generator=g)
    out = portable_ops.paged_attention(q, k_cache, v_cache, table, seqlens)
    for b, n in enumerate(lens):
        keys = [gathered(c, table, b, n + 2, 4) for c in (k_cache, v_cache)]
        torch.testing.assert_close(out[b], portable_ops.attention(q[b].transpose(0, 1)[None], *keys,
                                                                  causal=True)[0].transpose(0, 1))


def bad_append():
    """name -> (a function of the good arguments (a list) making them bad, error, message)."""
    def changed(i, value):
        return lambda args: args[:i] + [value(args)] + args[i + 1:]

    def table_entry(value, b=1, j=1):
        def bad(args):
            table = args[2].clone()
            table[b, j] = value
            return table
        return bad

    return {
        "a page past the pool": (changed(2, table_entry(99)), ValueError,
                                 r"block_table\[1, 1\] is 99, not a page of the cache \(it has \d+\); sequence 1 "
                                 r"writes positions 5 to 6 there"),
        "a released page": (changed(2, table_entry(-1)), ValueError, r"block_table\[1, 1\] is -1, not a page"),
        "past the table": (changed(3, lambda a: torch.tensor([5, 11], dtype=torch.int32)), ValueError,
                           r"cache_seqlens\[1\] \+ 2 new tokens = 13 exceeds the 12 positions block_table holds "
                           r"\(3 pages of 4\)"),
        "negative length": (changed(3, lambda a: torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
                            r"cache_seqlens\[0\] is -1; lengths must be >= 0"),
        "two sequences, one slot": (lambda a: a[:2] + [torch.tensor([[0, 1, 2], [3, 1, 5]], dtype=torch.int32),
                                                       torch.tensor([3, 4], dtype=torch.int32)] + a[4:],
                                    ValueError, "token 1 of sequence 0 and token 0 of sequence 1 would both be written "
                                                "to page 1, slot 0"),
        "new k/v in another dtype": (lambda a: a[:4] + [a[4].float(), a[5].float()], TypeError,
                                     "k_cache has dtype torch.float64 but k_new has torch.float32; the cache keeps"),
        "v_new in another dtype": (changed(5, lambda a: a[5].float()), TypeError,
                                   "v_new is torch.float32 on cpu but k_new is torch.float64"),
        "v_new of another shape": (changed(5, lambda a: a[5][:, :1]), ValueError, "v_new has shape"),
        "k_new of other heads": (changed(4, lambda a: a[4][:, :, :1]), ValueError,
                                 r"k_new has shape \(2, 2, 1, 8\)|v_new has shape"),
        "caches differ": (changed(1, lambda a: a[1][:, :2]), ValueError, "k_cache has shape .* but v_cache has"),
        "an int64 table": (changed(2, lambda a: a[2].long()), TypeError, "block_table has dtype torch.int64; expected "
                                                                         r"torch.int32 \[batch, max_pages\]"),
        "a 1-d table": (changed(2, lambda a: a[2][0]), ValueError, "block_table must have 2 dimensions"),
        "lengths of another batch": (changed(3, lambda a: a[3][:1]), ValueError,
                                     "cache_seqlens has batch 1 but q has batch 2"),
        "lengths elsewhere": (changed(3, lambda a: a[3].to("meta")), ValueError, "cache_seqlens is on meta"),
        "k_new needing grad": (changed(4, lambda a: a[4].clone().requires_grad_()), RuntimeError,
                               r"paged_kv_append is not differentiable \(inference only\), but k_new requires grad"),
        "page size 0": (changed(0, lambda a: a[0][:, :0]), ValueError, "k_cache has shape|page_size 0"),
    }


BAD_APPEND = bad_append()


@pytest.mark.parametrize("name", BAD_APPEND)
def test_a_refused_append_leaves_the_caches_bit_identical(name):
    k_cache, v_cache, table, _ = paged_cache([6, 6], 4, spare=4)
    g = torch.Generator().manual_seed(1)
    k_new, v_new = (torch.randn(2, 2, 2, 8, generator=g, dtype=F64) for _ in range(2))
    args = [k_cache, v_cache, table, torch.tensor([3, 5], dtype=torch.int32), k_new, v_new]
    make, error, message = BAD_APPEND[name]
    bad = make(args)
    before = snapshot([k_cache, v_cache])
    with pytest.raises(error, match=message):
        portable_ops.paged_kv_append(*bad)
    assert_bit_identical(before, [k_cache, v_cache])
    portable_ops.paged_kv_append(*args)  # the good call goes through
    assert not torch.equal(before[0], k_cache)


BAD_PAGED = {
    "q needing grad": (lambda a: {**a, "q": a["q"].clone().requires_grad_()}, RuntimeError,
                       r"paged_attention is not differentiable \(inference only\), but q requires grad: call it under "
                       r"torch.no_grad\(\)"),
    "q of 3 dims": (lambda a: {**a, "q": a["q"][0]}, ValueError,
                    r"q must have 4 dimensions \[batch, seq, heads, head_dim\]"),
    "cache in another dtype": (lambda a: {**a, "k_cache": a["k_cache"].float(), "v_cache": a["v_cache"].float()},
                               TypeError, "k_cache has dtype torch.float32 but q has torch.float64"),
    "heads": (lambda a: {**a, "q": a["q"][:, :, :3]}, ValueError, "q has 3 heads, k_cache and v_cache have 2"),
    "head dims": (lambda a: {**a, "q": a["q"][..., :4]}, ValueError, "k_cache has head_dim 8 but q has head_dim 4"),
    "a page past the pool": (lambda a: {**a, "block_table": a["block_table"] + 100}, ValueError,
                             r"block_table\[0, 0\] is 1\d\d, not a page of the cache"),
    "longer than the table": (lambda a: {**a, "cache_seqlens": torch.tensor([6, 17], dtype=torch.int32)},
                              ValueError, r"cache_seqlens\[1\] is 17, which exceeds the 16 positions block_table "
                                          r"holds \(4 pages of 4\)"),
    "a released page": (lambda a: {**a, "cache_seqlens": torch.tensor([6, 13], dtype=torch.int32)}, ValueError,
                        r"block_table\[1, 3\] is -1, not a page of the cache \(it has \d+\); sequence 1 reads "
                        r"positions 12 to 12 there"),
    "bad window": (lambda a: {**a, "window": (-1, None)}, ValueError, "use None for an unbounded side"),
    "bad softcap": (lambda a: {**a, "softcap": -3.0}, ValueError, "softcap must be >= 0.0"),
}


@pytest.mark.parametrize("name", BAD_PAGED)
def test_bad_paged_attention_input_is_refused_by_name(name, fake_backend):
    calls = []
    stand_in = fake_backend("triton", ops=("paged_attention",))
    stand_in.ops["paged_attention"] = dispatch.OpImpl(run=lambda **call: calls.append(call))
    k_cache, v_cache, table, seqlens = paged_cache([6, 9], 4)
    args = dict(q=torch.randn(2, 1, 4, 8, dtype=F64), k_cache=k_cache, v_cache=v_cache, block_table=table,
                cache_seqlens=seqlens)
    make, error, message = BAD_PAGED[name]
    with portable_ops.use_backend("triton"), pytest.raises(error, match=message):
        portable_ops.paged_attention(**make(args))
    assert not calls


def test_a_decode_loop_reads_the_tables_once_per_step(reads):
    """Per step: append (one read of the tables), then attention in every layer (one more read: the check
    differs), then the lengths grow in place, which is a new version."""
    k_cache, v_cache, table, seqlens = paged_cache([12, 12], 4)
    seqlens -= 2
    with torch.no_grad():
        for _step in range(2):
            for _layer in range(3):
                new = torch.randn(2, 1, 2, 8, dtype=F64)
                portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens, new, new)
            seqlens += 1
            for _layer in range(3):
                portable_ops.paged_attention(torch.randn(2, 1, 4, 8, dtype=F64), k_cache, v_cache, table, seqlens)
    assert len(reads) == 2 * 2 * 2  # steps x (append, attention) x (table, lengths)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] \+ 5 new tokens = 17 exceeds the 16 positions"):
        portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens, *(torch.zeros(2, 5, 2, 8, dtype=F64),) * 2)


@pytest.mark.parametrize("backend", [b for b in TAKING_PAGED if b in TAKING])
def test_kernel_backends_take_varlen_and_paged_ops(backend, monkeypatch):
    """explain and strict mode see packed and paged calls run on the backend, with the definition's values."""
    monkeypatch.setattr(dispatch, "_warned", set())
    device = default_device(backend)
    q, k, v, cu_q, cu_k = (t.to(device) for t in packed((3, 4), (3, 4), dtype=torch.float32))
    k_cache, v_cache, table, seqlens = (t.to(device) for t in paged_cache([6, 9], 4, dtype=torch.float32))
    pq, new = torch.randn(2, 1, 4, 8, device=device), torch.randn(2, 1, 2, 8, device=device)
    with portable_ops.use_backend(backend):
        for op, args in (("attention_varlen", (q, k, v, cu_q, cu_k, 4, 4)),
                         ("paged_attention", (pq, k_cache, v_cache, table, seqlens)),
                         ("paged_kv_append", (k_cache, v_cache, table, seqlens - 1, new, new))):
            assert portable_ops.explain(op, *args).backend == backend, op
    with forced_strict(backend):
        out = portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 4, causal=True)
        paged_out = portable_ops.paged_attention(pq, k_cache, v_cache, table, seqlens)
    with portable_ops.use_backend("reference"):
        torch.testing.assert_close(out, portable_ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 4, causal=True))
        torch.testing.assert_close(paged_out, portable_ops.paged_attention(pq, k_cache, v_cache, table, seqlens))


@pytest.mark.parametrize("backend", DECLINING_PAGED)
def test_other_backends_decline_paged_ops_with_the_reason(backend):
    k_cache, v_cache, table, seqlens = paged_cache([6, 9], 4, dtype=torch.float32)
    q, new = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8)
    with portable_ops.use_backend(backend):
        for op, args, feature in (
                ("paged_attention", (q, k_cache, v_cache, table, seqlens), "attention over a paged KV cache"),
                ("paged_kv_append", (k_cache, v_cache, table, seqlens - 1, new, new), "appending to a paged KV cache")):
            choice = portable_ops.explain(op, *args)
            assert choice.backend == "reference"
            assert choice.rejected[backend] == [f"{feature} ({op}): not in the {backend} kernels yet"]
    before = snapshot([k_cache, v_cache])
    with forced_strict(backend), pytest.raises(portable_ops.BackendUnavailableError, match="appending to a paged"):
        portable_ops.paged_kv_append(k_cache, v_cache, table, seqlens - 1, new, new)
    assert_bit_identical(before, [k_cache, v_cache])
