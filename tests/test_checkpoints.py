"""Checkpoints: what load_state_dict accepts and copies, the batch counter, loading one
layer out of a whole model's state_dict, and npnorm state going into torch modules."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import randomize
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm

finite32 = st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False, width=32)


# --- copies, not aliases ------------------------------------------------------


@pytest.mark.parametrize("source", ["numpy", "list", "same backend"])
def test_loaded_arrays_are_fresh_and_owned(backend, rng, source):
    m = npnorm.BatchNorm1d(3, xp=backend.xp)
    state = {k: rng.normal(size=tuple(v.shape)) for k, v in m.state_dict().items()}
    state["num_batches_tracked"] = np.asarray(4)
    given_state = {
        "numpy": {k: np.asarray(v, dtype=np.float32 if v.ndim else np.int64) for k, v in state.items()},
        "list": {k: np.asarray(v).tolist() for k, v in state.items()},
        "same backend": {
            k: backend.xp.asarray(np.asarray(v), dtype=getattr(m.state_dict()[k], "dtype", None))
            for k, v in state.items()
        },
    }[source]
    m.load_state_dict(given_state)
    for k, v in given_state.items():
        loaded = np.asarray(backend.numpy(getattr(m, k)), dtype=np.float64)
        np.testing.assert_allclose(loaded, np.asarray(state[k], dtype=np.float64), rtol=1e-6, err_msg=k)
        if isinstance(v, list):
            v[0] = 7.0  # the caller changes its list in place ...
        elif hasattr(v, "shape"):
            v[...] = 7  # ... or its array ...
        np.testing.assert_array_equal(backend.numpy(getattr(m, k)), loaded, err_msg=k)  # ... not ours
    assert m.state_dict()["weight"] is m.weight  # state_dict: the module's own arrays, as in torch


def test_state_dict_values_are_the_modules_arrays():
    m = npnorm.BatchNorm1d(2)
    sd = m.state_dict()
    assert all(sd[k] is getattr(m, k) for k in sd)
    sd["running_mean"] += 1.0  # documented: an in-place change reaches the module
    np.testing.assert_array_equal(m.running_mean, 1.0)


# --- floating dtypes the backend lacks -----------------------------------------


@given(values=hnp.arrays(np.float32, st.integers(1, 6), elements=finite32))
def test_bfloat16_torch_checkpoint_loads(torch, backend, values):
    n = values.shape[0]
    ref = torch.nn.LayerNorm(n, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(values))
        ref.bias.copy_(torch.from_numpy(-values))
    for dtype in ("float32", "float64"):
        m = npnorm.LayerNorm(n, dtype=dtype, xp=backend.xp)
        m.load_state_dict(ref.state_dict())
        assert m.weight.dtype == getattr(backend.xp, dtype)
        exact = ref.weight.detach().float().numpy()  # bfloat16 values are exact in float32
        np.testing.assert_array_equal(backend.numpy(m.weight), exact)
        np.testing.assert_array_equal(backend.numpy(m.bias), -exact)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
@given(values=hnp.arrays(np.float32, st.integers(1, 6), elements=st.floats(-400, 400, width=32)))
def test_ml_dtypes_arrays_load(backend, name, values):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="the 'test' extra installs ml_dtypes")
    low = values.astype(getattr(ml_dtypes, name))
    m = npnorm.RMSNorm(values.shape[0], dtype="float64", xp=backend.xp)
    m.load_state_dict({"weight": low})
    assert m.weight.dtype == backend.xp.float64
    np.testing.assert_array_equal(backend.numpy(m.weight), low.astype(np.float64))


@given(values=hnp.arrays(np.float16, st.integers(1, 6), elements=st.floats(-6e4, 6e4, width=16)))
def test_a_float16_checkpoint_loads_where_the_backend_has_no_float16(torch, backend, values):
    """A ``.half()`` checkpoint (NumPy's float16, torch's) loads into a module of any
    backend, widened exactly: array_api_strict, which has no float16, refused it ("does not
    support the dtype 'float16'") where it took bfloat16."""
    for source in (values, torch.from_numpy(values), values.astype(">f2")):
        m = npnorm.LayerNorm(values.shape[0], xp=backend.xp)
        m.load_state_dict({"weight": source, "bias": -source})
        assert m.weight.dtype == backend.xp.float32
        np.testing.assert_array_equal(backend.numpy(m.weight), values.astype(np.float32))
        np.testing.assert_array_equal(backend.numpy(m.bias), -values.astype(np.float32))


# --- num_batches_tracked -------------------------------------------------------


@pytest.mark.parametrize("cls", ["BatchNorm1d", "InstanceNorm1d"])
def test_checkpoint_without_num_batches_tracked_loads_as_in_torch(torch, cls):
    kw = {} if cls == "BatchNorm1d" else {"affine": True, "track_running_stats": True}
    ref = getattr(torch.nn, cls)(3, **kw)
    ours = getattr(npnorm, cls)(3, **kw)
    old = {k: v.clone() for k, v in ref.state_dict().items() if k != "num_batches_tracked"}
    old["running_mean"] += 1.0
    assert not ref.load_state_dict(old).missing_keys  # torch accepts it
    result = ours.load_state_dict(old)
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(ours.running_mean, ref.running_mean.numpy())
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 0
    assert ours.num_batches_tracked.dtype == np.int64 and ours.num_batches_tracked.shape == ()


def test_missing_counter_keeps_the_current_count_as_torch(torch, rng):
    """torch fills a missing counter with the module's own (0 for a new module)."""
    ref, ours = torch.nn.BatchNorm1d(2), npnorm.BatchNorm1d(2)
    for _ in range(3):
        x = rng.normal(size=(4, 2)).astype(np.float32)
        ref(torch.from_numpy(x))
        ours(x)
    old = {k: v.clone() for k, v in ref.state_dict().items() if k != "num_batches_tracked"}
    ref.load_state_dict(old)
    ours.load_state_dict(old)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 3


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("counter_none", [False, True])
@pytest.mark.parametrize("tracking_now", [True, False])
def test_an_old_checkpoint_gets_a_counter_where_torch_gives_one(torch, tracking_now, counter_none, strict):
    """PyTorch fills in an old checkpoint's counter where ``track_running_stats`` is true
    now (set after construction too), 0 where the counter was set to None, which is then an
    unexpected key. npnorm filled it in where the module held a counter: it loaded without
    a word where torch reports the counter missing (tracking switched off) or unexpected
    (counter set to None)."""
    ref, ours = torch.nn.BatchNorm1d(3), npnorm.BatchNorm1d(3)
    for m in (ref, ours):
        m.track_running_stats = tracking_now
        if counter_none:
            m.num_batches_tracked = None
    old = {k: v.clone() for k, v in ref.state_dict().items() if k != "num_batches_tracked"}
    state, grads = snapshot(ours)
    try:
        want = ref.load_state_dict(dict(old), strict=strict)
    except RuntimeError as err:
        key = re.search(r"(Missing|Unexpected) key\(s\)", str(err))
        assert key is not None
        with pytest.raises(RuntimeError, match=rf"(?i){key.group(1)} key\(s\): 'num_batches_tracked'"):
            ours.load_state_dict(old, strict=strict)
        assert_state_equal(ours, state, grads)  # nothing loaded
        return
    got = ours.load_state_dict(old, strict=strict)
    assert (got.missing_keys, got.unexpected_keys) == (want.missing_keys, want.unexpected_keys)


def test_a_versioned_torch_state_dict_without_its_counter_is_missing_a_key(torch):
    """A state_dict that PyTorch made (module version 2, in its _metadata) and that lost its
    counter is missing a key, strictly, as PyTorch says; a plain dict is an old checkpoint."""
    ref = torch.nn.BatchNorm1d(3)
    state = ref.state_dict()
    del state["num_batches_tracked"]
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        ref.load_state_dict(state)
    ours = npnorm.BatchNorm1d(3)
    with pytest.raises(RuntimeError, match=r"missing key.*'num_batches_tracked'"):
        ours.load_state_dict(state)
    assert ours.load_state_dict(state, strict=False).missing_keys == ["num_batches_tracked"]
    assert ours.load_state_dict(dict(state)).missing_keys == []  # no _metadata: torch < 0.4.1


@pytest.mark.parametrize("version", [1, 2])
def test_a_version_1_checkpoint_without_its_counter_loads_as_in_torch(torch, version):
    """Module version 1 (torch 0.4.0) had no num_batches_tracked: PyTorch fills the counter
    in, strictly, as for a checkpoint without a version; version 2 lacks a key. (A mutation
    that took version 1 for a current one passed the suite.)"""
    ref = torch.nn.BatchNorm1d(3)
    state = ref.state_dict()
    del state["num_batches_tracked"]
    state._metadata[""]["version"] = version
    ours = npnorm.BatchNorm1d(3)
    if version == 2:
        with pytest.raises(RuntimeError, match="num_batches_tracked"):
            ref.load_state_dict(state)
        with pytest.raises(RuntimeError, match=r"missing key.*'num_batches_tracked'"):
            ours.load_state_dict(state)
        return
    ref.load_state_dict(state)
    assert ours.load_state_dict(state).missing_keys == []
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 0


def test_a_counter_of_shape_1_loads_as_in_torch(torch):
    """torch 0.3 saved 0-d values as shape (1,): PyTorch unpacks them, and so does npnorm."""
    state = {k: v.numpy() for k, v in torch.nn.BatchNorm1d(3).state_dict().items()}
    state["num_batches_tracked"] = np.array([7])
    ref = torch.nn.BatchNorm1d(3)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    ours = npnorm.BatchNorm1d(3)
    ours.load_state_dict(state)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 7
    assert ours.num_batches_tracked.shape == ()
    state["num_batches_tracked"] = np.array([7, 8])
    with pytest.raises(RuntimeError, match="size mismatch"):
        ours.load_state_dict(state)


def test_running_stats_into_an_untracked_instance_norm_as_in_torch(torch):
    """A checkpoint without a version that has running stats for an InstanceNorm that does
    not track them: PyTorch refuses it even with strict=False (torch < 0.4 tracked them by
    default); a versioned one only has unexpected keys."""
    old = {"running_mean": np.zeros(3), "running_var": np.ones(3)}
    ref, ours = torch.nn.InstanceNorm1d(3), npnorm.InstanceNorm1d(3)
    with pytest.raises(RuntimeError, match="track_running_stats"):
        ref.load_state_dict({k: torch.from_numpy(v) for k, v in old.items()}, strict=False)
    with pytest.raises(RuntimeError, match=r"'running_mean' and 'running_var'.*track_running_stats=True"):
        ours.load_state_dict(old, strict=False)
    versioned = torch.nn.InstanceNorm1d(3, track_running_stats=True).state_dict()
    want = ref.load_state_dict(versioned, strict=False).unexpected_keys
    assert ours.load_state_dict(versioned, strict=False).unexpected_keys == want


def test_npnorm_state_carries_torchs_version_so_it_loads_as_a_current_checkpoint(torch):
    """npnorm's state_dict records the layer's version in ``_metadata`` as torch's does:
    a tracking InstanceNorm's state into one that does not track is then unexpected keys
    under strict=False, in npnorm and in torch (without a version both refused it as a
    checkpoint of torch < 0.4)."""
    src = npnorm.InstanceNorm1d(3, track_running_stats=True).state_dict()
    ref_src = torch.nn.InstanceNorm1d(3, track_running_stats=True).state_dict()
    assert list(src) == list(ref_src) and src._metadata == ref_src._metadata  # {"": {"version": 2}}
    got = npnorm.InstanceNorm1d(3).load_state_dict(src, strict=False)
    assert got == torch.nn.InstanceNorm1d(3).load_state_dict(ref_src, strict=False)
    as_tensors = type(src)((k, torch.as_tensor(v)) for k, v in src.items())
    as_tensors._metadata = src._metadata
    assert torch.nn.InstanceNorm1d(3).load_state_dict(as_tensors, strict=False).unexpected_keys == list(src)
    for make in (lambda m: m.LayerNorm(3), lambda m: m.RMSNorm(3), lambda m: m.GroupNorm(1, 3)):
        assert make(npnorm).state_dict()._metadata == make(torch.nn).state_dict()._metadata


def test_state_dict_takes_torchs_prefix_destination_and_keep_vars(torch):
    ours, ref = npnorm.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    got, want = ours.state_dict(prefix="1."), ref.state_dict(prefix="1.")
    assert list(got) == list(want) and got._metadata == want._metadata  # {"1": {"version": 2}}
    model = ours.state_dict(destination=npnorm.LayerNorm(3).state_dict(prefix="0."), prefix="1.")
    assert list(model) == ["0.weight", "0.bias", *want] and model._metadata == {
        "0": {"version": 1},
        "1": {"version": 2},
    }
    assert npnorm.LayerNorm(3).load_state_dict(model, prefix="0") == ([], [])
    plain: dict = {}
    assert ours.state_dict(destination=plain) is plain and list(plain) == list(ref.state_dict())
    t = npnorm.LayerNorm(3, xp="torch")
    t.weight.requires_grad_(True)  # e.g. assigned by hand: torch's state_dict detaches it
    assert not t.state_dict()["weight"].requires_grad and t.state_dict(keep_vars=True)["weight"] is t.weight
    assert ours.state_dict(keep_vars=True)["weight"] is ours.weight is ours.state_dict()["weight"]
    with pytest.raises(TypeError):
        ours.state_dict(None, "1.")  # keyword-only, as torch deprecates them positional


@pytest.mark.parametrize("value", [None, "7", b"7", [None]])
def test_a_value_that_is_no_array_is_a_listed_error_as_in_torch(torch, value):
    # None was "size mismatch ... shape ()", and "7" loaded as a counter of 7
    for key in ("bias", "num_batches_tracked"):
        m = npnorm.BatchNorm1d(3)
        before = snapshot(m)
        with pytest.raises(RuntimeError, match=rf"'{key}': cannot convert .*expected an array"):
            m.load_state_dict({**m.state_dict(), key: value})
        assert_state_equal(m, *before)
        with pytest.raises(RuntimeError, match=r"expected torch\.Tensor"):
            torch.nn.BatchNorm1d(3).load_state_dict({**torch.nn.BatchNorm1d(3).state_dict(), key: value})


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_batches_tracked", np.array("7")),
        ("weight", np.array(["1", "2", "3"])),
        ("weight", np.array([None] * 3, dtype=object)),
    ],
)
def test_numpy_arrays_of_strings_or_objects_are_refused_on_the_numpy_backend_too(key, value):
    # they went by the same-backend copy, unchecked: "7" loaded as a counter, None as NaN
    m = npnorm.BatchNorm1d(3)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=rf"'{key}': cannot convert .*expected an array"):
        m.load_state_dict({**m.state_dict(), key: value})
    assert_state_equal(m, *before)


