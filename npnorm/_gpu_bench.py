"""The GPU benchmark of ``python -m npnorm gpu-check``: every layer on CuPy against torch CUDA
and the GPU's copy bandwidth.

For each layer at the standard shapes of :mod:`npnorm._bench` (float32) it times forward,
backward and forward+backward of npnorm on CuPy arrays (the generic Array API path, and the
default dispatch too where CuPy has kernels of its own), of the same ``torch.nn`` layer on
CUDA when torch sees the GPU, and a device-to-device copy of the input (``copyto``). Each
call is timed with CUDA events (CuPy's for CuPy, torch's for torch) after warm-up rounds
(the first calls compile CuPy's kernels); the rounds are interleaved in a rotated order, as
in ``npnorm._bench``, each timed call right after an untimed one of the same implementation
(so that none inherits the cache of the one before it in the rotation), and ratios are
medians of per-round ratios. Traffic is counted as in
``npnorm._bench``: a copy reads and writes the input once (2 x bytes), forward+backward
reads x, writes y, reads x and dy and writes dx (5 x bytes); GB/s is that traffic over the
median time, and "of copy" the fraction of the copy's bandwidth it reaches.

:meth:`Device.cpu_stand_in` runs the same code on the CPU (NumPy standing in for CuPy, torch's
CPU build for torch CUDA, a wall-clock timer for the events): it is how the tests exercise
this module without a GPU; its figures are not GPU figures and are labelled so.

Run alone: ``python -m npnorm._gpu_bench --json FILE [--quick] [--rounds N] [--stand-in]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ._backend import resolve_namespace, to_host
from ._bench import FULL, QUICK, Spec, _ours, _torch_module
from ._files import write_json
from .functional import _dispatch

Timer = Callable[[Callable[[], Any]], tuple[float, Any]]  # fn -> (ms, fn's result)


class NoGPU(RuntimeError):
    """No usable CUDA GPU (CuPy missing, no driver or no device): the message says which."""


def wall_timer(sync: Callable[[], None] = lambda: None) -> Timer:
    """Times ``fn`` with ``time.perf_counter``, ``sync()`` before and after."""

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return 1e3 * (time.perf_counter() - t0), out

    return timed


def cupy_event_timer(cupy: Any) -> Timer:
    """Times ``fn`` with two CUDA events recorded on CuPy's current stream."""

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, end)), out

    return timed


def torch_event_timer(torch: Any) -> Timer:
    """Times ``fn`` with two CUDA events recorded on torch's current stream."""

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), out

    return timed


@dataclass
class Device:
    """Where the benchmark runs: the array module, its timer, torch's device and a description."""

    xp: Any  # the array module (cupy, or numpy standing in for it), with copyto
    timer: Timer
    torch: Any  # the torch module, or None
    torch_device: str | None  # "cuda", "cpu" (stand-in) or None: no torch row
    torch_timer: Timer | None
    info: dict[str, Any] = field(default_factory=dict)
    stand_in: bool = False

    @classmethod
    def cuda(cls) -> Device:
        """The first CUDA device through CuPy; raises :class:`NoGPU` saying why there is none."""
        info = gpu_info()  # raises NoGPU
        cupy = importlib.import_module("cupy")
        torch = _import_torch()
        torch_ok = torch is not None and bool(torch.cuda.is_available())
        if torch is not None:
            info["torch"] = torch.__version__
            info["torch_cuda"] = torch_ok
        return cls(
            xp=cupy,
            timer=cupy_event_timer(cupy),
            torch=torch if torch_ok else None,
            torch_device="cuda" if torch_ok else None,
            torch_timer=torch_event_timer(torch) if torch_ok else None,
            info=info,
        )

    @classmethod
    def cpu_stand_in(cls) -> Device:
        """The CPU standing in for the GPU, to run this code without one (not GPU figures)."""
        torch = _import_torch()
        info: dict[str, Any] = {"device": "CPU stand-in (NumPy for CuPy, wall clock for CUDA events)"}
        info["numpy"] = np.__version__
        if torch is not None:
            info["torch"] = torch.__version__
        return cls(
            xp=np,
            timer=wall_timer(),
            torch=torch,
            torch_device="cpu" if torch is not None else None,
            torch_timer=wall_timer() if torch is not None else None,
            info=info,
            stand_in=True,
        )


def _import_torch() -> Any:
    return importlib.import_module("torch") if importlib.util.find_spec("torch") is not None else None


