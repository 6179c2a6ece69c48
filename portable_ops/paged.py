"""Decoding from a paged KV cache: ``paged_attention`` (FlashAttention's ``flash_attn_with_kvcache`` with a
``block_table``) and ``paged_kv_append`` (vLLM's ``reshape_and_cache``), in vLLM's cache layout.

The cache is a pool of pages, ``k_cache, v_cache [num_pages, page_size, Hkv, D]``; each sequence's
``block_table`` row lists the pages that hold its tokens in order, so token ``j`` of sequence ``b``
lives at ``k_cache[block_table[b, j // page_size], j % page_size]``. Inference only: neither op is
differentiable, and both refuse inputs that would need a gradient. Eager calls dispatch directly
(decode is host-bound); torch.compile sees the custom ops ``portable_ops::paged_attention`` and
``portable_ops::paged_kv_append``.
"""

from __future__ import annotations

import torch

from . import checks
from .attention import as_returned, call_layout, lse_dtype, refuse_transforms, run_op, window_args, window_of


def paged_attention_call(q, k_cache, v_cache, block_table, cache_seqlens, scale, window, softcap, sinks=None):
    """Check one call's arguments (the page tables' values once per version) and return them as the
    backends take them."""
    checks.check_paged_attention(q, k_cache, v_cache, block_table, cache_seqlens)
    sinks = checks.attention_sinks(sinks, q, 2)
    checks.check_not_differentiated("paged_attention", sinks=sinks)
    _, scale, window, softcap = checks.attention_options(q.shape[-1], True, scale, window, softcap,
                                                         compiling=torch.compiler.is_compiling())
    _check_page_values_for_attention(q, k_cache, block_table, cache_seqlens, window)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                scale=scale, window=window, softcap=softcap, sinks=sinks)


def paged_kv_append_call(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """Check one append's arguments (the page tables' values once per version) and return them as the
    backends take them."""
    checks.check_paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new)
    _check_page_values_for_append(k_cache, block_table, cache_seqlens, k_new)
    return dict(k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=cache_seqlens, k_new=k_new,
                v_new=v_new)


def _check_page_values_for_attention(q, k_cache, block_table, cache_seqlens, window):
    checks.check_page_values(block_table, cache_seqlens, page_size=k_cache.shape[1], num_pages=k_cache.shape[0],
                             new_tokens=q.shape[1], window_left=None if window is None else window[0])


def _check_page_values_for_append(k_cache, block_table, cache_seqlens, k_new):
    checks.check_page_values(block_table, cache_seqlens, page_size=k_cache.shape[1], num_pages=k_cache.shape[0],
                             new_tokens=k_new.shape[1], append=True)


def _attend(call):
    """(out, lse) from the backend chosen for this call."""
    return run_op("paged_attention", call, call_layout(call), call["q"].device, None)


def _append(call):
    run_op("paged_kv_append", call, call_layout(call), call["k_new"].device, None)


# ----------------------------------------------------------------------------- torch.compile

@torch.library.custom_op("portable_ops::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, scale: float, window_left: int | None, window_right: int | None,
                        softcap: float | None, scale_tensor: torch.Tensor | None = None,
                        softcap_tensor: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scale, softcap = checks.op_values(scale, softcap, scale_tensor, softcap_tensor)
    window = window_of(window_left, window_right)
    # A compiled graph's first chance to read the page tables (tracing could not): once per version.
    _check_page_values_for_attention(q, k_cache, block_table, cache_seqlens, window)
    return _attend(dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                        scale=scale, window=window, softcap=softcap, sinks=sinks))


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, scale, window_left, window_right, softcap, scale_tensor=None,
      softcap_tensor=None, sinks=None):
    return (q.new_empty((*q.shape[:-1], v_cache.shape[-1])),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype(q)))


