"""A module's life, step by step, against torch.nn's twin: random sequences of what a
training loop does (forwards, backwards, a forward left without its backward, train/eval
switches, forwards under ``no_grad``, ``zero_grad`` both ways, resets, checkpoint loads
(torch's own ``state_dict`` among them, which npnorm must copy, not share), a new
``momentum``, deep copies, pickles, casts between float32 and float64, moves between
backends, conversions with ``from_torch``/``to_torch``), drawn by hypothesis's state
machines, so a failing sequence shrinks to the few steps that make it fail.

The other tests take one operation at a time; here the operations meet: the gradients
accumulated over several backwards, a backward after a mode switch or a load (torch's
saved forward decides, and where torch raises npnorm must too), ``momentum=None``'s
cumulative average across a reset, the gradients a deep copy or a pickle drops. After
every step both modules must hold the same mode, parameters, buffers and gradients, of
the same dtypes (to 1e-10 in float64; to float32's tolerance once the twins have lived
in float32). The npnorm module lives on NumPy, torch tensors or array_api_strict (and
moves between them), in float64 or float32, and its steps run on whichever kernel family
was last chosen.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import pickle
import threading
from typing import Any

import numpy as np
import pytest
from helpers import close, draw_state, grid_arrays, same_as_torch, same_dtype
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import npnorm
from npnorm._backend import namespace_of, resolve_namespace, to_host
from npnorm._threadcomm import run_ranks
from npnorm.functional import _dispatch

torch = pytest.importorskip("torch", reason="parity tests need torch==2.13.0 (the 'parity' extra)")

# name: (make(namespace, **factory_kwargs), input shape)
LAYERS = {
    "BatchNorm1d": (lambda nn, **kw: nn.BatchNorm1d(3, **kw), (4, 3, 2)),
    "BatchNorm1d, momentum=None": (lambda nn, **kw: nn.BatchNorm1d(3, momentum=None, **kw), (5, 3)),
    "BatchNorm2d, no running stats": (
        lambda nn, **kw: nn.BatchNorm2d(3, track_running_stats=False, **kw),
        (2, 3, 2, 2),
    ),
    "BatchNorm1d, no affine": (lambda nn, **kw: nn.BatchNorm1d(3, affine=False, **kw), (4, 3)),
    "InstanceNorm1d, tracked": (
        lambda nn, **kw: nn.InstanceNorm1d(3, affine=True, track_running_stats=True, **kw),
        (2, 3, 4),
    ),
    "LayerNorm": (lambda nn, **kw: nn.LayerNorm(4, **kw), (3, 4)),
    "GroupNorm": (lambda nn, **kw: nn.GroupNorm(2, 4, **kw), (2, 4, 3)),
    "RMSNorm": (lambda nn, **kw: nn.RMSNorm(4, **kw), (3, 4)),
}
BACKENDS = ["numpy", "torch"] + ["array_api_strict"] * (
    importlib.util.find_spec("array_api_strict") is not None
)


# In float32 each drawn input value at position k (in memory order) gets SPREAD * k *
# (-1)**k added: those offsets are distinct multiples of SPREAD and the grid's values
# (quarters in [-6, 6]) differ by at most 12 = SPREAD - 0.25, so the values of a group (a
# row, a channel) all differ by 0.25 or more, of both signs and in no fixed order. The small
# batches drawn here often held a constant channel, where both libraries' results are
# rounding amplified by 1/sqrt(eps) (torch's y 2.3e-5 where npnorm's is the exact 0; in
# eval, a running_var of 0 left by one, the same), a case the tests written for it take
# (test_offset_accuracy.py's constant rows). The values (|x| < 700) stay exact in float32.
# (A float64 life that left a running_var of 0 and was cast to float32 can still meet it:
# both libraries then round (x - mean)*316 in float32, within the tolerance.)
SPREAD = 12.25


def draw_input(data, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An input of ``shape`` drawn on the grid, spread as above in float32."""
    x = data.draw(grid_arrays(shape), label="x")
    if dtype == "float32":
        k = np.arange(x.size)
        x = x + (SPREAD * k * (-1.0) ** k).reshape(x.shape)
    return x.astype(dtype)


