"""The dropout kernel: its mask is jax.random.bernoulli's, for any blocks (TPU compilation: test_tpu_compile.py)."""


import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from reference import SEEDS, jax_key, jax_random_part, key_data, offset_words, ulp_distance
from torch_pallas.kernels import dropout as dropout_kernels
from torch_pallas.kernels.tiling import ElementwiseBlocks as Blocks

dropout = jax.jit(dropout_kernels.dropout, static_argnames=(
    "p", "impl", "interpret", "blocks", "shared_over_first_dim"))


def reference(seed, x, p):
    """The mask of the noise contract, and values scaled in float32 then rounded once."""
    keep = np.asarray(jax.random.bernoulli(jax_key(seed), 1 - p, x.shape))
    scaled = np.asarray(x, np.float32) / np.float32(1 - p)
    return keep, np.where(keep, scaled, 0).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape,blocks", [((20, 300), None), ((20, 300), Blocks(8, 128)),
                                          ((4, 8, 2048), Blocks(24, 1024)), ((7,), None), ((), None)])
def test_mask_is_jax_bernoulli(shape, blocks, dtype):
    seed, p = SEEDS[2], 0.3
    x = jax.random.uniform(jax.random.key(0), shape, dtype, minval=0.5, maxval=2.0)  # no zeros: mask = (y != 0)
    y = dropout(key_data(seed), x, p=p, impl="threefry", interpret=True, blocks=blocks)
    keep, expected = reference(seed, x, p)
    np.testing.assert_array_equal(np.asarray(y) != 0, keep)
    assert y.dtype == dtype
    assert ulp_distance(np.asarray(y, np.float32), np.asarray(expected, np.float32)) <= (1 if dtype == jnp.float32 else 1 << 16)


def test_forward_and_backward_block_shapes_agree():
    # The backward kernel may be tuned differently: other blocks, other grid order.
    x = jnp.ones((64, 1024), jnp.float32)
    forward = dropout(key_data(SEEDS[1]), x, p=0.5, impl="threefry", interpret=True, blocks=Blocks(8, 128))
    backward = dropout(key_data(SEEDS[1]), x, p=0.5, impl="threefry", interpret=True,
                       blocks=Blocks(40, 256, column_major_grid=True))
    np.testing.assert_array_equal(np.asarray(forward), np.asarray(backward))


def test_p_outside_unit_interval_is_rejected_and_p_one_drops_everything():
    with pytest.raises(ValueError, match="p must be in"):
        dropout_kernels.dropout(key_data(0), jnp.ones(4), p=1.5, interpret=True)
    np.testing.assert_array_equal(np.asarray(dropout(key_data(0), jnp.ones(4), p=1.0, interpret=True)), 0.0)


def test_mask_shared_over_first_dim_is_one_jax_mask_broadcast():
    seed, p, shape = SEEDS[1], 0.4, (6, 5, 100)
    x = jnp.ones(shape, jnp.float32)
    y = dropout(key_data(seed), x, p=p, impl="threefry", interpret=True, shared_over_first_dim=True)
    keep = np.asarray(jax.random.bernoulli(jax_key(seed), 1 - p, shape[1:]))
    np.testing.assert_array_equal(np.asarray(y) != 0, np.broadcast_to(keep, shape))
    tiled = dropout(key_data(seed), x, p=p, impl="threefry", interpret=True, shared_over_first_dim=True,
                    blocks=Blocks(6, 256))
    np.testing.assert_array_equal(np.asarray(tiled), np.asarray(y))


# Shards of tensors of 2**32 elements and more (2**32 is row 2**19 of 8192-wide rows): (global
# shape, shard shape, the shard's first element, a mask shared over the first dim).
BEYOND_2_32 = {
    "across": ((2**19 + 8, 8192), (8, 8192), (2**19 - 4, 0), False),
    "shared mask across": ((3, 2**19 + 8, 8192), (3, 8, 8192), (0, 2**19 - 4, 0), True),
    "shared mask, columns": ((3, 2**19 + 8, 8192), (3, 16, 1024), (0, 2**19 - 8, 4096), True),
}
dropout_shard = jax.jit(dropout_kernels.dropout, static_argnames=(
    "p", "impl", "interpret", "shared_over_first_dim", "global_shape"))


