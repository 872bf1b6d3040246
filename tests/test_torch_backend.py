"""torch tensors as an array backend (xp="torch"), as the README documents it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import randomize

import npnorm
import npnorm.functional as F

LAYERS = [
    (lambda **kw: npnorm.LayerNorm((2, 3), **kw), (4, 2, 3)),
    (lambda **kw: npnorm.RMSNorm(3, **kw), (4, 3)),
    (lambda **kw: npnorm.BatchNorm2d(2, **kw), (3, 2, 2, 2)),
    (lambda **kw: npnorm.GroupNorm(2, 4, **kw), (2, 4, 3)),
    (lambda **kw: npnorm.InstanceNorm1d(2, affine=True, track_running_stats=True, **kw), (2, 2, 5)),
]


@pytest.mark.parametrize("make,shape", LAYERS)
def test_torch_backend_matches_numpy(torch, rng, make, shape):
    on_torch, on_numpy = make(xp="torch", dtype="float64"), make(dtype="float64")
    randomize(on_numpy, rng)
    on_torch.load_state_dict(on_numpy.state_dict())
    for training in (True, False):
        on_torch.train(training)
        on_numpy.train(training)
        x, dy = rng.normal(size=shape), rng.normal(size=shape)
        y = on_torch(torch.from_numpy(x))
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float64
        np.testing.assert_allclose(y.numpy(), on_numpy(x), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            on_torch.backward(torch.from_numpy(dy)).numpy(), on_numpy.backward(dy), rtol=1e-12, atol=1e-12
        )
    for k, v in on_numpy.state_dict().items():
        np.testing.assert_allclose(on_torch.state_dict()[k].numpy(), v, rtol=1e-12, err_msg=k)
    for k, v in on_numpy.grads.items():
        np.testing.assert_allclose(on_torch.grads[k].numpy(), v, rtol=1e-12, atol=1e-12, err_msg=k)
    assert npnorm.gradcheck(on_torch.train(), torch.from_numpy(rng.normal(size=shape)))


def test_torch_tensor_into_a_numpy_module_suggests_the_torch_backend(torch):
    with pytest.raises(TypeError, match=r"module\.to\('torch'\).*xp='torch'"):
        npnorm.LayerNorm(4)(torch.randn(2, 4))
    m = npnorm.LayerNorm(4).to("torch")  # what the message says works
    assert isinstance(m(torch.randn(2, 4)), torch.Tensor)


# Inputs that require grad (the output of an upstream torch layer, a torch module's
# parameters): npnorm runs its own backward, so nothing it computes, stores or accumulates
# may carry autograd history, and the caller's tensors must not gain any either.


def _no_history(t):
    return not t.requires_grad and t.grad_fn is None


@pytest.mark.parametrize("make,shape", LAYERS)
def test_inputs_that_require_grad_leave_no_autograd_history(torch, make, shape):
    m = make(xp="torch", dtype="float64")
    for training in (True, True, False):
        m.train(training)
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        with pytest.warns(UserWarning, match="outside torch's autograd") as said:
            y = m(x)
        assert said[0].filename == __file__  # (the user's line, not npnorm's)
        with warnings.catch_warnings():  # (the forward warned; the backward says nothing more)
            warnings.simplefilter("error")
            dx = m.backward(torch.ones(shape, dtype=torch.float64, requires_grad=True))
        assert _no_history(y) and _no_history(dx)
        assert x.grad is None  # npnorm's backward returns dx; autograd never ran
    for name, value in (*m.state_dict().items(), *m.grads.items()):
        if value.is_floating_point():
            assert _no_history(value), name


def test_functional_batch_norm_on_a_torch_modules_buffers(torch):
    # the torch module's own buffers stay plain buffers: its next forward works
    ref = torch.nn.BatchNorm1d(3).double()
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match="outside torch's autograd"):
        y = npnorm.functional.batch_norm(
            x, ref.running_mean, ref.running_var, ref.weight, ref.bias, training=True
        )
    assert _no_history(y) and _no_history(ref.running_mean) and _no_history(ref.running_var)
    assert ref.weight.grad is None
    out = torch.empty_like(x, requires_grad=True)
    with pytest.raises(RuntimeError, match="out requires grad"):  # as torch's out= refuses it
        npnorm.functional.layer_norm_forward(x, 3, ref.weight, ref.bias, out=out)
    with torch.no_grad():
        y, _, _ = npnorm.functional.layer_norm_forward(x, 3, ref.weight, ref.bias, out=out)
    assert y is out
    ref(x).sum().backward()  # raised "not differentiable with respect to running_mean"


def test_a_silent_cut_in_a_torch_models_autograd_is_warned_of(torch):
    """npnorm.functional in a torch model's residual branch: its result has no grad_fn, so
    loss.backward() dropped the branch's gradient without a word (the Linear's weight got
    the residual's gradient alone). It still computes outside autograd, and now warns;
    under no_grad, or on detached tensors, it does not."""
    lin = torch.nn.Linear(4, 8).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    h = lin(x)
    with pytest.warns(UserWarning, match=r"layer_norm_forward ran on torch tensors that require grad"):
        y = npnorm.functional.layer_norm(h, (8,))
    assert _no_history(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        npnorm.functional.layer_norm(h.detach(), (8,))
        with torch.no_grad():
            npnorm.functional.layer_norm(h, (8,))
        npnorm.functional.layer_norm(torch.randn(3, 8), (8,), torch.nn.Parameter(torch.ones(8)).detach())


def test_loading_torch_parameters_keeps_the_module_apart_from_autograd(torch):
    ref = torch.nn.LayerNorm(4).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    m = npnorm.LayerNorm(4, xp="torch", dtype="float64")
    m.load_state_dict(dict(ref.named_parameters()))
    assert _no_history(m.weight) and m.weight.is_leaf
    torch.testing.assert_close(m.weight, ref.weight.detach())
    x = torch.randn(2, 4, dtype=torch.float64)
    assert _no_history(m(x))
    m.backward(torch.ones(2, 4, dtype=torch.float64))
    assert ref.weight.grad is None
    torch.optim.SGD([m.weight], lr=0.1)  # a leaf, as a fresh module's: raised "can't optimize a non-leaf"


KEPT = {  # what torch's backward of each layer keeps, beside its input
    "LayerNorm": ("weight", "bias"),
    "RMSNorm": ("weight",),
    "BatchNorm2d": ("weight",),
    "GroupNorm": ("weight",),
    "InstanceNorm1d": (),  # torch's instance_norm keeps copies of weight and bias
}


@pytest.mark.parametrize(
    "make,shape,what",
    [
        (*layer, what)
        for i, layer in enumerate(LAYERS)
        for what in ("input", "weight", "bias")[: 2 if i == 1 else 3]
    ],
)
def test_an_in_place_change_of_what_backward_keeps_raises_as_in_torch(torch, make, shape, what):
    # e.g. a pre-norm residual h = ln(x); x += f(h); ln.backward(dy): torch's version
    # counter makes its backward raise; npnorm's read the changed x and returned a wrong dx
    m = make(xp="torch", dtype="float64")
    x = torch.randn(shape, dtype=torch.float64)
    target = x if what == "input" else getattr(m, what)
    m(x)
    target.add_(1.0)
    if what == "input" or what in KEPT[type(m).__name__]:
        with pytest.raises(RuntimeError, match=f"{what}.*modified in place"):
            m.backward(torch.ones(shape, dtype=torch.float64))
        m(x)  # a new forward saves the new values
    m.backward(torch.ones(shape, dtype=torch.float64))


def test_the_same_in_place_changes_in_torch(torch):
    # the rule the test above follows
    ln = torch.nn.LayerNorm(3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h = x * 1.0
    y = ln(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    gn = torch.nn.GroupNorm(2, 4, dtype=torch.float64)
    y = gn(torch.randn(2, 4, 3, dtype=torch.float64))
    with torch.no_grad():
        gn.bias.add_(1.0)  # not kept by GroupNorm's backward
    y.sum().backward()


@pytest.mark.parametrize("make,shape", LAYERS)
def test_inference_tensors_run_as_in_torch(torch, make, shape):
    # they keep no version counter (reading it raises RuntimeError): nothing to check
    m = make(xp="torch", dtype="float32")
    with torch.inference_mode():
        x = torch.randn(shape)
        y = m(x)  # inside inference_mode too
    y = m(x)
    assert tuple(m.backward(torch.ones_like(y)).shape) == shape


@pytest.mark.parametrize("layout", ["strided", "channels_last", "contiguous"])
@pytest.mark.parametrize("name", ["GroupNorm", "InstanceNorm2d", "LayerNorm"])
def test_an_input_changed_in_place_after_forward_as_in_torch(torch, name, layout):
    """torch's GroupNorm keeps input.contiguous(memory_format=suggested), InstanceNorm
    input.contiguous(), LayerNorm the input: where that is a copy, an in-place change of
    the caller's tensor after the forward leaves the gradient of the forward as it ran;
    where it is the tensor itself, backward raises. npnorm kept the strided input itself
    unchecked: a silently wrong gradient (dx off by 13)."""
    make = {
        "GroupNorm": lambda: npnorm.GroupNorm(2, 4, xp="torch", dtype="float64"),
        "InstanceNorm2d": lambda: npnorm.InstanceNorm2d(4, affine=True, xp="torch", dtype="float64"),
        "LayerNorm": lambda: npnorm.LayerNorm(3, xp="torch", dtype="float64"),
    }[name]
    gen = torch.Generator().manual_seed(0)
    base = torch.randn((2, 4, 3, 6), dtype=torch.float64, generator=gen)
    dy = torch.randn((2, 4, 3, 3), dtype=torch.float64, generator=gen)

    def laid_out(t):
        if layout == "strided":
            return t[..., ::2]
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        return t[..., :3].contiguous(memory_format=fmt)

    ours = make()
    ref = npnorm.to_torch(ours)
    leaf = base.clone().requires_grad_()
    x_ref = laid_out(leaf * 1)
    y_ref = ref(x_ref)
    x = laid_out(base.clone())
    ours(x)
    with torch.no_grad():
        x_ref.mul_(2).add_(1)
    x.mul_(2).add_(1)
    try:
        y_ref.backward(dy)
    except RuntimeError as err:
        assert "modified by an inplace operation" in str(err)
        with pytest.raises(RuntimeError, match=r"input.*modified in place"):
            ours.backward(dy)
        return
    assert layout == "strided" or (name == "InstanceNorm2d" and layout == "channels_last")
    dx_ref = leaf.grad[..., ::2] if layout == "strided" else leaf.grad[..., :3]
    torch.testing.assert_close(ours.backward(dy), dx_ref, rtol=1e-10, atol=1e-10)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(ours.grads[k], p.grad, rtol=1e-10, atol=1e-10)


def test_a_module_made_in_inference_mode_refuses_training_outside_it_as_torch(torch, rng):
    """torch refuses in-place writes to inference tensors outside inference_mode: its
    BatchNorm made there raises at the training forward's counter update. npnorm trained,
    writing running_mean in place (through .data) and binding a new counter, so that a
    state_dict taken before saw one update and not the other. Now the training forward
    raises torch's error with nothing changed; eval runs, training inside inference_mode
    runs, and load_state_dict gives the module new arrays (then it trains anywhere)."""
    with torch.inference_mode():
        bn = npnorm.BatchNorm1d(3, xp="torch")
        inn = npnorm.InstanceNorm1d(3, track_running_stats=True, xp="torch")
        ref = torch.nn.BatchNorm1d(3)
        ln = npnorm.LayerNorm(3, xp="torch")
    x = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        ref(x)
    for m, data in ((bn, x), (inn, x.reshape(2, 3, 2))):
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            m(data)
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k
        m.eval()
        m(data)  # no update: runs, as torch's eval
        m.train()
        with torch.inference_mode():
            m(data)
        assert not torch.equal(m.running_mean, before["running_mean"])
    y = ln(x)  # no buffers: trains, and its backward runs
    ln.backward(torch.ones_like(y))
    bn.load_state_dict({k: v.clone() for k, v in torch.nn.BatchNorm1d(3).state_dict().items()})
    ref = torch.nn.BatchNorm1d(3)
    torch.testing.assert_close(bn(x), ref(x).detach())
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    bn.backward(torch.ones_like(x))
    ln.load_state_dict({"weight": torch.full((3,), 2.0), "bias": torch.ones(3)})
    assert ln.weight.tolist() == [2.0] * 3 and ln.bias.tolist() == [1.0] * 3


def test_a_buffer_that_requires_grad_is_refused_as_in_torch(torch, rng):
    # torch's batch_norm refuses running statistics that require grad; npnorm's forward
    # wrote running_mean and the counter, then raised on running_var (later: replaced it)
    m = npnorm.BatchNorm1d(3, xp="torch")
    ref = torch.nn.BatchNorm1d(3)
    m.running_var = m.running_var.clone().requires_grad_()
    ref.running_var.requires_grad_()
    x = torch.tensor(rng.normal(size=(8, 3)), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="not differentiable"):
        ref(x)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match="running_var requires grad"):
        m(x)
    for k, v in m.state_dict().items():
        assert torch.equal(v.detach(), before[k]), k
    with torch.no_grad():  # where torch takes them
        torch.testing.assert_close(m(x), ref(x))
    torch.testing.assert_close(m.running_var.detach(), ref.running_var.detach())


def test_training_leaves_the_buffers_change_counters_as_torch(torch, rng):
    """torch's kernels write the running statistics without an in-place change count;
    npnorm's write counted one, so that F.batch_norm on a torch layer's buffers failed
    that layer's pending backward, and a module sharing buffers with another
    (convert_sync_batchnorm) failed after the other's forward."""
    x = torch.tensor(rng.normal(size=(8, 3)), dtype=torch.float32)
    ref = torch.nn.BatchNorm1d(3).eval()
    xt = x.clone().requires_grad_()
    yt = ref(xt)
    F.batch_norm(x, ref.running_mean, ref.running_var, training=True)
    yt.sum().backward()  # raised "modified by an inplace operation"
    bn = npnorm.BatchNorm1d(3, xp="torch")
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn)
    versions = (bn.running_mean._version, bn.running_var._version)
    bn.eval()
    bn(x)
    sync(x)  # trains the shared buffers
    assert (bn.running_mean._version, bn.running_var._version) == versions
    bn.backward(torch.ones_like(x))


