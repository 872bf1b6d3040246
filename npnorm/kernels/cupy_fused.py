"""Fused CUDA kernels for CuPy arrays: LayerNorm, RMSNorm and BatchNorm.

The generic Array API kernels run on CuPy unchanged, but each of their steps is a kernel
launch and a pass over memory (LayerNorm's forward and backward take about a dozen). These
kernels do each op in one or two passes, compiled from the CUDA C below by CuPy (NVRTC) the
first time an op meets a dtype, and registered for the CuPy namespace behind the same
signatures: ``npnorm.use_kernels("reference")`` runs the generic kernels instead, and the
tests compare the two on the GPU. This module is imported the first time the dispatcher sees
a CuPy array, never at ``import npnorm``.

Rows (LayerNorm, RMSNorm): one thread block per row of D values, each thread holding up
to ``KMAX`` of them in registers, so that the row is read from memory once:

    forward:  mean = sum(x) / D;  var = sum((x - mean)**2) / D  (two passes over the
              registers, sums in float64);  y = xhat * w + b
    backward: xhat = (x - mean) * rstd,  dxhat = dy * w,  with means over the row
              dx = rstd * (dxhat - mean(dxhat) - (xhat - mean(xhat)) * mean(dxhat * (xhat - mean(xhat))))

The backward blocks stride over the rows, each keeping its columns' sums of ``dy * xhat``
and ``dy`` in registers; the per-block partial sums (float64) are added in a fixed order
afterwards, so results are deterministic. Rows longer than ``KMAX * MAX_THREADS`` (4096)
values run the generic kernels.

Channels (BatchNorm over (N, C, S)): per-channel sums are taken by (channel x slice)
blocks into float64 partials, added in a fixed order; the mean first, then the centred
squares (two passes over the input), as the reference's ``moments``; the normalization
and dx are elementwise kernels with per-channel factors. Inputs with fewer than
``MIN_SPATIAL`` values per (sample, channel) run the generic kernels.

float16 input is computed in float32 and returned in float16, as everywhere; an input
that is not C-ordered is copied to C order first.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import cupy
import numpy as np

from .._backend import Array, Namespace
from .._checks import default_eps, prod, work_dtype, write_out
from .._stats import rstd_of
from ..functional import _dispatch
from ..functional._channels import running_update

CUPY = "array_api_compat.cupy"
KMAX = 8  # values of a row each thread holds
MAX_THREADS = 512  # threads of a row's block (the row kernels are compiled for at most this many)
MIN_SPATIAL = 32  # BatchNorm inputs with fewer values per (sample, channel) run the generic kernels

_SOURCE = r"""
typedef %(T)s T;   // the computation dtype (float or double)
typedef double S;  // sums
#define KMAX %(KMAX)d
#define MAX_THREADS %(MAX_THREADS)d

__device__ __forceinline__ S warp_sum(S v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (blockDim.x a multiple of 32), returned in every thread.
__device__ S block_sum(S v, S* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // sh may still be read from the previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sh[lane] : (S)0;
        v = warp_sum(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

// LayerNorm (center = 1) and RMSNorm (center = 0) forward; one block per row.
extern "C" __global__ void __launch_bounds__(MAX_THREADS) rows_forward(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
    T* __restrict__ y, T* __restrict__ mean_out, T* __restrict__ rstd_out,
    const long long R, const long long D, const double eps,
    const int center, const int has_w, const int has_b)
{
    __shared__ S sh[32];
    T wv[KMAX], bv[KMAX];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
        const long long j = threadIdx.x + (long long)k * blockDim.x;
        wv[k] = (has_w && j < D) ? w[j] : (T)1;
        bv[k] = (has_b && j < D) ? b[j] : (T)0;
    }
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        const T* xr = x + r * D;
        T xv[KMAX];
        S s = 0;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const long long j = threadIdx.x + (long long)k * blockDim.x;
            xv[k] = j < D ? xr[j] : (T)0;
            s += (S)xv[k];
        }
        const S mu = center ? block_sum(s, sh) / (S)D : (S)0;
        S q = 0;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const long long j = threadIdx.x + (long long)k * blockDim.x;
            if (j < D) { const S d = (S)xv[k] - mu; q += d * d; }
        }
        const S rs = 1.0 / sqrt(block_sum(q, sh) / (S)D + (S)eps);
        T* yr = y + r * D;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const long long j = threadIdx.x + (long long)k * blockDim.x;
            if (j < D) {
                T v = (T)(((S)xv[k] - mu) * rs);  // xhat, the offset removed in float64
                if (has_w) v = v * wv[k];
                if (has_b) v = v + bv[k];
                yr[j] = v;
            }
        }
        if (threadIdx.x == 0) {
            if (center) mean_out[r] = (T)mu;
            rstd_out[r] = (T)rs;
        }
    }
}

