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
would in E[x^2] - E[x]^2. The statistics and ``xhat`` are computed in float64 when
the input is float32 (where the backend has float64), then rounded once:

* a float32 sum of values near 3e38 overflows, and a float32 value beyond ~1.8e19
  squares to infinity; in float64 the statistics of a finite input stay finite (the
  variance of ``[1e30, -1e30, 0, 0]`` is 5e59; its rstd, 1.4e-30, fits float32 again);
* a float32 mean carries a rounding error of up to half a unit in its last place, which
  ``x - mean`` passes on to every output: at a common offset of 1e3 times the spread
  that is ~3e-5 of the spread, more than torch's float32 kernels lose; in float64
  the output is as exact as float32 can hold it;
* a constant float32 row's float64 mean is the constant exactly, so ``x - mean`` is
  exactly 0 (the output is the bias; with ``eps=0``, NaN as in torch), not rounding
  noise scaled up by ``rstd``. (A float64 row has no wider dtype: its mean may be off by
  a rounding, which ``eps`` makes harmless; with ``eps=0`` such a constant row gives
  ±1 where torch gives NaN.)

docs/derivations/ derives :func:`standardize_backward` from the chain rule, node by
node; ``npnorm.learn`` runs that staged backward and checks each step of it.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from ._backend import Array, Namespace, no_fp_warnings
from ._checks import cast, prod

Axes = tuple[int, ...]

# A row centred on its mean rounded to float32 is off by that rounding, up to half an ulp
# of the mean: with a large common offset (1e3 times the spread) that is 3e-5 of the
# spread in every output, and a constant row's output is not exactly the bias (its values
# differ from the rounded mean by that rounding, its "spread"). Rows (channels, in
# SyncBatchNorm) whose mean is more than this many standard deviations from 0 are centred
# again on what the rounding lost (the numpy family's ``recentre``) or normalized with the
# float64 statistics (SyncBatchNorm); below it the rounding costs a few ulps, as the
# reference's float64 statistics do.
RECENTRE_ABOVE = 4.0


def square_dtype(xp: Namespace, a: Array) -> object:
    """The dtype squares of ``a``'s values are summed in: float64 where the backend has
    it on ``a``'s device (float32 squares overflow above ~1.8e19), else ``a``'s dtype
    (JAX without x64; a device without float64, such as torch's "mps": every layer
    raised there, asking for float64)."""
    wide = getattr(xp, "float64", None)
    if wide is None or not _float64_on(xp, a):
        return a.dtype
    return xp.result_type(a.dtype, wide)


def _float64_on(xp: Namespace, a: Array) -> bool:
    """Whether ``a``'s device has float64, as the namespace's inspection API says
    (``__array_namespace_info__().dtypes(device=...)``), asked once per device; True
    where it cannot say. NumPy is not asked, nor JAX, whose answer follows its x64 flag
    (which ``result_type`` follows too: a cached answer went stale when it was turned on)."""
    device = getattr(a, "device", None)  # (the Array API's attribute: no namespace lookup)
    try:
        known = _FLOAT64_ON.get((xp, device))
    except TypeError:  # a device that is no dict key
        return _device_has_float64(xp, device)
    if known is None:
        known = _FLOAT64_ON[(xp, device)] = _device_has_float64(xp, device)
    return known


_FLOAT64_ON: dict[tuple[Namespace, Any], bool] = {}  # (namespace, device): what _device_has_float64 said


def _device_has_float64(xp: Namespace, device: Any) -> bool:
    if array_api_compat.is_numpy_namespace(xp) or array_api_compat.is_jax_namespace(xp):
        return True
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        return True
    try:
        floats = info().dtypes(device=device, kind="real floating")
    except Exception:  # an older namespace, or a device it does not list: assume it has it
        return True
    return "float64" in floats


def wide_sum(xp: Namespace, a: Array, axes: Axes, *, keepdims: bool = False) -> Array:
    """``sum(a)`` over ``axes``, accumulated in ``square_dtype`` (float64) and returned in
    that dtype: the backwards' sums over many values. A float32 sum loses digits there:
    NumPy adds along a strided axis (BatchNorm's samples, LayerNorm's rows) one value
    after another, and ~1e5 values of ``dy`` with a common part of 1e3 kept three digits
    of ``mean(dy)`` (dx off by 20% of its size, PyTorch's by 3e-5)."""
    return xp.sum(a, axis=axes, keepdims=keepdims, dtype=square_dtype(xp, a))


