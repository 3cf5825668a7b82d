"""Random bits inside Pallas kernels, and their conversion to uniform, normal and Bernoulli.

Two generators, chosen by ``impl``:

``"threefry"``
    Threefry-2x32 (20 rounds) on each element's global row-major index, written in plain
    uint32 ``jnp`` operations so it lowers on Mosaic (TPU), in interpret mode (CPU) and on
    Triton (GPU). Element ``i`` of a tensor of shape ``S`` gets exactly the bits that
    ``jax.random`` gives it with ``jax_threefry_partitionable`` (JAX's default): the two
    threefry output words of the counter ``(i >> 32, i & 0xFFFFFFFF)`` (the 64-bit index as
    two words), xor-ed. A block at any offset can therefore compute its part of the global
    noise, whatever the block size or grid order. Mosaic has no 64-bit integers, so indices
    past 2**32 are carried in uint32 word pairs (:func:`block_counter`).

``"hardware"``
    The TPU's hardware PRNG, reseeded for every tile of the 2-D view (up to (64, 1024):
    :func:`tiling.hardware_tile`) exactly as ``pltpu.sample_block`` seeds it with that
    ``tile_size`` and a key from ``pltpu.to_pallas_key``: the Pallas key is
    ``jax.random.bits(key, (1, 2), uint32)`` (:func:`hardware_key_data`), a tile's key is
    its ``fold_in`` of the row-major tile index (:func:`tile_seed`), ``prng_seed`` gets
    those two words and the tile's bits are ``prng_random_bits(tile)``. So the noise is the
    same for every block made of whole tiles, and what a JAX user's ``sample_block`` draws
    with that tile on the same TPU. TPU only; not threefry's bits.

``"tiled"``
    The hardware impl's tiles, each filled by Threefry-2x32 with 13 rounds
    (:func:`tiled_tile_bits`) in plain uint32 ``jnp`` operations: the same tile structure
    (block invariance, tile numbering, shards), and the same bits in interpret mode on CPU and
    compiled on every TPU generation. One hash gives 64 bits, which fill two elements with 32
    bits each (sampling), or four with 16 (dropout's keep test, :data:`DROPOUT_BITS`): about a
    fifth of threefry's work per element of a mask. Its key is a full-strength mix of the call's
    key words (:func:`tiled_key_words`). Not ``jax.random``'s bits.

Everything here runs inside a kernel body. Key data arrives as two int32 words in SMEM (the
form it crosses the torch/JAX boundary in) and is reinterpreted as uint32 here.
"""

from __future__ import annotations

import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments, tiling

