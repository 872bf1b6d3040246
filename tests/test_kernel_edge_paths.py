"""Edge paths of the fast kernel families, each against the reference kernels.

Every case here is a branch of the "numpy" or "numba" family that a mutation removed
without any other test failing (mutation testing, third round), or that no test reached
(coverage): the remainder of a row
longer than one block, the float64 redo of sums that overflow or underflow float32, an
``out=`` that overlaps the input or the gradient, an ``out=`` that is a strided view,
inputs in unusual memory orders, channels-last GroupNorm's block remainders, infinities
and large offsets, the fallback of rows whose spread passes float32's range, and the
bound on the numba family's cache of constant rows. Each test runs the fast families
and compares them with the reference kernels on the same arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

import npnorm
import npnorm.functional as F
from npnorm.kernels import _blocks

FAST = [f for f in npnorm.kernels_available() if f != "reference"]


def reference(fn, *args, **kw):
    with npnorm.use_kernels("reference"):
        return fn(*args, **kw)


def run(family, fn, *args, **kw):
    with npnorm.use_kernels(family):
        return fn(*args, **kw)


def assert_matches(got, want, rtol, what, atol=0.0):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, (what, i)
            continue
        np.testing.assert_allclose(
            np.asarray(g, np.float64),
            np.asarray(w, np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=f"{what} [{i}]",
        )


@pytest.mark.parametrize("family", FAST)
@pytest.mark.parametrize("D", [4097, 8193])
def test_the_last_value_of_a_row_one_past_a_block_is_summed(family, D):
    """Rows of 4096*k + 1 values: the remainder of one value ends the row's sums (a
    remainder test off by one dropped it: mean 0 instead of 1)."""
    x = np.zeros((2, D), np.float32)
    x[:, -1] = D
    assert_matches(run(family, F.layer_norm_forward, x, D), reference(F.layer_norm_forward, x, D), 1e-5, "LN")
    assert_matches(run(family, F.rms_norm_forward, x, D), reference(F.rms_norm_forward, x, D), 1e-5, "RMS")


@pytest.mark.parametrize("family", FAST)
def test_a_backward_whose_float32_sums_overflow_redoes_them_in_float64(family):
    """dy of 1e38: sum(dy * xhat) (up to 8e38), or sum(dy), passes float32's range; redone
    in float64, dx is finite as the reference's, not inf; equal to rounding relative to
    the gradient's scale (max |dy| * rstd: some values of dx are a cancellation of terms
    of 1e38, which float32 resolves to about 1e31)."""
    x = np.tile(np.float32([1, -1]), (2, 4))
    # dy = 1e38 x (sum(dy * xhat) overflows), the same unevenly, and 1e38 |x| (sum(dy) does)
    for c in ([1, 1, 1, 1, 1, 1, 1, 1], [1, 0.9, 1, 0.8, 1, 0.7, 1, 0.6], [1, -1, 1, -1, 1, -1, 1, -1]):
        dy = (x * np.float32(c) * np.float32(1e38)).astype(np.float32)
        _, mean, rstd = reference(F.layer_norm_forward, x, 8)
        want = reference(F.layer_norm_backward, dy, x, 8, mean, rstd)
        got = run(family, F.layer_norm_backward, dy, x, 8, mean, rstd)
        assert np.isfinite(got[0]).all()
        assert_matches(got[:1], want[:1], 1e-5, "LN dx", atol=1e32)
        (_, rrstd) = reference(F.rms_norm_forward, x, 8)
        want = reference(F.rms_norm_backward, dy, x, 8, rrstd)
        got = run(family, F.rms_norm_backward, dy, x, 8, rrstd)
        assert np.isfinite(got[0]).all()
        assert_matches(got[:1], want[:1], 1e-5, "RMS dx", atol=1e32)


@pytest.mark.parametrize("family", FAST)
def test_a_variance_below_float32s_range_is_redone_in_float64(family):
    """Values of 1e-25 with eps=0: the squares (1e-50) underflow float32; redone in float64,
    rstd is 1e25 as the reference's, not inf."""
    x = np.tile(np.float32([1e-25, -1e-25]), (2, 4))
    got, want = (
        run(family, F.layer_norm_forward, x, 8, eps=0.0),
        reference(F.layer_norm_forward, x, 8, eps=0.0),
    )
    assert np.isfinite(got[2]).all()
    assert_matches(got, want, 1e-5, "LN")
    got, want = run(family, F.rms_norm_forward, x, 8, eps=0.0), reference(F.rms_norm_forward, x, 8, eps=0.0)
    assert np.isfinite(got[1]).all()
    assert_matches(got, want, 1e-5, "RMS")


