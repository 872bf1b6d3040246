"""``python -m npnorm bench``: time every layer against the alternatives and the memory roofline.

For each layer at standard shapes (float32) it prints the median forward, backward and
forward+backward times of npnorm's default (fast) kernels, npnorm's generic Array API
kernels, the textbook NumPy formulas and, when installed, PyTorch on the CPU; the
machine's copy bandwidth (``np.copyto`` of the same array) and each row's fraction of
the memory roofline it implies (forward reads x and writes y: one copy's traffic;
forward+backward: 2.5 copies); and the peak traced memory (tracemalloc) of
forward+backward, beyond the returned arrays, as a multiple of the input's size. All
ratios come from one run, in one process. Timings are figures to read, not assertions.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _textbook as textbook
from ._threads import get_num_threads
from .functional._dispatch import generic_only
from .modules import BatchNorm2d, GroupNorm, InstanceNorm2d, LayerNorm, Module, RMSNorm

EPS = 1e-5

# targets from the fast-path issue: forward+backward time as a multiple of PyTorch's
TARGET_VS_TORCH = {
    "LayerNorm": 0.6,
    "RMSNorm": 0.3,
    "BatchNorm2d": 1.0,
    "InstanceNorm2d": 1.0,
    "GroupNorm": 1.5,
}
TARGET_ROOFLINE = 0.30
TARGET_EXTRA_MEMORY = 0.25


@dataclass(frozen=True)
class Spec:
    layer: str
    shape: tuple[int, ...]


FULL = [
    Spec("LayerNorm", (32, 512, 768)),
    Spec("LayerNorm", (8, 2048, 4096)),
    Spec("RMSNorm", (32, 512, 768)),
    Spec("RMSNorm", (8, 2048, 4096)),
    Spec("BatchNorm2d", (32, 64, 56, 56)),
    Spec("GroupNorm", (32, 64, 56, 56)),
    Spec("InstanceNorm2d", (32, 64, 56, 56)),
]
QUICK = [
    Spec("LayerNorm", (8, 128, 768)),
    Spec("RMSNorm", (8, 128, 768)),
    Spec("BatchNorm2d", (8, 64, 28, 28)),
    Spec("GroupNorm", (8, 64, 28, 28)),
    Spec("InstanceNorm2d", (8, 64, 28, 28)),
]


def _ours(spec: Spec) -> Module:
    c = spec.shape[-1] if spec.layer in ("LayerNorm", "RMSNorm") else spec.shape[1]
    return {
        "LayerNorm": lambda: LayerNorm(c),
        "RMSNorm": lambda: RMSNorm(c),
        "BatchNorm2d": lambda: BatchNorm2d(c),
        "GroupNorm": lambda: GroupNorm(32, c),
        "InstanceNorm2d": lambda: InstanceNorm2d(c),
    }[spec.layer]()


def _torch_module(torch: Any, spec: Spec) -> Any:
    c = spec.shape[-1] if spec.layer in ("LayerNorm", "RMSNorm") else spec.shape[1]
    return {
        "LayerNorm": lambda: torch.nn.LayerNorm(c),
        "RMSNorm": lambda: torch.nn.RMSNorm(c),
        "BatchNorm2d": lambda: torch.nn.BatchNorm2d(c),
        "GroupNorm": lambda: torch.nn.GroupNorm(32, c),
        "InstanceNorm2d": lambda: torch.nn.InstanceNorm2d(c),
    }[spec.layer]()


def _textbook_pair(spec: Spec) -> tuple[Callable[[np.ndarray], Any], Callable[[np.ndarray, Any], Any]]:
    """(forward, backward) written as the textbook formulas, with the layer's parameters."""
    shape = spec.shape
    if spec.layer in ("LayerNorm", "RMSNorm"):
        d, center = shape[-1], spec.layer == "LayerNorm"
        gamma = np.ones(d, np.float32)
        beta = np.zeros(d, np.float32) if center else None
        axes, paxes = (len(shape) - 1,), tuple(range(len(shape) - 1))
        return (
            lambda x: textbook.forward(x, axes, gamma, beta, EPS, center),
            lambda dy, cache: textbook.backward(dy, cache[1], axes, gamma, paxes, center),
        )
    c = shape[1]
    gamma4 = np.ones((1, c, 1, 1), np.float32)
    beta4 = np.zeros((1, c, 1, 1), np.float32)
    if spec.layer == "BatchNorm2d":
        return (
            lambda x: textbook.forward(x, (0, 2, 3), gamma4, beta4, EPS),
            lambda dy, cache: textbook.backward(dy, cache[1], (0, 2, 3), gamma4, (0, 2, 3)),
        )
    if spec.layer == "InstanceNorm2d":  # affine=False by default, as in PyTorch
        return (
            lambda x: textbook.forward(x, (2, 3), None, None, EPS),
            lambda dy, cache: textbook.backward(dy, cache[1], (2, 3), None, (0, 2, 3)),
        )
    groups = 32

    def gn_forward(x: np.ndarray) -> Any:
        xg = x.reshape(x.shape[0], groups, -1)
        yg, cache = textbook.forward(xg, (2,), None, None, EPS)
        return yg.reshape(x.shape) * gamma4 + beta4, cache

    def gn_backward(dy: np.ndarray, out: Any) -> Any:
        cache = out[1]
        xhat = cache[3].reshape(dy.shape)
        dgamma, dbeta = (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))
        dxhat = (dy * gamma4).reshape(dy.shape[0], groups, -1)
        dx, _, _ = textbook.backward(dxhat, cache, (2,), None, (0,))
        return dx.reshape(dy.shape), dgamma, dbeta

    return gn_forward, gn_backward


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _peak_extra(fb: Callable[[], Any], input_bytes: int) -> float:
    """Peak traced memory of one forward+backward beyond the arrays it returns, x input size."""
    gc.collect()
    tracemalloc.start()
    try:
        returned = fb()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = sum(a.nbytes for a in returned if isinstance(a, np.ndarray))
    return (peak - kept) / input_bytes


