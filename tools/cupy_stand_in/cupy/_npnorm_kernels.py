"""NumPy emulations of the CUDA kernels in npnorm/kernels/cupy_fused.py's ``_SOURCE``.

Each follows its kernel's partition of the work: which grid block and thread takes which
elements, in which order a thread accumulates (float64 sums, Welford's update), and the
block reductions' trees (``block_sum``, also for the source's ``block_sum3``, whose three
sums take block_sum's tree, and ``block_moments``: the same shuffle trees, so float64 sums
come out in the GPU's order). The (T) and (S) casts of the source are applied where they
round: T-typed arithmetic runs on T arrays (float32 or float64, the module's ``typedef``),
S-typed on float64 arrays.

Not emulated: fused multiply-adds the compiler may contract (nvcc's default --fmad=true,
e.g. ``xh * wc + bc`` in T, ``q += d * d``), so results agree with a GPU to rounding,
not bitwise. Launches must be 1-D where the source indexes only ``.x`` (and 2-D grids
for ``channel_sums``; (32, 32) blocks for ``column_sums``); anything else raises rather
than guessing.
"""

from __future__ import annotations

import math

import numpy as np

from ._elementwise import ELEMENTWISE, ELEMENTWISE_BODIES
from ._raw import FINGERPRINTS, Launch, StandinError, block_moments, block_sum, chan_merge, emulates

F64 = np.float64


def _one_d(L: Launch, grid_dims: int = 1) -> int:
    """The 1-D block size, the launch checked to use only the axes the source indexes."""
    if L.block[1:] != (1, 1):
        raise StandinError(f"{L.name}: block {L.block}: the source indexes threadIdx.x only")
    if L.grid[grid_dims:] != (1,) * (3 - grid_dims):
        raise StandinError(f"{L.name}: grid {L.grid}: the source indexes blockIdx up to {grid_dims} axes")
    return L.block[0]


def _thread_sum(parts: np.ndarray) -> np.ndarray:
    """A thread's sequential float64 sum over its values (axis -2 of (..., K, bd))."""
    s = np.zeros(parts.shape[:-2] + parts.shape[-1:])
    for k in range(parts.shape[-2]):
        s = s + parts[..., k, :]
    return s


def _as_threads(a: np.ndarray, kmax: int, bd: int) -> np.ndarray:
    """(R, cols) values of the columns j < cols as (R, KMAX, bd), j = t + k * bd, 0 past cols."""
    R, cols = a.shape
    out = np.zeros((R, kmax * bd), dtype=a.dtype)
    out[:, :cols] = a
    return out.reshape(R, kmax, bd)


# --- rows: LayerNorm and RMSNorm ------------------------------------------------------


@emulates("rows_forward", "x, w, b, y, mean_out, rstd_out, R, D, eps, center, has_w, has_b")
def rows_forward(L: Launch) -> None:
    """Thread t holds the row's values t + k * blockDim.x, k < KMAX (0 past D)."""
    bd = _one_d(L)
    kmax = L.defines["KMAX"]
    T = L.T
    R, D, eps = L.val("R"), L.val("D"), L.val("eps")
    center, has_w, has_b = L.val("center"), L.val("has_w"), L.val("has_b")
    if R <= 0:
        return
    if D <= 0:
        raise StandinError(f"{L.name}: D = {D}")
    cols = min(D, kmax * bd)  # the columns the block's threads hold (j = t + k * bd, k < kmax)
    x = L.ptr("x", need=R * D)[: R * D].reshape(R, D)[:, :cols]
    xs = _as_threads(x.astype(F64), kmax, bd)  # (S)xv[k], 0 past D
    mu = block_sum(_thread_sum(xs)) / D if center else np.zeros(R)
    valid = (np.arange(kmax * bd) < cols).reshape(kmax, bd)
    d = xs - mu[:, None, None]
    q = _thread_sum(np.where(valid, d * d, 0.0))
    rs = 1.0 / np.sqrt(block_sum(q) / D + eps)
    v = ((x.astype(F64) - mu[:, None]) * rs[:, None]).astype(T)  # (T)(((S)xv - mu) * rs)
    if has_w:
        v = v * L.ptr("w", need=cols)[:cols]
    if has_b:
        v = v + L.ptr("b", need=cols)[:cols]
    L.ptr("y", need=R * D)[: R * D].reshape(R, D)[:, :cols] = v
    if center:
        L.ptr("mean_out", need=R)[:R] = mu.astype(T)
    L.ptr("rstd_out", need=R)[:R] = rs.astype(T)


