"""torch tensors as an array backend (xp="torch"), as the README documents it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import randomize

import npnorm

LAYERS = [
    (lambda **kw: npnorm.LayerNorm((2, 3), **kw), (4, 2, 3)),
    (lambda **kw: npnorm.RMSNorm(3, **kw), (4, 3)),
    (lambda **kw: npnorm.BatchNorm2d(2, **kw), (3, 2, 2, 2)),
    (lambda **kw: npnorm.GroupNorm(2, 4, **kw), (2, 4, 3)),
    (lambda **kw: npnorm.InstanceNorm1d(2, affine=True, track_running_stats=True, **kw), (2, 2, 5)),
]


@pytest.mark.parametrize("make,shape", LAYERS)
def test_torch_backend_matches_numpy(torch, rng, make, shape):
    on_torch, on_numpy = make(xp="torch", dtype="float64"), make(dtype="float64")
    randomize(on_numpy, rng)
    on_torch.load_state_dict(on_numpy.state_dict())
    for training in (True, False):
        on_torch.train(training)
        on_numpy.train(training)
        x, dy = rng.normal(size=shape), rng.normal(size=shape)
        y = on_torch(torch.from_numpy(x))
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float64
        np.testing.assert_allclose(y.numpy(), on_numpy(x), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            on_torch.backward(torch.from_numpy(dy)).numpy(), on_numpy.backward(dy), rtol=1e-12, atol=1e-12
        )
    for k, v in on_numpy.state_dict().items():
        np.testing.assert_allclose(on_torch.state_dict()[k].numpy(), v, rtol=1e-12, err_msg=k)
    for k, v in on_numpy.grads.items():
        np.testing.assert_allclose(on_torch.grads[k].numpy(), v, rtol=1e-12, atol=1e-12, err_msg=k)
    assert npnorm.gradcheck(on_torch.train(), torch.from_numpy(rng.normal(size=shape)))


def test_torch_tensor_into_a_numpy_module_suggests_the_torch_backend(torch):
    with pytest.raises(TypeError, match=r"module\.to\('torch'\).*xp='torch'"):
        npnorm.LayerNorm(4)(torch.randn(2, 4))
    m = npnorm.LayerNorm(4).to("torch")  # what the message says works
    assert isinstance(m(torch.randn(2, 4)), torch.Tensor)
