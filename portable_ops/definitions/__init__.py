"""What each op computes, written to be read: plain PyTorch, one tensor or one block of queries at a time.

Run in float64 on the CPU these are the conformance suite's oracle (``portable_ops.conformance``).
Attention's forward is built from differentiable torch ops, so it is also what double backward and
the torch.func transforms differentiate. The ``reference`` backend (``portable_ops.backends.reference``)
computes the same functions with torch's fastest kernels for the device, and runs these
definitions only for calls those kernels can't express.
"""
