"""BatchNorm: forward with running statistics, analytical backward, torch-style call.

Ioffe & Szegedy (2015), "Batch Normalization: Accelerating Deep Network Training by
Reducing Internal Covariate Shift", https://arxiv.org/abs/1502.03167.
"""

from __future__ import annotations

from .._backend import Array, Namespace, no_fp_warnings
from .._checks import (
    check_backward_training,
    check_eps,
    check_flag,
    check_grad_output,
    check_out,
    float_inputs,
    prod,
)
from ._channels import (
    channel_norm_backward,
    channel_norm_forward,
    check_buffers_paired,
    check_channels,
    check_momentum,
    check_per_channel,
    check_running_given,
    check_training_eps,
    empty_backward,
    empty_forward,
    store_running,
)
from ._dispatch import as_native, generic, run


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
    """BatchNorm forward: the output, the statistics it used and the updated buffers.

    Ioffe & Szegedy (2015), https://arxiv.org/abs/1502.03167. Per channel c, over
    the batch and spatial axes (n values):

        training:   mean_c = sum(x[:, c]) / n
                    var_c  = sum((x[:, c] - mean_c)**2) / n      (biased; two passes)
        inference:  mean_c = running_mean_c,  var_c = running_var_c
        y = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c

    When training with buffers, the running statistics move towards the batch's,
    the variance *unbiased* (as PyTorch does):

        new_running_mean = (1 - momentum) * running_mean + momentum * mean_c
        new_running_var  = (1 - momentum) * running_var  + momentum * var_c * n/(n - 1)

    This function is pure: it never writes into ``running_mean``/``running_var``;
    the updated buffers are returned (``batch_norm`` writes them in place).

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    running_mean, running_var : arrays of shape (C,), or None
        Required when ``training`` is False.
    weight, bias : arrays of shape (C,), optional
    training : bool, default False
        Use batch statistics (and update the buffers, if given).
    momentum : float, default 0.1
        Weight of the batch statistics in the update (the modules turn
        ``momentum=None`` into ``1 / num_batches_tracked``).
    eps : float, default 1e-5
        Added to the variance before the square root.
    out : array, keyword-only, optional
        Where to write the output: an array of the input's backend, shape and
        dtype (any layout), written in place and returned in its place.

    Returns
    -------
    output : array, shape and dtype of ``input`` (``out`` when given)
    mean, rstd : arrays of shape (C,)
        The statistics the output was normalized with (batch or running; rstd =
        1/sqrt(var + eps)), in the computation dtype (float32 for float16 input).
    new_running_mean, new_running_var : arrays of shape (C,) or None
        Updated buffers when training with buffers; else the buffers as given.

    Raises
    ------
    ValueError
        On a wrong shape, when training with one value per channel, on one running
        buffer without the other (an empty batch too, which PyTorch takes), or on a
        negative or NaN ``eps``. An empty batch (no values per channel) is no error, as in
        PyTorch: its output is empty, ``mean`` and ``rstd`` are NaN (statistics of
        nothing), and the buffers come back as they were.
    RuntimeError
        In inference without a running buffer (PyTorch's error), but for an empty input.
    TypeError
        On non-floating input, arrays of different backends, an ``eps`` that is
        not a real number, or a ``training`` that is not a bool (as PyTorch's).

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.array([[1.0, 10.0], [3.0, 30.0]])  # N=2, C=2
    >>> y, mean, rstd, rm, rv = F.batch_norm_forward(x, np.zeros(2), np.ones(2), training=True, eps=0.0)
    >>> y, mean
    (array([[-1., -1.],
           [ 1.,  1.]]), array([ 2., 20.]))
    >>> rm, rv  # 0.9 * old + 0.1 * batch, the variance unbiased: 2 and 200
    (array([0.2, 2. ]), array([ 1.1, 20.9]))
    """
    training = check_flag(training, "batch_norm_forward: training")
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    xp = float_inputs(
        input, running_mean, running_var, weight, bias,
        names=("input", "running_mean", "running_var", "weight", "bias"),
    )  # fmt: skip
    c = check_channels(input, None, "batch_norm")
    check_per_channel(c, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    values = int(input.shape[0]) * prod(input.shape[2:])  # per channel
    empty = values == 0 or c == 0  # no values at all
    # (an empty input in inference needs no buffers: PyTorch returns its empty output)
    check_running_given(running_mean, running_var, training or empty, "batch_norm")
    check_buffers_paired(running_mean, running_var)
    if training and values == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {tuple(input.shape)}"
        )
    check_out(xp, out, input)
    if empty and (training or running_mean is None):  # the buffers stay (PyTorch)
        return (
            *empty_forward(xp, input, (c,), weight, bias, out),
            as_native(running_mean),
            as_native(running_var),
        )
    return run(
        "batch_norm_forward", xp, input, running_mean, running_var, weight, bias, training,
        momentum, eps, out=out, reads=(running_mean, running_var, weight, bias),
    )  # fmt: skip


