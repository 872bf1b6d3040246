"""Finite huge inputs: no NumPy warning escapes from npnorm (pytest turns warnings into
errors), every output and gradient is finite, and, where the statistics fit the dtype,
the results are those of the same data at ordinary scale (normalization does not see a
common factor). Every layer, every kernel family, float32 and float64."""

from __future__ import annotations

import numpy as np
import pytest

import npnorm
import npnorm.functional as F

FAMILIES = npnorm.kernels_available()


def layers():
    """(name, module factory, input shape); InstanceNorm with affine and running stats."""
    return [
        ("LayerNorm", lambda dt: npnorm.LayerNorm(6, dtype=dt), (4, 3, 6)),
        ("RMSNorm", lambda dt: npnorm.RMSNorm(6, dtype=dt), (4, 3, 6)),
        ("BatchNorm1d", lambda dt: npnorm.BatchNorm1d(3, dtype=dt), (5, 3)),
        ("BatchNorm2d", lambda dt: npnorm.BatchNorm2d(3, dtype=dt), (4, 3, 5, 5)),
        (
            "InstanceNorm2d",
            lambda dt: npnorm.InstanceNorm2d(3, affine=True, track_running_stats=True, dtype=dt),
            (4, 3, 5, 5),
        ),
        ("GroupNorm", lambda dt: npnorm.GroupNorm(3, 6, dtype=dt), (4, 6, 4, 4)),
    ]


def _step(m, x, dy):
    y = m(x)
    dx = m.backward(dy)
    return y, dx, {k: g.copy() for k, g in m.grads.items()}  # grads accumulate in place


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype, scale", [("float32", 1e30), ("float32", 3e36), ("float64", 1e150)])
@pytest.mark.parametrize("layer", [name for name, _, _ in layers()])
def test_huge_inputs_match_ordinary_scale(family, dtype, scale, layer):
    make, shape = {n: (f, s) for n, f, s in layers()}[layer]
    rng = np.random.default_rng(1)
    x = rng.normal(size=shape)
    dy = rng.normal(size=shape)
    with npnorm.use_kernels(family):
        small, big = make(dtype), make(dtype)
        y0, dx0, g0 = _step(small, x.astype(dtype), dy.astype(dtype))
        y1, dx1, g1 = _step(big, (x * scale).astype(dtype), dy.astype(dtype))
        big.eval()
        ye = big((x * scale).astype(dtype))  # running statistics: finite, or inf where torch's are
        dxe = big.backward(dy.astype(dtype))
    for a in (y1, dx1, *g1.values(), ye, dxe):
        assert np.isfinite(a).all(), layer
    tol = 2e-3 if dtype == "float32" else 1e-4  # eps (1e-5) counts at ordinary scale only
    np.testing.assert_allclose(y1, y0, rtol=tol, atol=tol)
    np.testing.assert_allclose(dx1 * scale, dx0, rtol=tol, atol=tol * float(np.abs(dx0).max()))
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=tol, atol=tol * float(np.abs(g0[k]).max()), err_msg=k)


def long_rows():
    """(name, module factory, input shape): rows (LayerNorm, RMSNorm) and channels of 256
    values and more."""
    return [
        ("LayerNorm", lambda: npnorm.LayerNorm(768, dtype="float32"), (4, 768)),
        ("RMSNorm", lambda: npnorm.RMSNorm(768, dtype="float32"), (4, 768)),
        ("BatchNorm2d", lambda: npnorm.BatchNorm2d(4, dtype="float32"), (4, 4, 16, 16)),
        ("InstanceNorm2d", lambda: npnorm.InstanceNorm2d(4, affine=True, dtype="float32"), (2, 4, 16, 16)),
        ("GroupNorm", lambda: npnorm.GroupNorm(2, 4, dtype="float32"), (2, 4, 16, 16)),
    ]