@pytest.mark.parametrize("family", FAST)
def test_rows_far_from_zero_and_spread_past_float32_fall_back(family):
    """Values of 1e35 with gradients of 1e4: the fast loops' float32 products overflow;
    the fallback gives the reference's finite dx."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 16)) * 1e35).astype(np.float32)
    dy = (rng.standard_normal((4, 16)) * 1e4).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    _, mean, rstd = reference(F.layer_norm_forward, x, 16, w)
    got = run(family, F.layer_norm_backward, dy, x, 16, mean, rstd, w)
    assert np.isfinite(got[0]).all()
    assert_matches(got[:1], reference(F.layer_norm_backward, dy, x, 16, mean, rstd, w)[:1], 1e-4, "LN dx")
    (_, rrstd) = reference(F.rms_norm_forward, x, 16, w)
    got = run(family, F.rms_norm_backward, dy, x, 16, rrstd, w)
    assert np.isfinite(got[0]).all()
    assert_matches(got[:1], reference(F.rms_norm_backward, dy, x, 16, rrstd, w)[:1], 1e-4, "RMS dx")


@pytest.mark.parametrize("family", FAST)
def test_a_strided_out_of_float16_gets_the_output(family):
    """BatchNorm training forward of float16 channels into a strided ``out`` (every row
    half of a wider array): written in place, equal to a fresh output (the staged path
    wrote into a copy and left ``out`` as zeros)."""
    x = np.random.default_rng(2).standard_normal((4, 3, 1024)).astype(np.float16)
    out = np.zeros((4, 3, 2048), np.float16)[..., :1024]
    fresh = run(family, F.batch_norm_forward, x, None, None, training=True)[0]
    y = run(family, F.batch_norm_forward, x, None, None, training=True, out=out)[0]
    assert y is out
    np.testing.assert_array_equal(out, fresh)


@pytest.mark.parametrize("family", FAST)
def test_statistics_of_three_batch_axes_in_a_permuted_memory_order(family):
    """An input whose three batch axes lie in memory in an order that is not its own
    inverse: mean and rstd are saved in the batch's logical order, so the backward pairs
    each row with its own statistics."""
    rng = np.random.default_rng(3)
    x = np.transpose(rng.standard_normal((4, 2, 3, 8)).astype(np.float32), (1, 2, 0, 3))
    dy = np.transpose(rng.standard_normal((4, 2, 3, 8)).astype(np.float32), (1, 2, 0, 3))
    fwd = run(family, F.layer_norm_forward, x, 8)
    assert_matches(fwd, reference(F.layer_norm_forward, x, 8), 1e-5, "forward", atol=1e-6)
    got = run(family, F.layer_norm_backward, dy, x, 8, fwd[1], fwd[2])
    want = reference(F.layer_norm_backward, dy, x, 8, fwd[1], fwd[2])
    assert_matches(got, want, 1e-4, "backward", atol=1e-5)


def _overlapping(shape, dtype=np.float32, seed=4):
    """A base array and two views of it one row apart: ``a = base[:-1]``, ``b = base[1:]``."""
    base = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return base, base[:-1], base[1:]


@pytest.mark.parametrize("family", FAST)
def test_a_backward_out_overlapping_the_gradient_is_right(family):
    """``out=`` one row past ``grad_output`` in the same memory: dx as computed from copies
    (the kernels stage the rows they would overwrite before reading them)."""
    rng = np.random.default_rng(6)
    for op in ("layer_norm", "rms_norm"):
        _, dy, out = _overlapping((301, 1024))
        x = rng.standard_normal((300, 1024)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, 1024).astype(np.float32)
        if op == "layer_norm":
            _, mean, rstd = reference(F.layer_norm_forward, x, 1024, w)
            want = reference(F.layer_norm_backward, dy.copy(), x, 1024, mean, rstd, w)
            got = run(family, F.layer_norm_backward, dy, x, 1024, mean, rstd, w, out=out)
        else:
            _, rstd = reference(F.rms_norm_forward, x, 1024, w)
            want = reference(F.rms_norm_backward, dy.copy(), x, 1024, rstd, w)
            got = run(family, F.rms_norm_backward, dy, x, 1024, rstd, w, out=out)
        assert got[0] is out
        assert_matches(got[:1], want[:1], 1e-4, op, atol=1e-5)


@pytest.mark.parametrize("family", FAST)
def test_a_forward_out_overlapping_the_input_is_right(family):
    """``out=`` one row (or sample) past the input in the same memory: BatchNorm training
    of (N, C) rows, and GroupNorm of channels-last samples, equal results computed from a
    copy of the input."""
    _, x, out = _overlapping((5001, 64))
    want = reference(F.batch_norm_forward, x.copy(), None, None, training=True)
    got = run(family, F.batch_norm_forward, x, None, None, training=True, out=out)
    assert got[0] is out
    assert_matches(got[:3], want[:3], 1e-4, "BatchNorm", atol=1e-5)

    base = np.random.default_rng(7).standard_normal((5, 8, 8, 32)).astype(np.float32)
    x, out = np.moveaxis(base[:-1], -1, 1), np.moveaxis(base[1:], -1, 1)  # channels last
    want = reference(F.group_norm_forward, x.copy(), 4)
    got = run(family, F.group_norm_forward, x, 4, out=out)
    assert got[0] is out
    assert_matches(got, want, 1e-4, "GroupNorm", atol=1e-5)


@pytest.mark.parametrize("family", FAST)
def test_channels_last_group_norm_with_one_position_past_a_block(family):
    """Channels-last samples of 1025 positions of 64 channels (blocks of 16 positions: one
    left over): the last position is normalized as the others."""
    x = np.moveaxis(np.random.default_rng(8).standard_normal((2, 1025, 64)).astype(np.float32), -1, 1)
    assert_matches(
        run(family, F.group_norm_forward, x, 8), reference(F.group_norm_forward, x, 8), 1e-5, "GN", atol=1e-5
    )


@pytest.mark.parametrize("family", FAST)
def test_channels_last_group_norm_with_an_infinity_saves_an_infinite_mean(family):
    """An inf in group 0: that group's saved mean is inf, as the reference's (not NaN); the
    other groups are untouched."""
    x = np.moveaxis(np.random.default_rng(9).standard_normal((1, 1024, 64)).astype(np.float32), -1, 1)
    x[0, 0, 5] = np.inf
    got, want = run(family, F.group_norm_forward, x, 8), reference(F.group_norm_forward, x, 8)
    assert np.isposinf(got[1][0, 0]) and np.isposinf(want[1][0, 0])
    np.testing.assert_allclose(got[1][0, 1:], want[1][0, 1:], rtol=1e-5, atol=1e-6)  # means near 0


@pytest.mark.parametrize("family", FAST)
def test_channels_last_group_norm_backward_at_a_large_offset(family):
    """Values 1000 + 0.01 * N(0, 1), channels last: dweight and dx as accurate as the
    reference's (their correction for the rounded mean left dweight 3e-3 off)."""
    rng = np.random.default_rng(10)
    x = np.moveaxis((1000 + 1e-2 * rng.standard_normal((2, 1024, 64))).astype(np.float32), -1, 1)
    dy = np.moveaxis(rng.standard_normal((2, 1024, 64)).astype(np.float32), -1, 1)
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    b = rng.normal(size=64).astype(np.float32)
    _, mean, rstd = reference(F.group_norm_forward, x, 8, w, b)
    got = run(family, F.group_norm_backward, dy, x, 8, mean, rstd, w, b)
    want = reference(F.group_norm_backward, dy, x, 8, mean, rstd, w, b)
    dx_scale = float(np.abs(want[0]).max())
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5 * dx_scale)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5 * float(np.abs(want[1]).max()))


