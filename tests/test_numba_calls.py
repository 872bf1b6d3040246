"""What the numba family's Python layer (``numba_rows``, ``numba_channels``) decides
before its compiled loops run: where an ``out=`` that shares memory with the input or
the gradient is written (the loops must not overwrite values they have yet to read),
which dtype a call computes in, and which calls go to another kernel (parameters that
would overflow the loops' factors), and the running statistics' own arithmetic."""

from __future__ import annotations

import types

import array_api_compat.numpy as xp
import numpy as np
import pytest
from helpers import op_calls

from npnorm.functional._dispatch import family_kernel, generic_kernel

pytest.importorskip("numba", reason="the compiled kernels need numba (the 'fast' extra)")

from test_numba_kernels import config


def _in_layout(flat: np.ndarray, shape: tuple[int, ...], layout: str) -> np.ndarray:
    """The 1-d ``flat`` as an array of ``shape`` in ``layout`` (a view)."""
    if layout == "C":
        return flat.reshape(shape)
    if layout == "F":
        return flat.reshape(shape[::-1]).T
    return np.moveaxis(flat.reshape(shape[0], *shape[2:], shape[1]), -1, 1)  # channels-last


def _overlapping(a: np.ndarray, layout: str, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """A copy of ``a`` in ``layout``, and an array of its shape and layout in the same
    buffer ``shift`` values further on (before it, for a negative shift)."""
    n = a.size
    buf = np.zeros(n + abs(shift), a.dtype)
    at, out_at = (0, shift) if shift > 0 else (-shift, 0)
    copy = _in_layout(buf[at : at + n], a.shape, layout)
    copy[...] = a
    return copy, _in_layout(buf[out_at : out_at + n], a.shape, layout)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("shape", [(4, 16, 3, 5), (4, 3, 300), (300, 6)])
@pytest.mark.parametrize("layout", ["C", "channels_last", "F"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_out_overlapping_the_input_or_the_gradient_partly(dtype, layout, shape, small, restore_threads):
    """An ``out`` that overlaps the input (forward), the gradient or the input (backward),
    shifted by a value or a sample either way, gets bitwise what a fresh output gets, on
    every path of every operation: the loops called directly, staged by rows, BatchNorm
    by blocks of channels or of rows or through a whole copy, channels-last samples
    (test_out takes LayerNorm's forward only)."""
    if layout == "channels_last" and len(shape) < 3:
        layout = "C"
    rng = np.random.default_rng(5)
    x = _in_layout(np.empty(int(np.prod(shape)), dtype), shape, layout)
    x[...] = rng.normal(size=shape) * 2 + 1
    dy = _in_layout(np.empty(x.size, dtype), shape, layout)
    dy[...] = rng.normal(size=shape)
    D = shape[-1]
    w, b = np.linspace(0.5, 1.5, D).astype(dtype), np.linspace(-1, 1, D).astype(dtype)
    # small: blocks of a few values; else staged blocks of 3 KB (BatchNorm1d's float16 or
    # overlapped (300, 6) input then goes by blocks of 128 rows)
    with config(2, small, None if small else 3072):
        for op, fwd_args, bwd_args in op_calls(x, dy, w, b, 1 if shape[1] % 2 else 2):
            if op == "instance_norm" and fwd_args[5] and len(shape) < 3:
                continue  # (one value per instance)
            forward = family_kernel(op + "_forward", "numba")
            backward = family_kernel(op + "_backward", "numba")
            fresh = forward(xp, *fwd_args)
            fresh_dx = backward(xp, *bwd_args(fresh))
            for shift in (1, -1, x.size // shape[0]):
                what = f"{op} {fwd_args[5] if len(fwd_args) > 5 else ''} shift {shift}"
                x2, out = _overlapping(x, layout, shift)
                got = forward(xp, x2, *fwd_args[1:], out)
                assert got[0] is out, what
                for ours, want in zip(got, fresh, strict=True):
                    np.testing.assert_array_equal(ours, want, err_msg=f"forward {what}")
                for which in (0, 1):  # out overlapping dy, then x
                    args = list(bwd_args(fresh))
                    args[which], out = _overlapping(args[which], layout, shift)
                    got = backward(xp, *args, out)
                    assert got[0] is out, what
                    for ours, want in zip(got, fresh_dx, strict=True):
                        if want is None:
                            assert ours is None, what
                        else:
                            np.testing.assert_array_equal(ours, want, err_msg=f"backward {which} {what}")


def test_instance_norm_running_mean_of_many_instances_is_summed_in_float64():
    """InstanceNorm's running mean from many float32 instances near 1000: their means
    are averaged in float64 (in float32, 20000 of them summed past 2**24 lost 1e-5 of
    the mean, ~200 of its ulps)."""
    x = (1000 + np.random.default_rng(0).random((20000, 2, 2))).astype(np.float32)
    rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
    forward = family_kernel("instance_norm_forward", "numba")
    running_mean = forward(xp, x, rm, rv, None, None, True, 1.0, 1e-5)[3]
    truth = x.astype(np.float64).mean(axis=(0, 2))
    np.testing.assert_allclose(running_mean, truth, rtol=2 * np.finfo(np.float32).eps, atol=0)


def test_channel_backward_whose_scale_passes_float32_takes_the_reference():
    """``dx = rstd*w*dy`` with ``rstd*w`` (1e39) beyond float32 but dx (1e33) within it:
    BatchNorm's, InstanceNorm's and GroupNorm's backwards hand it to a kernel that takes
    that product in float64 (the loops' float32 factor was inf), as the reference does."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    dy = (rng.normal(size=x.shape) * 1e-6).astype(np.float32)
    w = np.full(3, 1e25, np.float32)
    per_channel = (np.zeros(3, np.float32), np.full(3, 1e14, np.float32))
    per_row = (np.zeros((4, 3), np.float32), np.full((4, 3), 1e14, np.float32))
    calls = [
        ("batch_norm_backward", (dy, x, *per_channel, w, None, False)),
        ("batch_norm_backward", (dy, x, *per_channel, w, None, True)),
        ("instance_norm_backward", (dy, x, *per_channel, w, None, False)),
        ("instance_norm_backward", (dy, x, *per_row, w, None, True)),
        ("group_norm_backward", (dy, x, 3, *per_row, w, None)),
    ]
    for op, args in calls:
        with np.errstate(over="ignore", invalid="ignore"):
            want = generic_kernel(op)(xp, *args)
        got = family_kernel(op, "numba")(xp, *args)
        for ours, ref in zip(got, want, strict=True):
            if ref is None:
                assert ours is None, op
            else:
                np.testing.assert_allclose(ours, ref, rtol=1e-5, err_msg=op)


def _within_half_an_ulp(ours: np.ndarray, truth: np.ndarray, what: str) -> None:
    """``ours`` (float32) is ``truth`` (float64) rounded: within half an ulp, plus 1e-12
    of the largest value for the float64 computation's own rounding."""
    assert ours.dtype == np.float32, what
    err = np.abs(ours.astype(np.float64) - truth)
    tol = 0.5 * np.spacing(np.abs(ours)).astype(np.float64) + 1e-12 * np.max(np.abs(truth))
    assert (err <= tol).all(), f"{what}: {int((err > tol).sum())} of {err.size} off by more than half an ulp"


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_float64_saved_statistics_are_taken_in_float64(offset):
    """float32 data and parameters with float64 saved statistics: the backwards compute
    in float64 (the statistics' dtype counts in the computation dtype, as in the
    reference), so each result is the float64 result rounded once to float32 (computed
    in float32, about a third of them were an ulp off)."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(6, 4, 40)) + offset).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    wd, wc = rng.uniform(0.5, 1.5, 40).astype(np.float32), rng.uniform(0.5, 1.5, 4).astype(np.float32)
    x64 = x.astype(np.float64)
    rows = x64.mean(-1), 1 / np.sqrt(x64.var(-1) + 1e-5)  # (6, 4) each, float64
    channels = x64.mean((0, 2)), 1 / np.sqrt(x64.var((0, 2)) + 1e-5)  # (4,) each, float64
    rms = 1 / np.sqrt((x64**2).mean(-1) + 1e-6)
    calls = [
        ("layer_norm_backward", (dy, x, (40,), *rows, wd, wd)),
        ("rms_norm_backward", (dy, x, (40,), rms, wd)),
        ("batch_norm_backward", (dy, x, *channels, wc, wc, True)),
        ("instance_norm_backward", (dy, x, *rows, wc, wc, True)),
        ("group_norm_backward", (dy, x, 4, *rows, wc, wc)),
    ]
    for op, args in calls:
        got = family_kernel(op, "numba")(xp, *args)
        as64 = [a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args]
        truth = generic_kernel(op)(xp, *as64)
        for i, (ours, want) in enumerate(zip(got, truth, strict=True)):
            _within_half_an_ulp(ours, want, f"{op} result {i}")


def test_channels_last_input_with_padded_rows_is_staged_for_the_loops(monkeypatch):
    """A channels-last input whose rows of C values lie further apart than C (a slice of
    the channels of a wider array) is staged, not handed to the loops as a non-C-ordered
    view (numba would compile a variant for another layout, seconds each at run time):
    every array the channel loops get is C-contiguous (the float16 casts read the input
    as it is), and forward and backward give the reference's results."""
    from npnorm.kernels import _numba_loops as loops
    from npnorm.kernels import numba_channels

    given = []

    def recorded(name, loop):
        def call(*args):
            given.extend((name, a.flags.c_contiguous) for a in args if isinstance(a, np.ndarray))
            return loop(*args)

        return call

    proxy = types.SimpleNamespace(
        **{k: recorded(k, v) if hasattr(v, "signatures") else v for k, v in vars(loops).items()}
    )
    monkeypatch.setattr(numba_channels, "loops", proxy)
    rng = np.random.default_rng(3)
    wide = rng.normal(size=(4, 3, 5, 24)).astype(np.float32)
    x = np.moveaxis(wide[..., :16], -1, 1)  # (4, 16, 3, 5), rows of 16 values 24 apart
    dy = np.moveaxis(rng.normal(size=(4, 3, 5, 24)).astype(np.float32)[..., :16], -1, 1)
    for op, fwd_args, bwd_args in op_calls(x, dy, None, None, 4):
        if op in ("layer_norm", "rms_norm"):
            continue
        given.clear()
        fresh = family_kernel(op + "_forward", "numba")(xp, *fwd_args)
        got = family_kernel(op + "_backward", "numba")(xp, *bwd_args(fresh))
        assert given, op  # (the loops were reached through the proxy)
        assert all(contiguous for name, contiguous in given if name != "half_columns_to_float"), (op, given)
        want = generic_kernel(op + "_forward")(xp, *fwd_args)
        np.testing.assert_allclose(fresh[0], want[0], rtol=1e-5, atol=1e-5, err_msg=op)
        want = generic_kernel(op + "_backward")(xp, *bwd_args(want))
        for ours, ref in zip(got, want, strict=True):
            if ref is None:
                assert ours is None, op
            else:
                np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5, err_msg=op)


def test_batch_norm_kernel_of_one_value_per_channel_without_buffers_is_the_reference():
    """The kernel called directly with one value per channel and no running statistics
    (the public functions refuse it in training, as torch does): the reference's result,
    as the numpy family gives (it divided by n - 1 = 0 for buffers it did not have)."""
    x = np.array([[1.0, -2.0, 3.0]], np.float32)
    want = generic_kernel("batch_norm_forward")(xp, x, None, None, None, None, True, 0.1, 1e-5)
    got = family_kernel("batch_norm_forward", "numba")(xp, x, None, None, None, None, True, 0.1, 1e-5)
    for ours, ref in zip(got, want, strict=True):
        if ref is None:
            assert ours is None
        else:
            np.testing.assert_array_equal(ours, ref)
