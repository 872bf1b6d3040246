"""The library's closed forms called with the same arguments as a staged forward.

``npnorm.functional.<name>_forward`` then ``<name>_backward`` on the saved statistics:
what ``--staged-vs-closed`` and the tests compare the tape with.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .. import functional as F


def closed(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], grad_output: np.ndarray
) -> dict[str, Any]:
    """``{"y", "input", "weight", "bias"}`` (the last two ``None`` when absent) from the library."""
    forward = getattr(F, f"{name}_forward")
    bound = inspect.signature(forward).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    out = forward(*bound.args, **bound.kwargs)
    dy, x, w = grad_output, a["input"], a["weight"]
    if name == "layer_norm":
        y, mean, rstd = out
        grads = F.layer_norm_backward(dy, x, a["normalized_shape"], mean, rstd, w, a["bias"])
    elif name == "rms_norm":
        y, rstd = out
        grads = F.rms_norm_backward(dy, x, a["normalized_shape"], rstd, w)
    elif name == "group_norm":
        y, mean, rstd = out
        grads = F.group_norm_backward(dy, x, a["num_groups"], mean, rstd, w, a["bias"])
    elif name == "batch_norm":
        y, mean, rstd, *_ = out
        grads = F.batch_norm_backward(dy, x, mean, rstd, w, a["bias"], a["training"])
    elif name == "instance_norm":
        y, mean, rstd, *_ = out
        grads = F.instance_norm_backward(dy, x, mean, rstd, w, a["bias"], a["use_input_stats"])
    else:
        raise ValueError(f"unknown layer {name!r}")
    result = {"y": y, "input": grads[0], "weight": grads[1], "bias": grads[2]}
    if name in ("batch_norm", "instance_norm"):
        result["running_mean"], result["running_var"] = out[3], out[4]
    return result
