"""The fused CuPy kernels (npnorm.kernels.cupy_fused) against the generic kernels, on the GPU.

Every case runs an op twice on the same CuPy arrays, with the default dispatch (the fused
kernels) and under ``use_kernels("reference")`` (the generic Array API kernels), and
compares every result: outputs, saved statistics, running buffers and gradients. Shapes,
dtypes, flags and values are drawn. Without a GPU every case skips (conftest).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F
from npnorm._backend import to_host
from npnorm.functional import _dispatch

pytestmark = pytest.mark.parametrize("backend", ["cupy"], indirect=True)

TOL = {"float16": 4e-3, "float32": 2e-5, "float64": 1e-12}


def _close(fused, ref, dtype: str, what: str) -> None:
    """Equal to rounding: the largest difference within TOL of the reference's scale."""
    if ref is None:
        assert fused is None, what
        return
    a, b = to_host(fused), to_host(ref)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    finite = np.isfinite(b)
    assert np.array_equal(a[~finite], b[~finite], equal_nan=True), what  # the same NaN and inf
    a, b = a[finite].astype(np.float64), b[finite].astype(np.float64)
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    err = float(np.abs(a - b).max()) if b.size else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: {err:.3g} > {TOL[dtype]:.0e} x {scale:.3g}"


def _both(fn):
    """``fn()`` with the default (fused) kernels and with the reference kernels."""
    fused = fn()
    with npnorm.use_kernels("reference"):
        ref = fn()
    return fused, ref


def _data(backend, rng, shape, dtype, offset=0.0):
    return backend.asarray(offset + rng.standard_normal(shape), dtype)


def test_cupy_arrays_take_the_fused_kernels(backend):
    from npnorm.kernels import cupy_fused

    for op in ("layer_norm", "rms_norm", "batch_norm", "instance_norm"):
        for step in ("forward", "backward"):
            name = f"{op}_{step}"
            assert _dispatch.kernel(name, backend.xp) is getattr(cupy_fused, name)
            with npnorm.use_kernels("reference"):
                assert _dispatch.kernel(name, backend.xp) is _dispatch.generic_kernel(name)


ROW_D = st.sampled_from([1, 3, 8, 32, 33, 100, 768, 1000, 1025, 2048, 3000, 4096, 4097])  # 4097: generic


@settings(max_examples=60)
@given(
    batch=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    D=ROW_D,
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    affine=st.sampled_from(["none", "weight", "bias", "both"]),
    offset=st.sampled_from([0.0, 1e3]),
    seed=st.integers(0, 2**16),
    transposed=st.booleans(),
)
def test_layer_norm_fused_equals_reference(backend, batch, D, dtype, affine, offset, seed, transposed):
    rng = np.random.default_rng(seed)
    shape = (*batch, D)
    x = _data(backend, rng, shape, dtype, offset)
    if transposed and len(batch) > 1:  # not C-ordered
        x = backend.xp.permute_dims(_data(backend, rng, (batch[1], batch[0], *batch[2:], D), dtype, offset),
                                    (1, 0, *range(2, len(shape))))  # fmt: skip
        shape = tuple(x.shape)
    dy = _data(backend, rng, shape, dtype)
    w = _data(backend, rng, (D,), dtype) if affine in ("weight", "both") else None
    b = _data(backend, rng, (D,), dtype) if affine in ("bias", "both") else None
    (y, mean, rstd), (ry, rmean, rrstd) = _both(lambda: F.layer_norm_forward(x, D, w, b))
    for what, f, r in (("y", y, ry), ("mean", mean, rmean), ("rstd", rstd, rrstd)):
        _close(f, r, dtype, what)
    # both backwards from the same saved statistics
    fused, ref = _both(lambda: F.layer_norm_backward(dy, x, D, rmean, rrstd, w, b))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, dtype, what)


