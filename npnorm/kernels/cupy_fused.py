"""Fused CUDA kernels for CuPy arrays: LayerNorm, RMSNorm, BatchNorm and InstanceNorm.

The generic Array API kernels run on CuPy unchanged, but each of their steps is a kernel
launch and a pass over memory (LayerNorm's forward and backward take about a dozen). These
kernels do each op in one or two passes, compiled from the CUDA C below by CuPy (NVRTC) the
first time an op meets a dtype, and registered for the CuPy namespace behind the same
signatures: ``npnorm.use_kernels("reference")`` runs the generic kernels instead, and the
tests compare the two on the GPU. This module is imported the first time the dispatcher sees
a CuPy array, never at ``import npnorm``.

Rows (LayerNorm, RMSNorm): one thread block per row of D values, each thread holding a
few of them in registers, so that the row is read from memory once:

    forward:  mean = sum(x) / D;  var = sum((x - mean)**2) / D  (two passes over the
              registers, sums in float64);  y = xhat * w + b
    backward: xhat = (x - mean) * rstd,  dxhat = dy * w,  with means over the row
              dx = rstd * (dxhat - mean(dxhat) - (xhat - mean(xhat)) * mean(dxhat * (xhat - mean(xhat))))

The backward launches as many blocks as the GPU holds at once; each strides over the rows,
loading the next row while it reduces this one's sums, and keeps its columns' sums of
``dy * xhat`` and ``dy`` in registers. Those per-block partial sums (float64) are added in a
fixed order by a second kernel. Rows longer than ``ROW_LIMIT`` (4096) values run the
generic kernels.

Channels (BatchNorm over (N, C, S)): (channel x slice) blocks take float64 partials of each
channel in one pass over the input: in the forward, the moments (count, mean and the sum of
squared deviations: Welford's update per thread, merged by Chan's formula across threads),
in the backward, the sums of dy, dy * xhat and xhat. One block per channel then merges its
partials in a fixed order and finishes the channel (mean, variance, rstd and the running
statistics; or dweight, dbias and the coefficients of dx), and one more kernel writes y or
dx, a block per (sample, channel) row. Training takes three launches each way; evaluation's
forward runs the running statistics through CuPy's elementwise kernels. InstanceNorm with
input statistics runs the same kernels with its (sample, channel) instances as the
channels; with running statistics it is BatchNorm in evaluation. Inputs with fewer than
``MIN_SPATIAL`` values per (sample, channel), or more than 65535 channels (instances), run
the generic kernels.

Results repeat bitwise for the same input on the same GPU, CUDA and CuPy: the partitions
into blocks, and so the order of the partial sums, follow the device's multiprocessor
count and the kernels' register use.

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
from .._checks import default_eps, fast_float_type, prod, work_dtype, write_out
from .._stats import less_centre, rstd_of
from ..functional import _dispatch
from ..functional._channels import running_update

CUPY = "array_api_compat.cupy"
KMAX = 4  # values of a row each thread holds, in the kernels compiled by default
MAX_THREADS = 1024  # threads of a row's block, at most, likewise
MIN_SPATIAL = 32  # BatchNorm inputs with fewer values per (sample, channel) run the generic kernels

fast_float_type(cupy.ndarray)  # CuPy arrays' checks: a type and a dtype test, as NumPy's

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

// Three block sums at once (sh holds 96 values): each the same tree as block_sum's, so the
// same bits, with one round of barriers instead of three.
__device__ void block_sum3(S& a, S& b, S& c, S* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
    __syncthreads();  // sh may still be read from the previous call
    if (lane == 0) { sh[warp] = a; sh[32 + warp] = b; sh[64 + warp] = c; }
    __syncthreads();
    if (warp == 0) {
        const bool in = lane < (int)(blockDim.x >> 5);
        a = warp_sum(in ? sh[lane] : (S)0);
        b = warp_sum(in ? sh[32 + lane] : (S)0);
        c = warp_sum(in ? sh[64 + lane] : (S)0);
        if (lane == 0) { sh[0] = a; sh[32] = b; sh[64] = c; }
    }
    __syncthreads();
    a = sh[0];
    b = sh[32];
    c = sh[64];
}

// LayerNorm (center = 1) and RMSNorm (center = 0) forward; one block per row, thread t
// holding the row's values t, t + blockDim.x, ... (at most KMAX of them) in registers.
extern "C" __global__ void __launch_bounds__(MAX_THREADS) rows_forward(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
    T* __restrict__ y, T* __restrict__ mean_out, T* __restrict__ rstd_out,
    const long long R, const int D, const double eps,
    const int center, const int has_w, const int has_b)
{
    __shared__ S sh[32];
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        const T* xr = x + r * D;
        T xv[KMAX];
        S s = 0;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            xv[k] = j < D ? xr[j] : (T)0;
            s += (S)xv[k];
        }
        const S mu = center ? block_sum(s, sh) / (S)D : (S)0;
        S q = 0;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < D) { const S d = (S)xv[k] - mu; q += d * d; }
        }
        const S rs = 1.0 / sqrt(block_sum(q, sh) / (S)D + (S)eps);
        T* yr = y + r * D;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < D) {
                T v = (T)(((S)xv[k] - mu) * rs);  // xhat, the offset removed in float64
                if (has_w) v = v * w[j];
                if (has_b) v = v + b[j];
                yr[j] = v;
            }
        }
        if (threadIdx.x == 0) {
            if (center) mean_out[r] = (T)mu;
            rstd_out[r] = (T)rs;
        }
    }
}

// LayerNorm / RMSNorm backward. Each block strides over the rows r = blockIdx.x,
// blockIdx.x + gridDim.x, ..., and loads the next row's x and dy before it reduces this
// row's sums, so that memory is read while the block waits at its barriers. Per block and
// column it keeps the partial sums of dweight (pw) and dbias (pb), written at the end; dweight
// takes xhat centred again, as dx does (its mean mx: 0 but for the saved mean's rounding).
extern "C" __global__ void __launch_bounds__(MAX_THREADS) rows_backward(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
    const T* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
    S* __restrict__ pw, S* __restrict__ pb, const long long R, const int D,
    const int center, const int has_w, const int need_pw, const int need_pb)
{
    __shared__ S sh[96];
    S aw[KMAX], ab[KMAX];  // this thread's columns' sums of dy * (xhat - mx) and dy
    T xc[KMAX], gc[KMAX];  // this row's x and dy
    T xn[KMAX], gn[KMAX];  // the next row's
    {
        const long long r = blockIdx.x;
        const T* xr = x + r * D;
        const T* gr = dy + r * D;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            aw[k] = 0;
            ab[k] = 0;
            const bool in = r < R && j < D;
            xc[k] = in ? xr[j] : (T)0;
            gc[k] = in ? gr[j] : (T)0;
        }
    }
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        const long long rn = r + gridDim.x;
        const T* xr = x + rn * D;
        const T* gr = dy + rn * D;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {  // the next row, loaded now, used next iteration
            const int j = threadIdx.x + k * blockDim.x;
            const bool in = rn < R && j < D;
            xn[k] = in ? xr[j] : (T)0;
            gn[k] = in ? gr[j] : (T)0;
        }
        const T m = center ? mean[r] : (T)0;
        const T rs = rstd[r];
        S s0 = 0, s1 = 0, s2 = 0;  // sums of xhat, dxhat, dxhat * xhat
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < D) {
                const T xh = (xc[k] - m) * rs;  // xhat
                const T gh = has_w ? gc[k] * w[j] : gc[k];  // dxhat
                s0 += (S)xh;
                s1 += (S)gh;
                s2 += (S)gh * (S)xh;
                ab[k] += (S)gc[k];
            }
        }
        block_sum3(s0, s1, s2, sh);
        S mx = 0, t1 = 0;
        if (center) {
            mx = s0 / (S)D;  // mean(xhat): 0 but for the saved mean's rounding
            t1 = s1 / (S)D;  // mean(dxhat)
        }
        const S t2 = s2 / (S)D - mx * t1;  // mean(dxhat * (xhat - mx))
        T* dr = dx + r * D;
#pragma unroll
        for (int k = 0; k < KMAX; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < D) {
                const T xh = (xc[k] - m) * rs;
                const T gh = has_w ? gc[k] * w[j] : gc[k];
                dr[j] = (T)((S)rs * ((S)gh - t1 - ((S)xh - mx) * t2));
                aw[k] += (S)gc[k] * ((S)xh - mx);
            }
            xc[k] = xn[k];
            gc[k] = gn[k];
        }
    }
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < D) {
            if (need_pw) pw[blockIdx.x * (long long)D + j] = aw[k];
            if (need_pb) pb[blockIdx.x * (long long)D + j] = ab[k];
        }
    }
}

// dweight and dbias from the backward's B x D partial sums: block (32 x 32) threads take 32
// columns; thread (tx, ty) adds rows ty, ty + 32, ..., then thread (tx, 0) adds the 32
// results in order (a fixed order: results repeat bitwise).
extern "C" __global__ void __launch_bounds__(1024) column_sums(
    const S* __restrict__ pw, const S* __restrict__ pb, T* __restrict__ dw, T* __restrict__ db,
    const long long B, const long long D, const int need_pw, const int need_pb)
{
    __shared__ S tw[32][33], tb[32][33];
    const long long j = blockIdx.x * 32LL + threadIdx.x;
    S a = 0, c = 0;
    if (j < D) {
        for (long long i = threadIdx.y; i < B; i += 32) {
            if (need_pw) a += pw[i * D + j];
            if (need_pb) c += pb[i * D + j];
        }
    }
    tw[threadIdx.y][threadIdx.x] = a;
    tb[threadIdx.y][threadIdx.x] = c;
    __syncthreads();
    if (threadIdx.y == 0 && j < D) {
        a = 0;
        c = 0;
        for (int t = 0; t < 32; ++t) { a += tw[t][threadIdx.x]; c += tb[t][threadIdx.x]; }
        if (need_pw) dw[j] = (T)a;
        if (need_pb) db[j] = (T)c;
    }
}

// Moments as (count, mean, M2 = sum of squared deviations from the mean), in float64.
// chan_merge adds (n2, m2, q2) into (n, m, q) (Chan, Golub & LeVeque's pairwise update);
// an empty side (count 0) leaves the other as it is.
__device__ __forceinline__ void chan_merge(S& n, S& m, S& q, const S n2, const S m2, const S q2) {
    if (n2 == 0) return;
    if (n == 0) { n = n2; m = m2; q = q2; return; }
    const S t = n + n2, d = m2 - m, f = n2 / t;
    m += d * f;
    q += q2 + d * d * n * f;
    n = t;
}

// The moments of the block (blockDim.x a multiple of 32), merged in a fixed tree; the
// result is in thread 0.
__device__ void block_moments(S& n, S& m, S& q, S* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const S n2 = __shfl_down_sync(0xffffffffu, n, o);
        const S m2 = __shfl_down_sync(0xffffffffu, m, o);
        const S q2 = __shfl_down_sync(0xffffffffu, q, o);
        chan_merge(n, m, q, n2, m2, q2);
    }
    __syncthreads();
    if (lane == 0) { sh[warp] = n; sh[32 + warp] = m; sh[64 + warp] = q; }
    __syncthreads();
    if (warp == 0) {
        const bool in = lane < (int)(blockDim.x >> 5);
        n = in ? sh[lane] : (S)0;
        m = in ? sh[32 + lane] : (S)0;
        q = in ? sh[64 + lane] : (S)0;
        for (int o = 16; o > 0; o >>= 1) {
            const S n2 = __shfl_down_sync(0xffffffffu, n, o);
            const S m2 = __shfl_down_sync(0xffffffffu, m, o);
            const S q2 = __shfl_down_sync(0xffffffffu, q, o);
            chan_merge(n, m, q, n2, m2, q2);
        }
    }
}

// Per-channel partials over (N, C, S) in C order, in one pass: block (blockIdx.x, c) takes
// the samples n = kn, kn + Kn, ... and the slice ks of S (blockIdx.x = kn + Kn * ks).
//   mode 0 (forward): the moments of x (Welford's update per thread, then merged):
//           p1 = count, p2 = mean, p3 = M2; and p4 = sum(x), whose mean stands in where
//           Welford's is not finite (after an infinite value, as the reference's sum;
//           float64 values near overflow may still differ from the reference's results)
//   mode 2 (backward): p1 = sum(dy), p2 = sum(dy * xhat), p3 = sum(xhat),
//           xhat = (x - mean[c]) * rstd[c]
extern "C" __global__ void channel_sums(
    const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ mean,
    const T* __restrict__ rstd, S* __restrict__ p1, S* __restrict__ p2, S* __restrict__ p3,
    S* __restrict__ p4, const long long N, const long long C, const long long Sz, const int Kn, const int Ks,
    const int mode)
{
    __shared__ S sh[96];
    const long long c = blockIdx.y;
    const int kn = blockIdx.x %% Kn, ks = blockIdx.x / Kn;
    const long long chunk = (Sz + Ks - 1) / Ks;
    const long long s0 = ks * chunk;
    const long long s1 = s0 + chunk < Sz ? s0 + chunk : Sz;
    const T m = mode == 2 ? mean[c] : (T)0;
    const T rs = mode == 2 ? rstd[c] : (T)0;
    S a1 = 0, a2 = 0, a3 = 0, a4 = 0;
    for (long long n = kn; n < N; n += Kn) {
        const long long base = (n * C + c) * Sz;
        for (long long s = s0 + threadIdx.x; s < s1; s += blockDim.x) {
            const long long i = base + s;
            if (mode == 0) {
                const S v = (S)x[i];
                a1 += 1;
                const S d = v - a2;
                a2 += d / a1;
                a3 += d * (v - a2);
                a4 += v;
            } else {
                const S g = (S)dy[i];
                const S xh = (S)((x[i] - m) * rs);
                a1 += g;
                a2 += g * xh;
                a3 += xh;
            }
        }
    }
    if (mode == 0) {
        block_moments(a1, a2, a3, sh);
        a4 = block_sum(a4, sh);
    } else {
        block_sum3(a1, a2, a3, sh);
    }
    if (threadIdx.x == 0) {
        const long long at = c * gridDim.x + blockIdx.x;
        p1[at] = a1;
        p2[at] = a2;
        p3[at] = a3;
        if (mode == 0) p4[at] = a4;
    }
}

// BatchNorm's per-channel results from channel_sums' C x K partials, one block per
// channel (the K partials merged or added in a fixed order). count: values per channel.
// (InstanceNorm's instances are its channels, the weight of instance c is w[c %% Cw].)
//   mode 0: mean = the merged mean (sum / count where that is not finite);  var = M2 / count
//           (biased);  rstd = 1 / sqrt(var + eps), into mean64, rstd64, var64 (float64) and
//           mean_t, rstd_t;  with running statistics (has_run), the new ones:
//           (1 - momentum) * running + momentum * batch, the variance unbiased
//           (M2 / (count - 1)), into new_mean, new_var (T), or new_mean64, new_var64 where
//           the buffers are of another dtype (run_wide: rounded once, by the caller)
//   mode 2: dweight = sum(dy * xhat), dbias = sum(dy);  for dx: coef[c] = (rstd * w,
//           t1 = mean(dy), mx = mean(xhat), t2 = mean(dy * xhat) - mx * t1)
//   mode 3: mode 2 with batch statistics: dweight = sum(dy * (xhat - mx)), xhat centred
//           again on what the saved mean's rounding left, as dx takes it (where finite)
extern "C" __global__ void channel_finish(
    const S* __restrict__ p1, const S* __restrict__ p2, const S* __restrict__ p3,
    const S* __restrict__ p4, const int K, const double count, const int mode,
    S* __restrict__ mean64, S* __restrict__ rstd64, S* __restrict__ var64, T* __restrict__ mean_t,
    T* __restrict__ rstd_t, const int has_run, const T* __restrict__ run_mean, const T* __restrict__ run_var,
    T* __restrict__ new_mean, T* __restrict__ new_var, S* __restrict__ new_mean64,
    S* __restrict__ new_var64, const int run_wide, const double momentum, const double eps,
    const T* __restrict__ rstd_in, const T* __restrict__ w, const int has_w, const long long Cw,
    T* __restrict__ dw, T* __restrict__ db, S* __restrict__ coef)
{
    __shared__ S sh[96];
    const long long c = blockIdx.x;
    S a1 = 0, a2 = 0, a3 = 0, a4 = 0;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const long long at = c * K + k;
        if (mode == 0) {
            chan_merge(a1, a2, a3, p1[at], p2[at], p3[at]);
            a4 += p4[at];
        } else {
            a1 += p1[at];
            a2 += p2[at];
            a3 += p3[at];
        }
    }
    if (mode == 0) {
        block_moments(a1, a2, a3, sh);
        a4 = block_sum(a4, sh);
    } else {
        block_sum3(a1, a2, a3, sh);
    }
    if (threadIdx.x != 0) return;
    if (mode == 0) {
        const S mu = isfinite(a2) ? a2 : a4 / count;
        const S var = a3 / count;  // biased
        const S rs = 1.0 / sqrt(var + eps);
        mean64[c] = mu;
        rstd64[c] = rs;
        var64[c] = var;
        mean_t[c] = (T)mu;
        rstd_t[c] = (T)rs;
        if (has_run) {
            const S nm = (1.0 - momentum) * (S)run_mean[c] + momentum * mu;
            const S nv = (1.0 - momentum) * (S)run_var[c] + momentum * (var * (count / (count - 1.0)));
            if (run_wide) {
                new_mean64[c] = nm;
                new_var64[c] = nv;
            } else {
                new_mean[c] = (T)nm;
                new_var[c] = (T)nv;
            }
        }
    } else {
        const S t1 = a1 / count, mx = a3 / count;
        const S shift = mx * a1;  // what sum(dy * xhat) took from the mean's rounding
        dw[c] = (T)((mode == 3 && isfinite(shift)) ? a2 - shift : a2);
        db[c] = (T)a1;
        S scale = (S)rstd_in[c];
        if (has_w) scale = scale * (S)w[c %% Cw];
        coef[4 * c] = scale;
        coef[4 * c + 1] = t1;
        coef[4 * c + 2] = mx;
        coef[4 * c + 3] = a2 / count - mx * t1;
    }
}

// The output of BatchNorm (and InstanceNorm) in training, one block per row of Sz values:
// y = (T)((x - mean64[i]) * rstd64[i]) * w[c] + b[c], for row r: statistics i = r %% Cs
// (the channel; InstanceNorm's: the row itself) and channel c = r %% C
extern "C" __global__ void channel_apply(
    const T* __restrict__ x, T* __restrict__ y, const S* __restrict__ mean64,
    const S* __restrict__ rstd64, const T* __restrict__ w, const T* __restrict__ b,
    const long long rows, const long long Cs, const long long C, const long long Sz,
    const int has_w, const int has_b)
{
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long i = row %% Cs, c = row %% C;
        const S mc = mean64[i], rc = rstd64[i];
        const T wc = has_w ? w[c] : (T)1, bc = has_b ? b[c] : (T)0;
        const T* xr = x + row * Sz;
        T* yr = y + row * Sz;
        for (long long s = threadIdx.x; s < Sz; s += blockDim.x) {
            const T xh = (T)(((S)xr[s] - mc) * rc);
            yr[s] = has_w ? (has_b ? xh * wc + bc : xh * wc) : (has_b ? xh + bc : xh);
        }
    }
}

// BatchNorm's dx, one block per row (n, c), from channel_finish's coef (mode 2):
//   training: dx = rstd * w * (dy - mean(dy) - (xhat - mean(xhat)) * t2)
//   eval:     dx = rstd * w * dy  (the running statistics are constants)
extern "C" __global__ void channel_dx(
    const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
    const T* __restrict__ rstd, const S* __restrict__ coef, T* __restrict__ dx,
    const long long rows, const long long C, const long long Sz, const int training)
{
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long c = row %% C;
        const S scale = coef[4 * c], t1 = coef[4 * c + 1], mx = coef[4 * c + 2], t2 = coef[4 * c + 3];
        const T m = mean[c], r = rstd[c];
        const T* gr = dy + row * Sz;
        const T* xr = x + row * Sz;
        T* dr = dx + row * Sz;
        for (long long s = threadIdx.x; s < Sz; s += blockDim.x) {
            if (training) {
                const S xh = (S)((xr[s] - m) * r);
                dr[s] = (T)(scale * ((S)gr[s] - t1 - (xh - mx) * t2));
            } else {
                dr[s] = (T)((S)gr[s] * scale);
            }
        }
    }
}
"""

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@functools.cache
def _module(dtype: np.dtype, kmax: int = KMAX, max_threads: int = MAX_THREADS) -> Any:
    """The compiled kernels for computation dtype ``dtype`` (float32 or float64), the row
    kernels for blocks of at most ``max_threads`` threads holding ``kmax`` values each."""
    source = _SOURCE % {"T": _CTYPE[dtype], "KMAX": kmax, "MAX_THREADS": max_threads}
    return cupy.RawModule(code=source, options=("--std=c++14",))


