"""npnorm.from_torch / npnorm.to_torch: same class, arguments, dtype, state, mode; exact
round trips; torch imported lazily."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
from npnorm.convert import PAIRS

# torch module factories, each drawing its constructor arguments
eps = st.sampled_from([1e-5, 1e-12, 0.25])
momentum = st.sampled_from([0.1, 0.7, None])
flag = st.booleans()
CONFIGS = {
    "LayerNorm": st.fixed_dictionaries(
        {"normalized_shape": st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
         "eps": eps, "elementwise_affine": flag, "bias": flag}
    ),
    "RMSNorm": st.fixed_dictionaries(
        {"normalized_shape": st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple),
         "eps": st.sampled_from([None, 1e-6, 1e-12]), "elementwise_affine": flag}
    ),
    "GroupNorm": st.integers(1, 3).flatmap(
        lambda g: st.fixed_dictionaries(
            {"num_groups": st.just(g), "num_channels": st.integers(1, 2).map(lambda k: g * k),
             "eps": eps, "affine": flag, "bias": flag}
        )
    ),
    **{
        name: st.fixed_dictionaries(
            {"num_features": st.integers(1, 4), "eps": eps, "momentum": momentum, "affine": flag,
             "track_running_stats": flag, "bias": flag}
        )
        for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                     "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")
    },
}  # fmt: skip
ATTRS = ("normalized_shape", "eps", "elementwise_affine", "num_groups", "num_channels",
         "num_features", "momentum", "affine", "track_running_stats")  # fmt: skip


def _config(m) -> dict:
    out = {a: getattr(m, a) for a in ATTRS if hasattr(m, a)}
    if "normalized_shape" in out:
        out["normalized_shape"] = tuple(out["normalized_shape"])
    out["has_bias"] = getattr(m, "bias", None) is not None
    return out


def _randomize_torch(torch, ref, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*ref.named_parameters(), *ref.named_buffers()]:
            if name == "num_batches_tracked":
                t.fill_(int(torch.randint(0, 100, (), generator=gen)))
            elif name == "running_var":
                t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))


def _draw_torch_state(torch, ref, data):
    """Every parameter and buffer of ``ref`` drawn as an array of its dtype (any finite
    value: subnormals, -0.0 and the largest ones too), so that a failure shrinks."""
    with torch.no_grad():
        for name, t in [*ref.named_parameters(), *ref.named_buffers()]:
            if name == "num_batches_tracked":
                t.fill_(data.draw(st.integers(0, 2**40), label=name))
                continue
            dtype = np.dtype(str(t.dtype).removeprefix("torch."))
            finite = st.floats(allow_nan=False, allow_infinity=False, width=8 * dtype.itemsize)
            if name == "running_var":
                finite = st.floats(0, 1e4, width=8 * dtype.itemsize)
            t.copy_(
                torch.from_numpy(data.draw(hnp.arrays(dtype, tuple(t.shape), elements=finite), label=name))
            )


def test_every_public_layer_has_a_row():
    """A layer added to npnorm needs its row in npnorm.convert.PAIRS."""
    layers = {
        n for n in npnorm.__all__
        if isinstance(getattr(npnorm, n), type) and issubclass(getattr(npnorm, n), npnorm.Module)
        and getattr(npnorm, n) is not npnorm.Module
    }  # fmt: skip
    assert {p.npnorm_class.__name__ for p in PAIRS} == layers
    assert set(CONFIGS) >= layers  # and a config to test it with


@pytest.mark.parametrize("name", list(CONFIGS))
@given(
    config=st.data(),
    dtype=st.sampled_from(["float32", "float64", "float16"]),
    training=st.booleans(),
)
def test_round_trips_are_exact(torch, name, config, dtype, training):
    kwargs = config.draw(CONFIGS[name])
    ref = getattr(torch.nn, name)(**kwargs, dtype=getattr(torch, dtype))
    _draw_torch_state(torch, ref, config)
    ref.train(training)
    ours = npnorm.from_torch(ref)
    assert type(ours) is getattr(npnorm, name) and _config(ours) == _config(ref)
    assert ours.training == training
    if ref.state_dict():  # (a module without tensors has no dtype to keep)
        assert np.dtype(ours.dtype) == np.dtype(dtype)
    tstate = ref.state_dict()
    assert list(ours.state_dict()) == list(tstate)
    for k, v in ours.state_dict().items():
        assert v.dtype == tstate[k].numpy().dtype, k
        np.testing.assert_array_equal(v, tstate[k].numpy(), err_msg=k)
        assert not np.shares_memory(v, tstate[k].numpy()), k
    back = npnorm.to_torch(ours)
    assert type(back) is type(ref) and repr(back) == repr(ref) and back.training == training
    assert _config(back) == _config(ref)
    for k, v in back.state_dict().items():
        assert v.dtype == tstate[k].dtype and torch.equal(v, tstate[k]), k
    again = npnorm.from_torch(back)
    assert repr(again) == repr(ours)
    for k, v in again.state_dict().items():
        np.testing.assert_array_equal(v, ours.state_dict()[k], err_msg=k)


@pytest.mark.parametrize("name", ["LayerNorm", "BatchNorm2d", "GroupNorm", "InstanceNorm1d", "RMSNorm"])
def test_converted_module_computes_what_torch_computes(torch, rng, name):
    make = {
        "LayerNorm": (lambda: torch.nn.LayerNorm(6, eps=1e-12, dtype=torch.float64), (3, 6)),
        "RMSNorm": (lambda: torch.nn.RMSNorm(6, dtype=torch.float64), (3, 6)),
        "BatchNorm2d": (lambda: torch.nn.BatchNorm2d(3, momentum=None, dtype=torch.float64), (4, 3, 2, 2)),
        "GroupNorm": (lambda: torch.nn.GroupNorm(2, 4, dtype=torch.float64), (2, 4, 3)),
        "InstanceNorm1d": (
            lambda: torch.nn.InstanceNorm1d(3, affine=True, track_running_stats=True, dtype=torch.float64),
            (2, 3, 5),
        ),
    }
    factory, shape = make[name]
    ref = factory()
    _randomize_torch(torch, ref, 0)
    ours = npnorm.from_torch(ref)
    for _ in range(2):  # train steps, then eval: buffers move the same way
        x = rng.normal(size=shape)
        np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    ours.eval()
    ref.eval()
    x = rng.normal(size=shape)
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[k], v.numpy(), rtol=1e-12, err_msg=k)


def test_minilm_eps_and_float64_kept(torch):
    ours = npnorm.from_torch(torch.nn.LayerNorm(384, eps=1e-12, dtype=torch.float64))
    assert ours.eps == 1e-12 and ours.weight.dtype == np.float64
    assert npnorm.to_torch(ours).eps == 1e-12


def test_bfloat16_becomes_float32_exactly(torch):
    ref = torch.nn.LayerNorm(5, dtype=torch.bfloat16)
    _randomize_torch(torch, ref, 1)
    ours = npnorm.from_torch(ref)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.weight, ref.weight.detach().float().numpy())


def test_other_backends(torch, backend):
    ref = torch.nn.BatchNorm1d(3)
    _randomize_torch(torch, ref, 2)
    ours = npnorm.from_torch(ref, xp=backend.xp)
    assert ours.xp is backend.xp
    back = npnorm.to_torch(ours)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("unset", [("running_mean", "running_var"), ("num_batches_tracked",)])
@pytest.mark.parametrize("name", ["BatchNorm1d", "SyncBatchNorm"])
def test_running_statistics_set_to_none_convert_both_ways(torch, rng, name, unset):
    # torch documents this state: eval then normalizes with the batch's statistics (a counter
    # of None: to_torch's load raised "Unexpected key(s)", torch filling in a counter for a
    # state dict without a version)
    ref = getattr(torch.nn, name)(3, dtype=torch.float64).eval()
    for key in unset:
        setattr(ref, key, None)
    if "running_mean" not in unset:
        ref.running_mean += 0.5
    ours = npnorm.from_torch(ref)
    assert all(getattr(ours, key) is None for key in unset)
    x = rng.normal(size=(5, 3))
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    back = npnorm.to_torch(ours)
    assert all(getattr(back, key) is None for key in unset)
    assert back.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d", "SyncBatchNorm"])
def test_tracking_switched_off_after_construction_converts_both_ways(torch, rng, name, training):
    """A layer built with running statistics and ``track_running_stats`` set False after
    (a common torch pattern: batch statistics in eval too) keeps its buffers in both
    libraries; from_torch and to_torch refused it ("unexpected key(s)"), building the layer
    without them. Now: the same buffers, flag, repr and outputs, both ways."""
    ref = getattr(torch.nn, name)(3, track_running_stats=True, dtype=torch.float64)
    _randomize_torch(torch, ref, 5)
    ref.track_running_stats = False
    ref.train(training)
    ours = npnorm.from_torch(ref)
    assert ours.track_running_stats is False and ours.training is training and repr(ours) == repr(ref)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(getattr(ours, k), v.numpy(), err_msg=k)
    back = npnorm.to_torch(ours)
    assert back.track_running_stats is False and back.training is training and repr(back) == repr(ref)
    assert back.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = rng.normal(size=(5, 3, 4))
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)


def test_clear_errors(torch):
    with pytest.raises(TypeError, match=r"converts torch.nn.LayerNorm.*got torch.nn.modules.linear.Linear"):
        npnorm.from_torch(torch.nn.Linear(2, 2))

    class MyNorm(torch.nn.LayerNorm):
        pass

    with pytest.raises(TypeError, match="not subclasses"):
        npnorm.from_torch(MyNorm(3))
    with pytest.raises(TypeError, match=re.escape("npnorm.to_torch converts that way")):
        npnorm.from_torch(npnorm.LayerNorm(3))
    with pytest.raises(TypeError, match=re.escape("npnorm.to_torch converts npnorm's LayerNorm")):
        npnorm.to_torch(torch.nn.LayerNorm(3))
    parametrized = torch.nn.LayerNorm(3)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", torch.nn.Identity())
    with pytest.raises(TypeError, match="a layer with parametrizations: torch"):
        npnorm.from_torch(parametrized)


def test_a_module_on_the_meta_device_says_it_has_no_values(torch):
    """to_torch raised torch's bare "Cannot copy out of meta tensor; no data!"."""
    with pytest.raises(
        ValueError, match=r"weight, bias are on torch's meta device.*LayerNorm\(\.\.\., device='meta'\)"
    ):
        npnorm.to_torch(npnorm.LayerNorm(4, xp="torch", device="meta"))


