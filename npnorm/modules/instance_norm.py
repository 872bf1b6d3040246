"""InstanceNorm1d/2d/3d: per-sample, per-channel normalization, batched or not."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._backend import Array
from ..functional.instance_norm import instance_norm_backward, instance_norm_forward
from ._module import Saved, Updates
from .batch_norm import _NormBase


class _InstanceNorm(_NormBase):
    r"""Instance normalization (Ulyanov et al. 2016, https://arxiv.org/abs/1607.08022).

    .. math::
        y_{n,c} = \frac{x_{n,c} - \mathrm{E}[x_{n,c}]}{\sqrt{\mathrm{Var}[x_{n,c}] + \epsilon}} w_c + b_c

    each (sample, channel) over its spatial axes. Defaults as ``torch.nn.InstanceNorm*d``:
    ``affine=False``, ``track_running_stats=False``. With running statistics, training
    moves them towards the batch average of the per-instance statistics (unbiased
    variance) and eval normalizes with them; as in PyTorch, ``num_batches_tracked``
    is kept in the state_dict but never incremented, and ``momentum=None`` leaves the
    running statistics unchanged. Unbatched input (no N axis) is accepted. Where
    PyTorch only warns (a channel count that differs from ``num_features`` without
    affine), this raises ``ValueError``.
    """

    _no_batch_ndim = 0

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        *,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype=dtype, xp=xp)

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
        x = xp.expand_dims(input, axis=0) if unbatched else input
        use_input_stats = self.training or not self.track_running_stats
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
        return y, (x, mean, rstd, use_input_stats, unbatched), updates

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        x, mean, rstd, use_input_stats, unbatched = saved
        if unbatched:
            if tuple(grad_output.shape) != tuple(x.shape[1:]):
                raise ValueError(
                    f"grad_output must have the shape of the forward's input {tuple(x.shape[1:])}, "
                    f"got {tuple(grad_output.shape)}"
                )
            grad_output = self.xp.expand_dims(grad_output, axis=0)
        dx, dweight, dbias = instance_norm_backward(
            grad_output, x, mean, rstd, self.weight, self.bias, use_input_stats
        )
        return (dx[0, ...] if unbatched else dx), {"weight": dweight, "bias": dbias}


class InstanceNorm1d(_InstanceNorm):
    """InstanceNorm over (N, C, L) or unbatched (C, L) input.

    Parameters
    ----------
    num_features : int
    eps : float, default 1e-5
    momentum : float or None, default 0.1
    affine : bool, default False
    track_running_stats : bool, default False
    dtype, xp : keyword-only; float32 and numpy by default
    """

    _no_batch_ndim = 2


class InstanceNorm2d(_InstanceNorm):
    """InstanceNorm over (N, C, H, W) or unbatched (C, H, W) input; arguments as InstanceNorm1d."""

    _no_batch_ndim = 3


class InstanceNorm3d(_InstanceNorm):
    """InstanceNorm over (N, C, D, H, W) or unbatched (C, D, H, W) input; arguments as InstanceNorm1d."""

    _no_batch_ndim = 4
