"""LayerNorm as a graph of six nodes (docs/derivations/layer_norm.md).

Each row (the trailing ``normalized_shape`` axes, ``n`` values) gets its own mean and
rstd; the weight and bias have the row's shape and are shared by all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from .._checks import as_shape, check_eps, check_param, check_trailing
from ._graph import affine, backward, same, standardize
from ._inputs import float64_leaves
from ._tape import Tape


def layer_norm(
    input: np.ndarray,
    normalized_shape: int | Sequence[int],
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
) -> Tape:
    """Staged LayerNorm forward; the arguments of ``npnorm.functional.layer_norm_forward``."""
    shape = as_shape(normalized_shape, after="input")
    eps = check_eps(eps)
    x, w, b = float64_leaves(input=input, weight=weight, bias=bias)
    assert x is not None
    check_trailing(x, shape)
    check_param(w, shape, "weight")
    check_param(b, shape, "bias")
    axes = tuple(range(x.ndim - len(shape), x.ndim))  # the normalized (trailing) axes
    t = Tape("layer_norm", input=x, weight=w, bias=b)
    t.description = f"LayerNorm over the trailing axes {axes} of input {x.shape}"
    standardize(t, "input", axes, eps)  # nodes 1-5: mean, xc, var, rstd, xhat (one per row)
    affine(t, "xhat", same)  # node 6: y = xhat · w + b
    t.backward = partial(backward, view=same)
    return t
