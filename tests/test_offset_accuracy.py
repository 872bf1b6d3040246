"""float32 data with a large common offset (mean 1e3, spread 1): every kernel family is at
least as accurate as PyTorch's CPU kernels, measured against float64 on the same float32
data. (Their statistics are taken in float64, or, in the "numpy" family, centred again on
what the float32 mean's rounding lost; the backward's error comes from the saved float32
mean, as PyTorch's does.) Also the other ends of float32: sums beyond its range, and
constant rows."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import channels_last

import npnorm
import npnorm.functional as F

FAMILIES = npnorm.kernels_available()  # numba where the 'fast' extra is installed

LAYERS = {
    "LayerNorm": ((64, 768), lambda c, d, dt: npnorm.LayerNorm(d, dtype=dt)),
    "RMSNorm": ((64, 768), lambda c, d, dt: npnorm.RMSNorm(d, dtype=dt)),
    "BatchNorm2d": ((8, 16, 12, 12), lambda c, d, dt: npnorm.BatchNorm2d(c, dtype=dt)),
    "GroupNorm": ((8, 16, 12, 12), lambda c, d, dt: npnorm.GroupNorm(4, c, dtype=dt)),
    "InstanceNorm2d": ((8, 16, 12, 12), lambda c, d, dt: npnorm.InstanceNorm2d(c, dtype=dt)),
}


def _torch_layer(torch, name, c, d):
    return {
        "LayerNorm": lambda: torch.nn.LayerNorm(d),
        "RMSNorm": lambda: torch.nn.RMSNorm(d),
        "BatchNorm2d": lambda: torch.nn.BatchNorm2d(c),
        "GroupNorm": lambda: torch.nn.GroupNorm(4, c),
        "InstanceNorm2d": lambda: torch.nn.InstanceNorm2d(c),
    }[name]()


def _error(a, truth):
    return float(np.abs(np.asarray(a, dtype=np.float64) - truth).max() / np.abs(truth).max())


def _channels_last(a):
    """``a`` (N, C, H, W) with the channels-last memory layout: its values, axes and shape
    as they were, its strides those of a C-ordered (N, H, W, C) array."""
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)).transpose(0, 3, 1, 2)


def _ours_and_float64(name, seed, family, channels_last=False):
    """``(x, dy, y, dx, y64, dx64)``: float32 data with offset 1e3 (x and dy laid out
    channels-last with ``channels_last``), the output and dx of the kernel family
    ``family``, and the reference's in float64 on the same values."""
    shape, make = LAYERS[name]
    c, d = shape[1], shape[-1]
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) + 1e3).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    if channels_last:
        x, dy = _channels_last(x), _channels_last(dy)
    with npnorm.use_kernels("reference"):
        m64 = make(c, d, "float64")
        y64 = m64(x.astype(np.float64))
        dx64 = m64.backward(dy.astype(np.float64))
    with npnorm.use_kernels(family):
        m = make(c, d, "float32")
        y = m(x)
        dx = m.backward(dy)
    return x, dy, y, dx, y64, dx64


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(LAYERS))
def test_float32_with_offset_1e3_rounds_like_float32_only(name, seed, family):
    """Without PyTorch too: statistics taken in float64 leave the float32 output off the
    float64 one by float32 rounding only (a float32 mean misses this by its rounding,
    up to 3e-5 of the spread here: the reference's was 8.8e-4 off at offset 1e3)."""
    _, _, y, _, y64, _ = _ours_and_float64(name, seed, family)
    assert _error(y, y64) <= 3e-7, "output: float64 statistics give float32 rounding only"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(LAYERS))
def test_float32_with_offset_1e3_at_least_as_accurate_as_torch(torch, name, seed, family):
    x, dy, y, dx, y64, dx64 = _ours_and_float64(name, seed, family)
    c, d = x.shape[1], x.shape[-1]
    ref = _torch_layer(torch, name, c, d)
    xt = torch.tensor(x, requires_grad=True)
    ref(xt).backward(torch.tensor(dy))
    yt = ref(torch.tensor(x)).detach().numpy()
    assert _error(y, y64) <= _error(yt, y64), "output"
    assert _error(dx, dx64) <= 1.1 * _error(xt.grad.numpy(), dx64) + 1e-7, "dx"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("name", "channels_last"),
    [("LayerNorm", False)]
    + [(name, last) for name in ("BatchNorm2d", "GroupNorm", "InstanceNorm2d") for last in (False, True)],
)
def test_float32_dx_with_offset_1e3_rounds_like_float32_only(name, channels_last, seed, family):
    """The backward recomputes xhat from the saved mean, rounded to float32 (up to 3e-5 of
    the spread off at offset 1e3), so xhat is off centre by as much; centred again, as the
    reference's ``centred_again`` does, dx is off the float64 one by float32
    rounding only: 1e-7 here, channels-last input too, which the fast kernels take in
    loops of their own. (LayerNorm's "numpy" and "numba" kernels were 2e-6 off before
    theirs did too, torch's is 2e-5; "numba"'s GroupNorm and InstanceNorm 2e-6 to 4e-6;
    BatchNorm's fast kernels 1e-6, torch's 7e-7.)"""
    *_, dx, _, dx64 = _ours_and_float64(name, seed, family, channels_last)
    assert _error(dx, dx64) <= 3e-7, "dx: xhat centred again gives float32 rounding only"


