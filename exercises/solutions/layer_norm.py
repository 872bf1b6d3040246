"""Solution: LayerNorm over two trailing axes, node by node (see ../layer_norm.py)."""


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    axes = (2, 3)  # the normalized axes: one mean and rstd per row (sample, position)
    rows = (0, 1)  # the axes the rows lie along: one weight serves every row
    n = t["input"].shape[2] * t["input"].shape[3]  # values per row: 4 · 5 in the example
    d = {"y": dy}
    # node 6, y = xhat · w + b
    d["bias"] = dy.sum(axis=rows)  # ∂y/∂b = 1; summed over the rows          (4, 5)
    d["weight"] = (dy * t["xhat"]).sum(axis=rows)  # ∂y/∂w = xhat; summed     (4, 5)
    d["xhat"] = dy * t["weight"]  # ∂y/∂xhat = w                              (2, 3, 4, 5)
    # node 5, xhat = xc · rstd
    d["rstd"] = (d["xhat"] * t["xc"]).sum(axis=axes, keepdims=True)  # ∂xhat/∂rstd = xc; summed   (2, 3, 1, 1)
    # node 4, rstd = (var + eps)^(-1/2)
    d["var"] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # (2, 3, 1, 1)
    # nodes 5 and 3
    d["xc"] = d["xhat"] * t["rstd"] + d["var"] * 2 * t["xc"] / n  # (2, 3, 4, 5)
    # node 2, xc = x - mean
    d["mean"] = -d["xc"].sum(axis=axes, keepdims=True)  # (2, 3, 1, 1)
    # nodes 2 and 1
    d["input"] = d["xc"] + d["mean"] / n  # (2, 3, 4, 5)
    return d