class _Twins(RuleBasedStateMachine):
    """npnorm modules (``mods``: one, or one per rank) and their torch twin ``ref``, taken
    through the same steps: the rules and the invariant of both machines below."""

    mods: list
    ref: Any
    dtype = "float64"  # the twins' dtype now (LifeOfAModule's ``cast`` changes it)
    # the tolerance: float32's once the twins have lived in float32, for the rest of the
    # life (deliberately: their float32 rounding stays in the state after a cast back,
    # unless every value is loaded again, which is not tracked)
    tol = "float64"
    pending = None  # torch's (input, output) of a forward not yet taken back (LifeOfAModule's)

    @rule(data=st.data())
    def load(self, data):
        """A checkpoint of drawn values, loaded into each (a copy in place in each)."""
        state = draw_state(data, self.mods[0])  # (the values drawn, not what npnorm made of them)
        for m in self.mods[1:]:
            m.load_state_dict(state)
        self.ref.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})

    @rule(mode=st.booleans())
    def train(self, mode):
        for m in self.mods:
            m.train(mode)
        self.ref.train(mode)

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none):
        for m in self.mods:
            m.zero_grad(set_to_none)
        self.ref.zero_grad(set_to_none)

    @rule(which=st.sampled_from(["reset_parameters", "reset_running_stats"]))
    def reset(self, which):
        if hasattr(self.ref, which):
            for m in self.mods:
                getattr(m, which)()
            getattr(self.ref, which)()

    @rule(how=st.sampled_from(["deepcopy", "pickle"]))
    def copy(self, how):
        """Carry on with deep copies or pickled copies of all (a forward pending in torch's
        graph would write the originals' grads, so it is dropped; a pickled SyncBatchNorm
        comes back without its communicator, set again at each step)."""
        copy_of = copy.deepcopy if how == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))
        self.mods = [copy_of(m) for m in self.mods]
        self.ref = copy_of(self.ref)
        self.pending = None

    @precondition(lambda self: hasattr(self.ref, "momentum"))
    @rule(momentum=st.sampled_from([None, 0.0, 0.25, 1.0]))
    def set_momentum(self, momentum):
        for m in self.mods:
            m.momentum = momentum
        self.ref.momentum = momentum

    def _same(self, ours, theirs, what: str) -> None:
        """An array of npnorm's (any backend) is torch's: its dtype, and its values to the
        tolerance."""
        same_as_torch(ours, theirs, self.tol, what)

    @invariant()
    def same_state(self):
        """Each module holds torch's mode, parameters and buffers, of torch's dtypes; their
        grads, of torch's dtypes too, add up to torch's (each rank holds its own share)."""
        theirs = self.ref.state_dict()
        for r, m in enumerate(self.mods):
            assert m.training == self.ref.training
            ours = m.state_dict()
            assert list(ours) == list(theirs)
            for k in ours:
                self._same(ours[k], theirs[k], f"module {r}: {k}")
        their_grads = {k: p.grad for k, p in self.ref.named_parameters() if p.grad is not None}
        for r, m in enumerate(self.mods):
            assert m.grads.keys() == their_grads.keys()
            for k, g in m.grads.items():
                same_dtype(g, their_grads[k], f"module {r}: {k}'s grad")
        for k, g in their_grads.items():
            total = sum(to_host(m.grads[k]).astype(np.float64) for m in self.mods)
            close(total, g, self.tol, f"{k}'s grad")


