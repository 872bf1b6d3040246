"""Solution: the closed form when the n-1 variance normalizes (see ../unbiased_variance.py)."""

import numpy as np


def closed_form(dxhat, xhat, rstd, axes):
    """The three terms of dx for var = Σ xc² / (n - 1), each of x's shape."""
    n = dxhat.shape[0]  # values per channel
    return {
        "direct": rstd * dxhat,  # term 1: unchanged
        "mean": np.broadcast_to(-rstd * dxhat.mean(axis=axes, keepdims=True), dxhat.shape),  # term 2: same
        "var": -rstd * xhat * (dxhat * xhat).sum(axis=axes, keepdims=True) / (n - 1),  # term 3: / (n - 1)
    }
