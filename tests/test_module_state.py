"""What a module's arrays are after a step, as in PyTorch: buffers, loaded values and grads
written in place (references held by the user see them), and a backward that differentiates
the forward that ran, with the weight it used."""

from __future__ import annotations

import array_api_compat
import numpy as np
import pytest
from conftest import assert_state_equal, snapshot

import npnorm
from npnorm._backend import to_host

# (make, input shape) for every layer with a weight; the batch-statistics layers track
LAYERS = [
    pytest.param(lambda **kw: npnorm.LayerNorm(4, **kw), (3, 4), id="LayerNorm"),
    pytest.param(lambda **kw: npnorm.RMSNorm(4, **kw), (3, 4), id="RMSNorm"),
    pytest.param(lambda **kw: npnorm.GroupNorm(2, 4, **kw), (3, 4, 5), id="GroupNorm"),
    pytest.param(lambda **kw: npnorm.BatchNorm1d(4, **kw), (3, 4, 5), id="BatchNorm1d"),
    pytest.param(
        lambda **kw: npnorm.InstanceNorm1d(4, affine=True, track_running_stats=True, **kw),
        (3, 4, 5),
        id="InstanceNorm1d",
    ),
    pytest.param(lambda **kw: npnorm.SyncBatchNorm(4, **kw), (3, 4, 5), id="SyncBatchNorm"),
]


def _data(backend, shape, seed=0):
    rng = np.random.default_rng(seed)
    return backend.asarray(rng.normal(size=shape)), backend.asarray(rng.normal(size=shape))


@pytest.mark.parametrize("make, shape", LAYERS)
def test_backward_uses_the_weight_its_forward_used(backend, make, shape):
    """A weight and bias assigned between forward and backward do not change the gradient
    (PyTorch's saved tensors: the forward's weight)."""
    m = make(dtype="float64", xp=backend.name)
    x, dy = _data(backend, shape)
    m(x)
    want = backend.numpy(m.backward(dy))
    m.zero_grad()
    m(x)
    m.weight = m.weight * 3.0 + 1.0
    if getattr(m, "bias", None) is not None:
        m.bias = m.bias - 2.0
    np.testing.assert_array_equal(backend.numpy(m.backward(dy)), want)


@pytest.mark.parametrize("make, shape", LAYERS)
def test_a_held_state_dict_sees_the_training_step(backend, make, shape):
    """Running statistics and the counter change in place: a state_dict taken before a step
    holds the step's values after it, as a PyTorch state_dict does."""
    m = make(dtype="float64", xp=backend.name)
    held = m.state_dict()
    m(_data(backend, shape)[0])
    now = m.state_dict()
    for k, v in held.items():
        assert v is now[k], k
    if "running_mean" in held:
        assert not np.all(backend.numpy(held["running_mean"]) == 0)
    if "num_batches_tracked" in held and not isinstance(m, npnorm.InstanceNorm1d):
        assert int(backend.numpy(held["num_batches_tracked"])) == 1


def test_a_converted_sync_batch_norm_keeps_sharing_its_buffers():
    """convert_sync_batchnorm shares the arrays (as torch's conversion): a step on either
    module moves both."""
    bn = npnorm.BatchNorm1d(3, dtype="float64")
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn)
    x = np.random.default_rng(0).normal(size=(4, 3))
    sync(x)
    assert int(bn.num_batches_tracked) == 1
    np.testing.assert_array_equal(bn.running_mean, sync.running_mean)
    sync.backward(x)  # grads made after the conversion are shared too (torch's .grad)
    assert bn.grads["weight"] is sync.grads["weight"]


@pytest.mark.parametrize("make, shape", LAYERS)
def test_load_state_dict_writes_into_held_arrays(backend, make, shape):
    """load_state_dict copies into the module's own arrays, so that an optimizer holding
    parameters() updates what the module uses; the module still shares no memory with the
    checkpoint."""
    m = make(dtype="float64", xp=backend.name)
    params = m.parameters()
    source = {k: np.full(tuple(v.shape), 0.5) for k, v in m.state_dict().items()}
    source.pop("num_batches_tracked", None)
    m.load_state_dict(source, strict=False)
    for k, v in params.items():
        assert v is getattr(m, k), k
        np.testing.assert_array_equal(backend.numpy(v), 0.5)
    source["weight"][...] = 7.0
    assert float(backend.numpy(m.weight).max()) == 0.5


