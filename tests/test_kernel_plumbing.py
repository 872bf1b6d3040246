"""The fast families' shared plumbing (``kernels._blocks``, ``_staging``,
``_memory_order``), each case against the reference kernels or a fresh call.

Every case here is a branch that a one-spot mutation changed without any other test
failing (mutation testing of the shared kernel plumbing): rows staged sample by sample
from a block that starts inside a sample, the rows' means recentred where a row holds an
infinity or is constant to a few ulps only, parameters given as strided views, and a
C-ordered array of one channel whose channel axis has a stride of one value.
"""

from __future__ import annotations

import numpy as np
import pytest
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
