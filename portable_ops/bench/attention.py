"""Attention benchmarks: portable_ops against each of SDPA's backends, forward and backward, in
TFLOP/s, at any head dims (a head dim that is not a power of two is also given as a fraction of its
next power of two's TFLOP/s, timed in the same run); decode (one query token against a KV cache), in
microseconds and GB/s; and the host time of the triton backend's calls with no-op kernel launches."""

from __future__ import annotations

import contextlib
import importlib
import time
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import portable_ops

from .common import graphed, median, median_ms, steady_ms

SDPA = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}


def _flops(b, h, s, d, causal, direction):
    fwd = 4 * b * h * s * s * d / (2 if causal else 1)
    return fwd if direction == "fwd" else 2.5 * fwd


def _time(fn, q, k, v, direction, steady_only=False):
    """(ms with the device drained before each call, ms per call enqueued back to back), or the latter
    alone."""
    if direction == "fwd":
        call = lambda: fn(q, k, v)  # noqa: E731
    else:
        out = fn(q, k, v)
        dout = torch.randn_like(out)
        call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    with torch.no_grad() if direction == "fwd" else contextlib.nullcontext():
        if steady_only:
            return steady_ms(call)
        return median_ms(call, iters=20), steady_ms(call)


def _sdpa_variants(causal, gqa):
    variants = {}
    for name, backend in SDPA.items():
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        variants[name] = sdpa
    return variants


def with_power_of_two_dims(head_dims) -> list[int]:
    """``head_dims`` plus the next power of two of each one that is not a power of two, sorted: the
    rows each odd head dim is compared with."""
    return sorted(set(head_dims) | {1 << (d - 1).bit_length() for d in head_dims})


def add_fraction_of_power_of_two(rows: list[dict]) -> list[dict]:
    """Set ``of pow2`` on each timed row whose head dim is not a power of two: its TFLOP/s over the
    TFLOP/s of the same variant, direction and shape at the next power of two (FLOPs count the head
    dim itself, so padding work shows as a fraction below 1)."""
    by_shape = {(r["variant"], r["dir"], r["D"], r["S"], r["B"], r["Hkv"], r["causal"]): r for r in rows
                if r.get("TFLOP/s")}
    for (variant, direction, d, s, b, hkv, causal), row in by_shape.items():
        pow2 = by_shape.get((variant, direction, 1 << (d - 1).bit_length(), s, b, hkv, causal))
        if d & (d - 1) and pow2 is not None:
            row["of pow2"] = row["TFLOP/s"] / pow2["TFLOP/s"]
    return rows


