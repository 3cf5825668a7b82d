"""References the tests compare against: JAX keys for torch seeds, and bit comparisons."""

import numpy as np
import jax
import torch
import jax.numpy as jnp
try:
    from jax._src import prng as jax_prng
except ImportError:  # jax 0.10 moved threefry's primitive and lowering to jax._src.random
    from jax._src.random import threefry2x32 as jax_prng
from jax._src.interpreters import mlir

from torch_pallas.kernels import attention, prng, tiling

# Seeds with and without high bits: the high word must reach the key.
SEEDS = (0, 1234, 2**63 + 2**40 + 7, 2**64 - 1)


def key_data(seed: int) -> np.ndarray:
    """int32 (2,) key data for a 64-bit seed, as the noise contract defines it (docs/noise.md, Keys from seeds)."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32).view(np.int32)


def jax_key(seed: int):
    """``jax.random.key(seed)`` as it would be with x64 enabled."""
    return jax.random.wrap_key_data(jnp.asarray(key_data(seed).view(np.uint32)), impl="threefry2x32")


def offset_words(flat_index: int) -> np.ndarray:
    """A shard's offset as the kernels take it: int32 ``[high, low]`` words of the flat index."""
    return np.array([flat_index >> 32, flat_index & 0xFFFFFFFF], np.uint32).view(np.int32)


def jax_random_part(draw, key, part) -> np.ndarray:
    """``draw(key)[part]``, where ``draw`` is a ``jax.random`` call over a whole tensor too large
    to allocate (2**32 elements and more), computed at the sliced elements only.

    On CPU, JAX lowers threefry as a rolled loop over whole arrays, so XLA would compute every
    element; JAX's own unrolled lowering (the one it uses on TPU and GPU; the same function)
    lets XLA fuse the slice into the draw. Raises AssertionError if XLA would still allocate
    more than a MiB.
    """
    cpu_rules = mlir._platform_specific_lowerings["cpu"]
    rolled = cpu_rules[jax_prng.threefry2x32_p]
    mlir.register_lowering(jax_prng.threefry2x32_p, jax_prng._threefry2x32_lowering_rule, platform="cpu")
    try:
        compiled = jax.jit(lambda k: draw(k)[part]).lower(key).compile()
    finally:
        cpu_rules[jax_prng.threefry2x32_p] = rolled
    assert compiled.memory_analysis().temp_size_in_bytes < 2**20, "XLA would compute the whole tensor"
    return np.asarray(compiled(key))


def as_bits(array) -> np.ndarray:
    """The raw bytes of an array, to compare floats bit for bit (NaN and -0.0 included)."""
    array = np.ascontiguousarray(np.asarray(array))
    return array.view(np.uint8) if array.dtype != np.bool_ else array


def ulp_distance(a, b) -> int:
    """Largest distance in units in the last place between two float32 arrays."""
    a = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(a - b).max()) if a.size else 0


def indrnn_reference(x, weight, h0, nonlinearity):
    """The IndRNN recurrence in float64 NumPy: ``(output, h_n)``."""
    x, weight, h0 = (np.asarray(a, np.float64) for a in (x, weight, h0))
    activate = (lambda a: np.maximum(a, 0.0)) if nonlinearity == "relu" else np.tanh
    hidden, outputs = h0, []
    for x_t in x:
        hidden = activate(x_t + weight * hidden)
        outputs.append(hidden)
    output = np.stack(outputs) if outputs else np.zeros_like(x)
    return output, hidden


def indrnn_reference_gradients(output, weight, h0, grad_output, grad_h_n, nonlinearity):
    """Gradients ``(grad_x, grad_weight, grad_h0)`` of :func:`indrnn_reference`, in float64
    NumPy, by the chain rule written out step by step in reverse time."""
    output, weight, h0, grad_output, grad_h_n = (
        np.asarray(a, np.float64) for a in (output, weight, h0, grad_output, grad_h_n))
    grad_x = np.zeros_like(output)
    grad_weight = np.zeros_like(weight)
    grad_from_future = grad_h_n
    for t in reversed(range(output.shape[0])):
        derivative = (output[t] > 0).astype(np.float64) if nonlinearity == "relu" else 1.0 - output[t] ** 2
        grad_pre_activation = (grad_output[t] + grad_from_future) * derivative
        grad_x[t] = grad_pre_activation
        grad_weight += (grad_pre_activation * (output[t - 1] if t > 0 else h0)).sum(axis=0)
        grad_from_future = weight * grad_pre_activation
    return grad_x, grad_weight, grad_from_future