def gpu_info() -> dict[str, Any]:
    """Name, memory and CUDA versions of device 0 through CuPy; :class:`NoGPU` if there is none."""
    if importlib.util.find_spec("cupy") is None:
        raise NoGPU(
            "CuPy is not installed, so no GPU can be used: this check needs a machine with an "
            "NVIDIA GPU and CuPy (pip install 'npnorm[cuda12]' or 'npnorm[cuda13]', by the CUDA "
            "version nvidia-smi shows)"
        )
    try:
        cupy = importlib.import_module("cupy")
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as err:  # no driver, no device visible, a broken CUDA install
        raise NoGPU(f"CuPy is installed but finds no usable CUDA GPU: {type(err).__name__}: {err}") from err
    if count < 1:
        raise NoGPU("CuPy is installed but finds no CUDA GPU (device count 0)")
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "device_count": count,
        "memory_GiB": round(props["totalGlobalMem"] / 2**30, 1),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "cupy": cupy.__version__,
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "numpy": np.__version__,
    }


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@dataclass(frozen=True)
class Impl:
    """One implementation of a layer: ``forward()`` returns what ``backward`` takes,
    ``both()`` runs forward then backward and returns (y, dx); ``timer`` times its calls."""

    forward: Callable[[], Any]
    backward: Callable[[Any], Any]
    both: Callable[[], tuple[Any, Any]]
    timer: Timer


def _namespace_name(device: Device) -> str:
    return str(resolve_namespace(device.xp).__name__)


def npnorm_impl(device: Device, spec: Spec, x: Any, dy: Any, *, generic: bool) -> Impl:
    """npnorm's module on ``device``; with ``generic``, every call runs the generic kernels."""
    m = _ours(spec).to(device.xp)

    def mode() -> contextlib.AbstractContextManager[None]:
        return _dispatch.use_kernels("reference") if generic else contextlib.nullcontext()

    def forward() -> None:
        with mode():
            m(x)  # the module keeps what its backward needs

    def backward(_: None) -> None:
        with mode():
            m.backward(dy)
        m.zero_grad()

    def both() -> tuple[Any, Any]:
        with mode():
            y = m(x)
            dx = m.backward(dy)
        m.zero_grad()
        return y, dx

    return Impl(forward, backward, both, device.timer)


def torch_impl(device: Device, spec: Spec, x_host: np.ndarray, dy_host: np.ndarray) -> Impl:
    """The same ``torch.nn`` layer on ``device.torch_device``."""
    torch, where = device.torch, device.torch_device
    assert torch is not None and where is not None and device.torch_timer is not None
    m = _torch_module(torch, spec).to(where)
    xt = torch.from_numpy(x_host).to(where).requires_grad_(True)
    dyt = torch.from_numpy(dy_host).to(where)

    def backward(y: Any) -> None:
        xt.grad = None
        m.zero_grad(set_to_none=True)
        y.backward(dyt)

    def both() -> tuple[Any, Any]:
        xt.grad = None
        m.zero_grad(set_to_none=True)
        y = m(xt)
        y.backward(dyt)
        return y, xt.grad

    return Impl(lambda: m(xt), backward, both, device.torch_timer)


def impls_for(device: Device, spec: Spec, x_host: np.ndarray, dy_host: np.ndarray) -> dict[str, Impl]:
    """npnorm generic, npnorm's default dispatch (only where the backend has kernels of its
    own, so that it differs from generic) and torch (where present)."""
    x, dy = device.xp.asarray(x_host), device.xp.asarray(dy_host)
    impls = {"npnorm generic": npnorm_impl(device, spec, x, dy, generic=True)}
    if _dispatch.has_own_kernels(_namespace_name(device)):
        impls["npnorm"] = npnorm_impl(device, spec, x, dy, generic=False)
    if device.torch_device is not None:
        impls["torch " + device.torch_device] = torch_impl(device, spec, x_host, dy_host)
    return impls


def _round(impl: Impl) -> dict[str, float]:
    """One forward, one backward (of that forward) and one forward+backward, in ms, after
    one untimed forward+backward of the same implementation."""
    impl.both()
    fwd, saved = impl.timer(impl.forward)
    bwd, _ = impl.timer(partial(impl.backward, saved))
    del saved
    fb, _ = impl.timer(impl.both)
    return {"fwd": fwd, "bwd": bwd, "fb": fb}


def _max_error(a: Any, b: Any) -> float:
    """max |a - b| / max(1, max |b|), on the host in float64."""
    a64 = to_host(a).astype(np.float64)
    b64 = to_host(b).astype(np.float64)
    return float(np.abs(a64 - b64).max(initial=0.0)) / max(1.0, float(np.abs(b64).max(initial=0.0)))