def batch_norm_backward(
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool | None = None,
    *,
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """BatchNorm backward, from the upstream gradient and the saved statistics.

    With ``xhat = (x - mean_c) * rstd_c``, ``dxhat = dy * weight_c`` (``dy``
    without weight) and means over the n values of a channel (batch and spatial
    axes):

        training (the batch statistics depend on x):
            dx = rstd_c * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        inference (the running statistics are constants):
            dx = rstd_c * dxhat
        both:
            dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Parameters
    ----------
    grad_output : array
        dy; shape of ``input``.
    input : array, shape (N, C, *spatial)
        The forward's input.
    mean, rstd : arrays of shape (C,)
        As returned by ``batch_norm_forward``.
    weight, bias : arrays of shape (C,), optional
        As given to the forward.
    training : bool
        The value the forward was called with. Required (a TypeError without it): the
        forward's default is False (inference, as PyTorch's ``F.batch_norm``), the
        gradient of a training forward another formula, and ``mean``/``rstd`` do not
        say which the forward was (PyTorch's ``native_batch_norm_backward`` requires
        its ``train`` too).
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
    >>> x = np.array([[1.0], [3.0]])
    >>> y, mean, rstd, _, _ = F.batch_norm_forward(x, np.zeros(1), np.full(1, 4.0), eps=0.0)  # inference
    >>> dx, dw, db = F.batch_norm_backward(np.ones_like(x), x, mean, rstd, np.full(1, 3.0), training=False)
    >>> dx  # rstd * dy * weight = 0.5 * 1 * 3
    array([[1.5],
           [1.5]])
    """
    training = check_backward_training(training, "batch_norm_backward")
    xp = float_inputs(
        grad_output, input, mean, rstd, weight, bias,
        names=("grad_output", "input", "mean", "rstd", "weight", "bias"), required=4,
    )  # fmt: skip
    c = check_channels(input, None, "batch_norm")
    check_grad_output(grad_output, input)
    check_per_channel(c, mean=mean, rstd=rstd, weight=weight, bias=bias)
    check_out(xp, out, input)
    if prod(input.shape) == 0:
        return empty_backward(xp, input, weight, bias, out)
    return run(
        "batch_norm_backward", xp, grad_output, input, mean, rstd, weight, bias, training,
        out=out, reads=(mean, rstd, weight),
    )  # fmt: skip


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
    """BatchNorm with ``torch.nn.functional.batch_norm``'s signature and semantics.

        y = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c

    with batch statistics when ``training`` (and, when buffers are given, the
    running statistics updated **in place**, the variance unbiased), else the
    running statistics. See ``batch_norm_forward`` for the formulas; it is the pure
    version.

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
    running_mean, running_var : arrays of shape (C,), or None
        Updated in place when training.
    weight, bias : arrays of shape (C,), optional
    training : bool, default False
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
    >>> rm, rv = np.zeros(1), np.ones(1)
    >>> y = F.batch_norm(np.array([[1.0], [3.0]]), rm, rv, training=True)
    >>> rm, rv
    (array([0.2]), array([1.1]))

    Raises
    ------
    ValueError
        As ``batch_norm_forward``, and, as PyTorch's, when ``training`` with
        ``eps = 0`` (``batch_norm_forward`` itself allows it).
    TypeError
        As ``batch_norm_forward``.
    """
    training = check_flag(training, "batch_norm: training")
    check_training_eps(check_eps(eps), training)
    y, _, _, new_mean, new_var = batch_norm_forward(
        input, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if training:
        store_running(running_mean, running_var, new_mean, new_var, counted=False)
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
