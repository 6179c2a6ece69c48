"""``sqrt`` and ``rsqrt`` of a ``[rows, 1]`` float32 column on the Scalar Engine, fed only its valid inputs.

The Scalar Engine's sqrt is valid on [2^-116, 2^118], its rsqrt on [2^-87, 2^97] (AWS's 'Supported Activation
Functions for NKI ISA'; outside them it gives invalid results, and the emulator refuses such inputs). A value
outside its function's range is multiplied by 2^-120 (above it) or 2^120 (below it), which brings any positive
float32 inside, and its root is multiplied back by the root of that power of two: exact, powers of two commuting
with a correctly rounded root. The values no scaling brings in get torch's answers by predicated copies: 0 gives
0 (sqrt) or inf (rsqrt), inf gives inf or 0, NaN gives NaN. Used on per-row statistics and a global norm (a few
tens of instructions on a column), never on whole tiles.
"""

from __future__ import annotations

import math

from .compat import nisa, nl

SCALE = 2.0 ** 120  # brings any positive float32 outside a root's range inside it


def sqrt(v, rows, engine=nisa.engine.vector):
    """``sqrt(v)`` of a ``[rows, 1]`` float32 column of values ``>= 0``, ``+inf`` or NaN, as a new column; the
    column arithmetic on ``engine`` (the Vector Engine or GpSimd; the predicated copies are the Vector Engine's)."""
    return _root(v, rows, nl.sqrt, (2.0 ** -116, 2.0 ** 118), 2.0 ** 60, (0.0, math.inf), engine)


def rsqrt(v, rows, engine=nisa.engine.vector):
    """``rsqrt(v)`` of a ``[rows, 1]`` float32 column of values ``>= 0``, ``+inf`` or NaN, as a new column; the
    column arithmetic on ``engine``, as for :func:`sqrt`."""
    return _root(v, rows, nl.rsqrt, (2.0 ** -87, 2.0 ** 97), 2.0 ** -60, (math.inf, 0.0), engine)


def _column(rows, dtype=nl.float32):
    return nl.ndarray((rows, 1), dtype=dtype, buffer=nl.sbuf)


def _flag(v, rows, op, value, engine):
    """A uint8 ``[rows, 1]`` predicate: 1 where ``v <op> value``."""
    pred = _column(rows, nl.uint8)
    nisa.tensor_scalar(dst=pred, data=v, op0=op, operand0=value, engine=engine)
    return pred


def _select(rows, default, choices):
    """A column of ``default``, with ``value`` where each ``(predicate, value)`` holds: powers of two chosen
    exactly (a product such as ``1 + f * (2^-120 - 1)`` would round)."""
    column = _column(rows)
    nisa.memset(dst=column, value=default)
    for predicate, value in choices:
        nisa.tensor_copy_predicated(dst=column, src=value, predicate=predicate)
    return column


def _root(v, rows, op, domain, root_of_scale, special, engine):
    """``op(v)`` with ``op``'s input ``domain``; ``root_of_scale`` is ``op(SCALE)``, ``special`` what ``op``
    gives at 0 and at +inf."""
    low, high = domain
    big, small = _flag(v, rows, nl.greater, high, engine), _flag(v, rows, nl.less, low, engine)
    scale_in = _select(rows, 1.0, ((big, 1 / SCALE), (small, SCALE)))
    scale_out = _select(rows, 1.0, ((big, root_of_scale), (small, 1 / root_of_scale)))
    scaled = _column(rows)
    nisa.tensor_tensor(dst=scaled, data1=v, data2=scale_in, op=nl.multiply, engine=engine)
    nan = _column(rows, nl.uint8)
    nisa.tensor_tensor(dst=nan, data1=v, data2=v, op=nl.not_equal, engine=engine)
    nisa.tensor_copy_predicated(dst=scaled, src=1.0, predicate=nan)  # what max/min do with NaN is undocumented
    nisa.tensor_scalar(dst=scaled, data=scaled, op0=nl.maximum, operand0=low, op1=nl.minimum, operand1=high,
                       engine=engine)
    r = _column(rows)
    nisa.activation(dst=r, op=op, data=scaled)
    nisa.tensor_tensor(dst=r, data1=r, data2=scale_out, op=nl.multiply, engine=engine)
    at_zero, at_inf = special
    nisa.tensor_copy_predicated(dst=r, src=at_inf, predicate=_flag(v, rows, nl.equal, math.inf, engine))
    nisa.tensor_copy_predicated(dst=r, src=at_zero, predicate=_flag(v, rows, nl.equal, 0.0, engine))
    nisa.tensor_copy_predicated(dst=r, src=math.nan, predicate=nan)
    return r
