"""The results tables of README.md and docs/performance.md, rendered from docs/perf/<bench>.json.

    python benchmarks/docs_tables.py           # rewrite every rendered block in place
    python benchmarks/docs_tables.py --check   # exit 1, naming each block that differs

A rendered block is the text between ``<!-- results: NAME -->`` and ``<!-- /results -->``. NAME is one
of ``RENDERERS``: each reads its benchmark's results file (the latest run of record, written by
``python -m portable_ops.bench NAME``) and prints its tables and, once, where the figures come from:
device, date, commit, versions and the command that produced the file. tests/test_docs_figures.py
re-renders every block and checks that no ratio or throughput figure of these docs lies outside one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import re
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "perf"
DOCS = (ROOT / "README.md", ROOT / "docs" / "performance.md")
BLOCK = re.compile(r"(<!-- results: (\S+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)
MET = 0.995  # a cell at this fraction of its target or above counts as met: runs move cells by a few %


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def pair(ours: float, theirs: float, digits: int = 2) -> str:
    return f"{ours:.{digits}f} / {theirs:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def provenance(name: str, info: dict) -> str:
    versions = ", ".join(f"{k} {info[k]}" for k in ("torch", "triton") if info.get(k))
    commit = f"commit {info['commit']}" if info.get("commit") else "commit not recorded"
    return (f"{info['device']}, {info['date']}, {commit}, {versions}. Command: {info['command']}. "
            f"Results: `docs/perf/{name}.json`.")


# --- the training benchmark -------------------------------------------------------------------------------

def _shape_label(name: str) -> str:
    from portable_ops.bench.train import SHAPES

    cfg = SHAPES.get(name)
    if cfg is None:
        return name
    return (f"d{cfg.d_model}, {cfg.layers} layers, {cfg.heads}/{cfg.kv_heads} heads of {cfg.d_model // cfg.heads}, "
            f"seq {cfg.seq}, batch {cfg.batch}")


def _runs(rows: dict) -> dict:
    """(shape, mode, stack) -> the run's row."""
    return {(r["shape"], r["mode"], r["stack"]): r for r in rows["runs"]}


def _modes(runs: dict) -> list[tuple[str, str]]:
    return list(dict.fromkeys((shape, mode) for shape, mode, _ in runs))


def headline() -> str:
    results = load("train")
    runs = _runs(results["rows"])
    shapes = list(dict.fromkeys(shape for shape, _ in _modes(runs)))
    all_ops = "all-ops" in _stacks(runs)

    def faster(shape, mode, field):  # torch's time over ours: above 1, ours is faster
        return ratio(runs[shape, mode, "torch"][field] / runs[shape, mode, "portable_ops"][field])

    def all_ops_cells(shape):
        if not all_ops:
            return []
        ours, torch = runs[shape, "eager", "all-ops"], runs[shape, "eager", "torch"]
        return [ratio(ours["vs torch"]), ratio(runs[shape, "compiled", "all-ops"]["vs torch"]),
                ratio(ours["peak GiB"] / torch["peak GiB"])]

    rows = [[_shape_label(s), ratio(runs[s, "eager", "portable_ops"]["vs torch"]),
             ratio(runs[s, "compiled", "portable_ops"]["vs torch"])] + all_ops_cells(s)
            + [faster(s, "eager", "attention fwd ms"), faster(s, "eager", "attention bwd ms"),
               faster(s, "eager", "optimizer ms")] for s in shapes]
    header = (["shape", "step, eager", "step, compiled"]
              + (["all ops: eager", "all ops: compiled", "all ops: peak memory"] if all_ops else [])
              + ["attention forward", "attention backward", "clip + AdamW"])
    return "\n\n".join([table(header, rows), provenance("train", results["info"])])


def _stacks(runs: dict) -> list[str]:
    """The portable_ops stacks a train result holds, in its order ("portable_ops", then "all-ops" where run)."""
    return [stack for stack in dict.fromkeys(stack for _, _, stack in runs) if stack != "torch"]


def _repeats(rows: dict) -> str:
    counts = {r.get("repeats", 1) for r in rows["runs"]}
    if counts == {1}:
        return "Every stack ran once"
    return (f"Every stack ran {'/'.join(map(str, sorted(counts)))} times in rotating order; a row is its median "
            "run, with the median of its ratios to torch's run of the same repeat and their range")