def test_hooks_that_are_not_carried_over_are_warned_of(torch, rng):
    """A forward hook or pre-hook changes what a torch layer computes as much as a subclass
    (which is refused): from_torch dropped them without a word (outputs 1.7 apart)."""
    ref = torch.nn.LayerNorm(4)
    ref.register_forward_pre_hook(lambda mod, inp: (inp[0] + 1,))
    handle = ref.register_forward_hook(lambda mod, inp, out: out * 2)
    with pytest.warns(
        UserWarning, match="has forward pre-hooks, forward hooks, which the npnorm layer"
    ) as said:
        ours = npnorm.from_torch(ref)
    assert said[0].filename == __file__
    x = rng.normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(ours(x), npnorm.LayerNorm(4)(x))  # the layer alone
    handle.remove()
    ref._forward_pre_hooks.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        npnorm.from_torch(ref)


def test_a_state_dict_hook_is_warned_of_and_the_layers_own_tensors_are_copied(torch, rng):
    """from_torch copied what ``state_dict()`` returned: a state_dict hook that changes a
    value (weight times 7) made the npnorm layer compute something else, silently."""
    ref = torch.nn.LayerNorm(3)
    ref.register_state_dict_post_hook(
        lambda mod, sd, p, meta: sd.update({p + "weight": sd[p + "weight"] * 7})
    )
    with pytest.warns(UserWarning, match="has state_dict hooks, which the npnorm layer"):
        ours = npnorm.from_torch(ref)
    np.testing.assert_array_equal(ours.weight, ref.weight.detach().numpy())
    x = rng.normal(size=(2, 3)).astype(np.float32)
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, tie", [("LayerNorm", ("bias", "weight")), ("BatchNorm1d", ("running_var", "running_mean"))]
)
def test_tied_tensors_convert_under_each_name(torch, name, tie):
    """A layer whose two names hold one tensor converts, as through its state_dict (the
    layer's own tensors, read once per tensor, missed the second name: "missing key(s)")."""
    ref = getattr(torch.nn, name)(4)
    setattr(ref, tie[0], getattr(ref, tie[1]))
    ours = npnorm.from_torch(ref)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.detach().numpy(), err_msg=k)


