"""BatchNorm1d/2d/3d: parity with torch.nn over training steps then eval, running-stat
rules pinned one by one, gradcheck in train and eval, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import draw_state, load_into_torch, randomize, train_then_eval
from hypothesis import given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F

SPATIAL = {"BatchNorm1d": [(), (3,)], "BatchNorm2d": [(3, 2)], "BatchNorm3d": [(2, 2, 3)]}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(SPATIAL))
@given(
    data=st.data(),
    n=st.integers(2, 4),
    c=st.integers(1, 4),
    momentum=st.sampled_from([0.1, 0.5, None]),
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
    shape = (n, c, *spatial)
    train_then_eval(torch, backend, ours, ref, data, shape, steps, dtype)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("track", [True, False])
def test_gradcheck_train_and_eval(backend, rng, training, track):
    m = npnorm.BatchNorm2d(3, track_running_stats=track, xp=backend.xp)
    randomize(m, rng)
    m.train(training)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(2, 3, 2, 2))))


@pytest.mark.parametrize("cls,shape", [(npnorm.BatchNorm1d, (4, 3)), (npnorm.BatchNorm3d, (2, 3, 2, 1, 2))])
def test_gradcheck_1d_3d(backend, rng, cls, shape):
    m = cls(3, xp=backend.xp)
    randomize(m, rng)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=shape)))


# --- the running-statistics rules, each pinned -------------------------------


def test_running_var_takes_the_unbiased_batch_variance(rng):
    m = npnorm.BatchNorm1d(2, momentum=1.0, dtype="float64")
    x = rng.normal(size=(5, 2))
    y = m(x)
    np.testing.assert_allclose(m.running_var, x.var(axis=0, ddof=1), rtol=1e-12)  # n/(n-1)
    np.testing.assert_allclose(m.running_mean, x.mean(axis=0), rtol=1e-12)
    # ... while the output is normalized with the biased one
    np.testing.assert_allclose(y, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-12)


def test_momentum_update_rule(rng):
    m = npnorm.BatchNorm1d(2, momentum=0.3, dtype="float64")
    x = rng.normal(size=(6, 2, 3))
    m(x)
    batch_var = x.transpose(1, 0, 2).reshape(2, -1).var(axis=1, ddof=1)
    np.testing.assert_allclose(m.running_var, 0.7 * 1.0 + 0.3 * batch_var, rtol=1e-12)
    np.testing.assert_allclose(m.running_mean, 0.3 * x.mean(axis=(0, 2)), rtol=1e-12)


def test_momentum_none_is_a_cumulative_average(rng):
    m = npnorm.BatchNorm1d(3, momentum=None, dtype="float64")
    xs = [rng.normal(size=(4, 3)) + i for i in range(4)]
    for x in xs:
        m(x)
    np.testing.assert_allclose(m.running_mean, np.mean([x.mean(0) for x in xs], axis=0), rtol=1e-12)
    np.testing.assert_allclose(m.running_var, np.mean([x.var(0, ddof=1) for x in xs], axis=0), rtol=1e-12)
    assert int(m.num_batches_tracked) == 4


def test_num_batches_tracked_only_counts_training_with_running_stats(rng):
    m = npnorm.BatchNorm1d(2)
    x = rng.normal(size=(3, 2)).astype(np.float32)
    m(x)
    m(x)
    m.eval()
    m(x)
    assert int(m.num_batches_tracked) == 2
    assert m.num_batches_tracked.dtype == np.int64 and m.num_batches_tracked.shape == ()


def test_track_running_stats_turned_off_after_construction_as_in_torch(torch, rng):
    """The flag as set, not as constructed, as torch's _BatchNorm reads it: training neither
    counts nor updates the buffers it keeps; eval still normalizes with them (they exist).
    (A mutation that counted, or one that used batch statistics in eval, passed the suite.)"""
    x = rng.normal(size=(6, 3)) * 2 + 1
    ours = npnorm.BatchNorm1d(3, dtype="float64")
    theirs = torch.nn.BatchNorm1d(3, dtype=torch.float64)
    ours.running_mean[...] = [0.5, -1.0, 2.0]
    ours.running_var[...] = [2.0, 0.5, 3.0]
    with torch.no_grad():
        theirs.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        theirs.running_var.copy_(torch.tensor([2.0, 0.5, 3.0]))
    ours.track_running_stats = theirs.track_running_stats = False
    y = ours(x)
    np.testing.assert_allclose(y, theirs(torch.tensor(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 0
    np.testing.assert_array_equal(ours.running_mean, [0.5, -1.0, 2.0])  # not updated
    ours.eval()
    theirs.eval()
    y = ours(x)
    np.testing.assert_allclose(y, theirs(torch.tensor(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        y, (x - [0.5, -1.0, 2.0]) / np.sqrt(np.array([2.0, 0.5, 3.0]) + 1e-5), rtol=1e-12
    )


def test_without_running_stats_batch_statistics_in_eval_too(rng):
    m = npnorm.BatchNorm1d(2, track_running_stats=False, dtype="float64").eval()
    assert m.running_mean is None and m.running_var is None and m.num_batches_tracked is None
    assert list(m.state_dict()) == ["weight", "bias"]
    x = rng.normal(size=(5, 2)) * 3 + 2
    np.testing.assert_allclose(m(x), (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-12)


def test_eval_backward_is_the_affine_maps_backward(rng):
    m = npnorm.BatchNorm1d(2, dtype="float64")
    m.load_state_dict(
        {"weight": [2.0, 3.0], "bias": [0.0, 1.0], "running_mean": [1.0, -1.0],
         "running_var": [4.0, 0.25], "num_batches_tracked": 7}
    )  # fmt: skip
    m.eval()
    x, dy = rng.normal(size=(4, 2)), rng.normal(size=(4, 2))
    m(x)
    dx = m.backward(dy)
    np.testing.assert_allclose(dx, dy * np.array([2.0, 3.0]) / np.sqrt(np.array([4.0, 0.25]) + 1e-5))


def test_state_dict_keys_are_torchs(torch):
    for kw in (
        {},
        {"affine": False},
        {"track_running_stats": False},
        {"affine": False, "track_running_stats": False},
    ):
        assert list(npnorm.BatchNorm2d(3, **kw).state_dict()) == list(
            torch.nn.BatchNorm2d(3, **kw).state_dict()
        )


def test_trained_torch_checkpoint_loads_and_gives_torchs_eval_output(torch, backend, rng):
    ref = torch.nn.BatchNorm2d(4)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2)
        ref.bias.normal_()
    for _ in range(5):
        ref(torch.randn(8, 4, 5, 5) * 3 + 1)
    ref.eval()
    ours = npnorm.BatchNorm2d(4, xp=backend.xp)
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    assert int(ours.num_batches_tracked) == 5
    x = rng.normal(size=(2, 4, 5, 5)).astype(np.float32)
    expect = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(
        backend.numpy(ours(backend.asarray(x, "float32"))), expect, rtol=1e-5, atol=1e-5
    )


def test_float16_stats_in_float32_output_float16(rng):
    m = npnorm.BatchNorm2d(3)
    x = (rng.normal(size=(4, 3, 2, 2)) * 2).astype(np.float16)
    y = m(x)
    assert y.dtype == np.float16 and m.running_mean.dtype == np.float32
    ref = npnorm.BatchNorm2d(3)
    np.testing.assert_array_equal(y, ref(x.astype(np.float32)).astype(np.float16))
    np.testing.assert_array_equal(m.running_var, ref.running_var)
    assert m.backward(np.ones_like(x)).dtype == np.float16


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("momentum", [0.1, None])
def test_float16_running_stats_equal_torchs_bit_for_bit(torch, rng, family, momentum):
    """Running statistics kept in float16 (a float16 module) move as torch's: the update
    is computed in float32 and rounded to float16 once per step, so they stay equal bit
    for bit over many steps. (An update computed in float16 itself passed the suite; it
    differs from torch in most steps, by up to tens of ulps.)"""
    ours = npnorm.BatchNorm1d(4, momentum=momentum, dtype="float16")
    ref = torch.nn.BatchNorm1d(4, momentum=momentum, dtype=torch.float16)
    with npnorm.use_kernels(family):
        for step in range(40):
            x = (rng.normal(size=(8, 4)) * (1 + step % 3) + [0.0, 3.0, -20.0, 100.0]).astype(np.float16)
            ours(x)
            ref(torch.from_numpy(x))
    for name in ("running_mean", "running_var"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(ref, name).numpy(), err_msg=name)


def test_float32_large_mean_stays_accurate(rng):
    x = (rng.normal(size=(32, 8, 16, 16)) + 1e4).astype(np.float32)
    truth = npnorm.BatchNorm2d(8, dtype="float64")(x.astype(np.float64))
    np.testing.assert_allclose(npnorm.BatchNorm2d(8)(x), truth, atol=1e-2)


def test_functional_batch_norm_updates_buffers_in_place(backend, rng):
    rm, rv = backend.asarray(np.zeros(3)), backend.asarray(np.ones(3))
    x = rng.normal(size=(4, 3))
    F.batch_norm(backend.asarray(x), rm, rv, training=True, momentum=0.5)
    np.testing.assert_allclose(backend.numpy(rm), 0.5 * x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(backend.numpy(rv), 0.5 + 0.5 * x.var(0, ddof=1), rtol=1e-12)
    before = backend.numpy(rm).copy()
    F.batch_norm(backend.asarray(x), rm, rv, training=False)
    np.testing.assert_array_equal(backend.numpy(rm), before)


def test_forward_is_pure(rng):
    rm, rv = np.zeros(3), np.ones(3)
    _, mean, rstd, new_rm, _new_rv = F.batch_norm_forward(rng.normal(size=(4, 3)), rm, rv, training=True)
    assert (rm == 0).all() and (rv == 1).all() and new_rm is not rm
    assert mean.shape == rstd.shape == (3,)


# --- bad input: clear errors, nothing changed ---------------------------------


def _trained(backend, rng):
    m = npnorm.BatchNorm2d(3, xp=backend.xp)
    randomize(m, rng)
    m(backend.asarray(rng.normal(size=(2, 3, 2, 2)), "float32"))
    m.backward(backend.asarray(rng.normal(size=(2, 3, 2, 2)), "float32"))
    return m


@pytest.mark.parametrize(
    "shape,dtype,error,match",
    [
        ((1, 3, 1, 1), "float32", ValueError, "more than 1 value per channel"),  # torch's too
        ((2, 4, 2, 2), "float32", ValueError, "expected 3 channels"),  # (torch: RuntimeError)
        ((2, 3, 2), "float32", ValueError, "expected 4D input"),  # torch's too
        ((2, 3, 2, 2), "int64", TypeError, "floating"),
    ],
)
def test_bad_input_raises_and_changes_nothing(backend, rng, shape, dtype, error, match):
    m = _trained(backend, rng)
    state, grads = snapshot(m)
    x = backend.xp.asarray(np.ones(shape, dtype=dtype))
    with pytest.raises(error, match=match):
        m(x)
    assert_state_equal(m, state, grads)
    assert int(m.num_batches_tracked) == int(state["num_batches_tracked"])


def test_one_value_per_channel_leaves_counter_untouched_unlike_torch(torch):
    """PyTorch increments num_batches_tracked before raising; npnorm changes nothing."""
    ours, ref = npnorm.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ours(np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ref(torch.ones(1, 2))
    assert int(ours.num_batches_tracked) == 0
    assert int(ref.num_batches_tracked) == 1


def test_one_value_per_channel_is_fine_in_eval():
    m = npnorm.BatchNorm1d(2).eval()
    assert m(np.ones((1, 2), np.float32)).shape == (1, 2)


def test_backend_mismatch(rng):
    import array_api_strict as aas

    m = npnorm.BatchNorm1d(2)
    with pytest.raises(TypeError, match="different array backends"):
        m(aas.asarray(rng.normal(size=(3, 2))))
    assert int(m.num_batches_tracked) == 0


def test_load_state_dict_atomic_on_bad_shape(rng):
    m = npnorm.BatchNorm1d(2)
    state, grads = snapshot(m)
    bad = {**{k: np.asarray(v) for k, v in state.items()}, "running_var": np.ones(3)}
    bad["weight"] = np.full(2, 9.0)
    with pytest.raises(RuntimeError, match="running_var"):
        m.load_state_dict(bad)
    assert_state_equal(m, state, grads)


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_features must be a positive int, got 0"):
        npnorm.BatchNorm1d(0)
    with pytest.raises(TypeError, match=r"momentum \(or None\) must be a number, got 'fast'"):
        npnorm.BatchNorm1d(3, momentum="fast")


def test_eval_statistics_do_not_alias_the_buffers(backend, rng):
    rm, rv = backend.asarray(np.zeros(2)), backend.asarray(np.ones(2))
    _, mean, _, _, _ = F.batch_norm_forward(backend.asarray(rng.normal(size=(3, 2))), rm, rv)
    rm[...] = backend.asarray(np.full(2, 5.0))
    np.testing.assert_array_equal(backend.numpy(mean), 0.0)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_eval_statistics_do_not_alias_the_buffers_in_any_family(family, rng):
    """As above in every kernel family (the "numpy" family returning a view of
    running_mean passed the suite, which ran the default family only)."""
    rm, rv = np.zeros(2), np.ones(2)
    with npnorm.use_kernels(family):
        _, mean, rstd, _, _ = F.batch_norm_forward(rng.normal(size=(3, 2, 4)), rm, rv)
    rm[...], rv[...] = 5.0, 7.0
    np.testing.assert_array_equal(mean, 0.0)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(1 + 1e-5), rtol=1e-15)


def test_momentum_none_without_a_counter_leaves_the_running_stats_as_in_torch(torch, rng):
    """momentum=None with num_batches_tracked set to None: torch's factor stays 0, so
    training normalizes with the batch and leaves the running statistics where they are
    (and the counter None). (A mutation that took a factor of 1 passed the suite.)"""
    ours = npnorm.BatchNorm1d(3, momentum=None, dtype="float64")
    ref = torch.nn.BatchNorm1d(3, momentum=None, dtype=torch.float64)
    for m in (ours, ref):
        m.num_batches_tracked = None
    ours.running_mean[...] = [0.5, -1.0, 2.0]
    with torch.no_grad():
        ref.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
    for _ in range(2):
        x = rng.normal(size=(6, 3)) * 2 + 1
        y = ours(x)
        np.testing.assert_allclose(y, ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ref.running_mean.numpy(), [0.5, -1.0, 2.0])
    np.testing.assert_array_equal(ours.running_mean, [0.5, -1.0, 2.0])
    np.testing.assert_array_equal(ours.running_var, ref.running_var.numpy())
    np.testing.assert_array_equal(ours.running_var, 1.0)
    assert ours.num_batches_tracked is None and ref.num_batches_tracked is None


def test_float64_running_var_widens_the_computation(rng):
    x = rng.normal(size=(4, 2)).astype(np.float32)
    rm, rv = np.zeros(2, np.float32), np.ones(2, np.float64)
    _, mean, rstd, _, new_rv = F.batch_norm_forward(x, rm, rv, training=True)
    assert mean.dtype == rstd.dtype == np.float64 and new_rv.dtype == np.float64


def test_reset_running_stats(rng):
    m = npnorm.BatchNorm1d(2)
    m(rng.normal(size=(4, 2)).astype(np.float32))
    m.reset_running_stats()
    np.testing.assert_array_equal(m.running_mean, 0)
    np.testing.assert_array_equal(m.running_var, 1)
    assert int(m.num_batches_tracked) == 0


def test_reset_running_stats_is_in_place_as_in_torch(backend, rng):
    # PyTorch zeroes and fills its buffers in place: an earlier state_dict(), and a
    # SyncBatchNorm converted from the module (which shares them), see the reset
    m = npnorm.BatchNorm1d(2, xp=backend.xp)
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(m)
    m(backend.asarray(rng.normal(size=(4, 2)), "float32"))
    state = m.state_dict()
    sync.reset_running_stats()
    for held in (state, m.state_dict()):
        np.testing.assert_array_equal(backend.numpy(held["running_mean"]), 0)
        np.testing.assert_array_equal(backend.numpy(held["running_var"]), 1)
        assert int(held["num_batches_tracked"]) == 0
    assert sync.running_mean is m.running_mean and sync.num_batches_tracked is m.num_batches_tracked


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("shape", [(0, 3), (0, 3, 4), (2, 3, 0)])
def test_an_empty_batch_trains_as_in_torch(torch, family, shape):
    """No values per channel in training: PyTorch returns an empty output, counts the
    batch and leaves the running statistics as they were; its weight and bias gradients are
    zeros. npnorm did the same nowhere (it raised "more than 1 value per channel")."""
    ref = torch.nn.BatchNorm1d(3).double()
    ours = npnorm.BatchNorm1d(3, dtype="float64")
    randomize(ours, np.random.default_rng(0))
    load_into_torch(torch, ours, ref)
    x = np.zeros(shape)
    xt = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    with npnorm.use_kernels(family):
        y = ours(x)
        dx = ours.backward(np.zeros(shape))
    yt = ref(xt)
    yt.sum().backward()
    assert y.shape == dx.shape == tuple(yt.shape) == shape
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy(), err_msg=k)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) > 0
    np.testing.assert_array_equal(ours.grads["weight"], ref.weight.grad.numpy())
    np.testing.assert_array_equal(ours.grads["bias"], ref.bias.grad.numpy())
    y, mean, rstd, rm, _ = F.batch_norm_forward(x, None, None, training=True)
    assert y.shape == shape and np.isnan(mean).all() and np.isnan(rstd).all() and rm is None
    half = npnorm.BatchNorm1d(3, dtype="float16")  # grads in the parameters' dtype, as torch's
    with npnorm.use_kernels(family):
        half(x.astype(np.float16))
        half.backward(np.zeros(shape, np.float16))
    assert half.grads["weight"].dtype == half.grads["bias"].dtype == np.float16


@pytest.mark.parametrize("name", ["BatchNorm1d", "BatchNorm2d", "SyncBatchNorm"])
@pytest.mark.parametrize("training", [True, False])
def test_an_empty_batch_of_the_wrong_channel_count_is_refused_unlike_torch(torch, name, training):
    """PyTorch's BatchNorm returns an empty input before it checks the channel count (and
    counts the batch); npnorm refuses it as it refuses a full batch of that shape, and
    changes nothing. The README lists this among the differences."""
    shape = (0, 4) if name == "BatchNorm1d" else (2, 4, 0, 2)
    ref = getattr(torch.nn, name)(3).train(training)
    assert tuple(ref(torch.zeros(shape)).shape) == shape  # torch takes it
    ours = getattr(npnorm, name)(3).train(training)
    state, grads = snapshot(ours)
    with pytest.raises(ValueError, match=r"expected 3 channels at dim 1, got input of shape"):
        ours(np.zeros(shape, np.float32))
    assert_state_equal(ours, state, grads)


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("numpy read-only", ValueError, "running_var cannot be written in place"),
        ("torch expand", ValueError, "running_var cannot be written in place"),
        ("torch leaf that requires grad", RuntimeError, "requires grad"),
        ("a write that fails", OSError, "the write of running_var failed"),
    ],
)
@pytest.mark.parametrize("fn", ["batch_norm", "instance_norm"])
def test_a_refused_running_var_write_leaves_running_mean_as_it_was(
    rng, torch, monkeypatch, fn, kind, error, match
):
    # running_var is written second: a refusal there left running_mean updated; PyTorch
    # leaves both as they were. The first three are refused before any write; the last
    # fails in the write itself, after running_mean's, which is then put back
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    if kind == "numpy read-only":
        rv.flags.writeable = False
    elif kind.startswith("torch"):
        x, rm = torch.tensor(x), torch.zeros(3)
        rv = torch.ones(1).expand(3) if kind == "torch expand" else torch.ones(3, requires_grad=True)
    else:
        import npnorm.functional._channels as channels

        def failing(write):
            def second_fails(current, value):
                if current is rv:
                    raise OSError("the write of running_var failed")
                write(current, value)

            return second_fails

        monkeypatch.setattr(channels, "write_uncounted", failing(channels.write_uncounted))
        monkeypatch.setattr(channels, "_write_counted", failing(channels._write_counted))
    call = F.batch_norm if fn == "batch_norm" else F.instance_norm
    with pytest.raises(error, match=match):
        call(x, rm, rv, None, None, True, 0.1, 1e-5)
    assert np.asarray(rm).tolist() == [0.0, 0.0, 0.0]
    assert np.asarray(rv.detach() if kind.startswith("torch") else rv).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("flag", ["False", 1, 0, None, np.array(True)])
def test_a_training_flag_that_is_not_a_bool_is_a_type_error_as_in_torch(torch, flag):
    """A truthy "False" selected training and wrote the caller's buffers; torch's
    functions refuse anything but a bool (npnorm also takes NumPy's bool)."""
    x = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    mean, rstd = np.zeros(3, np.float32), np.ones(3, np.float32)
    t = torch.tensor(x)
    with pytest.raises(TypeError, match="must be bool"):
        torch.nn.functional.batch_norm(t, torch.zeros(3), torch.ones(3), training=flag)
    with pytest.raises(TypeError, match="must be bool"):
        torch.nn.functional.instance_norm(t, torch.zeros(3), torch.ones(3), use_input_stats=flag)
    calls = {
        "batch_norm: training": lambda: F.batch_norm(x, rm, rv, training=flag),
        "batch_norm_forward: training": lambda: F.batch_norm_forward(x, rm, rv, training=flag),
        "batch_norm_backward: training": lambda: F.batch_norm_backward(x, x, mean, rstd, training=flag),
        "instance_norm_forward: use_input_stats": lambda: F.instance_norm(x, rm, rv, use_input_stats=flag),
        "instance_norm_backward: use_input_stats": lambda: F.instance_norm_backward(
            x, x, mean, rstd, use_input_stats=flag
        ),
        "sync_batch_norm_forward: training": lambda: F.sync_batch_norm_forward(x, rm, rv, training=flag),
        "sync_batch_norm_backward: training": lambda: F.sync_batch_norm_backward(
            x, x, mean, rstd, training=flag
        ),
    }
    for what, call in calls.items():
        expected = rf"{what} must be a bool, got"
        if flag is None and what.endswith("backward: training"):  # the backwards require it
            expected = rf"{what.split(':')[0]}\(\) needs training="
        with pytest.raises(TypeError, match=expected):
            call()
    assert rm.tolist() == [0, 0, 0] and rv.tolist() == [1, 1, 1]
    y, *_ = F.batch_norm_forward(x, rm, rv, training=np.True_)  # NumPy's bool is a bool
    np.testing.assert_array_equal(y, F.batch_norm_forward(x, rm, rv, training=True)[0])


@pytest.mark.parametrize("flag", [1, 0])
@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d", "SyncBatchNorm"])
def test_a_training_attribute_set_to_an_int_acts_on_its_truth_as_in_torch(torch, name, flag):
    """The modules pass the functions a bool, whatever ``training`` holds (torch's
    BatchNorm reads it as a condition; its InstanceNorm passes it on, and torch's
    function refuses an int: npnorm's InstanceNorm reads it as a condition too)."""
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    ours = getattr(npnorm, name)(3, track_running_stats=True)
    theirs = getattr(torch.nn, "BatchNorm1d" if name == "SyncBatchNorm" else name)
    theirs = theirs(3, track_running_stats=True)
    ours.training = flag
    theirs.training = bool(flag) if name == "InstanceNorm1d" else flag
    y = ours(x)
    ours.backward(np.ones_like(y))
    np.testing.assert_allclose(y, theirs(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.running_mean, theirs.running_mean.numpy(), rtol=1e-6)


def test_eps_zero_is_refused_with_batch_statistics_as_in_torch(torch):
    x = np.random.default_rng(0).normal(size=(4, 2, 3)).astype(np.float32)
    for ours, theirs in [
        (lambda: F.batch_norm(x, None, None, training=True, eps=0.0),
         lambda: torch.nn.functional.batch_norm(torch.tensor(x), None, None, training=True, eps=0.0)),
        (lambda: npnorm.BatchNorm1d(2, eps=0.0)(x),
         lambda: torch.nn.BatchNorm1d(2, eps=0.0)(torch.tensor(x))),
        (lambda: npnorm.BatchNorm1d(2, eps=0.0, track_running_stats=False).eval()(x),
         lambda: torch.nn.BatchNorm1d(2, eps=0.0, track_running_stats=False).eval()(torch.tensor(x))),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match="eps must be positive during training"):
            theirs()
        with pytest.raises(ValueError, match="eps must be positive during training"):
            ours()
    m = npnorm.BatchNorm1d(2, eps=0.0)
    assert int(m.num_batches_tracked) == 0  # the refused forward counted nothing
    y = m.eval()(x)  # running statistics: eps = 0 is fine, as in PyTorch
    ref = torch.nn.BatchNorm1d(2, eps=0.0).eval()(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-6)
    # batch_norm_forward, the pure pair, computes with eps = 0 (as torch.batch_norm, the op)
    y, *_ = F.batch_norm_forward(x, None, None, training=True, eps=0.0)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(
    "kw,other_channels_run",
    [
        (dict(affine=False, track_running_stats=False), True),  # no per-channel array in use
        (dict(affine=False), False),  # running statistics of 3 channels
        (dict(track_running_stats=False), False),  # weight and bias of 3 channels
    ],
)
def test_other_channel_counts_run_where_torch_runs_them(torch, rng, mode, kw, other_channels_run):
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    ours, theirs = npnorm.BatchNorm1d(3, **kw), torch.nn.BatchNorm1d(3, **kw)
    getattr(ours, mode)()
    getattr(theirs, mode)()
    if other_channels_run:
        np.testing.assert_allclose(ours(x), theirs(torch.tensor(x)).detach().numpy(), rtol=0, atol=1e-6)
        assert ours.backward(np.ones_like(x)).shape == x.shape
    else:
        with pytest.raises(RuntimeError):
            theirs(torch.tensor(x))
        with pytest.raises(ValueError, match="expected 3 channels"):
            ours(x)


@pytest.mark.parametrize(
    "make", [lambda: npnorm.BatchNorm1d(3), lambda: npnorm.GroupNorm(1, 3), lambda: npnorm.SyncBatchNorm(3)]
)
def test_an_input_of_other_channels_than_a_replaced_weight_names_the_weight(make):
    """A weight replaced by one of 4 values, on input of 3 channels: the error blamed the
    input ("expected 4 channels") without saying that the 4 is the weight's length
    (PyTorch: "weight should contain 3 elements not 4")."""
    m = make()
    with pytest.raises(ValueError, match=r"expected 3 channels at dim 1, got input of shape \(4, 5, 5\)"):
        m(np.zeros((4, 5, 5), np.float32))  # (arrays of num_features values: the input is named alone)
    m.weight = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"expected 4 channels at dim 1 \(the length of its weight\), got"):
        m(np.zeros((4, 3, 5), np.float32))


@pytest.mark.parametrize(
    "make", [lambda: npnorm.BatchNorm1d(3), lambda: npnorm.GroupNorm(3, 3), lambda: npnorm.SyncBatchNorm(3)]
)
def test_one_sample_without_its_batch_axis_is_named_as_such(make):
    """(C, L) input to a layer that takes (N, C, *) (torch's GroupNorm and BatchNorm1d
    refuse it too): the error says how to add the batch axis if dim 0 holds the
    channels; an input whose dim 0 is not C gets no such hint."""
    with pytest.raises(ValueError) as info:
        make()(np.zeros((3, 5), np.float32))
    assert str(info.value).endswith(
        "expected 3 channels at dim 1, got input of shape (3, 5) "
        "(if it is one sample with its 3 channels at dim 0, add the batch axis: x[None])"
    )
    with pytest.raises(ValueError) as info:
        make()(np.zeros((4, 5), np.float32))
    assert str(info.value).endswith("got input of shape (4, 5)")


@pytest.mark.parametrize(
    "make, shape", [(lambda: npnorm.BatchNorm1d(3), (3, 5, 7)), (lambda: npnorm.BatchNorm2d(3), (3, 8, 4, 4))]
)
def test_no_batch_axis_hint_where_the_layer_would_refuse_the_axis_added(make, shape):
    """BatchNorm1d takes (N, C) or (N, C, L) and BatchNorm2d (N, C, H, W): with one more
    axis the input would be refused for its dims, so C at dim 0 gets no hint there."""
    with pytest.raises(ValueError) as info:
        make()(np.zeros(shape, np.float32))
    assert str(info.value).endswith(f"got input of shape {shape}")


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_counter_of_one_value_in_any_shape_averages_as_torchs(torch, rng, shape):
    """momentum=None with a num_batches_tracked of shape (1,) (set by hand): torch trains,
    its counter keeps its shape; npnorm raised NumPy's "only 0-dimensional arrays can be
    converted to Python scalars". A counter of two values is torch's ValueError, nothing
    changed."""
    x = rng.normal(size=(4, 3)).astype(np.float32)
    ours, theirs = npnorm.BatchNorm1d(3, momentum=None), torch.nn.BatchNorm1d(3, momentum=None)
    ours.num_batches_tracked = np.full(shape, 2)
    theirs.num_batches_tracked = torch.full(shape, 2)
    ours(x)
    theirs(torch.from_numpy(x))
    np.testing.assert_array_equal(ours.num_batches_tracked, theirs.num_batches_tracked.numpy())
    np.testing.assert_allclose(ours.running_mean, theirs.running_mean.numpy(), rtol=1e-6)
    ours.num_batches_tracked = np.array([2, 3])
    theirs.num_batches_tracked = torch.tensor([2, 3])
    with pytest.raises(ValueError):
        theirs(torch.from_numpy(x))
    before = {k: np.copy(v) for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"num_batches_tracked must hold one count .* got shape \(2,\)"):
        ours(x)
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_input_is_checked_against_the_arrays_lengths_not_num_features(torch, rng, mode):
    # model surgery: a layer grown to 5 channels by replacing its arrays runs on 5 channels,
    # and one whose num_features alone was changed still runs on its arrays' 3, as in torch
    x = rng.normal(size=(4, 5, 2)).astype(np.float32)
    ours, theirs = npnorm.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    for name in ("weight", "bias", "running_mean", "running_var"):
        value = rng.uniform(0.5, 1.5, size=5).astype(np.float32)
        setattr(ours, name, value)
        if name in ("weight", "bias"):
            setattr(theirs, name, torch.nn.Parameter(torch.tensor(value)))
        else:
            setattr(theirs, name, torch.tensor(value))
    getattr(ours, mode)()
    getattr(theirs, mode)()
    ref = theirs(torch.tensor(x))
    np.testing.assert_allclose(ours(x), ref.detach().numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours.running_var, theirs.running_var.numpy(), rtol=0, atol=1e-6)
    m = npnorm.BatchNorm1d(3)
    getattr(m, mode)()
    m.num_features = 5
    assert m(x[:, :3]).shape == (4, 3, 2)
    with pytest.raises(ValueError, match="expected 3 channels"):
        m(x)
    m.weight = np.ones(5, np.float32)  # arrays that disagree: the first sets C, the next is named
    with pytest.raises(ValueError, match=r"must have shape \(5,\) \(one value per channel\), got \(3,\)"):
        m(x)


@pytest.mark.parametrize("fn", ["batch_norm_backward", "sync_batch_norm_backward"])
def test_the_backward_needs_the_forwards_training_flag(rng, fn):
    # the forward's default is inference (training=False), the backward's was True: with both
    # defaults, an inference forward's dx came from the training formula, silently
    x = rng.normal(size=(4, 3, 2))
    _, mean, rstd, _, _ = F.batch_norm_forward(x, np.zeros(3), np.ones(3))
    backward = getattr(F, fn)
    with pytest.raises(TypeError, match=r"needs training=: the value the forward was called with"):
        backward(np.ones_like(x), x, mean, rstd)
    dx, _, _ = backward(np.ones_like(x), x, mean, rstd, training=False)
    np.testing.assert_allclose(dx, np.ones_like(x) * rstd.reshape(1, 3, 1))


@pytest.mark.parametrize("fn", ["batch_norm", "instance_norm"])
@pytest.mark.parametrize("given", ["running_mean", "running_var", "neither"])
def test_a_missing_running_buffer_without_batch_statistics_is_torchs_runtime_error(torch, fn, given):
    """BatchNorm in eval (and InstanceNorm with use_input_stats=False) without one running
    buffer or both: torch raises RuntimeError ("running_var must be defined in evaluation
    mode"), npnorm raised ValueError ("must be given together", "needs running_mean and
    running_var"); with batch statistics the two agree on ValueError for one buffer."""
    x = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    buffers = {"running_mean": np.zeros(3, np.float32), "running_var": np.ones(3, np.float32)}
    rm, rv = (buffers[k] if k == given else None for k in ("running_mean", "running_var"))
    flag = "training" if fn == "batch_norm" else "use_input_stats"
    t = [None if a is None else torch.from_numpy(a) for a in (rm, rv)]
    for batch_stats in (False, True):
        if batch_stats and given == "neither":
            continue  # (batch statistics without buffers: no error)
        try:
            getattr(torch.nn.functional, fn)(torch.from_numpy(x), *t, **{flag: batch_stats})
        except (RuntimeError, ValueError) as err:
            theirs = err
        with pytest.raises(type(theirs)) as ours:
            getattr(F, fn)(x, rm, rv, **{flag: batch_stats})
        if not batch_stats and fn == "batch_norm":  # the buffer torch names
            assert str(theirs).split()[0] in str(ours.value), (theirs, ours.value)
    if fn == "batch_norm":  # the module in eval, as torch.nn.BatchNorm1d's
        m = npnorm.BatchNorm1d(3).eval()
        ref = torch.nn.BatchNorm1d(3).eval()
        for name in ("running_mean", "running_var"):
            if name != given:
                setattr(m, name, None)
                setattr(ref, name, None)
        if given == "neither":  # (both None: batch statistics, as torch's)
            assert m(x).shape == x.shape and ref(torch.from_numpy(x)).shape == x.shape
            return
        with pytest.raises(RuntimeError, match="must be defined in evaluation mode"):
            ref(torch.from_numpy(x))
        with pytest.raises(RuntimeError, match="must be defined in evaluation mode"):
            m(x)


@pytest.mark.parametrize("shape", [(0, 3), (0, 3, 4), (2, 3, 0), (2, 0, 4)])
def test_an_empty_batch_in_inference_needs_no_running_buffers(torch, shape):
    """torch's batch_norm returns an empty batch's empty output in eval without running
    buffers (it returns before asking for them); npnorm raised "running_mean must be
    defined in evaluation mode" (for no channels, (2, 0, 4), until later). InstanceNorm
    with use_input_stats=False still raises, as torch's does."""
    x = np.zeros(shape, np.float32)
    c = shape[1]
    w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    theirs = torch.nn.functional.batch_norm(torch.from_numpy(x), None, None, training=False)
    for family in npnorm.kernels_available():
        with npnorm.use_kernels(family):
            y = F.batch_norm(x, None, None, w, b, training=False)
            assert y.shape == tuple(theirs.shape) == shape and y.dtype == np.float32
            _, mean, rstd, rm, rv = F.batch_norm_forward(x, None, None, w, b, training=False)
            assert mean.shape == rstd.shape == (c,) and rm is None and rv is None
            dx, dw, db = F.batch_norm_backward(x, x, mean, rstd, w, b, training=False)
            assert dx.shape == shape
            np.testing.assert_array_equal(dw, 0)
            np.testing.assert_array_equal(db, 0)
    with pytest.raises(RuntimeError, match="use_input_stats is false"):
        torch.nn.functional.instance_norm(torch.from_numpy(x), None, None, use_input_stats=False)
    with pytest.raises(RuntimeError, match="use_input_stats is false"):
        F.instance_norm(x, None, None, use_input_stats=False)
    if c == 0:  # with a weight and bias of 0 values torch raises IndexError (the README's exception)
        for call in (
            lambda f, *a: f.batch_norm(a[0], None, None, *a[1:], training=True),
            lambda f, *a: f.instance_norm(a[0], None, None, *a[1:]),
        ):
            with pytest.raises(IndexError):
                call(torch.nn.functional, *(torch.from_numpy(a) for a in (x, w, b)))
            assert call(F, x, w, b).shape == shape


def test_a_bool_momentum_is_refused():
    """momentum=True is not a number (it read as 1.0: every step replaced the running
    statistics)."""
    with pytest.raises(TypeError, match=r"momentum \(or None\) must be a number, got True"):
        npnorm.BatchNorm1d(4, momentum=True)