def train() -> str:
    results = load("train")
    rows = results["rows"]
    runs = _runs(rows)
    speed, kernels = [], []
    for (shape, mode), stack in itertools.product(_modes(runs), _stacks(runs)):
        ours, torch = runs[shape, mode, stack], runs[shape, mode, "torch"]
        host = "-"
        if "host ms/step" in ours:  # "waited": a step outlasted the sleep queued ahead of it (no host time taken)
            host = " / ".join(v if isinstance(v, str) else f"{v:.1f}"
                              for v in (ours["host ms/step"], torch["host ms/step"]))
        peak = pair(ours["peak GiB"], torch["peak GiB"], 1) if ours.get("peak GiB") is not None else "-"
        spread = ours.get("vs torch range")
        speed.append([_shape_label(shape), mode, stack, f"{torch['tokens/s']:,.0f}", f"{ours['tokens/s']:,.0f}",
                      f"**{ratio(ours['vs torch'])}**", f"{ratio(spread[0])} to {ratio(spread[1])}" if spread else "-",
                      pair(ours["ms/step"], torch["ms/step"], 1),
                      pair(ours["busy ms/step"], torch["busy ms/step"], 1), host, peak])
        kernels.append([_shape_label(shape), mode, stack] + [pair(ours[f], torch[f]) for f in
                                                             ("attention fwd ms", "attention bwd ms", "optimizer ms",
                                                              "other ms")])
    losses = [[_shape_label(r["shape"]), r["mode"], r.get("stack", "portable_ops"),
               pair(r["max |loss diff|"], r["last-10 mean |diff|"], 3), r["torch's own spread"],
               "yes" if r["agree"] else "**no**"] for r in rows["losses"]]
    warm = {(r["shape"], r["mode"], r["stack"]): r["second-run warm-up s"] for r in rows["second run"]}
    host = {(r["shape"], r["stack"]): r for r in rows["attention host"]}
    second = []
    for shape in dict.fromkeys(s for s, _ in _modes(runs)):
        ours, sdpa = host[shape, "portable_ops"], host[shape, "torch"]
        second.append([_shape_label(shape), pair(ours["host us fwd"], sdpa["host us fwd"], 0),
                       pair(ours["host us bwd"], sdpa["host us bwd"], 0)]
                      + [pair(warm[shape, mode, "portable_ops"], warm[shape, mode, "torch"])
                         for mode in ("eager", "compiled")])
    return "\n\n".join([
        ("Stacks: portable_ops (its attention and fused clip + AdamW, torch's norms, RoPE and loss), all-ops "
         "(every part portable_ops has: also its RMSNorm, RoPE and linear cross-entropy), each against torch's. "
         f"{_repeats(rows)}:"),
        table(["shape", "mode", "stack", "torch tokens/s", "ours tokens/s", "vs torch", "range over repeats",
               "ms a step (ours / torch)",
               "device-busy ms", "host ms", "peak GiB"], speed),
        "Device time a step by kernel kind, ms (ours / torch's):",
        table(["shape", "mode", "stack", "attention forward", "attention backward", "clip + optimizer", "other"],
              kernels),
        ("Loss curves (max and last-10 mean of the gap to torch's; it agrees within 0.05 / 0.02 or within "
         "torch's own spread, the widest gap among its eager, compiled and flash-attention runs):"),
        table(["shape", "mode", "stack", "gap to torch", "torch's own spread", "agrees"], losses),
        ("Host time of one attention call (us, ours / SDPA's, the device idle before it) and a second run's "
         "warm-up in a fresh process with every cache filled (s, ours / torch's):"),
        table(["shape", "attention forward", "attention backward", "warm-up, eager", "warm-up, compiled"], second),
        provenance("train", results["info"])])


# --- Hugging Face transformers through the integration ---------------------------------------------------

def _hf_shape(shape: dict) -> str:
    window = f", sliding window {shape['window']}" if shape.get("window") else ""
    return (f"hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']}/{shape['kv_heads']} heads, "
            f"intermediate {shape['intermediate']}, vocab {shape['vocab']}, seq {shape['seq']}, "
            f"batch {shape['batch']}{window}")


