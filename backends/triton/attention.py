"""Flash attention on the tl.* kernels (FlashAttention-2's algorithm) and, where they take a call, the
Gluon kernels for Hopper (attention_sm90): forward, backward, packed sequences, and a split-key decode
over a dense or a paged cache. The backend's entry points: what each takes, and its plan's launches.

Causal masks are aligned to the bottom right: query ``i`` sees key ``j`` when ``j <= i + Skv - Sq``.
Every loop over tiles is cut into a range whose tiles need no mask at all (fully visible, fully in
bounds) and the few tiles that do (the causal diagonal, ragged tails), since a mask on every tile
costs the forward time. Any head dim up to 256 (attention_tiles says how a row is split), v's its own.
"""

from __future__ import annotations

import torch
import triton

from portable_ops import layout

from . import attention_plans
from .attention_fwd_kernels import append_kernel
from .attention_plans import Sequences, fold, most_pairs, plan_of_backward, plan_of_forward, run_backward, run_forward

MAX_HEAD_DIM = 256  # a tile row of the head dim must fit the registers
DOT_MIN_ROWS = 16  # tl.dot's smallest tile: no query tile has fewer rows


def _pairs_reasons(pairs: int, what: str) -> list[str]:
    """Past CUDA's limit on a grid's second dim, pairs fold over its third (``attention_plans.fold``); only
    more than both hold is refused."""
    most = most_pairs()
    if pairs <= most:
        return []
    return [f"{pairs} {what}: a launch takes at most {most} (CUDA's limit of {attention_plans.MAX_GRID_Y} on a "
            f"grid's second and third dims, and program ids in int32)"]


def attention_supports(call) -> list[str]:
    q = call["q"]
    return _pairs_reasons(q.shape[0] * q.shape[1], "batch x heads")


def attention_varlen_supports(call) -> list[str]:
    q = call["q"]
    sequences = call["cu_seqlens_q"].shape[0] - 1
    return _pairs_reasons(sequences * q.shape[1], "sequences x heads")


def paged_attention_supports(call) -> list[str]:
    b, sq, h = call["q"].shape[:3]
    hkv = call["k_cache"].shape[2]
    group = h // max(hkv, 1)
    if group > 1 and group * sq <= DOT_MIN_ROWS:  # a GQA group's rows then share a program in any tile config
        return _pairs_reasons(b * hkv, "sequences x KV heads")
    return _pairs_reasons(b * h, "sequences x heads")


def paged_kv_append_supports(call) -> list[str]:
    reasons = _pairs_reasons(call["k_new"].shape[2], "KV heads")
    if any(call[name].stride(-1) != 1 for name in ("k_cache", "v_cache")):
        reasons.append("a cache whose last dim is strided: the kernel writes rows of unit-stride columns")
    return reasons


def _row_major(t):
    """``t`` as the kernels address it: rows of unit-stride columns (a copy only when the last dim is strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    return _forward_call(q, k, v, causal, scale, window, softcap, sinks, layout.strides_like(q, v.shape[-1]), None,
                         (q, q, q, q))


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale,
                         window=None, softcap=None, sinks=None):
    """``q [Tq, H, D]`` -> (out ``[Tq, H, Dv]`` contiguous, lse ``[H, Tq]``), one launch for every sequence."""
    seqs = _varlen_sequences(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    offsets = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous())  # the kernels step them by one
    out, lse = _forward_call(*_as_batch(q, k, v), causal, scale, window, softcap, sinks,
                             _as_batch_strides(q, v.shape[-1]), seqs, (*offsets, q, q))
    return layout.unviewed(out[0].transpose(0, 1)), lse[0]


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, scale, window=None, softcap=None, sinks=None):
    """``q [B, Sq, Hq, D]`` over ``[pages, page_size, Hkv, D]`` (v: ``Dv``) caches -> (out ``[B, Sq, Hq, Dv]``
    contiguous, lse ``[B, Hq, Sq]``)."""
    b, sq, h = q.shape[:3]
    d = v_cache.shape[-1]
    page = k_cache.shape[1]
    block_table = block_table.contiguous()  # its row stride is a plan's, its columns are stepped by one
    seqs = Sequences("paged", b, sq, block_table.shape[1] * page, page, block_table.stride(0))
    out, lse = _forward_call(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), True, scale,
                             window, softcap, sinks, (sq * h * d, d, h * d, 1), seqs,
                             (q, q, cache_seqlens.contiguous(), block_table))
    return layout.unviewed(out.transpose(1, 2)), lse


def _varlen_sequences(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> Sequences:
    """The packed call's sequences; a ``max_seqlen`` past every token is cut to the tokens (the same call: no
    sequence is longer), since the grid is sized by it."""
    return Sequences("varlen", cu_seqlens_q.shape[0] - 1, min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0]),
                     tokens=q.shape[0])


def _as_batch(*packed):
    """Packed ``[T, H, D]`` tensors as the kernels' ``[1, H, T, D]`` views."""
    return tuple(t.transpose(0, 1)[None] for t in packed)


def _as_batch_strides(t, d=None) -> tuple:
    """The ``[1, H, T, D]`` view's strides of a contiguous ``[T, H, D]`` tensor shaped as ``t`` (its last dim
    ``d``, where given)."""
    tokens, h, own = t.shape
    d = own if d is None else d
    return (tokens * h * d, d, h * d, 1)


