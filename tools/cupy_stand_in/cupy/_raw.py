"""RawModule / RawKernel stand-ins: CUDA source parsed for signatures, launches checked and
run by NumPy emulations registered in ``RAW``.

An emulation is registered with ``@emulates("name", "p1, p2, ...")``: the parameter names
in the source's order (a launch fails when the source's list differs, so that a changed
kernel is not run by a stale emulation). It is called with a ``Launch`` that holds the
grid, block, the module's T/S dtypes and #defines, and the arguments:

    L.ptr("x")        the argument of pointer parameter x as a flat C-ordered view (read-only
                      where the parameter is const), its dtype checked against the
                      declared pointee type; ``need=`` checks it has that many elements
    L.val("R")        a scalar parameter's value (Python int or float)
"""

from __future__ import annotations

import hashlib
import itertools
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

_CTYPES = {
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
    "int": np.dtype(np.int32),
    "unsigned int": np.dtype(np.uint32),
    "long long": np.dtype(np.int64),
    "unsigned long long": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "__half": np.dtype(np.float16),
}

# name -> (parameter names, emulation)
RAW: dict[str, tuple[tuple[str, ...], Callable[[Launch], None]]] = {}
LAUNCHES: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # (kernel, grid, block), every launch
# name -> fingerprint of the kernel's source (and the __device__ functions it calls) the
# emulation was written against; a module whose kernel differs records it in STALE
FINGERPRINTS: dict[str, str] = {}
STALE: dict[str, str] = {}  # name -> the source's fingerprint now
_ptrs = itertools.count(0x7F0000001000, 0x100)


class StandinError(RuntimeError):
    """A launch a GPU would run wrongly or refuse (bad grid, argument type, memory access)."""


def emulates(name: str, params: str) -> Callable[[Callable[[Launch], None]], Callable[[Launch], None]]:
    names = tuple(p.strip() for p in params.split(",") if p.strip())

    def deco(fn: Callable[[Launch], None]) -> Callable[[Launch], None]:
        RAW[name] = (names, fn)
        return fn

    return deco


def _strip(code: str) -> str:
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    code = re.sub(r"//[^\n]*", " ", code)
    return " ".join(code.split())


def _braced(code: str, start: int) -> str:
    """The text from ``start`` to the brace that closes the first ``{`` after it."""
    i = code.index("{", start)
    depth = 0
    for j in range(i, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return code[start : j + 1]
    raise StandinError("unbalanced braces in the module source")


def fingerprint(code: str, name: str) -> str:
    """A hash of kernel ``name``'s definition and of the __device__ functions it calls (those
    recursively), comments and spacing ignored."""
    device = {
        m.group(1): _braced(code, m.start()) for m in re.finditer(r"__device__[^;{(]*?\b(\w+)\s*\(", code)
    }
    m = re.search(
        r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?' + re.escape(name) + r"\s*\(",
        code,
    )
    if m is None:
        raise StandinError(f"kernel {name} not found")
    parts, todo, seen = [_braced(code, m.start())], [], set()
    todo.append(parts[0])
    while todo:
        text = todo.pop()
        for f in sorted(set(re.findall(r"\b(\w+)\s*\(", text))):
            if f in device and f not in seen:
                seen.add(f)
                parts.append(device[f])
                todo.append(device[f])
    return hashlib.sha1(_strip("\n".join(parts)).encode()).hexdigest()[:12]


class Param:
    def __init__(self, text: str, typedefs: dict[str, np.dtype]):
        t = text.replace("__restrict__", " ").strip()
        self.text = text.strip()
        self.pointer = "*" in t
        self.const = bool(re.match(r"\s*const\b", t)) if self.pointer else True
        t = t.replace("*", " ")
        words = [w for w in t.split() if w != "const"]
        if len(words) < 2:
            raise StandinError(f"cannot parse the kernel parameter {text!r}")
        self.name = words[-1]
        ctype = " ".join(words[:-1])
        if ctype in typedefs:
            self.dtype = typedefs[ctype]
        elif ctype in _CTYPES:
            self.dtype = _CTYPES[ctype]
        else:
            raise StandinError(f"kernel parameter {text!r}: unknown type {ctype!r}")
        self.ctype = ctype


class Signature:
    def __init__(self, name: str, bounds: int | None, params: list[Param]):
        self.name, self.bounds, self.params = name, bounds, params


def parse_source(code: str) -> tuple[dict[str, np.dtype], dict[str, int], dict[str, Signature]]:
    typedefs: dict[str, np.dtype] = {}
    for ctype, alias in re.findall(r"typedef\s+([A-Za-z_][\w ]*?)\s+(\w+)\s*;", code):
        if ctype in _CTYPES:
            typedefs[alias] = _CTYPES[ctype]
    defines = {k: int(v) for k, v in re.findall(r"#define\s+(\w+)\s+(\d+)\s*$", code, re.M)}
    kernels: dict[str, Signature] = {}
    pattern = (
        r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(\s*(\w+)\s*(?:,[^)]*)?\)\s+)?'
        r"(\w+)\s*\(([^)]*)\)"
    )
    for bounds, name, params in re.findall(pattern, code, re.S):
        b = None
        if bounds:
            b = int(bounds) if bounds.isdigit() else defines.get(bounds)
            if b is None:
                raise StandinError(f"kernel {name}: __launch_bounds__({bounds}) not a number or #define")
        plist = [Param(p, typedefs) for p in params.split(",") if p.strip()]
        kernels[name] = Signature(name, b, plist)
    return typedefs, defines, kernels