def test_load_state_dict_writes_into_a_parameter_that_requires_grad(torch):
    # as torch's load_state_dict (a copy under no_grad): an optimizer holding the tensor
    # sees the loaded values; npnorm bound a new tensor
    m = npnorm.LayerNorm(3, xp="torch")
    w = m.weight.requires_grad_()
    m.load_state_dict({"weight": torch.full((3,), 2.0), "bias": torch.ones(3)})
    assert m.weight is w and w.tolist() == [2.0] * 3 and w.requires_grad


def test_functional_running_buffers_made_in_inference_mode(torch, rng):
    # torch's batch_norm updates them outside inference_mode; npnorm's write raised
    # "Inplace update to inference tensor outside InferenceMode"
    with torch.inference_mode():
        rm, rv = torch.zeros(3), torch.ones(3)
    x = torch.tensor(rng.normal(size=(8, 3)), dtype=torch.float32)
    want_m, want_v = torch.zeros(3), torch.ones(3)
    torch.nn.functional.batch_norm(x, want_m, want_v, training=True)
    F.batch_norm(x, rm, rv, training=True)
    torch.testing.assert_close(rm, want_m)
    torch.testing.assert_close(rv, want_v)


def test_numpy_arrays_of_any_layout_and_byte_order_load_into_torch(torch, tmp_path):
    # torch refuses NumPy arrays with negative strides or big-endian data: such a
    # checkpoint (a reversed view, an .npz written big-endian) failed to load
    w = np.arange(4.0, dtype=np.float32)
    np.savez(tmp_path / "be.npz", weight=w.astype(">f4"), bias=np.zeros(4, ">f4"))
    for state in (dict(np.load(tmp_path / "be.npz")), {"weight": w[::-1], "bias": np.zeros(4, np.float32)}):
        on_numpy = npnorm.LayerNorm(4)
        on_numpy.load_state_dict(state)
        m = npnorm.LayerNorm(4, xp="torch")
        m.load_state_dict(state)
        assert m.weight.tolist() == on_numpy.weight.tolist() and m.weight.dtype == torch.float32
    on_numpy = npnorm.LayerNorm(4)
    on_numpy.weight = w[::-1]  # held as given, a reversed view
    assert on_numpy.to("torch").weight.tolist() == [3.0, 2.0, 1.0, 0.0]


