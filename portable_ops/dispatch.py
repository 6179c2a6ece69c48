"""Backend selection: which backend runs a call, and why every other one does not.

A backend is a module under ``portable_ops.backends`` exposing ``BACKEND``, a
:class:`Backend`. It names the device types it is the native choice for and,
per op, an :class:`OpImpl` whose ``supports(call)`` returns the reasons it
cannot take ``call`` (empty when it can). Dispatch walks the preference list
for the tensors' device, keeps every rejection, and either runs the first
backend that accepts or falls back to ``reference`` with a warning (an error
under ``PORTABLE_OPS_STRICT=1``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import env

BACKEND_NAMES = ("triton", "nki", "reference")

# Device types each accelerator backend is the default for. Anything else runs
# on the reference backend unless a backend is forced.
NATIVE_DEVICES = {"triton": ("cuda",), "nki": ("xla", "neuron")}

Call = dict  # the keyword arguments of one op call, validated by the public API


class BackendUnavailableError(RuntimeError):
    """A forced or strict call could not run on the backend asked for."""


class FallbackWarning(UserWarning):
    """A call ran on the reference backend because the preferred one can't take it."""


@dataclass(frozen=True)
class OpImpl:
    run: Callable[..., Any]
    # Reasons this backend can't take a call; must not touch tensor data.
    supports: Callable[[Call], list[str]] = lambda call: []
    # Optional, for ops whose host time is critical: ``prepare(q, k, v, **options)`` returns ``run`` for every
    # call whose q, k and v have these ones' layout (shapes, strides, dtypes, device and 16-byte alignment)
    # and whose options are these, taking the op's tensors positionally (attention_bwd's: q, k, v, out, lse,
    # dout, the last three of any layout); what ``run`` would look up per call is looked up once.
    prepare: Callable[..., Callable[..., Any]] | None = None


@dataclass
class Backend:
    name: str
    ops: dict[str, OpImpl]
    # Reason the backend can't run at all in this process (library missing, ...), or None.
    unavailable: Callable[[], str | None] = lambda: None
    # Reasons the backend can't run on tensors of this device type, empty when it can.
    device_reasons: Callable[[torch.device], list[str]] = lambda device: []
    description: str = ""
    # Ops the backend does not implement (yet), each with the reason a user reads in explain's report
    # and in a fallback's warning; any other op it lacks reads "<name> does not implement <op>".
    declined: dict[str, str] = field(default_factory=dict)


@dataclass
class Choice:
    """The outcome of dispatch for one call: who runs it, and why the others don't."""

    op: str
    backend: str
    device: torch.device | None
    preferred: str
    rejected: dict[str, list[str]] = field(default_factory=dict)

    @property
    def is_fallback(self) -> bool:
        return self.backend != self.preferred

    def __str__(self) -> str:
        lines = [f"{self.op} on {self.device}: runs on '{self.backend}'"]
        if self.is_fallback:
            lines[0] += f" (fallback from '{self.preferred}')"
        for name, reasons in self.rejected.items():
            lines.append(f"  {name}: not used: " + "; ".join(reasons))
        return "\n".join(lines)


_backends: dict[str, Backend] = {}
_import_errors: dict[str, str] = {}
class _Forced(threading.local):
    name: str | None = None  # every thread starts with none forced (a class default: no AttributeError to catch)


_forced = _Forced()
_warned: set[tuple[str, str, str]] = set()
_memo: dict[tuple, Choice] = {}
_MEMO_SIZE = 4096  # a decode loop meets a new cache length every token: bounded, cleared when full
_lock = threading.Lock()


def get_backend(name: str) -> Backend | None:
    """The backend called ``name``, imported on first use; None if its module fails to import."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    with _lock:
        if name not in _backends and name not in _import_errors:
            try:
                _backends[name] = importlib.import_module(f"portable_ops.backends.{name}").BACKEND
            except Exception as exc:  # a broken backend is reported by doctor/explain, never fatal
                _import_errors[name] = f"portable_ops.backends.{name} failed to load: {type(exc).__name__}: {exc}"
    return _backends.get(name)


def unavailable_reason(name: str) -> str | None:
    backend = get_backend(name)
    if backend is None:
        return _import_errors[name]
    return backend.unavailable()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op inside the block onto backend ``name`` (overrides ``PORTABLE_OPS_BACKEND``)."""
    get_backend(name)  # validates the name early
    previous = _forced.name
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def forced_backend() -> str | None:
    return _forced.name or env.choice("PORTABLE_OPS_BACKEND", BACKEND_NAMES)


