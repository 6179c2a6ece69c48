"""Direct kernel launches (backends/triton/launch.py): the compiled kernel Triton returned is reused
only for calls it was specialised for, and Triton's own path is kept where it must be."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from portable_ops import dispatch

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")

import triton  # noqa: E402  (after portable_ops: it switches the interpreter on where there is no GPU)
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

launch = importlib.import_module("portable_ops.backends.triton.launch")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _axpb(X, Y, n, a, b, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(X + offs, mask=offs < n) * a + b
    if NEGATE:
        y = -y
    tl.store(Y + offs, y, mask=offs < n)


def _run(run, x, a, b):
    y = torch.full_like(x, float("nan"))
    run(x, y, x.numel(), a, b)
    return y


def test_results_follow_every_float_and_every_tensor_alignment():
    """Floats change between calls; a tensor one element into a buffer is not 16-byte aligned, which
    Triton compiles for separately (vector loads assume alignment): each gets its own kernel."""
    n = 1000
    run = launch.Launch(_axpb, (triton.cdiv(n, 256),), 2, BLOCK=256, NEGATE=True)
    buffer = torch.randn(n + 1, device=DEVICE)
    for x in (buffer[:n], buffer[1:], buffer[:n], buffer[1:]):
        for a, b in ((2.0, 0.5), (-1.5, 3.0)):
            torch.testing.assert_close(_run(run, x, a, b), -(x * a + b))
    if DEVICE.type == "cuda":
        assert len(run.compiled) == 2  # aligned and not: kept apart
        if launch.TRITON_RELEASE == (3, 6):  # the release whose launcher's C entry point was read
            assert all(compiled.entry is not None for compiled in run.compiled.values())
    else:
        assert not run.compiled  # the interpreter has no compiled kernel to keep


@pytest.mark.skipif(DEVICE.type != "cuda", reason="hooks fire on compiled launches")
@pytest.mark.parametrize("chain", ["launch_enter_hook", "launch_exit_hook"])
def test_a_launch_hook_sees_every_launch(chain):
    """A profiler's hook (Proton adds both) must see launches that would otherwise skip Triton."""
    n = 256
    run = launch.Launch(_axpb, (1,), 2, BLOCK=256)
    x = torch.randn(n, device=DEVICE)
    _run(run, x, 1.0, 0.0)  # compiled and kept
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    getattr(knobs.runtime, chain).add(hook)
    try:
        torch.testing.assert_close(_run(run, x, 3.0, 1.0), x * 3 + 1)
    finally:
        getattr(knobs.runtime, chain).remove(hook)
    assert len(seen) == 1


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter always launches through Triton")
def test_direct_launches_can_be_switched_off(monkeypatch):
    n = 256
    run = launch.Launch(_axpb, (1,), 2, BLOCK=256)
    x = torch.randn(n, device=DEVICE)
    monkeypatch.setenv("PORTABLE_OPS_DIRECT_LAUNCH", "0")
    torch.testing.assert_close(_run(run, x, 2.0, 1.0), x * 2 + 1)
    assert not run.compiled
    monkeypatch.setenv("PORTABLE_OPS_DIRECT_LAUNCH", "1")
    torch.testing.assert_close(_run(run, x, 2.0, 1.0), x * 2 + 1)
    assert len(run.compiled) == 1


def test_kernels_compile_under_the_triton_environment_of_backend_load(monkeypatch, tmp_path):
    """Inductor points TRITON_CACHE_DIR and TRITON_PTXAS_PATH elsewhere once it compiles: a launch that may
    compile ours runs under the values the backend loaded with, and leaves Inductor's in place after."""
    ours = {"TRITON_CACHE_DIR": str(tmp_path / "ours"), "TRITON_PTXAS_PATH": None}
    monkeypatch.setattr(launch, "_COMPILE_ENV", ours)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/torch/bin/ptxas")
    seen = launch.in_compile_env(lambda: (os.environ.get("TRITON_CACHE_DIR"), os.environ.get("TRITON_PTXAS_PATH")))
    assert seen == (ours["TRITON_CACHE_DIR"], None)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["TRITON_PTXAS_PATH"] == "/torch/bin/ptxas"
    with pytest.raises(ZeroDivisionError):  # restored when the launch raises too
        launch.in_compile_env(lambda: 1 / 0)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor")

    def inductor_sets_ptxas():  # another thread, meanwhile: its value is kept
        os.environ["TRITON_PTXAS_PATH"] = "/other/ptxas"

    monkeypatch.delenv("TRITON_PTXAS_PATH")
    launch.in_compile_env(inductor_sets_ptxas)
    assert os.environ["TRITON_PTXAS_PATH"] == "/other/ptxas"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor")

    calls = []
    monkeypatch.setattr(launch, "in_compile_env", lambda call, *a, **k: calls.append(call) or call(*a, **k))
    x = torch.randn(256, device=DEVICE)
    torch.testing.assert_close(_run(launch.Launch(_axpb, (1,), 2, BLOCK=256), x, 2.0, 1.0), x * 2 + 1)
    assert len(calls) == 1  # the first launch, the one that compiles
