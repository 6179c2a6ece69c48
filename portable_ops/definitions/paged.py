"""Attention over a paged KV cache, and appending to it (FlashAttention's ``flash_attn_with_kvcache`` and
vLLM's layout).

``k_cache [num_pages, page_size, Hkv, D]``, ``v_cache [num_pages, page_size, Hkv, Dv]``; token ``j`` of
sequence ``b`` lives in page ``block_table[b, j // page_size]`` at offset ``j % page_size``. Both ops share
that one mapping (:func:`_slots`). Attention gathers each sequence's keys into a contiguous
``[1, Hkv, L, D]`` and runs the dense attention of ``attention.py`` on it: its ``Sq`` queries are the
sequence's last positions, which is dense attention's bottom-right alignment.
"""

from __future__ import annotations

import torch

from .attention import attention_fwd, opmath


def _slots(block_table, positions, page_size):
    """``(page, offset)`` index tensors of token ``positions [B, n]`` of each sequence (``[n]``: of one)."""
    pages = torch.gather(block_table.long(), -1, (positions // page_size).long())
    return pages, positions % page_size


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale, window=None, softcap=None, sinks=None,
                    dense_fwd=attention_fwd):
    """``q [B, Sq, Hq, D]`` -> ``(out [B, Sq, Hq, Dv]`` (contiguous), ``lse [B, Hq, Sq])``; ``dense_fwd``: the dense
    attention run on each sequence (the reference backend passes its own)."""
    sq, page_size = q.shape[1], k_cache.shape[1]
    left = window[0] if window is not None else None
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
    lse = torch.empty((q.shape[0], q.shape[2], sq), dtype=opmath(q), device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        # Only the positions the window lets the queries see: pages before it are never read (a cache
        # may have released them).
        first = 0 if left is None else max(0, length - sq - left)
        pages, offsets = _slots(block_table[b], torch.arange(first, length, device=q.device), page_size)
        keys = [cache[pages, offsets].transpose(0, 1)[None] for cache in (k_cache, v_cache)]  # [1, Hkv, L, D]
        seq_out, lse[b] = dense_fwd(q[b].transpose(0, 1)[None], *keys, causal=True, scale=scale, window=window,
                                    softcap=softcap, sinks=sinks)
        out[b] = seq_out[0].transpose(0, 1)
    return out, lse


def paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """Token ``t`` of ``k_new [B, Sn, Hkv, D]``, ``v_new [B, Sn, Hkv, Dv]`` to position ``cache_seqlens[b] + t`` of
    sequence ``b``."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k_new.shape[1], device=k_new.device)
    pages, offsets = _slots(block_table, positions, k_cache.shape[1])
    k_cache[pages, offsets] = k_new
    v_cache[pages, offsets] = v_new
