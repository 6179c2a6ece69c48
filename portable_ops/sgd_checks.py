"""SGD's argument checks (``checks.py`` holds those every entry point shares): torch.optim.SGD's refusals,
made before any tensor is written."""

from __future__ import annotations

import torch

from . import checks

NESTEROV = "Nesterov momentum requires a momentum and zero dampening"  # torch.optim.SGD's words


def check_sgd_hyperparameters(*, lr, momentum, dampening, weight_decay, nesterov) -> None:
    """What torch.optim.SGD refuses (negative lr, momentum or weight_decay; Nesterov without momentum or with
    dampening), and NaN or infinite values, which torch lets through to poison every param."""
    checks.check_number("lr", lr, low=0.0)
    checks.check_number("momentum", momentum, low=0.0)
    checks.check_number("dampening", dampening)
    checks.check_number("weight_decay", weight_decay, low=0.0)
    if not isinstance(checks.plain(nesterov), (bool, int)):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    if nesterov and (_value(momentum) <= 0 or _value(dampening) != 0):
        raise ValueError(f"{NESTEROV}: got momentum={momentum}, dampening={dampening}")


def _value(x) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else checks.as_number(x))


def check_momentum_buffers(buffers, params, *, checked: bool = False) -> list[int]:
    """``momentum_buffer_list``, as torch's functional ``sgd`` takes it under momentum: a list as long as
    ``params`` of tensors or None (a buffer not made yet), each tensor shaped, typed and placed like its param
    and none sharing memory with another. ``checked``: the caller knows the tensors are those it checked on an
    earlier step, unchanged (the optimizer class), so only the Nones are looked for. Returns their positions."""
    if not isinstance(buffers, (list, tuple)):
        raise TypeError(f"momentum_buffer_list must be a list of tensors or None, got {type(buffers).__name__}")
    if len(buffers) != len(params):
        raise ValueError(f"momentum_buffer_list has {len(buffers)} entries but params has {len(params)}")
    new = [i for i, b in enumerate(buffers) if b is None]
    if new and not isinstance(buffers, list):  # torch's functional sgd puts them in the list it is handed
        raise TypeError(f"momentum_buffer_list must be a list (the new buffers are put in it, at the Nones), got a "
                        f"{type(buffers).__name__} with None at {new[0]}")
    if checked:
        return new
    made = [i for i, b in enumerate(buffers) if b is not None]
    for i in made:
        b, p = buffers[i], params[i]
        name = f"momentum_buffer_list[{i}]"
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(b).__name__}")
        if b.layout != torch.strided:
            raise ValueError(f"{name} is {b.layout}; only dense (strided) tensors are supported")
        if b.shape != p.shape:
            raise ValueError(f"{name} has shape {tuple(b.shape)} but params[{i}] has {tuple(p.shape)}")
        if b.dtype != p.dtype:
            raise TypeError(f"{name} has dtype {b.dtype} but params[{i}] has {p.dtype}")
        if b.device != p.device:
            raise ValueError(f"{name} is on {b.device} but params[{i}] is on {p.device}")
    made_buffers = [buffers[i] for i in made]
    checks.check_distinct("momentum_buffer_list", made_buffers)
    check_no_internal_overlap("momentum_buffer_list", made_buffers, lambda i: f"momentum_buffer_list[{made[i]}]")
    return new


def check_no_internal_overlap(arg: str, tensors, name=None) -> None:
    """No tensor whose elements share memory (an expanded view: a stride 0 over a dim of two or more), which the
    step writes element by element: torch's in-place ops refuse it, after the tensors before it were written.
    ``name(i)``: how the message names ``tensors[i]`` (default ``arg[i]``)."""
    if all(map(torch.Tensor.is_contiguous, tensors)):  # C-level: a contiguous tensor's elements are apart
        return
    overlap = list(map(torch._debug_has_internal_overlap, tensors))  # 0 no, 1 yes, 2 can't tell (torch's ops write)
    if 1 in overlap:
        i = overlap.index(1)
        raise ValueError(f"{name(i) if name else f'{arg}[{i}]'} has elements that share memory (an expanded view, "
                         f"strides {tuple(tensors[i].stride())}); the step writes every element: pass a tensor of its "
                         f"own (.clone())")
