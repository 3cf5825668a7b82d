"""Scaled dot-product attention with dropout, in flash (online-softmax) Pallas kernels.

``softmax(query @ key^T * scale + bias)``, dropped out and multiplied by ``value``, where
the ``L x S`` probabilities never reach HBM: the forward kernel walks blocks of keys with a
running row maximum and sum and saves the output and the row log-sum-exp; the backward
kernels (one for the key and value gradients, one for the query's, FlashAttention-2's split)
recompute the probabilities from the log-sum-exp; where every key fits one block (short
sequences: ViT's 197 patches, BERT's 512 tokens) the first kernel also gives the query's
gradient, which is then complete per block of rows, so the probabilities and the mask are
computed once in the backward pass instead of twice. Where a plane is smaller than a block
(ViT's 197 x 197), a grid step takes several planes (:class:`AttentionBlocks` ``planes``), one
after the other, so the step's fixed cost is shared. Where one block holds every key, key and
value planes are read transposed, ``(E, S)``, if that takes fewer bytes in HBM
(:func:`lanes_transposed`: head dims under 128 lanes). Planes of at most 256 x 256 with at most a
mask shared by the heads (BERT's and GPT-2's 128 tokens, ViT's 197 patches) run
:mod:`heads_in_lanes`'s kernels instead, on the operands laid out as the model's projections hold
them. The dropout mask is regenerated in every kernel from the 8-byte key, per element of the
``(*batch, L, S)`` probabilities:

- ``impl="threefry"``: element ``(b, l, s)`` (``b`` the flat batch index) keeps its
  probability when ``jax.random.bernoulli(key, 1 - dropout_p, (*batch, L, S))`` is True
  there, bit for bit, so the mask is the one :func:`dropout.dropout` draws for the
  probabilities themselves, and any forward and backward blocks agree.
- ``impl="hardware"`` (TPU only): the hardware PRNG seeded per :func:`attention_tile` tile
  of each batch element's ``L x S`` plane as ``pltpu.sample_block`` seeds it, the tiles
  numbered row-major over the planes (``b * tiles_per_plane + tile_row * tiles_per_row +
  tile_col``, the plane padded to whole tiles); blocks are whole tiles (or the whole length,
  its last tiles drawn whole and cut), so any forward and backward blocks agree.
- ``impl="tiled"``: the same tiles, numbering and blocks, each tile's bits from
  :func:`prng.tiled_tile_bits` (16-bit uniforms, ``dropout_p`` in steps of 2**-16 and the kept
  weights scaled by the keep probability that gives, :func:`prng.keep_probability`).

Shapes and semantics are torch's ``scaled_dot_product_attention``: ``query (*batch, L, E)``,
``key (*batch', S, E)``, ``value (*batch', S, Ev)`` with batch dims broadcast (and with
``gqa`` the head dim, ``-3``, of ``key`` and ``value`` repeated to the query's),
``is_causal`` keeps ``s <= l`` (top-left aligned), a bias (an additive float mask, a boolean
mask made ``0``/``-inf``) broadcast to ``(*batch, L, S)``, and a row whose every score is
``-inf`` gives zeros (torch's safe softmax), forward and backward. float16 is computed in
float32 (Mosaic has no float16); bfloat16 feeds the matrix unit in bfloat16 and accumulates
in float32. The products run at Mosaic's default precision, which on a TPU is one bfloat16
pass of the matrix unit for float32 operands too (XLA's default on TPU): libtpu schedules such
a product in the bundles of a bfloat16 one, and ``Precision.HIGHEST`` in about six times as
many. So float32 operands may come rounded to bfloat16 with float32 results
(``result_dtype``), which loses nothing on a TPU and halves what the backward pass keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import arguments, calls, compat, prng, tiling

# The forward kernel keeps its row statistics (running maximum and sum) as (rows, ROW_STAT_LANES)
# float32 blocks, every lane the row's value (see _lanes). The log-sum-exp it writes, and
# rowsum(dO * O), which the backward kernels read, are one value per row (_row_stat_spec): in HBM
# a (rows, ROW_STAT_LANES) array is 128 times the bytes, which the forward kernel's writes and the
# slice after it cost (BERT's 128 tokens: 6 MiB a layer), and which XLA kept alive with the
# backward pass's other operands at a step's peak.
ROW_STAT_LANES = tiling.LANES
_HARDWARE_TILE_MAX_COLS = 512
_HARDWARE_TILE_MAX_ROWS = 256
# Planes per grid step: each is its own unrolled block, so more of them lengthen the kernel's code.
# On the compiler's schedule ViT-B/16's 384 planes of 197 x 197 (f32, forward and backward) take
# least at 8 per step on v4-v6e. A step's blocks are bounded in lanes per row (the head dims', and
# a mask's and its gradient's): VMEM (16 MiB on v4) holds 8 planes of 197 x 197 float32 at E = 128
# with a float mask, not 4 at E = 256 with one.
MAX_PLANES = 8
_SHORT_PLANE = (256, 256)
_MAX_PLANE_LANES = 8 * 2 * tiling.LANES
# How a grid step's consecutive output planes read an operand (_grouping).
_BLOCKED, _SHARED = "blocked", "shared"


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Rows of the query (``q``) and of the keys and values (``kv``) per grid step of an
    attention kernel: the score block is ``q x kv``. A block larger than its length is
    clamped to it; the lengths are padded to whole blocks (padded keys are masked out).
    ``planes``: batch elements (heads) per grid step, each its own ``q x kv`` block, or
    ``None`` for as many as :func:`resolve_blocks` finds fit."""
    q: int
    kv: int
    planes: int | None = None

    def __post_init__(self):
        tiling.check_positive_ints(self, ("q", "kv") if self.planes is None else ("q", "kv", "planes"))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one operand's flat batch index follows the output's: per output batch dim,
    (stride in the operand's flat batch index, 0 where broadcast; divisor, the GQA group
    size on the head dim else 1)."""
    dims: tuple[tuple[int, int], ...]

    def index(self, batch, b):
        index, inner = 0, math.prod(batch)
        for size, (stride, divisor) in zip(batch, self.dims):
            inner //= size
            if stride:
                index = index + (b // inner % size // divisor) * stride
        return index


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The shapes of one attention call, resolved once: output batch dims, lengths, head
    dims, and each operand's batch layout."""
    batch: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    kv_layout: _Layout
    bias_layout: _Layout | None
    bias_rows: int  # L, or 1 for a bias broadcast over the query rows

    @property
    def size(self):
        return math.prod(self.batch)


def weights_problem(batch, L: int, S: int, Ev: int) -> _Problem:
    """The problem of attention weights already computed, ``(*batch, L, S)``, multiplied by a
    value of the same batch dims, ``(*batch, S, Ev)``: what :func:`kept_weights` and
    :func:`resolve_blocks` need (no query or key). The weights are a float ``(L, S)`` plane per
    batch element, held in VMEM as a mask is: the planes a grid step takes count their lanes."""
    same = _layout(tuple(batch), tuple(batch))
    return _Problem(tuple(batch), L, S, 0, Ev, same, same, L)


def attention_tile(L: int, S: int) -> tuple[int, int]:
    """The tile the hardware PRNG is seeded per over a batch element's ``L x S`` plane: the
    lanes of :func:`tiling.hardware_tile` of the plane, at most 512 (a score block of whole
    tiles stays small enough for VMEM), and every row of ``L`` in whole 8-row sublanes where
    that is at most 256, else as many rows, up to 256, as divide ``L`` in whole sublanes.
    Seeding hashes a whole vreg and costs as much for a small tile as for a large one, so the
    tile is as large as the default blocks take: every forward and backward default block is
    whole tiles, and a short length is one row of tiles (ViT-B/16's 197 patches: 200 x 256,
    not 25 tiles of 8 x 256 per plane)."""
    cols = min(tiling.hardware_tile(L, S)[1], _HARDWARE_TILE_MAX_COLS)
    height = tiling.round_up(L, tiling.SUBLANES)
    if height <= _HARDWARE_TILE_MAX_ROWS:
        return height, cols
    rows = tiling.SUBLANES
    while rows * 2 <= _HARDWARE_TILE_MAX_ROWS and height % (rows * 2) == 0:
        rows *= 2
    return rows, cols


