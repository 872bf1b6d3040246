"""The nodes every normalization layer is made of, and their local derivatives.

Forward, over the reduced ``axes`` (``n`` values per statistic):

    1  mean = Σ x / n                 (a running buffer instead, in eval mode)
    2  xc   = x - mean
    3  var  = Σ xc² / n               (a running buffer instead, in eval mode)
    4  rstd = 1 / sqrt(var + eps)
    5  xhat = xc · rstd
    6  y    = xhat · w + b

RMSNorm has no mean: ``ms = Σ x² / n``, ``rstd = 1 / sqrt(ms + eps)``, ``xhat = x · rstd``.

Backward, node by node from ``dy`` (``d[name]`` is the gradient of the loss with
respect to that step): each line is one local derivative of one node, applied to the
gradient of the node's output (the chain rule). Where a value is shared by many
elements (a statistic, a weight), its gradient sums the contributions of all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._tape import Standardized, Tape, count

View = Callable[[np.ndarray], np.ndarray]
Grads = dict[str, np.ndarray]


def same(p: np.ndarray) -> np.ndarray:
    """The parameter as it is (it already broadcasts against the input)."""
    return p


def channel_view(ndim: int) -> View:
    """Per-channel values of shape (C,) viewed as (1, C, 1, ..., 1), to broadcast against (N, C, *)."""
    return lambda p: np.reshape(p, (1, -1) + (1,) * (ndim - 2))


def sum_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` down to ``shape``: the gradient of broadcasting an array of ``shape`` up to ``g``.

    A value broadcast to many elements receives the sum of their gradients. Summed: the
    leading axes ``shape`` lacks, and the axes where ``shape`` is 1 and ``g`` is not.
    """
    lead = g.ndim - len(shape)
    spread = tuple(lead + i for i, k in enumerate(shape) if k == 1 and g.shape[lead + i] != 1)
    axes = tuple(range(lead)) + spread
    return np.sum(g, axis=axes, keepdims=True).reshape(shape)


def standardize(
    t: Tape,
    src: str,
    axes: tuple[int, ...],
    eps: float,
    *,
    out: str = "xhat",
    center: bool = True,
    running: View | None = None,
    correction: int = 0,
) -> None:
    """Nodes 1-5 over ``axes`` of the value ``src``: mean, xc, var, rstd, xhat.

    ``center=False`` (RMSNorm): ms, rstd, xhat with ``xhat = x · rstd``. ``running``
    (eval mode): mean and var are the running buffers, viewed to broadcast, constants.
    ``correction=1``: the n-1 (unbiased) variance in the normalization.
    """
    n = count(t[src].shape, axes)
    x = "x" if src == "input" else src  # the name formulas use
    xc = "xc" if center else src  # what rstd scales: x - mean, or x itself (RMSNorm)
    var = "var" if center else "ms"
    sq = "xc²" if center else f"{x}²"
    div = "n" if correction == 0 else f"(n - {correction})"

    def mean_over_axes(a: np.ndarray) -> np.ndarray:
        return np.sum(a, axis=axes, keepdims=True) / n  # axes -> 1

    def mean_square(a: np.ndarray) -> np.ndarray:
        return np.sum(a * a, axis=axes, keepdims=True) / (n - correction)  # axes -> 1

    def reciprocal_sqrt(v: np.ndarray) -> np.ndarray:
        return 1.0 / np.sqrt(v + eps)  # axes -> 1

    if running is not None:  # eval: the running buffers, constants as far as x is concerned
        t.node("mean", "mean = running_mean[c]", running, "running_mean")  # 1,C,1..
        t.node("var", "var = running_var[c]", running, "running_var")  # 1,C,1..
    elif center:
        t.node("mean", f"mean = Σ {x} / n", mean_over_axes, src)  # axes -> 1
    if center:
        t.node("xc", f"xc = {x} - mean", np.subtract, src, "mean")  # shape of x
    if running is None:
        t.node(var, f"{var} = Σ {sq} / {div}", mean_square, xc)  # axes -> 1
    t.node("rstd", f"rstd = 1 / sqrt({var} + eps)", reciprocal_sqrt, var)  # axes -> 1
    t.node(out, f"{out} = {'xc' if center else x} · rstd", np.multiply, xc, "rstd")  # shape of x
    t.standardized = Standardized(src, out, axes, n, center, running is None, correction, eps)


