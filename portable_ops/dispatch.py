"""Backend selection: which backend runs a call, and why every other one does not.

A backend is a module under ``portable_ops.backends`` exposing ``BACKEND``, a :class:`Backend`: the
device types whose tensors it runs by default, and per op (``portable_ops.ops.OPS``) an
:class:`OpImpl` that declares what it takes (dtypes, head dims, features) and whose ``supports(call)``
gives the reasons particular to the backend that it cannot take ``call``. Dispatch derives the
generic reasons from the declarations, walks the preference list for the tensors' device type, keeps
every rejection, and either runs the first backend that accepts or falls back to ``reference`` with a
warning (an error under ``PORTABLE_OPS_STRICT=1``).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import env
from .ops import OPS, Call, Op, declined_reason

BACKEND_NAMES = ("triton", "nki", "reference")
# Runs every call on any device: the last backend of every preference list, where fallbacks go.
FALLBACK = "reference"
# In ``Backend.devices``: tensors of every device type (the fallback's declaration).
EVERY_DEVICE_TYPE = "*"
FLOATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_dtype = operator.attrgetter("dtype")


class FallbackWarning(UserWarning):
    """A call ran on the reference backend because the preferred one can't take it."""


def _no_reasons(call: Call) -> list[str]:
    return []


@dataclass(frozen=True)
class OpImpl:
    run: Callable[..., Any]
    # Reasons particular to this backend that it can't take a call (a launch limit, a layout); must not
    # touch tensor data. Those of the declarations below are dispatch's to give.
    supports: Callable[[Call], list[str]] = _no_reasons
    # Optional, for ops whose host time is critical: ``prepare(**call)`` returns ``run`` for every call whose
    # tensors have these ones' layout (shapes, strides, dtypes, device and 16-byte alignment) and whose other
    # arguments are these, taking the op's tensors positionally; the backward ops' is given the call but for
    # the tensors that may come in any layout (attention_bwd's out, lse and dout; the norms' dout and dh).
    # What ``run`` would look up per call is looked up once (docs/adding-a-backend.md).
    prepare: Callable[..., Callable[..., Any]] | None = None
    # What it takes, as data (None: no limit): the dtypes of the op's floating-point tensors, the largest
    # head dim, and which of the op's optional features (``Op.features``, by name) it has.
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    features: tuple[str, ...] | None = None
    # Optional, for the forward ops whose public function says so (docs/adding-a-backend.md): returns the name, in
    # ``torch.ops.portable_ops``, of the op that torch.compile traces into in place of portable_ops' custom op (a
    # ``torch.library.triton_op``) for a call dispatch gives this backend while the graph is traced, registering it
    # at its first call.
    traced: Callable[[], str] | None = None
    # Optional: reasons this backend leaves an eager call (outside torch.compile, no backend forced) to the next
    # backend in the order, which runs it better there (a kernel of the same device time whose backward torch's
    # autograd runs without Python), asked whether or not this backend takes the call. Not a fallback: no warning,
    # and strict mode allows it.
    defer_eager: Callable[[Call], list[str]] | None = None
    # Optional: reasons this backend leaves a call torch.compile traces (no backend forced) to the next backend in
    # the order, whose ``autograd`` torch ops the graph then traces in: Inductor generates them and fuses them with
    # their neighbours. Not a fallback either.
    defer_traced: Callable[[Call], list[str]] | None = None
    # Optional, for the forward ops whose public function says so: ``autograd(**call)`` returns, for every call of
    # this one's layout, a function of its tensors that computes the public function's result with torch's own
    # differentiable ops (torch's autograd then runs the backward natively), or None where this call can't.
    autograd: Callable[..., Callable[..., Any] | None] | None = None


def _names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _is_or_are(items) -> str:
    return "is" if len(items) == 1 else "are"


def _dtypes_in(op: Op, call: Call) -> list[torch.dtype]:
    found: list[torch.dtype] = []
    for key in op.tensors:
        value = call.get(key)
        if isinstance(value, (list, tuple)):
            found += set(map(_dtype, value))
        elif value is not None:
            found.append(value.dtype)
    return list(dict.fromkeys(found))


