"""The sampling kernels against jax.random, bit for bit, for every block shape and grid order."""


import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from conftest import covered_on_the_newest_jax
from reference import (SEEDS, as_bits, emulated_hardware_tile_bits, jax_key, jax_random_part, key_data,
                       numpy_tiled_tile, offset_words, tiled_bits, tiled_seed_key, ulp_distance)
from torch_pallas.kernels import elementwise, prng, sampling, tiling
from torch_pallas.kernels.tiling import ElementwiseBlocks as Blocks

# (shape, block shapes to try). Blocks that do not divide the 2-D view are included: Pallas
# pads the edge blocks and the numbers must not change.
SHAPES_AND_BLOCKS = [
    ((), [None]),
    ((7,), [None]),
    ((20, 300), [None, Blocks(8, 128), Blocks(16, 256)]),        # view (20, 300): ragged in both dims
    ((3, 5, 129), [None, Blocks(8, 128)]),                        # view (15, 129): ragged blocks
    ((4, 8, 2048), [None, Blocks(8, 512), Blocks(24, 1024)]),     # lane-dense view (64, 1024)
]
CASES = [(shape, block) for shape, blocks in SHAPES_AND_BLOCKS for block in blocks]

# Jitted so that every seed reuses one compile per configuration.
sample = jax.jit(sampling.sample, static_argnames=(
    "shape", "distribution", "dtype", "p", "impl", "interpret", "blocks"))


def uniform(seed, shape, **options):
    return sample(key_data(seed), shape=shape, distribution="uniform", interpret=True, **options)


def test_threefry_is_jax_default():
    assert jax.config.jax_threefry_partitionable, "the noise contract assumes partitionable threefry"
    assert jax.config.jax_default_prng_impl == "threefry2x32"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,blocks", CASES)
def test_uniform_bit_exact(seed, shape, blocks):
    got = uniform(seed, shape, blocks=blocks)
    np.testing.assert_array_equal(as_bits(got), as_bits(jax.random.uniform(jax_key(seed), shape)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_low_precision_bit_exact(distribution, dtype):
    seed, shape = SEEDS[2], (20, 300)
    reference = getattr(jax.random, distribution)(jax_key(seed), shape, dtype)
    for blocks in (None, Blocks(8, 128)):
        got = sample(key_data(seed), shape=shape, distribution=distribution, dtype=dtype,
                     interpret=True, blocks=blocks)
        assert got.dtype == dtype
        np.testing.assert_array_equal(as_bits(got), as_bits(reference))


@pytest.mark.parametrize("seed", SEEDS[1:3])
@pytest.mark.parametrize("shape,blocks", CASES)
def test_normal_float32_within_four_ulps(seed, shape, blocks):
    # The uniform draw is exact; XLA's CPU erf_inv may round its last bits differently
    # depending on how the loop around it is vectorized (see prng.normal_from_bits).
    got = sample(key_data(seed), shape=shape, distribution="normal", interpret=True, blocks=blocks)
    reference = jax.random.normal(jax_key(seed), shape)
    assert ulp_distance(got, reference) <= 4  # measured: at most 3, on ~0.5% of elements
    assert np.mean(np.asarray(got) != np.asarray(reference)) < 0.01 if got.size else True


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_bernoulli_bit_exact(p):
    seed, shape = SEEDS[2], (20, 300)
    got = sample(key_data(seed), shape=shape, distribution="bernoulli", p=p, interpret=True, blocks=Blocks(8, 128))
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.random.bernoulli(jax_key(seed), p, shape)))


@pytest.mark.parametrize("shape,blocks", [((20, 300), (8, 128)), ((4, 8, 2048), (8, 512))])
def test_grid_order_does_not_change_numbers(shape, blocks):
    seed = SEEDS[1]
    row_major = uniform(seed, shape, blocks=Blocks(*blocks))
    column_major = uniform(seed, shape, blocks=Blocks(*blocks, column_major_grid=True))
    np.testing.assert_array_equal(as_bits(row_major), as_bits(column_major))
    np.testing.assert_array_equal(as_bits(row_major), as_bits(jax.random.uniform(jax_key(seed), shape)))


def test_empty_shape_gives_empty_array():
    assert uniform(0, (0, 5)).shape == (0, 5)


