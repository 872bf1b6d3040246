"""Every kernel family for NumPy input ("reference", "numpy", "numba" where installed)
against torch.autograd, in float64 and float32, and against finite differences
(gradcheck, float64), layer by layer, on drawn arrays (so that a failure shrinks to its
values). The backend-parametrized parity tests run the default family only (numba when
installed), so the others were checked against the reference alone."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from conftest import Backend
from helpers import draw_state, load_into_torch, randomize, step_and_compare
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import npnorm

FAMILIES = npnorm.kernels_available()
NUMPY = Backend("numpy")

# name: (npnorm module of a dtype, torch class name, (its args, kwargs), input shape)
LAYERS = {
    "LayerNorm": (lambda dt: npnorm.LayerNorm((3, 5), dtype=dt), "LayerNorm", (((3, 5),), {}), (4, 3, 5)),
    "RMSNorm": (lambda dt: npnorm.RMSNorm(5, dtype=dt), "RMSNorm", ((5,), {}), (4, 3, 5)),
    "BatchNorm1d": (lambda dt: npnorm.BatchNorm1d(3, dtype=dt), "BatchNorm1d", ((3,), {}), (4, 3, 5)),
    "BatchNorm2d": (
        lambda dt: npnorm.BatchNorm2d(3, momentum=None, dtype=dt),
        "BatchNorm2d",
        ((3,), {"momentum": None}),
        (2, 3, 4, 3),
    ),
    "GroupNorm": (lambda dt: npnorm.GroupNorm(2, 4, dtype=dt), "GroupNorm", ((2, 4), {}), (3, 4, 5)),
    "InstanceNorm1d": (
        lambda dt: npnorm.InstanceNorm1d(3, affine=True, track_running_stats=True, dtype=dt),
        "InstanceNorm1d",
        ((3,), {"affine": True, "track_running_stats": True}),
        (4, 3, 6),
    ),
    "BatchNorm3d": (lambda dt: npnorm.BatchNorm3d(3, dtype=dt), "BatchNorm3d", ((3,), {}), (2, 3, 2, 2, 3)),
    "InstanceNorm2d": (
        lambda dt: npnorm.InstanceNorm2d(3, affine=True, track_running_stats=True, dtype=dt),
        "InstanceNorm2d",
        ((3,), {"affine": True, "track_running_stats": True}),
        (2, 3, 3, 4),
    ),
    "InstanceNorm3d": (
        lambda dt: npnorm.InstanceNorm3d(3, affine=True, dtype=dt),
        "InstanceNorm3d",
        ((3,), {"affine": True}),
        (2, 3, 2, 2, 3),
    ),
    # without weight and bias, or without running statistics
    "LayerNorm no affine": (
        lambda dt: npnorm.LayerNorm(5, elementwise_affine=False, dtype=dt),
        "LayerNorm",
        ((5,), {"elementwise_affine": False}),
        (4, 3, 5),
    ),
    "RMSNorm no affine": (
        lambda dt: npnorm.RMSNorm(5, elementwise_affine=False, dtype=dt),
        "RMSNorm",
        ((5,), {"elementwise_affine": False}),
        (4, 3, 5),
    ),
    "LayerNorm no bias": (
        lambda dt: npnorm.LayerNorm(5, bias=False, dtype=dt),
        "LayerNorm",
        ((5,), {"bias": False}),
        (4, 3, 5),
    ),
    "BatchNorm1d untracked": (
        lambda dt: npnorm.BatchNorm1d(3, track_running_stats=False, dtype=dt),
        "BatchNorm1d",
        ((3,), {"track_running_stats": False}),
        (4, 3),
    ),
    "BatchNorm2d no affine": (
        lambda dt: npnorm.BatchNorm2d(3, affine=False, dtype=dt),
        "BatchNorm2d",
        ((3,), {"affine": False}),
        (2, 3, 4, 3),
    ),
    "GroupNorm no affine": (
        lambda dt: npnorm.GroupNorm(3, 6, affine=False, dtype=dt),
        "GroupNorm",
        ((3, 6), {"affine": False}),
        (2, 6, 4),
    ),
    "InstanceNorm2d tracked": (
        lambda dt: npnorm.InstanceNorm2d(3, track_running_stats=True, dtype=dt),
        "InstanceNorm2d",
        ((3,), {"track_running_stats": True}),
        (2, 3, 3, 4),
    ),
}


def _values(shape):
    # values of float32 range, spread by 3 about 0.5
    # (fill=nothing: each element drawn on its own, not most of the array one fill value)
    floats = st.floats(-4, 4, width=32)
    return hnp.arrays(np.float64, shape, elements=floats, fill=st.nothing()).map(lambda a: a * 3.0 + 0.5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("name", list(LAYERS))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_each_family_matches_torch_autograd_over_training_steps_then_eval(torch, name, dtype, family, data):
    make, torch_name, (args, kwargs), shape = LAYERS[name]
    ours = make(dtype)
    ref = getattr(torch.nn, torch_name)(*args, **kwargs, dtype=getattr(torch, dtype))
    draw_state(data, ours)
    load_into_torch(torch, ours, ref)
    x = data.draw(_values(shape), label="x")
    dy = data.draw(
        hnp.arrays(np.float64, shape, elements=st.floats(-2, 2, width=32), fill=st.nothing()), label="dy"
    )
    with npnorm.use_kernels(family):
        for mode in ("train", "train", "eval"):
            ours.train(mode == "train")
            ref.train(mode == "train")
            step_and_compare(torch, NUMPY, ours, ref, x, dy, dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(LAYERS))
def test_each_family_passes_gradcheck(name, family):
    make, _, _, shape = LAYERS[name]
    rng = np.random.default_rng(1)
    m = make("float64")
    randomize(m, rng)
    x = rng.normal(size=shape) * 2 + 1
    with npnorm.use_kernels(family):
        for mode in (True, False):
            m.train(mode)
            assert npnorm.gradcheck(m, x)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None)
@given(
    rows=hnp.arrays(
        np.float64, (3, 8), elements=st.floats(-8, 8, allow_subnormal=False, width=32), fill=st.nothing()
    ),
    exponent=st.integers(-30, -20),
)
def test_tiny_float32_rows_with_eps_0_are_normalized_as_in_float64(family, rows, exponent):
    """Rows of float32 values around 1e-25 (squares below float32's normal range) with
    eps = 0: every family gives the float64 math's result. The "numpy" family summed the
    squares in float32, to 0: inf outputs (InstanceNorm: its bias, as a constant row)."""
    x = (rows * 10.0**exponent).astype(np.float32)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(axis=1, keepdims=True)
    # a constant row (or all 0) is NaN by definition with eps = 0
    assume((centred**2).sum(axis=1).all() and (x64**2).sum(axis=1).all())
    ln = centred / np.sqrt((centred**2).mean(axis=1, keepdims=True))
    rms = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True))
    with npnorm.use_kernels(family):
        got = {
            "LayerNorm": npnorm.functional.layer_norm(x, 8, eps=0.0),
            "RMSNorm": npnorm.functional.rms_norm(x, 8, eps=0.0),
            "GroupNorm": npnorm.functional.group_norm(x[:, :, None], 1, eps=0.0)[:, :, 0],
            "InstanceNorm": npnorm.functional.instance_norm(x[None], eps=0.0)[0],
        }
    for name, y in got.items():
        want = rms if name == "RMSNorm" else ln
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=name)
