"""Every kernel compiled for TPU v4, v5e, v5p and v6e by libtpu's real compiler, on CPU.

Each configuration runs XLA's TPU compiler and Mosaic's passes (:mod:`torch_pallas.tpu_compile`): every
kernel, both noise impls, every dtype the public API accepts, tiny, ragged, 1-D and large
shapes (large enough that the default blocks reach their limits), with the library's
default blocks and with forced non-default ones; the Mosaic IR version the bridge pins;
and blocks too large for VMEM failing with libtpu's message rather than a crash.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from conftest import ON_TPU
from torch_pallas import tpu_compile
from torch_pallas.kernels import dropout, indrnn, prng, sampling
from torch_pallas.kernels.tiling import ElementwiseBlocks, RecurrenceBlocks
from torch_pallas.tpu_compile import GENERATIONS, compile_for_tpu

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(ON_TPU, reason="on a TPU the suite compiles and runs the kernels for real"),
    pytest.mark.skipif(not tpu_compile.available(), reason=(
        "libtpu (the TPU compiler) is not installed: ./dev test, or pip install -e '.[test]', installs "
        "libtpu==0.0.21, the version torch_xla[tpu] pins")),
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
# Tiny, ragged, 1-D (a single-row view), and large: (4096, 4096) reaches the TPU's default
# block limit (1 MiB per operand block).
ELEMENTWISE_SHAPES = {"tiny": (7,), "ragged": (20, 300), "1d": (1000001,), "large": (4096, 4096)}
FORCED_BLOCKS = {"8x128": ElementwiseBlocks(8, 128), "64x512-column-major": ElementwiseBlocks(64, 512, True)}
# (T, B, F): tiny, ragged, the benchmark's B=1 shape, and large (several blocks on every axis).
RECURRENCE_SHAPES = {"tiny": (16, 8, 128), "ragged": (37, 3, 200), "T1000-B1": (1000, 1, 1000),
                     "large": (64, 256, 2048)}


def compiles(function, *args, generation):
    assert compile_for_tpu(function, *args, generation=generation) is not None


@pytest.fixture(params=list(GENERATIONS))
def generation(request):
    return request.param


# Bernoulli samples bool whatever the dtype; uniform and normal every float dtype.
SAMPLERS = [(distribution, dtype) for distribution in ("uniform", "normal") for dtype in DTYPES] + [("bernoulli", "bool")]


@pytest.mark.parametrize("impl", prng.IMPLS)
@pytest.mark.parametrize("distribution,dtype", SAMPLERS)
def test_sampling(generation, distribution, dtype, impl):
    for shape in ELEMENTWISE_SHAPES.values():
        kernel = functools.partial(sampling.sample, shape=shape, distribution=distribution,
                                   dtype=DTYPES.get(dtype, jnp.float32), p=0.3, impl=impl, interpret=False)
        compiles(kernel, KEY, generation=generation)


@pytest.mark.parametrize("blocks", list(FORCED_BLOCKS))
@pytest.mark.parametrize("impl", prng.IMPLS)
def test_sampling_forced_blocks(generation, impl, blocks):
    for dtype in DTYPES.values():
        kernel = functools.partial(sampling.uniform, shape=ELEMENTWISE_SHAPES["large"], dtype=dtype, impl=impl,
                                   interpret=False, blocks=FORCED_BLOCKS[blocks])
        compiles(kernel, KEY, generation=generation)


@pytest.mark.parametrize("shared_over_first_dim", [False, True], ids=["", "shared-mask"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", prng.IMPLS)
def test_dropout(generation, impl, dtype, shared_over_first_dim):
    # The backward pass is this kernel on the gradient, with its own blocks (below).
    kernel = functools.partial(dropout.dropout, p=0.1, impl=impl, interpret=False,
                               shared_over_first_dim=shared_over_first_dim)
    # A shared mask needs a leading dim to share over: the 1-D shapes have none worth it.
    shapes = [ELEMENTWISE_SHAPES[name] for name in (("ragged", "large") if shared_over_first_dim else ELEMENTWISE_SHAPES)]
    for shape in shapes:
        compiles(kernel, KEY, jax.ShapeDtypeStruct(shape, DTYPES[dtype]), generation=generation)
    for blocks in FORCED_BLOCKS.values():
        compiles(functools.partial(kernel, blocks=blocks), KEY,
                 jax.ShapeDtypeStruct(ELEMENTWISE_SHAPES["large"], DTYPES[dtype]), generation=generation)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("nonlinearity", indrnn.NONLINEARITIES)
def test_indrnn(generation, nonlinearity, dtype):
    cases = [(shape, None, False) for shape in RECURRENCE_SHAPES.values()]
    cases.append((RECURRENCE_SHAPES["ragged"], RecurrenceBlocks(8, 8, 128), False))
    # Per-row lengths (packed sequences): default and forced blocks, whole and partial batch blocks.
    cases += [(RECURRENCE_SHAPES["ragged"], None, True), (RECURRENCE_SHAPES["ragged"], RecurrenceBlocks(8, 8, 128), True),
              (RECURRENCE_SHAPES["large"], None, True)]
    for (T, B, F), blocks, with_lengths in cases:
        sequence = jax.ShapeDtypeStruct((T, B, F), DTYPES[dtype])
        state = jax.ShapeDtypeStruct((B, F), DTYPES[dtype])
        weight = jax.ShapeDtypeStruct((F,), jnp.float32)
        lengths = [jax.ShapeDtypeStruct((B,), jnp.int32)] if with_lengths else []
        options = dict(nonlinearity=nonlinearity, interpret=False, blocks=blocks)
        compiles(functools.partial(indrnn.indrnn_forward, **options), sequence, weight, state, *lengths,
                 generation=generation)
        compiles(functools.partial(indrnn.indrnn_backward, **options), sequence, state, sequence, weight, state,
                 *lengths, generation=generation)


def test_mosaic_ir_version_pinned_by_the_bridge_is_accepted(generation):
    """Without the bridge's pin jax 0.7.1 emits IR version 8, which libtpu 0.0.21 rejects."""
    from jax._src import xla_bridge

    def kernel(key_data):  # a new function each call: jit caches lowerings by function
        return sampling.uniform(key_data, (8, 128), interpret=False)

    assert "tpu" in xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS  # set by importing torch_pallas
    compiles(kernel, KEY, generation=generation)
    xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.discard("tpu")
    try:
        with pytest.raises(Exception, match="Unsupported version: expected <= 7 but got 8"):
            compile_for_tpu(lambda key_data: kernel(key_data), KEY, generation=generation)
    finally:
        xla_bridge.FORCE_FORWARD_COMPAT_LOWERING_PLATFORMS.add("tpu")


