"""Whether forwards save what backward needs: ``no_grad`` / ``enable_grad``, per thread.

A module's forward keeps its input and statistics for ``backward`` (``Module._saved``).
For inference that is memory held for nothing: inside ``with npnorm.no_grad():`` a
forward saves nothing (and drops what an earlier forward saved), so a ``backward``
afterwards raises the same ``RuntimeError`` as a backward before any forward. The
switch is thread-local, as ``torch.no_grad`` is: another thread's forwards still save.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


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


@contextlib.contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    previous = is_grad_enabled()
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def no_grad() -> contextlib.AbstractContextManager[None]:
    """Context manager (or decorator): forwards in this thread save nothing for backward.

    Use it for inference: a module's forward normally keeps its input and the
    per-row or per-channel statistics until the next forward, so that
    ``backward`` can run. Inside ``no_grad()`` a forward keeps nothing and drops
    what an earlier forward kept; ``backward`` afterwards raises ``RuntimeError``
    (as before any forward). Everything else is unchanged: outputs are the same,
    and a BatchNorm in training mode still updates its running statistics (as in
    PyTorch). The setting is per thread, like ``torch.no_grad``, and nests with
    :func:`enable_grad`.

    Returns
    -------
    context manager
        Also usable as a decorator: ``@npnorm.no_grad()``.

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
    return _grad_mode(False)


def enable_grad() -> contextlib.AbstractContextManager[None]:
    """Context manager (or decorator): forwards in this thread save for backward again,
    also inside :func:`no_grad`. ``npnorm.gradcheck`` runs in it.

    Returns
    -------
    context manager

    Examples
    --------
    >>> import npnorm
    >>> with npnorm.no_grad():
    ...     with npnorm.enable_grad():
    ...         npnorm.is_grad_enabled()
    True
    """
    return _grad_mode(True)
