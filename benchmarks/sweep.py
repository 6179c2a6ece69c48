"""python benchmarks/sweep.py: tile and launch-size sweeps for the triton kernels (GPU).

Times each candidate configuration of the multi-tensor kernels (Adam step, norm partials) and
of the attention kernels against torch in one process, checks each candidate's result, prints
a table and writes JSON. The defaults in backends/triton come from this sweep.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops

from portable_ops.bench.common import copy_bandwidth, device_info, graphed, median_ms
from portable_ops.bench.optimizer import bytes_per_element, gpt2_medium_shapes

mt = importlib.import_module("portable_ops.backends.triton.multi_tensor")
adam_mod = importlib.import_module("portable_ops.backends.triton.adam")
norm_mod = importlib.import_module("portable_ops.backends.triton.grad_norm")
attn_mod = importlib.import_module("portable_ops.backends.triton.attention")
attn_configs = importlib.import_module("portable_ops.backends.triton.attention_configs")
attn_plans = importlib.import_module("portable_ops.backends.triton.attention_plans")

MT_CONFIGS = {
    torch.float32: [(8192, 2048, 8), (16384, 1024, 8), (4096, 2048, 8), (2048, 2048, 8), (4096, 4096, 8),
                    (8192, 1024, 8)],
    # 2-byte params: the same bytes per program and per thread take twice the elements
    torch.bfloat16: [(4096, 2048, 8), (8192, 2048, 8), (8192, 4096, 8), (16384, 4096, 8), (8192, 4096, 16),
                     (16384, 2048, 8), (4096, 4096, 8), (8192, 2048, 4), (16384, 4096, 16)],
}


def _reset_plans():
    adam_mod._plans.clear()
    norm_mod._plans.clear()
    mt._cache.clear()


def _each_launch(table: dict, key, configs):
    """Set ``table[key]`` to each of ``configs`` in turn, with no plan built under another shape;
    restore it afterwards."""
    default = table[key]
    try:
        for cfg in configs:
            table[key] = mt.Launch(*cfg)
            _reset_plans()
            yield cfg
    finally:
        table[key] = default
        _reset_plans()


def _sweep_adam(rows, params, grads, steps, lr, dtype, amsgrad, state_dtype, numel, copy):
    """One Adam variant's rows: torch's fused AdamW (for a state in the params' dtype), then each launch
    shape; the variant's moments are freed on return."""
    size = dtype.itemsize
    name = "adamw" + (" ams" if amsgrad else "") + f" {str(dtype)[6:]}" + (
        " fp32 state" if state_dtype != dtype else "")
    m, v, mx = ([torch.zeros_like(p, dtype=state_dtype) for p in params] for _ in range(3))
    floor = bytes_per_element(dtype, state_dtype, amsgrad) * numel / copy * 1e3
    if state_dtype == dtype:
        ref = torch.optim.AdamW([torch.nn.Parameter(p) for p in params], lr=lr, amsgrad=amsgrad, fused=True,
                                capturable=True)
        for p, gr in zip(ref.param_groups[0]["params"], grads):
            p.grad = gr
        ms = median_ms(graphed(ref.step))
        rows.append({"sweep": name, "config": "torch fused graph", "ms": ms, "of copy": floor / ms})
        del ref
        torch.cuda.empty_cache()
    for cfg in _each_launch(adam_mod.LAUNCH, (size, state_dtype.itemsize), MT_CONFIGS[dtype]):
        def step():
            with portable_ops.use_backend("triton"):
                portable_ops.functional.adam(params, grads, m, v, mx if amsgrad else [], steps, amsgrad=amsgrad,
                                             lr=lr, weight_decay=0.01, decoupled_weight_decay=True,
                                             state_dtype=None if state_dtype == dtype else state_dtype)
        try:
            ms = median_ms(graphed(step))
            rows.append({"sweep": name, "config": str(cfg), "ms": ms, "of copy": floor / ms})
        except Exception as exc:  # noqa: BLE001
            rows.append({"sweep": name, "config": str(cfg), "error": repr(exc)[:100]})


def sweep_multi_tensor(rows, dtype=torch.float32):
    """Adam (AMSGrad too for fp32; float32 state too for 2-byte params) and the norm's partials, per
    launch shape, under CUDA graph replay, against torch's fused AdamW and _foreach_norm."""
    shapes = gpt2_medium_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    copy = copy_bandwidth()
    rows.append({"sweep": "copy", "TB/s": copy / 1e12})
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=g).to(dtype) for s in shapes]
    grads = [(torch.randn(s, device="cuda", generator=g) * 1e-2).to(dtype) for s in shapes]
    steps = [torch.zeros((), device="cuda") for _ in params]
    lr = torch.tensor(1e-4, device="cuda")
    size = dtype.itemsize
    variants = [(False, dtype), (True, dtype)] if dtype == torch.float32 else [(False, dtype), (False, torch.float32)]
    for amsgrad, state_dtype in variants:
        _sweep_adam(rows, params, grads, steps, lr, dtype, amsgrad, state_dtype, numel, copy)
        torch.cuda.empty_cache()
    floor = size * numel / copy * 1e3  # read-only, at the copy rate (which counts read + write)
    flat = torch.cat([x.reshape(-1) for x in grads])
    want = flat.double().norm().item()
    del flat
    ms = median_ms(lambda: torch._foreach_norm(grads))
    name = f"norm {str(dtype)[6:]}"
    rows.append({"sweep": name, "config": "torch _foreach_norm", "ms": ms, "of copy": floor / ms})
    for cfg in _each_launch(norm_mod.LAUNCH, size, MT_CONFIGS[dtype]):
        def norm():
            with portable_ops.use_backend("triton"):
                return portable_ops.clip.total_norm(grads)
        got = norm().item()
        ms = median_ms(graphed(norm))
        rows.append({"sweep": name, "config": str(cfg), "ms": ms, "of copy": floor / ms,
                     "error": abs(got - want) / want})


FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 4), (64, 64, 4, 3), (128, 32, 4, 4),
       (128, 64, 8, 4)]
DKDV = [(64, 64, 8, 2), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
        (64, 128, 8, 2)]
DQ = [(128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3)]


def _reset_attention():
    """Forget every attention launch plan and tuned choice, so the next call builds its plan from CONFIGS
    (portable_ops.attention's memo holds the plans of the calls it saw: it is emptied too)."""
    attn_plans.fwd_plans.clear()
    attn_plans.bwd_plans.clear()
    attn_configs._tuner.chosen.clear()
    importlib.import_module("portable_ops.attention")._memo.clear()


def _each_tile(kernel, d, configs):
    """Set ``attention_configs.CONFIGS[kernel]`` at ``d``'s tile width to each of ``configs`` alone in turn (a
    one-candidate list is used untimed), with no plan built under another; restore it afterwards."""
    width = sum(attn_configs.head_split(d))
    default = attn_configs.CONFIGS[kernel][width]
    try:
        for cfg in configs:
            attn_configs.CONFIGS[kernel][width] = [attn_configs.TileConfig(*cfg)]
            _reset_attention()
            yield cfg
    finally:
        attn_configs.CONFIGS[kernel][width] = default
        _reset_attention()


def _flops(b, h, s, d, causal, direction):
    fwd = 4 * b * h * s * s * d / (2 if causal else 1)
    return fwd if direction == "fwd" else 2.5 * fwd


def _sweep_attention_case(rows, d, s, b, h, quick, causal):
    """The rows of one masking (causal or not); its tensors are freed on return."""
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with torch.no_grad():
            ms = median_ms(fwd, iters=15)
        rows.append({"sweep": f"attn fwd D{d}", "causal": causal, "config": name, "ms": ms,
                     "TFLOP/s": _flops(b, h, s, d, causal, "fwd") / ms / 1e9})
        out = fwd()
        ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters=15)
        rows.append({"sweep": f"attn bwd D{d}", "causal": causal, "config": name, "ms": ms,
                     "TFLOP/s": _flops(b, h, s, d, causal, "bwd") / ms / 1e9})
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    scale = 1 / math.sqrt(d)
    for cfg in _each_tile("fwd", d, FWD[:4] if quick else FWD):
        try:
            run = lambda: attn_mod.attention_fwd(qd, kd, vd, causal=causal, scale=scale)  # noqa: E731
            err = (run()[0].float() - ref.float()).abs().max().item()
            ms = median_ms(run, iters=15)
            rows.append({"sweep": f"attn fwd D{d}", "causal": causal, "config": str(cfg), "ms": ms,
                         "TFLOP/s": _flops(b, h, s, d, causal, "fwd") / ms / 1e9, "error": err})
        except Exception as exc:  # noqa: BLE001
            rows.append({"sweep": f"attn fwd D{d}", "causal": causal, "config": str(cfg), "error": repr(exc)[:100]})
    out, lse = attn_mod.attention_fwd(qd, kd, vd, causal=causal, scale=scale)
    for kernel, cands in (("dkdv", DKDV[:4] if quick else DKDV), ("dq", DQ[:4] if quick else DQ)):
        for cfg in _each_tile(kernel, d, cands):
            try:
                run = lambda: attn_mod.attention_bwd(qd, kd, vd, out, lse, dout, causal=causal, scale=scale)  # noqa: E731
                got = run()
                err = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref_grads))
                ms = median_ms(run, iters=15)
                rows.append({"sweep": f"attn bwd D{d}", "causal": causal, "config": f"{kernel} {cfg}", "ms": ms,
                             "TFLOP/s": _flops(b, h, s, d, causal, "bwd") / ms / 1e9, "error": err})
            except Exception as exc:  # noqa: BLE001
                rows.append({"sweep": f"attn bwd D{d}", "causal": causal, "config": f"{kernel} {cfg}",
                             "error": repr(exc)[:100]})


def sweep_attention(rows, d=128, s=4096, b=4, h=16, quick=False):
    torch.manual_seed(0)
    for causal in (False, True):
        _sweep_attention_case(rows, d, s, b, h, quick, causal)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--only", default="mt,mt_bf16,attn128,attn64")
    args = parser.parse_args(argv)
    rows = []
    parts = args.only.split(",")
    for part, fn in (("mt", lambda: sweep_multi_tensor(rows)),
                     ("mt_bf16", lambda: sweep_multi_tensor(rows, torch.bfloat16)),
                     ("attn128", lambda: sweep_attention(rows, d=128)),
                     ("attn64", lambda: sweep_attention(rows, d=64, quick=True))):
        if part in parts:
            try:
                fn()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            print(json.dumps(rows[-3:], default=str), flush=True)
            with open(args.out, "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump({"info": device_info(), "rows": rows}, f, indent=1, default=str)
    from portable_ops.bench.common import table
    print(table(rows, ["sweep", "causal", "config", "ms", "of copy", "TFLOP/s", "error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
