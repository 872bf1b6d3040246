"""Results live on the input's device (array_api_strict's second device stands in for a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import npnorm
import npnorm.functional as F

xs = pytest.importorskip("array_api_strict")
D1 = xs.Device("device1")


def _ones(*shape):
    return xs.ones(shape, dtype=xs.float64, device=D1)


def _on_device1(*arrays):
    return all(a is None or a.device == D1 for a in arrays)


@pytest.mark.parametrize("n,spatial", [(3, 4), (0, 4), (3, 0)])
def test_channel_layers_keep_the_inputs_device(n, spatial):
    # empty batches (n=0) and empty instances (spatial=0) take their own path
    x = xs.reshape(xs.arange(n * 6 * spatial, dtype=xs.float64, device=D1), (n, 6, spatial))
    w, b, rm, rv = _ones(6), _ones(6), _ones(6), _ones(6)
    y, mean, rstd, new_mean, new_var = F.batch_norm_forward(x, rm, rv, w, b, True)
    assert _on_device1(y, mean, rstd, new_mean, new_var)
    assert _on_device1(*F.batch_norm_backward(x, x, mean, rstd, w, b, True))
    if n:
        y, mean, rstd = F.group_norm_forward(x, 2, w, b)
        assert _on_device1(y, mean, rstd)
        assert _on_device1(*F.group_norm_backward(x, x, 2, mean, rstd, w, b))
        y, mean, rstd, new_mean, new_var = F.instance_norm_forward(x, rm, rv, w, b, True)
        assert _on_device1(y, mean, rstd, new_mean, new_var)
        assert _on_device1(*F.instance_norm_backward(x, x, mean, rstd, w, b, True))


def test_row_layers_keep_the_inputs_device():
    x, w = _ones(2, 5), _ones(5)
    y, mean, rstd = F.layer_norm_forward(x, 5, w, w)
    assert _on_device1(y, mean, rstd, *F.layer_norm_backward(x, x, 5, mean, rstd, w, w))
    y, rstd = F.rms_norm_forward(x, 5, w)
    assert _on_device1(y, rstd, *F.rms_norm_backward(x, x, 5, rstd, w))


@pytest.mark.parametrize("device, dtype", [("device1", "float64"), ("no_float64", "float32")])
def test_sync_batch_norm_over_ranks_keeps_the_inputs_device(device, dtype):
    """The statistics and means that the ranks computed on the host were made on the
    default device: over two ranks, SyncBatchNorm failed to combine them with input on
    any other ("Arrays from two different devices"), a GPU's in use."""
    from npnorm._threadcomm import run_ranks

    dev, cpu = xs.Device(device), xs.Device("CPU_DEVICE")
    xn = np.random.default_rng(0).normal(size=(6, 3, 4)).astype(dtype)
    x, w = xs.asarray(xn, device=dev), xs.ones(3, dtype=getattr(xs, dtype), device=dev)
    rm, rv = (
        xs.zeros(3, dtype=getattr(xs, dtype), device=dev),
        xs.ones(3, dtype=getattr(xs, dtype), device=dev),
    )
    y0, m0, r0, rm0, rv0 = F.batch_norm_forward(x, rm, rv, w, w, True)
    want = (y0, *F.batch_norm_backward(x, x, m0, r0, w, w, True), rm0, rv0)

    def rank_fn(comm):
        part = x[:2, ...] if comm.Get_rank() == 0 else x[2:, ...]
        y, m, r, new_rm, new_rv = F.sync_batch_norm_forward(part, rm, rv, w, w, training=True, comm=comm)
        dx, dw, db = F.sync_batch_norm_backward(part, part, m, r, w, w, training=True, comm=comm)
        return y, dx, dw, db, new_rm, new_rv

    ranks = run_ranks(2, rank_fn)
    assert all(a.device == dev for rank in ranks for a in rank)
    y, dx = (xs.concat([rank[k] for rank in ranks]) for k in (0, 1))
    dw, db = (ranks[0][k] + ranks[1][k] for k in (2, 3))
    tol = {"float64": 1e-12, "float32": 1e-5}[dtype]
    got = [y, dx, dw, db, *(rank[k] for rank in ranks for k in (4, 5))]  # every rank's running stats
    for g, ref in zip(got, [*want[:4], *want[4:] * 2], strict=True):
        np.testing.assert_allclose(
            np.asarray(g.to_device(cpu)), np.asarray(ref.to_device(cpu)), atol=tol * 10
        )


