"""Fast NumPy kernels for LayerNorm and RMSNorm (forward and backward).

Same signatures and results (to rounding) as the generic kernels in
``npnorm.functional.layer_norm`` / ``rms_norm``; registered as the ``"numpy"`` kernel
family for NumPy arrays (``npnorm.use_kernels("numpy")`` selects them).

How they are fast (see ``_blocks`` for the blocking):

* the input is viewed as ``(R, D)`` rows and processed in blocks of rows that fit
  in L2 cache: x (and dy) are read from memory once and the output written once;
  the other arithmetic passes over a block run from cache;
* every NumPy call writes into a preallocated buffer (``out=``): per thread, a few
  block-sized scratch buffers reused for every block, or the output block itself;
* weight and bias are tiled to block shape once per thread, so multiplying by them
  is one contiguous loop rather than one loop call per row;
* row statistics are BLAS dot products per row (``vecdot``); column sums (dweight,
  dbias) are ``matmul`` products over 128 rows at a time (``add_vecmat``), added into
  per-thread float64 partial sums, those added in thread order at the end;
* per-row broadcasts (``block * rstd[:, None]``) run unbuffered (``loop_mode``);
* the rows are split over threads (``npnorm._threads``): NumPy releases the GIL
  inside ufuncs and these reductions.

The variance is two-pass, ``E[(x - E[x])^2]``, as in ``npnorm._stats``: a block's
rows are in cache, so the second pass costs little.

float16 (and any input narrower than the computation dtype) is converted block by
block into a float32 scratch block and the result converted back on the way out;
inputs that cannot be viewed as rows are copied block by block (``_blocks.Rows``).
A sum of squares that overflows float32 (values beyond ~1.8e19) is redone in float64
for its rows (``_blocks.inv_rms``), so finite input gives finite statistics.
Besides the outputs, memory use is a few blocks per thread plus one ``(D,)``
partial sum per thread for each of dweight and dbias.
"""

from __future__ import annotations

import numpy as np

from .._backend import Namespace, no_fp_warnings
from .._checks import Shape, default_eps, prod, work_dtype
from .._stats import RECENTRE_ABOVE
from ..functional._dispatch import generic_kernel, specialized
from . import _memory_order as memory
from ._blocks import (
    Rows,
    add_vecmat,
    block_rows,
    blocks,
    extreme_spread,
    filled,
    finish,
    grad_as,
    inv_rms,
    output,
    param,
    per_row,
    recentre,
    row_layout,
    rowmean,
    rowsum,
    run_chunks,
    scaled_rowdot,
    scratch,
    sum_in_order,
    tiled,
    view,
)

NS = "array_api_compat.numpy"

Partials = tuple[np.ndarray | None, np.ndarray | None]


def _batch(input: np.ndarray, shape: Shape) -> tuple[int, ...]:
    return tuple(input.shape[: input.ndim - len(shape)])


def _rows(a: np.ndarray, shape: Shape, ct: np.dtype) -> Rows:
    """``a`` (*, *shape) as rows of ``prod(shape)`` values."""
    return Rows(a, *row_layout(a, len(shape)), ct)


# --- LayerNorm ---------------------------------------------------------------------------


