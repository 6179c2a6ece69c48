"""The Triton backend: multi-tensor Adam and SGD, two-phase norm, flash attention, RMSNorm/LayerNorm, RoPE and
linear cross-entropy's rows, for CUDA tensors.

CPU tensors run the same kernels in Triton's interpreter, which must be switched on before
any kernel is decorated: on a machine with no CUDA device this module switches it on itself
(``TRITON_INTERPRET=1``) before importing the kernels.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from portable_ops.dispatch import Backend, OpImpl

DEVICES = ("cuda",)
CPU_RUNNER = "the Triton interpreter"

if importlib.util.find_spec("triton") is None:
    BACKEND = Backend(name="triton", devices=DEVICES, cpu_runner=CPU_RUNNER, ops={},
                      unavailable=lambda: "triton is not installed (pip install 'portable-ops[triton]')",
                      description="Triton kernels")
else:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.language as tl

    from .interpreter import INTERPRETED

    # triton decides at import whether tl.zeros & co are interpreted: imported before the switch, no kernel can use them
    LATE_SWITCH = INTERPRETED and type(tl.zeros).__name__ != "InterpretedFunction"

    from .adam import adam, adam_supports
    from .attention import (MAX_HEAD_DIM, attention_bwd, attention_fwd, attention_supports, attention_varlen_bwd,
                            attention_varlen_fwd, attention_varlen_supports, paged_attention, paged_attention_supports,
                            paged_kv_append, paged_kv_append_supports, prepare_attention_bwd,
                            prepare_attention_fwd)
    from .grad_norm import grad_norm, grad_norm_supports
    from .launch import hash_triton_in_background
    from .linear_cross_entropy import linear_cross_entropy_bwd, linear_cross_entropy_fwd
    from . import norms, rope
    from .norms import (eager_to_aten, layer_norm_bwd, layer_norm_fwd, norm_supports, prepare_layer_norm_bwd,
                        prepare_layer_norm_fwd, prepare_rms_norm_bwd, prepare_rms_norm_fwd, rms_norm_bwd, rms_norm_fwd,
                        traced_to_inductor)
    from .rope import rope_bwd, rope_fwd, rope_inplace, rope_supports
    from .sgd import sgd, sgd_supports

    if not INTERPRETED:
        hash_triton_in_background()

    def _runtime_reasons(device: torch.device) -> list[str]:
        if LATE_SWITCH:
            return ["triton was imported before TRITON_INTERPRET=1 was set; set it before importing "
                    "torch._dynamo, triton or portable_ops"]
        if device.type == "cuda":
            return [] if not INTERPRETED else ["CUDA tensors while the Triton interpreter is on (TRITON_INTERPRET=1)"]
        return [] if INTERPRETED else ["CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 "
                                       "before importing portable_ops"]

    DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernels compute in float32
    _ATTENTION = dict(dtypes=DTYPES, max_head_dim=MAX_HEAD_DIM)

    BACKEND = Backend(
        name="triton",
        devices=DEVICES,
        cpu_runner=CPU_RUNNER,
        description="Triton kernels" + (", in the interpreter" if INTERPRETED else ""),
        ops={
            "adam": OpImpl(run=adam, supports=adam_supports, dtypes=DTYPES),
            "sgd": OpImpl(run=sgd, supports=sgd_supports, dtypes=DTYPES),
            "grad_norm": OpImpl(run=grad_norm, supports=grad_norm_supports, dtypes=DTYPES,
                                features=()),  # norm types 2 and inf
            "attention_fwd": OpImpl(run=attention_fwd, supports=attention_supports, prepare=prepare_attention_fwd,
                                    **_ATTENTION),
            "attention_bwd": OpImpl(run=attention_bwd, supports=attention_supports, prepare=prepare_attention_bwd,
                                    **_ATTENTION),
            "attention_varlen_fwd": OpImpl(run=attention_varlen_fwd, supports=attention_varlen_supports,
                                           **_ATTENTION),
            "attention_varlen_bwd": OpImpl(run=attention_varlen_bwd, supports=attention_varlen_supports,
                                           **_ATTENTION),
            "paged_attention": OpImpl(run=paged_attention, supports=paged_attention_supports, **_ATTENTION),
            "paged_kv_append": OpImpl(run=paged_kv_append, supports=paged_kv_append_supports),
            "rms_norm_fwd": OpImpl(run=rms_norm_fwd, supports=norm_supports, prepare=prepare_rms_norm_fwd,
                                   dtypes=DTYPES, traced=lambda: norms.traced_ops()["rms_norm_fwd"],
                                   defer_eager=eager_to_aten, defer_traced=traced_to_inductor),
            "rms_norm_bwd": OpImpl(run=rms_norm_bwd, supports=norm_supports, prepare=prepare_rms_norm_bwd,
                                   dtypes=DTYPES),
            "layer_norm_fwd": OpImpl(run=layer_norm_fwd, supports=norm_supports, prepare=prepare_layer_norm_fwd,
                                     dtypes=DTYPES, traced=lambda: norms.traced_ops()["layer_norm_fwd"],
                                     defer_eager=eager_to_aten, defer_traced=traced_to_inductor),
            "layer_norm_bwd": OpImpl(run=layer_norm_bwd, supports=norm_supports, prepare=prepare_layer_norm_bwd,
                                     dtypes=DTYPES),
            "linear_cross_entropy_fwd": OpImpl(run=linear_cross_entropy_fwd, dtypes=DTYPES),
            "linear_cross_entropy_bwd": OpImpl(run=linear_cross_entropy_bwd, dtypes=DTYPES),
            "rope_fwd": OpImpl(run=rope_fwd, supports=rope_supports, dtypes=DTYPES,
                               traced=lambda: rope.traced_ops()["rope_fwd"]),
            "rope_bwd": OpImpl(run=rope_bwd, supports=rope_supports, dtypes=DTYPES),
            "rope_inplace": OpImpl(run=rope_inplace, supports=rope_supports, dtypes=DTYPES),
        },
        runtime_reasons=_runtime_reasons,
    )
