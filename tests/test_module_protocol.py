"""The module protocol every layer shares: grads, modes, state_dict, to()."""

from __future__ import annotations

import inspect
import re
import types
import warnings

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import randomize

import npnorm


def test_backward_before_forward_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="forward"):
        npnorm.LayerNorm(3).backward(np.ones((2, 3), np.float32))


def test_grad_output_of_wrong_shape_is_a_value_error(rng):
    m = npnorm.LayerNorm(3)
    m(rng.normal(size=(2, 3)).astype(np.float32))
    with pytest.raises(ValueError, match=r"grad_output must have the shape.*\(2, 3\)"):
        m.backward(np.ones((3, 3), np.float32))
    assert m.grads == {}


def test_grads_accumulate_and_zero_grad_clears(rng):
    m = npnorm.LayerNorm(4, dtype="float64")
    x, dy = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    m(x)
    m.backward(dy)
    first = {k: v.copy() for k, v in m.grads.items()}
    assert set(first) == {"weight", "bias"}
    m(x)
    m.backward(dy)
    for k in first:
        np.testing.assert_allclose(m.grads[k], 2 * first[k])
    m.zero_grad()
    assert m.grads == {}


def test_zero_grad_set_to_none_false_writes_zeros_in_place(backend, rng):
    """PyTorch's ``zero_grad(set_to_none=False)``: the held gradients become zeros in place,
    and the next backward adds into them (a ported training loop passes the keyword)."""
    m = npnorm.LayerNorm(4, xp=backend.xp)
    x, dy = (
        backend.asarray(rng.normal(size=(3, 4)), "float32"),
        backend.asarray(rng.normal(size=(3, 4)), "float32"),
    )
    m(x)
    m.backward(dy)
    held = dict(m.grads)
    first = {k: backend.numpy(v).copy() for k, v in held.items()}
    m.zero_grad(set_to_none=False)
    assert set(m.grads) == {"weight", "bias"}
    for k, v in held.items():
        assert m.grads[k] is v
        np.testing.assert_array_equal(backend.numpy(v), 0)
    m(x)
    m.backward(dy)
    for k, v in held.items():
        assert m.grads[k] is v
        np.testing.assert_array_equal(backend.numpy(v), first[k])
    m.zero_grad(set_to_none=True)
    assert m.grads == {}


def test_zero_grad_set_to_none_false_replaces_a_read_only_gradient(rng):
    """A gradient that cannot be written in place (read-only: a caller's array, a
    broadcast view) becomes a new array of zeros, not left as it was."""
    m = npnorm.LayerNorm(4)
    kept = np.ones(4, np.float32)
    kept.flags.writeable = False
    m.grads["weight"] = kept
    m.grads["bias"] = np.broadcast_to(np.float32(2), (4,))
    m.zero_grad(set_to_none=False)
    for k in ("weight", "bias"):
        np.testing.assert_array_equal(m.grads[k], np.zeros(4, np.float32), err_msg=k)
        assert m.grads[k].dtype == np.float32 and m.grads[k].flags.writeable, k
    np.testing.assert_array_equal(kept, 1)  # the caller's array untouched


def test_parameters_train_eval():
    m = npnorm.LayerNorm(3, bias=False)
    assert list(m.parameters()) == ["weight"] and m.bias is None
    assert m.training
    assert m.eval() is m and not m.training
    assert m.train() is m and m.training
    assert npnorm.LayerNorm(3, elementwise_affine=False).parameters() == {}


@pytest.mark.parametrize("mode", ["eval", 0, 1, None, np.bool_(True)])
def test_train_takes_only_a_bool(mode):
    """train("eval") would train: PyTorch raises ValueError, and so does npnorm."""
    m = npnorm.BatchNorm1d(3).eval()
    with pytest.raises(ValueError, match="bool"):
        m.train(mode)
    assert not m.training


def test_numpy_integers_and_floats_configure_a_layer_as_in_torch():
    """NumPy's integer and float scalars are accepted where PyTorch accepts them, stored as
    Python numbers."""
    bn = npnorm.BatchNorm1d(np.int64(4), momentum=np.float32(0.5))
    assert type(bn.num_features) is int and bn.num_features == 4 and bn.momentum == 0.5
    inn = npnorm.InstanceNorm2d(np.int32(3))
    assert type(inn.num_features) is int
    gn = npnorm.GroupNorm(np.int64(2), np.int64(4))
    assert (type(gn.num_groups), type(gn.num_channels)) == (int, int)
    x = np.ones((2, 4, 3), np.float32)
    y, _, _ = npnorm.functional.group_norm_forward(x, np.int64(2))
    assert y.shape == x.shape
    for bad in (2.0, "2", True):  # PyTorch raises TypeError on each
        with pytest.raises(TypeError, match="num_groups must be a positive int"):
            npnorm.GroupNorm(bad, 4)
        with pytest.raises(TypeError, match="num_groups must be a positive int"):
            npnorm.functional.group_norm(x, bad)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="num_groups must be a positive int"):
            npnorm.GroupNorm(bad, 4)
    # PyTorch: TypeError ("must be float") on the first two, and True taken as 1.0; npnorm
    # refuses a bool as a flag passed in eps's place (BatchNorm1d(4, True)), a choice
    for bad in ("1e-5", None, True):
        with pytest.raises(TypeError, match="eps must be a non-negative number"):
            npnorm.functional.layer_norm(x, 3, eps=bad)
        with pytest.raises(TypeError, match="eps must be a non-negative number"):
            npnorm.BatchNorm1d(4, eps=bad)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        npnorm.functional.layer_norm(x, 3, eps=-1.0)
    with pytest.raises(TypeError, match="momentum"):
        npnorm.BatchNorm1d(4, momentum="0.1")


