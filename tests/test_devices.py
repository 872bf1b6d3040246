"""Results live on the input's device (array_api_strict's second device stands in for a GPU)."""

from __future__ import annotations

import pytest

import npnorm.functional as F

xs = pytest.importorskip("array_api_strict")
D1 = xs.Device("device1")


def _ones(*shape):
    return xs.ones(shape, dtype=xs.float64, device=D1)


def _on_device1(*arrays):
    return all(a is None or a.device == D1 for a in arrays)


@pytest.mark.parametrize("n,spatial", [(3, 4), (0, 4), (3, 0)])
def test_channel_layers_keep_the_inputs_device(n, spatial):
    # empty batches (n=0) and empty instances (spatial=0) take their own path
    x = xs.reshape(xs.arange(n * 6 * spatial, dtype=xs.float64, device=D1), (n, 6, spatial))
    w, b, rm, rv = _ones(6), _ones(6), _ones(6), _ones(6)
    y, mean, rstd, new_mean, new_var = F.batch_norm_forward(x, rm, rv, w, b, True)
    assert _on_device1(y, mean, rstd, new_mean, new_var)
    assert _on_device1(*F.batch_norm_backward(x, x, mean, rstd, w, b, True))
    if n:
        y, mean, rstd = F.group_norm_forward(x, 2, w, b)
        assert _on_device1(y, mean, rstd)
        assert _on_device1(*F.group_norm_backward(x, x, 2, mean, rstd, w, b))
        y, mean, rstd, new_mean, new_var = F.instance_norm_forward(x, rm, rv, w, b, True)
        assert _on_device1(y, mean, rstd, new_mean, new_var)
        assert _on_device1(*F.instance_norm_backward(x, x, mean, rstd, w, b, True))


def test_row_layers_keep_the_inputs_device():
    x, w = _ones(2, 5), _ones(5)
    y, mean, rstd = F.layer_norm_forward(x, 5, w, w)
    assert _on_device1(y, mean, rstd, *F.layer_norm_backward(x, x, 5, mean, rstd, w, w))
    y, rstd = F.rms_norm_forward(x, 5, w)
    assert _on_device1(y, rstd, *F.rms_norm_backward(x, x, 5, rstd, w))
