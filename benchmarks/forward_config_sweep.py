"""The Hopper forward's tile configs at one head dim, against cuDNN in the same run: what
``attention_sm90.CONFIGS`` is chosen from.

    D=64 VARIANTS=128x4x0x2,128x3x0x2,128x4x0x3,64x8x0x3 python benchmarks/forward_config_sweep.py

A variant is BLOCK_NxSTAGESxO_THROUGH_QxCONSUMERS (the CONFIGS entry, for causal and not alike;
CONSUMERS 2 when left out). Each output is checked against cuDNN's to 2% of its largest value, and
bit for bit against the first variant of the same BLOCK_N (another key tile width sums in another
order) and, under a causal mask, the same consumer count (another tile height masks other key
tiles, which rounds differently). bf16, 16 query and 16 KV heads,
16k tokens a batch (B = 16384 / S, at least 1), q/k/v transposed out of [B, S, H, D]. Each row: the best of three
interleaved rounds of 20 calls back to back (steady), as a ratio of cuDNN's time in the same row
(above 1: faster than cuDNN); cuDNN's column in TFLOP/s.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from portable_ops.backends.triton import attention_sm90 as sm90
from backward_ab import _inputs
from portable_ops.bench.common import device_info, steady_ms, table
from portable_ops.layout import empty_like, strides_like

D = int(os.environ.get("D", 64))
VARIANTS = [(*map(int, v.split("x")), 2)[:4] for v in os.environ.get("VARIANTS", "128x4x0x2,128x3x0x2").split(",")]
SEQS = [int(s) for s in os.environ.get("SEQS", "1024,2048,4096,8192,16384").split(",")]


def ours(q, k, v, causal, scale, config):
    block_n, stages, o_through_q, consumers = config
    saved = sm90.CONFIGS[D, causal]
    sm90.CONFIGS[D, causal] = sm90.FwdConfig(block_n, stages, bool(o_through_q), consumers)
    try:
        plan = sm90.Plan(q, k, v, strides_like(q), causal, scale)
    finally:
        sm90.CONFIGS[D, causal] = saved
    return lambda: sm90.forward(plan, q, k, v, empty_like(q), scale)[0]


def main():
    rows, wrong = [], 0
    names = ["x".join(map(str, v)) for v in VARIANTS]
    for s in SEQS:
        for causal in (False, True):
            q, k, v = _inputs(max(1, 16384 // s), 16, 16, s, s, D, heads_inner=True)
            scale = D ** -0.5
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                cudnn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)  # noqa: E731
                want = cudnn()
                calls = {"cudnn": cudnn}
                first = {}  # the first output of each BLOCK_N
                for name, config in zip(names, VARIANTS):
                    try:
                        call = ours(q, k, v, causal, scale, config)
                        out = call()
                    except Exception as exc:  # noqa: BLE001 -- a config that does not fit, say
                        print(f"S {s} causal {causal} {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                        continue
                    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    same = torch.equal(out, first.setdefault((config[0], causal and config[3]), out))
                    if not err <= 2e-2 or not same:
                        wrong += 1
                        print(f"WRONG S {s} causal {causal} {name}: {err:.3g} of cuDNN's largest, "
                              f"equal to the first of its BLOCK_N: {same}", flush=True)
                    calls[name] = call
                best = {name: float("inf") for name in calls}
                for turn in range(3):
                    order = list(calls)[turn:] + list(calls)[:turn]
                    for name in order:
                        best[name] = min(best[name], steady_ms(calls[name]))
            flops = 4 * q.shape[0] * 16 * s * s * D / (2 if causal else 1)
            row = {"D": D, "S": s, "causal": causal, "cudnn": round(flops / best.pop("cudnn") / 1e9)}
            row.update({name: round(flops / ms / 1e9 / row["cudnn"], 3) for name, ms in best.items()})
            rows.append(row)
            print(table([row], list(row)), flush=True)
    info = device_info()
    print(f"\n# D={D} VARIANTS={os.environ.get('VARIANTS')} python benchmarks/forward_config_sweep.py "
          f"({info['device']}, {info['date']}, commit {info['commit']}, triton {info['triton']})")
    print(table(rows, ["D", "S", "causal", "cudnn", *names]))
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
