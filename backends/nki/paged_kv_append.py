"""Appending new tokens' k and v to a paged KV cache (``paged_kv_append``, vLLM's ``reshape_and_cache``) as an NKI
kernel: the host maps each new token to its slot (``block_table[b, j // page_size] * page_size + j % page_size`` for
its position ``j = cache_seqlens[b] + t``), and the kernel scatters up to 128 tokens' rows (every KV head's ``D``
values, contiguous in the cache) per indirect DMA, one row per partition (``.ap(vector_offset=...)``). The checks
have refused any call with a slot outside the pool or two tokens in one slot, so the scatter is exact.
"""

from __future__ import annotations

import torch

from .compat import nki, nisa, nl
from .paged_attention import PMAX, cache_rows
from .runtime import kernel_op, launch, no_outputs

ROW_BYTES = 64 * 1024  # of a partition: a token's row of every KV head, k's or v's


@nki.jit
def paged_kv_append_kernel(k_rows, v_rows, slots, k_new, v_new):
    """``k_new [N, Hkv, D]``, ``v_new [N, Hkv, Dv]`` (the new tokens) to rows ``slots [N, 1]`` (int32) of the caches'
    token rows ``k_rows [slots, Hkv, D]``, ``v_rows [slots, Hkv, Dv]``, in place."""
    n = slots.shape[0]
    for t0 in nl.affine_range(0, n, PMAX):
        count = min(PMAX, n - t0)
        slot = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(slot, slots[t0:t0 + count, :])
        for rows, new in ((k_rows, k_new), (v_rows, v_new)):
            width = rows.shape[1] * rows.shape[2]
            tile = nl.ndarray((count, width), dtype=new.dtype, buffer=nl.sbuf)
            nisa.dma_copy(tile, new[t0:t0 + count, :, :])
            nisa.dma_copy(rows.ap([[width, count], [1, width]], offset=0, vector_offset=slot, indirect_dim=0), tile,
                          dge_mode=nisa.dge_mode.swdge)


@kernel_op("paged_kv_append", no_outputs, mutates_args=("k_rows", "v_rows"))
def paged_kv_append_op(k_rows: torch.Tensor, v_rows: torch.Tensor, slots: torch.Tensor, k_new: torch.Tensor,
                       v_new: torch.Tensor) -> None:
    """The kernel's launch as the op ``portable_ops_nki::paged_kv_append``, writing ``k_rows`` and ``v_rows``."""
    launch(paged_kv_append_kernel, k_rows, v_rows, slots, k_new, v_new)


def _new_slots(block_table, cache_seqlens, new_tokens, page_size):
    """``[B * Sn, 1]`` int32: the slot of each new token, sequence by sequence."""
    positions = cache_seqlens.long()[:, None] + torch.arange(new_tokens, device=block_table.device)
    pages = block_table.long().gather(1, positions // page_size)
    return (pages * page_size + positions % page_size).to(torch.int32).reshape(-1, 1)


def paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """``k_new [B, Sn, Hkv, D]``, ``v_new [B, Sn, Hkv, Dv]`` to positions ``cache_seqlens[b] + t`` of the paged
    caches, in place."""
    slots = _new_slots(block_table, cache_seqlens, k_new.shape[1], k_cache.shape[1])
    k_new, v_new = (new.reshape(-1, *new.shape[2:]).contiguous() for new in (k_new, v_new))
    paged_kv_append_op(cache_rows(k_cache), cache_rows(v_cache), slots, k_new, v_new)


def paged_kv_append_supports(call) -> list[str]:
    """What the kernel's layout needs beyond the declared dtypes and head dims."""
    k_cache, v_cache = call["k_cache"], call["v_cache"]
    reasons = []
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        reasons.append("the NKI kernel writes token rows of contiguous caches in place; a strided k_cache or v_cache "
                       "has no such rows")
    if k_cache.shape[0] * k_cache.shape[1] >= 2 ** 31:
        reasons.append("a pool of 2^31 or more token slots: the NKI kernel's scatter indices are int32")
    row = k_cache.shape[2] * max(k_cache.shape[3], v_cache.shape[3]) * k_cache.element_size()
    if row > ROW_BYTES:
        reasons.append(f"a token's row of every KV head is {row} bytes; the NKI kernel moves it through one partition "
                       f"of SBUF, at most {ROW_BYTES}")
    return reasons
