"""The one place the NKI kernels get ``nki``, ``nki.language`` and ``nki.isa`` from.

* The real Neuron SDK (``import nki``; NKI 0.7 / SDK 2.33, the ``nki.*`` namespace) when it is
  installed *and functional*: PyPI's ``nki`` / ``neuronx-cc`` / ``torch-neuronx`` are empty
  placeholders, so importing is not enough; we require ``nki.jit``, ``nki.language.ndarray``
  and ``nki.isa.nc_matmul`` to exist.
* Otherwise the project's CPU emulator (``backends/nki/emulator``), a test double.

``nki_op``, what registers each kernel's launch as a PyTorch custom op (``runtime.KernelOp``), is torch-neuronx's
(``torch_neuronx.nki_op``, torch-neuronx 2.14 / Neuron SDK 2.33) where torch-neuronx is installed with the SDK, else
the project's test double of it (``backends/nki/emulator/torch_neuronx.py``).

``PORTABLE_OPS_NKI_EMULATOR=1`` forces the emulator (and the double) even where the SDK is installed.
Kernels do ``from .compat import nki, nl, nisa`` and nothing else.
"""

from __future__ import annotations

import importlib

from portable_ops import env


def _load_sdk():
    """(nki, nki.language, nki.isa, None) from the real SDK, or (None, None, None, reason)."""
    if env.flag("PORTABLE_OPS_NKI_EMULATOR", False):
        return None, None, None, "PORTABLE_OPS_NKI_EMULATOR is set"
    try:
        sdk = importlib.import_module("nki")
    except ImportError:
        return None, None, None, "the Neuron SDK's nki package is not installed"
    if getattr(sdk, "IS_EMULATOR", False):
        return None, None, None, "'nki' on sys.path is the project's emulator"
    try:
        language = importlib.import_module("nki.language")
        isa = importlib.import_module("nki.isa")
    except ImportError as exc:
        return None, None, None, f"'nki' is installed but not functional ({exc}); PyPI's nki is an empty placeholder"
    missing = [name for mod, names in ((sdk, ("jit",)), (language, ("ndarray", "sbuf", "psum", "shared_hbm")),
                                       (isa, ("nc_matmul", "dma_copy", "activation")))
               for name in names if not hasattr(mod, name)]
    if missing:
        return None, None, None, ("'nki' is installed but lacks " + ", ".join(missing) +
                                  " (an empty placeholder, not the Neuron SDK's NKI 0.7)")
    return sdk, language, isa, None


_sdk, _language, _isa, SDK_REASON = _load_sdk()
USING_SDK = _sdk is not None

if USING_SDK:
    nki, nl, nisa = _sdk, _language, _isa
else:
    from . import emulator as nki  # noqa: E402
    from .emulator import isa as nisa  # noqa: E402
    from .emulator import language as nl  # noqa: E402

HAS_SIMULATOR = USING_SDK and callable(getattr(nki, "simulate", None))
MODE = "sdk" if USING_SDK else "emulator"


def _load_nki_op():
    """(torch_neuronx.nki_op, None) where torch-neuronx is installed with the SDK, else (None, reason)."""
    if not USING_SDK:
        return None, f"the Neuron SDK is not in use ({SDK_REASON})"
    try:
        torch_neuronx = importlib.import_module("torch_neuronx")
    except ImportError:
        return None, "torch-neuronx is not installed"
    if not callable(getattr(torch_neuronx, "nki_op", None)):
        return None, "the installed torch-neuronx has no nki_op (torch-neuronx 2.14, Neuron SDK 2.33, has it)"
    return torch_neuronx.nki_op, None


_torch_nki_op, NKI_OP_REASON = _load_nki_op()
USING_TORCH_NEURONX = _torch_nki_op is not None

if USING_TORCH_NEURONX:
    nki_op = _torch_nki_op
else:
    from .emulator.torch_neuronx import nki_op  # noqa: E402

__all__ = ["nki", "nl", "nisa", "nki_op", "USING_SDK", "SDK_REASON", "HAS_SIMULATOR", "MODE", "USING_TORCH_NEURONX",
           "NKI_OP_REASON"]
