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

import contextlib
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
from functools import partial
from typing import Any

import numpy as np

from ._threads import get_num_threads
from .functional._dispatch import generic_only
from .learn import _baseline as textbook
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
# Rounds per shape: at least ``reps``, and more, up to MAX_ROUNDS, until the shape has had
# SECONDS of rounds (the full run; the quick one stops at ``reps``): medians of fast
# layers then rest on a few dozen rounds, those of slow ones on ``reps``.
SECONDS = 10.0
MAX_ROUNDS = 50


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
        xhat = cache["xhat"].reshape(dy.shape)
        dgamma, dbeta = (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))
        dxhat = (dy * gamma4).reshape(dy.shape[0], groups, -1)
        dx, _, _ = textbook.backward(dxhat, cache, (2,), None, (0,))
        return dx.reshape(dy.shape), dgamma, dbeta

    return gn_forward, gn_backward


@dataclass(frozen=True)
class _Impl:
    """One implementation of a layer: ``forward()`` returns what ``backward`` needs (its
    output is dropped otherwise), ``both()`` runs forward then backward; with
    ``measure_memory``, ``both()`` returns the arrays it produced (for the memory figure)."""

    forward: Callable[[], Any]
    backward: Callable[[Any], Any]
    both: Callable[[], Any]
    measure_memory: bool = True


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


def _round(impl: _Impl) -> dict[str, float]:
    """One forward, one backward (of that forward) and one forward+backward, in ms."""
    fwd, saved = _timed(impl.forward)
    bwd, _ = _timed(partial(impl.backward, saved))
    del saved
    fb, _ = _timed(impl.both)
    return {"fwd": fwd, "bwd": bwd, "fb": fb}


Times = dict[str, dict[str, list[float]]]  # implementation -> figure -> ms per round


def _interleaved(impls: dict[str, _Impl], copy: Callable[[], Any], reps: int, seconds: float) -> Times:
    """Times of at least ``reps`` rounds (after one warm-up round), more while the rounds
    have taken less than ``seconds`` in all (at most ``MAX_ROUNDS``). In each round every
    implementation and the copy run once, in an order rotated from round to round, so
    that a slow spell of a shared machine falls on all of them alike; ratios are then
    taken round by round."""
    names = list(impls)
    times: Times = {n: {"fwd": [], "bwd": [], "fb": []} for n in names}
    times["copy"] = {"copy": []}
    start = time.perf_counter()
    i = 0
    while i <= reps or (time.perf_counter() - start < seconds and i <= MAX_ROUNDS):
        k = i % len(names)
        gc.collect()  # once a round (with torch loaded a collection takes tens of ms), then
        gc.disable()  # no collection inside a timed call
        try:
            for name in ["copy", *names[k:], *names[:k]]:
                if name == "copy":
                    t = {"copy": _timed(copy)[0]}
                else:
                    t = _round(impls[name])
                if i > 0:
                    for key, v in t.items():
                        times[name][key].append(v)
        finally:
            gc.enable()
        i += 1
    return times


def _peak_extra(fb: Callable[[], tuple[np.ndarray, ...]], input_bytes: int) -> float:
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


def _npnorm_impl(spec: Spec, x: np.ndarray, dy: np.ndarray, generic: bool = False) -> _Impl:
    """npnorm's module; with ``generic``, every call runs the generic kernels."""
    m = _ours(spec)

    def mode() -> contextlib.AbstractContextManager[None]:
        return generic_only() if generic else contextlib.nullcontext()

    def forward() -> None:
        with mode():
            m(x)  # the module keeps what its backward needs

    def backward(_: None) -> None:
        with mode():
            m.backward(dy)

    def fb() -> tuple[np.ndarray, ...]:
        with mode():
            y = m(x)
            dx = m.backward(dy)
        grads = tuple(m.grads.values())
        m.zero_grad()  # fresh gradients each time, as the memory figure needs
        return y, dx, *grads

    return _Impl(forward, backward, fb)