def indrnn_reference_with_lengths(x, weight, h0, lengths, grad_output, grad_h_n, nonlinearity):
    """``(output, h_n, grad_x, grad_weight, grad_h0)`` in float64 for rows that stop at their
    own lengths: each row is run alone over its first ``lengths[b]`` steps (as
    ``nn.RNN`` runs a packed sequence), outputs and input gradients past it are 0."""
    T, B, F = np.shape(x)
    results = [np.zeros((T, B, F)), np.zeros((B, F)), np.zeros((T, B, F)), np.zeros(F), np.zeros((B, F))]
    for b in range(B):
        steps = int(np.clip(lengths[b], 0, T))
        row = slice(b, b + 1)
        output, h_n = indrnn_reference(np.asarray(x)[:steps, row], weight, np.asarray(h0)[row], nonlinearity)
        grad_x, grad_weight, grad_h0 = indrnn_reference_gradients(
            output, weight, np.asarray(h0)[row], np.asarray(grad_output)[:steps, row], np.asarray(grad_h_n)[row],
            nonlinearity)
        results[0][:steps, row], results[1][row] = output, h_n
        results[2][:steps, row], results[4][row] = grad_x, grad_h0
        results[3] += grad_weight
    return tuple(results)


def emulated_hardware_tile_bits(hardware_key_ref, tile_index, tile):
    """A stand-in for the TPU's hardware PRNG, which cannot run on CPU: like it, a function of
    the two words ``prng_seed`` gets for the tile (here threefry of them over the tile)."""
    seed = [jax.lax.bitcast_convert_type(word, jnp.uint32)
            for word in prng.tile_seed(hardware_key_ref[0], hardware_key_ref[1], tile_index)]
    rows, cols = (jax.lax.broadcasted_iota(jnp.uint32, tile, d) for d in (0, 1))
    return prng.threefry_bits(*seed, rows * np.uint32(tile[1]) + cols)


def attention_threefry_keep(shape, dropout_p, seed=1234):
    """The threefry mask of ``(*batch, L, S)`` attention weights: jax.random.bernoulli's."""
    return np.asarray(jax.random.bernoulli(jax_key(seed), np.float32(1 - dropout_p), shape))


def attention_hardware_keep(shape, dropout_p, seed=1234):
    """The emulated hardware PRNG's mask of ``(*batch, L, S)`` attention weights: tile (i, j)
    of plane b gets the bits of tile index ``b * tiles_per_plane + i * tiles_per_row + j``
    (the plane padded to whole :func:`attention.attention_tile` tiles)."""
    *batch, L, S = shape
    tile = attention.attention_tile(L, S)
    rows, cols = -(-L // tile[0]), -(-S // tile[1])
    hardware_key = np.asarray(prng.hardware_key_data(jnp.asarray(key_data(seed))))
    planes = []
    for b in range(int(np.prod(batch))):
        plane = np.block([[np.asarray(emulated_hardware_tile_bits(hardware_key, np.int32((b * rows + i) * cols + j),
                                                                  tile)) for j in range(cols)] for i in range(rows)])
        planes.append(plane[:L, :S])
    bits = jnp.asarray(np.stack(planes).reshape(shape))
    return np.asarray(prng.bernoulli_from_bits(bits, np.float32(1 - dropout_p)))


def random_case(shape, weight_range=(0.0, 1.0), seed=0):
    """An IndRNN case in float64: x (T, B, F), weight (F,) in ``weight_range``, h0 (B, F), and
    incoming gradients of the output and of h_n."""
    T, B, F = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, F, generator=generator, dtype=torch.float64)
    low, high = weight_range
    weight = low + (high - low) * torch.rand(F, generator=generator, dtype=torch.float64)
    h0 = torch.randn(B, F, generator=generator, dtype=torch.float64)
    grad_output = torch.randn(T, B, F, generator=generator, dtype=torch.float64)
    grad_h_n = torch.randn(B, F, generator=generator, dtype=torch.float64)
    return x, weight, h0, grad_output, grad_h_n


