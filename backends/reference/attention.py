"""Dense attention through torch's own fused kernels: the ones ``F.scaled_dot_product_attention``
picks on this device, called through the aten ops that also return the log-sum-exp and take it
back in the backward.

A call maps onto them when the device type has such a kernel for its dtype (:data:`FUSED_KERNELS`),
it has no softcap and its scale is above zero. Masks are the definition's (``visible``): a plain
or square causal call runs as one kernel call; a window, or causal with ``Sq != Skv``
(bottom-right), runs one query block at a time against the keys that block can see, under an
additive mask of that block's size, so memory never grows as ``Sq x Skv``. Every other call (a
softcap, a device with no fused kernel, an empty tensor, mixed dtypes) runs the definition,
which is blocked too."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from portable_ops.definitions import attention as definition
from portable_ops.layout import as_layout_of, empty_like

MASK_BUDGET = 1 << 22  # elements of one query block's additive mask
MIN_BLOCK_ROWS = 128


class FusedKernel(NamedTuple):
    """One device type's fused attention: ``forward(q, k, v, is_causal, mask, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, is_causal, mask, scale) -> (dq, dk, dv)``, top-left causal, GQA
    taken as it comes (``k``, ``v`` with fewer heads than ``q``), and the dtypes it takes."""

    forward: Callable
    backward: Callable
    dtypes: tuple[torch.dtype, ...]


def _cpu_forward(q, k, v, is_causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                     scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)


def _groups_repeated(q, k, v):
    """``k``, ``v`` with each KV head repeated for its query heads (the CUDA kernel takes equal head counts)."""
    groups = q.shape[1] // k.shape[1]
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))


def _groups_summed(d, hkv):
    """The inverse of :func:`_groups_repeated` for a gradient: each KV head's query-head copies summed."""
    b, hq, s, dim = d.shape
    return d if hq == hkv else d.view(b, hkv, hq // hkv, s, dim).sum(2)


def _cuda_bias(mask, q):
    """The additive mask as the CUDA kernel takes it: broadcast to ``[B, H, Sq, Skv]``, each row starting
    at a multiple of 16 elements (SDPA pads it the same way)."""
    if mask is None:
        return None
    rows, skv = mask.shape
    padded = mask.new_zeros(rows, -(-skv // 16) * 16)
    padded[:, :skv] = mask
    return padded[:, :skv].expand(q.shape[0], q.shape[1], rows, skv)


def _cuda_forward(q, k, v, is_causal, mask, scale):
    k, v = _groups_repeated(q, k, v)
    mask = _cuda_bias(mask, q)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, is_causal,
                                                                            scale=scale)
    return out, lse[..., :q.shape[2]]


def _cuda_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    hkv = k.shape[1]
    k, v = _groups_repeated(q, k, v)
    mask = _cuda_bias(mask, q)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the RNG state is unused
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, mask, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], is_causal,
        scale=scale)
    return dq, _groups_summed(dk, hkv), _groups_summed(dv, hkv)