def prepare_attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_fwd`` without sinks for every call of this one's layout and options (``OpImpl.prepare``):
    ``run(q, k, v)``, its plan found here, once."""
    # not a launch of q, k, v as they are; or float32, whose products follow torch's TF32 switch per call
    if any(t.stride(-1) != 1 for t in (q, k, v)) or q.dtype == torch.float32:
        return lambda q, k, v: attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    plan, scale, softcap = plan_of_forward(q, k, v, causal, scale, window, softcap, None,
                                           layout.strides_like(q, v.shape[-1]), None, (q, q, q, q))
    return lambda q, k, v: run_forward(plan, q, k, v, scale, softcap, (q, q, q, q))


def _forward_call(q, k, v, causal, scale, window, softcap, sinks, out_stride, seqs, extras):
    """``seqs``: None for a dense batch; ``extras``: the kernel's CU_Q, CU_K, CACHE_LENS, TABLE (q where unused)."""
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    plan, scale, softcap = plan_of_forward(q, k, v, causal, scale, window, softcap, sinks, out_stride, seqs, extras)
    return run_forward(plan, q, k, v, scale, softcap, extras, sinks)


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them when there are sinks."""
    strides = (layout.strides_like(q), layout.strides_like(k), layout.strides_like(v))
    return _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, strides, None,
                          (q, q))


def attention_varlen_bwd(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """Gradients ``[T, H, D]``, contiguous, of :func:`attention_varlen_fwd` (and ``dsinks``, with sinks)."""
    seqs = _varlen_sequences(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    strides = tuple(_as_batch_strides(t) for t in (q, k, v))
    dq, dk, dv, *dsinks = _backward_call(*_as_batch(q, k, v, out), lse[None], *_as_batch(dout), causal, scale,
                                         window, softcap, sinks, None if dlse is None else dlse[None], strides, seqs,
                                         (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()))
    return (*(layout.unviewed(g[0].transpose(0, 1)) for g in (dq, dk, dv)), *dsinks)


def prepare_attention_bwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_bwd`` without sinks for every call whose q, k and v have this one's layout (shapes, strides,
    dtypes, device, 16-byte alignment; the caller sees to that) and these options (``OpImpl.prepare``):
    ``run(q, k, v, out, lse, dout)``, which finds its plan by out, lse and dout's layouts alone."""
    # not a launch of q, k, v as they are; or float32, whose products follow torch's TF32 switch per call
    if any(t.stride(-1) != 1 for t in (q, k, v)) or q.dtype == torch.float32:
        return lambda q, k, v, out, lse, dout: attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale,
                                                             window=window, softcap=softcap)
    strides = (layout.strides_like(q), layout.strides_like(k), layout.strides_like(v))
    plans: dict = {}  # a model hands its backward dout in one layout; bounded all the same

    def run(q, k, v, out, lse, dout):
        key = (out.stride(), out.dtype, lse.stride(), lse.dtype, dout.stride(), dout.dtype, dout.data_ptr() % 16 == 0,
               torch.are_deterministic_algorithms_enabled())
        found = plans.get(key)
        if found is None:
            if out.stride(-1) != 1 or dout.stride(-1) != 1 or not lse.is_contiguous():
                return _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, None, None, strides,
                                      None, (q, q))
            if len(plans) >= 16:
                plans.clear()
            found = plans[key] = plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, None,
                                                  None, strides, None, (q, q))
        try:
            return run_backward(*found, q, k, v, out, lse, dout, (q, q))
        except BaseException:  # a call that failed leaves no plan behind (run_backward drops it from its own)
            if plans.get(key) is found:
                del plans[key]
            raise

    return run


def _backward_call(q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, strides, seqs, extras):
    q, k, v, out, dout = _row_major(q), _row_major(k), _row_major(v), _row_major(out), _row_major(dout)
    lse = lse.contiguous()  # ours: already contiguous, so no copy
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    plan = plan_of_backward(q, k, v, out, lse, dout, causal, scale, window, softcap, sinks, dlse, strides, seqs,
                            extras)
    return run_backward(*plan, q, k, v, out, lse, dout, extras, sinks, dlse)


def paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """``k_new [B, Sn, Hkv, D]``, ``v_new [B, Sn, Hkv, Dv]`` to positions ``cache_seqlens[b] + t`` of the paged
    caches, in place."""
    b, sn, hkv, d = k_new.shape
    k_new, v_new = _row_major(k_new), _row_major(v_new)
    block_table, cache_seqlens = block_table.contiguous(), cache_seqlens.contiguous()  # read by stepping one
    heads, folds = fold(hkv)
    append_kernel[(b * sn, heads, folds)](k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, sn,
                                          *k_new.stride()[:3], *v_new.stride()[:3], *k_cache.stride()[:3],
                                          *v_cache.stride()[:3], block_table.stride(0), hkv, PAGE=k_cache.shape[1],
                                          D=d, VD=v_new.shape[-1],
                                          BLOCK_D=triton.next_power_of_2(max(d, v_new.shape[-1])), FOLD=folds > 1)
    # the kernel writes through raw pointers: tell autograd, as torch's in-place ops would
    torch.autograd.graph.increment_version([k_cache, v_cache])