def test_a_layer_on_the_meta_device_converts_only_to_the_meta_device(torch):
    """from_torch raised "cannot convert to an array (NotImplementedError: Cannot copy out
    of meta tensor; no data!)"; to the meta device it warned once per key that copying
    into meta is a no-op."""
    ref = torch.nn.BatchNorm1d(4, device="meta")
    with pytest.raises(
        ValueError, match=r"weight, bias, running_mean.* are on torch's meta device.*device='meta'"
    ):
        npnorm.from_torch(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = npnorm.from_torch(ref, xp="torch", device="meta")
    assert ours.weight.is_meta and ours.running_mean.is_meta and repr(ours) == repr(ref)


def test_a_layer_of_mixed_dtypes_is_refused_not_rounded(torch):
    """The dtype was the first tensor's: float64 running statistics in a float32 layer were
    rounded to float32 (a round trip not exact), float32 ones of 1e5 in a float16 layer
    became inf."""
    ref = torch.nn.BatchNorm1d(3)
    ref.running_mean = torch.full((3,), 1 + 2**-40, dtype=torch.float64)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"tensors have different dtypes \(float32, float64\).*cast the layer"
    ):
        npnorm.from_torch(ref)
    assert all(torch.equal(v, before[k]) for k, v in ref.state_dict().items())
    ours = npnorm.from_torch(ref.double())
    assert ours.running_mean[0] == 1 + 2**-40


