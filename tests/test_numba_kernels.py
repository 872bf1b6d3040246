"""The compiled ("numba") kernels against the generic reference kernels.

Every operation, forward and backward, on drawn shapes, values, dtypes, memory layouts,
flags, offsets and thread counts (hypothesis ``extra.numpy`` strategies, so failures
shrink); bitwise reproducibility at a fixed thread count. Most draws shrink the staging
block and the serial threshold, so that small inputs run through many staged blocks and
several threads.
"""

from __future__ import annotations

import contextlib
import math
import tracemalloc
from collections.abc import Iterator
from typing import Any

import array_api_compat.numpy as xp
import numpy as np
import pytest
from helpers import (
    at_elements,
    count_at,
    gradient_terms,
    op_calls,
    output_terms,
    parameter_at,
    same_results,
    statistic_max,
    statistic_scales,
    statistic_shape,
)
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
import npnorm.functional as F
from npnorm import _threads
from npnorm.functional._dispatch import family_kernel, generic_kernel

pytest.importorskip("numba", reason="the compiled kernels need numba (the 'fast' extra)")

from npnorm.kernels import _blocks, _staging, numba_channels, numba_rows

FLOATS = ("float16", "float32", "float64")
LAYOUTS = ("C", "F", "sliced", "transposed", "channels_last")
REL = {"float64": 1e-11, "float32": 2e-5}  # of the computation dtype, relative to a scale
# The statistics against float64 (the reference kernel on the data cast to float64): the
# compiled loops accumulate in float64 whatever the data's dtype, so they are off by the
# rounding to the result's dtype and a float64 summation order only.
TIGHT = 1e-11
STATS = {  # the forward's results, by position
    "layer_norm_forward": ("output", "mean", "rstd"),
    "rms_norm_forward": ("output", "rstd"),
    "group_norm_forward": ("output", "mean", "rstd"),
    "batch_norm_forward": ("output", "mean", "rstd", "running_mean", "running_var"),
    "instance_norm_forward": ("output", "mean", "rstd", "running_mean", "running_var"),
}


@contextlib.contextmanager
def config(threads: int, small: bool, stage_bytes: int | None = None) -> Iterator[None]:
    """Thread count; with ``small``, tiny staging blocks, no serial threshold, no whole
    copy of small inputs that cannot be viewed as rows (they are staged sample by sample,
    as large ones are), and BatchNorm's short channels taken in blocks of 1 to 3 channels
    (rows of 12 bytes or more), their spans of samples split from two spans, and
    channels-last GroupNorm/InstanceNorm input taken by samples from two channels, their
    sums in spans of 16 values (a row at least) which the threads split wherever there
    are fewer samples than threads, and Fortran-ordered BatchNorm input as planes from one
    sample, and staged BatchNorm input in blocks of one channel and more;
    ``stage_bytes``: the staging blocks' size, where given."""
    saved = (
        _threads.get_num_threads(),
        _staging.STAGE_BYTES,
        _staging.MIN_PARALLEL,
        _blocks.SMALL_COPY_BYTES,
        numba_channels.BLOCK_BYTES,
        numba_channels.ROW_BYTES,
        numba_channels.SPLIT_VALUES,
        numba_channels.WIDE_ROW_BYTES,
        numba_channels.PLANE_SAMPLES,
        numba_channels.SPAN_VALUES,
        numba_channels.SPAN_MIN_ROWS,
        numba_channels.SPLIT_SAMPLE_VALUES,
        numba_channels.STAGED_SPAN_BYTES,
    )
    _threads.set_num_threads(threads)
    if small:
        _staging.STAGE_BYTES, _staging.MIN_PARALLEL, _blocks.SMALL_COPY_BYTES = 64, 1, 0
        numba_channels.BLOCK_BYTES, numba_channels.ROW_BYTES, numba_channels.SPLIT_VALUES = 0, 12, 1
        numba_channels.WIDE_ROW_BYTES, numba_channels.PLANE_SAMPLES = 0, 1
        numba_channels.SPAN_VALUES, numba_channels.SPAN_MIN_ROWS, numba_channels.SPLIT_SAMPLE_VALUES = (
            16,
            1,
            1,
        )
        numba_channels.STAGED_SPAN_BYTES = 0
    if stage_bytes is not None:
        _staging.STAGE_BYTES = stage_bytes
    try:
        yield
    finally:
        _threads.set_num_threads(saved[0])
        _staging.STAGE_BYTES, _staging.MIN_PARALLEL, _blocks.SMALL_COPY_BYTES = saved[1:4]
        numba_channels.BLOCK_BYTES, numba_channels.ROW_BYTES, numba_channels.SPLIT_VALUES = saved[4:7]
        numba_channels.WIDE_ROW_BYTES, numba_channels.PLANE_SAMPLES = saved[7:9]
        numba_channels.SPAN_VALUES, numba_channels.SPAN_MIN_ROWS, numba_channels.SPLIT_SAMPLE_VALUES = saved[
            9:12
        ]
        numba_channels.STAGED_SPAN_BYTES = saved[12]


def recorded_loops(
    monkeypatch: pytest.MonkeyPatch, *names: str, blocks: bool = False, ranges: bool = False
) -> list[Any]:
    """Each of the compiled loops ``names`` replaced by a wrapper that records its calls in
    the list returned: the loop's name, or with ``blocks`` ``(name, its blocks' channels)``
    (the tenth argument of BatchNorm's blocks' loops ``channel_block_*``; None for others),
    or with ``ranges`` ``(name, (its last two arguments))`` (a channel loop's c0, c1)."""
    from npnorm.kernels import _numba_loops as loops

    called: list[Any] = []

    def recording(name: str, loop: Any) -> Any:
        def record(*a: Any) -> Any:
            block = a[9] if name.startswith("channel_block_") else None
            called.append((name, block) if blocks else (name, tuple(a[-2:])) if ranges else name)
            return loop(*a)

        return record

    for name in names:
        monkeypatch.setattr(loops, name, recording(name, getattr(loops, name)))
    return called


def laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """The values of ``a`` in another memory layout (same dtype)."""
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "sliced":  # every other entry along the last axis
        big = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype=a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if layout == "transposed":  # all strides reversed
        return np.ascontiguousarray(a.T).T
    if layout == "channels_last" and a.ndim >= 3:  # axis 1 innermost in memory
        return np.ascontiguousarray(np.moveaxis(a, 1, -1)).transpose(0, a.ndim - 1, *range(1, a.ndim - 1))
    return a


def values(dtype: str, shape: tuple[int, ...], *, each: bool = True) -> st.SearchStrategy[np.ndarray]:
    """Bounded finite values of ``dtype`` (float16 keeps its range), each drawn on its own
    (by default hypothesis draws a few and fills the rest with one value: most rows came
    out constant); ``each=False`` for arrays too large to draw value by value."""
    return hnp.arrays(
        np.dtype(dtype),
        shape,
        elements=st.floats(-4, 4, width=np.dtype(dtype).itemsize * 8),
        fill=st.nothing() if each else None,
    )


@st.composite
def problems(draw: st.DrawFn, kind: str) -> dict:
    """One drawn problem: the input and gradient, parameters, layout and settings.

    ``kind``: "rows" (LayerNorm/RMSNorm: any batch shape, normalized over 1-2 trailing
    axes), "batch", "instance" or "group" ((N, C, *spatial) input)."""
    dtype = draw(st.sampled_from(FLOATS))
    if kind == "rows":
        shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9))
        k = draw(st.integers(1, min(2, len(shape))))
        pshape = shape[len(shape) - k :]
        op, stat_shape = "layer_norm", shape[: len(shape) - k]  # (RMSNorm's rows too)
    else:
        groups = draw(st.integers(1, 3)) if kind == "group" else 0
        n = draw(st.integers(1, 4))
        c = groups * draw(st.integers(1, 3)) if kind == "group" else draw(st.integers(1, 5))
        spatial = draw(
            hnp.array_shapes(min_dims=0 if kind == "batch" else 1, max_dims=3, min_side=1, max_side=7)
        )
        shape, pshape = (n, c, *spatial), (c,)
        op = f"{kind}_norm"
        stat_shape = statistic_shape(op, shape, groups)
    pdt = draw(st.sampled_from((dtype, "float32", "float64")))
    offset = draw(st.sampled_from((0.0, 3.0, 1e3)))
    x = draw(values(dtype, shape))
    spread = draw(st.sampled_from((1.0, 1e-3)))
    # and each statistic (x's and dy's) scaled on its own, so that statistics of very
    # different sizes meet in one call
    scales = statistic_scales(op, shape, stat_shape)
    x_factor = draw(scales)
    x = ((x.astype(np.float64) * spread + offset) * x_factor).astype(dtype)
    dy = draw(values(dtype, shape)).astype(np.float64) * draw(scales)
    p = {
        "kind": kind,
        "x": laid_out(x, draw(st.sampled_from(LAYOUTS))),
        "dy": laid_out(dy.astype(dtype), draw(st.sampled_from(LAYOUTS))),
        "w": draw(hnp.arrays(np.dtype(pdt), pshape, elements=st.floats(0.5, 1.5)))
        if draw(st.booleans())
        else None,
        "b": draw(hnp.arrays(np.dtype(pdt), pshape, elements=st.floats(-2, 2)))
        if draw(st.booleans())
        else None,
        "threads": draw(st.sampled_from((1, 2, 3))),
        "small": draw(st.booleans()),
        "training": draw(st.booleans()),
        "momentum": draw(st.sampled_from((0.1, 1.0))),
        "eps": draw(st.sampled_from((1e-5, 0.25))),
    }
    if kind == "rows":
        p["norm"] = pshape
    if kind == "group":
        p["groups"] = groups
    if kind in ("batch", "instance"):
        buffers = draw(st.booleans()) or not p["training"]
        # to the size of their channel's data (its largest factor): a buffer of its own size
        # does not hide a wrong batch statistic on a small channel
        channel = statistic_max("batch_norm", x_factor, np.zeros(c))  # C
        for name, elements, power in (("rm", st.floats(-2, 2), 1), ("rv", st.floats(0.5, 2), 2)):
            drawn = draw(hnp.arrays(np.dtype(pdt), pshape, elements=elements)) if buffers else None
            p[name] = None if drawn is None else (drawn * channel**power).astype(pdt)
    return p


def ulp(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps)


def _within(ours, ref, want, rel: float, scale, what: str) -> None:
    """``ours`` has ``ref``'s dtype and shape, and equals ``want`` to ``rel`` relative to
    ``scale`` plus two roundings to its dtype (subnormals included)."""
    assert isinstance(ours, np.ndarray), what
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), (
        what,
        ours.dtype,
        ref.dtype,
        ours.shape,
        ref.shape,
    )
    a, b = ours.astype(np.float64), np.asarray(want, dtype=np.float64)
    tiny = float(np.finfo(ours.dtype).smallest_subnormal)
    tol = rel * np.asarray(scale) + 2 * ulp(ours.dtype) * np.abs(b) + 2 * tiny
    with np.errstate(invalid="ignore"):  # inf - inf: a float16 gradient beyond its range
        bad = ~((a == b) | (np.abs(a - b) <= tol))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} differ, worst {np.max(np.abs(a - b) - tol):.3g}"
    )


def assert_close(ours, ref, ct, scale, what: str) -> None:
    """``ours`` equals ``ref`` to the rounding of the computation dtype ``ct`` relative to
    ``scale``, plus two roundings to the result's dtype; same dtype and shape."""
    if ref is None:
        assert ours is None, what
        return
    _within(ours, ref, ref, REL[np.dtype(ct).name], scale, what)


def assert_accurate(ours, ref, truth, scale, what: str) -> None:
    """``ours`` has ``ref``'s dtype and shape, and equals ``truth`` (float64) to two
    roundings to its dtype plus ``TIGHT`` relative to ``scale``."""
    _within(ours, ref, truth, TIGHT, scale, what)


def as_float64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) else a


def _centred_again(op: str, fwd_args: tuple) -> bool:
    """Whether the backward of ``op``'s layer centres the recomputed xhat again in the
    "numba" family (LayerNorm, GroupNorm; InstanceNorm and BatchNorm with input or batch
    statistics)."""
    if op in ("instance_norm_forward", "batch_norm_forward"):
        return bool(fwd_args[5])  # use_input_stats, training
    return op in ("layer_norm_forward", "group_norm_forward")


def _xhat_bound(op: str, x, mean, rstd) -> float:
    """1 + max |x - mean| * rstd, each element with its own statistic's (``op`` a
    forward's name), in float64."""
    name = op.removesuffix("_forward")
    xc = np.abs(x.astype(np.float64) - at_elements(name, x, mean))
    return float(np.max(xc * np.abs(at_elements(name, x, rstd)), initial=0.0)) + 1.0


def compare(ops: tuple[str, str], fwd_args: tuple, bwd_args, p: dict, ct) -> tuple:
    """Forward and backward, numba vs reference (the backward from the reference's
    statistics for both); every result equal to rounding, and the statistics (mean, rstd,
    running buffers) to float64's accuracy."""
    with config(p["threads"], p["small"], p.get("stage_bytes")):
        ours_f = family_kernel(ops[0], "numba")(xp, *fwd_args)
        ref_f = generic_kernel(ops[0])(xp, *fwd_args)
        ours_b = family_kernel(ops[1], "numba")(xp, *bwd_args(ref_f))
        ref_b = generic_kernel(ops[1])(xp, *bwd_args(ref_f))
    x, dy, w = p["x"], p["dy"], p["w"]
    x64 = np.abs(x.astype(np.float64))
    xmax = float(x64.max(initial=0.0))
    rstd = ref_f[1] if ops[0] == "rms_norm_forward" else ref_f[2]
    rmax = float(np.max(np.abs(rstd.astype(np.float64)), initial=0.0))
    wmax = 1.0 if w is None else float(np.abs(w.astype(np.float64)).max())
    # |x - mean| * rstd with the mean as the backward takes it, rounded to ct (dx's subnormal
    # allowance below)
    xhat_max = (2 * xmax + 1) * rmax
    args64 = [as_float64(a) for a in fwd_args]
    if ops[0] == "rms_norm_forward" and args64[3] is None:
        # RMSNorm's default eps: that of the dtype the input is computed in (not the weight's)
        args64[3] = float(np.finfo(np.result_type(np.float32, p["x"].dtype)).eps)
    truth = generic_kernel(ops[0])(xp, *args64)
    b = p.get("b")
    # Both take the mean's rounding to ct back where it would show (each centres again, or
    # folds the mean into the shift only near 0), so each element of the output goes by
    # its own terms (its weight, bias and statistic: helpers.output_terms) and the float64
    # mean's rounding, n roundings of |mean| on a statistic of n values (the two sum in
    # other orders). (This was (2 xmax + 1) rstd w times ct's rounding, as for a mean
    # rounded to ct: over 1e5 x the output's scale at an offset of 1e3 with spread 1e-3,
    # where dropping the mean's low part passed; then x.size roundings of the largest |x|
    # of all.)
    op = ops[0].removesuffix("_forward")
    mean = np.zeros(np.shape(rstd)) if op == "rms_norm" else ref_f[1]
    terms, mean_rounding = output_terms(op, x, w, mean, rstd)
    b_at = 0.0 if b is None else parameter_at(op, x, b)
    y_scale = terms + b_at + np.abs(truth[0].astype(np.float64)) + mean_rounding / REL[np.dtype(ct).name]
    assert_close(ours_f[0], ref_f[0], ct, y_scale, "output")
    n = max(2, int(np.max(count_at(op, x, ref_f[1]), initial=0)))  # values per statistic
    for i, name in enumerate(STATS[ops[0]][1:], start=1):
        if ref_f[i] is None:
            assert ours_f[i] is None, name
            continue
        t = np.abs(truth[i].astype(np.float64))
        # each statistic to the largest |x| of its own values (or channel's, for a running
        # buffer), not of all
        x_max = statistic_max(op, x, t)
        # a two-pass variance is off by the square of its mean's error, and a float64 mean of
        # n values can be off by up to n - 1 roundings of its largest |x| (eps64 each; n
        # here, two at least): the reference's is, on a channel of 24 equal values
        # 1000.0027 (variance 3.4e-25 for 0)
        var_floor = (n * ulp(np.dtype(np.float64)) * x_max) ** 2 / TIGHT
        scale = {"mean": x_max, "rstd": t, "running_mean": x_max + t, "running_var": t + var_floor}[name]
        if name.startswith("running"):
            # new = (1 - m)*old + m*stat in the buffer's dtype: two products rounded, then
            # their sum, each term up to |old| + |new| (old -0.375 and a batch mean 3.67 at
            # momentum 0.1 gave 0.0292 from terms of 0.34, 7.5e-9 off in float32)
            old = np.abs(fwd_args[1 if name == "running_mean" else 2].astype(np.float64))  # (x, rm, rv, ..)
            scale = scale + 2 * ulp(ref_f[i].dtype) * (2 * old + t) / TIGHT
            if ops[0] == "instance_norm_forward" and name == "running_mean":
                # numba averages the (sample, channel) means as returned, rounded to ct (as
                # torch's instance_norm averages its float32 ones), the reference float64's:
                # momentum times a rounding of up to the channel's largest |x| each (means
                # 0, 1 and -16/15 of float32 data gave a running mean of -0.0022, 1.1e-9 apart)
                momentum = fwd_args[6]  # (x, rm, rv, w, b, use_input_stats, momentum, eps)
                share = 1.0 if momentum is None else abs(momentum)  # (None: 1 / count at most)
                scale = scale + share * ulp(np.dtype(ct)) * x_max / TIGHT
        assert_accurate(ours_f[i], ref_f[i], truth[i], scale, name)
    # dx = rstd * (g - mean(g) - ...): the reference takes mean(g) in the data's dtype, where a
    # mean of subnormal gradients rounds to the subnormal spacing, which rstd amplifies (dy
    # [1e-45, 0] with rstd 316 gave dx [4.4e-43, 0] against numba's float64 [2.2e-43, -2.2e-43])
    # (that allowance's |xhat|: bounded by |x - mean| * rstd where xhat is centred again,
    # as the reference's, else as wide as the data)
    dx_xhat = xhat_max
    if _centred_again(ops[0], fwd_args) and x.size:
        dx_xhat = _xhat_bound(ops[0], x, ref_f[1], rstd)
    # and numba sums g * (x - mean) before scaling by rstd (the reference scales xhat first):
    # products below the normal range round to the subnormal spacing, which rstd^2 |xhat|
    # amplifies (float64 dy [2.1e-313, 0] with x [1e-3, 0], rstd 312: dx 8.5e-321 apart)
    subnormal = (2 + rmax * (1 + dx_xhat)) * rmax * wmax * float(np.finfo(ct).smallest_subnormal)
    subnormal /= REL[np.dtype(ct).name]
    # Otherwise each element of dx to a few roundings of its own terms on its own statistic,
    # and each of dweight and dbias of its own sums (helpers.gradient_terms): with the
    # largest terms of all, a dx off by 50 roundings of its own terms, only on a statistic
    # whose terms are under 5% of the largest, passed the drawn LayerNorm, RMSNorm,
    # InstanceNorm and GroupNorm tests on 3 seeds of 3
    batch = _centred_again(ops[0], fwd_args) or op == "rms_norm"
    mean = None if op == "rms_norm" else ref_f[1]
    dx_terms, dw_terms, db_terms = gradient_terms(op, x, dy, w, mean, rstd, batch=batch)
    assert_close(ours_b[0], ref_b[0], ct, 4 * dx_terms + subnormal, "dx")
    for i, name, terms in ((1, "dweight", dw_terms), (2, "dbias", db_terms)):
        if i < len(ref_b):
            assert_close(ours_b[i], ref_b[i], ct, terms, name)
    return ours_f, ours_b


