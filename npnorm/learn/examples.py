"""The small examples ``python -m npnorm learn`` and the exercises run on (fixed seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Call = tuple[tuple[Any, ...], dict[str, Any]]
SPLIT = (2, 1, 0, 1)  # sync_batch_norm: samples per rank (uneven, one rank empty)


def example(
    name: str,
    *,
    eval: bool = False,
    groups: int = 3,
    seed: int = 0,
    split: Sequence[int] = SPLIT,
    shape: Sequence[int] | None = None,
    eps: float | None = None,
) -> Call:
    """Arguments of ``npnorm.functional.<name>_forward`` for a small example, float64.

    ``eval``: BatchNorm with ``training=False``, InstanceNorm with ``use_input_stats=False``.
    ``groups``: GroupNorm's number of groups (of the small example's 6 channels).
    ``split``: SyncBatchNorm's samples per rank; the batch has ``sum(split)`` samples (with
    the default, BatchNorm's example batch, split over 4 ranks). ``shape``: the input's
    shape instead of the small example's (channels on axis 1; LayerNorm normalizes the two
    trailing axes, RMSNorm the last; SyncBatchNorm's ``shape[0]`` must be ``sum(split)``);
    ``eps``: passed on where given. The exercises' second examples are these, with other
    sizes and seed.
    """
    rng = np.random.default_rng(seed)
    kw: dict[str, Any] = {} if eps is None else {"eps": eps}

    def data(default: tuple[int, ...]) -> np.ndarray:
        return rng.normal(0.5, 2.0, default if shape is None else tuple(shape))  # mean, spread not 0, 1

    def param(*s: int) -> np.ndarray:
        return rng.normal(1.0, 0.5, s)

    if name == "layer_norm":
        x = data((2, 3, 4, 5))
        return (x, x.shape[2:], param(*x.shape[2:]), param(*x.shape[2:])), kw
    if name == "rms_norm":
        x = data((2, 3, 8))
        return (x, x.shape[-1], param(x.shape[-1])), kw
    if name == "group_norm":
        x = data((2, 6, 2, 2))
        return (x, groups, param(x.shape[1]), param(x.shape[1])), kw
    C = 3 if shape is None else int(shape[1])
    running = (rng.normal(0.5, 0.2, C), rng.uniform(3.0, 5.0, C))  # running mean and var
    if name == "batch_norm":
        return (data((4, 3, 2, 2)), *running, param(C), param(C)), {"training": not eval, **kw}
    if name == "sync_batch_norm":
        if shape is not None and int(shape[0]) != sum(split):
            raise ValueError(
                f"shape[0] ({shape[0]}) must be sum(split) ({sum(split)}): the samples split over ranks"
            )
        return (data((sum(split), 3, 2, 2)), *running, param(C), param(C)), {"training": True, **kw}
    if name == "instance_norm":
        return (data((2, 3, 2, 3)), *running, param(C), param(C)), {"use_input_stats": not eval, **kw}
    raise ValueError(f"no example for {name!r}")


def upstream(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    """The ``dy`` of the loss ``L = sum(y · dy)``: random normal."""
    return np.random.default_rng(seed).standard_normal(shape)
