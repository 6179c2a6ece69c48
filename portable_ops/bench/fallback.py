"""The fallback benchmark (issue 38): each op with the backend forced to ``reference`` against torch's
fastest call for the same work, on whatever device is here (CUDA when available, else the CPU).

    python -m portable_ops.bench fallback [--device cpu|cuda] [--quick] [--out DIR]

Compared, ours / torch's time (target: at most ``TIME_TARGET``):
- attention, forward and forward + backward, against ``F.scaled_dot_product_attention(enable_gqa=True)``:
  GPT-like causal and non-causal shapes, decode (one query against a long KV cache: ours causal, which
  aligns to the bottom right, against SDPA with no mask, which is the same mask for one query), and
  q/k/v as transposed views of one fused qkv projection;
- ``portable_ops.optim.AdamW`` against ``torch.optim.AdamW`` with its fastest flag for the device;
- ``portable_ops.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_(foreach=True)``;
- ``portable_ops.optim.AdamW(max_grad_norm=1.0)`` against ``clip_grad_norm_(foreach=True)`` then torch's AdamW;
- torch's AdamW against itself (float32, no target): two equal calls as the measure sees them, its own bias.

And examples/gpt2_tiny.py trained by each stack, ours / torch's tokens/s (target: at least ``THROUGHPUT_TARGET``).

A shared machine's load comes and goes, so the two sides are timed in rounds that alternate which
side leads (ours in even rounds, torch's in odd ones), the two taking turns call by call within a
round; each round gives the median of each side's calls. A row gives the medians over rounds of each
side's time, the median of the per-round ratios and their range (``spread``). Each call is timed alone,
the device drained before it (CUDA events on CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import portable_ops

from .common import device_info, median

TIME_TARGET = 1.05  # ours / torch's time, at most
THROUGHPUT_TARGET = 0.95  # ours / torch's tokens/s, at least
SIZES = ("full", "quick", "tiny")


@dataclass(frozen=True)
class Plan:
    """How long each row is timed: its rounds, the time one side's round aims at, the bounds on calls a
    round, the warm-up, and the example's runs of each stack, their steps and whether its model is shrunk."""

    rounds: int
    round_s: float
    min_iters: int
    max_iters: int
    warmup_s: float
    gpt2_runs: int
    gpt2_steps: int
    gpt2_shrunk: bool = False


PLANS = {"full": Plan(7, 0.2, 3, 200, 0.5, 5, 150), "quick": Plan(3, 0.12, 3, 100, 0.2, 1, 60),
         "tiny": Plan(2, 0.0, 1, 2, 0.0, 1, 12, gpt2_shrunk=True)}


@dataclass(frozen=True)
class AttentionShape:
    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int

    def label(self) -> str:
        seq = f"S{self.sq}" if self.sq == self.skv else f"Sq{self.sq} Skv{self.skv}"
        return f"B{self.b} H{self.hq}/{self.hkv} {seq} D{self.d}"


@dataclass
class Row:
    """One comparison: ``make()`` builds its tensors and returns ``(ours, theirs)``, two calls taking no
    argument that do the same work (made when timed, so one row's tensors are alive at a time)."""

    op: str
    case: str
    dtype: torch.dtype
    make: Callable[[], tuple[Callable[[], object], Callable[[], object]]]
    torch_call: str
    noise: bool = False  # both sides torch's: how far apart the measure puts two equal calls, no target


def pick_device(device: str | None = None) -> torch.device:
    """``device``, else CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the fallback benchmark runs on cpu or cuda, not {device.type}")
    return device


def fallback_info(device: torch.device) -> dict:
    """:func:`device_info` naming the device the rows ran on (the CPU, with its thread count, even where CUDA
    is present), and the code the commit does not hold: tracked files changed in the checkout, but for
    documents and results."""
    info = device_info()
    if device.type == "cpu":
        info["device"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    changed = uncommitted_files()
    info["uncommitted"] = None if changed is None else [f for f in changed if not f.endswith(NOT_CODE)]
    return info


NOT_CODE = (".md", ".json", ".png", ".txt")


def uncommitted_files() -> list[str] | None:
    """Tracked files of the checkout with changes not committed; None where git can't tell."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=pathlib.Path(__file__).parent)
    except OSError:
        return None
    if status.returncode:
        return None
    return sorted(line[3:] for line in status.stdout.splitlines() if line.strip())


# --- timing -------------------------------------------------------------------------------------------------

def _call_ms(fn, device: torch.device) -> float:
    """One call's time in ms, the device drained before it and waited for after it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _round(first, second, iters: int, device: torch.device) -> tuple[float, float]:
    """``iters`` calls of each, taking turns call by call (``first`` leading): the median time of each one's
    calls. A busy neighbour's load changes within a round; turns by the call give both sides the same share."""
    a, b = [], []
    with _no_gc():
        for _ in range(iters):
            a.append(_call_ms(first, device))
            b.append(_call_ms(second, device))
    return median(a), median(b)