def bench_spec(device: Device, spec: Spec, rounds: int, warmup: int, seed: int = 0) -> list[dict[str, Any]]:
    """The rows of one layer and shape: one per implementation."""
    rng = np.random.default_rng(seed)
    x_host = rng.standard_normal(spec.shape, dtype=np.float32)
    dy_host = rng.standard_normal(spec.shape, dtype=np.float32)
    impls = impls_for(device, spec, x_host, dy_host)
    src = device.xp.asarray(x_host)
    dst = device.xp.empty_like(src)
    names = list(impls)
    times: dict[str, dict[str, list[float]]] = {n: {"fwd": [], "bwd": [], "fb": []} for n in names}
    copies: list[float] = []
    for i in range(warmup + rounds):
        k = i % len(names)
        device.xp.copyto(dst, src)
        copy_ms, _ = device.timer(lambda: device.xp.copyto(dst, src))
        measured = {name: _round(impls[name]) for name in [*names[k:], *names[:k]]}
        if i >= warmup:
            copies.append(copy_ms)
            for name, figures in measured.items():
                for key, v in figures.items():
                    times[name][key].append(v)
    # the results themselves, once: npnorm against torch (or, without torch, against generic)
    reference = next((n for n in names if n.startswith("torch")), "npnorm generic")
    ref_y, ref_dx = impls[reference].both()
    nbytes = x_host.nbytes
    copy_ms = statistics.median(copies)
    rows = []
    for name in names:
        t = times[name]
        y, dx = impls[name].both()
        fb_ms = statistics.median(t["fb"])
        torch_fb = next((times[n]["fb"] for n in names if n.startswith("torch")), None)
        vs_torch = None
        if torch_fb is not None:
            vs_torch = statistics.median(a / b for a, b in zip(t["fb"], torch_fb, strict=True))
        rows.append(
            {
                "layer": spec.layer,
                "shape": list(spec.shape),
                "impl": name,
                "rounds": rounds,
                "fwd_ms": statistics.median(t["fwd"]),
                "bwd_ms": statistics.median(t["bwd"]),
                "fb_ms": fb_ms,
                "fb_GBps": 5 * nbytes / fb_ms / 1e6,
                "copy_ms": copy_ms,
                "copy_GBps": 2 * nbytes / copy_ms / 1e6,
                "fb_of_copy": statistics.median(2.5 * c / f for c, f in zip(copies, t["fb"], strict=True)),
                "fb_vs_torch": vs_torch,
                "max_error_vs": reference,
                "max_error_y": _max_error(y, ref_y),
                "max_error_dx": _max_error(dx, ref_dx),
            }
        )
    return rows


def run(
    device: Device,
    specs: Sequence[Spec] = FULL,
    *,
    rounds: int = 10,
    warmup: int = 2,
    json_path: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Benchmark every spec; with ``json_path`` the figures are saved after each spec (a run
    cut short keeps what it measured)."""
    result: dict[str, Any] = {
        "device": device.info,
        "stand_in": device.stand_in,
        "timer": "wall clock (stand-in)" if device.stand_in else "CUDA events",
        "rounds": rounds,
        "warmup": warmup,
        "complete": False,
        "rows": [],
    }
    log("device: " + ", ".join(f"{k}={v}" for k, v in device.info.items()))
    for spec in specs:
        t0 = time.perf_counter()
        rows = bench_spec(device, spec, rounds, warmup)
        result["rows"].extend(rows)
        log(format_rows(rows) + f"\n  ({time.perf_counter() - t0:.1f} s with warm-up)")
        if json_path:
            _save(result, json_path)
    result["complete"] = True
    if json_path:
        _save(result, json_path)
    return result


def _save(result: dict[str, Any], path: str) -> None:
    """Whole or not at all (``write_json``): a benchmark killed while it saves (at its
    stage's limit) leaves the figures saved before, not half a JSON file."""
    write_json(path, result)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """One layer's rows as a small text table."""
    first = rows[0]
    lines = [
        f"{first['layer']} {tuple(first['shape'])} float32   copy {first['copy_ms']:.3f} ms "
        f"({first['copy_GBps']:.0f} GB/s read+write); medians of {first['rounds']} rounds",
        f"  {'impl':16} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b GB/s':>9} {'of copy':>7} "
        f"{'vs torch':>8} {'err y':>8} {'err dx':>8}",
    ]
    for r in rows:
        lines.append(
            f"  {r['impl']:16} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fb_ms']:8.3f} "
            f"{r['fb_GBps']:9.0f} {r['fb_of_copy']:7.0%} {_fmt(r['fb_vs_torch'], '8.2f')} "
            f"{r['max_error_y']:8.1e} {r['max_error_dx']:8.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npnorm._gpu_bench", description=__doc__)
    parser.add_argument("--json", metavar="FILE", help="save the figures as JSON (after each layer)")
    parser.add_argument("--quick", action="store_true", help="the small shapes of bench --quick")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per shape (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument(
        "--stand-in", action="store_true", help="run on the CPU with NumPy for CuPy (a test; not GPU figures)"
    )
    args = parser.parse_args(argv)
    try:
        device = Device.cpu_stand_in() if args.stand_in else Device.cuda()
    except NoGPU as err:
        print(f"gpu bench: {err}", file=sys.stderr)
        return 2
    run(device, QUICK if args.quick else FULL, rounds=args.rounds, warmup=args.warmup, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
