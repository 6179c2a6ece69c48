"""The reference backend: PyTorch alone, on any device, with torch's fastest kernels for the call.

It accepts every call the public API lets through, so it is where every other backend falls back
to. Each op runs the kernel torch itself would pick on the device (fused SDPA kernels, the fused
Adam and SGD, ``_foreach_norm``) where the call maps onto one, and the readable definition
(``portable_ops.definitions``, also the conformance oracle) where it does not.
"""

from portable_ops.dispatch import EVERY_DEVICE_TYPE, Backend, OpImpl

from .adam import adam
from .attention import attention_bwd, attention_fwd, prepare_attention_bwd, prepare_attention_fwd
from .attention_varlen import attention_varlen_bwd, attention_varlen_fwd
from .grad_norm import grad_norm
from .linear_cross_entropy import linear_cross_entropy_bwd, linear_cross_entropy_fwd
from .norms import (differentiable_layer_norm, differentiable_rms_norm, layer_norm_bwd, layer_norm_fwd,
                    prepare_layer_norm_fwd, prepare_rms_norm_fwd, rms_norm_bwd, rms_norm_fwd)
from .paged import paged_attention, paged_kv_append
from .rope import rope_bwd, rope_fwd, rope_inplace
from .sgd import sgd

BACKEND = Backend(
    name="reference",
    devices=(EVERY_DEVICE_TYPE,),
    description="PyTorch alone, any device",
    ops={
        "adam": OpImpl(run=adam),
        "sgd": OpImpl(run=sgd),
        "grad_norm": OpImpl(run=grad_norm),
        "attention_fwd": OpImpl(run=attention_fwd, prepare=prepare_attention_fwd),
        "attention_bwd": OpImpl(run=attention_bwd, prepare=prepare_attention_bwd),
        "attention_varlen_fwd": OpImpl(run=attention_varlen_fwd),
        "attention_varlen_bwd": OpImpl(run=attention_varlen_bwd),
        "paged_attention": OpImpl(run=paged_attention),
        "paged_kv_append": OpImpl(run=paged_kv_append),
        "rms_norm_fwd": OpImpl(run=rms_norm_fwd, prepare=prepare_rms_norm_fwd, autograd=differentiable_rms_norm),
        "rms_norm_bwd": OpImpl(run=rms_norm_bwd),
        "layer_norm_fwd": OpImpl(run=layer_norm_fwd, prepare=prepare_layer_norm_fwd,
                                 autograd=differentiable_layer_norm),
        "layer_norm_bwd": OpImpl(run=layer_norm_bwd),
        "linear_cross_entropy_fwd": OpImpl(run=linear_cross_entropy_fwd),
        "linear_cross_entropy_bwd": OpImpl(run=linear_cross_entropy_bwd),
        "rope_fwd": OpImpl(run=rope_fwd),
        "rope_bwd": OpImpl(run=rope_bwd),
        "rope_inplace": OpImpl(run=rope_inplace),
    },
)
