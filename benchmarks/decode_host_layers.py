"""Host time of one eager decode call, whole and layer by layer, against cuDNN's whole call (GPU).

``python benchmarks/decode_host_layers.py [--whole]`` (an H100; under a minute).

Decode is one new token per sequence, 32 query heads over 8 KV heads, D 128, bf16, as the decode
bench runs it. Every figure is the host time of one call, enqueued back to back with no sync inside
a round (the kernels are shorter than the host path, so the launch queue never fills): the best of
seven rounds of 200 calls, the rounds of every row of a table interleaved, so that a slow spell of
the host (they come and go on these machines) does not fall on one row. ``steady`` is the decode
bench's figure: 50 calls back to back timed by CUDA events, the best of the rounds; it is the
larger of the host and the device time. A layer's row includes the rows below it that it calls.
``--whole`` times whole calls only, through the public API, so that a tree from before the layers
were named can run it too.
"""

from __future__ import annotations

import importlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops
from portable_ops.bench.common import device_info, steady_ms

ROUNDS, CALLS, STEADY_CALLS = 7, 200, 50
CELLS = ((1, 512), (1, 4096), (1, 16384), (4, 4096), (16, 4096), (64, 4096))


def _host_us(fn) -> float:
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        fn()
    us = (time.perf_counter_ns() - start) / CALLS / 1e3
    torch.cuda.synchronize()
    return us


def _steady_us(fn) -> float:
    return steady_ms(fn, warmup=0, iters=STEADY_CALLS) * 1e3


def interleaved(rows: dict, measures=(_host_us,)) -> dict:
    """{name: [best of ROUNDS per measure]} for {name: fn}, every round running every row."""
    for fn in rows.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    best = {name: [float("inf")] * len(measures) for name in rows}
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            best[name] = [min(b, measure(fn)) for b, measure in zip(best[name], measures)]
    return best


def _inputs(b, cache, heads=32, kv_heads=8, d=128):
    q = torch.randn(b, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv_heads, cache, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def whole() -> list[str]:
    lines = ["B     cache   ours host  cuDNN host  ratio   ours steady  cuDNN steady  ratio"]
    for b, cache in CELLS:
        q, k, v = _inputs(b, cache)
        ours = lambda: portable_ops.attention(q, k, v, causal=True)  # noqa: E731
        cudnn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # chosen once: it costs ~8 us a call
            got = interleaved({"ours": ours, "cudnn": cudnn}, (_host_us, _steady_us))
        (oh, os_), (ch, cs) = got["ours"], got["cudnn"]
        lines.append(f"{b:<5d} {cache:<7d} {oh:9.1f} {ch:11.1f} {oh / ch:6.2f} {os_:12.1f} {cs:13.1f} {os_ / cs:6.2f}")
    return lines


def layers(b, cache) -> list[str]:
    api = importlib.import_module("portable_ops.attention")
    backend = importlib.import_module("portable_ops.backends.triton.attention")
    plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
    launch = importlib.import_module("portable_ops.backends.triton.launch")

    q, k, v = _inputs(b, cache)
    d, heads, scale = q.shape[-1], q.shape[1], q.shape[-1] ** -0.5
    with torch.no_grad():
        plans.fwd_plans.clear()
        api._memo.clear()
        portable_ops.attention(q, k, v, causal=True)
        (plan,) = plans.fwd_plans.values()
        split = plan.splits > 1
        floats = (scale * plans.LOG2E.value, 0.0, 0.0)
        out = torch.empty((plan.splits, b, heads, 1, d) if split else q.shape, device="cuda",
                          dtype=torch.float32 if split else q.dtype)
        lse = torch.empty((plan.splits, b, heads, 1) if split else (b, heads, 1), device="cuda", dtype=torch.float32)
        args = (q, k, v, out, lse, q, q, q, q, *plan.args, *floats, plan.keys_per_split)
        key = api._memo_key(q, k, v, True, None, None, None)
        memoised = api._memoised(key)
        fwd, compiled = plan.fwd, next(iter(plan.fwd.compiled.values()))
        pointers = [t.data_ptr() for t in args[:fwd.tensors]]
        stream = launch._current_stream(launch._current_device())
        entry_args = (*fwd.grid, stream, *compiled.head, *pointers, *args[fwd.tensors:], *fwd.tail)
        rows = {
            "portable_ops.attention": lambda: portable_ops.attention(q, k, v, causal=True),
            "  the memo's key": lambda: api._memo_key(q, k, v, True, None, None, None),
            "  the memoised call (after the key)": lambda: memoised(q, k, v),
            "  api.forward (checked, not memoised)": lambda: api.forward(q, k, v, None, True, scale),
            "    backend attention_fwd (after dispatch)": lambda: backend.attention_fwd(q, k, v, causal=True,
                                                                                       scale=scale),
            "      plans run_forward (after the plan key)": lambda: plans.run_forward(plan, q, k, v, scale, None,
                                                                                   (q, q, q, q)),
            f"        fwd launch, {plan.splits} split(s)": lambda: plan.fwd(*args),
            "          the launch's checks (_through_triton)": lambda: launch._through_triton(fwd.kernel),
            "          the launcher's C entry point alone": lambda: compiled.entry(*entry_args),
            "        torch.empty": lambda: torch.empty((b, heads, 1), dtype=torch.float32, device=q.device),
            "        torch.empty_strided": lambda: torch.empty_strided(q.shape, plan.out_stride, dtype=q.dtype,
                                                                    device=q.device),
            "        the current device and stream (as a launch gets them)": lambda: launch._current_stream(
                launch._current_device()),
        }
        if split:
            final, final_lse = torch.empty_like(q), torch.empty((b, heads, 1), device="cuda", dtype=torch.float32)
            rows["        combine launch"] = lambda: plan.combine(out, lse, final, final_lse, q, plan.splits, heads, 1,
                                                                   *plan.out_stride[:3])
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            rows["cuDNN: F.scaled_dot_product_attention"] = lambda: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=True)
            got = interleaved(rows)
    lines = [f"B {b}, {cache} keys: host us a call"]
    lines += [f"{name:58s} {us:7.1f}" for name, (us,) in got.items()]
    return lines


def main():
    info = device_info()
    lines = [f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, "
             f"triton {info['triton']}; portable_ops from {portable_ops.__file__}", ""]
    lines += whole()
    if "--whole" not in sys.argv[1:]:
        for b, cache in ((1, 4096), (16, 4096)):
            lines += ["", *layers(b, cache)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