def test_a_value_beyond_float16_loads_as_inf_without_a_warning_as_in_torch(torch):
    # pytest turns warnings into errors: the overflow warning of the cast refused the load
    sd = torch.nn.BatchNorm1d(3).state_dict()
    sd["running_var"] = torch.tensor([7e4, 1.0, 1.0])
    ref, ours = torch.nn.BatchNorm1d(3, dtype=torch.float16), npnorm.BatchNorm1d(3, dtype="float16")
    ref.load_state_dict(sd)
    ours.load_state_dict(sd)
    np.testing.assert_array_equal(ours.running_var, ref.running_var.numpy())  # [inf, 1, 1]


def test_a_value_too_big_for_its_dtype_is_a_listed_error():
    m = npnorm.BatchNorm1d(3)
    with pytest.raises(RuntimeError, match="'num_batches_tracked': cannot convert"):
        m.load_state_dict({**m.state_dict(), "num_batches_tracked": 2**70})
    assert int(m.num_batches_tracked) == 0


@pytest.mark.parametrize("value", [np.array(2**64 - 1, np.uint64), np.array([2**63], np.uint64)])
def test_a_counter_beyond_int64_is_a_listed_error_and_changes_nothing(value):
    """A uint64 counter of an .npz wrapped around: 2**64 - 1 loaded as -1 (and
    momentum=None then divided by 0)."""
    m = npnorm.BatchNorm1d(3)
    with pytest.raises(
        RuntimeError, match=rf"'num_batches_tracked': cannot convert .*{int(value.max())} does not fit int64"
    ):
        m.load_state_dict({**m.state_dict(), "num_batches_tracked": value})
    assert int(m.num_batches_tracked) == 0
    m.load_state_dict({**m.state_dict(), "num_batches_tracked": np.array(7, np.uint64)})  # one that fits
    assert int(m.num_batches_tracked) == 7