def compute_dtype(*arrays) -> np.dtype:
    return np.result_type(np.float32, *(a.dtype for a in arrays if a is not None))


# --- every operation against the reference ------------------------------------------------


# a subnormal float64 gradient whose products with x - mean sink deeper: hypothesis found it
SUBNORMAL_PRODUCTS = {
    "kind": "rows",
    "x": np.array([0.001, 0.0]),
    "dy": np.array([2.12199579e-313, 0.0]),
    "w": None,
    "b": None,
    "threads": 1,
    "small": False,
    "training": False,
    "momentum": 0.1,
    "eps": 1e-05,
    "norm": (2,),
}


@settings(max_examples=150)
@given(p=problems("rows"))
@example(p=SUBNORMAL_PRODUCTS)
def test_layer_norm(p):
    x, dy, w, b, norm = p["x"], p["dy"], p["w"], p["b"], p["norm"]
    ct = compute_dtype(x, w, b)
    f, _ = compare(
        ("layer_norm_forward", "layer_norm_backward"),
        (x, norm, w, b, p["eps"]),
        lambda r: (dy, x, norm, r[1], r[2], w, b),
        p,
        ct,
    )
    assert f[1].shape == f[2].shape == x.shape[: x.ndim - len(norm)] and f[1].dtype == ct


@settings(max_examples=150)
@given(p=problems("rows"), default_eps=st.booleans())
def test_rms_norm(p, default_eps):
    x, dy, w, norm = p["x"], p["dy"], p["w"], p["norm"]
    eps = None if default_eps else p["eps"]
    ct = compute_dtype(x, w)
    f, _ = compare(
        ("rms_norm_forward", "rms_norm_backward"),
        (x, norm, w, eps),
        lambda r: (dy, x, norm, r[1], w),
        p,
        ct,
    )
    assert f[1].dtype == ct


def _two_values(x, dy, axis):
    """The input doubled along ``axis`` (a statistic then has at least two values)."""
    return np.concatenate([x, x + 1], axis=axis), np.concatenate([dy, dy], axis=axis)


def long_channels_in_eval(kind: str) -> dict:
    """A problem whose channels have more than ``CHUNK`` values a sample, with running
    statistics (eval): the long-channel loops' eval branch, which drawn spatial sizes
    (at most 7**3 values) seldom reach with ``training`` False."""
    rng = np.random.default_rng(7)
    shape = (2, 3, 300)
    return {
        "kind": kind,
        "x": (rng.normal(size=shape) * 2 + 3).astype(np.float32),
        "dy": rng.normal(size=shape).astype(np.float32),
        "w": rng.uniform(0.5, 1.5, 3).astype(np.float32),
        "b": rng.uniform(-2, 2, 3).astype(np.float32),
        "threads": 2,
        "small": False,
        "training": False,
        "momentum": 0.1,
        "eps": 1e-05,
        "rm": rng.uniform(-2, 2, 3).astype(np.float32),
        "rv": rng.uniform(0.5, 2, 3).astype(np.float32),
    }


@settings(max_examples=150)
@given(p=problems("batch"))
@example(p=long_channels_in_eval("batch"))
def test_batch_norm(p):
    x, dy, w, b, rm, rv = p["x"], p["dy"], p["w"], p["b"], p["rm"], p["rv"]
    training = p["training"]
    if training and x.shape[0] * int(np.prod(x.shape[2:])) <= 1:
        x, dy = _two_values(x, dy, 0)
        p = {**p, "x": x, "dy": dy}
    ct = compute_dtype(x, w, b, rm, rv)
    f, _ = compare(
        ("batch_norm_forward", "batch_norm_backward"),
        (x, rm, rv, w, b, training, p["momentum"], p["eps"]),
        lambda r: (dy, x, r[1], r[2], w, b, training),
        p,
        ct,
    )
    assert f[1].shape == f[2].shape == (x.shape[1],) and f[1].dtype == f[2].dtype == ct
    if not training:  # the buffers come back as given
        assert f[3] is rm and f[4] is rv


def numpy_running(rm, rv, mean, var, count, momentum):
    """The running statistics as the NumPy kernels move them (``running_update``)."""
    from npnorm.functional._channels import running_update

    with np.errstate(all="ignore"):
        return (
            running_update(xp, rm, mean, momentum),
            running_update(xp, rv, var * (count / (count - 1)), momentum),
        )


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal values of one dtype, the sign of zeros and infinities included (a NaN's
    payload aside)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got) | np.isnan(got), np.signbit(want) | np.isnan(want))


@settings(max_examples=200)
@given(
    dtype=st.sampled_from(["float32", "float64"]),
    C=st.integers(1, 9),
    count=st.integers(2, 2**40),
    momentum=st.floats() | st.sampled_from([0.0, 0.1, 1.0, -0.5, 2.0]),
    data=st.data(),
)
def test_running_statistics_compiled_bitwise_as_numpy(dtype, C, count, momentum, data):
    """The numba family moves common buffers (C-ordered, writable, float32 or float64) in
    one compiled call (``loops.running_moved``): bitwise what the NumPy kernels'
    ``running_update`` gives, on any values (infinities, NaN, overflow to inf in float32,
    subnormals, negative zeros) and any momentum."""
    from npnorm.kernels import _numba_loops as loops

    buffer = hnp.arrays(dtype, C, elements=st.floats(width=np.dtype(dtype).itemsize * 8))
    batch = hnp.arrays("float64", C, elements=st.floats())
    rm, rv, mean, var = data.draw(buffer), data.draw(buffer), data.draw(batch), data.draw(batch)
    assert numba_channels._compiled_buffers(rm, rv, mean, var)
    before = rm.copy(), rv.copy()
    want = numpy_running(rm, rv, mean, var, count, momentum)
    new_mean, new_var = np.empty_like(rm), np.empty_like(rv)
    loops.running_moved(rm, rv, mean, var, count / (count - 1), momentum, new_mean, new_var)
    got = numba_channels._running(xp, rm, rv, mean, var, count, momentum)  # (the loop, by the guard)
    for g, w in zip((new_mean, new_var, *got), want * 2, strict=True):
        assert_same_bits(g, w)
    assert_same_bits(rm, before[0])  # the buffers are read, not written
    assert_same_bits(rv, before[1])


@pytest.mark.parametrize(
    "kind",
    ["read-only", "strided", "float16", "mixed dtypes", "float32 batch", "read-only batch", "strided batch"],
)
def test_other_running_statistics_moved_by_numpy(kind, monkeypatch):
    """Buffers or batch statistics the compiled update would compile again for (read-only,
    strided), or does not take (float16, two dtypes, a float32 batch variance:
    ``running_update`` computes in the batch's dtype), are moved by NumPy, with the same
    results as before."""
    from npnorm.kernels import _numba_loops as loops

    rng = np.random.default_rng(5)
    rm, rv = rng.normal(size=6).astype(np.float32), rng.uniform(0.5, 2, 6).astype(np.float32)
    mean, var = rng.normal(size=6), rng.uniform(0, 3, 6)
    if kind == "read-only":
        rm.flags.writeable = False
    elif kind == "strided":
        rv = np.repeat(rv, 2)[::2]
    elif kind == "float16":
        rm, rv = rm.astype(np.float16), rv.astype(np.float16)
    elif kind == "mixed dtypes":
        rv = rv.astype(np.float64)
    elif kind == "float32 batch":
        var = var.astype(np.float32)
    elif kind == "read-only batch":
        mean.flags.writeable = False
    else:
        var = np.repeat(var, 2)[::2]
    assert not numba_channels._compiled_buffers(rm, rv, mean, var)
    monkeypatch.setattr(loops, "running_moved", None)  # (calling it raises)
    got = numba_channels._running(xp, rm, rv, mean, var, 18, 0.1)
    for g, w in zip(got, numpy_running(rm, rv, mean, var, 18, 0.1), strict=True):
        assert_same_bits(g, w)


def near_the_bounds(dtype: str) -> st.SearchStrategy[float]:
    """Any value of ``dtype``, or one at or next to the bounds of ``spread_limits`` (an
    rstd at ``low``; a factor whose square is about ``largest``)."""
    low, _, largest = _blocks.spread_limits(np.dtype(dtype))
    t = np.dtype(dtype).type
    root = t(np.sqrt(largest))
    edges = [low, np.nextafter(low, t(0)), np.nextafter(low, t(1)), root, np.nextafter(root, t(np.inf))]
    return st.floats(width=np.dtype(dtype).itemsize * 8) | st.sampled_from([float(e) for e in edges])


@settings(max_examples=300)
@given(
    dtype=st.sampled_from(["float32", "float64"]),
    shape=st.sampled_from([(1,), (5,), (3, 4)]),
    weighted=st.booleans(),
    data=st.data(),
)
def test_coefficient_bounds_compiled_as_numpy(dtype, shape, weighted, data):
    """The numba backwards ask whether their coefficients would leave the dtype in one
    compiled call (``loops.coefficients_leave``) where rstd and the weight are plain arrays
    of the computation dtype: the answer of ``extreme_coefficients`` (tiny=False) on any
    values, at the bounds, with NaN, infinities and zeros."""
    ct = np.dtype(dtype)
    values = near_the_bounds(dtype)
    rstd = data.draw(hnp.arrays(ct, shape, elements=values))
    weight = data.draw(hnp.arrays(ct, shape[-1], elements=values)) if weighted else None
    assert _staging.plain(rstd, ct) and (weight is None or _staging.plain(weight, ct))
    with np.errstate(all="ignore"):
        want = _blocks.extreme_coefficients(rstd, weight, ct, tiny=False)
    assert numba_channels._coefficients_leave(rstd, weight, ct) is want


@settings(max_examples=300)
@given(dtype=st.sampled_from(["float32", "float64"]), n=st.integers(1, 6), data=st.data())
def test_spread_bounds_compiled_as_numpy(dtype, n, data):
    """The numba row backwards (LayerNorm, RMSNorm) ask whether a row's spread is huge
    or tiny in one compiled call (``loops.spread_leaves``): the answer of
    ``extreme_spread`` on any values, at the bounds, with NaN, infinities and zeros."""
    ct = np.dtype(dtype)
    low, high, _ = _blocks.spread_limits(ct)
    t = ct.type
    edges = [
        low,
        np.nextafter(low, t(0)),
        high,
        np.nextafter(high, t(np.inf)),
        -high,
        -np.nextafter(low, t(0)),
    ]
    values = st.floats(width=ct.itemsize * 8) | st.sampled_from([float(e) for e in edges])
    rstd = data.draw(hnp.arrays(ct, n, elements=values))
    with np.errstate(all="ignore"):
        want = _blocks.extreme_spread(rstd, ct)
    assert numba_rows._extreme_spread(rstd, ct) is want


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "rstd, weight",
    [([np.nan, 1e30], [1e30]), ([1e30], [1e30, np.nan]), ([1e30, np.nan], [1.0]), ([1e30, 2.0], [np.inf])],
)
def test_coefficient_bounds_with_nan_as_numpy(dtype, rstd, weight):
    """A NaN among rstd or the weights makes NumPy's largest magnitude NaN, and the
    product's bound no longer holds (False) where the other values would exceed it."""
    ct = np.dtype(dtype)
    big = float(np.finfo(ct).max) ** 0.5 * 2  # (1e30 is huge in float32 only)
    r = np.array([big if v == 1e30 else v for v in rstd], ct)
    w = np.array([big if v == 1e30 else v for v in weight], ct)
    with np.errstate(all="ignore"):
        want = _blocks.extreme_coefficients(r, w, ct, tiny=False)
    assert numba_channels._coefficients_leave(r, w, ct) is want


@pytest.mark.parametrize("kind", ["float64 rstd", "read-only", "strided weight", "2-d weight"])
def test_other_coefficient_bounds_asked_of_numpy(kind, monkeypatch):
    """rstd or weights the compiled question would compile again for, or does not take,
    are asked of ``extreme_coefficients`` itself."""
    from npnorm.kernels import _numba_loops as loops

    ct = np.dtype(np.float32)

    def rstd_of(value: float) -> np.ndarray:
        rstd = np.full(4, value, np.float64 if kind == "float64 rstd" else ct)
        rstd.flags.writeable = kind != "read-only"
        return rstd

    weight = {"strided weight": np.ones(8, ct)[::2], "2-d weight": np.ones((1, 4), ct)}.get(
        kind, np.ones(4, ct)
    )
    monkeypatch.setattr(loops, "coefficients_leave", None)  # (calling it raises)
    assert numba_channels._coefficients_leave(rstd_of(1e-20), weight, ct) is True  # below ``low``
    assert numba_channels._coefficients_leave(rstd_of(1.0), weight, ct) is False


def staged_batch_norm_case(kind: str, shape: tuple[int, ...], seed: int, layout: str = "C") -> tuple:
    """BatchNorm inputs the loops must stage (``kind``: float16, read-only, a float64
    weight, the other byte order) in ``layout``, and the same values as the loops take
    them unstaged: ``(w, b, running_mean, running_var, [x, dy] unstaged, [x, dy] staged)``."""
    rng = np.random.default_rng(seed)
    C = shape[1]
    dtype = "float16" if kind == "float16" else "float32"
    x = laid_out((rng.normal(size=shape) * 3 + 1).astype(dtype), layout)
    dy = laid_out(rng.normal(size=shape).astype(dtype), layout)
    ct = "float64" if kind == "float64 weight" else "float32"
    w, b = rng.normal(size=C).astype(ct), rng.normal(size=C).astype(ct)
    rm, rv = rng.normal(size=C).astype(ct), rng.uniform(0.5, 2, size=C).astype(ct)
    plain = [x.astype(ct), dy.astype(ct)]  # unstaged: writable, of ct (astype keeps the layout)
    staged = [x, dy]
    if kind == "read-only":
        for a in staged:
            a.flags.writeable = False
    if kind == "byte-swapped":
        staged = [a.astype(a.dtype.newbyteorder()) for a in staged]
    return w, b, rm, rv, plain, staged


def batch_norm_results(x, dy, w, b, rm, rv, training) -> list:
    """BatchNorm's forward (on copies of the running statistics) and backward: every result."""
    f = F.batch_norm_forward(x, rm.copy(), rv.copy(), w, b, training=training)
    return [*f, *F.batch_norm_backward(dy, x, f[1], f[2], w, b, training=training)]


def assert_staged_as_unstaged(got: list, want: list, what: str) -> None:
    """Staged results bitwise the unstaged ones (float16: the float32 result rounded)."""
    for g, v in zip(got, want, strict=True):
        if v is None:
            assert g is None
        else:
            np.testing.assert_array_equal(g, v.astype(g.dtype), err_msg=what)


@pytest.mark.parametrize("kind", ["float16", "read-only", "float64 weight", "byte-swapped"])
@pytest.mark.parametrize("shape", [(3, 5, 300), (40, 6, 2), (7, 3), (2, 4, 3, 5)])
def test_batch_norm_staged_in_blocks_of_channels_as_unstaged(kind, shape, restore_threads, monkeypatch):
    """BatchNorm input the loops cannot take as it is (float16, read-only, a computation
    dtype other than the input's, the other byte order) is staged in blocks of channels
    (``numba_channels._by_channel_blocks``): bitwise the results of the same values
    passed unstaged, for blocks of 1 channel and more and 1-3 threads, training and eval."""
    w, b, rm, rv, plain, staged = staged_batch_norm_case(kind, shape, seed=7)

    with npnorm.use_kernels("numba"):
        for training in (True, False):
            want = batch_norm_results(*plain, w, b, rm, rv, training)
            # (span 0: any channels by blocks; 1 MB: these copied whole, as short channels are,
            # but (7, 3), whose one value per channel and sample goes by blocks of rows)
            for threads, span in [(1, 0), (2, 0), (3, 0), (2, 1 << 20)]:
                _threads.set_num_threads(threads)
                monkeypatch.setattr(numba_channels, "STAGED_SPAN_BYTES", span)
                monkeypatch.setattr(_staging, "STAGE_BYTES", 64)  # 1 channel a block
                got = batch_norm_results(*staged, w, b, rm, rv, training)
                monkeypatch.undo()
                assert_staged_as_unstaged(got, want, f"{threads} {span}")


