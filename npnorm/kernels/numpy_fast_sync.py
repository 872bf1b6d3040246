"""Fast NumPy kernels of SyncBatchNorm's per-rank pieces, built from BatchNorm's sweeps.

Same signatures and results (to rounding) as the generic kernels in
``npnorm.functional.sync_batch_norm``; registered for NumPy arrays. They are the
BatchNorm kernels of ``numpy_fast_channels`` cut where the ranks communicate:

* ``sync_batch_norm_moments``: BatchNorm's statistics sweep (per row mean, residual and
  M2, merged per channel with Chan et al.'s formula in float64): the rank's mean and
  biased variance per channel.
* ``sync_batch_norm_grad_sums``: BatchNorm's backward sums sweep: per channel
  ``sum(dy)``, ``sum(dy*(x - mean))`` and ``sum(x - mean)`` (x centred first, as there).
* ``sync_batch_norm_dx``: BatchNorm's dx sweep ``dx = a_c*dy + b_c*(x - mean_c) + c_c``
  with coefficients from the *global* means of ``dy``, ``dy*(x - mean)`` and ``x - mean``
  (xhat centred again where BatchNorm's kernel centres it: a large common offset).

(The normalization sweep needs no kernel of its own: it is BatchNorm's inference
forward with the global statistics.) BatchNorm1d's (N, C) input and channels-last input
take BatchNorm's sweeps over columns (``numpy_fast_columns``; dx in the input's layout).
Empty inputs go to the generic kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._backend import Namespace, no_fp_warnings
from .._checks import prod, work_dtype
from ..functional._dispatch import generic_kernel, specialized
from . import numpy_fast_columns as columns
from ._blocks import as_vector, block_rows, extreme_spread, param
from .numpy_fast_channels import (
    NS,
    CoefficientOverflow,
    _batch_dx_coefficients,
    _batch_dx_sweep,
    _foldable,
    _grad_sums_sweep,
    _merge_rows,
    _Ring,
    _row_moments,
    _rows,
)


@specialized("sync_batch_norm_moments", NS, kernels="numpy")
@no_fp_warnings
def sync_batch_norm_moments(xp: Namespace, input: np.ndarray, ct: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per channel mean (in ``ct``) and biased variance (float64) of a non-empty input,
    as the generic kernel returns them."""
    ct = np.dtype(ct)
    N, C = int(input.shape[0]), int(input.shape[1])
    cols = columns.columns_of(None, input)  # BatchNorm1d's (N, C), channels-last input
    if cols is not None:
        return columns.moments(cols[0][0], ct)  # C, C
    return _merge_rows(*_row_moments(_rows(input, C, ct), ct), N, C, prod(input.shape[2:]))  # C, C


@specialized("sync_batch_norm_grad_sums", NS, kernels="numpy")
@no_fp_warnings
def sync_batch_norm_grad_sums(
    xp: Namespace, grad_output: np.ndarray, input: np.ndarray, mean: np.ndarray, rstd: np.ndarray, ct: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel ``sum(dy)``, ``sum(dy*(x - mean))`` and ``sum(x - mean)``, one sweep: each
    (sample, channel) row summed in the data's dtype, the rows added in float64."""
    if input.size == 0:
        return generic_kernel("sync_batch_norm_grad_sums")(xp, grad_output, input, mean, rstd, ct)
    ct = np.dtype(ct)
    N, C = int(input.shape[0]), int(input.shape[1])
    m = as_vector(mean, C, ct)  # C
    cols = columns.columns_of(None, input, grad_output)  # BatchNorm1d's (N, C), channels-last input
    if cols is not None:
        (x2, dy2), _ = cols
        col_xc = np.empty(C)  # C float64: sum(x - mean)
        col_dy, col_dyxc = columns.grad_sums(dy2, x2, ct, m, True, xc_sums=col_xc)  # C, C float64
        assert col_dyxc is not None
        return col_dy, col_dyxc, col_xc
    rows_x = _rows(input, C, ct)
    center = _Ring(m, block_rows(rows_x.R, rows_x.L, ct.itemsize))  # dy*(x - mean), never folded
    sxc = np.empty(rows_x.R, dtype=ct)  # R: sum(x - mean)
    sdy, sdx = _grad_sums_sweep(_rows(grad_output, C, ct), rows_x, ct, center, True, xc_sums=sxc)  # R, R
    assert sdx is not None
    # the samples added in float64
    sum_dy = np.add.reduce(sdy.reshape((N, C)), axis=0, dtype=np.float64)  # C
    sum_dyxc = np.add.reduce(sdx.reshape((N, C)), axis=0, dtype=np.float64)  # C
    sum_xc = np.add.reduce(sxc.reshape((N, C)), axis=0, dtype=np.float64)  # C
    return sum_dy, sum_dyxc, sum_xc


@specialized("sync_batch_norm_dx", NS, kernels="numpy")
@no_fp_warnings
def sync_batch_norm_dx(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    mean_dy: np.ndarray,
    mean_dyxc: np.ndarray,
    mean_xc: np.ndarray,
) -> np.ndarray:
    """``dx = a*(dy - mean_G(dy)) + b*(x - mean)`` with ``a = rstd*w``,
    ``b = -rstd^3*w*mean_G(dy*(x - mean))``: one sweep (dy centred before it is scaled).
    Where BatchNorm's kernel centres xhat again (a mean far from 0 against the spread,
    not ``_foldable``), so does this one, on ``mean_G(x - mean)``."""
    ct = np.dtype(work_dtype(xp, input, weight, mean))
    C = int(input.shape[1])
    m, r = as_vector(mean, C, ct), as_vector(rstd, C, ct)  # C, C
    if input.size == 0 or extreme_spread(r, ct):  # nothing to sweep, or
        # coefficients that underflow or overflow ct
        return generic_kernel("sync_batch_norm_dx")(
            xp, grad_output, input, mean, rstd, weight, mean_dy, mean_dyxc, mean_xc
        )
    f64 = np.dtype(np.float64)
    mean_dy64, mean_dyxc64 = as_vector(mean_dy, C, f64), as_vector(mean_dyxc, C, f64)  # C, C
    fold = _foldable(m, r)  # (else: a large offset, and xhat is centred again)
    mean_xc64 = None if fold else as_vector(mean_xc, C, f64)  # C
    try:  # BatchNorm's dx coefficients, with the global means as the sums over one value
        coefs = _batch_dx_coefficients(
            ct, m, r, param(weight, C, ct), mean_dy64, mean_dyxc64, 1.0, fold, sum_xc=mean_xc64
        )
    except CoefficientOverflow:
        return generic_kernel("sync_batch_norm_dx")(
            xp, grad_output, input, mean, rstd, weight, mean_dy, mean_dyxc, mean_xc
        )
    cols = columns.columns_of(None, input, grad_output)  # BatchNorm1d's (N, C), channels-last input
    if cols is not None:  # dx in the input's layout
        (x2, dy2), _ = cols
        dx, dx2 = columns.new_like(input, input.dtype)
        columns.batch_dx(dy2, x2, dx2, ct, *coefs)
        return dx
    rows_x, rows_dy = _rows(input, C, ct), _rows(grad_output, C, ct)
    dx = np.empty(input.shape, dtype=input.dtype)
    _batch_dx_sweep(rows_dy, rows_x, dx, ct, coefs, block_rows(rows_x.R, rows_x.L, ct.itemsize))
    return dx