def test_instance_norm_counts_its_running_statistics_writes_as_torch(torch, rng):
    # torch's instance_norm copies into the buffers (copy_: counted, refused for inference
    # tensors outside inference mode), unlike batch_norm's kernel
    x = torch.tensor(rng.normal(size=(2, 3, 5)), dtype=torch.float32)
    ours, theirs = torch.zeros(3), torch.zeros(3)
    F.instance_norm(x, ours, torch.ones(3), use_input_stats=True)
    torch.nn.functional.instance_norm(x, theirs, torch.ones(3), use_input_stats=True)
    assert ours._version == theirs._version == 1
    m = npnorm.InstanceNorm1d(3, track_running_stats=True, xp="torch")
    ref = torch.nn.InstanceNorm1d(3, track_running_stats=True)
    versions = (m.running_mean._version, ref.running_mean._version)
    m(x)
    ref(x)
    assert (m.running_mean._version - versions[0], ref.running_mean._version - versions[1]) == (1, 1)
    with torch.inference_mode():
        rm, rv, trm, trv = torch.zeros(3), torch.ones(3), torch.zeros(3), torch.ones(3)
    with pytest.raises(RuntimeError, match="nference"):
        torch.nn.functional.instance_norm(x, trm, trv, use_input_stats=True)
    with pytest.raises(RuntimeError, match="nference"):
        F.instance_norm(x, rm, rv, use_input_stats=True)
    assert rm.tolist() == [0.0] * 3 and rv.tolist() == [1.0] * 3  # (torch's wrote trm first)