@pytest.mark.parametrize(
    "shape, dtype, blocks",
    [
        ((2, 3, 1024), "float16", True),
        ((2, 3, 256), "float32", True),
        ((64, 4), "float16", False),
        ((8, 3, 100), "float16", False),
    ],
)
def test_staged_batch_norm_takes_blocks_of_channels_of_1kb_a_sample(shape, dtype, blocks, monkeypatch):
    """Channels of 1 KB a sample and more go by blocks of channels; shorter ones are
    copied whole (by blocks, float16 BatchNorm1d (262144, 4) took 46 ms, whole 7-9)."""
    calls = []
    real = numba_channels._by_channel_blocks
    monkeypatch.setattr(numba_channels, "_by_channel_blocks", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(dtype)
    x.flags.writeable = False  # (staged whatever the dtype)
    with npnorm.use_kernels("numba"):
        f = F.batch_norm_forward(x, None, None, training=True)
        F.batch_norm_backward(x, x, f[1], f[2], training=True)
    assert calls == ([1, 1] if blocks else [])


@pytest.mark.parametrize("layout", ["C", "channels_last", "batch_norm1d"])
def test_staged_batch_norm_needs_no_copy_of_the_input(layout, restore_threads, monkeypatch):
    """float16 BatchNorm was staged as float32 copies of the whole input and output
    (forward) or input, gradient and dx (backward): 4-6x the input's bytes on top of the
    result. In blocks of channels (or of rows, for one value per channel and sample:
    channels-last input, BatchNorm1d) it needs a few blocks' scratch per thread; the
    backward of rows also keeps its spans' partial sums per channel and SPAN samples: two
    float64 and a float32 (sum(x - mean)), 0.16x of this float16 input (0.22x in all
    before that third came in, 0.25x now)."""
    _threads.set_num_threads(2)
    rng = np.random.default_rng(1)
    shape = (8 * 64 * 64, 64) if layout == "batch_norm1d" else (8, 64, 64, 64)
    x = laid_out(rng.normal(size=shape).astype(np.float16), layout)
    dy = laid_out(rng.normal(size=x.shape).astype(np.float16), layout)
    with npnorm.use_kernels("numba"):
        f = F.batch_norm_forward(x, None, None, training=True)  # (compiled before measuring)
        F.batch_norm_backward(dy, x, f[1], f[2], training=True)
        monkeypatch.setattr(_staging, "STAGE_BYTES", 1 << 16)
        for step in ("forward", "backward"):
            tracemalloc.start()
            if step == "forward":
                F.batch_norm_forward(x, None, None, training=True)
            else:
                F.batch_norm_backward(dy, x, f[1], f[2], training=True)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            limit = 0.3 if step == "backward" and layout != "C" else 0.25
            assert peak - x.nbytes < limit * x.nbytes, (step, peak / x.nbytes)


@pytest.mark.parametrize("kind", ["float16", "read-only", "float64 weight", "byte-swapped"])
@pytest.mark.parametrize(
    "shape, channels_last", [((300, 5), False), ((6, 5, 7, 8), True), ((129, 2, 1, 1), False)]
)
def test_batch_norm_of_one_value_per_channel_staged_by_rows_as_unstaged(
    kind, shape, channels_last, restore_threads, monkeypatch
):
    """Staged BatchNorm input with one value per channel and sample (BatchNorm1d's (N, C),
    channels-last input's (N*S, C) rows) was copied whole into float32 with its output
    (float16: 8x the input's bytes at peak). It goes by blocks of rows
    (``numba_channels._staged_rows``): bitwise the results of the same values passed
    unstaged, for blocks of one span of rows and more, 1-3 threads taking the spans,
    training and eval."""
    layout = "channels_last" if channels_last else "C"
    w, b, rm, rv, plain, staged = staged_batch_norm_case(kind, shape, seed=3, layout=layout)
    calls = []
    real = numba_channels._staged_rows

    with npnorm.use_kernels("numba"):
        for training in (True, False):
            want = batch_norm_results(*plain, w, b, rm, rv, training)
            for threads, stage in [(1, 64), (2, 64), (3, 64), (2, 1 << 12)]:  # (a span of rows a block, more)
                _threads.set_num_threads(threads)
                monkeypatch.setattr(_staging, "STAGE_BYTES", stage)
                monkeypatch.setattr(_staging, "MIN_PARALLEL", 1)  # (the threads split even these)
                monkeypatch.setattr(numba_channels, "_staged_rows", lambda *a: calls.append(1) or real(*a))
                got = batch_norm_results(*staged, w, b, rm, rv, training)
                monkeypatch.undo()
                assert_staged_as_unstaged(got, want, f"{threads} {stage}")
                if channels_last:
                    assert np.moveaxis(got[0], 1, -1).flags.c_contiguous  # (the layout kept)
    assert calls


# a running mean of 0.0292 from terms of 0.34 (see compare): the tolerance lacked them
RUNNING_MEAN_FROM_LARGER_TERMS = {
    "kind": "instance",
    "x": np.array([[[3.0, 4.0, 4.0]]], np.float16),
    "dy": np.zeros((1, 1, 3), np.float16),
    "w": None,
    "b": None,
    "threads": 1,
    "small": False,
    "training": True,
    "momentum": 0.1,
    "eps": 1e-05,
    "rm": np.array([-0.375], np.float32),
    "rv": np.array([1.0], np.float32),
}


def _running_mean_of_rounded_means() -> dict:
    """InstanceNorm whose (sample, channel) means 0, 1 and -16/15 (float32: rounded) average
    to a running mean of -0.0022 (see ``compare``)."""
    x = np.zeros((3, 2, 3, 5), np.float32)
    x[1, 1, 2] = [0, 3, 4, 4, 4]
    x[2, 1, 2] = [0, -4, -4, -4, -4]
    return {
        **RUNNING_MEAN_FROM_LARGER_TERMS,
        "x": x,
        "dy": np.zeros_like(x),
        "rm": np.zeros(2, np.float32),
        "rv": np.ones(2, np.float32),
    }


@settings(max_examples=150)
@given(p=problems("instance"))
@example(p=RUNNING_MEAN_FROM_LARGER_TERMS)
@example(p=_running_mean_of_rounded_means())
@example(p=long_channels_in_eval("instance"))
def test_instance_norm(p):
    x, dy, w, b, rm, rv = p["x"], p["dy"], p["w"], p["b"], p["rm"], p["rv"]
    use_input_stats = p["training"]
    if use_input_stats and int(np.prod(x.shape[2:])) <= 1:
        x, dy = _two_values(x, dy, -1)
        p = {**p, "x": x, "dy": dy}
    ct = compute_dtype(x, w, b, rm, rv)
    f, _ = compare(
        ("instance_norm_forward", "instance_norm_backward"),
        (x, rm, rv, w, b, use_input_stats, p["momentum"], p["eps"]),
        lambda r: (dy, x, r[1], r[2], w, b, use_input_stats),
        p,
        ct,
    )
    assert f[1].shape == (x.shape[:2] if use_input_stats else x.shape[1:2])


@settings(max_examples=150)
@given(p=problems("group"))
def test_group_norm(p):
    x, dy, w, b, g = p["x"], p["dy"], p["w"], p["b"], p["groups"]
    ct = compute_dtype(x, w, b)
    f, _ = compare(
        ("group_norm_forward", "group_norm_backward"),
        (x, g, w, b, p["eps"]),
        lambda r: (dy, x, g, r[1], r[2], w, b),
        p,
        ct,
    )
    assert f[1].shape == f[2].shape == (x.shape[0], g)


# --- sizes, threads, determinism -------------------------------------------------------


def _all_results(x, dy, w, b, threads):
    """Every compiled forward and backward on (N, C, H, W) data, as one flat list, on
    ``threads`` threads (the other settings as they are)."""
    with config(threads, small=False):
        return _every_op(x, dy, w, b)


def _every_op(x, dy, w, b):
    out = []
    for op, fwd_args, bwd_args in op_calls(x, dy, w, b, 4):
        f = family_kernel(op + "_forward", "numba")(xp, *fwd_args)
        out += [*f, *family_kernel(op + "_backward", "numba")(xp, *bwd_args(f))]
    return [a for a in out if a is not None]


@pytest.mark.parametrize("layout", ["C", "F", "sliced", "channels_last", "read-only"])
def test_inputs_under_the_threshold_run_in_the_calling_thread(layout, monkeypatch):
    """Every operation, forward and backward, on inputs of fewer than ``2*MIN_PARALLEL``
    values runs in the calling thread whatever its layout, dtype and staging (staged in
    small blocks here): no call hands tasks to the pool. (Staged BatchNorm rows of one
    value per channel counted whole spans of 64 rows, 9216 values for these 6240, and
    split.) An input of ``2*MIN_PARALLEL`` values does split."""
    split: list[int] = []

    def counting(tasks):
        if len(tasks) > 1:
            split.append(len(tasks))
        return _threads.run_parallel(tasks)

    monkeypatch.setattr(_staging, "run_parallel", counting)
    rng = np.random.default_rng(12)
    with config(2, small=False, stage_bytes=64):
        _staging.MIN_PARALLEL = 4096  # (restored by config): calls split from 8192 values
        for shape in [(130, 48), (100, 81), (2, 4, 1023), (3, 5, 7, 77)]:
            for dtype in ("float16", "float32", "float64"):
                x = laid_out((rng.normal(size=shape) * 3 + 1).astype(dtype), layout.replace("read-only", "C"))
                x.flags.writeable = layout != "read-only"
                dy = rng.normal(size=shape).astype(dtype)
                w, b = np.ones(shape[-1], dtype), np.zeros(shape[-1], dtype)
                for op, fwd_args, bwd_args in op_calls(x, dy, w, b, 1):
                    if op == "instance_norm" and x.ndim < 3:  # (one value per instance)
                        continue
                    f = family_kernel(op + "_forward", "numba")(xp, *fwd_args)
                    family_kernel(op + "_backward", "numba")(xp, *bwd_args(f))
                    assert not split, (shape, dtype, op, split)
        x = rng.normal(size=(2, 4096)).astype(np.float32)
        family_kernel("layer_norm_forward", "numba")(xp, x, (4096,), None, None, 1e-5)
        assert split == [2]


def test_c_ordered_calls_skip_staging(monkeypatch):
    """An input C-ordered in the computation dtype goes to the loops as it is, every
    operation forward and backward: no staging (``Source``), each thread's rows in one
    call, and no split over the threads (``run_parallel``) under MIN_PARALLEL values. The
    results are those of the same loops staged in tiny blocks at the same thread count
    (bitwise: LayerNorm's and RMSNorm's dweight and dbias are summed per thread); a
    Fortran-ordered input of the same size takes the staged path."""
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(2, 4, 3, 5)) * 3 + 7).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w, b = np.linspace(0.5, 1.5, 5).astype(np.float32), np.linspace(-1, 1, 5).astype(np.float32)
    sources = []

    class Spy(_staging.Source):
        def __init__(self, *args, **kwargs):
            sources.append(1)
            super().__init__(*args, **kwargs)

    with monkeypatch.context() as m:  # the expected results: the same values, staged
        for module in (numba_rows, numba_channels):
            m.setattr(module, "Source", Spy)
        with config(1, small=True):  # in tiny blocks
            staged = _every_op(laid_out(x, "sliced"), dy, w, b)
        with config(2, small=True):  # and split over two threads
            staged_split = _every_op(laid_out(x, "sliced"), dy, w, b)
    assert len(sources) >= 2 * 2 * 5  # every op, forward and backward, staged both times
    splits = []

    def refuse(*args, **kwargs):
        raise AssertionError("staged")

    def count(tasks):
        splits.append(len(tasks))
        return [t() for t in tasks]

    for module in (numba_rows, numba_channels):
        monkeypatch.setattr(module, "Source", refuse)
    monkeypatch.setattr(_staging, "run_parallel", count)
    direct = _all_results(x, dy, w, b, 2)  # small: no split
    assert splits == [] and len(direct) == len(staged)
    for a, c in zip(direct, staged, strict=True):
        np.testing.assert_array_equal(a, c)
    with config(2, small=True):  # MIN_PARALLEL = 1: every call split in two
        direct_split = _every_op(x, dy, w, b)
    assert splits and set(splits) == {2}
    for a, c in zip(direct_split, staged_split, strict=True):
        np.testing.assert_array_equal(a, c)
    with pytest.raises(AssertionError, match="staged"):
        _all_results(np.asfortranarray(x), dy, w, b, 2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["C", "F"])
def test_bitwise_reproducible_for_a_thread_count(dtype, layout):
    """Large enough for several threads with the default settings (no shrinking): the
    same input gives bitwise the same results at a fixed thread count, and results to
    rounding across counts."""
    rng = np.random.default_rng(3)
    x = laid_out((rng.normal(size=(8, 16, 32, 300)) * 3 + 7).astype(dtype), layout)
    dy = laid_out(rng.normal(size=x.shape).astype(dtype), layout)
    w = rng.uniform(0.5, 1.5, 300).astype(dtype)
    b = rng.normal(size=300).astype(dtype)
    before = _threads.get_num_threads()
    try:
        runs = {t: [_all_results(x, dy, w, b, t), _all_results(x, dy, w, b, t)] for t in (1, 2, 3)}
    finally:
        _threads.set_num_threads(before)
    for first, second in runs.values():
        for a, c in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, c)
    rtol = 1e-11 if dtype == "float64" else 2e-5
    for a, c in zip(runs[2][0], runs[1][0], strict=True):
        np.testing.assert_allclose(a, c, rtol=rtol, atol=rtol * max(1.0, float(np.abs(c).max())))


def test_parallel_split_and_blocks():
    """The same results with the default settings, staged in tiny blocks (x Fortran-ordered,
    copied sample by sample; dy float16, converted block by block), and split over three
    threads with no serial threshold."""
    rng = np.random.default_rng(5)
    x = np.asfortranarray(rng.normal(size=(6, 8, 5, 12)).astype(np.float32))
    dy = rng.normal(size=x.shape).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 12).astype(np.float32)
    b = rng.normal(size=12).astype(np.float32)
    base = _all_results(x, dy, w, b, 1)
    with config(3, small=True):
        assert _staging.Source(x, 6, 8, (5, 12), np.dtype(np.float32)).direct is None  # staged
        split = _all_results(x, dy, w, b, 3)
    for a, c in zip(split, base, strict=True):
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(c).max())))


