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
    r"""Layer normalization (Ba et al. 2016, https://arxiv.org/abs/1607.06450).

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot w + b

    Mean and biased variance are taken over the trailing ``normalized_shape`` axes of
    each input; ``w`` (ones) and ``b`` (zeros) have shape ``normalized_shape``.
    Same arguments, defaults and ``state_dict`` keys as ``torch.nn.LayerNorm``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
    eps : float, default 1e-5
    elementwise_affine : bool, default True
        Learn ``weight`` (and ``bias``, unless ``bias=False``).
    bias : bool, default True
    dtype : float dtype or name, keyword-only, default float32
    xp : backend name or namespace, keyword-only, default numpy

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> ln = npnorm.LayerNorm(4)
    >>> y = ln(np.arange(8.0, dtype=np.float32).reshape(2, 4))
    >>> dx = ln.backward(np.ones_like(y))
    >>> sorted(ln.grads)
    ['bias', 'weight']
    """

    _parameter_names = ("weight", "bias")

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
        return y, (input, mean, rstd), {}

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd = saved
        dx, dweight, dbias = layer_norm_backward(
            grad_output, input, self.normalized_shape, mean, rstd, self.weight, self.bias
        )
        return dx, {"weight": dweight, "bias": dbias}

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
