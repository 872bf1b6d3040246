"""The module protocol every npnorm layer shares.

A module only holds state: parameters (``weight``, ``bias``), buffers (running
statistics), accumulated gradients, the train/eval flag and what the last forward
saved for backward. All math lives in :mod:`npnorm.functional`.
"""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from types import ModuleType
from typing import Any, ClassVar, NamedTuple, TypeVar

import array_api_compat
import numpy as np

from .._backend import (
    FLOAT_NAMES,
    Array,
    Namespace,
    _default_device,
    backend_name,
    check_dense,
    check_device,
    copy_array,
    counter_dtype,
    device_has,
    namespace_of,
    on_device_of,
    requires_grad,
    resolve_dtype,
    resolve_namespace,
    shown,
    to_host,
    to_namespace,
    torch_refuses_in_place,
    writable,
    write_uncounted,
)
from .._checks import same_but_byte_order
from .._grad_mode import is_grad_enabled

Saved = tuple[Any, ...]
Updates = dict[str, Array]
_M = TypeVar("_M", bound="Module")  # the layer a method returns: itself, or a copy of its class

# The constructor arguments every layer takes last (device and dtype where PyTorch has
# them, xp keyword-only), as its docstring lists them.
DEVICE_DTYPE_XP_DOC = """device : device, default None
        Where the parameters (and buffers) are created: a device of the backend
        ``xp`` ("cpu" for NumPy; a ``torch.device`` or "cuda:0" with
        ``xp="torch"``); ``None`` is the backend's default device, and a device
        the backend does not have raises ``ValueError``.
    dtype : str or dtype, default "float32"
        Floating dtype of the parameters (and running statistics): "float16",
        "float32" or "float64" (or a NumPy or backend dtype; another backend's,
        such as ``torch.float64``, names the dtype of the same name). Input of
        another float dtype is computed at the wider of the two precisions
        (float16 input in float32) and returned in its own dtype.
    xp : str or namespace module, keyword-only, default "numpy"
        Array backend of the parameters and buffers: "numpy", "cupy", "torch",
        "array_api_strict" or an Array API namespace module. The input must be
        of the same backend (``TypeError`` otherwise; ``to()`` moves a module)."""


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` did not match, as PyTorch's ``_IncompatibleKeys``.

    Returned by :meth:`Module.load_state_dict`; with ``strict=True`` (the default)
    both lists are empty, since anything unmatched raises instead.

    Parameters
    ----------
    missing_keys : list of str
        Keys of this module that the state_dict did not have (left unchanged).
    unexpected_keys : list of str
        Keys of the state_dict that this module does not have (ignored).

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> npnorm.LayerNorm(3).load_state_dict({"weight": np.ones(3), "scale": 1.0}, strict=False)
    IncompatibleKeys(missing_keys=['bias'], unexpected_keys=['scale'])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


# the other dtypes a buffer may have (a layer of your own's int32 or bool buffer), which to() keeps
_OTHER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool")


def dtype_name(xp: Namespace, dtype: Any) -> str:
    if isinstance(dtype, np.dtype):  # NumPy's ">f4" (a memmap's, a file's) is float32
        dtype = dtype.newbyteorder("=")
    for name in (*FLOAT_NAMES, *_OTHER_DTYPES):  # int32: also a counter on JAX without x64
        if getattr(xp, name, None) == dtype:
            return name
    raise TypeError(f"unsupported dtype {dtype!r} (a module's arrays are float, int or bool)")


def _prefix_hint(missing: list[str], source: Mapping[Any, Any], own: Mapping[str, Array]) -> str:
    """A whole model's state_dict given to one layer: a hint naming the prefixes (at most
    three) under which every missing key is found with this layer's shape."""
    found: list[str] = []
    name = missing[0]  # each prefix must hold this key, and then every other missing one
    for key in source:
        if not (isinstance(key, str) and key.endswith("." + name)):
            continue
        head = key[: -len(name)]
        fits = all(tuple(getattr(source.get(head + k), "shape", ())) == tuple(own[k].shape) for k in missing)
        if fits and head not in found:
            found.append(head)
    if not found:
        return ""
    listed = ", ".join(f"prefix={p!r}" for p in found[:3]) + (", ..." if len(found) > 3 else "")
    return f" (a model's state_dict? this layer's keys may be under a prefix: {listed})"


class Module:
    """Base class of every npnorm layer: parameters, buffers, grads, train/eval,
    ``state_dict``, backend moves, pickling.

    A module only holds state: its parameters (``weight``, ``bias``), its buffers
    (running statistics), the gradients accumulated by ``backward`` in
    ``self.grads``, the train/eval flag and what the last forward saved for
    backward. The math lives in :mod:`npnorm.functional`.

    Writing a layer of your own: list the names of its parameters and buffers in
    the class attributes ``_parameter_names`` and ``_buffer_names``, create them in
    ``__init__`` (after ``super().__init__(dtype=dtype, xp=xp)``, with ``self.xp``
    and ``self.dtype``; an absent one is ``None``), and implement two methods:

    ``_forward(input) -> (output, saved, updates)``
        Validate and compute, changing nothing on ``self``. ``saved`` is a tuple of
        whatever ``_backward`` needs, the parameters the forward used included (a
        ``weight`` assigned after the forward is not the one to differentiate);
        ``updates`` maps buffer names to their new values. ``forward`` assigns the
        updates and keeps ``saved`` only after ``_forward`` returned, so that a
        forward that raises changes nothing.
    ``_backward(grad_output, saved) -> (grad_input, {name: grad or None})``
        The input gradient, and each parameter's gradient (``None`` for an absent
        parameter); ``backward`` adds them into ``self.grads``.

    ``npnorm.gradcheck(module, x)`` then checks the backward against finite
    differences.

    Parameters
    ----------
    device : device, keyword-only, default None
        A device of the backend ``xp``, checked here (``ValueError`` for one it does
        not have); the layer creates its arrays there (``device=device``).
    dtype : float dtype or its name, keyword-only, default float32
        Floating dtype of the parameters (and running statistics): "float16",
        "float32" or "float64", a NumPy dtype, or a dtype of the backend.
    xp : str or namespace module, keyword-only, default "numpy"
        Array backend of the parameters and buffers: "numpy", "cupy", "torch",
        "array_api_strict", or an Array API namespace module. Inputs must come
        from the same backend.

    Examples
    --------
    A layer that multiplies its input by a learned scalar:

    >>> import numpy as np, npnorm
    >>> class Scale(npnorm.Module):
    ...     _parameter_names = ("weight",)
    ...     def __init__(self, *, dtype=None, xp=None):
    ...         super().__init__(dtype=dtype, xp=xp)
    ...         self.weight = self.xp.ones((), dtype=self.dtype)
    ...     def _forward(self, input):
    ...         return input * self.weight, (input, self.weight), {}
    ...     def _backward(self, grad_output, saved):
    ...         input, weight = saved
    ...         return grad_output * weight, {"weight": self.xp.sum(grad_output * input)}
    >>> npnorm.gradcheck(Scale(), np.arange(6.0).reshape(2, 3))
    True
    """

    _parameter_names: tuple[str, ...] = ()
    _buffer_names: tuple[str, ...] = ()
    # The arrays whose in-place overwrite (by load_state_dict) between forward and backward
    # makes backward raise: those PyTorch's backward of the layer keeps, or (None) those the
    # saved context holds.
    _kept_for_backward: tuple[str, ...] | None = None
    # The buffers the forward updates as PyTorch's kernels do, without counting an in-place
    # change on a torch tensor (BatchNorm's running statistics; InstanceNorm's copy_ counts)
    _written_uncounted: tuple[str, ...] = ()
    # PyTorch's version of the same layer's state (torch's ``_version``): what state_dict
    # records in its ``_metadata`` and load_state_dict reads back (BatchNorm/InstanceNorm: 2)
    _version: int = 1
    # What the last forward left for backward, which copies and pickles leave out
    _forward_context: tuple[str, ...] = ("_saved", "_saved_versions", "_saved_io", "_saved_kept")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A layer's ``_parameter_names`` and ``_buffer_names`` must be tuples of names: a
        string (``("weight")``, the comma forgotten) read as one name per letter."""
        super().__init_subclass__(**kwargs)
        for attr in ("_parameter_names", "_buffer_names"):
            names = getattr(cls, attr)
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"{cls.__name__}.{attr} must be a tuple of names, got {names!r} (a tuple of "
                    "one name needs its comma: ('weight',))"
                )
        # every layer's forward context holds its bases' (a layer that lists its own, written
        # before the base's grew, kept the saved forward's namespace module in its pickles; a
        # subclass of SyncBatchNorm listing its own lost the synced channels, and a copy's
        # backward entered the ranks' exchange alone)
        inherited = (n for base in reversed(cls.__mro__[1:]) for n in getattr(base, "_forward_context", ()))
        cls._forward_context = tuple(dict.fromkeys((*inherited, *cls._forward_context)))
        # a name twice (a parameter that is also a buffer) became one key of state_dict
        names = [*cls._parameter_names, *cls._buffer_names]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise TypeError(
                f"{cls.__name__}: {', '.join(map(repr, twice))} named more than once among its "
                f"_parameter_names {tuple(cls._parameter_names)} and _buffer_names "
                f"{tuple(cls._buffer_names)}: each array is one parameter or one buffer"
            )

    def __init__(self, *, device: Any = None, dtype: Any = None, xp: str | ModuleType | None = None) -> None:
        self.xp: Namespace = resolve_namespace(xp)
        # (the device checked here: the layer creates its arrays there, in a dtype it has)
        self.dtype: Any = resolve_dtype(self.xp, dtype, check_device(self.xp, device))
        self.training: bool = True
        self.grads: dict[str, Array] = {}
        self._saved: Saved | None = None
        self._saved_versions: _Versions | None = None
        self._saved_kept: dict[str, Any] | None = None
        self._saved_io: _InOut | None = None

    # --- forward / backward -------------------------------------------------

    def __call__(self, input: Array) -> Array:
        """``self.forward(input)``, as a PyTorch module's call."""
        return self.forward(input)

    def forward(self, input: Array) -> Array:
        """Normalize ``input``, update the running statistics (BatchNorm and
        InstanceNorm in training mode) and save what ``backward`` needs.

        Inside ``npnorm.no_grad()`` nothing is saved, and what an earlier forward
        saved is dropped. A forward that raises changes nothing: parameters,
        buffers, counters and the previously saved context stay exactly as they were.
        The running statistics and the counter are updated in place, as PyTorch
        updates its buffers: a ``state_dict()`` taken earlier, or a module that
        shares them (``SyncBatchNorm.convert_sync_batchnorm``), sees the new values.

        Parameters
        ----------
        input : array
            Of the module's backend; shape as the layer expects.

        Returns
        -------
        array
            The output, of the shape and dtype of ``input``.
        """
        self._check_initialized()
        # a JAX tracer kept in the module breaks it: refused before _forward where the call
        # would keep one (a saved forward, a training forward's running statistics), so that
        # the error is this one (momentum=None's counter raised JAX's own in _forward)
        traced = _traced(input)
        if traced and (is_grad_enabled() or self._updates_buffers()):
            self._refuse_traced(self._updates_buffers())
        result = self._forward(input)
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[2], Mapping)):
            raise TypeError(
                f"{type(self).__name__}._forward must return (output, saved, updates): the output, "
                "a tuple of what _backward needs and a dict of buffer updates ({} for none); got "
                + _described(result)
            )
        output, saved, updates = result
        if traced and updates:  # (a layer of your own that updates its buffers in eval mode)
            self._refuse_traced(True)
        updates = self._checked_updates(updates)  # all of them, before anything is written
        for name, value in updates.items():
            self._write(name, value, uncounted=name in self._written_uncounted)
        self._saved = saved if is_grad_enabled() else None
        self._saved_versions = None if self._saved is None else self._versions(input, saved)
        self._saved_io = None if self._saved is None else _InOut.of(input, output)
        kept = None if self._saved is None else self._kept()
        # the arrays PyTorch's backward would keep, as this forward used them
        self._saved_kept = None if kept is None else {k: getattr(self, k, None) for k in kept}
        return output

    def _updates_buffers(self) -> bool:
        """Whether a forward now updates buffers (the layers with running statistics, in
        training mode): asked before the forward only where its input is a JAX tracer. A
        layer of your own says nothing here (False); its updates are seen when returned."""
        return False

    def _refuse_traced(self, updates: bool) -> None:
        """The TypeError of a module called on a JAX tracer where the call would keep traced
        values: they die with the transformation and broke every later use of the module."""
        raise TypeError(
            f"{type(self).__name__}: a module call under a JAX transformation (jax.jit, grad, vmap) "
            "would keep traced values in the module (its "
            + ("running statistics" if updates else "saved forward")
            + "), which break every later use of it; nothing was changed. Transform the functions of "
            "npnorm.functional (the *_forward and *_backward pairs) instead, or call the module "
            "inside npnorm.no_grad() in a mode whose forward updates no buffer (eval, for the layers "
            "with running statistics)"
        )

    def _check_initialized(self) -> None:
        """The TypeError of a layer whose ``__init__`` did not call ``Module.__init__``
        (forward, backward, zero_grad, to() and gradcheck fail further on without it)."""
        if "grads" not in self.__dict__:
            raise TypeError(
                f"{type(self).__name__}.__init__ did not call super().__init__(dtype=dtype, xp=xp): "
                "npnorm.Module sets the module's backend, dtype, mode and grads there"
            )

    def _checked_updates(self, updates: Mapping[str, Any]) -> dict[str, Any]:
        """``_forward``'s ``updates``, each checked and in its buffer's dtype: a TypeError
        or ValueError unless every entry names a buffer and is an array of the module's
        backend (a NumPy scalar or a Python number is made one) and, where that buffer
        exists, has its shape. An update of another dtype is cast to the buffer's, as
        PyTorch's in-place updates keep a buffer's dtype (a float64 update of a float32
        buffer made it float64, no longer updated in place), unless it is of a wider kind
        (floats for an integer buffer, integers for a bool one): that raises. Before, one unknown
        name was written after the others, and a parameter named there was overwritten."""
        cls = type(self).__name__
        checked: dict[str, Any] = {}
        for name, value in updates.items():
            if name not in self._buffer_names:
                raise TypeError(
                    f"{cls}._forward returned an update for {name!r}, which is not a buffer "
                    f"(_buffer_names: {self._buffer_names}); parameters change only by assignment"
                )
            current: Any = getattr(self, name, None)
            self._check_update_allowed(name, current)
            checked[name] = self._as_update(name, value, current)
        return checked

    def _as_update(self, name: str, value: Any, current: Any) -> Any:
        """``value``, an update of buffer ``name`` (now ``current``), checked and cast
        (see ``_checked_updates``)."""
        if (
            type(value) is type(current)
            and _is_array(current)
            and value.dtype == current.dtype
            and value.shape == current.shape
            and (
                type(current) is np.ndarray
                or getattr(value, "device", None) == getattr(current, "device", None)
            )
        ):
            return value  # (the built-in layers' updates: nothing to check, nothing to cast)
        what = f"{type(self).__name__}._forward's update of {name!r}"
        held = current if _is_array(current) else None
        if isinstance(value, (np.generic, bool, int, float)) and not isinstance(value, np.complexfloating):
            value = self.xp.asarray(value)  # (0-d NumPy arithmetic gives a NumPy scalar)
        if not _is_array(value):
            raise TypeError(
                f"{what} is not an array (got {type(value).__name__}); a buffer's new value is an "
                "array of the module's backend"
            )
        xp = self.xp if held is None else array_api_compat.array_namespace(held)
        if array_api_compat.array_namespace(value) is not xp:
            raise TypeError(
                f"{what} is of another backend than the module's (got {type(value).__name__}): compute "
                "it with the module's arrays"
            )
        if held is None:
            return value
        if tuple(value.shape) != tuple(held.shape):
            raise ValueError(f"{what} has shape {tuple(value.shape)}, the buffer {tuple(held.shape)}")
        there, here = getattr(value, "device", None), getattr(held, "device", None)
        # onto the buffer's device, as PyTorch's copy_ writes across devices (the write failed,
        # after the updates before it had been written); but JAX's buffers, which are replaced,
        # take the update where it is (moved, it was committed to a device: the next step raised)
        if there != here and not array_api_compat.is_jax_array(held):
            try:
                value = on_device_of(held, value)
            except Exception as err:  # (a torch meta tensor holds no values to move)
                raise TypeError(
                    f"{what} is on device {there}, which cannot be copied to the buffer's ({here}): {err}"
                ) from err
        if value.dtype == held.dtype or same_but_byte_order(value.dtype, held.dtype):
            return value
        kinds = ("bool", "integral", "real floating")  # each cast exactly enough into the next
        rank = [
            next((i for i, k in enumerate(kinds) if xp.isdtype(d, k)), None)
            for d in (value.dtype, held.dtype)
        ]
        if rank[0] is None or rank[1] is None or rank[0] > rank[1]:
            raise TypeError(
                f"{what} has dtype {value.dtype}, the buffer {held.dtype}: a buffer keeps its dtype, "
                "and this update would lose its values there (cast it yourself where that is meant)"
            )
        return xp.astype(value, held.dtype)

    def _check_update_allowed(self, name: str, current: Any) -> None:
        """The ``RuntimeError`` of torch where the buffer ``current`` cannot be updated in
        place now: an inference tensor outside ``torch.inference_mode()``, as torch's
        BatchNorm raises at its counter's ``add_(1)`` (nothing is changed)."""
        if torch_refuses_in_place(current):
            raise RuntimeError(
                f"Inplace update to inference tensor outside InferenceMode is not allowed: "
                f"{type(self).__name__}'s {name} was made inside torch.inference_mode(), and this "
                "training forward updates it (nothing was changed); train inside inference_mode, or "
                "give the module new buffers (module.load_state_dict of clones made outside it)"
            )

    def _check_updates_allowed(self) -> None:
        """``_check_update_allowed`` for every buffer a training forward updates, before it
        runs (SyncBatchNorm: so that every rank raises, before the ranks' exchange)."""
        for name in self._buffer_names:
            self._check_update_allowed(name, getattr(self, name, None))

    def _versions(self, input: Array, saved: Saved) -> _Versions | None:
        """The in-place change counters (torch tensors' ``_version``; other backends
        have none) of the input and of the arrays PyTorch's backward keeps, as the
        forward leaves them: ``backward`` raises when one has moved since."""
        if _version_of(input) is None:  # NumPy, CuPy, ...: no counters (the module's arrays
            return None  # are of the input's backend)
        kept = self._kept()
        named = [("input", input)] if self._keeps_input(input) else []
        if kept is None:
            named += [("saved array", a) for a in saved if _is_array(a)]
        else:
            named += [(name, getattr(self, name)) for name in kept]
        counters = [(name, a, _version_of(a)) for name, a in named]
        return _Versions(saved, [(name, a, v) for name, a, v in counters if v is not None])

    def _check_saved_forward(self) -> None:
        """``backward``'s checks of what the last forward saved: the ``RuntimeError`` where
        none was saved, or where an array it used was overwritten or modified in place
        since (SyncBatchNorm makes them collective)."""
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward() called with no saved forward: call forward first "
                "(a forward inside npnorm.no_grad() saves nothing, and to() or a copy drops what was saved)"
            )
        if isinstance(self._saved, _Overwritten):
            names = self._saved.names
            raise RuntimeError(
                f"{type(self).__name__}.backward(): the {', '.join(names)} that the last forward used "
                f"{'was' if len(names) == 1 else 'were'} overwritten in place by {self._saved.by} since "
                "(PyTorch's backward raises there too): run forward again"
            )
        versions = getattr(self, "_saved_versions", None)  # None: a subclass without our __init__
        if versions is not None and versions.saved is self._saved:
            moved = [name for name, a, version in versions.counters if _version_of(a) != version]
            if moved:  # as PyTorch's check of the tensors its backward saved
                raise RuntimeError(
                    f"{type(self).__name__}.backward(): the {', '.join(moved)} that the last forward "
                    f"used {'was' if len(moved) == 1 else 'were'} modified in place since (PyTorch's "
                    "backward raises there too): run forward again"
                )

    def backward(self, grad_output: Array) -> Array:
        """Gradient of the input for the last forward; parameter gradients are
        added into ``self.grads`` (in place, as ``.grad`` accumulates in PyTorch).

        The gradient is that of the forward as it ran, with the parameters it used:
        assigning a new ``weight`` between forward and backward does not change it.

        Parameters
        ----------
        grad_output : array
            The gradient of the loss with respect to the last forward's output
            (same shape).

        Returns
        -------
        array
            The gradient with respect to the last forward's input.

        Raises
        ------
        RuntimeError
            When no forward was saved: none ran yet, the last one ran inside
            ``npnorm.no_grad()``, or ``to()`` / a copy dropped it; or when
            ``load_state_dict`` has since overwritten an array the forward saved.
        """
        self._check_saved_forward()
        saved = self._saved
        assert saved is not None  # (checked)
        result = self._backward(grad_output, saved)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
            raise TypeError(
                f"{type(self).__name__}._backward must return (grad_input, grads): the input's "
                "gradient and a dict of the parameters' ({name: gradient or None}); got " + _described(result)
            )
        grad_input, param_grads = result
        grad_input = self._checked_grad_input(grad_output, grad_input)
        unknown = sorted(set(param_grads) - set(self._parameter_names))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}._backward returned gradients for {', '.join(map(repr, unknown))}, "
                f"which {'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                f"(_parameter_names: {self._parameter_names})"
            )
        checked = {}  # name: the gradient in the parameter's dtype, checked
        for name, g in param_grads.items():
            if g is not None:
                g = self._as_parameter_grad(name, g)
                self._check_parameter_grad(name, g)
                checked[name] = g
        totals = {}  # (held, new total): every sum first, nothing accumulated if one raises
        with np.errstate(all="ignore"):  # float16 sums overflow to inf, as torch's
            for name, g in checked.items():
                held = self.grads.get(name)
                if held is None:  # a copy: the backward's array may be a view of its input
                    totals[name] = (held, copy_array(g))
                else:
                    total = held + g
                    if isinstance(total, np.generic):  # 0-d + 0-d is a NumPy scalar: an array again
                        total = self.xp.asarray(total)
                    totals[name] = (held, total)
        for name, (held, total) in totals.items():
            if held is None or not _into(held, total):  # in place, as PyTorch accumulates .grad
                self.grads[name] = total
        return grad_input

    def _checked_grad_input(self, grad_output: Any, grad_input: Any) -> Any:
        """``grad_input`` as ``_backward`` returned it, checked against the saved forward
        (after ``_backward`` ran, which checks the layers' own arguments, collectively for
        SyncBatchNorm): a ValueError where ``grad_output`` has not the forward's output's
        shape (PyTorch's "Mismatch in shape"; a layer of your own broadcast it and added a
        wrong gradient into ``grads``), and a TypeError or ValueError where ``grad_input``
        is neither None (no gradient: an integer input's, as a PyTorch backward may return)
        nor an array of the input's shape. A ``grad_input`` of another float dtype is cast
        to the input's, as PyTorch's autograd casts one."""
        io = getattr(self, "_saved_io", None)  # (None: a pickle of an older npnorm, or no __init__)
        if io is None:
            return grad_input
        cls = type(self).__name__
        got = getattr(grad_output, "shape", None)
        if io.output_shape is not None and (got is None or tuple(got) != io.output_shape):
            raise ValueError(
                f"grad_output must have the shape of the forward's output {io.output_shape}, got "
                + (str(tuple(got)) if got is not None else f"no array ({type(grad_output).__name__})")
                + f" ({cls}.backward; nothing was added to grads)"
            )
        if io.input_shape is None or grad_input is None:
            return grad_input
        if isinstance(grad_input, np.generic) and issubclass(io.input_type, np.ndarray):
            grad_input = np.asarray(grad_input)  # (0-d NumPy arithmetic on a NumPy input)
        if not _is_array(grad_input):
            raise TypeError(
                f"{cls}._backward returned a grad_input that is not an array (got "
                f"{type(grad_input).__name__}): the input's gradient, of its shape {io.input_shape}, or None"
            )
        if tuple(grad_input.shape) != io.input_shape:
            raise ValueError(
                f"{cls}._backward returned a grad_input of shape {tuple(grad_input.shape)}, the forward's "
                f"input {io.input_shape}: the input's gradient has its shape"
            )
        if type(grad_input) is io.input_type and grad_input.dtype == io.input_dtype:
            return grad_input
        try:  # (its class may be a subclass of the input's: a memmap, a Parameter)
            xp = namespace_of(grad_input)
        except TypeError:
            return grad_input
        if xp is not io.input_xp or grad_input.dtype == io.input_dtype:
            return grad_input  # (of another library: passed on as it is, its dtypes not comparable)
        try:
            floats = xp.isdtype(grad_input.dtype, "real floating") and xp.isdtype(
                io.input_dtype, "real floating"
            )
        except TypeError:  # a dtype the namespace does not know (ml_dtypes' bfloat16): passed on
            return grad_input
        if not floats or same_but_byte_order(grad_input.dtype, io.input_dtype):
            return grad_input
        return xp.astype(grad_input, io.input_dtype)

    def _as_parameter_grad(self, name: str, g: Any) -> Any:
        """A gradient that ``_backward`` returned, in the parameter's dtype, as PyTorch's
        autograd casts a gradient to its input's dtype: a number (a NumPy scalar, what a sum
        of NumPy arrays is, or a Python number) becomes a 0-d array of the module's backend,
        and an array of the parameter's backend in another float dtype is cast (a float64
        gradient of a float32 weight was added at float64 and rebound ``grads[name]``, no
        longer in place). Anything else passes as it is."""
        param = getattr(self, name, None)
        dtype = getattr(param, "dtype", self.dtype)
        if isinstance(g, np.generic) and not isinstance(g, np.bool_):
            g = self.xp.asarray(g)
        elif isinstance(g, (int, float, complex)) and not isinstance(g, bool):
            return self.xp.asarray(g, dtype=dtype)
        if (
            _is_array(g)
            and param is not None
            and isinstance(g, type(param))
            and g.dtype != dtype
            and not same_but_byte_order(g.dtype, dtype)
            and self.xp.isdtype(g.dtype, "real floating")
        ):
            g = self.xp.astype(g, dtype)
        return g

    def _check_parameter_grad(self, name: str, g: Any) -> None:
        """A TypeError or ValueError unless ``g`` (from ``_backward``, through
        ``_as_parameter_grad``) is a floating array of parameter ``name``'s backend and
        shape: anything else went into ``grads`` (a (3, 4) gradient of a (4,) weight, one
        not summed over the batch, grew the accumulated gradient to (3, 4))."""
        param: Any = getattr(self, name, None)
        if (  # (the built-in layers' NumPy gradients: the checks below, answered cheaply)
            type(g) is np.ndarray
            and type(param) is np.ndarray
            and g.dtype.kind == "f"
            and g.shape == param.shape
        ):
            return
        what = f"{type(self).__name__}._backward's gradient for {name!r}"
        if not _is_array(g):
            raise TypeError(f"{what} is a {type(g).__name__}, not an array")
        if not _is_array(param):
            return
        xp = namespace_of(param)  # (array_namespace's answer, remembered by array type)
        if namespace_of(g) is not xp:
            raise TypeError(
                f"{what} is a {type(g).__name__}, of another backend than the parameter "
                f"({type(param).__name__}): compute it with the module's arrays"
            )
        if not xp.isdtype(g.dtype, "real floating"):
            raise TypeError(f"{what} has dtype {g.dtype}, not a floating one (the parameter: {param.dtype})")
        if tuple(g.shape) != tuple(param.shape):
            raise ValueError(
                f"{what} has shape {tuple(g.shape)}, the parameter {tuple(param.shape)}: a "
                "parameter's gradient has its shape (sum the batch's contributions)"
            )

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        raise NotImplementedError(
            f"{type(self).__name__} does not implement _forward(input) -> (output, saved, updates), "
            "which npnorm.Module.forward calls (see help(npnorm.Module))"
        )

    def _kept(self) -> tuple[str, ...] | None:
        """``_kept_for_backward``, for the forward saved now (a layer whose backward keeps
        other arrays in another mode says so here)."""
        return self._kept_for_backward

    def _keeps_input(self, input: Array) -> bool:
        """Whether PyTorch's backward of this layer keeps the caller's tensor ``input``
        (a torch tensor) itself, so that an in-place change of it before backward raises
        there; else it keeps a copy (GroupNorm's and InstanceNorm's ``input.contiguous()``
        of a strided input), which the change does not reach."""
        return True

    def _input_for_backward(self, input: Array) -> Array:
        """What the forward saves of ``input``: the input itself, or a copy where
        ``_keeps_input`` says PyTorch's backward keeps one (a tensor changed in place
        after the forward then gives the forward's gradient, as in PyTorch). Backends
        without change counters keep the input itself: nothing there could tell."""
        if _version_of(input) is None or self._keeps_input(input):
            return input
        return copy_array(input)

    def _pin_for_float64(self, input: Array) -> None:
        """Before ``gradcheck`` moves the module to float64 for ``input`` (an array of the
        module's backend): fix any
        setting that follows the computation dtype to its value for ``input``, so that
        the check differentiates the function the module computes (RMSNorm's
        ``eps=None``). Nothing by default; ``gradcheck`` restores the module after."""

    def _gradcheck_refusal(self) -> str | None:
        """Why ``gradcheck`` cannot check this module as it is set (a sentence), or None.
        None by default; asked before anything runs."""
        return None

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        raise NotImplementedError(
            f"{type(self).__name__} does not implement _backward(grad_output, saved) -> (grad_input, "
            "{name: grad or None}), which npnorm.Module.backward calls (see help(npnorm.Module))"
        )

    # --- parameters, grads, modes ------------------------------------------

    def parameters(self) -> dict[str, Array]:
        """Name-to-array dict of the parameters that exist (absent ones are left out).

        The values are the module's own arrays, not copies.
        """
        own = {n: self._declared(n) for n in self._parameter_names}
        return {n: v for n, v in own.items() if v is not None}

    def buffers(self) -> dict[str, Array]:
        """Name-to-array dict of the buffers that exist (running statistics and
        ``num_batches_tracked``); the module's own arrays, not copies."""
        own = {n: self._declared(n) for n in self._buffer_names}
        return {n: v for n, v in own.items() if v is not None}

    def _declared(self, name: str) -> Any:
        """Parameter or buffer ``name`` (None where absent), or an AttributeError that says
        the layer lists it but never set it (a bare "no attribute" came from state_dict,
        parameters() or gradcheck, while forward worked)."""
        try:
            return getattr(self, name)
        except AttributeError:
            if name in self.__dict__:  # (raised by something else)
                raise
            kind = "_parameter_names" if name in self._parameter_names else "_buffer_names"
            raise AttributeError(
                f"{type(self).__name__} lists {name!r} in {kind} but never set self.{name}: create it "
                f"in __init__ (self.{name} = None where the layer has none)"
            ) from None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the accumulated gradients, as PyTorch's ``zero_grad``.

        Parameters
        ----------
        set_to_none : bool, default True
            Forget them (``self.grads`` becomes empty, as torch's ``.grad`` becomes
            None), or, with False, write zeros into each in place (a reference to
            ``m.grads["weight"]`` sees them).
        """
        if set_to_none:
            self.grads.clear()
            return
        for name, g in self.grads.items():
            zeros = self.xp.zeros_like(g)
            if not _into(g, zeros):  # read-only or immutable (JAX): a new array instead
                self.grads[name] = zeros

    def train(self: _M, mode: bool = True) -> _M:
        """Set training mode (``mode=True``) or evaluation mode; returns the module.

        The mode matters to BatchNorm (batch or running statistics) and to
        InstanceNorm with ``track_running_stats=True``.

        Parameters
        ----------
        mode : bool, default True
            Training (True) or evaluation (False).

        Returns
        -------
        Module
            ``self``.

        Raises
        ------
        ValueError
            When ``mode`` is not a bool, as in PyTorch (``train("eval")`` would train).
        """
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be a bool, got {shown(mode)}")
        self.training = mode
        return self

    def eval(self: _M) -> _M:
        """Set evaluation mode (``train(False)``); returns the module."""
        return self.train(False)

    # --- state_dict ----------------------------------------------------------

    def state_dict(
        self,
        *,
        destination: MutableMapping[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> MutableMapping[str, Any]:
        """Parameters then buffers, under PyTorch's key names for the same layer.

        As in PyTorch, the values are the module's own arrays, not copies: an
        in-place change to them changes the module, and a training step or a
        ``load_state_dict`` (which write in place) changes them. Copy them
        (``np.array(v)``) to keep a snapshot. ``num_batches_tracked`` is a 0-d int64
        array. As PyTorch's, the result is an ``OrderedDict`` whose ``_metadata``
        records the layer's version under ``prefix`` (without its last character),
        so that ``load_state_dict``, npnorm's or PyTorch's, reads it as a current
        checkpoint, not as one saved before PyTorch 0.4.

        Parameters
        ----------
        destination : mutable mapping, keyword-only, optional
            Where to put the entries (and the version, if it has a ``_metadata``
            mapping); returned. By default a new ``OrderedDict``.
        prefix : str, keyword-only, default ""
            Put before every key, as given (``"1."`` gives ``"1.weight"``): the
            layer's place in a whole model's state_dict.
        keep_vars : bool, keyword-only, default False
            As PyTorch's: a torch tensor that requires grad is returned detached
            (the same memory, without autograd history) unless ``keep_vars``.

        Examples
        --------
        >>> import npnorm
        >>> list(npnorm.LayerNorm(4).state_dict(prefix="encoder.norm."))
        ['encoder.norm.weight', 'encoder.norm.bias']
        """
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        metadata = getattr(destination, "_metadata", None)
        if isinstance(metadata, MutableMapping):
            metadata[prefix[:-1]] = {"version": self._version}
        for name, value in {**self.parameters(), **self.buffers()}.items():
            if not keep_vars and requires_grad(value):
                value = value.detach()
            destination[prefix + name] = value
        return destination

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, *, prefix: str = ""
    ) -> IncompatibleKeys:
        """Copy values from ``state_dict`` into this module's parameters and buffers.

        Values may be NumPy arrays, lists, scalars, torch tensors (CPU or GPU, any
        floating dtype: bfloat16 and float8 ones are widened exactly), ml_dtypes
        arrays, or arrays of any backend. Each is converted to the module's backend
        and dtype and copied into the module's own array, in place as PyTorch copies
        (references taken earlier, from ``state_dict()`` or ``parameters()``, see the
        loaded values): the module never shares memory with the checkpoint. Every
        key and shape is checked, and every value converted, before anything is
        assigned: on error the module is left exactly as it was. A backward after a
        load that overwrote an array PyTorch's backward keeps (the weight; LayerNorm's
        bias; BatchNorm's running statistics) raises, as PyTorch's does.

        A BatchNorm/InstanceNorm checkpoint without ``num_batches_tracked`` (saved
        by PyTorch before 0.4.1) loads as PyTorch loads it: the counter keeps its
        current value (0 for a new module).

        Parameters
        ----------
        state_dict : mapping of str to array-like
        strict : bool, default True
            Missing and unexpected keys raise. With ``strict=False`` they are
            returned instead (missing parameters keep their values); a shape
            mismatch still raises.
        prefix : str, keyword-only, default ""
            Load this layer out of a whole model's state_dict: only the keys that
            start with ``prefix`` are considered, with the prefix removed (a
            missing trailing "." is added: "encoder.norm" matches
            "encoder.norm.weight" but not "encoder.norm2.weight"). Keys outside the
            prefix are not unexpected; keys in messages keep the prefix.

        Returns
        -------
        IncompatibleKeys
            ``(missing_keys, unexpected_keys)``; both empty when ``strict``.

        Raises
        ------
        RuntimeError
            Listing every missing or unexpected key (when ``strict``), every shape
            mismatch and every value that does not convert, as PyTorch does.
        TypeError
            If ``state_dict`` is not a mapping, or (without ``prefix``) has a key
            that is not a str.

        Examples
        --------
        >>> import numpy as np, npnorm
        >>> model_state = {"0.weight": np.ones((2, 4)), "1.weight": np.full(4, 2.0), "1.bias": np.zeros(4)}
        >>> ln = npnorm.LayerNorm(4)
        >>> ln.load_state_dict(model_state, prefix="1.")
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        >>> ln.weight
        array([2., 2., 2., 2.], dtype=float32)
        """
        if not hasattr(state_dict, "keys"):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if prefix and not prefix.endswith("."):
            prefix += "."
        if prefix:
            source = {
                k[len(prefix) :]: state_dict[k]
                for k in state_dict.keys()
                if isinstance(k, str) and k.startswith(prefix)
            }
        else:
            source = {k: state_dict[k] for k in state_dict.keys()}
            names = [k for k in source if not isinstance(k, str)]
            if names:  # (before anything is staged: strict=False would load the rest, then fail)
                raise TypeError(
                    "state_dict keys must be str (parameter and buffer names); got "
                    + ", ".join(f"{k!r} ({type(k).__name__})" for k in names)
                    + " (nothing was changed)"
                )
        own = {**self.parameters(), **self.buffers()}
        # PyTorch's state_dict carries each module's version (torch's ``_metadata``);
        # a plain dict has none, as a checkpoint of an old PyTorch
        metadata = getattr(state_dict, "_metadata", None)
        version = metadata.get(prefix[:-1], {}).get("version") if isinstance(metadata, Mapping) else None
        errors = self._legacy_keys(source, version, prefix)
        for key, default in self._missing_key_defaults(version).items():
            if key not in source:  # (a key the module lacks is then unexpected, as in PyTorch)
                source[key] = default
        missing = [k for k in own if k not in source]
        unexpected = [k for k in source if k not in own]
        if strict and unexpected:
            errors.append("unexpected key(s): " + ", ".join(repr(prefix + k) for k in unexpected))
        if strict and missing:
            note = f" (no key of the state_dict starts with {prefix!r})" if prefix and not source else ""
            note += "" if prefix else _prefix_hint(missing, source, own)
            errors.append("missing key(s): " + ", ".join(repr(prefix + k) for k in missing) + note)
        staged: dict[str, Array] = {}
        for key, current in own.items():
            if key not in source:
                continue
            try:
                value = on_device_of(current, to_namespace(source[key], self.xp, current.dtype))
                if current.ndim == 0 and tuple(value.shape) == (1,):  # a counter saved by torch 0.3
                    value = self.xp.reshape(value, ())
            except Exception as err:  # 2**70 for an int64 counter, a torch meta tensor, ...
                errors.append(f"{prefix + key!r}: cannot convert to an array ({type(err).__name__}: {err})")
                continue
            if tuple(value.shape) != tuple(current.shape):
                errors.append(
                    f"size mismatch for {prefix + key!r}: the checkpoint has shape {tuple(value.shape)}, "
                    f"this module has {tuple(current.shape)}"
                )
                continue
            staged[key] = value
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__} (nothing was changed):\n\t"
                + "\n\t".join(errors)
            )
        for key in staged:
            if getattr(own[key], "is_meta", False):  # (loaded without a word, values dropped)
                warnings.warn(
                    f"for {prefix + key!r}: copying into a tensor on torch's meta device, which holds no "
                    "values, is a no-op, as in PyTorch (create the module on a real device to load values)",
                    UserWarning,
                    stacklevel=2,
                )
        self._overwrote([key for key, value in staged.items() if self._write(key, value)], "load_state_dict")
        return IncompatibleKeys([prefix + k for k in missing], [prefix + k for k in unexpected])

    def _overwrote(self, names: list[str], by: str) -> None:
        """The arrays ``names`` were overwritten in place by ``by``: where the saved forward
        used one (one that PyTorch's backward of the layer keeps), ``backward`` raises, as
        PyTorch's version check does (an earlier overwrite's names are kept, with theirs)."""
        saved = self._saved
        own = {k: getattr(self, k) for k in names}
        used = getattr(self, "_saved_kept", None)  # None: a subclass without our __init__

        def kept_and_used(k: str, kept: tuple[str, ...]) -> bool:
            # (an array assigned since the forward is not the one it used: PyTorch's
            # backward keeps the old one, whose version did not move. Told apart where a
            # view of it would be seen: NumPy's shared memory, torch's shared change
            # counter; on other backends a view looks like another array: by name)
            if k not in kept or used is None or k not in used:
                return k in kept
            before, now = used[k], own[k]
            comparable = isinstance(now, np.ndarray) or _version_of(now) is not None
            return before is not None and (_uses(before, now) or not comparable)

        if isinstance(saved, _Overwritten):
            kept = saved.kept
            more = [k for k in names if kept is not None and kept_and_used(k, kept) and k not in saved.names]
            self._saved = _Overwritten(saved.names + more, saved.by, kept)
        elif saved is not None:
            kept = self._kept()
            hit = [
                k
                for k in names
                if (kept_and_used(k, kept) if kept is not None else any(_uses(v, own[k]) for v in saved))
            ]
            if hit:
                self._saved = _Overwritten(hit, by, kept)

    def _name_overwrite(self, before: Any, by: str) -> None:
        """Where the saved forward ``before`` was overwritten since, by ``by`` or the methods
        it called (reset_parameters calls reset_running_stats), name ``by`` in the error."""
        saved = self._saved
        if isinstance(saved, _Overwritten) and not isinstance(before, _Overwritten):
            self._saved = _Overwritten(saved.names, by, saved.kept)

    def _write(self, name: str, value: Any, *, uncounted: bool = False) -> bool:
        """Set parameter or buffer ``name`` to ``value`` (of the module's backend):
        into the module's own array, in place, where shape and dtype match (True), or
        as a new array (False: none yet, another shape or dtype, or read-only).
        ``uncounted``: a torch tensor's change counter stays (``write_uncounted``)."""
        current = getattr(self, name)
        if isinstance(value, np.generic):  # a NumPy scalar from 0-d arithmetic
            value = self.xp.asarray(value)
        if current is not None and _into(current, value, uncounted=uncounted):
            return True
        setattr(self, name, value)
        return False

    def _device(self) -> Any:
        """The device of the module's arrays (the first one's), None where it has none."""
        for name in (*self._parameter_names, *self._buffer_names):
            value = self._declared(name)
            if value is not None and array_api_compat.is_array_api_obj(value):
                return array_api_compat.device(value)
        return None  # (a value that is no array: to() says so)

    def _where(self, device: Any) -> dict[str, Any]:
        """The ``dtype`` and ``device`` keywords of the layer's new arrays: the module's
        dtype, and the backend's device that ``device`` names (``ValueError`` for one it
        does not have)."""
        return {"dtype": self.dtype, "device": check_device(self.xp, device)}

    def _refill(self, fills: Mapping[str, float], by: str) -> None:
        """Set every value of each parameter or buffer named in ``fills`` (that exists)
        to its fill value, in place where it can be (as PyTorch's ``fill_``: on its
        device, in its dtype). A backward of the forward before then raises where it
        used one of them (``by`` names the method in its message), as in PyTorch."""
        written = []
        for name, fill in fills.items():
            current = getattr(self, name)
            if current is not None and self._write(name, self.xp.full_like(current, fill)):
                written.append(name)
        self._overwrote(written, by)

    def _missing_key_defaults(self, version: int | None) -> dict[str, Array]:
        """Values ``load_state_dict`` uses for keys a checkpoint of PyTorch module
        version ``version`` (None: unknown, a plain dict) may lack; none by default."""
        return {}

    def _legacy_keys(self, source: dict[str, Any], version: int | None, prefix: str) -> list[str]:
        """Errors for keys of an old checkpoint (module version ``version``) that
        PyTorch refuses whatever ``strict`` says, removed from ``source`` (keys without
        ``prefix``, which the messages show); none by default."""
        return []

    # --- backends ------------------------------------------------------------

    def to(self: _M, xp: str | ModuleType | None = None, *, device: Any = None, dtype: Any = None) -> _M:
        """Move parameters, buffers and grads to another backend and/or device, and/or
        cast the floating ones to ``dtype``; returns the module.

        As PyTorch's, an array already of that backend, device and dtype stays as it is
        (the same object: ``int64`` counters, a cast to the dtype it has, a move to where
        it is); the others are replaced by new arrays. Where anything changed, the saved
        forward context is dropped: run forward again before backward.

        Parameters
        ----------
        xp : str or namespace module, optional
            "numpy", "cupy", "torch", "array_api_strict" or a namespace module;
            ``None`` keeps the current backend.
        device : device, keyword-only, optional
            A device of that backend (``"cuda:0"`` with torch, say: ``ValueError`` for
            one it does not have); ``None`` keeps each array on its device (a move to
            another backend puts them on its default device).
        dtype : float dtype or its name, keyword-only, optional
            ``None`` keeps the current dtype. ``num_batches_tracked`` stays int64 (int32
            on JAX without x64, or on a device without int64).

        Examples
        --------
        >>> import npnorm
        >>> ln = npnorm.LayerNorm(4).to(dtype="float64")
        >>> ln.weight.dtype
        dtype('float64')
        """
        new_xp = self.xp if xp is None else resolve_namespace(xp)
        device = check_device(new_xp, device)  # (torch.device("cpu") names NumPy's "cpu")
        staying = None if new_xp is not self.xp else self._device()  # where the arrays stay
        new_dtype = resolve_dtype(
            new_xp,
            dtype_name(self.xp, self.dtype) if dtype is None else dtype,
            staying if device is None else device,
        )
        moved: dict[str, Array] = {}
        for name in (*self._parameter_names, *self._buffer_names):
            value = self._declared(name)
            if value is not None:
                counter = name == "num_batches_tracked"
                try:
                    moved[name] = self._moved(value, new_xp, new_dtype, device, counter=counter)
                except OverflowError as err:  # (integers beyond the new backend's dtype: JAX's int32)
                    raise OverflowError(
                        f"{type(self).__name__}.to(): {name}: {err} (nothing was changed)"
                    ) from err
        grads = {n: self._moved(g, new_xp, new_dtype, device) for n, g in self.grads.items()}
        changed = (new_xp, new_dtype) != (self.xp, self.dtype) or any(
            value is not getattr(self, name) for name, value in moved.items()
        )
        for name, value in moved.items():
            setattr(self, name, value)
        self.grads.clear()
        self.grads.update(grads)
        self.xp, self.dtype = new_xp, new_dtype
        if changed:
            self._saved = None
        return self

    def _moved(
        self, value: Array, new_xp: Namespace, new_dtype: Any, device: Any, *, counter: bool = False
    ) -> Array:
        """``value`` on ``new_xp`` (and ``device``, unless None), a floating dtype cast to
        ``new_dtype``, the ``counter`` to the backend's ``counter_dtype``, any other dtype
        (an int32 or bool buffer of a layer of your own) kept, as torch's ``to()`` keeps
        them: the array itself where it already is (a ``state_dict()`` taken before still
        follows the module), else a new one."""
        xp = namespace_of(value)
        name = dtype_name(xp, value.dtype)
        here = array_api_compat.device(value)
        if name in FLOAT_NAMES:
            target = new_dtype
        elif counter or name == "int64" or (name == "int32" and counter_dtype(xp, here) == xp.int32):
            # the widest int: int64, or int32 where the backend (or device) has no int64 (JAX
            # without x64)
            target = counter_dtype(new_xp, device if device is not None or xp is not new_xp else here)
        else:
            target = getattr(new_xp, name)
        if device is not None and xp is new_xp and not device_has(xp, dtype_name(xp, target), here):
            # a dtype the array's device lacks (the int64 counter of a move off a device
            # without int64): moved first, then cast where the dtype is
            value = array_api_compat.to_device(value, device)
        if xp is not new_xp or value.dtype != target:
            value = to_namespace(value, new_xp, target)
        if device is not None:  # the backend's to_device keeps an array already there
            moved = array_api_compat.to_device(value, device)
            # a moved array is a plain one, as one cast to another dtype (a torch tensor
            # that required grad came back with the move's autograd history)
            value = moved.detach() if moved is not value and requires_grad(moved) else moved
        return value

    def _check_backend(self, input: Array) -> Namespace:
        """Namespace of ``input``, which must match the module's arrays, and be dense
        (``check_dense``): npnorm's layers call this first, so that a nested torch tensor
        is refused before their checks of its shape (which raised torch's errors)."""
        xp = namespace_of(input, what="input")
        if xp is not self.xp:  # the module's arrays are of self.xp (the functional checks them too)
            held = [*self.parameters().values(), *self.buffers().values()]
            xp = namespace_of(input, *held, what="input and the module's parameters/buffers")
        check_dense(input)
        return xp

    # --- copies and pickling ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Pickle state: the backend and dtype by name, no saved forward, no gradients
        (as PyTorch's parameters pickle without ``.grad``), and every other array for
        ``__setstate__`` to restore into the same backend: NumPy arrays and torch
        tensors as themselves (pickled as NumPy and torch pickle them: an array that
        several modules in one pickle share stays shared, as in PyTorch), the arrays of
        other backends as NumPy copies."""
        state: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            if key == "xp":
                state[key] = backend_name(value)
            elif key == "dtype":
                state[key] = dtype_name(self.xp, value)
            elif key in self._forward_context:
                state[key] = None
            elif key == "grads":
                state[key] = _NoGrads.of(value)
            else:
                state[key] = _map_arrays(value, _HostArray.of, lambda v: v)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        xp = resolve_namespace(state["xp"])
        restored = dict(state)
        restored["xp"] = xp
        restored["dtype"] = resolve_dtype(xp, state["dtype"])
        for key, value in state.items():
            if key == "grads":  # a new empty dict (one per dict pickled: shared ones stay
                # shared), also where an older pickle held the gradients
                restored[key] = value if isinstance(value, dict) and not value else {}
            elif key not in ("xp", "dtype"):
                try:
                    restored[key] = _map_host(value, lambda h: h.restored(xp))
                except OverflowError as err:  # (integers beyond this backend's dtype: JAX's int32)
                    raise OverflowError(f"unpickling {type(self).__name__}: {key}: {err}") from err
        self.__dict__.update(restored)

    def __copy__(self: _M) -> _M:
        """A copy whose arrays share no memory with this module's (each copied once, the
        gradients too: PyTorch's shallow copy shares its parameters and so their
        ``.grad``); its other attributes are this module's own objects (a SyncBatchNorm's
        communicator, say); what the last forward saved is not copied."""
        return self._copy({}, lambda v: v, grads=True)

    def __deepcopy__(self: _M, memo: dict[int, Any]) -> _M:
        """A copy that shares no memory with this module (every array copied on its
        backend, once: an array that modules copied together share stays shared among
        the copies, as in PyTorch); what the last forward saved is not copied, nor the
        gradients (``grads`` is empty, as PyTorch's deep copy leaves ``.grad`` None)."""
        return self._copy(memo, lambda v: copy.deepcopy(v, memo), grads=False)

    def _copy(self: _M, memo: dict[int, Any], other: Callable[[Any], Any], *, grads: bool) -> _M:
        """A new module of this class: the backend and dtype as they are, no saved
        forward, the gradients copied only if ``grads``, every other array copied once
        per ``memo``, and ``other`` applied to the rest."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key in ("xp", "dtype"):
                new.__dict__[key] = value
            elif key in self._forward_context:
                new.__dict__[key] = None
            elif key == "grads" and not grads:  # one new empty dict per dict copied, so
                # that modules sharing theirs (convert_sync_batchnorm) share the new one
                new.__dict__[key] = _copy_once(value, memo, lambda _: {})
            else:
                new.__dict__[key] = _map_arrays(value, lambda a: _copy_once(a, memo), other)
        return new

    def extra_repr(self) -> str:
        """The constructor arguments shown by ``repr``."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def _described(value: Any) -> str:
    """What a method of a user's layer returned, in a few words, for an error message."""
    if isinstance(value, tuple):
        items = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a tuple of {len(value)} item(s) ({items})"
    return type(value).__name__


def _traced(a: Any) -> bool:
    """Whether ``a`` is a JAX tracer: a value inside jax.jit, grad or vmap, which dies with
    the transformation (JAX is not imported for this)."""
    jax = sys.modules.get("jax")
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    return tracer is not None and isinstance(a, tracer)


class _InOut(NamedTuple):
    """The shapes of a saved forward's input and output and the input's dtype (None where
    one is not an array: a layer of your own may take or return something else), which
    ``backward`` checks ``grad_output`` and the returned ``grad_input`` against."""

    input_shape: tuple[int, ...] | None
    input_dtype: Any
    input_type: type
    input_xp: Namespace | None
    output_shape: tuple[int, ...] | None

    @staticmethod
    def of(input: Any, output: Any) -> _InOut:
        array = _is_array(input)
        return _InOut(
            tuple(input.shape) if array else None,
            input.dtype if array else None,
            type(input),
            namespace_of(input) if array else None,
            tuple(output.shape) if _is_array(output) else None,
        )


def _version_of(a: Any) -> int | None:
    """``a``'s in-place change counter: a torch tensor's ``_version``; None for arrays of
    other backends, and for torch's inference tensors, which keep none."""
    if type(a) is np.ndarray:  # (the common call, without the AttributeError)
        return None
    try:
        return int(a._version)
    except (AttributeError, RuntimeError):
        return None


class _Versions(NamedTuple):
    """What a forward saved, and the in-place change counters of the arrays PyTorch's
    backward would check, as ``(name, array, version)``."""

    saved: Saved
    counters: list[tuple[str, Any, int]]


class _Overwritten(NamedTuple):
    """In place of the saved forward: the names of the saved arrays that ``by``
    (``load_state_dict``, ``reset_parameters``, ...) overwrote since (``backward`` raises)."""

    names: list[str]
    by: str
    kept: tuple[str, ...] | None  # the _kept() of the forward it stands in for


def _uses(saved: Any, array: Any) -> bool:
    """Whether a saved item is ``array`` or, for NumPy, a view of its memory (a layer of
    your own that saved ``self.w.reshape(1, -1)``: a load into ``w`` changes it too)."""
    if saved is array:
        return True
    if not (isinstance(saved, np.ndarray) and isinstance(array, np.ndarray)):
        return False
    return bool(np.shares_memory(saved, array))  # (exact: w = buf[::2] does not share buf[1::2])


def _into(current: Any, value: Any, *, uncounted: bool = False) -> bool:
    """Write ``value`` into ``current`` in place where it fits (same backend, ``current``
    of ``value``'s class or a subclass, same shape and dtype, ``current`` writable);
    whether it did. A torch leaf that requires grad is
    written under ``torch.no_grad()``, as PyTorch's ``load_state_dict`` copies into a
    Parameter; ``uncounted``: through ``write_uncounted``, as torch's kernels write the
    running statistics."""
    if (  # (the common call: NumPy arrays alike, ``current`` writable)
        type(current) is np.ndarray
        and type(value) is np.ndarray
        and current.shape == value.shape
        and current.dtype == value.dtype
        and writable(current)
    ):
        current[...] = value
        return True
    if not _is_array(value) or not isinstance(current, type(value)):  # (a memmap takes an ndarray)
        return False
    if tuple(value.shape) != tuple(current.shape):
        return False
    if value.dtype != current.dtype and not same_but_byte_order(value.dtype, current.dtype):
        return False  # (a ">f4" buffer, a memmap of a file say, takes float32 values)
    if not writable(current):  # read-only, or immutable (JAX): a new array instead
        return False
    if type(current) is np.ndarray:  # (the common call: no torch tensor to ask, counted or not)
        current[...] = value
        return True
    if uncounted:
        write_uncounted(current, value)
        return True
    if torch_refuses_in_place(current):  # a new tensor instead: nothing half-written
        return False
    if requires_grad(current):
        import torch

        with torch.no_grad():
            current[...] = value
        return True
    current[...] = value
    return True


def channels_last(a: Any) -> bool:
    """Whether the torch tensor ``a`` is a 4-D or 5-D tensor laid out channels-last and
    dense (``torch.channels_last`` / ``channels_last_3d``), as torch keeps it without a
    copy where a layer asks for the input's suggested memory format."""
    import torch

    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(a.ndim)
    return layout is not None and bool(a.is_contiguous(memory_format=layout))


def _copy_once(a: Any, memo: dict[int, Any], make: Callable[[Any], Any] = copy_array) -> Any:
    """``make(a)``, ``a``'s copy, once in one ``copy.copy`` or ``copy.deepcopy`` call (one
    per array, or object, and ``memo``: what the copied modules share stays shared)."""
    done = memo.get(id(a))
    if done is None:
        done = memo[id(a)] = make(a)
        memo.setdefault(id(memo), []).append(a)  # keep a alive while memo refers to its id
    return done


class _NoGrads:
    """A module's ``grads`` in a pickle: unpickled as a new empty dict, one per ``grads``
    dict pickled (two modules that share theirs get the same placeholder, which pickle
    stores once, so the unpickled modules share their new dict too)."""

    _live: ClassVar[weakref.WeakValueDictionary[int, _NoGrads]] = weakref.WeakValueDictionary()

    def __init__(self, grads: dict[str, Any]) -> None:
        self._grads = grads  # (kept alive while the pickle is written: its id stays its own)

    @classmethod
    def of(cls, grads: dict[str, Any]) -> _NoGrads:
        """The placeholder of ``grads``: the same object while one is alive (in a pickle
        being written)."""
        placeholder = cls._live.get(id(grads))
        if placeholder is None or placeholder._grads is not grads:
            placeholder = cls._live[id(grads)] = cls(grads)
        return placeholder

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return dict, ()


class _HostArray(NamedTuple):
    """A module array in a pickle: the array itself where pickle keeps its backend (NumPy,
    torch), else a NumPy copy; restored into the module's backend."""

    array: Any
    device: Any = None  # a copy's device where it is not its backend's default one

    @staticmethod
    def of(a: Array) -> _HostArray:
        native = isinstance(a, np.ndarray) or array_api_compat.is_torch_array(a)
        if native:
            return _HostArray(a)
        device = array_api_compat.device(a)
        default = _default_device(array_api_compat.array_namespace(a))
        return _HostArray(to_host(a), None if default is None or device == default else device)

    def restored(self, xp: Namespace) -> Array:
        """The array in ``xp``: itself where it is of ``xp`` already (so that what one
        pickle shared stays shared), else a copy, on the device it was pickled from."""
        a = self.array
        if array_api_compat.is_array_api_obj(a) and array_api_compat.array_namespace(a) is xp:
            return a
        out = to_namespace(a, xp)
        return out if self.device is None else array_api_compat.to_device(out, self.device)


def _is_array(value: Any) -> bool:
    """An array of some backend (NumPy scalars and Python numbers are not)."""
    kind = type(value)
    if kind in _ARRAY_TYPES:  # (the common case, without array_api_compat's checks)
        return True
    if array_api_compat.is_array_api_obj(value) and not isinstance(
        value, (bool, int, float, complex, np.generic)
    ):
        # remembered where the class decides it (a library's array type, or a class with
        # __array_namespace__), not one instance (a proxy that forwards attributes)
        if hasattr(kind, "__array_namespace__") or not hasattr(value, "__array_namespace__"):
            _ARRAY_TYPES.add(kind)
        return True
    return False


_ARRAY_TYPES: set[type] = {np.ndarray}  # the types _is_array has found to be arrays


def _map_arrays(value: Any, on_array: Callable[[Any], Any], other: Callable[[Any], Any]) -> Any:
    """``value`` with ``on_array`` applied to each array in it (through dicts, lists
    and tuples) and ``other`` to everything else."""
    if _is_array(value):
        return on_array(value)
    if type(value) is dict:
        return {k: _map_arrays(v, on_array, other) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_arrays(v, on_array, other) for v in value)
    return other(value)


def _map_host(value: Any, restore: Callable[[_HostArray], Any]) -> Any:
    if isinstance(value, _HostArray):
        return restore(value)
    if type(value) is dict:
        return {k: _map_host(v, restore) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_map_host(v, restore) for v in value)
    return value