def _broadcast_batch(shapes, names):
    batch = []
    rank = max(len(shape) for shape in shapes)
    for d in range(rank):
        sizes = {shape[d - rank] for shape in shapes if d - rank >= -len(shape)} - {1}
        if len(sizes) > 1:
            raise ValueError(f"the batch dims of {', '.join(names)} do not broadcast: "
                             f"{', '.join(str(tuple(s)) for s in shapes)}")
        batch.append(sizes.pop() if sizes else 1)
    return tuple(batch)


def _layout(batch, operand_batch, group_dim=None, group=1) -> _Layout:
    operand_batch = (1,) * (len(batch) - len(operand_batch)) + tuple(operand_batch)
    strides = [math.prod(operand_batch[d + 1:]) for d in range(len(batch))]
    dims = []
    for d, (size, own) in enumerate(zip(batch, operand_batch)):
        divisor = group if d == group_dim else 1
        dims.append((0 if own == 1 and size != 1 else strides[d], divisor))
    return _Layout(tuple(dims))


def resolve_problem(query_shape, key_shape, value_shape, bias_shape=None, *, gqa: bool = False) -> _Problem:
    """The batch dims, lengths and layouts of an attention call, checked as torch checks them.

    Raises:
        ValueError: operands of fewer than 2 dims, key and value of other lengths or batch
            dims, head dims that differ between query and key, batch dims that do not
            broadcast, a GQA head count that does not divide the query's, or a bias that does
            not broadcast to ``(*batch, L, S)``.
    """
    for name, shape in (("query", query_shape), ("key", key_shape), ("value", value_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., length, head_dim), got shape {tuple(shape)}")
    *query_batch, L, E = query_shape
    *key_batch, S, key_E = key_shape
    *value_batch, value_S, Ev = value_shape
    if key_E != E:
        raise ValueError(f"query and key must have the same last dim, got {tuple(query_shape)} and {tuple(key_shape)}")
    if value_S != S or tuple(value_batch) != tuple(key_batch):
        raise ValueError(f"key and value must agree in every dim but the last, got {tuple(key_shape)} and "
                         f"{tuple(value_shape)}")
    group_dim, group = None, 1
    kv_batch = list(key_batch)
    if gqa and len(query_batch) >= 1 and len(key_batch) >= 1:
        query_heads, kv_heads = query_batch[-1], key_batch[-1]
        if kv_heads == 0 or query_heads % kv_heads:
            raise ValueError(f"enable_gqa needs the query's heads (dim -3, {query_heads}) to be a multiple of "
                             f"the key's and value's ({kv_heads})")
        group = query_heads // kv_heads
        kv_batch[-1] = query_heads
    batch = _broadcast_batch([tuple(query_batch), tuple(kv_batch)], ("query", "key and value"))
    if gqa and group > 1:
        group_dim = len(batch) - 1
    kv_layout = _layout(batch, key_batch, group_dim, group)
    bias_layout, bias_rows = None, L
    if bias_shape is not None:
        *bias_batch, bias_rows, bias_cols = (1,) * max(0, 2 - len(bias_shape)) + tuple(bias_shape)
        if (bias_rows not in (1, L) or bias_cols not in (1, S) or len(bias_batch) > len(batch)
                or any(own not in (1, size) for own, size in zip(bias_batch[::-1], batch[::-1]))):
            raise ValueError(f"attn_mask of shape {tuple(bias_shape)} does not broadcast to the attention weights' "
                             f"shape {(*batch, L, S)}")
        bias_layout = _layout(batch, bias_batch)
    return _Problem(tuple(batch), L, S, E, Ev, kv_layout, bias_layout, bias_rows)


def _default_blocks(interpret: bool, backward: bool) -> AttentionBlocks:
    if interpret:
        # Few grid steps: each costs a fixed host overhead in interpret mode.
        return AttentionBlocks(512, 512)
    # Larger blocks spread each grid step's fixed cost (pipeline bookkeeping, the row statistics'
    # loads and stores) over more scores: on the compiler's schedule (bench/tpu_cost.py --only
    # attention) forward (512, 512) and backward (256, 512) beat (256, 512) and (128, 256) on
    # v4-v6e, and they compile on each up to E=256 float32 with a full float bias.
    return AttentionBlocks(256, 512) if backward else AttentionBlocks(512, 512)


def _grouping(layout: _Layout | None, batch, planes: int) -> str | None:
    """How each run of ``planes`` consecutive output planes (from a multiple of ``planes``)
    reads an operand laid out by ``layout``: ``"blocked"``, as consecutive operand planes from
    a multiple of ``planes`` (one block of them); ``"shared"``, as one operand plane (a mask
    broadcast over heads); ``None``, otherwise (GQA groups smaller than ``planes``, say)."""
    if layout is None:
        return _SHARED
    size = math.prod(batch)
    groups = np.broadcast_to(layout.index(batch, np.arange(size)), (size,)).reshape(-1, planes)
    if (groups == groups[:, :1] + np.arange(planes)).all() and not (groups[:, 0] % planes).any():
        return _BLOCKED
    if (groups == groups[:, :1]).all():
        return _SHARED
    return None


def _planes_fit(problem: _Problem, planes: int) -> bool:
    return (problem.size % planes == 0 and _grouping(problem.kv_layout, problem.batch, planes) is not None
            and _grouping(problem.bias_layout, problem.batch, planes) is not None)


def _resolve_planes(planes: int | None, problem: _Problem, q: int, kv: int, max_planes: int) -> int:
    if planes is not None:
        if planes > max_planes or not _planes_fit(problem, planes):
            raise ValueError(f"blocks.planes={planes} must be at most {max_planes} and divide the {problem.size} "
                             "planes (batch elements) in runs that read whole blocks of key, value and mask planes")
        return planes
    # A grid step costs a fixed time (pipeline bookkeeping, the row statistics) whatever its block's
    # size: short planes (ViT's 197 x 197) share steps; a longer one's blocks are large enough.
    short = (q == problem.L and kv == problem.S and tiling.round_up(q, tiling.SUBLANES) <= _SHORT_PLANE[0]
             and tiling.round_up(kv, tiling.LANES) <= _SHORT_PLANE[1])
    if not short:
        return 1
    lanes = sum(tiling.round_up(n, tiling.LANES) for n in (problem.E, problem.Ev))
    if problem.bias_layout is not None:
        lanes += tiling.round_up(kv, tiling.LANES)
    fits = [n for n in range(1, max_planes + 1) if n * lanes <= _MAX_PLANE_LANES and _planes_fit(problem, n)]
    return max(fits, default=1)


def resolve_blocks(blocks: AttentionBlocks | None, problem: _Problem, *, impl: str, interpret: bool,
                   backward: bool = False, max_planes: int = MAX_PLANES) -> AttentionBlocks:
    """``blocks`` (or the default) clamped to the lengths and checked as Mosaic wants them:
    ``q`` a multiple of 8 or all of ``L``, ``kv`` a multiple of 128 or all of ``S``; for
    the per-tile impls (hardware, tiled) whole :func:`attention_tile` tiles or all of the length (the default is
    rounded up to them). A block of all of a length needs no padding of the operands: XLA
    would otherwise copy them padded, forward and backward, at HBM's cost. ``planes`` (where
    ``None``): 1, unless a block is a whole plane of at most 256 x 256 scores (padded to whole
    vregs); then the most, up to ``max_planes``, whose rows hold at most 8 x 256 lanes (``E``,
    ``Ev`` and with a mask ``kv``, each padded to 128), which divide the batch, and whose key,
    value and mask planes are whole blocks or one shared plane.

    Raises:
        TypeError: ``blocks`` is not an :class:`AttentionBlocks`.
        ValueError: a block Mosaic would reject, not whole tiles for a per-tile impl, or
            ``planes`` that do not group as above.
    """
    tile = attention_tile(problem.L, problem.S) if prng.per_tile(impl) else None
    if blocks is None:
        blocks = _default_blocks(interpret, backward)
        if tile is not None:
            blocks = AttentionBlocks(tiling.round_up(blocks.q, tile[0]), tiling.round_up(blocks.kv, tile[1]))
    elif not isinstance(blocks, AttentionBlocks):
        raise TypeError(f"blocks must be an AttentionBlocks or None, got {type(blocks).__name__}")
    q = min(blocks.q, problem.L)
    kv = min(blocks.kv, problem.S)
    if tile is not None:
        if (q != problem.L and q % tile[0]) or (kv != problem.S and kv % tile[1]):
            raise ValueError(f"blocks ({blocks.q}, {blocks.kv}) must be whole {tile} tiles (or the whole length) for "
                             f"impl={impl!r}, the tile its noise is drawn per over this {problem.L}x{problem.S} "
                             "plane")
    elif (q != problem.L and q % tiling.SUBLANES) or (kv != problem.S and kv % tiling.LANES):
        raise ValueError(f"blocks: ({q}, {kv}) over a {problem.L}x{problem.S} score matrix is rejected by Mosaic "
                         f"(TPU), on every platform: q must be a multiple of {tiling.SUBLANES} or L, kv a multiple "
                         f"of {tiling.LANES} or S")
    return AttentionBlocks(q, kv, _resolve_planes(blocks.planes, problem, q, kv, max_planes))


@dataclasses.dataclass(frozen=True)
class _Static:
    """What every kernel of one call shares (hashable: it configures ``functools.partial``)."""
    problem: _Problem
    blocks: AttentionBlocks
    dropout_p: float
    impl: str
    causal: bool
    scale: float
    wide: bool
    global_batch: tuple[int, ...] | None  # a shard's: the whole tensor's batch dims

    @property
    def tile(self):
        return attention_tile(self.problem.L, self.problem.S)

    @property
    def plane_dim(self):
        """The leading dim of a block of the step's planes: ``None`` (squeezed) for one."""
        return self.blocks.planes if self.blocks.planes > 1 else None

    @property
    def grid_planes(self):
        return self.problem.size // self.blocks.planes

    def scratch(self, *shape):
        """float32 VMEM scratch of ``shape`` per plane of the step."""
        return pltpu.VMEM(shape if self.plane_dim is None else (self.plane_dim, *shape), jnp.float32)

    def _blocked(self, layout):
        return self.plane_dim is not None and _grouping(layout, self.problem.batch, self.blocks.planes) == _BLOCKED

    @functools.cached_property
    def kv_blocked(self):
        """Whether the key and value have a block of the step's planes (not one shared plane),
        as the kernels' specs and their per-plane refs both read it."""
        return self._blocked(self.problem.kv_layout)

    @functools.cached_property
    def bias_blocked(self):
        """As :attr:`kv_blocked`, for the mask."""
        return self._blocked(self.problem.bias_layout)

    @property
    def S_padded(self):
        return tiling.round_up(self.problem.S, self.blocks.kv)

    @functools.cached_property
    def key_transposed(self):
        """Whether the kernels read the key as ``(E, S)`` planes: where one block holds every
        key and that takes fewer bytes (:func:`lanes_transposed`). Over several key blocks
        libtpu's schedule of the kernels is longer with ``(E, kv)`` blocks than ``(kv, E)``
        (GPT-2's 1024 keys in blocks of 512), shorter with one (BERT's 512, ViT's 197)."""
        return self._reads_transposed(self.problem.E)

    @functools.cached_property
    def value_transposed(self):
        """As :attr:`key_transposed`, for the value's ``(Ev, S)``."""
        return self._reads_transposed(self.problem.Ev)

    def _reads_transposed(self, cols: int) -> bool:
        return self.S_padded == self.blocks.kv and lanes_transposed(self.S_padded, cols)

    def kernel_name(self, kernel: str, phase: str) -> str:
        """``kernel``'s name for XLA (:func:`calls.kernel_name`) in ``phase``: the noise impl
        where it drops weights, causal, the planes per step (``p8``) and the score block."""
        return calls.kernel_name(kernel, phase, self.impl if self.dropout_p else "", "causal" if self.causal else "",
                                 f"p{self.blocks.planes}" if self.blocks.planes > 1 else "",
                                 blocks=(self.blocks.q, self.blocks.kv))

    def block_bytes(self, rows: int, cols: int, dtype, blocked: bool = True) -> int:
        """Bytes of a block of ``rows x cols`` per plane of the step (one plane where the
        step's planes share it: not ``blocked``)."""
        return (self.blocks.planes if blocked else 1) * rows * cols * jnp.dtype(dtype).itemsize


# Per score, besides its matrix products, its exponential and its dropout, for the kernels' cost
# estimates: the scaling, the row maximum or shift, the sum or the gradient's subtraction and
# product, a select.
_SCORE_FLOPS = 5


@dataclasses.dataclass(frozen=True)
class BlockWalk:
    """How an attention-shaped grid ``(plane steps, outer blocks, inner blocks)`` walks a
    ``static.problem``: ``runs`` of the (outer, inner) pairs of a plane step run (all, or with
    ``causal`` those that see a key at or before their last row)."""
    static: _Static
    num_outer: int
    num_inner: int
    runs: int

    @classmethod
    def of(cls, static: _Static, num_outer: int, num_inner: int, kv_major: bool) -> BlockWalk:
        num_q, num_kv = (num_inner, num_outer) if kv_major else (num_outer, num_inner)
        runs = num_q * num_kv
        if static.causal:
            runs = sum(min(_last_needed_kv_block(static, q_index), num_kv - 1) + 1 for q_index in range(num_q))
        return cls(static, num_outer, num_inner, runs)

    def fetched(self, block_bytes: int, follows: str) -> int:
        """Bytes a BlockSpec of ``block_bytes`` blocks moves from HBM when its block index (besides
        the plane) follows ``follows``: ``"outer"``, ``"inner"`` or ``"both"`` grid axes. Pallas
        fetches a block when its index differs from the previous step's: one that follows the
        inner axis alone is fetched again for each outer block (once per plane step where the
        inner axis has one block)."""
        fetches = {"outer": self.num_outer, "inner": self.runs if self.num_inner > 1 else 1, "both": self.runs}[follows]
        return self.static.grid_planes * fetches * block_bytes

    def cost(self, *, bytes_accessed: int, matmul_lanes: int, elementwise: int = _SCORE_FLOPS,
             exponentials: bool = True, dropout_selects: int = 1) -> pl.CostEstimate:
        """The estimate of a kernel whose every running score takes part in matrix products over
        ``matmul_lanes`` lanes in all (2 flops each), ``elementwise`` other flops, an exponential
        (``exponentials``) and with dropout its noise (:func:`prng.noise_ops`), keep test and
        ``dropout_selects`` selects."""
        static = self.static
        scores = static.problem.size * self.runs * static.blocks.q * static.blocks.kv
        per_score = 2 * matmul_lanes + elementwise
        if static.dropout_p:
            per_score += prng.noise_ops(static.impl, prng.DROPOUT_BITS) + 1 + dropout_selects
        return calls.cost_estimate(bytes_accessed=bytes_accessed, flops=scores * per_score,
                                   transcendentals=scores if exponentials else 0)


def lanes_transposed(rows: int, cols: int) -> bool:
    """Whether ``(rows, cols)`` planes take fewer bytes in HBM as ``(cols, rows)``. TPU arrays
    are stored in (8, 128) tiles, so an operand whose last dim is a head dim of 64 takes twice
    its bytes, and XLA keeps the kernels' copies of the key and value from the forward pass to
    the backward (ViT's ``[32, 12, 197, 64]``: 37.5 MiB each, 24 MiB as ``(64, 197)`` planes;
    GPT-2's 1024 keys: half). A whole tile either way stays as it is."""
    def tiled(r, c):
        return tiling.round_up(r, tiling.SUBLANES) * tiling.round_up(c, tiling.LANES)
    return tiled(cols, rows) < tiled(rows, cols)


def planes_as_read(operand, transposed: bool):
    """``operand``'s ``(batch, rows, cols)`` planes as a kernel reads them: transposed where
    ``transposed`` (:func:`lanes_transposed`)."""
    return jnp.swapaxes(operand, 1, 2) if transposed else operand


def plane_spec(plane_dim, rows: int, cols: int, transposed: bool, index_map):
    """The BlockSpec of ``(rows, cols)`` blocks of an operand's planes, read as
    :func:`planes_as_read` gives them; ``index_map(*grid)`` is (plane, row block)."""
    if transposed:
        def transposed_map(*grid):
            plane, row_block = index_map(*grid)
            return plane, 0, row_block
        return pl.BlockSpec((plane_dim, cols, rows), transposed_map)
    return pl.BlockSpec((plane_dim, rows, cols), lambda *grid: (*index_map(*grid), 0))


def matmul(a, b, b_transposed: bool):
    """``a @ b``, float32, with ``b`` given as ``b.T`` where ``b_transposed``."""
    return lax.dot_general(a, b, (((1,), (1 if b_transposed else 0,)), ((), ())), preferred_element_type=jnp.float32)


class _PlaneRef:
    """Plane ``h`` of a ref whose leading dim is the grid step's planes, read and written by
    loads and stores at ``h`` (Mosaic rejects a view of one plane whose last dims are not whole
    tiles: a row statistic's ``(1, 197)``)."""

    def __init__(self, ref, h: int):
        self.ref, self.h = ref, h

    @property
    def shape(self):
        return self.ref.shape[1:]

    @property
    def dtype(self):
        return self.ref.dtype

    def __getitem__(self, index):
        return self.ref[(self.h, *(index if isinstance(index, tuple) else (index,)))]

    def __setitem__(self, index, value):
        self.ref[(self.h, *(index if isinstance(index, tuple) else (index,)))] = value


def _over_planes(body, static: _Static, has_bias: bool):
    """:func:`over_planes` of the attention kernels, whose inputs are the key data, query, key,
    value and mask (a key, value or mask plane the step's planes may share)."""
    planes = static.blocks.planes
    return over_planes(body, static, [False, planes > 1, static.kv_blocked, static.kv_blocked]
                       + ([static.bias_blocked] if has_bias else []))


def over_planes(body, static: _Static, inputs_blocked):
    """The kernel of a grid step over ``static.blocks.planes`` planes: ``body`` once per plane on
    its plane of each block, with ``plane`` the plane's flat batch index. ``inputs_blocked``:
    for each input ref, whether it has a block of the step's planes (else the step's planes
    share it as it is: the key data, a shared mask); the refs after them, the step's outputs
    and scratch, are all per plane."""
    planes = static.blocks.planes
    inputs = list(inputs_blocked)

    def kernel(*refs):
        first = pl.program_id(0) * planes
        per_plane = inputs + [planes > 1] * (len(refs) - len(inputs))
        for h in range(planes):
            body(*[_PlaneRef(ref, h) if split else ref for ref, split in zip(refs, per_plane)], plane=first + h)
    return kernel


def _score_block(static: _Static, q, k, bias_ref, q_index, kv_index):
    """The (q, kv) block of scaled scores, float32, ``-inf`` where masked out (causal, padded
    keys, the bias's ``-inf``)."""
    problem, blocks = static.problem, static.blocks
    # q @ k.T, with the key given as its transpose (the kernels' k.T) where it is not.
    s = matmul(q, k, not static.key_transposed) * np.float32(static.scale)
    if bias_ref is not None:
        s = s + bias_ref[...].astype(jnp.float32)
    shape = (blocks.q, blocks.kv)
    valid = None
    if static.causal or problem.S % blocks.kv:
        cols = lax.broadcasted_iota(jnp.int32, shape, 1) + kv_index * blocks.kv
        if problem.S % blocks.kv:
            valid = cols < problem.S
        if static.causal:
            rows = lax.broadcasted_iota(jnp.int32, shape, 0) + q_index * blocks.q
            causal = cols <= rows
            valid = causal if valid is None else valid & causal
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    return s


def _global_plane(static: _Static, noise_ref, b):
    """The flat batch index in the whole tensor of this kernel's batch element ``b``: ``b``
    itself, or in a shard the index of its place in the whole batch dims from the shard's
    first plane (``noise_ref[3]``, data: one compiled kernel serves every shard)."""
    if static.global_batch is None:
        return b
    local = static.problem.batch
    global_strides = [math.prod(static.global_batch[d + 1:]) for d in range(len(local))]
    plane, inner = noise_ref[3], math.prod(local)
    for size, stride in zip(local, global_strides):
        inner //= size
        if size > 1:
            plane = plane + b // inner % size * stride
    return plane


def kept_weights(static: _Static, key_ref, b, q_index, kv_index):
    """bool (q, kv): which weights of the block dropout keeps. The kernels select with it and
    apply ``1 / (1 - p)`` once per row (:func:`kept_scale`), not per weight."""
    problem, blocks = static.problem, static.blocks
    row0, col0 = q_index * blocks.q, kv_index * blocks.kv
    b = _global_plane(static, key_ref, b)
    if static.impl == prng.THREEFRY:
        b = lax.convert_element_type(b, jnp.uint32)
        base = prng.multiply_wide(b, problem.L * problem.S) if static.wide else b * np.uint32(problem.L * problem.S % 2**32)
        bits = prng.chunk_bits(prng.THREEFRY, key_ref, (blocks.q, blocks.kv), row0, col0, problem.S, base,
                               static.wide)
    else:
        tile = static.tile
        tiles_per_row = pl.cdiv(problem.S, tile[1])
        tiles_per_plane = pl.cdiv(problem.L, tile[0]) * tiles_per_row
        first = b * tiles_per_plane + row0 // tile[0] * tiles_per_row + col0 // tile[1]
        rows = []
        for tile_row in range(pl.cdiv(blocks.q, tile[0])):
            row = [prng.tile_bits(static.impl, key_ref, first + tile_row * tiles_per_row + tile_col, tile,
                                  prng.DROPOUT_BITS)
                   for tile_col in range(pl.cdiv(blocks.kv, tile[1]))]
            rows.append(row[0] if len(row) == 1 else jnp.concatenate(row, axis=1))
        bits = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)
        if bits.shape != (blocks.q, blocks.kv):  # a block of the whole length: its last tiles cut
            bits = bits[:blocks.q, :blocks.kv]
    return prng.kept(static.impl, bits, prng.keep_probability(static.impl, static.dropout_p))


