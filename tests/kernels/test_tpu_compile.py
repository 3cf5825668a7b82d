"""Every kernel compiled for the TPU generations the installed libtpu knows (v4, v5e, v5p, v6e;
TPU7x too with libtpu 0.0.52) by libtpu's real compiler, on CPU: a representative subset and
the tiled impl's configurations for every generation, and the whole matrix for each in the slow
tier (``--slow``).

Each configuration runs XLA's TPU compiler and Mosaic's passes (:mod:`torch_pallas.tpu_compile`): every
kernel, the threefry and hardware noise impls (the tiled one in a configuration per kernel family), every dtype the public API accepts, tiny, ragged, 1-D and large
shapes (large enough that the default blocks reach their limits), with the library's
default blocks and with forced non-default ones; the Mosaic IR version (pinned where the
JAX version needs it); blocks too large for VMEM failing with libtpu's message rather than a crash;
and each kernel's name and cost estimate in the compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from conftest import NEEDS_LIBTPU, ON_TPU, crossed
from hlo_dump import tpu_kernels
from torch_pallas.kernels import (attention, calls, compat, dropout, dropout_linear, dropout_matmul, indrnn, prng,
                                  sampling, token_sampling)
from torch_pallas.kernels.tiling import ElementwiseBlocks, RecurrenceBlocks
from jax.sharding import PartitionSpec as P

from torch_pallas.tpu_compile import GENERATIONS, compile_for_tpu, compile_sharded_for_tpu

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(ON_TPU, reason="on a TPU the suite compiles and runs the kernels for real"),
    NEEDS_LIBTPU,
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The impls the matrix below compiles. The tiled impl's kernels are the hardware impl's per-tile
# paths with an integer hash in place of the PRNG: TILED_CONFIGURATIONS compiles one
# configuration per kernel family for every generation.
MATRIX_IMPLS = (prng.THREEFRY, prng.HARDWARE)
KEY = jax.ShapeDtypeStruct((2,), jnp.int32)
# Tiny, ragged, 1-D (a single-row view), and large: (4096, 4096) reaches the TPU's default
# block limit (1 MiB per operand block).
ELEMENTWISE_SHAPES = {"tiny": (7,), "ragged": (20, 300), "1d": (1000001,), "large": (4096, 4096)}
# ViT-B/16's activations: (6304, 768) rows, whose hardware seed tiles (256, 256) leave the last
# tile row cut (the last block reaches past the view).
VIT_ROWS = (32, 197, 768)
# Non-default blocks of the large shape's (4096, 4096) view: for the hardware PRNG whole
# (64, 1024) seed tiles.
FORCED_BLOCKS = {"threefry": {"small": ElementwiseBlocks(8, 128), "column-major": ElementwiseBlocks(64, 512, True)},
                 "hardware": {"small": ElementwiseBlocks(64, 1024), "column-major": ElementwiseBlocks(128, 1024, True)}}
# (T, B, F): tiny, ragged, the benchmark's B=1 shape, and large (several blocks on every axis).
RECURRENCE_SHAPES = {"tiny": (16, 8, 128), "ragged": (37, 3, 200), "T1000-B1": (1000, 1, 1000),
                     "large": (64, 256, 2048)}


# float16 crosses every kernel boundary as float32 (Mosaic has no f16; tiling.widen_float16),
# so its kernels are the float32 ones: one shape checks the conversions around them.
FLOAT16_SHAPE = "ragged"


def elementwise_shapes(dtype, names=tuple(ELEMENTWISE_SHAPES)):
    return [ELEMENTWISE_SHAPES[name] for name in names if dtype != "float16" or name == FLOAT16_SHAPE]


# libtpu 0.0.52, the newest (the torchax stack's), is the one that knows TPU7x; the xla stack's 0.0.21 does not.
NEWEST_LIBTPU = "tpu7x" in GENERATIONS


def compiles(function, *args, generation):
    assert compile_for_tpu(function, *args, generation=generation) is not None


# The whole matrix is about 270 s of compiles per generation (TPU7x's took 2 of the torchax
# suite's 11 minutes on 2 cores), so a suite compiles the representative subset below
# (test_representative_configurations): each kernel family with both noise impls, a 16-bit and a
# 32-bit dtype, shards and masks, each of its configurations for one generation in turn (every
# family for every generation), and the tiled impl's configurations (test_tiled_configurations,
# TILED_FAST). The whole matrix is the slow tier.
@pytest.fixture(params=[pytest.param(generation, marks=pytest.mark.slow) for generation in GENERATIONS])
def generation(request):
    return request.param


# Bernoulli samples bool whatever the dtype; uniform and normal every float dtype.
SAMPLERS = [(distribution, dtype) for distribution in ("uniform", "normal") for dtype in DTYPES] + [("bernoulli", "bool")]


@pytest.mark.parametrize("impl", MATRIX_IMPLS)
@pytest.mark.parametrize("distribution,dtype", SAMPLERS)
def test_sampling(generation, distribution, dtype, impl):
    for shape in elementwise_shapes(dtype):
        kernel = functools.partial(sampling.sample, shape=shape, distribution=distribution,
                                   dtype=DTYPES.get(dtype, jnp.float32), p=0.3, impl=impl, interpret=False)
        compiles(kernel, KEY, generation=generation)


@pytest.mark.parametrize("blocks", ["small", "column-major"])
@pytest.mark.parametrize("impl", MATRIX_IMPLS)
def test_sampling_forced_blocks(generation, impl, blocks):
    for dtype in (jnp.float32, jnp.bfloat16):
        kernel = functools.partial(sampling.uniform, shape=ELEMENTWISE_SHAPES["large"], dtype=dtype, impl=impl,
                                   interpret=False, blocks=FORCED_BLOCKS[impl][blocks])
        compiles(kernel, KEY, generation=generation)


@pytest.mark.parametrize("shared_over_first_dim", [False, True], ids=["", "shared-mask"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", MATRIX_IMPLS)
def test_dropout(generation, impl, dtype, shared_over_first_dim):
    # The backward pass is this kernel on the gradient, with its own blocks (below).
    kernel = functools.partial(dropout.dropout, p=0.1, impl=impl, interpret=False,
                               shared_over_first_dim=shared_over_first_dim)
    # A shared mask needs a leading dim to share over: the 1-D shapes have none worth it.
    for shape in elementwise_shapes(dtype, ("ragged", "large") if shared_over_first_dim else ELEMENTWISE_SHAPES):
        compiles(kernel, KEY, jax.ShapeDtypeStruct(shape, DTYPES[dtype]), generation=generation)
    for blocks in FORCED_BLOCKS[impl].values() if dtype != "float16" else ():
        compiles(functools.partial(kernel, blocks=blocks), KEY,
                 jax.ShapeDtypeStruct(ELEMENTWISE_SHAPES["large"], DTYPES[dtype]), generation=generation)


# Each chip's shard offset: the [high, low] words of its first element's flat index.
OFFSETS_SPEC = P("data", "model", None)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("impl", MATRIX_IMPLS)
def test_dropout_add(generation, impl, dtype):
    # Two operands in, one out: the fused residual add (its backward is the dropout kernel).
    kernel = functools.partial(dropout.dropout_add, p=0.1, impl=impl, interpret=False)
    for shape in elementwise_shapes(dtype, ("ragged", "large")) + ([VIT_ROWS] if dtype != "float16" else []):
        operand = jax.ShapeDtypeStruct(shape, DTYPES[dtype])
        compiles(kernel, KEY, operand, operand, generation=generation)


def _dropout_on_shard(key_data, offsets, x, *, global_shape, **options):
    return dropout.dropout(key_data, x, global_shape=global_shape, shard_offset=offsets.reshape(2), **options)


# (global shape, partition spec): split rows, split columns, both, and a 3-D tensor split
# along its two last dims (the kernel's outer grid axis), each with and without a shared mask.
SHARDED_NOISE = [((1024, 2048), P("data", None)), ((1024, 2048), P(None, "model")),
                 ((1024, 2048), P("data", "model")), ((8, 64, 2048), P(None, "data", "model"))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_per_shard_on_a_2x2_topology(generation, dtype):
    offsets = jax.ShapeDtypeStruct((2, 2, 2), jnp.int32)
    for shape, spec in SHARDED_NOISE:
        for shared in (False, True):
            kernel = functools.partial(_dropout_on_shard, global_shape=shape, p=0.3, impl="threefry",
                                       interpret=False, shared_over_first_dim=shared)
            assert compile_sharded_for_tpu(kernel, (P(), OFFSETS_SPEC, spec), spec, KEY, offsets,
                                           jax.ShapeDtypeStruct(shape, DTYPES[dtype]), generation=generation)


# Shards of tensors of 2**32 elements and more, whose counters' high words the kernel computes,
# compiled as one chip runs them: (global shape, shard shape) for a run of rows, a split along
# columns (a row stride), a 3-D tensor's two last dims (the outer grid axis), and a row stride
# of 2**30, where a chunk's offsets pass one word.
PAST_2_32 = [((2**21, 4096), (1024, 4096)), ((2**21, 4096), (1024, 2048)), ((8, 2**18, 4096), (8, 512, 1024)),
             ((16, 2**30), (16, 1024))]


def test_dropout_shard_of_more_than_2_32_elements(generation):
    for shape, shard in PAST_2_32:
        kernel = functools.partial(_dropout_on_shard, global_shape=shape, p=0.3, impl="threefry", interpret=False)
        compiles(kernel, KEY, jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct(shard, jnp.float32),
                 generation=generation)


def test_dropout_of_more_than_2_32_elements_whole():
    # 2**32 + 2**15 float32 elements in and out: v5p's HBM (95 GiB) is the one that holds them.
    compiles(functools.partial(dropout.dropout, p=0.3, impl="threefry", interpret=False), KEY,
             jax.ShapeDtypeStruct((2**20 + 8, 4096), jnp.float32), generation="v5p")


# The hardware PRNG's shards are whole bands of seed tiles of the whole tensor's view (here
# 64 rows of (1024, 2048), and 1024-wide tiles of a shared mask): split rows (over one mesh
# axis, over both), and the shared mask of a (T, B, F) tensor split over B.
HARDWARE_SHARDED_NOISE = [((1024, 2048), P("data", None), False), ((1024, 2048), P(("data", "model"), None), False),
                          ((8, 64, 2048), P(None, ("data", "model"), None), True)]


# Shards that are not whole bands, drawn in the bands that cover them: rows of a band (a band is 64 rows
# of (64, 2048)), a split along columns (1024 runs: their span, drawn whole) and ViT-B/16's activations
# split along the batch (seen swapped, as (197, 32, 768): 197 runs of a shard's 8 rows).
COVERED_SHARDED_NOISE = [((64, 2048), P(("data", "model"), None), False), ((1024, 2048), P(None, "model"), False),
                         ((32, 197, 768), P(("data", "model"), None, None), False)]


def test_hardware_dropout_per_shard_on_a_2x2_topology(generation, impl="hardware", cases=HARDWARE_SHARDED_NOISE):
    offsets = jax.ShapeDtypeStruct((2, 2, 2), jnp.int32)
    for shape, spec, shared in cases:
        kernel = functools.partial(_dropout_on_shard, global_shape=shape, p=0.3, interpret=False, impl=impl,
                                   shared_over_first_dim=shared)
        assert compile_sharded_for_tpu(kernel, (P(), OFFSETS_SPEC, spec), spec, KEY, offsets,
                                       jax.ShapeDtypeStruct(shape, jnp.float32), generation=generation)


@pytest.mark.parametrize("nonlinearity", indrnn.NONLINEARITIES)
def test_indrnn_per_shard_on_a_2x2_topology(generation, nonlinearity):
    T, B, F = 64, 64, 2048
    sequence, state = jax.ShapeDtypeStruct((T, B, F), jnp.float32), jax.ShapeDtypeStruct((B, F), jnp.float32)
    weight, lengths = jax.ShapeDtypeStruct((F,), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)
    seq, st, w, b = P(None, "data", "model"), P("data", "model"), P("model"), P("data")
    options = dict(nonlinearity=nonlinearity, interpret=False)
    assert compile_sharded_for_tpu(functools.partial(indrnn.indrnn_forward, **options), (seq, w, st, b), (seq, st),
                                   sequence, weight, state, lengths, generation=generation)
    assert compile_sharded_for_tpu(functools.partial(indrnn.indrnn_backward_weight_rows, **options),
                                   (seq, st, seq, w, st, b), (seq, st, st), sequence, state, sequence, weight, state,
                                   lengths, generation=generation)


# The state and the nonlinearity are computed in float32 whatever the dtype: tanh is compiled
# with float32 only.
@pytest.mark.parametrize("nonlinearity,dtype", [("relu", dtype) for dtype in DTYPES] + [("tanh", "float32")])
def test_indrnn(generation, nonlinearity, dtype, shapes=tuple(RECURRENCE_SHAPES)):
    cases = [(shape, None, False) for shape in RECURRENCE_SHAPES.values()]
    cases.append((RECURRENCE_SHAPES["ragged"], RecurrenceBlocks(8, 8, 128), False))
    # Per-row lengths (packed sequences): default and forced blocks, whole and partial batch blocks.
    cases += [(RECURRENCE_SHAPES["ragged"], None, True), (RECURRENCE_SHAPES["ragged"], RecurrenceBlocks(8, 8, 128), True),
              (RECURRENCE_SHAPES["large"], None, True)]
    if dtype == "float16":
        shapes = (FLOAT16_SHAPE,)
    cases = [case for case in cases if case[0] in [RECURRENCE_SHAPES[name] for name in shapes]]
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


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_mosaic_ir_version_is_one_libtpu_accepts(generation, monkeypatch):
    """jax 0.7.1 writes IR version 8, which libtpu 0.0.21 rejects, unless the kernels' import
    pins 7; jax 0.10 picks its newest for a runtime as recent as libtpu 0.0.52 (which compiles
    it), and nothing is pinned."""
    from jax._src import tpu_custom_call

    picked = []
    pick = tpu_custom_call.get_ir_version
    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: picked.append(pick(ctx)) or picked[-1])

    def kernel(key_data):  # a new function each call: jit caches lowerings by function
        return sampling.uniform(key_data, (8, 128), interpret=False)

    compiles(kernel, KEY, generation=generation)
    old_jax = compat.JAX_VERSION < (0, 8)
    assert compat.mosaic_ir_version_pinned() == old_jax
    assert set(picked) == ({7} if old_jax else {None})  # None: the serialiser's current version
    if old_jax:
        with compat.unpinned_mosaic_ir_version(), pytest.raises(
                Exception, match="Unsupported version: expected <= 7 but got 8"):
            compile_for_tpu(lambda key_data: kernel(key_data), KEY, generation=generation)


def attention_forward_and_backward(key_data, query, key, value, *bias, **options):
    """The forward and both backward kernels of one attention call, with their default blocks."""
    def function(query, key, value):
        return attention.attention(key_data, query, key, value, *bias or (None,), interpret=False, **options)
    out, pullback = jax.vjp(function, query, key, value)
    return out, pullback(out)


def rounded_attention_forward_and_backward(key_data, query, key, value, *bias, **options):
    """The forward and backward kernels as the ops run float32 attention compiled for a TPU
    (``ops.attention.bfloat16_operands``): bfloat16 operands, float32 output and gradients."""
    operands = [operand.astype(jnp.bfloat16) for operand in (query, key, value)]
    out, lse = attention.attention_forward(key_data, *operands, *bias or (None,), interpret=False,
                                           result_dtype=query.dtype, **options)
    return out, attention.attention_backward(key_data, *operands, out, lse, out, *bias or (None,), interpret=False,
                                             **options)


# (L, S, head dim) x heads: ragged lengths, ViT-B/16's 197 patches (3 heads of 64 are not whole
# lane columns: the flash kernels, every block all of L, the planes in one grid step; 4 heads run
# heads_in_lanes, lengths that are not whole tiles), and 2048 tokens with the default blocks at
# their largest.
ATTENTION_SHAPES = {"ragged": ((2, 4, 1000, 64), (2, 4, 700, 64)), "197": ((2, 3, 197, 64),) * 2,
                    "197-heads-in-lanes": ((2, 4, 197, 64),) * 2, "2048-head-128": ((1, 2, 2048, 128),) * 2,
                    "128-heads-in-lanes": ((2, 4, 128, 64),) * 2}


# float16 reaches the kernels as float32 (Mosaic has no float16): threefry's float16 compiles its
# float32 kernels and the conversions around them.
ATTENTION_CONFIGURATIONS = [("threefry", "bfloat16"), ("threefry", "float16"), ("hardware", "float32"),
                            ("hardware", "bfloat16")]


@pytest.mark.parametrize("impl,dtype", ATTENTION_CONFIGURATIONS)
def test_attention(generation, impl, dtype, names=None):
    """Causal attention with dropout, forward and backward; 2048 tokens in the training dtype,
    197 in float32 (the flash kernels' planes, and several heads per lane column: heads_in_lanes),
    128 (heads_in_lanes) in both."""
    if names is None:
        names = ("ragged", "2048-head-128") if dtype == "bfloat16" else ("ragged", "197", "197-heads-in-lanes")
        names += ("128-heads-in-lanes",)
    for name in names:
        query_shape, key_shape = ATTENTION_SHAPES[name]
        query, key = (jax.ShapeDtypeStruct(shape, DTYPES[dtype]) for shape in (query_shape, key_shape))
        compiles(functools.partial(attention_forward_and_backward, dropout_p=0.1, impl=impl, causal=True),
                 KEY, query, key, key, generation=generation)


# A float mask over keys, or a boolean one per query row too, broadcast over heads; at 197 tokens
# a grid step holds several planes (heads), sharing the step's mask, key and value planes.
@pytest.mark.parametrize("mask,L,S", [("bool", 1000, 700), ("float", 1000, 700), ("float", 197, 197)])
def test_attention_with_a_broadcast_mask_and_gqa(generation, mask, L, S):
    query = jax.ShapeDtypeStruct((2, 4, L, 64), jnp.bfloat16)
    key = jax.ShapeDtypeStruct((2, 2, S, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((2, 1, L, S) if mask == "bool" else (2, 1, 1, S),
                                jnp.bool_ if mask == "bool" else jnp.bfloat16)
    compiles(functools.partial(attention_forward_and_backward, dropout_p=0.1, gqa=True),
             KEY, query, key, key, bias, generation=generation)


def _attention_on_shard(key_data, offsets, query, key, value, **options):
    """Forward and backward on one chip's shard, as torch_pallas's SPMD layer runs them."""
    shard = dict(options, global_shape=(4, 8, 1, 1), shard_offset=offsets.reshape(2), interpret=False)
    out, lse = attention.attention_forward(key_data, query, key, value, **shard)
    return attention.attention_backward(key_data, query, key, value, out, lse, out, **shard)


@pytest.mark.parametrize("impl", MATRIX_IMPLS)
def test_attention_per_shard_on_a_2x2_topology(generation, impl):
    """Batch and heads split over the 2x2 mesh, GQA heads with them."""
    spec = P("data", "model", None, None)
    query = jax.ShapeDtypeStruct((4, 8, 512, 64), jnp.bfloat16)
    key = jax.ShapeDtypeStruct((4, 4, 512, 64), jnp.bfloat16)
    kernel = functools.partial(_attention_on_shard, dropout_p=0.1, impl=impl, causal=True, gqa=True)
    assert compile_sharded_for_tpu(kernel, (P(), OFFSETS_SPEC, spec, spec, spec), (spec, spec, spec), KEY,
                                   jax.ShapeDtypeStruct((2, 2, 2), jnp.int32), query, key, key,
                                   generation=generation)


def dropout_matmul_forward_and_backward(key_data, weights, value, **options):
    out = dropout_matmul.dropout_matmul_forward(key_data, weights, value, interpret=False, **options)
    return out, dropout_matmul.dropout_matmul_backward(key_data, weights, value, out, interpret=False, **options)


# Eager attention's weights: GPT-2 small's (1024 tokens, head dim 64) and ViT-B/16's 197 patches
# (lengths no block divides).
DROPOUT_MATMUL_SHAPES = {"1024": (96, 1024, 1024, 64), "197": (24, 197, 197, 64)}


# The newest compiler compiles attention's configurations; libtpu 0.0.21 the hardware PRNG's in float32
# (threefry's mask is the flash kernels', compiled there).
DROPOUT_MATMUL_CONFIGURATIONS = ATTENTION_CONFIGURATIONS if NEWEST_LIBTPU else [("hardware", "float32")]


@pytest.mark.parametrize("impl,dtype", DROPOUT_MATMUL_CONFIGURATIONS)
def test_dropout_matmul(generation, impl, dtype, names=tuple(DROPOUT_MATMUL_SHAPES)):
    """The weights given, and (softmax=True) the scores given, whole rows per block."""
    for name in names if dtype != "float16" else ("197",):
        planes, L, S, Ev = DROPOUT_MATMUL_SHAPES[name]
        weights = jax.ShapeDtypeStruct((planes, L, S), DTYPES[dtype])
        value = jax.ShapeDtypeStruct((planes, S, Ev), DTYPES[dtype])
        for softmax in (False, True):
            compiles(functools.partial(dropout_matmul_forward_and_backward, p=0.1, impl=impl, softmax=softmax), KEY,
                     weights, value, generation=generation)
        compiles(functools.partial(dropout_matmul.dropout_weights, p=0.1, impl=impl, interpret=False), KEY, weights,
                 generation=generation)


# x's shape and N: LoRA's down-projection (rank 16) of 4096 rows of 1024 features, T5's
# feed-forward output (d_ff 3072 to 768) over 2 x 512 tokens, and rows that end inside a tile.
DROPOUT_LINEAR_SHAPES = {"lora": ((4096, 1024), 16), "t5-wo": ((2, 512, 3072), 768), "ragged": ((100, 1024), 16)}


def dropout_linear_forward_and_backward(key_data, x, weight, **options):
    out = dropout_linear.dropout_linear_forward(key_data, x, weight, interpret=False, **options)
    return out, dropout_linear.dropout_linear_backward(key_data, x, weight, out, interpret=False, **options)


@pytest.mark.parametrize("impl", MATRIX_IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16's kernels are float32's
def test_dropout_linear(generation, impl, dtype, names=tuple(DROPOUT_LINEAR_SHAPES)):
    for name in names:
        shape, N = DROPOUT_LINEAR_SHAPES[name]
        compiles(functools.partial(dropout_linear_forward_and_backward, p=0.1, impl=impl), KEY,
                 jax.ShapeDtypeStruct(shape, DTYPES[dtype]), jax.ShapeDtypeStruct((N, shape[-1]), DTYPES[dtype]),
                 generation=generation)


def _dropout_linear_on_shard(key_data, offsets, x, weight, *, global_shape, **options):
    shard = dict(global_shape=global_shape, shard_offset=offsets.reshape(2), interpret=False, **options)
    out = dropout_linear.dropout_linear_forward(key_data, x, weight, **shard)
    return out, *dropout_linear.dropout_linear_backward_weight_rows(key_data, x, weight, out, **shard)


def test_dropout_linear_per_shard_on_a_2x2_topology(generation, impl="tiled"):
    """FSDPv2's LoRA input: (16, 256, 1024) split along the batch over both mesh axes, its first
    row data (:func:`dropout_linear._with_first_row`), the rank-16 weight whole."""
    shape, spec = (16, 256, 1024), P(("data", "model"), None, None)
    offsets = jax.ShapeDtypeStruct((2, 2, 2), jnp.int32)
    kernel = functools.partial(_dropout_linear_on_shard, global_shape=shape, p=0.1, impl=impl)
    assert compile_sharded_for_tpu(kernel, (P(), OFFSETS_SPEC, spec, P()), (spec, spec, P(("data", "model"))),
                                   KEY, offsets, jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                                   jax.ShapeDtypeStruct((16, 1024), jnp.float32), generation=generation)


# (batch, vocabulary): one request of Llama 3's vocabulary (its row folded into 8 parts, a vreg's
# sublanes), and 13 rows of a ragged one smaller than a block.
TOKEN_SAMPLING_SHAPES = {"llama3": (1, 128256), "ragged": (13, 1000)}


@pytest.mark.parametrize("parameters", ["all", "temperature"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_sampling(generation, dtype, parameters, shapes=tuple(TOKEN_SAMPLING_SHAPES)):
    """The sampler whole: its keys, its kept sets' thresholds (top-k, top-p, min-p) and its
    Gumbel-max kernel over vocabulary blocks."""
    for batch, vocabulary in (TOKEN_SAMPLING_SHAPES[name] for name in shapes):
        rows = [jax.ShapeDtypeStruct((batch,), row_dtype) for row_dtype in (jnp.int32, jnp.float32, jnp.float32)]
        optional = [rows[0], rows[1], rows[2]] if parameters == "all" else []
        compiles(functools.partial(token_sampling.sample_tokens, interpret=False),
                 jax.ShapeDtypeStruct((batch, vocabulary), DTYPES[dtype]), jax.ShapeDtypeStruct((batch, 2), jnp.int32),
                 rows[0], rows[1], *optional, generation=generation)


# Per kernel: both noise impls, a 16-bit and a 32-bit dtype, a shared mask, forced blocks,
# lengths, sharded programs (tensors past 2**32 elements included) and attention's masks. Attention's
# planes and heads in lanes at 197 tokens are the tiled configurations' (the hardware impl's per-tile
# paths); tanh differs from relu in the elementwise step only (the ragged shape).
REPRESENTATIVE = {
    "sampling": {
        "normal-threefry": lambda generation: test_sampling(generation, "normal", "float32", "threefry"),
        "bernoulli-hardware": lambda generation: test_sampling(generation, "bernoulli", "bool", "hardware")},
    "dropout": {
        "threefry-bfloat16-shared": lambda generation: test_dropout(generation, "threefry", "bfloat16", True),
        "hardware-float32": lambda generation: test_dropout(generation, "hardware", "float32", False),
        "add-hardware-bfloat16": lambda generation: test_dropout_add(generation, "hardware", "bfloat16")},
    "dropout-per-shard": {
        "2x2-bfloat16": lambda generation: test_dropout_per_shard_on_a_2x2_topology(generation, "bfloat16"),
        "2x2-hardware": lambda generation: test_hardware_dropout_per_shard_on_a_2x2_topology(generation),
        "past-2-32": lambda generation: test_dropout_shard_of_more_than_2_32_elements(generation)},
    "indrnn": {
        "relu-bfloat16": lambda generation: test_indrnn(generation, "relu", "bfloat16"),
        "tanh-float32-ragged": lambda generation: test_indrnn(generation, "tanh", "float32", ("ragged",)),
        "2x2-relu": lambda generation: test_indrnn_per_shard_on_a_2x2_topology(generation, "relu")},
    "attention": {
        "hardware-float32": lambda generation: test_attention(generation, "hardware", "float32",
                                                              ("ragged", "128-heads-in-lanes")),
        "bool-mask-gqa-1000x700": lambda generation: test_attention_with_a_broadcast_mask_and_gqa(
            generation, "bool", 1000, 700),
        "float-mask-gqa-197": lambda generation: test_attention_with_a_broadcast_mask_and_gqa(
            generation, "float", 197, 197),
        "2x2-threefry": lambda generation: test_attention_per_shard_on_a_2x2_topology(generation, "threefry")},
    "dropout_matmul": {
        "hardware-float32-197": lambda generation: test_dropout_matmul(generation, "hardware", "float32", ("197",))},
    "token_sampling": {
        "bfloat16-all-llama3": lambda generation: test_token_sampling(generation, "bfloat16", "all", ("llama3",)),
        "float32-temperature-ragged": lambda generation: test_token_sampling(generation, "float32", "temperature",
                                                                             ("ragged",))},
    "dropout_linear": {
        "threefry-bfloat16-lora": lambda generation: test_dropout_linear(generation, "threefry", "bfloat16", ("lora",)),
        "hardware-float32-ragged": lambda generation: test_dropout_linear(generation, "hardware", "float32",
                                                                          ("ragged",)),
        "2x2": lambda generation: test_dropout_linear_per_shard_on_a_2x2_topology(generation)},
}


def _rotated(families, generations):
    """(generation, "family-configuration") pairs in which every generation compiles each family
    and each configuration compiles for one generation at least: configuration i of a family on
    generation i (round the generations, and the configurations round them where they are fewer)."""
    return {(generation, f"{family}-{configuration}")
            for family, configurations in families.items()
            for i, configuration in enumerate(configurations)
            for g, generation in enumerate(generations)
            if i % len(generations) == g or g % len(configurations) == i}


def _compiles_tiled_dropout(generation):
    """float32 (2**24 elements in (64, 1024) tiles: four row slabs per hash; a ragged view's (24, 128)
    tiles: rows rounded up to four 8-row slabs) and bfloat16 (a 1-D view's (8, 1024) tiles: four lane slabs; ViT's
    rows in (256, 256) tiles with the last tile row cut, with a residual)."""
    kernel = functools.partial(dropout.dropout, p=0.1, impl="tiled", interpret=False)
    for shape, dtype in ((ELEMENTWISE_SHAPES["large"], jnp.float32), (ELEMENTWISE_SHAPES["ragged"], jnp.float32),
                         (ELEMENTWISE_SHAPES["1d"], jnp.bfloat16)):
        compiles(kernel, KEY, jax.ShapeDtypeStruct(shape, dtype), generation=generation)
    compiles(functools.partial(dropout.dropout_add, p=0.1, impl="tiled", interpret=False), KEY,
             *[jax.ShapeDtypeStruct(VIT_ROWS, jnp.bfloat16)] * 2, generation=generation)


def _compiles_tiled_weights_in_lanes(generation, batch, length):
    """Eager attention's softmax, dropout and product over 12 heads of length x length weights."""
    compiles(functools.partial(dropout_matmul_forward_and_backward, p=0.1, impl="tiled", softmax=True), KEY,
             jax.ShapeDtypeStruct((batch, 12, length, length), jnp.float32),
             jax.ShapeDtypeStruct((batch, 12, length, 64), jnp.float32), generation=generation)


# One configuration per kernel family with impl="tiled", for every generation: its layouts (rows,
# lanes, rows rounded up), 32-bit draws for sampling, a shard, attention's planes of 197 x 197
# ((200, 256) tiles, cut: four slabs of 56 rows, 224 drawn), several heads per lane column (BERT's
# 128 tokens with a padding mask, ViT-B/16's 12 heads of 197; float32 attention as the ops give it
# to kernels compiled for a TPU: rounded to bfloat16), and eager attention's weights (the same).
# Heads in lanes at one length per kernel on every generation (attention's 128, the weights' 197),
# and at the other on the newest generation each libtpu knows; the rest in the slow tier.
TILED_CONFIGURATIONS = {
    "sampling": lambda generation: compiles(
        functools.partial(sampling.normal, shape=ELEMENTWISE_SHAPES["large"], impl="tiled", interpret=False), KEY,
        generation=generation),
    "dropout": _compiles_tiled_dropout,
    "dropout-per-shard": lambda generation: test_hardware_dropout_per_shard_on_a_2x2_topology(
        generation, "tiled", HARDWARE_SHARDED_NOISE[-1:] + COVERED_SHARDED_NOISE),
    "attention": lambda generation: compiles(
        functools.partial(rounded_attention_forward_and_backward, dropout_p=0.1, impl="tiled", causal=True), KEY,
        *[jax.ShapeDtypeStruct(ATTENTION_SHAPES["197"][0], jnp.float32)] * 3, generation=generation),
    "attention-heads-in-lanes-128": lambda generation: compiles(
        functools.partial(rounded_attention_forward_and_backward, dropout_p=0.1, impl="tiled"), KEY,
        *[jax.ShapeDtypeStruct((8, 12, 128, 64), jnp.float32)] * 3, jax.ShapeDtypeStruct((8, 1, 1, 128), jnp.bool_),
        generation=generation),
    "attention-heads-in-lanes-197": lambda generation: compiles(
        functools.partial(rounded_attention_forward_and_backward, dropout_p=0.1, impl="tiled"), KEY,
        *[jax.ShapeDtypeStruct((2, 12, 197, 64), jnp.float32)] * 3, generation=generation),
    "dropout_matmul": lambda generation: compiles(
        functools.partial(dropout_matmul_forward_and_backward, p=0.1, impl="tiled", softmax=True), KEY,
        *(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((24, 197, 197), (24, 197, 64))),
        generation=generation),
    "dropout_matmul-heads-in-lanes-128": lambda generation: _compiles_tiled_weights_in_lanes(generation, 8, 128),
    # the weights dropped alone, as route_dropout's attention weights are where no product fuses: ViT's
    # 197 x 197 in bfloat16 (whole planes, several per step) and BERT's 512 x 512 in float32
    "dropout_weights": lambda generation: [compiles(
        functools.partial(dropout_matmul.dropout_weights, p=0.1, impl="tiled", interpret=False), KEY,
        jax.ShapeDtypeStruct(shape, dtype), generation=generation)
        for shape, dtype in (((32, 12, 197, 197), jnp.bfloat16), ((8, 12, 512, 512), jnp.float32))],
    "dropout_linear": lambda generation: (test_dropout_linear(generation, "tiled", "bfloat16", ("lora", "t5-wo")),
                                          test_dropout_linear(generation, "tiled", "float32", ("ragged",))),
    "dropout_matmul-heads-in-lanes-197": lambda generation: _compiles_tiled_weights_in_lanes(generation, 2, 197),
}
TILED_ON_THE_NEWEST_ONLY = ("attention-heads-in-lanes-197", "dropout_matmul-heads-in-lanes-128")
# With the newest libtpu each configuration for every generation; with libtpu 0.0.21 (whose
# compiles are the xla suite's longest) each for one generation in turn, every generation
# compiling some: the newest libtpu compiles the same kernels for every generation, and the rest
# is the slow tier.
TILED_FAST = ({(generation, kernel) for generation in GENERATIONS for kernel in TILED_CONFIGURATIONS
               if kernel not in TILED_ON_THE_NEWEST_ONLY or generation == list(GENERATIONS)[-1]}
              if NEWEST_LIBTPU else
              {(generation, name.removeprefix("tiled-"))
               for generation, name in _rotated({"tiled": TILED_CONFIGURATIONS}, list(GENERATIONS))})


@pytest.mark.parametrize("generation,kernel", crossed(
    TILED_FAST, generation=list(GENERATIONS), kernel=list(TILED_CONFIGURATIONS)))
def test_tiled_configurations(generation, kernel):
    TILED_CONFIGURATIONS[kernel](generation)


@pytest.mark.parametrize("generation,configuration", crossed(
    _rotated(REPRESENTATIVE, list(GENERATIONS)), generation=list(GENERATIONS),
    configuration={f"{family}-{name}": compile_it for family, configurations in REPRESENTATIVE.items()
                   for name, compile_it in configurations.items()}))
def test_representative_configurations(generation, configuration):
    configuration(generation)


def test_libtpu_refusing_every_topology_raises_its_reason(monkeypatch):
    """Another process holding libtpu's lockfile: its message, not an empty list of generations."""
    from torch_pallas import tpu_compile

    def refused(name):
        raise RuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile.')

    monkeypatch.setattr(tpu_compile, "_known_generations", {})
    monkeypatch.setattr(tpu_compile, "_topology", refused)
    with pytest.raises(RuntimeError, match="libtpu refused to describe any TPU topology: .*lockfile"):
        tpu_compile.GENERATIONS


# VMEM: v4's (16 MiB) is the smallest. Blocks forced just past it (measured: by 44 KiB to
# 148 KiB) fail with libtpu's message, raised as an exception, not a crash. libtpu 0.0.52
# words an output window too large as an allocation that "would exceed memory" in vmem.
VMEM_ERROR = r"RESOURCE_EXHAUSTED.*(Exceeded vmem capacity|would exceed memory .*space=vmem)"
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


# Names and cost estimates (torch_pallas.kernels.calls): each Mosaic custom call carries its name
# (kernel, phase, variant, blocks) as the scope of its op_name, what TPU profiles show, and its cost
# estimate in its backend config, which XLA's cost analysis adds up.

def float32(*shape):
    return jax.ShapeDtypeStruct(shape, F32)


# Two blocks of queries and of keys in a short compile.
SMALL_BLOCKS = attention.AttentionBlocks(128, 128)
VIT_PLANES = attention.AttentionBlocks(197, 197, 8)


def indrnn_forward_and_backward(x, weight, h0, **options):
    output, h_n = indrnn.indrnn_forward(x, weight, h0, interpret=False, **options)
    return indrnn.indrnn_backward(output, h_n, output, weight, h0, interpret=False, **options)


# (function, argument shapes, the names of its kernels) for every kernel family, both noise impls,
# forward and backward, the attention kernels' variants (causal, several planes per step, the
# query's gradient in the key-value kernel), with their default blocks (causal attention's small).
NAMED_CASES = {
    "dropout": (functools.partial(dropout.dropout, p=0.1, impl="threefry", interpret=False),
                [KEY, float32(256, 1024)], ["dropout_threefry_b256x1024"]),
    "dropout_add-hardware": (functools.partial(dropout.dropout_add, p=0.1, impl="hardware", interpret=False),
                             [KEY, float32(256, 1024), float32(256, 1024)], ["dropout_add_hardware_b256x1024"]),
    "dropout-tiled": (functools.partial(dropout.dropout, p=0.1, impl="tiled", interpret=False),
                      [KEY, float32(256, 1024)], ["dropout_tiled_b256x1024"]),
    "dropout_linear-tiled": (functools.partial(dropout_linear_forward_and_backward, p=0.1, impl="tiled"),
                             [KEY, float32(4096, 1024), float32(16, 1024)],
                             ["dropout_linear_fwd_tiled_b512x1024", "dropout_linear_bwd_tiled_b512x1024"]),
    "normal": (functools.partial(sampling.normal, shape=(64, 1024), interpret=False), [KEY],
               ["sample_normal_threefry_b64x1024"]),
    "attention-causal": (functools.partial(attention_forward_and_backward, dropout_p=0.1, impl="threefry",
                                           causal=True, blocks=SMALL_BLOCKS, backward_blocks=SMALL_BLOCKS),
                         [KEY, *[float32(1, 2, 256, 64)] * 3],
                         ["attention_fwd_threefry_causal_b128x128", "attention_dkv_threefry_causal_b128x128",
                          "attention_dq_threefry_causal_b128x128"]),
    # ViT's planes given as blocks of 8 planes: the flash kernels, where its default runs heads_in_lanes'.
    "attention-vit": (functools.partial(attention_forward_and_backward, blocks=VIT_PLANES, backward_blocks=VIT_PLANES),
                      [KEY, *[float32(1, 8, 197, 64)] * 3],
                      ["attention_fwd_p8_b197x197", "attention_dqkv_p8_b197x197"]),
    "attention-vit-heads-in-lanes": (attention_forward_and_backward, [KEY, *[float32(1, 8, 197, 64)] * 3],
                                     ["attention_fwd_lanes_b197x197", "attention_dqkv_lanes_b197x197"]),
    "dropout_weights-tiled": (functools.partial(dropout_matmul.dropout_weights, p=0.1, impl="tiled", interpret=False),
                              [KEY, float32(2, 4, 512, 1024)], ["dropout_weights_tiled_b512x512"]),
    "softmax_dropout_matmul": (functools.partial(dropout_matmul_forward_and_backward, p=0.1, impl="threefry",
                                                 softmax=True),
                               [KEY, float32(1, 2, 256, 1024), float32(1, 2, 1024, 64)],
                               ["softmax_dropout_matmul_fwd_threefry_b128x1024",
                                "softmax_dropout_matmul_bwd_threefry_b128x1024"]),
    "indrnn": (functools.partial(indrnn_forward_and_backward, nonlinearity="tanh"),
               [float32(64, 8, 256), float32(256), float32(8, 256)],
               ["indrnn_fwd_tanh_b64x8x256", "indrnn_bwd_tanh_b64x8x256"]),
}


# Estimates worked out by hand from the kernels' counts: elementwise kernels move their operands
# and output once and work per element (the noise's integer work counted as flops,
# prng.noise_ops); attention computes one exponential per score of the blocks that run (causal:
# 3 of the 2 x 2 blocks of 128 x 128 per plane).
ELEMENTS = 256 * 1024
EXPECTED_COSTS = {
    "dropout_threefry_b256x1024": dict(flops=ELEMENTS * (prng.noise_ops("threefry") + 4), transcendentals=0,
                                       bytes_accessed=2 * 4 * ELEMENTS + 8),
    "dropout_tiled_b256x1024": dict(flops=ELEMENTS * (prng.noise_ops("tiled", prng.DROPOUT_BITS) + 4),
                                    transcendentals=0, bytes_accessed=2 * 4 * ELEMENTS + 8),
    "dropout_weights_tiled_b512x512": dict(flops=16 * ELEMENTS * (prng.noise_ops("tiled", prng.DROPOUT_BITS) + 4),
                                           transcendentals=0, bytes_accessed=16 * 2 * 4 * ELEMENTS + 8),
    "dropout_add_hardware_b256x1024": dict(flops=ELEMENTS * (prng.noise_ops("hardware") + 5), transcendentals=0,
                                           bytes_accessed=3 * 4 * ELEMENTS + 8),
    "sample_normal_threefry_b64x1024": dict(transcendentals=2 * 64 * 1024, bytes_accessed=4 * 64 * 1024 + 8),
    "attention_fwd_threefry_causal_b128x128": dict(transcendentals=2 * 3 * 128 * 128),
    "attention_fwd_p8_b197x197": dict(transcendentals=8 * 197 * 197),
    "attention_fwd_lanes_b197x197": dict(transcendentals=8 * 197 * 197),
    "indrnn_fwd_tanh_b64x8x256": dict(flops=3 * 64 * 8 * 256, transcendentals=64 * 8 * 256,
                                      bytes_accessed=4 * (2 * 64 * 8 * 256 + 256 + 2 * 8 * 256)),
}


def compiled_kernels(function, args):
    """The program compiled for v5e and its kernels' ``(name, cost estimate)``."""
    compiled = compile_for_tpu(function, *args, generation="v5e")
    return compiled, tpu_kernels(compiled.as_text())


@pytest.mark.parametrize("case", list(NAMED_CASES))
def test_each_compiled_kernel_carries_its_name_and_cost_estimate(case):
    function, args, names = NAMED_CASES[case]
    _, kernels = compiled_kernels(function, args)
    assert sorted({name for name, _ in kernels}) == sorted(names)
    for name, cost in kernels:
        assert cost["flops"] > 0 and cost["bytes_accessed"] > 0, (name, cost)
        expected = EXPECTED_COSTS.get(name, {})
        assert {key: cost[key] for key in expected} == expected, name


def test_xla_counts_the_kernels_estimate():
    function, args, [name] = NAMED_CASES["dropout"]
    compiled, [(_, cost)] = compiled_kernels(function, args)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    # Without an estimate XLA counts a Mosaic kernel as no flops and no total bytes.
    assert analysis["flops"] == cost["flops"] == EXPECTED_COSTS[name]["flops"]
    assert analysis["bytes accessed"] == cost["bytes_accessed"]


def test_kernel_names_are_stable_identifiers():
    assert calls.kernel_name("dropout", "", "threefry", blocks=(256, 1024)) == "dropout_threefry_b256x1024"
    assert calls.kernel_name("indrnn", "fwd", "relu", blocks=(64, 8, 256)) == "indrnn_fwd_relu_b64x8x256"
    with pytest.raises(ValueError, match="identifier"):
        calls.kernel_name("dropout", "p=0.5", blocks=(8, 128))
