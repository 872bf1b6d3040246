"""Long rows in float32: a row (or group, or instance) of millions of values has statistics
within some float32 roundings in every kernel family, as the README's "accumulated in
float64" promises. The "numpy" family's float32 BLAS dots lost digits with the row's length
(an rstd 4e-6 off at 2**22 normal values, 3e-4 at 2**26; 2.5e-4 at 2**22 values of 0.1)."""

from __future__ import annotations

import numpy as np
import pytest

import npnorm
import npnorm.functional as F

FAMILIES = npnorm.kernels_available()
D = 1 << 22


@pytest.fixture(scope="module", params=["normal", "constant"])
def rows(request):
    if request.param == "normal":
        x = np.random.default_rng(0).normal(5.0, 3.0, size=(2, D)).astype(np.float32)
    else:  # no rounding cancels another: a float32 dot of 2**16 of them was 1e-5 off
        x = np.stack([np.full(D, 0.1, np.float32), np.linspace(0.5, 1.5, D, dtype=np.float32)])
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(x64.var(axis=1) + 1e-5)
    rms = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1) + 1e-5)
    return x, x64.mean(axis=1), rstd, rms


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_of_long_rows_are_as_exact_as_short_rows(family, rows):
    x, mean, rstd, rms = rows
    tol = 1e-6  # some float32 roundings, whatever the length
    with npnorm.use_kernels(family):
        _, m, r = F.layer_norm_forward(x, (D,))
        _, rr = F.rms_norm_forward(x, (D,), eps=1e-5)
        _, _, gr = F.group_norm_forward(x.reshape(2, 4, D // 4), 1)
        _, _, ir, _, _ = F.instance_norm_forward(x.reshape(1, 2, D))
    np.testing.assert_allclose(m, mean, rtol=tol)
    for got, want, what in (
        (r, rstd, "LayerNorm"),
        (rr, rms, "RMSNorm"),
        (gr, rstd, "GroupNorm"),
        (ir, rstd, "IN"),
    ):
        np.testing.assert_allclose(np.ravel(got), want, rtol=tol, err_msg=what)
