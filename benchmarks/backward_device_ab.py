"""The triton backward's device time on four shapes, one tree a process (GPU; ~15 s a process).

``PYTHONPATH=<tree> python benchmarks/backward_device_ab.py``, alternately from two trees, to compare their
device time: ``attention_bwd`` (delta pass, dQ's zeroing and cast included), steady (30 calls back to back,
best of 5) and replayed from a CUDA graph (the same), bf16, q/k/v transposed out of [B, S, H, D].
"""
import importlib

import torch

import portable_ops
from portable_ops.bench.common import graphed, steady_ms

backend = importlib.import_module("portable_ops.backends.triton.attention")
print("tree", portable_ops.__file__)
for b, s, h, hkv, d, causal in [(4, 2048, 16, 4, 64, True), (2, 4096, 16, 8, 128, True), (4, 4096, 16, 16, 128, False),
                                (16, 1024, 16, 4, 64, True)]:
    def make(n):
        return torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = (make(n) for n in (h, hkv, hkv))
    dout = make(h)
    out, lse = backend.attention_fwd(q, k, v, causal=causal, scale=d ** -0.5)

    def step():
        return backend.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=d ** -0.5)

    step()
    replay = graphed(step)
    steady = min(steady_ms(step, iters=30) for _ in range(5))
    graph = min(steady_ms(replay, iters=30) for _ in range(5))
    print(f"B{b} S{s} H{h}/{hkv} D{d} {'causal' if causal else 'full'}: steady {steady * 1e3:8.1f} us  "
          f"graph {graph * 1e3:8.1f} us")
