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

from .index_values import check_values_once

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Complex tensors are stepped and measured as (real, imaginary) pairs, as torch does (view_as_real).
COMPLEX_DTYPES = (torch.complex32, torch.complex64, torch.complex128)
_TENSOR_LIST_DTYPES = frozenset(FLOAT_DTYPES + COMPLEX_DTYPES)


def _name(arg: str, i: int | None) -> str:
    return arg if i is None else f"{arg}[{i}]"


def plain(value):
    """A numpy scalar or 0-d array as the Python value it holds; anything else unchanged. Under torch.compile an
    int64's or float64's value is read at trace time (the graph specialises on it, as on a Python number); other
    numpy ints and bools can't be read there (nor can SDPA's ``is_causal``), so they break the graph."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    return value


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
    if value.__class__ is not float:  # a Python float, every step's usual value, skips the conversions
        value = _checked_float(arg, value)
        if value is None:
            return  # reading a device tensor would sync; device-resident values are trusted
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{arg} must be {'finite' if finite else 'a number or inf, not NaN'}, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{arg} must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{arg} must be {'<' if high_open else '<='} {high}, got {value}")


def _checked_float(arg: str, value) -> float | None:
    """``value`` as a float (:func:`as_number`; a one-element tensor's value; None for one on a device), or the
    error naming ``arg``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{arg} must be a float or a one-element tensor, "
                             f"got a tensor of shape {tuple(value.shape)}")
        if value.device.type != "cpu" and value.device.type != "meta":
            return None
        value = value.item()
    value = as_number(value)
    if not isinstance(value, float):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}")
    return value


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
_data_ptr = operator.methodcaller("data_ptr")
_nbytes = operator.attrgetter("nbytes")
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
                raise ValueError(f"{_name(arg, i)} has shape {tuple(t.shape)} "
                                 f"but {_name(like, i)} has {tuple(p.shape)}")
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


def check_scalar_tensor(arg: str, t, device: torch.device | None):
    """``t``, None or a one-element tensor on the params' device type, as a 0-dim view (GradScaler's tensors are
    ``[]`` or, in older releases, ``[1]``; the kernels take one shape)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise TypeError(f"{arg} must be None or a one-element tensor")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{arg} is on {t.device} but the params are on {device}")
    return t.reshape(())


def check_distinct(arg: str, tensors, name=None) -> None:
    """No two tensors sharing an element: a fused step updates every tensor of a launch at once, so one listed twice,
    or two views of one buffer that overlap, would be read and written by two programs in a race (torch's loop steps
    such an element twice in turn). Views that don't overlap (DDP's gradient buckets) are distinct; interleaved ones
    (``buf[0::2]``, ``buf[1::2]``) are refused with overlapping ones, as their address ranges meet. ``name(i)``: how
    the message names ``tensors[i]`` (default ``arg[i]``)."""
    starts = list(map(_data_ptr, tensors))
    extents = map(_nbytes, tensors) if all(map(torch.Tensor.is_contiguous, tensors)) else map(_extent, tensors)
    ends = list(map(operator.add, starts, extents))
    order = sorted(range(len(tensors)), key=starts.__getitem__)
    # C-level passes, the common call on every step: each tensor ends before the next one in address order starts
    if all(map(operator.le, map(ends.__getitem__, order[:-1]), map(starts.__getitem__, order[1:]))):
        return
    reach: dict = {}  # per device, (end, index) of the tensor reaching furthest so far in address order
    for i in order:
        t = tensors[i]
        if t.numel() == 0 or t.device.type == "meta":
            continue
        furthest, j = reach.get(t.device, (starts[i], i))
        if furthest > starts[i]:
            named = name or (lambda k: f"{arg}[{k}]")
            later, first = named(max(i, j)), named(min(i, j))
            if starts[i] == starts[j] and (t.shape, t.stride()) == (tensors[j].shape, tensors[j].stride()):
                raise ValueError(f"{later} is {first} (the same memory): each tensor may be stepped once per step; "
                                 f"pass it once")
            raise ValueError(f"{later} overlaps {first} in memory (views of one buffer whose address ranges meet): "
                             f"each element may be stepped once per step; give each tensor memory of its own")
        if ends[i] > furthest:
            reach[t.device] = (ends[i], i)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (strides are never negative)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))) * t.element_size()


def _check_rank(arg: str, t, layout: str) -> None:
    """``t`` a tensor of ``layout``'s rank (``"[batch, heads, seq, head_dim]"``: 4)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a tensor {layout}, got {type(t).__name__}")
    dims = layout.count(",") + 1
    if t.dim() != dims:
        raise ValueError(f"{arg} must have {dims} dimensions {layout}, got shape {tuple(t.shape)}")


