"""RMSNorm and LayerNorm, forward and backward, as NKI kernels (the residual add fused into the forward).

Layout: rows on the partitions, up to 128 per tile, the normalised dim ``D`` along the free axis whole
(``D <= MAX_D``), so a row's statistics are free-axis reductions: the sum of squares about the mean is the Scalar
Engine's ``square`` activation with its add-reduction, and so is the sum, but on the Tensor Engine's way (below).
Tiles load in their tensors' dtypes (DMAs do not convert), the engines read them and compute in float32, and each
output is rounded once to its dtype by the engine instruction that computes it last. The residual sum is rounded
to x's dtype on chip before it is normalised and stored, so the norm sees what is returned.

Forward, two ways: bfloat16 LayerNorm puts the affine on the Tensor Engine, exactly (``_AffineOnTensorEngine``);
RMSNorm and other dtypes normalise on the Scalar Engine and apply the weight and bias on GpSimd and the Vector
Engine, the parameters loaded once per launch onto every partition in use. The statistics ``[M, 1]`` move 128 row
tiles at a time (``_Columns``).

``rstd = rsqrt(var + eps)`` on the Scalar Engine, whose ``rsqrt`` is valid on [2^-87, 2^97] only (the emulator
rejects other inputs): ``exact_roots.rsqrt`` scales each row's value into that range by a power of two and
back, exactly, and gives torch's answers where no scaling can: +inf gives 0, 0 gives +inf, NaN gives NaN.

Backward: per row tile, ``dx = rstd * (w*dy - xhat * mean(w*dy*xhat) - mean(w*dy))`` (the last term LayerNorm's
alone), plus the gradient that reached the residual sum; the weight and bias gradients are the column sums of
``dy * xhat`` and ``dy`` over the rows, added tile after tile on the Tensor Engine into one float32 PSUM bank
(``_ColumnSums``): a fixed order, deterministic, no atomics.

Both kernels are software-pipelined (``_pipelined``): a tile's statistics or row sums are issued before the
previous tile's last element-wise passes, so a short chain of dependent column instructions does not wait behind a
whole tile's pass on an engine both use.
"""

from __future__ import annotations

import functools
import types

import torch

from . import exact_roots
from .compat import nki, nisa, nl
from .runtime import kernel_op, launch

PMAX = 128
PSUM_FREE = 512  # float32 per partition in a PSUM bank
TRANSPOSES_PER_BANK = 8  # 128-column bfloat16 transposes a PSUM bank (2 KiB a partition) holds side by side
EVACUATING = (nisa.engine.vector, nisa.engine.scalar)  # PSUM's readers besides the Tensor Engine, in turn
SPLIT = 3  # bfloat16 parts that sum to a float32 exactly (8 significant bits each)
MAX_D = 5120  # a row tile and its temporaries, D float32 each, fit SBUF (224 KiB a partition on Trn2)


def _column(rows):
    return nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)


def _broadcast(vector, rows, d):
    """A ``[D]`` HBM vector on each of ``rows`` partitions, in its dtype."""
    tile = nl.ndarray((rows, d), dtype=vector.dtype, buffer=nl.sbuf)
    for p in range(rows):
        nisa.dma_copy(dst=tile[p:p + 1, 0:d], src=vector.reshape((1, d)))
    return tile


def _load(src, r0, rows, d):
    tile = nl.ndarray((rows, d), dtype=src.dtype, buffer=nl.sbuf)  # as stored: the engines read any dtype
    nisa.dma_copy(dst=tile, src=src[r0:r0 + rows, 0:d])
    return tile


def _chain(steps, scratch, dtype):
    """Run ``steps`` (each ``step(dst, src)``, ``src`` the float32 ``scratch`` tile) in place on ``scratch``, the
    last into a new tile of ``dtype`` unless that is float32: the result rounded once, by the engine, to the
    dtype the DMA stores."""
    dst = scratch
    for i, step in enumerate(steps):
        if i == len(steps) - 1 and dtype != scratch.dtype:
            dst = nl.ndarray(scratch.shape, dtype=dtype, buffer=nl.sbuf)
        step(dst, scratch)
    return dst


