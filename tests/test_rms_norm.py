"""RMSNorm: parity with torch.nn.RMSNorm, properties, gradcheck, eps=None."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import draw_state, grid_arrays, load_into_torch, randomize, step_and_compare
from hypothesis import given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(
    batch=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    norm=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    eps=st.sampled_from([None, 1e-6, 1e-2]),
    affine=st.booleans(),
    data=st.data(),
)
def test_parity_with_torch(torch, backend, dtype, batch, norm, eps, affine, data):
    ours = npnorm.RMSNorm(norm, eps, affine, dtype=dtype, xp=backend.xp)
    ref = torch.nn.RMSNorm(norm, eps, affine, dtype=getattr(torch, dtype))
    draw_state(data, ours)
    load_into_torch(torch, ours, ref)
    full = (*batch, *norm)
    x, dy = data.draw(grid_arrays(full), label="x"), data.draw(grid_arrays(full), label="dy")
    step_and_compare(torch, backend, ours, ref, x, dy, dtype)


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck(backend, rng, affine):
    m = npnorm.RMSNorm((2, 5), elementwise_affine=affine, xp=backend.xp)
    randomize(m, rng)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(3, 2, 5))))


def test_invariant_to_positive_per_row_scale(backend, rng):
    x = rng.normal(size=(4, 6))
    scale = rng.uniform(0.1, 50, size=(4, 1))
    y1 = F.rms_norm(backend.asarray(x), 6, eps=0.0)
    y2 = F.rms_norm(backend.asarray(x * scale), 6, eps=0.0)
    np.testing.assert_allclose(backend.numpy(y1), backend.numpy(y2), atol=1e-12)


def test_output_has_unit_mean_square():
    x = np.random.default_rng(0).normal(size=(5, 32)) * 7
    y = F.rms_norm(x, 32, eps=0.0)
    np.testing.assert_allclose((y * y).mean(axis=-1), 1, atol=1e-12)


@pytest.mark.parametrize(
    "dtype,expect", [("float32", np.finfo(np.float32).eps), ("float64", np.finfo(np.float64).eps)]
)
def test_eps_none_is_machine_epsilon_of_compute_dtype(dtype, expect):
    """Rows whose mean square is 0 or of the order of eps: rstd shows eps itself."""
    x = np.zeros((2, 4), dtype=dtype)
    x[0, 0] = 2 * np.sqrt(expect)  # mean square = eps
    _, rstd = F.rms_norm_forward(x, 4)
    np.testing.assert_allclose(rstd, [1 / np.sqrt(2 * expect), 1 / np.sqrt(expect)], rtol=1e-6)


def test_float16_uses_float32_epsilon():
    x = np.zeros((1, 4), dtype=np.float16)
    _, rstd = F.rms_norm_forward(x, 4)
    assert rstd.dtype == np.float32
    np.testing.assert_allclose(rstd[0], 1 / np.sqrt(np.finfo(np.float32).eps), rtol=1e-6)


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize(
    "x_dtype,w_dtype", [("float16", "float64"), ("float32", "float64"), ("float64", "float32")]
)
def test_eps_none_follows_the_input_not_the_weight_as_torch(torch, family, x_dtype, w_dtype):
    """torch's default eps is the machine epsilon of the input's computation dtype; a
    float64 weight made it float64's (2.2e-16 instead of 1.2e-7: rstd 6.7e7 on a row of
    zeros, dx inf in float16)."""
    x = np.zeros((2, 3), dtype=x_dtype)
    x[1] = [1e-4, -2e-4, 3e-4]  # mean square ~ float32's eps: rstd shows which eps
    dy = np.ones((2, 3), dtype=x_dtype)
    w = np.array([0.5, 1.0, 1.5], dtype=w_dtype)
    xt = torch.tensor(x, requires_grad=True)
    with warnings.catch_warnings():  # torch: "Mismatch dtype between input and weight"
        warnings.simplefilter("ignore", UserWarning)
        yt = torch.nn.functional.rms_norm(xt, (3,), torch.tensor(w))
    yt.backward(torch.tensor(dy))
    want_eps = np.finfo(np.result_type(np.float32, x_dtype)).eps
    with npnorm.use_kernels(family):
        y, rstd = F.rms_norm_forward(x, 3, w)
        dx, _, _ = F.rms_norm_backward(dy, x, 3, rstd, w)
        m = npnorm.RMSNorm(3, dtype=w_dtype)
        m.load_state_dict({"weight": w})
        my, mdx = m(x), m.backward(dy)
    ms = (x.astype(np.float64) ** 2).mean(axis=1)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(ms + want_eps), rtol=1e-6)
    rtol = 2e-3 if x_dtype == "float16" else 1e-5
    for a, b in ((y, yt), (dx, xt.grad), (my, yt), (mdx, xt.grad)):
        assert a.dtype == np.dtype(x_dtype)
        np.testing.assert_allclose(a.astype(np.float64), b.detach().double().numpy(), rtol=rtol, atol=rtol)


def test_state_dict_keys_match_torch(torch):
    for affine in (True, False):
        ours = npnorm.RMSNorm(3, elementwise_affine=affine)
        assert list(ours.state_dict()) == list(torch.nn.RMSNorm(3, elementwise_affine=affine).state_dict())


def test_backward_returns_triple_with_no_bias(rng):
    x = rng.normal(size=(2, 3))
    _y, rstd = F.rms_norm_forward(x, 3, np.ones(3))
    _dx, dw, db = F.rms_norm_backward(np.ones_like(x), x, 3, rstd, np.ones(3))
    assert db is None and dw.shape == (3,)
