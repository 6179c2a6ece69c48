"""Rotary position embeddings: one kernel for the forward, the backward and the in-place rotation.

One program per (batch, block of ``BLOCK_S`` positions, block of ``HEADS`` heads), on a one-dimensional grid (no
grid limit short of 2^31 programs): it loads the pairs' two halves (dims ``j`` and ``j + R/2``, or ``2j`` and
``2j + 1`` interleaved) of its heads and positions as ``[HEADS, BLOCK_S, R/2]`` blocks through q's or k's strides
(no copy: transposed slices of a fused projection are read where they are), and the tables' through a zero head
stride (read once, then from cache, in the blocks' own layout: a ``[BLOCK_S, R/2]`` table broadcast over the heads
costs a layout conversion, which halved the bandwidth with bf16 tables on an H200), rotates them in float32 and
stores them, rounded once, through the output's strides; the dims past R are copied (not in place, where they are
left alone). The head blocks of q come first, then k's: q and k in one launch. Every offset is 64-bit. A program
reads both halves of a pair before it writes either, and no other program touches them, so the output may be the
input itself (``rope_``).

The backward (``rope_bwd``) is the same kernel with ``INVERSE``: the transpose ``dx = dout * cos - rotate(dout *
sin)``, which reads each half's sine at its partner's index and negates it; for rotation tables, the rotation by the
opposite angle.

Under torch.compile ``portable_ops::triton_rope_fwd`` / ``_bwd`` (:func:`traced_ops`) launch the same kernel,
configured by the same function, from the code Inductor generates.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from portable_ops import layout
from portable_ops.rope import register_gradients

from .adam import _TL_DTYPE
from .interpreter import to_dtype
from .launch import in_compile_env
from .traced import triton_op, wrap_triton

MAX_ROTARY = 4096  # R: a pair's half (R / 2) is one block of registers per position
# Positions and heads per program, and warps: the best of a sweep on an H200 (benchmarks/rope_ab.py; 8 x 4 x 4
# over 16 x 4 x 4, 16 x 8 x 4, 32 x 2 x 4, 4 x 4 x 4, 8 x 8 x 8, 16 x 4 x 8, 16 x 2 x 8), bf16 q and k at D 128
BLOCK_S = 8
HEADS = 4
NUM_WARPS = 4
BLOCK_ELEMENTS = 2048  # a block's elements, at most (the tuned 4 x 8 x 64): wider pairs take fewer heads, then rows
PASS_BLOCK = 64  # columns copied at a time past R


@triton.jit
def _rotate_heads(X, O, COS, SIN, b, h0, H, sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, so_d, sc_b, sc_s, sc_r,
                  ss_b, ss_s, ss_r, rows, R, D, S, DTYPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                  INVERSE: tl.constexpr, COPY_REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  PASS_BLOCK: tl.constexpr, HEADS: tl.constexpr):
    """``HEADS`` heads from ``h0`` at once, as blocks ``[HEADS, BLOCK_S, BLOCK_HALF]``; the tables are read through a
    zero head stride (from cache after the first head), so every block shares one layout."""
    j = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        lo = 2 * j
        hi = 2 * j + 1
    else:
        lo = j
        hi = j + R // 2
    h = h0 + tl.arange(0, HEADS)
    head_rows = (h < H)[:, None, None] & (rows < S)[None, :, None]
    mask = head_rows & (j < R // 2)[None, None, :]
    zero = h[:, None, None] * 0
    cos = COS + b * sc_b + rows[None, :, None] * sc_s + zero
    sin = SIN + b * ss_b + rows[None, :, None] * ss_s + zero
    c_lo = tl.load(cos + lo[None, None, :] * sc_r, mask=mask, other=0.0).to(tl.float32)
    c_hi = tl.load(cos + hi[None, None, :] * sc_r, mask=mask, other=0.0).to(tl.float32)
    s_lo = tl.load(sin + lo[None, None, :] * ss_r, mask=mask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin + hi[None, None, :] * ss_r, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose: each half takes its partner's sine, negated
        s_lo, s_hi = -s_hi, -s_lo
    x = X + b * sx_b + h[:, None, None] * sx_h + rows[None, :, None] * sx_s
    o = O + b * so_b + h[:, None, None] * so_h + rows[None, :, None] * so_s
    x_lo = tl.load(x + lo[None, None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(x + hi[None, None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(o + lo[None, None, :] * so_d, to_dtype(x_lo * c_lo - x_hi * s_lo, DTYPE), mask=mask)
    tl.store(o + hi[None, None, :] * so_d, to_dtype(x_hi * c_hi + x_lo * s_hi, DTYPE), mask=mask)
    if COPY_REST:
        for c0 in range(R, D, PASS_BLOCK):
            cols = c0 + tl.arange(0, PASS_BLOCK)
            pass_mask = head_rows & (cols < D)[None, None, :]
            tl.store(o + cols[None, None, :] * so_d, tl.load(x + cols[None, None, :] * sx_d, mask=pass_mask),
                     mask=pass_mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN,
                 sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sqo_b, sqo_h, sqo_s, sqo_d,
                 sko_b, sko_h, sko_s, sko_d, sc_b, sc_s, sc_r, ss_b, ss_s, ss_r,
                 HQ, HK, S, D, R, s_blocks, q_head_blocks, head_blocks,
                 DTYPE: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, COPY_REST: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS_BLOCK: tl.constexpr, HEADS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    hb = pid % head_blocks
    rest = pid // head_blocks
    b = rest // s_blocks
    rows = (rest % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    if hb < q_head_blocks:
        _rotate_heads(Q, QO, COS, SIN, b, hb * HEADS, HQ, sq_b, sq_h, sq_s, sq_d, sqo_b, sqo_h, sqo_s, sqo_d,
                      sc_b, sc_s, sc_r, ss_b, ss_s, ss_r, rows, R, D, S, DTYPE, INTERLEAVED, INVERSE, COPY_REST,
                      BLOCK_HALF, PASS_BLOCK, HEADS)
    else:
        _rotate_heads(K, KO, COS, SIN, b, (hb - q_head_blocks) * HEADS, HK, sk_b, sk_h, sk_s, sk_d, sko_b, sko_h,
                      sko_s, sko_d, sc_b, sc_s, sc_r, ss_b, ss_s, ss_r, rows, R, D, S, DTYPE, INTERLEAVED, INVERSE,
                      COPY_REST, BLOCK_HALF, PASS_BLOCK, HEADS)


def rope_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); half of R is a block of registers."""
    r = call["cos"].shape[-1]
    if r > MAX_ROTARY:
        return [f"the rotary dims R are {r}, over {MAX_ROTARY}, the most the triton rope kernel holds"]
    return []


