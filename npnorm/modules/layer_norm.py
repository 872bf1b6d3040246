"""The LayerNorm module: parameters and saved context around the functional core."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import as_shape, check_eps
from ..functional.layer_norm import layer_norm_backward, layer_norm_forward
from ._module import Module, Saved, Updates


class LayerNorm(Module):
    """Layer normalization (Ba, Kiros & Hinton 2016, https://arxiv.org/abs/1607.06450).

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
    dtype : str or dtype, keyword-only, default "float32"
        Floating dtype of the parameters: "float16", "float32" or "float64" (or
        a NumPy or backend dtype). Input of another float dtype is computed at
        the wider of the two precisions (float16 input in float32) and returned
        in its own dtype.
    xp : str or namespace module, keyword-only, default "numpy"
        Array backend of the parameters and buffers: "numpy", "cupy", "torch",
        "array_api_strict" or an Array API namespace module. The input must be
        of the same backend (``TypeError`` otherwise; ``to()`` moves a module).

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

    _parameter_names = ("weight", "bias")
    _kept_for_backward = ("weight", "bias")  # as torch's native_layer_norm_backward

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(dtype=dtype, xp=xp)
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight: Array | None = None
        self.bias: Array | None = None
        if self.elementwise_affine:
            self.weight = self.xp.ones(self.normalized_shape, dtype=self.dtype)
            if bias:
                self.bias = self.xp.zeros(self.normalized_shape, dtype=self.dtype)

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        y, mean, rstd = layer_norm_forward(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return y, (input, mean, rstd, self.weight, self.bias), {}

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, weight, bias = saved
        dx, dweight, dbias = layer_norm_backward(
            grad_output, input, self.normalized_shape, mean, rstd, weight, bias
        )
        return dx, {"weight": dweight, "bias": dbias}

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
