"""Benchmarks against PyTorch: python -m portable_ops.bench optimizer|clip|attention."""
