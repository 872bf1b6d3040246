"""Pieces shared by the layers with a per-channel affine map (BatchNorm,
InstanceNorm, GroupNorm): the (N, C, S) view, the affine map and its backward, the
running-statistics update, and the checks they all make."""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._backend import (
    Array,
    Namespace,
    copy_array,
    grad_tracked,
    torch_refuses_in_place,
    writable,
    write_uncounted,
)
from .._checks import cast, check_real, prod, work_dtype, write_out
from .._stats import (
    centred,
    centred_again,
    moments,
    reshaped,
    rstd_of,
    scaled,
    standardize_backward,
    wide_sum,
    xhat_from,
)
from ._dispatch import as_plain


def as_ncs(xp: Namespace, x: Array, dtype: Any) -> Array:
    """``x`` of shape (N, C, *spatial) viewed as (N, C, S), S = prod(spatial), in ``dtype``."""
    n, c = int(x.shape[0]), int(x.shape[1])
    return reshaped(xp, cast(xp, x, dtype), (n, c, prod(x.shape[2:])))  # N,C,S


def channel_affine(xp: Namespace, xhat: Array, weight: Array | None, bias: Array | None, dtype: Any) -> Array:
    """``y = xhat * w[c] + b[c]`` for ``xhat`` of shape (N, C, S)."""
    y = xhat  # N,C,S
    if weight is not None:
        y = y * xp.reshape(cast(xp, weight, dtype), (1, -1, 1))  # N,C,S
    if bias is not None:
        y = y + xp.reshape(cast(xp, bias, dtype), (1, -1, 1))  # N,C,S
    return y


def channel_affine_grads(
    xp: Namespace, dy: Array, xhat: Array, weight: Array | None, bias: Array | None
) -> tuple[Array | None, Array | None]:
    """``(dweight, dbias)`` of the per-channel affine map; dy, xhat are (N, C, S)
    (summed in float64, ``wide_sum``)."""
    dweight = None if weight is None else cast(xp, wide_sum(xp, dy * xhat, (0, 2)), weight.dtype)  # C
    dbias = None if bias is None else cast(xp, wide_sum(xp, dy, (0, 2)), bias.dtype)  # C
    return dweight, dbias


def channel_affine_backward(
    xp: Namespace, dy: Array, xhat: Array, weight: Array | None, bias: Array | None, dtype: Any
) -> tuple[Array, Array | None, Array | None]:
    """``(dxhat, dweight, dbias)`` of the per-channel affine map; dy, xhat are (N, C, S)
    (dweight and dbias as ``channel_affine_grads``)."""
    dweight, dbias = channel_affine_grads(xp, dy, xhat, weight, bias)  # C  C
    dxhat = dy if weight is None else dy * xp.reshape(cast(xp, weight, dtype), (1, -1, 1))  # N,C,S
    return dxhat, dweight, dbias


def running_update(xp: Namespace, running: Array, batch: Array, momentum: float) -> Array:
    """``(1 - momentum) * running + momentum * batch``, computed in ``batch``'s dtype
    (float32 at least) and returned in the buffer's dtype."""
    new = (1.0 - momentum) * cast(xp, running, batch.dtype) + momentum * batch  # C
    return cast(xp, new, running.dtype)


def store_running(
    running_mean: Array | None,
    running_var: Array | None,
    new_mean: Array | None,
    new_var: Array | None,
    *,
    counted: bool,
) -> None:
    """Write updated running statistics into the caller's buffers, in place, as
    ``torch.nn.functional.batch_norm``/``instance_norm`` do; no-op without buffers.
    ``counted``: a plain in-place write, as torch's instance_norm (``copy_``: a torch
    tensor's change counter moves, an inference tensor is refused outside inference
    mode); else as torch's batch_norm kernel writes them (``write_uncounted``). Both or
    neither: where ``running_var`` refuses the write (a read-only NumPy array),
    ``running_mean`` gets its old values back before the error propagates."""
    if running_mean is not None and running_var is not None:
        if counted and (torch_refuses_in_place(running_mean) or torch_refuses_in_place(running_var)):
            # torch raises this after writing running_mean: refused here before any write
            raise RuntimeError(
                "Inplace update to inference tensor outside InferenceMode is not allowed: the running "
                "statistics were made inside torch.inference_mode() (nothing was written)"
            )
        fixed = [
            name
            for name, a in (("running_mean", running_mean), ("running_var", running_var))
            if not writable(a)
        ]
        if fixed:  # read-only (NumPy), immutable (JAX) or broadcast (expand): refused before any write
            raise ValueError(
                f"{' and '.join(fixed)} cannot be written in place (read-only, immutable, or broadcast: "
                "several elements at one memory location), as this call "
                "updates the running statistics; batch_norm_forward / instance_norm_forward return them "
                "instead (nothing was written)"
            )
        write = _write_counted if counted else write_uncounted
        old_mean = copy_array(running_mean)  # C
        write(running_mean, new_mean)
        try:
            write(running_var, new_var)
        except BaseException:
            write(running_mean, old_mean)
            raise


def _write_counted(current: Array, value: Array) -> None:
    current[...] = value


