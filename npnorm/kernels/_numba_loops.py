"""The compiled loops of the ``"numba"`` kernel family (LayerNorm/RMSNorm rows, and the
BatchNorm, InstanceNorm and GroupNorm channels), each fusing a layer's passes over a row
or a channel into one read of the data from memory.

Every loop works on a range of rows (or channels) ``[r0, r1)`` of C-ordered arrays of
the computation dtype (float32 or float64; the Python side stages anything else), so
that each compiles once per dtype. They release the GIL: the Python side splits the
rows over npnorm's thread pool (``npnorm._threads``), one range per thread, so that
npnorm.set_num_threads is the one thread control and the split is fixed by the thread
count (numba's own threading layer is not used).

Numerics:

* the forwards' statistics are two-pass over the cached row (the mean, then the sum of
  squared deviations; RMSNorm's is one sum of squares), and every row sum, the
  backwards' too, is accumulated in float64 whatever the data's dtype: a float32 row
  with a large common offset (mean 1e3 x spread) keeps float64's accuracy, and a finite
  row has finite statistics (the squares of float32 values beyond ~1.8e19 overflow
  float32, not float64);
* the forwards split the float64 mean into its value in the data's dtype and the
  remainder, ``(x - m_hi) - m_lo``, so that centring in float32 keeps the float64 mean's
  accuracy (the backwards centre with the saved mean, which is stored in the data's
  dtype, as the reference's is);
* the row sums are vectorized: the small ``_sum*`` helpers are compiled with
  ``fastmath={"reassoc"}`` (only reassociation: NaN and infinity behave as usual), so
  their partial sums run in SIMD lanes, in an order fixed by the compiled code (the same
  input gives bitwise the same sums);
* ``error_model="numpy"``: a division by zero gives inf or NaN as in NumPy, never an
  exception.

Everything in this file is compiled code: keep it to one file, because numba's on-disk
cache (``cache=True``) tracks the source file of each function, not the files its callees
live in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, uint64

# the options of every loop, and of the row sums (vectorized by reassociation)
_loop: Any = njit(cache=True, nogil=True, error_model="numpy")
_sum_loop: Any = njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})

# dweight/dbias of LayerNorm and RMSNorm are summed over rows in the data's dtype, and
# added into float64 partial sums after every row whose index in the input is a multiple
# of FLUSH_ROWS minus one (so that how a thread's rows are cut into calls does not change
# the sums).
FLUSH_ROWS = 16

# the values per chunk of the pipelined row loops (see there)
CHUNK = 256


# --- vectorized row sums (float64 accumulators) -----------------------------------------
#
# The sums over a span ``[lo, hi)`` of a row (the whole row: ``0, len``) loop over unsigned
# indices: numba wraps a negative signed index around (``a[-1]``), and that test, in a loop
# over ``range(lo, hi)``, keeps it from vectorizing (6x slower).


@_sum_loop
def _sum(a, lo, hi):  # type: ignore[no-untyped-def]
    """sum(a[lo:hi])."""
    t = 0.0
    for i in range(uint64(lo), uint64(hi)):
        t += a[i]
    return t


@_sum_loop
def _sum_sq_dev(a, lo, hi, m):  # type: ignore[no-untyped-def]
    """sum((a[lo:hi] - m)^2), ``m`` a float64."""
    t = 0.0
    for i in range(uint64(lo), uint64(hi)):
        d = a[i] - m
        t += d * d
    return t


@_sum_loop
def _sum_sq(a, lo, hi):  # type: ignore[no-untyped-def]
    """sum(a[lo:hi]^2), the squares in float64."""
    t = 0.0
    for i in range(uint64(lo), uint64(hi)):
        v = np.float64(a[i])
        t += v * v
    return t


@_sum_loop
def _sums_dy(dy, x, w, lo, hi, m_hi, m_lo):  # type: ignore[no-untyped-def]
    """``(sum(g), sum(g * (x - m)))`` over ``[lo, hi)`` with ``g = dy * w``,
    ``x - m = (x - m_hi) - m_lo``."""
    sg = 0.0
    sgx = 0.0
    for i in range(uint64(lo), uint64(hi)):
        g = dy[i] * w[i]
        sg += g
        sgx += g * ((x[i] - m_hi) - m_lo)
    return sg, sgx


@_sum_loop
def _sums_dy_scalar_w(dy, x, lo, hi, m_hi, m_lo):  # type: ignore[no-untyped-def]
    """``(sum(dy), sum(dy * (x - m)))`` over ``[lo, hi)`` of a channel row,
    ``x - m = (x - m_hi) - m_lo``."""
    s = 0.0
    sx = 0.0
    for i in range(uint64(lo), uint64(hi)):
        d = dy[i]
        s += d
        sx += d * ((x[i] - m_hi) - m_lo)
    return s, sx


@_sum_loop
def _sum_g_x(dy, x, w, lo, hi):  # type: ignore[no-untyped-def]
    """sum(dy * w * x) over ``[lo, hi)`` (RMSNorm's backward)."""
    t = 0.0
    for i in range(uint64(lo), uint64(hi)):
        t += (dy[i] * w[i]) * x[i]
    return t


# --- the output passes over a span ``[lo, hi)`` of a row -----------------------------------
#
# LayerNorm/RMSNorm rows, with a weight (and bias) per value; the channel rows of BatchNorm,
# InstanceNorm and GroupNorm, with a scale and shift per channel.


@_loop
def _norm_span(x, y, w, b, lo, hi, m_hi, m_lo, k):  # type: ignore[no-untyped-def]
    """``y = (x - m)*k*w + b`` over ``[lo, hi)`` (LayerNorm)."""
    for j in range(uint64(lo), uint64(hi)):
        y[j] = ((x[j] - m_hi) - m_lo) * k * w[j] + b[j]


@_loop
def _scale_span(x, y, w, lo, hi, k):  # type: ignore[no-untyped-def]
    """``y = x*k*w`` over ``[lo, hi)`` (RMSNorm)."""
    for j in range(uint64(lo), uint64(hi)):
        y[j] = x[j] * k * w[j]


@_loop
def _norm_dx_span(dy, x, dx, w, lo, hi, a, c1, m, c0):  # type: ignore[no-untyped-def]
    """``dx = a*(dy*w) + c1*xhat + c0``, ``xhat = (x - m)*a``, over ``[lo, hi)``."""
    for j in range(uint64(lo), uint64(hi)):
        dx[j] = a * (dy[j] * w[j]) + c1 * ((x[j] - m) * a) + c0


@_loop
def _norm_dx_sums_span(dy, x, dx, w, pw, pb, lo, hi, a, c1, m, c0):  # type: ignore[no-untyped-def]
    """``_norm_dx_span``, and ``dy*xhat``, ``dy`` added into ``pw``, ``pb``."""
    for j in range(uint64(lo), uint64(hi)):
        xh = (x[j] - m) * a
        d = dy[j]
        dx[j] = a * (d * w[j]) + c1 * xh + c0
        pw[j] += d * xh
        pb[j] += d


@_loop
def _scale_dx_span(dy, x, dx, w, lo, hi, a, c1):  # type: ignore[no-untyped-def]
    """``dx = a*(dy*w) + c1*xhat``, ``xhat = x*a``, over ``[lo, hi)`` (RMSNorm)."""
    for j in range(uint64(lo), uint64(hi)):
        dx[j] = a * (dy[j] * w[j]) + c1 * (x[j] * a)


@_loop
def _scale_dx_sums_span(dy, x, dx, w, pw, lo, hi, a, c1):  # type: ignore[no-untyped-def]
    """``_scale_dx_span``, and ``dy*xhat`` added into ``pw``."""
    for j in range(uint64(lo), uint64(hi)):
        d = dy[j]
        xh = x[j] * a
        dx[j] = a * (d * w[j]) + c1 * xh
        pw[j] += d * xh


@_loop
def _affine_span(x, y, lo, hi, m_hi, m_lo, sc, bc):  # type: ignore[no-untyped-def]
    """``y = (x - m)*sc + bc`` over ``[lo, hi)``."""
    for j in range(uint64(lo), uint64(hi)):
        y[j] = ((x[j] - m_hi) - m_lo) * sc + bc


@_loop
def _dx_span(dy, x, dx, lo, hi, a, k1, m, rc, k0):  # type: ignore[no-untyped-def]
    """``dx = a*dy + k1*xhat + k0``, ``xhat = (x - m)*rc``, over ``[lo, hi)``."""
    for j in range(uint64(lo), uint64(hi)):
        dx[j] = a * dy[j] + k1 * ((x[j] - m) * rc) + k0


@_loop
def _split(m, scratch):  # type: ignore[no-untyped-def]
    """``m`` (float64) as ``(m_hi, m_lo)`` in ``scratch``'s dtype: ``m_hi`` rounded,
    ``m_lo`` what the rounding lost."""
    scratch[0] = m
    scratch[1] = m - scratch[0]
    return scratch[0], scratch[1]


@_loop
def _flush(part, total):  # type: ignore[no-untyped-def]
    for j in range(part.shape[0]):
        total[j] += part[j]
        part[j] = 0


# --- pipelined rows: LayerNorm, RMSNorm, GroupNorm and InstanceNorm ---------------------
#
# Reading a row for its sums and then writing its output would run as two phases, each
# leaving memory half idle: the hardware does not fetch the next row in time on its own
# (rows of a few KB and more; 16 KB for LayerNorm at D = 4096, 12.5 KB for an
# InstanceNorm row of 56x56 float32). So these loops pipeline the rows: they visit a row
# in chunks of CHUNK values, and with each chunk of row r that they write they take the
# same chunk of the rows ahead (the forward of LayerNorm and GroupNorm: row r + 1's
# squared deviations, from cache, and row r + 2's sum, from memory; RMSNorm's forward: row
# r + 1's sum of squares; the backwards: row r + 1's sums). The loop starts one or two rows
# before r0 with the writes off while the pipeline fills (``_one_ahead``, ``_two_ahead``),
# so that every row's sums are taken by the same code, chunk by chunk in the same order,
# wherever a thread's range or a staged block begins: the results do not depend on how the
# rows are split.


@_loop
def _one_ahead(r, r0, r1):  # type: ignore[no-untyped-def]
    """Step r (from r0 - 1) of a pipeline over rows ``[r0, r1)`` that takes row r + 1's sums
    while it writes row r: ``(write, add, row, n)``, whether row r is written and whether
    row r + 1 is summed, the row to write (r0, a placeholder, while the pipeline fills) and
    the row to sum (the row to write where there is none)."""
    write = r >= r0
    add = r + 1 < r1
    row = r if write else r0
    return write, add, row, r + 1 if add else row


@_loop
def _two_ahead(r, r0, r1):  # type: ignore[no-untyped-def]
    """Step r (from r0 - 2) of a pipeline over rows ``[r0, r1)`` that takes row r + 1's
    squared deviations and row r + 2's sum while it writes row r: ``(write, dev, add,
    row, n1, n2)``, whether each of the three is done, and the rows (as in ``_one_ahead``:
    the row to write where a row is out of the range)."""
    write = r >= r0
    dev = r0 <= r + 1 < r1
    add = r + 2 < r1
    row = r if write else r0
    return write, dev, add, row, r + 1 if dev else row, r + 2 if add else row


@_loop
def _row_stats(m, q, L, eps, s):  # type: ignore[no-untyped-def]
    """A row's statistics from its float64 mean ``m`` and sum of squared deviations ``q``
    over ``L`` values: ``(rstd, m_hi, m_lo)``, rstd = 1/sqrt(q/L + eps) rounded to the
    data's dtype as it is stored, and the mean split as by ``_split`` (in ``s[0:3]``)."""
    s[2] = 1.0 / np.sqrt(q / L + eps)
    m_hi, m_lo = _split(m, s)
    return s[2], m_hi, m_lo


# --- LayerNorm and RMSNorm: rows of D values ----------------------------------------------


@_loop
def layer_norm_forward(x, w, b, eps, y, mean, rstd, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` of x (R,D): mean, rstd (R,) and ``y = (x - mean)*rstd*w + b``.
    Without weight/bias the caller passes ones/zeros (exact). Pipelined (see above):
    writing row r, it takes row r + 1's squared deviations and row r + 2's sum."""
    D = x.shape[1]
    s = np.empty(3, dtype=y.dtype)
    if r1 <= r0:
        return
    m = q = m1 = 0.0  # row r's mean and squared deviations, row r + 1's mean
    for r in range(r0 - 2, r1):
        write, dev, add, row, n1, n2 = _two_ahead(r, r0, r1)
        xr, yr, x1, x2 = x[row], y[row], x[n1], x[n2]
        k, m_hi, m_lo = _row_stats(m, q, D, eps, s)
        if write:
            mean[r] = m
            rstd[r] = k
        q1 = 0.0  # row r + 1's squared deviations, row r + 2's sum
        t2 = 0.0
        for lo in range(0, D, CHUNK):
            hi = min(lo + CHUNK, D)
            if add:
                t2 += _sum(x2, lo, hi)
            if dev:
                q1 += _sum_sq_dev(x1, lo, hi, m1)
            if write:
                _norm_span(xr, yr, w, b, lo, hi, m_hi, m_lo, k)
        m, q, m1 = m1, q1, t2 / D


@_loop
def layer_norm_backward(dy, x, mean, rstd, w, dx, dw, db, pw, pb, with_sums, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` (rows ``base + r`` of the input): ``dx = rstd*(g - mean(g) -
    xhat*mean(g*xhat))``, ``g = dy*w``, as ``dx = a*g + c1*xhat + c0`` with per-row
    ``a = rstd``, ``c1 = -rstd*mean(g*xhat)``, ``c0 = -rstd*mean(g)`` (each representable
    where rstd is: no rstd^3, which underflows float32 for huge rows). With
    ``with_sums``, ``sum_rows(dy*xhat)`` and ``sum_rows(dy)`` go into the partial sums
    ``pw``, ``pb`` (the data's dtype, (D,)), flushed into the float64 ``dw``, ``db``
    (see FLUSH_ROWS; the caller flushes what is left). Pipelined (see above): writing
    row r's dx, it takes row r + 1's sums."""
    D = x.shape[1]
    s = np.empty(3, dtype=dx.dtype)
    s[0] = 0.0
    zero = s[0]  # 0 in the data's dtype
    if r1 <= r0:
        return
    sg = sgx = 0.0  # row r's sum(g), sum(g*(x - mean))
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        xr, dyr, dxr, x1, dy1 = x[row], dy[row], dx[row], x[n], dy[n]
        m = mean[row]
        rs = np.float64(rstd[row])
        s[0] = rs
        s[1] = -rs * (sgx * rs / D)
        s[2] = -rs * sg / D
        a, c1, c0 = s[0], s[1], s[2]
        sg = sgx = 0.0
        for lo in range(0, D, CHUNK):
            hi = min(lo + CHUNK, D)
            if add:
                u, v = _sums_dy(dy1, x1, w, lo, hi, mean[n], zero)
                sg += u
                sgx += v
            if write:
                if with_sums:
                    _norm_dx_sums_span(dyr, xr, dxr, w, pw, pb, lo, hi, a, c1, m, c0)
                else:
                    _norm_dx_span(dyr, xr, dxr, w, lo, hi, a, c1, m, c0)
        if write and with_sums and (base + r) % FLUSH_ROWS == FLUSH_ROWS - 1:
            _flush(pw, dw)
            _flush(pb, db)


@_loop
def rms_norm_forward(x, w, eps, y, rstd, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)``: ``rstd = 1/sqrt(mean(x^2) + eps)``, ``y = x*rstd*w``.
    Pipelined (see above): writing row r, it takes row r + 1's sum of squares."""
    D = x.shape[1]
    s = np.empty(1, dtype=y.dtype)
    if r1 <= r0:
        return
    q = 0.0  # row r's sum of squares
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        xr, yr, x1 = x[row], y[row], x[n]
        s[0] = 1.0 / np.sqrt(q / D + eps)
        if write:
            rstd[r] = s[0]
        k = s[0]
        q = 0.0
        for lo in range(0, D, CHUNK):
            hi = min(lo + CHUNK, D)
            if add:
                q += _sum_sq(x1, lo, hi)
            if write:
                _scale_span(xr, yr, w, lo, hi, k)


@_loop
def rms_norm_backward(dy, x, rstd, w, dx, dw, pw, with_sums, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` (rows ``base + r``): ``dx = a*g + c1*xhat`` with ``a = rstd``,
    ``xhat = x*rstd``, ``c1 = -rstd*mean(g*xhat)``, ``g = dy*w``; ``sum_rows(dy*xhat)``
    into ``pw`` and ``dw`` as in ``layer_norm_backward``. Pipelined (see above): writing
    row r's dx, it takes row r + 1's sum."""
    D = x.shape[1]
    s = np.empty(2, dtype=dx.dtype)
    if r1 <= r0:
        return
    sgx = 0.0  # row r's sum(g*x)
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        xr, dyr, dxr, x1, dy1 = x[row], dy[row], dx[row], x[n], dy[n]
        rs = np.float64(rstd[row])
        s[0] = rs
        s[1] = -rs * (sgx * rs / D)
        a, c1 = s[0], s[1]
        sgx = 0.0
        for lo in range(0, D, CHUNK):
            hi = min(lo + CHUNK, D)
            if add:
                sgx += _sum_g_x(dy1, x1, w, lo, hi)
            if write:
                if with_sums:
                    _scale_dx_sums_span(dyr, xr, dxr, w, pw, lo, hi, a, c1)
                else:
                    _scale_dx_span(dyr, xr, dxr, w, lo, hi, a, c1)
        if write and with_sums and (base + r) % FLUSH_ROWS == FLUSH_ROWS - 1:
            _flush(pw, dw)


# --- BatchNorm (and running statistics): channels of N rows of S values ---------------------


@_loop
def channel_forward(x, w, b, eps, training, mean, var, rstd, y, c0, c1):  # type: ignore[no-untyped-def]
    """Channels ``[c0, c1)`` of x (N,C,S), one channel at a time, so that its N*S values
    stay in cache between the passes. With ``training``, the channel's mean and biased
    variance (two-pass, float64) are written into ``mean``, ``var`` (float64 (C,));
    else they are read from there (running statistics). Then ``rstd`` (C,) and
    ``y = (x - mean)*rstd*w + b``."""
    N, S = x.shape[0], x.shape[2]
    M = N * S
    s = np.empty(3, dtype=y.dtype)
    for c in range(c0, c1):
        if training:
            t = 0.0
            for n in range(N):
                t += _sum(x[n, c], 0, S)
            m = t / M
            q = 0.0
            for n in range(N):
                q += _sum_sq_dev(x[n, c], 0, S, m)
            mean[c] = m
            var[c] = q / M
        m = mean[c]
        rs = 1.0 / np.sqrt(var[c] + eps)
        rstd[c] = rs
        m_hi, m_lo = _split(m, s)
        s[2] = rstd[c] * w[c]
        k = s[2]
        bc = b[c]
        for n in range(N):
            _affine_span(x[n, c], y[n, c], 0, S, m_hi, m_lo, k, bc)


@_loop
def channel_backward(dy, x, mean, rstd, w, training, dx, dw, db, c0, c1):  # type: ignore[no-untyped-def]
    """Channels ``[c0, c1)``: per channel ``sum(dy)`` and ``sum(dy*(x - mean))`` (float64,
    into ``db`` and, times rstd, ``dw``), then ``dx = a*dy + k1*xhat + k0`` with
    ``a = rstd*w``, ``xhat = (x - mean)*rstd``, and with ``training`` (batch statistics)
    ``k1 = -rstd*w*mean(dy*xhat)``, ``k0 = -rstd*w*mean(dy)`` (over the M = N*S values),
    else (running statistics) ``dx = a*dy`` alone."""
    N, S = x.shape[0], x.shape[2]
    M = N * S
    s = np.empty(4, dtype=dx.dtype)
    s[0] = 0.0
    zero = s[0]  # 0 in the data's dtype
    for c in range(c0, c1):
        m = mean[c]
        rs = np.float64(rstd[c])
        wc = np.float64(w[c])
        sd = 0.0
        sdx = 0.0
        for n in range(N):
            u, v = _sums_dy_scalar_w(dy[n, c], x[n, c], 0, S, m, zero)
            sd += u
            sdx += v
        db[c] = sd
        dw[c] = sdx * rs
        s[0] = rs * wc
        s[1] = -rs * wc * (sdx * rs / M)  # k1, k0: batch statistics only
        s[2] = -rs * wc * sd / M
        s[3] = rs
        a, k1, k0, rc = s[0], s[1], s[2], s[3]
        for n in range(N):
            xr = x[n, c]
            dyr = dy[n, c]
            dxr = dx[n, c]
            if training:
                _dx_span(dyr, xr, dxr, 0, S, a, k1, m, rc, k0)
            else:  # dx does not depend on x: a NaN or inf in x, or x - mean overflowing, stays out of it
                for j in range(S):
                    dxr[j] = a * dyr[j]


# --- GroupNorm and InstanceNorm: (sample, group) rows of k channels of S values ----------
#
# Pipelined as the rows above, a chunk never straddling two channels of the row.


@_loop
def group_forward(x, w, b, k, eps, y, mean, rstd, var, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` of x (R,L), row r being the (sample, group) row ``base + r`` of the
    input (group ``(base + r) % G``, G = C/k), L = k*S values: mean, rstd (R,), the
    biased variance into ``var`` (float64 (R,)), then ``y = (x - mean)*rstd*w_c + b_c``
    per channel c of the group. Pipelined (see above): writing row r, it takes row
    r + 1's squared deviations and row r + 2's sum."""
    L = x.shape[1]
    S = L // k
    G = w.shape[0] // k
    s = np.empty(3, dtype=y.dtype)
    if r1 <= r0:
        return
    m = q = m1 = 0.0  # row r's mean and squared deviations, row r + 1's mean
    for r in range(r0 - 2, r1):
        write, dev, add, row, n1, n2 = _two_ahead(r, r0, r1)
        xr, yr, x1, x2 = x[row], y[row], x[n1], x[n2]
        rc, m_hi, m_lo = _row_stats(m, q, L, eps, s)
        if write:
            var[r] = q / L
            mean[r] = m
            rstd[r] = rc
        c0 = ((base + row) % G) * k
        q1 = 0.0  # row r + 1's squared deviations, row r + 2's sum
        t2 = 0.0
        for i in range(k):
            s[2] = rc * w[c0 + i]
            sc = s[2]
            bc = b[c0 + i]
            end = (i + 1) * S  # channel c0 + i: values [i*S, end) of the row
            for lo in range(i * S, end, CHUNK):
                hi = min(lo + CHUNK, end)
                if add:
                    t2 += _sum(x2, lo, hi)
                if dev:
                    q1 += _sum_sq_dev(x1, lo, hi, m1)
                if write:
                    _affine_span(xr, yr, lo, hi, m_hi, m_lo, sc, bc)
        m, q, m1 = m1, q1, t2 / L


@_loop
def group_backward(dy, x, mean, rstd, w, k, dx, sdy, sdyx, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` (see ``group_forward``): per channel row ``sum(dy)`` and
    ``sum(dy*(x - mean))`` (float64, into ``sdy``, ``sdyx`` (R*k,)), combined with the
    weights into ``sg = sum(g)``, ``sgx = sum(g*(x - mean))`` (``g = dy*w_c``), then
    ``dx = rstd*w_c*dy + k1*xhat + k0``, ``xhat = (x - mean)*rstd``,
    ``k1 = -rstd*(sgx*rstd)/L``, ``k0 = -rstd*sg/L``. Pipelined (see above): writing
    row r's dx, it takes row r + 1's sums."""
    L = x.shape[1]
    S = L // k
    G = w.shape[0] // k
    s = np.empty(3, dtype=dx.dtype)
    s[0] = 0.0
    zero = s[0]  # 0 in the data's dtype
    if r1 <= r0:
        return
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        xr, dyr, dxr, x1, dy1 = x[row], dy[row], dx[row], x[n], dy[n]
        m = mean[row]
        rs = np.float64(rstd[row])
        c0 = ((base + row) % G) * k
        sg = 0.0
        sgx = 0.0
        for i in range(k if write else 0):  # (the placeholder row's sums are not taken yet)
            wc = np.float64(w[c0 + i])
            sg += wc * sdy[row * k + i]
            sgx += wc * sdyx[row * k + i]
        s[1] = -rs * (sgx * rs / L)
        s[2] = -rs * sg / L
        k1, k0, rc = s[1], s[2], rstd[row]
        for i in range(k):
            s[0] = rs * w[c0 + i]
            a = s[0]
            end = (i + 1) * S  # channel c0 + i
            u = 0.0
            v = 0.0
            for lo in range(i * S, end, CHUNK):
                hi = min(lo + CHUNK, end)
                if add:
                    p, q = _sums_dy_scalar_w(dy1, x1, lo, hi, mean[n], zero)
                    u += p
                    v += q
                if write:
                    _dx_span(dyr, xr, dxr, lo, hi, a, k1, m, rc, k0)
            if add:
                sdy[n * k + i] = u
                sdyx[n * k + i] = v
