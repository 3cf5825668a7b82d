"""One Pallas driver for every elementwise op that consumes noise (sampling, dropout).

It views the tensor as a 2-D matrix (:mod:`layout`), picks and checks the blocks, pads the
view to whole tiles for the hardware PRNG, and runs a kernel that, chunk by chunk, draws the
chunk's random bits and writes ``transform(bits[, operand chunk])``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import layout, prng


def _noise_kernel(key_ref, *refs, impl, transform, num_cols, rows_per_chunk, tile, transpose_grid, same_noise_per_row):
    out_ref = refs[-1]
    operand_ref = refs[0] if len(refs) == 2 else None
    block_rows, block_cols = out_ref.shape
    block_row, block_col = layout.block_position(transpose_grid)
    row0 = block_row * block_rows
    col0 = block_col * block_cols

    def chunk(row_offset):
        rows = pl.ds(row_offset, rows_per_chunk)
        if same_noise_per_row:
            # Every row gets row 0's bits: draw one row (one tile row for the hardware PRNG).
            drawn_rows = tile[0] if impl == prng.HARDWARE else 1
            bits = prng.chunk_bits(impl, key_ref, (drawn_rows, block_cols), 0, col0, num_cols, tile)
            bits = jnp.broadcast_to(bits[:1], (rows_per_chunk, block_cols))
        else:
            bits = prng.chunk_bits(impl, key_ref, (rows_per_chunk, block_cols), row0 + row_offset, col0, num_cols, tile)
        if operand_ref is None:
            out_ref[rows, :] = transform(bits)
        else:
            out_ref[rows, :] = transform(bits, operand_ref[rows, :])

    layout.for_each_chunk(block_rows, rows_per_chunk, chunk)


def noise_map(key_data: jax.Array, shape, transform, out_dtype, operand: jax.Array | None = None, *,
              impl: str, interpret: bool, block_shape=None, transpose_grid: bool = False,
              tile=prng.DEFAULT_TILE, same_noise_over_first_dim: bool = False) -> jax.Array:
    """``transform(bits[, operand])`` over a tensor of ``shape``, in one Pallas kernel.

    Element ``i`` (row-major) gets the random bits of flat index ``i`` under ``impl``, so the
    result does not depend on ``block_shape``, ``transpose_grid`` or (threefry) the backend.

    Args:
        key_data: int32 (2,) threefry key words.
        shape: the tensor's shape (fewer than 2**32 elements, at least one).
        transform: ``f(bits)`` or ``f(bits, operand_chunk)`` -> chunk of ``out_dtype``.
        out_dtype: the kernel's output dtype.
        operand: optional array of ``shape`` read elementwise.
        impl, interpret, block_shape, transpose_grid, tile: see :func:`sampling.sample`.
        same_noise_over_first_dim: every index along ``shape[0]`` gets the noise of a tensor
            of shape ``shape[1:]`` (for example one dropout mask per sequence, shared over
            time). The kernel then views the tensor as ``(shape[0], prod(shape[1:]))``.

    Raises:
        ValueError: an unknown impl, ``impl="hardware"`` in interpret mode, or a block
            shape Mosaic would reject or that is not a multiple of the hardware tile.
    """
    prng.check_impl(impl)
    if impl == prng.HARDWARE and interpret:
        raise ValueError('impl="hardware" runs only compiled on TPU; use impl="threefry" in interpret mode')
    if same_noise_over_first_dim:
        rows, cols = shape[0], math.prod(shape[1:])
    else:
        rows, cols = layout.view_2d(shape)
    view_rows, view_cols = rows, cols
    if impl == prng.HARDWARE:
        # Per-tile seeding needs whole tiles; the padding is computed and sliced off.
        view_rows, view_cols = layout.round_up(rows, tile[0]), layout.round_up(cols, tile[1])
    if block_shape is None:
        itemsize = max(jnp.dtype(out_dtype).itemsize, operand.dtype.itemsize if operand is not None else 1)
        block_shape = layout.default_block_shape(view_rows, view_cols, itemsize, interpret=interpret)
        if impl == prng.HARDWARE:
            block_shape = (layout.round_up(block_shape[0], tile[0]), layout.round_up(block_shape[1], tile[1]))
    layout.check_block_shape(block_shape, view_rows, view_cols, interpret=interpret)
    if impl == prng.HARDWARE and (block_shape[0] % tile[0] or block_shape[1] % tile[1]):
        raise ValueError(f"block_shape={block_shape} must be a multiple of tile={tile} for impl='hardware'")

    grid, index_map = layout.grid_and_index_map(view_rows, view_cols, block_shape, transpose_grid=transpose_grid)
    block_spec = pl.BlockSpec(block_shape, index_map)
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)]
    operands = [key_data]
    if operand is not None:
        operand = operand.reshape(rows, cols)
        if (view_rows, view_cols) != (rows, cols):
            operand = jnp.pad(operand, ((0, view_rows - rows), (0, view_cols - cols)))
        in_specs.append(block_spec)
        operands.append(operand)
    kernel = functools.partial(
        _noise_kernel, impl=impl, transform=transform, num_cols=view_cols, tile=tile,
        transpose_grid=transpose_grid, same_noise_per_row=same_noise_over_first_dim,
        rows_per_chunk=layout.chunk_rows(
            block_shape[0], interpret=interpret, tile_rows=tile[0] if impl == prng.HARDWARE else None))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((view_rows, view_cols), out_dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=block_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(*operands)
    if (view_rows, view_cols) != (rows, cols):
        out = out[:rows, :cols]
    return out.reshape(shape)