class Launch:
    """One launch of a kernel: grid, block, the module's types and #defines, the arguments."""

    def __init__(
        self,
        sig: Signature,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        typedefs: dict[str, np.dtype],
        defines: dict[str, int],
    ):
        self.sig, self.name = sig, sig.name
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.T = typedefs.get("T")
        self.S = typedefs.get("S")
        self.defines = defines
        self._params = {p.name: p for p in sig.params}
        self._args = dict(zip((p.name for p in sig.params), args, strict=True))
        self.used: dict[str, bool] = {}  # pointer parameters the emulation accessed -> written

    def _param(self, name: str) -> Param:
        if name not in self._params:
            raise StandinError(f"{self.name}: the emulation asks for a parameter {name!r} the source lacks")
        return self._params[name]

    def val(self, name: str) -> Any:
        p = self._param(name)
        if p.pointer:
            raise StandinError(f"{self.name}: {name} is a pointer")
        v = self._args[name]
        return v.item() if isinstance(v, np.generic) else v

    def check_restrict(self) -> None:
        """The pointers accessed are __restrict__: one written must not overlap another accessed."""
        names = list(self.used)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if (self.used[a] or self.used[b]) and np.shares_memory(self._args[a], self._args[b]):
                    raise StandinError(
                        f"{self.name}: {a} and {b} overlap in memory, one of them written "
                        "(both __restrict__: undefined behaviour)"
                    )

    def ptr(self, name: str, need: int = 0) -> np.ndarray:
        p = self._param(name)
        if not p.pointer:
            raise StandinError(f"{self.name}: {name} is not a pointer")
        a = self._args[name]
        what = f"{self.name}(grid={self.grid}, block={self.block}): argument {name} ({p.text})"
        if a.dtype != p.dtype:
            raise StandinError(f"{what} is read or written but has dtype {a.dtype} (expects {p.dtype})")
        if not a.flags.c_contiguous:
            raise StandinError(
                f"{what} is not C-contiguous (shape {a.shape}, strides {a.strides}): "
                "the kernel would read its memory as if it were"
            )
        if a.size < need:
            raise StandinError(f"{what} has {a.size} elements; the kernel accesses {need}")
        self.used[name] = not p.const
        flat = a.reshape(-1)
        if not np.shares_memory(flat, a) and a.size:
            raise StandinError(f"{what}: no flat view")  # cannot happen for C-contiguous arrays
        if p.const:
            flat = flat.view()
            flat.flags.writeable = False
        elif not a.flags.writeable:
            raise StandinError(f"{what} is written but is a read-only array")
        return flat