def _check_qkv(q, k, v, layout: str, batched: bool) -> None:
    """q, k and v as attention takes them: floating tensors of ``layout``'s rank (heads second), one dtype
    and device, k shaped like v but in the head dim (v's may differ), q's head dim k's, and q's heads a
    multiple of k's."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(arg, t, layout)
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{arg} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{arg} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{arg} is on {t.device} but q is on {q.device}")
        if batched and t.shape[0] != q.shape[0]:
            raise ValueError(f"{arg} has batch {t.shape[0]} but q has batch {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has head_dim {q.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match but in the "
                         f"head dim (v's may be its own)")
    _check_heads(q.shape[1], k.shape[1], "k and v")  # dim 1 in both layouts


def _check_heads(hq, hkv, kv: str) -> None:
    if (hq % hkv != 0) if hkv else hq != 0:
        raise ValueError(f"q has {hq} heads, {kv} have {hkv}: q's head count must be a multiple of k's "
                         f"(grouped-query)")


_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def check_attention(q, k, v) -> None:
    """``attention``'s tensors; its other arguments: :func:`attention_options`."""
    # Fast path, run on every eager call (host-time critical): one expression that holds for every valid
    # call but those with no heads; the checks one by one, to name the culprit, otherwise.
    try:
        q_shape, k_shape, dtype, device = q.shape, k.shape, q.dtype, q.device
        ok = (len(q_shape) == 4 and k_shape[:3] == v.shape[:3] and len(k_shape) == 4 and v.dim() == 4
              and dtype in _FLOAT_DTYPE_SET
              and k.dtype == dtype and v.dtype == dtype and k.device == device and v.device == device
              and k_shape[0] == q_shape[0] and k_shape[3] == q_shape[3] and k_shape[1] > 0
              and q_shape[1] % k_shape[1] == 0)
    except AttributeError:
        ok = False
    if not ok:
        _check_qkv(q, k, v, "[batch, heads, seq, head_dim]", batched=True)


def flag(arg: str, value) -> bool:
    """A bool option (numpy's too), refused by name otherwise."""
    value = plain(value)
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__} {value!r}")
    return value


def attention_sinks(sinks, q, heads_dim: int):
    """``sinks`` as the backends take it: None, or ``[heads]`` in lse's dtype (float32; float64 for float64 q) on
    q's device, cast from any floating dtype (differentiably: its gradient reaches the caller's tensor in its own
    dtype). ``heads_dim``: q's dim that counts the query heads."""
    if sinks is None:
        return None
    expected = "a floating-point tensor [heads] (one logit per query head)"
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or {expected}, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks has dtype {sinks.dtype}; expected {expected}")
    if sinks.dim() != 1:
        raise ValueError(f"sinks must have 1 dimension [heads], got shape {tuple(sinks.shape)}")
    heads = q.shape[heads_dim]
    if sinks.shape[0] != heads:
        raise ValueError(f"sinks has {sinks.shape[0]} entries but q has {heads} heads: one logit per query head")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return sinks if sinks.dtype == dtype else sinks.to(dtype)


