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
from .._stats import standardize, standardize_backward, xhat_from
from ._dispatch import generic, kernel


def layer_norm_forward(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
    *,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    r"""LayerNorm forward, returning the statistics backward needs.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot w + b

    with mean and (biased) variance over the trailing ``normalized_shape`` axes.

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    weight, bias : array of shape ``normalized_shape``, optional
    eps : float
        Added to the variance before the square root.
    out : array, optional, keyword-only
        Where to write the output: an array of the input's backend, shape and dtype
        (``TypeError``/``ValueError`` otherwise); it is returned as ``output``.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape ``input.shape[:-len(normalized_shape)]``
        Per-row mean and ``1/sqrt(var + eps)``, in the computation dtype
        (float32 for float16 input). Nothing the size of the input is saved.
    """
    shape = as_shape(normalized_shape)
    eps = check_eps(eps)
    xp = float_inputs(input, weight, bias, names=("input", "weight", "bias"))
    check_trailing(input, shape)
    check_param(weight, shape, "weight")
    check_param(bias, shape, "bias")
    check_out(xp, out, input)
    return kernel("layer_norm_forward", xp)(xp, input, shape, weight, bias, eps, out)


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
    r"""LayerNorm backward from the upstream gradient and the saved statistics.

    With :math:`\hat{x} = (x - \mu)\,\mathrm{rstd}` and :math:`g = dy \cdot w`:

    .. math::
        dx = \mathrm{rstd}\,\big(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\big),\quad
        dw = \textstyle\sum_{rows} dy\,\hat{x},\quad db = \textstyle\sum_{rows} dy

    where the bars are means over the normalized axes.

    ``out`` (keyword-only, optional): where to write ``dx``, an array of the input's
    backend, shape and dtype; it is returned as ``dx``.

    Returns
    -------
    (dx, dweight, dbias)
        ``dweight``/``dbias`` are ``None`` when ``weight``/``bias`` is ``None``;
        each gradient has the dtype of the array it belongs to.
    """
    shape = as_shape(normalized_shape)
    xp = float_inputs(
        grad_output,
        input,
        mean,
        rstd,
        weight,
        bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"),
    )
    check_trailing(input, shape)
    check_grad_output(grad_output, input)
    check_row_stats(input, shape, mean=mean, rstd=rstd)
    check_param(weight, shape, "weight")
    check_param(bias, shape, "bias")
    check_out(xp, out, input)
    return kernel("layer_norm_backward", xp)(xp, grad_output, input, shape, mean, rstd, weight, bias, out)


def layer_norm(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
) -> Array:
    """LayerNorm with ``torch.nn.functional.layer_norm``'s signature; returns the output."""
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
    x = xp.reshape(cast(xp, input, ct), (-1, D))  # R,D (R = rows)
    xhat, mean, rstd = standardize(xp, x, (1,), eps)  # R,D  R,1  R,1
    y = xhat  # R,D
    if weight is not None:
        y = y * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    if bias is not None:
        y = y + xp.reshape(cast(xp, bias, ct), (D,))  # R,D
    y = cast(xp, xp.reshape(y, tuple(input.shape)), input.dtype)  # *,*shape
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
    x = xp.reshape(cast(xp, input, ct), (-1, D))  # R,D
    dy = xp.reshape(cast(xp, grad_output, ct), (-1, D))  # R,D
    mean = xp.reshape(cast(xp, mean, ct), (-1, 1))  # R,1
    rstd = xp.reshape(cast(xp, rstd, ct), (-1, 1))  # R,1
    xhat = xhat_from(x, mean, rstd)  # R,D, recomputed rather than saved
    dweight = dbias = None
    if bias is not None:
        dbias = cast(xp, xp.reshape(xp.sum(dy, axis=0), shape), bias.dtype)  # *shape
    if weight is not None:
        dweight = cast(xp, xp.reshape(xp.sum(dy * xhat, axis=0), shape), weight.dtype)  # *shape
        dxhat = dy * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    else:
        dxhat = dy  # R,D
    dx = standardize_backward(xp, dxhat, xhat, rstd, (1,))  # R,D
    dx = cast(xp, xp.reshape(dx, tuple(input.shape)), input.dtype)  # *,*shape
    return write_out(xp, out, dx), dweight, dbias
