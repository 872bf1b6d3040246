"""The module protocol every npnorm layer shares.

A module only holds state: parameters (``weight``, ``bias``), buffers (running
statistics), accumulated gradients, the train/eval flag and what the last forward
saved for backward. All math lives in :mod:`npnorm.functional`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

from .._backend import (
    FLOAT_NAMES,
    Array,
    Namespace,
    namespace_of,
    resolve_dtype,
    resolve_namespace,
    to_namespace,
)

Saved = tuple[Any, ...]
Updates = dict[str, Array]


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` skipped, as in PyTorch."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def dtype_name(xp: Namespace, dtype: Any) -> str:
    for name in (*FLOAT_NAMES, "int64"):
        if getattr(xp, name, None) == dtype:
            return name
    raise TypeError(f"unsupported dtype {dtype!r}")


class Module:
    """Base class: parameters, buffers, grads, train/eval, state_dict, backend moves.

    Subclasses list their parameter and buffer names, create them in ``__init__``
    and implement ``_forward`` (validate and compute, changing nothing; return the
    output, what backward needs and the buffer updates) and ``_backward``.
    """

    _parameter_names: tuple[str, ...] = ()
    _buffer_names: tuple[str, ...] = ()

    def __init__(self, *, dtype: Any = None, xp: str | ModuleType | None = None) -> None:
        self.xp: Namespace = resolve_namespace(xp)
        self.dtype: Any = resolve_dtype(self.xp, dtype)
        self.training: bool = True
        self.grads: dict[str, Array] = {}
        self._saved: Saved | None = None

    # --- forward / backward -------------------------------------------------

    def __call__(self, input: Array) -> Array:
        return self.forward(input)

    def forward(self, input: Array) -> Array:
        """Normalize ``input`` and save what ``backward`` needs.

        Raises before changing anything: on bad input the parameters, buffers,
        counters and the previously saved context are exactly as they were.
        """
        output, saved, updates = self._forward(input)
        for name, value in updates.items():
            setattr(self, name, value)
        self._saved = saved
        return output

    def backward(self, grad_output: Array) -> Array:
        """Gradient of the input for the last forward; parameter gradients are
        added into ``self.grads`` (as ``.grad`` accumulates in PyTorch)."""
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward() called with no saved forward: call forward first"
            )
        grad_input, param_grads = self._backward(grad_output, self._saved)
        for name, g in param_grads.items():
            if g is None:
                continue
            self.grads[name] = self.grads[name] + g if name in self.grads else g
        return grad_input

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        raise NotImplementedError

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        raise NotImplementedError

    # --- parameters, grads, modes ------------------------------------------

    def parameters(self) -> dict[str, Array]:
        """Name-to-array dict of the parameters that exist (absent ones are left out)."""
        return {n: getattr(self, n) for n in self._parameter_names if getattr(self, n) is not None}

    def buffers(self) -> dict[str, Array]:
        return {n: getattr(self, n) for n in self._buffer_names if getattr(self, n) is not None}

    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""
        self.grads.clear()

    def train(self, mode: bool = True) -> Module:
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    # --- state_dict ----------------------------------------------------------

    def state_dict(self) -> dict[str, Array]:
        """Parameters then buffers, under PyTorch's key names for the same layer."""
        return {**self.parameters(), **self.buffers()}

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> IncompatibleKeys:
        """Copy values from ``state_dict`` (NumPy arrays, lists, CPU torch tensors,
        arrays of any backend) into this module's parameters and buffers.

        Every key and shape is checked, and every value converted, before anything
        is assigned: on error (``RuntimeError``, as PyTorch raises) the module is
        left exactly as it was. With ``strict=False`` missing and unexpected keys
        are returned instead of raised; shape mismatches still raise.
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        if strict and unexpected:
            errors.append("unexpected key(s): " + ", ".join(map(repr, unexpected)))
        if strict and missing:
            errors.append("missing key(s): " + ", ".join(map(repr, missing)))
        staged: dict[str, Array] = {}
        for key, current in own.items():
            if key not in state_dict:
                continue
            try:
                value = to_namespace(state_dict[key], self.xp, current.dtype)
            except (TypeError, ValueError) as err:
                errors.append(f"{key!r}: cannot convert to an array ({err})")
                continue
            if tuple(value.shape) != tuple(current.shape):
                errors.append(
                    f"size mismatch for {key!r}: the checkpoint has shape {tuple(value.shape)}, "
                    f"this module has {tuple(current.shape)}"
                )
                continue
            staged[key] = value
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__} (nothing was changed):\n\t"
                + "\n\t".join(errors)
            )
        for key, value in staged.items():
            setattr(self, key, value)
        return IncompatibleKeys(missing, unexpected)

    # --- backends ------------------------------------------------------------

    def to(self, xp: str | ModuleType | None = None, *, dtype: Any = None) -> Module:
        """Move parameters, buffers and grads to another backend (``"numpy"``,
        ``"cupy"``, ``"array_api_strict"`` or a namespace module) and/or cast the
        floating ones to ``dtype``. Returns the module. The saved forward context
        is dropped: run forward again before backward."""
        new_xp = self.xp if xp is None else resolve_namespace(xp)
        new_dtype = resolve_dtype(new_xp, dtype_name(self.xp, self.dtype) if dtype is None else dtype)
        moved: dict[str, Array] = {}
        for name in (*self._parameter_names, *self._buffer_names):
            value = getattr(self, name)
            if value is not None:
                moved[name] = self._moved(value, new_xp, new_dtype)
        grads = {n: self._moved(g, new_xp, new_dtype) for n, g in self.grads.items()}
        for name, value in moved.items():
            setattr(self, name, value)
        self.grads.clear()
        self.grads.update(grads)
        self.xp, self.dtype = new_xp, new_dtype
        self._saved = None
        return self

    def _moved(self, value: Array, new_xp: Namespace, new_dtype: Any) -> Array:
        name = dtype_name(self.xp, value.dtype)
        target = new_dtype if name in FLOAT_NAMES else getattr(new_xp, name)
        return to_namespace(value, new_xp, target)

    def _check_backend(self, input: Array) -> Namespace:
        """Namespace of ``input``, which must match the module's arrays."""
        xp = namespace_of(input, what="input")
        if xp is self.xp:  # the module's arrays are of self.xp (the functional checks them too)
            return xp
        held = [*self.parameters().values(), *self.buffers().values()]
        return namespace_of(input, *held, what="input and the module's parameters/buffers")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
