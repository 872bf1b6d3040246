"""Solution: GroupNorm by reshape, node by node (see ../group_norm.py)."""


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    n = t["xg"].shape[2]  # values per (sample, group): C/G · H · W
    rows = (0, 2, 3)  # one w[c] serves every sample and position of its channel
    w = t["weight"].reshape(1, -1, 1, 1)
    d = {"y": dy}
    # node 8, y = xhat · w[c] + b[c]
    d["bias"] = dy.sum(axis=rows)  # (C,)
    d["weight"] = (dy * t["xhat"]).sum(axis=rows)  # (C,)
    d["xhat"] = dy * w  # (N, C, H, W)
    # node 7, xhat = xhatg viewed as x: a view moves no value, so its gradient is the gradient viewed back
    d["xhatg"] = d["xhat"].reshape(t["xhatg"].shape)  # (N, G, C/G·H·W)
    # nodes 6 to 2: BatchNorm's standardize block, over the last axis of the grouped view
    d["rstd"] = (d["xhatg"] * t["xc"]).sum(axis=2, keepdims=True)  # (N, G, 1)
    d["var"] = -0.5 * t["rstd"] ** 3 * d["rstd"]  # (N, G, 1)
    d["xc"] = d["xhatg"] * t["rstd"] + d["var"] * 2 * t["xc"] / n  # (N, G, C/G·H·W)
    d["mean"] = -d["xc"].sum(axis=2, keepdims=True)  # (N, G, 1)
    d["xg"] = d["xc"] + d["mean"] / n  # (N, G, C/G·H·W)
    # node 1, xg = x viewed as (N, G, C/G·H·W)
    d["input"] = d["xg"].reshape(x.shape)  # (N, C, H, W)
    return d
