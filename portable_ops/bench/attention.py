"""Attention benchmarks: portable_ops against each of SDPA's backends, forward and backward, in TFLOP/s."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops

from .common import median_ms

SDPA = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}


def _flops(b, h, s, d, causal, direction):
    fwd = 4 * b * h * s * s * d / (2 if causal else 1)
    return fwd if direction == "fwd" else 2.5 * fwd


def _time(fn, q, k, v, direction):
    if direction == "fwd":
        with torch.no_grad():
            return median_ms(lambda: fn(q, k, v), iters=20)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    return median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters=20)


def run_attention(seqs=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(64, 128), tokens=16384, heads=16,
                  kv_heads=(16, 4)) -> list[dict]:
    rows = []
    for d in head_dims:
        for s in seqs:
            b = max(1, tokens // s)
            for hkv in kv_heads:
                for causal in (False, True):
                    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    variants = {"portable_ops": lambda q, k, v: portable_ops.attention(q, k, v, causal=causal)}
                    for name, backend in SDPA.items():
                        def sdpa(q, k, v, backend=backend):
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != heads)
                        variants[name] = sdpa
                    for direction in ("fwd", "bwd"):
                        for name, fn in variants.items():
                            try:
                                ms = _time(fn, q, k, v, direction)
                            except RuntimeError as exc:  # an SDPA backend that can't take this shape
                                rows.append({"bench": "attention", "variant": name, "dir": direction, "D": d,
                                             "S": s, "B": b, "Hkv": hkv, "causal": causal,
                                             "error": str(exc).splitlines()[0][:80]})
                                continue
                            rows.append({"bench": "attention", "variant": name, "dir": direction, "D": d, "S": s,
                                         "B": b, "Hkv": hkv, "causal": causal, "ms": ms,
                                         "TFLOP/s": _flops(b, heads, s, d, causal, direction) / (ms * 1e-3) / 1e12})
                    del q, k, v
    return rows
