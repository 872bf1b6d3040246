"""The worker threads npnorm's fast kernels split their work over.

NumPy releases the GIL inside ufuncs and reductions on large enough arrays, and the
compiled loops release it throughout, so plain Python threads each working on their
own rows run in parallel. One pool of workers is kept for the whole process, created on
first use and recreated when the thread count changes. The calling thread always takes
the first share of the work itself, so ``n`` threads means a pool of ``n - 1`` workers,
and ``set_num_threads(1)`` means no pool at all: everything runs inline.

Each worker is a thread waiting on a lock of its own: handing it a task is a lock
release, and waiting for it a lock acquire. That costs about a third of what a
``concurrent.futures.ThreadPoolExecutor`` hand-off did (15 against 47 us per call on a
2-vCPU VM: 4-8% off a module's forward+backward of 1-2.3 ms, 2% at 4 ms). One caller
uses the pool at a time: a call made while another thread's call holds it (or from
inside a task) runs its tasks in the calling thread instead, which gives the same
results, since how the work is split depends on the thread count only. Workers never
spin: between calls they sleep.

The default count is the environment variable ``NPNORM_NUM_THREADS`` if set, else
the number of CPUs this process may run on.
"""

from __future__ import annotations

import contextvars
import numbers
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

ENV_VAR = "NPNORM_NUM_THREADS"

_lock = threading.Lock()
_num_threads: int | None = None  # None: not yet read from the environment


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


class _Worker:
    """A pool thread. It sleeps on ``_go`` until handed a list of tasks, runs them in
    order, keeps each one's result or exception, and releases ``_done``."""

    def __init__(self, name: str) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._tasks: list[Callable[[], Any]] = []
        self.outcomes: list[tuple[Any, BaseException | None]] = []
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            self.outcomes = [_outcome(t) for t in self._tasks]
            self._tasks = []
            self._done.release()

    def start(self, tasks: list[Callable[[], Any]]) -> None:
        self._tasks = tasks
        self._go.release()

    def wait(self) -> None:
        """Until the tasks handed over by ``start`` have run, even if the wait is
        interrupted (KeyboardInterrupt): the interruption is raised after."""
        interrupted: BaseException | None = None
        while True:
            try:
                self._done.acquire()
                break
            except BaseException as e:  # re-raised below
                interrupted = e
        if interrupted is not None:
            raise interrupted

    def take(self) -> list[tuple[Any, BaseException | None]]:
        """The outcomes of the tasks that ``wait`` waited for (no longer kept here)."""
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def stop(self) -> None:
        self._stop = True
        self._go.release()


def _outcome(task: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return task(), None
    except BaseException as e:  # raised by run_parallel, in the calling thread
        return None, e


_busy = threading.Lock()  # held by the one call using the pool
_workers_list: list[_Worker] = []


def _workers(count: int) -> list[_Worker]:
    """The pool, (re)created with ``count`` workers (the caller holds ``_busy``: no task
    is running on it)."""
    global _workers_list
    if len(_workers_list) != count:
        for w in _workers_list:
            w.stop()
        _workers_list = [_Worker(f"npnorm-{k}") for k in range(count)]
    return _workers_list


def _forget_pool_after_fork() -> None:
    # A forked child has the parent's pool objects but none of its threads, and the
    # parent's locks in whatever state the fork found them.
    global _busy, _workers_list
    _busy = threading.Lock()
    _workers_list = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def run_parallel(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run the tasks, the first in the calling thread, the others on the pool.

    With ``n`` threads, task ``i`` runs in thread ``i % n`` (thread 0 being the caller),
    each thread taking its tasks in order. Returns their results in the order of
    ``tasks`` (so that whatever combines them does so in a fixed order). An exception
    in any task is raised here, the first in task order, after all of them have run.
    While another call holds the pool (another thread's, or the one whose task this
    is), the tasks run one after another in the calling thread, and the first exception
    stops them. Every task runs in the caller's context (``contextvars``): an
    ``np.errstate`` the caller set holds in the pool's threads too.
    """
    n = get_num_threads()
    threads = min(len(tasks), n)
    if threads <= 1 or not _busy.acquire(blocking=False):
        return [t() for t in tasks]
    try:
        workers = _workers(n - 1)[: threads - 1]
        for k, w in enumerate(workers, start=1):
            # each in a copy of the caller's context: NumPy's errstate is a context
            # variable, which a pool thread would otherwise see at its defaults
            w.start([partial(contextvars.copy_context().run, t) for t in tasks[k::threads]])
        try:
            mine = [_outcome(t) for t in tasks[::threads]]
        finally:
            for w in workers:
                w.wait()
        per_thread = [mine, *(w.take() for w in workers)]
        outcomes = [per_thread[i % threads][i // threads] for i in range(len(tasks))]
    finally:
        _busy.release()
    for _, err in outcomes:
        if err is not None:
            raise err
    return [result for result, _ in outcomes]
