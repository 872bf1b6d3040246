"""RMSNorm as a graph of four nodes (docs/derivations/rms_norm.md).

LayerNorm without the mean: each row is scaled by the reciprocal of its root mean
square, and there is no bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from .._checks import as_shape, check_eps, check_param, check_trailing
from ._graph import affine, backward, same, standardize
from ._inputs import float64_leaves, machine_eps
from ._tape import Tape


def rms_norm(
    input: np.ndarray,
    normalized_shape: int | Sequence[int],
    weight: np.ndarray | None = None,
    eps: float | None = None,
) -> Tape:
    """Staged RMSNorm forward; the arguments of ``npnorm.functional.rms_norm_forward``.

    ``eps=None`` is the machine epsilon of the dtype the library computes the input in
    (float32 for float16/float32 input, whatever the weight's dtype), as in PyTorch, even
    though the tape is float64.
    """
    shape = as_shape(normalized_shape, after="input")
    eps = machine_eps(input) if eps is None else check_eps(eps)
    x, w = float64_leaves(input=input, weight=weight)
    assert x is not None
    check_trailing(x, shape)
    check_param(w, shape, "weight")
    axes = tuple(range(x.ndim - len(shape), x.ndim))  # the normalized (trailing) axes
    t = Tape("rms_norm", input=x, weight=w)
    t.description = f"RMSNorm over the trailing axes {axes} of input {x.shape}"
    standardize(t, "input", axes, eps, center=False)  # nodes 1-3: ms, rstd, xhat
    affine(t, "xhat", same)  # node 4: y = xhat · w
    t.backward = partial(backward, view=same)
    return t
