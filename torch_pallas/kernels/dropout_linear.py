"""Dropout of a linear layer's input and the layer's product in one Pallas kernel:
``dropout(x) @ weight.T``, as ``nn.Linear(dropout(x))`` computes it (PEFT's LoRA
``lora_A(dropout(x))``, T5's ``wo(dropout(h))``, a classifier head after its dropout).

Apart, the dropout kernel writes the dropped ``x``, the product reads it back, and autograd
keeps it for the weight's gradient: a copy of ``x`` per consumer. Here the forward kernel reads
``x`` once and writes only ``(M, N)``; the backward kernel regenerates the mask from the 8-byte
key and writes ``x``'s gradient and the weight's. Nothing is saved but ``x`` itself, which
several consumers of one ``x`` (q, k and v; gate and up) share.

The mask is :func:`dropout.dropout`'s for the same key, bit for bit, on every impl: ``x`` is
seen as the ``(M, K)`` rows of its last dim, which must be the dropout's own 2-D view of ``x``
for the per-tile impls (:func:`takes`), and a kept element is ``x / q`` rounded to ``x``'s
dtype (``q`` :func:`prng.keep_probability`), as the dropout kernel writes it. The products
accumulate in float32. ``x``'s gradient is dropout's backward of ``grad @ weight`` rounded to
``x``'s dtype, as autograd computes it apart.

A float32 weight takes a 16-bit ``x`` as ``x.to(float32)`` (:func:`widens`): PEFT casts a
bfloat16 model's activations to its float32 adapters' dtype before their dropout, and the kernel
then reads the 16-bit ``x`` instead of a float32 copy, with the same mask, values and gradients.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments, calls, prng, tiling
from torch_pallas.kernels.dropout import kept_values

# Elements of one block of ``x``: 2 MiB of float32, double-buffered beside its bits and the
# dropped values, well within v4's 16 MiB of scoped VMEM.
_BLOCK_ELEMENTS = 2**19
# Rows and columns of a threefry chunk: a few vregs of bits at a time (as the elementwise kernels).
_THREEFRY_CHUNK = (64, 1024)
# Per element of ``x``, for the cost estimate: the mask's scaling, ``x * 0`` and the select.
_MASK_FLOPS = 3


def check_shapes(x_shape, weight_shape) -> None:
    """Raises ValueError unless ``x (..., K)`` and ``weight (N, K)`` share ``K``."""
    if len(x_shape) < 1 or len(weight_shape) != 2 or x_shape[-1] != weight_shape[1]:
        raise ValueError(f"x (..., K) and weight (N, K) must share K, got {tuple(x_shape)} and "
                         f"{tuple(weight_shape)}")


def widens(x_dtype, weight_dtype) -> bool:
    """Whether the kernels take an ``x`` of ``x_dtype`` with a weight of ``weight_dtype`` as
    ``x.to(weight_dtype)``: a 16-bit ``x`` with a float32 weight."""
    return jnp.dtype(weight_dtype) == jnp.float32 and jnp.dtype(x_dtype) in (jnp.bfloat16, jnp.float16)


def _rows(x_shape) -> tuple[int, int]:
    """(M, K): ``x``'s rows of its last dim."""
    return math.prod(x_shape[:-1]), x_shape[-1]


def takes(x_shape, impl: str) -> bool:
    """Whether the kernels draw ``x``'s dropout mask over its ``(M, K)`` rows: always with
    threefry (a flat index is ``row * K + col`` in any view) while every index stays below
    2**32; with a per-tile impl when those rows are the dropout's own 2-D view of ``x``
    (:func:`tiling.view_2d`: ``K`` a multiple of 128, at least 8 rows, and not a tensor the
    per-tile impls see with its first two dims swapped)."""
    M, K = _rows(x_shape)
    if M == 0 or K == 0:
        return False
    if not prng.per_tile(impl):
        return M * K <= 2**32
    return tiling.view_2d(tuple(x_shape)) == (M, K) and not tiling.first_dims_swapped(tuple(x_shape))