# --- modules built on, or moved to, the second device ------------------------------
MODULES = {
    "BatchNorm1d": (lambda **kw: npnorm.BatchNorm1d(3, **kw), (4, 3, 5)),
    "BatchNorm2d, momentum=None": (lambda **kw: npnorm.BatchNorm2d(3, momentum=None, **kw), (2, 3, 2, 2)),
    "SyncBatchNorm (one rank)": (lambda **kw: npnorm.SyncBatchNorm(3, **kw), (4, 3)),
    "InstanceNorm1d, tracked": (
        lambda **kw: npnorm.InstanceNorm1d(3, affine=True, track_running_stats=True, **kw),
        (2, 3, 5),
    ),
    "LayerNorm": (lambda **kw: npnorm.LayerNorm((2, 5), **kw), (3, 2, 5)),
    "RMSNorm": (lambda **kw: npnorm.RMSNorm(5, **kw), (3, 5)),
    "GroupNorm": (lambda **kw: npnorm.GroupNorm(3, 6, **kw), (2, 6, 4)),
}


def _arrays(m):
    return {**m.parameters(), **m.buffers(), **m.grads}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", MODULES)
def test_a_module_built_on_a_device_stays_there(name, training):
    """``device=`` puts every parameter and buffer there; forward, backward, the
    running-statistics updates, both resets and gradcheck keep them there, with the
    results of the default device."""
    make, shape = MODULES[name]
    m = make(device=D1, dtype="float64", xp="array_api_strict").train(training)
    ref = make(dtype="float64", xp="array_api_strict").train(training)
    assert all(a.device == D1 for a in _arrays(m).values())
    x = np.random.default_rng(0).normal(size=shape)
    y = m(xs.asarray(x, device=D1))
    dx = m.backward(xs.ones_like(y))
    y_ref = ref(xs.asarray(x))
    dx_ref = ref.backward(xs.ones_like(y_ref))
    assert y.device == D1 and dx.device == D1
    assert all(a.device == D1 for a in _arrays(m).values())
    np.testing.assert_array_equal(np.asarray(y.to_device(xs.Device("CPU_DEVICE"))), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx.to_device(xs.Device("CPU_DEVICE"))), np.asarray(dx_ref))
    m.reset_parameters()  # (and the running statistics, where the layer has them)
    assert all(a.device == D1 for a in _arrays(m).values())
    assert npnorm.gradcheck(m, xs.asarray(x, device=D1))


def test_to_moves_a_module_to_a_device_and_keeps_what_is_there():
    m = npnorm.BatchNorm1d(3, xp="array_api_strict")
    m(xs.ones((2, 3)))
    m.backward(xs.ones((2, 3)))
    here = m.to(device=xs.Device("CPU_DEVICE")).weight  # already there: the same arrays
    assert here is m.weight
    assert m.to(device=D1) is m
    assert all(a.device == D1 for a in _arrays(m).values())
    assert m.weight is not here
    with pytest.raises(RuntimeError, match="forward"):  # the move dropped the saved forward
        m.backward(xs.ones((2, 3), device=D1))
    y = m(xs.ones((2, 3), device=D1))
    assert y.device == D1


@pytest.mark.parametrize(
    "module", [npnorm.InstanceNorm1d(3), npnorm.LayerNorm(4, elementwise_affine=False)], ids=repr
)
def test_gradcheck_on_the_inputs_device(module):
    """gradcheck's projection ``u`` is made on the output's device (it was made on the
    default device: a torch CUDA or second-GPU input failed to combine with it)."""
    x = xs.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), device=D1)
    assert npnorm.gradcheck(module, x)


def test_from_torch_onto_a_device():
    torch = pytest.importorskip("torch")
    ref = torch.nn.BatchNorm1d(3, momentum=None)
    ref(torch.randn(5, 3))
    ours = npnorm.from_torch(ref, xp="array_api_strict", device=D1)
    assert all(a.device == D1 for a in _arrays(ours).values())
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(
            np.asarray(getattr(ours, k).to_device(xs.Device("CPU_DEVICE"))), v.numpy()
        )


def test_a_pickled_module_comes_back_on_its_device():
    """A module on a second device, pickled and loaded: its arrays on that device (they
    came back on the default device, and its own device's input was refused)."""
    import pickle

    m = npnorm.BatchNorm1d(3, device=D1, xp="array_api_strict")
    m(xs.ones((4, 3), device=D1))
    back = pickle.loads(pickle.dumps(m))
    assert all(a.device == D1 for a in _arrays(back).values())
    assert back(xs.ones((4, 3), device=D1)).device == D1
    here = pickle.loads(pickle.dumps(npnorm.BatchNorm1d(3, xp="array_api_strict")))
    assert here.weight.device == xs.Device("CPU_DEVICE")


