"""How an NKI kernel enters PyTorch, and where it runs: Trainium, AWS's CPU simulator, or the project's emulator.

Each kernel's launch is a PyTorch custom op, ``portable_ops_nki::<name>`` (:class:`KernelOp`), registered the way
AWS documents for torch-neuronx 2.14 / Neuron SDK 2.33 ("How to work with NKI kernels from torch-neuronx"): through
``nki_op`` (``compat.nki_op``: torch-neuronx's, or the project's test double of it), with ``mutates_args`` naming
every tensor the kernel writes, a fake giving the outputs' shapes for ``torch.compile``, and ``register_autograd``
where the op is differentiable. The op's function launches the kernel (:func:`launch`):

* tensors on the ``neuron`` device (torch-neuronx's native PyTorch backend) with the real SDK: the ``@nki.jit``
  kernel is called on them (torch-neuronx compiles it for that call's shapes, dtypes and non-tensor arguments, or
  makes it one node of the graph under ``torch.compile(backend="neuron")``);
* CPU tensors with the real SDK installed (no Trainium needed): ``nki.simulate(kernel)(...)``, the SDK's own CPU
  simulator (NKI 0.3+;
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.simulate.html);
* CPU tensors without the SDK: the project's emulator (``compat.nki`` is the emulator then);
* ``meta`` tensors (the emulator's count-only runs, for the cost model): the emulator, without the op, whose fake
  would answer for them.
"""

from __future__ import annotations

import torch

from . import compat

# Where the simulator and the emulator run kernels: host memory (meta too, for counting). Dispatch hands the
# backend tensors of no other device type than those it declares, where the @nki.jit kernel runs.
HOST_DEVICES = ("cpu", "meta")
NAMESPACE = "portable_ops_nki"  # the custom ops' namespace: torch.ops.portable_ops_nki.<name>
INSTRUCTION_BUDGET = 5_000_000  # per launch: the Neuron compiler's threshold (XTP002), which the emulator enforces


def where(device: torch.device) -> str:
    """'device', 'simulator' or 'emulator': how a kernel on tensors of ``device`` would run."""
    if device.type not in HOST_DEVICES:
        return "device"
    return "simulator" if compat.USING_SDK else "emulator"


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def launch(kernel, *args, **static):
    """Run ``kernel(*args, **static)`` where its tensors live (arguments may be lists of tensors);
    returns torch tensors on that device. Kernels may also write their argument tensors in place."""
    device = next(_tensors(args)).device
    how = where(device)
    if how == "device":
        if not compat.USING_SDK:
            raise RuntimeError(f"{device.type} tensors need the Neuron SDK's nki package: {compat.SDK_REASON}")
        return kernel(*args, **static)
    if how == "simulator":
        if not compat.HAS_SIMULATOR:
            raise RuntimeError("the installed nki has no nki.simulate (NKI 0.3+ needed) to run CPU tensors")
        out = compat.nki.simulate(kernel)(*args, **static)
        return _as_torch(out, device)
    return kernel(*args, **static)


def _as_torch(out, device):
    if out is None:  # an in-place kernel
        return None
    if isinstance(out, (tuple, list)):
        return type(out)(_as_torch(o, device) for o in out)
    if isinstance(out, torch.Tensor):
        return out.to(device)
    return torch.as_tensor(out, device=device)  # numpy results from the simulator


def no_outputs(*args, **kwargs):
    """The fake of an op that only writes its arguments."""
    return None


class KernelOp:
    """``launch_fn``, a typed function that launches a kernel, as the custom op ``portable_ops_nki::<name>``; calling
    this calls the op (``.op``, the ``CustomOpDef``), except on meta tensors (see the module docstring)."""

    def __init__(self, name, launch_fn, fake, mutates_args=()):
        self.launch_fn = launch_fn
        self.op = compat.nki_op(f"{NAMESPACE}::{name}", launch_fn, mutates_args=mutates_args)
        self.op.register_fake(fake)  # outputs from shapes alone, rather than the launch traced on fake tensors

    def __call__(self, *args, **kwargs):
        if any(t.device.type == "meta" for t in _tensors((*args, *kwargs.values()))):
            return self.launch_fn(*args, **kwargs)
        return self.op(*args, **kwargs)


def kernel_op(name, fake, mutates_args=()):
    """Decorator form of :class:`KernelOp`: ``@kernel_op("adam", no_outputs, mutates_args=("params", ...))``."""
    return lambda launch_fn: KernelOp(name, launch_fn, fake, mutates_args)
