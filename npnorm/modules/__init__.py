"""Layers: thin holders of parameters, buffers and grads around :mod:`npnorm.functional`."""

from ._module import IncompatibleKeys, Module
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm

__all__ = ["IncompatibleKeys", "LayerNorm", "Module", "RMSNorm"]
