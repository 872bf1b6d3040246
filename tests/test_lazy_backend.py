"""An Array API library that computes lazily (dask): every layer gives NumPy's values
through the module API (running statistics, grads accumulated over two backwards, a load,
a reset, gradcheck), results stay lazy, and an input whose sizes are not known yet (dask
after boolean indexing) gets a clear error. dask comes with the ``test`` extra."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import module_as_on_numpy

import npnorm
import npnorm.functional as F

da = pytest.importorskip("dask.array")

LAYERS = {
    "LayerNorm": (lambda **kw: npnorm.LayerNorm((2, 5), **kw), (3, 2, 5)),
    "RMSNorm": (lambda **kw: npnorm.RMSNorm(5, **kw), (3, 5)),
    "GroupNorm": (lambda **kw: npnorm.GroupNorm(2, 4, **kw), (3, 4, 5)),
    "BatchNorm2d, momentum=None": (lambda **kw: npnorm.BatchNorm2d(4, momentum=None, **kw), (3, 4, 2, 2)),
    "InstanceNorm1d, tracked": (
        lambda **kw: npnorm.InstanceNorm1d(4, affine=True, track_running_stats=True, **kw),
        (3, 4, 5),
    ),
}


def _state(m) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in {**m.state_dict(), **m.grads}.items()}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", LAYERS)
def test_a_module_on_dask_does_what_it_does_on_numpy(name, training):
    make, shape = LAYERS[name]
    ours, ref = make(xp=da, dtype="float64").train(training), make(dtype="float64").train(training)
    # gradcheck: a layer with running statistics takes ~25 s here (each of gradcheck's
    # forwards adds its update to the buffers' task graphs, the growth the README tells
    # users to persist)
    checked = training and "running_mean" not in ref.state_dict()
    module_as_on_numpy(ours, ref, shape, lambda a: da.from_array(a, chunks=2), da.Array, gradcheck=checked)


def test_an_input_of_unknown_size_is_a_clear_error_that_changes_nothing():
    """dask's boolean indexing leaves the number of rows unknown (NaN): npnorm failed inside
    a reshape with "cannot convert float NaN to integer"; it says what is missing and what to
    do, before any work."""
    x = np.random.default_rng(1).normal(size=(6, 4))
    lazy = da.from_array(x, chunks=3)
    lazy = lazy[lazy[:, 0] > 0]
    assert np.isnan(lazy.shape[0])
    bn = npnorm.BatchNorm1d(4, xp=da)
    before = _state(bn)
    for call in (lambda: F.layer_norm(lazy, (4,)), lambda: bn(lazy), lambda: F.rms_norm_forward(lazy, 4)):
        with pytest.raises(ValueError, match=r"every size must be known.*compute_chunk_sizes"):
            call()
    after = _state(bn)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    known = lazy.compute_chunk_sizes()
    np.testing.assert_allclose(F.layer_norm(known, (4,)).compute(), F.layer_norm(x[x[:, 0] > 0], (4,)))


@pytest.mark.parametrize("name", LAYERS)
def test_an_empty_batch_chunked_along_every_axis_gives_numpys_results(name):
    """dask cannot reshape a zero-length axis merged with a chunked one: LayerNorm and
    RMSNorm raised "reduce() of empty iterable" inside dask's reshape on an empty batch
    whose other batch axes were split into chunks; InstanceNorm's buffers, NaN after no
    instances, warned of 0 / 0 when computed."""
    make, shape = LAYERS[name]
    ours, ref = make(xp=da, dtype="float64"), make(dtype="float64")
    rows = name in ("LayerNorm", "RMSNorm")  # (a second batch axis, merged with the empty one)
    x = np.zeros((0, 3, *shape[1:]) if rows else (0, *shape[1:]))
    y = ours(da.from_array(x, chunks=1))
    dx = ours.backward(da.from_array(x, chunks=1))
    assert isinstance(y, da.Array) and isinstance(dx, da.Array)
    np.testing.assert_array_equal(y.compute(), ref(x))
    np.testing.assert_array_equal(dx.compute(), ref.backward(x))
    assert _state(ours).keys() == _state(ref).keys()
    for k, v in _state(ref).items():
        np.testing.assert_array_equal(_state(ours)[k], v, err_msg=k)


SPATIAL = {
    **LAYERS,
    "InstanceNorm3d, tracked": (
        lambda **kw: npnorm.InstanceNorm3d(1, track_running_stats=True, **kw),
        (1, 1, 4, 0, 1),  # (a chunked spatial axis merged with the empty one)
    ),
}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", SPATIAL)
def test_an_empty_spatial_axis_in_chunks_gives_numpys_results(name, training):
    """Instances with no spatial values (or rows of a batch axis of 0 between chunked
    ones): BatchNorm and InstanceNorm in eval reshaped them inside dask ("Dask's reshape
    only supports ...", "reduce() of empty iterable"), forward and backward."""
    make, shape = SPATIAL[name]
    ours, ref = make(xp=da, dtype="float64").train(training), make(dtype="float64").train(training)
    if name in ("LayerNorm", "RMSNorm"):
        x = np.zeros((2, 0, *shape[1:]))
    else:
        x = np.zeros(shape if 0 in shape else (2, shape[1], 0, *shape[3:]))
    y = ours(da.from_array(x, chunks=1))
    dx = ours.backward(da.from_array(x, chunks=1))
    np.testing.assert_array_equal(y.compute(), ref(x))
    np.testing.assert_array_equal(dx.compute(), ref.backward(x))
    for k, v in _state(ref).items():
        np.testing.assert_array_equal(_state(ours)[k], v, err_msg=k)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_empty_rows_with_a_chunked_wider_weight_compute(op):
    """An empty batch of rows under a chunked float64 weight built a task graph that failed
    when computed ("Missing dependency ('reshape-...')"): the empty result was reshaped
    back by dask."""
    x = da.zeros((3, 0, 3), dtype="float32", chunks=(1, 1, 3))
    w = da.ones(3, dtype="float64", chunks=1)
    extra = (w,) if op == "layer_norm" else ()
    y, *stats = getattr(F, f"{op}_forward")(x, 3, w, *extra)
    dx = getattr(F, f"{op}_backward")(x, x, 3, *stats, w, *extra)[0]
    assert y.compute().shape == dx.compute().shape == (3, 0, 3)


def test_out_of_no_values_takes_an_empty_result():
    """``out=`` of an empty array: dask refused the assignment of nothing ("shape mismatch:
    value array of shape (0, 3) could not be broadcast to indexing result of shape (0, 3)")."""
    x, out = da.zeros((0, 3), dtype="float32"), da.zeros((0, 3), dtype="float32")
    y, _, _ = F.layer_norm_forward(x, 3, out=out)
    dx, _, _ = F.layer_norm_backward(x, x, 3, *F.layer_norm_forward(x, 3)[1:], out=out)
    assert y is out and dx is out


def test_a_float16_array_comes_to_dask_as_float16():
    """The widening of float16 for a backend without it (array_api_strict) keyed on the
    namespace's lacking a ``float16`` name, which dask's lacks too though its arrays hold
    float16: a float16 buffer came back float32 from a pickle."""
    from npnorm._backend import resolve_namespace, to_namespace

    got = to_namespace(np.arange(3, dtype=np.float16), resolve_namespace(da))
    assert isinstance(got, da.Array) and got.dtype == np.float16


def test_sync_batch_norm_takes_float16_dask_input_as_batch_norm_does():
    """dask's namespace has no float16 attribute: the ranks' dtype exchange refused the
    input with "must have a floating dtype (float16/32/64, or bfloat16), got float16",
    where F.batch_norm takes it."""
    from npnorm._threadcomm import run_ranks

    x = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float16)
    want = F.batch_norm(da.from_array(x, chunks=2), None, None, training=True)

    def rank_fn(comm):
        part = x[:2] if comm.Get_rank() == 0 else x[2:]
        y, *_ = F.sync_batch_norm_forward(da.from_array(part, chunks=2), None, None, training=True, comm=comm)
        return y

    got = da.concatenate(run_ranks(2, rank_fn))
    assert isinstance(got, da.Array) and got.dtype == np.float16
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), atol=2e-3
    )