def test_a_big_endian_counter_keeps_its_shape(torch):
    from npnorm._backend import resolve_namespace, to_namespace

    for xp in ("torch", "array_api_strict", "numpy"):
        assert tuple(to_namespace(np.array(5, ">i8"), resolve_namespace(xp)).shape) == ()


def test_a_tensor_with_its_negative_bit_set_keeps_its_sign(torch):
    """``z.conj().imag`` is a view of ``z``'s memory with torch's negative bit set; DLPack
    hands over the memory without the bit, and a NumPy module loaded [1, 2, 3, 4] from
    [-1, -2, -3, -4] (torch's own load, and ``.numpy()``'s refusal, keep the sign)."""
    z = torch.complex(torch.zeros(4, dtype=torch.float64), torch.arange(1.0, 5.0, dtype=torch.float64))
    w = z.conj().imag
    assert w.is_neg()
    want = -np.arange(1.0, 5.0)
    m = npnorm.LayerNorm(4, dtype="float64")
    m.load_state_dict({"weight": w, "bias": torch.zeros(4)})
    np.testing.assert_array_equal(m.weight, want)
    on_torch = npnorm.LayerNorm(4, xp="torch", dtype="float64")
    on_torch.weight = w
    np.testing.assert_array_equal(on_torch.to("numpy").weight, want)
    ref = torch.nn.LayerNorm(4, dtype=torch.float64)
    ref.load_state_dict({"weight": w, "bias": torch.zeros(4)})
    np.testing.assert_array_equal(npnorm.from_torch(ref).weight, want)


