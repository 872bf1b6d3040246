"""Backend dispatch: which array namespace an array belongs to, and dtype rules.

npnorm follows the Array API community's convention (the one SciPy and scikit-learn
use): the namespace is read off the arrays with ``array_api_compat.array_namespace``,
so NumPy, CuPy and ``array_api_strict`` arrays all go through one code path. Nothing
here imports CuPy or torch: a backend is imported only when the user names it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import reprlib
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import array_api_compat
import numpy as np

Array = Any  # an array of any Array API namespace (numpy, cupy, array_api_strict, ...)
Namespace = Any  # an Array API namespace module

FLOAT_NAMES = ("float16", "float32", "float64")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def an_array(value: object) -> bool:
    """Whether ``value`` is an array of one dimension or more (NumPy's, torch's, ...)."""
    try:
        shape = getattr(value, "shape", None)
        return getattr(value, "dtype", None) is not None and isinstance(shape, tuple) and len(shape) > 0
    except Exception:  # a shape that raises (torch's nested tensors): not one to describe
        return False


# the values an array, list or tuple may have for its repr in an error message: a longer
# array is named by its shape and dtype, a longer list or tuple cut short (a weight passed
# where normalized_shape, eps or training goes printed its 768 values, 3.5 KB)
SHOWN_VALUES = 8
_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = SHOWN_VALUES
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 1 << 16  # (the rest as repr has it)


def shown(value: object) -> str:
    """``value`` for an error message (never raising): its repr, for an array of more than
    SHOWN_VALUES values its shape, dtype and type, and a longer list or tuple cut short."""
    try:
        if an_array(value):
            shape = tuple(int(d) for d in value.shape)  # type: ignore[attr-defined]
            if math.prod(shape) > SHOWN_VALUES:
                dtype = value.dtype  # type: ignore[attr-defined]
                return f"an array of shape {shape} and dtype {dtype} ({type(value).__name__})"
        elif isinstance(value, (list, tuple)):
            return _SHORT.repr(value)
    except Exception:  # a size not known (dask's NaN, a nested tensor's): its own repr
        pass
    return repr(value)


def no_fp_warnings(fn: F) -> F:
    """Run ``fn`` with NumPy's floating-point warnings off, as PyTorch's kernels never
    warn: a result that does not fit its dtype (an output beyond float32's range, 1/0
    from ``eps=0`` on a constant row) shows as inf or nan in the output instead of a
    ``RuntimeWarning`` from inside npnorm. Intermediate sums are kept finite where the
    result is (statistics in float64), so this only silences genuinely non-finite
    results. Backends that never warn (CuPy) are unaffected."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return quiet  # type: ignore[return-value]


# Namespaces by array type, for the types whose namespace the type alone decides (NumPy,
# CuPy and torch arrays; not array_api_strict, whose arrays carry an API version): the
# common call then costs a dict lookup instead of array_namespace's inspection.
_NAMESPACE_BY_TYPE: dict[type, Namespace] = {}


def _cached_namespace(arrays: tuple[Any, ...]) -> Namespace | None:
    """The cached namespace when every array present has one cached type, else None."""
    kind = None
    for a in arrays:
        if a is None:
            continue
        t = type(a)
        if kind is None:
            kind = t
        elif t is not kind:
            return None
    return None if kind is None else _NAMESPACE_BY_TYPE.get(kind)


def _type_decides_namespace(a: Any) -> bool:
    aac = array_api_compat
    return bool(aac.is_numpy_array(a) or aac.is_cupy_array(a) or aac.is_torch_array(a))