def test_different_seeds_give_different_numbers():
    a = uniform(SEEDS[2], (7,))
    b = uniform(SEEDS[2] - 2**63, (7,))  # only the high word differs
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="distribution"):
        sampling.sample(key_data(0), (4,), distribution="gamma", interpret=True)
    with pytest.raises(ValueError, match="impl"):
        sampling.uniform(key_data(0), (4,), impl="philox", interpret=True)
    with pytest.raises(ValueError, match="threefry"):
        sampling.uniform(key_data(0), (4,), impl="hardware", interpret=True)
    with pytest.raises(ValueError, match="blocks"):
        sampling.uniform(key_data(0), (64, 1024), interpret=False, blocks=Blocks(3, 100))
    with pytest.raises(ValueError, match="Mosaic"):  # the same rule in interpret mode
        sampling.uniform(key_data(0), (64, 1024), interpret=True, blocks=Blocks(3, 100))
    with pytest.raises(ValueError, match="1x2147483649 matrix.*int32"):  # docs/limits.md, Sizes, compiles and layouts
        sampling.uniform(key_data(0), (2**31 + 1,), interpret=True)


# A shard of a sharded tensor: (global shape, shards per dim, blocks). Split rows (one
# contiguous run), columns (a row stride), both, and the middle and last dims of a 3-D
# tensor (the kernel's outer grid axis), with forced blocks that do not divide the shard.
SHARDED = [((16, 256), (4, 1), None), ((16, 256), (1, 4), None), ((16, 256), (2, 2), None),
           ((8, 12, 256), (1, 2, 2), None), ((8, 12, 256), (2, 1, 2), Blocks(8, 128)),
           ((6, 4, 8, 256), (1, 2, 1, 2), Blocks(8, 128, True))]
sample_shard = jax.jit(sampling.sample, static_argnames=(
    "shape", "distribution", "interpret", "blocks", "global_shape"))


