"""The main job, ``python -m npnorm``: every layer, every backend found, checked.

For each layer: a forward, a ``gradcheck`` in float64 and, where torch is installed,
parity with the same ``torch.nn`` layer (outputs, input and parameter gradients,
running buffers) after loading npnorm's random parameters into it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import Namespace, resolve_namespace, to_host
from .gradient_check import GradcheckError, gradcheck
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Module,
    RMSNorm,
)


@dataclass(frozen=True)
class Case:
    """One layer configuration: how to build it in npnorm and in torch, and its input."""

    name: str
    make: Callable[..., Module]  # (dtype=..., xp=...) -> npnorm module
    make_torch: Callable[[Any], Any]  # torch -> torch.nn module
    shape: tuple[int, ...]
    steps: int = 1  # training steps before the eval comparison


CASES: list[Case] = [
    Case("LayerNorm", lambda **kw: LayerNorm((4, 6), **kw), lambda t: t.nn.LayerNorm((4, 6)), (3, 4, 6)),
    Case(
        "LayerNorm(bias=False)",
        lambda **kw: LayerNorm(6, bias=False, **kw),
        lambda t: t.nn.LayerNorm(6, bias=False),
        (5, 6),
    ),
    Case("RMSNorm", lambda **kw: RMSNorm(6, **kw), lambda t: t.nn.RMSNorm(6), (2, 3, 6)),
    Case("BatchNorm1d", lambda **kw: BatchNorm1d(3, **kw), lambda t: t.nn.BatchNorm1d(3), (4, 3), steps=3),
    Case(
        "BatchNorm2d",
        lambda **kw: BatchNorm2d(3, **kw),
        lambda t: t.nn.BatchNorm2d(3),
        (2, 3, 3, 2),
        steps=3,
    ),
    Case(
        "BatchNorm2d(momentum=None)",
        lambda **kw: BatchNorm2d(3, momentum=None, **kw),
        lambda t: t.nn.BatchNorm2d(3, momentum=None),
        (2, 3, 3, 2),
        steps=3,
    ),
    Case(
        "BatchNorm3d",
        lambda **kw: BatchNorm3d(2, **kw),
        lambda t: t.nn.BatchNorm3d(2),
        (2, 2, 2, 2, 3),
        steps=3,
    ),
    Case(
        "InstanceNorm1d(affine)",
        lambda **kw: InstanceNorm1d(3, affine=True, **kw),
        lambda t: t.nn.InstanceNorm1d(3, affine=True),
        (2, 3, 5),
    ),
    Case(
        "InstanceNorm2d(track)",
        lambda **kw: InstanceNorm2d(3, affine=True, track_running_stats=True, **kw),
        lambda t: t.nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        (2, 3, 3, 2),
        steps=3,
    ),
    Case(
        "InstanceNorm3d",
        lambda **kw: InstanceNorm3d(2, **kw),
        lambda t: t.nn.InstanceNorm3d(2),
        (2, 2, 2, 2, 2),
    ),
    Case("GroupNorm", lambda **kw: GroupNorm(2, 4, **kw), lambda t: t.nn.GroupNorm(2, 4), (2, 4, 3)),
]


def available_backends() -> list[str]:
    """numpy, plus array_api_strict, torch (its tensors) and cupy (with a GPU) where
    installed."""
    found = ["numpy"]
    for name in ("array_api_strict", "torch"):
        if importlib.util.find_spec(name) is not None:
            found.append(name)
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                found.append("cupy")
        except Exception:  # no driver / no device: cupy is installed but unusable
            pass
    return found


def randomize(module: Module, rng: np.random.Generator) -> None:
    """Give the parameters (and running statistics) non-trivial values."""
    state: dict[str, Any] = {}
    for name, value in module.state_dict().items():
        shape = tuple(value.shape)
        if name == "num_batches_tracked":
            state[name] = np.asarray(3, dtype=np.int64)
        elif name == "running_var" or name == "weight":
            state[name] = rng.uniform(0.5, 1.5, size=shape)
        else:
            state[name] = rng.normal(size=shape)
    module.load_state_dict(state)


def torch_parity(case: Case, xp: Namespace, dtype: str, seed: int = 0) -> float:
    """Largest relative error against torch over outputs, gradients and buffers."""
    import torch

    rng = np.random.default_rng(seed)
    ours = case.make(dtype=dtype, xp=xp)
    randomize(ours, rng)
    tdtype = getattr(torch, dtype)
    ref = case.make_torch(torch).to(tdtype)
    ref.load_state_dict({k: torch.as_tensor(to_host(v)) for k, v in ours.state_dict().items()})
    worst = 0.0

    def compare(a: Any, b: Any) -> None:
        nonlocal worst
        a_np = to_host(a).astype(np.float64)
        b_np = b.detach().cpu().double().numpy() if hasattr(b, "detach") else np.asarray(b, np.float64)
        scale = max(1.0, float(np.abs(b_np).max(initial=0.0)))
        err = float(np.abs(a_np - b_np).max(initial=0.0)) / scale
        worst = math.nan if math.isnan(err) else max(worst, err)  # (max(0.0, nan) is 0.0: it was dropped)

    for mode in ("train", "eval"):
        ours.train(mode == "train")
        ref.train(mode == "train")
        for _ in range(case.steps if mode == "train" else 1):
            x_np = rng.normal(size=case.shape) * 2.0 + 0.5
            dy_np = rng.normal(size=case.shape)
            ours.zero_grad()
            ref.zero_grad()
            y = ours(xp.asarray(x_np, dtype=getattr(xp, dtype)))
            dx = ours.backward(xp.asarray(dy_np, dtype=getattr(xp, dtype)))
            xt = torch.tensor(x_np, dtype=tdtype, requires_grad=True)
            yt = ref(xt)
            yt.backward(torch.tensor(dy_np, dtype=tdtype))
            compare(y, yt)
            compare(dx, xt.grad)
            tparams = dict(ref.named_parameters())
            for name, g in ours.grads.items():
                compare(g, tparams[name].grad)
            tstate = ref.state_dict()
            for name, value in ours.buffers().items():
                compare(value, tstate[name])
    return worst


def run(verbose: bool = True) -> bool:
    """Run every check and print a table; return whether all passed."""
    torch_ok = importlib.util.find_spec("torch") is not None
    tol = {"float64": 1e-10, "float32": 1e-4}
    rows: list[tuple[str, ...]] = []
    all_ok = True
    for backend in available_backends():
        xp = resolve_namespace(backend)
        for case in CASES:
            rng = np.random.default_rng(1)
            status = "ok"
            m = case.make(xp=xp)
            randomize(m, rng)
            y = m(xp.asarray(rng.normal(size=case.shape), dtype=xp.float32))
            finite = bool(np.isfinite(to_host(y)).all())
            x64 = xp.asarray(rng.normal(size=case.shape))
            try:
                gc = "pass" if gradcheck(m.train(), x64) and gradcheck(m.eval(), x64) else "FAIL"
            except GradcheckError:  # the forward's column keeps what the forward gave
                gc = "FAIL"
            par = {}
            for dtype in ("float64", "float32"):
                if torch_ok:
                    err = torch_parity(case, xp, dtype)
                    par[dtype] = f"{err:.1e}" + ("" if err <= tol[dtype] else " FAIL")
                else:
                    par[dtype] = "no torch"
            if not finite or gc != "pass" or any("FAIL" in v for v in par.values()):
                status, all_ok = "FAIL", False
            rows.append(
                (
                    case.name,
                    backend,
                    "finite" if finite else "NaN",
                    gc,
                    par["float64"],
                    par["float32"],
                    status,
                )
            )
    if verbose:
        header = ("layer", "backend", "forward", "gradcheck train+eval", "torch f64", "torch f32", "result")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, tuple("-" * w for w in widths), *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        print(
            "\ntorch columns: largest error relative to max(1, |torch value|) over outputs, "
            "gradients and buffers" + ("" if torch_ok else " (install torch==2.13.0 for the parity columns)")
        )
        print("all checks passed" if all_ok else "SOME CHECKS FAILED")
    return all_ok
