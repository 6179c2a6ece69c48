"""The NKI backend: Adam/AdamW/AMSGrad, SGD, two-phase global norm, flash attention, RMSNorm/LayerNorm, RoPE,
linear cross-entropy's rows and paged-KV-cache decode and append as NKI kernels for AWS Trainium2/Trainium3 (NKI 0.7,
Neuron SDK 2.33, the ``nki.*`` namespace).

Each kernel's launch is a PyTorch custom op, ``torch.ops.portable_ops_nki.<name>``, registered through ``nki_op`` as
AWS documents for torch-neuronx (``runtime.py``). Where the kernels run:

* ``neuron`` tensors (torch-neuronx's native PyTorch backend) -> the real ``@nki.jit`` kernels on the NeuronCore,
  eagerly or inside ``torch.compile(backend="neuron")``; needs the Neuron SDK and torch-neuronx's ``nki_op``.
* CPU tensors, forced with ``use_backend("nki")`` -> the same kernel source through AWS's CPU
  simulator ``nki.simulate`` when the SDK is installed, else through the project's emulator
  (``backends/nki/emulator``, a test double, with a test double of ``nki_op``).

Nothing here has been run on Trainium hardware by this project; see docs/backends/nki.md.
"""

from __future__ import annotations

import torch

from portable_ops.dispatch import Backend, OpImpl

from . import compat
from .adam import adam, adam_supports
from .attention import MAX_HEAD_DIM, attention_bwd, attention_fwd, attention_supports
from .attention_varlen import attention_varlen_bwd, attention_varlen_fwd, attention_varlen_supports
from .grad_norm import grad_norm
from .linear_cross_entropy import linear_cross_entropy_bwd, linear_cross_entropy_fwd
from .norms import layer_norm_bwd, layer_norm_fwd, norm_supports, rms_norm_bwd, rms_norm_fwd
from .paged_attention import MAX_HEAD_DIM as PAGED_MAX_HEAD_DIM
from .paged_attention import paged_attention, paged_attention_supports
from .paged_kv_append import paged_kv_append, paged_kv_append_supports
from .rope import rope_bwd, rope_fwd, rope_inplace, rope_supports
from .sgd import sgd, sgd_supports

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # NeuronCore engines have no float64


def _runtime_reasons(device: torch.device) -> list[str]:
    if device.type == "cpu":
        return []  # nki.simulate with the SDK, else the project's emulator
    if not compat.USING_SDK:
        return [f"{device.type} tensors need the Neuron SDK's nki package (NKI 0.7, Neuron SDK 2.33): "
                f"{compat.SDK_REASON}"]
    if not compat.USING_TORCH_NEURONX:
        return [f"{device.type} tensors need torch-neuronx's nki_op (torch-neuronx 2.14, Neuron SDK 2.33): "
                f"{compat.NKI_OP_REASON}"]
    return []


_ATTENTION = dict(dtypes=DTYPES, max_head_dim=MAX_HEAD_DIM)

BACKEND = Backend(
    name="nki",
    devices=("neuron",),  # torch-neuronx's native PyTorch device (PrivateUse1 named "neuron")
    cpu_runner="AWS nki.simulate" if compat.USING_SDK else "the project's NKI emulator (a test double)",
    ops={
        "adam": OpImpl(run=adam, supports=adam_supports, dtypes=DTYPES),
        "sgd": OpImpl(run=sgd, supports=sgd_supports, dtypes=DTYPES),
        "grad_norm": OpImpl(run=grad_norm, dtypes=DTYPES, features=()),  # norm types 2 and inf
        "attention_fwd": OpImpl(run=attention_fwd, supports=attention_supports, **_ATTENTION),
        "attention_bwd": OpImpl(run=attention_bwd, supports=attention_supports, **_ATTENTION),
        "attention_varlen_fwd": OpImpl(run=attention_varlen_fwd, supports=attention_varlen_supports, **_ATTENTION),
        "attention_varlen_bwd": OpImpl(run=attention_varlen_bwd, supports=attention_varlen_supports, **_ATTENTION),
        "rms_norm_fwd": OpImpl(run=rms_norm_fwd, supports=norm_supports, dtypes=DTYPES),
        "rms_norm_bwd": OpImpl(run=rms_norm_bwd, supports=norm_supports, dtypes=DTYPES),
        "layer_norm_fwd": OpImpl(run=layer_norm_fwd, supports=norm_supports, dtypes=DTYPES),
        "layer_norm_bwd": OpImpl(run=layer_norm_bwd, supports=norm_supports, dtypes=DTYPES),
        "linear_cross_entropy_fwd": OpImpl(run=linear_cross_entropy_fwd, dtypes=DTYPES),
        "linear_cross_entropy_bwd": OpImpl(run=linear_cross_entropy_bwd, dtypes=DTYPES),
        "rope_fwd": OpImpl(run=rope_fwd, supports=rope_supports, dtypes=DTYPES),
        "rope_bwd": OpImpl(run=rope_bwd, supports=rope_supports, dtypes=DTYPES),
        "rope_inplace": OpImpl(run=rope_inplace, supports=rope_supports, dtypes=DTYPES),
        "paged_attention": OpImpl(run=paged_attention, supports=paged_attention_supports, dtypes=DTYPES,
                                  max_head_dim=PAGED_MAX_HEAD_DIM),
        "paged_kv_append": OpImpl(run=paged_kv_append, supports=paged_kv_append_supports, dtypes=DTYPES,
                                  max_head_dim=PAGED_MAX_HEAD_DIM),
    },
    runtime_reasons=_runtime_reasons,
    description="NKI kernels for Trainium2/3, custom ops through "
                + ("" if compat.USING_TORCH_NEURONX else "a test double of ") + "torch-neuronx's nki_op",
)
