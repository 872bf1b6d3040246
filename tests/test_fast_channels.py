"""The fast NumPy BatchNorm/InstanceNorm/GroupNorm kernels against the generic ones.

``npnorm.kernels.numpy_fast_channels`` must give the generic kernels' results to
rounding for every layout, dtype, size and mode (batch or running statistics, with or
without buffers, weight and bias). Most tests shrink the block size so that small
inputs span many blocks (blocks ending mid-sample, mid-group) and both threads.
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator

import array_api_compat.numpy as xp
import numpy as np
import pytest
from helpers import (
    count_at,
    gradient_terms,
    op_calls,
    output_terms,
    same_results,
    statistic_max,
    statistic_scales,
    statistic_shape,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm.functional as F
from npnorm import _threads
from npnorm.functional._dispatch import generic_kernel, kernel, use_kernels
from npnorm.kernels import _blocks
from npnorm.kernels import numpy_fast_channels as fast
from npnorm.kernels import numpy_fast_columns as columns

OPS = (
    "batch_norm_forward",
    "batch_norm_backward",
    "instance_norm_forward",
    "instance_norm_backward",
    "group_norm_forward",
    "group_norm_backward",
)
FLOATS = ("float16", "float32", "float64")
LAYOUTS = ("C", "F", "sliced", "transposed", "channels_last")
REL = {"float64": 1e-11, "float32": 2e-5}  # of the computation dtype
DRAWN = 300  # examples per drawn test (each takes a few ms)


@pytest.fixture(autouse=True)
def numpy_kernels():
    """These tests are about the "numpy" kernel family: the public functions use it."""
    with use_kernels("numpy"):
        yield


@contextlib.contextmanager
def config(threads: int = 2, block_bytes: int | None = None, small_copy: int | None = None) -> Iterator[None]:
    """Thread count, block size and whole-copy limit for the block; restored after."""
    saved = (
        _threads.get_num_threads(),
        _blocks.BLOCK_BYTES,
        _blocks.SMALL_COPY_BYTES,
        _blocks.MIN_BLOCKS_PER_THREAD,
    )
    _threads.set_num_threads(threads)
    if block_bytes is not None:
        _blocks.BLOCK_BYTES = block_bytes
        _blocks.MIN_BLOCKS_PER_THREAD = 1
    if small_copy is not None:
        _blocks.SMALL_COPY_BYTES = small_copy
    try:
        yield
    finally:
        _threads.set_num_threads(saved[0])
        _blocks.BLOCK_BYTES, _blocks.SMALL_COPY_BYTES, _blocks.MIN_BLOCKS_PER_THREAD = saved[1:]


def laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """The values of ``a`` in another memory layout (same dtype)."""
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "sliced":  # every other entry along the last axis: no (rows, S) view
        big = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), dtype=a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if layout == "transposed":  # all strides reversed
        return np.ascontiguousarray(a.T).T
    if layout == "channels_last":  # (N, *spatial, C) in memory
        return np.ascontiguousarray(np.moveaxis(a, 1, -1)).transpose(0, a.ndim - 1, *range(1, a.ndim - 1))
    return a


def ulp(dtype) -> float:
    return float(np.finfo(dtype).eps)


def assert_close(ours, ref, ct, scale, what):
    """``ours`` equals ``ref`` to the rounding of the computation dtype ``ct`` (relative
    to ``scale``) plus two roundings to the result's dtype (subnormals included: their
    spacing is absolute, 2**-24 in float16)."""
    if ref is None:
        assert ours is None, what
        return
    assert isinstance(ours, np.ndarray), what
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), (what, ours.dtype, ref.dtype, ours.shape)
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    tiny = float(np.finfo(ref.dtype).smallest_subnormal)
    tol = REL[np.dtype(ct).name] * scale + 2 * ulp(ref.dtype) * np.abs(b) + 2 * tiny
    with np.errstate(invalid="ignore"):  # inf - inf
        # NaN fails unless the reference has it there too (|a - b| > tol let NaN through);
        # an infinite reference needs the same value (its tolerance is infinite)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        bad = ~np.where(np.isfinite(b), np.abs(a - b) <= tol, same)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ, worst {np.max(np.abs(a - b) - tol):.3g}"


def compare(ops: tuple[str, str], args_fwd, make_bwd, ct, x, dy, w):
    """Forward and backward through the fast and the generic kernels; all outputs equal
    to rounding. ``make_bwd(fwd_outputs)`` gives the backward's arguments."""
    fast_f = kernel(ops[0], xp)(xp, *args_fwd)
    ref_f = generic_kernel(ops[0])(xp, *args_fwd)
    fast_b = kernel(ops[1], xp)(xp, *make_bwd(ref_f))
    ref_b = generic_kernel(ops[1])(xp, *make_bwd(ref_f))
    # y = w (x - mean) r + b, each element to the rounding of its own terms. Where the
    # mean's rounding to ct would show, both take it back: GroupNorm and InstanceNorm centre
    # again (RECENTRE_ABOVE), BatchNorm and running statistics fold the mean into the shift
    # only within FOLD_LIMIT deviations of 0 and else carry what the rounding lost into it.
    # So the offset's allowance is the float64 mean's rounding alone, up to n - 1 roundings
    # of |mean| for a statistic of n values (float64 data: 10000 four times and 10000.0625
    # gave y 9e-12 apart). With an allowance of (2 max|x| + 1) max rstd, a forward whose
    # output is off by 20 roundings of the mean in ct, times rstd and w, passed the three
    # drawn tests.
    op = ops[0].removesuffix("_forward")
    terms, mean_rounding = output_terms(op, x, w, ref_f[1], ref_f[2])
    scale_y = terms + mean_rounding / REL[np.dtype(ct).name] + np.abs(ref_f[0].astype(np.float64))
    assert_close(fast_f[0], ref_f[0], ct, scale_y, "y")
    # each mean to its own values' largest |x|, not the largest of all; rstd to a few
    # roundings of itself, as both families take the variance in float64 (with |rstd| (1 +
    # max|x| max rstd), an rstd off by 20 roundings of ct times its own |x| rstd, as from a
    # variance rounded in ct, passed the three drawn tests)
    x_max, rstd64 = statistic_max(op, x, ref_f[1]), np.abs(ref_f[2].astype(np.float64))
    assert_close(fast_f[1], ref_f[1], ct, x_max, "mean")
    assert_close(fast_f[2], ref_f[2], ct, 4 * rstd64, "rstd")
    # new = (1 - m) old + m batch, in ct (functional._channels.running_update): each buffer
    # element to its own channel's terms, not the largest of all plus 1. They are the old
    # value and m times the batch statistic's size: the channel's largest |x| for the mean,
    # 2 sigma^2 for the unbiased variance (n / (n - 1) <= 2; sigma^2 = 1 / rstd^2, the
    # largest of the channel's statistics). Both families take the variance in float64,
    # two-pass: off by its own rounding and the square of the float64 mean's, up to n
    # roundings of the channel's largest |x| on n values.
    if len(ref_f) > 3:  # (BatchNorm, InstanceNorm: the new running buffers, or None)
        # by channel: an InstanceNorm's buffers too, as a (C,) statistic is
        channel_max = statistic_max("batch_norm", x, np.zeros(x.shape[1]))
        n = max(2, int(np.max(count_at(op, x, ref_f[1]), initial=0)))
        floor = (n * ulp(np.float64) * channel_max) ** 2 / REL[np.dtype(ct).name]
        variance = np.max(1 / rstd64.reshape(-1, x.shape[1]) ** 2, axis=0, initial=0.0)
        momentum = args_fwd[6]  # (.., training, momentum, eps)
        for i, name, batch in (
            (3, "new_running_mean", channel_max),
            (4, "new_running_var", 2 * variance + floor),
        ):
            old = args_fwd[i - 2]  # (x, running_mean, running_var, ..)
            scale = 0.0
            if ref_f[i] is not None:
                scale = (
                    np.abs(ref_f[i].astype(np.float64))
                    + np.abs(old.astype(np.float64))
                    + abs(momentum) * batch
                )
            assert_close(fast_f[i], ref_f[i], ct, scale, name)
    # The backward recomputes xhat from the saved mean, rounded to ct (up to half an ulp of
    # |x|), which moves every xhat by that times rstd (PyTorch's too: dx 0.014 where the
    # exact dx is 0, data 4 + 0.006 * noise in float16). Both centre xhat again: the
    # reference every statistic, the "numpy" family's GroupNorm and InstanceNorm every row,
    # its BatchNorm the channels whose mean is more than RECENTRE_ABOVE standard deviations
    # from 0 (below it the rounding moves xhat by under two roundings of ct). So dx's
    # terms, dy, mean(dy) and xhat * mean(dy * xhat), are bounded by the gradient and
    # |x - mean| * rstd, with no allowance for the offset (one of sqrt(n) * eps(ct) * max|x|
    # * rstd / REL let the loops that did not centre pass), and each element by its own
    # terms on its own statistic (helpers.gradient_terms: with the largest terms of all, max
    # rstd * max|w dy|, a dx off by 50 roundings of its own terms, only on a statistic whose
    # terms are under 5% of the largest, passed the drawn BatchNorm test on 3 seeds of 3).
    # dweight = sum(dy * xhat) and dbias each of its own channel's sums, dweight's alike:
    # with batch statistics (GroupNorm; BatchNorm's and InstanceNorm's flag, the backward's
    # last argument) xhat is centred again as for dx in every family (an allowance for the
    # offset let the families that did not centre dweight pass, 5e-2 of it off at offset
    # 1e3); with running statistics xhat is as large as the data and the given mean make it.
    batch = op == "group_norm" or bool(make_bwd(ref_f)[-1])
    dx_terms, dw_terms, db_terms = gradient_terms(op, x, dy, w, ref_f[1], ref_f[2], batch=batch)
    assert_close(fast_b[0], ref_b[0], ct, 4 * dx_terms, "dx")
    assert_close(fast_b[1], ref_b[1], ct, dw_terms, "dweight")
    assert_close(fast_b[2], ref_b[2], ct, db_terms, "dbias")
    return fast_f, fast_b


