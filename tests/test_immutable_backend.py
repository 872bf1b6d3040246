"""An Array API library whose arrays are immutable (JAX): the modules write a new array
where they would write in place (running statistics, accumulated grads, loads, resets),
gradcheck perturbs copies, and what cannot be done without a write (a torch-style call
that updates the caller's running statistics, ``out=``) is refused before any work.

JAX comes with the ``test`` extra; float64 needs its x64 mode, which the fixture turns
on for a test and off again."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import module_as_on_numpy

import npnorm
import npnorm.functional as F

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


LAYERS = {
    "LayerNorm": (lambda **kw: npnorm.LayerNorm((2, 5), **kw), (3, 2, 5)),
    "RMSNorm": (lambda **kw: npnorm.RMSNorm(5, **kw), (3, 5)),
    "GroupNorm": (lambda **kw: npnorm.GroupNorm(2, 4, **kw), (3, 4, 5)),
    "BatchNorm1d": (lambda **kw: npnorm.BatchNorm1d(4, **kw), (6, 4, 3)),
    "BatchNorm2d, momentum=None": (lambda **kw: npnorm.BatchNorm2d(4, momentum=None, **kw), (3, 4, 2, 2)),
    "InstanceNorm1d, tracked": (
        lambda **kw: npnorm.InstanceNorm1d(4, affine=True, track_running_stats=True, **kw),
        (3, 4, 5),
    ),
    "SyncBatchNorm (one rank)": (lambda **kw: npnorm.SyncBatchNorm(4, **kw), (6, 4)),
}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", LAYERS)
def test_a_module_on_jax_does_what_it_does_on_numpy(x64, name, training):
    """Two training steps (running statistics, grads accumulated over two backwards), a
    load, a reset and gradcheck: the same values as the NumPy module (JAX refused the
    first in-place write)."""
    make, shape = LAYERS[name]
    ours, ref = make(dtype="float64", xp=jnp).train(training), make(dtype="float64").train(training)
    module_as_on_numpy(ours, ref, shape, jnp.asarray, jax.Array)


def test_gradcheck_of_a_function_pair_on_jax(x64):
    x, w, b = (jnp.asarray(np.random.default_rng(1).normal(size=s)) for s in ((3, 5), (5,), (5,)))
    forward = lambda x, w, b: F.layer_norm_forward(x, 5, w, b)  # noqa: E731
    backward = lambda dy, x, w, b, mean, rstd: F.layer_norm_backward(dy, x, 5, mean, rstd, w, b)  # noqa: E731
    assert npnorm.gradcheck((forward, backward), x, w, b)


@pytest.mark.parametrize("call", [F.batch_norm, F.instance_norm])
def test_a_torch_style_call_that_updates_running_stats_is_refused(call):
    """F.batch_norm / F.instance_norm write the caller's running statistics in place,
    which JAX's arrays refuse: a clear error that points at the *_forward functions."""
    x = jnp.ones((2, 3, 4), dtype=jnp.float32)
    rm, rv = jnp.zeros(3, dtype=jnp.float32), jnp.ones(3, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"cannot be written in place.*return them"):
        call(x, rm, rv, None, None, True, 0.1, 1e-5)
    assert np.asarray(rm).tolist() == [0, 0, 0] and np.asarray(rv).tolist() == [1, 1, 1]
    y = call(x, rm, rv, None, None, False, 0.1, 1e-5)  # eval reads them only
    assert isinstance(y, jax.Array)


def test_out_that_cannot_be_written_is_refused_before_the_work():
    x = jnp.ones((3, 5), dtype=jnp.float32)
    with pytest.raises(ValueError, match="out is read-only"):
        F.layer_norm_forward(x, 5, out=jnp.zeros((3, 5), dtype=jnp.float32))


def test_a_constant_instance_with_eps_0_on_jax(x64):
    """InstanceNorm's rule for a constant instance with eps = 0 (the bias) wrote y in
    place: the pure function failed on JAX."""
    x = np.concatenate([np.ones((1, 2, 4)), np.random.default_rng(2).normal(size=(1, 2, 4))])
    b = np.array([0.5, -1.0])
    y, _, rstd, _, _ = F.instance_norm_forward(jnp.asarray(x), bias=jnp.asarray(b), eps=0.0)
    want, _, want_rstd, _, _ = F.instance_norm_forward(x, bias=b, eps=0.0)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(rstd), want_rstd, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(y)[0], np.broadcast_to(b[:, None], (2, 4)))  # the bias