def namespace_of(*arrays: Any, what: str = "arrays", names: Sequence[str] | None = None) -> Namespace:
    """The Array API namespace shared by ``arrays`` (``None`` entries ignored); ``names``
    (one per array) name them by backend in the error.

    Raises
    ------
    TypeError
        If an entry is not an array, or the arrays come from different backends.
    """
    cached = _cached_namespace(arrays)
    if cached is not None:
        return cached
    present = [a for a in arrays if a is not None]
    if not present:
        raise TypeError(f"{what}: expected an array (numpy, cupy or another Array API namespace), got None")
    for a in present:
        if not array_api_compat.is_array_api_obj(a):
            raise TypeError(
                f"{what}: expected an array (numpy, cupy or another Array API "
                f"namespace), got {type(a).__name__}"
            )
    try:
        xp = array_api_compat.array_namespace(*present)
    except TypeError as err:

        def kind(a: Any) -> str:
            return type(a).__module__.split(".")[0] + "." + type(a).__name__

        if names is None:
            listing = ", ".join(sorted({kind(a) for a in present}))
        else:  # each backend with the arrays of it: "grad_output: numpy.ndarray; input, ...: torch.Tensor"
            by_kind: dict[str, list[str]] = {}
            for name, a in zip(names, arrays, strict=True):
                if a is not None:
                    by_kind.setdefault(kind(a), []).append(name)
            listing = "; ".join(f"{', '.join(of)}: {k}" for k, of in by_kind.items())
        first = _backend_of(present[0])
        rest = {_backend_of(a) for a in present[1:]}
        if names is not None and names[0] == "grad_output" and len(rest) == 1 and first not in rest:
            # a backward whose grad_output alone is of another backend: the forward's
            (theirs,) = rest
            hint = (
                f"pass grad_output as an array of the forward's backend ({theirs}), converted from "
                f"{type(present[0]).__name__} (moving the module with to() would drop the saved forward)"
            )
        elif names is not None:  # a function's arrays (a module checks its own, without names)
            lead = next(n for n, a in zip(names, arrays, strict=True) if a is not None)
            hint = f"convert them to one backend first (the {lead}'s: {first})"
        else:
            hint = (
                f"move them to one backend first: for {type(present[0]).__name__} input, "
                f"module.to({first!r}) moves a module's arrays (or create the module with xp={first!r})"
            )
        raise TypeError(
            f"{what} live on different array backends ({listing}); {hint}; "
            "npnorm runs on NumPy, CuPy, torch tensors and any Array API namespace"
        ) from err
    types = {type(a) for a in present}
    if len(types) == 1 and _type_decides_namespace(present[0]):
        _NAMESPACE_BY_TYPE[types.pop()] = xp
    return xp


def backend_name(xp: Namespace) -> str:
    """The name ``resolve_namespace`` turns back into ``xp``: ``"numpy"``, ``"cupy"``,
    ``"torch"``, ``"array_api_strict"`` (array_api_compat's wrappers without their prefix)."""
    name: str = xp.__name__
    return name.removeprefix("array_api_compat.")


def _backend_of(a: Any) -> str:
    try:
        return backend_name(array_api_compat.array_namespace(a))
    except TypeError:
        return type(a).__module__.split(".")[0]


def resolve_namespace(xp: str | ModuleType | None) -> Namespace:
    """Turn ``None``, a name (``"numpy"``, ``"cupy"``, ``"array_api_strict"``) or a
    namespace module into the namespace ``array_namespace`` reports for its arrays."""
    if xp is None:
        xp = "numpy"
    if isinstance(xp, str):
        named = {"half": "float16", "float": "float32", "double": "float64"}.get(xp, xp)
        if named in (*FLOAT_NAMES, "bfloat16"):  # m.to("float64"): a torch habit
            hint = (
                f"m.to(dtype={named!r}), or the constructors' dtype="
                if named in FLOAT_NAMES
                else "a module's dtype is float16, float32 or float64"
            )
            raise ValueError(f"xp={xp!r} names a dtype, not an array backend: dtypes go in dtype= ({hint})")
        try:
            module = importlib.import_module(xp)
        except ImportError as err:
            raise ValueError(
                f"array backend {xp!r} is not installed (xp names a backend: numpy, torch, cupy, "
                f"array_api_strict, ...; a device such as 'cuda' goes in device=)"
            ) from err
    elif isinstance(xp, ModuleType):
        module = xp
    else:
        raise TypeError(
            f"xp must be None, a backend name or a namespace module, got {shown(xp)} (a dtype goes "
            f"in dtype=, a device in device=)"
        )
    try:
        return array_api_compat.array_namespace(module.empty((0,)))
    except (AttributeError, TypeError) as err:  # xp="json": a module, but no array library
        sub = f"{module.__name__}.numpy"  # "jax": its arrays come from jax.numpy
        hint = f"; did you mean {sub!r}?" if _module_exists(sub) else ""
        raise ValueError(f"xp={module.__name__!r} is not an array backend ({err}){hint}") from err


