"""``out=`` in the functional forward and backward functions, on every kernel family:
written in place and returned, checked like torch's ``out=`` (shape, dtype, backend),
any layout, aliasing the input allowed."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import channels_last
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
import npnorm.functional as F

FAMILIES = npnorm.kernels_available()


def _rng():
    return np.random.default_rng(4)


def cases(x: np.ndarray, dy: np.ndarray):
    """(name, forward(out), backward(out)) for every functional pair; the backward takes
    its statistics from a forward without ``out``."""
    c = x.shape[1]
    d = x.shape[-1]
    w, b = np.full(c, 1.5, x.dtype), np.full(c, 0.5, x.dtype)
    wd, bd = np.full(d, 1.5, x.dtype), np.full(d, 0.5, x.dtype)
    rm, rv = np.zeros(c, x.dtype), np.ones(c, x.dtype)
    ln = F.layer_norm_forward(x, d, wd, bd)
    rms = F.rms_norm_forward(x, d, wd)
    gn = F.group_norm_forward(x, 2, w, b)
    yield (
        "layer_norm",
        lambda out: F.layer_norm_forward(x, d, wd, bd, out=out),
        lambda out: F.layer_norm_backward(dy, x, d, ln[1], ln[2], wd, bd, out=out),
    )
    yield (
        "rms_norm",
        lambda out: F.rms_norm_forward(x, d, wd, out=out),
        lambda out: F.rms_norm_backward(dy, x, d, rms[1], wd, out=out),
    )
    yield (
        "group_norm",
        lambda out: F.group_norm_forward(x, 2, w, b, out=out),
        lambda out: F.group_norm_backward(dy, x, 2, gn[1], gn[2], w, b, out=out),
    )
    for training in (True, False):
        bn = F.batch_norm_forward(x, rm, rv, w, b, training)
        inn = F.instance_norm_forward(x, rm, rv, w, b, training)
        yield (
            f"batch_norm training={training}",
            lambda out, t=training: F.batch_norm_forward(x, rm, rv, w, b, t, out=out),
            lambda out, t=training, s=bn: F.batch_norm_backward(dy, x, s[1], s[2], w, b, t, out=out),
        )
        yield (
            f"instance_norm use_input_stats={training}",
            lambda out, t=training: F.instance_norm_forward(x, rm, rv, w, b, t, out=out),
            lambda out, t=training, s=inn: F.instance_norm_backward(dy, x, s[1], s[2], w, b, t, out=out),
        )


def same(a, b, name):
    """Bitwise equal: where the output is written does not change any result (the
    "numpy" family's LayerNorm took its row sums in a strided ``out`` and rounded them
    otherwise; numba's channels-last BatchNorm, GroupNorm and InstanceNorm took another
    loop for an ``out`` of another layout)."""
    np.testing.assert_array_equal(a, b, err_msg=name)


def layouts(shape, dtype):
    """Output arrays of several layouts: C, Fortran, strided views (every other value,
    reversed), channels-last."""
    yield np.empty(shape, dtype)
    yield np.asfortranarray(np.empty(shape, dtype))
    yield np.empty((*shape[:-1], 2 * shape[-1]), dtype)[..., ::2]
    yield np.empty(shape, dtype)[..., ::-1]
    yield channels_last(np.empty(shape, dtype))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["C", "channels-last"])
def test_out_is_written_and_returned(family, dtype, layout):
    rng = _rng()
    # 8 channels: float64 channels-last rows of 64 bytes, which numba's GroupNorm and
    # InstanceNorm take by samples
    x = (rng.normal(size=(3, 8, 5, 6)) + 2).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    if layout == "channels-last":
        x, dy = channels_last(x), channels_last(dy)
    with npnorm.use_kernels(family):
        for name, fwd, bwd in cases(x, dy):
            fresh_f, fresh_b = fwd(None), bwd(None)
            for out in layouts(x.shape, x.dtype):
                res = fwd(out)
                assert res[0] is out, name
                same(out, fresh_f[0], name)
                for a, c in zip(res[1:], fresh_f[1:], strict=True):
                    same(a, c, name)
            for out in layouts(x.shape, x.dtype):
                res = bwd(out)
                assert res[0] is out, name
                same(out, fresh_b[0], name)
                for a, c in zip(res[1:], fresh_b[1:], strict=True):
                    if c is None:
                        assert a is None
                    else:
                        same(a, c, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_out_takes_an_empty_batch_as_the_functions_do(family):
    # NumPy gives np.empty((0, 4, 5, 6)) zero strides: out= was refused as a broadcast array
    x = np.empty((0, 4, 5, 6), np.float32)
    assert 0 in x.strides
    with npnorm.use_kernels(family):
        for name, fwd, bwd in cases(x, np.empty_like(x)):
            out = np.empty_like(x)
            assert fwd(out)[0] is out, name
            assert bwd(out)[0] is out, name
    with pytest.raises(ValueError, match="zero stride"):  # a broadcast out still is refused
        F.layer_norm_forward(np.ones((2, 3)), 3, out=np.broadcast_to(np.zeros(3), (2, 3)))


@pytest.mark.parametrize("family", FAMILIES)
def test_out_with_a_new_axis_of_a_strided_array(family):
    # x[:, None] gives the new axis of length 1 a zero stride: no element repeats, so it is
    # taken (a rule refusing every zero stride refused it, where the array is not C-ordered)
    x = np.random.default_rng(0).standard_normal((3, 1, 5))
    out = np.zeros((5, 3)).T[:, None, :]
    assert out.strides[1] == 0 and not out.flags.c_contiguous
    with npnorm.use_kernels(family):
        want = F.layer_norm_forward(x, 5)[0]
        assert F.layer_norm_forward(x, 5, out=out)[0] is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["C", "channels-last"])
def test_out_may_be_the_input_itself(family, dtype, layout):
    """In place (``out=x``, ``out=dy``): the result is what a fresh output gets (8
    channels: float64 channels-last rows of 64 bytes, which numba's GroupNorm and
    InstanceNorm take by samples, where an ``out`` sharing the input's memory took
    another loop)."""
    rng = _rng()
    x0 = (rng.normal(size=(4, 8, 3, 5)) * 2 + 1).astype(dtype)
    dy0 = rng.normal(size=x0.shape).astype(dtype)
    if layout == "channels-last":
        x0, dy0 = channels_last(x0), channels_last(dy0)
    with npnorm.use_kernels(family):
        for i, (name, fwd, bwd) in enumerate(cases(x0.copy(order="K"), dy0.copy(order="K"))):
            fresh_f, fresh_b = fwd(None), bwd(None)
            # fresh copies, so that the in-place call cannot change the other case's data
            x, dy = x0.copy(order="K"), dy0.copy(order="K")
            fwd_x, bwd_x = list(cases(x, dy))[i][1:]
            expected_b = bwd_x(None)[0].copy()
            got = fwd_x(x)
            assert got[0] is x
            for a, c in zip((x, *got[1:]), fresh_f, strict=True):
                same(a, c, name)
            x, dy = x0.copy(order="K"), dy0.copy(order="K")
            fwd_x, bwd_x = list(cases(x, dy))[i][1:]
            got = bwd_x(dy)
            assert got[0] is dy
            same(dy, expected_b, name)
            for a, c in zip((dy, *got[1:]), fresh_b, strict=True):
                if c is None:
                    assert a is None
                else:
                    same(a, c, name)


def test_out_overlapping_the_input_partly():
    """A view that overlaps the input shifted by one row still gets the right values."""
    rng = _rng()
    buf = rng.normal(size=(9, 8)).astype(np.float32)
    x = buf[:8]
    expected = F.layer_norm(x.copy(), 8)
    for family in FAMILIES:
        data = buf.copy()
        with npnorm.use_kernels(family):
            F.layer_norm_forward(data[:8], 8, out=data[1:])
        np.testing.assert_allclose(data[1:], expected, rtol=1e-6, atol=1e-6, err_msg=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_out_is_refused_before_anything_is_written(family):
    x = np.ones((2, 3, 4), np.float32)
    wrong_shape, wrong_dtype = np.full((2, 3, 5), 7, np.float32), np.full(x.shape, 7.0)
    with npnorm.use_kernels(family):
        with pytest.raises(ValueError, match=r"out must have the input's shape \(2, 3, 4\), got \(2, 3, 5\)"):
            F.layer_norm_forward(x, 4, out=wrong_shape)
        with pytest.raises(TypeError, match="out must have the input's dtype float32, got float64"):
            F.batch_norm_forward(x, None, None, training=True, out=wrong_dtype)
        assert (wrong_shape == 7).all() and (wrong_dtype == 7).all()
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(x.shape, np.float32)
            ro.flags.writeable = False
            F.group_norm_forward(x, 3, out=ro)
        with pytest.raises(TypeError, match="out"):
            F.rms_norm_forward(x, 4, out=[[0.0] * 4] * 6)
        dx = np.full(x.shape, 7.0, np.float32)
        _, mean, rstd = F.layer_norm_forward(x, 4)
        with pytest.raises(ValueError, match="out must have the input's shape"):
            F.layer_norm_backward(x, x, 4, mean, rstd, out=dx[:1])
        assert (dx == 7).all()


def test_out_from_another_backend_is_a_type_error():
    strict = pytest.importorskip("array_api_strict")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match="out must be an array of the input's backend"):
        F.layer_norm_forward(x, 4, out=strict.zeros((2, 4), dtype=strict.float32))


def test_out_on_array_api_strict():
    strict = pytest.importorskip("array_api_strict")
    x = strict.asarray(np.random.default_rng(0).normal(size=(3, 4)), dtype=strict.float64)
    out = strict.zeros((3, 4), dtype=strict.float64)
    y = F.layer_norm_forward(x, 4, out=out)[0]
    assert y is out
    np.testing.assert_allclose(np.asarray(out), np.asarray(F.layer_norm(x, 4)), rtol=1e-12)


def test_out_is_keyword_only():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError):
        F.layer_norm_forward(x, 4, None, None, 1e-5, np.empty_like(x))  # type: ignore[misc]


def test_out_that_requires_grad_is_refused_as_torchs_out_refuses_it():
    torch = pytest.importorskip("torch")
    x = torch.ones((2, 4))
    out = torch.full((2, 4), 7.0, requires_grad=True)  # e.g. a parameter: was written silently
    with pytest.raises(RuntimeError, match="out requires grad"):
        F.layer_norm_forward(x, 4, out=out)
    with pytest.raises(RuntimeError, match="out requires grad"):
        F.batch_norm_forward(x, None, None, training=True, out=out)
    with pytest.raises(RuntimeError):  # torch's own
        torch.add(x, x, out=out)
    assert bool((out == 7).all())
    with torch.no_grad():  # torch allows it there, and so does npnorm
        y = F.layer_norm_forward(x, 4, out=out)[0]
        torch.add(x, x, out=torch.zeros((2, 4), requires_grad=True))
    assert y is out and bool((out == 0).all())


@st.composite
def _outs(draw):
    """An input and an ``out`` candidate of every kind ``check_out`` tells apart: shape,
    dtype (byte order too), layout (C, Fortran, strided, broadcast), read-only, masked, a
    subclass, an input of another backend."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    like = np.zeros(shape, np.float32)
    if draw(st.booleans()):  # an input of another backend: a NumPy out is refused
        like = pytest.importorskip("array_api_strict").asarray(like)
    oshape = draw(st.sampled_from([shape, shape[::-1], (*shape, 1), shape[1:]]))
    dtype = draw(st.sampled_from(["float32", ">f4", "float64", "float16"]))
    kind = draw(st.sampled_from(["C", "F", "strided", "broadcast", "read-only", "masked", "memmap-like"]))
    out = np.zeros(oshape, dtype)
    if kind == "F":
        out = np.asfortranarray(out)
    elif kind == "strided" and oshape:
        out = np.zeros((*oshape[:-1], 2 * oshape[-1]), dtype)[..., ::2]
    elif kind == "broadcast" and oshape:
        out = np.broadcast_to(np.zeros(oshape[-1:], dtype), oshape)
    elif kind == "read-only":
        out.flags.writeable = False
    elif kind == "masked":
        out = np.ma.masked_array(out)
    elif kind == "memmap-like":
        out = out.view(type("Sub", (np.ndarray,), {}))
    return like, out


@settings(max_examples=300)
@given(_outs())
def test_plain_out_shortcut_accepts_only_what_the_full_checks_accept(case):
    """``check_out`` takes a shortcut for a plain writable C-ordered NumPy ``out`` of the
    input's shape and dtype; it must never accept an ``out`` that the full checks refuse
    (and what it does not take goes through them, with their errors)."""
    from npnorm._backend import namespace_of
    from npnorm._checks import check_out, check_out_fully, plain_out

    like, out = case
    xp = namespace_of(like)
    if type(like) is not np.ndarray:  # (array_api_strict warns where a NumPy dtype meets its own)
        assert not plain_out(xp, out, like)
    try:
        check_out_fully(xp, out, like)
        full = None
    except (TypeError, ValueError) as err:
        full = (type(err), str(err))
    if plain_out(xp, out, like):
        assert full is None, full
    try:
        check_out(xp, out, like)
        got = None
    except (TypeError, ValueError) as err:
        got = (type(err), str(err))
    assert got == full