def run_attention(seqs=(1024, 2048, 4096, 8192, 16384, 32768), head_dims=(64, 128, 256), tokens=16384, heads=16,
                  kv_heads=(16, 4), sdpa=("sdpa flash", "sdpa cudnn")) -> list[dict]:
    """Forward and backward TFLOP/s of ours and of the ``sdpa`` backends (names of ``SDPA``), at
    ``tokens`` per batch (B = tokens / S, at least 1)."""
    rows = []
    for d in with_power_of_two_dims(head_dims):
        for s in seqs:
            b = max(1, tokens // s)
            for hkv in kv_heads:
                for causal in (False, True):
                    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    variants = {"portable_ops": lambda q, k, v: portable_ops.attention(q, k, v, causal=causal),
                                **{name: fn for name, fn in _sdpa_variants(causal, hkv != heads).items()
                                   if name in sdpa}}
                    for direction in ("fwd", "bwd"):
                        timed = {}
                        for name, fn in variants.items():
                            row = {"bench": "attention", "variant": name, "dir": direction, "D": d, "S": s, "B": b,
                                   "Hkv": hkv, "causal": causal}
                            rows.append(row)
                            try:
                                ms, steady = _time(fn, q, k, v, direction)
                            except RuntimeError as exc:  # an SDPA backend that can't take this shape
                                row["error"] = str(exc).splitlines()[0][:80]
                                continue
                            timed[name] = row
                            row.update({"ms": ms, "steady ms": steady})
                        # Steady again in the reverse order, the better of the two kept: on the H100 one kernel
                        # timed first in a row ran up to 10% faster than timed last (docs/performance.md, "The
                        # persistent forward"), so each variant gets an early turn and a late one.
                        for name in reversed(timed):
                            row = timed[name]
                            try:
                                row["steady ms"] = min(row["steady ms"], _time(variants[name], q, k, v, direction,
                                                                               True))
                            except RuntimeError:  # out of memory the second time: the first figure stands
                                pass
                            tflop = _flops(b, heads, s, d, causal, direction) / 1e12
                            row.update({"TFLOP/s": tflop / (row["ms"] * 1e-3),
                                        "steady TFLOP/s": tflop / (row["steady ms"] * 1e-3)})
                    del q, k, v
    return add_fraction_of_power_of_two(rows)


EXPANDED_LIMIT = 8 << 30  # bytes: SDPA's flash and efficient kernels get expanded K/V only up to this
GRAPH_ROUNDS = 3


def run_decode(caches=tuple(512 << i for i in range(9)), batches=(1, 4, 16, 64), heads=32, kv_heads=8,
               d=128) -> list[dict]:
    """One new token per sequence against a KV cache (512 to 128k keys, batch 1 to 64), bf16, forward
    only. SDPA gets ``is_causal=False``: its causal mask is aligned top-left, which would show the
    token only the first key; ours is bottom-right, so ``causal=True`` sees the whole cache. SDPA's
    flash and efficient kernels take no GQA, so they get K/V expanded to every query head before
    timing (4x the bytes; left out where that would take over ``EXPANDED_LIMIT``). GB/s counts the
    K/V bytes of the GQA cache, which bound decode; graph replays are timed round-robin across the
    variants, ``GRAPH_ROUNDS`` times. Every output is checked against float32 SDPA, one sequence at a
    time (the oracle's memory stays one sequence's)."""
    rows = []
    group = heads // kv_heads
    for b in batches:
        for s in caches:
            q = torch.randn(b, heads, 1, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, kv_heads, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            kv_bytes = 2 * k.numel() * k.element_size()
            with torch.no_grad():
                ref = torch.cat([F.scaled_dot_product_attention(*(t[i:i + 1].float() for t in (q, k, v)),
                                                                enable_gqa=True)
                                 for i in range(b)])
            # (function, inputs, SDPA backend): each SDPA backend is chosen once around its timing, not
            # per call, so that its eager host time is SDPA's own (sdpa_kernel costs ~8 us a call)
            gqa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            ours = lambda q, k, v: portable_ops.attention(q, k, v, causal=True)  # noqa: E731
            variants = {"portable_ops": (ours, (q, k, v), None), "sdpa cudnn": (gqa, (q, k, v), SDPA["sdpa cudnn"])}
            expanded = None
            if group * kv_bytes <= EXPANDED_LIMIT:
                expanded = (q, *(t.repeat_interleave(group, dim=1) for t in (k, v)))
                variants.update({f"{name} (K/V expanded)": (F.scaled_dot_product_attention, expanded, SDPA[name])
                                 for name in ("sdpa flash", "sdpa efficient")})
            replays = {}
            for name, (fn, args, backend) in variants.items():
                call = lambda fn=fn, args=args: fn(*args)  # noqa: E731
                row = {"bench": "decode", "variant": name, "B": b, "cache": s, "Hq": heads, "Hkv": kv_heads, "D": d}
                rows.append(row)
                try:
                    with torch.no_grad(), sdpa_kernel(backend) if backend else contextlib.nullcontext():
                        row["max abs diff"] = (call().float() - ref).abs().max().item()
                        row["us"] = 1e3 * median_ms(call, iters=30)
                        row["steady us"] = 1e3 * steady_ms(call, iters=50)
                        replays[name] = (row, graphed(call))
                except RuntimeError as exc:
                    row["error"] = str(exc).splitlines()[0][:80]
            # Graph replays timed round-robin, the median of the rounds kept: on the H100 the first
            # variant timed in a cell ran up to 17% slower than the same graph timed again later
            # (docs/performance.md, "Decode"), so no variant's figure may hang on its turn.
            rounds = {name: [] for name in replays}
            for _ in range(GRAPH_ROUNDS):
                for name, (row, replay) in replays.items():
                    rounds[name].append(1e3 * median_ms(replay, iters=30))
            for name, (row, _) in replays.items():
                row["graph us"] = median(rounds[name])
                row["graph GB/s"] = kv_bytes / (row["graph us"] * 1e-6) / 1e9
            del q, k, v, expanded, ref, variants, replays
    return rows


class _NoLaunch:
    """Stands in for ``kernel``: ``kernel[grid](*args, **kwargs)`` launches nothing and returns a
    compiled kernel whose launcher does nothing, which backends/triton/launch.py keeps and calls
    as it would a real one."""

    compiled = types.SimpleNamespace(run=lambda *args: None, function=None, packed_metadata=None)
    pre_run_hooks = ()

    def __init__(self, kernel):
        self.fn = kernel.fn  # the parameters, read once by launch.Launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


@contextlib.contextmanager
def _replaced(replacements):
    """Each ``(owner, name, value)``: ``owner.name`` set to ``value`` inside the block, and back after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    try:
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def no_launches():
    """Every attention kernel the triton backend's plans launch (backends/triton/attention_plans.py) and
    its Hopper forward (attention_sm90.py, where Gluon is there) replaced by a no-op."""
    plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
    kernels = [(plans, name) for name in ("fwd_kernel", "combine_kernel", "delta_kernel", "dkdv_kernel", "dq_kernel")]
    if hasattr(plans.attention_sm90, "fwd_kernel"):
        kernels.append((plans.attention_sm90, "fwd_kernel"))
    with _replaced([(owner, name, _NoLaunch(getattr(owner, name))) for owner, name in kernels]):
        yield


@contextlib.contextmanager
def no_norm_launches():
    """The triton backend's norm kernels replaced by no-ops, with a plan cache and a memo of the public norms of
    their own inside the block (their plans and prepared runs hold launches): nothing made inside outlives it."""
    kernels = importlib.import_module("portable_ops.backends.triton.norms")
    public = importlib.import_module("portable_ops.norms")
    with _replaced([*((kernels, name, _NoLaunch(getattr(kernels, name)))
                      for name in ("_norm_fwd_kernel", "_norm_bwd_kernel", "_column_sum_kernel")),
                    (kernels, "_plans", {}), (public, "_memo", {})]):
        yield


def run_attention_host(calls=2000, b=4, s=256, heads=16, kv_heads=4, d=64) -> list[dict]:
    """Host microseconds per call of the triton backend's ``attention_fwd`` and ``attention_bwd``
    with the kernel launches replaced by no-ops: everything a call costs on the host besides the
    launches themselves (plan lookup, allocations, copies). q/k/v and dout are transposed out of
    [B, S, H, D], as a transformer hands them over. Runs on CPU tensors (no GPU needed): CPU host
    time with no-op launches, not GPU time; allocations there are the CPU allocator's."""
    attn_mod = importlib.import_module("portable_ops.backends.triton.attention")
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def make(h):
        return torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    dout = make(heads)
    scale = d ** -0.5
    rows = []
    with no_launches():
        out, lse = attn_mod.attention_fwd(q, k, v, causal=True, scale=scale)  # plans built here
        attn_mod.attention_bwd(q, k, v, out, lse, dout, causal=True, scale=scale)
        for direction, call in (("fwd", lambda: attn_mod.attention_fwd(q, k, v, causal=True, scale=scale)),
                                ("bwd", lambda: attn_mod.attention_bwd(q, k, v, out, lse, dout, causal=True,
                                                                       scale=scale))):
            best = float("inf")
            for _ in range(5):  # the best of 5 rounds: the least disturbed by other processes
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                best = min(best, (time.perf_counter() - start) / calls * 1e6)
            rows.append({"bench": "attention host", "variant": "triton backend, no-op launches", "dir": direction,
                         "device": device, "B": b, "S": s, "Hq": heads, "Hkv": kv_heads, "D": d, "host us": best})
    return rows


NORM_HOST_COLUMNS = ["op", "variant", "dir", "device", "shape", "host us", "vs torch"]


def _norm_cases(x, r, w, b, eps):
    """(op, portable_ops' call, torch's call, the inputs the backward differentiates): the same work each."""
    d = x.shape[-1]
    return [
        ("rms_norm", lambda: portable_ops.rms_norm(x, w, eps), lambda: F.rms_norm(x, (d,), w, eps), (x, w)),
        ("rms_norm + residual", lambda: portable_ops.rms_norm(x, w, eps, residual=r)[0],
         lambda: F.rms_norm(x + r, (d,), w, eps), (x, r, w)),
        ("layer_norm", lambda: portable_ops.layer_norm(x, w, b, eps), lambda: F.layer_norm(x, (d,), w, b, eps),
         (x, w, b)),
    ]


def run_norm_host(calls=50, rounds=30, shape=(2, 16, 128)) -> list[dict]:
    """Host microseconds per call of ``rms_norm`` (with and without its residual add) and ``layer_norm``, forward
    and forward+backward, beside torch's ``F.rms_norm`` / ``F.layer_norm`` on the same tensors: portable_ops on
    the reference backend (aten's kernels run, as torch's do) and on the triton backend with no-op launches,
    both through the public function's memoised eager path. Variants are timed in turn, round after round, and
    each keeps its best round: the least disturbed by other processes. CPU tensors unless CUDA is present:
    CPU host time, with small tensors so that the kernels torch and the reference run cost little, on one
    intra-op thread (on tensors this small a thread pool's wake-ups would be timed, not the calls)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(shape, generator=g).to(device).requires_grad_() for _ in range(2))
    w, b = (torch.randn(shape[-1], generator=g).to(device).requires_grad_() for _ in range(2))
    dout = torch.randn(shape, generator=g).to(device)
    variants = {"torch eager": contextlib.nullcontext,
                "portable_ops, reference": lambda: portable_ops.use_backend("reference"),
                "portable_ops, triton no-op launches": lambda: portable_ops.use_backend("triton")}
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with no_norm_launches():
            for op, ours, theirs, inputs in _norm_cases(x, r, w, b, 1e-5):
                for direction in ("fwd", "fwd+bwd"):
                    best = dict.fromkeys(variants, float("inf"))
                    for _ in range(rounds):
                        for name, forced in variants.items():
                            call = theirs if forced is contextlib.nullcontext else ours
                            if direction == "fwd+bwd":
                                call = lambda call=call, inputs=inputs: torch.autograd.grad(call(), inputs, dout)  # noqa: E731
                            with forced(), torch.no_grad() if direction == "fwd" else contextlib.nullcontext():
                                best[name] = min(best[name], _host_us(call, calls))
                    rows += [{"bench": "norm host", "op": op, "variant": name, "dir": direction, "device": device,
                              "shape": "x".join(map(str, shape)), "host us": us, "vs torch": us / best["torch eager"]}
                             for name, us in best.items()]
    finally:
        torch.set_num_threads(threads)
    return rows


def _host_us(call, calls) -> float:
    """Microseconds per call of ``calls`` calls back to back, after one (the first call of a key memoises it)."""
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6
