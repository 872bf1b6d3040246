"""The fast families' shared plumbing (``kernels._blocks``, ``_staging``,
``_memory_order``), each case against the reference kernels or a fresh call.

Every case here is a branch that a one-spot mutation changed without any other test
failing (mutation testing of the shared kernel plumbing): rows staged sample by sample
from a block that starts inside a sample, the rows' means recentred where a row holds an
infinity or is constant to a few ulps only, parameters given as strided views, and a
C-ordered array of one channel whose channel axis has a stride of one value.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_kernel_edge_paths import FAST, assert_matches, reference, run

import npnorm.functional as F
from npnorm import _threads
from npnorm.kernels import _blocks


@pytest.mark.parametrize("family", FAST)
def test_rows_staged_by_sample_from_a_block_that_starts_inside_a_sample(family, monkeypatch, restore_threads):
    """An input whose samples are views of rows but the whole is not (a slice of the
    second axis), staged sample by sample in blocks of 3 rows of samples of 2 rows: the
    second block starts at a sample's second row, which is copied alone before the whole
    samples that follow (taking whole samples from there copied the wrong rows)."""
    D = 8
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 3, D)).astype(np.float32)[:, :2]  # N=6, P=2: no (12, D) view
    dy = rng.normal(size=x.shape).astype(np.float32)
    w = np.linspace(0.5, 1.5, D, dtype=np.float32)
    b = np.linspace(-1, 1, D, dtype=np.float32)
    monkeypatch.setattr(_blocks, "SMALL_COPY_BYTES", 0)  # staged by sample, not copied whole
    monkeypatch.setattr(_blocks, "BLOCK_BYTES", 3 * D * 4)  # "numpy": blocks of 3 rows
    if family == "numba":
        from npnorm.kernels import _staging  # (imports numba, which the "numpy" family runs without)

        monkeypatch.setattr(_staging, "STAGE_BYTES", 3 * D * 4)  # "numba": blocks of 3 rows
    _threads.set_num_threads(1)
    for fn, args in (
        (F.layer_norm_forward, (x, (D,), w, b)),
        (F.rms_norm_forward, (x, (D,), w)),
    ):
        want = reference(fn, *args)
        assert_matches(run(family, fn, *args), want, 1e-5, fn.__name__, atol=1e-6)
    _, mean, rstd = reference(F.layer_norm_forward, x, (D,), w, b)
    want = reference(F.layer_norm_backward, dy, x, (D,), mean, rstd, w, b)
    got = run(family, F.layer_norm_backward, dy, x, (D,), mean, rstd, w, b)
    assert_matches(got, want, 1e-4, "layer_norm_backward", atol=1e-5)


@pytest.mark.parametrize("family", FAST)
def test_a_row_holding_an_infinity_beside_a_recentred_row_keeps_an_infinite_mean(family):
    """A block with a row at a large common offset (recentred on its true mean) and a
    row holding an infinity: that row's mean stays inf, as the reference's (adding the
    row's NaN correction made it NaN)."""
    D = 16
    x = np.empty((2, D), np.float32)
    x[0] = 1000 + np.linspace(0, 1e-2, D)  # mean far beyond RECENTRE_ABOVE deviations
    x[1] = np.arange(D)
    x[1, 3] = np.inf
    got = run(family, F.layer_norm_forward, x, (D,))
    want = reference(F.layer_norm_forward, x, (D,))
    np.testing.assert_array_equal(got[1], want[1])  # mean: [~1000, inf]
    assert np.isposinf(got[1][1])
    assert_matches(got[:1], want[:1], 1e-3, "y", atol=1e-3)


@pytest.mark.parametrize("family", FAST)
def test_a_row_within_a_few_ulps_of_constant_is_centred_on_its_mean(family):
    """Rows at an offset of 1000 whose values differ by a few ulps (near-constant, not
    constant): they are centred on their true means, not on their first values, which
    only a constant row's mean is."""
    D = 8
    ulp = float(np.spacing(np.float32(1000)))
    steps = np.array([0, 1, 2, 3, 4, 5, 6, 7], np.float64) * ulp
    x = np.stack([1000 + steps, 1000 + steps[::-1], np.full(D, 1000.0)]).astype(np.float32)
    got = run(family, F.layer_norm_forward, x, (D,), eps=0.0)
    want = reference(F.layer_norm_forward, x, (D,), eps=0.0)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=ulp / 4)  # means
    np.testing.assert_allclose(got[0][:2], want[0][:2], rtol=1e-3, atol=1e-3)  # xhat: +-1.53
    assert np.isnan(got[0][2]).all() and np.isnan(want[0][2]).all()  # constant, eps 0


