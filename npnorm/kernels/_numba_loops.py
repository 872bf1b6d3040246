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
  dtype, as the reference's is; the backwards then centre the recomputed xhat again, as
  the reference's does: ``_row_dx_coefs``, ``_batch_dx_coefs``; for the channels or rows
  ``_far_from_zero`` only, whose third sum, ``sum(x - mean)``, is taken for that alone);
* the row sums are vectorized: the small ``_sum*`` helpers are compiled with
  ``fastmath={"reassoc"}`` (only reassociation: NaN and infinity behave as usual), so
  their partial sums run in SIMD lanes, in an order fixed by the compiled code (the same
  input gives bitwise the same sums);
* ``error_model="numpy"``: a division by zero gives inf or NaN as in NumPy, never an
  exception.

Everything in this file is compiled code: keep it to one file, because numba's on-disk
cache (``cache=True``) tracks the source file of each function, not the files its callees
live in. Where numba has nowhere to write the cache, the loops compile uncached
(``CACHED``, with one warning).
"""

from __future__ import annotations

import platform
import warnings
from typing import Any

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, types, uint16, uint32, uint64
from numba.core import config as numba_config
from numba.core.extending import intrinsic

from .._stats import RECENTRE_ABOVE


def _no_op() -> None:
    pass


def _cache_writable() -> bool:
    """Whether numba has a place to write this file's cache: ``__pycache__`` beside it,
    ``NUMBA_CACHE_DIR`` or the home directory's cache. In a read-only install (a
    non-root user, ``docker run --read-only``) with neither variable nor home writable,
    ``njit(cache=True)`` raises "no locator available" (numba reads a cache only where it
    could also write one); the loops then compile in each process, with one warning."""
    try:
        njit(cache=True)(_no_op)  # numba finds the cache's place here, before any compile
    except RuntimeError as err:
        warnings.warn(
            f"npnorm's numba kernels cannot be cached ({err}): they compile in this process "
            "(about a second per operation and dtype on first use). Set NUMBA_CACHE_DIR to a "
            "directory this user can write, and run `python -m npnorm warmup` with it set, "
            "to compile them once; or NPNORM_KERNELS=numpy to use NumPy's kernels",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


# whether the loops are cached on disk (``python -m npnorm warmup`` reports it)
CACHED = _cache_writable()

# the options of every loop, and of the row sums (vectorized by reassociation)
_loop: Any = njit(cache=CACHED, nogil=True, error_model="numpy")
_sum_loop: Any = njit(cache=CACHED, nogil=True, error_model="numpy", fastmath={"reassoc"})
_value: Any = njit(cache=CACHED, nogil=True, error_model="numpy", inline="always")  # one value's helper

# dweight/dbias of LayerNorm and RMSNorm are summed over rows in the data's dtype, and
# added into float64 partial sums after every row whose index in the input is a multiple
# of FLUSH_ROWS minus one (so that how a thread's rows are cut into calls does not change
# the sums).
FLUSH_ROWS = 16

# the values per chunk of the pipelined row loops (see there)
CHUNK = 256

# the values per piece of a row that BatchNorm's forward takes two-pass from cache (see
# channel_forward): 16 KB of float32
PIECE = 4096

# The sums over the channels of short rows (BatchNorm's blocks of channels, below) are
# taken over spans of SPAN samples, and each span's sum is added into the channel's
# total, spans in order (the backward's sum(x - mean), which only centres xhat again,
# over a span in the data's dtype: in float64 it cost BatchNorm1d's backward 12-29%):
# every loop adds the same partial sums in the same order, so that the sample-split
# loops (``channel_span_sums``, the threads each taking whole spans), the blocks and the
# backward's channel loop give bitwise the same sums.
SPAN = 64


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
def _sum_dev(a, lo, hi, m):  # type: ignore[no-untyped-def]
    """sum(a[lo:hi] - m), ``m`` a float64."""
    t = 0.0
    for i in range(uint64(lo), uint64(hi)):
        t += a[i] - m
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
def _row_sums_dy(dy, x, w, r, m):  # type: ignore[no-untyped-def]
    """Row r of a LayerNorm backward (dy, x (R,D)): ``(sum(g), sum(g * (x - m)), sum(x -
    m))`` with ``g = dy * w`` (the last sum centres xhat again: ``_row_dx_coefs``). The
    whole row in one loop, indexed in the 2-D arrays (a call per chunk of a row view cost
    the backward more than its arithmetic: see ``layer_norm_backward``)."""
    sg = 0.0
    sgx = 0.0
    sx = 0.0
    for i in range(uint64(0), uint64(x.shape[1])):
        g = dy[r, i] * w[i]
        xc = x[r, i] - m
        sg += g
        sgx += g * xc
        sx += xc
    return sg, sgx, sx


@_sum_loop
def _row_sums_g(dy, x, w, r, m):  # type: ignore[no-untyped-def]
    """``_row_sums_dy`` without its third sum, ``(sum(g), sum(g * (x - m)))``: for the
    rows near 0, whose dx and dweight do not centre xhat again (``_far_from_zero``)."""
    sg = 0.0
    sgx = 0.0
    for i in range(uint64(0), uint64(x.shape[1])):
        g = dy[r, i] * w[i]
        sg += g
        sgx += g * (x[r, i] - m)
    return sg, sgx


@_sum_loop
def _sums_dy_dev(dy, x, lo, hi, m, zero):  # type: ignore[no-untyped-def]
    """``(sum(dy), sum(dy * (x - m)), sum(x - m))`` over ``[lo, hi)`` of a channel row, m
    in the data's dtype (the backwards of BatchNorm, GroupNorm and InstanceNorm; the last
    sum centres xhat again: ``_batch_dx_coefs``, ``_row_dx_coefs``), returned in float64.
    That last sum is accumulated in the dtype of ``zero``: float64 for GroupNorm and
    InstanceNorm, whose C-ordered and channels-last loops add in different orders (in
    float32 their results differed, where the float64 sums of a few float32 terms are
    exact, and float16 data, staged, no longer came out as float32's rounded once); the
    data's dtype for BatchNorm, whose loops all add in one order and whose float64 spans
    cost BatchNorm1d's backward 12-29% (see SPAN)."""
    s = 0.0
    sx = 0.0
    sc = zero
    for i in range(uint64(lo), uint64(hi)):
        d = dy[i]
        xc = x[i] - m
        s += d
        sx += d * xc
        sc += xc
    return s, sx, np.float64(sc)


@_sum_loop
def _sums_dy(dy, x, lo, hi, m):  # type: ignore[no-untyped-def]
    """``(sum(dy), sum(dy * (x - m)))`` over ``[lo, hi)`` of a channel row, in float64:
    ``_sums_dy_dev`` without its third sum, for the channels (BatchNorm) and rows
    (GroupNorm, InstanceNorm) near 0, whose dx does not centre xhat again
    (``_far_from_zero``). The loops that sum a channel's or a row's values one after the
    other (BatchNorm's channel loop and blocks, GroupNorm's rows, pipelined or not) pick
    between the two by that one rule, so that they add in the same order."""
    s = 0.0
    sx = 0.0
    for i in range(uint64(lo), uint64(hi)):
        d = dy[i]
        s += d
        sx += d * (x[i] - m)
    return s, sx


@_sum_loop
def _row_sum_g_x(dy, x, w, r):  # type: ignore[no-untyped-def]
    """Row r of an RMSNorm backward: ``sum(dy * w * x)`` (as ``_row_sums_dy``)."""
    t = 0.0
    for i in range(uint64(0), uint64(x.shape[1])):
        t += (dy[r, i] * w[i]) * x[r, i]
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
def _batch_dx_span(dy, x, dx, lo, hi, a, k1, m, rc, d_hi, d_lo):  # type: ignore[no-untyped-def]
    """``dx = a*(dy - mean(dy)) + k1*xhat``, ``xhat = (x - m)*rc``, over ``[lo, hi)``, the
    mean of dy split as by ``_split`` (BatchNorm's: dy is centred before it is scaled)."""
    for j in range(uint64(lo), uint64(hi)):
        dx[j] = a * ((dy[j] - d_hi) - d_lo) + k1 * ((x[j] - m) * rc)


@_loop
def _scale_dy_span(dy, dx, lo, hi, a):  # type: ignore[no-untyped-def]
    """``dx = a*dy`` over ``[lo, hi)``."""
    for j in range(uint64(lo), uint64(hi)):
        dx[j] = a * dy[j]


@_loop
def _far_from_zero(m, r):  # type: ignore[no-untyped-def]
    """Whether a channel with mean m and rstd r has its xhat centred again in BatchNorm's
    backward (``_batch_dx_coefs``), or a row in LayerNorm's (``layer_norm_backward``),
    GroupNorm's and InstanceNorm's (``_centred_sum``): its mean more than RECENTRE_ABOVE
    standard deviations from 0, the threshold of the "numpy" family's rules (which take
    it per row for LayerNorm, per input for BatchNorm). Nearer to 0 the mean's rounding
    moves xhat by under two roundings of the dtype, and the sum that centres it again,
    ``sum(x - mean)``, costs the backward of one value per channel and sample
    (BatchNorm1d, channels-last) 12-29% (``_span_dy_sums``), and channels-last
    GroupNorm's 15%. On longer rows it cost (``_sums_dy_dev`` where ``_sums_dy`` does)
    GroupNorm's C-ordered backward 1.2-1.27x its time in cache ((4, 256, 16, 16), (16,
    512, 7, 7) with 32 groups) and 1.07x at (32, 64, 56, 56), and BatchNorm2d's up to
    1.1x, on one thread; LayerNorm's (``_row_sums_dy`` where ``_row_sums_g`` does)
    1.1-1.2x at (512, 384), (256, 768) and (4096, 64)."""
    return abs(np.float64(m)) * abs(np.float64(r)) > RECENTRE_ABOVE


@_loop
def _any_far(m, r):  # type: ignore[no-untyped-def]
    """Whether some channel of ``m``, ``r`` (k,) is ``_far_from_zero``."""
    for j in range(m.shape[0]):
        if _far_from_zero(m[j], r[j]):
            return True
    return False


@_loop
def _centred_sum(sx, m, r):  # type: ignore[no-untyped-def]
    """A GroupNorm or InstanceNorm row's ``sum(x - mean)`` as its dx coefficients take
    it (``_row_dx_coefs``): ``sx`` where the row is ``_far_from_zero``, else 0 (xhat not
    centred again, as BatchNorm's channels near 0). Every loop of theirs applies it per
    row, so that C-ordered and channels-last input get the same dx. The row loops take
    the sum only on the rows far from 0 (``_sums_dy`` elsewhere), and the channels-last
    loops only on samples with such a row (``_any_far`` of the sample's groups): see
    ``_far_from_zero`` for what it cost."""
    return sx if _far_from_zero(m, r) else 0.0


@_loop
def _centre_row_sums(sdy, sdyx, j0, k, csx, L):  # type: ignore[no-untyped-def]
    """A GroupNorm or InstanceNorm row's per-channel ``sum(dy*(x - mean))``, ``sdyx[j0:j0 +
    k]``, centred again in place for dweight, as its dx coefficients take xhat: minus
    ``xi*sum(dy)``, ``xi = csx/L`` the row's mean of ``x - mean`` (``csx`` from
    ``_centred_sum``: 0 for rows near 0, which are left as they are), where the rounding
    of the saved mean had added it (float32 at offset 1e3 and spread 1e-3: 4e-2 of
    dweight, as PyTorch's). Not where a value is not finite."""
    if csx == 0.0 or not np.isfinite(csx):
        return
    xi = csx / L
    for j in range(j0, j0 + k):
        shift = xi * sdy[j]
        if np.isfinite(shift) and np.isfinite(sdyx[j]):
            sdyx[j] -= shift


@_loop
def _batch_dx_coefs(m, rs, wc, sd, sdx, sxc, M, s):  # type: ignore[no-untyped-def]
    """BatchNorm's ``dx = a*(dy - mean(dy)) + k1*xhat`` over a channel of M values, from
    its float64 rstd ``rs``, weight ``wc``, ``sd = sum(dy)``, ``sdx = sum(dy*(x -
    mean))`` and ``sxc = sum(x - mean)``: ``(a, k1, d_hi, d_lo)`` in the data's dtype
    (through ``s[0:4]``), ``a = rstd*w``, ``k1 = -rstd*w*mean(dy*xhat)`` and ``mean(dy)``
    split as by ``_split`` (k1 and the mean: batch statistics only). dy is centred before
    it is scaled, as PyTorch's kernel does: as ``a*dy - a*mean(dy)``, a common part of dy
    (1e3 over a spread of 1) left ``a*dy``'s rounding in dx, 2-3 times PyTorch's error.
    xhat is centred again first, as in ``_row_dx_coefs``: its mean ``e = rs*sxc/M`` (the
    saved mean's rounding) comes out of ``mean(dy*xhat)``, and ``a*k*e`` moves into the
    mean of dy (``d - k*e``, ``k = mean(dy*(xhat - e))``); only for a channel whose mean
    ``m`` is ``_far_from_zero`` (elsewhere ``sxc`` is not read, and may be anything), and
    not where a sum is not finite."""
    s[0] = rs * wc
    d = sd / M
    if _far_from_zero(m, rs) and np.isfinite(sd) and np.isfinite(sdx) and np.isfinite(sxc):
        e = rs * (sxc / M)
        k = (sdx * rs - e * sd) / M
        s[1] = -rs * wc * k
        d = d - k * e
    else:
        s[1] = -rs * wc * (sdx * rs / M)
    s[2] = d
    s[3] = d - s[2] if np.isfinite(d) else 0.0  # (an inf in dy: inf, and no NaN from inf - inf)
    return s[0], s[1], s[2], s[3]


@_loop
def _batch_dw(m, rs, sd, sdx, sxc, M, training):  # type: ignore[no-untyped-def]
    """BatchNorm's ``dweight = sum(dy*xhat) = rs*sdx``, with batch statistics (``training``)
    xhat centred again as in ``_batch_dx_coefs`` (same rule): ``rs*(sdx - sxc/M*sd)``, where
    the rounding of the saved mean had added ``rs*mean(x - mean)*sum(dy)`` (float32 at
    offset 1e3 and spread 1e-3: 3e-2 of dweight, as PyTorch's)."""
    if training and _far_from_zero(m, rs) and np.isfinite(sd) and np.isfinite(sdx) and np.isfinite(sxc):
        shift = (sxc / M) * sd
        if np.isfinite(shift):
            return (sdx - shift) * rs
    return sdx * rs


@_loop
def _row_centre(rs, sx, D):  # type: ignore[no-untyped-def]
    """The mean of a LayerNorm row's xhat, ``rs*sx/D`` from its float64 rstd and ``sx =
    sum(x - mean)``, for dweight (0 where ``sx`` is not finite; from x alone, so that a row
    whose dy holds an inf is centred too, as by the reference): the rounding of the saved
    mean had added ``rstd*mean(x - mean)*sum(dy)`` to dweight (float32 at offset 1e3 and
    spread 1e-3: 8e-3 of it)."""
    if sx != 0.0 and np.isfinite(sx):
        return rs * (sx / D)
    return 0.0


@_loop
def _row_dx_coefs(rs, sg, sgx, sx, D, s):  # type: ignore[no-untyped-def]
    """LayerNorm's ``dx = a*g + c1*xhat + c0``, ``xhat = (x - mean)*rstd`` with the mean
    as saved, from a row's float64 rstd ``rs`` and sums ``sg = sum(g)``, ``sgx = sum(g*(x
    - mean))``, ``sx = sum(x - mean)``: ``(a, c1, c0)`` in the data's dtype (through
    ``s[0:3]``). As the reference's ``centred_again`` does, xhat is centred again
    first: the saved mean is rounded to the data's dtype, so xhat's mean is ``d =
    rs*sx/D``, not 0 (on a nearly constant row, rstd ~300, 1e-4 in float32), and term 3
    takes ``xhat - d``: ``c1 = -rs*mean(g*(xhat - d))``, and ``c0 = -rs*mean(g) - c1*d``
    moves the centre (each representable where rstd is: no rstd^3, which underflows
    float32 for huge rows; and mean(g) before rstd scales it, as the reference takes it:
    ``rs*sum(g)`` can pass float64's range where dx's terms do not). Where a sum is not
    finite (an inf or NaN in dy or x) xhat is taken as it is, so that NaN comes only
    where the values make it (0*inf of a correction would put it on the whole row); so
    it is where ``sx`` is 0, which the loops of LayerNorm, GroupNorm and InstanceNorm
    pass for rows near 0 (``_far_from_zero``, ``_centred_sum``): bitwise the uncentred
    coefficients, with no 0*inf where ``c1`` overflows."""
    s[0] = rs
    if sx != 0.0 and np.isfinite(sg) and np.isfinite(sgx) and np.isfinite(sx):
        d = rs * (sx / D)
        c1 = -rs * ((sgx * rs - d * sg) / D)
        s[1] = c1
        s[2] = -rs * (sg / D) - c1 * d
    else:
        s[1] = -rs * (sgx * rs / D)
        s[2] = -rs * (sg / D)
    return s[0], s[1], s[2]


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


# --- pipelined rows: LayerNorm, RMSNorm, GroupNorm, InstanceNorm (and BatchNorm's channels)
#
# Reading a row for its sums and then writing its output would run as two phases, each
# leaving memory half idle where the hardware does not fetch the next row in time on its
# own. So these loops pipeline the rows: they visit a row in chunks of CHUNK values, and
# with each chunk of row r that they write they take the same chunk of the rows ahead
# (the forward of LayerNorm and GroupNorm: row r + 1's squared deviations, from cache, and
# row r + 2's sum, from memory; RMSNorm's forward: row r + 1's sum of squares; the
# backwards: row r + 1's sums). The loop starts one or two rows before r0 with the writes
# off while the pipeline fills (``_one_ahead``, ``_two_ahead``), so that every row's sums
# are taken by the same code, chunk by chunk in the same order, wherever a thread's range
# or a staged block begins: the results do not depend on how the rows are split.
#
# Which loop shape is faster depends on the host. When the forwards were first pipelined,
# the pipeline measured 13-19% faster than one row at a time for GroupNorm and
# InstanceNorm at (32, 64, 56, 56), on a host not recorded. On a 2-vCPU AMD EPYC (1 MiB of
# L2 per core, 32 MiB of L3), the forwards of LayerNorm and GroupNorm were faster one row
# at a time for rows of LONG_FORWARD_ROW values and more (``layer_norm_forward_long``,
# ``group_forward_long``: the row's sum from memory, its squared deviations from cache,
# then its output; bitwise the same results). Timed there against the pipeline, the
# loops alone on two threads, float32: 0.73-0.87x its time for LayerNorm at (16384, 768)
# and (16384, 4096), 0.79x at (2048, 65536), 0.74x at (256, 1048576); 0.69-0.75x for
# GroupNorm and InstanceNorm at (32, 64, 56, 56) (64, 32 and 1 groups) and (8, 64, 128,
# 128), 0.84x at (16, 32, 224, 224); 0.87-1.06x, about break-even, with rows of 256 to 784
# values (LayerNorm at D = 256: 1.06x). On a 2-vCPU Intel Xeon (2 MiB of L2 per core) it
# was the other way round: the pipeline took 0.86x the one-at-a-time loop's time for
# LayerNorm at (16384, 4096), 0.91x at (16384, 768), 0.92x at (4096, 512), 1.00x at (1024,
# 256); 0.87-0.88x for GroupNorm at (32, 64, 56, 56) (32 and 64 groups), 0.76x at (8, 64,
# 128, 128), 1.02x at (32, 512, 7, 7). So long rows go one at a time on AMD processors
# (``LONG_ROWS_ALONE``, from the x86 vendor) and stay pipelined elsewhere, the shape the
# Intel hosts preferred (and the one untimed processors, ARM's among them, keep). Shorter
# rows stay pipelined everywhere: one at a time they took 1.1-1.3x the pipeline's time on
# the AMD host (LayerNorm (65536, 64), InstanceNorm at 4x4, 7x7 and 10x10), the steps of
# a row too short to hide one another's latency. (A pipeline one row deep, the next row's
# sum taken under this row's output and its squared deviations after, measured between
# the two there.) The backwards and RMSNorm's forward stay pipelined one row deep: one
# row at a time they measured 1.0-1.3x the pipeline's time on that AMD host. But
# GroupNorm's and InstanceNorm's backward takes short rows one at a time everywhere, and
# long ones where the forward does (``group_backward_short``; on a later AMD EPYC,
# ``znver5``, that took 0.79-0.94x the pipeline's time: see
# ``numba_channels.SHORT_ROW_BYTES``); and LayerNorm's and RMSNorm's backwards take whole
# rows, not chunks: row r + 1's sums in one call, then row r's dx in the loop's own body
# (see ``layer_norm_backward``).
LONG_FORWARD_ROW = 256


def _x86_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor's vendor as Linux reports it (``vendor_id``: "AuthenticAMD",
    "GenuineIntel"), or "" where there is none (another system, or an ARM processor)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# whether this host's processor is AMD's: the loop shapes below that depend on the host
