"""Argument checks of ``rope`` and ``rope_`` (``portable_ops/checks.py`` holds the other ops').

They run before any backend is chosen, and name the argument at fault; ``rope_`` refuses before anything is
written.
"""

from __future__ import annotations

import torch

from .checks import plain
from .norm_checks import check_float_tensor

_QK_LAYOUT = "[batch, heads, seq, head_dim]"


def check_rope(op: str, q, k, cos, sin, interleaved) -> bool:
    """q ``[B, Hq, S, D]`` and k ``[B, Hk, S, D]`` of one floating dtype; cos and sin ``[S, R]`` or ``[B or 1, S, R]``,
    one floating dtype (any: float32 tables beside bfloat16 q and k are autocast's mix), R even and at most D; all
    on q's device. Returns ``interleaved`` as a bool. cos and sin take no gradient: one that requires it is refused
    while grad mode is on."""
    for arg, t in (("q", q), ("k", k)):
        check_float_tensor(op, arg, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: {arg} must have 4 dimensions {_QK_LAYOUT}, got shape {tuple(t.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if k.device != q.device:
        raise ValueError(f"{op}: k is on {k.device} but q is on {q.device}")
    b, _, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"{op}: k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; they must share batch, seq "
                         f"and head_dim {_QK_LAYOUT} (the head counts may differ)")
    for arg, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(op, arg, t)
        if t.device != q.device:
            raise ValueError(f"{op}: {arg} is on {t.device} but q is on {q.device}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"{op}: sin is {sin.dtype} of shape {tuple(sin.shape)} but cos is {cos.dtype} of shape "
                         f"{tuple(cos.shape)}; they must match")
    if cos.dim() not in (2, 3) or (cos.dim() == 3 and cos.shape[0] not in (1, b)):
        raise ValueError(f"{op}: cos must be [seq, rotary_dim] or [batch (or 1), seq, rotary_dim] with batch {b} "
                         f"(q's), got shape {tuple(cos.shape)}")
    if cos.shape[-2] != s:
        raise ValueError(f"{op}: cos has {cos.shape[-2]} positions (its dim -2) but q has seq {s}; they must match")
    r = cos.shape[-1]
    if r % 2 or r > d:
        raise ValueError(f"{op}: cos's last dim, the rotary dims R, is {r}; R must be even and at most head_dim {d} "
                         f"(the first R dims of each head are rotated)")
    interleaved = plain(interleaved)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: interleaved must be a bool, got {type(interleaved).__name__}")
    if torch.is_grad_enabled():
        for arg, t in (("cos", cos), ("sin", sin)):
            if t.requires_grad:
                raise RuntimeError(f"{op}: {arg} requires grad, but rope differentiates q and k only (cos and sin are "
                                   f"position tables): pass {arg}.detach(), or compute it under torch.no_grad()")
    return interleaved


def check_rope_inplace(q, k) -> None:
    """What ``rope_`` writes: q and k, which take no gradient through it (torch refuses an in-place write to a leaf
    that requires grad; rope_ refuses any tensor that requires grad while grad mode is on)."""
    if torch.is_grad_enabled():
        for arg, t in (("q", q), ("k", k)):
            if t.requires_grad:
                raise RuntimeError(f"rope_: {arg} requires grad, and rope_ writes it in place with no gradient: use "
                                   f"portable_ops.rope (differentiable), or call rope_ under torch.no_grad()")


def check_writable(q, k) -> None:
    """What torch's in-place ops refuse and a kernel's raw pointers would not: elements sharing memory (an expanded
    view), q and k at the same memory (each rotated twice), an inference tensor written outside inference mode.
    Not traceable: eager calls check here, compiled graphs in the custom op as it runs."""
    q, k = _written(q), _written(k)
    for arg, t in (("q", q), ("k", k)):
        if torch._debug_has_internal_overlap(t) == 1:  # 0 no, 1 yes, 2 can't tell
            raise ValueError(f"rope_: {arg} has elements that share memory (an expanded view, strides "
                             f"{tuple(t.stride())}); rope_ writes every element: pass a tensor of its own (.clone())")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"rope_: {arg} was made under torch.inference_mode(), and torch lets an inference "
                               f"tensor be written in place only inside it: call rope_ under torch.inference_mode() "
                               f"too")
    if q.numel() and k.numel() and _share_an_element(q, k):
        raise ValueError("rope_: q and k share memory (an element of one is an element of the other); rope_ would "
                         "rotate it twice: pass q and k that share no element (slices of one fused projection are "
                         "fine)")


# Past this many elements, q and k of different strides in one storage are taken as disjoint unchecked
_ELEMENTS_SET_CHECKED = 1 << 22


def _share_an_element(q, k) -> bool:
    """Whether q and k, of one storage, have an element in common: exactly for equal strides (every slice of a
    fused projection, whatever the head counts), by their element sets up to ``_ELEMENTS_SET_CHECKED`` elements
    otherwise."""
    if q.device != k.device or _storage_start(q) != _storage_start(k):
        return False
    spans = [(t.storage_offset(), t.storage_offset() + _reach(t.shape, t.stride())) for t in (q, k)]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    if q.stride() == k.stride() and q.dim() == k.dim():
        dims = sorted(zip(q.stride(), q.shape, k.shape), reverse=True)
        return _meet(k.storage_offset() - q.storage_offset(), dims)
    if q.numel() + k.numel() > _ELEMENTS_SET_CHECKED:
        return False
    offsets = [torch.as_strided(torch.arange(end + 1), t.shape, t.stride(), t.storage_offset()).flatten()
               for t, (_, end) in zip((q, k), spans)]
    return bool(torch.isin(offsets[0], offsets[1]).any())


def _storage_start(t) -> int:
    """The address of ``t``'s storage, from its own pointer (wrapper tensors of other device types have no storage
    of their own to ask)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _reach(shape, stride) -> int:
    return sum((n - 1) * s for n, s in zip(shape, stride))


def _meet(delta: int, dims: list) -> bool:
    """Whether ``delta`` is ``sum(d_j * stride_j)`` with ``-(k_size_j - 1) <= d_j <= q_size_j - 1`` (``dims``:
    (stride, q's size, k's size), largest stride first): q's element at index i and k's at index l are one
    element when ``delta = sum((i_j - l_j) * stride_j)``, k's start less q's being ``delta``."""
    if not dims:
        return delta == 0
    (stride, q_size, k_size), rest = dims[0], dims[1:]
    if stride == 0:
        return _meet(delta, rest)
    up = sum((qn - 1) * s for s, qn, _ in rest)  # what the smaller strides can add to a difference, and take
    down = sum((kn - 1) * s for s, _, kn in rest)
    low = max(-(k_size - 1), -((up - delta) // stride))
    high = min(q_size - 1, (delta + down) // stride)
    return any(_meet(delta - d * stride, rest) for d in range(low, high + 1))


def _written(t):
    """The tensor whose memory a write to ``t`` changes: under torch.func transforms, the one ``t`` wraps (a vmap's
    batch of them), which torch's internal-overlap check can take."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t