@pytest.mark.parametrize("family", FAST)
def test_strided_parameters_give_what_their_contiguous_copies_give(family):
    """A weight (and bias) that is a strided view gives bitwise the results of its
    C-ordered copy, forward and backward: the kernels take their parameters contiguous
    (``_blocks.param``; a strided weight's dot products rounded differently)."""
    rng = np.random.default_rng(7)
    D = 48
    x = rng.normal(size=(16, D)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w = rng.normal(size=2 * D).astype(np.float32)[::2]
    b = rng.normal(size=2 * D).astype(np.float32)[1::2]
    wc, bc = np.ascontiguousarray(w), np.ascontiguousarray(b)
    for strided, contiguous in (((w, b), (wc, bc)), ((w, None), (wc, None))):
        y, mean, rstd = run(family, F.layer_norm_forward, x, (D,), *contiguous)
        got = run(family, F.layer_norm_forward, x, (D,), *strided)
        for g, want in zip(got, (y, mean, rstd), strict=True):
            np.testing.assert_array_equal(g, want)
        want = run(family, F.layer_norm_backward, dy, x, (D,), mean, rstd, *contiguous)
        got = run(family, F.layer_norm_backward, dy, x, (D,), mean, rstd, *strided)
        for g, v in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, v)
    y, rstd = run(family, F.rms_norm_forward, x, (D,), wc)
    np.testing.assert_array_equal(run(family, F.rms_norm_forward, x, (D,), w)[0], y)
    want = run(family, F.rms_norm_backward, dy, x, (D,), rstd, wc)
    got = run(family, F.rms_norm_backward, dy, x, (D,), rstd, w)
    for g, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, v)


@pytest.mark.parametrize("family", FAST)
def test_one_channel_gives_the_same_bits_whatever_the_stride_of_its_axis(family):
    """A C-ordered (N, 1, H, W) array whose channel axis has a stride of one value (NumPy's
    ``moveaxis`` of an (N, H, W, 1) array) is no channels-last layout of rows: its
    results are bitwise those of its copy, whose channel axis has the usual stride."""
    rng = np.random.default_rng(2)
    x = np.moveaxis(rng.normal(size=(3, 2, 7, 1)).astype(np.float32) + 3, -1, 1)
    assert x.flags.c_contiguous and x.strides[1] == x.itemsize
    xc = x.copy()
    assert xc.strides[1] != x.itemsize
    w, b = np.array([1.5], np.float32), np.array([0.25], np.float32)
    args = (None, None, w, b, True, 0.1, 1e-5)
    want = run(family, F.batch_norm_forward, xc, *args)
    got = run(family, F.batch_norm_forward, x, *args)
    for g, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, v)


# --- the small helpers every "numpy" kernel call goes through -------------------------------
# Each answers the common call without NumPy's general function; each is checked here against
# that function on drawn arrays (the kernels' results stayed bitwise the same with them).

_FLOATS = st.sampled_from([np.float16, np.float32, np.float64])


@given(
    a=hnp.arrays(
        _FLOATS, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5), elements=st.floats(-9, 9, width=16)
    ),
    order=st.sampled_from(["C", "F", "reversed", "strided", "subclass"]),
    to=_FLOATS,
    readonly=st.booleans(),
)
@example(a=np.arange(6.0).reshape(2, 3), order="F", to=np.float64, readonly=False)  # (order matters)
@example(a=np.arange(6.0).reshape(3, 2), order="subclass", to=np.float64, readonly=False)
def test_as_vector_is_ascontiguousarray_of_the_reshape(a, order, to, readonly):
    """``as_vector`` gives what ``np.ascontiguousarray(np.reshape(a, (n,)), dtype)`` gives (a
    plain ndarray, the values in C order), and ``a`` itself (or its view) where that is
    already a C-ordered (n,) ndarray of the dtype."""
    if order == "F":
        a = np.asfortranarray(a)
    elif order == "reversed":
        a = a[::-1]
    elif order == "strided":
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif order == "subclass":
        a = a.view(_Sub)
    a.flags.writeable = not readonly
    n, dtype = a.size, np.dtype(to)
    got = _blocks.as_vector(a, n, dtype)
    want = np.ascontiguousarray(np.reshape(a, (n,)), dtype=dtype)
    assert type(got) is type(want) is np.ndarray
    assert got.shape == (n,) and got.dtype == dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)
    if type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous and a.size:
        assert np.shares_memory(got, a)


