"""gradcheck itself: it passes correct backwards, fails wrong ones, restores state."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import randomize

import npnorm


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
    with pytest.raises(npnorm.GradcheckError, match=which) as info:
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


def test_restores_state_even_when_failing(rng):
    m = WrongLayerNorm(3, which="weight", factor=2.0)
    state, grads = snapshot(m)
    with pytest.raises(npnorm.GradcheckError):
        npnorm.gradcheck(m, rng.normal(size=(2, 3)))
    assert_state_equal(m, state, grads)
    assert m.weight.dtype == np.float32
