"""The ``"numpy"`` family's sweeps over columns: BatchNorm where a channel is a column,
and GroupNorm/InstanceNorm on channels-last input, sample by sample (at the end).

BatchNorm1d's (N, C) input holds one value per channel in each row, and so does a
channels-last (N, C, *spatial) input (NumPy's ``moveaxis`` of NHWC data, torch's
``channels_last``) seen as its (N*S, C) rows. As the N*C rows of S values that
``numpy_fast_channels`` sweeps, such input would be rows of one value, or a strided
gather. Here a block is B rows of p columns (all C, but for inputs so wide that
``MIN_ROWS`` rows of C values exceed a block), every per-channel value a vector
broadcast along the block's rows (or repeated on them, ``_Columns``), and every sum over
the rows a BLAS matrix-vector product of at most ``SUM_ROWS`` rows (one batched
``matmul`` per block), added in float64 (``_colsum``). The output keeps the input's
layout.

The statistics follow ``numpy_fast_channels._row_moments`` column by column: per block its
mean (float64, rounded to the computation dtype), the residual ``sum(x - mean)/n`` and
``M2 = sum((x - mean)^2)``, merged over the blocks with Chan et al.'s formula
(``merge_parts``). A channel constant in every block gets its value as the mean and a
variance of exactly 0, as in PyTorch. Each block's results go to their own slot and are
added in block order: the same bits whatever the thread count (the threads take
block-aligned chunks of rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from .._checks import prod
from .._threads import get_num_threads
from . import _blocks
from ._blocks import (
    LONG_ROW,
    block_rows,
    blocks,
    channels_last_rows,
    filled,
    from_channel_rows,
    needs_staging,
    run_chunks,
    run_ranges,
    vecmat,
    view,
)


def as_columns(a: np.ndarray) -> np.ndarray | None:
    """An (N, C, *spatial) array (or (N, C)) as its (M, C) rows of one value per channel,
    a view: any array of one value per channel and sample (S = 1), and channels-last
    ones; None for other layouts."""
    if a.ndim == 2 or all(int(d) == 1 for d in a.shape[2:]):
        return view(a, (int(a.shape[0]), int(a.shape[1])))  # N,C
    return channels_last_rows(a)  # N*S,C


def columns_of(
    out: np.ndarray | None,
    *arrays: np.ndarray,
    as_view: Callable[[np.ndarray], np.ndarray | None] = as_columns,
) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """The (M, C) views of ``arrays`` (``as_columns``, or ``as_view``) and of ``out`` (None
    where no ``out`` is given, or where it has no such view, shares memory with an input or
    is read-only: the result is then copied into it); None unless every array has one."""
    views = [v for v in map(as_view, arrays) if v is not None]
    if len(views) < len(arrays):
        return None
    out_view = None if out is None else as_view(out)
    if out_view is not None and (
        not out.flags.writeable or any(np.may_share_memory(out, a) for a in arrays)  # type: ignore[union-attr]
    ):
        out_view = None
    return views, out_view


def new_like(a: np.ndarray, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """A fresh array of ``a``'s shape and ``dtype`` laid out as its (M, C) rows (the
    channels-last layout; C-ordered where S = 1), and those rows."""
    shape = tuple(int(d) for d in a.shape)
    if prod(shape[2:]) == 1:  # one value per channel and sample
        y = np.empty(shape, dtype=dtype)
        return y, y.reshape(shape[0], shape[1])  # N,C
    rows = np.empty((prod(shape) // shape[1], shape[1]), dtype=dtype)  # N*S,C
    return from_channel_rows(rows, shape), rows


T = TypeVar("T")

# A block has MIN_ROWS rows at least (or all M): with fewer, the per-block statistics of
# very wide input (one row per block from 49152 float32 channels) were as large as the
# input, four times over; such blocks take panels of P < C columns instead.
MIN_ROWS = 64


def geometry(M: int, C: int, ct: np.dtype[Any]) -> tuple[int, int]:
    """``(B, P)``: rows per block (about ``_blocks.BLOCK_BYTES``, at most ``LONG_ROW``, at
    least ``MIN_ROWS`` or M) and columns per panel (all C unless a block of B rows of C
    values exceeds ``BLOCK_BYTES``)."""
    B = max(min(LONG_ROW, block_rows(M, C, ct.itemsize)), min(M, MIN_ROWS))
    return B, min(C, max(1, _blocks.BLOCK_BYTES // (B * ct.itemsize)))


def _panels(start: int, stop: int, B: int, C: int, P: int) -> Iterator[tuple[int, int, int, int]]:
    """``(a, e, c0, c1)``: the blocks of rows ``[start, stop)``, each in panels of columns."""
    for a, e in blocks(start, stop, B):
        for c0 in range(0, C, P):
            yield a, e, c0, min(C, c0 + P)


class _Scratch:
    """A (B, P) scratch block of ``ct`` whose (n, p) parts are C-ordered."""

    def __init__(self, B: int, P: int, ct: np.dtype[Any]) -> None:
        self.flat = np.empty(B * P, dtype=ct)

    def take(self, n: int, p: int) -> np.ndarray:
        return self.flat[: n * p].reshape(n, p)  # n,p


def _scratch(needed: bool, B: int, P: int, ct: np.dtype[Any]) -> _Scratch | None:
    return _Scratch(B, P, ct) if needed else None


def _read(src: np.ndarray, a: int, e: int, c0: int, c1: int, buf: _Scratch | None) -> np.ndarray:
    """The block ``src[a:e, c0:c1]``, or its copy in ``buf`` converted to its dtype."""
    if buf is None:
        return src[a:e, c0:c1]  # n,p
    out = buf.take(e - a, c1 - c0)  # n,p
    np.copyto(out, src[a:e, c0:c1], casting="unsafe")  # float16 -> float32 is exact
    return out


def _staged(src: np.ndarray, B: int, P: int, ct: np.dtype[Any]) -> _Scratch | None:
    return _scratch(needs_staging(src, ct), B, P, ct)


def _target(dst: np.ndarray, a: int, e: int, c0: int, c1: int, buf: _Scratch | None) -> np.ndarray:
    return dst[a:e, c0:c1] if buf is None else buf.take(e - a, c1 - c0)  # n,p


def _written(
    dst: np.ndarray, a: int, e: int, c0: int, c1: int, block: np.ndarray, buf: _Scratch | None
) -> None:
    if buf is not None:
        np.copyto(dst[a:e, c0:c1], block, casting="same_kind")  # n,p to the output's dtype


# A per-column (C,) operand broadcast along a block's rows costs NumPy a loop call per row
# (a block of 1536 rows of 64 float32 values: 17 against 7 us as one loop). ``_Columns``
# repeats it on r rows: a block of r rows or fewer takes that many of them (``on``: one
# loop), a longer C-ordered block is taken as rows of r*C values (``apply``):
# - BatchNorm's blocks (``_block_repeat``): r = B, a whole block in one loop, for inputs of
#   at least TILE_BLOCKS blocks with fewer than TILE_WIDTH channels; the repeat is a block,
#   whose allocation costs more than it saves on smaller inputs ((256, 512): 1.4 against
#   0.45 ms), which broadcast (r = 1);
# - GroupNorm's samples: r = WIDE // C.
TILE_BLOCKS = 16
TILE_WIDTH = 256
WIDE = 1024


class _Columns:
    """A per-column vector ``v`` (C,) and, for r > 1, its repeat on r rows (r, C)."""

    def __init__(self, v: np.ndarray, r: int) -> None:
        self.v, self.r = v, max(1, r)
        self.rows = None if self.r == 1 else np.empty((self.r, v.shape[0]), dtype=v.dtype)  # r,C
        if self.rows is not None:
            self.rows[...] = v

    def on(self, n: int, c0: int = 0, c1: int | None = None) -> np.ndarray:
        """The operand of a block of n rows (n <= r where r > 1), columns ``[c0, c1)``:
        the repeat's first n rows (n,p), or ``v`` to broadcast (p,)."""
        return self.v[c0:c1] if self.rows is None else self.rows[:n, c0:c1]

    def apply(
        self, ufunc: Any, a: np.ndarray, out: np.ndarray, c0: int = 0, c1: int | None = None
    ) -> np.ndarray:
        """``ufunc(a, v[c0:c1], out=out)`` for (n, c1 - c0) blocks (all C columns by
        default): a block of r rows or fewer with the repeat's rows, a longer one (all C
        columns, both C-ordered) as rows of r*C values and the rest with the repeat's
        rows; else broadcast."""
        rows, n = self.rows, a.shape[0]
        if rows is None or n <= self.r:
            return ufunc(a, self.on(n, c0, c1), out=out)  # n,p
        C = rows.shape[1]
        if (c0, c1) not in ((0, None), (0, C)) or not (a.flags.c_contiguous and out.flags.c_contiguous):
            return ufunc(a, self.v[c0:c1], out=out)  # n,p
        h = n - n % self.r
        W = self.r * C
        ufunc(a[:h].reshape(-1, W), rows.reshape(W), out=out[:h].reshape(-1, W))  # h/r,r*C
        if h < n:
            ufunc(a[h:], rows[: n - h], out=out[h:])  # n - h,C
        return out