def _pipelined(m, *stages):
    """Every row tile of ``m`` rows through ``stages`` (the first takes the tile's first row and returns its state,
    each later one takes that state and returns it), issued as a software pipeline: step i runs stage k on tile
    i - k, the newest tile first. A stage's instructions then come a step after those they wait for, and a tile's
    short chain of dependent column instructions is not queued behind another tile's element-wise pass on an engine
    both use (each engine takes its instructions in program order)."""
    starts = range(0, m, PMAX)
    carried = {}
    for step in range(len(starts) + len(stages) - 1):
        for k, stage in enumerate(stages):
            t = step - k
            if 0 <= t < len(starts):
                carried[t] = stage(carried.pop(t)) if k else stage(starts[t])


def _mean(src, rows, d):
    """``(mean, -mean)`` ``[rows, 1]`` float32 columns of a row tile: its sum the Scalar Engine's add-reduction."""
    total = _row_sum(src, rows, 1.0, scratch=nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf))
    mean, neg_mean = _column(rows), _column(rows)
    nisa.tensor_scalar(dst=mean, data=total, op0=nl.multiply, operand0=1.0 / d, engine=nisa.engine.scalar)
    nisa.tensor_scalar(dst=neg_mean, data=total, op0=nl.multiply, operand0=-1.0 / d, engine=nisa.engine.scalar)
    return mean, neg_mean


