"""The ``"numpy"`` family's sweeps over columns: BatchNorm where a channel is a column.

BatchNorm1d's (N, C) input holds one value per channel in each row, and so does a
channels-last (N, C, *spatial) input (NumPy's ``moveaxis`` of NHWC data, torch's
``channels_last``) seen as its (N*S, C) rows. As the N*C rows of S values that
``numpy_fast_channels`` sweeps, such input would be rows of one value, or a strided
gather. Here a block is B rows of p columns (all C, but for inputs so wide that
``MIN_ROWS`` rows of C values exceed a block), every per-channel value a vector
broadcast along the block's rows (or repeated on them, ``_tiles``), and every sum over
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

from collections.abc import Iterator
from typing import Any

import numpy as np

from .._checks import prod
from . import _blocks
from ._blocks import (
    LONG_ROW,
    block_rows,
    blocks,
    channels_last_rows,
    from_channel_rows,
    needs_staging,
    run_chunks,
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
    out: np.ndarray | None, *arrays: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """The (M, C) views of ``arrays`` (``as_columns``) and of ``out`` (None where no
    ``out`` is given, or where it has no such view, shares memory with an input or is
    read-only: the result is then copied into it); None unless every array has one."""
    views = [v for v in map(as_columns, arrays) if v is not None]
    if len(views) < len(arrays):
        return None
    out_view = None if out is None else as_columns(out)
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


# A per-channel (C,) vector is repeated on a block's rows (``_tiles``) for inputs of at
# least TILE_BLOCKS blocks with fewer than TILE_WIDTH channels: an operation with a
# broadcast (C,) operand costs NumPy a loop call per row (a block of 1536 rows of 64
# float32 values: 17 against 7 us), but the tiles are a block each, whose allocation
# costs more than that saves on small inputs ((256, 512): 1.4 against 0.45 ms).
TILE_BLOCKS = 16
TILE_WIDTH = 256


def _tiles(B: int, M: int, *vectors: np.ndarray | None) -> list[np.ndarray | None]:
    """Each (C,) vector repeated on B rows (B,C), or left as it is (see TILE_BLOCKS);
    ``_on`` takes a block's operand from either."""
    if any(v is not None and v.shape[0] >= TILE_WIDTH for v in vectors) or M < TILE_BLOCKS * B:
        return list(vectors)
    return [None if v is None else np.tile(v, (B, 1)) for v in vectors]  # B,C each


def _on(v: np.ndarray, n: int, c0: int, c1: int) -> np.ndarray:
    return v[:n, c0:c1] if v.ndim == 2 else v[c0:c1]  # n,p or p


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
        ones = np.ones(max(B, SUM_ROWS), dtype=ct)  # B
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
    center_t, scale_t, shift_t = _tiles(B, M, center, scale, shift)  # B,C or C each
    assert scale_t is not None

    def work(start: int, stop: int) -> None:
        xbuf = _staged(x, B, P, ct)
        obuf = _scratch(y.dtype != ct, B, P, ct)
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            n = e - a
            xb = _read(x, a, e, c0, c1, xbuf)  # n,p
            out = _target(y, a, e, c0, c1, obuf)  # n,p
            if center_t is not None:
                np.subtract(xb, _on(center_t, n, c0, c1), out=out)  # n,p
                np.multiply(out, _on(scale_t, n, c0, c1), out=out)  # n,p
            else:
                np.multiply(xb, _on(scale_t, n, c0, c1), out=out)  # n,p
            if shift_t is not None:
                np.add(out, _on(shift_t, n, c0, c1), out=out)  # n,p
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
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per column of dy, x (M, C): ``sum(dy)`` and, if ``need_dot``, ``sum(dy*(x -
    center))``, in float64 (``_colsum``), added over the blocks in block order ((C,)
    each). With ``dx`` and ``a_coef``, the same sweep writes ``dx = a_coef*dy`` (the
    backward with running statistics)."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B, P = geometry(M, C, ct)
    nb = -(-M // B)
    sdy = np.empty((nb, C))  # blocks,C float64
    sdx = np.empty((nb, C)) if need_dot else None  # blocks,C float64
    center_t, a_t = _tiles(B, M, center if need_dot else None, a_coef if dx is not None else None)

    def work(start: int, stop: int) -> None:
        dybuf = _staged(dy, B, P, ct)
        xbuf = _staged(x, B, P, ct) if need_dot else None
        tbuf = _scratch(need_dot, B, P, ct)
        obuf = _scratch(dx is not None and dx.dtype != ct, B, P, ct)
        ones = np.ones(max(B, SUM_ROWS), dtype=ct)  # B
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            i, n = a // B, e - a
            dyb = _read(dy, a, e, c0, c1, dybuf)  # n,p
            sdy[i, c0:c1] = _colsum(dyb, ones)  # p  sum(dy)
            if sdx is not None:
                assert tbuf is not None and center_t is not None
                xb = _read(x, a, e, c0, c1, xbuf)  # n,p
                t = np.subtract(xb, _on(center_t, n, c0, c1), out=tbuf.take(n, c1 - c0))  # n,p  x - mean
                sdx[i, c0:c1] = _colsum(np.multiply(t, dyb, out=t), ones)  # p
            if dx is not None and a_t is not None:
                out = _target(dx, a, e, c0, c1, obuf)  # n,p
                np.multiply(dyb, _on(a_t, n, c0, c1), out=out)  # n,p
                _written(dx, a, e, c0, c1, out, obuf)

    run_chunks(work, M, B, P)
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
    center_t, a_t, b_t, d_t = _tiles(B, M, center, a_coef, b_coef, d_coef)  # B,C or C each
    assert a_t is not None and b_t is not None and d_t is not None

    def work(start: int, stop: int) -> None:
        xbuf, dybuf = _staged(x, B, P, ct), _staged(dy, B, P, ct)
        tbuf = _Scratch(B, P, ct)
        obuf = _scratch(dx.dtype != ct, B, P, ct)
        for a, e, c0, c1 in _panels(start, stop, B, C, P):
            n = e - a
            xb, dyb = _read(x, a, e, c0, c1, xbuf), _read(dy, a, e, c0, c1, dybuf)  # n,p  n,p
            t = tbuf.take(n, c1 - c0)  # n,p
            out = _target(dx, a, e, c0, c1, obuf)  # n,p
            if center_t is not None:
                np.subtract(xb, _on(center_t, n, c0, c1), out=t)  # n,p  x - mean
                np.multiply(t, _on(b_t, n, c0, c1), out=t)  # n,p
            else:
                np.multiply(xb, _on(b_t, n, c0, c1), out=t)  # n,p
            np.subtract(dyb, _on(d_t, n, c0, c1), out=out)  # n,p
            np.multiply(out, _on(a_t, n, c0, c1), out=out)  # n,p
            np.add(out, t, out=out)  # n,p
            _written(dx, a, e, c0, c1, out, obuf)

    run_chunks(work, M, B, P)
