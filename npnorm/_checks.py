"""Input validation shared by the functional layer and the modules.

Every check raises before anything is computed or stored, with a message that says
what was expected and what arrived.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import array_api_compat
import numpy as np

from ._backend import (
    SHOWN_VALUES,
    Array,
    Namespace,
    an_array,
    backend_name,
    check_dense,
    check_floating,
    compute_dtype,
    grad_tracked,
    namespace_of,
    repeats_elements,
    shown,
    to_host,
    writable,
)

Shape = tuple[int, ...]


def as_shape(
    normalized_shape: int | Sequence[int], what: str = "normalized_shape", *, after: str = ""
) -> Shape:
    """An int or a sequence of ints as a non-empty tuple of positive ints. ``after``: the
    arguments before it in a function's signature, named in the error where an array came
    in its place (a weight, mean or rstd passed one argument early)."""
    if type(normalized_shape) is int and normalized_shape > 0:  # the common calls, cheaply
        return (normalized_shape,)
    if type(normalized_shape) is tuple and len(normalized_shape) == 1:
        d = normalized_shape[0]
        if type(d) is int and d > 0:
            return normalized_shape
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape: Shape = (int(normalized_shape),)
    else:
        try:
            items = tuple(normalized_shape)  # type: ignore[arg-type]
            if any(isinstance(d, bool) for d in items):
                raise TypeError("a bool is not a size")
            # operator.index: ints of any kind (np.int64 too), never a float or a string's digits
            shape = tuple(operator.index(d) for d in items)
        except TypeError as err:
            hint = ""
            if after and an_array(normalized_shape):
                hint = f" (an array where the shape goes: {what} comes right after {after})"
            raise TypeError(
                f"{what} must be an int or a sequence of ints, got {shown(normalized_shape)}{hint}"
            ) from err
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"{what} must be a non-empty shape of positive sizes, got {shown(normalized_shape)}")
    return shape


def prod(shape: Sequence[int]) -> int:
    return math.prod(map(int, shape))  # (map: half a generator's cost; a small call makes several)


def float_inputs(*arrays: Array | None, names: Sequence[str], required: int = 1) -> Namespace:
    """Namespace of the arrays, each checked to be a floating array of that backend; the
    first ``required`` of them may not be None."""
    xp = _float_numpy_namespace(arrays, required)
    if xp is not None:
        return xp
    for i, (name, a) in enumerate(zip(names, arrays, strict=True)):
        if isinstance(a, np.matrix):
            raise TypeError(
                f"{name}: np.matrix is not supported (its * is a matrix product): pass np.asarray(a)"
            )
        if (a is None and i < required) or (a is not None and not array_api_compat.is_array_api_obj(a)):
            raise TypeError(
                f"{name}: expected an array (numpy, cupy or another Array API namespace), "
                f"got {type(a).__name__}"
            )
        if isinstance(a, np.ma.MaskedArray):  # the kernel families would disagree on the mask
            raise TypeError(
                f"{name}: masked arrays are not supported (a norm layer has no notion of a mask): "
                "pass a.filled(value), or normalize a.compressed()"
            )
    xp = namespace_of(*arrays, what="the arrays", names=names)
    for name, a in zip(names, arrays, strict=True):
        if a is not None:
            check_dense(a, name)
            check_floating(xp, a, name)
            check_known_shape(a, name)
    return xp


def check_known_shape(a: Array, what: str) -> None:
    """Raise ``ValueError`` when a size of ``a`` is unknown: the Array API's ``None``, or
    dask's NaN after boolean indexing (the checks and the reductions need every size)."""
    if any(d is None or d != d for d in a.shape):
        raise ValueError(
            f"{what}: every size must be known, got shape {tuple(a.shape)} (a size computed "
            "lazily, as after boolean indexing; on dask, call x.compute_chunk_sizes() first)"
        )


# Array types whose dtype is a NumPy dtype and whose namespace their type decides: for
# arrays of one of them, a type and a dtype test stand for float_inputs' full checks.
# CuPy's ndarray joins when npnorm.kernels.cupy_fused is imported (``fast_float_type``).
_FAST_FLOAT_TYPES: set[type] = {np.ndarray}


def fast_float_type(t: type) -> None:
    """Let arrays of exact type ``t`` (a NumPy dtype, a namespace ``t`` decides) take
    float_inputs' cheap path."""
    _FAST_FLOAT_TYPES.add(t)