def shards(global_shape, tiles, shared_over_first_dim=False):
    """``(index, shard shape, shard_offset, slices of the whole)`` for every shard of a tensor
    of ``global_shape`` split into ``tiles`` per dim, its offset as the kernels take it."""
    shard = tuple(size // count for size, count in zip(global_shape, tiles))
    strides = [int(np.prod(global_shape[d + 1:])) for d in range(len(global_shape))]
    if shared_over_first_dim:
        strides[0] = 0
    for index in np.ndindex(*tiles):
        start = [i * size for i, size in zip(index, shard)]
        offset = offset_words(sum(s * stride for s, stride in zip(start, strides)))
        yield index, shard, offset, tuple(slice(s, s + size) for s, size in zip(start, shard))


@pytest.mark.parametrize("global_shape,tiles,blocks", SHARDED)
def test_every_shard_holds_its_part_of_the_unsharded_numbers(global_shape, tiles, blocks):
    seed = SEEDS[3]
    expected = np.asarray(jax.random.uniform(jax_key(seed), global_shape))
    for index, shard, offset, part in shards(global_shape, tiles):
        got = sample_shard(key_data(seed), shape=shard, distribution="uniform", interpret=True, blocks=blocks,
                           global_shape=global_shape, shard_offset=offset)
        np.testing.assert_array_equal(as_bits(got), as_bits(expected[part]), err_msg=str(index))


def part_of(start, shard):
    return tuple(slice(s, s + size) for s, size in zip(start, shard))


def flat_index(start, global_shape):
    return sum(s * int(np.prod(global_shape[d + 1:])) for d, s in enumerate(start))


# Shards of tensors of 2**32 elements and more, whose indices need the counter's high word:
# (global shape, shard shape, the shard's first element, blocks). A (2**19 + 8, 8192) tensor
# has 2**32 + 2**16 elements, 2**32 being row 2**19.
BEYOND_2_32 = {
    "just below": ((2**19 + 8, 8192), (8, 8192), (2**19 - 8, 0), None),
    "across": ((2**19 + 8, 8192), (8, 8192), (2**19 - 4, 0), Blocks(8, 1024)),
    "past": ((2**19 + 8, 8192), (8, 8192), (2**19, 0), None),
    "past 2**33": ((2**20 + 16, 8192), (8, 8192), (2**20 + 4, 0), None),
    # A split along columns (a row stride): rows below and past 2**32 in one block.
    "columns across": ((2**19 + 8, 8192), (16, 1024), (2**19 - 8, 2048), None),
    # Three dims (the kernel's outer grid axis), the outer stride carrying past 2**32.
    "outer axis": ((5, 2**18, 4096), (5, 8, 1024), (0, 2**18 - 8, 1024), Blocks(8, 512, True)),
    # Offsets within one block too large for one word: a row stride of 2**30, and of 2**32 + 128.
    "wide block": ((16, 2**30), (16, 256), (0, 2**30 - 256), None),
    "row stride past 2**32": ((4, 2**32 + 128), (4, 256), (0, 2**32 - 128), None),
}
sample_beyond = jax.jit(sampling.sample, static_argnames=(
    "shape", "distribution", "dtype", "p", "interpret", "blocks", "global_shape"))


@covered_on_the_newest_jax
@pytest.mark.parametrize("case", list(BEYOND_2_32))
def test_shards_past_2_32_elements_hold_jax_random_numbers(case):
    global_shape, shard, start, blocks = BEYOND_2_32[case]
    seed, offset = SEEDS[2], offset_words(flat_index(start, global_shape))
    for distribution, dtype in [("uniform", jnp.float32), ("uniform", jnp.bfloat16), ("bernoulli", jnp.float32)]:
        got = sample_beyond(key_data(seed), shape=shard, distribution=distribution, dtype=dtype, p=0.3,
                            interpret=True, blocks=blocks, global_shape=global_shape, shard_offset=offset)
        if distribution == "uniform":
            draw = lambda key: jax.random.uniform(key, global_shape, dtype)  # noqa: E731
        else:
            draw = lambda key: jax.random.bernoulli(key, 0.3, global_shape)  # noqa: E731
        expected = jax_random_part(draw, jax_key(seed), part_of(start, shard))
        np.testing.assert_array_equal(as_bits(got), as_bits(expected), err_msg=f"{distribution} {dtype.__name__}")


def test_jax_random_part_is_jax_random():
    # The reference above: jax.random itself, computed only where sliced.
    key, part = jax_key(SEEDS[3]), (slice(5, 9), slice(250, 300))
    for draw in (lambda k: jax.random.uniform(k, (20, 300), jnp.bfloat16), lambda k: jax.random.bits(k, (20, 300))):
        np.testing.assert_array_equal(as_bits(jax_random_part(draw, key, part)), as_bits(draw(key)[part]))


def test_wide_arithmetic_is_64_bit_arithmetic():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**32, 1000, dtype=np.uint64)
    x[:4] = [0, 1, 2**32 - 1, 2**31]
    for constant in (0, 1, 3, 4096, 0xFFFF, 0x10001, 2**31 + 11, 2**32 - 1, 2**32, 2**32 + 128, 2**64 - 1):
        high, low = prng.multiply_wide(jnp.asarray(x, jnp.uint32), constant)
        product = x.astype(object) * constant % 2**64
        np.testing.assert_array_equal(np.asarray(high, np.uint64) << np.uint64(32) | np.asarray(low, np.uint64),
                                      product.astype(np.uint64), err_msg=str(constant))
    y = rng.integers(0, 2**64, 1000, dtype=np.uint64)

    def words(v):
        return jnp.asarray(v >> np.uint64(32), jnp.uint32), jnp.asarray(v & np.uint64(2**32 - 1), jnp.uint32)
    high, low = prng.add_wide(words(x << np.uint64(20)), words(y))
    np.testing.assert_array_equal(np.asarray(high, np.uint64) << np.uint64(32) | np.asarray(low, np.uint64),
                                  (x << np.uint64(20)) + y)
    high, low = prng.minus_word(words(y), jnp.asarray(x, jnp.uint32))
    np.testing.assert_array_equal(np.asarray(high, np.uint64) << np.uint64(32) | np.asarray(low, np.uint64), y - x)
    for divisor in (1, 2, 3, 1000, 2**14, 65536 * 3, 2**31 - 1, 2**31):
        np.testing.assert_array_equal(np.asarray(prng.remainder_wide(words(y), divisor), np.uint64),
                                      y % np.uint64(divisor), err_msg=str(divisor))
    with pytest.raises(ValueError, match=r"divisor must be in \[1, 2\*\*31\]"):
        prng.remainder_wide(words(y), 2**31 + 1)


def test_index_dims_merge_what_a_stride_allows():
    from torch_pallas.kernels.elementwise import index_dims
    assert index_dims((16, 256), (16, 256)) == [(4096, 1)]
    assert index_dims((4, 256), (16, 256)) == [(1024, 1)]
    assert index_dims((16, 64), (16, 256)) == [(16, 256), (64, 1)]
    assert index_dims((8, 6, 128), (8, 12, 256)) == [(8, 3072), (6, 256), (128, 1)]
    assert index_dims((5, 7), (5, 7), shared_over_first_dim=True) == [(5, 0), (7, 1)]
    assert index_dims((5, 1), (5, 1), shared_over_first_dim=True) == [(5, 0), (1, 1)]


