"""The staged graph in the call shape of npnorm's benchmark baseline ("textbook").

``python -m npnorm bench`` times the way tutorials write a normalization layer: one
NumPy expression per node, every intermediate kept, the backward node by node. That
is this package's staged forward and backward, computed in the input's own dtype;
these two functions give them the positional call shape the benchmark uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import staged_backward
from ._tape import Tape
from .normalize import staged_normalize

Params = np.ndarray | None


def forward(
    x: np.ndarray, axes: Sequence[int], gamma: Params, beta: Params, eps: float, center: bool = True
) -> tuple[np.ndarray, Tape]:
    """``(y, tape)``: the staged forward over ``axes``; gamma/beta already shaped to broadcast."""
    tape = staged_normalize(x, axes, gamma, beta, eps, center=center, float64=False)
    return tape.output, tape


def backward(
    dy: np.ndarray,
    tape: Tape,
    axes: Sequence[int],
    gamma: Params,
    param_axes: Sequence[int],
    center: bool = True,
) -> tuple[np.ndarray, Params, Params]:
    """``(dx, dgamma, dbeta)`` by the staged backward (``None`` for an absent gamma or beta).

    The graph (axes, gamma, centring) is on the tape; the other arguments keep the
    benchmark's call shape and must agree with it.
    """
    st = tape.standardized
    assert st is not None and st.center == center and st.axes == tuple(a % dy.ndim for a in axes)
    assert (gamma is None) == ("weight" not in tape.leaves)
    del param_axes  # each parameter's gradient is summed to the parameter's own shape
    d = staged_backward(tape, dy)
    return d["input"], d.get("weight"), d.get("bias")
