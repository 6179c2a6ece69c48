"""The project's NKI emulator: a CPU test double for ``nki`` / ``nki.language`` / ``nki.isa``.

**This is a test double, not AWS's simulator and not hardware.** It runs the subset of NKI 0.7
(Neuron SDK 2.33) that ``backends/nki`` kernels use, on CPU tensors, with torch storage: bf16
tiles are stored as bf16 and every engine write rounds once; engines compute in fp32; PSUM
accumulates matmuls in fp32. Its functions take the parameters, with the defaults, of AWS's API
reference (tests/test_nki_api.py checks them against ``backends/nki/aws_signatures.py``), and
AWS's per-instruction examples are ported as tests (tests/test_nki_aws_examples.py). It rejects,
with :class:`EmulatorError` naming the rule, what the docs say the compiler or hardware rejects
(more than 128 partitions, SBUF/PSUM over capacity, a PSUM tile over one 2 KiB bank, matmul
operands outside the Tensor Engine limits, engines reading HBM, GpSimd touching PSUM, DMA
touching PSUM, accumulating onto PSUM no matmul initialised, unsupported dtypes, ...).

While a kernel runs it counts, per engine, the instructions issued, the elements they stream and
the DMA bytes moved (:func:`count_instructions`), and the peak SBUF/PSUM use; ``cost.py`` turns
the counts into time estimates. :func:`count_only` runs kernels on ``meta`` tensors (checks and
counters, no arithmetic) so full-size problems can be counted.

What it does not model: timing (the cost model estimates it from the counts), engine
concurrency, SBUF fragmentation and alignment, the compiler's own allocation (tiles here live for
the loop iteration or kernel that declares them), loop-carried dependencies in ``affine_range``
(not detected), the Scalar Engine's piece-wise polynomial approximations of activation functions
(it uses exact fp32 torch functions), and what the engines' max/min do with NaN (undocumented;
see :func:`max_nan_semantics`).

Used as the ``nki`` module by ``backends/nki/compat.py`` when the real SDK is not installed.
"""

from __future__ import annotations

import functools

import torch

from . import core, isa, language  # noqa: F401
from .core import (EmulatorError, Stats, count_instructions, count_only, max_nan_semantics,  # noqa: F401
                   use_target)

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


def _to_hbm(value):
    """Kernel arguments: torch tensors, also inside lists and tuples, become HBM tensors."""
    if isinstance(value, torch.Tensor):
        return core.wrap_hbm(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_hbm(v) for v in value)
    return value


class EmulatedKernel:
    """What ``@nki.jit`` returns here: calling it runs the kernel body on CPU tensors (writes to
    argument tensors land in them, as NKI kernels update their HBM inputs in place)."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        args, kwargs = _to_hbm(args), {k: _to_hbm(v) for k, v in kwargs.items()}
        saved = core.memory.tiles, core.memory.scopes
        core.memory.reset()
        core.record_launch()
        try:
            return _to_torch(self.fn(*args, **kwargs))
        finally:
            core.memory.tiles, core.memory.scopes = saved

    def __getitem__(self, grid):
        return self  # kernel[lnc]: one program here (nl.program_id() == 0)


def jit(fn=None, **kwargs):
    """``@nki.jit``: in the emulator the kernel body runs eagerly on CPU tensors."""
    if fn is None:
        return lambda f: EmulatedKernel(f)
    return EmulatedKernel(fn)


def simulate(kernel):
    """Same shape as ``nki.simulate(kernel)(*args)``: here it is the emulator itself."""
    return kernel if isinstance(kernel, EmulatedKernel) else EmulatedKernel(kernel)