def attention_options(head_dim, causal, scale, window, softcap, *, compiling=False) -> tuple:
    """``(causal, scale, window, softcap)`` checked and as the backends take them: ``scale`` a float
    (default ``1 / sqrt(head_dim)``), ``window`` None or ``(left, right)`` of ints or None, ``softcap``
    None or a positive float; numpy values as the Python values they hold. Under torch.compile
    (``compiling``) a ``scale`` or ``softcap`` that is symbolic or a one-element tensor is passed on as it
    is (reading its value would break the graph or recompile per value) and the custom op checks it when it
    runs (:func:`op_scalars`).

    One spelling per mask, so that a kernel without windows still takes the masks it has: under
    ``causal`` a window's right side is moot (dropped); ``window=(left, 0)`` is ``causal`` with
    ``(left, None)``; a window unbounded on both sides is no window."""
    causal = flag("causal", causal)
    if scale is None:
        d = int(head_dim)  # under torch.compile this specialises the head dim: the kernels do too
        scale = 1.0 / math.sqrt(d) if d else 1.0
    else:
        scale = _number_option("scale", scale, compiling)
    if window is not None:
        left, right = window_bounds(window)
        if right == 0:
            causal = True
        if causal:
            right = None
        window = None if left is None and right is None else (left, right)
    if softcap is not None:
        softcap = _number_option("softcap", softcap, compiling)
    return causal, scale, window, softcap


def _number_option(arg: str, value, compiling: bool):
    """``scale`` or ``softcap`` as the backends take it; under torch.compile a symbolic float, a numpy number (a
    tensor to dynamo, whose value can't always be read while tracing) or a one-element tensor is passed on as a
    float or a tensor, its value checked when the custom op runs."""
    if compiling and isinstance(value, np.ndarray):  # a numpy number is a tensor to dynamo: traced, not read
        value = torch.as_tensor(value)
    elif compiling and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # an int dynamo made dynamic is read here: one graph per value, as a float's
    value = plain(value)
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(_NOT_DIFFERENTIABLE_IN.format(arg))
    if compiling and (isinstance(value, float) or isinstance(value, torch.Tensor) and value.numel() == 1):
        return value
    return softcap_value(value) if arg == "softcap" else _scale_value(value)


def _scale_value(scale) -> float:
    check_number("scale", scale)
    return float(scale.item() if isinstance(scale, torch.Tensor) else as_number(scale))


def op_scalars(scale, softcap) -> tuple:
    """``scale, softcap`` as a custom op takes them: ``(scale, softcap, scale_tensor, softcap_tensor)``, where a
    one-element tensor (under torch.compile) travels as a tensor argument and a placeholder takes its place."""
    scale_tensor = scale if isinstance(scale, torch.Tensor) else None
    softcap_tensor = softcap if isinstance(softcap, torch.Tensor) else None
    return (1.0 if scale_tensor is not None else scale, None if softcap_tensor is not None else softcap,
            scale_tensor, softcap_tensor)


def op_values(scale, softcap, scale_tensor, softcap_tensor) -> tuple[float, float | None]:
    """Inside a custom op, as it runs: :func:`op_scalars`' four values back to the checked ``scale, softcap``."""
    return (_scale_value(scale if scale_tensor is None else scale_tensor),
            softcap_value(softcap if softcap_tensor is None else softcap_tensor))


_NOT_DIFFERENTIABLE_IN = ("{0} must be a number, or a tensor that does not require grad: attention is not "
                          "differentiable in {0}")


def window_bounds(window) -> tuple[int | None, int | None]:
    """``window`` as ``(left, right)``, Python ints or None (an unbounded side); a TypeError or ValueError
    naming it for anything else."""
    expected = "None or a pair (left, right), each a non-negative int or None (unbounded)"
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"window must be {expected}, got {type(window).__name__} {window!r}")
    if len(window) != 2:
        raise ValueError(f"window must be {expected}, got {len(window)} entries: {tuple(window)!r}")
    bounds = []
    for i, side in enumerate(map(plain, window)):
        if side is None:
            bounds.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"window[{i}] must be a non-negative int or None (unbounded), got "
                            f"{type(side).__name__} {side!r}")
        if side < 0:
            raise ValueError(f"window[{i}] must be >= 0, got {side}; use None for an unbounded side "
                             f"(FlashAttention's -1)")
        bounds.append(min(side, WIDEST_WINDOW))
    return bounds[0], bounds[1]


