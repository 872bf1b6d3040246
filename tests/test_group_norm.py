"""GroupNorm: parity with torch.nn.GroupNorm, gradcheck, equivalences, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import draw_state, grid_arrays, load_into_torch, randomize, step_and_compare
from hypothesis import given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(
    n=st.integers(1, 3),
    groups=st.integers(1, 3),
    per_group=st.integers(1, 3),
    spatial=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    affine=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-2]),
    data=st.data(),
)
def test_parity_with_torch(torch, backend, dtype, n, groups, per_group, spatial, affine, eps, data):
    c = groups * per_group
    shape = (n, c, *spatial)
    if per_group * int(np.prod(spatial)) < 2:  # torch: "Expected more than 1 value per channel"
        shape = (*shape, 2)
    ours = npnorm.GroupNorm(groups, c, eps, affine, dtype=dtype, xp=backend.xp)
    ref = torch.nn.GroupNorm(groups, c, eps, affine, dtype=getattr(torch, dtype))
    draw_state(data, ours)
    load_into_torch(torch, ours, ref)
    for mode in (True, False):  # no running statistics: eval is the same computation
        ours.train(mode)
        ref.train(mode)
        x, dy = data.draw(grid_arrays(shape), label="x"), data.draw(grid_arrays(shape), label="dy")
        step_and_compare(torch, backend, ours, ref, x, dy, dtype)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("training", [True, False])
def test_gradcheck(backend, rng, groups, training):
    m = npnorm.GroupNorm(groups, 4, xp=backend.xp)
    randomize(m, rng)
    m.train(training)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(2, 4, 3))))


def _standardized(x, axes):
    """(x - mean) / sqrt(var + 1e-5) over ``axes``, in plain NumPy."""
    return (x - x.mean(axis=axes, keepdims=True)) / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_one_group_is_layer_norm_over_channels_and_space(rng, family):
    x = rng.normal(size=(3, 4, 5))
    with npnorm.use_kernels(family):  # (the fast families share code between the layers)
        np.testing.assert_allclose(F.group_norm(x, 1), _standardized(x, (1, 2)), atol=1e-12)
        np.testing.assert_allclose(F.layer_norm(x, (4, 5)), _standardized(x, (1, 2)), atol=1e-12)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_one_channel_per_group_is_instance_norm(rng, family):
    x = rng.normal(size=(3, 4, 5))
    with npnorm.use_kernels(family):
        np.testing.assert_allclose(F.group_norm(x, 4), _standardized(x, (2,)), atol=1e-12)
        np.testing.assert_allclose(F.instance_norm(x), _standardized(x, (2,)), atol=1e-12)


def test_state_dict_keys(torch):
    for affine in (True, False):
        assert list(npnorm.GroupNorm(2, 4, affine=affine).state_dict()) == list(
            torch.nn.GroupNorm(2, 4, affine=affine).state_dict()
        )


def test_indivisible_channels_raise_at_construction():
    with pytest.raises(ValueError, match="divisible"):
        npnorm.GroupNorm(3, 4)


@pytest.mark.parametrize("shape,match", [((2, 6, 3), "expected 4 channels"), ((4,), "at least 2 dims")])
def test_bad_input_raises_and_changes_nothing(rng, shape, match):
    m = npnorm.GroupNorm(2, 4)
    randomize(m, rng)
    m(rng.normal(size=(2, 4, 3)).astype(np.float32))
    state, grads = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m(np.ones(shape, np.float32))
    assert_state_equal(m, state, grads)


def test_float16(rng):
    x = (rng.normal(size=(2, 4, 3)) * 3).astype(np.float16)
    y, mean, _rstd = F.group_norm_forward(x, 2)
    assert y.dtype == np.float16 and mean.dtype == np.float32 and mean.shape == (2, 2)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_groups_without_values_as_in_torch(torch, family):
    """Groups of no values (spatial size 0): an empty output as PyTorch's, statistics of
    nothing (NaN), PyTorch's weight gradient (NaN: it sums (ds - db*mean)*rstd with those
    statistics) and bias gradient (0), and no NumPy "Mean of empty slice" warning (which
    escaped from every family)."""
    ref = torch.nn.GroupNorm(2, 4).double()
    xt = torch.zeros((2, 4, 0), dtype=torch.float64, requires_grad=True)
    ref(xt).sum().backward()
    ours = npnorm.GroupNorm(2, 4, dtype="float64")
    with npnorm.use_kernels(family):
        y = ours(np.zeros((2, 4, 0)))
        dx = ours.backward(np.zeros((2, 4, 0)))
        _, mean, rstd = F.group_norm_forward(np.zeros((2, 4, 0)), 2)
    assert y.shape == dx.shape == (2, 4, 0)
    assert mean.shape == rstd.shape == (2, 2) and np.isnan(mean).all() and np.isnan(rstd).all()
    np.testing.assert_array_equal(ours.grads["weight"], ref.weight.grad.numpy())
    np.testing.assert_array_equal(ours.grads["bias"], ref.bias.grad.numpy())


@pytest.mark.parametrize("shape,groups", [((1, 4), 4), ((1, 4, 1), 4), ((1, 2), 2), ((1, 3, 1, 1), 3)])
def test_one_value_in_all_raises_as_in_torch(torch, shape, groups):
    # PyTorch checks N*C/G times the spatial size (its (N*C/G, G, *) view) like BatchNorm's
    # batch: 1 raises; npnorm returned zeros (the bias)
    x = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match="more than 1 value per channel") as theirs:
        torch.nn.functional.group_norm(torch.tensor(x), groups)
    with pytest.raises(ValueError, match="more than 1 value per channel") as ours:
        F.group_norm(x, groups)
    assert str(ours.value) == str(theirs.value)
    m = npnorm.GroupNorm(groups, shape[1])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m(x)
    assert m.grads == {}


@pytest.mark.parametrize("shape,groups", [((2, 4), 4), ((1, 4, 2), 4), ((1, 8), 4)])
def test_one_value_per_group_but_more_in_all_runs_as_in_torch(torch, shape, groups):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    ref = torch.nn.functional.group_norm(torch.tensor(x), groups).numpy()
    np.testing.assert_allclose(F.group_norm(x, groups), ref, rtol=0, atol=1e-6)


def test_without_weight_and_bias_any_divisible_channel_count_runs_as_in_torch(torch, rng):
    x = rng.normal(size=(3, 6, 5)).astype(np.float32)
    ref = torch.nn.GroupNorm(2, 4, affine=False)(torch.tensor(x)).numpy()
    m = npnorm.GroupNorm(2, 4, affine=False)
    np.testing.assert_allclose(m(x), ref, rtol=0, atol=1e-6)
    assert m.backward(np.ones_like(x)).shape == x.shape
    with pytest.raises(ValueError, match="divisible"):
        m(np.ones((3, 5, 5), np.float32))
    with pytest.raises(ValueError, match="expected 4 channels"):  # with weight: as PyTorch, an error
        npnorm.GroupNorm(2, 4)(x)


def test_the_input_is_checked_against_weight_and_bias_not_num_channels(torch, rng):
    # a GroupNorm grown to 6 channels by replacing weight and bias runs on 6, as in torch
    x = rng.normal(size=(4, 6, 2)).astype(np.float32)
    w, b = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
    ours, theirs = npnorm.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)
    ours.weight, ours.bias = w, b
    theirs.weight, theirs.bias = torch.nn.Parameter(torch.tensor(w)), torch.nn.Parameter(torch.tensor(b))
    np.testing.assert_allclose(ours(x), theirs(torch.tensor(x)).detach().numpy(), rtol=0, atol=1e-5)
    m = npnorm.GroupNorm(2, 4)
    m.num_channels = 6  # num_channels alone: still weight's 4, as in torch
    assert m(x[:, :4]).shape == (4, 4, 2)
    with pytest.raises(ValueError, match="expected 4 channels"):
        m(x)
    m.weight = None  # bias alone sets the count
    with pytest.raises(ValueError, match="expected 4 channels"):
        m(x)


def test_a_non_contiguous_torch_input_changed_after_the_forward_is_kept_as_torch_keeps_it(torch):
    """torch's group_norm keeps a contiguous copy of a non-contiguous input: a change to the
    input after the forward does not reach the backward (npnorm raised where it kept the
    input itself)."""
    x0 = torch.randn(3, 4, 10, dtype=torch.float64)
    x = x0[:, :, ::2]
    ours = npnorm.GroupNorm(2, 4, xp="torch", dtype="float64")
    ref = torch.nn.GroupNorm(2, 4, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    y = ours(x)
    x.add_(1)
    g = torch.randn(y.shape, dtype=torch.float64)
    dx = ours.backward(g)
    ref(xr).backward(g)
    torch.testing.assert_close(dx, xr.grad)


def test_backward_checks_the_saved_statistics(backend, rng):
    """A mean or rstd not of the forward's (N, num_groups) shape is refused, saying which."""
    x = backend.asarray(rng.normal(size=(3, 4, 5)))
    _, mean, rstd = F.group_norm_forward(x, 2)
    dy = backend.asarray(rng.normal(size=(3, 4, 5)))
    with pytest.raises(ValueError, match=r"^mean must have shape \(3, 2\), got \(3, 1\)"):
        F.group_norm_backward(dy, x, 2, mean[:, :1], rstd)
    with pytest.raises(ValueError, match=r"^rstd must have shape \(3, 2\), got \(2, 2\)"):
        F.group_norm_backward(dy, x, 2, mean, rstd[:2, ...])