class RawKernel:
    """``module.get_function(name)``: ``kernel(grid, block, args)`` runs the emulation."""

    def __init__(self, module: RawModule, name: str):
        if name not in module.signatures:
            raise StandinError(
                f'no extern "C" __global__ kernel {name!r} in the module source '
                f"(found {sorted(module.signatures)})"
            )
        if name not in RAW:
            raise NotImplementedError(
                f"the CPU stand-in has no emulation of kernel {name!r}: "
                "add one to tools/cupy_stand_in/cupy/_npnorm_kernels.py"
            )
        self.module, self.name = module, name
        self.sig = module.signatures[name]
        names, self._fn = RAW[name]
        src = tuple(p.name for p in self.sig.params)
        if names != src:
            raise StandinError(
                f"kernel {name}: the source's parameters {src} differ from the emulated "
                f"ones {names}: update the emulation"
            )
        fp = fingerprint(module.code, name)
        if name in FINGERPRINTS and FINGERPRINTS[name] != fp and STALE.get(name) != fp:
            STALE[name] = fp
            warnings.warn(
                f"the CUDA source of kernel {name} (or a __device__ function it calls) changed since "
                f"its emulation was written (fingerprint {fp}, emulated {FINGERPRINTS[name]}): "
                "review the emulation, then update FINGERPRINTS",
                stacklevel=2,
            )
        self.kernel = type("Function", (), {"ptr": next(_ptrs)})()  # RawKernel.kernel.ptr: a CUfunction
        self.attributes = {"max_threads_per_block": self.sig.bounds or 1024}

    def __call__(self, grid: Any, block: Any, args: Any, *, shared_mem: int = 0, **kw: Any) -> None:
        where = f"launch of {self.name}"
        grid, block = _dims(grid, "grid", where), _dims(block, "block", where)
        if not isinstance(args, tuple | list):
            raise StandinError(f"{where}: args must be a tuple, got {type(args).__name__}")
        g = grid + (1,) * (3 - len(grid))
        b = block + (1,) * (3 - len(block))
        if not (1 <= g[0] <= 2**31 - 1 and 1 <= g[1] <= 65535 and 1 <= g[2] <= 65535):
            raise StandinError(
                f"{where}: grid {grid} out of the device's limits (x < 2**31, y, z <= 65535, all >= 1)"
            )
        threads = b[0] * b[1] * b[2]
        if not (min(b) >= 1 and b[0] <= 1024 and b[1] <= 1024 and b[2] <= 64 and threads <= 1024):
            raise StandinError(f"{where}: block {block} out of the device's limits")
        if self.sig.bounds is not None and threads > self.sig.bounds:
            raise StandinError(
                f"{where}: block {block} exceeds __launch_bounds__({self.sig.bounds}): launch fails"
            )
        params = self.sig.params
        if len(args) != len(params):
            raise StandinError(f"{where}: {len(args)} arguments, the kernel takes {len(params)}")
        for p, a in zip(params, args, strict=True):
            _check_arg(where, p, a)
        LAUNCHES.append((self.name, g, b))
        launch = Launch(self.sig, g, b, tuple(args), self.module.typedefs, self.module.defines)
        with np.errstate(all="ignore"):
            self._fn(launch)
        launch.check_restrict()


def _dims(d: Any, what: str, where: str) -> tuple[int, ...]:
    if isinstance(d, int | np.integer):
        d = (d,)
    if not isinstance(d, tuple) or not 1 <= len(d) <= 3:
        raise StandinError(f"{where}: {what} must be a tuple of 1 to 3 ints, got {d!r}")
    for v in d:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise StandinError(f"{where}: {what} {d!r} holds a non-int {v!r}")
    return tuple(int(v) for v in d)


def _check_arg(where: str, p: Param, a: Any) -> None:
    if p.pointer:
        if not isinstance(a, np.ndarray):
            raise StandinError(f"{where}: parameter {p.text!r} gets {type(a).__name__} {a!r}, not an array")
        return
    if isinstance(a, np.ndarray):
        raise StandinError(f"{where}: scalar parameter {p.text!r} gets an array")
    if isinstance(a, np.generic):
        if a.dtype != p.dtype:
            raise StandinError(
                f"{where}: scalar parameter {p.text!r} gets a {a.dtype} ({a!r}); the kernel reads a {p.dtype}"
            )
        return
    # Python scalars: CuPy passes int as int64, float as double, bool as bool
    ok = (isinstance(a, bool) and p.dtype == np.bool_) or (
        not isinstance(a, bool)
        and ((isinstance(a, int) and p.dtype == np.int64) or (isinstance(a, float) and p.dtype == np.float64))
    )
    if not ok:
        raise StandinError(
            f"{where}: scalar parameter {p.text!r} gets Python {type(a).__name__} {a!r}, "
            f"which CuPy would not pass as a {p.dtype}"
        )