# --- drawn cases --------------------------------------------------------------------------


@st.composite
def cases(draw, kind: str):
    n = draw(st.integers(1, 4))
    if kind == "group":
        groups = draw(st.integers(1, 3))
        c = groups * draw(st.integers(1, 3))
    else:
        groups, c = 0, draw(st.integers(1, 5))
    spatial = tuple(draw(st.lists(st.integers(1, 7), min_size=1 if kind != "batch" else 0, max_size=3)))
    case = dict(
        shape=(n, c, *spatial),
        groups=groups,
        dtype=draw(st.sampled_from(FLOATS)),
        param_dtype=draw(st.sampled_from(("same", "float32", "float64"))),
        layout=draw(st.sampled_from(LAYOUTS)),
        dy_layout=draw(st.sampled_from(LAYOUTS)),
        weight=draw(st.booleans()),
        bias=draw(st.booleans()),
        training=draw(st.booleans()),
        buffers=draw(st.booleans()),
        momentum=draw(st.sampled_from((0.1, 0.5, 1.0, 0.0))),
        block_bytes=draw(st.sampled_from((None, 64, 1000))),
        threads=draw(st.sampled_from((1, 2))),
        small_copy=draw(st.sampled_from((None, 0))),  # 0: stage sample by sample
    )
    # the arrays in float64, drawn element by element so that a failure shrinks to its
    # values; make_inputs casts them to the case's dtypes and lays them out
    values = st.floats(-8, 8, width=16)
    shape = case["shape"]
    c = shape[1]
    offset = draw(hnp.arrays(np.float64, (1, c) + (1,) * (len(shape) - 2), elements=values), label="offset")
    # and on some cases a common offset of 1e4, hundreds of times the values' range: the saved
    # mean's rounding to float32 then moves xhat by ~1e-4, which dx must not carry
    offset = offset + draw(st.sampled_from((0.0, 1e4)), label="common offset")
    case["x"] = draw(hnp.arrays(np.float64, shape, elements=values, fill=st.nothing()), label="x") + offset
    case["dy"] = draw(hnp.arrays(np.float64, shape, elements=values, fill=st.nothing()), label="dy")
    # and each statistic (x's and dy's) scaled on its own, so that statistics of very
    # different sizes meet in one call
    scales = statistic_scales(f"{kind}_norm", shape, statistic_shape(f"{kind}_norm", shape, groups))
    factors = {name: draw(scales, label=f"{name} scales") for name in ("x", "dy")}
    for name in ("x", "dy"):
        case[name] = case[name] * factors[name]
    positive = st.floats(0.5, 2, width=16)
    case["w"] = draw(hnp.arrays(np.float64, c, elements=positive), label="w") if case["weight"] else None
    case["b"] = draw(hnp.arrays(np.float64, c, elements=values), label="b") if case["bias"] else None
    case["rm"] = case["rv"] = None
    if case["buffers"] or not case["training"]:
        # to the size of their channel's data (its largest factor): a buffer of its own size
        # does not hide a wrong batch statistic on a small channel
        channel = statistic_max("batch_norm", factors["x"], np.zeros(c))  # C
        case["rm"] = draw(hnp.arrays(np.float64, c, elements=values), label="running_mean") * channel
        case["rv"] = draw(hnp.arrays(np.float64, c, elements=positive), label="running_var") * channel**2
    return case


