"""npnorm.no_grad(): forwards save nothing for backward; thread-local like torch's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import npnorm


def _message(err: pytest.ExceptionInfo) -> str:
    return str(err.value).replace("LayerNorm", "<layer>")


def test_forward_saves_nothing_and_backward_raises_the_same_error(rng):
    x = rng.normal(size=(2, 4)).astype(np.float32)
    with pytest.raises(RuntimeError) as before_any:
        npnorm.LayerNorm(4).backward(np.ones_like(x))
    m = npnorm.LayerNorm(4)
    m(x)  # saves x ...
    with npnorm.no_grad():
        y = m(x)  # ... and this drops it
    assert m._saved is None
    np.testing.assert_array_equal(y, npnorm.LayerNorm(4)(x))  # same output
    with pytest.raises(RuntimeError) as after_no_grad:
        m.backward(np.ones_like(y))
    assert _message(after_no_grad) == _message(before_any)
    assert "no_grad" in _message(after_no_grad)
    assert m.grads == {}


def test_memory_is_released(rng):
    import weakref

    class Tracked(np.ndarray):
        pass

    x = rng.normal(size=(3, 4)).view(Tracked)
    ref = weakref.ref(x)
    m = npnorm.LayerNorm(4, dtype="float64")
    with npnorm.no_grad():
        m(x)
    del x
    assert ref() is None  # the module holds no reference to its input


@pytest.mark.parametrize("family", ["numba", "numpy"])
def test_memory_is_released_after_calls_split_over_threads(rng, family, restore_threads, monkeypatch):
    """Inputs large enough for the pool (2 threads): its workers kept the last call's
    tasks, and with them its input and output, while they slept. (The calls are split:
    a (1024, 256) input was split by neither family.)"""
    import gc
    import weakref

    from npnorm import _threads
    from npnorm.kernels import _blocks

    if family not in npnorm.kernels_available():
        pytest.skip(f"{family} is not installed")
    split: list[int] = []

    def counting(tasks):
        split.append(len(tasks))
        return _threads.run_parallel(tasks)

    monkeypatch.setattr(_blocks, "run_parallel", counting)  # (the "numpy" family's way to the pool)
    if family == "numba":
        from npnorm.kernels import _staging  # (it needs numba)

        monkeypatch.setattr(_staging, "run_parallel", counting)
    npnorm.set_num_threads(2)
    m = npnorm.BatchNorm1d(64)
    x = rng.normal(size=(65536, 64)).astype(np.float32)  # samples split over the threads
    with npnorm.use_kernels(family):
        y = m(x)
        dx = m.backward(y)
        with npnorm.no_grad():
            z = m(x)
    assert split and max(split) == 2, split
    refs = [weakref.ref(a) for a in (x, y, dx, z)]
    del x, y, dx, z
    gc.collect()
    assert all(r() is None for r in refs)


def test_running_statistics_still_update(rng):
    """As in torch: no_grad changes what is saved, not what the forward computes."""
    m, ref = npnorm.BatchNorm1d(2), npnorm.BatchNorm1d(2)
    x = rng.normal(size=(5, 2)).astype(np.float32)
    with npnorm.no_grad():
        m(x)
    ref(x)
    np.testing.assert_array_equal(m.running_mean, ref.running_mean)
    assert int(m.num_batches_tracked) == 1


def test_grad_mode_is_restored_and_nests():
    assert npnorm.is_grad_enabled()
    with npnorm.no_grad():
        assert not npnorm.is_grad_enabled()
        with npnorm.enable_grad():
            assert npnorm.is_grad_enabled()
        assert not npnorm.is_grad_enabled()
    assert npnorm.is_grad_enabled()
    with pytest.raises(ValueError), npnorm.no_grad():
        raise ValueError
    assert npnorm.is_grad_enabled()


def test_decorator(rng):
    @npnorm.no_grad()
    def infer(m, x):
        assert not npnorm.is_grad_enabled()
        return m(x)

    m = npnorm.RMSNorm(3)
    infer(m, rng.normal(size=(2, 3)).astype(np.float32))
    assert m._saved is None and npnorm.is_grad_enabled()


def test_bare_decorators_as_torch_takes_them(rng, torch):
    """``@npnorm.no_grad`` and ``@npnorm.enable_grad`` without the call, as ``torch.no_grad``
    takes them (a TypeError: no_grad() takes 0 positional arguments but 1 was given)."""

    @torch.no_grad
    def torch_mode():
        return torch.is_grad_enabled()

    @npnorm.no_grad
    def infer(m, x):
        """Runs m."""
        return npnorm.is_grad_enabled(), m(x)

    @npnorm.enable_grad
    def train(m, x):
        return npnorm.is_grad_enabled(), m(x)

    m = npnorm.RMSNorm(3)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    assert infer(m, x)[0] is torch_mode() is False
    assert m._saved is None and infer.__doc__ == "Runs m." and infer.__name__ == "infer"
    with npnorm.no_grad():
        assert train(m, x)[0] is True and m._saved is not None
    assert npnorm.is_grad_enabled()
    for mode in (npnorm.no_grad, npnorm.enable_grad):
        with pytest.raises(TypeError, match=r"takes no arguments .* or decorates a function .* got int"):
            mode(5)


def test_decorated_generator_runs_in_the_mode_only_while_it_runs(rng, torch):
    # as @torch.no_grad(): the decorator covers every resumption of the generator, not only
    # the call that makes it (npnorm's forwards inside saved their input), and the
    # caller's own setting holds while the generator waits at a yield
    m = npnorm.LayerNorm(4)

    @npnorm.no_grad()
    def infer(batches):
        for x in batches:
            got = yield m(x), npnorm.is_grad_enabled()
            assert got in (None, "sent") and not npnorm.is_grad_enabled()
        return "done"

    @torch.no_grad()
    def reference():
        yield torch.is_grad_enabled()

    batches = [rng.normal(size=(2, 4)).astype(np.float32) for _ in range(3)]
    gen = infer(batches)
    _, enabled = next(gen)
    assert enabled is next(reference()) is False and m._saved is None
    assert npnorm.is_grad_enabled()  # the caller's setting between resumptions
    m(batches[0])
    assert m._saved is not None  # the caller's forward saves
    _, enabled = gen.send("sent")
    assert not enabled and m._saved is None
    next(gen)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "done" and npnorm.is_grad_enabled()
    with npnorm.no_grad():  # a decorated enable_grad generator inside no_grad
        saving = npnorm.enable_grad()(lambda: (yield npnorm.is_grad_enabled()))()
        assert next(saving) is True and not npnorm.is_grad_enabled()
    # throw and close run in the mode too, and leave the caller's setting
    gen = infer(batches)
    next(gen)
    with pytest.raises(ValueError):
        gen.throw(ValueError("stop"))
    gen = infer(batches)
    next(gen)
    gen.close()
    assert npnorm.is_grad_enabled()


def test_thread_local(rng):
    """Another thread's forwards still save while this thread is in no_grad."""
    m = npnorm.LayerNorm(4)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    seen = {}

    def other() -> None:
        seen["enabled"] = npnorm.is_grad_enabled()
        m(x)
        seen["saved"] = m._saved is not None

    with npnorm.no_grad():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == {"enabled": True, "saved": True}


def test_gradcheck_works_inside_no_grad(rng):
    with npnorm.no_grad():
        assert npnorm.gradcheck(npnorm.LayerNorm(3), rng.normal(size=(2, 3)))
        assert not npnorm.is_grad_enabled()


def test_one_no_grad_object_entered_by_two_threads_restores_each_threads_setting():
    # the object kept one list of previous settings: thread B left it with thread A's
    # setting (grad on inside B's own outer no_grad), and A left it with B's
    shared = npnorm.no_grad()
    b1, b2 = threading.Barrier(2), threading.Barrier(2)
    seen = {}

    def a() -> None:  # grad on
        b1.wait()  # B is inside shared first
        with shared:
            b2.wait()  # B leaves while A is inside
            b1.wait()
        seen["a"] = npnorm.is_grad_enabled()

    def b() -> None:
        with npnorm.no_grad():  # B's own outer block: grad off
            with shared:
                b1.wait()
                b2.wait()
            seen["b"] = npnorm.is_grad_enabled()
            b1.wait()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": True, "b": False}
