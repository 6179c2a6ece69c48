"""Argument checks shared by every public entry point.

Each runs before any backend is chosen or any tensor written, so a rejected
call leaves parameters and optimizer state exactly as they were. Messages name
the argument and what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Complex tensors are stepped and measured as (real, imaginary) pairs, as torch does (view_as_real).
COMPLEX_DTYPES = (torch.complex32, torch.complex64, torch.complex128)
_TENSOR_LIST_DTYPES = frozenset(FLOAT_DTYPES + COMPLEX_DTYPES)


def _name(arg: str, i: int | None) -> str:
    return arg if i is None else f"{arg}[{i}]"


def as_number(value):
    """``value`` as a Python float when it is a real number as torch.optim takes one: a Python or numpy
    int or float (what a scheduler's lambda may return), or a 0-d numpy array; else ``value`` itself."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iuf":
        return float(value)
    return value


def check_number(arg: str, value, *, low: float | None = None, high: float | None = None,
                 high_open: bool = False, finite: bool = True) -> None:
    """A scalar (a real number, see :func:`as_number`, or a one-element tensor) inside [low, high] or
    [low, high); finite unless ``finite=False`` (NaN is refused either way)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{arg} must be a float or a one-element tensor, got a tensor of shape {tuple(value.shape)}")
        if value.device.type != "cpu" and value.device.type != "meta":
            return  # reading a device tensor would sync; device-resident values are trusted
        value = value.item()
    value = as_number(value)
    if not isinstance(value, float):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{arg} must be {'finite' if finite else 'a number or inf, not NaN'}, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{arg} must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{arg} must be {'<' if high_open else '<='} {high}, got {value}")


def check_adam_hyperparameters(*, lr, beta1, beta2, eps, weight_decay) -> None:
    check_number("lr", lr, low=0.0)
    check_number("betas[0]", beta1, low=0.0, high=1.0, high_open=True)
    check_number("betas[1]", beta2, low=0.0, high=1.0, high_open=True)
    check_number("eps", eps, low=0.0)
    check_number("weight_decay", weight_decay, low=0.0)


def check_state_dtype(state_dtype) -> None:
    if state_dtype is None or state_dtype is torch.float32:
        return
    if not isinstance(state_dtype, torch.dtype):
        raise TypeError(f"state_dtype must be None or torch.float32, got {type(state_dtype).__name__} {state_dtype!r}")
    raise ValueError(f"state_dtype must be None (state in the param's dtype) or torch.float32, got {state_dtype}")


def state_dtype_for(param_dtype: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a param's optimizer state: float32 for half params under ``state_dtype=torch.float32``,
    else the param's own (float32 state never narrows a float64 param's); a complex param's is the complex
    dtype of its real parts' state."""
    if param_dtype.is_complex:
        return state_dtype_for(param_dtype.to_real(), state_dtype).to_complex()
    return state_dtype if state_dtype is not None and param_dtype in HALF_DTYPES else param_dtype


_layout = operator.attrgetter("shape", "dtype", "device", "layout")  # C-level: runs per tensor per step
_dtype, _device, _storage = operator.itemgetter(1), operator.itemgetter(2), operator.itemgetter(3)  # of a _layout


def layouts(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """(shape, dtype, device, layout) of each tensor, in one C-level pass."""
    return list(map(_layout, tensors))


def check_tensor_lists(lists: dict[str, Sequence[torch.Tensor]], *, like: str, one_device: bool = True,
                       state: Sequence[str] = (), state_dtype: torch.dtype | None = None,
                       like_layouts: list[tuple] | None = None) -> set[torch.dtype]:
    """Every list as long as ``lists[like]``; every tensor shaped, typed and placed like its ``like`` twin.

    ``one_device``: all of ``lists[like]`` on one device (one kernel launch serves them), else
    only of one device type. The lists named in ``state`` are typed ``state_dtype_for(their twin's
    dtype, state_dtype)`` instead. ``like_layouts``: ``layouts(lists[like])``, when the caller has
    just taken them. Returns the dtypes found in ``lists[like]``.
    """
    ref = lists[like]
    for arg, tensors in lists.items():
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{arg} must be a list of tensors, got {type(tensors).__name__}")
        if len(tensors) != len(ref):
            raise ValueError(f"{arg} has {len(tensors)} tensors but {like} has {len(ref)}")
    # Fast path, run on every optimizer step over hundreds of tensors: compare layouts in bulk and
    # only walk the lists one by one, to name the culprit, when something is off.
    try:
        expected = layouts(ref) if like_layouts is None else like_layouts
        dtypes, devices = set(map(_dtype, expected)), set(map(_device, expected))
        places = devices if one_device else {device.type for device in devices}
        ok = dtypes <= _TENSOR_LIST_DTYPES and set(map(_storage, expected)) <= {torch.strided} and len(places) <= 1
        expected_state = expected
        if state_dtype is not None:
            expected_state = [(s, state_dtype_for(d, state_dtype), dev, lay) for s, d, dev, lay in expected]
        ok = ok and all(layouts(tensors) == (expected_state if arg in state else expected)
                        for arg, tensors in lists.items() if arg != like)
    except AttributeError:
        ok = False
    if not ok:
        _explain_tensor_lists(lists, like, one_device, state, state_dtype)
    return dtypes


def _explain_tensor_lists(lists, like, one_device, state, state_dtype) -> None:
    ref = lists[like]
    device = None
    for i, p in enumerate(ref):
        for arg, tensors in lists.items():
            t = tensors[i]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_name(arg, i)} must be a tensor, got {type(t).__name__}")
            if t.is_sparse or t.layout != torch.strided:
                raise ValueError(f"{_name(arg, i)} is {t.layout}; only dense (strided) tensors are supported")
            if t.dtype not in _TENSOR_LIST_DTYPES:
                raise TypeError(f"{_name(arg, i)} has dtype {t.dtype}; expected one of float16, bfloat16, float32, "
                                "float64 or a complex dtype")
            if arg == like:
                continue
            if t.shape != p.shape:
                raise ValueError(f"{_name(arg, i)} has shape {tuple(t.shape)} but {_name(like, i)} has {tuple(p.shape)}")
            if arg in state:
                _check_state_tensor_dtype(_name(arg, i), t.dtype, _name(like, i), p.dtype, state_dtype)
            elif t.dtype != p.dtype:
                raise TypeError(f"{_name(arg, i)} has dtype {t.dtype} but {_name(like, i)} has {p.dtype}")
            if t.device != p.device:
                raise ValueError(f"{_name(arg, i)} is on {t.device} but {_name(like, i)} is on {p.device}")
        if device is None:
            device = p.device
        elif p.device != device if one_device else p.device.type != device.type:
            raise ValueError(f"{_name(like, i)} is on {p.device} but {_name(like, 0)} is on {device}; one call "
                             f"takes tensors of one {'device' if one_device else 'device type'}")


def _check_state_tensor_dtype(arg, dtype, like, param_dtype, state_dtype) -> None:
    expected = state_dtype_for(param_dtype, state_dtype)
    if dtype == expected:
        return
    if state_dtype is None and dtype == torch.float32 and param_dtype in HALF_DTYPES:
        raise TypeError(f"{arg} has dtype {dtype} but {like} has {param_dtype}; "
                        f"pass state_dtype=torch.float32 for float32 state")
    if state_dtype is None:
        raise TypeError(f"{arg} has dtype {dtype} but {like} has {param_dtype}")
    raise TypeError(f"{arg} has dtype {dtype}, but with state_dtype={state_dtype} the state of a {param_dtype} "
                    f"{like} is {expected}")


def as_real(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each complex tensor as its (real, imaginary) pairs (``torch.view_as_real``: writes go to the
    tensor), the others as they are."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def check_steps(state_steps: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    if len(state_steps) != len(params):
        raise ValueError(f"state_steps has {len(state_steps)} tensors but params has {len(params)}")
    try:
        ok = all(s.numel() == 1 and s.is_floating_point() for s in state_steps)
    except AttributeError:
        ok = False
    if not ok:
        bad = next(i for i, s in enumerate(state_steps)
                   if not isinstance(s, torch.Tensor) or s.numel() != 1 or not s.is_floating_point())
        raise TypeError(f"state_steps[{bad}] must be a one-element floating-point tensor (torch's layout)")


def check_scalar_tensor(arg: str, t, device: torch.device | None) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise TypeError(f"{arg} must be None or a one-element tensor")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{arg} is on {t.device} but the params are on {device}")


def check_distinct(arg: str, tensors) -> None:
    """No tensor twice: a fused step updates every tensor of a launch at once, so one listed twice
    would be read and written by two programs in a race (torch's loop steps it twice in turn)."""
    seen: dict = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0 or t.device.type == "meta":
            continue
        first = seen.setdefault((t.device, t.data_ptr()), i)
        if first != i:
            raise ValueError(f"{arg}[{i}] is {arg}[{first}] (the same memory): each tensor may be stepped once "
                             f"per step; pass it once")


def check_attention(q, k, v, causal=False, scale=None, *, check_scale_value=True) -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{arg} must have 4 dimensions [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{arg} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{arg} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{arg} is on {t.device} but q is on {q.device}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{arg} has batch {t.shape[0]} but q has batch {q.shape[0]}")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{arg} has head_dim {t.shape[-1]} but q has head_dim {q.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    hq, hkv = q.shape[1], k.shape[1]
    if (hq % hkv != 0) if hkv else hq != 0:
        raise ValueError(f"q has {hq} heads, k and v have {hkv}: q's head count must be a multiple of k's (grouped-query)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError("scale must be a number, or a tensor that does not require grad: attention is not "
                        "differentiable in scale")
    if scale is not None and check_scale_value:
        check_number("scale", scale)
