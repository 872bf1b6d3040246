"""Exercise 2: collapse the staged BatchNorm backward into three terms.

Read docs/derivations/batch_norm_training.md, section 3. Starting from the staged
backward (exercise 1), write dx with no dvar, dmean or dxc left: only dxhat (= dy · w),
xhat and rstd. It comes out as three terms, one per way x reaches xhat:

    term 1, "direct": x → xc → xhat, with mean and var held fixed
    term 2, "mean":   x → mean → (xc → xhat and xc → var → rstd → xhat)
    term 3, "var":    x → xc → var → rstd → xhat, with mean held fixed

Each term has x's shape (N, C, H, W), even where it is the same for every value of a
channel. The grader checks each term against finite differences of the loss along its
own paths (the graph's other edges held at their recorded values), then their sum
against dx, on two examples: x of shape (4, 3, 2, 2) with ``axes`` (0, 2, 3), then a
BatchNorm1d batch (5, 2, 3) with ``axes`` (0, 2):

    python -m npnorm learn check closed_form
"""

from npnorm.learn import TODO


def closed_form(dxhat, xhat, rstd, axes):
    """The three terms of dx; ``axes``: the axes a channel's statistics are over, (0, 2, 3).

    dxhat, xhat: (N, C, H, W); rstd: (1, C, 1, 1). (The second example: (N, C, L), axes (0, 2).)
    """
    return {
        "direct": TODO,  # term 1
        "mean": TODO,  # term 2
        "var": TODO,  # term 3
    }
