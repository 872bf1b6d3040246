"""GroupNorm as a graph of eight nodes (docs/derivations/group_norm_instance_norm.md).

The channels are split into groups; each (sample, group) is normalized over its
channels and spatial axes. The graph says that literally: view the input as
(N, G, C/G·S), standardize over the last axis, view the result back, then the
per-channel affine map. A reshape moves no value, so its gradient is the gradient
reshaped back.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .._checks import check_eps
from ..functional._channels import check_channels, check_per_channel
from ..functional.group_norm import check_groups, check_values_per_group
from ._graph import Grads, View, affine, affine_backward, channel_view, standardize, standardize_backward
from ._inputs import float64_leaves, refuse_empty
from ._tape import Tape


def group_norm(
    input: np.ndarray,
    num_groups: int,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
) -> Tape:
    """Staged GroupNorm forward; the arguments of ``npnorm.functional.group_norm_forward``."""
    eps = check_eps(eps)
    x, w, b = float64_leaves(input=input, weight=weight, bias=bias)
    assert x is not None
    c = check_channels(x, None, "group_norm")
    num_groups = check_groups(num_groups, c)
    check_per_channel(c, weight=w, bias=b)
    check_values_per_group(x.shape, num_groups)
    refuse_empty(x, "group_norm")
    grouped = (x.shape[0], num_groups, x.size // (x.shape[0] * num_groups))  # N, G, C/G·S
    view = channel_view(x.ndim)  # (C,) -> (1, C, 1, ..., 1)
    t = Tape("group_norm", input=x, weight=w, bias=b)
    groups = f"{num_groups} group{'' if num_groups == 1 else 's'}"
    t.description = f"GroupNorm ({groups}) of input {x.shape}, grouped as {grouped}"
    t.node("xg", "xg = x viewed as (N, G, C/G·S)", lambda a: np.reshape(a, grouped), "input")  # node 1
    standardize(t, "xg", (2,), eps, out="xhatg")  # nodes 2-6: mean, xc, var, rstd, xhatg
    t.node("xhat", "xhat = xhatg viewed as x", lambda a: np.reshape(a, x.shape), "xhatg")  # node 7
    affine(t, "xhat", view, "[c]")  # node 8: y = xhat · w[c] + b[c]
    t.backward = partial(backward, view=view)
    return t


def backward(t: Tape, dy: np.ndarray, *, view: View) -> Grads:
    """Node 8, then the reshapes around the standardize block of nodes 2-6."""
    d = {"y": dy}
    affine_backward(t, d, "xhat", view)  # node 8: dbias, dweight, dxhat = dy · w[c]
    d["xhatg"] = np.reshape(d["xhat"], t["xhatg"].shape)  # node 7: a view's gradient, viewed back
    standardize_backward(t, d)  # nodes 6-2: drstd, dvar, dxc, dmean, dxg (per group)
    d["input"] = np.reshape(d["xg"], t["input"].shape)  # node 1: a view's gradient, viewed back
    return d
