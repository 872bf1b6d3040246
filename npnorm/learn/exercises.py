"""The exercises in ``exercises/`` and their grader (``python -m npnorm learn check NAME``).

Each exercise is a Python file with one function to fill in (its lines say ``TODO``).
The grader builds two small examples (the one the exercise describes, then one of
other sizes, seed and, where the exercise allows it, eps or axes: a function right only
for the first example's sizes fails the second), calls the function on each, and checks
what it returns with the step checker: every gradient against finite differences of the
loss, every term of a closed form against finite differences along its own paths. It
names the first wrong step going back from the output, which is the one to fix first
(the steps after it are computed from it). A function that writes into its arguments
fails too: a backward reads the forward's values, and other code reads them after it.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .._checks import changed_in_place
from . import staged_backward, staged_forward
from ._tape import Tape
from .check import TERM_NAMES, CheckRow, check_steps, check_terms, compare, numeric_gradient, term_paths
from .examples import example, upstream
from .normalize import staged_normalize

Result = tuple[Mapping[str, Any], Mapping[str, Any]]  # (step gradients, closed-form terms)


@dataclass(frozen=True)
class Exercise:
    name: str
    title: str
    page: str  # the derivation to read, under docs/derivations/
    function: str  # the function the learner writes
    make: Callable[[], Tape]
    call: Callable[[Callable[..., Any], Tape, np.ndarray], Result]
    names: tuple[str, ...] | None = None  # the steps checked; None: every step
    second: Callable[[], Tape] | None = None  # the second example: other sizes and seed

    @property
    def examples(self) -> tuple[Callable[[], Tape], ...]:
        """The examples graded, in order: the one the exercise describes, then the second."""
        return (self.make,) if self.second is None else (self.make, self.second)


class _ChangedInPlace(Exception):
    """What a call raises where the learner's function wrote into one of its arguments."""


def _check_unchanged(function: str, args: Mapping[str, tuple[Any, Any]]) -> None:
    """Raise ``_ChangedInPlace`` naming the first argument (name: (a copy kept, the array
    given to the learner's function)) whose value the function changed."""
    changed = changed_in_place(args)
    if changed:
        raise _ChangedInPlace(
            f"your {function} changed its argument {changed[0]} in place: a backward reads the "
            f"forward's values and must leave them as they were (other code reads them after it); "
            f"work on a copy (a = a.copy(), or a - b instead of a -= b)"
        )


def _staged(fn: Callable[..., Any], t: Tape, dy: np.ndarray) -> Result:
    kept = {name: np.copy(t[name]) for name in t}
    given_dy = dy.copy()
    grads = fn(t, given_dy)
    _check_unchanged("backward", {"dy": (dy, given_dy), **{f"t[{k!r}]": (v, t[k]) for k, v in kept.items()}})
    return grads, {}


def _terms(fn: Callable[..., Any], t: Tape, dy: np.ndarray) -> Result:
    st = t.standardized
    assert st is not None
    dxhat = staged_backward(t, dy)[st.out]
    args = {"dxhat": dxhat, "xhat": t[st.out], "rstd": t["rstd"]}
    given = {k: v.copy() for k, v in args.items()}
    terms = fn(*given.values(), st.axes)
    _check_unchanged("closed_form", {k: (args[k], given[k]) for k in args})
    return {}, terms


def _from_saved(fn: Callable[..., Any], t: Tape, dy: np.ndarray) -> Result:
    x, w = t["input"], t["weight"]
    rows = x.shape[: x.ndim - w.ndim]
    args = {"dy": dy, "x": x, "mean": t["mean"].reshape(rows), "rstd": t["rstd"].reshape(rows), "weight": w}
    given = {k: v.copy() for k, v in args.items()}  # the mean and rstd as the library saves them
    grads = fn(*given.values())
    _check_unchanged("backward_from_saved", {k: (args[k], given[k]) for k in args})
    return grads, {}


def _tape(name: str, **kw: Any) -> Callable[[], Tape]:
    def make() -> Tape:
        args, kwargs = example(name, **kw)
        return staged_forward(name, *args, **kwargs)

    return make


def _other(
    name: str, shape: tuple[int, ...], *, groups: int = 3, eval: bool = False, eps: float | None = None
) -> Callable[[], Tape]:
    """The second example of layer ``name``: the first example's (``example``) with an
    input of ``shape``, other values (seed 7) and ``eps`` where given."""
    return _tape(name, shape=shape, groups=groups, eval=eval, eps=eps, seed=7)


def _unbiased(shape: tuple[int, ...] = (6, 3), seed: int = 3) -> Callable[[], Tape]:
    def make() -> Tape:
        rng = np.random.default_rng(seed)
        return staged_normalize(rng.normal(0.5, 2.0, shape), 0, eps=1e-5, correction=1)  # BatchNorm1d, n-1

    return make


