"""The attention backward on Hopper, in one process: which kernel each case took, its gradients
against float64, and the time of ours (the Gluon kernel where it takes the call), the ``tl.*``
backward (``PORTABLE_OPS_SM90_ATTENTION=0``), cuDNN's and flash's (``torch.autograd.grad``
through SDPA) at B 4, H 16, S 4096.

``python benchmarks/backward_ab.py`` (an sm_90 GPU; about two minutes).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from portable_ops.definitions import attention as reference
from portable_ops.backends.triton import attention, attention_plans

from portable_ops.bench.common import device_info, steady_ms, table

# (B, Hq, Hkv, Sq, Skv, D, causal, q/k/v transposed out of [B, S, H, D])
CHECKS = [(2, 4, 4, 256, 256, 64, False, False), (1, 8, 2, 1000, 1000, 128, True, True),
          (2, 4, 1, 300, 777, 128, True, True), (1, 2, 2, 100, 100, 64, True, False),
          (3, 6, 3, 129, 200, 128, False, False), (2, 8, 2, 333, 517, 128, False, True)]
# (D, causal, Hkv) at B 4, Hq 16, S 4096
TIMED = [(128, False, 16), (128, True, 16), (128, True, 4), (128, False, 8), (64, True, 16), (64, True, 4),
         (64, False, 16)]


def _inputs(b, hq, hkv, sq, skv, d, heads_inner, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(h, s):
        if heads_inner:
            return torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).cuda().transpose(1, 2)
        return torch.randn(b, h, s, d, generator=g).to(torch.bfloat16).cuda()

    return make(hq, sq), make(hkv, skv), make(hkv, skv)


def check() -> list[dict]:
    rows = []
    for b, hq, hkv, sq, skv, d, causal, inner in CHECKS:
        q, k, v = _inputs(b, hq, hkv, sq, skv, d, inner)
        scale = 1 / math.sqrt(d)
        out, lse = attention.attention_fwd(q, k, v, causal=causal, scale=scale)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype).cuda()
        attention_plans.bwd_plans.clear()
        grads = attention.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale)
        plan = next(iter(attention_plans.bwd_plans.values()))
        q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
        ref_out, ref_lse = reference.attention_fwd(q64, k64, v64, causal=causal, scale=scale)
        ref = reference.attention_bwd(q64, k64, v64, ref_out, ref_lse, dout.double().cpu(), causal=causal, scale=scale)
        errors = [((g.double().cpu() - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref)]
        rows.append({"case": f"B{b} H{hq}/{hkv} S{sq}/{skv} D{d}{' causal' if causal else ''}",
                     "kernel": "gluon" if plan.hopper is not None else "tl",
                     **{f"{n} max err / max": f"{e:.1e}" for n, e in zip(("dq", "dk", "dv"), errors)}})
    return rows


def timed(b=4, h=16, s=4096) -> list[dict]:
    rows = []
    for d, causal, hkv in TIMED:
        q, k, v = _inputs(b, h, hkv, s, s, d, True)
        scale = 1 / math.sqrt(d)
        out, lse = attention.attention_fwd(q, k, v, causal=causal, scale=scale)
        dout = torch.randn_like(out)
        tflop = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1) / 1e12
        row = {"D": d, "causal": causal, "Hkv": hkv}
        def backward():
            attention.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale)

        for name, switch in (("ours", "1"), ("tl", "0")):
            os.environ["PORTABLE_OPS_SM90_ATTENTION"] = switch
            attention_plans.bwd_plans.clear()
            row[f"{name} ms"] = steady_ms(backward)
        os.environ.pop("PORTABLE_OPS_SM90_ATTENTION")
        attention_plans.bwd_plans.clear()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=hkv != h)
                row[f"{name} ms"] = steady_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))
        row["ours TFLOP/s"] = tflop / row["ours ms"] * 1e3
        row["vs tl"] = row["tl ms"] / row["ours ms"]
        row["vs cudnn"] = row["cudnn ms"] / row["ours ms"]
        rows.append(row)
    return rows


def main() -> int:
    print(table(check(), ["case", "kernel", "dq max err / max", "dk max err / max", "dv max err / max"]))
    print(table(timed(), ["D", "causal", "Hkv", "ours ms", "tl ms", "cudnn ms", "flash ms", "ours TFLOP/s", "vs tl",
                          "vs cudnn"]))
    info = device_info()
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