# --- The tiled impl in NumPy, written from its specification (docs/noise.md, The generators),
# not from the kernels' code: Random123's Threefry-2x32-R, the layout rule and the tile numbering.

_THREEFRY_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)


def numpy_threefry2x32(key, x0, x1, rounds):
    """Random123's ``threefry2x32_R(rounds, counter=(x0, x1), key)`` over uint32 arrays."""
    k0, k1 = (np.uint32(k) for k in key)
    schedule = (k0, k1, np.uint32(k0 ^ k1 ^ np.uint32(0x1BD11BDA)))
    x0 = np.asarray(x0, np.uint32) + schedule[0]
    x1 = np.asarray(x1, np.uint32) + schedule[1]
    for r in range(rounds):
        x0 = x0 + x1
        distance = _THREEFRY_ROTATIONS[r % 8]
        x1 = ((x1 << np.uint32(distance)) | (x1 >> np.uint32(32 - distance))) ^ x0
        if r % 4 == 3:
            injection = r // 4 + 1
            x0 = x0 + schedule[injection % 3]
            x1 = x1 + schedule[(injection + 1) % 3] + np.uint32(injection)
    return x0, x1


# The fixed key of the tiled impl's key mix: Random123's known-answer key (docs/noise.md).
TILED_KEY_MIX = (0x13198A2E, 0x03707344)


def tiled_key(key_words) -> np.ndarray:
    """The tiled impl's hash key for a call's uint32 key words: Threefry-2x32-20 of them (as the
    counter) under :data:`TILED_KEY_MIX`."""
    k0, k1 = (np.asarray(word, np.uint32).reshape(1) for word in key_words)  # arrays: numpy wraps them silently
    return np.concatenate(numpy_threefry2x32(TILED_KEY_MIX, k0, k1, rounds=20))


def tiled_seed_key(seed: int) -> np.ndarray:
    """The tiled impl's hash key for ``seed``: :func:`tiled_key` of its key data."""
    return tiled_key(key_data(seed).view(np.uint32))


def tiled_hash(key, x0, x1):
    """The tiled impl's hash: Threefry-2x32-13 of the counter ``(x0, x1)``."""
    return numpy_threefry2x32(key, x0, x1, rounds=13)