def test_a_meta_tensor_checkpoint_is_a_listed_error_and_changes_nothing(torch):
    # a model built under torch.device("meta") has no values: torch's load raises RuntimeError
    m = npnorm.LayerNorm(4)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=r"(?s)'weight': cannot convert.*meta.*'bias': cannot convert"):
        m.load_state_dict(torch.nn.LayerNorm(4, device="meta").state_dict())
    assert_state_equal(m, *before)


def test_a_load_into_a_module_on_the_meta_device_warns_as_torchs(torch):
    """The values were dropped without a word (torch warns once per key: a no-op)."""
    m = npnorm.LayerNorm(4, xp="torch", device="meta")
    with pytest.warns(UserWarning) as caught:
        m.load_state_dict({"weight": torch.full((4,), 2.0), "bias": torch.ones(4)})
    assert [str(w.message).split(", which")[0] for w in caught] == [
        f"for {key!r}: copying into a tensor on torch's meta device" for key in ("weight", "bias")
    ]
    assert m.weight.is_meta and m.bias.is_meta


def test_values_on_another_device_load_onto_the_modules(rng):
    # as torch's copy_ loads a CPU checkpoint into a CUDA module: array_api_strict's second
    # device stands in; the value on it used to fail the in-place write after the
    # weight was already loaded
    xs = pytest.importorskip("array_api_strict")
    m = npnorm.LayerNorm(3, xp="array_api_strict")
    weight, bias = m.weight, m.bias
    m.load_state_dict({"weight": xs.full(3, 5.0), "bias": xs.full(3, 7.0, device=xs.Device("device1"))})
    assert m.weight is weight and m.bias is bias  # written in place, on the module's device
    assert m.bias.device == weight.device
    np.testing.assert_array_equal(np.asarray(m.bias), np.full(3, 7.0))