def _textbook_impl(spec: Spec, x: np.ndarray, dy: np.ndarray) -> _Impl:
    fwd, bwd = _textbook_pair(spec)

    def fb() -> tuple[np.ndarray, ...]:
        y = fwd(x)
        return (y[0], *bwd(dy, y))

    return _Impl(lambda: fwd(x), lambda saved: bwd(dy, saved), fb)


def _torch_impl(torch: Any, spec: Spec, x: np.ndarray, dy: np.ndarray) -> _Impl:
    m = _torch_module(torch, spec)
    xt = torch.from_numpy(x).requires_grad_(True)
    dyt = torch.from_numpy(dy)

    def backward(y: Any) -> None:
        xt.grad = None
        y.backward(dyt)

    def fb() -> None:
        xt.grad = None
        m(xt).backward(dyt)

    return _Impl(lambda: m(xt), backward, fb, measure_memory=False)


def _median_ratio(num: list[float], den: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``scale * num[i] / den[i]``."""
    return statistics.median(scale * a / b for a, b in zip(num, den, strict=True))


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
        scratch = np.empty_like(x)
        impls = {
            "npnorm fast": _npnorm_impl(spec, x, dy),
            "npnorm generic": _npnorm_impl(spec, x, dy, generic=True),
            "textbook": _textbook_impl(spec, x, dy),
        }
        if torch is not None:
            impls["torch"] = _torch_impl(torch, spec, x, dy)
        times = _interleaved(impls, partial(np.copyto, scratch, x), reps, 0.0 if quick else SECONDS)
        memory = {n: _peak_extra(i.both, x.nbytes) for n, i in impls.items() if i.measure_memory}
        copy = times["copy"]["copy"]
        copy_ms = statistics.median(copy)
        for impl in impls:
            t = times[impl]
            row = {
                "rounds": len(copy),
                "layer": spec.layer,
                "shape": list(spec.shape),
                "impl": impl,
                "fwd_ms": statistics.median(t["fwd"]),
                "bwd_ms": statistics.median(t["bwd"]),
                "fb_ms": statistics.median(t["fb"]),
                "copy_ms": copy_ms,
                "copy_GBps": 2 * x.nbytes / copy_ms / 1e6,
                "roofline_fwd": _median_ratio(copy, t["fwd"]),
                "roofline_fb": _median_ratio(copy, t["fb"], 2.5),
                "extra_memory_x_input": memory.get(impl),
                "fb_vs_torch": _median_ratio(t["fb"], times["torch"]["fb"]) if torch is not None else None,
                "times_ms": t,
            }
            rows.append(row)
        _print_rows(rows[-len(impls) :], spec)
    _print_targets(rows, judge=not quick)
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
        f"({first['copy_GBps']:.1f} GB/s read+write); medians of {first['rounds']} rounds"
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


def _print_targets(rows: list[dict[str, Any]], judge: bool = True) -> None:
    """The fast path's figures against the issue's targets; with ``judge`` False (the quick
    run's small shapes, where fixed costs and per-thread scratch weigh more) the figures and
    targets without a verdict."""
    print("\ntargets for npnorm fast (forward+backward):")
    if not judge:
        print("  (quick shapes: the targets apply to the standard shapes; run without --quick)")

    def verdict(ok: bool) -> str:
        return (" met" if ok else " MISSED") if judge else ""

    for r in rows:
        if r["impl"] != "npnorm fast":
            continue
        target = TARGET_VS_TORCH[r["layer"]]
        checks = []
        if r["fb_vs_torch"] is not None:
            ok = r["fb_vs_torch"] <= target
            checks.append(f"{r['fb_vs_torch']:.2f}x torch (target <= {target}){verdict(ok)}")
        ok = r["roofline_fb"] >= TARGET_ROOFLINE
        checks.append(f"roofline {r['roofline_fb']:.0%} (>= 30%){verdict(ok)}")
        ok = r["extra_memory_x_input"] <= TARGET_EXTRA_MEMORY
        checks.append(f"extra memory {r['extra_memory_x_input']:.2f}x (<= 0.25){verdict(ok)}")
        print(f"  {r['layer']:15} {tuple(r['shape'])!s:18} " + "; ".join(checks))