def test_shards_the_kernel_cannot_follow_are_refused():
    # Three split dims besides the first need four strides.
    with pytest.raises(ValueError, match="at most two split dims"):
        sampling.uniform(key_data(0), (2, 2, 2, 128), interpret=True, global_shape=(2, 4, 4, 256),
                         shard_offset=np.zeros(2, np.int32))


def as_int32(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.int32)


# (global shape, shards per dim, shared over the first dim, blocks of the whole and the shard).
HARDWARE_SHARDED = [
    ((256, 1024), (4, 1), False, None),                    # view (256, 1024), (64, 1024) tiles: one band a shard
    ((6, 64, 2048), (2, 1, 1), False, Blocks(128, 1024)),  # view (384, 2048), (64, 1024) tiles: 3 bands per shard
    ((3, 64, 1024), (3, 1, 1), False, Blocks(64, 1024)),   # view (192, 1024), (64, 1024) tiles: a band a shard
    ((5, 8, 256), (1, 2, 1), True, None),                  # one mask row of 2048, (8, 1024) tiles: 1 per shard
    ((4, 2, 256), (2, 1, 1), True, Blocks(8, 512)),        # split over the shared dim: the whole mask row, one tile
]


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl", ["hardware", "tiled"])
@pytest.mark.parametrize("global_shape,tiles,shared,blocks", HARDWARE_SHARDED)
def test_per_tile_shards_draw_the_tiles_of_the_whole_tensor(emulated_hardware_prng, global_shape, tiles,
                                                             shared, blocks, impl):
    noise = functools.partial(elementwise.noise_map, jnp.asarray(key_data(5)), transform=as_int32,
                              out_dtype=jnp.int32, impl=impl, interpret=True, blocks=blocks,
                              shared_over_first_dim=shared)
    expected = np.asarray(noise(global_shape))
    if impl == "tiled" and not shared:
        np.testing.assert_array_equal(expected.view(np.uint32), tiled_bits(5, global_shape))
    for index, shard, offset, part in shards(global_shape, tiles, shared):
        got = noise(shard, global_shape=global_shape, shard_offset=offset)
        np.testing.assert_array_equal(np.asarray(got), expected[part], err_msg=str(index))
    drawn = expected[0] if shared else expected
    assert len(np.unique(drawn)) > drawn.size // 2  # distinct tiles, not one repeated


# Shards that are not whole bands of their tensor's noise, drawn in the bands that cover them:
# (global shape, shared over the first dim, each shard's (first element, shape), blocks).
COVERED = {
    # view (64, 256), one (64, 256) tile: a quarter of its one band each (the case)
    "rows of a band": ((64, 256), False, [((16 * i, 0), (16, 256)) for i in range(4)], None),
    # a (16, 1024) tile: each shard a column run per row (16 runs)
    "columns": ((16, 1024), False, [((0, 256 * i), (16, 256)) for i in range(4)], None),
    # view (128, 256), (128, 256) tiles: past 16 runs a shard's span is drawn in one call
    "many runs": ((128, 256), False, [((0, 0), (128, 128)), ((0, 128), (128, 128))], None),
    # a sequence split: 4 runs per shard, at places in the band the offset decides
    "sequence": ((4, 24, 256), False, [((0, 0, 0), (4, 12, 256)), ((0, 12, 0), (4, 12, 256))], None),
    # torch's uneven chunks (DTensor): 10 rows as 4, 4 and 2, of (64, 1024) tiles' one band
    "uneven rows": ((10, 1024), False, [((0, 0), (4, 1024)), ((4, 0), (4, 1024)), ((8, 0), (2, 1024))], None),
    # one shared mask row of 2048, (8, 1024) tiles: halves of tiles, for each of the 5 rows
    "shared row split": ((5, 8, 256), True, [((0, 0, 0), (5, 8, 64)), ((0, 0, 64), (5, 8, 64))], None),
    # a one-row view: 1000 elements in (8, 1024) tiles, split in three
    "one row": ((1000,), False, [((0,), (400,)), ((400,), (400,)), ((800,), (200,))], None),
}


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl", ["hardware", "tiled"])
@pytest.mark.parametrize("case", COVERED)
def test_per_tile_shards_that_are_not_whole_bands_draw_the_tiles_of_the_whole_tensor(emulated_hardware_prng,
                                                                                     case, impl):
    global_shape, shared, parts, blocks = COVERED[case]
    noise = functools.partial(elementwise.noise_map, jnp.asarray(key_data(5)), transform=as_int32,
                              out_dtype=jnp.int32, impl=impl, interpret=True, blocks=blocks,
                              shared_over_first_dim=shared)
    expected = np.asarray(noise(global_shape))
    strides = [0 if shared and d == 0 else int(np.prod(global_shape[d + 1:])) for d in range(len(global_shape))]
    for start, shard in parts:
        assert not elementwise.draws_whole_bands(shard, global_shape, shared)
        offset = offset_words(sum(s * stride for s, stride in zip(start, strides)))
        got = noise(shard, global_shape=global_shape, shard_offset=offset)
        np.testing.assert_array_equal(np.asarray(got), expected[part_of(start, shard)], err_msg=str(start))


