"""npnorm: normalization layers with explicit analytical backward passes.

BatchNorm, LayerNorm, RMSNorm, GroupNorm and InstanceNorm written against the Array
API (NumPy, CuPy, ...), PyTorch-exact in semantics and checked against finite
differences and ``torch.autograd``.
"""

from . import functional
from .gradient_check import GradcheckError, gradcheck
from .modules import IncompatibleKeys, LayerNorm, Module, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "GradcheckError",
    "IncompatibleKeys",
    "LayerNorm",
    "Module",
    "RMSNorm",
    "__version__",
    "functional",
    "gradcheck",
]
