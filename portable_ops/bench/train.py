"""The end-to-end benchmark: a Llama-style model trained with portable_ops against torch's own stack.

``python -m portable_ops.bench train`` trains :class:`~portable_ops.bench.llama.Llama` (fp32 params,
bf16 autocast) with

* **torch**: ``F.scaled_dot_product_attention`` (its default backend choice),
  ``clip_grad_norm_(foreach=True)`` and ``AdamW(fused=True)``;
* **portable_ops**: ``portable_ops.attention`` and ``portable_ops.optim.AdamW(max_grad_norm=...)``;
* **all-ops**: portable_ops' attention and optimizer, and its RMSNorm, RoPE and linear cross-entropy
  (``Llama(ops="portable_ops")``);

each eagerly and under ``torch.compile`` (the model and its loss; the optimizer step runs eagerly
on both sides), from the same initialisation on the same batches, in one process. Per run:
tokens/s and ms per step over back-to-back steps, device-busy ms per step (kernel time under
torch.profiler) and its split by kernel kind (attention forward and backward, optimizer, the
rest), the host time of a step and its split by phase (each step queued behind a sleep kernel, so
that the host never waits for the device: an eager run is host-bound where this passes the busy
time), warm-up seconds, peak memory and the loss of every step; per stack, the host time of one
attention call forward and backward. One more run per shape, torch's eager stack with SDPA held to
its flash kernel, measures how far bf16 rounding alone sends two loss curves apart. A second process,
started after the main runs so that every cache is warm, measures warm-up as a user's second run sees it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace

import torch

import portable_ops

from .common import host_ms, median, sync
from .llama import Llama, LlamaConfig, batches

# The two shapes, then a long-sequence one (head dim 128, 8k tokens per sequence).
SHAPES = {
    "d1024 hd64 s2048": LlamaConfig(d_model=1024, layers=8, heads=16, kv_heads=4, seq=2048, batch=4),
    "d2048 hd128 s4096": LlamaConfig(d_model=2048, layers=4, heads=16, kv_heads=8, seq=4096, batch=2),
    "d2048 hd128 s8192": LlamaConfig(d_model=2048, layers=4, heads=16, kv_heads=8, seq=8192, batch=1),
}
# What Inductor sets in a process that ran torch.compile, as this module found them when imported: a
# user's second run starts without Inductor's values (TRITON_PTXAS_PATH, torch's ptxas, is part of
# every Triton kernel's cache key: a child that inherited it compiled all our kernels again, 7.9-9.1 s).
_INDUCTOR_SETS = ("TRITON_PTXAS_PATH", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
_START_ENV = {key: os.environ.get(key) for key in _INDUCTOR_SETS}
STACKS = ("torch", "portable_ops", "all-ops")
PORTABLE_STACKS = ("portable_ops", "all-ops")  # those stepped by portable_ops' fused clip + AdamW
MODES = ("eager", "compiled")
ATTENTION_OF = {"torch": "sdpa", "portable_ops": "portable_ops", "all-ops": "portable_ops", "torch-flash": "sdpa-flash"}
OPS_OF = {"all-ops": "portable_ops"}  # the rest: torch's norms, RoPE and loss
MAX_GRAD_NORM = 1.0
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# A linear lr warm-up, as every recipe at this lr has: without it the loss spikes near step 10 and
# the spike unwinds differently on every run, torch's own runs included (docs/performance.md).
LR_WARMUP_STEPS = 20
WARMUP_STEPS = 3  # compilation and tile tuning happen in these
# Two runs of one model whose curves differ by more than this have not computed the same training:
# bf16 autocast rounds every matmul input to 8 bits, so curves drift apart by rounding alone, and
# further where the training amplifies rounding (the steps at the peak lr). How far is measured per
# shape as torch's own spread: its eager and compiled runs, and an eager run with SDPA held to its
# flash kernel ("torch-flash": the same function, rounded otherwise).
LOSS_TOLERANCE = {"max": 0.05, "mean": 0.02}
NOISE_RUN = ("torch-flash", "eager")
# Kernel names by what they compute, for the device-time breakdown (ours, cuDNN's, flash's, torch's
# fused AdamW and foreach norm); Inductor's and cuBLAS's kernels are the rest.
KERNEL_KINDS = {
    "attention fwd": re.compile(r"^fwd_kernel|^combine_kernel|fprop|flash_fwd|fmha.*fwd|cutlassF"),
    "attention bwd": re.compile(r"^bwd_kernel|^dkdv_kernel|^dq_kernel|^delta_kernel|bprop|flash_bwd|fmha.*bwd|dot_do_o|"
                                r"convert_dq|cutlassB"),
    # torch's clip: the per-tensor norms (LpNorm), the norm of norms (NormTwoOps), the scaling
    # (BinaryOpScalarTensor); its few scalar kernels (stack, clamp, div) stay in "other"
    "optimizer": re.compile(r"^_adam_kernel|^_partials_kernel|^_final_kernel|Adam|LpNorm|lpnorm|NormTwoOps|"
                            r"BinaryOpScalarTensor"),
}


def _optimizer(stack, model):
    if stack not in PORTABLE_STACKS:
        return torch.optim.AdamW(model.parameters(), fused=model.embed.weight.is_cuda, **HYPER)
    return portable_ops.optim.AdamW(model.parameters(), max_grad_norm=MAX_GRAD_NORM, **HYPER)


class Run:
    """One (shape, stack, mode): the model, its optimizer and a step function over seeded batches."""

    def __init__(self, cfg: LlamaConfig, stack: str, mode: str, device: torch.device, steps: int, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg, self.stack, self.device = cfg, stack, device
        self.model = Llama(cfg, attention=ATTENTION_OF[stack], ops=OPS_OF.get(stack, "torch")).to(device)
        self.opt = _optimizer(stack, self.model)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / LR_WARMUP_STEPS))
        self.loss_fn = torch.compile(self.model, fullgraph=True) if mode == "compiled" else self.model
        self.data = batches(cfg, steps, device, seed)
        self.losses: list[torch.Tensor] = []

    def step(self, mark=None):
        """One training step; ``mark(phase)`` is called as each of PHASES ends."""
        mark = mark or (lambda phase: None)
        tokens, targets = next(self.data)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss_fn(tokens, targets)
        mark("forward")
        loss.backward()
        mark("backward")
        if self.stack not in PORTABLE_STACKS:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM, foreach=True)
        mark("clip")
        self.opt.step()
        mark("optimizer")
        self.schedule.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        mark("rest")


PHASES = ("forward", "backward", "clip", "optimizer", "rest")
# Device work queued ahead of each step whose host time is measured (~0.25 s on an H100): longer
# than any step here, so that a step whose host never waits ends before the sleep does.
HOST_STEP_SLEEP_CYCLES = 500_000_000


def step_host_ms(run: Run, steps: int) -> dict:
    """Median host ms per step and per phase (PHASES) of ``steps`` steps: what a step costs the
    host, which an eager loop hides only while it stays under the device's time per step. On CUDA
    each step is enqueued behind a sleep kernel, so nothing in it waits for the device unless it
    synchronises or fills the launch queue; a run where any step outlasted its sleep (it may have
    waited) reports "waited" instead of host times."""
    times: dict[str, list[float]] = {phase: [] for phase in ("step", *PHASES)}
    waited = False
    for _ in range(steps):
        if run.device.type == "cuda":
            torch.cuda._sleep(HOST_STEP_SLEEP_CYCLES)
            slept = torch.cuda.Event()
            slept.record()
        start = last = time.perf_counter()

        def mark(phase):
            nonlocal last
            now = time.perf_counter()
            times[phase].append((now - last) * 1e3)
            last = now

        run.step(mark)
        times["step"].append((last - start) * 1e3)
        if run.device.type == "cuda":
            waited |= slept.query()
        sync(run.device)
    if waited:
        return {"host ms/step": "waited"}
    return {"host ms/step": median(times.pop("step")),
            **{f"host {phase} ms": median(values) for phase, values in times.items()}}


KINDS = (*KERNEL_KINDS, "other")


def _kind(kernel: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS.items() if pattern.search(kernel)), "other")


def _device_time(run: Run, steps: int) -> dict:
    """Kernel time per step under torch.profiler: busy ms (the union of the CUDA kernels'
    intervals) and the kernels' ms by kind (KERNEL_KINDS)."""
    if run.device.type != "cuda" or steps == 0:
        return {"busy ms/step": None}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.step()
        sync(run.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    row = {"busy ms/step": busy / 1e3 / steps, **{f"{kind} ms": 0.0 for kind in KINDS}}
    for e in kernels:
        row[f"{_kind(e.name)} ms"] += (e.time_range.end - e.time_range.start) / 1e3 / steps
    return row


def measure(cfg: LlamaConfig, stack: str, mode: str, device: torch.device, timed_steps: int, profiled_steps: int,
            progress=None, host_steps: int = 0) -> dict:
    run = Run(cfg, stack, mode, device, WARMUP_STEPS + timed_steps + profiled_steps + host_steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    for _ in range(WARMUP_STEPS):
        run.step()
    sync(device)
    warm = time.perf_counter()
    for _ in range(timed_steps):
        run.step()
    sync(device)
    ms = (time.perf_counter() - warm) * 1e3 / timed_steps
    row = {"shape": None, "stack": stack, "mode": mode, "ms/step": ms,
           "tokens/s": cfg.batch * cfg.seq / (ms / 1e3),
           "warm-up s": (warm - start) - WARMUP_STEPS * ms / 1e3,
           **_device_time(run, profiled_steps)}
    compared = len(run.losses)  # the host-timed steps train on, past the steps every run is compared over
    row.update(step_host_ms(run, host_steps) if host_steps else {})
    row["peak GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row["losses"] = torch.stack(run.losses[:compared]).float().cpu().tolist()
    if progress:
        progress(f"{stack:<12} {mode:<8} {ms:8.2f} ms/step  warm-up {row['warm-up s']:.1f} s")
    return row


def attention_host_us(cfg: LlamaConfig, stack: str, device: torch.device) -> dict:
    """Host time of one attention call (device idle before it), forward and backward, on the
    model's bf16 q/k/v transposed out of [B, S, H, D]."""
    from .llama import ATTENTION

    def make(h):
        return torch.randn(cfg.batch, cfg.seq, h, cfg.head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = (make(h).requires_grad_() for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
    fn = ATTENTION[ATTENTION_OF[stack]]
    out = fn(q, k, v, True)
    dout = torch.randn_like(out)
    timer = host_ms if device.type == "cuda" else _cpu_host_ms
    fwd = timer(lambda: fn(q, k, v, True))
    bwd = timer(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    return {"host us fwd": fwd * 1e3, "host us bwd": bwd * 1e3}


def _cpu_host_ms(fn, iters: int = 5) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def warm_second_run(shape: str, device: torch.device) -> list[dict]:
    """Warm-up seconds in a fresh process, after the main runs filled every cache (a user's second run)."""
    rows = []
    for mode in MODES:
        for stack in STACKS:
            command = [sys.executable, "-m", "portable_ops.bench.train", shape, stack, mode, str(device)]
            env = dict(os.environ)
            for key, value in _START_ENV.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if result.returncode:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
            rows.append({"shape": shape, "stack": stack, "mode": mode,
                         "second-run warm-up s": json.loads(result.stdout.splitlines()[-1])["warm-up s"]})
    return rows


def _loss_gap(a: list[float], b: list[float]) -> tuple[float, float]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    tail = diffs[-10:]
    return max(diffs), sum(tail) / len(tail)


def compare_losses(rows: list[dict]) -> list[dict]:
    """Per (shape, mode): how far portable_ops' loss curve is from torch's. Their gap must be within
    LOSS_TOLERANCE, or within torch's own spread where that is wider (the widest gap between any
    two of torch's runs: eager, compiled, and NOISE_RUN's other attention kernel): a training that
    amplifies rounding sends torch's own runs apart as well, and portable_ops cannot be asked to be
    closer to torch than torch is to itself."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        curves = {(r["stack"], r["mode"]): r["losses"] for r in rows if r["shape"] == shape}
        torch_runs = [curve for (stack, _), curve in curves.items() if stack not in PORTABLE_STACKS]
        gaps = [_loss_gap(a, b) for a, b in itertools.combinations(torch_runs, 2)]
        floor = (max(g[0] for g in gaps), max(g[1] for g in gaps)) if gaps else (0.0, 0.0)
        for mode, stack in itertools.product(MODES, PORTABLE_STACKS):
            if not {(stack, mode), ("torch", mode)} <= set(curves):
                continue
            worst, mean = _loss_gap(curves[stack, mode], curves["torch", mode])
            out.append({"shape": shape, "mode": mode, "stack": stack, "max |loss diff|": worst,
                        "last-10 mean |diff|": mean,
                        "torch's own spread": f"{floor[0]:.3g} / {floor[1]:.3g}",
                        "agree": worst <= max(LOSS_TOLERANCE["max"], floor[0])
                        and mean <= max(LOSS_TOLERANCE["mean"], floor[1])})
    return out


def run_train(shapes=SHAPES, device=None, timed_steps=20, profiled_steps=3, host_steps=10, second_run=True,
              progress=print, repeats=1) -> dict:
    """Every stack in every mode on every shape, ``repeats`` times in a rotating order (a lent machine's host
    speed drifts between runs of the same code): a (shape, mode, stack) row is its median run, with the median
    of the per-repeat ratios to torch's run of the same repeat and their range."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows, noise, host = [], [], []
    for name, cfg in shapes.items():
        progress(f"{name}: {asdict(cfg)}")
        for mode in MODES:
            runs = {stack: [] for stack in STACKS}
            for repeat in range(repeats):
                for stack in STACKS[repeat % len(STACKS):] + STACKS[:repeat % len(STACKS)]:
                    runs[stack].append(measure(cfg, stack, mode, device, timed_steps, profiled_steps, progress,
                                               host_steps))
            rows += [{**row, "shape": name} for row in _median_runs(runs)]
        try:  # as many steps as the runs it is compared with
            noise.append({**measure(cfg, *NOISE_RUN, device, timed_steps, profiled_steps, progress), "shape": name})
        except RuntimeError as error:  # no flash kernel for this GPU or shape: torch's eager/compiled spread only
            progress(f"{NOISE_RUN[0]} skipped: {str(error).splitlines()[0]}")
        for stack in STACKS:
            host.append({"shape": name, "stack": stack, **attention_host_us(cfg, stack, device)})
    warm = warm_second_run(next(iter(shapes)), device) if second_run else []
    return {"runs": rows, "noise runs": noise, "attention host": host, "losses": compare_losses(rows + noise),
            "second run": warm}


def _median_runs(runs: dict) -> list[dict]:
    """Per stack, its median run (by ms a step) with ``vs torch``: the median over repeats of its tokens/s over
    torch's in the same repeat, and ``vs torch range``: their least and greatest."""
    rows = []
    for stack, measured in runs.items():
        ratios = sorted(m["tokens/s"] / t["tokens/s"] for m, t in zip(measured, runs["torch"]))
        row = sorted(measured, key=lambda m: m["ms/step"])[len(measured) // 2]
        rows.append({**row, "vs torch": median(ratios), "vs torch range": [ratios[0], ratios[-1]],
                     "repeats": len(measured), "ms/step runs": [m["ms/step"] for m in measured]})
    return rows


RUN_COLUMNS = ["shape", "mode", "stack", "tokens/s", "vs torch", "ms/step", "busy ms/step", "warm-up s", "peak GiB"]
KIND_COLUMNS = ["shape", "mode", "stack", "busy ms/step", *(f"{kind} ms" for kind in KINDS)]
HOST_COLUMNS = ["shape", "mode", "stack", "busy ms/step", "host ms/step", *(f"host {phase} ms" for phase in PHASES)]


def report(result: dict, info: dict, out_dir) -> str:
    """Write train.json and train.png into ``out_dir``; return the tables to print."""
    from .common import table, write

    path = write("train", result, info, out_dir)
    try:
        plot(result, path.with_suffix(".png"))
    except ImportError:
        pass
    host = ["shape", "stack", "host us fwd", "host us bwd"]
    return "\n\n".join([table(result["runs"], RUN_COLUMNS), table(result["runs"], KIND_COLUMNS),
                         table(result["runs"], HOST_COLUMNS),
                         table(result["attention host"], host),
                         table(result["losses"], ["shape", "mode", "stack", "max |loss diff|", "last-10 mean |diff|",
                                                  "torch's own spread", "agree"]),
                         table(result["second run"], ["shape", "mode", "stack", "second-run warm-up s"])])


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in result["runs"]))
    fig, axes = plt.subplots(len(MODES), len(shapes), figsize=(4.5 * len(shapes), 6.5), squeeze=False)
    for col, shape in enumerate(shapes):
        for row, mode in enumerate(MODES):
            ax = axes[row][col]
            for r in result["runs"]:
                if r["shape"] == shape and r["mode"] == mode:
                    ax.plot(range(1, len(r["losses"]) + 1), r["losses"],
                            label=f"{r['stack']}: {r['tokens/s'] / 1e3:.0f}k tok/s ({r['vs torch']:.2f}x)")
            ax.set_title(f"{shape}, {mode}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    """``python -m portable_ops.bench.train SHAPE STACK MODE DEVICE``: one run's warm-up, as JSON."""
    shape, stack, mode, device = (argv or sys.argv[1:])[:4]
    row = measure(SHAPES[shape], stack, mode, torch.device(device), timed_steps=3, profiled_steps=0)
    print(json.dumps({"warm-up s": row["warm-up s"]}))
    return 0


def tiny(cfg: LlamaConfig) -> LlamaConfig:
    """The same architecture at a size a CPU trains in seconds (tests and smoke runs)."""
    return replace(cfg, d_model=64, layers=2, heads=4, kv_heads=cfg.kv_heads * 4 // cfg.heads or 1, seq=32,
                   batch=2, vocab=256)


if __name__ == "__main__":
    sys.exit(main())
