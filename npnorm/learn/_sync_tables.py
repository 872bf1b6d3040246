"""What ``python -m npnorm learn sync_batch_norm [--split 5,1,0]`` prints, section by
section as in docs/derivations/sync_batch_norm.md: SyncBatchNorm over simulated ranks
(``simulate_sync_batch_norm``), every exchange shown and every result compared with
BatchNorm on the concatenated batch, then the shortcuts' errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import functional as F
from ..functional._dispatch import generic_only
from . import sync_batch_norm as S
from ._pages import derivation
from .examples import example, upstream

TOL = 1e-12  # max |difference| <= TOL · (1 + max |BatchNorm's|), float64 (a sum against 0: its Σ |terms|)


def _rows(a: Any, precision: int = 4) -> str:
    return np.array2string(np.asarray(a, dtype=np.float64), precision=precision)


def _worst(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@dataclass
class _Checks:
    failed: list[str] = field(default_factory=list)

    def __call__(self, what: str, got: Any, want: Any, scale: float | None = None) -> str:
        """Compare, remember a failure, and say how far apart they are; ``scale`` is the
        size the rounding is relative to (``max |want|`` by default; a sum compared
        with 0 rounds relative to the sum of its terms' sizes, which grows with n)."""
        diff = _worst(got, want)
        if scale is None:
            scale = float(np.max(np.abs(np.asarray(want, dtype=np.float64))))
        ok = diff <= TOL * (1.0 + scale)
        if not ok:
            self.failed.append(what)
        return f"max |difference| {diff:.1e}" + ("" if ok else "  WRONG")


def show_sync_batch_norm(split: tuple[int, ...]) -> bool:
    """Print every table; True when every comparison with BatchNorm holds."""
    (x, rm, rv, w, b), _ = example("sync_batch_norm", split=split)
    dy = upstream(x.shape)
    momentum, eps = 0.1, 1e-5
    run = S.simulate_sync_batch_norm(x, dy, split, rm, rv, w, b, momentum, eps)
    with generic_only():
        generic = S.simulate_sync_batch_norm(x, dy, split, rm, rv, w, b, momentum, eps)
    y, mean, rstd, new_rm, new_rv = F.batch_norm_forward(x, rm, rv, w, b, True, momentum, eps)
    dx, dw, db = F.batch_norm_backward(dy, x, mean, rstd, w, b, True)
    ref = {"y": y, "mean": mean, "rstd": rstd, "running_mean": new_rm, "running_var": new_rv}
    ref.update(dx=dx, dweight=dw, dbias=db)
    check = _Checks()
    C = x.shape[1]
    cut, spatial = ",".join(map(str, split)), "·".join(map(str, x.shape[2:]))
    print(f"SyncBatchNorm over {len(split)} simulated ranks: the batch {x.shape} split {cut} along N")
    print(f"(rank r holds N_r samples, n_r = N_r·{spatial} values per channel).")
    print("Every rank is a thread running npnorm.functional.sync_batch_norm_forward and _backward on a")
    print(f"stand-in for an MPI communicator (npnorm._threadcomm); eps = {eps:g}, momentum = {momentum},")
    print(f"float64, channels 0..{C - 1}. The reference: BatchNorm (npnorm.functional.batch_norm_forward")
    print("and _backward) on the whole batch, in one process.")
    n, mean_g, m2 = _statistics(run, x, check)
    _forward(run, ref, check)
    _backward(run, generic, x, dy, w, ref, check)
    _cost(run, x)
    _shortcuts(run, n, mean_g, m2, eps)
    ok = not check.failed
    verdict = (
        "every comparison with BatchNorm on the whole batch holds"
        if ok
        else "WRONG: " + ", ".join(check.failed)
    )
    print(f"\n{verdict} (max |difference| <= {TOL:g} · (1 + max |BatchNorm's|))")
    print(derivation("sync_batch_norm.md"))
    return ok


def _statistics(run: S.SyncRun, x: np.ndarray, check: _Checks) -> S.Stats:
    """Sections 1 and 2: what each rank sends, the merge, the merged statistics."""
    C, axes, stats = run.channels, (0, *range(2, x.ndim)), run.stats
    print(
        "\n1. Each rank's statistics, two-pass on its own slice, as it sends them (the forward's allgather):"
    )
    print(f"   {'rank':>4} {'N_r':>4} {'n_r':>4}  {'mean_r':<30} M2_r = Σ (x - mean_r)²")
    for r, row in enumerate(stats):
        if row[0] == 0:
            print(
                f"   {r:>4} {run.split[r]:>4} {0:>4}  (an empty rank: it sends n_r = 0; the merge skips it)"
            )
        else:
            mean_r, m2_r = _rows(row[1 : 1 + C]), _rows(row[1 + C :])
            print(f"   {r:>4} {run.split[r]:>4} {int(row[0]):>4}  {mean_r:<30} {m2_r}")
    by_hand = np.array([np.concatenate([[n], m, m2]) for n, m, m2 in map(S.rank_moments, run.parts)])
    print(f"   by hand (Σ x / n_r, Σ (x - mean_r)² on each slice): {check('per rank', stats, by_hand)}")

    print("\n2. Chan's merge in rank order, channel 0 (every rank merges the same gathered bytes):")
    head = f"{'rank':>4} {'n_a':>4} {'n_b':>4} {'n':>4}  {'δ = mean_b - mean_a':>20} {'mean':>9}"
    print(f"   {head} {'δ²·n_a·n_b/n':>13} {'M2':>9}")
    n_a, mean_a = 0.0, 0.0
    steps = S.merge_steps(stats)
    for r, (row, (n, mean, m2)) in enumerate(zip(stats, steps, strict=True)):
        n_b = float(row[0])
        if n_b == 0:
            print(f"   {r:>4} {int(n_a):>4} {0:>4} {int(n):>4}  (skipped: an empty rank's mean is 0/0)")
            continue
        delta = float(row[1]) - mean_a
        spread = delta * delta * n_a * n_b / n
        cells = f"{int(n_a):>4} {int(n_b):>4} {int(n):>4}  {delta:>20.4f} {mean[0]:>9.4f}"
        print(f"   {r:>4} {cells} {spread:>13.4f} {m2[0]:>9.4f}")
        n_a, mean_a = n, float(mean[0])
    print("   (from n_a = 0, the first non-empty rank's mean_b and M2_b come through exactly)")
    n, mean, m2 = steps[-1]
    print(f"   merged, against the statistics of the concatenated batch (n = {int(n)} values per channel):")
    print(
        f"     mean       = {_rows(mean):<26} vs Σ x / n            {check('mean', mean, x.mean(axis=axes))}"
    )
    var, unbiased = (
        check("var", m2 / n, x.var(axis=axes)),
        check("M2/(n-1)", m2 / (n - 1), x.var(axis=axes, ddof=1)),
    )
    print(f"     M2/n       = {_rows(m2 / n):<26} vs np.var(x)          {var}")
    print(f"     M2/(n - 1) = {_rows(m2 / (n - 1)):<26} vs np.var(x, ddof=1) {unbiased}")
    keys = ("mean", "rstd", "running_mean", "running_var")
    same = all(np.array_equal(getattr(r, k), getattr(run.ranks[0], k)) for r in run.ranks for k in keys)
    print(f"   mean, rstd and the running buffers bitwise the same on every rank: {same}")
    if not same:
        check.failed.append("bitwise the same on every rank")
    return n, mean, m2


def _forward(run: S.SyncRun, ref: dict[str, Any], check: _Checks) -> None:
    """Section 3: the output and the running buffers."""
    print(
        "\n3. The forward on each rank's slice, with the global statistics, against BatchNorm on the batch:"
    )
    first = run.ranks[0]
    print(f"   y (concatenated over ranks)      {check('y', run.output, ref['y'])}")
    print(f"   rstd = 1 / sqrt(M2/n + eps)      {check('rstd', first.rstd, ref['rstd'])}")
    for name, label in (("running_mean", "running_mean"), ("running_var", "running_var (takes M2/(n - 1))")):
        print(f"   {label:<32} {check(name, getattr(first, name), ref[name])}")


def _backward(
    run: S.SyncRun,
    generic: S.SyncRun,
    x: np.ndarray,
    dy: np.ndarray,
    w: np.ndarray,
    ref: dict[str, Any],
    check: _Checks,
) -> None:
    """Section 4: the all-reduced sums, the global means, dx, dweight and dbias."""
    C, axes, sums = run.channels, (0, *range(2, x.ndim)), run.sums
    print("\n4. The backward. What each rank sends, per channel (the one all-reduce, float64):")
    print(f"   {'rank':>4} {'n_r':>4}  {'Σ dy':<30} {'Σ dy · (x - mean)':<30} Σ (x - mean)")
    for r, row in enumerate(sums):
        cols = (_rows(row[2 + k * C : 2 + (k + 1) * C]) for k in range(3))
        print(f"   {r:>4} {int(row[1]):>4}  " + "{:<30} {:<30} {}".format(*cols))
    total = sums.sum(axis=0)
    s1, s2, s3 = (total[2 + k * C : 2 + (k + 1) * C] for k in range(3))  # C each
    print(
        f"   {'sum':>4} {int(total[1]):>4}  {_rows(s1):<30} {_rows(s2):<30} |·| <= {np.max(np.abs(s3)):.1e}"
    )
    mean, rstd = run.ranks[0].mean, run.ranks[0].rstd
    parts = zip(run.parts, S.split_batch(dy, run.split), strict=True)
    by_hand = [np.concatenate([[0, p.size // C], *S.rank_sums(d, p, mean)]) for p, d in parts]
    print(f"   by hand (the sums over each slice): {check('sums', sums, np.array(by_hand))}")
    n = total[1]
    mean_dxhat = w * s1 / n  # C
    mean_dxhat_xhat = w * rstd * s2 / n  # C
    print(f"   mean_G(dxhat)        = w · Σ_G dy / n                     = {_rows(mean_dxhat)}")
    print(f"   mean_G(dxhat · xhat) = w · rstd · Σ_G dy · (x - mean) / n = {_rows(mean_dxhat_xhat)}")
    view = (1, -1) + (1,) * (x.ndim - 2)
    dxhat, xhat = dy * w.reshape(view), (x - mean.reshape(view)) * rstd.reshape(view)
    want = [dxhat.mean(axis=axes), (dxhat * xhat).mean(axis=axes)]
    means = check("means", [mean_dxhat, mean_dxhat_xhat], want)
    print(f"     against the means over the concatenated batch: {means}")
    print("   Σ_G (x - mean) is 0 but for the rounding of the saved mean (float64 here); dx centres")
    print("   xhat on it first, which matters in float32 with a large common offset (BatchNorm's too)")
    print(
        "   dx = rstd · (dxhat - mean_G(dxhat) - xhat · mean_G(dxhat · xhat)) on each slice, vs BatchNorm's:"
    )
    print(f"     default (fast NumPy) kernels   {check('dx', run.grad_input, ref['dx'])}")
    print(f"     generic kernels                {check('dx (generic)', generic.grad_input, ref['dx'])}")
    per_rank = [np.sum(r.dx, axis=axes) for r in run.ranks if r.dx.size]
    print("   Σ dx over each non-empty rank's slice: " + ", ".join(_rows(s, 2) for s in per_rank))
    size = float(np.max(sum(np.sum(np.abs(r.dx), axis=axes) for r in run.ranks)))  # Σ_G |dx|
    total = check("Σ_G dx", np.sum(per_rank, axis=0), 0.0, scale=size)
    print(f"     and over every rank, Σ_G dx against 0 (relative to Σ_G |dx|): {total}")
    print("   dweight = Σ dy · xhat and dbias = Σ dy: each rank returns the sums over its own slice")
    for r, rank in enumerate(run.ranks):
        print(f"     rank {r}: dweight {_rows(rank.dweight):<28} dbias {_rows(rank.dbias)}")
    dweight = check("dweight", run.grad_param("weight"), ref["dweight"])
    dbias = check("dbias", run.grad_param("bias"), ref["dbias"])
    print(f"     summed over ranks: dweight vs BatchNorm's {dweight}")
    print(f"                        dbias vs BatchNorm's   {dbias}")
    print(
        f"     (all-reduced by the layer, then summed by the optimizer: {len(run.split)} times BatchNorm's)"
    )


def _cost(run: S.SyncRun, x: np.ndarray) -> None:
    """Section 5: the collective calls of one training step and their sizes."""
    print("\n5. What crossed the ranks in this training step (every rank sends the same sizes):")
    what = [
        "forward:  ok flag, C, n_r, dtype (errors raised on every rank)",
        "forward:  n_r, mean_r (C), M2_r (C)",
        "backward: ok flag, C (the ranks' checks and channel counts, before the sums)",
        "backward: failed flag, n_r, Σ dy (C), Σ dy · (x - mean) (C), Σ (x - mean) (C)",
    ]
    for e, text in zip(run.log, what, strict=True):
        sent = np.asarray(e.sent[0])
        print(f"   {e.kind:<9}  {f'{sent.size} {sent.dtype} = {sent.nbytes} B':<18} per rank   {text}")
    C = run.channels
    print(
        f"   {len(run.log)} collective calls, sized by C = {C}, not by the {x.size // C} values per channel"
    )


def _shortcuts(run: S.SyncRun, n: float, mean: np.ndarray, m2: np.ndarray, eps: float) -> None:
    """Section 6: the common shortcuts, each against the right statistics."""
    P, split = len(run.split), run.split
    print("\n6. The shortcuts, against the right statistics:")
    nonempty = [p for p in run.parts if p.size]
    m_u, v_u = S.uncounted_mean(nonempty)
    print("   a. the ranks' means (and mean squares) averaged without their counts, (1/P) Σ_r mean_r")
    print("      (Flax's lax.pmean, ChainerMN's Allreduce / size); this split, its non-empty ranks:")
    print(f"      mean {_rows(m_u):<28} instead of {_rows(mean):<28} max |error| {_worst(m_u, mean):.2e}")
    print(f"      var  {_rows(v_u):<28} instead of {_rows(m2 / n):<28} max |error| {_worst(v_u, m2 / n):.2e}")
    if len({p.shape[0] for p in nonempty}) == 1:
        print("      (the non-empty ranks hold equal counts: then, and only then, the average is right)")
    if len(nonempty) < P:
        poisoned = _rows(S.uncounted_mean(run.parts)[0])
        print(f"      with the empty rank in the average (its mean: 0/0): mean {poisoned}")
    print("   b. Bessel's correction with the rank's own count, n_r / max(n_r - 1, 1) (ChainerMN),")
    print(f"      not n / (n - 1) = {n / (n - 1):.4f} (n = {int(n)}); the running variance each rank takes:")
    for r, n_r in enumerate(run.stats[:, 0]):
        if n_r == 0:
            print(f"      rank {r}: n_r = {0:>3}  (empty: its own statistics are 0/0)")
            continue
        factor = S.local_bessel(float(n_r))
        error = 100 * (factor / (n / (n - 1)) - 1)
        print(
            f"      rank {r}: n_r = {int(n_r):>3}, factor {factor:.4f}: running_var's increment {error:+.1f}%"
        )
    if len({int(n_r) for n_r in run.stats[:, 0] if n_r}) > 1:
        print("      (and the ranks' buffers disagree: in eval each rank runs a different model)")
    rng = np.random.default_rng(7)
    std = np.array([1e-4, 1e-5, 1e-6])
    tiny = (rng.standard_normal((sum(split), 3, 2, 2)) * std.reshape(1, 3, 1, 1)).astype(np.float32)
    print(
        "   c. invstd_r = 1/sqrt(var_r + eps) sent instead of M2_r, and var_r = 1/invstd_r² - eps recovered"
    )
    stds = ", ".join(f"{s:g}" for s in std)
    print(f"      (PyTorch's SyncBatchNorm); float32, eps = {eps:g}, channels of std {stds} around 0:")
    ours, theirs = _relative_errors(tiny, split, lambda parts: S.variance_from_invstd(parts, eps, np.float32))
    print(f"      relative error of the variance: npnorm (M2_r, two-pass) {_rows(ours, 1)}")
    print(f"                                      from invstd            {_rows(theirs, 1)}")
    print("      (rstd = 1/sqrt(var + eps) hardly moves; the running variance of such a channel does)")
    offset = np.array([0.0, 1e2, 1e3, 1e4])
    big = (rng.standard_normal((sum(split), 4, 2, 2)) + offset.reshape(1, 4, 1, 1)).astype(np.float32)
    print("   d. one pass: Σ x and Σ x² all-reduced, var = Σ x²/n - mean² (Keras's SyncBatchNormalization,")
    offsets = ", ".join(f"{o:g}" for o in offset)
    print(f"      Flax's default use_fast_variance, ChainerMN); float32, channels of std 1 around {offsets}:")
    ours, theirs = _relative_errors(big, split, lambda parts: S.one_pass_variance(parts, np.float32))
    print(f"      relative error of the variance: npnorm (two-pass, merged) {_rows(ours, 1)}")
    print(f"                                      one pass                {_rows(theirs, 1)}")


def _relative_errors(x: np.ndarray, split: tuple[int, ...], shortcut: Any) -> tuple[np.ndarray, np.ndarray]:
    """The relative error of the global biased variance of float32 ``x``: npnorm's (the
    library's SyncBatchNorm on ``split``), and ``shortcut``'s, against float64 two-pass."""
    exact = x.astype(np.float64).var(axis=(0, *range(2, x.ndim)))  # C
    run = S.simulate_sync_batch_norm(x, np.ones_like(x), split)
    n, _, m2 = S.merge_steps(run.stats)[-1]
    return m2 / n / exact - 1, shortcut(S.split_batch(x, split)) / exact - 1
