"""BatchNorm as a graph of six nodes (docs/derivations/batch_norm_training.md and
batch_norm_eval.md).

One statistic per channel, over the batch and spatial axes. Training normalizes with
the batch's mean and biased variance and moves the running buffers towards the batch
mean and the *unbiased* batch variance; eval normalizes with the running buffers,
which are constants as far as the input is concerned.
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


def batch_norm(
    input: np.ndarray,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tape:
    """Staged BatchNorm forward; the arguments of ``npnorm.functional.batch_norm_forward``.

    With ``training`` and buffers, ``tape.updates`` holds the new running buffers.
    """
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    x, rm, rv, w, b = float64_leaves(
        input=input, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias
    )
    assert x is not None
    c = check_channels(x, None, "batch_norm")
    check_per_channel(c, running_mean=rm, running_var=rv, weight=w, bias=b)
    n = x.shape[0] * int(np.prod(x.shape[2:]))  # values per channel
    check_running_given(rm, rv, training or n == 0, "batch_norm")  # (as the functional form)
    check_buffers_paired(rm, rv)
    if training and n == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
    refuse_empty(x, "batch_norm")  # (after the functional form's errors)
    axes = (0, *range(2, x.ndim))  # batch and spatial axes: one statistic per channel
    view = channel_view(x.ndim)  # (C,) -> (1, C, 1, ..., 1)
    t = Tape("batch_norm", constants=("running_mean", "running_var"), input=x, weight=w, bias=b,
             running_mean=rm, running_var=rv)  # fmt: skip
    mode = "training" if training else "eval"
    t.description = f"BatchNorm ({mode}) over the axes {axes} of input {x.shape}"
    standardize(t, "input", axes, eps, running=None if training else view)  # nodes 1-5
    affine(t, "xhat", view, "[c]")  # node 6: y = xhat · w[c] + b[c]
    if training and rm is not None and rv is not None:
        m = momentum
        t.update_formulas["running_mean"] = "running_mean ← (1 - momentum) · running_mean + momentum · mean"
        t.updates["running_mean"] = (1 - m) * rm + m * t["mean"].reshape(c)  # C
        t.update_formulas["running_var"] = (
            "running_var ← (1 - momentum) · running_var + momentum · var · n/(n-1)"
        )
        t.updates["running_var"] = (1 - m) * rv + m * t["var"].reshape(c) * n / (n - 1)  # C: unbiased
    t.backward = partial(backward, view=view)
    return t