def kept_scale(impl: str, dropout_p: float) -> np.float32:
    """The factor of a kept weight, one over :func:`prng.keep_fraction` (``1 / (1 - p)`` but
    for the tiled impl's rounding of ``p``); 0 where that keeps nothing."""
    keep = prng.keep_fraction(impl, dropout_p)
    return np.float32(1.0 / keep if keep > 0 else 0.0)


def _runs(static: _Static, q_index, kv_index):
    """Whether a (q, kv) block has any unmasked causal element: ``kv0 <= last row``."""
    if not static.causal:
        return True
    return kv_index * static.blocks.kv <= q_index * static.blocks.q + static.blocks.q - 1


def _last_needed_kv_block(static: _Static, q_index):
    return (q_index * static.blocks.q + static.blocks.q - 1) // static.blocks.kv


def _forward_kernel(key_ref, q_ref, k_ref, v_ref, *refs, static: _Static, has_bias: bool, plane):
    bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    out_ref, lse_ref, max_ref, sum_ref, acc_ref = refs
    b, q_index, kv_index = plane, pl.program_id(1), pl.program_id(2)
    if static.S_padded == static.blocks.kv:
        _whole_rows_forward(key_ref, q_ref, k_ref, v_ref, bias_ref, out_ref, lse_ref, static, b, q_index)
        return

    @pl.when(kv_index == 0)
    def _():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(_runs(static, q_index, kv_index))
    def _():
        s = _score_block(static, q_ref[...], k_ref[...], bias_ref, q_index, kv_index)
        # The row statistics stay (q, ROW_STAT_LANES) with every lane the row's value (see _lanes).
        previous_max = max_ref[...]
        new_max = jnp.maximum(previous_max, jnp.max(s, axis=1, keepdims=True))
        shift = _shift(new_max)
        p = jnp.exp(s - _lanes(shift, static.blocks.kv))
        correction = jnp.exp(previous_max - shift)
        sum_ref[...] = correction * sum_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        max_ref[...] = new_max
        if static.dropout_p:
            p = jnp.where(kept_weights(static, key_ref, b, q_index, kv_index), p, np.float32(0.0))
        v = v_ref[...]
        acc_ref[...] = (_lanes(correction, static.problem.Ev) * acc_ref[...]
                        + matmul(p.astype(v.dtype), v, static.value_transposed))

    @pl.when(kv_index == pl.num_programs(2) - 1)
    def _():
        inverse, lse = _normaliser(static, sum_ref[...], max_ref[...])
        out_ref[...] = (acc_ref[...] * _lanes(inverse, static.problem.Ev)).astype(out_ref.dtype)
        lse_ref[...] = row_stat_row(lse)


