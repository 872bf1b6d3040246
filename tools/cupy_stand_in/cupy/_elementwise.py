"""ElementwiseKernel stand-in: the NumPy emulation of kernel ``name`` is looked up in
``ELEMENTWISE`` (name -> function(*inputs broadcast) -> output values, or a tuple of
them for several outputs). ``ELEMENTWISE_BODIES`` may hold the body an emulation was
written for (name -> body): a kernel built with another body then fails, so that a
changed kernel is not run by a stale emulation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._raw import StandinError

ELEMENTWISE: dict[str, Callable[..., Any]] = {}
ELEMENTWISE_BODIES: dict[str, str] = {}
CALLS: list[tuple[str, tuple[int, ...]]] = []  # (name, output shape), every call

_FIXED = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "float": np.float32,
    "double": np.float64,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}


def _params(spec: str) -> list[tuple[str, str, bool]]:
    """(type, name, raw) of each parameter of ``"T x, raw T y, float32 z"``."""
    out = []
    for p in spec.split(","):
        words = p.split()
        if not words:
            continue
        raw = words[0] == "raw"
        if raw:
            words = words[1:]
        if len(words) != 2:
            raise StandinError(f"cannot parse the ElementwiseKernel parameter {p!r}")
        out.append((words[0], words[1], raw))
    return out


def _norm(body: str) -> str:
    return " ".join(body.split())


class ElementwiseKernel:
    def __init__(
        self,
        in_params: str,
        out_params: str,
        operation: str,
        name: str = "kernel",
        reduce_dims: bool = True,
        preamble: str = "",
        no_return: bool = False,
        return_tuple: bool = False,
        loop_prep: str = "",
        after_loop: str = "",
        options: tuple = (),
    ):
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        self.operation, self.name = operation, name
        self.return_tuple = return_tuple
        if name not in ELEMENTWISE:
            raise NotImplementedError(
                f"the CPU stand-in has no emulation of ElementwiseKernel {name!r}: "
                "register one in cupy.ELEMENTWISE"
            )
        expected = ELEMENTWISE_BODIES.get(name)
        if expected is not None and _norm(expected) != _norm(operation):
            raise StandinError(
                f"ElementwiseKernel {name}: body {operation!r} differs from the emulated "
                f"{expected!r}: update the emulation"
            )

    def __call__(self, *args: Any, size: int | None = None, block_size: int | None = None) -> Any:
        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise StandinError(
                f"ElementwiseKernel {self.name}: {len(args)} arguments, takes {n_in} (+{n_out} out)"
            )
        ins = list(args[:n_in])
        types: dict[str, np.dtype] = {}
        for (t, n, raw), a in zip(self.in_params, ins, strict=True):
            if raw:
                raise StandinError(f"ElementwiseKernel {self.name}: raw parameters are not emulated")
            if t in _FIXED:
                continue
            if isinstance(a, np.ndarray):
                if t in types and types[t] != a.dtype:
                    raise StandinError(
                        f"ElementwiseKernel {self.name}: type {t} is {types[t]} from an earlier "
                        f"argument but {n} is {a.dtype} (CuPy: type mismatch)"
                    )
                types.setdefault(t, a.dtype)
        for (t, _, _), a in zip(self.in_params, ins, strict=True):  # a type only NumPy scalars give: theirs
            if t not in _FIXED and t not in types and isinstance(a, np.generic):
                types[t] = a.dtype
        for t, _, _ in self.in_params:  # Python scalars take the type's dtype
            if t not in _FIXED and t not in types:
                raise StandinError(f"ElementwiseKernel {self.name}: type {t} has no array argument")
        arrays = []
        for (t, _, _), a in zip(self.in_params, ins, strict=True):
            dt = np.dtype(_FIXED[t]) if t in _FIXED else types[t]
            if isinstance(a, np.ndarray):
                if t in _FIXED and a.dtype != dt:
                    a = a.astype(dt)
                arrays.append(a)
            else:
                arrays.append(np.asarray(a, dtype=dt))
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        outs = list(args[n_in:])
        if not outs:
            for t, _, _ in self.out_params:
                dt = np.dtype(_FIXED[t]) if t in _FIXED else types.get(t)
                if dt is None:
                    raise StandinError(f"ElementwiseKernel {self.name}: output type {t} unknown")
                outs.append(np.full(shape, np.nan, dtype=dt) if dt.kind == "f" else np.empty(shape, dt))
        else:
            for o in outs:
                if o.shape != shape:
                    raise StandinError(f"ElementwiseKernel {self.name}: out shape {o.shape} vs {shape}")
        CALLS.append((self.name, tuple(shape)))
        with np.errstate(all="ignore"):
            res = ELEMENTWISE[self.name](*(np.broadcast_to(a, shape) for a in arrays))
        res = res if isinstance(res, tuple) else (res,)
        if len(res) != n_out:
            raise StandinError(f"ElementwiseKernel {self.name}: the emulation gave {len(res)} outputs")
        for o, r in zip(outs, res, strict=True):
            if np.asarray(r).dtype != o.dtype:
                raise StandinError(
                    f"ElementwiseKernel {self.name}: the emulation gave {np.asarray(r).dtype}, "
                    f"the output is {o.dtype} (emulate the C casts explicitly)"
                )
            o[...] = r
        if n_out == 1 and not self.return_tuple:
            return outs[0]
        return tuple(outs)
