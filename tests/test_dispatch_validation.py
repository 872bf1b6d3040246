"""The validation and dispatch layer's own rules, each pinned where a one-spot change of
``npnorm/functional/_dispatch.py``, ``npnorm/_checks.py`` or ``npnorm/_backend.py`` went
unnoticed by the other tests: kernel registration and lookup, another backend's kernels
under "reference", the namespace cache, gradcheck's NaN-equals-NaN test of changes in
place, a module that is no array backend as xp."""

from __future__ import annotations

import array_api_compat
import array_api_compat.numpy as xp
import numpy as np
import pytest

import npnorm
import npnorm.functional as F
from npnorm._backend import namespace_of
from npnorm.functional import _dispatch
from npnorm.functional._dispatch import NUMPY, family_kernel, generic_kernel, kernel


@pytest.mark.parametrize("family", [None, "reference", "cuda"])
def test_a_numpy_kernel_must_name_its_family(family):
    """A NumPy kernel registered without a known fast family is refused, not stored."""
    with pytest.raises(ValueError, match="a NumPy kernel must name its family"):
        _dispatch.specialized("layer_norm_forward", NUMPY, kernels=family)
    assert ("layer_norm_forward", family) not in _dispatch._SPECIALIZED


@pytest.mark.parametrize("family", ["cuda", "Numba", ""])
def test_family_kernel_refuses_an_unknown_family_as_set_kernels_does(family):
    """An unknown family name is set_kernels' ValueError listing the available ones."""
    with pytest.raises(ValueError, match=r"unknown or unavailable kernels.*available: reference, numpy"):
        family_kernel("layer_norm_forward", family)


def test_another_backends_own_kernels_run_unless_reference_is_selected(monkeypatch):
    """A backend's own kernels (CuPy's fused ones) run for its arrays, except under
    "reference", which runs the generic kernels for every backend."""
    strict = pytest.importorskip("array_api_strict")
    ns = array_api_compat.array_namespace(strict.asarray([1.0]))

    def own(*args):  # pragma: no cover - looked up, never called
        raise AssertionError

    monkeypatch.setitem(_dispatch._SPECIALIZED, ("layer_norm_forward", ns.__name__), own)
    with _dispatch.use_kernels("numpy"):
        assert kernel("layer_norm_forward", ns) is own
        assert kernel("layer_norm_backward", ns) is generic_kernel("layer_norm_backward")
    with _dispatch.use_kernels("reference"):
        assert kernel("layer_norm_forward", ns) is generic_kernel("layer_norm_forward")
        assert kernel("layer_norm_forward", xp) is generic_kernel("layer_norm_forward")


def test_numpy_and_backends_with_a_provider_have_own_kernels():
    """NumPy and CuPy have kernels of their own; array_api_strict and torch run the generic ones."""
    assert _dispatch.has_own_kernels(NUMPY)
    assert _dispatch.has_own_kernels("array_api_compat.cupy")
    assert not _dispatch.has_own_kernels("array_api_strict")
    assert not _dispatch.has_own_kernels("array_api_compat.torch")


@pytest.mark.parametrize("shape", [0, (0,), (), [], (6, 0), [6, -1], np.int64(0)])
def test_normalized_shape_must_be_non_empty_and_positive(shape):
    """0, an empty shape or a size of 0 or less is a ValueError, as torch refuses them."""
    with pytest.raises(ValueError, match="normalized_shape must be a non-empty shape of positive sizes"):
        F.layer_norm_forward(np.ones((2, 6), np.float32), shape)


@pytest.mark.parametrize("shape", [True, np.True_, (True,), (6, False)])
def test_a_bool_is_not_a_normalized_shape(shape):
    """A bool (numpy's too), alone or in a sequence, is a TypeError, not a size of 1 or 0."""
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints"):
        F.layer_norm_forward(np.ones((2, 1), np.float32), shape)


class _Duck:
    """An Array API object whose namespace is its own attribute, not its type's."""

    def __init__(self, namespace):
        self.namespace = namespace

    def __array_namespace__(self, api_version=None):
        return self.namespace


def test_the_namespace_is_cached_only_for_types_that_decide_it():
    """The namespace is cached by array type only for NumPy, CuPy and torch arrays, whose
    type decides it: arrays of another type each give their own namespace."""
    strict = pytest.importorskip("array_api_strict")
    for ns in (strict, xp, strict):
        assert namespace_of(_Duck(ns)) is ns


def test_gradcheck_takes_a_nan_left_as_it_was_as_unchanged():
    """An input NaN the forward leaves alone is not a change in place (NaN equals NaN in
    the before/after comparison): the check passes."""

    def masked(x):
        return np.where(np.isnan(x), 0.0, x)

    pair = (lambda x: masked(x) ** 2, lambda dy, x: dy * 2 * masked(x))
    assert npnorm.gradcheck(pair, np.array([1.0, np.nan, -2.0]))


def test_xp_whose_empty_makes_no_array_is_a_clear_error():
    """A module whose empty() makes something no Array API namespace takes (JAX's sparse
    BCOO) is no array backend: the ValueError a module without empty() gets."""
    pytest.importorskip("jax.experimental.sparse")
    with pytest.raises(ValueError, match=r"xp='jax.experimental.sparse' is not an array backend"):
        npnorm.LayerNorm(3).to("jax.experimental.sparse")
