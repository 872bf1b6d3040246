"""Solution: BatchNorm in eval mode, node by node (see ../batch_norm_eval.py)."""


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    rows = (0, 2, 3)
    w = t["weight"].reshape(1, -1, 1, 1)
    d = {"y": dy}
    # node 6, y = xhat · w[c] + b[c]: as in training
    d["bias"] = dy.sum(axis=rows)  # (C,)
    d["weight"] = (dy * t["xhat"]).sum(axis=rows)  # (C,)
    d["xhat"] = dy * w  # (N, C, H, W)
    # node 5, xhat = xc · rstd
    d["rstd"] = (d["xhat"] * t["xc"]).sum(axis=rows, keepdims=True)  # (1, C, 1, 1)
    d["xc"] = d["xhat"] * t["rstd"]  # only through xhat: var is a buffer, not computed from xc
    # node 4, rstd = (var + eps)^(-1/2): the gradient reaches the buffer and stops there
    d["var"] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # (1, C, 1, 1)
    # node 3, xc = x - mean
    d["mean"] = -d["xc"].sum(axis=rows, keepdims=True)  # reaches the buffer and stops   (1, C, 1, 1)
    d["input"] = d["xc"]  # ∂xc/∂x = 1, and the mean does not depend on x: dx = rstd · dxhat
    return d
