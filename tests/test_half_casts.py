"""float16 data and the compiled kernels: the casts to float32 and back.

The "numba" family computes float16 in float32 (numba has no float16 type on the CPU),
converting each staged block with its own compiled casts (``half_columns_to_float``,
``float_to_half_columns``) instead of NumPy's, which took most of a float16 call's time. They
must give NumPy's values bit for bit (a NaN's payload aside), so that a float16 call is
its float32 call rounded once.
"""

from __future__ import annotations

import platform

import array_api_compat.numpy as xp
import numpy as np
import pytest
from helpers import op_calls
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_numba_kernels import LAYOUTS, config, laid_out

from npnorm.functional._dispatch import family_kernel

pytest.importorskip("numba", reason="the compiled kernels need numba (the 'fast' extra)")

from npnorm.kernels import _numba_loops as loops
from npnorm.kernels import _staging

# both ways of each cast: in integer arithmetic (any CPU), and by the CPU's conversion
# instruction (where it has one: ``loops.CASTS_BY_INSTRUCTION``), which the staging uses there
WAYS = [
    pytest.param(
        way,
        marks=pytest.mark.skipif(
            way == "instruction" and not loops.CASTS_BY_INSTRUCTION,
            reason="no float16 conversion instruction here",
        ),
    )
    for way in ("bits", "instruction")
]


def to_half(f: np.ndarray, way: str = "bits") -> np.ndarray:
    """``float_to_half_columns`` (the ``way`` given) of a float32 array (as one row), as
    float16."""
    out = np.empty(f.shape, np.uint16)
    row = np.ascontiguousarray(f).reshape(1, -1)
    getattr(loops, f"_float_to_half_columns_{way}")(row, 0, out.reshape(1, -1))
    return out.view(np.float16)


def to_float(bits: np.ndarray, way: str = "bits") -> np.ndarray:
    """``half_columns_to_float`` (the ``way`` given) of float16 bits (as one row)."""
    out = np.empty(bits.shape, np.float32)
    getattr(loops, f"_half_columns_to_float_{way}")(bits.reshape(1, -1), 0, bits.size, out.reshape(1, -1))
    return out


def test_the_staging_casts_by_instruction_where_the_cpu_has_one():
    way = "instruction" if loops.CASTS_BY_INSTRUCTION else "bits"
    assert loops.half_columns_to_float is getattr(loops, f"_half_columns_to_float_{way}")
    assert loops.float_to_half_columns is getattr(loops, f"_float_to_half_columns_{way}")


def same_halves(ours: np.ndarray, f: np.ndarray) -> None:
    """``ours`` is NumPy's float16 of ``f``, bit for bit; a NaN is a NaN of its sign."""
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(np.float16)
    nan = np.isnan(f)
    assert np.isnan(ours[nan]).all()
    assert (np.signbit(ours[nan]) == np.signbit(f[nan])).all()
    bad = (ours.view(np.uint16) != want.view(np.uint16)) & ~nan
    assert not bad.any(), (f[bad][:5], ours[bad][:5], want[bad][:5])


@pytest.mark.parametrize("way", WAYS)
def test_every_half_to_float_is_numpys(way):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every float16 (NaNs too)
    ours = to_float(bits, way)
    want = bits.view(np.float16).astype(np.float32)
    assert (ours.view(np.uint32) == want.view(np.uint32)).all()  # NaN payloads included


def _boundaries() -> np.ndarray:
    """float32 values where rounding to float16 decides: every half, the midpoints between
    neighbours (ties: to even), a float32 ulp either side of them, the range's edges
    (65504, 65520: the tie to infinity), float32 subnormals, zeros, infinities, NaNs."""
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # +0 to 65504
    nxt = np.append(halves[1:], np.float32(65536.0))
    mid = ((halves.astype(np.float64) + nxt) / 2).astype(np.float32)  # exact in float32
    near = [np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))]
    edges = np.array(
        [65504, 65519.996, 65520, 65536, 3.4e38, 2.0**-24, 2.0**-25, 2.0**-26, 1e-45, 1e-40, 2.0**-14],
        np.float32,
    )
    special = np.array([np.inf, np.nan, -np.nan, 0.0], np.float32)
    pos = np.concatenate([halves, mid, *near, edges, special])
    return np.concatenate([pos, -pos])


@pytest.mark.parametrize("way", WAYS)
def test_float_to_half_is_numpys_at_every_rounding_boundary(way):
    f = _boundaries()
    same_halves(to_half(f, way), f)


@pytest.mark.parametrize("way", WAYS)
@settings(max_examples=200)
@given(f=hnp.arrays(np.float32, hnp.array_shapes(max_dims=1, max_side=300), elements=st.floats(width=32)))
def test_float_to_half_is_numpys(way, f):
    same_halves(to_half(f, way), f)