def _iterations(ours, theirs, plan: Plan, device: torch.device) -> int:
    """Calls per round: enough for the slower side's calls to take about ``plan.round_s``, after a warm-up
    of alternating calls (an optimizer's first steps allocate its state, and fresh memory is slow to touch)."""
    start, calls = time.perf_counter(), 0
    while calls < 2 or time.perf_counter() - start < plan.warmup_s:
        ours()
        theirs()
        calls += 1
    slower = max(_round(ours, theirs, 3, device))
    wanted = round(plan.round_s * 1e3 / max(slower, 1e-3))
    return max(plan.min_iters, min(plan.max_iters, wanted))


@contextlib.contextmanager
def _no_gc():
    """No garbage collection inside a round: a collection lands on whichever side happens to run then."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def interleaved(ours, theirs, plan: Plan, device: torch.device) -> dict:
    """Both sides timed in ``plan.rounds`` rounds, ours leading in even rounds and torch's in odd ones: the
    medians over rounds of each side's time, the median of the per-round ratios (ours / torch's) and their
    range."""
    iters = _iterations(ours, theirs, plan, device)
    mine, torch_ms, ratios = [], [], []
    for r in range(plan.rounds):
        if r % 2 == 0:
            a, b = _round(ours, theirs, iters, device)
        else:
            b, a = _round(theirs, ours, iters, device)
        mine.append(a)
        torch_ms.append(b)
        ratios.append(a / b)
    return {"ours ms": statistics.median(mine), "torch ms": statistics.median(torch_ms),
            "ratio": statistics.median(ratios),
            "ratio min": min(ratios), "ratio max": max(ratios), "rounds": plan.rounds, "iters": iters}


def spread(lo: float, hi: float) -> str:
    return f"{lo:.2f}-{hi:.2f}"


# --- attention ----------------------------------------------------------------------------------------------

def attention_shapes(device: torch.device, size: str) -> dict[str, AttentionShape]:
    if size == "tiny":
        return {"gpt": AttentionShape(1, 4, 2, 32, 32, 16), "decode": AttentionShape(1, 4, 2, 1, 64, 16)}
    shapes = {"gpt": AttentionShape(4, 8, 2, 512, 512, 64), "decode": AttentionShape(4, 8, 2, 1, 2048, 64)}
    if device.type == "cuda":
        shapes["large"] = AttentionShape(4, 16, 4, 2048, 2048, 128)
        shapes["decode"] = AttentionShape(4, 32, 8, 1, 8192, 128)
    return shapes


def _qkv(shape: AttentionShape, dtype, device, fused: bool, seed: int = 0):
    """Leaf tensors and a function making q, k, v of them: three tensors, or three transposed views of one
    ``[B, S, (Hq + 2 Hkv) * D]`` projection (``fused``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if fused:
        assert shape.sq == shape.skv
        qkv = torch.randn(shape.b, shape.sq, (shape.hq + 2 * shape.hkv) * shape.d, device=device, generator=g,
                          dtype=dtype)

        def split(qkv):
            q, k, v = qkv.split([shape.hq * shape.d, shape.hkv * shape.d, shape.hkv * shape.d], dim=-1)
            return (q.view(shape.b, shape.sq, shape.hq, shape.d).transpose(1, 2),
                    k.view(shape.b, shape.sq, shape.hkv, shape.d).transpose(1, 2),
                    v.view(shape.b, shape.sq, shape.hkv, shape.d).transpose(1, 2))
        return (qkv,), lambda leaves: split(leaves[0])
    q = torch.randn(shape.b, shape.hq, shape.sq, shape.d, device=device, generator=g, dtype=dtype)
    k = torch.randn(shape.b, shape.hkv, shape.skv, shape.d, device=device, generator=g, dtype=dtype)
    v = torch.randn(shape.b, shape.hkv, shape.skv, shape.d, device=device, generator=g, dtype=dtype)
    return (q, k, v), lambda leaves: leaves


def _attention_pair(shape, dtype, device, *, causal: bool, sdpa_causal: bool, fused: bool, backward: bool):
    leaves, make = _qkv(shape, dtype, device, fused)

    def ours_fn(q, k, v):
        return portable_ops.attention(q, k, v, causal=causal)

    def torch_fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=sdpa_causal, enable_gqa=True)

    if not backward:
        def call(fn):
            def run():
                with torch.no_grad():
                    return fn(*make(leaves))
            return run
        return call(ours_fn), call(torch_fn)
    leaves = tuple(t.requires_grad_() for t in leaves)
    g = torch.Generator(device=device).manual_seed(1)
    dout = torch.randn(shape.b, shape.hq, shape.sq, shape.d, device=device, generator=g, dtype=dtype)

    def call(fn):
        return lambda: torch.autograd.grad(fn(*make(leaves)), leaves, dout)
    return call(ours_fn), call(torch_fn)


