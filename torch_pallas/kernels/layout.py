"""How an elementwise kernel sees a tensor: a 2-D view, its blocks, and the grid over them.

Any tensor is viewed as a row-major (rows, cols) matrix with the same flat order, so the
reshape is free and each element keeps its flat index (the counter of its threefry noise).
Blocks follow Mosaic's rule (last two dims multiples of (8, 128) or the full dims). Pallas
pads the ragged edge blocks; kernels compute on the padding and the writes are dropped.
"""

from __future__ import annotations

import math

import jax
from jax.experimental import pallas as pl

MAX_ELEMENTS = 2**32 - 1  # flat indices are uint32 counters

# Per-block element targets. In interpret mode every grid step costs a fixed overhead on
# the host, so blocks are large; on TPU a block plus its double buffers must fit in VMEM.
_INTERPRET_BLOCK_ELEMENTS = 2**22
_TPU_BLOCK_BYTES = 2**20
_TPU_MAX_BLOCK_COLS = 2048
_TPU_CHUNK_ROWS = 32


def check_numel(shape) -> int:
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise ValueError(f"tensors of at most 2**32 - 1 elements are supported, got shape {tuple(shape)}")
    return numel


def view_2d(shape) -> tuple[int, int]:
    """(rows, cols) of the row-major 2-D view used for a tensor of ``shape`` (numel > 0).

    Prefers lane-dense views (cols a multiple of 128 dividing numel); otherwise the last
    dim when it is wide, else a single row.
    """
    numel = math.prod(shape)
    for cols in (1024, 512, 256, 128):
        if numel % cols == 0:
            return numel // cols, cols
    last = shape[-1] if len(shape) else 1
    if last >= 128:
        return numel // last, last
    return 1, numel


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def default_block_shape(rows: int, cols: int, itemsize: int = 4, *, interpret: bool) -> tuple[int, int]:
    """A block for a (rows, cols) view of ``itemsize``-byte elements: few large blocks in
    interpret mode, about 1 MiB per operand block on TPU (double-buffered in and out: 4 MiB
    of VMEM)."""
    if interpret:
        block_cols = cols
        target = _INTERPRET_BLOCK_ELEMENTS
    else:
        target = _TPU_BLOCK_BYTES // itemsize
        # A view of few rows (an odd-sized tensor seen as one row) gets wide blocks instead
        # of many tiny ones.
        max_cols = _TPU_MAX_BLOCK_COLS if rows >= 8 else max(128, target // rows // 128 * 128)
        block_cols = cols if cols <= max_cols else max_cols
    block_rows = max(8, (target // block_cols) // 8 * 8)
    return (rows if block_rows >= rows else block_rows), block_cols


def check_block_shape(block_shape, rows: int, cols: int, *, interpret: bool, name: str = "block_shape"):
    """Validates a caller's (block_rows, block_cols); Mosaic's alignment rule applies off interpret."""
    if (not isinstance(block_shape, tuple) or len(block_shape) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_shape)):
        raise ValueError(f"{name} must be a tuple of two positive ints, got {block_shape!r}")
    block_rows, block_cols = block_shape
    if not interpret and not (
            (block_rows % 8 == 0 or block_rows == rows) and (block_cols % 128 == 0 or block_cols == cols)):
        raise ValueError(
            f"{name}={block_shape} is not valid for TPU on a ({rows}, {cols}) view: each dim must be "
            f"a multiple of (8, 128) or equal the full dim")
    return block_shape


def chunk_rows(block_rows: int, *, interpret: bool, tile_rows: int | None = None) -> int:
    """Rows a kernel body processes at a time: the whole block in interpret mode, a few
    vregs' worth on TPU (bounded code size and live registers); the hardware PRNG's tile
    height when it is used."""
    if interpret:
        return block_rows
    if tile_rows is not None:
        return tile_rows
    for rows in (_TPU_CHUNK_ROWS, 8):
        if block_rows % rows == 0:
            return rows
    return block_rows


def grid_and_index_map(rows: int, cols: int, block_shape, *, transpose_grid: bool):
    """The 2-D grid over blocks and its index map; ``transpose_grid`` walks it column-major."""
    grid = (pl.cdiv(rows, block_shape[0]), pl.cdiv(cols, block_shape[1]))
    if transpose_grid:
        return grid[::-1], lambda j, i: (i, j)
    return grid, lambda i, j: (i, j)


def block_position(transpose_grid: bool) -> tuple[jax.Array, jax.Array]:
    """(block row, block col) of the running kernel instance."""
    if transpose_grid:
        return pl.program_id(1), pl.program_id(0)
    return pl.program_id(0), pl.program_id(1)


def for_each_chunk(block_rows: int, rows_per_chunk: int, body) -> None:
    """Calls ``body(row_offset)`` for each chunk of rows of a block."""
    if rows_per_chunk == block_rows:
        body(0)
        return
    def step(index, carry):
        body(pl.multiple_of(index * rows_per_chunk, rows_per_chunk))
        return carry
    jax.lax.fori_loop(0, block_rows // rows_per_chunk, step, 0)