def _strides(t):
    return t.stride() if t is not None else (0, 0, 0, 0)


def _table_strides(t):
    """A ``[Bc, S, R]`` table's strides, a batch of one read by every batch (stride 0)."""
    return (0 if t.shape[0] == 1 else t.stride(0), t.stride(1), t.stride(2))


def _rotate(q, k, cos, sin, interleaved, inverse, q_out, k_out, kernel):
    """Launch ``kernel`` (the rope kernel, or it wrapped for tracing) over q and k (either may be None) into ``q_out``,
    ``k_out`` (q and k themselves: in place)."""
    x = q if q is not None else k
    b, _, s, d = x.shape
    r = int(cos.shape[-1])  # R sizes the blocks: a symbolic one (while torch.compile traces) specialised
    hq, hk = (t.shape[1] if t is not None else 0 for t in (q, k))
    half = triton.next_power_of_2(r // 2)
    heads = max(1, min(HEADS, BLOCK_ELEMENTS // (BLOCK_S * half)))  # six blocks of float32 stay in registers
    block_s = max(1, min(BLOCK_S, BLOCK_ELEMENTS // (heads * half)))
    s_blocks = triton.cdiv(s, block_s)
    q_head_blocks = triton.cdiv(hq, heads)
    head_blocks = q_head_blocks + triton.cdiv(hk, heads)
    in_place = q_out is q and k_out is k
    in_compile_env(kernel[(b * s_blocks * head_blocks,)],
                   q if q is not None else x, k if k is not None else x, q_out if q_out is not None else x,
                   k_out if k_out is not None else x, cos, sin, *_strides(q), *_strides(k), *_strides(q_out),
                   *_strides(k_out), *_table_strides(cos), *_table_strides(sin), hq, hk, s, d, r, s_blocks,
                   q_head_blocks, head_blocks, DTYPE=_TL_DTYPE[x.dtype], INTERLEAVED=interleaved, INVERSE=inverse,
                   COPY_REST=r < d and not in_place, BLOCK_S=block_s, BLOCK_HALF=half,
                   PASS_BLOCK=PASS_BLOCK, HEADS=heads, num_warps=NUM_WARPS)


def _outputs(q, k):
    return tuple(None if t is None else layout.same_layout(t) for t in (q, k))


def _rotated(q, k, cos, sin, interleaved, inverse, kernel):
    q_out, k_out = _outputs(q, k)
    _rotate(q, k, cos, sin, interleaved, inverse, q_out, k_out, kernel)
    return q_out, k_out


def rope_fwd(q, k, cos, sin, interleaved):
    return _rotated(q, k, cos, sin, interleaved, False, _rope_kernel)


def rope_bwd(dq, dk, cos, sin, interleaved):
    return _rotated(dq, dk, cos, sin, interleaved, True, _rope_kernel)


def rope_inplace(q, k, cos, sin, interleaved):
    _rotate(q, k, cos, sin, interleaved, False, q, k, _rope_kernel)
    # the kernel writes through raw pointers: tell autograd, as torch's in-place ops would
    torch.autograd.graph.increment_version([q, k])


def _rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotated(q, k, cos, sin, interleaved, False, wrap_triton(_rope_kernel))


def _rope_bwd(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotated(dq, dk, cos, sin, interleaved, True, wrap_triton(_rope_kernel))


@functools.cache
def traced_ops() -> dict[str, str]:
    """The ops torch.compile traces into (``OpImpl.traced``): ``portable_ops::triton_rope_fwd`` / ``_bwd``, each the
    other's gradient, registered at the first call, as the norms' (``norms.traced_ops``). rope_ has none: its checks
    of what it writes (elements shared within or between q and k, inference tensors) run when its custom op does,
    and a graph Inductor compiles runs no Python of ours."""
    register_gradients(triton_op("portable_ops::triton_rope_fwd", mutates_args=())(_rope_fwd),
                       triton_op("portable_ops::triton_rope_bwd", mutates_args=())(_rope_bwd))
    return {"rope_fwd": "triton_rope_fwd"}
