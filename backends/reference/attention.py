"""Dense attention through torch's own fused kernels: the ones ``F.scaled_dot_product_attention``
picks on this device, called through the aten ops that also return the log-sum-exp and take it
back in the backward.

A call maps onto them when the device type has such a kernel for its dtype and head dim
(:data:`FUSED_KERNELS`), it has no softcap, one head dim for q, k and v, and its scale is above zero. A
plain or square causal call, and a single query (decode) against the span of keys it sees, run as one kernel call. Where
the kernel takes an additive mask (the CPU's), a window or causal with ``Sq != Skv`` (bottom-right;
masks are the definition's ``visible``) runs one query block at a time against the keys that block
can see, under a mask of that block's size, so memory never grows as ``Sq x Skv``. Every other call
(a softcap, a mask the kernel does not take, a device with no fused kernel, an empty tensor, mixed
dtypes) runs the definition, blocked too. Sinks are added to a fused kernel's result afterwards
(:func:`with_sinks`), and its backward takes that result as it is: the probabilities it recomputes from the
sunk lse, and its rowsum(dout * out), are then the sunk ones."""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch.nn.attention import SDPBackend

from portable_ops.definitions import attention as definition
from portable_ops.layout import as_layout_of, empty_like

aten = torch.ops.aten  # the backward ops; the forward ones through torch's C bindings, a few us a call less
MASK_BUDGET = 1 << 22  # elements of one query block's additive mask
MIN_BLOCK_ROWS = 128


class Kernel(NamedTuple):
    """One fused attention kernel: ``forward(q, k, v, is_causal, mask, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, is_causal, mask, scale) -> (dq, dk, dv)``, top-left causal, GQA
    taken as it comes (``k``, ``v`` with fewer heads than ``q``), each tensor's last dim dense.
    ``rereads_kv``: it reads (or copies) a KV head once for each query head of its group, where a decode call's
    group is better run as rows of its KV head."""

    forward: Callable
    backward: Callable
    rereads_kv: bool = False


class FusedKernel(NamedTuple):
    """One device type's fused attention: ``pick(q, k, v, is_causal, scale)``, the :class:`Kernel` for these
    tensors (last dims dense) and options; the dtypes it takes, whether it takes an additive mask, and
    ``takes(tensors)``: whether it takes these tensors' head dim."""

    pick: Callable
    dtypes: tuple[torch.dtype, ...]
    masks: bool
    takes: Callable


def _unit_stride(*tensors):
    """The tensors with their last dim dense, as torch's kernels read them (SDPA copies the same way)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _cpu_forward(q, k, v, is_causal, mask, scale):
    return torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                     attn_mask=mask, scale=scale)


CPU_KERNEL = Kernel(_cpu_forward, _cpu_backward, rereads_kv=True)


@functools.cache
def _stand_ins(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The RNG state arguments of the CUDA kernels' backward, which none of them reads without dropout."""
    return (torch.empty(0, dtype=torch.int64, device=device), torch.empty(2, dtype=torch.uint64, device=device),
            torch.empty((), dtype=torch.uint64, device=device))


def _out_as(out, dout):
    """``out`` with ``dout``'s strides, as the CUDA kernels' backward reads it."""
    return out if out.stride() == dout.stride() else torch.empty_like(dout).copy_(out)


def _cudnn_forward(q, k, v, is_causal, mask, scale):
    out, lse, *_ = torch._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
    return out, lse.view(lse.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    seed = _stand_ins(q.device)[0]
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, _out_as(out, dout), lse.contiguous()[..., None], seed, seed, None, None, None, q.shape[2],
        k.shape[2], 0.0, is_causal, scale=scale)


def _flash_forward(q, k, v, is_causal, mask, scale):
    out, lse, *_ = torch._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    _, rng_state, unused = _stand_ins(q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, _out_as(out, dout), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal,
        rng_state, unused, scale=scale)


def _groups_repeated(q, k, v):
    """``k``, ``v`` with each KV head repeated for its query heads (the memory-efficient kernel's aten ops take
    equal head counts)."""
    groups = q.shape[1] // k.shape[1]
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))


