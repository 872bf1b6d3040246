"""gradcheck itself: it passes correct backwards, fails wrong ones, restores state."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import randomize

import npnorm
import npnorm.functional as F


class WrongLayerNorm(npnorm.LayerNorm):
    """A LayerNorm whose backward is off by ``factor`` in one gradient."""

    def __init__(self, *args, which="input", factor=1.01, **kw):
        super().__init__(*args, **kw)
        self.which, self.factor = which, factor

    def _backward(self, grad_output, saved):
        dx, grads = super()._backward(grad_output, saved)
        if self.which == "input":
            dx = dx * self.factor
        else:
            grads[self.which] = grads[self.which] * self.factor
        return dx, grads


@pytest.mark.parametrize("which", ["input", "weight", "bias"])
def test_fails_on_a_one_percent_error(rng, which):
    m = WrongLayerNorm(5, which=which)
    randomize(m, rng)
    # the report's line for that array (the header names the input shape whatever failed)
    line = r"(?m)^  input: " if which == "input" else rf"(?m)^  grad {which}: "
    with pytest.raises(npnorm.GradcheckError, match=line) as info:
        npnorm.gradcheck(m, rng.normal(size=(3, 5)))
    assert "analytic" in str(info.value) and "numeric" in str(info.value)


def test_fails_when_a_gradient_is_missing(rng):
    class NoBiasGrad(npnorm.LayerNorm):
        def _backward(self, grad_output, saved):
            dx, grads = super()._backward(grad_output, saved)
            grads.pop("bias")
            return dx, grads

    with pytest.raises(npnorm.GradcheckError, match="bias"):
        npnorm.gradcheck(NoBiasGrad(3), rng.normal(size=(2, 3)))


def test_restores_module_state(backend, rng):
    m = npnorm.RMSNorm(4, xp=backend.xp)
    randomize(m, rng)
    x = backend.asarray(rng.normal(size=(2, 4)), "float32")
    m(x)
    m.backward(x)
    m.eval()
    state, grads = snapshot(m)
    assert npnorm.gradcheck(m, backend.asarray(rng.normal(size=(2, 4))))
    assert_state_equal(m, state, grads)
    assert m.dtype == backend.xp.float32 and not m.training
    assert m.backward(x).shape == (2, 4)  # saved context is back too


def test_restores_running_statistics_and_grads_in_their_own_arrays(backend, rng):
    """A training forward updates the buffers in place and a backward adds into the grads
    in place: gradcheck puts their values back, into the same arrays (which a state_dict
    or an optimizer may hold)."""
    m = npnorm.BatchNorm1d(3, dtype="float64", xp=backend.xp)
    x = backend.asarray(rng.normal(size=(4, 3)))
    m(x)
    m.backward(x)
    held = {**m.state_dict(), **{("grad", k): g for k, g in m.grads.items()}}
    state, grads = snapshot(m)
    assert npnorm.gradcheck(m, x)
    assert_state_equal(m, state, grads)
    now = {**m.state_dict(), **{("grad", k): g for k, g in m.grads.items()}}
    assert all(now[k] is v for k, v in held.items())


def test_restores_state_even_when_failing(rng):
    m = WrongLayerNorm(3, which="weight", factor=2.0)
    state, grads = snapshot(m)
    with pytest.raises(npnorm.GradcheckError):
        npnorm.gradcheck(m, rng.normal(size=(2, 3)))
    assert_state_equal(m, state, grads)
    assert m.weight.dtype == np.float32


# --- a plain (forward, backward) pair of functions ------------------------------

PAIRS = {
    "layer_norm": (
        lambda x, w, b: F.layer_norm_forward(x, 4, w, b),
        lambda dy, x, w, b, mean, rstd: F.layer_norm_backward(dy, x, 4, mean, rstd, w, b),
        (3, 4),
    ),
    "rms_norm": (  # no bias: backward returns (dx, dw, None), the None for a bias not passed
        lambda x, w: F.rms_norm_forward(x, 4, w),
        lambda dy, x, w, rstd: F.rms_norm_backward(dy, x, 4, rstd, w),
        (3, 4),
    ),
    "batch_norm": (
        lambda x, w, b: F.batch_norm_forward(x, None, None, w, b, training=True),
        lambda dy, x, w, b, mean, rstd, _rm, _rv: F.batch_norm_backward(
            dy, x, mean, rstd, w, b, training=True
        ),
        (3, 4, 2),
    ),
    "group_norm": (
        lambda x, w, b: F.group_norm_forward(x, 2, w, b),
        lambda dy, x, w, b, mean, rstd: F.group_norm_backward(dy, x, 2, mean, rstd, w, b),
        (2, 4, 3),
    ),
    "instance_norm": (
        lambda x, w, b: F.instance_norm_forward(x, None, None, w, b),
        lambda dy, x, w, b, mean, rstd, _rm, _rv: F.instance_norm_backward(dy, x, mean, rstd, w, b),
        (2, 4, 3),
    ),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_functional_pairs_pass(backend, rng, name):
    forward, backward, shape = PAIRS[name]
    w, b = backend.asarray(rng.uniform(0.5, 1.5, size=4)), backend.asarray(rng.normal(size=4))
    x = backend.asarray(rng.normal(size=shape), "float32")  # checked on a float64 copy
    params = (w, b) if name != "rms_norm" else (w,)
    assert npnorm.gradcheck((forward, backward), x, *params)
    assert npnorm.gradcheck((forward, backward), x, None, *params[1:])  # None: passed, not checked


@pytest.mark.parametrize("which", [0, 1, 2])
def test_pair_fails_on_a_one_percent_error(rng, which):
    forward, backward, shape = PAIRS["layer_norm"]

    def wrong(*args):
        grads = list(backward(*args))
        grads[which] = grads[which] * 1.01
        return tuple(grads)

    name = ["input", "params[0]", "params[1]"][which]
    with pytest.raises(npnorm.GradcheckError, match=rf"(?m)^  {re.escape(name)}: ") as info:
        npnorm.gradcheck((forward, wrong), rng.normal(size=shape), rng.normal(size=4), rng.normal(size=4))
    assert "analytic" in str(info.value) and "numeric" in str(info.value)


def test_pair_with_a_missing_or_extra_gradient(rng):
    forward, backward, shape = PAIRS["layer_norm"]
    x, w, b = rng.normal(size=shape), rng.normal(size=4), rng.normal(size=4)
    with pytest.raises(npnorm.GradcheckError, match=r"no gradient for: params\[0\]"):
        npnorm.gradcheck((forward, lambda *a: (backward(*a)[0], None, backward(*a)[2])), x, w, b)
    with pytest.raises(npnorm.GradcheckError, match=r"2 parameter gradient\(s\) for 1 parameter"):
        npnorm.gradcheck(
            (lambda x, w: forward(x, w, None), lambda dy, x, w, *s: backward(dy, x, w, w, *s)), x, w
        )


def test_pair_of_simple_functions(rng):
    x = rng.normal(size=(2, 3))
    assert npnorm.gradcheck((np.sin, lambda dy, x: dy * np.cos(x)), x)
    with pytest.raises(npnorm.GradcheckError):
        npnorm.gradcheck((np.sin, lambda dy, x: dy * np.sin(x)), x)


@pytest.mark.parametrize("target", [np.sin, "LayerNorm", (np.sin,), (np.sin, np.cos, np.tan), 3])
def test_anything_else_is_a_clear_type_error(rng, target):
    with pytest.raises(
        TypeError, match=r"gradcheck\(module, x\).*gradcheck\(\(forward, backward\), x, \*params\)"
    ):
        npnorm.gradcheck(target, rng.normal(size=3))


def test_plain_function_error_says_what_is_missing(rng):
    with pytest.raises(TypeError, match="a single function has no backward"):
        npnorm.gradcheck(np.sin, rng.normal(size=3))


def test_module_takes_no_params(rng):
    with pytest.raises(TypeError, match="takes no params"):
        npnorm.gradcheck(npnorm.LayerNorm(3), rng.normal(size=(2, 3)), np.ones(3))


class NaNLayerNorm(npnorm.LayerNorm):
    """A LayerNorm whose backward puts a NaN into one gradient."""

    def __init__(self, *args, which="input", **kw):
        super().__init__(*args, **kw)
        self.which = which

    def _backward(self, grad_output, saved):
        dx, grads = super()._backward(grad_output, saved)
        if self.which == "input":
            dx = dx.copy()
            dx[0, 1] = np.nan
        else:
            grads[self.which] = np.full_like(grads[self.which], np.nan)
        return dx, grads


@pytest.mark.parametrize("which", ["input", "weight", "bias"])
def test_fails_on_a_nan_gradient(rng, which):
    # NaN compares false with everything: a tolerance test written as err > tol passed it
    line = r"(?m)^  input: 1 of " if which == "input" else rf"(?m)^  grad {which}: 5 of 5 .*nan"
    with pytest.raises(npnorm.GradcheckError, match=line):
        npnorm.gradcheck(NaNLayerNorm(5, which=which), rng.normal(size=(3, 5)))
    pair = (lambda x: x**2, lambda dy, x: dy * 2 * x + np.where(x > 0, np.nan, 0.0))
    with pytest.raises(npnorm.GradcheckError, match="nan"):
        npnorm.gradcheck(pair, np.array([-1.0, 2.0]))


def test_fails_where_the_forward_gives_nan():
    # the numeric gradient is NaN there: nothing is checked, so the check cannot pass
    pair = (lambda x: x * np.nan, lambda dy, x: dy * 123.0)
    with pytest.raises(npnorm.GradcheckError, match="nan"):
        npnorm.gradcheck(pair, np.array([1.0, 2.0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_projection_is_not_the_users_own_draw(seed):
    # x from default_rng(seed) was exactly the projection u with the same seed: for a layer
    # that ignores the input's scale (LayerNorm, RMSNorm) the true dx is then ~0, and a
    # 1% error in dx passed
    x = np.random.default_rng(seed).standard_normal((8, 16))
    for m in (WrongLayerNorm(16, which="input"), WrongLayerNorm(16, which="input", factor=1.1)):
        with pytest.raises(npnorm.GradcheckError, match=r"(?m)^  input: "):
            npnorm.gradcheck(m, x, seed=seed)


def test_rms_norm_default_eps_is_the_modules_dtype_not_float64(rng):
    # eps=None is the machine epsilon of the compute dtype: the float64 check must
    # differentiate the float32 layer's function (eps 1.2e-7), not one with eps 2.2e-16,
    # whose curvature near a zero row defeats finite differences
    x = rng.normal(size=(4, 4)).astype(np.float32)
    x[1] = 0.0
    m = npnorm.RMSNorm(4)
    assert npnorm.gradcheck(m, x)
    assert m.eps is None and m.dtype == np.float32
    assert npnorm.gradcheck(npnorm.RMSNorm(6), (1e-5 * rng.normal(size=(4, 6))).astype(np.float32))


def test_failure_message_says_it_ran_in_float64(rng):
    with pytest.raises(npnorm.GradcheckError, match="in float64"):
        npnorm.gradcheck(WrongLayerNorm(5), rng.normal(size=(3, 5)).astype(np.float32))


def test_a_forward_that_drops_to_float32_is_named_in_the_failure(rng):
    """A forward that casts to float32 fails a correct backward (finite differences of
    float32 rounding, ~1e-2 off): the message says so, where it blamed the backward alone;
    a forward in float64 has no such note."""
    x = rng.normal(size=(3, 4))
    in_float32 = (lambda x: np.sin(x).astype(np.float32), lambda dy, x: dy * np.cos(x))
    with pytest.raises(npnorm.GradcheckError, match="forward returned float32 output for the float64 input"):
        npnorm.gradcheck(in_float32, x)
    with pytest.raises(npnorm.GradcheckError) as failed:
        npnorm.gradcheck((np.sin, lambda dy, x: dy * np.sin(x)), x)
    assert "Note" not in str(failed.value)

    class Float32LayerNorm(npnorm.LayerNorm):  # a module whose forward casts its output
        def _forward(self, input):
            y, saved, updates = super()._forward(input)
            return y.astype(np.float32), saved, updates

    with pytest.raises(npnorm.GradcheckError, match="forward returned float32 output"):
        npnorm.gradcheck(Float32LayerNorm(4), x)


PAIR = (lambda x: x * 2, lambda dy, x: dy * 2)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"eps": 0}, ValueError, r"eps \(the finite-difference step\) must be positive"),
        ({"eps": float("inf")}, ValueError, "must be positive and finite"),
        ({"atol": "1e-5"}, TypeError, "atol must be a number"),
        ({"rtol": None}, TypeError, "rtol must be a number"),
        ({"atol": -1.0}, ValueError, "atol must be a non-negative number"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": -1}, ValueError, "seed must be a non-negative int"),  # was NumPy's bare message
    ],
)
def test_bad_options_name_the_argument(kwargs, error, match):
    # they surfaced as ZeroDivisionError, UFuncTypeError or a bare operand TypeError
    for target in (PAIR, npnorm.LayerNorm(3)):
        with pytest.raises(error, match=match):
            npnorm.gradcheck(target, np.arange(6.0).reshape(2, 3), **kwargs)


def test_bad_x_or_forward_output_is_a_clear_type_error():
    with pytest.raises(TypeError, match="x: expected an array"):  # was AttributeError with params
        npnorm.gradcheck((lambda x, w: x * w, lambda dy, x, w: (dy * w, dy * x)), None, np.ones(()))
    with pytest.raises(TypeError, match=r"forward must return the output array.*got list"):
        npnorm.gradcheck((lambda x: [x * 2], lambda dy, x: dy * 2), np.arange(3.0))
    with pytest.raises(TypeError, match="got tuple whose first item is a list"):
        npnorm.gradcheck((lambda x: ([x], x), lambda dy, x, s: dy), np.arange(3.0))


def test_bad_backward_output_is_a_clear_type_error():
    """A pair's backward that returns a list, or None for dx: what it must return
    (the list was taken whole as dx, then 'no gradient for params[0]'; None as an
    'analytic gradient of shape ()')."""
    forward = lambda x, w: x * w  # noqa: E731
    x, w = np.arange(3.0), np.full(3, 2.0)
    with pytest.raises(TypeError, match=r"backward must return dx, or a tuple.*got list"):
        npnorm.gradcheck((forward, lambda dy, x, w: [dy * w, dy * x]), x, w)
    with pytest.raises(TypeError, match="got a tuple whose first item is NoneType"):
        npnorm.gradcheck((forward, lambda dy, x, w: (None, dy * x)), x, w)


class MovingCentre(npnorm.Module):
    """A layer whose training output reads the buffer it updates: ``y = (x - m_new)*w``,
    ``m_new = 0.5*running + 0.5*mean(x)`` (as online normalizations do)."""

    _parameter_names = ("weight",)
    _buffer_names = ("running",)

    def __init__(self, *, dtype=None, xp=None):
        super().__init__(dtype=dtype, xp=xp)
        self.weight = self.xp.asarray([1.5, 0.5, 2.0], dtype=self.dtype)
        self.running = self.xp.asarray([3.0, -1.0, 0.5], dtype=self.dtype)

    def _forward(self, x):
        m = 0.5 * self.running + 0.5 * np.mean(x, axis=0)  # 3
        return (x - m) * self.weight, (x, m, self.weight), {"running": m}

    def _backward(self, dy, saved):
        x, m, w = saved
        dx = dy * w - 0.5 * np.mean(dy * w, axis=0)  # the mean's path
        return dx, {"weight": np.sum(dy * (x - m), axis=0)}


def test_every_forward_of_the_check_sees_the_buffers_it_started_from(rng):
    """Finite differences of a training forward that reads a buffer it updates: every
    evaluation starts from the buffers the check found (each forward updated them, and
    the check failed a right backward by 1e5); the buffer is restored after."""
    m = MovingCentre(dtype="float64")
    assert npnorm.gradcheck(m, rng.normal(size=(4, 3)))
    np.testing.assert_array_equal(m.running, [3.0, -1.0, 0.5])


@pytest.mark.parametrize("value", [np.asarray(2), 2.0], ids=["int64 array", "python float"])
def test_a_parameter_that_cannot_be_perturbed_is_a_clear_type_error(rng, value):
    """An integer parameter (``xp.asarray(2)``) truncated the finite-difference step
    (numeric gradient 2.5e5 against a right 0.5); a Python float raised AttributeError."""

    class Scale(npnorm.Module):
        _parameter_names = ("g",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.g = value

        def _forward(self, x):
            return x * self.g, (x, self.g), {}

        def _backward(self, dy, saved):
            return dy * saved[1], {"g": np.sum(dy * saved[0])}

    with pytest.raises(TypeError, match=r"Scale\.g .*(dtype int64, not a floating|not an array)"):
        npnorm.gradcheck(Scale(), rng.normal(size=(2, 3)))


def test_the_failure_message_keeps_each_array_on_its_line():
    """Six values in scientific notation (a gradient of mixed magnitudes) wrapped onto a
    second line with no indentation."""
    from npnorm.gradient_check import _report

    analytic = np.array([-321.23456, 4.2123456e-8, 451.23456, 2.3123456e-7, -24.123456, -431.23456])
    text = _report("input", analytic, 1.5 * analytic, 1e-5, 1e-3)
    lines = text.splitlines()
    assert len(lines) == 3 and all(line.startswith("  ") for line in lines), lines


class COrderedReader(npnorm.Module):
    """A LayerNorm over the last axis whose backward reads the saved input as if it were
    C-ordered (as compiled code may): right on contiguous input, wrong on a strided view."""

    _parameter_names = ("weight",)

    def __init__(self, d):
        super().__init__(dtype="float64")
        self.weight = np.linspace(0.5, 1.5, d)

    def _forward(self, x):
        xc = x - x.mean(-1, keepdims=True)
        rstd = 1 / np.sqrt((xc**2).mean(-1, keepdims=True) + 1e-5)
        return xc * rstd * self.weight, (x, rstd, self.weight), {}

    def _backward(self, dy, saved):
        x, rstd, w = saved
        if self.c_ordered_read:  # from the view's lowest address, within the memory it spans
            low = x[tuple(slice(None, None, -1 if step < 0 else 1) for step in x.strides)]
            x = np.lib.stride_tricks.as_strided(low, x.shape, (x.shape[1] * x.itemsize, x.itemsize))
        xhat = (x - x.mean(-1, keepdims=True)) * rstd
        g = dy * w
        dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
        return dx, {"weight": (dy * xhat).sum(0)}


@pytest.mark.parametrize("layout", ["sliced", "reversed", "sliced float32"])
def test_the_check_runs_on_the_inputs_own_layout(layout):
    """A strided NumPy view is checked in its own memory layout, so that a backward
    wrong only for such a layout fails (the float64 copy was contiguous: it passed); a
    right backward passes on every layout, and x is left as it was."""
    base = np.random.default_rng(0).standard_normal((3, 8))
    views = {
        "sliced": base[:, ::2],
        "reversed": base[::-1, ::-2],
        "sliced float32": base.astype(np.float32)[:, 1::2],
    }
    x = views[layout]
    before = x.copy()
    m = COrderedReader(4)
    m.c_ordered_read = True
    with pytest.raises(npnorm.GradcheckError):
        npnorm.gradcheck(m, x)
    m.c_ordered_read = False
    assert npnorm.gradcheck(m, x)
    assert npnorm.gradcheck(m, np.broadcast_to(base[:1, :4], (3, 4)))  # elements sharing memory
    np.testing.assert_array_equal(x, before)


def test_the_report_names_the_worst_failing_element_not_the_largest_error():
    """The element with the largest |analytic - numeric| can be a large gradient within its
    tolerance (rtol * |numeric|); the report names the failing one, by error over tolerance."""
    forward = lambda x: np.stack([1e3 * x[0] ** 2 / 2, 1e-2 * x[1]])  # noqa: E731
    backward = lambda dy, x: np.stack([1e3 * x[0] * dy[0] * 1.0005, 1.1e-2 * dy[1]])  # noqa: E731
    with pytest.raises(npnorm.GradcheckError, match=r"1 of 2 elements differ; worst at \(1,\)"):
        npnorm.gradcheck((forward, backward), np.ones(2))


def test_a_module_whose_forward_returns_a_tuple_is_a_clear_type_error(rng):
    class TwoOutputs(npnorm.Module):
        def _forward(self, x):
            return (2 * x, 3 * x), (), {}

        def _backward(self, dy, saved):
            return 2 * dy, {}

    with pytest.raises(TypeError, match="forward returned a tuple, not an array"):
        npnorm.gradcheck(TwoOutputs(dtype="float64"), rng.normal(size=(2, 3)))


def test_a_forward_that_changes_its_input_in_place_is_named(rng):
    """Every perturbed evaluation would start from another point: the numeric gradients
    came out ~1e7 and the failure blamed the backward."""

    def forward(x, w):
        x *= 2  # in place
        return x * w

    with pytest.raises(npnorm.GradcheckError, match=r"forward changed x in place"):
        npnorm.gradcheck((forward, lambda dy, x, w: (dy * w, dy * x)), rng.normal(size=3), np.ones(3))

    def forward_w(x, w):
        w += 1
        return x * w

    with pytest.raises(npnorm.GradcheckError, match=r"forward changed params\[0\] in place"):
        npnorm.gradcheck((forward_w, lambda dy, x, w: (dy * w, dy * x)), rng.normal(size=3), np.ones(3))

    class Doubling(npnorm.Module):
        def _forward(self, x):
            x *= 2
            return x, (), {}

        def _backward(self, dy, saved):
            return 2 * dy, {}

    x = rng.normal(size=(2, 3))
    before = x.copy()
    with pytest.raises(npnorm.GradcheckError, match="Doubling's forward changed its input in place"):
        npnorm.gradcheck(Doubling(dtype="float64"), x)
    np.testing.assert_array_equal(x, before)  # the check's own copy took it


def test_a_missing_gradient_names_the_check(rng):
    with pytest.raises(npnorm.GradcheckError, match=r"gradcheck failed for \(.*no gradient for: params"):
        npnorm.gradcheck((lambda x, w: x * w, lambda dy, x, w: dy * w), rng.normal(size=3), np.ones(3))


def test_a_module_forward_that_changes_its_parameter_in_place_is_named(rng):
    class Growing(npnorm.Module):
        _parameter_names = ("w",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.w = np.ones(3)

        def _forward(self, x):
            self.w += 1  # in place
            return x * self.w, (x, self.w.copy()), {}

        def _backward(self, dy, saved):
            return dy * saved[1], {"w": (dy * saved[0]).sum(0)}

    m = Growing()
    with pytest.raises(npnorm.GradcheckError, match="Growing's forward changed w in place"):
        npnorm.gradcheck(m, rng.normal(size=(2, 3)))
    np.testing.assert_array_equal(m.w, 1.0)  # restored


class _ScaledNorm(npnorm.Module):
    """y = g * x / ||x|| over the last axis (ScaleNorm); ``in_place`` names what its
    backward changes in place: "dy" (scaled by g: a memory-saving habit) or "x" (divided
    by the norm), else nothing. The gradient it returns is right either way."""

    _parameter_names = ("g",)

    def __init__(self, in_place=None):
        super().__init__(dtype="float64")
        self.g = np.asarray(2.0)
        self.in_place = in_place

    def _forward(self, x):
        norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        return self.g * x / norm, (x, norm, self.g), {}

    def _backward(self, dy, saved):
        x, norm, g = saved
        if self.in_place == "x":
            x /= norm
            u = x
        else:
            u = x / norm
        dg = np.sum(dy * u)
        if self.in_place == "dy":
            dy *= g
            dxhat = dy
        else:
            dxhat = dy * g
        return (dxhat - u * np.sum(dxhat * u, axis=-1, keepdims=True)) / norm, {"g": dg}


@pytest.mark.parametrize("in_place,named", [("dy", "its grad_output"), ("x", "its input")])
def test_a_backward_that_changes_its_arrays_in_place_is_named(rng, in_place, named):
    """A right backward that scaled its grad_output in place failed as '15 of 15 elements
    differ' (the check's projection had changed), and one that divided its saved input in
    place as wrong values; torch's gradcheck passes the first."""
    x = rng.normal(size=(3, 5))
    assert npnorm.gradcheck(_ScaledNorm(), x)
    with pytest.raises(npnorm.GradcheckError, match=f"_ScaledNorm's backward changed {named} in place"):
        npnorm.gradcheck(_ScaledNorm(in_place), x)


