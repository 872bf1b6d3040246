"""How the compiled (numba) kernels get their arrays and their threads.

The compiled loops (``_numba_loops``) take C-ordered arrays of the computation dtype
(float32 or float64) only, so that each compiles once per dtype and layout. A call whose
inputs already are (the common case; ``direct``) passes them to the loops as they are,
each thread's range of rows (BatchNorm's: of channels) in one call, with no staging
objects; anything else (float16, Fortran order, channels-last, strided views) is copied
block by block into C-ordered scratch of the computation dtype (``Source``), and an
output of another dtype or layout is written through a scratch block (``Target``);
float16 blocks are converted to float32 and back by compiled casts (``cast_into``).
Memory beyond the outputs is then a few blocks per thread, a block being at least one
row (rows longer than ``STAGE_BYTES``, few huge LayerNorm rows or InstanceNorm planes,
take a row's scratch per staged array and thread: a float16 InstanceNorm of two 2048x2048
planes used 4x its input's bytes in the forward, 6x in the backward). BatchNorm, whose
loop needs all of a channel's samples at once, stages such an input in blocks of channels
or of rows where it can (``numba_channels``), else whole (``Source.whole``), and such an
output through a whole-size scratch array.

Threads: the rows (or channels) are split into one contiguous range per thread
(``ranges``), fixed by the thread count (``npnorm.set_num_threads``) and the size, and
run on npnorm's thread pool; the loops release the GIL. Small inputs run in the calling
thread: below ``MIN_PARALLEL`` elements per thread a hand-off costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import numpy as np

from .._threads import get_num_threads, run_parallel
from . import _blocks
from . import _numba_loops as loops
from ._blocks import Rows, as_vector, filled, view

T = TypeVar("T")

COMPILED = (np.dtype(np.float32), np.dtype(np.float64))  # the dtypes the loops compile for
# Elements per thread below which a call runs serially: a call splits over two threads
# from 2*MIN_PARALLEL values. Each split costs a hand-off to the pool, measured at 15-78
# us on the 2-vCPU VMs (a call of two no-op tasks; the same VM gave 66 us in one run of
# 2000 calls and 15 us in the next). With 1 << 16, on an AMD EPYC (2026-12-06; float32,
# module calls, 1 and 2 threads interleaved), two threads took 1.3-2.5x one thread's time
# at 131072 and 262144 values (LayerNorm, BatchNorm and GroupNorm forward+backward,
# BatchNorm's eval, LayerNorm's forward), 1.02-1.46x at 524288 (1.02-1.15x for the
# forward+backwards), 0.69-1.26x at 1048576 (0.69-0.88x but BatchNorm's eval) and
# 0.57-0.88x from 2097152; an earlier session measured the crossover at 400000-800000
# values on another VM (two threads 0.62-0.92x from 800000). So calls split from 786432
# values. (Some loops split later by rules of their own: ``numba_channels``.)
MIN_PARALLEL = 3 << 17
STAGE_BYTES = 1 << 20  # bytes of one staged block (per thread and staged array)


def ranges(n: int, per_item: int) -> list[tuple[int, int]]:
    """``n`` items (rows, channels) of ``per_item`` elements as contiguous ranges, one per
    thread: as many as the thread count allows with at least ``MIN_PARALLEL`` elements
    each, one (the calling thread) for small inputs."""
    if n * per_item < 2 * MIN_PARALLEL:  # one part whatever the thread count: skip reading
        return [(0, n)]  # it (0.35 against 2.2 us, a seventh of a tiny call)
    parts = max(1, min(get_num_threads(), n, (n * per_item) // MIN_PARALLEL))
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


def run(task: Callable[[int, int], T], parts: list[tuple[int, int]]) -> list[T]:
    """``task(start, stop)`` for every range, in parallel; results in range order."""
    if len(parts) == 1:
        return [task(*parts[0])]
    return run_parallel([partial(task, a, e) for a, e in parts])


def spans(start: int, stop: int, step: int) -> Iterator[tuple[int, int]]:
    for a in range(start, stop, step):
        yield a, min(a + step, stop)


def param_or(p: np.ndarray | None, n: int, ct: np.dtype[Any], fill: float) -> np.ndarray:
    """A weight or bias as a C-ordered (n,) array of ``ct``; an absent one as ``fill``
    (ones or zeros: multiplying by 1 and adding 0 are exact; ``_blocks.filled``, never
    written)."""
    if p is not None:
        return vector(p, n, ct)
    return filled(n, ct, fill)


def writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it where it is read-only: numba compiles each loop again for
    read-only arrays (another type; about a second per loop, at run time after
    ``warmup``), so the loops only see writable ones. (Large read-only inputs are staged
    instead: ``direct``, ``Source``; the float16 cast reads them as they are, its
    read-only variant compiled by ``warmup`` too.)"""
    return a if a.flags.writeable else a.copy()


