"""LayerNorm and RMSNorm on inputs whose batch axes lie in another order in memory.

A Fortran-ordered ``(B, T, D)`` input, or any input whose rows are C-ordered but whose
batch axes are permuted in memory (``x.transpose(1, 0, 2)`` of a C-ordered array), is
walked by the fast kernels in memory order (``npnorm.kernels._memory_order``): each row's
output, statistics and dx are bitwise those of the C-ordered input, the parameter
gradients equal to rounding (summed in another order), the output's rows C-ordered with
its batch axes in the input's order in memory, and the statistics C-ordered.
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator

import array_api_compat.numpy as xp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
from npnorm import _threads
from npnorm.functional._dispatch import family_kernel
from npnorm.kernels import _blocks, _memory_order

FAMILIES = [f for f in ("numpy", "numba") if f in npnorm.kernels_available()]
FLOATS = ("float16", "float32", "float64")
# dweight, dbias against the sum of their terms' sizes (float16 is summed in float32)
SUM_TOL = {"float16": 2e-5, "float32": 2e-5, "float64": 1e-13}
# The "numpy" family's row sums (BLAS dot products) round differently in blocks of other
# row counts, so its results match to rounding only (float16: a float32 ulp can round to
# the next float16).
CLOSE = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-14}


@st.composite
def batch_orders(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """``(x, dy, k)``: x of 2-3 batch axes and ``k`` row axes, either Fortran-ordered or
    with C-ordered rows and its batch axes in a drawn order in memory; dy C-ordered, in
    x's layout, or Fortran-ordered."""
    nb, k = draw(st.integers(2, 3)), draw(st.integers(1, 2))
    batch = draw(hnp.array_shapes(min_dims=nb, max_dims=nb, min_side=1, max_side=5))
    tail = draw(hnp.array_shapes(min_dims=k, max_dims=k, min_side=1, max_side=7))
    dtype = np.dtype(draw(st.sampled_from(FLOATS)))
    finite = st.floats(-50, 50, width=min(32, 8 * dtype.itemsize))
    c = draw(hnp.arrays(dtype, batch + tail, elements=finite, fill=st.nothing()))
    g = draw(hnp.arrays(dtype, batch + tail, elements=finite, fill=st.nothing()))

    def laid_out(a: np.ndarray, how: str, perm: list[int]) -> np.ndarray:
        if how == "F":
            return np.asfortranarray(a)
        if how == "C":
            return a
        order = (*perm, *range(nb, nb + k))
        return np.transpose(np.ascontiguousarray(np.transpose(a, order)), np.argsort(order))

    perm = draw(st.permutations(range(nb)))
    how = draw(st.sampled_from(["F", "permuted"]))
    x = laid_out(c, how, perm)
    dy = laid_out(g, draw(st.sampled_from(["C", how, "F"])), perm)
    return x, dy, k


def _calls(family: str, x: np.ndarray, dy: np.ndarray, k: int) -> list[np.ndarray | None]:
    shape = x.shape[x.ndim - k :]
    w = np.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape).astype(x.dtype)
    b = np.linspace(-1, 1, w.size).reshape(shape).astype(x.dtype)
    y, mean, rstd = family_kernel("layer_norm_forward", family)(xp, x, shape, w, b, 1e-5)
    ln = family_kernel("layer_norm_backward", family)(xp, dy, x, shape, mean, rstd, w, b)
    z, r = family_kernel("rms_norm_forward", family)(xp, x, shape, w, 1e-6)
    rms = family_kernel("rms_norm_backward", family)(xp, dy, x, shape, r, w)
    return [y, mean, rstd, *ln, z, r, *rms]


SUMS = (4, 5, 9)  # positions of dweight, dbias (LayerNorm) and dweight (RMSNorm)
DX = {3: 2, 8: 7}  # positions of dx (LayerNorm, RMSNorm): the position of the rstd it scales by


@contextlib.contextmanager
def small_blocks(threads: int) -> Iterator[None]:
    """``threads`` threads, blocks of a row or two and no serial threshold, so that the
    drawn inputs run through many blocks, staged or not, split over the threads."""
    saved = _threads.get_num_threads(), _blocks.BLOCK_BYTES, _blocks.MIN_BLOCKS_PER_THREAD
    staging = None
    if "numba" in FAMILIES:
        from npnorm.kernels import _staging

        staging = _staging, _staging.STAGE_BYTES, _staging.MIN_PARALLEL
        _staging.STAGE_BYTES, _staging.MIN_PARALLEL = 64, 1
    _threads.set_num_threads(threads)
    _blocks.BLOCK_BYTES, _blocks.MIN_BLOCKS_PER_THREAD = 64, 1
    try:
        yield
    finally:
        _threads.set_num_threads(saved[0])
        _blocks.BLOCK_BYTES, _blocks.MIN_BLOCKS_PER_THREAD = saved[1:]
        if staging is not None:
            staging[0].STAGE_BYTES, staging[0].MIN_PARALLEL = staging[1:]


