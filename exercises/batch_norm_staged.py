"""Exercise 1: BatchNorm's backward in training, node by node.

Read docs/derivations/batch_norm_training.md, sections 1 and 2. The forward has run:
``t`` holds every value of the graph (read them as ``t["xc"]``, ``t["rstd"]``, ...),
``dy`` is the gradient of the loss L = sum(y · dy) with respect to the output. Replace
each TODO with the gradient of L with respect to that step, from the gradients above
it (the chain rule, one node at a time; ``d["y"]`` is given). Then grade it:

    python -m npnorm learn check batch_norm_staged

The grader checks every gradient against finite differences and names the first wrong
one going back from y, on two examples: x of shape (4, 3, 2, 2), then (3, 2, 2, 3) (so
take every count from the shapes). A gradient has the shape of its step, exactly:
(1, C, 1, 1) for the statistics, (C,) for weight and bias. Leave ``t`` and ``dy`` as they
are: the grader fails a backward that writes into them.

The graph, for x of shape (N, C, H, W) and one statistic per channel over n = N·H·W values:

    1  mean = Σ x / n                  (1, C, 1, 1)
    2  xc   = x - mean                 (N, C, H, W)
    3  var  = Σ xc² / n                (1, C, 1, 1)
    4  rstd = 1 / sqrt(var + eps)      (1, C, 1, 1)
    5  xhat = xc · rstd                (N, C, H, W)
    6  y    = xhat · w[c] + b[c]       (N, C, H, W)
"""

from npnorm.learn import TODO


def backward(t, dy):
    """The gradient of L = sum(y · dy) with respect to every step, as a dict."""
    x = t["input"]
    n = x.shape[0] * x.shape[2] * x.shape[3]  # values per channel: N·H·W
    rows = (0, 2, 3)  # the axes one channel's values lie along
    w = t["weight"].reshape(1, -1, 1, 1)  # w[c], shaped to broadcast against x
    d = {"y": dy}
    d["bias"] = TODO  # node 6, y = xhat · w + b: one b[c] serves n values
    d["weight"] = TODO  # node 6
    d["xhat"] = TODO  # node 6
    d["rstd"] = TODO  # node 5, xhat = xc · rstd: one rstd serves n values
    d["var"] = TODO  # node 4, rstd = (var + eps)^(-1/2)
    d["xc"] = TODO  # xc reaches the loss through two nodes: 5 and 3
    d["mean"] = TODO  # node 2, xc = x - mean
    d["input"] = TODO  # x reaches the loss through two nodes: 2 and 1
    return d