# (npnorm layer, torch layer, input shape, mode) for the load-between-passes parity test
PAIRS = [
    ("LayerNorm", (4,), {}, (3, 4), "train"),
    ("RMSNorm", (4,), {}, (3, 4), "train"),
    ("GroupNorm", (2, 4), {}, (3, 4, 5), "train"),
    ("BatchNorm1d", (4,), {}, (3, 4, 5), "train"),
    ("BatchNorm1d", (4,), {}, (3, 4, 5), "eval"),
    ("InstanceNorm1d", (4,), {"affine": True, "track_running_stats": True}, (3, 4, 5), "train"),
]


@pytest.mark.parametrize("name, args, kw, shape, mode", PAIRS)
def test_a_load_between_forward_and_backward_as_in_torch(torch, name, args, kw, shape, mode):
    """load_state_dict of one array between forward and backward: backward raises where
    PyTorch's does (its version check on what its backward keeps: the weight, LayerNorm's
    bias, BatchNorm's running statistics), and otherwise gives the gradient of the forward
    that ran (InstanceNorm's keeps copies, as PyTorch's)."""
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    for key in [k for k in getattr(npnorm, name)(*args, **kw).state_dict() if k != "num_batches_tracked"]:
        ours = getattr(npnorm, name)(*args, **kw, dtype="float64")
        ref = getattr(torch.nn, name)(*args, **kw).double()
        getattr(ours, mode)()
        getattr(ref, mode)()
        want = _dx_of_a_step_on_a_copy(ours, x, dy)
        ours(x)
        xt = torch.tensor(x, requires_grad=True)
        yt = ref(xt)
        new = np.full(tuple(ours.state_dict()[key].shape), 0.5)
        ours.load_state_dict({key: new}, strict=False)
        ref.load_state_dict({key: torch.tensor(new)}, strict=False)
        try:
            yt.backward(torch.tensor(dy))
        except RuntimeError:
            with pytest.raises(RuntimeError, match=f"the {key} that the last forward used was overwritten"):
                ours.backward(dy)
            continue
        np.testing.assert_allclose(ours.backward(dy), want, rtol=1e-12, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(xt.grad.numpy(), want, rtol=1e-10, atol=1e-10, err_msg=key)


def _dx_of_a_step_on_a_copy(m, x, dy):
    """dx of a forward and backward on a deep copy of ``m`` (``m`` unchanged)."""
    import copy

    c = copy.deepcopy(m)
    c(x)
    return c.backward(dy)


def test_grads_accumulate_in_place_and_the_first_is_not_a_view_of_grad_output(rng):
    m = npnorm.LayerNorm(4, dtype="float64")
    x, dy = rng.normal(size=(4,)), rng.normal(size=(4,))  # one row: dbias has dy's values
    m(x)
    m.backward(dy)
    held = m.grads["bias"]
    assert not np.shares_memory(held, dy)
    first = held.copy()
    m(x)
    m.backward(dy)
    assert m.grads["bias"] is held
    np.testing.assert_allclose(held, 2 * first)
    np.testing.assert_array_equal(dy, first)  # the caller's grad_output unchanged


def test_a_failed_forward_changes_no_held_buffer():
    """In-place updates happen only after the forward succeeded."""
    m = npnorm.BatchNorm1d(3, dtype="float64")
    held = {k: np.array(v, copy=True) for k, v in m.state_dict().items()}
    with pytest.raises(ValueError):
        m(np.ones((4, 5)))  # 5 channels, not 3
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, held[k], err_msg=k)


def test_to_where_the_module_already_is_keeps_its_arrays_as_torch(torch, rng):
    """torch's ``to()`` returns a tensor that needs no move or cast as it is: a held
    state_dict, a SyncBatchNorm's shared buffers and the saved forward stay valid. It
    replaced every array."""
    x = rng.normal(size=(4, 3)).astype(np.float32)
    m = npnorm.BatchNorm1d(3)
    held = m.state_dict()
    m.to("numpy").to(dtype="float32")
    m(x)
    m.backward(np.ones_like(x))  # the saved forward survived a no-op move
    assert all(held[k] is v for k, v in m.state_dict().items()) and int(held["num_batches_tracked"]) == 1
    counter = m.num_batches_tracked
    m.to(dtype="float64")  # a cast: new float arrays, the same int64 counter, as torch
    ref = torch.nn.BatchNorm1d(3)
    ref_counter = ref.num_batches_tracked
    ref.to(torch.float64)
    assert (m.num_batches_tracked is counter) == (ref.num_batches_tracked is ref_counter) is True
    assert held["running_mean"] is not m.running_mean and m.running_mean.dtype == np.float64
    bn = npnorm.BatchNorm1d(3)
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn)
    sync.to("numpy")
    assert sync.running_mean is bn.running_mean


