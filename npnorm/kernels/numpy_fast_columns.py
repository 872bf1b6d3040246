"""The ``"numpy"`` family's sweeps over columns: BatchNorm where a channel is a column.

BatchNorm1d's (N, C) input holds one value per channel in each row, and so does a
channels-last (N, C, *spatial) input (NumPy's ``moveaxis`` of NHWC data, torch's
``channels_last``) seen as its (N*S, C) rows. As the N*C rows of S values that
``numpy_fast_channels`` sweeps, such input is rows of one value (BatchNorm1d: statistics
in float64 over blocks of samples, one thread) or a strided gather (channels-last: staged
block by block, the output C-ordered). Here a block is B rows of C values, every
per-channel value a (C,) vector repeated on the block's rows, and every sum over the rows
a BLAS ``vecmat`` (the means: of a block of at most ``_blocks.LONG_ROW`` rows, as the row
sweeps' dots; other sums: of ``SUM_ROWS`` rows, added in float64). The output keeps the
input's layout.

The statistics follow ``numpy_fast_channels._row_moments`` column by column: per block its
mean rounded to the computation dtype, the residual ``sum(x - mean)/n`` and ``M2 =
sum((x - mean)^2)``, merged over the blocks with Chan et al.'s formula by the caller; a
column constant within a block gets its exact residual and M2 (``_constant_columns``).
Each block's results go to their own slot and are added in block order: the same bits
whatever the thread count (the threads take block-aligned chunks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._blocks import LONG_ROW, block_rows, blocks, needs_staging, run_chunks, scratch, vecmat, view


def as_columns(a: np.ndarray) -> np.ndarray | None:
    """An (N, C, *spatial) array (or (N, C)) as its (M, C) rows of one value per channel,
    a view: any array of one value per channel and sample (S = 1), and channels-last
    ones; None for other layouts."""
    N, C = int(a.shape[0]), int(a.shape[1])
    if a.ndim == 2 or all(int(d) == 1 for d in a.shape[2:]):
        return view(a, (N, C))  # N,C
    if a.strides[1] != a.itemsize or C == 1:  # (NCHW input skips moveaxis)
        return None
    return view(np.moveaxis(a, 1, -1), (-1, C))  # N*S,C where channels-last, else None


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
    """A fresh array of ``a``'s shape and ``dtype`` whose (M, C) view (``as_columns``)
    exists, in ``a``'s layout where that is channels-last, and that view."""
    N, C = int(a.shape[0]), int(a.shape[1])
    if a.ndim == 2 or all(int(d) == 1 for d in a.shape[2:]):
        y = np.empty(a.shape, dtype=dtype)
    else:
        y = np.moveaxis(np.empty((N, *a.shape[2:], C), dtype=dtype), -1, 1)
    y2 = as_columns(y)
    assert y2 is not None
    return y, y2


def block_size(M: int, C: int, ct: np.dtype[Any]) -> int:
    """Rows per block: about ``_blocks.BLOCK_BYTES``, at most ``LONG_ROW`` (the length of
    one float32 sum)."""
    return min(LONG_ROW, block_rows(M, C, ct.itemsize))


# A per-channel (C,) vector is repeated on a block's rows (``_tiles``) for inputs of at
# least TILE_BLOCKS blocks with fewer than TILE_WIDTH channels: an operation with a
# broadcast (C,) operand costs NumPy a loop call per row (a block of 1536 rows of 64
# float32 values: 17 against 7 us), but the tiles are a block each, whose allocation
# costs more than that saves on small inputs ((256, 512): 1.4 against 0.45 ms).
TILE_BLOCKS = 16
TILE_WIDTH = 256


def _tiles(B: int, M: int, *vectors: np.ndarray | None) -> list[np.ndarray | None]:
    """Each (C,) vector repeated on B rows (B,C), or left as it is (see TILE_BLOCKS);
    ``_on(v, n)`` takes the operand for a block of n rows from either."""
    if any(v is not None and v.shape[0] >= TILE_WIDTH for v in vectors) or M < TILE_BLOCKS * B:
        return list(vectors)
    return [None if v is None else np.tile(v, (B, 1)) for v in vectors]  # B,C each


def _on(v: np.ndarray, n: int) -> np.ndarray:
    return v[:n] if v.ndim == 2 else v  # n,C or C


# Column sums in the data's dtype are BLAS sums of at most SUM_ROWS values each (one
# batched vecmat per block), added in float64: as float32 sums of a block of 4096 rows
# they left a variance 3.5e-7 off (the statistics of BatchNorm1d's input were float64
# before: 1.2e-6 against 4.1e-7 in y at offset 1e3).
SUM_ROWS = 128


