"""The functional core: stateless forward/backward pairs and torch.nn.functional-style calls.

Each ``*_forward`` returns the output plus the small per-row or per-channel statistics
its ``*_backward`` needs (and, for the layers with running statistics, the updated
buffers, never writing them); each ``*_backward`` takes the upstream gradient plus
what forward saved and returns ``(dx, dweight, dbias)``. The torch-style calls
(``layer_norm``, ``batch_norm``, ...) return the output only; ``batch_norm`` and
``instance_norm`` update the running buffers they are given in place, as PyTorch's do.
"""

from .batch_norm import batch_norm, batch_norm_backward, batch_norm_forward
from .group_norm import group_norm, group_norm_backward, group_norm_forward
from .instance_norm import instance_norm, instance_norm_backward, instance_norm_forward
from .layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from .rms_norm import rms_norm, rms_norm_backward, rms_norm_forward
from .sync_batch_norm import sync_batch_norm_backward, sync_batch_norm_forward

__all__ = [
    "batch_norm",
    "batch_norm_backward",
    "batch_norm_forward",
    "group_norm",
    "group_norm_backward",
    "group_norm_forward",
    "instance_norm",
    "instance_norm_backward",
    "instance_norm_forward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "sync_batch_norm_backward",
    "sync_batch_norm_forward",
]