def _module_exists(name: str) -> bool:
    """Whether the module ``name`` (``"jax.numpy"``) can be found. ``find_spec`` raises
    where its parent is no package or cannot be imported (``"math.numpy"``, a module made
    at run time: ModuleNotFoundError), or where ``name`` itself is in ``sys.modules``
    without a spec (ValueError), and that is an answer too."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def resolve_dtype(xp: Namespace, dtype: Any, device: Any = None) -> Any:
    """The floating dtype object of ``xp`` named by ``dtype`` (``None`` means float32),
    which ``device`` (one of ``xp``'s, or None) must have too.

    ``dtype`` may be a name (``"float64"``), a NumPy dtype or scalar type, a dtype of
    ``xp`` itself, or another backend's float dtype (``torch.float64`` on NumPy: the
    dtype of the same name, as ported ``dtype=`` arguments pass it).
    """
    if dtype is None:
        return xp.float32
    own = [n for n in FLOAT_NAMES if _library(dtype) == _library(c := getattr(xp, n, None)) and dtype == c]
    if own:  # a dtype of xp's own library (compared with no other: a NumPy dtype against
        name = own[0]  # array_api_strict's warns)
    elif isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:  # another library's dtype object, by the name it gives itself
            library, _, name = str(dtype).rpartition(".")  # ("torch", "float32")
            if library != _library(dtype):  # not a dtype that names itself: an enum, a config
                name = ""
    if name not in FLOAT_NAMES:
        raise TypeError(f"dtype must be one of {FLOAT_NAMES}, got {shown(dtype)}")
    resolved = getattr(xp, name, None)
    if resolved is None or name not in _standard_floats(xp):
        raise TypeError(
            f"backend {backend_name(xp)} has no {name} arrays"
            + (
                " (JAX makes them after jax.config.update('jax_enable_x64', True))"
                if resolved is not None
                else ""
            )
        )
    if device is not None and not device_has(xp, name, device):  # (torch's "mps")
        raise TypeError(f"backend {backend_name(xp)} has no {name} arrays on device {device!r}")
    return resolved


def device_has(xp: Namespace, name: str, device: Any) -> bool:
    """Whether ``device`` of ``xp`` makes arrays of the dtype ``name`` (True where its
    inspection does not say: a namespace without it, or float16, outside the standard)."""
    listed = _inspected(xp, lambda info: tuple(info.dtypes(device=device)), None)
    return listed is None or name == "float16" or name in listed


def _standard_floats(xp: Namespace) -> tuple[str, ...]:
    """The float dtypes ``xp`` can make now, as its Array API inspection lists them (JAX
    leaves float64 out until x64 is enabled: its float64 arrays would be float32);
    float16, outside the standard, as any backend that names it."""
    listed = _inspected(xp, lambda info: tuple(info.dtypes(kind="real floating")), None)
    return FLOAT_NAMES if listed is None else ("float16", *listed)


def counter_dtype(xp: Namespace, device: Any = None) -> Any:
    """The dtype of ``num_batches_tracked``: int64, as in PyTorch, where ``xp`` makes
    int64 arrays (on ``device``: its inspection lists them), else its widest signed
    integer (JAX without x64: int32, where an int64 request warns and gives int32
    anyway)."""
    listed = _inspected(xp, lambda info: info.dtypes(kind="signed integer", device=device), ("int64",))
    return getattr(xp, next((n for n in ("int64", "int32") if n in listed), "int64"))


def _inspected(xp: Namespace, ask: Callable[[Any], T], fallback: T) -> T:
    """``ask`` of ``xp``'s Array API inspection (``__array_namespace_info__()``), or
    ``fallback`` for an older namespace without it."""
    try:
        return ask(xp.__array_namespace_info__())
    except Exception:
        return fallback


def _library(obj: Any) -> str:
    """The top-level module of ``obj``'s type: "torch" for ``torch.float32``."""
    return type(obj).__module__.partition(".")[0]