BN, EVAL, LN = "batch_norm_training.md", "batch_norm_eval.md", "layer_norm.md"
GN = "group_norm_instance_norm.md"
SAVED = ("xhat", "weight", "bias", "input")  # what a backward from the saved statistics returns
EXERCISES = {
    e.name: e
    for e in [
        Exercise("batch_norm_staged", "BatchNorm in training, node by node", BN, "backward",
                 _tape("batch_norm"), _staged, second=_other("batch_norm", (3, 2, 2, 3))),
        Exercise("closed_form", "Collapse the staged BatchNorm backward into three terms", BN, "closed_form",
                 _tape("batch_norm"), _terms, second=_other("batch_norm", (5, 2, 3))),  # axes (0, 2)
        Exercise("layer_norm", "LayerNorm over two trailing axes, node by node", LN, "backward",
                 _tape("layer_norm"), _staged, second=_other("layer_norm", (3, 2, 3, 6))),
        Exercise("rms_norm", "RMSNorm, node by node", "rms_norm.md", "backward", _tape("rms_norm"), _staged,
                 second=_other("rms_norm", (2, 4, 5), eps=0.5)),
        Exercise("group_norm", "GroupNorm by reshape, node by node", GN, "backward",
                 _tape("group_norm"), _staged, second=_other("group_norm", (4, 12, 1, 3), groups=4)),
        Exercise("batch_norm_eval", "BatchNorm in eval mode, node by node", EVAL, "backward",
                 _tape("batch_norm", eval=True), _staged,
                 second=_other("batch_norm", (3, 2, 2, 3), eval=True)),
        Exercise("unbiased_variance", "The closed form when the n-1 variance normalizes", EVAL,
                 "closed_form", _unbiased(), _terms, second=_unbiased((5, 4), seed=8)),
        Exercise("cache_vs_recompute", "LayerNorm's backward from the saved statistics only", LN,
                 "backward_from_saved", _tape("layer_norm"), _from_saved, SAVED,
                 second=_other("layer_norm", (3, 2, 3, 6))),
    ]
}  # fmt: skip


def find(name_or_path: str, *, solution: bool = False) -> tuple[Exercise, Path]:
    """The exercise and the file to grade: a path, or a name looked up in ``exercises/``
    (``exercises/solutions/`` with ``solution``) under the current directory, then
    beside the npnorm package (a source checkout)."""
    path = Path(name_or_path)
    if path.suffix == ".py":
        if solution:
            raise ValueError(
                f"--solution takes an exercise name (it grades exercises/solutions/NAME.py), not a file: "
                f"{path}"
            )
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        name = path.stem
    else:
        name = name_or_path
        sub = Path("exercises", "solutions") if solution else Path("exercises")
        candidates = [
            Path.cwd() / sub / f"{name}.py",
            Path(__file__).resolve().parents[2] / sub / f"{name}.py",
        ]
        found = [c for c in candidates if c.is_file()]
        if name in EXERCISES and not found:
            raise FileNotFoundError(
                f"exercise {name!r} not found at {' or '.join(map(str, candidates))}: the exercises "
                f"come with npnorm's source repository (its exercises/ folder), not with the installed "
                f"package; run from a checkout, or give the path of your copy (named {name}.py)"
            )
        path = found[0] if found else path
    if name not in EXERCISES:
        named = " (a file is graded as the exercise its name names)" if path.suffix == ".py" else ""
        raise ValueError(f"unknown exercise {name!r}{named}; one of {', '.join(EXERCISES)}")
    return EXERCISES[name], path


@dataclass
class Grade:
    exercise: Exercise
    tape: Tape
    rows: list[CheckRow]
    error: str = ""
    raised: bool = True  # the error is the traceback of what the function raised
    unknown: tuple[str, ...] = ()  # keys of the returned dict that name no step (or term): typos?
    passed_before: tuple[Grade, ...] = ()  # the examples graded before this one (they passed)

    @property
    def ok(self) -> bool:
        return not self.error and all(r.ok for r in self.rows)

    @property
    def graded(self) -> tuple[Grade, ...]:
        """Every example's grade, in the order graded: those that passed, then this one."""
        return (*self.passed_before, self)

    def _where(self) -> str:
        """Which example failed, where it is not the first: its sizes are what differ."""
        if not self.passed_before:
            return ""
        return (
            f" on the second example ({self.tape.description}), where the first passed: is a count, "
            f"a shape or an axis written for the first example's sizes?"
        )

    @property
    def first_wrong(self) -> CheckRow | None:
        return next((r for r in self.rows if not r.ok), None)

    def message(self) -> str:
        if self.error and self.raised:
            return f"FAIL: your {self.exercise.function} raised an error{self._where() or ':'}\n{self.error}"
        if self.error:
            return f"FAIL: {self.error}"
        wrong = [r for r in self.rows if not r.ok]
        terms = self.exercise.call is _terms
        unknown = ""
        if self.unknown:  # (a misspelt key was reported as "missing"; an extra one passed unseen)
            kind = "term" if terms else "step"
            unknown = f" Not checked: {', '.join(self.unknown)}, no {kind} of this exercise (a typo?)."
        if not wrong:
            both = " on both examples" if self.passed_before else ""
            if terms:
                return (
                    f"PASS{both}: each term matches finite differences along its paths, and their sum "
                    "matches dx." + unknown
                )
            return f"PASS{both}: all {len(self.rows)} gradients match finite differences." + unknown
        first = wrong[0]
        if terms and first.name in TERM_NAMES:
            where = f"Wrong term: `{first.name}` ({TERM_NAMES[first.name]})"
        else:
            where = f"Wrong step: `{first.name}` (the first wrong one going back from y: fix it first)"
        detail = first.note or _diff(first)
        if unknown and not detail.endswith((".", "?")):
            detail += "."
        where_example = f"{self._where()}\n" if self.passed_before else ": "
        return f"FAIL{where_example}{len(wrong)} of {len(self.rows)} wrong. {where}: {detail}" + unknown


