"""npnorm: normalization layers with explicit analytical backward passes.

BatchNorm, LayerNorm, RMSNorm, GroupNorm and InstanceNorm written against the Array
API (NumPy, CuPy, ...), PyTorch-exact in semantics and checked against finite
differences and ``torch.autograd``.
"""

from . import functional, learn
from ._grad_mode import enable_grad, is_grad_enabled, no_grad
from ._threads import get_num_threads, set_num_threads
from .convert import from_torch, to_torch
from .functional._dispatch import get_kernels, kernels_available, set_kernels, use_kernels
from .gradient_check import GradcheckError, gradcheck
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    IncompatibleKeys,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Module,
    RMSNorm,
    SyncBatchNorm,
)

__version__ = "0.1.0"

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "GradcheckError",
    "GroupNorm",
    "IncompatibleKeys",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Module",
    "RMSNorm",
    "SyncBatchNorm",
    "__version__",
    "enable_grad",
    "from_torch",
    "functional",
    "get_kernels",
    "get_num_threads",
    "gradcheck",
    "is_grad_enabled",
    "kernels_available",
    "learn",
    "no_grad",
    "set_kernels",
    "set_num_threads",
    "to_torch",
    "use_kernels",
]
