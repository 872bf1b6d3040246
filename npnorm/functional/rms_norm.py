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
    float_inputs,
    prod,
    work_dtype,
    write_out,
)
from .._stats import standardize, standardize_backward, xhat_from
from ._dispatch import generic, kernel


def rms_norm_forward(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    eps: float | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array]:
    r"""RMSNorm forward, returning the statistic backward needs.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot w

    with the mean square over the trailing ``normalized_shape`` axes. No mean is
    subtracted and there is no bias.

    Parameters
    ----------
    input : array, shape (*, *normalized_shape)
    normalized_shape : int or tuple of int
    weight : array of shape ``normalized_shape``, optional
    eps : float, optional
        ``None`` (the default, as in PyTorch) means the machine epsilon of the
        computation dtype (float32 for float16 and float32 input).
    out : array, optional, keyword-only
        Where to write the output (the input's backend, shape and dtype); returned.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    rstd : array of shape ``input.shape[:-len(normalized_shape)]``
        Per-row ``1/sqrt(E[x^2] + eps)`` in the computation dtype.
    """
    shape = as_shape(normalized_shape)
    xp = float_inputs(input, weight, names=("input", "weight"))
    check_trailing(input, shape)
    check_param(weight, shape, "weight")
    eps_value = None if eps is None else check_eps(eps)
    check_out(xp, out, input)
    return kernel("rms_norm_forward", xp)(xp, input, shape, weight, eps_value, out)


def rms_norm_backward(
    grad_output: Array,
    input: Array,
    normalized_shape: int | Sequence[int],
    rstd: Array,
    weight: Array | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, None]:
    r"""RMSNorm backward from the upstream gradient and the saved ``rstd``.

    With :math:`\hat{x} = x\,\mathrm{rstd}` and :math:`g = dy \cdot w`:

    .. math::
        dx = \mathrm{rstd}\,\big(g - \hat{x}\,\overline{g\hat{x}}\big),\quad
        dw = \textstyle\sum_{rows} dy\,\hat{x}

    (LayerNorm's formula without the mean term). Returns ``(dx, dweight, None)``;
    the last slot is the absent bias, so every layer's backward returns a triple.
    ``out`` (keyword-only, optional): where to write ``dx`` (the input's backend, shape
    and dtype); returned as ``dx``.
    """
    shape = as_shape(normalized_shape)
    xp = float_inputs(grad_output, input, rstd, weight, names=("grad_output", "input", "rstd", "weight"))
    check_trailing(input, shape)
    check_grad_output(grad_output, input)
    check_row_stats(input, shape, rstd=rstd)
    check_param(weight, shape, "weight")
    check_out(xp, out, input)
    dx, dweight = kernel("rms_norm_backward", xp)(xp, grad_output, input, shape, rstd, weight, out)
    return dx, dweight, None


def rms_norm(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    eps: float | None = None,
) -> Array:
    """RMSNorm with ``torch.nn.functional.rms_norm``'s signature; returns the output."""
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
        eps = float(xp.finfo(ct).eps)
    batch = tuple(input.shape[: input.ndim - len(shape)])
    D = prod(shape)
    x = xp.reshape(cast(xp, input, ct), (-1, D))  # R,D
    xhat, _, rstd = standardize(xp, x, (1,), eps, center=False)  # R,D  R,1
    y = xhat if weight is None else xhat * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    y = cast(xp, xp.reshape(y, tuple(input.shape)), input.dtype)  # *,*shape
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
    x = xp.reshape(cast(xp, input, ct), (-1, D))  # R,D
    dy = xp.reshape(cast(xp, grad_output, ct), (-1, D))  # R,D
    rstd = xp.reshape(cast(xp, rstd, ct), (-1, 1))  # R,1
    xhat = xhat_from(x, None, rstd)  # R,D
    dweight = None
    dxhat = dy  # R,D
    if weight is not None:
        dweight = cast(xp, xp.reshape(xp.sum(dy * xhat, axis=0), shape), weight.dtype)  # *shape
        dxhat = dy * xp.reshape(cast(xp, weight, ct), (D,))  # R,D
    dx = standardize_backward(xp, dxhat, xhat, rstd, (1,), center=False)  # R,D
    return write_out(xp, out, cast(xp, xp.reshape(dx, tuple(input.shape)), input.dtype)), dweight