def _float_numpy_namespace(arrays: tuple[Array | None, ...], required: int) -> Namespace | None:
    """The namespace when every array present is a float16/32/64 array of one type of
    ``_FAST_FLOAT_TYPES`` (NumPy's ndarray; CuPy's once its kernels are loaded) and the first
    ``required`` are present (the common call: a type and dtype test per array), else
    None (the full checks decide)."""
    kind = None
    for a in arrays:
        if a is None:
            if required > 0:
                return None
        else:
            if kind is None:
                kind = type(a)
                if kind not in _FAST_FLOAT_TYPES:
                    return None
            if type(a) is not kind or a.dtype.char not in "efd":
                return None
        required -= 1
    return namespace_of(*arrays)


def check_trailing(x: Array, shape: Shape, what: str = "input") -> None:
    """``x`` must end in ``shape``."""
    k = len(shape)
    if x.ndim < k or tuple(x.shape[x.ndim - k :]) != shape:
        # (a shape of more sizes than SHOWN_VALUES, an int array's values, is not spelled out)
        sizes = ", ".join(map(str, shape)) if k <= SHOWN_VALUES else f"the {k} sizes of the normalized shape"
        raise ValueError(
            f"{what} of shape {tuple(x.shape)} does not end in the normalized shape "
            f"{shown(shape)}: expected an input of shape (*, {sizes})"
        )


def check_param(p: Array | None, shape: Shape, name: str) -> None:
    if p is not None and tuple(p.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(p.shape)}")


def check_grad_output(grad_output: Array, x: Array) -> None:
    if tuple(grad_output.shape) != tuple(x.shape):
        raise ValueError(
            f"grad_output must have the shape of the forward's input {tuple(x.shape)}, "
            f"got {tuple(grad_output.shape)}"
        )


def check_row_stats(x: Array, shape: Shape, **stats: Array) -> None:
    """Saved per-row statistics must hold one value per row of ``x`` (any shape of
    that size, e.g. the batch shape forward returns)."""
    rows = prod(x.shape[: x.ndim - len(shape)])
    for name, a in stats.items():
        if int(prod(a.shape)) != rows:
            raise ValueError(
                f"{name} must hold one value per row: {rows} for an input of shape "
                f"{tuple(x.shape)} normalized over {shape}, got shape {tuple(a.shape)}"
            )


def check_count(value: Any, what: str, expected: str = "a positive int") -> int:
    """A positive int (any integer, one with ``__index__``: NumPy's too, as PyTorch accepts
    them; not a bool) as an int; ``expected`` words the errors."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        count = operator.index(value)
    except TypeError:  # PyTorch: TypeError
        raise TypeError(f"{what} must be {expected}, got {shown(value)}") from None
    if count <= 0:
        raise ValueError(f"{what} must be {expected}, got {shown(value)}")
    return count


def check_flag(value: Any, what: str) -> bool:
    """A bool (NumPy's too), as a bool: PyTorch's functions refuse anything else with a
    TypeError, where a truthy string such as "False" would silently select training."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{what} must be a bool, got {shown(value)}")


def check_backward_training(value: Any, what: str) -> bool:
    """A BatchNorm backward's ``training``, which it requires: the forward's is False by
    default (inference), a training forward's gradient is another formula, and the saved
    ``mean``/``rstd`` do not say which the forward was."""
    if value is None:
        raise TypeError(
            f"{what}() needs training=: the value the forward was called with (True: batch "
            "statistics, whose gradient flows through them; False: running statistics, the "
            "forward's default)"
        )
    return check_flag(value, f"{what}: training")


def check_real(value: Any, what: str) -> float:
    """A real number (of any type: NumPy's float32 too; not a bool) as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {shown(value)}")
    return float(value)


def check_eps(eps: Any) -> float:
    if type(eps) is float and eps >= 0:  # the common call, cheaply (NaN falls through)
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):  # PyTorch: TypeError
        raise TypeError(f"eps must be a non-negative number, got {shown(eps)}")
    if not float(eps) >= 0:  # negative or NaN (PyTorch lets some through: npnorm refuses all)
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return float(eps)


def cast(xp: Namespace, x: Array, dtype: Any) -> Array:
    """``x`` in ``dtype``, without a copy when it already is."""
    if x.dtype == dtype:
        return x
    if type(x) is np.ndarray:  # (the same copy as array_api_compat's astype, without its device check)
        return x.astype(dtype)
    return xp.astype(x, dtype)


_WIDE = (np.dtype(np.float32), np.dtype(np.float64))  # NumPy dtypes that are their own computation dtype


def work_dtype(xp: Namespace, *arrays: Array | None) -> Any:
    """The computation dtype of these arrays (see ``compute_dtype``)."""
    first = arrays[0]
    if type(first) is np.ndarray and first.dtype in _WIDE:  # the common call, cheaply: NumPy
        dt = first.dtype  # arrays all of one float32 or float64 dtype (a third of the time)
        for a in arrays:
            if a is not None and (type(a) is not np.ndarray or a.dtype != dt):
                break
        else:
            return dt
    return compute_dtype(xp, *(a.dtype for a in arrays if a is not None))


def default_eps(xp: Namespace, input: Array) -> float:
    """RMSNorm's ``eps=None``, as PyTorch's: the machine epsilon of the input's dtype
    (float32's for float16, bfloat16 and float32 input; float64's for float64), whatever
    the weight's dtype, even where a float64 weight widens the computation."""
    return float(xp.finfo(work_dtype(xp, input)).eps)


