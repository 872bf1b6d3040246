"""BatchNorm: forward with running statistics, analytical backward, torch-style call.

Ioffe & Szegedy (2015), "Batch Normalization: Accelerating Deep Network Training by
Reducing Internal Covariate Shift", https://arxiv.org/abs/1502.03167.
"""

from __future__ import annotations

from .._backend import Array, Namespace, no_fp_warnings
from .._checks import check_eps, check_grad_output, check_out, float_inputs, prod
from ._channels import (
    channel_norm_backward,
    channel_norm_forward,
    check_buffers_paired,
    check_channels,
    check_momentum,
    check_per_channel,
    store_running,
)
from ._dispatch import generic, kernel


def batch_norm_forward(
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    r"""BatchNorm forward; returns the output, saved statistics and updated buffers.

    Training (batch statistics over the batch and spatial axes, per channel):

    .. math::
        \mu_c = \mathrm{E}[x_{:,c}],\quad \sigma_c^2 = \mathrm{E}[(x_{:,c} - \mu_c)^2],\quad
        y = \frac{x - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}}\, w_c + b_c

    and, when buffers are given, ``new = (1 - momentum) * old + momentum * batch``,
    where the running variance takes the *unbiased* batch variance
    :math:`\sigma_c^2 \cdot n/(n-1)` (``n`` values per channel), as PyTorch does.
    Inference (``training=False``) normalizes with the running statistics.

    This function is pure: it never writes into ``running_mean``/``running_var``;
    the updated buffers are returned (:func:`batch_norm` writes them in place).

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    running_mean, running_var : arrays of shape (C,), or None
        Required when ``training`` is False.
    weight, bias : arrays of shape (C,), optional
    training : bool
        Use batch statistics (and update the buffers, if any).
    momentum : float
    eps : float
    out : array, optional, keyword-only
        Where to write the output: an array of the input's backend, shape and dtype
        (``TypeError``/``ValueError`` otherwise); returned as ``output``.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape (C,)
        The statistics the output was normalized with (batch or running), in the
        computation dtype (float32 for float16 input).
    new_running_mean, new_running_var : arrays of shape (C,) or None
        Updated buffers when training with buffers; else the buffers as given.

    Raises
    ------
    ValueError
        On a wrong shape, or when training with one value per channel.
    """
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    xp = float_inputs(
        input, running_mean, running_var, weight, bias,
        names=("input", "running_mean", "running_var", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "batch_norm")
    check_per_channel(c, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    check_buffers_paired(running_mean, running_var)
    if training and int(input.shape[0]) * prod(input.shape[2:]) <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {tuple(input.shape)}"
        )
    if not training and running_mean is None:
        raise ValueError("batch_norm in inference mode (training=False) needs running_mean and running_var")
    check_out(xp, out, input)
    return kernel("batch_norm_forward", xp)(
        xp, input, running_mean, running_var, weight, bias, bool(training), momentum, eps, out
    )


def batch_norm_backward(
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool = True,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    r"""BatchNorm backward from the upstream gradient and the saved statistics.

    With :math:`\hat{x} = (x - \mu_c)\,\mathrm{rstd}_c` and :math:`g = dy \cdot w_c`,
    bars being means over the ``n`` values of a channel (batch and spatial axes):

    .. math::
        dx = \mathrm{rstd}_c\,\big(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\big)
        \quad\text{(training: batch statistics depend on } x\text{)}

        dx = \mathrm{rstd}_c\, g
        \quad\text{(inference: running statistics are constants)}

    and :math:`dw_c = \sum dy\,\hat{x}`, :math:`db_c = \sum dy` in both cases.
    ``training`` must be the value the forward was called with. ``out`` (keyword-only,
    optional): where to write ``dx`` (the input's backend, shape and dtype); returned.
    """
    xp = float_inputs(
        grad_output, input, mean, rstd, weight, bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "batch_norm")
    check_grad_output(grad_output, input)
    check_per_channel(c, mean=mean, rstd=rstd, weight=weight, bias=bias)
    check_out(xp, out, input)
    return kernel("batch_norm_backward", xp)(
        xp, grad_output, input, mean, rstd, weight, bias, bool(training), out
    )


def batch_norm(
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Array:
    """BatchNorm with ``torch.nn.functional.batch_norm``'s signature and semantics:
    when training, the given running buffers are updated in place."""
    y, _, _, new_mean, new_var = batch_norm_forward(
        input, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if training:
        store_running(running_mean, running_var, new_mean, new_var)
    return y


# --- generic Array API kernels ---


@generic("batch_norm_forward")
@no_fp_warnings
def batch_norm_forward_generic(
    xp: Namespace,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    training: bool,
    momentum: float,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    # statistics over the batch and spatial axes of the N,C,S view: one per channel
    y, mean, rstd, new_mean, new_var = channel_norm_forward(
        xp, input, running_mean, running_var, weight, bias, training, momentum, eps, axes=(0, 2), out=out
    )
    return y, xp.reshape(mean, (-1,)), xp.reshape(rstd, (-1,)), new_mean, new_var  # out, C, C, C, C


@generic("batch_norm_backward")
@no_fp_warnings
def batch_norm_backward_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    training: bool,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    return channel_norm_backward(
        xp, grad_output, input, mean, rstd, weight, bias, training, axes=(0, 2), out=out
    )
