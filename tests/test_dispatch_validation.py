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


def test_an_array_where_the_shape_goes_is_named_not_printed():
    """A weight passed where normalized_shape goes (``F.layer_norm_forward(x, w)``) printed
    its 768 values, a 3.5 KB message. An array of more than a few values is now named by its
    shape and dtype, and the functions say where the shape goes (an array in its place is
    most likely a weight, mean or rstd one argument early); the module, whose first argument
    it is, says no more; a short array keeps its repr."""
    x, w = np.ones((4, 768), np.float32), np.ones(768, np.float32)
    named = r"got an array of shape \(768,\) and dtype float32 \(ndarray\)"
    for forward in (F.layer_norm_forward, F.rms_norm):
        with pytest.raises(
            TypeError,
            match=named + r" \(an array where the shape goes: normalized_shape comes right after input\)$",
        ):
            forward(x, w)
    _, mean, rstd = F.layer_norm_forward(x, 768)
    after = r"\(an array where the shape goes: normalized_shape comes right after grad_output and input\)$"
    with pytest.raises(TypeError, match=r"got array\(\[1\., 1\., 1\., 1\.\], dtype=float32\) " + after):
        F.layer_norm_backward(x, x, mean, rstd, w)
    with pytest.raises(TypeError, match=named + "$"):
        npnorm.LayerNorm(w)
    with pytest.raises(
        ValueError, match=r"positive sizes, got an array of shape \(12,\) and dtype int64 \(ndarray\)$"
    ):
        F.layer_norm_forward(x, np.zeros(12, np.int64))
    with pytest.raises(TypeError, match=r"got 768\.0$"):  # not an array: its repr, no hint
        F.layer_norm_forward(x, 768.0)


def test_an_array_where_a_number_or_flag_goes_is_named_not_printed():
    """The same for eps, training, momentum and a count (an array one argument off among
    the positional ones: each printed its 768 values), and a module's dtype, xp and device."""
    x, w = np.ones((4, 768), np.float32), np.ones(768, np.float32)
    named = r"got an array of shape \(768,\) and dtype float32 \(ndarray\)"
    with pytest.raises(TypeError, match="eps must be a non-negative number, " + named + "$"):
        F.layer_norm_forward(x, 768, w, w, w)
    with pytest.raises(TypeError, match="training must be a bool, " + named + "$"):
        F.batch_norm_forward(x, w, w, w, w, w)
    with pytest.raises(TypeError, match="momentum must be a number, " + named + "$"):
        F.batch_norm_forward(x, w, w, w, w, True, w)
    with pytest.raises(TypeError, match="num_groups must be a positive int, " + named + "$"):
        F.group_norm_forward(np.ones((2, 768, 3), np.float32), w)
    with pytest.raises(TypeError, match=r"eps must be a non-negative number, got array\(\[1\., 1\.\]"):
        F.layer_norm_forward(x, 768, eps=np.ones(2))  # a short one keeps its repr
    with pytest.raises(TypeError, match=r"dtype must be one of .*, " + named + "$"):
        npnorm.LayerNorm(768, dtype=w)
    with pytest.raises(TypeError, match=r"xp must be None, .*, " + named + r" \(a dtype goes"):
        npnorm.LayerNorm(768, xp=w)
    with pytest.raises(
        ValueError, match=r"^device=an array of shape \(768,\) and dtype float32 \(ndarray\) is not"
    ):
        npnorm.LayerNorm(768, device=w)


def test_what_an_error_shows_of_a_value_is_bounded_and_never_raises():
    """Up to 8 values an array keeps its repr, from 9 it is named; a longer list or tuple is
    cut short, and an int array of 768 sizes as normalized_shape (7.5 KB before) is not
    spelled out; rms_norm_backward and the module's train(mode) show the same; a value whose
    shape raises (torch's nested tensors) gets its repr, not the shape's exception."""
    x = np.ones((4, 768), np.float32)
    with pytest.raises(TypeError, match=r"got array\(\[1\., 1\., 1\., 1\., 1\., 1\., 1\., 1\.\]\)$"):
        F.layer_norm_forward(x, 768, eps=np.ones(8))
    with pytest.raises(TypeError, match=r"got an array of shape \(9,\) and dtype float64 \(ndarray\)$"):
        F.layer_norm_forward(x, 768, eps=np.ones(9))
    with pytest.raises(TypeError, match=r"got \[1\.0, 1\.0, 1\.0, 1\.0, 1\.0, 1\.0, 1\.0, 1\.0, \.\.\.\]$"):
        F.layer_norm_forward(x, [1.0] * 768)
    with pytest.raises(
        ValueError,
        match=r"shape \(1, 2, 3, 4, 5, 6, 7, 8, \.\.\.\): expected an input of shape \(\*, the 768 sizes",
    ) as err:
        F.layer_norm_forward(x, np.arange(1, 769))
    assert len(str(err.value)) < 300
    rstd = np.ones(4, np.float32)
    with pytest.raises(TypeError, match=r"normalized_shape comes right after grad_output and input\)$"):
        F.rms_norm_backward(x, x, rstd, np.ones(768, np.float32))
    with pytest.raises(
        ValueError, match=r"bool, got an array of shape \(4, 768\) and dtype float32 \(ndarray\)$"
    ):
        npnorm.LayerNorm(768).train(x)

    class Odd:  # an object whose shape raises, as a nested tensor's does
        dtype = np.float32

        @property
        def shape(self):
            raise RuntimeError("no sizes here")

        def __repr__(self):
            return "Odd()"

    with pytest.raises(TypeError, match=r"eps must be a non-negative number, got Odd\(\)$"):
        F.layer_norm_forward(x, 768, eps=Odd())


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
