"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds, type-checks and specialises every argument on every call, which
costs a launch several times the host time of the compiled kernel's own launcher. A plan's launch fixes its
grid, its constexprs and every integer argument (the plan's key holds the shapes and strides they come
from), so the compiled kernel that Triton returns from a first call is kept and launched directly after
that, once per current device and per alignment of the tensor arguments: those, the only facts Triton
specialises on that a plan does not fix, are checked on every call (the plan's key holds every tensor's
dtype). Floats are not specialised.

In the interpreter, while Triton's launch hooks or the kernel's pre-run hooks are set (a profiler
such as Proton adds them), under ``TRITON_DEBUG``, on a Triton release whose launcher protocol was
not read (``PROTOCOL_READ_IN``), and under ``PORTABLE_OPS_DIRECT_LAUNCH=0`` (read per launch),
every launch goes through Triton. Not followed after a kernel's first launch: Triton's
instrumentation and sanitizer knobs, its compile-stage inspection hook and its check that the
globals a kernel read have not changed.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from functools import reduce
from operator import or_

import triton
from triton import knobs
from triton.runtime import driver

from .interpreter import INTERPRETED

try:  # what Triton's GPU drivers ask torch for, without their lookups and torch.cuda.current_device's Python
    from torch._C import _cuda_getCurrentRawStream as _current_stream, _cuda_getDevice as _current_device
except ImportError:  # a torch without CUDA: Triton's driver says
    def _current_device():
        return driver.active.get_current_device()

    def _current_stream(device):
        return driver.active.get_current_stream(device)


# releases whose launcher protocol (JITFunction.run's call of CompiledKernel.run) was read: others launch through Triton
PROTOCOL_READ_IN = ((3, 6), (3, 9))
TRITON_RELEASE = tuple(int(part) for part in triton.__version__.split(".")[:2])  # (major, minor)
_KNOWN_PROTOCOL = TRITON_RELEASE in PROTOCOL_READ_IN


def _through_triton(kernel) -> bool:
    """Whether Triton must launch: something it does per launch is asked for, or the user said so."""
    runtime = knobs.runtime
    return (_hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook) or kernel.pre_run_hooks
            or runtime.debug or not _KNOWN_PROTOCOL or not _env().flag("PORTABLE_OPS_DIRECT_LAUNCH", True))


