"""Random bits inside Pallas kernels, and their conversion to uniform, normal and Bernoulli.

Two generators, chosen by ``impl``:

``"threefry"``
    Threefry-2x32 (20 rounds) on each element's global row-major index, written in plain
    uint32 ``jnp`` operations so it lowers on Mosaic (TPU), in interpret mode (CPU) and on
    Triton (GPU). Element ``i`` of a tensor of shape ``S`` gets exactly the bits that
    ``jax.random`` gives it with ``jax_threefry_partitionable`` (JAX's default): the two
    threefry output words of the counter ``(0, i)``, xor-ed. A block at any offset can
    therefore compute its part of the global noise, whatever the block size or grid order.

``"hardware"``
    The TPU's hardware PRNG, reseeded for every (8, 128) tile of the 2-D view from the key
    and the tile's global index (the scheme of ``pltpu.sample_block``), so the noise is the
    same for every block made of whole tiles. TPU only; its bits differ from threefry's.

Everything here runs inside a kernel body. Key data arrives as two int32 words in SMEM (the
form it crosses the torch/JAX boundary in) and is reinterpreted as uint32 here.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments
from torch_pallas.kernels.tiling import TILE

THREEFRY = "threefry"
HARDWARE = "hardware"
IMPLS = (THREEFRY, HARDWARE)

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_SCHEDULE_PARITY = np.uint32(0x1BD11BDA)
_FLOAT32_ONE_BITS = np.uint32(0x3F800000)


def check_impl(impl: str) -> str:
    return arguments.check_one_of("impl", impl, IMPLS)


def read_key(key_data_ref) -> tuple[jax.Array, jax.Array]:
    """The two key words from an SMEM ref of int32 shape (2,), as uint32 scalars."""
    return key_data_ref[0].astype(jnp.uint32), key_data_ref[1].astype(jnp.uint32)


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
    return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds: the block cipher behind ``jax.random``'s default PRNG.

    ``k0, k1`` are uint32 key words (scalars), ``x0, x1`` uint32 counter words (arrays).
    Returns the two uint32 output words.
    """
    k2 = k0 ^ k1 ^ _KEY_SCHEDULE_PARITY
    schedule = (k0, k1, k2)
    x0 = x0 + k0
    x1 = x1 + k1
    for injection in range(5):
        for rotation in _ROTATIONS[injection % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, rotation)
            x1 = x0 ^ x1
        x0 = x0 + schedule[(injection + 1) % 3]
        x1 = x1 + schedule[(injection + 2) % 3] + np.uint32(injection + 1)
    return x0, x1


def threefry_bits(k0, k1, flat_index: jax.Array) -> jax.Array:
    """32 random bits per element, bit-identical to partitionable ``jax.random.bits``.

    ``flat_index`` holds each element's uint32 row-major index in the whole tensor; the high
    counter word is zero because tensors are limited to fewer than 2**32 elements.
    """
    y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(flat_index), flat_index)
    return y0 ^ y1


def block_flat_index(chunk_shape: tuple[int, int], row0, col0, num_cols: int) -> jax.Array:
    """uint32 global row-major indices of a (rows, cols) block at (row0, col0)."""
    rows = lax.broadcasted_iota(jnp.uint32, chunk_shape, 0) + lax.convert_element_type(row0, jnp.uint32)
    cols = lax.broadcasted_iota(jnp.uint32, chunk_shape, 1) + lax.convert_element_type(col0, jnp.uint32)
    return rows * np.uint32(num_cols) + cols


