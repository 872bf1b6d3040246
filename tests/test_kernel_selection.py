"""The public kernel selection: kernels_available, get_kernels, set_kernels, use_kernels
and NPNORM_KERNELS; and the NumPy path without numba."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

import array_api_compat.numpy as xp
import numpy as np
import pytest

import npnorm
import npnorm.functional as F
from npnorm.functional import _dispatch
from npnorm.functional._dispatch import family_kernel, generic_kernel, kernel

HAS_NUMBA = importlib.util.find_spec("numba") is not None


@pytest.fixture(autouse=True)
def restore_selection():
    before = _dispatch._selected
    yield
    _dispatch._selected = before


def test_available_names():
    names = npnorm.kernels_available()
    assert names[:2] == ["reference", "numpy"]
    assert ("numba" in names) == HAS_NUMBA
    assert npnorm.get_kernels() in names


def test_default_is_numba_where_it_imports(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch._default() == ("numba" if HAS_NUMBA else "numpy")


@pytest.mark.parametrize("name", ["reference", "numpy", *(["numba"] if HAS_NUMBA else [])])
def test_set_kernels_selects_the_family_for_numpy_input(name):
    npnorm.set_kernels(name)
    assert npnorm.get_kernels() == name
    for op in ("layer_norm_forward", "batch_norm_backward", "group_norm_forward"):
        assert kernel(op, xp) is family_kernel(op, name)
    x = np.random.default_rng(0).normal(size=(3, 5))
    np.testing.assert_allclose(
        F.layer_norm(x, 5), generic_kernel("layer_norm_forward")(xp, x, (5,), None, None, 1e-5)[0], rtol=1e-12
    )


def test_reference_is_the_generic_kernel_for_every_backend():
    strict = pytest.importorskip("array_api_strict")
    npnorm.set_kernels("reference")
    import array_api_compat

    ns = array_api_compat.array_namespace(strict.asarray([1.0]))
    assert kernel("layer_norm_forward", ns) is generic_kernel("layer_norm_forward")
    assert kernel("layer_norm_forward", xp) is generic_kernel("layer_norm_forward")


@pytest.mark.parametrize("bad", ["Numba", "torch", "", None, 3, ["numpy"]])
def test_unknown_names_are_a_value_error_listing_the_available(bad):
    before = npnorm.get_kernels()
    with pytest.raises(ValueError, match="available: reference, numpy"):
        npnorm.set_kernels(bad)
    with pytest.raises(ValueError, match="available: reference, numpy"):
        with npnorm.use_kernels(bad):
            pass
    assert npnorm.get_kernels() == before


def test_use_kernels_restores_on_exit_and_on_error():
    npnorm.set_kernels("numpy")
    with npnorm.use_kernels("reference"):
        assert npnorm.get_kernels() == "reference"
        with npnorm.use_kernels("numpy"):
            assert npnorm.get_kernels() == "numpy"
        assert npnorm.get_kernels() == "reference"
    assert npnorm.get_kernels() == "numpy"
    with pytest.raises(RuntimeError, match="inside"):
        with npnorm.use_kernels("reference"):
            raise RuntimeError("inside")
    assert npnorm.get_kernels() == "numpy"


def test_use_kernels_applies_to_the_calling_thread_only():
    npnorm.set_kernels("numpy")
    seen = []
    with npnorm.use_kernels("reference"):
        t = threading.Thread(target=lambda: seen.append(npnorm.get_kernels()))
        t.start()
        t.join()
        assert npnorm.get_kernels() == "reference"
    assert seen == ["numpy"]


def test_set_kernels_applies_to_every_thread():
    npnorm.set_kernels("reference")
    seen = []
    t = threading.Thread(target=lambda: seen.append(npnorm.get_kernels()))
    t.start()
    t.join()
    assert seen == ["reference"]


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != _dispatch.ENV_VAR}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def _runs_ok(code: str) -> None:
    """``code`` (which prints "ok" at its end) runs to its end in a fresh interpreter."""
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("name", ["reference", "numpy"])
def test_environment_variable_sets_the_start_value(name):
    out = _run("import npnorm; print(npnorm.get_kernels())", NPNORM_KERNELS=name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == name


# a small call that prints the ValueError it raises
SMALL_CALL = (
    "import numpy as np, npnorm\n"
    "try:\n"
    "    npnorm.LayerNorm(4)(np.ones((2, 4), np.float32))\n"
    "except ValueError as e:\n"
    "    print(e)\n"
)


def test_bad_environment_value_is_an_error_at_first_use():
    out = _run(SMALL_CALL, NPNORM_KERNELS="fortran")
    assert out.returncode == 0, out.stderr
    assert "NPNORM_KERNELS" in out.stdout and "available: reference, numpy" in out.stdout


def test_a_bad_thread_count_variable_is_an_error_at_the_first_call_of_any_size():
    """NPNORM_NUM_THREADS was read at the first call large enough to split over threads: a
    small call (a test) ran, a large one (the workload) raised."""
    for value in ("abc", "0", "1.5", "-2"):
        out = _run(SMALL_CALL, NPNORM_NUM_THREADS=value)
        assert out.returncode == 0, out.stderr
        # one wording for every wrong value (a count below 1 had another)
        want = f"NPNORM_NUM_THREADS must be an integer of at least 1 (1 = no worker threads), got {value!r}"
        assert out.stdout.strip() == want


# A subprocess in which numba cannot be imported (as without the 'fast' extra).
NO_NUMBA = "import sys\nsys.modules['numba'] = None\n"


def test_without_numba_numpy_input_runs_the_numpy_kernels():
    code = NO_NUMBA + (
        "import numpy as np, npnorm\n"
        "assert npnorm.kernels_available() == ['reference', 'numpy'], npnorm.kernels_available()\n"
        "assert npnorm.get_kernels() == 'numpy'\n"
        "try:\n"
        "    npnorm.set_kernels('numba')\n"
        "except ValueError as e:\n"
        "    assert 'npnorm[fast]' in str(e) and 'available: reference, numpy' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('numba accepted')\n"
        "x = np.random.default_rng(0).normal(size=(4, 3, 5, 5)).astype(np.float32)\n"
        "for m in (npnorm.LayerNorm(5), npnorm.RMSNorm(5), npnorm.BatchNorm2d(3), npnorm.GroupNorm(3, 3),\n"
        "          npnorm.InstanceNorm2d(3, affine=True, track_running_stats=True)):\n"
        "    for training in (True, False):\n"
        "        m.train(training)\n"
        "        y = m(x)\n"
        "        dx = m.backward(np.ones_like(y))\n"
        "        assert np.isfinite(y).all() and np.isfinite(dx).all()\n"
        "assert 'npnorm.kernels.numpy_fast' in sys.modules\n"
        "assert 'npnorm.kernels.numba_rows' not in sys.modules\n"
        "print('ok')\n"
    )
    _runs_ok(code)


def test_without_numba_the_environment_cannot_ask_for_it():
    out = _run(NO_NUMBA + "import npnorm\nnpnorm.get_kernels()", NPNORM_KERNELS="numba")
    assert out.returncode != 0 and "NPNORM_KERNELS" in out.stderr and "npnorm[fast]" in out.stderr


def test_warmup_command_without_numba_says_so(tmp_path):
    """It says so, and ``--json`` writes the file all the same (it wrote none)."""
    path = tmp_path / "w.json"
    out = _run(NO_NUMBA + f"from npnorm.__main__ import main\nmain(['warmup', '--json', {str(path)!r}])")
    assert out.returncode == 0, out.stderr
    assert "numba is not installed" in out.stdout
    assert json.loads(path.read_text()) == {"numba": False}


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_warmup_compiles_every_loop_for_both_dtypes(tmp_path):
    from npnorm import _warmup

    result = _warmup.run(verbose=False, json_path=str(tmp_path / "w.json"))
    assert result["compiled_loops"] >= 24  # 12 loops x float32, float64
    from npnorm.kernels import _numba_loops as loops

    # an argument of the computation dtype (the others' first is float64 partials)
    ct_arg = {"group_rows_statistics": -1, "group_rows_coefficients": -1}
    for name, fn in vars(loops).items():
        if hasattr(fn, "signatures") and not name.startswith("_") and name not in _warmup.CASTS:
            dtypes = {str(sig[ct_arg.get(name, 0)].dtype) for sig in fn.signatures}
            assert dtypes >= ({"float64"} if name == "add_spans" else {"float32", "float64"}), name
    for name in _warmup.CASTS:  # float16 data's way into the float32 loops and back
        assert getattr(loops, name).signatures, name
    assert set(result["seconds"]) == {
        f"{n} {d}" for n in ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm") for d in _warmup.DTYPES
    } | {"float16 casts", "transposing copies"}
    kinds = {(str(sig[0].dtype), sig[0].layout, sig[0].mutable) for sig in loops.transpose_into.signatures}
    assert kinds >= {(d, lay, m) for d in (*_warmup.DTYPES, "uint16") for lay in "CA" for m in (True, False)}


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_numba_with_its_jit_disabled_is_not_the_default():
    """``NUMBA_DISABLE_JIT=1`` (a user debugging their own numba code) ran npnorm's loops
    as Python by default, 200x slower than the "numpy" kernels."""
    code = "import npnorm\nprint(npnorm.get_kernels(), 'numba' in npnorm.kernels_available())"
    out = _run(code, NUMBA_DISABLE_JIT="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numpy", "True"]
    out = _run(code, NUMBA_DISABLE_JIT="1", NPNORM_KERNELS="numba")  # still there when asked for
    assert out.stdout.split() == ["numba", "True"], out.stderr
    # float16 too: the compiled casts' bit casts have no Python version (NumPy casts instead)
    half = "import numpy as np, npnorm.functional as F\n"
    half += "x = np.linspace(-3, 3, 24, dtype=np.float16).reshape(3, 8)\n"
    half += "print(F.layer_norm_forward(x, 8)[0].dtype)"
    out = _run(half, NUMBA_DISABLE_JIT="1", NPNORM_KERNELS="numba")
    assert out.returncode == 0 and out.stdout.split() == ["float16"], out.stderr


NO_CACHE_PLACE = (  # what numba finds in a read-only install without a writable home
    "import numba.core.caching as c\nc.CacheImpl._locator_classes = []\n"
)


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_where_numba_cannot_write_its_cache_the_kernels_compile_uncached_with_one_warning():
    """A read-only install (a non-root user, ``docker run --read-only``) without a writable
    NUMBA_CACHE_DIR or home: every NumPy call raised numba's "cannot cache function ...: no
    locator available", warmup included, and nothing fell back."""
    code = NO_CACHE_PLACE + (
        "import warnings\nwarnings.simplefilter('error')\n"
        "import numpy as np, npnorm, npnorm.functional as F\n"
        "x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    y, mean, rstd = F.layer_norm_forward(x, 16)\n"
        "    dx = F.layer_norm_backward(x, x, 16, mean, rstd)[0]\n"
        "assert npnorm.get_kernels() == 'numba'\n"
        "assert len(caught) == 1 and 'NUMBA_CACHE_DIR' in str(caught[0].message), caught\n"
        "with npnorm.use_kernels('reference'):\n"
        "    ref = F.layer_norm_forward(x, 16)[0]\n"
        "np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)\n"
        "from npnorm.kernels import _numba_loops\nassert _numba_loops.CACHED is False\n"
        "print('ok')\n"
    )
    _runs_ok(code)


@pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")
def test_warmup_says_when_nothing_was_cached_and_exits_1(monkeypatch, tmp_path, capsys):
    from npnorm.__main__ import main
    from npnorm.kernels import _numba_loops

    monkeypatch.setattr(_numba_loops, "CACHED", False)
    path = tmp_path / "w.json"
    assert main(["warmup", "--json", str(path)]) == 1
    assert "NOT CACHED" in capsys.readouterr().out
    assert json.loads(path.read_text())["cached"] is False
    monkeypatch.setattr(_numba_loops, "CACHED", True)
    assert main(["warmup", "--quiet"]) == 0


def _aliased(args, i, like):
    """``args`` with argument i replaced by a view of a new ``out`` (like ``like``) that
    holds its values; and that ``out``."""
    out = np.empty_like(like)
    view = out.reshape(-1)[: args[i].size].reshape(args[i].shape)
    view[...] = args[i]
    return (*args[:i], view, *args[i + 1 :]), out


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_out_that_holds_a_weight_or_a_statistic_gives_the_same_results(family):
    """An ``out=`` that shares memory with the weight, bias, statistics or running buffers
    the kernel reads while it writes: the results of a separate out (the compiled and
    NumPy kernels read the weight after they had written over it, off by up to 5e2)."""
    from helpers import op_calls

    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(64, 4, 300)), rng.normal(size=(64, 4, 300))
    w, b = rng.normal(size=300), rng.normal(size=300)
    with npnorm.use_kernels(family):
        for op, fwd_args, bwd_args in op_calls(x, dy, w, b, 2):
            forward, backward = getattr(F, op + "_forward"), getattr(F, op + "_backward")
            want_f = forward(*fwd_args)
            want_b = backward(*bwd_args(want_f))
            for call, args, want in ((forward, fwd_args, want_f), (backward, bwd_args(want_f), want_b)):
                small = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.shape != x.shape]
                assert small, op
                for i in small:
                    aliased, out = _aliased(args, i, x)
                    got = call(*aliased, out=out)
                    assert got[0] is out
                    np.testing.assert_allclose(out, want[0], rtol=1e-12, atol=1e-12, err_msg=f"{op} arg {i}")