@st.composite
def fortran_blocks(draw: st.DrawFn) -> np.ndarray:
    """An (n, L) block whose columns are contiguous, as the staging meets them: rows of a
    Fortran-ordered array (all of it, or a part) whose columns lie 4 KiB apart (a
    power-of-two number of rows) or not, its columns every one, every other or reversed,
    writable or not, float16/32/64; any bits (NaNs with payloads, infinities, -0.0)."""
    dtype = np.dtype(draw(st.sampled_from(["float16", "float32", "float64"])))
    n, L = draw(st.integers(2, 40)), draw(st.integers(2, 40))
    rows = draw(st.sampled_from([n, n + 3, _blocks.ALIASING_BYTES // dtype.itemsize]))  # the array's
    start = draw(st.integers(0, rows - n))
    step = draw(st.sampled_from([1, 2, -1]))
    bits = draw(hnp.arrays(np.dtype(f"u{dtype.itemsize}"), (n, abs(step) * L)))
    full = np.zeros((rows, abs(step) * L), bits.dtype, order="F")
    full[start : start + n] = bits
    block = full.view(dtype)[start : start + n, ::step][:, :L]
    block.flags.writeable = draw(st.booleans())
    return block


@given(block=fortran_blocks())
def test_fortran_blocks_take_the_transposing_copy(block):
    """A block of a Fortran-ordered input staged into C-ordered scratch of its dtype goes
    through the compiled transposing copy where its columns lie a multiple of 4 KiB apart
    (NumPy's copy took 7-14x its time there), else through NumPy's; a float16 block into
    float32 scratch through it wherever they lie (its bits, then the compiled cast); bit
    for bit NumPy's values."""
    from unittest import mock

    from npnorm.kernels import _numba_loops as loops

    half = block.dtype == np.float16
    dst = np.empty(block.shape, np.float32 if half else block.dtype)
    with mock.patch.object(loops, "transpose_into", wraps=loops.transpose_into) as spy:
        _staging.cast_into(dst, block)
    assert spy.call_count == (half or block.strides[1] % 4096 == 0)
    uint = f"u{dst.itemsize}"
    np.testing.assert_array_equal(dst.view(uint), block.astype(dst.dtype).view(uint))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", FLOATS)
def test_fortran_ordered_rows_as_c_ordered(dtype, threads):
    """LayerNorm and RMSNorm on a Fortran-ordered input and gradient (a pandas frame's
    ``.values``) of 1024 rows, staged in blocks of a few rows through the transposing
    copy (float16: of its bits, then cast), the last block a part one, split over the
    threads with no serial threshold: bitwise the C-ordered call's results, dweight and
    dbias too."""
    rng = np.random.default_rng(12)
    x = (rng.normal(size=(1024, 29)) * 3 + 7).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    w, b = rng.uniform(0.5, 1.5, 29).astype(dtype), rng.normal(size=29).astype(dtype)

    def results(x, dy):
        with config(threads, small=True, stage_bytes=29 * 8 * 13):  # 13 float64 rows, 26 of float32 or 16
            y, mean, rstd = family_kernel("layer_norm_forward", "numba")(xp, x, (29,), w, b, 1e-5)
            ln = family_kernel("layer_norm_backward", "numba")(xp, dy, x, (29,), mean, rstd, w, b)
            z, r = family_kernel("rms_norm_forward", "numba")(xp, x, (29,), w, 1e-6)
            rms = family_kernel("rms_norm_backward", "numba")(xp, dy, x, (29,), r, w)
        return [y, mean, rstd, *ln, z, r, *rms]

    from unittest import mock

    from npnorm.kernels import _numba_loops as loops

    expected = results(x, dy)
    with mock.patch.object(loops, "transpose_into", wraps=loops.transpose_into) as spy:
        fortran = results(np.asfortranarray(x), np.asfortranarray(dy))
    assert spy.call_count >= 2 * 1024 // 26  # (every block of x, and of dy in the backwards)
    for a, e in zip(fortran, expected, strict=True):
        if e is not None:
            np.testing.assert_array_equal(a, e)


def check_pipeline(x: np.ndarray, dy: np.ndarray, groups: int, threads: int) -> None:
    """BatchNorm, GroupNorm, InstanceNorm (x (N, C, S); BatchNorm's and InstanceNorm's
    training and running-statistics modes) and LayerNorm, RMSNorm (over S), split over
    ``threads``: as the reference to rounding, and bitwise the same as in one thread with
    the default blocks (all but LayerNorm/RMSNorm's dweight and dbias, summed per thread);
    and the same split with x and dy strided, so staged in blocks of 64 bytes (one row each
    for rows longer than that: the pipeline fills again at every row): bitwise as the
    unstaged split, dweight and dbias too."""
    dtype = x.dtype
    C, S = x.shape[1], x.shape[2]
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    b = np.linspace(-1, 1, C).astype(dtype)
    wS = np.linspace(0.5, 1.5, S).astype(dtype)  # LayerNorm/RMSNorm over the last axis
    bS = np.linspace(-1, 1, S).astype(dtype)
    rm, rv = np.zeros(C, dtype), np.ones(C, dtype)
    em, ev = np.linspace(6, 8, C).astype(dtype), np.linspace(1, 3, C).astype(dtype)  # running statistics
    p = {"x": x, "dy": dy, "threads": threads, "small": True}
    calls = [
        ("batch_norm", w, (x, rm, rv, w, b, True, 0.1, 1e-5), lambda f: (dy, x, f[1], f[2], w, b, True)),
        ("batch_norm", w, (x, em, ev, w, b, False, 0.1, 1e-5), lambda f: (dy, x, f[1], f[2], w, b, False)),
        ("instance_norm", w, (x, em, ev, w, b, False, 0.1, 1e-5), lambda f: (dy, x, *f[1:3], w, b, False)),
        ("group_norm", w, (x, groups, w, b, 1e-5), lambda f: (dy, x, groups, f[1], f[2], w, b)),
        ("instance_norm", w, (x, rm, rv, w, b, True, 0.1, 1e-5), lambda f: (dy, x, f[1], f[2], w, b, True)),
        ("layer_norm", wS, (x, (S,), wS, bS, 1e-5), lambda f: (dy, x, (S,), f[1], f[2], wS, bS)),
        ("rms_norm", wS, (x, (S,), wS, None), lambda f: (dy, x, (S,), f[1], wS)),
    ]
    for op, weight, fwd_args, bwd_args in calls:
        if (op == "instance_norm" and S == 1 and fwd_args[5]) or (op == "batch_norm" and x.shape[0] * S == 1):
            continue  # one value per (sample, channel) row, or per channel: no batch statistics
        ops = (op + "_forward", op + "_backward")
        bias = b if weight is w else bS  # (RMSNorm has none: bS only widens its output's scale)
        split_f, split_b = compare(ops, fwd_args, bwd_args, {**p, "w": weight, "b": bias}, dtype)
        ref_f = generic_kernel(ops[0])(xp, *fwd_args)  # compare's backward ran from these
        with config(1, small=False):
            one_f = family_kernel(ops[0], "numba")(xp, *fwd_args)
            one_b = family_kernel(ops[1], "numba")(xp, *bwd_args(ref_f))
        grads = 1 if op in ("layer_norm", "rms_norm") else len(one_b)
        for a, c in zip([*split_f, *split_b[:grads]], [*one_f, *one_b[:grads]], strict=True):
            np.testing.assert_array_equal(a, c, err_msg=op)
        xs, dys = laid_out(x, "sliced"), laid_out(dy, "sliced")
        swap = {id(x): xs, id(dy): dys}
        with config(threads, small=True):
            src = _staging.Source(xs, 1, xs.shape[0] * xs.shape[1], (S,), np.dtype(dtype))
            if not xs.flags.c_contiguous:  # (a single value is)
                assert src.direct is None
            staged_f = family_kernel(ops[0], "numba")(xp, *(swap.get(id(a), a) for a in fwd_args))
            staged_b = family_kernel(ops[1], "numba")(xp, *(swap.get(id(a), a) for a in bwd_args(ref_f)))
        for a, c in zip([*staged_f, *staged_b], [*split_f, *split_b], strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"{op}, staged")


def rounding(dtype: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Values whose sums round, so that summing them in another order shows."""
    return (np.sin(np.arange(math.prod(shape))) * scale).reshape(shape).astype(dtype)


@settings(max_examples=60)
@given(
    dtype=st.sampled_from(("float32", "float64")),
    n=st.integers(1, 5),
    groups=st.integers(1, 3),
    k=st.integers(1, 3),
    S=st.sampled_from((1, 255, 256, 257, 600)),
    threads=st.sampled_from((2, 3)),
    data=st.data(),
)
def test_pipeline_chunks_and_splits(dtype, n, groups, k, S, threads, data):
    """The row loops visit a row in chunks of ``CHUNK`` values and take the next rows' sums
    along (a pipeline that fills again wherever a thread's rows or a staged block begin):
    BatchNorm's channels (N rows each), GroupNorm/InstanceNorm channels, and
    LayerNorm/RMSNorm rows, shorter than, equal to and longer than a chunk, 1 to 45 rows
    (``check_pipeline``)."""
    from npnorm.kernels import _numba_loops as loops

    assert loops.CHUNK == 256  # the sizes drawn above straddle it
    shape = (n, groups * k, S)
    # (too large to draw value by value: rounding() spreads the values)
    x = data.draw(values(dtype, shape, each=False)) * np.asarray(3, dtype) + np.asarray(7, dtype)
    dy = data.draw(values(dtype, shape, each=False))
    # plus values whose sums round (drawn values are often exact in any order)
    check_pipeline(x + rounding(dtype, shape, 1 / 3), dy + rounding(dtype, shape, 1 / 7), groups, threads)


@pytest.mark.parametrize("threads", [2, 3])
def test_pipeline_split_does_not_change_sums(threads):
    """Rows of several chunks in float64 (whose sums round, unlike float32 values summed in
    float64), split over threads: every thread's first rows are summed in the same chunk
    order as in one thread (``check_pipeline``; drawn cases reach this only sometimes)."""
    shape = (4, 3, 600)
    x = 7 + rounding("float64", shape, 3.0)
    dy = np.cos(np.arange(math.prod(shape))).reshape(shape) / 7
    check_pipeline(x, dy, 3, threads)


@settings(max_examples=40)
@given(
    dtype=st.sampled_from(("float32", "float64")),
    n=st.integers(1, 4),
    groups=st.integers(1, 3),
    k=st.integers(1, 4),
    S=st.sampled_from((1, 7, 49, 255, 256, 257, 600)),
    threads=st.sampled_from((1, 2, 3)),
    layout=st.sampled_from(("C", "sliced")),
    data=st.data(),
)
def test_short_group_rows_one_at_a_time_as_the_pipeline(dtype, n, groups, k, S, threads, layout, data):
    """GroupNorm's and InstanceNorm's backward on short rows runs ``group_backward_short``
    (one row at a time, no pipeline): bitwise the pipelined ``group_backward``'s dx,
    dweight and dbias, rows shorter and longer than a chunk, split over threads, staged
    in blocks (``sliced``) or not."""
    shape = (n, groups * k, S)
    # (too large to draw value by value: rounding() spreads the values)
    x = data.draw(values(dtype, shape, each=False)) * np.asarray(3, dtype) + np.asarray(7, dtype)
    x = x + rounding(dtype, shape, 1 / 3)  # plus values whose sums round
    dy = data.draw(values(dtype, shape, each=False)) + rounding(dtype, shape, 1 / 7)
    w = np.linspace(0.5, 1.5, groups * k).astype(dtype)
    b = np.linspace(-1, 1, groups * k).astype(dtype)
    _, mean, rstd = generic_kernel("group_norm_forward")(xp, x, groups, w, b, 1e-5)
    x, dy = laid_out(x, layout), laid_out(dy, layout)
    backward = family_kernel("group_norm_backward", "numba")
    results = {}
    for short in (True, False):
        with pytest.MonkeyPatch.context() as mp, config(threads, small=True):
            mp.setattr(numba_channels, "_short_rows", lambda L, S, ct, short=short: short)
            results[short] = backward(xp, dy, x, groups, mean, rstd, w, b)
    for a, c in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(a, c)


def _errors_by_row(dx, dx64, rows):
    """Each row's largest error of ``dx`` against ``dx64``, relative to the row's largest
    value of ``dx64`` (``rows`` rows in C order)."""
    got, truth = np.reshape(dx, (rows, -1)).astype(np.float64), np.reshape(dx64, (rows, -1))
    return np.abs(got - truth).max(axis=1) / np.abs(truth).max(axis=1)


@pytest.mark.parametrize("threads", [1, 3])
def test_layer_norm_rows_near_and_far_from_zero_side_by_side(restore_threads, threads):
    """LayerNorm's backward takes a row's ``sum(x - mean)``, which centres xhat again for
    dx and dweight, only on the rows far from 0 (``loops._far_from_zero``), for the row
    the pipeline sums, not the one it writes: rows 1e4 from 0 beside rows near it, every
    row's float32 dx off the float64 one by float32 rounding only (not centred again, up
    to 7e-5 of a row here), and dweight too (not centred again, 2e-4 of it)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(12, 48))
    dy = rng.normal(size=x.shape).astype(np.float32)
    x[[1, 2, 5, 6, 9, 10]] += 1e4  # far, near, far and near neighbours both ways
    x = x.astype(np.float32)
    w, b = np.linspace(0.5, 1.5, 48), np.zeros(48)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _, mean64, rstd64 = generic_kernel("layer_norm_forward")(xp, x64, (48,), w, b, 1e-5)
    dx64, dw64, _ = generic_kernel("layer_norm_backward")(xp, dy64, x64, (48,), mean64, rstd64, w, b)
    _threads.set_num_threads(threads)
    w32, b32 = w.astype(np.float32), b.astype(np.float32)
    with npnorm.use_kernels("numba"):
        _, mean, rstd = F.layer_norm_forward(x, 48, w32, b32)
        dx, dw, _ = F.layer_norm_backward(dy, x, 48, mean, rstd, w32, b32)
    assert np.all(_errors_by_row(dx, dx64, 12) <= 3e-7)
    assert np.abs(dw - dw64).max() / np.abs(dw64).max() <= 3e-7


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("short", [True, False])
def test_group_rows_near_and_far_from_zero_side_by_side(monkeypatch, restore_threads, short, threads):
    """GroupNorm's row loops take a row's ``sum(x - mean)``, which centres xhat again,
    only on the rows far from 0 (``loops._far_from_zero``), row by row, and the pipeline
    (``short=False``) for the row it sums, not the one it writes: here (sample, group)
    rows 1e4 from 0 alternate with rows near it, and every row's float32 dx is off the
    float64 one by float32 rounding only (not centred again, 2e-6 to 1e-4 of the row)."""
    from npnorm.kernels import _numba_loops as loops

    N, C, G = 4, 8, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, C, 5, 5))
    dy = rng.normal(size=x.shape).astype(np.float32)
    for n in range(N):
        for g in range(G):
            x[n, 2 * g : 2 * g + 2] += 1e4 * ((n + g) % 2)
    x = x.astype(np.float32)
    w = np.linspace(0.5, 1.5, C)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _, mean64, rstd64 = generic_kernel("group_norm_forward")(xp, x64, G, w, None, 1e-5)
    dx64 = generic_kernel("group_norm_backward")(xp, dy64, x64, G, mean64, rstd64, w, None)[0]
    _threads.set_num_threads(threads)
    monkeypatch.setattr(numba_channels, "_short_rows", lambda L, S, ct: short)
    monkeypatch.setattr(loops, "LONG_ROWS_ALONE", False)  # (short=False: the pipeline)
    w32 = w.astype(np.float32)
    with npnorm.use_kernels("numba"):
        _, mean, rstd = F.group_norm_forward(x, G, w32)
        dx = F.group_norm_backward(dy, x, G, mean, rstd, w32)[0]
    assert np.all(_errors_by_row(dx, dx64, N * G) <= 3e-7)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("spatial", [(16, 20), (6, 6), ()])
def test_batch_norm_channels_near_and_far_from_zero_side_by_side(restore_threads, spatial, threads):
    """BatchNorm's backward takes a channel's ``sum(x - mean)`` only on the channels far
    from 0, channel by channel, in the channel loops (320 values per sample: the pipeline,
    for the channel it sums), the blocks of short channels (36) and across the channels
    (one value): channels 1e4 from 0 beside channels near it, each channel's float32 dx
    off the float64 one by float32 rounding only (not centred again, 1e-6 to 1e-5)."""
    N, C = 8, 8
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, C, *spatial))
    dy = rng.normal(size=x.shape).astype(np.float32)
    x[:, [1, 2, 5, 6]] += 1e4  # far, near, far and near neighbours both ways
    x = x.astype(np.float32)
    w = np.linspace(0.5, 1.5, C)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _, mean64, rstd64, _, _ = generic_kernel("batch_norm_forward")(
        xp, x64, None, None, w, None, True, 0.1, 1e-5
    )
    dx64 = generic_kernel("batch_norm_backward")(xp, dy64, x64, mean64, rstd64, w, None, True)[0]
    _threads.set_num_threads(threads)
    w32 = w.astype(np.float32)
    with npnorm.use_kernels("numba"):
        _, mean, rstd, _, _ = F.batch_norm_forward(x, None, None, w32, None, True, 0.1, 1e-5)
        dx = F.batch_norm_backward(dy, x, mean, rstd, w32, None, True)[0]
    errors = _errors_by_row(np.moveaxis(dx, 1, 0), np.moveaxis(dx64, 1, 0), C)  # by channel
    assert np.all(errors <= 3e-7), errors


@pytest.mark.parametrize("alone", [True, False])
def test_short_group_rows_rule(monkeypatch, alone):
    """Which backward loop GroupNorm and InstanceNorm rows go to: short rows of short
    channels one at a time, the others pipelined (see ``numba_channels._short_rows``),
    but where the forward takes long rows alone (AMD hosts: ``LONG_ROWS_ALONE``), rows of
    ``LONG_FORWARD_ROW`` values and more one at a time too."""
    from npnorm.kernels import _numba_loops as loops

    assert loops.LONG_FORWARD_ROW == 256  # the cases below straddle it
    monkeypatch.setattr(loops, "LONG_ROWS_ALONE", alone)
    called = recorded_loops(monkeypatch, "group_backward", "group_backward_short")
    long = "group_backward_short" if alone else "group_backward"  # rows of 256 values and more
    cases = [
        ((2, 4, 7, 7), 4, "float32", "group_backward_short"),  # InstanceNorm 7x7
        ((2, 32, 7, 7), 2, "float32", "group_backward_short"),  # 16 channels of 7x7: 3 KB rows
        ((2, 4, 14, 14), 4, "float64", "group_backward"),  # channels of 1.5 KB, rows of 196
        ((1, 1, 15, 17), 1, "float64", "group_backward"),  # rows of 255
        ((1, 2, 16, 16), 2, "float64", long),  # rows of 256
        ((1, 2, 30, 30), 2, "float32", long),  # channels of 3.5 KB
        ((1, 32, 14, 14), 2, "float32", long),  # rows of 12.5 KB
    ]
    rng = np.random.default_rng(5)
    for shape, groups, dtype, expected in cases:
        x = rng.normal(size=shape).astype(dtype)
        _, mean, rstd = F.group_norm_forward(x, groups)
        called.clear()
        dx = F.group_norm_backward(x, x, groups, mean, rstd)[0]
        assert set(called) == {expected}, (shape, groups, dtype, called)
        ref = generic_kernel("group_norm_backward")(xp, x, x, groups, mean, rstd, None, None)[0]
        np.testing.assert_allclose(dx, ref, rtol=1e-4 if dtype == "float32" else 1e-10, atol=1e-5)


