"""Host time per call of each way into dense attention, with a stand-in kernel that only allocates.

    python benchmarks/frontend_paths.py [cpu|cuda] [--rounds N]

Paths: ``po.attention`` (the memoised eager call), the custom op ``torch.ops.portable_ops.attention_fwd``
called eagerly (its registered autograd), the torch.func path (``_FuncAttention``), the unmemoised eager
path (``EagerAttention`` after the checks), and SDPA for scale. Forward alone without grad, and forward +
backward. Medians over interleaved rounds, microseconds per call.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import portable_ops as po
from portable_ops import dispatch

front = sys.modules["portable_ops.attention"]  # the package exports the function under the module's name


def stand_in_backend(device_type):
    """A backend under triton's name whose kernels only allocate their outputs: what is left is host time."""
    def fwd(q, k, v, **_):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def bwd(q, k, v, out, lse, dout, **_):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    ops = {"attention_fwd": dispatch.OpImpl(run=fwd), "attention_bwd": dispatch.OpImpl(run=bwd)}
    dispatch._backends["triton"] = dispatch.Backend(name="triton", devices=(device_type,), ops=ops,
                                                    cpu_runner="the stand-in", description="stand-in")


def paths(q, k, v):
    scale = q.shape[-1] ** -0.5

    def checked_eager(q, k, v):
        q, k, v, sinks, *options = front._checked(q, k, v, True, None, None, None)
        return front.EagerAttention.apply(q, k, v, sinks, front.Options(front.DENSE, tuple(options)))[0]

    return {
        "po.attention (memo)": lambda q, k, v: po.attention(q, k, v, causal=True),
        "custom op, eager": lambda q, k, v: torch.ops.portable_ops.attention_fwd(q, k, v, True, scale)[0],
        "torch.func path": lambda q, k, v: front._FuncAttention.apply(q, k, v, None, True, scale, None, None)[0],
        "checks + EagerAttention": checked_eager,
        "SDPA (scale)": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True),
    }


def time_us(fn, n):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main(argv):
    device = argv[0] if argv and not argv[0].startswith("-") else ("cuda" if torch.cuda.is_available() else "cpu")
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 7
    stand_in_backend(device)
    q = torch.randn(1, 4, 16, 64, device=device, requires_grad=True)
    k = torch.randn(1, 2, 16, 64, device=device, requires_grad=True)
    v = torch.randn(1, 2, 16, 64, device=device, requires_grad=True)
    dout = torch.randn(1, 4, 16, 64, device=device)
    results = {}
    with po.use_backend("triton"):
        for name, fn in paths(q, k, v).items():
            results[name] = {"fwd no grad": [], "fwd+bwd": []}
        for _ in range(rounds):
            for name, fn in paths(q, k, v).items():
                with torch.no_grad():
                    fn(q, k, v)
                    results[name]["fwd no grad"].append(time_us(lambda: fn(q, k, v), 300))

                def train_step(fn=fn):
                    torch.autograd.backward(fn(q, k, v), dout)
                train_step()
                results[name]["fwd+bwd"].append(time_us(train_step, 200))
    print(f"host us per call, median of {rounds} interleaved rounds ({device}, torch {torch.__version__}); "
          f"spread = max/min - 1")
    print(f"{'path':28s} {'fwd no grad':>12s} {'spread':>7s} {'fwd+bwd':>10s} {'spread':>7s}")
    for name, cols in results.items():
        a, b = cols["fwd no grad"], cols["fwd+bwd"]
        print(f"{name:28s} {statistics.median(a):12.1f} {max(a) / min(a) - 1:7.0%} {statistics.median(b):10.1f} "
              f"{max(b) / min(b) - 1:7.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
