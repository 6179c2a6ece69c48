"""Backends: one sub-package per backend, each exposing ``BACKEND`` (see portable_ops.dispatch)."""
