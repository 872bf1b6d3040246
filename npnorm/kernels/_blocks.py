"""Row blocks: how the fast NumPy kernels cut a ``(rows, D)`` array into pieces (and the
row views and output handling that the compiled kernels share).

A normalization over the trailing axes is independent from row to row, so the
kernels view the input as ``(R, D)`` and work through it ``B`` rows at a time, with
``B * D`` elements of the computation dtype about ``BLOCK_BYTES``. A block and the
few scratch blocks a kernel needs then stay in the core's L2 cache: the input is
read from memory by the first NumPy call on a block and the output written by one,
and the other calls (five to ten per block) read and write cache only. Blocks much
smaller than this make the per-call overhead (about a microsecond, partly under the
GIL) count; much larger ones spill out of L2.

The rows are split into one contiguous, block-aligned chunk per thread
(``chunks``); each thread allocates its scratch once and walks its chunk block by
block. The split depends only on ``R``, ``B`` and the thread count, so whatever a
kernel sums over rows (dweight, dbias) is summed in the same order every time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from typing import Any, TypeVar

import numpy as np

from .._checks import prod
from .._stats import RECENTRE_ABOVE
from .._threads import get_num_threads, run_parallel

T = TypeVar("T")

# Bytes of one block in the computation dtype, for every fast kernel. A thread touches up
# to ~6 blocks at once (input, gradient, scratch, output, tiled parameters), which should
# stay in its core's L2 cache; larger blocks mean fewer NumPy calls (each ~1-2 us).
# 256 KiB to 512 KiB measured within noise of each other on the 2 MiB L2 of the
# development machine.
BLOCK_BYTES = 384 * 1024
MIN_BLOCKS_PER_THREAD = 4  # below this a thread's share does not pay for the hand-off


# Arrays below this size that cannot be viewed as rows are copied whole (cheaper than
# copying them block by block, sample by sample, when samples are small).
SMALL_COPY_BYTES = 1 << 20


def view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``a`` reshaped to ``shape`` if that is possible without a copy, else None."""
    try:
        if a.flags.c_contiguous:  # always a view (the method: a third of np.reshape's cost)
            return a.reshape(shape)
        return np.reshape(a, shape, copy=False)
    except ValueError:  # (no copy would do, or no array has that shape)
        return None


def channels_last_rows(a: np.ndarray) -> np.ndarray | None:
    """A channels-last ``(N, C, *spatial)`` array (C its fastest axis: NumPy's
    ``moveaxis`` of an ``(N, *spatial, C)`` array, as torch's ``channels_last``) as its
    ``(N*S, C)`` rows of one value per channel, a view (C-ordered where the other axes
    are); None for other layouts, fewer than three axes or one channel."""
    if a.ndim < 3 or a.shape[1] <= 1 or a.strides[1] != a.itemsize:
        return None  # (the stride test first: NCHW input skips moveaxis, 3 us a call)
    return view(np.moveaxis(a, 1, -1), (-1, int(a.shape[1])))  # N*S,C


