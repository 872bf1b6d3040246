"""Files the commands write: whole or not at all."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import stat
from collections.abc import Callable
from typing import Any


class CannotWrite(OSError):
    """A command's output file could not be written; the file is left as it was."""


def write_whole(path: pathlib.Path, write: Callable[[pathlib.Path], object]) -> None:
    """``write(part)`` into a new file beside ``path``, then ``part`` renamed to ``path`` (an
    atomic replace): an interrupted or failed write leaves ``path`` as it was, and no part.

    The part has a short name of its own (a name near the length limit, or a user's
    ``NAME.part``, is not in its way) and the mode a new file gets, or the mode and, where
    this process may give them (root's), the owner and group of the file it replaces. A
    symbolic link is followed (the file it names is replaced, the link kept); what is not a
    regular file (``/dev/stdout``, a FIFO) is written into directly, as ``open(path, "w")``
    does."""
    target = pathlib.Path(os.path.realpath(path))  # (a link: the file it names)
    try:
        old: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        old = None
    if old is not None and not stat.S_ISREG(old.st_mode):  # a device, a FIFO: no replacing it
        write(target)
        return
    part = _new_part(target.parent)
    try:
        if old is not None:
            _keep_owner(part, old)
            os.chmod(part, stat.S_IMODE(old.st_mode))  # (after chown, which clears setuid bits)
        write(part)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)


def _keep_owner(part: pathlib.Path, old: os.stat_result) -> None:
    """``part`` given ``old``'s owner and group where they differ and this process may give
    them (root may; a user may pick one of their own groups); else, best effort, left as
    created, as an editor's save leaves it: a refused chown never fails the write."""
    now = os.stat(part)
    if (now.st_uid, now.st_gid) == (old.st_uid, old.st_gid):
        return
    for uid, gid in ((old.st_uid, old.st_gid), (-1, old.st_gid)):  # both, else the group alone
        try:
            os.chown(part, uid, gid)
            return
        except (OSError, AttributeError):  # not allowed, not supported (EINVAL: an id not
            continue  # mapped in a user namespace; ENOTSUP); no os.chown on Windows


def _new_part(folder: pathlib.Path) -> pathlib.Path:
    """A new empty file in ``folder`` with a name no other has, created with the mode a new
    file gets (0666 less the umask; ``tempfile`` gives 0600)."""
    while True:
        part = folder / f".npnorm-{secrets.token_hex(6)}.part"
        try:
            os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return part


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
