"""BatchNorm1d/2d/3d: parameters, running statistics and the train/eval switch."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from .._backend import Array, counter_dtype
from .._checks import check_count, check_eps, check_real
from ..functional._channels import channels_of, check_channels, check_training_eps
from ..functional.batch_norm import batch_norm_backward, batch_norm_forward
from ._module import DEVICE_DTYPE_XP_DOC, Module, Saved, Updates


def cumulative_factor(xp: ModuleType, counter: Array) -> float:
    """``1 / num_batches_tracked``, the step of ``momentum=None``'s cumulative average, from
    a counter of one value whatever its shape (PyTorch's ``float()`` of a one-element
    tensor: a counter of shape (1,) trains there); PyTorch's ValueError for more values."""
    if len(counter.shape) and math.prod(counter.shape) != 1:
        raise ValueError(
            "num_batches_tracked must hold one count (momentum=None averages over it), "
            f"got shape {tuple(counter.shape)}"
        )
    return 1.0 / float(xp.reshape(counter, ()))


class _NormBase(Module):
    """Parameters and running buffers of the per-channel layers, as PyTorch's ``_NormBase``."""

    _parameter_names = ("weight", "bias")
    _buffer_names = ("running_mean", "running_var", "num_batches_tracked")
    _version = 2  # PyTorch's _NormBase: a checkpoint of version 2 has num_batches_tracked

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(device=device, dtype=dtype, xp=xp)
        self.num_features = check_count(num_features, "num_features")
        self.eps = check_eps(eps)
        self.momentum = None if momentum is None else check_real(momentum, "momentum (or None)")
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        xp_, c, on = self.xp, num_features, self._where(device)
        self.weight: Array | None = xp_.ones((c,), **on) if affine else None
        self.bias: Array | None = xp_.zeros((c,), **on) if affine and bias else None
        self.running_mean: Array | None = None
        self.running_var: Array | None = None
        self.num_batches_tracked: Array | None = None
        if self.track_running_stats:
            self.running_mean = xp_.zeros((c,), **on)
            self.running_var = xp_.ones((c,), **on)
            self.num_batches_tracked = xp_.asarray(
                0, dtype=counter_dtype(xp_, on["device"]), device=on["device"]
            )

    def _updates_buffers(self) -> bool:
        return bool(self.training) and bool(self.track_running_stats) and bool(self.buffers())

    def reset_running_stats(self) -> None:
        """Running mean back to zeros, running variance to ones, ``num_batches_tracked``
        to 0, as in a new module (nothing to do without ``track_running_stats``). In
        place, as PyTorch's ``zero_()``/``fill_(1)``: a ``state_dict()`` taken earlier, or a
        module sharing the buffers (``SyncBatchNorm.convert_sync_batchnorm``), sees the reset."""
        if self.track_running_stats:
            self._refill(
                {"running_mean": 0, "running_var": 1, "num_batches_tracked": 0}, "reset_running_stats"
            )

    def reset_parameters(self) -> None:
        """``reset_running_stats()``, then ``weight`` back to ones and ``bias`` to zeros
        (where the layer has them), in place as PyTorch's ``reset_parameters``."""
        before = self._saved
        self.reset_running_stats()  # a subclass's override included, as in PyTorch
        self._refill({"weight": 1, "bias": 0}, "reset_parameters")
        self._name_overwrite(before, "reset_parameters")  # the method called, not its helper

    def _missing_key_defaults(self, version: int | None) -> dict[str, Array]:
        # As PyTorch's _NormBase: a checkpoint from before num_batches_tracked existed
        # (torch < 0.4.1, module version < 2, or no version) keeps the module's counter,
        # where track_running_stats is true now (as set, not as constructed): 0 where the
        # counter was set to None, which is then an unexpected key, as in PyTorch.
        if not self.track_running_stats or (version is not None and version >= 2):
            return {}
        counter, on = self.num_batches_tracked, self._device()  # (the module's device)
        return {
            "num_batches_tracked": self.xp.asarray(0, dtype=counter_dtype(self.xp, on), device=on)
            if counter is None
            else counter
        }

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}"
        )