@settings(max_examples=40)
@given(
    batch=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    D=ROW_D,
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    weighted=st.booleans(),
    eps=st.sampled_from([None, 1e-6]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_fused_equals_reference(backend, batch, D, dtype, weighted, eps, seed):
    rng = np.random.default_rng(seed)
    x = _data(backend, rng, (*batch, D), dtype, 0.5)
    dy = _data(backend, rng, (*batch, D), dtype)
    w = _data(backend, rng, (D,), dtype) if weighted else None
    (y, rstd), (ry, rrstd) = _both(lambda: F.rms_norm_forward(x, D, w, eps))
    _close(y, ry, dtype, "y")
    _close(rstd, rrstd, dtype, "rstd")
    fused, ref = _both(lambda: F.rms_norm_backward(dy, x, D, rrstd, w))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, dtype, what)


@settings(max_examples=60)
@given(
    N=st.integers(1, 6),
    C=st.integers(1, 70),
    spatial=st.sampled_from([(), (5,), (32,), (7, 9), (56, 56), (3, 4, 5), (2, 16, 16)]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    affine=st.sampled_from(["none", "weight", "bias", "both"]),
    running=st.booleans(),
    training=st.booleans(),
    momentum=st.sampled_from([0.1, 1.0, 0.0]),
    offset=st.sampled_from([0.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_batch_norm_fused_equals_reference(
    backend, N, C, spatial, dtype, affine, running, training, momentum, offset, seed
):
    training = training or not running  # without running statistics only batch statistics
    assume(not training or N * int(np.prod(spatial)) > 1)  # training needs two values per channel
    rng = np.random.default_rng(seed)
    shape = (N, C, *spatial)
    x = _data(backend, rng, shape, dtype, offset)
    dy = _data(backend, rng, shape, dtype)
    w = _data(backend, rng, (C,), dtype) if affine in ("weight", "both") else None
    b = _data(backend, rng, (C,), dtype) if affine in ("bias", "both") else None
    rm0 = rng.standard_normal(C)
    rv0 = rng.uniform(0.5, 2.0, C)

    def forward():
        rm = backend.asarray(rm0, "float32") if running else None
        rv = backend.asarray(rv0, "float32") if running else None
        res = F.batch_norm_forward(x, rm, rv, w, b, training, momentum, 1e-5)
        return (*res, rm, rv)

    fused, ref = _both(forward)
    names = ("y", "mean", "rstd", "new_mean", "new_var", "running_mean", "running_var")
    for what, f, r in zip(names, fused, ref, strict=True):
        _close(f, r, "float32" if what.startswith(("running", "new")) else dtype, what)
    mean, rstd = ref[1], ref[2]
    fused, ref = _both(lambda: F.batch_norm_backward(dy, x, mean, rstd, w, b, training))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, dtype, what)


def test_fused_kernels_write_out_and_repeat_bitwise(backend, rng):
    xp = backend.xp
    x = _data(backend, rng, (6, 7, 768), "float32", 3.0)
    dy = _data(backend, rng, (6, 7, 768), "float32")
    w, b = _data(backend, rng, (768,), "float32"), _data(backend, rng, (768,), "float32")
    out = xp.empty_like(x)
    y, mean, rstd = F.layer_norm_forward(x, 768, w, b, out=out)
    assert y is out
    y2, _, _ = F.layer_norm_forward(x, 768, w, b)
    assert np.array_equal(to_host(y), to_host(y2))
    g1 = F.layer_norm_backward(dy, x, 768, mean, rstd, w, b)
    g2 = F.layer_norm_backward(dy, x, 768, mean, rstd, w, b)
    for a, c in zip(g1, g2, strict=True):
        assert np.array_equal(to_host(a), to_host(c))  # deterministic: fixed blocks, fixed order
    xb = _data(backend, rng, (8, 16, 40, 40), "float32", 3.0)
    r1 = F.batch_norm_forward(xb, None, None, None, None, True)
    r2 = F.batch_norm_forward(xb, None, None, None, None, True)
    for a, c in zip(r1[:3], r2[:3], strict=True):
        assert np.array_equal(to_host(a), to_host(c))


def test_fused_float32_is_accurate_on_a_large_offset(backend, rng):
    """float32 data of mean 1e3 and spread 1: the fused kernels' error against a float64
    computation is no larger than the generic kernels' (sums in float64 in both)."""
    x64 = 1e3 + rng.standard_normal((64, 1024))
    exact = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    x = backend.asarray(x64, "float32")
    (y, _, _), (ry, _, _) = _both(lambda: F.layer_norm_forward(x, 1024))
    err = np.abs(to_host(y) - exact).max()
    assert err <= 1.5 * np.abs(to_host(ry) - exact).max() + 1e-6


@settings(max_examples=12)
@given(
    R=st.integers(300, 3000),
    D=st.sampled_from([1, 32, 100, 768, 1000, 1025, 3000, 4096]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    affine=st.sampled_from(["none", "weight", "bias", "both"]),
    center=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_row_kernels_on_many_rows_equal_reference(backend, R, D, dtype, affine, center, seed):
    """More rows than the backward launches blocks: each block takes several rows, each
    loading the next while it reduces this one's sums, and its dweight and dbias partial
    sums cover all of them."""
    rng = np.random.default_rng(seed)
    x = _data(backend, rng, (R, D), dtype, 2.0)
    dy = _data(backend, rng, (R, D), dtype)
    w = _data(backend, rng, (D,), dtype) if affine in ("weight", "both") else None
    b = _data(backend, rng, (D,), dtype) if affine in ("bias", "both") else None
    if center:
        (y, mean, rstd), (ry, rmean, rrstd) = _both(lambda: F.layer_norm_forward(x, D, w, b))
        pairs = [("y", y, ry), ("mean", mean, rmean), ("rstd", rstd, rrstd)]
        fused, ref = _both(lambda: F.layer_norm_backward(dy, x, D, rmean, rrstd, w, b))
    else:
        (y, rstd), (ry, rrstd) = _both(lambda: F.rms_norm_forward(x, D, w))
        pairs = [("y", y, ry), ("rstd", rstd, rrstd)]
        fused, ref = _both(lambda: F.rms_norm_backward(dy, x, D, rrstd, w))
    pairs += list(zip(("dx", "dweight", "dbias"), fused, ref, strict=False))
    for what, f, r in pairs:
        _close(f, r, dtype, what)


@settings(max_examples=10)
@given(
    C=st.integers(1, 40),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    momentum=st.sampled_from([0.1, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_batch_norm_fused_takes_strided_buffers(backend, C, dtype, momentum, seed):
    """Per-channel arrays that are views with a step (weight, bias, running statistics in
    the input's dtype) give what the generic kernels give, and the running statistics the
    fused forward returns are new arrays of the buffers' dtype."""
    rng = np.random.default_rng(seed)
    x = _data(backend, rng, (4, C, 9, 8), dtype, 5.0)
    dy = _data(backend, rng, (4, C, 9, 8), dtype)
    w = _data(backend, rng, (2 * C,), dtype)[::2]
    b = _data(backend, rng, (2 * C,), dtype)[1::2]
    rm0 = rng.standard_normal(2 * C)
    rv0 = rng.uniform(0.5, 2.0, 2 * C)

    def forward():
        rm = backend.asarray(rm0, dtype)[::2]
        rv = backend.asarray(rv0, dtype)[::2]
        return F.batch_norm_forward(x, rm, rv, w, b, True, momentum, 1e-5)

    fused, ref = _both(forward)
    for what, f, r in zip(("y", "mean", "rstd", "new_mean", "new_var"), fused, ref, strict=True):
        _close(f, r, dtype, what)
    assert np.dtype(fused[3].dtype) == np.dtype(dtype) == np.dtype(fused[4].dtype)
    g_fused, g_ref = _both(lambda: F.batch_norm_backward(dy, x, ref[1], ref[2], w, b, True))
    for what, f, r in zip(("dx", "dweight", "dbias"), g_fused, g_ref, strict=True):
        _close(f, r, dtype, what)


@settings(max_examples=50)
@given(
    N=st.integers(1, 6),
    C=st.integers(1, 40),
    spatial=st.sampled_from([(5,), (32,), (7, 9), (56, 56), (3, 4, 5), (2, 16, 16)]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    affine=st.booleans(),
    running=st.booleans(),
    use_input_stats=st.booleans(),
    momentum=st.sampled_from([0.1, 1.0]),
    eps=st.sampled_from([1e-5, 0.0]),
    constant=st.booleans(),
    offset=st.sampled_from([0.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_instance_norm_fused_equals_reference(
    backend, N, C, spatial, dtype, affine, running, use_input_stats, momentum, eps, constant, offset, seed
):
    """InstanceNorm on the fused kernels (BatchNorm's, with the instances as channels;
    BatchNorm's evaluation with running statistics) against the generic kernels: outputs,
    statistics, running buffers and gradients; with eps = 0, instances of one value (their
    rstd 0, PyTorch's rule)."""
    use_input_stats = use_input_stats or not running
    rng = np.random.default_rng(seed)
    shape = (N, C, *spatial)
    x64 = offset + rng.standard_normal(shape)
    if constant:
        x64[:, : (C + 1) // 2] = 0.75  # a value every dtype holds
    x = backend.asarray(x64, dtype)
    dy = _data(backend, rng, shape, dtype)
    w = _data(backend, rng, (C,), dtype) if affine else None
    b = _data(backend, rng, (C,), dtype) if affine else None
    rm0 = rng.standard_normal(C)
    rv0 = rng.uniform(0.5, 2.0, C)
    eps = eps if use_input_stats else 1e-5

    def forward():
        rm = backend.asarray(rm0, "float32") if running else None
        rv = backend.asarray(rv0, "float32") if running else None
        res = F.instance_norm_forward(x, rm, rv, w, b, use_input_stats, momentum, eps)
        return (*res, rm, rv)

    fused, ref = _both(forward)
    names = ("y", "mean", "rstd", "new_mean", "new_var", "running_mean", "running_var")
    for what, f, r in zip(names, fused, ref, strict=True):
        _close(f, r, "float32" if what.startswith(("running", "new")) else dtype, what)
    mean, rstd = ref[1], ref[2]
    fused, ref = _both(lambda: F.instance_norm_backward(dy, x, mean, rstd, w, b, use_input_stats))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, dtype, what)


def test_fused_kernels_mixed_dtypes_equal_reference(backend, rng):
    """float32 input with float64 parameters and running statistics (computed in float64 by
    both kernel families), and float16 input with float16 running statistics (computed in
    float32, the new running statistics rounded once from float64)."""
    x = _data(backend, rng, (6, 5, 40), "float32", 2.0)
    dy = _data(backend, rng, (6, 5, 40), "float32")
    w40, b40 = _data(backend, rng, (40,), "float64"), _data(backend, rng, (40,), "float64")
    fused, ref = _both(lambda: F.layer_norm_forward(x, 40, w40, b40))
    for what, f, r in zip(("y", "mean", "rstd"), fused, ref, strict=True):
        _close(f, r, "float32", what)
    fused, ref = _both(lambda: F.layer_norm_backward(dy, x, 40, ref[1], ref[2], w40, b40))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, "float32", what)
    for xdtype, rdtype in (("float32", "float64"), ("float16", "float16")):
        xb = _data(backend, rng, (6, 5, 40), xdtype, 2.0)
        w5 = _data(backend, rng, (5,), rdtype)

        def forward(xb=xb, w5=w5, rdtype=rdtype):
            rm = backend.asarray(np.zeros(5), rdtype)
            rv = backend.asarray(np.ones(5), rdtype)
            return F.batch_norm_forward(xb, rm, rv, w5, None, True, 0.1, 1e-5)

        fused, ref = _both(forward)
        for what, f, r in zip(("y", "mean", "rstd", "new_mean", "new_var"), fused, ref, strict=True):
            _close(f, r, xdtype, what)
            assert f.dtype == r.dtype, what


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_fused_statistics_of_non_finite_values_equal_reference(backend, rng, value):
    """A channel (BatchNorm), an instance (InstanceNorm) or a row (LayerNorm) holding an
    infinite or NaN value: the same infinite and NaN results as the generic kernels
    (a channel's mean +-inf where the reference's sum gives it, not Welford's NaN)."""
    x64 = rng.standard_normal((4, 3, 8, 8))
    x64[1, 1, 2, 3] = value
    x = backend.asarray(x64, "float32")

    def buffers():  # new ones for each call
        return backend.asarray(np.zeros(3), "float32"), backend.asarray(np.ones(3), "float32")

    cases = {
        "batch_norm": lambda: F.batch_norm_forward(x, *buffers(), None, None, True, 0.1, 1e-5),
        "instance_norm": lambda: F.instance_norm_forward(x, *buffers(), None, None, True, 0.1, 1e-5),
        "layer_norm": lambda: F.layer_norm_forward(x, (8, 8)),
    }
    for name, fn in cases.items():
        fused, ref = _both(fn)
        for i, (f, r) in enumerate(zip(fused, ref, strict=True)):
            _close(f, r, "float32", f"{name}[{i}]")


def _repeat_equal(first, second, what: str) -> None:
    for i, (a, c) in enumerate(zip(first, second, strict=True)):
        if a is None:
            assert c is None, (what, i)
            continue
        assert np.array_equal(to_host(a), to_host(c), equal_nan=True), (what, i)


def test_every_fused_kernel_repeats_bitwise_and_writes_out(backend, rng):
    """Each fused forward and backward, run twice on the same arrays, gives the same bits
    (fixed partitions and orders of its sums), and writes y or dx into ``out=`` where given:
    out is returned and holds what a call without out returns."""
    xp = backend.xp
    x = _data(backend, rng, (4, 12, 20, 20), "float32", 2.0)
    dy = _data(backend, rng, (4, 12, 20, 20), "float32")
    w, b = _data(backend, rng, (12,), "float32"), _data(backend, rng, (12,), "float32")
    wr = _data(backend, rng, (400,), "float32")
    xr, dyr = xp.reshape(x, (48, 400)), xp.reshape(dy, (48, 400))
    forwards = {
        "layer_norm": lambda o: F.layer_norm_forward(xr, 400, wr, wr, out=o),
        "rms_norm": lambda o: F.rms_norm_forward(xr, 400, wr, out=o),
        "batch_norm": lambda o: F.batch_norm_forward(x, None, None, w, b, True, out=o),
        "instance_norm": lambda o: F.instance_norm_forward(x, None, None, w, b, True, out=o),
    }
    backwards = {
        "layer_norm": lambda s, o: F.layer_norm_backward(dyr, xr, 400, s[1], s[2], wr, wr, out=o),
        "rms_norm": lambda s, o: F.rms_norm_backward(dyr, xr, 400, s[1], wr, out=o),
        "batch_norm": lambda s, o: F.batch_norm_backward(dy, x, s[1], s[2], w, b, True, out=o),
        "instance_norm": lambda s, o: F.instance_norm_backward(dy, x, s[1], s[2], w, b, True, out=o),
    }
    for name, forward in forwards.items():
        first = forward(None)
        _repeat_equal(first, forward(None), f"{name} forward")
        out = xp.empty_like(first[0])
        again = forward(out)
        assert again[0] is out, name
        _repeat_equal(first, again, f"{name} forward, out=")
        grads = backwards[name](first, None)
        _repeat_equal(grads, backwards[name](first, None), f"{name} backward")
        out = xp.empty_like(grads[0])
        again = backwards[name](first, out)
        assert again[0] is out, name
        _repeat_equal(grads, again, f"{name} backward, out=")


@pytest.mark.parametrize("affine", ["weight", "bias"])
def test_instance_norm_fused_with_weight_or_bias_alone(backend, rng, affine):
    x = _data(backend, rng, (3, 5, 9, 8), "float32", 1.0)
    dy = _data(backend, rng, (3, 5, 9, 8), "float32")
    w = _data(backend, rng, (5,), "float32") if affine == "weight" else None
    b = _data(backend, rng, (5,), "float32") if affine == "bias" else None
    fused, ref = _both(lambda: F.instance_norm_forward(x, None, None, w, b, True))
    for what, f, r in zip(("y", "mean", "rstd", "new_mean", "new_var"), fused, ref, strict=True):
        _close(f, r, "float32", what)
    fused, ref = _both(lambda: F.instance_norm_backward(dy, x, ref[1], ref[2], w, b, True))
    for what, f, r in zip(("dx", "dweight", "dbias"), fused, ref, strict=True):
        _close(f, r, "float32", what)


def _forward_backward_equal(name: str, forward, backward) -> None:
    """``forward()`` fused and generic, then ``backward(statistics)`` fused and generic from
    the generic forward's results: every result equal to rounding (float32)."""
    fused, ref = _both(forward)
    for i, (f, r) in enumerate(zip(fused, ref, strict=True)):
        _close(f, r, "float32", f"{name} forward [{i}]")
    grads, ref_grads = _both(lambda: backward(ref))
    for i, (f, r) in enumerate(zip(grads, ref_grads, strict=True)):
        _close(f, r, "float32", f"{name} backward [{i}]")


def test_fused_kernels_hand_over_to_the_generic_ones_past_their_limits(backend, rng):
    """Inputs the fused kernels do not take (more than 65535 instances, more channels than
    one launch's grid axis, rows over ROW_LIMIT values) run the generic kernels and give
    their results; BatchNorm with a thousand channels (more than 8 per multiprocessor: one
    block per channel) and evaluation with an eps other than 1e-5 run the fused ones."""
    from npnorm.kernels import cupy_fused

    cases = []
    x = _data(backend, rng, (2, 40000, 32), "float32", 1.0)  # 80000 instances
    dy = _data(backend, rng, (2, 40000, 32), "float32")
    assert not cupy_fused._instances_fit(x)
    cases.append(("instance_norm", lambda: F.instance_norm_forward(x, None, None, None, None, True),
                  lambda s: F.instance_norm_backward(dy, x, s[1], s[2], None, None, True)))  # fmt: skip
    xc = _data(backend, rng, (2, 70000, 32), "float32", 1.0)  # more channels than the grid's axis
    dyc = _data(backend, rng, (2, 70000, 32), "float32")
    assert not cupy_fused._channels_fit(xc)
    cases.append(("batch_norm, 70000 channels",
                  lambda: F.batch_norm_forward(xc, None, None, None, None, True),
                  lambda s: F.batch_norm_backward(dyc, xc, s[1], s[2], None, None, True)))  # fmt: skip
    xk = _data(backend, rng, (4, 1000, 7, 7), "float32", 1.0)  # one block per channel
    dyk = _data(backend, rng, (4, 1000, 7, 7), "float32")
    wk = _data(backend, rng, (1000,), "float32")
    assert cupy_fused._channels_fit(xk)
    cases.append(("batch_norm, 1000 channels",
                  lambda: F.batch_norm_forward(xk, None, None, wk, wk, True),
                  lambda s: F.batch_norm_backward(dyk, xk, s[1], s[2], wk, wk, True)))  # fmt: skip
    rm = backend.asarray(rng.standard_normal(1000), "float32")
    rv = backend.asarray(rng.uniform(0.5, 2, 1000), "float32")
    cases.append(("batch_norm eval, eps 0.3",
                  lambda: F.batch_norm_forward(xk, rm, rv, wk, wk, False, 0.1, 0.3),
                  lambda s: F.batch_norm_backward(dyk, xk, s[1], s[2], wk, wk, False)))  # fmt: skip
    xl = _data(backend, rng, (3, 300000), "float32", 1.0)  # rows longer than ROW_LIMIT
    dyl = _data(backend, rng, (3, 300000), "float32")
    wl = _data(backend, rng, (300000,), "float32")
    cases.append(("layer_norm, 300000", lambda: F.layer_norm_forward(xl, 300000, wl, wl),
                  lambda s: F.layer_norm_backward(dyl, xl, 300000, s[1], s[2], wl, wl)))  # fmt: skip
    for name, forward, backward in cases:
        _forward_backward_equal(name, forward, backward)


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_fused_gradients_of_non_finite_inputs_equal_reference(backend, rng, value):
    """A non-finite value in the input: the same NaN and inf in y and the statistics, and in
    dx, dweight and dbias, as the generic kernels give, for every fused layer. (A non-finite
    dy is not among these cases: there the fused backwards give NaN where the generic ones
    give infinities; see tools/gpu_pending.)"""
    x64 = rng.standard_normal((4, 4, 8, 8))
    x64[1, 1, 2, 3] = value
    x = backend.asarray(x64, "float32")
    dy = _data(backend, rng, (4, 4, 8, 8), "float32")
    w = backend.asarray(rng.standard_normal(4), "float32")
    w64 = backend.asarray(rng.standard_normal((8, 8)), "float32")
    cases = {
        "batch_norm": (lambda: F.batch_norm_forward(x, None, None, w, w, True),
                       lambda s: F.batch_norm_backward(dy, x, s[1], s[2], w, w, True)),
        "instance_norm": (lambda: F.instance_norm_forward(x, None, None, w, w, True),
                          lambda s: F.instance_norm_backward(dy, x, s[1], s[2], w, w, True)),
        "layer_norm": (lambda: F.layer_norm_forward(x, (8, 8), w64, w64),
                       lambda s: F.layer_norm_backward(dy, x, (8, 8), s[1], s[2], w64, w64)),
        "rms_norm": (lambda: F.rms_norm_forward(x, (8, 8), w64),
                     lambda s: F.rms_norm_backward(dy, x, (8, 8), s[1], w64)),
    }  # fmt: skip
    for name, (forward, backward) in cases.items():
        _forward_backward_equal(name, forward, backward)