def attention_rows(device: torch.device, size: str) -> list[Row]:
    shapes = attention_shapes(device, size)
    gpt, decode = shapes["gpt"], shapes["decode"]
    main = torch.bfloat16 if device.type == "cuda" else torch.float32
    other = torch.float32 if device.type == "cuda" else torch.bfloat16
    # (shape, label, dtypes, causal, fused qkv views, with a backward)
    cases = [(gpt, "causal", (main, other), True, False, True),
             (gpt, "non-causal", (main,), False, False, True)]
    if "large" in shapes:
        cases += [(shapes["large"], "causal", (main,), True, False, True),
                  (shapes["large"], "non-causal", (main,), False, False, True)]
    cases += [(gpt, "causal, q/k/v views of one qkv", (main,), True, True, True)]
    rows = []
    for shape, label, dtypes, causal, fused, backward in cases:
        for dtype in dtypes:
            for direction in ("fwd", "fwd+bwd") if backward else ("fwd",):
                make = functools.partial(_attention_pair, shape, dtype, device, causal=causal, sdpa_causal=causal,
                                         fused=fused, backward=direction == "fwd+bwd")
                rows.append(Row(f"attention {direction}", f"{shape.label()} {label}", dtype, make,
                                "F.scaled_dot_product_attention(enable_gqa=True)"))
    # one query sees every key of its cache: ours causal (aligned to the bottom right) against SDPA with no
    # mask, the same mask; and both with no mask, which tells the causal call's own cost from the rest
    for dtype, causal in ((main, True), (other, True), (main, False)):
        make = functools.partial(_attention_pair, decode, dtype, device, causal=causal, sdpa_causal=False,
                                 fused=False, backward=False)
        rows.append(Row("attention fwd", f"decode {decode.label()} {'causal' if causal else 'no mask'}", dtype,
                        make, "F.scaled_dot_product_attention(enable_gqa=True), no mask"))
    return rows


# --- optimizer and clip -------------------------------------------------------------------------------------

def param_shapes(device: torch.device, size: str) -> list[tuple[int, ...]]:
    """A GPT-like list of 52 tensors: about 10M elements for the CPU, 84M for CUDA (a few thousand for tests)."""
    d, vocab, ctx, layers = {"tiny": (16, 64, 16, 4), "cuda": (1024, 32768, 1024, 4),
                             "cpu": (384, 8192, 512, 4)}["tiny" if size == "tiny" else device.type]
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _params(shapes, dtype, device, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-2).to(dtype)
    return params


def _param_pair(shapes, dtype, device):
    return _params(shapes, dtype, device), _params(shapes, dtype, device)