@settings(max_examples=40)
@given(
    dtype=st.sampled_from(("float32", "float64")),
    n=st.integers(1, 4),
    groups=st.integers(1, 3),
    k=st.integers(1, 3),
    S=st.sampled_from((1, 7, 85, 255, 256, 257, 600)),
    threads=st.sampled_from((1, 2, 3)),
    layout=st.sampled_from(("C", "sliced")),
    data=st.data(),
)
def test_long_rows_one_at_a_time_as_the_pipeline(dtype, n, groups, k, S, threads, layout, data):
    """LayerNorm's and GroupNorm's forward loops for long rows (one row at a time, no
    pipeline: ``layer_norm_forward_long``, ``group_forward_long``) give bitwise the
    pipelined loops' y, mean and rstd, whichever loop the rows would go to, split over
    threads, staged in blocks (``sliced``) or not."""
    from npnorm.kernels import _numba_loops as loops

    shape = (n, groups * k, S)
    # (too large to draw value by value: rounding() spreads the values)
    x = data.draw(values(dtype, shape, each=False)) * np.asarray(3, dtype) + np.asarray(7, dtype)
    x = laid_out(x + rounding(dtype, shape, 1 / 3), layout)  # plus values whose sums round
    w = np.linspace(0.5, 1.5, groups * k).astype(dtype)
    b = np.linspace(-1, 1, groups * k).astype(dtype)
    wS, bS = np.linspace(0.5, 1.5, S).astype(dtype), np.linspace(-1, 1, S).astype(dtype)
    calls = [("group_norm_forward", (x, groups, w, b, 1e-5)), ("layer_norm_forward", (x, (S,), wS, bS, 1e-5))]
    for op, args in calls:
        results = {}
        for long_row in (1, 1 << 30):  # every row long, none
            with pytest.MonkeyPatch.context() as mp, config(threads, small=True):
                mp.setattr(loops, "LONG_ROWS_ALONE", True)  # (the AMD hosts' rule)
                mp.setattr(loops, "LONG_FORWARD_ROW", long_row)
                results[long_row] = family_kernel(op, "numba")(xp, *args)
        for a, c in zip(results[1], results[1 << 30], strict=True):
            np.testing.assert_array_equal(a, c, err_msg=op)


@pytest.mark.parametrize("alone", [True, False])
def test_long_rows_rule(monkeypatch, alone):
    """Which forward loop LayerNorm and GroupNorm rows go to, C-ordered or staged: where
    long rows go alone (AMD hosts), rows of ``LONG_FORWARD_ROW`` values and more one at a
    time and shorter ones pipelined; elsewhere every row pipelined."""
    from npnorm.kernels import _numba_loops as loops

    assert loops.LONG_FORWARD_ROW == 256  # the cases below straddle it
    monkeypatch.setattr(loops, "LONG_ROWS_ALONE", alone)
    names = ("layer_norm_forward", "layer_norm_forward_long", "group_forward", "group_forward_long")
    called = recorded_loops(monkeypatch, *names)
    rng = np.random.default_rng(6)
    cases = [
        (lambda x: F.layer_norm(x, 255), (3, 255), "layer_norm_forward"),
        (lambda x: F.layer_norm(x, 256), (3, 256), "layer_norm_forward_long"),
        (lambda x: F.layer_norm(x, (4, 64)), (2, 4, 64), "layer_norm_forward_long"),  # rows of 256 values
        (lambda x: F.group_norm(x, 4), (2, 4, 7, 7), "group_forward"),  # InstanceNorm's rows of 49
        (lambda x: F.group_norm(x, 2), (2, 4, 8, 16), "group_forward_long"),  # two channels of 128
        (lambda x: F.instance_norm(x), (2, 3, 16, 16), "group_forward_long"),
    ]
    for call, shape, expected in cases:
        if not alone:
            expected = expected.removesuffix("_long")
        for dtype in ("float32", "float64"):
            for layout in ("C", "sliced"):  # run directly, and staged in blocks
                called.clear()
                call(laid_out(rng.normal(size=shape).astype(dtype), layout))
                assert set(called) == {expected}, (shape, dtype, layout, called)


@pytest.mark.parametrize("in_memory_order", [True, False])
def test_batch_norm_forward_loop_rule(monkeypatch, in_memory_order):
    """BatchNorm's training forward of channels of ``CHUNK`` values a sample and more (C-ordered
    or staged in blocks) runs ``channel_forward`` (memory order, AMD processors) or
    ``channel_forward_pipelined`` (elsewhere) as ``CHANNELS_IN_MEMORY_ORDER`` says; short
    channels, the blocks' loop in blocks of ``_channel_block``; with running statistics,
    long channels or short, the blocks' loop with every channel in one block (memory order)."""
    from npnorm.kernels import _numba_loops as loops
    from npnorm.kernels.numba_channels import _channel_block

    monkeypatch.setattr(loops, "CHANNELS_IN_MEMORY_ORDER", in_memory_order)
    names = ("channel_forward", "channel_forward_pipelined", "channel_block_forward")
    called = recorded_loops(monkeypatch, *names, blocks=True)  # the loop, and the blocks' channels
    training_loop = "channel_forward" if in_memory_order else "channel_forward_pipelined"
    rng = np.random.default_rng(8)
    for shape, training, expected in [
        ((2, 3, 16, 16), True, (training_loop, None)),
        ((2, 3, 16, 16), False, ("channel_block_forward", 3)),
        ((3, 4, 255), True, ("channel_block_forward", "short")),
        ((3, 4, 255), False, ("channel_block_forward", 4)),
        ((64, 24, 200), True, ("channel_block_forward", "short")),
        ((64, 24, 200), False, ("channel_block_forward", 24)),  # (training's blocks: 11, 6 channels)
    ]:
        C = shape[1]
        for dtype in ("float32", "float64"):
            want = expected
            if expected[1] == "short":
                want = (expected[0], _channel_block(shape[0], shape[2], np.dtype(dtype)))
            for layout in ("C", "sliced"):
                called.clear()
                x = laid_out(rng.normal(size=shape).astype(dtype), layout)
                F.batch_norm_forward(x, np.zeros(C, dtype), np.ones(C, dtype), training=training)
                assert set(called) == {want}, (shape, training, dtype, layout, called)
    # short channels in training whose spans of samples the threads split: the statistics
    # by spans, then the output alone in one block (blocks of 1 channel here, as ``config``'s)
    x = rng.normal(size=(130, 5, 4))
    with config(2, small=True):
        assert numba_channels._span_parts(130, 5, 4, x.itemsize) == [(0, 1), (1, 3)]
        called.clear()
        F.batch_norm_forward(x, np.zeros(5), np.ones(5), training=True)
    assert set(called) == {("channel_block_forward", 5)}, called


def test_batch_norm_backward_block_rule(monkeypatch):
    """BatchNorm's backward of short channels runs the blocks' loop in blocks of
    ``_channel_block`` channels in training; with running statistics (dx needs no sum)
    channels of ``RUNNING_ROW`` values a sample and more run ``channel_running_backward``,
    shorter ones every channel in one block; long channels run ``channel_backward`` in
    training."""
    from npnorm.kernels.numba_channels import RUNNING_ROW, _channel_block

    assert RUNNING_ROW == 64  # (the shapes below: 63 and 64 values a sample)
    # the loop, and the blocks' channels
    names = ("channel_backward", "channel_running_backward", "channel_block_backward")
    called = recorded_loops(monkeypatch, *names, blocks=True)
    rng = np.random.default_rng(9)
    for shape, training, expected in [
        ((2, 3, 16, 16), True, ("channel_backward", None)),
        ((2, 3, 16, 16), False, ("channel_running_backward", None)),
        ((64, 24, 200), True, ("channel_block_backward", "short")),
        ((64, 24, 200), False, ("channel_running_backward", None)),
        ((64, 60, 40), True, ("channel_block_backward", "short")),
        ((64, 60, 40), False, ("channel_block_backward", 60)),  # (training's blocks: 52, 26 channels)
        ((3, 4, 63), False, ("channel_block_backward", 4)),
        ((3, 4, 64), False, ("channel_running_backward", None)),
        ((64, 5000), False, ("channel_block_backward", 5000)),  # (training's: 2048, 1024 channels)
    ]:
        C = shape[1]
        for dtype in ("float32", "float64"):
            want = expected
            if expected[1] == "short":
                want = (expected[0], _channel_block(shape[0], shape[2], np.dtype(dtype)))
                assert want[1] < C
            if len(shape) == 2:
                assert _channel_block(shape[0], 1, np.dtype(dtype)) < C
            x = rng.normal(size=shape).astype(dtype)
            dy = rng.normal(size=shape).astype(dtype)
            mean, rstd = np.zeros(C, dtype), np.ones(C, dtype)
            for layout in ("C", "sliced"):
                called.clear()
                F.batch_norm_backward(
                    laid_out(dy, layout), laid_out(x, layout), mean, rstd, training=training
                )
                assert set(called) == {want}, (shape, training, dtype, layout, called)
    # a Fortran-ordered input is taken as the (S, C, N) planes of its .T: channels of N values
    for N, expected in ((63, ("channel_block_backward", 3)), (64, ("channel_running_backward", None))):
        x = np.asfortranarray(rng.normal(size=(N, 3, 2, 2)))
        called.clear()
        F.batch_norm_backward(x, x, np.zeros(3), np.ones(3), training=False)
        assert set(called) == {expected}, (N, called)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_running_backward_splits_the_channels_of_wide_shares(monkeypatch, dtype):
    """Where the threads would split the spans of samples, the backward with running
    statistics of channels of ``RUNNING_ROW`` values and more splits the channels instead
    (one pass, ``channel_running_backward``) if each thread's share of a sample's row has
    ``RUNNING_SHARE_BYTES``, else it keeps the spans (``channel_span_dy_sums``); training
    keeps the spans; the results bitwise the same every way, and on one thread."""
    N, C, S = 130, 4, 70  # three spans of samples; rows of 4*70 values
    rng = np.random.default_rng(11)
    offsets = np.array([0.0, 1e3, -5.0, 1e6])[None, :, None]  # channels near 0 and far
    x = (offsets + rng.normal(size=(N, C, S))).astype(dtype)
    dy = rng.normal(size=(N, C, S)).astype(dtype)
    mean = (offsets[0, :, 0] + rng.normal(size=C)).astype(dtype)
    rstd = rng.uniform(0.5, 2.0, size=C).astype(dtype)
    w = np.linspace(-1.5, 1.5, C).astype(dtype)
    called = recorded_loops(monkeypatch, "channel_running_backward", "channel_span_dy_sums", ranges=True)
    results = {}
    for threads, share in ((1, None), (2, C * S * x.itemsize // 2), (2, C * S * x.itemsize // 2 + 1)):
        if share is not None:
            monkeypatch.setattr(numba_channels, "RUNNING_SHARE_BYTES", share)
        for training in (False, True):
            called.clear()
            with config(threads, small=True):
                results[threads, share, training] = F.batch_norm_backward(
                    dy, x, mean, rstd, w, training=training
                )
            if threads == 2:  # the one pass on two ranges of channels, or the spans
                split = not training and share == C * S * x.itemsize // 2
                taken = {name for name, _ in called}
                assert taken == ({"channel_running_backward"} if split else {"channel_span_dy_sums"}), called
                if split:
                    assert sorted(c for _, c in called) == [(0, C // 2), (C // 2, C)], called
    for (threads, share, training), got in results.items():
        for a, b in zip(got, results[1, None, training], strict=True):
            np.testing.assert_array_equal(
                a, b, err_msg=f"{threads} threads, shares {share}, training={training}"
            )


@pytest.mark.parametrize("S", [1, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_channel_block_backward_any_block(dtype, S):
    """``loops.channel_block_backward`` gives bitwise the same dx, dweight and dbias in
    blocks of 1, 3 or all channels, in training and with running statistics, with channels
    near 0 and far from it mixed (the blocks' test whether any is far): each channel's sums
    are added sample by sample in the same order whatever its block."""
    from npnorm.kernels import _numba_loops as loops

    N, C = 70, 7  # more than loops.SPAN samples: two spans
    rng = np.random.default_rng(10)
    offsets = np.array([0.0, 1e3, 0.0, 1e6, 0.0, 0.0, 5e2])  # C: channels near 0 and far
    x = (offsets[:, None] + rng.normal(size=(N, C, S))).astype(dtype)
    dy = rng.normal(size=(N, C, S)).astype(dtype)
    mean = x.mean(axis=(0, 2), dtype=np.float64).astype(dtype)
    rstd = (1 / np.sqrt(x.var(axis=(0, 2), dtype=np.float64) + 1e-5)).astype(dtype)
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    x2, dy2 = x.reshape(N, C * S), dy.reshape(N, C * S)
    for training in (True, False):
        runs = []
        for block in (1, 3, C):
            dx, dw, db = np.empty_like(x2), np.empty(C), np.empty(C)
            loops.channel_block_backward(dy2, x2, mean, rstd, w, training, dx, dw, db, block, 0, C)
            runs.append((dx, dw, db))
        for run in runs[1:]:
            for a, b in zip(run, runs[0], strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"training={training}")


@settings(max_examples=40)
@given(
    dtype=st.sampled_from(("float32", "float64")),
    N=st.integers(0, 140),
    S=st.integers(0, 700),
    offsets=st.lists(st.sampled_from((0.0, 1.0, 1e3, -1e6)), min_size=1, max_size=4),
    special=st.sampled_from((None, np.inf, -np.inf, np.nan)),
    data=st.data(),
)
def test_channel_running_backward_is_channel_backward(dtype, N, S, offsets, special, data):
    """``loops.channel_running_backward`` (the backward with running statistics, one pass
    in memory order) gives bitwise ``loops.channel_backward``'s dx, dweight and dbias with
    ``training`` false, on any range of channels: channels near 0 and far from it (where
    ``channel_backward`` takes a third sum), one to three spans of samples, rows of one
    value to a few chunks, empty ones, and an inf or NaN in x or dy."""
    from npnorm.kernels import _numba_loops as loops

    C = len(offsets)
    c0 = data.draw(st.integers(0, C), label="c0")
    c1 = data.draw(st.integers(c0, C), label="c1")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x = (np.array(offsets)[:, None] + rng.normal(size=(N, C, S))).astype(dtype)  # N,C,S
    dy = rng.normal(size=(N, C, S)).astype(dtype)  # N,C,S
    if special is not None and x.size:
        where = data.draw(st.integers(0, x.size - 1), label="where")
        (x if data.draw(st.booleans(), label="in x") else dy).reshape(-1)[where] = special
    mean = (np.array(offsets) + rng.normal(size=C)).astype(dtype)  # C: running statistics
    rstd = rng.uniform(0.5, 2.0, size=C).astype(dtype)  # C
    w = rng.uniform(-1.5, 1.5, size=C).astype(dtype)  # C
    results = []
    for loop in ("channel_backward", "channel_running_backward"):
        dx, dw, db = np.full_like(x, 7), np.full(C, 7.0), np.full(C, 7.0)  # (7: untouched)
        args = (dy, x, mean, rstd, w) + ((False,) if loop == "channel_backward" else ())
        getattr(loops, loop)(*args, dx, dw, db, c0, c1)
        results.append((dx, dw, db))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=40)
@given(
    dtype=st.sampled_from(("float32", "float64")),
    n=st.integers(1, 4),
    C=st.integers(1, 5),
    S=st.sampled_from((256, 257, 600, 4097)),
    offset=st.sampled_from((0.0, 1e3, 1e6)),
    data=st.data(),
)
def test_batch_norm_training_forwards_agree(dtype, n, C, S, offset, data):
    """BatchNorm's two training forwards (memory order; the channels pipelined): each gives
    bitwise the same results on 1, 2 and 3 threads, copied whole and staged in blocks of
    channels, the statistics of
    both are float64's two-pass ones to float64 rounding (at offsets up to 1e6 times the
    spread too), and their outputs agree to the data's rounding."""
    from npnorm.kernels import _numba_loops as loops

    x = data.draw(values(dtype, (n, C, S), each=False)) + np.asarray(offset, dtype)  # (rounding() spreads it)
    assume(n * S > 1)
    x = x + rounding(dtype, x.shape, 1 / 3)
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    b = np.linspace(-1, 1, C).astype(dtype)
    x64 = x.astype(np.float64)
    true_mean = np.array([math.fsum(x64[:, c].ravel()) / (n * S) for c in range(C)])  # exact sums
    true_var = ((x64 - true_mean[:, None]) ** 2).mean(axis=(0, 2))
    results = {}
    for in_memory_order in (True, False):
        runs = []
        for threads, layout in ((1, "C"), (2, "C"), (3, "C"), (2, "sliced"), (2, "read-only")):
            xl = laid_out(x, layout)
            if layout == "read-only":  # staged in blocks of channels (sliced: copied whole)
                xl = x.copy()
                xl.flags.writeable = False
            with pytest.MonkeyPatch.context() as mp, config(threads, small=True):
                mp.setattr(loops, "CHANNELS_IN_MEMORY_ORDER", in_memory_order)
                rm, rv = np.zeros(C, dtype), np.ones(C, dtype)
                runs.append(F.batch_norm_forward(xl, rm, rv, w, b, training=True))
        for other in runs[1:]:
            for a, c in zip(runs[0], other, strict=True):
                np.testing.assert_array_equal(a, c, err_msg=str(in_memory_order))
        results[in_memory_order] = runs[0]
    spread = np.sqrt(true_var) + np.abs(true_mean) * 1e-12
    # the float64 rounding of the mean, relative to the spread (1e6 against about 1: ~1e-10)
    lost = 64 * np.finfo(np.float64).eps * float(np.max(np.abs(true_mean) / spread))
    tol = (2e-6 if dtype == "float32" else 1e-12) + lost
    # the mean within 2 ulp of the exact one plus rounding on the scale of the values summed
    # (summed unshifted, a mean of 1e6 came out up to 15 ulp off), then rounded to the data's
    # dtype. That scale is the spread, or, for the pipelined loop, which sums each channel
    # shifted by its first value, the values' mean distance from it (larger where the first
    # value is an outlier: 2.5 against a spread of 0.05 in a drawn channel of zeros)
    near = true_mean.astype(dtype).astype(np.float64)
    shifted = np.abs(x64 - x64[0, :, :1]).mean(axis=(0, 2))  # C
    scale = np.maximum(np.sqrt(true_var), shifted)
    mean_tol = 2 * np.spacing(np.abs(true_mean)) + 8 * np.finfo(np.float64).eps * scale
    mean_tol = np.maximum(mean_tol, np.spacing(np.abs(near)))
    for _, mean, rstd, _, _ in results.values():
        assert np.all(np.abs(mean.astype(np.float64) - near) <= mean_tol), (mean - near, mean_tol)
        np.testing.assert_allclose(rstd, (1 / np.sqrt(true_var + 1e-5)).astype(dtype), rtol=tol)
    for a, c in zip(results[True], results[False], strict=True):
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)


@pytest.mark.parametrize("in_memory_order", [True, False])
def test_batch_norm_training_mean_of_a_large_offset(monkeypatch, in_memory_order):
    """Both training forwards take a float64 mean of 1e6 with a spread of 1e-3 within 2 ulp
    of the exact one (the pipelined loop's sum taken unshifted was 15 ulp off, 1.7e-6 of
    the spread, here)."""
    from npnorm.kernels import _numba_loops as loops

    monkeypatch.setattr(loops, "CHANNELS_IN_MEMORY_ORDER", in_memory_order)
    x = 1e6 + 1e-3 * np.random.default_rng(9).standard_normal((64, 8, 4096))
    exact = np.array([math.fsum(x[:, c].ravel()) / x[:, c].size for c in range(8)])
    mean = F.batch_norm_forward(x, np.zeros(8), np.ones(8), training=True)[1]
    assert np.all(np.abs(mean - exact) <= 2 * np.spacing(exact)), (mean - exact) / np.spacing(exact)


@pytest.mark.parametrize(
    ("text", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "AuthenticAMD"),
        ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n", "GenuineIntel"),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", ""),  # 64-bit ARM: no vendor_id
        (None, ""),  # no /proc/cpuinfo (macOS, Windows)
    ],
)
def test_long_rows_go_alone_on_amd_processors(tmp_path, text, vendor):
    """The host's x86 vendor, read from /proc/cpuinfo, picks the long rows' forward loop
    (one row at a time on AMD processors, faster on an AMD EPYC; pipelined elsewhere,
    faster on an Intel Xeon; see ``_numba_loops``) and BatchNorm's training forward
    (memory order on AMD processors, the channels pipelined elsewhere); this host's
    choices follow its own."""
    from npnorm.kernels import _numba_loops as loops

    path = tmp_path / "cpuinfo"
    if text is not None:
        path.write_text(text)
    assert loops._x86_vendor(str(path)) == vendor
    assert loops.LONG_ROWS_ALONE == (loops._x86_vendor() == "AuthenticAMD")
    assert loops.CHANNELS_IN_MEMORY_ORDER == (loops._x86_vendor() == "AuthenticAMD")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(7, 5), (3, 9, 1), (4, 6, 5), (2, 5, 255), (200, 5), (130, 4, 3)])
