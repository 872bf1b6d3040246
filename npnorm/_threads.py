"""The worker threads npnorm's fast NumPy kernels split their work over.

NumPy releases the GIL inside ufuncs and reductions on large enough arrays, so plain
Python threads each working on their own rows run in parallel. One
``ThreadPoolExecutor`` is kept for the whole process, created on first use and
recreated when the thread count changes. The calling thread always takes the first
share of the work itself, so ``n`` threads means a pool of ``n - 1`` workers, and
``set_num_threads(1)`` means no pool at all: everything runs inline.

The default count is the environment variable ``NPNORM_NUM_THREADS`` if set, else
the number of CPUs this process may run on.
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

ENV_VAR = "NPNORM_NUM_THREADS"

_lock = threading.Lock()
_num_threads: int | None = None  # None: not yet read from the environment
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0


def _check_count(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {n!r}")
    if n < 1:
        raise ValueError(f"{what} must be at least 1 (1 = no worker threads), got {n!r}")
    return int(n)


def default_num_threads() -> int:
    """``NPNORM_NUM_THREADS`` if set, else the CPUs available to this process."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a positive integer, got {env!r}") from None
        return _check_count(value, ENV_VAR)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def get_num_threads() -> int:
    """How many threads the fast NumPy kernels split their work over (the caller's included).

    The default is the environment variable ``NPNORM_NUM_THREADS`` if set, else the
    number of CPUs this process may run on; ``set_num_threads`` changes it. Results
    are bitwise reproducible for a fixed count.

    Returns
    -------
    int
        At least 1 (1: everything runs in the calling thread).

    Examples
    --------
    >>> import npnorm
    >>> npnorm.get_num_threads() >= 1
    True
    """
    global _num_threads
    with _lock:
        if _num_threads is None:
            _num_threads = default_num_threads()
        return _num_threads


def set_num_threads(n: int) -> None:
    """Make the fast NumPy kernels split their work over ``n`` threads, for the whole process.

    Parameters
    ----------
    n : int
        At least 1; 1 runs everything in the calling thread (no pool).

    Raises
    ------
    TypeError
        If ``n`` is not an integer.
    ValueError
        If ``n`` is less than 1.

    Examples
    --------
    >>> import npnorm
    >>> before = npnorm.get_num_threads()
    >>> npnorm.set_num_threads(1)
    >>> npnorm.get_num_threads()
    1
    >>> npnorm.set_num_threads(before)
    """
    global _num_threads
    count = _check_count(n, "the number of threads")
    with _lock:
        _num_threads = count


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool, (re)created with ``workers`` threads."""
    global _pool, _pool_workers
    with _lock:
        if _pool is None or _pool_workers != workers:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="npnorm")
            _pool_workers = workers
            if old is not None:
                old.shutdown(wait=False)  # its running tasks finish; it takes no more
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child has the parent's pool object but none of its threads.
    global _pool, _pool_workers
    _pool, _pool_workers = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def run_parallel(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run the tasks, the first in the calling thread, the others on the pool.

    Returns their results in the order of ``tasks`` (so that whatever combines them
    does so in a fixed order). An exception in any task is raised here, after all
    of them have finished.
    """
    workers = get_num_threads() - 1
    if len(tasks) <= 1 or workers == 0:
        return [t() for t in tasks]
    pool = _executor(workers)
    futures: list[Future[T]] = [pool.submit(t) for t in tasks[1:]]
    try:
        first = tasks[0]()
    finally:
        rest = [f.exception() for f in futures]  # wait for all before raising
    for err in rest:
        if err is not None:
            raise err
    return [first, *(f.result() for f in futures)]
