"""The tape: a forward pass recorded node by node, every value kept.

A node is ``name = fn(*inputs)``: a short step name, the formula it computes (for
printing), the names of the values it reads and the function that computes it from
them. Because every node knows its inputs, the tape can re-run exactly the part of
the graph after a step whose value was changed (what the finite-difference check
does), and can hold chosen edges fixed (what the check of the three named terms
does: each term is the gradient along some paths of the graph only).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

Edge = tuple[str, str]  # (input name, node name)


@dataclass(frozen=True)
class Node:
    """One node of the graph: ``name = fn(*inputs)``, which computes ``formula``.

    A :class:`Tape` makes one per step (``tape.node(...)``) and keeps them in
    ``tape.nodes``, in forward order. ``Tape.rerun`` calls ``fn`` again on changed
    input values: that is how the checks re-run the graph after a perturbed step.

    Parameters
    ----------
    name : str
        The step's name, e.g. ``"xhat"``: its key in ``tape.steps`` and in the
        gradients ``staged_backward`` returns.
    formula : str
        What the step computes, in plain text, for printing: ``"xhat = xc · rstd"``.
    inputs : tuple of str
        The names of the steps or leaves ``fn`` reads, in the order it takes them.
    fn : callable
        ``fn(*values) -> ndarray``: the step's value from its inputs' values.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward
    >>> tape = staged_forward("layer_norm", np.arange(8.0).reshape(2, 4), 4)
    >>> node = tape.nodes["xhat"]
    >>> node
    Node(name='xhat', formula='xhat = xc · rstd', inputs=('xc', 'rstd'))
    >>> np.array_equal(node.fn(*(tape[i] for i in node.inputs)), tape["xhat"])
    True
    """

    name: str
    formula: str
    inputs: tuple[str, ...]
    fn: Callable[..., np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class Standardized:
    """Where a tape's standardize block sits, for the closed form and the term checks.

    ``src`` is the value normalized (``input``, or GroupNorm's grouped view ``xg``),
    ``out`` the normalized value (``xhat``, or ``xhatg``), ``axes`` the reduced axes,
    ``n`` the number of values each statistic is taken over. ``center`` is False for
    RMSNorm (no mean), ``batch_stats`` False when the statistics are the running
    buffers, ``correction`` 1 for the n-1 variance.
    """

    src: str
    out: str
    axes: tuple[int, ...]
    n: int
    center: bool
    batch_stats: bool
    correction: int
    eps: float


class Tape(Mapping[str, np.ndarray]):
    """A staged forward pass: the value of every node, in order, and how to recompute it.

    ``tape[name]`` reads a step or a leaf. ``tape.steps`` maps each step name to its
    value, in forward order; ``tape.nodes`` maps it to its :class:`Node` (formula,
    inputs); ``tape.leaves`` holds the arrays the graph starts from (``input``,
    ``weight``, ``bias`` when given, and constants such as the running buffers);
    ``tape.output`` is the last step's value; ``tape.updates`` holds running buffers
    the forward updated (not part of the graph: nothing flows back through them).

    ``staged_forward`` and ``staged_normalize`` build the tapes of the library's
    layers; ``Tape(...)`` and :meth:`node` build one by hand, for any graph of NumPy
    functions. The values on a tape are never changed: :meth:`rerun` returns new ones.

    Parameters
    ----------
    layer : str
        A name for the graph (``"layer_norm"``, ...); ``tape.description`` starts as it.
    constants : collection of str, default ()
        Leaves that get no gradient (BatchNorm's ``running_mean``, ``running_var``);
        the other leaves are ``tape.differentiable``.
    **leaves : ndarray or None
        The arrays the graph starts from, by name (``input=x, weight=w``). A None is
        left out; the arrays are kept as given, not copied.

    Examples
    --------
    The graph of ``y = (x - 1)²`` by hand, two nodes:

    >>> import numpy as np
    >>> from npnorm.learn import Tape, numeric_gradient
    >>> x = np.array([0.0, 1.0, 3.0])
    >>> tape = Tape("square", input=x)
    >>> tape.node("xc", "xc = x - 1", lambda a: a - 1.0, "input")
    array([-1.,  0.,  2.])
    >>> tape.node("y", "y = xc²", np.square, "xc")
    array([1., 0., 4.])
    >>> list(tape), tape.output_name
    (['input', 'xc', 'y'], 'y')
    >>> tape.rerun({"xc": np.ones(3)})["y"]  # only the nodes after xc
    array([1., 1., 1.])
    >>> dy = np.array([1.0, 2.0, 3.0])
    >>> np.allclose(numeric_gradient(tape, "input", dy), 2 * (x - 1) * dy)
    True
    """

    def __init__(self, layer: str, *, constants: Collection[str] = (), **leaves: np.ndarray | None) -> None:
        self.layer = layer
        self.leaves: dict[str, np.ndarray] = {k: v for k, v in leaves.items() if v is not None}
        self.constants = frozenset(constants)  # leaves nothing is differentiated for
        self.nodes: dict[str, Node] = {}
        self.steps: dict[str, np.ndarray] = {}
        self.updates: dict[str, np.ndarray] = {}
        self.update_formulas: dict[str, str] = {}
        self.standardized: Standardized | None = None
        self.backward: Callable[[Tape, np.ndarray], dict[str, np.ndarray]] | None = None
        self.description = layer

    def node(self, name: str, formula: str, fn: Callable[..., np.ndarray], *inputs: str) -> np.ndarray:
        """Add the node ``name = fn(*inputs)``, run it, and return its value."""
        if name in self.nodes or name in self.leaves:
            raise ValueError(f"step {name!r} is already on the tape")
        value = fn(*(self[i] for i in inputs))
        self.nodes[name] = Node(name, formula, inputs, fn)
        self.steps[name] = value
        return value

    # Mapping over steps and leaves, so that backward code reads ``t["xc"]``
    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.steps:
            return self.steps[name]
        if name in self.leaves:
            return self.leaves[name]
        raise KeyError(f"no step {name!r} on this tape; it has {', '.join(self)}")

    def __iter__(self) -> Iterator[str]:
        yield from self.leaves
        yield from self.steps

    def __len__(self) -> int:
        return len(self.leaves) + len(self.steps)

    @property
    def output_name(self) -> str:
        """The name of the last step, the output (``"y"`` for every layer)."""
        return next(reversed(self.nodes))

    @property
    def output(self) -> np.ndarray:
        """The last step's value: the layer's output."""
        return self.steps[self.output_name]

    @property
    def differentiable(self) -> list[str]:
        """The leaves that get a gradient: ``input``, ``weight``, ``bias`` (those present)."""
        return [k for k in self.leaves if k not in self.constants]

    def rerun(
        self, changed: Mapping[str, np.ndarray], frozen: Collection[Edge] = ()
    ) -> dict[str, np.ndarray]:
        """Replace the values in ``changed`` and recompute only the nodes after them.

        A node is recomputed when it reads a changed or recomputed value through an
        edge ``(input, node)`` that is not in ``frozen``; through a frozen edge it reads
        the recorded value. Returns the changed and recomputed values (the tape itself
        is not modified).
        """
        new = dict(changed)
        for node in self.nodes.values():
            if node.name in changed:
                continue
            live = [i in new and (i, node.name) not in frozen for i in node.inputs]
            if any(live):
                args = (new[i] if hit else self[i] for i, hit in zip(node.inputs, live, strict=True))
                new[node.name] = node.fn(*args)
        return new

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.steps.items())
        return f"Tape({self.description}: {shapes})"


def count(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
    """Number of values each statistic over ``axes`` is taken over."""
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))