class _BatchNorm(_NormBase):
    """BatchNorm1d/2d/3d: the per-channel computation with batch or running
    statistics (the public classes' docstrings describe it)."""

    _kept_for_backward = ("weight", "running_mean", "running_var")  # as torch's batch_norm_backward
    _written_uncounted = ("running_mean", "running_var")  # as torch's batch_norm kernel

    def _kept(self) -> tuple[str, ...] | None:
        """After a forward of an empty batch, the weight alone: PyTorch's batch_norm returns
        ``input * weight + bias`` there, whose backward keeps no running statistics (a
        ``load_state_dict`` or ``reset_running_stats`` before the backward does not make it
        raise)."""
        saved = self._saved
        if isinstance(saved, tuple) and saved and 0 in tuple(getattr(saved[0], "shape", (1,))):
            return ("weight",)
        return super()._kept()

    _expected_ndims: tuple[int, ...] = ()

    def _takes_ndim(self, ndim: int) -> bool:
        """Whether an input of ``ndim`` dims has the dims this layer takes."""
        return ndim in self._expected_ndims

    def _check_input_dim(self, input: Array) -> None:
        if not self._takes_ndim(input.ndim):
            dims = " or ".join(f"{d}D" for d in self._expected_ndims)
            raise ValueError(f"expected {dims} input (got {input.ndim}D input of shape {tuple(input.shape)})")

    def _expected_channels(self, buffers_in_use: bool) -> tuple[int | None, str]:
        """The channel count an input must have: the length of the per-channel arrays that
        take part (weight, bias, and the running statistics when in use), else any (None),
        as PyTorch checks those arrays' lengths and not ``num_features``; and the array's
        name (``channels_of``) where that length is not ``num_features`` (a replaced
        array, which the error names), else ""."""
        running = {"running_mean": self.running_mean, "running_var": self.running_var}
        expected, source = channels_of(
            weight=self.weight, bias=self.bias, **(running if buffers_in_use else {})
        )
        return expected, source if expected != self.num_features else ""

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        self._check_input_dim(input)
        buffers_in_use = not self.training or self.track_running_stats
        expected, source = self._expected_channels(buffers_in_use)
        unbatched = self._takes_ndim(input.ndim + 1)  # (x[None] is an input it takes)
        check_channels(input, expected, type(self).__name__, source=source, unbatched=unbatched)
        factor = 0.0 if self.momentum is None else self.momentum
        updates: Updates = {}
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            # a 0-d array: NumPy arithmetic on a 0-d array returns a NumPy scalar (made one by
            # NumPy's own asarray, the same array as array_api_compat's, at a third of its cost)
            count = self.num_batches_tracked + 1
            updates["num_batches_tracked"] = (
                np.asarray(count) if isinstance(count, np.generic) else self.xp.asarray(count)
            )
            if self.momentum is None:  # cumulative moving average
                factor = cumulative_factor(self.xp, updates["num_batches_tracked"])
        # batch statistics when training, or when there are no running statistics (a bool
        # whatever was set: training = 1 trains, as in PyTorch; the functions take only bools)
        use_batch_stats = bool(self.training) or (self.running_mean is None and self.running_var is None)
        check_training_eps(self.eps, use_batch_stats)  # as PyTorch's: eps = 0 only in eval
        running_mean = self.running_mean if buffers_in_use else None
        running_var = self.running_var if buffers_in_use else None
        y, mean, rstd, new_mean, new_var = batch_norm_forward(
            input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
        )
        if use_batch_stats and running_mean is not None:
            updates["running_mean"], updates["running_var"] = new_mean, new_var
        return y, (input, mean, rstd, use_batch_stats, self.weight, self.bias), updates

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, use_batch_stats, weight, bias = saved
        dx, dweight, dbias = batch_norm_backward(
            grad_output, input, mean, rstd, weight, bias, use_batch_stats
        )
        return dx, {"weight": dweight, "bias": dbias}


