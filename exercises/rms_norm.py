"""Exercise 4: RMSNorm, node by node.

Read docs/derivations/rms_norm.md. No mean, no bias: x has shape (2, 3, 8), each row
of 8 values is scaled by the reciprocal of its root mean square. The grader also runs it
on a second example, x of shape (2, 4, 5) with eps = 0.5. Grade it:

    python -m npnorm learn check rms_norm

    1  ms   = Σ x² / n                 (2, 3, 1)
    2  rstd = 1 / sqrt(ms + eps)       (2, 3, 1)
    3  xhat = x · rstd                 (2, 3, 8)
    4  y    = xhat · w                 (2, 3, 8); w: (8,)
"""

from npnorm.learn import TODO


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    axes = (2,)  # the normalized axis
    rows = (0, 1)  # one weight serves every row
    n = x.shape[2]
    d = {"y": dy}
    d["weight"] = TODO
    d["xhat"] = TODO
    d["rstd"] = TODO
    d["ms"] = TODO
    d["input"] = TODO  # x reaches the loss through two nodes: 3 and 1
    return d
