"""portable-ops: the same Python call runs the fastest correct kernel on whatever hardware holds the tensors.

Public API: ``optim.Adam``, ``optim.AdamW``, ``optim.SGD``, ``functional.adam``, ``functional.sgd``,
``clip_grad_norm_``, ``attention``, ``attention_varlen``, ``paged_attention``, ``paged_kv_append``, ``rms_norm``,
``layer_norm``, ``rope``, ``rope_``, ``linear_cross_entropy``, ``nn.RMSNorm``, ``nn.LayerNorm``, ``use_backend``,
``explain``. Backends:
``triton`` (CUDA), ``nki`` (Trainium), ``reference`` (plain PyTorch, any device).
"""

import os as _os

import torch as _torch

# Triton runs kernels on CPU tensors only in its interpreter, which must be on before triton is
# first imported (torch._dynamo imports it, and so does this package): on a machine with no CUDA
# device, switch it on now, first. An explicit TRITON_INTERPRET wins.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from . import functional, nn, optim  # noqa: E402
from .attention import attention  # noqa: E402
from .attention_varlen import attention_varlen  # noqa: E402
from .clip import clip_grad_norm_  # noqa: E402
from .dispatch import BackendUnavailableError, FallbackWarning, use_backend  # noqa: E402
from .explain import explain  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .norms import layer_norm, rms_norm  # noqa: E402
from .paged import paged_attention, paged_kv_append  # noqa: E402
from .rope import rope, rope_  # noqa: E402

if _torch.accelerator.is_available():
    # With an accelerator the backends are loaded now, not inside the first training step: loading the one
    # serving it may start work in a thread (triton's cache-key hashing, backends/triton/launch.py), which
    # then runs while the user builds the model instead of in front of the first kernel launch.
    from .dispatch import loaded_backends as _loaded_backends  # noqa: E402

    _loaded_backends()

__version__ = "0.1.0"

__all__ = ["optim", "functional", "nn", "attention", "attention_varlen", "paged_attention", "paged_kv_append",
           "rms_norm", "layer_norm", "rope", "rope_", "linear_cross_entropy", "clip_grad_norm_", "use_backend",
           "explain",
           "BackendUnavailableError", "FallbackWarning"]