def _colsum(a: np.ndarray, ones: np.ndarray) -> np.ndarray:
    """``sum_i a[i, j]`` of an (n, C) block in float64: sums of ``SUM_ROWS`` rows in the
    block's dtype (``ones`` has at least that many ones), added in float64."""
    n, C = a.shape
    whole = n - n % SUM_ROWS
    total = np.zeros(C)  # C float64
    if whole:
        parts = np.matmul(ones[:SUM_ROWS], np.reshape(a[:whole], (-1, SUM_ROWS, C)))  # n/SUM_ROWS,C
        np.add.reduce(parts, axis=0, dtype=np.float64, out=total)  # C
    if whole < n:
        total += vecmat(ones[: n - whole], a[whole:], out=np.empty(C, dtype=a.dtype))  # C
    return total


def _read(src: np.ndarray, a: int, e: int, buf: np.ndarray | None) -> np.ndarray:
    """Rows ``[a, e)`` of ``src`` (M, C), or their copy in ``buf`` converted to its dtype."""
    if buf is None:
        return src[a:e]  # n,C
    out = buf[: e - a]  # n,C
    np.copyto(out, src[a:e], casting="unsafe")  # float16 -> float32 is exact
    return out


def _staged(src: np.ndarray, B: int, ct: np.dtype[Any]) -> np.ndarray | None:
    return scratch(needs_staging(src, ct), B, int(src.shape[1]), ct)


def _target(dst: np.ndarray, a: int, e: int, buf: np.ndarray | None) -> np.ndarray:
    return dst[a:e] if buf is None else buf[: e - a]  # n,C


def _written(dst: np.ndarray, a: int, e: int, block: np.ndarray, buf: np.ndarray | None) -> None:
    if buf is not None:
        np.copyto(dst[a:e], block, casting="same_kind")  # n,C to the output's dtype