_BATCH_NORM_DOC = """Batch normalization over {input} input
    (Ioffe & Szegedy 2015, https://arxiv.org/abs/1502.03167).

    Each channel c is normalized over the batch and spatial axes, n = {n}
    values per channel:

        mean_c = sum(x[:, c]) / n
        var_c  = sum((x[:, c] - mean_c)**2) / n        (biased; two passes)
        y      = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c

    Training and evaluation (PyTorch's rules, each pinned by a test):

    - Training mode (``train()``, the default): the batch statistics above
      normalize, and the running statistics move towards them:

          running_mean = (1 - momentum) * running_mean + momentum * mean_c
          running_var  = (1 - momentum) * running_var  + momentum * var_c * n/(n - 1)

      The running variance takes the *unbiased* batch variance (``n/(n-1)``,
      Bessel's correction); the output uses the biased one. ``momentum=None``
      makes the update a cumulative average, with factor
      ``1 / num_batches_tracked``. ``num_batches_tracked`` (a 0-d int64 array)
      counts the training forwards.
    - Eval mode (``eval()``): the running statistics normalize,
      ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias``, and
      nothing is updated; an example's output no longer depends on its batch.
    - ``track_running_stats=False``: no running statistics; batch statistics in
      both modes.
    - Training on one value per channel raises ``ValueError`` (PyTorch raises
      too, after incrementing the counter; npnorm changes nothing).

    Backward, with ``rstd_c = 1 / sqrt(var_c + eps)``, ``xhat = (x - mean_c) * rstd_c``,
    ``dxhat = dy * weight_c`` and means over the n values of a channel:

        training (the batch statistics depend on x):
            dx = rstd_c * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        eval (the running statistics are constants):
            dx = rstd_c * dxhat
        both:
            dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Same arguments, defaults and ``state_dict`` keys (weight, bias, running_mean,
    running_var, num_batches_tracked) as ``torch.nn.{name}``.

    Parameters
    ----------
    num_features : int
        C, the number of channels (dim 1 of the input).
    eps : float, default 1e-5
        Added to the variance before the square root.
    momentum : float or None, default 0.1
        Weight of the batch statistics in the running-statistics update; ``None``
        for a cumulative average.
    affine : bool, default True
        Learn a per-channel ``weight`` (ones) and ``bias`` (zeros).
    track_running_stats : bool, default True
        Keep ``running_mean`` (zeros), ``running_var`` (ones) and
        ``num_batches_tracked`` (0) as buffers.
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
    >>> bn = npnorm.{name}(3)
    >>> x = np.random.default_rng(0).normal(size={shape}).astype(np.float32)
    >>> y = bn(x)                          # training: batch statistics
    >>> dx = bn.backward(np.ones_like(y))  # input gradient; bn.grads: weight, bias
    >>> int(bn.num_batches_tracked), bn.running_mean.shape
    (1, (3,))
    >>> y_eval = bn.eval()(x[:1])          # eval: running statistics, any batch size
    """


class BatchNorm1d(_BatchNorm):
    __doc__ = _BATCH_NORM_DOC.format(
        name="BatchNorm1d",
        input="(N, C) or (N, C, L)",
        n="N or N*L",
        shape=(4, 3, 5),
        device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )

    _expected_ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    __doc__ = _BATCH_NORM_DOC.format(
        name="BatchNorm2d",
        input="(N, C, H, W)",
        n="N*H*W",
        shape=(4, 3, 2, 2),
        device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )

    _expected_ndims = (4,)


class BatchNorm3d(_BatchNorm):
    __doc__ = _BATCH_NORM_DOC.format(
        name="BatchNorm3d",
        input="(N, C, D, H, W)",
        n="N*D*H*W",
        shape=(2, 3, 2, 2, 2),
        device_dtype_xp=DEVICE_DTYPE_XP_DOC,
    )

    _expected_ndims = (5,)
