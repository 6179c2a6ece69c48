"""Decode sweep: one-token decode under CUDA-graph replay, the split-key kernel's tiles and split
count forced, against cuDNN in the same run: what the decode policy of backends/triton/attention_configs.py
(``attention_configs.decode_tile_config``, ``key_splits``) is chosen from.

    PORTABLE_OPS_AUTOTUNE=0 python benchmarks/decode_sweep.py [--batches 1,4] [--caches 512,131072]
        [--configs 16x64x4x3,16x128x4x3] [--splits 1,4,16] [--rounds 3] [--before OLD.json] [--json F]

32 query heads over 8 KV heads, D 128, bf16. Variants: "shipped" (the policy in the checkout),
"before" (the tiles and split count an earlier run's JSON records as shipped, per cell; --before),
and every forced config x split count whose ranges hold a key tile. Each variant is captured in
its own graph, then all are timed round-robin ``--rounds`` times (median of 30 replays each; the
median of the rounds kept), so drift in clocks lands on every variant alike. Every output is
checked against cuDNN's (bf16 both; over 2e-2 is reported as wrong and the exit is non-zero)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

import portable_ops
import portable_ops.backends.triton.attention_configs as configs
import portable_ops.backends.triton.attention_plans as plans
from portable_ops.bench.attention import _sdpa_variants
from portable_ops.bench.common import graphed, median, median_ms
from portable_ops.cli import positive_int

api = importlib.import_module("portable_ops.attention")


def _ints(text):
    return [positive_int(x) for x in text.split(",")]


def _configs(text):
    configs = [tuple(positive_int(x) for x in c.split("x")) for c in text.split(",")]
    if any(len(c) != 4 for c in configs):
        raise argparse.ArgumentTypeError(f"expected BLOCK_MxBLOCK_NxWARPSxSTAGES configs, got {text!r}")
    return configs


def _forced(config, splits):
    """Patch the policy to ``config`` / ``splits`` (None: the shipped one); returns the undo."""
    shipped = configs.decode_tile_config, plans.key_splits
    if config is not None:
        configs.decode_tile_config = lambda *args: configs.TileConfig(*config)
    if splits is not None:
        plans.key_splits = lambda *args, **kwargs: splits
    _forget_plans()

    def undo():
        configs.decode_tile_config, plans.key_splits = shipped
        _forget_plans()
    return undo


def _forget_plans():
    """Every forward plan, and portable_ops.attention's memo, which holds the plans of the calls it saw."""
    plans.fwd_plans.clear()
    api._memo.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16, 64])
    parser.add_argument("--caches", type=_ints, default=[512 << i for i in range(9)])
    parser.add_argument("--configs", type=_configs,
                        default=_configs("16x64x4x3,16x64x4x4,16x128x4x3,16x128x8x3,16x32x4x4,16x64x8x4"))
    parser.add_argument("--splits", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=positive_int, default=1)
    parser.add_argument("--before", help="an earlier run's --json: its shipped tiles and splits, per cell")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it times CUDA graphs against cuDNN")
    before = {}
    if args.before:
        try:
            with open(args.before) as f:
                before = {(c["B"], c["cache"]): (tuple(c["shipped config"]), c["shipped splits"])
                          for c in json.load(f)}
        except (OSError, ValueError, TypeError, KeyError) as exc:
            parser.error(f"--before {args.before}: not a --json file of this sweep ({type(exc).__name__}: {exc})")
    if args.json:
        try:
            open(args.json, "a").close()
        except OSError as exc:
            parser.error(f"--json {args.json}: can't write it ({exc})")
    heads, kv_heads, d = 32, 8, 128
    rows, wrong = [], 0
    for b in args.batches:
        for s in args.caches:
            q = torch.randn(b, heads, 1, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, kv_heads, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            cudnn = _sdpa_variants(False, True)["sdpa cudnn"]
            ours = lambda q=q, k=k, v=v: portable_ops.attention(q, k, v, causal=True)  # noqa: E731
            cell = {"B": b, "cache": s}
            variants = [("shipped", None, None)]
            if (b, s) in before:
                variants.append(("before", *before[(b, s)]))
            variants += [(f"{c}/{n}", c, n) for c in args.configs for n in args.splits if s // n >= c[1]]
            with torch.no_grad():
                ref = cudnn(q, k, v)
                replays = {"cudnn": graphed(lambda q=q, k=k, v=v: cudnn(q, k, v))}
                for name, config, splits in variants:
                    undo = _forced(config, splits)
                    try:
                        # relative to the output's largest value: at 128k keys that is ~0.02, so an
                        # absolute bound would pass an output that dropped half the keys
                        err = ((ours().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                        if name == "shipped":
                            plan = next(iter(plans.fwd_plans.values()))
                            options = plan.fwd.options
                            cell["shipped config"] = [options[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps",
                                                                               "num_stages")]
                            cell["shipped splits"] = plan.splits
                        replays[name] = graphed(ours)
                    except Exception as exc:  # noqa: BLE001 -- out of shared memory for a config, say (OutOfResources)
                        print(f"B {b} cache {s} {name}: {str(exc).splitlines()[0][:80]}", flush=True)
                        continue
                    finally:
                        undo()
                    if not err <= 2e-2:  # NaN included
                        wrong += 1
                        print(f"WRONG B {b} cache {s} {name}: max abs diff {err:.3g} of the largest output",
                              flush=True)
                rounds = {name: [] for name in replays}
                for _ in range(args.rounds):
                    for name, replay in replays.items():
                        rounds[name].append(1e3 * median_ms(replay))
            timed = {name: median(us) for name, us in rounds.items()}
            cudnn_us = timed.pop("cudnn")
            if "shipped" not in timed:
                sys.exit(f"B {b} cache {s}: the shipped policy failed (above)")
            forced = [n for n in timed if n not in ("shipped", "before")]
            best = min(forced, key=timed.get) if forced else "shipped"
            cell.update({"cudnn": cudnn_us, "shipped": timed["shipped"], "before": timed.get("before"), "best": best,
                         "best us": timed[best], "all": timed})
            rows.append(cell)
            was = f"before {cudnn_us / cell['before']:.2f}x  " if cell["before"] else ""
            print(f"B {b:3d} cache {s:6d}: cudnn {cudnn_us:8.1f}  shipped {cell['shipped']:8.1f} "
                  f"({cell['shipped splits']} splits, {cudnn_us / cell['shipped']:.2f}x)  {was}best {best} "
                  f"{cell['best us']:8.1f} ({cudnn_us / cell['best us']:.2f}x)", flush=True)
            del q, k, v, ours, ref, replays
            if args.json:  # after every cell: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print("\nratio cuDNN / ours: the best split count per config (the count), then shipped and before:")
    print("B cache " + " ".join(f"{str(c):>18}" for c in args.configs) + "  shipped  before")
    for cell in rows:
        line = f"{cell['B']} {cell['cache']} "
        for c in args.configs:
            mine = {n: us for n, us in cell["all"].items() if n.startswith(f"{c}/")}
            name = min(mine, key=mine.get) if mine else None
            line += f"{cell['cudnn'] / mine[name]:>13.2f} ({name.split('/')[1]:>2}) " if name else f"{'-':>18} "
        line += f" {cell['cudnn'] / cell['shipped']:.2f} ({cell['shipped splits']})"
        line += f"  {cell['cudnn'] / cell['before']:.2f}" if cell["before"] else ""
        print(line)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