def vector(a: np.ndarray, n: int, ct: np.dtype[Any]) -> np.ndarray:
    """``a`` (n values: a parameter, a saved statistic) as the loops take it: a C-ordered,
    writable (n,) array of ``ct`` (``_blocks.as_vector``, copied where read-only)."""
    return writable(as_vector(a, n, ct))


HALF, SINGLE = np.dtype(np.float16), np.dtype(np.float32)


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``src`` copied into ``dst`` (the same shape), converted to ``dst``'s dtype: float16
    to float32 and back by the compiled loops (``loops.half_columns_to_float``,
    ``float_to_half_columns``, the array as one row: 6-7x faster than NumPy's casts in
    integer arithmetic, 20-40x by the CPU's conversion instruction where it has one; bit
    for bit the same values) where both are C-ordered and native; a block of a
    Fortran-ordered input into C-ordered scratch of its own dtype, where its columns lie a
    multiple of 4 KiB apart, by a compiled copy that reads eight of them side by side
    (``loops.transpose_into``; NumPy's copy took 7-14x its time there: see
    ``_transposing_pays``), and a float16 one into float32 scratch, wherever its columns
    lie, by that copy of its bits and the compiled cast (NumPy's cast of such a block took
    LayerNorm's forward+backward to 6.7x the C-ordered input's time); else by NumPy."""
    if dst.flags.c_contiguous and dst.shape == src.shape and loops.CASTS_COMPILED:
        if _blocks.column_major(src):  # a block of a Fortran-ordered input
            if src.dtype == HALF and dst.dtype == SINGLE:
                bits = np.empty(src.shape, np.uint16)  # n,L: the block C-ordered, still float16
                loops.transpose_into(src.view(np.uint16).T, bits)
                loops.half_columns_to_float(bits.reshape(1, -1), 0, bits.size, dst.reshape(1, -1))
                return
            if src.dtype == dst.dtype and src.dtype in COMPILED and _transposing_pays(src):
                loops.transpose_into(src.T, dst)
                return
        elif src.flags.c_contiguous:  # the whole array as one row
            row, out = src.reshape(1, -1), dst.reshape(1, -1)
            if src.dtype == HALF and dst.dtype == SINGLE:
                loops.half_columns_to_float(row.view(np.uint16), 0, src.size, out)
                return
            if src.dtype == SINGLE and dst.dtype == HALF:
                loops.float_to_half_columns(row, 0, out.view(np.uint16))
                return
    _blocks.cast_into(dst, src)


def _transposing_pays(src: np.ndarray) -> bool:
    """Whether the transposing copy beats NumPy's for the column-major block ``src``:
    where its columns alias (``_blocks.aliased_columns``), there 0.4-1 ns a value
    against NumPy's 4-7 (whose copy of such a block of 16 rows or more, a few columns at
    a time, is 1.5-3x faster than in one call, still about 3x slower than this one). At
    other distances NumPy's took 0.7-1 ns, and the transposing copy gained nothing
    (LayerNorm forward+backward 0.95-1.09x at (15000, 512), (15000, 768), (10000, 1000)
    float32; 5-11% slower where the scratch rows lie 4 KiB apart, (15000, 512) float64)."""
    return _blocks.aliased_columns(src)


def compiled(ct: np.dtype[Any]) -> bool:
    return ct in COMPILED


def plain(a: Any, ct: np.dtype[Any]) -> bool:
    """Whether ``a`` is a C-ordered, writable NumPy array of ``ct``, as the loops take
    their small arrays without a copy (numba would compile a loop again, at run time,
    for a read-only or strided one)."""
    return type(a) is np.ndarray and a.dtype == ct and a.flags.c_contiguous and a.flags.writeable


def direct(ct: np.dtype[Any], out: np.ndarray | None, *inputs: np.ndarray) -> bool:
    """Whether a call can skip staging: the inputs C-ordered in the computation dtype and
    writable, and no ``out`` or a C-ordered one in that dtype (the caller lets the other
    byte order through) that shares no memory with them. (Against the staging objects, which see
    the same arrays through a few layers of Python, this saves 15-40 us a call; with 2
    threads, LayerNorm's forward at (2, 128, 384) took 50 against 67 us, GroupNorm's
    backward at (8, 64, 14, 14) 120 against 154 us.)"""
    for a in inputs:  # (a loop, not any(...): a tenth of a tiny call less)
        if a.dtype != ct:
            return False
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable):
            return False  # (a read-only input is staged: see ``writable``)
    if out is None:
        return True
    return out.dtype == ct and out.flags.c_contiguous and not any(np.may_share_memory(out, a) for a in inputs)


class Source:
    """An input's rows ``(R, L)`` for the loops: the input itself when it is C-ordered in
    the computation dtype (``direct``), else blocks staged through scratch."""

    def __init__(self, a: np.ndarray, N: int, P: int, tail: tuple[int, ...], ct: np.dtype[Any]) -> None:
        self.rows = Rows(a, N, P, tail, ct, cast_into)
        whole = self.rows.whole if self.rows.contiguous else None
        self.direct = whole if whole is not None and whole.flags.writeable else None  # (see ``writable``)
        self.ct, self.L = ct, self.rows.L

    def buffer(self, B: int) -> np.ndarray | None:
        return None if self.direct is not None else np.empty((B, self.L), dtype=self.ct)

    def block(self, a: int, e: int, buf: np.ndarray | None) -> np.ndarray:
        if self.direct is not None:
            return self.direct[a:e]  # n,L
        return self.rows.read(a, e, buf)  # n,L copied into buf

    def whole(self) -> np.ndarray:
        """All rows as one C-ordered (R, L) array of ``ct`` (a copy unless ``direct``,
        made by the threads, each its range of rows)."""
        if self.direct is not None:
            return self.direct
        rows = np.empty((self.rows.R, self.L), dtype=self.ct)  # R,L
        run(lambda a, e: self.rows.read(a, e, rows[a:e]), ranges(self.rows.R, self.L))
        return rows


class Target:
    """An output's rows ``(R, L)`` for the loops: written in place when the output is
    C-ordered in the computation dtype, else through a scratch block converted on the
    way out (``done``)."""

    def __init__(self, y: np.ndarray, R: int, L: int, ct: np.dtype[Any]) -> None:
        rows = view(y, (R, L))  # R,L (y is C-ordered: see _blocks.output)
        assert rows is not None
        self.rows, self.ct, self.L = rows, ct, L
        self.direct = rows.dtype == ct and rows.flags.c_contiguous

    def buffer(self, B: int) -> np.ndarray | None:
        return None if self.direct else np.empty((B, self.L), dtype=self.ct)

    def block(self, a: int, e: int, buf: np.ndarray | None) -> np.ndarray:
        if self.direct:
            return self.rows[a:e]  # n,L
        assert buf is not None
        return buf[: e - a]

    def done(self, a: int, e: int, block: np.ndarray) -> None:
        if not self.direct:
            cast_into(self.rows[a:e], block)  # n,L to the output's dtype

    def all_done(self, rows: np.ndarray) -> None:
        """``done`` for all rows at once (R, L), by the threads, each its range."""
        run(lambda a, e: self.done(a, e, rows[a:e]), ranges(rows.shape[0], self.L))


def block_size(
    sources: tuple[Source, ...], targets: tuple[Target, ...], R: int, L: int, ct: np.dtype[Any]
) -> int:
    """Rows per call of a staged loop: all of a thread's range when nothing needs staging
    (an input passed as it is, with an ``out`` that could not be written directly), else
    blocks of about ``STAGE_BYTES``."""
    if all(s.direct is not None for s in sources) and all(t.direct for t in targets):
        return max(1, R)
    return max(1, min(R, STAGE_BYTES // max(1, L * ct.itemsize)))