def check_out(xp: Namespace, out: Array | None, like: Array, what: str = "out") -> None:
    """``out`` (when given) must be a writable array of ``xp`` with ``like``'s shape and
    dtype (as torch's ``out=``: no broadcasting, no casting; NumPy's byte order aside),
    each element at its own memory location (no zero stride), not masked, and, while
    torch's grad mode is on, not a torch tensor that requires grad."""
    if out is None or plain_out(xp, out, like, what):
        return
    check_out_fully(xp, out, like, what)


def plain_out(xp: Namespace, out: Array, like: Array, what: str = "out") -> bool:
    """Whether ``out`` is the common ``out=``, a plain writable C-ordered NumPy array of
    ``like``'s shape and dtype, not empty (so no zero stride: an empty view can have them,
    and ``check_out_fully`` refuses those), which passes every check of
    ``check_out_fully``: a few attribute tests (0.4 us) instead of 1.3 us of checks."""
    return bool(
        type(out) is np.ndarray
        and type(like) is np.ndarray  # (before comparing dtypes: array_api_strict warns)
        and out.size
        and out.shape == like.shape
        and out.dtype == like.dtype
        and out.flags.c_contiguous
        and out.flags.writeable
        and namespace_of(out, what=what) is xp
    )


def check_out_fully(xp: Namespace, out: Array, like: Array, what: str = "out") -> None:
    """``check_out``'s checks, each with its error."""
    if isinstance(out, np.ma.MaskedArray):  # the families would disagree on its mask
        raise TypeError(f"{what}: masked arrays are not supported: pass a plain array (out.data)")
    check_dense(out, what, written=True)
    if namespace_of(out, what=what) is not xp:
        raise TypeError(f"{what} must be an array of the input's backend ({xp.__name__}), got {type(out)}")
    if tuple(out.shape) != tuple(like.shape):
        raise ValueError(f"{what} must have the input's shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if out.dtype != like.dtype and not same_but_byte_order(out.dtype, like.dtype):
        raise TypeError(f"{what} must have the input's dtype {like.dtype}, got {out.dtype}")
    if repeats_elements(out):
        raise ValueError(  # (np.broadcast_arrays, expand: each result would overwrite others)
            f"{what} has more than one element at one memory location (a zero stride, from "
            "broadcasting): each element needs its own; pass a new array "
            f"({backend_name(xp)}.empty(out.shape, dtype=out.dtype))"
        )
    if not writable(out):
        raise ValueError(f"{what} is read-only (an immutable array, such as JAX's, cannot take out=)")
    if grad_tracked(out):  # torch's out= refuses it too: the write would bypass autograd
        raise RuntimeError(
            f"{what} requires grad: npnorm writes it outside autograd, as torch's out= functions "
            "refuse to; pass a tensor that does not require grad, or call under torch.no_grad()"
        )


def same_but_byte_order(a: Any, b: Any) -> bool:
    """Whether NumPy dtypes ``a`` and ``b`` differ in byte order only (``>f4``, float32)."""
    return isinstance(a, np.dtype) and isinstance(b, np.dtype) and a.newbyteorder("=") == b.newbyteorder("=")


def write_out(xp: Namespace, out: Array | None, result: Array) -> Array:
    """``result`` itself, or copied into ``out`` (which is returned) when given."""
    if out is None:
        return result
    if prod(out.shape) > 0:  # (nothing to write: dask refuses an empty assignment)
        out[...] = result
    return out


def changed_in_place(arrays: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """The names, in order, of ``arrays`` (name: (a copy taken before a call, the array
    passed to it)) whose values the call changed; NaN equals NaN. gradcheck and the
    exercise grader refuse a function that wrote into what it was given."""
    return [
        name
        for name, (before, after) in arrays.items()
        if not np.array_equal(to_host(before), to_host(after), equal_nan=True)
    ]