def _diff(row: CheckRow) -> str:
    text = f"max |yours - numeric| = {row.max_abs:.3e} ({row.max_rel:.1e} of the gradient's size)"
    if row.max_rel < 1e-3:  # (it failed: above RTOL, 1e-6, where rounding stays near 1e-10)
        text += (
            "; small, but far above rounding in float64, so a real difference: a term slightly off, "
            "such as eps left out?"
        )
    return text


def grade(exercise: Exercise, fn: Callable[..., Any]) -> Grade:
    """Run ``fn`` (the learner's function) on each of the exercise's examples in turn and
    check what it returns: the first example's grade where it fails, else the second's
    (with the first in ``passed_before``)."""
    passed: tuple[Grade, ...] = ()
    for make in exercise.examples:
        result = _grade_on(exercise, fn, make)
        result.passed_before = passed
        if not result.ok:
            break
        passed = (*passed, result)
    return result


def _grade_on(exercise: Exercise, fn: Callable[..., Any], make: Callable[[], Tape]) -> Grade:
    """The grade of ``fn`` on the example ``make`` builds."""
    tape = make()
    dy = upstream(tape.output.shape)
    reference = staged_backward(tape, dy)  # only its order is used: the order the steps are computed in
    try:  # on a tape of its own: whatever the function changes in place, the check's tape stays as built
        grads, terms = exercise.call(fn, make(), dy)
    except _ChangedInPlace as err:
        return Grade(exercise, tape, [], str(err), raised=False)
    except (Exception, SystemExit) as err:  # sys.exit() in the learner's code is a failure too
        text = traceback.format_exc(limit=-2)
        if isinstance(err, ValueError) and "broadcast" in str(err):  # (the line shown is the victim)
            text += (
                "A broadcast error usually means that a gradient computed earlier has the wrong shape: "
                "a statistic's gradient keeps its reduced axes (keepdims=True): the statistic's own shape, "
                "as (1, C, 1, 1) for BatchNorm's or (N, 1, 1, 1) for a LayerNorm row's.\n"
            )
        if "_Todo" in str(err):  # a step filled in reads one still TODO (TODO * a, TODO.sum())
            text += (
                "A step you filled in reads the gradient of a step still TODO: fill them in in order, "
                "going back from y (each step's gradient is computed from the ones after it).\n"
            )
        return Grade(exercise, tape, [], text)
    rows: list[CheckRow] = []
    if exercise.call is _terms:
        if not isinstance(terms, Mapping):
            return Grade(
                exercise,
                tape,
                [],
                f"your {exercise.function} must return a dict of terms, got {type(terms)}",
                raised=False,
            )
        rows = check_terms(tape, terms, grad_output=dy)
        st = tape.standardized
        assert st is not None
        if all(r.shape_ok for r in rows):
            total = np.sum([np.asarray(terms[r.name]) for r in rows], axis=0)  # dx: the sum of the terms
            rows.append(compare(st.src, total, numeric_gradient(tape, st.src, dy)))
        return Grade(exercise, tape, rows, unknown=_unknown(terms, list(term_paths(tape))))
    if not isinstance(grads, Mapping):
        return Grade(
            exercise,
            tape,
            [],
            f"your {exercise.function} must return a dict of gradients, got {type(grads)}",
            raised=False,
        )
    names = list(exercise.names) if exercise.names else [k for k in reference if k != tape.output_name]
    order = [k for k in reference if k in names]
    rows = check_steps(tape, grads, grad_output=dy, names=order)
    return Grade(exercise, tape, rows, unknown=_unknown(grads, [*reference, tape.output_name]))


def _unknown(given: Mapping[Any, Any], known: list[str]) -> tuple[str, ...]:
    """The keys of ``given`` that are not in ``known``, as ``repr`` shows them, in their order."""
    return tuple(repr(k) for k in given if k not in known)


def load(path: Path, function: str) -> Callable[..., Any]:
    """The function ``function`` defined in the file ``path``."""
    spec = importlib.util.spec_from_file_location(f"npnorm_exercise_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no function {function!r}")
    return fn