@emulates("rows_backward", "dy, x, mean, rstd, w, dx, pw, pb, R, D, center, has_w, need_pw, need_pb")
def rows_backward(L: Launch) -> None:
    """dx of each row (thread t holds the values t + k * blockDim.x, k < KMAX), and each
    block's column sums pw, pb over its rows."""
    bd = _one_d(L)
    kmax = L.defines["KMAX"]
    G = L.grid[0]
    T = L.T
    R, D = L.val("R"), L.val("D")
    center, has_w = L.val("center"), L.val("has_w")
    if D <= 0:
        raise StandinError(f"{L.name}: D = {D}")
    cols = min(D, kmax * bd)
    Rp = max(R, 0)
    x = L.ptr("x", need=Rp * D)[: Rp * D].reshape(Rp, D)[:, :cols]
    g = L.ptr("dy", need=Rp * D)[: Rp * D].reshape(Rp, D)[:, :cols]
    rs = L.ptr("rstd", need=Rp)[:Rp]
    m = L.ptr("mean", need=Rp)[:Rp] if center else np.zeros(Rp, dtype=T)
    xh = (x - m[:, None]) * rs[:, None]  # in T
    gh = g * L.ptr("w", need=cols)[:cols] if has_w else g  # in T
    xhs, ghs = xh.astype(F64), gh.astype(F64)
    s0 = block_sum(_thread_sum(_as_threads(xhs, kmax, bd)))
    s1 = block_sum(_thread_sum(_as_threads(ghs, kmax, bd)))
    s2 = block_sum(_thread_sum(_as_threads(ghs * xhs, kmax, bd)))
    mx = s0 / D if center else np.zeros(Rp)
    t1 = s1 / D if center else np.zeros(Rp)
    t2 = s2 / D - mx * t1  # as the source: inf - inf (NaN) where mx * t1 is not finite
    dx = (rs.astype(F64)[:, None] * (ghs - t1[:, None] - (xhs - mx[:, None]) * t2[:, None])).astype(T)
    if Rp:
        L.ptr("dx", need=Rp * D)[: Rp * D].reshape(Rp, D)[:, :cols] = dx
    if L.val("need_pw") or L.val("need_pb"):
        # block b takes the rows b, b + G, ... in order; each thread keeps its columns' sums
        aw, ab = np.zeros((G, cols)), np.zeros((G, cols))
        gs = g.astype(F64)
        with np.errstate(invalid="ignore"):  # (inf - inf where the source gives NaN too)
            cw = gs * (xhs - mx[:, None])  # dweight's: xhat centred again, as dx takes it
        for i in range(math.ceil(Rp / G)):
            lo, hi = i * G, min((i + 1) * G, Rp)
            aw[: hi - lo] += cw[lo:hi]
            ab[: hi - lo] += gs[lo:hi]
        if L.val("need_pw"):
            L.ptr("pw", need=G * D)[: G * D].reshape(G, D)[:, :cols] = aw
        if L.val("need_pb"):
            L.ptr("pb", need=G * D)[: G * D].reshape(G, D)[:, :cols] = ab


@emulates("column_sums", "pw, pb, dw, db, B, D, need_pw, need_pb")
def column_sums(L: Launch) -> None:
    if L.block != (32, 32, 1):
        raise StandinError(
            f"column_sums: block {L.block}: the source's shared tiles and strides take (32, 32)"
        )
    if L.grid[1:] != (1, 1):
        raise StandinError(f"column_sums: grid {L.grid}: the source indexes blockIdx.x only")
    T = L.T
    B, D = L.val("B"), L.val("D")
    need_pw, need_pb = L.val("need_pw"), L.val("need_pb")
    cols = min(D, 32 * L.grid[0])  # j = blockIdx.x * 32 + threadIdx.x
    if cols <= 0:
        return
    Bp = max(B, 0)

    def sums(name: str) -> np.ndarray:
        p = L.ptr(name, need=Bp * D)[: Bp * D].reshape(Bp, D)[:, :cols]
        tile = np.zeros((32, cols))  # thread (tx, ty): rows ty, ty + 32, ... in order
        for i0 in range(0, Bp, 32):
            blk = p[i0 : i0 + 32]
            tile[: blk.shape[0]] += blk
        acc = np.zeros(cols)
        for t in range(32):  # thread (tx, 0): the 32 results in order
            acc = acc + tile[t]
        return acc

    if need_pw:
        L.ptr("dw", need=cols)[:cols] = sums("pw").astype(T)
    if need_pb:
        L.ptr("db", need=cols)[:cols] = sums("pb").astype(T)


# --- channels: BatchNorm, InstanceNorm --------------------------------------------------