@pytest.mark.parametrize("shape", [(6.5,), (6.0,), "6", ["6"], np.array([6.7]), [True]])
def test_normalized_shape_of_floats_or_strings_is_a_type_error(shape):
    """int() would read 6.5 as 6 and "66" as (6, 6); PyTorch raises TypeError."""
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints"):
        npnorm.functional.layer_norm_forward(np.ones((2, 6), np.float32), shape)
    with pytest.raises(TypeError, match="normalized_shape"):
        npnorm.RMSNorm(shape)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.nn.LayerNorm(5),
        lambda t: t.nn.LayerNorm((2, 5), bias=False),
        lambda t: t.nn.LayerNorm(5, elementwise_affine=False),
        lambda t: t.nn.RMSNorm(5),
        lambda t: t.nn.RMSNorm(5, elementwise_affine=False),
    ],
)
def test_state_dict_round_trip_with_real_torch_module(torch, make, rng):
    ref = make(torch)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    cls = getattr(npnorm, type(ref).__name__)
    kwargs = {"elementwise_affine": ref.elementwise_affine}
    if isinstance(ref, torch.nn.LayerNorm):
        kwargs["bias"] = ref.bias is not None or not ref.elementwise_affine
    ours = cls(ref.normalized_shape, **kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())  # CPU torch tensors load directly
    back = make(torch)
    back.load_state_dict({k: torch.as_tensor(v) for k, v in ours.state_dict().items()})
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.numpy())
    x = torch.randn(3, *ref.normalized_shape)
    np.testing.assert_allclose(ours(x.numpy()), ref(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_load_state_dict_accepts_lists_and_keeps_dtype():
    m = npnorm.LayerNorm(3)
    m.load_state_dict({"weight": [1.0, 2.0, 3.0], "bias": np.zeros(3)})
    assert m.weight.dtype == np.float32
    np.testing.assert_array_equal(m.weight, [1, 2, 3])


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"weight": np.ones(3)}, "missing key"),
        ({"weight": np.ones(3), "bias": np.ones(3), "extra": np.ones(1)}, "unexpected key"),
        ({"weight": np.ones(3), "bias": np.ones(4)}, "size mismatch for 'bias'"),
        ({"weight": np.full(3, 7.0), "bias": [["a"]]}, "bias"),
    ],
)
def test_load_state_dict_is_atomic(backend, rng, bad, match):
    m = npnorm.LayerNorm(3, xp=backend.xp)
    randomize(m, rng)
    m(backend.asarray(rng.normal(size=(2, 3)), "float32"))
    m.backward(backend.asarray(rng.normal(size=(2, 3)), "float32"))
    state, grads = snapshot(m)
    with pytest.raises(RuntimeError, match=match):
        m.load_state_dict(bad)
    assert_state_equal(m, state, grads)


@pytest.mark.parametrize("strict", [True, False])
def test_a_key_that_is_not_a_str_is_a_type_error_and_changes_nothing(rng, strict):
    """With strict=False the values were loaded, then the returned keys' ``prefix + k``
    raised a TypeError about str concatenation, and the next backward raised too."""
    m = npnorm.LayerNorm(3)
    randomize(m, rng)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    m(x)
    state, grads = snapshot(m)
    bad = {"weight": np.full(3, 7.0), "bias": np.zeros(3), 0: 1.0}
    with pytest.raises(TypeError, match=r"keys must be str .*got 0 \(int\)"):
        m.load_state_dict(bad, strict=strict)
    assert_state_equal(m, state, grads)
    m.backward(np.ones((2, 3), np.float32))  # the saved forward stands


def test_load_state_dict_non_strict_reports_keys():
    m = npnorm.LayerNorm(3)
    result = m.load_state_dict({"weight": np.full(3, 2.0), "other": np.ones(1)}, strict=False)
    assert result.missing_keys == ["bias"] and result.unexpected_keys == ["other"]
    np.testing.assert_array_equal(m.weight, 2.0)


def test_to_moves_parameters_grads_and_dtype(rng):
    import array_api_strict as aas

    m = npnorm.LayerNorm(3)
    m(rng.normal(size=(2, 3)).astype(np.float32))
    m.backward(np.ones((2, 3), np.float32))
    assert m.to("array_api_strict") is m
    assert isinstance(m.weight, type(aas.asarray(1.0)))
    assert isinstance(m.grads["weight"], type(aas.asarray(1.0)))
    with pytest.raises(RuntimeError):
        m.backward(aas.ones((2, 3)))  # the saved context was dropped by the move
    y = m(aas.asarray(rng.normal(size=(2, 3)), dtype=aas.float32))
    assert y.dtype == aas.float32
    m.to("numpy", dtype="float64")
    assert m.weight.dtype == np.float64 and m.grads["bias"].dtype == np.float64


def test_to_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="not installed"):
        npnorm.LayerNorm(3).to("no_such_backend_xyz")


def test_torch_style_to_arguments_say_where_they_go(torch):
    """``m.to("cuda")`` and ``m.to(torch.float64)``, as torch's ``to`` takes them: the
    errors point at device= and dtype= (they only said the backend was unknown)."""
    with pytest.raises(ValueError, match="goes in device="):
        npnorm.LayerNorm(3).to("cuda")
    with pytest.raises(TypeError, match="a dtype goes in dtype="):
        npnorm.LayerNorm(3).to(torch.float64)


# every layer in a few configurations, as npnorm(...) and torch.nn(...) build it
TORCH_TWINS = [
    lambda m: m.LayerNorm(4),
    lambda m: m.LayerNorm((2, 4), eps=1e-12, bias=False),
    lambda m: m.LayerNorm(4, elementwise_affine=False),
    lambda m: m.RMSNorm(4),
    lambda m: m.RMSNorm(4, eps=1e-6, elementwise_affine=False),
    lambda m: m.GroupNorm(2, 4),
    lambda m: m.GroupNorm(2, 4, affine=False),
    lambda m: m.GroupNorm(2, 4, bias=False),
    lambda m: m.BatchNorm1d(4),
    lambda m: m.BatchNorm2d(4, momentum=None, affine=False),
    lambda m: m.BatchNorm3d(4, bias=False, track_running_stats=False),
    lambda m: m.InstanceNorm1d(4),
    lambda m: m.InstanceNorm2d(4, affine=True, track_running_stats=True),
    lambda m: m.InstanceNorm3d(4, affine=True, bias=False),
    lambda m: m.SyncBatchNorm(4),
]


def test_repr():
    assert repr(npnorm.LayerNorm(4)) == "LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)"


@pytest.mark.parametrize("make", TORCH_TWINS)
def test_repr_is_torchs(torch, make):
    """PyTorch 2.13 prints ``bias=`` on every layer but RMSNorm (npnorm printed it
    only for ``bias=False`` with affine, and never on LayerNorm)."""
    assert repr(make(npnorm)) == repr(make(torch.nn))


