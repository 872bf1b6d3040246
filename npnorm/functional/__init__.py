"""The functional core: stateless forward/backward pairs and torch.nn.functional-style calls.

Each ``*_forward`` returns the output plus the small per-row or per-channel statistics
its ``*_backward`` needs; each ``*_backward`` takes the upstream gradient plus what
forward saved and returns ``(dx, dweight, dbias)``.
"""

from .layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from .rms_norm import rms_norm, rms_norm_backward, rms_norm_forward

__all__ = [
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
]
