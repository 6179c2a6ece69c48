"""portable-ops: the same Python call runs the fastest correct kernel on whatever hardware holds the tensors.

Public API: ``optim.Adam``, ``optim.AdamW``, ``functional.adam``, ``clip_grad_norm_``,
``attention``, ``use_backend``, ``explain``. Backends: ``triton`` (CUDA), ``nki``
(Trainium), ``reference`` (plain PyTorch, any device).
"""

from . import functional, optim
from .attention import attention
from .clip import clip_grad_norm_
from .dispatch import BackendUnavailableError, FallbackWarning, use_backend
from .explain import explain

__version__ = "0.1.0"

__all__ = ["optim", "functional", "attention", "clip_grad_norm_", "use_backend", "explain",
           "BackendUnavailableError", "FallbackWarning"]
