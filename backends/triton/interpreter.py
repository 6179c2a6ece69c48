"""Whether kernels run in Triton's interpreter (CPU tensors) rather than compiled for a GPU."""

import os

# Read once: triton.jit decides at decoration time, so this cannot change later in the process.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
