"""The step checker: each step's gradient against finite differences, in float64.

The loss is ``L = sum(y · grad_output)``, a random projection of the output, so its
gradient with respect to ``y`` is ``grad_output`` and every output element's path
back is exercised. For a step ``s`` the checker perturbs one element of ``s`` at a
time by ``±h`` (scaled to the element's magnitude), re-runs only the nodes after
``s`` (the nodes before it do not change) and takes the central difference

    D(h) = (L(s + h e_i) - L(s - h e_i)) / (2 h)    (error ~ c·h², from the curvature)

at ``h`` and ``h/2``, and combines them so that the ``h²`` error cancels
(Richardson extrapolation):

    dL/ds[i] ~ (4·D(h/2) - D(h)) / 3

It does so at five steps 100 times apart and keeps the estimate that agrees best with
the next one (no single step suits a mean of 1000 over values 0.01 apart, which needs a
small one, and a variance of 1e-6 under an eps of 0.1, which needs a large one).

A gradient passes when ``max |given - numeric| <= atol + rtol · max |numeric|`` and
its shape is the step's shape exactly: a gradient of shape (C,) for a step of shape
(1, C, 1, 1) is wrong even though it would broadcast to the right values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._tape import Edge, Tape

ATOL = 1e-7
RTOL = 1e-6
H = 1e-6


class _Todo:
    """What an exercise stub holds where a gradient is still to be written."""

    def __repr__(self) -> str:
        return "TODO"


TODO: Any = _Todo()


@dataclass(frozen=True)
class CheckRow:
    """One step's verdict: a given gradient against finite differences.

    A gradient passes when it has the step's shape exactly and
    ``max |given - numeric| <= atol + rtol · max |numeric|``. ``str(row)`` is one line
    of the report ``python -m npnorm learn`` prints.

    Parameters
    ----------
    name : str
        The step, leaf or named term checked.
    ok : bool
        Whether the given gradient passed.
    shape_ok : bool
        Whether it has the step's shape exactly (False when there was no array).
    max_abs : float
        ``max |given - numeric|``; NaN when the gradient could not be compared
        (``note`` says why).
    max_rel : float
        ``max_abs / max |numeric|``; NaN as ``max_abs`` is.
    shape : tuple of int
        The step's shape, which the gradient must have.
    got_shape : tuple of int or None
        The given gradient's shape; None when no array was given.
    note : str, default ""
        Why the gradient could not be compared (missing, still TODO, wrong shape,
        not floating point, nan or inf).

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, check_steps
    >>> tape = staged_forward("layer_norm", np.arange(8.0).reshape(2, 4), 4)
    >>> dy = np.random.default_rng(0).standard_normal(tape.output.shape)
    >>> grads = staged_backward(tape, dy)
    >>> [row] = check_steps(tape, grads, names=["rstd"])
    >>> row.ok, row.shape
    (True, (2, 1))
    >>> grads["rstd"] = grads["rstd"].reshape(2)  # the right values, the wrong shape
    >>> [row] = check_steps(tape, grads, names=["rstd"])
    >>> row.ok, row.got_shape
    (False, (2,))
    >>> print(row)
    rstd: WRONG: shape (2,) where the step has shape (2, 1)
    (it would broadcast, but a gradient has its step's shape exactly)
    """

    name: str
    ok: bool
    shape_ok: bool
    max_abs: float
    max_rel: float
    shape: tuple[int, ...]
    got_shape: tuple[int, ...] | None
    note: str = ""

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "WRONG"
        if np.isnan(self.max_abs):
            return f"{self.name}: {verdict}: {self.note}"
        extra = f" ({self.note})" if self.note else ""
        return (
            f"{self.name}: {verdict}: max |given - numeric| = {self.max_abs:.2e}, "
            f"relative {self.max_rel:.2e}, shape {self.shape}{extra}"
        )


def numeric_gradient(
    tape: Tape, name: str, grad_output: np.ndarray, *, h: float = H, frozen: Collection[Edge] = ()
) -> np.ndarray:
    """Central differences of ``L = sum(y · grad_output)`` with respect to step ``name``.

    For each element ``i`` of the step's value ``s``, with a step scaled to the element,
    ``h_i = h · max(|s[i]|, mean |s|, std(input))`` (``h`` where all are 0; the input's
    spread keeps a step of values near 0, such as the mean of centred rows or a small
    bias, from drowning in rounding), and ``D(t) = (L(s + t e_i) - L(s - t e_i)) / (2 t)``
    (``2 t`` as the perturbed values are stored, so that a step lost to their rounding
    does not count)::

        R(t) = (4 D(t / 2) - D(t)) / 3

    ``D``'s error is ``c·t² + O(t⁴)``, so this combination (Richardson extrapolation)
    leaves ``O(t⁴)``, plus the loss's rounding over ``t``. ``R`` is taken at the five
    steps ``t = h_i · (1e4, 1e2, 1, 1e-2, 1e-4)``; the result is the one whose error
    looks least: the larger of its difference from the next step's and the loss's
    rounding at its step. A step too large for the curvature (a mean of 1000 over values
    0.01 apart: ``h_i`` is a tenth of the spread) or too small for the rounding (a
    variance of 1e-6 under an eps of 0.1, a bias of 100 over outputs of 1e-3) is passed
    over: one step for all called right gradients wrong there. Inputs of 1000 ± 0.1 are
    checked as well as unit-scale data; at 1000 ± 0.01, and closer, the input's gradient
    can still be off by 1e-6 to 4e-6 of its size (the rounding of the mean), over the
    default rtol. Only the graph after ``name`` is re-run (``Tape.rerun``); eight re-runs
    per element mostly (twenty at most), so keep the arrays small.
    Edges in ``frozen`` keep their recorded values, so the result is the gradient along
    the other paths only.

    Parameters
    ----------
    tape : Tape
        A staged forward (``staged_forward``, ``staged_normalize``, or built by hand).
    name : str
        The step or leaf to differentiate with respect to: ``"input"``, ``"xhat"``, ...
    grad_output : ndarray
        The upstream gradient ``dy``, of the output's shape: ``L = sum(y · dy)``.
    h : float, default 1e-6
        The finite-difference step, relative to each element's magnitude (or to the
        step's mean magnitude, or the input's standard deviation, where larger): the
        middle one of the five steps tried.
    frozen : collection of (str, str), default ()
        Edges ``(input name, node name)`` held at their recorded values; see
        :func:`term_paths`.

    Returns
    -------
    ndarray
        The numeric gradient, float64, of the step's shape.

    Raises
    ------
    KeyError
        When ``name`` is neither a step nor a leaf of the tape.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, numeric_gradient
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.standard_normal((2, 3)), np.array([1.0, 2.0, 3.0])
    >>> tape = staged_forward("layer_norm", x, 3, w)
    >>> dy = rng.standard_normal((2, 3))
    >>> dxhat = numeric_gradient(tape, "xhat", dy)  # y = xhat · w, so dxhat = dy · w
    >>> np.allclose(dxhat, dy * w)
    True
    >>> dx = numeric_gradient(tape, "input", dy)
    >>> np.allclose(dx, staged_backward(tape, dy)["input"])
    True
    """
    v0 = np.asarray(tape[name], dtype=np.float64)
    out = tape.output_name
    typical = float(np.mean(np.abs(v0))) if v0.size else 0.0  # the step's mean magnitude
    if "input" in tape and np.size(tape["input"]):  # and the data's spread, where larger
        typical = max(typical, float(np.std(tape["input"])))

    def central(i: tuple[int, ...], t: float) -> float:  # D(t) for element i
        losses, at = [], []
        for sign in (1.0, -1.0):
            v = v0.copy()
            v[i] += sign * t
            at.append(float(v[i]))
            y = tape.rerun({name: v}, frozen).get(out, tape.output)
            losses.append(float(np.sum(y * grad_output)))
        return (losses[0] - losses[1]) / (at[0] - at[1])  # over the step as stored: exact

    def richardson(i: tuple[int, ...], t: float) -> float:
        return (4.0 * central(i, t / 2.0) - central(i, t)) / 3.0  # the t² errors cancel

    num = np.empty(v0.shape)
    noise = ROUNDING * float(np.sum(np.abs(tape.output * grad_output)))  # L's rounding, about
    with np.errstate(all="ignore"):  # a step out of the domain gives nan, which the verdict names
        for i in np.ndindex(v0.shape):
            step = h * (max(abs(float(v0[i])), typical) or 1.0)  # h_i
            num[i] = _steadiest(functools.partial(richardson, i), step, noise)
    return num


STEP_FACTORS = (1e4, 1e2, 1.0, 1e-2, 1e-4)  # the steps tried, times h_i (see _steadiest)
ROUNDING = 4.0 * float(np.finfo(np.float64).eps)  # L's rounding error, relative to sum |y · dy|


def _steadiest(estimate: Callable[[float], float], step: float, noise: float) -> float:
    """Of the estimates ``estimate(t)`` at the steps ``t = step · STEP_FACTORS`` (falling
    by 100 each), the one whose error looks least: at a step too large the curvature moves
    it (it differs from the next one's), at a step too small the loss's rounding does
    (``3 · noise / t``: two estimates at tiny steps can agree by both being rounding).
    Error of each: the larger of its difference from the next estimate and its rounding.
    The steps stop where the rounding alone passes the least error found (it only grows
    as they fall): two estimates, mostly. NaN where no two are finite."""
    best, best_error = float("nan"), float("inf")
    previous = None
    for t in (step * m for m in STEP_FACTORS):
        if previous is not None and 3.0 * noise / previous[0] >= best_error:
            break  # (no later estimate can do better)
        current = (t, estimate(t))
        if previous is not None and np.isfinite(previous[1]) and np.isfinite(current[1]):
            error = max(abs(previous[1] - current[1]), 3.0 * noise / previous[0])
            if error < best_error:
                best, best_error = previous[1], error
        previous = current
    return best


def compare(
    name: str, given: Any, numeric: np.ndarray, *, atol: float = ATOL, rtol: float = RTOL, what: str = "step"
) -> CheckRow:
    """The verdict on ``given`` against ``numeric`` (same shape required, never broadcast);
    ``what`` ("step", or "term" of the closed form) names it in a shape note."""
    shape = tuple(numeric.shape)
    nan = float("nan")
    if given is TODO:
        return CheckRow(name, False, False, nan, nan, shape, None, "not filled in (still TODO)")
    if given is None:
        return CheckRow(name, False, False, nan, nan, shape, None, "missing (no gradient given)")
    if not isinstance(given, (np.ndarray, np.generic)):
        return CheckRow(name, False, False, nan, nan, shape, None, f"not an array: {type(given).__name__}")
    got = tuple(given.shape)
    if got != shape:
        note = f"shape {got} where the {what} has shape {shape}"
        if _broadcasts(got, shape) and what == "term":
            note += (
                " (it would broadcast, but each term has the shape of the value normalized: "
                "broadcast it, np.broadcast_to(term, shape))"
            )
        elif _broadcasts(got, shape):
            note += " (it would broadcast, but a gradient has its step's shape exactly)"
        return CheckRow(name, False, False, nan, nan, shape, got, note)
    if not np.issubdtype(given.dtype, np.floating):
        return CheckRow(name, False, True, nan, nan, shape, got, f"dtype {given.dtype}, not floating point")
    a = given.astype(np.float64)
    if not np.all(np.isfinite(a)):
        return CheckRow(name, False, True, nan, nan, shape, got, "contains nan or inf")
    if not np.all(np.isfinite(numeric)):  # not the gradient's fault: say so
        note = (
            "the numeric gradient is nan or inf: a finite-difference step left the function's "
            "domain (a variance pushed below 0?); try a smaller h"
        )
        return CheckRow(name, False, True, nan, nan, shape, got, note)
    err = float(np.max(np.abs(a - numeric), initial=0.0))
    scale = float(np.max(np.abs(numeric), initial=0.0))
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    ok = err <= atol + rtol * scale
    return CheckRow(name, ok, True, err, rel, shape, got)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _upstream(tape: Tape, grads: Mapping[str, Any] | None, grad_output: Any) -> np.ndarray:
    """``grad_output`` as float64 of the output's shape; from ``grads`` (check_steps'
    mapping; None for check_terms, which has none) where it is None."""
    if tape.output.dtype != np.float64:
        raise TypeError(
            f"the step checker needs a float64 tape, got {tape.output.dtype} "
            "(staged_forward always computes in float64)"
        )
    if grad_output is None:
        if grads is None:
            raise ValueError("pass grad_output: the upstream gradient dy the terms were computed from")
        if tape.output_name not in grads:
            raise ValueError(
                f"pass grad_output, or the gradient of the output step {tape.output_name!r} in grads"
            )
        grad_output = grads[tape.output_name]
    dy = np.asarray(grad_output, dtype=np.float64)
    if dy.shape != tape.output.shape:
        raise ValueError(f"grad_output must have the output's shape {tape.output.shape}, got {dy.shape}")
    return dy


def check_steps(
    tape: Tape,
    grads: Mapping[str, Any],
    *,
    grad_output: np.ndarray | None = None,
    names: Sequence[str] | None = None,
    atol: float = ATOL,
    rtol: float = RTOL,
    h: float = H,
) -> list[CheckRow]:
    """Check the gradient of every step (and of input, weight, bias) by finite differences.

    Parameters
    ----------
    tape : Tape
        From :func:`staged_forward` (float64).
    grads : mapping
        Step name -> the gradient of ``L = sum(y · grad_output)`` with respect to that
        step, as :func:`staged_backward` returns (or as you computed it).
    grad_output : ndarray, optional
        The upstream gradient ``dy``; by default ``grads[<output step>]``.
    names : sequence of str, optional
        The steps to check; by default the differentiable leaves, then every step.
        A name missing from ``grads`` fails ("missing").
    atol, rtol, h : float, default 1e-7, 1e-6 and 1e-6
        Tolerances and the finite-difference step (see the module docstring).

    Returns
    -------
    list of CheckRow
        One per name, in the order checked.

    Raises
    ------
    TypeError
        When the tape is not float64.
    ValueError
        When ``grad_output`` is not given and ``grads`` has no gradient of the output
        step, when it does not have the output's shape, or when a name is not a step
        or differentiable leaf of the tape.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, check_steps
    >>> x = np.random.default_rng(0).standard_normal((2, 3, 4))
    >>> tape = staged_forward("layer_norm", x, 4)
    >>> dy = np.random.default_rng(1).standard_normal(tape.output.shape)
    >>> grads = staged_backward(tape, dy)
    >>> [(row.name, row.ok) for row in check_steps(tape, grads)]
    [('input', True), ('mean', True), ('xc', True), ('var', True), ('rstd', True),
     ('xhat', True), ('y', True)]

    A wrong ``dx``: the closed form without its ``- mean(dxhat)`` term.

    >>> dxhat = grads["xhat"]
    >>> rstd, xhat = tape["rstd"], tape["xhat"]
    >>> grads["input"] = rstd * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    >>> [row] = check_steps(tape, grads, names=["input"])
    >>> row.ok
    False
    """
    if not isinstance(grads, Mapping):
        raise TypeError(
            "grads must map step names to gradients, as staged_backward returns them "
            f"(e.g. {{'xhat': ..., 'input': ...}}); got {type(grads).__name__}"
        )
    dy = _upstream(tape, grads, grad_output)
    if names is None:
        names = [*tape.differentiable, *tape.steps]
    rows = []
    for name in names:
        if name not in tape or name in tape.constants:
            raise ValueError(f"{name!r} is not a step of this tape; its steps are {', '.join(tape)}")
        numeric = numeric_gradient(tape, name, dy, h=h)
        rows.append(compare(name, grads.get(name), numeric, atol=atol, rtol=rtol))
    return rows


TERM_NAMES = {
    "direct": "term 1, the direct path to xhat (the statistics held)",
    "mean": "term 2, the path through the mean",
    "var": "term 3, the path through the variance (mean held)",
    "ms": "term 3, the path through the mean square",
}


def term_paths(tape: Tape) -> dict[str, frozenset[Edge]]:
    """The edges each named term of ``dx`` holds fixed: the term is the gradient along
    every other path from the normalized value to the loss.

    Term 1 (direct) keeps the statistics fixed; term 2 follows x into the mean (and on
    from there); term 3 follows x into the variance with the mean fixed. Together they
    cover every path once, so they sum to ``dx``::

        dx = rstd · dxhat - rstd · mean(dxhat) - rstd · xhat · mean(dxhat · xhat)
             (direct)       (mean)               (var)

    RMSNorm has ``"direct"`` and ``"ms"`` (no mean); with running statistics (eval)
    only ``"direct"`` is left, holding nothing.

    Parameters
    ----------
    tape : Tape
        From ``staged_forward`` or ``staged_normalize``.

    Returns
    -------
    dict of str to frozenset of (str, str)
        Term name -> the edges ``(input name, node name)`` it holds at their recorded
        values; pass them as ``frozen`` to :func:`numeric_gradient`.

    Raises
    ------
    ValueError
        When the tape has no standardize block (one built by hand).

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, numeric_gradient, term_paths
    >>> x = np.random.default_rng(0).standard_normal((2, 4))
    >>> tape = staged_forward("layer_norm", x, 4)
    >>> paths = term_paths(tape)
    >>> sorted(paths["mean"])  # term 2: x reaches xhat only through the mean
    [('input', 'xc')]
    >>> dy = np.random.default_rng(1).standard_normal((2, 4))
    >>> dxhat = staged_backward(tape, dy)["xhat"]
    >>> direct = numeric_gradient(tape, "input", dy, frozen=paths["direct"])
    >>> np.allclose(direct, tape["rstd"] * dxhat)  # term 1 = rstd · dxhat
    True
    """
    st = tape.standardized
    if st is None:
        raise ValueError("this tape has no standardize block")
    src, out = st.src, st.out
    if not st.batch_stats:  # running statistics: x reaches xhat only directly
        return {"direct": frozenset()}
    if not st.center:
        return {"direct": frozenset({(src, "ms")}), "ms": frozenset({(src, out)})}
    return {
        "direct": frozenset({(src, "mean"), ("xc", "var")}),
        "mean": frozenset({(src, "xc")}),
        "var": frozenset({(src, "mean"), ("xc", out)}),
    }


def check_terms(
    tape: Tape,
    terms: Mapping[str, Any],
    *,
    grad_output: np.ndarray,
    atol: float = ATOL,
    rtol: float = RTOL,
    h: float = H,
) -> list[CheckRow]:
    """Check each named term of the closed form against finite differences along its paths.

    ``terms`` maps ``"direct"``, ``"mean"``, ``"var"`` (``"ms"`` for RMSNorm) to arrays
    of the normalized value's shape (``closed_form`` computes them). Each is
    compared with the gradient of the loss with respect to the normalized value along
    the paths of that term only (the other edges held at their recorded values, as
    :func:`term_paths` lists them).

    Parameters
    ----------
    tape : Tape
        From ``staged_forward`` or ``staged_normalize`` (float64).
    terms : mapping
        Term name -> its array, of the shape of the value normalized (``input``, or
        GroupNorm's grouped view ``xg``). A term missing here fails ("missing").
    grad_output : ndarray
        The upstream gradient ``dy`` the terms were computed from, of the output's shape.
    atol, rtol, h : float, default 1e-7, 1e-6 and 1e-6
        Tolerances and the finite-difference step (see the module docstring).

    Returns
    -------
    list of CheckRow
        One per term of the tape, in the order of :func:`term_paths`.

    Raises
    ------
    TypeError
        When the tape is not float64.
    ValueError
        When ``grad_output`` does not have the output's shape.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward, closed_form, check_terms
    >>> x = np.random.default_rng(0).standard_normal((4, 2, 3))
    >>> tape = staged_forward("batch_norm", x, None, None, training=True)
    >>> dy = np.random.default_rng(1).standard_normal(x.shape)
    >>> dxhat = staged_backward(tape, dy)["xhat"]
    >>> terms = closed_form(tape, dxhat)
    >>> [(row.name, row.ok) for row in check_terms(tape, terms, grad_output=dy)]
    [('direct', True), ('mean', True), ('var', True)]
    """
    dy = _upstream(tape, None, grad_output)
    st = tape.standardized
    assert st is not None
    rows = []
    for name, frozen in term_paths(tape).items():
        numeric = numeric_gradient(tape, st.src, dy, h=h, frozen=frozen)
        rows.append(compare(name, terms.get(name), numeric, atol=atol, rtol=rtol, what="term"))
    return rows