@pytest.mark.parametrize("way", WAYS)
@settings(max_examples=100)
@given(bits=hnp.arrays(np.uint32, hnp.array_shapes(max_dims=1, max_side=300)))
def test_float_to_half_of_any_bits_is_numpys(way, bits):
    """Any 32 bits as a float32 (NaN payloads, subnormals, every exponent)."""
    f = bits.view(np.float32)
    same_halves(to_half(f, way), f)


@pytest.mark.parametrize(
    "machine, cpu_name, features, want",
    [
        ("x86_64", "generic", None, False),  # a portable target: no F16C assumed
        ("x86_64", "generic", "+avx2,+f16c", False),  # (LLVM's to work out: "-avx" takes F16C away)
        ("x86_64", None, "-f16c", False),  # the host's CPU, F16C taken away
        ("x86_64", "skylake", None, False),
        ("aarch64", None, None, True),  # in ARMv8's floating point
        ("ppc64le", None, None, False),
    ],
)
def test_instructions_only_where_numba_compiles_for_them(monkeypatch, machine, cpu_name, features, want):
    """The instruction casts compile to a call numba does not link on a target without
    the instruction: a float16 call crashed the process under NUMBA_CPU_NAME=generic, and
    under NUMBA_CPU_FEATURES=-f16c (or -avx) on this CPU."""
    from numba.core import config as numba_config

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(numba_config, "CPU_NAME", cpu_name, raising=False)
    monkeypatch.setattr(numba_config, "CPU_FEATURES", features, raising=False)
    assert loops._instructions_convert_halves() is want


@pytest.mark.parametrize("way", WAYS)
def test_column_casts_are_numpys(way):
    """BatchNorm's staged blocks of channels: columns [lo, hi) of every row, both ways."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 1 << 16, size=(5, 300), dtype=np.uint16)
    up = np.empty((5, 77), np.float32)
    getattr(loops, f"_half_columns_to_float_{way}")(bits, 100, 177, up)
    want = bits[:, 100:177].view(np.float16).astype(np.float32)
    assert (up.view(np.uint32) == want.view(np.uint32)).all()
    f = (rng.normal(size=(5, 77)) * 10.0 ** rng.integers(-9, 6, size=(5, 77))).astype(np.float32)
    back = np.zeros((5, 300), np.uint16)
    getattr(loops, f"_float_to_half_columns_{way}")(f, 100, back)
    same_halves(back[:, 100:177].view(np.float16), f)
    assert not back[:, :100].any() and not back[:, 177:].any()


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"NUMBA_CPU_NAME": "generic"}, {"NUMBA_CPU_FEATURES": "-f16c"}])
def test_another_target_casts_without_the_instructions(env):
    """Under NUMBA_CPU_NAME=generic (portable caches), or with F16C taken away, float16
    LayerNorm and BatchNorm run, in integer arithmetic, and give the values they give on
    this CPU."""
    import subprocess
    import sys

    code = (
        "import numpy as np, npnorm.functional as F\n"
        "from npnorm.kernels import _numba_loops as loops\n"
        "x = np.linspace(-3, 3, 4096, dtype=np.float16).reshape(2, 2, 1024)\n"
        "y = F.layer_norm(x, 1024), F.batch_norm(x, None, None, training=True)\n"
        "print(loops.CASTS_BY_INSTRUCTION, *(a.view(np.uint16).sum() for a in y))\n"
    )
    env = {**__import__("os").environ, **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    x = np.linspace(-3, 3, 4096, dtype=np.float16).reshape(2, 2, 1024)
    from npnorm import functional as F

    y = F.layer_norm(x, 1024), F.batch_norm(x, None, None, training=True)
    assert out.stdout.split() == ["False", *(str(a.view(np.uint16).sum()) for a in y)]


def _mxcsr_access():  # type: ignore[no-untyped-def]
    """Compiled ``(get, set)`` of this thread's MXCSR (x86-64: SSE's control register)."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    def call(builder, name, ptr):  # type: ignore[no-untyped-def]
        # the intrinsics take an i8*: llvmlite before 0.45 (numba 0.61, the extra's floor)
        # types its pointers and refused the i32* ("Intrinsic has incorrect argument type")
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [builder.bitcast(ptr, i8p)])

    @intrinsic
    def _load(typingctx, v):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            ptr = builder.alloca(ir.IntType(32))
            builder.store(args[0], ptr)
            call(builder, "llvm.x86.sse.ldmxcsr", ptr)
            return context.get_dummy_value()

        return numba.types.void(numba.types.uint32), codegen

    @intrinsic
    def _store(typingctx):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            ptr = builder.alloca(ir.IntType(32))
            call(builder, "llvm.x86.sse.stmxcsr", ptr)
            return builder.load(ptr)

        return numba.types.uint32(), codegen

    return numba.njit(lambda: _store()), numba.njit(lambda v: _load(np.uint32(v)))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="MXCSR is x86's")
