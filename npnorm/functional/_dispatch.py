"""Which kernel computes an operation, and the public kernel selection.

Every operation has a generic kernel written against the Array API: the readable
reference, used for every backend. NumPy input can also run one of two faster kernel
families with the same signatures, each tested against the reference:

* ``"numpy"``: blocked NumPy calls (``npnorm.kernels.numpy_fast``,
  ``numpy_fast_channels``, ``numpy_fast_sync``), always available;
* ``"numba"``: fused compiled loops (``npnorm.kernels.numba_rows``,
  ``numba_channels``), available when numba imports (the ``fast`` extra); an op it
  has no loop for (SyncBatchNorm's per-rank pieces) runs the ``"numpy"`` kernel.

``get_kernels()`` names the family NumPy input runs now; the start value is the
environment variable ``NPNORM_KERNELS`` if set, else ``"numba"`` when numba imports,
else ``"numpy"``. ``set_kernels(name)`` changes it for the process,
``use_kernels(name)`` within a ``with`` block (in the calling thread and context only).
``"reference"`` runs the generic kernels for every backend.

Another backend may register its own kernels (``specialized(op, namespace_name)``);
they run unless ``"reference"`` is selected. CuPy arrays have fused CUDA kernels for
LayerNorm, RMSNorm, BatchNorm and InstanceNorm (``npnorm.kernels.cupy_fused``), imported the first
time a CuPy array is seen. The math modules never branch on the
backend themselves: they ask ``kernel(op, xp)``. The kernel modules are imported the
first time their family is used, so ``import npnorm`` imports neither numba nor them.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import array_api_compat
import numpy as np

from .._backend import Namespace, grad_tracked
from .._threads import get_num_threads

F = TypeVar("F", bound=Callable[..., Any])

NUMPY = "array_api_compat.numpy"  # the namespace name array_namespace gives NumPy arrays
TORCH = "array_api_compat.torch"
REFERENCE = "reference"
ENV_VAR = "NPNORM_KERNELS"

# The kernel families for NumPy input: the modules that register them, and the
# third-party module each needs. The default is the first available of DEFAULT_ORDER.
_FAMILIES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "numpy": (
        ("npnorm.kernels.numpy_fast", "npnorm.kernels.numpy_fast_channels", "npnorm.kernels.numpy_fast_sync"),
        None,
    ),
    "numba": (("npnorm.kernels.numba_rows", "npnorm.kernels.numba_channels"), "numba"),
}
# An op a family has no kernel for runs the kernel of the family named here (else the
# generic one): SyncBatchNorm's per-rank pieces have blocked NumPy kernels, no compiled ones.
_FALLBACK: dict[str, str] = {"numba": "numpy"}
DEFAULT_ORDER = ("numba", "numpy")

_GENERIC: dict[str, Callable[..., Any]] = {}
# (op, family) for NumPy families, (op, namespace name) for other backends' kernels
_SPECIALIZED: dict[tuple[str, str], Callable[..., Any]] = {}
# Modules holding the kernels of another backend, imported the first time one of its
# arrays is seen (NumPy's families are in _FAMILIES).
_PROVIDERS: dict[str, tuple[str, ...]] = {"array_api_compat.cupy": ("npnorm.kernels.cupy_fused",)}

_LOCK = threading.RLock()
_LOADED: set[str] = set()  # families and namespaces whose modules are imported
_AVAILABLE: dict[str, bool] = {}  # family -> whether its third-party module imports
_IMPORT_ERRORS: dict[str, str] = {}  # family -> what importing its module raised
_selected: str | None = None  # process-wide selection; None: not yet read from the environment
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("npnorm_kernels", default=None)


def generic(op: str) -> Callable[[F], F]:
    """Register the generic (Array API) kernel of ``op``."""

    def deco(fn: F) -> F:
        _GENERIC[op] = fn
        return fn

    return deco


def specialized(op: str, namespace_name: str, kernels: str | None = None) -> Callable[[F], F]:
    """Register a kernel of ``op`` for arrays whose namespace is ``namespace_name``; for
    NumPy (``NUMPY``), ``kernels`` names the family it belongs to."""
    if namespace_name == NUMPY and kernels not in _FAMILIES:
        raise ValueError(f"a NumPy kernel must name its family, one of {list(_FAMILIES)}; got {kernels!r}")

    def deco(fn: F) -> F:
        _SPECIALIZED[(op, kernels if namespace_name == NUMPY else namespace_name)] = fn  # type: ignore[index]
        return fn

    return deco


# --- which families exist here ---------------------------------------------------------


def _available(family: str) -> bool:
    """Whether ``family``'s third-party module imports (cached). Only a missing or
    unimportable dependency counts as unavailable (any exception its import raises: a
    broken install raised AttributeError from every call; ``_checked`` names it); an
    error in npnorm's own kernel modules is raised where they are imported."""
    known = _AVAILABLE.get(family)
    if known is not None:
        return known
    with _LOCK:
        if family not in _AVAILABLE:
            requires = _FAMILIES[family][1]
            ok = True
            if requires is not None:
                try:
                    ok = importlib.util.find_spec(requires) is not None
                    if ok:
                        importlib.import_module(requires)
                except Exception as err:  # (ImportError, or whatever a broken install raises)
                    ok = False
                    _IMPORT_ERRORS[family] = f"{type(err).__name__}: {err}"
            _AVAILABLE[family] = ok
        return _AVAILABLE[family]


