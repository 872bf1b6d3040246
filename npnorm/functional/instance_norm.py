"""InstanceNorm: forward with optional running statistics, analytical backward.

Ulyanov, Vedaldi & Lempitsky (2016), "Instance Normalization: The Missing Ingredient
for Fast Stylization", https://arxiv.org/abs/1607.08022.
"""

from __future__ import annotations

from .._backend import Array, Namespace, no_fp_warnings, writable
from .._checks import check_eps, check_flag, check_grad_output, check_out, float_inputs, prod
from ._channels import (
    channel_norm_backward,
    channel_norm_forward,
    check_buffers_paired,
    check_channels,
    check_momentum,
    check_per_channel,
    check_running_given,
    empty_backward,
    empty_forward,
    store_running,
)
from ._dispatch import as_native, as_plain, generic, run


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
    """InstanceNorm forward: the output, the statistics it used and the updated buffers.

    Ulyanov, Vedaldi & Lempitsky (2016), https://arxiv.org/abs/1607.08022. With
    input statistics (the usual case), each (sample n, channel c) pair is
    normalized over its spatial axes (S values):

        mean_nc = sum(x[n, c]) / S
        var_nc  = sum((x[n, c] - mean_nc)**2) / S             (biased; two passes)
        y       = (x - mean_nc) / sqrt(var_nc + eps) * weight_c + bias_c

    With buffers, they move towards the *batch average* of the per-instance
    statistics, the variance unbiased, exactly as PyTorch computes it:

        new_running_mean = (1 - momentum) * running_mean + momentum * mean_n(mean_nc)
        new_running_var  = (1 - momentum) * running_var  + momentum * mean_n(var_nc) * S/(S - 1)

    ``use_input_stats=False`` normalizes with the buffers instead. Pure: the
    buffers are returned, never written (``instance_norm`` writes them).

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
        No spatial axis, (N, C), only with ``use_input_stats=False``, as in PyTorch
        (statistics over one value per instance are refused).
    running_mean, running_var : arrays of shape (C,), or None
        Required when ``use_input_stats`` is False.
    weight, bias : arrays of shape (C,), optional
    use_input_stats : bool, default True
        Normalize with each instance's statistics (and update the buffers, if given).
    momentum : float, default 0.1
        Weight of the batch-averaged statistics in the update.
    eps : float, default 1e-5
        Added to the variance before the square root.
    out : array, keyword-only, optional
        Where to write the output: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape (N, C) with input statistics, (C,) with running ones
    new_running_mean, new_running_var : arrays of shape (C,) or None

    Raises
    ------
    ValueError
        On a wrong shape, input statistics over one spatial element, or a negative
        or NaN ``eps``. Input
        statistics over none are no error, as in PyTorch: the output is empty; with
        no spatial values ``mean`` and ``rstd`` are NaN (statistics of nothing) and the
        buffers come back as they were, and with no instances (N = 0) the buffers
        become NaN, the average over no instances.
    TypeError
        On non-floating input, arrays of different backends, an ``eps`` that is
        not a real number, or a ``use_input_stats`` that is not a bool (as PyTorch's).

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.array([[[1.0, 3.0], [0.0, 4.0]]])  # N=1, C=2, L=2
    >>> y, mean, rstd, _, _ = F.instance_norm_forward(x, eps=0.0)
    >>> y, mean
    (array([[[-1.,  1.],
            [-1.,  1.]]]), array([[2., 2.]]))
    """
    use_input_stats = check_flag(use_input_stats, "instance_norm_forward: use_input_stats")
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    xp = float_inputs(
        input, running_mean, running_var, weight, bias,
        names=("input", "running_mean", "running_var", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "instance_norm", min_ndim=2)
    check_per_channel(c, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    check_running_given(running_mean, running_var, use_input_stats, "instance_norm")
    check_buffers_paired(running_mean, running_var)
    s = prod(input.shape[2:])  # spatial values per instance
    if use_input_stats and s == 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {tuple(input.shape)}"
        )
    check_out(xp, out, input)
    n = int(input.shape[0])
    if use_input_stats and (s == 0 or n == 0):  # instances without values, or none
        y, mean, rstd = empty_forward(xp, input, (n, c), weight, bias, out)
        if n > 0:  # the buffers stay as they are, as PyTorch's
            return y, mean, rstd, as_native(running_mean), as_native(running_var)
        # no instances: NaN buffers, PyTorch's average over none (made here, not as a 0 / 0
        # that a lazy backend would compute, and warn of, outside this call)
        nan = [
            None if a is None else as_plain(xp.full_like(a, float("nan")))
            for a in (running_mean, running_var)
        ]
        return y, mean, rstd, nan[0], nan[1]
    y, mean, rstd, new_mean, new_var = run(
        "instance_norm_forward", xp, input, running_mean, running_var, weight, bias,
        use_input_stats, momentum, eps, out=out, reads=(running_mean, running_var, weight, bias),
    )  # fmt: skip
    if use_input_stats and eps == 0:
        y, rstd = _constant_instances(xp, y, rstd, bias)
    return y, mean, rstd, new_mean, new_var


def _constant_instances(xp: Namespace, y: Array, rstd: Array, bias: Array | None) -> tuple[Array, Array]:
    """PyTorch's rule for an instance of variance 0 with ``eps = 0`` (its batch-norm
    kernels' inverse standard deviation is 0 where ``var + eps`` is 0): rstd 0, so that
    the output is the bias (0 without one) and the gradient of x is 0, where 0/0 would
    give NaN. Returns ``y`` (N, C, *) corrected (in place where it can be written: it
    may be the caller's ``out=``; else a new array, as on JAX) and the (N, C) rstd."""
    flat = xp.isinf(rstd)  # N,C  var == 0 (rstd = 1/sqrt(0)), unchecked: jax.jit traces it
    spatial = (None,) * (y.ndim - 2)  # N,C -> N,C,1,..  and C -> C,1,..
    shift = xp.zeros_like(y) if bias is None else xp.astype(bias[(slice(None), *spatial)], y.dtype)
    fixed = xp.where(flat[(..., *spatial)], shift, y)  # N,C,*
    if writable(y):
        y[...] = fixed
    else:
        y = fixed
    return y, xp.where(flat, xp.zeros_like(rstd), rstd)  # N,C


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
    """InstanceNorm backward, from the upstream gradient and the saved statistics.

    With ``xhat = (x - mean_nc) * rstd_nc``, ``dxhat = dy * weight_c`` (``dy``
    without weight) and means over the S spatial values of a (sample, channel):

        input statistics:
            dx = rstd_nc * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        running statistics (constants):
            dx = rstd_c * dxhat
        both:
            dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Parameters
    ----------
    grad_output : array
        dy; shape of ``input``.
    input : array, shape (N, C, *spatial)
        The forward's input.
    mean, rstd : arrays of shape (N, C), or (C,) with running statistics
        As returned by ``instance_norm_forward``.
    weight, bias : arrays of shape (C,), optional
        As given to the forward.
    use_input_stats : bool, default True
        The value the forward was called with.
    out : array, keyword-only, optional
        Where to write ``dx``: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    dx : array, shape and dtype of ``input``
    dweight, dbias : arrays of shape (C,), or None where weight/bias is None

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.array([[[1.0, 3.0], [0.0, 4.0]]])
    >>> y, mean, rstd, _, _ = F.instance_norm_forward(x)
    >>> dx, dw, db = F.instance_norm_backward(np.ones_like(x), x, mean, rstd)
    >>> np.abs(dx).max() < 1e-12, dw
    (np.True_, None)
    """
    use_input_stats = check_flag(use_input_stats, "instance_norm_backward: use_input_stats")
    xp = float_inputs(
        grad_output, input, mean, rstd, weight, bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"), required=4,
    )  # fmt: skip
    c = check_channels(input, None, "instance_norm", min_ndim=2)
    check_grad_output(grad_output, input)
    check_per_channel(c, weight=weight, bias=bias)
    stats_shape = (int(input.shape[0]), c) if use_input_stats else (c,)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if tuple(a.shape) != stats_shape:
            raise ValueError(f"{name} must have shape {stats_shape}, got {tuple(a.shape)}")
    check_out(xp, out, input)
    if prod(input.shape) == 0:
        return empty_backward(xp, input, weight, bias, out)
    return run(
        "instance_norm_backward", xp, grad_output, input, mean, rstd, weight, bias,
        use_input_stats, out=out, reads=(mean, rstd, weight),
    )  # fmt: skip


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
    """InstanceNorm with ``torch.nn.functional.instance_norm``'s signature and semantics.

        y = (x - mean_nc) / sqrt(var_nc + eps) * weight_c + bias_c

    with each (sample, channel)'s statistics over its spatial axes when
    ``use_input_stats`` (and, when buffers are given, the running statistics
    updated **in place** towards their batch average), else the running
    statistics. See ``instance_norm_forward``, the pure version.

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    running_mean, running_var : arrays of shape (C,), or None
        Updated in place with input statistics.
    weight, bias : arrays of shape (C,), optional
    use_input_stats : bool, default True
    momentum : float, default 0.1
    eps : float, default 1e-5

    Returns
    -------
    array
        The output, of the shape and dtype of ``input``.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> F.instance_norm(np.array([[[1.0, 3.0]]]), eps=0.0)
    array([[[-1.,  1.]]])
    """
    y, _, _, new_mean, new_var = instance_norm_forward(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
    if use_input_stats:
        store_running(running_mean, running_var, new_mean, new_var, counted=True)
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
