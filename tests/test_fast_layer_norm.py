"""The fast NumPy LayerNorm/RMSNorm kernels against the generic ones, and the threads.

``npnorm.kernels.numpy_fast`` must give the generic kernels' results to rounding for
every layout, dtype and size; the block size is shrunk in most tests so that small
arrays still span many blocks and several threads.
"""

from __future__ import annotations

import math
import os
import tracemalloc

import array_api_compat.numpy as xp
import numpy as np
import pytest
from helpers import at_elements, gradient_terms, output_terms, parameter_at, statistic_max, statistic_scales
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
import npnorm.functional as F
from npnorm import _threads
from npnorm.functional._dispatch import generic_kernel, kernel, use_kernels
from npnorm.kernels import _blocks
from npnorm.kernels import numpy_fast as fast

OPS = ("layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward")
LAYOUTS = ("C", "F", "rows_sliced", "inner_sliced", "transposed", "batch_swapped")
FLOATS = ("float16", "float32", "float64")
# the block size and thread count fixtures hold for every drawn example
FIXTURES_OK = [HealthCheck.function_scoped_fixture]
REL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-5}  # of the computation dtype
pytestmark = pytest.mark.usefixtures("restore_threads")  # (tests/conftest.py)


@pytest.fixture(autouse=True)
def numpy_kernels():
    """These tests are about the "numpy" kernel family: the public functions use it."""
    with use_kernels("numpy"):
        yield


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 512 bytes: a few rows each, so small inputs span many blocks."""
    monkeypatch.setattr(_blocks, "BLOCK_BYTES", 512)
    monkeypatch.setattr(_blocks, "MIN_BLOCKS_PER_THREAD", 1)


def laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """The values of ``a`` in a different memory layout (same dtype)."""
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "rows_sliced":  # every other entry along the first axis
        big = np.zeros((2 * a.shape[0], *a.shape[1:]), dtype=a.dtype)
        big[::2] = a
        return big[::2]
    if layout == "inner_sliced":  # every other entry along the last axis
        big = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype=a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if layout == "transposed":  # all strides reversed
        return np.ascontiguousarray(a.T).T
    if layout == "batch_swapped" and a.ndim >= 2:
        return np.ascontiguousarray(np.swapaxes(a, 0, 1)).swapaxes(0, 1)
    return a


def ulp(dtype) -> float:
    return float(np.finfo(dtype).eps)


def assert_close(ours, ref, ct, scale, what):
    """``ours`` equals ``ref`` to the rounding of the computation dtype ``ct`` plus one
    rounding to the result's dtype; ``scale`` is the size errors are relative to. A
    result rounded into the subnormal range has an absolute spacing (2**-24 in float16):
    two kernels whose exact values differ by a rounding may land a step apart there."""
    if ref is None:
        assert ours is None, what
        return
    assert isinstance(ours, np.ndarray), what
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (what, ours.dtype, ref.dtype, ours.shape)
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    scale = np.maximum(scale, 1e-30)
    tiny = float(np.finfo(ref.dtype).smallest_subnormal)
    tol = REL[np.dtype(ct).name] * scale + 2 * ulp(ref.dtype) * np.abs(b) + 2 * tiny
    if ref.dtype != ct:  # rounded once more to a narrower dtype: one ulp either way
        tol = tol + ulp(ref.dtype) * np.abs(b)
    with np.errstate(invalid="ignore"):  # inf - inf
        # NaN fails unless the reference has it there too (|a - b| > tol let NaN through);
        # an infinite reference needs the same value (its tolerance is infinite)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        bad = ~np.where(np.isfinite(b), np.abs(a - b) <= tol, same)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} differ, max {np.abs(a - b).max()}"


_settings = st.fixed_dictionaries(
    {
        "batch": st.lists(st.integers(1, 7), min_size=0, max_size=3),
        "norm": st.lists(st.integers(1, 9), min_size=1, max_size=3),
        "dtype": st.sampled_from(FLOATS),
        "param_dtype": st.sampled_from((None, "float32", "float64")),  # None: as the input
        "layout": st.sampled_from(LAYOUTS),
        "dy_layout": st.sampled_from(LAYOUTS),
        "eps": st.sampled_from((None, 1e-5, 0.25)),
        "offset": st.sampled_from((0.0, 3.0, 100.0, 1e4)),  # 1e4: over 1e3 x the values' spread
    }
)


@st.composite
def _problems(draw: st.DrawFn) -> dict:
    """One drawn problem: its settings, then its arrays in float64 (``make`` casts them),
    drawn element by element so that a failure shrinks to its values."""
    p = draw(_settings)
    full, norm = (*p["batch"], *p["norm"]), tuple(p["norm"])
    values = st.floats(-8, 8, width=16)  # exact in every dtype drawn
    p["x"] = draw(hnp.arrays(np.float64, full, elements=values, fill=st.nothing()), label="x")
    p["dy"] = draw(hnp.arrays(np.float64, full, elements=values, fill=st.nothing()), label="dy")
    p["w"] = draw(st.none() | hnp.arrays(np.float64, norm, elements=st.floats(0.5, 1.5, width=16)), label="w")
    p["b"] = draw(st.none() | hnp.arrays(np.float64, norm, elements=values), label="b")
    # and each row (x's and dy's) scaled on its own, so that rows of very different sizes
    # meet in one call (hand-made problems leave these out: 1)
    scales = statistic_scales("layer_norm", full, tuple(p["batch"]))
    for name in ("x", "dy"):
        p[f"{name}_scale"] = draw(scales, label=f"{name} scales")
    return p


problems = _problems()


def make(p):
    """Input, upstream gradient and parameters of one problem, in its dtypes and layouts."""
    norm = tuple(p["norm"])
    pd = p["param_dtype"] or p["dtype"]
    x = laid_out(((p["x"] + p["offset"]) * p.get("x_scale", 1.0)).astype(p["dtype"]), p["layout"])
    dy = laid_out((p["dy"] * p.get("dy_scale", 1.0)).astype(p["dtype"]), p["dy_layout"])
    w = None if p["w"] is None else p["w"].astype(pd)
    b = None if p["b"] is None else p["b"].astype(pd)
    return norm, x, dy, w, b


def check_layer_norm(p, eps=1e-5):
    norm, x, dy, w, b = make(p)
    ct = np.result_type(np.float32, *(a.dtype for a in (x, w, b) if a is not None))
    y, mean, rstd = fast.layer_norm_forward(xp, x, norm, w, b, eps)
    ry, rmean, rrstd = generic_kernel("layer_norm_forward")(xp, x, norm, w, b, eps)
    # each row's mean to its own largest |x| (not the largest of all)
    assert_close(mean, rmean, ct, statistic_max("layer_norm", x, rmean), "mean")
    assert_close(rstd, rrstd, ct, np.abs(rrstd.astype(np.float64)) * 4, "rstd")
    # each element to its own terms: both centre again where the mean's rounding to ct
    # would show (RECENTRE_ABOVE), so the offset's allowance is the float64 mean's rounding
    # alone, up to n - 1 roundings of |mean| for a row of n values (with one of 2 max|x|
    # max rstd max|w| + max|b|, a forward whose output is off by 20 roundings of the mean
    # in ct, times rstd and w, passed both drawn tests)
    b_at = 0.0 if b is None else parameter_at("layer_norm", x, b)
    terms, mean_rounding = output_terms("layer_norm", x, w, rmean, rrstd)
    assert_close(y, ry, ct, terms + mean_rounding / REL[np.dtype(ct).name] + b_at, "output")

    dx, dw, db = fast.layer_norm_backward(xp, dy, x, norm, rmean, rrstd, w, b)
    rdx, rdw, rdb = generic_kernel("layer_norm_backward")(xp, dy, x, norm, rmean, rrstd, w, b)
    # Both centre the recomputed xhat again (the fast kernels on rows whose mean is more than
    # RECENTRE_ABOVE standard deviations from 0, below which the saved mean's rounding moves
    # xhat by under two roundings): dx's error is bounded by |xhat|, not by the offset
    # (1 + max|x| * rstd, which let the kernels that did not centre pass at offset 1e4).
    # Each element goes by its own terms on its own row (helpers.gradient_terms; the largest
    # terms of all, times sqrt(D), let a dx wrong on a row of small terms pass). dweight =
    # sum(dy * xhat): on a row near 0, which only the reference centres again, each term
    # moves by dy times xhat's mean (under two roundings of ct): the terms' 1 + |xhat| (a
    # float16 row at offset 3 with float32 weights: 1.4e-7 off, 3x a tolerance from the
    # column's sum of |dy * xhat| alone)
    dx_terms, dw_terms, db_terms = gradient_terms("layer_norm", x, dy, w, rmean, rrstd, batch=True)
    assert_close(dx, rdx, ct, 4 * dx_terms, "dx")
    assert_close(dw, rdw, ct, dw_terms, "dweight")
    assert_close(db, rdb, ct, db_terms, "dbias")


def check_rms_norm(p):
    norm, x, dy, w, _ = make(p)
    ct = np.result_type(np.float32, *(a.dtype for a in (x, w) if a is not None))
    y, rstd = fast.rms_norm_forward(xp, x, norm, w, p["eps"])
    ry, rrstd = generic_kernel("rms_norm_forward")(xp, x, norm, w, p["eps"])
    assert_close(rstd, rrstd, ct, np.abs(rrstd.astype(np.float64)) * 4, "rstd")
    xhat_bound = 2 * np.abs(x.astype(np.float64)) * at_elements("rms_norm", x, np.abs(rrstd))
    assert_close(y, ry, ct, xhat_bound * parameter_at("rms_norm", x, w), "output")

    dx, dw = fast.rms_norm_backward(xp, dy, x, norm, rrstd, w)
    rdx, rdw = generic_kernel("rms_norm_backward")(xp, dy, x, norm, rrstd, w)
    dx_terms, dw_terms, _ = gradient_terms("rms_norm", x, dy, w, None, rrstd, batch=True)
    assert_close(dx, rdx, ct, 4 * dx_terms, "dx")
    assert_close(dw, rdw, ct, dw_terms, "dweight")


# --- fast == generic ---------------------------------------------------------------------


# float16 whose dx lands in the subnormal range, where the kernels' values a rounding apart
# round a step (2**-24) apart: a purely relative tolerance failed it
SUBNORMAL_DX = {"batch": [], "norm": [3], "dtype": "float16", "param_dtype": None}
SUBNORMAL_DX |= {"layout": "C", "dy_layout": "C", "eps": None, "offset": 3.0, "b": None}
SUBNORMAL_DX |= {
    "x": np.array([2.984375, -6.484375, 2.88671875]),
    "dy": np.array([3.13520432e-05, 3.51667404e-05, 1.46031380e-04]).astype(np.float16).astype(np.float64),
    "w": np.array([1.1484375, 0.89013672, 0.828125]).astype(np.float16).astype(np.float64),
}


@settings(max_examples=80, suppress_health_check=FIXTURES_OK)
@given(p=problems)
@example(p=SUBNORMAL_DX)
def test_layer_norm_matches_generic_many_blocks_and_threads(small_blocks, p):
    _threads.set_num_threads(2)
    check_layer_norm(p, eps=p["eps"] or 1e-5)


@settings(max_examples=80, suppress_health_check=FIXTURES_OK)
@given(p=problems)
def test_rms_norm_matches_generic_many_blocks_and_threads(small_blocks, p):
    _threads.set_num_threads(2)
    check_rms_norm(p)


@settings(suppress_health_check=FIXTURES_OK)
@given(p=problems)
def test_layer_norm_matches_generic_default_blocks_one_thread(p):
    _threads.set_num_threads(1)
    check_layer_norm(p)


@settings(suppress_health_check=FIXTURES_OK)
@given(p=problems)
def test_rms_norm_matches_generic_default_blocks_one_thread(p):
    _threads.set_num_threads(1)
    check_rms_norm(p)


@settings(max_examples=60, suppress_health_check=FIXTURES_OK)
@given(p=problems, threads=st.sampled_from([1, 2]))
def test_parameters_broadcast_or_tiled_bitwise_alike(small_blocks, p, threads):
    """Blocks of at most ``BROADCAST_ROWS`` rows take the weight and bias as one row to
    broadcast, larger ones tiled (``_blocks.tiled``): the same products and sums, so
    every result of all four ops is bitwise the same either way."""
    _threads.set_num_threads(threads)
    norm, x, dy, w, b = make(p)
    results = []
    for rows in (0, 10**9):  # always tiled, always broadcast
        before = _blocks.BROADCAST_ROWS
        _blocks.BROADCAST_ROWS = rows
        try:
            f = fast.layer_norm_forward(xp, x, norm, w, b, 1e-5)
            g = fast.layer_norm_backward(xp, dy, x, norm, f[1], f[2], w, b)
            h = fast.rms_norm_forward(xp, x, norm, w, 1e-5)
            k = fast.rms_norm_backward(xp, dy, x, norm, h[1], w)
        finally:
            _blocks.BROADCAST_ROWS = before
        results.append([a for a in (*f, *g, *h, *k) if a is not None])
    for tiled, broadcast in zip(*results, strict=True):
        np.testing.assert_array_equal(broadcast, tiled)
        assert broadcast.dtype == tiled.dtype


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 7, 1000])
@pytest.mark.parametrize("layout", ["C", "F"])
def test_sizes_around_the_default_block(dtype, rows, layout):
    """One row, fewer rows than a block, and ~6 blocks of 768-wide rows."""
    rng = np.random.default_rng(rows)
    base = {"batch": [rows], "norm": [768], "dtype": dtype, "param_dtype": None, "layout": layout}
    base |= {"dy_layout": "C", "eps": None, "offset": 3.0}
    base |= {"x": rng.normal(size=(rows, 768)) * 2, "dy": rng.normal(size=(rows, 768))}
    for w, b in [(rng.uniform(0.5, 1.5, 768), rng.normal(size=768)), (None, None)]:
        p = {**base, "w": w, "b": b}
        check_layer_norm(p)
        check_rms_norm(p)


@pytest.mark.parametrize("norm", [[3], [7], [2, 4]])
def test_rows_far_from_zero_are_centred_again(norm):
    """Rows 1e5 from 0 with a spread of 4, in float32, where the saved mean's rounding
    moves xhat by up to ~1e-3: dx within the |xhat|-bounded tolerance of the reference
    (which centres xhat again) only if the fast backward centres again too. Every row has
    the same spread. (The drawn cases reach an offset of 1e4, but rarely on rows that
    tell; the kernels that did not centre failed this on rows of 3 to 10 values, and on
    longer rows passed it, when dx's tolerance grew with sqrt(D).)"""
    rng = np.random.default_rng(len(norm) * 100 + norm[0])
    z = rng.normal(size=(64, math.prod(norm)))
    z = (z - z.mean(axis=1, keepdims=True)) / z.std(axis=1, keepdims=True)  # 64,D: mean 0, std 1
    base = {"batch": [64], "norm": norm, "dtype": "float32", "param_dtype": None, "layout": "C"}
    base |= {"dy_layout": "C", "eps": None, "offset": 1e5, "b": None}
    base |= {"x": np.reshape(z * 4, (64, *norm)), "dy": rng.normal(size=(64, *norm))}
    for w in (rng.uniform(0.5, 1.5, norm), None):
        check_layer_norm({**base, "w": w})


def test_public_functions_use_the_fast_kernels_for_numpy(rng):
    for op in OPS:
        assert kernel(op, xp) is getattr(fast, op)
    x = rng.normal(size=(4, 6))
    with use_kernels("reference"):
        for op in OPS:
            assert kernel(op, xp) is generic_kernel(op)
        slow = F.layer_norm(x, 6)
    np.testing.assert_allclose(F.layer_norm(x, 6), slow, rtol=1e-12, atol=1e-12)


def test_empty_batch(rng):
    x = np.zeros((0, 3, 4), dtype=np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    y, mean, rstd = fast.layer_norm_forward(xp, x, (4,), w, b, 1e-5)
    assert y.shape == x.shape and mean.shape == rstd.shape == (0, 3)
    dx, dw, db = fast.layer_norm_backward(xp, x, x, (4,), mean, rstd, w, b)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dw, np.zeros(4))
    np.testing.assert_array_equal(db, np.zeros(4))
    dx, dw = fast.rms_norm_backward(xp, x, x, (4,), rstd, w)
    np.testing.assert_array_equal(dw, np.zeros(4))


def test_wrong_number_of_saved_statistics_is_an_error(rng):
    x = rng.normal(size=(3, 4))
    with pytest.raises(ValueError, match="one value per row"):
        fast.layer_norm_backward(xp, x, x, (4,), np.zeros(2), np.ones(3), None, None)


def test_no_floating_point_warnings_from_worker_threads(small_blocks):
    """Constant rows with eps=0 divide by zero: inf rstd and NaN output, as in PyTorch, and
    no warning from any thread (pytest turns any warning from any thread into an error),
    whatever the caller's NumPy error settings."""
    _threads.set_num_threads(2)
    x = np.ones((64, 8))
    with np.errstate(all="raise"):
        y, _, rstd = fast.layer_norm_forward(xp, x, (8,), None, None, 0.0)
    assert np.isinf(rstd).all() and np.isnan(y).all()


def test_memory_is_outputs_plus_block_scratch(rng, monkeypatch):
    # blocks of 32 KiB, so that the scratch allowance is well under one input-sized array
    monkeypatch.setattr(_blocks, "BLOCK_BYTES", 32 * 1024)
    _threads.set_num_threads(2)
    x = rng.normal(size=(2048, 512)).astype(np.float32)  # 4 MiB
    dy = rng.normal(size=x.shape).astype(np.float32)
    w, b = np.ones(512, np.float32), np.zeros(512, np.float32)
    _, mean, rstd = fast.layer_norm_forward(xp, x, (512,), w, b, 1e-5)
    # per thread at most ~7 block-sized buffers (scratch, tiled w and b)
    allowance = 2 * 7 * _blocks.BLOCK_BYTES + 256 * 1024
    assert allowance < x.nbytes / 4
    for call in (
        lambda: fast.layer_norm_forward(xp, x, (512,), w, b, 1e-5),
        lambda: fast.layer_norm_backward(xp, dy, x, (512,), mean, rstd, w, b),
        lambda: fast.rms_norm_forward(xp, x, (512,), w, None),
        lambda: fast.rms_norm_backward(xp, dy, x, (512,), rstd, w),
    ):
        tracemalloc.start()
        try:
            call()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= x.nbytes + allowance, (peak, x.nbytes)


# --- determinism and threads ---------------------------------------------------------------


def _all_results(x, dy, w, b):
    D = x.shape[-1]
    y, mean, rstd = fast.layer_norm_forward(xp, x, (D,), w, b, 1e-5)
    ln = fast.layer_norm_backward(xp, dy, x, (D,), mean, rstd, w, b)
    ry, rr = fast.rms_norm_forward(xp, x, (D,), w, None)
    rms = fast.rms_norm_backward(xp, dy, x, (D,), rr, w)
    return [y, mean, rstd, *ln, ry, rr, *rms]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bitwise_reproducible_for_a_thread_count_close_across_counts(small_blocks, rng, dtype):
    x = (rng.normal(size=(301, 37)) + 5).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    w, b = rng.uniform(0.5, 1.5, 37).astype(dtype), rng.normal(size=37).astype(dtype)
    _threads.set_num_threads(2)
    first, second = _all_results(x, dy, w, b), _all_results(x, dy, w, b)
    for a, c in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, c)
    _threads.set_num_threads(1)
    single = _all_results(x, dy, w, b)
    rtol = 1e-12 if dtype == "float64" else 1e-5
    for a, c in zip(first, single, strict=True):
        np.testing.assert_allclose(a, c, rtol=rtol, atol=rtol * max(1.0, float(np.abs(c).max())))


