"""Workloads to profile the attention kernels (GPU).

``python benchmarks/profile_attention.py ncu [D S [causal]]`` runs one forward + backward of
portable_ops (triton) and of SDPA's cuDNN backend at head dim D, sequence S (defaults 128, 4096), 16k
tokens per batch (B = 16384 / S), 16 heads, bf16, inside a cudaProfilerStart/Stop range, for Nsight Compute::

    PORTABLE_OPS_AUTOTUNE=0 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis --section SchedulerStats \\
        python benchmarks/profile_attention.py ncu

(autotuning off: under ncu every timed candidate would be profiled too; the first candidates
are the tuned ones at this shape). ``... decode B CACHE`` does the same for one decode call of each
(one new token for each of B sequences, 32 query heads over 8 KV heads, D 128, a CACHE-key cache).
``... host`` prints a cProfile of 500 decode calls (one token against a 4k cache, the same heads):
where the host time of a call goes.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops


def _decode_inputs(b: int, cache: int) -> tuple:
    """q, k, v of one new token for each of ``b`` sequences: 32 query heads over 8 KV heads, D 128, bf16."""
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 8, cache, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def host_profile(calls: int = 500) -> str:
    q, k, v = _decode_inputs(1, 4096)
    with torch.no_grad():
        for _ in range(20):
            portable_ops.attention(q, k, v, causal=True)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            portable_ops.attention(q, k, v, causal=True)
        profiler.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def _under_profiler(variants) -> None:
    for fn in variants:  # compile outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in variants:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def decode_under_profiler(b: int, cache: int) -> None:
    q, k, v = _decode_inputs(b, cache)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with torch.no_grad():
        _under_profiler((lambda: portable_ops.attention(q, k, v, causal=True), cudnn))


def kernels_under_profiler(b=4, h=16, s=4096, d=128, causal=False) -> None:
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    _under_profiler([lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), dout)
                     for fn in (lambda: portable_ops.attention(q, k, v, causal=causal), cudnn)])


if __name__ == "__main__":
    if sys.argv[1:] == ["host"]:
        print(host_profile())
    elif sys.argv[1:2] == ["ncu"] and len(sys.argv) in (2, 4, 5) and sys.argv[4:] in ([], ["causal"]):
        d, s = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 2 else (128, 4096)
        kernels_under_profiler(b=max(16384 // s, 1), s=s, d=d, causal=sys.argv[4:] == ["causal"])
    elif sys.argv[1:2] == ["decode"] and len(sys.argv) == 4 and all(a.isdigit() for a in sys.argv[2:]):
        decode_under_profiler(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(__doc__)
