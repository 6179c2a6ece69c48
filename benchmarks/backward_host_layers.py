"""Host time of the training bench's attention backward (shape 1), layer by layer, against SDPA's (GPU).

``python benchmarks/backward_host_layers.py`` (an H100; under a minute). Shape 1's
attention: batch 4, 2048 tokens, 16 query heads over 4 KV heads, head dim 64, causal, bf16, q/k/v
transposed out of [B, S, H, D]. Each figure is the median host time of one call enqueued while the
device is busy (a sleep kernel queued ahead of each row's calls), as in a training loop whose host
keeps ahead of its device: ROUNDS rounds of CALLS calls, the rows' rounds interleaved. A layer's row
includes the rows below it that it calls. Rows marked "1 thread" run the autograd engine on the
calling thread (``set_multithreading_enabled(False)``); otherwise a CUDA backward runs on the
engine's device thread, as ``loss.backward()`` does, and each call pays the hand-over. A call the
memo does not take (a numpy bool ``causal``) dispatches its backward per call: against the memoised
call's row, in the same process, it prices what the memo saves.

A tree without ``prepare_attention_bwd`` (before the backward was memoised with the forward) gets the
whole-call rows only, so that two trees can be compared in alternate processes.
"""

from __future__ import annotations

import importlib
import statistics
import time

import numpy
import torch
import torch.nn.functional as F

import portable_ops
from portable_ops.bench.common import device_info

CALLS = 30
ROUNDS = 5
SLEEP_CYCLES = 100_000_000  # ~60 ms on an H100: longer than a row's calls take to enqueue


def busy_us(rows: dict) -> dict:
    for fn in rows.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in rows}
    for _ in range(ROUNDS):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            for _ in range(CALLS):
                start = time.perf_counter_ns()
                fn()
                times[name].append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def one_thread(fn):
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            fn()
    return run


def main():
    api = importlib.import_module("portable_ops.attention")
    backend = importlib.import_module("portable_ops.backends.triton.attention")
    plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
    sm90 = importlib.import_module("portable_ops.backends.triton.attention_sm90")
    b, s, h, hkv, d = 4, 2048, 16, 4, 64
    make = lambda heads: torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = (make(n).requires_grad_() for n in (h, hkv, hkv))
    dout = make(h)
    scale = d ** -0.5
    for _ in range(2):  # the second call is memoised, as every call of a training loop after its first
        out = portable_ops.attention(q, k, v, causal=True)
    # a numpy bool is not a plain option: the call is checked and dispatched, and so is its backward
    unmemoised = portable_ops.attention(q, k, v, causal=numpy.bool_(True))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ours = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    sdpa = lambda: torch.autograd.grad(ref, (q, k, v), dout, retain_graph=True)  # noqa: E731
    rows = {
        "torch.autograd.grad through portable_ops.attention": ours,
        "  the same, 1 thread": one_thread(ours),
        "  the same, 1 thread, through a call the memo does not take": one_thread(
            lambda: torch.autograd.grad(unmemoised, (q, k, v), dout, retain_graph=True)),
        "torch.autograd.grad through SDPA": sdpa,
        "  the same, 1 thread ": one_thread(sdpa),
        "portable_ops.attention forward": lambda: portable_ops.attention(q, k, v, causal=True),
        "SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    if hasattr(backend, "prepare_attention_bwd"):
        with torch.no_grad():
            out_, lse = backend.attention_fwd(q, k, v, causal=True, scale=scale)
            run = backend.prepare_attention_bwd(q, k, v, causal=True, scale=scale)
            run(q, k, v, out_, lse, dout)
            (plan,) = [p for key, p in plans.bwd_plans.items() if key[:2] == (q.shape, q.stride())]
        rows["  api.backward (dispatch, then the backend)"] = lambda: api.backward(q, k, v, out_, lse, dout, None,
                                                                                   None, True, scale)
        rows["    backend attention_bwd"] = lambda: backend.attention_bwd(q, k, v, out_, lse, dout, causal=True,
                                                                          scale=scale)
        rows["    the prepared backward (a memoised call's)"] = lambda: run(q, k, v, out_, lse, dout)
        if plan.hopper is not None:
            delta, dq, dk, dv = plans.bwd_buffers(plan, q, k, v)
            dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            rows["      bwd_buffers (four allocations)"] = lambda: plans.bwd_buffers(plan, q, k, v)
            rows["      delta launch (zeroing dQ's float32 sum)"] = lambda: plan.delta(out_, dout, delta, delta, dq_sum,
                                                                                       *plan.delta_args)
            rows["      Hopper backward launch"] = lambda: sm90.backward(plan.hopper, q, k, v, dout, lse, delta, dq_sum,
                                                                        dk, dv, scale)
            rows["      dQ's cast (copy_)"] = lambda: dq.copy_(dq_sum)
    got = busy_us(rows)
    info = device_info()
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}; "
          f"portable_ops from {portable_ops.__file__}")
    print(f"B {b}, S {s}, {h} query heads over {hkv} KV heads, D {d}, causal, bf16: median host us of one call, "
          f"device busy")
    for name, us in got.items():
        print(f"{name:58s} {us:7.1f}")


if __name__ == "__main__":
    main()
