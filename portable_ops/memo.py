"""Eager calls memoised whole, and how a chosen backend's op runs: what attention and the norms share.

An eager call's checks, its dispatch and its backend's prepared run depend only on its memo key (its
tensors' layouts, its other arguments, grad mode, autocast and :func:`portable_ops.dispatch.state`), so a
call whose key was seen runs that prepared run at once. The callers build the keys and the prepared calls;
here are the rules they share: a fallback is never memoised (each one warns, or raises under strict mode,
as the checked path does), a call that failed leaves nothing behind, and a backend's op replaced since
(tests stand ones in) is noticed and run.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from . import dispatch

SIZE = 4096  # entries per memo, as the plans': a decode loop meets a new cache length every token


def autocasting(device_type: str) -> bool:
    if torch.compiler.is_compiling():
        # Dynamo (torch 2.11) can't trace is_autocast_available; it only compiles for device
        # types that have autocast
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """Autocast off for a backend's computation: the inputs are already cast (each op's ``autocast_inputs``); left
    on, autocast would also run the float32 products and accumulations (the reference's, the
    emulator's) in the low dtype."""
    return torch.autocast(device_type, enabled=False) if autocasting(device_type) else contextlib.nullcontext()


def autocast_key(t: torch.Tensor):
    """What a memo key holds of autocast: its dtype for ``t``'s device type where it is on, else False."""
    if not torch._C._is_any_autocast_enabled():
        return False
    device_type = t.device.type
    return autocasting(device_type) and torch.get_autocast_dtype(device_type)


def run_choice(op, choice, call, device):
    """Run ``op(**call)`` on ``choice``'s backend, autocast off."""
    with autocast_off(device.type):
        return dispatch.get_backend(choice.backend).ops[op].run(**call)


def memoised(memo: dict, key, op: str):
    """The call memoised under ``key`` for ``op``, unless its backend's op was replaced since."""
    entry = memo.get(key)
    if entry is None:
        return None
    backend, impl, call = entry
    return call if backend.ops.get(op) is impl else None


def remember(memo: dict, key, entry) -> None:
    """Memoise ``entry``, ``(backend, its op, call)``, once its call has run: a call that failed leaves nothing
    behind. Each entry holds its backend and op, so no id in a key is reused while it lives."""
    if len(memo) >= SIZE:
        memo.clear()
    memo[key] = entry


def choose(op: str, layout: tuple, call: dict, device: torch.device, prefer: str | None = None):
    """Dispatch's choice for ``op(**call)`` and, unless it is a fallback (warned of, or raised under strict mode,
    by dispatch just now), ``(backend, its op)``, else None."""
    choice = dispatch.select_by_layout(op, layout, lambda: call, device, prefer)
    if choice.is_fallback:
        return choice, None
    backend = dispatch.get_backend(choice.backend)
    return choice, (backend, backend.ops[op])


def prepared(impl, call: dict, tensors: tuple, varying: tuple = ()) -> Callable:
    """``impl``'s run for every later call of this one's key, taking the tensors that ``tensors`` names
    positionally: what its ``prepare`` returns, given ``call`` but for the ``varying`` tensors (those whose
    layout the key does not hold), where it has one; else its run with the rest of ``call`` fixed."""
    if impl.prepare is not None:
        return impl.prepare(**{name: value for name, value in call.items() if name not in varying})
    options = {name: value for name, value in call.items() if name not in tensors}
    return lambda *given: impl.run(**dict(zip(tensors, given)), **options)


def prepared_backward(op: str, layout: tuple, device: torch.device, make_call: Callable, tensors: tuple,
                      varying: tuple) -> Callable:
    """``run(prefer, *given)``: the backward op ``op`` of every call of one memoised key, its tensors ``given``
    positionally (named by ``tensors``; ``make_call(*given)`` builds its call), with its dispatch memoised per
    forced backend and its backend's run prepared (:func:`prepared`), both at its first call that runs. A
    fallback is neither: it warns, or raises under strict mode, each time. The caller sees that the tensors
    not ``varying`` still have the forward's layout (a ``.data`` swapped since changes it)."""
    runs: dict = {}  # (prefer, dispatch.state()) -> (backend, its op, run)

    def run(prefer, *given):
        state = (prefer, dispatch.state())
        found = runs.get(state)
        if found is None or found[0].ops.get(op) is not found[1]:
            call = make_call(*given)
            choice, backend_op = choose(op, layout, call, device, prefer)
            if backend_op is None:
                return run_choice(op, choice, call, device)
            found = (*backend_op, prepared(backend_op[1], call, tensors, varying))
            result = _run(found[2], given, device)
            runs[state] = found
            return result
        return _run(found[2], given, device)

    return run


def _run(run: Callable, given: tuple, device: torch.device):
    if torch._C._is_any_autocast_enabled():  # loss.backward() inside an autocast block
        with autocast_off(device.type):
            return run(*given)
    return run(*given)