def test_a_pair_whose_backward_changes_dy_or_x_in_place_is_named(rng):
    def backward_dy(dy, x, w):
        dy *= w  # in place
        return dy, dy * x / w

    def backward_x(dy, x, w):
        x *= dy  # in place: dL/dw
        return dy * w, x

    for backward, named in ((backward_dy, "dy"), (backward_x, "x")):
        with pytest.raises(npnorm.GradcheckError, match=rf"backward changed {named} in place"):
            npnorm.gradcheck((lambda x, w: x * w, backward), rng.normal(size=3), np.full(3, 2.0))


@pytest.mark.parametrize(
    "dtype",
    [np.int64, np.bool_, np.complex128, np.longdouble],
    ids=["int64", "bool", "complex", "longdouble"],
)
def test_x_or_a_param_of_a_dtype_the_layers_refuse_is_a_type_error(rng, dtype):
    """The check ran on a float64 copy and returned True for an input the layer itself
    refuses (integer LayerNorm input), and dropped a complex one's imaginary part."""
    x = (rng.normal(size=(3, 4)) * 4).astype(dtype)
    with pytest.raises(TypeError, match=rf"gradcheck: x must have a floating dtype .*got {np.dtype(dtype)}"):
        npnorm.gradcheck(npnorm.LayerNorm(4), x)
    pair = (lambda x, w: x * w, lambda dy, x, w: (dy * w, dy * x))
    with pytest.raises(TypeError, match=r"gradcheck: params\[0\] must have a floating dtype"):
        npnorm.gradcheck(pair, rng.normal(size=4), np.ones(4, dtype))


