"""``from_torch`` / ``to_torch``: a torch.nn norm layer to the same npnorm layer and back.

One row of ``PAIRS`` per layer: the ``torch.nn`` class name, the npnorm class, and
the function that reads the constructor arguments off a module of either library
(both use PyTorch's attribute names). Adding a layer is adding a row. Everything
else, the dtype, the state (copied) and the train/eval flag, is handled the same
way for every row. torch is imported only when a conversion runs.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ._backend import FLOAT_NAMES, to_host
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Module,
    RMSNorm,
    SyncBatchNorm,
)
from .modules._module import dtype_name


@dataclass(frozen=True)
class Pair:
    """A torch.nn layer and the npnorm layer that computes the same thing."""

    torch_name: str  # the class's name in torch.nn
    npnorm_class: type[Module]
    arguments: Callable[[Any], dict[str, Any]]  # constructor arguments of a module of either library


def _affine(m: Any, flag: str) -> bool:
    """The affine flag a layer is built with: as ``m`` has it, or true where ``m`` holds a
    weight or bias though its flag was set false after construction (both libraries then
    still apply them; the flag is set after the load, ``_set_flags_after_load``)."""
    return (
        bool(getattr(m, flag))
        or getattr(m, "weight", None) is not None
        or getattr(m, "bias", None) is not None
    )


def _layer_norm_args(m: Any) -> dict[str, Any]:
    affine = _affine(m, "elementwise_affine")
    return {
        "normalized_shape": tuple(m.normalized_shape),
        "eps": m.eps,
        "elementwise_affine": affine,
        "bias": m.bias is not None if affine else True,
    }


def _rms_norm_args(m: Any) -> dict[str, Any]:
    return {
        "normalized_shape": tuple(m.normalized_shape),
        "eps": m.eps,
        "elementwise_affine": _affine(m, "elementwise_affine"),
    }


def _group_norm_args(m: Any) -> dict[str, Any]:
    affine = _affine(m, "affine")
    return {
        "num_groups": m.num_groups,
        "num_channels": m.num_channels,
        "eps": m.eps,
        "affine": affine,
        "bias": m.bias is not None if affine else True,
    }


def _norm_base_args(m: Any) -> dict[str, Any]:
    """BatchNorm*d, InstanceNorm*d (and SyncBatchNorm): PyTorch's ``_NormBase`` arguments.
    A layer whose ``track_running_stats`` was set false after construction keeps its
    buffers (in both libraries): built with them, and the flag set after the load
    (``_set_flags_after_load``); so does one whose ``affine`` was (``_affine``)."""
    affine = _affine(m, "affine")
    return {
        "num_features": m.num_features,
        "eps": m.eps,
        "momentum": m.momentum,
        "affine": affine,
        "track_running_stats": m.track_running_stats or _holds_running_buffers(m),
        "bias": m.bias is not None if affine else True,
    }


PAIRS: tuple[Pair, ...] = (
    Pair("LayerNorm", LayerNorm, _layer_norm_args),
    Pair("RMSNorm", RMSNorm, _rms_norm_args),
    Pair("BatchNorm1d", BatchNorm1d, _norm_base_args),
    Pair("BatchNorm2d", BatchNorm2d, _norm_base_args),
    Pair("BatchNorm3d", BatchNorm3d, _norm_base_args),
    Pair("GroupNorm", GroupNorm, _group_norm_args),
    Pair("InstanceNorm1d", InstanceNorm1d, _norm_base_args),
    Pair("InstanceNorm2d", InstanceNorm2d, _norm_base_args),
    Pair("InstanceNorm3d", InstanceNorm3d, _norm_base_args),
    Pair("SyncBatchNorm", SyncBatchNorm, _norm_base_args),
)


def _import_torch(what: str) -> ModuleType:
    try:
        return importlib.import_module("torch")
    except ImportError as err:
        raise ImportError(
            f"npnorm.{what} needs PyTorch, which is not installed: pip install torch "
            "(npnorm's 'parity' extra pins the version its tests use)"
        ) from err


def _names(pairs: tuple[Pair, ...], torch_side: bool) -> str:
    return ", ".join(("torch.nn." + p.torch_name) if torch_side else p.npnorm_class.__name__ for p in pairs)


def _holds_running_buffers(m: Any) -> bool:
    return any(
        getattr(m, name, None) is not None for name in ("running_mean", "running_var", "num_batches_tracked")
    )


def _set_flags_after_load(source: Any, target: Any) -> None:
    """``track_running_stats`` and the affine flag as ``source`` has them now (see
    ``_norm_base_args``, ``_affine``), and the train/eval flag."""
    for flag in ("track_running_stats", "affine", "elementwise_affine"):
        if hasattr(source, flag):
            setattr(target, flag, getattr(source, flag))
    target.train(source.training)


def _drop_unset(source: Any, target: Any) -> None:
    """Set to None the parameters and buffers of ``target`` that are None in ``source``:
    a layer whose weight (or bias) was set to None after construction (it then
    normalizes without it, in both libraries), or a BatchNorm whose running statistics
    were (it then normalizes with batch statistics in eval too), has no such keys to load."""
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        if getattr(source, name, None) is None and getattr(target, name, None) is not None:
            setattr(target, name, None)


# a torch module's hooks on its own calls (torch.nn.Module's attributes), which from_torch warns of
_HOOKS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_state_dict_hooks": "state_dict hooks",
}


def from_torch(module: Any, *, xp: str | ModuleType | None = None, device: Any = None) -> Module:
    """The npnorm layer equivalent to a ``torch.nn`` normalization layer.

    The result has the same class, constructor arguments (eps, momentum, affine
    flags, shapes, ...), dtype, state and train/eval flag as ``module``. The state
    is copied: the two modules share no memory. ``to_torch`` is the inverse, and
    ``to_torch(from_torch(m))`` reproduces ``m`` exactly, but for bfloat16 and the
    parameters' ``requires_grad`` (npnorm has no such flag: to_torch's parameters
    require grad, as torch's constructors make them).

    Converted layers: torch.nn.LayerNorm, RMSNorm, BatchNorm1d/2d/3d, GroupNorm,
    InstanceNorm1d/2d/3d and SyncBatchNorm (``npnorm.convert.PAIRS``). The class must be one of
    these exactly: a subclass may compute something else and is refused. Hooks on the
    layer's calls (``register_forward_hook`` and the like) or on its ``state_dict`` are
    not carried over (the layer's own tensors are copied), nor is a SyncBatchNorm's
    ``process_group``: a ``UserWarning`` names them.

    Parameters
    ----------
    module : torch.nn.Module
        The layer, on any device. Its dtype is kept: float16, float32 and float64
        as they are; bfloat16 (which npnorm does not have) becomes float32, exactly.
    xp : str or namespace module, keyword-only, default None
        Backend of the new module's arrays ("numpy", "cupy", "torch", ...); None
        means NumPy.
    device : device, keyword-only, default None
        Device of the new module's arrays, one of that backend's (``None``: its
        default device). ``from_torch(m, xp="torch", device=m.weight.device)``
        keeps a layer on its GPU.

    Returns
    -------
    npnorm.Module

    Raises
    ------
    ImportError
        When torch is not installed.
    TypeError
        When ``module`` is not one of the converted torch.nn classes.
    ValueError
        When its tensors have different float dtypes (an npnorm layer holds one), or are
        on torch's meta device (no values) while the new module is not.

    Examples
    --------
    >>> import torch, npnorm
    >>> ref = torch.nn.LayerNorm(384, eps=1e-12, dtype=torch.float64)
    >>> ln = npnorm.from_torch(ref)
    >>> ln
    LayerNorm((384,), eps=1e-12, elementwise_affine=True, bias=True)
    >>> ln.weight.dtype
    dtype('float64')
    """
    torch = _import_torch("from_torch")
    pair = next((p for p in PAIRS if type(module) is getattr(torch.nn, p.torch_name, None)), None)
    if pair is None:
        hint = " (an npnorm module: npnorm.to_torch converts that way)" if isinstance(module, Module) else ""
        if getattr(module, "parametrizations", None) is not None:
            hint = (
                " (a layer with parametrizations: torch.nn.utils.parametrize.remove_parametrizations("
                "module, name) makes it a plain layer again, with the computed values)"
            )
        raise TypeError(
            f"npnorm.from_torch converts {_names(PAIRS, True)} (exactly these classes, not subclasses); "
            f"got {type(module).__module__}.{type(module).__qualname__}{hint}"
        )
    hooks = [kind for attribute, kind in _HOOKS.items() if getattr(module, attribute, None)]
    if hooks:  # (a subclass is refused; a hook may change the output as much, or only watch it)
        warnings.warn(
            f"npnorm.from_torch: the {type(module).__name__} has {', '.join(hooks)}, which the npnorm "
            "layer does not carry over: it computes the layer alone",
            UserWarning,
            stacklevel=2,
        )
    if getattr(module, "process_group", None) is not None:
        warnings.warn(
            "npnorm.from_torch: the SyncBatchNorm's process_group is not carried over: the npnorm "
            "layer syncs over its comm (None: MPI's COMM_WORLD); set comm= to the ranks' communicator",
            UserWarning,
            stacklevel=2,
        )
    # the layer's own tensors, not its state_dict(): a state_dict hook may change what that gives
    own = OrderedDict(
        (k, v)
        for k, v in (
            *module.named_parameters(recurse=False, remove_duplicate=False),  # (tied: each name)
            *module.named_buffers(recurse=False, remove_duplicate=False),
        )
        if k not in getattr(module, "_non_persistent_buffers_set", ())
    )
    floating = sorted({str(t.dtype).removeprefix("torch.") for t in own.values() if t.is_floating_point()})
    if len(floating) > 1:  # (an npnorm layer holds one dtype: the others would be rounded)
        raise ValueError(
            f"npnorm.from_torch: the {type(module).__name__}'s tensors have different dtypes "
            f"({', '.join(floating)}); an npnorm layer holds one: cast the layer first "
            f"(module.to(torch.float32), say)"
        )
    name = floating[0] if floating else str(torch.get_default_dtype()).removeprefix("torch.")
    ours = pair.npnorm_class(
        **pair.arguments(module), device=device, dtype=name if name in FLOAT_NAMES else "float32", xp=xp
    )
    meta = [k for k, v in own.items() if v.is_meta]
    if meta and getattr(ours._device(), "type", None) != "meta":  # (else nothing to copy: meta to meta)
        raise ValueError(
            f"npnorm.from_torch: {', '.join(meta)} are on torch's meta device, which holds no values to "
            f"convert: move the layer off it first, or build on it (xp='torch', device='meta')"
        )
    _drop_unset(module, ours)
    if not meta:
        own._metadata = OrderedDict({"": {"version": getattr(module, "_version", 1)}})  # type: ignore[attr-defined]
        ours.load_state_dict(own)
    _set_flags_after_load(module, ours)
    return ours


def to_torch(module: Module) -> Any:
    """The ``torch.nn`` layer equivalent to an npnorm layer (CPU; ``.to(device)`` moves it).

    Same class, constructor arguments, dtype, state (copied) and train/eval flag;
    the inverse of ``from_torch``. The module can be on any npnorm backend. A layer
    that holds no arrays (no affine parameters, no running statistics) has no dtype
    in torch: ``from_torch`` gives it torch's default dtype back.

    Loading only the state into an existing torch layer is a one-liner, since
    torch's ``load_state_dict`` wants torch tensors (for a NumPy-backed module)::

        torch_layer.load_state_dict({k: torch.as_tensor(v) for k, v in layer.state_dict().items()})

    Parameters
    ----------
    module : npnorm.Module
        One of LayerNorm, RMSNorm, BatchNorm1d/2d/3d, GroupNorm, InstanceNorm1d/2d/3d,
        SyncBatchNorm.

    Returns
    -------
    torch.nn.Module

    Raises
    ------
    ImportError
        When torch is not installed.
    TypeError
        When ``module`` is not one of the converted npnorm classes.
    ValueError
        When its arrays are on torch's meta device (no values).

    Examples
    --------
    >>> import npnorm
    >>> bn = npnorm.BatchNorm2d(8, momentum=None).eval()
    >>> ref = npnorm.to_torch(bn)
    >>> ref, ref.training
    (BatchNorm2d(8, eps=1e-05, momentum=None, affine=True, bias=True, track_running_stats=True), False)
    """
    torch = _import_torch("to_torch")
    pair = next((p for p in PAIRS if type(module) is p.npnorm_class), None)
    if pair is None:
        raise TypeError(
            f"npnorm.to_torch converts npnorm's {_names(PAIRS, False)} (exactly these classes); "
            f"got {type(module).__module__}.{type(module).__qualname__}"
        )
    own = module.state_dict()
    meta = [k for k, v in own.items() if getattr(v, "is_meta", False)]
    if meta:  # (torch's own error: "Cannot copy out of meta tensor; no data!")
        raise ValueError(
            f"npnorm.to_torch: {', '.join(meta)} are on torch's meta device, which holds no values to "
            f"convert: build the torch layer itself there (torch.nn.{pair.torch_name}(..., device='meta'))"
        )
    tdtype = getattr(torch, dtype_name(module.xp, module.dtype))
    cls = getattr(torch.nn, pair.torch_name)
    arguments = pair.arguments(module)
    # torch before 2.13 has no bias= in BatchNorm, InstanceNorm and GroupNorm: build the layer
    # with its bias, then unset it, which leaves what bias=False builds (no parameter, no key)
    has_bias = True
    if "bias" not in inspect.signature(cls).parameters:
        has_bias = arguments.pop("bias", True)
    ref = cls(**arguments, dtype=tdtype)
    if not has_bias:
        ref.bias = None
    _drop_unset(module, ref)
    state = OrderedDict((k, torch.from_numpy(to_host(v))) for k, v in own.items())
    # the module's own version, as a torch state_dict carries it: a BatchNorm whose counter
    # is None has no num_batches_tracked key, which torch fills in for an unversioned dict
    state._metadata = OrderedDict({"": {"version": getattr(ref, "_version", 1)}})  # type: ignore[attr-defined]
    ref.load_state_dict(state)
    _set_flags_after_load(module, ref)
    return ref