@pytest.mark.parametrize(
    "name, args, flag",
    [
        ("BatchNorm1d", (3,), "affine"),
        ("InstanceNorm1d", (3,), "affine"),
        ("GroupNorm", (1, 3), "affine"),
        ("LayerNorm", (4,), "elementwise_affine"),
        ("RMSNorm", (4,), "elementwise_affine"),
    ],
)
def test_an_affine_flag_set_false_after_construction_converts_both_ways(torch, rng, name, args, flag):
    """torch (and npnorm) still apply a weight and bias whose layer's affine flag was set
    false after construction; from_torch and to_torch built the layer without them and
    raised "unexpected key(s): 'weight', 'bias'"."""
    kw = {"affine": True} if name == "InstanceNorm1d" else {}
    ref = getattr(torch.nn, name)(*args, **kw, dtype=torch.float64)
    _randomize_torch(torch, ref, 5)
    setattr(ref, flag, False)
    ours = npnorm.from_torch(ref)
    assert getattr(ours, flag) is False and repr(ours) == repr(ref)
    back = npnorm.to_torch(ours)
    assert getattr(back, flag) is False and back.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    x = rng.normal(size=(2, 3, 4))
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)


def test_a_process_group_that_is_not_carried_over_is_warned_of(torch, monkeypatch):
    """A SyncBatchNorm's process_group was dropped without a word: the npnorm layer would
    sync over every rank (COMM_WORLD)."""
    ref = torch.nn.SyncBatchNorm(3)
    monkeypatch.setattr(ref, "process_group", object())  # (a group needs torch.distributed set up)
    with pytest.warns(UserWarning, match="process_group is not carried over.*set comm="):
        ours = npnorm.from_torch(ref)
    assert ours.comm is None


