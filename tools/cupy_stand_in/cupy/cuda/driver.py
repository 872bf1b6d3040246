"""cupy.cuda.driver stand-in: the occupancy query answers ``STANDIN_OCCUPANCY`` (2)."""

from __future__ import annotations

import os

_state = {"occupancy": int(os.environ.get("STANDIN_OCCUPANCY", "2"))}
QUERIES: list[tuple[int, int, int]] = []  # (function ptr, threads, dynamic shared memory)


def set_occupancy(n: int) -> None:
    _state["occupancy"] = int(n)


def occupancyMaxActiveBlocksPerMultiprocessor(func: int, blockSize: int, dynamicSMemSize: int) -> int:
    if not isinstance(func, int) or func <= 0:
        raise TypeError(f"occupancy query: a CUfunction pointer (a positive int), got {func!r}")
    blockSize, dynamicSMemSize = int(blockSize), int(dynamicSMemSize)
    if not 0 < blockSize <= 1024:
        raise ValueError(f"occupancy query: block size {blockSize} out of 1..1024")
    QUERIES.append((func, blockSize, dynamicSMemSize))
    return _state["occupancy"]
