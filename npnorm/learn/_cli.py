"""python -m npnorm learn: the command line of npnorm.learn (its usage is ``USAGE``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from . import LAYERS, check_steps, check_terms, closed_form, jacobian, staged_backward, staged_forward
from ._library import closed
from ._pages import PAGE, derivation
from ._tape import Tape
from .check import ATOL, RTOL, TERM_NAMES, CheckRow
from .examples import SPLIT, example, upstream
from .exercises import EXERCISES, Exercise, find, grade, load
from .normalize import staged_normalize

# the overview and --help text: a constant, not the docstring, which ``python -OO`` strips
USAGE = """python -m npnorm learn: print the staged graphs, their gradient checks, and grade exercises.

    python -m npnorm learn layer_norm                     the step table
    python -m npnorm learn layer_norm --staged-vs-closed  staged == the library's closed form
    python -m npnorm learn layer_norm --matrix            dx = J · dxhat, J checked
    python -m npnorm learn batch_norm --eval              eval mode (instance_norm: running stats)
    python -m npnorm learn group_norm --groups 6          GroupNorm with 6 groups (of 6 channels)
    python -m npnorm learn bessel                         the n-1 variance, and PyTorch's convention
    python -m npnorm learn sync_batch_norm --split 5,1,0  SyncBatchNorm over 3 simulated ranks
    python -m npnorm learn check batch_norm_staged        grade exercises/batch_norm_staged.py
    python -m npnorm learn check batch_norm_staged --solution