_FLOAT_CHARS = "efd"  # NumPy's float16, float32, float64: checked without isdtype


def check_device(xp: Namespace, device: Any) -> Any:
    """The device of ``xp`` that ``device`` names: itself where ``xp`` can create arrays
    there, the backend's device of that name where ``device`` is another library's object
    or a name (``torch.device("cpu")`` on NumPy, "cpu" on JAX), ``None`` for ``None``;
    else a ``ValueError`` that says which backend refused it and why."""
    if device is None:
        return None
    try:
        xp.empty((0,), device=device)
        return device
    except Exception as err:  # torch: RuntimeError or AssertionError; NumPy: ValueError
        # another library's name of xp's default device: "cpu", or "cpu:0" (torch.device("cpu",
        # 0)), index 0 of a device without indices. JAX names no default: then each of its
        # devices, by its platform too (a ported device="cpu" failed: JAX's CPU device,
        # "cpu:0" or "TFRT_CPU_0" by version, went unmatched). (torch's inspection would probe
        # every device type, with warnings.)
        default = _default_device(xp)
        devices = [default] if default is not None else _inspected(xp, lambda info: list(info.devices()), [])
        for known in devices:
            named = [str(known), getattr(known, "platform", None)]
            names = [f"{n}{i}" for n in named if isinstance(n, str) for i in ("", ":0")]
            if known is not None and str(device) in names:
                return known
        raise ValueError(
            f"device={shown(device)} is not a device of backend {backend_name(xp)} ({err}); None means "
            f"the backend's default device, and xp= chooses the backend"
        ) from err


def _default_device(xp: Namespace) -> Any:
    """``xp``'s default device (the Array API's inspection), or None where it has none."""
    return _inspected(xp, lambda info: info.default_device(), None)