@functools.lru_cache(maxsize=None)
def _layout(M: int, K: int, impl: str, interpret: bool, global_rows: int):
    """(block rows, block cols, chunk rows, chunk cols) over the ``(M, K)`` rows, a block of
    the ``(global_rows, K)`` rows of a whole tensor: a per-tile impl's chunk is one tile of
    :func:`tiling.hardware_tile` of the whole tensor's rows (the dropout's seed tile) and blocks
    are whole tiles; threefry's chunk is a few vregs, and its blocks whole chunks (or all of
    ``K`` where no 128-lane multiple divides it)."""
    if prng.per_tile(impl):
        chunk_rows, chunk_cols = tiling.hardware_tile(global_rows, K)
    else:
        chunk_cols = next((c for c in (1024, 512, 256, tiling.LANES) if K % c == 0), K)
        chunk_rows = min(_THREEFRY_CHUNK[0], tiling.round_up(M, tiling.SUBLANES))
    # Columns: whole chunks dividing K, at most a quarter of the block's elements.
    col_chunks = K // chunk_cols
    per_block = max(1, _BLOCK_ELEMENTS // 4 // (chunk_rows * chunk_cols))
    block_cols = chunk_cols * max(d for d in range(1, col_chunks + 1) if col_chunks % d == 0 and d <= per_block)
    block_rows = chunk_rows * max(1, _BLOCK_ELEMENTS // (block_cols * chunk_rows))
    block_rows = min(block_rows, tiling.round_up(M, chunk_rows))
    if interpret:  # few large blocks: each grid step is a Python-level loop iteration
        block_rows = tiling.round_up(M, chunk_rows)
    return block_rows, block_cols, chunk_rows, chunk_cols


def row_tile(global_shape, impl: str) -> int:
    """What the first row of a block of the rows of a tensor of ``global_shape`` must be a
    multiple of for the kernels to draw its part of the tensor's mask: the seed tile's rows
    (:func:`tiling.hardware_tile`) for a per-tile impl, any row for threefry."""
    return tiling.hardware_tile(*_rows(global_shape))[0] if prng.per_tile(impl) else 1


def takes_rows(x_shape, global_shape, first_row: int, impl: str) -> bool:
    """Whether the kernels draw, for ``x`` the ``(M, K)`` rows from ``first_row`` on of the rows
    of a tensor of ``global_shape``, their part of that tensor's mask: the whole tensor's rows
    :func:`takes` for ``impl``, and ``first_row`` a multiple of :func:`row_tile`."""
    M, K = _rows(x_shape)
    global_rows, global_K = _rows(global_shape)
    return (K == global_K and M > 0 and 0 <= first_row <= global_rows - M and takes(global_shape, impl)
            and first_row % row_tile(global_shape, impl) == 0)


def _checked(key_data, x, weight, p, impl, interpret, global_shape, first_row):
    p = arguments.check_probability(p)
    prng.check_can_run(impl, interpret)
    check_shapes(x.shape, weight.shape)
    if weight.dtype != x.dtype and not widens(x.dtype, weight.dtype):
        raise TypeError(f"weight must have x's dtype {x.dtype} (or float32 for a 16-bit x, taken as "
                        f"x.to(float32)), got {weight.dtype}")
    if global_shape is None and not takes(x.shape, impl):
        raise ValueError(f"impl={impl!r} does not draw the mask of x of shape {tuple(x.shape)} over its (M, K) rows "
                         "(see dropout_linear.takes): run dropout and the product apart")
    # A shard's first row is data (shard_offset): each shard's is a multiple of its rows.
    row = _rows(x.shape)[0] if first_row is None else first_row
    if global_shape is not None and not takes_rows(x.shape, global_shape, row, impl):
        raise ValueError(f"impl={impl!r} does not draw, for x of shape {tuple(x.shape)} at row {row} of the "
                         f"rows of a tensor of shape {tuple(global_shape)}, its part of that tensor's mask (see "
                         "dropout_linear.takes_rows): run dropout and the product apart")
    return p, prng.key_words(key_data, impl)


def _with_first_row(words, first_row, shard_offset, K: int):
    """The kernels' SMEM words and their static first row: with ``shard_offset`` (a shard's
    ``[high, low]`` flat offset words) the first row is data, appended to the key's words
    (``None`` returned in its place)."""
    if shard_offset is None:
        return words, first_row
    # The whole tensor's rows hold fewer than 2**32 elements (takes): the high word is 0.
    row = (shard_offset.reshape(2)[1].astype(jnp.uint32) // np.uint32(K)).astype(jnp.int32)
    return jnp.concatenate([words, row[None]]), None


class _Prepared(NamedTuple):
    p: float
    words: jax.Array  # the kernels' SMEM words (_with_first_row)
    first_row: int | None
    M: int
    K: int
    N: int
    block: tuple[int, int]
    chunk: tuple[int, int]


def _prepared(key_data, x, weight, p, impl, interpret, global_shape, first_row, shard_offset) -> _Prepared:
    """What both kernels start from: the arguments checked (:func:`_checked`), the SMEM words
    with a shard's first row as data where ``shard_offset`` gives it, ``x``'s rows and the
    blocks over them (:func:`_layout`)."""
    first_row = None if shard_offset is not None else first_row
    p, words = _checked(key_data, x, weight, p, impl, interpret, global_shape, first_row)
    M, K = _rows(x.shape)
    words, first_row = _with_first_row(words, first_row, shard_offset, K)
    block_rows, block_cols, *chunk = _layout(M, K, impl, interpret, _rows(global_shape or x.shape)[0])
    return _Prepared(p, words, first_row, M, K, weight.shape[0], (block_rows, block_cols), tuple(chunk))


def _row_block(half, i, per_half):
    """The backward grid's block of rows at step ``i`` of ``half`` (``per_half`` blocks each)."""
    return half * per_half + i


def _first_row(key_ref, first_row):
    """The kernels' first row: static, or the data after the key's words (:func:`_with_first_row`)."""
    return key_ref[key_ref.shape[0] - 1] if first_row is None else first_row


def _chunk(key_ref, x_ref, w_ref, row, col, row0, col0, *, impl, keep_probability, K, chunk):
    """The chunk at (row, col) of the block, at (row0, col0) of the ``(M, K)`` rows: its row and
    column slices, its mask (the dropout kernel's: the same bits at the same place) and its ``x``,
    widened to the weight's dtype (:func:`widens`)."""
    rows, cols = pl.ds(row, chunk[0]), pl.ds(col, chunk[1])
    bits = prng.chunk_bits(impl, key_ref, chunk, row0, col0, K, uniform_bits=prng.DROPOUT_BITS)
    return rows, cols, prng.kept(impl, bits, keep_probability), x_ref[rows, cols].astype(w_ref.dtype)


def _dot(a, b, interpret: bool):
    """``a @ b`` accumulated in float32. In interpret mode 16-bit operands are widened first
    (exactly): XLA's CPU runtime under torch_xla 2.9 has no bfloat16 x bfloat16 = float32 dot
    for some shapes ("Unsupported element type for DotThunk")."""
    if interpret:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _walk(block, chunk, body):
    """``body(row_offset, col_offset)`` for every chunk of a block: a loop over rows (bounded
    code whatever the block), the columns unrolled (static lane offsets)."""
    row_chunks = block[0] // chunk[0]

    def step(index, carry):
        row = pl.multiple_of(index * chunk[0], chunk[0]) if row_chunks > 1 else 0
        for col in range(0, block[1], chunk[1]):
            body(row, col)
        return carry

    if row_chunks == 1:
        step(0, 0)
    else:
        lax.fori_loop(0, row_chunks, step, 0)


def _forward_kernel(key_ref, x_ref, w_ref, out_ref, acc_ref, *, impl, keep_probability, K, chunk, first_row,
                    interpret):
    i, k = pl.program_id(0), pl.program_id(1)
    block = x_ref.shape

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def body(row, col):
        row0 = _first_row(key_ref, first_row) + i * block[0] + row
        rows, cols, keep, x = _chunk(key_ref, x_ref, w_ref, row, col, row0, k * block[1] + col, impl=impl,
                                     keep_probability=keep_probability, K=K, chunk=chunk)
        dropped = kept_values(keep, x, keep_probability).astype(x.dtype)
        acc_ref[rows, :] += _dot(dropped, w_ref[cols, :], interpret)

    _walk(block, chunk, body)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def dropout_linear_forward(key_data, x, weight, *, p: float, impl: str = prng.DROPOUT_DEFAULT, interpret: bool,
                           global_shape=None, first_row: int = 0, shard_offset: jax.Array | None = None):
    """``dropout(x, p) @ weight.T`` in one kernel (see the module docstring).

    Args:
        key_data: int32 (2,) threefry key words.
        x: ``(..., K)`` float32, bfloat16 or float16, whose rows :func:`takes` for ``impl``.
        weight: ``(N, K)`` of ``x``'s dtype, or float32 for a 16-bit ``x`` (:func:`widens`).
        p: drop probability in [0, 1].
        impl: ``"threefry"``, ``"tiled"`` or ``"hardware"`` (compiled on TPU only).
        interpret: run Pallas in interpret mode (any platform) or compiled (TPU).
        global_shape, first_row: ``x`` is the rows from ``first_row`` on of the ``(M, K)``
            rows of a tensor of ``global_shape`` (a DTensor's local shard), and is dropped with
            its part of that tensor's mask (:func:`takes_rows`).
        shard_offset: int32 ``[high, low]`` words of the flat index of ``x``'s first element
            in a tensor of ``global_shape``, as data (an SPMD shard, split along its rows
            into shards of ``x``'s rows), in place of ``first_row``.

    Returns:
        ``(..., N)`` in the weight's dtype.

    Raises:
        ValueError: ``p`` outside [0, 1], shapes that do not pair, or an ``x`` whose mask the
            kernels do not draw over its rows (:func:`takes`).
        TypeError: a ``weight`` of another dtype than ``x``.
    """
    if x.dtype == jnp.float16:
        wide_x, wide_w = tiling.widen_float16(x, weight)
        return dropout_linear_forward(key_data, wide_x, wide_w, p=p, impl=impl, interpret=interpret,
                                      global_shape=global_shape, first_row=first_row,
                                      shard_offset=shard_offset).astype(weight.dtype)
    p, words, first_row, M, K, N, (block_rows, block_cols), chunk = _prepared(
        key_data, x, weight, p, impl, interpret, global_shape, first_row, shard_offset)
    grid = (pl.cdiv(M, block_rows), K // block_cols)
    x2 = x.reshape(M, K)
    out_shape = jax.ShapeDtypeStruct((M, N), weight.dtype)
    kernel = functools.partial(_forward_kernel, impl=impl, keep_probability=prng.keep_probability(impl, p), K=K,
                               chunk=chunk, first_row=first_row, interpret=interpret)
    out = calls.pallas_call(
        kernel,
        name=calls.kernel_name("dropout_linear", "fwd", impl, blocks=(block_rows, block_cols)),
        cost_estimate=calls.cost_estimate(
            bytes_accessed=calls.nbytes(x2, out_shape) + grid[0] * calls.nbytes(weight) + 8,
            flops=M * K * (2 * N + _MASK_FLOPS + prng.noise_ops(impl, prng.DROPOUT_BITS))),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((block_rows, block_cols), lambda i, k: (i, k)),
                  pl.BlockSpec((block_cols, N), lambda i, k: (k, 0))],
        out_specs=pl.BlockSpec((block_rows, N), lambda i, k: (i, 0)),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((block_rows, N), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(words, x2, weight.T)
    return out.reshape(*x.shape[:-1], N)


def _backward_kernel(key_ref, x_ref, w_ref, g_ref, grad_x_ref, grad_w_ref, *, impl, keep_probability, M, K, chunk,
                     first_row, per_half, interpret):
    half, k, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block = x_ref.shape

    # The weight's gradient block stays in VMEM across the half's rows (the inner axis): its sum.
    @pl.when(i == 0)
    def _():
        grad_w_ref[...] = jnp.zeros(grad_w_ref.shape, jnp.float32)

    def body(row, col):
        row0 = _row_block(half, i, per_half) * block[0] + row
        rows, cols, keep, x = _chunk(key_ref, x_ref, w_ref, row, col, _first_row(key_ref, first_row) + row0,
                                     k * block[1] + col,
                                     impl=impl, keep_probability=keep_probability, K=K, chunk=chunk)
        g = g_ref[rows, :]
        grad_dropped = _dot(g, w_ref[:, cols], interpret).astype(x.dtype)
        grad_x_ref[rows, cols] = kept_values(keep, grad_dropped, keep_probability).astype(grad_x_ref.dtype)
        # Rows past M (the last block's padding) hold whatever the buffer held: none of them
        # may reach the weight's gradient.
        valid = lax.broadcasted_iota(jnp.int32, (chunk[0], 1), 0) + row0 < M
        dropped = jnp.where(valid, kept_values(keep, x, keep_probability), 0.0).astype(x.dtype)
        g = jnp.where(valid, g, jnp.zeros_like(g))
        # (N, cols): the small gradient transposed, not the block of x.
        grad_w_ref[:, cols] += _dot(g.T, dropped, interpret)

    _walk(block, chunk, body)


def dropout_linear_backward_weight_rows(*args, **options):
    """:func:`dropout_linear_backward` on one SPMD shard of ``x``'s rows, the weight's gradient as
    a ``(1, N, K)`` row: the shards' rows are summed afterwards in a fixed order."""
    grad_x, grad_w = dropout_linear_backward(*args, **options)
    return grad_x, grad_w[None]


def dropout_linear_backward(key_data, x, weight, grad_out, *, p: float, impl: str = prng.DROPOUT_DEFAULT,
                            interpret: bool, global_shape=None, first_row: int = 0,
                            shard_offset: jax.Array | None = None):
    """The gradients of :func:`dropout_linear_forward` with respect to ``x`` and ``weight``,
    given the same key and options and the output's gradient ``(..., N)``, in one kernel that
    regenerates the mask.

    Returns:
        ``(grad_x, grad_weight)``: ``x``'s shape and dtype, and ``weight``'s shape in float32
        (summed over every row of ``x`` in float32; round it to the weight's dtype once).
    """
    if x.dtype == jnp.float16:
        wide_x, wide_w, wide_g = tiling.widen_float16(x, weight, grad_out)
        grad_x, grad_w = dropout_linear_backward(key_data, wide_x, wide_w, wide_g, p=p, impl=impl,
                                                 interpret=interpret, global_shape=global_shape, first_row=first_row,
                                                 shard_offset=shard_offset)
        return grad_x.astype(x.dtype), grad_w
    p, words, first_row, M, K, N, (block_rows, block_cols), chunk = _prepared(
        key_data, x, weight, p, impl, interpret, global_shape, first_row, shard_offset)
    # The weight's gradient sums over every row: the rows are the inner, sequential axis. Two
    # halves of them, where they split into whole blocks, are a parallel axis with a sum each
    # (added after): LoRA's K of 1024 is one block of columns, which alone would leave a
    # megacore's second TensorCore idle (bench/results/tpu_cost_lora.md).
    row_blocks = pl.cdiv(M, block_rows)
    halves = 2 if row_blocks % 2 == 0 else 1
    per_half = row_blocks // halves
    grid = (halves, K // block_cols, per_half)
    x2, g2 = x.reshape(M, K), grad_out.reshape(M, N).astype(weight.dtype)
    out_shapes = (jax.ShapeDtypeStruct((M, K), x.dtype), jax.ShapeDtypeStruct((halves, N, K), jnp.float32))
    kernel = functools.partial(_backward_kernel, impl=impl, keep_probability=prng.keep_probability(impl, p), M=M,
                               K=K, chunk=chunk, first_row=first_row, per_half=per_half, interpret=interpret)
    rows = functools.partial(_row_block, per_half=per_half)
    grad_x, grad_w = calls.pallas_call(
        kernel,
        name=calls.kernel_name("dropout_linear", "bwd", impl, blocks=(block_rows, block_cols)),
        cost_estimate=calls.cost_estimate(
            bytes_accessed=calls.nbytes(x2, weight, *out_shapes) + grid[1] * calls.nbytes(g2) + 8,
            flops=M * K * (4 * N + 2 * _MASK_FLOPS + prng.noise_ops(impl, prng.DROPOUT_BITS))),
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((block_rows, block_cols), lambda h, k, i: (rows(h, i), k)),
                  pl.BlockSpec((N, block_cols), lambda h, k, i: (0, k)),
                  pl.BlockSpec((block_rows, N), lambda h, k, i: (rows(h, i), 0))],
        out_specs=[pl.BlockSpec((block_rows, block_cols), lambda h, k, i: (rows(h, i), k)),
                   pl.BlockSpec((None, N, block_cols), lambda h, k, i: (h, 0, k))],
        out_shape=out_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(words, x2, weight, g2)
    return grad_x.reshape(x.shape), grad_w.sum(0)