class RawModule:
    def __init__(
        self,
        code: str | None = None,
        *,
        path: str | None = None,
        options: tuple[str, ...] = (),
        backend: str = "nvrtc",
        translate_cucomplex: bool = False,
        enable_cooperative_groups: bool = False,
        name_expressions: Any = None,
        jitify: bool = False,
    ):
        if code is None:
            raise StandinError("the stand-in RawModule needs code= (no cubin paths)")
        if not isinstance(options, tuple):
            raise StandinError(f"RawModule options must be a tuple, got {type(options).__name__}")
        if "%(" in code:
            raise StandinError("the module source still holds a %(...) placeholder: not substituted")
        self.code, self.options = code, options
        self.typedefs, self.defines, self.signatures = parse_source(code)
        self._functions: dict[str, RawKernel] = {}

    def get_function(self, name: str) -> RawKernel:
        if name not in self._functions:
            self._functions[name] = RawKernel(self, name)
        return self._functions[name]


# --- the block-level reductions of the source, in NumPy, per thread along the last axis ----


def warp_sum(v: np.ndarray) -> np.ndarray:
    """``warp_sum`` on (..., 32) lane values (``__shfl_down_sync`` tree): lane 0 holds the sum."""
    v = v.copy()
    for o in (16, 8, 4, 2, 1):
        src = v.copy()
        src[..., : 32 - o] = v[..., o:]  # lanes past the warp read their own value
        v = v + src
    return v


def block_sum(v: np.ndarray) -> np.ndarray:
    """``block_sum`` over the last axis (blockDim.x threads, a multiple of 32): each warp's
    ``warp_sum``, then warp 0 sums the warps' results (lanes past them 0)."""
    bd = v.shape[-1]
    if bd % 32 or bd > 1024:
        raise StandinError(f"block_sum with blockDim.x = {bd}: not a multiple of 32 (or > 1024)")
    nw = bd // 32
    w = warp_sum(v.reshape(*v.shape[:-1], nw, 32))[..., 0]
    lanes = np.zeros((*v.shape[:-1], 32))
    lanes[..., :nw] = w
    return warp_sum(lanes)[..., 0]


def chan_merge(n, m, q, n2, m2, q2):
    """``chan_merge`` of the source, elementwise: (n, m, q) with (n2, m2, q2) added."""
    t = n + n2
    d = m2 - m
    f = n2 / t
    mm = m + d * f
    qq = q + (q2 + d * d * n * f)
    take2 = n == 0
    skip = n2 == 0
    rn = np.where(skip, n, np.where(take2, n2, t))
    rm = np.where(skip, m, np.where(take2, m2, mm))
    rq = np.where(skip, q, np.where(take2, q2, qq))
    return rn, rm, rq


def _warp_moments(n, m, q):
    for o in (16, 8, 4, 2, 1):
        n2, m2, q2 = n.copy(), m.copy(), q.copy()
        n2[..., : 32 - o] = n[..., o:]
        m2[..., : 32 - o] = m[..., o:]
        q2[..., : 32 - o] = q[..., o:]
        n, m, q = chan_merge(n, m, q, n2, m2, q2)
    return n, m, q


def block_moments(n: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``block_moments`` over the last axis: thread 0's result."""
    bd = n.shape[-1]
    if bd % 32 or bd > 1024:
        raise StandinError(f"block_moments with blockDim.x = {bd}: not a multiple of 32 (or > 1024)")
    nw = bd // 32
    shape = (*n.shape[:-1], nw, 32)
    wn, wm, wq = (a[..., 0] for a in _warp_moments(n.reshape(shape), m.reshape(shape), q.reshape(shape)))
    ln, lm, lq = (np.zeros((*n.shape[:-1], 32)) for _ in range(3))
    ln[..., :nw], lm[..., :nw], lq[..., :nw] = wn, wm, wq
    rn, rm, rq = _warp_moments(ln, lm, lq)
    return rn[..., 0], rm[..., 0], rq[..., 0]