@functools.cache
def _kernel(name: str, dtype: Any, kmax: int = KMAX, max_threads: int = MAX_THREADS) -> Any:
    """Kernel ``name`` of ``_module(dtype, kmax, max_threads)`` (looked up once: a lookup
    costs microseconds on every call otherwise)."""
    return _module(np.dtype(dtype), kmax, max_threads).get_function(name)


def _sm_count() -> int:
    """The multiprocessors of CuPy's current device."""
    return _sm_count_of(cupy.cuda.Device().id)


@functools.cache
def _sm_count_of(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def _resident_blocks(dtype: np.dtype, kmax: int, max_threads: int, name: str, threads: int) -> int:
    """How many blocks of ``threads`` threads of kernel ``name`` one multiprocessor holds."""
    kernel = _kernel(name, dtype, kmax, max_threads).kernel  # the RawKernel's CUDA function
    return max(1, int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, 0)))


def _threads_for_row(D: int, kmax: int = KMAX, max_threads: int = MAX_THREADS) -> int:
    """Threads per block for rows of D values: ``kmax`` values each at most, a multiple of 32."""
    return min(max_threads, max(32, 32 * math.ceil(math.ceil(D / kmax) / 32)))


def _c_ordered(a: Array, dtype: Any) -> Array:
    """``a`` in ``dtype``, C-ordered (a copy only where needed)."""
    return cupy.ascontiguousarray(a.astype(dtype, copy=False))


