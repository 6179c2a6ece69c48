"""Global gradient norm (2 or inf) of every grad of a step in one NKI kernel launch.

The kernel walks the grads as a table (``tensor_table``, as ``adam.py`` does): each grad's ``[128, F]`` body
in ``[128, 2048]`` tiles, and the ``n % 128`` leftovers gathered one grad per partition into zero-filled tail
tiles, one dtype to a tile (zeros are neutral for a sum of squares and for max |g|). Tiles stay in their grads'
dtypes (DMAs do not convert; the engines read any dtype). Each tile adds to a ``[128, 1]`` float32
accumulator: the sum of squares (Scalar Engine activation with its add-reduction), or max |g|. At the end the
partitions are reduced on GpSimd (``tensor_partition_reduce``) and the 2-norm takes its ``sqrt`` through
``exact_roots`` (the Scalar Engine's sqrt is valid on [2^-116, 2^118]: a zero, tiny, huge, infinite or NaN sum
gets torch's root, exactly). The result stays on the device as a 0-dim float32 tensor: the clip coefficient is
computed from it and fed to the Adam kernel's hyperparameters, with no host sync.

NaN: a NaN grad must give a NaN norm, as in torch. The sum of squares propagates it by IEEE
arithmetic. The max does not have to: the NKI docs do not say what the engines' ``maximum``
does with NaN, so the inf-norm counts NaNs explicitly (``x != x``) and writes NaN over the
result when it saw one (tests run it under the emulator's NaN-dropping max too).
"""

from __future__ import annotations

import math

import torch

from . import exact_roots, tensor_table
from .compat import nki, nisa, nl
from .runtime import kernel_op, launch

PMAX = 128
F_TILE = 2048  # 8 KiB fp32 DMA payloads


def _accumulate(tile, shape, acc, nans, norm_inf):
    """Add one loaded tile (any float dtype) to the ``[128, 1]`` accumulators (first ``rows`` partitions)."""
    rows = shape[0]
    part = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    if norm_inf:
        flags = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)  # 1.0 where NaN
        nisa.tensor_tensor(dst=flags, data1=tile, data2=tile, op=nl.not_equal, engine=nisa.engine.gpsimd)
        nisa.tensor_reduce(dst=part, op=nl.maximum, data=flags, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=nans[0:rows, 0:1], data1=nans[0:rows, 0:1], data2=part, op=nl.maximum)
        nisa.activation(dst=tile, op=nl.abs, data=tile)
        nisa.tensor_reduce(dst=part, op=nl.maximum, data=tile, axis=1, keepdims=True)
        nisa.tensor_tensor(dst=acc[0:rows, 0:1], data1=acc[0:rows, 0:1], data2=part, op=nl.maximum)
    else:
        nisa.activation(dst=tile, op=nl.square, data=tile, reduce_op=nl.add, reduce_res=part,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_tensor(dst=acc[0:rows, 0:1], data1=acc[0:rows, 0:1], data2=part, op=nl.add)


@nki.jit
def norm_kernel(grads, norm_inf=False):
    """The ``[1, 1]`` float32 2-norm (or inf-norm) of a list of 1-D HBM grads taken together."""
    out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nans = nl.zeros((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf) if norm_inf else None
    table = (grads,)
    for i, g in enumerate(grads):
        for views, shape in tensor_table.body_tiles(table, i, F_TILE):
            _accumulate(tensor_table.load(views[0], g.dtype, shape), shape, acc, nans, norm_inf)
    for block in tensor_table.tail_blocks([g.shape[0] for g in grads], [g.dtype for g in grads]):
        views, shape = tensor_table.tail_tile(table, block)
        tile = nl.ndarray(shape, dtype=grads[block[0]].dtype, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=0.0)
        tensor_table.fill(tile, views[0])
        _accumulate(tile, shape, acc, nans, norm_inf)

    total = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(dst=total, op=nl.maximum if norm_inf else nl.add, data=acc)
    if norm_inf:  # NaN over the result if any grad held one
        seen = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=seen, op=nl.maximum, data=nans)
        pred = nl.ndarray((1, 1), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=pred, src=seen)
        nisa.tensor_copy_predicated(dst=total, src=math.nan, predicate=pred)
    else:
        total = exact_roots.sqrt(total, 1)
    nisa.dma_copy(dst=out, src=total)
    return out


def _fake_norm(grads, norm_inf):
    return grads[0].new_empty((1, 1), dtype=torch.float32)


@kernel_op("grad_norm", _fake_norm)
def norm_op(grads: list[torch.Tensor], norm_inf: bool) -> torch.Tensor:
    """The kernel's launch as the op ``portable_ops_nki::grad_norm``: writes nothing it is given."""
    return launch(norm_kernel, grads, norm_inf=norm_inf)


def grad_norm(grads, norm_type):
    live = [tensor_table.flat(g) for g in grads if g.numel()]
    if not live:
        return torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    return norm_op(live, math.isinf(float(norm_type))).reshape(())