def test_short_channels_the_same_in_any_blocks(dtype, shape, monkeypatch):
    """BatchNorm's channels of fewer than CHUNK values per sample go in blocks of channels
    (BatchNorm1d's (N, C) input among them); their results are bitwise the same in blocks
    of one, two and all channels (the same sums in the same order), in training and with
    running statistics, in one thread and split over threads: with more than one span of
    samples (``loops.SPAN``), the threads split the spans."""
    from npnorm.kernels import _numba_loops as loops

    span_calls = []

    def counted(f):
        return lambda *a: span_calls.append(f(*a))

    for name in ("channel_span_sums", "channel_span_dy_sums"):
        monkeypatch.setattr(loops, name, counted(getattr(loops, name)))
    C = shape[1]
    x = 7 + rounding(dtype, shape, 3.0)
    dy = np.cos(np.arange(math.prod(shape))).reshape(shape).astype(dtype) / 7
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    b = np.linspace(-1, 1, C).astype(dtype)
    rm, rv = np.linspace(6, 8, C).astype(dtype), np.linspace(1, 3, C).astype(dtype)

    def results(block: int, threads: int) -> list[np.ndarray]:
        monkeypatch.setattr(numba_channels, "_channel_block", lambda N, S, ct: block)
        out = []
        with config(threads, small=True):
            for training in (True, False):
                f = family_kernel("batch_norm_forward", "numba")(xp, x, rm, rv, w, b, training, 0.1, 1e-5)
                g = family_kernel("batch_norm_backward", "numba")(xp, dy, x, f[1], f[2], w, b, training)
                out += [*f, *g]
        return out

    one_at_a_time = results(1, 1)
    for block, threads in ((1, 2), (2, 2), (2, 3), (C, 1), (C, 2)):
        span_calls.clear()
        for a, c in zip(results(block, threads), one_at_a_time, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"blocks of {block}, {threads} threads")
        # the forward's two sums and the backward's, in training; the backward's with running statistics
        assert len(span_calls) == (3 * threads + threads if shape[0] > loops.SPAN and threads > 1 else 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "shape", [(7, 5), (3, 9, 1), (4, 6, 5), (2, 5, 255), (200, 5), (130, 4, 3), (130, 4, 40)]
)
def test_short_channels_backward_in_blocks_as_the_channel_loop(dtype, shape, monkeypatch):
    """BatchNorm's backward on short channels in blocks (one, two, all channels; split
    over threads) is bitwise the channel loops' (``channel_backward`` in training,
    ``channel_running_backward`` with running statistics): the same sums in the same
    order, and the same dx."""
    C = shape[1]
    x = 7 + rounding(dtype, shape, 3.0)
    dy = np.cos(np.arange(math.prod(shape))).reshape(shape).astype(dtype) / 7
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    b = np.linspace(-1, 1, C).astype(dtype)
    _, mean, rstd, *_ = generic_kernel("batch_norm_forward")(xp, x, None, None, w, b, True, 0.1, 1e-5)

    def results(block: int, threads: int) -> list[np.ndarray]:
        monkeypatch.setattr(numba_channels, "_channel_block", lambda N, S, ct: block)
        with config(threads, small=True):
            return [
                r
                for training in (True, False)
                for r in family_kernel("batch_norm_backward", "numba")(xp, dy, x, mean, rstd, w, b, training)
            ]

    channel_loop = results(0, 1)
    for block, threads in ((1, 1), (2, 2), (C, 1), (C, 3)):
        for a, c in zip(results(block, threads), channel_loop, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"blocks of {block}, {threads} threads")
    # values of a real spread far from zero (30 + 3 N(0, 1)), whose sums of x - mean round
    # in float32 (7 + rounding's are exact): sum(x - mean) is summed in the data's dtype
    # by both (a float64 sum in the channel loop alone passed the values above)
    # (at the default staging and thresholds: the small ones stage these inputs otherwise)
    rng = np.random.default_rng(0)
    x = (30 + 3 * rng.normal(size=shape)).astype(dtype)
    dy = rng.normal(size=shape).astype(dtype)
    _, mean, rstd, *_ = generic_kernel("batch_norm_forward")(xp, x, None, None, w, b, True, 0.1, 1e-5)
    for training in (True, False):
        runs = []
        for block in (0, 1):
            monkeypatch.setattr(numba_channels, "_channel_block", lambda N, S, ct, block=block: block)
            runs.append(family_kernel("batch_norm_backward", "numba")(xp, dy, x, mean, rstd, w, b, training))
        for a, c in zip(*runs, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=f"30 + 3 N(0, 1), blocks of 1, training={training}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(3, 4, 256), (2, 3, 4095), (2, 3, 4097), (3, 2, 9000), (1, 5, 300)])
def test_long_channels_statistics_merged_row_by_row(dtype, shape):
    """BatchNorm's channels of CHUNK values per sample and more: each row's pieces
    (``loops.PIECE`` values) two-pass on their own, merged in sample order. The mean and
    biased variance equal float64's two-pass over the whole channel to float64 rounding
    (samples and pieces of different means, so a wrong merge term shows; channel means up
    to 1e6, against which an unshifted update lost digits), y and the running statistics
    as the reference's; bitwise the same in one, two and three threads,
    and staged (strided input), in training and with running statistics."""
    from npnorm.kernels import _numba_loops as loops

    assert loops.PIECE < 9000 < 3 * loops.PIECE  # one, two and three pieces per row
    N, C, S = shape
    ramp = np.arange(S) > S // 2  # pieces of different means
    x = 7 + 3 * np.arange(N)[:, None, None] + ramp + rounding("float64", shape, 1 / 3)
    offsets = np.minimum(1e3 ** np.arange(C), 1e6)  # channels offset by 1, 1e3, 1e6, 1e6, ...
    x = (x + offsets[None, :, None]).astype(dtype)
    w = np.linspace(0.5, 1.5, C).astype(dtype)
    b = np.linspace(-1, 1, C).astype(dtype)
    rm, rv = np.linspace(6, 8, C).astype(dtype), np.linspace(1, 3, C).astype(dtype)
    exact = x.astype(np.float64)
    mean = exact.mean(axis=(0, 2))  # C
    var = ((exact - mean[None, :, None]) ** 2).mean(axis=(0, 2))  # C, biased
    results = {}
    for threads, layout in ((1, "C"), (2, "C"), (3, "C"), (2, "sliced")):
        with config(threads, small=layout == "sliced"):
            out = []
            for training in (True, False):
                args = (xp, laid_out(x, layout), rm, rv, w, b, training, 1.0, 1e-5)
                out += family_kernel("batch_norm_forward", "numba")(*args)
            results[threads, layout] = out
    first = results[1, "C"]
    for key, out in results.items():
        for a, c in zip(out, first, strict=True):
            np.testing.assert_array_equal(a, c, err_msg=str(key))
    _, m, rstd, new_rm, new_rv = first[:5]
    n = N * S
    rtol = 1e-15 if dtype == "float64" else 6e-8  # the float64 result, rounded to float32
    np.testing.assert_allclose(m, mean, rtol=rtol)
    np.testing.assert_allclose(new_rm, mean, rtol=rtol)  # momentum 1: the batch mean
    np.testing.assert_allclose(new_rv, var * n / (n - 1), rtol=4 * rtol)  # and unbiased variance
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var + 1e-5), rtol=4 * rtol)
    for training, ours in ((True, first[:5]), (False, first[5:])):
        ref = generic_kernel("batch_norm_forward")(xp, x, rm, rv, w, b, training, 1.0, 1e-5)
        for a, c in zip(ours[1:], ref[1:], strict=True):  # the statistics
            assert a.dtype == c.dtype and a.shape == c.shape
            np.testing.assert_allclose(a, c, rtol=4 * rtol)
        # y: to a few roundings of the channel's values, times rstd*w
        eps = float(np.finfo(dtype).eps)
        unit = (8 * eps * (offsets + 10) * np.abs(ours[2] * w))[None, :, None]  # 1,C,1
        assert ours[0].dtype == ref[0].dtype
        assert (np.abs(ours[0].astype(np.float64) - ref[0]) <= unit).all()


@pytest.mark.parametrize("in_memory_order", [True, False])
@pytest.mark.parametrize("n, s", [(0, 0), (0, 7), (0, 4200), (1, 100), (1, 4999)])
def test_long_channels_holding_an_inf_as_the_reference(n, s, in_memory_order, monkeypatch):
    """An inf in a long channel (rows of two pieces): the mean and running mean inf, the
    variance and output NaN, as the reference's two passes and PyTorch give them. The
    merge gave a NaN mean (an inf first piece made the shift inf; a later one made the
    next piece's difference of means -inf), whichever piece held it but the last. Both
    training forwards, whichever this host runs: the pipelined one's shift is the
    channel's first value, which must not be taken where it is the inf (at (0, 0))."""
    from npnorm.kernels import _numba_loops as loops

    monkeypatch.setattr(loops, "CHANNELS_IN_MEMORY_ORDER", in_memory_order)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 2, 5000))
    x[n, 0, s] = np.inf
    rm, rv = np.zeros(2), np.ones(2)
    ours = family_kernel("batch_norm_forward", "numba")(xp, x, rm, rv, None, None, True, 0.1, 1e-5)
    ref = generic_kernel("batch_norm_forward")(xp, x, rm, rv, None, None, True, 0.1, 1e-5)
    assert ours[1][0] == np.inf and ours[3][0] == np.inf  # mean, running mean
    for a, c in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)  # (NaN where NaN)


@pytest.mark.parametrize("shape", [(8, 4, 300), (8, 4, 6, 6), (64, 8)])
def test_batch_norm_eval_backward_with_a_running_mean_far_from_zero(shape):
    """With running statistics, dweight = sum(dy * (x - running_mean)) * rstd is not
    centred again (the batch's xhat has no zero mean): 50 + N(0, 1) against a running
    mean of 49. Centring it in eval too left dweight 44-85% off."""
    rng = np.random.default_rng(0)
    C = shape[1]
    x = (50 + rng.normal(size=shape)).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, C).astype(np.float32)
    rm, rv = np.full(C, 49.0, np.float32), np.full(C, 1.5, np.float32)
    results = {}
    for family in ("reference", "numba"):
        with npnorm.use_kernels(family):
            _, mean, rstd, _, _ = F.batch_norm_forward(x, rm, rv, w, None, training=False)
            results[family] = F.batch_norm_backward(dy, x, mean, rstd, w, None, False)
    for name, a, c in zip(("dx", "dweight"), results["numba"], results["reference"], strict=False):
        scale = float(np.abs(c).max())
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-5 * scale, err_msg=name)


def test_long_channels_whose_variance_overflows_as_the_reference():
    """float64 values of 1e200: the squared deviations overflow, the variance is inf,
    rstd 0 and the output the bias, as the reference and PyTorch give them. The merge's
    first step took ``d*d*0`` with ``d*d`` inf: NaN everywhere."""
    x = np.random.default_rng(0).normal(size=(2, 1, 300)) * 1e200
    args = (x, np.zeros(1), np.ones(1), None, np.full(1, 0.5), True, 0.1, 1e-5)
    ours = family_kernel("batch_norm_forward", "numba")(xp, *args)
    ref = generic_kernel("batch_norm_forward")(xp, *args)
    assert ours[2][0] == 0 and ours[4][0] == np.inf and (ours[0] == 0.5).all()
    for a, c in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-12)


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_dweight_stays_finite_where_only_sum_dy_overflows(channels_last):
    """A float64 group far from 0 (1000 + values below 1) whose dy of 6e307 overflows
    sum(dy) but not sum(dy*(x - mean)): the shift that centres xhat again for dweight,
    mean(x - mean)*sum(dy), is inf there and is skipped, so dweight stays finite as the
    reference's (taken, it made dweight inf)."""
    x = (1000.0 + np.array([0.1, 0.3, 0.45, 0.9, 0.2, 0.7, 0.35, 0.55])).reshape(1, 2, 4)
    dy = np.full((1, 2, 4), 6e307)
    dy[0, 1] = [1.0, -2.0, 0.5, 0.25]
    if channels_last:  # (N, C, S) viewed from (N, S, C) memory
        x = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)
        dy = np.ascontiguousarray(dy.transpose(0, 2, 1)).transpose(0, 2, 1)
    w, b = np.ones(2), np.zeros(2)
    got = {}
    for family in ("numba", "reference"):
        with npnorm.use_kernels(family), np.errstate(all="ignore"):
            _, m, rs = F.group_norm_forward(x, 1, w, b)
            got[family] = F.group_norm_backward(dy, x, 1, m, rs, w, b)
    assert np.isfinite(got["reference"][1]).all()
    np.testing.assert_allclose(got["numba"][1], got["reference"][1], rtol=1e-9)  # dweight
    np.testing.assert_array_equal(got["numba"][2], got["reference"][2])  # dbias: [inf, -0.25]


