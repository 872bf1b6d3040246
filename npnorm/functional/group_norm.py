"""GroupNorm: forward, analytical backward, torch-style call.

Wu & He (2018), "Group Normalization", https://arxiv.org/abs/1803.08494.
"""

from __future__ import annotations

from .._backend import Array, Namespace, no_fp_warnings
from .._checks import (
    cast,
    check_count,
    check_eps,
    check_grad_output,
    check_out,
    float_inputs,
    prod,
    work_dtype,
    write_out,
)
from .._stats import centred_again, reshaped, standardize, standardize_backward, xhat_from
from ._channels import (
    as_ncs,
    channel_affine,
    channel_affine_backward,
    check_channels,
    check_per_channel,
    empty_backward,
    empty_forward,
)
from ._dispatch import generic, run


def check_values_per_group(shape: tuple[int, ...], num_groups: int) -> None:
    """PyTorch's ``ValueError`` for an input of one value per group in all (N*C/G times
    the spatial size is 1), checked on its (N*C/G, G, *) view."""
    n, c = int(shape[0]), int(shape[1])
    spatial = [int(d) for d in shape[2:]]
    if n * c // num_groups * prod(spatial) == 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got input size "
            f"{[n * c // num_groups, num_groups, *spatial]}"
        )


def check_groups(num_groups: int, num_channels: int) -> int:
    """``num_groups`` as an int, checked to divide ``num_channels``."""
    num_groups = check_count(num_groups, "num_groups")
    if num_channels % num_groups:
        raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
    return num_groups


