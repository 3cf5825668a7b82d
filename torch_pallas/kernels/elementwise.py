"""One Pallas driver for every elementwise op that consumes noise (sampling, dropout).

It views the tensor as a 2-D matrix (:func:`tiling.view_2d`), resolves the blocks, pads the
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

from torch_pallas.kernels import prng, tiling


def _noise_kernel(key_data_ref, *refs, impl, transform, num_cols, chunk_shape, column_major_grid,
                  shared_over_first_dim):
    out_ref = refs[-1]
    operand_ref = refs[0] if len(refs) == 2 else None
    block_rows, block_cols = out_ref.shape
    chunk_rows, chunk_cols = chunk_shape
    block_row, block_col = pl.program_id(0), pl.program_id(1)
    if column_major_grid:
        block_row, block_col = block_col, block_row
    row0 = block_row * block_rows
    col0 = block_col * block_cols

    def chunk(row_offset, col_offset):
        rows, cols = pl.ds(row_offset, chunk_rows), pl.ds(col_offset, chunk_cols)
        if shared_over_first_dim:
            # Every row gets row 0's bits: draw one row (one tile row for the hardware PRNG).
            drawn_rows = tiling.SUBLANES if impl == prng.HARDWARE else 1
            bits = prng.chunk_bits(impl, key_data_ref, (drawn_rows, chunk_cols), 0, col0 + col_offset, num_cols)
            bits = jnp.broadcast_to(bits[:1], chunk_shape)
        else:
            bits = prng.chunk_bits(impl, key_data_ref, chunk_shape, row0 + row_offset, col0 + col_offset, num_cols)
        if operand_ref is None:
            out_ref[rows, cols] = transform(bits)
        else:
            out_ref[rows, cols] = transform(bits, operand_ref[rows, cols])

    # A loop, not Python unrolling, over the block's chunks: the kernel's code size stays
    # bounded however large the block.
    chunks_per_row = block_cols // chunk_cols
    num_chunks = block_rows // chunk_rows * chunks_per_row
    if num_chunks == 1:
        chunk(0, 0)
        return

    def step(index, carry):
        # Offsets along a dim with a single chunk stay static: Mosaic must prove a dynamic
        # offset aligned to the dtype's packing, which a one-row chunk cannot show.
        row_offset = pl.multiple_of(index // chunks_per_row * chunk_rows, chunk_rows) if chunk_rows < block_rows else 0
        col_offset = pl.multiple_of(index % chunks_per_row * chunk_cols, chunk_cols) if chunks_per_row > 1 else 0
        chunk(row_offset, col_offset)
        return carry
    jax.lax.fori_loop(0, num_chunks, step, 0)


def noise_map(key_data: jax.Array, shape, transform, out_dtype, operand: jax.Array | None = None, *,
              impl: str, interpret: bool, blocks: tiling.ElementwiseBlocks | None = None,
              shared_over_first_dim: bool = False) -> jax.Array:
    """``transform(bits[, operand])`` over a tensor of ``shape``, in one Pallas kernel.

    Element ``i`` (row-major) gets the random bits of flat index ``i`` under ``impl``, so the
    result does not depend on ``blocks`` or (threefry) the backend.

    Args:
        key_data: int32 (2,) threefry key words.
        shape: the tensor's shape (fewer than 2**32 elements, at least one).
        transform: ``f(bits)`` or ``f(bits, operand_chunk)`` -> chunk of ``out_dtype``.
        out_dtype: the kernel's output dtype.
        operand: optional array of ``shape`` read elementwise.
        impl, interpret, blocks: see :func:`sampling.sample`.
        shared_over_first_dim: every index along ``shape[0]`` gets the noise of a tensor
            of shape ``shape[1:]`` (for example one dropout mask per sequence, shared over
            time). The kernel then views the tensor as ``(shape[0], prod(shape[1:]))``.

    Raises:
        ValueError: an unknown impl, ``impl="hardware"`` in interpret mode, or blocks that
            :func:`tiling.resolve_elementwise` rejects.
    """
    prng.check_impl(impl)
    hardware = impl == prng.HARDWARE
    if hardware and interpret:
        raise ValueError('impl="hardware" runs only compiled on TPU; use impl="threefry" in interpret mode')
    if shared_over_first_dim:
        rows, cols = shape[0], math.prod(shape[1:])
    else:
        rows, cols = tiling.view_2d(shape)
    view_rows, view_cols = rows, cols
    if hardware:
        # Per-tile seeding needs whole tiles; the padding is computed and sliced off.
        view_rows, view_cols = tiling.round_up(rows, tiling.SUBLANES), tiling.round_up(cols, tiling.LANES)
    itemsize = max(jnp.dtype(out_dtype).itemsize, operand.dtype.itemsize if operand is not None else 1)
    blocks = tiling.resolve_elementwise(blocks, view_rows, view_cols, itemsize, interpret=interpret,
                                        whole_tiles=hardware)

    grid = (pl.cdiv(view_rows, blocks.rows), pl.cdiv(view_cols, blocks.cols))
    if blocks.column_major_grid:
        block_spec = pl.BlockSpec((blocks.rows, blocks.cols), lambda j, i: (i, j))
        grid = grid[::-1]
    else:
        block_spec = pl.BlockSpec((blocks.rows, blocks.cols), lambda i, j: (i, j))
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)]
    operands = [prng.hardware_key_data(key_data) if hardware else key_data]
    if operand is not None:
        operand = operand.reshape(rows, cols)
        if (view_rows, view_cols) != (rows, cols):
            operand = jnp.pad(operand, ((0, view_rows - rows), (0, view_cols - cols)))
        in_specs.append(block_spec)
        operands.append(operand)
    kernel = functools.partial(
        _noise_kernel, impl=impl, transform=transform, num_cols=view_cols,
        column_major_grid=blocks.column_major_grid, shared_over_first_dim=shared_over_first_dim,
        chunk_shape=tiling.chunk_shape(blocks, interpret=interpret, whole_tiles=hardware))
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
