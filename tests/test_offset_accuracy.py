"""float32 data with a large common offset (mean 1e3, spread 1): the compiled kernels are
at least as accurate as PyTorch's CPU kernels, measured against float64 on the same
float32 data. (Their statistics accumulate in float64; the backward's error comes from
the saved float32 mean, as PyTorch's does.)"""

from __future__ import annotations

import numpy as np
import pytest

import npnorm

pytest.importorskip("numba", reason="the compiled kernels need numba (the 'fast' extra)")

LAYERS = {
    "LayerNorm": ((64, 768), lambda c, d, dt: npnorm.LayerNorm(d, dtype=dt)),
    "RMSNorm": ((64, 768), lambda c, d, dt: npnorm.RMSNorm(d, dtype=dt)),
    "BatchNorm2d": ((8, 16, 12, 12), lambda c, d, dt: npnorm.BatchNorm2d(c, dtype=dt)),
    "GroupNorm": ((8, 16, 12, 12), lambda c, d, dt: npnorm.GroupNorm(4, c, dtype=dt)),
    "InstanceNorm2d": ((8, 16, 12, 12), lambda c, d, dt: npnorm.InstanceNorm2d(c, dtype=dt)),
}


def _torch_layer(torch, name, c, d):
    return {
        "LayerNorm": lambda: torch.nn.LayerNorm(d),
        "RMSNorm": lambda: torch.nn.RMSNorm(d),
        "BatchNorm2d": lambda: torch.nn.BatchNorm2d(c),
        "GroupNorm": lambda: torch.nn.GroupNorm(4, c),
        "InstanceNorm2d": lambda: torch.nn.InstanceNorm2d(c),
    }[name]()


def _error(a, truth):
    return float(np.abs(np.asarray(a, dtype=np.float64) - truth).max() / np.abs(truth).max())


def _ours_and_float64(name, seed):
    """``(x, dy, y, dx, y64, dx64)``: float32 data with offset 1e3, the compiled kernels'
    output and dx, and the reference's in float64 on the same values."""
    shape, make = LAYERS[name]
    c, d = shape[1], shape[-1]
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) + 1e3).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    with npnorm.use_kernels("reference"):
        m64 = make(c, d, "float64")
        y64 = m64(x.astype(np.float64))
        dx64 = m64.backward(dy.astype(np.float64))
    with npnorm.use_kernels("numba"):
        m = make(c, d, "float32")
        y = m(x)
        dx = m.backward(dy)
    return x, dy, y, dx, y64, dx64


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(LAYERS))
def test_float32_with_offset_1e3_rounds_like_float32_only(name, seed):
    """Without PyTorch too: statistics taken in float64 leave the float32 output off the
    float64 one by float32 rounding only (a float32 sum of the row misses this)."""
    _, _, y, _, y64, _ = _ours_and_float64(name, seed)
    assert _error(y, y64) <= 3e-7, "output: float64 statistics give float32 rounding only"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(LAYERS))
def test_float32_with_offset_1e3_at_least_as_accurate_as_torch(torch, name, seed):
    x, dy, y, dx, y64, dx64 = _ours_and_float64(name, seed)
    c, d = x.shape[1], x.shape[-1]
    ref = _torch_layer(torch, name, c, d)
    xt = torch.tensor(x, requires_grad=True)
    ref(xt).backward(torch.tensor(dy))
    yt = ref(torch.tensor(x)).detach().numpy()
    assert _error(y, y64) <= _error(yt, y64), "output"
    assert _error(dx, dx64) <= 1.1 * _error(xt.grad.numpy(), dx64) + 1e-7, "dx"