# --- rows: LayerNorm and RMSNorm ------------------------------------------------------

ROW_LIMIT = 4096  # longer rows run the generic kernels
# The row kernels' shapes, (values per thread, most threads per block), chosen on an H200
# (float32, 16384 rows; forward, then backward with its column sums, in ms):
#   forward  D = 768:  (4, 1024) 0.051, (8, 512) 0.051, (16, 256) 0.054  (torch 0.051)
#            D = 4096: (4, 1024) 0.259, (8, 512) 0.231, (16, 256) 0.202  (torch 0.183)
#   backward D = 768:  (4, 1024) 0.113, (8, 512) 0.089, (4, 512) 0.089   (torch 0.120)
#            D = 4096: (4, 1024) 0.632, (8, 512) 0.435                   (torch 0.444)
# The backward launches as many blocks as the multiprocessors hold at once: fewer (1, 2 or
# 4 per multiprocessor) measured 1.1-4.4x slower.
ROWS_BACKWARD = (8, 512)


def _forward_shape(D: int) -> tuple[int, int]:
    """(values per thread, most threads per block) of the row forward for rows of D values."""
    return (4, 1024) if D <= 1024 else (16, 256)


def _rows_fit(input: Array, D: int) -> bool:
    """Rows (D > 0, as ``as_shape`` ensures) that one block holds, and at least one of them."""
    return input.size > 0 and D <= ROW_LIMIT