@pytest.mark.parametrize("name", [p.npnorm_class.__name__ for p in npnorm.convert.PAIRS])
def test_constructor_takes_torchs_positional_arguments(torch, name):
    """torch's positional arguments, device and dtype included, in torch's order and
    with its defaults (a ported ``LayerNorm(d, eps, True, True, None, None)`` or
    ``**factory_kwargs`` call works); SyncBatchNorm's ``process_group`` is ``comm``."""
    ours = inspect.signature(getattr(npnorm, name)).parameters.values()
    theirs = inspect.signature(getattr(torch.nn, name)).parameters.values()
    positional = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
    ours_pos = [(p.name, p.default) for p in ours if p.kind in positional]
    theirs_pos = [(p.name, p.default) for p in theirs if p.kind in positional]
    assert ours_pos == [("comm" if n == "process_group" else n, d) for n, d in theirs_pos]
    theirs_kw = {p.name: p.default for p in theirs if p.kind == inspect.Parameter.KEYWORD_ONLY}
    assert theirs_kw.items() <= {p.name: p.default for p in ours}.items()


def test_factory_kwargs_and_torch_dtypes(torch):
    """torch's ``factory_kwargs``: ``device=None`` or "cpu" on NumPy, and a torch dtype
    naming the dtype of the same name on any backend."""
    ln = npnorm.LayerNorm(8, 1e-12, True, True, None, torch.float64)
    assert ln.weight.dtype == np.float64 and isinstance(ln.weight, np.ndarray)
    gn = npnorm.GroupNorm(2, 4, device="cpu", dtype=torch.float16)
    assert gn.weight.dtype == np.float16
    bn = npnorm.BatchNorm1d(3).to(dtype=torch.float64)
    assert bn.running_var.dtype == np.float64 and bn.num_batches_tracked.dtype == np.int64
    with pytest.raises(TypeError, match="dtype must be one of"):
        npnorm.BatchNorm1d(3, dtype=torch.int64)


RESETS = [
    (m, r) for m in TORCH_TWINS for r in ("reset_parameters", "reset_running_stats") if hasattr(m(npnorm), r)
]


def _twins_and_input(torch, make, rng):
    """The npnorm and torch layers of ``make``, and a float32 input of a shape they take."""
    ours, ref = make(npnorm), make(torch.nn)
    name = type(ref).__name__
    if name in ("LayerNorm", "RMSNorm"):
        shape = (3, *ref.normalized_shape)
    else:
        shape = {"2d": (3, 4, 3, 3), "3d": (3, 4, 2, 2, 2)}.get(name[-2:], (3, 4, 5))
    return ours, ref, shape, rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("make,reset", RESETS)
def test_a_reset_between_forward_and_backward_raises_where_torchs_does(torch, make, reset, rng):
    """A reset writes in place: where torch's backward keeps the array it overwrote, torch
    raises, and so does npnorm (on NumPy the backward used the reset weight: a wrong dx)."""
    ours, ref, shape, x = _twins_and_input(torch, make, rng)
    y = ref(torch.tensor(x, requires_grad=True))
    getattr(ref, reset)()
    try:
        y.backward(torch.ones_like(y))
        torch_raised = False
    except RuntimeError:
        torch_raised = True
    ours(x)
    getattr(ours, reset)()
    if torch_raised:
        # the method called is named (reset_parameters calls reset_running_stats first, as
        # torch's does: the message named only that one, which the user never called)
        named = rf"overwritten in place by {reset} since"
        with pytest.raises(RuntimeError, match=named):
            ours.backward(np.ones(shape, np.float32))
    else:
        ours.backward(np.ones(shape, np.float32))


@pytest.mark.parametrize("make,reset", RESETS)
def test_a_reset_of_arrays_assigned_after_the_forward_is_as_torchs(torch, make, reset, rng):
    """Every parameter and buffer reassigned after the forward, then reset in place: the
    arrays the forward used were never touched, and torch's backward (which keeps the old
    ones) runs; npnorm raised "overwritten in place", by name alone. The gradient is the
    forward's, as torch's."""
    ours, ref, shape, x = _twins_and_input(torch, make, rng)
    xt = torch.tensor(x, requires_grad=True)
    y = ref(xt)
    for k, v in [*ref.named_parameters(), *ref.named_buffers()]:
        if v.is_floating_point():
            setattr(ref, k, torch.nn.Parameter(v.detach() + 1) if k in ("weight", "bias") else v + 1)
    getattr(ref, reset)()
    y.backward(torch.ones_like(y))  # (torch raises nothing)
    ours(x)
    for k, v in {**ours.parameters(), **ours.buffers()}.items():
        if v.dtype.kind == "f":
            setattr(ours, k, v + 1)
    getattr(ours, reset)()
    dx = ours.backward(np.ones(shape, np.float32))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("xp", ["numpy", "array_api_strict"])
def test_a_reset_through_views_of_the_arrays_the_forward_used_still_raises(xp, rng):
    """Reassigned to views of themselves, then reset: the forward's arrays change, and
    backward raises, as torch's (its views share the change counter). On array_api_strict,
    where npnorm cannot see a view, by name: a first version of the reassignment rule let
    the backward run there on the reset values (dx 6.65 off)."""
    ns = pytest.importorskip(xp)
    m = npnorm.LayerNorm(5, xp=xp)
    m.load_state_dict({"weight": np.full(5, 2, np.float32), "bias": np.full(5, 0.5, np.float32)})
    m(ns.asarray(rng.normal(size=(3, 5)).astype(np.float32)))
    m.weight, m.bias = m.weight[:], m.bias[:]
    m.reset_parameters()
    with pytest.raises(RuntimeError, match="overwritten in place by reset_parameters"):
        m.backward(ns.ones((3, 5), dtype=ns.float32))


def test_a_torch_device_naming_the_cpu_is_numpys_cpu(torch):
    """``torch.device("cpu")`` (a ported ``factory_kwargs``, or ``from_torch(m,
    device=m.weight.device)``) names NumPy's one device."""
    m = npnorm.BatchNorm1d(3, device=torch.device("cpu"))
    assert isinstance(m.running_mean, np.ndarray)
    ref = torch.nn.LayerNorm(3)
    assert isinstance(npnorm.from_torch(ref, device=ref.weight.device).weight, np.ndarray)
    ln = npnorm.LayerNorm(3)
    w = ln.weight
    assert ln.to(device=torch.device("cpu")).weight is w  # (to() refused what the constructor took)
    for cpu0 in ("cpu:0", torch.device("cpu", 0)):  # index 0 of torch's cpu: the same (refused)
        torch.nn.LayerNorm(3, device=cpu0)
        assert isinstance(npnorm.BatchNorm1d(3, device=cpu0).running_mean, np.ndarray)
        assert ln.to(device=cpu0).weight is w
    with pytest.raises(ValueError, match="not a device of backend numpy"):
        npnorm.LayerNorm(3, device="cpu:1")