@dataclass
class Backend:
    """What a backend serves, as data: its device types, and per op what it takes (docs/adding-a-backend.md)."""

    name: str
    # Device types whose tensors it runs by default, e.g. ("cuda",).
    devices: tuple[str, ...]
    ops: dict[str, OpImpl]
    # What runs it on CPU tensors when it is forced there ("the Triton interpreter"); None: it does not.
    cpu_runner: str | None = None
    # Reason the backend can't run at all in this process (library missing, ...), or None.
    unavailable: Callable[[], str | None] = lambda: None
    # Reasons it can't run now on tensors of a device type it runs (an SDK missing, the interpreter off).
    runtime_reasons: Callable[[torch.device], list[str]] = lambda device: []
    description: str = ""
    # Ops it has no kernels for yet: each falls back with ``ops.declined_reason``'s wording, and the
    # conformance suite counts their fallbacks as declared. Any other op it lacks is an undeclared gap.
    declined: tuple[str, ...] = ()

    def __post_init__(self):
        problems = self._declaration_problems()
        if problems:
            raise ValueError(f"backend {self.name!r} is declared wrongly: " + "; ".join(problems))

    def _declaration_problems(self) -> list[str]:
        if not isinstance(self.devices, tuple) or not all(isinstance(d, str) and d for d in self.devices):
            return [f"devices must be a tuple of device type names such as ('cuda',), got {self.devices!r}"]
        problems = []
        if EVERY_DEVICE_TYPE in self.devices and self.name != FALLBACK:
            problems.append(f"only {FALLBACK!r} runs on every device type ({EVERY_DEVICE_TYPE!r})")
        for op in [*self.ops, *self.declined]:
            if op not in OPS:
                problems.append(f"{op!r} is not an op of portable_ops/ops.py (one of {', '.join(OPS)})")
        problems += [f"{op!r} is both implemented and declined" for op in self.declined if op in self.ops]
        for name, impl in self.ops.items():
            op = OPS.get(name)
            if op is not None:
                problems += [f"{name}: {problem}" for problem in _impl_problems(op, impl)]
        return problems

    def runs_on(self, device_type: str) -> bool:
        """Whether it runs tensors of ``device_type`` at all: one it serves, or the CPU through ``cpu_runner``."""
        return (device_type in self.devices or EVERY_DEVICE_TYPE in self.devices
                or (device_type == "cpu" and self.cpu_runner is not None))

    def device_reasons(self, device: torch.device) -> list[str]:
        """Why it can't run on tensors of ``device``'s type; empty when it can."""
        if self.runs_on(device.type):
            return self.runtime_reasons(device)
        where = " or ".join(self.devices) + " tensors" if self.devices else "no device type by default"
        if self.cpu_runner is not None:
            where += f", and on CPU tensors in {self.cpu_runner}"
        return [f"{self.name} runs on {where}; not on {device.type}"]

    def reasons(self, op: str, call: Call) -> list[str]:
        """Why it can't take ``op(**call)`` (whatever the device): empty when it can."""
        impl = self.ops.get(op)
        if impl is None:
            return [declined_reason(op, self.name) if op in self.declined else f"{self.name} does not implement {op}"]
        return self._declared_reasons(OPS[op], impl, call) + impl.supports(call)

    def _declared_reasons(self, op: Op, impl: OpImpl, call: Call) -> list[str]:
        reasons = []
        if impl.dtypes is not None:
            refused = [d for d in _dtypes_in(op, call) if d not in impl.dtypes]
            if refused:
                reasons.append(f"{_names(refused)} {_is_or_are(refused)} not supported "
                               f"({_names(impl.dtypes)} {_is_or_are(impl.dtypes)})")
        head_dim = op.head_dim(call) if impl.max_head_dim is not None else 0
        if head_dim > (impl.max_head_dim or 0):
            reasons.append(f"head_dim {head_dim} is over {impl.max_head_dim}, the largest the {self.name} kernels take")
        for feature in op.features:
            usage = feature.usage(call) if impl.features is not None and feature.name not in impl.features else ""
            if usage:
                reasons.append(f"{usage} is not supported" + (f" ({feature.without})" if feature.without else ""))
        return reasons