# VMEM: v4's (16 MiB) is the smallest. Blocks forced just past it (measured: by 44 KiB to
# 148 KiB) fail with libtpu's message, raised as an exception, not a crash.
VMEM_ERROR = r"RESOURCE_EXHAUSTED.*Exceeded vmem capacity"
F32 = jnp.float32
VIEW = jax.ShapeDtypeStruct((16384, 1024), F32)


def test_sampling_blocks_past_vmem_fail_clearly():
    kernel = functools.partial(sampling.uniform, shape=VIEW.shape, interpret=False, blocks=ElementwiseBlocks(4096, 1024))
    with pytest.raises(Exception, match=VMEM_ERROR):
        compile_for_tpu(kernel, KEY, generation="v4")


def test_dropout_blocks_past_vmem_fail_clearly():
    kernel = functools.partial(dropout.dropout, p=0.1, interpret=False, blocks=ElementwiseBlocks(2048, 1024))
    with pytest.raises(Exception, match=VMEM_ERROR):
        compile_for_tpu(kernel, KEY, VIEW, generation="v4")


def test_indrnn_blocks_past_vmem_fail_clearly():
    T, B, F = 512, 8, 1024
    sequence, state, weight = (jax.ShapeDtypeStruct(s, F32) for s in ((T, B, F), (B, F), (F,)))
    forward = functools.partial(indrnn.indrnn_forward, nonlinearity="relu", interpret=False,
                                blocks=RecurrenceBlocks(256, B, F))
    backward = functools.partial(indrnn.indrnn_backward, nonlinearity="relu", interpret=False,
                                 blocks=RecurrenceBlocks(168, B, F))
    with pytest.raises(Exception, match=VMEM_ERROR):
        compile_for_tpu(forward, sequence, weight, state, generation="v4")
    with pytest.raises(Exception, match=VMEM_ERROR):
        compile_for_tpu(backward, sequence, state, sequence, weight, state, generation="v4")