class _Sub(np.ndarray):
    """An ndarray subclass (as np.memmap is one): ``as_vector`` hands the kernels a plain array."""


@given(
    v=hnp.arrays(
        _FLOATS, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4), elements=st.floats(-9, 9, width=16)
    ),
    n=st.integers(0, 6),
)
def test_stacked_is_tile(v, n):
    """``stacked(v, n)`` is ``np.tile`` of ``v`` along a new first axis: the parameters'
    rows (``tiled``), the channel rings, GroupNorm's per-channel-row weights."""
    got = _blocks.stacked(v, n)
    want = np.tile(v, (n,) + (1,) * v.ndim).reshape(n, *v.shape)
    assert got.dtype == v.dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)


def test_filled_keeps_small_constants_and_makes_large_ones_each_call():
    """``filled`` gives the same array again for a small constant (kept; never written by
    a kernel) and a new one above ``CONSTANT_CACHE_BYTES``; either holds the value."""
    small = _blocks.filled(8, np.dtype(np.float32), 1.0 / 8)
    assert _blocks.filled(8, np.dtype(np.float32), 1.0 / 8) is small
    np.testing.assert_array_equal(small, np.full(8, 1.0 / 8, np.float32))
    assert _blocks.filled(8, np.dtype(np.float64), 1.0 / 8) is not small  # (another dtype)
    n = _blocks.CONSTANT_CACHE_BYTES // 4 + 1
    large = _blocks.filled(n, np.dtype(np.float32), 1.0)
    assert _blocks.filled(n, np.dtype(np.float32), 1.0) is not large
    assert large.shape == (n,) and (large == 1).all()


@pytest.mark.parametrize("layout", ["C", "F", "sliced"])
def test_view_of_a_c_ordered_array_is_numpys_view(layout):
    """``view`` answers a C-ordered array with its ``reshape`` method: the same view
    NumPy's ``np.reshape(copy=False)`` gives (memory, strides); other arrays as before."""
    a = np.arange(24.0).reshape(2, 3, 4)
    a = {"C": a, "F": np.asfortranarray(a), "sliced": a[:, :, ::2]}[layout]
    for shape in ((a.size // a.shape[-1], a.shape[-1]), (a.size,), (-1, a.shape[-1])):
        try:
            want = np.reshape(a, shape, copy=False)
        except ValueError:
            assert _blocks.view(a, shape) is None
            continue
        got = _blocks.view(a, shape)
        assert got is not None and got.shape == want.shape and got.strides == want.strides
        assert np.shares_memory(got, a)


def test_one_range_runs_in_the_calling_thread_without_the_pool(monkeypatch, restore_threads):
    """A call of one range (every small call) runs its work at once in the calling thread:
    the pool is not asked."""
    import threading

    _threads.set_num_threads(2)

    def no_pool(tasks):
        raise AssertionError("the pool was asked for one range")

    monkeypatch.setattr(_blocks, "run_parallel", no_pool)
    seen = []
    assert _blocks.run_chunks(lambda a, e: seen.append(threading.get_ident()) or (a, e), 10, 4, 8) == [
        (0, 10)
    ]
    assert seen == [threading.get_ident()]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunks_are_the_general_split_of_the_blocks(threads, restore_threads):
    """``chunks`` answers few blocks with one range at once, as the general split does (at
    most one range for fewer than 2 * MIN_BLOCKS_PER_THREAD blocks): the same ranges,
    and so the same sums, for every row count and thread count."""
    _threads.set_num_threads(threads)
    M = _blocks.MIN_BLOCKS_PER_THREAD
    for B in (1, 3, 7):
        for R in range(1, 4 * M * B + 2):
            n_blocks = -(-R // B)
            n = max(1, min(threads, n_blocks // M))
            edges = [min(R, (k * n_blocks // n) * B) for k in range(n + 1)]
            assert _blocks.chunks(R, B) == list(itertools.pairwise(edges)), (R, B)


def test_one_range_of_long_rows_runs_unbuffered(restore_threads):
    """One range of rows of ``UNBUFFERED_MIN_ROW`` values or more still runs in
    ``loop_mode`` (NumPy's minimal buffer), as every split does; shorter rows at NumPy's
    own buffer size."""
    _threads.set_num_threads(1)
    sizes = []
    for row in (_blocks.UNBUFFERED_MIN_ROW - 1, _blocks.UNBUFFERED_MIN_ROW):
        _blocks.run_ranges(lambda a, e: sizes.append(np.getbufsize()), [(0, 1)], row)
    assert sizes == [np.getbufsize(), 16]