WIDEST_WINDOW = 2**62  # past any sequence: a wider side means the same, and stays an int64 for every backend


def softcap_value(softcap) -> float | None:
    """``softcap`` as a positive float, or None when it is off (None or 0). Taken as ``scale`` is: a
    Python or numpy number, or a one-element CPU tensor (a device tensor would have to be read back)."""
    if softcap is None:
        return None
    if isinstance(softcap, torch.Tensor) and softcap.device.type != "cpu":
        raise ValueError(f"softcap must be a number or a one-element CPU tensor, got a tensor on {softcap.device}")
    check_number("softcap", softcap, low=0.0)
    value = float(softcap.item() if isinstance(softcap, torch.Tensor) else as_number(softcap))
    return value or None


def _check_int(arg: str, value, low: int = 0) -> None:
    """A Python or numpy int, not a bool, at least ``low`` (under torch.compile a symbolic int passes as an int)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{arg} must be >= {low}, got {value}")


def _check_index_tensor(arg: str, t, dims: int, layout: str, device: torch.device) -> None:
    """An int32 index tensor of ``dims`` dimensions on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be an int32 tensor {layout}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{arg} has dtype {t.dtype}; expected torch.int32 {layout}")
    if t.dim() != dims:
        raise ValueError(f"{arg} must have {dims} dimension{'s' if dims > 1 else ''} {layout}, got shape "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{arg} is on {t.device} but q is on {device}")


def check_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """``attention_varlen``'s tensors and lengths, but not the values of ``cu_seqlens_*``
    (:func:`check_cu_seqlens_values`, which reads them); its options: :func:`attention_options`."""
    _check_qkv(q, k, v, "[tokens, heads, head_dim]", batched=False)
    for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_index_tensor(arg, cu, 1, "[N + 1] (cumulative sequence lengths, from 0)", q.device)
        if cu.shape[0] == 0:
            raise ValueError(f"{arg} must have N + 1 >= 1 entries (N sequences), got none")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.shape[0]}: q and k must hold the same number of sequences")
    _check_int("max_seqlen_q", max_seqlen_q)
    _check_int("max_seqlen_k", max_seqlen_k)



def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, tokens_q: int, tokens_k: int, max_seqlen_q: int,
                            max_seqlen_k: int) -> None:
    """The values of ``cu_seqlens_q`` and ``_k``: from 0, non-decreasing, ending at q's (k's) token count,
    no sequence longer than ``max_seqlen_*``. Read once per version of the tensors
    (:func:`check_values_once`)."""
    def check(values_q, values_k):
        for side, values, tokens, longest in (("q", values_q, tokens_q, max_seqlen_q),
                                              ("k", values_k, tokens_k, max_seqlen_k)):
            arg = f"cu_seqlens_{side}"
            if values[0] != 0:
                raise ValueError(f"{arg}[0] must be 0, got {values[0]}")
            lengths = np.diff(values.astype(np.int64))
            if (lengths < 0).any():
                i = int(np.argmax(lengths < 0))
                raise ValueError(f"{arg} must be non-decreasing, but {arg}[{i + 1}] = {values[i + 1]} < "
                                 f"{arg}[{i}] = {values[i]}")
            if values[-1] != tokens:
                raise ValueError(f"{arg}[-1] is {values[-1]} but {side} has {tokens} tokens (its first dimension)")
            if lengths.size and lengths.max() > longest:
                i = int(np.argmax(lengths))
                raise ValueError(f"max_seqlen_{side} is {longest} but sequence {i} has {lengths[i]} tokens "
                                 f"({arg}); it must be at least the longest (kernels size their grids from it)")

    check_values_once((cu_seqlens_q, cu_seqlens_k), ("cu_seqlens", tokens_q, tokens_k, max_seqlen_q, max_seqlen_k),
                      check)


