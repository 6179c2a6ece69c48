"""Host time of the training bench's attention backward (shape 1), layer by layer, against SDPA's (GPU).

``PYTHONPATH=$PWD python docs/perf/backward_host_layers.py`` (an H100; under a minute). Shape 1's
attention: batch 4, 2048 tokens, 16 query heads over 4 KV heads, head dim 64, causal, bf16, q/k/v
transposed out of [B, S, H, D]. Each figure is the median host time of one call with the device
drained before it (the kernels outlast the host path, so back-to-back calls would time the
device), over 30 calls, the rows' calls interleaved. A layer's row includes the rows below it that
it calls.
"""

from __future__ import annotations

import importlib
import statistics
import time

import torch
import torch.nn.functional as F

import portable_ops
from portable_ops.bench.common import device_info

CALLS = 30


def drained_us(rows: dict) -> dict:
    for fn in rows.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in rows}
    for _ in range(CALLS):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            start = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    api = importlib.import_module("portable_ops.attention")
    backend = importlib.import_module("portable_ops.backends.triton.attention")
    sm90 = importlib.import_module("portable_ops.backends.triton.attention_sm90")
    b, s, h, hkv, d = 4, 2048, 16, 4, 64
    make = lambda heads: torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = (make(n).requires_grad_() for n in (h, hkv, hkv))
    dout = make(h)
    scale = d ** -0.5
    out = portable_ops.attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad():
        out_, lse = backend.attention_fwd(q, k, v, causal=True, scale=scale)
    rows = {
        "torch.autograd.grad through portable_ops.attention": lambda: torch.autograd.grad(
            out, (q, k, v), dout, retain_graph=True),
        "  api.backward (dispatch, then the backend)": lambda: api.backward(q, k, v, out_, lse, dout, True, scale),
        "    backend attention_bwd": lambda: backend.attention_bwd(q, k, v, out_, lse, dout, causal=True, scale=scale),
        "torch.autograd.grad through SDPA": lambda: torch.autograd.grad(ref, (q, k, v), dout, retain_graph=True),
        "torch.empty_strided (one)": lambda: torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device),
        "torch.zeros float32 like q (one)": lambda: torch.zeros(q.shape, dtype=torch.float32, device=q.device),
    }
    with torch.no_grad():
        backend._bwd_plans.clear()
        backend.attention_bwd(q, k, v, out_, lse, dout, causal=True, scale=scale)
        (plan,) = backend._bwd_plans.values()
        if plan.hopper is not None:
            delta, dq, dk, dv = backend._bwd_buffers(plan, q, k, v)
            rows["      delta launch"] = lambda: plan.delta(out_, dout, delta, *plan.delta_args)
            rows["      attention_sm90.backward (zeros, launch, copy)"] = lambda: sm90.backward(
                plan.hopper, q, k, v, dout, lse, delta, dq, dk, dv, scale)
            rows["      _bwd_buffers (four allocations)"] = lambda: backend._bwd_buffers(plan, q, k, v)
        got = drained_us(rows)
    info = device_info()
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}")
    print(f"B {b}, S {s}, {h} query heads over {hkv} KV heads, D {d}, causal, bf16: median host us of one call, drained")
    for name, us in got.items():
        print(f"{name:58s} {us:7.1f}")


if __name__ == "__main__":
    main()