def strict() -> bool:
    return env.flag("PORTABLE_OPS_STRICT", False)


def state() -> tuple:
    """What a choice that is not a fallback depends on besides the call: the forced backend and the backends
    loaded (strict mode changes only what a fallback does)."""
    return forced_backend(), tuple(map(id, _backends.values()))


def preference(device: torch.device | None, prefer: str | None = None) -> list[str]:
    """Backends to try for tensors on ``device``, best first; ``reference`` always ends the list."""
    first = prefer or forced_backend()
    if first is not None:
        return [first] if first == "reference" else [first, "reference"]
    dtype = device.type if device is not None else "cpu"
    native = [name for name, types in NATIVE_DEVICES.items() if dtype in types]
    return native + ["reference"]


def _reasons(name: str, op: str, call: Call, device: torch.device | None) -> list[str]:
    reason = unavailable_reason(name)
    if reason is not None:
        return [reason]
    backend = _backends[name]
    if op not in backend.ops:
        return [backend.declined.get(op) or f"{name} does not implement {op}"]
    reasons = list(backend.device_reasons(device)) if device is not None else []
    return reasons or backend.ops[op].supports(call)


def choose(op: str, call: Call, device: torch.device | None, prefer: str | None = None) -> Choice:
    """Pick the backend for ``op(**call)``, keeping the reasons of every backend passed over."""
    order = preference(device, prefer)
    choice = Choice(op=op, backend="reference", device=device, preferred=order[0])
    for name in order:
        reasons = _reasons(name, op, call, device)
        if not reasons:
            choice.backend = name
            break
        choice.rejected[name] = reasons
    if choice.backend in choice.rejected:
        raise ValueError(f"{op}: no backend can run this call: " + "; ".join(choice.rejected["reference"]))
    kind = device.type if device is not None else "these"
    for name in BACKEND_NAMES:
        if name not in order:
            why = (f"'{order[0]}' is forced" if order[0] != "reference" or forced_backend()
                   else f"not the default for {kind} tensors (force it with use_backend({name!r}))")
            choice.rejected[name] = [why]
    return choice


def _callers_level() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first frame outside
    portable_ops (its backends and conformance included), torch and the standard library."""
    internal = [os.path.dirname(torch.__file__), os.path.dirname(contextlib.__file__)]
    for name in ("portable_ops", "portable_ops.backends", "portable_ops.conformance"):
        internal += getattr(sys.modules.get(name), "__path__", [])
    internal = tuple(os.path.join(os.path.abspath(d), "") for d in internal)
    frame, level = sys._getframe(2), 2  # frame: select's caller, which stacklevel 2 names
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def select(op: str, call: Call, device: torch.device | None, prefer: str | None = None) -> Choice:
    """:func:`choose`, then warn once (or raise under ``PORTABLE_OPS_STRICT=1``) if it fell back."""
    choice = choose(op, call, device, prefer)
    if choice.is_fallback:
        reasons = "; ".join(choice.rejected[choice.preferred])
        message = f"portable_ops.{op}: '{choice.preferred}' can't take this call ({reasons}); running 'reference'"
        if strict():
            raise BackendUnavailableError(message + " -- refused because PORTABLE_OPS_STRICT=1")
        key = (op, choice.preferred, reasons)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(message, FallbackWarning, stacklevel=_callers_level())
    return choice


def select_by_layout(op: str, layout: tuple, make_call: Callable[[], Call], device: torch.device | None,
                     prefer: str | None = None) -> Choice:
    """:func:`select` for an op whose choice depends only on ``layout`` (shapes, strides, dtypes,
    flags), memoised: eager attention pays this on every call, and ``make_call`` (meta stand-ins)
    and the backends' checks cost tens of microseconds. Fallbacks are not memoised, so each one
    still warns once or, under strict mode, raises."""
    key = (op, layout, device, prefer, state())
    choice = _memo.get(key)
    if choice is None:
        choice = select(op, make_call(), device, prefer)
        if not choice.is_fallback:
            if len(_memo) >= _MEMO_SIZE:
                _memo.clear()
            _memo[key] = choice
    return choice


def dispatch(op: str, call: Call, device: torch.device | None, prefer: str | None = None) -> OpImpl:
    """The implementation to run for ``op(**call)``, chosen by :func:`select`."""
    return _backends[select(op, call, device, prefer).backend].ops[op]
