"""The staged graph over any axes you choose (docs/derivations/batch_norm_eval.md uses it
for the n-1 variance).

Every layer is this graph over its own axes; :func:`staged_normalize` lets you pick
the axes, leave out the centring (RMSNorm) or normalize with the n-1 variance.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
from numpy.lib.array_utils import normalize_axis_tuple

from .._backend import shown
from .._checks import check_eps
from ._graph import affine, backward, same, standardize
from ._inputs import float64_leaves
from ._tape import Tape, count


def staged_normalize(
    input: np.ndarray,
    axes: int | Sequence[int],
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
    *,
    center: bool = True,
    correction: int = 0,
    float64: bool = True,
) -> Tape:
    """Normalize ``input`` over ``axes``, then ``y = xhat · weight + bias``, as a tape.

    The graph is the layers' nodes 1-6 over ``axes`` (``n`` values per statistic)::

        mean = Σ x / n,   xc = x - mean,   var = Σ xc² / (n - correction)
        rstd = 1 / sqrt(var + eps),   xhat = xc · rstd,   y = xhat · weight + bias

    (``center=False``: ``ms = Σ x² / (n - correction)``, ``xhat = x · rstd``.)

    Parameters
    ----------
    input : ndarray
        The values to normalize, floating point.
    axes : int or sequence of int
        The axes each statistic is taken over (negative ones count from the end).
    weight, bias : ndarray, optional
        Shaped to broadcast against ``input`` (e.g. (1, C, 1, 1) for per-channel);
        their gradients come back in these shapes.
    eps : float, default 1e-5
        Added to the variance under the square root.
    center : bool, default True
        False leaves out the mean (RMSNorm).
    correction : {0, 1}, default 0
        The variance divides by ``n - correction``: 0 is the biased variance PyTorch
        normalizes with, 1 the n-1 (unbiased) variance some write-ups normalize with.
    float64 : bool, default True
        Compute in float64 (copies of the arrays; what the step checker needs). False
        computes in the arrays' own dtype without copying them, as textbook NumPy code
        does (npnorm's benchmark times it that way).

    Returns
    -------
    Tape
        Steps ``mean``, ``xc``, ``var``, ``rstd``, ``xhat``, ``y`` (``ms``, ``rstd``,
        ``xhat``, ``y`` with ``center=False``), ready for ``staged_backward``.

    Raises
    ------
    ValueError
        When ``eps`` is negative, ``correction`` is not 0 or 1, an axis is repeated or
        out of range (``numpy.exceptions.AxisError``, a ValueError), the axes hold no
        more than ``correction`` values, or weight or bias does not broadcast against input.
    TypeError
        With ``float64=True``, when an array is not a floating-point NumPy array.

    Examples
    --------
    Normalizing columns with the n-1 variance:

    >>> import numpy as np
    >>> from npnorm.learn import staged_normalize, staged_backward, check_steps
    >>> x = np.random.default_rng(0).standard_normal((5, 3))
    >>> tape = staged_normalize(x, 0, eps=0.0, correction=1)
    >>> tape.nodes["var"].formula
    'var = Σ xc² / (n - 1)'
    >>> np.allclose(tape["xhat"].var(axis=0, ddof=1), 1.0)
    True
    >>> grads = staged_backward(tape, np.random.default_rng(1).standard_normal(x.shape))
    >>> all(row.ok for row in check_steps(tape, grads))
    True
    """
    eps = check_eps(eps)
    if float64:
        x, weight, bias = float64_leaves(input=input, weight=weight, bias=bias)
        assert x is not None
        input = x
    # NumPy's rules: an axis out of range is an AxisError, a repeated one a ValueError
    norm_axes = tuple(sorted(normalize_axis_tuple(axes, input.ndim, "axes")))
    try:
        valid = bool(correction in (0, 1))
    except (TypeError, ValueError):  # an array of several values: "ambiguous" said nothing of it
        valid = False
    if not valid:
        raise ValueError(f"correction must be 0 (biased variance) or 1 (n-1), got {shown(correction)}")
    if count(input.shape, norm_axes) <= correction:
        raise ValueError(
            f"the variance over {count(input.shape, norm_axes)} value(s) needs more than {correction}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (
            p.ndim > input.ndim or np.broadcast_shapes(p.shape, input.shape) != input.shape
        ):
            raise ValueError(f"{name} of shape {p.shape} does not broadcast against input {input.shape}")
    t = Tape("normalize", input=input, weight=weight, bias=bias)
    t.description = f"normalization over the axes {norm_axes} of input {input.shape}"
    standardize(t, "input", norm_axes, eps, center=center, correction=correction)  # mean, xc, var, rstd, xhat
    affine(t, "xhat", same)  # y = xhat · w + b
    t.backward = partial(backward, view=same)
    return t