def _time_npnorm(spec: Spec, x: np.ndarray, dy: np.ndarray, reps: int) -> dict[str, float]:
    m = _ours(spec)

    def fb() -> tuple[np.ndarray, ...]:
        y = m(x)
        return y, m.backward(dy), *m.grads.values()

    out = {"fwd": _median_ms(lambda: m(x), reps)}
    m(x)
    out["bwd"] = _median_ms(lambda: m.backward(dy), reps)
    out["fb"] = _median_ms(fb, reps)
    m.zero_grad()
    del m.grads  # measure without the accumulated grads
    m.grads = {}
    out["mem"] = _peak_extra(fb, x.nbytes)
    return out


def _time_textbook(spec: Spec, x: np.ndarray, dy: np.ndarray, reps: int) -> dict[str, float]:
    fwd, bwd = _textbook_pair(spec)
    out = {"fwd": _median_ms(lambda: fwd(x), reps)}
    saved = fwd(x)
    out["bwd"] = _median_ms(lambda: bwd(dy, saved), reps)

    def fb() -> tuple[np.ndarray, ...]:
        y = fwd(x)
        return (y[0], *bwd(dy, y))

    out["fb"] = _median_ms(fb, reps)
    out["mem"] = _peak_extra(fb, x.nbytes)
    return out


def _time_torch(torch: Any, spec: Spec, x: np.ndarray, dy: np.ndarray, reps: int) -> dict[str, float]:
    m = _torch_module(torch, spec)
    xt = torch.from_numpy(x).requires_grad_(True)
    dyt = torch.from_numpy(dy)

    def fwd() -> Any:
        return m(xt)

    out = {"fwd": _median_ms(fwd, reps)}
    y = m(xt)

    def bwd() -> None:
        xt.grad = None
        y.backward(dyt, retain_graph=True)

    out["bwd"] = _median_ms(bwd, reps)

    def fb() -> None:
        xt.grad = None
        m(xt).backward(dyt)

    out["fb"] = _median_ms(fb, reps)
    return out


