"""BatchNorm1d/2d/3d: parameters, running statistics and the train/eval switch."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import check_eps
from ..functional._channels import check_channels
from ..functional.batch_norm import batch_norm_backward, batch_norm_forward
from ._module import Module, Saved, Updates


class _NormBase(Module):
    """Parameters and running buffers of the per-channel layers, as PyTorch's ``_NormBase``."""

    _parameter_names = ("weight", "bias")
    _buffer_names = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(dtype=dtype, xp=xp)
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features <= 0:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))):
            raise TypeError(f"momentum must be a number or None, got {momentum!r}")
        self.num_features = num_features
        self.eps = check_eps(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        xp_, c = self.xp, num_features
        self.weight: Array | None = xp_.ones((c,), dtype=self.dtype) if affine else None
        self.bias: Array | None = xp_.zeros((c,), dtype=self.dtype) if affine else None
        self.running_mean: Array | None = None
        self.running_var: Array | None = None
        self.num_batches_tracked: Array | None = None
        if self.track_running_stats:
            self.running_mean = xp_.zeros((c,), dtype=self.dtype)
            self.running_var = xp_.ones((c,), dtype=self.dtype)
            self.num_batches_tracked = xp_.asarray(0, dtype=xp_.int64)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            self.running_mean = self.xp.zeros((self.num_features,), dtype=self.dtype)
            self.running_var = self.xp.ones((self.num_features,), dtype=self.dtype)
            self.num_batches_tracked = self.xp.asarray(0, dtype=self.xp.int64)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )


class _BatchNorm(_NormBase):
    r"""Batch normalization (Ioffe & Szegedy 2015, https://arxiv.org/abs/1502.03167).

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot w + b

    per channel, over the batch and spatial axes. In training the batch statistics
    (biased variance) normalize and the running statistics are updated with
    ``new = (1 - momentum) * old + momentum * batch`` using the *unbiased* batch
    variance; ``momentum=None`` makes it a cumulative average over
    ``num_batches_tracked``. In eval the running statistics normalize (and backward
    is then only the affine map's). ``track_running_stats=False``: no buffers, batch
    statistics in train and eval. All as ``torch.nn.BatchNorm*d``.
    """

    _expected_ndims: tuple[int, ...] = ()

    def _check_input_dim(self, input: Array) -> None:
        if input.ndim not in self._expected_ndims:
            dims = " or ".join(f"{d}D" for d in self._expected_ndims)
            raise ValueError(f"expected {dims} input (got {input.ndim}D input of shape {tuple(input.shape)})")

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        self._check_input_dim(input)
        check_channels(input, self.num_features, type(self).__name__)
        factor = 0.0 if self.momentum is None else self.momentum
        updates: Updates = {}
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            updates["num_batches_tracked"] = self.num_batches_tracked + 1
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(updates["num_batches_tracked"])
        # batch statistics when training, or when there are no running statistics
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        buffers_in_use = not self.training or self.track_running_stats
        running_mean = self.running_mean if buffers_in_use else None
        running_var = self.running_var if buffers_in_use else None
        y, mean, rstd, new_mean, new_var = batch_norm_forward(
            input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
        )
        if use_batch_stats and running_mean is not None:
            updates["running_mean"], updates["running_var"] = new_mean, new_var
        return y, (input, mean, rstd, use_batch_stats), updates

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, use_batch_stats = saved
        dx, dweight, dbias = batch_norm_backward(
            grad_output, input, mean, rstd, self.weight, self.bias, use_batch_stats
        )
        return dx, {"weight": dweight, "bias": dbias}


class BatchNorm1d(_BatchNorm):
    """BatchNorm over (N, C) or (N, C, L) input; see :class:`_BatchNorm` for the math.

    Parameters
    ----------
    num_features : int
        C.
    eps : float, default 1e-5
    momentum : float or None, default 0.1
    affine : bool, default True
    track_running_stats : bool, default True
    dtype, xp : keyword-only; float32 and numpy by default
    """

    _expected_ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """BatchNorm over (N, C, H, W) input; arguments as :class:`BatchNorm1d`."""

    _expected_ndims = (4,)


class BatchNorm3d(_BatchNorm):
    """BatchNorm over (N, C, D, H, W) input; arguments as :class:`BatchNorm1d`."""

    _expected_ndims = (5,)
