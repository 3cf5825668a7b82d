"""What Mosaic asks of a kernel: its tile, every kernel's block configuration with its
defaults and one rule, and no float16.

A kernel's block configuration is a frozen dataclass (:class:`ElementwiseBlocks`,
:class:`RecurrenceBlocks`), checked once in :func:`resolve_elementwise` /
:func:`resolve_recurrence` by the same rule on every platform: the last two block dims
are multiples of :data:`TILE` or the full dims (what Mosaic accepts), so a block accepted
in interpret mode meets Mosaic's rule too (whether it fits VMEM only the TPU compiler
tells: ``tests/kernels/test_tpu_compile.py``). A block larger than its dim is clamped to it.

Elementwise kernels see any tensor as a row-major ``(rows, cols)`` matrix with the same
flat order (:func:`view_2d`), so each element keeps its flat index, the counter of its
threefry noise (the per-tile impls see a tensor that XLA holds with its first two dims
swapped as that swap's matrix: :func:`first_dims_swapped`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from torch_pallas.kernels.arguments import check_positive_int

# One vreg of 32-bit values: (sublanes, lanes). Blocks are multiples of it.
TILE = (8, 128)
SUBLANES, LANES = TILE
# The hardware PRNG is seeded once per tile of up to this many elements: seeding is a
# threefry hash of a whole vreg, so a (8, 128) tile spent as many vector ops on the seed as
# threefry spends on the tile's noise, and a (64, 1024) tile brings dropout to HBM speed on
# v5e/v5p/v6e (bench/results/tpu_cost.md, where the tile sizes compared are costed).
HARDWARE_TILE_ELEMENTS = 64 * 1024

# Interpret mode: every grid step costs a fixed host overhead and copies of every operand
# block, so blocks are as large as possible. TPU: a block plus its double buffers fits VMEM.
_INTERPRET_BLOCK_ELEMENTS = 2**22
_TPU_BLOCK_BYTES = 2**20
_TPU_MAX_BLOCK_COLS = 2048
# A kernel body's chunk: at most 8 vregs of 32-bit values per live array.
_TPU_CHUNK_COLS = 1024
_TPU_CHUNK_ELEMENTS = 8 * 1024

_TPU_MAX_BLOCK_TIME = 256
_TPU_MAX_BLOCK_BATCH = 32
_TPU_MAX_BLOCK_FEATURES = 1024
_TPU_SPLIT_BLOCK_FEATURES = 512
# Each recurrence step is a short dependent chain; unrolling lets the TPU scheduler
# overlap neighbouring steps' loads and stores (not tuned on hardware). In interpret mode
# unrolling gains nothing: XLA's CPU loop ran no faster unrolled anywhere measured, the
# forward slower, and the unrolled kernels take longer to compile (measured in
# bench/results/interpret_choices.md, § Time-loop unroll).
_TPU_UNROLL = 8
_INTERPRET_UNROLL = 1


def check_positive_ints(blocks, names) -> None:
    for name in names:
        object.__setattr__(blocks, name, check_positive_int(getattr(blocks, name), f"{type(blocks).__name__}.{name}"))


@dataclasses.dataclass(frozen=True)
class ElementwiseBlocks:
    """A block of the ``(rows, cols)`` view an elementwise kernel (sampling, dropout) walks.

    ``column_major_grid`` walks the blocks column by column; the noise does not change.
    """
    rows: int
    cols: int
    column_major_grid: bool = False

    def __post_init__(self):
        check_positive_ints(self, ("rows", "cols"))


@dataclasses.dataclass(frozen=True)
class RecurrenceBlocks:
    """A ``(time, batch, features)`` block of the IndRNN kernels, and their time-loop unroll
    (``None``: the platform's default)."""
    time: int
    batch: int
    features: int
    unroll: int | None = None

    def __post_init__(self):
        check_positive_ints(self, ("time", "batch", "features") + (("unroll",) if self.unroll is not None else ()))


def widen_float16(*arrays):
    """The arrays, float16 ones as float32 (exact). Mosaic has no float16 ("Unsupported type
    in mosaic dialect: 'f16'"), so kernels see float16 operands as float32 on every
    platform, and their callers round float16 results once, outside the kernel."""
    return tuple(a.astype(jnp.float32) if a.dtype == jnp.float16 else a for a in arrays)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sublane_tile(itemsize: int) -> int:
    """Rows of one vreg tile of a dtype of ``itemsize`` bytes: packed dtypes fill a vreg's
    sublanes with 32 // bits rows (8 rows of 32 bits, 16 of 16 bits), so an array's rows are
    padded to this many in VMEM, and on TPU in HBM."""
    return SUBLANES * max(1, 4 // itemsize)


def view_2d(shape) -> tuple[int, int]:
    """(rows, cols) of the row-major 2-D view of a tensor of ``shape`` (numel > 0).

    The tensor's own rows when its last dim is whole lanes (a multiple of 128) and there
    are at least 8 of them (a vreg's sublanes): the ops around a kernel (a LayerNorm, a
    matmul) work on those rows, and XLA computes a fusion that meets a kernel in the
    kernel's view, where a per-row statistic of rows of another width cannot be broadcast
    inside the fusion and is written to HBM whole. Otherwise a lane-dense view (cols a
    multiple of 128 dividing numel); otherwise the last dim when it is wide, else a single
    row.
    """
    numel = math.prod(shape)
    last = shape[-1] if len(shape) else 1
    if last % LANES == 0 and numel // last >= SUBLANES:
        return numel // last, last
    for cols in (1024, 512, 256, 128):
        if numel % cols == 0:
            return numel // cols, cols
    if last >= LANES:
        return numel // last, last
    return 1, numel


def first_dims_swapped(shape) -> bool:
    """Whether the per-tile impls view a tensor of ``shape`` with its first two dims swapped.

    A 3-D tensor ``(B, L, C)`` whose ``C`` is whole lanes and ``L`` is not whole 8-row
    sublanes while ``B`` is (ViT-B/16's ``(32, 197, 768)`` activations): XLA on TPU lays it
    out as ``(L, B, C)`` (layout ``{2,0,1}``: ``B`` in the sublanes, no row padded), so a
    kernel reading the swapped tensor's rows reads XLA's own buffer, where the tensor's own
    rows would be copied in and out of a padded layout around every kernel. Threefry's
    counters are the flat indices of the tensor as it is, so it keeps the tensor's rows.
    """
    return (len(shape) == 3 and shape[2] % LANES == 0 and shape[1] % SUBLANES != 0
            and shape[0] % SUBLANES == 0)


def hardware_tile(rows: int, cols: int) -> tuple[int, int]:
    """The tile the hardware PRNG is seeded per, over a ``(rows, cols)`` view: the widest of
    1024, 512, 256, 128 lanes that divides the view's width in whole lanes, and every row in
    whole 8-row sublanes where that is at most :data:`HARDWARE_TILE_ELEMENTS` in all, else the
    most rows, a power of two, within it; the view's last tile row may be cut (its rows past
    the view are drawn and not kept). A function of the view alone: the forward and backward
    kernels of one tensor, and its shards, share it. Seeding costs as much for a small tile as
    for a large one: ViT-B/16's ``(6304, 768)`` rows (6304 = 2**5 x 197) get (256, 256) tiles,
    not the (32, 256) that divide them, whose seeds dominated the kernel's schedule."""
    width = round_up(cols, LANES)
    tile_cols = next(c for c in (1024, 512, 256, LANES) if width % c == 0)
    height = round_up(rows, SUBLANES)
    if height * tile_cols <= HARDWARE_TILE_ELEMENTS:
        return height, tile_cols
    tile_rows = SUBLANES
    while tile_rows * 2 * tile_cols <= HARDWARE_TILE_ELEMENTS:
        tile_rows *= 2
    return tile_rows, tile_cols


def _mosaic_block(block: tuple[int, int], full: tuple[int, int], what: str) -> tuple[int, int]:
    """``block`` clamped to ``full``; raises unless each dim is a multiple of TILE or full."""
    block = tuple(min(b, f) for b, f in zip(block, full))
    if any(b != f and b % t for b, f, t in zip(block, full, TILE)):
        raise ValueError(
            f"{what}: a block of {block} over {full} is rejected by Mosaic (TPU), on every platform: "
            f"each of the last two block dims must be a multiple of {TILE} or the full dim")
    return block


def resolve_elementwise(blocks: ElementwiseBlocks | None, rows: int, cols: int, itemsize: int, *,
                        interpret: bool, seed_tile: tuple[int, int] | None = None) -> ElementwiseBlocks:
    """``blocks`` checked against a ``(rows, cols)`` view, or the default for it.

    Default: few large blocks in interpret mode; about 1 MiB per operand block on TPU
    (double-buffered in and out: 4 MiB of VMEM). ``seed_tile`` (the per-tile impls' tile;
    the view is then whole tiles of columns, and its last tile row may be cut) requires
    blocks made of whole tiles, at most the view's rows rounded up to whole tiles: the last
    block may reach past the view (Pallas reads its rows there as padding and drops their
    writes).

    Raises:
        TypeError: ``blocks`` is not an :class:`ElementwiseBlocks`.
        ValueError: a block Mosaic would reject, or not whole tiles when they are required.
    """
    if blocks is None:
        blocks = _default_elementwise(rows, cols, itemsize, interpret)
        if seed_tile is not None:
            blocks = ElementwiseBlocks(round_up(blocks.rows, seed_tile[0]), round_up(blocks.cols, seed_tile[1]))
    elif not isinstance(blocks, ElementwiseBlocks):
        raise TypeError(f"blocks must be an ElementwiseBlocks or None, got {type(blocks).__name__}")
    full = (rows, cols) if seed_tile is None else (round_up(rows, seed_tile[0]), round_up(cols, seed_tile[1]))
    block_rows, block_cols = _mosaic_block((blocks.rows, blocks.cols), full, "blocks")
    if seed_tile is not None and (block_rows % seed_tile[0] or block_cols % seed_tile[1]):
        raise ValueError(f"blocks ({block_rows}, {block_cols}) must be whole {seed_tile} tiles for impl='hardware' and "
                         f"'tiled', the tile their noise is drawn per over this {rows}x{cols} view")
    return dataclasses.replace(blocks, rows=block_rows, cols=block_cols)


def _default_elementwise(rows: int, cols: int, itemsize: int, interpret: bool) -> ElementwiseBlocks:
    if interpret:
        block_rows = max(SUBLANES, _INTERPRET_BLOCK_ELEMENTS // cols // SUBLANES * SUBLANES)
        return ElementwiseBlocks(min(rows, block_rows), cols)
    target = _TPU_BLOCK_BYTES // itemsize
    if rows >= SUBLANES:
        block_cols = min(cols, _TPU_MAX_BLOCK_COLS)
        # VMEM pads a block's rows to whole lanes (128 of them): a narrow view's budget counts them.
        block_rows = max(SUBLANES, target // round_up(block_cols, LANES) // SUBLANES * SUBLANES)
        return ElementwiseBlocks(min(rows, block_rows), block_cols)
    # A view of few rows (an odd-sized tensor seen as one row) gets one wide block row. VMEM
    # pads it to a whole sublane tile (8 rows of 32 bits, 16 of 16 bits), so its width is
    # budgeted for that; beyond a chunk's width it is made a multiple of the chunk, so the
    # kernel body can walk it in bounded chunks.
    max_cols = max(LANES, target // sublane_tile(itemsize) // LANES * LANES)
    block_cols = min(cols, max_cols)
    if block_cols > _TPU_CHUNK_COLS:
        block_cols = block_cols // _TPU_CHUNK_COLS * _TPU_CHUNK_COLS
    return ElementwiseBlocks(rows, block_cols)


def chunk_shape(blocks: ElementwiseBlocks, *, interpret: bool,
                seed_tile: tuple[int, int] | None = None) -> tuple[int, int]:
    """What an elementwise kernel body processes at a time: the whole block in interpret
    mode; on TPU a few vregs, so that the threefry rounds' live values stay in registers
    (a (1, 262144) chunk spilled 24 MiB and overflowed v4's VMEM); one ``seed_tile`` for the
    per-tile impls (hardware, tiled), whose noise is drawn per tile."""
    if seed_tile is not None:
        return seed_tile
    if interpret:
        return blocks.rows, blocks.cols
    cols = next((c for c in (_TPU_CHUNK_COLS, 512, 256, LANES) if blocks.cols % c == 0), blocks.cols)
    rows = next((r for r in (32, 16, SUBLANES) if blocks.rows % r == 0 and r * cols <= _TPU_CHUNK_ELEMENTS),
                SUBLANES if blocks.rows % SUBLANES == 0 else blocks.rows)
    return rows, cols


def resolve_recurrence(blocks: RecurrenceBlocks | None, T: int, B: int, F: int, dtype, *,
                       interpret: bool) -> RecurrenceBlocks:
    """``blocks`` checked against a ``(T, B, F)`` sequence, or the default for it.

    Default: in interpret mode the whole sequence as one block: each grid step there
    dynamic-slices every operand's block out of the full array and writes it back, and there
    is no VMEM to fit. Shorter time blocks made forward+backward several times slower at both
    shapes measured, and more blocks slower still, though by less than their number
    (bench/results/interpret_choices.md, § Time-block size). On TPU:
    ``features`` the full F up to 1024, else 512; ``batch`` the full B up to 32, else 32;
    ``time`` so that one block is about 1 MiB (the backward keeps three such streams
    double-buffered), between 8 and 256 steps, balanced over T.

    Raises:
        TypeError: ``blocks`` is not a :class:`RecurrenceBlocks`.
        ValueError: a (batch, features) block Mosaic would reject.
    """
    unroll = _INTERPRET_UNROLL if interpret else _TPU_UNROLL
    if blocks is None:
        blocks = _default_recurrence(T, B, F, dtype, interpret)
    elif not isinstance(blocks, RecurrenceBlocks):
        raise TypeError(f"blocks must be a RecurrenceBlocks or None, got {type(blocks).__name__}")
    batch, features = _mosaic_block((blocks.batch, blocks.features), (B, F), "blocks (batch, features)")
    return RecurrenceBlocks(min(blocks.time, T), batch, features, blocks.unroll or unroll)


def _balanced_block(length: int, max_block: int) -> int:
    """The smallest block that splits ``length`` into as few blocks as ``max_block`` allows
    (1000 -> 4 x 250 rather than 3 x 256 + 232: a small padded tail)."""
    num_blocks = -(-length // max(1, max_block))
    return -(-length // num_blocks)


def _default_recurrence(T: int, B: int, F: int, dtype, interpret: bool) -> RecurrenceBlocks:
    if interpret:
        return RecurrenceBlocks(T, B, F)
    itemsize = np.dtype(dtype).itemsize
    features = F if F <= _TPU_MAX_BLOCK_FEATURES else _TPU_SPLIT_BLOCK_FEATURES
    batch = min(B, _TPU_MAX_BLOCK_BATCH)
    # A (batch, features) slab occupies at least a sublane tile's rows of VMEM.
    step_bytes = round_up(batch, sublane_tile(itemsize)) * round_up(features, LANES) * itemsize
    max_time = max(SUBLANES, min(_TPU_MAX_BLOCK_TIME, _TPU_BLOCK_BYTES // step_bytes))
    return RecurrenceBlocks(_balanced_block(T, max_time), batch, features)
