"""An A/B of the Hopper backward's variants (H100): the committed form (backends/triton/_sm90_before.py,
`git show COMMIT:backends/triton/attention_sm90.py > backends/triton/_sm90_before.py`) against the
working tree's kernel under each constexpr set of VARIANTS, all through attention.attention_bwd (so
each time includes the delta pass, dQ's zeroing and its cast), with cuDNN timed in the same row.

The check compares each variant's gradients with float64 on the CHECKS cases (backward_ab's, with
head dim 64 unmasked added). Rows: the best of max(3, variants) interleaved rounds of 10 calls back
to back, each round in another order, as a ratio of cuDNN's time in the same row (above 1: faster).
SEQS=4096,... chooses the sequence lengths (16k tokens: B = 16384 / S), DIMS=64,128 the head dims (of the
check and the timing), CONFIGS=2/1,128/2/1,128/2/1/0 more variants of the working tree's kernel: ring stages /
dQ buffers, after a tile's query rows where three or four numbers are given, and then 1 to mask only the
tiles that need it or 0 to mask every tile (named s2b1, m128s2b1, m128s2b1-all; the fields not given as
BWD_CONFIGS has them), BANDS=1,4,all more with a causal call's programs started in bands of that
many (batch, KV head) pairs or of all (named band1, band4, bandall), MASKS=causal or unmasked the timed
cases (unset: both), ONLY=a,b the variants ("tl": the tl.* backward); TIMED=0: the check alone.
"""
import math
import os
import time
import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from torch.nn.attention import SDPBackend, sdpa_kernel
from portable_ops.definitions import attention as reference
from portable_ops.backends.triton import attention, attention_plans, attention_sm90 as new
from portable_ops.backends.triton import _sm90_before as old
from backward_ab import _inputs as inputs
from portable_ops.bench.common import steady_ms, table, device_info

# name: (module, overrides of BWD_CONFIGS' fields)
FIELDS = ("BLOCK_M", "STAGES", "DQ_BUFFERS", "SPLIT_MASK")
VARIANTS = {"before": (old, {}), "now": (new, {}), "now split": (new, {"SPLIT_MASK": True}), "tl": None}
for _c in filter(None, os.environ.get("CONFIGS", "").split(",")):
    _parts = _c.split("/")
    _n = tuple(map(int, _parts)) if all(x.isdigit() for x in _parts) else ()
    if len(_n) == 2:  # stages / buffers
        _n = (None, *_n)
    if (len(_n) not in (3, 4) or _n[0] not in (None, 64, 128) or 0 in _n[1:3]
            or len(_n) == 4 and _n[3] not in (0, 1)):
        raise SystemExit(f"CONFIGS: {_c!r} is not stages/buffers or rows (64 or 128)/stages/buffers[/split 0 or 1], "
                         "whole numbers, stages and buffers >= 1")
    _fields = {k: v for k, v in zip(FIELDS, _n) if v is not None}
    _name = (f"m{_n[0]}" if _n[0] else "") + f"s{_n[1]}b{_n[2]}" + ("" if len(_n) == 3 else ("-all", "-split")[_n[3]])
    VARIANTS[_name] = (new, {k: bool(v) if k == "SPLIT_MASK" else v for k, v in _fields.items()})
# BANDS=1,4,all: the working tree's kernel with a causal call's programs started in bands of that many
# (batch, KV head) pairs, or of all of them (named band1, band4, bandall); unmasked calls keep band()'s one
BANDS = {}
for _b in filter(None, (b.strip() for b in os.environ.get("BANDS", "").split(","))):
    if not (_b == "all" or _b.isdigit() and int(_b) >= 1):
        raise SystemExit(f"BANDS: {_b!r} is not a whole number of pairs >= 1 or 'all'")
    VARIANTS[f"band{_b}"] = (new, {})
    BANDS[f"band{_b}"] = _b
KERNELS = {mod: (mod.BwdPlan, mod.backward, mod.supports_backward) for mod in (old, new)}  # before bwd() patches new's
ONLY = [v.strip() for v in os.environ.get("ONLY", "").split(",") if v.strip()]
if set(ONLY) - set(VARIANTS):
    raise SystemExit(f"ONLY: unknown {sorted(set(ONLY) - set(VARIANTS))}; known: {sorted(VARIANTS)}")
if ONLY:
    VARIANTS = {k: VARIANTS[k] for k in ONLY}
MASKS = {"causal": (True,), "unmasked": (False,), "": (False, True)}.get(os.environ.get("MASKS", ""))
if MASKS is None:
    raise SystemExit(f"MASKS: {os.environ['MASKS']!r}; choose causal or unmasked (unset: both)")
DIMS = {int(d) for d in os.environ.get("DIMS", "64,128").split(",") if d.strip()}
if not DIMS <= {64, 128}:
    raise SystemExit(f"DIMS: {sorted(DIMS)}; the Hopper backward takes 64 and 128")


