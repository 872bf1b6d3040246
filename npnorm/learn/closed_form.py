"""The staged backward collapsed: the three named terms, and the matrix view.

(docs/derivations/batch_norm_training.md derives both.) npnorm's own backward,
``npnorm._stats.standardize_backward``, computes the same three terms fused into one
expression; here each term is its own line, so that each can be checked against
finite differences along its own paths (:func:`npnorm.learn.check_terms`).
"""

from __future__ import annotations

import numpy as np

from ._tape import Tape


def closed_form(tape: Tape, dxhat: np.ndarray) -> dict[str, np.ndarray]:
    """The terms of the input gradient, from ``dxhat`` and the tape's xhat and rstd.

    ``dx`` (the gradient of the normalized value, ``input`` or GroupNorm's ``xg``) is
    their sum::

        term 1  direct           rstd · dxhat
        term 2  through mean     -rstd · mean(dxhat)                    (not in RMSNorm)
        term 3  through var      -rstd · xhat · Σ(dxhat · xhat) / n     (n - 1 with correction=1)

    With running statistics (eval) only term 1 is there. Each term has the shape of x.

    Parameters
    ----------
    tape : Tape
        From ``staged_forward`` or ``staged_normalize``: its xhat, rstd, reduced axes
        and ``n`` are used.
    dxhat : ndarray
        The gradient of the loss with respect to xhat (``dxhat = dy · w``; GroupNorm's
        ``xhatg``, the grouped view), e.g. ``staged_backward(tape, dy)["xhat"]``.

    Returns
    -------
    dict of str to ndarray
        ``"direct"``, then ``"mean"`` (not for RMSNorm), then ``"var"`` (``"ms"`` for
        RMSNorm) with batch statistics; only ``"direct"`` with running statistics.

    Raises
    ------
    TypeError
        When ``tape`` is not the tape of a normalization.
    ValueError
        When ``dxhat`` does not have the shape of the tape's xhat.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, closed_form
    >>> x = np.random.default_rng(0).standard_normal((2, 3, 4))
    >>> tape = staged_forward("layer_norm", x, 4)
    >>> grads = staged_backward(tape, np.random.default_rng(1).standard_normal(x.shape))
    >>> dxhat = grads["xhat"]
    >>> terms = closed_form(tape, dxhat)
    >>> list(terms)
    ['direct', 'mean', 'var']
    >>> np.allclose(terms["direct"] + terms["mean"] + terms["var"], grads["input"])
    True
    """
    st = tape.standardized if isinstance(tape, Tape) else None
    if st is None:
        raise TypeError(
            "closed_form takes the tape of a normalization (staged_forward or staged_normalize), "
            f"got {type(tape).__name__}"
        )
    xhat, rstd, axes = tape[st.out], tape["rstd"], st.axes
    if np.shape(dxhat) != np.shape(xhat):
        raise ValueError(
            f"dxhat must have the shape of the tape's {st.out!r}, {tuple(np.shape(xhat))} "
            f"(the gradient with respect to it), got {tuple(np.shape(dxhat))}"
        )
    terms = {"direct": rstd * dxhat}  # term 1
    if st.batch_stats and st.center:
        terms["mean"] = np.broadcast_to(
            -rstd * np.mean(dxhat, axis=axes, keepdims=True), xhat.shape
        ).copy()  # term 2
    if st.batch_stats:
        proj = np.sum(dxhat * xhat, axis=axes, keepdims=True) / (st.n - st.correction)  # axes -> 1
        terms["var" if st.center else "ms"] = -rstd * xhat * proj  # term 3
    return terms


def jacobian(tape: Tape, *, h: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The matrix view of the first group (row, channel, ...): ``dx = J · dxhat``.

    ``J = ∂xhat/∂x`` of the first group's ``n`` values, from the formula::

        J = rstd · (I - 11ᵀ/n - xhat xhatᵀ/n)

    (without the ``11ᵀ/n`` term for RMSNorm, ``n - 1`` with correction=1, ``rstd · I``
    with running statistics). J is symmetric, so the gradient ``Jᵀ dxhat`` is ``J dxhat``.

    Parameters
    ----------
    tape : Tape
        From ``staged_forward`` or ``staged_normalize``.
    h : float, default 1e-6
        The finite-difference step of the numeric matrix.

    Returns
    -------
    J : ndarray, shape (n, n)
        From the formula.
    J_numeric : ndarray, shape (n, n)
        The same matrix by central differences of the tape; column j is ``∂xhat/∂x_j``.
    xhat : ndarray, shape (n,)
        The group's normalized values.
    rstd : float
        The group's ``1 / sqrt(var + eps)``.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, jacobian
    >>> x = np.random.default_rng(0).standard_normal((2, 4))
    >>> tape = staged_forward("layer_norm", x, 4)
    >>> J, J_numeric, xhat, rstd = jacobian(tape)
    >>> J.shape, np.allclose(J, J_numeric), np.allclose(J, J.T)
    ((4, 4), True, True)
    >>> grads = staged_backward(tape, np.random.default_rng(1).standard_normal(x.shape))
    >>> dxhat = grads["xhat"][0]  # the first row
    >>> np.allclose(J @ dxhat, grads["input"][0])
    True
    """
    st = tape.standardized
    assert st is not None
    x0 = tape[st.src]
    sel = tuple(slice(None) if a in st.axes else 0 for a in range(x0.ndim))  # the first group
    xhat = tape[st.out][sel].reshape(-1)  # n
    rstd = float(np.broadcast_to(tape["rstd"], x0.shape)[sel].reshape(-1)[0])
    n = xhat.size
    # the formula
    inner = np.eye(n)  # n,n
    if st.batch_stats and st.center:
        inner = inner - np.ones((n, n)) / n  # through the mean
    if st.batch_stats:
        inner = inner - np.outer(xhat, xhat) / (n - st.correction)  # through the variance
    J = rstd * inner  # n,n
    # finite differences: column j is ∂xhat/∂x_j
    where = np.argwhere(np.ones(x0[sel].shape, dtype=bool))  # the group's elements, in xhat's order
    members = [tuple(next(it) if a in st.axes else 0 for a in range(x0.ndim)) for it in map(iter, where)]
    J_num = np.empty((n, n))
    for j, idx in enumerate(members):
        cols = []
        for sign in (1.0, -1.0):
            v = x0.copy()
            v[idx] += sign * h
            cols.append(tape.rerun({st.src: v})[st.out][sel].reshape(-1))
        J_num[:, j] = (cols[0] - cols[1]) / (2 * h)
    return J, J_num, xhat, rstd
