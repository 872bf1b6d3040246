"""Kernel calls from several Python threads at once, each with its own arrays or modules
(as torch's functions and modules may be called): every call gives bitwise the results it
gives alone.

One caller at a time holds the worker pool; a call that finds it held runs its share of
the work in its own thread (``npnorm._threads.run_parallel``), split as the pool would
split it, so the results must not depend on who got the pool, nor on what the other
threads are running. The inputs are large enough for the "numba" kernels to split every
call over threads with ``_staging.MIN_PARALLEL`` at 65536 values a thread, which the test
sets (the default splits from 786432 values; these inputs stay small for four threads;
the "numpy" kernels split BatchNorm1d's, whose samples are split for its sums; the
"reference" kernels never split), and calls without weight or bias use the
kernels' shared constants (``_staging.param_or``). Every call of every kernel family runs
in a step where all threads run it at once, and in one where each thread runs another
family (``use_kernels`` holds per thread); the test checks that calls did find the pool
held.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time

import numpy as np
import pytest

import npnorm
import npnorm.functional as F
from npnorm import _threads

pytestmark = pytest.mark.usefixtures("restore_threads")  # (tests/conftest.py)


def _calls(rng: np.random.Generator) -> dict:
    """Functions, by name, that run a layer's forward and backward and return every array
    made."""
    calls = {}
    x = (rng.standard_normal((8, 96, 257)) * 3 + 5).astype(np.float32)  # 197K values
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w, b = rng.standard_normal(257).astype(np.float32), rng.standard_normal(257).astype(np.float32)

    def layer_norm(w=w, b=b):
        y, mean, rstd = F.layer_norm_forward(x, 257, w, b)
        return (y, mean, rstd, *F.layer_norm_backward(dy, x, 257, mean, rstd, w, b))

    calls["LayerNorm"] = layer_norm
    calls["LayerNorm without weight and bias"] = lambda: layer_norm(None, None)
    for shape in [(65536, 64), (32, 16, 20, 20)]:  # BatchNorm1d's short channels; 2d
        xc = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
        dyc = rng.standard_normal(shape).astype(np.float32)
        wc, bc = rng.standard_normal(shape[1]).astype(np.float32), np.ones(shape[1], np.float32)

        def batch_norm(xc=xc, dyc=dyc, wc=wc, bc=bc):
            rm, rv = np.zeros(xc.shape[1], np.float32), np.ones(xc.shape[1], np.float32)
            y, mean, rstd, rm, rv = F.batch_norm_forward(xc, rm, rv, wc, bc, training=True)
            dx, dw, db = F.batch_norm_backward(dyc, xc, mean, rstd, wc, bc, training=True)
            y_eval = F.batch_norm_forward(xc, rm, rv, wc, bc)[0]
            return y, mean, rstd, rm, rv, dx, dw, db, y_eval

        calls[f"BatchNorm {shape}"] = batch_norm
        if len(shape) == 4:

            def group_norm(xc=xc, dyc=dyc):  # without weight and bias
                y, mean, rstd = F.group_norm_forward(xc, 4)
                return (y, mean, rstd, *F.group_norm_backward(dyc, xc, 4, mean, rstd))

            def module(xc=xc, dyc=dyc, wc=wc):  # a BatchNorm2d's training step, then eval
                m = npnorm.BatchNorm2d(xc.shape[1])
                m.weight[...] = wc
                y = m(xc)
                dx = m.backward(dyc)
                y_eval = m.eval()(xc)
                return y, dx, m.grads["weight"], m.grads["bias"], m.running_mean, m.running_var, y_eval

            calls[f"GroupNorm {shape}"] = group_norm
            calls[f"BatchNorm2d module {shape}"] = module
    return calls


def _digests(arrays) -> list[str]:
    """The bytes of each array, as a digest (the results alone are kept so: BatchNorm1d's
    are large, to split its samples over the threads)."""
    return [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays]


class _CountingLock:
    """The pool's lock, counting the calls that found it held (and so ran inline)."""

    def __init__(self, lock):
        self.lock, self.found_held = lock, 0

    def locked(self) -> bool:
        held = self.lock.locked()
        self.found_held += held
        return held

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_calls_from_several_threads_at_once_give_each_calls_own_results(rng, monkeypatch):
    npnorm.set_num_threads(2)
    if "numba" in npnorm.kernels_available():  # (every call split: see above)
        from npnorm.kernels import _staging  # (it needs numba)

        monkeypatch.setattr(_staging, "MIN_PARALLEL", 1 << 16)
    threads = 4
    calls = [_calls(rng) for _ in range(threads)]  # each thread's own arrays
    names, families = list(calls[0]), npnorm.kernels_available()
    alone = {}
    for family in families:
        with npnorm.use_kernels(family):
            for t in range(threads):
                for name in names:
                    alone[t, family, name] = _digests(calls[t][name]())
    # the steps the threads take together (after a barrier): every call and family once
    # with the same family in all threads, once with one family per thread
    steps = [
        (name, f, mixed) for name, f in itertools.product(names, range(len(families))) for mixed in (0, 1)
    ]
    barrier = threading.Barrier(threads, timeout=60)
    errors: list = []
    lock = _CountingLock(_threads._busy)
    monkeypatch.setattr(_threads, "_busy", lock)

    def caller(t: int) -> None:
        try:
            for s, (name, f, mixed) in enumerate(steps):
                family = families[(f + t * mixed) % len(families)]
                barrier.wait()
                with npnorm.use_kernels(family):
                    got = _digests(calls[t][name]())
                for k, (a, want) in enumerate(zip(got, alone[t, family, name], strict=True)):
                    if a != want:
                        errors.append(f"step {s}, thread {t}: {family} {name}: result {k} differs")
        except BaseException as err:  # reported below (a broken barrier: see the first)
            errors.append(err)
            barrier.abort()

    workers = [threading.Thread(target=caller, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 300
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(w.is_alive() for w in workers), "a call hung"
    assert not errors, errors[:3]
    assert lock.found_held > 0, "no call found the pool held: the threads did not overlap"