@pytest.mark.parametrize(
    "make, shape, change",
    [
        (lambda: npnorm.GroupNorm(2, 6, affine=False), (2, 6, 4), ("num_groups", 3)),
        (lambda: npnorm.LayerNorm((3, 4), elementwise_affine=False), (2, 3, 4), ("normalized_shape", (4,))),
        (lambda: npnorm.RMSNorm((3, 4), elementwise_affine=False), (2, 3, 4), ("normalized_shape", (4,))),
    ],
)
def test_backward_differentiates_the_forward_as_it_ran_whatever_setting_changed(make, shape, change):
    """Setting ``num_groups`` or ``normalized_shape`` between forward and backward made the
    backward use the new value (a shape error, or the gradient of another layer); torch's
    backward and npnorm's contract use the forward's."""
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    m, ref = make(), make()
    m(x)
    ref(x)
    setattr(m, *change)
    np.testing.assert_array_equal(m.backward(dy), ref.backward(dy))


def _0d_grad_accumulates(xp, asarray, dtype, kind, rng):
    class Scale(npnorm.Module):
        _parameter_names = ("g",)

        def __init__(self):
            super().__init__(dtype=dtype, xp=xp)
            self.g = xp.ones((), dtype=self.dtype)

        def _forward(self, x):
            return x * self.g, (x, self.g), {}

        def _backward(self, dy, saved):
            x, g = saved
            dg = xp.sum(dy * x)  # numpy: a NumPy scalar; the others: a 0-d array
            if kind == "python float":
                dg = float(dg)
            elif kind == "0-d array":
                dg = xp.asarray(dg)
            elif kind == "float64 array":  # cast to the parameter's dtype, as torch's autograd does
                dg = xp.asarray(float(dg), dtype=xp.float64)
            return dy * g, {"g": dg}

    m = Scale()
    x, dy = asarray(rng.normal(size=(3, 5)), dtype), asarray(rng.normal(size=(3, 5)), dtype)
    m(x)
    m.backward(dy)
    held = m.grads["g"]
    assert array_api_compat.array_namespace(held) is array_api_compat.array_namespace(m.g)
    assert tuple(held.shape) == () and held.dtype == m.g.dtype
    first = float(held)
    m(x)
    m.backward(dy)
    assert m.grads["g"] is held
    assert float(held) == 2 * first  # the same gradient twice: doubling is exact


