"""InstanceNorm1d/2d/3d: parity with torch (quirks included), batched and unbatched."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import draw_state, load_into_torch, randomize, train_then_eval
from hypothesis import given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F

SPATIAL = {"InstanceNorm1d": [(3,), (5,)], "InstanceNorm2d": [(2, 3)], "InstanceNorm3d": [(2, 2, 2)]}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(SPATIAL))
@given(
    data=st.data(),
    n=st.integers(0, 3),  # 0 = unbatched input
    c=st.integers(1, 4),
    momentum=st.sampled_from([0.1, 0.7, None]),
    affine=st.booleans(),
    track=st.booleans(),
    steps=st.integers(1, 3),
)
def test_parity_over_training_steps_then_eval(
    torch, backend, dtype, name, data, n, c, momentum, affine, track, steps
):
    spatial = data.draw(st.sampled_from(SPATIAL[name]))
    ours = getattr(npnorm, name)(c, 1e-5, momentum, affine, track, dtype=dtype, xp=backend.xp)
    ref = getattr(torch.nn, name)(c, 1e-5, momentum, affine, track, dtype=getattr(torch, dtype))
    draw_state(data, ours)
    load_into_torch(torch, ours, ref)
    shape = ((n,) if n else ()) + (c, *spatial)
    train_then_eval(torch, backend, ours, ref, data, shape, steps, dtype)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine,track", [(True, True), (False, False), (True, False)])
def test_gradcheck(backend, rng, training, affine, track):
    m = npnorm.InstanceNorm2d(2, affine=affine, track_running_stats=track, xp=backend.xp)
    randomize(m, rng)
    m.train(training)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(2, 2, 2, 3))))


def test_gradcheck_unbatched(backend, rng):
    m = npnorm.InstanceNorm1d(3, affine=True, xp=backend.xp)
    randomize(m, rng)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(3, 4))))


def test_running_stats_are_the_batch_average_of_instance_stats(rng):
    m = npnorm.InstanceNorm1d(2, momentum=1.0, track_running_stats=True, dtype="float64")
    x = rng.normal(size=(3, 2, 5))
    m(x)
    np.testing.assert_allclose(m.running_mean, x.mean(axis=2).mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(m.running_var, x.var(axis=2, ddof=1).mean(axis=0), rtol=1e-12)


def test_torch_quirks_pinned(torch, rng):
    """num_batches_tracked is in the state_dict but never incremented; momentum=None
    leaves the running statistics where they are."""
    ours = npnorm.InstanceNorm1d(2, momentum=None, track_running_stats=True)
    ref = torch.nn.InstanceNorm1d(2, momentum=None, track_running_stats=True)
    x = rng.normal(size=(3, 2, 4)).astype(np.float32)
    ours(x)
    ref(torch.from_numpy(x))
    assert (
        list(ours.state_dict())
        == list(ref.state_dict())
        == ["running_mean", "running_var", "num_batches_tracked"]
    )
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 0
    np.testing.assert_array_equal(ours.running_mean, 0)
    np.testing.assert_array_equal(ref.running_mean.numpy(), 0)
    np.testing.assert_array_equal(ours.running_var, 1)
    np.testing.assert_array_equal(ref.running_var.numpy(), 1)


@pytest.mark.parametrize("training", [True, False])
def test_running_stats_cleared_after_construction_still_move_as_in_torch(torch, rng, training):
    """InstanceNorm built with running statistics whose flag was then cleared normalizes
    with each instance's statistics and still moves the buffers it holds, in training and
    in eval alike (torch's F.instance_norm updates whatever buffers it is given). (A
    mutation that left the buffers alone passed the suite: the conversion tests compare
    outputs only.)"""
    ours = npnorm.InstanceNorm1d(3, momentum=0.3, track_running_stats=True, dtype="float64")
    ref = torch.nn.InstanceNorm1d(3, momentum=0.3, track_running_stats=True, dtype=torch.float64)
    for m in (ours, ref):
        m.track_running_stats = False
        m.train(training)
    for _ in range(2):
        x = rng.normal(size=(4, 3, 5)) * 2 + 1
        y = ours(x)
        np.testing.assert_allclose(y, ref(torch.from_numpy(x)).numpy(), rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var"):
        want = getattr(ref, name).numpy()
        assert not np.array_equal(want, np.zeros(3) if name == "running_mean" else np.ones(3))
        np.testing.assert_allclose(getattr(ours, name), want, rtol=1e-12, err_msg=name)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 0


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_eval_statistics_do_not_alias_the_buffers_in_any_family(family, rng):
    """The mean returned in eval (the running mean, saved for the backward) is a copy in
    every kernel family: a later write to the buffer must not change it. (The "numpy"
    family returning a view passed the suite.)"""
    rm, rv = np.zeros(2), np.ones(2)
    with npnorm.use_kernels(family):
        _, mean, rstd, _, _ = F.instance_norm_forward(
            rng.normal(size=(3, 2, 4)), rm, rv, use_input_stats=False
        )
    rm[...], rv[...] = 5.0, 7.0
    np.testing.assert_array_equal(mean, 0.0)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(1 + 1e-5), rtol=1e-15)


def test_channel_mismatch_raises_where_torch_only_warns(torch):
    ours = npnorm.InstanceNorm1d(3)
    with pytest.warns(UserWarning):
        torch.nn.InstanceNorm1d(3)(torch.randn(4, 5))  # unbatched (C=4, L=5): torch warns, runs
    with pytest.raises(ValueError, match=r"dim=0 to match num_features \(3\), but got: 4"):
        ours(np.ones((4, 5), np.float32))


@pytest.mark.parametrize(
    "shape,match",
    [((2, 3, 1), "more than 1 spatial element"), ((2, 3), "dim=0"), ((2, 2, 3, 4), "expected 2D .* or 3D")],
)
def test_bad_input_raises_and_changes_nothing(rng, shape, match):
    m = npnorm.InstanceNorm1d(3, affine=True, track_running_stats=True)
    randomize(m, rng)
    m(rng.normal(size=(2, 3, 4)).astype(np.float32))
    state, grads = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m(np.ones(shape, np.float32))
    assert_state_equal(m, state, grads)


@pytest.mark.parametrize("module_xp", ["numpy", "array_api_strict"])
@pytest.mark.parametrize("batched", [False, True])
def test_a_module_without_arrays_runs_any_backends_input(backend, module_xp, batched, rng):
    """README: a module that holds no arrays takes any backend's input and returns that
    backend's arrays, backward included (the unbatched backward added the batch axis with
    the module's namespace: a torch input into a NumPy module raised TypeError there)."""
    pytest.importorskip(module_xp)
    x64 = rng.normal(size=(1, 3, 5) if batched else (3, 5))
    g64 = rng.normal(size=x64.shape)
    m = npnorm.InstanceNorm1d(3, xp=module_xp)
    y = m(backend.asarray(x64))
    dx = m.backward(backend.asarray(g64))
    assert type(y) is type(dx) is type(backend.asarray(x64))
    ref = npnorm.InstanceNorm1d(3)
    np.testing.assert_allclose(backend.numpy(y), ref(x64), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.numpy(dx), ref.backward(g64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batched", [False, True])
def test_a_gradient_from_another_backend_is_refused_batched_or_not(rng, batched):
    """grad_output is checked unbatched as batched: another backend's array or a list is a
    TypeError, and the grads are unchanged (unbatched, a list raised AttributeError and an
    array_api_strict gradient was converted to NumPy)."""
    strict = pytest.importorskip("array_api_strict")
    shape = (1, 3, 5) if batched else (3, 5)
    m = npnorm.InstanceNorm1d(3, affine=True)
    m(rng.normal(size=shape))
    m.backward(rng.normal(size=shape))
    state, grads = snapshot(m)
    for bad, match in [
        (strict.ones(shape, dtype=strict.float64), "different array backends"),
        (np.ones(shape).tolist(), "expected an array"),
    ]:
        with pytest.raises(TypeError, match=match):
            m.backward(bad)
        assert_state_equal(m, state, grads)


def test_one_spatial_element_fine_in_eval_with_running_stats():
    m = npnorm.InstanceNorm1d(3, track_running_stats=True).eval()
    assert m(np.ones((2, 3, 1), np.float32)).shape == (2, 3, 1)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_no_spatial_axis_in_eval_with_running_stats_as_torch(torch, family, rng):
    """F.instance_norm on (N, C) input with the running statistics: torch normalizes it
    (npnorm refused anything under 3 dims); with input statistics both refuse it."""
    x, dy = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    rm, rv, w, b = rng.normal(size=5), rng.uniform(0.5, 2, 5), rng.normal(size=5), rng.normal(size=5)
    tx = torch.tensor(x, requires_grad=True)
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    ref = torch.nn.functional.instance_norm(
        tx, torch.tensor(rm), torch.tensor(rv), tw, tb, use_input_stats=False
    )
    ref.backward(torch.tensor(dy))
    with npnorm.use_kernels(family):
        y, mean, rstd, _, _ = F.instance_norm_forward(x, rm, rv, w, b, False)
        dx, dw, db = F.instance_norm_backward(dy, x, mean, rstd, w, b, False)
        np.testing.assert_allclose(F.instance_norm(x, rm, rv, w, b, use_input_stats=False), ref.detach())
        with pytest.raises(ValueError, match="Expected more than 1 spatial element when training"):
            F.instance_norm(x, rm, rv, use_input_stats=True)
    np.testing.assert_allclose(y, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    for ours, theirs in ((dx, tx), (dw, tw), (db, tb)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_empty_batch_with_running_stats_as_torch(family):
    """An empty batch in training with running statistics: an empty output, and the
    buffers become NaN (the average of no instances), as in PyTorch; no NumPy warning
    (one escaped from a mean over no instances)."""
    m = npnorm.InstanceNorm1d(3, affine=True, track_running_stats=True)
    with npnorm.use_kernels(family):
        y = m(np.zeros((0, 3, 4), np.float32))
        dx = m.backward(np.zeros((0, 3, 4), np.float32))
    assert y.shape == dx.shape == (0, 3, 4)
    assert np.isnan(m.running_mean).all() and np.isnan(m.running_var).all()
    assert int(m.num_batches_tracked) == 0
    np.testing.assert_array_equal(m.grads["weight"], 0)


def test_affine_with_no_instances_returns_empty_where_torch_raises(torch):
    """The README's one exception to "an empty batch as in PyTorch": torch 2.13's affine
    InstanceNorm fails inside its kernel on N = 0; npnorm returns the empty output."""
    with pytest.raises(IndexError):
        torch.nn.InstanceNorm1d(3, affine=True)(torch.zeros((0, 3, 4)))
    assert npnorm.InstanceNorm1d(3, affine=True)(np.zeros((0, 3, 4), np.float32)).shape == (0, 3, 4)


def test_empty_batch_running_stats_match_torch(torch):
    ref = torch.nn.InstanceNorm1d(3, track_running_stats=True)
    ref(torch.zeros((0, 3, 4)))
    ours = npnorm.InstanceNorm1d(3, track_running_stats=True)
    ours(np.zeros((0, 3, 4), np.float32))
    np.testing.assert_array_equal(ours.running_mean, ref.running_mean.numpy())
    np.testing.assert_array_equal(ours.running_var, ref.running_var.numpy())


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_no_spatial_values_train_as_in_torch(torch, family):
    """Instances with no spatial values (N > 0, S = 0): PyTorch returns an empty output and
    leaves the running statistics as they were (npnorm raised "more than 1 spatial
    element"); no NumPy warning."""
    ref = torch.nn.InstanceNorm1d(3, affine=True, track_running_stats=True).double()
    ours = npnorm.InstanceNorm1d(3, affine=True, track_running_stats=True, dtype="float64")
    randomize(ours, np.random.default_rng(0))
    load_into_torch(torch, ours, ref)
    xt = torch.zeros((2, 3, 0), dtype=torch.float64, requires_grad=True)
    ref(xt).sum().backward()
    with npnorm.use_kernels(family):
        y = ours(np.zeros((2, 3, 0)))
        dx = ours.backward(np.zeros((2, 3, 0)))
        _, _, _, rm, _ = F.instance_norm_forward(np.zeros((0, 3, 0)), np.zeros(3), np.ones(3))
    assert np.isnan(rm).all()  # no instances: NaN, as for (0, 3, 4), without NumPy's warning
    assert y.shape == dx.shape == (2, 3, 0)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy(), err_msg=k)
    np.testing.assert_array_equal(ours.grads["weight"], ref.weight.grad.numpy())
    np.testing.assert_array_equal(ours.grads["bias"], ref.bias.grad.numpy())


def test_a_constant_instance_with_eps_zero_gives_the_bias_as_in_torch(torch, rng):
    # PyTorch's inverse standard deviation is 0 where var + eps is 0: output the bias, dx 0
    x = rng.normal(size=(2, 3, 5)).astype(np.float32)
    x[:, 0], x[1, 2] = 0.3, -7.0
    w, b = np.array([2.0, 3.0, 4.0], np.float32), np.array([0.5, 0.6, 0.7], np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    ref = torch.nn.InstanceNorm1d(3, eps=0.0, affine=True)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
        ref.bias.copy_(torch.tensor(b))
    xt = torch.tensor(x, requires_grad=True)
    yt = ref(xt)
    yt.backward(torch.tensor(dy))
    for family in npnorm.kernels_available():
        with npnorm.use_kernels(family):
            m = npnorm.InstanceNorm1d(3, eps=0.0, affine=True)
            m.weight[...], m.bias[...] = w, b
            y = m(x)
            dx = m.backward(dy)
            np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=2e-6, err_msg=family)
            np.testing.assert_array_equal(y[:, 0], 0.5)
            np.testing.assert_array_equal(dx[:, 0], 0.0)
            np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=2e-6, err_msg=family)
            y2 = F.instance_norm(x, None, None, None, None, eps=0.0)  # no bias: 0
            np.testing.assert_array_equal(y2[:, 0], 0.0)


@pytest.mark.parametrize("use_input_stats", [True, False])
def test_backward_checks_the_saved_statistics(backend, rng, use_input_stats):
    """mean and rstd must be of the forward's shape: (N, C) from the input's statistics,
    (C,) from the running ones."""
    x = backend.asarray(rng.normal(size=(3, 4, 5)))
    rm, rv = backend.asarray(np.zeros(4)), backend.asarray(np.ones(4))
    _, mean, rstd, _, _ = F.instance_norm_forward(x, rm, rv, use_input_stats=use_input_stats)
    want = "(3, 4)" if use_input_stats else "(4,)"
    dy = backend.asarray(rng.normal(size=(3, 4, 5)))
    with pytest.raises(ValueError, match=rf"^mean must have shape {re.escape(want)}, got \(2, 4\)"):
        F.instance_norm_backward(
            dy, x, backend.asarray(np.zeros((2, 4))), rstd, use_input_stats=use_input_stats
        )
    with pytest.raises(ValueError, match=rf"^rstd must have shape {re.escape(want)}, got \(4, 3\)"):
        F.instance_norm_backward(
            dy, x, mean, backend.asarray(np.ones((4, 3))), use_input_stats=use_input_stats
        )


def test_an_unbatched_backward_checks_grad_outputs_shape(rng):
    m = npnorm.InstanceNorm1d(4, affine=True)
    m(rng.normal(size=(4, 5)))  # unbatched (C, L)
    with pytest.raises(ValueError, match=r"^grad_output must have the shape of the forward's input \(4, 5\)"):
        m.backward(rng.normal(size=(1, 4, 5)))
    assert not m.grads
    assert m.backward(rng.normal(size=(4, 5))).shape == (4, 5)
