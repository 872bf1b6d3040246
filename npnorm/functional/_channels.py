"""Pieces shared by the layers with a per-channel affine map (BatchNorm,
InstanceNorm, GroupNorm): the (N, C, S) view, the affine map and its backward, the
running-statistics update, and the checks they all make."""

from __future__ import annotations

from typing import Any

from .._backend import Array, Namespace
from .._checks import cast, prod


def as_ncs(xp: Namespace, x: Array, dtype: Any) -> Array:
    """``x`` of shape (N, C, *spatial) viewed as (N, C, S), S = prod(spatial), in ``dtype``."""
    n, c = int(x.shape[0]), int(x.shape[1])
    return xp.reshape(cast(xp, x, dtype), (n, c, prod(x.shape[2:])))  # N,C,S


def channel_affine(xp: Namespace, xhat: Array, weight: Array | None, bias: Array | None, dtype: Any) -> Array:
    """``y = xhat * w[c] + b[c]`` for ``xhat`` of shape (N, C, S)."""
    y = xhat  # N,C,S
    if weight is not None:
        y = y * xp.reshape(cast(xp, weight, dtype), (1, -1, 1))  # N,C,S
    if bias is not None:
        y = y + xp.reshape(cast(xp, bias, dtype), (1, -1, 1))  # N,C,S
    return y


def channel_affine_backward(
    xp: Namespace, dy: Array, xhat: Array, weight: Array | None, bias: Array | None, dtype: Any
) -> tuple[Array, Array | None, Array | None]:
    """``(dxhat, dweight, dbias)`` of the per-channel affine map; dy, xhat are (N, C, S)."""
    dweight = dbias = None
    if bias is not None:
        dbias = cast(xp, xp.sum(dy, axis=(0, 2)), bias.dtype)  # C
    dxhat = dy  # N,C,S
    if weight is not None:
        dweight = cast(xp, xp.sum(dy * xhat, axis=(0, 2)), weight.dtype)  # C
        dxhat = dy * xp.reshape(cast(xp, weight, dtype), (1, -1, 1))  # N,C,S
    return dxhat, dweight, dbias


def running_update(xp: Namespace, running: Array, batch: Array, momentum: float) -> Array:
    """``(1 - momentum) * running + momentum * batch``, computed in ``batch``'s dtype
    (float32 at least) and returned in the buffer's dtype."""
    new = (1.0 - momentum) * cast(xp, running, batch.dtype) + momentum * batch  # C
    return cast(xp, new, running.dtype)


def check_channels(x: Array, num: int | None, what: str, *, min_ndim: int = 2) -> int:
    """``x`` is (N, C, *) with at least ``min_ndim`` dims; return C (checked against ``num``)."""
    if x.ndim < min_ndim:
        raise ValueError(
            f"{what} expects input of shape (N, C, *) with at least {min_ndim} dims, "
            f"got shape {tuple(x.shape)}"
        )
    c = int(x.shape[1])
    if num is not None and c != num:
        raise ValueError(f"{what} expected {num} channels at dim 1, got input of shape {tuple(x.shape)}")
    return c


def check_per_channel(c: int, **arrays: Array | None) -> None:
    for name, a in arrays.items():
        if a is not None and tuple(a.shape) != (c,):
            raise ValueError(f"{name} must have shape ({c},) (one value per channel), got {tuple(a.shape)}")


def check_momentum(momentum: Any) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a number, got {momentum!r}")
    return float(momentum)


def check_buffers_paired(running_mean: Array | None, running_var: Array | None) -> None:
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (or both None)")