def test_reset_parameters_calls_reset_running_stats(torch):
    """As torch's: a subclass that overrides reset_running_stats sees reset_parameters
    call it."""
    calls = []

    class Counted(npnorm.BatchNorm1d):
        def reset_running_stats(self):
            calls.append("reset_running_stats")
            super().reset_running_stats()

    Counted(3).reset_parameters()
    assert calls == ["reset_running_stats"]


def test_a_dtype_is_read_by_name_only_from_a_library_dtype(torch):
    """Another library's dtype names the dtype of the same name; an object that merely
    prints like one (an enum member, a config value) is refused."""
    import enum

    class Precision(enum.Enum):
        float32 = "half, please"

    with pytest.raises(TypeError, match="dtype must be one of"):
        npnorm.LayerNorm(3, dtype=Precision.float32)
    aas = pytest.importorskip("array_api_strict")
    assert npnorm.LayerNorm(3, dtype=aas.float64).weight.dtype == np.float64  # (it warned)
    assert npnorm.LayerNorm(3, dtype=torch.float16).weight.dtype == np.float16


def test_to_a_device_leaves_plain_arrays(torch):
    """A torch weight that requires grad, moved to another device, is a plain leaf tensor,
    as a cast leaves it (it kept the move's autograd history)."""
    m = npnorm.LayerNorm(3, xp="torch")
    m.weight.requires_grad_(True)
    m.to(device="meta")
    assert m.weight.device.type == "meta" and m.weight.is_leaf and m.weight.grad_fn is None


def test_xp_that_is_no_array_library_is_a_clear_error():
    with pytest.raises(ValueError, match="xp='json' is not an array backend"):
        npnorm.LayerNorm(3).to("json")
    # a module that is no package, and one made at run time: looking for a hint
    # ("did you mean 'jax.numpy'?") raised ModuleNotFoundError from find_spec instead
    with pytest.raises(ValueError, match=r"xp='math' is not an array backend \(.*\)$"):
        npnorm.LayerNorm(3, xp="math")
    with pytest.raises(ValueError, match="xp='mine' is not an array backend"):
        npnorm.LayerNorm(3, xp=types.ModuleType("mine"))


@pytest.mark.parametrize(
    "name,dtype", [("float64", "float64"), ("float16", "float16"), ("double", "float64"), ("half", "float16")]
)
def test_to_a_dtype_name_says_it_goes_in_dtype(name, dtype):
    # m.to("float64") (torch's m.to(dtype) habit) said the backend 'float64' is not installed
    m = npnorm.LayerNorm(3)
    w = m.weight
    hint = rf"xp='{name}' names a dtype.*dtypes go in dtype= \(m.to\(dtype='{dtype}'\)"
    with pytest.raises(ValueError, match=hint):
        m.to(name)
    assert m.weight is w
    assert m.to(dtype=dtype).weight.dtype == np.dtype(dtype)  # the call it suggests works
    with pytest.raises(ValueError, match="a module's dtype is float16, float32 or float64"):
        m.to("bfloat16")


@pytest.mark.parametrize("device", ["cuda", "gpu:0", 0])
def test_a_device_numpy_lacks_is_a_clear_error(device):
    with pytest.raises(ValueError, match=r"not a device of backend numpy.*xp= chooses the backend"):
        npnorm.BatchNorm2d(3, device=device)
    m = npnorm.LayerNorm(3)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    w = m.weight
    with pytest.raises(ValueError, match="not a device of backend numpy"):
        m.to(device=device)
    assert m.weight is w and all(np.array_equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("make", TORCH_TWINS)
def test_reset_parameters_is_torchs(torch, make, rng):
    """``reset_parameters``: running statistics reset (where tracked), weight ones and
    bias zeros, in place (a state_dict taken before sees it), as torch's."""
    ours, ref = make(npnorm), make(torch.nn)
    ours.load_state_dict(
        {
            k: rng.normal(size=v.shape).astype(np.float32) if v.is_floating_point() else v.numpy() + 5
            for k, v in ref.state_dict().items()
        }
    )
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in ours.state_dict().items()})
    held = ours.state_dict()
    ours.reset_parameters()
    ref.reset_parameters()
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(held[k], v.numpy(), err_msg=k)
        assert held[k] is getattr(ours, k)


@pytest.mark.parametrize("source", ["torch", "numpy"])
def test_load_state_dict_copies_never_aliases(torch, source):
    """Loading from CPU torch tensors or NumPy arrays of the module's dtype must copy:
    a later in-place change on either side must not reach the other (PyTorch copies)."""
    ref = torch.nn.BatchNorm2d(3)
    ref.train()
    ref(torch.randn(4, 3, 2, 2))  # non-trivial running stats and counter
    state = ref.state_dict() if source == "torch" else {k: v.numpy() for k, v in ref.state_dict().items()}
    ours = npnorm.BatchNorm2d(3)
    ours.load_state_dict(state)
    for k, v in ref.state_dict().items():
        assert not np.shares_memory(getattr(ours, k), v.numpy()), k
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ours.weight += 1.0  # in place on the npnorm side
    ref(torch.randn(4, 3, 2, 2))  # a torch training step moves torch's buffers in place
    assert torch.equal(ref.weight.detach(), before["weight"])
    np.testing.assert_array_equal(ours.running_mean, before["running_mean"].numpy())


NOT_ARRAYS = {
    "None": (None, "input: expected an array"),  # IndexError from an empty backend lookup
    "list": ([[1.0, 2.0], [3.0, 4.0]], "input: expected an array (numpy, cupy or another Array API"),
    "masked": (np.ma.masked_array(np.ones((2, 2)), mask=[[0, 1], [0, 0]]), "masked arrays are not supported"),
}
LAYERS_2 = [
    lambda: npnorm.LayerNorm(2, elementwise_affine=False),
    lambda: npnorm.RMSNorm(2),
    lambda: npnorm.BatchNorm1d(2, affine=False, track_running_stats=False),
    lambda: npnorm.GroupNorm(1, 2),
    lambda: npnorm.InstanceNorm1d(2),
]


@pytest.mark.parametrize("make", LAYERS_2)
@pytest.mark.parametrize("what", list(NOT_ARRAYS))
def test_an_input_that_is_not_an_array_is_a_type_error_naming_it(make, what):
    # every kernel family would treat a masked array its own way (the reference kept the
    # mask, the numpy kernels ignored it, numba raised NumbaTypeError)
    value, message = NOT_ARRAYS[what]
    m = make()
    with pytest.raises(TypeError, match=re.escape(message)):
        m(value)


