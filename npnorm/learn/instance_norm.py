"""InstanceNorm as a graph of six nodes (docs/derivations/group_norm_instance_norm.md).

One statistic per (sample, channel), over the spatial axes: BatchNorm's graph with the
batch axis taken out of the reduction, or GroupNorm with one channel per group.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .._checks import check_eps
from ..functional._channels import (
    check_buffers_paired,
    check_channels,
    check_momentum,
    check_per_channel,
    check_running_given,
)
from ._graph import affine, backward, channel_view, standardize
from ._inputs import float64_leaves, refuse_empty
from ._tape import Tape


def instance_norm(
    input: np.ndarray,
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tape:
    """Staged InstanceNorm forward; the arguments of ``npnorm.functional.instance_norm_forward``.

    With input statistics and buffers, ``tape.updates`` holds the new running buffers:
    they move towards the batch average of the per-instance mean and unbiased variance.
    """
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    x, rm, rv, w, b = float64_leaves(
        input=input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias
    )
    assert x is not None
    c = check_channels(x, None, "instance_norm", min_ndim=2)
    check_per_channel(c, running_mean=rm, running_var=rv, weight=w, bias=b)
    check_running_given(rm, rv, use_input_stats, "instance_norm")
    check_buffers_paired(rm, rv)
    n = int(np.prod(x.shape[2:]))  # spatial values per (sample, channel)
    if use_input_stats and n == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {x.shape}")
    refuse_empty(x, "instance_norm")  # (after the functional form's errors)
    axes = tuple(range(2, x.ndim))  # spatial axes: one statistic per (sample, channel)
    view = channel_view(x.ndim)  # (C,) -> (1, C, 1, ..., 1)
    t = Tape("instance_norm", constants=("running_mean", "running_var"), input=x, weight=w, bias=b,
             running_mean=rm, running_var=rv)  # fmt: skip
    stats = "input statistics" if use_input_stats else "running statistics"
    t.description = f"InstanceNorm ({stats}) over the axes {axes} of input {x.shape}"
    standardize(t, "input", axes, eps, running=None if use_input_stats else view)  # nodes 1-5
    affine(t, "xhat", view, "[c]")  # node 6: y = xhat · w[c] + b[c]
    if use_input_stats and rm is not None and rv is not None:
        m = momentum
        mean_n = np.mean(t["mean"].reshape(-1, c), axis=0)  # C: averaged over the N instances
        var_n = np.mean(t["var"].reshape(-1, c), axis=0)  # C
        t.update_formulas["running_mean"] = "running_mean ← (1 - momentum) · running_mean + momentum · mean_N"
        t.updates["running_mean"] = (1 - m) * rm + m * mean_n  # C
        t.update_formulas["running_var"] = (
            "running_var ← (1 - momentum) · running_var + momentum · var_N · n/(n-1)"
        )
        t.updates["running_var"] = (1 - m) * rv + m * var_n * n / (n - 1)  # C: unbiased
    t.backward = partial(backward, view=view)
    return t
