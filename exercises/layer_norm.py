"""Exercise 3: LayerNorm over two trailing axes, node by node.

Read docs/derivations/layer_norm.md. The same six nodes as BatchNorm, over other axes:
x has shape (2, 3, 4, 5) and normalized_shape (4, 5), so each of the 2·3 rows has its
own mean, var and rstd (shape (2, 3, 1, 1)) over n = 20 values, and the weight and bias
(shape (4, 5)) are shared by all rows. Mind which axes each sum runs over. The grader
also runs it on a second example, x of shape (3, 2, 3, 6), normalized over (3, 6). Grade it:

    python -m npnorm learn check layer_norm

    1  mean = Σ x / n                  (2, 3, 1, 1)
    2  xc   = x - mean                 (2, 3, 4, 5)
    3  var  = Σ xc² / n                (2, 3, 1, 1)
    4  rstd = 1 / sqrt(var + eps)      (2, 3, 1, 1)
    5  xhat = xc · rstd                (2, 3, 4, 5)
    6  y    = xhat · w + b             (2, 3, 4, 5); w, b: (4, 5)
"""

from npnorm.learn import TODO


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    axes = (2, 3)  # the normalized axes: one mean and rstd per row
    rows = (0, 1)  # the axes the rows lie along: one weight serves every row
    n = t["input"].shape[2] * t["input"].shape[3]  # values per row: 4 · 5 in the example
    d = {"y": dy}
    d["bias"] = TODO
    d["weight"] = TODO
    d["xhat"] = TODO
    d["rstd"] = TODO
    d["var"] = TODO
    d["xc"] = TODO
    d["mean"] = TODO
    d["input"] = TODO
    return d
