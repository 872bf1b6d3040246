#!/usr/bin/env python
"""Sensitivity check of check.py: each mutant is npnorm/kernels/cupy_fused.py with one
launch-logic bug (a text replacement, in memory only), run through check.py in a subprocess;
every mutant must FAIL there ("caught"). The harmless variants (the unchanged source, and
other partitions of the same work) must pass ("harmless"), so that a caught mutant is
caught for its own change.

    . .venv/bin/activate && python tools/cupy_stand_in/mutants.py [--cases N] [--jobs J]

A variant whose text is no longer in cupy_fused.py is reported "n/a" and fails the run
(the list must follow the source: update its texts). A variant with a ``when`` text runs
only where the source holds that text (the kernels it needs exist), else is "skipped".
Exit 0 when every mutant was caught and every harmless variant passed.
tests/test_cupy_stand_in.py runs it in CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
SOURCE = os.path.join(REPO, "npnorm", "kernels", "cupy_fused.py")


class Variant(NamedTuple):
    name: str
    old: str  # text of cupy_fused.py ("" with new "": the source unchanged)
    new: str  # its replacement (the first occurrence)
    ops: str  # the ops check.py runs (comma-separated; "": every op cupy_fused registers)
    when: str = ""  # a text the source must hold for the variant to apply (else skipped)


HARMLESS = [
    Variant("unchanged source", "", "", ""),  # every op cupy_fused registers
    Variant(
        "split kn/ks swapped",
        "    return kn, ks\n",
        "    return ks, kn\n",
        "batch_norm_forward,instance_norm_forward",
    ),
    Variant(
        "channel_sums Kn/Ks args swapped",
        "np.int32(kn), np.int32(ks), np.int32(mode)",
        "np.int32(ks), np.int32(kn), np.int32(mode)",
        "batch_norm_forward,batch_norm_backward",
    ),
    Variant(
        "channel_sums Kn = 1",
        "np.int32(kn), np.int32(ks), np.int32(mode)",
        "np.int32(1), np.int32(ks), np.int32(mode)",
        "batch_norm_forward,instance_norm_backward",
    ),
    Variant(
        "rows_backward blocks not capped at R (idle blocks)",
        "blocks = max(1, min(R, per_sm * _sm_count()))",
        "blocks = max(1, per_sm * _sm_count())",
        "layer_norm_backward,rms_norm_backward",
    ),
]

MUTANTS = [
    Variant(
        "channel_sums grid one block short",
        "        (kn * ks, C),\n",
        "        (max(1, kn * ks - 1), C),\n",
        "batch_norm_forward,batch_norm_backward",
    ),
    Variant(
        "channel_finish K - 1",
        "(p1, p2, p3, p4, np.int32(K), np.float64(count)",
        "(p1, p2, p3, p4, np.int32(max(1, K - 1)), np.float64(count)",
        "batch_norm_forward,batch_norm_backward",
    ),
    Variant(
        "finish count n*S -> S",
        "_finish(ct, _channel_partials(x, 0), 0, n * S,",
        "_finish(ct, _channel_partials(x, 0), 0, S,",
        "batch_norm_forward",
    ),
    Variant(
        "channel_apply Cs/C swapped",
        "np.int64(n * Cs), np.int64(Cs), np.int64(C), np.int64(S),",
        "np.int64(n * Cs), np.int64(C), np.int64(Cs), np.int64(S),",
        "instance_norm_forward",
    ),
    Variant(
        "channel_dx one row short",
        "(dy, x, m, r, coef, dx, np.int64(n * Cs),",
        "(dy, x, m, r, coef, dx, np.int64(n * Cs - 1),",
        "batch_norm_backward",
    ),
    Variant(
        "instance running variance biased",
        "sum(axis=0) / N * (S / (S - 1))",
        "sum(axis=0) / N",
        "instance_norm_forward",
    ),
    Variant(
        "rows_backward need_pw/need_pb swapped",
        "np.int32(weight is not None), np.int32(weight is not None), np.int32(need_dbias)),",
        "np.int32(weight is not None), np.int32(need_dbias), np.int32(weight is not None)),",
        "layer_norm_backward",
    ),
    Variant(
        "rows_forward D as int64",
        "y, mean, rstd, np.int64(R), np.int32(D), np.float64(eps),",
        "y, mean, rstd, np.int64(R), np.int64(D), np.float64(eps),",
        "layer_norm_forward",
    ),
    Variant(
        "rows threads one warp short",
        "return min(max_threads, max(32, 32 * math.ceil(math.ceil(D / kmax) / 32)))",
        "return min(max_threads, max(32, 32 * math.ceil(math.ceil(D / kmax) / 32) - 32))",
        "layer_norm_forward",
    ),
    Variant(
        "ROW_LIMIT past the short kernels' capacity",
        "ROW_LIMIT = 4096",
        "ROW_LIMIT = 4100",
        "layer_norm_forward,rms_norm_backward",
    ),
    Variant(
        "partials one block short",
        "pw, pb = cupy.empty((2, blocks, D), dtype=cupy.float64) if need",
        "pw, pb = cupy.empty((2, max(1, blocks - 1), D), dtype=cupy.float64) if need",
        "layer_norm_backward",
    ),
    Variant(
        "column_sums B = 1",
        "(pw, pb, dw, db, np.int64(blocks), np.int64(D),",
        "(pw, pb, dw, db, np.int64(1), np.int64(D),",
        "layer_norm_backward,rms_norm_backward",
    ),
    Variant(
        "affine flags swapped",
        "y = _affine(weight is not None, bias is not None)(",
        "y = _affine(bias is not None, weight is not None)(",
        "batch_norm_forward",
    ),
    Variant("momentum 1 - m", '"momentum": momentum,', '"momentum": 1.0 - momentum,', "batch_norm_forward"),
    Variant(
        "channel_dx training always",
        "np.int64(S), np.int32(training)),",
        "np.int64(S), np.int32(True)),",
        "batch_norm_backward",
    ),
    Variant(
        "rows_fit: empty input to the kernels (a grid of 0 blocks)",
        "return input.size > 0 and D <= ROW_LIMIT",
        "return D <= ROW_LIMIT",
        "layer_norm_forward",
    ),
    Variant(
        "channels_fit: N = 0 to the kernels",
        "return N > 0 and 0 < C <= 65535 and S >= MIN_SPATIAL",
        "return 0 < C <= 65535 and S >= MIN_SPATIAL",
        "batch_norm_forward",
    ),
    Variant(
        "instances_fit: C, not N * C, bounded by the grid's second axis",
        "return 0 < N * C <= 65535 and S >= MIN_SPATIAL",
        "return N > 0 and 0 < C <= 65535 and S >= MIN_SPATIAL",
        "instance_norm_forward",
    ),
    Variant(
        "InstanceNorm's dweight not centred again (less_centre skipped)",
        "sdyx = less_centre(xp, sdyx, sxh / S, sdy)",
        "sdyx = sdyx + 0 * less_centre(xp, sdyx, sxh / S, sdy)",
        "instance_norm_backward",
    ),
    Variant(
        "evaluation mean: the caller's running_mean returned",
        "mean = running_mean.astype(ct, copy=True)",
        "mean = running_mean.astype(ct, copy=False)",
        "batch_norm_forward",
    ),
    Variant(
        "CUDA source edited (stale emulation)",
        "dr[s] = (T)((S)gr[s] * scale);",
        "dr[s] = (T)((S)gr[s] * scale * 2.0);",
        "batch_norm_backward",
    ),
    # for the kernels not on main yet (long rows, GroupNorm): skipped where the source lacks them
    Variant(
        "long rows last chunk dropped",
        "B = math.ceil(R / chunk)",
        "B = max(1, math.ceil(R / chunk) - 1)",
        "layer_norm_backward,rms_norm_backward",
        when="rows_backward_long",
    ),
    Variant(
        "gn rows repeat per -> 1",
        "rows = cupy.repeat(stats[:2], per, axis=1)",
        "rows = cupy.repeat(stats[:2], 1, axis=1)",
        "group_norm_forward",
        when="group_norm_forward",
    ),
    Variant(
        "gn backward per-group means over C",
        "means = sums.reshape(3, N, G, per).sum(axis=3) / (per * S)",
        "means = sums.reshape(3, N, G, per).sum(axis=3) / (C * S)",
        "group_norm_backward",
        when="group_norm_backward",
    ),
]

RUNNER = r"""
import sys, types
sys.path.insert(0, {here!r})
sys.path.insert(1, {repo!r})
import cupy
assert getattr(cupy, "STANDIN", False), f"imported a real cupy from {{cupy.__file__}}, not the stand-in"
import npnorm.kernels
src = open({source!r}).read()
if {old!r}:
    src = src.replace({old!r}, {new!r}, 1)
