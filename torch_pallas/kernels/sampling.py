"""Block-invariant random sampling kernels: uniform, normal and Bernoulli tensors.

With ``impl="threefry"`` the result is bit for bit ``jax.random.uniform / normal /
bernoulli(key, shape)`` for the key whose data is ``key_data``, for every block shape and
grid order. With ``impl="hardware"`` (TPU only) it is the TPU PRNG's per-tile noise, the same
for every block shape that is a multiple of ``tile``.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import layout, prng

DISTRIBUTIONS = ("uniform", "normal", "bernoulli")


def _sample_kernel(key_ref, out_ref, *, impl, transform, num_cols, rows_per_chunk, tile, transpose_grid):
    block_rows, block_cols = out_ref.shape
    block_row, block_col = layout.block_position(transpose_grid)
    row0 = block_row * block_rows
    col0 = block_col * block_cols

    def chunk(row_offset):
        bits = prng.chunk_bits(impl, key_ref, (rows_per_chunk, block_cols), row0 + row_offset, col0, num_cols, tile)
        out_ref[pl.ds(row_offset, rows_per_chunk), :] = transform(bits)

    layout.for_each_chunk(block_rows, rows_per_chunk, chunk)


def _bernoulli_as_int32(bits, p):
    # Mosaic cannot store booleans; int32 keeps every block shape legal for the output.
    return prng.bernoulli_from_bits(bits, p).astype(jnp.int32)


def sample(key_data: jax.Array, shape, *, distribution: str, dtype=jnp.float32, p: float = 0.5,
           impl: str = prng.THREEFRY, interpret: bool, block_shape=None, transpose_grid: bool = False,
           tile=prng.DEFAULT_TILE) -> jax.Array:
    """Samples a tensor of ``shape`` from ``distribution`` in one Pallas kernel.

    Args:
        key_data: int32 array of shape (2,), the threefry key words ``[seed >> 32, seed & 0xFFFFFFFF]``
            reinterpreted as int32.
        shape: output shape (tuple of non-negative ints).
        distribution: ``"uniform"`` ([0, 1)), ``"normal"`` (standard) or ``"bernoulli"``.
        dtype: floating output dtype for uniform and normal (bernoulli returns bool).
        p: probability of True for bernoulli, drawn as ``uniform(float32) < float32(p)``.
        impl: ``"threefry"`` or ``"hardware"`` (TPU only; not with ``interpret``).
        interpret: run Pallas in interpret mode (any non-TPU backend).
        block_shape: (rows, cols) block of the 2-D view; default chosen per shape and mode.
        transpose_grid: walk the grid column-major instead of row-major (same result).
        tile: hardware PRNG seeding tile; blocks must be multiples of it.

    Raises:
        ValueError: unknown distribution or impl, ``impl="hardware"`` in interpret mode, a
            block shape Mosaic would reject, or a tensor of 2**32 or more elements.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    prng.check_impl(impl)
    if impl == prng.HARDWARE and interpret:
        raise ValueError('impl="hardware" runs only compiled on TPU; use impl="threefry" in interpret mode')
    shape = tuple(shape)
    numel = layout.check_numel(shape)
    out_dtype = jnp.bool_ if distribution == "bernoulli" else jnp.dtype(dtype)
    if numel == 0:
        return jnp.zeros(shape, out_dtype)

    rows, cols = layout.view_2d(shape)
    view_rows, view_cols = rows, cols
    if impl == prng.HARDWARE:
        # Per-tile seeding needs whole tiles; the padding is generated and sliced off.
        view_rows, view_cols = layout.round_up(rows, tile[0]), layout.round_up(cols, tile[1])
    if block_shape is None:
        block_shape = layout.default_block_shape(view_rows, view_cols, interpret=interpret)
        if impl == prng.HARDWARE:
            block_shape = (layout.round_up(block_shape[0], tile[0]), layout.round_up(block_shape[1], tile[1]))
    layout.check_block_shape(block_shape, view_rows, view_cols, interpret=interpret)
    if impl == prng.HARDWARE and (block_shape[0] % tile[0] or block_shape[1] % tile[1]):
        raise ValueError(f"block_shape={block_shape} must be a multiple of tile={tile} for impl='hardware'")

    if distribution == "uniform":
        transform, kernel_dtype = functools.partial(prng.uniform_from_bits, dtype=out_dtype), out_dtype
    elif distribution == "normal":
        transform, kernel_dtype = functools.partial(prng.normal_from_bits, dtype=out_dtype), out_dtype
    else:
        transform, kernel_dtype = functools.partial(_bernoulli_as_int32, p=np.float32(p)), jnp.int32

    grid, index_map = layout.grid_and_index_map(view_rows, view_cols, block_shape, transpose_grid=transpose_grid)
    kernel = functools.partial(
        _sample_kernel, impl=impl, transform=transform, num_cols=view_cols, tile=tile,
        transpose_grid=transpose_grid,
        rows_per_chunk=layout.chunk_rows(
            block_shape[0], interpret=interpret, tile_rows=tile[0] if impl == prng.HARDWARE else None))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((view_rows, view_cols), kernel_dtype),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec(block_shape, index_map),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(key_data)
    if (view_rows, view_cols) != (rows, cols):
        out = out[:rows, :cols]
    return out.reshape(shape).astype(out_dtype)


def uniform(key_data, shape, dtype=jnp.float32, **options):
    """``jax.random.uniform(key, shape, dtype)`` in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="uniform", dtype=dtype, **options)


def normal(key_data, shape, dtype=jnp.float32, **options):
    """``jax.random.normal(key, shape, dtype)`` in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="normal", dtype=dtype, **options)


def bernoulli(key_data, p, shape, **options):
    """``jax.random.bernoulli(key, p, shape)`` (bool) in a Pallas kernel; see :func:`sample`."""
    return sample(key_data, shape, distribution="bernoulli", p=p, **options)
