"""Textbook NumPy formulas, the baseline the benchmark compares against.

Written the way tutorials (and the notes this project started from) write them: one
NumPy expression per step of the derivation, each a full pass over memory with its
own temporary, and the staged backward (dxhat -> dvar -> dmean -> dx). Correct, and
the starting point the library's kernels are measured against; not used by npnorm.
"""

from __future__ import annotations

import numpy as np


def forward(x: np.ndarray, axes: tuple[int, ...], gamma: np.ndarray | None, beta: np.ndarray | None,
            eps: float, center: bool = True) -> tuple[np.ndarray, tuple]:  # fmt: skip
    """Normalize over ``axes``; gamma/beta already shaped to broadcast."""
    mu = x.mean(axis=axes, keepdims=True) if center else 0.0
    var = x.var(axis=axes, keepdims=True) if center else (x**2).mean(axis=axes, keepdims=True)
    std = np.sqrt(var + eps)
    xhat = (x - mu) / std
    y = xhat
    if gamma is not None:
        y = gamma * y
    if beta is not None:
        y = y + beta
    return y, (x, mu, std, xhat)


def backward(dy: np.ndarray, cache: tuple, axes: tuple[int, ...], gamma: np.ndarray | None,
             param_axes: tuple[int, ...], center: bool = True) -> tuple:  # fmt: skip
    """The staged backward: dxhat, then dvar, then dmean, then dx."""
    x, mu, std, xhat = cache
    m = np.prod([x.shape[a] for a in axes])
    dgamma = (dy * xhat).sum(axis=param_axes)
    dbeta = dy.sum(axis=param_axes)
    dxhat = dy * gamma if gamma is not None else dy
    xmu = x - mu
    dvar = (dxhat * xmu * -0.5 * std**-3).sum(axis=axes, keepdims=True)
    dx = dxhat / std + dvar * 2 * xmu / m
    if center:
        dmu = (-dxhat / std).sum(axis=axes, keepdims=True) + dvar * (-2 * xmu).mean(axis=axes, keepdims=True)
        dx = dx + dmu / m
    return dx, dgamma, dbeta
