"""InstanceNorm1d/2d/3d: per-sample, per-channel normalization, batched or not."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._backend import Array, copy_array
from .._checks import float_inputs
from ..functional.instance_norm import instance_norm_backward, instance_norm_forward
from ._module import DEVICE_DTYPE_XP_DOC, Saved, Updates
from .batch_norm import _NormBase


class _InstanceNorm(_NormBase):
    """InstanceNorm1d/2d/3d: the per-(sample, channel) computation, batched or not
    (the public classes' docstrings describe it)."""

    # torch's backward keeps copies (the weight repeated per sample): a load changes nothing
    _kept_for_backward = ()

    _no_batch_ndim = 0

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias, xp=xp
        )

    def _legacy_keys(self, source: dict[str, Any], version: int | None, prefix: str) -> list[str]:
        # As PyTorch's _InstanceNorm: a checkpoint without a version (torch < 0.4, where
        # InstanceNorm tracked running statistics by default) refused with its reason
        found = [k for k in ("running_mean", "running_var") if k in source]
        if version is not None or self.track_running_stats or not found:
            return []
        for key in found:
            del source[key]
        name = type(self).__name__
        return [
            f"unexpected running stats buffer(s) {' and '.join(repr(prefix + k) for k in found)} for {name} "
            f"with track_running_stats=False: a checkpoint saved before PyTorch 0.4.0 may have them "
            f"(InstanceNorm tracked running stats by default then); remove them from the state_dict, "
            f"or construct {name} with track_running_stats=True to use them"
        ]

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        xp = self._check_backend(input)
        nb = self._no_batch_ndim
        if input.ndim not in (nb, nb + 1):
            raise ValueError(
                f"expected {nb}D (unbatched) or {nb + 1}D (batched) input "
                f"(got {input.ndim}D input of shape {tuple(input.shape)})"
            )
        feature_dim = input.ndim - nb
        if int(input.shape[feature_dim]) != self.num_features:
            raise ValueError(
                f"expected input's size at dim={feature_dim} to match num_features "
                f"({self.num_features}), but got: {int(input.shape[feature_dim])} "
                f"(input shape {tuple(input.shape)})"
            )
        unbatched = input.ndim == nb
        kept = self._input_for_backward(input)  # x, or the copy PyTorch's backward keeps
        x = xp.expand_dims(kept, axis=0) if unbatched else kept
        use_input_stats = bool(self.training) or not self.track_running_stats  # (training = 1 trains)
        momentum = self.momentum if self.momentum is not None else 0.0
        y, mean, rstd, new_mean, new_var = instance_norm_forward(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            use_input_stats,
            momentum,
            self.eps,
        )
        updates: Updates = {}
        if use_input_stats and self.running_mean is not None:
            updates["running_mean"], updates["running_var"] = new_mean, new_var
        if unbatched:
            y = y[0, ...]
        # copies of weight and bias (C values), as torch's repeated weight: a later load
        # into them does not change this forward's gradient
        weight, bias = (None if a is None else copy_array(a) for a in (self.weight, self.bias))
        return y, (x, mean, rstd, use_input_stats, unbatched, weight, bias), updates

    def _keeps_input(self, input: Array) -> bool:
        # torch's instance_norm normalizes input.contiguous() viewed as (1, N*C, *): the
        # tensor itself when contiguous, else a copy
        return bool(input.is_contiguous())

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        x, mean, rstd, use_input_stats, unbatched, weight, bias = saved
        if unbatched:
            # the input's backend, not the module's: a module without arrays takes any
            # backend's input (and grad_output is checked here as the batched call checks it)
            xp = float_inputs(grad_output, x, names=("grad_output", "input"), required=2)
            if tuple(grad_output.shape) != tuple(x.shape[1:]):
                raise ValueError(
                    f"grad_output must have the shape of the forward's input {tuple(x.shape[1:])}, "
                    f"got {tuple(grad_output.shape)}"
                )
            grad_output = xp.expand_dims(grad_output, axis=0)
        dx, dweight, dbias = instance_norm_backward(grad_output, x, mean, rstd, weight, bias, use_input_stats)
        return (dx[0, ...] if unbatched else dx), {"weight": dweight, "bias": dbias}