def make_inputs(case):
    """The drawn arrays in the case's dtypes and layouts."""
    dtype = case["dtype"]
    pdt = dtype if case["param_dtype"] == "same" else case["param_dtype"]
    x, dy = case["x"].astype(dtype), case["dy"].astype(dtype)
    w, b, rm, rv = (
        None if a is None else a.astype(pdt) for a in (case["w"], case["b"], case["rm"], case["rv"])
    )
    return laid_out(x, case["layout"]), laid_out(dy, case["dy_layout"]), w, b, rm, rv


def compute_dtype(*arrays):
    return np.result_type(np.float32, *(a.dtype for a in arrays if a is not None))


@settings(max_examples=DRAWN)
@given(case=cases("batch"))
def test_batch_norm_matches_generic(case):
    check_batch_norm(case)


def check_batch_norm(case):
    x, dy, w, b, rm, rv = make_inputs(case)
    n, s = x.shape[0], int(np.prod(x.shape[2:]))
    training = case["training"] or rm is None
    if training and n * s <= 1:
        x, dy = np.concatenate([x, x + 1]), np.concatenate([dy, dy])  # 2 values per channel
    ct = compute_dtype(x, w, b, rm)
    fwd = (x, rm, rv, w, b, training, case["momentum"], 1e-5)
    with config(case["threads"], case["block_bytes"], case["small_copy"]):
        f, _ = compare(
            ("batch_norm_forward", "batch_norm_backward"),
            fwd,
            lambda r: (dy, x, r[1], r[2], w, b, training),
            ct,
            x,
            dy,
            w,
        )
    # a channels-last input's output is channels-last (as torch's), others C-ordered
    last = x.ndim > 2 and np.moveaxis(x, 1, -1).flags.c_contiguous
    assert np.moveaxis(f[0], 1, -1).flags.c_contiguous if last else f[0].flags.c_contiguous
    assert f[1].shape == f[2].shape == (x.shape[1],)
    assert f[1].dtype == f[2].dtype == ct
    if not training:  # the buffers come back as given
        assert f[3] is rm and f[4] is rv


@settings(max_examples=DRAWN)
@given(case=cases("instance"))
def test_instance_norm_matches_generic(case):
    x, dy, w, b, rm, rv = make_inputs(case)
    use_input_stats = case["training"] or rm is None
    if use_input_stats and int(np.prod(x.shape[2:])) <= 1:
        x, dy = np.concatenate([x, x + 1], axis=-1), np.concatenate([dy, dy], axis=-1)
    ct = compute_dtype(x, w, b, rm)
    fwd = (x, rm, rv, w, b, use_input_stats, case["momentum"], 1e-5)
    with config(case["threads"], case["block_bytes"], case["small_copy"]):
        f, _ = compare(
            ("instance_norm_forward", "instance_norm_backward"),
            fwd,
            lambda r: (dy, x, r[1], r[2], w, b, use_input_stats),
            ct,
            x,
            dy,
            w,
        )
    stats = x.shape[:2] if use_input_stats else x.shape[1:2]
    assert f[1].shape == f[2].shape == stats and f[1].dtype == ct


@settings(max_examples=DRAWN)
@given(case=cases("group"))
def test_group_norm_matches_generic(case):
    check_group_norm(case)