def test_float64_without_jax_x64_is_refused():
    """With JAX's x64 mode off its float64 arrays are float32: the module said float64
    and held float32 (and gradcheck failed on float32 rounding, 'in float64')."""
    for dtype in ("float64", jnp.float64):  # (JAX's own float64 got past the check)
        with pytest.raises(TypeError, match="jax_enable_x64"):
            npnorm.LayerNorm(5, dtype=dtype, xp=jnp)
        with pytest.raises(TypeError, match="jax_enable_x64"):
            npnorm.LayerNorm(5, xp=jnp).to(dtype=dtype)
    assert npnorm.LayerNorm(5, xp=jnp).weight.dtype == jnp.float32


def test_the_counter_without_jax_x64_is_int32_and_quiet():
    """Without x64 JAX has no int64: BatchNorm's counter asked for one (a warning, an
    error under this suite) and got int32 anyway; it is int32 from the start now."""
    bn = npnorm.BatchNorm1d(3, xp=jnp)
    moved = npnorm.BatchNorm1d(3).to(jnp)
    for m in (bn, moved):
        assert m.num_batches_tracked.dtype == jnp.int32
        m(jnp.ones((4, 3), dtype=jnp.float32))
        assert int(m.num_batches_tracked) == 1
    back = moved.to("numpy")
    assert back.num_batches_tracked.dtype == np.int64 and int(back.num_batches_tracked) == 1


def test_xp_jax_points_at_jax_numpy():
    with pytest.raises(ValueError, match=r"did you mean 'jax\.numpy'"):
        npnorm.LayerNorm(3, xp="jax")