@pytest.mark.parametrize("family", FAMILIES)
@given(case=batch_orders(), threads=st.integers(1, 3))
def test_rows_walked_in_memory_order(family, case, threads):
    """Every result as the C-ordered input's at the same thread count (the compiled
    kernels' bitwise but for the parameter gradients, summed over rows in another order;
    the "numpy" family's to rounding); the outputs' rows C-ordered with the batch axes in
    the input's order in memory where the kernels walked the rows in that order (failed
    before: C-ordered outputs, the rows walked in the input's own order), the statistics
    C-ordered in the batch shape."""
    x, dy, k = case
    with small_blocks(threads):
        got = _calls(family, x, dy, k)
        expected = _calls(family, np.ascontiguousarray(x), np.ascontiguousarray(dy), k)
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == e.shape and a.dtype == e.dtype
        if family == "numba" and i not in SUMS:
            np.testing.assert_array_equal(a, e)
        elif i in SUMS:  # against the sum of the terms' sizes: |dy| * |xhat| <= |dy| * sqrt(L)
            terms = np.abs(dy.astype(np.float64)).reshape(-1, a.size).sum(axis=0) * np.sqrt(a.size)
            atol = SUM_TOL[x.dtype.name] * terms.max()  # (rtol: the rounding to float16)
            np.testing.assert_allclose(a, e, rtol=CLOSE[x.dtype.name], atol=atol)
        else:
            tol = CLOSE[x.dtype.name]
            finite = np.abs(e[np.isfinite(e)])  # (float16 results may overflow: inf where expected)
            scale = finite.max(initial=0)
            if i in DX:  # dx = rstd*(dy*w - ...): terms of size rstd*|dy*w|, which may cancel
                rstd = np.abs(expected[DX[i]].astype(np.float64))
                terms = np.abs(dy.astype(np.float64)).max(initial=0) * 1.5 * rstd.max(initial=0)
                scale = max(scale, terms)  # (a row [16, 1e-10] left dx 1.5e-8 of terms 0.19)
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale)
    for stats in (got[1], got[2], got[7]):
        assert stats.flags.c_contiguous and stats.shape == x.shape[: x.ndim - k]
    order = _memory_order.memory_order(x, k)
    if order is not None:
        for out in (got[0], got[6]):  # y, RMSNorm's y
            assert np.transpose(out, order).flags.c_contiguous
    order = _memory_order.rows_order(k, x, dy, None)  # the backwards'
    if order is not None:
        for out in (got[3], got[8]):  # dx, RMSNorm's dx
            assert np.transpose(out, order).flags.c_contiguous


def test_fortran_ordered_batch_is_one_column_major_matrix():
    """A Fortran-ordered (B, T, D) input's rows in (t, b) order are one column-major
    (T*B, D) matrix: the order found, and none for C-ordered rows, one batch axis, a
    strided batch axis or Fortran-ordered rows of two axes."""
    x = np.asfortranarray(np.zeros((4, 6, 8), np.float32))
    order = _memory_order.memory_order(x, 1)
    assert order == (1, 0, 2)
    rows = _blocks.view(np.transpose(x, order), (24, 8))
    assert rows is not None and rows.flags.f_contiguous
    assert _memory_order.memory_order(np.ascontiguousarray(x), 1) is None
    assert _memory_order.memory_order(np.asfortranarray(np.zeros((6, 8))), 1) is None
    assert _memory_order.memory_order(np.zeros((4, 12, 8))[:, ::2], 1) is None
    assert _memory_order.memory_order(np.asfortranarray(np.zeros((4, 6, 8, 2))), 2) is None


