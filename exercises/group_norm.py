"""Exercise 5: GroupNorm by reshape, node by node.

Read docs/derivations/group_norm_instance_norm.md. x has shape (N, C, H, W) = (2, 6, 2, 2)
in G = 3 groups of 2 channels. The graph views x as (N, G, C/G·H·W), standardizes over
the last axis, views the result back and applies the per-channel affine map. A view
moves no value: what is its gradient? The grader also runs it on a second example, x of
shape (4, 12, 1, 3) in G = 4 groups of 3 channels. Grade it:

    python -m npnorm learn check group_norm

    1  xg    = x viewed as (N, G, C/G·H·W)     (2, 3, 8)
    2  mean  = Σ xg / n                        (2, 3, 1)
    3  xc    = xg - mean                       (2, 3, 8)
    4  var   = Σ xc² / n                       (2, 3, 1)
    5  rstd  = 1 / sqrt(var + eps)             (2, 3, 1)
    6  xhatg = xc · rstd                       (2, 3, 8)
    7  xhat  = xhatg viewed as x               (2, 6, 2, 2)
    8  y     = xhat · w[c] + b[c]              (2, 6, 2, 2); w, b: (6,)
"""

from npnorm.learn import TODO


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    n = t["xg"].shape[2]  # values per (sample, group): C/G · H · W
    rows = (0, 2, 3)  # one w[c] serves every sample and position of its channel
    w = t["weight"].reshape(1, -1, 1, 1)
    d = {"y": dy}
    d["bias"] = TODO
    d["weight"] = TODO
    d["xhat"] = TODO
    d["xhatg"] = TODO  # node 7
    d["rstd"] = TODO
    d["var"] = TODO
    d["xc"] = TODO
    d["mean"] = TODO
    d["xg"] = TODO
    d["input"] = TODO  # node 1
    return d
