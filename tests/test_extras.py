"""The suite's handling of optional extras (tests/conftest.py): an ImportError of npnorm's
naming an extra skips the test only where that extra is missing."""

from __future__ import annotations

import conftest
import pytest
from helpers import extra_missing

MPI_ERROR = ImportError(
    "SyncBatchNorm needs mpi4py: pip install 'npnorm[mpi]' (mpi4py and the mpich MPI library)"
)


def test_an_import_error_for_a_missing_extra_is_a_skip_naming_it(monkeypatch):
    monkeypatch.setattr(conftest, "extra_missing", lambda extra: f"needs the {extra!r} extra")
    with pytest.raises(pytest.skip.Exception, match=r"needs the 'mpi' extra \(the test met: SyncBatchNorm"):
        conftest._skip_if_its_extra_is_missing(MPI_ERROR)


def test_an_import_error_for_an_installed_extra_or_no_extra_is_left_to_fail(monkeypatch):
    monkeypatch.setattr(conftest, "extra_missing", lambda extra: None)  # every extra installed
    conftest._skip_if_its_extra_is_missing(MPI_ERROR)  # returns: the hook re-raises the error
    monkeypatch.setattr(conftest, "extra_missing", lambda extra: f"needs the {extra!r} extra")
    conftest._skip_if_its_extra_is_missing(ImportError("No module named 'scipy'"))
    conftest._skip_if_its_extra_is_missing(ImportError("pip install 'npnorm[nosuchextra]'"))


def test_extra_missing_names_what_is_absent(monkeypatch):
    monkeypatch.setattr(conftest.importlib.util, "find_spec", lambda name: None)
    reason = extra_missing("demo")
    assert reason == "needs the 'demo' extra (matplotlib, sklearn, tqdm missing): pip install -e \".[demo]\""
