"""Timings the review of the pending patch asked for, on a GPU: the fused kernels against the
generic ones (``use_kernels("reference")``) at the shapes where the patch's launches may
leave the GPU idle (a few long rows; GroupNorm with few (sample, channel) rows of many
values), functional forward+backward, float32, median of 7 calls timed with CUDA events after
2 untimed ones. Run after applying the patch, from the repository root:

    python tools/gpu_pending/extra_timings.py

Exit status 2 without CuPy or a GPU.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

try:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device")
except Exception as err:  # no CuPy, no driver, no device
    print(f"extra_timings: needs CuPy and a GPU ({type(err).__name__}: {err})", file=sys.stderr)
    sys.exit(2)

import npnorm
import npnorm.functional as F
from npnorm._gpu_bench import cupy_event_timer

ROWS = [(3, 300_000), (8, 65_536), (64, 16_384), (132, 8192), (4096, 8192)]  # (R, D) of LayerNorm
GROUPS = [((1, 3, 1024, 1024), 1), ((2, 32, 256, 256), 8), ((32, 64, 56, 56), 32)]  # GroupNorm


def median_ms(fn, rounds: int = 7) -> float:
    timed = cupy_event_timer(cupy)
    for _ in range(2):
        fn()
    return statistics.median(timed(fn)[0] for _ in range(rounds))


def both(fn) -> tuple[float, float]:
    fused = median_ms(fn)
    with npnorm.use_kernels("reference"):
        generic = median_ms(fn)
    return fused, generic


def main() -> int:
    rng = np.random.default_rng(0)
    print("| case | fused ms | generic ms | fused / generic |")
    print("|---|---|---|---|")
    for R, D in ROWS:
        x, dy = (cupy.asarray(rng.standard_normal((R, D)), dtype=cupy.float32) for _ in range(2))
        w = cupy.asarray(rng.standard_normal(D), dtype=cupy.float32)

        def layer_norm(x=x, dy=dy, w=w, D=D):
            _, mean, rstd = F.layer_norm_forward(x, D, w, w)
            return F.layer_norm_backward(dy, x, D, mean, rstd, w, w)

        fused, generic = both(layer_norm)
        print(f"| LayerNorm ({R}, {D}) | {fused:.3f} | {generic:.3f} | {fused / generic:.2f} |")
    for shape, groups in GROUPS:
        x, dy = (cupy.asarray(rng.standard_normal(shape), dtype=cupy.float32) for _ in range(2))
        w = cupy.asarray(rng.standard_normal(shape[1]), dtype=cupy.float32)

        def group_norm(x=x, dy=dy, w=w, groups=groups):
            _, mean, rstd = F.group_norm_forward(x, groups, w, w)
            return F.group_norm_backward(dy, x, groups, mean, rstd, w, w)

        fused, generic = both(group_norm)
        print(f"| GroupNorm {shape}, G={groups} | {fused:.3f} | {generic:.3f} | {fused / generic:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