def test_counter_stays_a_0d_int64_array(backend, rng):
    m = npnorm.BatchNorm2d(2, xp=backend.xp)
    x = backend.asarray(rng.normal(size=(3, 2, 2, 2)), "float32")
    for step in range(1, 3):
        m(x)
        c = m.num_batches_tracked
        assert not isinstance(c, np.generic) and tuple(c.shape) == () and c.dtype == backend.xp.int64
        assert int(c) == step
    m.load_state_dict({**m.state_dict(), "num_batches_tracked": 9})
    assert tuple(m.num_batches_tracked.shape) == () and int(m.num_batches_tracked) == 9


def test_counter_goes_into_torch_from_numpy(torch, rng):
    """torch.from_numpy refuses NumPy scalars: the counter must be an array."""
    m = npnorm.BatchNorm1d(2)
    m(rng.normal(size=(4, 2)).astype(np.float32))
    assert torch.from_numpy(m.num_batches_tracked).item() == 1


# --- npnorm state into torch ------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.nn.BatchNorm2d(3),
        lambda t: t.nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        lambda t: t.nn.LayerNorm((2, 3)),
        lambda t: t.nn.RMSNorm(3),
        lambda t: t.nn.GroupNorm(1, 3),
    ],
)
def test_torch_module_loads_npnorm_state_with_the_documented_one_liner(torch, rng, make):
    ref = make(torch)
    ours = npnorm.from_torch(ref)
    randomize(ours, rng)
    with pytest.raises(RuntimeError, match="Tensor"):
        ref.load_state_dict(ours.state_dict())  # torch wants tensors, not NumPy arrays
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in ours.state_dict().items()})  # README
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(ref.state_dict()[k].numpy(), v, err_msg=k)
        assert not np.shares_memory(ref.state_dict()[k].numpy(), v), k  # torch copied
    back = npnorm.to_torch(ours)
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k].numpy(), v, err_msg=k)


