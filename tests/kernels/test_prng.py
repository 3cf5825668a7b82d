"""The threefry core against JAX's own implementation and the published test vector; the
hardware PRNG's per-tile seeds against JAX's sample_block and to_pallas_key."""

import itertools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax._src import blocked_sampler
from jax._src.pallas.mosaic import random as pallas_random
from jax.experimental.pallas import tpu as pltpu
from jax.extend import random as jax_extend_random

from reference import SEEDS, jax_key, key_data
from torch_pallas.kernels import prng, tiling


def test_threefry2x32_known_answer():
    # Random123's known-answer test for threefry2x32_20 with key and counter all ones.
    ones = np.uint32(0xFFFFFFFF)
    y0, y1 = prng.threefry2x32(ones, ones, jnp.array([ones]), jnp.array([ones]))
    assert (int(y0[0]), int(y1[0])) == (0x1CB996FC, 0xBB002BE7)


def test_threefry2x32_matches_jax():
    rng = np.random.default_rng(0)
    k0, k1 = (np.uint32(v) for v in rng.integers(0, 2**32, 2))
    x0, x1 = (rng.integers(0, 2**32, 1000).astype(np.uint32) for _ in range(2))
    ours = prng.threefry2x32(k0, k1, jnp.asarray(x0), jnp.asarray(x1))
    theirs = jax_extend_random.threefry_2x32(jnp.array([k0, k1]), jnp.concatenate([jnp.asarray(x0), jnp.asarray(x1)]))
    np.testing.assert_array_equal(np.concatenate([np.asarray(o) for o in ours]), np.asarray(theirs))


# --- Hardware PRNG seeds: plain integer arithmetic, checked against JAX's own functions ---

@pytest.mark.parametrize("seed", SEEDS)
def test_hardware_key_is_to_pallas_key(seed):
    ours = np.asarray(prng.hardware_key_data(jnp.asarray(key_data(seed)))).view(np.uint32)
    theirs = np.asarray(jax.random.key_data(pltpu.to_pallas_key(jax_key(seed)))).reshape(-1)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("seed", SEEDS)
def test_tile_seed_is_pallas_fold_in(seed, monkeypatch):
    # JAX's pallas_tpu fold_in runs only inside a kernel (its key wrap/unwrap primitives have
    # no CPU rule); with those two made plain tuples, JAX's own arithmetic runs here.
    monkeypatch.setattr(pallas_random, "unwrap_pallas_seed", lambda words: words)
    monkeypatch.setattr(pallas_random, "wrap_pallas_seed", lambda *words, impl: words)
    hardware_key = prng.hardware_key_data(jnp.asarray(key_data(seed)))
    indices = jnp.array([0, 1, 7, 2**20 + 3, 2**31 + 5, 2**32 - 1], dtype=jnp.uint32)
    ours = prng.tile_seed(hardware_key[0], hardware_key[1], indices.view(jnp.int32))
    theirs = pallas_random._fold_in(tuple(hardware_key.view(jnp.uint32)), indices)
    for our_word, their_word in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(our_word).view(np.uint32), np.asarray(their_word))


@pytest.mark.parametrize("total,block,tile", [
    ((16, 512), (16, 256), (8, 128)), ((16, 512), (8, 128), (8, 128)), ((64, 1024), (32, 512), (8, 128)),
    ((24, 384), (24, 128), (8, 128)), ((256, 3072), (128, 2048), (64, 1024)), ((256, 3072), (64, 1024), (64, 1024)),
    ((48, 1152), (48, 384), (16, 128))])
def test_tile_index_is_sample_blocks(total, block, tile):
    tiles_per_block = (block[0] // tile[0], block[1] // tile[1])
    tiles_in_total = (total[0] // tile[0], total[1] // tile[1])
    for block_row, block_col in itertools.product(range(total[0] // block[0]), range(total[1] // block[1])):
        for r, c in itertools.product(*map(range, tiles_per_block)):
            theirs = blocked_sampler._compute_tile_index((block_row, block_col), tiles_per_block, tiles_in_total, (r, c))
            row0, col0 = block_row * block[0] + r * tile[0], block_col * block[1] + c * tile[1]
            assert prng.tile_index(row0, col0, total[1], tile) == theirs


@pytest.mark.parametrize("shape,view", [
    ((32, 197, 768), (6304, 768)), ((8, 512, 2048), (4096, 2048)), ((2**22,), (4096, 1024)),
    ((4, 768), (3, 1024)), ((2, 3, 256), (3, 512)), ((13, 300), (13, 300)), ((1000,), (1, 1000)), ((7,), (1, 7))])
def test_view_is_the_tensors_own_rows_when_they_are_whole_lanes(shape, view):
    """docs/noise.md, The generators: the 2-D view the hardware impl's seed tiles cover."""
    assert tiling.view_2d(shape) == view


@pytest.mark.parametrize("shape,swapped", [
    ((32, 197, 768), True), ((8, 13, 256), True), ((32, 200, 768), False), ((4, 197, 768), False),
    ((32, 197, 100), False), ((32, 197), False), ((2, 32, 197, 768), False)])
def test_first_dims_are_swapped_where_xla_lays_the_batch_in_the_sublanes(shape, swapped):
    """docs/noise.md, The generators: the per-tile impls' view of a (B, L, C) tensor with L off
    whole sublanes and B on them is (L, B, C)'s rows."""
    assert tiling.first_dims_swapped(shape) == swapped


@pytest.mark.parametrize("view,tile", [
    ((4096, 1024), (64, 1024)), ((16, 1024), (16, 1024)), ((1, 1000), (8, 1024)), ((13, 300), (16, 128)),
    ((20, 300), (24, 128)), ((2, 3072), (8, 1024)), ((100, 384), (104, 128)), ((2048, 128), (512, 128)),
    ((1, 7), (8, 128)), ((6304, 768), (256, 256)), ((4160, 1024), (64, 1024))])
def test_hardware_tile_is_every_row_or_the_most_rows_within_65536_elements(view, tile):
    """docs/noise.md, The generators: the seed tiles it names."""
    assert tiling.hardware_tile(*view) == tile
