"""The nki backend's paged KV cache kernels in the emulator, beyond the conformance cases (which run every option
on them): rows that see no key, keys that must never be read, several sections of keys and several groups of KV
heads in one call, and the calls they decline. The indirect DMA they gather and scatter with:
tests/test_nki_rules.py."""

import importlib

import pytest
import torch
from attention_definitions import paged_cache

import portable_ops
from portable_ops.backends.nki import compat, runtime
from portable_ops.conformance.runner import forced_strict

nki_paged = importlib.import_module("portable_ops.backends.nki.paged_attention")  # the package's name is the op's
pytestmark = pytest.mark.skipif(compat.USING_SDK, reason="the emulator's rules and a CPU run of the kernels")


def _nki_and_reference(*args, **options):
    with forced_strict("nki"), torch.no_grad():
        got = portable_ops.paged_attention(*args, return_lse=True, **options)
    with portable_ops.use_backend("reference"):
        want = portable_ops.paged_attention(*args, return_lse=True, **options)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    return got


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.5, -1.0, 2.0, 0.0])])
def test_rows_that_see_no_key_give_zero_and_minus_infinity_or_their_sink(sinks):
    k_cache, v_cache, table, _ = paged_cache([6, 2], 4, dtype=torch.float32)
    q = torch.randn(2, 3, 4, 8)
    out, lse = _nki_and_reference(q, k_cache, v_cache, table, torch.tensor([0, 2], dtype=torch.int32), sinks=sinks)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    no_key = torch.full((4,), float("-inf")) if sinks is None else sinks
    assert torch.equal(lse[0, :, 0], no_key)
    out, lse = _nki_and_reference(q, k_cache, v_cache, table[:, :0], torch.zeros(2, dtype=torch.int32), sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse[1, :, 2], no_key)  # a table of no pages


