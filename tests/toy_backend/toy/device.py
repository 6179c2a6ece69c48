"""The "toy" device type, for tests/test_adding_a_backend.py: PyTorch's PrivateUse1 device renamed "toy",
whose tensors are wrappers (``ToyTensor``) around CPU tensors. Every aten op on them runs on the wrapped
tensors and wraps what it returns, so a toy tensor holds real values while ``tensor.device.type`` is "toy".

Renaming PrivateUse1 can be done once per process and can't be undone: import this in a process of its own.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

TYPE = "toy"


class ToyModule:
    """What torch asks of a device type's module (``torch.toy``)."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


_setup_privateuseone_for_python_backend(rename=TYPE, backend_module=ToyModule())
DEVICE = torch.device(TYPE, 0)  # autograd's engine keeps a queue per device index


class ToyTensor(torch.Tensor):
    """A tensor on the toy device: the CPU tensor ``cpu`` it wraps holds its values."""

    @staticmethod
    def __new__(cls, cpu: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, cpu.shape, strides=cpu.stride(), dtype=cpu.dtype,
                                                   storage_offset=cpu.storage_offset(), device=DEVICE,
                                                   requires_grad=cpu.requires_grad)

    def __init__(self, cpu: torch.Tensor):
        self.cpu_tensor = cpu

    def __repr__(self) -> str:
        return f"ToyTensor({self.cpu_tensor!r})"

    def data_ptr(self) -> int:  # the wrapper has no storage of its own
        return self.cpu_tensor.data_ptr()

    def tolist(self) -> list:  # torch refuses it for a subclass: no aten op to dispatch
        return self.cpu_tensor.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_on_toy(func, args, kwargs or {})


def _unwrap(value):
    return value.cpu_tensor if isinstance(value, ToyTensor) else value


def run_on_toy(func, args, kwargs):
    """``func`` on the wrapped CPU tensors; its tensors come back wrapped unless it was asked for another
    device (``.to("cpu")``). An op that returns one of its arguments (in place) returns its wrapper."""
    device = kwargs.get("device")
    to_toy = device is None or torch.device(device).type == TYPE
    if device is not None and to_toy:
        kwargs = dict(kwargs, device=torch.device("cpu"))
    wrappers = {id(t.cpu_tensor): t for t in tree_leaves((args, kwargs)) if isinstance(t, ToyTensor)}
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not to_toy:
        return out
    return tree_map(lambda t: _wrapped(t, wrappers) if isinstance(t, torch.Tensor) else t, out)


def _wrapped(t: torch.Tensor, wrappers: dict) -> ToyTensor:
    return wrappers[id(t)] if id(t) in wrappers else ToyTensor(t)


# What a tensor made on the device (a factory with device="toy", .to("toy")) needs below the wrapper.
_aten = torch.library.Library("aten", "IMPL")
_aten.impl("empty.memory_format", lambda size, dtype=None, layout=None, device=None, pin_memory=None,
           memory_format=None: ToyTensor(torch.empty(size, dtype=dtype, memory_format=memory_format)), "PrivateUse1")
_aten.impl("empty_strided", lambda size, stride, dtype=None, layout=None, device=None, pin_memory=None:
           ToyTensor(torch.empty_strided(size, stride, dtype=dtype)), "PrivateUse1")
_aten.impl("_copy_from", lambda src, dst, non_blocking=False: (_unwrap(dst).copy_(_unwrap(src)), dst)[1],
           "PrivateUse1")