def kernels_available() -> list[str]:
    """The kernel families that can run NumPy input here.

    ``"reference"`` (the generic Array API kernels, the readable reference) and
    ``"numpy"`` (blocked NumPy calls) always; ``"numba"`` (fused compiled loops) where
    numba imports (``pip install "npnorm[fast]"``). Each family has the same functional
    signatures and is tested against the reference to rounding.

    Returns
    -------
    list of str
        E.g. ``["reference", "numpy", "numba"]``.

    Examples
    --------
    >>> import npnorm
    >>> npnorm.kernels_available()[:2]
    ['reference', 'numpy']
    """
    return [REFERENCE, *(f for f in _FAMILIES if _available(f))]


def numba_import_error() -> str:
    """What importing numba raised where it is installed but broken ("" where it imported,
    or is not installed); asks ``kernels_available`` first."""
    kernels_available()
    return _IMPORT_ERRORS.get("numba", "")


def _checked(name: object) -> str:
    if isinstance(name, str) and (name == REFERENCE or (name in _FAMILIES and _available(name))):
        return name
    available = kernels_available()
    hint = ""
    if isinstance(name, str) and name in _FAMILIES:
        failed = _IMPORT_ERRORS.get(name)
        why = f"; importing it raised {failed}" if failed else ""
        hint = f" ({name!r} needs {_FAMILIES[name][1]}: pip install 'npnorm[fast]'{why})"
    raise ValueError(f"unknown or unavailable kernels {name!r}{hint}; available: {', '.join(available)}")


def _default() -> str:
    """The start value: ``NPNORM_KERNELS`` if set, else the first available family. Read
    at the first call of any operation, with ``NPNORM_NUM_THREADS``, so that a wrong value
    of either raises there (a wrong thread count raised only at the first call large
    enough to split over threads: a small test passed, a real workload failed)."""
    get_num_threads()
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            return _checked(env)
        except ValueError as err:
            raise ValueError(f"{ENV_VAR}: {err}") from None
    return next(f for f in DEFAULT_ORDER if _available(f) and _compiles(f))


def _compiles(family: str) -> bool:
    """Whether ``family`` runs compiled code here: not numba under ``NUMBA_DISABLE_JIT=1``,
    whose loops then run as Python, ~200x slower than the "numpy" kernels (still
    available, not the default)."""
    return family != "numba" or not importlib.import_module("numba").config.DISABLE_JIT


# --- selection -------------------------------------------------------------------------


def get_kernels() -> str:
    """The kernel family NumPy input runs now: ``"reference"``, ``"numpy"`` or ``"numba"``.

    The innermost ``use_kernels`` block of the calling thread decides, else the last
    ``set_kernels``, else the start value: the environment variable ``NPNORM_KERNELS``
    if set, otherwise ``"numba"`` where numba imports (and compiles: not under
    ``NUMBA_DISABLE_JIT=1``) and ``"numpy"`` where it does not.
    Other backends (CuPy, array_api_strict, torch) run the reference kernels whatever
    this says (and their own kernels where they have some, unless it is "reference").

    Returns
    -------
    str

    Examples
    --------
    >>> import npnorm
    >>> npnorm.get_kernels() in npnorm.kernels_available()
    True
    >>> with npnorm.use_kernels("reference"):
    ...     npnorm.get_kernels()
    'reference'
    """
    name = _override.get()
    if name is not None:
        return name
    global _selected
    if _selected is None:
        with _LOCK:
            if _selected is None:
                _selected = _default()
    return _selected


