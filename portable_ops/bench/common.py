"""Timing and reporting shared by the benchmarks: CUDA-event medians, copy bandwidth, JSON and plots."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

import torch


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median wall time of ``fn()`` on the current CUDA stream, from CUDA events, in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def steady_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Mean time per call of ``iters`` calls enqueued back to back (one sync at the end), in ms:
    a training loop's view, where the host enqueues the next step while the device runs this one."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(step, warmup: int = 3):
    """``step`` captured in a CUDA graph (after warm-up on a side stream); returns the replay function."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def host_ms(fn, iters: int = 20) -> float:
    """Median host time to enqueue ``fn()`` (the device is drained before each call)."""
    import time

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return median(times)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * n * 4 / (ms * 1e-3)


def checkout_commit() -> str | None:
    """The checkout's commit, short; None where git can't tell."""
    # A copy of the checkout without .git (a lent GPU machine) names its commit in PORTABLE_OPS_COMMIT.
    commit = os.environ.get("PORTABLE_OPS_COMMIT")
    try:
        return commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=pathlib.Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


def triton_version() -> str | None:
    """The version of the Triton this process imports; None without one (the CPU smoke run needs none)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def device_info() -> dict:
    """What a result was measured on: device, date, versions and the checkout's commit."""
    device = torch.cuda.get_device_properties(0).name if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {"device": device, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "python": platform.python_version(), "triton": triton_version(), "commit": checkout_commit()}


def write(name: str, rows: list[dict], info: dict, out_dir: str | pathlib.Path) -> pathlib.Path:
    """``out_dir/name.json``: the rows, and ``info`` with the commit and the command line that produced them
    (the docs print both under the tables they render from the file: benchmarks/docs_tables.py)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    command = shlex.join(["python", *sys.orig_argv[1:]])
    info = {"commit": checkout_commit(), **info, "command": info.get("command", command)}
    path.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)
