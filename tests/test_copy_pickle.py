"""pickle and copy.deepcopy: every layer, every backend; copies share no memory, and keep
no gradients (as torch's)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from helpers import randomize

import npnorm

LAYERS = {
    "LayerNorm": (lambda **kw: npnorm.LayerNorm((2, 3), **kw), (4, 2, 3)),
    "RMSNorm": (lambda **kw: npnorm.RMSNorm(3, eps=1e-6, **kw), (4, 3)),
    "BatchNorm2d": (lambda **kw: npnorm.BatchNorm2d(2, momentum=None, **kw), (3, 2, 2, 2)),
    "GroupNorm": (lambda **kw: npnorm.GroupNorm(2, 4, **kw), (2, 4, 3)),
    "InstanceNorm1d": (
        lambda **kw: npnorm.InstanceNorm1d(2, affine=True, track_running_stats=True, **kw),
        (2, 2, 5),
    ),
}


def _trained(backend, rng, name, dtype="float32"):
    make, shape = LAYERS[name]
    m = make(dtype=dtype, xp=backend.xp)
    randomize(m, rng)
    x = backend.asarray(rng.normal(size=shape), dtype)
    m(x)
    m.backward(backend.asarray(rng.normal(size=shape), dtype))
    m.eval()
    return m, x


def _arrays(m):
    return {**{k: v for k, v in m.state_dict().items()}, **{f"grad {k}": v for k, v in m.grads.items()}}


COPIES = {"pickle": lambda m: pickle.loads(pickle.dumps(m)), "deepcopy": copy.deepcopy, "copy": copy.copy}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("how", list(COPIES))
def test_copy_is_equal_and_independent(backend, rng, name, how):
    m, x = _trained(backend, rng, name, dtype="float64")
    c = COPIES[how](m)
    assert type(c) is type(m) and repr(c) == repr(m) and c.training == m.training
    assert c.xp is m.xp and c.dtype == m.dtype
    ours, theirs = _arrays(m), _arrays(c)
    if how != "copy":  # the gradients are left behind, as torch's deep copies and pickles do
        assert m.grads and not c.grads
        ours = {k: v for k, v in ours.items() if not k.startswith("grad ")}
    assert ours.keys() == theirs.keys()
    for k in ours:
        a, b = backend.numpy(ours[k]), backend.numpy(theirs[k])
        np.testing.assert_array_equal(a, b, err_msg=k)
        assert theirs[k].dtype == ours[k].dtype and tuple(theirs[k].shape) == tuple(ours[k].shape), k
        if backend.name == "numpy":
            assert not np.shares_memory(ours[k], theirs[k]), k
    np.testing.assert_array_equal(backend.numpy(c(x)), backend.numpy(m(x)))
    # an in-place change to the copy does not reach the original
    before = backend.numpy(m.state_dict()["weight"] if "weight" in ours else m.running_mean).copy()
    for v in c.state_dict().values():
        v[...] = 0
    after = backend.numpy(m.state_dict()["weight"] if "weight" in ours else m.running_mean)
    np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copy_has_no_saved_forward(rng, how):
    m = npnorm.LayerNorm(3)
    y = m(rng.normal(size=(2, 3)).astype(np.float32))
    c = pickle.loads(pickle.dumps(m)) if how == "pickle" else copy.deepcopy(m)
    with pytest.raises(RuntimeError, match="no saved forward"):
        c.backward(np.ones_like(y))
    assert m.backward(np.ones_like(y)).shape == (2, 3)  # the original keeps its own


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_a_copy_has_the_gradients_torchs_has(torch, rng, how):
    """torch's deep copies and pickles of a layer leave its parameters' ``.grad`` behind (a
    Parameter is copied without it), and its shallow copy shares the parameters, so their
    ``.grad`` too; npnorm's deep copies and pickles kept the grads, and a training step on
    the copy added to them. ``copy.copy`` copies npnorm's arrays (grads included)."""
    x = rng.normal(size=(4, 3)).astype(np.float32)
    ours, ref = npnorm.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    ours(x)
    ours.backward(np.ones_like(x))
    ref(torch.tensor(x)).backward(torch.ones(4, 3))
    copy_of = COPIES[how]
    theirs = {k: p.grad for k, p in copy_of(ref).named_parameters() if p.grad is not None}
    c = copy_of(ours)
    assert c.grads.keys() == theirs.keys()
    for k, g in theirs.items():
        np.testing.assert_allclose(c.grads[k], g.numpy(), rtol=1e-6, atol=1e-6)
        assert not np.shares_memory(c.grads[k], ours.grads[k])


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_converted_pair_copied_together_shares_its_new_gradients(rng, how):
    """convert_sync_batchnorm shares the grads dict (as torch's layers share their
    Parameters and so ``.grad``); copied together, the copies share one new empty dict,
    so a backward on one shows in the other, as in torch (each got a dict of its own)."""
    x = rng.normal(size=(4, 3)).astype(np.float32)
    bn = npnorm.BatchNorm1d(3)
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn)
    bn(x)
    bn.backward(np.ones_like(x))
    bn_copy, sync_copy = COPIES[how]([bn, sync])
    assert bn_copy.grads is sync_copy.grads and not bn_copy.grads and bn.grads
    bn_copy(x)
    bn_copy.backward(np.ones_like(x))
    assert sorted(sync_copy.grads) == ["bias", "weight"]


