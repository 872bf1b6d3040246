"""RMSNorm: forward, analytical backward, and the torch.nn.functional-style call.

Zhang & Sennrich (2019), "Root Mean Square Layer Normalization",
https://arxiv.org/abs/1910.07467.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._backend import Array, Namespace, no_fp_warnings
from .._checks import (
    Shape,
    as_shape,
    cast,
    check_eps,
    check_grad_output,
    check_out,
    check_param,
    check_row_stats,
    check_trailing,
    default_eps,
    float_inputs,
    prod,
    work_dtype,
    write_out,
)
from .._stats import as_rows, reshaped, standardize, standardize_backward, wide_sum, xhat_from
from ._dispatch import generic, run


def rms_norm_forward(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    eps: float | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array]:
    """RMSNorm forward: the output and the per-row statistic backward needs.

    Zhang & Sennrich (2019), https://arxiv.org/abs/1910.07467. Each row (the
    trailing ``normalized_shape`` axes, D values) is scaled by its root mean
    square; no mean is subtracted and there is no bias:

        rstd = 1 / sqrt(sum(x**2) / D + eps)
        y    = x * rstd * weight

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
        Any real floating dtype; float16 is computed in float32.
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    weight : array of shape normalized_shape, optional
    eps : float or None, default None
        Added to the mean square; ``None`` (as in PyTorch) means the machine
        epsilon of the input's dtype (float32's for float16 and float32 input,
        float64's for float64), whatever the weight's dtype.
    out : array, keyword-only, optional
        Where to write the output: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    rstd : array of shape ``input.shape[:-len(normalized_shape)]``
        Per-row ``1/sqrt(mean(x**2) + eps)``, in the computation dtype.

    Raises
    ------
    ValueError
        If ``input`` does not end in ``normalized_shape``, weight has another shape,
        or ``eps`` is negative or NaN.
    TypeError
        On non-floating input, arrays of different backends, or an ``eps`` that is
        not a real number (None: the dtype's machine epsilon).

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> y, rstd = F.rms_norm_forward(np.array([[3.0, 4.0]]), 2, eps=0.0)
    >>> y.round(4), rstd.round(4)
    (array([[0.8485, 1.1314]]), array([0.2828]))
    """
    shape = as_shape(normalized_shape, after="input")
    xp = float_inputs(input, weight, names=("input", "weight"))
    check_trailing(input, shape)
    check_param(weight, shape, "weight")
    eps_value = None if eps is None else check_eps(eps)
    check_out(xp, out, input)
    return run("rms_norm_forward", xp, input, shape, weight, eps_value, out=out, reads=(weight,))


def rms_norm_backward(
    grad_output: Array,
    input: Array,
    normalized_shape: int | Sequence[int],
    rstd: Array,
    weight: Array | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, None]:
    """RMSNorm backward, from the upstream gradient and the saved ``rstd``.

    With ``xhat = x * rstd``, ``dxhat = dy * weight`` (``dy`` without weight) and
    means over the row's D values, LayerNorm's formula without the term through
    the mean:

        dx      = rstd * (dxhat - xhat * mean(dxhat * xhat))
        dweight = sum over rows of dy * xhat

    Parameters
    ----------
    grad_output : array
        dy, the gradient of the loss with respect to the output; shape of ``input``.
    input : array, shape (*, *normalized_shape)
        The forward's input.
    normalized_shape : int or tuple of int
        As given to the forward.
    rstd : array
        As returned by ``rms_norm_forward`` (one value per row).
    weight : array of shape normalized_shape, optional
        As given to the forward.
    out : array, keyword-only, optional
        Where to write ``dx``: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    dx : array, shape and dtype of ``input``
    dweight : array of shape normalized_shape, or None without ``weight``
    None
        The absent bias's slot, so that every layer's backward returns a triple.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.array([[3.0, 4.0]])
    >>> y, rstd = F.rms_norm_forward(x, 2, eps=0.0)
    >>> dx, dw, db = F.rms_norm_backward(x, x, 2, rstd)  # dy parallel to x
    >>> np.abs(dx).max() < 1e-12, db
    (np.True_, None)
    """
    shape = as_shape(normalized_shape, after="grad_output and input")
    xp = float_inputs(
        grad_output, input, rstd, weight, names=("grad_output", "input", "rstd", "weight"), required=3
    )
    check_trailing(input, shape)
    check_grad_output(grad_output, input)
    check_row_stats(input, shape, rstd=rstd)
    check_param(weight, shape, "weight")
    check_out(xp, out, input)
    dx, dweight = run(
        "rms_norm_backward", xp, grad_output, input, shape, rstd, weight, out=out, reads=(rstd, weight)
    )
    return dx, dweight, None


def rms_norm(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    eps: float | None = None,
) -> Array:
    """RMSNorm with ``torch.nn.functional.rms_norm``'s signature; returns the output.

        y = x / sqrt(mean(x**2) + eps) * weight

    with the mean square over the trailing ``normalized_shape`` axes (see
    ``rms_norm_forward``, which also returns ``rstd``).

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
    normalized_shape : int or tuple of int
        The trailing axes to normalize over (an int too, as the modules take;
        torch's function takes a tuple or list only).
    weight : array of shape normalized_shape, optional
    eps : float or None, default None
        ``None`` means the machine epsilon of the input's dtype (float32's for
        float16 input), whatever the weight's dtype.

    Returns
    -------
    array
        The output, of the shape and dtype of ``input``.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> F.rms_norm(np.array([[3.0, 4.0]]), 2, eps=0.0).round(4)
    array([[0.8485, 1.1314]])
    """
    return rms_norm_forward(input, normalized_shape, weight, eps)[0]


# --- generic Array API kernels ---


@generic("rms_norm_forward")
@no_fp_warnings
def rms_norm_forward_generic(
    xp: Namespace,
    input: Array,
    shape: Shape,
    weight: Array | None,
    eps: float | None,
    out: Array | None = None,
) -> tuple[Array, Array]:
    ct = work_dtype(xp, input, weight)  # float32 at least
    if eps is None:
        eps = default_eps(xp, input)
    batch = tuple(input.shape[: input.ndim - len(shape)])
    D = prod(shape)
    x = as_rows(xp, cast(xp, input, ct), D)  # R,D
    xhat, _, rstd = standardize(xp, x, (1,), eps, center=False)  # R,D  R,1
    y = xhat if weight is None else xhat * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    y = cast(xp, reshaped(xp, y, tuple(input.shape)), input.dtype)  # *,*shape
    return write_out(xp, out, y), xp.reshape(rstd, batch)  # out, (*)


@generic("rms_norm_backward")
@no_fp_warnings
def rms_norm_backward_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    shape: Shape,
    rstd: Array,
    weight: Array | None,
    out: Array | None = None,
) -> tuple[Array, Array | None]:
    ct = work_dtype(xp, input, weight, rstd)
    D = prod(shape)
    x = as_rows(xp, cast(xp, input, ct), D)  # R,D
    dy = as_rows(xp, cast(xp, grad_output, ct), D)  # R,D
    rstd = xp.reshape(cast(xp, rstd, ct), (-1, 1))  # R,1
    xhat = xhat_from(x, None, rstd)  # R,D
    dweight = None
    dxhat = dy  # R,D
    if weight is not None:
        dweight = cast(xp, xp.reshape(wide_sum(xp, dy * xhat, (0,)), shape), weight.dtype)  # *shape
        dxhat = dy * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    dx = standardize_backward(xp, dxhat, xhat, rstd, (1,), center=False)  # R,D
    return write_out(xp, out, cast(xp, reshaped(xp, dx, tuple(input.shape)), input.dtype)), dweight