def torch_adamw_flag(device: torch.device) -> dict:
    """torch's fastest AdamW flag for ``device``: its fused kernel where it has one."""
    return {"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}


def optimizer_rows(device: torch.device, size: str) -> list[Row]:
    shapes = param_shapes(device, size)
    numel = sum(math.prod(s) for s in shapes)
    label = f"{len(shapes)} tensors, {numel / 1e6:.1f}M" if numel >= 1e5 else f"{len(shapes)} tensors, {numel}"
    flag = torch_adamw_flag(device)
    adamw = "torch.optim.AdamW({})".format(", ".join(f"{k}={v}" for k, v in flag.items()))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        def pair(dtype=dtype):  # each side steps its own copy of the same params and grads
            return _param_pair(shapes, dtype, device)

        def adamw_step(pair=pair):
            ours_p, torch_p = pair()
            return portable_ops.optim.AdamW(ours_p, lr=1e-4).step, torch.optim.AdamW(torch_p, lr=1e-4, **flag).step

        def clip(pair=pair):
            ours_p, torch_p = pair()
            return (lambda: portable_ops.clip_grad_norm_(ours_p, 1.0),
                    lambda: torch.nn.utils.clip_grad_norm_(torch_p, 1.0, foreach=True))

        def clip_adamw_step(pair=pair):
            ours_p, torch_p = pair()
            ours_opt = portable_ops.optim.AdamW(ours_p, lr=1e-4, max_grad_norm=1.0)
            torch_opt = torch.optim.AdamW(torch_p, lr=1e-4, **flag)

            def torch_step():
                torch.nn.utils.clip_grad_norm_(torch_p, 1.0, foreach=True)
                torch_opt.step()
            return ours_opt.step, torch_step

        rows += [Row("AdamW step", label, dtype, adamw_step, adamw),
                 Row("clip", label, dtype, clip, "torch.nn.utils.clip_grad_norm_(foreach=True)"),
                 Row("clip + AdamW step", label, dtype, clip_adamw_step, f"clip_grad_norm_(foreach=True) + {adamw}")]

    def torch_against_itself():  # "ours" is torch's step on the copy made first: the measure's own bias
        first, second = _param_pair(shapes, torch.float32, device)
        return (torch.optim.AdamW(first, lr=1e-4, **flag).step, torch.optim.AdamW(second, lr=1e-4, **flag).step)
    rows.append(Row("AdamW step, torch against itself", label, torch.float32, torch_against_itself,
                    f"{adamw} on a second copy", noise=True))
    return rows


# --- the example model --------------------------------------------------------------------------------------

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt2_tiny.py"


def load_example(path: pathlib.Path = EXAMPLE):
    """examples/gpt2_tiny.py as a module (it is not in the package), or None where the file is absent."""
    if not path.is_file():
        return None
    name = "portable_ops_bench_gpt2_tiny"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def gpt2_row(device: torch.device, plan: Plan, path: pathlib.Path = EXAMPLE) -> dict:
    """gpt2_tiny's default model trained ``plan.gpt2_runs`` times by each stack, alternating which goes first;
    ours / torch's tokens/s of each pair of runs."""
    example = load_example(path)
    base = {"op": "gpt2_tiny train", "dtype": "float32", "device": device.type, "target": f">= {THROUGHPUT_TARGET}x",
            "torch": "SDPA + clip_grad_norm_(foreach=True) + fused AdamW"}
    if example is None:
        return {**base, "case": "skipped", "note": f"{path} not found (an installed package has no examples/)",
                "ours ms": None, "torch ms": None, "ratio": None, "spread": None, "met": None}
    cfg = example.Config(seq=16, batch=2, layers=1) if plan.gpt2_shrunk else example.Config()
    steps = plan.gpt2_steps
    tokens = cfg.batch * cfg.seq
    mine, theirs, ratios = [], [], []
    for r in range(plan.gpt2_runs):
        with _no_gc():
            runs = {}
            for use_torch in ((False, True) if r % 2 == 0 else (True, False)):
                result = example.train(cfg, steps, str(device), backend=None if use_torch else "reference",
                                       use_torch=use_torch)
                runs[use_torch] = result["tokens_per_s"]
        mine.append(runs[False])
        theirs.append(runs[True])
        ratios.append(runs[False] / runs[True])
    ours_tps, torch_tps = statistics.median(mine), statistics.median(theirs)
    ratio = statistics.median(ratios)
    return {**base, "case": f"d{cfg.d_model}, {cfg.layers} layers, batch {cfg.batch}x{cfg.seq}, {steps} steps",
            "ours ms": tokens / ours_tps * 1e3, "torch ms": tokens / torch_tps * 1e3, "ratio": ratio,
            "ratio min": min(ratios), "ratio max": max(ratios), "spread": spread(min(ratios), max(ratios)),
            "met": ratio >= THROUGHPUT_TARGET, "ours tokens/s": ours_tps, "torch tokens/s": torch_tps,
            "rounds": plan.gpt2_runs, "iters": steps}


# --- the run ------------------------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_fallback(device: str | torch.device | None = None, *, size: str = "full", quick: bool = False,
                 example: pathlib.Path | None = EXAMPLE, log=None) -> list[dict]:
    """Every comparison's row on ``device`` (default: CUDA when available, else the CPU). ``size``: ``full``
    (the run of record), ``quick`` (fewer, shorter rounds; ``quick=True`` says the same) or ``tiny`` (tiny
    shapes and a few calls: a smoke test, not a measurement). ``example``: None leaves out the gpt2_tiny row."""
    size = "quick" if quick and size == "full" else size
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    device = pick_device(None if device is None else str(device))
    plan = PLANS[size]
    out = []
    with portable_ops.use_backend("reference"):
        for row in attention_rows(device, size) + optimizer_rows(device, size):
            ours, theirs = row.make()
            timed = interleaved(ours, theirs, plan, device)
            del ours, theirs
            out.append({"op": row.op, "case": row.case, "dtype": _dtype_name(row.dtype), "device": device.type,
                        **timed, "target": None if row.noise else f"<= {TIME_TARGET}x",
                        "spread": spread(timed["ratio min"], timed["ratio max"]),
                        "met": None if row.noise else timed["ratio"] <= TIME_TARGET, "torch": row.torch_call})
            if log:
                log(f"  {row.op}, {row.case}, {_dtype_name(row.dtype)}: {timed['ratio']:.3f} "
                    f"({out[-1]['spread']})")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if example is not None:
        row = gpt2_row(device, plan, example)
        out.append(row)
        if log:
            log(f"  {row['op']}: " + (row["note"] if row["ratio"] is None else f"{row['ratio']:.3f} ({row['spread']})"))
    return out