@torch.library.custom_op("portable_ops::paged_kv_append", mutates_args=("k_cache", "v_cache"))
def _paged_kv_append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    checks.check_caches_writable(k_cache, v_cache)
    _check_page_values_for_append(k_cache, block_table, cache_seqlens, k_new)
    _append(dict(k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=cache_seqlens, k_new=k_new,
                 v_new=v_new))


@_paged_kv_append_op.register_fake
def _(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    return None


# ----------------------------------------------------------------------------- the public functions

def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale=None, softcap=None, window=None,
                    sinks=None, return_lse=False):
    """Attention of each sequence's newest ``Sq`` tokens over its tokens in a paged KV cache.

    q ``[B, Sq, Hq, D]`` (``Sq = 1`` for decode, a few for speculative decoding); k_cache ``[num_pages,
    page_size, Hkv, D]`` and v_cache ``[num_pages, page_size, Hkv, Dv]`` in q's dtype, ``Hq % Hkv == 0``;
    ``block_table`` int32 ``[B, max_pages]``; ``cache_seqlens`` int32 ``[B]``: each sequence's valid tokens,
    the ``Sq`` new ones included (append them first with :func:`paged_kv_append`). Query ``t`` of sequence
    ``b`` sits at position ``cache_seqlens[b] - Sq + t`` and sees the keys at positions up to its own (causal,
    always), minus ``window=(left, right)``'s (``right`` is moot). ``scale``, ``softcap`` and ``sinks`` as
    for :func:`portable_ops.attention`. Returns ``[B, Sq, Hq, Dv]``, contiguous, or with ``return_lse=True``
    ``(out, lse)``, ``lse [B, Hq, Sq]`` as for :func:`portable_ops.attention`. Not differentiable.
    """
    refuse_transforms("paged_attention", q, k_cache, v_cache, sinks)
    call = paged_attention_call(q, k_cache, v_cache, block_table, cache_seqlens, scale, window, softcap, sinks)
    return_lse = checks.flag("return_lse", return_lse)
    if q.numel() == 0 or k_cache.numel() == 0 or v_cache.numel() == 0:
        # nothing to compute, or an empty cache (every length 0): no row sees a key
        return as_returned((q.new_zeros((*q.shape[:-1], v_cache.shape[-1])), _lse_of_no_key(q, call["sinks"])),
                        return_lse)
    if torch.compiler.is_compiling():
        scale, softcap, scale_tensor, softcap_tensor = checks.op_scalars(call["scale"], call["softcap"])
        return as_returned(_paged_attention_op(q, k_cache, v_cache, block_table, cache_seqlens, scale,
                                            *window_args(call["window"]), softcap, scale_tensor, softcap_tensor,
                                            call["sinks"]), return_lse)
    return as_returned(_attend(call), return_lse)


def _lse_of_no_key(q, sinks):
    """``[B, Hq, Sq]``: rows that see no key have -inf, or their sink."""
    b, sq, hq = q.shape[:3]
    if sinks is None:
        return torch.full((b, hq, sq), float("-inf"), dtype=lse_dtype(q), device=q.device)
    return sinks[None, :, None].expand(b, hq, sq).clone()


def paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new) -> None:
    """Write token ``t`` of ``k_new [B, Sn, Hkv, D]`` and ``v_new [B, Sn, Hkv, Dv]`` to position
    ``cache_seqlens[b] + t`` of sequence ``b`` of the paged cache, in place.

    ``cache_seqlens`` (int32 ``[B]``) are the lengths before the append; it is not changed: add ``Sn``
    to it afterwards (as vLLM's slot mapping is computed by the caller). Every page written must be
    listed in ``block_table``, every position must fit in its ``max_pages * page_size``, and no two new
    tokens may map to one slot; a call that breaks any of these is refused before anything is written.
    """
    refuse_transforms("paged_kv_append", k_cache, v_cache, k_new, v_new)
    call = paged_kv_append_call(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new)
    if k_new.numel() == 0:
        return
    if torch.compiler.is_compiling():
        _paged_kv_append_op(**call)
        return
    _append(call)