def _check_cache(k_cache, v_cache, device: torch.device, dtype: torch.dtype) -> None:
    layout = "[num_pages, page_size, kv_heads, head_dim]"
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_rank(arg, t, layout)
        if t.dtype != dtype:
            raise TypeError(f"{arg} has dtype {t.dtype} but q has {dtype}")
        if t.device != device:
            raise ValueError(f"{arg} is on {t.device} but q is on {device}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} but v_cache has {tuple(v_cache.shape)}; they "
                         f"must match but in the head dim (v's may be its own)")
    if k_cache.shape[1] == 0:
        raise ValueError("k_cache has page_size 0 (its second dimension); a page must hold at least one token")


def _check_page_tables(block_table, cache_seqlens, batch: int, device: torch.device) -> None:
    _check_index_tensor("block_table", block_table, 2, "[batch, max_pages] (page numbers)", device)
    _check_index_tensor("cache_seqlens", cache_seqlens, 1, "[batch] (tokens per sequence)", device)
    for arg, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.shape[0] != batch:
            raise ValueError(f"{arg} has batch {t.shape[0]} but q has batch {batch}")


def check_paged_attention(q, k_cache, v_cache, block_table, cache_seqlens) -> None:
    """``paged_attention``'s tensors, but not the values of ``block_table`` and ``cache_seqlens``
    (:func:`check_page_values`); its options: :func:`attention_options`."""
    _check_rank("q", q, "[batch, seq, heads, head_dim]")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected float16, bfloat16, float32 or float64")
    _check_cache(k_cache, v_cache, q.device, q.dtype)
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[-1]} but q has head_dim {q.shape[-1]}")
    _check_heads(q.shape[2], k_cache.shape[2], "k_cache and v_cache")
    _check_page_tables(block_table, cache_seqlens, q.shape[0], q.device)
    check_not_differentiated("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache)


def check_paged_kv_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new) -> None:
    """``paged_kv_append``'s arguments but the values of ``block_table`` and ``cache_seqlens``."""
    for arg, t in (("k_new", k_new), ("v_new", v_new)):
        _check_rank(arg, t, "[batch, new_tokens, kv_heads, head_dim]")
    if k_new.dtype not in FLOAT_DTYPES:
        raise TypeError(f"k_new has dtype {k_new.dtype}; expected float16, bfloat16, float32 or float64")
    if v_new.shape[:-1] != k_new.shape[:-1]:
        raise ValueError(f"v_new has shape {tuple(v_new.shape)} but k_new has {tuple(k_new.shape)}; they must match "
                         f"but in the head dim (v's may be its own)")
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(t, torch.Tensor) and t.dtype != k_new.dtype:
            raise TypeError(f"{arg} has dtype {t.dtype} but k_new has {k_new.dtype}; the cache keeps its dtype, "
                            f"cast k_new and v_new to it")
    if v_new.dtype != k_new.dtype or v_new.device != k_new.device:
        raise TypeError(f"v_new is {v_new.dtype} on {v_new.device} but k_new is {k_new.dtype} on {k_new.device}")
    _check_cache(k_cache, v_cache, k_new.device, k_new.dtype)
    for new, new_t, cache, cache_t in (("k_new", k_new, "k_cache", k_cache), ("v_new", v_new, "v_cache", v_cache)):
        if new_t.shape[2:] != cache_t.shape[2:]:
            raise ValueError(f"{new} has (kv_heads, head_dim) {tuple(new_t.shape[2:])} but {cache} has "
                             f"{tuple(cache_t.shape[2:])}")
    _check_page_tables(block_table, cache_seqlens, k_new.shape[0], k_new.device)
    check_not_differentiated("paged_kv_append", k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    if not torch.compiler.is_compiling():  # dynamo can't trace inference mode: the custom op checks as it runs
        check_caches_writable(k_cache, v_cache)


def check_caches_writable(k_cache, v_cache) -> None:
    """torch's rule for every in-place write, kernels' raw pointers included: an inference tensor is written only
    inside inference mode."""
    if torch.is_inference_mode_enabled():
        return
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.is_inference():
            raise RuntimeError(f"paged_kv_append: {arg} was made under torch.inference_mode(), and torch lets an "
                               f"inference tensor be written in place only inside it: append under "
                               f"torch.inference_mode() too")


def check_not_differentiated(op: str, **tensors) -> None:
    """Inference-only ops refuse to run where autograd would record them: with grad mode on, an input that
    requires grad would get no gradient (or, written into a cache, a graph across decode steps)."""
    if not torch.is_grad_enabled():
        return
    for arg, t in tensors.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(f"{op} is not differentiable (inference only), but {arg} requires grad: call it "
                               f"under torch.no_grad() or torch.inference_mode(), or pass {arg}.detach()")


def check_page_values(block_table, cache_seqlens, *, page_size: int, num_pages: int, new_tokens: int,
                      window_left: int | None = None, append: bool = False) -> None:
    """The values of ``block_table`` and ``cache_seqlens``, read once per version (:func:`check_values_once`).

    Attention (``append=False``): sequence b's queries are its last ``new_tokens`` positions of
    ``cache_seqlens[b]``, and the keys they see start ``window_left`` before the first of them. Appending:
    positions ``cache_seqlens[b] ..`` ``+ new_tokens`` are written, and no two tokens may land in one slot.
    Every page either touches must be a page of the cache, and every position inside the table's
    ``max_pages * page_size``."""
    def check(table, lengths):
        lengths = lengths.astype(np.int64)
        capacity = table.shape[1] * page_size
        end = lengths + new_tokens if append else lengths
        if (lengths < 0).any():
            b = int(np.argmax(lengths < 0))
            raise ValueError(f"cache_seqlens[{b}] is {lengths[b]}; lengths must be >= 0")
        if (end > capacity).any():
            b = int(np.argmax(end > capacity))
            what = (f"cache_seqlens[{b}] + {new_tokens} new tokens = {end[b]}" if append
                    else f"cache_seqlens[{b}] is {end[b]}, which")
            raise ValueError(f"{what} exceeds the {capacity} positions block_table holds ({table.shape[1]} pages of "
                             f"{page_size})")
        if append:
            start = lengths
        else:
            start = np.zeros_like(lengths) if window_left is None else np.maximum(end - new_tokens - window_left, 0)
        pages = np.arange(table.shape[1])
        touched = (pages >= start[:, None] // page_size) & (pages * page_size < end[:, None])
        bad = touched & ((table < 0) | (table >= num_pages))
        if bad.any():
            b, j = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"block_table[{b}, {j}] is {table[b, j]}, not a page of the cache (it has {num_pages}); "
                             f"sequence {b} {'writes' if append else 'reads'} positions "
                             f"{max(start[b], j * page_size)} to {min(end[b], (j + 1) * page_size) - 1} there")
        if append and new_tokens:
            positions = lengths[:, None] + np.arange(new_tokens)
            slots = table[np.arange(len(lengths))[:, None], positions // page_size] * page_size + positions % page_size
            unique, counts = np.unique(slots.ravel(), return_counts=True)
            if (counts > 1).any():
                slot = unique[np.argmax(counts > 1)]
                (b1, t1), (b2, t2) = np.argwhere(slots == slot)[:2]
                raise ValueError(f"token {t1} of sequence {b1} and token {t2} of sequence {b2} would both be written "
                                 f"to page {slot // page_size}, slot {slot % page_size}: block_table maps both "
                                 f"positions to one page")

    check_values_once((block_table, cache_seqlens),
                      ("append" if append else "attention", page_size, num_pages, new_tokens, window_left), check)
