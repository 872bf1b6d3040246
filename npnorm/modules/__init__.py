"""Layers: thin holders of parameters, buffers and grads around :mod:`npnorm.functional`."""

from ._module import IncompatibleKeys, Module
from .batch_norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .group_norm import GroupNorm
from .instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "GroupNorm",
    "IncompatibleKeys",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Module",
    "RMSNorm",
    "SyncBatchNorm",
]