def test_a_missing_backward_argument_is_a_type_error_naming_it():
    x = np.ones((2, 3))
    _, mean, rstd = npnorm.functional.layer_norm_forward(x, 3)
    for args, name in (
        ((None, x, 3, mean, rstd), "grad_output"),
        ((x, x, 3, None, rstd), "mean"),
        ((x, x, 3, mean, None), "rstd"),
    ):
        with pytest.raises(TypeError, match=f"^{name}: expected an array"):
            npnorm.functional.layer_norm_backward(*args)


class _Scale(npnorm.Module):
    """A user's layer whose ``_forward``/``_backward`` return what ``returns`` says."""

    _parameter_names = ("g",)

    def __init__(self, forward_returns, backward_returns):
        super().__init__(dtype="float64")
        self.g = np.asarray(2.0)
        self.forward_returns, self.backward_returns = forward_returns, backward_returns

    def _forward(self, x):
        return self.forward_returns(x * self.g, (x, self.g))

    def _backward(self, dy, saved):
        x, g = saved
        return self.backward_returns(dy * g, np.sum(dy * x))


@pytest.mark.parametrize(
    "forward_returns, backward_returns, match",
    [
        (lambda y, s: (y, s), None, r"_Scale\._forward must return \(output, saved, updates\).*a tuple of 2"),
        (lambda y, s: y, None, r"_Scale\._forward must return .*got ndarray"),
        (
            lambda y, s: (y, s, None),
            None,
            r"_forward must return .*got a tuple of 3 item\(s\) \(.*NoneType\)",
        ),
        (lambda y, s: (y, s, {}), lambda dx, dg: dx, r"_Scale\._backward must return \(grad_input, grads\)"),
        (lambda y, s: (y, s, {}), lambda dx, dg: (dx, (dg,)), r"_backward must return .*tuple of 2"),
        (
            lambda y, s: (y, s, {}),
            lambda dx, dg: (dx, {"gg": dg}),
            r"gradients for 'gg', which is not a param",
        ),
    ],
)
def test_a_users_layer_that_breaks_the_contract_is_told_what_to_return(
    forward_returns, backward_returns, match
):
    """What ``_forward`` and ``_backward`` must return, said where a user's layer returns
    something else (these were unpacking errors, AttributeError on ``.items``, or a
    missing gradient where a key was misspelt); nothing is changed."""
    m = _Scale(forward_returns, backward_returns)
    x = np.arange(6.0).reshape(2, 3)
    with pytest.raises(TypeError, match=match):
        m(x)
        m.backward(np.ones_like(x))
    assert m.grads == {} and float(m.g) == 2.0


class _ScaleWithBuffers(npnorm.Module):
    """y = x * w over the last axis, with a step counter of int32 and a bool flag."""

    _parameter_names = ("w",)
    _buffer_names = ("steps", "seen")

    def __init__(self, d=4, grad=None, updates=None, **kw):
        super().__init__(**kw)
        self.w = self.xp.ones(d, dtype=self.dtype)
        self.steps = self.xp.asarray(np.zeros(2, np.int32))
        self.seen = self.xp.asarray(np.zeros(2, bool))
        self.grad, self.updates = grad, updates

    def _forward(self, x):
        return x * self.w, (x, self.w), (self.updates(self) if self.updates else {})

    def _backward(self, dy, saved):
        x, w = saved
        return dy * w, {"w": self.grad(dy, x) if self.grad else (dy * x).sum(0)}


@pytest.mark.parametrize(
    "grad,error,match",
    [
        (lambda dy, x: dy * x, ValueError, r"gradient for 'w' has shape \(3, 4\), the parameter \(4,\)"),
        (lambda dy, x: np.sum(dy * x), ValueError, r"has shape \(\), the parameter \(4,\)"),
        (lambda dy, x: np.ones(4, bool), TypeError, "has dtype bool, not a floating one"),
        (lambda dy, x: np.ones(4, np.int64), TypeError, "has dtype int64"),
        (lambda dy, x: [1.0] * 4, TypeError, "is a list, not an array"),
    ],
)
def test_a_parameter_gradient_of_another_shape_or_kind_is_refused(rng, grad, error, match):
    """_backward's gradients went into grads as they came: a (3, 4) gradient of a (4,)
    weight grew the accumulated one, a bool one stayed bool. Nothing is accumulated."""
    m = _ScaleWithBuffers(grad=grad, dtype="float32")
    m(rng.normal(size=(3, 4)).astype(np.float32))
    with pytest.raises(error, match=match):
        m.backward(np.ones((3, 4), np.float32))
    assert m.grads == {}


def test_a_parameter_gradient_of_another_backend_is_refused(torch, rng):
    m = _ScaleWithBuffers(grad=lambda dy, x: np.ones(4, np.float32), xp="torch")
    m(torch.ones(3, 4))
    with pytest.raises(TypeError, match="of another backend than the parameter"):
        m.backward(torch.ones(3, 4))
    assert m.grads == {}


@pytest.mark.parametrize(
    "updates,error,match",
    [
        (
            lambda m: {"steps": m.steps + 1, "nope": m.steps},
            TypeError,
            r"update for 'nope', which is not a buffer",
        ),
        (lambda m: {"w": m.w * 0}, TypeError, r"update for 'w', which is not a buffer"),
        (
            lambda m: {"steps": np.zeros(3, np.int32)},
            ValueError,
            r"update of 'steps' has shape \(3,\), the buffer \(2,\)",
        ),
    ],
)
def test_a_forward_update_that_is_not_a_buffer_of_its_shape_changes_nothing(rng, updates, error, match):
    """An unknown name was written after the valid ones (a bare AttributeError, the
    buffer already changed), and a parameter named there was overwritten."""
    m = _ScaleWithBuffers(updates=updates, dtype="float32")
    state, grads = snapshot(m)
    with pytest.raises(error, match=match):
        m(rng.normal(size=(3, 4)).astype(np.float32))
    assert_state_equal(m, state, grads)


def test_to_keeps_int_and_bool_buffers_as_torch_does(torch):
    """An int32 buffer became int64 at every to(), even one that changes nothing (a new
    array: a state_dict taken before lost it), and a bool one raised 'unsupported dtype'."""
    m = _ScaleWithBuffers(dtype="float32")
    steps = m.steps
    assert m.to() is m and m.steps is steps
    m.to(dtype="float64")
    assert m.steps is steps and m.seen.dtype == np.bool_ and m.w.dtype == np.float64
    m.to("torch")
    assert (m.steps.dtype, m.seen.dtype, m.w.dtype) == (torch.int32, torch.bool, torch.float64)
    ref = torch.nn.Module()
    ref.register_buffer("steps", torch.zeros(2, dtype=torch.int32))
    ref.register_buffer("seen", torch.zeros(2, dtype=torch.bool))
    ref.to(torch.float16)
    assert (ref.steps.dtype, ref.seen.dtype) == (torch.int32, torch.bool)  # torch keeps them too
    m.to("numpy")
    assert (m.steps.dtype, m.seen.dtype) == (np.int32, np.bool_)


