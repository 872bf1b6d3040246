"""The RMSNorm module: parameters and saved context around the functional core."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import as_shape, check_eps
from ..functional.rms_norm import rms_norm_backward, rms_norm_forward
from ._module import Module, Saved, Updates


class RMSNorm(Module):
    r"""Root-mean-square normalization (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot w

    The mean square is over the trailing ``normalized_shape`` axes; ``w`` (ones) has
    shape ``normalized_shape``; there is no bias. Same arguments, defaults and
    ``state_dict`` keys as ``torch.nn.RMSNorm``.

    Parameters
    ----------
    normalized_shape : int or tuple of int
    eps : float or None, default None
        ``None`` means the machine epsilon of the computation dtype, as in PyTorch.
    elementwise_affine : bool, default True
    dtype : float dtype or name, keyword-only, default float32
    xp : backend name or namespace, keyword-only, default numpy
    """

    _parameter_names = ("weight",)

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(dtype=dtype, xp=xp)
        self.normalized_shape = as_shape(normalized_shape)
        self.eps = None if eps is None else check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight: Array | None = None
        if self.elementwise_affine:
            self.weight = self.xp.ones(self.normalized_shape, dtype=self.dtype)

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        y, rstd = rms_norm_forward(input, self.normalized_shape, self.weight, self.eps)
        return y, (input, rstd), {}

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, rstd = saved
        dx, dweight, _ = rms_norm_backward(grad_output, input, self.normalized_shape, rstd, self.weight)
        return dx, {"weight": dweight}

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
