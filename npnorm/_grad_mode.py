"""Whether forwards save what backward needs: ``no_grad`` / ``enable_grad``, per thread.

A module's forward keeps its input and statistics for ``backward`` (``Module._saved``).
For inference that is memory held for nothing: inside ``with npnorm.no_grad():`` a
forward saves nothing (and drops what an earlier forward saved), so a ``backward``
afterwards raises the same ``RuntimeError`` as a backward before any forward. The
switch is thread-local, as ``torch.no_grad`` is: another thread's forwards still save.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Generator
from typing import Any, TypeVar, cast, overload

_state = threading.local()
_F = TypeVar("_F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Whether forwards in this thread save what ``backward`` needs.

    Returns
    -------
    bool
        False inside ``npnorm.no_grad()`` (and not inside a nested
        ``npnorm.enable_grad()``), True otherwise.

    Examples
    --------
    >>> import npnorm
    >>> npnorm.is_grad_enabled()
    True
    >>> with npnorm.no_grad():
    ...     npnorm.is_grad_enabled()
    False
    """
    return bool(getattr(_state, "enabled", True))


class _GradMode(contextlib.ContextDecorator):
    """Sets whether forwards save, in this thread, for a ``with`` block or a decorated
    function; the previous setting comes back on exit, also on error. A decorated
    generator function runs in the mode each time it resumes, and the caller's own
    setting holds while it is suspended (as with ``torch.no_grad``: a ``with`` around
    the generator's body would leak the mode into the caller at every ``yield``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._previous = threading.local()  # per thread: one object may be entered by many

    def __enter__(self) -> None:
        stack = self._previous.__dict__.setdefault("stack", [])
        stack.append(is_grad_enabled())
        _state.enabled = self.enabled

    def __exit__(self, *exc: object) -> None:
        _state.enabled = self._previous.stack.pop()

    def _recreate_cm(self) -> _GradMode:
        return _GradMode(self.enabled)  # one per call: a decorated function may run in many threads

    def __call__(self, func: _F) -> _F:
        if not inspect.isgeneratorfunction(func):
            return super().__call__(func)
        enabled = self.enabled

        @functools.wraps(func)
        def generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            with _GradMode(enabled):
                gen = func(*args, **kwargs)
                try:
                    value = next(gen)
                except StopIteration as stop:
                    return stop.value
            while True:
                try:
                    sent = yield value
                except GeneratorExit:
                    with _GradMode(enabled):
                        gen.close()
                    raise
                except BaseException as err:
                    method, arg = gen.throw, err
                else:
                    method, arg = gen.send, sent
                with _GradMode(enabled):
                    try:
                        value = method(arg)
                    except StopIteration as stop:
                        return stop.value

        return cast(_F, generator)


def _mode(enabled: bool, func: object, name: str) -> Any:
    """``_GradMode(enabled)``, or ``func`` decorated with it (the bare ``@npnorm.no_grad``,
    which ``torch.no_grad`` accepts too)."""
    if func is None:
        return _GradMode(enabled)
    if not callable(func):
        raise TypeError(
            f"npnorm.{name}() takes no arguments (with npnorm.{name}(): ...), or decorates a "
            f"function (@npnorm.{name} or @npnorm.{name}()); got {type(func).__name__}"
        )
    return _GradMode(enabled)(func)


@overload
def no_grad() -> _GradMode: ...
@overload
def no_grad(func: _F) -> _F: ...
def no_grad(func: object = None) -> Any:
    """Context manager (or decorator): forwards in this thread save nothing for backward.

    Use it for inference: a module's forward normally keeps its input and the
    per-row or per-channel statistics until the next forward, so that
    ``backward`` can run. Inside ``no_grad()`` a forward keeps nothing and drops
    what an earlier forward kept; ``backward`` afterwards raises ``RuntimeError``
    (as before any forward). Everything else is unchanged: outputs are the same,
    and a BatchNorm in training mode still updates its running statistics (as in
    PyTorch). The setting is per thread, like ``torch.no_grad``, and nests with
    :func:`enable_grad`.

    Parameters
    ----------
    func : callable, optional
        A function to decorate (the bare ``@npnorm.no_grad``); without it, the
        context manager.

    Returns
    -------
    context manager
        Also usable as a decorator, ``@npnorm.no_grad()`` or ``@npnorm.no_grad`` (as
        ``torch.no_grad``); a decorated generator function runs in it whenever it
        resumes (not while it waits at a ``yield``). Called with a function, returns
        it decorated.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> ln = npnorm.LayerNorm(4)
    >>> with npnorm.no_grad():
    ...     y = ln(np.ones((2, 4), np.float32))
    >>> try:
    ...     ln.backward(np.ones_like(y))
    ... except RuntimeError as err:
    ...     print("RuntimeError")
    RuntimeError
    """
    return _mode(False, func, "no_grad")


@overload
def enable_grad() -> _GradMode: ...
@overload
def enable_grad(func: _F) -> _F: ...
def enable_grad(func: object = None) -> Any:
    """Context manager (or decorator): forwards in this thread save for backward again,
    also inside :func:`no_grad`. ``npnorm.gradcheck`` runs in it.

    Parameters
    ----------
    func : callable, optional
        A function to decorate (the bare ``@npnorm.enable_grad``); without it, the
        context manager.

    Returns
    -------
    context manager
        Also usable as a decorator, with or without the call (``@npnorm.enable_grad``).

    Examples
    --------
    >>> import npnorm
    >>> with npnorm.no_grad():
    ...     with npnorm.enable_grad():
    ...         npnorm.is_grad_enabled()
    True
    """
    return _mode(True, func, "enable_grad")