def group_norm_results(case):
    """``(x, dy, groups, ct, forward results, backward results)`` of GroupNorm on the
    case's inputs, compared with the generic kernels (``compare``)."""
    x, dy, w, b, _, _ = make_inputs(case)
    g = case["groups"]
    ct = compute_dtype(x, w, b)
    with config(case["threads"], case["block_bytes"], case["small_copy"]):
        f, fb = compare(
            ("group_norm_forward", "group_norm_backward"),
            (x, g, w, b, 1e-5),
            lambda r: (dy, x, g, r[1], r[2], w, b),
            ct,
            x,
            dy,
            w,
        )
    return x, dy, g, ct, f, fb


def check_group_norm(case):
    x, _, g, ct, f, _ = group_norm_results(case)
    assert f[1].shape == f[2].shape == (x.shape[0], g) and f[1].dtype == ct
    # channels-last samples of SAMPLE_VALUES values and more keep the layout (as torch's),
    # smaller ones and other layouts come back C-ordered
    by_samples = channels_last(x) and x.size // x.shape[0] >= columns.SAMPLE_VALUES
    assert np.moveaxis(f[0], 1, -1).flags.c_contiguous if by_samples else f[0].flags.c_contiguous


def channels_last(a: np.ndarray) -> bool:
    return a.ndim > 2 and np.moveaxis(a, 1, -1).flags.c_contiguous


@settings(max_examples=DRAWN)
@given(case=cases("group"), instance=st.booleans(), dy_last=st.booleans())
def test_channels_last_samples_match_generic(case, instance, dy_last):
    """GroupNorm and InstanceNorm (input statistics) on channels-last input, every sample
    taken as its (S, C) rows (``numpy_fast_columns.group_forward``/``_backward``, here
    from one value up): as the reference to rounding, the output channels-last, and dx
    too with a channels-last gradient (another gradient goes the rows' way, C-ordered)."""
    case = {**case, "layout": "channels_last", "dy_layout": "channels_last" if dy_last else "C"}
    if instance:
        case["groups"] = case["shape"][1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(columns, "SAMPLE_VALUES", 1)
        x, dy, _, _, f, fb = group_norm_results(case)
    last = channels_last(x) and x.size > x.shape[0] * x.shape[1]  # (S = 1: C-ordered too)
    assert np.moveaxis(f[0], 1, -1).flags.c_contiguous if last else f[0].flags.c_contiguous
    both = last and channels_last(dy)
    assert np.moveaxis(fb[0], 1, -1).flags.c_contiguous if both else fb[0].flags.c_contiguous


def test_channels_last_samples_take_their_own_sweep(monkeypatch):
    """Which way channels-last GroupNorm goes: samples of ``SAMPLE_VALUES`` values and
    more by samples (forward and backward), the output and dx channels-last; smaller ones
    the rows' way, C-ordered."""
    calls: list[str] = []
    for name in ("group_forward", "group_backward"):
        f = getattr(columns, name)
        monkeypatch.setattr(columns, name, lambda *a, f=f, name=name: (calls.append(name), f(*a))[1])
    rng = np.random.default_rng(3)
    for shape, expected in (((2, 64, 32, 32), ["group_forward", "group_backward"]), ((2, 8, 4, 4), [])):
        x = laid_out(rng.normal(size=shape).astype(np.float32), "channels_last")
        calls.clear()
        y, mean, rstd = F.group_norm_forward(x, 4)
        dx = F.group_norm_backward(x, x, 4, mean, rstd)[0]
        assert calls == expected, (shape, calls)
        for a in (y, dx):
            assert np.moveaxis(a, 1, -1).flags.c_contiguous if expected else a.flags.c_contiguous
        ref = generic_kernel("group_norm_forward")(xp, x, 4, None, None, 1e-5)[0]
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


# --- sizes spanning several default blocks and both threads -------------------------------

LARGE = (16, 16, 64, 64)  # 4 MiB of float32: 8+ default blocks, two thread chunks


def run_all(x, dy, w, b, rm, rv, groups=4):
    """Every fast forward and backward on the same data; a flat list of the outputs."""
    out = []
    for training in (True, False):
        f = F.batch_norm_forward(x, rm, rv, w, b, training, 0.1, 1e-5)
        out += [*f, *F.batch_norm_backward(dy, x, f[1], f[2], w, b, training)]
        f = F.instance_norm_forward(x, rm, rv, w, b, training, 0.1, 1e-5)
        out += [*f, *F.instance_norm_backward(dy, x, f[1], f[2], w, b, training)]
    f = F.group_norm_forward(x, groups, w, b, 1e-5)
    out += [*f, *F.group_norm_backward(dy, x, groups, f[1], f[2], w, b)]
    return out


@pytest.fixture(scope="module")
def large():
    rng = np.random.default_rng(7)
    c = LARGE[1]
    x = (rng.normal(size=LARGE) * 2 + rng.normal(size=(1, c, 1, 1))).astype(np.float32)
    dy = rng.normal(size=LARGE).astype(np.float32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)
    rm, rv = rng.normal(size=c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    return x, dy, w, b, rm, rv


@pytest.mark.parametrize("layout", ["C", "F", "sliced"])
@pytest.mark.parametrize("kind", ["batch", "instance", "group"])
def test_large_inputs_match_generic(large, kind, layout):
    x, dy, w, b, rm, rv = large
    x, dy = laid_out(x, layout), laid_out(dy, layout)
    with config(threads=2):
        for training in (True, False):
            if kind == "batch":
                ops = ("batch_norm_forward", "batch_norm_backward")
                args = (x, rm, rv, w, b, training, 0.1, 1e-5)
            elif kind == "instance":
                ops = ("instance_norm_forward", "instance_norm_backward")
                args = (x, rm, rv, w, b, training, 0.1, 1e-5)
            else:
                ops = ("group_norm_forward", "group_norm_backward")
                args = (x, 4, w, b, 1e-5)

            def bwd(r, training=training):
                if kind == "group":
                    return (dy, x, 4, r[1], r[2], w, b)
                return (dy, x, r[1], r[2], w, b, training)

            compare(ops, args, bwd, np.float32, x, dy, w)
            if kind == "group":
                break


def test_deterministic_for_a_thread_count_and_close_across_counts(large):
    with config(threads=2):
        first = run_all(*large)
        second = run_all(*large)
    for a, b in zip(first, second, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
    with config(threads=1):
        single = run_all(*large)
    for a, b in zip(first, single, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(b))))


def test_thread_count_is_restored_by_config():
    before = _threads.get_num_threads()
    with config(threads=1):
        assert _threads.get_num_threads() == 1
    assert _threads.get_num_threads() == before


# --- accuracy, memory, dispatch, edge cases -----------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_as_accurate_as_generic_with_a_large_common_offset(offset):
    """Against a float64 reference, float32 errors stay within a small multiple of the
    generic kernels' (the mean is subtracted before anything is squared or scaled)."""
    rng = np.random.default_rng(3)
    shape, c = (6, 8, 20, 20), 8
    x = (rng.normal(size=shape) + offset).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)

    def everything(x_, dy_, w_, b_, generic=False):
        def k(op):
            return generic_kernel(op) if generic else kernel(op, xp)

        f = k("batch_norm_forward")(xp, x_, None, None, w_, b_, True, 0.1, 1e-5)
        out = [*f[:3], *k("batch_norm_backward")(xp, dy_, x_, f[1], f[2], w_, b_, True)]
        f = k("instance_norm_forward")(xp, x_, None, None, w_, b_, True, 0.1, 1e-5)
        out += [*f[:3], *k("instance_norm_backward")(xp, dy_, x_, f[1], f[2], w_, b_, True)]
        f = k("group_norm_forward")(xp, x_, 2, w_, b_, 1e-5)
        return [*out, *f, *k("group_norm_backward")(xp, dy_, x_, 2, f[1], f[2], w_, b_)]

    ref = everything(*(a.astype(np.float64) for a in (x, dy, w, b)), generic=True)
    ours = everything(x, dy, w, b)
    gen = everything(x, dy, w, b, generic=True)
    for r, o, g in zip(ref, ours, gen, strict=True):
        scale = float(np.max(np.abs(r)))
        err_ours = float(np.max(np.abs(o - r))) / scale
        err_gen = float(np.max(np.abs(g - r))) / scale
        assert err_ours <= 4 * err_gen + 8 * ulp(np.float32), (err_ours, err_gen)


