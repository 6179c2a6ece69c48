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
touching PSUM, accumulating onto PSUM no matmul initialised, unsupported dtypes, activation
inputs outside their valid ranges, dtype-converting DMAs, strided or misaligned partition
accesses, memset values a dtype cannot hold, LNC launches whose cores race on HBM, more
instructions than the compiler takes, ...; docs/backends/nki.md lists them with their sources).
``kernel[2](...)`` runs a kernel on the two cores of a logical NeuronCore (:class:`EmulatedKernel`).

While a kernel runs it counts, per engine, the instructions issued, the elements they stream and
the DMA bytes moved (:func:`count_instructions`), and the peak SBUF/PSUM use, and traces each
instruction with what it depends on through on-chip tiles; ``cost.py`` schedules the trace into time
estimates. :func:`count_only` runs kernels on ``meta`` tensors (checks and
counters, no arithmetic) so full-size problems can be counted.

What it does not model: timing and engine concurrency (the cost model estimates them from the
trace), SBUF fragmentation and alignment, the compiler's own allocation (tiles here live for
the loop iteration or kernel that declares them), loop-carried dependencies in ``affine_range``
(not detected), the Scalar Engine's piece-wise polynomial approximations of activation functions
(it uses exact fp32 torch functions), and what the engines' max/min do with NaN (undocumented;
see :func:`max_nan_semantics`).

Used as the ``nki`` module by ``backends/nki/compat.py`` when the real SDK is not installed.
"""

from __future__ import annotations

import functools

import torch

from . import allocation, core, isa, language, tensors, trace  # noqa: F401
from .core import (EmulatorError, count_only, dma_casting, domain_policy, instruction_budget,  # noqa: F401
                   max_nan_semantics, use_target)
from .trace import Stats, count_instructions  # noqa: F401

__version__ = "0.7.0-emulated"
IS_EMULATOR = True


def _to_torch(value):
    if isinstance(value, tensors.Tensor):
        if value.buffer.on_chip:
            core.reject("kernel-return", "a kernel returns HBM tensors (nl.shared_hbm), not on-chip tiles")
        if value.buffer is not core.shared_hbm and core.launch.cores > 1:
            core.reject("lnc-output", "a kernel launched on several cores returns nl.shared_hbm tensors, not "
                        "nl.private_hbm ones, which each core has its own of (lnc.rst, 'Final Notes')")
        return value.data
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    return value


def _to_hbm(value):
    """Kernel arguments: torch tensors, also inside lists and tuples, become HBM tensors."""
    if isinstance(value, torch.Tensor):
        return allocation.wrap_hbm(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_hbm(v) for v in value)
    return value


def _flat(value):
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    return [value]


class EmulatedKernel:
    """What ``@nki.jit`` returns here: calling it runs the kernel body on CPU tensors (writes to
    argument tensors land in them, as NKI kernels update their HBM inputs in place).

    ``kernel[2](...)`` launches it on the two physical cores of a logical NeuronCore (LNC=2): the body runs
    once per core, in turn, with ``nl.program_id(0)`` that core's index and ``nl.num_programs()`` 2, each core
    with its own SBUF and PSUM, the HBM shared (core.Launch checks the cores do not race on it)."""

    def __init__(self, fn, cores: int = 1):
        self.fn, self.cores = fn, cores
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        args, kwargs = _to_hbm(args), {k: _to_hbm(v) for k, v in kwargs.items()}
        saved = allocation.memory.tiles, allocation.memory.scopes, core.launch
        core.launch = core.Launch(self.cores)
        trace.record_launch(self.cores)
        try:
            results = []
            for index in range(self.cores):
                allocation.memory.reset()
                core.launch.start_core(index)
                results.append(self.fn(*args, **kwargs))
            out, first = _to_torch(results[0]), _flat(results[0])
            if any(len(_flat(r)) != len(first) or any(a is not b for a, b in zip(_flat(r), first)) for r in results):
                core.reject("lnc-divergent", "the cores of a launch return different values; a kernel returns the "
                            "shared HBM tensors every core declared")
            return out
        finally:
            allocation.memory.tiles, allocation.memory.scopes, core.launch = saved

    def __getitem__(self, grid):
        """``kernel[cores]``: one number, 1 or 2 (lnc.rst: "The bracket syntax must contain only one number";
        logical-neuroncore-config.rst: "LNC can only be set to 1 or 2")."""
        limit = core.target().max_lnc
        if isinstance(grid, bool) or not isinstance(grid, int) or not 1 <= grid <= limit:
            core.reject("lnc-grid", f"kernel[{grid!r}]: the launch grid is one number of cores, 1 to {limit} on "
                        f"{core.target().name}")
        return EmulatedKernel(self.fn, grid)


def jit(fn=None, **kwargs):
    """``@nki.jit``: in the emulator the kernel body runs eagerly on CPU tensors."""
    if fn is None:
        return lambda f: EmulatedKernel(f)
    return EmulatedKernel(fn)


def simulate(kernel):
    """Same shape as ``nki.simulate(kernel)(*args)``: here it is the emulator itself."""
    return kernel if isinstance(kernel, EmulatedKernel) else EmulatedKernel(kernel)