def test_a_module_holding_another_is_refused_and_the_inner_one_left_alone(rng):
    """Modules do not nest: the check returned True having checked only the outer
    module's own parameter, and left the inner BatchNorm's counter, running statistics and
    grads changed."""

    class BatchNormThenScale(npnorm.Module):
        _parameter_names = ("s",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.bn = npnorm.BatchNorm1d(3, dtype="float64")
            self.s = np.asarray(1.5)

        def _forward(self, x):
            y = self.bn(x)
            return self.s * y, (y, self.s), {}

        def _backward(self, dy, saved):
            y, s = saved
            return self.bn.backward(dy * s), {"s": np.sum(dy * y)}

    m = BatchNormThenScale()
    state, grads = snapshot(m.bn)
    with pytest.raises(TypeError, match=r"BatchNormThenScale\.bn is an npnorm Module\. Modules do not nest"):
        npnorm.gradcheck(m, rng.normal(size=(4, 3)))
    assert_state_equal(m.bn, state, grads)


class WrongWeightGrad(npnorm.BatchNorm1d):
    def _backward(self, grad_output, saved):
        dx, grads = super()._backward(grad_output, saved)
        return dx, {**grads, "weight": 2 * grads["weight"]}  # wrong


@pytest.mark.parametrize("hold", ["list of lists", "dict of lists", "namespace", "set in a tuple"])
def test_a_module_held_deeper_in_containers_is_refused_too(rng, hold):
    """The refusal looked one container deep: a BatchNorm (with a wrong weight gradient) held
    in a list of lists passed the check, its counter and running statistics changed."""
    import types

    inner = WrongWeightGrad(3, dtype="float64")
    held = {
        "list of lists": ([[inner]], r"Outer\.inner\[0\]\[0\]"),
        "dict of lists": ({"stage": [inner]}, r"Outer\.inner\['stage'\]\[0\]"),
        "namespace": (types.SimpleNamespace(bn=inner), r"Outer\.inner\.bn"),
        "set in a tuple": ((1, {inner}), r"an item of Outer\.inner\[1\]"),
    }
    value, where = held[hold]

    class Outer(npnorm.Module):
        _parameter_names = ("s",)

        def __init__(self):
            super().__init__(dtype="float64")
            self.s = np.asarray(1.5)
            self.inner = value

        def _forward(self, x):
            y = inner(x)
            return self.s * y, (y,), {}

        def _backward(self, dy, saved):
            return inner.backward(dy * self.s), {"s": np.sum(dy * saved[0])}

    m = Outer()
    m.inner_cycle = [m.inner]  # a cycle through containers ends
    m.inner_cycle.append(m.inner_cycle)
    state, grads = snapshot(inner)
    with pytest.raises(TypeError, match=where + r" is an npnorm Module\. Modules do not nest"):
        npnorm.gradcheck(m, rng.normal(size=(4, 3)))
    assert_state_equal(inner, state, grads)


def test_the_search_for_held_modules_ends_fast_on_shared_and_deep_containers():
    """The search remembered only the containers on its path: a list holding another twice,
    40 levels down, took for ever (2**40 paths), and lists nested 500 deep hit the recursion
    limit."""
    m = npnorm.LayerNorm(3, dtype="float64")
    shared: list = []
    for _ in range(40):
        shared = [shared, shared]
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    m.held = (shared, deep)
    assert npnorm.gradcheck(m, np.random.default_rng(0).normal(size=(2, 3)))
    deep_inner: list = [npnorm.LayerNorm(3)]
    for _ in range(5000):
        deep_inner = [deep_inner]
    m.held = deep_inner
    with pytest.raises(TypeError, match=r"LayerNorm\.held\[0\]\[0\].* is an npnorm Module"):
        npnorm.gradcheck(m, np.ones((2, 3)))


def test_a_backward_whose_sums_change_order_passes_within_nondet_tol(rng):
    """Two backwards of one forward must agree bit for bit by default (as torch's); one that
    sums in another order from call to call (threads) needs nondet_tol, as in torch."""
    calls = []

    def backward(dy, x, w):
        calls.append(1)
        rows = dy * x if len(calls) % 2 else (dy * x)[::-1]
        return dy * w, np.add.reduce(rows, axis=0)

    forward = lambda x, w: x * w  # noqa: E731
    x, w = rng.normal(size=(50, 3)), rng.normal(size=3)
    with pytest.raises(npnorm.GradcheckError, match=r"not reentrant.*pass nondet_tol="):
        npnorm.gradcheck((forward, backward), x, w)
    assert npnorm.gradcheck((forward, backward), x, w, nondet_tol=1e-12)

    def inf_the_second_time(dy, x, w):
        calls.append(1)
        dw = np.sum(dy * x, axis=0)
        return dy * w, dw if len(calls) % 2 else np.where(np.arange(3) == 0, np.inf, dw)

    with pytest.raises(npnorm.GradcheckError, match="not reentrant"):  # not close at any tol, as torch's
        npnorm.gradcheck((forward, inf_the_second_time), x, w, nondet_tol=float("inf"))
    with pytest.raises(ValueError, match="nondet_tol must be a non-negative number"):
        npnorm.gradcheck((forward, backward), x, w, nondet_tol=-1.0)


class ScratchInSaved(npnorm.Module):
    """y = s * x / |x|, whose backward uses the saved x / |x| as scratch (``u *= ...``):
    right on the first backward of a forward, wrong on the second."""

    _parameter_names = ("s",)

    def __init__(self):
        super().__init__(dtype="float64")
        self.s = np.asarray(1.5)

    def _forward(self, x):
        n = np.sqrt(np.sum(x * x))
        u = x / n
        return self.s * u, (u, n), {}

    def _backward(self, dy, saved):
        u, n = saved
        ds = np.sum(dy * u)
        g = self.s * dy
        proj = np.sum(g * u)
        dx = (g - proj * u) / n
        u *= proj  # scratch: the saved u is gone
        return dx, {"s": ds}


def test_a_backward_that_is_right_only_once_fails_as_not_reentrant(rng):
    """A backward that overwrote what its forward saved passed the check (one backward),
    where torch's gradcheck says "Backward is not reentrant"; a second backward of the same
    forward gave a dx off by 1. The check runs the backward twice now."""
    x = rng.normal(size=(2, 3))
    with pytest.raises(npnorm.GradcheckError, match=r"ScratchInSaved's backward is not reentrant.*grad s"):
        npnorm.gradcheck(ScratchInSaved(), x)

    def forward(x):
        n = np.sqrt(np.sum(x * x))
        return x / n, x / n, n

    def backward(dy, x, u, n):
        dx = (dy - np.sum(dy * u) * u) / n
        u *= 2.0  # scratch
        return dx

    with pytest.raises(npnorm.GradcheckError, match=r"gradcheck: backward is not reentrant.*input"):
        npnorm.gradcheck((forward, backward), x)
    calls = []

    def first_call_only(dy, x):  # right once, then zero
        calls.append(1)
        return dy * 2 if len(calls) == 1 else dy * 0

    with pytest.raises(npnorm.GradcheckError, match="not reentrant"):
        npnorm.gradcheck((lambda x: x * 2, first_call_only), x)
    w = rng.normal(size=3)

    def dw_once(dy, x, w):  # a parameter's gradient, then None
        calls.append(1)
        return dy * w, (np.sum(dy * x, axis=0) if len(calls) % 2 else None)

    def dw_reshaped(dy, x, w):  # the same values, another shape the second time
        calls.append(1)
        dw = np.sum(dy * x, axis=0)
        return dy * w, (dw if len(calls) % 2 else dw[None])

    calls.clear()
    with pytest.raises(npnorm.GradcheckError, match=r"not reentrant.*params\[0\] \(given once only\)"):
        npnorm.gradcheck((lambda x, w: x * w, dw_once), x, w)
    calls.clear()
    with pytest.raises(
        npnorm.GradcheckError, match=r"not reentrant.*params\[0\] \(shapes \(3,\) and \(1, 3\)\)"
    ):
        npnorm.gradcheck((lambda x, w: x * w, dw_reshaped), x, w)
    with pytest.raises(  # and a first gradient of the wrong shape, before any second call
        npnorm.GradcheckError, match=r"input: the analytic gradient has shape \(1, 3\), expected \(2, 3\)"
    ):
        npnorm.gradcheck((lambda x, w: x * w, lambda dy, x, w: ((dy * w)[:1], np.sum(dy * x, axis=0))), x, w)
    assert npnorm.gradcheck(npnorm.LayerNorm(3), x)  # npnorm's own: a second backward is the first's


def test_a_module_backward_without_an_input_gradient_says_so(rng):
    """A module's _backward returning None for dx was 'the analytic gradient has shape ()'."""

    class NoInputGrad(npnorm.LayerNorm):
        def _backward(self, grad_output, saved):
            return None, super()._backward(grad_output, saved)[1]

    with pytest.raises(npnorm.GradcheckError, match="backward produced no gradient for: input"):
        npnorm.gradcheck(NoInputGrad(4), rng.normal(size=(3, 4)))


def test_a_pair_on_a_backend_without_float64_is_a_clear_type_error():
    """JAX without x64 made the check's float64 copies float32, silently, and a correct pair
    failed with a note blaming its forward; a device without float64 gave the backend's
    ValueError. (The module path said so already.)"""
    xs = pytest.importorskip("array_api_strict")
    pair = (lambda x: x * 2, lambda dy, x: dy * 2)
    x = xs.asarray([1.0, 2.0, 3.0], dtype=xs.float32, device=xs.Device("no_float64"))
    with pytest.raises(TypeError, match=r"gradcheck runs in float64: .*no float64 arrays on device"):
        npnorm.gradcheck(pair, x)
    jax = pytest.importorskip("jax")
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        import jax.numpy as jnp

        with pytest.raises(TypeError, match=r"gradcheck runs in float64: .*jax_enable_x64"):
            npnorm.gradcheck((jnp.sin, lambda dy, x: dy * jnp.cos(x)), jnp.ones(3, dtype=jnp.float32))
    finally:
        jax.config.update("jax_enable_x64", x64)


def test_a_pair_parameter_gradient_that_is_not_an_array_is_a_clear_type_error(rng):
    """A str or dict gradient failed in float(); a list was taken."""
    forward = lambda x, w: x * w  # noqa: E731
    x, w = np.arange(3.0), np.full(3, 2.0)
    for bad in ("oops", {"w": 1}, [1.0, 2.0, 3.0]):
        with pytest.raises(
            TypeError, match=r"gradient for params\[0\] must be an array.*got " + type(bad).__name__
        ):
            npnorm.gradcheck((forward, lambda dy, x, w, bad=bad: (dy * w, bad)), x, w)
    with pytest.raises(TypeError, match=r"backward must return dx, or a tuple.*got an empty tuple"):
        npnorm.gradcheck((forward, lambda dy, x, w: ()), x, w)
    with pytest.raises(TypeError, match=r"forward must return the output array.*got an empty tuple"):
        npnorm.gradcheck((lambda x: (), lambda dy, x: dy), x)


def test_a_module_that_skipped_super_init_is_told_so(rng):
    class NoInit(npnorm.Module):
        def __init__(self):
            self.dtype = np.float64

    with pytest.raises(TypeError, match=r"NoInit.__init__ did not call super\(\).__init__"):
        npnorm.gradcheck(NoInit(), rng.normal(size=3))


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_gradcheck_gives_back_the_grads_dict_a_caller_holds(rng):
    """After the check, ``m.grads`` is the same dict as before, with the same gradients (an
    optimizer holding it kept a dict the module no longer used)."""
    m = npnorm.LayerNorm(4, dtype="float64")
    x = rng.normal(size=(3, 4))
    m(x)
    m.backward(np.ones_like(x))
    held = m.grads
    before = {k: v.copy() for k, v in held.items()}
    assert npnorm.gradcheck(m, x)
    assert held is m.grads and held.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(held[k], before[k])


def test_an_input_whose_elements_share_memory_is_checked_on_a_copy():
    """A strided view whose rows overlap (as_strided): perturbing one element moves others,
    so the check works on a copy; laid out as the input, it failed a right backward."""
    x = np.lib.stride_tricks.as_strided(np.arange(12.0), (3, 4), (16, 8))  # rows share 2 values
    assert npnorm.gradcheck(npnorm.LayerNorm(4, dtype="float64"), x)


def test_a_module_held_in_a_frozenset_is_refused(rng):
    """A frozenset is looked into as a set is."""

    class Holder(npnorm.LayerNorm):
        pass

    m = Holder(3, dtype="float64")
    m.extra = frozenset({npnorm.LayerNorm(3, dtype="float64")})
    with pytest.raises(TypeError, match=r"an item of Holder\.extra is an npnorm Module"):
        npnorm.gradcheck(m, rng.normal(size=(2, 3)))