def check_channels(
    x: Array, num: int | None, what: str, *, min_ndim: int = 2, source: str = "", unbatched: bool = False
) -> int:
    """``x`` is (N, C, *) with at least ``min_ndim`` dims; return C (checked against ``num``,
    the length of the module's array named ``source``, where given). ``unbatched``: the
    layer takes ``x[None]`` too, so an ``x`` with ``num`` at dim 0 may be one sample
    without its batch axis, and the error says how to add it."""
    if x.ndim < min_ndim:
        raise ValueError(
            f"{what} expects input of shape (N, C, *) with at least {min_ndim} dims, "
            f"got shape {tuple(x.shape)}"
        )
    c = int(x.shape[1])
    if num is not None and c != num:
        whose = f" (the length of its {source})" if source else ""
        shape = tuple(x.shape)
        hint = (
            f" (if it is one sample with its {num} channels at dim 0, add the batch axis: x[None])"
            if unbatched and shape[0] == num and not source
            else ""
        )
        raise ValueError(f"{what} expected {num} channels at dim 1{whose}, got input of shape {shape}{hint}")
    return c


def channels_of(**arrays: Array | None) -> tuple[int | None, str]:
    """The channel count the given per-channel arrays ask of an input, and the name of the
    array that says so: the length of the first that is not None (``check_per_channel``
    then holds the others to it), or ``(None, "")`` (any count) where all are None. A
    module's input is checked against its arrays' lengths, not its ``num_features``, as
    PyTorch's: a layer grown by replacing its arrays runs."""
    for name, a in arrays.items():
        if a is not None:
            return (int(a.shape[0]), name) if a.ndim >= 1 else (None, "")
    return None, ""


def check_per_channel(c: int, **arrays: Array | None) -> None:
    for name, a in arrays.items():
        if a is not None and tuple(a.shape) != (c,):
            raise ValueError(f"{name} must have shape ({c},) (one value per channel), got {tuple(a.shape)}")


def check_training_eps(eps: float, training: bool) -> None:
    """PyTorch's ``batch_norm`` refuses ``eps = 0`` with batch statistics (a constant
    channel would divide 0 by 0)."""
    if training and eps <= 0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")


def check_momentum(momentum: Any) -> float:
    return check_real(momentum, "momentum")


def empty_forward(
    xp: Namespace,
    input: Array,
    stats_shape: tuple[int, ...],
    weight: Array | None,
    bias: Array | None,
    out: Array | None,
) -> tuple[Array, Array, Array]:
    """The forward of an input whose channels (or groups, or instances) hold no values,
    as PyTorch computes it: an empty output, and statistics of nothing (NaN, as NumPy's
    mean of nothing, without its warning) of shape ``stats_shape``; NumPy results in
    native byte order (``as_plain``), as every kernel's."""
    ct = work_dtype(xp, input, weight, bias)
    on = array_api_compat.device(input)  # results on the input's device, as every kernel's
    nan = xp.full(stats_shape, float("nan"), dtype=ct, device=on)
    return (
        write_out(xp, out, as_plain(xp.zeros(tuple(input.shape), dtype=input.dtype, device=on))),
        nan,
        xp.asarray(nan, copy=True),
    )


def empty_backward(
    xp: Namespace,
    input: Array,
    weight: Array | None,
    bias: Array | None,
    out: Array | None,
) -> tuple[Array, Array | None, Array | None]:
    """The backward of an input with no values: an empty dx, and dweight, dbias sums of
    nothing (zeros, as PyTorch's), in the parameters' dtypes (as ``channel_affine_backward``);
    NumPy results in native byte order (``as_plain``), as every kernel's."""
    c, on = int(input.shape[1]), array_api_compat.device(input)
    dx = write_out(xp, out, as_plain(xp.zeros(tuple(input.shape), dtype=input.dtype, device=on)))
    dweight = None if weight is None else as_plain(xp.zeros((c,), dtype=weight.dtype, device=on))
    dbias = None if bias is None else as_plain(xp.zeros((c,), dtype=bias.dtype, device=on))
    return dx, dweight, dbias


def check_running_given(
    running_mean: Array | None, running_var: Array | None, use_batch_stats: bool, what: str
) -> None:
    """Without batch statistics (BatchNorm in eval, InstanceNorm with
    ``use_input_stats=False``) both running buffers, else PyTorch's ``RuntimeError``."""
    if use_batch_stats or (running_mean is not None and running_var is not None):
        return
    if what == "instance_norm":
        raise RuntimeError(
            "Expected running_mean and running_var to be defined when use_input_stats is false "
            "(instance_norm then normalizes with them)"
        )
    missing = "running_mean" if running_mean is None else "running_var"
    raise RuntimeError(f"{missing} must be defined in evaluation mode (training=False)")


