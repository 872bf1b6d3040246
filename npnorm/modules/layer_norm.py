"""The LayerNorm module: parameters and saved context around the functional core."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import as_shape, check_eps
from ..functional.layer_norm import layer_norm_backward, layer_norm_forward
from ._module import DEVICE_DTYPE_XP_DOC, Module, Saved, Updates

_LAYER_NORM_DOC = """Layer normalization (Ba, Kiros & Hinton 2016, https://arxiv.org/abs/1607.06450).

    Each row (the trailing ``normalized_shape`` axes of the input, D values) is
    normalized on its own:

        mean = sum(x) / D
        var  = sum((x - mean)**2) / D                  (biased; two passes)
        y    = (x - mean) / sqrt(var + eps) * weight + bias

    ``weight`` (ones) and ``bias`` (zeros) have shape ``normalized_shape``. No
    running statistics: training and eval mode compute the same thing. Same
    arguments, defaults and ``state_dict`` keys as ``torch.nn.LayerNorm``.

    Backward, with ``rstd = 1 / sqrt(var + eps)``, ``xhat = (x - mean) * rstd``,
    ``dxhat = dy * weight`` and means over the row:

        dx      = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
                          term 1   term 2         term 3
                         (direct) (through mean) (through var)
        dweight = sum over rows of dy * xhat
        dbias   = sum over rows of dy

    The forward saves the input and one mean and rstd per row; backward
    recomputes xhat from them.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The shape of the trailing input axes to normalize over: input of shape
        (*, *normalized_shape).
    eps : float, default 1e-5
        Added to the variance before the square root.
    elementwise_affine : bool, default True
        Learn ``weight`` (and ``bias``, unless ``bias=False``); without it the
        output is xhat.
    bias : bool, default True
        Learn ``bias`` as well as ``weight`` (with ``elementwise_affine``).
    {device_dtype_xp}

    Attributes
    ----------
    weight, bias : array of shape normalized_shape, or None
    grads : dict of str to array
        Gradients of ``weight`` and ``bias`` accumulated by ``backward``.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> ln = npnorm.LayerNorm(4)
    >>> y = ln(np.arange(8.0, dtype=np.float32).reshape(2, 4))
    >>> y.round(3)
    array([[-1.342, -0.447,  0.447,  1.342],
           [-1.342, -0.447,  0.447,  1.342]], dtype=float32)
    >>> dx = ln.backward(np.ones_like(y))
    >>> sorted(ln.grads)
    ['bias', 'weight']
"""


class LayerNorm(Module):
    __doc__ = _LAYER_NORM_DOC.format(device_dtype_xp=DEVICE_DTYPE_XP_DOC)

    _parameter_names = ("weight", "bias")
    _kept_for_backward = ("weight", "bias")  # as torch's native_layer_norm_backward

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(device=device, dtype=dtype, xp=xp)
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight: Array | None = None
        self.bias: Array | None = None
        if self.elementwise_affine:
            on = self._where(device)
            self.weight = self.xp.ones(self.normalized_shape, **on)
            if bias:
                self.bias = self.xp.zeros(self.normalized_shape, **on)

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        y, mean, rstd = layer_norm_forward(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return y, (input, mean, rstd, self.weight, self.bias, self.normalized_shape), {}

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, weight, bias, shape = saved  # the forward's, whatever changed since
        dx, dweight, dbias = layer_norm_backward(grad_output, input, shape, mean, rstd, weight, bias)
        return dx, {"weight": dweight, "bias": dbias}

    def reset_parameters(self) -> None:
        """``weight`` back to ones and ``bias`` to zeros (where the layer has them), in
        place as PyTorch's ``reset_parameters``."""
        self._refill({"weight": 1, "bias": 0}, "reset_parameters")

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}"
        )