def numpy_tiled_tile(key, tile_index, tile, uniform_bits, hash_words=tiled_hash):
    """uint32 bits of one tile of the tiled impl: the parts of a hash cut the rows, rounded up,
    into slabs of whole sublanes, or the lanes into whole vregs where only they divide; a 16-bit (or 8-bit)
    element's uniform is the top half (or byte) of its word, its other bits zeros here. ``hash_words(key, x0, x1)``: the hash (the statistical
    tests' negative controls pass weakened ones)."""
    rows, cols = tile
    parts = 64 // uniform_bits
    along_rows = rows % (8 * parts) == 0 or cols % (128 * parts) != 0
    grid = (-(-rows // (8 * parts)) * 8, cols) if along_rows else (rows, cols // parts)
    position = np.arange(grid[0] * grid[1], dtype=np.uint32).reshape(grid)
    y0, y1 = hash_words(key, np.full(grid, tile_index % 2**32, np.uint32), position)
    # each word's uniform_bits-bit parts, the lowest first, as the top bits of an element
    slabs = [(word >> np.uint32(uniform_bits * part)) << np.uint32(32 - uniform_bits) if uniform_bits < 32 else word
             for word in (y0, y1) for part in range(32 // uniform_bits)]
    return np.concatenate(slabs, axis=0 if along_rows else 1)[:rows]  # rows rounded up: drawn, not used


def numpy_tiled_view(key, view, tile, uniform_bits, first_tile=0, hash_words=tiled_hash):
    """The tiled impl's bits of a ``view`` (rows, cols) drawn per ``tile``, numbered row-major
    over the view padded to whole tiles (from ``first_tile``), cut to the view."""
    tiles_down, tiles_across = -(-view[0] // tile[0]), -(-view[1] // tile[1])
    bits = np.block([[numpy_tiled_tile(key, first_tile + i * tiles_across + j, tile, uniform_bits, hash_words)
                      for j in range(tiles_across)] for i in range(tiles_down)])
    return bits[:view[0], :view[1]]


def tiled_bits(seed, shape, uniform_bits=32):
    """uint32 bits of the tiled impl for an elementwise tensor of ``shape`` (its 2-D view and the
    hardware impl's tiles: tiling.view_2d, tiling.hardware_tile; of the tensor with its first two
    dims swapped where tiling.first_dims_swapped), 16-bit ones masked to their top half."""
    if tiling.first_dims_swapped(shape):
        return tiled_bits(seed, (shape[1], shape[0], *shape[2:]), uniform_bits).swapaxes(0, 1)
    view = tiling.view_2d(shape)
    key = tiled_seed_key(seed)
    return numpy_tiled_view(key, view, tiling.hardware_tile(*view), uniform_bits).reshape(shape)


def tiled_drop_threshold(p):
    return int(np.floor(p * 65536 + 0.5))


def tiled_keep_from_bits(bits, p):
    """Kept where the 16-bit uniform (the top half) is at least round(p * 65536)."""
    return (np.asarray(bits, np.uint32) >> np.uint32(16)) >= tiled_drop_threshold(p)


def dropout_keep(seed, shape, p, impl="tiled"):
    """The keep mask of dropout over ``shape`` with ``impl`` (``"tiled"``, the default, or
    ``"threefry"``: ``jax.random.bernoulli``'s), and the float32 keep probability kept values are
    divided by (docs/noise.md, Dropout's mask)."""
    if impl == "threefry":
        return np.array(jax.random.bernoulli(jax_key(seed), np.float32(1 - p), shape)), keep_probability(p, impl)
    return tiled_keep_from_bits(tiled_bits(seed, shape, 16), p), keep_probability(p, impl)


def keep_probability(p, impl="tiled"):
    """float32: what dropout with ``impl`` divides kept values by, ``1 - p``, or the tiled impl's
    ``(65536 - t) / 65536`` for its threshold ``t``."""
    return np.float32(1 - p) if impl == "threefry" else np.float32((65536 - tiled_drop_threshold(p)) / 65536)


def tiled_dropout(seed, x, p):
    """Dropout with the tiled impl: kept values divided by (65536 - t) / 65536 in float32, rounded once."""
    keep, scale = dropout_keep(seed, x.shape, p)
    wide = np.asarray(x, np.float32)
    return jnp.asarray(np.where(keep, wide / scale, wide * np.float32(0.0))).astype(x.dtype)


def attention_tiled_keep(shape, dropout_p, seed=1234):
    """The tiled impl's mask of ``(*batch, L, S)`` attention weights: each plane drawn per
    :func:`attention.attention_tile`, tiles numbered on from the previous planes'."""
    *batch, L, S = shape
    tile = attention.attention_tile(L, S)
    tiles_per_plane = -(-L // tile[0]) * -(-S // tile[1])
    key = tiled_seed_key(seed)
    planes = [numpy_tiled_view(key, (L, S), tile, 16, b * tiles_per_plane) for b in range(int(np.prod(batch)))]
    return tiled_keep_from_bits(np.stack(planes).reshape(shape), dropout_p)


def kept_by_definition(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The token sampler's kept set of one row in float64 (torch_pallas.kernels.token_sampling's
    definitions): greedy; else min-p, top-k (ties kept), then top-p over what they keep,
    renormalised (the fewest largest reaching top_p, ties kept)."""
    logits = logits.astype(np.float64)
    if temperature < 1e-5:
        return logits == logits.max()
    masses = np.exp((logits - logits.max()) / temperature)
    kept = masses >= min_p
    if top_k:
        kept &= logits >= np.sort(logits)[::-1][min(top_k, logits.size) - 1]
    if top_p < 1:
        mass = np.where(kept, masses, 0.0)
        values, group = np.unique(logits, return_inverse=True)  # -0.0 and 0.0 are one value
        group_mass = np.bincount(group, weights=mass, minlength=values.size)
        above = np.concatenate([np.cumsum(group_mass[::-1])[::-1][1:], [0.0]])  # the mass of larger values
        kept &= above[group] < top_p * mass.sum()
    return kept