def hf() -> str:
    results = load("hf")
    info = results["info"]
    rows = []
    for r in results["rows"]:
        name = f"**{r['attention']}**" if r["attention"] == "portable_ops" else r["attention"]
        if "tokens/s" not in r:  # the variant failed; the bench recorded why
            rows.append([r["model"], r["mode"], name, "failed: " + r["error"].replace("|", "\\|")] + ["-"] * 7)
            continue
        versus = f"{ratio(r['vs best transformers'])} ({r['best transformers']})"
        gap, widest = r.get("loss - sdpa's"), r.get("max |loss - sdpa's|")
        graphs = "-" if "graphs" not in r else f"{r['graphs']} / {r['graph breaks']}" + (
            f", {r['graphs compiled while timed']} more while timed" if r["graphs compiled while timed"] else "")
        rows.append([r["model"], r["mode"], name, f"{r['tokens/s']:,.0f}",
                     f"{r['tokens/s min']:,.0f} to {r['tokens/s max']:,.0f}",
                     f"**{versus}**" if r["attention"] == "portable_ops" else versus, graphs,
                     "-" if r.get("peak GiB") is None else f"{r['peak GiB']:.1f}", f"{r['final loss']:.3f}",
                     "-" if gap is None else f"{gap:+.3f}", "-" if widest is None else f"{widest:.3f}"])
    spread = {r["model"]: r.get("transformers' own loss spread") for r in results["rows"] if "tokens/s" in r}
    shapes = "; ".join(f"{name}: {_hf_shape(shape)}" for name, shape in info["shapes"].items() if name in spread)
    autocast = "bf16 autocast" if info.get("autocast") else "no autocast"
    return "\n\n".join([
        table(["model", "mode", "attention", "tokens/s (median)", "range over rounds", "vs best transformers",
               "graphs / breaks", "peak GiB", "final loss", "minus sdpa's", "largest gap to sdpa"], rows),
        (f"{shapes}; fp32 parameters, {autocast}. {info['warm-up steps']} warm-up steps per variant, then "
         f"{info['rounds']} rounds of {info['timed steps per round']} timed steps, the variants of a model and mode "
         "in turn. transformers' own loss spread, the largest gap over all steps between two runs of its "
         "implementations: " + ", ".join(f"{m} {'-' if v is None else f'{v:.3f}'}" for m, v in spread.items())
         + "."),
        f"transformers {info['transformers']}. " + provenance("hf", info)])


# --- the optimizer and the clip ---------------------------------------------------------------------------

def optimizer() -> str:
    results = load("optimizer")
    by_name = {(r["bench"], r["variant"]): r for r in results["rows"]}

    def cell(row, field, fmt):
        return fmt(row[field]) if row and row.get(field) is not None else "-"

    rows = []
    for (bench, variant), row in by_name.items():
        name = variant.removesuffix(", graph")
        if bench == "copy" or variant != name and (bench, name) in by_name:  # a graph row joins its variant's
            continue
        drained = row if variant == name else None
        graph = by_name.get((bench, name + ", graph"))
        rows.append([bench, name, cell(drained, "ms", "{:.2f}".format),
                     cell(drained, "steady ms", "{:.2f}".format), cell(graph, "ms", "{:.2f}".format),
                     cell(graph, "of copy", "{:.1%}".format), cell(drained, "steady vs torch fused", ratio),
                     cell(graph, "vs torch fused", ratio), cell(drained, "host ms", "{:.2f}".format)])
    copy = by_name["copy", "device copy"]
    return "\n\n".join([
        table(["step", "variant", "ms", "steady ms", "graph ms", "of copy (graph)", "vs torch fused (steady)",
               "vs torch fused (graph)", "host ms"], rows),
        f"{copy['tensors']} tensors, {copy['elements'] / 1e6:.1f}M elements; device copy bandwidth in the same run "
        f"{copy['TB/s']:.2f} TB/s (read + write). " + provenance("optimizer", results["info"])])


