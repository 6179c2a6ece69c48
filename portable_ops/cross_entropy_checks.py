"""Argument checks of ``linear_cross_entropy`` (``portable_ops/checks.py`` holds the other ops').

They run before any backend is chosen, and name the argument at fault; the targets' values are read once per
tensor version (``index_values``), where values can be read (not while torch.compile traces: the custom op reads
them when the graph runs). CUDA targets are checked on the device instead, as ``F.cross_entropy``'s kernel
asserts: a fresh target tensor every step, read on the host, would make every step wait for the device.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .checks import FLOAT_DTYPES, plain
from .definitions.linear_cross_entropy import REDUCTIONS
from .index_values import check_values_once

OP = "linear_cross_entropy"
_INT64 = torch.iinfo(torch.int64)


def _tensor(arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{OP}: {arg} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{OP}: {arg} must be a dense (strided) tensor, got layout {t.layout}")


def check_tensors(hidden, weight, target, bias) -> None:
    """``hidden [..., H]`` floating; ``weight [V, H]`` (V >= 1) and ``bias`` (None or ``[V]``) in hidden's dtype;
    ``target`` int64 of hidden's leading shape; all on hidden's device."""
    _tensor("hidden", hidden)
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{OP}: hidden has dtype {hidden.dtype}; expected float16, bfloat16, float32 or float64")
    if hidden.dim() == 0:
        raise ValueError(f"{OP}: hidden must have at least one dimension (its last is the hidden size), got a 0-d "
                         "tensor")
    h = hidden.shape[-1]
    for arg, t in (("weight", weight), ("bias", bias), ("target", target)):
        if t is None and arg == "bias":
            continue
        _tensor(arg, t)
        if t.device != hidden.device:
            raise ValueError(f"{OP}: {arg} is on {t.device} but hidden is on {hidden.device}")
    if weight.dim() != 2 or weight.shape[1] != h or weight.shape[0] == 0:
        raise ValueError(f"{OP}: weight must have shape [V, {h}] (V >= 1 classes; {h} = hidden.shape[-1]), got "
                         f"{tuple(weight.shape)}")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{OP}: {arg} has dtype {t.dtype} but hidden has {hidden.dtype}; F.linear takes one "
                            "dtype (under autocast all are cast to the autocast dtype)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{OP}: bias must have shape ({weight.shape[0]},) (weight.shape[0], the classes), got "
                         f"{tuple(bias.shape)}")
    if target.dtype != torch.int64:
        raise TypeError(f"{OP}: target has dtype {target.dtype}; expected torch.int64 class indices (as "
                        "F.cross_entropy takes)")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{OP}: target must have shape {tuple(hidden.shape[:-1])} (hidden's without its last dim), "
                         f"got {tuple(target.shape)}")


def options(ignore_index, label_smoothing, reduction, softcap) -> tuple[int, float, str, float | None]:
    """The options as the backends take them: ``ignore_index`` an int, ``label_smoothing`` a float in [0, 1],
    ``reduction`` one of ``"mean"``, ``"sum"``, ``"none"``, ``softcap`` None or a finite float > 0."""
    ignore_index, label_smoothing, softcap = plain(ignore_index), plain(label_smoothing), plain(softcap)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{OP}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not _INT64.min <= ignore_index <= _INT64.max:  # compared with int64 targets
        raise ValueError(f"{OP}: ignore_index must fit in int64 (target's dtype), got {ignore_index}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"{OP}: label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:  # NaN fails it too
        raise ValueError(f"{OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"{OP}: softcap must be a float (or None), got {type(softcap).__name__}")
        if not 0.0 < softcap < math.inf:
            raise ValueError(f"{OP}: softcap must be a finite number > 0 (or None), got {softcap}")
        softcap = float(softcap)
    return int(ignore_index), float(label_smoothing), reduction, softcap


def check_target_values(target, classes: int, ignore_index: int) -> None:
    """Every target in ``[0, classes)`` or ``ignore_index``; read once per version of ``target``, or on CUDA asserted
    on the device (``torch._assert_async``, queued before the op's kernels, which then never run on a bad target)."""
    if target.numel() == 0:
        return
    allowed = f"outside [0, {classes}) and not ignore_index ({ignore_index})"

    def bad(values):  # a tensor's or a numpy array's
        return (values != ignore_index) & ((values < 0) | (values >= classes))

    if target.is_cuda:
        if not torch.compiler.is_compiling():  # traced: the custom op asserts when the graph runs
            torch._assert_async(~bad(target).any(), f"{OP}: a target is {allowed}")
        return

    def check(values):
        found = bad(values)
        if found.any():
            i = int(np.flatnonzero(found.reshape(-1))[0])
            raise ValueError(f"{OP}: target[{i}] (flattened) is {int(values.reshape(-1)[i])}, {allowed}")

    check_values_once((target,), (classes, ignore_index), check)
