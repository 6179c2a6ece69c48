"""Benchmarks against PyTorch: python -m portable_ops.bench optimizer|clip|attention.

Runs from a source checkout without installing: setuptools maps ``backends/`` and
``conformance/`` to ``portable_ops.backends`` / ``portable_ops.conformance``; when the package
is not installed (a bare GPU machine with no network), the same mapping is made here.
"""

import importlib
import sys

try:
    import portable_ops.backends  # noqa: F401
except ModuleNotFoundError:
    import portable_ops

    for _name in ("backends", "conformance"):
        _module = importlib.import_module(_name)  # the checkout's root is on sys.path under -m
        sys.modules[f"portable_ops.{_name}"] = _module
        setattr(portable_ops, _name, _module)