# follow it (read once, at import)
ON_AMD = _x86_vendor() == "AuthenticAMD"

# whether the forwards of LayerNorm and GroupNorm take rows of LONG_FORWARD_ROW values and
# more one at a time (on AMD processors; see above)
LONG_ROWS_ALONE = ON_AMD


def one_row_at_a_time(L: int) -> bool:
    """Whether the forward loops take rows of L values one at a time (``*_forward_long``)
    rather than pipelined: long rows, on a host where that measured faster (see above).
    The two give bitwise the same results. GroupNorm's backward follows it too
    (``group_backward_short``; see ``numba_channels.SHORT_ROW_BYTES``)."""
    return LONG_ROWS_ALONE and L >= LONG_FORWARD_ROW


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
def _row_stats(m, var, eps, s):  # type: ignore[no-untyped-def]
    """A row's (or channel's) statistics from its float64 mean ``m`` and biased variance
    ``var``: ``(rstd, m_hi, m_lo)``, rstd = 1/sqrt(var + eps) rounded to the data's dtype
    as it is stored, and the mean split as by ``_split`` (in ``s[0:3]``)."""
    s[2] = 1.0 / np.sqrt(var + eps)
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
        k, m_hi, m_lo = _row_stats(m, q / D, eps, s)
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
def layer_norm_forward_long(x, w, b, eps, y, mean, rstd, r0, r1):  # type: ignore[no-untyped-def]
    """``layer_norm_forward`` for long rows (the callers: ``one_row_at_a_time``; correct
    for any length): one row at a time, no pipeline: its sum from memory,
    its squared deviations from cache, then its output. The same sums, chunk by chunk in
    the same order: bitwise the pipelined loop's results. (The two sums are written out
    here and in ``group_forward_long``: as a helper returning both, called from these
    loops, they measured 1.04x and 1.3x the time at (16384, 768) and (8192, 384).)"""
    D = x.shape[1]
    s = np.empty(3, dtype=y.dtype)
    for r in range(r0, r1):
        xr, yr = x[r], y[r]  # D, D
        t = 0.0  # float64: the row's sum, then its squared deviations
        for lo in range(0, D, CHUNK):
            t += _sum(xr, lo, min(lo + CHUNK, D))
        m = t / D
        q = 0.0
        for lo in range(0, D, CHUNK):
            q += _sum_sq_dev(xr, lo, min(lo + CHUNK, D), m)
        k, m_hi, m_lo = _row_stats(m, q / D, eps, s)
        mean[r] = m
        rstd[r] = k
        for lo in range(0, D, CHUNK):
            _norm_span(xr, yr, w, b, lo, min(lo + CHUNK, D), m_hi, m_lo, k)