WEIGHTED = {  # every layer whose weight multiplies a centred xhat
    "LayerNorm": ((64, 48), lambda c, d, dt: npnorm.LayerNorm(d, dtype=dt)),
    "BatchNorm1d": ((96, 16), lambda c, d, dt: npnorm.BatchNorm1d(c, dtype=dt)),
    "BatchNorm2d": ((8, 16, 6, 6), lambda c, d, dt: npnorm.BatchNorm2d(c, dtype=dt)),
    "GroupNorm": ((8, 16, 6, 6), lambda c, d, dt: npnorm.GroupNorm(4, c, dtype=dt)),
    "InstanceNorm2d": ((8, 16, 6, 6), lambda c, d, dt: npnorm.InstanceNorm2d(c, affine=True, dtype=dt)),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", list(WEIGHTED))
def test_float32_dweight_with_an_offset_rounds_like_float32_only(name, channels_last, seed, family):
    """dweight = sum(dy * xhat) took xhat as recomputed from the saved float32 mean, off
    centre by that mean's rounding, which added rstd * mean(x - mean) * sum(dy) to it:
    at offset 1e3 and spread 1e-3, 8e-3 (LayerNorm) to 5e-2 (InstanceNorm) of dweight,
    as PyTorch's, where the "numpy" family's GroupNorm and InstanceNorm were 5e-7. xhat is
    centred again for dweight as it is for dx."""
    shape, make = WEIGHTED[name]
    c, d = shape[1], shape[-1]
    rng = np.random.default_rng(seed)
    x = (1e-3 * rng.normal(size=shape) + 1e3).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    if channels_last and x.ndim == 4:
        x, dy = _channels_last(x), _channels_last(dy)
    with npnorm.use_kernels("reference"):
        m64 = make(c, d, "float64")
        m64(x.astype(np.float64))
        m64.backward(dy.astype(np.float64))
    with npnorm.use_kernels(family):
        m = make(c, d, "float32")
        m(x)
        m.backward(dy)
    assert _error(m.grads["weight"], m64.grads["weight"]) <= 1e-6


@pytest.mark.parametrize("N", [300, 1000])
def test_batch_norm1d_dweight_with_an_offset_where_the_threads_split_the_samples(N, monkeypatch):
    """numba's BatchNorm on short channels splits the spans of samples over the threads
    (``channel_span_dy_sums``) above SPLIT_VALUES values: there too xhat is centred again
    on channels far from zero, or dweight is 2.5e-5 off (4e-8 centred) at offset 1e3 and
    spread 1e-3, as at (65536, 64) on 2 threads without any patching."""
    pytest.importorskip("numba", reason="the compiled kernels need numba (the 'fast' extra)")
    from npnorm.kernels import numba_channels

    monkeypatch.setattr(numba_channels, "SPLIT_VALUES", 1)
    rng = np.random.default_rng(0)
    x = (1e-3 * rng.normal(size=(N, 8)) + 1e3).astype(np.float32)
    dy = rng.normal(size=(N, 8)).astype(np.float32)
    with npnorm.use_kernels("reference"):
        m64 = npnorm.BatchNorm1d(8, dtype="float64")
        m64(x.astype(np.float64))
        dx64 = m64.backward(dy.astype(np.float64))
    threads = npnorm.get_num_threads()
    npnorm.set_num_threads(2)
    try:
        assert len(numba_channels._span_parts(N, 8, 1, 4) or ()) == 2  # the samples are split
        with npnorm.use_kernels("numba"):
            m = npnorm.BatchNorm1d(8)
            m(x)
            dx = m.backward(dy)
    finally:
        npnorm.set_num_threads(threads)
    assert _error(m.grads["weight"], m64.grads["weight"]) <= 1e-6
    assert _error(dx, dx64) <= 3e-7


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_norm_dweight_is_centred_on_a_row_whose_gradient_holds_an_inf(family):
    """numba's LayerNorm decided whether to centre a row's xhat for dweight from dy's sums
    too: a row holding an inf in dy kept the uncentred xhat, and every finite column of
    dweight took its error (3e-2 off at offset 1e3 and spread 1e-3)."""
    rng = np.random.default_rng(0)
    x = (1e3 + 1e-3 * rng.normal(size=(4, 8))).astype(np.float32)
    dy = (10 + rng.normal(size=(4, 8))).astype(np.float32)
    dy[1, 0] = np.inf
    with npnorm.use_kernels("reference"), np.errstate(all="ignore"):
        m64 = npnorm.LayerNorm(8, dtype="float64")
        m64(x.astype(np.float64))
        m64.backward(dy.astype(np.float64))
    with npnorm.use_kernels(family), np.errstate(all="ignore"):
        m = npnorm.LayerNorm(8)
        m(x)
        m.backward(dy)
    got, want = m.grads["weight"].astype(np.float64)[1:], m64.grads["weight"][1:]  # column 0: inf
    assert np.isinf(m.grads["weight"][0])
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["BatchNorm2d", "GroupNorm", "InstanceNorm2d"])
def test_gradient_with_a_common_part_at_least_as_accurate_as_torch(torch, name, family):
    """dy = 1 + small (loss = y.sum() + a small term) on data 3 standard deviations from 0:
    the "numpy" family's sum(dy*x) - mean*sum(dy) added terms of one sign in float32,
    dweight 16 times and dx 20 times torch's error (BatchNorm; 4-10 times for the others);
    then GroupNorm's and InstanceNorm's sum(dy*(x - mean)) carried their float32 mean's
    rounding (up to an ulp) times sum(dy), dweight 2.7 times torch's error."""
    rng = np.random.default_rng(0)
    shape = (16, 4, 16, 16)
    x = (3.0 + rng.standard_normal(shape)).astype(np.float32)
    dy = (1.0 + 1e-3 * rng.standard_normal(shape)).astype(np.float32)
    c = shape[1]
    errors = {}
    for dtype in ("float64", "float32"):
        ref = _torch_layer(torch, name, c, shape[-1])
        if name == "InstanceNorm2d":
            ref = torch.nn.InstanceNorm2d(c, affine=True)
        ref = ref.to(getattr(torch, dtype))
        xt = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
        ref(xt).backward(torch.tensor(dy, dtype=getattr(torch, dtype)))
        errors[dtype] = (xt.grad.double().numpy(), ref.weight.grad.double().numpy())
    ours = npnorm.from_torch(ref.float())
    with npnorm.use_kernels(family):
        ours(x)
        dx = ours.backward(dy)
    (dx64, dw64), (dx32, dw32) = errors["float64"], errors["float32"]
    assert _error(dx, dx64) <= 2 * _error(dx32, dx64) + 1e-7, "dx"
    assert _error(ours.grads["weight"], dw64) <= 2 * _error(dw32, dw64) + 1e-7, "dweight"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "name, shape, layout",
    [
        ("batch_norm", (32, 4, 5000), "channels_last"),
        ("batch_norm", (65536, 8), "C"),
        ("instance_norm", (2, 4, 128, 128), "channels_last"),
        ("group_norm", (2, 8, 128, 128), "channels_last"),
        ("layer_norm", (16384, 16), "C"),
    ],
)
def test_an_upstream_gradient_with_a_large_common_part(family, name, shape, layout):
    """dy = 1e3 + noise, summed over many values along strided axes (samples, rows): the
    backward's sums are float64 in every family. The reference's float32 sums, which
    NumPy takes one value after another along such axes, left dx off by up to 22% of
    its size (BatchNorm channels-last; 4% BatchNorm1d, 6e-4 InstanceNorm), PyTorch's
    float32 by 3e-5 to 5e-4."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = (1e3 + rng.standard_normal(shape)).astype(np.float32)
    if layout == "channels_last":
        x, dy = channels_last(x), channels_last(dy)
    c, d = shape[1], shape[-1]
    w = np.linspace(0.5, 1.5, d if name == "layer_norm" else c)
    b = np.linspace(-1, 1, w.size)

    def backward(x, dy):
        w_, b_ = w.astype(x.dtype), b.astype(x.dtype)
        if name == "layer_norm":
            f = F.layer_norm_forward(x, d, w_, b_)
            return F.layer_norm_backward(dy, x, d, f[1], f[2], w_, b_)
        if name == "group_norm":
            f = F.group_norm_forward(x, 2, w_, b_)
            return F.group_norm_backward(dy, x, 2, f[1], f[2], w_, b_)
        forward, back = getattr(F, name + "_forward"), getattr(F, name + "_backward")
        f = forward(x, None, None, w_, b_, True, 0.1, 1e-5)
        return back(dy, x, f[1], f[2], w_, b_, True)

    with npnorm.use_kernels("reference"):
        truth = backward(x.astype(np.float64), dy.astype(np.float64))
    with npnorm.use_kernels(family):
        ours = backward(x, dy)
    assert _error(ours[0], truth[0]) <= 1e-4, "dx"
    assert _error(ours[2], truth[2]) <= 1e-6, "dbias"
    # dweight = sum(dy*xhat) carries the float32 saved statistics' rounding times the
    # common part: up to 6e-3 here in every family, as in PyTorch's float32
    assert _error(ours[1], truth[1]) <= 1e-2, "dweight"


def _each_functional(x, eps):
    """Every layer's functional forward on x (N, C, L): LayerNorm over L, GroupNorm with
    a group per channel (BatchNorm in training only where eps > 0: PyTorch refuses 0)."""
    c, d = x.shape[1], x.shape[-1]
    w, b = np.full(c, 2.0, dtype=x.dtype), np.full(c, 0.5, dtype=x.dtype)
    rm, rv = np.zeros(c, dtype=x.dtype), np.ones(c, dtype=x.dtype)
    return {
        "layer_norm": F.layer_norm(x, d, np.full(d, 2.0, x.dtype), np.full(d, 0.5, x.dtype), eps),
        **({"batch_norm": F.batch_norm(x, rm, rv, w, b, True, 0.1, eps)} if eps > 0 else {}),
        "group_norm": F.group_norm(x, c, w, b, eps),
        "instance_norm": F.instance_norm(x, None, None, w, b, True, 0.1, eps),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_sums_beyond_its_range(family):
    # the mean of [3e38, 3e38, 2e38, 2e38] is 2.5e38, but its float32 sum overflows: the
    # reference gave NaN everywhere
    x = np.array([3e38, 3e38, 2e38, 2e38], dtype=np.float32).reshape(1, 1, 4)
    with npnorm.use_kernels(family):
        for op, y in _each_functional(x, 1e-5).items():
            np.testing.assert_allclose(y.reshape(-1), [2.5, 2.5, -1.5, -1.5], rtol=1e-6, err_msg=op)


def test_the_reference_centres_and_scales_float32_beyond_its_range_in_float64():
    """Where ``x - mean`` passes float32's range, or (eps=0) rstd does, the reference
    computes both in float64 and gives the finite result (the README's two limits, where
    the fast kernels, as PyTorch's, may give inf or NaN: not held here); InstanceNorm at
    eps=0 takes the instance as constant, zeros, in every family."""
    x = np.array([3e38, 3e38, 3e38, -3e38], dtype=np.float32).reshape(1, 1, 4)
    with npnorm.use_kernels("reference"):
        for op, y in _each_functional(x, 1e-5).items():
            np.testing.assert_allclose(
                y.reshape(-1), [1.65470, 1.65470, 1.65470, -2.96410], rtol=1e-5, err_msg=op
            )
        tiny = np.array([[1e-39, -1e-39, 2e-39, 0.0]], dtype=np.float32)
        np.testing.assert_allclose(
            F.layer_norm(tiny, 4, eps=0.0), [[0.4472136, -1.3416408, 1.3416408, -0.4472136]], rtol=1e-6
        )
        np.testing.assert_allclose(
            F.rms_norm(tiny, 4, eps=0.0), [[0.8164966, -0.8164966, 1.6329932, 0.0]], rtol=1e-6
        )
        np.testing.assert_allclose(
            F.group_norm(tiny.reshape(1, 1, 4), 1, eps=0.0).reshape(-1),
            [0.4472136, -1.3416408, 1.3416408, -0.4472136],
            rtol=1e-6,
        )
    for family in FAMILIES:
        with npnorm.use_kernels(family):
            np.testing.assert_array_equal(F.instance_norm(tiny.reshape(1, 1, 4), eps=0.0), 0)


def _each_backward(x, dy):
    """Every layer's forward then backward on x (N, C, L), as the tests above; dx and the
    parameter gradients of each."""
    c, d = x.shape[1], x.shape[-1]
    w, b = np.full(c, 2.0, dtype=x.dtype), np.full(c, 0.5, dtype=x.dtype)
    wd, bd = np.full(d, 2.0, dtype=x.dtype), np.full(d, 0.5, dtype=x.dtype)
    _, m, r = F.layer_norm_forward(x, d, wd, bd)
    _, rr = F.rms_norm_forward(x, d, wd)
    _, bm, br, _, _ = F.batch_norm_forward(x, None, None, w, b, training=True)
    _, gm, gr = F.group_norm_forward(x, c, w, b)
    _, im, ir, _, _ = F.instance_norm_forward(x, None, None, w, b, True)
    return {
        "layer_norm": F.layer_norm_backward(dy, x, d, m, r, wd, bd),
        "rms_norm": F.rms_norm_backward(dy, x, d, rr, wd)[:2],
        "batch_norm": F.batch_norm_backward(dy, x, bm, br, w, b, training=True),
        "group_norm": F.group_norm_backward(dy, x, c, gm, gr, w, b),
        "instance_norm": F.instance_norm_backward(dy, x, im, ir, w, b, True),
    }


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "reference"])
def test_float32_rows_near_its_range_have_the_references_finite_gradients(family):
    # dy * (x - mean) overflowed float32 in the fast kernels' sums: dx NaN, dweight +-inf,
    # where the reference (xhat first) gives finite gradients (torch float64's)
    dy = np.array([[1.0, -2.0, 0.5, 3.0], [0.5, 1.0, -1.0, 2.0]], np.float32).reshape(2, 1, 4)
    for rows in ([[3e38, -3e38, 3e38, -3e38], [-3e38, 3e38, -3e38, 3e38]], [[3e38, 3e38, 2e38, 2e38]] * 2):
        x = np.array(rows, np.float32).reshape(2, 1, 4)
        with npnorm.use_kernels("reference"):
            want = _each_backward(x, dy)
        with npnorm.use_kernels(family):
            got = _each_backward(x, dy)
        for op, results in want.items():
            for a, b in zip(got[op], results, strict=True):
                assert np.isfinite(b).all(), op
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-45, err_msg=op)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [1e-3, 50.0, 4e5])
def test_constant_rows_give_the_bias(family, scale):
    # a row of one value has mean exactly that value: x - mean is 0 and the output exactly
    # the bias, as PyTorch's (the reference's float32 mean left rounding noise, scaled by
    # rstd ~ 316 into errors of 3e-4; the "numpy" family's, 1e-6 to 5e-8, and +-1 or inf
    # with eps=0, where PyTorch gives NaN)
    rng = np.random.default_rng(0)
    values = (scale * rng.uniform(-1, 1, size=(1, 16, 1))).astype(np.float32)  # one per channel
    x = np.ascontiguousarray(np.broadcast_to(values, (5, 16, 777)))
    with npnorm.use_kernels(family):
        for op, y in _each_functional(x, 1e-5).items():
            np.testing.assert_array_equal(y, 0.5, err_msg=op)
        for op, y in _each_functional(x, 0.0).items():  # exactly 0 / 0: NaN, as in PyTorch
            if op == "instance_norm":  # PyTorch's rstd is 0 where var + eps is 0: the bias
                np.testing.assert_array_equal(y, 0.5, err_msg=op)
            else:  # (BatchNorm in training refuses eps=0, as PyTorch)
                assert np.isnan(y).all(), op


@pytest.mark.parametrize("family", FAMILIES)
def test_constant_rows_beside_varying_ones(family, torch):
    # in one block with rows that vary (one with a large offset, which makes the "numpy"
    # family centre its block again): the constant rows give the bias exactly, the others
    # what the reference gives, and BatchNorm's running variance takes 0 for a constant
    # channel (eps=0 too: NaN exactly where PyTorch has it)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 6, 333)).astype(np.float32)
    x[:, 1] += 1e3
    x[:, 2] = np.float32(0.3)
    x[:, 4] = np.float32(-771.7)
    for eps in (1e-5, 0.0):
        with npnorm.use_kernels("reference"):
            ref = _each_functional(x.astype(np.float64), eps)
        with npnorm.use_kernels(family):
            ours = _each_functional(x, eps)
        tf = torch.nn.functional
        xt = torch.tensor(x)
        c, d = x.shape[1], x.shape[-1]
        w, b = torch.full((c,), 2.0), torch.full((c,), 0.5)
        theirs = {
            "layer_norm": tf.layer_norm(xt, (d,), torch.full((d,), 2.0), torch.full((d,), 0.5), eps),
            **({"batch_norm": tf.batch_norm(xt, None, None, w, b, True, 0.1, eps)} if eps > 0 else {}),
            "group_norm": tf.group_norm(xt, c, w, b, eps),
            "instance_norm": tf.instance_norm(xt, None, None, w, b, True, 0.1, eps),
        }
        for op, y in ours.items():
            t = theirs[op].numpy()
            np.testing.assert_array_equal(np.isnan(y), np.isnan(t), err_msg=f"{op} eps={eps}")
            if op != "layer_norm":  # per channel: the constant channels are exactly the bias
                for ch in (2, 4):
                    if eps:
                        np.testing.assert_array_equal(y[:, ch], 0.5, err_msg=op)
            ok = ~np.isnan(y)
            np.testing.assert_allclose(y[ok], ref[op][ok], rtol=0, atol=3e-6, err_msg=f"{op} eps={eps}")
    rm, rv = np.zeros(6, np.float32), np.ones(6, np.float32)
    with npnorm.use_kernels(family):
        F.batch_norm(x, rm, rv, None, None, True, 1.0, 1e-5)
    np.testing.assert_array_equal(rv[[2, 4]], 0.0)
    np.testing.assert_array_equal(rm[[2, 4]], x[0, [2, 4], 0])


def test_the_reference_on_other_backends(backend):
    # what torch tensors, array_api_strict and CuPy arrays always run
    x = backend.asarray(np.array([[3e38, 3e38, 2e38, 2e38]]), "float32")
    y = F.layer_norm(x, 4)
    np.testing.assert_allclose(backend.numpy(y), [[1, 1, -1, -1]], rtol=1e-6)
    offset = (np.random.default_rng(0).normal(size=(8, 768)) + 1e3).astype(np.float32)
    y = backend.numpy(F.layer_norm(backend.asarray(offset, "float32"), 768))
    y64 = F.layer_norm(offset.astype(np.float64), 768)
    assert _error(y, y64) <= 3e-7


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_holding_inf_keeps_an_inf_mean(family):
    # beside a row with a large offset, the "numpy" kernels centred the block again and
    # added mean(x - inf) = NaN to the inf row's mean
    x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    x[1] += 1e4
    x[2, 5] = np.inf
    with npnorm.use_kernels(family):
        _, mean, _ = F.layer_norm_forward(x, 64)
        _, gmean, _ = F.group_norm_forward(x.reshape(4, 2, 32), 1)
    assert mean[2] == np.inf and gmean[2, 0] == np.inf
    assert np.isfinite(mean[[0, 1, 3]]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_channel_holding_inf_has_an_inf_mean_as_in_torch(family, torch):
    # the "numpy" family's merge of row means added the residual inf - inf = NaN
    x = np.array([[[0.5, 1.0]], [[np.inf, 2.0]]])
    rm_t, rv_t = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    torch.nn.functional.batch_norm(torch.tensor(x), rm_t, rv_t, training=True)
    with npnorm.use_kernels(family):
        _, mean, _, rm, _ = F.batch_norm_forward(x, np.zeros(1), np.ones(1), None, None, True)
    np.testing.assert_array_equal(mean, [np.inf])
    np.testing.assert_array_equal(rm, rm_t.numpy())


@pytest.mark.parametrize("family", FAMILIES)
def test_instance_means_near_the_float32_limit_average_without_overflow(family, torch):
    # the "numpy" family summed the per-instance means in float32: inf
    x = np.full((2, 1, 4), 2.975e38, np.float32)
    x[:, :, :2] = 2.95e38
    x[:, :, 2:] = 3.0e38
    rm_t, rv_t = torch.zeros(1), torch.ones(1)
    torch.nn.functional.instance_norm(torch.tensor(x), rm_t, rv_t, use_input_stats=True)
    with npnorm.use_kernels(family):
        _, _, _, rm, _ = F.instance_norm_forward(x, np.zeros(1, np.float32), np.ones(1, np.float32))
    assert np.isfinite(rm).all()
    np.testing.assert_allclose(rm, rm_t.numpy(), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_spread_near_the_float32_limit_stays_finite(family):
    # centring a row about its first value overflowed float32 where the row's spread is
    # over half its range (a change that made constant rows exact gave NaN here)
    x = np.full((2, 1000), 1.5e38, np.float32)
    x[0, 0], x[0, -1] = 3.3e38, -0.3e38
    x[1] = 5.0  # a constant row in the same block
    with npnorm.use_kernels("reference"):
        ref = F.layer_norm(x, 1000)
    with npnorm.use_kernels(family):
        for y in (F.layer_norm(x, 1000), F.group_norm(x[:, None], 1)[:, 0]):
            assert np.isfinite(y).all()
            np.testing.assert_allclose(y[0, [0, -1]], ref[0, [0, -1]], rtol=1e-5)
            np.testing.assert_array_equal(y[1], 0.0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [1e-20, 1e-26])
@pytest.mark.parametrize("op", ["instance_norm", "group_norm", "batch_norm"])
def test_a_spread_near_float32s_smallest_keeps_finite_gradients(family, scale, op):
    """Values of spread 1e-20 and less with eps about 0 (0; BatchNorm's smallest positive,
    1e-45): rstd ~1e20, whose square overflows float32. The "numpy" family's backward
    coefficients (about rstd^2) went inf and dx NaN/inf; it now takes the reference's way,
    as for the other end (a huge spread: ``extreme_coefficients``)."""
    rng = np.random.default_rng(0)
    x = (scale * rng.normal(size=(2, 3, 64))).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    w, b = np.linspace(0.5, 1.5, 3), np.linspace(-1, 1, 3)
    _assert_dx_finite_and_accurate(op, family, x, dy, w, b, groups=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("running_var, weight, scale", [(1e-28, 1e25, 1e-6), (1e24, 1e20, 1e25)])
@pytest.mark.parametrize("op", ["instance_norm", "batch_norm"])
def test_running_statistics_scale_dy_once_by_rstd_times_w(family, running_var, weight, scale, op):
    """With running statistics dx = dy * (rstd * w): where rstd * w (rstd 1e14, w 1e25) or
    dy * w (1e25 * 1e20) leaves float32 but dx (~1e33) fits, dx was inf: the "numpy"
    family's (and numba's through it) formed rstd * w in float32, the reference dy * w
    first. The product is taken in float64, as in training; PyTorch's dx is finite."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 6)).astype(np.float32)
    dy = (scale * rng.standard_normal(x.shape)).astype(np.float32)
    w, rm, rv = np.array([weight, -2 * weight]), np.zeros(2), np.full(2, running_var)

    def backward(x, dy):
        w_, rm_, rv_ = (a.astype(x.dtype) for a in (w, rm, rv))
        forward, back = getattr(F, op + "_forward"), getattr(F, op + "_backward")
        f = forward(x, rm_, rv_, w_, None, False, 0.1, 0.0)
        return back(dy, x, f[1], f[2], w_, None, False)[0]

    with npnorm.use_kernels("reference"):
        truth = backward(x.astype(np.float64), dy.astype(np.float64))
    with npnorm.use_kernels(family):
        ours = backward(x, dy)
    assert np.isfinite(ours).all()
    assert _error(ours, truth) <= 1e-6


