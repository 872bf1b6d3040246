"""The small examples ``python -m npnorm learn`` and the exercises run on (fixed seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Call = tuple[tuple[Any, ...], dict[str, Any]]
SPLIT = (2, 1, 0, 1)  # sync_batch_norm: samples per rank (uneven, one rank empty)


def example(
    name: str, *, eval: bool = False, groups: int = 3, seed: int = 0, split: Sequence[int] = SPLIT
) -> Call:
    """Arguments of ``npnorm.functional.<name>_forward`` for a small example, float64.

    ``eval``: BatchNorm with ``training=False``, InstanceNorm with ``use_input_stats=False``.
    ``groups``: GroupNorm's number of groups (of 6 channels). ``split``: SyncBatchNorm's
    samples per rank; the batch has ``sum(split)`` samples (with the default, BatchNorm's
    example batch, split over 4 ranks).
    """
    rng = np.random.default_rng(seed)

    def data(*shape: int) -> np.ndarray:
        return rng.normal(0.5, 2.0, shape)  # a mean and a spread that are not 0 and 1

    def param(*shape: int) -> np.ndarray:
        return rng.normal(1.0, 0.5, shape)

    if name == "layer_norm":
        return (data(2, 3, 4, 5), (4, 5), param(4, 5), param(4, 5)), {}
    if name == "rms_norm":
        return (data(2, 3, 8), 8, param(8)), {}
    if name == "group_norm":
        return (data(2, 6, 2, 2), groups, param(6), param(6)), {}
    running = (rng.normal(0.5, 0.2, 3), rng.uniform(3.0, 5.0, 3))  # running mean and var
    if name == "batch_norm":
        return (data(4, 3, 2, 2), *running, param(3), param(3)), {"training": not eval}
    if name == "sync_batch_norm":
        return (data(sum(split), 3, 2, 2), *running, param(3), param(3)), {"training": True}
    if name == "instance_norm":
        return (data(2, 3, 2, 3), *running, param(3), param(3)), {"use_input_stats": not eval}
    raise ValueError(f"no example for {name!r}")


def upstream(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    """The ``dy`` of the loss ``L = sum(y · dy)``: random normal."""
    return np.random.default_rng(seed).standard_normal(shape)