def set_kernels(name: str) -> None:
    """Run NumPy input with the kernel family ``name`` from now on, in every thread
    (``use_kernels`` blocks still take precedence within them).

    Parameters
    ----------
    name : str
        One of ``kernels_available()``: ``"reference"``, ``"numpy"`` or ``"numba"``.

    Raises
    ------
    ValueError
        If ``name`` is not one of ``kernels_available()``; the message lists them.

    Examples
    --------
    >>> import npnorm
    >>> before = npnorm.get_kernels()
    >>> npnorm.set_kernels("numpy")
    >>> npnorm.get_kernels()
    'numpy'
    >>> npnorm.set_kernels(before)
    >>> npnorm.set_kernels("cuda")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown or unavailable kernels 'cuda'; available: ...
    """
    global _selected
    checked = _checked(name)
    with _LOCK:
        _selected = checked


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Run NumPy input with the kernel family ``name`` inside the ``with`` block.

    The selection holds in the calling thread (and context) only; the previous one
    comes back on exit, also when the block raises. (As any context variable's, a block
    inside a generator is seen by its caller while the generator is suspended in it; if
    another thread or context finishes the generator, the exit changes nothing there, and
    the first context keeps the block's selection.)

    Parameters
    ----------
    name : str
        One of ``kernels_available()``: ``"reference"``, ``"numpy"`` or ``"numba"``.

    Raises
    ------
    ValueError
        If ``name`` is not one of ``kernels_available()``; the message lists them.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> x = np.random.default_rng(0).standard_normal((4, 8))
    >>> with npnorm.use_kernels("reference"):  # the readable generic kernels
    ...     y_ref = npnorm.functional.layer_norm(x, 8)
    >>> bool(np.allclose(npnorm.functional.layer_norm(x, 8), y_ref))
    True
    """
    token = _override.set(_checked(name))
    try:
        yield
    finally:
        try:
            _override.reset(token)
        except ValueError:  # a generator's block ending in another context: leave that one as it is
            pass


@contextlib.contextmanager
def generic_only(namespace_name: str = NUMPY) -> Iterator[None]:
    """The generic kernels inside the block, for every backend (``namespace_name`` is
    kept for the callers that named one); ``use_kernels("reference")``."""
    with use_kernels(REFERENCE):
        yield


# --- lookup ----------------------------------------------------------------------------


def _load(key: str, modules: tuple[str, ...]) -> None:
    with _LOCK:
        if key not in _LOADED:
            for module in modules:
                importlib.import_module(module)  # an import error propagates, every time
            _LOADED.add(key)


def family_kernel(op: str, family: str) -> Callable[..., Any]:
    """The kernel of ``op`` in the NumPy family ``family`` (``"reference"``: the generic one)."""
    if family == REFERENCE:
        return _GENERIC[op]
    if family not in _LOADED:
        _checked(family)
        _load(family, _FAMILIES[family][0])
    fn = _SPECIALIZED.get((op, family))
    if fn is not None:
        return fn
    fallback = _FALLBACK.get(family)
    return family_kernel(op, fallback) if fallback is not None else _GENERIC[op]


def kernel(op: str, xp: Namespace) -> Callable[..., Any]:
    """The kernel that computes ``op`` for arrays of ``xp`` under the current selection."""
    selected = get_kernels()
    if selected == REFERENCE:
        return _GENERIC[op]
    name = xp.__name__
    if name == NUMPY:
        # a kernel registered by a module that another thread is still importing may call
        # helpers defined further down it: taken only once the family is loaded (whose
        # import family_kernel waits for)
        fn = _SPECIALIZED.get((op, selected)) if selected in _LOADED else None
        return fn if fn is not None else family_kernel(op, selected)
    if name not in _LOADED:
        _load(name, tuple(p for p in _PROVIDERS.get(name, ()) if importlib.util.find_spec(p) is not None))
    return _SPECIALIZED.get((op, name)) or _GENERIC[op]


def run(op: str, xp: Namespace, *args: Any, out: Any, reads: tuple[Any, ...]) -> Any:
    """``kernel(op, xp)(xp, *args, out)``: the kernel's result, whose first array (the
    output, or dx) is written into ``out`` when given.

    A kernel may write ``out`` while it still reads the small arrays ``reads`` (weight,
    bias, statistics, running buffers): where ``out`` shares memory with one of them, the
    kernel computes into a new array, which is then copied into ``out`` (an ``out`` that
    is the input or grad_output itself the kernels handle)."""
    fn = kernel(op, xp)
    if xp.__name__ == TORCH:
        return _run_detached(fn, xp, args, out, op)
    if isinstance(out, np.ndarray) and any(
        isinstance(a, np.ndarray) and np.may_share_memory(out, a) for a in reads
    ):
        result = fn(xp, *args, None)
        out[...] = result[0]
        result = (out, *result[1:])
    else:
        result = fn(xp, *args, out)
    if xp.__name__ == NUMPY:
        for a in result:
            if a is not None and (type(a) is not np.ndarray or not a.dtype.isnative):
                return tuple(a if a is out else as_plain(a) for a in result)
    return result


def as_plain(a: Any) -> Any:
    """``a`` as every family returns it: a plain ``ndarray`` (not a memmap or another
    subclass the reference's operations carried over) in native byte order (NumPy's own
    results are native; a ``>f4`` input gave a ``>f4`` output)."""
    if isinstance(a, np.ndarray):
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        if type(a) is not np.ndarray:
            a = a.view(np.ndarray)
    return a


def as_native(a: Any) -> Any:
    """``a`` itself unless it is a NumPy array in another byte order, which ``as_plain``
    makes native: for arrays returned as they were given (the running buffers an empty
    batch leaves), so that a caller's memmap stays that object."""
    return as_plain(a) if isinstance(a, np.ndarray) and not a.dtype.isnative else a


