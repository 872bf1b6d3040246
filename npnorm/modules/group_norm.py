"""The GroupNorm module."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._backend import Array
from .._checks import check_count, check_eps
from ..functional._channels import channels_of, check_channels
from ..functional.group_norm import check_groups, group_norm_backward, group_norm_forward
from ._module import DEVICE_DTYPE_XP_DOC, Module, Saved, Updates, channels_last

_GROUP_NORM_DOC = """Group normalization (Wu & He 2018, https://arxiv.org/abs/1803.08494).

    The C channels of an (N, C, *) input are split into ``num_groups`` groups of
    C/G consecutive channels; each (sample n, group g) is normalized over its
    channels and spatial axes (m = C/G * prod(spatial) values), then each
    channel c gets its own affine map:

        mean_ng = sum(x[n, group g]) / m
        var_ng  = sum((x[n, group g] - mean_ng)**2) / m    (biased; two passes)
        y[n, c] = (x[n, c] - mean_ng) / sqrt(var_ng + eps) * weight_c + bias_c

    One group is LayerNorm over (C, *spatial) with a per-channel affine map; C
    groups is InstanceNorm. No running statistics: training and eval mode compute
    the same thing. Same arguments, defaults and ``state_dict`` keys as
    ``torch.nn.GroupNorm``.

    Backward, with ``rstd_ng = 1 / sqrt(var_ng + eps)``, ``xhat = (x - mean_ng) * rstd_ng``,
    ``dxhat = dy * weight_c`` and means over the m values of a (sample, group):

        dx        = rstd_ng * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        dweight_c = sum(dy * xhat)        dbias_c = sum(dy)

    Parameters
    ----------
    num_groups : int
        G, the number of groups the channels are split into.
    num_channels : int
        C, the number of channels (dim 1 of the input); divisible by
        ``num_groups`` (``ValueError`` otherwise).
    eps : float, default 1e-5
        Added to the variance before the square root.
    affine : bool, default True
        Learn a per-channel ``weight`` (ones) and ``bias`` (zeros).
    bias : bool, keyword-only, default True
        With ``affine``, learn ``bias`` as well as ``weight`` (PyTorch 2.13's
        keyword of the same name).
    {device_dtype_xp}

    Attributes
    ----------
    weight, bias : array of shape (C,), or None without ``affine``
    grads : dict of str to array
        Gradients of ``weight`` and ``bias`` accumulated by ``backward``.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> gn = npnorm.GroupNorm(2, 4)
    >>> x = np.random.default_rng(0).normal(size=(3, 4, 5)).astype(np.float32)
    >>> y = gn(x)
    >>> dx = gn.backward(np.ones_like(y))
    >>> y.shape, sorted(gn.grads)
    ((3, 4, 5), ['bias', 'weight'])
"""


class GroupNorm(Module):
    __doc__ = _GROUP_NORM_DOC.format(device_dtype_xp=DEVICE_DTYPE_XP_DOC)

    _parameter_names = ("weight", "bias")
    _kept_for_backward = ("weight",)  # as torch's native_group_norm_backward

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(device=device, dtype=dtype, xp=xp)
        num_channels = check_count(num_channels, "num_channels")
        num_groups = check_groups(num_groups, num_channels)
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps = check_eps(eps)
        self.affine = bool(affine)
        on = self._where(device)
        self.weight: Array | None = self.xp.ones((num_channels,), **on) if affine else None
        self.bias: Array | None = self.xp.zeros((num_channels,), **on) if affine and bias else None

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        self._check_backend(input)
        # as PyTorch's: the length of weight and bias (not num_channels); without them,
        # any channel count divisible by num_groups
        expected, source = channels_of(weight=self.weight, bias=self.bias)
        named = source if expected != self.num_channels else ""
        check_channels(input, expected, "GroupNorm", source=named, unbatched=True)
        y, mean, rstd = group_norm_forward(input, self.num_groups, self.weight, self.bias, self.eps)
        saved = (self._input_for_backward(input), mean, rstd, self.weight, self.bias, self.num_groups)
        return y, saved, {}

    def _keeps_input(self, input: Array) -> bool:
        # torch's native_group_norm keeps input.contiguous(memory_format=suggested): the
        # tensor itself when contiguous or channels-last, else a copy
        return bool(input.is_contiguous()) or channels_last(input)

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, weight, bias, groups = saved  # the forward's, whatever changed since
        dx, dweight, dbias = group_norm_backward(grad_output, input, groups, mean, rstd, weight, bias)
        return dx, {"weight": dweight, "bias": dbias}

    def reset_parameters(self) -> None:
        """``weight`` back to ones and ``bias`` to zeros (where the layer has them), in
        place as PyTorch's ``reset_parameters``."""
        self._refill({"weight": 1, "bias": 0}, "reset_parameters")

    def extra_repr(self) -> str:
        return (
            f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
            f"bias={self.bias is not None}"
        )