def _impl_problems(op: Op, impl: OpImpl) -> list[str]:
    problems = []
    if impl.dtypes is not None and not set(impl.dtypes) <= set(FLOATING_DTYPES):
        problems.append(f"dtypes {impl.dtypes} are not all of {_names(FLOATING_DTYPES)}")
    if impl.max_head_dim is not None and op.head_dim is None:
        problems.append("max_head_dim is declared for an op with no head dim")
    known = {f.name for f in op.features}
    problems += [f"{f!r} is not one of its features ({', '.join(sorted(known)) or 'none'})"
                 for f in impl.features or () if f not in known]
    if impl.traced is not None and not callable(impl.traced):
        problems.append(f"traced must be a function returning its op's name, got {impl.traced!r}")
    return problems


@dataclass
class Choice:
    """The outcome of dispatch for one call: who runs it, and why the others don't."""

    op: str
    backend: str
    device: torch.device | None
    preferred: str
    order: tuple[str, ...] = ()  # the backends to try, best first
    tried: dict[str, list[str]] = field(default_factory=dict)  # those tried before ``backend``, and why not
    deferred: dict[str, list[str]] = field(default_factory=dict)  # those that left the eager call to a later one
    forced: bool = False
    _untried: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)

    @property
    def is_fallback(self) -> bool:
        return self.backend != self.preferred

    @property
    def reasons(self) -> list[str]:
        """Why the preferred backend did not take the call (empty when it did)."""
        return self.tried.get(self.preferred, [])

    @property
    def rejected(self) -> dict[str, list[str]]:
        """Why each backend but ``backend`` did not run the call: those tried, then the others (worked out
        when asked: every optimizer step chooses, and only explain and the messages read them)."""
        if self._untried is None:
            self._untried = _untried_reasons(self)
        return {**self.deferred, **self.tried, **self._untried}

    def fallback_message(self) -> str:
        return (f"portable_ops.{self.op}: '{self.preferred}' can't take this call ({'; '.join(self.reasons)}); "
                f"running '{self.backend}'")

    def strict_message(self) -> str:
        """Why strict mode refused the fallback, and how to allow it."""
        return (f"portable_ops.{self.op}: call refused under strict mode (PORTABLE_OPS_STRICT is on): "
                f"'{self.preferred}' can't take it ({'; '.join(self.reasons)}); set PORTABLE_OPS_STRICT=0 or unset "
                f"it to let the call fall back to '{self.backend}'")

    def __str__(self) -> str:
        lines = [f"{self.op} on {self.device}: runs on '{self.backend}'"]
        if self.is_fallback:
            lines[0] += f" (fallback from '{self.preferred}')"
        for name, reasons in self.rejected.items():
            lines.append(f"  {name}: not used: " + "; ".join(reasons))
        return "\n".join(lines)


class BackendUnavailableError(RuntimeError):
    """A forced or strict call could not run on the backend asked for; ``choice`` says which and why."""

    def __init__(self, message: str, choice: Choice):
        super().__init__(message)
        self.choice = choice

    @property
    def op(self) -> str:
        return self.choice.op

    @property
    def preferred(self) -> str:
        return self.choice.preferred

    @property
    def backend(self) -> str:
        return self.choice.backend

    @property
    def reasons(self) -> list[str]:
        return self.choice.reasons


_backends: dict[str, Backend] = {}
_import_errors: dict[str, str] = {}
class _Forced(threading.local):
    def __init__(self):
        # every thread starts with none forced, set in its own dict, where dynamo's guards read it
        self.name: str | None = None


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


def loaded_backends() -> dict[str, Backend]:
    """Every backend that loads, by name, in ``BACKEND_NAMES``' order (importing each on first use)."""
    return {name: backend for name in BACKEND_NAMES if (backend := get_backend(name)) is not None}