def _sum_of_squares(src, rows, neg_mean):
    """``sum((src - mean)^2)`` per row, a ``[rows, 1]`` float32 column (``neg_mean`` None: the mean is 0): the Scalar
    Engine's ``square`` activation, biased by ``-mean``, with its add-reduction."""
    sum_sq = _column(rows)
    squares = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)  # the element-wise result, unused
    nisa.activation(dst=squares, op=nl.square, data=src, bias=neg_mean, reduce_op=nl.add, reduce_res=sum_sq,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    return sum_sq


def _rstd(sum_sq, rows, d, eps):
    """``rsqrt(sum_sq / d + eps)``, its column arithmetic on GpSimd."""
    var = _column(rows)
    nisa.tensor_scalar(dst=var, data=sum_sq, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps,
                       engine=nisa.engine.gpsimd)
    return exact_roots.rsqrt(var, rows, engine=nisa.engine.gpsimd)


class _Columns:
    """Per-row float32 statistics ``[M, 1]`` in HBM, moved a group of row tiles at a time: up to 128 full tiles'
    ``[128, 1]`` columns side by side in SBUF, transposed on the Tensor Engine to ``[tiles, 128]`` and moved in
    512-byte descriptors, where a column alone moves 4 bytes a partition (the DMA's least efficient size). A last
    tile of fewer than 128 rows moves alone."""

    def __init__(self, hbm, m):
        self.hbm, self.full = hbm, m // PMAX
        self.group, self.t0 = None, 0

    def _span(self, t):
        """The group starting at full tile ``t``: its HBM rows as ``[tiles, 128]`` and its tile count."""
        tiles = min(PMAX, self.full - t)
        return self.hbm[t * PMAX:(t + tiles) * PMAX, 0:1].reshape((tiles, PMAX)), tiles

    def read(self, r0, rows):
        """The tile's ``[rows, 1]`` column (loading its group first when the tile starts one)."""
        t = r0 // PMAX
        if rows < PMAX:
            column = _column(rows)
            nisa.dma_copy(dst=column, src=self.hbm[r0:r0 + rows, 0:1])
            return column
        if self.group is None or t >= self.t0 + self.group.shape[1]:
            span, tiles = self._span(t)
            by_tile = nl.ndarray((tiles, PMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=by_tile, src=span)
            turned = nl.ndarray((PMAX, tiles), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=turned, data=by_tile)
            self.group, self.t0 = nl.ndarray((PMAX, tiles), dtype=nl.float32, buffer=nl.sbuf), t
            nisa.tensor_copy(dst=self.group, src=turned, engine=nisa.engine.scalar)
        return self.group[0:PMAX, t - self.t0:t - self.t0 + 1]

    def write(self, r0, rows, column):
        """Store the tile's column (with its group's, once the group's last tile has come)."""
        t = r0 // PMAX
        if rows < PMAX:
            nisa.dma_copy(dst=self.hbm[r0:r0 + rows, 0:1], src=column)
            return
        if self.group is None:
            self.t0 = t
            self.group = nl.ndarray((PMAX, self._span(t)[1]), dtype=nl.float32, buffer=nl.sbuf)
        j = t - self.t0
        nisa.tensor_copy(dst=self.group[0:PMAX, j:j + 1], src=column, engine=nisa.engine.gpsimd)
        if j + 1 == self.group.shape[1]:
            span, tiles = self._span(self.t0)
            turned = nl.ndarray((tiles, PMAX), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=turned, data=self.group)
            by_tile = nl.ndarray((tiles, PMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=by_tile, src=turned, engine=nisa.engine.scalar)
            nisa.dma_copy(dst=span, src=by_tile)
            self.group = None


class _AffineOnTensorEngine:
    """LayerNorm's ``rstd * (x - mean) * w + b`` of bfloat16 row tiles with the products on the Tensor Engine,
    exact: a tile's 128-column blocks are transposed there (back to SBUF by the Vector Engine); matmuls of the
    ``x^T`` blocks against a column of ones give the row sums, and each block against ``diag(w)`` puts ``x * w`` in
    PSUM in the tile's own layout (bfloat16 products are exact, their sums float32). One more matmul per 512 columns
    adds ``b / rstd - mean * w``: its stationary rows are three bfloat16 parts of each row's ``1 / rstd`` (with a
    bias) and of its ``-mean`` (parts whose sum is the float32 value), its moving rows ``b`` and ``w`` three times
    each. The Vector and Scalar Engines take each PSUM bank out in turn with the one multiplication by ``rstd``,
    rounding once to bfloat16. The weight and bias must be bfloat16 too (``None``: 1 and 0)."""

    def __init__(self, weight, bias, d):
        self.d, self.blocks = d, -(-d // PMAX)
        identity = nl.ndarray((PMAX, PMAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        self.ones = nl.ndarray((PMAX, PMAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=self.ones, value=1.0)
        nisa.affine_select(dst=identity, pattern=[[-1, PMAX]], channel_multiplier=1, on_true_tile=self.ones,
                           on_false_value=0.0)  # p - i == 0
        self.diag = nl.ndarray((PMAX, self.blocks * PMAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        w_cols = self._columns(weight) if weight is not None else None
        for blk, (d0, width) in enumerate(self._blocks()):
            diag = self.diag[0:width, blk * PMAX:blk * PMAX + width]
            if w_cols is None:
                nisa.tensor_copy(dst=diag, src=identity[0:width, 0:width])
            else:
                nisa.tensor_scalar(dst=diag, data=identity[0:width, 0:width], op0=nl.multiply,
                                   operand0=w_cols[0:width, blk:blk + 1])
        # the correction's moving rows: b three times (with a bias), then w (or 1) three times
        self.biased = bias is not None
        parts = ([bias] * SPLIT if self.biased else []) + [weight] * SPLIT
        self.terms = len(parts)
        self.moving = nl.ndarray((self.terms, d), dtype=nl.bfloat16, buffer=nl.sbuf)
        if None in parts:  # no weight: its rows are ones (a DMA writes any partition, an engine aligned ones only)
            nisa.memset(dst=self.moving, value=1.0)
        for k, part in enumerate(parts):
            if part is not None:
                nisa.dma_copy(dst=self.moving[k:k + 1, 0:d], src=part.reshape((1, d)))

    def _blocks(self):
        return [(d0, min(PMAX, self.d - d0)) for d0 in range(0, self.d, PMAX)]

    def _columns(self, vector):
        """A ``[D]`` HBM vector as float32 columns ``[128, blocks]``: block j's 128 values down column j (loaded a
        block to a partition, transposed on the Tensor Engine)."""
        full = self.d // PMAX
        by_block = nl.ndarray((self.blocks, PMAX), dtype=vector.dtype, buffer=nl.sbuf)
        if full:
            nisa.dma_copy(dst=by_block[0:full, 0:PMAX], src=vector[0:full * PMAX].reshape((full, PMAX)))
        if full < self.blocks:
            left = self.d - full * PMAX
            nisa.dma_copy(dst=by_block[full:full + 1, 0:left], src=vector[full * PMAX:self.d].reshape((1, left)))
        turned = nl.ndarray((PMAX, self.blocks), dtype=vector.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=turned, data=by_block)
        columns = nl.ndarray((PMAX, self.blocks), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=columns, src=turned)
        return columns

    def transposed(self, src, rows):
        """The tile's ``x^T``: its 128-column blocks side by side, ``[128, blocks * 128]`` in SBUF."""
        xt = nl.ndarray((PMAX, self.blocks * PMAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        for g0 in range(0, self.blocks, TRANSPOSES_PER_BANK):
            group = self._blocks()[g0:g0 + TRANSPOSES_PER_BANK]
            turned = nl.ndarray((PMAX, len(group) * PMAX), dtype=nl.bfloat16, buffer=nl.psum)
            for j, (d0, width) in enumerate(group):
                nisa.nc_transpose(dst=turned[0:width, j * PMAX:j * PMAX + rows], data=src[0:rows, d0:d0 + width])
            nisa.tensor_copy(dst=xt[0:PMAX, g0 * PMAX:(g0 + len(group)) * PMAX], src=turned)
        return xt

    def mean(self, xt, rows):
        """``(mean, -mean)`` ``[rows, 1]`` float32 columns of the tile whose ``x^T`` is ``xt``: its row sums are
        matmuls of the blocks against a column of ones, exact products added in float32."""
        sums = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
        for blk, (d0, width) in enumerate(self._blocks()):
            nisa.nc_matmul(dst=sums, stationary=xt[0:width, blk * PMAX:blk * PMAX + rows],
                           moving=self.ones[0:width, 0:1], accumulate=blk > 0)
        mean, neg_mean = _column(rows), _column(rows)
        nisa.tensor_scalar(dst=mean, data=sums, op0=nl.multiply, operand0=1.0 / self.d)
        nisa.tensor_scalar(dst=neg_mean, data=sums, op0=nl.multiply, operand0=-1.0 / self.d,
                           engine=nisa.engine.scalar)
        return mean, neg_mean

    def normalise(self, xt, rows, neg_mean, rstd):
        """The output of the tile whose ``x^T`` is ``xt``: bfloat16 ``[rows, D]`` in SBUF."""
        stationary = self._correction(rows, neg_mean, rstd)
        out = nl.ndarray((rows, self.d), dtype=nl.bfloat16, buffer=nl.sbuf)
        per_bank = PSUM_FREE // PMAX
        for c0 in range(0, self.d, PSUM_FREE):
            width = min(PSUM_FREE, self.d - c0)
            acc = nl.ndarray((rows, PSUM_FREE), dtype=nl.float32, buffer=nl.psum)
            for j, (d0, bw) in enumerate(self._blocks()[c0 // PMAX:c0 // PMAX + per_bank]):
                blk = d0 // PMAX
                nisa.nc_matmul(dst=acc[0:rows, j * PMAX:j * PMAX + bw],
                               stationary=xt[0:bw, blk * PMAX:blk * PMAX + rows],
                               moving=self.diag[0:bw, blk * PMAX:blk * PMAX + bw], accumulate=False)
            nisa.nc_matmul(dst=acc[0:rows, 0:width], stationary=stationary,
                           moving=self.moving[0:self.terms, c0:c0 + width], accumulate=True)
            nisa.tensor_scalar(dst=out[0:rows, c0:c0 + width], data=acc[0:rows, 0:width], op0=nl.multiply,
                               operand0=rstd, engine=EVACUATING[c0 // PSUM_FREE % len(EVACUATING)])
        return out

    def _correction(self, rows, neg_mean, rstd):
        """The stationary ``[terms, rows]`` of ``b / rstd - mean * w``: three bfloat16 parts of each row's
        ``1 / rstd`` (with a bias) and of its ``-mean``."""
        values = [neg_mean]
        if self.biased:
            spread = _column(rows)
            nisa.reciprocal(dst=spread, data=rstd)
            values.insert(0, spread)
        parts = nl.ndarray((rows, self.terms), dtype=nl.bfloat16, buffer=nl.sbuf)
        for k, value in enumerate(values):
            _split(value, parts[0:rows, k * SPLIT:(k + 1) * SPLIT], rows)
        turned = nl.ndarray((self.terms, rows), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=turned, data=parts)
        stationary = nl.ndarray((self.terms, rows), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=stationary, src=turned)
        return stationary


def _split(value, parts, rows):
    """A float32 column as the sum of ``SPLIT`` bfloat16 columns ``parts`` (each the rounded remainder of those
    before: exact, bfloat16 keeping float32's exponents)."""
    left = value
    for k in range(SPLIT):
        nisa.tensor_copy(dst=parts[0:rows, k:k + 1], src=left, engine=nisa.engine.gpsimd)
        if k + 1 < SPLIT:
            rest = _column(rows)
            nisa.tensor_tensor(dst=rest, data1=left, data2=parts[0:rows, k:k + 1], op=nl.subtract,
                               engine=nisa.engine.gpsimd)
            left = rest


@nki.jit
def norm_fwd_kernel(x, residual=None, weight=None, bias=None, eps=1e-5, rms=True):
    """``(out, [h], [mean], rstd)`` of contiguous rows ``x [M, D]``: h with a residual, mean for LayerNorm;
    statistics ``[M, 1]`` float32. The residual add on GpSimd, the sums on the Scalar Engine; then bfloat16
    LayerNorm takes the Tensor Engine's way (``_AffineOnTensorEngine``, the mean from it too), the others the
    engines': the normalisation on the Scalar Engine, the weight on whichever of GpSimd and the Vector Engine the
    residual left free, the bias on the other."""
    m, d = x.shape
    out = nl.ndarray((m, d), dtype=x.dtype, buffer=nl.shared_hbm)
    h_out = nl.ndarray((m, d), dtype=x.dtype, buffer=nl.shared_hbm) if residual is not None else None
    mean_out = None if rms else nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((m, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    rstd_columns, mean_columns = _Columns(rstd_out, m), None if rms else _Columns(mean_out, m)
    weight_engine, bias_engine = ((nisa.engine.vector, nisa.engine.gpsimd) if residual is not None
                                  else (nisa.engine.gpsimd, nisa.engine.vector))

    # LayerNorm only: a row's non-finite value makes its every output NaN there, as the zeros of diag(w) times it
    # do here (RMSNorm's rstd of 0 leaves the row's finite values' outputs 0)
    on_tensor_engine = not rms and all(v is None or v.dtype == nl.bfloat16 for v in (x, weight, bias))

    @functools.cache
    def parameters():
        """The weight and bias as the normalisation takes them, loaded when first needed: after the first tiles'
        loads, which wait for neither."""
        if on_tensor_engine:
            return _AffineOnTensorEngine(weight, bias, d)
        most = min(PMAX, m)
        return tuple(None if v is None else _broadcast(v, most, d) for v in (weight, bias))

    def load(r0):
        """The tile's rows as normalised (the residual sum, stored); LayerNorm's mean on the engines' way."""
        tile = types.SimpleNamespace(r0=r0, rows=min(PMAX, m - r0), mean=None, neg_mean=None)
        tile.src = _load(x, r0, tile.rows, d)
        if residual is not None:
            h = nl.ndarray((tile.rows, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=h, data1=tile.src, data2=_load(residual, r0, tile.rows, d), op=nl.add,
                               engine=nisa.engine.gpsimd)  # rounds once to x's dtype
            nisa.dma_copy(dst=h_out[r0:r0 + tile.rows, 0:d], src=h)
            tile.src = h  # the sum as returned is what is normalised
        if not rms and not on_tensor_engine:
            tile.mean, tile.neg_mean = _mean(tile.src, tile.rows, d)
        return tile

    def transpose(tile):
        """The Tensor Engine's way: the tile's x^T, and its mean from it."""
        tile.xt = parameters().transposed(tile.src, tile.rows)
        tile.mean, tile.neg_mean = parameters().mean(tile.xt, tile.rows)
        return tile

    def spread(tile):
        tile.sum_sq = _sum_of_squares(tile.src, tile.rows, tile.neg_mean)
        return tile

    def root(tile):
        tile.rstd = _rstd(tile.sum_sq, tile.rows, d, eps)
        return tile

    def normalise(tile):
        """The tile's output and statistics stored."""
        r0, rows, src, mean, rstd = tile.r0, tile.rows, tile.src, tile.mean, tile.rstd
        rstd_columns.write(r0, rows, rstd)
        if mean is not None:
            mean_columns.write(r0, rows, mean)
        if on_tensor_engine:
            nisa.dma_copy(dst=out[r0:r0 + rows, 0:d], src=parameters().normalise(tile.xt, rows, tile.neg_mean, rstd))
            return
        w, b = parameters()

        def centred(dst, _):
            if rms:
                nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=rstd, engine=nisa.engine.scalar)
            else:
                nisa.tensor_scalar(dst=dst, data=src, op0=nl.subtract, operand0=mean, op1=nl.multiply,
                                   operand1=rstd, engine=nisa.engine.scalar)

        steps = [centred]
        if w is not None:
            steps.append(lambda dst, y: nisa.tensor_tensor(dst=dst, data1=y, data2=w[0:rows, 0:d], op=nl.multiply,
                                                            engine=weight_engine))
        if b is not None:
            steps.append(lambda dst, y: nisa.tensor_tensor(dst=dst, data1=y, data2=b[0:rows, 0:d], op=nl.add,
                                                            engine=bias_engine))
        y = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out[r0:r0 + rows, 0:d], src=_chain(steps, y, x.dtype))

    _pipelined(m, load, *([transpose] if on_tensor_engine else []), spread, root, normalise)
    return tuple(o for o in (out, h_out, mean_out, rstd_out) if o is not None)


class _ColumnSums:
    """Column sums of ``[rows, D]`` row tiles, added tile after tile on the Tensor Engine into one PSUM bank
    ``[J, 512]`` float32 (J chunks of 512 columns): chunk j of a tile is the moving side of a matmul whose stationary
    ``[rows, J]`` is zeros but for ones in column j, which adds the chunk's sums to row j (and zeros to the others).
    A fixed order, no atomics. ``dtype`` is the tiles' (a matmul's two sides share a width)."""

    def __init__(self, d, rows, dtype):
        self.d, self.chunks = d, -(-d // PSUM_FREE)
        # every selector is a window of this one: ones in the middle column
        self.ones = nl.ndarray((rows, 2 * self.chunks - 1), dtype=dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.ones, value=0.0)
        nisa.memset(dst=self.ones[:, self.chunks - 1:self.chunks], value=1.0)
        self.sums = nl.ndarray((self.chunks, PSUM_FREE), dtype=nl.float32, buffer=nl.psum)
        self.started = False

    def _chunks(self):
        return enumerate((c0, min(PSUM_FREE, self.d - c0)) for c0 in range(0, self.d, PSUM_FREE))

    def add(self, tile, rows):
        for j, (c0, width) in self._chunks():
            window = self.ones[0:rows, self.chunks - 1 - j:2 * self.chunks - 1 - j]
            nisa.nc_matmul(dst=self.sums[0:self.chunks, 0:width], stationary=window,
                           moving=tile[0:rows, c0:c0 + width], accumulate=self.started or j > 0)
        self.started = True

    def store(self, out):
        """Write the sums to ``out`` ``[1, D]`` float32 in HBM."""
        total = nl.ndarray((self.chunks, PSUM_FREE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=total, src=self.sums)
        for j, (c0, width) in self._chunks():
            nisa.dma_copy(dst=out[0:1, c0:c0 + width], src=total[j:j + 1, 0:width])


@nki.jit
def norm_bwd_kernel(x, rstd, dout, weight=None, mean=None, dh=None, rms=True, bias_grad=False):
    """``(dx, [dweight], [dbias])`` of contiguous rows ``x [M, D]`` (what was normalised) from the saved
    ``[M, 1]`` statistics; dweight with a weight, dbias with ``bias_grad``, ``[1, D]`` float32. Engines: xhat, the
    row sums and the last scaling on the Scalar Engine; ``w*dy``, ``dy*xhat`` and dh's add on GpSimd;
    ``xhat*w*dy`` and dx's combination on the Vector Engine; the weight and bias gradients' column sums on the
    Tensor Engine."""
    m, d = x.shape
    dx_out = nl.ndarray((m, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dw_out = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.shared_hbm) if weight is not None else None
    db_out = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.shared_hbm) if bias_grad else None
    most = min(PMAX, m)
    w = _broadcast(weight, most, d) if weight is not None else None
    dw_sums = _ColumnSums(d, most, nl.float32) if weight is not None else None
    rstd_columns, mean_columns = _Columns(rstd, m), None if mean is None else _Columns(mean, m)
    db_sums = _ColumnSums(d, most, dout.dtype) if bias_grad else None

    def prepare(r0):
        """The tile's xhat, w*dy and -mean(xhat * w * dy)."""
        rows = min(PMAX, m - r0)
        xt, dy = _load(x, r0, rows, d), _load(dout, r0, rows, d)
        rs = rstd_columns.read(r0, rows)
        xhat = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
        if rms:
            nisa.tensor_scalar(dst=xhat, data=xt, op0=nl.multiply, operand0=rs, engine=nisa.engine.scalar)
        else:
            mu = mean_columns.read(r0, rows)
            nisa.tensor_scalar(dst=xhat, data=xt, op0=nl.subtract, operand0=mu, op1=nl.multiply, operand1=rs,
                               engine=nisa.engine.scalar)
        wdy = dy
        if w is not None:
            wdy = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=wdy, data1=dy, data2=w[0:rows, 0:d], op=nl.multiply, engine=nisa.engine.gpsimd)
        prod = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
        wdy_mean = None if rms else _row_sum(wdy, rows, -1.0 / d, scratch=prod)  # -mean(w * dy)
        nisa.tensor_tensor(dst=prod, data1=xhat, data2=wdy, op=nl.multiply)
        return r0, rows, dy, rs, xhat, wdy, _row_sum(prod, rows, -1.0 / d, scratch=prod), wdy_mean

    def finish(state):
        """dx stored, and the tile's column sums added (tiles rewritten in place once they are not read again)."""
        r0, rows, dy, rs, xhat, wdy, c, wdy_mean = state
        dx = wdy if w is not None else nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)  # not dy itself
        nisa.scalar_tensor_tensor(dst=dx, data=xhat, op0=nl.multiply, operand0=c, op1=nl.add, operand1=wdy)

        def times_rstd(dst, dx):
            if rms:
                nisa.tensor_scalar(dst=dst, data=dx, op0=nl.multiply, operand0=rs, engine=nisa.engine.scalar)
            else:
                nisa.tensor_scalar(dst=dst, data=dx, op0=nl.add, operand0=wdy_mean, op1=nl.multiply, operand1=rs,
                                   engine=nisa.engine.scalar)

        steps = [times_rstd]
        if dh is not None:
            steps.append(lambda dst, g: nisa.tensor_tensor(dst=dst, data1=g, data2=_load(dh, r0, rows, d), op=nl.add,
                                                            engine=nisa.engine.gpsimd))
        nisa.dma_copy(dst=dx_out[r0:r0 + rows, 0:d], src=_chain(steps, dx, x.dtype))
        if dw_sums is not None:
            g = xhat
            nisa.tensor_tensor(dst=g, data1=dy, data2=xhat, op=nl.multiply, engine=nisa.engine.gpsimd)
            dw_sums.add(g, rows)
        if db_sums is not None:
            db_sums.add(dy, rows)

    _pipelined(m, prepare, finish)
    for sums, grad_out in ((dw_sums, dw_out), (db_sums, db_out)):
        if sums is not None:
            sums.store(grad_out)
    return tuple(o for o in (dx_out, dw_out, db_out) if o is not None)


def _row_sum(tile, rows, scale, scratch):
    """``scale * sum(tile)`` per row, a new ``[rows, 1]`` float32 column: the Scalar Engine's add-reduction, its
    element-wise result written to ``scratch`` (which may be ``tile``)."""
    total = _column(rows)
    nisa.activation(dst=scratch, op=nl.copy, data=tile, scale=scale, reduce_op=nl.add, reduce_res=total,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    return total


# ----------------------------------------------------------------------------- host side
def norm_supports(call) -> list[str]:
    """Dtypes are declared (``BACKEND``); a row tile holds the whole normalised dim."""
    d = call["x"].shape[-1]
    if d > MAX_D:
        return [f"the normalised dim is {d}, over {MAX_D}, the largest row the NKI norm kernels hold in SBUF"]
    return []


def _contiguous(t):
    return None if t is None else t.contiguous()  # the kernels read rows as [M, D] row-major HBM views


def _fake_fwd(x, residual, weight, bias, eps, rms):
    def column():
        return x.new_empty((x.shape[0], 1), dtype=torch.float32)

    return [x.new_empty(x.shape), *([x.new_empty(x.shape)] if residual is not None else []),
            *([] if rms else [column()]), column()]


@kernel_op("norm_fwd", _fake_fwd)
def norm_fwd_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, rms: bool) -> list[torch.Tensor]:
    """The forward kernel's launch as the op ``portable_ops_nki::norm_fwd``: ``[out, h?, mean?, rstd]`` (h with a
    residual, mean for LayerNorm; the statistics ``[M, 1]`` float32)."""
    return list(launch(norm_fwd_kernel, x.contiguous(), residual=_contiguous(residual), weight=_contiguous(weight),
                       bias=_contiguous(bias), eps=eps, rms=rms))


def _fake_bwd(x, rstd, dout, weight, mean, dh, rms, bias_grad):
    column_sums = [x.new_empty((1, x.shape[1]), dtype=torch.float32) for given in (weight is not None, bias_grad)
                   if given]
    return [x.new_empty(x.shape), *column_sums]


@kernel_op("norm_bwd", _fake_bwd)
def norm_bwd_op(x: torch.Tensor, rstd: torch.Tensor, dout: torch.Tensor, weight: torch.Tensor | None,
                mean: torch.Tensor | None, dh: torch.Tensor | None, rms: bool, bias_grad: bool) -> list[torch.Tensor]:
    """The backward kernel's launch as the op ``portable_ops_nki::norm_bwd``: ``[dx, dweight?, dbias?]`` (the
    parameters' gradients ``[1, D]`` float32) from ``rstd`` and ``mean`` ``[M]``."""
    return list(launch(norm_bwd_kernel, x.contiguous(), rstd.reshape(-1, 1).contiguous(), dout.contiguous(),
                       weight=_contiguous(weight), mean=None if mean is None else mean.reshape(-1, 1).contiguous(),
                       dh=_contiguous(dh), rms=rms, bias_grad=bias_grad))


def _norm_fwd(x, residual, weight, bias, eps, rms):
    outs = norm_fwd_op(x, residual, weight, bias, float(eps), rms)
    out = outs.pop(0)
    h = outs.pop(0) if residual is not None else None
    mean = outs.pop(0).reshape(-1) if not rms else None
    return out, h, mean, outs.pop(0).reshape(-1)


def _norm_bwd(x, weight, mean, rstd, dout, dh, rms, has_bias):
    outs = norm_bwd_op(x, rstd, dout, weight, mean, dh, rms, has_bias)
    dx = outs.pop(0)
    dweight = outs.pop(0).reshape(-1) if weight is not None else None
    dbias = outs.pop(0).reshape(-1) if has_bias else None
    return dx, dweight, dbias


def rms_norm_fwd(x, residual, weight, eps):
    out, h, _, rstd = _norm_fwd(x, residual, weight, None, eps, rms=True)
    return out, h, rstd


def rms_norm_bwd(x, weight, rstd, dout, dh):
    dx, dweight, _ = _norm_bwd(x, weight, None, rstd, dout, dh, rms=True, has_bias=False)
    return dx, dweight


def layer_norm_fwd(x, residual, weight, bias, eps):
    return _norm_fwd(x, residual, weight, bias, eps, rms=False)


def layer_norm_bwd(x, weight, mean, rstd, dout, dh, has_bias):
    return _norm_bwd(x, weight, mean, rstd, dout, dh, rms=False, has_bias=has_bias)
