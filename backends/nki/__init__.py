"""The NKI backend for AWS Trainium2/Trainium3: not implemented yet.

Declared so that dispatch, ``explain`` and ``python -m portable_ops doctor`` say why Trainium
tensors run on ``reference``. The kernels (NKI 0.7, ``nki.*`` namespace) and the CPU emulator
that runs them in CI are the open NKI issue.
"""

from portable_ops.dispatch import Backend

BACKEND = Backend(
    name="nki",
    ops={},
    unavailable=lambda: "not implemented yet (the NKI kernels and their CPU emulator are an open issue)",
    description="NKI kernels for Trainium",
)