def _shift(row_max):
    """What a row's exponentials subtract: its maximum, or 0 for a row with no score above -inf,
    so that its exponentials are 0, not NaN."""
    return jnp.where(row_max == -jnp.inf, np.float32(0.0), row_max)


def _normaliser(static: _Static, total, row_max):
    """Each row's factor, the kept weights' ``1 / (1 - p)`` over its sum of exponentials ``total``
    (once per row, not per weight), and its log-sum-exp given its maximum: torch's safe softmax,
    a row with every score -inf attends to nothing (factor over 1, log-sum-exp ``inf``)."""
    empty = total == 0.0
    safe_total = jnp.where(empty, np.float32(1.0), total)
    inverse = (kept_scale(static.impl, static.dropout_p) if static.dropout_p else np.float32(1.0)) / safe_total
    return inverse, jnp.where(empty, jnp.inf, row_max + jnp.log(safe_total))


def _whole_rows_forward(key_ref, q_ref, k_ref, v_ref, bias_ref, out_ref, lse_ref, static: _Static, b, q_index):
    """The forward kernel where one block holds every key: the softmax of whole rows, without the
    running statistics and their corrections, which a single step does not need (128 keys: about
    a sixth of the kernel's bundles)."""
    s = _score_block(static, q_ref[...], k_ref[...], bias_ref, q_index, 0)
    p, inverse, lse = whole_rows_softmax(static, s, lambda: kept_weights(static, key_ref, b, q_index, 0))
    v = v_ref[...]
    out_ref[...] = (matmul(p.astype(v.dtype), v, static.value_transposed) * inverse).astype(out_ref.dtype)
    lse_ref[...] = row_stat_row(lse)


