"""Rotary position embeddings as one NKI kernel: the forward, the backward (``inverse``) and the in-place rotation.

Layout: positions on the partitions, the R rotated dims along the free axis: a tile ``[128, n, R]`` holds
``128 * n`` positions, n consecutive ones per partition (``n = 1024 // R``: one DMA moves a head's 128 KiB at
D = 128, bf16, where one of 128 positions would spend as long on the transfer's fixed cost as on its bytes). For
each batch and tile of positions the tables are loaded once (as stored) and the signed sines made (float32)
once, ``t = (-sin_lo, sin_hi)`` (the backward's transpose: ``(sin_hi, -sin_lo)``, each half its partner's sine),
so that for every head of q and then of k, ``out = x * cos + swap(x) * t`` is three element-wise instructions:
``x * cos`` on GpSimd, the two halves of ``swap(x) * t`` on the Vector Engine (a pair is dims ``j`` and
``j + R/2``, or ``2j`` and ``2j + 1`` interleaved: a step-2 access of the free axis), and their sum on the Vector
Engine one head in three, on GpSimd (the faster, by clock) the other two, which balances the two engines. The
engines compute in float32 and the store rounds once to x's dtype. The dims past R are copied HBM to HBM by one DMA
per head (left alone in place). The host side hands the kernel contiguous q, k and tables (a copy where they are
not), and lays each output out as its input.

Cost (``python -m portable_ops.bench nki``): six float32 element passes of arithmetic per element (three
two-input instructions) against the 4 bytes a bf16 element moves (read and written), so the kernel is bound by the
Vector Engine and GpSimd, about twice its HBM floor on Trn2 (its DMA alone: 1.1x). bf16 operands would halve the
arithmetic's cost (the Vector Engine's 16-bit mode) but round the products, where this op computes in float32 and
rounds once.
"""

from __future__ import annotations

import torch

from .compat import nki, nisa, nl
from .runtime import kernel_op, launch, no_outputs

PMAX = 128
MAX_ROTARY = 4096  # a tile's R dims: the tables, the signed sines and a head's three tiles, float32, fit SBUF
FREE = 1024  # float32 elements per partition in a tile: R times the positions each partition holds