def _long_row_data(pattern, shape, rng):
    """``(x, dy)`` at ordinary scale: dy of the sign of x (products of one sign: float32
    sums overflow to inf), or x of alternating sign along the last axis with dy positive
    (products of alternating sign: the partial sums of a vectorized dot overflow both
    ways, to NaN)."""
    if pattern == "dy follows x":
        x = rng.normal(size=shape)
        return x, np.sign(x) * (1 + rng.random(shape))
    signs = np.where(np.arange(shape[-1]) % 2 == 0, 1.0, -1.0)
    return signs * (1 + 0.1 * rng.random(shape)), 1 + rng.random(shape)


@pytest.mark.parametrize("pattern", ["dy follows x", "x alternates"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [name for name, _, _ in long_rows()])
def test_huge_long_rows_whose_gradient_sums_overflow_float32(family, layer, pattern):
    """float32 values near 3e36 in long rows: float32 sums of dy*(x - mean) pass float32's
    largest value (the numpy family's LayerNorm and RMSNorm gave inf and NaN here), and
    the results are still those of the same data at ordinary scale."""
    make, shape = {n: (f, s) for n, f, s in long_rows()}[layer]
    x, dy64 = _long_row_data(pattern, shape, np.random.default_rng(3))
    dy = dy64.astype(np.float32)
    scale = 3e36
    with npnorm.use_kernels(family):
        small, big = make(), make()
        y0, dx0, g0 = _step(small, x.astype(np.float32), dy)
        y1, dx1, g1 = _step(big, (x * scale).astype(np.float32), dy)
    for a in (y1, dx1, *g1.values()):
        assert np.isfinite(a).all(), layer
    np.testing.assert_allclose(y1, y0, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dx1 * scale, dx0, rtol=2e-3, atol=2e-3 * float(np.abs(dx0).max()))
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=2e-3, atol=2e-3 * float(np.abs(g0[k]).max()), err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [name for name, _, _ in layers()])
def test_statistics_beyond_float64_give_finite_results(family, layer):
    """float64 data near 1e200: the variance overflows float64 itself; as in PyTorch the
    output is then the bias (rstd 0), finite, and nothing warns."""
    make, shape = {n: (f, s) for n, f, s in layers()}[layer]
    x = np.random.default_rng(2).normal(size=shape) * 1e200
    with npnorm.use_kernels(family):
        m = make("float64")
        y = m(x)
        dx = m.backward(np.ones_like(x))
    assert np.isfinite(y).all() and np.isfinite(dx).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_reported_case(family, dtype):
    """``LayerNorm(4)`` on ``[1e30, -1e30, 0, 0]``: torch gives zeros in float32 (its
    variance overflows) and ``[1.414, -1.414, 0, 0]`` in float64; npnorm gives the latter
    in both, without a warning."""
    x = np.array([[1e30, -1e30, 0.0, 0.0]], dtype=dtype)
    with npnorm.use_kernels(family):
        m = npnorm.LayerNorm(4, dtype=dtype)
        y = m(x)
        dx = m.backward(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=dtype))
    np.testing.assert_allclose(y, [[2**0.5, -(2**0.5), 0, 0]], rtol=1e-6, atol=1e-6)
    assert np.isfinite(dx).all() and np.abs(dx).max() < 1e-28