def clip() -> str:
    results = load("clip")
    by_name = {r["variant"]: r for r in results["rows"]}
    rows = []
    for variant, row in by_name.items():
        if variant.endswith("graph"):
            continue
        graph = by_name[variant + ", graph"]
        rows.append([variant, f"{row['ms']:.2f}", f"{row['steady ms']:.2f}", f"{graph['ms']:.2f}",
                     f"{graph['clip ms']:.2f}", ratio(row["steady vs torch pair"]), ratio(graph["vs torch pair"])])
    return "\n\n".join([table(["variant", "ms", "steady ms", "graph ms", "of which the norm (graph ms)",
                               "vs torch's pair (steady)", "vs torch's pair (graph)"], rows),
                        provenance("clip", results["info"])])


# --- attention --------------------------------------------------------------------------------------------

def _attention_cells(rows: list[dict]) -> dict:
    return {(r["variant"], r["dir"], r["D"], r["S"], r["Hkv"], r["causal"]): r for r in rows}


def _seq(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 else str(s)


def attention() -> str:
    results = load("attention")
    cells = _attention_cells(results["rows"])
    heads = sorted({k[4] for k in cells}, reverse=True)
    shapes = sorted({(k[2], k[3], k[5]) for k in cells})

    def vs(direction, d, s, causal, field="steady TFLOP/s", other="sdpa cudnn"):
        return [cells["portable_ops", direction, d, s, h, causal][field]
                / cells[other, direction, d, s, h, causal][field] for h in heads]

    rows = []
    for d, s, causal in shapes:
        mine = {direction: cells["portable_ops", direction, d, s, heads[0], causal] for direction in ("fwd", "bwd")}
        cudnn = {direction: cells["sdpa cudnn", direction, d, s, heads[0], causal] for direction in ("fwd", "bwd")}
        row = [str(d), _seq(s), "yes" if causal else "no"]
        for direction in ("fwd", "bwd"):
            row += [f"{mine[direction]['steady TFLOP/s']:.0f}", f"{cudnn[direction]['steady TFLOP/s']:.0f}",
                    "**" + " / ".join(map(ratio, vs(direction, d, s, causal))) + "**"]
        row += [" / ".join(map(ratio, vs(direction, d, s, causal, "TFLOP/s"))) for direction in ("fwd", "bwd")]
        row += [" / ".join(ratio(vs(direction, d, s, causal, other="sdpa flash")[0]) for direction in ("fwd", "bwd"))]
        rows.append(row)
    kv = " / ".join(map(str, heads))
    main = table(["D", "S", "causal", "fwd ours", "fwd cuDNN", f"fwd vs cuDNN ({kv} KV heads)", "bwd ours",
                  "bwd cuDNN", f"bwd vs cuDNN ({kv})", f"drained fwd vs cuDNN ({kv})", f"drained bwd vs cuDNN ({kv})",
                  f"vs flash, fwd / bwd ({heads[0]})"], rows)
    targets = []
    for direction in ("fwd", "bwd"):
        for d in sorted({d for d, _, _ in shapes} - {256}):
            for causal in (False, True):
                got = [x for dd, s, c in shapes if dd == d and c == causal and s >= 2048
                       for x in vs(direction, d, s, causal)]
                targets.append([{"fwd": "forward", "bwd": "backward"}[direction], str(d), "yes" if causal else "no",
                                f"{ratio(min(got))} to {ratio(max(got))}",
                                f"{sum(x >= MET for x in got)} of {len(got)}"])
    summary = table(["target: at least cuDNN's speed from 2k", "D", "causal", "steady, vs cuDNN", "cells met"], targets)
    return "\n\n".join([main, summary, provenance("attention", results["info"])])


def decode() -> str:
    results = load("decode")
    cells = {(r["variant"], r["B"], r["cache"]): r for r in results["rows"]}
    batches = sorted({b for _, b, _ in cells})
    caches = sorted({c for _, _, c in cells})

    def graph_vs(b, c):  # cuDNN's replay time over ours: above 1, ours is faster
        return cells["sdpa cudnn", b, c]["graph us"] / cells["portable_ops", b, c]["graph us"]

    grid = [[str(b)] + [f"{graph_vs(b, c):.2f}" for c in caches] for b in batches]
    every = [graph_vs(b, c) for b in batches for c in caches]
    detail = []
    for b in batches:
        for c in caches[::3]:
            ours, cudnn = cells["portable_ops", b, c], cells["sdpa cudnn", b, c]
            flash = cells.get(("sdpa flash (K/V expanded)", b, c), {})
            detail.append([str(b), _seq(c), pair(ours["graph us"], cudnn["graph us"], 1),
                           pair(ours["graph GB/s"], cudnn["graph GB/s"], 0),
                           pair(ours["steady us"], cudnn["steady us"], 0),
                           f"{flash['graph us']:.1f}" if flash.get("graph us") else "-"])
    gmean = math.exp(sum(map(math.log, every)) / len(every))
    return "\n\n".join([
        "Kernel time under CUDA-graph replay, cuDNN's over ours (above 1: ours is faster), by batch and keys:",
        table(["B"] + [_seq(c) for c in caches], grid),
        f"{sum(x >= MET for x in every)} of {len(every)} cells at {MET} or above; geometric mean {ratio(gmean)}.",
        table(["B", "keys", "graph us (ours / cuDNN)", "graph GB/s", "steady us, eager calls back to back",
               "flash on expanded K/V, graph us"], detail),
        provenance("decode", results["info"])])


# --- attention features and the NKI estimates -------------------------------------------------------------

def features() -> str:
    results = load("features")
    dense = [r for r in results["rows"] if r["feature"] != "paged decode"]
    rows = []
    for feature, direction in dict.fromkeys((r["feature"], r["dir"]) for r in dense):
        group = [r for r in dense if (r["feature"], r["dir"]) == (feature, direction)]
        ours, others = group[0], group[1:]
        for other in others:
            rows.append([f"{ours['variant']}, {direction}", ours["shape"], f"{ours['steady TFLOP/s']:.0f}",
                         f"{other['variant']}: {other['steady TFLOP/s']:.0f}",
                         ratio(ours["steady TFLOP/s"] / other["steady TFLOP/s"])])
    paged = {}
    for r in results["rows"]:
        if r["feature"] == "paged decode":
            paged.setdefault(r["shape"], []).append(r)
    paged_rows = [[shape] + [f"{ratio(r['of_contiguous'])} ({r['us']:.0f} us)" for r in group]
                  + [f"{group[0]['contiguous_us']:.0f}"] for shape, group in paged.items()]
    pages = [r["variant"].removeprefix("ours paged ").strip("()") for r in next(iter(paged.values()))]
    return "\n\n".join([
        table(["ours", "shape", "steady TFLOP/s", "against (steady TFLOP/s)", "ours vs it"], rows),
        ("Paged decode against our decode from a contiguous cache holding the same keys, CUDA-graph replay "
         "(above 1: the paged call is faster):"),
        table(["shape"] + pages + ["contiguous us"], paged_rows),
        provenance("features", results["info"])])


def nki() -> str:
    results = load("nki")
    rows = [[r["kernel"], r["instructions t/v/s/g/dma"], f"{r['HBM GB']:.2f}",
             f"{r['SBUF KiB']:.0f} / {r['PSUM banks']}"]
            + [f"{pair(r[f'{chip} ms'], r[f'{chip} floor ms'])} ({ratio(r[f'{chip} x floor'])}, {r[f'{chip} bound']})"
               for chip in ("Trn2", "Trn3")] for r in results["rows"]]
    return "\n\n".join([table(["kernel (one launch each)", "instructions tensor/vector/scalar/gpsimd/dma", "HBM GB",
                               "SBUF KiB / PSUM banks (peak)", "Trn2 ms: estimate / floor (ratio, bound)",
                               "Trn3 ms: estimate / floor (ratio, bound)"], rows),
                        provenance("nki", results["info"])])


# --- the reference backend against torch's best ------------------------------------------------------------

def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _calls(calls: dict) -> str:
    """The torch calls of one op: the first, then each other as what it adds and the cases (by their first
    word) that take it."""
    first, *others = calls
    text = first
    for call in others:
        added = call.removeprefix(first).lstrip(", ") if call.startswith(first) else call
        text += f" ({added} for {', '.join(calls[call])})"
    return text


def fallback(name: str = "fallback") -> str:
    results = load(name)
    rows, missed, against = [], [], {}
    timed = [r for r in results["rows"] if r.get("ratio") is not None and r.get("target") is not None]
    for r in results["rows"]:
        if r.get("ratio") is None:  # not run: gpt2_tiny outside a checkout
            rows.append([r["op"], f"skipped: {r.get('note', r['case'])}", r["dtype"]] + ["-"] * 6)
            continue
        if r.get("target") is None:  # torch against itself: the measure's own bias
            rows.append([r["op"], r["case"], r["dtype"], _ms(r["ours ms"]), _ms(r["torch ms"]), ratio(r["ratio"]),
                         "none (the measure's bias)", f"{ratio(r['ratio min'])} to {ratio(r['ratio max'])}", "-"])
            continue
        met = r["met"]
        cell = ratio(r["ratio"])
        rows.append([r["op"], r["case"], r["dtype"], _ms(r["ours ms"]), _ms(r["torch ms"]),
                     cell if met else f"**{cell}**", r["target"].replace(">=", "at least").replace("<=", "at most"),
                     f"{ratio(r['ratio min'])} to {ratio(r['ratio max'])}", "yes" if met else "**no**"])
        if not met:
            missed.append(f"{r['op']} ({r['case']}, {r['dtype']}): {cell}")
        family = "attention" if r["op"].startswith("attention") else r["op"]
        against.setdefault(family, {}).setdefault(r["torch"], {})[r["case"].split()[0]] = None
    gpt2 = next((r for r in timed if r["op"] == "gpt2_tiny train"), None)
    rounds = sorted({r["rounds"] for r in timed if r is not gpt2})
    compared = "; ".join(f"{op}, {_calls(calls)}" for op, calls in against.items())
    method = (f"Against: {compared}. Each row is timed in {' or '.join(map(str, rounds))} rounds, the two sides "
              "taking turns call by call and leading in alternate rounds; a round gives each side's median call. "
              "Shown: each side's median over rounds (ms a call), the median of the rounds' ratios (ours over "
              "torch's time) and their range.")
    if gpt2:
        pairs = f"{gpt2['rounds']} pair{'s' if gpt2['rounds'] != 1 else ''}"
        method += (f" gpt2_tiny: {pairs} of {gpt2['iters']}-step runs, each stack's median ms a step (from "
                   "tokens/s) and the median of ours over torch's tokens/s.")
    verdict = f"{sum(r['met'] for r in timed)} of {len(timed)} rows meet their target"
    verdict += f"; missed: {'; '.join(missed)}." if missed else "."
    notes = [method, verdict]
    if results["info"].get("uncommitted"):
        notes.append("The run's checkout had changes not in its commit, to: "
                     + ", ".join(f"`{path}`" for path in results["info"]["uncommitted"]) + ".")
    return "\n\n".join([table(["op", "case", "dtype", "ours ms", "torch ms", "ours / torch", "target",
                                "range over rounds", "met"], rows), *notes, provenance(name, results["info"])])


def ops() -> str:
    results = load("ops")
    rows = [[r["op"], _shape_label(r["case"]), r["dir"], f"{r['ours ms']:.3f}", f"{r['torch ms']:.3f}",
             f"{r['compiled ms']:.3f}", ratio(r["vs torch"]), f"**{ratio(r['vs compiled'])}**"]
            for r in results["rows"]]
    return "\n\n".join([table(["op", "activations of", "direction", "ours ms", "torch eager ms", "torch compiled ms",
                                 "vs eager", "vs compiled"], rows), provenance("ops", results["info"])])


RENDERERS: dict[str, Callable[[], str]] = {
    "headline": headline, "train": train, "ops": ops, "optimizer": optimizer, "clip": clip, "attention": attention,
    "decode": decode, "features": features, "nki": nki, "hf": hf, "fallback": fallback,
    "fallback_cuda": lambda: fallback("fallback_cuda")}


def render(text: str) -> str:
    """``text`` with every rendered block re-rendered from the results files."""
    def block(match):
        name = match.group(2)
        if name not in RENDERERS:
            raise KeyError(f"no renderer for the block 'results: {name}'; known: {', '.join(RENDERERS)}")
        return f"{match.group(1)}{RENDERERS[name]()}\n{match.group(4)}"

    return BLOCK.sub(block, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a doc differs")
    args = parser.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(rendered)
    if stale:
        print(("differs from its results: " if args.check else "rewrote ") + ", ".join(map(str, stale)))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
