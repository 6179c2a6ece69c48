"""python -m portable_ops.bench optimizer|clip|attention|decode [--out DIR]

Times portable_ops against PyTorch's own kernels in the same run, on the GPU, prints a table,
and writes JSON and a plot into DIR (default docs/perf).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .common import device_info, table, write

COLUMNS = {
    "optimizer": ["bench", "variant", "ms", "host ms", "TB/s", "of copy", "vs torch fused", "steady ms",
                  "steady vs torch fused"],
    "clip": ["bench", "variant", "ms", "clip ms", "vs torch pair", "steady ms", "steady vs torch pair"],
    "attention": ["variant", "dir", "D", "S", "B", "Hkv", "causal", "ms", "TFLOP/s", "steady ms", "steady TFLOP/s",
                  "error"],
    "decode": ["variant", "B", "cache", "us", "steady us", "graph us", "graph GB/s", "max abs diff", "error"],
}


def _curves(ax, rows, *, x, y, series, label):
    """One line per distinct value of the ``series`` fields, through the rows that measured ``y``."""
    for values in sorted({tuple(r[f] for f in series) for r in rows}):
        pts = sorted((r[x], r[y]) for r in rows if tuple(r[f] for f in series) == values and r.get(y))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label.format(*values))


def plot(name, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    if name == "decode":
        _curves(ax, rows, x="cache", y="graph us", series=("variant", "B"), label="{} B={}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("KV cache length (Sq = 1, 32 query heads over 8 KV heads, D=128, bf16)")
        ax.set_ylabel("us per call, CUDA graph replay")
    elif name == "attention":
        hkv = max(r["Hkv"] for r in rows)  # one curve per variant and direction: one KV-head count
        _curves(ax, [r for r in rows if r["D"] == 128 and not r["causal"] and r["Hkv"] == hkv],
                x="S", y="TFLOP/s", series=("variant", "dir"), label="{} {}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"sequence length (D=128, non-causal, {hkv} KV heads, bf16)")
        ax.set_ylabel("TFLOP/s")
    else:
        timed = [r for r in rows if r.get("ms")]
        ax.barh([f"{r['bench']}: {r['variant']}" for r in timed], [r["ms"] for r in timed])
        ax.set_xlabel("ms per step (lower is better)")
    if name in ("attention", "decode"):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_ops.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=sorted(COLUMNS))
    parser.add_argument("--out", default="docs/perf")
    parser.add_argument("--quick", action="store_true", help="fewer attention shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmarks time CUDA kernels against torch's; no CUDA device here", file=sys.stderr)
        return 2
    if args.bench == "optimizer":
        from .optimizer import run_optimizer as run
    elif args.bench == "clip":
        from .optimizer import run_clip_step as run
    elif args.bench == "decode":
        from .attention import run_decode as run
    else:
        from .attention import run_attention

        run = (lambda: run_attention(seqs=(1024, 4096), head_dims=(128,), kv_heads=(16,))) if args.quick \
            else run_attention
    rows = run()
    info = device_info()
    path = write(args.bench, rows, info, args.out)
    try:
        plot(args.bench, rows, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(table(rows, COLUMNS[args.bench]))
    print(f"{info['device']}, {info['date']}, torch {info['torch']}, triton {info['triton']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