def test_a_backward_given_another_backends_gradient_says_to_convert_it(torch):
    """The error advised module.to('numpy'), which drops the saved forward: the next
    backward then raised 'no saved forward'. It now names each array's backend and says
    to pass grad_output in the forward's; doing so works, the state untouched meanwhile."""
    m = npnorm.LayerNorm(5, xp="torch")
    x = torch.randn(4, 3, 5)
    m(x)
    with pytest.raises(TypeError, match=r"grad_output: numpy\.ndarray; input, .*: torch\.Tensor") as info:
        m.backward(np.ones((4, 3, 5), np.float32))
    assert "pass grad_output as an array of the forward's backend (torch)" in str(info.value)
    assert "module.to(" not in str(info.value)
    assert not m.grads
    dx = m.backward(torch.ones(4, 3, 5))
    assert isinstance(dx, torch.Tensor) and set(m.grads) == {"weight", "bias"}


def test_a_backward_whose_odd_array_is_not_grad_output_does_not_blame_it(torch):
    x = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match=r"weight: torch\.Tensor") as info:
        npnorm.functional.batch_norm_backward(
            x, x, np.zeros(3, np.float32), np.ones(3, np.float32), torch.ones(3), training=True
        )
    assert "pass grad_output" not in str(info.value)


def _not_strided(torch, kind, dense):
    """``dense`` as a tensor of another layout (CSR: as a matrix), or a nested tensor of its
    first sample and the rest."""
    with warnings.catch_warnings():  # (CSR and strided nested tensors warn that they are beta)
        warnings.simplefilter("ignore", UserWarning)
        if kind == "coo":
            return dense.to_sparse()
        if kind == "csr":
            return dense.reshape(dense.shape[0], -1).to_sparse_csr()
        if kind == "mkldnn":
            return dense.float().to_mkldnn()
        halves = list(dense.split([1, dense.shape[0] - 1]))
        return torch.nested.nested_tensor(halves, layout=torch.jagged if kind == "jagged" else torch.strided)


