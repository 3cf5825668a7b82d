"""The tiled impl (docs/noise.md, The generators) against a NumPy reference written from its
specification (reference.numpy_tiled_tile): Random123's known answers for 13 rounds and for the
key mix's 20, related seeds' keys far apart, committed
golden values, the layout rule of each tile shape, and the kernels' bits and masks bit for bit
for ragged, 1-D, cut-last-tile-row and attention shapes under several blocks and grid orders,
forward and backward. Its shards: test_sampling.py's per-tile shard tests."""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from conftest import covered_on_the_newest_jax
from reference import (as_bits, attention_tiled_keep, key_data, numpy_threefry2x32, numpy_tiled_tile, tiled_bits,
                       tiled_drop_threshold, tiled_dropout, tiled_seed_key, ulp_distance)
from torch_pallas.kernels import attention, dropout, dropout_matmul, elementwise, prng, sampling
from torch_pallas.kernels.attention import AttentionBlocks as AttnBlocks
from torch_pallas.kernels.tiling import ElementwiseBlocks as Blocks

KEY = key_data(1234)

# Random123's tests/kat_vectors, the lines ``threefry2x32 13``: counter words, key words, output words.
THREEFRY13_KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x9D1C5EC6, 0x8BD50731)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0xFD36D048, 0x2D17272C)),
    ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344), (0xBA3E4725, 0xF27D669E)),
]

# Random123's tests/kat_vectors, the line ``threefry2x32 20`` of pi's digits: the key the mix
# uses, and seed 0x243F6A8885A308D3's words as the counter.
KEY_MIX_KNOWN_ANSWER = (0x243F6A8885A308D3, (0xC4923A9C, 0x483DF7A0))

# Row 0, columns 0-7 of the 32-bit bits of a (64, 1024) tensor (one (64, 1024) tile, index 0):
# word 0 of the hashes at positions 0-7. Changing them changes every user's tiled noise (they
# changed on 2026-12-02, when the hash's key became the mix of the seed's words).
GOLDEN = {
    0: [0x313C6C40, 0xF321CBFC, 0xFEC3BF31, 0x735DC53E, 0x639D574B, 0x09AD9982, 0xF65220F9, 0x0B9D5844],
    2**40 + 7: [0x409E6CC9, 0xC2E468AC, 0x38776698, 0x99F38808, 0x7F7F02EC, 0x2DEBC387, 0x01AF0392, 0xE4E30D28],
}


def raw_bits(shape, seed=1234, uniform_bits=32, **options):
    """The tiled impl's uint32 bits for a tensor of ``shape``, as a kernel draws them."""
    bits = elementwise.noise_map(jnp.asarray(key_data(seed)), shape, lambda b: jax.lax.bitcast_convert_type(b, jnp.int32),
                                 jnp.int32, impl="tiled", interpret=True, uniform_bits=uniform_bits, **options)
    return np.asarray(bits).view(np.uint32)


@pytest.mark.parametrize("counter,key,expected", THREEFRY13_KNOWN_ANSWERS)
def test_threefry_13_rounds_gives_random123s_known_answers(counter, key, expected):
    words = prng.threefry2x32(jnp.uint32(key[0]), jnp.uint32(key[1]), jnp.array([counter[0]], jnp.uint32),
                              jnp.array([counter[1]], jnp.uint32), rounds=13)
    assert tuple(int(w[0]) for w in words) == expected
    assert tuple(int(w[0]) for w in numpy_threefry2x32(key, [counter[0]], [counter[1]], 13)) == expected


def test_the_hash_is_keyed_by_threefry_20_of_the_seeds_words():
    seed, expected = KEY_MIX_KNOWN_ANSWER
    assert tuple(np.asarray(prng.tiled_key_words(jnp.asarray(key_data(seed)))).view(np.uint32)) == expected
    assert tuple(tiled_seed_key(seed)) == expected


def test_related_seeds_key_the_hash_with_unrelated_words():
    """Seeds users write side by side (s, s + 1, s + 2**32, s ^ 2**k for each of the 64 bits) get
    hash keys about 32 of 64 bits apart: none within 8 bits of another (6 standard deviations),
    where the seed's words themselves are 1 to 2 bits apart."""
    seed = 2**40 + 7
    related = sorted({seed, seed + 1, seed + 2**32, *(seed ^ 1 << k for k in range(64))})
    keys = np.stack([np.asarray(prng.tiled_key_words(jnp.asarray(key_data(s)))).view(np.uint32) for s in related])
    distances = [sum(bin(int(w)).count("1") for w in keys[i] ^ keys[j])
                 for i in range(len(related)) for j in range(i)]
    assert 8 <= min(distances) and max(distances) <= 56, (min(distances), max(distances))


@pytest.mark.parametrize("seed", GOLDEN)
def test_golden_values(seed):
    expected = np.array(GOLDEN[seed], np.uint32)
    np.testing.assert_array_equal(raw_bits((64, 1024), seed)[0, :8], expected)
    np.testing.assert_array_equal(numpy_tiled_tile(tiled_seed_key(seed), 0, (64, 1024), 32)[0, :8], expected)