def test_a_generators_block_ended_in_another_thread_does_not_raise():
    """The block reset its context variable by token, which raised ValueError ('created
    in a different Context') when a generator suspended inside it was finished in
    another thread; that thread's own selection stands. (Run in a copy of the context:
    the context that started the generator keeps the block's selection.)"""
    import contextvars
    import threading

    def scenario():
        def gen():
            with npnorm.use_kernels("reference"):
                yield npnorm.get_kernels()
                yield npnorm.get_kernels()

        it = gen()
        assert next(it) == "reference"
        errors, seen = [], []

        def finish_inside_own_block():
            with npnorm.use_kernels("numpy"):
                try:
                    list(it)
                except Exception as err:  # pragma: no cover - the failure being guarded
                    errors.append(err)
                seen.append(npnorm.get_kernels())  # the finishing thread's own block stands

        t = threading.Thread(target=finish_inside_own_block)
        t.start()
        t.join()
        return errors, seen

    before = npnorm.get_kernels()
    errors, seen = contextvars.copy_context().run(scenario)
    assert errors == [] and seen == ["numpy"]
    assert npnorm.get_kernels() == before  # this test's context untouched


def test_a_numba_that_fails_to_import_otherwise_than_importerror_falls_back(tmp_path):
    """A broken numba install (its import raising AttributeError, say) made every call
    raise that error; it now counts as unavailable, and asking for it says why."""
    import subprocess
    import sys

    (tmp_path / "numba").mkdir()
    (tmp_path / "numba" / "__init__.py").write_text('raise AttributeError("a broken install")\n')
    script = (
        "import numpy as np, npnorm\n"
        "assert npnorm.kernels_available() == ['reference', 'numpy'], npnorm.kernels_available()\n"
        "assert npnorm.get_kernels() == 'numpy'\n"
        "npnorm.functional.layer_norm(np.ones((2, 4)), 4)\n"
        "try:\n"
        "    npnorm.set_kernels('numba')\n"
        "except ValueError as err:\n"
        "    assert 'AttributeError: a broken install' in str(err), err\n"
        "else:\n"
        "    raise SystemExit('set_kernels(numba) did not raise')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("NPNORM_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_kernel_is_taken_only_once_its_family_is_loaded(monkeypatch):
    """A family's kernels are registered as its module's body runs: a call in one thread
    while another thread was still importing that module took a kernel whose helpers,
    defined further down, did not exist yet. The kernel is now taken only once the family
    is loaded (``_load``, which waits for the import under its lock)."""

    def registered_early(*args):
        raise AssertionError("taken while its module was still being imported")

    loaded = []

    def load(key, modules):
        loaded.append(key)
        _dispatch._LOADED.add(key)  # (the import done)
        _dispatch._SPECIALIZED[("layer_norm_forward", "numpy")] = fast

    fast = family_kernel("layer_norm_forward", "numpy")  # (the family loaded, as it would be)
    monkeypatch.setattr(_dispatch, "_LOADED", _dispatch._LOADED - {"numpy"})
    monkeypatch.setitem(_dispatch._SPECIALIZED, ("layer_norm_forward", "numpy"), registered_early)
    monkeypatch.setattr(_dispatch, "_load", load)
    with npnorm.use_kernels("numpy"):
        assert kernel("layer_norm_forward", xp) is fast
    assert loaded == ["numpy"]


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_the_environment_variables_value_is_taken_without_surrounding_space():
    out = _run("import npnorm; print(npnorm.get_kernels())", NPNORM_KERNELS=" numpy\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "numpy"


@pytest.mark.skipif("numba" not in npnorm.kernels_available(), reason="needs numba (the 'fast' extra)")
def test_an_op_the_numba_family_lacks_falls_back_to_the_numpy_family():
    """As documented: numba's family falls back to the "numpy" family's kernel, not the
    generic one, where it has none of its own (SyncBatchNorm's per-rank dx)."""
    assert family_kernel("sync_batch_norm_dx", "numba") is family_kernel("sync_batch_norm_dx", "numpy")
    assert family_kernel("sync_batch_norm_dx", "numpy") is not generic_kernel("sync_batch_norm_dx")