def test_per_tile_shards_of_whole_bands_at_a_band_are_drawn_as_they_are():
    assert elementwise.draws_whole_bands((64, 1024), (256, 1024))  # (64, 1024) tiles: one band
    assert not elementwise.draws_whole_bands((32, 1024), (256, 1024))  # half a band
    assert not elementwise.draws_whole_bands((64, 512), (256, 1024))  # runs of half a row
    assert not elementwise.draws_whole_bands((128, 1024), (192, 1024))  # 2 bands of an uneven split


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl", ["hardware", "tiled"])
def test_per_tile_noise_of_a_tensor_xla_holds_swapped_is_the_swapped_tensors(emulated_hardware_prng, impl):
    """docs/noise.md, The generators: (16, 13, 256) is drawn as (13, 16, 256)'s rows, XLA's
    layout of it on TPU, not as its own (208, 256) rows."""
    noise = functools.partial(elementwise.noise_map, jnp.asarray(key_data(7)), transform=as_int32,
                              out_dtype=jnp.int32, impl=impl, interpret=True)
    got = np.asarray(noise((16, 13, 256)))
    np.testing.assert_array_equal(got, np.asarray(noise((13, 16, 256))).swapaxes(0, 1))
    assert not np.array_equal(got.reshape(208, 256), np.asarray(noise((208, 256))))


@covered_on_the_newest_jax
@pytest.mark.parametrize("impl", ["hardware", "tiled"])
def test_per_tile_shards_of_a_tensor_xla_holds_swapped_draw_their_part_of_the_swapped_tensors(
        emulated_hardware_prng, impl):
    global_shape = (16, 13, 256)  # seen as (13, 16, 256)
    noise = functools.partial(elementwise.noise_map, jnp.asarray(key_data(7)), transform=as_int32,
                              out_dtype=jnp.int32, impl=impl, interpret=True)
    expected = np.asarray(noise(global_shape))
    for start, shard in [((8, 0, 0), (8, 13, 256)), ((0, 0, 128), (16, 13, 128)), ((8, 4, 0), (4, 9, 256))]:
        got = noise(shard, global_shape=global_shape, shard_offset=offset_words(flat_index(start, global_shape)))
        np.testing.assert_array_equal(np.asarray(got), expected[part_of(start, shard)], err_msg=str(start))


def test_swapped_offset_is_the_index_in_the_swapped_tensor():
    rng = np.random.default_rng(0)
    for global_shape in [(16, 13, 256), (2**14, 3, 2**17), (24, 2**20 + 1, 2, 3)]:
        for _ in range(20):
            start = [int(rng.integers(size)) for size in global_shape]
            swapped_shape = (global_shape[1], global_shape[0], *global_shape[2:])
            swapped_start = [start[1], start[0], *start[2:]]
            got = elementwise._swapped_offset(jnp.asarray(offset_words(flat_index(start, global_shape))), global_shape)
            np.testing.assert_array_equal(np.asarray(got), offset_words(flat_index(swapped_start, swapped_shape)))


@covered_on_the_newest_jax
@pytest.mark.parametrize("shape,blocks", [((256, 1024), [Blocks(64, 1024), Blocks(128, 1024, True), Blocks(256, 1024)]),
                                          ((13, 300), [Blocks(16, 128), Blocks(16, 256, True)]),
                                          ((3, 5, 700), [Blocks(16, 256), Blocks(16, 768, True)]),
                                          ((6, 1000, 128), [Blocks(512, 128), Blocks(1024, 128, True)])],
                         ids=["large tiles", "ragged", "last dim", "last tile row cut"])