def _hooked(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # a HookChain (3.6, 3.9) or a function


@functools.cache
def _env():
    """portable_ops.env, imported on first use: the kernel modules load without the package
    (tests/test_triton_compiles.py); an import statement per launch costs as much as the checks around it."""
    from portable_ops import env

    return env


class Launch:
    """``kernel[grid](*args, **options)``, for arguments that lead with ``len(descriptors)`` tensors
    that those TMA descriptor templates (``TensorDescriptor`` holding no tensor) address, then with
    ``tensors`` tensors, and whose integers are the same on every call."""

    __slots__ = ("kernel", "grid", "options", "tensors", "descriptors", "tail", "compiled")

    def __init__(self, kernel, grid, tensors: int, descriptors=(), **options):
        self.kernel, self.options, self.tensors, self.descriptors = kernel, options, tensors, tuple(descriptors)
        self.grid = (*grid, 1, 1)[:3]
        self.tail = None  # the kernel's parameters after the positional arguments, in order
        self.compiled: dict = {}

    def __call__(self, *args) -> None:
        if INTERPRETED or _through_triton(self.kernel):
            in_compile_env(self.kernel[self.grid], *self._described(args), **self.options)
            return
        device = _current_device()
        n = len(self.descriptors)
        # addresses, not tensors: the launcher would ask the driver whether each tensor's is the device's
        pointers = [t.data_ptr() for t in args[n:n + self.tensors]]
        # the usual key (every address aligned) is the device alone: one reduction on the path every launch takes
        key = device if not reduce(or_, pointers, 0) & 15 else (device, *[p % 16 == 0 for p in pointers])
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = _Compiled(in_compile_env(self.kernel[self.grid], *self._described(args),
                                                          **self.options), self.descriptors)
            if self.tail is None:
                parameters = list(inspect.signature(self.kernel.fn).parameters.values())[len(args):]
                self.tail = tuple(self.options.get(p.name, p.default) for p in parameters)
            return
        stream = _current_stream(device)
        if compiled.entry is None:
            compiled.kernel.run(*self.grid, stream, compiled.kernel.function, compiled.kernel.packed_metadata, None,
                                None, None, *self._described(args[:n]), *pointers, *args[n + self.tensors:],
                                *self.tail)
        else:
            compiled.entry(*self.grid, stream, *compiled.head, *compiled.expand(self.descriptors, args[:n]),
                           *pointers, *args[n + self.tensors:], *self.tail)

    def _described(self, args):
        if not self.descriptors:
            return args
        return (*(_rebased(template, t) for template, t in zip(self.descriptors, args)), *args[len(self.descriptors):])


def _rebased(template, base):
    """``template`` over ``base``, a tensor of the same shape and strides (the plan's key fixes them):
    the checks ``TensorDescriptor`` runs when built cost host time on every launch."""
    descriptor = object.__new__(type(template))
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = base
    return descriptor


class _Compiled:
    """A compiled kernel and, where its launcher's layout is the one read in (Triton 3.6's CUDA
    launcher), the launcher's C entry point, called without the Python around it.

    That Python allocates the kernel's scratch memory, where it has any (then it is kept), and, for
    descriptor arguments, encodes every one again on every launch (a driver call,
    ``cuTensorMapEncodeTiled``, and the Python around it). A descriptor depends only on the template,
    fixed per plan, and the base address, which a training loop's caching allocator hands back step
    after step; so the encoded descriptors are kept per template and base address, a bounded number
    of them.
    """

    __slots__ = ("kernel", "entry", "head", "tensor_maps", "metadata")

    # per template: every layer of a model (twice under activation checkpointing) brings its own tensors
    MAX_ADDRESSES = 1024

    def __init__(self, kernel, descriptors):
        self.kernel, self.entry, self.tensor_maps, self.metadata = kernel, None, (), ()
        launcher = kernel.run
        entry = getattr(launcher, "launch", None)
        if (TRITON_RELEASE != (3, 6) or entry is None or getattr(launcher, "global_scratch_size", 1)
                or getattr(launcher, "profile_scratch_size", 1)):
            return  # not the launcher read in, or one that allocates scratch memory per launch
        if descriptors:
            free = dict(zip(getattr(getattr(entry, "__code__", None), "co_freevars", ()),
                            getattr(entry, "__closure__", None) or ()))
            metadata = free["tensordesc_meta"].cell_contents if "tensordesc_meta" in free else None
            if (set(free) != {"launcher", "tensordesc_indices", "tensordesc_meta"}
                    # the descriptors lead the arguments
                    or free["tensordesc_indices"].cell_contents != set(range(len(descriptors)))
                    or not metadata or None in metadata or len(metadata) != len(descriptors)
                    or any(m["fp4_padded"] for m in metadata)):
                return  # descriptors go through Triton's launcher, encoded on every launch
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

            entry = free["launcher"].cell_contents
            self.metadata = [(m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                              m["block_size"]) for m in metadata]
            self.tensor_maps = [{} for _ in descriptors]
        if not callable(entry) or hasattr(entry, "__code__"):
            return  # not the compiled C function read in
        self.entry = entry
        # after the grid and stream: function, cooperative grid, PDL, no scratch, metadata, no launch metadata or hooks
        self.head = (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                     kernel.packed_metadata, None, None, None)

    def expand(self, templates, tensors):
        """Each descriptor as the launcher's C entry point takes it: encoded map, shape, strides."""
        expanded = []
        for template, t, maps, (swizzle, size, dtype, block) in zip(templates, tensors, self.tensor_maps,
                                                                     self.metadata):
            address = t.data_ptr()
            encoded = maps.get(address)
            if encoded is None:
                if len(maps) >= self.MAX_ADDRESSES:
                    maps.clear()
                encoded = maps[address] = driver.active.utils.fill_tma_descriptor(
                    address, swizzle, size, dtype, block, template.shape, template.strides,
                    1 if template.padding == "nan" else 0)
            expanded += (encoded, *template.shape, *template.strides)
        return expanded


# Triton's cache directory and ptxas as the user's environment gave them when the backend loaded (unset: left unset)
_COMPILE_ENV = {key: os.environ.get(key) for key in ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")}
_compile_env_lock = threading.RLock()


def _set_env(values: dict) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def in_compile_env(call, *args, **kwargs):
    """``call(*args, **kwargs)``, a Triton launch that may compile, with Triton's cache directory and
    ptxas as they were when the backend loaded.

    Inductor (torch.compile) sets ``TRITON_CACHE_DIR`` to a directory of its own when it first
    builds a kernel runner in a process, and ``TRITON_PTXAS_PATH`` to torch's bundled ptxas when it
    first compiles; it does neither when it runs a graph from its own cache. So our kernels were
    compiled into one directory in one process and looked for in another in the next: a second run
    compiled all of them again. Held here while a launch that may compile
    runs, one such launch at a time; afterwards a variable goes back to what it was unless another
    thread (Inductor) changed it meanwhile, so Inductor's own choices stay as they are."""
    _wait_for_cache_key()  # before any launch that may compile
    if all(os.environ.get(key) == value for key, value in _COMPILE_ENV.items()):
        return call(*args, **kwargs)
    with _compile_env_lock:
        saved = {key: os.environ.get(key) for key in _COMPILE_ENV}
        _set_env(_COMPILE_ENV)
        try:
            return call(*args, **kwargs)
        finally:
            _set_env({key: value for key, value in saved.items() if os.environ.get(key) == _COMPILE_ENV[key]})


_hashing: threading.Thread | None = None


def hash_triton_in_background() -> None:
    """Start computing the key that Triton's compile cache prefixes every kernel with.

    A process's first kernel launch hashes Triton's own shared library and sources for that key, a large
    part of eager training's warm-up with every cache warm. Hashing runs without
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