def _groups_summed(d, hkv):
    """The inverse of :func:`_groups_repeated` for a gradient: each KV head's query-head copies summed."""
    b, hq, s, dim = d.shape
    return d if hq == hkv else d.view(b, hkv, hq // hkv, s, dim).sum(2)


def _efficient_forward(q, k, v, is_causal, mask, scale):
    k, v = _groups_repeated(q, k, v)
    out, lse, _, _ = torch._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
    return out, lse[..., :q.shape[2]]


def _heads_inner(t):
    """``t`` laid out as ``[B, S, H, D]`` in memory, as the memory-efficient kernel's forward writes its out: its
    backward misreads a half-precision out in any other layout."""
    b, h, s, d = t.shape
    strides = (s * h * d, d, h * d, 1)
    return t if t.stride() == strides else torch.empty_strided(t.shape, strides, dtype=t.dtype,
                                                               device=t.device).copy_(t)


def _efficient_backward(dout, q, k, v, out, lse, is_causal, mask, scale):
    hkv, sq = k.shape[1], q.shape[2]
    k, v = _groups_repeated(q, k, v)
    # each head's lse at a stride of Sq rounded up to 32, as the forward wrote it; +inf rows add nothing
    padded = lse.new_full((*lse.shape[:-1], -(-sq // 32) * 32), float("inf"))
    padded[..., :sq] = lse
    unused = torch.empty(0, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, _heads_inner(out), padded[..., :sq], unused, unused, 0.0, [True, True, True, False],
        is_causal, scale=scale)
    return dq, _groups_summed(dk, hkv), _groups_summed(dv, hkv)


# cuDNN's and FlashAttention-2's aten ops take GQA as it comes; the memory-efficient kernel's get k, v repeated
CUDA_KERNELS = {int(SDPBackend.CUDNN_ATTENTION): Kernel(_cudnn_forward, _cudnn_backward),
                int(SDPBackend.FLASH_ATTENTION): Kernel(_flash_forward, _flash_backward)}
EFFICIENT_KERNEL = Kernel(_efficient_forward, _efficient_backward, rereads_kv=True)


def _cuda_pick(q, k, v, is_causal, scale):
    """The kernel SDPA picks for these tensors (the backward's pick is the forward's: the same tensors)."""
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return CUDA_KERNELS.get(choice, EFFICIENT_KERNEL)


def _cuda_takes(tensors):
    head_dim = tensors[0].shape[-1]
    return head_dim % 8 == 0 and head_dim <= 256


FUSED_KERNELS = {
    "cpu": FusedKernel(lambda *_: CPU_KERNEL, (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                       masks=True, takes=lambda tensors: True),
    # the CUDA kernels' backward with an additive mask disagreed with the definition: masked calls run it
    "cuda": FusedKernel(_cuda_pick, (torch.float32, torch.bfloat16, torch.float16), masks=False, takes=_cuda_takes),
}


class Block(NamedTuple):
    """Query rows ``rows`` and the key span ``keys`` they see, with the additive mask over that span and
    which of the rows see at least one key; an empty span for rows that see none."""

    rows: slice
    keys: slice
    mask: torch.Tensor | None
    seeing: torch.Tensor | None


def _fused_kernel(q, scale, softcap, tensors, lse=None):
    """The device's fused kernel where it computes this call, else None. It takes ``tensors`` all of q's
    dtype (a backward may see q's ``.data`` swapped since the forward) and head dim (``tensors[1]`` is v: the
    kernels take one head dim). A scale of zero or below is left to the definition: the CPU kernel gives NaN
    for it in float16."""
    kernel = FUSED_KERNELS.get(q.device.type)
    if kernel is None or softcap is not None or scale <= 0 or q.dtype not in kernel.dtypes or q.numel() == 0:
        return None
    if tensors[1].shape[-1] != q.shape[-1]:
        return None
    if {t.dtype for t in tensors} != {q.dtype} or not all(t.numel() for t in tensors):
        return None
    if not kernel.takes((q, *tensors)) or (lse is not None and lse.dtype != definition.opmath(q)):
        return None
    return kernel


def _sides(causal, window):
    """How far before and after its own position a query sees (None: unbounded), causal folded in."""
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _whole(q, k, causal, window):
    """``(is_causal, keys)`` for a call the kernel runs whole over the keys ``keys``, without a mask: no window
    (causal when square), or one query (decode), which sees one span of keys; else None."""
    sq, skv = q.shape[2], k.shape[2]
    left, right = _sides(causal, window)
    if left is None and (right is None or (right == 0 and sq == skv)):
        return right == 0, slice(0, skv)
    if sq == 1:
        first = 0 if left is None else max(0, skv - 1 - left)
        last = skv if right is None else min(skv, skv + right)
        if last > first:
            return False, slice(first, last)
    return None


def _blocks(q, k, causal, window):
    """The query blocks a masked call runs as, each with its key span and mask."""
    sq, skv = q.shape[2], k.shape[2]
    left, right = _sides(causal, window)
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
            blocks.append(Block(slice(start, end), slice(0, 0), None, None))
            continue
        seen = definition.visible(torch.arange(start, end, device=q.device) + shift,
                                  torch.arange(first, last, device=q.device), causal, window)
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        blocks.append(Block(slice(start, end), slice(first, last), mask, seen.any(-1)))
    return blocks


def with_sinks(out, lse, sinks):
    """A result computed without sinks, with them: each row's denominator gains ``exp(sink)``, so its lse becomes
    ``logaddexp(lse, sink)`` and its output shrinks by ``exp(lse - that)`` (0 on a row that sees no key)."""
    if sinks is None:
        return out, lse
    sunk = torch.logaddexp(lse, sinks[:, None])
    return out.mul_(torch.exp(lse - sunk)[..., None]), sunk


def _sink_gradient(out, lse, dout, sinks):
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return definition.sink_gradient(sinks, lse, delta)


def _whole_forward(fused, q, k, v, is_causal, scale):
    """``(out, lse)`` of a call the kernel runs whole. One query (decode) of several heads a KV head runs as that
    KV head's rows, ``[B, Hkv, Hq / Hkv, D]``, not masked (it sees every key given), where the kernel would
    read the KV head once for each of them (:attr:`Kernel.rereads_kv`)."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    q_u, k_u, v_u = _unit_stride(q, k, v)
    kernel = fused.pick(q_u, k_u, v_u, is_causal, scale)
    if sq == 1 and hq != hkv and not is_causal and kernel.rereads_kv:
        out, lse = kernel.forward(q_u.view(b, hkv, hq // hkv, d), k_u, v_u, False, None, scale)
        return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)
    return kernel.forward(q_u, k_u, v_u, is_causal, None, scale)


def attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    fused = _fused_kernel(q, scale, softcap, (k, v))
    whole = None if fused is None else _whole(q, k, causal, window)
    if whole is not None:
        is_causal, keys = whole
        out, lse = _whole_forward(fused, q, k[:, :, keys], v[:, :, keys], is_causal, scale)
        return with_sinks(as_layout_of(out, q), lse.contiguous(), sinks)
    if fused is None or not fused.masks:
        return definition.attention_fwd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                        sinks=sinks)
    out = empty_like(q).zero_()
    lse = torch.full(q.shape[:3], float("-inf"), dtype=definition.opmath(q), device=q.device)
    q_u, k_u, v_u = _unit_stride(q, k, v)
    for block in _blocks(q, k, causal, window):
        if block.mask is None:
            continue
        q_b, k_b, v_b = q_u[:, :, block.rows], k_u[:, :, block.keys], v_u[:, :, block.keys]
        out_b, lse_b = fused.pick(q_b, k_b, v_b, False, scale).forward(q_b, k_b, v_b, False, block.mask, scale)
        out[:, :, block.rows] = out_b * block.seeing[:, None]  # the kernel's rows that see no key: zero
        lse[:, :, block.rows] = lse_b.masked_fill(~block.seeing, float("-inf"))
    return with_sinks(out, lse, sinks)


def prepare_attention_fwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_fwd`` without sinks for every call of this one's layout and options (``OpImpl.prepare``):
    ``run(q, k, v)``, its checks and span of keys found here, once (the kernel is picked per call, as SDPA's
    switches may change)."""
    fused = _fused_kernel(q, scale, softcap, (k, v))
    whole = None if fused is None else _whole(q, k, causal, window)
    if whole is None:
        return functools.partial(attention_fwd, causal=causal, scale=scale, window=window, softcap=softcap)
    is_causal, keys = whole
    every_key = keys == slice(0, k.shape[2])

    def run(q, k, v):
        if not every_key:
            k, v = k[:, :, keys], v[:, :, keys]
        out, lse = _whole_forward(fused, q, k, v, is_causal, scale)
        return as_layout_of(out, q), lse.contiguous()

    return run


def _over_keys(d, t, keys):
    """A key gradient over the span ``keys`` as one over all of ``t``'s keys, in ``t``'s layout."""
    if keys == slice(0, t.shape[2]):
        return as_layout_of(d, t)
    whole = empty_like(t, dtype=d.dtype).zero_()
    whole[:, :, keys] = d
    return whole


def attention_bwd(q, k, v, out, lse, dout, *, causal, scale, window=None, softcap=None, sinks=None, dlse=None):
    """``(dq, dk, dv)``, and ``dsinks`` after them when there are sinks. A gradient through lse (``dlse``) runs
    the definition: the fused kernels take none."""
    grads = None if dlse is not None else _fused_bwd(q, k, v, out, lse, dout, causal, scale, window, softcap)
    if grads is None:
        return definition.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale, window=window,
                                        softcap=softcap, sinks=sinks, dlse=dlse)
    return grads if sinks is None else (*grads, _sink_gradient(out, lse, dout, sinks))


def _fused_bwd(q, k, v, out, lse, dout, causal, scale, window, softcap):
    """The fused kernel's ``(dq, dk, dv)``, None where it does not compute this call."""
    fused = _fused_kernel(q, scale, softcap, (k, v, out, dout), lse=lse)
    whole = None if fused is None else _whole(q, k, causal, window)
    if whole is not None:
        is_causal, keys = whole
        q_u, k_u, v_u, out, dout = _unit_stride(q, k[:, :, keys], v[:, :, keys], out, dout)
        kernel = fused.pick(q_u, k_u, v_u, is_causal, scale)
        dq, dk, dv = kernel.backward(dout, q_u, k_u, v_u, out, lse, is_causal, None, scale)
        return as_layout_of(dq, q), _over_keys(dk, k, keys), _over_keys(dv, v, keys)
    if fused is None or not fused.masks:
        return None
    q_u, k_u, v_u, out, dout = _unit_stride(q, k, v, out, dout)
    dq = empty_like(q).zero_()
    dk = torch.zeros(k.shape, dtype=definition.opmath(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=definition.opmath(v), device=v.device)
    for block in _blocks(q, k, causal, window):
        if block.mask is None:
            continue
        rows, keys = block.rows, block.keys
        q_b, k_b, v_b = q_u[:, :, rows], k_u[:, :, keys], v_u[:, :, keys]
        # a row that sees no key has lse -inf; the kernel takes exp(score - lse) with its scores -inf
        lse_b = lse[:, :, rows].masked_fill(~block.seeing, 0.0)
        dq_b, dk_b, dv_b = fused.pick(q_b, k_b, v_b, False, scale).backward(
            dout[:, :, rows], q_b, k_b, v_b, out[:, :, rows], lse_b, False, block.mask, scale)
        dq[:, :, rows] = dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    return dq, as_layout_of(dk.to(k.dtype), k), as_layout_of(dv.to(v.dtype), v)


def prepare_attention_bwd(q, k, v, *, causal, scale, window=None, softcap=None):
    """``attention_bwd`` without sinks for every call whose q, k and v have this one's layout and whose options
    are these (``OpImpl.prepare``): ``run(q, k, v, out, lse, dout)``, its checks and span of keys found here, once; an
    out, lse or dout of another dtype than the forward gives (a ``.data`` swap) takes the checked path."""
    fused = _fused_kernel(q, scale, softcap, (k, v))
    whole = None if fused is None else _whole(q, k, causal, window)
    general = functools.partial(attention_bwd, causal=causal, scale=scale, window=window, softcap=softcap)
    if whole is None:
        return general
    is_causal, keys = whole
    every_key = keys == slice(0, k.shape[2])
    dtype, lse_dtype = q.dtype, definition.opmath(q)

    def run(q, k, v, out, lse, dout):
        if out.dtype != dtype or dout.dtype != dtype or lse.dtype != lse_dtype:
            return general(q, k, v, out, lse, dout)
        k_s, v_s = (k, v) if every_key else (k[:, :, keys], v[:, :, keys])
        q_u, k_u, v_u, out, dout = _unit_stride(q, k_s, v_s, out, dout)
        kernel = fused.pick(q_u, k_u, v_u, is_causal, scale)
        dq, dk, dv = kernel.backward(dout, q_u, k_u, v_u, out, lse, is_causal, None, scale)
        return as_layout_of(dq, q), _over_keys(dk, k, keys), _over_keys(dv, v, keys)

    return run
