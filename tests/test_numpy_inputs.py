"""The NumPy arrays a pipeline hands over, in every kernel family: another byte order
(a file written elsewhere), ndarray subclasses (memmap, a user's), and what is refused
clearly (longdouble, np.matrix, a masked or self-overlapping ``out``, dates and masked
values in a checkpoint). Each family returns what the others return: plain, native
``ndarray`` results, buffers and grads updated in place."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from helpers import op_calls, same_results
from hypothesis import given, settings
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F

FAMILIES = npnorm.kernels_available()


class Tagged(np.ndarray):
    """A user's ndarray subclass."""


def _native(a):
    return None if a is None else np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([">f2", ">f4", ">f8", "<f4"]),
    shape=hnp.array_shapes(min_dims=3, max_dims=4, min_side=2, max_side=5).filter(lambda s: s[1] % 2 == 0),
    empty=st.sampled_from([None, 0, 2]),
)
def test_any_byte_order_in_gives_native_results_equal_to_a_native_copy(family, data, dtype, shape, empty):
    """A ``>f4`` input gave ``>f4`` outputs and dx (and ``dweight`` from a ``>f4`` weight)
    while the statistics came back native: ``y.dtype == np.float32`` was False. Empty
    input too (``empty``: the batch axis, or the first spatial axis of 4-D input, holds no
    values): the channel layers' own path for it gave ``>f4`` outputs, dx and dweight."""
    if empty is not None:
        shape = tuple(0 if i == (empty if len(shape) == 4 else 0) else n for i, n in enumerate(shape))
    values = hnp.arrays(dtype, shape, elements=st.floats(-100, 100, width=16), fill=st.nothing())
    x, dy = data.draw(values), data.draw(values)
    w = data.draw(hnp.arrays(dtype, shape[-1:], elements=st.floats(0.5, 2, width=16)))
    with npnorm.use_kernels(family):
        for op, args, back in op_calls(x, dy, w, None, groups=2):
            fwd = getattr(F, f"{op}_forward")
            native_args = tuple(_native(a) if isinstance(a, np.ndarray) else a for a in args)
            got, want = fwd(*args), fwd(*native_args)
            same_results(got, want, f"{family} {op} forward")
            same_results(
                getattr(F, f"{op}_backward")(*back(got)),
                getattr(F, f"{op}_backward")(*back(want)),
                f"{family} {op} backward",
            )
            for r in got:
                assert r is None or (type(r) is np.ndarray and r.dtype.isnative), (op, r.dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("out_order", ["=", ">"])
def test_out_of_either_byte_order(family, out_order):
    """``out=`` takes the input's dtype in either byte order (it is written, not viewed);
    the compiled kernels wrote a ``>f4`` out directly and failed to compile."""
    x = np.random.default_rng(0).normal(size=(6, 5)).astype(np.float32)
    for given_x in (x, x.astype(">f4")):
        out = np.zeros(x.shape, np.dtype(np.float32).newbyteorder(out_order))
        with npnorm.use_kernels(family):
            y = F.layer_norm_forward(given_x, 5, out=out)[0]
        assert y is out
        np.testing.assert_allclose(out, F.layer_norm(x, 5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_subclass_input_gives_plain_results_and_buffers_updated_in_place(family):
    """The reference family carried a subclass (memmap, a user's) into its results: a
    module's running statistics and grads were then new arrays of that class, not the
    module's own updated in place (a ``state_dict()`` taken before went stale)."""
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32).view(Tagged)
    with npnorm.use_kernels(family):
        assert type(F.layer_norm(x, 3)) is np.ndarray
        bn = npnorm.BatchNorm1d(3)
        state = bn.state_dict()
        y = bn(x)
        bn.backward(np.ones_like(x))
        grad = bn.grads["weight"]
        bn(x)
        bn.backward(np.ones_like(x))
    assert type(y) is np.ndarray
    assert state["running_mean"] is bn.running_mean and state["running_var"] is bn.running_var
    assert grad is bn.grads["weight"] and type(grad) is np.ndarray
    assert int(bn.num_batches_tracked) == 2 and np.any(bn.running_mean != 0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("order", ["=", ">"])
def test_a_memmap_buffer_is_written_in_place(family, order, tmp_path):
    """A running mean the user set to a ``np.memmap`` (of either byte order: a file written
    elsewhere) was replaced by a new array at the first step, and the file never written."""
    dtype = np.dtype(np.float32).newbyteorder(order)
    mm = np.memmap(tmp_path / "running_mean.bin", dtype=dtype, mode="w+", shape=(3,))
    bn = npnorm.BatchNorm1d(3)
    bn.running_mean = mm
    with npnorm.use_kernels(family):
        bn(np.random.default_rng(2).normal(3.0, 1.0, size=(8, 3)).astype(np.float32))
    assert bn.running_mean is mm and np.all(np.asarray(mm) > 0.1)


def test_a_module_holding_another_byte_order_moves_converts_and_gradchecks():
    """A module whose weight and running mean are ``>f4`` (set from a file written
    elsewhere; forward, backward and loads take them): ``to()``, ``to(dtype=...)``,
    ``to(xp)``, ``gradcheck`` and ``to_torch`` raised "unsupported dtype" or torch's
    byte-order error. Now they work on the values."""
    strict = pytest.importorskip("array_api_strict")
    big = np.dtype(">f4")

    def make():
        bn = npnorm.BatchNorm1d(3)
        bn.weight = np.arange(1, 4).astype(big)
        bn.running_mean = np.array([0.5, -1.0, 2.0], dtype=big)
        return bn

    want = np.arange(1, 4, dtype=np.float32)
    assert np.array_equal(make().to().weight, want)
    assert make().to(dtype="float64").weight.dtype == np.float64
    assert np.array_equal(np.asarray(make().to(strict).running_mean), [0.5, -1.0, 2.0])
    x = np.random.default_rng(0).normal(size=(6, 3))
    m = make()
    assert npnorm.gradcheck(m, x)
    assert m.weight.dtype == big  # restored as it was
    torch = pytest.importorskip("torch")
    ref = npnorm.to_torch(make())
    assert torch.equal(ref.weight.detach(), torch.from_numpy(want))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_empty_batch_returns_a_native_memmap_buffer_as_given(family, tmp_path):
    """An empty training batch leaves the running buffers as they are: the functional
    forward returns a native buffer itself (a1fbad3's native copies made a read-only
    memmap buffer a plain array, which the module then bound in its place), and another
    byte order as a native copy."""
    mm = np.memmap(tmp_path / "running_mean.bin", dtype=np.float32, mode="w+", shape=(3,))
    mm[:] = [1.0, 2.0, 3.0]
    mm.flush()
    ro = np.memmap(tmp_path / "running_mean.bin", dtype=np.float32, mode="r", shape=(3,))
    big = np.ones(3, dtype=">f4")
    with npnorm.use_kernels(family):
        for op, shape in ((F.batch_norm_forward, (0, 3, 4)), (F.instance_norm_forward, (2, 3, 0))):
            x = np.zeros(shape, np.float32)
            *_, new_mean, new_var = op(x, ro, big, None, None, True, 0.1, 1e-5)
            assert new_mean is ro, op
            assert new_var.dtype == np.float32 and np.array_equal(new_var, big), op
        bn = npnorm.BatchNorm1d(3)
        bn.running_mean = ro
        bn(np.zeros((0, 3), np.float32))
    assert bn.running_mean is ro


@pytest.mark.parametrize("family", FAMILIES)
def test_out_masked_or_self_overlapping_is_refused(family):
    """A masked ``out``: one family cleared its mask, one kept it, numba failed to compile
    on a first call. A zero-stride ``out`` (``np.broadcast_arrays``) took every row's
    result at one place: the last row's result, wrong everywhere (torch refuses it)."""
    x = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
    masked = np.ma.array(np.zeros((4, 5), np.float32), mask=np.eye(4, 5, dtype=bool))
    overlapping = np.broadcast_arrays(np.zeros(5, np.float32), x)[0]
    with npnorm.use_kernels(family):
        with pytest.raises(TypeError, match="out: masked arrays are not supported"):
            F.layer_norm_forward(x, 5, out=masked)
        with pytest.raises(ValueError, match="more than one element at one memory location"):
            F.layer_norm_forward(x, 5, out=overlapping)
        # a hint that makes a C-ordered array (np.empty_like(out) keeps a broadcast view's
        # stride order: Fortran-ordered here) and exists for every backend (not out.copy())
        with pytest.raises(ValueError, match=r"\(numpy\.empty\(out\.shape, dtype=out\.dtype\)\)$"):
            F.layer_norm_forward(x, 5, out=np.broadcast_to(np.zeros(5, np.float32), (4, 5)))
        _, mean, rstd = F.layer_norm_forward(x, 5)
        with pytest.raises(ValueError, match="more than one element at one memory location"):
            F.layer_norm_backward(x, x, 5, mean, rstd, out=overlapping)
    assert masked.mask.sum() == 4 and not np.any(masked.data)


@pytest.mark.parametrize("family", FAMILIES)
def test_longdouble_and_matrix_are_refused(family):
    """longdouble was accepted and computed in float128 by the reference and in float64 by
    the others (BatchNorm of values 1e-17 apart: a ramp in one, zeros in the other)."""
    with npnorm.use_kernels(family):
        with pytest.raises(TypeError, match="longdouble are not taken"):
            F.layer_norm(np.ones((2, 3), np.longdouble), 3)
        with pytest.raises(TypeError, match="longdouble are not taken"):
            npnorm.BatchNorm1d(3)(np.ones((4, 3), np.longdouble))
        with pytest.warns(PendingDeprecationWarning):
            m = np.matrix(np.ones((2, 3), np.float32))
        with pytest.raises(TypeError, match=r"np.matrix is not supported.*np.asarray"):
            F.layer_norm(m, 3)


@pytest.mark.parametrize(
    "value, message",
    [
        (np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0]), "masked arrays are not supported"),
        (np.array(["2020-01-01"] * 3, "datetime64[D]"), r"ndarray of datetime64\[D\]"),
        (np.array([1, 2, 3], "timedelta64[s]"), r"ndarray of timedelta64\[s\]"),
    ],
)
def test_a_checkpoint_of_masked_values_or_dates_is_refused(value, message):
    """Loaded silently before: a masked value as a number, dates as days since 1970."""
    bn = npnorm.BatchNorm1d(3)
    before = {k: np.copy(v) for k, v in bn.state_dict().items()}
    with pytest.raises(RuntimeError, match=message):
        bn.load_state_dict({**bn.state_dict(), "running_mean": value})
    with pytest.raises(RuntimeError, match="cannot convert"):
        bn.load_state_dict({**bn.state_dict(), "num_batches_tracked": np.array(5, "timedelta64[s]")})
    for k, v in bn.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_sync_batch_norm_over_ranks_takes_either_byte_order():
    """The ranks compare their input dtypes by code: ``>f4`` was no code at all ("input must
    have a floating dtype ..., got >f4") where BatchNorm takes it."""
    from npnorm._threadcomm import run_ranks

    x = np.random.default_rng(4).normal(size=(4, 3, 5)).astype(np.float32)
    want = run_ranks(2, lambda c: npnorm.SyncBatchNorm(3, comm=c)(x))
    got = run_ranks(2, lambda c: npnorm.SyncBatchNorm(3, comm=c)(x.astype(">f4")))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)

    def step(c, given):  # the backward's dx is native too (it came back as >f4)
        m = npnorm.SyncBatchNorm(3, comm=c)
        m(given)
        return m.backward(np.ones_like(x))

    swapped, native = run_ranks(2, lambda c: step(c, x.astype(">f4"))), run_ranks(2, lambda c: step(c, x))
    for dx, want_dx in zip(swapped, native, strict=True):
        assert dx.dtype.isnative and dx.dtype == np.float32
        np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(family):
    """Short rows took einsum in blocks of 128 rows or more and a BLAS dot below: the same
    row gave other bits in a batch of 2 than in a batch of 4096 ("numpy" family)."""
    x = np.random.default_rng(5).normal(3.0, 2.0, size=(4096, 24)).astype(np.float32)
    with npnorm.use_kernels(family):
        full = F.layer_norm_forward(x, (24,))
        for n in (1, 2, 127, 128, 200):
            part = F.layer_norm_forward(x[:n], (24,))
            for a, b in zip(part, full, strict=True):
                np.testing.assert_array_equal(a, b[:n])


@given(
    dtypes=st.lists(
        st.sampled_from(["float16", "float32", "float64", ">f4", ">f8", "<f2", None]), min_size=1, max_size=5
    ).filter(lambda d: d[0] is not None),
    subclass=st.booleans(),
)
def test_work_dtype_is_the_widest_with_float32(dtypes, subclass):
    """The computation dtype (the shortcut for NumPy arrays of one float32 or float64
    dtype included): the widest of the arrays' dtypes and float32, native."""
    import array_api_compat.numpy as xp

    from npnorm._checks import work_dtype

    arrays = [None if d is None else np.zeros(2, d) for d in dtypes]
    if subclass:
        arrays[-1] = None if arrays[-1] is None else arrays[-1].view(Tagged)
    expected = np.result_type(np.float32, *(np.dtype(d) for d in dtypes if d is not None))
    ct = work_dtype(xp, *arrays)
    assert ct == expected and ct.isnative