class LifeOfAModule(_Twins):
    """One npnorm module and its torch twin, taken through the same steps."""

    @property
    def ours(self):
        return self.mods[0]

    @ours.setter
    def ours(self, module):
        self.mods = [module]

    @initialize(
        name=st.sampled_from(sorted(LAYERS)),
        backend=st.sampled_from(BACKENDS),
        dtype=st.sampled_from(["float64", "float64", "float32"]),  # (most ci lives at 1e-10)
        data=st.data(),
    )
    def build(self, name, backend, dtype, data):
        make, self.shape = LAYERS[name]
        self.xp, self.backend = resolve_namespace(backend), backend
        self.dtype = self.tol = dtype
        self.ours = make(npnorm, dtype=dtype, xp=backend)
        self.ref = make(torch.nn, dtype=getattr(torch, dtype))
        self.kernels_before = _dispatch._selected  # (restored at the end, unset if it was)
        self.load_torchs_state_dict(data)  # (so that every sequence checks that it is copied)

    def teardown(self):
        if hasattr(self, "kernels_before"):
            _dispatch._selected = self.kernels_before

    def _ours(self, a: np.ndarray):
        return self.xp.asarray(a, dtype=getattr(self.xp, self.dtype))

    def _theirs(self, a: np.ndarray, **kwargs):
        return torch.tensor(a, dtype=getattr(torch, self.dtype), **kwargs)

    # --- steps ---------------------------------------------------------------

    @rule(data=st.data())
    def load_torchs_state_dict(self, data):
        """torch's own ``state_dict()`` (its live tensors) loaded into npnorm: copied,
        so that torch's later in-place updates never reach npnorm's arrays."""
        self.load(data)
        self.ours.load_state_dict(self.ref.state_dict())
        self._shares_no_memory()

    @rule(how=st.sampled_from(["from_torch", "to_torch"]))
    def convert(self, how):
        """Carry on with a conversion of one twin into the other's library (the state
        copied, the gradients not: both are cleared, and a pending forward dropped)."""
        if how == "from_torch":
            self.ours = npnorm.from_torch(self.ref, xp=self.backend)
        else:
            self.ref = npnorm.to_torch(self.ours)
        self.ours.zero_grad()
        self.ref.zero_grad()
        self.pending = None
        self._shares_no_memory()

    def _shares_no_memory(self):
        """torch's tensors changed in place, then put back: npnorm's arrays must not see
        it (state equality alone would not: two modules sharing memory stay equal)."""
        theirs = self.ref.state_dict()
        before = {k: to_host(v).copy() for k, v in self.ours.state_dict().items()}
        kept = {k: t.clone() for k, t in theirs.items()}
        with torch.no_grad():
            for t in theirs.values():
                t.fill_(7)
            for k, v in self.ours.state_dict().items():
                np.testing.assert_array_equal(to_host(v), before[k], err_msg=f"{k}: shares torch's memory")
            for k, t in theirs.items():
                t.copy_(kept[k])

    @rule(data=st.data())
    def forward(self, data):
        x = draw_input(data, self.shape, self.dtype)
        xt = self._theirs(x, requires_grad=True)
        yt = self.ref(xt)
        y = self.ours(self._ours(x))
        self._same(y, yt, "y")
        self.pending = (xt, yt)

    @rule(data=st.data())
    def forward_without_grad(self, data):
        """A forward under ``no_grad`` (inference in a training loop, a validation
        batch): the same output, the same running statistics updated in training mode,
        and nothing kept for a backward (npnorm drops an earlier forward's; torch's
        earlier graph is left alone here)."""
        x = draw_input(data, self.shape, self.dtype)
        with torch.no_grad():
            yt = self.ref(self._theirs(x))
        with npnorm.no_grad():
            y = self.ours(self._ours(x))
        self._same(y, yt, "y")
        self.pending = None
        with pytest.raises(RuntimeError, match="no saved forward"):
            self.ours.backward(self._ours(np.zeros(self.shape)))

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data())
    def backward(self, data):
        """The last forward's backward: torch's graph or npnorm's saved forward, whatever
        happened since (where torch refuses, because an array it saved was overwritten in
        place, npnorm must refuse too and change nothing)."""
        xt, yt = self.pending
        self.pending = None
        dy = data.draw(grid_arrays(self.shape), label="dy")
        try:
            yt.backward(self._theirs(dy))
            torch_error = None
        except RuntimeError as err:
            torch_error = err
        if torch_error is not None:
            grads = {k: to_host(v) for k, v in self.ours.grads.items()}
            with pytest.raises(RuntimeError, match="overwritten in place"):
                self.ours.backward(self._ours(dy))
            assert grads.keys() == self.ours.grads.keys()
            for k, g in grads.items():
                np.testing.assert_array_equal(to_host(self.ours.grads[k]), g, err_msg=k)
            return
        dx = self.ours.backward(self._ours(dy))
        self._same(dx, xt.grad, "dx")

    @rule(data=st.data())
    def step(self, data):
        """A forward and its backward at once, a training loop's step (drawn as two
        rules, a backward comes after a few of the other steps only now and then)."""
        self.forward(data)
        self.backward(data)

    @rule(dtype=st.sampled_from(["float32", "float64"]))
    def cast(self, dtype):
        """Parameters, buffers and grads cast to ``dtype``, and the life goes on in it
        (torch's ``.float()``/``.double()``: a float64 life rounded to float32 and back
        is two of these; a pending forward is dropped, as above)."""
        self.ours.to(dtype=dtype)
        self.ref.to(getattr(torch, dtype))
        self.dtype = dtype
        if dtype == "float32":  # (see tol: its rounding stays after a cast back)
            self.tol = dtype
        self.pending = None

    @invariant()
    def on_its_backend(self):
        """Every parameter, buffer and grad is an array of the backend the life is on."""
        assert self.ours.xp is self.xp
        arrays = {**self.ours.state_dict(), **{f"{k}'s grad": g for k, g in self.ours.grads.items()}}
        for k, v in arrays.items():
            assert namespace_of(v) is self.xp, f"{k}: {type(v).__name__} on a {self.backend} module"

    @rule(backend=st.sampled_from(BACKENDS))
    def move(self, backend):
        """Parameters, buffers and grads moved to another backend (``to(xp)``), and the
        life goes on there (npnorm drops the saved forward when anything moved, as the
        README says: a pending forward is dropped)."""
        self.ours.to(backend)
        self.xp, self.backend = resolve_namespace(backend), backend
        self.pending = None

    @rule(family=st.sampled_from(npnorm.kernels_available()))
    def kernels(self, family):
        """The kernels NumPy input runs from here on (a backward may run other kernels than
        its forward did)."""
        npnorm.set_kernels(family)