def from_channel_rows(rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``(N*S, C)`` rows (or ``(N, S, C)`` samples) as the channels-last ``(N, C,
    *spatial)`` array of ``shape`` they hold (a view: the output keeps the input's
    layout, as torch's and NumPy's elementwise results do)."""
    return np.moveaxis(rows.reshape(shape[0], *shape[2:], shape[1]), -1, 1)


class Rows:
    """Read access to an array as ``R = N*P`` rows of ``L`` values, block by block, in
    the computation dtype ``ct``: every kernel's way into its input.

    The array is seen as ``(N, P, *tail)``: N samples (its first axis) of P rows of
    ``L = prod(tail)`` values. LayerNorm's input ``(*batch, *shape)`` is
    ``(batch[0], prod(batch[1:]), *shape)``; a channel layer's ``(N, C, *spatial)`` with
    G groups is ``(N, G, C/G, *spatial)`` (splitting the channel axis is always a view).

    ``read(start, stop, buf)`` returns rows ``[start, stop)`` as an (n, L) array with unit
    stride along rows: a view of the input when its layout and dtype allow (``staged``
    is False), else their copy in the scratch block ``buf``. An input that cannot be
    viewed as rows is copied sample by sample (whole when small, or when even one sample
    cannot be viewed as its P rows). ``contiguous``: the rows are one C-ordered (R, L)
    array of ``ct`` (``whole`` is then that array). ``cast(dst, src)`` copies and
    converts (``cast_into``: NumPy's cast; the compiled kernels pass their own).
    """

    def __init__(
        self,
        a: np.ndarray,
        N: int,
        P: int,
        tail: tuple[int, ...],
        ct: np.dtype[Any],
        cast: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        self.N, self.P, self.tail = N, P, tail
        self._cast = cast or cast_into
        self.R, self.L = N * P, prod(tail)
        rows = view(a, (self.R, self.L))  # R,L
        split = None if rows is not None else view(a, (N, P, *tail))  # N,P,*tail
        if rows is None and (split is None or a.nbytes <= SMALL_COPY_BYTES):
            rows = np.reshape(np.ascontiguousarray(a), (self.R, self.L))  # R,L (a copy)
        self._rows = rows
        self._split = split
        self.staged = rows is None or needs_staging(rows, ct)
        self.contiguous = rows is not None and rows.dtype == ct and rows.flags.c_contiguous
        self.whole = rows

    def read(self, start: int, stop: int, buf: np.ndarray | None) -> np.ndarray:
        if self._rows is not None:
            return stage(self._rows[start:stop], buf, self._cast)  # n,L
        assert buf is not None and self._split is not None
        out = buf[: stop - start]  # n,L
        r = start
        while r < stop:  # whole samples at once, else one sample's rows
            n, p = divmod(r, self.P)
            whole = (stop - r) // self.P if p == 0 else 0
            if whole:
                e = r + whole * self.P
                dst = np.reshape(out[r - start : e - start], (whole, self.P, *self.tail))
                self._cast(dst, self._split[n : n + whole])
            else:
                e = min(stop, (n + 1) * self.P)
                dst = np.reshape(out[r - start : e - start], (e - r, *self.tail))
                self._cast(dst, self._split[n, p : p + e - r])
            r = e
        return out


def row_layout(input: np.ndarray, k: int) -> tuple[int, int, tuple[int, ...]]:
    """``(N, P, tail)`` of an input normalized over its last ``k`` axes (see ``Rows``)."""
    batch = input.shape[: input.ndim - k]
    return (int(batch[0]) if batch else 1), prod(batch[1:]), tuple(input.shape[input.ndim - k :])


def output(
    out: np.ndarray | None,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    rows: tuple[int, int],
    inputs: tuple[np.ndarray | None, ...],
    contiguous: bool = False,
) -> np.ndarray:
    """The array a kernel writes its output into: the caller's ``out`` when it can be
    viewed as ``rows`` (C-ordered too, when ``contiguous``) and shares no memory with
    the ``inputs``, else a fresh array (``finish`` then copies it into ``out``)."""
    if out is not None and not any(a is not None and np.may_share_memory(out, a) for a in inputs):
        r = view(out, rows)
        if r is not None and (not contiguous or r.flags.c_contiguous):
            return out
    return np.empty(shape, dtype=dtype)


def finish(result: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``result``, copied into ``out`` when that was given and not written directly."""
    if out is None or result is out:
        return result
    np.copyto(out, result)
    return out


def grad_as(g: np.ndarray | None, like: np.ndarray | None) -> np.ndarray | None:
    """A parameter's gradient ``g`` in the shape and dtype of the parameter ``like``
    (None when there is no parameter)."""
    if g is None or like is None:
        return None
    if g.shape != like.shape:
        g = g.reshape(like.shape)
    return g if g.dtype == like.dtype else g.astype(like.dtype)


def as_vector(a: np.ndarray, n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """``a`` (n values: a parameter, a saved statistic) as a C-ordered ``(n,)`` array of
    ``dtype``: ``a`` itself, or its view, where it is one already (the common call, at a
    third of ``np.ascontiguousarray``'s cost), else a copy."""
    if type(a) is np.ndarray and a.dtype == dtype:
        b = a if a.shape == (n,) else a.reshape(n)
        if b.flags.c_contiguous:
            return b
    return np.ascontiguousarray(np.reshape(a, (n,)), dtype=dtype)  # n


def param(p: np.ndarray | None, D: int, dtype: np.dtype[Any]) -> np.ndarray | None:
    """A weight or bias as a contiguous ``(D,)`` array of ``dtype`` (``None`` stays)."""
    return None if p is None else as_vector(p, D, dtype)  # D


_CONSTANTS: dict[tuple[int, np.dtype[Any], float], np.ndarray] = {}
CONSTANT_CACHE_BYTES = 1 << 16  # larger filled arrays are made per call, not kept


def filled(n: int, dtype: np.dtype[Any], value: float) -> np.ndarray:
    """An (n,) array of ``dtype`` holding ``value`` everywhere (the ones a row sum is a dot
    with, ``1/n`` for a mean, an absent weight's ones), for the kernels to read, never to
    write. Those of at most ``CONSTANT_CACHE_BYTES`` are made once and kept (a small
    call's ``np.full`` cost 1 us); a cache of larger ones held 256 MB per row length after
    LayerNorm(2**26, elementwise_affine=False) was gone, and filling one costs little
    beside a row of that length."""
    if n * dtype.itemsize > CONSTANT_CACHE_BYTES:
        return np.full(n, value, dtype=dtype)
    key = (n, dtype, value)
    c = _CONSTANTS.get(key)
    if c is None:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        c = _CONSTANTS[key] = np.full(n, value, dtype=dtype)
    return c


def per_row(s: np.ndarray, R: int, dtype: np.dtype[Any], what: str) -> np.ndarray:
    """A saved per-row statistic as a contiguous ``(R,)`` array of ``dtype``."""
    if s.size != R:
        raise ValueError(f"{what} must have one value per row ({R}), got shape {tuple(s.shape)}")
    return as_vector(s, R, dtype)  # R


def block_rows(R: int, D: int, itemsize: int) -> int:
    """Rows of ``D`` values per block: about ``BLOCK_BYTES``, at least one row, at most
    ``R`` (at least one)."""
    return max(1, min(R, BLOCK_BYTES // max(1, D * itemsize)))


def scratch(needed: bool, B: int, D: int, dtype: np.dtype[Any]) -> np.ndarray | None:
    """A (B,D) scratch block of ``dtype`` (allocated once per thread and sweep), or None
    unless ``needed``."""
    return np.empty((B, D), dtype=dtype) if needed else None


def needs_staging(a: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether blocks of the ``(R, D)`` array ``a`` must be copied before use: they
    must be of ``dtype`` and have unit stride along a row."""
    return a.dtype != dtype or (a.shape[1] > 1 and a.strides[1] != a.itemsize)


# Addresses a multiple of this many bytes apart compete for the same sets of the CPU's
# caches (4 KiB: the span of an L1 cache's sets on the x86-64 cores of the last decade).
ALIASING_BYTES = 4096


def column_major(a: np.ndarray) -> bool:
    """Whether ``a`` is an (n, L) block, n and L above 1, whose columns are contiguous (a
    Fortran-ordered array's rows; its values along the rows may lie anywhere)."""
    return a.ndim == 2 and a.shape[0] > 1 and a.shape[1] > 1 and a.strides[0] == a.itemsize


def aliased_columns(a: np.ndarray) -> bool:
    """Whether the column-major block ``a``'s columns lie a multiple of ALIASING_BYTES
    apart (a Fortran-ordered input of a power-of-two number of rows, as batches of 2**k
    samples give): NumPy's copy of it into C-ordered scratch walks the scratch's rows,
    reading the block's values a column apart, and there every read competes for the
    same cache sets (4-7 ns a value on the 2-vCPU AMD EPYC here, 0.7-1 elsewhere)."""
    return a.strides[1] != 0 and a.strides[1] % ALIASING_BYTES == 0  # (0: a broadcast, in cache)


TILE_ROWS = 16  # the fewest rows of a block that cast_into copies in tiles of columns


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``src`` copied into ``dst`` (the same shape), converted to ``dst``'s dtype; a
    column-major block of TILE_ROWS rows or more with aliased columns into C-ordered
    scratch a few columns at a time (16 to 64, each copy of about 1024 values), whose
    reads then stay in cache: the "numpy" kernels' blocks of a Fortran-ordered float32
    input at (16384, 768) were copied in 14-17 against 48-49 ms, at (2048, 2048) 8-10
    against 28 (LayerNorm's forward+backward there 0.6-0.9x the time; these copies,
    about 2 ns a value, are still most of its gap to C-ordered input: the "numba"
    kernels copy such blocks with ``_numba_loops.transpose_into``). With fewer rows the
    copies' own cost won ((1024, 49152) float32 in blocks of 2 rows took 1.2-1.6x the
    time in tiles)."""
    if (
        dst.flags.c_contiguous
        and column_major(src)
        and src.shape[0] >= TILE_ROWS
        and aliased_columns(src)
        and dst.shape == src.shape
    ):
        n, L = src.shape
        T = min(64, max(16, 1024 // n))  # columns per copy
        for j in range(0, L, T):
            np.copyto(dst[:, j : j + T], src[:, j : j + T], casting="unsafe")
        return
    np.copyto(dst, src, casting="unsafe")  # float16 -> float32 is exact


def stage(
    src: np.ndarray, buf: np.ndarray | None, cast: Callable[[np.ndarray, np.ndarray], None] = cast_into
) -> np.ndarray:
    """The block ``src`` (n,D) itself, or its copy in ``buf[:n]`` converted to
    ``buf``'s dtype (by ``cast``) when ``buf`` is given."""
    if buf is None:
        return src
    out = buf[: src.shape[0]]  # n,D
    cast(out, src)
    return out


def blocks(start: int, stop: int, B: int) -> Iterator[tuple[int, int]]:
    """``(a, b)`` row ranges of at most ``B`` rows covering ``[start, stop)``."""
    for a in range(start, stop, B):
        yield a, min(a + B, stop)


def chunks(R: int, B: int) -> list[tuple[int, int]]:
    """One block-aligned ``(start, stop)`` row range per thread; a single range
    (run inline) when there are too few blocks to share."""
    n_blocks = -(-R // B)
    if n_blocks < 2 * MIN_BLOCKS_PER_THREAD:  # one range whatever the thread count
        return [(0, R)]
    n = max(1, min(get_num_threads(), n_blocks // MIN_BLOCKS_PER_THREAD))
    edges = [min(R, (k * n_blocks // n) * B) for k in range(n + 1)]
    return list(itertools.pairwise(edges))


def run_chunks(work: Callable[[int, int], T], R: int, B: int, row: int = 0) -> list[T]:
    """``work(start, stop)`` over the chunks of ``R`` rows, in parallel (``run_ranges``);
    results in chunk order."""
    return run_ranges(work, chunks(R, B), row)


def run_ranges(work: Callable[[int, int], T], parts: list[tuple[int, int]], row: int = 0) -> list[T]:
    """``work(start, stop)`` over the ranges ``parts``, in parallel, in
    ``loop_mode(row)``; results in range order. The kernels raise no floating-point
    warnings (see ``npnorm._backend.no_fp_warnings``); NumPy's error settings are per
    thread, so the workers silence them too. A single range of rows shorter than
    ``UNBUFFERED_MIN_ROW`` (every small call) runs in the calling thread at once, under
    the calling kernel's ``no_fp_warnings``: the pool's plumbing (the task, its error
    settings) cost ~4 us a sweep, more than a tiny call's arithmetic."""
    if len(parts) == 1 and row < UNBUFFERED_MIN_ROW:
        return [work(*parts[0])]

    def task(start: int, stop: int) -> T:
        with np.errstate(all="ignore"), loop_mode(row):
            return work(start, stop)

    return run_parallel([partial(task, a, b) for a, b in parts])


def sum_in_order(partials: list[np.ndarray | None]) -> np.ndarray | None:
    """The per-thread partial sums added in thread order (deterministic)."""
    total = None
    for p in partials:
        if p is not None:
            total = p.copy() if total is None else np.add(total, p, out=total)
    return total


# --- reductions over a block ---------------------------------------------------------
# vecdot and vecmat are BLAS dot / gemv loops: one read of the block at full speed, with
# the GIL released, and they keep their speed when two threads run them at once (an
# axis-0 ``add.reduce`` or an ``einsum`` over a block ran 2-3x slower with two threads
# than with one on the development machine).


# Rows of at most SHORT_ROW values are summed by einsum: a BLAS dot per row costs more
# than the row (BatchNorm1d's (N, C) input is N*C rows of one value: 10x faster at (256,
# 512)). It is chosen by the row's length alone, so that a row's result does not depend
# on how many rows share its block (einsum and a dot round differently; a tiny (4, 8)
# LayerNorm pays einsum's per-call cost, about 3 us). Rows of more than LONG_ROW values
# are summed as dots of LONG_ROW values each, added in float64: one float32 dot's
# rounding grows with its length (2**16 values of 0.1 sum 1e-5 off, 2**12 of them 6e-7;
# a row of 2**26 normal values had an rstd 3e-4 off).
SHORT_ROW = 32
LONG_ROW = 1 << 12


def rowdot(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = sum_j a[i, j] * b[i, j]`` for (n,D) blocks (``b`` may be one (D,) row)."""
    D = a.shape[1]
    if D <= SHORT_ROW:
        return np.einsum("ij,j->i" if b.ndim == 1 else "ij,ij->i", a, b, out=out)  # n
    if D > LONG_ROW:
        return _long_rowdot(a, b, out)  # n
    return np.vecdot(a, b, out=out)  # n


def _long_rowdot(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``rowdot`` of rows longer than ``LONG_ROW``: a dot per span of ``LONG_ROW`` values
    (and one for the tail), the spans' dots added in float64."""
    D = a.shape[1]
    K = LONG_ROW
    whole = D - D % K  # values in whole spans

    def spans(v: np.ndarray) -> np.ndarray:
        return v[..., :whole].reshape(*v.shape[:-1], whole // K, K)  # (n,) D/K,K

    parts = np.vecdot(spans(a), spans(b))  # n,D/K  a's dtype (b: D/K,K or n,D/K,K)
    total = np.add.reduce(parts, axis=1, dtype=np.float64)  # n
    if whole < D:
        total += np.vecdot(a[:, whole:], b[..., whole:])  # n  the tail
    out[...] = total
    return out


def rowsum(a: np.ndarray, ones: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = sum_j a[i, j]`` for an (n,D) block; ``ones`` is (D,) of ones."""
    return rowdot(a, ones, out)  # n


def vecmat(v: np.ndarray, a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[j] = sum_i v[i] * a[i, j]`` for an (n,) vector and an (n,D) block."""
    return np.vecmat(v, a, out=out)  # D


ACC_ROWS = 128  # rows summed in the block's dtype before a float64 addition (add_vecmat)


def add_vecmat(v: np.ndarray, a: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``total[j] += sum_i v[i] * a[i, j]`` for an (n,) vector, an (n,D) block and a (D,)
    float64 ``total``: sums of ``ACC_ROWS`` rows in the block's dtype (one ``matmul``),
    added in float64. (One float32 ``vecmat`` over a block of thousands of short rows,
    as RMSNorm's dweight took it, lost up to 13 ulps where PyTorch's lost 1.)"""
    n, D = a.shape
    whole = n - n % ACC_ROWS
    if whole:
        parts = np.matmul(  # n/ACC_ROWS,1,D
            np.reshape(v[:whole], (-1, 1, ACC_ROWS)), np.reshape(a[:whole], (-1, ACC_ROWS, D))
        )
        total += np.add.reduce(np.reshape(parts, (-1, D)), axis=0, dtype=np.float64)  # D
    if whole < n:
        total += vecmat(v[whole:], a[whole:], out=np.empty(D, dtype=a.dtype))  # D
    return total


def _wide_rowdot(a: np.ndarray, b: np.ndarray, rows: np.ndarray, dtype: Any = np.float64) -> np.ndarray:
    """``sum_j a[i, j] * b[j]`` (``b`` a (D,) row) or ``* b[i, j]`` (an (n,D) block) in
    ``dtype``, for the rows the mask ``rows`` selects: the few rows whose dot in the
    block's dtype overflowed, taken again (``rowmean``, ``scaled_rowdot``, ``rowsumsq``)."""
    wide = a[rows].astype(dtype)  # the selected rows
    if b.ndim == 1:
        return np.einsum("ij,j->i", wide, b.astype(dtype))
    return np.einsum("ij,ij->i", wide, wide if b is a else b[rows].astype(dtype))


def rowmean(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = mean_j a[i, j] * b[j]`` for an (n,D) block and a (D,) row ``b`` (ones
    for the plain mean): a dot in the block's dtype over D, taken again in float64 for the
    rows where the dot is not finite (as in ``scaled_rowdot``)."""
    rowdot(a, b, out=out)  # n
    big = ~np.isfinite(out)  # n
    np.divide(out, a.shape[1], out=out)  # n
    if big.any():
        out[big] = _wide_rowdot(a, b, big) / a.shape[1]
    return out


def scaled_rowdot(a: np.ndarray, b: np.ndarray, scale: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = scale[i] * sum_j a[i, j] * b[j]`` for an (n,D) block and a (D,) row (or
    an (n,D) block ``b``), ``scale`` float64 (n,): the dot in the block's dtype, taken
    again in float64 for the rows where that is not finite (a float32 row of values near
    1e36: inf where the products share a sign, NaN where the dot's partial sums overflowed
    both ways), so that a scale that brings the sum back into range gives a finite
    result (a row holding a NaN or an infinity comes out the same either way)."""
    rowdot(a, b, out=out)  # n
    big = ~np.isfinite(out)  # n  (inf, or NaN where lanes overflowed both ways)
    np.multiply(out, scale, out=out)  # n
    if big.any():
        out[big] = _wide_rowdot(a, b, big) * scale[big]
    return out


def rowsumsq(a: np.ndarray, out: np.ndarray, small: bool = False) -> np.ndarray:
    """``out[i] = sum_j a[i, j]**2`` for an (n,L) block: a BLAS dot in the block's dtype,
    summed again in ``out``'s dtype (float64) for the rows where that overflows (float32
    values beyond ~1.8e19), so that a finite block has finite sums; with ``small``, also
    for the rows whose sum is so small that squares below the dtype's normal range may
    have lost digits (float32 values below ~1e-19: a row of 1e-25s sums to 0 in float32)."""
    tmp = out if out.dtype == a.dtype else np.empty(out.shape, dtype=a.dtype)  # n
    rowdot(a, a, out=tmp)
    redo = np.isinf(tmp)  # n
    if tmp is not out:
        out[...] = tmp
        if small:
            info = np.finfo(a.dtype)
            redo |= tmp < a.shape[1] * float(info.tiny) / float(info.eps)  # lost digits > eps
    if redo.any():
        out[redo] = _wide_rowdot(a, a, redo, out.dtype)
    return out


def inv_rms(
    a: np.ndarray, count: int, eps: float, out: np.ndarray, var: np.ndarray | None = None
) -> np.ndarray:
    """``out[i] = 1 / sqrt(sum_j a[i, j]**2 / count + eps)`` for an (n,L) block (``a``
    centred: the rstd of LayerNorm and GroupNorm; ``a = x``: RMSNorm's), the mean square
    in float64 (``rowsumsq``); ``var`` (optional) receives the mean square itself. Where
    ``eps`` is so small (below ~1e-24, 0 say) that a mean square below float32's normal
    range still counts, the rows of tiny values are summed in float64 from the start."""
    info = np.finfo(a.dtype)
    small = eps < float(info.tiny) / float(info.eps) ** 2  # ~8e-25 for float32
    ms = rowsumsq(a, np.empty(a.shape[0], dtype=np.float64), small)  # n
    np.divide(ms, count, out=ms)  # mean square
    if var is not None:
        var[...] = ms
    np.add(ms, eps, out=ms)
    np.sqrt(ms, out=ms)
    np.divide(1.0, ms, out=out)  # rstd
    return out


# The fast backwards' guards against coefficients that leave the computation dtype ``ct``;
# where one fires, the caller runs the next family's kernel instead (numba: the "numpy"
# family's; that: the reference's, which forms ``xhat = (x - mean) * rstd`` first: finite
# input, finite and accurate gradients). On the statistics' magnitudes ``size = |rstd|``:
#
# * a huge spread: some rstd below ``low`` (a spread beyond ~1e15 in float32), whose
#   coefficients (``rstd^3 * sum(...)``, about ``rstd^2``) underflow ``ct``, or whose
#   products ``dy * (x - mean)`` overflow it;
# * a tiny spread: some rstd above ``high`` (a spread below ~1e-15 in float32, with
#   ``eps`` about 0), or inf (eps = 0 and a spread that underflows), whose coefficients,
#   about ``rstd^2``, overflow ``ct`` (inf, then ``inf*0`` NaN in dx);
# * a scale that overflows: ``rstd * w``, the per-channel factor by which the backwards of
#   BatchNorm, InstanceNorm and GroupNorm scale dy, might leave ``ct`` (rstd 1e14 with w
#   1e25 in float32): a bound from the largest of each, their product taken in float64.
#   dx may still fit (w 1e25 with dy 1e-6: 1e33).
#
# Each is a few NumPy calls on (C,) or (R,) arrays, once per call: cheap, but a tiny call's
# whole budget is tens of us, so the bounds are taken once per dtype and ``size`` once.


def extreme_spread(rstd: np.ndarray, ct: np.dtype[Any]) -> bool:
    """A huge or tiny spread (see above): the row backwards (LayerNorm, RMSNorm) and
    SyncBatchNorm's dx then take the next family's way."""
    return _extreme(np.abs(rstd), ct, tiny=True)


def extreme_coefficients(
    rstd: np.ndarray, weight: np.ndarray | None, ct: np.dtype[Any], *, tiny: bool = True
) -> bool:
    """A huge spread, a scale that overflows or (with ``tiny``; the numba loops take
    those in float64) a tiny spread (see above): a channel backward's coefficients would
    leave ``ct``."""
    size = np.abs(np.asarray(rstd))
    if _extreme(size, ct, tiny=tiny):
        return True
    if weight is None:
        return False
    # (the largest magnitudes are exact in the arrays' own dtypes; their product in float64)
    largest = spread_limits(ct)[2]
    return float(size.max(initial=0.0)) * float(np.abs(np.asarray(weight)).max(initial=0.0)) > largest


def _extreme(size: np.ndarray, ct: np.dtype[Any], *, tiny: bool) -> bool:
    """A huge spread, or with ``tiny`` a tiny one, among the magnitudes ``size`` of rstd."""
    low, high, _ = spread_limits(ct)
    return bool((size < low).any() or (tiny and (size > high).any()))


@cache
def spread_limits(ct: np.dtype[Any]) -> tuple[np.floating[Any], np.floating[Any], float]:
    """``(low, high, largest)``: the bounds of rstd (see above), scalars of ``ct`` (an
    rstd of another dtype is compared as NumPy promotes the two), and the largest finite
    value of ``ct``, which bounds the scale."""
    info = np.finfo(ct)
    return np.sqrt(info.tiny) * 1e4, np.sqrt(info.max) * 1e-4, float(info.max)


def recentre(
    xc: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    var: np.ndarray,
    inv: np.ndarray,
    eps: float,
) -> None:
    """For an (n,L) block ``xc = x - mean`` centred on its rows' means as rounded to the
    block's dtype, their ``rstd`` and ``var`` (float64, the mean square of ``xc``, as
    ``inv_rms`` gives it; ``inv`` (L,) holds 1/L): where some row's mean is more than
    ``RECENTRE_ABOVE`` standard deviations (eps left out) from 0, take the rows' own
    means ``d = mean(xc)`` (what the rounding lost; a constant row's is its one value of
    ``xc``, exactly: ``constant_rows``), subtract them from ``xc`` and add them to
    ``mean``, and take ``rstd`` and ``var`` again, about the true means. A constant row
    then comes out exactly centred (``xc`` all 0, ``var`` 0, ``mean`` the constant), as
    PyTorch's: its output is the bias exactly, NaN with ``eps = 0``. One more pass over
    the cached block, with a large common offset or a constant row only."""
    if not (mean.astype(np.float64) ** 2 > RECENTRE_ABOVE**2 * var).any():  # (a mean beyond
        return  # 1e154 squares to inf: silenced by the calling kernel's no_fp_warnings)
    d = rowdot(xc, inv, out=np.empty(xc.shape[0], dtype=xc.dtype))  # n
    flat = constant_rows(xc, mean, var)
    d[flat] = xc[flat, 0]
    np.subtract(xc, d[:, None], out=xc)  # n,L  x - true mean
    np.add(mean, d, out=mean, where=np.isfinite(d))  # n  as close to the true mean as the dtype
    # holds (a row holding inf or NaN keeps the mean it had: inf stays inf)
    inv_rms(xc, xc.shape[1], eps, out=rstd, var=var)  # n


def constant_rows(xc: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """The indices of the constant rows of an (n,L) block ``xc = x - mean`` (``mean``
    rounded to the block's dtype, ``var`` the mean square of ``xc``). Every value of such
    a row is the mean's rounding ``d``, and ``mean(xc)`` need not round to ``d`` (nor,
    with a rounded ``1/L``, be taken exactly); the caller uses ``xc[row, 0]``. Only rows
    whose spread is within a few dozen ulps of their mean are searched (max == min)."""
    ulps = 64 * float(np.finfo(xc.dtype).eps)
    rows = np.flatnonzero(var <= (mean.astype(np.float64) * ulps) ** 2)  # near-constant rows
    if rows.size == 0:
        return rows
    near = xc[rows]  # m,L
    return rows[np.max(near, axis=1) == np.min(near, axis=1)]  # (NaN rows: not constant)


# --- loop mode ------------------------------------------------------------------------
# NumPy buffers a broadcast ``block * col[:, None]`` whose rows are shorter than its
# buffer size (8192 elements), which makes it 1.5-3x slower than the unbuffered loop for
# rows of a few hundred values and more. The kernels' workers set a minimal buffer size
# while they run when rows are at least this long (the setting is per thread).
UNBUFFERED_MIN_ROW = 256


@contextmanager
def loop_mode(row: int) -> Iterator[None]:
    """Unbuffered NumPy loops in this thread for rows of ``row`` values (see
    ``UNBUFFERED_MIN_ROW``); the previous buffer size is restored on exit."""
    if row < UNBUFFERED_MIN_ROW:
        yield
        return
    old = np.setbufsize(16)
    try:
        yield
    finally:
        np.setbufsize(old)


# Blocks of at most this many rows take a (D,) parameter broadcast rather than tiled.
BROADCAST_ROWS = 32


def tiled(v: np.ndarray | None, B: int) -> np.ndarray | None:
    """A (D,) parameter repeated on B rows, so that multiplying a block by it is one
    contiguous pass (a broadcast (D,) operand costs NumPy one loop call per row); for
    blocks of at most ``BROADCAST_ROWS`` rows, the parameter as one (1, D) row to
    broadcast (those loop calls cost less than a copy's 1-3 us; the same products).
    Either way ``tiled(v, B)[:n]`` multiplies or adds into an (n, D) block, n <= B."""
    if v is None:
        return None
    if B <= BROADCAST_ROWS:
        return v[None]  # 1,D
    return stacked(v, B)  # B,D


def stacked(v: np.ndarray, n: int) -> np.ndarray:
    """``n`` copies of ``v`` along a new first axis, shape ``(n, *v.shape)``, C-ordered:
    ``np.tile(v, (n, 1, ...))`` by one broadcast assignment (``np.tile``'s Python layers
    cost 3-4 us a call, more than a small call's copy)."""
    out = np.empty((n, *v.shape), dtype=v.dtype)  # n,*v.shape
    out[...] = v
    return out