@pytest.mark.parametrize("page", [1, 2, 4])
def test_keys_no_query_sees_never_reach_the_output(page):
    """Every slot but those the queries see holds NaN: past each length, before the window, the spare pages and
    the table's unused entries (-1). A V row read would reach the output (NaN * 0 is NaN); a K row read with its
    page's others (up to 4 a partition) is masked."""
    lens = [37, 9]
    k_cache, v_cache, table, seqlens = paged_cache(lens, page, dtype=torch.float32)
    seen = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(max(0, n - 2 - 5), n):
            seen[table[b, j // page], j % page] = True
    for cache in (k_cache, v_cache):
        cache[~seen] = float("nan")
    out, _ = _nki_and_reference(torch.randn(2, 2, 4, 8), k_cache, v_cache, table, seqlens, window=(5, None))
    assert out.isfinite().all()


def test_several_sections_of_keys_and_groups_of_kv_heads(monkeypatch):
    """Sections of one block of 512 keys (the accumulator rescaled between them) and 40 query heads per KV head with
    2 new tokens: 80 query rows, one KV head per group of the 128 partitions."""
    monkeypatch.setattr(nki_paged, "SECTION_KEYS", 256)
    k_cache, v_cache, table, seqlens = paged_cache([600, 3], 16, dtype=torch.float32)
    q = torch.randn(2, 2, 80, 8)
    assert len(nki_paged.groups(2, 80, 8, 8, 4)) == 2
    _nki_and_reference(q, k_cache, v_cache, table, seqlens, softcap=20.0, sinks=torch.randn(80))


def test_calls_the_kernel_cannot_take_are_declined_with_the_reason():
    k_cache, v_cache, table, seqlens = paged_cache([6, 9], 4, dtype=torch.float32)
    strided = torch.randn(*k_cache.shape[:2], 4, 8).transpose(1, 2)  # [pages, 4 heads, page, 8] seen transposed
    with portable_ops.use_backend("nki"):
        choice = portable_ops.explain("paged_attention", torch.randn(2, 1, 8, 8), strided, strided, table, seqlens)
        assert "contiguous caches" in " ".join(choice.rejected["nki"])
        wide = torch.randn(2, 3, 2 * 43, 8)  # 3 tokens x 43 query heads per KV head: 129 rows
        choice = portable_ops.explain("paged_attention", wide, k_cache, v_cache, table, seqlens)
        assert choice.rejected["nki"] == ["3 new tokens x 43 query heads per KV head = 129 query rows per KV head; "
                                          "the NKI kernel holds them on its 128 partitions"]
        many = torch.zeros(k_cache.shape[0], 4, 40, 512)  # a token's row: 40 KV heads x 512 float32, 80 KiB
        new = torch.zeros(2, 1, 40, 512)
        choice = portable_ops.explain("paged_kv_append", many, many, table, seqlens - 1, new, new)
        assert choice.rejected["nki"] == ["a token's row of every KV head is 81920 bytes; the NKI kernel moves it "
                                          "through one partition of SBUF, at most 65536"]


def _counted_decode(b, table_pages, page=16, length=40, hq=4, hkv=2, d=8):
    """The kernel's emulator counts (count-only) for ``b`` sequences of ``length`` keys, tables ``table_pages`` wide."""
    from portable_ops.backends.nki import emulator
    meta = dict(dtype=torch.bfloat16, device="meta")
    pool = b * -(-length // page)
    with emulator.count_only(), emulator.count_instructions() as stats:
        nki_paged.paged_attention(torch.zeros(b, 1, hq, d, **meta), torch.zeros(pool, page, hkv, d, **meta),
                                  torch.zeros(pool, page, hkv, d, **meta),
                                  torch.zeros(b, table_pages, dtype=torch.int32, device="meta"),
                                  torch.full((b,), length, dtype=torch.int32, device="meta"), scale=d ** -0.5)
    return stats


def test_the_slot_tables_sbuf_holds_do_not_grow_with_the_block_tables_width():
    """A table as wide as supports takes (2^24 positions: 32768 blocks of 512 keys) must fit SBUF, so the kernel
    holds one section's slots at a time, not the whole table's."""
    narrow, wide = (_counted_decode(1, pages).sbuf_peak_bytes for pages in (256, 1024))
    assert wide == narrow


def test_the_instruction_estimate_bounds_what_a_sequence_issues():
    """The host splits a batch into launches by :func:`sequence_instructions`: it must not undercount (a launch past
    the compiler's threshold fails) nor overcount much (launches cost)."""
    for b, pages, hq, hkv, d in ((1, 256, 4, 2, 8), (1, 1024, 16, 2, 40), (2, 80, 8, 8, 200)):
        counted = sum(_counted_decode(b, pages, hq=hq, hkv=hkv, d=d).instructions.values()) / b
        estimate = nki_paged.sequence_instructions(pages * 16, 16, 1, hq, hkv, d, d, torch.bfloat16.itemsize)
        assert counted <= estimate <= 2 * counted


def test_a_batch_past_the_instruction_budget_runs_in_several_launches(monkeypatch):
    """Every sequence's blocks are issued up to the table's width, so a batch of long tables (256 sequences of
    128K positions in pages of 16) passes the compiler's 5,000,000 instructions a launch: the host splits it."""
    from portable_ops.backends.nki import emulator
    k_cache, v_cache, table, seqlens = paged_cache([30, 0, 5, 17, 9], 16, dtype=torch.float32)
    one = nki_paged.sequence_instructions(table.shape[1] * 16, 16, 1, 4, 2, 8, 8, 4)
    budget = int(2.5 * one)
    monkeypatch.setattr(runtime, "INSTRUCTION_BUDGET", budget)
    q = torch.randn(5, 1, 4, 8)
    with emulator.instruction_budget(budget), emulator.count_instructions() as stats:
        _nki_and_reference(q, k_cache, v_cache, table, seqlens, softcap=9.0)
    assert stats.launches == 3
    monkeypatch.setattr(runtime, "INSTRUCTION_BUDGET", one - 1)  # not even one sequence a launch: declined
    with portable_ops.use_backend("nki"):
        reasons = portable_ops.explain("paged_attention", q, k_cache, v_cache, table, seqlens).rejected["nki"]
    assert reasons == [f"one sequence of a block table of {table.shape[1] * 16} positions takes up to {one} "
                       f"instructions, past the Neuron compiler's {one - 1} a launch: the NKI kernel issues every "
                       "block up to the table's width"]
