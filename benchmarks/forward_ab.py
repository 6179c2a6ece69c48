"""An A/B of the Hopper forward against an earlier form of it (H100), or of its two grids.

``python benchmarks/forward_ab.py``. The earlier form is imported as backends/triton/_sm90_before.py
(``git show COMMIT:backends/triton/attention_sm90.py > backends/triton/_sm90_before.py``). AB=grids (the
default) forces the current forward's grid by replacing attention_sm90.programs: one program per tile
("per tile") or one per SM, each persistent program taking the next free tile ("dynamic"). AB=before
times the earlier form ("before") against the current one ("now"), each with its own grid. The check
compares the current outputs with the earlier form's, bit for bit, and across both grids. Rows: the
best of max(3, variants) interleaved rounds of 10 calls back to back (steady), as a ratio of cuDNN
timed in the same row. TIMED=0: the check alone; CHECK=0: the timing alone; SEQS=2048,4096 and DIMS=64
choose the timed lengths and head dims.
"""
import math
import os
import time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from portable_ops.definitions import attention as reference
from portable_ops.backends.triton import attention_sm90 as new
from portable_ops.backends.triton import _sm90_before as old
from backward_ab import _inputs as inputs  # bf16 q/k/v on the GPU, [B, S, H, D]-transposed or not
from portable_ops.bench.common import steady_ms, table, device_info
from portable_ops.layout import strides_like, empty_like

def run(mod, q, k, v, causal, scale, grid=None):
    saved = getattr(mod, "programs", None)
    if grid is not None:
        tiles = -(-q.shape[2] // (64 * mod.config(q.shape[3], causal)[3])) * q.shape[0] * q.shape[1]
        mod.programs = lambda q, k, causal: tiles if grid == "tiles" else min(tiles, 132)
    try:
        plan = mod.Plan(q, k, v, strides_like(q), causal, scale)
    finally:
        if grid is not None:
            mod.programs = saved
    def call():
        return mod.forward(plan, q, k, v, empty_like(q), scale)
    return call

CHECKS = [(2, 4, 4, 256, 256, 64, False, False, None), (1, 8, 2, 1000, 1000, 128, True, True, None),
          (2, 4, 1, 300, 777, 128, True, True, None), (1, 2, 2, 100, 100, 64, True, False, None),
          (3, 6, 3, 129, 200, 128, False, False, -0.3), (2, 8, 2, 333, 517, 64, False, True, None),
          (1, 2, 1, 4096, 4096, 128, True, True, None), (5, 3, 3, 700, 1500, 64, True, True, None),
          (200, 2, 2, 130, 130, 128, False, False, None)]

def check():
    rows = []
    for b, hq, hkv, sq, skv, d, causal, inner, sc in CHECKS:
        q, k, v = inputs(b, hq, hkv, sq, skv, d, inner)
        scale = sc if sc is not None else 1 / math.sqrt(d)
        reasons = new.supports(q, k, v, causal, strides_like(q))
        assert not reasons, reasons
        o_new, l_new = run(new, q, k, v, causal, scale)()
        o_old, l_old = run(old, q, k, v, causal, scale)()
        row = {"case": f"B{b} H{hq}/{hkv} S{sq}/{skv} D{d}{' causal' if causal else ''}",
               "same as before": torch.equal(o_new, o_old) and torch.equal(l_new, l_old)}
        for grid in ("tiles", "sms"):
            fn = run(new, q, k, v, causal, scale, grid=grid)
            for _ in range(3):
                o2, lse2 = fn()
                row[f"same {grid}"] = (row.get(f"same {grid}", True) and torch.equal(o2, o_new)
                                       and torch.equal(lse2, l_new))
        torch.cuda.synchronize()
        row["counters zero"] = all(int(c.abs().sum()) == 0 for c in new._TILE_COUNTERS.values())
        if b * hq * sq * skv < 2e8:
            q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
            ro, rl = reference.attention_fwd(q64, k64, v64, causal=causal, scale=scale)
            row["out err/max"] = f"{((o_new.double().cpu() - ro).abs().max() / ro.abs().max()).item():.1e}"
            row["lse err"] = f"{(l_new.double().cpu() - rl).abs().max().item():.1e}"
        rows.append(row)
    return rows

VARIANTS = {
    "grids": lambda q, k, v, causal, scale: [("per tile", run(new, q, k, v, causal, scale, grid="tiles")),
                                             ("dynamic", run(new, q, k, v, causal, scale, grid="sms"))],
    "before": lambda q, k, v, causal, scale: [("before", run(old, q, k, v, causal, scale)),
                                              ("now", run(new, q, k, v, causal, scale))] +
                                             [(name, run(mod, q, k, v, causal, scale)) for name, mod in EXTRA],
}
# EXTRA=_sm90_x,_sm90_y: more forms of the module (backends/triton/_sm90_x.py, ...) timed with AB=before
EXTRA = [(name, __import__(f"portable_ops.backends.triton.{name}", fromlist=["Plan"]))
         for name in filter(None, os.environ.get("EXTRA", "").split(","))]
AB = os.environ.get("AB", "grids")


def timed(seqs, dims):
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                for hkv in (16, 4):
                    if hkv == 4 and s not in (2048, 8192):
                        continue
                    b, h = max(1, 16384 // s), 16
                    q, k, v = inputs(b, h, hkv, s, s, d, True)
                    scale = 1 / math.sqrt(d)
                    tflop = 4 * b * h * s * s * d * (0.5 if causal else 1) / 1e12
                    row = {"D": d, "S": s, "causal": causal, "Hkv": hkv}
                    variants = VARIANTS[AB](q, k, v, causal, scale)
                    best = {}
                    for r in range(max(3, len(variants))):  # interleaved rounds, each in another order: clocks drift
                        for name, fn in variants[r % len(variants):] + variants[:r % len(variants)]:
                            best[name] = min(best.get(name, 1e9), steady_ms(fn, iters=10))
                    for name, _ in variants:
                        row[name] = tflop / best[name] * 1e3
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        row["cudnn"] = tflop / min(
                            steady_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                             enable_gqa=hkv != h), iters=10)
                            for _ in range(3)) * 1e3
                    for name, _ in variants:
                        row[name] = row[name] / row["cudnn"]
                    rows.append(row)
                    print(row, flush=True)
    return rows

if __name__ == "__main__":
    t0 = time.time()
    if os.environ.get("CHECK", "1") == "1":
        print(table(check(), ["case", "same as before", "same tiles", "same sms", "counters zero", "out err/max",
                              "lse err"]), flush=True)
    print("check s", time.time() - t0, flush=True)
    if os.environ.get("TIMED", "1") != "1":
        raise SystemExit(0)
    seqs = [int(x) for x in os.environ.get("SEQS", "1024,2048,4096,8192,16384,32768").split(",")]
    rows = timed(seqs, [int(x) for x in os.environ.get("DIMS", "128,64").split(",")])
    print("ratios against cuDNN; cudnn column in TFLOP/s")
    print(table(rows, ["D", "S", "causal", "Hkv", "cudnn", *list(rows[0])[4:-1]]))
    print(device_info())
