"""The suite's handling of optional extras (tests/conftest.py): an ImportError of npnorm's
naming an extra skips the test only where one of that extra's packages is not installed."""

from __future__ import annotations

import conftest
import pytest
from helpers import extra_missing


def _error(message: str, cause: BaseException | None) -> ImportError:
    """npnorm's ImportError ``message``, raised from ``cause`` as npnorm raises it."""
    try:
        raise ImportError(message) from cause
    except ImportError as err:
        return err


MPI_HINT = "SyncBatchNorm needs mpi4py: pip install 'npnorm[mpi]' (mpi4py and the mpich MPI library)"


def test_an_import_error_for_a_package_of_the_extra_not_installed_is_a_skip_naming_it():
    err = _error(MPI_HINT, ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py"))
    with pytest.raises(pytest.skip.Exception, match=r"needs the 'mpi' extra.*\(the test met: SyncBatchNorm"):
        conftest._skip_if_its_extra_is_missing(err)


@pytest.mark.parametrize(
    "message, cause",
    [
        # mpi4py installed but unusable (no MPI library to load): a failure, not a skip
        (MPI_HINT, ImportError("libmpi.so.12: cannot open shared object file")),
        (MPI_HINT, None),
        (MPI_HINT, ModuleNotFoundError("No module named 'scipy'", name="scipy")),  # not the extra's
        ("No module named 'mpi4py'", ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py")),
        ("pip install 'npnorm[nosuchextra]'", ModuleNotFoundError("No module named 'x'", name="x")),
    ],
    ids=["broken mpi4py", "no cause", "other package", "no extra named", "unknown extra"],
)
def test_any_other_import_error_is_left_to_fail(message, cause):
    conftest._skip_if_its_extra_is_missing(_error(message, cause))  # returns: the hook re-raises


def test_extra_missing_names_what_is_absent(monkeypatch):
    monkeypatch.setattr(conftest.importlib.util, "find_spec", lambda name: None)
    reason = extra_missing("demo")
    assert reason == "needs the 'demo' extra (matplotlib, sklearn, tqdm missing): pip install -e \".[demo]\""
