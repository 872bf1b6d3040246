"""The arrays a staged forward starts from: NumPy, float64, copied."""

from __future__ import annotations

import array_api_compat
import numpy as np

from .._backend import Array
from .._checks import default_eps, float_inputs


def float64_leaves(**arrays: Array | None) -> list[np.ndarray | None]:
    """Each array as a float64 NumPy copy (``None`` stays ``None``), in the order given.

    npnorm.learn runs on NumPy in float64: the step checker compares gradients with
    finite differences, which resolve about 1e-10 in float64 and nothing useful in
    float32. The arrays are copied, so that the tape never aliases the caller's data.
    """
    xp = float_inputs(*arrays.values(), names=tuple(arrays))
    if not array_api_compat.is_numpy_namespace(xp):
        raise TypeError(
            f"npnorm.learn works on NumPy arrays (its checks run in float64 on the CPU); "
            f"got {xp.__name__} arrays: convert them with numpy.asarray first"
        )
    return [None if a is None else np.array(a, dtype=np.float64) for a in arrays.values()]


def refuse_empty(x: np.ndarray, name: str) -> None:
    """The staged graph runs on values: an input that holds none for some statistic (an
    empty batch, or no spatial values), which ``npnorm.functional.<name>_forward``
    takes (an empty output), is a ``ValueError`` saying so (means of nothing, NaN)."""
    if x.size == 0:
        raise ValueError(
            f"the staged {name} needs values to run: input of shape {x.shape} has none "
            f"(npnorm.functional.{name}_forward gives an empty output for it)"
        )


def machine_eps(input: Array) -> float:
    """RMSNorm's default eps: the machine epsilon of the dtype the library computes the
    input in (the weight's dtype aside, as in PyTorch)."""
    return default_eps(array_api_compat.array_namespace(input), input)
