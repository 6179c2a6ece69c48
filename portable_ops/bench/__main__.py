"""python -m portable_ops.bench train|optimizer|clip|attention|decode|features|ops|hf|attention-host|nki|fallback
    [--out DIR]

Times portable_ops against PyTorch's own kernels in the same run, on the GPU, prints a table,
and writes JSON and a plot into DIR (default docs/perf). ``train`` is the headline: a Llama-style
model trained with each stack, eager and compiled (portable_ops/bench/train.py). ``hf`` trains
transformers' Llama and Mistral with each of its attention implementations and with portable_ops'
through the integration (portable_ops/bench/hf.py); ``hf --tiny`` is a CPU smoke run.
``ops`` times the step's other ops (norms, RoPE, linear cross-entropy) against torch eager and compiled
(portable_ops/bench/ops.py).
``attention --head-dims 40,80,96,192`` times those head dims and their next powers of two, with
each odd one's TFLOP/s as a fraction of its power of two's (``of pow2``). Three need no GPU:
``attention-host`` measures the triton backend's host time per call with no-op launches (and the norms'
through the public functions, beside torch's),
``nki`` estimates the NKI kernels' time on Trn2/Trn3 from the emulator's counts
(portable_ops/bench/nki.py), and ``fallback`` times each op with the backend forced to ``reference``
against torch's fastest call for the same work, on CUDA when available, else the CPU (``--device``
picks; ``--quick``: fewer, shorter rounds; portable_ops/bench/fallback.py).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .. import cli
from .common import device_info, table, write

COLUMNS = {
    "optimizer": ["bench", "variant", "ms", "host ms", "TB/s", "of copy", "vs torch fused", "steady ms",
                  "steady vs torch fused"],
    "clip": ["bench", "variant", "ms", "clip ms", "vs torch pair", "steady ms", "steady vs torch pair"],
    "attention": ["variant", "dir", "D", "S", "B", "Hkv", "causal", "ms", "TFLOP/s", "of pow2", "steady ms",
                  "steady TFLOP/s", "error"],
    "attention-host": ["variant", "dir", "device", "B", "S", "Hq", "Hkv", "D", "host us"],
    "decode": ["variant", "B", "cache", "us", "steady us", "graph us", "graph GB/s", "max abs diff", "error"],
    "features": ["feature", "variant", "dir", "shape", "ms", "TFLOP/s", "steady ms", "steady TFLOP/s", "us",
                 "contiguous_us", "of_contiguous", "error"],
    "ops": ["op", "case", "dtype", "dir", "ours ms", "torch ms", "compiled ms", "vs torch", "vs compiled",
            "max abs diff"],
    "train": [],  # its own tables: portable_ops.bench.train.report
    "hf": ["model", "mode", "attention", "tokens/s", "tokens/s min", "tokens/s max", "vs best transformers", "ms/step",
           "warm-up s", "graphs", "graph breaks", "graphs compiled while timed", "peak GiB", "final loss",
           "loss - sdpa's", "max |loss - sdpa's|", "transformers' own loss spread", "error"],
    "fallback": ["op", "case", "dtype", "device", "ours ms", "torch ms", "ratio", "target", "spread"],
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
        # one curve per variant and direction: one head dim (128 where the run has it) and KV-head count
        dims = {r["D"] for r in rows}
        if not dims:
            raise ValueError("no attention rows to plot")
        d = 128 if 128 in dims else min(dims)
        hkv = max(r["Hkv"] for r in rows if r["D"] == d)
        _curves(ax, [r for r in rows if r["D"] == d and not r["causal"] and r["Hkv"] == hkv],
                x="S", y="steady TFLOP/s", series=("variant", "dir"), label="{} {}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"sequence length (D={d}, non-causal, {hkv} KV heads, bf16)")
        ax.set_ylabel("TFLOP/s, back to back (steady)")
    else:
        timed = [r for r in rows if r.get("ms")]
        ax.barh([f"{r['bench']}: {r['variant']}" for r in timed], [r["ms"] for r in timed])
        ax.set_xlabel("ms per step (lower is better)")
    if name in ("attention", "decode"):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _shape_names(text: str) -> list[str]:
    from .train import SHAPES

    names = list(SHAPES)
    picked = []
    for item in (x.strip() for x in text.split(",")):
        if item.isdigit() and 1 <= int(item) <= len(names):
            picked.append(names[int(item) - 1])
        elif item in SHAPES:
            picked.append(item)
        else:
            choices = ", ".join(f"{i} ({name})" for i, name in enumerate(names, 1))
            raise argparse.ArgumentTypeError(f"unknown train shape {item!r}; choose from {choices}")
    return list(dict.fromkeys(picked))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m portable_ops.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=sorted([*COLUMNS, "nki"]))
    parser.add_argument("--out", default="docs/perf")
    parser.add_argument("--quick", action="store_true",
                        help="attention: fewer shapes; fallback: fewer, shorter rounds")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="fallback: where to run (default: cuda when available, else cpu)")
    parser.add_argument("--tiny", action="store_true",
                        help="train, hf: every shape shrunk to a few seconds of CPU (a smoke run, not a measurement)")
    parser.add_argument("--head-dims", type=_ints, default=None,
                        help="attention head dims, e.g. 40,64,80,96,128,192,256 (each odd one's next power of two is "
                             "added)")
    parser.add_argument("--seqs", type=_ints, default=None, help="attention sequence lengths, e.g. 2048,4096")
    parser.add_argument("--shapes", type=_shape_names, default=None,
                        help="train: a comma-separated subset of its shapes, by number from 1 or by name "
                             "(default: all of them)")
    parser.add_argument("--repeats", type=cli.positive_int, default=None,
                        help="train: runs of every stack per shape and mode, in rotating order (default 3; 1 with "
                             "--tiny)")
    args = parser.parse_args(argv)
    applies = {"--quick": "attention or fallback", "--head-dims": "attention", "--seqs": "attention",
               "--tiny": "train or hf", "--shapes": "train", "--device": "fallback", "--repeats": "train"}
    for option, bench in applies.items():
        if getattr(args, option[2:].replace("-", "_")) not in (None, False) and args.bench not in bench.split(" or "):
            parser.error(f"{option} applies to the {bench} benchmark, not {args.bench}")
    try:  # before minutes of timing, not when the results are written
        cli.writable_folder("--out", args.out)
    except ValueError as exc:
        parser.error(str(exc))
    if args.bench == "nki":
        from .nki import run as run_nki
        return run_nki(args.out)
    if args.bench == "attention-host":
        from .attention import NORM_HOST_COLUMNS, run_attention_host, run_norm_host

        rows = run_attention_host()
        print(table(rows, COLUMNS[args.bench]))
        print("CPU host time per call with no-op kernel launches (not GPU time)" if rows[0]["device"] == "cpu"
              else "host time per call with no-op kernel launches")
        print(table(run_norm_host(), NORM_HOST_COLUMNS))
        return 0
    if args.bench == "fallback":
        from .fallback import fallback_info, pick_device, run_fallback

        try:
            device = pick_device(args.device)
        except ValueError as exc:
            parser.error(str(exc))
        rows = run_fallback(device, quick=args.quick, log=lambda line: print(line, file=sys.stderr, flush=True))
        info = fallback_info(device)
        path = write(args.bench, rows, info, args.out)  # the table is the figure: no plot
        print(table(rows, COLUMNS[args.bench]))
        print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}; wrote {path}")
        return 0
    if not torch.cuda.is_available() and not (args.bench in ("train", "hf") and args.tiny):
        print("the benchmarks time CUDA kernels against torch's; no CUDA device here", file=sys.stderr)
        return 2
    if args.bench == "hf":
        from . import hf

        rows, info = hf.run_cli(args.tiny)
        path = write("hf", rows, info, args.out)
        print(table(rows, COLUMNS["hf"]))
        print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, "
              f"triton {info['triton']}, transformers {info['transformers']}; wrote {path}")
        return 0
    if args.bench == "train":
        from . import train

        shapes = {name: train.SHAPES[name] for name in args.shapes or train.SHAPES}
        if args.tiny:
            shapes = {name: train.tiny(cfg) for name, cfg in shapes.items()}
        info = device_info()
        repeats = args.repeats or (1 if args.tiny else 3)
        print(train.report(train.run_train(shapes, second_run=not args.tiny, repeats=repeats), info, args.out))
        print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, "
              f"triton {info['triton']}")
        return 0
    if args.bench == "optimizer":
        from .optimizer import run_optimizer as run
    elif args.bench == "clip":
        from .optimizer import run_clip_step as run
    elif args.bench == "decode":
        from .attention import run_decode as run
    elif args.bench == "features":
        from .features import run_features as run
    elif args.bench == "ops":
        from .ops import run_ops as run
    else:
        from .attention import run_attention

        shape = dict(seqs=(1024, 4096), head_dims=(128,), kv_heads=(16,)) if args.quick else {}
        if args.head_dims:
            shape["head_dims"] = args.head_dims
        if args.seqs:
            shape["seqs"] = args.seqs
        run = lambda: run_attention(**shape)  # noqa: E731
    rows = run()
    info = device_info()
    path = write(args.bench, rows, info, args.out)
    try:
        if args.bench not in ("features", "ops"):  # mixed units: the table is the figure
            plot(args.bench, rows, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(table(rows, COLUMNS[args.bench]))
    print(f"{info['device']}, {info['date']}, commit {info['commit']}, torch {info['torch']}, triton {info['triton']}; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