# --- one layer out of a whole model -------------------------------------------


def test_load_one_layer_by_prefix_from_a_torch_model(torch, rng):
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.LayerNorm(4)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.train()
    model(torch.randn(8, 4))
    full = model.state_dict()
    bn, ln = npnorm.BatchNorm1d(4), npnorm.LayerNorm(4)
    assert bn.load_state_dict(full, prefix="1.") == ([], [])
    assert ln.load_state_dict(full, prefix="3") == ([], [])  # the trailing "." is added
    for ours, ref in ((bn, model[1]), (ln, model[3])):
        for k, v in ref.state_dict().items():
            np.testing.assert_array_equal(getattr(ours, k), v.numpy(), err_msg=k)
    model.eval()
    x = rng.normal(size=(5, 4)).astype(np.float32)
    h = model[0](torch.from_numpy(x))
    np.testing.assert_allclose(
        bn.eval()(h.detach().numpy()), model[1](h).detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_a_whole_models_state_dict_without_prefix_names_the_prefixes_that_fit(torch):
    # the error listed every key of the model as unexpected, with no hint of prefix=
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Sequential(torch.nn.LayerNorm(4))
    )
    with pytest.raises(RuntimeError) as info:
        npnorm.LayerNorm(4).load_state_dict(model.state_dict())
    message = str(info.value)
    # the BatchNorm's weight and bias fit a LayerNorm(4) too; the Linear's (4, 4) weight does not
    assert "this layer's keys may be under a prefix: prefix='1.', prefix='2.0.')" in message
    with pytest.raises(RuntimeError) as info:
        npnorm.BatchNorm1d(4).load_state_dict(model.state_dict())
    assert "prefix='1.')" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        npnorm.LayerNorm(5).load_state_dict(model.state_dict())  # no shape fits: no hint
    assert "prefix" not in str(info.value)