def _block_repeat(B: int, M: int, C: int) -> int:
    """r for BatchNorm's ``_Columns`` over blocks of B of the M rows (see TILE_BLOCKS)."""
    return B if M >= TILE_BLOCKS * B and C < TILE_WIDTH else 1


def _columns(r: int, *vectors: np.ndarray | None) -> list[_Columns | None]:
    return [None if v is None else _Columns(v, r) for v in vectors]


def _sample_columns(v: np.ndarray) -> _Columns:
    """A (C,) vector as GroupNorm's samples take it (r = WIDE // C)."""
    return _Columns(v, WIDE // int(v.shape[0]))


# Column sums are BLAS sums of at most SUM_ROWS rows in the data's dtype (one batched
# matmul per block), added in float64: as float32 sums of a block of 4096 rows they left a
# variance 3.5e-7 off, and a block's mean hundreds of ulps off at a large offset, which
# made a near-constant channel's variance 10x too large or negative.
SUM_ROWS = 128


def _colsum(a: np.ndarray, ones: np.ndarray) -> np.ndarray:
    """``sum_i a[i, j]`` of an (n, p) block in float64: sums of ``SUM_ROWS`` rows in the
    block's dtype (``ones`` has at least that many ones), added in float64; a column whose
    total is not finite (a sum beyond the block's dtype: inf, or NaN where sums of both
    signs overflowed) is summed again in float64."""
    n, p = a.shape
    whole = n - n % SUM_ROWS
    total = np.zeros(p)  # p float64
    if whole:
        parts = np.matmul(ones[:SUM_ROWS], np.reshape(a[:whole], (-1, SUM_ROWS, p)))  # n/SUM_ROWS,p
        np.add.reduce(parts, axis=0, dtype=np.float64, out=total)  # p
    if whole < n:
        total += vecmat(ones[: n - whole], a[whole:], out=np.empty(p, dtype=a.dtype))  # p
    over = ~np.isfinite(total)  # p
    if over.any() and a.dtype != np.float64:  # (float32 sums beyond ~3.4e38)
        total[over] = np.add.reduce(a[:, over], axis=0, dtype=np.float64)
    return total


def moments(x: np.ndarray, ct: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each column's mean and biased variance, float64 (C,) each, of x (M, C): per block
    of rows the mean (float64, rounded to ``ct``), its residual ``sum(x - mean)/n`` and
    ``M2 = sum((x - mean)^2)`` (float64 sums, ``_colsum``; taken again in float64 where
    the squares overflow or underflow ``ct``), merged by ``merge_parts``; a column
    constant in every block gets its value and a variance of 0."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B, P = geometry(M, C, ct)
    nb = -(-M // B)
    mean = np.empty((nb, C), dtype=ct)  # blocks,C
    resid, m2 = np.empty((nb, C)), np.empty((nb, C))  # blocks,C float64
    flat = np.empty((nb, C), dtype=ct)  # blocks,C: a column's value where constant in the block, else NaN
    info = np.finfo(ct)

    def work(start: int, stop: int) -> None:
        xbuf = _staged(x, B, P, ct)
        xcbuf, sqbuf = _Scratch(B, P, ct), _Scratch(B, P, ct)
        ones = filled(max(B, SUM_ROWS), ct, 1.0)  # B
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            i, n, p = a // B, e - a, c1 - c0
            xb = _read(x, a, e, c0, c1, xbuf)  # n,p
            m = mean[i, c0:c1]  # p
            m[...] = _colsum(xb, ones) / n  # the block's mean, rounded to ct
            xc = np.subtract(xb, m, out=xcbuf.take(n, p))  # n,p
            resid[i, c0:c1] = _colsum(xc, ones) / n  # p  what the rounding of the mean lost
            q = m2[i, c0:c1]  # p
            q[...] = _colsum(np.multiply(xc, xc, out=sqbuf.take(n, p)), ones)  # p  M2
            value = flat[i, c0:c1]  # p
            value[...] = _constant_columns(xb, xc, m, resid[i, c0:c1], q)
            # squares beyond ct, or below its normal range (all-zero and other constant
            # columns excepted: their M2 is exact), summed again in float64
            redo = (np.isinf(q) | (q < n * float(info.tiny) / float(info.eps))) & np.isnan(value)  # p
            if redo.any() and ct != np.float64:
                wide = xc[:, redo].astype(np.float64)  # n,k
                q[redo] = np.einsum("ij,ij->j", wide, wide)  # k

    run_chunks(work, M, B, P)
    counts = np.full((nb, 1), float(B))  # blocks,1
    counts[-1] = M - (nb - 1) * B
    mean_c, var_c = merge_parts(mean, resid, m2, counts)  # C, C
    same = np.all(flat == flat[0], axis=0)  # C  constant in every block, with one value (NaN: not)
    mean_c[same] = flat[0, same]
    var_c[same] = 0.0
    return mean_c, var_c


def _constant_columns(
    xb: np.ndarray, xc: np.ndarray, mean: np.ndarray, resid: np.ndarray, m2: np.ndarray
) -> np.ndarray:
    """Each column's value where constant in the (n, p) block ``xb`` (``xc = xb - mean``),
    else NaN; a constant column's residual is set to its mean's rounding ``d`` and its M2
    to ``n*d^2``, so that it adds no spread to its channel's (``merge_parts`` subtracts
    ``n*resid^2``). Only columns whose spread is within a few dozen ulps of their mean are
    searched (max == min)."""
    n, p = xc.shape
    value = np.full(p, np.nan, dtype=xb.dtype)  # p
    if n == 1:  # one value per column: constant where finite (an inf's variance is NaN)
        finite = np.isfinite(xb[0])  # p
        value[finite] = xb[0, finite]
        resid[finite] = 0.0
        m2[finite] = 0.0
        return value
    ulps = 64 * float(np.finfo(xc.dtype).eps)
    cols = np.flatnonzero(m2 / n <= (mean.astype(np.float64) * ulps) ** 2)  # near-constant
    if cols.size == 0:
        return value
    near = xb if cols.size == p else xb[:, cols]  # n,k  (every column: no copy)
    cols = cols[np.max(near, axis=0) == np.min(near, axis=0)]  # (NaN columns: not constant)
    cols = cols[np.isfinite(xb[0, cols])]  # (a column of inf: its variance is NaN)
    d = xc[0, cols].astype(np.float64)  # the rounding of each constant column's mean
    resid[cols] = d
    m2[cols] = n * (d * d)
    value[cols] = xb[0, cols]
    return value


def merge_parts(
    mean: np.ndarray, resid: np.ndarray, m2: np.ndarray, count: float | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Chan et al.'s parallel merge of the (K, C) statistics of K parts of each channel
    (rows of a channel, or blocks of a column), in float64: with part means ``m_p =
    mean_p + resid_p`` of ``count`` values each (a number, or a (K, 1) array),
    ``mean_c`` their (weighted) mean and ``M2_c = sum(M2_p - count*resid_p^2) +
    sum(count*(m_p - mean_c)^2)``, at least 0. Returns ``(mean_c, var_c)``, the mean and
    the (biased) variance, in float64."""
    rm = mean.astype(np.float64)  # K,C
    rd = resid.astype(np.float64)  # K,C
    rd[~np.isfinite(rm)] = 0.0  # a part mean of inf is inf (its residual, inf - inf, is NaN)
    weighted = isinstance(count, np.ndarray)
    total = float(np.sum(count)) if weighted else count * rm.shape[0]
    mean_c = np.sum(count * (rm + rd), axis=0) / total if weighted else np.mean(rm + rd, axis=0)  # C
    dev = (rm - mean_c) + rd  # K,C  part mean - channel mean
    within = np.sum(m2 - count * (rd * rd), axis=0)  # C
    between = np.sum(count * (dev * dev), axis=0) if weighted else count * np.sum(dev * dev, axis=0)  # C
    m2_c = np.maximum(within + between, 0.0)  # C  (NaN stays)
    m2_c[np.isinf(m2).any(axis=0)] = np.inf  # beyond float64 (not inf - inf = NaN)
    return mean_c, m2_c / total


def affine(
    x: np.ndarray,
    y: np.ndarray,
    ct: np.dtype[Any],
    center: np.ndarray | None,
    scale: np.ndarray,
    shift: np.ndarray | None,
) -> None:
    """One sweep ``y = (x - center) * scale + shift`` over the rows of x, y (M, C), the
    coefficients (C,) of ``ct`` (``x`` itself without ``center``, no shift without
    ``shift``)."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B, P = geometry(M, C, ct)
    center_c, scale_c, shift_c = _columns(_block_repeat(B, M, C), center, scale, shift)
    assert scale_c is not None

    def work(start: int, stop: int) -> None:
        xbuf = _staged(x, B, P, ct)
        obuf = _scratch(y.dtype != ct, B, P, ct)
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            n = e - a
            xb = _read(x, a, e, c0, c1, xbuf)  # n,p
            out = _target(y, a, e, c0, c1, obuf)  # n,p
            if center_c is not None:
                np.subtract(xb, center_c.on(n, c0, c1), out=out)  # n,p
                np.multiply(out, scale_c.on(n, c0, c1), out=out)  # n,p
            else:
                np.multiply(xb, scale_c.on(n, c0, c1), out=out)  # n,p
            if shift_c is not None:
                np.add(out, shift_c.on(n, c0, c1), out=out)  # n,p
            _written(y, a, e, c0, c1, out, obuf)

    run_chunks(work, M, B, P)


def grad_sums(
    dy: np.ndarray,
    x: np.ndarray,
    ct: np.dtype[Any],
    center: np.ndarray,
    need_dot: bool,
    dx: np.ndarray | None = None,
    a_coef: np.ndarray | None = None,
    *,
    xc_sums: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per column of dy, x (M, C): ``sum(dy)`` and, if ``need_dot``, ``sum(dy*(x -
    center))``, in float64 (``_colsum``), added over the blocks in block order ((C,)
    each); with ``xc_sums`` (C,) (and ``need_dot``), also ``sum(x - center)`` into it. With
    ``dx`` and ``a_coef``, the same sweep writes ``dx = a_coef*dy`` (the backward with
    running statistics)."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B, P = geometry(M, C, ct)
    nb = -(-M // B)
    sdy = np.empty((nb, C))  # blocks,C float64
    sdx = np.empty((nb, C)) if need_dot else None  # blocks,C float64
    sxc = np.empty((nb, C)) if need_dot and xc_sums is not None else None  # blocks,C float64
    r = _block_repeat(B, M, C)
    center_c, a_c = _columns(r, center if need_dot else None, a_coef if dx is not None else None)

    def work(start: int, stop: int) -> None:
        dybuf = _staged(dy, B, P, ct)
        xbuf = _staged(x, B, P, ct) if need_dot else None
        tbuf = _scratch(need_dot, B, P, ct)
        obuf = _scratch(dx is not None and dx.dtype != ct, B, P, ct)
        ones = filled(max(B, SUM_ROWS), ct, 1.0)  # B
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            i, n = a // B, e - a
            dyb = _read(dy, a, e, c0, c1, dybuf)  # n,p
            sdy[i, c0:c1] = _colsum(dyb, ones)  # p  sum(dy)
            if sdx is not None:
                assert tbuf is not None and center_c is not None
                xb = _read(x, a, e, c0, c1, xbuf)  # n,p
                t = np.subtract(xb, center_c.on(n, c0, c1), out=tbuf.take(n, c1 - c0))  # n,p  x - mean
                if sxc is not None:
                    sxc[i, c0:c1] = _colsum(t, ones)  # p  sum(x - mean)
                sdx[i, c0:c1] = _colsum(np.multiply(t, dyb, out=t), ones)  # p
            if dx is not None and a_c is not None:
                out = _target(dx, a, e, c0, c1, obuf)  # n,p
                np.multiply(dyb, a_c.on(n, c0, c1), out=out)  # n,p
                _written(dx, a, e, c0, c1, out, obuf)

    run_chunks(work, M, B, P)
    if sxc is not None and xc_sums is not None:
        np.add.reduce(sxc, axis=0, out=xc_sums)  # C
    return np.add.reduce(sdy, axis=0), None if sdx is None else np.add.reduce(sdx, axis=0)  # C, C


def batch_dx(
    dy: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray,
    ct: np.dtype[Any],
    center: np.ndarray | None,
    a_coef: np.ndarray,
    b_coef: np.ndarray,
    d_coef: np.ndarray,
) -> None:
    """One sweep ``dx = a*(dy - d) + b*(x - center)`` (``x`` itself without ``center``)
    over the rows of dy, x, dx (M, C): dy centred before it is scaled."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B, P = geometry(M, C, ct)
    center_c, a_c, b_c, d_c = _columns(_block_repeat(B, M, C), center, a_coef, b_coef, d_coef)
    assert a_c is not None and b_c is not None and d_c is not None

    def work(start: int, stop: int) -> None:
        xbuf, dybuf = _staged(x, B, P, ct), _staged(dy, B, P, ct)
        tbuf = _Scratch(B, P, ct)
        obuf = _scratch(dx.dtype != ct, B, P, ct)
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            n = e - a
            xb, dyb = _read(x, a, e, c0, c1, xbuf), _read(dy, a, e, c0, c1, dybuf)  # n,p  n,p
            t = tbuf.take(n, c1 - c0)  # n,p
            out = _target(dx, a, e, c0, c1, obuf)  # n,p
            if center_c is not None:
                np.subtract(xb, center_c.on(n, c0, c1), out=t)  # n,p  x - mean
                np.multiply(t, b_c.on(n, c0, c1), out=t)  # n,p
            else:
                np.multiply(xb, b_c.on(n, c0, c1), out=t)  # n,p
            np.subtract(dyb, d_c.on(n, c0, c1), out=out)  # n,p
            np.multiply(out, a_c.on(n, c0, c1), out=out)  # n,p
            np.add(out, t, out=out)  # n,p
            _written(dx, a, e, c0, c1, out, obuf)

    run_chunks(work, M, B, P)


# --- GroupNorm and InstanceNorm on channels-last input: each sample's (S, C) rows ---------
#
# A channels-last (N, C, *spatial) input seen as its (N, S, C) samples: a (sample, group)
# statistic is over the S rows of the group's k = C/G columns of one sample. Per sample,
# in blocks of rows: the column sums (float64, ``_colsum``), then each group's mean
# rounded to the computation dtype, the residual ``sum(x - mean)`` and ``M2 = sum((x -
# mean)^2)`` of its columns (float64), then the output. The threads take whole samples:
# the same bits for any thread count. Output and dx keep the input's layout.


# Samples of fewer than SAMPLE_VALUES values (S*C) go the rows' way instead
# (``numpy_fast_channels``: staged into (sample, group) rows, the output C-ordered): a
# sample's sweeps cost some 40 NumPy calls, which small samples do not pay for.
# Forward+backward against the rows' way, float32, two threads, on an idle 2-vCPU host:
# 0.72x at (1, 32, 256, 256), 0.90x at (4, 512, 14, 14) (100K values a sample), 0.99-1.03x
# at (8, 256, 28, 28) and (32, 64, 56, 56) (200K), where it keeps the layout for free
# (copying the rows' output into it cost 0.39 ms at (64, 64, 16, 16), 1.2-1.6x there);
# 2.0-3.3x at 16K-25K values, 9-12x at 3-4K.
SAMPLE_VALUES = 1 << 16


def as_samples(a: np.ndarray) -> np.ndarray | None:
    """A channels-last (N, C, *spatial) array with S > 1 values per channel as its (N, S,
    C) samples, a view; None for other layouts."""
    if a.ndim < 3 or prod(a.shape[2:]) <= 1:
        return None
    rows = channels_last_rows(a)  # N*S,C
    return None if rows is None else rows.reshape(int(a.shape[0]), -1, int(a.shape[1]))


def samples_of(
    out: np.ndarray | None, *arrays: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """``columns_of`` for ``as_samples``: the (N, S, C) views of ``arrays`` and ``out``;
    None unless every array has one and the samples have ``SAMPLE_VALUES`` values at
    least."""
    views = columns_of(out, *arrays, as_view=as_samples)
    if views is None or views[0][0].shape[1] * views[0][0].shape[2] < SAMPLE_VALUES:
        return None
    return views


def new_samples(a: np.ndarray, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """A fresh channels-last array of ``a``'s shape and ``dtype``, and its (N, S, C) view."""
    y, rows = new_like(a, dtype)
    return y, rows.reshape(int(a.shape[0]), -1, int(a.shape[1]))


def _sample_rows(S: int, C: int, ct: np.dtype[Any]) -> int:
    """Rows per block of a sample: about ``_blocks.BLOCK_BYTES``."""
    return max(1, min(S, block_rows(S, C, ct.itemsize)))


def _run_samples(work: Callable[[int, int], T], N: int, C: int) -> list[T]:
    """``work(n0, n1)`` over the N samples, one contiguous range of whole samples per
    thread (a sample has ``SAMPLE_VALUES`` values at least: worth a thread; ``run_chunks``
    would want a few blocks per thread); results in range order."""
    n = max(1, min(get_num_threads(), N))
    return run_ranges(work, [(i * N // n, (i + 1) * N // n) for i in range(n)], C)


def _group_sums(v: np.ndarray, G: int) -> np.ndarray:
    return np.add.reduce(v.reshape(G, -1), axis=1)  # G: a (C,) float64 vector's group sums


def group_forward(
    x: np.ndarray,
    y: np.ndarray,
    G: int,
    w: np.ndarray | None,
    b: np.ndarray | None,
    eps: float,
    ct: np.dtype[Any],
    keep_var: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GroupNorm's forward over the (N, S, C) samples ``x`` into ``y`` (the same shape, the
    output's dtype): ``y = (x - mean_g)*rstd_g*w_c + b_c``, w and b (C,) of ``ct`` or None.
    Returns ``(mean, rstd, var)``, (N*G,) arrays (``ct``; ``var``, float64 and biased,
    only with ``keep_var``). A group constant in its sample gets its value as the mean and
    a variance of 0 (its output the bias exactly, as PyTorch's); one whose squares leave
    ``ct``'s normal range is taken again in float64."""
    N, S, C = (int(d) for d in x.shape)
    k = C // G
    L = k * S  # values per (sample, group)
    B = _sample_rows(S, C, ct)
    mean = np.empty(N * G, dtype=ct)  # N*G
    rstd = np.empty(N * G, dtype=ct)  # N*G
    var = np.empty(N * G) if keep_var else None  # N*G float64
    info = np.finfo(ct)
    ulps = 64 * float(info.eps)

    def statistics(xs: np.ndarray, xbuf: _Scratch | None, tbuf: _Scratch, ones: np.ndarray) -> tuple:
        """One sample's group means (rounded to ct), residuals and biased variances."""
        col = np.zeros(C)  # C float64
        for a, e in blocks(0, S, B):
            col += _colsum(_read(xs, a, e, 0, C, xbuf), ones)
        m64 = _group_sums(col, G) / L  # G float64
        m = m64.astype(ct)  # G  the mean, rounded
        mc = _sample_columns(np.repeat(m, k))  # C
        rs, q = np.zeros(C), np.zeros(C)  # C float64: sum(x - m), sum((x - m)^2) per column
        for a, e in blocks(0, S, B):
            t = mc.apply(np.subtract, _read(xs, a, e, 0, C, xbuf), tbuf.take(e - a, C))  # n,C
            rs += _colsum(t, ones)
            q += _colsum(np.multiply(t, t, out=t), ones)
        resid = _group_sums(rs, G) / L  # G  what the rounding of the mean lost
        resid[~np.isfinite(m64)] = 0.0  # (a mean of inf: inf - inf)
        m2 = _group_sums(q, G)  # G
        v = np.maximum(m2 / L - resid * resid, 0.0)  # G  (NaN stays)
        v[np.isinf(m2)] = np.inf
        constant = np.zeros(G, dtype=bool)  # G
        for g in np.flatnonzero(v <= (m64 * ulps) ** 2):  # near-constant groups: constant?
            vals = xs[:, g * k : (g + 1) * k]  # S,k
            hi = vals.max()
            if hi == vals.min() and np.isfinite(hi):
                m[g], resid[g], v[g], constant[g] = hi, 0.0, 0.0, True
        redo = (np.isinf(m2) | (m2 < L * float(info.tiny) / float(info.eps))) & ~constant & np.isfinite(m64)
        for g in np.flatnonzero(redo) if ct != np.float64 else ():  # squares beyond ct: float64
            vals = xs[:, g * k : (g + 1) * k].astype(np.float64)  # S,k
            mu = float(np.mean(vals))
            m[g] = mu
            resid[g] = mu - float(m[g])
            v[g] = float(np.mean((vals - mu) ** 2))
        return m, resid, v

    def work(n0: int, n1: int) -> None:
        xbuf = _scratch(needs_staging(x[0], ct), B, C, ct)
        tbuf = _Scratch(B, C, ct)
        obuf = _scratch(y.dtype != ct, B, C, ct)
        ones = filled(max(B, SUM_ROWS), ct, 1.0)  # B
        for n in range(n0, n1):
            xs, ys = x[n], y[n]  # S,C  S,C
            m, resid, v = statistics(xs, xbuf, tbuf, ones)  # G (ct), G, G (float64)
            r = 1.0 / np.sqrt(v + eps)  # G float64
            g0 = n * G
            mean[g0 : g0 + G] = m + resid  # the mean as close as ct holds it
            rstd[g0 : g0 + G] = r
            if var is not None:
                var[g0 : g0 + G] = v
            rc = np.repeat(rstd[g0 : g0 + G], k)  # C  (ct)
            scale = rc if w is None else np.multiply(rc, w)  # C  rstd*w
            d = np.repeat(resid.astype(ct).astype(np.float64), k)  # C  the residual, as ct holds it
            with np.errstate(all="ignore"):
                shift = -d * scale if b is None else b - d * scale  # C float64: (x - m - d)*scale + b
            shift = np.where(d == 0, 0.0 if b is None else b, shift).astype(ct)  # C (0*inf: not NaN)
            mc, sc, sh = (_sample_columns(v) for v in (np.repeat(m, k), scale, shift))  # C each
            for a, e in blocks(0, S, B):
                out = _target(ys, a, e, 0, C, obuf)  # n,C
                mc.apply(np.subtract, _read(xs, a, e, 0, C, xbuf), out)
                sc.apply(np.multiply, out, out)
                sh.apply(np.add, out, out)
                _written(ys, a, e, 0, C, out, obuf)

    _run_samples(work, N, C)
    return mean, rstd, var


def group_backward(
    dy: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray,
    G: int,
    mean: np.ndarray,
    rstd: np.ndarray,
    w: np.ndarray | None,
    ct: np.dtype[Any],
) -> tuple[np.ndarray, np.ndarray] | None:
    """GroupNorm's backward over the (N, S, C) samples dy, x into dx, from the (N*G,)
    statistics (``ct``): per sample and column ``sum(dy)`` and ``sum(dy*(x - m - d))``
    (float64; m the saved mean, ``d = mean(x - m)`` over the group, what its rounding
    lost: x - m - d is x less the true mean), then ``dx = rstd*w_c*dy + b_g*(x - m) +
    c_g`` with ``b = -rstd^3*sum(g*(x - m - d))/L``, ``c = -rstd*sum(g)/L - b*d``, ``g =
    dy*w``. Returns the (N, C) float64 sums ``(sum(dy), sum(dy*(x - m - d)))`` for
    dweight and dbias, or None where a coefficient is beyond ``ct`` with finite sums (the
    caller falls back)."""
    N, S, C = (int(d) for d in x.shape)
    k = C // G
    L = k * S
    B = _sample_rows(S, C, ct)
    sdy_all, sdx_all = np.empty((N, C)), np.empty((N, C))  # N,C float64
    w64 = None if w is None else w.astype(np.float64)  # C

    def work(n0: int, n1: int) -> bool:
        xbuf, dybuf = (
            _scratch(needs_staging(x[0], ct), B, C, ct),
            _scratch(needs_staging(dy[0], ct), B, C, ct),
        )
        tbuf = _Scratch(B, C, ct)
        obuf = _scratch(dx.dtype != ct, B, C, ct)
        ones = filled(max(B, SUM_ROWS), ct, 1.0)  # B
        for n in range(n0, n1):
            xs, dys, dxs = x[n], dy[n], dx[n]  # S,C each
            g0 = n * G
            mc = _sample_columns(np.repeat(mean[g0 : g0 + G], k))  # C  (ct)
            rs = rstd[g0 : g0 + G]  # G  (ct)
            sx, sd, sdx = np.zeros(C), sdy_all[n], sdx_all[n]  # C float64 each
            sd[...] = 0.0
            sdx[...] = 0.0
            for a, e in blocks(0, S, B):
                dyb = _read(dys, a, e, 0, C, dybuf)  # n,C
                t = mc.apply(np.subtract, _read(xs, a, e, 0, C, xbuf), tbuf.take(e - a, C))  # n,C
                sx += _colsum(t, ones)
                sd += _colsum(dyb, ones)
                sdx += _colsum(np.multiply(t, dyb, out=t), ones)
            d = _group_sums(sx, G) / L  # G  mean(x - mean)
            sdx -= np.repeat(d, k) * sd  # C  sum(dy*(x - mean - d))
            sg = _group_sums(sd if w64 is None else sd * w64, G)  # G  sum(g)
            sgx = _group_sums(sdx if w64 is None else sdx * w64, G)  # G  sum(g*(x - mean - d))
            r64 = rs.astype(np.float64)  # G
            with np.errstate(all="ignore"):
                bc = ((r64 * sgx) * (r64 * r64 / -L)).astype(ct)  # G
                cc = (r64 * sg / -L).astype(ct)  # G
            if (
                (np.isinf(bc).any() or np.isinf(cc).any())
                and np.isfinite(sgx).all()
                and np.isfinite(sg).all()
            ):
                return False  # finite sums, coefficients beyond ct
            with np.errstate(all="ignore"):  # b*(x - m - d) + c = b*(x - m) + (c - b*d)
                cc = (cc - bc.astype(np.float64) * d).astype(ct)  # G
            rc = np.repeat(rs, k)  # C
            a_c = rc if w is None else np.multiply(rc, w)  # C  rstd*w
            ac, b_c, c_c = (_sample_columns(v) for v in (a_c, np.repeat(bc, k), np.repeat(cc, k)))  # C each
            for a, e in blocks(0, S, B):
                dyb = _read(dys, a, e, 0, C, dybuf)  # n,C
                t = mc.apply(np.subtract, _read(xs, a, e, 0, C, xbuf), tbuf.take(e - a, C))  # n,C
                out = _target(dxs, a, e, 0, C, obuf)  # n,C
                ac.apply(np.multiply, dyb, out)
                b_c.apply(np.multiply, t, t)
                np.add(out, t, out=out)
                c_c.apply(np.add, out, out)
                _written(dxs, a, e, 0, C, out, obuf)
        return True

    if not all(_run_samples(work, N, C)):
        return None
    return sdy_all, sdx_all