def test_more_threads_than_cpus(small_blocks, rng):
    threads = (
        len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1
    )
    x, dy = rng.normal(size=(8 * threads, 9)), rng.normal(size=(8 * threads, 9))  # blocks of 7 rows
    _threads.set_num_threads(1)
    ref = _all_results(x, dy, None, None)
    _threads.set_num_threads(threads)
    for a, c in zip(_all_results(x, dy, None, None), ref, strict=True):
        if c is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)


def test_small_inputs_run_inline():
    _threads.set_num_threads(2)
    assert _blocks.chunks(10, 4) == [(0, 10)]
    many = _blocks.chunks(10_000, 100)
    assert len(many) == 2 and many[0][0] == 0 and many[-1][1] == 10_000
    assert all(start % 100 == 0 for start, _ in many)


@pytest.mark.parametrize("bad", [0, -1, -8])
def test_set_num_threads_rejects_counts_below_one(bad):
    with pytest.raises(ValueError, match="at least 1"):
        _threads.set_num_threads(bad)


@pytest.mark.parametrize("bad", [1.5, "2", True, None])
def test_set_num_threads_rejects_non_integers(bad):
    with pytest.raises(TypeError):
        _threads.set_num_threads(bad)


def test_set_and_get_num_threads():
    _threads.set_num_threads(3)
    assert _threads.get_num_threads() == 3
    _threads.set_num_threads(np.int64(1))
    assert _threads.get_num_threads() == 1