@pytest.mark.parametrize("family", FAST)
def test_the_kept_constants_stay_few(family):
    """The fast families keep constant rows (ones for a row sum, 1/L for a mean, ones for
    rows without a weight) per length and dtype in a small cache (``_blocks.filled``),
    cleared past 64 entries: 300 lengths do not keep 300 rows."""
    with npnorm.use_kernels(family):
        for d in range(1, 301):
            F.layer_norm_forward(np.ones((2, d), np.float32), d)
    assert len(_blocks._CONSTANTS) <= 65


@pytest.mark.parametrize("family", FAST)
def test_no_large_constant_is_kept_after_a_call(family):
    """An absent weight or bias was cached as a filled array of the row's length for the
    life of the process: 256 MB per row length after a LayerNorm of 2**26 values."""
    x = np.ones((1, 1 << 16), dtype=np.float32)
    _blocks._CONSTANTS.clear()
    with npnorm.use_kernels(family):
        F.layer_norm(x, x.shape[1:])
        F.layer_norm(x[:, :8], (8,))
    sizes = [c.nbytes for c in _blocks._CONSTANTS.values()]
    assert sizes and max(sizes) <= _blocks.CONSTANT_CACHE_BYTES, sizes


@pytest.mark.parametrize("family", FAST)
def test_channels_last_group_norm_whose_squares_pass_float32(family):
    """Values of spread 1e20 in float32, channels last: the groups' sums of squares pass
    float32's range and are redone in float64, so rstd is ~1e-20, not 0 (or NaN)."""
    x = np.moveaxis(
        (1e20 * np.random.default_rng(11).standard_normal((2, 1024, 64))).astype(np.float32), -1, 1
    )
    got, want = (
        run(family, F.group_norm_forward, x, 8, eps=0.0),
        reference(F.group_norm_forward, x, 8, eps=0.0),
    )
    assert np.all(want[2] > 0) and np.isfinite(want[0]).all()
    assert_matches(got, want, 1e-5, "GN", atol=1e-5)


@pytest.mark.parametrize("family", FAST)
def test_channels_last_group_norm_backward_whose_coefficients_pass_float32(family):
    """A spread of 1e-15 (eps 0: rstd ~1e15) and a gradient of 1e20, channels last: the
    sums are finite but the dx coefficients pass float32's range; the kernel gives up its
    blocked pass and the result is the reference's, finite."""
    rng = np.random.default_rng(12)
    x = np.moveaxis((1e-15 * rng.standard_normal((2, 1024, 64))).astype(np.float32), -1, 1)
    dy = np.moveaxis((1e20 * rng.standard_normal((2, 1024, 64))).astype(np.float32), -1, 1)
    _, mean, rstd = reference(F.group_norm_forward, x, 8, eps=0.0)
    got = run(family, F.group_norm_backward, dy, x, 8, mean, rstd)
    want = reference(F.group_norm_backward, dy, x, 8, mean, rstd)
    assert np.isfinite(want[0]).all()
    scale = float(np.abs(want[0]).max())  # (~1e35; small elements cancel to ~1e-5 relative)
    assert_matches(got, want, 1e-5, "GN backward", atol=1e-6 * scale)
