"""Files the commands write: whole or not at all."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any


class CannotWrite(OSError):
    """A command's output file could not be written; the file is left as it was."""


def write_whole(path: pathlib.Path, write: Callable[[pathlib.Path], object]) -> None:
    """``write(part)`` into ``path``'s folder, then ``part`` renamed to ``path`` (an atomic
    replace): an interrupted or failed write leaves ``path`` as it was, and no part."""
    part = path.with_name(path.name + ".part")
    try:
        write(part)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON in ``path``, whole (``write_whole``); ``CannotWrite`` (a
    line that says why) where it fails: a full disk left a truncated file in place of the
    previous one, and a traceback, at the end of a benchmark."""

    def write(part: pathlib.Path) -> None:
        with open(part, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)

    try:
        write_whole(pathlib.Path(path), write)
    except OSError as err:
        raise CannotWrite(f"cannot write {path}: {err.strerror or err} (left as it was)") from None
