"""npnorm's worker pool (``npnorm._threads.run_parallel``): which thread runs which
task, results and errors in task order, the pool's life (recreated with the thread
count, after a fork), and callers that find it in use (other threads, nested calls)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from npnorm import _threads

pytestmark = pytest.mark.usefixtures("restore_threads")  # (tests/conftest.py)


def _where(i: int):
    """A task that returns its index and the name of the thread that ran it."""
    return lambda: (i, threading.current_thread().name)


def test_task_i_runs_in_thread_i_mod_n_results_in_task_order():
    _threads.set_num_threads(3)
    caller = threading.current_thread().name
    out = _threads.run_parallel([_where(i) for i in range(7)])
    assert [i for i, _ in out] == list(range(7))
    names = [name for _, name in out]
    assert names[0::3] == [caller] * 3  # tasks 0, 3, 6: the calling thread
    assert len(set(names[1::3])) == 1 and len(set(names[2::3])) == 1
    assert len({caller, names[1], names[2]}) == 3  # three threads in all
    assert _threads.run_parallel([lambda k=k: k * k for k in range(6)]) == [0, 1, 4, 9, 16, 25]


def test_fewer_tasks_than_threads_and_one_thread():
    _threads.set_num_threads(4)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]
    assert _threads.run_parallel([lambda: 5]) == [5]
    assert _threads.run_parallel([]) == []
    _threads.set_num_threads(1)
    caller = threading.current_thread().name
    assert [name for _, name in _threads.run_parallel([_where(i) for i in range(3)])] == [caller] * 3


def test_tasks_on_the_pool_see_the_callers_errstate():
    """NumPy's errstate is a context variable: the pool's threads saw the defaults, so a
    kernel's quiet cast to float16 (inf, as the reference gives) warned there."""
    _threads.set_num_threads(2)
    with np.errstate(over="ignore", invalid="raise"):
        states = _threads.run_parallel([np.geterr for _ in range(4)])
        casts = _threads.run_parallel([lambda: np.array([1e6]).astype(np.float16) for _ in range(4)])
    assert all(s["over"] == "ignore" and s["invalid"] == "raise" for s in states)
    assert all(np.isinf(c[0]) for c in casts)  # and no RuntimeWarning (an error in pytest)
    assert all(s["over"] == np.geterr()["over"] for s in _threads.run_parallel([np.geterr] * 2))


def test_pool_shrinks_when_the_count_drops():
    _threads.set_num_threads(3)
    _threads.run_parallel([_where(i) for i in range(3)])
    old = list(_threads._workers_list)
    assert len(old) == 2 and all(w.thread.is_alive() for w in old)
    _threads.set_num_threads(2)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]
    assert _threads._workers_list == old[:1] and old[0].thread.is_alive()
    old[1].thread.join(timeout=10)  # the worker beyond the count exits
    assert not old[1].thread.is_alive()