def check_dense(x: Any, what: str = "input", *, written: bool = False) -> None:
    """Raise ``TypeError`` (its message led by ``what``) for a torch tensor that is not a
    plain strided one: sparse (COO, CSR, ...), mkldnn or nested. The math reshapes, reduces
    and writes every element: such a tensor failed deep inside, with torch's own error or
    an AttributeError (a checkpoint's sparse tensor after others were loaded), where this
    one says what to pass instead (``written``: an array to write into, ``out=``)."""
    if type(x) is np.ndarray or not array_api_compat.is_torch_array(x):
        return
    said = f"{what}: " if what else ""
    instead = "pass a dense tensor to write into" if written else ""
    if getattr(x, "is_nested", False):  # layout torch.jagged, or torch.strided for the older kind
        raise TypeError(
            f"{said}nested torch tensors are not supported: "
            + (
                instead
                or "normalize each component (x.unbind()), or, over a jagged tensor's regular "
                "last dimension, its x.values()"
            )
        )
    layout = getattr(x, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        raise TypeError(
            f"{said}a torch tensor of layout {layout} is not supported: npnorm takes dense "
            f"(strided) tensors ({instead or 'x.to_dense() makes one'})"
        )


def check_floating(xp: Namespace, x: Array, what: str = "input") -> None:
    """Raise ``TypeError`` unless ``x`` has a real floating dtype."""
    if type(x) is np.ndarray and x.dtype.char in _FLOAT_CHARS:
        return
    try:
        floating = xp.isdtype(x.dtype, "real floating")
    except TypeError:  # a dtype the namespace does not know: NumPy's ml_dtypes.bfloat16, ...
        floating = False
    if floating and isinstance(x, np.ndarray) and x.dtype.char not in _FLOAT_CHARS:
        floating = False  # NumPy's longdouble: torch has none, and the kernels compute float64
    if not floating:
        raise TypeError(
            f"{what} must have a floating dtype (float16/32/64, or a backend's bfloat16, such as "
            f"torch's; NumPy arrays of ml_dtypes' bfloat16 or of longdouble are not taken: cast "
            f"them to float32 or float64), got {x.dtype}"
        )


def compute_dtype(xp: Namespace, *dtypes: Any) -> Any:
    """The dtype the math runs in: the widest of the given dtypes and float32.

    float16 input is therefore computed in float32, and an input whose dtype differs
    from the parameters' is computed at the wider of the two precisions.
    """
    present = tuple(d for d in dtypes if d is not None)
    key = (xp.__name__, present)
    try:
        return _RESULT_TYPES[key]
    except KeyError:
        pass
    except TypeError:  # a backend whose dtypes do not hash
        return xp.result_type(xp.float32, *present)
    ct = _RESULT_TYPES[key] = xp.result_type(xp.float32, *present)
    return ct


_RESULT_TYPES: dict[tuple[str, tuple[Any, ...]], Any] = {}


def to_namespace(value: Any, xp: Namespace, dtype: Any = None) -> Array:
    """Copy ``value`` (an array of any backend, a CPU torch tensor, a list or a
    scalar) into a fresh array of ``xp``, optionally cast to ``dtype``.

    The result never shares memory with ``value``: a CPU torch tensor or a NumPy
    array is viewed by ``_to_host`` without a copy, so the copy is made here, always.
    Nor does it share autograd history: a torch tensor that requires grad (an
    ``nn.Parameter``) gives a plain tensor.
    """
    if _not_numbers(value):
        raise TypeError(f"expected an array, a tensor or numbers, got {_kind(value)}")
    check_dense(value, "")  # (a sparse tensor was staged, then failed its copy in place)
    if isinstance(value, np.ma.MaskedArray):  # its masked values would load as numbers
        raise TypeError(
            "masked arrays are not supported (a norm layer's state has no mask): pass a.filled(value)"
        )
    if array_api_compat.is_array_api_obj(value) and array_api_compat.array_namespace(value) is xp:
        out = copy_array(value)
        if dtype is not None and out.dtype != dtype and _integral(xp, out.dtype):
            _check_integers_fit(xp, _to_host(out), dtype)
    else:
        host = _to_host(value)
        if _not_numbers(host):  # a list of None, say
            held = " that NumPy holds only as Python objects" if host.dtype.kind == "O" else ""
            beyond = " (an integer beyond int64's range?)" if held and _has_big_int(value) else ""
            raise TypeError(f"expected an array, a tensor or numbers, got {_kind(value)}{held}{beyond}")
        _check_integers_fit(xp, host, dtype)  # (before xp.asarray: JAX without x64 wraps there)
        copy: bool | None = True
        if isinstance(host, np.ndarray) and (
            not host.dtype.isnative or any(s < 0 for s in host.strides) or not host.flags.writeable
        ):
            # a reversed view, a big-endian .npz: torch (and DLPack) take neither; a read-only
            # array (JAX's, through DLPack; a memmap): torch warns that it cannot be written
            host = host.astype(host.dtype.newbyteorder("="), order="C")  # (0-d stays 0-d)
            copy = None  # the copy is made: not a second one
        try:
            out = xp.asarray(host, copy=copy)
        except TypeError:
            if not _is_float16(host):
                raise
            out = xp.asarray(host.astype(np.float32), copy=None)  # exact: array_api_strict has no float16
    if dtype is not None and out.dtype != dtype:
        with np.errstate(all="ignore"):  # as torch's casts: beyond float16's range is inf, no warning
            out = xp.astype(out, dtype)
    return out


def _is_float16(host: Any) -> bool:
    dtype = getattr(host, "dtype", None)
    return isinstance(dtype, np.dtype) and dtype.kind == "f" and dtype.itemsize == 2


def _integral(xp: Namespace, dtype: Any) -> bool:
    """Whether ``dtype`` is an integer dtype of ``xp`` (False for one it does not know, such
    as ml_dtypes' bfloat16 on NumPy)."""
    try:
        return bool(xp.isdtype(dtype, "integral"))
    except TypeError:
        return False


def _check_integers_fit(xp: Namespace, host: Any, dtype: Any) -> None:
    """An OverflowError where the integers ``host`` (NumPy's) do not fit ``dtype``, an
    integer dtype of ``xp`` they are to become: the casts wrap around (a uint64 counter of
    2**64 - 1 loaded as -1, and a BatchNorm with momentum=None then divided by 0; JAX
    without x64 made an int64 2**40 a 0). Checked on NumPy's copy: torch has no min of its
    unsigned tensors."""
    host = np.asarray(host)
    if host.dtype.kind not in "iu" or not host.size or not (dtype is None or _integral(xp, dtype)):
        return
    # the dtype xp makes (JAX without x64 makes int32 of int64, asked for or not: None too)
    with warnings.catch_warnings():  # (JAX warns that it truncates an int64 asked for)
        warnings.simplefilter("ignore")
        native = host.dtype.newbyteorder("=")  # (torch refuses a big-endian array, an .npz's)
        made = xp.asarray(np.zeros((), native) if dtype is None else 0, dtype=dtype).dtype
    if not _integral(xp, made):
        return
    info, held_info = xp.iinfo(made), np.iinfo(native)
    if info.min <= held_info.min and info.max >= held_info.max:
        return  # (every value of the dtype fits: nothing to scan)
    lo, hi = int(host.min()), int(host.max())
    if lo < info.min or hi > info.max:
        held = str(lo) if lo == hi else f"integers from {lo} to {hi}"
        raise OverflowError(f"{held} does not fit {made} ({info.min} to {info.max})")


def _kind(value: Any) -> str:
    """``value``'s class, and its dtype where it has one (``ndarray of datetime64[D]``)."""
    dtype = getattr(value, "dtype", None)
    return type(value).__name__ + ("" if dtype is None else f" of {dtype}")


def _has_big_int(value: Any) -> bool:
    """Whether ``value`` is, or a list or tuple (nested) holds, an int beyond int64's range."""
    if isinstance(value, (list, tuple)):
        return any(_has_big_int(v) for v in value)
    return isinstance(value, int) and not -(2**63) <= value < 2**63


def _not_numbers(value: Any) -> bool:
    """Whether ``value`` is None, a string, or a NumPy array (or scalar) of strings,
    objects, records, dates or time spans, which torch refuses as a tensor's values (an
    extension dtype such as ml_dtypes' bfloat16, kind "V" too, holds numbers)."""
    if value is None or isinstance(value, (str, bytes)):
        return True
    if not isinstance(value, (np.ndarray, np.generic)):
        return False
    return value.dtype.kind in "OUSVMm" and value.dtype.isbuiltin != 2


def copy_array(a: Array) -> Array:
    """A copy of ``a`` on its own backend and device, sharing no memory with it (and, for
    a torch tensor, no autograd history: npnorm computes its own backward)."""
    if array_api_compat.is_torch_array(a):
        a = a.detach()
    return array_api_compat.array_namespace(a).asarray(a, copy=True)


def requires_grad(a: Any) -> bool:
    """Whether ``a`` is a torch tensor that requires grad."""
    return bool(getattr(a, "requires_grad", False)) and array_api_compat.is_torch_array(a)


def grad_tracked(a: Any) -> bool:
    """Whether ``a`` is a torch tensor that requires grad while torch's grad mode is on:
    where torch refuses it as an ``out=`` or as running statistics, since npnorm would
    write it outside autograd."""
    if not requires_grad(a):
        return False
    import torch

    return bool(torch.is_grad_enabled())


def torch_refuses_in_place(a: Any) -> bool:
    """Whether torch refuses an in-place write to ``a`` (after making it, for some
    writes): an inference tensor (made inside ``torch.inference_mode()``) outside it."""
    if type(a) is np.ndarray or not array_api_compat.is_torch_array(a):  # (NumPy's: at once)
        return False
    import torch

    return bool(a.is_inference() and not torch.is_inference_mode_enabled())


def repeats_elements(a: Any) -> bool:
    """Whether two of ``a``'s elements are at one memory location: a zero stride along an
    axis of length 2 or more (broadcasting: NumPy's ``broadcast_to``, torch's ``expand``).
    An axis of length 1 may have a zero stride with no element repeated (NumPy's
    ``x[:, None]``), and an empty array has no two elements (NumPy gives ``np.empty((0,
    3))`` zero strides)."""
    if type(a) is np.ndarray and 0 not in a.strides:  # (the common call: no zero stride)
        return False
    shape = tuple(a.shape)
    strides = a.stride() if array_api_compat.is_torch_array(a) else getattr(a, "strides", None)
    if strides is None or math.prod(shape) == 0:
        return False
    return any(st == 0 and n > 1 for st, n in zip(strides, shape, strict=False))


def writable(a: Any) -> bool:
    """Whether ``a``'s values can be written in place: not a read-only NumPy array (nor
    an array_api_strict array over one), not an array of an immutable library such as
    JAX, and no two of its elements at one memory location (a zero stride: NumPy's
    ``broadcast_to`` made writable, torch's ``expand``, to which torch refuses writes).
    ``array_api_compat.is_writeable_array`` says True for the last two and for a
    read-only array_api_strict array, whose writes then raised half-way through a
    module's update."""
    if type(a) is np.ndarray:  # (the common call, without array_api_compat's tests)
        return bool(a.flags.writeable) and not repeats_elements(a)
    if not array_api_compat.is_writeable_array(a) or repeats_elements(a):
        return False
    if type(a).__module__.startswith("array_api_strict"):  # it wraps a NumPy array, which
        inner = getattr(a, "_array", None)  # holds the flag (no public attribute has it)
        return not isinstance(inner, np.ndarray) or bool(inner.flags.writeable)
    return True


def write_uncounted(current: Array, value: Array) -> None:
    """``current[...] = value`` as PyTorch's kernels write a layer's running statistics:
    for a torch tensor through ``.data``, which leaves its in-place change counter
    (``_version``) alone and takes an inference tensor or a leaf that requires grad as
    torch's batch_norm does (a plain write bumped the counter, failing the backward of a
    module that shares the buffer, and refused those two)."""
    if array_api_compat.is_torch_array(current):
        current.data[...] = value
    else:
        current[...] = value


def on_device_of(like: Array, a: Array) -> Array:
    """``a`` (an array of ``like``'s backend) on ``like``'s device: itself where it is
    there already, else a copy (as PyTorch's ``copy_`` loads a checkpoint across devices)."""
    device = array_api_compat.device(like)
    return a if array_api_compat.device(a) == device else array_api_compat.to_device(a, device)


def to_host(value: Any) -> np.ndarray:
    """A NumPy copy of ``value`` (any backend, torch tensor, list or scalar), in native
    byte order (``torch.from_numpy`` refuses a ``>f4`` array)."""
    a = np.asarray(_to_host(value))
    return np.array(a, dtype=a.dtype.newbyteorder("="), copy=True)


def _to_host(value: Any) -> Any:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
        # its lazy conjugation and negation applied (``x.conj().imag`` is a view with the
        # negative bit set: DLPack hands over the memory without it, the values' signs lost)
        for name in ("resolve_conj", "resolve_neg"):
            resolve = getattr(value, name, None)  # (another library's tensor may lack them)
            if resolve is not None:
                value = resolve()
        if value.is_floating_point() and str(value.dtype).removeprefix("torch.") not in FLOAT_NAMES:
            # bfloat16, float8_*: NumPy has no such dtype; float32 holds their values exactly
            value = value.float()
    if array_api_compat.is_cupy_array(value):
        return _standard_host(value.get())
    if array_api_compat.is_array_api_obj(value) and not isinstance(value, (np.ndarray, np.generic)):
        # e.g. array_api_strict: go through DLPack where the array supports it
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError, AttributeError):
            return np.asarray(value)
    return _standard_host(np.asarray(value))


def _standard_host(a: np.ndarray) -> np.ndarray:
    """``a``, or its float32 copy when its dtype is one NumPy itself lacks (ml_dtypes'
    bfloat16, float8_*, float4_*, int4, ...: user-defined NumPy dtypes, each of which
    converts to float32 exactly). Other backends know only the standard dtypes."""
    if a.dtype.isbuiltin == 2:  # a user-defined dtype
        try:
            return a.astype(np.float32)
        except (TypeError, ValueError):
            return a
    return a