def test_default_from_environment(monkeypatch):
    monkeypatch.setattr(_threads, "_num_threads", None)
    monkeypatch.setenv(_threads.ENV_VAR, "3")
    assert _threads.get_num_threads() == 3
    monkeypatch.setattr(_threads, "_num_threads", None)
    monkeypatch.delenv(_threads.ENV_VAR)
    assert _threads.get_num_threads() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_environment_value_is_an_error(monkeypatch, bad):
    monkeypatch.setattr(_threads, "_num_threads", None)
    monkeypatch.setenv(_threads.ENV_VAR, bad)
    with pytest.raises(ValueError, match=_threads.ENV_VAR):
        _threads.get_num_threads()


@given(
    dtype=st.sampled_from(FLOATS),
    target=st.sampled_from(["float32", "float64"]),
    n=st.integers(2, 80),
    L=st.integers(2, 150),
    aliased=st.booleans(),
    data=st.data(),
)
def test_aliased_column_major_blocks_are_copied_in_tiles(dtype, target, n, L, aliased, data):
    """A block of 16 rows or more of a Fortran-ordered input whose columns lie a multiple
    of 4 KiB apart (NumPy's copy of it in one call ran at 4-7 ns a value) is copied into
    C-ordered scratch a few columns at a time, other blocks in one call; NumPy's values either way
    (cast too), bit for bit."""
    from unittest import mock

    dt = np.dtype(dtype)
    rows = _blocks.ALIASING_BYTES // dt.itemsize if aliased else n + 1
    bits = data.draw(hnp.arrays(np.dtype(f"u{dt.itemsize}"), (n, L)))
    full = np.zeros((rows, L), bits.dtype, order="F")
    full[:n] = bits
    block = full.view(dt)[:n]
    dst = np.empty((n, L), target)
    # raw bits: float64 values beyond float32's range become inf in both casts, and a
    # signaling NaN's cast raises the invalid flag: NumPy warns of both (tests/test_huge_inputs.py
    # checks that no warning leaves the kernels, which wrap these copies)
    quiet = np.errstate(over="ignore", invalid="ignore")
    with mock.patch.object(_blocks.np, "copyto", wraps=np.copyto) as spy, quiet:
        _blocks.cast_into(dst, block)
    T = min(64, max(16, 1024 // n))
    assert spy.call_count == (-(-L // T) if aliased and n >= _blocks.TILE_ROWS else 1)
    expected = np.empty_like(dst)
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(expected, np.ascontiguousarray(block), casting="unsafe")
    np.testing.assert_array_equal(dst.view(f"u{dst.itemsize}"), expected.view(f"u{dst.itemsize}"))


def test_fortran_ordered_power_of_two_rows_as_c_ordered(small_blocks):
    """LayerNorm and RMSNorm on a Fortran-ordered input and gradient of 1024 rows (staged
    in tiles of columns): bitwise the C-ordered call's results."""
    rng = np.random.default_rng(13)
    x = (rng.normal(size=(1024, 40)) * 3 + 7).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w, b = rng.uniform(0.5, 1.5, 40).astype(np.float32), rng.normal(size=40).astype(np.float32)

    def results(x, dy):
        y, mean, rstd = F.layer_norm_forward(x, 40, w, b)
        z, r = F.rms_norm_forward(x, 40, w)
        return [y, mean, rstd, *F.layer_norm_backward(dy, x, 40, mean, rstd, w, b), z, r,
                *F.rms_norm_backward(dy, x, 40, r, w)]  # fmt: skip

    for a, e in zip(results(np.asfortranarray(x), np.asfortranarray(dy)), results(x, dy), strict=True):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("family", [f for f in npnorm.kernels_available() if f != "reference"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_whose_rstd_is_infinite_give_the_references_nans(family, op):
    """eps = 0 and a spread that underflows (values of 1e-310): rstd is inf. The fast row
    backwards, which take rstd^2, gave +-inf where the reference (and torch) give NaN."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 3, 3)) * 1e-310, rng.standard_normal((3, 3, 3))
    fwd, bwd = getattr(F, f"{op}_forward"), getattr(F, f"{op}_backward")

    def dx() -> np.ndarray:
        saved = fwd(x, 3, eps=0.0)[1:]
        return bwd(dy, x, 3, *saved)[0]

    with npnorm.use_kernels("reference"):
        ref = dx()
    assert np.isinf(ref).any() or np.isnan(ref).any()
    with npnorm.use_kernels(family):
        np.testing.assert_array_equal(dx(), ref)