def device_present(device_type: str) -> bool:
    """Whether this process can make tensors of ``device_type`` (its device module says so, or one is made)."""
    module = getattr(torch, device_type, None)
    if callable(getattr(module, "is_available", None)):
        return bool(module.is_available())
    try:
        torch.empty(0, device=device_type)
    except Exception:  # torch raises RuntimeError, AssertionError ... by device type
        return False
    return True


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every op inside the block onto backend ``name`` (overrides ``PORTABLE_OPS_BACKEND``)."""
    if torch.compiler.is_compiling():  # the compiled ops dispatch when the graph runs, outside this block
        raise RuntimeError(f"use_backend({name!r}) inside a function torch.compile traces: enter it around the call "
                           f"of the compiled function instead (its graph is traced again for each forced backend)")
    get_backend(name)  # validates the name early
    previous = _forced.name
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def forced_backend() -> str | None:
    return _forced.name or env.choice("PORTABLE_OPS_BACKEND", BACKEND_NAMES)


def forced_by_use_backend() -> str | None:
    """The backend ``use_backend`` forces in this thread (``PORTABLE_OPS_BACKEND`` aside), read where dynamo can guard
    on it."""
    return _forced.name


def strict() -> bool:
    return env.flag("PORTABLE_OPS_STRICT", False)


def state() -> tuple:
    """What a choice that is not a fallback depends on besides the call: the forced backend and the backends
    loaded (strict mode changes only what a fallback does, and fallbacks are never memoised). Every memoised
    eager call reads it."""
    return forced_backend(), tuple(map(id, _backends.values()))


def preference(device: torch.device | None, prefer: str | None = None) -> list[str]:
    """Backends to try for tensors on ``device``, best first: the forced one, else those whose declared
    ``devices`` hold its type; the fallback always ends the list."""
    first = prefer or forced_backend()
    if first is not None:
        return [first] if first == FALLBACK else [first, FALLBACK]
    kind = device.type if device is not None else "cpu"
    return [name for name, backend in loaded_backends().items()
            if name != FALLBACK and kind in backend.devices] + [FALLBACK]


def _reasons(name: str, op: str, call: Call, device: torch.device | None) -> list[str]:
    reason = unavailable_reason(name)
    if reason is not None:
        return [reason]
    backend = _backends[name]
    reasons = backend.device_reasons(device) if device is not None else []
    return reasons or backend.reasons(op, call)


def _deferral(name: str, op: str, call: Call, device: torch.device | None, eager: bool) -> list[str]:
    """Why backend ``name`` leaves this call to the next (``OpImpl.defer_eager``, or ``defer_traced`` for a call a
    graph is traced for), whether or not it could run it: a call it would leave is the next backend's either way,
    never its fallback. Empty where it can't run here."""
    impl = _backends[name].ops.get(op)
    defer = None if impl is None else impl.defer_eager if eager else impl.defer_traced
    if defer is None or _unusable_reasons(name, device):
        return []
    return defer(call)


def _unusable_reasons(name: str, device: torch.device | None) -> list[str]:
    """Why backend ``name`` can't run in this process (not installed, failed to load) or on ``device``'s tensors,
    whatever the op; empty when forcing it could run it."""
    reason = unavailable_reason(name)
    if reason is not None:
        return [reason]
    return _backends[name].device_reasons(device) if device is not None else []


def choose(op: str, call: Call, device: torch.device | None, prefer: str | None = None, eager: bool = True) -> Choice:
    """Pick the backend for ``op(**call)``, keeping the reasons of every backend passed over; ``eager=False`` for a
    call a graph is traced for (``OpImpl.defer_traced`` then says which backends leave it, not ``defer_eager``)."""
    order = preference(device, prefer)
    choice = Choice(op=op, backend=FALLBACK, device=device, preferred=order[0], order=tuple(order),
                    forced=order[0] != FALLBACK or forced_backend() is not None)
    may_defer = prefer is None and forced_backend() is None and not (eager and torch.compiler.is_compiling())
    for i, name in enumerate(order):
        deferral = _deferral(name, op, call, device, eager) if may_defer and name != FALLBACK else []
        if deferral:  # the next backend is the preferred one for this call
            choice.deferred[name] = deferral
            if choice.preferred == name:
                choice.preferred = order[i + 1]
            continue
        reasons = _reasons(name, op, call, device)
        if not reasons:
            choice.backend = name
            break
        choice.tried[name] = reasons
    if choice.backend in choice.tried:
        raise ValueError(f"{op}: no backend can run this call: " + "; ".join(choice.tried[FALLBACK]))
    return choice