@pytest.mark.parametrize("case", list(BEYOND_2_32))
def test_mask_of_a_shard_past_2_32_elements_is_jax_bernoulli(case):
    global_shape, shard, start, shared = BEYOND_2_32[case]
    seed, p = SEEDS[3], 0.3
    mask_shape, mask_start = (global_shape[1:], start[1:]) if shared else (global_shape, start)
    flat_index = sum(s * int(np.prod(mask_shape[d + 1:])) for d, s in enumerate(mask_start))
    y = dropout_shard(key_data(seed), jnp.ones(shard, jnp.float32), p=p, impl="threefry", interpret=True,
                      shared_over_first_dim=shared, global_shape=global_shape, shard_offset=offset_words(flat_index))
    part = tuple(slice(s, s + size) for s, size in zip(mask_start, shard[len(shard) - len(mask_shape):]))
    keep = jax_random_part(lambda key: jax.random.bernoulli(key, 1 - p, mask_shape), jax_key(seed), part)
    np.testing.assert_array_equal(np.asarray(y) != 0, np.broadcast_to(keep, shard))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("blocks", [None, Blocks(8, 128)])
def test_dropout_add_is_the_dropout_mask_plus_residual_rounded_once(dtype, blocks):
    seed, p, shape = SEEDS[1], 0.3, (20, 300)
    x = jax.random.normal(jax.random.key(1), shape, dtype)
    residual = jax.random.normal(jax.random.key(2), shape, dtype)
    y = jax.jit(dropout_kernels.dropout_add, static_argnames=("p", "impl", "interpret", "blocks"))(
        key_data(seed), x, residual, p=p, impl="threefry", interpret=True, blocks=blocks)
    keep, _ = reference(seed, x, p)
    exact = np.where(keep, np.asarray(x, np.float64) / (1 - p), 0) + np.asarray(residual, np.float64)
    assert y.dtype == dtype
    # float32 arithmetic rounded once to the dtype: within an ulp or two of the exact sum.
    np.testing.assert_allclose(np.asarray(y, np.float64), exact, rtol=2 * float(jnp.finfo(dtype).eps), atol=1e-6)


@pytest.mark.parametrize("shape,dtype,held", [
    ((4, 197, 256), jnp.float32, True),    # ViT's 197 tokens: the reshape to (4, 197, 256) is a copy on TPU
    ((4, 200, 256), jnp.float32, False),   # whole (8, 128) tiles: the reshape is free
    ((4, 200, 256), jnp.bfloat16, True),   # bfloat16's tiles are 16 rows
    ((4, 197, 320), jnp.float32, False),   # seen lane-dense, (985, 256): not the tensor's own rows
    ((197, 256), jnp.float32, False)])     # the view is the tensor
def test_result_is_held_in_its_own_layout_where_reshaping_it_is_a_copy(shape, dtype, held):
    # bench/results/tpu_step.md: without the barrier ViT's MLP gradient is computed in the
    # kernel's 2-D rows and copied to its padded layout (77 MB more at the step's peak).
    # threefry: in interpret mode the per-tile impls run a bfloat16 dropout as float32 (kernels/dropout.py).
    hlo = dropout.lower(jnp.asarray(key_data(0)), jax.ShapeDtypeStruct(shape, dtype), p=0.1, impl="threefry",
                        interpret=True).as_text()
    assert ("optimization_barrier" in hlo) == held


def test_per_tile_impls_read_a_tensor_xla_holds_swapped_in_that_layout():
    """No barrier: (8, 197, 256) goes to the kernel as (197, 8, 256), the bytes of XLA's
    {2,0,1} layout of it on TPU, and comes back by the inverse transpose."""
    hlo = dropout.lower(jnp.asarray(key_data(0)), jax.ShapeDtypeStruct((8, 197, 256), jnp.float32), p=0.1,
                        impl="tiled", interpret=True).as_text()
    assert "optimization_barrier" not in hlo
    assert re.search(r"transpose.*\(tensor<8x197x256xf32>\) -> tensor<197x8x256xf32>", hlo)