def test_a_pickle_of_an_older_npnorm_holding_gradients_comes_back_without(rng):
    """Pickles written before the gradients were left out still carry them: they are
    dropped on loading, so that every unpickled module has empty grads."""
    m = npnorm.LayerNorm(3)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    m(x)
    m.backward(np.ones_like(x))
    state = m.__getstate__()
    state["grads"] = {k: np.array(v) for k, v in m.grads.items()}  # as older versions wrote it
    old = npnorm.LayerNorm.__new__(npnorm.LayerNorm)
    old.__setstate__(state)
    assert old.grads == {} and old(x).shape == (2, 3)


def test_pickle_keeps_the_counter_a_0d_array(rng):
    m = npnorm.BatchNorm1d(2)
    m(rng.normal(size=(4, 2)).astype(np.float32))
    c = pickle.loads(pickle.dumps(m))
    assert isinstance(c.num_batches_tracked, np.ndarray) and c.num_batches_tracked.shape == ()
    assert c.num_batches_tracked.dtype == np.int64 and int(c.num_batches_tracked) == 1


def test_torch_backend_pickles(torch, rng):
    m = npnorm.GroupNorm(1, 2, xp="torch", dtype="float64")
    randomize(m, rng)
    c = pickle.loads(pickle.dumps(m))
    assert isinstance(c.weight, torch.Tensor) and c.weight.dtype == torch.float64
    assert torch.equal(c.weight, m.weight) and c.weight.data_ptr() != m.weight.data_ptr()
    d = copy.deepcopy(m)
    assert torch.equal(d.bias, m.bias) and d.bias.data_ptr() != m.bias.data_ptr()


def test_pickle_names_the_backend_not_the_module():
    blob = pickle.dumps(npnorm.LayerNorm(2, xp="array_api_strict"))
    assert b"array_api_strict" in blob
    c = pickle.loads(blob)
    assert type(c.weight).__module__.startswith("array_api_strict")


def test_subclass_attributes_survive(rng):
    class Tagged(npnorm.LayerNorm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.tag = {"name": "ln", "extra": np.arange(3.0)}

    m = Tagged(3)
    c = copy.deepcopy(m)
    assert c.tag["name"] == "ln" and not np.shares_memory(c.tag["extra"], m.tag["extra"])


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_arrays_shared_between_modules_stay_shared_in_the_copy(torch, rng, how, xp):
    # as PyTorch's deepcopy and pickle (their memo): a tied weight, and the buffers a
    # SyncBatchNorm shares with the BatchNorm it was converted from; each copied array
    # shared with nothing of the originals
    a, b = npnorm.LayerNorm(3, xp=xp), npnorm.LayerNorm(3, xp=xp)
    b.weight = a.weight
    bn = npnorm.BatchNorm1d(3, xp=xp)
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn)
    originals = [a, b, bn, sync]
    copies = pickle.loads(pickle.dumps(originals)) if how == "pickle" else copy.deepcopy(originals)
    a2, b2, bn2, sync2 = copies
    assert a2.weight is b2.weight and a2.bias is not b2.bias
    for name in ("weight", "running_mean", "num_batches_tracked"):
        assert getattr(bn2, name) is getattr(sync2, name), name
    bn2(bn2.xp.asarray(rng.normal(size=(4, 3)).astype(np.float32)))
    assert int(sync2.num_batches_tracked) == 1 and int(bn.num_batches_tracked) == 0
    a2.weight[...] = 5.0
    assert float(a.weight[0]) == 1.0