def test_torch_is_imported_lazily_and_its_absence_is_a_clear_error():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import npnorm\n"
        "try:\n"
        "    npnorm.to_torch(npnorm.LayerNorm(3))\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "npnorm.to_torch needs PyTorch" in out.stdout and "pip install torch" in out.stdout


@pytest.mark.parametrize("bias", [True, False])
def test_to_torch_on_a_torch_without_the_bias_argument(torch, monkeypatch, rng, bias):
    # torch before 2.13 (the GPU machine's 2.11) has no bias= in BatchNorm: to_torch passed it
    # and raised TypeError ("unexpected keyword argument 'bias'")
    class BatchNorm2dWithoutBiasArgument(torch.nn.BatchNorm2d):
        def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                     device=None, dtype=None):  # fmt: skip
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    monkeypatch.setattr(torch.nn, "BatchNorm2d", BatchNorm2dWithoutBiasArgument)
    ours = npnorm.BatchNorm2d(3, bias=bias, dtype="float64")
    ours(rng.normal(size=(4, 3, 2, 2)))  # moves the running statistics
    ref = npnorm.to_torch(ours)
    assert (ref.bias is not None) == bias
    assert ref.state_dict().keys() == ours.state_dict().keys()
    ref.eval(), ours.eval()
    x = rng.normal(size=(2, 3, 2, 2))
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name,args,shape,unset",
    [
        (name, args, shape, unset)
        for name, args, shape in [
            ("BatchNorm1d", (3,), (5, 3, 2)),
            ("InstanceNorm1d", (3,), (5, 3, 4)),
            ("GroupNorm", (1, 3), (5, 3, 2)),
            ("LayerNorm", (4,), (5, 3, 4)),
            ("RMSNorm", (4,), (5, 3, 4)),
        ]
        for unset in ("weight", "bias")
        if (name, unset) != ("RMSNorm", "bias")  # RMSNorm has no bias
    ],
)
def test_a_parameter_set_to_none_converts_both_ways(torch, rng, name, args, shape, unset):
    # torch runs a layer whose weight (or bias) was set to None after construction; from_torch
    # and to_torch built it with the parameter and their loads raised "missing key(s)"
    kwargs = {"affine": True} if name == "InstanceNorm1d" else {}
    ref = getattr(torch.nn, name)(*args, dtype=torch.float64, **kwargs).eval()  # buffers kept
    assert getattr(ref, unset) is not None
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(0.5, 1.5)
    setattr(ref, unset, None)
    ours = npnorm.from_torch(ref)
    assert getattr(ours, unset) is None
    x = rng.normal(size=shape)
    np.testing.assert_allclose(ours(x), ref(torch.from_numpy(x)).detach().numpy(), rtol=1e-12, atol=1e-12)
    back = npnorm.to_torch(ours)
    assert getattr(back, unset) is None
    assert back.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_from_torch_leaves_a_non_persistent_buffer_out(torch):
    """A buffer registered with persistent=False is not part of torch's state: from_torch
    leaves it out, as torch's own state_dict does (loading it raised "Error(s) in
    loading state_dict")."""
    ref = torch.nn.LayerNorm(4)
    ref.register_buffer("extra", torch.zeros(2), persistent=False)
    ours = npnorm.from_torch(ref)
    assert type(ours) is npnorm.LayerNorm and set(ours.state_dict()) == {"weight", "bias"}


def test_from_torch_of_a_layer_without_tensors_takes_torchs_default_dtype(torch):
    """A layer without parameters has no tensor to tell its dtype: it takes torch's default
    dtype, as the torch layer would make its tensors (float32 was hard-coded)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ours = npnorm.from_torch(torch.nn.LayerNorm(4, elementwise_affine=False))
    finally:
        torch.set_default_dtype(before)
    assert ours.dtype == np.float64


def test_to_torch_refuses_a_subclass_as_from_torch_does(torch):
    """to_torch takes npnorm's own classes exactly: a user's subclass may change the math,
    which torch's class would not run."""

    class Mine(npnorm.LayerNorm):
        pass

    with pytest.raises(TypeError, match="Mine"):
        npnorm.to_torch(Mine(4))
