"""tests/typed/user_code.py is the user code CI type-checks with ``mypy --strict``
(``.ci/run``): it must also run, so that what it type-checks is real usage."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_the_type_checked_user_code_runs(restore_threads):  # (it sets the thread count)
    runpy.run_path(str(Path(__file__).parent / "typed" / "user_code.py"), run_name="__main__")