@pytest.mark.parametrize("tile,uniform_bits,layout,grid", [
    ((64, 1024), 16, (4, 0), (16, 1024)), ((64, 1024), 32, (2, 0), (32, 1024)), ((32, 2048), 16, (4, 0), (8, 2048)),
    ((8, 1024), 16, (4, 1), (8, 256)), ((8, 1024), 32, (2, 1), (8, 512)),
    # Rows rounded up to whole sublanes per slab where the lanes do not divide: the extra rows drawn, unused.
    ((16, 128), 16, (4, 0), (8, 128)), ((200, 256), 16, (4, 0), (56, 256)), ((24, 128), 16, (4, 0), (8, 128)),
    ((8, 128), 32, (2, 0), (8, 128)), ((200, 256), 32, (2, 1), (200, 128))])
def test_layout_is_whole_vreg_slabs_of_the_tile(tile, uniform_bits, layout, grid):
    """docs/noise.md, The generators: rows in slabs of whole sublanes (rounded up), lanes in whole
    vregs where only they divide; every hash fills 64 // uniform_bits elements."""
    assert prng.tiled_layout(tile, uniform_bits) == layout
    assert prng.tiled_grid(tile, uniform_bits) == grid


# (shape, uniform bits, blocks to try: None is the default), the layout of the view's tile in the comment.
SHAPES = [
    ((256, 1024), 16, [None, Blocks(64, 1024), Blocks(128, 1024, True)]),  # (64, 1024): four row slabs per hash
    ((256, 1024), 32, [None, Blocks(128, 1024, True)]),                    # two row slabs
    ((256, 1024), 8, [None, Blocks(128, 1024, True)]),                     # eight row slabs (a bench's candidate)
    ((20, 300), 16, [Blocks(24, 128, True)]),                              # ragged, (24, 128): 32 rows drawn
    ((13, 300), 16, [None, Blocks(16, 256)]),                              # (16, 128): four slabs of 8 rows
    ((1000,), 16, [None]),                                                 # 1-D, (8, 1024): four lane slabs
    ((1000,), 32, [None]),                                                 # two lane slabs
    ((100, 1024), 16, [Blocks(64, 1024), Blocks(128, 1024, True)]),        # (64, 1024), the last tile row cut
    ((16, 13, 1024), 16, [None, Blocks(64, 1024), Blocks(128, 1024, True)]), # seen as (13, 16, 1024): (64, 1024) tiles
]


# Each tile hashed whole, and 8 hash-grid rows at a time (what jax 0.7.1's kernels compile for TPU:
# compat.TILED_HASH_IN_PIECES; in interpret mode only here).
@covered_on_the_newest_jax
@pytest.mark.parametrize("in_pieces", [False, True], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("shape,uniform_bits,blocks", SHAPES, ids=[f"{case[0]}-{case[1]}" for case in SHAPES])
def test_bits_are_the_references_for_every_block_of_whole_tiles(shape, uniform_bits, blocks, in_pieces):
    expected = tiled_bits(1234, shape, uniform_bits)
    mask = np.uint32(2**32 - 2**(32 - uniform_bits))  # the uniform's bits, the top ones
    assert len(np.unique(expected)) > min(expected.size, 2**uniform_bits) // 2
    for block in blocks:
        got = raw_bits(shape, uniform_bits=uniform_bits, blocks=block, tiled_hash_in_pieces=in_pieces)
        np.testing.assert_array_equal(got & mask, expected, err_msg=str(block))


@pytest.mark.parametrize("shape,p,blocks,dtype", [((256, 1024), 0.1, Blocks(128, 1024, True), jnp.float32),
                                                  ((256, 1024), 0.1, None, jnp.bfloat16),
                                                  ((1000,), 0.3, None, jnp.bfloat16)])
def test_dropout_is_the_references(shape, p, blocks, dtype):
    """Kept where the 16-bit uniform is at least round(p * 65536); kept values divided by the
    keep probability that threshold gives (to 1 ulp in float32: XLA's CPU compiler may multiply by
    the reciprocal, as for threefry). The backward pass is this function on the gradient."""
    x = jax.random.uniform(jax.random.key(0), shape, dtype, minval=0.5, maxval=2.0)  # no zeros: mask = (y != 0)
    got = dropout.dropout(jnp.asarray(KEY), x, p=p, impl="tiled", interpret=True, blocks=blocks)
    expected = tiled_dropout(1234, x, p)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got) != 0, np.asarray(expected) != 0)
    assert ulp_distance(np.asarray(got, np.float32), np.asarray(expected, np.float32)) <= (1 if dtype == jnp.float32 else 0)


def test_dropout_add_is_the_dropout_plus_the_residual():
    x, residual = (jax.random.normal(jax.random.key(i), (13, 300)) for i in range(2))
    got = dropout.dropout_add(jnp.asarray(KEY), x, residual, p=0.2, impl="tiled", interpret=True)
    expected = np.asarray(tiled_dropout(1234, x, 0.2)) + np.asarray(residual)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p,threshold,keep_probability", [
    (0.0, 0, 1.0), (0.1, 6554, 58982 / 65536), (0.5, 32768, 0.5), (2**-18, 0, 1.0), (1 - 2**-18, 65536, 0.0),
    (1.0, 65536, 0.0)])