def standardize_backward(t: Tape, d: Grads) -> None:
    """Gradients of nodes 5 to 1, from ``d[out]`` (dxhat): rstd, var, xc, mean, then ``src``."""
    st = t.standardized
    assert st is not None
    n, correction = st.n, st.correction  # correction: 0 (the biased variance the layers use), or 1
    xc = "xc" if st.center else st.src
    var = "var" if st.center else "ms"
    dxhat = d[st.out]
    # node 5, xhat = xc · rstd: ∂xhat/∂rstd = xc (summed over the values one rstd serves), ∂xhat/∂xc = rstd
    d["rstd"] = sum_to(dxhat * t[xc], t["rstd"].shape)  # axes -> 1
    dxc = dxhat * t["rstd"]  # shape of x: the direct path
    # node 4, rstd = (var + eps)^(-1/2): ∂rstd/∂var = -1/2 (var + eps)^(-3/2) = -rstd³/2
    d[var] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # axes -> 1
    if st.batch_stats:
        # node 3, var = Σ xc² / n: ∂var/∂xc = 2 xc / n (n - 1 with correction=1, Bessel's)
        dxc = dxc + d[var] * 2.0 * t[xc] / (n - correction)  # shape of x: the path through var
    d[xc] = dxc
    if not st.center:
        return  # RMSNorm: xc is x itself, done
    # node 2, xc = x - mean: ∂xc/∂mean = -1 (summed over the values one mean serves), ∂xc/∂x = 1
    d["mean"] = -sum_to(d["xc"], t["mean"].shape)  # axes -> 1
    dx = d["xc"]  # shape of x
    if st.batch_stats:
        # node 1, mean = Σ x / n: ∂mean/∂x = 1/n
        dx = dx + d["mean"] / n  # shape of x: the path through the mean
    d[st.src] = dx


def affine(t: Tape, src: str, view: View, index: str = "") -> None:
    """Node 6: ``y = xhat · w + b`` (without the terms of an absent weight or bias)."""
    w, b = "weight" in t.leaves, "bias" in t.leaves

    def scale_shift(a: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * view(w) + view(b)

    def scale(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        return a * view(w)

    def shift(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + view(b)

    def same_array(a: np.ndarray) -> np.ndarray:
        return a  # no copy: values on a tape are never changed

    if w and b:
        t.node("y", f"y = xhat · w{index} + b{index}", scale_shift, src, "weight", "bias")
    elif w:
        t.node("y", f"y = xhat · w{index}", scale, src, "weight")
    elif b:
        t.node("y", f"y = xhat + b{index}", shift, src, "bias")
    else:
        t.node("y", "y = xhat", same_array, src)


def affine_backward(t: Tape, d: Grads, src: str, view: View) -> None:
    """Gradients of node 6 from ``d["y"]``: bias, weight, then xhat (``dxhat = dy · w``)."""
    dy = d["y"]
    if "bias" in t.leaves:
        b = t["bias"]
        # ∂y/∂b = 1; one b serves every row: sum dy over the rows
        d["bias"] = sum_to(dy, view(b).shape).reshape(b.shape)  # shape of b
    if "weight" in t.leaves:
        w = t["weight"]
        # ∂y/∂w = xhat; one w serves every row: sum dy · xhat over the rows
        d["weight"] = sum_to(dy * t[src], view(w).shape).reshape(w.shape)  # shape of w
        d[src] = dy * view(w)  # ∂y/∂xhat = w: dxhat = dy · w
    else:
        d[src] = dy  # ∂y/∂xhat = 1


def backward(t: Tape, dy: np.ndarray, *, view: View) -> Grads:
    """The staged backward of the graph above: node 6, then nodes 5 to 1."""
    d = {"y": dy}
    affine_backward(t, d, "xhat", view)  # dbias, dweight, dxhat = dy · w
    standardize_backward(t, d)  # drstd, dvar, dxc, dmean, dx
    return d