Exit status 0 when every check passes.
"""

SYMBOL = {"input": "x", "weight": "w", "bias": "b"}


def _num(v: float) -> str:
    return "-" if np.isnan(v) else f"{v:.1e}"


def step_table(tape: Tape, rows: list[CheckRow]) -> str:
    """The table: node, formula, shape, and the check of its gradient."""
    by_name = {r.name: r for r in rows}
    lines = [f"  {'#':>2}  {'step':<7} {'formula':<34} {'shape':<14} {'gradient':<9} "
             f"{'max |d - fd|':>12} {'relative':>9}  check"]  # fmt: skip
    entries = [("-", k, SYMBOL.get(k, k), tape[k].shape) for k in tape.differentiable]
    entries += [(str(i), k, node.formula, tape[k].shape) for i, (k, node) in enumerate(tape.nodes.items(), 1)]
    for num, name, formula, shape in entries:
        r = by_name.get(name)
        check = "-" if r is None else ("ok" if r.ok else f"WRONG {r.note}".rstrip())
        lines.append(
            f"  {num:>2}  {name:<7} {formula:<34} {tuple(shape)!s:<14} {'d' + SYMBOL.get(name, name):<9} "
            f"{_num(r.max_abs) if r else '-':>12} {_num(r.max_rel) if r else '-':>9}  {check}"
        )
    return "\n".join(lines)


def _header(tape: Tape) -> str:
    st = tape.standardized
    assert st is not None
    stats = (
        f"n = {st.n} values per statistic (Σ and n over the axes {st.axes})"
        if st.batch_stats
        else "statistics: the running buffers (constants)"
    )
    return (
        f"{tape.description}: {stats}, eps = {st.eps:g}, float64\n"
        "loss L = sum(y · dy), dy random normal; each step's gradient d<step> = dL/d<step> from\n"
        "staged_backward, checked against central differences of L in that step (perturb one element,\n"
        "re-run only the graph after the step)"
    )


def show_layer(name: str, *, eval: bool, groups: int) -> bool:
    args, kwargs = example(name, eval=eval, groups=groups)
    tape = staged_forward(name, *args, **kwargs)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    rows = check_steps(tape, grads)
    print(_header(tape))
    print()
    print(step_table(tape, rows))
    for k, v in tape.updates.items():
        print(f"  running buffer (not part of the graph): {tape.update_formulas[k]}")
        print(f"      = {np.array2string(v, precision=4)}")
    ok = all(r.ok for r in rows)
    print()
    tol = f"max |d - fd| <= {ATOL:g} + {RTOL:g} · max |fd|"
    if ok:
        print(f"all {len(rows)} gradients match finite differences ({tol})")
    else:
        print(f"WRONG: {', '.join(r.name for r in rows if not r.ok)} ({tol})")
    print(derivation("batch_norm_eval.md" if name == "batch_norm" and eval else PAGE[name]))
    return ok


def staged_vs_closed(name: str, *, eval: bool, groups: int) -> bool:
    from ..functional._dispatch import generic_only

    args, kwargs = example(name, eval=eval, groups=groups)
    tape = staged_forward(name, *args, **kwargs)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    fast = closed(name, args, kwargs, dy)
    with generic_only():
        generic = closed(name, args, kwargs, dy)
    print(f"{tape.description}, float64")
    print(f"staged (npnorm.learn) vs the library's closed form (npnorm.functional.{name}_backward):")
    worst = 0.0
    for key, label in (("y", "output y"), ("input", "dx"), ("weight", "dw"), ("bias", "db")):
        if fast[key] is None:
            continue
        staged = tape.output if key == "y" else grads[key]
        diffs = [float(np.max(np.abs(staged - lib[key]))) for lib in (fast, generic)]
        worst = max(worst, *diffs)
        print(
            f"  {label:<9} max |staged - closed| = {diffs[0]:.1e} (default kernel), {diffs[1]:.1e} (generic)"
        )
    for k, v in tape.updates.items():
        diff = float(np.max(np.abs(v - fast[k])))
        worst = max(worst, diff)
        print(f"  {k:<13} max |staged - library| = {diff:.1e}")
    ok = worst <= 1e-10
    print(f"  {'equal to 1e-10' if ok else 'DIFFERENT'}")
    st = tape.standardized
    assert st is not None
    terms = closed_form(tape, grads[st.out])
    rows = check_terms(tape, terms, grad_output=dy)
    dsrc = "dx" if st.src == "input" else f"d{st.src}"
    print(f"\nthe closed form term by term (npnorm.learn.closed_form), d{st.out} -> {dsrc}; each term")
    print("checked against finite differences along its own paths (the other edges of the graph held):")
    div = "n" if st.correction == 0 else "(n - 1)"
    formulas = {
        "direct": "rstd · dxhat",
        "mean": "-rstd · mean(dxhat)",
        "var": f"-rstd · xhat · Σ(dxhat · xhat) / {div}",
        "ms": "-rstd · xhat · Σ(dxhat · xhat) / n",
    }
    for r in rows:
        verdict = "ok" if r.ok else "WRONG"
        print(f"  {TERM_NAMES[r.name]:<56} {formulas[r.name]:<36} {_num(r.max_abs):>8}  {verdict}")
    total = sum(terms.values(), start=np.zeros_like(tape[st.src]))
    diff = float(np.max(np.abs(total - grads[st.src])))
    print(f"  staged {dsrc} - (sum of the terms): max {diff:.1e}")
    return ok and all(r.ok for r in rows) and diff <= 1e-10


# the values the first statistic serves, as the pages name them
_FIRST_STATISTIC = {
    "batch_norm": "channel 0",
    "layer_norm": "the first row",
    "rms_norm": "the first row",
    "group_norm": "the first group",
    "instance_norm": "the first instance (sample 0, channel 0)",
}


def show_matrix(name: str, *, eval: bool, groups: int) -> bool:
    args, kwargs = example(name, eval=eval, groups=groups)
    tape = staged_forward(name, *args, **kwargs)
    st = tape.standardized
    assert st is not None
    J, J_num, xhat, rstd = jacobian(tape)
    n, eps = xhat.size, st.eps
    fd = float(np.max(np.abs(J - J_num)))
    first = _FIRST_STATISTIC.get(tape.layer, "the first group")  # the values one statistic serves
    print(f"{tape.description}: the matrix view of {first} (n = {n} values)")
    print(f"dx = J · dxhat over {first}, J = ∂xhat/∂x:")
    if not st.batch_stats:
        formula = "rstd · I (the statistics are constants)"
    elif st.center:
        formula = f"rstd · (I - 11ᵀ/n - xhat xhatᵀ/{'n' if st.correction == 0 else '(n - 1)'})"
    else:
        formula = "rstd · (I - xhat xhatᵀ/n)"
    rows = [(f"J = {formula}", f"max |J - finite differences| = {fd:.1e}")]
    rows.append(("J is symmetric", f"max |J - Jᵀ| = {float(np.max(np.abs(J - J.T))):.1e}"))
    if st.batch_stats and st.center:
        rows.append(
            ("J · 1 = 0, so dx sums to zero", f"max |J · 1| = {float(np.max(np.abs(J @ np.ones(n)))):.1e}")
        )
    lam = eps * rstd**3  # J · xhat = eps · rstd³ · xhat
    if st.batch_stats:
        left = float(np.max(np.abs(J @ xhat - lam * xhat)))
        rows.append(("J · xhat = eps · rstd³ · xhat", f"max |J · xhat - eps · rstd³ · xhat| = {left:.1e}"))
    for claim, figure in rows:
        print(f"  {claim:<46} {figure}")
    if st.batch_stats:
        print("  so xhat · dx = eps · rstd³ · (xhat · dxhat): dx is orthogonal to xhat up to eps")
        print(f"  (eps · rstd³ = {lam:.2e})")
    print(f"  eigenvalues: {_multiset(np.linalg.eigvalsh(J), rstd)}   (rstd = {rstd:.4g})")
    return fd <= 1e-6


def _multiset(values: np.ndarray, scale: float) -> str:
    groups: list[list[float]] = []
    for v in np.sort(values):
        v = 0.0 if abs(v) < 1e-12 * scale else float(v)
        if groups and abs(v - groups[-1][0]) <= 1e-9 * max(scale, abs(v)):
            groups[-1].append(v)
        else:
            groups.append([v])
    return ", ".join(f"{g[0]:.4g}" + (f" ({len(g)} times)" if len(g) > 1 else "") for g in groups)


def _show(a: np.ndarray, precision: int = 4) -> str:
    return np.array2string(np.asarray(a), precision=precision)


def bessel() -> bool:
    """The n-1 variance: what it does to the output and the gradient, and where PyTorch uses it."""
    from .. import functional as F

    rng = np.random.default_rng(5)
    x = rng.normal(0.5, 2.0, (4, 3))  # BatchNorm1d: n = 4 values per channel
    n, eps = x.shape[0], 1e-5
    rm, rv = np.zeros(3), np.ones(3)
    y, _, _, _, new_rv = F.batch_norm_forward(x, rm, rv, training=True, momentum=0.1, eps=eps)
    tape = staged_forward("batch_norm", x, rm, rv, training=True, momentum=0.1, eps=eps)
    biased = tape["var"].reshape(-1)
    print(f"BatchNorm1d on input {x.shape}: n = {n} values per channel, eps = {eps:g}")
    print("\n1. Training normalizes with the biased batch variance var = Σ xc² / n (PyTorch, npnorm):")
    print(f"   var         = {_show(biased)}")
    print(f"   Σ xc²/(n-1) = {_show(np.var(x, axis=0, ddof=1))}")
    print(f"   variance of y per channel = var/(var + eps) ≈ 1: {_show(np.var(y, axis=0), 6)}")
    u = staged_normalize(x, 0, eps=eps, correction=1)
    print("\n2. Normalizing with Σ xc²/(n-1) instead (a common mistake; torch.var's default):")
    print(f"   variance of y per channel ≈ (n-1)/n = {(n - 1) / n:.3g}: {_show(np.var(u.output, axis=0), 6)}")
    print(
        f"   y_(n-1) / y = sqrt((n-1)/n) = {np.sqrt((n - 1) / n):.4f} up to eps: {_show((u.output / y)[0])}"
    )
    print("\n3. The running variance takes the unbiased batch variance var · n/(n-1):")
    print("   running_var ← (1 - momentum) · running_var + momentum · var · n/(n-1)")
    by_hand = 0.9 * rv + 0.1 * biased * n / (n - 1)
    staged_rv = tape.updates["running_var"]
    assert new_rv is not None
    print(f"   library {_show(new_rv, 6)}, staged {_show(staged_rv, 6)}, by hand {_show(by_hand, 6)}")
    var = np.var(np.random.default_rng(6).normal(0.0, 2.0, (4000, n)), axis=1)  # 4000 batches from N(0, 4)
    print(f"   why: over 4000 batches of {n} values from N(0, 4), the mean of var is {np.mean(var):.3f}")
    unbiased = np.mean(var) * n / (n - 1)
    print(f"   (≈ (n-1)/n · 4 = {(n - 1) / n * 4:g}); the mean of var · n/(n-1) is {unbiased:.3f}")
    print("   (≈ 4): eval normalizes with an unbiased estimate of the variance")
    dy = upstream(u.output.shape)
    grads = staged_backward(u, dy)
    rows = check_steps(u, grads)
    print("\n4. The n-1 graph's backward: only the local derivative of var changes, ∂var/∂xc = 2 xc/(n-1):")
    print(step_table(u, rows))
    right = check_terms(u, closed_form(u, grads["xhat"]), grad_output=dy)
    xhat, rstd = u["xhat"], u["rstd"]
    mixed = closed_form(u, grads["xhat"])
    mixed["var"] = -rstd * xhat * np.mean(grads["xhat"] * xhat, axis=0, keepdims=True)  # / n, as if biased
    wrong = check_terms(u, mixed, grad_output=dy)[-1]
    print(f"   term 3 with / (n-1): {'ok' if right[-1].ok else 'WRONG'}")
    verdict = "ok" if wrong.ok else "WRONG"
    print(f"   term 3 with / n (the biased closed form on the n-1 graph): {verdict}")
    print(f"      (max |term - finite differences| = {wrong.max_abs:.2e})")
    print(derivation("batch_norm_eval.md"))
    return all(r.ok for r in rows) and all(r.ok for r in right) and not wrong.ok


def check_exercise(exercise: Exercise, path: Path) -> bool:
    print(f"exercise {exercise.name}: {exercise.title}")
    shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
    print(f"file: {shown}   ({derivation(exercise.page)})")
    try:
        fn = load(path, exercise.function)
    except (Exception, SystemExit) as err:  # a syntax error in the learner's file, a missing function
        print(f"FAIL: could not load {exercise.function} from {path}: {type(err).__name__}: {err}")
        return False
    result = grade(exercise, fn)
    for i, each in enumerate(result.graded):
        print(f"graded on{' a second example' if i else ''}: {each.tape.description}\n")
        for r in each.rows:
            print(f"  {r}")
        if each.rows:
            print()
    print(result.message())
    return result.ok


def overview() -> None:
    print(USAGE)
    print("layers:", ", ".join(LAYERS), "(and sync_batch_norm, over simulated ranks)")
    print("exercises:", ", ".join(EXERCISES))
    # paths of the source repository: an installed package has no docs/ or exercises/
    print("the derivations: docs/derivations/README.md and the exercises: exercises/")
    print("(both in npnorm's source repository, not in an installed package)")


MAX_RANKS, MAX_SAMPLES = 64, 1_000_000  # --split's bounds


def _split(parser: argparse.ArgumentParser, text: str | None) -> tuple[int, ...]:
    """``--split 5,1,0``: samples per rank; two ranks at least, one sample at least, and a
    size that prints tables a reader can follow (every rank is a thread: 2000 ranks broke
    the threads' barrier after a minute, 1e11 samples asked for terabytes)."""
    if text is None:
        return SPLIT
    try:
        split = tuple(int(k) for k in text.split(","))
    except ValueError:
        parser.error(f"--split: expected samples per rank such as 5,1,0, got {text!r}")
    if len(split) < 2 or min(split) < 0 or sum(split) < 1:
        parser.error(f"--split: two ranks at least, counts >= 0, one sample at least; got {text!r}")
    if len(split) > MAX_RANKS or sum(split) > MAX_SAMPLES:
        parser.error(
            f"--split: at most {MAX_RANKS} ranks and {MAX_SAMPLES} samples in all (the tables are "
            f"for reading); got {len(split)} ranks and {sum(split)} samples"
        )
    return split


def _split_joined(argv: list[str]) -> list[str]:
    """``--split -1,3`` as ``--split=-1,3``: argparse takes a value that begins with "-"
    (but for a plain negative number) for an option, and said "expected one argument"
    instead of what a split must be."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        nxt = next(it, None) if arg == "--split" else None
        if nxt is not None and nxt.startswith("-") and nxt[1:2].isdigit():
            out.append(f"--split={nxt}")
        else:
            out += [arg] if nxt is None else [arg, nxt]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m npnorm learn",
        description="npnorm's layers as staged graphs, every step's gradient checked, and the exercises.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=USAGE,
    )
    parser.add_argument("topic", nargs="?", help=f"{', '.join(LAYERS)}, bessel, sync_batch_norm, or check")
    parser.add_argument("exercise", nargs="?", help="after check: an exercise name or file")
    parser.add_argument(
        "--staged-vs-closed", action="store_true", help="compare with the library's closed form"
    )
    parser.add_argument("--matrix", action="store_true", help="the matrix view dx = J · dxhat")
    parser.add_argument("--eval", action="store_true", help="running statistics (batch_norm, instance_norm)")
    parser.add_argument(
        "--groups", type=int, help="group_norm: number of groups of the 6 channels (1, 2, 3 or 6; default 3)"
    )
    parser.add_argument("--solution", action="store_true", help="check: grade exercises/solutions/NAME.py")
    parser.add_argument(
        "--split",
        help="sync_batch_norm: samples per simulated rank, e.g. 5,1,0 (default "
        + ",".join(map(str, SPLIT))
        + ")",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print nothing on standard output; the exit status tells"
    )
    args = parser.parse_intermixed_args(_split_joined(argv))  # (check --solution NAME as well)
    with contextlib.redirect_stdout(io.StringIO()) if args.quiet else contextlib.nullcontext():
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The topic ``args`` names (the overview without one); usage errors through ``parser``."""
    kw: dict[str, Any] = {"eval": args.eval, "groups": 3 if args.groups is None else args.groups}
    if args.topic is None:
        overview()
        return 0
    if args.topic == "check":
        if args.exercise is None:
            parser.error(f"check needs an exercise: one of {', '.join(EXERCISES)}")
        if (
            args.eval
            or args.staged_vs_closed
            or args.matrix
            or args.groups is not None
            or args.split is not None
        ):
            parser.error("check takes an exercise and --solution only")
        try:
            exercise, path = find(args.exercise, solution=args.solution)
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        return 0 if check_exercise(exercise, path) else 1
    if args.exercise is not None:
        parser.error(f"unexpected argument {args.exercise!r}")
    if args.solution:
        parser.error("--solution applies to check")
    if args.split is not None and args.topic != "sync_batch_norm":
        parser.error("--split applies to sync_batch_norm")
    if args.staged_vs_closed and args.matrix:
        parser.error("--staged-vs-closed and --matrix are two views: choose one")
    if args.topic == "bessel":
        if args.eval or args.staged_vs_closed or args.matrix or args.groups is not None:
            parser.error("bessel takes no options")
        return 0 if bessel() else 1
    if args.topic == "sync_batch_norm":
        if args.eval or args.staged_vs_closed or args.matrix or args.groups is not None:
            parser.error("sync_batch_norm takes --split only")
        from ._sync_tables import show_sync_batch_norm

        return 0 if show_sync_batch_norm(_split(parser, args.split)) else 1
    if args.topic not in LAYERS:
        parser.error(
            f"unknown topic {args.topic!r}: one of {', '.join(LAYERS)}, bessel, sync_batch_norm, check"
        )
    if args.eval and args.topic not in ("batch_norm", "instance_norm"):
        parser.error("--eval applies to batch_norm and instance_norm")
    if args.groups is not None and args.topic != "group_norm":
        parser.error("--groups applies to group_norm")
    if args.groups is not None and (args.groups < 1 or 6 % args.groups):
        parser.error(f"--groups must divide the 6 channels: 1, 2, 3 or 6 (got {args.groups})")
    if args.staged_vs_closed:
        return 0 if staged_vs_closed(args.topic, **kw) else 1
    if args.matrix:
        return 0 if show_matrix(args.topic, **kw) else 1
    return 0 if show_layer(args.topic, **kw) else 1
