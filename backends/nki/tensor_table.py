"""The table of tensors the optimizer and norm kernels walk, and how its tiles move between HBM and SBUF.

A step's tensors are separate allocations, so a kernel takes them as lists and walks them at specialization time
(NKI unrolls the loops): each tensor's flat HBM view gives a ``[128, F]`` body, walked in ``[128, f_tile]`` tiles,
and its ``n % 128`` leftover elements go, one tensor per partition, into tail tiles that tensors share. A tile holds
one dtype and DMAs move data as it is (no conversion: docs/backends/nki.md, "The emulator's rules"), so tensors
share a tail tile only when their dtypes match; the engines read any dtype and compute in float32, and a result
is converted to its tensor's dtype on an engine before it is stored.

A tile's ``views`` list, per kind of tensor (param, grad, moment, ...), ``(row, count, hbm_view)``: where each HBM
view lands in the tile (``row`` None: the whole tile).
"""

from __future__ import annotations

from .compat import nisa, nl

PMAX = 128


def tail_blocks(sizes, dtype_keys) -> list[list[int]]:
    """The tail tiles: lists of at most 128 indices of the tensors whose sizes are not multiples of 128, those of
    one ``dtype_keys`` value together, in order of first appearance. Kernel and host call it alike (the host to
    lay out per-tile hyperparameters), with the dtypes each sees."""
    groups = {}
    for i, (size, key) in enumerate(zip(sizes, dtype_keys)):
        if size % PMAX:
            groups.setdefault(key, []).append(i)
    return [group[b:b + PMAX] for group in groups.values() for b in range(0, len(group), PMAX)]


def body_tiles(tensors, i, f_tile):
    """``(views, shape)`` per tile of tensor ``i``'s ``[128, F]`` body; ``tensors`` lists the kinds' lists."""
    F = tensors[0][i].shape[0] // PMAX
    for f0 in range(0, F, f_tile):
        fs = min(f_tile, F - f0)
        yield [[(None, None, t[i][0:PMAX * F].reshape((PMAX, F))[0:PMAX, f0:f0 + fs])] for t in tensors], (PMAX, fs)


def tail_tile(tensors, block):
    """``(views, shape)`` of the tail tile of the tensors ``block`` (from :func:`tail_blocks`)."""
    views = [[] for _ in tensors]
    for r, i in enumerate(block):
        size = tensors[0][i].shape[0]
        start = size - size % PMAX
        for k, t in enumerate(tensors):
            views[k].append((r, size - start, t[i][start:size].reshape((1, size - start))))
    return views, (len(block), max(tensors[0][i].shape[0] % PMAX for i in block))


def _part(tile, row, count):
    return tile if row is None else tile[row:row + 1, 0:count]


def load(views, dtype, shape):
    """A new SBUF tile of ``dtype`` holding the HBM views."""
    tile = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    fill(tile, views)
    return tile


def fill(tile, views):
    """DMA the HBM views into their places in ``tile``."""
    for row, count, view in views:
        nisa.dma_copy(dst=_part(tile, row, count), src=view)


def store(tile, views):
    for row, count, view in views:
        nisa.dma_copy(dst=view, src=_part(tile, row, count))


def as_dtype(tile, dtype, negate=False, engine=nisa.engine.scalar):
    """``tile``, or a copy in ``dtype`` (one rounding, on ``engine``) when its dtype differs or ``negate`` asks for
    ``-tile`` (exact)."""
    if tile.dtype == dtype and not negate:
        return tile
    out = nl.ndarray(tile.shape, dtype=dtype, buffer=nl.sbuf)
    if negate:
        nisa.tensor_scalar(dst=out, data=tile, op0=nl.multiply, operand0=-1.0, engine=engine)
    else:
        nisa.tensor_copy(dst=out, src=tile, engine=engine)
    return out


def flat(t):
    """``t`` as one dense dim: a view of a contiguous tensor, which a kernel may write through, else a copy (a
    tensor only read; the ops decline a non-contiguous one they would write)."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def first_noncontiguous(call, keys) -> str | None:
    """``"key[i]"`` naming the first non-contiguous tensor of an optimizer call's lists ``keys``, and of its grads
    when the step scales them (``grad_scale`` or ``clip_coef`` set: the kernels write them back); None if none."""
    if call.get("grad_scale") is not None or call.get("clip_coef") is not None:
        keys = ("grads", *keys)
    return next((f"{key}[{i}]" for key in keys for i, t in enumerate(call[key]) if not t.is_contiguous()), None)
