"""Solution: BatchNorm's backward in training, node by node (see ../batch_norm_staged.py)."""


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    n = x.shape[0] * x.shape[2] * x.shape[3]  # values per channel: N·H·W
    rows = (0, 2, 3)  # the axes one channel's values lie along
    w = t["weight"].reshape(1, -1, 1, 1)  # w[c], shaped to broadcast against x
    d = {"y": dy}
    # node 6, y = xhat · w + b
    d["bias"] = dy.sum(axis=rows)  # ∂y/∂b = 1; b[c] serves n values: sum    (C,)
    d["weight"] = (dy * t["xhat"]).sum(axis=rows)  # ∂y/∂w = xhat; summed     (C,)
    d["xhat"] = dy * w  # ∂y/∂xhat = w                                        (N, C, H, W)
    # node 5, xhat = xc · rstd
    d["rstd"] = (d["xhat"] * t["xc"]).sum(axis=rows, keepdims=True)  # ∂xhat/∂rstd = xc; summed   (1, C, 1, 1)
    # node 4, rstd = (var + eps)^(-1/2)
    d["var"] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # ∂rstd/∂var = -rstd³/2     (1, C, 1, 1)
    # nodes 5 and 3: xc reaches the loss through xhat (∂xhat/∂xc = rstd) and var (∂var/∂xc = 2 xc / n)
    d["xc"] = d["xhat"] * t["rstd"] + d["var"] * 2 * t["xc"] / n  # (N, C, H, W)
    # node 2, xc = x - mean
    d["mean"] = -d["xc"].sum(axis=rows, keepdims=True)  # ∂xc/∂mean = -1; summed   (1, C, 1, 1)
    # nodes 2 and 1: x reaches the loss through xc (∂xc/∂x = 1) and mean (∂mean/∂x = 1/n)
    d["input"] = d["xc"] + d["mean"] / n  # (N, C, H, W)
    return d