FUSED_KERNELS = {
    "cpu": FusedKernel(_cpu_forward, _cpu_backward, (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
    "cuda": FusedKernel(_cuda_forward, _cuda_backward, (torch.float32, torch.bfloat16, torch.float16)),
}


class Block(NamedTuple):
    """Query rows ``rows`` and the key span ``keys`` they can see, with the additive mask over that span
    (None: every key of the span is visible, or, with ``is_causal``, the kernel's top-left causal mask)
    and which of the rows see at least one key (None: all of them)."""

    rows: slice
    keys: slice
    mask: torch.Tensor | None
    is_causal: bool
    seeing: torch.Tensor | None


def _fused_kernel(q, scale, softcap, tensors, lse=None):
    """The device's fused kernel where it computes this call, else None. It takes ``tensors`` all of q's
    dtype (a backward may see q's ``.data`` swapped since the forward). A scale of zero or below is left
    to the definition: the CPU kernel gives NaN for it in float16."""
    kernel = FUSED_KERNELS.get(q.device.type)
    if kernel is None or softcap is not None or scale <= 0 or q.dtype not in kernel.dtypes or q.numel() == 0:
        return None
    if {t.dtype for t in tensors} != {q.dtype} or not all(t.numel() for t in tensors):
        return None
    if lse is not None and lse.dtype != definition.opmath(q):
        return None
    return kernel


def _blocks(q, k, causal, window):
    """The query blocks a call runs as, each with its key span and mask."""
    sq, skv = q.shape[2], k.shape[2]
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and (right is None or (right == 0 and sq == skv)):
        return [Block(slice(0, sq), slice(0, skv), None, right == 0, None)]
    shift = skv - sq  # query i sits at key position i + shift
    if left is None or right is None:
        step = MASK_BUDGET // skv
    else:
        span = min(skv, left + right + 1)  # keys one query sees; a block of n rows sees n + span - 1
        fits = (math.isqrt((span - 1) ** 2 + 4 * MASK_BUDGET) - (span - 1)) // 2
        # blocks about as tall as the window: the kernel computes the masked keys too
        step = min(fits, max(span, MIN_BLOCK_ROWS))
    step = max(1, min(sq, step))
    blocks = []
    for start in range(0, sq, step):
        end = min(sq, start + step)
        first = 0 if left is None else max(0, start + shift - left)
        last = skv if right is None else min(skv, end - 1 + shift + right + 1)
        if last <= first:
            blocks.append(Block(slice(start, end), slice(0, 0), None, False, None))
            continue
        seen = definition.visible(torch.arange(start, end, device=q.device) + shift,
                                  torch.arange(first, last, device=q.device), causal, window)
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        blocks.append(Block(slice(start, end), slice(first, last), mask, False, seen.any(-1)))
    return blocks


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None):
    kernel = _fused_kernel(q, scale, softcap, (k, v))
    if kernel is None:
        return definition.attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)
    blocks = _blocks(q, k, causal, window)
    if len(blocks) == 1 and blocks[0].seeing is None:
        out, lse = kernel.forward(q, k, v, causal, None, scale)
        return as_layout_of(out, q), lse.contiguous()
    out = empty_like(q).zero_()
    lse = torch.full(q.shape[:3], float("-inf"), dtype=definition.opmath(q), device=q.device)
    for block in blocks:
        if block.keys.stop == block.keys.start:
            continue
        out_b, lse_b = kernel.forward(q[:, :, block.rows], k[:, :, block.keys], v[:, :, block.keys], block.is_causal,
                                      block.mask, scale)
        out_b = out_b * block.seeing[:, None]  # the kernel's rows that see no key: zero, as the definition's
        lse_b = lse_b.masked_fill(~block.seeing, float("-inf"))
        out[:, :, block.rows] = out_b
        lse[:, :, block.rows] = lse_b
    return out, lse


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None):
    kernel = _fused_kernel(q, scale, softcap, (k, v, out, dout), lse=lse)
    if kernel is None:
        return definition.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale, window=window,
                                        softcap=softcap)
    blocks = _blocks(q, k, causal, window)
    if len(blocks) == 1 and blocks[0].seeing is None:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, None, scale)
        return as_layout_of(dq, q), as_layout_of(dk, k), as_layout_of(dv, v)
    dq = empty_like(q).zero_()
    dk = torch.zeros(k.shape, dtype=definition.opmath(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=definition.opmath(v), device=v.device)
    for block in blocks:
        if block.keys.stop == block.keys.start:
            continue
        rows, keys = block.rows, block.keys
        # a row that sees no key has lse -inf; the kernel takes exp(score - lse) with its scores -inf
        lse_b = lse[:, :, rows].masked_fill(~block.seeing, 0.0)
        dq_b, dk_b, dv_b = kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                           out[:, :, rows], lse_b, block.is_causal, block.mask, scale)
        dq[:, :, rows] = dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    return dq, as_layout_of(dk.to(k.dtype), k), as_layout_of(dv.to(v.dtype), v)