@emulates("channel_sums", "x, dy, mean, rstd, p1, p2, p3, p4, N, C, Sz, Kn, Ks, mode")
def channel_sums(L: Launch) -> None:
    bd = _one_d(L, grid_dims=2)
    T = L.T
    G, Cg = L.grid[0], L.grid[1]  # blocks per channel; channels c = blockIdx.y
    N, C, Sz = L.val("N"), L.val("C"), L.val("Sz")
    Kn, Ks, mode = L.val("Kn"), L.val("Ks"), L.val("mode")
    if Kn <= 0 or Ks <= 0:
        raise StandinError(f"channel_sums: Kn = {Kn}, Ks = {Ks}: division by zero")
    k = np.arange(G)
    kn, ks = k % Kn, k // Kn
    chunk = (Sz + Ks - 1) // Ks
    s0 = ks * chunk
    s1 = np.minimum(s0 + chunk, Sz)
    nmax = max(0, -(-N // Kn))  # samples of block kn = 0, the most
    J = max(0, -(-chunk // bd))  # values per thread and sample, at most
    n = kn[:, None] + Kn * np.arange(nmax)[None, :]  # (G, nmax)
    s = s0[:, None, None] + np.arange(bd)[None, :, None] + bd * np.arange(J)[None, None, :]  # (G, bd, J)
    ok = (n < N)[:, None, :, None] & (s < s1[:, None, None])[:, :, None, :]  # (G, bd, nmax, J)
    Lq = nmax * J  # a thread's values: samples outer, its slice's values inner
    ok = ok.reshape(G, bd, Lq)
    m = rs = None
    if mode == 2:
        m = L.ptr("mean", need=Cg)[:Cg]
        rs = L.ptr("rstd", need=Cg)[:Cg]
    p = [L.ptr(f"p{i}", need=Cg * G) for i in (1, 2, 3)]
    p4 = L.ptr("p4", need=Cg * G) if mode == 0 else None
    xf = L.ptr("x")
    gf = L.ptr("dy") if mode != 0 else None
    step = max(1, int(4_000_000 // max(1, G * bd * Lq)))  # channels per batch (memory)
    for c0 in range(0, Cg, step):
        cs = np.arange(c0, min(Cg, c0 + step))
        idx = (n[None, :, None, :, None] * C + cs[:, None, None, None, None]) * Sz + s[
            None, :, :, None, :
        ]  # (c, G, bd, nmax, J)
        idx = idx.reshape(len(cs), G, bd, Lq)
        valid = np.broadcast_to(ok, idx.shape)
        if valid.any():
            hi = int(idx[valid].max()) + 1
            lo = int(idx[valid].min())
            for name, f in (("x", xf), ("dy", gf)):
                if f is not None and (hi > f.size or lo < 0):
                    raise StandinError(
                        f"channel_sums: reads {name}[{lo}..{hi - 1}], it has {f.size} elements"
                    )
        safe = np.where(valid, idx, 0)
        xv = xf[safe] if xf.size else np.zeros(idx.shape, T)
        shape = idx.shape[:-1]
        a1, a2, a3, a4 = (np.zeros(shape) for _ in range(4))
        if mode == 0:
            for q in range(Lq):  # Welford's update, per thread
                v = xv[..., q].astype(F64)
                w = valid[..., q]
                n1 = a1 + 1
                d = v - a2
                m1 = a2 + d / n1
                a3 = np.where(w, a3 + d * (v - m1), a3)
                a1, a2 = np.where(w, n1, a1), np.where(w, m1, a2)
                a4 = np.where(w, a4 + v, a4)
            r1, r2, r3 = block_moments(a1, a2, a3)
            r4 = block_sum(a4)
        else:
            gv = gf[safe]
            mc = m[cs][:, None, None, None] if mode == 2 else np.zeros((1, 1, 1, 1), T)
            rc = rs[cs][:, None, None, None] if mode == 2 else np.zeros((1, 1, 1, 1), T)
            xh_all = ((xv - mc) * rc).astype(F64)  # (S)((x - m) * rs), in T
            for q in range(Lq):
                w = valid[..., q]
                gq = gv[..., q].astype(F64)
                xh = xh_all[..., q]
                a1 = np.where(w, a1 + gq, a1)
                a2 = np.where(w, a2 + gq * xh, a2)
                a3 = np.where(w, a3 + xh, a3)
            r1, r2, r3 = block_sum(a1), block_sum(a2), block_sum(a3)
            r4 = None
        at = (cs[:, None] * G + k[None, :]).reshape(-1)  # c * gridDim.x + blockIdx.x
        p[0][at], p[1][at], p[2][at] = r1.reshape(-1), r2.reshape(-1), r3.reshape(-1)
        if mode == 0:
            p4[at] = r4.reshape(-1)


@emulates(
    "channel_finish",
    "p1, p2, p3, p4, K, count, mode, mean64, rstd64, var64, mean_t, rstd_t, has_run, run_mean, run_var, "
    "new_mean, new_var, new_mean64, new_var64, run_wide, momentum, eps, rstd_in, w, has_w, Cw, dw, db, coef",
)
def channel_finish(L: Launch) -> None:
    bd = _one_d(L)
    T = L.T
    Cg = L.grid[0]  # c = blockIdx.x
    K, count, mode = L.val("K"), float(L.val("count")), L.val("mode")
    Kp = max(K, 0)
    Lk = -(-Kp // bd)
    kk = np.arange(bd)[:, None] + bd * np.arange(Lk)[None, :]  # thread t: k = t, t + bd, ...
    valid = kk < Kp
    at = np.arange(Cg)[:, None, None] * Kp + np.where(valid, kk, 0)[None]  # (Cg, bd, Lk)

    def load(name: str) -> np.ndarray:
        return np.where(valid, L.ptr(name, need=Cg * Kp)[at], 0.0)

    v1, v2, v3 = load("p1"), load("p2"), load("p3")
    a1, a2, a3, a4 = (np.zeros((Cg, bd)) for _ in range(4))
    if mode == 0:
        v4 = load("p4")
        for q in range(Lk):
            w = valid[:, q]
            n1, m1, q1 = chan_merge(a1, a2, a3, v1[..., q], v2[..., q], v3[..., q])
            a1, a2, a3 = np.where(w, n1, a1), np.where(w, m1, a2), np.where(w, q1, a3)
            a4 = np.where(w, a4 + v4[..., q], a4)
        a1, a2, a3 = block_moments(a1, a2, a3)
        a4 = block_sum(a4)
        mu = np.where(np.isfinite(a2), a2, a4 / count)
        var = a3 / count
        rs = 1.0 / np.sqrt(var + L.val("eps"))
        L.ptr("mean64", need=Cg)[:Cg] = mu
        L.ptr("rstd64", need=Cg)[:Cg] = rs
        L.ptr("var64", need=Cg)[:Cg] = var
        L.ptr("mean_t", need=Cg)[:Cg] = mu.astype(T)
        L.ptr("rstd_t", need=Cg)[:Cg] = rs.astype(T)
        if L.val("has_run"):
            mom = L.val("momentum")
            rm = L.ptr("run_mean", need=Cg)[:Cg].astype(F64)
            rv = L.ptr("run_var", need=Cg)[:Cg].astype(F64)
            nm = (1.0 - mom) * rm + mom * mu
            nv = (1.0 - mom) * rv + mom * (var * (count / (count - 1.0)))
            if L.val("run_wide"):
                L.ptr("new_mean64", need=Cg)[:Cg] = nm
                L.ptr("new_var64", need=Cg)[:Cg] = nv
            else:
                L.ptr("new_mean", need=Cg)[:Cg] = nm.astype(T)
                L.ptr("new_var", need=Cg)[:Cg] = nv.astype(T)
    else:
        for q in range(Lk):
            w = valid[:, q]
            a1 = np.where(w, a1 + v1[..., q], a1)
            a2 = np.where(w, a2 + v2[..., q], a2)
            a3 = np.where(w, a3 + v3[..., q], a3)
        a1, a2, a3 = block_sum(a1), block_sum(a2), block_sum(a3)
        with np.errstate(all="ignore"):
            shift = (a3 / count) * a1  # mode 3: dweight of xhat centred again (where finite)
            dw = np.where((mode == 3) & np.isfinite(shift), a2 - shift, a2)
        L.ptr("dw", need=Cg)[:Cg] = dw.astype(T)
        L.ptr("db", need=Cg)[:Cg] = a1.astype(T)
        scale = L.ptr("rstd_in", need=Cg)[:Cg].astype(F64)
        if L.val("has_w"):
            Cw = L.val("Cw")
            if Cw <= 0:
                raise StandinError(f"channel_finish: Cw = {Cw}: division by zero")
            wi = np.arange(Cg) % Cw
            scale = scale * L.ptr("w", need=int(wi.max()) + 1 if Cg else 0)[wi].astype(F64)
        t1, mx = a1 / count, a3 / count
        coef = L.ptr("coef", need=4 * Cg)[: 4 * Cg].reshape(Cg, 4)
        coef[:, 0], coef[:, 1], coef[:, 2], coef[:, 3] = scale, t1, mx, a2 / count - mx * t1


@emulates("channel_apply", "x, y, mean64, rstd64, w, b, rows, Cs, C, Sz, has_w, has_b")
def channel_apply(L: Launch) -> None:
    _one_d(L)  # rows: a grid-stride loop; values: a block-stride loop (any sizes cover all)
    T = L.T
    rows, Cs, C, Sz = L.val("rows"), L.val("Cs"), L.val("C"), L.val("Sz")
    has_w, has_b = L.val("has_w"), L.val("has_b")
    if rows <= 0:
        return
    if Cs <= 0 or C <= 0:
        raise StandinError(f"channel_apply: Cs = {Cs}, C = {C}: division by zero")
    r = np.arange(rows)
    i, c = r % Cs, r % C
    mc = L.ptr("mean64", need=int(i.max()) + 1)[i]
    rc = L.ptr("rstd64", need=int(i.max()) + 1)[i]
    wc = L.ptr("w", need=int(c.max()) + 1)[c] if has_w else None
    bc = L.ptr("b", need=int(c.max()) + 1)[c] if has_b else None
    if Sz <= 0:
        return
    x = L.ptr("x", need=rows * Sz)[: rows * Sz].reshape(rows, Sz)
    xh = ((x.astype(F64) - mc[:, None]) * rc[:, None]).astype(T)  # (T)(((S)x - mc) * rc)
    y = xh
    if has_w:
        y = y * wc[:, None]
    if has_b:
        y = y + bc[:, None]
    L.ptr("y", need=rows * Sz)[: rows * Sz].reshape(rows, Sz)[...] = y


@emulates("channel_dx", "dy, x, mean, rstd, coef, dx, rows, C, Sz, training")
def channel_dx(L: Launch) -> None:
    _one_d(L)
    T = L.T
    rows, C, Sz, training = L.val("rows"), L.val("C"), L.val("Sz"), L.val("training")
    if rows <= 0:
        return
    if C <= 0:
        raise StandinError(f"channel_dx: C = {C}: division by zero")
    c = np.arange(rows) % C
    nc = int(c.max()) + 1
    coef = L.ptr("coef", need=4 * nc)[: 4 * nc].reshape(nc, 4)[c]
    scale, t1, mx, t2 = (coef[:, j][:, None] for j in range(4))
    m = L.ptr("mean", need=nc)[c][:, None]  # read whether training or not, as the source
    r = L.ptr("rstd", need=nc)[c][:, None]
    if Sz <= 0:
        return
    g = L.ptr("dy", need=rows * Sz)[: rows * Sz].reshape(rows, Sz).astype(F64)
    if training:
        x = L.ptr("x", need=rows * Sz)[: rows * Sz].reshape(rows, Sz)
        xh = ((x - m) * r).astype(F64)  # (S)((x - m) * r), in T
        dx = (scale * (g - t1 - (xh - mx) * t2)).astype(T)
    else:
        dx = (g * scale).astype(T)
    L.ptr("dx", need=rows * Sz)[: rows * Sz].reshape(rows, Sz)[...] = dx


# --- elementwise ----------------------------------------------------------------------


def _bn_y(has_w: bool, has_b: bool):
    def fn(x, m, r, w, b):
        xh = ((x - m) * r).astype(x.dtype, copy=False)  # (T)((x - m) * r), all in T
        y = xh
        if has_w:
            y = y * w
        if has_b:
            y = y + b
        return y.astype(x.dtype, copy=False)

    return fn


for _w in (0, 1):
    for _b in (0, 1):
        _name = f"npnorm_bn_y_{_w:d}{_b:d}"
        ELEMENTWISE[_name] = _bn_y(bool(_w), bool(_b))
        _y = "xh" + (" * w" if _w else "") + (" + b" if _b else "")
        ELEMENTWISE_BODIES[_name] = f"const T xh = (T)((x - m) * r); y = {_y};"


# --- the source each emulation was written against --------------------------------------
# Fingerprints (cupy._raw.fingerprint: the kernel and the __device__ functions it calls,
# comments and spacing ignored) of npnorm/kernels/cupy_fused.py's _SOURCE as emulated
# above. A kernel whose source differs is recorded in cupy.STALE (check.py fails):
# review its emulation against the new source, then update its fingerprint here.
FINGERPRINTS.update(
    {
        "rows_forward": "58356f3fa62d",
        "rows_backward": "3378a065d3e5",
        "column_sums": "8ef2bd6eecba",
        "channel_sums": "a2849d80256f",
        "channel_finish": "76a111d5355c",
        "channel_apply": "def6dd7c8296",
        "channel_dx": "18773145f30c",
    }
)
