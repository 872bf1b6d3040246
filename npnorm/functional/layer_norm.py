"""LayerNorm: forward, analytical backward, and the torch.nn.functional-style call.

Ba, Kiros & Hinton (2016), "Layer Normalization", https://arxiv.org/abs/1607.06450.
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
    float_inputs,
    prod,
    work_dtype,
    write_out,
)
from .._stats import as_rows, centred_again, reshaped, standardize, standardize_backward, wide_sum, xhat_from
from ._dispatch import generic, run


def layer_norm_forward(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
    *,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    """LayerNorm forward: the output and the per-row statistics backward needs.

    Ba, Kiros & Hinton (2016), https://arxiv.org/abs/1607.06450. Each row (the
    trailing ``normalized_shape`` axes, D values) is normalized on its own:

        mean = sum(x) / D
        var  = sum((x - mean)**2) / D              (biased; two passes)
        rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight + bias

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
        Any real floating dtype; float16 is computed in float32.
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    weight, bias : array of shape normalized_shape, optional
        The affine map; ``None`` leaves it out.
    eps : float, default 1e-5
        Added to the variance before the square root.
    out : array, optional, keyword-only
        Where to write the output: an array of the input's backend, shape and dtype
        (``TypeError``/``ValueError`` otherwise); it is returned as ``output``.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape ``input.shape[:-len(normalized_shape)]``
        Per-row mean and ``1/sqrt(var + eps)``, in the computation dtype (float32
        for float16 input). Nothing the size of the input is saved.

    Raises
    ------
    ValueError
        If ``input`` does not end in ``normalized_shape``, weight/bias have
        another shape, or ``eps`` is negative or NaN.
    TypeError
        On non-floating input, arrays of different backends, or an ``eps`` that is
        not a real number.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 5.0]])
    >>> y, mean, rstd = F.layer_norm_forward(x, 3, eps=0.0)
    >>> y.round(4), mean
    (array([[-1.2247,  0.    ,  1.2247],
           [-0.7071, -0.7071,  1.4142]]), array([2., 3.]))
    """
    shape = as_shape(normalized_shape, after="input")
    eps = check_eps(eps)
    xp = float_inputs(input, weight, bias, names=("input", "weight", "bias"))
    check_trailing(input, shape)
    check_param(weight, shape, "weight")
    check_param(bias, shape, "bias")
    check_out(xp, out, input)
    return run("layer_norm_forward", xp, input, shape, weight, bias, eps, out=out, reads=(weight, bias))


def layer_norm_backward(
    grad_output: Array,
    input: Array,
    normalized_shape: int | Sequence[int],
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """LayerNorm backward, from the upstream gradient and what the forward saved.

    With ``xhat = (x - mean) * rstd``, ``dxhat = dy * weight`` (``dy`` without
    weight) and means over the row's D values:

        dx      = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
                          term 1   term 2         term 3
                         (direct) (through mean) (through var)
        dweight = sum over rows of dy * xhat
        dbias   = sum over rows of dy

    xhat is recomputed from ``input``, ``mean`` and ``rstd``.

    Parameters
    ----------
    grad_output : array
        dy, the gradient of the loss with respect to the output; shape of ``input``.
    input : array, shape (*, *normalized_shape)
        The forward's input.
    normalized_shape : int or tuple of int
        As given to the forward.
    mean, rstd : arrays
        As returned by ``layer_norm_forward`` (one value per row).
    weight, bias : array of shape normalized_shape, optional
        As given to the forward; a gradient is returned for each one given.
    out : array, keyword-only, optional
        Where to write ``dx``: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    dx : array, shape and dtype of ``input``
    dweight, dbias : arrays of shape normalized_shape, or None
        ``None`` where ``weight``/``bias`` is ``None``; each in the dtype of the
        array it belongs to.

    Raises
    ------
    ValueError
        On a shape that does not match the forward's (grad_output, statistics,
        parameters).

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x, w = np.array([[1.0, 2.0, 4.0]]), np.ones(3)
    >>> y, mean, rstd = F.layer_norm_forward(x, 3, w)
    >>> dx, dw, db = F.layer_norm_backward(np.ones_like(x), x, 3, mean, rstd, w)
    >>> np.abs(dx).max() < 1e-12, db is None  # a constant dy shifts y: no gradient
    (np.True_, True)
    """
    shape = as_shape(normalized_shape, after="grad_output and input")
    xp = float_inputs(
        grad_output,
        input,
        mean,
        rstd,
        weight,
        bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"),
        required=4,
    )
    check_trailing(input, shape)
    check_grad_output(grad_output, input)
    check_row_stats(input, shape, mean=mean, rstd=rstd)
    check_param(weight, shape, "weight")
    check_param(bias, shape, "bias")
    check_out(xp, out, input)
    return run(
        "layer_norm_backward", xp, grad_output, input, shape, mean, rstd, weight, bias,
        out=out, reads=(mean, rstd, weight),
    )  # fmt: skip


def layer_norm(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
) -> Array:
    """LayerNorm with ``torch.nn.functional.layer_norm``'s signature; returns the output.

        y = (x - mean) / sqrt(var + eps) * weight + bias

    with mean and biased variance over the trailing ``normalized_shape`` axes
    (see ``layer_norm_forward``, which also returns the statistics).

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
    normalized_shape : int or tuple of int
        The trailing axes to normalize over (an int too, as the modules take;
        torch's function takes a tuple or list only).
    weight, bias : array of shape normalized_shape, optional
    eps : float, default 1e-5
        Added to the variance before the square root.

    Returns
    -------
    array
        The output, of the shape and dtype of ``input``.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> F.layer_norm(np.array([[0.0, 2.0]]), 2, eps=0.0)
    array([[-1.,  1.]])
    """
    return layer_norm_forward(input, normalized_shape, weight, bias, eps)[0]


# --- the generic Array API kernels: the reference every faster kernel is tested against ---


@generic("layer_norm_forward")
@no_fp_warnings
def layer_norm_forward_generic(
    xp: Namespace,
    input: Array,
    shape: Shape,
    weight: Array | None,
    bias: Array | None,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    ct = work_dtype(xp, input, weight, bias)  # float32 at least
    batch = tuple(input.shape[: input.ndim - len(shape)])
    D = prod(shape)
    x = as_rows(xp, cast(xp, input, ct), D)  # R,D (R = rows)
    xhat, mean, rstd = standardize(xp, x, (1,), eps)  # R,D  R,1  R,1
    y = xhat  # R,D
    if weight is not None:
        y = y * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    if bias is not None:
        y = y + xp.reshape(cast(xp, bias, ct), (D,))  # R,D
    y = cast(xp, reshaped(xp, y, tuple(input.shape)), input.dtype)  # *,*shape
    assert mean is not None
    return write_out(xp, out, y), xp.reshape(mean, batch), xp.reshape(rstd, batch)  # out, (*), (*)


@generic("layer_norm_backward")
@no_fp_warnings
def layer_norm_backward_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    shape: Shape,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    ct = work_dtype(xp, input, weight, bias, mean, rstd)
    D = prod(shape)
    x = as_rows(xp, cast(xp, input, ct), D)  # R,D
    dy = as_rows(xp, cast(xp, grad_output, ct), D)  # R,D
    mean = xp.reshape(cast(xp, mean, ct), (-1, 1))  # R,1
    rstd = xp.reshape(cast(xp, rstd, ct), (-1, 1))  # R,1
    xhat = xhat_from(x, mean, rstd)  # R,D, recomputed rather than saved
    xhat = centred_again(xp, xhat, (1,))  # R,D: before dweight takes it
    dweight = dbias = None
    if bias is not None:
        dbias = cast(xp, xp.reshape(wide_sum(xp, dy, (0,)), shape), bias.dtype)  # *shape
    if weight is not None:
        dweight = cast(xp, xp.reshape(wide_sum(xp, dy * xhat, (0,)), shape), weight.dtype)  # *shape
        dxhat = dy * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    else:
        dxhat = dy  # R,D
    dx = standardize_backward(xp, dxhat, xhat, rstd, (1,))  # R,D
    dx = cast(xp, reshaped(xp, dx, tuple(input.shape)), input.dtype)  # *,*shape
    return write_out(xp, out, dx), dweight, dbias
