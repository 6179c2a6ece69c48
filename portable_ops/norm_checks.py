"""Argument checks of ``rms_norm`` and ``layer_norm`` (``portable_ops/checks.py`` holds the other ops').

They run before any backend is chosen, and name the argument at fault.
"""

from __future__ import annotations

import numbers
import sys

import torch

from .checks import FLOAT_DTYPES, plain

_DTYPE_NAMES = "float16, bfloat16, float32 or float64"


def check_float_tensor(op: str, arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {arg} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {arg} has dtype {t.dtype}; expected {_DTYPE_NAMES}")


def check_norm(op: str, x, residual, weight, bias) -> None:
    """``x [..., D]`` floating; ``residual`` None or x's shape; ``weight``/``bias`` None or ``[D]``; all on x's
    device (weight, bias and residual may have another floating dtype, as torch's mixed-dtype norms take)."""
    check_float_tensor(op, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the one normalised), got a 0-d tensor")
    d = x.shape[-1]
    for arg, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        check_float_tensor(op, arg, t)
        if t.device != x.device:
            raise ValueError(f"{op}: {arg} is on {t.device} but x is on {x.device}")
        want = tuple(x.shape) if arg == "residual" else (d,)
        if tuple(t.shape) != want:
            what = "x's shape" if arg == "residual" else "[D], D = x.shape[-1] (the normalised dim)"
            raise ValueError(f"{op}: {arg} must have shape {want} ({what}), got {tuple(t.shape)}")


def norm_eps(op: str, eps, dtype: torch.dtype) -> float:
    """``eps`` as a float: None means ``torch.finfo(dtype).eps`` (``F.rms_norm``'s default); a finite number
    >= 0 otherwise (a tensor is refused, as torch's norms take a float)."""
    eps = plain(eps)
    if eps is None:
        return torch.finfo(dtype).eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a float (or None), got {type(eps).__name__}")
    # compared before float(), which overflows on an int past the largest float; NaN fails it too (comparisons
    # trace under torch.compile)
    if not 0 <= eps <= sys.float_info.max:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps}")
    return float(eps)


def last_dim(op: str, normalized_shape) -> int:
    """``normalized_shape`` as the nn modules take it (an int, or a one-element shape): the last dim's size."""
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"portable_ops.nn.{op}: normalized_shape must be the last dim alone (an int or a "
                         f"one-element shape), got {shape}; these norms normalise over the last dim only")
    if isinstance(shape[0], bool) or not isinstance(shape[0], numbers.Integral) or shape[0] < 1:
        raise ValueError(f"portable_ops.nn.{op}: normalized_shape must be a positive int, got {shape[0]!r}")
    return int(shape[0])


def check_module_input(op: str, x, normalized_shape) -> None:
    """x's last dim is the module's ``normalized_shape``, as torch's modules require: without a weight nothing
    else would tell a wrong width (the norm would run over x's own last dim)."""
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] != normalized_shape[0]:
        raise ValueError(f"portable_ops.nn.{op}: x's last dim is {x.shape[-1]} but the module normalises over "
                         f"normalized_shape={list(normalized_shape)}; got x of shape {tuple(x.shape)}")
