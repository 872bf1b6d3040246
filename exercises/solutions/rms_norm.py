"""Solution: RMSNorm, node by node (see ../rms_norm.py)."""


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    axes = (2,)  # the normalized axis
    rows = (0, 1)  # one weight serves every row
    n = x.shape[2]
    d = {"y": dy}
    # node 4, y = xhat · w
    d["weight"] = (dy * t["xhat"]).sum(axis=rows)  # ∂y/∂w = xhat; summed     (8,)
    d["xhat"] = dy * t["weight"]  # ∂y/∂xhat = w                              (2, 3, 8)
    # node 3, xhat = x · rstd
    d["rstd"] = (d["xhat"] * x).sum(axis=axes, keepdims=True)  # ∂xhat/∂rstd = x; summed   (2, 3, 1)
    # node 2, rstd = (ms + eps)^(-1/2)
    d["ms"] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # (2, 3, 1)
    # nodes 3 and 1: x reaches the loss directly through xhat and through ms (∂ms/∂x = 2 x / n)
    d["input"] = d["xhat"] * t["rstd"] + d["ms"] * 2 * x / n  # (2, 3, 8)
    return d