NO_F64 = xs.Device("no_float64")  # array_api_strict's device without float64 (as torch's "mps")
NO_X64 = xs.Device("no_x64")  # nor int64 (as JAX without x64)


@pytest.mark.parametrize("start", [NO_F64, NO_X64])
@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d, tracked"])
def test_a_module_moves_off_a_device_without_a_dtype_it_takes_there(name, start):
    """to() cast an array before moving it: an int32 counter leaving a device without
    int64 (and float32 arrays given float64 leaving one without float64) was cast where
    that dtype is missing, array_api_strict's ValueError. They move first, then cast."""
    make, shape = MODULES[name]
    m = make(xp="array_api_strict", device=start)
    m(xs.asarray(np.random.default_rng(0).normal(size=shape).astype(np.float32), device=start))
    state = {k: np.asarray(v.to_device(xs.Device("CPU_DEVICE"))) for k, v in m.state_dict().items()}
    cpu = xs.Device("CPU_DEVICE")
    m.to(device=cpu, dtype="float64")
    assert m.num_batches_tracked.dtype == xs.int64 and m.weight.dtype == xs.float64
    for k, v in m.state_dict().items():
        assert v.device == cpu
        np.testing.assert_array_equal(np.asarray(v), state[k], err_msg=k)
    m.to(device=start, dtype="float32")  # and back
    assert m.num_batches_tracked.dtype == (xs.int32 if start == NO_X64 else xs.int64)
    assert all(v.device == start for v in m.state_dict().values())


@pytest.mark.parametrize("how", ["constructor", "to", "to the device"])
def test_a_dtype_the_device_lacks_is_our_type_error_and_changes_nothing(how):
    """float64 on a device without it raised array_api_strict's own ValueError ("does not
    support dtype=float64"); it is npnorm's TypeError, as a dtype the backend lacks, and a
    refused to() changes nothing."""
    m = npnorm.LayerNorm(3, xp="array_api_strict", device=NO_F64)
    on_cpu = npnorm.LayerNorm(3, xp="array_api_strict", dtype="float64")
    match = r"backend array_api_strict has no float64 arrays on device .*no_float64"
    with pytest.raises(TypeError, match=match):
        if how == "constructor":
            npnorm.LayerNorm(3, xp="array_api_strict", dtype="float64", device=NO_F64)
        elif how == "to":
            m.to(dtype="float64")
        else:
            on_cpu.to(device=NO_F64)
    assert m.weight.dtype == xs.float32 and m.weight.device == NO_F64
    assert on_cpu.weight.dtype == xs.float64 and on_cpu.weight.device == xs.Device("CPU_DEVICE")


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", [n for n in MODULES if not n.startswith("SyncBatchNorm")])
@pytest.mark.parametrize("device", [NO_F64, NO_X64])
def test_a_device_without_float64_sums_in_float32(name, training, device):
    """The statistics were summed in float64 wherever the namespace has float64, not its
    device: on one without (torch's "mps"), every layer raised. They are summed in the
    input's dtype there, as for JAX without x64, close to the float64 sums. On a device
    without int64 too, the counter is int32 (a BatchNorm could not be built there:
    "does not support dtype=int64")."""
    make, shape = MODULES[name]
    m = make(device=device, xp="array_api_strict").train(training)
    ref = make().train(training)
    x = (np.random.default_rng(0).normal(size=shape) * 3 + 1).astype(np.float32)
    y = m(xs.asarray(x, device=device))
    dx = m.backward(xs.ones_like(y) * 0.5)
    y_ref, dx_ref = ref(x), ref.backward(np.full(shape, 0.5, np.float32))
    assert y.device == device and y.dtype == dx.dtype == xs.float32
    counter = m.buffers().get("num_batches_tracked")
    assert counter is None or counter.dtype == (xs.int32 if device == NO_X64 else xs.int64)
    for moved in (m.to(dtype="float32"), m.to(device=device)):  # the counter stays int32 there
        assert moved.buffers().get("num_batches_tracked") is counter
    for got, want in ((y, y_ref), (dx, dx_ref), *((m.buffers()[k], v) for k, v in ref.buffers().items())):
        np.testing.assert_allclose(
            np.asarray(got.to_device(xs.Device("CPU_DEVICE"))), want, rtol=1e-5, atol=1e-5
        )