@specialized("layer_norm_forward", NS, kernels="numpy")
@no_fp_warnings
def layer_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    shape: Shape,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm forward, block by block.

    For each block of rows, in the computation dtype ``ct``:
    ``mean = rowsum(x) / D`` (``rowmean``: rows whose float32 sum overflows are summed again
    in float64); ``xc = x - mean`` (into the output block, or a scratch
    block when the output dtype differs); ``rstd = 1 / sqrt(rowdot(xc, xc) / D + eps)``
    (two-pass, from cache); with a large common offset, ``xc`` centred again on what the
    mean's rounding to ``ct`` lost (``recentre``); then ``xc *= rstd``, ``*= w``, ``+= b``
    in place. mean and rstd are written straight into the (R,) outputs.
    """
    order = memory.memory_order(input, len(shape), out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input)
        return memory.forward(layer_norm_forward, order, xp, input, (shape, weight, bias, eps), out)
    ct = np.dtype(work_dtype(xp, input, weight, bias))  # float32 at least
    D = prod(shape)
    x = _rows(input, shape, ct)  # R rows of D values
    R = x.R
    y = output(out, input.shape, input.dtype, (R, D), (input,))  # *,*shape
    y2 = view(y, (R, D))  # R,D view of y
    assert y2 is not None
    mean = np.empty(R, dtype=ct)  # R
    rstd = np.empty(R, dtype=ct)  # R
    w = param(weight, D, ct)  # D
    b = param(bias, D, ct)  # D
    ones = filled(D, ct, 1.0)  # D
    B = block_rows(R, D, ct.itemsize)
    # compute in the output block itself, where it is C-ordered: the row sums taken there
    # over a strided out= would be summed in another order than over a fresh output's
    direct = y.dtype == ct and y2.flags.c_contiguous

    def work(start: int, stop: int) -> None:
        xbuf = scratch(x.staged, B, D, ct)  # B,D
        wbuf = scratch(not direct, B, D, ct)  # B,D
        wt, bt = tiled(w, B), tiled(b, B)  # B,D  B,D
        inv = filled(D, ct, 1.0 / D)  # D
        var = np.empty(B)  # B  the rows' mean squares about their rounded means
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = x.read(a, e, xbuf)  # n,D
            out = y2[a:e] if wbuf is None else wbuf[:n]  # n,D
            m = mean[a:e]  # n
            r = rstd[a:e]  # n
            rowmean(xb, ones, out=m)  # mean, rounded to ct
            np.subtract(xb, m[:, None], out=out)  # n,D  x - mean
            inv_rms(out, D, eps, out=r, var=var[:n])  # rstd
            recentre(out, m, r, var[:n], inv, eps)  # a large common offset, a constant row: centred
            # on the true mean
            np.multiply(out, r[:, None], out=out)  # n,D  xhat
            if wt is not None:
                np.multiply(out, wt[:n], out=out)  # n,D
            if bt is not None:
                np.add(out, bt[:n], out=out)  # n,D
            if wbuf is not None:
                np.copyto(y2[a:e], out, casting="same_kind")  # n,D  to the input dtype

    run_chunks(work, R, B, D)
    batch = _batch(input, shape)
    return finish(y, out), mean.reshape(batch), rstd.reshape(batch)  # out, (*), (*)


def _centre_again(
    xc: np.ndarray, ones: np.ndarray, mean: np.ndarray, rstd: np.ndarray, sx: np.ndarray
) -> None:
    """Centre ``xc = x - mean`` again, in place, as the reference centres xhat: taken with
    the saved mean, rounded to the data's dtype, it has a mean ``d = mean(xc)`` that is not
    0 (on a nearly constant row with rstd ~300, 1e-4 of xhat in float32), which term 3 of
    dx would multiply by ``mean(g)`` and dweight would take times ``sum(dy)`` (float32 at
    offset 1e3 and spread 1e-3: 8e-3 of dweight). ``sx`` (n,) is scratch.

    As the forward's ``recentre``, only rows whose mean is more than ``RECENTRE_ABOVE``
    standard deviations from 0 (``|mean| * rstd``) are taken: elsewhere the rounding moves
    xhat by under 2 roundings of the dtype, and the extra pass would cost the backward
    ~10%. The rule is per row, so that a row's dx does not depend on its block. Rows whose
    ``d`` is not finite (an inf or NaN in x) are left as they are."""
    rows = np.abs(mean.astype(np.float64)) * rstd.astype(np.float64) > RECENTRE_ABOVE  # n
    if not rows.any():
        return
    d = rowsum(xc, ones, out=sx).astype(np.float64) / xc.shape[1]  # n  mean(xc)
    rows &= np.isfinite(d)
    xc[rows] -= d[rows, None].astype(xc.dtype)  # n,D (the rows far from 0)


@specialized("layer_norm_backward", NS, kernels="numpy")
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
    """LayerNorm backward, block by block.

    With ``xc = x - mean`` (so ``xhat = xc * rstd``), ``g = dy * w`` and, per row,
    ``mg = mean(g)`` and ``k = rstd * mean(g * xhat) = rstd^2 * rowsum(dy * xc * w) / D``:

    * ``dbias += colsum(dy)`` and ``dweight += rstd @ (dy * xc)`` (= colsum(dy * xhat)),
      into this thread's float64 partial sums;
    * ``dx = rstd * (g - mg - k * xc)``, built in place in the output block (or a
      scratch block when dx's dtype is not the computation dtype), ``xc`` centred again
      first on rows far from 0 (``_centre_again``), for dweight too.

    ``k``'s and ``mg``'s row sums are taken again in float64 for rows where they overflow
    the computation dtype (``scaled_rowdot``, ``rowmean``: float32 gradients near 1e37).

    The per-thread partials are added in thread order at the end.
    """
    order = memory.rows_order(len(shape), input, grad_output, out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input or gradient)
        saved, params = (mean, rstd), (weight, bias)
        return memory.backward(layer_norm_backward, order, xp, grad_output, input, shape, saved, params, out)
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean, rstd))
    D = prod(shape)
    x = _rows(input, shape, ct)  # R rows of D values
    dy = _rows(grad_output, shape, ct)  # R rows of D values
    R = x.R
    mean_c = per_row(mean, R, ct, "mean")  # R
    rstd_c = per_row(rstd, R, ct, "rstd")  # R
    if extreme_spread(rstd_c, ct):  # dy * (x - mean) or rstd^2 would leave ct: the generic kernel
        args = (xp, grad_output, input, shape, mean, rstd, weight, bias, out)
        return generic_kernel("layer_norm_backward")(*args)
    r64 = rstd_c.astype(np.float64)  # R
    rr = r64 * r64 / D  # R  rstd^2 / D, in float64: it underflows float32 for huge rows
    w = param(weight, D, ct)  # D
    ones = filled(D, ct, 1.0)  # D
    dx = output(out, input.shape, input.dtype, (R, D), (input, grad_output))  # *,*shape
    dx2 = view(dx, (R, D))  # R,D view of dx
    assert dx2 is not None
    B = block_rows(R, D, ct.itemsize)
    direct = dx.dtype == ct

    def work(start: int, stop: int) -> Partials:
        xbuf = scratch(x.staged, B, D, ct)  # B,D
        dybuf = scratch(dy.staged, B, D, ct)  # B,D
        xcbuf = np.empty((B, D), dtype=ct)  # B,D
        ubuf = scratch(w is not None, B, D, ct)  # B,D
        dbuf = scratch(not direct, B, D, ct)  # B,D
        wt = tiled(w, B)  # B,D
        dw_part = None if w is None else np.zeros(D)  # D float64: many blocks' column sums
        db_part = None if bias is None else np.zeros(D)  # D float64
        kbuf = np.empty(B, dtype=ct)  # B
        mgbuf = np.empty(B, dtype=ct)  # B
        sxbuf = np.empty(B, dtype=ct)  # B
        ones_b = filled(B, ct, 1.0)  # B
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = x.read(a, e, xbuf)  # n,D
            dyb = dy.read(a, e, dybuf)  # n,D
            r = rstd_c[a:e, None]  # n,1
            k, mg = kbuf[:n], mgbuf[:n]  # n  n
            xc = xcbuf[:n]  # n,D
            out = dx2[a:e] if dbuf is None else dbuf[:n]  # n,D
            np.subtract(xb, mean_c[a:e, None], out=xc)  # n,D  x - mean
            _centre_again(xc, ones, mean_c[a:e], rstd_c[a:e], sxbuf[:n])  # xhat centred again
            if db_part is not None:
                add_vecmat(ones_b[:n], dyb, db_part)  # D  += colsum(dy)
            if w is not None and wt is not None and ubuf is not None and dw_part is not None:
                u = ubuf[:n]  # n,D
                np.multiply(dyb, xc, out=u)  # n,D  dy * xc
                add_vecmat(rstd_c[a:e], u, dw_part)  # D  += colsum(dy * xhat)
                scaled_rowdot(u, w, rr[a:e], out=k)  # n  rstd * mean(g * xhat)
                rowmean(dyb, w, out=mg)  # n  mean(g)
                g = np.multiply(dyb, wt[:n], out=out)  # n,D
            else:
                scaled_rowdot(dyb, xc, rr[a:e], out=k)  # n  rstd * mean(g * xhat)
                rowmean(dyb, ones, out=mg)  # n  mean(g)
                g = dyb  # n,D
            np.multiply(xc, k[:, None], out=xc)  # n,D
            np.subtract(g, xc, out=out)  # n,D
            np.subtract(out, mg[:, None], out=out)  # n,D
            np.multiply(out, r, out=out)  # n,D  dx
            if dbuf is not None:
                np.copyto(dx2[a:e], out, casting="same_kind")  # n,D  to the input dtype
        return dw_part, db_part

    partials = run_chunks(work, R, B, D)
    dweight = sum_in_order([p[0] for p in partials])
    dbias = sum_in_order([p[1] for p in partials])
    return finish(dx, out), grad_as(dweight, weight), grad_as(dbias, bias)


# --- RMSNorm -----------------------------------------------------------------------------


@specialized("rms_norm_forward", NS, kernels="numpy")
@no_fp_warnings
def rms_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    shape: Shape,
    weight: np.ndarray | None,
    eps: float | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm forward, block by block: ``rstd = 1 / sqrt(rowdot(x, x) / D + eps)``
    then ``y = x * rstd * w`` in the output block (or a scratch block converted on
    the way out)."""
    order = memory.memory_order(input, len(shape), out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input)
        return memory.forward(rms_norm_forward, order, xp, input, (shape, weight, eps), out)
    ct = np.dtype(work_dtype(xp, input, weight))  # float32 at least
    eps_value = default_eps(xp, input) if eps is None else eps
    D = prod(shape)
    x = _rows(input, shape, ct)  # R rows of D values
    R = x.R
    y = output(out, input.shape, input.dtype, (R, D), (input,))  # *,*shape
    y2 = view(y, (R, D))  # R,D view of y
    assert y2 is not None
    rstd = np.empty(R, dtype=ct)  # R
    w = param(weight, D, ct)  # D
    B = block_rows(R, D, ct.itemsize)
    direct = y.dtype == ct

    def work(start: int, stop: int) -> None:
        xbuf = scratch(x.staged, B, D, ct)  # B,D
        wbuf = scratch(not direct, B, D, ct)  # B,D
        wt = tiled(w, B)  # B,D
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = x.read(a, e, xbuf)  # n,D
            out = y2[a:e] if wbuf is None else wbuf[:n]  # n,D
            r = rstd[a:e]  # n
            inv_rms(xb, D, eps_value, out=r)  # rstd
            np.multiply(xb, r[:, None], out=out)  # n,D  xhat
            if wt is not None:
                np.multiply(out, wt[:n], out=out)  # n,D
            if wbuf is not None:
                np.copyto(y2[a:e], out, casting="same_kind")  # n,D

    run_chunks(work, R, B, D)
    return finish(y, out), rstd.reshape(_batch(input, shape))  # out, (*)


@specialized("rms_norm_backward", NS, kernels="numpy")
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
    """RMSNorm backward, block by block.

    With ``xhat = x * rstd``, ``g = dy * w`` and, per row,
    ``k = rstd * mean(g * xhat) = rstd^2 * rowsum(dy * x * w) / D``:
    ``dweight += rstd @ (dy * x)`` (= colsum(dy * xhat)) into this thread's float64
    partial sum, and ``dx = rstd * (g - k * x)``, built in place in the output block. No mean
    is subtracted, so working with ``x`` rather than ``xhat`` loses nothing; ``k``'s row
    sums are taken again in float64 where they overflow (``scaled_rowdot``).
    """
    order = memory.rows_order(len(shape), input, grad_output, out)
    if order is not None:  # rows walked in memory order (a Fortran-ordered input or gradient)
        return memory.backward(
            rms_norm_backward, order, xp, grad_output, input, shape, (rstd,), (weight,), out
        )
    ct = np.dtype(work_dtype(xp, input, weight, rstd))
    D = prod(shape)
    x = _rows(input, shape, ct)  # R rows of D values
    dy = _rows(grad_output, shape, ct)  # R rows of D values
    R = x.R
    rstd_c = per_row(rstd, R, ct, "rstd")  # R
    if extreme_spread(rstd_c, ct):  # dy * x or rstd^2 would leave ct: the generic kernel
        return generic_kernel("rms_norm_backward")(xp, grad_output, input, shape, rstd, weight, out)
    r64 = rstd_c.astype(np.float64)  # R
    rr = r64 * r64 / D  # R  rstd^2 / D, in float64 (see layer_norm_backward)
    w = param(weight, D, ct)  # D
    dx = output(out, input.shape, input.dtype, (R, D), (input, grad_output))  # *,*shape
    dx2 = view(dx, (R, D))  # R,D view of dx
    assert dx2 is not None
    B = block_rows(R, D, ct.itemsize)
    direct = dx.dtype == ct

    def work(start: int, stop: int) -> np.ndarray | None:
        xbuf = scratch(x.staged, B, D, ct)  # B,D
        dybuf = scratch(dy.staged, B, D, ct)  # B,D
        ubuf = np.empty((B, D), dtype=ct)  # B,D
        dbuf = scratch(not direct, B, D, ct)  # B,D
        wt = tiled(w, B)  # B,D
        dw_part = None if w is None else np.zeros(D)  # D float64: many blocks' column sums
        kbuf = np.empty(B, dtype=ct)  # B
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = x.read(a, e, xbuf)  # n,D
            dyb = dy.read(a, e, dybuf)  # n,D
            k = kbuf[:n]  # n
            u = ubuf[:n]  # n,D
            out = dx2[a:e] if dbuf is None else dbuf[:n]  # n,D
            if w is not None and wt is not None and dw_part is not None:
                np.multiply(dyb, xb, out=u)  # n,D  dy * x
                add_vecmat(rstd_c[a:e], u, dw_part)  # D  += colsum(dy * xhat)
                scaled_rowdot(u, w, rr[a:e], out=k)  # n  rstd * mean(g * xhat)
                g = np.multiply(dyb, wt[:n], out=out)  # n,D
            else:
                scaled_rowdot(dyb, xb, rr[a:e], out=k)  # n  rstd * mean(g * xhat)
                g = dyb  # n,D
            np.multiply(xb, k[:, None], out=u)  # n,D
            np.subtract(g, u, out=out)  # n,D
            np.multiply(out, rstd_c[a:e, None], out=out)  # n,D  dx
            if dbuf is not None:
                np.copyto(dx2[a:e], out, casting="same_kind")  # n,D
        return dw_part

    partials = run_chunks(work, R, B, D)
    return finish(dx, out), grad_as(sum_in_order(partials), weight)
