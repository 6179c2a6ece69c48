"""An index tensor's values (``cu_seqlens``, a block table, cache lengths), checked once per version: the usual
loop passes one such tensor to every layer of a step, and a check that reads it reads the device once."""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

# Value checks already passed: tensor -> {params: (states, the other tensors, their storages)}. Keyed by
# identity (a weakref.WeakKeyDictionary compares tensors with ==), weakly, so a dropped tensor takes its entry
# with it.
_checked_values = WeakIdKeyDictionary()
_CHECKS_PER_TENSOR = 16  # params a tensor is checked under (a decode step: attention and append, per length)


def values_readable(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values now: not while torch.compile traces (fake tensors hold no
    values; the custom op checks when the graph runs), not during CUDA graph capture (a read would break
    it), not on the meta device."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def read_values(t: torch.Tensor) -> np.ndarray:
    """The one device-to-host read of a value check."""
    return t.detach().cpu().numpy()


def _state(t: torch.Tensor) -> tuple:
    """What a passed check holds of ``t``: its version counter, which a ``.data`` swap keeps, and where and how its
    values lie, which the swap changes (the record holds the storage, so its address is not reused meanwhile)."""
    return t._version, t.data_ptr(), tuple(t.shape), t.stride()


def check_values_once(tensors: tuple[torch.Tensor, ...], params: tuple, check) -> None:
    """``check(*arrays)`` on the values of ``tensors`` (numpy, one device-to-host read per distinct tensor),
    unless it passed before on these same tensors, unmodified since (their version counters, and their memory and
    layout: a ``.data`` swapped since keeps the counter), with the
    same ``params``. So the usual loop, one ``cu_seqlens`` (or block table) per step passed to every
    layer, reads once per step, not per layer. Inference tensors have no version counter: they are read
    every call."""
    if not values_readable(tensors[0]):
        return
    tracked = not any(t.is_inference() for t in tensors)
    if tracked:
        states = tuple(_state(t) for t in tensors)
        record = _checked_values.get(tensors[0], {}).get(params)
        if (record is not None and record[0] == states
                and all(ref() is t for ref, t in zip(record[1], tensors[1:]))):
            return
    arrays: dict[int, np.ndarray] = {}
    for t in tensors:
        if id(t) not in arrays:
            arrays[id(t)] = read_values(t)
    check(*(arrays[id(t)] for t in tensors))
    if tracked:
        records = _checked_values.setdefault(tensors[0], {})
        if len(records) >= _CHECKS_PER_TENSOR:
            records.clear()
        records[params] = (states, tuple(weakref.ref(t) for t in tensors[1:]),
                           tuple(t.untyped_storage() for t in tensors))