def bwd(variant, q, k, v, out, lse, dout, causal, scale):
    """attention_bwd through ``variant``'s Hopper kernel (head dim 64 unmasked included), or, for "tl",
    through the tl.* backward: each variant with its own plan cache, swapped in for its calls."""
    plans = {}
    if variant == "tl":
        kernels, supports = (new.BwdPlan, new.backward), (lambda *a, **kw: ["timed as tl.*"])
    else:
        mod, consts = VARIANTS[variant]

        def plan(q, *args):
            key = (q.shape[-1], args[-1])
            saved = mod.BWD_CONFIGS[key]
            fields = dict(zip(FIELDS, saved), **consts)
            mod.BWD_CONFIGS[key] = tuple(fields.values())
            try:
                p = KERNELS[mod][0](q, *args)
            finally:
                mod.BWD_CONFIGS[key] = saved
            if variant in BANDS and causal:
                pairs = p.launch.grid[1]
                p.args = (*p.args[:-1], pairs if BANDS[variant] == "all" else min(int(BANDS[variant]), pairs))
            return p
        kernels = (plan, KERNELS[mod][1])
        supports = KERNELS[new][2]

    def call():
        saved = attention_plans.bwd_plans, new.BwdPlan, new.backward, new.supports_backward
        attention_plans.bwd_plans, (new.BwdPlan, new.backward), new.supports_backward = plans, kernels, supports
        try:
            return attention.attention_bwd(q, k, v, out, lse, dout, causal=causal, scale=scale)
        finally:
            attention_plans.bwd_plans, new.BwdPlan, new.backward, new.supports_backward = saved
    call()
    assert (next(iter(plans.values())).hopper is None) == (variant == "tl")
    return call


CHECKS = [(2, 4, 4, 256, 256, 64, False, False), (1, 8, 2, 1000, 1000, 128, True, True),
          (2, 4, 1, 300, 777, 128, True, True), (1, 2, 2, 100, 100, 64, True, False),
          (3, 6, 3, 129, 200, 128, False, False), (2, 8, 2, 333, 517, 128, False, True),
          (1, 4, 4, 65, 65, 64, False, False), (2, 4, 2, 300, 777, 64, True, True),
          (1, 4, 1, 1500, 1500, 64, False, True),
          (1, 4, 2, 200, 256, 128, False, False), (1, 4, 4, 1000, 1024, 64, True, True),
          (2, 4, 2, 300, 777, 64, True, True, 12.0), (1, 4, 4, 200, 200, 64, False, False, 12.0)]  # last: q * 12


def check():
    rows = []
    for b, hq, hkv, sq, skv, d, causal, inner, *magnitude in [c for c in CHECKS if c[5] in DIMS]:
        q, k, v = inputs(b, hq, hkv, sq, skv, d, inner)
        q = q * magnitude[0] if magnitude else q  # scores in the hundreds: lse far from 0
        scale = 1 / math.sqrt(d)
        out, lse = attention.attention_fwd(q, k, v, causal=causal, scale=scale)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype).cuda()
        q64, k64, v64 = (t.double().cpu() for t in (q, k, v))
        ref_out, ref_lse = reference.attention_fwd(q64, k64, v64, causal=causal, scale=scale)
        ref = reference.attention_bwd(q64, k64, v64, ref_out, ref_lse, dout.double().cpu(), causal=causal, scale=scale)
        row = {"case": f"B{b} H{hq}/{hkv} S{sq}/{skv} D{d}{' causal' if causal else ''}"
                       f"{' q*%g' % magnitude[0] if magnitude else ''}"}
        for name in VARIANTS:
            try:
                grads = [g.clone() for g in bwd(name, q, k, v, out, lse, dout, causal, scale)()]
            except OutOfResources:  # a config past shared memory's limit
                row[name] = "OutOfResources"
                continue
            err = max(((g.double().cpu() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                      for g, r in zip(grads, ref))
            row[name] = f"{err:.1e}" if all(g.isfinite().all() for g in grads) else "non-finite"
        rows.append(row)
        print(row, flush=True)
    return rows


def timed(seqs):
    rows = []
    cases = [(128, False, 16), (128, True, 16), (128, True, 4), (64, True, 16), (64, True, 4), (64, False, 16)]
    for d, causal, hkv in [c for c in cases if c[0] in DIMS and c[1] in MASKS]:
        for s in seqs:
            b, h = max(1, 16384 // s), 16
            q, k, v = inputs(b, h, hkv, s, s, d, True)
            scale = 1 / math.sqrt(d)
            out, lse = attention.attention_fwd(q, k, v, causal=causal, scale=scale)
            dout = torch.randn_like(out)
            variants = []
            for name in VARIANTS:
                try:  # a config past shared memory's limit fails to compile
                    variants.append((name, bwd(name, q, k, v, out, lse, dout, causal, scale)))
                except OutOfResources as e:
                    print(name, str(e)[:200], flush=True)
            if not variants:
                continue
            best = {}
            for r in range(max(3, len(variants))):  # interleaved rounds, each in another order: clocks drift
                for name, fn in variants[r % len(variants):] + variants[:r % len(variants)]:
                    best[name] = min(best.get(name, 1e9), steady_ms(fn, iters=10))
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=hkv != h)
                cudnn = min(steady_ms(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), iters=10)
                            for _ in range(3))
            tflop = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1) / 1e12
            row = {"D": d, "S": s, "causal": causal, "Hkv": hkv, "cudnn TFLOP/s": round(tflop / cudnn * 1e3),
                   **{name: round(cudnn / best[name], 3) if name in best else None for name in VARIANTS}}
            rows.append(row)
            print(row, flush=True)
    return rows


if __name__ == "__main__":
    t0 = time.time()
    checked = check()
    print(table(checked, ["case", *VARIANTS]), flush=True)
    print("check s", round(time.time() - t0), flush=True)
    # bf16 outputs round at ~4e-3 of the largest element; well past that is a wrong kernel
    wrong = [(r["case"], n) for r in checked for n in VARIANTS
             if r[n] == "non-finite" or (r[n] != "OutOfResources" and float(r[n]) > 2e-2)]
    if wrong:
        raise SystemExit(f"gradients off: {wrong}")
    if os.environ.get("TIMED", "1") == "1":
        rows = timed([int(s) for s in os.environ.get("SEQS", "4096").split(",")])
        print("backward time as a ratio of cuDNN's (above 1: faster)")
        print(table(rows, list(rows[0])) if rows else "no case timed")
    print(device_info())