def _rows_forward(
    xp: Namespace, input: Array, D: int, weight: Array | None, bias: Array | None, eps: float, center: bool
) -> tuple[Array, Array, Array]:
    ct = work_dtype(xp, input, weight, bias)
    x = _c_ordered(input, ct)  # R*D values
    R = x.size // D
    y = cupy.empty(x.shape, dtype=ct)
    mean, rstd = cupy.empty((2, R), dtype=ct)  # one allocation for both
    w = x if weight is None else _c_ordered(weight, ct)  # a placeholder pointer where absent
    b = x if bias is None else _c_ordered(bias, ct)
    kmax, max_threads = _forward_shape(D)
    _kernel("rows_forward", ct, kmax, max_threads)(
        (min(R, 2**31 - 1),),
        (_threads_for_row(D, kmax, max_threads),),
        (x, w, b, y, mean, rstd, np.int64(R), np.int32(D), np.float64(eps),
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
    """dx, and dweight and dbias (dbias where ``bias`` is given) in the computation dtype."""
    ct = work_dtype(xp, input, weight, bias, mean, rstd)  # the absent ones skipped
    need_dbias = bias is not None
    x = _c_ordered(input, ct)
    dy = _c_ordered(grad_output, ct)
    R = x.size // D
    rs = _c_ordered(rstd, ct)
    m = rs if mean is None else _c_ordered(mean, ct)
    w = x if weight is None else _c_ordered(weight, ct)
    kmax, max_threads = ROWS_BACKWARD
    threads = _threads_for_row(D, kmax, max_threads)
    per_sm = _resident_blocks(np.dtype(ct), kmax, max_threads, "rows_backward", threads)
    blocks = max(1, min(R, per_sm * _sm_count()))  # each keeps partial sums of dweight, dbias
    dx = cupy.empty(x.shape, dtype=ct)
    need = weight is not None or need_dbias
    pw, pb = cupy.empty((2, blocks, D), dtype=cupy.float64) if need else (dx, dx)  # placeholders
    _kernel("rows_backward", ct, kmax, max_threads)(
        (blocks,),
        (threads,),
        (dy, x, m, rs, w, dx, pw, pb, np.int64(R), np.int32(D), np.int32(mean is not None),
         np.int32(weight is not None), np.int32(weight is not None), np.int32(need_dbias)),
    )  # fmt: skip
    dweight = dbias = None
    if need:
        dw, db = cupy.empty((2, D), dtype=ct)
        _kernel("column_sums", ct)(
            (math.ceil(D / 32),),
            (32, 32),
            (pw, pb, dw, db, np.int64(blocks), np.int64(D), np.int32(weight is not None),
             np.int32(need_dbias)),
        )  # fmt: skip
        dweight = None if weight is None else dw.astype(weight.dtype, copy=False)
        dbias = None if bias is None else db
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
        dbias = dbias.astype(bias.dtype, copy=False).reshape(shape)
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


def _channel_partials(
    x: Array, mode: int, *, dy: Array | None = None, mean: Array | None = None, rstd: Array | None = None
) -> list[Array]:
    """Per-channel float64 partials (four C x K arrays) of x's (N, C, S) view, as
    ``channel_sums`` in the source takes them: x's moments and sum (mode 0), or the sums
    of the backward (mode 2; the fourth unused)."""
    N, C, S = _ncs(x)
    kn, ks = _split(N, C, S)
    p1, p2, p3, p4 = parts = list(cupy.empty((4, C, kn * ks), dtype=cupy.float64))
    _kernel("channel_sums", x.dtype)(
        (kn * ks, C),
        (256,),
        (x, x if dy is None else dy, x if mean is None else mean, x if rstd is None else rstd,
         p1, p2, p3, p4, np.int64(N), np.int64(C), np.int64(S), np.int32(kn), np.int32(ks), np.int32(mode)),
    )  # fmt: skip
    return parts


def _finish(ct: Any, parts: list[Array], mode: int, count: int, **arrays: Any) -> None:
    """``channel_finish`` (see the source) of computation dtype ``ct`` over the C x K
    ``parts``. ``arrays`` names the kernel's array arguments this mode reads or writes (the
    others get a placeholder); ``momentum``, ``eps`` and the flags ``has_run``, ``run_wide``,
    ``has_w`` default to 0, ``cw`` (the weight's length) to C."""
    p1, p2, p3, p4 = parts
    C, K = p1.shape
    names = ("mean64", "rstd64", "var64", "mean_t", "rstd_t", "run_mean", "run_var", "new_mean", "new_var",
             "new_mean64", "new_var64", "rstd_in", "w", "dw", "db", "coef")  # fmt: skip
    arg = {n: arrays.get(n, p1) for n in names}
    _kernel("channel_finish", ct)(
        (C,),
        (128,),
        (p1, p2, p3, p4, np.int32(K), np.float64(count), np.int32(mode), arg["mean64"], arg["rstd64"],
         arg["var64"], arg["mean_t"], arg["rstd_t"], np.int32(arrays.get("has_run", 0)), arg["run_mean"],
         arg["run_var"], arg["new_mean"], arg["new_var"], arg["new_mean64"], arg["new_var64"],
         np.int32(arrays.get("run_wide", 0)), np.float64(arrays.get("momentum", 0.0)),
         np.float64(arrays.get("eps", 0.0)), arg["rstd_in"], arg["w"], np.int32(arrays.get("has_w", 0)),
         np.int64(arrays.get("cw", C)), arg["dw"], arg["db"], arg["coef"]),
    )  # fmt: skip


def _row_blocks(rows: int) -> int:
    """Blocks of the per-(sample, channel) kernels: one per row, at most 2**31 - 1."""
    return max(1, min(rows, 2**31 - 1))


def _train_forward(
    ct: Any, x: Array, C: int, weight: Array | None, bias: Array | None, eps: float, **run: Any
) -> tuple[Array, Array, Array, Array, Array]:
    """The training forward of the C-ordered (N', Cs, S) view ``x`` (computation dtype ``ct``),
    each of its Cs channels normalized by its own statistics, weight and bias indexed by the
    channel mod ``C`` (BatchNorm: Cs = C; InstanceNorm: the N*C instances). ``run``: the
    running-statistics arguments of ``_finish``. Returns y (x's shape, ``ct``), mean and rstd
    (Cs, ``ct``) and the float64 mean and biased variance (Cs)."""
    n, Cs, S = _ncs(x)
    mean, rstd = cupy.empty((2, Cs), dtype=ct)
    mean64, rstd64, var64 = cupy.empty((3, Cs), dtype=cupy.float64)
    # one pass for the moments; then the mean, the variance (biased), rstd and the running
    # statistics (the variance unbiased)
    _finish(ct, _channel_partials(x, 0), 0, n * S, mean64=mean64, rstd64=rstd64, var64=var64,
            mean_t=mean, rstd_t=rstd, eps=eps, **run)  # fmt: skip
    y = cupy.empty(x.shape, dtype=ct)
    w = x if weight is None else _c_ordered(weight, ct)  # a placeholder pointer where absent
    b = x if bias is None else _c_ordered(bias, ct)
    _kernel("channel_apply", ct)(
        (_row_blocks(n * Cs),),
        (256,),
        (x, y, mean64, rstd64, w, b, np.int64(n * Cs), np.int64(Cs), np.int64(C), np.int64(S),
         np.int32(weight is not None), np.int32(bias is not None)),
    )  # fmt: skip
    return y, mean, rstd, mean64, var64


def _backward(
    ct: Any, dy: Array, x: Array, m: Array, r: Array, weight: Array | None, C: int, training: bool
) -> tuple[list[Array], Array, Array, Array]:
    """The backward of the C-ordered (N', Cs, S) views ``x`` and ``dy`` with the saved
    statistics ``m``, ``r`` (Cs), the weight indexed by the channel mod ``C`` (as
    ``_train_forward``). Returns the float64 partials of the sums of dy, dy * xhat and xhat
    (Cs x K each), each channel's dweight and dbias (Cs, ``ct``) and dx (x's shape, ``ct``)."""
    n, Cs, S = _ncs(x)
    w = r if weight is None else _c_ordered(weight, ct)  # a placeholder pointer where absent
    dw, db = cupy.empty((2, Cs), dtype=ct)
    coef = cupy.empty((Cs, 4), dtype=cupy.float64)  # rstd * w (in float64), mean(dy), mean(xhat), t2
    parts = _channel_partials(x, 2, dy=dy, mean=m, rstd=r)
    mode = 3 if training else 2  # (3: dweight of xhat centred again, as dx)
    _finish(ct, parts, mode, n * S, rstd_in=r, w=w, has_w=int(weight is not None), cw=C, dw=dw, db=db,
            coef=coef)  # fmt: skip
    dx = cupy.empty(x.shape, dtype=ct)
    _kernel("channel_dx", ct)(
        (_row_blocks(n * Cs),),
        (256,),
        (dy, x, m, r, coef, dx, np.int64(n * Cs), np.int64(Cs), np.int64(S), np.int32(training)),
    )
    return parts, dw, db, dx


@functools.cache
def _affine(has_w: bool, has_b: bool) -> Any:
    """``y = (T)((x - m) * r) * w + b`` per element, m and r (per channel) the running
    statistics in the computation dtype (evaluation)."""
    y = "xh" + (" * w" if has_w else "") + (" + b" if has_b else "")
    body = f"const T xh = (T)((x - m) * r); y = {y};"
    return cupy.ElementwiseKernel("T x, T m, T r, T w, T b", "T y", body, f"npnorm_bn_y_{has_w:d}{has_b:d}")


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
    if not training:
        assert running_mean is not None and running_var is not None
        mean = running_mean.astype(ct, copy=True)  # C: never the caller's buffer
        rstd = rstd_of(xp, running_var.astype(ct, copy=False), eps, ct)  # C
        shape = (1, C, 1)
        w = cupy.ones((), dtype=ct) if weight is None else weight.astype(ct, copy=False).reshape(shape)
        b = cupy.zeros((), dtype=ct) if bias is None else bias.astype(ct, copy=False).reshape(shape)
        y = _affine(weight is not None, bias is not None)(
            x.reshape(N, C, S), mean.reshape(shape), rstd.reshape(shape), w, b
        )  # N,C,S
        y = y.astype(input.dtype, copy=False).reshape(input.shape)
        return write_out(xp, out, y), mean, rstd, running_mean, running_var
    new_mean, new_var = running_mean, running_var
    run: dict[str, Any] = {}
    if running_mean is not None and running_var is not None:
        # the new buffers in the computation dtype where the buffers have it, else in float64,
        # then rounded once to the buffers' dtype (as the reference's running_update)
        wide = np.dtype(running_mean.dtype) != np.dtype(ct) or np.dtype(running_var.dtype) != np.dtype(ct)
        new = cupy.empty((2, C), dtype=cupy.float64 if wide else ct)
        suffix = "64" if wide else ""
        run = {"has_run": 1, "run_wide": int(wide), "momentum": momentum, "new_mean" + suffix: new[0],
               "new_var" + suffix: new[1], "run_mean": _c_ordered(running_mean, ct),
               "run_var": _c_ordered(running_var, ct)}  # fmt: skip
    y, mean, rstd, _, _ = _train_forward(ct, x.reshape(N, C, S), C, weight, bias, eps, **run)
    if running_mean is not None and running_var is not None:
        new_mean = new[0].astype(running_mean.dtype, copy=False)
        new_var = new[1].astype(running_var.dtype, copy=False)
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
    x = _c_ordered(input, ct).reshape(N, C, S)
    dy = _c_ordered(grad_output, ct).reshape(N, C, S)
    m = _c_ordered(mean, ct).reshape(C)
    r = _c_ordered(rstd, ct).reshape(C)
    _, dw, db, dx = _backward(ct, dy, x, m, r, weight, C, training)
    dweight = None if weight is None else dw.astype(weight.dtype, copy=False)
    dbias = None if bias is None else db.astype(bias.dtype, copy=False)
    dx = dx.astype(input.dtype, copy=False).reshape(input.shape)
    return write_out(xp, out, dx), dweight, dbias


# --- instances: InstanceNorm ----------------------------------------------------------
# With input statistics, the N x C instances are the channels of BatchNorm's kernels on the
# (1, N*C, S) view (the weight and bias indexed by instance mod C); with the running ones,
# InstanceNorm is BatchNorm in evaluation, and its kernels run as they are.


def _instances_fit(input: Array) -> bool:
    N, C, S = _ncs(input)
    return 0 < N * C <= 65535 and S >= MIN_SPATIAL  # the instances are the grid's second axis


@_dispatch.specialized("instance_norm_forward", CUPY)
def instance_norm_forward(
    xp: Namespace,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    if not _instances_fit(input):
        return _dispatch.generic_kernel("instance_norm_forward")(
            xp, input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, out
        )
    if not use_input_stats:
        return batch_norm_forward(
            xp, input, running_mean, running_var, weight, bias, False, momentum, eps, out
        )
    ct = work_dtype(xp, input, weight, bias, running_mean, running_var)
    N, C, S = _ncs(input)
    x = _c_ordered(input, ct)
    y, mean, rstd, mean64, var64 = _train_forward(ct, x.reshape(1, N * C, S), C, weight, bias, eps)
    new_mean, new_var = running_mean, running_var
    if running_mean is not None and running_var is not None:  # moved towards the instances' average
        batch_mean = mean64.reshape(N, C).sum(axis=0) / N  # C
        batch_var = var64.reshape(N, C).sum(axis=0) / N * (S / (S - 1))  # C, unbiased
        new_mean = running_update(xp, running_mean, batch_mean, momentum)
        new_var = running_update(xp, running_var, batch_var, momentum)
    y = y.astype(input.dtype, copy=False).reshape(input.shape)
    return write_out(xp, out, y), mean.reshape(N, C), rstd.reshape(N, C), new_mean, new_var


@_dispatch.specialized("instance_norm_backward", CUPY)
def instance_norm_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    if not _instances_fit(input):
        return _dispatch.generic_kernel("instance_norm_backward")(
            xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, out
        )
    if not use_input_stats:
        return batch_norm_backward(xp, grad_output, input, mean, rstd, weight, bias, False, out)
    ct = work_dtype(xp, input, weight, bias, mean)
    N, C, S = _ncs(input)
    x = _c_ordered(input, ct).reshape(1, N * C, S)
    dy = _c_ordered(grad_output, ct).reshape(1, N * C, S)
    m = _c_ordered(mean, ct).reshape(N * C)
    r = _c_ordered(rstd, ct).reshape(N * C)
    parts, _, _, dx = _backward(ct, dy, x, m, r, weight, C, True)  # dw, db per instance: unused
    # each channel's sums over its N instances, from the float64 partials (a fixed order);
    # dweight's of xhat centred again per instance, as dx takes it (where finite)
    dweight = None
    if weight is not None:
        sdy, sdyx, sxh = (p.sum(axis=1) for p in parts[:3])  # N*C each, per instance
        sdyx = less_centre(xp, sdyx, sxh / S, sdy)  # N*C: less what the mean's rounding added
        dweight = sdyx.reshape(N, C).sum(axis=0).astype(weight.dtype)
    dbias = None if bias is None else parts[0].reshape(N, C, -1).sum(axis=(0, 2)).astype(bias.dtype)
    dx = dx.astype(input.dtype, copy=False).reshape(input.shape)
    return write_out(xp, out, dx), dweight, dbias