def test_workers_start_only_as_the_tasks_need_them():
    """``set_num_threads(n)`` started n - 1 threads at the next parallel call whatever its
    tasks: 2999 for a call split in two after ``set_num_threads(3000)``."""
    _threads.set_num_threads(2)
    _threads.run_parallel([lambda: 1, lambda: 2])
    _threads.set_num_threads(64)
    assert _threads.run_parallel([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    assert len(_threads._workers_list) == 2
    assert [i for i, _ in _threads.run_parallel([_where(i) for i in range(5)])] == list(range(5))
    assert len(_threads._workers_list) == 4
    _threads.set_num_threads(2)  # the workers beyond the count stop at the next call
    _threads.run_parallel([lambda: 1, lambda: 2])
    assert len(_threads._workers_list) == 1


def test_errors_raised_first_in_task_order_after_every_task_ran():
    _threads.set_num_threads(2)
    ran = []

    def ok(i):
        def task():
            time.sleep(0.01)
            ran.append(i)

        return task

    def boom(msg):
        def task():
            raise RuntimeError(msg)

        return task

    with pytest.raises(RuntimeError, match="task 1"):
        _threads.run_parallel([ok(0), boom("task 1"), ok(2), boom("task 3"), ok(4)])
    assert sorted(ran) == [0, 2, 4]
    # the caller's own task failing: raised after the worker's task has finished
    with pytest.raises(RuntimeError, match="task 0"):
        _threads.run_parallel([boom("task 0"), ok(5)])
    assert sorted(ran) == [0, 2, 4, 5]
    # and the pool still works
    assert _threads.run_parallel([lambda: "a", lambda: "b"]) == ["a", "b"]


def test_a_nested_call_runs_in_its_thread():
    _threads.set_num_threads(2)

    def inner():
        out = _threads.run_parallel([_where(0), _where(1)])
        me = threading.current_thread().name
        return [name == me for _, name in out]

    assert _threads.run_parallel([inner, inner]) == [[True, True], [True, True]]


def test_callers_in_several_threads_each_get_their_results():
    _threads.set_num_threads(2)
    errors: list[BaseException] = []
    results: dict[int, list[list[int]]] = {}

    def caller(c: int) -> None:
        try:
            tasks = [lambda k=k: c * 100 + k for k in range(3)]
            results[c] = [_threads.run_parallel(tasks) for _ in range(200)]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for c in range(4):
        assert results[c] == [[c * 100, c * 100 + 1, c * 100 + 2]] * 200


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
# JAX (imported by an earlier test module) warns at any fork once its backend is up
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_pool_works_in_a_forked_child():
    _threads.set_num_threads(2)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: its own pool, created on first use
        ok = False
        try:
            ok = _threads.run_parallel([lambda: 3, lambda: 4]) == [3, 4]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


KILL_A_WORKER = """
import ctypes
from npnorm import _threads
_threads.set_num_threads(3)
assert _threads.run_parallel([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
worker = _threads._workers_list[0]
class Killed(Exception):
    pass
# an exception sent into the sleeping worker's thread: raised there as it wakes for a call
ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.thread.ident), ctypes.py_object(Killed))
try:
    _threads.run_parallel([lambda: 1, lambda: 2, lambda: 3])
except RuntimeError as err:
    print("raised:", err)
print("ended:", worker.dead)
print("outcomes kept:", [len(w._outcomes[1]) for w in _threads._workers_list])
print("next:", _threads.run_parallel([lambda: 3, lambda: 4]))
"""


def test_a_worker_killed_from_outside_is_an_error_not_a_hang():
    """An exception sent into a pool thread (``PyThreadState_SetAsyncExc``, as some tools
    that stop threads do) ended its loop; the call that had handed it tasks waited for
    ever, Ctrl-C included, and the pool stayed taken. Now that call raises RuntimeError,
    keeping none of the other workers' outcomes, and the next call starts a new worker."""
    out = subprocess.run([sys.executable, "-c", KILL_A_WORKER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("raised: npnorm's thread pool: its thread npnorm-0 was ended"), out.stdout
    assert lines[1:] == ["ended: True", "outcomes kept: [0, 0]", "next: [3, 4]"], out.stdout


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
def test_an_interrupted_wait_still_waits_for_the_workers():
    """A KeyboardInterrupt while the caller waits for a worker is raised once the worker's
    task has finished, and the pool is then as good as new."""
    _threads.set_num_threads(2)
    finished = []

    def slow():
        time.sleep(0.3)
        finished.append(True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    class Big:  # stands for an array the worker's task returns
        pass

    made = []  # a weak reference to the worker's result

    def slow_result():
        slow()
        big = Big()
        made.append(weakref.ref(big))
        return big

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # while the caller waits for `slow`
        with pytest.raises(KeyboardInterrupt):
            _threads.run_parallel([lambda: None, slow_result])
        assert finished == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    gc.collect()
    assert made and made[0]() is None  # the worker kept its result
    assert _threads.run_parallel([lambda: "a", lambda: "b"]) == ["a", "b"]


def _within(seconds: float, fn):
    """``fn()`` in a helper thread; its result, or a failure if it is still running after
    ``seconds`` (a hung pool) or raised."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(_threads._outcome(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the pool hangs"
    result, err = box[0]
    if err is not None:
        raise err
    return result


class _GetThenInterrupt:
    """A worker's outbox whose first ``get`` takes its token and then raises, as a signal
    handler does when it runs right after the call returns."""

    def __init__(self, queue, shot: list):
        self.queue, self.shot = queue, shot  # one shot for all the workers

    def get(self, timeout=None):
        token = self.queue.get(timeout=timeout)
        if self.shot:
            self.shot.clear()
            raise KeyboardInterrupt
        return token

    def put(self, item):
        self.queue.put(item)


def _one_call_then_good_calls(threads: int) -> list:
    tasks = [lambda k=k: k * k for k in range(2 * threads)]
    # the workers' tasks outlast the caller's, so that the caller waits (takes a token)
    slow = [t if k % threads == 0 else (lambda t=t: time.sleep(0.1) or t()) for k, t in enumerate(tasks)]
    with pytest.raises(KeyboardInterrupt):
        _threads.run_parallel(slow)
    return [_threads.run_parallel(tasks) for _ in range(20)]


@pytest.mark.parametrize("threads", [2, 3])
def test_an_interruption_right_after_a_wait_took_its_token_leaves_the_pool_working(threads):
    """The probe's case 1: with two bare locks the interrupted wait acquired its lock a
    second time and hung for good (and Ctrl-C could no longer end the process)."""
    _threads.set_num_threads(threads)
    _threads.run_parallel([lambda: 0] * threads)
    shot = [True]
    for w in _threads._workers_list:
        w._outbox = _GetThenInterrupt(w._outbox, shot)
    squares = [k * k for k in range(2 * threads)]
    assert _within(30, lambda: _one_call_then_good_calls(threads)) == [squares] * 20


@pytest.mark.parametrize("after_put", [False, True])
def test_an_interruption_between_two_workers_starts_leaves_the_pool_working(after_put):
    """The probe's cases 2 and 3 (3 threads): a worker started before the interruption
    was not waited for, so the next call took its stale "done" (and returned before its
    own tasks ran), and the worker died on "release unlocked lock"."""
    _threads.set_num_threads(3)
    _threads.run_parallel([lambda: 0] * 3)
    second = _threads._workers_list[1]
    real_start = second.start

    def start_then_interrupt(ticket, tasks):
        second.start = real_start  # once
        if after_put:
            real_start(ticket, tasks)
        raise KeyboardInterrupt

    second.start = start_then_interrupt
    slow = [lambda: time.sleep(0.2) or 0, lambda: time.sleep(0.2) or 1, lambda: 2]
    with pytest.raises(KeyboardInterrupt):
        _within(30, lambda: _threads.run_parallel(slow))
    got = _within(30, lambda: [_threads.run_parallel([_where(i) for i in range(6)]) for _ in range(20)])
    assert all([i for i, _ in out] == list(range(6)) for out in got)
    assert all(w.thread.is_alive() for w in _threads._workers_list)


def test_ctrl_c_at_random_moments_of_pooled_calls_leaves_them_working(tmp_path):
    """Real SIGINTs at random moments of LayerNorm calls that use the pool (the probe's
    reproduction, shortened): each call raises KeyboardInterrupt or gives the right
    result, and the process neither hangs nor loses a worker."""
    script = tmp_path / "sigint.py"
    script.write_text(
        """
import os, signal, sys, threading, time
import numpy as np
import npnorm, npnorm.functional as F

npnorm.set_num_threads(int(sys.argv[1]))
x = np.random.default_rng(0).standard_normal((512, 4096)).astype(np.float32)  # split by either family
ref = F.layer_norm_forward(x, 4096)[0]
from npnorm import _threads
assert _threads._workers_list, "the calls must use the pool"
rng = np.random.default_rng(0)
for _ in range(60):
    t = threading.Timer(rng.uniform(0, 2e-3), os.kill, (os.getpid(), signal.SIGINT))
    try:
        t.start()
        while t.is_alive():
            y = np.zeros_like(x)
            F.layer_norm_forward(x, 4096, out=y)
            assert np.array_equal(y, ref)
        t.join()
        time.sleep(0.005)
    except KeyboardInterrupt:
        pass
    t.join()
y = np.zeros_like(x)
F.layer_norm_forward(x, 4096, out=y)
assert np.array_equal(y, ref)
assert not _threads._busy.locked(), "the pool was left taken: every call runs inline"
assert all(w.thread.is_alive() for w in _threads._workers_list)
names = _threads.run_parallel([lambda: threading.current_thread().name] * 2)
assert len(set(names)) == 2, names
print("ok")
"""
    )
    import subprocess
    import sys

    for threads in ("2", "3"):
        done = subprocess.run(
            [sys.executable, str(script), threads], capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_an_interruption_after_a_put_waits_for_that_workers_tasks():
    """A worker whose start was interrupted after its tasks went in: the call raises only
    once they have run (they write the caller's outputs; they ran on after it returned)."""
    _threads.set_num_threads(3)
    _threads.run_parallel([lambda: 0] * 3)
    second = _threads._workers_list[1]
    real_start = second.start
    done = []

    def put_then_interrupt(ticket, tasks):
        second.start = real_start  # once: the settling hand-off goes through
        real_start(ticket, tasks)
        raise KeyboardInterrupt

    second.start = put_then_interrupt

    def late():
        time.sleep(0.2)
        done.append(True)

    def call():
        with pytest.raises(KeyboardInterrupt):
            _threads.run_parallel([lambda: 0, lambda: 1, late])
        return list(done)

    assert _within(30, call) == [True]
    assert _threads.run_parallel([lambda k=k: k for k in range(3)]) == [0, 1, 2]


def test_an_interruption_as_the_pool_is_taken_releases_it():
    """The first step with the pool taken is interrupted: the pool is free afterwards. (It
    is taken by a ``with``, released even if an interruption comes right after the lock is
    acquired, which a test cannot stage: a non-blocking acquire before a ``try`` left it
    taken for good there, every later call inline; the SIGINT test below checks it.)"""
    _threads.set_num_threads(2)
    real = _threads._tickets

    class Interrupting:
        def __next__(self):
            _threads._tickets = real
            raise KeyboardInterrupt

    _threads._tickets = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        _threads.run_parallel([lambda: 0, lambda: 1])
    assert not _threads._busy.locked()
    names = [name for _, name in _threads.run_parallel([_where(i) for i in range(2)])]
    assert len(set(names)) == 2  # the pool's worker again, not the caller alone


def test_an_interruption_while_the_pool_is_recreated_leaves_no_stopped_worker():
    """Resizing stopped the old workers before the new list was in place: interrupted
    there, the old list (stopped threads) stayed, and a call at that size waited for them
    forever. (Shrinking stops the workers beyond the count: the last one here.)"""
    _threads.set_num_threads(3)
    _threads.run_parallel([lambda: 0] * 3)
    first = _threads._workers_list[-1]
    real_stop = first.stop

    def stop_then_interrupt():
        real_stop()
        raise KeyboardInterrupt

    first.stop = stop_then_interrupt
    _threads.set_num_threads(2)
    with pytest.raises(KeyboardInterrupt):
        _threads.run_parallel([lambda: 0, lambda: 1])
    assert not _threads._busy.locked()
    first.thread.join(10)
    _threads.set_num_threads(3)
    assert _within(30, lambda: _threads.run_parallel([lambda k=k: k for k in range(3)])) == [0, 1, 2]
    assert all(w.thread.is_alive() for w in _threads._workers_list)


def test_the_pool_keeps_nothing_of_a_finished_call():
    """A worker kept its last tasks (and their outcomes) while it slept: the caller's
    arrays stayed alive until the next call that used the pool, and for good once the
    thread count dropped to 1 (3x a LayerNorm's input after a forward and backward)."""
    _threads.set_num_threads(2)

    class Big:  # stands for a call's array: weakly referable
        pass

    def task(big: Big) -> int:
        return id(big)

    def failing(big: Big) -> int:
        raise ValueError(id(big))  # the exception's traceback holds the task's frame

    for second in (task, failing):
        items = [Big(), Big()]
        refs = [weakref.ref(b) for b in items]
        tasks = [lambda b=items[0]: task(b), lambda b=items[1], f=second: f(b)]
        try:
            _threads.run_parallel(tasks)
        except ValueError:
            pass
        del items, tasks
        gc.collect()
        assert all(r() is None for r in refs), second.__name__
    _threads.set_num_threads(1)


def test_an_interruption_in_the_callers_share_drops_the_workers_outcomes(monkeypatch):
    """Ctrl-C between the caller's own tasks (outside the waits): the workers' results
    stayed held until the next pooled call."""
    _threads.set_num_threads(2)
    _threads.run_parallel([lambda: 0, lambda: 0])  # the worker exists

    class Big:
        pass

    outcome = _threads._outcome
    caller = threading.current_thread()

    def interrupted_after(task):
        result = outcome(task)
        if threading.current_thread() is caller:
            raise KeyboardInterrupt  # as a signal handler right after the task returned
        return result

    monkeypatch.setattr(_threads, "_outcome", interrupted_after)
    made = []  # a weak reference to the worker's result

    def slow_result():
        time.sleep(0.05)
        big = Big()
        made.append(weakref.ref(big))
        return big

    with pytest.raises(KeyboardInterrupt):
        _threads.run_parallel([lambda: None, slow_result])
    monkeypatch.setattr(_threads, "_outcome", outcome)
    gc.collect()
    assert made and made[0]() is None
    assert _threads.run_parallel([lambda: "a", lambda: "b"]) == ["a", "b"]


def test_set_num_threads_takes_any_integer_with_index_as_its_annotation_says():
    """``n: SupportsIndex``: an object with ``__index__`` was refused (numbers.Integral)."""

    class Two:
        def __index__(self):
            return 2

    _threads.set_num_threads(Two())
    assert _threads.get_num_threads() == 2
    for bad in (True, np.True_, 2.0):
        with pytest.raises(TypeError, match="must be an integer"):
            _threads.set_num_threads(bad)