// LayerNorm / RMSNorm backward; blocks stride over rows, partial sums of dweight (pw) and
// dbias (pb) per block and column.
extern "C" __global__ void __launch_bounds__(MAX_THREADS) rows_backward(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
    const T* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
    S* __restrict__ pw, S* __restrict__ pb, const long long R, const long long D,
    const int center, const int has_w, const int need_pw, const int need_pb)
{
    __shared__ S sh[32];
    T wv[KMAX];
    S aw[KMAX], ab[KMAX];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
        const long long j = threadIdx.x + (long long)k * blockDim.x;
        wv[k] = (has_w && j < D) ? w[j] : (T)1;
        aw[k] = 0;
        ab[k] = 0;
    }
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        const T m = center ? mean[r] : (T)0;
        const T rs = rstd[r];
        T xh[KMAX], gh[KMAX];  // xhat, dxhat
        S s0 = 0, s1 = 0, s2 = 0;  // sums of xhat, dxhat, dxhat * xhat
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const long long j = threadIdx.x + (long long)k * blockDim.x;
            xh[k] = 0;
            gh[k] = 0;
            if (j < D) {
                const T g = dy[r * D + j];
                xh[k] = (x[r * D + j] - m) * rs;
                gh[k] = has_w ? g * wv[k] : g;
                s0 += (S)xh[k];
                s1 += (S)gh[k];
                s2 += (S)gh[k] * (S)xh[k];
                aw[k] += (S)g * (S)xh[k];
                ab[k] += (S)g;
            }
        }
        S mx = 0, t1 = 0;
        if (center) {
            mx = block_sum(s0, sh) / (S)D;  // mean(xhat): 0 but for the saved mean's rounding
            t1 = block_sum(s1, sh) / (S)D;  // mean(dxhat)
        }
        // mean(dxhat * (xhat - mx))
        const S t2 = block_sum(s2, sh) / (S)D - mx * t1;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const long long j = threadIdx.x + (long long)k * blockDim.x;
            if (j < D) dx[r * D + j] = (T)((S)rs * ((S)gh[k] - t1 - ((S)xh[k] - mx) * t2));
        }
    }
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
        const long long j = threadIdx.x + (long long)k * blockDim.x;
        if (j < D) {
            if (need_pw) pw[blockIdx.x * D + j] = aw[k];
            if (need_pb) pb[blockIdx.x * D + j] = ab[k];
        }
    }
}