def test_prefix_does_not_match_a_longer_name():
    full = {
        "layer.1.weight": np.full(3, 1.0),
        "layer.1.bias": np.zeros(3),
        "layer.10.weight": np.full(3, 10.0),
    }
    m = npnorm.LayerNorm(3)
    assert m.load_state_dict(full, prefix="layer.1") == ([], [])
    np.testing.assert_array_equal(m.weight, 1.0)
    m2 = npnorm.LayerNorm(3)
    with pytest.raises(RuntimeError, match=r"missing key\(s\): 'layer.10.bias'") as info:
        m2.load_state_dict(full, prefix="layer.10.")
    assert "unexpected" not in str(info.value)  # keys outside the prefix are not unexpected
    np.testing.assert_array_equal(m2.weight, 1.0)  # nothing changed
    result = m2.load_state_dict(full, strict=False, prefix="layer.10.")
    assert result.missing_keys == ["layer.10.bias"] and result.unexpected_keys == []
    np.testing.assert_array_equal(m2.weight, 10.0)


def test_prefix_errors_name_full_keys(rng):
    m = npnorm.LayerNorm(3)
    randomize(m, rng)
    state, grads = snapshot(m)
    full = {"enc.norm.weight": np.ones(3), "enc.norm.bias": np.ones(4), "enc.norm.extra": 1.0}
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(full, prefix="enc.norm.")
    msg = str(info.value)
    assert "'enc.norm.extra'" in msg and "size mismatch for 'enc.norm.bias'" in msg
    assert_state_equal(m, state, grads)
    with pytest.raises(RuntimeError, match=re.escape("no key of the state_dict starts with 'dec.'")):
        m.load_state_dict(full, prefix="dec")