def _run_detached(fn: Callable[..., Any], xp: Namespace, args: tuple[Any, ...], out: Any, op: str) -> Any:
    """Run a kernel on torch tensors outside autograd: npnorm computes its own backward,
    so the kernel sees every tensor detached (the same memory, without history). An
    input that requires grad then gives a result without a ``grad_fn``, and the running
    buffers it writes, a torch module's own among them, gain no history either; with
    grad mode on, a forward warns (``warn_outside_autograd``)."""
    warn_outside_autograd(op, args)
    result = fn(xp, *(detached(a) for a in args), detached(out))
    return result if out is None else (out, *result[1:])


def warn_outside_autograd(op: str, tensors: tuple[Any, ...]) -> None:
    """The ``UserWarning`` of a forward ``op`` given torch tensors that require grad while
    grad mode is on: its result has no ``grad_fn`` (npnorm computes outside autograd), so
    a torch model's ``loss.backward()`` would drop this branch's gradient without a word.
    (A backward, whose saved input may require grad, says nothing: its forward did.)"""
    if op.endswith("_forward") and any(grad_tracked(a) for a in tensors):
        warnings.warn(
            f"npnorm's {op} ran on torch tensors that require grad, outside torch's autograd: its "
            "result has no grad_fn, and no gradient flows back through it to them. npnorm's "
            "backward computes the gradients (Module.backward, npnorm.functional's *_backward); "
            "pass detached tensors (t.detach()), or call under torch.no_grad(), where that is meant",
            UserWarning,
            stacklevel=_first_outside_npnorm(),
        )


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # npnorm/


def _first_outside_npnorm() -> int:
    """The ``stacklevel`` that points a warning made by the caller at the first frame
    outside npnorm (the user's call, through however many of npnorm's functions)."""
    frame, level = sys._getframe(1), 1  # the caller: stacklevel 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def detached(a: Any) -> Any:
    """``a`` without autograd history where it is a torch tensor (the same memory); any
    other value as it is. For the kernels a caller runs without ``run``."""
    return a.detach() if array_api_compat.is_torch_array(a) else a


def has_own_kernels(namespace_name: str) -> bool:
    """Whether arrays of the namespace called ``namespace_name`` have faster kernels than
    the generic ones (NumPy's families, or another backend's registered provider)."""
    return namespace_name == NUMPY or bool(_PROVIDERS.get(namespace_name))


def generic_kernel(op: str) -> Callable[..., Any]:
    """The generic kernel of ``op`` (what the other kernels are tested against)."""
    return _GENERIC[op]
