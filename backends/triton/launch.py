"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds, type-checks and specialises every argument on every call:
42 us a launch on the H100's host, against 11 us for the compiled kernel's own launcher
(docs/performance.md, "Host time"). A plan's launch fixes its grid, its constexprs and every
integer argument (the plan's key holds the shapes and strides they come from), so the compiled
kernel that Triton returns from a first call is kept and launched directly after that, once per
current device and per alignment of the tensor arguments: those, the only facts Triton
specialises on that a plan does not fix, are checked on every call. Floats are not specialised.

In the interpreter, while Triton's launch hooks are set (a profiler such as Proton reads them),
and under ``PORTABLE_OPS_DIRECT_LAUNCH=0`` (the escape hatch, should a Triton release change the
launcher's protocol; read per launch), every launch goes through Triton.
"""

from __future__ import annotations

import inspect
import threading

from triton import knobs
from triton.runtime import driver

from .interpreter import INTERPRETED


def _through_triton() -> bool:
    from portable_ops import env  # here: the kernel modules load without the package (tests/test_triton_compiles.py)

    hook = knobs.runtime.launch_enter_hook  # triton 3.6 and 3.9: a HookChain, empty unless a tool added one
    return (hook is not None and bool(getattr(hook, "calls", True))) or not env.flag("PORTABLE_OPS_DIRECT_LAUNCH", True)


class Launch:
    """``kernel[grid](*args, **options)``, for arguments that lead with ``tensors`` tensors and
    whose integers are the same on every call."""

    __slots__ = ("kernel", "grid", "options", "tensors", "tail", "compiled")

    def __init__(self, kernel, grid, tensors: int, **options):
        self.kernel, self.options, self.tensors = kernel, options, tensors
        self.grid = (*grid, 1, 1)[:3]
        self.tail = None  # the kernel's parameters after the positional arguments, in order
        self.compiled: dict = {}

    def __call__(self, *args) -> None:
        if INTERPRETED or _through_triton():
            self.kernel[self.grid](*args, **self.options)
            return
        device = driver.active.get_current_device()
        key = (device, *[t.data_ptr() % 16 == 0 for t in args[:self.tensors]])
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[self.grid](*args, **self.options)
            if self.tail is None:
                parameters = list(inspect.signature(self.kernel.fn).parameters.values())[len(args):]
                self.tail = tuple(self.options.get(p.name, p.default) for p in parameters)
            return
        compiled.run(*self.grid, driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *self.tail)


def hash_triton_in_background() -> None:
    """Start computing the key that Triton's compile cache prefixes every kernel with.

    A process's first kernel launch hashes Triton's own shared library and sources for that key:
    0.42 s of the 0.9-1.2 s our eager training spent warming up on the H100 with every cache
    warm, where torch's eager stack needs 0.4-0.6 s (docs/performance.md). Hashing runs without
    the GIL, so a thread started when ``import portable_ops`` loads this backend (on a machine with
    CUDA) has it ready by the time the user's model has been built.
    """
    from triton.runtime import cache

    triton_key = getattr(cache, "triton_key", None)  # memoised: the first launch reuses the thread's result
    if triton_key is not None:
        threading.Thread(target=triton_key, name="portable_ops-triton-key", daemon=True).start()
