"""A test double of torch-neuronx's ``nki_op``: an NKI kernel's launch registered as a real ``torch.library`` custom
op, as torch-neuronx registers it, where torch-neuronx can't be installed (CPU tensors, the project's emulator).

**A test double, not torch-neuronx.** :func:`nki_op` takes torch-neuronx's parameters with their defaults
(``backends/nki/aws_signatures.py``, ``TORCH_NEURONX_API``; tests/test_nki_api.py checks them) and does what its source
does: ``torch.library.custom_op`` with the schema inferred from the function and ``mutates_args``, the function
itself registered as the fake, the ``CustomOpDef`` returned, so ``register_fake`` and ``register_autograd`` apply.
On top of that it enforces the custom-op contract on every call, where torch leaves it to ``torch.library.opcheck``:
each tensor argument that ``mutates_args`` does not name is compared byte for byte before and after the call, and a
write to one raises :class:`UndeclaredWrite` naming it (a captured graph may reorder or drop a write it was not told
of). torch itself refuses outputs that alias inputs.
"""

from __future__ import annotations

import inspect

import torch


class UndeclaredWrite(RuntimeError):
    """An op's function wrote a tensor argument that its ``mutates_args`` does not declare."""


def _tensors(name, value):
    """(label, tensor) for a tensor argument, or for each tensor of a list argument."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, t in enumerate(value):
            if isinstance(t, torch.Tensor):
                yield f"{name}[{i}]", t


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _checked(name, fn, declared):
    """``fn``, refusing a write to any tensor argument outside ``declared`` (names of parameters)."""
    signature = inspect.signature(fn)

    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        kept = [(label, t, _bytes(t).clone()) for arg, value in bound.arguments.items() if arg not in declared
                for label, t in _tensors(arg, value)]
        out = fn(*args, **kwargs)
        for label, t, before in kept:
            if not torch.equal(_bytes(t), before):
                raise UndeclaredWrite(f"{name} wrote its argument {label}, which its mutates_args "
                                      f"{sorted(declared)} does not declare: declare it, or return a new tensor")
        return out

    return run


def nki_op(name, fn=None, mutates_args={}):
    """``@nki_op("namespace::name", mutates_args={...})`` over a function with type annotations whose body launches
    NKI kernels: returns the registered ``torch.library`` op (a ``CustomOpDef``)."""
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(f"nki_op name {name!r}: expected 'namespace::name', e.g. 'mylib::my_add'")

    def register(fn):
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        params = inspect.signature(fn).parameters
        declared = set(params) if mutates_args == "unknown" else set(mutates_args)
        op = torch.library.custom_op(name, _checked(name, fn, declared), mutates_args=mutates_args, schema=schema)
        op.register_fake(fn)
        return op

    return register if fn is None else register(fn)
