"""The kernels as torch.compile traces them: ops made by ``torch.library.triton_op`` whose bodies allocate their
outputs and launch the kernels through ``torch.library.wrap_triton``. AOTAutograd decomposes such an op into its
launches, so Inductor calls the kernels from the code it generates (and CUDA graphs capture them), with no Python
of ours in between.

In Triton's interpreter (CPU tensors) neither works as torch documents: torch hands an interpreted kernel back
from ``wrap_triton`` as it is, which fake tensors can't run, and Inductor compiles no Triton kernel for the CPU.
There a traced op is a custom op running the same body, which is its fake implementation too, and ``wrap_triton``
wraps the kernel in the tracing wrapper torch's own returns, over a ``JITFunction`` that runs it interpreted: a
trace runs the body's allocations and launch arguments on fake tensors, and the graph, compiled by aot_eager or
Inductor alike, runs the op, whose launches run the kernels.
"""

from __future__ import annotations

import functools

import torch
from triton.runtime.jit import JITFunction

from .interpreter import INTERPRETED


def triton_op(name: str, mutates_args: tuple):
    """``torch.library.triton_op(name, mutates_args=...)``; in the interpreter, the custom op described above."""
    if not INTERPRETED:
        return torch.library.triton_op(name, mutates_args=mutates_args)

    def define(body):
        op = torch.library.custom_op(name, body, mutates_args=mutates_args)
        op.register_fake(body)
        return op

    return define


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)``; in the interpreter, the wrapper over an interpreted ``JITFunction``.
    Named as torch's: torch finds a triton_op's kernels (its compile caches key on their source) by this call."""
    if not INTERPRETED:
        return torch.library.wrap_triton(kernel)
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper

    return TraceableTritonKernelWrapper(_interpreted(kernel), None, None)


class _InterpretedJIT(JITFunction):
    """A ``JITFunction`` (what torch's kernel tracing takes) of an interpreted kernel's source, launched through the
    interpreter."""

    def __init__(self, interpreted):
        super().__init__(interpreted.fn)
        self.interpreted = interpreted

    def run(self, *args, grid, warmup, **kwargs):
        return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    @property
    def cache_key(self) -> str:
        # Triton's key hashes the jit functions a kernel calls, which are interpreted ones here: it refuses them
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


@functools.cache
def _interpreted(kernel) -> _InterpretedJIT:
    return _InterpretedJIT(kernel)