def wide_mean(xp: Namespace, a: Array, axes: Axes) -> Array:
    """``mean(a)`` over ``axes`` (kept as size-1 axes), accumulated as ``wide_sum`` and
    returned in ``a``'s dtype."""
    n = 1
    for axis in axes:
        n *= int(a.shape[axis])
    return cast(xp, wide_sum(xp, a, axes, keepdims=True) / n, a.dtype)


def moments(xp: Namespace, x: Array, axes: Axes, *, center: bool = True) -> tuple[Array | None, Array]:
    """Mean (``None`` when ``center=False``) and biased variance of ``x`` over ``axes``
    (without centring: the mean square), both in ``square_dtype`` (float64).

    Both keep the reduced axes (size 1) so that they broadcast against ``x``.
    """
    xw = cast(xp, x, square_dtype(xp, x))  # same shape as x, float64
    if center:
        mean = xp.mean(xw, axis=axes, keepdims=True)  # reduced axes -> 1
        xc = xw - mean  # same shape as x
        var = xp.mean(xc * xc, axis=axes, keepdims=True)  # reduced axes -> 1
        return mean, var
    ms = xp.mean(xw * xw, axis=axes, keepdims=True)  # mean square, reduced axes -> 1
    return None, ms


def rstd_of(xp: Namespace, var: Array, eps: float, dtype: object) -> Array:
    """``1 / sqrt(var + eps)``, computed in ``var``'s dtype and returned in ``dtype``."""
    return cast(xp, 1.0 / xp.sqrt(var + eps), dtype)


