"""Where an NKI kernel runs: Trainium, AWS's CPU simulator, or the project's emulator.

* Tensors on the Trainium device (``xla`` under torch-neuronx, or the native ``neuron`` device)
  with the real SDK: the ``@nki.jit`` kernel is called on them directly (torch-neuronx compiles
  and launches it on the NeuronCore).
* CPU tensors with the real SDK installed (no Trainium needed): ``nki.simulate(kernel)(...)``,
  the SDK's own CPU simulator (NKI 0.3+;
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.simulate.html).
* CPU tensors without the SDK: the project's emulator (``compat.nki`` is the emulator then).
"""

from __future__ import annotations

import torch

from . import compat

# Where the simulator and the emulator run kernels: host memory (meta too, for counting). Dispatch hands the
# backend tensors of no other device type than those it declares, where the @nki.jit kernel runs.
HOST_DEVICES = ("cpu", "meta")


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
