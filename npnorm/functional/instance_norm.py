"""InstanceNorm: forward with optional running statistics, analytical backward.

Ulyanov, Vedaldi & Lempitsky (2016), "Instance Normalization: The Missing Ingredient
for Fast Stylization", https://arxiv.org/abs/1607.08022.
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


def instance_norm_forward(
    input: Array,
    running_mean: Array | None = None,
    running_var: Array | None = None,
    weight: Array | None = None,
    bias: Array | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    r"""InstanceNorm forward; returns the output, saved statistics and updated buffers.

    With input statistics (the usual case), each (sample, channel) pair is normalized
    over its spatial axes:

    .. math::
        y_{n,c} = \frac{x_{n,c} - \mathrm{E}[x_{n,c}]}{\sqrt{\mathrm{Var}[x_{n,c}] + \epsilon}}\, w_c + b_c

    With buffers, they move towards the *batch average* of the per-instance
    statistics (the variance unbiased with ``S/(S-1)``, S spatial elements), exactly
    as PyTorch computes it. ``use_input_stats=False`` normalizes with the buffers.
    Pure: buffers are returned, never written (:func:`instance_norm` writes them).

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    running_mean, running_var : arrays of shape (C,), or None
    weight, bias : arrays of shape (C,), optional
    use_input_stats : bool
    momentum, eps : float
    out : array, optional, keyword-only
        Where to write the output: an array of the input's backend, shape and dtype
        (``TypeError``/``ValueError`` otherwise); returned as ``output``.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape (N, C) with input statistics, (C,) with running ones
    new_running_mean, new_running_var : arrays of shape (C,) or None
    """
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    xp = float_inputs(
        input, running_mean, running_var, weight, bias,
        names=("input", "running_mean", "running_var", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "instance_norm", min_ndim=3)
    check_per_channel(c, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    check_buffers_paired(running_mean, running_var)
    if use_input_stats and prod(input.shape[2:]) <= 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {tuple(input.shape)}"
        )
    if not use_input_stats and running_mean is None:
        raise ValueError("instance_norm with use_input_stats=False needs running_mean and running_var")
    check_out(xp, out, input)
    return kernel("instance_norm_forward", xp)(
        xp, input, running_mean, running_var, weight, bias, bool(use_input_stats), momentum, eps, out
    )


def instance_norm_backward(
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    use_input_stats: bool = True,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    r"""InstanceNorm backward: the LayerNorm formula per (sample, channel) over the
    spatial axes when ``use_input_stats``, else the affine map's backward
    :math:`dx = \mathrm{rstd}_c\, dy\, w_c`. Returns ``(dx, dweight, dbias)``; ``dx`` is
    written into ``out`` (keyword-only; the input's backend, shape and dtype) when given."""
    xp = float_inputs(
        grad_output, input, mean, rstd, weight, bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "instance_norm", min_ndim=3)
    check_grad_output(grad_output, input)
    check_per_channel(c, weight=weight, bias=bias)
    stats_shape = (int(input.shape[0]), c) if use_input_stats else (c,)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if tuple(a.shape) != stats_shape:
            raise ValueError(f"{name} must have shape {stats_shape}, got {tuple(a.shape)}")
    check_out(xp, out, input)
    return kernel("instance_norm_backward", xp)(
        xp, grad_output, input, mean, rstd, weight, bias, bool(use_input_stats), out
    )


def instance_norm(
    input: Array,
    running_mean: Array | None = None,
    running_var: Array | None = None,
    weight: Array | None = None,
    bias: Array | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Array:
    """InstanceNorm with ``torch.nn.functional.instance_norm``'s signature: with input
    statistics, the given running buffers are updated in place."""
    y, _, _, new_mean, new_var = instance_norm_forward(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
    if use_input_stats:
        store_running(running_mean, running_var, new_mean, new_var)
    return y


# --- generic Array API kernels ---


@generic("instance_norm_forward")
@no_fp_warnings
def instance_norm_forward_generic(
    xp: Namespace,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    # statistics over the spatial axis of the N,C,S view: one per (sample, channel)
    y, mean, rstd, new_mean, new_var = channel_norm_forward(
        xp, input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, axes=(2,), out=out
    )
    n, c = int(input.shape[0]), int(input.shape[1])
    stats_shape = (n, c) if use_input_stats else (c,)
    return y, xp.reshape(mean, stats_shape), xp.reshape(rstd, stats_shape), new_mean, new_var


@generic("instance_norm_backward")
@no_fp_warnings
def instance_norm_backward_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    axes = (2,)
    return channel_norm_backward(xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, axes, out)
