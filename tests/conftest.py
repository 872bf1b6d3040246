"""Shared fixtures: the backends every test is parametrized over.

numpy always; ``array_api_strict`` as the CPU stand-in for a second backend (it
rejects anything outside the Array API standard, so a NumPy-only call in the math
fails there); cupy only where a GPU is present. Without a GPU, the cupy cases of a
test module are reported as one skip line for the module.

Hypothesis profiles: "ci" draws the same examples on every run (derandomized), "dev"
draws new ones each run (failures are kept in .hypothesis/ and replayed first).
"ci" is the default where the environment variable CI is set (CI services set it;
.ci/run does), "dev" elsewhere; ``--hypothesis-profile=NAME`` picks one explicitly
("gpu", "dev" without shrinking, is the GPU check's).

Optional extras (``mpi``, ``demo``): where one is not installed, the tests that need it
skip and name it (``helpers.needs_extra``). A test that raises npnorm's own ImportError
naming an extra (``pip install 'npnorm[mpi]'``, as a SyncBatchNorm training on the default
communicator does without mpi4py) is skipped by the hook below, but only where it was
raised from a ModuleNotFoundError for one of that extra's packages; any other (mpi4py
installed but broken, say) fails the test as any other error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
from collections.abc import Generator

import numpy as np
import pytest
from helpers import EXTRA_MODULES, extra_missing
from hypothesis import Phase, settings

import npnorm
from npnorm._backend import resolve_namespace, to_host

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25, print_blob=True)
# the GPU check's tests stage (npnorm._gpu_check): no shrinking, so that a failure that is slow
# on every call (a CUDA compile error) is reported at once instead of running out the stage
settings.register_profile(
    "gpu",
    deadline=None,
    max_examples=25,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _import_every_module() -> None:
    """Every npnorm module that imports here, imported now, before any test draws.

    Hypothesis also draws the constants written in the source of the code under test (the
    modules in ``sys.modules`` outside site-packages and outside the tests): so what a test
    draws, even derandomized or with ``--hypothesis-seed``, depended on which npnorm modules
    the tests collected or run before it had imported. One file run alone drew other
    examples than the same file in the whole suite, so a CI failure did not come back when
    its file was run again. With every module imported first, a test draws the same in any
    selection of tests, given the same code and extras: a change to a constant in npnorm
    still changes the draws (the printed ``@reproduce_failure`` blob replays one example,
    for the same test and version of Hypothesis). A module whose optional dependency is
    missing or broken here (cupy, numba, an extra) is left out, as the tests that need it
    are."""
    for found in pkgutil.walk_packages(npnorm.__path__, "npnorm.", onerror=lambda name: None):
        if found.name.rpartition(".")[2] == "__main__":  # (runs a command)
            continue
        try:
            importlib.import_module(found.name)
        except Exception:  # (a broken install too, as the dispatcher takes it: the kernels'
            continue  # tests say so, where a failure here stopped the whole session)


_import_every_module()


def _cupy_unusable() -> str:
    """Why cupy cases cannot run here ('' when they can): the reason shows in the skip."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy needs a CUDA GPU; none here"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return ""
        return "cupy is installed but sees no CUDA device"
    except Exception as err:
        return f"cupy is installed but unusable: {type(err).__name__}: {err}"


_CUPY_UNUSABLE = _cupy_unusable()

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param(
        "array_api_strict",
        id="array_api_strict",
        # installed by the 'test' extra; missing only where the tests run without it (the offline GPU machine)
        marks=pytest.mark.skipif(
            importlib.util.find_spec("array_api_strict") is None,
            reason="array_api_strict is not installed (the 'test' extra installs it)",
        ),
    ),
    pytest.param("cupy", id="cupy"),  # skipped where unusable, see pytest_runtest_setup
]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip the cupy cases without a GPU, before the backend fixture imports cupy.

    The skip is raised here, not by a mark, so pytest reports it at this line: the
    cases of one test module fold into one "SKIPPED [n]" line instead of one per test.
    """
    callspec = getattr(item, "callspec", None)
    if _CUPY_UNUSABLE and callspec is not None and callspec.params.get("backend") == "cupy":
        module = item.module.__name__ if item.module is not None else item.nodeid
        pytest.skip(f"{_CUPY_UNUSABLE}: the cupy cases of {module}")


_EXTRA_NAMED = re.compile(r"npnorm\[(\w+)\]")


def _skip_if_its_extra_is_missing(err: ImportError) -> None:
    """Skip the test when ``err`` is npnorm's ImportError asking for an extra
    (``npnorm[NAME]`` in its message) raised because one of that extra's modules is not
    installed (the ModuleNotFoundError it was raised from names it); else return."""
    cause = err.__cause__
    if not isinstance(cause, ModuleNotFoundError) or not cause.name:
        return
    for extra in _EXTRA_NAMED.findall(str(err)):
        if cause.name.split(".")[0] in EXTRA_MODULES.get(extra, ()):
            pytest.skip(f"{extra_missing(extra) or f'needs the {extra!r} extra'} (the test met: {err})")


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """A test body's ImportError for a missing extra is a skip (see the module docstring)."""
    try:
        return (yield)
    except ImportError as err:
        _skip_if_its_extra_is_missing(err)
        raise


class Backend:
    """A backend under test: its namespace and converters to and from NumPy."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.xp = resolve_namespace(name)
        self.has_float16 = hasattr(self.xp, "float16")

    def asarray(self, a, dtype="float64"):
        return self.xp.asarray(np.asarray(a, dtype=dtype), dtype=getattr(self.xp, dtype))

    @staticmethod
    def numpy(a) -> np.ndarray:
        return to_host(a)

    def __repr__(self) -> str:
        return self.name


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request) -> Backend:
    return Backend(request.param)


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch", reason="parity tests need torch==2.13.0 (the 'parity' extra)")


@pytest.fixture
def restore_threads():
    """The thread count as it was before the test (for tests that set it)."""
    before = npnorm.get_num_threads()
    yield
    npnorm.set_num_threads(before)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def assert_state_equal(a: npnorm.Module, b_state: dict, grads: dict | None = None) -> None:
    """Module ``a``'s state_dict equals ``b_state`` exactly (and its grads ``grads``)."""
    sa = a.state_dict()
    assert sa.keys() == b_state.keys()
    for k in sa:
        np.testing.assert_array_equal(to_host(sa[k]), to_host(b_state[k]), err_msg=k)
    if grads is not None:
        assert a.grads.keys() == grads.keys()
        for k in grads:
            np.testing.assert_array_equal(to_host(a.grads[k]), to_host(grads[k]), err_msg=k)


def snapshot(m: npnorm.Module) -> tuple[dict, dict]:
    return (
        {k: to_host(v) for k, v in m.state_dict().items()},
        {k: to_host(v) for k, v in m.grads.items()},
    )