@pytest.mark.parametrize(
    "value, says",
    [
        (
            [1.0, 2**70],
            r"got list that NumPy holds only as Python objects \(an integer beyond int64's range\?\)",
        ),
        ([None, 1.0], r"got list that NumPy holds only as Python objects\)"),
        (None, r"got NoneType\)"),
    ],
)
def test_values_that_are_not_numbers_say_what_they_are(value, says):
    """An int beyond int64 reached NumPy as an object array, and the error said only "got
    int" (an int is a number); nothing is loaded."""
    m = npnorm.LayerNorm(2, dtype="float64")
    with pytest.raises(RuntimeError, match=r"'weight': cannot convert to an array \(TypeError: .*" + says):
        m.load_state_dict({"weight": value, "bias": [0.0, 0.0]})
    np.testing.assert_array_equal(m.weight, np.ones(2))
    np.testing.assert_array_equal(m.bias, np.zeros(2))


@pytest.mark.parametrize("value", ["numpy uint64", "torch uint64", "torch uint32"])
def test_an_unsigned_counter_that_fits_loads_into_a_torch_module(torch, value):
    """The range check asked torch for the min of an unsigned tensor, which torch's CPU
    kernels lack: every unsigned counter was refused (torch's own layers load them)."""
    counter = {
        "numpy uint64": np.array(7, np.uint64),
        "torch uint64": torch.tensor(7, dtype=torch.uint64),
        "torch uint32": torch.tensor(7, dtype=torch.uint32),
    }[value]
    m = npnorm.BatchNorm1d(3, xp="torch")
    m.load_state_dict({**m.state_dict(), "num_batches_tracked": counter})
    assert int(m.num_batches_tracked) == 7 and m.num_batches_tracked.dtype == torch.int64


def test_an_empty_integer_buffer_loads_on_torch(torch):
    """Checking an empty tensor's range raised (torch.amin of an empty tensor)."""

    class Ids(npnorm.Module):
        _buffer_names = ("ids",)

        def __init__(self):
            super().__init__(xp="torch")
            self.ids = torch.zeros(0, dtype=torch.int32)

    m = Ids()
    m.load_state_dict({"ids": torch.zeros(0, dtype=torch.int64)})
    assert m.ids.dtype == torch.int32 and m.ids.shape == (0,)


def test_unpickling_a_counter_beyond_int32_on_jax_without_x64_names_it():
    """A JAX module pickled with x64 on, unpickled with it off: the OverflowError did not
    say which module or buffer (``to()`` names them)."""
    jax = pytest.importorskip("jax")
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        m = npnorm.BatchNorm1d(3, xp="jax.numpy")
        m.num_batches_tracked = m.xp.asarray(2**40, dtype=m.xp.int64)
        blob = pickle.dumps(m)
        jax.config.update("jax_enable_x64", False)
        with pytest.raises(
            OverflowError, match=r"unpickling BatchNorm1d: num_batches_tracked: 1099511627776 does"
        ):
            pickle.loads(blob)
    finally:
        jax.config.update("jax_enable_x64", x64)


@pytest.mark.parametrize("value", [2**40, 2**31])
def test_a_counter_beyond_int32_is_refused_on_jax_without_x64(value):
    """JAX without x64 keeps the counter in int32, and its asarray wrapped an int64 2**40 to
    0 (the running average restarted) before any range was checked."""
    jax = pytest.importorskip("jax")
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        m = npnorm.BatchNorm1d(3, xp="jax.numpy")
        with pytest.raises(RuntimeError, match=rf"OverflowError: {value} does not fit int32"):
            m.load_state_dict({**m.state_dict(), "num_batches_tracked": np.array(value, np.int64)})
        assert int(m.num_batches_tracked) == 0
        ours = npnorm.BatchNorm1d(3)
        ours.num_batches_tracked = np.asarray(value)
        with pytest.raises(
            OverflowError, match=rf"BatchNorm1d.to\(\): num_batches_tracked: {value} does not"
        ):
            ours.to(xp="jax.numpy")  # (it became 0 or -2**31 without a word)
        assert ours.xp is not m.xp and int(ours.num_batches_tracked) == value
        from npnorm._backend import to_namespace

        for dtype in (m.xp.int64, None):  # asked for int64 or nothing, JAX makes int32
            with pytest.raises(OverflowError, match=f"{value} does not fit int32"):
                to_namespace(np.array(value), m.xp, dtype)
    finally:
        jax.config.update("jax_enable_x64", x64)