def _untried_reasons(choice: Choice) -> dict[str, list[str]]:
    """Why each backend :func:`choose` would not try was not used: it can't run here, or another was forced or is
    the default (then forcing it is suggested)."""
    kind = choice.device.type if choice.device is not None else "these"
    untried = {}
    for name in BACKEND_NAMES:
        if name in choice.order:
            continue
        unusable = _unusable_reasons(name, choice.device)
        if unusable:  # suggest forcing only a backend that could run here
            untried[name] = unusable
        elif choice.forced:
            untried[name] = [f"'{choice.preferred}' is forced"]
        else:
            untried[name] = [f"not the default for {kind} tensors (force it with use_backend({name!r}))"]
    return untried


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
        if strict():
            raise BackendUnavailableError(choice.strict_message(), choice)
        key = (op, choice.preferred, "; ".join(choice.reasons))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(choice.fallback_message(), FallbackWarning, stacklevel=_callers_level())
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


def traced_op(op: str, tensors: tuple, options: tuple, device: torch.device, forced: str | None) -> str | None:
    """While torch.compile traces a call of ``op``: the ``OpImpl.traced`` op of the backend :func:`choose` picks, by
    name, which the graph then runs; None where that backend has none or the call falls back (portable_ops' custom
    op then dispatches when the graph runs, warning or raising as an eager call would).

    Dynamo runs this once per trace and keeps its result as a constant of the graph, so its arguments are constants:
    the call as the backends' choice reads it, ``tensors`` as ``(name, shape, dtype)`` (dtype None: no tensor), meta
    stand-ins of that shape, and ``options`` as ``(name, value)``; ``forced``, :func:`forced_by_use_backend`, read by
    the caller in traced code, where dynamo guards on it (a graph traced before a backend was forced is traced again
    inside ``use_backend``). ``PORTABLE_OPS_BACKEND`` is read here, when a graph is traced."""
    choice = _traced_choice(op, tensors, options, device, forced)
    traced = _backends[choice.backend].ops[op].traced
    return None if choice.is_fallback or traced is None else traced()


def traced_backend(op: str, tensors: tuple, options: tuple, device: torch.device, forced: str | None) -> str | None:
    """While torch.compile traces a call of ``op``: the name of the backend :func:`choose` picks (:func:`traced_op`'s
    arguments), None where the call falls back. A backend with no traced op whose ``OpImpl.autograd`` takes the call
    is traced as those torch ops."""
    choice = _traced_choice(op, tensors, options, device, forced)
    return None if choice.is_fallback else choice.backend


def loaded_op(backend: str, op: str) -> OpImpl:
    """``op`` of ``backend``, which a choice just loaded (no import, no lock: traced code reads it)."""
    return _backends[backend].ops[op]


def _traced_choice(op, tensors, options, device, forced) -> Choice:
    call = {name: None if dtype is None else torch.empty(shape, dtype=dtype, device="meta")
            for name, shape, dtype in tensors}
    call.update(options)
    return choose(op, call, device, forced, eager=False)  # dynamo runs this outside the traced code


# torch.compiler.assume_constant_result's mark, set without it: the decorator imports torch._dynamo, which
# ``import portable_ops`` does not
traced_op._dynamo_marked_constant = traced_backend._dynamo_marked_constant = True


def dispatch(op: str, call: Call, device: torch.device | None, prefer: str | None = None) -> OpImpl:
    """The implementation to run for ``op(**call)``, chosen by :func:`select`."""
    return _backends[select(op, call, device, prefer).backend].ops[op]
