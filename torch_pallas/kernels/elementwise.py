"""One Pallas driver for every elementwise op that consumes noise (sampling, dropout).

It views the tensor as a 2-D matrix (:func:`tiling.view_2d`), resolves the blocks, pads the
view to whole seed tiles for the per-tile impls (:func:`tiling.hardware_tile`), and runs a
kernel that, chunk by chunk, draws the chunk's random bits and writes
``transform(bits, *operand chunks)``.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import calls, compat, prng, tiling


def _noise_kernel(key_data_ref, *refs, impl, transform, row_stride, view_cols, outer_stride, sharded, wide,
                  chunk_shape, column_major_grid, uniform_bits, tiled_hash_in_pieces):
    offset_ref, refs = (refs[0], refs[1:]) if sharded else (None, refs)
    *operand_refs, out_ref = refs
    block_rows, block_cols = out_ref.shape
    chunk_rows, chunk_cols = chunk_shape
    base = None
    if sharded:
        # A shard of a larger tensor: the global index of its first element (per-tile impls:
        # of its first tile) arrives as data, so one compiled kernel serves every shard.
        if prng.per_tile(impl):
            base = offset_ref[0]
        elif wide:
            base = (offset_ref[0].astype(jnp.uint32), offset_ref[1].astype(jnp.uint32))
        else:
            base = offset_ref[1].astype(jnp.uint32)  # the high word is 0
    if outer_stride is not None:
        # The outer grid axis walks a dim of the shard that the 2-D view cannot fold in.
        outer = pl.program_id(0).astype(jnp.uint32)
        if wide:
            base = prng.add_wide(base, prng.multiply_wide(outer, outer_stride))
        else:
            base = base + outer * np.uint32(outer_stride)
    first_axis = 0 if outer_stride is None else 1
    block_row, block_col = pl.program_id(first_axis), pl.program_id(first_axis + 1)
    if column_major_grid:
        block_row, block_col = block_col, block_row
    row0 = block_row * block_rows
    col0 = block_col * block_cols

    def chunk(row_offset, col_offset):
        rows, cols = pl.ds(row_offset, chunk_rows), pl.ds(col_offset, chunk_cols)
        if row_stride == 0:
            # Every row gets row 0's bits (a mask shared over the first dim): draw one row
            # (one seed tile, whose first row it is, for the per-tile impls).
            drawn_rows = chunk_rows if prng.per_tile(impl) else 1
            bits = prng.chunk_bits(impl, key_data_ref, (drawn_rows, chunk_cols), 0, col0 + col_offset,
                                   view_cols, base, wide, uniform_bits)
            bits = jnp.broadcast_to(bits[:1], chunk_shape)
        elif impl == prng.TILED and tiled_hash_in_pieces:
            def write(piece_rows, piece_cols, bits):
                out_ref[piece_rows, piece_cols] = transform(
                    bits, *(operand_ref[piece_rows, piece_cols] for operand_ref in operand_refs))
            index = prng.tile_index(row0 + row_offset, col0 + col_offset, row_stride, chunk_shape)
            _walk_tiled_tile(key_data_ref, index if base is None else index + base, chunk_shape, uniform_bits,
                             row_offset, col_offset, write)
            return
        else:
            bits = prng.chunk_bits(impl, key_data_ref, chunk_shape, row0 + row_offset, col0 + col_offset,
                                   row_stride, base, wide, uniform_bits)
        out_ref[rows, cols] = transform(bits, *(operand_ref[rows, cols] for operand_ref in operand_refs))

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


def _aligned(offset, multiple: int):
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _walk_tiled_tile(key_data_ref, tile_index, tile, uniform_bits, row_offset, col_offset, write):
    """Draws one tile of the tiled impl (:func:`prng.tiled_tile_bits`) 8 rows of its hash grid at
    a time, and calls ``write(rows, cols, bits)`` for the piece of each of its slabs they fill. The
    hash's live values stay within a few vregs, which the older TPU compiler schedules better
    (:data:`compat.TILED_HASH_IN_PIECES`)."""
    axis = prng.tiled_layout(tile, uniform_bits)[1]
    slab_rows, slab_cols = prng.tiled_grid(tile, uniform_bits)

    def piece(first):
        slabs = prng.tiled_slabs(key_data_ref, tile_index, tile, uniform_bits, first, tiling.SUBLANES)
        for part, bits in enumerate(slabs):
            if axis == 0 and first + part * slab_rows >= tile[0]:
                continue  # rows the hash grid rounded the tile up to: drawn, not used
            rows = row_offset + first + (part * slab_rows if axis == 0 else 0)
            cols = col_offset + (part * slab_cols if axis == 1 else 0)
            write(pl.ds(_aligned(rows, tiling.SUBLANES), tiling.SUBLANES), pl.ds(_aligned(cols, tiling.LANES), slab_cols),
                  bits)

    # Unrolled: as much code as hashing the whole tile at once, bounded by the tile's size.
    for first in range(0, slab_rows, tiling.SUBLANES):
        piece(first)


def index_dims(shape, global_shape, shared_over_first_dim: bool = False) -> list[tuple[int, int]]:
    """The dims of a tensor of ``shape`` as (size, stride in ``global_shape``'s flat index),
    size-1 dims dropped and neighbours merged where their strides allow.

    A whole tensor is one dim ``(numel, 1)``; a shard of a tensor split along dims other than
    the first keeps one more dim per split (a (4, 1024) shard of (16, 4096) at any offset:
    ``[(4, 4096), (1024, 1)]``). ``shared_over_first_dim`` gives the first dim stride 0: every
    index along it reads the noise of ``global_shape[1:]``. The last dim always has stride 1.
    """
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    if shared_over_first_dim and strides:
        strides[0] = 0
    dims: list[tuple[int, int]] = []
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if not dims or dims[-1][1] != 1:
        dims.append((1, 1))
    return dims


def check_index_dims(shape, global_shape, shared_over_first_dim: bool = False) -> list[tuple[int, int]]:
    """:func:`index_dims`, or ValueError when the kernel cannot follow them: its 2-D view plus
    one outer grid axis give it three strides, enough for any shard of a tensor split along
    at most two dims (every sharding over a 1-D or 2-D mesh)."""
    dims = index_dims(shape, global_shape, shared_over_first_dim)
    if len(dims) > 3:
        split = [d for d, (size, whole) in enumerate(zip(shape, global_shape)) if size != whole]
        raise ValueError(f"a shard of shape {tuple(shape)} of a tensor of shape {tuple(global_shape)} is split "
                         f"along dims {split}; the kernels follow at most two split dims besides the first")
    return dims


def per_tile_view(shape, global_shape, shared_over_first_dim: bool = False, impl: str = prng.HARDWARE
                  ) -> tuple[int, int, bool, int, tuple[int, int]]:
    """``(rows, cols, shared_row, global_cols, seed_tile)`` for a per-tile ``impl`` (hardware, tiled): the 2-D
    view of a tensor of ``shape``, a shard of ``global_shape`` (or all of it), whether every
    row draws the first row's noise, the width of the whole tensor's view, and the tile the
    noise is drawn per.

    The noise is drawn per tile (:func:`tiling.hardware_tile`) of the whole tensor's
    view, padded to whole tiles: the elements of ``global_shape[1:]`` in one row for a mask
    shared over the first dim, else :func:`tiling.view_2d` of ``global_shape`` (of the
    tensor with its first two dims swapped where :func:`tiling.first_dims_swapped`:
    :func:`noise_map` swaps them before it asks). The kernel draws a shard's part of that
    noise directly when the shard is whole bands of it (:func:`draws_whole_bands`);
    :func:`noise_map` draws any other shard in the bands that cover it.

    Raises:
        ValueError: a shard that is not whole bands of the whole tensor's view, or any shard
            of a tensor whose view swaps its first two dims (its view is the swapped tensor's).
    """
    if swaps_first_dims(global_shape, shared_over_first_dim) and tuple(shape) != tuple(global_shape):
        raise ValueError(f'impl="{impl}" on a shard of shape {tuple(shape)} of a tensor of shape '
                         f"{tuple(global_shape)}: its noise is drawn per tile of the tensor seen with its first two "
                         f"dims swapped, as XLA lays it out on TPU (noise_map draws the shard of the swapped tensor)")
    shared_row, numel, global_cols, seed_tile, band = _bands(global_shape, shared_over_first_dim)
    part = [size for size, stride in index_dims(shape, global_shape, shared_over_first_dim) if stride]
    if len(part) != 1 or (part[0] != numel and part[0] % band):
        raise ValueError(
            f'impl="{impl}" on a shard of shape {tuple(shape)} of a tensor of shape {tuple(global_shape)}: '
            f"its noise is drawn per {seed_tile} tile of the whole tensor's "
            f"{numel // global_cols}x{global_cols} view, and the kernel draws a contiguous run of whole "
            f"{band}-element bands of it (noise_map draws other shards in the bands that cover them)")
    size = part[0]
    rows, cols = (1, size) if numel == global_cols else (size // global_cols, global_cols)
    if shared_row:
        rows = shape[0]
    return rows, cols, shared_row, global_cols, seed_tile


def _bands(global_shape, shared_over_first_dim: bool) -> tuple[bool, int, int, tuple[int, int], int]:
    """``(shared_row, numel, global_cols, seed_tile, band)`` of a per-tile impl's noise over a tensor
    of ``global_shape`` (as :func:`per_tile_view` sees it): the indices it draws (``numel``), its
    view's width, its tile and its bands, the runs of ``band`` indices (a tile row of the view, or a
    tile of a one-row view) that a kernel call draws whole."""
    global_dims = index_dims(global_shape, global_shape, shared_over_first_dim)
    shared_row = len(global_dims) == 2  # [(first dim, stride 0), (the rest, 1)]
    numel = global_dims[-1][0] if shared_row else math.prod(global_shape)
    global_cols = numel if shared_row else tiling.view_2d(global_shape)[1]
    seed_tile = tiling.hardware_tile(numel // global_cols, global_cols)
    band = global_cols * seed_tile[0] if numel > global_cols else seed_tile[1]
    return shared_row, numel, global_cols, seed_tile, band


def band_length(global_shape, shared_over_first_dim: bool = False) -> int:
    """How many of the noise's flat indices a band of a per-tile impl's noise over a tensor of
    ``global_shape`` holds (:func:`_bands`)."""
    return _bands(global_shape, shared_over_first_dim)[-1]


def draws_whole_bands(shape, global_shape, shared_over_first_dim: bool = False) -> bool:
    """Whether a per-tile impl's kernel draws a shard of ``shape`` of a tensor of ``global_shape``
    as it is: a contiguous run of whole bands (:func:`_bands`) of an even split (every dim of
    ``global_shape`` a multiple of the shard's), whose first index is then a multiple of the
    run's length, as the shards of an even split and torch's DTensor shards start. Otherwise
    :func:`noise_map` draws the bands that cover it (:func:`_in_covering_bands`)."""
    _, numel, _, _, band = _bands(global_shape, shared_over_first_dim)
    part = [size for size, stride in index_dims(shape, global_shape, shared_over_first_dim) if stride]
    even = all(whole % size == 0 for size, whole in zip(shape, global_shape))
    return len(part) == 1 and (part[0] == numel or (part[0] % band == 0 and even))


# Beyond this many runs in a shard (one per index of the dims before the last it splits), the
# bands of the span of all of them cost less than a kernel call per run.
MOST_RUNS = 16


def block_runs(block_shape, shape) -> tuple[int, list[int]]:
    """The runs of a block of ``block_shape`` of a tensor of ``shape`` in its flat order: their
    length and each start's flat index relative to the block's first element, one run per index
    of the dims before the last dim the block splits, in the block's own order."""
    split = max([0] + [d for d, (size, whole) in enumerate(zip(block_shape, shape)) if size != whole])
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    # itertools, not np.ndindex: dynamo traces this where a DTensor op runs compiled (dtensors.row_runs).
    starts = [sum(i * stride for i, stride in zip(position, strides))
              for position in itertools.product(*(range(size) for size in block_shape[:split]))]
    return block_shape[split] * strides[split], starts


def _in_covering_bands(key_data, shape, transform, out_dtype, operands, *, global_shape, shard_offset,
                       shared_over_first_dim, **options) -> jax.Array:
    """:func:`noise_map` of a per-tile impl on a shard that is not whole bands of the whole
    tensor's noise (:func:`draws_whole_bands`): its runs of the noise's flat indices (one per
    index of the dims before the last it splits; with ``shared_over_first_dim`` in the noise of
    ``global_shape[1:]``, for every index of the first dim), each placed in zeros where it lies in
    the bands that cover it, those bands drawn by the kernel as a block of the whole tensor's 2-D
    view, and the run cut out again. Past :data:`MOST_RUNS` runs, the span of all of them is
    drawn in one call (a split along the last dim: the whole tensor's bands, for its rows).

    The run's place in its first band is the shard's offset (data: every shard runs this code)
    modulo the band, so the covering bands are as many as the worst place needs: the run's
    length plus a band, rounded up to whole bands."""
    shared_row, numel, columns, _, band = _bands(global_shape, shared_over_first_dim)
    # A first dim of 1 shares nothing: its noise is the tensor's own.
    shared_over_first_dim = shared_over_first_dim and shared_row
    if band > 2**31:
        raise ValueError(f"a tensor of shape {tuple(global_shape)} has bands of {band} elements; a shard of it "
                         f"that is not whole bands is drawn for bands of at most 2**31")
    index_shape = tuple(global_shape[1:]) if shared_over_first_dim else tuple(global_shape)
    block = tuple(shape[1:]) if shared_over_first_dim else tuple(shape)
    lead = shape[0] if shared_over_first_dim else 1
    view = (lead, numel) if shared_over_first_dim else (numel // columns, columns)
    offset = tuple(lax.bitcast_convert_type(shard_offset, jnp.uint32))
    misplaced = prng.remainder_wide(offset, band)

    def drawn(pieces, length: int, start, place):
        """The noise of ``length`` indices at ``place`` in the covering bands from ``start``
        (uint32 words, a band's first), the ``pieces`` of the operands (``(lead, length)``) put
        there, cut out."""
        span = tiling.round_up(length + band - 1, band)
        rows = lead if shared_over_first_dim or view[0] == 1 else span // columns
        covering = tuple(lax.dynamic_update_slice(jnp.zeros((lead, span), piece.dtype), piece,
                                                  (np.int32(0), place)).reshape(rows, -1) for piece in pieces)
        words = lax.bitcast_convert_type(jnp.stack(start), jnp.int32)
        out = _noise_map_call(key_data, (rows, span * lead // rows), transform, out_dtype, covering,
                              shared_over_first_dim=shared_over_first_dim, global_shape=view, shard_offset=words,
                              **options).reshape(lead, span)
        return lax.dynamic_slice(out, (np.int32(0), place), (lead, length))

    run, starts = block_runs(block, index_shape)
    if len(starts) <= MOST_RUNS:
        pieces = [operand.reshape(lead, -1, run) for operand in operands]
        outputs = []
        for index, relative in enumerate(starts):
            place = (misplaced + np.uint32(relative % band)) % np.uint32(band)
            start = prng.minus_word(prng.add_wide(offset, (np.uint32(relative >> 32), np.uint32(relative & 0xFFFFFFFF))),
                                    place)
            outputs.append(drawn([piece[:, index] for piece in pieces], run, start, place.astype(jnp.int32)))
        return jnp.stack(outputs, axis=1).reshape(shape)
    # The span: the shard placed in the whole tensor's dims after its first, zeros between its runs.
    extent = block[0] * math.prod(index_shape[1:])
    pieces = [jnp.pad(operand.reshape(lead, *block), [(0, 0), (0, 0)] + [(0, whole - size) for size, whole in
                                                                      zip(block[1:], index_shape[1:])]
                      ).reshape(lead, extent) for operand in operands]
    out = drawn(pieces, extent, prng.minus_word(offset, misplaced), misplaced.astype(jnp.int32))
    return out.reshape(lead, block[0], *index_shape[1:])[(slice(None),) + tuple(slice(0, size) for size in block)
                                                          ].reshape(shape)


def swaps_first_dims(global_shape, shared_over_first_dim: bool) -> bool:
    """Whether a per-tile impl sees a tensor of ``global_shape`` with its first two dims swapped
    (:func:`tiling.first_dims_swapped`; a mask shared over the first dim never is)."""
    return not shared_over_first_dim and tiling.first_dims_swapped(global_shape)


def _swapped_offset(shard_offset: jax.Array, global_shape) -> jax.Array:
    """int32 ``[high, low]`` words of the flat index, in the tensor of ``global_shape`` with its
    first two dims swapped, of the element at flat index ``shard_offset`` (the same words) in the
    tensor: ``(i, j, k)`` at ``(i * L + j) * C + k`` goes to ``(j * B + i) * C + k``, for
    ``global_shape = (B, L, *rest)`` and ``C`` the elements of ``rest``. From word arithmetic: the
    row ``i * L + j`` is below 2**31 (Pallas numbers rows with int32), so its word is an exact
    quotient (:func:`prng.exact_quotient_word`)."""
    batch, length, inner = global_shape[0], global_shape[1], math.prod(global_shape[2:])
    offset = tuple(lax.bitcast_convert_type(shard_offset, jnp.uint32))
    column = prng.remainder_wide(offset, inner)
    row = prng.exact_quotient_word(prng.minus_word(offset, column), inner)
    j = row % np.uint32(length)
    i = row // np.uint32(length)
    swapped = prng.add_wide(prng.add_wide(prng.multiply_wide(j, batch * inner), prng.multiply_wide(i, inner)),
                            (np.uint32(0), column))
    return lax.bitcast_convert_type(jnp.stack(swapped), jnp.int32)


def index_count(global_shape, shared_over_first_dim: bool = False) -> int:
    """How many flat indices the noise of a tensor of ``global_shape`` uses: its elements, or
    with ``shared_over_first_dim`` those of ``global_shape[1:]``."""
    return math.prod(global_shape[1:] if shared_over_first_dim else global_shape)


def _first_tile(shard_offset: jax.Array, global_cols: int, one_row: bool, seed_tile: tuple[int, int]) -> jax.Array:
    """int32 (1,): the index of a shard's first seed tile in the whole tensor's view (see
    :func:`per_tile_view`), from the 64-bit flat index of its first element, an int32 (2,)
    ``[high, low]``. The shard starts a whole tile of a one-row view, else a whole band of
    ``global_cols * seed_tile[0]`` elements, so the quotients are exact (:func:`prng.exact_quotient_word`:
    Mosaic and XLA on TPU have no 64-bit integers; the tile index itself fits one word, and
    wraps as the int32 arithmetic of JAX's ``sample_block`` does)."""
    tile_rows, tile_cols = seed_tile
    first = prng.exact_quotient_word(tuple(lax.bitcast_convert_type(shard_offset, jnp.uint32)),
                                     tile_cols if one_row else global_cols * tile_rows)
    if not one_row:
        first = first * np.uint32(tiling.round_up(global_cols, tile_cols) // tile_cols)
    return lax.bitcast_convert_type(first, jnp.int32).reshape(1)


def noise_map(key_data: jax.Array, shape, transform, out_dtype, operands: tuple = (), *,
              impl: str, interpret: bool, blocks: tiling.ElementwiseBlocks | None = None,
              shared_over_first_dim: bool = False, global_shape=None,
              shard_offset: jax.Array | None = None, name: str = "noise",
              element_cost: tuple[int, int] = (0, 0), uniform_bits: int = 32,
              tiled_hash_in_pieces: bool | None = None) -> jax.Array:
    """``transform(bits, *operands)`` over a tensor of ``shape``, in one Pallas kernel.

    Element ``i`` (row-major) gets the random bits of flat index ``i`` under ``impl`` (the
    per-tile impls: of its place in the tiles of :func:`per_tile_view`, the tensor's first two
    dims swapped where :func:`tiling.first_dims_swapped`), so the result does not depend on
    ``blocks`` or (threefry, tiled) the backend. A shard of a larger
    tensor (``global_shape``) gets the bits of its elements' indices in that tensor, so the
    shards of a sharded run together hold exactly the unsharded run's noise: any shard (a
    per-tile impl draws one that is not whole bands of its tiles in the bands that cover it,
    :func:`_in_covering_bands`; for a tensor seen swapped, the swapped tensor's shard).

    Args:
        key_data: int32 (2,) threefry key words.
        shape: the tensor's (or shard's) shape (at least one element).
        transform: ``f(bits, *operand_chunks)`` -> chunk of ``out_dtype``.
        out_dtype: the kernel's output dtype.
        operands: arrays of ``shape`` read elementwise (none for sampling).
        impl, interpret, blocks: see :func:`sampling.sample`.
        shared_over_first_dim: every index along ``shape[0]`` gets the noise of a tensor
            of shape ``shape[1:]`` (for example one dropout mask per sequence, shared over
            time).
        global_shape: the whole tensor's shape when ``shape`` is a shard of it; default
            ``shape``.
        shard_offset: with ``global_shape``, an int32 (2,) array ``[high, low]``: the
            words of the 64-bit flat index in the whole tensor of the shard's first element
            (with ``shared_over_first_dim``, of its first element along the other dims).
            Data, not a static value: every shard runs the same compiled kernel.
        name: the kernel's name for XLA (:func:`calls.kernel_name` adds ``impl`` and the blocks).
        element_cost: ``transform``'s flops and transcendentals per element, for the kernel's
            cost estimate (the noise's own work is added).
        uniform_bits: how many top bits of each element's bits ``transform`` reads: 32, or
            :data:`prng.DROPOUT_BITS` (the tiled impl then fills four elements per hash).
        tiled_hash_in_pieces: whether the tiled impl draws each tile 8 hash-grid rows at a time
            (the same bits); default :data:`compat.TILED_HASH_IN_PIECES`. Tests draw both ways
            on either JAX version.

    Raises:
        ValueError: an unknown impl, ``impl="hardware"`` in interpret mode, a threefry shard
            that is split along more than two dims besides the first, a
            ``shard_offset`` of another shape, a 2-D view with a dim of 2**31 or more
            (Pallas numbers blocks with int32), or blocks that
            :func:`tiling.resolve_elementwise` rejects.
    """
    prng.check_can_run(impl, interpret)
    per_tile = prng.per_tile(impl)
    sharded = global_shape is not None
    if per_tile and interpret and jnp.dtype(out_dtype) == jnp.bfloat16:
        # The per-tile loop's 16-bit stores took time quadratic in the block's rows under jax 0.7.1
        # on the CPU (dropout of 2**22 elements: 2 s, ~270x threefry's, where float32 took 1.6x): the
        # kernel runs in float32, which holds the 16-bit operands and results exactly, and the
        # result is rounded once, here.
        wide = noise_map(key_data, shape, functools.partial(_in_float32, transform=transform), jnp.float32,
                         tuple(operand.astype(jnp.float32) for operand in operands), impl=impl,
                         interpret=interpret, blocks=blocks, shared_over_first_dim=shared_over_first_dim,
                         global_shape=global_shape, shard_offset=shard_offset, name=name, element_cost=element_cost,
                         uniform_bits=uniform_bits, tiled_hash_in_pieces=tiled_hash_in_pieces)
        return wide.astype(out_dtype)
    if sharded and tuple(shard_offset.shape) != (2,):
        raise ValueError(f"shard_offset must have shape (2,) (the high and low words of a flat index), "
                         f"got {tuple(shard_offset.shape)}")
    if per_tile and swaps_first_dims(global_shape if sharded else shape, shared_over_first_dim):
        out = noise_map(key_data, swap_first_dims(shape), transform, out_dtype,
                        tuple(jnp.swapaxes(operand, 0, 1) for operand in operands), impl=impl,
                        interpret=interpret, blocks=blocks,
                        global_shape=swap_first_dims(global_shape) if sharded else None,
                        shard_offset=_swapped_offset(shard_offset, global_shape) if sharded else None, name=name,
                        element_cost=element_cost, uniform_bits=uniform_bits,
                        tiled_hash_in_pieces=tiled_hash_in_pieces)
        return jnp.swapaxes(out, 0, 1)
    if per_tile and sharded and not draws_whole_bands(shape, global_shape, shared_over_first_dim):
        return _in_covering_bands(key_data, shape, transform, out_dtype, operands, global_shape=global_shape,
                                  shard_offset=shard_offset, shared_over_first_dim=shared_over_first_dim, impl=impl,
                                  interpret=interpret, blocks=blocks, name=name, element_cost=element_cost,
                                  uniform_bits=uniform_bits, tiled_hash_in_pieces=tiled_hash_in_pieces)
    return _noise_map_call(key_data, shape, transform, out_dtype, operands, impl=impl, interpret=interpret,
                           blocks=blocks, shared_over_first_dim=shared_over_first_dim, global_shape=global_shape,
                           shard_offset=shard_offset, name=name, element_cost=element_cost,
                           uniform_bits=uniform_bits, tiled_hash_in_pieces=tiled_hash_in_pieces)


def _noise_map_call(key_data, shape, transform, out_dtype, operands, *, impl, interpret, blocks, shared_over_first_dim,
                    global_shape, shard_offset, name, element_cost, uniform_bits, tiled_hash_in_pieces) -> jax.Array:
    """:func:`noise_map`'s kernel call on a tensor, or a shard of one that its kernel draws as it
    is (for a per-tile impl, whole bands starting at a band: :func:`draws_whole_bands`)."""
    per_tile = prng.per_tile(impl)
    sharded = global_shape is not None
    # The counters' high words are 0 unless an index reaches 2**32: then they are computed.
    wide = not per_tile and index_count(global_shape if sharded else shape, shared_over_first_dim) > 2**32
    outer, outer_stride = 1, None
    seed_tile = None
    if per_tile:
        rows, cols, shared_row, global_cols, seed_tile = per_tile_view(
            shape, global_shape if sharded else shape, shared_over_first_dim, impl)
        # Per-tile seeding needs whole tiles: the columns are padded to them (computed and sliced
        # off); the last tile row may be cut, its blocks reaching past the view (their rows there
        # drawn and dropped), so no copy pads the rows. A shared row's view rows are the first
        # dim's, whose every row reads the tile's row 0, padded to whole sublanes.
        view_rows = tiling.round_up(rows, tiling.SUBLANES) if shared_row else rows
        view_cols = tiling.round_up(cols, seed_tile[1])
        row_stride = 0 if shared_row else view_cols
        if sharded:
            shard_offset = _first_tile(shard_offset, global_cols,
                                       index_count(global_shape, shared_over_first_dim) == global_cols, seed_tile)
    else:
        dims = check_index_dims(shape, global_shape if sharded else shape, shared_over_first_dim)
        if len(dims) == 3:
            outer, outer_stride = dims[0]
        if len(dims) == 1:
            # Contiguous: any 2-D view keeps the flat order, so take the one XLA's ops beside it prefer.
            rows, cols = tiling.view_2d(shape)
            row_stride = cols
        else:
            (rows, row_stride), (cols, _) = dims[-2:]
        view_rows, view_cols = rows, cols
    if max(outer, view_rows, view_cols) >= 2**31:
        raise ValueError(f"a tensor of shape {tuple(shape)} is seen as a {view_rows}x{view_cols} matrix"
                         f"{f' {outer} times' if outer > 1 else ''}, and Pallas numbers the blocks along a dim "
                         "with int32: a dim of 2**31 or more is not supported")
    itemsize = max([jnp.dtype(out_dtype).itemsize, *(operand.dtype.itemsize for operand in operands)])
    blocks = tiling.resolve_elementwise(blocks, view_rows, view_cols, itemsize, interpret=interpret,
                                        seed_tile=seed_tile)

    grid = (pl.cdiv(view_rows, blocks.rows), pl.cdiv(view_cols, blocks.cols))
    block_shape = (blocks.rows, blocks.cols)
    if blocks.column_major_grid:
        grid, index_map = grid[::-1], lambda j, i: (i, j)
    else:
        index_map = lambda i, j: (i, j)  # noqa: E731
    if outer_stride is not None:
        grid, block_shape = (outer, *grid), (pl.Squeezed(), *block_shape)
        index_map = lambda o, *ij, view_index=index_map: (o, *view_index(*ij))  # noqa: E731
    block_spec = pl.BlockSpec(block_shape, index_map)
    view_shape = (view_rows, view_cols) if outer_stride is None else (outer, view_rows, view_cols)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    in_specs = [smem]
    arguments = [prng.key_words(key_data, impl)]
    if sharded:
        in_specs.append(smem)
        arguments.append(shard_offset)
    for operand in operands:
        operand = operand.reshape(view_shape if not per_tile else (rows, cols))
        if per_tile and (view_rows, view_cols) != (rows, cols):
            operand = jnp.pad(operand, ((0, view_rows - rows), (0, view_cols - cols)))
        in_specs.append(block_spec)
        arguments.append(operand)
    out_shape = jax.ShapeDtypeStruct(view_shape, out_dtype)
    chunk_shape = tiling.chunk_shape(blocks, interpret=interpret, seed_tile=seed_tile)
    elements = math.prod(view_shape)
    # A mask shared over the first dim draws threefry bits for one row of each chunk.
    drawn = elements // chunk_shape[0] if row_stride == 0 and not per_tile else elements
    flops, transcendentals = element_cost
    cost = calls.cost_estimate(bytes_accessed=calls.nbytes(*arguments, out_shape),
                               flops=drawn * prng.noise_ops(impl, uniform_bits) + elements * flops,
                               transcendentals=elements * transcendentals)
    name = calls.kernel_name(name, impl, "columns" if blocks.column_major_grid else "",
                             blocks=(blocks.rows, blocks.cols))
    kernel = functools.partial(
        _noise_kernel, impl=impl, transform=transform, row_stride=row_stride, view_cols=view_cols,
        outer_stride=outer_stride, sharded=sharded, wide=wide, column_major_grid=blocks.column_major_grid,
        chunk_shape=chunk_shape, uniform_bits=uniform_bits,
        tiled_hash_in_pieces=compat.TILED_HASH_IN_PIECES if tiled_hash_in_pieces is None else tiled_hash_in_pieces)
    out = calls.pallas_call(
        kernel,
        name=name,
        cost_estimate=cost,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=block_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid)),
        interpret=interpret,
    )(*arguments)
    if (view_rows, view_cols) != (rows, cols):
        out = out[:rows, :cols]
    return _in_own_layout(out.reshape(shape), two_d_rows=outer_stride is None and len(shape) >= 3 and cols == shape[-1])


def _in_float32(bits, *operands, transform):
    return transform(bits, *operands).astype(jnp.float32)


def swap_first_dims(shape) -> tuple:
    """``shape`` (a shape or a position in one) with its first two entries swapped."""
    return (shape[1], shape[0], *shape[2:])


def _in_own_layout(out: jax.Array, *, two_d_rows: bool) -> jax.Array:
    """``out``, the kernel's result reshaped from its ``two_d_rows`` (the tensor's own rows in
    2-D) to its tensor's shape, held there by a barrier where that reshape is a copy on TPU:
    a 3-D or wider tensor whose second-minor dim is not whole sublane tiles (ViT's 197
    tokens) under threefry (the per-tile impls read ViT's swapped, in XLA's own layout:
    :func:`tiling.first_dims_swapped`). Without it XLA folds the reshape into the consumers'
    own reshapes to 2-D rows, so a matmul of the result (a Linear's gradient) runs on the
    kernel's rows and its output, 4x wider in an MLP, is what gets copied to the tensor's
    padded layout."""
    if two_d_rows and out.shape[-2] % tiling.sublane_tile(out.dtype.itemsize):
        return lax.optimization_barrier(out)
    return out
