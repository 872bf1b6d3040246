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
from hypothesis import given, settings
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
}


def _values(shape):
    # values of float32 range, spread by 3 about 0.5
    return hnp.arrays(np.float64, shape, elements=st.floats(-4, 4, width=32)).map(lambda a: a * 3.0 + 0.5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
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
    dy = data.draw(hnp.arrays(np.float64, shape, elements=st.floats(-2, 2, width=32)), label="dy")
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