_INSTANCE_NORM_DOC = """Instance normalization over {input} input, or unbatched
    {unbatched} input (Ulyanov, Vedaldi & Lempitsky 2016, https://arxiv.org/abs/1607.08022).

    Each (sample n, channel c) pair is normalized over its spatial axes, S = {s}
    values:

        mean_nc = sum(x[n, c]) / S
        var_nc  = sum((x[n, c] - mean_nc)**2) / S       (biased; two passes)
        y       = (x - mean_nc) / sqrt(var_nc + eps) * weight_c + bias_c

    Defaults as ``torch.nn.{name}``: ``affine=False`` and
    ``track_running_stats=False``, i.e. no parameters and no buffers, and the
    input's own statistics in training and eval alike.

    Running statistics (``track_running_stats=True``; PyTorch's rules):

    - Training mode: the input statistics normalize, and the running statistics
      move towards their average over the batch:

          running_mean = (1 - momentum) * running_mean + momentum * mean_n(mean_nc)
          running_var  = (1 - momentum) * running_var  + momentum * mean_n(var_nc) * S/(S - 1)

      (the *unbiased* variance). As in PyTorch, ``momentum=None`` leaves them
      unchanged, and ``num_batches_tracked`` is kept in the state_dict but never
      incremented.
    - Eval mode: the running statistics normalize,
      ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias``.
    - Input statistics over one spatial element raise ``ValueError``. Where
      PyTorch only warns (a channel count other than ``num_features``), this
      raises ``ValueError``.

    Backward, with ``rstd_nc = 1 / sqrt(var_nc + eps)``, ``xhat = (x - mean_nc) * rstd_nc``,
    ``dxhat = dy * weight_c`` and means over the S values of a (sample, channel):

        input statistics:
            dx = rstd_nc * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        running statistics (eval with track_running_stats):
            dx = dxhat / sqrt(running_var_c + eps)
        both:
            dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Parameters
    ----------
    num_features : int
        C, the number of channels (dim 1 of batched input, dim 0 of unbatched).
    eps : float, default 1e-5
        Added to the variance before the square root.
    momentum : float or None, default 0.1
        Weight of the batch-averaged instance statistics in the running-statistics
        update; ``None`` leaves the running statistics unchanged (as PyTorch).
    affine : bool, default False
        Learn a per-channel ``weight`` (ones) and ``bias`` (zeros).
    track_running_stats : bool, default False
        Keep ``running_mean`` (zeros), ``running_var`` (ones) and
        ``num_batches_tracked`` as buffers, and normalize with them in eval mode.
    bias : bool, keyword-only, default True
        With ``affine``, learn ``bias`` as well as ``weight`` (PyTorch 2.13's
        keyword of the same name).
    {device_dtype_xp}

    Attributes
    ----------
    weight, bias : array of shape (C,), or None without ``affine``
    running_mean, running_var : array of shape (C,), or None without ``track_running_stats``
    num_batches_tracked : 0-d int64 array (int32 where the backend or device has no int64), or None
        without ``track_running_stats``
    grads : dict of str to array
        Gradients of ``weight`` and ``bias`` accumulated by ``backward``.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> inorm = npnorm.{name}(3, affine=True)
    >>> x = np.random.default_rng(0).normal(size={shape}).astype(np.float32)
    >>> y = inorm(x)
    >>> dx = inorm.backward(np.ones_like(y))
    >>> sorted(inorm.grads), inorm(x[0]).shape  # unbatched input too
    (['bias', 'weight'], {unbatched_shape})
    """


class InstanceNorm1d(_InstanceNorm):
    __doc__ = _INSTANCE_NORM_DOC.format(
        name="InstanceNorm1d", input="(N, C, L)", unbatched="(C, L)", s="L", shape=(2, 3, 5),
        unbatched_shape=(3, 5), device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )  # fmt: skip

    _no_batch_ndim = 2


class InstanceNorm2d(_InstanceNorm):
    __doc__ = _INSTANCE_NORM_DOC.format(
        name="InstanceNorm2d", input="(N, C, H, W)", unbatched="(C, H, W)", s="H*W", shape=(2, 3, 4, 4),
        unbatched_shape=(3, 4, 4), device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )  # fmt: skip

    _no_batch_ndim = 3


class InstanceNorm3d(_InstanceNorm):
    __doc__ = _INSTANCE_NORM_DOC.format(
        name="InstanceNorm3d", input="(N, C, D, H, W)", unbatched="(C, D, H, W)", s="D*H*W",
        shape=(2, 3, 2, 2, 2), unbatched_shape=(3, 2, 2, 2), device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )  # fmt: skip

    _no_batch_ndim = 4