def check_buffers_paired(running_mean: Array | None, running_var: Array | None) -> None:
    """Both running buffers or neither; and, as PyTorch's batch_norm, none a torch tensor
    that requires grad while grad is enabled (torch: "not differentiable with respect to
    argument 'running_var'"), refused before anything is written."""
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (or both None)")
    for name, a in (("running_mean", running_mean), ("running_var", running_var)):
        if grad_tracked(a):
            raise RuntimeError(
                f"{name} requires grad: the running statistics are not differentiable (PyTorch's "
                "batch_norm refuses them too); pass a tensor that does not require grad"
            )


def channel_norm_forward(
    xp: Namespace,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    axes: tuple[int, ...],
    out: Array | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    """The forward BatchNorm (``axes=(0, 2)``) and InstanceNorm (``axes=(2,)``) share.

    On the (N, C, S) view: with input statistics, mean and biased variance over
    ``axes`` (kept as size-1 axes), and the running buffers moved towards their average
    over the remaining instances (one for BatchNorm, N for InstanceNorm) with the
    variance unbiased by ``count/(count-1)``, ``count`` the values per statistic.
    Without, the running statistics, shaped (1, C, 1). Returns the output in the input's
    shape and dtype (written into ``out`` when given), mean and rstd as computed
    (keepdims), and the new buffers.
    """
    ct = work_dtype(xp, input, weight, bias, running_mean, running_var)  # float32 at least
    x = as_ncs(xp, input, ct)  # N,C,S
    new_mean, new_var = running_mean, running_var
    if use_input_stats:
        mean, var = moments(xp, x, axes)  # 1,C,1 (BN) or N,C,1 (IN), float64; variance biased
        assert mean is not None
        if running_mean is not None and running_var is not None:
            count = prod([int(x.shape[a]) for a in axes])  # values per statistic
            batch_mean = xp.sum(mean, axis=(0, 2)) / mean.shape[0]  # C, average over instances (none: NaN)
            batch_var = xp.sum(var, axis=(0, 2)) / mean.shape[0] * (count / (count - 1))  # C, unbiased
            new_mean = running_update(xp, running_mean, batch_mean, momentum)  # C
            new_var = running_update(xp, running_var, batch_var, momentum)  # C
        rstd = rstd_of(xp, var, eps, var.dtype)  # same shape as mean, float64
        xhat = cast(xp, centred(xp, x, mean) * rstd, ct)  # N,C,S: the offset removed in float64
        mean, rstd = cast(xp, mean, ct), cast(xp, rstd, ct)  # what backward gets
    else:
        assert running_mean is not None and running_var is not None
        # a copy, so that the saved statistics never alias the caller's buffers
        mean = xp.reshape(xp.asarray(running_mean, dtype=ct, copy=True), (1, -1, 1))  # 1,C,1
        var = xp.reshape(cast(xp, running_var, ct), (1, -1, 1))  # 1,C,1
        rstd = rstd_of(xp, var, eps, ct)  # 1,C,1
        xhat = xhat_from(x, mean, rstd)  # N,C,S
    y = channel_affine(xp, xhat, weight, bias, ct)  # N,C,S
    y = cast(xp, reshaped(xp, y, tuple(input.shape)), input.dtype)
    return write_out(xp, out, y), mean, rstd, new_mean, new_var


def channel_norm_backward(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    use_input_stats: bool,
    axes: tuple[int, ...],
    out: Array | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """The backward BatchNorm and InstanceNorm share; ``mean``/``rstd`` as the forward
    computed them, in any shape that reshapes to 1,C,1 (running or BatchNorm) or N,C,1."""
    ct = work_dtype(xp, input, weight, bias, mean)
    x = as_ncs(xp, input, ct)  # N,C,S
    dy = as_ncs(xp, grad_output, ct)  # N,C,S
    n, c = int(x.shape[0]), int(x.shape[1])
    per_instance = use_input_stats and 0 not in axes  # InstanceNorm's input statistics
    stats = (n, c, 1) if per_instance else (1, c, 1)
    mean = xp.reshape(cast(xp, mean, ct), stats)  # 1,C,1 or N,C,1
    rstd = xp.reshape(cast(xp, rstd, ct), stats)  # 1,C,1 or N,C,1
    xhat = xhat_from(x, mean, rstd)  # N,C,S
    if use_input_stats:  # on what the saved mean's rounding left
        xhat = centred_again(xp, xhat, axes)  # N,C,S: before dweight takes it
    dweight, dbias = channel_affine_grads(xp, dy, xhat, weight, bias)  # C  C
    # w is one number per statistic here, so it factors out of dxhat = dy*w: dx is taken
    # from dy and scaled by rstd * w once, which centres dy before scaling it, as
    # PyTorch's kernel does (dxhat = dy*w first rounds a common part of dy at w's scale)
    w = None if weight is None else xp.reshape(weight, (1, -1, 1))  # 1,C,1
    if use_input_stats:
        dx = standardize_backward(xp, dy, xhat, rstd, axes, weight=w)  # N,C,S
    elif w is not None:  # the statistics are constants: dx = dy * (rstd * w)
        dx = scaled(xp, dy, rstd, w)  # N,C,S
    else:
        dx = dy * rstd  # N,C,S: the statistics are constants
    return write_out(xp, out, cast(xp, reshaped(xp, dx, tuple(input.shape)), input.dtype)), dweight, dbias