def _assert_dx_finite_and_accurate(op, family, x, dy, w, b, *, groups):
    """``op``'s training backward (``eps`` about 0) on float32 ``x`` and ``dy`` in ``family``:
    finite, and within 1e-5 of the reference's on the same values in float64."""

    def backward(x, dy):
        w_, b_ = w.astype(x.dtype), None if b is None else b.astype(x.dtype)
        if op == "group_norm":
            f = F.group_norm_forward(x, groups, w_, b_, 0.0)
            return F.group_norm_backward(dy, x, groups, f[1], f[2], w_, b_)
        eps = 1e-45 if op == "batch_norm" else 0.0
        forward, back = getattr(F, op + "_forward"), getattr(F, op + "_backward")
        f = forward(x, None, None, w_, b_, True, 0.1, eps)
        return back(dy, x, f[1], f[2], w_, b_, True)

    with npnorm.use_kernels("reference"):
        truth = backward(x.astype(np.float64), dy.astype(np.float64))
    with npnorm.use_kernels(family):
        ours = backward(x, dy)
    assert np.isfinite(ours[0]).all()
    assert _error(ours[0], truth[0]) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", [(64, 8, 3), (16, 8, 100), (8, 16, 12, 12), (32, 4, 5000)])
def test_batch_norm_dx_centres_dy_as_torch_does(torch, family, shape):
    """BatchNorm's training dx with dy = 1e3 + noise on data centred near 0: every family
    centres dy on its (float64) mean before scaling it, as PyTorch's kernel does, and
    takes the sums over samples in float64. As ``a*dy + c`` the fast families' dx carried
    ``a*dy``'s rounding: 2-3x (numba) and 3-6x (numpy) PyTorch's error; the reference's
    ``dxhat = dy*w`` first, then ``dxhat - xhat*proj`` before the mean, 2-4x."""
    ratios = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=shape).astype(np.float32)
        dy = (1e3 + rng.normal(size=shape)).astype(np.float32)
        c = shape[1]
        w = (1 + 0.5 * rng.normal(size=c)).astype(np.float32)
        b = rng.normal(size=c).astype(np.float32)
        with npnorm.use_kernels("reference"):
            args64 = [a.astype(np.float64) for a in (x, w, b)]
            f = F.batch_norm_forward(args64[0], None, None, *args64[1:], training=True)
            dx64 = F.batch_norm_backward(dy.astype(np.float64), args64[0], f[1], f[2], *args64[1:], True)[0]
        xt = torch.tensor(x, requires_grad=True)
        wt, bt = torch.tensor(w), torch.tensor(b)
        torch.nn.functional.batch_norm(xt, None, None, wt, bt, True).backward(torch.tensor(dy))
        with npnorm.use_kernels(family):
            f = F.batch_norm_forward(x, None, None, w, b, training=True)
            dx = F.batch_norm_backward(dy, x, f[1], f[2], w, b, True)[0]
        ratios.append(_error(dx, dx64) / _error(xt.grad.numpy(), dx64))
    assert np.median(ratios) <= 1.5, ratios


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "spread, weight, scale",
    [
        (1e-14, 1e8, 1e4),
        (1e-10, 1e15, 1e6),
        (1e-15, 1e-8, 1e25),  # rstd * dy beyond float32, dx ~1e32
        (1e-10, 1e-10, 1e30),  # the same, dx ~1e30
        (1e-14, 1e25, 1e-6),  # rstd * w beyond float32, dx ~1e33
        (1e30, 1e25, 1e-12),  # dy * rstd subnormal in float32, dx ~1e-17
    ],
)
@pytest.mark.parametrize("op", ["instance_norm", "group_norm", "batch_norm"])
def test_a_small_spread_with_large_weights_and_gradients_keeps_finite_gradients(
    family, spread, weight, scale, op
):
    """rstd 1e10 to 1e14, below the tiny spread's bound (``extreme_coefficients``), but
    weights and dy large enough that the "numpy" family's coefficient
    ``rstd^3*sum(g*(x - mean))/n`` left float32 (dx ~1e26 fits): its dx was inf and NaN
    in most places. Such coefficients now take the reference's way. Where one of the two
    factors of ``rstd * w * dy`` applied alone leaves float32 (rstd * dy, rstd * w) and
    dx fits, the reference's BatchNorm and InstanceNorm dx (which scaled by rstd, then
    w) was inf and NaN, and numba's (whose per-channel ``rstd * w`` was inf) too; a
    subnormal ``dy * rstd`` lost digits (3e-4). (PyTorch's dx is inf and NaN in the
    first two, and 0 in the last.)"""
    rng = np.random.default_rng(7)
    x = (spread * rng.standard_normal((4, 3, 16))).astype(np.float32)
    dy = (scale * rng.standard_normal(x.shape)).astype(np.float32)
    _assert_dx_finite_and_accurate(op, family, x, dy, np.full(3, weight), None, groups=3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "name, training", [("batch_norm", True), ("batch_norm", False), ("instance_norm", False)]
)
def test_an_offset_hidden_by_a_large_eps_is_still_centred(name, training, family):
    """With eps = 1 over a variance of 1e-6, rstd = 1/sqrt(var + eps) ~ 1 made a mean 1e3
    standard deviations from 0 look like one of 1, and the "numpy" kernels folded it into
    the shift: y lost 10-50 ulps of its size (PyTorch's 2-20). Whether to fold is judged by
    the variance now."""
    rng = np.random.default_rng(4)
    x = (1.0 + 1e-3 * rng.standard_normal((4, 3, 64))).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(3)).astype(np.float32)
    b = np.zeros(3, np.float32)  # (a bias of 1 would hide the loss: it is measured against |y|)
    x64 = x.astype(np.float64)
    rm = x64.mean((0, 2)).astype(np.float32)
    rv = x64.var((0, 2)).astype(np.float32)
    stats = (
        (x64.mean((0, 2)), x64.var((0, 2))) if training else (rm.astype(np.float64), rv.astype(np.float64))
    )
    xhat = (x64 - stats[0][:, None]) / np.sqrt(stats[1][:, None] + 1.0)
    exact = xhat * w[:, None] + b[:, None]  # N, C, L
    size = np.max(np.abs(xhat * w[:, None]) + np.abs(b[:, None]), axis=(0, 2))  # C
    forward = getattr(F, f"{name}_forward")
    with npnorm.use_kernels(family):
        y = forward(x, rm.copy(), rv.copy(), w, b, training, 0.1, 1.0)[0]
    ulps = np.max(np.abs(y - exact), axis=(0, 2)) / size / np.finfo(np.float32).eps
    assert np.max(ulps) <= 2.0, ulps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_float32_dweight_over_many_short_rows_is_summed_without_drift(name, family):
    """dweight sums dy*xhat over every row: one float32 product over a block of 16384 rows of
    4 values lost 13 ulps in the "numpy" kernels (PyTorch's: 0.6). Terms of one sign here
    (dy has x's sign), so nothing cancels: the error is the summation's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16384, 4)).astype(np.float32)
    dy = (x * (1 + rng.random((16384, 4)))).astype(np.float32)
    w = (1 + 0.5 * rng.random(4)).astype(np.float32)
    x64 = x.astype(np.float64)
    with npnorm.use_kernels(family):
        if name == "rms_norm":
            _, rstd = F.rms_norm_forward(x, 4, w)
            dw = F.rms_norm_backward(dy, x, 4, rstd, w)[1]
            xhat = x64 * rstd.astype(np.float64).reshape(-1, 1)
        else:
            _, mean, rstd = F.layer_norm_forward(x, 4, w, np.zeros(4, np.float32))
            dw = F.layer_norm_backward(dy, x, 4, mean, rstd, w, np.zeros(4, np.float32))[1]
            xhat = (x64 - mean.astype(np.float64).reshape(-1, 1)) * rstd.astype(np.float64).reshape(-1, 1)
    exact = np.sum(dy * xhat, axis=0)  # (from the saved statistics: the sum is what is measured)
    scale = np.sum(np.abs(dy * xhat), axis=0)
    assert np.max(np.abs(dw - exact) / scale) / np.finfo(np.float32).eps <= 2.0