@pytest.mark.parametrize("shape", [(3, 1, 300), (2, 2, 17), (300, 2)])
def test_an_inf_in_dy_gives_the_references_nan_and_inf(shape):
    """One inf in dy: BatchNorm's training dx is inf or NaN where the reference's is
    (a -inf mean of dy less the inf, ...). Splitting mean(dy) = inf into two parts gave
    ``inf - inf``, and every dx of the channel NaN."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape)
    dy = np.ones(shape)
    dy.reshape(-1)[5 * shape[1]] = np.inf  # a value of channel 0
    _, mean, rstd, *_ = generic_kernel("batch_norm_forward")(xp, x, None, None, None, None, True, 0.1, 1e-5)
    ours = family_kernel("batch_norm_backward", "numba")(xp, dy, x, mean, rstd, None, None, True)[0]
    ref = generic_kernel("batch_norm_backward")(xp, dy, x, mean, rstd, None, None, True)[0]
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    assert np.isinf(ours).any() and np.isfinite(ours[:, 1:]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_overflow_to_float16_is_quiet_on_every_thread(threads):
    """dx beyond float16's range is inf, as the reference gives it and without a warning
    (an error here): the staged cast ran in a pool thread outside the caller's errstate."""
    x, dy, w = np.zeros((64, 8), np.float16), np.ones((64, 8), np.float16), np.ones(8)
    _, rstd = generic_kernel("rms_norm_forward")(xp, x, (8,), w, 1e-12)  # 1e6
    with config(threads, True):
        ours = family_kernel("rms_norm_backward", "numba")(xp, dy, x, (8,), rstd, w)
    ref = generic_kernel("rms_norm_backward")(xp, dy, x, (8,), rstd, w)
    assert np.isinf(ref[0]).all()
    same_results(ours[:2], ref, "rms_norm_backward")


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 1), (3, 1, 1), (2, 3, 1), (1, 2, 1, 1)])
def test_one_row_and_one_value(shape):
    """One row, D = 1, one spatial element: as the reference."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=shape)
    dy = rng.normal(size=shape)
    D = shape[-1]
    for op, args, bwd in (
        ("layer_norm", (x, (D,), None, None, 1e-5), lambda r: (dy, x, (D,), r[1], r[2], None, None)),
        ("rms_norm", (x, (D,), None, None), lambda r: (dy, x, (D,), r[1], None)),
    ):
        ours = family_kernel(op + "_forward", "numba")(xp, *args)
        ref = generic_kernel(op + "_forward")(xp, *args)
        for a, c in zip(ours, ref, strict=True):
            np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)
        dx = family_kernel(op + "_backward", "numba")(xp, *bwd(ref))[0]
        np.testing.assert_allclose(
            dx, generic_kernel(op + "_backward")(xp, *bwd(ref))[0], rtol=1e-9, atol=1e-12
        )
    if x.ndim >= 3:
        ours = family_kernel("group_norm_forward", "numba")(xp, x, 1, None, None, 1e-5)
        ref = generic_kernel("group_norm_forward")(xp, x, 1, None, None, 1e-5)
        np.testing.assert_allclose(ours[0], ref[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["empty", "longdouble"])
def test_what_the_loops_do_not_take_goes_to_the_numpy_family(case):
    """Every operation, forward and backward, on an empty batch and on longdouble data (a
    dtype the loops do not compile for): the numba family hands them to the "numpy"
    family's kernels, with every argument in its place (as the reference's results).
    (BatchNorm's batch statistics of an empty batch never reach a kernel: the functional
    API gives an empty output and the buffers as they were, as PyTorch does.)"""
    if case == "longdouble" and np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("longdouble is float64 on this platform")
    rng = np.random.default_rng(0)
    n, dt = (0, np.float32) if case == "empty" else (2, np.longdouble)
    x = rng.normal(size=(n, 3, 4)).astype(dt)
    dy = rng.normal(size=x.shape).astype(dt)
    w, b = np.linspace(0.5, 1.5, 4).astype(dt), np.linspace(-1, 1, 4).astype(dt)
    for op, fwd_args, bwd_args in op_calls(x, dy, w, b, 3):
        what = f"{op}{fwd_args[5:6]}, {case}"
        if case == "empty" and op == "batch_norm" and fwd_args[5]:  # as PyTorch
            with npnorm.use_kernels("numba"):
                y, _, _, rm, rv = F.batch_norm_forward(x, *fwd_args[1:5], training=True)
            assert y.shape == x.shape and rm is fwd_args[1] and rv is fwd_args[2]
            continue
        ref_f = generic_kernel(op + "_forward")(xp, *fwd_args)
        same_results(family_kernel(op + "_forward", "numba")(xp, *fwd_args), ref_f, what, 1e-12)
        ref_b = generic_kernel(op + "_backward")(xp, *bwd_args(ref_f))
        ours_b = family_kernel(op + "_backward", "numba")(xp, *bwd_args(ref_f))
        same_results(ours_b, ref_b, what + ", backward", 1e-12)


def test_each_loop_compiles_for_float32_and_float64_only():
    """Staging keeps the loops to one layout: after inputs of every dtype and layout, each
    compiled loop has at most one signature per computation dtype; the two staging copies
    that read the input as given (the float16 cast, the transposing copy) one per kind of
    input (dtype, layout, read-only or not), into C-ordered scratch."""
    from npnorm.kernels import _numba_loops as loops

    rng = np.random.default_rng(2)
    for dtype in FLOATS:
        for layout in LAYOUTS:
            x = laid_out(rng.normal(size=(3, 4, 5)).astype(dtype), layout)
            _all_results(x, x, None, None, 2)
        rows = np.asfortranarray(rng.normal(size=(1024, 3)).astype(dtype))  # the transposing copy's
        for small, writable in ((False, True), (True, True), (True, False)):  # a whole block, parts
            rows.flags.writeable = writable  # (small: blocks of 2 rows of float64, 5 of float32)
            with config(2, small=small):
                _, mean, rstd = family_kernel("layer_norm_forward", "numba")(xp, rows, (3,), None, None, 1e-5)
                family_kernel("layer_norm_backward", "numba")(xp, rows, rows, (3,), mean, rstd, None, None)
    ct_arg = {"group_rows_statistics": -1, "group_rows_coefficients": -1}  # (their first: float64 partials)
    assert len(loops.transpose_into.signatures) >= 6  # (C and A, writable, read-only A; 2 dtypes)
    for name, fn in vars(loops).items():
        if hasattr(fn, "signatures") and not name.startswith("_"):
            if name in ("half_columns_to_float", "transpose_into"):  # (input first, scratch last)
                kinds = [(sig[0].dtype, sig[0].layout, sig[0].mutable) for sig in fn.signatures]
                # (the transposing copy: float32, float64 and float16's bits)
                assert len(kinds) == len(set(kinds)) and len({k[0] for k in kinds}) <= 3, (name, kinds)
                assert all(sig[-1].layout == "C" and sig[-1].mutable for sig in fn.signatures), name
                continue
            dtypes = [sig[ct_arg.get(name, 0)].dtype for sig in fn.signatures]
            assert len(dtypes) == len(set(dtypes)) <= 2, (name, fn.signatures)


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("repeats", [1, 12])
def test_running_statistics_backward_does_not_read_x(op, dtype, repeats):
    """With running statistics dx = dy * w * rstd, whatever x holds: a NaN, an inf, or values
    whose distance to the mean overflows must not reach dx (they did, as 0 * NaN, in the
    compiled kernel). Channels of 6 values a sample (one block) and 72 (one pass, from
    ``RUNNING_ROW``)."""
    big = np.finfo(dtype).max / 2
    x = np.array([[[1.0, np.nan, np.inf, -np.inf, big, -big]], [[2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]], dtype=dtype)
    x = np.tile(x, (1, 1, repeats))  # 2,1,6*repeats
    dy = np.linspace(-1.0, 1.0, x.size, dtype=dtype).reshape(x.shape)
    w = np.array([1.5], dtype=dtype)
    running_mean, running_var = np.array([-big], dtype=dtype), np.array([4.0], dtype=dtype)
    forward, backward = getattr(F, f"{op}_forward"), getattr(F, f"{op}_backward")
    flag = {"batch_norm": "training", "instance_norm": "use_input_stats"}[op]
    results = {}
    for family in ("numba", "reference"):
        with npnorm.use_kernels(family):
            _, mean, rstd, _, _ = forward(x, running_mean, running_var, w, None, **{flag: False})
            results[family] = backward(dy, x, mean, rstd, w, None, **{flag: False})[0]
    expected = dy * w * (1 / np.sqrt(4.0 + 1e-5))
    np.testing.assert_allclose(results["reference"], expected, rtol=1e-6)
    np.testing.assert_allclose(results["numba"], expected, rtol=1e-6)


def _in_layout(a: np.ndarray, layout: str) -> bool:
    """Whether ``a`` (N, C, *spatial) is laid out as ``laid_out(..., layout)`` makes it."""
    if layout == "channels_last":
        return np.moveaxis(a, 1, -1).flags.c_contiguous
    return a.flags.f_contiguous if layout == "F" else a.flags.c_contiguous


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("given_out", [False, True])
@pytest.mark.parametrize(  # ((N, C) input in channels-last order is C-ordered)
    "layout, shape", [("channels_last", (8, 6, 4, 5)), ("F", (8, 6, 4, 5)), ("F", (40, 6))]
)
def test_channels_last_and_fortran_batch_norm_run_as_views_and_keep_the_layout(
    training, given_out, shape, layout
):
    """A channels-last (N, C, H, W) input (torch's channels_last, NumPy's moveaxis of NHWC)
    was copied whole into (N, C, S) order first, in one thread: 4-5x torch's time in
    inference. It runs as the (N*H*W, C) rows of BatchNorm1d now, and y and dx keep the
    layout, as torch's do. A Fortran-ordered input (a pandas frame's ``.values``) was
    staged, a transpose: 2-4x the C-ordered time at (100000, 64); it runs as the (S, C, N)
    planes of its ``.T``, and keeps its layout too."""
    rng = np.random.default_rng(0)
    x = laid_out((rng.normal(size=shape) * 2 + 3).astype(np.float32), layout)
    dy = laid_out(rng.normal(size=shape).astype(np.float32), layout)
    w, b = np.linspace(0.5, 1.5, 6).astype(np.float32), np.linspace(-1, 1, 6).astype(np.float32)
    rm, rv = np.linspace(-1, 1, 6).astype(np.float32), np.linspace(0.5, 2, 6).astype(np.float32)
    fwd, bwd = family_kernel("batch_norm_forward", "numba"), family_kernel("batch_norm_backward", "numba")
    out = laid_out(np.empty(shape, np.float32), layout) if given_out else None
    got = fwd(xp, x, rm.copy(), rv.copy(), w, b, training, 0.1, 1e-5, out)
    want = generic_kernel("batch_norm_forward")(xp, x, rm.copy(), rv.copy(), w, b, training, 0.1, 1e-5)
    same_results(got, want, "forward", tol=2e-6)
    assert got[0] is out if given_out else _in_layout(got[0], layout)
    dout = laid_out(np.empty(shape, np.float32), layout) if given_out else None
    dgot = bwd(xp, dy, x, got[1], got[2], w, b, training, dout)
    dwant = generic_kernel("batch_norm_backward")(xp, dy, x, want[1], want[2], w, b, training)
    same_results(dgot, dwant, "backward", tol=2e-5)
    assert dgot[0] is dout if given_out else _in_layout(dgot[0], layout)


@st.composite
def channels_last_groups(draw: st.DrawFn) -> dict:
    """A GroupNorm or InstanceNorm problem (as ``problems``) on channels-last input and
    gradient, with channels enough for the sample loops at their default width."""
    op = draw(st.sampled_from(["group_norm", "instance_norm"]))
    dtype = draw(st.sampled_from(FLOATS))
    k = draw(st.sampled_from([1, 2, 4, 8])) if op == "group_norm" else 1
    wide = numba_channels.WIDE_ROW_BYTES // max(4, np.dtype(dtype).itemsize)  # channels
    C = max(k * draw(st.integers(1, 8)), -(-wide // k) * k)
    spatial = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6))
    if op == "instance_norm" and math.prod(spatial) < 2:
        spatial = (2, *spatial[1:])  # (one value per channel is an error)
    shape = (draw(st.integers(1, 4)), C, *spatial)
    offset = draw(st.sampled_from([0.0, 1e3]))
    x = (draw(values(dtype, shape)).astype(np.float64) + offset).astype(dtype)
    return {
        "op": op,
        "x": laid_out(x, "channels_last"),
        "dy": laid_out(draw(values(dtype, shape)), "channels_last"),
        "w": draw(hnp.arrays(np.dtype(dtype), (C,), elements=st.floats(0.5, 1.5))),
        "b": draw(hnp.arrays(np.dtype(dtype), (C,), elements=st.floats(-2, 2))),
        "groups": C // k,
        "eps": draw(st.sampled_from((1e-5, 0.25))),
        "read_only": draw(st.booleans()),
    }


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@settings(max_examples=40, deadline=None)
@given(p=channels_last_groups())
def test_channels_last_group_norm_runs_by_samples_and_keeps_the_layout(p):
    """Channels-last GroupNorm and InstanceNorm input (a group: neighbouring columns of
    each sample's S rows of C values) was staged into (N, C, S) order block by block:
    2-3x torch's time (it has a channels-last kernel), and a C-ordered output. Wide
    enough rows now run sample by sample (``loops.group_rows_*``): the reference's
    results, the layout kept (or ``out`` filled), bitwise the same with one thread and
    two; float16 and read-only arrays through staged blocks of samples, with the same
    sums."""
    op, x, dy, w, b, G = p["op"], p["x"], p["dy"], p["w"], p["b"], p["groups"]
    if p["read_only"]:
        x, dy = x.copy(order="K"), dy.copy(order="K")
        x.flags.writeable = dy.flags.writeable = False
    if op == "group_norm":
        fwd_args = (x, G, w, b, p["eps"])

        def bwd_args(r):
            return (dy, x, G, r[1], r[2], w, b)
    else:
        fwd_args = (x, None, None, w, b, True, 0.1, p["eps"])

        def bwd_args(r):
            return (dy, x, r[1], r[2], w, b, True)

    ops = (op + "_forward", op + "_backward")
    fwd, bwd = family_kernel(ops[0], "numba"), family_kernel(ops[1], "numba")
    results = []
    settings_ = {
        "small": True,
        "stage_bytes": 1 << 20,
    }  # two threads on these small inputs, samples in a block
    for threads in (1, 2):
        f, d = compare(ops, fwd_args, bwd_args, {**p, "threads": threads, **settings_}, compute_dtype(x, w))
        for a in (f[0], d[0]):
            assert np.moveaxis(a, 1, -1).flags.c_contiguous  # channels-last, as x
        with config(threads, **settings_):  # a backward from the compiled statistics, and out=
            d = bwd(xp, *bwd_args(f))
            out, dout = (laid_out(np.empty(x.shape, x.dtype), "channels_last") for _ in range(2))
            f_out, d_out = fwd(xp, *fwd_args, out), bwd(xp, *bwd_args(f), dout)
        assert f_out[0] is out and d_out[0] is dout
        for one, two in zip([*f[:3], *d], [*f_out[:3], *d_out], strict=True):
            np.testing.assert_array_equal(one, two)
        results.append([*f[:3], *d])
    if p["read_only"]:  # the same as from writable arrays
        with config(1, **settings_):
            f = fwd(xp, *(np.copy(a) if isinstance(a, np.ndarray) else a for a in fwd_args))
        np.testing.assert_array_equal(f[0], results[0][0])
    for one, two in zip(*results, strict=True):
        np.testing.assert_array_equal(one, two)


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("kind", ["float16", "read-only", "float64 weight"])
def test_channels_last_samples_are_staged_in_blocks(kind, monkeypatch, restore_threads):
    """Channels-last samples that the loops cannot take as they are (float16, read-only,
    a computation dtype other than the input's) were staged one sample at a time, one
    loop call each from Python: 35-50x slower than before the sample loops at S = 1, 2x
    at (128, 64, 14, 14). They are staged in blocks of samples (``_staging.STAGE_BYTES``):
    a few loop calls, the same results as sample by sample."""
    _threads.set_num_threads(1)
    rng = np.random.default_rng(3)
    x = laid_out(
        rng.normal(size=(64, 32, 3, 2)).astype("float16" if kind == "float16" else "float32"), "channels_last"
    )
    dy = laid_out(rng.normal(size=x.shape).astype(x.dtype), "channels_last")
    w = np.linspace(0.5, 1.5, 32).astype("float64" if kind == "float64 weight" else x.dtype)
    if kind == "read-only":
        x.flags.writeable = dy.flags.writeable = False
    calls = []
    for name in ("group_rows_forward", "group_rows_backward"):
        loop = getattr(numba_channels.loops, name)
        monkeypatch.setattr(
            numba_channels.loops, name, lambda *a, _l=loop: calls.append(a[-1] - a[-2]) or _l(*a)
        )

    def both():
        f = F.group_norm_forward(x, 8, w, None)
        return [*f, *F.group_norm_backward(dy, x, 8, f[1], f[2], w, None)]

    with npnorm.use_kernels("numba"):
        blocks = both()
        assert len(calls) == 2 and calls == [64, 64]  # one call per direction: 64 samples of 0.75-1.5 KB
        ct = np.result_type(np.float32, x.dtype, w.dtype)
        monkeypatch.setattr(_staging, "STAGE_BYTES", x[0].size * ct.itemsize)  # one sample per block
        one_by_one = both()
    assert len(calls) == 2 + 2 * 64
    assert np.moveaxis(blocks[0], 1, -1).flags.c_contiguous
    for a, b in zip(blocks, one_by_one, strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def _group_or_instance(op: str, x: np.ndarray, dy: np.ndarray, G: int, w: np.ndarray) -> list:
    """Forward and backward results of ``op`` (GroupNorm with G groups, or InstanceNorm
    with input statistics) on x, dy."""
    if op == "group_norm":
        f = F.group_norm_forward(x, G, w, None)
        return [*f, *F.group_norm_backward(dy, x, G, f[1], f[2], w, None)]
    f = F.instance_norm_forward(x, None, None, w, None, use_input_stats=True)
    return [*f, *F.instance_norm_backward(dy, x, f[1], f[2], w, None, use_input_stats=True)]


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
@pytest.mark.parametrize("N", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_channels_last_samples_fewer_than_threads_are_split_over_them(
    op, N, dtype, monkeypatch, restore_threads
):
    """Channels-last samples ran one per thread: with fewer samples than threads (a batch
    of one image on a many-core host) the other threads stayed idle. A sample's sums are
    now taken in spans of ``SPAN_VALUES``, which the threads split there
    (``loops.group_rows_partials``, ``group_rows_dy_partials``): the results and layout
    of one sample per thread, bitwise, whatever the thread count (float64 data whose
    span sums round: added in another order, they differ), and the reference's to
    rounding."""
    rng = np.random.default_rng(8)
    x = laid_out((rng.normal(size=(N, 32, 13, 11)) * 3 + 100).astype(dtype), "channels_last")
    dy = laid_out((rng.normal(size=x.shape) + 0.3).astype(dtype), "channels_last")
    w = np.linspace(0.5, 1.5, 32).astype(dtype)
    monkeypatch.setattr(
        numba_channels, "SPAN_VALUES", 32 * 5
    )  # spans of 5 rows: 29 of a sample, the last of 3
    monkeypatch.setattr(numba_channels, "SPAN_MIN_ROWS", 1)
    monkeypatch.setattr(numba_channels, "SPLIT_SAMPLE_VALUES", 1)
    monkeypatch.setattr(_staging, "MIN_PARALLEL", 1)
    split: dict[str, list[int]] = {"group_rows_partials": [], "group_rows_dy_partials": []}
    for name, calls in split.items():
        loop = getattr(numba_channels.loops, name)
        monkeypatch.setattr(
            numba_channels.loops, name, lambda *a, _l=loop, _c=calls: _c.append(a[-1] - a[-2]) or _l(*a)
        )
    results = {}
    with npnorm.use_kernels("numba"):
        for threads in (1, 2, 3):
            _threads.set_num_threads(threads)
            for calls in split.values():
                calls.clear()
            results[threads] = _group_or_instance(op, x, dy, 8, w)
            forward, backward = split.values()
            assert bool(forward) == bool(backward) == (threads > N)
            if forward:  # the spans of the means and of the squared deviations, then of dy's sums
                assert len(forward) == 2 * threads and sum(forward) == 2 * N * 29
                assert len(backward) == threads and sum(backward) == N * 29
    for threads in (2, 3):
        for a, b in zip(results[1], results[threads], strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b)
    y, dx = (a for a in results[3] if a is not None and a.ndim == 4)
    assert np.moveaxis(y, 1, -1).flags.c_contiguous and np.moveaxis(dx, 1, -1).flags.c_contiguous
    with npnorm.use_kernels("reference"):
        reference = _group_or_instance(op, x, dy, 8, w)
    for a, b in zip(results[3], reference, strict=True):
        if a is not None:
            tol = 2e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("N", [2, 6])
@pytest.mark.parametrize("path", ["direct", "staged", "split"])
@pytest.mark.parametrize("threads", [1, 3])
def test_channels_last_centres_the_rows_c_ordered_input_centres(
    N, path, threads, monkeypatch, restore_threads
):
    """GroupNorm's backward centres xhat again on the rows (groups of a sample) far from 0
    only, and channels-last input takes ``sum(x - mean)`` only on samples with such a row
    (``loops._any_far`` of its groups): sample 1 has only its last group at 1e3, the last
    samples every group, the others none. Channels-last dx is bitwise C-ordered dx on the loops
    that take a sample in place, staged (read-only input, a sample per block) and split
    into spans over the threads. (A wrong sample index or a scan of the first group only
    passed every other test: their samples were all near 0 or all far; staged, the index
    put channels-last dx 1.8e-6 off, 15 roundings of float32.)"""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 32, 8, 8))
    x[1, 24:] += 1e3  # sample 1: its last group of 8 channels far from 0
    x[N // 2 + 1 :] += 1e3  # the last samples: every group far
    x = x.astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    _threads.set_num_threads(threads)
    if path == "staged":
        monkeypatch.setattr(_staging, "STAGE_BYTES", x[0].nbytes)  # a sample per block
    if path == "split":
        monkeypatch.setattr(numba_channels, "SPAN_VALUES", 32 * 4)  # spans of 4 rows
        monkeypatch.setattr(numba_channels, "SPAN_MIN_ROWS", 1)
        monkeypatch.setattr(numba_channels, "SPLIT_SAMPLE_VALUES", 1)
        monkeypatch.setattr(_staging, "MIN_PARALLEL", 1)
    loop = "group_rows_dy_partials" if path == "split" else "group_rows_backward"
    calls: list[int] = []
    original = getattr(numba_channels.loops, loop)
    monkeypatch.setattr(numba_channels.loops, loop, lambda *a: calls.append(1) or original(*a))
    with npnorm.use_kernels("numba"):
        _, mean, rstd = F.group_norm_forward(x, 4)
        dx_c = F.group_norm_backward(dy, x, 4, mean, rstd)[0]
        assert not calls  # (C-ordered input: the rows' loops)
        x_last, dy_last = laid_out(x, "channels_last"), laid_out(dy, "channels_last")
        if path == "staged":
            x_last.flags.writeable = dy_last.flags.writeable = False
        dx_last = F.group_norm_backward(dy_last, x_last, 4, mean, rstd)[0]
    split_here = path == "split" and threads > N
    assert calls if path != "split" or split_here else not calls, (path, threads)
    np.testing.assert_array_equal(dx_last, dx_c)


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("shape", [(2, 64, 56, 56), (1, 32, 200, 100)])
def test_channels_last_float64_group_means_within_a_few_ulp(shape):
    """The sample loops summed each channel's column down all S rows in one float64 sum:
    on data of offset 1e3 the group means of channels-last input came out 10-26 ulp off
    the exact mean (C-ordered input: 5-9). Summed in spans, added in order: 2."""
    rng = np.random.default_rng(4)
    x = laid_out(rng.normal(size=shape) * 2 + 1e3, "channels_last")
    G = 8
    exact = np.array(
        [[math.fsum(g) / g.size for g in s] for s in np.reshape(np.ascontiguousarray(x), (shape[0], G, -1))]
    )
    with npnorm.use_kernels("numba"):
        mean = np.reshape(F.group_norm_forward(x, G)[1], exact.shape)
    assert np.max(np.abs(mean - exact) / np.spacing(np.abs(exact))) <= 4


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_channels_last_samples_larger_than_a_block_are_staged_by_rows(op, restore_threads):
    """A staged channels-last sample is one block at least: float16 samples of (2, 64,
    384, 384) took 4x the input's bytes in the forward and 6x in the backward (the
    staged rows path: 5-7 MiB). Samples that need staging and are larger than a block
    take the staged rows path again, with the results of the sample loops to rounding."""
    import tracemalloc

    _threads.set_num_threads(2)
    rng = np.random.default_rng(6)
    x = laid_out(rng.normal(size=(2, 32, 64, 64)).astype(np.float16), "channels_last")  # 512 KB
    dy = laid_out(rng.normal(size=x.shape).astype(np.float16), "channels_last")
    w = np.linspace(0.5, 1.5, 32).astype(np.float16)
    if op == "group_norm":
        fwd = lambda: F.group_norm_forward(x, 8, w, None)  # noqa: E731
        bwd = lambda f: F.group_norm_backward(dy, x, 8, f[1], f[2], w, None)  # noqa: E731
    else:
        fwd = lambda: F.instance_norm_forward(x, None, None, w, None, use_input_stats=True)  # noqa: E731
        bwd = lambda f: F.instance_norm_backward(dy, x, f[1], f[2], w, None, use_input_stats=True)  # noqa: E731
    with npnorm.use_kernels("numba"):
        samples = [*(f := fwd()), *bwd(f)]  # samples of 256 KB in float32: within a block
        small = 64 * 1024  # a block of 64 KB: a sample does not fit
        with config(2, small=True):  # (no whole copy of small inputs, two threads)
            _staging.STAGE_BYTES = small  # the staged rows: one (sample, group) row of 64 KB a block
            fwd(), bwd(f)  # (compiled and warm)
            peaks = []
            for call in (fwd, lambda: bwd(f)):
                tracemalloc.start()
                try:
                    got = call()
                    peaks.append(tracemalloc.get_traced_memory()[1])
                finally:
                    tracemalloc.stop()
            rows = [*(g := fwd()), *bwd(g)]
    for p in peaks:  # the output, and 2-3 blocks per thread (a sample each: 2-3x 256 KB)
        assert p < x.nbytes + 8 * small, (p / x.nbytes, peaks)
    for a, b in zip(rows, samples, strict=True):
        if a is not None:
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-3, atol=2e-3)
    del got


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("layout", ["C", "channels_last", "F"])
@pytest.mark.parametrize("given_out", [False, True])
def test_instance_norm_with_running_statistics_is_batch_norm_eval(layout, given_out):
    """InstanceNorm without input statistics is BatchNorm's eval (the same affine map of
    the running statistics): bitwise the same results. On channels-last input it was
    staged whole, 3.5x BatchNorm eval's time in the forward and 4-10x InstanceNorm's own
    C-ordered time in forward+backward (19-55 against 5.5-6 ms at (32, 64, 56, 56)), with
    a C-ordered output; it now runs as BatchNorm's (N*S, C) rows and keeps the layout."""
    rng = np.random.default_rng(5)
    x = laid_out((rng.normal(size=(8, 6, 5, 4)) * 2 + 3).astype(np.float32), layout)
    dy = laid_out(rng.normal(size=x.shape).astype(np.float32), layout)
    w, b = np.linspace(0.5, 1.5, 6).astype(np.float32), np.linspace(-1, 1, 6).astype(np.float32)
    rm, rv = np.linspace(-1, 1, 6).astype(np.float32), np.linspace(0.5, 2, 6).astype(np.float32)

    def out():
        return laid_out(np.empty(x.shape, np.float32), layout) if given_out else None

    inst = family_kernel("instance_norm_forward", "numba")(xp, x, rm, rv, w, b, False, 0.1, 1e-5, out())
    batch = family_kernel("batch_norm_forward", "numba")(xp, x, rm, rv, w, b, False, 0.1, 1e-5, out())
    d_inst = family_kernel("instance_norm_backward", "numba")(xp, dy, x, inst[1], inst[2], w, b, False, out())
    d_batch = family_kernel("batch_norm_backward", "numba")(xp, dy, x, batch[1], batch[2], w, b, False, out())
    for a, c in zip([*inst, *d_inst], [*batch, *d_batch], strict=True):
        np.testing.assert_array_equal(a, c)
    for a in (inst[0], d_inst[0]):
        assert _in_layout(a, layout)
    want = generic_kernel("instance_norm_forward")(xp, x, rm, rv, w, b, False, 0.1, 1e-5)
    same_results(inst, want, "forward", tol=2e-6)


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba")
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_a_backward_without_parameters_keeps_no_row_length_partials(op, restore_threads):
    """Each thread allocated float64 and float32 partial sums of the row's length for
    dweight/dbias even without a weight or bias: 6x the input in extra memory for two rows
    of 2**20 values (and two more of them for the threads' totals)."""
    import tracemalloc

    _threads.set_num_threads(2)
    D = 1 << 20
    x = np.random.default_rng(0).normal(size=(2, D)).astype(np.float32)
    with npnorm.use_kernels("numba"):
        f = getattr(F, f"{op}_forward")(x, (D,))
        tracemalloc.start()
        try:
            getattr(F, f"{op}_backward")(x, x, (D,), *f[1:])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2 * x.nbytes, peak / x.nbytes  # dx and a row of ones (no weight), little else