def hardware_bits(key_data_ref, chunk_shape, tile_row0, tile_col0, num_tile_cols: int):
    """32 random bits per element of a chunk from the TPU hardware PRNG, reseeded per tile.

    Each tile is seeded with the key words and its global row-major tile index, so its
    bits do not depend on the block or chunk it was generated in. ``tile_row0, tile_col0``
    are the chunk's position in tiles. Runs only in compiled Mosaic kernels: the hardware
    PRNG has no CPU rule.
    """
    tile_rows, tile_cols = TILE
    rows = []
    for r in range(chunk_shape[0] // tile_rows):
        row = []
        for c in range(chunk_shape[1] // tile_cols):
            tile_index = (tile_row0 + r) * num_tile_cols + (tile_col0 + c)
            pltpu.prng_seed(key_data_ref[0], key_data_ref[1], tile_index)
            row.append(pltpu.bitcast(pltpu.prng_random_bits(TILE), jnp.uint32))
        rows.append(row[0] if len(row) == 1 else jnp.concatenate(row, axis=1))
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)


def chunk_bits(impl: str, key_data_ref, chunk_shape, row0, col0, num_cols: int) -> jax.Array:
    """uint32 random bits for the (rows, cols) chunk at global position (row0, col0).

    ``num_cols`` is the width of the whole 2-D view. For ``impl="hardware"`` the chunk and
    its position must be whole tiles.
    """
    if impl == THREEFRY:
        k0, k1 = read_key(key_data_ref)
        return threefry_bits(k0, k1, block_flat_index(chunk_shape, row0, col0, num_cols))
    tile_rows, tile_cols = TILE
    return hardware_bits(key_data_ref, chunk_shape, row0 // tile_rows, col0 // tile_cols, -(-num_cols // tile_cols))


def unit_uniform(bits: jax.Array, dtype) -> jax.Array:
    """float32 values in [0, 1), exactly those of ``jax.random.uniform(key, shape, dtype)``.

    JAX draws ``nbits`` random bits per element (8 for bfloat16, 16 for float16, 32 for
    float32), keeps the top ``nmant`` of them as the mantissa of a float in [1, 2) and
    subtracts 1. Building that float in float32 gives a value exactly representable in
    ``dtype``, so the cast the caller makes afterwards is exact, and the kernel never needs
    16-bit integer or float arithmetic (which older TPUs lack).
    """
    finfo = jnp.finfo(dtype)
    rng_bits = finfo.bits if finfo.nmant >= 8 else 8
    if rng_bits < 32:
        bits = bits & np.uint32((1 << rng_bits) - 1)
    mantissa = bits >> np.uint32(rng_bits - finfo.nmant)
    float_bits = (mantissa << np.uint32(23 - finfo.nmant)) | _FLOAT32_ONE_BITS
    return lax.bitcast_convert_type(float_bits, jnp.float32) - np.float32(1.0)


def uniform_from_bits(bits: jax.Array, dtype) -> jax.Array:
    """``jax.random.uniform(key, shape, dtype)`` (range [0, 1)) from its random bits."""
    return unit_uniform(bits, dtype).astype(dtype)


def normal_from_bits(bits: jax.Array, dtype) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)`` from its random bits.

    JAX maps a uniform on (-1, 1) through ``sqrt(2) * erfinv``; the arithmetic is done in
    ``dtype`` as JAX does it, so bfloat16 and float16 roundings match too. The float32
    ``erf_inv`` may differ from an XLA-computed reference by a few ulps (3 seen): XLA's CPU compiler
    rounds its polynomial differently depending on how the surrounding loop is vectorized.
    """
    dtype = jnp.dtype(dtype)
    lo = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype), dtype=dtype)
    span = np.array(1.0, dtype) - lo
    floats = unit_uniform(bits, dtype).astype(dtype)
    u = jnp.maximum(lo, floats * span + lo)
    # XLA evaluates a 16-bit erf_inv in float32 and rounds; Mosaic has no 16-bit erf_inv.
    return np.array(np.sqrt(2), dtype) * lax.erf_inv(u.astype(jnp.float32)).astype(dtype)


def bernoulli_from_bits(bits: jax.Array, probability_of_true) -> jax.Array:
    """``jax.random.bernoulli(key, probability_of_true, shape)`` from its random bits.

    True where the float32 uniform is below ``probability_of_true`` (a float32), as in JAX.
    """
    return unit_uniform(bits, jnp.float32) < probability_of_true