@_loop
def layer_norm_backward(dy, x, mean, rstd, w, dx, dw, db, pw, pb, with_sums, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` (rows ``base + r`` of the input): ``dx = rstd*(g - mean(g) -
    xhat*mean(g*xhat))``, ``g = dy*w``, as ``dx = a*g + c1*xhat + c0`` with per-row
    ``a = rstd``, ``c1 = -rstd*mean(g*xhat)``, ``c0 = -rstd*mean(g)``, xhat centred
    again first (``_row_dx_coefs``) on the rows far from 0 (``_far_from_zero``; the
    others take two sums, ``_row_sums_g``). With
    ``with_sums``, ``sum_rows(dy*xhat)`` and ``sum_rows(dy)`` go into the partial sums
    ``pw``, ``pb`` (the data's dtype, (D,)), flushed into the float64 ``dw``, ``db``
    (see FLUSH_ROWS; the caller flushes what is left). Pipelined one row deep: row r + 1's
    sums (``_row_sums_dy`` or ``_row_sums_g``, one call), then row r's dx, written here in
    the loop's body.
    (Calling a helper per chunk of 256 values for each, on row views, as the forwards do,
    took 1.2-4.6x this loop's time in float32 on an AMD EPYC, float64 0.95-1.3x.)"""
    D = x.shape[1]
    s = np.empty(4, dtype=dx.dtype)
    if r1 <= r0:
        return
    sg = sgx = sx = 0.0  # row r's sum(g), sum(g*(x - mean)), sum(x - mean)
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        rs = np.float64(rstd[row])
        s[3] = _row_centre(rs, sx, D)
        e = s[3]  # (in the data's dtype)
        a, c1, c0 = _row_dx_coefs(rs, sg, sgx, sx, D, s)
        if add and _far_from_zero(mean[n], rstd[n]):
            sg, sgx, sx = _row_sums_dy(dy, x, w, n, mean[n])
        elif add:
            sg, sgx = _row_sums_g(dy, x, w, n, mean[n])
            sx = 0.0
        if not write:
            continue
        m = mean[row]
        if with_sums:
            for j in range(uint64(0), uint64(D)):
                xh = (x[row, j] - m) * a
                d = dy[row, j]
                dx[row, j] = a * (d * w[j]) + c1 * xh + c0
                pw[j] += d * (xh - e)
                pb[j] += d
            if (base + r) % FLUSH_ROWS == FLUSH_ROWS - 1:
                _flush(pw, dw)
                _flush(pb, db)
        else:
            for j in range(uint64(0), uint64(D)):
                dx[row, j] = a * (dy[row, j] * w[j]) + c1 * ((x[row, j] - m) * a) + c0


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
    into ``pw`` and ``dw`` as in ``layer_norm_backward``, and pipelined as there: row
    r + 1's sum (``_row_sum_g_x``), then row r's dx."""
    D = x.shape[1]
    s = np.empty(2, dtype=dx.dtype)
    if r1 <= r0:
        return
    sgx = 0.0  # row r's sum(g*x)
    for r in range(r0 - 1, r1):
        write, add, row, n = _one_ahead(r, r0, r1)
        rs = np.float64(rstd[row])
        s[0] = rs
        s[1] = -rs * (sgx * rs / D)
        a, c1 = s[0], s[1]
        if add:
            sgx = _row_sum_g_x(dy, x, w, n)
        if not write:
            continue
        if with_sums:
            for j in range(uint64(0), uint64(D)):
                d = dy[row, j]
                xh = x[row, j] * a
                dx[row, j] = a * (d * w[j]) + c1 * xh
                pw[j] += d * xh
            if (base + r) % FLUSH_ROWS == FLUSH_ROWS - 1:
                _flush(pw, dw)
        else:
            for j in range(uint64(0), uint64(D)):
                dx[row, j] = a * (dy[row, j] * w[j]) + c1 * (x[row, j] * a)


# --- BatchNorm (and running statistics): channels of N rows of S values ---------------------


@_loop
def running_moved(running_mean, running_var, mean, var, unbias, momentum, new_mean, new_var):  # type: ignore[no-untyped-def]
    """The running statistics moved towards a batch's: ``new_mean = (1 - momentum) *
    running_mean + momentum * mean`` and ``new_var`` the same with ``var * unbias`` (the
    biased variance made unbiased), each term in float64 and rounded once to the buffer's
    dtype as it is stored: bitwise what ``functional._channels.running_update`` gives for
    a float64 batch (the same operations in the same order; one call for what took it
    nine NumPy calls, about 5 us of a small BatchNorm's training forward). All (C,):
    ``mean`` and ``var`` float64; the buffers, which are only read, and the new arrays
    of one dtype, float32 or float64."""
    keep = 1.0 - momentum
    for c in range(mean.shape[0]):
        new_mean[c] = keep * np.float64(running_mean[c]) + momentum * mean[c]
        new_var[c] = keep * np.float64(running_var[c]) + momentum * (var[c] * unbias)


@_loop
def _largest_magnitude(a):  # type: ignore[no-untyped-def]
    """``abs(a).max(initial=0.0)`` as NumPy takes it, in float64: NaN where any value is
    NaN."""
    top = 0.0
    for i in range(a.shape[0]):
        s = abs(np.float64(a[i]))
        if top == top and not s <= top:  # (a NaN top stays; a NaN or larger value is taken)
            top = s
    return top


@_loop
def spread_leaves(rstd, low, high):  # type: ignore[no-untyped-def]
    """``_blocks.extreme_spread`` for an (n,) ``rstd`` of ``ct``, with ``low`` and ``high``
    its bounds (``_blocks.spread_limits``): whether some rstd lies below ``low`` or
    above ``high`` in magnitude (a NaN does neither), in one call for NumPy's three."""
    for i in range(rstd.shape[0]):
        s = abs(np.float64(rstd[i]))
        if s < low or s > high:
            return True
    return False


@_loop
def coefficients_leave(rstd, w, weighted, low, largest):  # type: ignore[no-untyped-def]
    """``_blocks.extreme_coefficients(rstd, w if weighted else None, ct, tiny=False)`` for
    (n,) ``rstd`` and ``w`` of ``ct``, with ``low`` and ``largest`` its bounds
    (``_blocks.spread_limits``): whether some rstd is below ``low`` in magnitude, or the
    largest rstd times the largest weight (NaN where either holds a NaN) exceeds
    ``largest``. The same comparisons on the same values (float32 magnitudes compare
    alike in float64), in one call for the five NumPy calls that cost a small backward
    3-8 us."""
    if spread_leaves(rstd, low, np.inf):  # (only the lower bound: tiny=False)
        return True
    if not weighted:
        return False
    return _largest_magnitude(rstd) * _largest_magnitude(w) > largest


@_loop
def _channel_two_pass(x, c, mean, var):  # type: ignore[no-untyped-def]
    """Channel c's mean and biased variance of x (N,C,S) into ``mean[c]``, ``var[c]``, two
    passes over the channel (float64): ``channel_forward``'s way for a channel holding an
    inf or NaN, whose merge gives NaN where the mean is inf."""
    N, S = x.shape[0], x.shape[2]
    t = 0.0
    for n in range(N):
        t += _sum(x[n, c], 0, S)
    m = t / (N * S)
    q = 0.0
    for n in range(N):
        q += _sum_sq_dev(x[n, c], 0, S, m)
    mean[c] = m
    var[c] = q / (N * S)


@_loop
def channel_forward(x, w, b, eps, training, mean, var, rstd, y, c0, c1):  # type: ignore[no-untyped-def]
    """Channels ``[c0, c1)`` of x (N,C,S), channel c's M = N*S values being the N rows
    ``x[n, c]``. With ``training``, each channel's mean and biased variance (float64) are
    written into ``mean``, ``var`` (float64 (C,)); else they are read from there (running
    statistics). Then ``rstd`` (C,) and ``y = (x - mean)*rstd*w + b``.

    Both passes go through memory in its own order, sample by sample (the rows of
    channels ``[c0, c1)`` of sample 0, then of sample 1, ...), not channel by channel:
    a channel's rows lie C*S values apart, and rows of a few KB read one after another
    from so far apart leave the hardware's prefetch behind. The statistics take each row
    in pieces of at most PIECE values, each two-pass on its own from cache (its mean,
    then its squared deviations from it, float64), merged into the channel's running
    mean and sum of squared deviations in sample order (Chan, Golub and LeVeque's
    pairwise update): one read of the input for the statistics and one for the output,
    and the same results whichever threads take which channels. The pieces' means are
    taken about the channel's first piece's mean (``shift``), so that the differences
    of means in the update keep their digits where a channel's mean is large against
    its spread (unshifted, float64 lost ~1e-7 relative at offset 1e6, spread 1e-3)."""
    N, S = x.shape[0], x.shape[2]
    s = np.empty(3, dtype=y.dtype)
    k = max(0, c1 - c0)
    sc = np.empty(k, dtype=y.dtype)  # rstd*w, b and the mean split, per channel
    bc = np.empty(k, dtype=y.dtype)
    m_hi = np.empty(k, dtype=y.dtype)
    m_lo = np.empty(k, dtype=y.dtype)
    if training:
        shift = np.empty(k)  # float64: the first piece's mean, per channel
        for c in range(c0, c1):
            shift[c - c0] = _sum(x[0, c], 0, min(PIECE, S)) / min(PIECE, S)
            mean[c] = 0.0  # the mean about the shift until the end
            var[c] = 0.0  # and the sum of squared deviations
        for n in range(N):
            for c in range(c0, c1):
                xr, sh = x[n, c], shift[c - c0]
                for lo in range(0, S, PIECE):
                    hi = min(lo + PIECE, S)
                    mp = _sum_dev(xr, lo, hi, sh) / (hi - lo)  # the piece's mean about the shift
                    qp = _sum_sq_dev(xr, lo, hi, sh + mp)  # and its squared deviations
                    done = n * S + lo  # values merged so far
                    if done == 0:  # the first piece as it is (d*d*0 is NaN where d*d overflows)
                        mean[c] = mp
                        var[c] = qp
                        continue
                    d = mp - mean[c]
                    f = (hi - lo) / (done + (hi - lo))
                    mean[c] += d * f
                    var[c] += qp + d * d * (done * f)
        for c in range(c0, c1):
            mean[c] += shift[c - c0]
            var[c] /= N * S
            if not np.isfinite(mean[c]):  # an inf or NaN among the values: as the two-pass
                _channel_two_pass(x, c, mean, var)  # statistics have them (inf - inf is NaN)
    for c in range(c0, c1):
        rs, m_hi[c - c0], m_lo[c - c0] = _row_stats(mean[c], var[c], eps, s)
        rstd[c] = rs
        sc[c - c0] = rs * w[c]
        bc[c - c0] = b[c]
    for n in range(N):
        for c in range(c0, c1):
            j = c - c0
            _affine_span(x[n, c], y[n, c], 0, S, m_hi[j], m_lo[j], sc[j], bc[j])


# Which of BatchNorm's two training forwards is faster depends on the host, as for the long
# rows above. ``channel_forward`` reads the input in memory order, sample by sample; on a
# 2-vCPU AMD EPYC (1 MiB of L2 per core, 32 MiB of L3) it took 0.75x the time of the
# channel-by-channel pipeline (``channel_forward_pipelined``) at (32, 64, 56, 56) and 0.63x
# at (128, 64, 28, 28), the loops alone in training. On a 2-vCPU Intel Xeon (2 MiB of L2 per
# core) the pipeline was the faster: memory order took 1.26x its time at (32, 64, 56, 56),
# 1.03x at (128, 64, 28, 28), 1.15x at (8, 64, 128, 128), 1.38x at (32, 256, 28, 28) and
# 1.08x at (16, 32, 224, 224) (with running statistics the two took the same time). So the
# training forward reads memory order on AMD processors and pipelines the channels elsewhere.
CHANNELS_IN_MEMORY_ORDER = ON_AMD


@_loop
def channel_forward_pipelined(x, w, b, eps, training, mean, var, rstd, y, c0, c1):  # type: ignore[no-untyped-def]
    """``channel_forward``'s training (``training`` is true: the parameters are
    ``channel_forward``'s, and running statistics go there) with the channels pipelined as
    the rows above, where ``CHANNELS_IN_MEMORY_ORDER`` is off: writing channel c (from
    cache), it takes channel c + 1's squared deviations (from cache) and channel c + 2's
    sum (from memory), chunk by chunk of each of the N rows, summed per span of SPAN
    samples. Two-pass statistics in float64, the sum taken about the channel's first value
    (``shift``, where finite), so that a mean large against the spread keeps its digits
    (summed unshifted, float64's mean was 15 ulp off at offset 1e6, spread 1e-3): the same
    to float64 rounding as ``channel_forward``'s (not bitwise: another order of the sums)."""
    N, S = x.shape[0], x.shape[2]
    M = N * S
    s = np.empty(3, dtype=y.dtype)
    if c1 <= c0:
        return
    m = q = m1 = 0.0  # channel c's mean and squared deviations, channel c + 1's mean
    for c in range(c0 - 2, c1):
        write, dev, add, ch, n1, n2 = _two_ahead(c, c0, c1)
        shift = np.float64(x[0, n2, 0]) if add and S > 0 else 0.0  # channel c + 2's first value
        if not np.isfinite(shift):  # (an inf or NaN: the sum has it as it is)
            shift = 0.0
        rs, m_hi, m_lo = _row_stats(m, q / M, eps, s)
        if write:
            mean[c] = m
            var[c] = q / M
            rstd[c] = rs
        s[2] = rs * w[ch]
        sc = s[2]
        bc = b[ch]
        q1 = 0.0  # channel c + 1's squared deviations, channel c + 2's sum
        t2 = 0.0
        pq = pt = 0.0  # the same over this span of samples
        for n in range(N):
            xr, yr, x1, x2 = x[n, ch], y[n, ch], x[n, n1], x[n, n2]
            for lo in range(0, S, CHUNK):
                hi = min(lo + CHUNK, S)
                if add:
                    pt += _sum_dev(x2, lo, hi, shift)
                if dev:
                    pq += _sum_sq_dev(x1, lo, hi, m1)
                if write:
                    _affine_span(xr, yr, lo, hi, m_hi, m_lo, sc, bc)
            if (n + 1) % SPAN == 0 or n + 1 == N:  # the span's sums into the totals
                q1 += pq
                t2 += pt
                pq = pt = 0.0
        m, q, m1 = m1, q1, shift + t2 / M


# The backward has one loop shape on every host. A backward in memory order, as the AMD
# forward's (every channel's sums sample by sample, then every dx; bitwise the same sums,
# added in the same order), was timed against this pipeline on a 2-vCPU AMD EPYC, the loops
# alone in float32: on one thread 0.71-0.87x its time at (32, 64, 56, 56), (128, 64, 28,
# 28) and (32, 256, 28, 28) (1.1x at (8, 64, 128, 128) and (16, 32, 224, 224)), but on two
# threads 0.95x at (32, 64, 56, 56) only, and 1.04-1.30x at the other six (the four above,
# (64, 128, 14, 14) and (256, 512, 7, 7)): it reads dy and x from memory twice. So it was
# not kept.
@_loop
def channel_backward(dy, x, mean, rstd, w, training, dx, dw, db, c0, c1):  # type: ignore[no-untyped-def]
    """Channels ``[c0, c1)``: per channel ``sum(dy)`` and ``sum(dy*(x - mean))`` (float64,
    into ``db`` and, times rstd, ``dw``) and, on a channel ``_far_from_zero``, ``sum(x -
    mean)``, then with ``training`` (batch statistics)
    ``dx = a*(dy - mean(dy)) + k1*xhat`` with ``a = rstd*w``, ``xhat = (x - mean)*rstd``,
    ``k1 = -rstd*w*mean(dy*xhat)`` (over the M = N*S values; ``_batch_dx_coefs``), else
    (running statistics) ``dx = a*dy`` alone. Pipelined as the rows above: writing
    channel c's dx, it takes channel c + 1's sums."""
    N, S = x.shape[0], x.shape[2]
    M = N * S
    s = np.empty(4, dtype=dx.dtype)
    s[0] = 0.0
    zero = s[0]  # 0 in the data's dtype
    px = np.zeros(1, dtype=dx.dtype)  # a span's sum(x - mean), in the data's dtype (see SPAN)
    if c1 <= c0:
        return
    sd = sdx = sxc = 0.0  # channel c's sum(dy), sum(dy*(x - mean)), sum(x - mean)
    for c in range(c0 - 1, c1):
        write, add, ch, n1 = _one_ahead(c, c0, c1)
        m = mean[ch]
        rs = np.float64(rstd[ch])
        wc = np.float64(w[ch])
        if write:
            db[c] = sd
            dw[c] = _batch_dw(m, rs, sd, sdx, sxc, M, training)
        a, k1, d_hi, d_lo = _batch_dx_coefs(m, rs, wc, sd, sdx, sxc, M, s)
        rc = rstd[ch]
        sd = sdx = sxc = 0.0
        pd = pdx = 0.0  # the same over this span of samples (and px[0])
        far = _far_from_zero(mean[n1], rstd[n1])  # (else channel n1's sum(x - mean) is not read)
        for n in range(N):
            xr, dyr, dxr, x1, dy1 = x[n, ch], dy[n, ch], dx[n, ch], x[n, n1], dy[n, n1]
            for lo in range(0, S, CHUNK):
                hi = min(lo + CHUNK, S)
                if add and far:
                    u, v, t = _sums_dy_dev(dy1, x1, lo, hi, mean[n1], zero)
                    pd += u
                    pdx += v
                    px[0] += t
                elif add:
                    u, v = _sums_dy(dy1, x1, lo, hi, mean[n1])
                    pd += u
                    pdx += v
                if write:
                    if training:
                        _batch_dx_span(dyr, xr, dxr, lo, hi, a, k1, m, rc, d_hi, d_lo)
                    else:  # dx does not depend on x: a NaN or inf in x, or x - mean
                        _scale_dy_span(dyr, dxr, lo, hi, a)  # overflowing, stays out of it
            if (n + 1) % SPAN == 0 or n + 1 == N:  # the span's sums into the totals
                sd += pd
                sdx += pdx
                sxc += px[0]
                pd = pdx = 0.0
                px[0] = 0.0


# With the running statistics (a frozen BatchNorm's backward, and InstanceNorm's with
# running statistics) dx = rstd*w*dy needs no sum, so one pass in memory order can take
# every sum and write dx from each chunk while it is in cache: dy and x read from memory
# once. Timed on a 2-vCPU AMD EPYC (2026-12-07, float32, the loops alone on one thread, 15
# interleaved rounds, medians of the per-round ratios) against ``channel_backward``'s
# pipeline: 0.40-0.45x its time at (32, 64, 56, 56) and (32, 64, 28, 28), 0.54x at (16,
# 256, 16, 16), 0.72-0.74x at (8, 128, 28, 28) and (4, 64, 64, 64) (0.49x in float64),
# 0.96x at (1, 64, 65536), with bitwise the same results.
@_loop
def channel_running_backward(dy, x, mean, rstd, w, dx, dw, db, c0, c1):  # type: ignore[no-untyped-def]
    """``channel_backward`` with the running statistics (``training`` false) for channels
    ``[c0, c1)`` of dy, x, dx (N,C,S): ``dx = a*dy``, ``a = rstd*w``, ``dbias = sum(dy)``
    and ``dweight = rstd*sum(dy*(x - mean))`` (xhat is not centred again: its mean is a
    constant here, and ``_batch_dw`` takes it as it is), in one pass through memory in
    its own order, sample by sample: each chunk of CHUNK values of a channel's row gives
    its sums, then its dx, while it is in cache. Each channel's sums are added chunk by
    chunk and span by span (SPAN samples) in ``channel_backward``'s order, by the helper
    it takes (``_sums_dy_dev`` on a channel ``_far_from_zero``, else ``_sums_dy``):
    bitwise its results."""
    N, S = x.shape[0], x.shape[2]
    k = max(0, c1 - c0)
    a = np.empty(k, dtype=dx.dtype)  # rstd*w, per channel
    sd = np.zeros(k)  # sum(dy) and sum(dy*(x - mean)) (float64),
    sdx = np.zeros(k)
    pd = np.zeros(k)  # and the same over this span of samples
    pdx = np.zeros(k)
    far = np.empty(k, dtype=np.bool_)  # per channel, channel_backward's helper (see below)
    zero = np.zeros(1, dtype=dx.dtype)[0]  # 0 in the data's dtype
    for c in range(c0, c1):
        a[c - c0] = np.float64(rstd[c]) * np.float64(w[c])
        far[c - c0] = _far_from_zero(mean[c], rstd[c])
    for n in range(N):
        for c in range(c0, c1):
            j = c - c0
            xr, dyr, dxr, m, ac = x[n, c], dy[n, c], dx[n, c], mean[c], a[j]
            for lo in range(0, S, CHUNK):
                hi = min(lo + CHUNK, S)
                # the third sum, sum(x - mean), is not needed here, but the two helpers'
                # vectorized sums may add in different orders (compiled for AVX2 they did):
                # so it takes the helper channel_backward and the blocks take for the
                # channel, and their sums, bitwise
                if far[j]:
                    u, v, _ = _sums_dy_dev(dyr, xr, lo, hi, m, zero)
                else:
                    u, v = _sums_dy(dyr, xr, lo, hi, m)
                pd[j] += u
                pdx[j] += v
                _scale_dy_span(dyr, dxr, lo, hi, ac)  # (dx does not depend on x: see channel_backward)
        if (n + 1) % SPAN == 0 or n + 1 == N:  # the span's sums into the totals
            for j in range(k):
                sd[j] += pd[j]
                sdx[j] += pdx[j]
                pd[j] = 0.0
                pdx[j] = 0.0
    for c in range(c0, c1):
        db[c] = sd[c - c0]
        dw[c] = _batch_dw(mean[c], np.float64(rstd[c]), sd[c - c0], sdx[c - c0], 0.0, N * S, False)


# Channels of short rows (S < CHUNK values per sample; BatchNorm1d's (N, C) input has S =
# 1): taking one channel at a time would read every sample's row of a few bytes from a
# cache line of its own, C*S values apart. So these loops take a block of channels [a, e)
# at a time, whose N rows ``x[n, a*S:e*S]`` are contiguous and, for a block of the size
# the caller picks, stay in cache between the passes. Each channel's sums are added in one
# order (one sum per row, spans of SPAN samples), from the same helpers or, at S = 1, the
# same operations in loops over the rows and across the channels (``_across_*``,
# vectorized across the channels): the results do not depend on which loops ran, nor on
# the blocks (and the backward's sums are those of ``channel_backward``). (Each row of x
# here is a sample: ``x[n, lo + j]`` is channel j of the block that begins at ``lo``.)
#
# With many samples the threads split the samples instead of the channels (threads that
# split the channels wrote, and read, neighbouring parts of every row: BatchNorm1d's (N,
# C) training was 2x slower with two threads than with one). Each thread takes whole spans
# of samples, and writes each span's sums (``channel_span_sums``, ``channel_span_dy_sums``)
# for the caller to add in order (``add_spans``); then each thread writes its samples'
# output (``channel_block_forward`` with the statistics) or dx (``channel_dx``, with the
# coefficients of ``channel_grads``).


@_loop
def _across_sum(x, n0, n1, lo, t):  # type: ignore[no-untyped-def]
    """``t += x[n, lo:lo + len(t)]`` for every row n in ``[n0, n1)`` (one value per channel)."""
    base = uint64(lo)
    for n in range(n0, n1):
        for j in range(uint64(0), uint64(t.shape[0])):
            t[j] += x[n, base + j]


@_loop
def _across_sq_dev(x, n0, n1, lo, m, t):  # type: ignore[no-untyped-def]
    """``t += (x[n, lo:lo + len(t)] - m)^2`` for every row n in ``[n0, n1)``, ``m`` float64."""
    base = uint64(lo)
    for n in range(n0, n1):
        for j in range(uint64(0), uint64(t.shape[0])):
            d = x[n, base + j] - m[j]
            t[j] += d * d


@_loop
def _across_affine(x, y, lo, m_hi, m_lo, sc, bc):  # type: ignore[no-untyped-def]
    """``y = ((x - m_hi) - m_lo)*sc + bc`` on ``[:, lo:lo + len(sc)]`` (``_affine_span``'s,
    per channel)."""
    base = uint64(lo)
    for n in range(x.shape[0]):
        for j in range(uint64(0), uint64(sc.shape[0])):
            y[n, base + j] = ((x[n, base + j] - m_hi[j]) - m_lo[j]) * sc[j] + bc[j]


@_loop
def _across_sums_dy(dy, x, n0, n1, lo, m, sd, sdx, sxc, centre):  # type: ignore[no-untyped-def]
    """``sd += dy``, ``sdx += dy*(x - m)`` and, with ``centre``, ``sxc += x - m`` on ``[n,
    lo:lo + len(sd)]`` for every row n in ``[n0, n1)`` (``_sums_dy_dev``'s, per channel;
    ``sxc`` a span's: BatchNorm's in the data's dtype, GroupNorm's float64)."""
    base = uint64(lo)
    for n in range(n0, n1):
        if centre:
            for j in range(uint64(0), uint64(sd.shape[0])):
                d = dy[n, base + j]
                xc = x[n, base + j] - m[j]
                sd[j] += d
                sdx[j] += d * xc
                sxc[j] += xc
        else:
            for j in range(uint64(0), uint64(sd.shape[0])):
                d = dy[n, base + j]
                sd[j] += d
                sdx[j] += d * (x[n, base + j] - m[j])


@_loop
def _across_dx(dy, x, dx, lo, a, k1, m, rc, d_hi, d_lo):  # type: ignore[no-untyped-def]
    """``dx = a*((dy - d_hi) - d_lo) + k1*((x - m)*rc)`` on ``[:, lo:lo + len(a)]``
    (``_batch_dx_span``'s, per channel)."""
    base = uint64(lo)
    for n in range(x.shape[0]):
        for j in range(uint64(0), uint64(a.shape[0])):
            i = base + j
            dx[n, i] = a[j] * ((dy[n, i] - d_hi[j]) - d_lo[j]) + k1[j] * ((x[n, i] - m[j]) * rc[j])


@_loop
def _across_scale_dy(dy, dx, lo, a):  # type: ignore[no-untyped-def]
    """``dx = a*dy`` on ``[:, lo:lo + len(a)]`` (``_scale_dy_span``'s, per channel)."""
    base = uint64(lo)
    for n in range(dy.shape[0]):
        for j in range(uint64(0), uint64(a.shape[0])):
            dx[n, base + j] = a[j] * dy[n, base + j]


@_loop
def _span_sums(x, n0, n1, lo, S, dev, m, t):  # type: ignore[no-untyped-def]
    """``t`` (float64 (k,)) = each channel's sum over samples ``[n0, n1)`` of the block of
    k channels of S values that begins at ``lo`` in the rows of x: of its values, or with
    ``dev`` of their squared deviations from ``m`` (float64 (k,))."""
    t.fill(0.0)
    if S == 1:
        if dev:
            _across_sq_dev(x, n0, n1, lo, m, t)
        else:
            _across_sum(x, n0, n1, lo, t)
        return
    for n in range(n0, n1):
        xr = x[n]
        for j in range(t.shape[0]):
            jlo, jhi = lo + j * S, lo + (j + 1) * S
            t[j] += _sum_sq_dev(xr, jlo, jhi, m[j]) if dev else _sum(xr, jlo, jhi)


@_loop
def _span_dy_sums(dy, x, n0, n1, lo, S, m, r, far, sd, sdx, sxc):  # type: ignore[no-untyped-def]
    """``sd``, ``sdx`` (float64 (k,)) and ``sxc`` (the data's dtype) = each channel's
    ``sum(dy)``, ``sum(dy*(x - m))``, ``sum(x - m)`` over samples ``[n0, n1)``, the block
    of k channels beginning at ``lo`` (m, r (k,)). ``sxc``, which ``_batch_dx_coefs``
    reads on the channels ``_far_from_zero`` only, is 0 on a block with none (``far``:
    ``_any_far`` of the block's channels); with one value per channel and sample it is
    taken on every channel of a block with one (vectorized across the channels), with
    more on each channel that is far itself (as ``channel_backward`` takes it: the same
    helper for each channel's sums, so the same sums)."""
    sd.fill(0.0)
    sdx.fill(0.0)
    sxc.fill(0.0)
    if S == 1:
        _across_sums_dy(dy, x, n0, n1, lo, m, sd, sdx, sxc, far)
        return
    s = np.empty(1, dtype=x.dtype)
    s[0] = 0.0
    zero = s[0]  # 0 in the data's dtype
    for n in range(n0, n1):
        xr, dyr = x[n], dy[n]
        for j in range(sd.shape[0]):
            jlo, jhi = lo + j * S, lo + (j + 1) * S
            if far and _far_from_zero(m[j], r[j]):
                u, v, t = _sums_dy_dev(dyr, xr, jlo, jhi, m[j], zero)
                sxc[j] += t
            else:
                u, v = _sums_dy(dyr, xr, jlo, jhi, m[j])
            sd[j] += u
            sdx[j] += v


@_loop
def add_spans(parts, t):  # type: ignore[no-untyped-def]
    """``t`` (float64 (C,)) = the sum of the spans' sums ``parts`` ((spans, C), float64 or,
    for sum(x - mean), the data's dtype), added in order (as the channel loops add them)."""
    t.fill(0.0)
    for k in range(parts.shape[0]):
        for j in range(t.shape[0]):
            t[j] += parts[k, j]


@_loop
def channel_span_sums(x, S, dev, m, parts, k0, k1):  # type: ignore[no-untyped-def]
    """Spans ``[k0, k1)`` of SPAN samples of x (N,C*S): ``parts[k]`` = every channel's sum
    over span k (``_span_sums``: of the values, or with ``dev`` of their squared
    deviations from the float64 mean ``m`` (C,))."""
    N = x.shape[0]
    for k in range(k0, k1):
        _span_sums(x, k * SPAN, min((k + 1) * SPAN, N), 0, S, dev, m, parts[k])


@_loop
def channel_span_dy_sums(dy, x, S, m, r, sd, sdx, sxc, k0, k1):  # type: ignore[no-untyped-def]
    """Spans ``[k0, k1)`` of SPAN samples of dy, x (N,C*S): ``sd[k]``, ``sdx[k]``,
    ``sxc[k]`` = every channel's ``sum(dy)``, ``sum(dy*(x - m))`` and ``sum(x - m)`` over
    span k (m, r (C,) the data's dtype; ``_span_dy_sums``)."""
    N = x.shape[0]
    far = _any_far(m, r)
    for k in range(k0, k1):
        _span_dy_sums(dy, x, k * SPAN, min((k + 1) * SPAN, N), 0, S, m, r, far, sd[k], sdx[k], sxc[k])


@_loop
def channel_block_forward(x, w, b, eps, training, mean, var, rstd, y, B, c0, c1):  # type: ignore[no-untyped-def]
    """BatchNorm's forward (as ``channel_forward``) for short channel rows, x (N,C,S) as
    (N,C*S) and y likewise, in blocks of B channels (see above): the statistics two-pass
    over each block, which stays in cache."""
    N, S = x.shape[0], x.shape[1] // mean.shape[0]
    M = N * S
    s = np.empty(3, dtype=y.dtype)
    nb = max(0, min(B, c1 - c0))
    t = np.empty(nb)  # the block's channel sums (float64), and one span's
    p = np.empty(nb)
    sc = np.empty(nb, dtype=y.dtype)  # rstd*w, b and the mean split, per channel
    bc = np.empty(nb, dtype=y.dtype)
    m_hi = np.empty(nb, dtype=y.dtype)
    m_lo = np.empty(nb, dtype=y.dtype)
    for a in range(c0, c1, B):
        e = min(a + B, c1)
        k, lo = e - a, a * S  # the block's channels, and where its rows begin
        m, v, tb, pb = mean[a:e], var[a:e], t[:k], p[:k]
        if training:
            for q in (False, True):  # the sums, then the squared deviations from the mean
                tb.fill(0.0)
                for n0 in range(0, N, SPAN):
                    _span_sums(x, n0, min(n0 + SPAN, N), lo, S, q, m, pb)
                    for j in range(k):  # (a loop: array expressions take seconds to compile)
                        tb[j] += pb[j]
                for j in range(k):
                    if q:
                        v[j] = tb[j] / M
                    else:
                        m[j] = tb[j] / M
        for j in range(k):
            c = a + j
            rs, m_hi[j], m_lo[j] = _row_stats(mean[c], var[c], eps, s)
            rstd[c] = rs
            sc[j] = rs * w[c]
            bc[j] = b[c]
        if S == 1:
            _across_affine(x, y, lo, m_hi[:k], m_lo[:k], sc[:k], bc[:k])
        else:
            for n in range(N):
                xr, yr = x[n], y[n]
                for j in range(k):
                    _affine_span(xr, yr, lo + j * S, lo + (j + 1) * S, m_hi[j], m_lo[j], sc[j], bc[j])


@_loop
def channel_dx(dy, x, dx, lo, S, training, av, k1v, m, r, dhv, dlv):  # type: ignore[no-untyped-def]
    """dx of the block of k = len(av) channels of S values beginning at ``lo``, on every
    row (sample) of dy, x, dx (n,C*S): ``a*(dy - mean(dy)) + k1*xhat`` (``training``; the
    mean split in ``dhv``, ``dlv``) or ``a*dy``, per channel."""
    k = av.shape[0]
    if S == 1:  # vectorized across the channels (eval's span loop of one value: 1.6x slower)
        if training:
            _across_dx(dy, x, dx, lo, av, k1v, m, r, dhv, dlv)
        else:
            _across_scale_dy(dy, dx, lo, av)
        return
    for n in range(x.shape[0]):
        xr, dyr, dxr = x[n], dy[n], dx[n]
        for j in range(k):
            jlo, jhi = lo + j * S, lo + (j + 1) * S
            if training:
                _batch_dx_span(dyr, xr, dxr, jlo, jhi, av[j], k1v[j], m[j], r[j], dhv[j], dlv[j])
            else:  # dx does not depend on x (see channel_backward)
                _scale_dy_span(dyr, dxr, jlo, jhi, av[j])


@_loop
def channel_grads(m, r, w, sd, sdx, sxc, M, training, dw, db, av, k1v, dhv, dlv):  # type: ignore[no-untyped-def]
    """dweight, dbias (float64; ``_batch_dw``) and dx's coefficients (``_batch_dx_coefs``,
    in ``av``'s dtype) of channels whose mean ``m``, rstd ``r``, weight ``w`` and sums over
    their M values ``sd``, ``sdx``, ``sxc`` are given (all (k,))."""
    s = np.empty(4, dtype=av.dtype)
    for j in range(av.shape[0]):
        rs = np.float64(r[j])
        db[j] = sd[j]
        dw[j] = _batch_dw(m[j], rs, sd[j], sdx[j], sxc[j], M, training)
        wc = np.float64(w[j])
        av[j], k1v[j], dhv[j], dlv[j] = _batch_dx_coefs(m[j], rs, wc, sd[j], sdx[j], sxc[j], M, s)


@_loop
def channel_block_backward(dy, x, mean, rstd, w, training, dx, dw, db, B, c0, c1):  # type: ignore[no-untyped-def]
    """``channel_backward`` for short channel rows, dy, x, dx (N,C*S), in blocks of B
    channels (see above)."""
    N, S = x.shape[0], x.shape[1] // mean.shape[0]
    nb = max(0, min(B, c1 - c0))
    sd = np.empty(nb)  # the block's sum(dy), sum(dy*(x - mean)), sum(x - mean) (float64),
    sdx = np.empty(nb)  # and one span's (sum(x - mean): in the data's dtype, see SPAN)
    sxc = np.empty(nb)
    pd = np.empty(nb)
    pdx = np.empty(nb)
    pxc = np.empty(nb, dtype=dx.dtype)
    av = np.empty(nb, dtype=dx.dtype)  # a, k1 and mean(dy) split, per channel
    k1v = np.empty(nb, dtype=dx.dtype)
    dhv = np.empty(nb, dtype=dx.dtype)
    dlv = np.empty(nb, dtype=dx.dtype)
    for a in range(c0, c1, B):
        e = min(a + B, c1)
        k, lo = e - a, a * S  # the block's channels, and where its rows begin
        m, r = mean[a:e], rstd[a:e]
        sd.fill(0.0)
        sdx.fill(0.0)
        sxc.fill(0.0)
        far = _any_far(m, r)
        for n0 in range(0, N, SPAN):
            _span_dy_sums(dy, x, n0, min(n0 + SPAN, N), lo, S, m, r, far, pd[:k], pdx[:k], pxc[:k])
            for j in range(k):
                sd[j] += pd[j]
                sdx[j] += pdx[j]
                sxc[j] += pxc[j]
        sums = (sd[:k], sdx[:k], sxc[:k])
        channel_grads(
            m, r, w[a:e], *sums, N * S, training, dw[a:e], db[a:e], av[:k], k1v[:k], dhv[:k], dlv[:k]
        )
        channel_dx(dy, x, dx, lo, S, training, av[:k], k1v[:k], m, r, dhv[:k], dlv[:k])


# --- GroupNorm and InstanceNorm: (sample, group) rows of k channels of S values ----------
#
# Pipelined as the rows above (long rows one at a time where the forward's are, in both
# directions, and the backward's short rows everywhere). The forward's sums
# take the row in chunks of CHUNK values whatever its channels (a row of short channels,
# 16 of 7x7 values, then costs a few sum calls per pass instead of one per channel: with
# the pipelined loop writing each chunk's output channel by channel too, 18% faster at
# (32, 512, 7, 7) with 32 groups); the backward needs each channel's own sums, so its
# chunks never straddle two channels.


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
        rc, m_hi, m_lo = _row_stats(m, q / L, eps, s)
        if write:
            var[r] = q / L
            mean[r] = m
            rstd[r] = rc
        c0 = ((base + row) % G) * k
        q1 = 0.0  # row r + 1's squared deviations, row r + 2's sum
        t2 = 0.0
        i = 0  # the channel c0 + i, values [i*S, (i + 1)*S) of the row, that lo is in
        for lo in range(0, L, CHUNK):
            hi = min(lo + CHUNK, L)
            if add:
                t2 += _sum(x2, lo, hi)
            if dev:
                q1 += _sum_sq_dev(x1, lo, hi, m1)
            j = lo
            while write and j < hi:  # the chunk's output, channel by channel
                end = min(hi, (i + 1) * S)
                s[2] = rc * w[c0 + i]
                _affine_span(xr, yr, j, end, m_hi, m_lo, s[2], b[c0 + i])
                if end == (i + 1) * S:
                    i += 1
                j = end
        m, q, m1 = m1, q1, t2 / L


@_loop
def group_forward_long(x, w, b, k, eps, y, mean, rstd, var, base, r0, r1):  # type: ignore[no-untyped-def]
    """``group_forward`` for long rows (the callers: ``one_row_at_a_time``; correct for
    any length): one row at a time, no pipeline, as
    ``layer_norm_forward_long``; the output channel by channel, one call per channel.
    Bitwise the pipelined loop's results."""
    L = x.shape[1]
    S = L // k
    G = w.shape[0] // k
    s = np.empty(3, dtype=y.dtype)
    for r in range(r0, r1):
        xr, yr = x[r], y[r]  # L, L
        t = 0.0  # float64: the row's sum, then its squared deviations
        for lo in range(0, L, CHUNK):
            t += _sum(xr, lo, min(lo + CHUNK, L))
        m = t / L
        q = 0.0
        for lo in range(0, L, CHUNK):
            q += _sum_sq_dev(xr, lo, min(lo + CHUNK, L), m)
        rc, m_hi, m_lo = _row_stats(m, q / L, eps, s)
        var[r] = q / L
        mean[r] = m
        rstd[r] = rc
        c0 = ((base + r) % G) * k
        for i in range(k):  # channel c0 + i: values [i*S, (i + 1)*S) of the row
            s[2] = rc * w[c0 + i]
            _affine_span(xr, yr, i * S, (i + 1) * S, m_hi, m_lo, s[2], b[c0 + i])


@_loop
def group_backward(dy, x, mean, rstd, w, k, dx, sdy, sdyx, base, r0, r1):  # type: ignore[no-untyped-def]
    """Rows ``[r0, r1)`` (see ``group_forward``): per channel row ``sum(dy)`` and
    ``sum(dy*(x - mean))`` (float64, into ``sdy``, ``sdyx`` (R*k,)), combined with the
    weights into ``sg = sum(g)``, ``sgx = sum(g*(x - mean))`` (``g = dy*w_c``), then
    ``dx = rstd*w_c*dy + k1*xhat + k0``, ``xhat = (x - mean)*rstd``,
    ``k1 = -rstd*(sgx*rstd)/L``, ``k0 = -rstd*sg/L``, xhat centred again first with the
    row's ``sum(x - mean)`` where the row is far from 0 (``_row_dx_coefs``,
    ``_centred_sum``). Pipelined (see above): writing row r's dx, it takes row r + 1's
    sums."""
    L = x.shape[1]
    S = L // k
    G = w.shape[0] // k
    s = np.empty(3, dtype=dx.dtype)
    if r1 <= r0:
        return
    sx = 0.0  # row r's sum(x - mean)
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
        csx = _centred_sum(sx, m, rs)
        _, k1, k0 = _row_dx_coefs(rs, sg, sgx, csx, L, s)
        if write:
            _centre_row_sums(sdy, sdyx, row * k, k, csx, L)  # for dweight
        rc = rstd[row]
        sx = 0.0
        far = _far_from_zero(mean[n], rstd[n])  # (else row n's sum(x - mean) is not taken)
        for i in range(k):
            s[0] = rs * w[c0 + i]
            a = s[0]
            end = (i + 1) * S  # channel c0 + i
            u = 0.0
            v = 0.0
            for lo in range(i * S, end, CHUNK):
                hi = min(lo + CHUNK, end)
                if add and far:
                    p, q, t = _sums_dy_dev(dy1, x1, lo, hi, mean[n], 0.0)
                    u += p
                    v += q
                    sx += t
                elif add:
                    p, q = _sums_dy(dy1, x1, lo, hi, mean[n])
                    u += p
                    v += q
                if write:
                    _dx_span(dyr, xr, dxr, lo, hi, a, k1, m, rc, k0)
            if add:
                sdy[n * k + i] = u
                sdyx[n * k + i] = v


@_loop
def group_backward_short(dy, x, mean, rstd, w, k, dx, sdy, sdyx, base, r0, r1):  # type: ignore[no-untyped-def]
    """``group_backward`` for short rows (a few KB): one row at a time, its sums, then its
    dx, with no pipeline (the hardware fetches short rows in time on its own, and the
    pipeline's steps cost more than they hide there); for long rows too where the forward
    takes them one at a time (``one_row_at_a_time``: AMD hosts). The same sums, chunk by chunk in
    the same order, and the same dx: bitwise ``group_backward``'s results. (The row's
    dx coefficients are written out as there: as one helper called from both, the
    backward measured 1.6x slower at InstanceNorm (32, 512, 7, 7).)"""
    L = x.shape[1]
    S = L // k
    G = w.shape[0] // k
    s = np.empty(3, dtype=dx.dtype)
    for r in range(r0, r1):
        xr, dyr, dxr = x[r], dy[r], dx[r]
        m = mean[r]
        rs = np.float64(rstd[r])
        c0 = ((base + r) % G) * k
        sx = 0.0  # the row's sum(x - mean), taken where it is far from 0 (_centred_sum)
        far = _far_from_zero(m, rs)
        for i in range(k):  # the row's sums per channel
            u = 0.0
            v = 0.0
            for lo in range(i * S, (i + 1) * S, CHUNK):
                hi = min(lo + CHUNK, (i + 1) * S)
                if far:
                    p, q, t = _sums_dy_dev(dyr, xr, lo, hi, m, 0.0)
                    sx += t
                else:
                    p, q = _sums_dy(dyr, xr, lo, hi, m)
                u += p
                v += q
            sdy[r * k + i] = u
            sdyx[r * k + i] = v
        sg = 0.0
        sgx = 0.0
        for i in range(k):
            wc = np.float64(w[c0 + i])
            sg += wc * sdy[r * k + i]
            sgx += wc * sdyx[r * k + i]
        csx = _centred_sum(sx, m, rs)
        _, k1, k0 = _row_dx_coefs(rs, sg, sgx, csx, L, s)
        _centre_row_sums(sdy, sdyx, r * k, k, csx, L)  # for dweight
        rc = rstd[r]
        for i in range(k):  # then its dx
            s[0] = rs * w[c0 + i]
            _dx_span(dyr, xr, dxr, i * S, (i + 1) * S, s[0], k1, m, rc, k0)


@_loop
def group_param_sums(rstd, sdy, sdyx, k, dw, db):  # type: ignore[no-untyped-def]
    """dweight and dbias (float64 (C,)) from the rows' ``rstd`` (N*G,) and the
    per-(sample, channel) sums of ``group_backward``, ``sdy``, ``sdyx`` (N*C,), channel c
    being in group ``c // k``: ``dw[c] = sum_n rstd[n, g]*sdyx[n, c]`` (sdyx centred again
    by the loops where the row is far from 0: ``_centre_row_sums``), ``db[c] = sum_n
    sdy[n, c]``, the samples added in order."""
    C = dw.shape[0]
    G = C // k
    for c in range(C):
        dw[c] = 0.0
        db[c] = 0.0
    for n in range(sdy.shape[0] // C):
        if k == 1:  # InstanceNorm: one loop over the channels (it vectorizes; 6x faster)
            for c in range(C):
                dw[c] += sdyx[n * C + c] * np.float64(rstd[n * C + c])
                db[c] += sdy[n * C + c]
            continue
        for g in range(G):  # group by group: no integer division per channel
            r = np.float64(rstd[n * G + g])
            for c in range(g * k, (g + 1) * k):
                dw[c] += sdyx[n * C + c] * r
                db[c] += sdy[n * C + c]


# --- GroupNorm and InstanceNorm on channels-last input: a sample's S rows of C values ----
#
# A channels-last (N, C, *spatial) input holds each sample as S rows of C values (one per
# channel), a group being k neighbouring columns. Its sums are taken down the columns into
# C float64 accumulators at once (``_across_*``, vectorized across the channels), then
# added group by group; the sample (S*C values) stays in cache between its passes. As a
# (sample, group) row of the loops above, a group is a strided gather: such input was
# staged into (N, C, S) order block by block, and its output written back through scratch
# (2-3x torch's time, which has a channels-last kernel).
#
# A sample's sums are taken span by span, a span being ``rows`` of its S rows (the caller
# picks ``rows`` from C alone): each span's sums into float64 partials, added into the
# sample's totals in span order. With fewer samples than threads, the threads split the
# samples' spans (``group_rows_partials``, ``group_rows_dy_partials``: a span per unit of
# work), and the caller's one call per sample adds the partials in the same order
# (``group_rows_statistics``, ``group_rows_coefficients``): the results are bitwise those
# of ``group_rows_forward``/``_backward``, whatever the thread count.


@_loop
def _span_of(u, spans, rows, S):  # type: ignore[no-untyped-def]
    """Unit u of the samples' spans (``spans`` per sample): its sample and rows [r0, r1)."""
    n = u // spans
    r0 = (u - n * spans) * rows
    return n, r0, min(S, r0 + rows)


@_loop
def _add_into(t, part):  # type: ignore[no-untyped-def]
    for j in range(t.shape[0]):
        t[j] += part[j]


@_loop
def _sample_sums(xn, rows, dev, m, part, t):  # type: ignore[no-untyped-def]
    """``t`` = the column sums of xn (S,C) (with ``dev``: of the squared deviations from
    ``m``), span by span: each span's into ``part``, added into ``t`` in order."""
    t.fill(0.0)
    for r0 in range(0, xn.shape[0], rows):
        part.fill(0.0)
        r1 = min(xn.shape[0], r0 + rows)
        if dev:
            _across_sq_dev(xn, r0, r1, 0, m, part)
        else:
            _across_sum(xn, r0, r1, 0, part)
        _add_into(t, part)


@_loop
def _sample_dy_sums(dyn, xn, rows, m, far, pd, pdx, pxc, sd, sdx, sxc):  # type: ignore[no-untyped-def]
    """``sd``, ``sdx``, ``sxc`` = the column sums of dyn, of dyn*(xn - m) and, where
    ``far`` (some group of the sample far from 0), of xn - m (else 0), (S,C), span by span (``_sample_sums``'s
    order)."""
    sd.fill(0.0)
    sdx.fill(0.0)
    sxc.fill(0.0)
    for r0 in range(0, xn.shape[0], rows):
        pd.fill(0.0)
        pdx.fill(0.0)
        pxc.fill(0.0)
        _across_sums_dy(dyn, xn, r0, min(xn.shape[0], r0 + rows), 0, m, pd, pdx, pxc, far)
        _add_into(sd, pd)
        _add_into(sdx, pdx)
        _add_into(sxc, pxc)


@_loop
def _group_means(t, k, L, mc):  # type: ignore[no-untyped-def]
    """``mc``: each channel's group mean (float64), from the channels' sums ``t``."""
    for g in range(t.shape[0] // k):
        u = 0.0
        for c in range(g * k, (g + 1) * k):
            u += t[c]
        for c in range(g * k, (g + 1) * k):
            mc[c] = u / L


@_loop
def _group_statistics(t, mc, k, L, eps, w, b, r0, mean, rstd, var, sc, bc, m_hi, m_lo, s):  # type: ignore[no-untyped-def]
    """From the channels' squared deviations ``t`` about their group means ``mc``: each
    group's mean, rstd and biased variance (rows ``r0 + g`` of ``mean``, ``rstd``, ``var``),
    and per channel the output's coefficients (``sc = rstd*w``, ``bc = b``, the mean split
    into ``m_hi + m_lo``)."""
    for g in range(t.shape[0] // k):
        q = 0.0
        for c in range(g * k, (g + 1) * k):
            q += t[c]
        rc, hi, lo = _row_stats(mc[g * k], q / L, eps, s)
        var[r0 + g] = q / L
        mean[r0 + g] = mc[g * k]
        rstd[r0 + g] = rc
        for c in range(g * k, (g + 1) * k):
            s[2] = rc * w[c]
            sc[c] = s[2]
            bc[c] = b[c]
            m_hi[c] = hi
            m_lo[c] = lo


@_loop
def _group_dx_coefficients(sd, sdx, sxc, i, mean, rstd, w, k, L, sdy, sdyx, av, k1v, k0v, rcv, s):  # type: ignore[no-untyped-def]
    """For the input's sample i, from its channels' ``sum(dy)``, ``sum(dy*(x - mean))``
    and ``sum(x - mean)`` (``sd``, ``sdx``, ``sxc``; the first two kept in ``sdy``,
    ``sdyx``): per channel dx's coefficients ``a = rstd*w_c`` and the group's ``k1 =
    -rstd*(sgx*rstd)/L``, ``k0 = -rstd*sg/L`` (``sg`` = sum(w*dy), ``sgx`` =
    sum(w*dy*(x - mean)) over the group; xhat centred again first where the group is far
    from 0: ``_row_dx_coefs``, ``_centred_sum``), and its rstd."""
    C = sd.shape[0]
    G = C // k
    for g in range(G):
        rs = np.float64(rstd[i * G + g])
        sg = 0.0
        sgx = 0.0
        sx = 0.0
        for c in range(g * k, (g + 1) * k):
            sdy[i * C + c] = sd[c]
            sdyx[i * C + c] = sdx[c]
            wc = np.float64(w[c])
            sg += wc * sd[c]
            sgx += wc * sdx[c]
            sx += sxc[c]
        csx = _centred_sum(sx, mean[i * G + g], rs)
        _row_dx_coefs(rs, sg, sgx, csx, L, s)
        _centre_row_sums(sdy, sdyx, i * C + g * k, k, csx, L)  # for dweight
        for c in range(g * k, (g + 1) * k):
            s[0] = rs * w[c]
            av[c] = s[0]
            k1v[c] = s[1]
            k0v[c] = s[2]
            rcv[c] = rstd[i * G + g]


@_loop
def _group_mean_per_channel(mean, i, k, mc):  # type: ignore[no-untyped-def]
    """``mc``: each channel's group mean for the input's sample i."""
    G = mc.shape[0] // k
    for g in range(G):
        for c in range(g * k, (g + 1) * k):
            mc[c] = mean[i * G + g]


@_loop
def _across_group_dx(dy, x, dx, a, k1, m, rc, k0):  # type: ignore[no-untyped-def]
    """``dx = a*dy + k1*xhat + k0``, ``xhat = (x - m)*rc`` on every row of dy, x, dx
    (S,C), per channel (``_dx_span``'s)."""
    for n in range(x.shape[0]):
        for j in range(uint64(0), uint64(a.shape[0])):
            dx[n, j] = a[j] * dy[n, j] + k1[j] * ((x[n, j] - m[j]) * rc[j]) + k0[j]


@_loop
def group_rows_forward(x, w, b, k, eps, rows, y, mean, rstd, var, base, n0, n1):  # type: ignore[no-untyped-def]
    """Samples ``[n0, n1)`` of x (n,S,C), channels-last, sample j being the input's sample
    ``base + j``, in groups of k channels (G = C/k): each group's mean, rstd and biased
    variance (into ``mean``, ``rstd``, ``var`` (float64), the input's (N*G,) rows), two-pass
    over the cached sample (float64 sums per channel, span by span, added per group), then
    ``y = (x - mean)*rstd*w_c + b_c`` (``group_forward``'s, per channel)."""
    S, C = x.shape[1], x.shape[2]
    G = C // k
    L = S * k
    s = np.empty(3, dtype=y.dtype)
    t = np.empty(C)  # the channels' sums (float64)
    part = np.empty(C)  # a span's
    mc = np.empty(C)  # their group's mean (float64)
    sc = np.empty(C, dtype=y.dtype)  # rstd*w, b and the mean split, per channel
    bc = np.empty(C, dtype=y.dtype)
    m_hi = np.empty(C, dtype=y.dtype)
    m_lo = np.empty(C, dtype=y.dtype)
    for n in range(n0, n1):
        xn, yn = x[n], y[n]  # S,C  S,C
        _sample_sums(xn, rows, False, mc, part, t)
        _group_means(t, k, L, mc)
        _sample_sums(xn, rows, True, mc, part, t)
        _group_statistics(t, mc, k, L, eps, w, b, (base + n) * G, mean, rstd, var, sc, bc, m_hi, m_lo, s)
        _across_affine(xn, yn, 0, m_hi, m_lo, sc, bc)


@_loop
def group_rows_backward(dy, x, mean, rstd, w, k, rows, dx, sdy, sdyx, base, n0, n1):  # type: ignore[no-untyped-def]
    """Samples ``[n0, n1)`` of dy, x, dx (n,S,C), channels-last (see
    ``group_rows_forward``): each channel's ``sum(dy)`` and ``sum(dy*(x - mean))`` (float64,
    span by span, into ``sdy``, ``sdyx``, the input's (N*C,)), then dx from the sample in
    cache, as ``group_backward``'s: ``dx = rstd*w_c*dy + k1*xhat + k0`` with the group's
    ``k1 = -rstd*(sgx*rstd)/L``, ``k0 = -rstd*sg/L``, xhat centred again first, on the
    groups far from 0, with the channels' ``sum(x - mean)`` (``_group_dx_coefficients``;
    the sum is taken only on samples with such a group, ``_any_far``)."""
    S, C = x.shape[1], x.shape[2]
    G = C // k
    L = S * k
    s = np.empty(3, dtype=dx.dtype)
    sd = np.empty(C)  # the channels' sums (float64), and a span's
    sdx = np.empty(C)
    sxc = np.empty(C)
    pd = np.empty(C)
    pdx = np.empty(C)
    pxc = np.empty(C)
    mc = np.empty(C, dtype=dx.dtype)  # the group's mean, rstd and dx's coefficients, per channel
    rcv = np.empty(C, dtype=dx.dtype)
    av = np.empty(C, dtype=dx.dtype)
    k1v = np.empty(C, dtype=dx.dtype)
    k0v = np.empty(C, dtype=dx.dtype)
    for n in range(n0, n1):
        xn, dyn, dxn = x[n], dy[n], dx[n]  # S,C each
        i = base + n  # the input's sample
        _group_mean_per_channel(mean, i, k, mc)
        far = _any_far(mean[i * G : (i + 1) * G], rstd[i * G : (i + 1) * G])  # (the sample's groups)
        _sample_dy_sums(dyn, xn, rows, mc, far, pd, pdx, pxc, sd, sdx, sxc)
        _group_dx_coefficients(sd, sdx, sxc, i, mean, rstd, w, k, L, sdy, sdyx, av, k1v, k0v, rcv, s)
        _across_group_dx(dyn, xn, dxn, av, k1v, mc, rcv, k0v)


@_loop
def group_rows_partials(x, rows, dev, m, part, u0, u1):  # type: ignore[no-untyped-def]
    """Units ``[u0, u1)`` of the spans of x's samples (n,S,C): ``part[u]`` = the column sums
    of unit u's rows (with ``dev``: of their squared deviations from ``m[n]``, float64
    (n,C)), as ``_sample_sums`` takes each span."""
    S = x.shape[1]
    spans = (S + rows - 1) // rows
    for u in range(u0, u1):
        n, r0, r1 = _span_of(u, spans, rows, S)
        p = part[u]
        p.fill(0.0)
        if dev:
            _across_sq_dev(x[n], r0, r1, 0, m[n], p)
        else:
            _across_sum(x[n], r0, r1, 0, p)


@_loop
def group_rows_statistics(part, spans, dev, k, L, eps, w, b, base, mc, mean, rstd, var, sc, bc, m_hi, m_lo):  # type: ignore[no-untyped-def]
    """Per sample n of ``mc`` (n,C): its spans' partials added in order; without ``dev``
    (the sums) each channel's group mean into ``mc[n]``; with it (the squared deviations)
    the statistics of the input's sample ``base + n`` and the output's coefficients
    (n,C), as ``group_rows_forward`` takes them."""
    C = mc.shape[1]
    G = C // k
    t = np.empty(C)
    s = np.empty(3, dtype=sc.dtype)
    for n in range(mc.shape[0]):
        t.fill(0.0)
        for u in range(n * spans, (n + 1) * spans):
            _add_into(t, part[u])
        if dev:
            _group_statistics(
                t, mc[n], k, L, eps, w, b, (base + n) * G, mean, rstd, var, sc[n], bc[n], m_hi[n], m_lo[n], s
            )
        else:
            _group_means(t, k, L, mc[n])


@_loop
def group_rows_affine(x, y, rows, m_hi, m_lo, sc, bc, u0, u1):  # type: ignore[no-untyped-def]
    """Units ``[u0, u1)`` of the spans of x's samples (n,S,C): ``y = ((x - m_hi) - m_lo)*sc
    + bc`` on the unit's rows, with its sample's coefficients (n,C)."""
    S = x.shape[1]
    spans = (S + rows - 1) // rows
    for u in range(u0, u1):
        n, r0, r1 = _span_of(u, spans, rows, S)
        _across_affine(x[n, r0:r1], y[n, r0:r1], 0, m_hi[n], m_lo[n], sc[n], bc[n])


@_loop
def group_rows_dy_partials(dy, x, rows, m, mean, rstd, pd, pdx, pxc, u0, u1):  # type: ignore[no-untyped-def]
    """Units ``[u0, u1)`` of the spans of the samples of dy and x (n,S,C): ``pd[u]``,
    ``pdx[u]``, ``pxc[u]`` = the column sums of dy, dy*(x - m[n]) and x - m[n] (``m``
    (n,C) in x's dtype; the last 0 on a sample with no group far from 0, from its groups'
    ``mean``, ``rstd`` (n*G,)) over the unit's rows, as ``_sample_dy_sums`` takes each
    span."""
    S = x.shape[1]
    G = mean.shape[0] // x.shape[0]
    spans = (S + rows - 1) // rows
    for u in range(u0, u1):
        n, r0, r1 = _span_of(u, spans, rows, S)
        pd[u].fill(0.0)
        pdx[u].fill(0.0)
        pxc[u].fill(0.0)
        far = _any_far(mean[n * G : (n + 1) * G], rstd[n * G : (n + 1) * G])  # (the sample's groups)
        _across_sums_dy(dy[n], x[n], r0, r1, 0, m[n], pd[u], pdx[u], pxc[u], far)


@_loop
def group_rows_coefficients(pd, pdx, pxc, spans, mean, rstd, w, k, L, base, sdy, sdyx, av, k1v, k0v, rcv):  # type: ignore[no-untyped-def]
    """Per sample n of ``av`` (n,C): its spans' partials added in order, then dx's
    coefficients for the input's sample ``base + n`` (n,C each), as
    ``group_rows_backward`` takes them."""
    C = av.shape[1]
    sd = np.empty(C)
    sdx = np.empty(C)
    sxc = np.empty(C)
    s = np.empty(3, dtype=av.dtype)
    for n in range(av.shape[0]):
        sd.fill(0.0)
        sdx.fill(0.0)
        sxc.fill(0.0)
        for u in range(n * spans, (n + 1) * spans):
            _add_into(sd, pd[u])
            _add_into(sdx, pdx[u])
            _add_into(sxc, pxc[u])
        _group_dx_coefficients(
            sd, sdx, sxc, base + n, mean, rstd, w, k, L, sdy, sdyx, av[n], k1v[n], k0v[n], rcv[n], s
        )


@_loop
def group_rows_dx(dy, x, dx, rows, av, k1v, mc, rcv, k0v, u0, u1):  # type: ignore[no-untyped-def]
    """Units ``[u0, u1)`` of the spans of the samples of dy, x, dx (n,S,C): dx on the
    unit's rows with its sample's coefficients (n,C each), as ``group_rows_backward``."""
    S = x.shape[1]
    spans = (S + rows - 1) // rows
    for u in range(u0, u1):
        n, r0, r1 = _span_of(u, spans, rows, S)
        _across_group_dx(dy[n, r0:r1], x[n, r0:r1], dx[n, r0:r1], av[n], k1v[n], mc[n], rcv[n], k0v[n])


# --- float16 <-> float32 ----------------------------------------------------------------
#
# float16 data is computed in float32 (numba has no float16 type on the CPU): the staging
# converts each block on its way in and out, from and to the float16 bits as uint16.
# NumPy's own casts take 2-3 ns per value in one thread; these loops vectorize (about 0.3
# ns per value on a 2-vCPU Xeon), bit for bit NumPy's results (round to nearest even),
# but for a NaN's payload: float32 to float16 gives every NaN as the quiet NaN of its
# sign (NumPy keeps the payload's top bits). Both are written
# in integer arithmetic on the float32 bits, with no float32 subnormal in between: a
# process whose MXCSR flushes subnormals (a library built with -ffast-math) still gets
# the exact halves. Where the CPU converts in one instruction, the staging calls the
# instruction's loops below instead. Each way (integer arithmetic, instruction) has two
# loops, float16 to float32 and back, over columns ``[lo, hi)`` of an (N, W) array's
# rows: BatchNorm's staged blocks of channels, and a whole C-ordered array as one row.


# --- transposing copies (staging a block of a Fortran-ordered input) ---------------------
#
# A block of rows of a Fortran-ordered (R, L) input (a pandas frame's ``.values``, ``x.T``
# of a C-ordered array) is L columns of n contiguous values each, to be copied into the
# C-ordered (n, L) scratch the loops read. NumPy's copy walks the scratch's rows and reads
# the block's values a column (R values) apart; where that is a multiple of 4 KiB (R a
# power of two, as batches of 2**k samples give) every read competes for the same cache
# sets, and it took 4-7 ns a value here: LayerNorm's forward+backward at (16384, 768) took
# 5.6x the C-ordered input's time. This copy takes eight of the block's columns (rows of
# its transpose) at a time, reads them side by side and writes eight contiguous values of
# each scratch row: 0.4-1 ns a value at those shapes. The eight named row views let LLVM
# keep the rows' addresses in registers (a loop over ``src_t[j, i]`` for the eight j was
# 1.2-1.8x slower on whole inputs). The staging takes it only where NumPy's copy is slowed
# (``_staging._transposing_pays``).


@_loop
def transpose_into(src_t, dst):  # type: ignore[no-untyped-def]
    """``dst[i, j] = src_t[j, i]``: ``dst`` (n, L), ``src_t`` (L, n) of the same dtype, any
    strides (fast where both have unit stride along their rows)."""
    L, n = src_t.shape
    L8 = L - L % 8
    for j in range(0, L8, 8):  # eight of src_t's rows, side by side
        r0, r1, r2, r3 = src_t[j], src_t[j + 1], src_t[j + 2], src_t[j + 3]
        r4, r5, r6, r7 = src_t[j + 4], src_t[j + 5], src_t[j + 6], src_t[j + 7]
        for i in range(n):
            d = dst[i]
            d[j], d[j + 1], d[j + 2], d[j + 3] = r0[i], r1[i], r2[i], r3[i]
            d[j + 4], d[j + 5], d[j + 6], d[j + 7] = r4[i], r5[i], r6[i], r7[i]
    for j in range(L8, L):  # the last L % 8 rows one at a time
        r = src_t[j]
        for i in range(n):
            dst[i, j] = r[i]


# the casts run compiled (their bit casts have no Python version: under
# NUMBA_DISABLE_JIT=1, where the loops run as Python, the staging casts with NumPy)
CASTS_COMPILED = not numba_config.DISABLE_JIT  # type: ignore[attr-defined]  # (set at run time)


@intrinsic
def _float_bits(typingctx, f):  # type: ignore[no-untyped-def]
    """The bits of a float32 as a uint32 (no conversion)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_float(typingctx, u):  # type: ignore[no-untyped-def]
    """The float32 whose bits are the uint32 ``u`` (no conversion)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@_value
def _half_value_bits(h):  # type: ignore[no-untyped-def]
    """float32 of the float16 whose bits are ``h`` (uint16). A half's 5 exponent bits and 10
    mantissa bits move up to float32's 8 and 23 (the exponent's bias from 15 to 127); a
    subnormal half is its mantissa times 2^-24 (an integer conversion, exact); infinities
    and NaNs keep float32's all-ones exponent."""
    u = uint32(h)
    em = u & uint32(0x7FFF)  # exponent and mantissa, without the sign
    bits = (em << uint32(13)) + uint32(0x38000000)  # a normal half: exponent + (127 - 15)
    if em >= uint32(0x7C00):  # infinity or NaN
        bits = (em << uint32(13)) | uint32(0x7F800000)
    f = _bits_float(bits | ((u & uint32(0x8000)) << uint32(16)))
    if em < uint32(0x0400):  # zero or a subnormal half: mantissa * 2^-24, with the sign
        f = float32(int32(em)) * float32(2.0**-24)  # (int32: vectorizes without AVX-512)
        if u & uint32(0x8000):
            f = -f
    return f


@_value
def _half_bits_value(x):  # type: ignore[no-untyped-def]
    """The bits (uint16) of float16(``x``), ``x`` a float32, rounded to the nearest half,
    ties to even; beyond the largest half, infinity (as NumPy's cast)."""
    u = _float_bits(x)
    a = u & uint32(0x7FFFFFFF)  # the magnitude's bits
    if a >= uint32(0x47800000):  # 2^16 and beyond: infinity (or NaN, quiet)
        o = uint32(0x7E00) if a > uint32(0x7F800000) else uint32(0x7C00)
    elif a < uint32(0x38800000):  # below 2^-14, the smallest normal half
        # adding 0.5 puts the value's multiple of 2^-24 (a half subnormal's unit) in the
        # float's low mantissa bits, rounded to nearest even by the float addition
        o = _float_bits(_bits_float(a) + float32(0.5)) - uint32(0x3F000000)
    else:  # rebias the exponent (127 -> 15), round the 13 dropped bits to nearest even
        o = (a + uint32(0xC8000FFF) + ((a >> uint32(13)) & uint32(1))) >> uint32(13)
    return uint16(o | ((u >> uint32(16)) & uint32(0x8000)))


# --- the same casts in one instruction each, where the CPU has them ---------------------
#
# x86-64 CPUs with F16C (Intel since 2012, AMD since 2011) and 64-bit ARM convert between
# float16 and float32 in one instruction (vcvtph2ps/vcvtps2ph, fcvt), which LLVM emits for
# a float16 ``fpext``/``fptrunc``: 4x faster than the integer arithmetic above (0.06 against
# 0.26 ns per value on a 2-vCPU EPYC; forward+backward of float16 LayerNorm (32, 512, 768),
# BatchNorm2d, GroupNorm(32) and InstanceNorm2d at (32, 64, 56, 56) took 0.60-0.73x the
# time). Under the default rounding mode the instructions round to nearest even, as NumPy
# does, whether or not the thread's MXCSR flushes subnormals (tested on halves and floats
# below float16's normal range; another rounding mode changes them, as it changes the
# integer casts' subnormals); a float16 signalling NaN comes back quiet from them, so the
# half-to-float values put back NumPy's bits for NaNs. Where numba compiles for another
# target, LLVM would call a runtime conversion that numba does not link (a process
# compiling for NUMBA_CPU_NAME=generic, or with NUMBA_CPU_FEATURES=-f16c, crashed), so
# the casts stay in integer arithmetic there.


def _instructions_convert_halves() -> bool:
    """Whether numba compiles for a CPU with float16 conversion instructions: this host's,
    where numba targets it as it is (NUMBA_CPU_NAME and NUMBA_CPU_FEATURES unset). A target
    set by either (a portable cache, features taken away) gets the integer arithmetic:
    whether it has the instruction is LLVM's to work out from the names (``-avx`` takes
    F16C away too), and a wrong guess crashes the process."""
    if numba_config.CPU_NAME is not None or numba_config.CPU_FEATURES is not None:  # type: ignore[attr-defined]
        return False
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True  # (in ARMv8's floating point)
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("f16c", False))
    except Exception:  # (no host feature query on this platform)
        return False


CASTS_BY_INSTRUCTION = _instructions_convert_halves()


@intrinsic
def _half_float(typingctx, u):  # type: ignore[no-untyped-def]
    """float32 of the float16 whose bits are the uint16 ``u`` (LLVM's ``fpext``)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float_half(typingctx, f):  # type: ignore[no-untyped-def]
    """The bits (uint16) of float16(``f``), rounded to nearest even (LLVM's ``fptrunc``)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@_value
def _half_value_instruction(h):  # type: ignore[no-untyped-def]
    """``_half_value_bits`` by the CPU's conversion; a NaN gets its bits as there (the
    instruction makes a signalling NaN quiet)."""
    u = uint32(h)
    f = _half_float(h)
    if (u & uint32(0x7FFF)) > uint32(0x7C00):  # a NaN: its payload kept, not made quiet
        f = _bits_float(
            ((u & uint32(0x7FFF)) << uint32(13)) | uint32(0x7F800000) | ((u & uint32(0x8000)) << uint32(16))
        )
    return f


@_loop
def _half_columns_to_float_bits(h, lo, hi, out):  # type: ignore[no-untyped-def]
    """``out[n] = float32(h[n, lo:hi])`` for every row n: ``h`` (N, W) the bits (uint16)
    of C-ordered float16 values, ``out`` (N, hi - lo) float32 (``_half_value_bits``; the
    rows in one call: a call per row took 1 ns a value on rows of 32 values, this 0.13)."""
    start = uint64(lo)  # (unsigned indices: no check for negative ones, so it vectorizes)
    for n in range(h.shape[0]):
        hn, on = h[n], out[n]
        for i in range(uint64(0), uint64(hi - lo)):
            on[i] = _half_value_bits(hn[start + i])


@_loop
def _half_columns_to_float_instruction(h, lo, hi, out):  # type: ignore[no-untyped-def]
    """``_half_columns_to_float_bits`` by the CPU's conversion."""
    start = uint64(lo)
    for n in range(h.shape[0]):
        hn, on = h[n], out[n]
        for i in range(uint64(0), uint64(hi - lo)):
            on[i] = _half_value_instruction(hn[start + i])


@_loop
def _float_to_half_columns_bits(f, lo, out):  # type: ignore[no-untyped-def]
    """``out[n, lo:lo + W]`` = the bits of ``float16(f[n])`` for every row n: ``f`` (N, W)
    float32, ``out`` (N, *) uint16 (``_half_bits_value``)."""
    start = uint64(lo)
    for n in range(f.shape[0]):
        fn, on = f[n], out[n]
        for i in range(uint64(0), uint64(f.shape[1])):
            on[start + i] = _half_bits_value(fn[i])


@_loop
def _float_to_half_columns_instruction(f, lo, out):  # type: ignore[no-untyped-def]
    """``_float_to_half_columns_bits`` by the CPU's conversion (a NaN keeps its sign, its
    payload as the instruction leaves it)."""
    start = uint64(lo)
    for n in range(f.shape[0]):
        fn, on = f[n], out[n]
        for i in range(uint64(0), uint64(f.shape[1])):
            on[start + i] = _float_half(fn[i])


# the casts the staging calls: the fastest this CPU has. (Each loop calls one way's value
# helpers by name: numba's cache keeps a loop with the functions it called when it
# compiled, and a process that chose the other way would load it with those.)
if CASTS_BY_INSTRUCTION:
    half_columns_to_float = _half_columns_to_float_instruction
    float_to_half_columns = _float_to_half_columns_instruction
else:
    half_columns_to_float, float_to_half_columns = _half_columns_to_float_bits, _float_to_half_columns_bits
