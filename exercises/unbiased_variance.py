"""Exercise 7: the closed form when the n-1 variance normalizes.

Read docs/derivations/batch_norm_eval.md, section 3. Some write-ups normalize with
var = Σ xc² / (n - 1) (what torch.var computes by default); PyTorch's BatchNorm does
not. Redo exercise 2 for that graph: x has shape (6, 3), one statistic per channel over
the n = 6 values of axis 0 (and a second example, x of shape (5, 4)). Which terms
change? Grade it:

    python -m npnorm learn check unbiased_variance

    1  mean = Σ x / n                  (1, 3)
    2  xc   = x - mean                 (6, 3)
    3  var  = Σ xc² / (n - 1)          (1, 3)
    4  rstd = 1 / sqrt(var + eps)      (1, 3)
    5  xhat = xc · rstd                (6, 3)
    6  y    = xhat                     (6, 3)
"""

from npnorm.learn import TODO


def closed_form(dxhat, xhat, rstd, axes):
    """The three terms of dx, each of x's shape; ``axes`` = (0,)."""
    return {
        "direct": TODO,  # term 1
        "mean": TODO,  # term 2
        "var": TODO,  # term 3
    }
