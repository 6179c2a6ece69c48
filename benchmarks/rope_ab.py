"""RoPE on a GPU: the triton kernel (forward, backward, in place) against torch's eager transformers formula and
``torch.compile`` of it, on q and k sliced from one fused projection and transposed, bf16, with float32 tables
(autocast's mix) and bf16 ones. Device time per call (CUDA events over many calls) and the bytes it must move.

``python benchmarks/rope_ab.py [BLOCK_S,HEADS,NUM_WARPS ...]`` (a GPU; under a minute a config).
"""

from __future__ import annotations

import sys

import torch

import portable_ops
from portable_ops.bench.common import device_info, table

SHAPES = {  # name: (B, S, Hq, Hk, D)
    "d1024 hd64 s2048 (train shape 1)": (4, 2048, 16, 4, 64),
    "d2048 hd128 s4096 (train shape 2)": (2, 4096, 16, 8, 128),
    "llama-8b hd128 s8192": (1, 8192, 32, 8, 128),
}


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def transformers_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _time(fn, iters=50, graph=True):
    """Device time per call in us: replays of a CUDA graph of ``iters`` calls (no host time), or, with
    ``graph=False``, back-to-back eager calls (host time shows where it exceeds the kernels')."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def run(configs=None) -> list[dict]:
    """``configs``: (BLOCK_S, HEADS, NUM_WARPS) of the triton kernel, each timed (default: the kernel's own)."""
    from portable_ops.backends.triton import rope as kernel

    configs = configs or [(kernel.BLOCK_S, kernel.HEADS, kernel.NUM_WARPS)]
    rows = []
    compiled = torch.compile(transformers_rope, dynamic=False)
    for name, (b, s, hq, hk, d) in SHAPES.items():
        for table_dtype, config in [(t, c) for t in (torch.bfloat16, torch.float32) for c in configs]:
            kernel.BLOCK_S, kernel.HEADS, kernel.NUM_WARPS = config
            qkv = torch.randn(b, s, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
            q, k, _ = qkv.view(b, s, hq + 2 * hk, d).split([hq, hk, hk], dim=2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            pos = torch.arange(s, device="cuda", dtype=torch.float32)
            freqs = pos[:, None] * 10000.0 ** (-torch.arange(0, d, 2, device="cuda") / d)
            emb = torch.cat((freqs, freqs), -1)[None]
            cos, sin = emb.cos().to(table_dtype), emb.sin().to(table_dtype)
            dq, dk = torch.randn_like(q), torch.randn_like(k)
            moved = 2 * (q.numel() + k.numel()) * 2  # read and write q and k, bf16
            ops = torch.ops.portable_ops
            qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()

            def fwd_bwd(rope):
                with torch.enable_grad():
                    torch.autograd.backward(rope(qg, kg, cos, sin), (dq, dk))
                qg.grad = kg.grad = None

            times = {
                "ours fwd+bwd, eager calls": _time(lambda: fwd_bwd(portable_ops.rope), graph=False),
                "torch eager fwd+bwd, eager calls": _time(lambda: fwd_bwd(transformers_rope), graph=False),
                "ours fwd, eager calls": _time(lambda: portable_ops.rope(q, k, cos, sin), graph=False),
                "ours fwd": _time(lambda: portable_ops.rope(q, k, cos, sin)),
                "ours bwd": _time(lambda: ops.rope_bwd(dq, dk, cos, sin, False)),
                "ours in place": _time(lambda: portable_ops.rope_(q, k, cos, sin)),
                "torch eager fwd": _time(lambda: transformers_rope(q, k, cos, sin)),
                "torch compiled fwd": _time(lambda: compiled(q, k, cos, sin)),
            }
            for label, us in times.items():
                rows.append({"shape": name, "tables": str(table_dtype).removeprefix("torch."), "call": label,
                             "config": config, "us": us, "GB/s": moved / us / 1e3})
    return rows


if __name__ == "__main__":
    with torch.no_grad():
        configs = [tuple(int(n) for n in c.split(",")) for c in sys.argv[1:]]
        print(table(run(configs), ["shape", "tables", "config", "call", "us", "GB/s"]))
    info = device_info()
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}")
