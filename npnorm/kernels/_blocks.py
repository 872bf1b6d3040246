"""Row blocks: how the fast NumPy kernels cut a ``(rows, D)`` array into pieces.

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
from functools import partial
from typing import Any, TypeVar

import numpy as np

from .._threads import get_num_threads, run_parallel

T = TypeVar("T")

# Bytes of one block in the computation dtype, for every fast kernel. A thread touches up
# to ~6 blocks at once (input, gradient, scratch, output, tiled parameters), which should
# stay in its core's L2 cache; larger blocks mean fewer NumPy calls (each ~1-2 us).
# 256 KiB to 512 KiB measured within noise of each other on the 2 MiB L2 of the
# development machine.
BLOCK_BYTES = 384 * 1024
MIN_BLOCKS_PER_THREAD = 4  # below this a thread's share does not pay for the hand-off


def rows_view(a: np.ndarray, D: int) -> np.ndarray:
    """``a`` as ``(R, D)``: a view when its layout allows, else one C-ordered copy.

    A view may have strided rows (a transposed or sliced input); ``stage`` copies
    such blocks into contiguous scratch one at a time.
    """
    return np.reshape(a, (-1, D))  # R,D


def param(p: np.ndarray | None, D: int, dtype: np.dtype[Any]) -> np.ndarray | None:
    """A weight or bias as a contiguous ``(D,)`` array of ``dtype`` (``None`` stays)."""
    if p is None:
        return None
    return np.ascontiguousarray(np.reshape(p, (D,)), dtype=dtype)  # D


def per_row(s: np.ndarray, R: int, dtype: np.dtype[Any], what: str) -> np.ndarray:
    """A saved per-row statistic as a contiguous ``(R,)`` array of ``dtype``."""
    if s.size != R:
        raise ValueError(f"{what} must have one value per row ({R}), got shape {tuple(s.shape)}")
    return np.ascontiguousarray(np.reshape(s, (R,)), dtype=dtype)  # R


def block_rows(R: int, D: int, itemsize: int) -> int:
    """Rows per block: about ``BLOCK_BYTES``, at least one row, at most ``R``."""
    return max(1, min(R, BLOCK_BYTES // (D * itemsize)))


def scratch(needed: bool, B: int, D: int, dtype: np.dtype[Any]) -> np.ndarray | None:
    """A (B,D) scratch block of ``dtype`` (allocated once per thread and sweep), or None
    unless ``needed``."""
    return np.empty((B, D), dtype=dtype) if needed else None


def needs_staging(a: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether blocks of the ``(R, D)`` array ``a`` must be copied before use: they
    must be of ``dtype`` and have unit stride along a row."""
    return a.dtype != dtype or (a.shape[1] > 1 and a.strides[1] != a.itemsize)


def stage(src: np.ndarray, buf: np.ndarray | None) -> np.ndarray:
    """The block ``src`` (n,D) itself, or its copy in ``buf[:n]`` converted to
    ``buf``'s dtype when ``buf`` is given."""
    if buf is None:
        return src
    out = buf[: src.shape[0]]  # n,D
    np.copyto(out, src, casting="unsafe")  # float16 -> float32 is exact
    return out


def blocks(start: int, stop: int, B: int) -> Iterator[tuple[int, int]]:
    """``(a, b)`` row ranges of at most ``B`` rows covering ``[start, stop)``."""
    for a in range(start, stop, B):
        yield a, min(a + B, stop)


def chunks(R: int, B: int) -> list[tuple[int, int]]:
    """One block-aligned ``(start, stop)`` row range per thread; a single range
    (run inline) when there are too few blocks to share."""
    n_blocks = -(-R // B)
    n = max(1, min(get_num_threads(), n_blocks // MIN_BLOCKS_PER_THREAD))
    edges = [min(R, (k * n_blocks // n) * B) for k in range(n + 1)]
    return list(itertools.pairwise(edges))


def run_chunks(work: Callable[[int, int], T], R: int, B: int, row: int = 0) -> list[T]:
    """``work(start, stop)`` over the chunks of ``R`` rows, in parallel, in
    ``loop_mode(row)``; results in chunk order. NumPy's floating-point error settings
    (``np.errstate``) are per thread, so the caller's are applied in the workers too."""
    err = np.geterr()

    def task(start: int, stop: int) -> T:
        with np.errstate(**err), loop_mode(row):
            return work(start, stop)

    return run_parallel([partial(task, a, b) for a, b in chunks(R, B)])


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
# than with one on the development machine). einsum is the fallback for NumPy < 2.0
# (no vecdot) and < 2.2 (no vecmat).

_HAS_VECDOT = hasattr(np, "vecdot")
_HAS_VECMAT = hasattr(np, "vecmat")


def rowdot(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = sum_j a[i, j] * b[i, j]`` for (n,D) blocks (``b`` may be one (D,) row)."""
    if _HAS_VECDOT:
        return np.vecdot(a, b, out=out)  # n
    return np.einsum("ij,ij->i" if b.ndim == 2 else "ij,j->i", a, b, out=out)  # n


def rowsum(a: np.ndarray, ones: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = sum_j a[i, j]`` for an (n,D) block; ``ones`` is (D,) of ones."""
    return rowdot(a, ones, out)  # n


def vecmat(v: np.ndarray, a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[j] = sum_i v[i] * a[i, j]`` for an (n,) vector and an (n,D) block."""
    if _HAS_VECMAT:
        return np.vecmat(v, a, out=out)  # D
    return np.einsum("i,ij->j", v, a, out=out)  # D


def colsum(a: np.ndarray, ones: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[j] = sum_i a[i, j]`` for an (n,D) block; ``ones`` has at least n ones."""
    return vecmat(ones[: a.shape[0]], a, out)  # D


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


def tiled(v: np.ndarray | None, B: int) -> np.ndarray | None:
    """A (D,) parameter repeated on B rows, so that multiplying a block by it is one
    contiguous pass (a broadcast (D,) operand costs NumPy one loop call per row)."""
    if v is None:
        return None
    return np.tile(v, (B, 1))  # B,D