def test_hardware_noise_is_the_same_for_every_block_of_whole_tiles(emulated_hardware_prng, shape, blocks):
    noise = functools.partial(elementwise.noise_map, jnp.asarray(key_data(7)), shape, as_int32, jnp.int32,
                              impl="hardware", interpret=True)
    expected = np.asarray(noise())
    assert len(np.unique(expected)) > expected.size // 2
    for block in blocks:
        np.testing.assert_array_equal(np.asarray(noise(blocks=block)), expected, err_msg=str(block))


def test_hardware_noise_of_a_cut_last_tile_row_is_its_tiles_drawn_whole(emulated_hardware_prng):
    """docs/noise.md, The generators: a (6000, 128) view's (512, 128) tiles numbered row-major, the
    last tile row's 368 rows those of its tile drawn whole; no block is padded in HBM."""
    shape = (6, 1000, 128)
    got = np.asarray(elementwise.noise_map(jnp.asarray(key_data(7)), shape, as_int32, jnp.int32, impl="hardware",
                                           interpret=True, blocks=Blocks(1024, 128))).reshape(6000, 128)
    hardware_key = np.asarray(prng.hardware_key_data(jnp.asarray(key_data(7))))
    tiles = [np.asarray(emulated_hardware_tile_bits(hardware_key, np.int32(i), (512, 128))) for i in range(12)]
    np.testing.assert_array_equal(got, np.concatenate(tiles).view(np.int32)[:6000])


def test_hardware_blocks_that_are_not_whole_seed_tiles_are_refused():
    with pytest.raises(ValueError, match=r"whole \(64, 1024\) tiles for impl='hardware'"):
        elementwise.noise_map(jnp.asarray(key_data(0)), (256, 1024), as_int32, jnp.int32, impl="hardware",
                              interpret=False, blocks=Blocks(8, 128))


@pytest.mark.parametrize("global_cols,one_row", [(1024, False), (200, False), (384, False), (3 * 2**30, False),
                                                 (1024, True), (2**32 + 1024, True)])
def test_first_tile_of_a_shard_is_its_tile_index_past_2_32_elements(global_cols, one_row):
    # A shard starts a whole band of the view (one-row view: a whole tile); the tile index
    # wraps modulo 2**32 as the int32 arithmetic of JAX's sample_block does. (8, 128) seed
    # tiles: the band's odd factors are what the exact division has to handle.
    step = tiling.LANES if one_row else global_cols * tiling.SUBLANES
    tiles_per_band = -(-global_cols // tiling.LANES)
    for multiple in (0, 1, 5, 2**20 + 3, 2**25 + 7, 2**31 - 1, 2**33 + 1):
        offset = multiple * step
        if offset >= 2**64:
            continue
        expected = (offset // tiling.LANES if one_row else multiple * tiles_per_band) % 2**32
        got = elementwise._first_tile(jnp.asarray(offset_words(offset)), global_cols, one_row, tiling.TILE)
        assert int(np.asarray(got).view(np.uint32)[0]) == expected, offset


def test_tiled_shard_past_2_32_elements_draws_its_tiles():
    # As below: the shards at elements 2**32 and 2**32 + 2**16 are (64, 1024) tiles 2**16 and 2**16 + 1.
    key = tiled_seed_key(5)
    for tile in range(2):
        got = elementwise.noise_map(jnp.asarray(key_data(5)), (64, 1024), as_int32, jnp.int32, impl="tiled",
                                    interpret=True, global_shape=(2**22 + 128, 1024),
                                    shard_offset=offset_words(2**32 + tile * 2**16), uniform_bits=16)
        expected = numpy_tiled_tile(key, 2**16 + tile, (64, 1024), 16)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32) & np.uint32(0xFFFF0000), expected)


def test_hardware_shard_past_2_32_elements_draws_its_tiles(emulated_hardware_prng):
    # (2**22 + 128, 1024) is seeded in (64, 1024) tiles: the shards at rows 2**22 and
    # 2**22 + 64 (elements 2**32 and 2**32 + 2**16) are one tile each, numbered 2**16 and 2**16 + 1.
    global_shape, shard = (2**22 + 128, 1024), (64, 1024)
    hardware_key = prng.hardware_key_data(jnp.asarray(key_data(5)))
    for tile in range(2):
        got = elementwise.noise_map(jnp.asarray(key_data(5)), shard, as_int32, jnp.int32, impl="hardware",
                                    interpret=True, global_shape=global_shape,
                                    shard_offset=offset_words(2**32 + tile * 2**16))
        bits = emulated_hardware_tile_bits(hardware_key, np.int32(2**16 + tile), (64, 1024))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(as_int32(bits)).reshape(shard))
