"""Code a user writes against npnorm's public API, checked by ``mypy --strict`` in CI
(``.ci/run``): correct code must type-check. Not a test module (pytest skips the folder's
files: their names do not start with ``test_``); tests/test_typed_usage.py runs it."""

from __future__ import annotations

import numpy as np

import npnorm
import npnorm.functional as F


@npnorm.no_grad()  # the decorator form the README shows
def infer(m: npnorm.LayerNorm, x: np.ndarray) -> np.ndarray:
    y: np.ndarray = m(x)
    return y


@npnorm.no_grad  # bare, as torch.no_grad takes it
def infer_bare(m: npnorm.LayerNorm, x: np.ndarray) -> np.ndarray:
    y: np.ndarray = m(x)
    return y


def main() -> None:
    x = np.ones((2, 4), dtype=np.float32)
    ln: npnorm.LayerNorm = npnorm.LayerNorm(4).to(dtype="float64").train()  # methods return the layer
    bn = npnorm.BatchNorm2d(3).eval()
    assert bn.running_mean is not None  # an attribute of BatchNorm2d, not of Module
    with npnorm.enable_grad():
        y = ln(x.astype(np.float64))
        ln.backward(np.ones_like(y))
    infer(ln, x.astype(np.float64))
    infer_bare(ln, x.astype(np.float64))
    npnorm.set_num_threads(np.int64(1))  # any integer
    _, mean, rstd = F.layer_norm_forward(x, 4)
    dx, dw, db = F.layer_norm_backward(x, x, 4, mean, rstd)
    assert dw is None and db is None and dx.shape == x.shape


if __name__ == "__main__":
    main()