SAID = {
    "coo": r"a torch tensor of layout torch\.sparse_coo is not supported: npnorm takes dense \(strided\)",
    "csr": r"a torch tensor of layout torch\.sparse_csr is not supported",
    "mkldnn": r"a torch tensor of layout torch\._mkldnn is not supported",
    "jagged": r"nested torch tensors are not supported: .*x\.values\(\)",
    "nested": r"nested torch tensors are not supported",
}
# (a CSR tensor is a matrix: RMSNorm's (4, 3) input alone)
ODD_INPUTS = [
    (make, shape, kind) for make, shape in LAYERS for kind in SAID if kind != "csr" or len(shape) == 2
]


@pytest.mark.parametrize("make,shape,kind", ODD_INPUTS)
def test_a_sparse_mkldnn_or_nested_input_is_refused_clearly(torch, make, shape, kind):
    """Such tensors failed deep inside npnorm (a reshape of a sparse tensor, the sizes of
    a nested one, or a layer's own "expected 4D input" for a jagged (2, j3, ...) shape);
    the module's state is left as it was."""
    m = make(xp="torch", dtype="float32")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    odd = _not_strided(torch, kind, torch.randn(*shape))
    with pytest.raises(TypeError, match="^input: " + SAID[kind]):
        m(odd)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    m(torch.randn(*shape))  # a dense input runs, then the backward is given the odd one
    with pytest.raises(TypeError, match="^grad_output: " + SAID[kind]):
        m.backward(odd)
    assert not m.grads
    with pytest.raises(TypeError, match="^gradcheck: x: " + SAID[kind]):
        npnorm.gradcheck(m, odd)