def _copy_ms(x: np.ndarray, reps: int) -> float:
    """Median time of copying ``x`` into a preallocated array: the memory roofline's unit."""
    scratch = np.empty_like(x)
    return _median_ms(lambda: np.copyto(scratch, x), reps)


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cpus, "numpy": np.__version__, "python": platform.python_version()}


def run(quick: bool = False, reps: int | None = None, json_path: str | None = None) -> list[dict[str, Any]]:
    specs = QUICK if quick else FULL
    reps = reps or (3 if quick else 5)
    torch: Any = None
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
    info = machine()
    info["npnorm_threads"] = get_num_threads()
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for spec in specs:
        x = rng.standard_normal(spec.shape, dtype=np.float32)
        dy = rng.standard_normal(spec.shape, dtype=np.float32)
        copy_ms = _copy_ms(x, reps)
        results = {"npnorm fast": _time_npnorm(spec, x, dy, reps)}
        with generic_only():
            results["npnorm generic"] = _time_npnorm(spec, x, dy, reps)
        results["textbook"] = _time_textbook(spec, x, dy, reps)
        if torch is not None:
            results["torch"] = _time_torch(torch, spec, x, dy, reps)
        for impl, r in results.items():
            row = {
                "layer": spec.layer,
                "shape": list(spec.shape),
                "impl": impl,
                "fwd_ms": r["fwd"],
                "bwd_ms": r["bwd"],
                "fb_ms": r["fb"],
                "copy_ms": copy_ms,
                "copy_GBps": 2 * x.nbytes / copy_ms / 1e6,
                "roofline_fwd": copy_ms / r["fwd"],
                "roofline_fb": 2.5 * copy_ms / r["fb"],
                "extra_memory_x_input": r.get("mem"),
                "fb_vs_torch": r["fb"] / results["torch"]["fb"] if torch is not None else None,
            }
            rows.append(row)
        _print_rows(rows[-len(results) :], spec)
    _print_targets(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": info, "quick": quick, "reps": reps, "rows": rows}, f, indent=1)
        print(f"figures saved to {json_path}")
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_rows(rows: list[dict[str, Any]], spec: Spec) -> None:
    first = rows[0]
    print(
        f"\n{spec.layer} {tuple(spec.shape)} float32   copy {first['copy_ms']:.2f} ms "
        f"({first['copy_GBps']:.1f} GB/s read+write)"
    )
    header = f"  {'impl':15} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b/torch':>9} "
    header += f"{'roof fwd':>8} {'roof f+b':>8} {'extra mem':>9}"
    print(header)
    for r in rows:
        mem = r["extra_memory_x_input"]
        print(
            f"  {r['impl']:15} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['fb_ms']:8.2f} "
            f"{_fmt(r['fb_vs_torch'], '9.2f')} {r['roofline_fwd']:8.0%} {r['roofline_fb']:8.0%} "
            f"{'-' if mem is None else format(mem, '8.2f') + 'x'}"
        )


def _print_targets(rows: list[dict[str, Any]]) -> None:
    print("\ntargets for npnorm fast (forward+backward):")
    for r in rows:
        if r["impl"] != "npnorm fast":
            continue
        target = TARGET_VS_TORCH[r["layer"]]
        checks = []
        if r["fb_vs_torch"] is not None:
            ok = r["fb_vs_torch"] <= target
            checks.append(f"{r['fb_vs_torch']:.2f}x torch (target <= {target}) {'met' if ok else 'MISSED'}")
        ok = r["roofline_fb"] >= TARGET_ROOFLINE
        checks.append(f"roofline {r['roofline_fb']:.0%} (>= 30%) {'met' if ok else 'MISSED'}")
        ok = r["extra_memory_x_input"] <= TARGET_EXTRA_MEMORY
        checks.append(f"extra memory {r['extra_memory_x_input']:.2f}x (<= 0.25) {'met' if ok else 'MISSED'}")
        print(f"  {r['layer']:15} {tuple(r['shape'])!s:18} " + "; ".join(checks))
