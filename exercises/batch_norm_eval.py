"""Exercise 6: BatchNorm in eval mode, node by node.

Read docs/derivations/batch_norm_eval.md. In eval mode mean and var are the running
buffers, not computed from x: the graph has the same nodes in a different order, and
fewer edges. Find which local derivatives disappear. The grader runs it on x of shape
(4, 3, 2, 2), then (3, 2, 2, 3). Grade it:

    python -m npnorm learn check batch_norm_eval

    1  mean = running_mean[c]          (1, C, 1, 1)
    2  var  = running_var[c]           (1, C, 1, 1)
    3  xc   = x - mean                 (N, C, H, W)
    4  rstd = 1 / sqrt(var + eps)      (1, C, 1, 1)
    5  xhat = xc · rstd                (N, C, H, W)
    6  y    = xhat · w[c] + b[c]       (N, C, H, W)

The gradients of mean and var are still asked for: they reach the buffers and stop.
"""

from npnorm.learn import TODO


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    rows = (0, 2, 3)
    w = t["weight"].reshape(1, -1, 1, 1)
    d = {"y": dy}
    d["bias"] = TODO
    d["weight"] = TODO
    d["xhat"] = TODO
    d["rstd"] = TODO
    d["xc"] = TODO
    d["var"] = TODO
    d["mean"] = TODO
    d["input"] = TODO
    return d
