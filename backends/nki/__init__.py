"""The NKI backend: Adam/AdamW/AMSGrad, two-phase global norm and flash attention as NKI kernels
for AWS Trainium2/Trainium3 (NKI 0.7, Neuron SDK 2.33, the ``nki.*`` namespace).

Where the kernels run (``runtime.py``):

* Trainium tensors (``xla`` under torch-neuronx, native ``neuron``) -> the real ``@nki.jit``
  kernels on the NeuronCore; needs the Neuron SDK (``compat.USING_SDK``).
* CPU tensors, forced with ``use_backend("nki")`` -> the same kernel source through AWS's CPU
  simulator ``nki.simulate`` when the SDK is installed, else through the project's emulator
  (``backends/nki/emulator``, a test double).

Nothing here has been run on Trainium hardware by this project; see docs/backends/nki.md.
"""

from __future__ import annotations

import torch

from portable_ops.backends.pending import declined_ops
from portable_ops.dispatch import Backend, OpImpl

from . import compat
from .adam import adam, adam_supports
from .attention import KERNELS, attention_bwd, attention_fwd, attention_supports
from .grad_norm import grad_norm, grad_norm_supports
from .runtime import TRAINIUM_DEVICES


def _device_reasons(device: torch.device) -> list[str]:
    kind = device.type
    if kind in TRAINIUM_DEVICES:
        if compat.USING_SDK:
            return []
        return [f"{kind} tensors need the Neuron SDK's nki package (NKI 0.7, Neuron SDK 2.33): {compat.SDK_REASON}"]
    if kind == "cpu":
        return []  # nki.simulate with the SDK, else the project's emulator
    return [f"NKI kernels run on Trainium tensors (xla/neuron), or on CPU tensors in a simulator; not on {kind}"]


def _description() -> str:
    cpu = "AWS nki.simulate" if compat.USING_SDK else "the project's NKI emulator (a test double)"
    return f"NKI kernels for Trainium2/3; CPU tensors run in {cpu}"


BACKEND = Backend(
    name="nki",
    ops={
        "adam": OpImpl(run=adam, supports=adam_supports),
        "grad_norm": OpImpl(run=grad_norm, supports=grad_norm_supports),
        "attention_fwd": OpImpl(run=attention_fwd, supports=attention_supports),
        "attention_bwd": OpImpl(run=attention_bwd, supports=attention_supports),
    },
    unavailable=lambda: None,
    device_reasons=_device_reasons,
    description=_description(),
    declined=declined_ops(KERNELS),
)