def test_the_pure_functions_run_under_jit():
    """``jax.jit`` over the functional forwards and backwards (the eps = 0 rule of
    InstanceNorm tested ``any`` of a traced array: it raised under jit)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(4, 3, 5)).astype(np.float32))
    w, b, rm, rv = jnp.ones(3), jnp.zeros(3), jnp.zeros(3), jnp.ones(3)
    calls = {
        "layer_norm": lambda x: F.layer_norm_backward(x, x, 5, *F.layer_norm_forward(x, 5)[1:], None, None),
        "rms_norm": lambda x: F.rms_norm_forward(x, 5),
        "batch_norm": lambda x: F.batch_norm_forward(x, rm, rv, w, b, True),
        "group_norm": lambda x: F.group_norm_forward(x, 3, w, b),
        "instance_norm, eps=0": lambda x: F.instance_norm_forward(x, eps=0.0),
        "F.layer_norm": lambda x: F.layer_norm(x, 5),
    }
    for name, call in calls.items():
        jitted, plain = jax.jit(call)(x), call(x)
        for a, b_ in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(plain), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", [n for n in LAYERS if not n.startswith("SyncBatchNorm")])
def test_a_module_call_under_jit_that_would_keep_traced_values_is_refused(name):
    """A module call under jax.jit returned and left tracers in the running statistics,
    the counter and the saved forward: every later use of the module raised JAX's
    UnexpectedTracerError. It is refused with nothing changed; in eval mode inside
    npnorm.no_grad() (nothing kept) it runs."""
    from conftest import assert_state_equal, snapshot

    make, shape = LAYERS[name]
    m = make(xp="jax.numpy")
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape).astype(np.float32))
    state, grads = snapshot(m)
    with pytest.raises(TypeError, match=r"under a JAX transformation .* nothing was changed"):
        jax.jit(lambda a: m(a))(x)
    assert_state_equal(m, state, grads)
    y = m(x)  # the module works, untouched
    m.backward(jnp.ones_like(y))
    m.eval()
    with npnorm.no_grad():
        np.testing.assert_allclose(
            np.asarray(jax.jit(lambda a: m(a))(x)), np.asarray(m(x)), rtol=1e-6, atol=1e-6
        )


def test_a_jax_module_moves_to_torch_without_torchs_read_only_warning(torch):
    """JAX's arrays reach NumPy read-only through DLPack, and torch warns when it is
    given a read-only 0-d array (the counter), once per process: in a fresh process with
    warnings as errors, a move to torch and a load of such an array raised."""
    import subprocess
    import sys

    script = (
        "import numpy as np, npnorm\n"
        "m = npnorm.BatchNorm1d(3, xp='jax.numpy')\n"
        "t = m.to('torch')\n"
        "assert type(t.num_batches_tracked).__module__ == 'torch'\n"
        "c = np.asarray(np.int64(4)); c.flags.writeable = False\n"
        "n = npnorm.BatchNorm1d(3, xp='torch')\n"
        "n.load_state_dict({**m.state_dict(), 'num_batches_tracked': c})\n"
        "assert int(n.num_batches_tracked) == 4\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "torch.device"])
def test_a_ported_cpu_device_names_jaxs(device):
    """JAX's CPU device is TFRT_CPU_0 (its platform "cpu"), and JAX's inspection names no
    default device: a ported ``device="cpu"`` was "not a device of backend jax.numpy"."""
    if device == "torch.device":
        device = pytest.importorskip("torch").device("cpu")
    m = npnorm.LayerNorm(5, xp="jax.numpy", device=device)
    (cpu,) = jax.devices("cpu")
    assert m.weight.devices() == {cpu}
    assert m.to(device=device).weight.devices() == {cpu}
    with pytest.raises(ValueError, match=r"'gpu:7' is not a device of backend jax\.numpy"):
        npnorm.LayerNorm(5, xp="jax.numpy", device="gpu:7")


@pytest.mark.parametrize("xp", ["numpy", "jax.numpy", "array_api_strict"])
def test_the_string_none_names_no_device(xp):
    """A device with no platform attribute added "None" to the names matched."""
    with pytest.raises(ValueError, match="'None' is not a device of backend"):
        npnorm.LayerNorm(5, xp=xp, device="None")


def test_x64_turned_on_after_a_float32_call_sums_in_float64():
    """Whether a device has float64 was cached: a JAX call before x64 was turned on kept
    later calls' sums in float32 (a result 6e-3 off at a large offset)."""
    x = (np.random.default_rng(0).normal(size=(4, 64)) + 3e3).astype(np.float32)
    npnorm.LayerNorm(64, xp="jax.numpy")(jnp.asarray(x))  # x64 off
    jax.config.update("jax_enable_x64", True)
    try:
        y = npnorm.LayerNorm(64, xp="jax.numpy")(jnp.asarray(x))
    finally:
        jax.config.update("jax_enable_x64", False)
    want = npnorm.LayerNorm(64, dtype="float32")(x)  # float64 sums (float32 ones: 6e-3 off)
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-6)


def test_a_layer_of_your_own_with_constant_buffers_runs_under_jit_without_grad():
    """The refusal before the forward asked whether the module has buffers: a layer whose
    buffers are constants was refused in training mode inside no_grad, "its running
    statistics" named."""

    class Shift(npnorm.Module):
        _buffer_names = ("shift",)

        def __init__(self):
            super().__init__()
            self.shift = jnp.full(3, 2.0, dtype=jnp.float32)

        def _forward(self, x):
            return x + self.shift, (), {}

        def _backward(self, dy, saved):
            return dy, {}

    m = Shift()
    with npnorm.no_grad():
        y = jax.jit(lambda a: m(a))(jnp.zeros(3, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), 2.0)


def test_batch_norm_trains_on_inputs_committed_to_another_jax_device():
    """Its running-statistics updates, made on the input's device, were moved back to the
    buffers' device, which committed the buffers there: the next training step raised JAX's
    "incompatible devices". (Two host devices need XLA_FLAGS before jax is imported.)"""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, jax, jax.numpy as jnp, npnorm\n"
        "d0, d1 = jax.devices()\n"
        "m = npnorm.BatchNorm1d(3, xp=jnp)\n"
        "for step in range(3):\n"
        "    x = jax.device_put(jnp.asarray(np.full((4, 3), step, np.float32) + np.arange(4)[:, None]), d1)\n"
        "    m.backward(jnp.ones_like(m(x)))\n"
        "print(int(m.num_batches_tracked))\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"
