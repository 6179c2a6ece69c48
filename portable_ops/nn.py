"""``portable_ops.nn``: drop-in modules for ``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm``.

Same constructor arguments, same parameters (``weight``, ``bias``) and buffers, so a state_dict moves
between these and torch's modules both ways; ``forward`` runs :func:`portable_ops.rms_norm` /
:func:`portable_ops.layer_norm`. ``normalized_shape`` must be the last dim alone (an int or a one-element
shape): the kernels normalise over the last dim, and a wider shape is refused when the module is built.
``forward(x, residual=None)`` also takes the pre-norm block's residual: with it, it returns
``(norm(x + residual), x + residual)``.
"""

from __future__ import annotations

import torch

from .norm_checks import check_module_input, last_dim
from .norms import layer_norm, rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None)``."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
        last_dim("RMSNorm", normalized_shape)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device,
                         dtype=dtype)

    def forward(self, x, residual=None):
        check_module_input("RMSNorm", x, self.normalized_shape)
        return rms_norm(x, self.weight, self.eps, residual=residual)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
    dtype=None)``."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        last_dim("LayerNorm", normalized_shape)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)

    def forward(self, x, residual=None):
        check_module_input("LayerNorm", x, self.normalized_shape)
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)
