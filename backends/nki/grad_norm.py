"""Global gradient norm in two phases, as NKI kernels.

Phase 1 (one launch per grad, on its ``[128, F]`` body and ``[T, 1]`` tail): per-partition
partial sums of squares (norm 2, fused into the Scalar Engine's activation reduce) or partial
max of ``|g|`` (norm inf), into a ``[P, 1]`` float32 HBM vector. Phase 2 (one launch): the
partials of all grads side by side as ``[128, n]``, reduced along the free axis (Vector
Engine), then across partitions (GpSimd ``tensor_partition_reduce``), then ``sqrt`` for norm 2.
The result stays on the device as a 0-dim float32 tensor: it is what the clip coefficient is
computed from and fed to the Adam kernel's hyperparameter tensor, with no host sync.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .compat import nki, nisa, nl
from .runtime import launch

F_TILE = 2048


def _accumulate(acc, grad, f0, fs, norm_inf):
    P = grad.shape[0]
    tile = nl.ndarray((P, fs), dtype=grad.dtype, buffer=nl.sbuf)
    nisa.dma_copy(tile, grad[0:P, f0:f0 + fs])
    work = nl.ndarray((P, fs), dtype=nl.float32, buffer=nl.sbuf)
    part = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if norm_inf:
        nisa.activation(work, op=nl.abs, data=tile)
        nisa.tensor_reduce(part, op=nl.maximum, data=work, axis=1, keepdims=True)
        nisa.tensor_tensor(acc, acc, part, op=nl.maximum)
    else:
        nisa.activation(work, op=nl.square, data=tile, reduce_op=nl.add, reduce_res=part,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_tensor(acc, acc, part, op=nl.add)


@nki.jit
def norm_partials_kernel(grad, norm_inf=False):
    """Per-partition partials of one ``[P, F]`` grad (P <= 128): sum of squares, or max |g|."""
    P, F_ = grad.shape
    out = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    n_full = F_ // F_TILE
    for t in nl.sequential_range(n_full):  # acc is carried from tile to tile
        _accumulate(acc, grad, t * F_TILE, F_TILE, norm_inf)
    if F_ % F_TILE:
        _accumulate(acc, grad, n_full * F_TILE, F_ % F_TILE, norm_inf)
    nisa.dma_copy(out, acc)
    return out


@nki.jit
def norm_finish_kernel(partials, norm_inf=False):
    """``[P, n]`` float32 partials -> ``[1, 1]`` norm: free-axis reduce, partition reduce, sqrt."""
    P, n = partials.shape
    op = nl.maximum if norm_inf else nl.add
    out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((P, 1), dtype=nl.float32, buffer=nl.sbuf)

    def chunk(f0, fs):
        tile = nl.ndarray((P, fs), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(tile, partials[0:P, f0:f0 + fs])
        part = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(part, op=op, data=tile, axis=1, keepdims=True)
        nisa.tensor_tensor(acc, acc, part, op=op)

    n_full = n // F_TILE
    for t in nl.sequential_range(n_full):
        chunk(t * F_TILE, F_TILE)
    if n % F_TILE:
        chunk(n_full * F_TILE, n % F_TILE)
    total = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(total, op=op, data=acc)
    if not norm_inf:
        nisa.activation(total, op=nl.sqrt, data=total)
    nisa.dma_copy(out, total)
    return out


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grad_norm_supports(call) -> list[str]:
    reasons = []
    norm_type = float(call["norm_type"])
    if not (norm_type == 2.0 or norm_type == math.inf):
        reasons.append(f"NKI grad_norm computes norm_type 2 and inf; got {norm_type:g}")
    bad = sorted({str(g.dtype).removeprefix("torch.") for g in call["grads"] if g.dtype not in SUPPORTED_DTYPES})
    if bad:
        reasons.append(f"NKI grad_norm takes float32, bfloat16 and float16 grads; got {', '.join(bad)} "
                       "(NeuronCore engines have no float64)")
    return reasons


def grad_norm(grads, norm_type):
    norm_inf = math.isinf(float(norm_type))
    device = grads[0].device
    partials = []
    for g in grads:
        n = g.numel()
        flat = g.reshape(-1)
        main = (n // 128) * 128
        if main:
            partials.append(launch(norm_partials_kernel, flat[:main].reshape(128, main // 128), norm_inf=norm_inf))
        if n - main:
            tail = launch(norm_partials_kernel, flat[main:].reshape(n - main, 1), norm_inf=norm_inf)
            partials.append(F.pad(tail, (0, 0, 0, 128 - (n - main))))  # zeros are neutral for sum and max|g|
    if not partials:
        return torch.zeros((), dtype=torch.float32, device=device)
    out = launch(norm_finish_kernel, torch.cat(partials, dim=1).contiguous(), norm_inf=norm_inf)
    return out.reshape(())