def moments(x: np.ndarray, ct: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block of rows of x (M, C) and per column: the mean rounded to ``ct``, its
    residual ``sum(x - mean)/n`` and ``M2 = sum((x - mean)^2)`` (float64: a block whose
    float32 sum of squares overflows is summed again in float64), each (blocks, C); and the
    blocks' row counts (blocks, 1), float64."""
    M, C = int(x.shape[0]), int(x.shape[1])
    B = block_size(M, C, ct)
    nb = -(-M // B)
    mean, resid = np.empty((nb, C), dtype=ct), np.empty((nb, C), dtype=ct)  # blocks,C
    m2 = np.empty((nb, C))  # blocks,C float64

    def work(start: int, stop: int) -> None:
        xbuf = _staged(x, B, ct)  # B,C
        xcbuf, sqbuf = np.empty((B, C), dtype=ct), np.empty((B, C), dtype=ct)  # B,C  B,C
        ones = np.ones(max(B, SUM_ROWS), dtype=ct)  # B
        for a, e in blocks(start, stop, B):
            i, n = a // B, e - a
            inv = np.full(n, 1.0 / n, dtype=ct)  # n (1/n, not a sum then a division: no overflow)
            xb = _read(x, a, e, xbuf)  # n,C
            vecmat(inv, xb, out=mean[i])  # C  the block's mean
            xc = np.subtract(xb, mean[i], out=xcbuf[:n])  # n,C
            vecmat(inv, xc, out=resid[i])  # C  the residual of the mean
            m2[i] = _colsum(np.multiply(xc, xc, out=sqbuf[:n]), ones)  # C  M2
            over = np.isinf(m2[i])  # C
            if over.any():  # (float32 values beyond ~1.8e19 from the mean)
                wide = xc[:, over].astype(np.float64)  # n,k
                m2[i, over] = np.einsum("ij,ij->j", wide, wide)  # k
            _constant_columns(xc, mean[i], resid[i], m2[i])

    run_chunks(work, M, B, C)
    counts = np.full((nb, 1), float(B))  # blocks,1
    counts[-1] = M - (nb - 1) * B
    return mean, resid, m2, counts


def _constant_columns(xc: np.ndarray, mean: np.ndarray, resid: np.ndarray, m2: np.ndarray) -> None:
    """``numpy_fast_channels._constant_rows`` for the columns of the (n, C) block ``xc =
    x - mean``: a column constant within the block holds the mean's rounding ``d`` in
    every row; its residual is set to ``d`` and its M2 to ``n*d^2``, so that the merge
    gives its channel's mean exactly and a variance of 0. Only columns whose spread is
    within a few dozen ulps of their mean are searched (max == min)."""
    n = xc.shape[0]
    if n == 1:  # one value per column: xc is 0 already
        return
    ulps = 64 * float(np.finfo(xc.dtype).eps)
    cols = np.flatnonzero(m2 / n <= (mean.astype(np.float64) * ulps) ** 2)  # near-constant
    if cols.size == 0:
        return
    near = xc[:, cols]  # n,k
    flat = cols[np.max(near, axis=0) == np.min(near, axis=0)]  # (NaN columns: not constant)
    if flat.size == 0:
        return
    d = xc[0, flat]  # the rounding of each constant column's mean
    resid[flat] = d
    d64 = d.astype(np.float64)
    m2[flat] = n * (d64 * d64)


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
    B = block_size(M, C, ct)
    center_t, scale_t, shift_t = _tiles(B, M, center, scale, shift)  # B,C each
    assert scale_t is not None

    def work(start: int, stop: int) -> None:
        xbuf = _staged(x, B, ct)  # B,C
        obuf = scratch(y.dtype != ct, B, C, ct)  # B,C
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = _read(x, a, e, xbuf)  # n,C
            out = _target(y, a, e, obuf)  # n,C
            if center_t is not None:
                np.subtract(xb, _on(center_t, n), out=out)  # n,C
                np.multiply(out, _on(scale_t, n), out=out)  # n,C
            else:
                np.multiply(xb, _on(scale_t, n), out=out)  # n,C
            if shift_t is not None:
                np.add(out, _on(shift_t, n), out=out)  # n,C
            _written(y, a, e, out, obuf)

    run_chunks(work, M, B, C)


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
    B = block_size(M, C, ct)
    nb = -(-M // B)
    sdy = np.empty((nb, C))  # blocks,C float64
    sdx = np.empty((nb, C)) if need_dot else None  # blocks,C float64
    center_t, a_t = _tiles(B, M, center if need_dot else None, a_coef if dx is not None else None)  # B,C each

    def work(start: int, stop: int) -> None:
        dybuf = _staged(dy, B, ct)  # B,C
        xbuf = _staged(x, B, ct) if need_dot else None  # B,C
        tbuf = scratch(need_dot, B, C, ct)  # B,C
        obuf = scratch(dx is not None and dx.dtype != ct, B, C, ct)  # B,C
        ones = np.ones(max(B, SUM_ROWS), dtype=ct)  # B
        for a, e in blocks(start, stop, B):
            i, n = a // B, e - a
            dyb = _read(dy, a, e, dybuf)  # n,C
            sdy[i] = _colsum(dyb, ones)  # C  sum(dy)
            if sdx is not None:
                assert tbuf is not None and center_t is not None
                t = np.subtract(_read(x, a, e, xbuf), _on(center_t, n), out=tbuf[:n])  # n,C  x - mean
                sdx[i] = _colsum(np.multiply(t, dyb, out=t), ones)  # C
            if dx is not None and a_t is not None:
                out = _target(dx, a, e, obuf)  # n,C
                np.multiply(dyb, _on(a_t, n), out=out)  # n,C
                _written(dx, a, e, out, obuf)

    run_chunks(work, M, B, C)
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
    B = block_size(M, C, ct)
    center_t, a_t, b_t, d_t = _tiles(B, M, center, a_coef, b_coef, d_coef)  # B,C each
    assert a_t is not None and b_t is not None and d_t is not None

    def work(start: int, stop: int) -> None:
        xbuf, dybuf = _staged(x, B, ct), _staged(dy, B, ct)  # B,C  B,C
        tbuf = np.empty((B, C), dtype=ct)  # B,C
        obuf = scratch(dx.dtype != ct, B, C, ct)  # B,C
        for a, e in blocks(start, stop, B):
            n = e - a
            xb, dyb = _read(x, a, e, xbuf), _read(dy, a, e, dybuf)  # n,C  n,C
            t = tbuf[:n]  # n,C
            out = _target(dx, a, e, obuf)  # n,C
            if center_t is not None:
                np.subtract(xb, _on(center_t, n), out=t)  # n,C  x - mean
                np.multiply(t, _on(b_t, n), out=t)  # n,C
            else:
                np.multiply(xb, _on(b_t, n), out=t)  # n,C
            np.subtract(dyb, _on(d_t, n), out=out)  # n,C
            np.multiply(out, _on(a_t, n), out=out)  # n,C
            np.add(out, t, out=out)  # n,C
            _written(dx, a, e, out, obuf)

    run_chunks(work, M, B, C)