@pytest.mark.parametrize("walked", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_out_and_saved_statistics_in_memory_order(family, walked):
    """With ``out=`` for a Fortran-ordered input the kernels write and return ``out``
    itself: one laid out as the output of the rows walked in memory order (``walked``)
    takes that order, a C-ordered one the input's own order; statistics passed flat (R,)
    or of a wrong size behave as for a C-ordered input (the same values; the same error)."""
    rng = np.random.default_rng(3)
    c = rng.normal(size=(3, 5, 7))
    x, dy = np.asfortranarray(c), np.asfortranarray(rng.normal(size=c.shape))
    w = rng.uniform(0.5, 1.5, 7)
    expected_y = family_kernel("layer_norm_forward", family)(xp, x, (7,), w, None, 1e-5)[0]
    out = np.empty_like(expected_y) if walked else np.empty_like(c)
    assert (_memory_order.memory_order(x, 1, out) is not None) == walked
    y, mean, rstd = family_kernel("layer_norm_forward", family)(xp, x, (7,), w, None, 1e-5, out)
    assert y is out
    np.testing.assert_array_equal(out, expected_y)
    dx_out = np.empty_like(out)
    assert (_memory_order.rows_order(1, x, dy, dx_out) is not None) == walked
    dx, _, _ = family_kernel("layer_norm_backward", family)(
        xp, dy, x, (7,), mean.ravel(), rstd, w, None, dx_out
    )
    assert dx is dx_out
    expected = family_kernel("layer_norm_backward", family)(
        xp, np.ascontiguousarray(dy), c, (7,), mean, rstd, w, None
    )
    np.testing.assert_array_equal(dx, expected[0])
    with pytest.raises(ValueError, match="mean must have one value per row"):
        family_kernel("layer_norm_backward", family)(xp, dy, x, (7,), mean[:2], rstd, w, None)
    with pytest.raises(ValueError, match="rstd must have one value per row"):
        family_kernel("rms_norm_backward", family)(xp, dy, x, (7,), rstd[:, :3], w)


@pytest.mark.parametrize("family", FAMILIES)
def test_out_of_another_order_takes_no_temporary(family):
    """A C-ordered ``out`` for a Fortran-ordered input is written directly, not through a
    full-size temporary (the rows walked in memory order would need one: 1.07x the input's
    bytes at peak, where ``out=`` is meant to save them; failed before)."""
    rng = np.random.default_rng(4)
    x = np.asfortranarray(rng.normal(size=(16, 512, 128)))  # 8 MiB
    w = np.ones(128)
    y, mean, rstd = family_kernel("layer_norm_forward", family)(xp, x, (128,), w, None, 1e-5)
    out = np.empty(x.shape)
    saved = _threads.get_num_threads()
    _threads.set_num_threads(1)  # (scratch blocks of 1 MiB per staged array and thread)
    tracemalloc.start()
    try:
        family_kernel("layer_norm_forward", family)(xp, x, (128,), w, None, 1e-5, out)
        family_kernel("layer_norm_backward", family)(xp, y, x, (128,), mean, rstd, w, None, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        _threads.set_num_threads(saved)
    assert peak < 0.4 * x.nbytes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "shape, layout",
    [((4, 6, 8), "F"), ((4, 6, 8), "strided"), ((3, 4, 5, 8), "F"), ((3, 4, 5, 8), "C")],
)
def test_an_out_the_walk_cannot_write_gets_the_results_without_out(family, shape, layout):
    """A Fortran-ordered input with an ``out`` that is not laid out as the fresh output
    (Fortran-ordered or strided; or C-ordered, where a sample of the input is no view of
    rows and its own order would copy it whole): every result, dweight and dbias too, is
    bitwise the call's without ``out`` (the rows walked in memory order, the fresh output
    copied; the input's own order summed dweight otherwise, and took more memory)."""
    rng = np.random.default_rng(5)
    c = rng.normal(size=shape)
    x, dy = np.asfortranarray(c), np.asfortranarray(rng.normal(size=shape))
    D = shape[-1]
    w, b = rng.uniform(0.5, 1.5, D), rng.normal(size=D)

    def new_out():
        if layout == "F":
            return np.asfortranarray(np.empty(shape))
        if layout == "strided":
            return np.empty((*shape[:-1], 2 * D))[..., ::2]
        return np.empty(shape)

    fwd, bwd = family_kernel("layer_norm_forward", family), family_kernel("layer_norm_backward", family)
    rfwd, rbwd = family_kernel("rms_norm_forward", family), family_kernel("rms_norm_backward", family)
    y, mean, rstd = fwd(xp, x, (D,), w, b, 1e-5)
    fresh = [(y, mean, rstd), bwd(xp, dy, x, (D,), mean, rstd, w, b)]
    out_y, out_dx = new_out(), new_out()
    got = [fwd(xp, x, (D,), w, b, 1e-5, out_y), bwd(xp, dy, x, (D,), mean, rstd, w, b, out_dx)]
    assert got[0][0] is out_y and got[1][0] is out_dx
    ry, rr = rfwd(xp, x, (D,), w, 1e-5)
    fresh += [(ry, rr), rbwd(xp, dy, x, (D,), rr, w)]
    out_y, out_dx = new_out(), new_out()
    got += [rfwd(xp, x, (D,), w, 1e-5, out_y), rbwd(xp, dy, x, (D,), rr, w, out_dx)]
    for want, have in zip(fresh, got, strict=True):
        for a, h in zip(want, have, strict=True):
            np.testing.assert_array_equal(h, a)