def _halves(tile, r, interleaved):
    """The pairs' two halves of a ``[rows, n, R]`` tile: dims ``j`` and ``j + R/2``, or ``2j`` and ``2j + 1``."""
    if interleaved:
        return tile[:, :, 0:r:2], tile[:, :, 1:r:2]
    return tile[:, :, 0:r // 2], tile[:, :, r // 2:r]


def _rows(t, s0, rows, n, r):
    """Positions ``s0 .. s0 + rows * n`` of a ``[S, width]`` HBM slice as ``[rows, n, R]``: partition p holds the n
    consecutive positions from ``s0 + p * n`` (one DMA moves a head's ``rows * n`` positions)."""
    return t[s0:s0 + rows * n, :].reshape((rows, n, t.shape[1]))[:, :, 0:r]


def _load(src, shape):
    tile = nl.ndarray(shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)  # as stored: the engines read any dtype (a DMA converts only in some modes)
    return tile


def _blocks(s, per_partition):
    """``(s0, rows, n)`` covering positions ``0 .. s``: full tiles of ``128 * per_partition`` positions, then what
    is left with as many positions per partition as fill 128 partitions, then a last tile of one each."""
    s0 = 0
    while s0 < s:
        left = s - s0
        n = min(per_partition, left // PMAX) or 1
        rows = PMAX if left >= PMAX else left
        yield s0, rows, n
        s0 += rows * n


@nki.jit
def rope_kernel(cos, sin, q=None, k=None, interleaved=False, inverse=False, in_place=False):
    """q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` (either may be None), contiguous, rotated by cos and sin
    ``[Bc, S, R]`` (``Bc`` 1 or B, contiguous): returns ``(q_out, k_out)`` (those given), or, ``in_place``, writes
    q and k."""
    x_first = q if q is not None else k
    batch, _, s, d = x_first.shape
    r = cos.shape[2]
    pairs = [(x, x if in_place else nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm))
             for x in (q, k) if x is not None]
    for x, out in pairs:
        if not in_place and r < d:  # the dims past R: copied, HBM to HBM, one DMA per head
            for b in range(batch):
                for h in range(x.shape[1]):
                    nisa.dma_copy(dst=out[b, h, 0:s, r:d], src=x[b, h, 0:s, r:d])
    turn = 0
    for b in range(batch):
        tb = b if cos.shape[0] > 1 else 0
        for s0, rows, n in _blocks(s, max(1, FREE // r)):
            shape = (rows, n, r)
            c = _load(_rows(cos[tb], s0, rows, n, r), shape)
            sn = _load(_rows(sin[tb], s0, rows, n, r), shape)
            t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)  # the signed sines, each half its partner's
            t_lo, t_hi = _halves(t, r, interleaved)
            s_lo, s_hi = _halves(sn, r, interleaved)
            negated, kept = ((t_hi, s_lo), (t_lo, s_hi)) if inverse else ((t_lo, s_lo), (t_hi, s_hi))
            nisa.tensor_scalar(dst=negated[0], data=negated[1], op0=nl.multiply, operand0=-1.0)
            nisa.tensor_copy(dst=kept[0], src=kept[1])
            for x, out in pairs:
                for h in range(x.shape[1]):
                    xt = _load(_rows(x[b, h], s0, rows, n, r), shape)
                    y = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=y, data1=xt, data2=c, op=nl.multiply, engine=nisa.engine.gpsimd)
                    z = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
                    z_lo, z_hi = _halves(z, r, interleaved)
                    x_lo, x_hi = _halves(xt, r, interleaved)
                    nisa.tensor_tensor(dst=z_lo, data1=x_hi, data2=t_lo, op=nl.multiply, engine=nisa.engine.vector)
                    nisa.tensor_tensor(dst=z_hi, data1=x_lo, data2=t_hi, op=nl.multiply, engine=nisa.engine.vector)
                    # the sum, rounded once to x's dtype by the engine, on the Vector Engine one head in three and on
                    # GpSimd (25% faster) the other two: balanced
                    total = y if x.dtype == nl.float32 else nl.ndarray(shape, dtype=x.dtype, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=total, data1=y, data2=z, op=nl.add,
                                       engine=nisa.engine.vector if turn % 3 == 0 else nisa.engine.gpsimd)
                    turn += 1
                    nisa.dma_copy(dst=_rows(out[b, h], s0, rows, n, r), src=total)
    if in_place:
        return None
    return tuple(out for _, out in pairs)


# ----------------------------------------------------------------------------- host side
def rope_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); a tile holds the R rotated dims whole."""
    r = call["cos"].shape[-1]
    if r > MAX_ROTARY:
        return [f"the rotary dims R are {r}, over {MAX_ROTARY}, the most the NKI rope kernel holds in SBUF"]
    return []


def _contiguous(t):
    return None if t is None else t.contiguous()  # the kernel reads [B, H, S, D] row-major HBM tensors


def _in_layout(out, given):
    """The kernel's contiguous output laid out as its input (``portable_ops.layout.same_layout``)."""
    from portable_ops import layout

    want = layout.same_layout(given)
    return out if out.stride() == want.stride() else want.copy_(out)


def _fake_rotated(cos, sin, q, k, interleaved, inverse):
    return [x.new_empty(x.shape) for x in (q, k) if x is not None]


@kernel_op("rope", _fake_rotated)
def rope_op(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor | None, interleaved: bool,
            inverse: bool) -> list[torch.Tensor]:
    """The kernel's launch as the op ``portable_ops_nki::rope``: the rotated q and k (those given), contiguous."""
    return list(launch(rope_kernel, _contiguous(cos), _contiguous(sin), q=_contiguous(q), k=_contiguous(k),
                       interleaved=interleaved, inverse=inverse))


@kernel_op("rope_", no_outputs, mutates_args=("q", "k"))
def rope_inplace_op(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, interleaved: bool) -> None:
    """The kernel's in-place launch as the op ``portable_ops_nki::rope_``: rotates contiguous q and k."""
    launch(rope_kernel, _contiguous(cos), _contiguous(sin), q=q, k=k, interleaved=interleaved, in_place=True)


def _rotate(q, k, cos, sin, interleaved, inverse):
    outs = iter(rope_op(cos, sin, q, k, interleaved, inverse))
    return tuple(None if t is None else _in_layout(next(outs), t) for t in (q, k))


def rope_fwd(q, k, cos, sin, interleaved):
    return _rotate(q, k, cos, sin, interleaved, False)


def rope_bwd(dq, dk, cos, sin, interleaved):
    return _rotate(dq, dk, cos, sin, interleaved, True)


def rope_inplace(q, k, cos, sin, interleaved):
    given = (q, k)
    dense = tuple(t.contiguous() for t in given)
    rope_inplace_op(cos, sin, *dense, interleaved)  # the op bumps the versions of what it writes
    for t, written in zip(given, dense):
        if written is not t:
            t.copy_(written)