KINDS = ["sum", "python float", "0-d array", "float64 array"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_0d_parameters_grad_accumulates_in_place(backend, rng, kind, dtype):
    """A user's layer with a 0-d parameter (the README's ScaleNorm). Its gradient may come
    back as a number: NumPy sums arrays into a NumPy scalar (and adds two 0-d arrays into
    one, which used to replace ``grads["g"]`` on the second backward, so that a reference
    held to it kept the first gradient), or a layer returns a Python float (an obscure
    array_api_compat TypeError), or an array in a wider dtype (added at float64, which
    rebound ``grads["g"]``). Each is a 0-d array of the module's backend in the parameter's
    dtype, summed in place."""
    if dtype == "float16" and not backend.has_float16:
        pytest.skip(f"{backend} has no float16")
    _0d_grad_accumulates(backend.xp, backend.asarray, dtype, kind, rng)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_a_0d_parameters_grad_accumulates_in_place_on_torch(torch, rng, kind, dtype):
    """As above, with torch tensors as the backend (xp="torch")."""
    xp = array_api_compat.array_namespace(torch.zeros(1))
    _0d_grad_accumulates(xp, lambda a, dtype: torch.asarray(a, dtype=getattr(torch, dtype)), dtype, kind, rng)


def _unwritable(kind, values):
    """``values`` (NumPy float32, all equal) as an array whose elements cannot each take a
    write: a torch ``expand`` (torch refuses writes to it), an array_api_strict array over a
    read-only NumPy array, a NumPy zero-stride view made writable (a write to one element is
    a write to all)."""
    if kind == "torch expand":
        import torch

        return torch.from_numpy(values[:1].copy()).expand(values.shape[0])
    if kind == "array_api_strict read-only":
        strict = pytest.importorskip("array_api_strict")
        held = values.copy()
        held.flags.writeable = False
        return strict.asarray(held)
    return np.lib.stride_tricks.as_strided(values[:1].copy(), values.shape, (0,), writeable=True)


@pytest.mark.parametrize("kind", ["torch expand", "array_api_strict read-only", "numpy zero stride"])
def test_an_array_that_cannot_take_writes_in_place_is_replaced_not_half_written(kind):
    """A parameter, buffer or grad that cannot be written in place element by element was
    taken as writable (array_api_compat says so for these three): load_state_dict,
    reset_parameters, a training forward's running statistics and backward's gradient sums
    wrote the first arrays, then raised on it (torch: "more than one element of the
    written-to tensor refers to a single memory location"; array_api_strict: "assignment
    destination is read-only"), or, for the NumPy view, wrote one value over all. Now such
    an array is replaced by a new one, as a read-only NumPy array is."""
    if kind == "torch expand":
        pytest.importorskip("torch")
    xp = {"torch expand": "torch", "array_api_strict read-only": "array_api_strict"}.get(kind)
    kw = {"dtype": "float32"} if xp is None else {"dtype": "float32", "xp": xp}
    rng = np.random.default_rng(0)
    x32 = rng.normal(size=(6, 5)).astype(np.float32)
    plain, odd = npnorm.BatchNorm1d(5, **kw), npnorm.BatchNorm1d(5, **kw)
    x = plain.xp.asarray(x32)
    twos, halves = np.full(5, 2.0, np.float32), np.full(5, 0.5, np.float32)

    for m in (plain, odd):  # a load whose last key is the odd array
        if m is odd:
            m.bias = _unwritable(kind, np.zeros(5, np.float32))
        m.load_state_dict({"weight": m.xp.asarray(twos), "bias": m.xp.asarray(halves)}, strict=False)
    for m in (plain, odd):  # a training step that updates the odd running_var
        if m is odd:
            m.running_var = _unwritable(kind, np.ones(5, np.float32))
        y = m(x)
        m.backward(m.xp.ones_like(y))
    for m in (plain, odd):  # a backward that adds into an odd grad
        if m is odd:
            m.grads["bias"] = _unwritable(kind, np.ones(5, np.float32))
        else:
            m.grads["bias"] = m.xp.asarray(np.ones(5, np.float32))
        m(x)
        m.backward(m.xp.ones_like(y))
    for key, value in plain.state_dict().items():
        np.testing.assert_array_equal(to_host(odd.state_dict()[key]), to_host(value), err_msg=key)
    for key, value in plain.grads.items():
        np.testing.assert_array_equal(to_host(odd.grads[key]), to_host(value), err_msg=key)
    odd.weight = _unwritable(kind, np.zeros(5, np.float32))
    odd.reset_parameters()
    np.testing.assert_array_equal(to_host(odd.weight), np.ones(5, np.float32))
    np.testing.assert_array_equal(to_host(odd.bias), np.zeros(5, np.float32))


@pytest.mark.parametrize("op", ["load_state_dict", "reset_running_stats", "reset_parameters"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("affine", [True, False])
def test_a_change_after_an_empty_batch_fails_the_backward_where_torch_does(torch, op, mode, affine):
    """torch's batch_norm on an empty batch is ``input * weight + bias``, whose backward keeps
    the weight alone: a load_state_dict or reset of the running statistics before it runs
    there, and raised here (the running statistics were taken as kept, as for a batch)."""
    x = np.zeros((0, 3, 2), np.float32)
    ours, ref = npnorm.BatchNorm1d(3, affine=affine), torch.nn.BatchNorm1d(3, affine=affine)
    getattr(ours, mode)()
    getattr(ref, mode)()
    y = ours(x)
    xt = torch.from_numpy(x).requires_grad_()
    yt = ref(xt)
    if op == "load_state_dict":
        ours.load_state_dict({k: np.array(v) for k, v in ours.state_dict().items()})
        ref.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()})
    else:
        getattr(ours, op)()
        getattr(ref, op)()
    try:
        yt.backward(torch.ones_like(yt))
    except RuntimeError:
        with pytest.raises(RuntimeError, match="overwritten"):
            ours.backward(np.ones_like(y))
        assert affine  # (torch raises only where the weight was overwritten)
        return
    assert ours.backward(np.ones_like(y)).shape == x.shape


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_load_state_dict_of_a_list_is_a_type_error_as_in_torch(torch):
    """torch: "TypeError: Expected state_dict to be dict-like"; the docstring says TypeError."""
    pairs = [("weight", np.ones(3))]
    with pytest.raises(TypeError, match="dict-like"):
        torch.nn.LayerNorm(3).load_state_dict(pairs)
    m = npnorm.LayerNorm(3)
    state, grads = snapshot(m)
    with pytest.raises(TypeError):
        m.load_state_dict(pairs)
    assert_state_equal(m, state, grads)


def test_the_prefix_hint_names_three_prefixes():
    """Keys of a whole model's checkpoint: the error suggests the prefixes found, up to
    three."""
    keys = {f"{i}.{k}": np.ones(4) for i in range(4) for k in ("weight", "bias")}
    with pytest.raises(RuntimeError) as err:
        npnorm.LayerNorm(4).load_state_dict(keys)
    assert "prefix='0.', prefix='1.', prefix='2.'" in str(err.value)