@pytest.mark.parametrize("way", WAYS)
def test_casts_are_exact_where_the_thread_flushes_subnormals(way):
    """A library built with -ffast-math sets the thread's MXCSR to flush subnormal results
    to zero and read subnormal inputs as zero (FTZ, DAZ); the casts still give every half
    and every float below float16's normal range as NumPy does."""
    get, put = _mxcsr_access()
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    tiny = np.concatenate([_boundaries(), np.float32(2.0**-14) * np.linspace(-1, 1, 4097, dtype=np.float32)])
    tiny = tiny[np.abs(tiny) < 2.0**-13]  # float16's subnormals and their neighbours
    up, down = np.empty(halves.shape, np.float32), np.empty(tiny.shape, np.uint16)
    saved = get()
    put(saved | 0x8040)  # FTZ | DAZ
    try:
        assert get() & 0x8040 == 0x8040
        getattr(loops, f"_half_columns_to_float_{way}")(halves[None], 0, halves.size, up[None])
        getattr(loops, f"_float_to_half_columns_{way}")(tiny[None], 0, down[None])
    finally:
        put(saved)
    assert (up.view(np.uint32) == halves.view(np.float16).astype(np.float32).view(np.uint32)).all()
    same_halves(down.view(np.float16), tiny)


def test_cast_into_takes_numpy_where_the_loops_cannot():
    """Strided blocks and other dtypes go through NumPy's cast, with the same values."""
    src = np.arange(24, dtype=np.float16).reshape(4, 6)[:, ::2]  # not C-ordered
    dst = np.empty((4, 3), np.float32)
    _staging.cast_into(dst, src)
    assert (dst == src.astype(np.float32)).all()
    back = np.empty((4, 3), np.dtype(">f2"))  # the other byte order
    _staging.cast_into(back, dst)
    assert (back == src).all()


@st.composite
def float16_problems(draw: st.DrawFn) -> dict:
    shape = draw(hnp.array_shapes(min_dims=3, max_dims=4, min_side=1, max_side=6))
    # two samples (BatchNorm), two groups, two values per channel (InstanceNorm)
    shape = (shape[0] + 1, 2 * shape[1], *shape[2:-1], shape[-1] + 1)
    elements = st.floats(-60000, 60000, width=16)
    x = draw(hnp.arrays(np.float16, shape, elements=elements, fill=st.nothing()))
    scale = draw(st.sampled_from((1.0, 1e-3)))
    x = (x.astype(np.float32) * np.float32(scale)).astype(np.float16)
    dy = draw(hnp.arrays(np.float16, shape, elements=elements, fill=st.nothing()))
    return {
        "x": laid_out(x, draw(st.sampled_from(LAYOUTS))),
        "dy": laid_out(dy, draw(st.sampled_from(LAYOUTS))),
        "threads": draw(st.sampled_from((1, 2, 3))),
        "small": draw(st.booleans()),
        "affine": draw(st.booleans()),
    }


@settings(max_examples=60)
@given(p=float16_problems())
def test_float16_is_float32_rounded_once(p):
    """Every operation on float16 data gives, bit for bit, its float32 call's output and dx
    rounded to float16, and its float32 statistics: the casts add no error of their own,
    whatever the layout, staging blocks and threads."""
    x, dy = p["x"], p["dy"]
    D = x.shape[-1]
    w = np.linspace(0.5, 1.5, D).astype(np.float16) if p["affine"] else None
    b = np.linspace(-1, 1, D).astype(np.float16) if p["affine"] else None

    def up(a):  # float16 arrays as float32 (exact), anything else as it is
        return a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float16 else a

    with config(p["threads"], p["small"]), np.errstate(over="ignore", invalid="ignore"):
        for op, fwd, bwd in op_calls(x, dy, w, b, 2):
            forward, backward = (family_kernel(f"{op}_{s}", "numba") for s in ("forward", "backward"))
            f16, f32 = forward(xp, *fwd), forward(xp, *map(up, fwd))
            assert f16[0].dtype == np.float16
            assert (f16[0].view(np.uint16) == f32[0].astype(np.float16).view(np.uint16)).all(), op
            for ours, want in zip(f16[1:3], f32[1:3], strict=True):  # the statistics, float32
                assert ours.dtype == want.dtype == np.float32
                np.testing.assert_array_equal(ours, want, err_msg=op)
            dx16 = backward(xp, *bwd(f16))[0]
            dx32 = backward(xp, *map(up, bwd(f32)))[0]
            assert dx16.dtype == np.float16
            np.testing.assert_array_equal(dx16, dx32.astype(np.float16), err_msg=op)
