"""The project's NKI emulator: a CPU test double for ``nki`` / ``nki.language`` / ``nki.isa``.

**This is a test double, not AWS's simulator and not hardware.** It runs the subset of NKI 0.7
(Neuron SDK 2.33) that ``backends/nki`` kernels use, on CPU tensors, with torch storage: bf16
tiles are stored as bf16 and every engine write rounds once; engines compute in fp32; PSUM
accumulates matmuls in fp32. It rejects, with :class:`EmulatorError` naming the rule, what the
docs say the compiler or hardware rejects: more than 128 partitions, SBUF/PSUM over capacity,
a PSUM tile over one 2 KiB bank, matmul operands outside the Tensor Engine limits (contraction
partitions <= 128, stationary free <= 128, moving free <= 512), engines reading HBM, GpSimd
touching PSUM, DMA touching PSUM, unsupported dtypes (no float64). It counts instructions per
engine (``count_instructions()``) for the roofline table in docs/backends/nki.md.

What it does not model: timing, engine concurrency, SBUF fragmentation and alignment, the
compiler's own allocation (tiles here live for the loop iteration or kernel that declares
them), loop-carried dependencies in ``affine_range`` (not detected), activation-function
approximation error on the Scalar Engine (it uses exact fp32 torch functions).

Used as the ``nki`` module by ``backends/nki/compat.py`` when the real SDK is not installed.
"""

from __future__ import annotations

import functools

import torch

from . import core, isa, language  # noqa: F401
from .core import EmulatorError, Stats, count_instructions, use_target  # noqa: F401

__version__ = "0.7.0-emulated"
IS_EMULATOR = True


def _to_torch(value):
    if isinstance(value, core.Tensor):
        if value.buffer.on_chip:
            core.reject("kernel-return", "a kernel returns HBM tensors (nl.shared_hbm), not on-chip tiles")
        return value.data
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    return value


class EmulatedKernel:
    """What ``@nki.jit`` returns here: calling it runs the kernel body on CPU tensors."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        wrapped = [core.wrap_hbm(a) if isinstance(a, torch.Tensor) else a for a in args]
        kw = {k: core.wrap_hbm(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        saved = core.memory.scopes
        core.memory.reset()
        try:
            return _to_torch(self.fn(*wrapped, **kw))
        finally:
            core.memory.scopes = saved

    def __getitem__(self, grid):
        return self  # SPMD grids: one program here (nl.program_id() == 0)


def jit(fn=None, **options):
    """``@nki.jit``: in the emulator the kernel body runs eagerly on CPU tensors."""
    if fn is None:
        return lambda f: EmulatedKernel(f)
    return EmulatedKernel(fn)


def simulate(kernel):
    """Same shape as ``nki.simulate(kernel)(*args)``: here it is the emulator itself."""
    return kernel if isinstance(kernel, EmulatedKernel) else EmulatedKernel(kernel)