def whole_rows_softmax(static: _Static, s, kept):
    """Whole rows of scores ``s`` (float32, ``-inf`` where masked) as ``(weights, inverse, lse)``:
    the exponentials shifted by each row's maximum, dropped where ``kept()`` is False; each row's
    factor, the kept weights' ``1 / (1 - p)`` over the row's sum (torch's safe softmax: a row with
    nothing to attend to gives zeros); and the row's log-sum-exp, ``inf`` for such a row. Columns
    ``(rows, 1)``."""
    shift = _shift(jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - shift)
    total = jnp.sum(p, axis=1, keepdims=True)
    if static.dropout_p:
        p = jnp.where(kept(), p, np.float32(0.0))
    return (p, *_normaliser(static, total, shift))


def row_stat_row(row_stat):
    """A row statistic, a (rows, 1) column or (rows, ROW_STAT_LANES) with every lane the row's
    value, as the (1, rows) row :func:`_row_stat_spec` writes (one transpose of a vreg column)."""
    return jnp.broadcast_to(row_stat, (row_stat.shape[0], ROW_STAT_LANES)).T[:1]


def _lanes(row_stat, cols):
    """A (rows, ROW_STAT_LANES) row statistic whose lanes all hold the row's value, as (rows, cols).
    Repeating whole vregs (or taking their first lanes) keeps the values where they are; broadcasting
    a (rows, 1) column costs a cross-lane permute per vreg of rows, which the kernels' steps would
    otherwise spend on every score block."""
    if cols % ROW_STAT_LANES == 0:
        return compat.repeat(row_stat, cols // ROW_STAT_LANES, axis=1)
    if cols < ROW_STAT_LANES:
        return row_stat[:, :cols]
    # A block of a whole length that is not whole vregs (ViT's 197 keys): whole vregs, then their
    # first lanes.
    return compat.repeat(row_stat, pl.cdiv(cols, ROW_STAT_LANES), axis=1)[:, :cols]


def padded(array, axis, length):
    if array.shape[axis] == length:
        return array
    padding = [(0, 0)] * array.ndim
    padding[axis] = (0, length - array.shape[axis])
    return jnp.pad(array, padding)


def flatten(array):
    """``array`` (*batch', rows, cols) as (prod(batch'), rows, cols)."""
    return array.reshape(-1, *array.shape[-2:])


def additive_mask(bias, dtype):
    """An attention mask as the kernels add it to the scores: a boolean one (True takes part) as 0 /
    -inf in ``dtype``, a float one as it is."""
    if bias.dtype == jnp.bool_:
        return jnp.where(bias, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
    return bias


def _kernel_operands(query, key, value, bias, static: _Static, L_padded: int):
    """query (broadcast to the output's batch), key, value and the bias as the kernels read
    them: flat batch, lengths padded to whole blocks, key and value planes transposed where
    :attr:`_Static.key_transposed` / ``value_transposed``; the bias with a boolean mask as 0 /
    -inf in query's dtype, its key dim broadcast (padded keys are masked in the kernels)."""
    problem, S_padded = static.problem, static.S_padded
    q = padded(flatten(jnp.broadcast_to(query, (*problem.batch, problem.L, problem.E))), 1, L_padded)
    k = planes_as_read(padded(flatten(key), 1, S_padded), static.key_transposed)
    v = planes_as_read(padded(flatten(value), 1, S_padded), static.value_transposed)
    if bias is not None:
        bias = additive_mask(bias, query.dtype)
        bias = bias.reshape((1,) * max(0, 2 - bias.ndim) + bias.shape)
        bias = padded(flatten(jnp.broadcast_to(bias, (*bias.shape[:-1], problem.S))), 2, S_padded)
        if problem.bias_rows != 1:
            bias = padded(bias, 1, L_padded)
    return q, k, v, bias


def _widened(*arrays):
    """:func:`tiling.widen_float16` of the float operands; a boolean mask as it is."""
    return tuple(array if array is None or array.dtype == jnp.bool_ else tiling.widen_float16(array)[0]
                 for array in arrays)


def compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _specs(static: _Static, has_bias: bool, kv_major: bool):
    """BlockSpecs of (key data, q, k, v, bias) for a grid (b, q block, kv block), or
    (b, kv block, q block) with ``kv_major``."""
    problem, blocks = static.problem, static.blocks

    def ordered(function):
        if kv_major:
            return lambda b, kv_index, q_index: function(b, q_index, kv_index)
        return function

    def kv_block(q_index, kv_index):
        # Causal blocks past the diagonal are skipped: keep fetching the last one needed, so
        # no copy starts for them.
        if static.causal and not kv_major:
            return jnp.minimum(kv_index, _last_needed_kv_block(static, q_index))
        return kv_index

    def q_block(q_index, kv_index):
        if static.causal and kv_major:
            # The first query block that sees this key block.
            first = kv_index * blocks.kv // blocks.q
            return jnp.maximum(q_index, first)
        return q_index

    def operand_plane(layout, blocked):
        """The leading block dim and the block index of an operand's planes for grid step ``b``."""
        if blocked:
            return static.plane_dim, lambda b: layout.index(problem.batch, b * blocks.planes) // blocks.planes
        return None, lambda b: layout.index(problem.batch, b * blocks.planes)

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    q_spec = pl.BlockSpec((static.plane_dim, blocks.q, problem.E), ordered(lambda b, i, j: (b, q_block(i, j), 0)))
    kv_dim, kv_plane = operand_plane(problem.kv_layout, static.kv_blocked)
    kv_index = ordered(lambda b, i, j: (kv_plane(b), kv_block(i, j)))
    specs = [smem, q_spec, plane_spec(kv_dim, blocks.kv, problem.E, static.key_transposed, kv_index),
             plane_spec(kv_dim, blocks.kv, problem.Ev, static.value_transposed, kv_index)]
    if has_bias:
        rows = blocks.q if problem.bias_rows != 1 else 1
        bias_dim, bias_plane = operand_plane(problem.bias_layout, static.bias_blocked)
        specs.append(pl.BlockSpec(
            (bias_dim, rows, blocks.kv),
            ordered(lambda b, i, j: (bias_plane(b), q_block(i, j) if rows != 1 else 0, kv_block(i, j)))))
    return specs, ordered, q_block


def _operands_fetched(walk: BlockWalk, q, k, v, bias, *, kv_major: bool, grad_out=None) -> int:
    """Bytes the BlockSpecs of :func:`_specs` move over ``walk``'s grid, and with ``grad_out`` those
    of the backward kernels' per-row operands (the output's gradient, the log-sum-exp and
    ``delta``, one float32 per row each): the query's and the rows' blocks follow the q axis, the
    key's and value's the kv axis, a mask's both (a mask of one row: the kv axis)."""
    static, problem, blocks = walk.static, walk.static.problem, walk.static.blocks
    q_axis, kv_axis = ("inner", "outer") if kv_major else ("outer", "inner")
    row_bytes = static.block_bytes(blocks.q, problem.E, q.dtype)
    if grad_out is not None:
        row_bytes += (static.block_bytes(blocks.q, problem.Ev, grad_out.dtype)
                      + 2 * static.block_bytes(1, blocks.q, jnp.float32))
    total = walk.fetched(row_bytes, q_axis)
    total += walk.fetched(static.block_bytes(blocks.kv, problem.E + problem.Ev, k.dtype, static.kv_blocked), kv_axis)
    if bias is not None:
        rows = blocks.q if problem.bias_rows != 1 else 1
        total += walk.fetched(static.block_bytes(rows, blocks.kv, bias.dtype, static.bias_blocked),
                              "both" if rows != 1 else kv_axis)
    return total


def noise_words(key_data, impl, shard_offset):
    """The kernels' SMEM words: the key (for the hardware PRNG ``to_pallas_key``'s), then for a
    shard the [high, low] words of its first plane's flat batch index."""
    key = prng.key_words(key_data, impl)
    return key if shard_offset is None else jnp.concatenate([key, shard_offset.reshape(2).astype(jnp.int32)])


def resolve_static(problem, blocks, *, dropout_p, impl, causal, scale, interpret, backward, global_shape,
                   max_planes=MAX_PLANES):
    # Without dropout nothing is drawn, so no impl's tiles constrain the blocks.
    blocks = resolve_blocks(blocks, problem, impl=impl if dropout_p > 0 else prng.THREEFRY, interpret=interpret,
                            backward=backward, max_planes=max_planes)
    global_batch = None if global_shape is None else tuple(global_shape[:-2])
    total_planes = problem.size if global_batch is None else math.prod(global_batch)
    wide = impl == prng.THREEFRY and total_planes * problem.L * problem.S > 2**32
    return _Static(problem, blocks, float(dropout_p), impl, bool(causal), float(scale), wide, global_batch)


def _heads_in_lanes():
    """:mod:`heads_in_lanes`, imported when first used: it builds on this module."""
    from torch_pallas.kernels import heads_in_lanes
    return heads_in_lanes


def _check_options(dropout_p, impl, interpret):
    dropout_p = arguments.check_probability(dropout_p, "dropout_p")
    prng.check_can_run(impl, interpret)
    return dropout_p


def attention_forward(key_data, query, key, value, bias=None, *, dropout_p: float = 0.0,
                      impl: str = prng.DROPOUT_DEFAULT, causal: bool = False, scale: float | None = None,
                      gqa: bool = False, interpret: bool, blocks: AttentionBlocks | None = None,
                      global_shape=None, shard_offset=None, result_dtype=None):
    """The attention output and the float32 row log-sum-exp ``(*batch, L)`` (``inf`` for a
    row that attends to nothing) the backward pass needs; see the module docstring.

    Args:
        key_data: int32 (2,) threefry key words; unused when ``dropout_p == 0``.
        query, key, value: ``(*batch, L, E)``, ``(*batch', S, E)``, ``(*batch', S, Ev)``, one
            float dtype (float32, bfloat16, float16).
        bias: optional additive float mask, or a boolean mask (True takes part), broadcastable
            to ``(*batch, L, S)``.
        dropout_p: probability of dropping an attention weight, in [0, 1).
        impl: ``"threefry"``, ``"tiled"`` or ``"hardware"`` (compiled on TPU only).
        causal: keep only ``s <= l``; no ``bias`` with it.
        scale: the scores' factor; default ``1 / sqrt(E)``.
        gqa: repeat the key's and value's heads (dim -3) to the query's.
        interpret: run Pallas in interpret mode (any platform) or compiled (TPU).
        blocks: the forward kernel's :class:`AttentionBlocks` (default per platform).
        global_shape, shard_offset: the operands are one shard of tensors whose batch dims
            are ``global_shape[:-2]`` (``global_shape`` is ``(*batch, 1, 1)``: the SPMD layer
            passes the sharding's rank), split along batch dims only; ``shard_offset``, int32
            ``(2,)`` ``[high, low]``, is the flat batch index of the shard's first element.
            Each shard draws its part of the whole tensor's mask.
        result_dtype: the output's dtype (default query's): float32 for bfloat16 operands
            rounded from float32 ones (the ops' ``bfloat16_operands``).

    Returns:
        ``(output (*batch, L, Ev) in result_dtype, log-sum-exp (*batch, L) float32)``.
    """
    dropout_p = _check_options(dropout_p, impl, interpret)
    result_dtype = query.dtype if result_dtype is None else jnp.dtype(result_dtype)
    problem = resolve_problem(query.shape, key.shape, value.shape, None if bias is None else bias.shape, gqa=gqa)
    scale = 1.0 / math.sqrt(problem.E) if scale is None else scale
    if query.dtype == jnp.float16:
        out, lse = attention_forward(key_data, *_widened(query, key, value, bias), dropout_p=dropout_p, impl=impl,
                                     causal=causal, scale=scale, gqa=gqa, interpret=interpret, blocks=blocks,
                                     global_shape=global_shape, shard_offset=shard_offset)
        return out.astype(query.dtype), lse
    if _heads_in_lanes().takes(query.shape, key.shape, value.shape, bias=bias, gqa=gqa, blocks=blocks,
                               global_shape=global_shape, causal=causal):
        return _heads_in_lanes().forward(key_data, query, key, value, bias, dropout_p=dropout_p, impl=impl,
                                         causal=causal, scale=scale, interpret=interpret, result_dtype=result_dtype)
    static = resolve_static(problem, blocks, dropout_p=dropout_p, impl=impl, causal=causal, scale=scale,
                     interpret=interpret, backward=False, global_shape=global_shape)
    blocks = static.blocks
    L_padded, S_padded = tiling.round_up(problem.L, blocks.q), static.S_padded
    q, k, v, bias = _kernel_operands(query, key, value, bias, static, L_padded)
    specs, _, _ = _specs(static, bias is not None, kv_major=False)
    grid = (static.grid_planes, L_padded // blocks.q, S_padded // blocks.kv)
    out_index = lambda b, i, j: (b, i, 0)  # noqa: E731
    words = noise_words(key_data, impl, shard_offset)
    out_shape = [jax.ShapeDtypeStruct((problem.size, L_padded, problem.Ev), result_dtype),
                 jax.ShapeDtypeStruct((problem.size, L_padded // blocks.q, 1, blocks.q), jnp.float32)]
    walk = BlockWalk.of(static, *grid[1:], kv_major=False)
    out, lse = calls.pallas_call(
        _over_planes(functools.partial(_forward_kernel, static=static, has_bias=bias is not None), static,
                     bias is not None),
        name=static.kernel_name("attention", "fwd"),
        cost_estimate=walk.cost(
            bytes_accessed=_operands_fetched(walk, q, k, v, bias, kv_major=False) + calls.nbytes(words, *out_shape),
            matmul_lanes=problem.E + problem.Ev),
        grid=grid,
        in_specs=specs,
        out_specs=[pl.BlockSpec((static.plane_dim, blocks.q, problem.Ev), out_index),
                   _row_stat_spec(static, lambda b, i, j: (b, i, 0, 0))],
        out_shape=out_shape,
        scratch_shapes=[static.scratch(blocks.q, ROW_STAT_LANES), static.scratch(blocks.q, ROW_STAT_LANES),
                        static.scratch(blocks.q, problem.Ev)],
        compiler_params=compiler_params(),
        interpret=interpret,
    )(*[words, q, k, v, *([] if bias is None else [bias])])
    out = out[:, :problem.L].reshape(*problem.batch, problem.L, problem.Ev)
    # One barrier for both outputs makes XLA take the log-sum-exp out of the kernel's (1, q) rows
    # (8 sublanes each in HBM) when the forward pass reads the output: left to itself it
    # schedules the slice just before the backward's reader and keeps the padded rows alive in
    # between.
    lse = lse.reshape(problem.size, L_padded)[:, :problem.L]
    return lax.optimization_barrier((out, lse.reshape(*problem.batch, problem.L)))


def _column(row_stat_ref):
    """A (1, q) block of a row statistic (:func:`_row_stat_spec`) as a (q, 1) column, which the
    score block's arithmetic broadcasts over its lanes (libtpu 0.0.21's Mosaic lowers that
    implicit broadcast, not an explicit ``broadcast_to`` of the column)."""
    return jnp.expand_dims(row_stat_ref[0], -1)


def _row_stat_spec(static: _Static, index_map):
    """The BlockSpec of a row statistic laid out ``(batch, q blocks, 1, q)``: one value per row,
    each plane's block a whole (1, q) array, which Mosaic takes for every ``q``."""
    return pl.BlockSpec((static.plane_dim, None, 1, static.blocks.q), index_map)


def _probabilities(s, lse):
    # lse is inf for rows that attend to nothing (and padded rows): their weights are 0.
    return jnp.exp(s - lse)


def _key_value_kernel(key_ref, q_ref, k_ref, v_ref, *refs, static: _Static, has_bias: bool, with_query: bool,
                      bias_grad: bool, plane):
    """The key's and value's gradients, accumulated over the blocks of query rows (the grid's
    innermost axis). ``with_query``, when one block holds every key: the query's gradient (and
    with ``bias_grad`` the bias's) of each block of rows too, whole in that one step."""
    bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    grad_out_ref, lse_ref, delta_ref, grad_k_ref, grad_v_ref, *refs = refs
    grad_q_ref, refs = (refs[0], refs[1:]) if with_query else (None, refs)
    grad_bias_ref, refs = (refs[0], refs[1:]) if bias_grad else (None, refs)
    grad_k_acc, grad_v_acc = refs
    b, kv_index, q_index = plane, pl.program_id(1), pl.program_id(2)
    # One block of rows: a step sees every row, so it writes its key and value gradients whole,
    # without accumulating them in scratch.
    whole_columns = tiling.round_up(static.problem.L, static.blocks.q) == static.blocks.q
    runs = _runs(static, q_index, kv_index)

    if whole_columns and static.causal:
        @pl.when(jnp.logical_not(runs))
        def _():
            grad_k_ref[...] = jnp.zeros(grad_k_ref.shape, grad_k_ref.dtype)
            grad_v_ref[...] = jnp.zeros(grad_v_ref.shape, grad_v_ref.dtype)

    if not whole_columns:
        @pl.when(q_index == 0)
        def _():
            grad_k_acc[...] = jnp.zeros(grad_k_acc.shape, jnp.float32)
            grad_v_acc[...] = jnp.zeros(grad_v_acc.shape, jnp.float32)

    @pl.when(runs)
    def _():
        q, k, grad_out = q_ref[...], k_ref[...], grad_out_ref[...]
        s = _score_block(static, q, k, bias_ref, q_index, kv_index)
        p = _probabilities(s, _column(lse_ref))
        v = v_ref[...]
        # grad_out arrives multiplied by 1 / (1 - p) (attention_backward): the kept weights'
        # factor is in it, so a dropped weight is a select.
        grad_p = matmul(grad_out, v, not static.value_transposed)
        dropped = p
        if static.dropout_p:
            kept = kept_weights(static, key_ref, b, q_index, kv_index)
            dropped = jnp.where(kept, p, np.float32(0.0))
            grad_p = jnp.where(kept, grad_p, np.float32(0.0))
        grad_v = jnp.dot(dropped.T.astype(grad_out.dtype), grad_out, preferred_element_type=jnp.float32)
        grad_s = p * (grad_p - _column(delta_ref))
        grad_k = jnp.dot(grad_s.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
        if whole_columns:
            grad_k_ref[...] = (grad_k * np.float32(static.scale)).astype(grad_k_ref.dtype)
            grad_v_ref[...] = grad_v.astype(grad_v_ref.dtype)
        else:
            grad_k_acc[...] += grad_k
            grad_v_acc[...] += grad_v
        if with_query:
            grad_q_ref[...] = (matmul(grad_s.astype(k.dtype), k, static.key_transposed)
                               * np.float32(static.scale)).astype(grad_q_ref.dtype)
            if bias_grad:
                grad_bias_ref[...] = grad_s

    if not whole_columns:
        @pl.when(q_index == pl.num_programs(2) - 1)
        def _():
            grad_k_ref[...] = (grad_k_acc[...] * np.float32(static.scale)).astype(grad_k_ref.dtype)
            grad_v_ref[...] = grad_v_acc[...].astype(grad_v_ref.dtype)


def _query_kernel(key_ref, q_ref, k_ref, v_ref, *refs, static: _Static, has_bias: bool, bias_grad: bool, plane):
    bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    grad_out_ref, lse_ref, delta_ref, grad_q_ref, *refs = refs
    grad_bias_ref, grad_q_acc = refs if bias_grad else (None, refs[0])
    b, q_index, kv_index = plane, pl.program_id(1), pl.program_id(2)

    @pl.when(kv_index == 0)
    def _():
        grad_q_acc[...] = jnp.zeros(grad_q_acc.shape, jnp.float32)

    runs = _runs(static, q_index, kv_index)

    @pl.when(runs)
    def _():
        k = k_ref[...]
        s = _score_block(static, q_ref[...], k, bias_ref, q_index, kv_index)
        p = _probabilities(s, _column(lse_ref))
        grad_p = matmul(grad_out_ref[...], v_ref[...], not static.value_transposed)
        if static.dropout_p:
            grad_p = jnp.where(kept_weights(static, key_ref, b, q_index, kv_index), grad_p, np.float32(0.0))
        grad_s = p * (grad_p - _column(delta_ref))
        if bias_grad:
            grad_bias_ref[...] = grad_s
        grad_q_acc[...] += matmul(grad_s.astype(k.dtype), k, static.key_transposed)

    if bias_grad:
        @pl.when(jnp.logical_not(runs))
        def _():
            grad_bias_ref[...] = jnp.zeros(grad_bias_ref.shape, jnp.float32)

    @pl.when(kv_index == pl.num_programs(2) - 1)
    def _():
        grad_q_ref[...] = (grad_q_acc[...] * np.float32(static.scale)).astype(grad_q_ref.dtype)


def _query_gradients(static: _Static, operands, has_bias, bias_grad, dtype, L_padded, S_padded, interpret):
    """The query kernel's outputs: the query's gradient, and with ``bias_grad`` the bias's."""
    problem, blocks = static.problem, static.blocks
    specs, _, _ = _specs(static, has_bias, kv_major=False)
    row_spec = lambda lanes: pl.BlockSpec((static.plane_dim, blocks.q, lanes), lambda b, i, j: (b, i, 0))  # noqa: E731
    row_stat = _row_stat_spec(static, lambda b, i, j: (b, i, 0, 0))
    out_specs = [row_spec(problem.E)]
    out_shape = [jax.ShapeDtypeStruct((problem.size, L_padded, problem.E), dtype)]
    if bias_grad:
        out_specs.append(pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv), lambda b, i, j: (b, i, j)))
        out_shape.append(jax.ShapeDtypeStruct((problem.size, L_padded, S_padded), jnp.float32))
    grid = (static.grid_planes, L_padded // blocks.q, S_padded // blocks.kv)
    walk = BlockWalk.of(static, *grid[1:], kv_major=False)
    words, q, k, v, *bias, grad_out, _, _ = operands
    return calls.pallas_call(
        _over_planes(functools.partial(_query_kernel, static=static, has_bias=has_bias, bias_grad=bias_grad), static,
                     has_bias),
        name=static.kernel_name("attention", "dq"),
        cost_estimate=walk.cost(
            bytes_accessed=_operands_fetched(walk, q, k, v, bias[0] if bias else None, kv_major=False,
                                             grad_out=grad_out)
            + calls.nbytes(words, *out_shape),
            matmul_lanes=2 * problem.E + problem.Ev),
        grid=grid,
        in_specs=[*specs, row_spec(problem.Ev), row_stat, row_stat],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[static.scratch(blocks.q, problem.E)],
        compiler_params=compiler_params(),
        interpret=interpret,
    )(*operands)


def _sum_to(grad, shape):
    """A gradient computed per element of the broadcast output summed to an operand's
    ``shape``: over the leading dims it lacks, its dims of size 1, and a dim repeated in
    groups (GQA's heads: ``repeat_interleave``, so each of its ``n`` entries owns
    ``size // n`` consecutive ones)."""
    shape = tuple(shape)
    padded = (1,) * (grad.ndim - len(shape)) + shape
    if padded == grad.shape:
        return grad.reshape(shape)
    grouped = [part for size, own in zip(grad.shape, padded) for part in (own, size // own)]
    return grad.reshape(grouped).sum(axis=tuple(range(1, 2 * grad.ndim, 2))).reshape(shape)


def attention_backward(key_data, query, key, value, out, lse, grad_out, bias=None, *, dropout_p: float = 0.0,
                       impl: str = prng.DROPOUT_DEFAULT, causal: bool = False, scale: float | None = None,
                       gqa: bool = False, interpret: bool, blocks: AttentionBlocks | None = None,
                       bias_grad: bool = False, global_shape=None, shard_offset=None):
    """Gradients of :func:`attention_forward`'s output with respect to query, key and value
    (and, with ``bias_grad``, the float bias, summed to its shape), given the forward's
    ``out`` and ``lse`` and the same options. ``blocks`` are the backward kernels' own,
    independent of the forward's: the mask is regenerated, not read.

    Returns:
        ``(grad_query, grad_key, grad_value)`` in ``grad_out``'s dtype (the forward's
        ``result_dtype``), plus ``grad_bias`` in the bias's with ``bias_grad``.
    """
    dropout_p = _check_options(dropout_p, impl, interpret)
    problem = resolve_problem(query.shape, key.shape, value.shape, None if bias is None else bias.shape, gqa=gqa)
    scale = 1.0 / math.sqrt(problem.E) if scale is None else scale
    options = dict(dropout_p=dropout_p, impl=impl, causal=causal, scale=scale, gqa=gqa, interpret=interpret,
                   blocks=blocks, bias_grad=bias_grad, global_shape=global_shape, shard_offset=shard_offset)
    if query.dtype == jnp.float16:
        wide_query, wide_key, wide_value, wide_out, wide_grad_out, wide_bias = _widened(
            query, key, value, out, grad_out, bias)
        grads = attention_backward(key_data, wide_query, wide_key, wide_value, wide_out, lse, wide_grad_out, wide_bias,
                                   **options)
        return tuple(grad.astype(operand.dtype) for grad, operand in zip(grads, (query, key, value, bias)))
    if _heads_in_lanes().takes(query.shape, key.shape, value.shape, bias=bias, gqa=gqa, blocks=blocks,
                               global_shape=global_shape, causal=causal, bias_grad=bias_grad):
        return _heads_in_lanes().backward(key_data, query, key, value, out, lse, grad_out, bias, dropout_p=dropout_p,
                                          impl=impl, causal=causal, scale=scale, interpret=interpret)
    static = resolve_static(problem, blocks, dropout_p=dropout_p, impl=impl, causal=causal, scale=scale,
                     interpret=interpret, backward=True, global_shape=global_shape)
    blocks = static.blocks
    L_padded, S_padded = tiling.round_up(problem.L, blocks.q), static.S_padded
    rows = (problem.size, problem.L)

    def per_row(array):
        return padded(array.reshape(*rows, -1), 1, L_padded)

    q, k, v, prepared_bias = _kernel_operands(query, key, value, bias, static, L_padded)
    result_dtype = grad_out.dtype
    grad_out = per_row(grad_out).astype(jnp.float32)
    delta = jnp.sum(grad_out * per_row(out).astype(jnp.float32), axis=-1)
    # The kernels take the gradient times the kept weights' 1 / (1 - p) (see _key_value_kernel).
    grad_out = (grad_out * kept_scale(impl, dropout_p) if dropout_p else grad_out).astype(query.dtype)
    lse_rows = jnp.pad(lse.reshape(rows), ((0, 0), (0, L_padded - problem.L)), constant_values=jnp.inf)
    num_q, num_kv = L_padded // blocks.q, S_padded // blocks.kv
    lse_rows, delta = (stat.reshape(problem.size, num_q, 1, blocks.q) for stat in (lse_rows, delta))
    has_bias = prepared_bias is not None
    operands = [noise_words(key_data, impl, shard_offset), q, k, v, *([prepared_bias] if has_bias else []),
                grad_out, lse_rows, delta]

    specs, ordered, q_block = _specs(static, has_bias, kv_major=True)
    row_spec = lambda lanes: pl.BlockSpec((static.plane_dim, blocks.q, lanes),  # noqa: E731
                                          ordered(lambda b, i, j: (b, q_block(i, j), 0)))
    row_stat = _row_stat_spec(static, ordered(lambda b, i, j: (b, q_block(i, j), 0, 0)))
    per_key = lambda lanes: pl.BlockSpec((static.plane_dim, blocks.kv, lanes), lambda b, j, i: (b, j, 0))  # noqa: E731
    out_specs = [per_key(problem.E), per_key(problem.Ev)]
    out_shape = [jax.ShapeDtypeStruct((problem.size, S_padded, problem.E), jnp.float32),
                 jax.ShapeDtypeStruct((problem.size, S_padded, problem.Ev), jnp.float32)]
    # One block of keys: a block of rows sees every key in one step, so its query gradient is whole
    # there and the query kernel (which would recompute the probabilities and the mask) is not needed.
    with_query = num_kv == 1
    if with_query:
        out_specs.append(row_spec(problem.E))
        out_shape.append(jax.ShapeDtypeStruct((problem.size, L_padded, problem.E), result_dtype))
        if bias_grad:
            out_specs.append(pl.BlockSpec((static.plane_dim, blocks.q, blocks.kv),
                                          ordered(lambda b, i, j: (b, q_block(i, j), j))))
            out_shape.append(jax.ShapeDtypeStruct((problem.size, L_padded, S_padded), jnp.float32))
    walk = BlockWalk.of(static, num_kv, num_q, kv_major=True)
    grad_k, grad_v, *grads = calls.pallas_call(
        _over_planes(functools.partial(_key_value_kernel, static=static, has_bias=has_bias, with_query=with_query,
                                       bias_grad=with_query and bias_grad), static, has_bias),
        name=static.kernel_name("attention", "dqkv" if with_query else "dkv"),
        cost_estimate=walk.cost(
            bytes_accessed=_operands_fetched(walk, q, k, v, prepared_bias, kv_major=True, grad_out=grad_out)
            + calls.nbytes(operands[0], *out_shape),
            matmul_lanes=(3 if with_query else 2) * problem.E + 2 * problem.Ev, dropout_selects=2),
        grid=(static.grid_planes, num_kv, num_q),
        in_specs=[*specs, row_spec(problem.Ev), row_stat, row_stat],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[static.scratch(blocks.kv, problem.E), static.scratch(blocks.kv, problem.Ev)],
        compiler_params=compiler_params(),
        interpret=interpret,
    )(*operands)
    if not with_query:
        grads = _query_gradients(static, operands, has_bias, bias_grad, result_dtype, L_padded, S_padded, interpret)

    grad_q = _sum_to(grads[0][:, :problem.L].reshape(*problem.batch, problem.L, problem.E), query.shape)
    grad_k = _sum_to(grad_k[:, :problem.S].reshape(*problem.batch, problem.S, problem.E), key.shape)
    grad_v = _sum_to(grad_v[:, :problem.S].reshape(*problem.batch, problem.S, problem.Ev), value.shape)
    result = tuple(grad.astype(result_dtype) for grad in (grad_q, grad_k, grad_v))
    if bias_grad:
        grad_bias = grads[1][:, :problem.L, :problem.S].reshape(*problem.batch, problem.L, problem.S)
        result += (_sum_to(grad_bias, bias.shape).astype(bias.dtype),)
    return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def attention(key_data, query, key, value, bias, dropout_p=0.0, impl=prng.DROPOUT_DEFAULT, causal=False, scale=None,
              gqa=False, interpret=True, blocks=None, backward_blocks=None):
    """:func:`attention_forward`'s output, differentiable with ``jax.grad`` (query, key,
    value; a float bias too) through :func:`attention_backward` with ``backward_blocks``."""
    return attention_forward(key_data, query, key, value, bias, dropout_p=dropout_p, impl=impl, causal=causal,
                             scale=scale, gqa=gqa, interpret=interpret, blocks=blocks)[0]


def _attention_fwd(key_data, query, key, value, bias, dropout_p, impl, causal, scale, gqa, interpret, blocks,
                   backward_blocks):
    out, lse = attention_forward(key_data, query, key, value, bias, dropout_p=dropout_p, impl=impl, causal=causal,
                                 scale=scale, gqa=gqa, interpret=interpret, blocks=blocks)
    return out, (key_data, query, key, value, bias, out, lse)


def _attention_bwd(dropout_p, impl, causal, scale, gqa, interpret, blocks, backward_blocks, residuals, grad_out):
    key_data, query, key, value, bias, out, lse = residuals
    bias_grad = bias is not None and bias.dtype != jnp.bool_
    grads = attention_backward(key_data, query, key, value, out, lse, grad_out, bias, dropout_p=dropout_p,
                               impl=impl, causal=causal, scale=scale, gqa=gqa, interpret=interpret,
                               blocks=backward_blocks, bias_grad=bias_grad)
    grad_bias = grads[3] if bias_grad else None
    return (None, *grads[:3], grad_bias)


attention.defvjp(_attention_fwd, _attention_bwd)