def test_a_load_into_a_parameter_the_forward_saved_a_view_of_makes_backward_raise():
    """Overwrites were found only for arrays saved as themselves: a layer of your own
    that saved ``w.reshape(1, -1)`` then differentiated the loaded weight, silently, on
    NumPy (torch raises, from the view's version counter)."""

    class ViewSaver(npnorm.Module):
        _parameter_names = ("w",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.w = np.ones(4)

        def _forward(self, x):
            w = self.w.reshape(1, 4)
            return x * w, (w,), {}

        def _backward(self, dy, saved):
            return dy * saved[0], {"w": dy.sum(0)}

    m = ViewSaver()
    m(np.ones((2, 4)))
    m.load_state_dict({"w": np.full(4, 5.0)})
    with pytest.raises(RuntimeError, match="the w that the last forward used was overwritten in place"):
        m.backward(np.ones((2, 4)))
    m(np.ones((2, 4)))
    np.testing.assert_array_equal(m.backward(np.ones((2, 4))), 5.0)  # a forward again: the new w


def test_a_layer_that_skips_super_init_or_lists_a_string_is_told_so():
    class NoInit(npnorm.Module):
        def __init__(self):
            self.w = np.ones(3)

        def _forward(self, x):
            return x * self.w, (), {}

    with pytest.raises(TypeError, match=r"NoInit.__init__ did not call super\(\).__init__"):
        NoInit()(np.ones(3))  # the forward ran; backward, zero_grad and to() failed later
    with pytest.raises(TypeError, match=r"Letters._parameter_names must be a tuple of names, got 'weight'"):

        class Letters(npnorm.Module):
            _parameter_names = "weight"  # ("weight"), the comma forgotten


def test_an_int64_buffer_moves_through_jax_without_x64_and_back_quietly():
    """to() asked JAX (without x64) for int64, which warns and gives int32; the widest
    int goes to the backend's counter dtype, and comes back int64."""
    pytest.importorskip("jax")
    m = _ScaleWithBuffers(dtype="float32")
    m.steps = np.arange(2, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.to("jax.numpy")
        m.to("numpy")
    assert m.steps.dtype == np.int64 and m.seen.dtype == np.bool_


def test_a_load_into_another_parameter_of_the_same_buffer_is_no_overwrite():
    """Parameters that are interleaved views of one buffer (w = buf[::2], b = buf[1::2]):
    a load into b does not touch the w the forward saved (memory bounds alone said it did)."""
    buf = np.ones(8)

    class Interleaved(npnorm.Module):
        _parameter_names = ("w", "b")

        def __init__(self):
            super().__init__(dtype="float64")
            self.w, self.b = buf[::2], buf[1::2]

        def _forward(self, x):
            return x * self.w + self.b, (self.w,), {}

        def _backward(self, dy, saved):
            return dy * saved[0], {"w": dy.sum(0), "b": dy.sum(0)}

    m = Interleaved()
    m(np.ones((2, 4)))
    m.load_state_dict({"b": np.full(4, 3.0)}, strict=False)
    np.testing.assert_array_equal(m.backward(np.ones((2, 4))), 1.0)


class _Ema(npnorm.Module):
    """y = x, with an exponential moving average of the batch mean as a buffer (float) and
    a call counter (int32): ``update(m, x)`` gives the forward's updates."""

    _buffer_names = ("ema", "calls")

    def __init__(self, update, **kw):
        super().__init__(**kw)
        self.ema = self.xp.zeros(3, dtype=self.dtype)
        self.calls = self.xp.asarray(np.zeros((), np.int32))
        self.update = update

    def _forward(self, x):
        return x, (), self.update(self, x)

    def _backward(self, dy, saved):
        return dy, {}


@pytest.mark.parametrize(
    "update,ema,calls",
    [
        (lambda m, x: {"ema": 0.9 * m.ema + 0.1 * x.mean(0)}, None, 0),  # float64 x: a float64 update
        (lambda m, x: {"ema": np.full(3, 3, np.int64), "calls": m.calls + np.int64(1)}, 3.0, 1),
        (lambda m, x: {"calls": 5, "ema": np.float64(2.0) * np.ones(3, np.float16)}, 2.0, 5),
        (lambda m, x: {"calls": np.int64(7)}, 0.0, 7),  # a NumPy scalar
    ],
)
def test_a_forward_update_keeps_its_buffers_dtype_in_place(rng, update, ema, calls):
    """An update in another dtype replaced the buffer by a new array of that dtype (a
    float32 buffer became float64, and a state_dict taken before stopped seeing updates);
    it is cast into the buffer, as PyTorch's in-place updates keep a buffer's dtype."""
    m = _Ema(update, dtype="float32")
    held = m.state_dict()
    x = rng.normal(size=(4, 3))
    m(x)
    assert (m.ema.dtype, m.calls.dtype) == (np.float32, np.int32)
    assert m.ema is held["ema"] and m.calls is held["calls"]
    want = (0.1 * x.mean(0)).astype(np.float32) if ema is None else np.full(3, ema, np.float32)
    np.testing.assert_array_equal(m.ema, want)
    assert int(m.calls) == calls


@pytest.mark.parametrize(
    "update,match",
    [
        (lambda m, x: {"ema": None}, r"update of 'ema' is not an array \(got NoneType\)"),
        (lambda m, x: {"ema": [0.0, 0.0, 0.0]}, r"update of 'ema' is not an array \(got list\)"),
        (lambda m, x: {"calls": m.calls + 0.5}, r"update of 'calls' has dtype float64, the buffer int32"),
        (lambda m, x: {"calls": 2.0}, r"update of 'calls' has dtype float64, the buffer int32"),
        (lambda m, x: {"ema": m.ema + 1j}, r"update of 'ema' has dtype complex64, the buffer float32"),
    ],
)
def test_a_forward_update_that_is_no_array_or_loses_values_changes_nothing(rng, update, match):
    """None took the buffer out of state_dict (a later load failed on an 'unexpected key'),
    a number or a list became the buffer itself, and floats went into an int buffer as a
    new float array."""
    m = _Ema(update, dtype="float32")
    state, grads = snapshot(m)
    with pytest.raises(TypeError, match=match):
        m(rng.normal(size=(4, 3)).astype(np.float32))
    assert_state_equal(m, state, grads)


def test_a_forward_update_of_another_backend_changes_nothing(torch, rng):
    m = _Ema(lambda m, x: {"ema": torch.zeros(3)}, dtype="float32")
    state, grads = snapshot(m)
    with pytest.raises(
        TypeError, match=r"update of 'ema' is of another backend than the module's \(got Tensor\)"
    ):
        m(rng.normal(size=(4, 3)).astype(np.float32))
    assert_state_equal(m, state, grads)


@pytest.mark.parametrize(
    "dy_shape,backward_returns,error,match",
    [
        (
            (4,),
            None,
            ValueError,
            r"grad_output must have the shape of the forward's output \(3, 4\), got \(4,\)",
        ),
        ((1, 4), None, ValueError, r"forward's output \(3, 4\), got \(1, 4\)"),
        ((3, 4), lambda dx: [dx], TypeError, r"returned a grad_input that is not an array \(got list\)"),
        (
            (3, 4),
            lambda dx: dx[:1],
            ValueError,
            r"grad_input of shape \(1, 4\), the forward's input \(3, 4\)",
        ),
    ],
)
def test_a_users_backward_with_a_gradient_of_another_shape_adds_nothing(
    rng, dy_shape, backward_returns, error, match
):
    """Module.backward checked the parameters' gradients only: a grad_output of (4,) for a
    (3, 4) output was broadcast by a layer of your own and a wrong gradient added into
    grads (PyTorch: "Mismatch in shape"), and a grad_input of None or of another shape
    was returned as it was."""

    class Layer(_ScaleWithBuffers):
        def _backward(self, dy, saved):
            dx, grads = super()._backward(dy, saved)
            return (dx if backward_returns is None else backward_returns(dx)), grads

    m = Layer(dtype="float32")
    m(rng.normal(size=(3, 4)).astype(np.float32))
    with pytest.raises(error, match=match):
        m.backward(np.ones(dy_shape, np.float32))
    assert m.grads == {}


def test_a_users_grad_input_in_another_float_dtype_is_cast_to_the_inputs(rng):
    """As PyTorch's autograd casts a Function's gradient to its input's dtype."""

    class Wide(_ScaleWithBuffers):
        def _backward(self, dy, saved):
            dx, grads = super()._backward(dy, saved)
            return dx.astype(np.float64), grads

    m = Wide(dtype="float32")
    x = rng.normal(size=(3, 4)).astype(np.float16)
    m(x)
    assert m.backward(np.ones((3, 4), np.float16)).dtype == np.float16


def test_a_layer_that_lists_a_name_it_never_sets_or_twice_is_told_so():
    """A name in _parameter_names never set gave a bare AttributeError from state_dict,
    parameters() and gradcheck (the forward worked); a name listed twice (a parameter and
    a buffer) became one state_dict key."""

    class Forgot(npnorm.Module):
        _parameter_names = ("w", "b")

        def __init__(self):
            super().__init__(dtype="float64")
            self.w = np.ones(3)

    for call in (lambda m: m.state_dict(), lambda m: m.parameters(), lambda m: m.to(dtype="float32")):
        with pytest.raises(
            AttributeError, match=r"Forgot lists 'b' in _parameter_names but never set self\.b"
        ):
            call(Forgot())
    with pytest.raises(TypeError, match=r"Twice: 'w' named more than once among its _parameter_names"):

        class Twice(npnorm.Module):
            _parameter_names = ("w",)
            _buffer_names = ("w",)


def test_a_layer_without_forward_or_backward_says_which():
    class Neither(npnorm.Module):
        pass

    with pytest.raises(NotImplementedError, match=r"Neither does not implement _forward\(input\)"):
        Neither()(np.ones(3))

    class NoBackward(npnorm.Module):
        def _forward(self, x):
            return x, (), {}

    m = NoBackward()
    m(np.ones(3))
    with pytest.raises(
        NotImplementedError, match=r"NoBackward does not implement _backward\(grad_output, saved\)"
    ):
        m.backward(np.ones(3))


def test_an_overwrite_of_two_saved_arrays_says_were():
    m = npnorm.LayerNorm(3)
    m(np.ones((2, 3), np.float32))
    m.load_state_dict({"weight": np.full(3, 2.0), "bias": np.ones(3)})
    with pytest.raises(
        RuntimeError, match="the weight, bias that the last forward used were overwritten in place"
    ):
        m.backward(np.ones((2, 3), np.float32))


def test_a_users_backward_may_give_no_input_gradient():
    """As a PyTorch backward returns None for an input that takes no gradient (an
    embedding's integer indices): the check of grad_input refused None."""

    class Embedding(npnorm.Module):
        _parameter_names = ("table",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.table = np.arange(12.0).reshape(4, 3)

        def _forward(self, ids):
            return self.table[ids], (ids,), {}

        def _backward(self, dy, saved):
            (ids,) = saved
            dtable = np.zeros_like(self.table)
            np.add.at(dtable, ids, dy)
            return None, {"table": dtable}

    m = Embedding()
    ids = np.array([0, 2, 2])
    m(ids)
    assert m.backward(np.ones((3, 3))) is None
    np.testing.assert_array_equal(m.grads["table"], [[1.0] * 3, [0.0] * 3, [2.0] * 3, [0.0] * 3])


def test_a_users_grad_input_of_another_library_is_passed_on_as_before(torch):
    """Its dtype was compared with the input's across libraries (an AttributeError from
    NumPy's isdtype on a torch dtype); it is passed on as it is, as before the check."""

    class TorchGrad(_ScaleWithBuffers):
        def _backward(self, dy, saved):
            dx, grads = super()._backward(dy, saved)
            return torch.from_numpy(np.asarray(dx, np.float64)), grads

    m = TorchGrad(dtype="float32")
    m(np.ones((3, 4), np.float32))
    assert m.backward(np.ones((3, 4), np.float32)).dtype == torch.float64


def test_a_users_grad_input_that_is_a_numpy_scalar_is_taken():
    """0-d NumPy arithmetic gives a NumPy scalar: the class docstring's Scale layer (here
    _Scale, returning what the contract asks) failed the grad_input check on a 0-d input."""

    def scale():
        return _Scale(lambda y, s: (y, s, {}), lambda dx, dg: (dx, {"g": dg}))

    m = scale()
    m(np.asarray(3.0))
    dx = m.backward(np.asarray(1.0))
    assert isinstance(dx, np.ndarray) and dx.shape == () and float(dx) == 2.0
    assert npnorm.gradcheck(scale(), np.asarray(3.0))


def test_a_buffer_held_as_a_python_number_takes_an_update():
    """The shortcut for updates of the buffer's own type read a Python int's dtype."""

    class Counter(npnorm.Module):
        _buffer_names = ("calls",)

        def __init__(self):
            super().__init__()
            self.calls = 0

        def _forward(self, x):
            return x, (), {"calls": self.calls + 1}

        def _backward(self, dy, saved):
            return dy, {}

    m = Counter()
    m(np.ones(2, np.float32))
    assert isinstance(m.calls, np.ndarray) and int(m.calls) == 1


def test_a_users_grad_input_for_a_memmap_input_is_cast_to_its_dtype(tmp_path):
    """The cast to the input's dtype was skipped where the input's class was a subclass
    (a memmap, a torch Parameter): it took them for another library's."""

    class Wide(_ScaleWithBuffers):
        def _backward(self, dy, saved):
            dx, grads = super()._backward(dy, saved)
            return dx.astype(np.float64), grads

    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(3, 4))
    x[...] = 1.0
    m = Wide(dtype="float32")
    m(x)
    assert m.backward(np.ones((3, 4), np.float32)).dtype == np.float32


def test_a_buffer_update_on_another_device_is_moved_there_before_any_write():
    """An update on another device failed in the write, after the updates before it had
    been written (a forward that raises must change nothing); it is moved onto the buffer's
    device, as PyTorch's copy_ writes across devices."""
    xs = pytest.importorskip("array_api_strict")
    elsewhere = xs.Device("device1")

    class TwoBuffers(npnorm.Module):
        _buffer_names = ("a", "b")

        def __init__(self):
            super().__init__(xp="array_api_strict")
            self.a = xs.zeros(3, dtype=xs.float32)
            self.b = xs.zeros(3, dtype=xs.float32)

        def _forward(self, x):
            return x, (), {"a": self.a + 1, "b": xs.ones(3, dtype=xs.float32, device=elsewhere)}

        def _backward(self, dy, saved):
            return dy, {}

    m = TwoBuffers()
    a, b = m.a, m.b
    m(xs.ones(3, dtype=xs.float32))
    assert m.a is a and m.b is b and m.b.device == a.device  # written in place, on their device
    np.testing.assert_array_equal(np.asarray(m.b), 1.0)


class _OwnContext(npnorm.Module):
    """A layer that lists its own _forward_context, written before the base's had _saved_io."""

    _forward_context = ("_saved", "_saved_versions")

    def _forward(self, x):
        return x, (x,), {}

    def _backward(self, dy, saved):
        return dy, {}


def test_a_layer_whose_own_forward_context_predates_saved_io_pickles():
    """Such a layer kept the saved forward's namespace module in its pickle, which pickle
    refuses."""
    import copy
    import pickle

    m = _OwnContext()
    m(np.ones(3))
    assert pickle.loads(pickle.dumps(m))._saved is None
    assert copy.deepcopy(m)._saved is None


def test_an_ml_dtypes_input_of_a_users_layer_passes_its_gradient_on():
    """The input dtype's kind was asked of NumPy, which does not know ml_dtypes' bfloat16:
    NumPy's TypeError came out of backward."""
    ml_dtypes = pytest.importorskip("ml_dtypes")

    class Identity(npnorm.Module):
        def _forward(self, x):
            return x, (), {}

        def _backward(self, dy, saved):
            return dy.astype(np.float32), {}

    m = Identity()
    x = np.ones(3, ml_dtypes.bfloat16)
    m(x)
    assert m.backward(np.ones(3, ml_dtypes.bfloat16)).dtype == np.float32


def test_an_array_proxy_is_judged_per_instance():
    """A class whose instances forward attributes is an array only while it wraps one: the
    first such instance made _is_array say so of the class for good."""
    from npnorm.modules._module import _is_array

    class Proxy:
        def __init__(self, wrapped):
            self._wrapped = wrapped

        def __getattr__(self, name):
            return getattr(self._wrapped, name)

    assert _is_array(Proxy(np.ones(3)))
    assert not _is_array(Proxy(1.0))


def test_a_read_only_buffer_keeps_its_device_when_its_update_comes_from_another():
    """The move onto the buffer's device was skipped for buffers that are not writable
    (meant for JAX's, which are replaced): an array_api_strict buffer made from a read-only
    array left for the update's device."""
    xs = pytest.importorskip("array_api_strict")

    class ReadOnly(npnorm.Module):
        _buffer_names = ("b",)

        def __init__(self):
            super().__init__(xp="array_api_strict")
            raw = np.zeros(3, np.float32)
            raw.flags.writeable = False
            self.b = xs.asarray(raw)

        def _forward(self, x):
            return x, (), {"b": xs.ones(3, dtype=xs.float32, device=xs.Device("device1"))}

        def _backward(self, dy, saved):
            return dy, {}

    m = ReadOnly()
    device = m.b.device
    m(xs.ones(3, dtype=xs.float32))
    assert m.b.device == device
    np.testing.assert_array_equal(np.asarray(m.b), 1.0)


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_zero_grad_and_to_keep_the_grads_dict_a_caller_holds():
    """An optimizer that holds ``m.grads`` sees zero_grad's clearing and to()'s casting:
    the same dict, changed in place (a new dict left it the stale gradients)."""
    m = npnorm.LayerNorm(3)
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    m(x)
    m.backward(np.ones_like(x))
    held = m.grads
    m.to(dtype="float64")
    assert held is m.grads and held["weight"].dtype == np.float64
    m.zero_grad()
    assert held is m.grads and held == {}


class _Shift(npnorm.Module):
    """y = x + b, whose backward hands grad_output itself back as b's gradient."""

    _parameter_names = ("b",)

    def __init__(self):
        super().__init__(dtype="float64")
        self.b = np.zeros(3)

    def _forward(self, x):
        return x + self.b, (), {}

    def _backward(self, dy, saved):
        return dy, {"b": dy}


def test_a_first_gradient_is_stored_as_a_copy():
    """The first backward's gradient is kept as a copy: a layer that returns grad_output
    itself as a gradient did not see the caller's array summed into on the next backward."""
    m = _Shift()
    first = np.ones(3)
    m(np.zeros(3))
    m.backward(first)
    m(np.zeros(3))
    m.backward(np.ones(3))
    np.testing.assert_array_equal(first, 1.0)
    np.testing.assert_array_equal(m.grads["b"], 2.0)