def group_norm_forward(
    input: Array,
    num_groups: int,
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
    *,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    """GroupNorm forward: the output and the per-(sample, group) statistics.

    Wu & He (2018), https://arxiv.org/abs/1803.08494. The C channels are split into
    ``num_groups`` groups of C/G consecutive channels; each (sample n, group g) is
    normalized over its channels and spatial axes (m = C/G * prod(spatial) values),
    then each channel c gets its own affine map:

        mean_ng = sum(x[n, group g]) / m
        var_ng  = sum((x[n, group g] - mean_ng)**2) / m        (biased; two passes)
        y[n, c] = (x[n, c] - mean_ng) / sqrt(var_ng + eps) * weight_c + bias_c

    One group is LayerNorm over (C, *spatial) with a per-channel affine map; C
    groups is InstanceNorm.

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    num_groups : int
        G; must divide C.
    weight, bias : arrays of shape (C,), optional
    eps : float, default 1e-5
        Added to the variance before the square root.
    out : array, keyword-only, optional
        Where to write the output: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape (N, num_groups), in the computation dtype

    Raises
    ------
    ValueError
        If C is not divisible by ``num_groups``, on a wrong shape, or on a negative
        or NaN ``eps``; and, as PyTorch's, when the input holds one value per group
        in all (N*C/G times the spatial size is 1: ``(1, C)`` with ``num_groups = C``).
    TypeError
        On non-floating input, arrays of different backends, or an ``eps`` that is
        not a real number.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.arange(8.0).reshape(1, 4, 2)  # N=1, C=4, L=2
    >>> y, mean, rstd = F.group_norm_forward(x, 2)
    >>> mean
    array([[1.5, 5.5]])
    """
    eps = check_eps(eps)
    xp = float_inputs(input, weight, bias, names=("input", "weight", "bias"))
    c = check_channels(input, None, "group_norm")
    num_groups = check_groups(num_groups, c)
    check_per_channel(c, weight=weight, bias=bias)
    check_values_per_group(input.shape, num_groups)
    n = int(input.shape[0])
    check_out(xp, out, input)
    if n * prod(input.shape[1:]) == 0:  # no group holds a value (or there is none)
        return empty_forward(xp, input, (n, num_groups), weight, bias, out)
    return run("group_norm_forward", xp, input, num_groups, weight, bias, eps, out=out, reads=(weight, bias))


def group_norm_backward(
    grad_output: Array,
    input: Array,
    num_groups: int,
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """GroupNorm backward, from the upstream gradient and the saved statistics.

    With ``xhat = (x - mean_ng) * rstd_ng``, ``dxhat = dy * weight_c`` (``dy``
    without weight) and means over the m values of a (sample, group):

        dx        = rstd_ng * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Parameters
    ----------
    grad_output : array
        dy; shape of ``input``.
    input : array, shape (N, C, *spatial)
        The forward's input.
    num_groups : int
        As given to the forward.
    mean, rstd : arrays of shape (N, num_groups)
        As returned by ``group_norm_forward``.
    weight, bias : arrays of shape (C,), optional
        As given to the forward.
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
    >>> x = np.arange(8.0).reshape(1, 4, 2)
    >>> y, mean, rstd = F.group_norm_forward(x, 2)
    >>> dx, dw, db = F.group_norm_backward(np.ones_like(x), x, 2, mean, rstd, np.ones(4), np.zeros(4))
    >>> np.abs(dx).max() < 1e-12, db
    (np.True_, array([2., 2., 2., 2.]))
    """
    xp = float_inputs(
        grad_output, input, mean, rstd, weight, bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"), required=4,
    )  # fmt: skip
    c = check_channels(input, None, "group_norm")
    num_groups = check_groups(num_groups, c)
    check_grad_output(grad_output, input)
    check_per_channel(c, weight=weight, bias=bias)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if tuple(a.shape) != (int(input.shape[0]), num_groups):
            raise ValueError(
                f"{name} must have shape {(int(input.shape[0]), num_groups)}, got {tuple(a.shape)}"
            )
    check_out(xp, out, input)
    if prod(input.shape) == 0:
        dx, dweight, dbias = empty_backward(xp, input, weight, bias, out)
        if dweight is not None and int(input.shape[0]) > 0:
            # as PyTorch's: its dweight_c sums (ds - db*mean)*rstd over samples, with the
            # NaN statistics of groups of no values (N > 0, S = 0); dbias stays 0
            dweight = dweight + float("nan")
        return dx, dweight, dbias
    return run(
        "group_norm_backward", xp, grad_output, input, num_groups, mean, rstd, weight, bias,
        out=out, reads=(mean, rstd, weight),
    )  # fmt: skip


def group_norm(
    input: Array,
    num_groups: int,
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
) -> Array:
    """GroupNorm with ``torch.nn.functional.group_norm``'s signature; returns the output.

        y[n, c] = (x[n, c] - mean_ng) / sqrt(var_ng + eps) * weight_c + bias_c

    with mean and biased variance per (sample, group of C/G channels) over the
    group's channels and spatial axes (see ``group_norm_forward``).

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    num_groups : int
        G; must divide C.
    weight, bias : arrays of shape (C,), optional
    eps : float, default 1e-5

    Returns
    -------
    array
        The output, of the shape and dtype of ``input``.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> F.group_norm(np.array([[[0.0], [2.0], [5.0], [5.0]]]), 2)[0, :, 0].round(3)
    array([-1.,  1.,  0.,  0.])
    """
    return group_norm_forward(input, num_groups, weight, bias, eps)[0]


# --- generic Array API kernels ---


@generic("group_norm_forward")
@no_fp_warnings
def group_norm_forward_generic(
    xp: Namespace,
    input: Array,
    num_groups: int,
    weight: Array | None,
    bias: Array | None,
    eps: float,
    out: Array | None = None,
) -> tuple[Array, Array, Array]:
    ct = work_dtype(xp, input, weight, bias)  # float32 at least
    x = as_ncs(xp, input, ct)  # N,C,S
    n, c, s = (int(d) for d in x.shape)
    xg = xp.reshape(x, (n, num_groups, c // num_groups, s))  # N,G,C/G,S (splits C only)
    xhat, mean, rstd = standardize(xp, xg, (2, 3), eps)  # N,G,C/G,S  N,G,1,1  N,G,1,1
    assert mean is not None
    y = channel_affine(xp, xp.reshape(xhat, (n, c, s)), weight, bias, ct)  # N,C,S
    y = cast(xp, reshaped(xp, y, tuple(input.shape)), input.dtype)
    return write_out(xp, out, y), xp.reshape(mean, (n, num_groups)), xp.reshape(rstd, (n, num_groups))


@generic("group_norm_backward")
@no_fp_warnings
def group_norm_backward_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    num_groups: int,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    ct = work_dtype(xp, input, weight, bias, mean)
    x = as_ncs(xp, input, ct)  # N,C,S
    dy = as_ncs(xp, grad_output, ct)  # N,C,S
    n, c, s = (int(d) for d in x.shape)
    group = (n, num_groups, c // num_groups, s)  # splits C only
    mean = xp.reshape(cast(xp, mean, ct), (n, num_groups, 1, 1))  # N,G,1,1
    rstd = xp.reshape(cast(xp, rstd, ct), (n, num_groups, 1, 1))  # N,G,1,1
    xhat = xhat_from(xp.reshape(x, group), mean, rstd)  # N,G,C/G,S
    xhat = centred_again(xp, xhat, (2, 3))  # N,G,C/G,S: before dweight takes it
    dxhat, dweight, dbias = channel_affine_backward(
        xp, dy, xp.reshape(xhat, (n, c, s)), weight, bias, ct
    )  # N,C,S  C  C
    dx = standardize_backward(xp, xp.reshape(dxhat, group), xhat, rstd, (2, 3))  # N,G,C/G,S
    return write_out(xp, out, cast(xp, reshaped(xp, dx, tuple(input.shape)), input.dtype)), dweight, dbias
