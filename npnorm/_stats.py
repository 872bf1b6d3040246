"""The one statistics helper every layer uses, and its backward.

Every normalization layer in npnorm is the same computation over a different set of
axes (Ba et al. 2016, "Layer Normalization", eq. 4; Ioffe & Szegedy 2015, alg. 1):

    mean = E[x]                   (over ``axes``; 0 when ``center=False``)
    var  = E[(x - mean)^2]        (biased, two-pass; E[x^2] when ``center=False``)
    rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd

LayerNorm reduces over the trailing axes, RMSNorm is the same call with ``center=False``
(Zhang & Sennrich 2019), GroupNorm reduces over (channels in a group, spatial),
InstanceNorm over spatial, BatchNorm over (batch, spatial).

The variance is two-pass: the mean is removed before squaring, so a large common
offset (say rows with mean 1e4 in float32) does not cancel catastrophically as it
would in E[x^2] - E[x]^2. The squares are summed in float64 when the input is
float32 (where the backend has float64): a float32 value beyond ~1.8e19 squares to
infinity, and the statistics of a finite input stay finite (the variance of
``[1e30, -1e30, 0, 0]`` is 5e59; its rstd, 1.4e-30, fits float32 again).

docs/derivations/ derives :func:`standardize_backward` from the chain rule, node by
node; ``npnorm.learn`` runs that staged backward and checks each step of it.
"""

from __future__ import annotations

from ._backend import Array, Namespace
from ._checks import cast

Axes = tuple[int, ...]


def square_dtype(xp: Namespace, dtype: object) -> object:
    """The dtype squares of ``dtype`` values are summed in: float64 where the backend
    has it (float32 squares overflow above ~1.8e19), else ``dtype``."""
    wide = getattr(xp, "float64", None)
    return dtype if wide is None else xp.result_type(dtype, wide)


def moments(xp: Namespace, x: Array, axes: Axes, *, center: bool = True) -> tuple[Array | None, Array]:
    """Mean (``None`` when ``center=False``) and biased variance of ``x`` over ``axes``.

    Both keep the reduced axes (size 1) so that they broadcast against ``x``. The mean
    has ``x``'s dtype; the variance is in ``square_dtype`` (float64).
    """
    wide = square_dtype(xp, x.dtype)
    if center:
        mean = xp.mean(x, axis=axes, keepdims=True)  # reduced axes -> 1
        xc = cast(xp, x - mean, wide)  # same shape as x
        var = xp.mean(xc * xc, axis=axes, keepdims=True)  # reduced axes -> 1
        return mean, var
    xw = cast(xp, x, wide)  # same shape as x
    ms = xp.mean(xw * xw, axis=axes, keepdims=True)  # mean square, reduced axes -> 1
    return None, ms


def rstd_of(xp: Namespace, var: Array, eps: float, dtype: object) -> Array:
    """``1 / sqrt(var + eps)``, computed in ``var``'s dtype and returned in ``dtype``."""
    return cast(xp, 1.0 / xp.sqrt(var + eps), dtype)


def standardize(
    xp: Namespace, x: Array, axes: Axes, eps: float, *, center: bool = True
) -> tuple[Array, Array | None, Array]:
    """``(xhat, mean, rstd)`` of ``x`` over ``axes``; mean and rstd keep dims, in
    ``x``'s dtype."""
    mean, var = moments(xp, x, axes, center=center)
    rstd = rstd_of(xp, var, eps, x.dtype)  # reduced axes -> 1
    xhat = (x - mean if mean is not None else x) * rstd  # same shape as x
    return xhat, mean, rstd


def xhat_from(x: Array, mean: Array | None, rstd: Array) -> Array:
    """Recompute the normalized input from the saved statistics.

    Backward passes recompute ``xhat`` rather than saving it: the saved statistics
    are one number per reduced group instead of one per element (memory for compute).
    """
    return (x - mean if mean is not None else x) * rstd


def standardize_backward(
    xp: Namespace, dxhat: Array, xhat: Array, rstd: Array, axes: Axes, *, center: bool = True
) -> Array:
    """Gradient ``dx`` through ``xhat = (x - mean) * rstd`` with batch statistics.

    ``dxhat`` is the gradient of the loss with respect to ``xhat`` (``dy * w`` after an
    affine map). With means over the ``n`` reduced elements, the chain rule through
    ``x``, ``mean`` and ``rstd`` gives three terms, one per path from ``x`` to ``xhat``:

        term 1 (direct path):       rstd * dxhat
        term 2 (through the mean):  -rstd * mean(dxhat)
        term 3 (through the var):   -rstd * xhat * mean(dxhat * xhat)

    so that ``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``.
    Without centring (RMSNorm) there is no mean, and no term 2.
    (docs/derivations/batch_norm_training.md collapses the staged backward into these.)
    """
    proj = xp.mean(dxhat * xhat, axis=axes, keepdims=True)  # reduced axes -> 1: mean(dxhat * xhat)
    inner = dxhat - xhat * proj  # (term 1 + term 3) / rstd
    if center:
        inner = inner - xp.mean(dxhat, axis=axes, keepdims=True)  # + term 2 / rstd
    return inner * rstd  # same shape as x: dx
