"""The RMSNorm module: parameters and saved context around the functional core."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import as_shape, check_eps, default_eps
from ..functional.rms_norm import rms_norm_backward, rms_norm_forward
from ._module import DEVICE_DTYPE_XP_DOC, Module, Saved, Updates

_RMS_NORM_DOC = """Root-mean-square normalization (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    Each row (the trailing ``normalized_shape`` axes of the input, D values) is
    scaled by its root mean square; no mean is subtracted and there is no bias:

        ms = sum(x**2) / D
        y  = x / sqrt(ms + eps) * weight

    ``weight`` (ones) has shape ``normalized_shape``. ``eps=None`` (the default,
    as in PyTorch) is the machine epsilon of the input's own dtype (float32's for
    float16 input), whatever the weight's dtype (float32 input with a float64
    weight is computed in float64, with float32's epsilon). Same
    arguments, defaults and ``state_dict`` keys as ``torch.nn.RMSNorm``.

    Backward, with ``rstd = 1 / sqrt(ms + eps)``, ``xhat = x * rstd``,
    ``dxhat = dy * weight`` and means over the row (LayerNorm's formula without
    the term through the mean):

        dx      = rstd * (dxhat - xhat * mean(dxhat * xhat))
        dweight = sum over rows of dy * xhat

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The shape of the trailing input axes to normalize over: input of shape
        (*, *normalized_shape).
    eps : float or None, default None
        Added to the mean square before the square root; ``None`` means the
        machine epsilon of the input's dtype (float32's for float16 input),
        whatever the weight's dtype.
    elementwise_affine : bool, default True
        Learn ``weight``; without it the output is xhat.
    {device_dtype_xp}

    Attributes
    ----------
    weight : array of shape normalized_shape, or None
    grads : dict of str to array
        The gradient of ``weight`` accumulated by ``backward``.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> rms = npnorm.RMSNorm(2, eps=0.0)
    >>> y = rms(np.array([[3.0, 4.0]], dtype=np.float32))
    >>> y.round(4)
    array([[0.8485, 1.1314]], dtype=float32)
    >>> dx = rms.backward(np.ones_like(y))
    >>> sorted(rms.grads)
    ['weight']
"""


class RMSNorm(Module):
    __doc__ = _RMS_NORM_DOC.format(device_dtype_xp=DEVICE_DTYPE_XP_DOC)

    _parameter_names = ("weight",)
    _kept_for_backward = ("weight",)

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(device=device, dtype=dtype, xp=xp)
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = None if eps is None else check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight: Array | None = None
        if self.elementwise_affine:
            self.weight = self.xp.ones(self.normalized_shape, **self._where(device))

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        y, rstd = rms_norm_forward(input, self.normalized_shape, self.weight, self.eps)
        return y, (input, rstd, self.weight, self.normalized_shape), {}

    def _pin_for_float64(self, input: Array) -> None:
        if self.eps is None:  # the machine epsilon of the input's dtype (float32's for float16)
            self.eps = default_eps(self.xp, input)

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, rstd, weight, shape = saved  # the forward's, whatever changed since
        dx, dweight, _ = rms_norm_backward(grad_output, input, shape, rstd, weight)
        return dx, {"weight": dweight}

    def reset_parameters(self) -> None:
        """``weight`` back to ones (where the layer has it), in place as PyTorch's
        ``reset_parameters``."""
        self._refill({"weight": 1}, "reset_parameters")

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