LifeOfAModule.TestCase.settings = settings(LifeOfAModule.TestCase.settings, stateful_step_count=20)
test_a_modules_life_is_torchs = LifeOfAModule.TestCase


# --- SyncBatchNorm over ranks against BatchNorm on the whole batch ----------------------

SYNC_FLAGS = [
    dict(momentum=0.1, affine=True, track_running_stats=True),
    dict(momentum=None, affine=True, track_running_stats=True),
    dict(momentum=0.1, affine=False, track_running_stats=True),
    dict(momentum=0.1, affine=True, track_running_stats=False),
]


class LifeOfASyncBatchNorm(_Twins):
    """A SyncBatchNorm on each of a few ranks (threads), their batches of drawn sizes (some
    empty), against torch's BatchNorm1d on the batches put together: a data-parallel
    training loop's steps, as above (copies and pickles too). Every rank must hold torch's
    running statistics, mode and parameters, each rank's outputs and input gradients must
    be torch's rows of them, and the ranks' gradients must add up to torch's (each holds
    its own share). In float64 or float32."""

    C, L = 3, 2  # channels, and values per channel in a sample

    @initialize(
        ranks=st.integers(1, 3),
        flags=st.sampled_from(SYNC_FLAGS),
        dtype=st.sampled_from(["float64", "float64", "float32"]),
        data=st.data(),
    )
    def build(self, ranks, flags, dtype, data):
        self.ranks, self.dtype, self.tol = ranks, dtype, dtype
        self.mods = [npnorm.SyncBatchNorm(self.C, **flags, dtype=dtype) for _ in range(ranks)]
        self.ref = torch.nn.BatchNorm1d(self.C, **flags, dtype=getattr(torch, dtype))
        self.load(data)

    def _on_ranks(self, fn):
        """``fn(rank, module)`` on every rank at once, each module on this step's group."""

        def on_rank(comm):
            r = comm.Get_rank()
            self.mods[r].comm = comm
            return fn(r, self.mods[r])

        results = run_ranks(self.ranks, on_rank)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # the rank's own error first, not another's broken barrier
            errors.sort(key=lambda err: isinstance(err, threading.BrokenBarrierError))
            raise errors[0]
        return results

    @rule(data=st.data(), backward=st.booleans())
    def step(self, data, backward):
        """A forward on every rank, and its backward (or a forward under ``no_grad``, as a
        skipped backward must be run: a synced forward's backward is collective)."""
        sizes = data.draw(
            st.lists(st.integers(0, 3), min_size=self.ranks, max_size=self.ranks), label="sizes"
        )
        if sum(sizes) == 0:
            sizes[-1] = 1
        n = sum(sizes)
        x = draw_input(data, (n, self.C, self.L), self.dtype)
        dy = data.draw(grid_arrays((n, self.C, self.L)), label="dy").astype(self.dtype)
        ends = np.cumsum([0, *sizes])

        def on_rank(r, m):
            if not backward:  # (npnorm's documented way to skip a backward: see the README)
                with npnorm.no_grad():
                    return m(x[ends[r] : ends[r + 1]]), None
            return m(x[ends[r] : ends[r + 1]]), m.backward(dy[ends[r] : ends[r + 1]])

        got = self._on_ranks(on_rank)
        # the whole batch, but where eval mode has no running statistics each rank's own
        # batch (as torch's SyncBatchNorm does: it syncs in training only)
        local = not self.ref.training and not self.ref.track_running_stats
        parts = [(lo, hi) for lo, hi in itertools.pairwise(ends) if hi > lo] if local else [(0, n)]
        for lo, hi in parts:
            xt = torch.tensor(x[lo:hi], requires_grad=backward)
            with torch.set_grad_enabled(backward):
                yt = self.ref(xt)
            self._same(np.concatenate([y for y, _ in got])[lo:hi], yt, "y")
            if backward:
                yt.backward(torch.tensor(dy[lo:hi]))
                self._same(np.concatenate([dx for _, dx in got])[lo:hi], xt.grad, "dx")


LifeOfASyncBatchNorm.TestCase.settings = settings(
    LifeOfASyncBatchNorm.TestCase.settings, stateful_step_count=20
)
test_a_sync_batch_norms_life_over_ranks_is_batch_norms = LifeOfASyncBatchNorm.TestCase
