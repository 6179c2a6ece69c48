"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds, type-checks and specialises every argument on every call:
33-42 us a launch on the H100's host, against 11-14 us for the compiled kernel's own launcher
(two profiles; docs/backends/triton.md, "Direct launches"). A plan's launch fixes its grid, its
constexprs and every integer argument (the plan's key holds the shapes and strides they come from), so the compiled
kernel that Triton returns from a first call is kept and launched directly after that, once per
current device and per alignment of the tensor arguments: those, the only facts Triton
specialises on that a plan does not fix, are checked on every call (the plan's key holds every
tensor's dtype). Floats are not specialised.

In the interpreter, while Triton's launch hooks or the kernel's pre-run hooks are set (a profiler
such as Proton adds them), under ``TRITON_DEBUG``, on a Triton release whose launcher protocol was
not read (``PROTOCOL_READ_IN``), and under ``PORTABLE_OPS_DIRECT_LAUNCH=0`` (read per launch),
every launch goes through Triton. Not followed after a kernel's first launch: Triton's
instrumentation and sanitizer knobs, its compile-stage inspection hook and its check that the
globals a kernel read have not changed.
"""

from __future__ import annotations

import inspect
import threading

import triton
from triton import knobs
from triton.runtime import driver

from .interpreter import INTERPRETED


# The launcher protocol used below (CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *every kernel parameter)) is JITFunction.run's in the
# Triton releases it was read in; any other release launches through Triton.
PROTOCOL_READ_IN = ((3, 6), (3, 9))
TRITON_RELEASE = tuple(int(part) for part in triton.__version__.split(".")[:2])  # (major, minor)
_KNOWN_PROTOCOL = TRITON_RELEASE in PROTOCOL_READ_IN


def _through_triton(kernel) -> bool:
    """Whether Triton must launch: something it does per launch is asked for, or the user said so."""
    from portable_ops import env  # here: the kernel modules load without the package (tests/test_triton_compiles.py)

    runtime = knobs.runtime
    hooked = any(hook is not None and bool(getattr(hook, "calls", True))  # a HookChain (3.6, 3.9) or a function
                 for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))
    return (hooked or kernel.pre_run_hooks or runtime.debug or not _KNOWN_PROTOCOL
            or not env.flag("PORTABLE_OPS_DIRECT_LAUNCH", True))


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
        _wait_for_cache_key()  # before any launch that may compile, through Triton or not
        if INTERPRETED or _through_triton(self.kernel):
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


_hashing: threading.Thread | None = None


def hash_triton_in_background() -> None:
    """Start computing the key that Triton's compile cache prefixes every kernel with.

    A process's first kernel launch hashes Triton's own shared library and sources for that key:
    0.42 s of the 0.9-1.1 s our eager training spent warming up on the H100 with every cache
    warm, where torch's eager stack needs 0.4-0.6 s (docs/performance.md). Hashing runs without
    the GIL, so a thread started when ``import portable_ops`` loads this backend (on a machine with
    CUDA) overlaps with building the model; a launch that comes first waits for it rather than
    hashing again (``triton_key`` is memoised, but not against a call in progress).
    """
    global _hashing
    from triton.runtime import cache

    triton_key = getattr(cache, "triton_key", None)
    if triton_key is None:
        return
    try:
        _hashing = threading.Thread(target=triton_key, name="portable_ops-triton-key", daemon=True)
        _hashing.start()
    except RuntimeError:  # no thread to be had: the first launch hashes, as it would without us
        _hashing = None


def _wait_for_cache_key() -> None:
    global _hashing
    hashing = _hashing  # read once: another thread may clear it meanwhile
    if hashing is not None:
        hashing.join()
        _hashing = None