THREEFRY = "threefry"
HARDWARE = "hardware"
TILED = "tiled"
IMPLS = (THREEFRY, HARDWARE, TILED)
# The impl of each kind of op called without one. Masks (dropout and every op built on it) draw
# with the tiled impl: the same bits on every device, and the fast one that does (libtpu's
# schedule: bench/results/tpu_cost.md, tpu_step.md). Samples draw with threefry: being
# jax.random's bits is what uniform/normal/bernoulli are for.
DROPOUT_DEFAULT = TILED
SAMPLING_DEFAULT = THREEFRY
# The impls whose noise is drawn per tile of the 2-D view (tiling.hardware_tile, and per batch
# plane attention.attention_tile): kernels walk blocks of whole tiles for both.
PER_TILE_IMPLS = (HARDWARE, TILED)
# Bits of each element's uniform that dropout's keep test reads: the tiled impl then packs four
# elements in one 64-bit hash, and ``p`` takes steps of 2**-16 (:func:`drop_threshold`). The
# other impls draw 32 bits an element whatever the consumer reads.
DROPOUT_BITS = 16
TILED_ROUNDS = 13
# Each generator's work per element of noise, integer work that kernels count as flops in
# their cost estimates (XLA's cost analysis counts every elementwise op, integer ones too, as
# a flop): threefry's 20 rounds of an add, a rotation (two shifts and an or) and a xor, its 5
# key injections of two adds, the counter and the final xor, 113 (what XLA counts for the same
# jnp ops outside a kernel); the hardware PRNG's one instruction per vreg of bits, 1 (a tile's
# seeding is scalar work); the tiled impl's hash (13 rounds, 3 injections, its counter) shared by
# the elements one hash fills, plus the shifts that place 16-bit uniforms.
_NOISE_OPS = {THREEFRY: 113, HARDWARE: 1}
_TILED_HASH_OPS = 5 * TILED_ROUNDS + 2 * (TILED_ROUNDS // 4) + 3

# The fixed key of the tiled impl's key mix (:func:`tiled_key_words`): Random123's known-answer
# key (digits of pi), so that the mix of one seed is a published answer (tests/kernels/test_tiled.py).
TILED_KEY_MIX = (np.uint32(0x13198A2E), np.uint32(0x03707344))

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_SCHEDULE_PARITY = np.uint32(0x1BD11BDA)
_FLOAT32_ONE_BITS = np.uint32(0x3F800000)


def check_impl(impl: str, name: str = "impl") -> str:
    return arguments.check_one_of(name, impl, IMPLS)


def per_tile(impl: str) -> bool:
    """Whether ``impl`` draws its noise per tile (:data:`PER_TILE_IMPLS`)."""
    return impl in PER_TILE_IMPLS


def noise_ops(impl: str, uniform_bits: int = 32) -> int:
    """Integer ops per element of noise of ``impl`` whose consumer reads ``uniform_bits`` bits
    of it, for the kernels' cost estimates (the tiled impl's full four- or two-part layout)."""
    if impl != TILED:
        return _NOISE_OPS[impl]
    per_hash = 64 // uniform_bits
    return math.ceil((_TILED_HASH_OPS + (per_hash // 2 if uniform_bits < 32 else 0)) / per_hash)


def check_can_run(impl: str, interpret: bool) -> None:
    """Raises ValueError for an unknown ``impl``, or ``"hardware"`` in interpret mode (the
    hardware PRNG has no CPU rule, and TPU interpret mode makes it zeros)."""
    check_impl(impl)
    if impl == HARDWARE and interpret:
        raise ValueError('impl="hardware" runs only compiled on TPU; use impl="threefry" in interpret mode')


def read_key(key_data_ref) -> tuple[jax.Array, jax.Array]:
    """The two key words from an SMEM ref of int32 shape (2,), as uint32 scalars."""
    return key_data_ref[0].astype(jnp.uint32), key_data_ref[1].astype(jnp.uint32)


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
    """32-bit rotation, for uint32 (threefry's vectors) and int32 (the tile seeds' scalars)."""
    dtype = jnp.dtype(x.dtype).type
    return lax.shift_left(x, dtype(distance)) | lax.shift_right_logical(x, dtype(32 - distance))


def threefry2x32(k0, k1, x0, x1, rounds: int = 20) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with ``rounds`` rounds (Random123's ``threefry2x32_R``): 20 is the block
    cipher behind ``jax.random``'s default PRNG, 13 the tiled impl's.

    ``k0, k1`` are uint32 key words (scalars), ``x0, x1`` uint32 counter words (arrays, or
    scalars). The key is injected after every fourth round. Returns the two uint32 output words.
    """
    k2 = k0 ^ k1 ^ _KEY_SCHEDULE_PARITY
    schedule = (k0, k1, k2)
    x0 = x0 + k0
    x1 = x1 + k1
    for round_index in range(rounds):
        x0 = x0 + x1
        x1 = _rotate_left(x1, _ROTATIONS[round_index // 4 % 2][round_index % 4])
        x1 = x0 ^ x1
        if round_index % 4 == 3:
            injection = round_index // 4 + 1
            x0 = x0 + schedule[injection % 3]
            # Grouped so that the constant joins the scalar key word: one vector add, not two.
            x1 = x1 + (schedule[(injection + 1) % 3] + np.uint32(injection))
    return x0, x1


def threefry_bits(k0, k1, low_word: jax.Array, high_word: jax.Array | None = None) -> jax.Array:
    """32 random bits per element, bit-identical to partitionable ``jax.random.bits``.

    The counter of element ``i`` is its 64-bit row-major index in the whole tensor, as the
    uint32 words ``high_word`` (``i >> 32``; ``None`` where it is 0 for every element, as in
    any tensor of at most 2**32 elements) and ``low_word`` (``i & 0xFFFFFFFF``).
    """
    y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(low_word) if high_word is None else high_word, low_word)
    return y0 ^ y1


def add_wide(a, b) -> tuple[jax.Array, jax.Array]:
    """``a + b`` modulo 2**64 for (high, low) pairs of uint32 words (scalars or arrays)."""
    low = a[1] + b[1]
    high = a[0] + b[0]
    # Unsigned wrap-around: the low sum is below an addend exactly when it carried.
    return jnp.where(low < a[1], high + np.uint32(1), high), low


def minus_word(a, x) -> tuple[jax.Array, jax.Array]:
    """``a - x`` modulo 2**64 for a (high, low) pair ``a`` and a uint32 ``x``."""
    return jnp.where(a[1] < x, a[0] - np.uint32(1), a[0]), a[1] - x


def remainder_wide(a, divisor: int) -> jax.Array:
    """uint32 ``(high * 2**32 + low) % divisor`` for a (high, low) pair ``a`` of uint32 words
    and a static ``divisor`` in [1, 2**31]: long division in digits of as many bits as keep
    ``remainder * 2**bits + digit`` within a word (Mosaic and XLA on TPU have no 64-bit
    integers)."""
    if not 1 <= divisor <= 2**31:
        raise ValueError(f"divisor must be in [1, 2**31], got {divisor}")
    remainder = jnp.zeros_like(jnp.asarray(a[1]))
    if divisor == 1:
        return remainder
    digit_bits = 32 - (divisor - 1).bit_length()  # a remainder has (divisor - 1)'s bits at most
    for word in a:
        for end in range(32, 0, -digit_bits):
            width = min(digit_bits, end)
            digit = (word >> np.uint32(end - width)) & np.uint32(2**width - 1)
            remainder = ((remainder << np.uint32(width)) | digit) % np.uint32(divisor)
    return remainder


def exact_quotient_word(a, divisor: int) -> jax.Array:
    """The low uint32 word of ``(high * 2**32 + low) / divisor`` for a (high, low) pair ``a``
    that a static ``divisor`` divides: a shift by the divisor's power of two, then a
    multiplication by its odd factor's inverse modulo 2**32 (exact in the low word). A shard's
    first tile and a row of a swapped tensor's offset are such quotients."""
    high, low = a
    shift = (divisor & -divisor).bit_length() - 1
    if shift == 0:
        shifted = low
    elif shift < 32:
        shifted = low >> np.uint32(shift) | high << np.uint32(32 - shift)
    else:
        shifted = high >> np.uint32(shift - 32)
    return shifted * np.uint32(pow(divisor >> shift, -1, 2**32))


def multiply_wide(x: jax.Array, constant: int) -> tuple[jax.Array, jax.Array]:
    """(high, low) words of ``x * constant`` modulo 2**64, for uint32 ``x`` (scalar or array)
    and a static ``constant`` in [0, 2**64)."""
    constant_low, constant_high = constant & 0xFFFFFFFF, constant >> 32 & 0xFFFFFFFF
    high = _multiply_high(x, constant_low)
    if constant_high:
        high = high + x * np.uint32(constant_high)
    return high, x * np.uint32(constant_low)


def _multiply_high(x: jax.Array, constant: int) -> jax.Array:
    """The high word of the 64-bit product of uint32 ``x`` and a static ``constant`` below
    2**32, from 16-bit halves whose products fit one word (Mosaic has no 64-bit integers)."""
    if constant & (constant - 1) == 0:  # 0 or a power of two: a shift
        shift = constant.bit_length() - 1
        return x >> np.uint32(32 - shift) if shift > 0 else jnp.zeros_like(x)
    half = np.uint32(0xFFFF)
    x_low, x_high = x & half, x >> np.uint32(16)
    c_low, c_high = np.uint32(constant & 0xFFFF), np.uint32(constant >> 16)
    low_high, high_low = x_low * c_high, x_high * c_low
    middle = (x_low * c_low >> np.uint32(16)) + (low_high & half) + (high_low & half)
    return (x_high * c_high + (low_high >> np.uint32(16)) + (high_low >> np.uint32(16))
            + (middle >> np.uint32(16)))


def fold_in(key_data: jax.Array, data: int) -> jax.Array:
    """int32 (2,) data of ``jax.random.fold_in(key, data)`` for threefry key data: the two
    threefry output words of the counter ``(0, data)``."""
    words = lax.bitcast_convert_type(key_data, jnp.uint32)
    y0, y1 = threefry2x32(words[0], words[1], np.uint32(0), np.uint32(data))
    return lax.bitcast_convert_type(jnp.stack([y0, y1]), jnp.int32)


def block_flat_index(chunk_shape: tuple[int, int], row0, col0, row_stride: int, base=None) -> jax.Array:
    """uint32 global flat indices of a (rows, cols) block at (row0, col0) of a 2-D view whose
    rows are ``row_stride`` apart (its width, for a whole tensor) and whose element (0, 0)
    has index ``base`` (a uint32 scalar; ``None``: 0). Every index below 2**32."""
    rows = lax.broadcasted_iota(jnp.uint32, chunk_shape, 0) + lax.convert_element_type(row0, jnp.uint32)
    cols = lax.broadcasted_iota(jnp.uint32, chunk_shape, 1) + lax.convert_element_type(col0, jnp.uint32)
    if base is not None:
        # Added to the scalar first: one vector add.
        cols = cols + base
    return rows * np.uint32(row_stride) + cols


def block_counter(chunk_shape: tuple[int, int], row0, col0, row_stride: int,
                  base=None) -> tuple[jax.Array, jax.Array]:
    """(high, low) uint32 words of the 64-bit global flat indices of a block, for indices that
    may reach 2**32: :func:`block_flat_index` with ``row_stride`` any static int below
    2**64 and ``base`` a (high, low) pair of uint32 scalars (``None``: 0).

    The block's first index is computed in scalar word pairs; the offsets within the block
    are one uint32 vector when they fit one word (then the carry into the high word is one
    compare), else word pairs too.
    """
    origin = add_wide(multiply_wide(lax.convert_element_type(row0, jnp.uint32), row_stride),
                      (np.uint32(0), lax.convert_element_type(col0, jnp.uint32)))
    if base is not None:
        origin = add_wide(origin, base)
    rows = lax.broadcasted_iota(jnp.uint32, chunk_shape, 0)
    cols = lax.broadcasted_iota(jnp.uint32, chunk_shape, 1)
    if chunk_shape[0] == 1:
        return add_wide(origin, (np.uint32(0), cols))
    if (chunk_shape[0] - 1) * row_stride + chunk_shape[1] - 1 < 2**32:
        return add_wide(origin, (np.uint32(0), rows * np.uint32(row_stride) + cols))
    return add_wide(origin, add_wide(multiply_wide(rows, row_stride), (jnp.zeros_like(cols), cols)))


def hardware_key_data(key_data: jax.Array) -> jax.Array:
    """int32 (2,) data of ``pltpu.to_pallas_key(key)``, i.e. ``jax.random.bits(key, (1, 2),
    uint32)``: threefry's bits for counters 0 and 1. Computed outside the kernel."""
    words = lax.bitcast_convert_type(key_data, jnp.uint32)
    bits = threefry_bits(words[0], words[1], jnp.arange(2, dtype=jnp.uint32))
    return lax.bitcast_convert_type(bits, jnp.int32)


def tile_seed(hardware_key0, hardware_key1, tile_index):
    """The two int32 words ``prng_seed`` gets for a tile: the Pallas key's ``fold_in`` of the
    tile index (JAX's ``pallas_tpu`` impl: ``key1 += index``, then one threefry round with
    rotation 13). Plain integer arithmetic, so it is tested on CPU against JAX's own."""
    key1 = hardware_key1 + tile_index
    key0 = hardware_key0 + key1
    return key0, _rotate_left(key1, 13) ^ key0


def tile_index(row0, col0, num_cols: int, tile: tuple[int, int]):
    """Row-major index of the ``tile``-shaped tile at element (row0, col0) of a view
    ``num_cols`` wide (whole tiles), as ``sample_block`` numbers tiles."""
    return row0 // tile[0] * (num_cols // tile[1]) + col0 // tile[1]


def hardware_tile_bits(hardware_key_ref, tile_index, tile: tuple[int, int]) -> jax.Array:
    """uint32 bits of one ``tile`` from the TPU hardware PRNG, seeded for that tile.
    Compiled Mosaic kernels only: the hardware PRNG has no CPU rule."""
    pltpu.prng_seed(*tile_seed(hardware_key_ref[0], hardware_key_ref[1], tile_index))
    return pltpu.bitcast(pltpu.prng_random_bits(tile), jnp.uint32)


def tiled_layout(tile: tuple[int, int], uniform_bits: int = 32) -> tuple[int, int]:
    """``(parts, axis)``: how :func:`tiled_tile_bits` fills a ``tile`` from one grid of hashes,
    a rule of the tile's shape alone (the one place it is stated).

    One hash has two 32-bit words, so it fills ``parts`` = 2 elements with 32 bits, 4 with 16
    (``uniform_bits``), or 8 with 8 (a candidate of bench/tpu_cost_noise_candidates.py: no op
    draws 8-bit uniforms). The tile is cut into ``parts`` equal slabs along ``axis``, so that
    placing them is a concatenation of whole vregs that Mosaic lays out: rows (0) in slabs of
    whole 8-row sublanes, except where the rows do not divide into them and the lanes divide
    into whole 128-lane vregs, lanes (1). Rows that do not divide are rounded up to a multiple
    of ``8 * parts`` first (:func:`tiled_grid`): the rows past the tile are drawn and not used,
    which hashes fewer positions than filling fewer parts per hash would (a (200, 256) tile:
    four slabs of 56 rows, 224 drawn, 56 x 256 hashes, not 200 x 128 with two 16-bit parts).
    The hash grid is one slab's shape.
    """
    rows, cols = tile
    parts = 64 // uniform_bits
    if rows % (tiling.SUBLANES * parts) and cols % (tiling.LANES * parts) == 0:
        return parts, 1
    return parts, 0


def tiled_grid(tile: tuple[int, int], uniform_bits: int = 32) -> tuple[int, int]:
    """The shape of the grid of hashes that fills a ``tile`` (one slab of :func:`tiled_layout`;
    along rows, of the tile's rows rounded up to whole sublanes in every slab)."""
    parts, axis = tiled_layout(tile, uniform_bits)
    if axis == 1:
        return tile[0], tile[1] // parts
    return tiling.round_up(tile[0], tiling.SUBLANES * parts) // parts, tile[1]


def _position_counter(grid: tuple[int, int], first_row: int = 0) -> jax.Array:
    """uint32 row-major positions of the rows of a ``grid`` of hashes from ``first_row`` on (a
    power-of-two width: a shift, as multiplies are emulated on v4)."""
    rows, cols = (lax.broadcasted_iota(jnp.uint32, grid, d) for d in (0, 1))
    if not isinstance(first_row, int) or first_row:
        rows = rows + lax.convert_element_type(first_row, jnp.uint32)
    width = grid[1]
    if width & (width - 1) == 0:
        return lax.shift_left(rows, np.uint32(width.bit_length() - 1)) | cols
    return rows * np.uint32(width) + cols


def tiled_tile_bits(key_data_ref, tile_index, tile: tuple[int, int], uniform_bits: int = 32) -> jax.Array:
    """uint32 bits of one ``tile`` of the tiled impl: Threefry-2x32 with 13 rounds keyed by
    the call's :func:`tiled_key_words` (which ``key_data_ref`` holds), whose counter is
    ``(tile_index, position)`` for each position of the hash grid that :func:`tiled_layout` gives the tile. The grid's words fill
    its slabs in order: for 32 bits word 0 then word 1; for 16 bits word 0's low half, its high
    half, word 1's low half, its high half (for 8, each word's bytes, the lowest first); slabs along rows are cut to the tile's rows. An element's
    uniform is the top ``uniform_bits`` of its bits (the low 16 of a 16-bit element's are not
    random: ``bits >> 16`` is its uniform)."""
    slabs = tiled_slabs(key_data_ref, tile_index, tile, uniform_bits)
    return jnp.concatenate(slabs, axis=tiled_layout(tile, uniform_bits)[1])[:tile[0]]


def tiled_slabs(key_data_ref, tile_index, tile: tuple[int, int], uniform_bits: int = 32, first_row=0,
                rows: int | None = None) -> tuple[jax.Array, ...]:
    """The slabs :func:`tiled_tile_bits` concatenates, each cut to the hash grid's ``rows`` rows
    from ``first_row`` (an int or a traced scalar; all of them by default): a kernel can walk a
    tile a few rows of its grid at a time, each then giving a piece of each slab."""
    k0, k1 = read_key(key_data_ref)
    grid = list(tiled_grid(tile, uniform_bits))
    if rows is not None:
        grid[0] = rows
    # A tile index wraps modulo 2**32 as int32 arithmetic does; the conversion keeps its bits (as
    # read_key's does: Mosaic bitcasts vectors only).
    counter0 = lax.convert_element_type(tile_index, jnp.uint32)
    y0, y1 = threefry2x32(k0, k1, counter0, _position_counter(tuple(grid), first_row), rounds=TILED_ROUNDS)
    # Each uniform_bits-bit part of a word goes to the top, where the consumer reads it, by one
    # shift, the lowest part first; the highest is there already.
    per_word = 32 // uniform_bits
    return tuple(word << np.uint32(32 - uniform_bits * (part + 1)) if part < per_word - 1 else word
                 for word in (y0, y1) for part in range(per_word))


def tile_bits(impl: str, key_data_ref, tile_index, tile: tuple[int, int], uniform_bits: int = 32) -> jax.Array:
    """uint32 bits of one ``tile`` of a per-tile impl (:data:`PER_TILE_IMPLS`): ``key_data_ref``
    holds :func:`key_words`: :func:`hardware_key_data` for ``"hardware"``, :func:`tiled_key_words` for ``"tiled"``."""
    if impl == HARDWARE:
        return hardware_tile_bits(key_data_ref, tile_index, tile)
    return tiled_tile_bits(key_data_ref, tile_index, tile, uniform_bits)


def tiled_key_words(key_data: jax.Array) -> jax.Array:
    """int32 (2,) key words of the tiled impl's hash for threefry key data: Threefry-2x32 with 20
    rounds of the key data as the counter, under the fixed key :data:`TILED_KEY_MIX`.

    The hash's key is added to its counter before its first round, so keyed by the seed's words
    themselves, seed s + 1 at position p and seed s at p + 1 (s + 2**32 and the next tile, s ^ 2**k
    and 2**k positions on) would run their first rounds alike and differ only through the later
    key injections: their streams interleaved failed PractRand at 2**32 bytes. Through a block
    cipher at full strength, related seeds give unrelated keys. Scalar work, once per call."""
    words = lax.bitcast_convert_type(key_data, jnp.uint32)
    mixed = threefry2x32(*TILED_KEY_MIX, words[0], words[1])
    return lax.bitcast_convert_type(jnp.stack(mixed), jnp.int32)


def key_words(key_data: jax.Array, impl: str) -> jax.Array:
    """The int32 (2,) key words a kernel of ``impl`` reads: :func:`hardware_key_data` for the
    hardware PRNG, :func:`tiled_key_words` for the tiled impl, the threefry key data itself for
    threefry (``jax.random``'s, whose 20 rounds leave related keys unrelated). Computed outside
    the kernel."""
    if impl == HARDWARE:
        return hardware_key_data(key_data)
    return tiled_key_words(key_data) if impl == TILED else key_data


def chunk_bits(impl: str, key_data_ref, chunk_shape, row0, col0, row_stride: int, base=None,
               wide: bool = False, uniform_bits: int = 32) -> jax.Array:
    """uint32 random bits for the (rows, cols) chunk at position (row0, col0) of a 2-D view.

    ``row_stride`` and ``base``: see :func:`block_flat_index`, or with ``wide`` (a tensor
    whose indices reach 2**32) :func:`block_counter`. For ``impl="hardware"`` the view is
    padded to whole tiles, ``row_stride`` its width, the chunk one tile (the seed tile) at a
    tile's position, ``base`` (int32) the index of the view's first tile in the whole
    tensor's view, and ``key_data_ref`` holds :func:`hardware_key_data`; the same for
    ``impl="tiled"`` with :func:`tiled_key_words`, whose tiles hold ``uniform_bits``-bit
    uniforms (:func:`tiled_tile_bits`).
    """
    if impl == THREEFRY:
        k0, k1 = read_key(key_data_ref)
        if wide:
            high, low = block_counter(chunk_shape, row0, col0, row_stride, base)
            return threefry_bits(k0, k1, low, high)
        return threefry_bits(k0, k1, block_flat_index(chunk_shape, row0, col0, row_stride, base))
    index = tile_index(row0, col0, row_stride, chunk_shape)
    return tile_bits(impl, key_data_ref, index if base is None else index + base, chunk_shape, uniform_bits)


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
    """``jax.random.normal(key, shape, dtype)`` from its random bits."""
    return normal_from_uniform(uniform_from_bits(bits, dtype))


def normal_from_uniform(uniform: jax.Array) -> jax.Array:
    """``jax.random.normal`` from ``jax.random.uniform``'s numbers in the same dtype.

    JAX maps a uniform on (-1, 1) through ``sqrt(2) * erfinv``; the arithmetic is done in
    the uniform's dtype as JAX does it, so bfloat16 and float16 roundings match too. The
    float32 ``erf_inv`` may differ from an XLA-computed reference by a few ulps (3 seen):
    XLA's CPU compiler rounds its polynomial differently depending on how the surrounding
    loop is vectorized.
    """
    dtype = uniform.dtype
    lo = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype), dtype=dtype)
    span = np.array(1.0, dtype) - lo
    u = jnp.maximum(lo, uniform * span + lo)
    # XLA evaluates a 16-bit erf_inv in float32 and rounds; Mosaic has no 16-bit erf_inv.
    return np.array(np.sqrt(2), dtype) * lax.erf_inv(u.astype(jnp.float32)).astype(dtype)


def bernoulli_from_bits(bits: jax.Array, probability_of_true) -> jax.Array:
    """``jax.random.bernoulli(key, probability_of_true, shape)`` from its random bits.

    True where the float32 uniform is below ``probability_of_true`` (a float32), as in JAX.
    That uniform is exactly ``(bits >> 9) * 2**-23``, so with a static probability the test
    is the integer ``bits >> 9 < ceil(probability * 2**23)``, that is ``bits <
    ceil(probability * 2**23) * 2**9``: the same mask in one vector op.
    """
    if isinstance(probability_of_true, jax.core.Tracer):
        return unit_uniform(bits, jnp.float32) < probability_of_true
    threshold = math.ceil(float(np.float32(probability_of_true)) * 2.0**23)  # exact: 24-bit mantissa
    if threshold >= 2**23:  # every uniform is below 1
        return jnp.ones(bits.shape, jnp.bool_)
    return bits < np.uint32(threshold << 9)


def drop_threshold(p: float) -> int:
    """The tiled impl's dropout threshold ``t``, ``p * 2**16`` rounded to the nearest integer
    (halves up): an element is dropped where its 16-bit uniform is below ``t``, so ``p`` takes
    steps of 2**-16, ``p == 0`` keeps every element and ``p == 1`` none."""
    return math.floor(p * 2**DROPOUT_BITS + 0.5)


def keep_fraction(impl: str, p: float) -> float:
    """The probability that dropout of ``impl`` keeps an element, exactly: ``1 - p``, or for
    ``impl="tiled"`` the keep probability its 16-bit threshold actually gives, ``(2**16 - t) /
    2**16`` (exact in float32 too)."""
    if impl == TILED:
        return (2**DROPOUT_BITS - drop_threshold(p)) / 2**DROPOUT_BITS
    return 1.0 - p


def keep_probability(impl: str, p: float) -> np.float32:
    """:func:`keep_fraction` in float32, which the kept values are divided by so that the output
    is unbiased (``float32(1 - p)`` is also the threshold ``jax.random.bernoulli`` computes)."""
    return np.float32(keep_fraction(impl, p))


def kept(impl: str, bits: jax.Array, keep_probability) -> jax.Array:
    """bool: where dropout of ``impl`` with :func:`keep_probability` ``keep_probability`` keeps
    an element, from its bits (for ``impl="tiled"`` drawn with :data:`DROPOUT_BITS`: kept where
    its uniform ``bits >> 16`` is at least ``t``, tested as ``bits >= t << 16`` in one op)."""
    if impl != TILED:
        return bernoulli_from_bits(bits, keep_probability)
    threshold = 2**DROPOUT_BITS - round(float(keep_probability) * 2**DROPOUT_BITS)
    if threshold == 2**DROPOUT_BITS:
        return jnp.zeros(bits.shape, jnp.bool_)
    return bits >= np.uint32(threshold << (32 - DROPOUT_BITS))
