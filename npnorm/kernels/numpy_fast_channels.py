"""Fast NumPy kernels for BatchNorm, InstanceNorm and GroupNorm (forward and backward).

Same signatures and results (to rounding) as the generic kernels in
``npnorm.functional.batch_norm`` / ``instance_norm`` / ``group_norm``; registered for
NumPy arrays as the ``"numpy"`` kernel family.

Layout. An input of shape (N, C, *spatial) is viewed as rows, S = prod(spatial):

* BatchNorm, and InstanceNorm with running statistics: ``R = N*C`` rows of ``S``
  values, row ``r`` being sample ``r // C``, channel ``r % C``;
* GroupNorm with G groups of ``k = C/G`` channels: ``R = N*G`` *group rows* of
  ``L = k*S`` values, each made of ``k`` channel rows of ``S`` values (InstanceNorm
  with input statistics is the case ``G = C``, ``k = 1``).

The rows are processed in blocks of about ``_blocks.BLOCK_BYTES`` (whole rows; at
least one), split into one chunk per thread (``_blocks.run_chunks``). A block is read
from memory once per sweep; the several NumPy calls on it then run from cache, each writing into
the output block or a per-thread scratch block (``out=``). Besides the outputs a
kernel holds a few blocks per thread and a few arrays of one value per row: no
full-size temporary. Per-channel values reach a block through a ``_Ring`` (a slice,
no gather), and per-row broadcasts run unbuffered (``loop_mode`` in ``_blocks``).

The passes ("sweep": one read of the inputs from memory):

* GroupNorm / InstanceNorm forward, one sweep: per group row ``mean = sum(x)/L``,
  ``xc = x - mean`` (in the output block), ``var = dot(xc, xc)/L`` (two-pass, from
  cache), then ``y = xc * (rstd*w_c) + b_c`` per channel row, in place.
* GroupNorm / InstanceNorm backward, one sweep: per channel row ``sum(dy)`` and
  ``dot(dy, x - mean)``, combined per group row with the weights into ``sum(g)`` and
  ``sum(g*(x - mean))`` (``g = dy*w``), then
  ``dx = rstd*w_c*dy - rstd^3*mean(g*(x - mean))*(x - mean) - rstd*mean(g)``.
* BatchNorm forward, two sweeps: per row the mean, its rounding residual and
  ``M2 = sum((x - mean)^2)``, merged over the N rows of a channel with Chan et al.'s
  formula for equal counts (``mean_c`` = mean of the row means,
  ``M2_c = sum(M2) + S*sum((mean_r - mean_c)^2)``, in float64: as exact as a
  two-pass variance over the channel); then ``y = (x - mean_c)*(rstd_c*w_c) + b_c``.
* BatchNorm backward, two sweeps: per row ``sum(dy)`` and ``dot(dy, x - mean_c)``,
  summed per channel (the samples in float64); then ``dx = a_c*(dy - d_c) + b_c*(x - mean_c)``,
  ``d_c = mean(dy)``: dy centred before it is scaled, as PyTorch's kernel does.
* Running statistics (BatchNorm eval, InstanceNorm without input statistics): one
  sweep ``y = (x - mean_c)*(rstd_c*w_c) + b_c``; backward ``dx = rstd_c*w_c*dy``,
  with the sums for dweight/dbias in the same sweep.
* BatchNorm on input of one value per channel and sample (BatchNorm1d's (N, C)) or
  channels-last input (and InstanceNorm's running-statistics mode on the latter): the
  same passes over its (M, C) columns (``numpy_fast_columns``), the output and dx in
  the input's layout. Short rows of 2 to ``SHORT_ROW`` values take float64 statistics
  over blocks of samples (``_short_channel_moments``).
* GroupNorm and InstanceNorm (input statistics) on channels-last input (and gradient)
  with samples of ``numpy_fast_columns.SAMPLE_VALUES`` values and more: sample by sample
  over its (S, C) rows (``numpy_fast_columns.group_forward`` / ``_backward``), the output
  and dx in the input's layout; smaller samples go the rows' way, C-ordered.

When every mean is within ``FOLD_LIMIT`` standard deviations of 0 (``_foldable``),
the subtraction of the mean is folded into the constant term of an elementwise map
(``y = x*s + t``, ``dx = a*(dy - (d + b*mean/a)) + b*x``), one pass fewer for the same
accuracy to a few ulps; otherwise (a large common offset) the kernels centre first.
The backward's sums always take ``dy*(x - mean)``: ``sum(dy*x) - mean*sum(dy)`` sums
terms of one sign when dy has a common part (``loss = y.sum() + ...``), whose float32
partial sums lost up to ~sqrt(N*S)*|mean|/std ulps (dweight 15 times torch's error).

Per-row results are written to their slot of an (R,) array and reduced per channel
at the end in a fixed order, so that results are the same whatever the number of
threads, up to how BLAS groups the rows of a block; bitwise the same for a given
thread count.

float16 (and any input narrower than the computation dtype) is converted block by
block into scratch of the computation dtype, and the result converted on the way
out. Inputs that cannot be viewed as rows (Fortran order, some slicings) are copied
block by block, one sample at a time (small ones whole). Empty inputs go to the
generic kernels, and so does a backward whose rstd is so small (a spread beyond ~1e15
in float32) that the sweeps' coefficients would underflow (a huge spread:
``extreme_coefficients``). A single row longer than a block (GroupNorm with few, large
groups) is one block: memory then grows to a few such rows per thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._backend import Namespace, no_fp_warnings
from .._checks import cast, prod, work_dtype
from .._stats import less_centre
from ..functional._channels import running_update
from ..functional._dispatch import generic_kernel, specialized
from . import numpy_fast_columns as columns
from ._blocks import (
    SHORT_ROW,
    Rows,
    as_vector,
    block_rows,
    blocks,
    constant_rows,
    extreme_coefficients,
    filled,
    finish,
    grad_as,
    inv_rms,
    output,
    param,
    recentre,
    rowdot,
    rowsum,
    rowsumsq,
    run_chunks,
    scratch,
    stacked,
    view,
)

NS = "array_api_compat.numpy"

# A mean is folded into the constant term when within this many standard deviations of
# 0 (see ``_foldable``): the rounding error then grows by at most ~2*FOLD_LIMIT ulps.
FOLD_LIMIT = 4.0


# --- geometry and per-row values ----------------------------------------------------------


def _rows(a: np.ndarray, G: int, ct: np.dtype[Any]) -> Rows:
    """An (N, C, *spatial) array as ``R = N*G`` rows of ``L = (C/G)*S`` values."""
    N, C = int(a.shape[0]), int(a.shape[1])
    return Rows(a, N, G, (C // G, *(int(d) for d in a.shape[2:])), ct)


class _Ring:
    """The per-row values of a per-channel (or per-group) array ``v`` of P entries for
    blocks of at most B rows, row ``r`` taking ``v[r % P]``: ``rows(start, n)`` is a
    slice of ``v`` tiled over ``B + P`` rows, so a block needs no gather."""

    def __init__(self, v: np.ndarray, B: int) -> None:
        self.P = int(v.shape[0])
        reps = -(-(B + self.P) // self.P)
        tiles = stacked(v, reps).reshape(reps * self.P, *v.shape[1:])  # reps*P,*v.shape[1:]
        self.tiled = tiles[: B + self.P]  # B+P,*v.shape[1:]

    def rows(self, start: int, n: int) -> np.ndarray:
        s = start % self.P
        return self.tiled[s : s + n]  # n,*v.shape[1:]

    def col(self, start: int, n: int) -> np.ndarray:
        """``rows`` of a 1-d ``v`` as an (n, 1) column, to broadcast along rows."""
        return self.rows(start, n)[:, None]  # n,1


def _ring(v: np.ndarray | None, B: int) -> _Ring | None:
    return None if v is None else _Ring(v, B)


def _foldable(mean: np.ndarray, rstd: np.ndarray, var: np.ndarray | None = None) -> bool:
    """Whether ``x*s + (t - mean*s)`` is as accurate (to a few ulps) as
    ``(x - mean)*s + t``, saving the subtraction pass: true when every mean is within
    ``FOLD_LIMIT`` standard deviations of 0, so that little cancels. Else (a large
    common offset, a near-constant row) the kernels centre first. The standard
    deviation is ``sqrt(var)`` where the variance is given, else ``1/rstd``, which eps
    inflates: with eps = 1 over a variance of 1e-6, a mean 1e3 deviations from 0 looked
    like one of 1 (y lost 10-50 ulps where PyTorch's lost 2-20)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        r = rstd if var is None else 1.0 / np.sqrt(var.astype(np.float64))  # 1/std
        return bool((np.abs(mean) * r <= FOLD_LIMIT).all())


# --- per-channel statistics (BatchNorm, and InstanceNorm/BatchNorm eval) -----------------
# Rows are the N*C (sample, channel) rows of S values; per-channel values reach a block
# of rows through a _Ring.


def _affine_sweep(
    rows: Rows,
    y: np.ndarray,
    ct: np.dtype[Any],
    center: _Ring | None,
    scale: _Ring,
    shift: _Ring | None,
) -> None:
    """One sweep ``y = (x - center_c) * scale_c + shift_c`` (``x`` itself without
    ``center``; no shift without ``shift``) over the (N*C, S) rows of x."""
    R, S = rows.R, rows.L
    y2 = view(y, (R, S))  # R,S
    assert y2 is not None
    B = block_rows(R, S, ct.itemsize)
    direct = y.dtype == ct

    def work(start: int, stop: int) -> None:
        xbuf = scratch(rows.staged, B, S, ct)  # B,S
        obuf = scratch(not direct, B, S, ct)  # B,S
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = rows.read(a, e, xbuf)  # n,S
            out = y2[a:e] if obuf is None else obuf[:n]  # n,S
            if center is not None:
                np.subtract(xb, center.col(a, n), out=out)  # n,S  x - mean
                np.multiply(out, scale.col(a, n), out=out)  # n,S
            else:
                np.multiply(xb, scale.col(a, n), out=out)  # n,S
            if shift is not None:
                np.add(out, shift.col(a, n), out=out)  # n,S
            if obuf is not None:
                np.copyto(y2[a:e], out, casting="same_kind")  # n,S  to the output dtype

    run_chunks(work, R, B, S)


def _affine_coefficients(
    ct: np.dtype[Any],
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    var: np.ndarray | None,
    spread: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """``(center, scale, shift)`` (C,) of ``ct`` (center and shift may be None) for
    ``y = (x - center_c) * scale_c + shift_c`` equal to ``(x - mean_c) * rstd_c * w_c + b_c``:
    the mean folded into the shift, ``y = x * scale_c + shift_c``, when ``_foldable`` by the
    variance ``spread`` (the batch's or the running one; by rstd where None).
    ``mean`` may be float64 (batch statistics): the sweep then subtracts its value
    rounded to ``ct`` and the shift takes what that rounding lost, so that a large
    common offset costs no accuracy and no pass. A channel of variance 0 (``var``, where
    given; finite rstd) is constant: its output is exactly the bias, as PyTorch's (scale
    0, shift the bias, whichever sweep runs)."""
    C = int(rstd.shape[0])
    w, b = param(weight, C, ct), param(bias, C, ct)  # C, C
    scale = rstd if w is None else rstd * w  # C, ct
    if var is not None:
        flat = (var == 0) & np.isfinite(rstd)  # C  constant channels (eps > 0)
        if flat.any():
            scale = np.where(flat, np.zeros_like(scale), scale)  # C
    scale64 = scale.astype(np.float64)  # C
    b64 = 0.0 if b is None else b.astype(np.float64)  # C
    mean64 = mean.astype(np.float64)  # C
    if _foldable(mean64, rstd, spread):
        return None, scale, (b64 - mean64 * scale64).astype(ct)  # C
    center = mean.astype(ct)  # C
    lost = mean64 - center.astype(np.float64)  # C: the rounding of the mean
    if b is None and not lost.any():
        return center, scale, None
    return center, scale, (b64 - lost * scale64).astype(ct)  # C


def _row_moments(rows: Rows, ct: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (N*C rows of S values), two-pass within the cached block: the mean
    ``m = sum(x)/S`` as rounded to ``ct``, its residual ``d = sum(x - m)/S`` (what the
    rounding lost: it matters when rows differ little relative to a large common
    offset) and ``M2 = sum((x - m)^2)``. Three (R,) arrays, of ``ct`` but ``M2`` in
    float64 (``rowsumsq``: finite for any finite row). A constant row, whose values all
    differ from ``m`` by the same rounding, gets exactly that as ``d`` and ``S*d^2`` as
    ``M2`` (``_constant_rows``): its channel's mean is then the constant and its variance
    0, exactly, as in PyTorch."""
    R, S = rows.R, rows.L
    mean = np.empty(R, dtype=ct)  # R
    resid = np.empty(R, dtype=ct)  # R
    m2 = np.empty(R, dtype=np.float64)  # R
    B = block_rows(R, S, ct.itemsize)

    def work(start: int, stop: int) -> None:
        xbuf = scratch(rows.staged, B, S, ct)  # B,S
        xcbuf = np.empty((B, S), dtype=ct)  # B,S
        inv = filled(S, ct, 1.0 / S)  # S
        for a, e in blocks(start, stop, B):
            xb = rows.read(a, e, xbuf)  # n,S
            xc = xcbuf[: e - a]  # n,S
            m = mean[a:e]  # n
            rowdot(xb, inv, out=m)  # row mean
            np.subtract(xb, m[:, None], out=xc)  # n,S
            rowdot(xc, inv, out=resid[a:e])  # n  residual of the mean
            rowsumsq(xc, out=m2[a:e])  # n  M2 about the rounded mean
            _constant_rows(xc, m, resid[a:e], m2[a:e])

    run_chunks(work, R, B, S)
    return mean, resid, m2


def _constant_rows(xc: np.ndarray, mean: np.ndarray, resid: np.ndarray, m2: np.ndarray) -> None:
    """For the (n,S) block ``xc = x - mean`` of ``_row_moments``: a constant row's ``xc`` is
    the mean's rounding ``d`` in every place, but ``sum(xc)/S`` need not round to ``d``;
    set ``resid = d`` and ``M2 = S*d^2`` (as ``_merge_rows`` subtracts it: the row's own
    M2 comes out 0). Rows of one value (S = 1) have ``xc`` 0 already."""
    S = xc.shape[1]
    if S == 1:
        return
    flat = constant_rows(xc, mean, m2 / S)
    if flat.size == 0:
        return
    d = xc[flat, 0]  # the rounding of each constant row's mean
    resid[flat] = d
    d64 = d.astype(np.float64)
    m2[flat] = S * (d64 * d64)  # the same rounding as _merge_rows's S * (rd * rd)


def _merge_rows(
    mean: np.ndarray, resid: np.ndarray, m2: np.ndarray, N: int, C: int, S: int
) -> tuple[np.ndarray, np.ndarray]:
    """Chan et al.'s parallel merge of the N row statistics of each channel (all rows
    have S values), in float64: ``numpy_fast_columns.merge_parts`` of the (N, C) row
    statistics."""
    return columns.merge_parts(mean.reshape((N, C)), resid.reshape((N, C)), m2.reshape((N, C)), S)


def _short_channel_moments(input: np.ndarray, N: int, C: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """The (C,) mean and biased variance, in float64, of an input whose channels hold few
    values per sample (``S <= SHORT_ROW``; one value: the columns path), where the
    row statistics of ``_row_moments`` would cost more than their rows: two passes over
    blocks of samples, the deviations from the float64 mean in float64 (a constant
    channel's are exactly 0)."""
    x = input.reshape((N, C, S))  # N,C,S
    B = block_rows(N, C * S, 8)  # samples per block of float64 deviations
    total = np.zeros(C, dtype=np.float64)  # C
    for a, e in blocks(0, N, B):
        total += np.add.reduce(x[a:e], axis=(0, 2), dtype=np.float64)  # C
    mean = total / (N * S)  # C
    m2 = np.zeros(C, dtype=np.float64)  # C
    for a, e in blocks(0, N, B):
        dev = np.subtract(x[a:e], mean[:, None], dtype=np.float64)  # n,C,S
        m2 += np.einsum("ncs,ncs->c", dev, dev)  # C
    return mean, m2 / (N * S)


def _grad_sums_sweep(
    rows_dy: Rows,
    rows_x: Rows,
    ct: np.dtype[Any],
    center: _Ring,
    need_dot: bool,
    dx: np.ndarray | None = None,
    a_coef: _Ring | None = None,
    *,
    xc_sums: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per row (N*C rows of S values): ``sum(dy)`` and, if ``need_dot``,
    ``sum(dy * (x - center_c))``; (R,) arrays. With ``xc_sums`` (R,) (and ``need_dot``),
    also ``sum(x - center_c)`` into it (``_batch_dx_coefficients`` centres xhat again).

    With ``dx`` and ``a_coef``, the same sweep writes ``dx = a_c * dy`` (the backward
    with running statistics).
    """
    R, S = rows_x.R, rows_x.L
    sdy = np.empty(R, dtype=ct)  # R
    sdx = np.empty(R, dtype=ct) if need_dot else None  # R
    dx2 = None if dx is None else view(dx, (R, S))  # R,S
    B = block_rows(R, S, ct.itemsize)
    direct = dx is None or dx.dtype == ct

    def work(start: int, stop: int) -> None:
        dybuf = scratch(rows_dy.staged, B, S, ct)  # B,S
        xbuf = scratch(need_dot and rows_x.staged, B, S, ct)  # B,S
        xcbuf = scratch(need_dot, B, S, ct)  # B,S
        obuf = scratch(dx2 is not None and not direct, B, S, ct)  # B,S
        ones = filled(S, ct, 1.0)  # S
        for a, e in blocks(start, stop, B):
            n = e - a
            dyb = rows_dy.read(a, e, dybuf)  # n,S
            rowsum(dyb, ones, out=sdy[a:e])  # n  sum(dy)
            if sdx is not None:
                assert xcbuf is not None
                xs = np.subtract(rows_x.read(a, e, xbuf), center.col(a, n), out=xcbuf[:n])  # n,S  x - mean
                rowdot(dyb, xs, out=sdx[a:e])  # n
                if xc_sums is not None:
                    rowsum(xs, ones, out=xc_sums[a:e])  # n  sum(x - mean)
            if dx2 is not None and a_coef is not None:
                out = dx2[a:e] if obuf is None else obuf[:n]  # n,S
                np.multiply(dyb, a_coef.col(a, n), out=out)  # n,S
                if obuf is not None:
                    np.copyto(dx2[a:e], out, casting="same_kind")  # n,S

    run_chunks(work, R, B, S)
    return sdy, sdx


def _dx_sweep(
    rows_dy: Rows,
    rows_x: Rows,
    dx: np.ndarray,
    ct: np.dtype[Any],
    center: _Ring | None,
    a_coef: _Ring,
    b_coef: _Ring,
    d_coef: _Ring,
) -> None:
    """One sweep ``dx = a_c*(dy - d_c) + b_c*(x - center_c)`` (``x`` itself without
    ``center``) over the (N*C, S) rows: dy centred before it is scaled."""
    R, S = rows_x.R, rows_x.L
    dx2 = view(dx, (R, S))  # R,S
    assert dx2 is not None
    B = block_rows(R, S, ct.itemsize)
    direct = dx.dtype == ct

    def work(start: int, stop: int) -> None:
        xbuf = scratch(rows_x.staged, B, S, ct)  # B,S
        dybuf = scratch(rows_dy.staged, B, S, ct)  # B,S
        tbuf = np.empty((B, S), dtype=ct)  # B,S
        obuf = scratch(not direct, B, S, ct)  # B,S
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = rows_x.read(a, e, xbuf)  # n,S
            dyb = rows_dy.read(a, e, dybuf)  # n,S
            t = tbuf[:n]  # n,S
            out = dx2[a:e] if obuf is None else obuf[:n]  # n,S
            if center is not None:
                np.subtract(xb, center.col(a, n), out=t)  # n,S  x - mean
                np.multiply(t, b_coef.col(a, n), out=t)  # n,S
            else:
                np.multiply(xb, b_coef.col(a, n), out=t)  # n,S
            np.subtract(dyb, d_coef.col(a, n), out=out)  # n,S
            np.multiply(out, a_coef.col(a, n), out=out)  # n,S
            np.add(out, t, out=out)  # n,S
            if obuf is not None:
                np.copyto(dx2[a:e], out, casting="same_kind")  # n,S

    run_chunks(work, R, B, S)


class CoefficientOverflow(Exception):
    """Raised by ``_batch_dx_coefficients`` (before any write) and ``_group_backward`` where a
    coefficient of dx is beyond the computation dtype's range though the sums are finite
    (``rstd^3*sum(g*(x - mean))`` with a tiny spread and a large weight or gradient: inf,
    then inf and NaN in dx), or where the sums are not finite (an infinite or NaN dy or x:
    the folded coefficients add inf to -inf, so a whole channel or group of dx came out NaN
    where the reference and PyTorch give +-inf): the caller runs the generic kernel instead."""


def _require_finite(*sums: np.ndarray) -> None:
    """Raise ``CoefficientOverflow`` where a backward's sums are not finite (an infinite or
    NaN dy or x): the generic kernel then gives the reference's infinities, where the
    folded coefficients would add inf to -inf."""
    if not all(np.isfinite(a).all() for a in sums):
        raise CoefficientOverflow


def _batch_dx_sweep(
    rows_dy: Rows,
    rows_x: Rows,
    dx: np.ndarray,
    ct: np.dtype[Any],
    coefs: tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray],
    B: int,
) -> None:
    """BatchNorm's training dx in one sweep over the rows, with the coefficients
    ``(center, a, b, d)`` of ``_batch_dx_coefficients``."""
    center, *abd = coefs
    _dx_sweep(rows_dy, rows_x, dx, ct, _ring(center, B), *(_Ring(c, B) for c in abd))


def _centred_dot(
    sum_dy: np.ndarray, sum_dyxc: np.ndarray, sum_xc: np.ndarray | None, count: float
) -> np.ndarray:
    """``sum(dy*(x - mean - xi))`` (C,) float64, ``xi = sum_xc/count`` the mean of ``x - mean``
    that the saved mean's rounding left: the sums of xhat centred again (``sum_dyxc`` itself
    where ``sum_xc`` is None, or where the shift is not finite: an inf in dy)."""
    return sum_dyxc if sum_xc is None else less_centre(np, sum_dyxc, sum_xc / count, sum_dy)


def _batch_dx_coefficients(
    ct: np.dtype[Any],
    m: np.ndarray,
    r: np.ndarray,
    w: np.ndarray | None,
    sum_dy: np.ndarray,
    sum_dyxc: np.ndarray,
    count: float,
    fold: bool,
    *,
    sum_xc: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """BatchNorm's training ``dx = a*(dy - d) + b*(x - mean)`` from the (C,) sums of
    ``dy`` and ``dy*(x - mean)`` over ``count`` values per channel: ``(center, a, b, d)``
    (C,) of ``ct``, ``a = rstd*w``, ``b = -rstd^3*w*sum(dy*(x - mean))/count``, ``d =
    sum(dy)/count`` (``b``, ``d`` formed in float64: ``rstd^3`` underflows float32 for
    huge inputs), ``center`` the mean. dy is centred before it is scaled, as PyTorch's
    kernel does (as ``a*dy + c``, a common part of dy of 1e3 over a spread of 1 left
    ``a*dy``'s rounding in dx: 3-6 times PyTorch's error). With ``fold`` the mean moves
    into ``d`` and the sweep reads ``x`` itself (``center`` None): ``b*(x - mean) = b*x -
    a*(b*mean/a)``. With ``sum_xc`` (C,), the sum of ``x - mean``, xhat is centred again
    first, as the reference's ``centred_again`` does: the saved mean is rounded to
    ``ct``, so ``x - mean`` has a mean ``xi``, which comes out of the sum of ``dy*(x -
    mean)`` (``- xi*sum(dy)``), and ``b*xi`` moves into ``d``. Raises
    ``CoefficientOverflow`` (before any write) where ``b`` is beyond ``ct``'s range, or
    where a sum is not finite."""
    _require_finite(sum_dy, sum_dyxc, *(() if sum_xc is None else (sum_xc,)))
    a_coef = r if w is None else r * w  # C
    wv = 1.0 if w is None else w.astype(np.float64)
    r64 = r.astype(np.float64)  # C
    d64 = sum_dy / count  # C: mean(dy)
    if sum_xc is not None:
        xi = sum_xc / count  # C: mean(x - mean), what the mean's rounding left
        sum_dyxc = _centred_dot(sum_dy, sum_dyxc, sum_xc, count)  # C: sum(dy*(x - mean - xi))
        d64 = d64 - (r64 * sum_dyxc / count) * (r64 * xi)  # C: mean(dy*xhat) times xhat's mean
    b64 = -r64 * (r64 * (wv * sum_dyxc) / count) * r64  # C  (r*sum is O(1): no r^3 underflow)
    if fold:
        a64 = r64 * wv  # C
        safe = np.where(a64 == 0, 1.0, a64)  # a = 0: dx = b*(x - mean) with b = 0 too
        d64 = d64 + np.where(a64 == 0, 0.0, b64 * m / safe)  # C
    big = float(np.finfo(ct).max)
    with np.errstate(invalid="ignore"):
        if (np.isfinite(b64) & (np.abs(b64) > big)).any():  # (a finite float64 beyond ct)
            raise CoefficientOverflow
    return (None if fold else m), a_coef, b64.astype(ct), d64.astype(ct)


def _channel_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    ct: np.dtype[Any],
    batch_stats: bool,
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Backward from (C,) per-channel statistics: BatchNorm's (``batch_stats``: the
    statistics were the batch's), or the affine map's with running statistics.

    With batch statistics, ``M = N*S`` values per channel, ``g = dy*w``:
    ``dx = rstd*(g - mean(g) - xhat*mean(g*xhat)) = a*(dy - mean(dy)) + b*(x - mean)``
    with ``a = rstd*w``, ``b = -rstd^3*w*sum(dy*(x - mean))/M``: a sweep for the sums
    (per row, then over the samples in float64), then one for dx. With running
    statistics ``dx = a*dy``, in the sweep that takes the sums for dweight/dbias. (``b``
    and ``mean(dy)`` are formed in float64: ``rstd^3`` underflows float32 for huge inputs.)
    """
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    m = as_vector(mean, C, ct)  # C
    r = as_vector(rstd, C, ct)  # C
    w = param(weight, C, ct)  # C
    need_dot = batch_stats or weight is not None
    cols = columns.columns_of(out, input, grad_output)  # BatchNorm1d's (N, C), channels-last input
    if cols is not None:
        (x2, dy2), out2 = cols
        dx, dx2 = (
            (out, out2) if out is not None and out2 is not None else columns.new_like(input, input.dtype)
        )
        if batch_stats:
            fold = _foldable(m, r)  # (else: a large offset, and xhat is centred again)
            sum_xc = None if fold else np.empty(C)  # C float64: sum(x - mean)
            sum_dy, sum_dyxc = columns.grad_sums(dy2, x2, ct, m, need_dot, xc_sums=sum_xc)  # C, C float64
            assert sum_dyxc is not None
            coefs = _batch_dx_coefficients(ct, m, r, w, sum_dy, sum_dyxc, N * S, fold, sum_xc=sum_xc)
            columns.batch_dx(dy2, x2, dx2, ct, *coefs)
            sum_dyxc = _centred_dot(sum_dy, sum_dyxc, sum_xc, N * S)  # C: dweight's, xhat centred again
        else:  # dx = rstd*w*dy, written by the sums sweep
            sum_dy, sum_dyxc = columns.grad_sums(dy2, x2, ct, m, need_dot, dx2, r if w is None else r * w)
        return _channel_grads(dx, out, sum_dy, sum_dyxc, r, weight, bias)
    rows_x = _rows(input, C, ct)
    rows_dy = _rows(grad_output, C, ct)
    B = block_rows(rows_x.R, S, ct.itemsize)
    center = _Ring(m, B)  # the sums take dy*(x - mean) (see the module's docstring)
    dx = output(out, input.shape, input.dtype, (rows_x.R, S), (input, grad_output), contiguous=True)
    fold = not batch_stats or _foldable(m, r)  # (else: a large offset, and xhat is centred again)
    xc_rows = None if fold else np.empty(rows_x.R, dtype=ct)  # R  sum(x - mean)
    if batch_stats:
        sdy, sdx = _grad_sums_sweep(rows_dy, rows_x, ct, center, need_dot, xc_sums=xc_rows)
    else:  # dx = rstd*w*dy, written by the sums sweep
        dx_coef = _Ring(r if w is None else r * w, B)  # C
        sdy, sdx = _grad_sums_sweep(rows_dy, rows_x, ct, center, need_dot, dx, dx_coef)
    sum_dy = np.add.reduce(sdy.reshape((N, C)), axis=0, dtype=np.float64)  # C
    sum_dyxc = (  # C: sum(dy*(x - mean))
        None if sdx is None else np.add.reduce(sdx.reshape((N, C)), axis=0, dtype=np.float64)
    )
    if batch_stats:
        assert sum_dyxc is not None
        sum_xc = (  # C: sum(x - mean)
            None if xc_rows is None else np.add.reduce(xc_rows.reshape((N, C)), axis=0, dtype=np.float64)
        )
        # with fold, dx = a*(dy - d - b*mean/a) + b*x, one pass fewer
        coefs = _batch_dx_coefficients(ct, m, r, w, sum_dy, sum_dyxc, N * S, fold, sum_xc=sum_xc)
        _batch_dx_sweep(rows_dy, rows_x, dx, ct, coefs, B)
        sum_dyxc = _centred_dot(sum_dy, sum_dyxc, sum_xc, N * S)  # C: dweight's, xhat centred again
    return _channel_grads(dx, out, sum_dy, sum_dyxc, r, weight, bias)


def _channel_grads(
    dx: np.ndarray,
    out: np.ndarray | None,
    sum_dy: np.ndarray,
    sum_dyxc: np.ndarray | None,
    r: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(dx, dweight, dbias)`` from the (C,) sums of dy and dy*(x - mean), float64."""
    dweight = None if weight is None or sum_dyxc is None else sum_dyxc * r  # C
    dbias = None if bias is None else sum_dy  # C
    return finish(dx, out), grad_as(dweight, weight), grad_as(dbias, bias)


# --- per-group statistics (GroupNorm, InstanceNorm with input statistics) ----------------
# Rows are the N*G (sample, group) rows of L = k*S values; a block of n group rows is
# also viewed as n*k channel rows of S values for the per-channel affine map.


def _group_forward(
    input: np.ndarray,
    G: int,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    ct: np.dtype[Any],
    keep_var: bool = False,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Normalize each (sample, group) row over its L = k*S values, one sweep: per block
    ``mean = sum(x)/L``, ``xc = x - mean`` (in the output block), ``var = dot(xc, xc)/L``
    (with a large common offset, centred again on what the mean's rounding lost:
    ``recentre``), then ``y = xc * (rstd*w_c) + b_c`` in place.

    Returns ``(y, mean, rstd, var)``, the statistics (N*G,) arrays of ``ct``; ``var``
    (biased, float64) only when ``keep_var``. ``y`` is ``out`` when that was given.
    """
    C = int(input.shape[1])
    w = param(weight, C, ct)  # C
    b = param(bias, C, ct)  # C
    samples = columns.samples_of(out, input)  # channels-last input: its (N, S, C) samples
    if samples is not None:
        (x3,), out3 = samples
        y, y3 = (
            (out, out3) if out is not None and out3 is not None else columns.new_samples(input, input.dtype)
        )
        mean_s, rstd_s, var_s = columns.group_forward(x3, y3, G, w, b, eps, ct, keep_var)
        return finish(y, out), mean_s, rstd_s, var_s
    rows = _rows(input, G, ct)
    R, L, k = rows.R, rows.L, rows.tail[0]
    S = L // k
    y = output(out, input.shape, input.dtype, (R, L), (input,), contiguous=True)
    y2 = view(y, (R, L))  # R,L
    assert y2 is not None
    mean = np.empty(R, dtype=ct)  # R
    rstd = np.empty(R, dtype=ct)  # R
    var = np.empty(R, dtype=np.float64) if keep_var else None  # R
    B = block_rows(R, L, ct.itemsize)
    w_ring = None if w is None else _Ring(w.reshape((G, k)), B)  # group row -> its k weights
    b_ring = None if b is None else _Ring(b.reshape((G, k)), B)
    direct = y.dtype == ct

    def work(start: int, stop: int) -> None:
        xbuf = scratch(rows.staged, B, L, ct)  # B,L
        obuf = scratch(not direct, B, L, ct)  # B,L
        inv = filled(L, ct, 1.0 / L)  # L
        vbuf = np.empty(B)  # B  the rows' variances, where var is not kept
        scale = np.empty((B, k), dtype=ct)  # B,k
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = rows.read(a, e, xbuf)  # n,L
            out = y2[a:e] if obuf is None else obuf[:n]  # n,L
            out_c = out.reshape(n * k, S)  # n*k,S  channel rows
            m, r = mean[a:e], rstd[a:e]  # n, n
            rowdot(xb, inv, out=m)  # mean, rounded to ct
            np.subtract(xb, m[:, None], out=out)  # n,L  xc = x - mean
            v = vbuf[:n] if var is None else var[a:e]  # n
            inv_rms(out, L, eps, out=r, var=v)  # rstd and var
            recentre(out, m, r, v, inv, eps)  # a large common offset, a constant row: centred on the
            # true mean
            if w_ring is None:
                np.multiply(out, r[:, None], out=out)  # n,L  xhat
            else:
                sc = np.multiply(w_ring.rows(a, n), r[:, None], out=scale[:n])  # n,k  rstd*w
                np.multiply(out_c, sc.reshape(n * k, 1), out=out_c)  # n*k,S
            if b_ring is not None:
                np.add(out_c, b_ring.rows(a, n).reshape(n * k, 1), out=out_c)  # n*k,S
            if obuf is not None:
                np.copyto(y2[a:e], out, casting="same_kind")  # n,L  to the output dtype

    run_chunks(work, R, B, S)
    return finish(y, out), mean, rstd, var


def _group_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    G: int,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    ct: np.dtype[Any],
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Backward of ``_group_forward`` (batch statistics), one sweep.

    Per block of group rows, with ``xs = x - mean`` (centred first: see the module's
    docstring on the backward's sums) and ``d = mean(xs)`` over the group row (what the
    float32 mean's rounding lost, up to an ulp of it: a dy of common part 1 would
    multiply it by the row's length):

    * per channel row ``sum(dy)`` and ``sum(dy*(xs - d))``;
    * per group row, with ``g = dy*w``: ``sg = sum(g)``, ``sgx = sum(g*(x - mean))``;
    * ``dx = (rstd*w_c)*dy + b*(xs - d) + c``, ``b = -rstd^3*sgx/L``, ``c = -rstd*sg/L``.

    The per-row factors are computed for all rows before the sweep. dweight and
    dbias are the per-channel sums over samples of ``rstd*sum(dy*(x - mean))`` and
    ``sum(dy)``, reduced at the end from (N*C,) per-channel-row arrays.
    """
    N, C = int(input.shape[0]), int(input.shape[1])
    m_all = as_vector(mean, N * G, ct)  # N*G
    r_all = as_vector(rstd, N * G, ct)  # N*G
    w = param(weight, C, ct)  # C
    samples = columns.samples_of(out, input, grad_output)  # channels-last input and gradient
    if samples is not None:
        (x3, dy3), out3 = samples
        dx, dx3 = (
            (out, out3) if out is not None and out3 is not None else columns.new_samples(input, input.dtype)
        )
        sums = columns.group_backward(dy3, x3, dx3, G, m_all, r_all, w, ct)
        if sums is None:
            raise CoefficientOverflow
        sdy_s, sdx_s = sums  # N,C float64 each: sum(dy), sum(dy*(x - mean))
        _require_finite(sdy_s, sdx_s)
        dweight_s = None
        if weight is not None:
            dweight_s = np.sum(sdx_s * np.repeat(r_all.reshape((N, G)), C // G, axis=1), axis=0)  # C
        dbias_s = None if bias is None else np.sum(sdy_s, axis=0)  # C
        return finish(dx, out), grad_as(dweight_s, weight), grad_as(dbias_s, bias)
    rows_x = _rows(input, G, ct)
    rows_dy = _rows(grad_output, G, ct)
    R, L, k = rows_x.R, rows_x.L, rows_x.tail[0]
    S = L // k
    r64 = r_all.astype(np.float64)  # R
    nb_all = (r64 * r64) / -L  # R: b = nb * (rstd * sgx) (float64; rstd * sgx is O(1))
    nc_all = r_all / -L  # R: c = nc * sg
    B = block_rows(R, L, ct.itemsize)
    w_ring = None if w is None else _Ring(w.reshape((G, k)), B)  # group row -> its k weights
    # d(dx)/d(dy) per channel row: rstd*w (R,k), or rstd per group row without weight
    a_all = None if w is None else r_all.reshape((R, 1)) * stacked(w.reshape((G, k)), N).reshape(R, k)
    dx = output(out, input.shape, input.dtype, (R, L), (input, grad_output), contiguous=True)
    dx2 = view(dx, (R, L))  # R,L
    assert dx2 is not None
    sdy_all = np.empty(R * k, dtype=ct)  # N*C  sum(dy) per channel row
    sdx_all = np.empty(R * k, dtype=ct)  # N*C  sum(dy * xs) per channel row
    direct = dx.dtype == ct

    def work(start: int, stop: int) -> None:
        xbuf = scratch(rows_x.staged, B, L, ct)  # B,L
        dybuf = scratch(rows_dy.staged, B, L, ct)  # B,L
        tbuf = np.empty((B, L), dtype=ct)  # B,L
        obuf = scratch(not direct, B, L, ct)  # B,L
        ones = filled(S, ct, 1.0)  # S
        inv_l = filled(L, ct, 1.0 / L)  # L
        sg_buf, sgx_buf, b_buf, c_buf, d_buf = (np.empty(B, dtype=ct) for _ in range(5))  # B each
        for a, e in blocks(start, stop, B):
            n = e - a
            xb = rows_x.read(a, e, xbuf)  # n,L
            dyb = rows_dy.read(a, e, dybuf)  # n,L
            m = m_all[a:e]  # n
            t = tbuf[:n]  # n,L
            xs = np.subtract(xb, m[:, None], out=t)  # n,L  x - mean
            dy_c = dyb.reshape(n * k, S)  # n*k,S  channel rows
            sdy, sdx = sdy_all[a * k : e * k], sdx_all[a * k : e * k]  # n*k, n*k
            d = rowdot(xs, inv_l, out=d_buf[:n])  # n  mean(xs): the true mean's excess
            rowsum(dy_c, ones, out=sdy)  # sum(dy)
            rowdot(dy_c, xs.reshape(n * k, S), out=sdx)  # sum(dy * xs)
            sdx -= np.repeat(d, k) * sdy  # n*k  sum(dy * (xs - d)): about the true mean
            sg, sgx, b_, c_ = sg_buf[:n], sgx_buf[:n], b_buf[:n], c_buf[:n]  # n each
            if w_ring is not None:
                wb = w_ring.rows(a, n)  # n,k
                rowdot(wb, sdy.reshape(n, k), out=sg)  # sum(g)
                rowdot(wb, sdx.reshape(n, k), out=sgx)  # sum(g * xs)
            else:
                np.add.reduce(sdy.reshape(n, k), axis=1, out=sg)
                np.add.reduce(sdx.reshape(n, k), axis=1, out=sgx)
            np.multiply(r_all[a:e], sgx, out=b_)
            np.multiply(nb_all[a:e], b_, out=b_)  # b
            np.multiply(nc_all[a:e], sg, out=c_)  # c
            _require_finite(sgx, sg)
            if np.isinf(b_).any() or np.isinf(c_).any():
                raise CoefficientOverflow  # finite sums, coefficients beyond ct
            np.subtract(c_, np.multiply(b_, d, out=sg), out=c_)  # b*(xs - d) + c = b*xs + (c - b*d)
            out = dx2[a:e] if obuf is None else obuf[:n]  # n,L
            if a_all is not None:
                out_c = out.reshape(n * k, S)  # n*k,S
                np.multiply(dy_c, a_all[a:e].reshape(n * k, 1), out=out_c)  # (rstd*w)*dy
            else:
                np.multiply(dyb, r_all[a:e, None], out=out)  # n,L  rstd*dy
            np.multiply(xs, b_[:, None], out=t)  # n,L
            np.add(out, t, out=out)  # n,L
            np.add(out, c_[:, None], out=out)  # n,L  dx
            if obuf is not None:
                np.copyto(dx2[a:e], out, casting="same_kind")  # n,L

    run_chunks(work, R, B, S)
    dweight = dbias = None
    if weight is not None:
        sdx3 = sdx_all.reshape((N, G, k))  # N,G,k  sum(dy * (x - mean))
        dxhat = sdx3 * r_all.reshape((N, G, 1))  # N,G,k  sum(dy * xhat)
        dweight = np.sum(dxhat.reshape((N, C)), axis=0)  # C
    if bias is not None:
        dbias = np.sum(sdy_all.reshape((N, C)), axis=0)  # C
    return finish(dx, out), grad_as(dweight, weight), grad_as(dbias, bias)


# --- BatchNorm ---------------------------------------------------------------------------


@specialized("batch_norm_forward", NS, kernels="numpy")
@no_fp_warnings
def batch_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    training: bool,
    momentum: float,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BatchNorm forward: the statistics sweep (training) then the normalize sweep."""
    if input.size == 0:  # nothing to sweep over: the generic kernel's results
        return generic_kernel("batch_norm_forward")(
            xp, input, running_mean, running_var, weight, bias, training, momentum, eps, out
        )
    ct = np.dtype(work_dtype(xp, input, weight, bias, running_mean, running_var))  # float32 at least
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    cols = columns.columns_of(out, input)  # BatchNorm1d's (N, C), channels-last input
    rows = _rows(input, C, ct) if cols is None else None
    new_mean, new_var = running_mean, running_var
    if training:
        if cols is not None:
            mean, var = columns.moments(cols[0][0], ct)  # C, C (biased), float64
        elif S <= SHORT_ROW:  # rows too short to pay for the row statistics
            mean, var = _short_channel_moments(input, N, C, S)  # C, C (biased), float64
        else:
            assert rows is not None
            mean, var = _merge_rows(*_row_moments(rows, ct), N, C, S)  # C, C (biased), float64
        if running_mean is not None and running_var is not None:
            n = N * S  # values per channel
            new_mean = running_update(xp, running_mean, mean, momentum)  # C
            new_var = running_update(xp, running_var, var * (n / (n - 1)), momentum)  # C
    else:
        assert running_mean is not None and running_var is not None
        mean = np.array(cast(xp, running_mean, ct), dtype=ct, copy=True)  # C
        var = cast(xp, running_var, ct)  # C
    rstd = (1.0 / np.sqrt(var + eps)).astype(ct)  # C
    # (mean: float64 when training)
    y = _normalized(input, out, cols, rows, ct, mean, rstd, weight, bias, var if training else None, var)
    return y, mean.astype(ct, copy=False), rstd, new_mean, new_var


def _normalized(
    input: np.ndarray,
    out: np.ndarray | None,
    cols: tuple[list[np.ndarray], np.ndarray | None] | None,
    rows: Rows | None,
    ct: np.dtype[Any],
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    var: np.ndarray | None = None,
    spread: np.ndarray | None = None,
) -> np.ndarray:
    """``y = (x - mean_c) * rstd_c * w_c + b_c`` from (C,) statistics, one sweep with the
    coefficients of ``_affine_coefficients`` (``var``: the batch variance, whose 0 marks a
    constant channel; ``spread``: the variance that decides the fold), in ``out`` where
    given: over the input's columns (``cols``, ``numpy_fast_columns``; the output in the
    input's layout) or its rows."""
    center, scale, shift = _affine_coefficients(ct, mean, rstd, weight, bias, var, spread)  # C each
    if cols is not None:
        (x2,), out2 = cols
        y, y2 = (out, out2) if out is not None and out2 is not None else columns.new_like(input, input.dtype)
        columns.affine(x2, y2, ct, center, scale, shift)
        return finish(y, out)
    assert rows is not None
    y = output(out, input.shape, input.dtype, (rows.R, rows.L), (input,))
    B = block_rows(rows.R, rows.L, ct.itemsize)
    _affine_sweep(rows, y, ct, _ring(center, B), _Ring(scale, B), _ring(shift, B))
    return finish(y, out)


@specialized("batch_norm_backward", NS, kernels="numpy")
@no_fp_warnings
def batch_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    training: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BatchNorm backward: the sums sweep then the dx sweep (training), or one sweep
    ``dx = rstd*w*dy`` (inference)."""
    if input.size == 0:
        return generic_kernel("batch_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, training, out
        )
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    # (huge: with running statistics too, dweight's dy*(x - mean) overflows ct)
    if extreme_coefficients(rstd, weight, ct):
        return generic_kernel("batch_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, training, out
        )
    try:
        return _channel_backward(grad_output, input, mean, rstd, weight, bias, ct, training, out)
    except CoefficientOverflow:
        pass  # the generic kernel runs below, the fast attempt's arrays freed with the exception
    return generic_kernel("batch_norm_backward")(
        xp, grad_output, input, mean, rstd, weight, bias, training, out
    )


# --- InstanceNorm ------------------------------------------------------------------------


@specialized("instance_norm_forward", NS, kernels="numpy")
@no_fp_warnings
def instance_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """InstanceNorm forward: GroupNorm's sweep with one channel per group, or the
    running statistics' sweep."""
    if input.size == 0:
        return generic_kernel("instance_norm_forward")(
            xp, input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, out
        )
    ct = np.dtype(work_dtype(xp, input, weight, bias, running_mean, running_var))  # float32 at least
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    new_mean, new_var = running_mean, running_var
    if use_input_stats:
        with_buffers = running_mean is not None and running_var is not None
        y, mean, rstd, var = _group_forward(input, C, weight, bias, eps, ct, with_buffers, out)
        if running_mean is not None and running_var is not None:
            assert var is not None
            # C: the average over the N instances (NaN for an empty batch, as in PyTorch)
            batch_mean = np.sum(mean.reshape((N, C)), axis=0, dtype=np.float64) / N  # C (float64:
            # means near the dtype's largest would overflow its sum)
            batch_var = np.sum(var.reshape((N, C)), axis=0) / N * (S / (S - 1))  # C, unbiased
            new_mean = running_update(xp, running_mean, batch_mean, momentum)  # C
            new_var = running_update(xp, running_var, batch_var, momentum)  # C
        return y, mean.reshape((N, C)), rstd.reshape((N, C)), new_mean, new_var
    assert running_mean is not None and running_var is not None
    m = np.array(cast(xp, running_mean, ct), dtype=ct, copy=True)  # C
    v = cast(xp, running_var, ct)  # C
    r = 1.0 / np.sqrt(v + eps)  # C
    cols = columns.columns_of(out, input)  # channels-last input
    rows = _rows(input, C, ct) if cols is None else None
    y = _normalized(input, out, cols, rows, ct, m, r, weight, bias, None, v)
    return y, m, r, new_mean, new_var


@specialized("instance_norm_backward", NS, kernels="numpy")
@no_fp_warnings
def instance_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    use_input_stats: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """InstanceNorm backward: GroupNorm's with one channel per group, or the affine
    map's ``dx = rstd_c*w_c*dy`` with running statistics."""
    if input.size == 0:
        return generic_kernel("instance_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, out
        )
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    # (huge: with running statistics too, dweight's dy*(x - mean) overflows ct)
    if extreme_coefficients(rstd, weight, ct):
        return generic_kernel("instance_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, out
        )
    if use_input_stats:
        C = int(input.shape[1])
        try:
            return _group_backward(grad_output, input, C, mean, rstd, weight, bias, ct, out)
        except CoefficientOverflow:
            pass  # the generic kernel runs below, the fast attempt's arrays freed with the exception
        return generic_kernel("instance_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, out
        )
    return _channel_backward(grad_output, input, mean, rstd, weight, bias, ct, False, out)


# --- GroupNorm ---------------------------------------------------------------------------


@specialized("group_norm_forward", NS, kernels="numpy")
@no_fp_warnings
def group_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    num_groups: int,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GroupNorm forward, one sweep over the (sample, group) rows."""
    if input.size == 0:
        return generic_kernel("group_norm_forward")(xp, input, num_groups, weight, bias, eps, out)
    ct = np.dtype(work_dtype(xp, input, weight, bias))  # float32 at least
    N = int(input.shape[0])
    y, mean, rstd, _ = _group_forward(input, num_groups, weight, bias, eps, ct, False, out)
    return y, mean.reshape((N, num_groups)), rstd.reshape((N, num_groups))


@specialized("group_norm_backward", NS, kernels="numpy")
@no_fp_warnings
def group_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    num_groups: int,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """GroupNorm backward, one sweep over the (sample, group) rows."""
    if input.size == 0:
        return generic_kernel("group_norm_backward")(
            xp, grad_output, input, num_groups, mean, rstd, weight, bias, out
        )
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    if extreme_coefficients(rstd, weight, ct):
        return generic_kernel("group_norm_backward")(
            xp, grad_output, input, num_groups, mean, rstd, weight, bias, out
        )
    try:
        return _group_backward(grad_output, input, num_groups, mean, rstd, weight, bias, ct, out)
    except CoefficientOverflow:
        pass  # the generic kernel runs below, the fast attempt's arrays freed with the exception
    return generic_kernel("group_norm_backward")(
        xp, grad_output, input, num_groups, mean, rstd, weight, bias, out
    )