def test_p_takes_steps_of_2_to_the_minus_16(p, threshold, keep_probability):
    assert prng.drop_threshold(p) == tiled_drop_threshold(p) == threshold
    assert prng.keep_probability("tiled", p) == np.float32(keep_probability)


def test_p_one_drops_everything_and_p_zero_nothing():
    x = jnp.full((64, 1024), 3.0)
    for p, expected in ((1.0, 0.0), (0.0, 3.0)):
        got = dropout.dropout(jnp.asarray(KEY), x, p=p, impl="tiled", interpret=True)
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_sampling_converts_32_bit_words_as_threefrys():
    """A float32 uniform gets 23 random mantissa bits: the top 23 of its element's word."""
    shape = (13, 300)
    bits = tiled_bits(1234, shape)
    uniform = sampling.uniform(jnp.asarray(KEY), shape, impl="tiled", interpret=True)
    expected = ((bits >> np.uint32(9)) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1.0)
    np.testing.assert_array_equal(as_bits(uniform), as_bits(expected))
    bernoulli = sampling.bernoulli(jnp.asarray(KEY), 0.3, shape, impl="tiled", interpret=True)
    np.testing.assert_array_equal(np.asarray(bernoulli), expected < np.float32(0.3))


def attention_mask(shape, dropout_p, head_dim=8, **options):
    """The forward kernel's output and mask of ``(*batch, L, S)`` weights (zero scores: every
    weight 1 / S, the value the identity, so the output is the kept weights), and the backward
    kernels' mask (the value's gradient against an identity output gradient is the kept weights
    transposed)."""
    *batch, L, S = shape
    zeros = jnp.zeros((*batch, L, head_dim)), jnp.zeros((*batch, S, head_dim))
    value = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32), (*batch, S, S))
    function = functools.partial(attention.attention, jnp.asarray(KEY), bias=None, dropout_p=dropout_p, impl="tiled",
                                 interpret=True, **options)
    out, pullback = jax.vjp(lambda v: function(zeros[0], zeros[1], v), value)
    (grad_value,) = pullback(jnp.broadcast_to(jnp.eye(L, S, dtype=jnp.float32), out.shape))
    return np.asarray(out), np.swapaxes(np.asarray(grad_value), -1, -2)[..., :L, :] > 0


@covered_on_the_newest_jax
@pytest.mark.parametrize("shape,blocks", [
    ((2, 2, 197, 197), [dict(blocks=AttnBlocks(197, 197, 1), backward_blocks=AttnBlocks(197, 197, 2))]),
    ((1, 1, 264, 300), [dict(blocks=AttnBlocks(16, 128), backward_blocks=AttnBlocks(8, 384))]),
    # head dim 128 = the value's S: the default runs heads_in_lanes's kernels
    ((2, 2, 64, 128), [dict(head_dim=128), dict(head_dim=128, blocks=AttnBlocks(64, 128))]),
], ids=["ViT planes", "several tiles", "heads in lanes"])
def test_attention_mask_is_the_references_forward_and_backward(shape, blocks):
    """Each plane in attention_tile tiles ((200, 256) for 197 x 197, cut, its hash grid's rows
    rounded up to 224; (8, 128) for 264 x 300), numbered on through the planes, whatever the
    blocks and planes per step; a kept weight is scaled by the keep probability the threshold gives."""
    expected = attention_tiled_keep(shape, 0.2)
    for options in blocks:
        out, backward = attention_mask(shape, 0.2, **options)
        np.testing.assert_array_equal(out > 0, expected, err_msg=str(options))
        np.testing.assert_array_equal(backward, expected, err_msg=str(options))
        np.testing.assert_allclose(out[expected], 1 / shape[-1] / prng.keep_probability("tiled", 0.2), rtol=1e-6)


def test_dropout_matmul_draws_the_attention_mask_forward_and_backward():
    shape = (2, 40, 300)
    weights, value = jnp.ones(shape), jnp.broadcast_to(jnp.eye(300), (2, 300, 300))
    out = dropout_matmul.dropout_matmul_forward(jnp.asarray(KEY), weights, value, p=0.25, impl="tiled", interpret=True)
    grad_weights, _ = dropout_matmul.dropout_matmul_backward(jnp.asarray(KEY), weights, value, jnp.ones((2, 40, 300)),
                                                             p=0.25, impl="tiled", interpret=True,
                                                             blocks=AttnBlocks(40, 128))
    expected = attention_tiled_keep(shape, 0.25)
    np.testing.assert_array_equal(np.asarray(out) > 0, expected)
    np.testing.assert_array_equal(np.asarray(grad_weights) > 0, expected)
    np.testing.assert_array_equal(np.asarray(out)[expected], np.float32(1 / prng.keep_probability("tiled", 0.25)))
