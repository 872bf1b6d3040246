"""LayerNorm: parity with torch.nn.LayerNorm, properties, gradcheck, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import draw_state, grid_arrays, load_into_torch, randomize, step_and_compare
from hypothesis import assume, given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F

shapes = st.tuples(
    st.lists(st.integers(1, 4), min_size=0, max_size=2),  # batch dims
    st.lists(st.integers(1, 5), min_size=1, max_size=3),  # normalized_shape, ranks 1-3
)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(
    shape=shapes,
    eps=st.sampled_from([1e-5, 1e-3, 0.5]),
    affine=st.booleans(),
    bias=st.booleans(),
    data=st.data(),
)
def test_parity_with_torch(torch, backend, dtype, shape, eps, affine, bias, data):
    batch, norm = shape
    ours = npnorm.LayerNorm(norm, eps, affine, bias, dtype=dtype, xp=backend.xp)
    ref = torch.nn.LayerNorm(norm, eps, affine, bias, dtype=getattr(torch, dtype))
    draw_state(data, ours)
    load_into_torch(torch, ours, ref)
    full = (*batch, *norm)
    x, dy = data.draw(grid_arrays(full), label="x"), data.draw(grid_arrays(full), label="dy")
    step_and_compare(torch, backend, ours, ref, x, dy, dtype)


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, True)])
def test_gradcheck(backend, rng, affine, bias):
    m = npnorm.LayerNorm((3, 4), elementwise_affine=affine, bias=bias, xp=backend.xp)
    randomize(m, rng)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(2, 3, 4))))


@given(data=st.data(), norm=st.integers(2, 20), rows=st.integers(1, 6))
def test_output_rows_have_mean_0_and_variance_1(data, norm, rows):
    x = data.draw(grid_arrays((rows, norm)), label="x") * 5 + 3
    assume(bool((x.max(axis=-1) > x.min(axis=-1)).all()))  # (a constant row is 0/0 with eps=0)
    y = F.layer_norm(x, norm, eps=0.0)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1, atol=1e-10)


def test_invariant_to_per_row_shift(backend, rng):
    x = rng.normal(size=(4, 3, 5))
    shift = rng.normal(size=(4, 1, 1)) * 100
    w, b = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    args = [backend.asarray(a) for a in (w, b)]
    y1 = F.layer_norm(backend.asarray(x), (3, 5), *args)
    y2 = F.layer_norm(backend.asarray(x + shift), (3, 5), *args)
    np.testing.assert_allclose(backend.numpy(y1), backend.numpy(y2), atol=1e-10)


def test_dx_sums_to_zero_along_normalized_axes(backend, rng):
    x = backend.asarray(rng.normal(size=(4, 3, 5)))
    w = backend.asarray(rng.normal(size=(5,)))
    _y, mean, rstd = F.layer_norm_forward(x, 5, w, None)
    dx, dw, db = F.layer_norm_backward(backend.asarray(rng.normal(size=(4, 3, 5))), x, 5, mean, rstd, w)
    np.testing.assert_allclose(backend.numpy(dx).sum(axis=-1), 0, atol=1e-12)
    assert db is None and dw.shape == (5,)


def test_forward_saves_only_per_row_statistics(backend, rng):
    _y, mean, rstd = F.layer_norm_forward(backend.asarray(rng.normal(size=(2, 3, 4, 5))), (4, 5))
    assert tuple(mean.shape) == tuple(rstd.shape) == (2, 3)


def test_float32_large_mean_as_accurate_as_torch(torch, rng):
    """Two-pass variance: rows of mean 1e4 and unit spread stay accurate in float32."""
    x64 = rng.normal(size=(64, 768)) + 1e4
    x32 = x64.astype(np.float32)
    truth = F.layer_norm(x32.astype(np.float64), 768)  # exact math on the same float32 data
    ours = F.layer_norm(x32, 768)
    theirs = torch.nn.functional.layer_norm(torch.from_numpy(x32), (768,)).numpy()
    err_ours = np.abs(ours - truth).max()
    err_torch = np.abs(theirs - truth).max()
    assert err_ours <= max(2 * err_torch, 1e-3), (err_ours, err_torch)
    # E[x^2]-E[x]^2 in float32 would be off by far more than this
    assert err_ours < 1e-2


def test_float16_computed_in_float32_returned_in_float16(rng):
    x = (rng.normal(size=(3, 8)) * 4).astype(np.float16)
    m = npnorm.LayerNorm(8)
    y = m(x)
    assert y.dtype == np.float16
    ref = F.layer_norm(x.astype(np.float32), 8)
    np.testing.assert_array_equal(y, ref.astype(np.float16))
    dx = m.backward(np.ones_like(x))
    assert dx.dtype == np.float16 and m.grads["weight"].dtype == np.float32


def test_mixed_precision_computes_wide_returns_input_dtype(rng):
    m = npnorm.LayerNorm(6, dtype="float64")
    randomize(m, rng)
    x = rng.normal(size=(2, 6)).astype(np.float32)
    y = m(x)
    assert y.dtype == np.float32
    expect = F.layer_norm(x.astype(np.float64), 6, m.weight, m.bias)
    np.testing.assert_array_equal(y, expect.astype(np.float32))


# --- bad input: clear errors, nothing changed ---------------------------------


def test_wrong_trailing_shape_says_what_was_expected(backend):
    m = npnorm.LayerNorm((3, 4), xp=backend.xp)
    with pytest.raises(ValueError, match=r"\(2, 3, 5\).*\(\*, 3, 4\)"):
        m(backend.asarray(np.zeros((2, 3, 5))))
    with pytest.raises(ValueError, match="normalized shape"):
        m(backend.asarray(np.zeros((4,))))


@pytest.mark.parametrize("dtype", ["int64", "bool", "complex64"])
@pytest.mark.parametrize("layer", [lambda: npnorm.LayerNorm(3), lambda: npnorm.RMSNorm(3)])
def test_non_float_input_is_a_type_error(dtype, layer):
    """As the README says: complex input too (torch's RMSNorm takes it)."""
    with pytest.raises(TypeError, match=f"floating dtype.*got {dtype}"):
        layer()(np.ones((2, 3), dtype=dtype))


def test_an_integer_grad_output_is_a_type_error():
    """As the README says (torch's autograd casts it)."""
    m = npnorm.LayerNorm(3)
    m(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match=r"grad_output must have a floating dtype.*got int64"):
        m.backward(np.ones((2, 3), np.int64))


def test_numpy_bfloat16_input_gets_our_message():
    # ml_dtypes' bfloat16 made NumPy's isdtype raise "dtype argument must be a NumPy dtype"
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((2, 3), dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"must have a floating dtype.*cast them to float32"):
        npnorm.LayerNorm(3)(x)
    with pytest.raises(TypeError, match="must have a floating dtype"):
        F.batch_norm(x.reshape(2, 3, 1), None, None, training=True)


def test_non_array_input_is_a_type_error():
    with pytest.raises(TypeError, match="expected an array"):
        npnorm.LayerNorm(3)([[1.0, 2.0, 3.0]])


def test_backend_mismatch_is_a_type_error(rng):
    import array_api_strict

    m = npnorm.LayerNorm(3)
    with pytest.raises(TypeError, match=r"different array backends.*module\.to\('array_api_strict'\)"):
        m(array_api_strict.asarray(rng.normal(size=(2, 3))))


def test_a_functions_backend_mismatch_names_no_module(rng):
    """A function's hint said "module.to(...) moves a module's arrays" where no module is
    involved."""
    import array_api_strict

    x = array_api_strict.asarray(rng.normal(size=(2, 3)))
    with pytest.raises(
        TypeError, match=r"convert them to one backend first \(the input's: array_api_strict\)"
    ) as err:
        F.layer_norm_forward(x, 3, np.ones(3), None)
    assert "module" not in str(err.value)


def test_failed_forward_keeps_saved_context(rng):
    m = npnorm.LayerNorm(3, dtype="float64")
    randomize(m, rng)
    x, dy = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    m(x)
    state, grads = snapshot(m)
    with pytest.raises(ValueError, match=r"does not end in the normalized shape \(3,\)"):
        m(np.zeros((2, 4)))
    assert_state_equal(m, state, grads)
    dx = m.backward(dy)  # still the first forward's context: the gradient of x, not of the zeros
    expect = npnorm.LayerNorm(3, dtype="float64")
    expect.load_state_dict(m.state_dict())
    expect(x)
    np.testing.assert_array_equal(dx, expect.backward(dy))
    np.testing.assert_array_equal(m.grads["weight"], expect.grads["weight"])


def test_bad_constructor_arguments():
    with pytest.raises(
        ValueError, match="normalized_shape must be a non-empty shape of positive sizes, got 0"
    ):
        npnorm.LayerNorm(0)
    with pytest.raises(ValueError, match=r"eps must be a non-negative number, got -1\.0"):
        npnorm.LayerNorm(3, eps=-1.0)
    with pytest.raises(TypeError, match=r"dtype must be one of .*got 'int32'"):
        npnorm.LayerNorm(3, dtype="int32")


def test_functional_weight_shape_checked():
    with pytest.raises(ValueError, match="weight must have shape"):
        F.layer_norm(np.zeros((2, 3)), 3, np.ones(4))


def test_backward_checks_the_saved_statistics(backend, rng):
    x = backend.asarray(rng.normal(size=(4, 3, 5)))
    _, mean, rstd = F.layer_norm_forward(x, 5)
    dy = backend.asarray(rng.normal(size=(4, 3, 5)))
    with pytest.raises(ValueError, match="one value per row: 12"):
        F.layer_norm_backward(dy, x, 5, mean[:1, :1], rstd)
    with pytest.raises(ValueError, match="rstd must hold one value per row"):
        F.rms_norm_backward(dy, x, 5, rstd[:2, ...])


@pytest.mark.parametrize("eps", [float("nan"), np.float32("nan"), -1e-5])
def test_a_nan_or_negative_eps_is_refused(eps):
    """The README: npnorm refuses a negative or NaN eps, which torch lets through (a NaN
    eps gave NaN outputs)."""
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        npnorm.LayerNorm(4, eps=eps)