def as_rows(xp: Namespace, a: Array, D: int) -> Array:
    """``a``, whose trailing axes hold D values (D > 0), as rows: shape (R, D). An empty
    ``a`` becomes a new (0, D) array: dask cannot reshape a zero-length axis merged with a
    chunked one."""
    return reshaped(xp, a, (prod(a.shape) // D, D))


def reshaped(xp: Namespace, a: Array, shape: tuple[int, ...]) -> Array:
    """``a`` reshaped to ``shape``; an empty ``a`` as a new empty array of that shape (dask
    cannot reshape a zero-length axis merged with, or split from, a chunked one)."""
    if prod(a.shape) == 0:
        return xp.zeros(shape, dtype=a.dtype, device=array_api_compat.device(a))
    return xp.reshape(a, shape)


def standardize(
    xp: Namespace, x: Array, axes: Axes, eps: float, *, center: bool = True
) -> tuple[Array, Array | None, Array]:
    """``(xhat, mean, rstd)`` of ``x`` over ``axes``, computed in float64
    (``square_dtype``) and returned in ``x``'s dtype; mean and rstd keep dims."""
    mean, var = moments(xp, x, axes, center=center)  # reduced axes -> 1, float64
    rstd = rstd_of(xp, var, eps, var.dtype)  # reduced axes -> 1, float64
    xhat = centred(xp, x, mean) * rstd  # same shape as x, float64
    return cast(xp, xhat, x.dtype), None if mean is None else cast(xp, mean, x.dtype), cast(xp, rstd, x.dtype)


def centred(xp: Namespace, x: Array, mean: Array | None) -> Array:
    """``x - mean`` (``x`` where ``mean`` is None) in the dtype of ``mean`` (float64 from
    ``moments``): the offset is removed before anything rounds to ``x``'s dtype."""
    if mean is None:
        return x
    return cast(xp, x, mean.dtype) - mean


def xhat_from(x: Array, mean: Array | None, rstd: Array) -> Array:
    """Recompute the normalized input from the saved statistics.

    Backward passes recompute ``xhat`` rather than saving it: the saved statistics
    are one number per reduced group instead of one per element (memory for compute).
    """
    return (x - mean if mean is not None else x) * rstd


def centred_again(xp: Namespace, xhat: Array, axes: Axes) -> Array:
    """``xhat`` as the backward recomputes it, centred again on its mean over ``axes`` (one
    statistic's values), as the layers take it before ``dweight`` and
    :func:`standardize_backward`.

    ``xhat`` has mean 0, but the backward recomputes it from the mean as saved, rounded to
    the input's dtype. On a nearly constant row (rstd ~300 at eps = 1e-5) that rounding
    made ``mean(xhat)`` 1e-4, which term 3 of dx multiplied by ``mean(dxhat)``: a constant
    ``dy``, whose exact ``dx`` is 0, gave float32 ``dx`` of 1e-2 (3x PyTorch's error there;
    now 1e-7). And ``dweight = sum(dy * xhat)`` took ``rstd * mean(x - mean) * sum(dy)``
    with it (float32 at offset 1e3 and spread 1e-3: 3e-2 of dweight, as PyTorch's).
    """
    return xhat - wide_mean(xp, xhat, axes)  # same shape as xhat: centred again


@no_fp_warnings  # (0 * inf where dy is infinite)
def less_centre(xp: Namespace, dot: Array, xi: Array, total: Array) -> Array:
    """``sum(dy * (x - mean - xi))`` from ``dot = sum(dy * (x - mean))`` and ``total =
    sum(dy)`` (or the same as means): the sums of xhat centred again on ``xi``, the mean of
    ``x - mean`` that the saved mean's rounding left (:func:`centred_again`). Left as it was
    where ``xi * total`` is not finite (an infinite dy), so that no NaN comes of inf - inf."""
    shift = xi * total
    return dot - xp.where(xp.isfinite(shift), shift, xp.zeros_like(shift))


def standardize_backward(
    xp: Namespace,
    dxhat: Array,
    xhat: Array,
    rstd: Array,
    axes: Axes,
    *,
    center: bool = True,
    weight: Array | None = None,
) -> Array:
    """Gradient ``dx`` through ``xhat = (x - mean) * rstd`` with batch statistics.

    ``dxhat`` is the gradient of the loss with respect to ``xhat`` (``dy * w`` after an
    affine map). With means over the ``n`` reduced elements, the chain rule through
    ``x``, ``mean`` and ``rstd`` gives three terms, one per path from ``x`` to ``xhat``:

        term 1 (direct path):       rstd * dxhat
        term 2 (through the mean):  -rstd * mean(dxhat)
        term 3 (through the var):   -rstd * xhat * mean(dxhat * xhat)

    so that ``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``.
    Without centring (RMSNorm) there is no mean, and no term 2. The two means are
    accumulated in float64 (``wide_mean``), and term 2 comes before term 3: a common part
    of ``dxhat`` (``dy = 1e3 + noise``) cancels there exactly, before anything rounds at
    its scale.

    With ``center``, ``xhat`` has mean 0 over ``axes``: the layers recompute it from the
    saved mean, rounded to the input's dtype, and pass it through :func:`centred_again`
    first (before they take dweight from it too).

    Where the affine weight is one number per statistic (BatchNorm's and InstanceNorm's
    channels), pass ``dy`` as ``dxhat`` and the weight, shaped as ``rstd``, as ``weight``:
    ``dxhat = dy * w`` with ``w`` constant over the reduced axes, so ``w`` factors out of
    the three terms and ``dx = (rstd * w) * (dy - mean(dy) - xhat * mean(dy * xhat))``,
    as PyTorch's kernel scales by ``invstd * w``, the factor taken in float64
    (:func:`scaled`).
    (docs/derivations/batch_norm_training.md collapses the staged backward into these.)
    """
    proj = wide_mean(xp, dxhat * xhat, axes)  # reduced axes -> 1: mean(dxhat * xhat)
    inner = dxhat  # term 1 / rstd
    if center:
        inner = inner - wide_mean(xp, dxhat, axes)  # + term 2 / rstd
    inner = inner - xhat * proj  # + term 3 / rstd
    if weight is None:
        return inner * rstd  # same shape as x: dx
    return scaled(xp, inner, rstd, weight)  # same shape as x: dx


def scaled(xp: Namespace, a: Array, rstd: Array, weight: Array) -> Array:
    """``a * (rstd * weight)`` in ``a``'s dtype, with ``rstd`` and ``weight`` one number per
    statistic (shaped to broadcast against ``a``): their product is taken in float64
    (``square_dtype``) and applied before rounding once, as PyTorch scales by
    ``invstd * w``. With float32 factors either product alone can leave float32 where the
    result fits (rstd 1e15, a 1e25 and w 1e-8; or rstd 1e14 and w 1e25)."""
    wide = square_dtype(xp, rstd)
    scale = cast(xp, rstd, wide) * cast(xp, weight, wide)  # shape of rstd, float64: rstd * w
    return cast(xp, a * scale, a.dtype)  # shape of a
