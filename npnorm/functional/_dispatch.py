"""Which kernel computes an operation for a given array namespace.

Every operation has a generic kernel written against the Array API (the readable
reference, used for every backend). A backend may register a faster kernel for the
same operation with the same signature; it is tested against the generic one. The
math modules never branch on the backend themselves: they ask ``kernel(op, xp)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._backend import Namespace

F = TypeVar("F", bound=Callable[..., Any])

_GENERIC: dict[str, Callable[..., Any]] = {}
_SPECIALIZED: dict[tuple[str, str], Callable[..., Any]] = {}
_DISABLED: set[str] = set()
# Modules holding the specialized kernels of a namespace, imported the first time an
# array of that namespace is seen (so `import npnorm` stays light).
_PROVIDERS: dict[str, tuple[str, ...]] = {
    "array_api_compat.numpy": (
        "npnorm.kernels.numpy_fast",
        "npnorm.kernels.numpy_fast_channels",
        "npnorm.kernels.numpy_fast_sync",
    ),
}
_LOADED: set[str] = set()
_LOCK = threading.Lock()


def generic(op: str) -> Callable[[F], F]:
    """Register the generic (Array API) kernel of ``op``."""

    def deco(fn: F) -> F:
        _GENERIC[op] = fn
        return fn

    return deco


def specialized(op: str, namespace_name: str) -> Callable[[F], F]:
    """Register a kernel of ``op`` for arrays whose namespace is called ``namespace_name``."""

    def deco(fn: F) -> F:
        _SPECIALIZED[(op, namespace_name)] = fn
        return fn

    return deco


def set_specialized(namespace_name: str, enabled: bool) -> None:
    """Turn the specialized kernels of one namespace off (or back on)."""
    if enabled:
        _DISABLED.discard(namespace_name)
    else:
        _DISABLED.add(namespace_name)


@contextlib.contextmanager
def generic_only(namespace_name: str = "array_api_compat.numpy") -> Iterator[None]:
    """Within the block, use the generic kernels for ``namespace_name`` (for
    benchmarks and tests that compare the two paths)."""
    was_disabled = namespace_name in _DISABLED
    set_specialized(namespace_name, False)
    try:
        yield
    finally:
        set_specialized(namespace_name, not was_disabled)


def kernel(op: str, xp: Namespace) -> Callable[..., Any]:
    """The kernel that computes ``op`` for arrays of ``xp``."""
    name = xp.__name__
    if name not in _LOADED:
        with _LOCK:
            if name not in _LOADED:
                for provider in _PROVIDERS.get(name, ()):
                    if importlib.util.find_spec(provider) is not None:
                        importlib.import_module(provider)  # an import error propagates, every time
                _LOADED.add(name)
    if name not in _DISABLED:
        fn = _SPECIALIZED.get((op, name))
        if fn is not None:
            return fn
    return _GENERIC[op]


def generic_kernel(op: str) -> Callable[..., Any]:
    """The generic kernel of ``op`` (what specialized kernels are tested against)."""
    return _GENERIC[op]