def test_a_layer_of_ones_own_takes_a_sparse_tensor_and_a_numpy_module_names_the_backend(torch):
    """The refusal is npnorm's layers' (their _check_backend), not Module's: a layer of
    one's own may take sparse tensors; and a sparse tensor given to a NumPy module is told
    of the backend first, the real problem (its to_dense() would fail there too)."""

    class Double(npnorm.Module):
        def _forward(self, input):
            return input * 2, (), {}

        def _backward(self, grad_output, saved):
            return grad_output * 2, {}

    x = torch.randn(3, 4).to_sparse()
    m = Double(xp="torch")
    assert torch.equal(m(x).to_dense(), 2 * x.to_dense())
    assert torch.equal(m.backward(x).to_dense(), 2 * x.to_dense())
    with pytest.raises(TypeError, match="different array backends"):
        npnorm.LayerNorm(4)(x)


def test_a_broadcast_out_is_told_of_its_backends_empty(torch):
    """An expanded tensor as out= is refused, and the hint names a call that exists for
    it (the message said out.copy(), which torch tensors lack)."""
    x = torch.randn(4, 3)
    hint = r"one memory location.*\(torch\.empty\(out\.shape, dtype=out\.dtype\)\)$"
    with pytest.raises(ValueError, match=hint):
        F.layer_norm_forward(x, 3, out=torch.empty(1, 3).expand(4, 3))


def test_a_tensor_where_the_shape_goes_is_named_not_printed(torch):
    """A weight tensor passed where normalized_shape goes is named by its shape and dtype
    (its repr printed every value), with where the shape goes."""
    named = r"got an array of shape \(768,\) and dtype torch\.float32 \(Tensor\)"
    with pytest.raises(TypeError, match=named + r" \(an array where the shape goes: normalized_shape"):
        F.layer_norm_forward(torch.ones(4, 768), torch.ones(768))


@pytest.mark.parametrize("kind", ["coo", "mkldnn"])
def test_a_sparse_out_or_running_buffer_is_refused_clearly(torch, kind):
    x = torch.randn(4, 3)
    odd = _not_strided(torch, kind, torch.zeros(4, 3))
    with pytest.raises(TypeError, match="^out: " + SAID[kind] + r".*\(pass a dense tensor to write into\)"):
        F.layer_norm_forward(x, 3, out=odd)  # (it said: a zero stride)
    with pytest.raises(TypeError, match="^running_mean: " + SAID[kind]):
        F.batch_norm(x, _not_strided(torch, kind, torch.zeros(3)), torch.ones(3), training=True)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_a_checkpoints_sparse_tensor_changes_nothing(torch, backend):
    """On a torch module, the tensors before the sparse one were written, then its copy_
    raised: a load that raises must change nothing, as every other refusal does."""
    m = npnorm.BatchNorm1d(3, xp=backend)
    m(torch.randn(5, 3) if backend == "torch" else np.ones((5, 3), np.float32) * [[1], [2], [3], [4], [5]])
    before = {k: torch.as_tensor(v).clone() for k, v in m.state_dict().items()}
    sd = {k: torch.full_like(v, 7) for k, v in before.items()}
    sd["running_var"] = sd["running_var"].to_sparse()
    with pytest.raises(RuntimeError, match=r"(?s)nothing was changed.*'running_var'.*" + SAID["coo"]):
        m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        assert torch.equal(torch.as_tensor(v), before[k]), k
    sd["running_var"] = sd["running_var"].to_dense()
    m.load_state_dict(sd)  # a dense one loads
    assert (torch.as_tensor(m.state_dict()["running_var"]) == 7).all()