// Per-channel partial sums over (N, C, S) in C order: block (blockIdx.x, c) takes the
// samples n = kn, kn + Kn, ... and the slice ks of S (blockIdx.x = kn + Kn * ks).
//   mode 0: p1 = sum(x)
//   mode 1: p1 = sum((x - center[c])**2)
//   mode 2: p1 = sum(dy), p2 = sum(dy * xhat), p3 = sum(xhat), xhat = (x - mean[c]) * rstd[c]
extern "C" __global__ void channel_sums(
    const T* __restrict__ x, const T* __restrict__ dy, const S* __restrict__ center,
    const T* __restrict__ mean, const T* __restrict__ rstd,
    S* __restrict__ p1, S* __restrict__ p2, S* __restrict__ p3,
    const long long N, const long long C, const long long Sz, const int Kn, const int Ks,
    const int mode)
{
    __shared__ S sh[32];
    const long long c = blockIdx.y;
    const int kn = blockIdx.x %% Kn, ks = blockIdx.x / Kn;
    const long long chunk = (Sz + Ks - 1) / Ks;
    const long long s0 = ks * chunk;
    const long long s1 = s0 + chunk < Sz ? s0 + chunk : Sz;
    const S cd = mode == 1 ? center[c] : (S)0;
    const T m = mode == 2 ? mean[c] : (T)0;
    const T rs = mode == 2 ? rstd[c] : (T)0;
    S a1 = 0, a2 = 0, a3 = 0;
    for (long long n = kn; n < N; n += Kn) {
        const long long base = (n * C + c) * Sz;
        for (long long s = s0 + threadIdx.x; s < s1; s += blockDim.x) {
            const long long i = base + s;
            if (mode == 0) {
                a1 += (S)x[i];
            } else if (mode == 1) {
                const S d = (S)x[i] - cd;
                a1 += d * d;
            } else {
                const S g = (S)dy[i];
                const S xh = (S)((x[i] - m) * rs);
                a1 += g;
                a2 += g * xh;
                a3 += xh;
            }
        }
    }
    const long long at = c * gridDim.x + blockIdx.x;
    a1 = block_sum(a1, sh);
    if (threadIdx.x == 0) p1[at] = a1;
    if (mode == 2) {
        a2 = block_sum(a2, sh);
        a3 = block_sum(a3, sh);
        if (threadIdx.x == 0) { p2[at] = a2; p3[at] = a3; }
    }
}
"""

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@functools.cache
def _module(dtype: np.dtype) -> Any:
    """The compiled kernels for computation dtype ``dtype`` (float32 or float64)."""
    source = _SOURCE % {"T": _CTYPE[dtype], "KMAX": KMAX, "MAX_THREADS": MAX_THREADS}
    return cupy.RawModule(code=source, options=("--std=c++14",))


@functools.cache
def _sm_count() -> int:
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def _threads_for_row(D: int) -> int:
    """Threads per block for rows of D values: about 4 values each, a multiple of 32."""
    return min(MAX_THREADS, max(32, 32 * math.ceil(math.ceil(D / 4) / 32)))


def _c_ordered(a: Array, dtype: Any) -> Array:
    """``a`` in ``dtype``, C-ordered (a copy only where needed)."""
    return cupy.ascontiguousarray(a.astype(dtype, copy=False))


# --- rows: LayerNorm and RMSNorm ------------------------------------------------------


def _rows_fit(input: Array, D: int) -> bool:
    """Rows (D > 0, as ``as_shape`` ensures) that one block holds, and at least one of them."""
    return input.size > 0 and D <= KMAX * MAX_THREADS


def _rows_forward(
    xp: Namespace, input: Array, D: int, weight: Array | None, bias: Array | None, eps: float, center: bool
) -> tuple[Array, Array, Array]:
    ct = work_dtype(xp, input, weight, bias)
    x = _c_ordered(input, ct)  # R*D values
    R = x.size // D
    y = cupy.empty(x.shape, dtype=ct)
    mean = cupy.empty((R,), dtype=ct)
    rstd = cupy.empty((R,), dtype=ct)
    w = x if weight is None else _c_ordered(weight, ct)  # a placeholder pointer where absent
    b = x if bias is None else _c_ordered(bias, ct)
    threads = _threads_for_row(D)
    _module(np.dtype(ct)).get_function("rows_forward")(
        (min(R, 2**31 - 1),),
        (threads,),
        (x, w, b, y, mean, rstd, np.int64(R), np.int64(D), np.float64(eps),
         np.int32(center), np.int32(weight is not None), np.int32(bias is not None)),
    )  # fmt: skip
    return y.astype(input.dtype, copy=False), mean, rstd


def _rows_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    D: int,
    mean: Array | None,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
) -> tuple[Array, Array | None, Array | None]:
    """dx, and the float64 sums of dweight and dbias (dbias where ``bias`` is given)."""
    ct = work_dtype(xp, input, weight, bias, mean, rstd)  # the absent ones skipped
    need_dbias = bias is not None
    x = _c_ordered(input, ct)
    dy = _c_ordered(grad_output, ct)
    R = x.size // D
    rs = _c_ordered(rstd, ct)
    m = rs if mean is None else _c_ordered(mean, ct)
    w = x if weight is None else _c_ordered(weight, ct)
    threads = _threads_for_row(D)
    blocks = max(1, min(R, 4 * _sm_count()))  # each keeps partial sums of dweight, dbias
    dx = cupy.empty(x.shape, dtype=ct)
    pw = cupy.empty((blocks, D), dtype=cupy.float64) if weight is not None else dx
    pb = cupy.empty((blocks, D), dtype=cupy.float64) if need_dbias else dx
    _module(np.dtype(ct)).get_function("rows_backward")(
        (blocks,),
        (threads,),
        (dy, x, m, rs, w, dx, pw, pb, np.int64(R), np.int64(D), np.int32(mean is not None),
         np.int32(weight is not None), np.int32(weight is not None), np.int32(need_dbias)),
    )  # fmt: skip
    dweight = None if weight is None else pw.sum(axis=0).astype(weight.dtype)
    dbias = None if not need_dbias else pb.sum(axis=0)
    return dx.astype(input.dtype, copy=False), dweight, dbias


@_dispatch.specialized("layer_norm_forward", CUPY)
def layer_norm_forward(
    xp: Namespace,
    input: Array,
    shape: tuple[int, ...],
    weight: Array | None,
    bias: Array | None,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    D = prod(shape)
    if not _rows_fit(input, D):
        return _dispatch.generic_kernel("layer_norm_forward")(xp, input, shape, weight, bias, eps, out)
    y, mean, rstd = _rows_forward(xp, input, D, weight, bias, eps, center=True)
    batch = tuple(input.shape[: input.ndim - len(shape)])
    return write_out(xp, out, y.reshape(input.shape)), mean.reshape(batch), rstd.reshape(batch)


@_dispatch.specialized("layer_norm_backward", CUPY)
def layer_norm_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    shape: tuple[int, ...],
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    D = prod(shape)
    if not _rows_fit(input, D):
        return _dispatch.generic_kernel("layer_norm_backward")(
            xp, grad_output, input, shape, mean, rstd, weight, bias, out
        )
    dx, dweight, dbias = _rows_backward(xp, grad_output, input, D, mean, rstd, weight, bias)
    if dweight is not None:
        dweight = dweight.reshape(shape)
    if dbias is not None:
        assert bias is not None
        dbias = dbias.astype(bias.dtype).reshape(shape)
    return write_out(xp, out, dx.reshape(input.shape)), dweight, dbias


@_dispatch.specialized("rms_norm_forward", CUPY)
def rms_norm_forward(
    xp: Namespace,
    input: Array,
    shape: tuple[int, ...],
    weight: Array | None,
    eps: float | None,
    out: Array | None = None,
) -> tuple[Array, Array]:
    D = prod(shape)
    if not _rows_fit(input, D):
        return _dispatch.generic_kernel("rms_norm_forward")(xp, input, shape, weight, eps, out)
    if eps is None:
        eps = default_eps(xp, input)
    y, _, rstd = _rows_forward(xp, input, D, weight, None, eps, center=False)
    batch = tuple(input.shape[: input.ndim - len(shape)])
    return write_out(xp, out, y.reshape(input.shape)), rstd.reshape(batch)


@_dispatch.specialized("rms_norm_backward", CUPY)
def rms_norm_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    shape: tuple[int, ...],
    rstd: Array,
    weight: Array | None,
    out: Array | None = None,
) -> tuple[Array, Array | None]:
    D = prod(shape)
    if not _rows_fit(input, D):
        return _dispatch.generic_kernel("rms_norm_backward")(xp, grad_output, input, shape, rstd, weight, out)
    dx, dweight, _ = _rows_backward(xp, grad_output, input, D, None, rstd, weight, None)
    if dweight is not None:
        dweight = dweight.reshape(shape)
    return write_out(xp, out, dx.reshape(input.shape)), dweight


# --- channels: BatchNorm ---------------------------------------------------------------


def _ncs(input: Array) -> tuple[int, int, int]:
    return int(input.shape[0]), int(input.shape[1]), prod(input.shape[2:])


def _channels_fit(input: Array) -> bool:
    N, C, S = _ncs(input)
    return N > 0 and 0 < C <= 65535 and S >= MIN_SPATIAL  # C is the grid's second axis


def _split(N: int, C: int, S: int) -> tuple[int, int]:
    """(Kn, Ks): blocks per channel over samples and over S, about 8 blocks per SM in all."""
    per_channel = max(1, math.ceil(8 * _sm_count() / C))
    kn = min(N, per_channel)
    ks = max(1, min(math.ceil(per_channel / kn), math.ceil(S / 256)))
    return kn, ks


def _channel_sums(
    x: Array, mode: int, *, dy: Array | None = None, center: Array | None = None,
    mean: Array | None = None, rstd: Array | None = None,
) -> list[Array]:  # fmt: skip
    """Per-channel float64 sums of x's (N, C, S) view (see ``channel_sums`` in the source):
    one array for modes 0 and 1, three for mode 2."""
    N, C, S = _ncs(x)
    kn, ks = _split(N, C, S)
    parts = [cupy.empty((C, kn * ks), dtype=cupy.float64) for _ in range(3 if mode == 2 else 1)]
    p1, p2, p3 = (parts * 3)[:3] if mode != 2 else parts
    _module(np.dtype(x.dtype)).get_function("channel_sums")(
        (kn * ks, C),
        (256,),
        (x, x if dy is None else dy, p1 if center is None else center, x if mean is None else mean,
         x if rstd is None else rstd, p1, p2, p3, np.int64(N), np.int64(C), np.int64(S),
         np.int32(kn), np.int32(ks), np.int32(mode)),
    )  # fmt: skip
    return [p.sum(axis=1) for p in parts]  # C each, added in a fixed order


@functools.cache
def _affine(has_w: bool, has_b: bool) -> Any:
    """``y = (T)((x - m) * r) * w + b`` per element; m and r (per channel) in their own
    dtype M: float64 batch statistics, or the running ones in the computation dtype."""
    y = "xh" + (" * w" if has_w else "") + (" + b" if has_b else "")
    body = f"const T xh = (T)(((M)x - m) * r); y = {y};"
    return cupy.ElementwiseKernel("T x, M m, M r, T w, T b", "T y", body, f"npnorm_bn_y_{has_w:d}{has_b:d}")


_dx_train = functools.cache(
    lambda: cupy.ElementwiseKernel(
        "T dy, T x, T m, T r, float64 scale, float64 t1, float64 mx, float64 t2",
        "T dx",
        "const double xh = (double)((x - m) * r); dx = (T)(scale * ((double)dy - t1 - (xh - mx) * t2));",
        "npnorm_bn_dx_train",
    )
)
_dx_eval = functools.cache(
    lambda: cupy.ElementwiseKernel(
        "T dy, float64 scale", "T dx", "dx = (T)((double)dy * scale);", "npnorm_bn_dx_eval"
    )
)


@_dispatch.specialized("batch_norm_forward", CUPY)
def batch_norm_forward(
    xp: Namespace,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    training: bool,
    momentum: float,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    if not _channels_fit(input):
        return _dispatch.generic_kernel("batch_norm_forward")(
            xp, input, running_mean, running_var, weight, bias, training, momentum, eps, out
        )
    ct = work_dtype(xp, input, weight, bias, running_mean, running_var)
    N, C, S = _ncs(input)
    x = _c_ordered(input, ct)
    new_mean, new_var = running_mean, running_var
    if training:
        count = N * S  # values per channel
        (total,) = _channel_sums(x, 0)
        mean64 = total / count  # C, float64
        (squares,) = _channel_sums(x, 1, center=mean64)
        var64 = squares / count  # C, float64, biased
        if running_mean is not None and running_var is not None:
            new_mean = running_update(xp, running_mean, mean64, momentum)
            new_var = running_update(xp, running_var, var64 * (count / (count - 1)), momentum)
        rstd64 = rstd_of(xp, var64, eps, cupy.float64)  # C
        m, r = mean64, rstd64
        mean, rstd = mean64.astype(ct), rstd64.astype(ct)
    else:
        assert running_mean is not None and running_var is not None
        mean = running_mean.astype(ct, copy=True)  # C: never the caller's buffer
        rstd = rstd_of(xp, running_var.astype(ct, copy=False), eps, ct)  # C
        m, r = mean, rstd
    shape = (1, C, 1)
    w = cupy.ones((), dtype=ct) if weight is None else weight.astype(ct, copy=False).reshape(shape)
    b = cupy.zeros((), dtype=ct) if bias is None else bias.astype(ct, copy=False).reshape(shape)
    y = _affine(weight is not None, bias is not None)(
        x.reshape(N, C, S), m.reshape(shape), r.reshape(shape), w, b
    )  # N,C,S
    y = y.astype(input.dtype, copy=False).reshape(input.shape)
    return write_out(xp, out, y), mean, rstd, new_mean, new_var


@_dispatch.specialized("batch_norm_backward", CUPY)
def batch_norm_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    training: bool,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    if not _channels_fit(input):
        return _dispatch.generic_kernel("batch_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, training, out
        )
    ct = work_dtype(xp, input, weight, bias, mean)
    N, C, S = _ncs(input)
    count = N * S
    x = _c_ordered(input, ct)
    dy = _c_ordered(grad_output, ct)
    m = _c_ordered(mean, ct).reshape(C)
    r = _c_ordered(rstd, ct).reshape(C)
    sum_dy, sum_dy_xhat, sum_xhat = _channel_sums(x, 2, dy=dy, mean=m, rstd=r)  # C each, float64
    dweight = None if weight is None else sum_dy_xhat.astype(weight.dtype)
    dbias = None if bias is None else sum_dy.astype(bias.dtype)
    scale = r.astype(cupy.float64)  # C: rstd * w, taken in float64 as the reference's ``scaled``
    if weight is not None:
        scale = scale * weight.astype(cupy.float64).reshape(C)
    shape = (1, C, 1)
    if training:
        t1 = sum_dy / count  # mean(dy)
        mx = sum_xhat / count  # mean(xhat): 0 but for the saved mean's rounding
        t2 = sum_dy_xhat / count - mx * t1  # mean(dy * (xhat - mx))
        dx = _dx_train()(
            dy.reshape(N, C, S), x.reshape(N, C, S), m.reshape(shape), r.reshape(shape), scale.reshape(shape),
            t1.reshape(shape), mx.reshape(shape), t2.reshape(shape),
        )  # fmt: skip
    else:
        dx = _dx_eval()(dy.reshape(N, C, S), scale.reshape(shape))
    dx = dx.astype(input.dtype, copy=False).reshape(input.shape)
    return write_out(xp, out, dx), dweight, dbias