def _signatures() -> dict[str, int]:
    from npnorm.kernels import _numba_loops as loops

    return {n: len(f.signatures) for n, f in vars(loops).items() if hasattr(f, "signatures")}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["C", "channels_last"])
def test_read_only_arrays_compile_nothing_new(dtype, layout):
    """Read-only arrays (``np.load(mmap_mode="r")``, ``np.frombuffer``, a frozen weight)
    are another type to numba: every loop compiled again for them, about a second each at
    run time, after ``warmup`` too. The loops now see writable copies (staged blocks for
    the inputs): the same results, and no loop gains a signature (but the float16 casts'
    read-only variants, which ``warmup`` compiles)."""
    from npnorm import _warmup

    _warmup._float16_casts()
    rng = np.random.default_rng(4)
    x = laid_out((rng.normal(size=(4, 6, 5, 3)) * 3 + 1).astype(dtype), layout)
    dy = laid_out(rng.normal(size=x.shape).astype(dtype), layout)
    w, b = np.linspace(0.5, 1.5, 3).astype(dtype), np.linspace(-1, 1, 3).astype(dtype)

    def frozen(a):
        if not isinstance(a, np.ndarray):
            return a
        a = a.copy(order="K")
        a.flags.writeable = False
        return a

    for threads in (1, 2):
        with config(threads, small=threads == 2):
            writable = [(op, f, b_(f)) for op, f, b_ in _op_results(x, dy, w, b)]
            before = _signatures()
            for (op, fwd, bwd), (_, want_f, want_b) in zip(
                _op_calls(x, dy, w, b, frozen), writable, strict=True
            ):
                got_f = family_kernel(op + "_forward", "numba")(xp, *fwd)
                got_b = family_kernel(op + "_backward", "numba")(xp, *bwd(tuple(map(frozen, got_f))))
                same_results(got_f, want_f, op)
                same_results(got_b, want_b, op + " backward")
            assert _signatures() == before


def _op_calls(x, dy, w, b, wrap):
    """``op_calls`` on (N, C, *, D) data, every array passed through ``wrap``."""
    calls = []
    for op, fwd, bwd in op_calls(wrap(x), wrap(dy), wrap(w), wrap(b), 2):
        fwd = tuple(map(wrap, fwd))
        calls.append((op, fwd, lambda f, bwd=bwd: tuple(map(wrap, bwd(f)))))
    return calls


def _op_results(x, dy, w, b):
    """``(op, forward results, backward from them)`` of every op of ``op_calls``."""
    out = []
    for op, fwd, bwd in op_calls(x, dy, w, b, 2):
        f = family_kernel(op + "_forward", "numba")(xp, *fwd)
        out.append((op, f, lambda f, bwd=bwd, op=op: family_kernel(op + "_backward", "numba")(xp, *bwd(f))))
    return out


@st.composite
def small_channel_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """A small C-ordered BatchNorm input (N, C, *spatial) or (N, C) of float32/float64
    (up to 300 samples: spans of samples the threads may split), with or without a
    weight and a bias."""
    dtype = draw(st.sampled_from(["float32", "float64"]))
    spatial = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=4))
    shape = (draw(st.integers(1, 300)), draw(st.integers(1, 9)), *spatial)
    finite = st.floats(-1e3, 1e3, width=32)
    x = draw(hnp.arrays(dtype, shape, elements=finite))
    C = shape[1]
    w = draw(st.none() | hnp.arrays(dtype, C, elements=st.floats(0.25, 4, width=32)))
    b = draw(st.none() | hnp.arrays(dtype, C, elements=finite))
    return x, w, b


@settings(max_examples=100)  # (about a second)
@given(
    case=small_channel_inputs(),
    training=st.booleans(),
    given_out=st.booleans(),
    thresholds=st.sampled_from([None, (1 << 16, 1), (64, 1 << 21), (64, 1)]),
)
def test_small_batch_norm_forward_in_one_call_as_the_general_way(case, training, given_out, thresholds):
    """A small C-ordered BatchNorm forward calls its loop at once (``_one_call``): only
    where the general way makes that one call in the calling thread (none of its work
    handed to the pool, with 2 threads, at the default thresholds or lowered ones:
    ``_staging.MIN_PARALLEL``, ``numba_channels.SPLIT_VALUES``), and then bitwise the
    general way's output, statistics and running buffers, in training and in eval, with
    or without ``out=``."""
    from unittest import mock

    x, w, b = case
    C = x.shape[1]
    assume(not training or x.size > C)  # (training needs two values a channel: F.batch_norm checks)
    rng = np.random.default_rng(0)
    rm0, rv0 = rng.normal(size=C).astype(x.dtype), rng.uniform(0.5, 2, C).astype(x.dtype)
    kernel = family_kernel("batch_norm_forward", "numba")

    def forward() -> list[np.ndarray]:
        rm, rv = rm0.copy(), rv0.copy()
        out = np.empty_like(x) if given_out else None
        got = kernel(xp, x, rm, rv, w, b, training, 0.1, 1e-5, out)
        assert out is None or got[0] is out
        return [*got[:3], rm, rv, *(a for a in got[3:] if a is not None)]

    taken: list[bool] = []
    real = numba_channels._one_call

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    saved = _threads.get_num_threads(), _staging.MIN_PARALLEL, numba_channels.SPLIT_VALUES
    _threads.set_num_threads(2)
    if thresholds is not None:
        _staging.MIN_PARALLEL, numba_channels.SPLIT_VALUES = thresholds
    try:
        with mock.patch.object(numba_channels, "_one_call", spy):
            fast = forward()
        with (
            mock.patch.object(numba_channels, "_one_call", return_value=False),
            mock.patch.object(_staging, "run_parallel", wraps=_staging.run_parallel) as pool,
        ):
            general = forward()
    finally:
        _threads.set_num_threads(saved[0])
        _staging.MIN_PARALLEL, numba_channels.SPLIT_VALUES = saved[1:]
    if taken[0]:
        assert pool.call_count == 0  # the general way's work all in the calling thread too
    if thresholds is None:  # (S = 1 with spatial axes is channels-last too: its view may take it)
        assert taken[0] == (x.ndim == 2 or x[0, 0].size > 1)
    for a, e in zip(fast, general, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


# numba's target for AVX2 without AVX-512 (Haswell's features; NUMBA_CPU_NAME alone did not
# change the features numba compiled for)
AVX2_TARGET = {
    "NUMBA_CPU_NAME": "haswell",
    "NUMBA_CPU_FEATURES": "+64bit,+cmov,+cx16,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,"
    "+avx,+avx2,+fma,+bmi,+bmi2,+lzcnt,+f16c",
}


def _host_has_avx2() -> bool:
    import platform

    from llvmlite import binding

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return bool(binding.get_host_cpu_features().get("avx2", False))


@pytest.mark.slow
@pytest.mark.skipif(not _host_has_avx2(), reason="compiles for AVX2: needs an x86-64 host that has it")
def test_bitwise_claims_hold_compiled_for_avx2(tmp_path):
    """Every test of this file whose docstring says "bitwise", run again with the loops
    compiled for AVX2 without AVX-512 (in a subprocess, with a numba cache of its own). The
    vectorized helpers' order of addition depends on the target: ``_sums_dy`` and
    ``_sums_dy_dev`` add ``sum(dy)`` alike with AVX-512 but not with AVX2, where a loop
    that took the other helper than ``channel_backward`` gave other float64 dweights (a
    review found it; the tests passed on this project's AVX-512 hosts)."""
    import ast
    import os
    import pathlib
    import subprocess
    import sys

    tree = ast.parse(pathlib.Path(__file__).read_text(encoding="utf-8"))
    names = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test_")
        and "bitwise" in (ast.get_docstring(node) or "").lower()
        and node.name != "test_bitwise_claims_hold_compiled_for_avx2"
    ]
    assert len(names) >= 15, names
    env = {**os.environ, **AVX2_TARGET, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        " or ".join(names),
    ]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