def test_the_reported_case_against_torch(torch):
    x = np.array([[1e30, -1e30, 0.0, 0.0]])
    ref = torch.nn.functional.layer_norm(torch.tensor(x), (4,)).numpy()  # float64
    for family in FAMILIES:
        with npnorm.use_kernels(family):
            np.testing.assert_allclose(npnorm.LayerNorm(4)(x.astype(np.float32)), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_float16_grads_that_overflow_when_accumulated_are_inf_without_a_warning(family):
    """The second backward's ``grads["bias"]`` (two sums of 40000 ones) exceeds float16: a
    NumPy overflow warning escaped, and under warnings-as-errors the weight's grad was
    accumulated and the bias's not. torch's float16 ``.grad`` is inf there, silently."""
    m = npnorm.LayerNorm(4, dtype="float16")
    x = np.random.default_rng(0).normal(size=(40000, 4)).astype(np.float16)
    dy = np.ones_like(x)
    with npnorm.use_kernels(family):
        for _ in range(2):
            m(x)
            m.backward(dy)
    assert np.all(np.isinf(m.grads["bias"])) and np.all(np.isfinite(m.grads["weight"]))
    single = npnorm.LayerNorm(4, dtype="float16")
    with npnorm.use_kernels(family):
        single(x)
        single.backward(dy)
    np.testing.assert_array_equal(m.grads["weight"], single.grads["weight"] + single.grads["weight"])


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "reference"])  # each against it
@pytest.mark.parametrize("layer", ["BatchNorm1d", "InstanceNorm1d"])
def test_running_statistics_backward_with_a_huge_spread(family, layer):
    """Eval mode with a running variance of 1e30 (rstd 1e-15) and float32 values of 1e20:
    the fast kernels' dweight, ``sum(dy * (x - mean)) * rstd``, overflowed float32 in the
    product (NaN, where the reference, forming ``xhat`` first, gives the finite sum);
    such a spread goes to the reference's way, as in training."""
    x = np.where(np.arange(260) % 2 == 0, 1e20, -1e20).astype(np.float32).reshape(130, 2)
    if layer == "InstanceNorm1d":
        x = x.reshape(13, 2, 10)
    dy = np.full(x.shape, 1e20, np.float32)
    grads = {}
    for kernels in ("reference", family):
        m = (
            npnorm.BatchNorm1d(2)
            if layer == "BatchNorm1d"
            else npnorm.InstanceNorm1d(2, affine=True, track_running_stats=True)
        )
        m.running_var[...] = 1e30
        m.eval()
        with npnorm.use_kernels(kernels):
            m(x)
            dx = m.backward(dy)
        assert np.isfinite(dx).all()
        grads[kernels] = {k: g.copy() for k, g in m.grads.items()}
    for k, g in grads["reference"].items():
        assert np.isfinite(g).all() and np.isfinite(grads[family][k]).all(), k
        atol = 1e-5 * float(np.abs(g).max())
        np.testing.assert_allclose(grads[family][k], g, rtol=1e-5, atol=atol, err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [name for name, _, _ in long_rows()])
def test_gradients_whose_row_sums_overflow_float32_give_finite_dx(family, layer):
    """float32 gradients of 1e36-2e36, one sign, over long rows: their row sums pass
    float32's largest value, while dx (linear in dy) is finite: that of the same gradient
    at ordinary scale, scaled. The numpy family's LayerNorm took mean(dy * w) in float32
    and gave -inf on every value; the weight and bias gradients may be inf, as the
    reference's and torch's are."""
    make, shape = {n: (f, s) for n, f, s in long_rows()}[layer]
    rng = np.random.default_rng(4)
    x = rng.normal(size=shape).astype(np.float32)
    dy = 1 + rng.random(shape)
    scale = 1e36
    with npnorm.use_kernels(family):
        _, dx0, _ = _step(make(), x, dy.astype(np.float32))
        _, dx1, _ = _step(make(), x, (dy * scale).astype(np.float32))
    assert np.isfinite(dx1).all(), layer
    np.testing.assert_allclose(dx1 / scale, dx0, rtol=2e-3, atol=2e-3 * float(np.abs(dx0).max()))


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_dx_where_rstd_times_weight_passes_float32_but_dx_fits(family, training):
    """rstd 1e14 (a spread of 1e-14) and a weight of 1e25: their product, 1e39, is beyond
    float32, dx (1e9) is not. It is taken in float64 and applied once (as PyTorch scales by
    invstd * w); a product in float32 gave inf in every family (a mutation that made it so
    passed the suite)."""
    rng = np.random.default_rng(0)
    x = (1e-14 * rng.standard_normal((6, 3))).astype(np.float32)
    w = np.full(3, 1e25, np.float32)
    dy = (1e-30 * rng.standard_normal((6, 3))).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.full(3, 1e-28, np.float32)
    with npnorm.use_kernels(family):
        _, mean, rstd, _, _ = F.batch_norm_forward(x, rm.copy(), rv.copy(), w, None, training, 0.1, 1e-35)
        dx = F.batch_norm_backward(dy, x, mean, rstd, w, None, training=training)[0]
    x64, dy64, r64 = x.astype(np.float64), dy.astype(np.float64), rstd.astype(np.float64)
    if training:
        xhat = (x64 - mean.astype(np.float64)) * r64
        want = r64 * 1e25 * (dy64 - dy64.mean(0) - xhat * (dy64 * xhat).mean(0))
    else:
        want = dy64 * r64 * 1e25
    assert np.all(np.isfinite(dx)) and np.abs(want).max() > 1e8
    np.testing.assert_allclose(dx, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "reference"])  # each against it