def test_peak_memory_is_a_fraction_of_the_input():
    """Forward + backward allocate, besides their results, a few blocks per thread and
    per-row statistics: no full-size temporary."""
    rng = np.random.default_rng(0)
    shape, c = (16, 32, 32, 32), 32
    x = rng.normal(size=shape).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    runs = {
        "batch": lambda: (
            f := F.batch_norm_forward(x, rm, rv, w, b, True),
            F.batch_norm_backward(dy, x, f[1], f[2], w, b, True),
        ),
        "instance": lambda: (
            f := F.instance_norm_forward(x, rm, rv, w, b, True),
            F.instance_norm_backward(dy, x, f[1], f[2], w, b, True),
        ),
        "group": lambda: (
            f := F.group_norm_forward(x, 8, w, b),
            F.group_norm_backward(dy, x, 8, f[1], f[2], w, b),
        ),
    }
    with config(threads=2, block_bytes=32 * 1024):
        for name, run in runs.items():
            run()  # the thread pool and imports, outside the measure
            tracemalloc.start()
            try:
                fwd, bwd = run()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            kept = sum(a.nbytes for a in (*fwd, *bwd) if isinstance(a, np.ndarray))
            assert (peak - kept) / x.nbytes <= 0.25, name


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_peak_memory_of_batch_norm1d(dtype, training):
    """BatchNorm1d's (N, C) input has one value per row: the backward's per-row sums were
    two arrays as large as the input (2.1x its bytes in float32, 4.6x in float16)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16384, 64)).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    w, b = np.ones(64, dtype), np.zeros(64, dtype)
    with config(threads=2, block_bytes=32 * 1024):
        rm, rv = np.zeros(64, dtype), np.ones(64, dtype)
        f = F.batch_norm_forward(x, rm, rv, w, b, training)
        F.batch_norm_backward(dy, x, f[1], f[2], w, b, training)  # the thread pool, outside the measure
        tracemalloc.start()
        try:
            got = F.batch_norm_backward(dy, x, f[1], f[2], w, b, training)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    kept = sum(a.nbytes for a in got if isinstance(a, np.ndarray))
    assert (peak - kept) / x.nbytes <= 0.25


@pytest.mark.parametrize("op", OPS)
def test_registered_for_numpy(op):
    assert kernel(op, xp) is getattr(fast, op)
    assert generic_kernel(op) is not getattr(fast, op)


def test_empty_inputs_give_the_generic_results():
    """An empty batch through every channel operation the public API lets through
    (BatchNorm's batch statistics of no values never reach a kernel), forward and
    backward: as the reference."""
    x = np.zeros((0, 3, 4), np.float32)
    for op, args, bwd in op_calls(x, x, None, None, 3):
        if op in ("layer_norm", "rms_norm") or (op == "batch_norm" and args[5]):
            continue  # rows, not channels (test_fast_layer_norm); batch statistics of no values
        ours_f = kernel(op + "_forward", xp)(xp, *args)
        ref_f = generic_kernel(op + "_forward")(xp, *args)
        ours_b = kernel(op + "_backward", xp)(xp, *bwd(ref_f))
        ref_b = generic_kernel(op + "_backward")(xp, *bwd(ref_f))
        same_results((*ours_f, *ours_b), (*ref_f, *ref_b), op)  # exactly (NaN buffers as the reference's)


def test_tiny_shapes():
    """One row; two values per channel; one value per row with several rows."""
    rng = np.random.default_rng(1)
    for shape in [(1, 1, 2), (2, 1), (1, 3, 2), (5, 4, 1)]:
        x = rng.normal(size=shape)
        dy = rng.normal(size=shape)
        ours = F.batch_norm_forward(x, None, None, training=True)
        ref = generic_kernel("batch_norm_forward")(xp, x, None, None, None, None, True, 0.1, 1e-5)
        np.testing.assert_allclose(ours[0], ref[0], rtol=1e-12, atol=1e-12)
        dx = F.batch_norm_backward(dy, x, ours[1], ours[2], training=True)[0]
        dx_ref = generic_kernel("batch_norm_backward")(xp, dy, x, ref[1], ref[2], None, None, True)[0]
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-9, atol=1e-9)
        y, _mean, _rstd = F.group_norm_forward(x, 1)
        y_ref = generic_kernel("group_norm_forward")(xp, x, 1, None, None, 1e-5)[0]
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)


def test_an_infinite_gradient_gives_the_references_infinities():
    # sum(dy*x) - mean*sum(dy) made inf - inf: dweight NaN where the reference (and torch)
    # give -inf, and dx all NaN
    x = np.array([[[0.5, -1.0]], [[2.0, 1.5]]], np.float32)
    dy = np.array([[[np.inf, 1.0]], [[1.0, 1.0]]], np.float32)
    w, b = np.ones(1, np.float32), np.zeros(1, np.float32)
    mean, rstd = generic_kernel("batch_norm_forward")(xp, x, None, None, w, b, True, 0.1, 1e-5)[1:3]
    with np.errstate(all="ignore"):
        ref = generic_kernel("batch_norm_backward")(xp, dy, x, mean, rstd, w, b, True)
        ours = fast.batch_norm_backward(xp, dy, x, mean, rstd, w, b, True)
    same_results(ours, ref, "batch_norm_backward")
    assert np.isneginf(ours[1][0])


def _same_non_finite(ours, ref, what: str) -> None:
    """NaN, +inf and -inf in the same places; finite values close (float32 rounding of the
    largest finite reference value: what one channel's infinity leaves of the others)."""
    for i, (a, c) in enumerate(zip(ours, ref, strict=True)):
        if c is None:
            assert a is None, (what, i)
            continue
        a, c = a.astype(np.float64), c.astype(np.float64)
        for mask in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(mask(a), mask(c)), (what, i, mask.__name__)
        finite = np.isfinite(c)
        scale = float(np.max(np.abs(c[finite]), initial=1.0))
        np.testing.assert_allclose(a[finite], c[finite], rtol=0, atol=1e-3 * scale, err_msg=f"{what} [{i}]")


def _check_non_finite(case, arrays, in_dy: bool, value: float, data, channel_op: str) -> None:
    """``value`` put at a drawn place of dy (``in_dy``) or x; the backward with batch
    statistics (GroupNorm where the case has groups, else ``channel_op``), the fast kernel's
    against the generic one's (``_same_non_finite``)."""
    x, dy, w, b = arrays
    target = dy if in_dy else x
    index = data.draw(st.tuples(*(st.integers(0, d - 1) for d in target.shape)), label="index")
    target[index] = value
    op = "group_norm" if case["groups"] else channel_op
    with config(case["threads"], case["block_bytes"], case["small_copy"]):
        ours, ref = _fast_and_generic_backward(op, x, dy, w, b, case["groups"])
    _same_non_finite(ours, ref, f"{op}_backward")


def _fast_and_generic_backward(op: str, x, dy, w, b, groups: int):
    """The backward of ``op`` (batch statistics; ``groups`` for GroupNorm) from the generic
    forward's statistics: ``(fast kernel's results, generic kernel's results)``."""
    if op == "group_norm":
        fwd, bwd = (x, groups, w, b, 1e-5), lambda r: (dy, x, groups, r[1], r[2], w, b)
    else:
        fwd, bwd = (x, None, None, w, b, True, 0.1, 1e-5), lambda r: (dy, x, r[1], r[2], w, b, True)
    with np.errstate(all="ignore"):
        stats = generic_kernel(f"{op}_forward")(xp, *fwd)
        ref = generic_kernel(f"{op}_backward")(xp, *bwd(stats))
        ours = kernel(f"{op}_backward", xp)(xp, *bwd(stats))
    return ours, ref


@settings(max_examples=DRAWN)
@given(
    case=st.sampled_from(("batch", "instance", "group")).flatmap(cases),
    value=st.sampled_from((np.inf, -np.inf, np.nan)),
    in_dy=st.booleans(),
    data=st.data(),
)
def test_a_non_finite_value_gives_the_references_nan_and_inf(case, value, in_dy, data):
    """An infinite or NaN value in dy or x, with batch statistics: the fast backward gives
    NaN and +-inf where the generic kernel gives them, in dx, dweight and dbias. (The
    folded coefficients added inf to -inf: a whole channel or group of dx was NaN where the
    reference and PyTorch mix NaN and +-inf; the sums now send such inputs to the generic
    kernel.)"""
    x, dy, w, b, _, _ = make_inputs(case)
    if x.ndim == 2:  # BatchNorm1d's (N, C): two samples at least
        x, dy = np.concatenate([x, x + 1]), np.concatenate([dy, dy])
    elif int(np.prod(x.shape[2:])) <= 1:  # two values per instance at least
        x, dy = np.concatenate([x, x + 1], axis=-1), np.concatenate([dy, dy], axis=-1)
    batch = x.ndim == 2 or data.draw(st.booleans(), label="batch")
    _check_non_finite(case, (x, dy, w, b), in_dy, value, data, "batch_norm" if batch else "instance_norm")


@settings(max_examples=DRAWN)
@given(
    case=st.sampled_from(("instance", "group")).flatmap(cases),
    value=st.sampled_from((np.inf, -np.inf, np.nan)),
    in_dy=st.booleans(),
    data=st.data(),
)
def test_a_non_finite_value_in_channels_last_samples(case, value, in_dy, data):
    """As above, on the channels-last samples' own sweep (``columns.group_backward``, which
    large samples take: here every sample, SAMPLE_VALUES set to 1)."""
    case = {**case, "layout": "channels_last", "dy_layout": "channels_last"}
    x, dy, w, b, _, _ = make_inputs(case)
    assume(int(np.prod(x.shape[2:])) > 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(columns, "SAMPLE_VALUES", 1)
        _check_non_finite(case, (x, dy, w, b), in_dy, value, data, "instance_norm")


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm", "group_norm"])
def test_a_gradient_whose_sums_overflow_float32_gives_the_references_finite_dx(op):
    """dy of +-3e37 in float32: sum(dy) overflows float32 (the reference's dbias is inf too),
    while dx is finite. The fast kernels' folded coefficients made dx -inf and NaN; such sums
    send the input to the generic kernel, whose finite dx they now return."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 40)).astype(np.float32)
    dy = (3e37 * np.sign(rng.standard_normal((4, 3, 40)))).astype(np.float32)
    w = np.ones(3, np.float32)
    ours, ref = _fast_and_generic_backward(op, x, dy, w, w, 3)
    assert np.isfinite(ref[0]).all()
    _same_non_finite(ours, ref, f"{op}_backward")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "op, training, layout",  # (InstanceNorm with input statistics: GroupNorm's sweeps)
    [
        ("batch_norm", True, "channels_last"),
        ("batch_norm", False, "channels_last"),
        ("batch_norm", True, "batch_norm1d"),
        ("batch_norm", False, "batch_norm1d"),
        ("instance_norm", False, "channels_last"),
    ],
)
@pytest.mark.parametrize("many_blocks", [False, True])
def test_channel_columns_keep_the_layout_with_the_references_results(
    dtype, op, training, layout, many_blocks
):
    """BatchNorm on channels-last input (and InstanceNorm with running statistics) was
    staged into (N, C, S) rows block by block (2-3x the C-ordered time) and its output
    and dx came back C-ordered; BatchNorm1d's (N, C) rows of one value took float64
    statistics in one thread (3x PyTorch's time). Both now run over (M, C) columns
    (``numpy_fast_columns``): the reference's results, a channels-last output and dx for
    channels-last input (as PyTorch's), bitwise the same for 1, 2 and 3 threads over
    blocks of 1 KB; a constant channel and one of offset 1e3 included. ``many_blocks``:
    ``TILE_BLOCKS`` blocks of rows or more, where the per-channel coefficients are
    repeated on a block's rows (no drawn case has that many rows)."""
    rng = np.random.default_rng(5)
    if many_blocks:  # 1100 rows (1100 = 17 * 64 + 12)
        shape = (22, 12, 5, 10) if layout == "channels_last" else (1100, 12)
    else:
        shape = (6, 12, 5, 7) if layout == "channels_last" else (211, 12)
    x = rng.normal(size=shape)
    x[:, 3] += 1e3
    x[:, 5] = 0.3
    x = x.astype(dtype)
    dy = rng.normal(size=shape).astype(dtype)
    if layout == "channels_last":
        x, dy = laid_out(x, "channels_last"), laid_out(dy, "channels_last")
    w, b = np.linspace(0.5, 1.5, 12).astype(dtype), np.linspace(-1, 1, 12).astype(dtype)
    rm, rv = np.linspace(-1, 1, 12).astype(dtype), np.linspace(0.5, 2, 12).astype(dtype)
    if op == "batch_norm":
        fwd_args = (x, rm.copy(), rv.copy(), w, b, training, 0.1, 1e-5)
        ops = ("batch_norm_forward", "batch_norm_backward")
    else:
        fwd_args = (x, rm.copy(), rv.copy(), w, b, False, 0.1, 1e-5)
        ops = ("instance_norm_forward", "instance_norm_backward")

    def bwd_args(r):
        return (dy, x, r[1], r[2], w, b, training)

    ct = compute_dtype(x, w, b, rm)
    # blocks of 1 KB; with many_blocks, of 64 rows of all 12 channels (a smaller block
    # would be taken in panels of columns, which broadcast)
    block_bytes = 64 * 12 * np.dtype(ct).itemsize if many_blocks else 1024
    results = []
    for threads in (1, 2, 3):
        with config(threads, block_bytes=block_bytes):
            f, d = compare(ops, fwd_args, bwd_args, ct, x, dy, w)
        for a in (f[0], d[0]):
            assert (
                np.moveaxis(a, 1, -1).flags.c_contiguous
                if layout == "channels_last"
                else a.flags.c_contiguous
            )
        results.append([a for a in (*f, *d) if a is not None])
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, c)
    if training:  # the constant channel: exactly the bias, a variance of exactly 0
        y = results[0][0]
        np.testing.assert_array_equal(y[:, 5], np.broadcast_to(b[5], y[:, 5].shape))
        assert results[0][4][5] == np.asarray((1 - 0.1) * float(rv[5])).astype(dtype)


def _columns_layouts(x: np.ndarray) -> list[np.ndarray]:
    """(M, C) data as BatchNorm1d's input and as a channels-last (M/64, C, 8, 8) input."""
    M, C = x.shape
    return [x, np.moveaxis(x[: M - M % 64].reshape(-1, 8, 8, C), -1, 1)]


def test_channel_columns_near_constant_channels_keep_their_variance():
    """A block's mean was one float32 sum of up to 4096 rows, hundreds of ulps off at a
    large offset: a channel whose values differ by an ulp here and there (quantized data)
    got a variance 6-60x too large, or negative (rstd NaN with eps=0). The float64 sums of
    128-row sums keep it within a few ulps of the float64 variance, and never below 0."""
    rng = np.random.default_rng(1)
    for base in (1600.3, 5000.3, -771.7):
        x = np.full((4000, 8), base, np.float32)
        up = rng.uniform(size=x.shape) < 0.003
        x[up] = np.nextafter(np.float32(base), np.float32(np.inf))
        for a in _columns_layouts(x):
            rm, rv = np.zeros(8, np.float32), np.ones(8, np.float32)
            _, _, rstd, _, rv = F.batch_norm_forward(a, rm, rv, None, None, True, 1.0, 0.0)
            x64 = np.moveaxis(a, 1, -1).reshape(-1, 8).astype(np.float64)
            want = x64.var(axis=0) * (len(x64) / (len(x64) - 1))  # the unbiased batch variance
            assert np.isfinite(rstd).all()
            np.testing.assert_allclose(rv, want, rtol=1e-5)


def test_channel_columns_of_tiny_values_keep_their_variance():
    """Squares of float32 values below ~1e-19 underflow: such columns' M2 is taken again
    in float64 (rstd was 2e-3 off at 1e-22 and NaN at 1e-25 with eps=0)."""
    x0 = np.random.default_rng(4).normal(size=(256, 5))
    for scale in (1e-22, 1e-25, 1e-30):
        x = (x0 * scale).astype(np.float32)
        for a in _columns_layouts(x):
            x64 = np.moveaxis(a, 1, -1).reshape(-1, 5).astype(np.float64)
            _, _, rstd, _, _ = F.batch_norm_forward(a, None, None, None, None, True, 0.1, 0.0)
            np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(axis=0)), rtol=1e-6)


def test_channel_columns_a_float64_constant_channel_over_blocks_is_exact():
    """A float64 channel of one value over several blocks: its mean is that value and its
    variance exactly 0, so the output is exactly the bias (the blocks' weighted mean was
    off in the last place: variance -1.4e-44, and y not the bias)."""
    x = np.random.default_rng(2).normal(size=(10001, 2))
    b = np.array([0.25, -0.5])
    for value in (0.1, 1e3 + 0.3, -7.7e-5):
        x[:, 0] = value
        y, mean, _, _, rv = F.batch_norm_forward(x, np.zeros(2), np.ones(2), None, b, True, 1.0, 1e-5)
        assert mean[0] == value and rv[0] == 0.0
        np.testing.assert_array_equal(y[:, 0], b[0])


def test_channel_columns_of_very_wide_input_stay_within_a_fraction_of_it():
    """With one row per block (from 49152 float32 channels) the per-block statistics
    were as large as the input, four times over: (64, 50000) took 14x its bytes beyond
    the outputs (and 4x the time of the float64 path before). Blocks keep 64 rows at least,
    in panels of columns."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 50000)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w, b = np.ones(50000, np.float32), np.zeros(50000, np.float32)
    with config(threads=1):
        f = F.batch_norm_forward(x, None, None, w, b, True)
        F.batch_norm_backward(dy, x, f[1], f[2], w, b, True)
        tracemalloc.start()
        try:
            f = F.batch_norm_forward(x, None, None, w, b, True)
            d = F.batch_norm_backward(dy, x, f[1], f[2], w, b, True)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    kept = sum(a.nbytes for a in (*f, *d) if isinstance(a, np.ndarray))
    assert (peak - kept) / x.nbytes <= 0.5
    with use_kernels("reference"):
        want = F.batch_norm_forward(x, None, None, w, b, True)[0]
    np.testing.assert_allclose(f[0], want, rtol=1e-5, atol=1e-5)


def test_channel_columns_near_float32s_largest_give_the_references_results():
    """Sums of 128 rows of +-3e38 overflow float32 to +inf in one part and -inf in
    another: their total was NaN, which the float64 redo (of infinite totals) missed:
    mean, rstd, y and dbias NaN where the reference is finite."""
    x = np.zeros((256, 2), np.float32)
    x[:128, 0], x[128:, 0] = 3e38, -3e38
    x[:, 1] = np.linspace(-1, 1, 256)
    dy = np.ones_like(x)
    dy[128:, 0] = -1.0
    w, b = np.ones(2, np.float32), np.zeros(2, np.float32)
    results = []
    for family in ("numpy", "reference"):
        with use_kernels(family):
            f = F.batch_norm_forward(x, None, None, w, b, True)
            results.append([*f[:3], *F.batch_norm_backward(dy * 3e37, x, f[1], f[2], w, b, True)])
    for got, want in zip(*results, strict=True):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


def test_channel_columns_a_single_row_of_inf_has_the_references_nan_variance():
    """One row per channel (a SyncBatchNorm rank's share) was taken as a constant whatever
    its value: an inf got variance 0, where the generic kernel (and torch) give NaN."""
    x = np.array([[np.inf, 1.0, -2.0]], np.float32)
    got = kernel("sync_batch_norm_moments", xp)(xp, x, np.dtype(np.float32))
    want = generic_kernel("sync_batch_norm_moments")(xp, x, np.dtype(np.float32))
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
