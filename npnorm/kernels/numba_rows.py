"""Compiled kernels for LayerNorm and RMSNorm: the ``"numba"`` family.

Same signatures and results (to rounding) as the generic kernels in
``npnorm.functional.layer_norm`` / ``rms_norm``; registered as the ``"numba"`` kernel
family for NumPy arrays, the default when numba imports (``pip install "npnorm[fast]"``).

Each row of ``D`` values is read from memory once per pass direction, the later passes
over it hitting the cache: the forward takes its float64 mean and two-pass variance
(RMSNorm: its mean square) and writes ``y``; the backward takes the row's sums (two;
RMSNorm's one) and writes ``dx``, adding the row into this thread's dweight/dbias partial
sums (in the data's dtype, flushed into float64 every ``_numba_loops.FLUSH_ROWS`` rows;
the threads' float64 sums are added in thread order at the end: bitwise reproducible
for a fixed thread count). The loops are pipelined: while a row's output is written,
chunk by chunk, the next rows' sums are taken, so that reading memory overlaps writing
it (the backwards: row r + 1's sums, whole, then row r's dx); on AMD processors
LayerNorm's forward takes rows of ``loops.LONG_FORWARD_ROW`` values and more one at a
time instead (``layer_norm_forward_long``), which measured faster there and slower on
an Intel Xeon (``loops.one_row_at_a_time``). See ``_numba_loops`` for the
loops and ``_staging`` for how inputs of other dtypes and layouts reach them.

Anything the loops do not compile for (a computation dtype other than float32/float64,
say longdouble) and empty inputs go to the ``"numpy"`` family's kernels.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .._backend import Namespace, no_fp_warnings
from .._checks import Shape, default_eps, prod, work_dtype
from ..functional._dispatch import NUMPY, family_kernel, specialized
from . import _memory_order as memory
from . import _numba_loops as loops
from ._blocks import finish, grad_as, output, per_row, row_layout, spread_limits
from ._staging import Source, Target, block_size, compiled, direct, param_or, ranges, run, spans, writable

Partials = tuple[np.ndarray, np.ndarray]


def _batch(input: np.ndarray, shape: Shape) -> tuple[int, ...]:
    return tuple(input.shape[: input.ndim - len(shape)])


def _fallback(op: str, *args: Any) -> Any:
    return family_kernel(op, "numpy")(*args)


def _staged_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    shape: Shape,
    R: int,
    D: int,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, Source, Source, Target, int]:
    """A backward's staged rows: ``(dx, x's rows, dy's rows, dx's rows, rows per block)``."""
    dx = output(out, input.shape, input.dtype, (R, D), (input, grad_output), contiguous=True)
    layout = row_layout(input, len(shape))
    src_x, src_dy = Source(input, *layout, ct), Source(grad_output, *layout, ct)
    dst = Target(dx, R, D, ct)
    return dx, src_x, src_dy, dst, block_size((src_x, src_dy), (dst,), R, D, ct)


def _partials(D: int, ct: np.dtype[Any], count: int) -> list[np.ndarray]:
    """A thread's partial sums of ``count`` parameter gradients: ``count`` float64 (D,)
    arrays the loop flushes into, then ``count`` (D,) arrays of ``ct`` for the rows since
    the last flush. ``D = 0`` where there are no parameters (the loop writes none: a
    layer without them kept four arrays of the row's length per thread)."""
    return [np.zeros(D) for _ in range(count)] + [np.zeros(D, dtype=ct) for _ in range(count)]


# --- LayerNorm ---------------------------------------------------------------------------


def _extreme_spread(rstd: np.ndarray, ct: np.dtype[Any]) -> bool:
    """``_blocks.extreme_spread(rstd, ct)`` for the backwards' rstd (a C-ordered, writable
    (R,) array of ``ct``: ``per_row``, ``writable``), in one compiled call
    (``loops.spread_leaves``) for NumPy's three (2-3 us of a small backward)."""
    low, high, _ = spread_limits(ct)
    return bool(loops.spread_leaves(rstd, float(low), float(high)))


def _forward_loop(D: int) -> Any:
    """LayerNorm's forward loop for rows of D values: pipelined, or one row at a time
    for rows of ``loops.LONG_FORWARD_ROW`` values and more on hosts where that is faster
    (``loops.one_row_at_a_time``; bitwise the same results; see there)."""
    return loops.layer_norm_forward_long if loops.one_row_at_a_time(D) else loops.layer_norm_forward


@specialized("layer_norm_forward", NUMPY, kernels="numba")
def layer_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    shape: Shape,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm forward: one visit per row (``loops.layer_norm_forward``, or
    ``layer_norm_forward_long``: see ``_forward_loop``)."""
    ct = np.dtype(work_dtype(xp, input, weight, bias))  # float32 at least
    if input.size == 0 or not compiled(ct):
        return _fallback("layer_norm_forward", xp, input, shape, weight, bias, eps, out)
    D = prod(shape)
    R = input.size // D
    w = param_or(weight, D, ct, 1.0)  # D
    b = param_or(bias, D, ct, 0.0)  # D
    mean = np.empty(R, dtype=ct)  # R
    rstd = np.empty(R, dtype=ct)  # R
    batch = _batch(input, shape)
    if direct(ct, out, input):  # the common call: no staging (and no NumPy arithmetic to silence)
        y = np.empty(input.shape, dtype=ct) if out is None else out
        x2, y2 = input.reshape(R, D), y.reshape(R, D)  # R,D  R,D
        run(partial(_forward_loop(D), x2, w, b, eps, y2, mean, rstd), ranges(R, D))
        return y, mean.reshape(batch), rstd.reshape(batch)
    order = memory.memory_order(input, len(shape), out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input)
        return memory.forward(layer_norm_forward, order, xp, input, (shape, weight, bias, eps), out)
    return _layer_norm_forward(input, shape, R, w, b, eps, mean, rstd, ct, out)


@no_fp_warnings
def _layer_norm_forward(
    input: np.ndarray,
    shape: Shape,
    R: int,
    w: np.ndarray,
    b: np.ndarray,
    eps: float,
    mean: np.ndarray,
    rstd: np.ndarray,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``layer_norm_forward`` staged and split over the threads."""
    D = w.shape[0]
    y = output(out, input.shape, input.dtype, (R, D), (input,), contiguous=True)  # *,*shape
    src = Source(input, *row_layout(input, len(shape)), ct)
    dst = Target(y, R, D, ct)
    B = block_size((src,), (dst,), R, D, ct)
    loop = _forward_loop(D)

    def task(start: int, stop: int) -> None:
        xbuf, ybuf = src.buffer(B), dst.buffer(B)
        for a, e in spans(start, stop, B):
            yb = dst.block(a, e, ybuf)  # n,D
            loop(src.block(a, e, xbuf), w, b, eps, yb, mean[a:e], rstd[a:e], 0, e - a)
            dst.done(a, e, yb)

    run(task, ranges(R, D))
    batch = _batch(input, shape)
    return finish(y, out), mean.reshape(batch), rstd.reshape(batch)  # out, (*), (*)


@specialized("layer_norm_backward", NUMPY, kernels="numba")
@no_fp_warnings
def layer_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    shape: Shape,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """LayerNorm backward: one visit per row (``loops.layer_norm_backward``); dweight and
    dbias from per-thread float64 partial sums added in thread order."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean, rstd))
    if input.size == 0 or not compiled(ct):
        return _fallback("layer_norm_backward", xp, grad_output, input, shape, mean, rstd, weight, bias, out)
    order = memory.rows_order(len(shape), input, grad_output, out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input or gradient)
        saved, params = (mean, rstd), (weight, bias)
        return memory.backward(layer_norm_backward, order, xp, grad_output, input, shape, saved, params, out)
    D = prod(shape)
    R = input.size // D
    mean_c = writable(per_row(mean, R, ct, "mean"))  # R
    rstd_c = writable(per_row(rstd, R, ct, "rstd"))  # R
    if _extreme_spread(rstd_c, ct):  # dy * (x - mean) or rstd^2 would leave ct in the loops
        return _fallback("layer_norm_backward", xp, grad_output, input, shape, mean, rstd, weight, bias, out)
    w = param_or(weight, D, ct, 1.0)  # D
    sums = weight is not None or bias is not None
    if direct(ct, out, input, grad_output):  # no staging: each thread's rows in one call
        dx = np.empty(input.shape, dtype=ct) if out is None else out
        x2, dy2, dx2 = input.reshape(R, D), grad_output.reshape(R, D), dx.reshape(R, D)  # R,D each

        def rows(start: int, stop: int) -> Partials:
            dw, db, pw, pb = _partials(D if sums else 0, ct, 2)  # D, D float64; D, D ct
            loops.layer_norm_backward(dy2, x2, mean_c, rstd_c, w, dx2, dw, db, pw, pb, sums, 0, start, stop)
            return np.add(dw, pw, out=dw), np.add(db, pb, out=db)

        partials = run(rows, ranges(R, D))
    else:
        dx, src_x, src_dy, dst, B = _staged_backward(grad_output, input, shape, R, D, ct, out)

        def task(start: int, stop: int) -> Partials:
            xbuf, dybuf, obuf = src_x.buffer(B), src_dy.buffer(B), dst.buffer(B)
            dw, db, pw, pb = _partials(D if sums else 0, ct, 2)  # D, D float64; D, D ct
            for a, e in spans(start, stop, B):
                xb, dyb = src_x.block(a, e, xbuf), src_dy.block(a, e, dybuf)  # n,D  n,D
                ob = dst.block(a, e, obuf)  # n,D
                loops.layer_norm_backward(
                    dyb, xb, mean_c[a:e], rstd_c[a:e], w, ob, dw, db, pw, pb, sums, a, 0, e - a
                )
                dst.done(a, e, ob)
            return np.add(dw, pw, out=dw), np.add(db, pb, out=db)

        partials = run(task, ranges(R, D))
        dx = finish(dx, out)
    dweight = dbias = None
    if sums:
        dweight, dbias = partials[0]
        for pw, pb in partials[1:]:  # in thread order
            dweight, dbias = dweight + pw, dbias + pb
    return dx, grad_as(dweight, weight), grad_as(dbias, bias)


# --- RMSNorm -----------------------------------------------------------------------------


@specialized("rms_norm_forward", NUMPY, kernels="numba")
@no_fp_warnings
def rms_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    shape: Shape,
    weight: np.ndarray | None,
    eps: float | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm forward: one visit per row (``loops.rms_norm_forward``)."""
    ct = np.dtype(work_dtype(xp, input, weight))  # float32 at least
    if input.size == 0 or not compiled(ct):
        return _fallback("rms_norm_forward", xp, input, shape, weight, eps, out)
    eps_value = default_eps(xp, input) if eps is None else eps
    D = prod(shape)
    R = input.size // D
    w = param_or(weight, D, ct, 1.0)  # D
    rstd = np.empty(R, dtype=ct)  # R
    if direct(ct, out, input):  # no staging
        y = np.empty(input.shape, dtype=ct) if out is None else out
        x2, y2 = input.reshape(R, D), y.reshape(R, D)  # R,D  R,D
        run(partial(loops.rms_norm_forward, x2, w, eps_value, y2, rstd), ranges(R, D))
        return y, rstd.reshape(_batch(input, shape))
    order = memory.memory_order(input, len(shape), out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input)
        return memory.forward(rms_norm_forward, order, xp, input, (shape, weight, eps), out)
    y = output(out, input.shape, input.dtype, (R, D), (input,), contiguous=True)
    src = Source(input, *row_layout(input, len(shape)), ct)
    dst = Target(y, R, D, ct)
    B = block_size((src,), (dst,), R, D, ct)

    def task(start: int, stop: int) -> None:
        xbuf, ybuf = src.buffer(B), dst.buffer(B)
        for a, e in spans(start, stop, B):
            yb = dst.block(a, e, ybuf)  # n,D
            loops.rms_norm_forward(src.block(a, e, xbuf), w, eps_value, yb, rstd[a:e], 0, e - a)
            dst.done(a, e, yb)

    run(task, ranges(R, D))
    return finish(y, out), rstd.reshape(_batch(input, shape))


@specialized("rms_norm_backward", NUMPY, kernels="numba")
@no_fp_warnings
def rms_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    shape: Shape,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """RMSNorm backward: one visit per row (``loops.rms_norm_backward``); dweight from
    per-thread float64 partial sums added in thread order."""
    ct = np.dtype(work_dtype(xp, input, weight, rstd))
    if input.size == 0 or not compiled(ct):
        return _fallback("rms_norm_backward", xp, grad_output, input, shape, rstd, weight, out)
    order = memory.rows_order(len(shape), input, grad_output, out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input or gradient)
        return memory.backward(
            rms_norm_backward, order, xp, grad_output, input, shape, (rstd,), (weight,), out
        )
    D = prod(shape)
    R = input.size // D
    rstd_c = writable(per_row(rstd, R, ct, "rstd"))  # R
    if _extreme_spread(rstd_c, ct):  # dy * x or rstd^2 would leave ct in the loops
        return _fallback("rms_norm_backward", xp, grad_output, input, shape, rstd, weight, out)
    w = param_or(weight, D, ct, 1.0)  # D
    sums = weight is not None
    if direct(ct, out, input, grad_output):  # no staging: each thread's rows in one call
        dx = np.empty(input.shape, dtype=ct) if out is None else out
        x2, dy2, dx2 = input.reshape(R, D), grad_output.reshape(R, D), dx.reshape(R, D)  # R,D each

        def rows(start: int, stop: int) -> np.ndarray:
            dw, pw = _partials(D if sums else 0, ct, 1)  # D float64, D ct
            loops.rms_norm_backward(dy2, x2, rstd_c, w, dx2, dw, pw, sums, 0, start, stop)
            return np.add(dw, pw, out=dw)

        partials = run(rows, ranges(R, D))
    else:
        dx, src_x, src_dy, dst, B = _staged_backward(grad_output, input, shape, R, D, ct, out)

        def task(start: int, stop: int) -> np.ndarray:
            xbuf, dybuf, obuf = src_x.buffer(B), src_dy.buffer(B), dst.buffer(B)
            dw, pw = _partials(D if sums else 0, ct, 1)  # D float64, D ct
            for a, e in spans(start, stop, B):
                xb, dyb = src_x.block(a, e, xbuf), src_dy.block(a, e, dybuf)  # n,D  n,D
                ob = dst.block(a, e, obuf)  # n,D
                loops.rms_norm_backward(dyb, xb, rstd_c[a:e], w, ob, dw, pw, sums, a, 0, e - a)
                dst.done(a, e, ob)
            return np.add(dw, pw, out=dw)

        partials = run(task, ranges(R, D))
        dx = finish(dx, out)
    dweight = None
    if sums:
        dweight = partials[0]
        for p in partials[1:]:  # in thread order
            dweight = dweight + p
    return dx, grad_as(dweight, weight)
