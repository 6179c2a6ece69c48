"""Whether kernels run in Triton's interpreter (CPU tensors) rather than compiled for a GPU, and the
one conversion the interpreter gets wrong, done right by hand there."""

import triton
import triton.language as tl
from triton import knobs

# Triton's own knob, read once (triton.jit decides at decoration): TRITON_INTERPRET means here what it does there
INTERPRETED = bool(knobs.runtime.interpret)
# Kernels may read only constexpr globals.
BF16_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr):
    """``x`` converted to ``DTYPE``, rounding to nearest even, as a GPU's conversion does.

    Triton's interpreter (3.9) truncates float32 to bfloat16 and flushes bfloat16 subnormals to
    zero, which biases every bf16 result of a CPU run: there (only) the rounding is done on the
    bits. NaN stays NaN, infinities stay infinite, a finite value past bf16's range rounds to inf.
    Compiled for a GPU this is the plain ``x.to(DTYPE)``.
    """
    if BF16_BY_HAND and DTYPE == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # ties go to the even neighbour
        rounded = tl.where(x != x, 0x7FC0, rounded)  # a NaN's low bits could carry it to inf
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
