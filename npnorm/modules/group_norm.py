"""The GroupNorm module."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import check_eps
from ..functional._channels import check_channels
from ..functional.group_norm import check_groups, group_norm_backward, group_norm_forward
from ._module import Module, Saved, Updates


class GroupNorm(Module):
    r"""Group normalization (Wu & He 2018, https://arxiv.org/abs/1803.08494).

    .. math::
        y_{n,c} = \frac{x_{n,c} - \mu_{n,g(c)}}{\sqrt{\sigma^2_{n,g(c)} + \epsilon}} \cdot w_c + b_c

    Channels are split into ``num_groups`` groups; each (sample, group) is normalized
    over its channels and spatial axes; ``w``, ``b`` are per channel. Input (N, C, *).
    Same arguments and ``state_dict`` keys as ``torch.nn.GroupNorm``.

    Parameters
    ----------
    num_groups : int
    num_channels : int
        Must be divisible by ``num_groups`` (``ValueError`` otherwise).
    eps : float, default 1e-5
    affine : bool, default True
    dtype, xp : keyword-only; float32 and numpy by default
    """

    _parameter_names = ("weight", "bias")

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        *,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(dtype=dtype, xp=xp)
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels <= 0:
            raise ValueError(f"num_channels must be a positive int, got {num_channels!r}")
        check_groups(num_groups, num_channels)
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps = check_eps(eps)
        self.affine = bool(affine)
        self.weight: Array | None = self.xp.ones((num_channels,), dtype=self.dtype) if affine else None
        self.bias: Array | None = self.xp.zeros((num_channels,), dtype=self.dtype) if affine else None

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        check_channels(input, self.num_channels, "GroupNorm")
        y, mean, rstd = group_norm_forward(input, self.num_groups, self.weight, self.bias, self.eps)
        return y, (input, mean, rstd), {}

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd = saved
        dx, dweight, dbias = group_norm_backward(
            grad_output, input, self.num_groups, mean, rstd, self.weight, self.bias
        )
        return dx, {"weight": dweight, "bias": dbias}

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