@pytest.mark.parametrize("layer", ["LayerNorm", "GroupNorm", "InstanceNorm1d"])
def test_float64_dx_where_rstd_times_sum_dy_passes_float64_but_dx_fits(family, layer):
    """float64 rows 1000 + U(0, 1) (rstd ~3.4) of 5 values with dy of 1e307-2e307: rstd
    times the row's sum of dy passes float64's largest value, while every term of dx,
    ``rstd*(dy - mean(dy) - ...)``, is near 1e307. The numba family took ``-rstd*sum(dy)``
    before dividing by the row's size and gave -inf across the row, where the reference
    takes the mean first."""
    rng = np.random.default_rng(3)
    shape = {"LayerNorm": (3, 5), "GroupNorm": (2, 2, 5), "InstanceNorm1d": (2, 3, 5)}[layer]
    x = 1000 + rng.random(shape)
    dy = 1e307 * (1 + rng.random(shape))
    dxs = {}
    for kernels in ("reference", family):
        with npnorm.use_kernels(kernels):
            if layer == "LayerNorm":
                _, mean, rstd = F.layer_norm_forward(x, 5)
                dxs[kernels] = F.layer_norm_backward(dy, x, 5, mean, rstd)[0]
            elif layer == "GroupNorm":
                _, mean, rstd = F.group_norm_forward(x, 2)
                dxs[kernels] = F.group_norm_backward(dy, x, 2, mean, rstd)[0]
            else:
                _, mean, rstd, _, _ = F.instance_norm_forward(x)
                dxs[kernels] = F.instance_norm_backward(dy, x, mean, rstd)[0]
    want = dxs["reference"]
    assert np.isfinite(want).all() and np.abs(want).max() > 1e306
    assert np.isfinite(dxs[family]).all(), layer
    np.testing.assert_allclose(dxs[family], want, rtol=1e-9, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("layer", [name for name, _, _ in layers()])
def test_reference_backward_where_dy_times_x_passes_float32(layer):
    """float32 gradients near 1e37 on data spread over about +-100: ``dy * (x - mean)``
    passes float32's range, dx (near 1e35) and the parameters' gradients do not. The
    reference forms xhat before it meets dy and gives them finite, equal to the same
    data's gradients at float64 (the fast families may give inf or NaN there, as
    PyTorch's do: README)."""
    make, shape = {n: (f, s) for n, f, s in layers()}[layer]
    rng = np.random.default_rng(0)
    x = (100 * rng.standard_normal(shape)).astype(np.float32)
    dy = (1e37 * rng.standard_normal(shape)).astype(np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(dy * x).all()  # (the products overflow float32)
    with npnorm.use_kernels("reference"):
        _, dx, grads = _step(make("float32"), x, dy)
        _, dx64, grads64 = _step(make("float64"), x.astype(np.float64), dy.astype(np.float64))
    assert np.isfinite(dx).all() and all(np.isfinite(g).all() for g in grads.values())
    np.testing.assert_allclose(dx, dx64, rtol=1e-3, atol=1e-4 * np.abs(dx64).max())
    for k, g in grads.items():
        np.testing.assert_allclose(g, grads64[k], rtol=1e-3, atol=1e-4 * np.abs(grads64[k]).max(), err_msg=k)