mod = types.ModuleType("npnorm.kernels.cupy_fused")
mod.__package__ = "npnorm.kernels"
mod.__file__ = {source!r}
sys.modules[mod.__name__] = mod
exec(compile(src, {source!r}, "exec"), mod.__dict__)
npnorm.kernels.cupy_fused = mod
import check
sys.exit(check.main(["--cases", {cases!r}, "--ops", {ops!r}, "--show", "1"]))
"""


def run(v: Variant, cases: str) -> subprocess.CompletedProcess[str]:
    code = RUNNER.format(here=HERE, repo=REPO, source=SOURCE, old=v.old, new=v.new, cases=cases, ops=v.ops)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=80, help="check.py's cases per op (default 80)")
    ap.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="variants run at once (default: CPUs)"
    )
    args = ap.parse_args(argv)
    src = open(SOURCE).read()
    todo: list[tuple[bool, Variant]] = []
    wrong = 0
    for harmless, v in [(True, v) for v in HARMLESS] + [(False, v) for v in MUTANTS]:
        if v.when and v.when not in src:
            print(f"skipped  {v.name}: the source has no {v.when}")
        elif v.old not in src:
            print(f"n/a      {v.name}: its text is no longer in cupy_fused.py (update the list)")
            wrong += 1
        else:
            todo.append((harmless, v))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda t: run(t[1], str(args.cases)), todo))
    for (harmless, v), r in zip(todo, results, strict=True):
        fail = next((ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")), "")
        first = fail[:160] or (r.stderr.strip().splitlines() or [""])[-1][:160]
        if harmless and r.returncode == 0:
            print(f"harmless {v.name}: passed")
        elif harmless:
            wrong += 1
            print(f"WRONG    {v.name}: a harmless variant failed (exit {r.returncode}): {first}")
        elif r.returncode == 1 and fail:
            print(f"caught   {v.name}: {first}")
        else:  # passed, or check.py itself broke (an import error, a crash: no FAIL line)
            wrong += 1
            why = "passed" if r.returncode == 0 else f"exit {r.returncode}, not check.py's failure: {first}"
            print(f"MISSED   {v.name}: {why}")
    n_mut = sum(not h for h, _ in todo)
    print(
        f"{len(todo) - n_mut} harmless variants, {n_mut} mutants: "
        + ("every mutant caught, every harmless variant passed" if not wrong else f"{wrong} wrong")
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
